//! A message's delivery task: claim it (exclusive mode), hand it to the handler while the
//! lock is renewed, and record the outcome — retrying writes until the lock runs out, so a
//! Cosmos outage never loses a settled message. Ordered groups and waits (schedules, messages
//! another holder has) are handled here too; the range's loop (`host.rs`) decides when a task
//! starts and what its fate means for the checkpoint.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, warn};

use crate::backoff::RetryPolicy;
use crate::consumer::{ConsumerStats, Delivery, Handler, Outcome};
use crate::error::QueueError;
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

/// What became of a message a delivery task was given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fate {
    /// The group is done with it (completed, dead-lettered), or it is not this task's to
    /// deliver (already settled, expired, a state another version owns).
    Settled,
    /// Completed with nothing written (the lease write path): the range records it with its
    /// next lease write.
    Completed,
    /// A state document brings it back (a retry, a schedule, a lock that will expire, another
    /// holder): the checkpoint may pass it, but it is not settled yet.
    Pending,
    /// Nothing is recorded (Cosmos kept failing until the range stopped): the checkpoint must
    /// stay before it so the range's next reader delivers it.
    Unrecorded,
    /// Never started: the range stopped before its turn came (nothing delivered).
    Unstarted,
}

impl Fate {
    /// The checkpoint's view of it.
    pub(crate) fn settle(self) -> crate::checkpoint::Settle {
        use crate::checkpoint::Settle;
        match self {
            Fate::Settled => Settle::Done,
            Fate::Completed => Settle::Completed,
            Fate::Pending => Settle::Pending,
            Fate::Unrecorded => Settle::Unrecorded,
            Fate::Unstarted => Settle::Unstarted,
        }
    }
}

/// How a delivery task claims its message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Path {
    /// Read from the feed for the first time: lease-fenced where the group's path is, a
    /// claim otherwise.
    Feed,
    /// Look for a state document first (a range taken over from an owner that may have left
    /// one, or a message that waited for another holder).
    Checked,
    /// Its range's last owner handed it out and recorded no outcome: a redelivery.
    Recovered,
}

/// What the range tells a lease-fenced delivery of the lease write path (nothing is written
/// for it unless it runs long or the range moves).
pub(crate) struct Fence {
    /// Give a delivery still under way after this long a lock of its own.
    pub(crate) promote_after: Duration,
    /// The range drains or is handed over: every delivery under way gets a lock of its own.
    pub(crate) promote_now: CancellationToken,
    /// The lease is lost: a delivery without a lock of its own is dropped (its answer could
    /// no longer be recorded, and the range's next owner delivers it again).
    pub(crate) lost: CancellationToken,
    /// Told once the delivery has a lock of its own (the range may pass it).
    pub(crate) promoted: Option<tokio::sync::oneshot::Sender<()>>,
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
pub(crate) struct Deliverer<H> {
    pub(crate) group: Group,
    pub(crate) handler: Arc<H>,
    pub(crate) owner: String,
    pub(crate) stats: Arc<ConsumerStats>,
}

impl<H: Handler> Deliverer<H> {
    /// Claims, delivers and settles a message read from the change feed. When its fate is
    /// [`Fate::Unrecorded`] (Cosmos kept failing until `give_up`), the caller must not
    /// checkpoint past it, so the feed brings it back. `check_state`: look for a state document
    /// first even in stream mode (a range taken over from an owner that may have left one).
    pub(crate) async fn process(
        &self,
        message: Message,
        give_up: &CancellationToken,
        permit: &mut Permit,
        mut path: Path,
        fence: Option<Fence>,
    ) -> Fate {
        let mut failures = 0;
        let mut held_polls = 0;
        let token = crate::state::new_lock_token();
        let ordered = self.group.config().ordered;
        let fenced = self.group.config().lease_fenced();
        loop {
            let claimed = match path {
                Path::Checked => {
                    self.group
                        .claim_checked_as(&message, &self.owner, &token, fenced)
                        .await
                }
                Path::Feed => {
                    self.group
                        .claim_as(&message, &self.owner, &token, fenced)
                        .await
                }
                Path::Recovered => {
                    self.group
                        .claim_recovered(&message, &self.owner, &token, 1)
                        .await
                }
            };
            match claimed {
                Ok(ClaimOutcome::Claimed(claim)) => {
                    let fence = fence.filter(|_| !claim.is_recorded());
                    return self
                        .deliver(message, claim, give_up, permit, fence, &token)
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
                    path = Path::Checked;
                    held_polls += 1;
                    let poll = look_again_after(held_polls);
                    let wait = self.until(until.unwrap_or(0)).min(poll);
                    if !self.wait(permit, wait, give_up).await {
                        return Fate::Pending; // its holder's document brings it back
                    }
                }
                Ok(ClaimOutcome::NotYetDue { due }) if ordered => {
                    path = Path::Checked;
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
            match self.group.read_doc(key, message_id).await {
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
                let token = claim
                    .state
                    .as_ref()
                    .and_then(|s| s.lock_token.clone())
                    .unwrap_or_default();
                self.deliver(
                    message,
                    claim,
                    &CancellationToken::new(),
                    permit,
                    None,
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
        mut fence: Option<Fence>,
        token: &str,
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
                .holding(
                    &mut claim,
                    &mut fence,
                    token,
                    guarded(self.handler.handle(delivery)),
                )
                .await
            else {
                return Fate::Pending; // another holder has it now
            };
            // Ordered groups retry in place, keeping the key, until the attempts run out.
            match outcome {
                // The range stops and the app never saw it: give it back as it was, no
                // attempt counted (a recorded claim), or leave it before the checkpoint for
                // the range's next reader (an unrecorded one).
                Outcome::Undelivered { error, .. } if give_up.is_cancelled() => {
                    debug!(group = self.group.name(), message_id = %id, %error, "not delivered before the range stopped; given back");
                    if !claim.is_recorded() {
                        return Fate::Unstarted;
                    }
                    if let Err(e) = self.group.release(&claim).await {
                        self.failed("release", &id, e);
                    }
                    return Fate::Pending;
                }
                Outcome::Undelivered { error, delay }
                    if undelivered_since
                        .get_or_insert_with(tokio::time::Instant::now)
                        .elapsed()
                        < self.group.config().lock_duration =>
                {
                    debug!(group = self.group.name(), message_id = %id, %error, "not delivered (the app is not listening); trying again");
                    let backoff = delay.unwrap_or_else(|| RECORD_RETRY.backoff_random(3));
                    if self
                        .holding(&mut claim, &mut fence, token, tokio::time::sleep(backoff))
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
                    if self
                        .holding(&mut claim, &mut fence, token, wait)
                        .await
                        .is_none()
                    {
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

    /// Runs `work` while renewing the claim's lock, so the message stays ours however long
    /// the app takes. Renewals are timed from the lock's expiry (a third of the lock before
    /// it), and a failed one is tried again soon (429s, timeouts) rather than a whole interval
    /// later. `None` when the lock is lost to another holder: `work` (the app's call) is then
    /// dropped, since its answer could no longer be recorded.
    async fn holding<T>(
        &self,
        claim: &mut Claim,
        fence: &mut Option<Fence>,
        token: &str,
        work: impl Future<Output = T>,
    ) -> Option<T> {
        tokio::pin!(work);
        if let Some(f) = fence.as_ref() {
            let (after, now, lost) = (f.promote_after, f.promote_now.clone(), f.lost.clone());
            tokio::select! {
                biased;
                _ = lost.cancelled() => {
                    debug!(group = self.group.name(), message_id = %claim.message_id, "lease lost mid-delivery; dropped (the range's next owner delivers it again)");
                    return None;
                }
                out = &mut work => return Some(out),
                _ = now.cancelled() => {}
                _ = tokio::time::sleep(after) => {}
            }
            if !self.promote(claim, fence, token, &lost).await {
                return None;
            }
        }
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

    /// Gives a lease-fenced delivery a lock of its own (see [`Fence`]), retrying through
    /// transient errors while the lease holds. `false` when the delivery must stop: a state
    /// document owns the message, or the lease was lost first.
    async fn promote(
        &self,
        claim: &mut Claim,
        fence: &mut Option<Fence>,
        token: &str,
        lost: &CancellationToken,
    ) -> bool {
        let mut failures = 0;
        loop {
            match self.group.promote(claim, &self.owner, token).await {
                Ok(true) => {
                    debug!(group = self.group.name(), message_id = %claim.message_id, "the delivery has a lock of its own now");
                    if let Some(tx) = fence.take().and_then(|f| f.promoted) {
                        let _ = tx.send(());
                    }
                    return true;
                }
                Ok(false) => {
                    warn!(group = self.group.name(), message_id = %claim.message_id, "a state document owns the message; this delivery stops");
                    return false;
                }
                Err(e) => {
                    if !self
                        .keep_trying("promote", &claim.message_id, e, &mut failures, None, lost)
                        .await
                    {
                        return false;
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
