//! What a consumer of a group is made of besides the lease loop (`host.rs`): the handler
//! contract (`Delivery`, `Outcome`, `Handler`), a consumer's counters, and adaptive polling.

use std::future::Future;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::message::Message;

/// One delivery handed to a [`Handler`].
#[derive(Clone, Debug)]
pub struct Delivery {
    /// The message.
    pub message: Message,
    /// 1 on the first delivery.
    pub delivery_count: u32,
    /// The consumer group delivering it.
    pub group: String,
    /// The queue (messages container) it came from.
    pub queue: String,
    /// Until when the delivery is this handler's alone (Service Bus' `LockedUntil`), kept up
    /// to date while the host renews the lock.
    pub locked_until: LockedUntil,
}

/// Until when a delivery is its handler's alone: epoch ms by the delivering host's clock, moved
/// on by every renewal — of the message's own lock, or of the range's lease where that is the
/// lock. After it, another consumer may be given the message. Clones share the value.
#[derive(Clone, Debug, Default)]
pub struct LockedUntil(Arc<AtomicI64>);

impl LockedUntil {
    /// Now, in epoch ms; `None` before the host set one.
    pub fn get(&self) -> Option<i64> {
        match self.0.load(Ordering::SeqCst) {
            0 => None,
            ms => Some(ms),
        }
    }

    pub(crate) fn set(&self, epoch_ms: i64) {
        self.0.store(epoch_ms, Ordering::SeqCst);
    }
}

/// What the handler decided.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// Done: the group never delivers it again.
    Complete,
    /// Deliver again later: after `delay` if given (an app's `Retry-After`), else back-off.
    Retry {
        /// Why it failed (kept as the last error).
        error: String,
        /// When to deliver it again, instead of the back-off.
        delay: Option<Duration>,
    },
    /// Give up now.
    DeadLetter {
        /// Why (recorded with the dead letter).
        reason: String,
        /// The last error (recorded with the dead letter).
        error: String,
    },
    /// The app never saw the message (it refused the connection: not listening yet, or
    /// restarting): no delivery attempt is counted. Delivered again after `delay` (back-off
    /// when `None`) under the same claim; after a whole lock duration of this it counts as a
    /// failed attempt, so an app that never comes back still ends in retries and dead letters.
    Undelivered {
        /// Why the app could not be reached.
        error: String,
        /// When to try again, instead of the back-off.
        delay: Option<Duration>,
    },
}

/// Processes deliveries. Implemented for `Fn(Delivery) -> impl Future<Output = Outcome>`.
pub trait Handler: Send + Sync + 'static {
    /// Handles one delivery; the outcome settles it.
    fn handle(&self, delivery: Delivery) -> impl Future<Output = Outcome> + Send;
}

impl<F, Fut> Handler for F
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Outcome> + Send,
{
    fn handle(&self, delivery: Delivery) -> impl Future<Output = Outcome> + Send {
        self(delivery)
    }
}

/// Counters a running consumer keeps; shared so callers can watch it live.
#[derive(Debug, Default)]
pub struct ConsumerStats {
    /// Deliveries handed to the handler.
    pub delivered: AtomicU64,
    /// Messages completed.
    pub completed: AtomicU64,
    /// Failed deliveries scheduled for a retry.
    pub retried: AtomicU64,
    /// Messages dead-lettered.
    pub dead_lettered: AtomicU64,
    /// Outcomes not recorded because the lock had passed to another owner.
    pub lock_lost: AtomicU64,
    /// Documents of the messages container that are not messages (skipped).
    pub malformed: AtomicU64,
    /// State documents left alone because this version cannot read them.
    pub unknown_state: AtomicU64,
    /// Cosmos DB errors the loops retried.
    pub errors: AtomicU64,
    /// Leases this host holds now (a gauge).
    pub leases_owned: AtomicU64,
    /// Leases taken (free, expired or stolen) and lost (stolen from us, or not renewed).
    pub leases_acquired: AtomicU64,
    /// Leases lost: stolen, or not renewed in time.
    pub leases_lost: AtomicU64,
}

impl ConsumerStats {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// A counter's value now.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// Exponential back-off of the poll interval while the feed is empty.
#[derive(Clone, Debug)]
pub struct AdaptivePoll {
    min: Duration,
    max: Duration,
    current: Duration,
    /// Empty reads since the last page with work.
    empty: u32,
    /// Empty reads at `min` before backing off: [`HOLD_AT_MIN`] of them.
    hold: u32,
}

/// How long the feed stays at the shortest interval after work before backing off: a steady
/// trickle (a message every few tens of ms per range) leaves gaps of a few hundred ms, and
/// doubling within them makes the next message wait the longer interval (the latency's tail).
/// An idle range pays for it once per spell of work (250 ms of reads at `min`), not per second.
const HOLD_AT_MIN: Duration = Duration::from_millis(250);

impl AdaptivePoll {
    /// Starting at `min`.
    pub fn new(min: Duration, max: Duration) -> Self {
        let hold = HOLD_AT_MIN.as_millis() / min.as_millis().max(1);
        Self {
            min,
            max,
            current: Duration::ZERO,
            empty: 0,
            hold: hold.clamp(1, 64) as u32,
        }
    }

    /// The wait before the next read.
    pub fn delay(&self) -> Duration {
        self.current
    }

    /// A page came back with `items` of at most `page_size`: read again at once while pages
    /// come back full (more is waiting), shortly after a partial page (caught up), and back
    /// off while they come back empty.
    pub fn observed(&mut self, items: usize, page_size: usize) {
        if items > 0 {
            self.empty = 0;
        }
        self.current = match items {
            0 => return self.idle(),
            n if n >= page_size => Duration::ZERO,
            _ => self.min,
        };
    }

    /// A page came back empty: after [`HOLD_AT_MIN`] of reads at the shortest interval, wait
    /// longer, up to the ceiling.
    pub fn idle(&mut self) {
        self.empty = self.empty.saturating_add(1);
        self.current = if self.current.is_zero() || self.empty <= self.hold {
            self.min
        } else {
            (self.current * 2).min(self.max)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polling_backs_off_to_the_ceiling_and_resets_on_work() {
        let mut poll = AdaptivePoll::new(Duration::from_millis(100), Duration::from_secs(1));
        assert_eq!(poll.delay(), Duration::ZERO);
        let mut seen = Vec::new();
        for _ in 0..9 {
            poll.observed(0, 100);
            seen.push(poll.delay().as_millis());
        }
        assert_eq!(seen, vec![100, 100, 200, 400, 800, 1000, 1000, 1000, 1000]);
        poll.observed(100, 100);
        assert_eq!(
            poll.delay(),
            Duration::ZERO,
            "a full page: read again at once"
        );
        poll.observed(3, 100);
        assert_eq!(
            poll.delay(),
            Duration::from_millis(100),
            "a partial page: caught up"
        );
        poll.observed(0, 100);
        assert_eq!(
            poll.delay(),
            Duration::from_millis(100),
            "a few empty reads at the shortest interval after work"
        );
        // At the production floor (20 ms), a quarter of a second of reads before backing off.
        let mut poll = AdaptivePoll::new(Duration::from_millis(20), Duration::from_secs(5));
        let at_min = (0..40)
            .map(|_| {
                poll.idle();
                poll.delay()
            })
            .take_while(|d| *d == Duration::from_millis(20))
            .count();
        assert_eq!(at_min, 12);
    }
}
