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
use crate::group::{Claim, ClaimOutcome, Group, RetryOutcome};
use crate::message::{Message, MessageKey};
use crate::state::{StateDoc, REASON_PERMANENT_ERROR};

/// Back-off between attempts to record a message's fate after a Cosmos error the SDK did not
/// retry away (a long 429 storm, 503s, timeouts, resets).
const RECORD_RETRY: RetryPolicy = RetryPolicy {
    max_delivery_attempts: u32::MAX,
    initial_backoff: Duration::from_millis(50),
    max_backoff: Duration::from_secs(5),
    multiplier: 2.0,
    jitter: 0.2,
};

/// Back-off between attempts to renew a lock after a failed renewal: soon, since the lock is
/// running out.
const RENEW_RETRY: RetryPolicy = RetryPolicy {
    max_delivery_attempts: u32::MAX,
    initial_backoff: Duration::from_millis(200),
    max_backoff: Duration::from_secs(2),
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
    /// The app never saw the message (it refused the connection: not listening yet, or
    /// restarting): no delivery attempt is counted. Delivered again after `delay` (back-off
    /// when `None`) under the same claim; after a whole lock duration of this it counts as a
    /// failed attempt, so an app that never comes back still ends in retries and dead letters.
    Undelivered {
        error: String,
        delay: Option<Duration>,
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
    /// State documents left alone because this version cannot read them.
    pub unknown_state: AtomicU64,
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
                    match self.group.due(self.options.max_concurrency * 4, None).await {
                        Ok(docs) => for doc in docs {
                            let permit = tokio::select! {
                                p = Arc::clone(&permits).acquire_owned() => p.expect("semaphore never closes"),
                                _ = shutdown.cancelled() => break,
                            };
                            let mut permit = Permit::held(Arc::clone(&permits), permit);
                            let worker = self.worker();
                            tasks.spawn(async move { worker.process_due(doc, &mut permit).await; });
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
                                let worker = self.worker();
                                let shutdown = shutdown.clone();
                                tasks.spawn(async move { worker.process(message, &shutdown, &mut permit, false).await; });
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

/// What became of a message a delivery task was given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fate {
    /// The group is done with it (completed, dead-lettered), or it is not this task's to
    /// deliver (already settled, expired, a state another version owns).
    Settled,
    /// A state document brings it back (a retry, a schedule, a lock that will expire, another
    /// holder): the checkpoint may pass it, but it is not settled yet.
    Pending,
    /// Nothing is recorded (Cosmos kept failing until the range stopped): the checkpoint must
    /// stay before it so the range's next reader delivers it.
    Unrecorded,
}

impl Fate {
    pub(crate) fn is_recorded(self) -> bool {
        self != Fate::Unrecorded
    }
}

/// A delivery permit that its task gives back while it only waits (for a schedule, a back-off
/// or the previous message of its key), so waiting never blocks working.
pub(crate) struct Permit {
    permits: Arc<Semaphore>,
    held: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Permit {
    /// Waits for a permit.
    pub(crate) async fn acquire(permits: Arc<Semaphore>) -> Self {
        let held = Arc::clone(&permits)
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        Self {
            permits,
            held: Some(held),
        }
    }

    pub(crate) fn held(permits: Arc<Semaphore>, held: tokio::sync::OwnedSemaphorePermit) -> Self {
        Self {
            permits,
            held: Some(held),
        }
    }

    /// Runs `wait` without the permit, then takes one again.
    async fn released_while<T>(&mut self, wait: impl Future<Output = T>) -> T {
        self.held = None;
        let out = wait.await;
        self.held = Some(
            Arc::clone(&self.permits)
                .acquire_owned()
                .await
                .expect("the semaphore is never closed"),
        );
        out
    }
}

/// Longest pause between looks at a message another holder has (ordered groups): its holder
/// usually settles long before the lock would expire.
const HELD_POLL_MAX: Duration = Duration::from_secs(5);

/// The pause before the `n`-th look at a message another holder has: 200 ms, doubling, up to
/// [`HELD_POLL_MAX`].
fn look_again_after(n: u32) -> Duration {
    Duration::from_millis(100 << n.min(6)).min(HELD_POLL_MAX)
}

/// Everything one delivery task needs: claim, deliver with lock renewal, settle.
pub(crate) struct Worker<H> {
    pub(crate) group: Group,
    pub(crate) handler: Arc<H>,
    pub(crate) holder: String,
    pub(crate) stats: Arc<ConsumerStats>,
}

impl<H: Handler> Worker<H> {
    /// Claims, delivers and settles a message read from the change feed. When its fate is
    /// [`Fate::Unrecorded`] (Cosmos kept failing until `give_up`), the caller must not
    /// checkpoint past it, so the feed brings it back. `check_state`: look for a state document
    /// first even in stream mode (a range taken over from an owner that may have left one).
    pub(crate) async fn process(
        &self,
        message: Message,
        give_up: &CancellationToken,
        permit: &mut Permit,
        mut check_state: bool,
    ) -> Fate {
        let mut failures = 0;
        let mut held_polls = 0;
        let token = crate::state::new_lock_token();
        let ordered = self.group.config().ordered;
        loop {
            let claimed = if check_state {
                self.group
                    .claim_checked(&message, &self.holder, &token)
                    .await
            } else {
                self.group
                    .claim_with_token(&message, &self.holder, &token)
                    .await
            };
            match claimed {
                Ok(ClaimOutcome::Claimed(claim)) => {
                    return self.deliver(message, claim, give_up, permit).await
                }
                // Ordered groups hold the key: the key's later messages wait behind this one,
                // which waits (without a permit) for the earlier holder to settle or its lock
                // to expire, or for its time to come.
                // After a wait the message has a state document (the schedule, the other
                // holder's lock): the next attempt goes through it, in stream mode too, or a
                // stream claim would deliver past it and the document deliver it again.
                Ok(ClaimOutcome::Held { until, .. }) if ordered => {
                    check_state = true;
                    held_polls += 1;
                    let poll = look_again_after(held_polls);
                    let wait = self.until(until.unwrap_or(0)).min(poll);
                    if !self.wait(permit, wait, give_up).await {
                        return Fate::Pending; // its holder's document brings it back
                    }
                }
                Ok(ClaimOutcome::NotYetDue { due }) if ordered => {
                    check_state = true;
                    if !self.wait(permit, self.until(due), give_up).await {
                        return Fate::Pending; // its schedule brings it back
                    }
                }
                Ok(other) => {
                    debug!(message_id = %message.id, outcome = ?other, "not claimed");
                    return match other {
                        ClaimOutcome::Held { .. } | ClaimOutcome::NotYetDue { .. } => Fate::Pending,
                        _ => Fate::Settled,
                    };
                }
                Err(e @ QueueError::UnknownState { .. }) => {
                    ConsumerStats::bump(&self.stats.unknown_state);
                    warn!(group = self.group.name(), message_id = %message.id, error = %e, "left alone: another version of cosmosq owns this message's state");
                    return Fate::Settled;
                }
                Err(e) if e.is_permanent() => return self.refused(&message, e).await,
                // Nothing is recorded yet and the feed has moved on: keep trying.
                Err(e) => {
                    if !self
                        .keep_trying("claim", &message.id, e, &mut failures, None, give_up)
                        .await
                    {
                        return Fate::Unrecorded;
                    }
                }
            }
        }
    }

    /// Returns once the group's state of a message says it is settled (or gone): what the
    /// next message of an ordered key waits for when this one's fate was left to its state
    /// document. Looks again with back-off, holding no permit.
    pub(crate) async fn settled(&self, key: &MessageKey, message_id: &str) {
        let mut looks = 0;
        loop {
            match self.group.read_state(key, message_id).await {
                Ok(None) => return,
                Ok(Some(doc)) if doc.state.is_settled() => return,
                Err(QueueError::UnknownState { .. }) => return,
                Ok(Some(_)) | Err(_) => {}
            }
            looks += 1;
            let wait = look_again_after(looks);
            tokio::time::sleep(wait).await;
        }
    }

    /// The claim of `message` can never be written (Cosmos refused it as a request): it goes
    /// to the dead letters with the cause, instead of being retried forever.
    async fn refused(&self, message: &Message, cause: QueueError) -> Fate {
        let error = format!("the claim was refused: {cause}");
        match self
            .group
            .dead_letter_unclaimed(message, REASON_PERMANENT_ERROR, &error)
            .await
        {
            Ok(()) => {
                ConsumerStats::bump(&self.stats.dead_lettered);
                Fate::Settled
            }
            Err(e) => {
                ConsumerStats::bump(&self.stats.errors);
                error!(group = self.group.name(), message_id = %message.id, cause = %cause, error = %e, "the message can be neither claimed nor dead-lettered; it stays ahead of the checkpoint");
                Fate::Unrecorded
            }
        }
    }

    /// How long until `epoch_ms` by the queue's clock.
    fn until(&self, epoch_ms: i64) -> Duration {
        let now = self.group.queue().clock().now_ms();
        Duration::from_millis((epoch_ms - now).max(0) as u64)
    }

    /// Waits `wait` without the permit; `false` when `give_up` fired first.
    async fn wait(&self, permit: &mut Permit, wait: Duration, give_up: &CancellationToken) -> bool {
        permit
            .released_while(async {
                tokio::select! {
                    biased;
                    _ = give_up.cancelled() => false,
                    _ = tokio::time::sleep(wait) => true,
                }
            })
            .await
    }

    /// After a failed write: waits its back-off and says whether to try again. Gives up on a
    /// permanent error, when `give_up` fires or at `deadline` (epoch ms). The first failure of
    /// a message is a warning with its context; repeats are debug, so a storm of errors logs
    /// once per message.
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
        if e.is_permanent() {
            error!(group = self.group.name(), message_id, step, error = %e, "step refused; not retrying it");
            return false;
        }
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

    pub(crate) async fn process_due(&self, doc: StateDoc, permit: &mut Permit) {
        let (pk, id) = (doc.message_pk.clone(), doc.id.clone());
        // Take over first, then read the message: of the hosts that found the same document,
        // only the one that won reads its body (the others lose on the ETag at a fraction of
        // the cost). A take-over whose answer was lost may have taken effect: tried again with
        // the same token on the document as it now is, it is recognised as ours instead of
        // burning the attempt it recorded (bounded by a lock duration, after which the sweep
        // finds it again). whose answer was lost may have taken effect: tried again with the same
        // token on the document as it now is, it is recognised as ours instead of burning the
        // attempt it recorded (bounded by a lock duration, after which the sweep finds it).
        let token = crate::state::new_lock_token();
        let deadline = self.group.queue().clock().now_ms()
            + crate::clock::duration_ms(self.group.config().lock_duration);
        let (mut doc, mut failures) = (Some(doc), 0);
        let claim = loop {
            let current = match doc.take() {
                Some(doc) => doc,
                None => match self.group.read_state(&pk, &id).await {
                    Ok(Some(doc)) => doc,
                    Ok(None) => return,
                    Err(e) => return self.failed("claim", &id, e),
                },
            };
            match self
                .group
                .take_over_with_token(current, &self.holder, &token)
                .await
            {
                Ok(ClaimOutcome::Claimed(claim)) => break claim,
                Ok(ClaimOutcome::DeadLettered) => {
                    ConsumerStats::bump(&self.stats.dead_lettered);
                    return;
                }
                Ok(_) => return,
                Err(e) => {
                    let never = CancellationToken::new();
                    if !self
                        .keep_trying("claim", &id, e, &mut failures, Some(deadline), &never)
                        .await
                    {
                        return;
                    }
                }
            }
        };
        let message = match self.group.queue().read_message(&pk, &id).await {
            Ok(message) => message,
            Err(e) => {
                // Nothing was delivered: give the message back without counting the attempt.
                self.failed("read message", &id, e);
                if let Err(e) = self.group.release(&claim).await {
                    self.failed("release", &id, e);
                }
                return;
            }
        };
        match message {
            Some(message) => {
                // The state document exists: at worst its lock expires and it comes back.
                self.deliver(message, claim, &CancellationToken::new(), permit)
                    .await;
            }
            None => {
                // Retention removed the message while it waited: record it where users look.
                warn!(group = self.group.name(), message_id = %id, "message expired before it could be delivered again");
                if let Err(e) = self
                    .group
                    .dead_letter(
                        &claim,
                        crate::state::REASON_EXPIRED,
                        "the message expired (TTL) before a successful delivery",
                    )
                    .await
                {
                    self.failed("dead-letter", &id, e);
                }
            }
        }
    }

    async fn deliver(
        &self,
        message: Message,
        mut claim: Claim,
        give_up: &CancellationToken,
        permit: &mut Permit,
    ) -> Fate {
        let id = message.id.clone();
        let mut undelivered_since: Option<tokio::time::Instant> = None;
        let outcome = loop {
            ConsumerStats::bump(&self.stats.delivered);
            let delivery = Delivery {
                message: message.clone(),
                delivery_count: claim.attempt,
                group: self.group.name().into(),
                queue: self.group.queue().name().into(),
            };
            let Some(outcome) = self
                .holding(&mut claim, guarded(self.handler.handle(delivery)))
                .await
            else {
                return Fate::Pending; // another holder has it now
            };
            // Ordered groups retry in place, keeping the key, until the attempts run out.
            match outcome {
                Outcome::Undelivered { error, delay }
                    if undelivered_since
                        .get_or_insert_with(tokio::time::Instant::now)
                        .elapsed()
                        < self.group.config().lock_duration =>
                {
                    debug!(group = self.group.name(), message_id = %id, %error, "not delivered (the app is not listening); trying again");
                    let backoff = delay.unwrap_or_else(|| RECORD_RETRY.backoff_random(3));
                    if self
                        .holding(&mut claim, tokio::time::sleep(backoff))
                        .await
                        .is_none()
                    {
                        return Fate::Pending;
                    }
                }
                Outcome::Undelivered { error, delay } => {
                    break Outcome::Retry {
                        error: format!("{error} for a whole lock duration"),
                        delay,
                    }
                }
                Outcome::Retry { error, delay }
                    if self.group.config().ordered
                        && !self.group.config().retry.exhausted(claim.attempt) =>
                {
                    let backoff = delay
                        .unwrap_or_else(|| self.group.config().retry.backoff_random(claim.attempt));
                    if let Some(fate) = self.retry_in_place(&mut claim, &error, give_up).await {
                        return fate;
                    }
                    ConsumerStats::bump(&self.stats.retried);
                    let wait = permit.released_while(tokio::time::sleep(backoff));
                    if self.holding(&mut claim, wait).await.is_none() {
                        return Fate::Pending;
                    }
                }
                other => break other,
            }
        };
        // A recorded claim keeps trying until its lock's expiry, even while the range drains:
        // giving up earlier would throw the app's answer away and burn an attempt, while at the
        // expiry the sweep delivers it again and nothing is lost. Stream mode's first delivery
        // has no state document: the outcome must be written before the range lets go.
        let (deadline, give_up) = match claim.locked_until.filter(|_| claim.is_recorded()) {
            Some(until) => (Some(until), &CancellationToken::new()),
            None => (None, give_up),
        };
        let mut failures = 0;
        loop {
            let settled = match &outcome {
                Outcome::Complete => self
                    .group
                    .complete(&claim)
                    .await
                    .map(|_| (&self.stats.completed, Fate::Settled)),
                Outcome::Retry { error, delay } | Outcome::Undelivered { error, delay } => self
                    .group
                    .retry(&claim, error, *delay)
                    .await
                    .map(|r| match r {
                        RetryOutcome::Scheduled { .. } => (&self.stats.retried, Fate::Pending),
                        RetryOutcome::DeadLettered => (&self.stats.dead_lettered, Fate::Settled),
                    }),
                Outcome::DeadLetter { reason, error } => self
                    .group
                    .dead_letter(&claim, reason, error)
                    .await
                    .map(|_| (&self.stats.dead_lettered, Fate::Settled)),
            };
            match settled {
                Ok((counter, fate)) => {
                    ConsumerStats::bump(counter);
                    return fate;
                }
                Err(e @ QueueError::LockLost { .. }) => {
                    self.failed("settle", &id, e);
                    return Fate::Pending;
                }
                Err(e) => {
                    if !self
                        .keep_trying("settle", &id, e, &mut failures, deadline, give_up)
                        .await
                    {
                        return if claim.is_recorded() {
                            Fate::Pending
                        } else {
                            Fate::Unrecorded
                        };
                    }
                }
            }
        }
    }

    /// Records a failed delivery of an ordered group and keeps the message (and its key):
    /// retried through transient errors until the lock's expiry (the range's stop, for a
    /// stream first delivery that has no lock yet). `Some(fate)` when the message is no longer
    /// this task's to deliver.
    async fn retry_in_place(
        &self,
        claim: &mut Claim,
        error: &str,
        give_up: &CancellationToken,
    ) -> Option<Fate> {
        let mut failures = 0;
        loop {
            let deadline = claim.locked_until.filter(|_| claim.is_recorded());
            match self.group.retry_in_place(claim, &self.holder, error).await {
                Ok(()) => return None,
                Err(e @ QueueError::LockLost { .. }) => {
                    self.failed("retry", &claim.message_id, e);
                    return Some(Fate::Pending);
                }
                Err(e) => {
                    if !self
                        .keep_trying(
                            "retry",
                            &claim.message_id,
                            e,
                            &mut failures,
                            deadline,
                            give_up,
                        )
                        .await
                    {
                        return Some(if claim.is_recorded() {
                            Fate::Pending
                        } else {
                            Fate::Unrecorded
                        });
                    }
                }
            }
        }
    }

    /// Runs `work` while renewing the claim's lock, so the message stays ours however long
    /// the app takes. Renewals are timed from the lock's expiry (a third of the lock before
    /// it), and a failed one is tried again soon (429s, timeouts) rather than a whole interval
    /// later. `None` when the lock is lost to another holder: `work` (the app's call) is then
    /// dropped, since its answer could no longer be recorded.
    async fn holding<T>(&self, claim: &mut Claim, work: impl Future<Output = T>) -> Option<T> {
        tokio::pin!(work);
        let third = crate::clock::duration_ms(self.group.config().lock_duration / 3);
        let mut failures = 0;
        loop {
            let wait = match claim.locked_until {
                Some(until) if failures == 0 => self.until(until - third),
                Some(until) => RENEW_RETRY
                    .backoff_random(failures)
                    .min(self.until(until).max(Duration::from_millis(10))),
                None => Duration::ZERO,
            };
            tokio::select! {
                out = &mut work => return Some(out),
                _ = tokio::time::sleep(wait), if claim.locked_until.is_some() => {
                    match self.group.renew(claim).await {
                        Ok(()) => failures = 0,
                        Err(e @ QueueError::LockLost { .. }) => {
                            self.failed("renew", &claim.message_id.clone(), e);
                            return None;
                        }
                        Err(e) => {
                            failures += 1;
                            ConsumerStats::bump(&self.stats.errors);
                            if failures == 1 {
                                warn!(group = self.group.name(), message_id = %claim.message_id, error = %e, "lock renewal failed; retrying soon");
                            }
                        }
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
