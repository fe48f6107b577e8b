//! A group's state document of a message: the model, its partition key and its TTL (pure).
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
//! Writing the transitions is [`crate::group`]'s business (claims in `group/claim.rs`,
//! settling in `group/settle.rs`).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::clock::duration_ms;
use crate::message::{Message, MessageKey};

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

/// Where a message stands in a group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum MessageState {
    /// Enqueued with a future visible time; `due` is that time.
    Scheduled,
    /// Held by `owner` until `due`.
    Locked,
    /// Failed; deliverable again at `due`.
    Retry,
    /// Delivered and done: never delivered again in this group.
    Completed,
    /// Given up; listed, replayed or purged with the dead letters.
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
    /// Always [`STATE_DOC_TYPE`].
    #[serde(rename = "type")]
    pub doc_type: String,
    /// The group.
    pub group: String,
    /// The message's partition key, with its JSON type.
    pub message_pk: MessageKey,
    /// Where the message stands.
    pub state: MessageState,
    /// Who holds the lock (while `locked`).
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
    /// When the message was enqueued (epoch ms).
    pub enqueued_at: i64,
    /// When the message expires with the queue's retention (epoch ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<i64>,
    /// When it was first delivered (epoch ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_attempt_at: Option<i64>,
    /// When it was last delivered (epoch ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_attempt_at: Option<i64>,
    /// The last delivery's error, cut to a few KB.
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
    /// Ordered groups: ids of earlier messages of the same key that must be settled before
    /// this one is delivered (it was parked behind them: their work ran long, or a range's new
    /// owner found them unsettled). Cleared when it is claimed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub waits_for: Vec<String>,
    /// The message's effective partition key (hex): which lease's range it is in, so each host
    /// sweeps the state of the ranges it owns. Set on every write of a state the sweep looks
    /// for (not on settled ones); documents written before it existed have none until their
    /// next write.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epk: Option<String>,
    /// The document's ETag as last read: every transition is `If-Match` on it.
    #[serde(rename = "_etag", default, skip_serializing)]
    pub etag: Option<String>,
}

/// A fresh lock token.
pub fn new_lock_token() -> String {
    format!("{:032x}", crate::chance::bits())
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
    /// A group's first document of `message`, in `state`.
    pub(crate) fn new(
        group: &str,
        message: &Message,
        expires_at: Option<i64>,
        state: MessageState,
    ) -> Self {
        Self::of_key(
            group,
            &message.id,
            &message.partition_key,
            message.enqueued_at,
            expires_at,
            state,
        )
    }

    /// A group's first document of the message `id` under `message_pk`, in `state`: no lock,
    /// no attempt yet.
    pub(crate) fn of_key(
        group: &str,
        id: &str,
        message_pk: &MessageKey,
        enqueued_at: i64,
        expires_at: Option<i64>,
        state: MessageState,
    ) -> Self {
        Self {
            id: id.to_owned(),
            pk: state_pk(group, message_pk),
            doc_type: STATE_DOC_TYPE.into(),
            group: group.into(),
            message_pk: message_pk.clone(),
            state,
            owner: None,
            lock_token: None,
            due: None,
            attempts: 0,
            enqueued_at,
            expires_at,
            first_attempt_at: None,
            last_attempt_at: None,
            last_error: None,
            reason: None,
            settled_at: None,
            ttl: None,
            waits_for: Vec::new(),
            epk: None,
            etag: None,
        }
    }

    /// Sets the TTL for what the document now says (see [`state_ttl_secs`]).
    pub(crate) fn refresh_ttl(&mut self, now_ms: i64, retention_secs: Option<i64>) {
        self.ttl = state_ttl_secs(self, now_ms, retention_secs);
    }

    pub(crate) fn lock(&mut self, owner: &str, now_ms: i64, lock: Duration, token: &str) {
        self.state = MessageState::Locked;
        self.waits_for.clear();
        self.owner = Some(owner.into());
        self.lock_token = Some(token.to_owned());
        self.due = Some(now_ms + duration_ms(lock));
        self.attempts += 1;
        self.first_attempt_at.get_or_insert(now_ms);
        self.last_attempt_at = Some(now_ms);
    }

    pub(crate) fn settle(&mut self, state: MessageState, now_ms: i64) {
        self.state = state;
        self.owner = None;
        self.due = None;
        self.epk = None;
        self.settled_at = Some(now_ms);
    }
}

/// `text` cut to [`MAX_ERROR_CHARS`] characters, with a marker where it was cut.
pub(crate) fn truncate(text: &str) -> String {
    if text.chars().count() <= MAX_ERROR_CHARS {
        return text.to_owned();
    }
    let cut: String = text.chars().take(MAX_ERROR_CHARS).collect();
    format!("{cut}… (truncated)")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
