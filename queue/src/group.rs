//! The per-group message state machine.
//!
//! A group's knowledge of a message is one state document in the lease container,
//! `id = message id`, `pk = "<group>|<message partition key>"`:
//!
//! ```text
//!             claim (create, or replace If-Match when the lock expired / retry is due)
//!   (none) ───────────────► Locked ──complete──► Completed
//!     │                      │  ▲ └──dead-letter / attempts exhausted──► DeadLettered ──purge──► Purged
//!     │ not yet visible      │  │ renew                                       │
//!     ▼                      ▼  │                                             │ replay
//!  Scheduled ──due──► claim  Retry ──due──► claim ◄───────────────────────────┘
//! ```
//!
//! Every transition after the first write is a replace with `If-Match` on the ETag the
//! writer last saw, so at most one consumer of the group holds a message while its lock is
//! valid. In `stream` mode the first delivery writes nothing (the range's lease fences it);
//! only failures create a state document, and from there the path is the same.

use azure_core::http::Etag;
use azure_data_cosmos::options::{ItemWriteOptions, Precondition};
use azure_data_cosmos::FeedScope;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tracing::{debug, info, warn};

use crate::clock::duration_ms;
use crate::config::{DeliveryMode, GroupConfig};
use crate::error::{status_of, QueueError, Result, CONFLICT, NOT_FOUND, PRECONDITION_FAILED};
use crate::message::{Message, MessageKey};
use crate::queue::Queue;
use crate::sql;

/// The `type` of per-message state documents in the lease container.
pub const STATE_DOC_TYPE: &str = "message";
/// Longest `lastError` kept; the rest is cut with a marker (it is a diagnostic, not data).
const MAX_ERROR_CHARS: usize = 4096;
/// State documents outlive their message by this much, then expire.
const STATE_TTL_MARGIN_SECS: i64 = 3600;

/// Reason recorded when a message is dead-lettered for running out of attempts.
pub const REASON_MAX_ATTEMPTS: &str = "MaxDeliveryAttemptsExceeded";
/// Reason recorded when Cosmos refuses a message's claim as a request (400, 403): retrying
/// could never succeed.
pub const REASON_PERMANENT_ERROR: &str = "PermanentError";
/// Reason recorded when retention removed a message before a successful delivery.
pub const REASON_EXPIRED: &str = "MessageExpired";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum MessageState {
    /// Enqueued with a future visible time; `due` is that time.
    Scheduled,
    /// Held by `owner` until `due`.
    Locked,
    /// Failed; deliverable again at `due`.
    Retry,
    Completed,
    DeadLettered,
    /// A dead letter the user discarded.
    Purged,
}

impl MessageState {
    /// Whether the group is done with the message (no delivery will follow).
    pub fn is_settled(self) -> bool {
        matches!(
            self,
            MessageState::Completed | MessageState::DeadLettered | MessageState::Purged
        )
    }
}

/// One group's state of one message.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StateDoc {
    /// The message id.
    pub id: String,
    /// `<group>|<message partition key>`.
    pub pk: String,
    #[serde(rename = "type")]
    pub doc_type: String,
    pub group: String,
    /// The message's partition key, with its JSON type.
    pub message_pk: MessageKey,
    pub state: MessageState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// New with every lock (Service Bus' lock token). A write whose answer was lost (a
    /// timeout after the service applied it) is recognised as ours by it when read back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lock_token: Option<String>,
    /// Lock expiry (Locked) or next delivery time (Retry, Scheduled), epoch ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub due: Option<i64>,
    /// Deliveries so far.
    pub attempts: u32,
    pub enqueued_at: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_attempt_at: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_attempt_at: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// Why it was dead-lettered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// When it was completed, dead-lettered or purged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settled_at: Option<i64>,
    /// Cosmos per-item TTL in seconds: the message's remaining life plus a margin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl: Option<i64>,
    /// The message's effective partition key (hex): which lease's range it is in, so each host
    /// sweeps the state of the ranges it owns. Set on every write of a state the sweep looks
    /// for (not on settled ones); documents written before it existed have none until their
    /// next write.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epk: Option<String>,
    #[serde(rename = "_etag", default, skip_serializing)]
    pub etag: Option<String>,
}

/// A fresh lock token.
pub fn new_lock_token() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// Longest readable state partition key, `<group>|<key>`; Cosmos takes up to 2 KB.
const MAX_READABLE_STATE_PK_BYTES: usize = 1024;
/// Marks a hashed key in a state partition key (a readable one never starts with it).
const HASHED_KEY_MARKER: char = '~';

/// The partition key of a group's state documents for messages with `message_pk`.
///
/// A string key stays readable (`orders|customer-7`). Keys of other JSON types, keys long
/// enough that `<group>|<key>` would pass Cosmos' 2 KB partition-key limit, and strings that
/// start with the marker are hashed (`orders|~<sha256 of the key's JSON>`): any valid message
/// key then has a state document, and `5` and `"5"` never share one.
pub fn state_pk(group: &str, message_pk: &MessageKey) -> String {
    match message_pk.as_str() {
        Some(s)
            if !s.starts_with(HASHED_KEY_MARKER)
                && group.len() + 1 + s.len() <= MAX_READABLE_STATE_PK_BYTES =>
        {
            format!("{group}|{s}")
        }
        _ => {
            use sha2::Digest as _;
            let digest = sha2::Sha256::digest(message_pk.canonical().as_bytes());
            let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
            format!("{group}|{HASHED_KEY_MARKER}{hex}")
        }
    }
}

/// How long a state document may live (its Cosmos TTL in seconds; `None`: as long as the
/// container keeps items), so that it never expires before what it describes has an outcome:
/// - waiting or held (scheduled, retry, locked): until its `due` or the message's expiry,
///   whichever is later, so a schedule beyond the message's life still ends in a dead letter
///   (`MessageExpired`) instead of vanishing;
/// - completed: as long as the message, so reading the feed again finds it settled;
/// - dead-lettered or purged: as long as the message and at least one retention after
///   settling, so a dead letter stays listable after its message is gone.
///
/// Plus a margin for clock skew and the sweep's interval.
pub fn state_ttl_secs(doc: &StateDoc, now_ms: i64, retention_secs: Option<i64>) -> Option<i64> {
    let message_expiry = doc.expires_at?;
    let until = match doc.state {
        MessageState::Completed => message_expiry,
        MessageState::DeadLettered | MessageState::Purged => {
            let kept = now_ms.saturating_add(retention_secs?.saturating_mul(1000));
            message_expiry.max(kept)
        }
        MessageState::Scheduled | MessageState::Retry | MessageState::Locked => {
            message_expiry.max(doc.due.unwrap_or(now_ms))
        }
    };
    let secs = (until.saturating_sub(now_ms) / 1000).max(0) + STATE_TTL_MARGIN_SECS;
    Some(secs.min(i64::from(i32::MAX)))
}

/// When a failed message is delivered again: after `delay`, but never after its message
/// expires (an app's `Retry-After` can ask for any time): at the latest a moment before, so
/// the last try still finds the message.
pub fn retry_at(now_ms: i64, delay: Duration, expires_at: Option<i64>) -> i64 {
    let wanted = now_ms.saturating_add(duration_ms(delay));
    match expires_at {
        Some(expiry) => wanted.min((expiry - RETRY_BEFORE_EXPIRY_MS).max(now_ms)),
        None => wanted,
    }
}

/// How long before its message's expiry a late retry is delivered.
const RETRY_BEFORE_EXPIRY_MS: i64 = 60_000;

impl StateDoc {
    fn new(group: &str, message: &Message, expires_at: Option<i64>, state: MessageState) -> Self {
        Self {
            id: message.id.clone(),
            pk: state_pk(group, &message.partition_key),
            doc_type: STATE_DOC_TYPE.into(),
            group: group.into(),
            message_pk: message.partition_key.clone(),
            state,
            owner: None,
            lock_token: None,
            due: None,
            attempts: 0,
            enqueued_at: message.enqueued_at,
            expires_at,
            first_attempt_at: None,
            last_attempt_at: None,
            last_error: None,
            reason: None,
            settled_at: None,
            ttl: None,
            epk: None,
            etag: None,
        }
    }

    /// Sets the TTL for what the document now says (see [`state_ttl_secs`]).
    pub(crate) fn refresh_ttl(&mut self, now_ms: i64, retention_secs: Option<i64>) {
        self.ttl = state_ttl_secs(self, now_ms, retention_secs);
    }

    fn lock(&mut self, owner: &str, now_ms: i64, lock: Duration, token: &str) {
        self.state = MessageState::Locked;
        self.owner = Some(owner.into());
        self.lock_token = Some(token.to_owned());
        self.due = Some(now_ms + duration_ms(lock));
        self.attempts += 1;
        self.first_attempt_at.get_or_insert(now_ms);
        self.last_attempt_at = Some(now_ms);
    }

    fn settle(&mut self, state: MessageState, now_ms: i64) {
        self.state = state;
        self.owner = None;
        self.due = None;
        self.epk = None;
        self.settled_at = Some(now_ms);
    }
}

/// A delivery the caller holds: settle it with [`Group::complete`], [`Group::retry`] or
/// [`Group::dead_letter`]; renew it with [`Group::renew`] while work goes on.
#[derive(Clone, Debug)]
pub struct Claim {
    pub message_id: String,
    pub message_pk: MessageKey,
    /// The delivery count, starting at 1.
    pub attempt: u32,
    /// Epoch ms until which the claim is exclusive (`None`: a stream-mode first delivery,
    /// fenced by the range's lease instead).
    pub locked_until: Option<i64>,
    pub enqueued_at: i64,
    /// The state document as this holder last wrote it (absent for a stream first delivery).
    state: Option<Box<StateDoc>>,
    expires_at: Option<i64>,
}

impl Claim {
    /// Whether a state document records this delivery (its lock's expiry or retry time brings
    /// the message back if the outcome is never written).
    pub fn is_recorded(&self) -> bool {
        self.state.is_some()
    }
}

/// What a claim attempt found.
#[derive(Clone, Debug)]
pub enum ClaimOutcome {
    Claimed(Claim),
    /// The group is done with it.
    Settled(MessageState),
    /// Another consumer holds a valid lock.
    Held {
        owner: Option<String>,
        until: Option<i64>,
    },
    /// Scheduled or backing off; the sweep delivers it at `due`.
    NotYetDue {
        due: i64,
    },
    /// Its last holder died on the final allowed attempt: dead-lettered instead of delivered.
    DeadLettered,
    /// The message is gone (expired by TTL) before it could be delivered.
    Gone,
}

/// What [`Group::retry`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetryOutcome {
    /// Deliverable again at this time (epoch ms).
    Scheduled { at: i64 },
    /// Out of attempts: dead-lettered.
    DeadLettered,
}

/// A consumer group of a queue: the state machine over its state documents.
#[derive(Clone)]
pub struct Group {
    queue: Queue,
    config: Arc<GroupConfig>,
}

pub(crate) enum Write {
    Done(Box<StateDoc>),
    /// Conflict on create, or the ETag no longer matched on replace.
    Lost,
    /// The document does not exist (a replace after TTL removed it).
    Missing,
}

impl Group {
    pub(crate) fn new(queue: Queue, config: GroupConfig) -> Self {
        Self {
            queue,
            config: Arc::new(config),
        }
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    pub fn config(&self) -> &GroupConfig {
        &self.config
    }

    pub fn queue(&self) -> &Queue {
        &self.queue
    }

    fn now(&self) -> i64 {
        self.queue.clock().now_ms()
    }

    fn expires_at(&self, message: &Message) -> Option<i64> {
        self.queue.message_expires_at(message)
    }

    fn retention_secs(&self) -> Option<i64> {
        self.queue.config().retention_secs()
    }

    /// Tries to take `message` for delivery by `holder`, as read from the change feed.
    pub async fn claim(&self, message: &Message, holder: &str) -> Result<ClaimOutcome> {
        self.claim_with_token(message, holder, &new_lock_token())
            .await
    }

    /// [`Self::claim`] with the lock token to write. Retrying a failed claim with the same
    /// token takes the lock back if the failed attempt did take effect (its answer was lost);
    /// a fresh token would find the message locked, by itself, until the lock expired.
    pub async fn claim_with_token(
        &self,
        message: &Message,
        holder: &str,
        token: &str,
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
                _ => self.claim_existing(message, holder, token).await,
            };
        }
        if self.config.mode == DeliveryMode::Stream {
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
        doc.lock(holder, now, self.config.lock_duration, token);
        doc.refresh_ttl(now, self.retention_secs());
        match self.create(&doc, "claim").await {
            Ok(Write::Done(doc)) => Ok(ClaimOutcome::Claimed(self.claim_from(*doc))),
            Ok(_) => self.claim_existing(message, holder, token).await,
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
        holder: &str,
        token: &str,
    ) -> Result<ClaimOutcome> {
        if self.config.mode == DeliveryMode::Stream && message.is_visible(self.now()) {
            if let Some(doc) = self.read_state(&message.partition_key, &message.id).await? {
                return self.take_over_with_token(doc, holder, token).await;
            }
        }
        self.claim_with_token(message, holder, token).await
    }

    /// Records a message whose claim Cosmos refused for good straight in the dead letters.
    pub async fn dead_letter_unclaimed(
        &self,
        message: &Message,
        reason: &str,
        error: &str,
    ) -> Result<()> {
        let now = self.now();
        let mut doc = StateDoc::new(
            self.name(),
            message,
            self.expires_at(message),
            MessageState::DeadLettered,
        );
        doc.settle(MessageState::DeadLettered, now);
        doc.reason = Some(truncate(reason));
        doc.last_error = Some(truncate(error));
        doc.refresh_ttl(now, self.retention_secs());
        match self.create(&doc, "dead-letter").await? {
            Write::Done(_) => {
                warn!(group = self.name(), message_id = %message.id, reason, error, "message dead-lettered");
                Ok(())
            }
            // Already recorded by someone: that record stands.
            Write::Lost | Write::Missing => Ok(()),
        }
    }

    async fn claim_existing(
        &self,
        message: &Message,
        holder: &str,
        token: &str,
    ) -> Result<ClaimOutcome> {
        match self.read_state(&message.partition_key, &message.id).await? {
            Some(doc) => self.take_over_with_token(doc, holder, token).await,
            // Created and already gone (TTL) between our create and read: nothing to deliver.
            None => Ok(ClaimOutcome::Gone),
        }
    }

    /// Takes a message whose state document exists (found by the sweep, or by a claim that
    /// lost the create): succeeds when its lock expired or its retry/schedule time has come.
    pub async fn take_over(&self, doc: StateDoc, holder: &str) -> Result<ClaimOutcome> {
        self.take_over_with_token(doc, holder, &new_lock_token())
            .await
    }

    /// [`Self::take_over`] writing `token`; a document already locked with it is ours.
    pub async fn take_over_with_token(
        &self,
        doc: StateDoc,
        holder: &str,
        token: &str,
    ) -> Result<ClaimOutcome> {
        if doc.state == MessageState::Locked && doc.lock_token.as_deref() == Some(token) {
            debug!(group = self.name(), message_id = %doc.id, "an earlier claim attempt took effect although its answer was lost");
            let mut claim = self.claim_from(doc);
            // Found after a while (the answer was lost, then retried with back-off): the lock
            // may be nearly over. Renew it before delivering, or the app would work on a
            // message that another holder may take at any moment.
            let left = claim.locked_until.unwrap_or(0) - self.now();
            if left < duration_ms(self.config.lock_duration) * 2 / 3 {
                self.renew(&mut claim).await?;
            }
            return Ok(ClaimOutcome::Claimed(claim));
        }
        let now = self.now();
        let due = doc.due.unwrap_or(i64::MIN);
        match doc.state {
            s if s.is_settled() => return Ok(ClaimOutcome::Settled(s)),
            MessageState::Locked if due > now => {
                return Ok(ClaimOutcome::Held {
                    owner: doc.owner,
                    until: doc.due,
                })
            }
            MessageState::Retry | MessageState::Scheduled if due > now => {
                return Ok(ClaimOutcome::NotYetDue { due })
            }
            _ => {}
        }
        let etag = doc.etag.clone().unwrap_or_default();
        if doc.state == MessageState::Locked && self.config.retry.exhausted(doc.attempts) {
            let mut dead = doc.clone();
            let previous_owner = dead.owner.clone().unwrap_or_default();
            dead.settle(MessageState::DeadLettered, now);
            dead.reason = Some(REASON_MAX_ATTEMPTS.into());
            dead.last_error = Some(format!(
                "the lock of delivery {} (held by {previous_owner}) expired without an outcome",
                doc.attempts
            ));
            dead.refresh_ttl(now, self.retention_secs());
            return match self.replace(&dead, &etag, "dead-letter").await? {
                Write::Done(_) => {
                    warn!(group = self.name(), message_id = %dead.id, attempts = dead.attempts, "dead-lettered: last allowed delivery never settled");
                    Ok(ClaimOutcome::DeadLettered)
                }
                Write::Lost => Ok(ClaimOutcome::Held {
                    owner: None,
                    until: None,
                }),
                Write::Missing => Ok(ClaimOutcome::Gone),
            };
        }
        let recovered = doc.state == MessageState::Locked;
        let mut next = doc;
        next.lock(holder, now, self.config.lock_duration, token);
        next.refresh_ttl(now, self.retention_secs());
        let written = match self.replace(&next, &etag, "claim").await {
            Ok(written) => written,
            Err(e) => Write::Done(Box::new(self.landed(&next, e).await?)),
        };
        match written {
            Write::Done(doc) => {
                if recovered {
                    info!(group = self.name(), message_id = %doc.id, attempt = doc.attempts, holder, "recovered a message whose lock expired");
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
    pub async fn retry_in_place(&self, claim: &mut Claim, holder: &str, error: &str) -> Result<()> {
        let now = self.now();
        let mut next = self.next_state(claim, now);
        // Same token: still this claim, so a lost answer is recognised like a renewal's.
        let token = next.lock_token.clone().unwrap_or_else(new_lock_token);
        next.lock(holder, now, self.config.lock_duration, &token);
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

    /// The document a settlement writes: the claim's, or a new one for a stream first delivery.
    fn next_state(&self, claim: &Claim, now: i64) -> StateDoc {
        claim.state.as_deref().cloned().unwrap_or_else(|| StateDoc {
            id: claim.message_id.clone(),
            pk: state_pk(self.name(), &claim.message_pk),
            doc_type: STATE_DOC_TYPE.into(),
            group: self.name().into(),
            message_pk: claim.message_pk.clone(),
            state: MessageState::Retry,
            owner: None,
            lock_token: None,
            due: None,
            attempts: claim.attempt,
            enqueued_at: claim.enqueued_at,
            expires_at: claim.expires_at,
            first_attempt_at: Some(now),
            last_attempt_at: Some(now),
            last_error: None,
            reason: None,
            settled_at: None,
            ttl: None,
            epk: None,
            etag: None,
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

    fn lock_lost(&self, claim: &Claim) -> QueueError {
        QueueError::LockLost {
            group: self.name().into(),
            message_id: claim.message_id.clone(),
        }
    }

    /// A state document as stored, or [`QueueError::UnknownState`] when this version cannot
    /// read it (a state a newer version added, a field of another type).
    pub(crate) fn parse_state(&self, doc: serde_json::Value) -> Result<StateDoc> {
        let id = doc
            .get("id")
            .and_then(serde_json::Value::as_str)
            .unwrap_or_default()
            .to_owned();
        serde_json::from_value(doc).map_err(|e| QueueError::UnknownState {
            group: self.name().to_owned(),
            id,
            reason: e.to_string(),
        })
    }

    /// State documents whose lock expired or whose retry/schedule time has come, oldest due
    /// first is not guaranteed; at most `limit`. With `ranges` (the lease ranges a host owns),
    /// only messages in them, plus documents that carry no EPK yet: hosts sweep disjoint sets
    /// instead of racing on the same documents. Documents this version cannot read are
    /// reported and left out: they are another version's to handle, and must not stop the
    /// sweep of every other message.
    pub async fn due(
        &self,
        limit: usize,
        ranges: Option<&[(String, String)]>,
    ) -> Result<Vec<StateDoc>> {
        let mut params = vec![
            ("@limit".to_owned(), json!(limit)),
            ("@type".to_owned(), json!(STATE_DOC_TYPE)),
            ("@group".to_owned(), json!(self.name())),
            ("@now".to_owned(), json!(self.now())),
        ];
        let mut text = String::from(
            "SELECT TOP @limit * FROM c WHERE c.type = @type AND c.group = @group \
             AND (c.state = 'locked' OR c.state = 'retry' OR c.state = 'scheduled') \
             AND c.due <= @now",
        );
        if let Some(ranges) = ranges {
            let mut any = vec!["NOT IS_DEFINED(c.epk)".to_owned()];
            for (i, (min, max)) in coalesce_ranges(ranges).into_iter().enumerate() {
                any.push(format!("(c.epk >= @min{i} AND c.epk < @max{i})"));
                params.push((format!("@min{i}"), json!(min)));
                params.push((format!("@max{i}"), json!(max)));
            }
            text.push_str(&format!(" AND ({})", any.join(" OR ")));
        }
        let params: Vec<(&str, serde_json::Value)> = params
            .iter()
            .map(|(k, v)| (k.as_str(), v.clone()))
            .collect();
        let query = sql::query(&text, &params)?;
        let docs: Vec<serde_json::Value> = sql::collect(
            self.queue.leases(),
            query,
            FeedScope::full_container(),
            Some(limit),
            self.queue.charges(),
            "sweep",
        )
        .await?;
        Ok(docs
            .into_iter()
            .filter_map(|doc| match self.parse_state(doc) {
                Ok(doc) => Some(doc),
                Err(e) => {
                    warn!(group = self.name(), error = %e, "left a state document alone");
                    None
                }
            })
            .collect())
    }

    /// The group's state of one message, if any.
    pub async fn read_state(
        &self,
        message_pk: &MessageKey,
        message_id: &str,
    ) -> Result<Option<StateDoc>> {
        let pk = state_pk(self.name(), message_pk);
        match self.queue.leases().read_item(pk, message_id, None).await {
            Ok(response) => {
                self.queue
                    .charges()
                    .record_diagnostics("read state", &response.diagnostics());
                let doc: serde_json::Value = response
                    .into_model()
                    .map_err(QueueError::cosmos("read state"))?;
                self.parse_state(doc).map(Some)
            }
            Err(e) if status_of(&e) == NOT_FOUND => Ok(None),
            Err(e) => Err(QueueError::cosmos("read state")(e)),
        }
    }

    /// `doc` with its message's EPK, which every write of a state the sweep looks for carries
    /// (see [`StateDoc::epk`]); settled states leave it out (one property less to pay for).
    fn with_epk<'d>(&self, doc: &'d StateDoc) -> std::borrow::Cow<'d, StateDoc> {
        if doc.epk.is_some() || doc.state.is_settled() {
            return std::borrow::Cow::Borrowed(doc);
        }
        let mut doc = doc.clone();
        doc.epk = Some(self.queue.message_epk(&doc.message_pk));
        std::borrow::Cow::Owned(doc)
    }

    async fn create(&self, doc: &StateDoc, op: &'static str) -> Result<Write> {
        let doc = &*self.with_epk(doc);
        let result = self
            .queue
            .leases()
            .create_item(doc.pk.clone(), &doc.id, doc, None)
            .await;
        self.written(doc, result, op)
    }

    /// The document as written when `doc`'s write failed without an answer but took effect
    /// (the service applied it and the response was lost); `e` when it did not, or it
    /// cannot be told.
    async fn landed(&self, doc: &StateDoc, e: QueueError) -> Result<StateDoc> {
        match self.read_state(&doc.message_pk, &doc.id).await {
            Ok(Some(current))
                if current.lock_token.is_some()
                    && current.lock_token == doc.lock_token
                    && current.state == doc.state
                    && current.attempts == doc.attempts =>
            {
                debug!(group = self.name(), message_id = %doc.id, error = %e, "the write took effect although its answer was lost");
                Ok(current)
            }
            _ => Err(e),
        }
    }

    /// Replaces the state document of a claim this holder has: on an ETag mismatch, looks
    /// whether the document still carries the claim's lock token. Then the change was ours
    /// (an earlier attempt whose answer was lost, or a renewal): done if it is already what
    /// `doc` says, else written again on the current ETag. Otherwise the lock is lost.
    async fn replace_own(&self, doc: &StateDoc, etag: &str, op: &'static str) -> Result<Write> {
        let lost = match self.replace(doc, etag, op).await? {
            Write::Lost => Write::Lost,
            other => return Ok(other),
        };
        let Some(current) = self.read_state(&doc.message_pk, &doc.id).await? else {
            return Ok(Write::Missing);
        };
        if current.lock_token.is_none() || current.lock_token != doc.lock_token {
            return Ok(lost);
        }
        if current.state == doc.state && current.attempts == doc.attempts && current.due == doc.due
        {
            return Ok(Write::Done(Box::new(current)));
        }
        if current.state != MessageState::Locked {
            return Ok(lost);
        }
        let etag = current.etag.clone().unwrap_or_default();
        self.replace(doc, &etag, op).await
    }

    pub(crate) async fn replace(
        &self,
        doc: &StateDoc,
        etag: &str,
        op: &'static str,
    ) -> Result<Write> {
        let doc = &*self.with_epk(doc);
        let options = ItemWriteOptions::default()
            .with_precondition(Precondition::if_match(Etag::from(etag.to_owned())));
        let result = self
            .queue
            .leases()
            .replace_item(doc.pk.clone(), &doc.id, doc, Some(options))
            .await;
        self.written(doc, result, op)
    }

    fn written(
        &self,
        doc: &StateDoc,
        result: azure_data_cosmos::Result<azure_data_cosmos::models::ItemResponse>,
        op: &'static str,
    ) -> Result<Write> {
        match result {
            Ok(response) => {
                self.queue
                    .charges()
                    .record_diagnostics(op, &response.diagnostics());
                let mut doc = doc.clone();
                doc.etag = response.headers().etag().map(|e| e.to_string());
                Ok(Write::Done(Box::new(doc)))
            }
            Err(e) => match status_of(&e) {
                CONFLICT | PRECONDITION_FAILED => {
                    match e.diagnostics() {
                        Some(d) => self.queue.charges().record_diagnostics(op, &d),
                        None => self.queue.charges().record(op, None),
                    }
                    Ok(Write::Lost)
                }
                NOT_FOUND => Ok(Write::Missing),
                _ => Err(QueueError::cosmos(op)(e)),
            },
        }
    }
}

/// Ranges merged where they touch (the leases of one host are often neighbours), sorted.
pub fn coalesce_ranges(ranges: &[(String, String)]) -> Vec<(String, String)> {
    let mut sorted = ranges.to_vec();
    sorted.sort_by(|a, b| crate::lease::epk_cmp(&a.0, &b.0));
    let mut merged: Vec<(String, String)> = Vec::with_capacity(sorted.len());
    for (min, max) in sorted {
        match merged.last_mut() {
            Some(last) if crate::lease::epk_cmp(&min, &last.1).is_le() => {
                if crate::lease::epk_cmp(&max, &last.1).is_gt() {
                    last.1 = max;
                }
            }
            _ => merged.push((min, max)),
        }
    }
    merged
}

fn truncate(text: &str) -> String {
    if text.chars().count() <= MAX_ERROR_CHARS {
        return text.to_owned();
    }
    let cut: String = text.chars().take(MAX_ERROR_CHARS).collect();
    format!("{cut}… (truncated)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_ranges_are_merged_where_they_touch() {
        let r = |a: &str, b: &str| (a.to_owned(), b.to_owned());
        assert_eq!(
            coalesce_ranges(&[r("80", "FF"), r("", "40"), r("40", "80")]),
            vec![r("", "FF")]
        );
        assert_eq!(
            coalesce_ranges(&[r("C0", "FF"), r("", "40")]),
            vec![r("", "40"), r("C0", "FF")]
        );
        assert!(coalesce_ranges(&[]).is_empty());
    }

    #[test]
    fn state_doc_round_trips_and_hides_etag_on_write() {
        let message = crate::message::NewMessage::json(json!(1))
            .with_id("m")
            .with_partition_key("k")
            .into_message(1_000)
            .unwrap();
        let mut doc = StateDoc::new("g", &message, Some(61_000), MessageState::Retry);
        doc.lock("host-a", 2_000, Duration::from_secs(30), "t1");
        doc.refresh_ttl(2_000, Some(60));
        doc.etag = Some("\"e1\"".into());
        let value = serde_json::to_value(&doc).unwrap();
        assert_eq!(value["pk"], "g|k");
        assert_eq!(value["state"], "locked");
        assert_eq!(value["due"], 32_000);
        assert_eq!(value["ttl"], 59 + STATE_TTL_MARGIN_SECS);
        assert!(value.get("_etag").is_none());
        let mut stored = value.clone();
        stored["_etag"] = json!("\"e1\"");
        let back: StateDoc = serde_json::from_value(stored).unwrap();
        assert_eq!(back, doc);
    }

    #[test]
    fn settled_states() {
        assert!(MessageState::Completed.is_settled());
        assert!(MessageState::DeadLettered.is_settled());
        assert!(MessageState::Purged.is_settled());
        assert!(!MessageState::Locked.is_settled());
        assert!(!MessageState::Retry.is_settled());
        assert!(!MessageState::Scheduled.is_settled());
    }

    #[test]
    fn an_apps_retry_after_never_outlives_the_message() {
        let now = 1_000_000;
        let ten_min = Duration::from_secs(600);
        assert_eq!(retry_at(now, ten_min, None), now + 600_000);
        assert_eq!(retry_at(now, ten_min, Some(now + 3_600_000)), now + 600_000);
        // Asked for ten minutes, the message expires in five: a minute before it expires.
        assert_eq!(
            retry_at(now, ten_min, Some(now + 300_000)),
            now + 300_000 - RETRY_BEFORE_EXPIRY_MS
        );
        // Already about to expire: now, never in the past.
        assert_eq!(retry_at(now, ten_min, Some(now + 1_000)), now);
    }

    #[test]
    fn long_errors_are_cut_with_a_marker() {
        let long = "e".repeat(MAX_ERROR_CHARS + 10);
        let cut = truncate(&long);
        assert!(cut.ends_with("(truncated)"));
        assert_eq!(truncate("short"), "short");
    }
}
