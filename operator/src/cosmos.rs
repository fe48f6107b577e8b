//! The Cosmos DB side of the operator: the engine's settings from the resources (pure), and
//! connections per queue — the account key read from the queue's Secret on demand (never
//! cached on disk, never logged), or the operator's own Entra identity; where an admin gave
//! the operator a management scope for the account, that identity creates and deletes an
//! identity queue's containers through Azure Resource Manager (`arm`).

use std::collections::HashMap;
use std::sync::Arc;

use cosmosq_crds::CosmosQueue;
use cosmosq_queue::cosmos::provision::{self, Provisioned, Shortfall};
use cosmosq_queue::{Auth, ConnectionArgs, CosmosClient, Queue, QueueError};
use k8s_openapi::api::core::v1::Secret;
use kube::{Api, ResourceExt};
use tokio::sync::{Mutex, OnceCell};

use crate::arm::{AccountId, Arm, ArmError, ManagementScope};
use crate::grants::IdentityGrant;
use crate::spec::{self, SpecError};

/// What connecting to a queue's account can meet.
#[derive(Debug, thiserror::Error)]
pub enum CosmosError {
    /// The spec cannot be used.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// The operator does not dial that endpoint.
    #[error(transparent)]
    Endpoint(#[from] crate::endpoint::EndpointError),
    /// The key's Secret does not exist.
    #[error("spec.credentials.secretKeyRef: Secret {0} not found")]
    SecretNotFound(String),
    /// The operator may not read it: in a namespace being deleted, the Role that let it (with
    /// `watchNamespace`) may already be gone.
    #[error("spec.credentials.secretKeyRef: Secret {0} may not be read by the operator")]
    SecretForbidden(String),
    /// The Secret has no such key.
    #[error("spec.credentials.secretKeyRef: Secret {secret} has no key {key:?}")]
    SecretKeyMissing {
        /// The Secret (`namespace/name`).
        secret: String,
        /// The key looked for.
        key: String,
    },
    /// The namespace may not use the operator's own identity on that account's database.
    #[error(
        "spec.credentials.workloadIdentity: namespace {namespace} is not granted the operator's \
         identity on database {database} of {endpoint} (an admin grants it with \
         --identity-grant, the chart's workloadIdentity.grants; or use a key Secret of this \
         namespace)"
    )]
    IdentityNotGranted {
        /// The queue's namespace.
        namespace: String,
        /// The account.
        endpoint: String,
        /// The database.
        database: String,
    },
    /// The queue's identity may not create its containers, or (through ARM) may create only
    /// what is missing, and they are not all there as the engine needs them.
    #[error("{}; {}", shortfalls.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "),
        if *through_arm {
            "the operator creates missing databases and containers through Azure Resource \
             Manager but never changes existing ones: an admin changes them (docs/identity.md), \
             or deletes them for the operator to create"
        } else {
            "the operator's Entra identity may not create or change databases and containers \
             (Cosmos DB's data-plane roles do not cover them): an admin creates them as \
             docs/identity.md shows, gives the operator a management scope for the account, \
             or the queue uses a key Secret"
        })]
    NeedsProvisioning {
        /// What is missing or unlike what the engine needs.
        shortfalls: Vec<Shortfall>,
        /// Whether the operator provisions this account through ARM (what it could create,
        /// it did).
        through_arm: bool,
    },
    /// Azure Resource Manager did not create or delete them. Said with ARM's status code and
    /// request ids only.
    #[error(transparent)]
    Arm(#[from] ArmError),
    /// Reading the Secret failed.
    #[error("reading Secret {secret}: {source}")]
    Secret {
        /// The Secret (`namespace/name`).
        secret: String,
        /// The API server's error.
        source: kube::Error,
    },
    /// The queue asks for more throughput than the admin lets the operator create through ARM.
    #[error(
        "spec.throughput: {requested} RU/s is more than the operator may create through Azure \
         Resource Manager on this account ({}); the account's admin pays for it: lower it, \
         remove it (the account's default), or ask the admin (--arm-max-throughput, the chart's \
         workloadIdentity.maxThroughput) or to create the containers",
        match .allowed { Some(ru) => format!("at most {ru} RU/s"), None => "none may be asked for".to_owned() }
    )]
    ThroughputNotAllowed {
        /// What the queue asks for.
        requested: u32,
        /// The admin's ceiling.
        allowed: Option<u32>,
    },
    /// The engine failed. Said without what the endpoint answered: this text reaches the
    /// resource's status and Events.
    #[error("{}", .0.without_answer())]
    Queue(#[from] QueueError),
}

impl CosmosError {
    /// Errors only the resource's owner can fix: retrying does not help until it changes.
    pub fn is_spec_error(&self) -> bool {
        matches!(
            self,
            CosmosError::Spec(_)
                | CosmosError::Endpoint(_)
                | CosmosError::SecretNotFound(_)
                | CosmosError::SecretKeyMissing { .. }
                | CosmosError::IdentityNotGranted { .. }
                | CosmosError::ThroughputNotAllowed { .. }
        )
    }

    /// Errors retrying does not get past: the spec's, a Secret the operator may not read, and
    /// an account refusing the credentials (401/403) until a key or a role assignment changes,
    /// and ARM's answers no retry gets past (a bad request, a failed operation). The operator
    /// still retries these now and then; kstatus readers see `Stalled`.
    pub fn is_stalled(&self) -> bool {
        self.is_spec_error()
            || matches!(
                self,
                CosmosError::SecretForbidden(_)
                    | CosmosError::NeedsProvisioning { .. }
                    | CosmosError::Queue(QueueError::Cosmos {
                        status: 401 | 403,
                        ..
                    })
            )
            || matches!(self, CosmosError::Arm(e) if e.is_permanent())
    }

    /// Whether the account refuses the operator's credentials for this queue (401/403 from
    /// the data plane or ARM): a deletion that no retry gets past.
    pub fn is_refused(&self) -> bool {
        matches!(
            self,
            CosmosError::Queue(QueueError::Cosmos {
                status: 401 | 403,
                ..
            })
        ) || matches!(self, CosmosError::Arm(e) if e.keeps_containers())
    }
}

/// Whether the queue's namespace is granted the operator's identity on its database (pure).
fn granted(grants: &[crate::grants::IdentityGrant], cq: &CosmosQueue) -> Result<(), CosmosError> {
    let namespace = cq.namespace().unwrap_or_default();
    if crate::grants::identity_allowed(grants, &namespace, &cq.spec.endpoint, &cq.spec.database) {
        return Ok(());
    }
    Err(CosmosError::IdentityNotGranted {
        namespace,
        endpoint: cq.spec.endpoint.clone(),
        database: cq.spec.database.clone(),
    })
}

/// How a queue's database and containers come to exist.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Provisioning {
    /// The operator creates what is missing: a key Secret is the account's key, which may.
    Create,
    /// An admin creates them; the operator checks. An Entra identity has data-plane roles
    /// only, and those do not cover creating or deleting databases and containers.
    Verify,
    /// The operator's identity creates what is missing through Azure Resource Manager (never
    /// changing what exists) and deletes the containers there: an admin gave the operator a
    /// management scope for the account (`--identity-management`).
    Arm,
}

impl Provisioning {
    /// The queue's provisioning, from its credentials and the accounts the operator may
    /// manage (pure). Whether the namespace may use the identity at all is the grants'.
    pub fn of(cq: &CosmosQueue, scopes: &[ManagementScope]) -> Self {
        if cq.spec.credentials.secret_key_ref.is_some() {
            Provisioning::Create
        } else if crate::arm::scope::account_for(scopes, &cq.spec.endpoint).is_some() {
            Provisioning::Arm
        } else {
            Provisioning::Verify
        }
    }
}

/// Where and for whom the operator's identity works through Azure Resource Manager. Kept
/// apart from [`Backend`]: tests pair it with the emulator's data plane.
pub struct Management {
    /// Who may use the operator's identity: checked here again, before any ARM request,
    /// whatever the backend.
    pub grants: Vec<IdentityGrant>,
    /// The accounts the operator may manage, by endpoint.
    pub scopes: Vec<ManagementScope>,
    /// The client, as the operator's identity.
    pub arm: Arm,
    /// The most request units per second a queue may ask of a container the operator creates
    /// through ARM (`spec.throughput`, manual or the autoscale maximum): the account's admin
    /// pays for them. `None`: a queue there may not ask for any (the account's default).
    pub max_throughput: Option<u32>,
}

/// Where queues live.
#[derive(Clone)]
pub enum Backend {
    /// Each queue's own account, with its credentials (production); the operator's own
    /// identity only where `identity_grants` allow it.
    Azure {
        /// The Azure region the operator runs in (reads go there first).
        region: String,
        /// Who may use the operator's own identity.
        identity_grants: Vec<crate::grants::IdentityGrant>,
        /// The endpoints it dials.
        endpoints: crate::endpoint::EndpointPolicy,
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
    /// One cell per account and credential, filled once: the reconciles of 50 queues of one
    /// account starting together would otherwise each build a client (its HTTP pools, its
    /// copy of the trust roots) and keep it in their queue's handle.
    clients: Mutex<HashMap<u64, Arc<OnceCell<CosmosClient>>>>,
    /// Creating and deleting identity queues' containers through ARM, where configured.
    management: Option<Management>,
}

impl Cosmos {
    /// No queue open yet.
    pub fn new(backend: Backend, client: kube::Client) -> Self {
        Self {
            backend,
            client,
            queues: Mutex::default(),
            clients: Mutex::default(),
            management: None,
        }
    }

    /// Also provisions identity queues through ARM on the accounts `management` names.
    pub fn with_management(mut self, management: Management) -> Self {
        self.management = Some(management);
        self
    }

    fn provisioning(&self, cq: &CosmosQueue) -> Provisioning {
        let scopes = self.management.as_ref().map_or(&[][..], |m| &m.scopes[..]);
        Provisioning::of(cq, scopes)
    }

    /// The ARM client and the account for a queue provisioned through ARM, once its namespace
    /// is found granted the identity on its database.
    fn arm_for(&self, cq: &CosmosQueue) -> Result<(&Arm, &AccountId), CosmosError> {
        let management = self
            .management
            .as_ref()
            .expect("Provisioning::Arm comes from a management scope");
        granted(&management.grants, cq)?;
        let account = crate::arm::scope::account_for(&management.scopes, &cq.spec.endpoint)
            .expect("Provisioning::Arm comes from a management scope");
        Ok((&management.arm, account))
    }

    /// Whether the queue's throughput is within what the admin lets the operator create
    /// through ARM (pure but for the setting).
    fn throughput_allowed(&self, config: &cosmosq_queue::QueueConfig) -> Result<(), CosmosError> {
        let allowed = self.management.as_ref().and_then(|m| m.max_throughput);
        let requested = match config.throughput {
            None => return Ok(()),
            Some(
                cosmosq_queue::Throughput::Manual(ru) | cosmosq_queue::Throughput::Autoscale(ru),
            ) => ru,
        };
        match allowed {
            Some(ceiling) if requested <= ceiling => Ok(()),
            _ => Err(CosmosError::ThroughputNotAllowed { requested, allowed }),
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
                endpoints,
            } => {
                // Before anything is read or signed for it.
                endpoints.check(&cq.spec.endpoint)?;
                (region.clone(), identity_grants)
            }
        };
        if cq.spec.credentials.secret_key_ref.is_none() {
            granted(grants, cq)?;
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
        let cell = self
            .clients
            .lock()
            .await
            .entry(fingerprint)
            .or_default()
            .clone();
        // A failed connect leaves the cell empty: the next reconcile tries again.
        Ok(cell.get_or_try_init(|| args.connect()).await?.clone())
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
        let config = spec::queue(&cq.spec)?;
        let client = self.connect(cq).await?;
        let queue = Queue::open(&client, config).await?;
        self.queues
            .lock()
            .await
            .insert(key, (generation, queue.clone()));
        Ok(queue)
    }

    /// Creates what the queue needs (database, containers) and opens it; with the operator's
    /// identity, which may not create them, checks that they are there as the engine needs
    /// (and, with a management scope, first creates what is missing through ARM).
    pub async fn provision(&self, cq: &CosmosQueue) -> Result<(Queue, Provisioned), CosmosError> {
        let config = spec::queue(&cq.spec)?;
        let provisioning = self.provisioning(cq);
        if provisioning == Provisioning::Arm {
            // The grant first: an ungranted namespace gets nothing, not even a data-plane read.
            self.arm_for(cq)?;
        }
        let client = self.connect(cq).await?;
        let (queue, provisioned) = match provisioning {
            Provisioning::Create => provision::provision(&client, &config).await?,
            Provisioning::Verify => (
                verified(&client, &config, false).await?,
                Provisioned::default(),
            ),
            Provisioning::Arm => {
                let (arm, account) = self.arm_for(cq)?;
                match provision::verify(&client, &config).await? {
                    Ok(queue) => (queue, Provisioned::default()),
                    Err(shortfalls) => {
                        let plan =
                            crate::arm::plan(&shortfalls, &config).map_err(|shortfalls| {
                                CosmosError::NeedsProvisioning {
                                    shortfalls,
                                    through_arm: true,
                                }
                            })?;
                        if plan.messages {
                            self.throughput_allowed(&config)?;
                        }
                        let owner = cq.metadata.uid.clone().unwrap_or_default();
                        let provisioned = arm.create(account, &config, plan, &owner).await?;
                        // What ARM made, as the data plane sees it.
                        (verified(&client, &config, true).await?, provisioned)
                    }
                }
            }
        };
        self.queues
            .lock()
            .await
            .insert(Self::key(cq), (cq.metadata.generation, queue.clone()));
        Ok((queue, provisioned))
    }

    /// Deletes the queue's containers (deletion policy `Delete`): through ARM where the
    /// operator manages the account, else on the data plane.
    pub async fn deprovision(&self, cq: &CosmosQueue) -> Result<(), CosmosError> {
        let config = spec::queue(&cq.spec)?;
        if self.provisioning(cq) == Provisioning::Arm {
            let (arm, account) = self.arm_for(cq)?;
            self.forget(cq).await;
            let owner = cq.metadata.uid.clone().unwrap_or_default();
            return Ok(arm.delete(account, &config, &owner).await?);
        }
        let client = self.connect(cq).await?;
        self.forget(cq).await;
        Ok(provision::deprovision(&client, &config).await?)
    }

    /// Drops the open handle, so the next use re-reads the Secret (a rotated key gets a new
    /// client; the account's client stays shared).
    pub async fn forget(&self, cq: &CosmosQueue) {
        self.queues.lock().await.remove(&Self::key(cq));
    }
}

/// The queue, opened, if its containers are there as the engine needs them.
async fn verified(
    client: &CosmosClient,
    config: &cosmosq_queue::QueueConfig,
    through_arm: bool,
) -> Result<Queue, CosmosError> {
    provision::verify(client, config)
        .await?
        .map_err(|shortfalls| CosmosError::NeedsProvisioning {
            shortfalls,
            through_arm,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_errors_wait_for_a_change() {
        let spec = CosmosError::from(spec::invalid("spec.retention", "\"5x\": unknown unit"));
        assert!(spec.is_spec_error());
        assert!(spec.to_string().starts_with("spec.retention:"), "{spec}");
        assert!(!CosmosError::SecretForbidden("shop/k".into()).is_spec_error());
    }

    #[test]
    fn only_identity_queues_on_a_managed_account_go_through_arm() {
        let queue = |credentials: serde_json::Value, endpoint: &str| -> CosmosQueue {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "cosmosq.io/v1alpha1", "kind": "CosmosQueue",
                "metadata": {"name": "orders", "namespace": "shop"},
                "spec": {"endpoint": endpoint, "credentials": credentials,
                         "database": "shop", "container": "orders"}
            }))
            .unwrap()
        };
        let identity = serde_json::json!({"workloadIdentity": {}});
        let key = serde_json::json!({"secretKeyRef": {"name": "k"}});
        let scopes = [crate::arm::fake::scope()];
        let managed = "https://ACCT.documents.azure.com/";
        let other = "https://other.documents.azure.com:443/";
        for (credentials, endpoint, scopes, expected) in [
            (&identity, managed, &scopes[..], Provisioning::Arm),
            (&identity, other, &scopes[..], Provisioning::Verify),
            (&identity, managed, &[][..], Provisioning::Verify),
            // A key may create, and never goes through the operator's identity.
            (&key, managed, &scopes[..], Provisioning::Create),
        ] {
            let cq = queue(credentials.clone(), endpoint);
            assert_eq!(
                Provisioning::of(&cq, scopes),
                expected,
                "{credentials} {endpoint}"
            );
        }
    }
}
