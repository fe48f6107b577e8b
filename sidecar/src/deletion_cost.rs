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
