//! The contracts between processes: the sidecar container the operator builds is read by the
//! sidecar's own `SidecarSettings`, so a renamed variable or a value one side spells
//! differently fails here rather than in a cluster; and the chart's dashboard queries only metrics the operator
//! and the sidecar export.

use std::collections::{BTreeMap, BTreeSet};

use cosmosq_crds::{CosmosQueue, QueueConsumerGroup};
use cosmosq_operator::build::{deployment, sidecar_settings, Defaults, SIDECAR_CONTAINER};
use cosmosq_sidecar::settings::{AppMode, AppProtocol, SidecarSettings, Token};
use k8s_openapi::api::core::v1::PodSpec;
use serde_json::json;

/// The sidecar's environment as the kubelet would give it (downward API fields filled in),
/// and the settings the operator meant it to carry.
fn sidecar_environment(group: serde_json::Value) -> (BTreeMap<String, String>, SidecarSettings) {
    let (environment, meant, _) = sidecar_of(group, &[]);
    (environment, meant)
}

/// A CosmosQueue of the namespace `shop`.
fn queue(name: &str, spec: serde_json::Value) -> CosmosQueue {
    serde_json::from_value(json!({
        "apiVersion": "cosmosq.io/v1alpha1", "kind": "CosmosQueue",
        "metadata": {"name": name, "namespace": "shop", "uid": name}, "spec": spec
    }))
    .unwrap()
}

/// [`sidecar_environment`] for a group publishing to `targets`, and the worker pod.
fn sidecar_of(
    group: serde_json::Value,
    targets: &[CosmosQueue],
) -> (BTreeMap<String, String>, SidecarSettings, PodSpec) {
    let queue = queue(
        "orders",
        json!({"endpoint": "https://acct.documents.azure.com:443/",
               "credentials": {"secretKeyRef": {"name": "cosmos-key"}},
               "database": "shop", "container": "orders"}),
    );
    let mut spec = json!({"queueRef": {"name": "orders"},
        "template": {"spec": {"containers": [{"name": "app", "image": "example/app"}]}},
        "app": {"port": 8080}});
    spec.as_object_mut()
        .unwrap()
        .extend(group.as_object().unwrap().clone());
    let group: QueueConsumerGroup = serde_json::from_value(json!({
        "apiVersion": "cosmosq.io/v1alpha1", "kind": "QueueConsumerGroup",
        "metadata": {"name": "billing", "namespace": "shop", "uid": "g"}, "spec": spec
    }))
    .unwrap();
    let settings = cosmosq_operator::spec::group(&group).unwrap();
    let meant = sidecar_settings(&group, &settings, &queue, targets);
    let d = deployment(
        &group,
        &settings,
        &queue,
        targets,
        &Defaults::new("sidecar:test"),
    )
    .unwrap();
    let pod = d.spec.unwrap().template.spec.unwrap();
    let sidecar = pod
        .containers
        .iter()
        .find(|c| c.name == SIDECAR_CONTAINER)
        .unwrap()
        .clone();
    let environment = sidecar
        .env
        .unwrap_or_default()
        .into_iter()
        .map(|e| {
            let value = match (e.value, e.value_from) {
                (Some(v), _) => v,
                (None, Some(from)) => match (from.field_ref, from.secret_key_ref) {
                    (Some(f), _) if f.field_path == "metadata.name" => "billing-workers-abc".into(),
                    (Some(f), _) if f.field_path == "metadata.namespace" => "shop".into(),
                    // A Secret's key, as the kubelet would give it: named after where it is.
                    (None, Some(key)) => format!("{}.{}", key.name, key.key),
                    other => panic!("{}: an unexpected source {other:?}", e.name),
                },
                (None, None) => String::new(),
            };
            (e.name, value)
        })
        .collect();
    (environment, meant, pod)
}

/// Reads an environment as the sidecar does: every variable must be one it reads.
fn parse(environment: &BTreeMap<String, String>) -> SidecarSettings {
    SidecarSettings::from_vars(environment).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn the_sidecar_reads_every_variable_the_operator_sets_as_the_operator_meant_it() {
    for group in [
        json!({}),
        json!({"deliveryMode": "Stream", "startFrom": "Beginning", "ordered": true,
               "app": {"port": 9000, "path": "/orders", "format": "Raw", "timeout": "5m",
                       "healthPath": "/health"},
               "concurrency": 7, "lockDuration": "90s",
               "retry": {"maxDeliveryAttempts": 4, "initialBackoff": "2s", "maxBackoff": "2m"}}),
        // The lowercase spellings of earlier versions mean the same.
        json!({"deliveryMode": "stream", "startFrom": "beginning", "app": {"port": 9000, "format": "raw"}}),
        json!({"deliveryMode": "Stream", "startFrom": "Beginning", "app": {"port": 9000, "mode": "Pull"}}),
        // Pull workers come to the sidecar: no port of theirs.
        json!({"app": {"mode": "Pull"}}),
        // The claims write path, with its own concurrency and retries.
        json!({"exclusiveWrites": "Claims", "concurrency": 3,
               "retry": {"maxDeliveryAttempts": 2, "initialBackoff": "500ms", "maxBackoff": "30s"}}),
        // Dapr's API tokens, from the group's Secret.
        json!({"app": {"port": 9000, "apiTokenSecret": "billing-tokens"}}),
        // A gRPC app (Dapr's spelling too).
        json!({"app": {"port": 9000, "protocol": "GRPC"}}),
        json!({"app": {"port": 9000, "protocol": "grpc"}}),
    ] {
        let (environment, mut meant) = sidecar_environment(group.clone());
        let config = parse(&environment);
        // Everything the operator meant arrives, besides what the kubelet fills in.
        meant.pod_name = Some("billing-workers-abc".into());
        meant.pod_namespace = Some("shop".into());
        meant.api_token = config.api_token.clone();
        meant.app_api_token = config.app_api_token.clone();
        assert_eq!(format!("{config:?}"), format!("{meant:?}"), "{group}");
        let debug = format!("{config:?}");
        assert_eq!(config.queue, "orders", "{group}");
        assert_eq!(config.group, "billing", "{group}");
        assert_eq!(config.pod_name.as_deref(), Some("billing-workers-abc"));
        if group.get("deliveryMode").is_some() {
            assert!(debug.contains("Stream"), "{group}: {debug}");
            assert!(debug.contains("Beginning"), "{group}: {debug}");
        } else {
            assert!(debug.contains("Exclusive"), "{debug}");
            // The drain outlasts the longest delivery (app.timeout 60 s by default).
            assert_eq!(config.grace_period, std::time::Duration::from_secs(70));
        }
        let port = match group.get("app") {
            Some(app) => app["port"].as_u64().map(|p| u16::try_from(p).unwrap()),
            None => Some(8080), // the fixture's
        };
        assert_eq!(config.app_port, port, "{group}");
        assert_eq!(config.ordered, group["ordered"] == true, "{group}");
        // What the spec says, checked against the spec (not against what the operator meant).
        assert_eq!(
            config.exclusive_writes,
            if group["exclusiveWrites"] == "Claims" {
                cosmosq_queue::ExclusiveWrites::Claims
            } else {
                cosmosq_queue::ExclusiveWrites::Lease
            },
            "{group}"
        );
        let concurrency = group["concurrency"].as_u64().unwrap_or(16);
        assert_eq!(config.max_concurrency as u64, concurrency, "{group}");
        if group["exclusiveWrites"] == "Claims" {
            assert_eq!(config.max_delivery_attempts, 2);
            assert_eq!(
                config.retry_initial_backoff,
                std::time::Duration::from_millis(500)
            );
            assert_eq!(config.retry_max_backoff, std::time::Duration::from_secs(30));
        }
        let pull = group["app"]["mode"] == "Pull";
        assert_eq!(
            config.app_mode,
            if pull { AppMode::Pull } else { AppMode::Push },
            "{group}"
        );
        let grpc = group["app"]["protocol"]
            .as_str()
            .is_some_and(|p| p.eq_ignore_ascii_case("grpc"));
        assert_eq!(
            config.app_protocol,
            if grpc {
                AppProtocol::Grpc
            } else {
                AppProtocol::Http
            },
            "{group}"
        );
        let token = |t: Option<&Token>| t.map(|t| t.expose().to_owned());
        if group["app"]["apiTokenSecret"].is_string() {
            assert_eq!(
                (
                    token(config.api_token.as_ref()),
                    token(config.app_api_token.as_ref())
                ),
                (
                    Some("billing-tokens.dapr-api-token".to_owned()),
                    Some("billing-tokens.app-api-token".to_owned())
                )
            );
        } else {
            assert!(config.api_token.is_none() && config.app_api_token.is_none());
        }
        if group["app"]["timeout"] == "5m" {
            assert_eq!(config.app_timeout, std::time::Duration::from_secs(300));
            assert_eq!(config.grace_period, std::time::Duration::from_secs(310));
        }
    }
}

#[test]
fn a_pipeline_s_queues_reach_the_sidecar_with_their_own_keys_mounted() {
    let targets = [
        // On the group's account, with the same Secret: its key file is the group's.
        queue(
            "invoices",
            json!({"endpoint": "https://acct.documents.azure.com:443/",
                   "credentials": {"secretKeyRef": {"name": "cosmos-key"}},
                   "database": "shop", "container": "invoices"}),
        ),
        // Another account, another Secret and key: mounted on its own.
        queue(
            "receipts",
            json!({"endpoint": "https://ledger.documents.azure.com:443/",
                   "credentials": {"secretKeyRef": {"name": "ledger-key", "key": "primary"}},
                   "database": "ledger", "container": "receipts-v2"}),
        ),
    ];
    let group = json!({"publishTo": [{"queueRef": {"name": "invoices"}},
        {"queueRef": {"name": "receipts"}}]});
    let (environment, meant, pod) = sidecar_of(group, &targets);
    let config = parse(&environment);
    assert_eq!(config.publish_to, meant.publish_to);
    let published: Vec<(&str, &str, &str, cosmosq_queue::Auth)> = config
        .publish_to
        .0
        .iter()
        .map(|t| {
            (
                t.database.as_str(),
                t.queue.as_str(),
                t.endpoint.as_str(),
                t.auth,
            )
        })
        .collect();
    use cosmosq_queue::Auth::Key;
    assert_eq!(
        published,
        [
            (
                "shop",
                "invoices",
                "https://acct.documents.azure.com:443/",
                Key
            ),
            (
                "ledger",
                "receipts-v2",
                "https://ledger.documents.azure.com:443/",
                Key
            ),
        ]
    );
    // Each key file is in a mount of the sidecar whose volume holds that queue's Secret key.
    let sidecar = pod
        .containers
        .iter()
        .find(|c| c.name == SIDECAR_CONTAINER)
        .unwrap();
    let secret_of = |file: &std::path::Path| {
        let mount = sidecar
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| file.parent() == Some(std::path::Path::new(&m.mount_path)))
            .unwrap_or_else(|| panic!("{}: not in a mount of the sidecar", file.display()));
        let volume = pod
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == mount.name)
            .unwrap();
        let secret = volume.secret.as_ref().unwrap();
        let item = &secret.items.as_ref().unwrap()[0];
        assert_eq!(item.path, file.file_name().unwrap().to_str().unwrap());
        (secret.secret_name.clone().unwrap(), item.key.clone())
    };
    let keys: Vec<Option<(String, String)>> = config
        .publish_to
        .0
        .iter()
        .map(|t| t.key_file.as_deref().map(secret_of))
        .collect();
    assert_eq!(
        keys,
        [
            Some(("cosmos-key".into(), "key".into())),
            Some(("ledger-key".into(), "primary".into())),
        ]
    );
    assert_eq!(
        secret_of(config.connection.key_file.as_deref().unwrap()),
        ("cosmos-key".into(), "key".into())
    );
    // No other container of the pod mounts a key.
    for app in pod
        .containers
        .iter()
        .filter(|c| c.name != SIDECAR_CONTAINER)
    {
        assert!(app.volume_mounts.is_none(), "{:?}", app.volume_mounts);
    }
}

/// The metric names a PromQL text mentions (`cosmosq_…`), with the selector that follows each.
fn queried(text: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("cosmosq_") {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        let selector = match rest.strip_prefix('{') {
            Some(inner) => inner[..inner.find('}').unwrap_or(0)].to_owned(),
            None => String::new(),
        };
        found.push((name, selector));
    }
    found
}

/// Every metric the chart's Grafana dashboard queries is one the operator or the sidecar
/// registers, and a figure both report is queried with its scope, so no panel sums a group's
/// total with its pods' shares.
#[test]
fn the_dashboard_queries_only_metrics_that_exist() {
    use cosmosq_queue::metric_names;
    let dashboard = include_str!("../../charts/cosmosq/dashboards/cosmosq.json");
    let operator = cosmosq_operator::metrics::OperatorMetrics::new();
    let sidecar = cosmosq_sidecar::metrics::SidecarMetrics::new("orders", "billing");
    let exported: BTreeSet<&str> = operator
        .names()
        .iter()
        .chain(sidecar.names())
        .map(String::as_str)
        .collect();
    for shared in [metric_names::BACKLOG, metric_names::LAG] {
        assert!(operator.names().iter().any(|n| n == shared), "{shared}");
        assert!(sidecar.names().iter().any(|n| n == shared), "{shared}");
    }
    let queries = queried(dashboard);
    assert!(queries.len() > 10, "{queries:?}");
    for (name, selector) in queries {
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| name.strip_suffix(suffix))
            .unwrap_or(&name);
        assert!(
            exported.contains(family),
            "the dashboard queries {name}, which nothing exports ({exported:?})"
        );
        if operator.names().iter().any(|n| n == family)
            && sidecar.names().iter().any(|n| n == family)
        {
            assert!(
                selector.contains(&format!("{}=", metric_names::SCOPE)),
                "the dashboard queries {name} without its scope: {{{selector}}}"
            );
        }
    }
    // What a scrape shows carries the scope: the sidecar's on every series.
    sidecar.backlog.set(3);
    assert!(
        sidecar.render().contains(&format!(
            "{}=\"{}\"",
            metric_names::SCOPE,
            metric_names::SCOPE_POD
        )),
        "{}",
        sidecar.render()
    );
    operator
        .groups
        .estimated(&["shop", "orders", "billing"], 3, 0, 0);
    assert!(
        operator.render().contains(&format!(
            "{}{{group=\"billing\",namespace=\"shop\",queue=\"orders\",scope=\"group\"}} 3",
            metric_names::BACKLOG
        )),
        "{}",
        operator.render()
    );
}

/// `app.daprEnv`: the app's `DAPR_HTTP_PORT` is the port the sidecar, configured as the
/// operator configures it, serves its localhost API (and Dapr's publish) on.
#[test]
fn dapr_http_port_names_the_port_the_sidecar_listens_on() {
    let (environment, _) = sidecar_environment(json!({}));
    let config = parse(&environment);
    assert_eq!(
        config.listen.port(),
        cosmosq_operator::build::SIDECAR_API_PORT,
        "{:?}",
        config.listen
    );
    assert!(config.listen.ip().is_loopback(), "localhost only");
}

/// `app.subscription`: what the operator declares is what the sidecar routes by, in the
/// format of Dapr's `GET /dapr/subscribe` entries.
#[test]
fn a_declared_subscription_reaches_the_sidecar_as_routes() {
    let (environment, _) = sidecar_environment(json!({"app": {"port": 8080, "subscription": {
        "pubsubname": "pubsub",
        "rules": [{"match": "event.data.priority > 5", "path": "/urgent"}],
        "default": "/orders", "rawPayload": true,
        "bulk": {"maxMessagesCount": 20}}}}));
    let config = parse(&environment);
    let declared = config.app_subscription.as_deref().expect("declared");
    let s = cosmosq_sidecar::subscribe::declared(declared, &config.queue).unwrap();
    assert_eq!(
        s.bulk,
        Some(cosmosq_sidecar::bulk::BulkSettings {
            max_messages: 20,
            max_await: std::time::Duration::from_millis(1000),
        }),
        "bulk, with Dapr's default wait"
    );
    use cosmosq_sidecar::subscribe::Route;
    assert_eq!(
        s.route(&json!({"data": {"priority": 9}})),
        Route::Path("/urgent")
    );
    assert_eq!(
        s.route(&json!({"data": {"priority": 1}})),
        Route::Path("/orders")
    );
    assert_eq!(s.pubsub_name, "pubsub");
    assert!(s.raw_payload);
}

/// The operator's container arguments as the chart renders them with `values`.
fn rendered_operator_args(values: &[&str]) -> Vec<String> {
    let mut args = vec!["--show-only", "templates/deployment.yaml"];
    for value in values {
        args.extend(["--set", value]);
    }
    let deployment = cosmosq_tests::helm_template("cosmosq", "cosmosq", &args).remove(0);
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    container["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("a string").to_owned())
        .collect()
}

#[test]
fn the_operator_reads_the_identity_settings_the_chart_renders() {
    use cosmosq_operator::config::Config;
    let id = "/subscriptions/0b1f6471-1bf0-4dda-aec3-cb9272f09590/resourceGroups/shop-rg/\
              providers/Microsoft.DocumentDB/databaseAccounts/shop-acct";
    let management = format!("workloadIdentity.management[0].accountResourceId={id}");
    let args = rendered_operator_args(&[
        "workloadIdentity.grants[0].endpoint=https://shop-acct.documents.azure.com:443/",
        "workloadIdentity.grants[0].namespaces={shop,billing}",
        "workloadIdentity.grants[0].databases={shop}",
        "workloadIdentity.management[0].endpoint=https://shop-acct.documents.azure.com:443/",
        &management,
        "workloadIdentity.armEndpoint=https://management.usgovcloudapi.net",
        "workloadIdentity.maxThroughput=4000",
    ]);
    let config = <Config as clap::Parser>::try_parse_from(
        std::iter::once("cosmosq-operator".to_owned()).chain(args),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.identity_grants.len(), 1);
    assert_eq!(config.identity_management.len(), 1);
    assert_eq!(
        config.identity_management[0].endpoint,
        "https://shop-acct.documents.azure.com:443"
    );
    assert_eq!(config.identity_management[0].account.to_string(), id);
    assert_eq!(
        config.arm_endpoint.origin(),
        "https://management.usgovcloudapi.net"
    );
    assert_eq!(config.arm_max_throughput, Some(4000));
    // Without management, no ARM settings at all.
    let args = rendered_operator_args(&[]);
    assert!(
        !args
            .iter()
            .any(|a| a.starts_with("--identity-management") || a.starts_with("--arm-")),
        "{args:?}"
    );
}

#[test]
fn the_operator_reads_the_console_settings_the_chart_renders() {
    use cosmosq_operator::config::Config;
    let parse = |args: Vec<String>| {
        <Config as clap::Parser>::try_parse_from(
            std::iter::once("cosmosq-operator".to_owned()).chain(args),
        )
        .unwrap_or_else(|e| panic!("{e}"))
    };
    let config = parse(rendered_operator_args(&[
        "console.enabled=true",
        "console.sampleEvery=30s",
    ]));
    // On the pod's loopback: kubectl port-forward reaches it, other pods do not.
    assert_eq!(config.console_listen, Some(([127, 0, 0, 1], 8090).into()));
    assert_eq!(
        config.console_sample_every,
        std::time::Duration::from_secs(30)
    );
    assert_eq!(parse(rendered_operator_args(&[])).console_listen, None);
}

/// One of the chart's rendered objects, by kind and name.
fn rendered<'a>(objects: &'a [serde_json::Value], kind: &str, name: &str) -> &'a serde_json::Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("the chart renders no {kind} {name}"))
}

/// The release workflow publishes each image under the name the chart installs and the
/// operator injects, built from the Dockerfile of the binary it names; the workspace, the chart
/// and the operator's default agree on the version. A renamed image or a moved Dockerfile fails
/// here, not at a user's `helm install`.
#[test]
fn the_release_publishes_the_images_the_chart_installs() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let read = |path: &str| {
        std::fs::read_to_string(root.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
    };
    let workflow: serde_json::Value =
        serde_yaml::from_str(&read(".github/workflows/release.yml")).unwrap();
    let values: serde_json::Value =
        serde_yaml::from_str(&read("charts/cosmosq/values.yaml")).unwrap();
    let chart: serde_json::Value =
        serde_yaml::from_str(&read("charts/cosmosq/Chart.yaml")).unwrap();
    // The chart's defaults are the project's own organisation's images.
    let owner = "cosmosq";
    let registry = workflow["env"]["REGISTRY"].as_str().expect("env.REGISTRY");

    let build = &workflow["jobs"]["image"];
    let components: Vec<&str> = build["strategy"]["matrix"]["component"]
        .as_array()
        .expect("a component matrix")
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    assert_eq!(components, ["operator", "sidecar"]);
    let platforms = &build["strategy"]["matrix"]["platform"];
    assert_eq!(platforms, &json!(["linux/amd64", "linux/arm64"]));
    let step = build["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == "build")
        .expect("the build step");
    let publish = workflow["jobs"]["publish"]["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == "tags")
        .expect("the tagging step");

    for (component, chart_value) in [("operator", "image"), ("sidecar", "sidecarImage")] {
        let expand = |text: &str| {
            text.replace("${{ env.REGISTRY }}", registry)
                .replace("${{ needs.versions.outputs.owner }}", owner)
                .replace("${{ matrix.component }}", component)
        };
        let dockerfile = expand(step["with"]["file"].as_str().unwrap());
        let binary = format!("/cosmosq-{component}");
        assert!(
            read(&dockerfile).contains(&format!("ENTRYPOINT [\"{binary}\"]")),
            "{dockerfile} builds {binary}"
        );
        let outputs = expand(step["with"]["outputs"].as_str().unwrap());
        let pushed = outputs
            .split(',')
            .find_map(|o| o.strip_prefix("name="))
            .expect("an image name");
        let installed = values[chart_value]["repository"].as_str().unwrap();
        assert_eq!(pushed, installed, "{component}: pushed ≠ installed");
        let tagged = format!(
            "{}-{component}",
            expand(publish["env"]["PREFIX"].as_str().unwrap())
        );
        assert_eq!(tagged, installed, "{component}: tagged ≠ installed");
    }

    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(chart["appVersion"], version, "Chart.yaml appVersion");
    assert_eq!(chart["version"], version, "Chart.yaml version");
    let config =
        <cosmosq_operator::config::Config as clap::Parser>::try_parse_from(["cosmosq-operator"])
            .unwrap();
    assert_eq!(
        config.sidecar_image,
        format!(
            "{}:{version}",
            values["sidecarImage"]["repository"].as_str().unwrap()
        ),
        "the operator's default sidecar is the chart's"
    );
}

#[test]
fn the_chart_pins_images_by_digest() {
    let operator = format!("sha256:{}", "a".repeat(64));
    let sidecar = format!("sha256:{}", "b".repeat(64));
    let (image, sidecar_image) = (
        format!("image.digest={operator}"),
        format!("sidecarImage.digest={sidecar}"),
    );
    let objects = cosmosq_tests::helm_template(
        "cosmosq",
        "cosmosq",
        &[
            "--set",
            &image,
            "--set",
            &sidecar_image,
            "--set",
            "image.tag=1.2.3",
        ],
    );
    let deployment = rendered(&objects, "Deployment", "cosmosq");
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    // The digest pins the bytes; a tag beside it would only be a label.
    assert_eq!(
        container["image"],
        format!("ghcr.io/cosmosq/cosmosq-operator@{operator}")
    );
    assert!(
        container["args"]
            .as_array()
            .unwrap()
            .contains(&json!(format!(
                "--sidecar-image=ghcr.io/cosmosq/cosmosq-sidecar@{sidecar}"
            ))),
        "{}",
        container["args"]
    );
    // A digest that is not one is refused before anything is installed.
    let refused = std::process::Command::new(cosmosq_tests::helm())
        .args(["template", "cosmosq"])
        .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/cosmosq"))
        .args(["--set", "image.digest=latest"])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("digest"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
}

/// `helm test`: the chart's hook runs `cosmosq-operator check` with the names the chart gave
/// the operator's Deployment and Lease, may only read those objects and the two CRDs, and is
/// never adopted by the operator's ReplicaSet. The check itself, run with the rendered
/// arguments against an API server: it passes while a leader renews the Lease, and fails,
/// naming the condition, when the operator's pods are not ready (Pending, as on a cluster
/// without nodes).
#[tokio::test(start_paused = true)]
async fn helm_test_checks_the_operator_with_only_the_rights_it_needs() {
    use cosmosq_operator::config::{Command, Config};
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::coordination::v1::Lease;
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::api::{Patch, PatchParams, PostParams};
    use kube::Api;

    let objects = cosmosq_tests::helm_template("platform", "ops", &[]);
    let pod = rendered(&objects, "Pod", "platform-cosmosq-test");
    assert_eq!(pod["metadata"]["annotations"]["helm.sh/hook"], "test");
    let operator = rendered(&objects, "Deployment", "platform-cosmosq");
    let selector = operator["spec"]["selector"]["matchLabels"]
        .as_object()
        .unwrap();
    assert!(
        selector
            .iter()
            .any(|(k, v)| pod["metadata"]["labels"][k] != *v),
        "the operator's ReplicaSet would adopt the test pod"
    );
    let container = &pod["spec"]["containers"][0];
    assert_eq!(
        container["image"],
        operator["spec"]["template"]["spec"]["containers"][0]["image"]
    );
    let args = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap());
    let config =
        <Config as clap::Parser>::try_parse_from(std::iter::once("cosmosq-operator").chain(args))
            .unwrap_or_else(|e| panic!("{e}"));
    let Some(Command::Check(check)) = config.command else {
        panic!("the hook runs something else: {container}")
    };
    let operator_args = operator["spec"]["template"]["spec"]["containers"][0]["args"].to_string();
    assert_eq!(check.namespace, "ops");
    assert_eq!(check.deployment, "platform-cosmosq");
    assert!(operator_args.contains(&format!("--lease-name={}", check.lease_name)));
    // Least privilege: get, of exactly the objects the check reads.
    let role = rendered(&objects, "Role", "platform-cosmosq-test");
    let cluster_role = rendered(&objects, "ClusterRole", "platform-cosmosq-test");
    assert_eq!(
        role["rules"],
        json!([
            {"apiGroups": ["apps"], "resources": ["deployments"], "resourceNames": ["platform-cosmosq"], "verbs": ["get"]},
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["platform-cosmosq"], "verbs": ["get"]}
        ])
    );
    assert_eq!(
        cluster_role["rules"],
        json!([{"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
                "resourceNames": cosmosq_operator::check::CRDS, "verbs": ["get"]}])
    );

    // The cluster the check reads.
    let server = cosmosq_testkit::fake::FakeApiServer::new();
    let client = server.client();
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for name in cosmosq_operator::check::CRDS {
        let (plural, group) = name.split_once('.').unwrap();
        let crd = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"group": group, "scope": "Namespaced", "versions": [],
                     "names": {"plural": plural, "kind": plural}}
        }))
        .unwrap();
        crds.create(&PostParams::default(), &crd).await.unwrap();
        let established =
            json!({"status": {"conditions": [{"type": "Established", "status": "True"}]}});
        crds.patch_status(name, &PatchParams::default(), &Patch::Merge(established))
            .await
            .unwrap();
    }
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), "ops");
    let d = serde_json::from_value(json!({"metadata": {"name": "platform-cosmosq"}})).unwrap();
    deployments
        .create(&PostParams::default(), &d)
        .await
        .unwrap();
    let set_ready = |ready: i32| {
        let deployments = deployments.clone();
        async move {
            let status = json!({"status": {"observedGeneration": 1, "replicas": 1,
                                           "updatedReplicas": 1, "readyReplicas": ready,
                                           "availableReplicas": ready}});
            deployments
                .patch_status(
                    "platform-cosmosq",
                    &PatchParams::default(),
                    &Patch::Merge(status),
                )
                .await
                .unwrap();
        }
    };
    let leases: Api<Lease> = Api::namespaced(client.clone(), "ops");
    let lease = serde_json::from_value(json!({"metadata": {"name": "platform-cosmosq"},
        "spec": {"holderIdentity": "platform-cosmosq-7d9-x2", "renewTime": "2026-12-05T10:00:00.000000Z"}}))
    .unwrap();
    leases.create(&PostParams::default(), &lease).await.unwrap();
    // The leader renews every 2 s.
    let renewing = tokio::spawn({
        let leases = leases.clone();
        async move {
            for second in (2..).step_by(2) {
                tokio::time::sleep(std::time::Duration::from_secs(2)).await;
                let renewed = json!({"spec": {"renewTime": format!("2026-12-05T10:00:{:02}.000000Z", second % 60)}});
                leases
                    .patch(
                        "platform-cosmosq",
                        &PatchParams::default(),
                        &Patch::Merge(renewed),
                    )
                    .await
                    .unwrap();
            }
        }
    });

    // Pods Pending: no ready replica, and the check says so.
    set_ready(0).await;
    let error = cosmosq_operator::check::run(client.clone(), &check)
        .await
        .expect_err("no ready replica");
    let message = error.to_string();
    assert!(
        message.contains("Deployment ops/platform-cosmosq ready") && message.contains("0 ready"),
        "{message}"
    );

    set_ready(1).await;
    let passed = cosmosq_operator::check::run(client.clone(), &check)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(passed.len(), 4, "{passed:?}");
    assert!(
        passed[3].contains("renewed by platform-cosmosq-7d9-x2"),
        "{passed:?}"
    );

    // A leader that stopped renewing is not an operator that acts.
    renewing.abort();
    let error = cosmosq_operator::check::run(client, &check)
        .await
        .expect_err("a stale lease");
    assert!(error.to_string().contains("has not renewed it"), "{error}");
}
