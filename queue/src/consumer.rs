//! A consumer: reads the queue's change feed, claims, hands messages to a handler, settles.
//!
//! This consumer reads the whole container's feed; the change-feed lease loop (per feed range,
//! balanced across hosts, with durable checkpoints) builds on the same claim/settle path.
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
use tracing::{debug, error, warn};

use crate::backoff::RetryPolicy;
use crate::error::{QueueError, Result};
use crate::feed::FeedReader;
use crate::group::{Claim, ClaimOutcome, Group, RetryOutcome, StateDoc};
use crate::message::Message;

/// Back-off between attempts to record a message's fate after a Cosmos error the SDK did not
/// retry away (a long 429 storm, 503s, timeouts, resets).
const RECORD_RETRY: RetryPolicy = RetryPolicy {
    max_delivery_attempts: u32::MAX,
    initial_backoff: Duration::from_millis(50),
    max_backoff: Duration::from_secs(5),
    multiplier: 2.0,
    jitter: 0.2,
};

/// A handler that panics fails the delivery like an error would (retried, then dead-lettered):
/// otherwise the task would die with the message unsettled and its range could never drain.
async fn guarded(handling: impl Future<Output = Outcome>) -> Outcome {
    use futures::FutureExt as _;
    match std::panic::AssertUnwindSafe(handling).catch_unwind().await {
        Ok(outcome) => outcome,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-string payload".to_owned());
            error!(panic = %what, "the handler panicked; the delivery counts as failed");
            Outcome::Retry {
                error: format!("the handler panicked: {what}"),
                delay: None,
            }
        }
    }
}

/// One delivery handed to a [`Handler`].
#[derive(Clone, Debug)]
pub struct Delivery {
    pub message: Message,
    /// 1 on the first delivery.
    pub delivery_count: u32,
    pub group: String,
    pub queue: String,
}

/// What the handler decided.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    Complete,
    /// Deliver again later: after `delay` if given (an app's `Retry-After`), else back-off.
    Retry {
        error: String,
        delay: Option<Duration>,
    },
    /// Give up now.
    DeadLetter {
        reason: String,
        error: String,
    },
}

/// Processes deliveries. Implemented for `Fn(Delivery) -> impl Future<Output = Outcome>`.
pub trait Handler: Send + Sync + 'static {
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

#[derive(Clone, Debug)]
pub struct ConsumerOptions {
    /// This consumer's identity in locks (pod name, host name).
    pub holder: String,
    /// Deliveries in flight at most (back-pressure on reading).
    pub max_concurrency: usize,
    /// Poll interval bounds: read again at once while pages carry work, back off to `max_poll`
    /// while the feed is empty.
    pub min_poll: Duration,
    pub max_poll: Duration,
    /// How often to look for expired locks and due retries.
    pub sweep_interval: Duration,
    /// Items per change-feed page.
    pub page_size: u32,
}

impl ConsumerOptions {
    pub fn new(holder: impl Into<String>) -> Self {
        Self {
            holder: holder.into(),
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
    pub delivered: AtomicU64,
    pub completed: AtomicU64,
    pub retried: AtomicU64,
    pub dead_lettered: AtomicU64,
    pub lock_lost: AtomicU64,
    pub malformed: AtomicU64,
    pub errors: AtomicU64,
    /// Leases this host holds now (a gauge).
    pub leases_owned: AtomicU64,
    /// Leases taken (free, expired or stolen) and lost (stolen from us, or not renewed).
    pub leases_acquired: AtomicU64,
    pub leases_lost: AtomicU64,
}

impl ConsumerStats {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

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

pub struct Consumer<H> {
    group: Group,
    handler: Arc<H>,
    options: ConsumerOptions,
    stats: Arc<ConsumerStats>,
}

impl<H: Handler> Consumer<H> {
    pub fn new(group: Group, handler: H, options: ConsumerOptions) -> Self {
        Self {
            group,
            handler: Arc::new(handler),
            options,
            stats: Arc::default(),
        }
    }

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
                    match self.group.due(self.options.max_concurrency * 4).await {
                        Ok(docs) => for doc in docs {
                            let permit = tokio::select! {
                                p = Arc::clone(&permits).acquire_owned() => p.expect("semaphore never closes"),
                                _ = shutdown.cancelled() => break,
                            };
                            let worker = self.worker();
                            tasks.spawn(async move { worker.process_due(doc).await; drop(permit); });
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
                                let worker = self.worker();
                                let shutdown = shutdown.clone();
                                tasks.spawn(async move { worker.process(message, &shutdown).await; drop(permit); });
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

    fn worker(&self) -> Worker<H> {
        Worker {
            group: self.group.clone(),
            handler: Arc::clone(&self.handler),
            holder: self.options.holder.clone(),
            stats: Arc::clone(&self.stats),
        }
    }
}

/// Everything one delivery task needs: claim, deliver with lock renewal, settle.
pub(crate) struct Worker<H> {
    pub(crate) group: Group,
    pub(crate) handler: Arc<H>,
    pub(crate) holder: String,
    pub(crate) stats: Arc<ConsumerStats>,
}

impl<H: Handler> Worker<H> {
    /// Claims, delivers and settles a message read from the change feed. Returns whether its
    /// fate is recorded in the database; when it is not (Cosmos kept failing until `give_up`),
    /// the caller must not checkpoint past it, so the feed brings it back.
    pub(crate) async fn process(&self, message: Message, give_up: &CancellationToken) -> bool {
        let mut failures = 0;
        let token = crate::group::new_lock_token();
        loop {
            match self
                .group
                .claim_with_token(&message, &self.holder, &token)
                .await
            {
                Ok(ClaimOutcome::Claimed(claim)) => {
                    return self.deliver(message, claim, give_up).await
                }
                // Ordered groups hold the key: wait for the earlier holder's lock to expire or
                // the message's time to come, then try again; the key's later messages wait.
                Ok(ClaimOutcome::Held { until, .. }) if self.group.config().ordered => {
                    self.wait_until(until.unwrap_or(0)).await
                }
                Ok(ClaimOutcome::NotYetDue { due }) if self.group.config().ordered => {
                    self.wait_until(due).await
                }
                Ok(other) => {
                    debug!(message_id = %message.id, outcome = ?other, "not claimed");
                    return true;
                }
                // Nothing is recorded yet and the feed has moved on: keep trying.
                Err(e) => {
                    if !self
                        .keep_trying("claim", &message.id, e, &mut failures, None, give_up)
                        .await
                    {
                        return false;
                    }
                }
            }
        }
    }

    /// After a failed write: waits its back-off and says whether to try again. Gives up when
    /// `give_up` fires or at `deadline` (epoch ms). The first failure of a message is a
    /// warning with its context; repeats are debug, so a storm of errors logs once per message.
    async fn keep_trying(
        &self,
        step: &str,
        message_id: &str,
        e: QueueError,
        failures: &mut u32,
        deadline: Option<i64>,
        give_up: &CancellationToken,
    ) -> bool {
        ConsumerStats::bump(&self.stats.errors);
        *failures += 1;
        if *failures == 1 {
            warn!(group = self.group.name(), message_id, step, error = %e, "step failed; retrying with back-off");
        } else {
            debug!(group = self.group.name(), message_id, step, attempt = *failures, error = %e, "step failed again");
        }
        let delay = RECORD_RETRY.backoff_random(*failures);
        let now = self.group.queue().clock().now_ms();
        if deadline.is_some_and(|d| now + crate::clock::duration_ms(delay) >= d) {
            warn!(
                group = self.group.name(),
                message_id,
                step,
                failures = *failures,
                "giving up before the lock expires; the message will be delivered again"
            );
            return false;
        }
        tokio::select! {
            biased;
            _ = give_up.cancelled() => {
                warn!(group = self.group.name(), message_id, step, failures = *failures, "stopped retrying; the message stays ahead of the checkpoint");
                false
            }
            _ = tokio::time::sleep(delay) => true,
        }
    }

    /// Sleeps until `epoch_ms` by the queue's clock, but looks again within a second: the
    /// holder usually settles long before its lock would expire.
    async fn wait_until(&self, epoch_ms: i64) {
        let now = self.group.queue().clock().now_ms();
        let wait = (epoch_ms - now).clamp(50, 1_000);
        tokio::time::sleep(Duration::from_millis(wait as u64)).await;
    }

    pub(crate) async fn process_due(&self, doc: StateDoc) {
        let (pk, id) = (doc.message_pk.clone(), doc.id.clone());
        // Read before taking over: a failed read then costs nothing, where after the take-over
        // it would burn one of the message's delivery attempts.
        let message = match self.group.queue().read_message(&pk, &id).await {
            Ok(message) => message,
            Err(e) => return self.failed("read message", &id, e),
        };
        let claim = match self.group.take_over(doc, &self.holder).await {
            Ok(ClaimOutcome::Claimed(claim)) => claim,
            Ok(ClaimOutcome::DeadLettered) => {
                ConsumerStats::bump(&self.stats.dead_lettered);
                return;
            }
            Ok(_) => return,
            Err(e) => return self.failed("claim", &id, e),
        };
        match message {
            Some(message) => {
                // The state document exists: at worst its lock expires and it comes back.
                self.deliver(message, claim, &CancellationToken::new())
                    .await;
            }
            None => {
                // Retention removed the message while it waited: record it where users look.
                warn!(group = self.group.name(), message_id = %id, "message expired before it could be delivered again");
                if let Err(e) = self
                    .group
                    .dead_letter(
                        &claim,
                        "MessageExpired",
                        "the message expired (TTL) before a successful delivery",
                    )
                    .await
                {
                    self.failed("dead-letter", &id, e);
                }
            }
        }
    }

    /// Returns whether the outcome (or the claim that brings the message back) is recorded.
    async fn deliver(
        &self,
        message: Message,
        mut claim: Claim,
        give_up: &CancellationToken,
    ) -> bool {
        let id = message.id.clone();
        let outcome = loop {
            ConsumerStats::bump(&self.stats.delivered);
            let delivery = Delivery {
                message: message.clone(),
                delivery_count: claim.attempt,
                group: self.group.name().into(),
                queue: self.group.queue().name().into(),
            };
            let outcome = self
                .holding(&mut claim, guarded(self.handler.handle(delivery)))
                .await;
            // Ordered groups retry in place, keeping the key, until the attempts run out.
            match outcome {
                Outcome::Retry { error, delay }
                    if self.group.config().ordered
                        && !self.group.config().retry.exhausted(claim.attempt) =>
                {
                    let backoff = delay
                        .unwrap_or_else(|| self.group.config().retry.backoff_random(claim.attempt));
                    if let Err(e) = self
                        .group
                        .retry_in_place(&mut claim, &self.holder, &error)
                        .await
                    {
                        // A claim exists (or, in stream mode, the lease fences the range):
                        // the lock's expiry or the feed brings the message back.
                        self.failed("retry", &id, e);
                        return claim.is_recorded();
                    }
                    ConsumerStats::bump(&self.stats.retried);
                    self.holding(&mut claim, tokio::time::sleep(backoff)).await;
                }
                other => break other,
            }
        };
        // Exclusive mode: the claim is recorded, so giving up at the lock's expiry loses
        // nothing (the sweep delivers it again); retrying until then spares the app a repeat.
        // Stream mode's first delivery has no state document: the outcome must be written.
        let deadline = claim.locked_until.filter(|_| claim.is_recorded());
        let mut failures = 0;
        loop {
            let settled = match &outcome {
                Outcome::Complete => self
                    .group
                    .complete(&claim)
                    .await
                    .map(|_| &self.stats.completed),
                Outcome::Retry { error, delay } => self
                    .group
                    .retry(&claim, error, *delay)
                    .await
                    .map(|r| match r {
                        RetryOutcome::Scheduled { .. } => &self.stats.retried,
                        RetryOutcome::DeadLettered => &self.stats.dead_lettered,
                    }),
                Outcome::DeadLetter { reason, error } => self
                    .group
                    .dead_letter(&claim, reason, error)
                    .await
                    .map(|_| &self.stats.dead_lettered),
            };
            match settled {
                Ok(counter) => {
                    ConsumerStats::bump(counter);
                    return true;
                }
                Err(e @ QueueError::LockLost { .. }) => {
                    self.failed("settle", &id, e);
                    return true;
                }
                Err(e) => {
                    if !self
                        .keep_trying("settle", &id, e, &mut failures, deadline, give_up)
                        .await
                    {
                        return claim.is_recorded();
                    }
                }
            }
        }
    }

    /// Runs `work` while renewing the claim's lock, so the message stays ours however long
    /// the app takes (a failed renewal is reported when settling).
    async fn holding<T>(&self, claim: &mut Claim, work: impl Future<Output = T>) -> T {
        tokio::pin!(work);
        let renew_every = self.group.config().lock_duration / 3;
        loop {
            tokio::select! {
                out = &mut work => return out,
                _ = tokio::time::sleep(renew_every), if claim.locked_until.is_some() => {
                    if let Err(e) = self.group.renew(claim).await {
                        warn!(group = self.group.name(), message_id = %claim.message_id, error = %e, "lock renewal failed");
                    }
                }
            }
        }
    }

    fn failed(&self, step: &str, message_id: &str, e: QueueError) {
        if matches!(e, QueueError::LockLost { .. }) {
            ConsumerStats::bump(&self.stats.lock_lost);
            warn!(group = self.group.name(), message_id, step, error = %e, "outcome not recorded: lock lost");
        } else {
            ConsumerStats::bump(&self.stats.errors);
            // The message stays where it was (unclaimed, or locked until expiry), so the
            // sweep or the feed brings it back: nothing is lost.
            warn!(group = self.group.name(), message_id, step, error = %e, "step failed; the message will be delivered again");
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
