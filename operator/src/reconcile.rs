//! Reconciling a QueueConsumerGroup: fetch → validate and build (pure) → apply → status.
//! Invalid specs are reported in a condition naming the field and wait for a change; transient
//! errors go back to the controller, which retries with back-off.

use std::sync::Arc;
use std::time::Duration;

use cosmosq_crds::{CosmosQueue, QueueConsumerGroup, QueueConsumerGroupStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use tracing::{info, warn};

use crate::apply::{apply_group, ApplyError, FIELD_MANAGER};
use crate::build::Defaults;

/// Condition types and reasons, in one place.
pub mod conditions {
    pub const READY: &str = "Ready";
    pub const DEGRADED: &str = "Degraded";
    pub const APPLIED: &str = "Applied";
    pub const QUEUE_NOT_FOUND: &str = "QueueNotFound";
    pub const INVALID_SPEC: &str = "InvalidSpec";
}

/// What every reconcile shares.
pub struct Context {
    pub client: Client,
    pub defaults: Defaults,
}

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error(transparent)]
    Apply(#[from] ApplyError),
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("{0} has no namespace")]
    NoNamespace(String),
}

/// A condition, keeping its last transition time when its status did not change.
pub fn condition(
    existing: &[Condition],
    type_: &str,
    ok: bool,
    reason: &str,
    message: String,
    generation: Option<i64>,
    now: Time,
) -> Condition {
    let status = if ok { "True" } else { "False" };
    let since = existing
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or(now);
    Condition {
        type_: type_.into(),
        status: status.into(),
        reason: reason.into(),
        message,
        observed_generation: generation,
        last_transition_time: since,
    }
}

/// One pass over a group.
pub async fn reconcile_group(
    qcg: Arc<QueueConsumerGroup>,
    ctx: Arc<Context>,
) -> Result<Action, ReconcileError> {
    let namespace = qcg
        .namespace()
        .ok_or_else(|| ReconcileError::NoNamespace(qcg.name_any()))?;
    let queues: Api<CosmosQueue> = Api::namespaced(ctx.client.clone(), &namespace);
    let queue_name = &qcg.spec.queue_ref.name;
    let (ok, reason, message, action) = match queues.get_opt(queue_name).await? {
        None => (
            false,
            conditions::QUEUE_NOT_FOUND,
            format!("CosmosQueue {queue_name} does not exist in {namespace}"),
            Action::requeue(Duration::from_secs(30)),
        ),
        Some(queue) => match apply_group(&ctx.client, &qcg, &queue, &ctx.defaults).await {
            Ok(applied) => (
                true,
                conditions::APPLIED,
                format!("Deployment {} is up to date", applied.deployment),
                Action::requeue(Duration::from_secs(300)),
            ),
            // Nothing was written; the object waits for its owner to fix it.
            Err(ApplyError::Build(e)) => (
                false,
                conditions::INVALID_SPEC,
                e.to_string(),
                Action::await_change(),
            ),
            Err(e) => return Err(e.into()),
        },
    };
    if ok {
        info!(group = %qcg.name_any(), %namespace, "{message}");
    } else {
        warn!(group = %qcg.name_any(), %namespace, reason, "{message}");
    }
    let existing = qcg
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let generation = qcg.metadata.generation;
    let status = QueueConsumerGroupStatus {
        conditions: vec![
            condition(
                &existing,
                conditions::READY,
                ok,
                reason,
                message.clone(),
                generation,
                now.clone(),
            ),
            condition(
                &existing,
                conditions::DEGRADED,
                !ok,
                reason,
                message,
                generation,
                now,
            ),
        ],
        observed_generation: generation,
        ..qcg.status.clone().unwrap_or_default()
    };
    let groups: Api<QueueConsumerGroup> = Api::namespaced(ctx.client.clone(), &namespace);
    let patch = json!({"apiVersion": "cosmosq.io/v1alpha1", "kind": "QueueConsumerGroup", "status": status});
    groups
        .patch_status(
            &qcg.name_any(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(patch),
        )
        .await?;
    Ok(action)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{Method, Request, Response, StatusCode};
    use kube::client::Body;
    use serde_json::Value;

    type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    struct ApiServerVerifier(Handle);

    impl ApiServerVerifier {
        async fn next(
            &mut self,
            method: Method,
            path: &str,
        ) -> (Value, tower_test::mock::SendResponse<Response<Body>>) {
            let (request, send) = self.0.next_request().await.expect("a request");
            assert_eq!((request.method(), request.uri().path()), (&method, path));
            let bytes = request.into_body().collect_bytes().await.unwrap();
            (serde_json::from_slice(&bytes).unwrap_or(Value::Null), send)
        }

        async fn get_queue(&mut self, found: bool) {
            let (_, send) = self
                .next(
                    Method::GET,
                    "/apis/cosmosq.io/v1alpha1/namespaces/shop/cosmosqueues/orders",
                )
                .await;
            let response = if found {
                Response::builder()
                    .body(Body::from(serde_json::to_vec(&queue_json()).unwrap()))
                    .unwrap()
            } else {
                let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"});
                Response::builder()
                    .status(StatusCode::NOT_FOUND)
                    .body(Body::from(serde_json::to_vec(&status).unwrap()))
                    .unwrap()
            };
            send.send_response(response);
        }

        async fn applies(&mut self, n: usize) {
            for _ in 0..n {
                let (request, send) = self.0.next_request().await.expect("an apply");
                assert_eq!(request.method(), Method::PATCH);
                let bytes = request.into_body().collect_bytes().await.unwrap();
                send.send_response(
                    Response::builder()
                        .body(Body::from(bytes.to_vec()))
                        .unwrap(),
                );
            }
        }

        async fn status(&mut self) -> Value {
            let (body, send) = self
                .next(
                    Method::PATCH,
                    "/apis/cosmosq.io/v1alpha1/namespaces/shop/queueconsumergroups/billing/status",
                )
                .await;
            let mut echo = group_json(json!([{"name": "app", "image": "x"}]));
            echo["status"] = body["status"].clone();
            send.send_response(
                Response::builder()
                    .body(Body::from(serde_json::to_vec(&echo).unwrap()))
                    .unwrap(),
            );
            body["status"].clone()
        }
    }

    fn queue_json() -> Value {
        json!({
            "apiVersion": "cosmosq.io/v1alpha1", "kind": "CosmosQueue",
            "metadata": {"name": "orders", "namespace": "shop", "uid": "q1"},
            "spec": {"endpoint": "https://acct.documents.azure.com:443/",
                     "credentials": {"secretKeyRef": {"name": "cosmos-key"}},
                     "database": "shop", "container": "orders"}
        })
    }

    fn group_json(containers: Value) -> Value {
        json!({
            "apiVersion": "cosmosq.io/v1alpha1", "kind": "QueueConsumerGroup",
            "metadata": {"name": "billing", "namespace": "shop", "uid": "g1", "generation": 3},
            "spec": {"queueRef": {"name": "orders"}, "template": {"spec": {"containers": containers}},
                     "app": {"port": 8080}}
        })
    }

    fn setup(containers: Value) -> (Arc<QueueConsumerGroup>, Arc<Context>, ApiServerVerifier) {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let ctx = Context {
            client: Client::new(service, "shop"),
            defaults: Defaults {
                sidecar_image: "s:t".into(),
            },
        };
        let qcg: QueueConsumerGroup = serde_json::from_value(group_json(containers)).unwrap();
        (Arc::new(qcg), Arc::new(ctx), ApiServerVerifier(handle))
    }

    fn ready(status: &Value) -> (&str, &str) {
        let c = status["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Ready")
            .unwrap();
        (c["status"].as_str().unwrap(), c["reason"].as_str().unwrap())
    }

    #[tokio::test]
    async fn a_valid_group_is_applied_and_reported_ready() {
        let (qcg, ctx, mut server) = setup(json!([{"name": "app", "image": "example/app"}]));
        let verifier = tokio::spawn(async move {
            server.get_queue(true).await;
            server.applies(4).await;
            server.status().await
        });
        let action = reconcile_group(qcg, ctx).await.unwrap();
        assert_eq!(action, Action::requeue(Duration::from_secs(300)));
        let status = verifier.await.unwrap();
        assert_eq!(ready(&status), ("True", "Applied"));
        assert_eq!(status["observedGeneration"], 3);
    }

    #[tokio::test]
    async fn a_missing_queue_is_reported_and_retried() {
        let (qcg, ctx, mut server) = setup(json!([{"name": "app", "image": "example/app"}]));
        let verifier = tokio::spawn(async move {
            server.get_queue(false).await;
            server.status().await
        });
        let action = reconcile_group(qcg, ctx).await.unwrap();
        assert_eq!(action, Action::requeue(Duration::from_secs(30)));
        let status = verifier.await.unwrap();
        assert_eq!(ready(&status), ("False", "QueueNotFound"));
        let degraded = status["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Degraded")
            .unwrap();
        assert_eq!(degraded["status"], "True");
    }

    #[tokio::test]
    async fn an_invalid_spec_is_named_in_status_and_nothing_is_applied() {
        let (qcg, ctx, mut server) = setup(json!([]));
        let verifier = tokio::spawn(async move {
            server.get_queue(true).await;
            server.status().await // the next request is the status: no apply came first
        });
        let action = reconcile_group(qcg, ctx).await.unwrap();
        assert_eq!(action, Action::await_change());
        let status = verifier.await.unwrap();
        assert_eq!(ready(&status), ("False", "InvalidSpec"));
        let message = status["conditions"][0]["message"].as_str().unwrap();
        assert!(
            message.contains("spec.template.spec.containers"),
            "{message}"
        );
    }

    #[test]
    fn transition_time_moves_only_when_the_status_flips() {
        let t0 = Time(k8s_openapi::jiff::Timestamp::from_second(1_000).unwrap());
        let t1 = Time(k8s_openapi::jiff::Timestamp::from_second(2_000).unwrap());
        let first = condition(
            &[],
            "Ready",
            true,
            "Applied",
            "ok".into(),
            Some(1),
            t0.clone(),
        );
        let same = condition(
            std::slice::from_ref(&first),
            "Ready",
            true,
            "Applied",
            "ok".into(),
            Some(2),
            t1.clone(),
        );
        assert_eq!(same.last_transition_time, t0);
        let flipped = condition(
            &[first],
            "Ready",
            false,
            "InvalidSpec",
            "bad".into(),
            Some(3),
            t1.clone(),
        );
        assert_eq!(flipped.last_transition_time, t1);
    }
}
