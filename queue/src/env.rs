//! The environment of the sidecar (and of every cosmosq program, for the connection):
//! the operator sets these variables on the sidecar container and the sidecar reads them, so
//! both name them from here. `tests/it/contract.rs` checks that what one writes the other
//! parses.

/// The account endpoint.
pub const ENDPOINT: &str = "COSMOSQ_ENDPOINT";
/// How to authenticate: `key`, `identity` or `emulator`.
pub const AUTH: &str = "COSMOSQ_AUTH";
/// The account key itself (prefer [`KEY_FILE`]).
pub const KEY: &str = "COSMOSQ_KEY";
/// A file holding the account key (a mounted Secret).
pub const KEY_FILE: &str = "COSMOSQ_KEY_FILE";
/// The preferred Azure region.
pub const REGION: &str = "COSMOSQ_REGION";
/// The database.
pub const DATABASE: &str = "COSMOSQ_DATABASE";
/// The messages container: the queue.
pub const QUEUE: &str = "COSMOSQ_QUEUE";
/// The messages container's partition key path (used when it is created).
pub const PARTITION_KEY_PATH: &str = "COSMOSQ_PARTITION_KEY_PATH";
/// The consumer group.
pub const GROUP: &str = "COSMOSQ_GROUP";
/// `exclusive` or `stream`.
pub const DELIVERY_MODE: &str = "COSMOSQ_DELIVERY_MODE";
/// `lease` or `claims`: how an exclusive group records deliveries.
pub const EXCLUSIVE_WRITES: &str = "COSMOSQ_EXCLUSIVE_WRITES";
/// `now` or `beginning`.
pub const START_FROM: &str = "COSMOSQ_START_FROM";
/// FIFO per partition key: `true` or `false`.
pub const ORDERED: &str = "COSMOSQ_ORDERED";
/// The app's port on localhost.
pub const APP_PORT: &str = "COSMOSQ_APP_PORT";
/// The path messages are posted to.
pub const APP_PATH: &str = "COSMOSQ_APP_PATH";
/// `cloudevents` or `raw`.
pub const APP_FORMAT: &str = "COSMOSQ_APP_FORMAT";
/// `push` (deliveries posted to the app) or `pull` (workers receive through the API).
pub const APP_MODE: &str = "COSMOSQ_APP_MODE";
/// How the app is called: `http` or `grpc` (Dapr's `AppCallback`).
pub const APP_PROTOCOL: &str = "COSMOSQ_APP_PROTOCOL";
/// How long the app may take for one message.
pub const APP_TIMEOUT: &str = "COSMOSQ_APP_TIMEOUT";
/// The app's readiness path (a TCP connect when unset).
pub const APP_HEALTH_PATH: &str = "COSMOSQ_APP_HEALTH_PATH";
/// A declared subscription: one entry of Dapr's `GET /dapr/subscribe` answer, as JSON.
pub const APP_SUBSCRIPTION: &str = "COSMOSQ_APP_SUBSCRIPTION";
/// Other queues the app may publish to: a JSON list of `{database, queue, endpoint, auth,
/// keyFile}`.
pub const PUBLISH_TO: &str = "COSMOSQ_PUBLISH_TO";
/// Dapr's gRPC API, on a loopback address (empty: not served).
pub const GRPC_LISTEN: &str = "COSMOSQ_GRPC_LISTEN";
/// Deliveries in flight at most.
pub const MAX_CONCURRENCY: &str = "COSMOSQ_MAX_CONCURRENCY";
/// Deliveries before a message is dead-lettered.
pub const MAX_DELIVERY_ATTEMPTS: &str = "COSMOSQ_MAX_DELIVERY_ATTEMPTS";
/// Back-off after the first failure.
pub const RETRY_INITIAL_BACKOFF: &str = "COSMOSQ_RETRY_INITIAL_BACKOFF";
/// The longest back-off.
pub const RETRY_MAX_BACKOFF: &str = "COSMOSQ_RETRY_MAX_BACKOFF";
/// How long a claim is exclusive without renewal.
pub const LOCK_DURATION: &str = "COSMOSQ_LOCK_DURATION";
/// How often leases are renewed.
pub const LEASE_RENEW: &str = "COSMOSQ_LEASE_RENEW";
/// Exclusive groups on the lease write path: how long a delivery runs before it gets a lock
/// of its own.
pub const PROMOTE_AFTER: &str = "COSMOSQ_PROMOTE_AFTER";
/// How often free and expired leases are looked for.
pub const LEASE_ACQUIRE: &str = "COSMOSQ_LEASE_ACQUIRE";
/// How long an unrenewed lease stays its owner's.
pub const LEASE_EXPIRE: &str = "COSMOSQ_LEASE_EXPIRE";
/// Leases per physical partition when a group's leases are created.
pub const LEASES_PER_PARTITION: &str = "COSMOSQ_LEASES_PER_PARTITION";
/// The longest wait between reads of an empty feed.
pub const MAX_POLL: &str = "COSMOSQ_MAX_POLL";
/// How often a range resting on its partition's probe reads its feed by itself.
pub const IDLE_READ: &str = "COSMOSQ_IDLE_READ";
/// Exclusive groups: how often a range writes what it started and completed (its window) while
/// something waits to be written; stream groups: how often a moved checkpoint is written.
pub const CHECKPOINT_INTERVAL: &str = "COSMOSQ_CHECKPOINT_INTERVAL";
/// How often expired locks and due retries are swept.
pub const SWEEP_INTERVAL: &str = "COSMOSQ_SWEEP_INTERVAL";
/// The localhost API's address (enqueue, health, metrics).
pub const LISTEN: &str = "COSMOSQ_LISTEN";
/// The probes' and metrics' address the kubelet reaches.
pub const PROBE_LISTEN: &str = "COSMOSQ_PROBE_LISTEN";
/// How long a drain may take after SIGTERM.
pub const GRACE_PERIOD: &str = "COSMOSQ_GRACE_PERIOD";
/// This pod's name (downward API): the owner in leases and locks.
pub const POD_NAME: &str = "POD_NAME";
/// This pod's namespace (downward API).
pub const POD_NAMESPACE: &str = "POD_NAMESPACE";
/// Whether the sidecar sets its pod's deletion cost.
pub const POD_DELETION_COST: &str = "COSMOSQ_POD_DELETION_COST";
/// What the app must present to the sidecar's API (`dapr-api-token`); the app's containers
/// get it as Dapr's `DAPR_API_TOKEN`.
pub const API_TOKEN: &str = "COSMOSQ_API_TOKEN";
/// What the sidecar presents to the app (`dapr-api-token`); the app's containers get it as
/// Dapr's `APP_API_TOKEN`.
pub const APP_API_TOKEN: &str = "COSMOSQ_APP_API_TOKEN";
