//! The `cosmosq.io/v1alpha1` custom resources. The YAML in this folder is generated from these
//! types by `cargo run -p cosmosq-crds --bin crdgen` and never edited by hand; a test fails
//! when they differ.
//!
//! Validation the API server can do lives in the schema (ranges, patterns, enums, CEL rules for
//! cross-field checks), so invalid objects are rejected at `kubectl apply`.
#![forbid(unsafe_code)]
#![warn(missing_docs)]
// kube's `printcolumn(type_ = ...)` repeats keys across columns by design.
#![allow(clippy::duplicated_attributes)]

use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscalerBehavior;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, CustomResourceExt, KubeSchema};
use serde::{Deserialize, Serialize};

/// The API group of both kinds.
pub const GROUP: &str = "cosmosq.io";
/// The API version of both kinds.
pub const VERSION: &str = "v1alpha1";

fn preserve_unknown_fields(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({"type": "object", "x-kubernetes-preserve-unknown-fields": true})
}

/// A group's pod template, kept as the JSON text it arrived as and read when a Deployment is
/// built. The operator caches every group, and a template held as a tree of JSON maps costs a
/// B-tree node (≈ 600 bytes) per object in it: the operator bench's one-container template is
/// 63 bytes as text and ≈ 2 KB as maps, ≈ 10 MB over 5,000 groups (≈ 16 MB at the heap's peak,
/// which held about 8,700 copies of groups). Any JSON (what is not a pod template is the
/// builder's error to report, with its path).
#[derive(Clone, PartialEq, Eq)]
pub struct Template(std::sync::Arc<str>);

impl Template {
    /// The template as JSON. Fails only where the text does not parse back: nested deeper
    /// than the JSON reader allows (128 levels), which a template read from the API server
    /// never is (it was read with that same limit).
    pub fn value(&self) -> Result<serde_json::Value, serde_json::Error> {
        serde_json::from_str(&self.0)
    }
}

impl From<serde_json::Value> for Template {
    fn from(value: serde_json::Value) -> Self {
        Self(value.to_string().into())
    }
}

impl Default for Template {
    fn default() -> Self {
        Self::from(serde_json::json!({}))
    }
}

impl std::fmt::Debug for Template {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for Template {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.value()
            .map_err(serde::ser::Error::custom)?
            .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Template {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        serde_json::Value::deserialize(deserializer).map(Self::from)
    }
}

/// Conditions as a list keyed by type, so server-side apply merges them per condition: the
/// reconciler owns `Ready`, the scaling loop `Degraded`, without overwriting each other.
fn conditions_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let mut schema = generator.subschema_for::<Vec<Condition>>();
    schema.insert("x-kubernetes-list-type".into(), "map".into());
    schema.insert(
        "x-kubernetes-list-map-keys".into(),
        serde_json::json!(["type"]),
    );
    schema
}

/// A queue: a Cosmos DB container of messages plus its lease container.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "cosmosq.io",
    version = "v1alpha1",
    kind = "CosmosQueue",
    validation = Rule::new("self.metadata.name.size() <= 63").message("the name labels the queue's metrics and its groups refer to it: at most 63 characters"),
    namespaced,
    shortname = "cq",
    category = "cosmosq",
    status = "CosmosQueueStatus",
    doc = "A work queue on an Azure Cosmos DB container",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Partitions",
        type_ = "integer",
        json_path = ".status.partitions"
    ),
    printcolumn(name = "Backlog", type_ = "integer", json_path = ".status.backlog"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    printcolumn(
        name = "Database",
        type_ = "string",
        json_path = ".spec.database",
        priority = 1
    ),
    printcolumn(
        name = "Container",
        type_ = "string",
        json_path = ".spec.container",
        priority = 1
    ),
    printcolumn(
        name = "Deletion",
        type_ = "string",
        json_path = ".spec.deletionPolicy",
        priority = 1
    )
)]
#[serde(rename_all = "camelCase")]
pub struct CosmosQueueSpec {
    /// Account endpoint, e.g. `https://myaccount.documents.azure.com:443/`: a scheme, a host and
    /// a port only. The operator dials `https://*.documents.azure.{com,us,cn}:443` and what its
    /// admin allows (`allowedEndpoints`), nothing else.
    #[schemars(regex(pattern = r"^https?://"), length(max = 300))]
    #[x_kube(
        validation = Rule::new("self.matches('^https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?/?$')").message("endpoint must be an account endpoint: scheme://host[:port]/, with no user, path, query or fragment"),
        validation = Rule::new("self == oldSelf").message("endpoint is immutable: the queue's messages live in that account (create a new queue to move)")
    )]
    pub endpoint: String,
    /// How the operator and the sidecars reach the account.
    pub credentials: Credentials,
    /// The database that holds the messages and lease containers.
    #[schemars(regex(pattern = r"^[^/\\?#]{1,255}$"))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("database is immutable: the queue's messages live there (create a new queue to move)"))]
    pub database: String,
    /// The messages container; the queue's name in Cosmos DB.
    #[schemars(regex(pattern = r"^[^/\\?#]{1,255}$"))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("container is immutable: it holds the queue's messages (create a new queue to move)"))]
    pub container: String,
    /// Partition key path of the messages container: one top-level property.
    #[serde(default = "default_partition_key_path")]
    #[schemars(regex(pattern = r"^/[A-Za-z_][A-Za-z0-9_]*$"))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("partitionKeyPath is immutable: it is fixed when the container is created"))]
    pub partition_key_path: String,
    /// Provisioned throughput of the messages container when it is created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throughput: Option<ThroughputSpec>,
    /// How long messages are kept (Cosmos TTL), e.g. `7d`.
    #[serde(default = "default_retention")]
    #[schemars(regex(pattern = r"^([0-9]+(ms|s|m|h|d))+$"))]
    pub retention: String,
    /// Physical partitions to plan for (a hint for throughput and lease counts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub physical_partitions: Option<i32>,
    /// What deleting the resource does to the containers: keep them (default) or delete them.
    #[serde(default)]
    pub deletion_policy: DeletionPolicy,
}

fn default_partition_key_path() -> String {
    "/pk".into()
}

fn default_retention() -> String {
    "7d".into()
}

/// How the operator and the sidecars authenticate: exactly one of the two.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(validation = Rule::new("has(self.secretKeyRef) != has(self.workloadIdentity)").message("set exactly one of secretKeyRef and workloadIdentity"))]
#[serde(rename_all = "camelCase")]
pub struct Credentials {
    /// The account key, from a Secret in the queue's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_key_ref: Option<SecretKeyRef>,
    /// Microsoft Entra workload identity (the pods' service account is federated).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload_identity: Option<WorkloadIdentity>,
}

/// A key of a Secret in the queue's namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    /// The Secret's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The key within the Secret that holds the account key.
    #[serde(default = "default_secret_key")]
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

fn default_secret_key() -> String {
    "key".into()
}

/// The workload identity the pods use (the service account must be federated).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadIdentity {
    /// The managed identity's client id (`azure.workload.identity/client-id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_id: Option<String>,
}

/// Throughput to provision when the container is created (an existing one keeps its own).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ThroughputSpec {
    /// `Manual` (fixed RU/s) or `Autoscale` (up to `requestUnits`).
    #[serde(default)]
    pub mode: ThroughputMode,
    /// RU/s (manual), or the autoscale maximum.
    #[schemars(range(min = 400, max = 1_000_000))]
    pub request_units: i32,
}

/// How throughput is provisioned: `Manual` (fixed RU/s) or `Autoscale` (scales between 10%
/// and 100% of the maximum).
// The values are described here: doc comments on unit variants would make the
// schema a `oneOf`.
#[allow(missing_docs)]
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
pub enum ThroughputMode {
    #[default]
    Manual,
    Autoscale,
}

/// What deleting a CosmosQueue does to its containers: `Retain` keeps them (the default),
/// `Delete` deletes the messages and lease containers.
// The values are described here: doc comments on unit variants would make the
// schema a `oneOf`.
#[allow(missing_docs)]
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
pub enum DeletionPolicy {
    #[default]
    Retain,
    Delete,
}

/// What the operator observed of a queue.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct CosmosQueueStatus {
    /// `Ready`, `Provisioned`, `Degraded`, and kstatus' `Reconciling` (retrying by itself) and
    /// `Stalled` (waiting for its owner), each with the generation it describes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// Physical partitions of the messages container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partitions: Option<i32>,
    /// Messages not yet settled, summed over the queue's groups.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backlog: Option<i64>,
    /// Age of the oldest message a group of the queue has not settled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_message_age_seconds: Option<i64>,
    /// The generation the conditions describe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// A group of worker pods consuming a queue: the app's pod template with the sidecar injected.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "cosmosq.io",
    version = "v1alpha1",
    kind = "QueueConsumerGroup",
    validation = Rule::new("self.metadata.name.size() <= 63").message("the name labels the group's pods and metrics: at most 63 characters"),
    namespaced,
    shortname = "qcg",
    category = "cosmosq",
    status = "QueueConsumerGroupStatus",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    doc = "Worker pods consuming a cosmosq queue",
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(name = "Backlog", type_ = "integer", json_path = ".status.backlog"),
    printcolumn(name = "Lag", type_ = "integer", json_path = ".status.lag"),
    printcolumn(name = "Replicas", type_ = "integer", json_path = ".status.replicas"),
    printcolumn(
        name = "Desired",
        type_ = "integer",
        json_path = ".status.desiredReplicas"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    printcolumn(
        name = "Queue",
        type_ = "string",
        json_path = ".spec.queueRef.name",
        priority = 1
    ),
    printcolumn(
        name = "Delivery",
        type_ = "string",
        json_path = ".spec.deliveryMode",
        priority = 1
    ),
    printcolumn(
        name = "Scaling",
        type_ = "string",
        json_path = ".spec.scaling.mode",
        priority = 1
    )
)]
#[x_kube(validation = Rule::new("!has(self.publishTo) || self.publishTo.all(t, t.queueRef.name != self.queueRef.name)").message("publishTo lists other queues: a group publishes to its own queue without it"))]
#[x_kube(validation = Rule::new("has(self.group) == has(oldSelf.group) && (!has(self.group) || self.group == oldSelf.group)").message("group is immutable: it names the group's state and leases in the queue (create a new group)"))]
#[serde(rename_all = "camelCase")]
pub struct QueueConsumerGroupSpec {
    /// The CosmosQueue (same namespace).
    #[x_kube(validation = Rule::new("self == oldSelf").message("queueRef is immutable: the group's state and leases belong to that queue (create a new group)"))]
    pub queue_ref: QueueRef,
    /// The consumer group's name in the queue; defaults to the resource's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$"))]
    pub group: Option<String>,
    /// `Exclusive` (default): one pod of the group at a time per message, never again after
    /// success; `Stream`: the lease fences the range and nothing is written per message
    /// (at-least-once across lease hand-overs).
    #[serde(default)]
    #[x_kube(validation = Rule::new("self.lowerAscii() == oldSelf.lowerAscii()").message("deliveryMode is immutable: the two modes keep different state (create a new group)"))]
    pub delivery_mode: GroupDeliveryMode,
    /// How an `Exclusive` group records deliveries, with the same guarantees: `Lease`
    /// (default: the range's lease is the lock, completions are recorded with the checkpoint;
    /// about 0.2 RU per message) or `Claims` (a state document per delivery: about 23 RU).
    /// See docs/design.md, "The exclusive write path".
    #[serde(default)]
    pub exclusive_writes: GroupExclusiveWrites,
    /// Where a new group starts: `Now` (messages enqueued from now on) or `Beginning`.
    #[serde(default)]
    pub start_from: GroupStartFrom,
    /// FIFO per partition key.
    #[serde(default)]
    #[x_kube(validation = Rule::new("self == oldSelf").message("ordered is immutable: switching it mid-stream breaks the order of messages in flight (create a new group)"))]
    pub ordered: bool,
    /// The app's pod template (its containers); the sidecar is added to it.
    #[schemars(schema_with = "preserve_unknown_fields")]
    pub template: Template,
    /// How the sidecar delivers to the app.
    pub app: AppSpec,
    /// Deliveries in flight per pod.
    #[serde(default = "default_concurrency")]
    #[schemars(range(min = 1, max = 10_000))]
    pub concurrency: i32,
    /// Retries with exponential back-off, then the dead letters.
    #[serde(default)]
    pub retry: RetrySpec,
    /// How long a delivery is exclusive without renewal (renewed while the app works).
    #[serde(default = "default_lock_duration")]
    #[schemars(regex(pattern = r"^([0-9]+(ms|s|m|h|d))+$"))]
    pub lock_duration: String,
    /// The injected sidecar container.
    #[serde(default)]
    pub sidecar: SidecarSpec,
    /// How the group's workers are scaled.
    #[serde(default)]
    pub scaling: ScalingSpec,
    /// Workers to run, as `kubectl scale qcg`, an HPA or a KEDA `ScaledObject` set them through
    /// the scale subresource. Honoured in `scaling.mode: External` only; in the other modes the
    /// operator (or its HPA) decides and says so in a Warning Event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 10_000))]
    pub replicas: Option<i32>,
    /// Other queues of the namespace the workers may publish to (a pipeline: orders →
    /// invoices): the app publishes with Dapr's API under the topic of the queue's container,
    /// and the sidecar enqueues there. A topic not listed is refused (`ERR_PUBSUB_FORBIDDEN`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    #[x_kube(validation = Rule::new("self.all(t, self.exists_one(u, u.queueRef.name == t.queueRef.name))").message("publishTo names each queue once"))]
    pub publish_to: Vec<PublishTarget>,
}

/// A queue a group's workers may publish to.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PublishTarget {
    /// The CosmosQueue (same namespace).
    pub queue_ref: QueueRef,
}

impl QueueConsumerGroup {
    /// Whether the group consumes the queue `name` or publishes to it: its workers' settings
    /// follow that queue's spec.
    pub fn uses_queue(&self, name: &str) -> bool {
        self.spec.queue_ref.name == name
            || self
                .spec
                .publish_to
                .iter()
                .any(|t| t.queue_ref.name == name)
    }
}

fn default_concurrency() -> i32 {
    16
}

fn default_lock_duration() -> String {
    "60s".into()
}

/// A CosmosQueue in the group's namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct QueueRef {
    /// At most 63 characters: it labels the group's metrics (`queue=<name>`).
    #[schemars(length(min = 1, max = 63))]
    pub name: String,
}

/// How a group's deliveries are kept apart: `Exclusive` (per-message claims) or `Stream`
/// (the lease fences the range; at-least-once).
// The values are described here: doc comments on unit variants would make the
// schema a `oneOf`.
#[allow(missing_docs)]
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
// Kubernetes API style (CamelCase); the lowercase spellings of earlier versions are still
// accepted, so stored objects and existing manifests stay valid.
#[serde(rename_all = "PascalCase")]
#[schemars(extend("enum" = ["Exclusive", "Stream", "exclusive", "stream"]))]
pub enum GroupDeliveryMode {
    #[default]
    #[serde(alias = "exclusive")]
    Exclusive,
    #[serde(alias = "stream")]
    Stream,
}

/// How an exclusive group records deliveries: `Lease` or `Claims`.
// The values are described on the field.
#[allow(missing_docs)]
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
#[serde(rename_all = "PascalCase")]
pub enum GroupExclusiveWrites {
    #[default]
    Lease,
    Claims,
}

/// Where a new group starts reading: `Now` or `Beginning`.
// The values are described here: doc comments on unit variants would make the
// schema a `oneOf`.
#[allow(missing_docs)]
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
#[serde(rename_all = "PascalCase")]
#[schemars(extend("enum" = ["Now", "Beginning", "now", "beginning"]))]
pub enum GroupStartFrom {
    #[default]
    #[serde(alias = "now")]
    Now,
    #[serde(alias = "beginning")]
    Beginning,
}

/// The app's endpoint in the pod, which the sidecar posts each message to.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(validation = Rule::new("has(self.port) || (has(self.mode) && self.mode == 'Pull')").message("app.port is required: the sidecar posts messages to it (only Pull workers, which come to the sidecar, need none)"))]
#[x_kube(validation = Rule::new("!has(self.apiTokenSecret) || !has(self.generateApiTokens) || !self.generateApiTokens").message("set apiTokenSecret (a Secret you keep) or generateApiTokens (one the operator makes), not both"))]
#[serde(rename_all = "camelCase")]
pub struct AppSpec {
    /// The port the app listens on (localhost in the pod); required unless `mode` is `Pull`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    #[x_kube(validation = Rule::new("self != 3500 && self != 50001 && self != 9464").message("app.port cannot be 3500, 50001 or 9464: the sidecar's Dapr HTTP and gRPC APIs and its probes listen there"))]
    pub port: Option<i32>,
    /// The path messages are posted to.
    #[serde(default = "default_app_path")]
    #[schemars(regex(pattern = r"^/"))]
    pub path: String,
    /// How long the app may take for one message before the delivery counts as failed; at
    /// most 1h (it bounds the pods' termination grace, which node drains wait for: longer
    /// work is kept by lock promotion, `promoteAfter`).
    #[serde(default = "default_app_timeout")]
    #[schemars(regex(pattern = r"^([0-9]+(ms|s|m|h|d))+$"))]
    #[x_kube(validation = Rule::new("!self.contains('d') && duration(self) <= duration('1h')").message("app.timeout must be at most 1h: it bounds the pods' termination grace, which node drains and upgrades wait for; longer work is kept by lock promotion (promoteAfter)"))]
    pub timeout: String,
    /// `Push` (default): the sidecar posts each message to the app; `Pull`: the app's workers
    /// receive and settle messages in batches through the sidecar's localhost API
    /// (`/v1/receive`, see docs/app-contract.md), and `port`, `path` and `format` are not used.
    #[serde(default)]
    pub mode: GroupAppMode,
    /// `HTTP` (default: Dapr's HTTP pub/sub contract at `port`) or `GRPC` (Dapr's gRPC
    /// `AppCallback` service at `port`, as `--app-protocol grpc`: `ListTopicSubscriptions` at
    /// start, `OnTopicEvent` per message; `path`, `format` and `healthPath` are not used).
    #[serde(default)]
    pub protocol: GroupAppProtocol,
    /// `CloudEvents` (default: a structured CloudEvent, the message in `data`) or `Raw` (the body as is).
    #[serde(default)]
    pub format: GroupAppFormat,
    /// A path answering 2xx when the app is ready; a TCP connect otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^/"))]
    pub health_path: Option<String>,
    /// A declarative subscription, as Dapr's: routes by CEL rules over the CloudEvent. Without
    /// it the sidecar asks the app (`GET /dapr/subscribe`), then falls back to `path`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subscription: Option<SubscriptionSpec>,
    /// Set `DAPR_HTTP_PORT` (3500) and `DAPR_GRPC_PORT` (50001) in the app's containers to
    /// the sidecar's localhost APIs, so Dapr SDKs and apps publish through it unchanged (a
    /// container's own value is kept).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dapr_env: bool,
    /// A Secret of the group's namespace holding Dapr's two API tokens: `dapr-api-token`,
    /// which the app presents to the sidecar's API (`DAPR_API_TOKEN`; another container of
    /// the pod cannot enqueue or settle without it), and `app-api-token`, which the sidecar
    /// presents to the app on every call (`APP_API_TOKEN`; the app can tell its sidecar from
    /// anyone). Both are set in the sidecar and in the app's containers, under Dapr's names,
    /// so the Dapr SDKs send and check them unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"))]
    pub api_token_secret: Option<String>,
    /// The operator makes the tokens: two random values in a Secret `<group>-api-tokens`
    /// that the group owns (deleted with it), used as `apiTokenSecret` is. Deleting the
    /// Secret rotates them: at the group's next reconcile (at once with the annotation
    /// `cosmosq.io/reconcile-requested-at`) the operator makes a new one and rolls the
    /// group's workers onto it. An existing Secret of that name that the group does not own
    /// is never taken over; one left by turning this off is used again when it is turned on.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub generate_api_tokens: bool,
}

fn default_app_path() -> String {
    "/".into()
}

fn default_app_timeout() -> String {
    "60s".into()
}

/// A Dapr-style subscription declared in the group (Dapr's `Subscription` `routes` and
/// `metadata.rawPayload`).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct SubscriptionSpec {
    /// The pub/sub name the CloudEvents carry (and publishing accepts); `cosmosq` when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pubsubname: Option<String>,
    /// Tried in order; the first whose CEL `match` is true routes the message.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 100))]
    pub rules: Vec<RouteRule>,
    /// Where messages no rule matches go; without it they are dead-lettered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^/"))]
    pub default: Option<String>,
    /// Deliver the body as it is, not a CloudEvent (rules still see the CloudEvent).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub raw_payload: bool,
    /// Deliver several messages to a request (Dapr's `bulkSubscribe`); one at a time when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bulk: Option<BulkSubscribeSpec>,
}

/// Bulk delivery: entries bound for one path go together, each settled by its own status.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BulkSubscribeSpec {
    /// The most messages a request carries.
    #[serde(default = "default_bulk_messages")]
    #[schemars(range(min = 1, max = 1000))]
    pub max_messages_count: u32,
    /// How long the first message of a request waits for others, in milliseconds.
    #[serde(default = "default_bulk_await_ms")]
    #[schemars(range(min = 0, max = 60000))]
    pub max_await_duration_ms: u64,
}

fn default_bulk_messages() -> u32 {
    100
}

fn default_bulk_await_ms() -> u64 {
    1000
}

/// One routing rule.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct RouteRule {
    /// A CEL expression over the CloudEvent as `event`, e.g. `event.data.priority > 5`.
    #[serde(rename = "match")]
    #[schemars(length(min = 1, max = 4096))]
    pub matches: String,
    /// The path matched messages are posted to.
    #[schemars(regex(pattern = r"^/"))]
    pub path: String,
}

/// How messages reach the app: `Push` or `Pull`.
// The values are described on the field.
#[allow(missing_docs)]
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
pub enum GroupAppMode {
    #[default]
    Push,
    Pull,
}

/// How the sidecar calls the app: `HTTP` or `gRPC`.
// The values are described on the field.
#[allow(missing_docs)]
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
// Kubernetes API style; Dapr's own spellings (`--app-protocol http|grpc`) are accepted too.
#[schemars(extend("enum" = ["HTTP", "GRPC", "http", "grpc"]))]
pub enum GroupAppProtocol {
    #[default]
    #[serde(rename = "HTTP", alias = "http")]
    Http,
    #[serde(rename = "GRPC", alias = "grpc")]
    Grpc,
}

/// What the app receives: `CloudEvents` (a CloudEvents 1.0 structured event, as Dapr
/// sends) or `Raw` (the message body as it was enqueued).
// The values are described here: doc comments on unit variants would make the
// schema a `oneOf`.
#[allow(missing_docs)]
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
#[schemars(extend("enum" = ["CloudEvents", "Raw", "cloudevents", "raw"]))]
pub enum GroupAppFormat {
    #[default]
    #[serde(rename = "CloudEvents", alias = "cloudevents")]
    Cloudevents,
    #[serde(rename = "Raw", alias = "raw")]
    Raw,
}

/// Retries of failed deliveries.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(validation = Rule::new("duration(self.initialBackoff) <= duration(self.maxBackoff)").message("initialBackoff must not exceed maxBackoff"))]
#[serde(rename_all = "camelCase")]
pub struct RetrySpec {
    /// Deliveries before a message is dead-lettered.
    #[serde(default = "default_max_attempts")]
    #[schemars(range(min = 1, max = 1000))]
    pub max_delivery_attempts: i32,
    /// Back-off after the first failure; doubled (with jitter) after each further one.
    #[serde(default = "default_initial_backoff")]
    #[schemars(regex(pattern = r"^([0-9]+(ms|s|m|h))+$"))]
    pub initial_backoff: String,
    /// The longest back-off.
    #[serde(default = "default_max_backoff")]
    #[schemars(regex(pattern = r"^([0-9]+(ms|s|m|h))+$"))]
    pub max_backoff: String,
}

impl Default for RetrySpec {
    fn default() -> Self {
        Self {
            max_delivery_attempts: default_max_attempts(),
            initial_backoff: default_initial_backoff(),
            max_backoff: default_max_backoff(),
        }
    }
}

fn default_max_attempts() -> i32 {
    10
}

fn default_initial_backoff() -> String {
    "1s".into()
}

fn default_max_backoff() -> String {
    "5m".into()
}

/// The sidecar container the operator injects.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct SidecarSpec {
    /// The sidecar image; the operator's default when empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Resources of the sidecar container (a `ResourceRequirements`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "preserve_unknown_fields")]
    pub resources: Option<serde_json::Value>,
    /// More environment for the sidecar, as a container's `env` (values from Secrets too):
    /// e.g. `OTEL_EXPORTER_OTLP_ENDPOINT` to export its spans. The `COSMOSQ_*` settings come
    /// from the group's spec and cannot be set here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    #[x_kube(validation = Rule::new("self.all(e, !e.name.startsWith('COSMOSQ_') && e.name != 'POD_NAME' && e.name != 'POD_NAMESPACE')").message("sidecar.env cannot set COSMOSQ_* variables, POD_NAME or POD_NAMESPACE: the operator sets them from the group's spec"))]
    pub env: Vec<k8s_openapi::api::core::v1::EnvVar>,
}

/// How the group's workers are scaled from its backlog.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[x_kube(validation = Rule::new("self.minReplicas <= self.maxReplicas").message("minReplicas must not exceed maxReplicas"))]
#[x_kube(validation = Rule::new("!has(self.mode) || self.mode != 'HPA' || !has(self.scaleDownStabilization) || duration(self.scaleDownStabilization) <= duration('1h')").message("scaleDownStabilization must be at most 1h in HPA mode (the HorizontalPodAutoscaler's limit)"))]
#[x_kube(validation = Rule::new("!has(self.behavior) || (has(self.mode) && self.mode == 'HPA')").message("behavior configures the operator's HorizontalPodAutoscaler: set mode HPA, or remove it"))]
#[serde(rename_all = "camelCase")]
pub struct ScalingSpec {
    /// `Direct`: the operator sets replicas; `HPA`: an HPA the operator owns scales on its
    /// metrics; `External`: the operator publishes the figures and runs `spec.replicas`, which
    /// `kubectl scale`, the user's HPA or KEDA set (min/max and targets are theirs then).
    #[serde(default)]
    pub mode: ScalingMode,
    /// Fewest workers; 0 lets an idle group scale to zero (Direct mode).
    #[serde(default)]
    #[schemars(range(min = 0, max = 10_000))]
    pub min_replicas: i32,
    /// Most workers; the number of leases caps it too.
    #[serde(default = "default_max_replicas")]
    #[schemars(range(min = 1, max = 10_000))]
    pub max_replicas: i32,
    /// Backlog one replica is expected to carry.
    #[serde(default = "default_target_backlog")]
    #[schemars(range(min = 1))]
    pub target_backlog_per_replica: i64,
    /// Scale down only to the highest recommendation seen within this window.
    #[serde(default = "default_stabilization")]
    #[schemars(regex(pattern = r"^([0-9]+(ms|s|m|h))+$"))]
    pub scale_down_stabilization: String,
    /// Idle time before scaling to zero (when minReplicas is 0).
    #[serde(default = "default_cooldown")]
    #[schemars(regex(pattern = r"^([0-9]+(ms|s|m|h))+$"))]
    pub scale_to_zero_cooldown: String,
    /// Backlog that wakes a group scaled to zero.
    #[serde(default = "default_activation")]
    #[schemars(range(min = 1))]
    pub activation_threshold: i64,
    /// HPA mode: the HorizontalPodAutoscaler's `behavior` (scale-up and scale-down policies
    /// and windows), as is; `scaleDownStabilization` fills the scale-down window it leaves out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub behavior: Option<HorizontalPodAutoscalerBehavior>,
}

impl Default for ScalingSpec {
    fn default() -> Self {
        Self {
            mode: ScalingMode::default(),
            min_replicas: 0,
            max_replicas: default_max_replicas(),
            target_backlog_per_replica: default_target_backlog(),
            scale_down_stabilization: default_stabilization(),
            scale_to_zero_cooldown: default_cooldown(),
            activation_threshold: default_activation(),
            behavior: None,
        }
    }
}

fn default_max_replicas() -> i32 {
    10
}

fn default_target_backlog() -> i64 {
    100
}

fn default_stabilization() -> String {
    "300s".into()
}

fn default_cooldown() -> String {
    "300s".into()
}

fn default_activation() -> i64 {
    1
}

/// Who scales the workers: `Direct` (the operator), `HPA` (an HPA the operator owns) or
/// `External` (whoever sets `spec.replicas`).
// The values are described here: doc comments on unit variants would make the
// schema a `oneOf`.
#[allow(missing_docs)]
#[derive(
    schemars::JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
pub enum ScalingMode {
    #[default]
    Direct,
    #[serde(rename = "HPA")]
    Hpa,
    External,
}

/// What the operator observed of a group.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct QueueConsumerGroupStatus {
    /// `Ready` (applied, pods can be created), `Available` (the Deployment's), `Degraded` (the
    /// estimate failed), `Paused`, and kstatus' `Reconciling` (retrying by itself or rolling
    /// out) and `Stalled` (waiting for its owner), each with the generation it describes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// Worker pods that exist.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
    /// The workers' label selector (the scale subresource's, for an HPA or KEDA that
    /// targets the group).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// Workers the scaling decision wants.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_replicas: Option<i32>,
    /// Messages the group has not settled yet; absent while the estimate fails.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backlog: Option<i64>,
    /// Messages the group has not read yet; absent while the estimate fails.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag: Option<i64>,
    /// Who processes what: one entry per feed range.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranges: Vec<RangeStatus>,
    /// When the operator last changed the replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scale_time: Option<Time>,
    /// Why it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scale_reason: Option<String>,
    /// The generation `Ready` describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The operator version and sidecar image the workers were built by
    /// (`<version>/<image>`); absent for workers built before this was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workers_built_by: Option<String>,
    /// What the operator would roll the workers onto, and why it waits: an upgrade waits for
    /// the group's next spec change or `cosmosq.io/rollout-requested-at` (or, with the
    /// operator's `--sidecar-update=rolling`, for its turn).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_update: Option<String>,
}

/// One feed range of the group: who processes it and what is left.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RangeStatus {
    /// Effective partition key bounds, `min-max`.
    pub range: String,
    /// The pod holding the range's lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// Messages of the range not yet read; absent until the range has a checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag: Option<i64>,
    /// Messages of the range not yet settled.
    pub backlog: i64,
}

/// Where `crdgen` writes the reference, relative to this crate.
pub const REFERENCE_PATH: &str = "../docs/crds.md";

/// Where `crdgen` writes the YAML, relative to this crate: here, and the Helm chart's `crds/`.
pub const MANIFEST_DIRS: [&str; 2] = [".", "../charts/cosmosq/crds"];

/// The CRDs as the YAML `crdgen` writes, by file name.
pub fn manifests() -> Vec<(&'static str, String)> {
    vec![
        (
            "cosmosqueue.yaml",
            serde_yaml::to_string(&CosmosQueue::crd()).expect("CRD serializes"),
        ),
        (
            "queueconsumergroup.yaml",
            serde_yaml::to_string(&QueueConsumerGroup::crd()).expect("CRD serializes"),
        ),
    ]
}

/// The CRD reference (`docs/crds.md`), generated from the same schema the API server checks.
pub fn reference_markdown() -> String {
    let mut out = String::from(
        "# CRD reference\n\nGenerated from the CRDs' schema by `cargo run -p cosmosq-crds --bin crdgen`;\n\
         a test fails when it is stale. Validation listed here is enforced by the API server at\n\
         `kubectl apply`.\n",
    );
    for crd in [CosmosQueue::crd(), QueueConsumerGroup::crd()] {
        let crd = serde_json::to_value(crd).expect("CRD serializes");
        let version = &crd["spec"]["versions"][0];
        out.push_str(&format!(
            "\n## {} (`{}/{}`, short name `{}`)\n\n",
            crd["spec"]["names"]["kind"].as_str().unwrap_or_default(),
            crd["spec"]["group"].as_str().unwrap_or_default(),
            version["name"].as_str().unwrap_or_default(),
            crd["spec"]["names"]["shortNames"][0]
                .as_str()
                .unwrap_or_default(),
        ));
        out.push_str(
            "| field | type | default | validation | meaning |\n| --- | --- | --- | --- | --- |\n",
        );
        let schema = &version["schema"]["openAPIV3Schema"]["properties"];
        for part in ["spec", "status"] {
            reference_rows(&schema[part], part, &mut out);
        }
    }
    out
}

fn reference_rows(schema: &serde_json::Value, path: &str, out: &mut String) {
    let cell = |text: String| text.replace('|', "\\|").replace('\n', " ");
    let kind = match schema["type"].as_str() {
        Some("array") => format!(
            "array of {}",
            schema["items"]["type"].as_str().unwrap_or("object")
        ),
        Some(t) => t.to_owned(),
        None => "any".to_owned(),
    };
    let mut rules = Vec::new();
    if let Some(values) = schema["enum"].as_array() {
        let values: Vec<String> = values
            .iter()
            .map(|v| format!("`{}`", v.as_str().unwrap_or_default()))
            .collect();
        rules.push(format!("one of {}", values.join(", ")));
    }
    for (key, label) in [
        ("minimum", "≥"),
        ("maximum", "≤"),
        ("minLength", "length ≥"),
        ("maxLength", "length ≤"),
    ] {
        if let Some(n) = schema[key].as_f64() {
            rules.push(format!("{label} {n}"));
        }
    }
    if let Some(pattern) = schema["pattern"].as_str() {
        rules.push(format!("matches `{pattern}`"));
    }
    for rule in schema["x-kubernetes-validations"]
        .as_array()
        .into_iter()
        .flatten()
    {
        rules.push(rule["message"].as_str().unwrap_or_default().to_owned());
    }
    if schema["x-kubernetes-preserve-unknown-fields"] == true {
        rules.push("free-form".to_owned());
    }
    let default = match &schema["default"] {
        serde_json::Value::Null => String::new(),
        serde_json::Value::Object(_) => String::new(),
        v => format!(
            "`{}`",
            v.as_str()
                .map(str::to_owned)
                .unwrap_or_else(|| v.to_string())
        ),
    };
    let description = schema["description"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    if path != "spec" && path != "status" {
        out.push_str(&format!(
            "| `{path}` | {kind} | {default} | {} | {} |\n",
            cell(rules.join("; ")),
            cell(description)
        ));
    }
    // Conditions are the standard Kubernetes type; no need to repeat its fields.
    if path.ends_with(".conditions") {
        return;
    }
    let properties = if schema["type"] == "array" {
        &schema["items"]["properties"]
    } else {
        &schema["properties"]
    };
    let suffix = if schema["type"] == "array" { "[]" } else { "" };
    if let Some(properties) = properties.as_object() {
        for (name, child) in properties {
            reference_rows(child, &format!("{path}{suffix}.{name}"), out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn committed_yaml_is_what_crdgen_writes() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        for (file, yaml) in manifests() {
            for dir in MANIFEST_DIRS {
                let path = root.join(dir).join(file);
                let committed = std::fs::read_to_string(&path).unwrap_or_default();
                assert!(
                    committed == yaml,
                    "{} is stale: run `cargo run -p cosmosq-crds --bin crdgen`",
                    path.display()
                );
            }
        }
    }

    #[test]
    fn committed_reference_is_what_crdgen_writes() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(REFERENCE_PATH);
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == reference_markdown(),
            "{} is stale: run `cargo run -p cosmosq-crds --bin crdgen`",
            path.display()
        );
        for field in [
            "`spec.scaling.minReplicas`",
            "`status.ranges[].owner`",
            "`spec.deletionPolicy`",
        ] {
            assert!(
                committed.contains(field),
                "{field} missing from the reference"
            );
        }
    }

    #[test]
    fn enum_values_are_camel_case_and_the_old_spellings_still_read() {
        for (old, new) in [
            ("\"exclusive\"", "\"Exclusive\""),
            ("\"stream\"", "\"Stream\""),
        ] {
            let mode: GroupDeliveryMode = serde_json::from_str(old).unwrap();
            assert_eq!(serde_json::to_string(&mode).unwrap(), new);
            assert_eq!(
                serde_json::from_str::<GroupDeliveryMode>(new).unwrap(),
                mode
            );
        }
        let format: GroupAppFormat = serde_json::from_str("\"cloudevents\"").unwrap();
        assert_eq!(serde_json::to_string(&format).unwrap(), "\"CloudEvents\"");
        let start: GroupStartFrom = serde_json::from_str("\"beginning\"").unwrap();
        assert_eq!(serde_json::to_string(&start).unwrap(), "\"Beginning\"");
    }

    #[test]
    fn names_short_names_and_columns() {
        let crd = serde_json::to_value(QueueConsumerGroup::crd()).unwrap();
        assert_eq!(crd["metadata"]["name"], "queueconsumergroups.cosmosq.io");
        assert_eq!(crd["spec"]["names"]["shortNames"][0], "qcg");
        let columns = |priority: i64| -> Vec<String> {
            crd["spec"]["versions"][0]["additionalPrinterColumns"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|c| c["priority"].as_i64().unwrap_or(0) == priority)
                .map(|c| c["name"].as_str().unwrap().to_owned())
                .collect()
        };
        assert_eq!(
            columns(0),
            ["Ready", "Backlog", "Lag", "Replicas", "Desired", "Age"]
        );
        // `kubectl get -o wide` adds what the group consumes and how.
        assert_eq!(columns(1), ["Queue", "Delivery", "Scaling"]);
        assert_eq!(
            crd["spec"]["versions"][0]["subresources"]["status"],
            serde_json::json!({})
        );
        let cq = serde_json::to_value(CosmosQueue::crd()).unwrap();
        assert_eq!(cq["spec"]["names"]["shortNames"][0], "cq");
    }

    #[test]
    fn schema_carries_the_validation_rules() {
        let yaml = serde_yaml::to_string(&QueueConsumerGroup::crd()).unwrap();
        for rule in [
            "self.minReplicas <= self.maxReplicas",
            "self == oldSelf",
            "deliveryMode is immutable",
            "has(self.group) == has(oldSelf.group)",
            "duration(self.initialBackoff) <= duration(self.maxBackoff)",
            "x-kubernetes-preserve-unknown-fields: true",
            "maximum: 65535",
            // Conditions merge per type under server-side apply (two writers own them).
            "x-kubernetes-list-type: map",
        ] {
            assert!(yaml.contains(rule), "missing {rule}");
        }
        let yaml = serde_yaml::to_string(&CosmosQueue::crd()).unwrap();
        assert!(yaml.contains("has(self.secretKeyRef) != has(self.workloadIdentity)"));
        assert!(yaml.contains("- Retain"));
    }

    #[test]
    fn a_minimal_group_gets_the_documented_defaults() {
        let spec: QueueConsumerGroupSpec = serde_json::from_value(serde_json::json!({
            "queueRef": {"name": "orders"},
            "template": {"spec": {"containers": [{"name": "app", "image": "example/app"}]}},
            "app": {"port": 8080}
        }))
        .unwrap();
        assert_eq!(spec.delivery_mode, GroupDeliveryMode::Exclusive);
        assert_eq!(spec.concurrency, 16);
        assert_eq!(spec.lock_duration, "60s");
        assert_eq!(spec.retry.max_delivery_attempts, 10);
        assert_eq!(spec.scaling.mode, ScalingMode::Direct);
        assert_eq!(spec.scaling.max_replicas, 10);
        assert_eq!(spec.app.path, "/");
    }

    /// A group as the API server sends it (a watch event's bytes) keeps its template, and
    /// writes it back as it came, JSON of every type in it.
    #[test]
    fn a_template_is_kept_as_it_came() {
        let template = serde_json::json!({
            "metadata": {"labels": {"app": "billing"}, "annotations": {}},
            "spec": {
                "containers": [{"name": "app", "image": "example/app", "args": ["--n", 3, 2.5, true, null]}],
                "x-unknown": {"nested": [[{}]]}
            }
        });
        let event = serde_json::json!({"type": "ADDED", "object": {
            "apiVersion": "cosmosq.io/v1alpha1", "kind": "QueueConsumerGroup",
            "metadata": {"name": "billing", "namespace": "shop"},
            "spec": {"queueRef": {"name": "orders"}, "template": template, "app": {"port": 8080}}
        }});
        let bytes = serde_json::to_vec(&event).unwrap();
        let watched: kube::core::WatchEvent<QueueConsumerGroup> =
            serde_json::from_slice(&bytes).unwrap();
        let kube::core::WatchEvent::Added(group) = watched else {
            panic!("an ADDED event");
        };
        assert_eq!(group.spec.template.value().unwrap(), template);
        assert_eq!(
            serde_json::to_value(&group).unwrap()["spec"]["template"],
            template
        );
        assert_eq!(
            serde_yaml::from_str::<serde_json::Value>(&serde_yaml::to_string(&group).unwrap())
                .unwrap()["spec"]["template"],
            template
        );
        // Not an object: the builder refuses it with its path (build.rs), the decoder keeps it.
        let odd: Template = serde_json::from_str("[1]").unwrap();
        assert_eq!(odd.value().unwrap(), serde_json::json!([1]));
        // Deeper than JSON is read: an error to report, not a panic.
        let mut deep = serde_json::json!({});
        for _ in 0..200 {
            deep = serde_json::json!({ "a": deep });
        }
        assert!(Template::from(deep).value().is_err());
    }
}
