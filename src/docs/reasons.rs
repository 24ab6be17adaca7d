//! The troubleshooting page: every reason of [`crate::api::reasons::REASONS`], indexed by the
//! condition it appears in.

use std::collections::BTreeMap;
use std::fmt::Write;

use crate::api::reasons::{REASONS, Reason, Seen};

const INTRO: &str = "\
# Troubleshooting by reason

Every condition capmox writes has a reason, and so has every Event it publishes. This page lists
all of them: what each means and what to do. Start from what an object reports:

```sh
kubectl get proxmoxclusters,proxmoxmachines -A        # READY columns
kubectl describe proxmoxmachine NAME                   # conditions with reason and message, events
kubectl get events --field-selector involvedObject.name=NAME
```

The condition's message names the object, the step and, for Proxmox failures, Proxmox's own
answer. A Warning event with the same reason is published when a streak of failures starts, not
on every retry; how the retries are spaced is in [Outages](outages.md).
";

/// Where a reason is seen, as a page line.
fn seen(seen: &Seen) -> String {
    match seen {
        Seen::Condition {
            kind,
            condition,
            status,
        } if *condition == "any" => format!("{kind} conditions (any, status {status})"),
        Seen::Condition {
            kind,
            condition,
            status,
        } => format!("{kind} `{condition}={status}`"),
        Seen::Event { kind, type_ } => format!("{type_} Event on a {kind}"),
    }
}

/// The index: per object kind and condition (or events), the reasons with their status.
fn index() -> BTreeMap<(String, String), Vec<(String, &'static str)>> {
    let mut index: BTreeMap<(String, String), Vec<(String, &'static str)>> = BTreeMap::new();
    for reason in REASONS {
        for place in reason.seen {
            let (key, status) = match place {
                Seen::Condition {
                    kind,
                    condition,
                    status,
                } => (
                    (
                        (*kind).to_owned(),
                        if *condition == "any" {
                            "any condition".to_owned()
                        } else {
                            format!("`{condition}`")
                        },
                    ),
                    (*status).to_owned(),
                ),
                Seen::Event { kind, type_ } => (
                    ((*kind).to_owned(), "Events".to_owned()),
                    (*type_).to_owned(),
                ),
            };
            index.entry(key).or_default().push((status, reason.name));
        }
    }
    index
}

fn entry(out: &mut String, reason: &Reason) {
    let places: Vec<String> = reason.seen.iter().map(seen).collect();
    // Writing to a String cannot fail.
    let _ = write!(
        out,
        "\n### {}\n\nSeen on: {}.\n\n{}\n\nWhat to do: {}\n",
        reason.name,
        places.join("; "),
        super::cell(reason.meaning),
        super::cell(reason.action)
    );
}

pub(super) fn render() -> String {
    let mut out = String::from(INTRO);
    out.push_str("\n## By condition\n\n| object | condition | reasons |\n|---|---|---|\n");
    for ((kind, condition), reasons) in index() {
        let listed: Vec<String> = reasons
            .iter()
            .map(|(status, name)| format!("[{name}](#{}) ({status})", name.to_lowercase()))
            .collect();
        let _ = writeln!(out, "| {kind} | {condition} | {} |", listed.join(", "));
    }
    out.push_str("\n## Reasons\n");
    for reason in REASONS {
        entry(&mut out, reason);
    }
    out
}
