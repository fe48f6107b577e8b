//! Creates what a queue needs, leaving whatever already exists alone.

use azure_data_cosmos::models::{
    ContainerProperties, IndexingPolicy, PartitionKeyDefinition, PropertyPath,
    ThroughputProperties, TimeToLive,
};
use azure_data_cosmos::options::CreateContainerOptions;
use azure_data_cosmos::CosmosClient;
use serde_json::json;
use tracing::{debug, info};

use crate::config::{QueueConfig, Throughput};
use crate::error::{status_of, QueueError, Result, CONFLICT, NOT_FOUND};
use crate::queue::Queue;

/// What provisioning did, for status and Events.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Provisioned {
    /// The database was created (it did not exist).
    pub created_database: bool,
    /// The messages container was created.
    pub created_messages_container: bool,
    /// The lease container was created.
    pub created_lease_container: bool,
}

/// Creates the database, the messages container and the lease container if missing, then
/// opens the queue. Existing resources are not modified (their settings are the owner's).
pub async fn provision(
    client: &CosmosClient,
    config: &QueueConfig,
) -> Result<(Queue, Provisioned)> {
    config.validate()?;
    let created_database = match client.create_database(&config.database, None).await {
        Ok(_) => true,
        Err(e) if status_of(&e) == CONFLICT => false,
        Err(e) => return Err(QueueError::cosmos("create database")(e)),
    };
    let db = client.database_client(config.database.as_str());

    let mut options = CreateContainerOptions::default();
    if let Some(throughput) = config.throughput {
        options = options.with_throughput(match throughput {
            Throughput::Manual(ru) => ThroughputProperties::manual(u64::from(ru)),
            Throughput::Autoscale(ru) => ThroughputProperties::autoscale(u64::from(ru), None),
        });
    }
    let created_messages_container =
        create_container(&db, messages_container(config), Some(options)).await?;
    let created_lease_container = create_container(&db, lease_container(config), None).await?;
    if !created_lease_container {
        index_lease_container(&db, config).await?;
    }
    let provisioned = Provisioned {
        created_database,
        created_messages_container,
        created_lease_container,
    };
    info!(
        database = %config.database,
        container = %config.container,
        lease_container = %config.lease_container_name(),
        ?provisioned,
        "queue provisioned"
    );
    Ok((open_created(client, config).await?, provisioned))
}

/// Opens a queue whose containers were just created or found. The SDK shares one metadata
/// lookup per container among its callers: one begun before the create (the operator's
/// scaling loop opening the queue of a group) answers this open with its 404. Its failure
/// leaves the cache, so the next lookup is a new one, sent after the create.
async fn open_created(client: &CosmosClient, config: &QueueConfig) -> Result<Queue> {
    let mut stale = 0;
    loop {
        match Queue::open(client, config.clone()).await {
            Err(e) if e.status() == Some(NOT_FOUND) && stale < 2 => {
                stale += 1;
                debug!(container = %config.container, "a lookup from before the create answered 404; looking again");
            }
            opened => return opened,
        }
    }
}

/// Deletes the messages container and the lease container (the database may hold other
/// queues and stays). Containers already gone count as deleted.
pub async fn deprovision(client: &CosmosClient, config: &QueueConfig) -> Result<()> {
    config.validate()?;
    let db = client.database_client(config.database.as_str());
    for name in [config.container.clone(), config.lease_container_name()] {
        let container = match db.container_client(name.as_str(), None).await {
            Ok(c) => c,
            Err(e) if status_of(&e) == NOT_FOUND => continue,
            Err(e) => return Err(QueueError::cosmos("open container")(e)),
        };
        match container.delete(None).await {
            Ok(_) => info!(database = %config.database, container = %name, "container deleted"),
            Err(e) if status_of(&e) == NOT_FOUND => {}
            Err(e) => return Err(QueueError::cosmos("delete container")(e)),
        }
    }
    Ok(())
}

/// What [`verify`] found missing or unlike what the engine needs, said so that whoever creates
/// the queue's containers (an admin with `az` or Bicep) knows what to do.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Shortfall {
    /// The database does not exist.
    #[error("database {0} does not exist")]
    Database(String),
    /// A container does not exist.
    #[error("container {name} does not exist (partition key {partition_key})")]
    Container {
        /// The container.
        name: String,
        /// The partition key path it needs.
        partition_key: String,
    },
    /// A container is partitioned on another path.
    #[error("container {name} is partitioned on {found}, not {needed}")]
    PartitionKey {
        /// The container.
        name: String,
        /// Its partition key paths.
        found: String,
        /// The path the queue needs.
        needed: String,
    },
    /// Time to live is off (or on without the default the retention needs): what should
    /// expire never does.
    #[error("container {name} has no time to live for them ({what} would never expire)")]
    TimeToLive {
        /// The container.
        name: String,
        /// What would be kept for ever.
        what: &'static str,
    },
    /// A path the engine filters or sorts on is not indexed (its queries would fail).
    #[error("container {name} does not index {path}")]
    Index {
        /// The container.
        name: String,
        /// The path.
        path: String,
    },
}

/// Checks, creating nothing, that the database and both containers exist as the engine needs
/// them (partition keys, time to live, the indexed paths), and opens the queue when they do.
/// This is what an Entra identity can do: Cosmos DB's data-plane roles read metadata but do
/// not cover creating or deleting databases and containers.
pub async fn verify(
    client: &CosmosClient,
    config: &QueueConfig,
) -> Result<std::result::Result<Queue, Vec<Shortfall>>> {
    config.validate()?;
    let db = client.database_client(config.database.as_str());
    match db.read(None).await {
        Ok(_) => {}
        Err(e) if status_of(&e) == NOT_FOUND => {
            return Ok(Err(vec![Shortfall::Database(config.database.clone())]))
        }
        Err(e) => return Err(QueueError::cosmos("read database")(e)),
    }
    let mut shortfalls = Vec::new();
    for (needed, what) in [
        (messages_container(config), "messages"),
        (lease_container(config), "settled message states"),
    ] {
        let found = match db.container_client(needed.id.as_ref(), None).await {
            Ok(container) => container
                .read(None)
                .await
                .map_err(QueueError::cosmos("read container"))?
                .into_model()
                .map_err(QueueError::cosmos("read container"))?,
            Err(e) if status_of(&e) == NOT_FOUND => {
                shortfalls.push(Shortfall::Container {
                    name: needed.id.to_string(),
                    partition_key: needed.partition_key.paths().join(","),
                });
                continue;
            }
            Err(e) => return Err(QueueError::cosmos("open container")(e)),
        };
        shortfalls.extend(compare(&needed, &found, what));
    }
    if !shortfalls.is_empty() {
        return Ok(Err(shortfalls));
    }
    Ok(Ok(Queue::open(client, config.clone()).await?))
}

/// How `found` falls short of `needed` (pure): other settings (throughput, more indexed
/// paths, another default TTL) are the owner's choice.
fn compare(
    needed: &ContainerProperties,
    found: &ContainerProperties,
    what: &'static str,
) -> Vec<Shortfall> {
    let name = needed.id.to_string();
    let mut shortfalls = Vec::new();
    if found.partition_key.paths() != needed.partition_key.paths() {
        shortfalls.push(Shortfall::PartitionKey {
            name: name.clone(),
            found: found.partition_key.paths().join(","),
            needed: needed.partition_key.paths().join(","),
        });
    }
    // Off, or (where the queue's retention needs a default) on without one: what the
    // retention should drop would be kept for ever.
    let expires = match (&needed.default_ttl, &found.default_ttl) {
        (TimeToLive::Forever, _) => true,
        (_, TimeToLive::Forever) => false,
        (TimeToLive::Seconds(_), TimeToLive::NoDefault) => false,
        _ => true,
    };
    if !expires {
        shortfalls.push(Shortfall::TimeToLive {
            name: name.clone(),
            what,
        });
    }
    let needed_paths = needed
        .indexing_policy
        .iter()
        .flat_map(|p| p.included_paths.iter().map(|p| p.path.clone()));
    for path in needed_paths {
        if !indexes(found.indexing_policy.as_ref(), &path) {
            shortfalls.push(Shortfall::Index {
                name: name.clone(),
                path,
            });
        }
    }
    shortfalls
}

/// Whether `policy` indexes `path` (a `/a/?` scalar path): explicitly, or through `/*` without
/// excluding it. No policy is the service's default, which indexes everything.
fn indexes(policy: Option<&IndexingPolicy>, path: &str) -> bool {
    let Some(policy) = policy else {
        return true;
    };
    if policy.indexing_mode == Some(azure_data_cosmos::models::IndexingMode::None) {
        return false;
    }
    let listed = |paths: &[PropertyPath], p: &str| paths.iter().any(|x| x.path == p);
    let prefix = path.trim_end_matches("/?");
    let excluded = listed(&policy.excluded_paths, path)
        || listed(&policy.excluded_paths, &format!("{prefix}/*"));
    listed(&policy.included_paths, path)
        || (!excluded
            && (policy.included_paths.is_empty() || listed(&policy.included_paths, "/*"))
            && !listed(&policy.excluded_paths, "/*"))
}

/// Indexed so each host's sweep of the ranges it owns is an index seek (added later than the
/// others: lease containers created before it get it at the next provisioning).
const EPK_INDEX_PATH: &str = "/epk/?";

/// Adds what a lease container created by an earlier version does not index yet. Cosmos DB
/// rebuilds the index online; queries work meanwhile.
async fn index_lease_container(
    db: &azure_data_cosmos::DatabaseClient,
    config: &QueueConfig,
) -> Result<()> {
    let name = config.lease_container_name();
    let container = db
        .container_client(name.as_str(), None)
        .await
        .map_err(QueueError::cosmos("open lease container"))?;
    let mut properties: ContainerProperties = container
        .read(None)
        .await
        .map_err(QueueError::cosmos("read lease container"))?
        .into_model()
        .map_err(QueueError::cosmos("read lease container"))?;
    let Some(policy) = properties.indexing_policy.as_mut() else {
        return Ok(()); // the service's default policy indexes every path
    };
    let excludes_all = policy.excluded_paths.iter().any(|p| p.path == "/*");
    if !excludes_all
        || policy
            .included_paths
            .iter()
            .any(|p| p.path == EPK_INDEX_PATH)
    {
        return Ok(());
    }
    policy
        .included_paths
        .push(PropertyPath::default().with_path(EPK_INDEX_PATH));
    container
        .replace(properties, None)
        .await
        .map_err(QueueError::cosmos("index lease container"))?;
    info!(database = %config.database, container = %name, path = EPK_INDEX_PATH, "lease container index extended");
    Ok(())
}

async fn create_container(
    db: &azure_data_cosmos::DatabaseClient,
    properties: ContainerProperties,
    options: Option<CreateContainerOptions>,
) -> Result<bool> {
    match db.create_container(properties, options).await {
        Ok(_) => Ok(true),
        Err(e) if status_of(&e) == CONFLICT => Ok(false),
        Err(e) => Err(QueueError::cosmos("create container")(e)),
    }
}

pub(crate) fn hash_key(path: &str) -> PartitionKeyDefinition {
    serde_json::from_value(json!({"paths": [path], "kind": "Hash", "version": 2}))
        .expect("a hash partition key definition is valid")
}

/// Messages: default TTL = retention; only the enqueue time is indexed, so bodies of any
/// shape cost nothing to index and writes stay cheap.
pub fn messages_container(config: &QueueConfig) -> ContainerProperties {
    let indexing: IndexingPolicy = serde_json::from_value(json!({
        "indexingMode": "consistent",
        "automatic": true,
        "includedPaths": [{"path": "/enqueuedAt/?"}],
        "excludedPaths": [{"path": "/*"}]
    }))
    .expect("indexing policy is valid");
    let ttl = match config.retention_secs() {
        Some(secs) => TimeToLive::Seconds(u32::try_from(secs).unwrap_or(u32::MAX)),
        None => TimeToLive::NoDefault,
    };
    ContainerProperties::new(
        config.container.clone(),
        hash_key(&config.partition_key_path),
    )
    .with_indexing_policy(indexing)
    .with_default_ttl(ttl)
}

/// Leases and per-group message state: TTL enabled per item (state documents expire with the
/// message they describe; leases never do); the fields the engine filters on are indexed.
pub fn lease_container(config: &QueueConfig) -> ContainerProperties {
    let indexing: IndexingPolicy = serde_json::from_value(json!({
        "indexingMode": "consistent",
        "automatic": true,
        "includedPaths": [
            {"path": "/type/?"}, {"path": "/group/?"}, {"path": "/state/?"},
            {"path": "/due/?"}, {"path": "/enqueuedAt/?"}, {"path": EPK_INDEX_PATH}
        ],
        "excludedPaths": [{"path": "/*"}]
    }))
    .expect("indexing policy is valid");
    ContainerProperties::new(config.lease_container_name(), hash_key("/pk"))
        .with_indexing_policy(indexing)
        .with_default_ttl(TimeToLive::NoDefault)
}
