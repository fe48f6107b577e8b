//! Messages: what producers give, what is stored, what consumers get.
//!
//! A stored message is an immutable document in the messages container:
//! `{ id, <pk>, body | bodyBase64, contentType?, metadata?, enqueuedAt, visibleAt?, ttl? }`.

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::clock::duration_ms;

/// Cosmos DB's item size limit.
pub const MAX_ITEM_BYTES: usize = 2 * 1024 * 1024;
/// Room left for the system properties Cosmos adds (`_rid`, `_etag`, `_ts`, ...).
const SYSTEM_PROPERTIES_ALLOWANCE: usize = 1024;
/// The largest message document we send.
pub const MAX_DOCUMENT_BYTES: usize = MAX_ITEM_BYTES - SYSTEM_PROPERTIES_ALLOWANCE;
/// Cosmos' limit on a partition key value.
pub const MAX_PARTITION_KEY_BYTES: usize = 2048;

/// Property names the engine owns in message documents (a partition key path may not use them).
pub const RESERVED_FIELDS: &[&str] = &[
    "id",
    "body",
    "bodyBase64",
    "contentType",
    "metadata",
    "enqueuedAt",
    "visibleAt",
    "ttl",
];

/// Why a message cannot be enqueued; the text says what to change.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MessageError {
    /// An id Cosmos DB cannot store.
    #[error("message id {0:?} must be 1-255 characters without '/', '\\', '?' or '#'")]
    InvalidId(String),
    /// A key Cosmos DB cannot store.
    #[error("partition key must be a string of at most {MAX_PARTITION_KEY_BYTES} bytes, a number, true, false or null")]
    InvalidPartitionKey,
    /// Over the 2 MB item limit.
    #[error("message document is {size} bytes, over the {MAX_DOCUMENT_BYTES}-byte limit (Cosmos DB items are at most 2 MB); it was not enqueued")]
    TooLarge {
        /// The document's size in bytes.
        size: usize,
    },
    /// A metadata entry with an empty key.
    #[error("metadata keys must be non-empty")]
    EmptyMetadataKey,
    /// A time-to-live under a second.
    #[error("ttl must be at least 1 second")]
    InvalidTtl,
    /// Both a JSON and a base64 body.
    #[error("give either body or bodyBase64, not both")]
    AmbiguousBody,
    /// A base64 body that does not decode.
    #[error("bodyBase64 is not valid base64: {0}")]
    InvalidBase64(String),
    /// A schedule that is not an RFC 3339 time.
    #[error("scheduledAt {0:?} is not an RFC 3339 time")]
    InvalidScheduledAt(String),
    /// A duration that does not parse.
    #[error("{field} {value:?} is not a duration such as \"30s\" or \"1h\"")]
    InvalidDuration {
        /// The field (`delay`, `ttl`).
        field: &'static str,
        /// What was given.
        value: String,
    },
}

/// A message's partition key as Cosmos stores it: a string, a number, a boolean or null.
///
/// It keeps its JSON type end to end. Cosmos hashes `5` and `"5"` to different partitions, so
/// a message another producer wrote with the number 5 can only be read back, and its state
/// found, with the number 5.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct MessageKey(Value);

impl MessageKey {
    /// A key from a JSON value; arrays, objects and strings over Cosmos' 2 KB limit are not keys.
    pub fn from_json(value: Value) -> Result<Self, MessageError> {
        let key = Self(value);
        key.validate()?;
        Ok(key)
    }

    fn validate(&self) -> Result<(), MessageError> {
        match &self.0 {
            Value::String(s) if s.len() <= MAX_PARTITION_KEY_BYTES => Ok(()),
            Value::Number(n) if n.as_f64().is_some_and(f64::is_finite) => Ok(()),
            Value::Bool(_) | Value::Null => Ok(()),
            _ => Err(MessageError::InvalidPartitionKey),
        }
    }

    /// The key as the JSON value it is.
    pub fn as_json(&self) -> &Value {
        &self.0
    }

    /// The string, when the key is one.
    pub fn as_str(&self) -> Option<&str> {
        self.0.as_str()
    }

    /// The key for SDK calls, with its JSON type.
    pub fn to_partition_key(&self) -> azure_data_cosmos::PartitionKey {
        use azure_data_cosmos::models::PartitionKeyValue;
        match &self.0 {
            Value::String(s) => s.clone().into(),
            Value::Bool(b) => (*b).into(),
            Value::Number(n) => match n.as_i64() {
                Some(i) => i.into(),
                None => PartitionKeyValue::try_from(n.as_f64().unwrap_or(0.0))
                    .unwrap_or(PartitionKeyValue::NULL)
                    .into(),
            },
            _ => PartitionKeyValue::NULL.into(),
        }
    }

    /// One text per key, distinct across types (`"5"` vs `5`): for maps and hashing.
    pub fn canonical(&self) -> String {
        self.0.to_string()
    }
}

/// Strings as they are; other keys as JSON (`5`, `true`, `null`).
impl std::fmt::Display for MessageKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Value::String(s) => f.write_str(s),
            other => write!(f, "{other}"),
        }
    }
}

impl From<&str> for MessageKey {
    fn from(s: &str) -> Self {
        Self(Value::String(s.to_owned()))
    }
}

impl From<String> for MessageKey {
    fn from(s: String) -> Self {
        Self(Value::String(s))
    }
}

impl From<&String> for MessageKey {
    fn from(s: &String) -> Self {
        Self(Value::String(s.clone()))
    }
}

impl From<i64> for MessageKey {
    fn from(n: i64) -> Self {
        Self(Value::from(n))
    }
}

impl From<bool> for MessageKey {
    fn from(b: bool) -> Self {
        Self(Value::Bool(b))
    }
}

impl PartialEq<&str> for MessageKey {
    fn eq(&self, other: &&str) -> bool {
        self.0.as_str() == Some(*other)
    }
}

/// A message body: JSON is stored as is (readable in the portal), bytes as base64.
#[derive(Clone, Debug, PartialEq)]
pub enum Body {
    /// JSON, stored as is.
    Json(Value),
    /// Bytes, stored as base64.
    Bytes(Vec<u8>),
}

impl Body {
    /// The body as bytes: JSON is serialised, bytes are returned as they are.
    pub fn to_bytes(&self) -> Vec<u8> {
        match self {
            Body::Json(v) => serde_json::to_vec(v).unwrap_or_default(),
            Body::Bytes(b) => b.clone(),
        }
    }
}

/// A message to enqueue.
#[derive(Clone, Debug, PartialEq)]
pub struct NewMessage {
    /// Producer-given id for idempotent enqueue; generated when absent.
    pub id: Option<String>,
    /// The ordering key. Absent: the id, which spreads messages evenly over partitions.
    pub partition_key: Option<MessageKey>,
    /// The payload.
    pub body: Body,
    /// Its media type (`application/json` for a JSON body when absent).
    pub content_type: Option<String>,
    /// String pairs delivered with the message (as headers).
    pub metadata: BTreeMap<String, String>,
    /// Not delivered before this time (epoch ms).
    pub visible_at: Option<i64>,
    /// Not delivered until this long after enqueue (ignored when `visible_at` is set).
    pub delay: Option<Duration>,
    /// Per-message time to live, overriding the queue's retention.
    pub ttl: Option<Duration>,
}

impl NewMessage {
    /// A JSON message.
    pub fn json(body: Value) -> Self {
        Self::with_body(Body::Json(body))
    }

    /// A binary message.
    pub fn bytes(body: impl Into<Vec<u8>>) -> Self {
        Self::with_body(Body::Bytes(body.into()))
    }

    fn with_body(body: Body) -> Self {
        Self {
            id: None,
            partition_key: None,
            body,
            content_type: None,
            metadata: BTreeMap::new(),
            visible_at: None,
            delay: None,
            ttl: None,
        }
    }

    /// With the producer's id (idempotent enqueue).
    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }

    /// With a partition key (the ordering key).
    pub fn with_partition_key(mut self, key: impl Into<MessageKey>) -> Self {
        self.partition_key = Some(key.into());
        self
    }

    /// With a media type.
    pub fn with_content_type(mut self, content_type: impl Into<String>) -> Self {
        self.content_type = Some(content_type.into());
        self
    }

    /// With one metadata entry.
    pub fn with_metadata(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.metadata.insert(key.into(), value.into());
        self
    }

    /// With the producer's trace context (stored in metadata as `traceparent`/`tracestate`).
    pub fn with_trace_context(mut self, trace: &crate::trace::TraceContext) -> Self {
        trace.store(&mut self.metadata);
        self
    }

    /// With `trace` (a request's) unless the message carries a valid context of its own,
    /// which wins.
    pub fn inherit_trace(self, trace: Option<&crate::trace::TraceContext>) -> Self {
        match trace {
            Some(trace) if crate::trace::TraceContext::from_metadata(&self.metadata).is_none() => {
                self.with_trace_context(trace)
            }
            _ => self,
        }
    }

    /// Delivered no sooner than `delay` after enqueue.
    pub fn with_delay(mut self, delay: Duration) -> Self {
        self.delay = Some(delay);
        self
    }

    /// Delivered no sooner than `epoch_ms`.
    pub fn with_visible_at(mut self, epoch_ms: i64) -> Self {
        self.visible_at = Some(epoch_ms);
        self
    }

    /// Removed after `ttl` if not settled (at most the queue's retention).
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// Validates and turns the message into its stored form at time `now_ms`.
    pub fn into_message(self, now_ms: i64) -> Result<Message, MessageError> {
        let id = match self.id {
            Some(id) => {
                validate_id(&id)?;
                id
            }
            None => uuid::Uuid::new_v4().to_string(),
        };
        let partition_key = self.partition_key.unwrap_or_else(|| MessageKey::from(&id));
        partition_key.validate()?;
        if self.metadata.keys().any(|k| k.is_empty()) {
            return Err(MessageError::EmptyMetadataKey);
        }
        let ttl_secs = match self.ttl {
            Some(t) if t.as_secs() == 0 => return Err(MessageError::InvalidTtl),
            Some(t) => Some(i64::try_from(t.as_secs()).unwrap_or(i64::from(i32::MAX))),
            None => None,
        };
        let visible_at = self
            .visible_at
            .or_else(|| self.delay.map(|d| now_ms.saturating_add(duration_ms(d))))
            .filter(|at| *at > now_ms);
        Ok(Message {
            id,
            partition_key,
            body: self.body,
            content_type: self.content_type,
            metadata: self.metadata,
            enqueued_at: now_ms,
            visible_at,
            ttl_secs,
        })
    }
}

fn validate_id(id: &str) -> Result<(), MessageError> {
    if id.is_empty() || id.len() > 255 || id.contains(['/', '\\', '?', '#']) {
        return Err(MessageError::InvalidId(id.chars().take(300).collect()));
    }
    Ok(())
}

/// A stored message, as consumers see it.
#[derive(Clone, Debug, PartialEq)]
pub struct Message {
    /// The message's id.
    pub id: String,
    /// Its partition key, of the JSON type its producer gave.
    pub partition_key: MessageKey,
    /// The payload.
    pub body: Body,
    /// Its media type.
    pub content_type: Option<String>,
    /// Its metadata.
    pub metadata: BTreeMap<String, String>,
    /// Enqueue time, epoch ms.
    pub enqueued_at: i64,
    /// Not deliverable before this time, epoch ms.
    pub visible_at: Option<i64>,
    /// Per-message TTL in seconds; `None` means the queue's retention applies.
    pub ttl_secs: Option<i64>,
}

impl Message {
    /// When the message leaves the container by TTL (epoch ms), given the queue's retention.
    /// An item's own `ttl` wins over the container's; `-1` (or any negative) is Cosmos DB's
    /// "never", which another producer may write.
    pub fn expires_at(&self, retention_secs: Option<i64>) -> Option<i64> {
        let secs = match self.ttl_secs {
            Some(ttl) if ttl < 0 => return None,
            Some(ttl) => Some(ttl),
            None => retention_secs,
        };
        secs.map(|secs| self.enqueued_at.saturating_add(secs.saturating_mul(1000)))
    }

    /// Whether the message may be delivered at `now_ms`.
    pub fn is_visible(&self, now_ms: i64) -> bool {
        self.visible_at.is_none_or(|at| at <= now_ms)
    }

    /// The document stored in the messages container; fails when it would exceed Cosmos' limit.
    pub fn to_document(&self, pk_field: &str) -> Result<Value, MessageError> {
        let mut doc = Map::new();
        doc.insert("id".into(), Value::String(self.id.clone()));
        doc.insert(pk_field.into(), self.partition_key.as_json().clone());
        match &self.body {
            Body::Json(v) => doc.insert("body".into(), v.clone()),
            Body::Bytes(b) => doc.insert(
                "bodyBase64".into(),
                Value::String(base64::engine::general_purpose::STANDARD.encode(b)),
            ),
        };
        if let Some(ct) = &self.content_type {
            doc.insert("contentType".into(), Value::String(ct.clone()));
        }
        if !self.metadata.is_empty() {
            let meta = self
                .metadata
                .iter()
                .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                .collect();
            doc.insert("metadata".into(), Value::Object(meta));
        }
        doc.insert("enqueuedAt".into(), self.enqueued_at.into());
        if let Some(at) = self.visible_at {
            doc.insert("visibleAt".into(), at.into());
        }
        if let Some(ttl) = self.ttl_secs {
            doc.insert("ttl".into(), ttl.into());
        }
        let doc = Value::Object(doc);
        let size = serde_json::to_vec(&doc)
            .map(|b| b.len())
            .unwrap_or(usize::MAX);
        if size > MAX_DOCUMENT_BYTES {
            return Err(MessageError::TooLarge { size });
        }
        Ok(doc)
    }

    /// Reads a document from the messages container. Anything that is not a message written
    /// by a producer is reported with the reason, so a consumer can skip and log it.
    pub fn from_document(doc: &Value, pk_field: &str) -> Result<Message, String> {
        let obj = doc.as_object().ok_or("not a JSON object")?;
        let text = |name: &str| obj.get(name).and_then(Value::as_str).map(str::to_owned);
        let id = text("id").ok_or("no string id")?;
        let partition_key = match obj.get(pk_field) {
            Some(v) => MessageKey::from_json(v.clone())
                .map_err(|e| format!("partition key property {pk_field:?}: {e}"))?,
            None => return Err(format!("no partition key property {pk_field:?}")),
        };
        let body = match (obj.get("body"), obj.get("bodyBase64")) {
            (Some(v), None) => Body::Json(v.clone()),
            (None, Some(Value::String(b64))) => Body::Bytes(
                base64::engine::general_purpose::STANDARD
                    .decode(b64)
                    .map_err(|e| format!("bodyBase64 is not base64: {e}"))?,
            ),
            (None, None) => return Err("no body or bodyBase64".into()),
            _ => return Err("both body and bodyBase64, or bodyBase64 not a string".into()),
        };
        let enqueued_at = obj
            .get("enqueuedAt")
            .and_then(Value::as_i64)
            .ok_or("no numeric enqueuedAt")?;
        let metadata = match obj.get("metadata") {
            None | Some(Value::Null) => BTreeMap::new(),
            Some(Value::Object(m)) => m
                .iter()
                .map(|(k, v)| {
                    let v = v
                        .as_str()
                        .map(str::to_owned)
                        .unwrap_or_else(|| v.to_string());
                    (k.clone(), v)
                })
                .collect(),
            Some(_) => return Err("metadata is not an object".into()),
        };
        Ok(Message {
            id,
            partition_key,
            body,
            content_type: text("contentType"),
            metadata,
            enqueued_at,
            visible_at: obj.get("visibleAt").and_then(Value::as_i64),
            ttl_secs: obj.get("ttl").and_then(Value::as_i64),
        })
    }
}

/// A message as producers write it in JSON (CLI input lines, the sidecar's enqueue API).
///
/// `{"id"?, "partitionKey"?, "body"? | "bodyBase64"?, "contentType"?, "metadata"?,
///   "delay"? ("30s"), "scheduledAt"? (RFC 3339), "ttl"? ("1h")}`
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MessageInput {
    /// The producer's id (idempotent enqueue).
    pub id: Option<String>,
    /// A string, number, boolean or null.
    pub partition_key: Option<MessageKey>,
    /// A JSON body.
    pub body: Option<Value>,
    /// A binary body, base64.
    pub body_base64: Option<String>,
    /// Its media type.
    pub content_type: Option<String>,
    /// String pairs delivered with the message.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// Delivered no sooner than this after enqueue (`30s`).
    pub delay: Option<String>,
    /// Delivered no sooner than this time (RFC 3339).
    pub scheduled_at: Option<String>,
    /// Removed after this long if not settled (`1h`).
    pub ttl: Option<String>,
}

impl TryFrom<MessageInput> for NewMessage {
    type Error = MessageError;

    fn try_from(input: MessageInput) -> Result<Self, Self::Error> {
        let body = match (input.body, input.body_base64) {
            (Some(_), Some(_)) => return Err(MessageError::AmbiguousBody),
            (Some(v), None) => Body::Json(v),
            (None, Some(b64)) => Body::Bytes(
                base64::engine::general_purpose::STANDARD
                    .decode(b64)
                    .map_err(|e| MessageError::InvalidBase64(e.to_string()))?,
            ),
            (None, None) => Body::Json(Value::Null),
        };
        let duration = |field, text: Option<String>| -> Result<Option<Duration>, MessageError> {
            text.map(|value| {
                humantime::parse_duration(&value)
                    .map_err(|_| MessageError::InvalidDuration { field, value })
            })
            .transpose()
        };
        let visible_at = input
            .scheduled_at
            .map(|t| {
                humantime::parse_rfc3339_weak(&t)
                    .map(|st| {
                        st.duration_since(std::time::UNIX_EPOCH)
                            .map(duration_ms)
                            .unwrap_or(0)
                    })
                    .map_err(|_| MessageError::InvalidScheduledAt(t))
            })
            .transpose()?;
        let ttl = duration("ttl", input.ttl)?;
        Ok(NewMessage {
            id: input.id,
            partition_key: input.partition_key,
            body,
            content_type: input.content_type,
            metadata: input.metadata,
            visible_at,
            delay: duration("delay", input.delay)?,
            ttl,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{TraceContext, TRACEPARENT, TRACESTATE};
    use serde_json::json;

    #[test]
    fn a_request_trace_is_inherited_unless_the_message_has_its_own() {
        let request = TraceContext::parse(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            Some("congo=t61rcWkgMzE"),
        )
        .unwrap();
        let own = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let inherited = NewMessage::json(json!(1)).inherit_trace(Some(&request));
        assert_eq!(
            TraceContext::from_metadata(&inherited.metadata),
            Some(request.clone())
        );
        let kept = NewMessage::json(json!(1))
            .with_metadata(TRACEPARENT, own)
            .inherit_trace(Some(&request));
        assert_eq!(kept.metadata[TRACEPARENT], own);
        assert!(
            !kept.metadata.contains_key(TRACESTATE),
            "not the request's state"
        );
        let repaired = NewMessage::json(json!(1))
            .with_metadata(TRACEPARENT, "garbage")
            .with_metadata(TRACESTATE, "stale=1")
            .inherit_trace(Some(&request));
        assert_eq!(
            TraceContext::from_metadata(&repaired.metadata),
            Some(request)
        );
        assert_eq!(
            NewMessage::json(json!(1)).inherit_trace(None).metadata,
            BTreeMap::new()
        );
        let stored = inherited.with_id("m").into_message(0).unwrap();
        let doc = stored.to_document("pk").unwrap();
        assert_eq!(
            TraceContext::from_metadata(&Message::from_document(&doc, "pk").unwrap().metadata)
                .unwrap()
                .trace_id(),
            "4bf92f3577b34da6a3ce929d0e0e4736",
            "stored with the message"
        );
    }

    #[test]
    fn round_trips_json_and_bytes_bodies() {
        for body in [
            Body::Json(json!({"order": 7})),
            Body::Bytes(vec![0, 159, 146, 150]),
        ] {
            let msg = NewMessage::with_body(body)
                .with_id("m1")
                .with_partition_key("tenant-a")
                .with_metadata("source", "test")
                .with_content_type("application/x")
                .with_ttl(Duration::from_secs(60))
                .into_message(1_000)
                .unwrap();
            let doc = msg.to_document("tenant").unwrap();
            assert_eq!(doc["tenant"], "tenant-a");
            assert_eq!(Message::from_document(&doc, "tenant").unwrap(), msg);
        }
    }

    #[test]
    fn defaults_spread_by_id_and_delay_sets_visibility() {
        let msg = NewMessage::json(json!(1))
            .with_delay(Duration::from_secs(5))
            .into_message(10_000)
            .unwrap();
        assert_eq!(msg.partition_key, MessageKey::from(&msg.id));
        assert_eq!(msg.visible_at, Some(15_000));
        assert!(!msg.is_visible(14_999));
        assert!(msg.is_visible(15_000));
        let past = NewMessage::json(json!(1))
            .with_visible_at(5)
            .into_message(10)
            .unwrap();
        assert_eq!(past.visible_at, None, "a time in the past is just visible");
    }

    #[test]
    fn expiry_uses_message_ttl_over_retention() {
        let msg = NewMessage::json(json!(1)).into_message(1_000).unwrap();
        assert_eq!(msg.expires_at(Some(10)), Some(11_000));
        assert_eq!(msg.expires_at(None), None);
        let msg = NewMessage::json(json!(1))
            .with_ttl(Duration::from_secs(2))
            .into_message(1_000)
            .unwrap();
        assert_eq!(msg.expires_at(Some(10)), Some(3_000));
    }

    #[test]
    fn a_foreign_ttl_of_minus_one_never_expires_whatever_the_retention() {
        // Another producer wrote `"ttl": -1` (Cosmos DB's "never"): no expiry, so a retry
        // backs off as usual and a completion is kept as long as the container keeps items.
        let doc = json!({"id": "m", "pk": "k", "body": 1, "enqueuedAt": 1_000, "ttl": -1});
        let msg = Message::from_document(&doc, "pk").unwrap();
        assert_eq!(msg.expires_at(Some(10)), None);
        assert_eq!(msg.expires_at(None), None);
    }

    #[test]
    fn rejects_oversized_documents_without_truncating() {
        let big = "x".repeat(MAX_ITEM_BYTES);
        let msg = NewMessage::json(json!(big)).into_message(0).unwrap();
        let err = msg.to_document("pk").unwrap_err();
        assert!(matches!(err, MessageError::TooLarge { size } if size > MAX_ITEM_BYTES));
        assert!(err.to_string().contains("2 MB"));
        let fits = "x".repeat(MAX_DOCUMENT_BYTES - 200);
        let msg = NewMessage::json(json!(fits)).into_message(0).unwrap();
        assert!(msg.to_document("pk").is_ok());
    }

    #[test]
    fn rejects_invalid_ids_and_keys() {
        for id in ["", "a/b", "a?b", "a#b", "a\\b"] {
            let err = NewMessage::json(json!(1)).with_id(id).into_message(0);
            assert!(matches!(err, Err(MessageError::InvalidId(_))), "{id:?}");
        }
        let err = NewMessage::json(json!(1))
            .with_partition_key("k".repeat(3000))
            .into_message(0);
        assert_eq!(err, Err(MessageError::InvalidPartitionKey));
    }

    #[test]
    fn malformed_documents_have_reasons() {
        let cases = [
            (json!("text"), "not a JSON object"),
            (
                json!({"pk": "a", "body": 1, "enqueuedAt": 1}),
                "no string id",
            ),
            (
                json!({"id": "a", "body": 1, "enqueuedAt": 1}),
                "no partition key",
            ),
            (json!({"id": "a", "pk": "a", "enqueuedAt": 1}), "no body"),
            (json!({"id": "a", "pk": "a", "body": 1}), "enqueuedAt"),
            (
                json!({"id": "a", "pk": "a", "bodyBase64": "%%%", "enqueuedAt": 1}),
                "base64",
            ),
        ];
        for (doc, reason) in cases {
            let err = Message::from_document(&doc, "pk").unwrap_err();
            assert!(err.contains(reason), "{doc}: {err}");
        }
    }

    #[test]
    fn parses_producer_json() {
        let input: MessageInput = serde_json::from_value(json!({
            "id": "o-1", "partitionKey": "c-9", "body": {"total": 3},
            "metadata": {"k": "v"}, "delay": "30s", "ttl": "1h"
        }))
        .unwrap();
        let msg = NewMessage::try_from(input)
            .unwrap()
            .into_message(0)
            .unwrap();
        assert_eq!(msg.visible_at, Some(30_000));
        assert_eq!(msg.ttl_secs, Some(3600));
        assert_eq!(msg.metadata["k"], "v");
        let input: MessageInput =
            serde_json::from_value(json!({"scheduledAt": "2030-01-01T00:00:00Z"})).unwrap();
        let msg = NewMessage::try_from(input)
            .unwrap()
            .into_message(0)
            .unwrap();
        assert_eq!(msg.visible_at, Some(1_893_456_000_000));
        let bad: Result<MessageInput, _> = serde_json::from_value(json!({"bdy": 1}));
        assert!(bad.is_err(), "unknown fields are rejected, not ignored");
        let input: MessageInput =
            serde_json::from_value(json!({"body": 1, "bodyBase64": "AA=="})).unwrap();
        assert_eq!(
            NewMessage::try_from(input).unwrap_err(),
            MessageError::AmbiguousBody
        );
    }
}
