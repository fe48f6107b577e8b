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

/// The variable tokio reads for its worker count; set, it wins over [`runtime`]'s bound.
pub const WORKER_THREADS: &str = "TOKIO_WORKER_THREADS";

/// How many workers a runtime is given (pure): `None` leaves it to tokio (which reads
/// [`WORKER_THREADS`]); otherwise the CPUs available, at most `most`. A pod without a CPU
/// limit sees every core of its node, and each worker costs a stack and, with glibc, a
/// malloc arena: a sidecar on a 64-core node would start 64 workers for I/O two keep up with.
pub fn worker_threads(set: bool, available: usize, most: usize) -> Option<usize> {
    (!set).then(|| available.clamp(1, most.max(1)))
}

/// A multi-threaded runtime with I/O and timers and at most `most` workers unless
/// [`WORKER_THREADS`] says otherwise (linkerd's proxy, likewise, runs on one core unless its
/// configuration gives it more).
pub fn runtime(most: usize) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    let available = std::thread::available_parallelism().map_or(1, usize::from);
    if let Some(workers) =
        worker_threads(std::env::var_os(WORKER_THREADS).is_some(), available, most)
    {
        builder.worker_threads(workers);
    }
    builder.build()
}

/// Runs a program's `main` future on [`runtime`]`(most)`.
pub fn block_on(most: usize, main: impl Future<Output = ExitCode>) -> ExitCode {
    match runtime(most) {
        Ok(runtime) => runtime.block_on(main),
        Err(e) => {
            eprintln!("starting the runtime: {e}");
            ExitCode::FAILURE
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runtime_has_the_cpus_available_up_to_its_bound_unless_the_variable_is_set() {
        // A pod without a CPU limit on a 64-core node, and on a 1-CPU limit.
        assert_eq!(worker_threads(false, 64, 2), Some(2));
        assert_eq!(worker_threads(false, 1, 2), Some(1));
        assert_eq!(worker_threads(false, 0, 2), Some(1));
        // `TOKIO_WORKER_THREADS` set: tokio reads it, whatever it says.
        assert_eq!(worker_threads(true, 64, 2), None);
    }

    #[test]
    fn the_runtime_built_runs_tasks_and_timers() {
        let runtime = runtime(2).unwrap();
        let workers = runtime.metrics().num_workers();
        let bound = match std::env::var(WORKER_THREADS) {
            // Whoever runs the tests set it: tokio's to read.
            Ok(set) => set.parse().unwrap_or(usize::MAX),
            Err(_) => 2,
        };
        assert!((1..=bound).contains(&workers), "{workers} workers");
        let slept = runtime.block_on(async {
            tokio::spawn(tokio::time::sleep(Duration::from_millis(1)))
                .await
                .is_ok()
        });
        assert!(slept);
    }
}
