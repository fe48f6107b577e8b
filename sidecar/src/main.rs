//! `cosmosq-sidecar`: runs next to the app in every worker pod.
#![forbid(unsafe_code)]

use clap::Parser;
use cosmosq_program::process::{self, Stopping};
use cosmosq_sidecar::{run, settings::SidecarSettings};
use tokio_util::sync::CancellationToken;
use tracing::error;

/// Workers the runtime starts, unless `TOKIO_WORKER_THREADS` says otherwise: a sidecar's
/// work is one pod's I/O, and each worker more is memory in every worker pod.
const WORKERS: usize = 2;

fn main() -> std::process::ExitCode {
    let settings = SidecarSettings::parse();
    process::block_on(WORKERS, serve(settings))
}

async fn serve(settings: SidecarSettings) -> std::process::ExitCode {
    process::init_tracing();
    if let Err(e) = settings.validate() {
        error!("{e}");
        eprintln!("{e}");
        return std::process::ExitCode::from(2);
    }
    let grace = settings.grace_period;
    let shutdown = CancellationToken::new();
    let stopping = Stopping {
        draining: "stopping: finishing in-flight work, then releasing leases",
        grace_over: "grace period over with work in flight: its locks expire and other pods \
                     deliver it again",
        interrupted: "exiting at once; in-flight messages are delivered again after their locks \
                      expire",
    };
    process::run_until_signalled(
        run::run(settings, shutdown.clone()),
        shutdown,
        grace,
        stopping,
    )
    .await
}
