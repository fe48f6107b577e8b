//! The environment of the sidecar (and of every cosmosq program, for the connection):
//! the operator sets these variables on the sidecar container and the sidecar reads them, so
//! both name them from here. `tests/it/contract.rs` checks that what one writes the other
//! parses.

pub const ENDPOINT: &str = "COSMOSQ_ENDPOINT";
pub const AUTH: &str = "COSMOSQ_AUTH";
pub const KEY: &str = "COSMOSQ_KEY";
pub const KEY_FILE: &str = "COSMOSQ_KEY_FILE";
pub const REGION: &str = "COSMOSQ_REGION";
pub const DATABASE: &str = "COSMOSQ_DATABASE";
pub const QUEUE: &str = "COSMOSQ_QUEUE";
pub const PARTITION_KEY_PATH: &str = "COSMOSQ_PARTITION_KEY_PATH";
pub const GROUP: &str = "COSMOSQ_GROUP";
pub const DELIVERY_MODE: &str = "COSMOSQ_DELIVERY_MODE";
pub const START_FROM: &str = "COSMOSQ_START_FROM";
pub const ORDERED: &str = "COSMOSQ_ORDERED";
pub const APP_PORT: &str = "COSMOSQ_APP_PORT";
pub const APP_PATH: &str = "COSMOSQ_APP_PATH";
pub const APP_FORMAT: &str = "COSMOSQ_APP_FORMAT";
pub const APP_TIMEOUT: &str = "COSMOSQ_APP_TIMEOUT";
pub const APP_HEALTH_PATH: &str = "COSMOSQ_APP_HEALTH_PATH";
pub const MAX_CONCURRENCY: &str = "COSMOSQ_MAX_CONCURRENCY";
pub const MAX_DELIVERY_ATTEMPTS: &str = "COSMOSQ_MAX_DELIVERY_ATTEMPTS";
pub const RETRY_INITIAL_BACKOFF: &str = "COSMOSQ_RETRY_INITIAL_BACKOFF";
pub const RETRY_MAX_BACKOFF: &str = "COSMOSQ_RETRY_MAX_BACKOFF";
pub const LOCK_DURATION: &str = "COSMOSQ_LOCK_DURATION";
pub const LEASE_RENEW: &str = "COSMOSQ_LEASE_RENEW";
pub const LEASE_ACQUIRE: &str = "COSMOSQ_LEASE_ACQUIRE";
pub const LEASE_EXPIRE: &str = "COSMOSQ_LEASE_EXPIRE";
pub const LEASES_PER_PARTITION: &str = "COSMOSQ_LEASES_PER_PARTITION";
pub const MAX_POLL: &str = "COSMOSQ_MAX_POLL";
pub const SWEEP_INTERVAL: &str = "COSMOSQ_SWEEP_INTERVAL";
pub const LISTEN: &str = "COSMOSQ_LISTEN";
pub const PROBE_LISTEN: &str = "COSMOSQ_PROBE_LISTEN";
pub const GRACE_PERIOD: &str = "COSMOSQ_GRACE_PERIOD";
pub const POD_NAME: &str = "POD_NAME";
pub const POD_NAMESPACE: &str = "POD_NAMESPACE";
pub const POD_DELETION_COST: &str = "COSMOSQ_POD_DELETION_COST";
