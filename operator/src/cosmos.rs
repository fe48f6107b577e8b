//! The Cosmos DB side of the operator: the engine's settings from the resources (pure), and
//! connections per queue — the account key read from the queue's Secret on demand (never
//! cached on disk, never logged), or the operator's own Entra identity.

use std::collections::HashMap;
use std::time::Duration;

use cosmosq_crds::{
    CosmosQueue, CosmosQueueSpec, DeliveryMode, QueueConsumerGroup, StartFrom, ThroughputMode,
};
use cosmosq_queue::backoff::RetryPolicy;
use cosmosq_queue::config::{self, GroupConfig, QueueConfig, Throughput};
use cosmosq_queue::{Auth, ConnectionArgs, CosmosClient, Queue, QueueError};
use k8s_openapi::api::core::v1::Secret;
use kube::{Api, ResourceExt};
use tokio::sync::Mutex;

use crate::build::group_name;

#[derive(Debug, thiserror::Error)]
pub enum CosmosError {
    /// A field of the spec the schema could not check; the message names it.
    #[error("{field}: {reason}")]
    InvalidSpec { field: &'static str, reason: String },
    #[error("spec.credentials.secretKeyRef: Secret {0} not found")]
    SecretNotFound(String),
    /// The operator may not read it: in a namespace being deleted, the Role that let it (with
    /// `watchNamespace`) may already be gone.
    #[error("spec.credentials.secretKeyRef: Secret {0} may not be read by the operator")]
    SecretForbidden(String),
    #[error("spec.credentials.secretKeyRef: Secret {secret} has no key {key:?}")]
    SecretKeyMissing { secret: String, key: String },
    #[error(
        "spec.credentials.workloadIdentity: namespace {namespace} is not granted the operator's \
         identity on {endpoint} (an admin grants it with --identity-grant, the chart's \
         workloadIdentity.grants; or use a key Secret of this namespace)"
    )]
    IdentityNotGranted { namespace: String, endpoint: String },
    #[error("reading Secret {secret}: {source}")]
    Secret { secret: String, source: kube::Error },
    #[error(transparent)]
    Queue(#[from] QueueError),
}

impl CosmosError {
    /// Errors only the resource's owner can fix: retrying does not help until it changes.
    pub fn is_spec_error(&self) -> bool {
        matches!(
            self,
            CosmosError::InvalidSpec { .. }
                | CosmosError::SecretNotFound(_)
                | CosmosError::SecretKeyMissing { .. }
                | CosmosError::IdentityNotGranted { .. }
        )
    }
}

fn invalid(field: &'static str, reason: impl std::fmt::Display) -> CosmosError {
    CosmosError::InvalidSpec {
        field,
        reason: reason.to_string(),
    }
}

fn duration(field: &'static str, value: &str) -> Result<Duration, CosmosError> {
    humantime::parse_duration(value).map_err(|e| invalid(field, e))
}

/// The engine's queue settings from a CosmosQueue.
pub fn queue_config(spec: &CosmosQueueSpec) -> Result<QueueConfig, CosmosError> {
    let mut config = QueueConfig::new(spec.database.clone(), spec.container.clone());
    config.partition_key_path = spec.partition_key_path.clone();
    config.retention = Some(duration("spec.retention", &spec.retention)?);
    config.throughput = spec.throughput.as_ref().map(|t| match t.mode {
        ThroughputMode::Manual => Throughput::Manual(t.request_units.max(0) as u32),
        ThroughputMode::Autoscale => Throughput::Autoscale(t.request_units.max(0) as u32),
    });
    config.validate().map_err(|e| invalid("spec", e))?;
    Ok(config)
}

/// The engine's group settings from a QueueConsumerGroup (the same the sidecars get).
pub fn group_config(qcg: &QueueConsumerGroup) -> Result<GroupConfig, CosmosError> {
    let s = &qcg.spec;
    let retry = RetryPolicy {
        max_delivery_attempts: s.retry.max_delivery_attempts.max(0) as u32,
        initial_backoff: duration("spec.retry.initialBackoff", &s.retry.initial_backoff)?,
        max_backoff: duration("spec.retry.maxBackoff", &s.retry.max_backoff)?,
        ..RetryPolicy::default()
    };
    let config = GroupConfig::new(group_name(qcg))
        .with_mode(match s.delivery_mode {
            DeliveryMode::Exclusive => config::DeliveryMode::Exclusive,
            DeliveryMode::Stream => config::DeliveryMode::Stream,
        })
        .with_start_from(match s.start_from {
            StartFrom::Now => config::StartFrom::Now,
            StartFrom::Beginning => config::StartFrom::Beginning,
        })
        .with_lock_duration(duration("spec.lockDuration", &s.lock_duration)?)
        .with_ordering(s.ordered)
        .with_retry(retry);
    config.validate().map_err(|e| invalid("spec", e))?;
    Ok(config)
}

/// Where queues live.
#[derive(Clone)]
pub enum Backend {
    /// Each queue's own account, with its credentials (production); the operator's own
    /// identity only where `identity_grants` allow it.
    Azure {
        region: String,
        identity_grants: Vec<crate::grants::IdentityGrant>,
    },
    /// Every queue on this one client: the embedded emulator (tests, the local run).
    Fixed(CosmosClient),
}

/// Open queues, by resource, for as long as their spec is unchanged. An entry is dropped when
/// a call through it fails (`forget`), so a rotated key is read again on the next round.
pub struct Cosmos {
    backend: Backend,
    client: kube::Client,
    queues: Mutex<HashMap<String, (Option<i64>, Queue)>>,
    clients: Mutex<HashMap<u64, CosmosClient>>,
}

impl Cosmos {
    pub fn new(backend: Backend, client: kube::Client) -> Self {
        Self {
            backend,
            client,
            queues: Mutex::default(),
            clients: Mutex::default(),
        }
    }

    fn key(cq: &CosmosQueue) -> String {
        format!("{}/{}", cq.namespace().unwrap_or_default(), cq.name_any())
    }

    async fn connect(&self, cq: &CosmosQueue) -> Result<CosmosClient, CosmosError> {
        let (region, grants) = match &self.backend {
            Backend::Fixed(client) => return Ok(client.clone()),
            Backend::Azure {
                region,
                identity_grants,
            } => (region.clone(), identity_grants),
        };
        let namespace = cq.namespace().unwrap_or_default();
        if cq.spec.credentials.secret_key_ref.is_none()
            && !crate::grants::identity_allowed(grants, &namespace, &cq.spec.endpoint)
        {
            return Err(CosmosError::IdentityNotGranted {
                namespace,
                endpoint: cq.spec.endpoint.clone(),
            });
        }
        let mut args = ConnectionArgs {
            endpoint: cq.spec.endpoint.clone(),
            auth: Auth::Identity,
            key: None,
            key_file: None,
            region,
        };
        if let Some(secret_ref) = &cq.spec.credentials.secret_key_ref {
            let namespace = cq.namespace().unwrap_or_default();
            let secrets: Api<Secret> = Api::namespaced(self.client.clone(), &namespace);
            let name = format!("{namespace}/{}", secret_ref.name);
            let secret = secrets
                .get_opt(&secret_ref.name)
                .await
                .map_err(|source| match source {
                    kube::Error::Api(e) if e.code == 403 => {
                        CosmosError::SecretForbidden(name.clone())
                    }
                    source => CosmosError::Secret {
                        secret: name.clone(),
                        source,
                    },
                })?
                .ok_or_else(|| CosmosError::SecretNotFound(name.clone()))?;
            let value = secret
                .data
                .as_ref()
                .and_then(|d| d.get(&secret_ref.key))
                .and_then(|v| String::from_utf8(v.0.clone()).ok())
                .ok_or_else(|| CosmosError::SecretKeyMissing {
                    secret: name,
                    key: secret_ref.key.clone(),
                })?;
            args.auth = Auth::Key;
            args.key = Some(value);
        }
        // One client per account and credential: queues of one account share its connections
        // and metadata caches. The map is keyed by a hash; the key itself is not kept there.
        let fingerprint = {
            use std::hash::{Hash, Hasher};
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            (&args.endpoint, &args.key).hash(&mut hasher);
            hasher.finish()
        };
        if let Some(client) = self.clients.lock().await.get(&fingerprint) {
            return Ok(client.clone());
        }
        let client = args.connect().await?;
        self.clients
            .lock()
            .await
            .insert(fingerprint, client.clone());
        Ok(client)
    }

    /// The queue's engine handle; its containers must exist.
    pub async fn queue(&self, cq: &CosmosQueue) -> Result<Queue, CosmosError> {
        let key = Self::key(cq);
        let generation = cq.metadata.generation;
        if let Some((seen, queue)) = self.queues.lock().await.get(&key) {
            if *seen == generation {
                return Ok(queue.clone());
            }
        }
        let config = queue_config(&cq.spec)?;
        let client = self.connect(cq).await?;
        let queue = Queue::open(&client, config).await?;
        self.queues
            .lock()
            .await
            .insert(key, (generation, queue.clone()));
        Ok(queue)
    }

    /// Creates what the queue needs (database, containers) and opens it.
    pub async fn provision(
        &self,
        cq: &CosmosQueue,
    ) -> Result<(Queue, cosmosq_queue::provision::Provisioned), CosmosError> {
        let config = queue_config(&cq.spec)?;
        let client = self.connect(cq).await?;
        let (queue, provisioned) = cosmosq_queue::provision::provision(&client, &config).await?;
        self.queues
            .lock()
            .await
            .insert(Self::key(cq), (cq.metadata.generation, queue.clone()));
        Ok((queue, provisioned))
    }

    /// Deletes the queue's containers (deletion policy `Delete`).
    pub async fn deprovision(&self, cq: &CosmosQueue) -> Result<(), CosmosError> {
        let config = queue_config(&cq.spec)?;
        let client = self.connect(cq).await?;
        self.forget(cq).await;
        Ok(cosmosq_queue::provision::deprovision(&client, &config).await?)
    }

    /// Drops the open handle, so the next use re-reads the Secret (a rotated key gets a new
    /// client; the account's client stays shared).
    pub async fn forget(&self, cq: &CosmosQueue) {
        self.queues.lock().await.remove(&Self::key(cq));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(extra: serde_json::Value) -> CosmosQueueSpec {
        let mut base = json!({
            "endpoint": "https://acct.documents.azure.com:443/",
            "credentials": {"secretKeyRef": {"name": "k"}},
            "database": "shop", "container": "orders"
        });
        base.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        serde_json::from_value(base).unwrap()
    }

    #[test]
    fn queue_settings_follow_the_spec() {
        let config = queue_config(&spec(json!({
            "retention": "2d", "partitionKeyPath": "/tenant",
            "throughput": {"mode": "Autoscale", "requestUnits": 4000}
        })))
        .unwrap();
        assert_eq!(config.retention, Some(Duration::from_secs(2 * 86_400)));
        assert_eq!(config.partition_key_path, "/tenant");
        assert_eq!(config.throughput, Some(Throughput::Autoscale(4000)));
        assert_eq!(config.lease_container_name(), "orders-leases");
    }

    #[test]
    fn an_unparsable_retention_names_the_field() {
        let err = queue_config(&spec(json!({"retention": "5x"}))).unwrap_err();
        assert!(err.to_string().starts_with("spec.retention:"), "{err}");
        assert!(err.is_spec_error());
    }

    #[test]
    fn group_settings_follow_the_spec() {
        let qcg: QueueConsumerGroup = serde_json::from_value(json!({
            "apiVersion": "cosmosq.io/v1alpha1", "kind": "QueueConsumerGroup",
            "metadata": {"name": "billing", "namespace": "shop"},
            "spec": {"queueRef": {"name": "orders"}, "template": {}, "app": {"port": 8080},
                     "deliveryMode": "stream", "startFrom": "beginning", "ordered": true,
                     "lockDuration": "90s",
                     "retry": {"maxDeliveryAttempts": 3, "initialBackoff": "2s", "maxBackoff": "1m"}}
        }))
        .unwrap();
        let config = group_config(&qcg).unwrap();
        assert_eq!(config.name, "billing");
        assert_eq!(config.mode, config::DeliveryMode::Stream);
        assert_eq!(config.start_from, config::StartFrom::Beginning);
        assert!(config.ordered);
        assert_eq!(config.lock_duration, Duration::from_secs(90));
        assert_eq!(config.retry.max_delivery_attempts, 3);
        assert_eq!(config.retry.max_backoff, Duration::from_secs(60));
    }
}
