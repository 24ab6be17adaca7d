//! The `capmox` binary: a thin CLI over the library.

use std::process::ExitCode;

use clap::Parser;

/// glibc's allocator spent about a quarter of capmox's CPU on the small allocations of decoding
/// Kubernetes and Proxmox JSON (the book's performance page has the figures).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = capmox::cli::Cli::parse();
    capmox::cli::exit_status("capmox", capmox::cli::execute(cli))
}
