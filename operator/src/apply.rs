//! The apply step of the reconcile pipeline: everything a QueueConsumerGroup owns, written by
//! server-side apply with one field manager (so the operator owns exactly the fields it sets,
//! and users or the HPA keep theirs — replicas among them).

use cosmosq_crds::{CosmosQueue, QueueConsumerGroup, ScalingMode};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{DeleteParams, Patch, PatchParams, Preconditions};
use kube::{Api, Client, ResourceExt};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::build::{self, Defaults};
use crate::spec::{self, SpecError};

/// The field manager of everything the reconcilers apply.
pub const FIELD_MANAGER: &str = "cosmosq-operator";

/// What can stop an apply.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The spec cannot be used; nothing was written.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// The API server refused or failed.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// The group has no namespace.
    #[error("{0} has no namespace")]
    NoNamespace(String),
}

/// What was applied.
#[derive(Clone, Debug, PartialEq)]
pub struct Applied {
    /// The Deployment's name.
    pub deployment: String,
    /// Whether an HPA was applied (HPA mode).
    pub hpa: bool,
    /// The Deployment's status as the apply returned it.
    pub workers: Option<k8s_openapi::api::apps::v1::DeploymentStatus>,
}

async fn apply<K>(client: &Client, namespace: &str, object: &K) -> Result<K, ApplyError>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + Serialize
        + DeserializeOwned
        + std::fmt::Debug,
{
    let api: Api<K> = Api::namespaced(client.clone(), namespace);
    // Strict: a field the API server does not know is refused, not dropped.
    let params = PatchParams::apply(FIELD_MANAGER)
        .force()
        .validation_strict();
    Ok(api
        .patch(&object.name_any(), &params, &Patch::Apply(object))
        .await?)
}

/// Applies the workers' RoleBinding. One made before the worker ClusterRole existed names the
/// group's own Role, and a binding's roleRef cannot change: that binding and its Role are
/// deleted and the binding made anew (the workers lack the grant for a moment; their deletion
/// cost waits for the next try).
async fn apply_binding(
    client: &Client,
    namespace: &str,
    binding: &RoleBinding,
) -> Result<(), ApplyError> {
    match apply::<RoleBinding>(client, namespace, binding).await {
        Err(ApplyError::Kube(kube::Error::Api(e)))
            if e.code == 422 && e.message.contains("roleRef") =>
        {
            let name = binding.name_any();
            gone(
                Api::<RoleBinding>::namespaced(client.clone(), namespace)
                    .delete(&name, &DeleteParams::default())
                    .await
                    .map(|_| ()),
            )?;
            gone(
                Api::<Role>::namespaced(client.clone(), namespace)
                    .delete(&name, &DeleteParams::default())
                    .await
                    .map(|_| ()),
            )?;
            tracing::info!(%namespace, binding = %name, "replaced a RoleBinding to the group's own Role by one to the worker ClusterRole");
            apply::<RoleBinding>(client, namespace, binding).await?;
            Ok(())
        }
        other => other.map(|_| ()),
    }
}

/// The digest of the account key the queue's Secret holds now (`None` with workload identity).
/// While the Secret or its key is missing (the queue's status reports that), the workers keep
/// the digest they have: a Secret deleted and made again must not roll them twice, and new pods
/// could not start without it anyway.
async fn key_digest(
    client: &Client,
    namespace: &str,
    queue: &CosmosQueue,
    deployment: &str,
) -> Result<Option<String>, ApplyError> {
    let Some(key_ref) = &queue.spec.credentials.secret_key_ref else {
        return Ok(None);
    };
    let secret = Api::<Secret>::namespaced(client.clone(), namespace)
        .get_opt(&key_ref.name)
        .await?;
    if let Some(digest) = secret
        .and_then(|s| s.data)
        .and_then(|d| d.get(&key_ref.key).map(|v| build::key_digest(&v.0)))
    {
        return Ok(Some(digest));
    }
    let live = Api::<Deployment>::namespaced(client.clone(), namespace)
        .get_opt(deployment)
        .await?;
    Ok(live
        .and_then(|d| d.spec)
        .and_then(|s| s.template.metadata)
        .and_then(|m| m.annotations)
        .and_then(|mut a| a.remove(build::KEY_DIGEST_ANNOTATION)))
}

/// A delete that found nothing to delete succeeded.
fn gone(result: Result<(), kube::Error>) -> Result<(), kube::Error> {
    match result {
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        other => other,
    }
}

/// Validates, builds and applies the group's ServiceAccount, RoleBinding, Deployment and (HPA
/// mode) HorizontalPodAutoscaler. Validating and building are pure and happen first: an invalid
/// spec writes nothing.
pub async fn apply_group(
    client: &Client,
    qcg: &QueueConsumerGroup,
    queue: &CosmosQueue,
    defaults: &Defaults,
) -> Result<Applied, ApplyError> {
    let namespace = qcg
        .namespace()
        .ok_or_else(|| ApplyError::NoNamespace(qcg.name_any()))?;
    let settings = spec::group(qcg)?;
    let mut deployment = build::deployment(qcg, &settings, queue, defaults)?;
    if let Some(digest) = key_digest(client, &namespace, queue, &deployment.name_any()).await? {
        build::with_key_digest(&mut deployment, digest);
    }
    let service_account = build::service_account(qcg, queue)?;
    let pod_account = deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.service_account_name.clone())
        .unwrap_or_else(|| build::workers_name(qcg));
    let binding = build::role_binding(qcg, &pod_account, defaults)?;
    let hpa = build::hpa(qcg, &settings)?;

    apply::<ServiceAccount>(client, &namespace, &service_account).await?;
    apply_binding(client, &namespace, &binding).await?;
    let applied = apply::<Deployment>(client, &namespace, &deployment).await?;
    if let Some(hpa) = &hpa {
        apply::<HorizontalPodAutoscaler>(client, &namespace, hpa).await?;
    } else if spec_changed(qcg) || qcg.spec.scaling.mode == ScalingMode::Hpa {
        // Left from HPA mode, or paused in it: it would go on scaling the Deployment against
        // the operator or the pause.
        remove_owned_hpa(client, &namespace, qcg).await?;
    }
    Ok(Applied {
        deployment: deployment.name_any(),
        hpa: hpa.is_some(),
        workers: applied.status,
    })
}

/// Whether the spec changed since the last reconcile that finished (a mode switch is one):
/// only then can an object the group no longer wants be left over, so only then is it looked
/// for (no extra request on the periodic reconciles).
fn spec_changed(qcg: &QueueConsumerGroup) -> bool {
    qcg.metadata.generation != qcg.status.as_ref().and_then(|s| s.observed_generation)
}

/// Deletes the group's HorizontalPodAutoscaler if there is one and the group owns it (an HPA
/// of that name that someone else made is theirs). The delete is conditional on the UID read.
async fn remove_owned_hpa(
    client: &Client,
    namespace: &str,
    qcg: &QueueConsumerGroup,
) -> Result<(), ApplyError> {
    let api: Api<HorizontalPodAutoscaler> = Api::namespaced(client.clone(), namespace);
    let name = build::workers_name(qcg);
    let Some(hpa) = api.get_opt(&name).await? else {
        return Ok(());
    };
    let ours = hpa
        .owner_references()
        .iter()
        .any(|o| Some(&o.uid) == qcg.metadata.uid.as_ref());
    if !ours {
        return Ok(());
    }
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: hpa.metadata.uid.clone(),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match api.delete(&name, &params).await {
        Ok(_) => {
            tracing::info!(group = %qcg.name_any(), hpa = %name, "removed the HorizontalPodAutoscaler: the group no longer scales through one");
            Ok(())
        }
        Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{client, json_response, ApiServerVerifier};
    use http::{Method, StatusCode};
    use serde_json::{json, Value};

    impl ApiServerVerifier {
        /// The next request is a server-side apply of `kind` at `path` by our field manager,
        /// owned by the group; it is echoed back.
        async fn expect_apply(&mut self, path: &str, kind: &str) -> Value {
            let seen = self.expect(Method::PATCH, path).await;
            assert!(
                seen.query.contains("fieldManager=cosmosq-operator")
                    && seen.query.contains("force=true"),
                "{}",
                seen.query
            );
            assert_eq!(seen.content_type, "application/apply-patch+yaml");
            assert_eq!(seen.body["kind"], kind);
            assert_eq!(
                seen.body["metadata"]["ownerReferences"][0]["kind"],
                "QueueConsumerGroup"
            );
            seen.send
                .send_response(json_response(StatusCode::OK, &seen.body));
            seen.body
        }

        /// The group's ServiceAccount, RoleBinding and Deployment, applied in order.
        async fn expect_workers_applied(&mut self) {
            self.key_read("k1").await;
            for (path, kind) in [
                ("/api/v1/namespaces/shop/serviceaccounts/billing-workers", "ServiceAccount"),
                ("/apis/rbac.authorization.k8s.io/v1/namespaces/shop/rolebindings/billing-workers", "RoleBinding"),
                ("/apis/apps/v1/namespaces/shop/deployments/billing-workers", "Deployment"),
            ] {
                self.expect_apply(path, kind).await;
            }
        }
    }

    fn queue() -> CosmosQueue {
        serde_json::from_value(json!({
            "apiVersion": "cosmosq.io/v1alpha1", "kind": "CosmosQueue",
            "metadata": {"name": "orders", "namespace": "shop", "uid": "q1"},
            "spec": {"endpoint": "https://acct.documents.azure.com:443/",
                     "credentials": {"secretKeyRef": {"name": "cosmos-key"}},
                     "database": "shop", "container": "orders"}
        }))
        .unwrap()
    }

    fn group(scaling: Value) -> QueueConsumerGroup {
        serde_json::from_value(json!({
            "apiVersion": "cosmosq.io/v1alpha1", "kind": "QueueConsumerGroup",
            "metadata": {"name": "billing", "namespace": "shop", "uid": "g1"},
            "spec": {"queueRef": {"name": "orders"},
                     "template": {"spec": {"containers": [{"name": "app", "image": "example/app"}]}},
                     "app": {"port": 8080}, "scaling": scaling}
        }))
        .unwrap()
    }

    fn defaults() -> Defaults {
        Defaults::new("cosmosq/sidecar:test")
    }

    #[tokio::test]
    async fn direct_mode_applies_rbac_then_the_deployment() {
        let (client, mut server) = client();
        let verifier = tokio::spawn(async move {
            let digest = server.key_read("k1").await;
            server
                .expect_apply(
                    "/api/v1/namespaces/shop/serviceaccounts/billing-workers",
                    "ServiceAccount",
                )
                .await;
            let binding = server.expect_apply("/apis/rbac.authorization.k8s.io/v1/namespaces/shop/rolebindings/billing-workers", "RoleBinding").await;
            assert_eq!(binding["subjects"][0]["name"], "billing-workers");
            assert_eq!(binding["roleRef"]["kind"], "ClusterRole");
            assert_eq!(binding["roleRef"]["name"], "cosmosq-worker");
            let deployment = server
                .expect_apply(
                    "/apis/apps/v1/namespaces/shop/deployments/billing-workers",
                    "Deployment",
                )
                .await;
            assert!(
                deployment["spec"].get("replicas").is_none(),
                "replicas are not ours to apply"
            );
            assert_eq!(
                deployment["spec"]["template"]["spec"]["containers"][1]["name"],
                "cosmosq-sidecar"
            );
            // A rotated key changes the template, which rolls the workers onto it.
            assert_eq!(
                deployment["spec"]["template"]["metadata"]["annotations"]
                    [build::KEY_DIGEST_ANNOTATION],
                digest.as_str()
            );
            server
        });
        let applied = apply_group(&client, &group(json!({})), &queue(), &defaults())
            .await
            .unwrap();
        assert_eq!(
            applied,
            Applied {
                deployment: "billing-workers".into(),
                hpa: false,
                workers: None,
            }
        );
        let server = verifier.await.unwrap();
        drop(client);
        server.done().await; // nothing else was written
    }

    #[tokio::test]
    async fn a_missing_key_secret_keeps_the_workers_digest() {
        let (client, mut server) = client();
        let verifier = tokio::spawn(async move {
            server
                .answer(
                    Method::GET,
                    "/api/v1/namespaces/shop/secrets/cosmos-key",
                    crate::testing::not_found(),
                )
                .await;
            // The live Deployment's digest is kept.
            let live = json!({"apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {"name": "billing-workers", "namespace": "shop"},
                "spec": {"selector": {}, "template": {"metadata": {"annotations":
                    {build::KEY_DIGEST_ANNOTATION: "0123456789abcdef"}}}}});
            server
                .answer(
                    Method::GET,
                    "/apis/apps/v1/namespaces/shop/deployments/billing-workers",
                    json_response(StatusCode::OK, &live),
                )
                .await;
            server
                .expect_apply(
                    "/api/v1/namespaces/shop/serviceaccounts/billing-workers",
                    "ServiceAccount",
                )
                .await;
            server
                .expect_apply("/apis/rbac.authorization.k8s.io/v1/namespaces/shop/rolebindings/billing-workers", "RoleBinding")
                .await;
            let deployment = server
                .expect_apply(
                    "/apis/apps/v1/namespaces/shop/deployments/billing-workers",
                    "Deployment",
                )
                .await;
            assert_eq!(
                deployment["spec"]["template"]["metadata"]["annotations"]
                    [build::KEY_DIGEST_ANNOTATION],
                "0123456789abcdef"
            );
            server
        });
        apply_group(&client, &group(json!({})), &queue(), &defaults())
            .await
            .unwrap();
        let server = verifier.await.unwrap();
        drop(client);
        server.done().await;
    }

    #[tokio::test]
    async fn a_binding_to_the_old_per_group_role_is_replaced() {
        let (client, mut server) = client();
        let binding =
            "/apis/rbac.authorization.k8s.io/v1/namespaces/shop/rolebindings/billing-workers";
        let verifier = tokio::spawn(async move {
            server.key_read("k1").await;
            server
                .expect_apply(
                    "/api/v1/namespaces/shop/serviceaccounts/billing-workers",
                    "ServiceAccount",
                )
                .await;
            // The API server refuses to change the roleRef of the existing binding.
            let seen = server.expect(Method::PATCH, binding).await;
            seen.send.send_response(json_response(
                StatusCode::UNPROCESSABLE_ENTITY,
                &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                        "reason": "Invalid", "code": 422,
                        "message": "RoleBinding.rbac.authorization.k8s.io \"billing-workers\" is invalid: roleRef: Invalid value: ...: cannot change roleRef"}),
            ));
            let gone = json!({"kind": "Status", "apiVersion": "v1", "status": "Success"});
            server
                .answer(
                    Method::DELETE,
                    binding,
                    json_response(StatusCode::OK, &gone),
                )
                .await;
            // The old Role may already be gone.
            server
                .answer(
                    Method::DELETE,
                    "/apis/rbac.authorization.k8s.io/v1/namespaces/shop/roles/billing-workers",
                    crate::testing::not_found(),
                )
                .await;
            let applied = server.expect_apply(binding, "RoleBinding").await;
            assert_eq!(applied["roleRef"]["kind"], "ClusterRole");
            server
                .expect_apply(
                    "/apis/apps/v1/namespaces/shop/deployments/billing-workers",
                    "Deployment",
                )
                .await;
            server
        });
        apply_group(&client, &group(json!({})), &queue(), &defaults())
            .await
            .unwrap();
        let server = verifier.await.unwrap();
        drop(client);
        server.done().await;
    }

    #[tokio::test]
    async fn hpa_mode_also_applies_the_autoscaler() {
        let (client, mut server) = client();
        let verifier = tokio::spawn(async move {
            server.expect_workers_applied().await;
            let hpa = server
                .expect_apply(
                    "/apis/autoscaling/v2/namespaces/shop/horizontalpodautoscalers/billing-workers",
                    "HorizontalPodAutoscaler",
                )
                .await;
            assert_eq!(
                hpa["spec"]["metrics"][0]["external"]["metric"]["name"],
                "cosmosq_backlog_messages"
            );
        });
        let applied = apply_group(
            &client,
            &group(json!({"mode": "HPA", "maxReplicas": 5})),
            &queue(),
            &defaults(),
        )
        .await
        .unwrap();
        assert!(applied.hpa);
        verifier.await.unwrap();
    }

    #[tokio::test]
    async fn switching_to_direct_mode_removes_the_groups_autoscaler_only() {
        let hpa_path =
            "/apis/autoscaling/v2/namespaces/shop/horizontalpodautoscalers/billing-workers";
        for (owner, deleted) in [("g1", true), ("someone-else", false)] {
            let (client, mut server) = client();
            let verifier = tokio::spawn(async move {
                server.expect_workers_applied().await;
                let existing = json!({
                    "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                    "metadata": {"name": "billing-workers", "namespace": "shop", "uid": "h1",
                                 "ownerReferences": [{"apiVersion": "cosmosq.io/v1alpha1",
                                     "kind": "QueueConsumerGroup", "name": "billing", "uid": owner}]},
                    "spec": {"scaleTargetRef": {"kind": "Deployment", "name": "billing-workers"},
                             "maxReplicas": 5}
                });
                server
                    .answer(
                        Method::GET,
                        hpa_path,
                        json_response(StatusCode::OK, &existing),
                    )
                    .await;
                if deleted {
                    let seen = server.expect(Method::DELETE, hpa_path).await;
                    assert_eq!(seen.body["preconditions"]["uid"], "h1");
                    seen.send
                        .send_response(json_response(StatusCode::OK, &existing));
                }
                server
            });
            let mut switched = group(json!({}));
            switched.metadata.generation = Some(3);
            switched.status =
                Some(serde_json::from_value(json!({"observedGeneration": 2})).unwrap());
            let applied = apply_group(&client, &switched, &queue(), &defaults())
                .await
                .unwrap();
            assert!(!applied.hpa);
            let server = verifier.await.unwrap();
            drop(client);
            server.done().await;
        }
    }

    #[tokio::test]
    async fn an_invalid_spec_writes_nothing() {
        let (client, server) = client();
        let mut bad = group(json!({}));
        bad.spec.template = json!({"spec": {"containers": []}});
        let err = apply_group(&client, &bad, &queue(), &defaults())
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("spec.template.spec.containers"),
            "{err}"
        );
        drop(client);
        server.done().await; // no request was made
    }
}
