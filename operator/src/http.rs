//! The operator's HTTP surface. Plain HTTP: `/healthz` and `/readyz`, for the kubelet. Over TLS
//! only, and only for authenticated, authorized callers (see [`crate::auth`]): `/metrics` (its
//! series name every tenant's queues and backlogs), the `external.metrics.k8s.io/v1beta1` API an
//! HPA reads through an APIService, and the same figures as plain JSON for KEDA's metrics-api
//! scaler (when enabled), and the wake a producer sends after writing to a queue
//! ([`crate::wake`]). `/metrics` is served without authentication only on a listener asked
//! for by name (`--insecure-metrics-listen`: loopback, behind kube-rbac-proxy or on a laptop).
//!
//! A group whose estimate failed answers with an error, never with a zero: the HPA and KEDA
//! then keep the replicas they have.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use kube::runtime::reflector::ObjectRef;
use rustls::pki_types::CertificateDer;
use serde::Deserialize;
use serde_json::json;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use cosmosq_queue::metric_names;

use crate::auth::{Attributes, Audience, AuthError, Authorizer, RequestHeader};
use crate::context::{Figures, GroupFigures};
use crate::metrics::OperatorMetrics;
use crate::tls::ServingTls;
use crate::wake::{WakeSender, WAKE_BACKLOG};
use cosmosq_program::wake::is_object_name;

const EXTERNAL_METRICS_GROUP: &str = "external.metrics.k8s.io";
const EXTERNAL_METRICS: &str = "/apis/external.metrics.k8s.io/v1beta1";
/// The path Prometheus scrapes, and the non-resource URL its readers are granted `get` on.
pub const METRICS_PATH: &str = "/metrics";

/// What can stop the HTTP listeners.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// A listener could not bind.
    #[error("listening on {addr}: {source}")]
    Bind {
        /// Its address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

/// What the handlers read.
#[derive(Clone)]
pub struct Shared {
    /// The operator's metrics.
    pub metrics: Arc<OperatorMetrics>,
    /// The figures the metrics APIs serve.
    pub figures: Figures,
    /// This replica leads (or leader election is off): only the leader has figures. The
    /// leader labels its pod `cosmosq.io/leader=true`, which the metrics Service selects.
    pub leader: Arc<AtomicBool>,
    /// The caches are filled and the controllers run.
    pub synced: Arc<AtomicBool>,
    /// Where wakes go to the scaling loop (`crate::wake`); `None`: the endpoint is off.
    pub wakes: Option<WakeSender>,
}

impl Shared {
    /// A standby with empty caches until told otherwise.
    pub fn new(metrics: Arc<OperatorMetrics>, figures: Figures) -> Self {
        Self {
            metrics,
            figures,
            leader: Arc::default(),
            synced: Arc::default(),
            wakes: None,
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

/// Who is on the other end of a TLS connection, fixed at its handshake.
#[derive(Clone)]
pub struct Peer {
    /// The client certificate, already verified against the front proxy's CA.
    pub certificate: Option<CertificateDer<'static>>,
    /// How the front proxy authenticates, as of the handshake.
    pub front_proxy: Result<Arc<RequestHeader>, String>,
}

/// What the secure handlers read.
#[derive(Clone)]
struct Secure {
    shared: Shared,
    authorizer: Arc<Authorizer>,
    /// Whom KEDA's and producers' tokens must be minted for: the operator's own audience.
    audience: Audience,
}

/// Health and readiness: nothing a caller must be trusted with.
pub fn router(shared: Shared) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(shared)
}

/// `/metrics` for anyone who can connect: only for a listener no other pod can reach.
pub fn insecure_metrics_router(shared: Shared) -> Router {
    Router::new()
        .route(METRICS_PATH, get(metrics))
        .with_state(shared)
}

/// `/metrics` and the figures, per group and namespace, for authorized callers; connections
/// come from [`serve_tls`], which attaches each one's [`Peer`]. With `keda`, the KEDA endpoint
/// too, and with `shared.wakes` the wake endpoint, both for tokens minted for `audience` (the
/// operator's own).
pub fn secure_router(
    shared: Shared,
    authorizer: Arc<Authorizer>,
    audience: String,
    keda: bool,
) -> Router {
    let wake = shared.wakes.is_some();
    let mut router = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route(METRICS_PATH, get(secure_metrics))
        .route(EXTERNAL_METRICS, get(discovery))
        .route(
            &format!("{EXTERNAL_METRICS}/namespaces/{{namespace}}/{{metric}}"),
            get(external_metric),
        );
    if keda {
        router = router.route(
            "/keda/namespaces/{namespace}/queueconsumergroups/{name}",
            get(keda_figures),
        );
    }
    if wake {
        router = router.route(
            "/v1/namespaces/{namespace}/cosmosqueues/{name}/wake",
            post(wake_queue),
        );
    }
    router.with_state(Secure {
        shared,
        authorizer,
        audience: Audience::Named(audience),
    })
}

fn auth_response(error: AuthError) -> Response {
    debug!(error = %error, "refused a metrics request");
    match error {
        AuthError::Unauthenticated(message) => {
            status_error(StatusCode::UNAUTHORIZED, "Unauthorized", message)
        }
        AuthError::Config(_) => {
            status_error(StatusCode::UNAUTHORIZED, "Unauthorized", error.to_string())
        }
        AuthError::Forbidden(message) => status_error(StatusCode::FORBIDDEN, "Forbidden", message),
        AuthError::TooManyRequests(wait) => {
            let mut response = status_error(
                StatusCode::TOO_MANY_REQUESTS,
                "TooManyRequests",
                error.to_string(),
            );
            response.headers_mut().insert(
                http::header::RETRY_AFTER,
                crate::auth::retry_after_seconds(wait).into(),
            );
            response
        }
        AuthError::Api(_) => status_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            error.to_string(),
        ),
    }
}

impl Secure {
    /// The caller the API server's front proxy vouches for, if it may do `attributes`.
    async fn front_proxy_caller(
        &self,
        peer: Option<Extension<Peer>>,
        headers: &HeaderMap,
        attributes: Attributes,
    ) -> Result<(), Response> {
        let Some(Extension(peer)) = peer else {
            return Err(auth_response(AuthError::Unauthenticated(
                "the external metrics API is served over TLS only".into(),
            )));
        };
        let Some(certificate) = &peer.certificate else {
            return Err(auth_response(AuthError::Unauthenticated(
                "a client certificate of the API server's front proxy is required".into(),
            )));
        };
        let front_proxy = peer.front_proxy.as_ref().map_err(|reason| {
            auth_response(AuthError::Unauthenticated(format!(
                "client certificates cannot be verified: {reason}"
            )))
        })?;
        let user = front_proxy
            .user(certificate, headers)
            .map_err(auth_response)?;
        self.authorizer
            .authorize(&user, &attributes)
            .await
            .map_err(auth_response)
    }

    /// The holder of the request's bearer token (minted for `audience`), if it may do
    /// `attributes`.
    async fn bearer_caller(
        &self,
        headers: &HeaderMap,
        audience: &Audience,
        attributes: Attributes,
    ) -> Result<(), Response> {
        let token = headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                auth_response(AuthError::Unauthenticated(
                    "a bearer token is required (Authorization: Bearer ...)".into(),
                ))
            })?;
        let user = self
            .authorizer
            .token_user(token, audience)
            .await
            .map_err(auth_response)?;
        self.authorizer
            .authorize(&user, &attributes)
            .await
            .map_err(auth_response)
    }
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

/// Prometheus' read: its own ServiceAccount token (the API server's audience), bound to a role
/// that may `get` the non-resource URL `/metrics` (the chart's `<release>-metrics-reader`).
async fn secure_metrics(State(secure): State<Secure>, headers: HeaderMap) -> Response {
    let attributes = Attributes::NonResource {
        path: METRICS_PATH.into(),
        verb: "get".into(),
    };
    if let Err(refused) = secure
        .bearer_caller(&headers, &Audience::ApiServer, attributes)
        .await
    {
        return refused;
    }
    metrics(State(secure.shared)).await
}

async fn discovery(
    State(secure): State<Secure>,
    peer: Option<Extension<Peer>>,
    headers: HeaderMap,
) -> Response {
    let attributes = Attributes::NonResource {
        path: EXTERNAL_METRICS.into(),
        verb: "get".into(),
    };
    if let Err(refused) = secure.front_proxy_caller(peer, &headers, attributes).await {
        return refused;
    }
    let resource = |name: &str| {
        json!({"name": name, "singularName": "", "namespaced": true,
               "kind": "ExternalMetricValueList", "verbs": ["get"]})
    };
    Json(json!({
        "kind": "APIResourceList", "apiVersion": "v1",
        "groupVersion": "external.metrics.k8s.io/v1beta1",
        "resources": [resource(metric_names::BACKLOG), resource(metric_names::LAG)]
    }))
    .into_response()
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
    State(secure): State<Secure>,
    peer: Option<Extension<Peer>>,
    headers: HeaderMap,
    UrlPath((namespace, metric)): UrlPath<(String, String)>,
    Query(query): Query<MetricQuery>,
) -> Response {
    let attributes = Attributes::Resource {
        group: EXTERNAL_METRICS_GROUP.into(),
        version: "v1beta1".into(),
        resource: metric.clone(),
        namespace: namespace.clone(),
        name: None,
        subresource: None,
        verb: "get".into(),
    };
    if let Err(refused) = secure.front_proxy_caller(peer, &headers, attributes).await {
        return refused;
    }
    let shared = &secure.shared;
    if let Some(response) = shared.not_leading() {
        return response;
    }
    let Some(figure) = metric_names::external(&metric) else {
        return status_error(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("no external metric {metric}"),
        );
    };
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
        let value = if figure == metric_names::BACKLOG {
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

/// Whoever may read a QueueConsumerGroup may read its figures.
async fn keda_figures(
    State(secure): State<Secure>,
    headers: HeaderMap,
    UrlPath((namespace, name)): UrlPath<(String, String)>,
) -> Response {
    let attributes =
        Attributes::cosmosq_object("queueconsumergroups", None, &namespace, &name, "get");
    if let Err(refused) = secure
        .bearer_caller(&headers, &secure.audience, attributes)
        .await
    {
        return refused;
    }
    let shared = &secure.shared;
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

/// A producer's word that it wrote to a CosmosQueue: the queue's groups at zero are looked
/// at now, not at the next round ([`crate::wake`]). The caller needs `create` on
/// `cosmosqueues/wake` of that queue (a subresource no API server serves, granted by RBAC like
/// any other) and a token minted for the operator's audience. Answered 202 once handed to the
/// scaling loop, whether or not the queue has groups at zero: the estimate decides, not the
/// caller.
async fn wake_queue(
    State(secure): State<Secure>,
    headers: HeaderMap,
    UrlPath((namespace, name)): UrlPath<(String, String)>,
) -> Response {
    // Names checked before anything is asked of the API server.
    if !is_object_name(&namespace) || !is_object_name(&name) {
        return status_error(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            format!("{namespace:?}/{name:?} is not a namespace and a CosmosQueue's name"),
        );
    }
    let attributes =
        Attributes::cosmosq_object("cosmosqueues", Some("wake"), &namespace, &name, "create");
    if let Err(refused) = secure
        .bearer_caller(&headers, &secure.audience, attributes)
        .await
    {
        return refused;
    }
    let shared = &secure.shared;
    if !shared.leader.load(Ordering::Relaxed) {
        return status_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "this replica is a standby; the leader takes wakes".into(),
        );
    }
    // The route exists only with a sender (`secure_router`).
    let Some(wakes) = &shared.wakes else {
        return status_error(
            StatusCode::NOT_FOUND,
            "NotFound",
            "wakes are off (--wake-endpoint=false)".into(),
        );
    };
    match wakes.try_send(ObjectRef::new(&name).within(&namespace)) {
        Ok(()) => {
            debug!(%namespace, queue = %name, "wake accepted");
            let code = StatusCode::ACCEPTED;
            let message =
                format!("CosmosQueue {namespace}/{name}: its groups at zero are looked at now");
            (
                code,
                Json(
                    json!({"kind": "Status", "apiVersion": "v1", "status": "Success",
                            "code": code.as_u16(), "message": message}),
                ),
            )
                .into_response()
        }
        Err(mpsc::error::TrySendError::Full(_)) => {
            let mut response = status_error(
                StatusCode::TOO_MANY_REQUESTS,
                "TooManyRequests",
                format!(
                    "{WAKE_BACKLOG} wakes are waiting; the next round looks at every group anyway"
                ),
            );
            response
                .headers_mut()
                .insert(http::header::RETRY_AFTER, 1.into());
            response
        }
        Err(mpsc::error::TrySendError::Closed(_)) => status_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "the scaling loop has stopped".into(),
        ),
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
    info!(%addr, "serving plain HTTP");
    axum::serve(listener, router)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
        .map_err(|source| HttpError::Bind { addr, source })
}

/// Serves HTTPS until `shutdown`: each connection's handshake runs in its own task, so a slow
/// client cannot hold up the others, and takes the newest certificate and client CA.
pub async fn serve_tls(
    listener: tokio::net::TcpListener,
    router: Router,
    tls: Arc<ServingTls>,
    shutdown: CancellationToken,
) -> Result<(), HttpError> {
    info!(addr = ?listener.local_addr().ok(), "serving metrics and the figures over TLS");
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
        let Some(settings) = tls.current() else {
            debug!(%peer, "no serving certificate yet; closing the connection");
            continue;
        };
        let acceptor = tokio_rustls::TlsAcceptor::from(settings.config.clone());
        let router = router.clone();
        tokio::spawn(async move {
            let stream = match acceptor.accept(stream).await {
                Ok(stream) => stream,
                Err(e) => {
                    debug!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
            };
            let caller = Peer {
                certificate: stream
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|chain| chain.first())
                    .map(|c| c.clone().into_owned()),
                front_proxy: settings.front_proxy.clone(),
            };
            let service =
                hyper_util::service::TowerToHyperService::new(router.layer(Extension(caller)));
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
    use crate::auth::{AUTHENTICATION_CONFIG_MAP, AUTHENTICATION_NAMESPACE};
    use cosmosq_testkit::fake::FakeApiServer;
    use cosmosq_testkit::pki::TestCa;
    use kube::api::{Api, PostParams};
    use serde_json::Value;

    const HPA: &str = "system:serviceaccount:kube-system:horizontal-pod-autoscaler";
    const KEDA: &str = "system:serviceaccount:keda:keda-operator";
    const PROMETHEUS: &str = "system:serviceaccount:monitoring:prometheus";

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

    /// The operator's TLS listener on loopback, in a cluster whose front proxy, HPA controller
    /// and KEDA are known to the (in-memory) API server.
    struct Served {
        server: FakeApiServer,
        shared: Shared,
        tls: Arc<ServingTls>,
        url: String,
        serving_ca: TestCa,
        proxy_ca: TestCa,
        front_proxy: (String, String),
        dir: std::path::PathBuf,
        _shutdown: tokio_util::sync::DropGuard,
    }

    /// The served key and certificate are test secrets all the same: gone with the test.
    impl Drop for Served {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    async fn serve(f: GroupFigures, keda: bool) -> Served {
        serve_with(f, keda, None).await
    }

    /// [`serve`], handing wakes to `wakes`.
    async fn serve_with(f: GroupFigures, keda: bool, wakes: Option<WakeSender>) -> Served {
        cosmosq_queue::cosmos::tls::install_crypto_provider();
        let server = FakeApiServer::new();
        let proxy_ca = TestCa::new("front-proxy-ca");
        let maps = Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(
            server.client(),
            AUTHENTICATION_NAMESPACE,
        );
        let data = json!({
            "requestheader-client-ca-file": proxy_ca.pem,
            "requestheader-allowed-names": r#"["front-proxy-client"]"#,
            "requestheader-username-headers": r#"["X-Remote-User"]"#,
            "requestheader-group-headers": r#"["X-Remote-Group"]"#,
            "requestheader-extra-headers-prefix": r#"["X-Remote-Extra-"]"#,
        });
        maps.create(
            &PostParams::default(),
            &serde_json::from_value(
                json!({"metadata": {"name": AUTHENTICATION_CONFIG_MAP}, "data": data}),
            )
            .unwrap(),
        )
        .await
        .unwrap();
        server.grant(
            HPA,
            "get",
            EXTERNAL_METRICS_GROUP,
            metric_names::BACKLOG,
            "shop",
        );
        // An HPA written against the name the backlog had before.
        server.grant(
            HPA,
            "get",
            EXTERNAL_METRICS_GROUP,
            "cosmosq_backlog",
            "shop",
        );
        // KEDA's token, minted for the operator's audience; the same account's token for the
        // API server (what its pod mounts).
        server.issue_token_for("keda-token", KEDA, &[crate::auth::DEFAULT_TOKEN_AUDIENCE]);
        server.issue_token("keda-api-token", KEDA);
        server.issue_token("prometheus-token", PROMETHEUS);
        server.grant_path(PROMETHEUS, "get", METRICS_PATH);
        server.grant(
            KEDA,
            "get",
            cosmosq_crds::GROUP,
            "queueconsumergroups",
            "shop",
        );
        server.issue_token_for(
            "stranger-token",
            "system:serviceaccount:other:app",
            &[
                cosmosq_testkit::fake::API_AUDIENCE,
                crate::auth::DEFAULT_TOKEN_AUDIENCE,
            ],
        );

        let serving_ca = TestCa::new("serving-ca");
        let dir = std::env::temp_dir().join(format!("cosmosq-tls-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        write_pair(&dir, serving_ca.server());
        let tls = Arc::new(
            ServingTls::load(
                crate::tls::Source::Files {
                    cert: dir.join("tls.crt"),
                    key: dir.join("tls.key"),
                },
                server.client(),
            )
            .await
            .unwrap(),
        );
        let mut shared = Shared::new(Arc::new(OperatorMetrics::new()), Figures::default());
        shared.wakes = wakes;
        shared.leader.store(true, Ordering::Relaxed);
        shared
            .figures
            .write()
            .await
            .insert(("shop".into(), "billing-qcg".into()), f);
        let listener = bind(SocketAddr::from(([127, 0, 0, 1], 0))).await.unwrap();
        let url = format!(
            "https://localhost:{}",
            listener.local_addr().unwrap().port()
        );
        let shutdown = CancellationToken::new();
        let router = secure_router(
            shared.clone(),
            Arc::new(Authorizer::new(server.client())),
            crate::auth::DEFAULT_TOKEN_AUDIENCE.to_owned(),
            keda,
        );
        tokio::spawn(serve_tls(listener, router, tls.clone(), shutdown.clone()));
        Served {
            server,
            shared,
            tls,
            url,
            serving_ca,
            front_proxy: proxy_ca.client("front-proxy-client"),
            proxy_ca,
            dir,
            _shutdown: shutdown.drop_guard(),
        }
    }

    fn write_pair(dir: &std::path::Path, (cert, key): (String, String)) {
        std::fs::write(dir.join("tls.crt"), cert).unwrap();
        std::fs::write(dir.join("tls.key"), key).unwrap();
    }

    /// An HTTPS client trusting `ca`, presenting `identity` if given.
    fn client(ca: &TestCa, identity: Option<&(String, String)>) -> reqwest::Client {
        cosmosq_queue::cosmos::tls::http_client_builder()
            .tls_backend_preconfigured(cosmosq_testkit::pki::client_config(&ca.pem, identity))
            .build()
            .unwrap()
    }

    impl Served {
        /// The HPA's read of the backlog, over a connection that trusts `trusting` and
        /// presents `identity` (not necessarily the front proxy's).
        fn backlog_read(
            &self,
            trusting: &TestCa,
            identity: Option<&(String, String)>,
        ) -> reqwest::RequestBuilder {
            client(trusting, identity)
                .get(format!("{}{BACKLOG}", self.url))
                .header("X-Remote-User", HPA)
        }

        /// A request as the aggregator proxies it for `user`.
        async fn as_user(&self, user: &str, path: &str) -> (StatusCode, Value) {
            let client = client(&self.serving_ca, Some(&self.front_proxy));
            send(
                client
                    .get(format!("{}{path}", self.url))
                    .header("X-Remote-User", user),
            )
            .await
        }

        async fn with_token(&self, token: Option<&str>, path: &str) -> (StatusCode, Value) {
            send(self.token_request(token, path)).await
        }

        fn token_request(&self, token: Option<&str>, path: &str) -> reqwest::RequestBuilder {
            let request = client(&self.serving_ca, None).get(format!("{}{path}", self.url));
            match token {
                Some(token) => request.bearer_auth(token),
                None => request,
            }
        }

        /// A producer's wake of `path`, with `token`.
        async fn wake(&self, token: Option<&str>, path: &str) -> (StatusCode, Value, HeaderMap) {
            let request = client(&self.serving_ca, None).post(format!("{}{path}", self.url));
            let request = match token {
                Some(token) => request.bearer_auth(token),
                None => request,
            };
            let response = request.send().await.unwrap();
            let status = StatusCode::from_u16(response.status().as_u16()).unwrap();
            let headers = response.headers().clone();
            let bytes = response.bytes().await.unwrap_or_default();
            let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            (status, body, headers)
        }

        /// TokenReviews the operator asked so far.
        fn token_reviews(&self) -> u64 {
            self.server
                .requests()
                .get("POST apis/authentication.k8s.io/v1/tokenreviews")
                .copied()
                .unwrap_or(0)
        }
    }

    async fn send(request: reqwest::RequestBuilder) -> (StatusCode, Value) {
        let response = request.send().await.unwrap();
        let status = StatusCode::from_u16(response.status().as_u16()).unwrap();
        let bytes = response.bytes().await.unwrap_or_default();
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    const BACKLOG: &str =
        "/apis/external.metrics.k8s.io/v1beta1/namespaces/shop/cosmosq_backlog_messages";

    #[tokio::test]
    async fn the_hpa_reads_the_backlog_of_the_selected_group_through_the_front_proxy() {
        let served = serve(figures(Some(420)), false).await;
        let (status, body) = served
            .as_user(
                HPA,
                &format!("{BACKLOG}?labelSelector=queue%3Dorders%2Cgroup%3Dbilling"),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(body["kind"], "ExternalMetricValueList");
        assert_eq!(body["items"][0]["value"], "420");
        assert_eq!(body["items"][0]["metricLabels"]["group"], "billing");
        assert_eq!(body["items"][0]["timestamp"], "2023-11-14T22:13:20Z");
        // The backlog's old name is the same figure.
        let (status, old) = served
            .as_user(
                HPA,
                "/apis/external.metrics.k8s.io/v1beta1/namespaces/shop/cosmosq_backlog?labelSelector=group%3Dbilling",
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{old}");
        assert_eq!(old["items"][0]["value"], "420");
        assert_eq!(
            old["items"][0]["metricName"], "cosmosq_backlog",
            "answered by the name asked"
        );
        // Another group selects nothing; a metric that does not exist is not found.
        let (_, body) = served
            .as_user(HPA, &format!("{BACKLOG}?labelSelector=group%3Dshipping"))
            .await;
        assert_eq!(body["items"], json!([]));
        // A metric nobody was granted is refused before anything is looked up.
        let (status, _) = served
            .as_user(
                HPA,
                "/apis/external.metrics.k8s.io/v1beta1/namespaces/shop/cpu",
            )
            .await;
        assert_eq!(status, StatusCode::FORBIDDEN);
    }

    #[tokio::test]
    async fn the_external_metrics_api_answers_only_callers_the_front_proxy_vouches_for() {
        let served = serve(figures(Some(420)), false).await;
        // Straight to the operator, without the front proxy's certificate.
        let (status, body) = send(served.backlog_read(&served.serving_ca, None)).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        assert!(
            body["message"]
                .as_str()
                .unwrap()
                .contains("client certificate"),
            "{body}"
        );
        // A certificate with the right name from another CA fails the handshake.
        let rogue = TestCa::new("rogue").client("front-proxy-client");
        let refused = served
            .backlog_read(&served.serving_ca, Some(&rogue))
            .send()
            .await;
        assert!(refused.is_err(), "{refused:?}");
        // The front proxy's CA, but a name that is not allowed to vouch.
        let impostor = served.proxy_ca.client("system:node:worker-1");
        let (status, body) = send(served.backlog_read(&served.serving_ca, Some(&impostor))).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        assert!(
            body["message"]
                .as_str()
                .unwrap()
                .contains("not an allowed front proxy"),
            "{body}"
        );
        // A caller the front proxy names but RBAC does not allow: another namespace, another
        // metric, another user.
        let (status, body) = served
            .as_user("system:serviceaccount:other:app", BACKLOG)
            .await;
        assert_eq!(status, StatusCode::FORBIDDEN);
        assert!(
            body["message"]
                .as_str()
                .unwrap()
                .contains("cosmosq_backlog_messages"),
            "{body}"
        );
        let (status, _) = served
            .as_user(
                HPA,
                "/apis/external.metrics.k8s.io/v1beta1/namespaces/bank/cosmosq_backlog_messages",
            )
            .await;
        assert_eq!(status, StatusCode::FORBIDDEN);
        let (status, _) = served
            .as_user(
                HPA,
                "/apis/external.metrics.k8s.io/v1beta1/namespaces/shop/cosmosq_lag_messages",
            )
            .await;
        assert_eq!(status, StatusCode::FORBIDDEN);
        // The plain HTTP router does not serve the figures at all.
        assert_eq!(
            plain_status(&served.shared, BACKLOG).await,
            StatusCode::NOT_FOUND
        );
    }

    /// What the plain (probes) router answers to `GET path`.
    async fn plain_status(shared: &Shared, path: &str) -> StatusCode {
        let request = http::Request::get(path)
            .body(axum::body::Body::empty())
            .unwrap();
        tower::ServiceExt::oneshot(router(shared.clone()), request)
            .await
            .unwrap()
            .status()
    }

    #[tokio::test]
    async fn a_failed_estimate_is_an_error_never_a_zero() {
        let served = serve(figures(None), true).await;
        let (status, body) = served
            .as_user(HPA, &format!("{BACKLOG}?labelSelector=group%3Dbilling"))
            .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body["message"].as_str().unwrap().contains("503"));
        let (status, _) = served
            .with_token(
                Some("keda-token"),
                "/keda/namespaces/shop/queueconsumergroups/billing-qcg",
            )
            .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    }

    #[tokio::test]
    async fn keda_gets_plain_json_for_a_token_that_may_read_the_group() {
        let served = serve(figures(Some(7)), true).await;
        let path = "/keda/namespaces/shop/queueconsumergroups/billing-qcg";
        let (status, body) = served.with_token(Some("keda-token"), path).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            (
                body["backlog"].as_u64(),
                body["lag"].as_u64(),
                body["desiredReplicas"].as_u64()
            ),
            (Some(7), Some(3), Some(3))
        );
        let (status, _) = served
            .with_token(
                Some("keda-token"),
                "/keda/namespaces/shop/queueconsumergroups/nope",
            )
            .await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        // No token, a token the API server rejects, a token whose holder may not read groups.
        assert_eq!(
            served.with_token(None, path).await.0,
            StatusCode::UNAUTHORIZED
        );
        let (status, body) = served.with_token(Some("forged"), path).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        assert!(
            body["message"].as_str().unwrap().contains("not accepted"),
            "{body}"
        );
        assert_eq!(
            served.with_token(Some("stranger-token"), path).await.0,
            StatusCode::FORBIDDEN
        );
        // KEDA's own account, with a token minted for the API server (its pod's): not for us.
        let (status, body) = served.with_token(Some("keda-api-token"), path).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
        assert!(
            body["message"].as_str().unwrap().contains("cosmosq"),
            "{body}"
        );
        // Off unless enabled.
        let off = serve(figures(Some(7)), false).await;
        assert_eq!(
            off.with_token(Some("keda-token"), path).await.0,
            StatusCode::NOT_FOUND
        );
    }

    #[tokio::test]
    async fn a_renewed_certificate_is_served_without_a_restart() {
        let served = serve(figures(Some(7)), false).await;
        assert_eq!(served.as_user(HPA, BACKLOG).await.0, StatusCode::OK);
        assert!(!served.tls.reload().await.unwrap(), "nothing changed yet");
        // What `helm upgrade` or cert-manager does: a new key pair from a new CA.
        let renewed = TestCa::new("renewed-ca");
        write_pair(&served.dir, renewed.server());
        assert!(served.tls.reload().await.unwrap());
        let (status, _) = send(served.backlog_read(&renewed, Some(&served.front_proxy))).await;
        assert_eq!(status, StatusCode::OK);
        // A half-written pair keeps the previous settings.
        std::fs::write(served.dir.join("tls.key"), "garbage").unwrap();
        assert!(served.tls.reload().await.is_err());
        let (status, _) = send(served.backlog_read(&renewed, Some(&served.front_proxy))).await;
        assert_eq!(status, StatusCode::OK);
    }

    #[tokio::test]
    async fn readiness_and_metrics_follow_leadership() {
        let served = serve(figures(Some(1)), true).await;
        let shared = &served.shared;
        shared.leader.store(true, Ordering::Relaxed);
        let get = |path: &'static str| {
            let plain = router(shared.clone());
            async move {
                tower::ServiceExt::oneshot(
                    plain,
                    http::Request::get(path)
                        .body(axum::body::Body::empty())
                        .unwrap(),
                )
                .await
                .unwrap()
                .status()
            }
        };
        // A leader that has not synced its caches is not ready yet.
        assert_eq!(get("/readyz").await, StatusCode::SERVICE_UNAVAILABLE);
        shared.synced.store(true, Ordering::Relaxed);
        assert_eq!(get("/readyz").await, StatusCode::OK);
        assert_eq!(get("/healthz").await, StatusCode::OK);
        // A standby is ready (rollouts proceed) but sends metric readers to the leader.
        shared.leader.store(false, Ordering::Relaxed);
        assert_eq!(get("/readyz").await, StatusCode::OK);
        let (status, body) = served
            .with_token(
                Some("keda-token"),
                "/keda/namespaces/shop/queueconsumergroups/billing-qcg",
            )
            .await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body["message"].as_str().unwrap().contains("standby"));
    }

    /// The HTTPS path of the Azure SDK's and identity's clients: reqwest builds its own TLS
    /// from the process's provider (ring, `cosmos::tls`) and the platform's verifier. With the
    /// serving CA added it completes the handshake; with the system's roots alone it refuses
    /// the certificate, an error rather than a panic for want of a provider.
    #[tokio::test]
    async fn reqwest_s_own_tls_verifies_with_the_installed_provider() {
        let served = serve(figures(Some(1)), false).await;
        let url = format!("{}{METRICS_PATH}", served.url);
        let ca = reqwest::Certificate::from_pem(served.serving_ca.pem.as_bytes()).unwrap();
        let trusting = cosmosq_queue::cosmos::tls::http_client_builder()
            .tls_certs_merge([ca])
            .build()
            .unwrap();
        let answer = trusting.get(&url).send().await.unwrap();
        assert_eq!(answer.status(), StatusCode::UNAUTHORIZED);
        let untrusting = cosmosq_queue::cosmos::tls::http_client_builder()
            .build()
            .unwrap();
        let refused = untrusting.get(&url).send().await.unwrap_err();
        let chain =
            std::iter::successors(Some(&refused as &(dyn std::error::Error + 'static)), |e| {
                e.source()
            })
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join(": ");
        assert!(chain.contains("certificate"), "{chain}");
    }

    #[tokio::test]
    async fn metrics_are_served_over_tls_to_holders_of_get_metrics_only() {
        let served = serve(figures(Some(7)), false).await;
        let scrape = |token: Option<&'static str>| served.with_token(token, METRICS_PATH);
        // Anonymous, a token the API server does not know, a known caller not granted
        // `get /metrics`.
        assert_eq!(scrape(None).await.0, StatusCode::UNAUTHORIZED);
        assert_eq!(scrape(Some("forged")).await.0, StatusCode::UNAUTHORIZED);
        let (status, body) = scrape(Some("stranger-token")).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
        assert!(
            body["message"].as_str().unwrap().contains("get /metrics"),
            "{body}"
        );
        // Prometheus, with its pod's own token (the API server's audience).
        let response = served
            .token_request(Some("prometheus-token"), METRICS_PATH)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 200);
        let text = response.text().await.unwrap();
        assert!(text.contains("cosmosq_operator_leader"), "{text}");
        // The plain listener has probes only.
        assert_eq!(
            plain_status(&served.shared, METRICS_PATH).await,
            StatusCode::NOT_FOUND
        );
    }

    #[tokio::test]
    async fn unknown_tokens_cost_at_most_a_burst_of_reviews_then_429() {
        let served = serve(figures(Some(7)), true).await;
        // Prometheus' token is known (cached) before the flood.
        assert_eq!(
            served
                .with_token(Some("prometheus-token"), METRICS_PATH)
                .await
                .0,
            StatusCode::OK
        );
        let before = served.token_reviews();
        // The same forged token again and again: one review, then its cached refusal.
        for _ in 0..5 {
            let (status, _) = served.with_token(Some("forged"), METRICS_PATH).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED);
        }
        assert_eq!(served.token_reviews(), before + 1);
        // A new token per request: the rest of the burst is reviewed, then refused unasked.
        let flood = std::time::Instant::now();
        let mut refused = None;
        for i in 0..crate::auth::REVIEW_BURST * 3 {
            let response = served
                .token_request(Some(&format!("forged-{i}")), METRICS_PATH)
                .send()
                .await
                .unwrap();
            if response.status().as_u16() == 429 {
                refused = Some(response);
                break;
            }
            assert_eq!(response.status().as_u16(), 401);
        }
        let refused = refused.expect("refused with 429 once the burst is spent");
        let retry_after = refused.headers()["retry-after"]
            .to_str()
            .unwrap()
            .to_owned();
        assert_eq!(retry_after, "1", "the next review is due within a second");
        // The burst, the forged token's one review, and what refilled while the flood ran.
        let refilled =
            (flood.elapsed().as_millis() / crate::auth::REVIEW_REFILL.as_millis()) as u64;
        let reviews = served.token_reviews() - before;
        assert!(
            reviews <= u64::from(crate::auth::REVIEW_BURST) + 1 + refilled,
            "{reviews} reviews, {refilled} refilled"
        );
        // A token answered before the flood still reads.
        assert_eq!(
            served
                .with_token(Some("prometheus-token"), METRICS_PATH)
                .await
                .0,
            StatusCode::OK
        );
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

    #[tokio::test]
    async fn a_token_that_may_create_the_wake_subresource_wakes_that_queue_and_no_other() {
        const PRODUCER: &str = "system:serviceaccount:shop:producer";
        const EDITOR: &str = "system:serviceaccount:shop:editor";
        let (wakes, mut woken) = mpsc::channel(1);
        let served = serve_with(figures(Some(0)), false, Some(wakes)).await;
        let audience = crate::auth::DEFAULT_TOKEN_AUDIENCE;
        served
            .server
            .issue_token_for("producer", PRODUCER, &[audience]);
        served.server.issue_token("producer-for-api", PRODUCER);
        served.server.issue_token_for("editor", EDITOR, &[audience]);
        served.server.grant(
            PRODUCER,
            "create",
            cosmosq_crds::GROUP,
            "cosmosqueues/wake",
            "shop",
        );
        // Every verb on the queues themselves, yet not the wake: RBAC grants it by name.
        for verb in ["get", "create", "update", "patch"] {
            served
                .server
                .grant(EDITOR, verb, cosmosq_crds::GROUP, "cosmosqueues", "shop");
        }
        let path = "/v1/namespaces/shop/cosmosqueues/orders/wake";

        let refused = [
            (None, path, StatusCode::UNAUTHORIZED),
            // Minted for the API server: a credential handed out for another purpose.
            (Some("producer-for-api"), path, StatusCode::UNAUTHORIZED),
            (Some("editor"), path, StatusCode::FORBIDDEN),
            // Another namespace's queue.
            (
                Some("producer"),
                "/v1/namespaces/other/cosmosqueues/orders/wake",
                StatusCode::FORBIDDEN,
            ),
        ];
        for (token, path, expected) in refused {
            let (status, body, _) = served.wake(token, path).await;
            assert_eq!(status, expected, "{token:?} {path}: {body}");
        }
        assert!(
            woken.try_recv().is_err(),
            "nothing refused reached the loop"
        );

        let (status, body, _) = served.wake(Some("producer"), path).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
        assert_eq!(body["status"], "Success");
        let orders = ObjectRef::<cosmosq_crds::CosmosQueue>::new("orders").within("shop");
        assert_eq!(woken.try_recv().unwrap(), orders);
        // The producers' client (`cosmosq wake`, the bench) speaks the same contract, and
        // says why when refused.
        let token = served.dir.join("producer-token");
        std::fs::write(&token, "producer\n").unwrap();
        let url = served.url.clone();
        let waker = cosmosq_program::wake::Waker::new(
            &url,
            Some(served.serving_ca.pem.as_bytes()),
            token.clone(),
        )
        .unwrap();
        waker.wake("shop/orders").await.unwrap();
        assert_eq!(woken.try_recv().unwrap(), orders);
        let err = waker.wake("other/orders").await.unwrap_err().to_string();
        assert!(
            err.contains("403") && err.contains("create cosmosqueues.cosmosq.io/wake"),
            "{err}"
        );
        // The loop is behind (a backlog of one here): the producer is told to come back.
        served.wake(Some("producer"), path).await;
        let (status, _, headers) = served.wake(Some("producer"), path).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(headers[http::header::RETRY_AFTER], "1");
        // A path that cannot name a queue is refused before anything is asked of the API
        // server.
        let access_reviews = || {
            served
                .server
                .requests()
                .get("POST apis/authorization.k8s.io/v1/subjectaccessreviews")
                .copied()
                .unwrap_or(0)
        };
        let reviews = access_reviews();
        let (status, _, _) = served
            .wake(
                Some("producer"),
                "/v1/namespaces/shop/cosmosqueues/Not_A_Name/wake",
            )
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(access_reviews(), reviews, "nothing asked of the API server");
        // A standby has no scaling loop to hand it to.
        served.shared.leader.store(false, Ordering::Relaxed);
        let (status, _, _) = served.wake(Some("producer"), path).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    }

    #[tokio::test]
    async fn no_wake_is_served_when_it_is_turned_off() {
        let served = serve(figures(Some(0)), false).await;
        let (status, _, _) = served
            .wake(None, "/v1/namespaces/shop/cosmosqueues/orders/wake")
            .await;
        assert_eq!(status, StatusCode::NOT_FOUND);
    }
}
