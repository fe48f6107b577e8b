//! What the programs' `main`s share: JSON logs filtered by `RUST_LOG`, and a run that stops
//! gracefully on SIGTERM (Kubernetes) or SIGINT (Ctrl-C) within a grace period. One signal
//! handler per process: the main task gets a `CancellationToken`, never a second handler.

use std::fmt::Display;
use std::future::Future;
use std::process::ExitCode;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// Structured (JSON) logs on stderr, at `RUST_LOG` or `info`.
pub fn init_tracing() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .json()
        .init();
}

/// What a program says while it stops (each names what it finishes).
pub struct Stopping {
    /// On the first signal, when the main task is asked to stop.
    pub draining: &'static str,
    /// When the grace period ends first.
    pub grace_over: &'static str,
    /// When a second signal ends the drain at once.
    pub interrupted: &'static str,
}

/// Exit code of a second signal during the drain (128 + SIGINT, as shells report it).
pub const INTERRUPTED: u8 = 130;

/// Runs `task` until it ends, or until a signal: then cancels `shutdown` and waits for the task
/// at most `grace`. A second signal ends the process at once. Errors are logged; the exit code
/// is 0 for a clean end or an expired grace period, 1 for an error, [`INTERRUPTED`] for a
/// second signal.
pub async fn run_until_signalled<F, E>(
    task: F,
    shutdown: CancellationToken,
    grace: Duration,
    stopping: Stopping,
) -> ExitCode
where
    F: Future<Output = Result<(), E>> + Send + 'static,
    E: Display + Send + 'static,
{
    let mut task = tokio::spawn(task);
    let result = tokio::select! {
        result = &mut task => result,
        _ = terminated() => {
            info!(grace_period = ?grace, "{}", stopping.draining);
            shutdown.cancel();
            tokio::select! {
                result = &mut task => result,
                _ = tokio::time::sleep(grace) => {
                    warn!("{}", stopping.grace_over);
                    return ExitCode::SUCCESS;
                }
                _ = terminated() => {
                    warn!("second signal: {}", stopping.interrupted);
                    return ExitCode::from(INTERRUPTED);
                }
            }
        }
    };
    match result {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(e)) => {
            error!("{e}");
            ExitCode::FAILURE
        }
        Err(e) => {
            error!("the main task failed: {e}");
            ExitCode::FAILURE
        }
    }
}

/// SIGTERM (Kubernetes) or SIGINT (Ctrl-C).
async fn terminated() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            },
            Err(e) => {
                warn!(error = %e, "no SIGTERM handler; stopping on Ctrl-C only");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}
