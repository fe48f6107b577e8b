//! `cosmosq-operator`: reconciles CosmosQueues and QueueConsumerGroups and scales their workers.
#![forbid(unsafe_code)]
// The controllers' futures (kube-runtime streams, hyper, `#[instrument]` spans) nest deeper
// than the default limit when their `Send` bound is checked.
#![recursion_limit = "256"]

use clap::Parser;
use cosmosq_operator::{config::Config, run};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let config = Config::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .json()
        .init();
    let grace = config.grace_period;
    let shutdown = CancellationToken::new();
    let mut task = tokio::spawn(run::run(config, shutdown.clone()));
    let result = tokio::select! {
        result = &mut task => result,
        _ = terminated() => {
            info!(grace_period = ?grace, "stopping: finishing reconciles, releasing the leader lease");
            shutdown.cancel();
            tokio::select! {
                result = &mut task => result,
                _ = tokio::time::sleep(grace) => {
                    warn!("grace period over; exiting");
                    return std::process::ExitCode::SUCCESS;
                }
            }
        }
    };
    match result {
        Ok(Ok(())) => std::process::ExitCode::SUCCESS,
        Ok(Err(e)) => {
            error!("{e}");
            std::process::ExitCode::FAILURE
        }
        Err(e) => {
            error!("operator task failed: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// SIGTERM (Kubernetes) or SIGINT (Ctrl-C).
async fn terminated() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).expect("signal handler");
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}
