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

/// Runs `task` until it ends, or until a signal or a stop the program asked for itself
/// (`shutdown` cancelled, e.g. the sidecar's `POST /v1.0/shutdown`): then cancels `shutdown`
/// and waits for the task at most `grace`. A second signal ends the process at once. Errors are
/// logged; the exit code is 0 for a clean end or an expired grace period, 1 for an error,
/// [`INTERRUPTED`] for a second signal.
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
        _ = async { tokio::select! { _ = terminated() => {}, _ = shutdown.cancelled() => {} } } => {
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

#[cfg(test)]
mod tests {
    use super::*;

    const STOPPING: Stopping = Stopping {
        draining: "draining",
        grace_over: "grace over",
        interrupted: "interrupted",
    };

    fn same(a: ExitCode, b: ExitCode) -> bool {
        format!("{a:?}") == format!("{b:?}")
    }

    /// A stop the program asks for itself (the sidecar's shutdown API) drains like a signal,
    /// and is bounded by the same grace period.
    #[tokio::test(start_paused = true)]
    async fn a_stop_the_program_asks_for_drains_within_the_grace_period() {
        let started = tokio::time::Instant::now();
        let asked = |shutdown: &CancellationToken| {
            let stop = shutdown.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(1)).await;
                stop.cancel();
            });
        };
        // A task that drains for 3 s once told.
        let shutdown = CancellationToken::new();
        asked(&shutdown);
        let token = shutdown.clone();
        let draining = async move {
            token.cancelled().await;
            tokio::time::sleep(Duration::from_secs(3)).await;
            Ok::<(), String>(())
        };
        let code = run_until_signalled(draining, shutdown, Duration::from_secs(20), STOPPING).await;
        assert!(same(code, ExitCode::SUCCESS));
        assert_eq!(started.elapsed(), Duration::from_secs(4));

        // A task that never finishes: the grace period ends it.
        let shutdown = CancellationToken::new();
        asked(&shutdown);
        let stuck = std::future::pending::<Result<(), String>>();
        let code = run_until_signalled(stuck, shutdown, Duration::from_secs(20), STOPPING).await;
        assert!(same(code, ExitCode::SUCCESS));
        assert_eq!(started.elapsed(), Duration::from_secs(4 + 21));
    }
}
