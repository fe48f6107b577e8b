//! Settling a claim: complete, retry with back-off (or in place, for ordered groups), release,
//! dead-letter.

use std::time::Duration;

use tracing::{debug, warn};

use super::{Claim, Group, Write};
use crate::clock::duration_ms;
use crate::error::Result;
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
        self.settle_claim(claim, next, "complete").await
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
    /// key's next message keeps waiting): the attempt count grows and the lock is extended.
    pub async fn retry_in_place(&self, claim: &mut Claim, owner: &str, error: &str) -> Result<()> {
        let now = self.now();
        let mut next = self.next_state(claim, now);
        // Same token: still this claim, so a lost answer is recognised like a renewal's.
        let token = next.lock_token.clone().unwrap_or_else(new_lock_token);
        next.lock(owner, now, self.config.lock_duration, &token);
        next.attempts = claim.attempt + 1;
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

    /// Moves the message to the group's dead letters with a reason and the last error.
    pub async fn dead_letter(&self, claim: &Claim, reason: &str, error: &str) -> Result<()> {
        let now = self.now();
        let mut next = self.next_state(claim, now);
        next.settle(MessageState::DeadLettered, now);
        next.reason = Some(truncate(reason));
        next.last_error = Some(truncate(error));
        self.settle_claim(claim, next, "dead-letter").await?;
        warn!(group = self.name(), message_id = %claim.message_id, attempts = claim.attempt, reason, error, "message dead-lettered");
        Ok(())
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
