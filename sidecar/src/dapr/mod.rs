//! Dapr's publish API on the sidecar's localhost port, so an app (or a Dapr SDK client) that
//! publishes with `POST /v1.0/publish/<pubsubname>/<topic>` works unchanged: the pub/sub is
//! [`crate::app::PUBSUB_NAME`] or the name the app's own subscription gives, the topic is the
//! sidecar's queue. Answers and error bodies are
//! Dapr's (`204`; `{"errorCode": "ERR_PUBSUB_NOT_FOUND", "message": …}`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use cosmosq_queue::trace::{TRACEPARENT, TRACESTATE};
use cosmosq_queue::{EnqueueOutcome, MessageError, NewMessage, QueueError, TraceContext};
use serde_json::{json, Value};

use crate::api::ApiState;
use crate::app::PUBSUB_NAME;
use crate::spans::Publish;

pub mod go_json;
pub mod grpc;
pub mod metadata;

/// `POST /v1.0/shutdown`, Dapr's shutdown API (Jobs call it when their work is done): the
/// sidecar stops as on SIGTERM — no new deliveries, those in flight settled, leases released —
/// then exits (a SIGTERM meanwhile starts the usual grace period). `204` at once, as daprd
/// answers. Behind the API token when one is set.
pub async fn shutdown(State(state): State<Arc<ApiState>>) -> StatusCode {
    stop(&state);
    StatusCode::NO_CONTENT
}

/// Stops the sidecar as SIGTERM does: Dapr's shutdown API, over HTTP or gRPC.
fn stop(state: &ApiState) {
    tracing::info!("shutdown requested through the API: draining, then exiting");
    state.stopping.cancel();
}

/// Why a publish was refused, each with Dapr's error code.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// Not this sidecar's pub/sub.
    #[error("pubsub '{0}' not found")]
    PubsubNotFound(String),
    /// A topic other than this sidecar's queue and those its group may publish to.
    #[error("topic '{topic}' is not allowed: this sidecar publishes to {allowed} only (a group publishes to other queues listed in its spec.publishTo)")]
    TopicForbidden {
        /// Asked for.
        topic: String,
        /// The ones there are, quoted.
        allowed: String,
    },
    /// A body sent as `application/cloudevents+json` that is not a CloudEvent.
    #[error("the body is not a CloudEvent: {0}")]
    CloudEvent(String),
    /// A `metadata.*` query parameter that does not parse.
    #[error("metadata.{key} {value:?} is invalid")]
    Metadata {
        /// The parameter, without `metadata.`.
        key: String,
        /// What was given.
        value: String,
    },
    /// The message was refused (too large, invalid id, …).
    #[error(transparent)]
    Message(#[from] MessageError),
    /// The queue did not take it.
    #[error("publishing failed: {0}")]
    Queue(#[from] QueueError),
    /// A bulk publish whose body is not a list of entries.
    #[error("the body is not a list of bulk publish entries: {0}")]
    BulkBody(String),
}

impl PublishError {
    /// Dapr's error code (`ERR_PUBSUB_NOT_FOUND`, …).
    pub fn code(&self) -> &'static str {
        match self {
            Self::PubsubNotFound(_) => "ERR_PUBSUB_NOT_FOUND",
            Self::TopicForbidden { .. } => "ERR_PUBSUB_FORBIDDEN",
            Self::CloudEvent(_) => "ERR_PUBSUB_CLOUD_EVENTS_SER",
            Self::Metadata { .. } => "ERR_PUBSUB_REQUEST_METADATA",
            Self::Message(_) | Self::Queue(_) => "ERR_PUBSUB_PUBLISH_MESSAGE",
            Self::BulkBody(_) => "ERR_PUBSUB_EVENTS_SER",
        }
    }

    /// The HTTP API's status for it.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::PubsubNotFound(_)
            | Self::CloudEvent(_)
            | Self::Metadata { .. }
            | Self::BulkBody(_) => StatusCode::BAD_REQUEST,
            Self::TopicForbidden { .. } => StatusCode::FORBIDDEN,
            Self::Message(MessageError::TooLarge { .. }) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Message(_) => StatusCode::BAD_REQUEST,
            Self::Queue(e) if e.status() == Some(429) => StatusCode::TOO_MANY_REQUESTS,
            Self::Queue(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl IntoResponse for PublishError {
    fn into_response(self) -> Response {
        let body = json!({"errorCode": self.code(), "message": self.to_string()});
        (self.status(), Json(body)).into_response()
    }
}

/// Which pub/sub and topic a publish names, checked against this sidecar's: its own name, or
/// the one the app's subscription gave (an unmodified Dapr app publishes under that); the
/// topic one of `topics` (its own queue, then those its group may publish to). The index of
/// the topic in `topics`.
pub fn check_target(
    pubsub: &str,
    topic: &str,
    topics: &[&str],
    apps_name: Option<&str>,
) -> Result<usize, PublishError> {
    if pubsub != PUBSUB_NAME && Some(pubsub) != apps_name {
        return Err(PublishError::PubsubNotFound(pubsub.to_owned()));
    }
    topics
        .iter()
        .position(|t| *t == topic)
        .ok_or_else(|| PublishError::TopicForbidden {
            topic: topic.to_owned(),
            allowed: topics
                .iter()
                .map(|t| format!("'{t}'"))
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// The message a Dapr publish becomes (pure). The body is the data, with `Content-Type` as
/// its media type (Dapr's default: `text/plain`); an `application/cloudevents+json` body is
/// the publisher's own event: its `id` is the message id (publishing it twice enqueues it
/// once), its `data` the body, and its `traceparent`/`tracestate` the trace, unless
/// `metadata.rawPayload` says to keep the body as it is. `metadata.ttlInSeconds` is the
/// message's time to live; other `metadata.*` parameters become its metadata.
pub fn message_of(
    content_type: Option<&str>,
    query: &HashMap<String, String>,
    body: &[u8],
) -> Result<NewMessage, PublishError> {
    let content_type = content_type.unwrap_or("text/plain");
    let media = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    let metadata: HashMap<&str, &str> = query
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix("metadata.")?, v.as_str())))
        .collect();
    let bad = |key: &str, value: &str| PublishError::Metadata {
        key: key.to_owned(),
        value: value.to_owned(),
    };
    let raw = match metadata.get("rawPayload") {
        None => false,
        Some(v) => v.parse::<bool>().map_err(|_| bad("rawPayload", v))?,
    };
    let mut message = if media == "application/cloudevents+json" && !raw {
        from_cloud_event(body)?
    } else {
        let json = media == "application/json" || media.ends_with("+json");
        match serde_json::from_slice::<Value>(body) {
            Ok(value) if json => NewMessage::json(value),
            Err(e) if json => return Err(PublishError::CloudEvent(format!("not JSON: {e}"))),
            _ => NewMessage::bytes(body.to_vec()),
        }
        .with_content_type(content_type)
    };
    for (key, value) in metadata {
        match key {
            "ttlInSeconds" => {
                let secs: u64 = value.parse().map_err(|_| bad(key, value))?;
                message = message.with_ttl(Duration::from_secs(secs));
            }
            "rawPayload" => {}
            _ => message = message.with_metadata(key, value),
        }
    }
    Ok(message)
}

fn from_cloud_event(body: &[u8]) -> Result<NewMessage, PublishError> {
    let event: Value =
        serde_json::from_slice(body).map_err(|e| PublishError::CloudEvent(e.to_string()))?;
    let Some(attributes) = event.as_object() else {
        return Err(PublishError::CloudEvent("not a JSON object".into()));
    };
    let text = |name: &str| attributes.get(name).and_then(Value::as_str);
    let mut message = match (attributes.get("data"), text("data_base64")) {
        (Some(_), Some(_)) => {
            return Err(PublishError::CloudEvent("both data and data_base64".into()))
        }
        (_, Some(b64)) => NewMessage::bytes(
            base64::engine::general_purpose::STANDARD
                .decode(b64)
                .map_err(|e| PublishError::CloudEvent(format!("data_base64: {e}")))?,
        ),
        (Some(data), None) => NewMessage::json(data.clone()),
        (None, None) => NewMessage::json(Value::Null),
    };
    if let Some(id) = text("id") {
        message = message.with_id(id);
    }
    if let Some(media) = text("datacontenttype") {
        message = message.with_content_type(media);
    }
    for name in ["type", "source", "subject"] {
        if let Some(value) = text(name) {
            message = message.with_metadata(format!("cloudevent.{name}"), value);
        }
    }
    let trace = text(TRACEPARENT).and_then(|t| TraceContext::parse(t, text(TRACESTATE)));
    Ok(message.inherit_trace(trace.as_ref()))
}

/// How long a publish under a pub/sub name not yet known waits for the app's subscription,
/// which names it: an SDK publishes as soon as the sidecar answers, which can be before the
/// sidecar has asked the app (daprd knows its components' names from the start).
pub const SUBSCRIPTION_WAIT: Duration = Duration::from_secs(10);

/// The queue a publish goes to: [`check_target`] against the app's subscription's pub/sub
/// name; when a publish names another than the sidecar's own before the subscription is
/// known, after waiting for it (at most [`SUBSCRIPTION_WAIT`]).
async fn published_queue<'a>(
    state: &'a ApiState,
    pubsub: &str,
    topic: &str,
) -> Result<&'a cosmosq_queue::Queue, PublishError> {
    if pubsub != PUBSUB_NAME && state.pubsub_name.get().is_none() {
        let _ = tokio::time::timeout(SUBSCRIPTION_WAIT, state.subscribed.cancelled()).await;
    }
    let apps_name = state.pubsub_name.get().map(String::as_str);
    let queues: Vec<&cosmosq_queue::Queue> = std::iter::once(&state.queue)
        .chain(&state.publish_to)
        .collect();
    let topics: Vec<&str> = queues.iter().map(|q| q.name()).collect();
    let index = check_target(pubsub, topic, &topics, apps_name)?;
    Ok(queues[index])
}

/// A publish's result in the enqueue metric.
fn count<E>(state: &ApiState, result: &Result<EnqueueOutcome, E>) {
    let label = match result {
        Ok(outcome) if outcome.is_duplicate() => "duplicate",
        Ok(_) => "enqueued",
        Err(_) => "rejected",
    };
    state.metrics.enqueued.with_label_values(&[label]).inc();
}

/// One publish, whichever API it came through: checked, made a message and enqueued on the
/// topic's queue, in a span under the caller's trace; counted in the enqueue metric.
pub(crate) async fn publish_one(
    state: &ApiState,
    pubsub: &str,
    topic: &str,
    content_type: Option<&str>,
    query: &HashMap<String, String>,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<(), PublishError> {
    let published = async {
        let queue = published_queue(state, pubsub, topic).await?;
        let message = message_of(content_type, query, body)?;
        let mut publish = Publish::one(state, queue.name(), headers, &message);
        let enqueued = queue.enqueue(publish.stamp(message)).await;
        if let Err(e) = &enqueued {
            publish.failed(1, &e.to_string());
        }
        Ok::<_, PublishError>(enqueued?)
    }
    .await;
    count(state, &published);
    published.map(|_| ())
}

/// `POST /v1.0/publish/<pubsubname>/<topic>`.
pub async fn publish(
    State(state): State<Arc<ApiState>>,
    Path((pubsub, topic)): Path<(String, String)>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let content_type = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    match publish_one(
        &state,
        &pubsub,
        &topic,
        content_type,
        &query,
        &headers,
        &body,
    )
    .await
    {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => e.into_response(),
    }
}

/// One entry of a bulk publish, as Dapr's HTTP API takes it.
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct BulkEntry {
    entry_id: String,
    event: Value,
    #[serde(default)]
    content_type: Option<String>,
    #[serde(default)]
    metadata: HashMap<String, String>,
}

/// One entry of a bulk publish, as either API carries it: the event's bytes.
#[derive(Debug)]
pub struct RawEntry {
    /// The publisher's id of the entry (its answer names failed entries by it).
    pub entry_id: String,
    /// The event.
    pub event: Vec<u8>,
    /// Its media type; `text/plain` when none.
    pub content_type: Option<String>,
    /// The entry's own metadata (it wins over the request's).
    pub metadata: HashMap<String, String>,
}

/// The entries of an HTTP bulk publish's body (pure): JSON, its field names read as daprd's
/// Go decoder reads them. A string event is `text/plain`, other JSON `application/json`,
/// unless the entry says.
fn http_entries(body: &[u8]) -> Result<Vec<RawEntry>, PublishError> {
    let mut body: Value =
        serde_json::from_slice(body).map_err(|e| PublishError::BulkBody(e.to_string()))?;
    go_json::fold_each(&mut body, &["entryId", "event", "contentType", "metadata"]);
    let entries: Vec<BulkEntry> =
        serde_json::from_value(body).map_err(|e| PublishError::BulkBody(e.to_string()))?;
    Ok(entries
        .into_iter()
        .map(|entry| {
            let content_type = entry.content_type.unwrap_or_else(|| {
                if entry.event.is_string() {
                    "text/plain".into()
                } else {
                    "application/json".into()
                }
            });
            let event = match (&entry.event, content_type.starts_with("text/")) {
                (Value::String(text), true) => text.clone().into_bytes(),
                (event, _) => serde_json::to_vec(event).unwrap_or_default(),
            };
            RawEntry {
                entry_id: entry.entry_id,
                event,
                content_type: Some(content_type),
                metadata: entry.metadata,
            }
        })
        .collect())
}

/// The messages of a bulk publish (pure), each under its `entryId`, and the entries refused
/// with why. Each entry is what a single publish of its event with its content type would be,
/// with the request's `metadata.*` and the entry's own `metadata` (which wins).
pub fn entry_messages(
    query: &HashMap<String, String>,
    entries: Vec<RawEntry>,
) -> Result<Bulk, PublishError> {
    let mut ids = std::collections::HashSet::new();
    if let Some(e) = entries.iter().find(|e| !ids.insert(e.entry_id.as_str())) {
        return Err(PublishError::BulkBody(format!(
            "entryId {:?} appears twice",
            e.entry_id
        )));
    }
    let (mut messages, mut failed) = (Vec::new(), Vec::new());
    for entry in entries {
        let mut params = query.clone();
        for (key, value) in entry.metadata {
            params.insert(format!("metadata.{key}"), value);
        }
        match message_of(entry.content_type.as_deref(), &params, &entry.event) {
            Ok(message) => messages.push((entry.entry_id, message)),
            Err(e) => failed.push((entry.entry_id, e.to_string())),
        }
    }
    Ok(Bulk { messages, failed })
}

/// [`entry_messages`] of an HTTP bulk publish's body (pure).
pub fn bulk_messages(query: &HashMap<String, String>, body: &[u8]) -> Result<Bulk, PublishError> {
    entry_messages(query, http_entries(body)?)
}

/// A bulk publish's entries: the messages by `entryId`, and the entries refused with why.
#[derive(Debug)]
pub struct Bulk {
    /// Messages to enqueue, by entry.
    pub messages: Vec<(String, NewMessage)>,
    /// Entries refused, with the reason.
    pub failed: Vec<(String, String)>,
}

/// A bulk publish, whichever API it came through: the entries that were not enqueued, with
/// why (the others were), or why none was.
pub(crate) async fn publish_entries(
    state: &ApiState,
    pubsub: &str,
    topic: &str,
    headers: &HeaderMap,
    bulk: Result<Bulk, PublishError>,
) -> Result<Vec<(String, String)>, PublishError> {
    let parsed = match published_queue(state, pubsub, topic).await {
        Ok(queue) => bulk.map(|bulk| (queue, bulk)),
        Err(e) => Err(e),
    };
    let (
        queue,
        Bulk {
            messages,
            mut failed,
        },
    ) = match parsed {
        Ok(parsed) => {
            state.metrics.rejected(parsed.1.failed.len());
            parsed
        }
        Err(e) => {
            state.metrics.rejected(1);
            return Err(e);
        }
    };
    let mut publish = Publish::start(
        &state.telemetry,
        queue.name(),
        crate::api::caller_trace(headers),
        messages.len(),
    );
    let (entry_ids, messages): (Vec<String>, Vec<NewMessage>) = messages
        .into_iter()
        .map(|(id, m)| (id, publish.stamp(m)))
        .unzip();
    for (entry_id, result) in entry_ids
        .into_iter()
        .zip(queue.enqueue_batch(messages).await)
    {
        count(state, &result);
        if let Err(e) = result {
            failed.push((entry_id, e.to_string()));
        }
    }
    if !failed.is_empty() {
        publish.failed(failed.len(), "some messages were not enqueued");
    }
    Ok(failed)
}

/// `POST /v1.0-alpha1/publish/bulk/<pubsubname>/<topic>`: `204` when every entry was
/// enqueued; otherwise Dapr's `500` with `{"failedEntries": [{"entryId", "error"}],
/// "errorCode": "ERR_PUBSUB_PUBLISH_MESSAGE"}` (the others were enqueued).
pub async fn publish_bulk(
    State(state): State<Arc<ApiState>>,
    Path((pubsub, topic)): Path<(String, String)>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let bulk = bulk_messages(&query, &body);
    let failed = match publish_entries(&state, &pubsub, &topic, &headers, bulk).await {
        Ok(failed) if failed.is_empty() => return StatusCode::NO_CONTENT.into_response(),
        Ok(failed) => failed,
        Err(e) => return e.into_response(),
    };
    let failed: Vec<Value> = failed
        .into_iter()
        .map(|(entry_id, error)| json!({"entryId": entry_id, "error": error}))
        .collect();
    (
        StatusCode::INTERNAL_SERVER_ERROR,
        Json(json!({"failedEntries": failed, "errorCode": "ERR_PUBSUB_PUBLISH_MESSAGE"})),
    )
        .into_response()
}

/// Dapr's health endpoints (`/v1.0/healthz`, `/v1.0/healthz/outbound`, which Dapr SDKs wait
/// on before their first call): 204 once the sidecar is up.
pub async fn healthz() -> StatusCode {
    StatusCode::NO_CONTENT
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn bulk_entries_are_read_with_go_field_names() {
        // The JavaScript SDK's spelling (`entryID`) and others daprd accepts.
        let body = serde_json::to_vec(&json!([
            {"entryID": "1", "event": {"n": 1}},
            {"EntryId": "2", "Event": "text", "ContentType": "text/plain",
             "METADATA": {"ttlInSeconds": "10"}, "unknown": true}
        ]))
        .unwrap();
        let Bulk { messages, failed } = bulk_messages(&HashMap::new(), &body).unwrap();
        assert!(failed.is_empty(), "{failed:?}");
        let ids: Vec<&str> = messages.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids, ["1", "2"]);
        let built: Vec<cosmosq_queue::Message> = messages
            .into_iter()
            .map(|(_, m)| m.into_message(0).unwrap())
            .collect();
        assert_eq!(built[0].body, cosmosq_queue::Body::Json(json!({"n": 1})));
        assert_eq!(built[1].body.to_bytes(), b"text");
        assert_eq!(built[1].content_type.as_deref(), Some("text/plain"));
        assert_eq!(built[1].ttl_secs, Some(10), "the entry's metadata was read");
    }

    #[test]
    fn bulk_entries_are_single_publishes_each_and_fail_alone() {
        let body = serde_json::to_vec(&json!([
            {"entryId": "1", "event": "first text message", "contentType": "text/plain"},
            {"entryId": "2", "event": {"message": "second JSON message"}},
            {"entryId": "3", "event": {"specversion": "1.0", "id": "ev-3", "source": "s",
                "type": "t", "data": {"n": 3}}, "contentType": "application/cloudevents+json",
                "metadata": {"ttlInSeconds": "10"}},
            {"entryId": "4", "event": {"x": 1}, "metadata": {"ttlInSeconds": "soon"}}
        ]))
        .unwrap();
        let Bulk { messages, failed } =
            bulk_messages(&query(&[("metadata.source", "bulk")]), &body).unwrap();
        let ids: Vec<&str> = messages.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids, ["1", "2", "3"]);
        let built: Vec<cosmosq_queue::Message> = messages
            .into_iter()
            .map(|(_, m)| m.into_message(0).unwrap())
            .collect();
        assert_eq!(built[0].body.to_bytes(), b"first text message");
        assert_eq!(built[0].content_type.as_deref(), Some("text/plain"));
        assert_eq!(
            built[1].body,
            cosmosq_queue::Body::Json(json!({"message": "second JSON message"}))
        );
        assert_eq!(built[2].id, "ev-3", "the publisher's event id");
        assert_eq!(built[2].ttl_secs, Some(10));
        assert!(built.iter().all(|m| m.metadata["source"] == "bulk"));
        assert_eq!(failed.len(), 1);
        assert_eq!(failed[0].0, "4");
        assert!(failed[0].1.contains("ttlInSeconds"), "{failed:?}");

        for bad in [
            &b"{}"[..],
            br#"[{"event": 1}]"#,
            br#"[{"entryId":"a","event":1},{"entryId":"a","event":2}]"#,
        ] {
            let e = bulk_messages(&HashMap::new(), bad).unwrap_err();
            assert_eq!(e.code(), "ERR_PUBSUB_EVENTS_SER", "{e}");
        }
    }

    #[test]
    fn only_this_sidecars_pubsub_and_queue_are_published_to() {
        let own = ["orders"];
        assert_eq!(check_target("cosmosq", "orders", &own, None).unwrap(), 0);
        // The name the app's own subscription uses, as an unmodified Dapr app publishes.
        assert_eq!(
            check_target("pubsub", "orders", &own, Some("pubsub")).unwrap(),
            0
        );
        let e = check_target("redis-pubsub", "orders", &own, Some("pubsub")).unwrap_err();
        assert_eq!(
            (e.code(), e.status(), e.to_string().as_str()),
            (
                "ERR_PUBSUB_NOT_FOUND",
                StatusCode::BAD_REQUEST,
                "pubsub 'redis-pubsub' not found"
            )
        );
        let e = check_target("cosmosq", "payments", &own, None).unwrap_err();
        assert_eq!(
            (e.code(), e.status()),
            ("ERR_PUBSUB_FORBIDDEN", StatusCode::FORBIDDEN)
        );
        // A pipeline's next stage, under either name; a topic not granted names those that are.
        let granted = ["orders", "invoices", "receipts"];
        assert_eq!(
            check_target("cosmosq", "invoices", &granted, None).unwrap(),
            1
        );
        assert_eq!(
            check_target("pubsub", "receipts", &granted, Some("pubsub")).unwrap(),
            2
        );
        let e = check_target("pubsub", "payments", &granted, Some("pubsub")).unwrap_err();
        assert_eq!(e.code(), "ERR_PUBSUB_FORBIDDEN");
        assert!(
            e.to_string()
                .contains("publishes to 'orders', 'invoices', 'receipts' only"),
            "{e}"
        );
    }

    #[test]
    fn data_keeps_its_content_type_and_metadata_applies() {
        let m = message_of(
            Some("application/json"),
            &query(&[("metadata.ttlInSeconds", "120"), ("metadata.source", "web")]),
            br#"{"status":"completed"}"#,
        )
        .unwrap();
        assert_eq!(
            m.body,
            cosmosq_queue::Body::Json(json!({"status": "completed"}))
        );
        assert_eq!(m.content_type.as_deref(), Some("application/json"));
        assert_eq!(m.ttl, Some(Duration::from_secs(120)));
        assert_eq!(m.metadata["source"], "web");
        // Dapr's default media type: text, kept as bytes.
        let m = message_of(None, &query(&[]), b"hello").unwrap();
        assert_eq!(m.body, cosmosq_queue::Body::Bytes(b"hello".to_vec()));
        assert_eq!(m.content_type.as_deref(), Some("text/plain"));
        let e = message_of(None, &query(&[("metadata.ttlInSeconds", "soon")]), b"x").unwrap_err();
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert!(e.to_string().contains("ttlInSeconds"), "{e}");
        assert!(message_of(Some("application/json"), &query(&[]), b"{nope").is_err());
    }

    #[test]
    fn a_publishers_cloud_event_gives_the_id_data_and_trace() {
        let event = json!({
            "specversion": "1.0", "id": "evt-1", "source": "checkout", "type": "order.created",
            "datacontenttype": "application/json", "data": {"sku": 7},
            "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        });
        let body = event.to_string();
        let m = message_of(
            Some("application/cloudevents+json"),
            &query(&[]),
            body.as_bytes(),
        )
        .unwrap();
        assert_eq!(
            m.id.as_deref(),
            Some("evt-1"),
            "publishing twice enqueues once"
        );
        assert_eq!(m.body, cosmosq_queue::Body::Json(json!({"sku": 7})));
        assert_eq!(m.metadata["cloudevent.type"], "order.created");
        assert_eq!(
            TraceContext::from_metadata(&m.metadata).unwrap().trace_id(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        // rawPayload: the event is the body, as it came.
        let raw = message_of(
            Some("application/cloudevents+json"),
            &query(&[("metadata.rawPayload", "true")]),
            body.as_bytes(),
        )
        .unwrap();
        assert_eq!(raw.body, cosmosq_queue::Body::Json(event));
        assert_eq!(raw.id, None);
        let e = message_of(Some("application/cloudevents+json"), &query(&[]), b"[1]").unwrap_err();
        assert_eq!(e.code(), "ERR_PUBSUB_CLOUD_EVENTS_SER");
    }
}
