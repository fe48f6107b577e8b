//! `cosmosq-sidecar`: runs next to the app in every worker pod.
#![forbid(unsafe_code)]

use clap::Parser;
use cosmosq_sidecar::{config, run};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let config = config::Config::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .json()
        .init();
    if let Err(e) = config.validate() {
        error!("{e}");
        eprintln!("{e}");
        return std::process::ExitCode::from(2);
    }
    let grace = config.grace_period;
    let shutdown = CancellationToken::new();
    let mut task = tokio::spawn(run::run(config, shutdown.clone()));
    let finished = tokio::select! {
        result = &mut task => Some(result),
        _ = terminated() => None,
    };
    let result = match finished {
        Some(result) => result,
        None => {
            info!(grace_period = ?grace, "stopping: finishing in-flight work, then releasing leases");
            shutdown.cancel();
            tokio::select! {
                result = &mut task => result,
                _ = tokio::time::sleep(grace) => {
                    warn!("grace period over with work in flight: its locks expire and other pods deliver it again");
                    return std::process::ExitCode::SUCCESS;
                }
                _ = terminated() => {
                    warn!("second signal: exiting at once; in-flight messages are delivered again after their locks expire");
                    return std::process::ExitCode::from(130);
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
            error!("sidecar task failed: {e}");
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
