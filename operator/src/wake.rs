//! Wakes: a producer tells the operator it wrote to a queue, and the queue's groups at zero
//! are looked at now instead of at the next scaling round.
//!
//! A wake is a hint, never an order: it makes the operator do sooner what its next round would
//! do anyway (probe the queue's feed head, estimate the groups whose feed moved, scale from
//! zero a group with work), so a caller can neither scale a group that has nothing to do nor
//! keep one up. Who may tell is RBAC's answer (`create` on `cosmosqueues/wake`, see
//! `crate::http`); how often it costs Cosmos DB is [`Coalescer`]'s: per queue, one wake at a
//! time, one more folded behind it, and starts at least [`WAKE_SPACING`] apart, however many
//! producers tell how often. At most that is a probe of the queue's feed head and an estimate
//! of each of its groups at zero a second (a group at zero whose work the operator leaves to
//! someone else, paused or below its activation threshold, is estimated at each wake).

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Arc;
use std::time::Duration;

use cosmosq_crds::CosmosQueue;
use kube::runtime::reflector::ObjectRef;
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::scaler::Scaler;

/// Wakes waiting for the loop, at most: beyond it a caller is answered 429 (`Retry-After`).
pub const WAKE_BACKLOG: usize = 1024;
/// The shortest time between two wakes' starts on one queue: a producer telling at every
/// message costs one probe of the feed head a second, not one per message.
pub const WAKE_SPACING: Duration = Duration::from_secs(1);
/// Groups looked at by wakes at once, all queues together (a round's own width is beside it).
pub const WAKE_WIDTH: usize = 16;

/// Where the HTTP handler hands wakes to the scaling loop.
pub type WakeSender = mpsc::Sender<ObjectRef<CosmosQueue>>;

/// One queue's wakes: the last start, and whether one is in progress with another behind it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    /// None in progress; the last started then.
    Done { started: Instant },
    /// One in progress (or waiting out the spacing), started then; `again`: another was asked
    /// for since, to run after it (the caller's message may have come after its probe).
    Running { started: Instant, again: bool },
}

/// Per key, at most one wake in progress and one folded behind it, starts `spacing` apart
/// (pure: the caller runs what it is told to).
#[derive(Debug)]
pub struct Coalescer<K> {
    spacing: Duration,
    slots: HashMap<K, Slot>,
}

impl<K: Eq + Hash + Clone> Coalescer<K> {
    /// Starts at least `spacing` apart per key.
    pub fn new(spacing: Duration) -> Self {
        Self {
            spacing,
            slots: HashMap::new(),
        }
    }

    /// A wake for `key` arrived at `now`: `Some(wait)` to start one after `wait`, `None` when it
    /// is folded into the one in progress (which then runs once more).
    pub fn arrived(&mut self, key: K, now: Instant) -> Option<Duration> {
        self.forget_before(now);
        let wait = match self.slots.get_mut(&key) {
            // One still waiting out the spacing has not probed yet: it sees this write too.
            Some(Slot::Running { started, .. }) if now < *started => return None,
            Some(Slot::Running { again, .. }) => {
                *again = true;
                return None;
            }
            Some(Slot::Done { started }) => {
                (*started + self.spacing).saturating_duration_since(now)
            }
            None => Duration::ZERO,
        };
        self.slots.insert(
            key,
            Slot::Running {
                started: now + wait,
                again: false,
            },
        );
        Some(wait)
    }

    /// The wake for `key` ended at `now`: `Some(wait)` to start the one folded behind it.
    pub fn finished(&mut self, key: K, now: Instant) -> Option<Duration> {
        let slot = self.slots.get_mut(&key)?;
        let Slot::Running { started, again } = *slot else {
            return None;
        };
        if !again {
            *slot = Slot::Done { started };
            return None;
        }
        let wait = (started + self.spacing).saturating_duration_since(now);
        *slot = Slot::Running {
            started: now + wait,
            again: false,
        };
        Some(wait)
    }

    /// Keys remembered (tests: what is past its spacing is forgotten).
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether no key is remembered.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Drops the finished wakes whose spacing is over: they no longer delay anything.
    fn forget_before(&mut self, now: Instant) {
        let spacing = self.spacing;
        self.slots.retain(|_, slot| match slot {
            Slot::Done { started } => *started + spacing > now,
            Slot::Running { .. } => true,
        });
    }
}

/// Runs the wakes the handler sends until `shutdown`, beside the rounds (a round over
/// thousands of groups takes seconds; a wake must not wait for it). The groups all wakes look
/// at once are bounded together ([`WAKE_WIDTH`]), however many queues are told at once.
pub async fn run(
    scaler: Arc<Scaler>,
    mut wakes: mpsc::Receiver<ObjectRef<CosmosQueue>>,
    shutdown: CancellationToken,
) {
    let mut coalescer = Coalescer::new(WAKE_SPACING);
    let mut running = JoinSet::new();
    // Which queue each task wakes: a task that panicked still ends its queue's wake.
    let mut queues: HashMap<tokio::task::Id, ObjectRef<CosmosQueue>> = HashMap::new();
    let width = Arc::new(Semaphore::new(WAKE_WIDTH));
    let start = |running: &mut JoinSet<()>, queue: &ObjectRef<CosmosQueue>, wait: Duration| {
        let (scaler, width, queue) = (scaler.clone(), width.clone(), queue.clone());
        running
            .spawn(async move {
                tokio::time::sleep(wait).await;
                let groups = scaler.wake(&queue, &width).await;
                debug!(%queue, groups, "woken");
            })
            .id()
    };
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            Some(queue) = wakes.recv() => {
                if let Some(wait) = coalescer.arrived(queue.clone(), Instant::now()) {
                    queues.insert(start(&mut running, &queue, wait), queue);
                }
            }
            Some(done) = running.join_next_with_id() => {
                let id = match done {
                    Ok((id, ())) => id,
                    Err(e) => {
                        warn!(error = %e, "a wake failed");
                        e.id()
                    }
                };
                let Some(queue) = queues.remove(&id) else { continue };
                if let Some(wait) = coalescer.finished(queue.clone(), Instant::now()) {
                    queues.insert(start(&mut running, &queue, wait), queue);
                }
            }
        }
    }
    running.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = WAKE_SPACING;

    #[tokio::test(start_paused = true)]
    async fn one_wake_at_a_time_per_queue_and_one_more_folded_behind_it() {
        let mut c = Coalescer::new(S);
        let t0 = Instant::now();
        assert_eq!(
            c.arrived("q", t0),
            Some(Duration::ZERO),
            "the first starts at once"
        );
        // Told again and again while it runs: folded into one more, not one each.
        for ms in [10, 20, 30] {
            assert_eq!(c.arrived("q", t0 + Duration::from_millis(ms)), None);
        }
        // Another queue is not held up by this one.
        assert_eq!(c.arrived("other", t0), Some(Duration::ZERO));
        // The first ends after 200 ms: the folded one starts a spacing after the first began.
        let ended = t0 + Duration::from_millis(200);
        assert_eq!(c.finished("q", ended), Some(S - Duration::from_millis(200)));
        // It ends with nothing behind it: no more.
        assert_eq!(c.finished("q", t0 + S + Duration::from_millis(100)), None);
    }

    #[tokio::test(start_paused = true)]
    async fn starts_are_a_spacing_apart_and_forgotten_once_it_is_over() {
        let mut c = Coalescer::new(S);
        let t0 = Instant::now();
        assert_eq!(c.arrived("q", t0), Some(Duration::ZERO));
        assert_eq!(c.finished("q", t0 + Duration::from_millis(50)), None);
        // Told again 300 ms after the last start: it waits out the rest of the spacing.
        assert_eq!(
            c.arrived("q", t0 + Duration::from_millis(300)),
            Some(Duration::from_millis(700))
        );
        assert_eq!(c.finished("q", t0 + S + Duration::from_millis(10)), None);
        // Long after: at once, and what was past its spacing is forgotten.
        assert_eq!(c.arrived("late", t0 + 5 * S), Some(Duration::ZERO));
        assert_eq!(c.len(), 1, "only the wake in progress is remembered");
        // A finish for a key never started changes nothing.
        assert_eq!(c.finished("never", t0), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_wake_still_waiting_out_the_spacing_takes_later_words_with_it() {
        let mut c = Coalescer::new(S);
        let t0 = Instant::now();
        c.arrived("q", t0);
        c.finished("q", t0 + Duration::from_millis(10));
        // Told at 100 ms: it starts at 1 s, after anything told before then.
        assert_eq!(
            c.arrived("q", t0 + Duration::from_millis(100)),
            Some(Duration::from_millis(900))
        );
        assert_eq!(c.arrived("q", t0 + Duration::from_millis(500)), None);
        assert_eq!(
            c.finished("q", t0 + S + Duration::from_millis(50)),
            None,
            "no second"
        );
        // Told while it runs (after its start): one more.
        c.arrived("q", t0 + 3 * S);
        assert_eq!(c.arrived("q", t0 + 3 * S + Duration::from_millis(1)), None);
        assert!(c
            .finished("q", t0 + 3 * S + Duration::from_millis(5))
            .is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn a_wake_finishing_late_starts_the_folded_one_at_once() {
        let mut c = Coalescer::new(S);
        let t0 = Instant::now();
        c.arrived("q", t0);
        assert_eq!(c.arrived("q", t0 + Duration::from_millis(100)), None);
        assert_eq!(c.finished("q", t0 + 3 * S), Some(Duration::ZERO));
    }
}
