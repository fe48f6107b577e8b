//! The operator's HTTP surface: `/metrics`, `/healthz`, `/readyz`, the
//! `external.metrics.k8s.io/v1beta1` API an HPA reads through an APIService (served over TLS
//! when a certificate is given), and the same figures as plain JSON for KEDA's metrics-api
//! scaler.
//!
//! A group whose estimate failed answers with an error, never with a zero: the HPA and KEDA
//! then keep the replicas they have.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::{Path as UrlPath, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::build::BACKLOG_METRIC;
use crate::context::{Figures, GroupFigures};
use crate::metrics::Metrics;

/// The lag metric, next to `cosmosq_backlog`.
pub const LAG_METRIC: &str = "cosmosq_lag";
const EXTERNAL_METRICS: &str = "/apis/external.metrics.k8s.io/v1beta1";

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("listening on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("TLS certificate or key {path}: {reason}")]
    Tls { path: String, reason: String },
}

/// What the handlers read.
#[derive(Clone)]
pub struct Shared {
    pub metrics: Arc<Metrics>,
    pub figures: Figures,
    /// This replica leads (or leader election is off): only the leader has figures. The
    /// leader labels its pod `cosmosq.io/leader=true`, which the metrics Service selects.
    pub leader: Arc<AtomicBool>,
    /// The caches are filled and the controllers run.
    pub synced: Arc<AtomicBool>,
}

impl Shared {
    pub fn new(metrics: Arc<Metrics>, figures: Figures) -> Self {
        Self {
            metrics,
            figures,
            leader: Arc::default(),
            synced: Arc::default(),
        }
    }

    fn not_leading(&self) -> Option<Response> {
        (!self.leader.load(Ordering::Relaxed)).then(|| {
            status_error(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                "this replica is a standby; the leader serves the metrics".into(),
            )
        })
    }
}

pub fn router(shared: Shared) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route(EXTERNAL_METRICS, get(discovery))
        .route(
            &format!("{EXTERNAL_METRICS}/namespaces/{{namespace}}/{{metric}}"),
            get(external_metric),
        )
        .route(
            "/keda/namespaces/{namespace}/queueconsumergroups/{name}",
            get(keda),
        )
        .with_state(shared)
}

/// A standby is ready (it is healthy and waiting); a leader once its caches are synced.
async fn readyz(State(shared): State<Shared>) -> Response {
    match (
        shared.leader.load(Ordering::Relaxed),
        shared.synced.load(Ordering::Relaxed),
    ) {
        (false, _) => "standby".into_response(),
        (true, true) => "ok".into_response(),
        (true, false) => (StatusCode::SERVICE_UNAVAILABLE, "syncing caches").into_response(),
    }
}

async fn metrics(State(shared): State<Shared>) -> Response {
    (
        [("content-type", "text/plain; version=0.0.4")],
        shared.metrics.render(),
    )
        .into_response()
}

async fn discovery() -> Json<Value> {
    let resource = |name: &str| {
        json!({"name": name, "singularName": "", "namespaced": true,
               "kind": "ExternalMetricValueList", "verbs": ["get"]})
    };
    Json(json!({
        "kind": "APIResourceList", "apiVersion": "v1",
        "groupVersion": "external.metrics.k8s.io/v1beta1",
        "resources": [resource(BACKLOG_METRIC), resource(LAG_METRIC)]
    }))
}

/// A Kubernetes `Status` error, which the HPA controller reports in its own conditions.
fn status_error(code: StatusCode, reason: &str, message: String) -> Response {
    (
        code,
        Json(
            json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "reason": reason, "code": code.as_u16(), "message": message}),
        ),
    )
        .into_response()
}

/// Equality-based label selectors (`k=v`, `k==v`, comma-separated): what an HPA's metric
/// selector with `matchLabels` sends.
pub fn parse_selector(selector: &str) -> Result<BTreeMap<String, String>, String> {
    let mut labels = BTreeMap::new();
    for term in selector.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let (key, value) = term
            .split_once("==")
            .or_else(|| term.split_once('='))
            .filter(|(k, _)| !k.ends_with('!'))
            .ok_or_else(|| format!("unsupported selector term {term:?}: use key=value"))?;
        labels.insert(key.trim().to_owned(), value.trim().to_owned());
    }
    Ok(labels)
}

fn matches(figures: &GroupFigures, labels: &BTreeMap<String, String>) -> bool {
    labels.iter().all(|(k, v)| match k.as_str() {
        "queue" => &figures.queue == v,
        "group" => &figures.group == v,
        _ => false,
    })
}

#[derive(Deserialize)]
struct MetricQuery {
    #[serde(rename = "labelSelector", default)]
    label_selector: String,
}

async fn external_metric(
    State(shared): State<Shared>,
    UrlPath((namespace, metric)): UrlPath<(String, String)>,
    Query(query): Query<MetricQuery>,
) -> Response {
    if let Some(response) = shared.not_leading() {
        return response;
    }
    if metric != BACKLOG_METRIC && metric != LAG_METRIC {
        return status_error(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("no external metric {metric}"),
        );
    }
    let labels = match parse_selector(&query.label_selector) {
        Ok(labels) => labels,
        Err(e) => return status_error(StatusCode::BAD_REQUEST, "BadRequest", e),
    };
    let figures = shared.figures.read().await;
    let mut items = Vec::new();
    for f in figures
        .values()
        .filter(|f| f.namespace == namespace && matches(f, &labels))
    {
        let value = if metric == BACKLOG_METRIC {
            f.backlog
        } else {
            f.lag
        };
        let Some(value) = value else {
            // Keep the HPA where it is rather than feed it a zero.
            return status_error(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                format!(
                    "the estimate of group {} failed: {}",
                    f.group,
                    f.error.as_deref().unwrap_or("unknown")
                ),
            );
        };
        let timestamp = k8s_openapi::jiff::Timestamp::from_millisecond(f.measured_at)
            .map(|t| t.to_string())
            .unwrap_or_default();
        items.push(json!({
            "metricName": metric,
            "metricLabels": {"queue": f.queue, "group": f.group},
            "timestamp": timestamp,
            "value": value.to_string(),
        }));
    }
    debug!(%namespace, %metric, selector = %query.label_selector, items = items.len(), "external metric");
    Json(json!({
        "kind": "ExternalMetricValueList",
        "apiVersion": "external.metrics.k8s.io/v1beta1",
        "metadata": {},
        "items": items,
    }))
    .into_response()
}

async fn keda(
    State(shared): State<Shared>,
    UrlPath((namespace, name)): UrlPath<(String, String)>,
) -> Response {
    if let Some(response) = shared.not_leading() {
        return response;
    }
    let figures = shared.figures.read().await;
    match figures.get(&(namespace.clone(), name.clone())) {
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": format!("no figures for QueueConsumerGroup {namespace}/{name} yet")})),
        )
            .into_response(),
        Some(f) if f.backlog.is_none() => (StatusCode::SERVICE_UNAVAILABLE, Json(json!(f))).into_response(),
        Some(f) => Json(json!(f)).into_response(),
    }
}

/// Binds a listener; done before anything else starts, so a taken port stops the operator
/// at once with a clear error instead of leaving it running without probes.
pub async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, HttpError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| HttpError::Bind { addr, source })
}

/// Serves plain HTTP until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: CancellationToken,
) -> Result<(), HttpError> {
    let addr = listener.local_addr().map_err(|source| HttpError::Bind {
        addr: SocketAddr::from(([0, 0, 0, 0], 0)),
        source,
    })?;
    info!(%addr, "serving metrics, health and the KEDA endpoint");
    axum::serve(listener, router)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
        .map_err(|source| HttpError::Bind { addr, source })
}

fn tls_error(path: &Path, reason: impl ToString) -> HttpError {
    HttpError::Tls {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

/// The TLS settings from PEM files (the APIService's serving certificate).
pub fn tls_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, HttpError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_file_iter(cert)
        .map_err(|e| tls_error(cert, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| tls_error(cert, e))?;
    if certs.is_empty() {
        return Err(tls_error(cert, "no certificate in the file"));
    }
    let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| tls_error(key, e))?;
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| tls_error(cert, e))?
    .with_no_client_auth()
    .with_single_cert(certs, key_der)
    .map_err(|e| tls_error(cert, e))?;
    Ok(Arc::new(config))
}

/// Serves HTTPS until `shutdown`: each connection's handshake runs in its own task, so a slow
/// client cannot hold up the others.
pub async fn serve_tls(
    listener: tokio::net::TcpListener,
    router: Router,
    tls: Arc<rustls::ServerConfig>,
    shutdown: CancellationToken,
) -> Result<(), HttpError> {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    info!(addr = ?listener.local_addr().ok(), "serving external.metrics.k8s.io over TLS");
    loop {
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    warn!(error = %e, "accept failed");
                    continue;
                }
            },
        };
        let acceptor = acceptor.clone();
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        tokio::spawn(async move {
            let stream = match acceptor.accept(stream).await {
                Ok(stream) => stream,
                Err(e) => {
                    debug!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
            };
            let io = hyper_util::rt::TokioIo::new(stream);
            if let Err(e) =
                hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .serve_connection(io, service)
                    .await
            {
                debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use http::Request;
    use tower::ServiceExt;

    fn figures(backlog: Option<u64>) -> GroupFigures {
        GroupFigures {
            namespace: "shop".into(),
            queue: "orders".into(),
            group: "billing".into(),
            backlog,
            lag: backlog.map(|b| b / 2),
            oldest_message_age_seconds: Some(12),
            desired_replicas: 3,
            error: backlog.is_none().then(|| "Cosmos DB: 503".to_owned()),
            measured_at: 1_700_000_000_000,
        }
    }

    async fn get(shared: &Shared, uri: &str) -> (StatusCode, Value) {
        let response = router(shared.clone())
            .oneshot(Request::get(uri).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    async fn shared_with(f: GroupFigures) -> Shared {
        let shared = Shared::new(Arc::new(Metrics::new()), Figures::default());
        shared.leader.store(true, Ordering::Relaxed);
        shared
            .figures
            .write()
            .await
            .insert(("shop".into(), "billing-qcg".into()), f);
        shared
    }

    #[tokio::test]
    async fn the_hpa_reads_the_backlog_of_the_selected_group() {
        let shared = shared_with(figures(Some(420))).await;
        let (status, body) = get(
            &shared,
            "/apis/external.metrics.k8s.io/v1beta1/namespaces/shop/cosmosq_backlog?labelSelector=queue%3Dorders%2Cgroup%3Dbilling",
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body["kind"], "ExternalMetricValueList");
        assert_eq!(body["items"][0]["value"], "420");
        assert_eq!(body["items"][0]["metricLabels"]["group"], "billing");
        assert_eq!(body["items"][0]["timestamp"], "2023-11-14T22:13:20Z");
        // Another group, namespace or metric selects nothing.
        let (_, body) = get(
            &shared,
            "/apis/external.metrics.k8s.io/v1beta1/namespaces/shop/cosmosq_lag?labelSelector=group%3Dshipping",
        )
        .await;
        assert_eq!(body["items"], json!([]));
        let (_, body) = get(
            &shared,
            "/apis/external.metrics.k8s.io/v1beta1/namespaces/other/cosmosq_lag",
        )
        .await;
        assert_eq!(body["items"], json!([]));
        let (status, _) = get(
            &shared,
            "/apis/external.metrics.k8s.io/v1beta1/namespaces/shop/cpu",
        )
        .await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        let (_, body) = get(&shared, "/apis/external.metrics.k8s.io/v1beta1").await;
        assert_eq!(body["resources"][0]["name"], "cosmosq_backlog");
    }

    #[tokio::test]
    async fn a_failed_estimate_is_an_error_never_a_zero() {
        let shared = shared_with(figures(None)).await;
        let (status, body) = get(
            &shared,
            "/apis/external.metrics.k8s.io/v1beta1/namespaces/shop/cosmosq_backlog?labelSelector=group%3Dbilling",
        )
        .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body["message"].as_str().unwrap().contains("503"));
        let (status, _) = get(
            &shared,
            "/keda/namespaces/shop/queueconsumergroups/billing-qcg",
        )
        .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    }

    #[tokio::test]
    async fn keda_gets_plain_json() {
        let shared = shared_with(figures(Some(7))).await;
        let (status, body) = get(
            &shared,
            "/keda/namespaces/shop/queueconsumergroups/billing-qcg",
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            (
                body["backlog"].as_u64(),
                body["lag"].as_u64(),
                body["desiredReplicas"].as_u64()
            ),
            (Some(7), Some(3), Some(3))
        );
        let (status, _) = get(&shared, "/keda/namespaces/shop/queueconsumergroups/nope").await;
        assert_eq!(status, StatusCode::NOT_FOUND);
    }

    #[tokio::test]
    async fn readiness_and_metrics_follow_leadership() {
        let shared = shared_with(figures(Some(1))).await;
        // A leader that has not synced its caches is not ready yet.
        assert_eq!(
            get(&shared, "/readyz").await.0,
            StatusCode::SERVICE_UNAVAILABLE
        );
        shared.synced.store(true, Ordering::Relaxed);
        assert_eq!(get(&shared, "/readyz").await.0, StatusCode::OK);
        assert_eq!(get(&shared, "/healthz").await.0, StatusCode::OK);
        // A standby is ready (rollouts proceed) but sends metric readers to the leader.
        shared.leader.store(false, Ordering::Relaxed);
        assert_eq!(get(&shared, "/readyz").await.0, StatusCode::OK);
        let (status, body) = get(
            &shared,
            "/keda/namespaces/shop/queueconsumergroups/billing-qcg",
        )
        .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body["message"].as_str().unwrap().contains("standby"));
    }

    #[test]
    fn selectors_are_equality_terms() {
        assert_eq!(
            parse_selector("queue=orders, group==billing").unwrap(),
            BTreeMap::from([
                ("group".to_owned(), "billing".to_owned()),
                ("queue".to_owned(), "orders".to_owned())
            ])
        );
        assert!(parse_selector("").unwrap().is_empty());
        assert!(parse_selector("group!=billing").is_err());
        assert!(parse_selector("group in (a,b)").is_err());
    }
}
