//! A message's delivery task: claim it (exclusive mode), hand it to the handler while the
//! lock is renewed, and record the outcome — retrying writes until the lock runs out, so a
//! Cosmos outage never loses a settled message. Ordered groups and waits (schedules, messages
//! another holder has) are handled here too; the range's loop (`range.rs`) decides when a task
//! starts and what its fate means for the checkpoint.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{oneshot, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, warn};

use crate::backoff::RetryPolicy;
use crate::buggify::{self, Bug};
use crate::checkpoint::Fate;
use crate::error::QueueError;
use crate::group::{Claim, ClaimOutcome, Group, RetryOutcome};
use crate::handler::{ConsumerStats, Delivery, Handler, LockedUntil, Outcome};
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
                reason: format!("the handler panicked: {what}"),
                delay: None,
            }
        }
    }
}

/// How a delivery task claims its message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    /// Read from the feed for the first time: lease-fenced where the group's path is, a
    /// claim otherwise.
    Feed,
    /// Look for a state document first (a range taken over from an owner that may have left
    /// one, or a message that waited for another holder).
    Checked,
    /// Its range's last owner handed it out and recorded no outcome: a redelivery.
    Recovered,
    /// A lock of its own (a state document) whatever the group's path: its range's last owner
    /// may have started it unlisted and may yet record its completion by a state document
    /// (see `RangeProcessor::complete_by_documents`). The two creates exclude each other, so
    /// the message is completed once: by the one, or delivered by the other.
    Locked,
}

/// Long work stops holding its range (exclusive groups): a delivery still under way after
/// `after`, or at once when `now` fires (the range drains or is handed over), lets its page
/// pass it — one whose only lock is the range's lease first gets a lock of its own.
pub(crate) struct Promotion {
    pub(crate) after: Duration,
    pub(crate) now: CancellationToken,
    /// Told once the delivery holds the range no more.
    pub(crate) promoted: Option<oneshot::Sender<()>>,
}

/// The range's lease as the lock of a first delivery (the lease write path): nothing is
/// written for it unless it runs long or the range moves.
pub(crate) struct LeaseLock {
    /// The lease is lost: the call is cut (its answer could no longer be recorded, and the
    /// range's next owner delivers it again).
    pub(crate) lost: CancellationToken,
    /// Until when the lease is surely this host's (its last write plus the expiry others judge
    /// it by, minus a margin; monotonic): the call is cut past it.
    pub(crate) held: super::ordered_watch::Receiver<Instant>,
}

/// What a delivery keeps an eye on while the app works.
pub(crate) struct Watch {
    pub(crate) promotion: Option<Promotion>,
    /// `Some` while the claim has no state document and the lease is its lock.
    pub(crate) lease: Option<LeaseLock>,
    pub(crate) locked_until: LockedUntil,
    /// Set once the app may have had the message (a call went out and was not refused): a
    /// delivery nothing could be recorded for is then delivered again as a redelivery.
    pub(crate) reached: Arc<std::sync::atomic::AtomicBool>,
    started: Instant,
}

impl Watch {
    pub(crate) fn new(
        promotion: Option<Promotion>,
        lease: Option<LeaseLock>,
        locked_until: LockedUntil,
        reached: Arc<std::sync::atomic::AtomicBool>,
    ) -> Self {
        Self {
            promotion,
            lease,
            locked_until,
            reached,
            started: Instant::now(),
        }
    }

    /// Resolves when the delivery is due to stop holding its range; never when it does not.
    async fn promotion_due(promotion: &Option<Promotion>, started: Instant) {
        match promotion {
            Some(p) => tokio::select! {
                biased;
                _ = tokio::time::sleep_until(started + p.after) => {}
                _ = p.now.cancelled() => {}
            },
            None => std::future::pending().await,
        }
    }

    /// Tells the range the delivery holds it no more.
    fn promoted(&mut self) {
        if let Some(tx) = self.promotion.take().and_then(|p| p.promoted) {
            let _ = tx.send(());
        }
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
    pub(crate) async fn released_while<T>(&mut self, wait: impl Future<Output = T>) -> T {
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

/// How soon the sweep looks again at a message parked behind its key's predecessors.
const PARKED_LOOK_AGAIN: Duration = Duration::from_secs(1);

/// Longest pause between looks at a message another holder has (ordered groups): its holder
/// usually settles long before the lock would expire.
const HELD_POLL_MAX: Duration = Duration::from_secs(5);

/// The pause before the `n`-th look at a message another holder has: 200 ms, doubling, up to
/// [`HELD_POLL_MAX`].
fn look_again_after(n: u32) -> Duration {
    Duration::from_millis(100 << n.min(6)).min(HELD_POLL_MAX)
}

/// Everything one delivery task needs: claim, deliver with lock renewal, settle.
pub(crate) struct Deliverer<H> {
    pub(crate) group: Group,
    pub(crate) handler: Arc<H>,
    pub(crate) owner: String,
    pub(crate) stats: Arc<ConsumerStats>,
}

impl<H: Handler> Deliverer<H> {
    /// Claims, delivers and settles a message read from the change feed. When its fate is
    /// [`Fate::Unrecorded`] (Cosmos kept failing until `give_up`), the caller must not
    /// checkpoint past it, so the feed brings it back. `path` says how to claim it: from the
    /// feed, after looking for a state document first (even in stream mode), as a redelivery,
    /// or under a lock of its own (see [`Route`]).
    pub(crate) async fn process(
        &self,
        message: Message,
        give_up: &CancellationToken,
        permit: &mut Permit,
        mut path: Route,
        mut watch: Watch,
    ) -> Fate {
        let mut failures = 0;
        let mut held_polls = 0;
        let token = crate::state::new_lock_token();
        let ordered = self.group.config().ordered;
        let fenced = self.group.config().lease_fenced();
        loop {
            let claimed = match path {
                Route::Checked => {
                    self.group
                        .claim_checked_as(&message, &self.owner, &token, fenced)
                        .await
                }
                Route::Feed => {
                    self.group
                        .claim_as(&message, &self.owner, &token, fenced)
                        .await
                }
                Route::Recovered => {
                    self.group
                        .claim_recovered(&message, &self.owner, &token, 1)
                        .await
                }
                // The defect: as any message its owner may have left a state of.
                Route::Locked if buggify::on(Bug::LateCompletionRace) => {
                    self.group
                        .claim_checked_as(&message, &self.owner, &token, fenced)
                        .await
                }
                Route::Locked => {
                    self.group
                        .claim_as(&message, &self.owner, &token, false)
                        .await
                }
            };
            match claimed {
                Ok(ClaimOutcome::Claimed(mut claim)) => {
                    if !self.fresh_lock(&mut claim).await {
                        return Fate::Pending; // its state document brings it back
                    }
                    if claim.is_recorded() {
                        watch.lease = None;
                    }
                    return self
                        .deliver(message, claim, give_up, permit, watch, &token)
                        .await;
                }
                Ok(ClaimOutcome::DeadLettered) => {
                    ConsumerStats::bump(&self.stats.dead_lettered);
                    return Fate::Settled;
                }
                // Ordered groups hold the key: the key's later messages wait behind this one,
                // which waits (without a permit) for the earlier holder to settle or its lock
                // to expire, or for its time to come.
                // After a wait the message has a state document (the schedule, the other
                // holder's lock): the next attempt goes through it, in stream mode too, or a
                // stream claim would deliver past it and the document deliver it again.
                Ok(ClaimOutcome::Held { until, .. }) if ordered => {
                    path = Route::Checked;
                    held_polls += 1;
                    let poll = look_again_after(held_polls);
                    let wait = self.until(until.unwrap_or(0)).min(poll);
                    if !self.wait(permit, wait, give_up).await {
                        return Fate::Pending; // its holder's document brings it back
                    }
                }
                Ok(ClaimOutcome::NotYetDue { due }) if ordered => {
                    path = Route::Checked;
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

    /// Returns once the group's state of each message `ids` of `key` says it is settled (or
    /// gone): what the next message of an ordered key waits for when its predecessors' fate
    /// was left to their state documents. Looks again with back-off, holding no permit.
    pub(crate) async fn all_settled(&self, key: &MessageKey, ids: &[String]) {
        let mut looks = 0;
        loop {
            if let Ok(true) = self.predecessors_settled(key, ids).await {
                return;
            }
            looks += 1;
            tokio::time::sleep(look_again_after(looks)).await;
        }
    }

    /// Whether every message `ids` of `key` is settled (or gone).
    pub(crate) async fn predecessors_settled(
        &self,
        key: &MessageKey,
        ids: &[String],
    ) -> crate::error::Result<bool> {
        for id in ids {
            match self.group.read_doc(key, id).await {
                Ok(Some(doc)) if !doc.state.is_settled() => return Ok(false),
                Ok(_) | Err(QueueError::UnknownState { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(true)
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
            Ok(true) => {
                ConsumerStats::bump(&self.stats.dead_lettered);
                Fate::Settled
            }
            // Another state of it stands (a lock, a schedule): that one brings it back.
            Ok(false) => Fate::Pending,
            Err(e) => {
                ConsumerStats::bump(&self.stats.errors);
                error!(group = self.group.name(), message_id = %message.id, cause = %cause, error = %e, "the message can be neither claimed nor dead-lettered; it stays ahead of the checkpoint");
                Fate::Unrecorded
            }
        }
    }

    /// How long until `epoch_ms` by the queue's clock.
    pub(crate) fn until(&self, epoch_ms: i64) -> Duration {
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

    /// A claim whose write took longer than much of its lock (the SDK held a throttled create
    /// or replace for seconds; its lock was stamped before it was sent) holds a lock about to
    /// run out, or already run out, before the app has the message: it is renewed first.
    /// `false` when it cannot be: another holder took it (its delivery now), or the renewal
    /// failed and the message is given back undelivered, its attempt not counted.
    async fn fresh_lock(&self, claim: &mut Claim) -> bool {
        let lock = crate::clock::duration_ms(self.group.config().lock_duration);
        let now = self.group.queue().clock().now_ms();
        let stale = claim.is_recorded()
            && claim
                .locked_until
                .is_some_and(|until| until - now < lock / 2);
        if !stale {
            return true;
        }
        match self.group.renew(claim).await {
            Ok(()) => true,
            Err(e @ QueueError::LockLost { .. }) => {
                debug!(group = self.group.name(), message_id = %claim.message_id, error = %e, "its lock ran out while it was written, and another holder took it");
                false
            }
            Err(e) => {
                self.failed(
                    "renew a lock that ran out while it was written",
                    &claim.message_id,
                    e,
                );
                if let Err(e) = self.group.release(claim).await {
                    self.failed("release", &claim.message_id, e);
                }
                false
            }
        }
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
        // Parked behind earlier messages of its key (ordered groups): not before they settle.
        if !doc.waits_for.is_empty() {
            match self.predecessors_settled(&pk, &doc.waits_for).await {
                Ok(true) => {}
                Ok(false) => {
                    debug!(group = self.group.name(), message_id = %id, waits_for = ?doc.waits_for, "parked: its key's earlier messages are not settled yet");
                    if let Err(e) = self.group.postpone(doc, PARKED_LOOK_AGAIN).await {
                        self.failed("postpone", &id, e);
                    }
                    return;
                }
                Err(e) => return self.failed("read predecessors", &id, e),
            }
        }
        // Take over first, then read the message: of the hosts that found the same document,
        // only the one that won reads its body (the others lose on the ETag at a fraction of
        // the cost). A take-over whose answer was lost may have taken effect: tried again with
        // the same token on the document as it now is, it is recognised as ours instead of
        // burning the attempt it recorded (bounded by a lock duration, after which the sweep
        // finds it again).
        let token = crate::state::new_lock_token();
        let deadline = self.group.queue().clock().now_ms()
            + crate::clock::duration_ms(self.group.config().lock_duration);
        let (mut doc, mut failures) = (Some(doc), 0);
        let claim = loop {
            let current = match doc.take() {
                Some(doc) => doc,
                None => match self.group.read_doc(&pk, &id).await {
                    Ok(Some(doc)) => doc,
                    Ok(None) => return,
                    Err(e) => return self.failed("claim", &id, e),
                },
            };
            match self
                .group
                .take_over_with_token(current, &self.owner, &token)
                .await
            {
                Ok(ClaimOutcome::Claimed(mut claim)) => match self.fresh_lock(&mut claim).await {
                    true => break claim,
                    false => return,
                },
                Ok(ClaimOutcome::DeadLettered) => {
                    ConsumerStats::bump(&self.stats.dead_lettered);
                    return;
                }
                Ok(other) => {
                    debug!(group = self.group.name(), message_id = %id, outcome = ?other, "due, not claimed");
                    return;
                }
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
                let token = claim
                    .state
                    .as_ref()
                    .and_then(|s| s.lock_token.clone())
                    .unwrap_or_default();
                let watch = Watch::new(None, None, LockedUntil::default(), Arc::default());
                self.deliver(
                    message,
                    claim,
                    &CancellationToken::new(),
                    permit,
                    watch,
                    &token,
                )
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
        mut watch: Watch,
        token: &str,
    ) -> Fate {
        let id = message.id.clone();
        if let Some(until) = claim.locked_until.filter(|_| claim.is_recorded()) {
            watch.locked_until.set(until);
        }
        let mut undelivered_since: Option<tokio::time::Instant> = None;
        // Exclusive groups: a delivery the app never saw (it refused the connection) is not
        // counted while it waits to be tried again, so that a holder that dies meanwhile leaves
        // the count at what the app saw; it is counted again as the next try starts.
        let exclusive = self.group.config().mode == crate::config::DeliveryMode::Exclusive;
        let mut uncounted = false;
        let outcome = loop {
            if uncounted {
                if let Some(fate) = self.next_attempt(&mut claim, give_up).await {
                    return fate;
                }
                uncounted = false;
            }
            ConsumerStats::bump(&self.stats.delivered);
            // What the app is told its lock is: the claim's as now renewed (an in-place retry
            // or a counted attempt moved it).
            if let Some(until) = claim.locked_until.filter(|_| claim.is_recorded()) {
                watch.locked_until.set(until);
            }
            let delivery = Delivery {
                message: message.clone(),
                delivery_count: claim.attempt,
                group: self.group.name().into(),
                queue: self.group.queue().name().into(),
                locked_until: watch.locked_until.clone(),
            };
            watch
                .reached
                .store(true, std::sync::atomic::Ordering::SeqCst);
            let outcome = match self
                .holding(
                    &mut claim,
                    &mut watch,
                    token,
                    guarded(self.handler.handle(delivery)),
                )
                .await
            {
                Ok(outcome) => outcome,
                Err(fate) => return fate,
            };
            if matches!(outcome, Outcome::Undelivered { .. }) {
                watch
                    .reached
                    .store(false, std::sync::atomic::Ordering::SeqCst);
            } else if !buggify::on(Bug::RefusalsNeverForgotten) {
                // The app had it: a later refusal (an in-place retry of an ordered group, once
                // the app restarts) starts its own lock duration.
                undelivered_since = None;
            }
            // Ordered groups retry in place, keeping the key, until the attempts run out.
            match outcome {
                // The range stops and the app never saw it: give it back as it was, no
                // attempt counted (a recorded claim), or leave it before the checkpoint for
                // the range's next reader (an unrecorded one).
                Outcome::Undelivered { reason: error, .. } if give_up.is_cancelled() => {
                    debug!(group = self.group.name(), message_id = %id, %error, "not delivered before the range stopped; given back");
                    if !claim.is_recorded() {
                        return Fate::Unstarted;
                    }
                    if uncounted {
                        claim.attempt += 1; // what the release takes back was taken back already
                    }
                    if let Err(e) = self.group.release(&claim).await {
                        self.failed("release", &id, e);
                    }
                    return Fate::Pending;
                }
                Outcome::Undelivered {
                    reason: error,
                    delay,
                } if undelivered_since
                    .get_or_insert_with(tokio::time::Instant::now)
                    .elapsed()
                    < self.group.config().lock_duration =>
                {
                    debug!(group = self.group.name(), message_id = %id, %error, "not delivered (the app is not listening); trying again");
                    if exclusive && !uncounted {
                        if let Err(fate) = self.uncount(&mut claim, &mut watch, token).await {
                            return fate;
                        }
                        uncounted = true;
                    }
                    let backoff = delay.unwrap_or_else(|| RECORD_RETRY.backoff_random(3));
                    if let Err(fate) = self
                        .holding(&mut claim, &mut watch, token, tokio::time::sleep(backoff))
                        .await
                    {
                        return fate;
                    }
                }
                Outcome::Undelivered {
                    reason: error,
                    delay,
                } => {
                    // Refused for a whole lock duration: that counts as a failed attempt.
                    if uncounted {
                        if let Some(fate) = self.next_attempt(&mut claim, give_up).await {
                            return fate;
                        }
                    }
                    break Outcome::Retry {
                        reason: format!("{error} for a whole lock duration"),
                        delay,
                    };
                }
                // A range that stopped keeps nothing in place: the retry is recorded as any
                // other, and the range's next owner (its sweep) delivers it.
                Outcome::Retry {
                    reason: error,
                    delay,
                } if self.group.config().ordered
                    && !self.group.config().retry.exhausted(claim.attempt)
                    && !give_up.is_cancelled() =>
                {
                    let backoff = delay
                        .unwrap_or_else(|| self.group.config().retry.backoff_random(claim.attempt));
                    if let Some(fate) = self.retry_in_place(&mut claim, &error, give_up).await {
                        return fate;
                    }
                    ConsumerStats::bump(&self.stats.retried);
                    let began = tokio::time::Instant::now();
                    let wait = permit.released_while(async {
                        tokio::select! {
                            biased;
                            _ = tokio::time::sleep(backoff) => false,
                            _ = give_up.cancelled() => true,
                        }
                    });
                    match self.holding(&mut claim, &mut watch, token, wait).await {
                        Err(fate) => return fate,
                        Ok(true) => {
                            break Outcome::Retry {
                                reason: error,
                                delay: Some(backoff.saturating_sub(began.elapsed())),
                            }
                        }
                        Ok(false) => {}
                    }
                    // The next attempt is counted as it starts, not before the back-off: a
                    // holder that dies meanwhile leaves the count at what the app saw.
                    if let Some(fate) = self.next_attempt(&mut claim, give_up).await {
                        return fate;
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
        if outcome == Outcome::Complete
            && !claim.is_recorded()
            && self.group.config().lease_recorded()
        {
            return Fate::Completed; // the range records it with the lease
        }
        let mut failures = 0;
        loop {
            let settled = match &outcome {
                Outcome::Complete => self
                    .group
                    .complete(&claim)
                    .await
                    .map(|_| (&self.stats.completed, Fate::Settled)),
                Outcome::Retry {
                    reason: error,
                    delay,
                }
                | Outcome::Undelivered {
                    reason: error,
                    delay,
                } => self
                    .group
                    .retry(&claim, error, *delay)
                    .await
                    .map(|r| match r {
                        RetryOutcome::Scheduled { .. } => (&self.stats.retried, Fate::Pending),
                        RetryOutcome::DeadLettered => (&self.stats.dead_lettered, Fate::Settled),
                    }),
                Outcome::DeadLetter {
                    reason,
                    description: error,
                } => self
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
            match self.group.retry_in_place(claim, &self.owner, error).await {
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

    /// Takes back the attempt of a delivery the app refused (see `deliver`): the message keeps
    /// its lock (one of its own, if the range's lease was its lock) with the count of what the
    /// app saw. `Err(fate)` when the delivery must stop.
    async fn uncount(&self, claim: &mut Claim, watch: &mut Watch, token: &str) -> Result<(), Fate> {
        let lost = match &watch.lease {
            Some(lease) => lease.lost.clone(),
            None => CancellationToken::new(),
        };
        let was_recorded = claim.is_recorded();
        let mut failures = 0;
        loop {
            match self.group.uncount(claim, &self.owner, token).await {
                Ok(true) => {
                    if !was_recorded {
                        watch.lease = None;
                        watch.promoted();
                    }
                    if let Some(until) = claim.locked_until {
                        watch.locked_until.set(until);
                    }
                    return Ok(());
                }
                Ok(false) => return Err(Fate::Pending),
                Err(e @ QueueError::LockLost { .. }) => {
                    self.failed("take the attempt back", &claim.message_id, e);
                    return Err(Fate::Pending);
                }
                Err(e) => {
                    let deadline = claim.locked_until.filter(|_| claim.is_recorded());
                    if !self
                        .keep_trying(
                            "take the attempt back",
                            &claim.message_id,
                            e,
                            &mut failures,
                            deadline,
                            &lost,
                        )
                        .await
                    {
                        return Err(match claim.is_recorded() {
                            true => Fate::Pending,
                            false => Fate::Unrecorded,
                        });
                    }
                }
            }
        }
    }

    /// Counts the next in-place attempt of an ordered group's message before it starts.
    /// `Some(fate)` when the message is no longer this task's to deliver.
    async fn next_attempt(&self, claim: &mut Claim, give_up: &CancellationToken) -> Option<Fate> {
        let mut failures = 0;
        loop {
            let deadline = claim.locked_until;
            match self.group.next_attempt(claim).await {
                Ok(()) => return None,
                Err(e @ QueueError::LockLost { .. }) => {
                    self.failed("count the attempt", &claim.message_id, e);
                    return Some(Fate::Pending);
                }
                Err(e) => {
                    if !self
                        .keep_trying(
                            "count the attempt",
                            &claim.message_id,
                            e,
                            &mut failures,
                            deadline,
                            give_up,
                        )
                        .await
                    {
                        return Some(Fate::Pending);
                    }
                }
            }
        }
    }

    /// Runs `work` while keeping the message this holder's: under the range's lease (cut when
    /// the lease is lost or not renewed in time; given a lock of its own when the work runs
    /// long), then under its own lock, renewed a third of the lock before its expiry (timed
    /// from the expiry, not from the last attempt; a failed renewal is tried again soon). Long
    /// work stops holding its range (see [`Promotion`]). `Err(fate)` when the delivery must
    /// stop: `work` (the app's call) is then dropped, since its answer could no longer be
    /// recorded.
    async fn holding<T>(
        &self,
        claim: &mut Claim,
        watch: &mut Watch,
        token: &str,
        work: impl Future<Output = T>,
    ) -> Result<T, Fate> {
        tokio::pin!(work);
        while !claim.is_recorded() {
            let Some(lease) = watch.lease.as_mut() else {
                break;
            };
            let deadline = *lease.held.borrow_and_update();
            watch.locked_until.set(self.wall_ms(deadline));
            let lost = lease.lost.clone();
            let enforce = !buggify::on(Bug::StartUnderExpiredLease);
            tokio::select! {
                biased;
                _ = lost.cancelled() => {
                    debug!(group = self.group.name(), message_id = %claim.message_id, "lease lost mid-delivery; the call is cut (the range's next owner delivers it again)");
                    return Err(Fate::Unrecorded);
                }
                out = &mut work => return Ok(out),
                changed = lease.held.changed() => {
                    if changed.is_err() {
                        watch.lease = None; // the range is gone; `lost` says the rest
                    }
                    continue;
                }
                _ = tokio::time::sleep_until(deadline), if enforce => {
                    warn!(group = self.group.name(), message_id = %claim.message_id, "the range's lease was not renewed in time: its lock of this delivery ran out, and the call is cut");
                    return Err(Fate::Unrecorded);
                }
                _ = Watch::promotion_due(&watch.promotion, watch.started) => {}
            }
            self.promote(claim, watch, token).await?;
        }
        watch.lease = None;
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
                biased;
                out = &mut work => return Ok(out),
                _ = Watch::promotion_due(&watch.promotion, watch.started), if claim.is_recorded() && !buggify::on(Bug::RecordedClaimHoldsRange) => {
                    watch.promoted();
                }
                _ = tokio::time::sleep(wait), if claim.locked_until.is_some() => {
                    match self.group.renew(claim).await {
                        Ok(()) => {
                            failures = 0;
                            if let Some(until) = claim.locked_until {
                                watch.locked_until.set(until);
                            }
                        }
                        Err(e @ QueueError::LockLost { .. }) => {
                            self.failed("renew", &claim.message_id.clone(), e);
                            return Err(Fate::Pending);
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

    /// `deadline` (monotonic) as epoch ms by the queue's clock.
    fn wall_ms(&self, deadline: Instant) -> i64 {
        let now = Instant::now();
        let clock = self.group.queue().clock().now_ms();
        match deadline.checked_duration_since(now) {
            Some(ahead) => clock + crate::clock::duration_ms(ahead),
            None => clock - crate::clock::duration_ms(now - deadline),
        }
    }

    /// Gives a delivery whose lock is the range's lease a lock of its own (a `locked` state
    /// document with the same attempt count), retrying through transient errors while the
    /// lease holds. `Err(fate)` when the delivery must stop: a state document owns the message
    /// already (`Pending`), the lease was lost first (`Unrecorded`), or Cosmos DB refused the
    /// document for good — then the message goes to the dead letters with the cause, as a
    /// refused claim does, since nothing else would ever bring it back.
    async fn promote(&self, claim: &mut Claim, watch: &mut Watch, token: &str) -> Result<(), Fate> {
        let lost = match &watch.lease {
            Some(lease) => lease.lost.clone(),
            None => CancellationToken::new(),
        };
        let mut failures = 0;
        loop {
            match self.group.promote(claim, &self.owner, token).await {
                Ok(true) => {
                    debug!(group = self.group.name(), message_id = %claim.message_id, "the delivery has a lock of its own now");
                    watch.lease = None;
                    if let Some(until) = claim.locked_until {
                        watch.locked_until.set(until);
                    }
                    watch.promoted();
                    return Ok(());
                }
                Ok(false) => {
                    warn!(group = self.group.name(), message_id = %claim.message_id, "a state document owns the message; this delivery stops");
                    return Err(Fate::Pending);
                }
                Err(e) if e.is_permanent() => {
                    if buggify::on(Bug::PromoteRefusalForgotten) {
                        return Err(Fate::Pending);
                    }
                    ConsumerStats::bump(&self.stats.errors);
                    let error = format!("its lock could not be recorded: {e}");
                    return match self
                        .group
                        .dead_letter_unrecorded(claim, REASON_PERMANENT_ERROR, &error)
                        .await
                    {
                        Ok(true) => {
                            ConsumerStats::bump(&self.stats.dead_lettered);
                            Err(Fate::Settled)
                        }
                        // Another state of it stands (a lock, a schedule): that one brings it
                        // back.
                        Ok(false) => Err(Fate::Pending),
                        Err(dead) => {
                            error!(group = self.group.name(), message_id = %claim.message_id, cause = %e, error = %dead, "the message can be neither locked nor dead-lettered; it stays ahead of the checkpoint");
                            Err(Fate::Unrecorded)
                        }
                    };
                }
                Err(e) => {
                    if !self
                        .keep_trying("promote", &claim.message_id, e, &mut failures, None, &lost)
                        .await
                    {
                        return Err(Fate::Unrecorded);
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

    /// Another holder's message is looked at again soon, then less and less often.
    #[test]
    fn looks_at_a_held_message_back_off_to_a_cap() {
        let ms = Duration::from_millis;
        for (look, pause) in [
            (1, ms(200)),
            (2, ms(400)),
            (5, ms(3_200)),
            (6, HELD_POLL_MAX),
            (40, HELD_POLL_MAX),
        ] {
            assert_eq!(look_again_after(look), pause, "look {look}");
        }
    }

    /// Long work stops holding its range at `promoteAfter`, or at once when the range drains
    /// or is handed over, and never in a group that does not promote (paused time).
    #[tokio::test(start_paused = true)]
    async fn a_delivery_stops_holding_its_range_when_promotion_is_due() {
        let secs = Duration::from_secs_f64;
        /// A delivery promoted after so many seconds (or never), whose range drains at a
        /// time (or not), looked at after so many seconds: due or not.
        struct Case(&'static str, Option<f64>, Option<f64>, f64, bool);
        #[rustfmt::skip]
        let cases = [
            Case("not before promoteAfter", Some(5.0), None, 4.9, false),
            Case("at promoteAfter", Some(5.0), None, 5.1, true),
            Case("at once when the range drains", Some(5.0), Some(1.0), 1.1, true),
            Case("a drain after the look changes nothing", Some(5.0), Some(2.0), 1.1, false),
            Case("never in a group that does not promote", None, None, 3_600.0, false),
        ];
        for Case(what, after, drains_at, looked, due) in cases {
            let now = CancellationToken::new();
            let promotion = after.map(|after| Promotion {
                after: secs(after),
                now: now.clone(),
                promoted: None,
            });
            if let Some(at) = drains_at {
                tokio::spawn(async move {
                    tokio::time::sleep(secs(at)).await;
                    now.cancel();
                });
            }
            let started = Instant::now();
            let fired =
                tokio::time::timeout(secs(looked), Watch::promotion_due(&promotion, started))
                    .await
                    .is_ok();
            assert_eq!(fired, due, "{what}");
        }
    }
}
