//! What the operator keeps in memory of the workers' Deployments: the few fields the scaling
//! loop reads and a change is told by, not the Deployment. A `Deployment` value is 2.4 KB
//! before any of its strings (the pod spec inside its template is laid out inline even when
//! empty): the 5,000 groups' trimmed Deployments held ≈ 20 MB that way.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::watcher;
use kube::Resource;

/// A workers' Deployment as the cache keeps it. Reconciles read the whole object when they
/// apply; this is for the scaling loop and for telling a change that needs a reconcile.
#[derive(Clone, Debug, PartialEq)]
pub struct CachedDeployment {
    /// Name, namespace, uid, owner references, versions and deletion time: no labels (the
    /// watch selects by them on the server), annotations or field managers.
    pub metadata: ObjectMeta,
    /// `spec.replicas`: what the last scale asked for.
    pub replicas: Option<i32>,
    /// `status.replicas`: pods that exist.
    pub running: Option<i32>,
    /// `spec.selector.matchLabels`.
    pub selector: BTreeMap<String, String>,
    /// A hash of the spec but the replicas: a change to it is someone else's edit.
    pub spec_hash: u64,
    /// The conditions' type, status and reason (their messages and times are no change).
    pub conditions: Vec<(String, String, Option<String>)>,
}

/// A hash of a Deployment's spec, its replicas left out.
fn hash(unscaled: &Option<k8s_openapi::api::apps::v1::DeploymentSpec>) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    serde_json::to_string(unscaled)
        .unwrap_or_default()
        .hash(&mut hasher);
    hasher.finish()
}

impl From<Deployment> for CachedDeployment {
    fn from(deployment: Deployment) -> Self {
        let Deployment {
            metadata,
            spec,
            status,
        } = deployment;
        let (replicas, selector, spec_hash) = match spec {
            Some(mut spec) => {
                let replicas = spec.replicas.take();
                let selector = spec.selector.match_labels.clone().unwrap_or_default();
                (replicas, selector, hash(&Some(spec)))
            }
            None => (None, BTreeMap::new(), hash(&None)),
        };
        let (running, conditions) = status
            .map(|s| (s.replicas, s.conditions.unwrap_or_default()))
            .unwrap_or_default();
        Self {
            metadata: ObjectMeta {
                name: metadata.name,
                namespace: metadata.namespace,
                uid: metadata.uid,
                resource_version: metadata.resource_version,
                generation: metadata.generation,
                owner_references: metadata.owner_references,
                deletion_timestamp: metadata.deletion_timestamp,
                ..ObjectMeta::default()
            },
            replicas,
            running,
            selector,
            spec_hash,
            conditions: conditions
                .into_iter()
                .map(|c| (c.type_, c.status, c.reason))
                .collect(),
        }
    }
}

/// A watch of Deployments as one of [`CachedDeployment`]s (pure).
pub fn event(event: watcher::Event<Deployment>) -> watcher::Event<CachedDeployment> {
    use watcher::Event::*;
    match event {
        Apply(d) => Apply(d.into()),
        Delete(d) => Delete(d.into()),
        Init => Init,
        InitApply(d) => InitApply(d.into()),
        InitDone => InitDone,
    }
}

impl Resource for CachedDeployment {
    type DynamicType = ();
    type Scope = k8s_openapi::NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        <Deployment as Resource>::kind(&())
    }

    fn group(_: &()) -> Cow<'_, str> {
        <Deployment as Resource>::group(&())
    }

    fn version(_: &()) -> Cow<'_, str> {
        <Deployment as Resource>::version(&())
    }

    fn plural(_: &()) -> Cow<'_, str> {
        <Deployment as Resource>::plural(&())
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::ResourceExt;

    /// The group controller maps a cached Deployment to its group by the owner reference and
    /// the kind it reports: a Deployment's, as the API server names it.
    #[test]
    fn it_is_a_deployment_to_the_controller() {
        assert_eq!(CachedDeployment::kind(&()), "Deployment");
        assert_eq!(CachedDeployment::api_version(&()), "apps/v1");
        assert_eq!(CachedDeployment::plural(&()), "deployments");
        let deployment: Deployment = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "billing-workers", "namespace": "shop", "uid": "d-1",
                         "ownerReferences": [{"apiVersion": "cosmosq.io/v1alpha1",
                             "kind": "QueueConsumerGroup", "name": "billing", "uid": "u-1",
                             "controller": true}]}
        }))
        .unwrap();
        let watcher::Event::Apply(cached) = event(watcher::Event::Apply(deployment)) else {
            panic!("an apply stays an apply");
        };
        let reference = cached.object_ref(&());
        assert_eq!(
            (reference.kind.as_deref(), reference.name.as_deref()),
            (Some("Deployment"), Some("billing-workers"))
        );
        assert_eq!(cached.owner_references()[0].uid, "u-1");
        assert_eq!((cached.replicas, cached.running), (None, None));
    }
}
