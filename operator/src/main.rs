//! `cosmosq-operator`: reconciles CosmosQueues and QueueConsumerGroups and scales their workers.
#![forbid(unsafe_code)]
// The controllers' futures (kube-runtime streams, hyper, `#[instrument]` spans) nest deeper
// than the default limit when their `Send` bound is checked.
#![recursion_limit = "256"]

use clap::Parser;
use cosmosq_operator::config::{Command, Config};
use cosmosq_operator::{check::CheckArgs, run};
use cosmosq_program::process::{self, Stopping};
use tokio_util::sync::CancellationToken;

/// Workers the runtime starts, unless `TOKIO_WORKER_THREADS` says otherwise: the operator
/// waits on the API server and the accounts, and on a node of many cores one worker each held
/// memory its pod's limit does not have (docs/benchmarks.md).
const WORKERS: usize = 2;

fn main() -> std::process::ExitCode {
    let config = Config::parse();
    process::block_on(WORKERS, operate(config))
}

async fn operate(config: Config) -> std::process::ExitCode {
    process::init_tracing();
    if let Some(Command::Check(args)) = &config.command {
        return check(args).await;
    }
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

/// `cosmosq-operator check`: one line per condition that held, or the one that did not.
async fn check(args: &CheckArgs) -> std::process::ExitCode {
    cosmosq_queue::cosmos::tls::install_crypto_provider();
    let client = match kube::Client::try_default().await {
        Ok(client) => client,
        Err(e) => {
            eprintln!("check failed: no Kubernetes client: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match cosmosq_operator::check::run(client, args).await {
        Ok(passed) => {
            for line in passed {
                println!("ok: {line}");
            }
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("check failed: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
