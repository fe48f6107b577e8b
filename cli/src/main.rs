//! `cosmosq`: the command for humans.
#![forbid(unsafe_code)]

mod args;
#[cfg(feature = "emulator")]
mod bench;
mod console;
#[cfg(feature = "emulator")]
mod demo;
mod dlq;
#[cfg(feature = "emulator")]
mod emulator;
mod enqueue;
mod inspect;
mod output;
#[cfg(feature = "emulator")]
mod seed;

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = args::Cli::parse();
    args::init_tracing(cli.verbose, cli.command.quiet_logs());
    match args::run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
