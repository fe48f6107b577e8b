//! Scale-in friendliness: while the app has work in flight the pod carries a higher
//! `controller.kubernetes.io/pod-deletion-cost`, so a ReplicaSet scaling down removes idle pods
//! first. Needs only `patch` on its own pod (the operator's Role grants exactly that).

use std::time::Duration;

use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::error::SidecarError;

pub const ANNOTATION: &str = "controller.kubernetes.io/pod-deletion-cost";
pub const BUSY_COST: i32 = 1000;
pub const IDLE_COST: i32 = 0;
const SERVICE_ACCOUNT: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// Patches one pod's annotations through the Kubernetes API.
pub struct PodPatcher {
    http: reqwest::Client,
    url: String,
    token: String,
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
        let token = String::from_utf8_lossy(&read("token")?).trim().to_owned();
        let ca = read("ca.crt")?;
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host
        };
        Self::new(
            &format!("https://{host}:{port}"),
            token,
            Some(&ca),
            namespace,
            pod,
        )
        .map(Some)
    }

    pub fn new(
        api: &str,
        token: String,
        ca_pem: Option<&[u8]>,
        namespace: &str,
        pod: &str,
    ) -> Result<Self, SidecarError> {
        let mut builder = reqwest::Client::builder().timeout(Duration::from_secs(10));
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
            token,
        })
    }

    pub async fn set_cost(&self, cost: i32) -> Result<(), SidecarError> {
        let patch = json!({"metadata": {"annotations": {ANNOTATION: cost.to_string()}}});
        let response = self
            .http
            .patch(&self.url)
            .bearer_auth(&self.token)
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

/// Keeps the annotation in step with whether deliveries are in flight (checked every second,
/// patched only when busy turns idle or back).
pub async fn run(
    patcher: PodPatcher,
    in_flight: prometheus::IntGauge,
    shutdown: CancellationToken,
) {
    let mut current: Option<i32> = None;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let wanted = if in_flight.get() > 0 {
            BUSY_COST
        } else {
            IDLE_COST
        };
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
        let task = tokio::spawn(run(patcher, in_flight.clone(), stop.clone()));
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
    fn outside_kubernetes_there_is_nothing_to_patch() {
        if std::env::var_os("KUBERNETES_SERVICE_HOST").is_none() {
            assert!(PodPatcher::in_cluster("ns", "pod").unwrap().is_none());
        }
    }
}
