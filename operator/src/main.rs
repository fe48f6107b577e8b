//! `cosmosq-operator`: reconciles CosmosQueues and QueueConsumerGroups and scales their workers.
#![forbid(unsafe_code)]
// The controllers' futures (kube-runtime streams, hyper, `#[instrument]` spans) nest deeper
// than the default limit when their `Send` bound is checked.
#![recursion_limit = "256"]

use clap::Parser;
use cosmosq_operator::{config::Config, run};
use cosmosq_program::process::{self, Stopping};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let config = Config::parse();
    process::init_tracing();
    let grace = config.grace_period;
    let shutdown = CancellationToken::new();
    let stopping = Stopping {
        draining: "stopping: finishing reconciles, releasing the leader lease",
        grace_over: "grace period over; exiting",
        interrupted: "exiting at once; the next leader takes the work over",
    };
    process::run_until_signalled(
        run::run(config, shutdown.clone()),
        shutdown,
        grace,
        stopping,
    )
    .await
}
