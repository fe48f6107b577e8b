//! The handler contract (`Delivery`, `Outcome`, `Handler`), consumers' counters and adaptive
//! polling, and `Consumer`: the lease-less reader of the whole container's feed.
//!
//! `Consumer` reads every range with no lease or checkpoint, so several consumers of a group
//! contend for every message through their claims alone; the change-feed lease loop
//! (`host.rs`, per feed range, balanced, checkpointed) is what the sidecar runs. Both hand
//! messages to the same delivery task (`delivery.rs`).
//! Correctness never rests on the feed position: in `exclusive` mode claims are durable, so a
//! consumer that starts over skips what its group already settled.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use azure_data_cosmos::FeedScope;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{error, warn};

use crate::cosmos::feed::FeedReader;
use crate::delivery::{Deliverer, Permit};
use crate::error::Result;
use crate::group::Group;
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

/// How a lease-less [`Consumer`] runs.
#[derive(Clone, Debug)]
pub struct ConsumerOptions {
    /// This consumer's identity in locks (pod name, host name).
    pub owner: String,
    /// Deliveries in flight at most (back-pressure on reading).
    pub max_concurrency: usize,
    /// Poll interval bounds: read again at once while pages carry work, back off to `max_poll`
    /// while the feed is empty.
    pub min_poll: Duration,
    /// The longest wait between reads of an empty feed.
    pub max_poll: Duration,
    /// How often to look for expired locks and due retries.
    pub sweep_interval: Duration,
    /// Items per change-feed page.
    pub page_size: u32,
}

impl ConsumerOptions {
    /// Options with the defaults, as `owner`.
    pub fn new(owner: impl Into<String>) -> Self {
        Self {
            owner: owner.into(),
            max_concurrency: 16,
            min_poll: Duration::from_millis(50),
            max_poll: Duration::from_secs(5),
            sweep_interval: Duration::from_secs(5),
            page_size: 100,
        }
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
}

impl AdaptivePoll {
    /// Starting at `min`.
    pub fn new(min: Duration, max: Duration) -> Self {
        Self {
            min,
            max,
            current: Duration::ZERO,
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
        self.current = match items {
            0 => return self.idle(),
            n if n >= page_size => Duration::ZERO,
            _ => self.min,
        };
    }

    /// A page came back empty: wait longer, up to the ceiling.
    pub fn idle(&mut self) {
        self.current = if self.current.is_zero() {
            self.min
        } else {
            (self.current * 2).min(self.max)
        };
    }
}

/// Reads the whole container's feed with no lease or checkpoint (see the module's doc).
pub struct Consumer<H> {
    group: Group,
    handler: Arc<H>,
    options: ConsumerOptions,
    stats: Arc<ConsumerStats>,
}

impl<H: Handler> Consumer<H> {
    /// A consumer of `group` handing messages to `handler`.
    pub fn new(group: Group, handler: H, options: ConsumerOptions) -> Self {
        Self {
            group,
            handler: Arc::new(handler),
            options,
            stats: Arc::default(),
        }
    }

    /// Its counters, live.
    pub fn stats(&self) -> Arc<ConsumerStats> {
        Arc::clone(&self.stats)
    }

    /// Runs until `shutdown`, then waits for the deliveries in flight to settle.
    pub async fn run(self, shutdown: CancellationToken) -> Result<()> {
        let permits = Arc::new(Semaphore::new(self.options.max_concurrency.max(1)));
        let mut tasks = JoinSet::new();
        let mut feed = FeedReader::new(
            self.group.queue().messages().clone(),
            FeedScope::full_container(),
            self.group.config().start_from,
            None,
            self.options.page_size,
            Arc::clone(self.group.queue().charges()),
        );
        let mut poll = AdaptivePoll::new(self.options.min_poll, self.options.max_poll);
        let mut sweep = tokio::time::interval(self.options.sweep_interval);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            while let Some(done) = tasks.try_join_next() {
                if let Err(e) = done {
                    error!(error = %e, "delivery task panicked");
                }
            }
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = sweep.tick() => {
                    match self.group.due(self.options.max_concurrency * 4, None).await {
                        Ok(docs) => for doc in docs {
                            let permit = tokio::select! {
                                p = Arc::clone(&permits).acquire_owned() => p.expect("semaphore never closes"),
                                _ = shutdown.cancelled() => break,
                            };
                            let mut permit = Permit::held(Arc::clone(&permits), permit);
                            let deliverer = self.deliverer();
                            tasks.spawn(async move { deliverer.process_due(doc, &mut permit).await; });
                        },
                        Err(e) => { ConsumerStats::bump(&self.stats.errors); warn!(group = self.group.name(), error = %e, "sweep failed; trying again next interval") }
                    }
                }
                _ = tokio::time::sleep(poll.delay()) => {
                    match feed.next_page().await {
                        Ok((docs, _)) if docs.is_empty() => poll.idle(),
                        Ok((docs, _)) => {
                            poll.observed(docs.len(), self.options.page_size as usize);
                            for doc in docs {
                                let message = match Message::from_document(&doc, self.group.queue().pk_field()) {
                                    Ok(m) => m,
                                    Err(reason) => {
                                        ConsumerStats::bump(&self.stats.malformed);
                                        warn!(queue = self.group.queue().name(), id = ?doc.get("id"), %reason, "skipping a malformed document in the messages container");
                                        continue;
                                    }
                                };
                                let permit = tokio::select! {
                                    p = Arc::clone(&permits).acquire_owned() => p.expect("semaphore never closes"),
                                    _ = shutdown.cancelled() => break,
                                };
                                let mut permit = Permit::held(Arc::clone(&permits), permit);
                                let deliverer = self.deliverer();
                                let shutdown = shutdown.clone();
                                tasks.spawn(async move { deliverer.process(message, &shutdown, &mut permit, false).await; });
                            }
                        }
                        Err(e) => {
                            ConsumerStats::bump(&self.stats.errors);
                            poll.idle();
                            warn!(queue = self.group.queue().name(), error = %e, "change feed read failed; retrying");
                        }
                    }
                }
            }
        }
        while let Some(done) = tasks.join_next().await {
            if let Err(e) = done {
                error!(error = %e, "delivery task panicked");
            }
        }
        Ok(())
    }

    fn deliverer(&self) -> Deliverer<H> {
        Deliverer {
            group: self.group.clone(),
            handler: Arc::clone(&self.handler),
            owner: self.options.owner.clone(),
            stats: Arc::clone(&self.stats),
        }
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
        for _ in 0..6 {
            poll.observed(0, 100);
            seen.push(poll.delay().as_millis());
        }
        assert_eq!(seen, vec![100, 200, 400, 800, 1000, 1000]);
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
        assert_eq!(poll.delay(), Duration::from_millis(200));
    }
}
