//! Settling a claim: complete, retry with back-off (or in place, for ordered groups), release,
//! dead-letter.

use std::time::Duration;

use tracing::{debug, warn};

use super::{Claim, Group, Write};
use crate::buggify::{self, Bug};
use crate::clock::duration_ms;
use crate::error::Result;
use crate::message::{Message, MessageKey};
use crate::state::{
    new_lock_token, retry_at, truncate, MessageState, StateDoc, REASON_MAX_ATTEMPTS,
};

/// What [`Group::retry`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetryOutcome {
    /// Deliverable again later.
    Scheduled {
        /// When (epoch ms).
        at: i64,
    },
    /// Out of attempts: dead-lettered.
    DeadLettered,
}

impl Group {
    /// Records success: the group never delivers this message again.
    pub async fn complete(&self, claim: &Claim) -> Result<()> {
        let Some(current) = &claim.state else {
            return Ok(()); // stream mode: the checkpoint records progress
        };
        let mut next = StateDoc::clone(current);
        next.settle(MessageState::Completed, self.now());
        next.last_error = None;
        self.settle_claim(claim, next, "complete").await?;
        crate::ledger::completion_recorded(self.name(), &claim.message_id, &claim.message_pk);
        Ok(())
    }

    /// Records a failed delivery: back off and deliver again, or dead-letter when out of attempts.
    /// `delay` overrides the back-off (an app's `Retry-After`).
    pub async fn retry(
        &self,
        claim: &Claim,
        error: &str,
        delay: Option<Duration>,
    ) -> Result<RetryOutcome> {
        if self.config.retry.exhausted(claim.attempt) {
            self.dead_letter(claim, REASON_MAX_ATTEMPTS, error).await?;
            return Ok(RetryOutcome::DeadLettered);
        }
        let now = self.now();
        let delay = delay.unwrap_or_else(|| self.config.retry.backoff_random(claim.attempt));
        let at = retry_at(now, delay, claim.expires_at);
        let mut next = self.next_state(claim, now);
        next.state = MessageState::Retry;
        next.owner = None;
        next.due = Some(at);
        next.last_error = Some(truncate(error));
        self.settle_claim(claim, next, "retry").await?;
        debug!(group = self.name(), message_id = %claim.message_id, attempt = claim.attempt, retry_at = at, error, "delivery failed; retrying later");
        Ok(RetryOutcome::Scheduled { at })
    }

    /// Gives a claimed message back undelivered (its body could not be read): deliverable
    /// again after a short back-off, and the attempt the claim counted is not counted.
    pub async fn release(&self, claim: &Claim) -> Result<()> {
        let now = self.now();
        let mut next = self.next_state(claim, now);
        next.state = MessageState::Retry;
        next.owner = None;
        next.attempts = claim.attempt.saturating_sub(1);
        next.due = Some(now + duration_ms(self.config.retry.backoff_random(1)));
        self.settle_claim(claim, next, "release").await
    }

    /// Records a failed delivery and keeps the message (ordered groups retry in place so the
    /// key's next message keeps waiting): the lock is extended over the back-off, and the next
    /// attempt is counted when it starts ([`Self::next_attempt`]).
    pub async fn retry_in_place(&self, claim: &mut Claim, owner: &str, error: &str) -> Result<()> {
        let now = self.now();
        let mut next = self.next_state(claim, now);
        // Same token: still this claim, so a lost answer is recognised like a renewal's.
        let token = next.lock_token.clone().unwrap_or_else(new_lock_token);
        next.lock(owner, now, self.config.lock_duration, &token);
        next.attempts = claim.attempt;
        next.last_error = Some(truncate(error));
        next.refresh_ttl(now, self.retention_secs());
        let written = match &claim.state {
            Some(current) => {
                let etag = current.etag.clone().unwrap_or_default();
                self.replace_own(&next, &etag, "retry").await?
            }
            None => self.create(&next, "retry").await?,
        };
        match written {
            Write::Done(doc) => {
                claim.attempt = doc.attempts;
                claim.locked_until = doc.due;
                claim.state = Some(doc);
                Ok(())
            }
            Write::Lost | Write::Missing => Err(self.lock_lost(claim)),
        }
    }

    /// Takes back the attempt a claim counted for a delivery the app never saw (it refused the
    /// connection): the message stays locked to this holder, counted as the app saw it. A
    /// delivery whose lock was the range's lease gets a lock of its own. `false` when another
    /// holder's state owns the message.
    pub(crate) async fn uncount(
        &self,
        claim: &mut Claim,
        owner: &str,
        token: &str,
    ) -> Result<bool> {
        let now = self.now();
        let Some(current) = &claim.state else {
            let attempts = claim.attempt.saturating_sub(1);
            return match self
                .create_first_lock(claim, attempts, (owner, token), "uncount")
                .await?
            {
                Write::Done(doc) => {
                    claim.adopt(doc);
                    Ok(true)
                }
                Write::Lost | Write::Missing => Ok(false),
            };
        };
        let mut next = StateDoc::clone(current);
        next.attempts = claim.attempt.saturating_sub(1);
        next.due = Some(now + duration_ms(self.config.lock_duration));
        next.refresh_ttl(now, self.retention_secs());
        self.replace_claim(claim, next, "uncount").await
    }

    /// Writes `next` over the claim's own state document and takes it as the claim's.
    async fn replace_claim(
        &self,
        claim: &mut Claim,
        next: StateDoc,
        op: &'static str,
    ) -> Result<bool> {
        let etag = claim
            .state
            .as_ref()
            .and_then(|s| s.etag.clone())
            .unwrap_or_default();
        match self.replace_own(&next, &etag, op).await? {
            Write::Done(doc) => {
                claim.adopt(doc);
                Ok(true)
            }
            Write::Lost | Write::Missing => Err(self.lock_lost(claim)),
        }
    }

    /// Counts the next attempt of a message retried in place, as it starts: a holder that died
    /// during the back-off leaves the count at the deliveries that happened.
    pub async fn next_attempt(&self, claim: &mut Claim) -> Result<()> {
        let Some(current) = &claim.state else {
            claim.attempt += 1;
            return Ok(());
        };
        let now = self.now();
        let mut next = StateDoc::clone(current);
        next.attempts = claim.attempt + 1;
        next.last_attempt_at = Some(now);
        next.due = Some(now + duration_ms(self.config.lock_duration));
        next.refresh_ttl(now, self.retention_secs());
        self.replace_claim(claim, next, "count attempt")
            .await
            .map(|_| ())
    }

    /// Moves the message to the group's dead letters with a reason and the last error.
    pub async fn dead_letter(&self, claim: &Claim, reason: &str, error: &str) -> Result<()> {
        let now = self.now();
        let mut next = self.next_state(claim, now);
        next.settle(MessageState::DeadLettered, now);
        next.reason = Some(truncate(reason));
        next.last_error = Some(truncate(error));
        self.settle_claim(claim, next, "dead-letter").await?;
        warn!(group = self.name(), message_id = %claim.message_id, attempts = claim.attempt, reason, error, "message dead-lettered");
        crate::ledger::dead_lettered(self.name(), &claim.message_id, &claim.message_pk, reason);
        Ok(())
    }

    /// Records a delivery that has no state document yet (its lock was the range's lease) in
    /// the dead letters: its lock could never be written, so nothing else would bring it back.
    /// `false` when another state of it stands (see [`Self::create_dead_letter`]).
    pub(crate) async fn dead_letter_unrecorded(
        &self,
        claim: &Claim,
        reason: &str,
        error: &str,
    ) -> Result<bool> {
        let now = self.now();
        let doc = self.next_state(claim, now);
        self.create_dead_letter(doc, now, reason, error).await
    }

    /// Records the completion of a first delivery that has no state document (its range's
    /// lease could not record it): a `completed` state, so that nobody delivers it again.
    /// `false` when the message has a state document already (another holder's, now).
    pub(crate) async fn record_completion(
        &self,
        id: &str,
        key: &MessageKey,
        enqueued_at: i64,
        expires_at: Option<i64>,
    ) -> Result<bool> {
        let now = self.now();
        let mut doc = StateDoc::of_key(
            self.name(),
            id,
            key,
            enqueued_at,
            expires_at,
            MessageState::Completed,
        );
        doc.attempts = 1;
        doc.first_attempt_at = Some(now);
        doc.last_attempt_at = Some(now);
        // Tells this write from another holder's completion when its answer is lost.
        doc.lock_token = Some(crate::state::new_lock_token());
        doc.settle(MessageState::Completed, now);
        doc.refresh_ttl(now, self.retention_secs());
        let written = self.create(&doc, "complete").await;
        if let Ok(Write::Done(_)) = written {
            return Ok(true);
        }
        // Its answer lost (or the SDK sent it again after a lost answer and was told it
        // exists): recorded if the document is this write. A completion by the range's next
        // owner (it delivered the message again meanwhile) is its own.
        match self.read_doc(key, id).await {
            Ok(Some(current))
                if current.state == MessageState::Completed
                    && (current.lock_token == doc.lock_token
                        || buggify::on(Bug::LateCompletionRace)) =>
            {
                Ok(true)
            }
            Ok(_) => written.map(|_| false),
            Err(e) => Err(written.err().unwrap_or(e)),
        }
    }

    /// Moves a waiting document's next look `after` from now (a message parked behind its
    /// key's predecessors, which are not settled yet). Someone else's change wins.
    pub(crate) async fn postpone(&self, doc: StateDoc, after: Duration) -> Result<()> {
        let now = self.now();
        let etag = doc.etag.clone().unwrap_or_default();
        let mut next = doc;
        next.due = Some(now + duration_ms(after));
        next.refresh_ttl(now, self.retention_secs());
        self.replace(&next, &etag, "postpone").await.map(|_| ())
    }

    /// Parks `message` behind the earlier messages `waits_for` of its key (ordered groups):
    /// a scheduled state due at once, which the sweep delivers once they are settled. `false`
    /// when the message has a state document already (it is its to bring back).
    pub(crate) async fn park(&self, message: &Message, waits_for: Vec<String>) -> Result<bool> {
        let now = self.now();
        let mut doc = StateDoc::new(
            self.name(),
            message,
            self.queue.message_expires_at(message),
            MessageState::Scheduled,
        );
        // Due at once (the sweep checks its predecessors), or at its schedule, if later.
        doc.due = Some(message.visible_at.unwrap_or(now).max(now));
        doc.waits_for = waits_for;
        doc.refresh_ttl(now, self.retention_secs());
        let written = self.create(&doc, "park").await;
        if let Ok(Write::Done(_)) = written {
            return Ok(true);
        }
        // Its answer lost (or the SDK tried again after a lost answer and was told it exists):
        // parked if the document says so.
        match self.read_doc(&doc.message_pk, &doc.id).await {
            Ok(Some(current))
                if current.state == MessageState::Scheduled
                    && current.waits_for == doc.waits_for =>
            {
                Ok(true)
            }
            Ok(_) => written.map(|_| false),
            Err(e) => Err(written.err().unwrap_or(e)),
        }
    }

    /// The first state document of a lease-fenced delivery (nothing recorded it yet).
    pub(super) fn first_state(&self, claim: &Claim) -> StateDoc {
        StateDoc::of_key(
            self.name(),
            &claim.message_id,
            &claim.message_pk,
            claim.enqueued_at,
            claim.expires_at,
            MessageState::Retry,
        )
    }

    /// The document a settlement writes: the claim's, or a new one for a stream first delivery.
    fn next_state(&self, claim: &Claim, now: i64) -> StateDoc {
        claim.state.as_deref().cloned().unwrap_or_else(|| {
            let mut doc = self.first_state(claim);
            doc.attempts = claim.attempt;
            doc.first_attempt_at = Some(now);
            doc.last_attempt_at = Some(now);
            doc
        })
    }

    async fn settle_claim(
        &self,
        claim: &Claim,
        mut next: StateDoc,
        op: &'static str,
    ) -> Result<()> {
        next.refresh_ttl(self.now(), self.retention_secs());
        let written = match &claim.state {
            Some(current) => {
                let etag = current.etag.clone().unwrap_or_default();
                self.replace_own(&next, &etag, op).await?
            }
            None => self.create(&next, op).await?,
        };
        match written {
            Write::Done(_) => Ok(()),
            // Stream mode: a state document already exists (an earlier failure recorded it,
            // before a lease hand-over redelivered the message); that document owns its fate.
            Write::Lost if claim.state.is_none() => {
                debug!(group = self.name(), message_id = %claim.message_id, "state already recorded by an earlier delivery");
                Ok(())
            }
            Write::Lost | Write::Missing => Err(self.lock_lost(claim)),
        }
    }
}
