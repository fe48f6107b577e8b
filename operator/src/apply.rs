//! The apply step of the reconcile pipeline: everything a QueueConsumerGroup owns, written by
//! server-side apply with one field manager (so the operator owns exactly the fields it sets,
//! and users or the HPA keep theirs — replicas among them).

use cosmosq_crds::{CosmosQueue, QueueConsumerGroup, ScalingMode};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{DeleteParams, Patch, PatchParams, Preconditions};
use kube::{Api, Client, ResourceExt};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::build::{self, Defaults};
use crate::rollout;
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
    /// An object of the name the group needs exists and is not the group's: the operator does
    /// not take over (or, by owning it, garbage-collect) what it did not make.
    #[error(
        "{object} exists and is not this group's ({holder}): the operator does not take over \
         objects it did not make; delete or rename it, or give the group another name"
    )]
    NotOwned {
        /// `Kind namespace/name`.
        object: String,
        /// Who controls it, as far as its owner references say.
        holder: String,
    },
}

/// What was applied.
#[derive(Clone, Debug, PartialEq)]
pub struct Applied {
    /// The Deployment's name.
    pub deployment: String,
    /// Whether an HPA was applied (HPA mode).
    pub hpa: bool,
    /// The Deployment's status as the apply (or, when held, a read) returned it.
    pub workers: Option<k8s_openapi::api::apps::v1::DeploymentStatus>,
    /// What the running workers were built from (unknown for a Deployment built before the
    /// record).
    pub running: Option<rollout::BuiltFrom>,
    /// What the operator would build now, and why it waits, when the Deployment was left as
    /// it is.
    pub held: Option<(rollout::BuiltFrom, &'static str)>,
    /// Where the Deployment's rollout stands.
    pub rollout: rollout::Rollout,
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

/// Whether `meta` names the group as its controller (pure): the owner reference the operator
/// writes, matched by UID (a group deleted and made again under the same name is another
/// group).
pub fn controlled_by(meta: &ObjectMeta, qcg: &QueueConsumerGroup) -> bool {
    meta.owner_references
        .iter()
        .flatten()
        .any(|o| o.controller == Some(true) && Some(&o.uid) == qcg.metadata.uid.as_ref())
}

/// Who an object's owner references say controls it (pure), for a refusal's message.
fn holder(meta: &ObjectMeta) -> String {
    match meta
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))
    {
        Some(o) => format!("controlled by {} {}", o.kind, o.name),
        None => "no controller".into(),
    }
}

/// Reads the object of `name` (metadata only) and refuses one the group does not control.
/// `None`: there is none; an apply creates it.
async fn ours<K>(
    client: &Client,
    namespace: &str,
    name: &str,
    qcg: &QueueConsumerGroup,
) -> Result<Option<ObjectMeta>, ApplyError>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug,
{
    let api: Api<K> = Api::namespaced(client.clone(), namespace);
    let Some(found) = api.get_metadata_opt(name).await? else {
        return Ok(None);
    };
    if controlled_by(&found.metadata, qcg) {
        return Ok(Some(found.metadata));
    }
    Err(ApplyError::NotOwned {
        object: format!("{} {namespace}/{name}", K::kind(&())),
        holder: holder(&found.metadata),
    })
}

/// Deletes `name` if, and only if, the group controls it; conditional on the UID read, so an
/// object made again in between is left alone. True when this call deleted it.
async fn delete_if_ours<K>(
    client: &Client,
    namespace: &str,
    name: &str,
    qcg: &QueueConsumerGroup,
) -> Result<bool, ApplyError>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug,
{
    let Some(meta) = ours::<K>(client, namespace, name, qcg).await? else {
        return Ok(false);
    };
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: meta.uid,
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    let api: Api<K> = Api::namespaced(client.clone(), namespace);
    match api.delete(name, &params).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Applies the workers' RoleBinding. One made before the worker ClusterRole existed names the
/// group's own Role, and a binding's roleRef cannot change: that binding and its Role are
/// deleted and the binding made anew (the workers lack the grant for a moment; their deletion
/// cost waits for the next try).
async fn apply_binding(
    client: &Client,
    namespace: &str,
    binding: &RoleBinding,
    qcg: &QueueConsumerGroup,
) -> Result<(), ApplyError> {
    match apply::<RoleBinding>(client, namespace, binding).await {
        Err(ApplyError::Kube(kube::Error::Api(e)))
            if e.code == 422 && e.message.contains("roleRef") =>
        {
            // Only the group's own binding and Role: the caller checked the binding before
            // this apply, and a Role of the name is looked at before it goes.
            let name = binding.name_any();
            delete_if_ours::<RoleBinding>(client, namespace, &name, qcg).await?;
            delete_if_ours::<Role>(client, namespace, &name, qcg).await?;
            tracing::info!(%namespace, binding = %name, "replaced a RoleBinding to the group's own Role by one to the worker ClusterRole");
            apply::<RoleBinding>(client, namespace, binding).await?;
            Ok(())
        }
        other => other.map(|_| ()),
    }
}

/// The digest of the account keys the sidecars read, as their Secrets hold them now: the
/// queue's (`None` with workload identity) and those of the queues of `spec.publishTo` (a
/// group without them keeps the digest it always had, so an upgrade rolls nothing).
async fn key_digest(
    client: &Client,
    namespace: &str,
    queue: &CosmosQueue,
    targets: &[CosmosQueue],
    deployment: &str,
) -> Result<Option<String>, ApplyError> {
    let keyed = |q: &CosmosQueue| q.spec.credentials.secret_key_ref.is_some();
    if !std::iter::once(queue).chain(targets).any(keyed) {
        return Ok(None);
    }
    let secrets = Api::<Secret>::namespaced(client.clone(), namespace);
    let digest_of = |queue: &CosmosQueue| {
        let secrets = secrets.clone();
        let key_ref = queue.spec.credentials.secret_key_ref.clone();
        async move {
            let Some(key_ref) = key_ref else {
                return Ok::<_, kube::Error>(Some(None));
            };
            let secret = secrets.get_opt(&key_ref.name).await?;
            // The outer `None`: a Secret or key that is not there (yet).
            Ok(secret
                .and_then(|s| s.data)
                .and_then(|d| d.get(&key_ref.key).map(|v| Some(build::key_digest(&v.0)))))
        }
    };
    let own = digest_of(queue).await?;
    let mut others = Vec::new();
    for target in targets {
        others.push(digest_of(target).await?);
    }
    let digest = keys_digest(own, others);
    or_running(
        client,
        namespace,
        deployment,
        build::KEY_DIGEST_ANNOTATION,
        digest,
    )
    .await
}

/// A key's digest as read: `None` when its Secret or key is not there (yet), `Some(None)` for
/// a queue on workload identity.
type KeyRead = Option<Option<String>>;

/// One digest of the keys the sidecars read (pure): the queue's own alone for a group that
/// publishes nowhere else (as before pipelines: an upgrade rolls nothing), else a digest over
/// every queue's, which changes when any one is rotated; `None` while one cannot be read (the
/// running workers' is kept meanwhile).
fn keys_digest(own: KeyRead, targets: Vec<KeyRead>) -> Option<String> {
    if targets.is_empty() {
        return own.flatten();
    }
    std::iter::once(own)
        .chain(targets)
        .map(|read| read.map(|key| key.unwrap_or_else(|| "-".into())))
        .collect::<Option<Vec<String>>>()
        .map(|keys| build::key_digest(keys.join("/").as_bytes()))
}

/// The digest of the group's API tokens (`None` without tokens), and with
/// `spec.app.generateApiTokens` the Secret to make when it is missing — only then: one of the
/// name that the group does not control is refused, never written.
async fn tokens_digest(
    client: &Client,
    namespace: &str,
    qcg: &QueueConsumerGroup,
    deployment: &str,
) -> Result<(Option<String>, Option<Secret>), ApplyError> {
    let Some(name) = build::api_token_secret(qcg) else {
        return Ok((None, None));
    };
    let mut secret = Api::<Secret>::namespaced(client.clone(), namespace)
        .get_opt(&name)
        .await?;
    let mut make = None;
    if qcg.spec.app.generate_api_tokens {
        match &secret {
            Some(found) if !controlled_by(&found.metadata, qcg) => {
                return Err(ApplyError::NotOwned {
                    object: format!("Secret {namespace}/{name}"),
                    holder: holder(&found.metadata),
                })
            }
            Some(_) => {}
            None => {
                make = Some(build::generated_api_tokens(qcg)?);
                secret = make.clone();
            }
        }
    }
    let digest = match &secret {
        Some(made) if qcg.spec.app.generate_api_tokens => build::api_tokens_digest(made),
        // A Secret the team keeps: told by its identity and version, not its content (its
        // tokens may be guessable, and whoever may read pods reads the template).
        Some(kept) => build::api_tokens_digest(kept).and_then(|_| {
            let meta = &kept.metadata;
            let (uid, version) = (meta.uid.as_ref()?, meta.resource_version.as_ref()?);
            Some(build::key_digest(format!("{uid}/{version}").as_bytes()))
        }),
        None => None,
    };
    let digest = or_running(
        client,
        namespace,
        deployment,
        build::TOKENS_DIGEST_ANNOTATION,
        digest,
    )
    .await?;
    Ok((digest, make))
}

/// `digest`, or while its Secret or key is missing (the pods say so: they cannot start
/// without it), the one the running workers carry: a Secret deleted and made again must not
/// roll them twice.
async fn or_running(
    client: &Client,
    namespace: &str,
    deployment: &str,
    annotation: &str,
    digest: Option<String>,
) -> Result<Option<String>, ApplyError> {
    if digest.is_some() {
        return Ok(digest);
    }
    let live = Api::<Deployment>::namespaced(client.clone(), namespace)
        .get_opt(deployment)
        .await?;
    Ok(live
        .and_then(|d| d.spec)
        .and_then(|s| s.template.metadata)
        .and_then(|m| m.annotations)
        .and_then(|mut a| a.remove(annotation)))
}

/// Validates, builds and applies the group's ServiceAccount, RoleBinding, Deployment and (HPA
/// mode) HorizontalPodAutoscaler. Validating and building are pure and happen first: an invalid
/// spec writes nothing.
pub async fn apply_group(
    client: &Client,
    qcg: &QueueConsumerGroup,
    queue: &CosmosQueue,
    targets: &[CosmosQueue],
    defaults: &Defaults,
) -> Result<Applied, ApplyError> {
    let namespace = qcg
        .namespace()
        .ok_or_else(|| ApplyError::NoNamespace(qcg.name_any()))?;
    let settings = spec::group(qcg)?;
    let mut deployment = build::deployment(qcg, &settings, queue, targets, defaults)?;
    let name = build::workers_name(qcg);
    let (digest, (tokens, make_tokens)) = tokio::try_join!(
        key_digest(client, &namespace, queue, targets, &name),
        tokens_digest(client, &namespace, qcg, &name),
    )?;
    if let Some(digest) = &digest {
        build::with_digest(
            &mut deployment,
            build::KEY_DIGEST_ANNOTATION,
            digest.clone(),
        );
    }
    if let Some(tokens) = &tokens {
        build::with_digest(
            &mut deployment,
            build::TOKENS_DIGEST_ANNOTATION,
            tokens.clone(),
        );
    }
    let built_from = rollout::BuiltFrom {
        group: qcg.metadata.generation,
        queue: queue.metadata.generation,
        targets: targets
            .iter()
            .map(|t| (t.name_any(), t.metadata.generation.unwrap_or_default()))
            .collect(),
        request: qcg.annotations().get(rollout::ROLLOUT_REQUESTED).cloned(),
        operator: rollout::operator(&defaults.sidecar_image),
        key: digest,
        tokens,
    };
    let service_account = build::service_account(qcg, queue)?;
    // The pods run as that account (`build::deployment` refuses any other).
    let binding = build::role_binding(qcg, &name, defaults)?;
    let hpa = build::hpa(qcg, &settings)?;

    // Nothing is written until every object of the group's names is known to be its own (or
    // absent): a team's Deployment, ServiceAccount or binding of that name stays theirs.
    let (_, _, running, _) = tokio::try_join!(
        ours::<ServiceAccount>(client, &namespace, &name, qcg),
        ours::<RoleBinding>(client, &namespace, &name, qcg),
        ours::<Deployment>(client, &namespace, &name, qcg),
        async {
            match &hpa {
                Some(_) => ours::<HorizontalPodAutoscaler>(client, &namespace, &name, qcg).await,
                None => Ok(None),
            }
        },
    )?;
    if let Some(tokens) = &make_tokens {
        // Created, never applied: a Secret of the name made in between (by a former leader)
        // is not overwritten; the conflict retries the reconcile, which reads that one.
        Api::<Secret>::namespaced(client.clone(), &namespace)
            .create(&Default::default(), tokens)
            .await?;
        tracing::info!(%namespace, secret = %tokens.name_any(), "made the group's API tokens");
    }
    apply::<ServiceAccount>(client, &namespace, &service_account).await?;
    apply_binding(client, &namespace, &binding, qcg).await?;
    // The workers roll for the user's changes; for the operator's, as its policy allows.
    let running_from = running
        .as_ref()
        .and_then(|m| rollout::BuiltFrom::of(m.annotations.as_ref()?));
    let mut cause = match &running {
        None => rollout::Cause::Unchanged,
        Some(_) => rollout::cause(running_from.as_ref(), &built_from, spec_changed(qcg)),
    };
    // Built before the record: a rotated key is told by the template's own digest (one more
    // read, for such Deployments only), so it is not held with the upgrade.
    let deployments = Api::<Deployment>::namespaced(client.clone(), &namespace);
    let mut live = None;
    if cause == rollout::Cause::Operator && running_from.is_none() && built_from.key.is_some() {
        let read = deployments.get(&name).await?;
        let live_key = read
            .spec
            .as_ref()
            .and_then(|s| s.template.metadata.as_ref())
            .and_then(|m| m.annotations.as_ref())
            .and_then(|a| a.get(build::KEY_DIGEST_ANNOTATION));
        if live_key != built_from.key.as_ref() {
            cause = rollout::Cause::Key;
        }
        live = Some(read);
    }
    // One budgeted decision at a time, from the count to the apply: concurrent reconciles
    // would each see a free place and overshoot the budget (only the leader reconciles).
    let deciding = if rollout::counts(cause, &defaults.rollout) {
        Some(defaults.rollout_lock.lock().await)
    } else {
        None
    };
    let rolling = if deciding.is_some() {
        Some(budgeted_rollouts(client, defaults, running.as_ref()).await?)
    } else {
        None
    };
    let decision = rollout::decide(cause, &defaults.rollout, || {
        rolling.expect("counted when the decision needs it")
    });
    let (workers, running_from, held, stands) = match decision {
        rollout::RolloutDecision::Apply { budgeted } => {
            let annotations = deployment
                .metadata
                .annotations
                .get_or_insert_with(Default::default);
            annotations.insert(rollout::BUILT_FROM.into(), built_from.annotation());
            if cause != rollout::Cause::Unchanged {
                let why = if budgeted { "operator" } else { "spec" };
                annotations.insert(rollout::ROLLOUT_CAUSE.into(), why.into());
            } else if let Some(why) = running
                .as_ref()
                .and_then(|m| m.annotations.as_ref()?.get(rollout::ROLLOUT_CAUSE))
            {
                // Kept: a budgeted rollout counts until it completes.
                annotations.insert(rollout::ROLLOUT_CAUSE.into(), why.clone());
            }
            let applied = apply::<Deployment>(client, &namespace, &deployment).await?;
            let stands = rollout::rollout(&applied);
            (applied.status, Some(built_from), None, stands)
        }
        rollout::RolloutDecision::Hold(why) => {
            tracing::info!(group = %qcg.name_any(), ?cause, "{why}");
            let live = match live {
                Some(live) => live,
                None => deployments.get(&name).await?,
            };
            let stands = rollout::rollout(&live);
            (live.status, running_from, Some((built_from, why)), stands)
        }
    };
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
        workers,
        running: running_from,
        held,
        rollout: stands,
    })
}

/// How many groups' Deployments (but `own`) are rolling for the operator's reasons: listed
/// when a rollout would count against the budget, so the count survives restarts and leader
/// changes (no state of the operator's own).
async fn budgeted_rollouts(
    client: &Client,
    defaults: &Defaults,
    own: Option<&ObjectMeta>,
) -> Result<usize, ApplyError> {
    let api: Api<Deployment> = match &defaults.rollout_scope {
        Some(namespace) => Api::namespaced(client.clone(), namespace),
        None => Api::all(client.clone()),
    };
    let listed = api
        .list(&kube::api::ListParams::default().labels(build::MANAGED_SELECTOR))
        .await?;
    let own = own.and_then(|m| m.uid.as_deref()).unwrap_or_default();
    Ok(rollout::budgeted_in_progress(&listed.items, own))
}

/// Whether the spec changed since the last reconcile that finished (a mode switch is one):
/// only then can an object the group no longer wants be left over, so only then is it looked
/// for (no extra request on the periodic reconciles).
fn spec_changed(qcg: &QueueConsumerGroup) -> bool {
    qcg.metadata.generation != qcg.status.as_ref().and_then(|s| s.observed_generation)
}

/// Deletes the group's HorizontalPodAutoscaler if there is one and the group controls it (an
/// HPA of that name that someone else made is theirs, and stays).
async fn remove_owned_hpa(
    client: &Client,
    namespace: &str,
    qcg: &QueueConsumerGroup,
) -> Result<(), ApplyError> {
    let name = build::workers_name(qcg);
    match delete_if_ours::<HorizontalPodAutoscaler>(client, namespace, &name, qcg).await {
        Ok(true) => {
            tracing::info!(group = %qcg.name_any(), hpa = %name, "removed the HorizontalPodAutoscaler: the group no longer scales through one");
            Ok(())
        }
        Ok(false) | Err(ApplyError::NotOwned { .. }) => Ok(()),
        Err(e) => Err(e),
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

        /// The reads of the group's ServiceAccount, RoleBinding, Deployment (and HPA) before
        /// anything is written, answered with `found` (`None`: not found).
        async fn expect_reads(&mut self, found: [Option<Value>; 4], hpa: bool) {
            let paths = [
                "/api/v1/namespaces/shop/serviceaccounts/billing-workers",
                "/apis/rbac.authorization.k8s.io/v1/namespaces/shop/rolebindings/billing-workers",
                "/apis/apps/v1/namespaces/shop/deployments/billing-workers",
                "/apis/autoscaling/v2/namespaces/shop/horizontalpodautoscalers/billing-workers",
            ];
            for (path, found) in paths.into_iter().zip(found).take(if hpa { 4 } else { 3 }) {
                let response = match found {
                    Some(object) => json_response(StatusCode::OK, &object),
                    None => crate::testing::not_found(),
                };
                self.answer(Method::GET, path, response).await;
            }
        }

        /// The key read, the reads of the group's names, then its objects applied.
        async fn expect_workers_applied(&mut self, hpa: bool) {
            self.key_read("k1").await;
            self.expect_reads([None, None, None, None], hpa).await;
            self.expect_applies().await;
        }

        /// The group's ServiceAccount, RoleBinding and Deployment, applied in order; returns
        /// the Deployment as applied.
        async fn expect_applies(&mut self) -> Value {
            for (path, kind) in [
                ("/api/v1/namespaces/shop/serviceaccounts/billing-workers", "ServiceAccount"),
                ("/apis/rbac.authorization.k8s.io/v1/namespaces/shop/rolebindings/billing-workers", "RoleBinding"),
            ] {
                self.expect_apply(path, kind).await;
            }
            self.expect_apply(
                "/apis/apps/v1/namespaces/shop/deployments/billing-workers",
                "Deployment",
            )
            .await
        }
    }

    fn queue() -> CosmosQueue {
        serde_json::from_value(json!({
            "apiVersion": "cosmosq.io/v1alpha1", "kind": "CosmosQueue",
            "metadata": {"name": "orders", "namespace": "shop", "uid": "q1", "generation": 1},
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

    /// An object of the group's name, controlled by `controller` (a UID), or by nothing.
    fn existing(api_version: &str, kind: &str, controller: Option<&str>) -> Value {
        let owners: Vec<Value> = controller
            .map(|uid| {
                json!({"apiVersion": "cosmosq.io/v1alpha1", "kind": "QueueConsumerGroup",
                       "name": "billing", "uid": uid, "controller": true})
            })
            .into_iter()
            .collect();
        json!({"apiVersion": api_version, "kind": kind,
               "metadata": {"name": "billing-workers", "namespace": "shop",
                            "uid": format!("{kind}-uid"), "ownerReferences": owners}})
    }

    #[tokio::test]
    async fn direct_mode_applies_rbac_then_the_deployment() {
        let (client, mut server) = client();
        let verifier = tokio::spawn(async move {
            let digest = server.key_read("k1").await;
            server.expect_reads([None, None, None, None], false).await;
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
        let applied = apply_group(&client, &group(json!({})), &queue(), &[], &defaults())
            .await
            .unwrap();
        let server = verifier.await.unwrap();
        let built_from = rollout::BuiltFrom {
            group: None,
            queue: Some(1),
            targets: Default::default(),
            request: None,
            operator: format!(
                "{}+t{}/cosmosq/sidecar:test",
                env!("CARGO_PKG_VERSION"),
                rollout::TEMPLATE_REVISION
            ),
            key: Some(build::key_digest(b"k1")),
            tokens: None,
        };
        assert_eq!(
            applied,
            Applied {
                deployment: "billing-workers".into(),
                hpa: false,
                workers: None,
                running: Some(built_from),
                held: None,
                // The echo has no status: its controller has not seen it yet.
                rollout: rollout::Rollout::Going,
            }
        );
        drop(client);
        server.done().await; // nothing else was written
    }

    #[test]
    fn a_rotated_key_of_any_queue_the_workers_use_changes_their_digest() {
        let key = |k: &str| Some(Some(build::key_digest(k.as_bytes())));
        // Without pipelines, the digest workers were built with before them.
        assert_eq!(keys_digest(key("k1"), vec![]), key("k1").flatten());
        assert_eq!(keys_digest(Some(None), vec![]), None);
        let both = keys_digest(key("k1"), vec![key("i1"), Some(None)]);
        assert!(both.is_some());
        assert_ne!(both, keys_digest(key("k1"), vec![key("i2"), Some(None)]));
        assert_ne!(both, keys_digest(key("k2"), vec![key("i1"), Some(None)]));
        assert_eq!(both, keys_digest(key("k1"), vec![key("i1"), Some(None)]));
        // A Secret not there yet: no digest (the running workers' is kept).
        assert_eq!(keys_digest(key("k1"), vec![None]), None);
    }

    /// Workers built before the record (an upgrade to this version): held, unless their
    /// template's key digest shows a rotated key, which rolls (counted against the budget).
    #[tokio::test]
    async fn workers_built_before_the_record_are_held_unless_their_key_was_rotated() {
        for (live_digest, rolls) in [("k1", false), ("k0", true)] {
            let (client, mut server) = client();
            let verifier = tokio::spawn(async move {
                server.key_read("k1").await;
                let mut live = existing("apps/v1", "Deployment", Some("g1"));
                live["spec"] = json!({"selector": {}, "template": {"metadata": {"annotations":
                        {build::KEY_DIGEST_ANNOTATION: build::key_digest(live_digest.as_bytes())}}}});
                server
                    .expect_reads([None, None, Some(live.clone()), None], false)
                    .await;
                for (path, kind) in [
                    (
                        "/api/v1/namespaces/shop/serviceaccounts/billing-workers",
                        "ServiceAccount",
                    ),
                    (
                        "/apis/rbac.authorization.k8s.io/v1/namespaces/shop/rolebindings/billing-workers",
                        "RoleBinding",
                    ),
                ] {
                    server.expect_apply(path, kind).await;
                }
                server
                    .answer(
                        Method::GET,
                        "/apis/apps/v1/namespaces/shop/deployments/billing-workers",
                        json_response(StatusCode::OK, &live),
                    )
                    .await;
                if rolls {
                    // The budget is counted from the operator's Deployments: none is rolling.
                    let list = server
                        .expect(Method::GET, "/apis/apps/v1/deployments")
                        .await;
                    assert!(list.query.contains("labelSelector"), "{}", list.query);
                    list.send.send_response(json_response(
                        StatusCode::OK,
                        &json!({"apiVersion": "apps/v1", "kind": "DeploymentList",
                                "metadata": {}, "items": []}),
                    ));
                    let applied = server
                        .expect_apply(
                            "/apis/apps/v1/namespaces/shop/deployments/billing-workers",
                            "Deployment",
                        )
                        .await;
                    let annotations = &applied["metadata"]["annotations"];
                    assert_eq!(annotations[rollout::ROLLOUT_CAUSE], "operator");
                    assert!(annotations[rollout::BUILT_FROM].is_string());
                }
                server
            });
            let applied = apply_group(&client, &group(json!({})), &queue(), &[], &defaults())
                .await
                .unwrap();
            let server = verifier.await.unwrap();
            assert_eq!(applied.held.is_none(), rolls, "{live_digest}");
            if let Some((next, why)) = &applied.held {
                assert_eq!(next.key.as_deref(), Some(build::key_digest(b"k1").as_str()));
                assert!(why.contains("rollout-requested-at"), "{why}");
            }
            drop(client);
            server.done().await; // nothing else was read or written
        }
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
            // The live Deployment's digest is kept (through a change of the group's spec).
            let mut live = existing("apps/v1", "Deployment", Some("g1"));
            live["metadata"]["annotations"] = json!({rollout::BUILT_FROM: rollout::BuiltFrom {
                group: Some(2),
                queue: Some(1),
                targets: Default::default(),
                request: None,
                operator: rollout::operator("cosmosq/sidecar:test"),
                key: Some("0123456789abcdef".into()),
                tokens: None,
            }.annotation()});
            live["spec"] = json!({"selector": {}, "template": {"metadata": {"annotations":
                    {build::KEY_DIGEST_ANNOTATION: "0123456789abcdef"}}}});
            server
                .answer(
                    Method::GET,
                    "/apis/apps/v1/namespaces/shop/deployments/billing-workers",
                    json_response(StatusCode::OK, &live),
                )
                .await;
            server
                .expect_reads([None, None, Some(live), None], false)
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
        apply_group(&client, &group(json!({})), &queue(), &[], &defaults())
            .await
            .unwrap();
        let server = verifier.await.unwrap();
        drop(client);
        server.done().await;
    }

    #[tokio::test]
    async fn a_binding_to_the_old_per_group_role_is_replaced() {
        // The group's own binding and Role go; a Role of the name someone else made stays
        // (and the binding is not made again until it is gone: the apply fails).
        for role_owner in [Some("g1"), None] {
            let (client, mut server) = client();
            let binding =
                "/apis/rbac.authorization.k8s.io/v1/namespaces/shop/rolebindings/billing-workers";
            let role = "/apis/rbac.authorization.k8s.io/v1/namespaces/shop/roles/billing-workers";
            let verifier = tokio::spawn(async move {
                server.key_read("k1").await;
                let old = existing("rbac.authorization.k8s.io/v1", "RoleBinding", Some("g1"));
                server
                    .expect_reads([None, Some(old.clone()), None, None], false)
                    .await;
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
                server
                    .answer(Method::GET, binding, json_response(StatusCode::OK, &old))
                    .await;
                let seen = server.expect(Method::DELETE, binding).await;
                assert_eq!(seen.body["preconditions"]["uid"], "RoleBinding-uid");
                seen.send.send_response(json_response(StatusCode::OK, &old));
                let old_role = existing("rbac.authorization.k8s.io/v1", "Role", role_owner);
                server
                    .answer(Method::GET, role, json_response(StatusCode::OK, &old_role))
                    .await;
                if role_owner.is_none() {
                    return server;
                }
                let seen = server.expect(Method::DELETE, role).await;
                assert_eq!(seen.body["preconditions"]["uid"], "Role-uid");
                seen.send
                    .send_response(json_response(StatusCode::OK, &old_role));
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
            let result = apply_group(&client, &group(json!({})), &queue(), &[], &defaults()).await;
            if role_owner.is_some() {
                result.unwrap();
            } else {
                let err = result.unwrap_err().to_string();
                assert!(
                    err.starts_with("Role shop/billing-workers exists and is not this group's"),
                    "{err}"
                );
            }
            let server = verifier.await.unwrap();
            drop(client);
            server.done().await;
        }
    }

    #[tokio::test]
    async fn objects_of_the_groups_names_that_are_not_its_own_are_never_written() {
        // A team's Deployment (or ServiceAccount, binding, HPA) of the name the group needs:
        // refused, naming it, before anything is written. Another group's of the same name
        // (deleted and made again: another UID) is not this group's either.
        for (index, controller) in [(0, None), (1, Some("old-group")), (2, None), (3, None)] {
            let (client, mut server) = client();
            let kinds = [
                ("v1", "ServiceAccount"),
                ("rbac.authorization.k8s.io/v1", "RoleBinding"),
                ("apps/v1", "Deployment"),
                ("autoscaling/v2", "HorizontalPodAutoscaler"),
            ];
            let (api_version, kind) = kinds[index];
            let verifier = tokio::spawn(async move {
                server.key_read("k1").await;
                let mut found = [None, None, None, None];
                found[index] = Some(existing(api_version, kind, controller));
                server.expect_reads(found, true).await;
                server
            });
            let err = apply_group(
                &client,
                &group(json!({"mode": "HPA", "maxReplicas": 5})),
                &queue(),
                &[],
                &defaults(),
            )
            .await
            .unwrap_err();
            let text = err.to_string();
            let holder = match controller {
                Some(_) => "(controlled by QueueConsumerGroup billing)",
                None => "(no controller)",
            };
            assert!(
                text.starts_with(&format!(
                    "{kind} shop/billing-workers exists and is not this group's {holder}"
                )),
                "{text}"
            );
            let server = verifier.await.unwrap();
            drop(client);
            server.done().await; // nothing was written
        }
    }

    /// A group whose operator makes its API tokens.
    fn tokens_group() -> QueueConsumerGroup {
        let mut g = group(json!({}));
        g.spec.app.generate_api_tokens = true;
        g
    }

    const TOKENS: &str = "/api/v1/namespaces/shop/secrets/billing-api-tokens";

    #[tokio::test]
    async fn generated_api_tokens_are_made_once_after_every_name_is_known_to_be_the_groups() {
        let (client, mut server) = client();
        let verifier = tokio::spawn(async move {
            server.key_read("k1").await;
            server
                .answer(Method::GET, TOKENS, crate::testing::not_found())
                .await;
            // Nothing is written before the group's other names are known to be its own.
            server.expect_reads([None, None, None, None], false).await;
            let made = server
                .echo(Method::POST, "/api/v1/namespaces/shop/secrets")
                .await;
            let deployment = server.expect_applies().await;
            (server, made, deployment)
        });
        let applied = apply_group(&client, &tokens_group(), &queue(), &[], &defaults())
            .await
            .unwrap();
        let (server, made, deployment) = verifier.await.unwrap();
        assert_eq!(made["metadata"]["name"], "billing-api-tokens");
        assert_eq!(made["metadata"]["ownerReferences"][0]["uid"], "g1");
        assert_eq!(made["metadata"]["ownerReferences"][0]["controller"], true);
        assert_eq!(made["immutable"], true);
        let made: Secret = serde_json::from_value(made).unwrap();
        let digest = build::api_tokens_digest(&made).expect("both tokens");
        // The pods carry the tokens' digest (a new Secret rolls them) and read them from it.
        let template = &deployment["spec"]["template"];
        assert_eq!(
            template["metadata"]["annotations"][build::TOKENS_DIGEST_ANNOTATION],
            digest.as_str()
        );
        assert!(template["spec"]["containers"][0]["env"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["name"] == "DAPR_API_TOKEN"
                && v["valueFrom"]["secretKeyRef"]["name"] == "billing-api-tokens"));
        assert_eq!(applied.running.unwrap().tokens, Some(digest.clone()));
        drop(client);
        server.done().await;

        // Next time the Secret is there, and the group's: read, not made again.
        let (client, mut server) = crate::testing::client();
        let mut stored = serde_json::to_value(&made).unwrap();
        stored["data"] = json!({
            "dapr-api-token": base64_of(&made, "dapr-api-token"),
            "app-api-token": base64_of(&made, "app-api-token"),
        });
        stored.as_object_mut().unwrap().remove("stringData");
        let verifier = tokio::spawn(async move {
            server.key_read("k1").await;
            server
                .answer(Method::GET, TOKENS, json_response(StatusCode::OK, &stored))
                .await;
            server.expect_reads([None, None, None, None], false).await;
            server.expect_applies().await;
            server
        });
        let applied = apply_group(&client, &tokens_group(), &queue(), &[], &defaults())
            .await
            .unwrap();
        assert_eq!(
            applied.running.unwrap().tokens,
            Some(digest),
            "the same tokens"
        );
        let server = verifier.await.unwrap();
        drop(client);
        server.done().await;
    }

    fn base64_of(secret: &Secret, key: &str) -> String {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.encode(&secret.string_data.as_ref().unwrap()[key])
    }

    #[tokio::test]
    async fn a_teams_token_secret_is_told_by_its_version_not_by_its_tokens() {
        // The template is readable by whoever may read pods: a digest of a team's (perhaps
        // guessable) tokens must not be in it; a new version of the Secret still rolls.
        let mut g = group(json!({}));
        g.spec.app.api_token_secret = Some("billing-tokens".into());
        let mut digests = Vec::new();
        for version in ["41", "42"] {
            let (client, mut server) = client();
            let g = g.clone();
            let verifier = tokio::spawn(async move {
                server.key_read("k1").await;
                let theirs = json!({"apiVersion": "v1", "kind": "Secret",
                    "metadata": {"name": "billing-tokens", "namespace": "shop",
                                 "uid": "s1", "resourceVersion": version},
                    "data": {"dapr-api-token": "czNjcjN0", "app-api-token": "czNjcjN0"}});
                server
                    .answer(
                        Method::GET,
                        "/api/v1/namespaces/shop/secrets/billing-tokens",
                        json_response(StatusCode::OK, &theirs),
                    )
                    .await;
                server.expect_reads([None, None, None, None], false).await;
                let deployment = server.expect_applies().await;
                (server, deployment)
            });
            apply_group(&client, &g, &queue(), &[], &defaults())
                .await
                .unwrap();
            let (server, deployment) = verifier.await.unwrap();
            drop(client);
            server.done().await;
            let digest = deployment["spec"]["template"]["metadata"]["annotations"]
                [build::TOKENS_DIGEST_ANNOTATION]
                .as_str()
                .unwrap()
                .to_owned();
            let content = Secret {
                data: Some(
                    [("dapr-api-token", "s3cr3t"), ("app-api-token", "s3cr3t")]
                        .into_iter()
                        .map(|(k, v)| (k.to_owned(), k8s_openapi::ByteString(v.into())))
                        .collect(),
                ),
                ..Secret::default()
            };
            assert_ne!(Some(&digest), build::api_tokens_digest(&content).as_ref());
            digests.push(digest);
        }
        assert_ne!(digests[0], digests[1], "a new version rolls the workers");
    }

    #[tokio::test]
    async fn a_tokens_secret_of_the_name_that_is_not_the_groups_is_never_written() {
        // A team's Secret, or one a deleted group of the same name made (another UID).
        for controller in [None, Some("old-group")] {
            let (client, mut server) = client();
            let verifier = tokio::spawn(async move {
                server.key_read("k1").await;
                let mut theirs = existing("v1", "Secret", controller);
                theirs["metadata"]["name"] = json!("billing-api-tokens");
                theirs["data"] = json!({"dapr-api-token": "dGhlaXJz", "app-api-token": "dGhlaXJz"});
                server
                    .answer(Method::GET, TOKENS, json_response(StatusCode::OK, &theirs))
                    .await;
                server
            });
            let err = apply_group(&client, &tokens_group(), &queue(), &[], &defaults())
                .await
                .unwrap_err();
            assert!(
                err.to_string()
                    .starts_with("Secret shop/billing-api-tokens exists and is not this group's"),
                "{err}"
            );
            let server = verifier.await.unwrap();
            drop(client);
            server.done().await; // nothing was written
        }
    }

    #[tokio::test]
    async fn hpa_mode_also_applies_the_autoscaler() {
        let (client, mut server) = client();
        let verifier = tokio::spawn(async move {
            server.expect_workers_applied(true).await;
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
            &[],
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
                server.expect_workers_applied(false).await;
                let existing = json!({
                    "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                    "metadata": {"name": "billing-workers", "namespace": "shop", "uid": "h1",
                                 "ownerReferences": [{"apiVersion": "cosmosq.io/v1alpha1",
                                     "kind": "QueueConsumerGroup", "name": "billing", "uid": owner,
                                     "controller": true}]},
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
            let applied = apply_group(&client, &switched, &queue(), &[], &defaults())
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
        bad.spec.template = json!({"spec": {"containers": []}}).into();
        let err = apply_group(&client, &bad, &queue(), &[], &defaults())
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
