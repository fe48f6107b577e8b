//! Pull groups' localhost API (`app.mode: Pull`): workers receive and lock messages in batches
//! and settle each, as Storage Queue, SQS and Service Bus' peek-lock workers do, on the
//! engine's [`cosmosq_queue::pull`] (the same claims and guarantees as pushed delivery).
//!
//! - `POST /v1/receive?max=32&visibility=30s&wait=20s` → `{"messages": [...]}`, each with its
//!   `lockToken`, `deliveryCount` and `lockedUntil`; answers as soon as any message is there,
//!   or empty after `wait`.
//! - `POST /v1/messages/<lockToken>/complete`, `/abandon` (`{"delay": "10s", "reason": …}`,
//!   both optional), `/dead-letter` (`{"reason": …}`), `/renew?visibility=30s`;
//!   `410 Gone` when the lock is no longer held (expired: the message went back to the group).
//! - `POST /v1/settle` with `[{"lockToken", "action": "complete" | "abandon" | "deadLetter",
//!   "delay", "reason"}]` → `{"results": [{"lockToken", "settled"} | {"lockToken", "error"}]}`.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use cosmosq_queue::clock::{format_ms, system_now_ms};
use cosmosq_queue::pull::{LockLost, Received, Verdict, MAX_RECEIVE};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::api::ApiState;

/// Longest lock a receive or renew may ask for.
pub const MAX_VISIBILITY: Duration = Duration::from_secs(12 * 3600);
/// Longest a receive waits for its first message.
pub const MAX_WAIT: Duration = Duration::from_secs(60);
const DEFAULT_VISIBILITY: Duration = Duration::from_secs(30);

/// What a pull request got wrong, or why it cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    /// A parameter out of its range or unreadable.
    #[error("{0}")]
    Invalid(String),
    /// The group is delivered by push.
    #[error("this group delivers by push (app.mode: Push): there is nothing to receive")]
    PushGroup,
    /// The lock is gone.
    #[error(transparent)]
    Lost(#[from] LockLost),
}

impl IntoResponse for PullError {
    fn into_response(self) -> Response {
        let status = match self {
            PullError::Invalid(_) => StatusCode::BAD_REQUEST,
            PullError::PushGroup => StatusCode::CONFLICT,
            PullError::Lost(_) => StatusCode::GONE,
        };
        (status, Json(json!({"error": self.to_string()}))).into_response()
    }
}

/// A duration as `30s`, `1m30s`, or whole seconds (`30`), within `max` (pure).
pub fn duration(name: &str, text: &str, max: Duration) -> Result<Duration, PullError> {
    let parsed = match text.parse::<u64>() {
        Ok(seconds) => Ok(Duration::from_secs(seconds)),
        Err(_) => humantime::parse_duration(text).map_err(|e| e.to_string()),
    };
    match parsed {
        Ok(d) if d <= max => Ok(d),
        Ok(_) => Err(PullError::Invalid(format!(
            "{name} {text:?} is longer than {}",
            humantime::format_duration(max)
        ))),
        Err(e) => Err(PullError::Invalid(format!("{name} {text:?}: {e}"))),
    }
}

#[derive(Deserialize, Default)]
pub(crate) struct ReceiveQuery {
    max: Option<usize>,
    visibility: Option<String>,
    wait: Option<String>,
}

fn visibility(text: Option<&str>) -> Result<Duration, PullError> {
    let v = text.map_or(Ok(DEFAULT_VISIBILITY), |t| {
        duration("visibility", t, MAX_VISIBILITY)
    })?;
    if v < Duration::from_secs(1) {
        return Err(PullError::Invalid("visibility must be at least 1s".into()));
    }
    Ok(v)
}

/// A received message as the worker sees it (pure).
pub fn message_json(r: &Received, now: tokio::time::Instant, now_ms: i64) -> Value {
    let m = &r.delivery.message;
    let left = r.locked_until.saturating_duration_since(now);
    let mut out = json!({
        "messageId": m.id,
        "lockToken": r.lock_token,
        "deliveryCount": r.delivery.delivery_count,
        "lockedUntil": format_ms(now_ms + i64::try_from(left.as_millis()).unwrap_or(i64::MAX)),
        "enqueuedTime": format_ms(m.enqueued_at),
        "partitionKey": m.partition_key.as_json(),
        "metadata": m.metadata,
    });
    if let Some(ct) = &m.content_type {
        out["contentType"] = json!(ct);
    }
    match crate::app::body_json(&m.body, m.content_type.as_deref().unwrap_or_default()) {
        (body, false) => out["body"] = body,
        (body, true) => out["bodyBase64"] = body,
    }
    out
}

fn puller(state: &ApiState) -> Result<&cosmosq_queue::pull::Puller, PullError> {
    state.puller.as_ref().ok_or(PullError::PushGroup)
}

/// `POST /v1/receive`.
pub(crate) async fn receive(
    State(state): State<Arc<ApiState>>,
    Query(query): Query<ReceiveQuery>,
) -> Result<Json<Value>, PullError> {
    let puller = puller(&state)?;
    let max = query.max.unwrap_or(MAX_RECEIVE);
    if !(1..=MAX_RECEIVE).contains(&max) {
        return Err(PullError::Invalid(format!(
            "max {max}: between 1 and {MAX_RECEIVE}"
        )));
    }
    let visibility = visibility(query.visibility.as_deref())?;
    let wait = query
        .wait
        .as_deref()
        .map_or(Ok(Duration::ZERO), |w| duration("wait", w, MAX_WAIT))?;
    let received = tokio::select! {
        r = puller.receive(max, visibility, wait) => r,
        // A stopping sidecar answers at once: the worker should stop too.
        () = state.stopping.cancelled() => Vec::new(),
    };
    let (now, now_ms) = (tokio::time::Instant::now(), system_now_ms());
    let messages: Vec<Value> = received
        .iter()
        .map(|r| message_json(r, now, now_ms))
        .collect();
    Ok(Json(json!({ "messages": messages })))
}

#[derive(Deserialize, Default)]
pub(crate) struct SettleBody {
    #[serde(default)]
    delay: Option<Value>,
    #[serde(default)]
    reason: Option<String>,
}

fn delay_of(value: Option<&Value>) -> Result<Option<Duration>, PullError> {
    let max = Duration::from_secs(30 * 86_400);
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => duration("delay", s, max).map(Some),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(seconds) => duration("delay", &seconds.to_string(), max).map(Some),
            None => Err(PullError::Invalid(format!("delay {n}: whole seconds"))),
        },
        Some(other) => Err(PullError::Invalid(format!(
            "delay {other}: a duration (\"10s\") or seconds"
        ))),
    }
}

fn verdict(action: &str, body: SettleBody) -> Result<Verdict, PullError> {
    match action {
        "complete" => Ok(Verdict::Complete),
        "abandon" => Ok(Verdict::Abandon {
            reason: body
                .reason
                .unwrap_or_else(|| "abandoned by the worker".into()),
            delay: delay_of(body.delay.as_ref())?,
        }),
        "dead-letter" | "deadLetter" => Ok(Verdict::DeadLetter {
            reason: body
                .reason
                .unwrap_or_else(|| "dead-lettered by the worker".into()),
        }),
        other => Err(PullError::Invalid(format!(
            "{other:?}: one of complete, abandon, deadLetter"
        ))),
    }
}

/// `POST /v1/messages/<lockToken>/<action>`.
pub(crate) async fn settle_one(
    State(state): State<Arc<ApiState>>,
    Path((token, action)): Path<(String, String)>,
    Query(query): Query<ReceiveQuery>,
    body: Option<Json<SettleBody>>,
) -> Result<Response, PullError> {
    let puller = puller(&state)?;
    if action == "renew" {
        let until = puller.renew(&token, visibility(query.visibility.as_deref())?)?;
        let left = until.saturating_duration_since(tokio::time::Instant::now());
        let at = system_now_ms() + i64::try_from(left.as_millis()).unwrap_or(i64::MAX);
        return Ok(Json(json!({"lockedUntil": format_ms(at)})).into_response());
    }
    let body = body.map(|Json(b)| b).unwrap_or_default();
    puller.settle(&token, verdict(&action, body)?)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Settlement {
    lock_token: String,
    action: String,
    #[serde(flatten)]
    body: SettleBody,
}

/// `POST /v1/settle`: many at once, each settled or refused on its own.
pub(crate) async fn settle_many(
    State(state): State<Arc<ApiState>>,
    body: Result<Json<Vec<Settlement>>, JsonRejection>,
) -> Result<Json<Value>, PullError> {
    let puller = puller(&state)?;
    let Json(settlements) = body.map_err(|e| PullError::Invalid(e.body_text()))?;
    let results: Vec<Value> = settlements
        .into_iter()
        .map(|s| {
            let token = s.lock_token.clone();
            match verdict(&s.action, s.body).and_then(|v| Ok(puller.settle(&token, v)?)) {
                Ok(()) => json!({"lockToken": token, "settled": true}),
                Err(e) => json!({"lockToken": token, "error": e.to_string()}),
            }
        })
        .collect();
    Ok(Json(json!({ "results": results })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_seconds_or_humantime_within_their_bound() {
        let max = Duration::from_secs(60);
        assert_eq!(
            duration("wait", "20", max).unwrap(),
            Duration::from_secs(20)
        );
        assert_eq!(
            duration("wait", "1m", max).unwrap(),
            Duration::from_secs(60)
        );
        assert_eq!(
            duration("wait", "500ms", max).unwrap(),
            Duration::from_millis(500)
        );
        for bad in ["61", "2m", "soon", "-1"] {
            let e = duration("wait", bad, max).unwrap_err().to_string();
            assert!(e.contains("wait"), "{bad}: {e}");
        }
        assert!(visibility(Some("0")).is_err());
        assert_eq!(visibility(None).unwrap(), DEFAULT_VISIBILITY);
    }

    #[test]
    fn verdicts_from_the_worker() {
        assert_eq!(
            verdict("complete", SettleBody::default()).unwrap(),
            Verdict::Complete
        );
        let abandon = verdict(
            "abandon",
            SettleBody {
                delay: Some(json!(10)),
                reason: Some("busy".into()),
            },
        )
        .unwrap();
        assert_eq!(
            abandon,
            Verdict::Abandon {
                reason: "busy".into(),
                delay: Some(Duration::from_secs(10))
            }
        );
        assert!(matches!(
            verdict("deadLetter", SettleBody::default()).unwrap(),
            Verdict::DeadLetter { .. }
        ));
        assert!(verdict(
            "abandon",
            SettleBody {
                delay: Some(json!("later")),
                reason: None
            }
        )
        .is_err());
        assert!(verdict("finish", SettleBody::default()).is_err());
    }
}
