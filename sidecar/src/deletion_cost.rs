//! Scale-in friendliness: while the app has work in flight the pod carries a higher
//! `controller.kubernetes.io/pod-deletion-cost`, so a ReplicaSet scaling down removes idle pods
//! first. Needs only `patch` on its own pod (the group's RoleBinding grants patch on pods; the
//! chart's admission policy narrows it to this pod's deletion cost).
//!
//! A pod turns idle only after a quiet period: a worker between two messages is not busy for
//! a second and idle the next, and the API server is not patched every second.
//!
//! Why not `kube::Client`: this is one merge patch of one annotation on one object, with the
//! in-cluster token and CA. kube's client would bring a second HTTP stack (hyper-util's client,
//! tower layers, hyper-rustls, kubeconfig and exec-plugin loading) beside the reqwest client the
//! sidecar already has for the app and OTLP, in every worker pod, whose idle memory is mostly
//! code pages (see `[profile.image]` in the workspace `Cargo.toml`). What kube would add here,
//! refreshing the kubelet-rotated token, is done by reading the token file for every patch.

use std::path::PathBuf;
use std::time::Duration;

use tokio::time::Instant;

use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::error::SidecarError;

/// The annotation ReplicaSets read to choose which pods to remove first.
pub const ANNOTATION: &str = "controller.kubernetes.io/pod-deletion-cost";
/// A pod at work: removed after the idle ones.
pub const BUSY_COST: i32 = 1000;
/// A pod quiet for a while: removed first.
pub const IDLE_COST: i32 = 0;
const SERVICE_ACCOUNT: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// How long a pod must have had nothing in flight before it is marked idle.
pub const IDLE_AFTER: Duration = Duration::from_secs(30);

/// Where the bearer token comes from.
enum Token {
    Fixed(String),
    /// The projected token, which the kubelet rotates: read again for every request, as
    /// client-go does.
    File(PathBuf),
}

/// Patches one pod's annotations through the Kubernetes API.
pub struct PodPatcher {
    http: reqwest::Client,
    url: String,
    token: Token,
}

impl PodPatcher {
    /// The in-cluster patcher, or `None` outside Kubernetes.
    pub fn in_cluster(namespace: &str, pod: &str) -> Result<Option<Self>, SidecarError> {
        let (Ok(host), Ok(port)) = (
            std::env::var("KUBERNETES_SERVICE_HOST"),
            std::env::var("KUBERNETES_SERVICE_PORT"),
        ) else {
            return Ok(None);
        };
        let read = |file: &str| {
            std::fs::read(format!("{SERVICE_ACCOUNT}/{file}")).map_err(|e| {
                SidecarError::Kubernetes(format!("reading the service account {file}: {e}"))
            })
        };
        // Read once here so a missing token is reported at start.
        read("token")?;
        let ca = read("ca.crt")?;
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host
        };
        let mut patcher = Self::new(
            &format!("https://{host}:{port}"),
            String::new(),
            Some(&ca),
            namespace,
            pod,
        )?;
        patcher.token = Token::File(PathBuf::from(SERVICE_ACCOUNT).join("token"));
        Ok(Some(patcher))
    }

    /// A patcher of `pod` in `namespace` that presents `token` on every request;
    /// [`PodPatcher::in_cluster`] reads the pod-bound token from its file instead.
    pub fn new(
        api: &str,
        token: String,
        ca_pem: Option<&[u8]>,
        namespace: &str,
        pod: &str,
    ) -> Result<Self, SidecarError> {
        let mut builder =
            cosmosq_queue::cosmos::tls::http_client_builder().timeout(Duration::from_secs(10));
        if let Some(pem) = ca_pem {
            let cert = reqwest::Certificate::from_pem(pem)
                .map_err(|e| SidecarError::Kubernetes(format!("cluster CA: {e}")))?;
            builder = builder.add_root_certificate(cert);
        }
        let http = builder
            .build()
            .map_err(|e| SidecarError::Kubernetes(e.to_string()))?;
        Ok(Self {
            http,
            url: format!(
                "{}/api/v1/namespaces/{namespace}/pods/{pod}",
                api.trim_end_matches('/')
            ),
            token: Token::Fixed(token),
        })
    }

    async fn token(&self) -> Result<String, SidecarError> {
        match &self.token {
            Token::Fixed(token) => Ok(token.clone()),
            Token::File(path) => tokio::fs::read_to_string(path)
                .await
                .map(|t| t.trim().to_owned())
                .map_err(|e| SidecarError::Kubernetes(format!("reading {}: {e}", path.display()))),
        }
    }

    /// Sets the pod's deletion cost.
    pub async fn set_cost(&self, cost: i32) -> Result<(), SidecarError> {
        let patch = json!({"metadata": {"annotations": {ANNOTATION: cost.to_string()}}});
        let token = self.token().await?;
        let response = self
            .http
            .patch(&self.url)
            .bearer_auth(token)
            .header(
                reqwest::header::CONTENT_TYPE,
                "application/merge-patch+json",
            )
            .body(patch.to_string())
            .send()
            .await
            .map_err(|e| SidecarError::Kubernetes(e.to_string()))?;
        if !response.status().is_success() {
            return Err(SidecarError::Kubernetes(format!(
                "patching the pod answered {}",
                response.status()
            )));
        }
        Ok(())
    }
}

/// The cost the pod should carry (pure): busy while anything is in flight, and for `quiet`
/// after; idle otherwise (and at start, when nothing has been busy yet).
pub fn wanted_cost(
    in_flight: i64,
    last_busy: Option<Instant>,
    now: Instant,
    quiet: Duration,
) -> i32 {
    match last_busy {
        _ if in_flight > 0 => BUSY_COST,
        Some(at) if now.duration_since(at) < quiet => BUSY_COST,
        _ => IDLE_COST,
    }
}

/// Keeps the annotation in step with the work in flight (checked every second, patched only
/// when the wanted cost changes; idle only after `quiet`).
pub async fn run(
    patcher: PodPatcher,
    in_flight: prometheus::IntGauge,
    quiet: Duration,
    shutdown: CancellationToken,
) {
    let mut current: Option<i32> = None;
    let mut last_busy: Option<Instant> = None;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let now = Instant::now();
        let busy = in_flight.get();
        if busy > 0 {
            last_busy = Some(now);
        }
        let wanted = wanted_cost(busy, last_busy, now, quiet);
        if current == Some(wanted) {
            continue;
        }
        match patcher.set_cost(wanted).await {
            Ok(()) => {
                debug!(cost = wanted, "pod deletion cost updated");
                current = Some(wanted);
            }
            Err(e) => warn!(error = %e, "could not update the pod deletion cost; will try again"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// Namespace, pod, body and authorization of each patch received.
    type Patches = Arc<Mutex<Vec<(String, String, String, String)>>>;

    /// A stand-in Kubernetes API that records the pod patches it gets.
    async fn api_server() -> (String, Patches) {
        let seen: Patches = Arc::default();
        let record = Arc::clone(&seen);
        let router = axum::Router::new().route(
            "/api/v1/namespaces/{ns}/pods/{pod}",
            axum::routing::patch(
                move |axum::extract::Path((ns, pod)): axum::extract::Path<(String, String)>,
                      headers: axum::http::HeaderMap,
                      body: String| {
                    let record = Arc::clone(&record);
                    async move {
                        let header = |n: &str| {
                            headers
                                .get(n)
                                .and_then(|v| v.to_str().ok())
                                .unwrap_or_default()
                                .to_owned()
                        };
                        assert_eq!(header("authorization"), "Bearer t0ken");
                        assert_eq!(header("content-type"), "application/merge-patch+json");
                        record
                            .lock()
                            .unwrap()
                            .push((ns, pod, body, header("authorization")));
                        "{}"
                    }
                },
            ),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, router).await });
        (url, seen)
    }

    #[tokio::test]
    async fn busy_pods_cost_more_to_delete_and_idle_ones_less() {
        let (url, seen) = api_server().await;
        let patcher = PodPatcher::new(&url, "t0ken".into(), None, "shop", "worker-1").unwrap();
        let in_flight = prometheus::IntGauge::new("in_flight", "x").unwrap();
        let stop = CancellationToken::new();
        // Longer than a gap between messages plus a tick (1 s), so the gap never reads as idle.
        let quiet = Duration::from_millis(2500);
        let task = tokio::spawn(run(patcher, in_flight.clone(), quiet, stop.clone()));
        let wait_for = |n: usize| {
            let seen = Arc::clone(&seen);
            async move {
                tokio::time::timeout(Duration::from_secs(10), async {
                    while seen.lock().unwrap().len() < n {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                })
                .await
                .expect("patched in time");
            }
        };
        wait_for(1).await; // idle at start
        in_flight.set(3);
        wait_for(2).await;
        in_flight.set(0);
        // Between two messages: still busy.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        in_flight.set(1);
        tokio::time::sleep(Duration::from_millis(1100)).await;
        in_flight.set(0);
        wait_for(3).await;
        stop.cancel();
        task.await.unwrap();
        let patches = seen.lock().unwrap().clone();
        let costs: Vec<String> = patches
            .iter()
            .map(|(ns, pod, body, _)| {
                assert_eq!((ns.as_str(), pod.as_str()), ("shop", "worker-1"));
                let v: serde_json::Value = serde_json::from_str(body).unwrap();
                v["metadata"]["annotations"][ANNOTATION]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        assert_eq!(costs, vec!["0", "1000", "0"], "patched only on transitions");
    }

    #[test]
    fn a_pod_turns_idle_only_after_the_quiet_period() {
        let t0 = Instant::now();
        let quiet = Duration::from_secs(30);
        let at = |s: u64| t0 + Duration::from_secs(s);
        for (in_flight, last_busy, now, expected) in [
            (0, None, 0, IDLE_COST),          // nothing yet
            (2, None, 0, BUSY_COST),          // work in flight
            (0, Some(at(0)), 29, BUSY_COST),  // between messages
            (0, Some(at(0)), 30, IDLE_COST),  // quiet long enough
            (1, Some(at(0)), 100, BUSY_COST), // busy again
        ] {
            assert_eq!(
                wanted_cost(in_flight, last_busy, at(now), quiet),
                expected,
                "{in_flight} in flight, last busy {last_busy:?}, now {now}"
            );
        }
    }

    #[test]
    fn outside_kubernetes_there_is_nothing_to_patch() {
        if std::env::var_os("KUBERNETES_SERVICE_HOST").is_none() {
            assert!(PodPatcher::in_cluster("ns", "pod").unwrap().is_none());
        }
    }
}
