//! The validate step: each resource's spec parsed once into the typed settings every later
//! step uses (the engine's queue and group settings, the scaling policy, the app's timeout).
//! The schema and its CEL rules refuse most bad specs at `kubectl apply`; what they cannot
//! check (a duration's range, a reserved name) is refused here with the field named, and
//! nothing is written for it.

use std::time::Duration;

use cosmosq_crds as crd;
use cosmosq_crds::{CosmosQueueSpec, QueueConsumerGroup, ScalingMode, ThroughputMode};
use cosmosq_queue::backoff::RetryPolicy;
use cosmosq_queue::config::{self, GroupConfig, QueueConfig, Throughput};
use cosmosq_scaling::Policy;
use cosmosq_sidecar::app::AppFormat;
use cosmosq_sidecar::settings::{AppMode, AppProtocol};
use kube::ResourceExt;

/// A field of a spec that cannot be used as it is; only its owner can fix it, so what refused
/// it waits for a change rather than retrying.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct SpecError {
    /// The field's path in the resource, as `kubectl explain` names it.
    pub field: &'static str,
    /// Why it was refused.
    pub reason: String,
}

/// A refusal of `field`.
pub fn invalid(field: &'static str, reason: impl std::fmt::Display) -> SpecError {
    SpecError {
        field,
        reason: reason.to_string(),
    }
}

/// The longest `spec.app.timeout`: it bounds the workers' termination grace, which node drains
/// and cluster upgrades wait for (AKS gives a node 30 minutes by default). The CRD refuses
/// more too; work longer than this keeps its message through lock promotion (`promoteAfter`).
pub const MAX_APP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3600);
/// Why a longer timeout is refused.
pub const APP_TIMEOUT_LIMIT: &str = "at most 1h: it bounds the pods' termination grace, which node drains and upgrades wait for; longer work is kept by lock promotion (promoteAfter)";

/// The one parser of the CRDs' durations (`30s`, `5m`, `1h30m`).
fn duration(field: &'static str, text: &str) -> Result<Duration, SpecError> {
    humantime::parse_duration(text).map_err(|e| invalid(field, format!("{text:?}: {e}")))
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

// The CRDs' choices as the engine and the sidecar name them: each table written once.

/// `spec.deliveryMode`.
pub fn delivery_mode(mode: crd::GroupDeliveryMode) -> config::DeliveryMode {
    match mode {
        crd::GroupDeliveryMode::Exclusive => config::DeliveryMode::Exclusive,
        crd::GroupDeliveryMode::Stream => config::DeliveryMode::Stream,
    }
}

/// `spec.exclusiveWrites`.
pub fn exclusive_writes(writes: crd::GroupExclusiveWrites) -> config::ExclusiveWrites {
    match writes {
        crd::GroupExclusiveWrites::Lease => config::ExclusiveWrites::Lease,
        crd::GroupExclusiveWrites::Claims => config::ExclusiveWrites::Claims,
    }
}

/// `spec.startFrom`.
pub fn start_from(start: crd::GroupStartFrom) -> config::StartFrom {
    match start {
        crd::GroupStartFrom::Now => config::StartFrom::Now,
        crd::GroupStartFrom::Beginning => config::StartFrom::Beginning,
    }
}

/// `spec.app.mode`.
pub fn app_mode(mode: crd::GroupAppMode) -> AppMode {
    match mode {
        crd::GroupAppMode::Push => AppMode::Push,
        crd::GroupAppMode::Pull => AppMode::Pull,
    }
}

/// `spec.app.protocol`.
pub fn app_protocol(protocol: crd::GroupAppProtocol) -> AppProtocol {
    match protocol {
        crd::GroupAppProtocol::Http => AppProtocol::Http,
        crd::GroupAppProtocol::Grpc => AppProtocol::Grpc,
    }
}

/// `spec.app.format`.
pub fn app_format(format: crd::GroupAppFormat) -> AppFormat {
    match format {
        crd::GroupAppFormat::Cloudevents => AppFormat::Cloudevents,
        crd::GroupAppFormat::Raw => AppFormat::Raw,
    }
}

/// The engine's queue settings from a CosmosQueue.
pub fn queue(spec: &CosmosQueueSpec) -> Result<QueueConfig, SpecError> {
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

/// Everything the operator uses of a QueueConsumerGroup's spec, parsed and checked.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupSettings {
    /// The engine's group settings: the same the sidecars are given.
    pub config: GroupConfig,
    /// The scaling decision's policy.
    pub policy: Policy,
    /// The longest one delivery to the app may take; the drain is sized from it.
    pub app_timeout: Duration,
    /// The scale-down window, in the HPA's whole seconds (HPA mode).
    pub scale_down_stabilization_seconds: i32,
}

/// The consumer group's name in the queue: `spec.group`, or the resource's name.
pub fn group_name(qcg: &QueueConsumerGroup) -> String {
    qcg.spec.group.clone().unwrap_or_else(|| qcg.name_any())
}

/// The annotation that holds a group's workers at a count (as KEDA's
/// `autoscaling.keda.sh/paused-replicas`): no scaling decision, HPA or `spec.replicas` moves
/// them while it is set.
pub const PAUSED_REPLICAS: &str = "cosmosq.io/paused-replicas";
/// The annotation that holds a group's workers where they are (`"true"`).
pub const PAUSED: &str = "cosmosq.io/paused";
/// The annotation whose every new value asks for a reconcile now (Flux's
/// `reconcile.fluxcd.io/requestedAt`): e.g. after an admin created a queue's containers,
/// rather than at the next look 30 s later.
pub const RECONCILE_REQUESTED: &str = "cosmosq.io/reconcile-requested-at";

/// Who sets a group's replicas this round.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Control {
    /// The operator's scaling decision (`Direct`).
    Operator,
    /// The HorizontalPodAutoscaler the operator owns (`HPA`).
    Hpa,
    /// `spec.replicas`, as the scale subresource's users set it (`External`); `None` while
    /// it is unset (the workers stay where they are).
    External(Option<u32>),
    /// A pause annotation: at this count, or where they are (`None`).
    Paused(Option<u32>),
}

/// A pause annotation that cannot be read: the group is held where it is (what its user
/// wanted most likely), and told why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("annotation {annotation}: {value:?} is not {expected}; holding the workers where they are")]
pub struct PauseError {
    /// The annotation.
    pub annotation: &'static str,
    /// Its value.
    pub value: String,
    /// What it must be.
    pub expected: &'static str,
}

/// Who sets the group's replicas (pure: its mode, `spec.replicas` and pause annotations). A
/// pause wins over every mode; an unreadable one still pauses, with the error to report.
pub fn control(qcg: &QueueConsumerGroup) -> (Control, Option<PauseError>) {
    let annotations = qcg.annotations();
    if let Some(value) = annotations.get(PAUSED_REPLICAS) {
        return match value.trim().parse::<u32>() {
            Ok(n) => (Control::Paused(Some(n)), None),
            Err(_) => (
                Control::Paused(None),
                Some(PauseError {
                    annotation: PAUSED_REPLICAS,
                    value: value.clone(),
                    expected: "a whole number of replicas",
                }),
            ),
        };
    }
    if let Some(value) = annotations.get(PAUSED) {
        match value.trim().to_ascii_lowercase().as_str() {
            "true" => return (Control::Paused(None), None),
            "false" => {}
            _ => {
                return (
                    Control::Paused(None),
                    Some(PauseError {
                        annotation: PAUSED,
                        value: value.clone(),
                        expected: "\"true\" or \"false\"",
                    }),
                )
            }
        }
    }
    let control = match qcg.spec.scaling.mode {
        ScalingMode::Direct => Control::Operator,
        ScalingMode::Hpa => Control::Hpa,
        ScalingMode::External => Control::External(qcg.spec.replicas.map(|r| r.max(0) as u32)),
    };
    (control, None)
}

/// The ports the sidecar listens on in every worker pod.
const SIDECAR_PORTS: [i32; 3] = [3500, 50001, 9464];

/// The settings of a QueueConsumerGroup.
pub fn group(qcg: &QueueConsumerGroup) -> Result<GroupSettings, SpecError> {
    let s = &qcg.spec;
    let name = group_name(qcg);
    if name == cosmosq_queue::lease::LEASE_DOC_TYPE {
        return Err(invalid(
            "spec.group",
            "\"lease\" is reserved (it names the lease documents); set spec.group",
        ));
    }
    // The CRD refuses these; a group stored before it did is refused here, not by a sidecar
    // that cannot start.
    if let Some(port) = s.app.port.filter(|p| SIDECAR_PORTS.contains(p)) {
        return Err(invalid(
            "spec.app.port",
            format!(
                "{port} is the sidecar's (3500: Dapr's HTTP API, 50001: its gRPC API, 9464: \
                 probes); the app listens on another port"
            ),
        ));
    }
    let retry = RetryPolicy {
        max_delivery_attempts: s.retry.max_delivery_attempts.max(0) as u32,
        initial_backoff: duration("spec.retry.initialBackoff", &s.retry.initial_backoff)?,
        max_backoff: duration("spec.retry.maxBackoff", &s.retry.max_backoff)?,
        ..RetryPolicy::default()
    };
    let config = GroupConfig::new(name)
        .with_mode(delivery_mode(s.delivery_mode))
        .with_exclusive_writes(exclusive_writes(s.exclusive_writes))
        .with_start_from(start_from(s.start_from))
        .with_lock_duration(duration("spec.lockDuration", &s.lock_duration)?)
        .with_ordering(s.ordered)
        .with_retry(retry);
    config.validate().map_err(|e| invalid("spec", e))?;

    let scaling = &s.scaling;
    let stabilization = duration(
        "spec.scaling.scaleDownStabilization",
        &scaling.scale_down_stabilization,
    )?;
    let cooldown = duration(
        "spec.scaling.scaleToZeroCooldown",
        &scaling.scale_to_zero_cooldown,
    )?;
    let policy = Policy {
        min_replicas: scaling.min_replicas.max(0) as u32,
        max_replicas: scaling.max_replicas.max(0) as u32,
        target_backlog_per_replica: scaling.target_backlog_per_replica.max(1) as u64,
        scale_down_stabilization_ms: millis(stabilization),
        scale_to_zero_cooldown_ms: millis(cooldown),
        activation_threshold: scaling.activation_threshold.max(1) as u64,
    };
    for rule in s.app.subscription.iter().flat_map(|sub| &sub.rules) {
        if let Err(e) = cel::Program::compile(&rule.matches) {
            return Err(invalid(
                "spec.app.subscription.rules",
                format!("{:?} is not a CEL expression: {e}", rule.matches),
            ));
        }
    }
    if s.app
        .port
        .is_some_and(|p| u16::try_from(p).map_or(true, |p| p == 0))
    {
        // The CRD refuses it; an object stored under an older CRD may still carry one.
        return Err(invalid("spec.app.port", "must be 1-65535"));
    }
    let app_timeout = duration("spec.app.timeout", &s.app.timeout)?;
    if app_timeout > MAX_APP_TIMEOUT {
        return Err(invalid("spec.app.timeout", APP_TIMEOUT_LIMIT));
    }
    Ok(GroupSettings {
        config,
        policy,
        app_timeout,
        scale_down_stabilization_seconds: i32::try_from(stabilization.as_secs())
            .map_err(|_| invalid("spec.scaling.scaleDownStabilization", "too long"))?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn queue_spec(extra: serde_json::Value) -> CosmosQueueSpec {
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

    fn qcg(spec: serde_json::Value) -> QueueConsumerGroup {
        let mut base =
            json!({"queueRef": {"name": "orders"}, "template": {}, "app": {"port": 8080}});
        base.as_object_mut()
            .unwrap()
            .extend(spec.as_object().unwrap().clone());
        serde_json::from_value(json!({
            "apiVersion": "cosmosq.io/v1alpha1", "kind": "QueueConsumerGroup",
            "metadata": {"name": "billing", "namespace": "shop"},
            "spec": base
        }))
        .unwrap()
    }

    #[test]
    fn who_scales_follows_the_mode_replicas_and_pause_annotations() {
        let with = |spec: serde_json::Value, annotations: serde_json::Value| {
            let mut g = qcg(spec);
            g.metadata.annotations = serde_json::from_value(annotations).unwrap();
            control(&g)
        };
        let external = json!({"scaling": {"mode": "External"}, "replicas": 4});
        for (spec, annotations, expected) in [
            (json!({}), json!({}), Control::Operator),
            (json!({"replicas": 4}), json!({}), Control::Operator),
            (json!({"scaling": {"mode": "HPA"}}), json!({}), Control::Hpa),
            (external.clone(), json!({}), Control::External(Some(4))),
            (
                json!({"scaling": {"mode": "External"}}),
                json!({}),
                Control::External(None),
            ),
            // A pause wins over every mode.
            (
                external.clone(),
                json!({PAUSED_REPLICAS: "0"}),
                Control::Paused(Some(0)),
            ),
            (
                json!({"scaling": {"mode": "HPA"}}),
                json!({PAUSED_REPLICAS: " 2 "}),
                Control::Paused(Some(2)),
            ),
            (json!({}), json!({PAUSED: "True"}), Control::Paused(None)),
            (json!({}), json!({PAUSED: "false"}), Control::Operator),
        ] {
            assert_eq!(
                with(spec.clone(), annotations.clone()),
                (expected, None),
                "{spec} {annotations}"
            );
        }
        // Unreadable pauses hold the workers where they are, and say why.
        for (annotations, named) in [
            (json!({PAUSED_REPLICAS: "three"}), PAUSED_REPLICAS),
            (json!({PAUSED_REPLICAS: "-1"}), PAUSED_REPLICAS),
            (json!({PAUSED: "yes"}), PAUSED),
        ] {
            let (control, error) = with(external.clone(), annotations);
            assert_eq!(control, Control::Paused(None));
            let message = error.expect("an error to report").to_string();
            assert!(message.contains(named), "{message}");
            assert!(message.contains("holding the workers"), "{message}");
        }
    }

    #[test]
    fn a_subscription_rule_that_is_not_cel_is_refused() {
        let e = group(&qcg(json!({"app": {"port": 8080, "subscription": {
            "rules": [{"match": "event.data.kind ==", "path": "/x"}]}}})))
        .unwrap_err();
        assert_eq!(e.field, "spec.app.subscription.rules");
        assert!(e.reason.contains("event.data.kind =="), "{e}");
        group(&qcg(json!({"app": {"port": 8080, "subscription": {
            "rules": [{"match": "event.data.kind == \"x\"", "path": "/x"}]}}})))
        .expect("a CEL rule");
    }

    #[test]
    fn queue_settings_follow_the_spec() {
        let config = queue(&queue_spec(json!({
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
    fn group_settings_follow_the_spec() {
        let settings = group(&qcg(json!({
            "deliveryMode": "stream", "startFrom": "beginning", "ordered": true,
            "lockDuration": "90s",
            "retry": {"maxDeliveryAttempts": 3, "initialBackoff": "2s", "maxBackoff": "1m"},
            "app": {"port": 8080, "timeout": "2m"},
            "scaling": {"minReplicas": 1, "maxReplicas": 7, "targetBacklogPerReplica": 50,
                        "scaleDownStabilization": "90s", "scaleToZeroCooldown": "10m",
                        "activationThreshold": 4}
        })))
        .unwrap();
        let config = &settings.config;
        assert_eq!(config.name, "billing");
        assert_eq!(config.mode, config::DeliveryMode::Stream);
        assert_eq!(config.start_from, config::StartFrom::Beginning);
        assert!(config.ordered);
        assert_eq!(config.lock_duration, Duration::from_secs(90));
        assert_eq!(config.retry.max_delivery_attempts, 3);
        assert_eq!(config.retry.max_backoff, Duration::from_secs(60));
        assert_eq!(
            settings.policy,
            Policy {
                min_replicas: 1,
                max_replicas: 7,
                target_backlog_per_replica: 50,
                scale_down_stabilization_ms: 90_000,
                scale_to_zero_cooldown_ms: 600_000,
                activation_threshold: 4,
            }
        );
        assert_eq!(settings.app_timeout, Duration::from_secs(120));
        assert_eq!(settings.scale_down_stabilization_seconds, 90);
    }

    /// Each field the schema cannot fully check is refused here by name.
    #[test]
    fn refusals_name_the_field() {
        let err = queue(&queue_spec(json!({"retention": "5x"}))).unwrap_err();
        assert_eq!(err.field, "spec.retention");
        for (spec, field) in [
            (json!({"group": "lease"}), "spec.group"),
            (json!({"lockDuration": "soon"}), "spec.lockDuration"),
            // Past the CRD's range: an object stored under an older CRD.
            (json!({"app": {"port": 70000}}), "spec.app.port"),
            (json!({"app": {"port": 0}}), "spec.app.port"),
            (
                json!({"retry": {"initialBackoff": "1y2"}}),
                "spec.retry.initialBackoff",
            ),
            (
                json!({"retry": {"maxBackoff": "x"}}),
                "spec.retry.maxBackoff",
            ),
            (
                json!({"app": {"port": 8080, "timeout": "9000000000000s"}}),
                "spec.app.timeout",
            ),
            (
                json!({"app": {"port": 8080, "timeout": "61m"}}),
                "spec.app.timeout",
            ),
            (
                json!({"scaling": {"scaleDownStabilization": "9000000000000s"}}),
                "spec.scaling.scaleDownStabilization",
            ),
            (
                json!({"scaling": {"scaleToZeroCooldown": "later"}}),
                "spec.scaling.scaleToZeroCooldown",
            ),
        ] {
            let err = group(&qcg(spec.clone())).unwrap_err();
            assert_eq!(err.field, field, "{spec}: {err}");
            assert!(err.to_string().starts_with(field), "{err}");
        }
    }
}

#[cfg(test)]
mod hostile_rules {
    /// The CRD admits rules of up to 4,096 characters. The deepest of them compile (or are
    /// refused) and run on a 2 MiB stack, a tokio worker's, without overflowing it: an
    /// overflow aborts the process, so a hostile spec would crash-loop the operator.
    #[test]
    fn the_deepest_rules_the_crd_admits_neither_overflow_the_compiler_nor_the_evaluator() {
        let limit = 4096;
        for rule in [
            format!("{}1{}", "(".repeat(2047), ")".repeat(2047)),
            format!("{}true", "!".repeat(limit - 4)),
            format!("{}1 > 0", "1 + ".repeat((limit - 5) / 4)),
            format!("{}1{}", "[".repeat(2047), "]".repeat(2047)),
            format!("{}0", "-".repeat(limit - 1)),
        ] {
            assert!(rule.len() <= limit, "{}", rule.len());
            std::thread::Builder::new()
                .stack_size(2 << 20)
                .spawn(move || {
                    if let Ok(program) = cel::Program::compile(&rule) {
                        let _ = program.execute(&cel::Context::default());
                    }
                })
                .unwrap()
                .join()
                .expect("no panic");
        }
    }
}
