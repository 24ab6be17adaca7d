//! The `capmox` binary: a thin CLI over the library.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = capmox::cli::Cli::parse();
    capmox::cli::exit_status("capmox", capmox::cli::execute(cli))
}
