//! The objects a QueueConsumerGroup owns, built by pure functions (no client): the worker
//! Deployment with the sidecar injected (its settings from [`sidecar_settings`]), the workers'
//! ServiceAccount and a RoleBinding to the installation's worker ClusterRole (patch on its own
//! pod for the deletion cost), the generated API-token Secret, and in HPA mode the
//! HorizontalPodAutoscaler.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use cosmosq_crds::{CosmosQueue, Credentials, QueueConsumerGroup, ScalingMode, SecretKeyRef};
use cosmosq_queue::env as env_names;
use cosmosq_queue::metric_names;
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::autoscaling::v2::{
    CrossVersionObjectReference, ExternalMetricSource, HPAScalingRules, HorizontalPodAutoscaler,
    HorizontalPodAutoscalerSpec, MetricIdentifier, MetricSpec, MetricTarget,
};
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapProjection, Container, ContainerPort, DownwardAPIProjection,
    DownwardAPIVolumeFile, EnvVar, EnvVarSource, HTTPGetAction, KeyToPath, Lifecycle,
    LifecycleHandler, ObjectFieldSelector, PodTemplateSpec, Probe, ProjectedVolumeSource,
    ResourceRequirements, SeccompProfile, Secret, SecretVolumeSource, SecurityContext,
    ServiceAccount, ServiceAccountTokenProjection, Volume, VolumeMount, VolumeProjection,
};
use k8s_openapi::api::rbac::v1::{RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{Resource, ResourceExt};

use crate::spec::{self, control, group_name, invalid, Control, GroupSettings, SpecError};
use cosmosq_queue::Auth;
use cosmosq_sidecar::settings::{PublishTarget, PublishTargets, SidecarSettings};

/// The injected container's name.
pub const SIDECAR_CONTAINER: &str = "cosmosq-sidecar";
/// The sidecar's probe and metrics port.
pub const PROBE_PORT: i32 = 9464;
const KEY_VOLUME: &str = "cosmosq-account-key";
/// The operator's volumes' names start so; a template's may not.
const RESERVED_PREFIX: &str = "cosmosq-";
const KEY_DIR: &str = "/var/run/cosmosq";
/// Where the keys of other accounts' queues a group publishes to are mounted, one directory
/// each (not under [`KEY_DIR`], a read-only volume of its own).
const PUBLISH_KEY_DIR: &str = "/var/run/cosmosq-publish";
/// The sidecar drains for 25 s; the pod gets a little more.
const MIN_TERMINATION_GRACE_SECONDS: i64 = 30;
/// Beyond `app.timeout`, what the sidecar's drain allows for settling the last deliveries.
const DRAIN_MARGIN_SECONDS: i64 = 10;
/// Beyond the drain, what the pod's grace allows the app for its own shutdown.
const APP_STOP_MARGIN_SECONDS: i64 = 15;

/// Parses a free-form part of the spec as the Kubernetes type it must be, refusing fields that
/// type does not have: a typo (`imagePullPolicy: Always` under `resources`, `volumeMount`) would
/// otherwise be dropped without a word, as `fieldValidation=Strict` would refuse it.
fn strict<T>(field: &'static str, value: &serde_json::Value) -> Result<T, SpecError>
where
    T: serde::de::DeserializeOwned,
{
    let mut unknown = Vec::new();
    let parsed: T = serde_ignored::deserialize(value, |path| {
        unknown.push(format!("{field}{}", json_path(&path)))
    })
    .map_err(|e| invalid(field, format!("not a {}: {e}", short_type_name::<T>())))?;
    match unknown.as_slice() {
        [] => Ok(parsed),
        fields => Err(invalid(
            field,
            format!("unknown field {} (a typo?)", fields.join(", ")),
        )),
    }
}

fn short_type_name<T>() -> &'static str {
    std::any::type_name::<T>()
        .rsplit("::")
        .next()
        .unwrap_or("value")
}

/// A path as the spec's users write it: `.containers[0].volumeMount`.
fn json_path(path: &serde_ignored::Path) -> String {
    use serde_ignored::Path;
    match path {
        Path::Root => String::new(),
        Path::Seq { parent, index } => format!("{}[{index}]", json_path(parent)),
        Path::Map { parent, key } => format!("{}.{key}", json_path(parent)),
        Path::Some { parent }
        | Path::NewtypeStruct { parent }
        | Path::NewtypeVariant { parent } => json_path(parent),
    }
}

/// Settings of this operator installation.
#[derive(Clone, Debug)]
pub struct Defaults {
    /// The sidecar image, unless a group names its own.
    pub sidecar_image: String,
    /// The ClusterRole each group's RoleBinding grants its workers (the chart's
    /// `<release>-worker`: patch pods, narrowed by the chart's admission policy to the caller's
    /// own pod's deletion cost).
    pub worker_cluster_role: String,
    /// When the operator's own changes roll the workers.
    pub rollout: crate::rollout::RolloutPolicy,
    /// Where the groups are (the watched namespace), for counting rollouts.
    pub rollout_scope: Option<String>,
    /// Held from counting the rollouts in progress to applying one.
    pub rollout_lock: std::sync::Arc<tokio::sync::Mutex<()>>,
}

/// The worker ClusterRole's name when none is configured.
pub const WORKER_CLUSTER_ROLE: &str = "cosmosq-worker";

impl Defaults {
    /// Defaults with `sidecar_image` and the chart's default worker ClusterRole.
    pub fn new(sidecar_image: impl Into<String>) -> Self {
        Self {
            sidecar_image: sidecar_image.into(),
            worker_cluster_role: WORKER_CLUSTER_ROLE.into(),
            rollout: crate::rollout::RolloutPolicy::default(),
            rollout_scope: None,
            rollout_lock: Default::default(),
        }
    }
}

/// Name of the Deployment, ServiceAccount, RoleBinding and HPA of a group (and of the Role an
/// older version made).
pub fn workers_name(qcg: &QueueConsumerGroup) -> String {
    format!("{}-workers", qcg.name_any())
}

fn selector_labels(qcg: &QueueConsumerGroup) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".into(), "cosmosq-worker".into()),
        ("app.kubernetes.io/instance".into(), qcg.name_any()),
    ])
}

/// The label selector of every object the operator manages (its watches and lists use it).
pub const MANAGED_SELECTOR: &str = "app.kubernetes.io/managed-by=cosmosq-operator";

fn labels(qcg: &QueueConsumerGroup) -> BTreeMap<String, String> {
    let mut labels = selector_labels(qcg);
    let (key, value) = MANAGED_SELECTOR.split_once('=').expect("key=value");
    labels.insert(key.into(), value.into());
    labels.insert("cosmosq.io/queue".into(), qcg.spec.queue_ref.name.clone());
    labels
}

fn owner(qcg: &QueueConsumerGroup) -> Result<OwnerReference, SpecError> {
    qcg.controller_owner_ref(&())
        .ok_or_else(|| invalid("metadata", "the group has no uid yet"))
}

fn metadata(qcg: &QueueConsumerGroup) -> Result<ObjectMeta, SpecError> {
    Ok(ObjectMeta {
        name: Some(workers_name(qcg)),
        namespace: qcg.namespace(),
        labels: Some(labels(qcg)),
        owner_references: Some(vec![owner(qcg)?]),
        ..ObjectMeta::default()
    })
}

/// What Dapr SDKs and apps read to find their sidecar's HTTP API.
pub const DAPR_HTTP_PORT: &str = "DAPR_HTTP_PORT";
/// The sidecar's localhost API port: its default `--listen` (Dapr's port, 3500).
pub const SIDECAR_API_PORT: u16 = 3500;
/// What Dapr SDKs read to find their sidecar's gRPC API.
pub const DAPR_GRPC_PORT: &str = "DAPR_GRPC_PORT";
/// The sidecar's gRPC API port: its default `--grpc-listen` (Dapr's port, 50001).
pub const SIDECAR_GRPC_PORT: u16 = 50001;

/// A declared subscription as the entry of Dapr's `GET /dapr/subscribe` answer the sidecar
/// reads (pure): one format for both ways of subscribing.
pub fn subscription_entry(s: &cosmosq_crds::SubscriptionSpec, topic: &str) -> serde_json::Value {
    let rules: Vec<serde_json::Value> = s
        .rules
        .iter()
        .map(|r| serde_json::json!({"match": r.matches, "path": r.path}))
        .collect();
    let mut entry = serde_json::json!({
        "pubsubname": s.pubsubname.as_deref().unwrap_or(cosmosq_queue::PUBSUB_NAME),
        "topic": topic,
        "routes": {"rules": rules},
    });
    if let Some(default) = &s.default {
        entry["routes"]["default"] = serde_json::json!(default);
    }
    if s.raw_payload {
        entry["metadata"] = serde_json::json!({"rawPayload": "true"});
    }
    if let Some(bulk) = &s.bulk {
        entry["bulkSubscribe"] = serde_json::json!({
            "enabled": true,
            "maxMessagesCount": bulk.max_messages_count,
            "maxAwaitDurationMs": bulk.max_await_duration_ms,
        });
    }
    entry
}

/// Dapr's variable for the token the app presents to its sidecar.
pub const API_TOKEN_ENV: &str = "DAPR_API_TOKEN";
/// Dapr's variable for the token the sidecar presents to its app.
pub const APP_API_TOKEN_ENV: &str = "APP_API_TOKEN";
/// The key of `spec.app.apiTokenSecret` holding [`API_TOKEN_ENV`].
pub const API_TOKEN_KEY: &str = "dapr-api-token";
/// The key of `spec.app.apiTokenSecret` holding [`APP_API_TOKEN_ENV`].
pub const APP_API_TOKEN_KEY: &str = "app-api-token";

/// The Secret `spec.app.generateApiTokens` makes for a group.
pub fn generated_api_tokens_name(qcg: &QueueConsumerGroup) -> String {
    format!("{}-api-tokens", qcg.name_any())
}

/// The Secret the group's API tokens come from, if it has any (pure).
pub fn api_token_secret(qcg: &QueueConsumerGroup) -> Option<String> {
    match (
        &qcg.spec.app.api_token_secret,
        qcg.spec.app.generate_api_tokens,
    ) {
        (Some(name), _) => Some(name.clone()),
        (None, true) => Some(generated_api_tokens_name(qcg)),
        (None, false) => None,
    }
}

/// A new Secret of two random tokens for `spec.app.generateApiTokens`, owned by the group (the
/// garbage collector deletes it with the group). Immutable: the sidecar and the app of a pod
/// read it at start, and a value changed under running pods would set a restarted container
/// apart from the others; a rotation is a new Secret, and new pods.
pub fn generated_api_tokens(qcg: &QueueConsumerGroup) -> Result<Secret, SpecError> {
    use base64::Engine as _;
    use rand::RngCore as _;
    let token = || {
        // 256 bits from a cryptographically secure generator, in URL-safe text (43 chars).
        let mut bytes = [0u8; 32];
        rand::rng().fill_bytes(&mut bytes);
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    };
    Ok(Secret {
        metadata: ObjectMeta {
            name: Some(generated_api_tokens_name(qcg)),
            ..metadata(qcg)?
        },
        immutable: Some(true),
        type_: Some("Opaque".into()),
        string_data: Some(BTreeMap::from([
            (API_TOKEN_KEY.into(), token()),
            (APP_API_TOKEN_KEY.into(), token()),
        ])),
        ..Secret::default()
    })
}

/// A digest of a Secret's two API tokens (both present): it changes when they are rotated.
/// Only for tokens the operator drew (256 bits each): a short digest of guessable ones would
/// let whoever reads the pod template test guesses offline.
pub fn api_tokens_digest(secret: &Secret) -> Option<String> {
    // As read (`data`), or as made and not yet written (`stringData`).
    let value = |key: &str| match (&secret.data, &secret.string_data) {
        (Some(data), _) => data.get(key).map(|v| v.0.clone()),
        (None, Some(text)) => text.get(key).map(|v| v.clone().into_bytes()),
        (None, None) => None,
    };
    let mut both = value(API_TOKEN_KEY)?;
    // A separator no token text holds: ("ab", "c") and ("a", "bc") differ.
    both.push(0);
    both.extend(value(APP_API_TOKEN_KEY)?);
    Some(key_digest(&both))
}

/// `name` from `key` of the Secret `secret` (required: a pod without it does not start, and
/// says so, rather than run unguarded).
fn secret_env(name: &str, secret: &str, key: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value_from: Some(k8s_openapi::api::core::v1::EnvVarSource {
            secret_key_ref: Some(k8s_openapi::api::core::v1::SecretKeySelector {
                name: secret.into(),
                key: key.into(),
                optional: Some(false),
            }),
            ..Default::default()
        }),
        ..EnvVar::default()
    }
}

fn env(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value.into()),
        ..EnvVar::default()
    }
}

fn env_field(name: &str, path: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.into(),
                ..ObjectFieldSelector::default()
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}

/// The sidecar's settings for a group's pods: what the queue and the group say, and where the
/// pod puts things (the key's file, the probe and API ports, the drain); the rest are the
/// sidecar's defaults, written out so a pod's spec says all it runs with.
pub fn sidecar_settings(
    qcg: &QueueConsumerGroup,
    settings: &GroupSettings,
    queue: &CosmosQueue,
    targets: &[CosmosQueue],
) -> SidecarSettings {
    let (s, q, group) = (&qcg.spec, &queue.spec, &settings.config);
    let by_key = q.credentials.secret_key_ref.is_some();
    let mut sidecar = SidecarSettings::new(&q.database, &q.container, &group.name);
    sidecar.connection.endpoint = q.endpoint.clone();
    sidecar.connection.auth = if by_key { Auth::Key } else { Auth::Identity };
    // The key travels as a mounted file, never as an environment variable.
    sidecar.connection.key_file = by_key.then(|| format!("{KEY_DIR}/key").into());
    SidecarSettings {
        partition_key_path: q.partition_key_path.clone(),
        mode: group.mode,
        exclusive_writes: group.exclusive_writes,
        start_from: group.start_from,
        ordered: group.ordered,
        lock_duration: group.lock_duration,
        max_delivery_attempts: group.retry.max_delivery_attempts,
        retry_initial_backoff: group.retry.initial_backoff,
        retry_max_backoff: group.retry.max_backoff,
        app_port: s.app.port.and_then(|p| u16::try_from(p).ok()),
        app_path: s.app.path.clone(),
        app_mode: spec::app_mode(s.app.mode),
        app_protocol: spec::app_protocol(s.app.protocol),
        app_format: spec::app_format(s.app.format),
        app_timeout: settings.app_timeout,
        app_subscription: s
            .app
            .subscription
            .as_ref()
            .map(|sub| subscription_entry(sub, &q.container).to_string()),
        app_health_path: s.app.health_path.clone(),
        max_concurrency: s.concurrency.max(1) as usize,
        listen: SocketAddr::from(([127, 0, 0, 1], SIDECAR_API_PORT)),
        probe_listen: format!("0.0.0.0:{PROBE_PORT}"),
        grpc_listen: format!("127.0.0.1:{SIDECAR_GRPC_PORT}"),
        grace_period: drain(settings),
        publish_to: PublishTargets(
            targets
                .iter()
                .map(|target| publish_target(queue, target))
                .collect(),
        ),
        ..sidecar
    }
}

/// Where the sidecar finds the account key of a queue it publishes to, unless it is the one
/// of the group's own queue (the same Secret and key): each other key is a volume of its own.
fn publish_key_dir(target: &CosmosQueue) -> String {
    format!("{PUBLISH_KEY_DIR}/{}", target.name_any())
}

/// The volume of [`publish_key_dir`]: `cosmosq-publish-<queue>`, a DNS label of at most 63
/// characters (a queue's name may be longer, and have dots: such a name is cut, its dots made
/// dashes, and told apart by a digest).
fn publish_key_volume(target: &CosmosQueue) -> String {
    const PREFIX: &str = "cosmosq-publish-";
    let name = target.name_any();
    if name.len() <= 63 - PREFIX.len() && !name.contains('.') {
        return format!("{PREFIX}{name}");
    }
    let digest = key_digest(name.as_bytes());
    let cut: String = name
        .chars()
        .take(30)
        .map(|c| if c == '.' { '-' } else { c })
        .collect();
    format!("{PREFIX}{}-{}", cut.trim_end_matches('-'), &digest[..8])
}

/// The Secret key of `target` the sidecar needs mounted, if it is not the consumed queue's.
fn own_publish_key<'a>(queue: &CosmosQueue, target: &'a CosmosQueue) -> Option<&'a SecretKeyRef> {
    target
        .spec
        .credentials
        .secret_key_ref
        .as_ref()
        .filter(|key| Some(*key) != queue.spec.credentials.secret_key_ref.as_ref())
}

/// A queue the group's sidecar publishes to, as the sidecar's `--publish-to` names it.
fn publish_target(queue: &CosmosQueue, target: &CosmosQueue) -> PublishTarget {
    let t = &target.spec;
    let key_file = match (
        &t.credentials.secret_key_ref,
        own_publish_key(queue, target),
    ) {
        (None, _) => None,
        (Some(_), Some(_)) => Some(format!("{}/key", publish_key_dir(target)).into()),
        (Some(_), None) => Some(format!("{KEY_DIR}/key").into()),
    };
    PublishTarget {
        database: t.database.clone(),
        queue: t.container.clone(),
        endpoint: t.endpoint.clone(),
        auth: if key_file.is_some() {
            Auth::Key
        } else {
            Auth::Identity
        },
        key_file,
    }
}

/// Refuses `spec.publishTo` queues whose topics (their containers' names) would be taken for
/// another's: the group's own, or one another's (pure).
pub fn check_publish_targets(
    queue: &CosmosQueue,
    targets: &[CosmosQueue],
) -> Result<(), SpecError> {
    let mut topics = BTreeMap::from([(queue.spec.container.as_str(), queue.name_any())]);
    let identity = |q: &CosmosQueue| {
        q.spec
            .credentials
            .workload_identity
            .as_ref()
            .map(|w| w.client_id.clone())
    };
    for target in targets {
        // The pods have one Entra identity, the group's ServiceAccount's, which the consumed
        // queue names: a queue on another (or on one while the group's uses a key) could not
        // be reached; refused here rather than found by a sidecar that cannot start.
        if let Some(wanted) = identity(target) {
            if identity(queue) != Some(wanted.clone()) {
                return Err(invalid(
                    "spec.publishTo",
                    format!(
                        "CosmosQueue {} uses workload identity {}, which the workers do not \
                         have: they run with {}'s credentials ({}); give both queues the same \
                         identity, or {} a key Secret",
                        target.name_any(),
                        wanted.as_deref().unwrap_or("(the default client id)"),
                        queue.name_any(),
                        match identity(queue) {
                            Some(Some(id)) => format!("workload identity {id}"),
                            Some(None) => "the default workload identity".into(),
                            None => "a key Secret".into(),
                        },
                        target.name_any(),
                    ),
                ));
            }
        }
        if let Some(first) = topics.insert(&target.spec.container, target.name_any()) {
            return Err(invalid(
                "spec.publishTo",
                format!(
                    "CosmosQueue {} and {first} both have the container {:?}, which is the topic \
                     an app publishes under: list one of them",
                    target.name_any(),
                    target.spec.container
                ),
            ));
        }
    }
    Ok(())
}

/// How long the sidecar drains on SIGTERM: the longest delivery plus a margin to settle it.
fn drain(settings: &GroupSettings) -> Duration {
    settings.app_timeout + Duration::from_secs(DRAIN_MARGIN_SECONDS as u64)
}

/// The sidecar container's environment: its settings, the pod's name and namespace from the
/// downward API, then the user's additions.
pub fn sidecar_env(
    qcg: &QueueConsumerGroup,
    settings: &GroupSettings,
    queue: &CosmosQueue,
    targets: &[CosmosQueue],
) -> Vec<EnvVar> {
    let mut vars: Vec<EnvVar> = sidecar_settings(qcg, settings, queue, targets)
        .to_env()
        .into_iter()
        .map(|(name, value)| env(name, value))
        .collect();
    vars.push(env_field(env_names::POD_NAME, "metadata.name"));
    vars.push(env_field(env_names::POD_NAMESPACE, "metadata.namespace"));
    // The user's additions last; the CRD refuses the names set above, and should one get
    // past it (an older CRD), the spec's setting is kept, not the addition.
    let own: std::collections::BTreeSet<String> = vars.iter().map(|v| v.name.clone()).collect();
    vars.extend(
        qcg.spec
            .sidecar
            .env
            .iter()
            .filter(|v| !own.contains(&v.name) && !v.name.starts_with("COSMOSQ_"))
            .cloned(),
    );
    vars
}

fn sidecar_container(
    qcg: &QueueConsumerGroup,
    settings: &GroupSettings,
    queue: &CosmosQueue,
    targets: &[CosmosQueue],
    defaults: &Defaults,
) -> Result<Container, SpecError> {
    let resources = match &qcg.spec.sidecar.resources {
        Some(value) => strict::<ResourceRequirements>("spec.sidecar.resources", value)?,
        None => ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".into(), Quantity("50m".into())),
                ("memory".into(), Quantity("64Mi".into())),
            ])),
            limits: Some(BTreeMap::from([(
                "memory".into(),
                Quantity("256Mi".into()),
            )])),
            ..ResourceRequirements::default()
        },
    };
    let probe = |path: &str, delay: i32| Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::Int(PROBE_PORT),
            ..HTTPGetAction::default()
        }),
        initial_delay_seconds: Some(delay),
        period_seconds: Some(10),
        ..Probe::default()
    };
    Ok(Container {
        name: SIDECAR_CONTAINER.into(),
        image: Some(
            qcg.spec
                .sidecar
                .image
                .clone()
                .unwrap_or_else(|| defaults.sidecar_image.clone()),
        ),
        env: Some(sidecar_env(qcg, settings, queue, targets)),
        ports: Some(vec![ContainerPort {
            name: Some("cosmosq-metrics".into()),
            container_port: PROBE_PORT,
            ..ContainerPort::default()
        }]),
        readiness_probe: Some(probe("/readyz", 2)),
        liveness_probe: Some(probe("/healthz", 10)),
        resources: Some(resources),
        security_context: Some(SecurityContext {
            // The image's numeric USER (65532) satisfies runAsNonRoot; no UID is set here, so
            // OpenShift's restricted SCC can assign one from the namespace's range.
            run_as_non_root: Some(true),
            read_only_root_filesystem: Some(true),
            allow_privilege_escalation: Some(false),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                ..Capabilities::default()
            }),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".into(),
                ..SeccompProfile::default()
            }),
            ..SecurityContext::default()
        }),
        volume_mounts: Some(key_mounts(queue, targets)).filter(|m| !m.is_empty()),
        ..Container::default()
    })
}

/// The sidecar's mounts of account keys: the consumed queue's, and each other one of the
/// queues it publishes to.
fn key_mounts(queue: &CosmosQueue, targets: &[CosmosQueue]) -> Vec<VolumeMount> {
    let mount = |name: String, path: String| VolumeMount {
        name,
        mount_path: path,
        read_only: Some(true),
        ..VolumeMount::default()
    };
    let own = queue
        .spec
        .credentials
        .secret_key_ref
        .as_ref()
        .map(|_| mount(KEY_VOLUME.into(), KEY_DIR.into()));
    let published = targets
        .iter()
        .filter(|target| own_publish_key(queue, target).is_some())
        .map(|target| mount(publish_key_volume(target), publish_key_dir(target)));
    own.into_iter().chain(published).collect()
}

/// A volume of one key of a Secret, as the file `key`.
fn key_volume(name: String, key: &SecretKeyRef) -> Volume {
    Volume {
        name,
        secret: Some(SecretVolumeSource {
            secret_name: Some(key.name.clone()),
            items: Some(vec![KeyToPath {
                key: key.key.clone(),
                path: "key".into(),
                ..KeyToPath::default()
            }]),
            ..SecretVolumeSource::default()
        }),
        ..Volume::default()
    }
}

/// The worker Deployment: the user's pod template plus the sidecar. Replicas are left out:
/// the scaler (or the HPA) owns them through the scale subresource. `targets` are the queues
/// of `spec.publishTo`, in its order.
pub fn deployment(
    qcg: &QueueConsumerGroup,
    settings: &GroupSettings,
    queue: &CosmosQueue,
    targets: &[CosmosQueue],
    defaults: &Defaults,
) -> Result<Deployment, SpecError> {
    check_publish_targets(queue, targets)?;
    let template = qcg.spec.template.value().map_err(|e| {
        invalid(
            "spec.template",
            format!("not JSON this operator reads: {e}"),
        )
    })?;
    let mut template: PodTemplateSpec = strict("spec.template", &template)?;
    let mut pod = template
        .spec
        .take()
        .ok_or_else(|| invalid("spec.template.spec", "missing"))?;
    if pod.containers.is_empty() {
        return Err(invalid(
            "spec.template.spec.containers",
            "at least one container (the app) is needed",
        ));
    }
    if pod.containers.iter().any(|c| c.name == SIDECAR_CONTAINER) {
        return Err(invalid(
            "spec.template.spec.containers",
            format!("the name {SIDECAR_CONTAINER} is the sidecar's"),
        ));
    }
    // The operator's volumes (the account keys, the sidecar's API token) are the sidecar's
    // alone: a template naming one could mount a key its author may not read.
    if let Some(volume) = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name.starts_with(RESERVED_PREFIX))
    {
        return Err(invalid(
            "spec.template.spec.volumes",
            format!(
                "{:?}: names starting with {RESERVED_PREFIX:?} are the operator's",
                volume.name
            ),
        ));
    }
    let containers = pod
        .containers
        .iter()
        .chain(pod.init_containers.iter().flatten());
    for container in containers {
        if let Some(mount) = container
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.name.starts_with(RESERVED_PREFIX))
        {
            return Err(invalid(
                "spec.template.spec.containers",
                format!(
                    "{}: volume {:?} is the sidecar's (the account keys and its API token \
                     are mounted for it alone)",
                    container.name, mount.name
                ),
            ));
        }
    }
    // On the node's network, the sidecar's localhost API would be every pod's on the node.
    if pod.host_network == Some(true) {
        return Err(invalid(
            "spec.template.spec.hostNetwork",
            "the sidecar's API listens on the pod's localhost, which the node's network would \
             share with every host-network pod of the node; leave it unset",
        ));
    }
    pod.containers
        .push(sidecar_container(qcg, settings, queue, targets, defaults)?);
    // The workers run as the group's own ServiceAccount: the operator binds the worker role
    // to no account it did not make (`default`, another team's).
    let account = workers_name(qcg);
    if let Some(named) = pod.service_account_name.as_ref().filter(|n| **n != account) {
        return Err(invalid(
            "spec.template.spec.serviceAccountName",
            format!(
                "{named:?}: the workers run as the group's own ServiceAccount {account} (the \
                 operator makes it, and binds the worker role to no other); leave it unset"
            ),
        ));
    }
    pod.service_account_name = Some(account);
    // The app gets no API token (unless the template asks for one): only the sidecar talks
    // to the API server, with a projected token bound to its pod.
    if pod.automount_service_account_token != Some(true) {
        pod.automount_service_account_token = Some(false);
        pod.volumes
            .get_or_insert_with(Vec::new)
            .push(api_token_volume());
        let sidecar = pod
            .containers
            .iter_mut()
            .find(|c| c.name == SIDECAR_CONTAINER)
            .expect("the sidecar was just added");
        sidecar
            .volume_mounts
            .get_or_insert_with(Vec::new)
            .push(VolumeMount {
                name: API_TOKEN_VOLUME.into(),
                mount_path: API_TOKEN_DIR.into(),
                read_only: Some(true),
                ..VolumeMount::default()
            });
    }
    // Scale-in never cuts a delivery: the sidecar drains for the longest delivery plus a
    // margin to settle it; each app container's preStop waits for that drain, so the app
    // serves until its last delivery is settled; the pod's grace covers both and the app's
    // own shutdown.
    let drain = drain(settings).as_secs() as i64;
    for container in pod.containers.iter_mut() {
        // Dapr's two tokens, under Dapr's names, in every container: the sidecar checks and
        // sends them, the app's SDK sends and checks them.
        if let Some(secret) = &api_token_secret(qcg) {
            let sidecar = container.name == SIDECAR_CONTAINER;
            let vars = container.env.get_or_insert_with(Vec::new);
            for (app_name, sidecar_name, key) in [
                (API_TOKEN_ENV, env_names::API_TOKEN, API_TOKEN_KEY),
                (
                    APP_API_TOKEN_ENV,
                    env_names::APP_API_TOKEN,
                    APP_API_TOKEN_KEY,
                ),
            ] {
                let name = if sidecar { sidecar_name } else { app_name };
                vars.retain(|v| v.name != name);
                vars.push(secret_env(name, secret, key));
            }
        }
        if container.name == SIDECAR_CONTAINER {
            continue;
        }
        if qcg.spec.app.dapr_env {
            let vars = container.env.get_or_insert_with(Vec::new);
            for (name, port) in [
                (DAPR_HTTP_PORT, SIDECAR_API_PORT),
                (DAPR_GRPC_PORT, SIDECAR_GRPC_PORT),
            ] {
                if !vars.iter().any(|v| v.name == name) {
                    vars.push(env(name, port.to_string()));
                }
            }
        }
        let lifecycle = container.lifecycle.get_or_insert_with(Lifecycle::default);
        if lifecycle.pre_stop.is_none() {
            lifecycle.pre_stop = Some(LifecycleHandler {
                http_get: Some(HTTPGetAction {
                    path: Some("/drained".into()),
                    port: IntOrString::Int(PROBE_PORT),
                    ..HTTPGetAction::default()
                }),
                ..LifecycleHandler::default()
            });
        }
    }
    pod.termination_grace_period_seconds = Some(
        pod.termination_grace_period_seconds
            .unwrap_or(0)
            .max(drain + APP_STOP_MARGIN_SECONDS)
            .max(MIN_TERMINATION_GRACE_SECONDS),
    );
    let volumes = pod.volumes.get_or_insert_with(Vec::new);
    if let Some(key) = &queue.spec.credentials.secret_key_ref {
        volumes.push(key_volume(KEY_VOLUME.into(), key));
    }
    for target in targets {
        if let Some(key) = own_publish_key(queue, target) {
            volumes.push(key_volume(publish_key_volume(target), key));
        }
    }
    if volumes.is_empty() {
        pod.volumes = None;
    }
    let mut meta = template.metadata.take().unwrap_or_default();
    meta.labels
        .get_or_insert_with(BTreeMap::new)
        .extend(selector_labels(qcg));
    if std::iter::once(queue).chain(targets).any(|q| {
        matches!(
            q.spec.credentials,
            Credentials {
                workload_identity: Some(_),
                ..
            }
        )
    }) {
        meta.labels
            .get_or_insert_with(BTreeMap::new)
            .insert("azure.workload.identity/use".into(), "true".into());
    }
    Ok(Deployment {
        metadata: metadata(qcg)?,
        spec: Some(DeploymentSpec {
            selector: LabelSelector {
                match_labels: Some(selector_labels(qcg)),
                ..LabelSelector::default()
            },
            template: PodTemplateSpec {
                metadata: Some(meta),
                spec: Some(pod),
            },
            ..DeploymentSpec::default()
        }),
        ..Deployment::default()
    })
}

const API_TOKEN_VOLUME: &str = "cosmosq-api-token";
/// Where in-cluster clients (kube-rs, client-go) look for the token, CA and namespace.
const API_TOKEN_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// What the kubelet mounts for an automounted token: a bound, expiring token (refreshed by the
/// kubelet), the cluster CA and the namespace.
fn api_token_volume() -> Volume {
    Volume {
        name: API_TOKEN_VOLUME.into(),
        projected: Some(ProjectedVolumeSource {
            default_mode: Some(0o444),
            sources: Some(vec![
                VolumeProjection {
                    service_account_token: Some(ServiceAccountTokenProjection {
                        path: "token".into(),
                        expiration_seconds: Some(3607),
                        ..ServiceAccountTokenProjection::default()
                    }),
                    ..VolumeProjection::default()
                },
                VolumeProjection {
                    config_map: Some(ConfigMapProjection {
                        name: "kube-root-ca.crt".into(),
                        items: Some(vec![KeyToPath {
                            key: "ca.crt".into(),
                            path: "ca.crt".into(),
                            ..KeyToPath::default()
                        }]),
                        ..ConfigMapProjection::default()
                    }),
                    ..VolumeProjection::default()
                },
                VolumeProjection {
                    downward_api: Some(DownwardAPIProjection {
                        items: Some(vec![DownwardAPIVolumeFile {
                            path: "namespace".into(),
                            field_ref: Some(ObjectFieldSelector {
                                field_path: "metadata.namespace".into(),
                                ..ObjectFieldSelector::default()
                            }),
                            ..DownwardAPIVolumeFile::default()
                        }]),
                    }),
                    ..VolumeProjection::default()
                },
            ]),
        }),
        ..Volume::default()
    }
}

/// The pod template annotation that carries a digest of the account key the sidecars use.
pub const KEY_DIGEST_ANNOTATION: &str = "cosmosq.io/key-digest";

/// A digest of an account key: it changes when the key is rotated, and reveals nothing of it.
pub fn key_digest(key: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(key);
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// The pod template annotation that carries a digest of the group's API tokens.
pub const TOKENS_DIGEST_ANNOTATION: &str = "cosmosq.io/api-tokens-digest";

/// Marks the worker pods with a Secret's digest ([`KEY_DIGEST_ANNOTATION`],
/// [`TOKENS_DIGEST_ANNOTATION`]): a rotated value changes the template, and the Deployment
/// rolls the workers onto it (the containers read it once, at start).
pub fn with_digest(deployment: &mut Deployment, annotation: &str, digest: String) {
    if let Some(template) = deployment.spec.as_mut().map(|s| &mut s.template) {
        template
            .metadata
            .get_or_insert_with(ObjectMeta::default)
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(annotation.into(), digest);
    }
}

/// The sidecar's identity (workload identity is federated on it when the queue uses it).
pub fn service_account(
    qcg: &QueueConsumerGroup,
    queue: &CosmosQueue,
) -> Result<ServiceAccount, SpecError> {
    let mut meta = metadata(qcg)?;
    if let Some(client_id) = queue
        .spec
        .credentials
        .workload_identity
        .as_ref()
        .and_then(|w| w.client_id.clone())
    {
        meta.annotations = Some(BTreeMap::from([(
            "azure.workload.identity/client-id".into(),
            client_id,
        )]));
    }
    Ok(ServiceAccount {
        metadata: meta,
        ..ServiceAccount::default()
    })
}

/// The workers' grant: the installation's worker ClusterRole, in the group's namespace only.
/// A ClusterRole the chart owns (rather than a Role per group) means the operator needs no
/// right to create Roles, only to bind that one role.
pub fn role_binding(
    qcg: &QueueConsumerGroup,
    service_account: &str,
    defaults: &Defaults,
) -> Result<RoleBinding, SpecError> {
    Ok(RoleBinding {
        metadata: metadata(qcg)?,
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "ClusterRole".into(),
            name: defaults.worker_cluster_role.clone(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: service_account.into(),
            namespace: qcg.namespace(),
            ..Subject::default()
        }]),
    })
}

/// HPA mode: scale the Deployment on the operator's external metric, the group's backlog
/// ([`metric_names::BACKLOG`]), with the spec's `behavior`. None while paused, as KEDA does:
/// an HPA would go on scaling the paused workers.
pub fn hpa(
    qcg: &QueueConsumerGroup,
    settings: &GroupSettings,
) -> Result<Option<HorizontalPodAutoscaler>, SpecError> {
    let scaling = &qcg.spec.scaling;
    if scaling.mode != ScalingMode::Hpa || matches!(control(qcg).0, Control::Paused(_)) {
        return Ok(None);
    }
    let mut behavior = scaling.behavior.clone().unwrap_or_default();
    let scale_down = behavior
        .scale_down
        .get_or_insert_with(HPAScalingRules::default);
    scale_down
        .stabilization_window_seconds
        .get_or_insert(settings.scale_down_stabilization_seconds);
    let selector = LabelSelector {
        match_labels: Some(BTreeMap::from([
            ("queue".into(), qcg.spec.queue_ref.name.clone()),
            ("group".into(), group_name(qcg)),
        ])),
        ..LabelSelector::default()
    };
    Ok(Some(HorizontalPodAutoscaler {
        metadata: metadata(qcg)?,
        spec: Some(HorizontalPodAutoscalerSpec {
            scale_target_ref: CrossVersionObjectReference {
                api_version: Some("apps/v1".into()),
                kind: "Deployment".into(),
                name: workers_name(qcg),
            },
            // The HPA cannot go to zero without a feature gate; Direct mode can.
            min_replicas: Some(scaling.min_replicas.max(1)),
            max_replicas: scaling.max_replicas,
            metrics: Some(vec![MetricSpec {
                type_: "External".into(),
                external: Some(ExternalMetricSource {
                    metric: MetricIdentifier {
                        name: metric_names::BACKLOG.into(),
                        selector: Some(selector),
                    },
                    target: MetricTarget {
                        type_: "AverageValue".into(),
                        average_value: Some(Quantity(
                            scaling.target_backlog_per_replica.to_string(),
                        )),
                        ..MetricTarget::default()
                    },
                }),
                ..MetricSpec::default()
            }]),
            behavior: Some(behavior),
        }),
        ..HorizontalPodAutoscaler::default()
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn queue(credentials: serde_json::Value) -> CosmosQueue {
        let mut q: CosmosQueue = serde_json::from_value(json!({
            "apiVersion": "cosmosq.io/v1alpha1", "kind": "CosmosQueue",
            "metadata": {"name": "orders", "namespace": "shop", "uid": "q-uid"},
            "spec": {"endpoint": "https://acct.documents.azure.com:443/", "credentials": credentials,
                     "database": "shop", "container": "orders"}
        }))
        .unwrap();
        q.metadata.generation = Some(1);
        q
    }

    fn group(extra: serde_json::Value) -> QueueConsumerGroup {
        let mut spec = json!({
            "queueRef": {"name": "orders"},
            "template": {"metadata": {"labels": {"team": "billing"}},
                         "spec": {"containers": [{"name": "app", "image": "example/billing:1"}]}},
            "app": {"port": 8080, "path": "/orders"}
        });
        spec.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        serde_json::from_value(json!({
            "apiVersion": "cosmosq.io/v1alpha1", "kind": "QueueConsumerGroup",
            "metadata": {"name": "billing", "namespace": "shop", "uid": "g-uid"},
            "spec": spec
        }))
        .unwrap()
    }

    /// Validated, then built: the reconciler's path.
    fn build(
        g: &QueueConsumerGroup,
        q: &CosmosQueue,
        defaults: &Defaults,
    ) -> Result<Deployment, SpecError> {
        deployment(g, &crate::spec::group(g)?, q, &[], defaults)
    }

    fn build_hpa(g: &QueueConsumerGroup) -> Result<Option<HorizontalPodAutoscaler>, SpecError> {
        hpa(g, &crate::spec::group(g)?)
    }

    fn defaults() -> Defaults {
        Defaults::new("ghcr.io/cosmosq/cosmosq-sidecar:0.1.0")
    }

    fn key_queue() -> CosmosQueue {
        queue(json!({"secretKeyRef": {"name": "cosmos-key"}}))
    }

    /// A queue named `name` on the container `container`, with its own key Secret.
    fn other_queue(name: &str, container: &str) -> CosmosQueue {
        let mut q = queue(json!({"secretKeyRef": {"name": format!("{name}-key")}}));
        q.metadata.name = Some(name.into());
        q.spec.container = container.into();
        q
    }

    #[test]
    fn a_group_publishes_to_queues_whose_topics_are_their_own() {
        let g = group(json!({"publishTo": [{"queueRef": {"name": "invoices"}},
                                           {"queueRef": {"name": "receipts"}}]}));
        let settings = crate::spec::group(&g).unwrap();
        let built =
            |targets: &[CosmosQueue]| deployment(&g, &settings, &key_queue(), targets, &defaults());
        let d = built(&[
            other_queue("invoices", "invoices"),
            other_queue("receipts", "receipts"),
        ])
        .unwrap();
        let volumes: Vec<String> = d
            .spec
            .unwrap()
            .template
            .spec
            .unwrap()
            .volumes
            .unwrap()
            .into_iter()
            .filter_map(|v| Some(format!("{}={}", v.name, v.secret?.secret_name?)))
            .collect();
        assert_eq!(
            volumes,
            [
                "cosmosq-account-key=cosmos-key",
                "cosmosq-publish-invoices=invoices-key",
                "cosmosq-publish-receipts=receipts-key"
            ]
        );
        // Two queues on one container, or one on the group's own: one topic, two queues.
        for targets in [
            vec![other_queue("invoices", "orders")],
            vec![
                other_queue("invoices", "bills"),
                other_queue("receipts", "bills"),
            ],
        ] {
            let e = built(&targets).unwrap_err();
            assert_eq!(e.field, "spec.publishTo");
            assert!(e.reason.contains("which is the topic"), "{e}");
        }
    }

    #[test]
    fn the_templates_containers_cannot_mount_the_operators_volumes() {
        for (template, field) in [
            (
                json!({"spec": {"containers": [{"name": "app", "image": "a",
                    "volumeMounts": [{"name": "cosmosq-account-key", "mountPath": "/k"}]}]}}),
                "spec.template.spec.containers",
            ),
            (
                json!({"spec": {"containers": [{"name": "app", "image": "a"}],
                    "initContainers": [{"name": "init", "image": "a",
                        "volumeMounts": [{"name": "cosmosq-publish-invoices", "mountPath": "/k"}]}]}}),
                "spec.template.spec.containers",
            ),
            (
                json!({"spec": {"containers": [{"name": "app", "image": "a"}],
                    "volumes": [{"name": "cosmosq-account-key", "emptyDir": {}}]}}),
                "spec.template.spec.volumes",
            ),
        ] {
            let e = build(
                &group(json!({"template": template})),
                &key_queue(),
                &defaults(),
            )
            .unwrap_err();
            assert_eq!(e.field, field, "{e}");
        }
    }

    #[test]
    fn a_queue_to_publish_to_on_another_identity_is_refused() {
        let g = group(json!({"publishTo": [{"queueRef": {"name": "audit"}}]}));
        let settings = crate::spec::group(&g).unwrap();
        let on_identity = |name: &str, client: &str| {
            let mut q = queue(json!({"workloadIdentity": {"clientId": client}}));
            q.metadata.name = Some(name.into());
            q.spec.container = name.into();
            q
        };
        let audit = on_identity("audit", "id-2");
        for consumed in [key_queue(), on_identity("orders", "id-1")] {
            let e = deployment(
                &g,
                &settings,
                &consumed,
                std::slice::from_ref(&audit),
                &defaults(),
            )
            .unwrap_err();
            assert_eq!(e.field, "spec.publishTo");
            assert!(e.reason.contains("uses workload identity id-2"), "{e}");
        }
        // The same identity as the group's own queue: its pods have it.
        let d = deployment(
            &g,
            &settings,
            &on_identity("orders", "id-2"),
            &[audit],
            &defaults(),
        );
        assert!(d.is_ok(), "{d:?}");
    }

    #[test]
    fn a_long_or_dotted_queue_name_makes_a_valid_volume_name_of_its_own() {
        let long = |end: char| format!("{}{end}", "a".repeat(62));
        let names: Vec<String> = [
            long('b'),
            long('c'),
            "short".into(),
            "a.b".into(),
            "a-b".into(),
        ]
        .iter()
        .map(|name| publish_key_volume(&other_queue(name, name)))
        .collect();
        for name in &names {
            assert!(name.len() <= 63, "{name}");
            assert!(!name.ends_with('-'), "{name}");
        }
        assert_ne!(names[0], names[1], "told apart");
        assert_eq!(names[2], "cosmosq-publish-short");
        assert!(!names[3].contains('.'), "a DNS label: {}", names[3]);
        assert_ne!(names[3], names[4], "told apart");
    }

    fn env_map(d: &Deployment) -> BTreeMap<String, String> {
        let pod = d.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
        let sidecar = pod
            .containers
            .iter()
            .find(|c| c.name == SIDECAR_CONTAINER)
            .unwrap();
        sidecar
            .env
            .as_ref()
            .unwrap()
            .iter()
            .map(|e| {
                let value = e.value.clone().unwrap_or_else(|| {
                    format!(
                        "fieldRef:{}",
                        e.value_from
                            .as_ref()
                            .unwrap()
                            .field_ref
                            .as_ref()
                            .unwrap()
                            .field_path
                    )
                });
                (e.name.clone(), value)
            })
            .collect()
    }

    #[test]
    fn the_deployment_runs_the_app_with_the_sidecar_configured_from_both_specs() {
        let d = build(
            &group(json!({"deliveryMode": "stream", "ordered": true})),
            &key_queue(),
            &defaults(),
        )
        .unwrap();
        let env = env_map(&d);
        let expected = [
            ("COSMOSQ_ENDPOINT", "https://acct.documents.azure.com:443/"),
            ("COSMOSQ_AUTH", "key"),
            ("COSMOSQ_KEY_FILE", "/var/run/cosmosq/key"),
            ("COSMOSQ_DATABASE", "shop"),
            ("COSMOSQ_QUEUE", "orders"),
            ("COSMOSQ_PARTITION_KEY_PATH", "/pk"),
            ("COSMOSQ_GROUP", "billing"),
            ("COSMOSQ_DELIVERY_MODE", "stream"),
            ("COSMOSQ_EXCLUSIVE_WRITES", "lease"),
            ("COSMOSQ_START_FROM", "now"),
            ("COSMOSQ_ORDERED", "true"),
            ("COSMOSQ_APP_PORT", "8080"),
            ("COSMOSQ_APP_PATH", "/orders"),
            ("COSMOSQ_APP_FORMAT", "cloudevents"),
            ("COSMOSQ_APP_TIMEOUT", "1m"),
            ("COSMOSQ_MAX_CONCURRENCY", "16"),
            ("COSMOSQ_MAX_DELIVERY_ATTEMPTS", "10"),
            ("COSMOSQ_LOCK_DURATION", "1m"),
            ("COSMOSQ_PROBE_LISTEN", "0.0.0.0:9464"),
            ("COSMOSQ_LISTEN", "127.0.0.1:3500"),
            // The drain: the longest delivery and 10 s to settle it.
            ("COSMOSQ_GRACE_PERIOD", "1m 10s"),
            // Settings the spec does not name are written as the sidecar's defaults.
            ("COSMOSQ_LEASE_EXPIRE", "1m"),
            ("POD_NAME", "fieldRef:metadata.name"),
            ("POD_NAMESPACE", "fieldRef:metadata.namespace"),
        ];
        for (name, value) in expected {
            assert_eq!(env.get(name).map(String::as_str), Some(value), "{name}");
        }
        assert!(
            !env.values().any(|v| v.contains("cosmos-key")),
            "no secret material in env"
        );

        let pod = d.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
        assert_eq!(
            pod.containers[0].name, "app",
            "the app is untouched and first"
        );
        let sidecar = &pod.containers[1];
        assert_eq!(
            sidecar.image.as_deref(),
            Some("ghcr.io/cosmosq/cosmosq-sidecar:0.1.0")
        );
        let sc = sidecar.security_context.as_ref().unwrap();
        assert_eq!(sc.run_as_non_root, Some(true));
        assert_eq!(sc.read_only_root_filesystem, Some(true));
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        assert_eq!(
            sc.capabilities.as_ref().unwrap().drop.as_deref(),
            Some(&["ALL".to_string()][..])
        );
        let readiness = sidecar
            .readiness_probe
            .as_ref()
            .unwrap()
            .http_get
            .as_ref()
            .unwrap();
        assert_eq!(
            (readiness.path.as_deref(), &readiness.port),
            (Some("/readyz"), &IntOrString::Int(9464))
        );
        // app.timeout 60 s: the sidecar drains for 70 s, the pod's grace adds 15 s for the app.
        assert_eq!(pod.termination_grace_period_seconds, Some(85));
        assert_eq!(pod.service_account_name.as_deref(), Some("billing-workers"));
        let volume = pod
            .volumes
            .as_ref()
            .unwrap()
            .iter()
            .find(|v| v.name == KEY_VOLUME)
            .unwrap();
        assert_eq!(
            volume.secret.as_ref().unwrap().secret_name.as_deref(),
            Some("cosmos-key")
        );
        assert_eq!(
            volume.secret.as_ref().unwrap().items.as_ref().unwrap()[0].key,
            "key"
        );

        let spec = d.spec.as_ref().unwrap();
        assert_eq!(spec.replicas, None, "the scaler owns replicas");
        let pod_labels = spec
            .template
            .metadata
            .as_ref()
            .unwrap()
            .labels
            .as_ref()
            .unwrap();
        assert_eq!(pod_labels["team"], "billing", "the user's labels stay");
        for (k, v) in spec.selector.match_labels.as_ref().unwrap() {
            assert_eq!(pod_labels.get(k), Some(v), "the selector matches the pods");
        }
        let owner = &d.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.controller),
            ("QueueConsumerGroup", "billing", Some(true))
        );
        assert_eq!(d.metadata.name.as_deref(), Some("billing-workers"));
        assert_eq!(d.metadata.namespace.as_deref(), Some("shop"));
    }

    #[test]
    fn workload_identity_labels_the_pods_and_annotates_the_service_account() {
        let q = queue(json!({"workloadIdentity": {"clientId": "11111111-2222"}}));
        let g = group(json!({}));
        let d = build(&g, &q, &defaults()).unwrap();
        assert_eq!(env_map(&d)["COSMOSQ_AUTH"], "identity");
        assert!(!env_map(&d).contains_key("COSMOSQ_KEY_FILE"));
        let labels = d.spec.unwrap().template.metadata.unwrap().labels.unwrap();
        assert_eq!(labels["azure.workload.identity/use"], "true");
        let sa = service_account(&g, &q).unwrap();
        assert_eq!(
            sa.metadata.annotations.unwrap()["azure.workload.identity/client-id"],
            "11111111-2222"
        );
    }

    #[test]
    fn dapr_api_tokens_reach_the_sidecar_and_every_app_container_from_the_named_secret() {
        let mut spec = json!({"template": {"spec": {"containers": [
            {"name": "app", "image": "a", "env": [{"name": "DAPR_API_TOKEN", "value": "stale"}]},
            {"name": "worker", "image": "w"}]}}});
        spec["app"] = json!({"port": 8080, "apiTokenSecret": "billing-tokens"});
        let d = build(&group(spec), &key_queue(), &defaults()).unwrap();
        let pod = d.spec.unwrap().template.spec.unwrap();
        assert_eq!(pod.containers.len(), 3);
        for container in &pod.containers {
            // The sidecar under its own names, the app's containers under Dapr's.
            let (api, app) = if container.name == SIDECAR_CONTAINER {
                ("COSMOSQ_API_TOKEN", "COSMOSQ_APP_API_TOKEN")
            } else {
                ("DAPR_API_TOKEN", "APP_API_TOKEN")
            };
            let from = |name: &str| {
                let found: Vec<_> = container
                    .env
                    .iter()
                    .flatten()
                    .filter(|v| v.name == name)
                    .collect();
                assert_eq!(found.len(), 1, "{} {name}", container.name);
                let key = found[0]
                    .value_from
                    .as_ref()
                    .and_then(|f| f.secret_key_ref.as_ref())
                    .unwrap_or_else(|| panic!("{} {name}: not from the Secret", container.name));
                (key.name.clone(), key.key.clone())
            };
            assert_eq!(
                from(api),
                ("billing-tokens".into(), "dapr-api-token".into())
            );
            assert_eq!(from(app), ("billing-tokens".into(), "app-api-token".into()));
        }
        // Without the setting, no token is set anywhere.
        let d = build(&group(json!({})), &key_queue(), &defaults()).unwrap();
        let pod = d.spec.unwrap().template.spec.unwrap();
        assert!(pod
            .containers
            .iter()
            .flat_map(|c| c.env.iter().flatten())
            .all(|v| !v.name.ends_with("API_TOKEN")));
    }

    #[test]
    fn generated_api_tokens_are_random_the_groups_and_used_as_a_named_secret_is() {
        let mut g = group(json!({}));
        g.spec.app.generate_api_tokens = true;
        assert_eq!(api_token_secret(&g).as_deref(), Some("billing-api-tokens"));
        let (one, two) = (
            generated_api_tokens(&g).unwrap(),
            generated_api_tokens(&g).unwrap(),
        );
        let tokens = one.string_data.as_ref().unwrap();
        let (api, app) = (&tokens[API_TOKEN_KEY], &tokens[APP_API_TOKEN_KEY]);
        assert_eq!((api.len(), app.len()), (43, 43), "256 bits each");
        assert_ne!(api, app);
        assert_ne!(
            api_tokens_digest(&one),
            api_tokens_digest(&two),
            "drawn anew"
        );
        assert_eq!(one.immutable, Some(true));
        let owner = &one.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.controller, owner.uid.as_str()),
            (Some(true), "g-uid")
        );
        // As read back (`data`), the digest is the one of the values written (`stringData`).
        let mut read = one.clone();
        read.data = Some(
            tokens
                .iter()
                .map(|(k, v)| (k.clone(), k8s_openapi::ByteString(v.clone().into_bytes())))
                .collect(),
        );
        read.string_data = None;
        assert_eq!(api_tokens_digest(&read), api_tokens_digest(&one));
        // The pods read them from it, as from a Secret the group names.
        let d = build(&g, &key_queue(), &defaults()).unwrap();
        let pod = d.spec.unwrap().template.spec.unwrap();
        for container in &pod.containers {
            assert!(
                container.env.iter().flatten().any(|v| v
                    .value_from
                    .as_ref()
                    .and_then(|f| f.secret_key_ref.as_ref())
                    .is_some_and(|r| r.name == "billing-api-tokens")),
                "{}",
                container.name
            );
        }
    }

    #[test]
    fn invalid_templates_are_named() {
        // Deeper than JSON is read (a template the API server could not have sent).
        let mut deep = json!({"containers": []});
        for _ in 0..200 {
            deep = json!({ "spec": deep });
        }
        let cases = [
            (json!({ "template": deep }), "spec.template"),
            (
                json!({"template": {"spec": {"containers": []}}}),
                "spec.template.spec.containers",
            ),
            (
                json!({"template": {"spec": {"containers": [{"name": "cosmosq-sidecar", "image": "x"}]}}}),
                "spec.template.spec.containers",
            ),
            (json!({"template": {"metadata": {}}}), "spec.template.spec"),
            (
                json!({"template": {"spec": {"containers": "nope"}}}),
                "spec.template",
            ),
            (
                json!({"sidecar": {"resources": {"limits": 7}}}),
                "spec.sidecar.resources",
            ),
            (json!({"group": "lease"}), "spec.group"),
            // Any account but the group's own: the worker role would be bound to it.
            (
                json!({"template": {"spec": {"serviceAccountName": "default",
                    "containers": [{"name": "app", "image": "a"}]}}}),
                "spec.template.spec.serviceAccountName",
            ),
            // The sidecar's localhost API would be the node's.
            (
                json!({"template": {"spec": {"hostNetwork": true,
                    "containers": [{"name": "app", "image": "a"}]}}}),
                "spec.template.spec.hostNetwork",
            ),
        ];
        for (extra, field) in cases {
            match build(&group(extra.clone()), &key_queue(), &defaults()) {
                Err(SpecError { field: f, .. }) => assert_eq!(f, field, "{extra}"),
                other => panic!("{extra}: expected an error naming {field}, got {other:?}"),
            }
        }
    }

    #[test]
    fn typos_in_the_pod_template_are_refused_not_dropped() {
        for (extra, named) in [
            (
                json!({"template": {"spec": {"containers": [{"name": "app", "image": "a",
                    "volumeMount": [{"name": "v", "mountPath": "/v"}]}]}}}),
                "spec.template.spec.containers[0].volumeMount",
            ),
            (
                json!({"template": {"metadata": {"labels": {"a": "b"}, "annotation": {}},
                    "spec": {"containers": [{"name": "app", "image": "a"}]}}}),
                "spec.template.metadata.annotation",
            ),
            (
                json!({"sidecar": {"resources": {"limit": {"memory": "1Gi"}}}}),
                "spec.sidecar.resources.limit",
            ),
        ] {
            match build(&group(extra.clone()), &key_queue(), &defaults()) {
                Err(SpecError { reason, .. }) => {
                    assert!(reason.contains(named), "{reason}");
                    assert!(reason.contains("unknown field"), "{reason}");
                }
                other => panic!("{extra}: expected the typo {named} named, got {other:?}"),
            }
        }
        // Every field a Kubernetes type has passes, with explicit nulls and empty objects.
        let g = group(
            json!({"template": {"metadata": {"labels": {"tier": "jobs"}},
            "spec": {"nodeSelector": null, "securityContext": {},
                     "containers": [{"name": "app", "image": "a", "ports": [{"containerPort": 80}],
                                     "resources": {"limits": {"cpu": "1"}},
                                     "volumeMounts": [{"name": "v", "mountPath": "/v"}]}],
                     "volumes": [{"name": "v", "emptyDir": {}}]}}}),
        );
        build(&g, &key_queue(), &defaults()).unwrap();
    }

    #[test]
    fn a_rotated_key_changes_the_worker_template() {
        let mut d = build(&group(json!({})), &key_queue(), &defaults()).unwrap();
        with_digest(&mut d, KEY_DIGEST_ANNOTATION, key_digest(b"primary"));
        let annotation = |d: &Deployment| {
            d.spec
                .as_ref()
                .unwrap()
                .template
                .metadata
                .as_ref()
                .unwrap()
                .annotations
                .as_ref()
                .unwrap()[KEY_DIGEST_ANNOTATION]
                .clone()
        };
        let before = annotation(&d);
        assert_eq!(before.len(), 16);
        assert!(!before.contains("primary"));
        with_digest(&mut d, KEY_DIGEST_ANNOTATION, key_digest(b"primary"));
        assert_eq!(annotation(&d), before, "the same key, the same template");
        with_digest(&mut d, KEY_DIGEST_ANNOTATION, key_digest(b"secondary"));
        assert_ne!(annotation(&d), before, "a new key, a new template");
    }

    #[test]
    fn scale_in_waits_for_the_drain_and_the_grace_follows_the_app_timeout() {
        let g = group(json!({"app": {"port": 8080, "timeout": "5m"},
            "template": {"spec": {"terminationGracePeriodSeconds": 10, "containers": [
                {"name": "app", "image": "example/app"},
                {"name": "helper", "image": "example/helper",
                 "lifecycle": {"preStop": {"exec": {"command": ["/bin/flush"]}}}}]}}}));
        let pod = build(&g, &key_queue(), &defaults())
            .unwrap()
            .spec
            .unwrap()
            .template
            .spec
            .unwrap();
        let container = |name: &str| pod.containers.iter().find(|c| c.name == name).unwrap();
        let pre_stop = |name: &str| {
            container(name)
                .lifecycle
                .as_ref()
                .unwrap()
                .pre_stop
                .clone()
                .unwrap()
        };
        let drained = pre_stop("app").http_get.unwrap();
        assert_eq!(
            (drained.path.as_deref(), &drained.port),
            (Some("/drained"), &IntOrString::Int(PROBE_PORT))
        );
        assert!(
            pre_stop("helper").exec.is_some(),
            "a preStop of the user's is kept"
        );
        assert!(container(SIDECAR_CONTAINER).lifecycle.is_none());
        let grace = container(SIDECAR_CONTAINER)
            .env
            .iter()
            .flatten()
            .find(|e| e.name == "COSMOSQ_GRACE_PERIOD")
            .and_then(|e| e.value.clone());
        assert_eq!(grace.as_deref(), Some("5m 10s"));
        // The template's 10 s would kill a drain in progress: raised to cover it.
        assert_eq!(pod.termination_grace_period_seconds, Some(325));
    }

    #[test]
    fn only_the_sidecar_gets_an_api_token_and_the_worker_role_is_bound() {
        let g = group(json!({}));
        let binding = role_binding(&g, "billing-workers", &defaults()).unwrap();
        assert_eq!(binding.subjects.unwrap()[0].name, "billing-workers");
        assert_eq!(
            (
                binding.role_ref.kind.as_str(),
                binding.role_ref.name.as_str()
            ),
            ("ClusterRole", WORKER_CLUSTER_ROLE)
        );
        let d = build(&g, &key_queue(), &defaults()).unwrap();
        let pod = d.spec.unwrap().template.spec.unwrap();
        assert_eq!(pod.automount_service_account_token, Some(false));
        let mounts = |name: &str| -> Vec<String> {
            pod.containers
                .iter()
                .find(|c| c.name == name)
                .unwrap()
                .volume_mounts
                .iter()
                .flatten()
                .map(|m| m.mount_path.clone())
                .collect()
        };
        assert!(mounts("app").is_empty(), "{:?}", mounts("app"));
        assert!(mounts(SIDECAR_CONTAINER).contains(&API_TOKEN_DIR.to_owned()));
        let token = pod
            .volumes
            .unwrap()
            .into_iter()
            .find(|v| v.name == API_TOKEN_VOLUME)
            .unwrap()
            .projected
            .unwrap();
        let sources = token.sources.unwrap();
        assert!(sources[0].service_account_token.is_some());
        assert_eq!(
            sources[1].config_map.as_ref().unwrap().name,
            "kube-root-ca.crt"
        );
        // A template that asks for the automounted token keeps it (for every container).
        let g = group(
            json!({"template": {"spec": {"automountServiceAccountToken": true,
            "containers": [{"name": "app", "image": "example/app"}]}}}),
        );
        let pod = build(&g, &key_queue(), &defaults())
            .unwrap()
            .spec
            .unwrap()
            .template
            .spec
            .unwrap();
        assert_eq!(pod.automount_service_account_token, Some(true));
        assert!(!pod
            .volumes
            .iter()
            .flatten()
            .any(|v| v.name == API_TOKEN_VOLUME));
    }

    #[test]
    fn hpa_mode_scales_on_the_backlog_metric() {
        assert!(
            build_hpa(&group(json!({}))).unwrap().is_none(),
            "Direct mode owns no HPA"
        );
        let g = group(
            json!({"scaling": {"mode": "HPA", "minReplicas": 0, "maxReplicas": 20,
            "targetBacklogPerReplica": 250, "scaleDownStabilization": "2m"}}),
        );
        let hpa = build_hpa(&g).unwrap().unwrap();
        let spec = hpa.spec.unwrap();
        assert_eq!(spec.scale_target_ref.name, "billing-workers");
        assert_eq!((spec.min_replicas, spec.max_replicas), (Some(1), 20));
        let external = spec.metrics.unwrap()[0].external.clone().unwrap();
        assert_eq!(external.metric.name, "cosmosq_backlog_messages");
        let labels = external.metric.selector.unwrap().match_labels.unwrap();
        assert_eq!(
            (labels["queue"].as_str(), labels["group"].as_str()),
            ("orders", "billing")
        );
        assert_eq!(external.target.average_value, Some(Quantity("250".into())));
        assert_eq!(
            spec.behavior
                .unwrap()
                .scale_down
                .unwrap()
                .stabilization_window_seconds,
            Some(120)
        );
    }

    #[test]
    fn dapr_env_points_the_apps_at_the_sidecar_and_keeps_their_own() {
        let dapr_port = |g: &QueueConsumerGroup| {
            let d = build(g, &key_queue(), &defaults()).unwrap();
            let pod = d.spec.unwrap().template.spec.unwrap();
            pod.containers
                .iter()
                .map(|c| {
                    let value = |name: &str| {
                        c.env
                            .iter()
                            .flatten()
                            .find(|v| v.name == name)
                            .and_then(|v| v.value.clone())
                    };
                    (c.name.clone(), value(DAPR_HTTP_PORT), value(DAPR_GRPC_PORT))
                })
                .collect::<Vec<_>>()
        };
        let off = dapr_port(&group(json!({})));
        assert!(
            off.iter()
                .all(|(_, http, grpc)| http.is_none() && grpc.is_none()),
            "{off:?}"
        );
        let on = group(json!({
            "app": {"port": 8080, "daprEnv": true},
            "template": {"spec": {"containers": [
                {"name": "app", "image": "example/app:1"},
                {"name": "helper", "image": "example/helper:1",
                 "env": [{"name": "DAPR_HTTP_PORT", "value": "3600"}]}]}}
        }));
        assert_eq!(
            dapr_port(&on),
            [
                (
                    "app".to_owned(),
                    Some("3500".to_owned()),
                    Some("50001".to_owned())
                ),
                (
                    "helper".to_owned(),
                    Some("3600".to_owned()),
                    Some("50001".to_owned())
                ),
                (SIDECAR_CONTAINER.to_owned(), None, None),
            ]
        );
    }

    #[test]
    fn sidecar_env_adds_to_the_sidecars_settings_and_never_replaces_them() {
        let g = group(json!({"sidecar": {"env": [
            {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": "http://otel:4318"},
            {"name": "OTEL_EXPORTER_OTLP_HEADERS",
             "valueFrom": {"secretKeyRef": {"name": "otel", "key": "headers"}}},
            {"name": "COSMOSQ_GROUP", "value": "someone-elses"},
            {"name": "POD_NAME", "value": "fixed"}]}}));
        let d = build(&g, &key_queue(), &defaults()).unwrap();
        let pod = d.spec.unwrap().template.spec.unwrap();
        let sidecar = pod
            .containers
            .iter()
            .find(|c| c.name == SIDECAR_CONTAINER)
            .unwrap();
        let vars = sidecar.env.clone().unwrap();
        let named = |name: &str| vars.iter().filter(|v| v.name == name).collect::<Vec<_>>();
        assert_eq!(
            named("OTEL_EXPORTER_OTLP_ENDPOINT")[0].value.as_deref(),
            Some("http://otel:4318")
        );
        let headers = named("OTEL_EXPORTER_OTLP_HEADERS");
        assert_eq!(headers.len(), 1);
        assert!(headers[0].value.is_none(), "the secret stays a reference");
        for name in [env_names::GROUP, env_names::POD_NAME] {
            let set = named(name);
            assert_eq!(set.len(), 1, "{name} once: {set:?}");
            assert_ne!(set[0].value.as_deref(), Some("someone-elses"));
            assert_ne!(set[0].value.as_deref(), Some("fixed"));
        }
        let app = pod.containers.iter().find(|c| c.name == "app").unwrap();
        assert!(
            app.env
                .iter()
                .flatten()
                .all(|v| !v.name.starts_with("OTEL_")),
            "the app's environment is its own"
        );
    }

    #[test]
    fn hpa_behavior_is_the_specs_with_the_stabilization_filled_in() {
        let behavior = json!({
            "scaleUp": {"stabilizationWindowSeconds": 30,
                        "policies": [{"type": "Pods", "value": 4, "periodSeconds": 60}]},
            "scaleDown": {"policies": [{"type": "Percent", "value": 10, "periodSeconds": 60}],
                          "selectPolicy": "Min"}
        });
        let g = group(
            json!({"scaling": {"mode": "HPA", "scaleDownStabilization": "10m",
                                         "behavior": behavior}}),
        );
        let hpa = build_hpa(&g).unwrap().unwrap();
        let mut expected = behavior.clone();
        expected["scaleDown"]["stabilizationWindowSeconds"] = json!(600);
        assert_eq!(
            serde_json::to_value(hpa.spec.unwrap().behavior).unwrap(),
            expected
        );
        // A window of its own wins over scaleDownStabilization.
        let mut own = behavior.clone();
        own["scaleDown"]["stabilizationWindowSeconds"] = json!(45);
        let g = group(json!({"scaling": {"mode": "HPA", "behavior": own}}));
        let spec = build_hpa(&g).unwrap().unwrap().spec.unwrap();
        assert_eq!(
            spec.behavior
                .unwrap()
                .scale_down
                .unwrap()
                .stabilization_window_seconds,
            Some(45)
        );
    }

    #[test]
    fn a_paused_hpa_group_owns_no_hpa() {
        for (annotation, value) in [
            (crate::spec::PAUSED_REPLICAS, "2"),
            (crate::spec::PAUSED, "true"),
            (crate::spec::PAUSED_REPLICAS, "unreadable"),
        ] {
            let mut g = group(json!({"scaling": {"mode": "HPA"}}));
            g.metadata.annotations = Some(BTreeMap::from([(annotation.into(), value.into())]));
            assert!(build_hpa(&g).unwrap().is_none(), "{annotation}: {value}");
        }
    }

    /// Every key of `input` is in `output` (serde dropped nothing as unknown), at `path`.
    fn nothing_dropped(input: &serde_json::Value, output: &serde_json::Value, path: &str) {
        if let (Some(input), Some(output)) = (input.as_object(), output.as_object()) {
            for (key, value) in input {
                let here = format!("{path}.{key}");
                let Some(kept) = output.get(key) else {
                    panic!("{here} is not a field of the resource");
                };
                nothing_dropped(value, kept, &here);
            }
        }
    }

    #[test]
    fn the_examples_are_valid_and_build() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
        let mut queues = Vec::new();
        let mut groups = Vec::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let text = std::fs::read_to_string(&path).unwrap();
            for document in serde_yaml::Deserializer::from_str(&text) {
                let value: serde_json::Value = serde::Deserialize::deserialize(document).unwrap();
                let file = path.file_name().unwrap().to_string_lossy().to_string();
                match value["kind"].as_str() {
                    Some("CosmosQueue") => {
                        let cq: CosmosQueue = serde_json::from_value(value.clone()).unwrap();
                        nothing_dropped(&value, &serde_json::to_value(&cq).unwrap(), &file);
                        queues.push(cq);
                    }
                    Some("QueueConsumerGroup") => {
                        let qcg: QueueConsumerGroup =
                            serde_json::from_value(value.clone()).unwrap();
                        nothing_dropped(&value, &serde_json::to_value(&qcg).unwrap(), &file);
                        groups.push(qcg);
                    }
                    _ => {}
                }
            }
        }
        assert_eq!((queues.len(), groups.len()), (2, 3));
        for mut qcg in groups {
            qcg.metadata.uid = Some("uid".into());
            let queue = queues
                .iter()
                .find(|q| q.metadata.name.as_ref() == Some(&qcg.spec.queue_ref.name))
                .expect("the group's queue is an example too");
            build(&qcg, queue, &defaults()).unwrap();
            build_hpa(&qcg).unwrap();
        }
        for queue in &queues {
            crate::spec::queue(&queue.spec).unwrap();
        }
    }
}
