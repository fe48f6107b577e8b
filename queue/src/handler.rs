//! The handler contract between the lease loop ([`crate::host`]) and the app's code: what a
//! handler is given (`Delivery`), what it answers (`Outcome`), `Handler` itself, and a
//! consumer's counters.

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
        reason: String,
        /// When to deliver it again, instead of the back-off.
        delay: Option<Duration>,
    },
    /// Give up now.
    DeadLetter {
        /// Why, in a word (recorded with the dead letter, as Service Bus'
        /// `DeadLetterReason`).
        reason: String,
        /// The last error (recorded with the dead letter, as Service Bus'
        /// `DeadLetterErrorDescription`).
        description: String,
    },
    /// The app never saw the message (it refused the connection: not listening yet, or
    /// restarting): no delivery attempt is counted. Delivered again after `delay` (back-off
    /// when `None`) under the same claim; after a whole lock duration of this it counts as a
    /// failed attempt, so an app that never comes back still ends in retries and dead letters.
    Undelivered {
        /// Why the app could not be reached.
        reason: String,
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
