//! The flags page: every subcommand and flag of the `capmox` binary, from its clap definition.

use std::fmt::Write;

use clap::CommandFactory;

const INTRO: &str = "\
# Flags

The `capmox` binary's subcommands and flags, read from its command-line definition. The
Deployment of the release runs `capmox run --leader-elect` with the flags in
`config/manager/`; clusterctl variables of the same name as an environment variable below
(`CAPMOX_GLOBAL_CREDENTIALS_NAMESPACES`, ...) reach the manager through its environment.
Every listener takes `:PORT` (every address of both families; IPv4 alone where the host has no
IPv6), `IPv4:PORT` or `[IPv6]:PORT`; their limits are under
[Security](../operations/security.md#listener-limits).

Logs are text by default; `--log-format json` gives one JSON object per line, and `RUST_LOG` or
`--log-filter` select what is logged (e.g. `info,capmox=debug`). capmox's Kubernetes requests
carry `User-Agent: capmox/<version>`, so API server audit logs and the `managedFields` of its
writes that name no field manager say capmox.
";

fn flag_table(args: Vec<&clap::Arg>) -> String {
    let mut out = String::from("| flag | environment | default | meaning |\n|---|---|---|---|\n");
    for arg in args {
        let name = match arg.get_long() {
            Some(long) => format!("`--{long}`"),
            None => format!("`<{}>`", arg.get_id().as_str().to_uppercase()),
        };
        let env = arg
            .get_env()
            .map(|e| format!("`{}`", e.to_string_lossy()))
            .unwrap_or_default();
        let defaults: Vec<String> = arg
            .get_default_values()
            .iter()
            .map(|v| v.to_string_lossy().into_owned())
            .filter(|v| !v.is_empty())
            .map(|v| format!("`{v}`"))
            .collect();
        let mut meaning = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        if !meaning.is_empty() && !meaning.ends_with('.') {
            meaning.push('.');
        }
        let values: Vec<String> = arg
            .get_possible_values()
            .iter()
            .filter(|_| arg.get_action().takes_values())
            .map(|v| format!("`{}`", v.get_name()))
            .collect();
        if !values.is_empty() {
            meaning.push_str(&format!(" One of {}.", values.join(", ")));
        }
        // Writing to a String cannot fail.
        let _ = writeln!(
            out,
            "| {name} | {env} | {} | {} |",
            defaults.join(", "),
            super::cell(&meaning)
        );
    }
    out
}

pub(super) fn render() -> String {
    let command = crate::cli::Cli::command();
    let mut out = String::from(INTRO);
    let globals: Vec<&clap::Arg> = command.get_arguments().collect();
    out.push_str("\n## Every subcommand\n\n");
    out.push_str(&flag_table(globals));
    for sub in command.get_subcommands() {
        let about = sub.get_about().map(|a| a.to_string()).unwrap_or_default();
        let _ = write!(
            out,
            "\n## capmox {}\n\n{}.\n",
            sub.get_name(),
            super::one_line(&about)
        );
        let args: Vec<&clap::Arg> = sub.get_arguments().filter(|a| !a.is_hide_set()).collect();
        if !args.is_empty() {
            out.push('\n');
            out.push_str(&flag_table(args));
        }
    }
    out
}
