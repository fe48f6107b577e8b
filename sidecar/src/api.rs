//! The localhost API the app talks to: enqueue, health, readiness, metrics.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::{rejection::JsonRejection, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use cosmosq_queue::message::MessageInput;
use cosmosq_queue::trace::{TRACEPARENT, TRACESTATE};
use cosmosq_queue::{
    ConsumerStats, EnqueueOutcome, MessageError, NewMessage, Queue, QueueError, TraceContext,
};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::metrics::SidecarMetrics;
use crate::spans::Publish;

/// Largest request body taken (a batch of messages).
const MAX_REQUEST_BYTES: usize = 16 * 1024 * 1024;

/// What the API serves from.
pub struct ApiState {
    /// The queue the app enqueues to.
    pub queue: Queue,
    /// The other queues it may publish to (`--publish-to`), by their topics.
    pub publish_to: Vec<Queue>,
    /// The sidecar's metrics, served at `/metrics`.
    pub metrics: Arc<SidecarMetrics>,
    /// The lease loop's counters, for health.
    pub stats: Arc<ConsumerStats>,
    /// Connected, and the app answered: leases may be taken.
    pub ready: AtomicBool,
    /// Cancelled when the sidecar is told to stop (SIGTERM).
    pub stopping: CancellationToken,
    /// Cancelled once it has drained: deliveries settled, leases released.
    pub drained: CancellationToken,
    /// The pub/sub name of the app's subscription, accepted for publishing too.
    pub pubsub_name: std::sync::OnceLock<String>,
    /// Cancelled once the app's subscription is known, or known to be none (pull groups at
    /// once): a publish under the app's pub/sub name may come before the sidecar has asked.
    pub subscribed: CancellationToken,
    /// The app's subscription as Dapr's metadata lists it, once known.
    pub subscription: std::sync::OnceLock<serde_json::Value>,
    /// What the metadata API says of this sidecar.
    pub about: crate::dapr::metadata::About,
    /// The app's own metadata attributes (`PUT /v1.0/metadata/{key}`), in memory.
    pub attributes: std::sync::Mutex<std::collections::BTreeMap<String, String>>,
    /// A pull group's receive side; `None` for push.
    pub puller: Option<cosmosq_queue::pull::Puller>,
    /// Where publish spans go.
    pub telemetry: cosmosq_program::telemetry::Telemetry,
}

/// How long `/drained` waits for this sidecar to begin stopping. A pod being deleted sends
/// SIGTERM to the sidecar as the app's preStop hook starts; if none comes, the app container
/// alone is being restarted (a failed liveness probe), and it should not wait for a drain.
pub const DRAIN_START_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Health, readiness and metrics only, for the kubelet's probes and Prometheus, which reach the
/// pod's IP, not its loopback. Nothing here changes anything.
pub fn probe_router(state: Arc<ApiState>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/v1.0/healthz", get(crate::dapr::healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/drained", get(drained))
        .with_state(state)
}

/// For the app containers' preStop hook (the operator sets it): answers once this sidecar has
/// drained, so the app keeps serving until its last delivery is settled and only then gets
/// SIGTERM. Scale-in never cuts a delivery short.
async fn drained(State(state): State<Arc<ApiState>>) -> Response {
    if tokio::time::timeout(DRAIN_START_WAIT, state.stopping.cancelled())
        .await
        .is_err()
    {
        return (StatusCode::OK, "not stopping").into_response();
    }
    state.drained.cancelled().await;
    (StatusCode::OK, "drained").into_response()
}

/// The full local API for the app next to the sidecar (loopback only).
pub fn router(state: Arc<ApiState>) -> Router {
    Router::new()
        .route("/v1/enqueue", post(enqueue))
        .route("/v1/enqueue/batch", post(enqueue_batch))
        .route("/v1.0/publish/{pubsub}/{topic}", post(crate::dapr::publish))
        .route(
            "/v1.0-alpha1/publish/bulk/{pubsub}/{topic}",
            post(crate::dapr::publish_bulk),
        )
        .route("/v1.0/metadata", get(crate::dapr::metadata::get))
        .route(
            "/v1.0/metadata/{key}",
            axum::routing::put(crate::dapr::metadata::put).layer(
                axum::extract::DefaultBodyLimit::max(crate::dapr::metadata::MAX_ATTRIBUTE_BYTES),
            ),
        )
        .route("/v1.0/shutdown", post(crate::dapr::shutdown))
        .route("/v1/receive", post(crate::pull::receive))
        .route(
            "/v1/messages/{lock_token}/{action}",
            post(crate::pull::settle_one),
        )
        .route("/v1/settle", post(crate::pull::settle_many))
        .route("/healthz", get(|| async { "ok" }))
        .route("/v1.0/healthz", get(crate::dapr::healthz))
        .route("/v1.0/healthz/outbound", get(crate::dapr::healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        // Room for a message at Cosmos' 2 MB limit in JSON; the engine gives the exact error.
        .layer(axum::extract::DefaultBodyLimit::max(MAX_REQUEST_BYTES))
        .with_state(state)
}

/// The header Dapr's API token travels in, both ways.
pub const API_TOKEN_HEADER: &str = "dapr-api-token";

/// Paths answered without the token: health, as Dapr leaves its health endpoints open (the
/// kubelet and the app's own start-up checks ask them).
const OPEN_PATHS: [&str; 4] = [
    "/healthz",
    "/readyz",
    "/v1.0/healthz",
    "/v1.0/healthz/outbound",
];

/// `router` answering only callers that present `token` (`dapr-api-token`), 401 otherwise,
/// as Dapr's API token authentication does; unchanged without a token.
pub fn guarded(router: Router, token: Option<crate::settings::Token>) -> Router {
    let Some(token) = token else {
        return router;
    };
    let token = Arc::new(token);
    router.layer(axum::middleware::from_fn(
        move |request: axum::extract::Request, next: axum::middleware::Next| {
            let token = Arc::clone(&token);
            async move {
                let presented = request
                    .headers()
                    .get(API_TOKEN_HEADER)
                    .map(|v| v.as_bytes())
                    .unwrap_or_default();
                if OPEN_PATHS.contains(&request.uri().path()) || token.matches(presented) {
                    next.run(request).await
                } else {
                    error(
                        StatusCode::UNAUTHORIZED,
                        format!("a valid {API_TOKEN_HEADER} header is required"),
                    )
                }
            }
        },
    ))
}

async fn readyz(State(state): State<Arc<ApiState>>) -> Response {
    if state.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ready").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: waiting for the app or Cosmos DB",
        )
            .into_response()
    }
}

async fn metrics(State(state): State<Arc<ApiState>>) -> Response {
    state.metrics.sync(&state.stats, state.queue.charges());
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        state.metrics.render(),
    )
        .into_response()
}

fn error(status: StatusCode, message: String) -> Response {
    (status, Json(json!({"error": message}))).into_response()
}

/// The HTTP status for an enqueue failure: the caller's fault (4xx) or ours to retry (5xx).
fn failure(e: &QueueError) -> StatusCode {
    match e {
        QueueError::InvalidMessage(MessageError::TooLarge { .. }) => StatusCode::PAYLOAD_TOO_LARGE,
        QueueError::InvalidMessage(_) => StatusCode::BAD_REQUEST,
        e if e.status() == Some(429) => StatusCode::TOO_MANY_REQUESTS,
        _ => StatusCode::SERVICE_UNAVAILABLE,
    }
}

/// The caller's W3C trace context, stored with what it enqueues (a message's own metadata
/// `traceparent` wins), so the trace goes on at the delivery.
pub(crate) fn caller_trace(headers: &HeaderMap) -> Option<TraceContext> {
    let header = |name| headers.get(name).and_then(|v| v.to_str().ok());
    TraceContext::parse(header(TRACEPARENT)?, header(TRACESTATE))
}

fn outcome_json(outcome: &EnqueueOutcome) -> serde_json::Value {
    json!({"id": outcome.id(), "duplicate": outcome.is_duplicate()})
}

async fn enqueue(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
    body: Result<Json<MessageInput>, JsonRejection>,
) -> Response {
    let Json(input) = match body {
        Ok(b) => b,
        Err(e) => return error(e.status(), e.body_text()),
    };
    let message = match NewMessage::try_from(input) {
        Ok(m) => m,
        Err(e) => {
            state.metrics.rejected(1);
            return error(StatusCode::BAD_REQUEST, e.to_string());
        }
    };
    let mut publish = Publish::one(&state, state.queue.name(), &headers, &message);
    let message = publish.stamp(message);
    match state.queue.enqueue(message).await {
        Ok(outcome) => {
            let (status, result) = if outcome.is_duplicate() {
                (StatusCode::OK, "duplicate")
            } else {
                (StatusCode::CREATED, "enqueued")
            };
            state.metrics.enqueued.with_label_values(&[result]).inc();
            (status, Json(outcome_json(&outcome))).into_response()
        }
        Err(e) => {
            state.metrics.rejected(1);
            publish.failed(1, &e.to_string());
            error(failure(&e), e.to_string())
        }
    }
}

/// `[{message}, ...]` → `{"results": [{"id","duplicate"} | {"error"}, ...]}` in input order;
/// 200 when all were taken, 207 when some were not.
async fn enqueue_batch(
    State(state): State<Arc<ApiState>>,
    headers: HeaderMap,
    body: Result<Json<Vec<MessageInput>>, JsonRejection>,
) -> Response {
    let Json(inputs) = match body {
        Ok(b) => b,
        Err(e) => return error(e.status(), e.body_text()),
    };
    let mut publish = Publish::start(
        &state.telemetry,
        state.queue.name(),
        caller_trace(&headers),
        inputs.len(),
    );
    let mut results: Vec<Option<serde_json::Value>> = vec![None; inputs.len()];
    let mut valid = Vec::new();
    let mut positions = Vec::new();
    for (i, input) in inputs.into_iter().enumerate() {
        match NewMessage::try_from(input) {
            Ok(m) => {
                valid.push(publish.stamp(m));
                positions.push(i);
            }
            Err(e) => results[i] = Some(json!({"error": e.to_string()})),
        }
    }
    for (i, result) in positions
        .into_iter()
        .zip(state.queue.enqueue_batch(valid).await)
    {
        results[i] = Some(match result {
            Ok(o) => outcome_json(&o),
            Err(e) => json!({"error": e.to_string()}),
        });
    }
    let results: Vec<serde_json::Value> =
        results.into_iter().map(|r| r.unwrap_or_default()).collect();
    let failed = results.iter().filter(|r| r.get("error").is_some()).count();
    for r in &results {
        let label = match (r.get("error"), r.get("duplicate").and_then(|d| d.as_bool())) {
            (Some(_), _) => "rejected",
            (None, Some(true)) => "duplicate",
            _ => "enqueued",
        };
        state.metrics.enqueued.with_label_values(&[label]).inc();
    }
    let status = if failed == 0 {
        StatusCode::OK
    } else {
        publish.failed(failed, "some messages were not enqueued");
        StatusCode::MULTI_STATUS
    };
    (status, Json(json!({"results": results}))).into_response()
}
