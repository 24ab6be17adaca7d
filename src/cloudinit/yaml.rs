//! YAML for cloud-init, which reads it with PyYAML (YAML 1.1): serde_norway writes YAML 1.2 and
//! leaves strings such as the QEMU MAC `52:54:00:12:34:56` (a base-60 integer in YAML 1.1) or a
//! VRF named `on` (a boolean) unquoted. Those strings are single-quoted here, and the result is
//! parsed back and compared with the document as a self-check.

use std::collections::BTreeSet;
use std::sync::LazyLock;

use regex::Regex;
use serde::Serialize;
use serde_norway::Value;

/// Plain scalars that YAML 1.1 (PyYAML's resolver) reads as something other than a string.
static YAML11_NON_STRING: LazyLock<Option<Regex>> = LazyLock::new(|| {
    Regex::new(concat!(
        r"^(?:",
        r"yes|Yes|YES|no|No|NO|true|True|TRUE|false|False|FALSE|on|On|ON|off|Off|OFF|y|Y|n|N",
        r"|~|null|Null|NULL|=|<<",
        r"|[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+",
        r"|[-+]?[1-9][0-9_]*(?::[0-5]?[0-9])+",
        r"|[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9_]+(?:[eE][-+][0-9]+)?",
        r"|[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)",
        r"|[0-9][0-9][0-9][0-9]-[0-9][0-9]?-[0-9][0-9]?(?:(?:[Tt]|[ \t]+).*)?",
        r")$"
    ))
    .ok()
});

fn ambiguous(s: &str) -> bool {
    // The pattern is a constant that compiles (tested); if it ever did not, quote nothing extra.
    YAML11_NON_STRING.as_ref().is_some_and(|re| re.is_match(s))
}

fn collect(v: &Value, out: &mut BTreeSet<String>) {
    match v {
        Value::String(s) if ambiguous(s) => {
            out.insert(s.clone());
        }
        Value::Sequence(items) => items.iter().for_each(|i| collect(i, out)),
        Value::Mapping(m) => {
            for (k, v) in m {
                collect(k, out);
                collect(v, out);
            }
        }
        Value::Tagged(t) => collect(&t.value, out),
        _ => {}
    }
}

fn quote_if(token: &str, risky: &BTreeSet<String>) -> String {
    if risky.contains(token) {
        format!("'{token}'")
    } else {
        token.to_owned()
    }
}

/// Block-style YAML of `doc` that YAML 1.1 and 1.2 readers both read as the same document.
pub(crate) fn to_string<T: Serialize>(doc: &T) -> Result<String, String> {
    let value = serde_norway::to_value(doc).map_err(|e| e.to_string())?;
    let text = serde_norway::to_string(&value).map_err(|e| e.to_string())?;
    let mut risky = BTreeSet::new();
    collect(&value, &mut risky);
    if risky.is_empty() {
        return Ok(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for line in text.lines() {
        let body = line.trim_start();
        let mut at = line.len() - body.len();
        while line[at..].starts_with("- ") {
            at += 2;
        }
        let (head, rest) = line.split_at(at);
        out.push_str(head);
        if let Some((k, v)) = rest.split_once(": ") {
            out.push_str(&quote_if(k, &risky));
            out.push_str(": ");
            out.push_str(&quote_if(v, &risky));
        } else if let Some(k) = rest.strip_suffix(':') {
            out.push_str(&quote_if(k, &risky));
            out.push(':');
        } else {
            out.push_str(&quote_if(rest, &risky));
        }
        out.push('\n');
    }
    let back: Value = serde_norway::from_str(&out).map_err(|e| e.to_string())?;
    if back != value {
        return Err("quoting for YAML 1.1 changed the document".to_owned());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_yaml11_pattern_compiles_and_matches_what_pyyaml_misreads() {
        assert!(YAML11_NON_STRING.is_some());
        for s in [
            "52:54:00:12:34:56",
            "1:2:3:4:5:6:7:8",
            "on",
            "yes",
            "0777",
            "1_000",
            "1.5",
        ] {
            assert!(ambiguous(s), "{s}");
        }
        for s in [
            "bc:24:11:00:00:01",
            "10.0.0.1",
            "2001:db8::1",
            "::/0",
            "eth0",
            "vrf-blue",
        ] {
            assert!(!ambiguous(s), "{s}");
        }
    }

    #[test]
    fn ambiguous_keys_and_values_are_quoted_and_nothing_else() {
        #[derive(Serialize)]
        struct Doc {
            mac: &'static str,
            list: Vec<&'static str>,
            map: std::collections::BTreeMap<&'static str, u32>,
            metric: u32,
        }
        let doc = Doc {
            mac: "52:54:00:12:34:56",
            list: vec!["1:2:3:4:5:6:7:8", "2001:db8::1"],
            map: [("on", 1), ("eth0", 2)].into_iter().collect(),
            metric: 200,
        };
        assert_eq!(
            to_string(&doc).expect("renders"),
            "mac: '52:54:00:12:34:56'\n\
             list:\n\
             - '1:2:3:4:5:6:7:8'\n\
             - 2001:db8::1\n\
             map:\n  \
               eth0: 2\n  \
               'on': 1\n\
             metric: 200\n"
        );
    }
}
