//! Claims: taking a message for delivery (exclusive mode), taking over a state document whose
//! lock expired or whose time has come, and renewing a lock while work goes on.

use tracing::{debug, info, warn};

use super::{Group, Write};
use crate::backoff::RetryPolicy;
use crate::clock::duration_ms;
use crate::config::DeliveryMode;
use crate::error::Result;
use crate::message::{Message, MessageKey};
use crate::state::{new_lock_token, truncate, MessageState, StateDoc, REASON_MAX_ATTEMPTS};

/// A delivery the caller holds: settle it with [`Group::complete`], [`Group::retry`] or
/// [`Group::dead_letter`]; renew it with [`Group::renew`] while work goes on.
#[derive(Clone, Debug, PartialEq)]
pub struct Claim {
    /// The message's id.
    pub message_id: String,
    /// The message's partition key.
    pub message_pk: MessageKey,
    /// The delivery count, starting at 1.
    pub attempt: u32,
    /// Epoch ms until which the claim is exclusive (`None`: a stream-mode first delivery,
    /// fenced by the range's lease instead).
    pub locked_until: Option<i64>,
    /// When the message was enqueued (epoch ms).
    pub enqueued_at: i64,
    /// The state document as this holder last wrote it (absent for a stream first delivery).
    pub(crate) state: Option<Box<StateDoc>>,
    pub(crate) expires_at: Option<i64>,
}

impl Claim {
    /// Whether a state document records this delivery (its lock's expiry or retry time brings
    /// the message back if the outcome is never written).
    pub fn is_recorded(&self) -> bool {
        self.state.is_some()
    }

    /// Takes `doc`, as just written, as this claim's state: its count and its lock.
    pub(crate) fn adopt(&mut self, doc: Box<StateDoc>) {
        self.attempt = doc.attempts;
        self.locked_until = doc.due;
        self.state = Some(doc);
    }
}

/// What a claim attempt found.
#[derive(Clone, Debug, PartialEq)]
pub enum ClaimOutcome {
    /// Ours to deliver.
    Claimed(Claim),
    /// The group is done with it.
    Settled(MessageState),
    /// Another consumer holds a valid lock.
    Held {
        /// Who holds it, when known.
        owner: Option<String>,
        /// Until when (epoch ms), when known.
        until: Option<i64>,
    },
    /// Scheduled or backing off; the sweep delivers it at `due`.
    NotYetDue {
        /// When (epoch ms).
        due: i64,
    },
    /// Its last holder died on the final allowed attempt: dead-lettered instead of delivered.
    DeadLettered,
    /// The message is gone (expired by TTL) before it could be delivered.
    Gone,
}

/// What taking over a message's existing state document may do, judged from the document
/// alone (pure).
#[derive(Clone, Debug, PartialEq)]
pub enum TakeOver {
    /// Locked with this very token: an earlier claim attempt took effect although its answer
    /// was lost.
    AlreadyOurs,
    /// Nothing to write: the claim's answer is this ([`ClaimOutcome::Settled`],
    /// [`ClaimOutcome::Held`] or [`ClaimOutcome::NotYetDue`]).
    Answer(ClaimOutcome),
    /// The lock of its last allowed delivery expired without an outcome: dead-letter it.
    DeadLetter,
    /// Lock it for a new delivery.
    Lock {
        /// The lock of a holder that never settled is taken over.
        recovered: bool,
    },
}

impl TakeOver {
    /// The decision for `doc`, by a claim writing `token` at `now`.
    pub fn judge(doc: &StateDoc, token: &str, now: i64, retry: &RetryPolicy) -> Self {
        if doc.state == MessageState::Locked && doc.lock_token.as_deref() == Some(token) {
            return Self::AlreadyOurs;
        }
        let due = doc.due.unwrap_or(i64::MIN);
        match doc.state {
            state if state.is_settled() => Self::Answer(ClaimOutcome::Settled(state)),
            MessageState::Locked if due > now => Self::Answer(ClaimOutcome::Held {
                owner: doc.owner.clone(),
                until: doc.due,
            }),
            MessageState::Retry | MessageState::Scheduled if due > now => {
                Self::Answer(ClaimOutcome::NotYetDue { due })
            }
            MessageState::Locked if retry.exhausted(doc.attempts) => Self::DeadLetter,
            state => Self::Lock {
                recovered: state == MessageState::Locked,
            },
        }
    }
}

impl Group {
    /// Tries to take `message` for delivery by `holder`, as read from the change feed.
    pub async fn claim(&self, message: &Message, owner: &str) -> Result<ClaimOutcome> {
        self.claim_with_token(message, owner, &new_lock_token())
            .await
    }

    /// [`Self::claim`] with the lock token to write. Retrying a failed claim with the same
    /// token takes the lock back if the failed attempt did take effect (its answer was lost);
    /// a fresh token would find the message locked, by itself, until the lock expired.
    pub async fn claim_with_token(
        &self,
        message: &Message,
        owner: &str,
        token: &str,
    ) -> Result<ClaimOutcome> {
        let fenced = self.config.mode == DeliveryMode::Stream;
        self.claim_as(message, owner, token, fenced).await
    }

    /// A message its range's previous owner handed out and may have delivered `prior` times
    /// without recording an outcome (it died or lost the lease; lease write path). Claimed
    /// with a state document, as a redelivery: it counts the attempt, and a message that
    /// keeps killing its worker reaches the dead letters after `maxDeliveryAttempts`.
    pub(crate) async fn claim_recovered(
        &self,
        message: &Message,
        owner: &str,
        token: &str,
        prior: u32,
    ) -> Result<ClaimOutcome> {
        let now = self.now();
        if !message.is_visible(now) {
            return self.claim_as(message, owner, token, false).await;
        }
        if let Some(doc) = self.read_doc(&message.partition_key, &message.id).await? {
            return self.take_over_with_token(doc, owner, token).await;
        }
        let expires_at = self.expires_at(message);
        let mut doc = StateDoc::new(self.name(), message, expires_at, MessageState::Retry);
        doc.attempts = prior;
        if self.config.retry.exhausted(prior) {
            let error =
                format!("delivery {prior} ended without an outcome (its worker stopped with it)");
            if self
                .dead_letter_new(message, prior, REASON_MAX_ATTEMPTS, &error)
                .await?
            {
                return Ok(ClaimOutcome::DeadLettered);
            }
            return self.claim_existing(message, owner, token).await;
        }
        doc.lock(owner, now, self.config.lock_duration, token);
        doc.refresh_ttl(now, self.retention_secs());
        match self.create(&doc, "claim").await {
            Ok(Write::Done(doc)) => {
                info!(group = self.name(), message_id = %doc.id, attempt = doc.attempts, owner, "recovered a message its range's last owner left unsettled");
                Ok(ClaimOutcome::Claimed(self.claim_from(*doc)))
            }
            Ok(_) => self.claim_existing(message, owner, token).await,
            Err(e) => Ok(ClaimOutcome::Claimed(
                self.claim_from(self.landed(&doc, e).await?),
            )),
        }
    }

    /// Gives a lease-fenced delivery a lock of its own (a locked state document), so it
    /// outlives the range's lease: work that runs long, or that is still under way when the
    /// range is handed over. `Ok(false)` when a state document already exists: it owns the
    /// message, and this delivery must stop.
    pub(crate) async fn promote(
        &self,
        claim: &mut Claim,
        owner: &str,
        token: &str,
    ) -> Result<bool> {
        if claim.state.is_some() {
            return Ok(true);
        }
        let written = self
            .create_first_lock(claim, claim.attempt, (owner, token), "promote")
            .await?;
        match written {
            Write::Done(doc) => {
                claim.adopt(doc);
                Ok(true)
            }
            Write::Lost | Write::Missing => Ok(false),
        }
    }

    /// The first state document of a claim that had none (the lease was its lock): locked by
    /// `token`, recording `attempts` deliveries. A create whose answer was lost and that the
    /// SDK tried again is recognised by its token.
    pub(super) async fn create_first_lock(
        &self,
        claim: &Claim,
        attempts: u32,
        (owner, token): (&str, &str),
        op: &'static str,
    ) -> Result<Write> {
        let now = self.now();
        let mut doc = self.first_state(claim);
        doc.lock(owner, now, self.config.lock_duration, token);
        doc.attempts = attempts;
        doc.refresh_ttl(now, self.retention_secs());
        Ok(match self.create(&doc, op).await {
            Ok(Write::Lost) => match self.read_doc(&doc.message_pk, &doc.id).await? {
                Some(current) if current.lock_token.as_deref() == Some(token) => {
                    Write::Done(Box::new(current))
                }
                _ => Write::Lost,
            },
            Ok(written) => written,
            Err(e) => Write::Done(Box::new(self.landed(&doc, e).await?)),
        })
    }

    /// A claim of a message read from the feed. `fenced`: read by the owner of its range's
    /// lease on a path where the lease fences a first delivery (`stream`, and `exclusive` on
    /// the lease write path), so nothing is written unless the message is not yet visible.
    pub(crate) async fn claim_as(
        &self,
        message: &Message,
        owner: &str,
        token: &str,
        fenced: bool,
    ) -> Result<ClaimOutcome> {
        let now = self.now();
        let expires_at = self.expires_at(message);
        if !message.is_visible(now) {
            let due = message.visible_at.unwrap_or(now);
            let mut doc = StateDoc::new(self.name(), message, expires_at, MessageState::Scheduled);
            doc.due = Some(due);
            doc.refresh_ttl(now, self.retention_secs());
            return match self.create(&doc, "schedule").await? {
                Write::Done(_) => Ok(ClaimOutcome::NotYetDue { due }),
                _ => self.claim_existing(message, owner, token).await,
            };
        }
        if fenced {
            return Ok(ClaimOutcome::Claimed(Claim {
                message_id: message.id.clone(),
                message_pk: message.partition_key.clone(),
                attempt: 1,
                locked_until: None,
                enqueued_at: message.enqueued_at,
                state: None,
                expires_at,
            }));
        }
        let mut doc = StateDoc::new(self.name(), message, expires_at, MessageState::Retry);
        doc.lock(owner, now, self.config.lock_duration, token);
        doc.refresh_ttl(now, self.retention_secs());
        match self.create(&doc, "claim").await {
            Ok(Write::Done(doc)) => Ok(ClaimOutcome::Claimed(self.claim_from(*doc))),
            Ok(_) => self.claim_existing(message, owner, token).await,
            Err(e) => Ok(ClaimOutcome::Claimed(
                self.claim_from(self.landed(&doc, e).await?),
            )),
        }
    }

    /// [`Self::claim_with_token`], looking for a state document first in stream mode too: a
    /// range taken over from an owner that did not release it may hold messages that owner
    /// was still retrying in place (ordered groups), which must not be delivered past.
    pub async fn claim_checked(
        &self,
        message: &Message,
        owner: &str,
        token: &str,
    ) -> Result<ClaimOutcome> {
        let fenced = self.config.mode == DeliveryMode::Stream;
        self.claim_checked_as(message, owner, token, fenced).await
    }

    /// [`Self::claim_checked`] by `fenced`: whether a first delivery without a state document
    /// is fenced by its range's lease (the owner of the range on a lease-fenced path).
    pub(crate) async fn claim_checked_as(
        &self,
        message: &Message,
        owner: &str,
        token: &str,
        fenced: bool,
    ) -> Result<ClaimOutcome> {
        if fenced && message.is_visible(self.now()) {
            if let Some(doc) = self.read_doc(&message.partition_key, &message.id).await? {
                return self.take_over_with_token(doc, owner, token).await;
            }
        }
        self.claim_as(message, owner, token, fenced).await
    }

    /// Records a message whose claim Cosmos refused for good straight in the dead letters.
    pub async fn dead_letter_unclaimed(
        &self,
        message: &Message,
        reason: &str,
        error: &str,
    ) -> Result<bool> {
        self.dead_letter_new(message, 0, reason, error).await
    }

    /// Records `message`, delivered `attempts` times, straight in the dead letters: `false`
    /// when another state of it was there first (someone's lock or schedule), which stands.
    async fn dead_letter_new(
        &self,
        message: &Message,
        attempts: u32,
        reason: &str,
        error: &str,
    ) -> Result<bool> {
        let now = self.now();
        let mut doc = StateDoc::new(
            self.name(),
            message,
            self.expires_at(message),
            MessageState::DeadLettered,
        );
        doc.attempts = attempts;
        self.create_dead_letter(doc, now, reason, error).await
    }

    /// Writes `doc` as the message's first state, dead-lettered with `reason` and `error`:
    /// `false` when another state of it was there first (someone's lock or schedule), which
    /// stands. A create whose answer was lost and that the SDK tried again finds its own dead
    /// letter: that counts as written.
    pub(super) async fn create_dead_letter(
        &self,
        mut doc: StateDoc,
        now: i64,
        reason: &str,
        error: &str,
    ) -> Result<bool> {
        doc.settle(MessageState::DeadLettered, now);
        doc.reason = Some(truncate(reason));
        doc.last_error = Some(truncate(error));
        doc.refresh_ttl(now, self.retention_secs());
        match self.create(&doc, "dead-letter").await? {
            Write::Done(_) => {
                warn!(group = self.name(), message_id = %doc.id, attempts = doc.attempts, reason, error, "message dead-lettered");
                crate::ledger::dead_lettered(self.name(), &doc.id, &doc.message_pk, reason);
                Ok(true)
            }
            Write::Lost | Write::Missing => Ok(self
                .read_doc(&doc.message_pk, &doc.id)
                .await?
                .is_some_and(|doc| doc.state == MessageState::DeadLettered)),
        }
    }

    async fn claim_existing(
        &self,
        message: &Message,
        owner: &str,
        token: &str,
    ) -> Result<ClaimOutcome> {
        match self.read_doc(&message.partition_key, &message.id).await? {
            Some(doc) => self.take_over_with_token(doc, owner, token).await,
            // Created and already gone (TTL) between our create and read: nothing to deliver.
            None => Ok(ClaimOutcome::Gone),
        }
    }

    /// Takes a message whose state document exists (found by the sweep, or by a claim that
    /// lost the create): succeeds when its lock expired or its retry/schedule time has come.
    pub async fn take_over(&self, doc: StateDoc, owner: &str) -> Result<ClaimOutcome> {
        self.take_over_with_token(doc, owner, &new_lock_token())
            .await
    }

    /// [`Self::take_over`] writing `token`; a document already locked with it is ours.
    pub async fn take_over_with_token(
        &self,
        doc: StateDoc,
        owner: &str,
        token: &str,
    ) -> Result<ClaimOutcome> {
        let now = self.now();
        let recovered = match TakeOver::judge(&doc, token, now, &self.config.retry) {
            TakeOver::AlreadyOurs => {
                debug!(group = self.name(), message_id = %doc.id, "an earlier claim attempt took effect although its answer was lost");
                let mut claim = self.claim_from(doc);
                // Found after a while (the answer was lost, then retried with back-off): the
                // lock may be nearly over. Renew it before delivering, or the app would work on
                // a message that another holder may take at any moment.
                let left = claim.locked_until.unwrap_or(0) - now;
                if left < duration_ms(self.config.lock_duration) * 2 / 3 {
                    self.renew(&mut claim).await?;
                }
                return Ok(ClaimOutcome::Claimed(claim));
            }
            TakeOver::Answer(outcome) => return Ok(outcome),
            TakeOver::DeadLetter => return self.dead_letter_abandoned(doc, now).await,
            TakeOver::Lock { recovered } => recovered,
        };
        let etag = doc.etag.clone().unwrap_or_default();
        let mut next = doc;
        next.lock(owner, now, self.config.lock_duration, token);
        next.refresh_ttl(now, self.retention_secs());
        let written = match self.replace(&next, &etag, "claim").await {
            // Refused on the ETag: an attempt whose answer was lost may have landed (and the
            // SDK's retry of it found the new ETag); then the lock is this claim's.
            Ok(Write::Lost) => match self.read_doc(&next.message_pk, &next.id).await? {
                Some(current)
                    if current.state == MessageState::Locked
                        && current.lock_token.as_deref() == Some(token) =>
                {
                    Write::Done(Box::new(current))
                }
                _ => Write::Lost,
            },
            Ok(written) => written,
            Err(e) => Write::Done(Box::new(self.landed(&next, e).await?)),
        };
        match written {
            Write::Done(doc) => {
                if recovered {
                    info!(group = self.name(), message_id = %doc.id, attempt = doc.attempts, owner, "recovered a message whose lock expired");
                }
                Ok(ClaimOutcome::Claimed(self.claim_from(*doc)))
            }
            Write::Lost => Ok(ClaimOutcome::Held {
                owner: None,
                until: None,
            }),
            Write::Missing => Ok(ClaimOutcome::Gone),
        }
    }

    /// The last allowed delivery's lock expired without an outcome (its holder died with it,
    /// perhaps because of it): dead-lettered instead of delivered again.
    async fn dead_letter_abandoned(&self, doc: StateDoc, now: i64) -> Result<ClaimOutcome> {
        let etag = doc.etag.clone().unwrap_or_default();
        let mut dead = doc;
        let previous_owner = dead.owner.clone().unwrap_or_default();
        dead.settle(MessageState::DeadLettered, now);
        dead.reason = Some(REASON_MAX_ATTEMPTS.into());
        dead.last_error = Some(format!(
            "the lock of delivery {} (held by {previous_owner}) expired without an outcome",
            dead.attempts
        ));
        dead.refresh_ttl(now, self.retention_secs());
        match self.replace(&dead, &etag, "dead-letter").await? {
            Write::Done(_) => {
                warn!(group = self.name(), message_id = %dead.id, attempts = dead.attempts, "dead-lettered: last allowed delivery never settled");
                crate::ledger::dead_lettered(
                    self.name(),
                    &dead.id,
                    &dead.message_pk,
                    REASON_MAX_ATTEMPTS,
                );
                Ok(ClaimOutcome::DeadLettered)
            }
            Write::Lost => Ok(ClaimOutcome::Held {
                owner: None,
                until: None,
            }),
            Write::Missing => Ok(ClaimOutcome::Gone),
        }
    }

    fn claim_from(&self, doc: StateDoc) -> Claim {
        Claim {
            message_id: doc.id.clone(),
            message_pk: doc.message_pk.clone(),
            attempt: doc.attempts,
            locked_until: doc.due,
            enqueued_at: doc.enqueued_at,
            expires_at: doc.expires_at,
            state: Some(Box::new(doc)),
        }
    }

    /// Extends the lock of a claim still being worked on.
    pub async fn renew(&self, claim: &mut Claim) -> Result<()> {
        let Some(current) = &claim.state else {
            return Ok(()); // stream first delivery: the lease fences it
        };
        let now = self.now();
        let mut next = StateDoc::clone(current);
        next.due = Some(now + duration_ms(self.config.lock_duration));
        next.refresh_ttl(now, self.retention_secs());
        let etag = current.etag.clone().unwrap_or_default();
        match self.replace_own(&next, &etag, "renew").await? {
            Write::Done(doc) => {
                claim.locked_until = doc.due;
                claim.state = Some(doc);
                Ok(())
            }
            Write::Lost | Write::Missing => Err(self.lock_lost(claim)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(state: MessageState, due: Option<i64>, attempts: u32, token: Option<&str>) -> StateDoc {
        let message = crate::message::NewMessage::json(serde_json::json!(1))
            .with_id("m")
            .into_message(0)
            .unwrap();
        let mut doc = StateDoc::new("g", &message, None, state);
        doc.due = due;
        doc.attempts = attempts;
        doc.owner = token.map(|_| "pod-a".to_owned());
        doc.lock_token = token.map(Into::into);
        doc
    }

    #[test]
    fn a_take_over_follows_the_document() {
        use MessageState::*;
        let retry = RetryPolicy {
            max_delivery_attempts: 3,
            ..RetryPolicy::default()
        };
        let now = 10_000;
        let held = TakeOver::Answer(ClaimOutcome::Held {
            owner: Some("pod-a".into()),
            until: Some(now + 1),
        });
        for (name, doc, expected) in [
            (
                "our own lost answer",
                doc(Locked, Some(now + 1), 1, Some("mine")),
                TakeOver::AlreadyOurs,
            ),
            (
                "ours even when expired",
                doc(Locked, Some(now - 1), 3, Some("mine")),
                TakeOver::AlreadyOurs,
            ),
            (
                "a valid lock",
                doc(Locked, Some(now + 1), 1, Some("theirs")),
                held,
            ),
            (
                "an expired lock",
                doc(Locked, Some(now - 1), 1, Some("theirs")),
                TakeOver::Lock { recovered: true },
            ),
            (
                "expired at exactly now",
                doc(Locked, Some(now), 2, Some("theirs")),
                TakeOver::Lock { recovered: true },
            ),
            (
                "the last attempt died",
                doc(Locked, Some(now - 1), 3, Some("theirs")),
                TakeOver::DeadLetter,
            ),
            (
                "a retry not yet due",
                doc(Retry, Some(now + 5), 1, None),
                TakeOver::Answer(ClaimOutcome::NotYetDue { due: now + 5 }),
            ),
            (
                "a due retry",
                doc(Retry, Some(now), 2, None),
                TakeOver::Lock { recovered: false },
            ),
            (
                "a due retry after the last attempt is still delivered",
                doc(Retry, Some(now), 3, None),
                TakeOver::Lock { recovered: false },
            ),
            (
                "a schedule not yet due",
                doc(Scheduled, Some(now + 5), 0, None),
                TakeOver::Answer(ClaimOutcome::NotYetDue { due: now + 5 }),
            ),
            (
                "a due schedule",
                doc(Scheduled, Some(now - 5), 0, None),
                TakeOver::Lock { recovered: false },
            ),
            (
                "no due time",
                doc(Retry, None, 1, None),
                TakeOver::Lock { recovered: false },
            ),
            (
                "completed",
                doc(Completed, None, 1, None),
                TakeOver::Answer(ClaimOutcome::Settled(Completed)),
            ),
            (
                "dead-lettered",
                doc(DeadLettered, None, 3, None),
                TakeOver::Answer(ClaimOutcome::Settled(DeadLettered)),
            ),
            (
                "purged",
                doc(Purged, None, 3, None),
                TakeOver::Answer(ClaimOutcome::Settled(Purged)),
            ),
        ] {
            assert_eq!(
                TakeOver::judge(&doc, "mine", now, &retry),
                expected,
                "{name}"
            );
        }
    }
}
