//! The `capmox` binary: a thin CLI over the library.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = capmox::cli::Cli::parse();
    match capmox::cli::execute(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("capmox: {error}");
            ExitCode::FAILURE
        }
    }
}
