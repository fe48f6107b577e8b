//! The CRDs' validation rules as cases: an object (or an update from an old one) and the
//! message it must be refused with, or none. The same table runs in every `cargo test` through
//! a CEL interpreter (`kube::core::cel`, for the rules that are CEL) and, when a cluster is
//! given, against the real API server (every rule, patterns and lengths too).

use serde_json::{json, Value};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Queue,
    Group,
}

#[derive(Clone, Debug)]
pub struct RuleCase {
    /// Unique among the cases; also the object's name unless `name` overrides it.
    pub id: &'static str,
    pub kind: Kind,
    /// The object's name (`id` when `None`).
    pub name: Option<String>,
    /// Set: the case updates an object created with this spec.
    pub old: Option<Value>,
    pub spec: Value,
    /// `Some(message)`: refused, the message naming the rule; `None`: accepted.
    pub refused_with: Option<&'static str>,
    /// The rule is CEL (`x-kubernetes-validations`); otherwise the schema's patterns and
    /// lengths refuse it, which only an API server checks here.
    pub cel: bool,
}

impl RuleCase {
    pub fn name(&self) -> String {
        self.name.clone().unwrap_or_else(|| self.id.to_owned())
    }

    /// The object as `kubectl apply` would send it.
    pub fn object(&self, spec: &Value) -> Value {
        let kind = match self.kind {
            Kind::Queue => "CosmosQueue",
            Kind::Group => "QueueConsumerGroup",
        };
        json!({"apiVersion": "cosmosq.io/v1alpha1", "kind": kind,
               "metadata": {"name": self.name()}, "spec": spec})
    }
}

pub fn queue_spec(extra: Value) -> Value {
    let mut spec = json!({"endpoint": "https://a.documents.azure.com/",
        "credentials": {"workloadIdentity": {}}, "database": "db", "container": "c"});
    merge(&mut spec, extra);
    spec
}

pub fn group_spec(extra: Value) -> Value {
    let mut spec = json!({"queueRef": {"name": "rules"},
        "template": {"spec": {"containers": [{"name": "app", "image": "example/app"}]}},
        "app": {"port": 8080}});
    merge(&mut spec, extra);
    spec
}

fn merge(target: &mut Value, extra: Value) {
    if let (Some(target), Value::Object(extra)) = (target.as_object_mut(), extra) {
        target.extend(extra);
    }
}

/// A group whose subscription has `n` rules.
fn subscription(n: usize) -> Value {
    let rules: Vec<Value> = (0..n)
        .map(|i| json!({"match": format!("event.data.n == {i}"), "path": "/x"}))
        .collect();
    group_spec(json!({"app": {"port": 8080, "subscription": {"rules": rules}}}))
}

pub fn cases() -> Vec<RuleCase> {
    let case = |id, kind, spec, refused_with, cel| RuleCase {
        id,
        kind,
        name: None,
        old: None,
        spec,
        refused_with,
        cel,
    };
    let update = |id, kind, old: Value, spec, refused_with| RuleCase {
        old: Some(old),
        ..case(id, kind, spec, refused_with, true)
    };
    let exactly_one = Some("set exactly one of secretKeyRef and workloadIdentity");
    let long_name = "q".repeat(64);
    vec![
        // Exactly one credential.
        case(
            "valid-queue",
            Kind::Queue,
            queue_spec(json!({})),
            None,
            true,
        ),
        case(
            "two-credentials",
            Kind::Queue,
            queue_spec(
                json!({"credentials": {"workloadIdentity": {}, "secretKeyRef": {"name": "k"}}}),
            ),
            exactly_one,
            true,
        ),
        case(
            "no-credentials",
            Kind::Queue,
            queue_spec(json!({"credentials": {}})),
            exactly_one,
            true,
        ),
        // An account endpoint: nothing past the port (the operator also refuses hosts its
        // admin did not allow; that is not the API server's to know).
        case(
            "endpoint-with-port",
            Kind::Queue,
            queue_spec(json!({"endpoint": "https://a.documents.azure.com:443/"})),
            None,
            true,
        ),
        case(
            "endpoint-with-path",
            Kind::Queue,
            queue_spec(json!({"endpoint": "https://a.documents.azure.com/dbs/x?y=1"})),
            Some("endpoint must be an account endpoint"),
            true,
        ),
        case(
            "endpoint-with-user",
            Kind::Queue,
            queue_spec(json!({"endpoint": "https://u:p@a.documents.azure.com/"})),
            Some("endpoint must be an account endpoint"),
            true,
        ),
        // The app's timeout bounds the pods' termination grace.
        case(
            "app-timeout-hour",
            Kind::Group,
            group_spec(json!({"app": {"port": 8080, "timeout": "1h"}})),
            None,
            true,
        ),
        case(
            "app-timeout-day",
            Kind::Group,
            group_spec(json!({"app": {"port": 8080, "timeout": "1d"}})),
            Some("app.timeout must be at most 1h"),
            true,
        ),
        case(
            "app-timeout-long",
            Kind::Group,
            group_spec(json!({"app": {"port": 8080, "timeout": "90m"}})),
            Some("app.timeout must be at most 1h"),
            true,
        ),
        // API tokens: a Secret the user keeps, or one the operator makes; not both.
        case(
            "tokens-generated",
            Kind::Group,
            group_spec(json!({"app": {"port": 8080, "generateApiTokens": true}})),
            None,
            true,
        ),
        case(
            "tokens-named-or-generated",
            Kind::Group,
            group_spec(
                json!({"app": {"port": 8080, "apiTokenSecret": "t", "generateApiTokens": true}}),
            ),
            Some("set apiTokenSecret (a Secret you keep) or generateApiTokens"),
            true,
        ),
        case(
            "tokens-named-not-generated",
            Kind::Group,
            group_spec(
                json!({"app": {"port": 8080, "apiTokenSecret": "t", "generateApiTokens": false}}),
            ),
            None,
            true,
        ),
        RuleCase {
            name: Some(long_name.clone()),
            ..case(
                "long-queue-name",
                Kind::Queue,
                queue_spec(json!({})),
                Some("at most 63 characters"),
                true,
            )
        },
        // Back-off, replica bounds, the HPA's window limit.
        case(
            "valid-group",
            Kind::Group,
            group_spec(
                json!({"retry": {"initialBackoff": "1s", "maxBackoff": "1m"},
                              "scaling": {"minReplicas": 1, "maxReplicas": 2}}),
            ),
            None,
            true,
        ),
        case(
            "backoff",
            Kind::Group,
            group_spec(json!({"retry": {"initialBackoff": "2m", "maxBackoff": "1m"}})),
            Some("initialBackoff must not exceed maxBackoff"),
            true,
        ),
        case(
            "replicas",
            Kind::Group,
            group_spec(json!({"scaling": {"minReplicas": 3, "maxReplicas": 2}})),
            Some("minReplicas must not exceed maxReplicas"),
            true,
        ),
        case(
            "hpa-window",
            Kind::Group,
            group_spec(json!({"scaling": {"mode": "HPA", "scaleDownStabilization": "2h"}})),
            Some("scaleDownStabilization must be at most 1h in HPA mode"),
            true,
        ),
        case(
            "hpa-window-ok",
            Kind::Group,
            group_spec(json!({"scaling": {"mode": "HPA", "scaleDownStabilization": "30m"}})),
            None,
            true,
        ),
        case(
            "direct-window",
            Kind::Group,
            group_spec(json!({"scaling": {"scaleDownStabilization": "2h"}})),
            None,
            true,
        ),
        case(
            "behavior-direct",
            Kind::Group,
            group_spec(
                json!({"scaling": {"behavior": {"scaleUp": {"stabilizationWindowSeconds": 60}}}}),
            ),
            Some("behavior configures the operator's HorizontalPodAutoscaler"),
            true,
        ),
        case(
            "behavior-hpa",
            Kind::Group,
            group_spec(json!({"scaling": {"mode": "HPA", "behavior": {
                "scaleUp": {"policies": [{"type": "Pods", "value": 4, "periodSeconds": 60}]}}}})),
            None,
            true,
        ),
        case(
            "external-replicas",
            Kind::Group,
            group_spec(json!({"scaling": {"mode": "External"}, "replicas": 3})),
            None,
            true,
        ),
        case(
            "replicas-negative",
            Kind::Group,
            group_spec(json!({"scaling": {"mode": "External"}, "replicas": -1})),
            Some("spec.replicas"),
            false,
        ),
        // Pull workers come to the sidecar: no port of theirs is needed.
        case(
            "pull-without-port",
            Kind::Group,
            group_spec(json!({"app": {"mode": "Pull"}})),
            None,
            true,
        ),
        case(
            "push-without-port",
            Kind::Group,
            group_spec(json!({"app": {"path": "/messages"}})),
            Some("app.port is required"),
            true,
        ),
        // The sidecar's own settings come from the spec, never from sidecar.env.
        case(
            "sidecar-env-otel",
            Kind::Group,
            group_spec(json!({"sidecar": {"env": [
                {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": "http://otel:4318"},
                {"name": "OTEL_EXPORTER_OTLP_HEADERS",
                 "valueFrom": {"secretKeyRef": {"name": "otel", "key": "headers"}}}]}})),
            None,
            true,
        ),
        case(
            "sidecar-env-reserved",
            Kind::Group,
            group_spec(json!({"sidecar": {"env": [{"name": "COSMOSQ_GROUP", "value": "x"}]}})),
            Some("sidecar.env cannot set COSMOSQ_* variables"),
            true,
        ),
        case(
            "sidecar-env-pod-name",
            Kind::Group,
            group_spec(json!({"sidecar": {"env": [{"name": "POD_NAME", "value": "x"}]}})),
            Some("sidecar.env cannot set COSMOSQ_* variables, POD_NAME or POD_NAMESPACE"),
            true,
        ),
        // A hostile subscription is bounded before the operator compiles it: at most 100
        // rules of at most 4,096 characters (`spec::hostile_rules` runs the deepest of them).
        case(
            "subscription-rule-too-long",
            Kind::Group,
            group_spec(json!({"app": {"port": 8080, "subscription": {"rules": [
                {"match": format!("event.data.n == {}", "1".repeat(4090)), "path": "/x"}]}}})),
            Some("spec.app.subscription.rules[0].match"),
            false,
        ),
        case(
            "subscription-too-many-rules",
            Kind::Group,
            subscription(101),
            Some("spec.app.subscription.rules"),
            false,
        ),
        case(
            "subscription-hundred-rules",
            Kind::Group,
            subscription(100),
            None,
            false,
        ),
        // Names that become label values.
        case(
            "group-label",
            Kind::Group,
            group_spec(json!({"group": "-billing"})),
            Some("spec.group"),
            false,
        ),
        case(
            "queue-ref-label",
            Kind::Group,
            group_spec(json!({"queueRef": {"name": long_name.clone()}})),
            Some("spec.queueRef.name"),
            false,
        ),
        RuleCase {
            name: Some("g".repeat(64)),
            ..case(
                "long-group-name",
                Kind::Group,
                group_spec(json!({})),
                Some("at most 63 characters"),
                true,
            )
        },
        // Immutable fields: a change would silently abandon the messages or the group's state.
        update(
            "endpoint",
            Kind::Queue,
            queue_spec(json!({})),
            queue_spec(json!({"endpoint": "https://b.documents.azure.com/"})),
            Some("endpoint is immutable"),
        ),
        update(
            "database",
            Kind::Queue,
            queue_spec(json!({})),
            queue_spec(json!({"database": "other"})),
            Some("database is immutable"),
        ),
        update(
            "container",
            Kind::Queue,
            queue_spec(json!({})),
            queue_spec(json!({"container": "other"})),
            Some("container is immutable"),
        ),
        update(
            "partition-key",
            Kind::Queue,
            queue_spec(json!({})),
            queue_spec(json!({"partitionKeyPath": "/tenant"})),
            Some("partitionKeyPath is immutable"),
        ),
        update(
            "deletion-policy",
            Kind::Queue,
            queue_spec(json!({})),
            queue_spec(json!({"deletionPolicy": "Delete"})),
            None,
        ),
        update(
            "queue-ref",
            Kind::Group,
            group_spec(json!({})),
            group_spec(json!({"queueRef": {"name": "other"}})),
            Some("queueRef is immutable"),
        ),
        update(
            "delivery-mode",
            Kind::Group,
            group_spec(json!({})),
            group_spec(json!({"deliveryMode": "stream"})),
            Some("deliveryMode is immutable"),
        ),
        update(
            "ordered",
            Kind::Group,
            group_spec(json!({})),
            group_spec(json!({"ordered": true})),
            Some("ordered is immutable"),
        ),
        update(
            "group-name",
            Kind::Group,
            group_spec(json!({})),
            group_spec(json!({"group": "renamed"})),
            Some("group is immutable"),
        ),
        // Enum values in the Kubernetes API style; earlier lowercase ones still accepted, and
        // respelling a value is not a change.
        case(
            "camel-case-values",
            Kind::Group,
            group_spec(json!({"deliveryMode": "Stream", "startFrom": "Beginning",
                              "app": {"port": 8080, "format": "Raw"}})),
            None,
            true,
        ),
        update(
            "delivery-mode-respelled",
            Kind::Group,
            group_spec(json!({"deliveryMode": "exclusive"})),
            group_spec(json!({"deliveryMode": "Exclusive"})),
            None,
        ),
        update(
            "delivery-mode-camel",
            Kind::Group,
            group_spec(json!({"deliveryMode": "exclusive"})),
            group_spec(json!({"deliveryMode": "Stream"})),
            Some("deliveryMode is immutable"),
        ),
        update(
            "concurrency",
            Kind::Group,
            group_spec(json!({})),
            group_spec(json!({"concurrency": 7})),
            None,
        ),
        // A gRPC app, in Kubernetes' spelling or Dapr's.
        case(
            "app-protocol-grpc",
            Kind::Group,
            group_spec(json!({"app": {"port": 8080, "protocol": "grpc"}})),
            None,
            false,
        ),
        case(
            "app-protocol-unknown",
            Kind::Group,
            group_spec(json!({"app": {"port": 8080, "protocol": "thrift"}})),
            Some("Unsupported value"),
            false,
        ),
        // The sidecar's ports are its own.
        case(
            "app-port-grpc",
            Kind::Group,
            group_spec(json!({"app": {"port": 50001}})),
            Some("app.port cannot be 3500, 50001 or 9464"),
            true,
        ),
        // A pipeline: other queues, each once.
        case(
            "publish-to",
            Kind::Group,
            group_spec(json!({"publishTo": [{"queueRef": {"name": "invoices"}},
                                            {"queueRef": {"name": "receipts"}}]})),
            None,
            true,
        ),
        case(
            "publish-to-twice",
            Kind::Group,
            group_spec(json!({"publishTo": [{"queueRef": {"name": "invoices"}},
                                            {"queueRef": {"name": "invoices"}}]})),
            Some("publishTo names each queue once"),
            true,
        ),
        case(
            "publish-to-own-queue",
            Kind::Group,
            group_spec(json!({"publishTo": [{"queueRef": {"name": "rules"}}]})),
            Some("publishTo lists other queues"),
            true,
        ),
        case(
            "publish-to-seventeen",
            Kind::Group,
            group_spec(json!({"publishTo": (0..17)
                .map(|i| json!({"queueRef": {"name": format!("q{i}")}}))
                .collect::<Vec<_>>()})),
            Some("must have at most 16 items"),
            false,
        ),
    ]
}
