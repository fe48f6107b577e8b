//! The operator ↔ sidecar contract: the sidecar container the operator builds is parsed by the
//! sidecar's own `Config`, so a renamed variable or a value one side spells differently fails
//! here rather than in a cluster.

use std::collections::BTreeMap;

use clap::CommandFactory;
use cosmosq_crds::{CosmosQueue, QueueConsumerGroup};
use cosmosq_operator::build::{deployment, Defaults, SIDECAR_CONTAINER};
use cosmosq_sidecar::config::Config;
use serde_json::json;

/// The sidecar's environment as the kubelet would give it (downward API fields filled in).
fn sidecar_environment(group: serde_json::Value) -> BTreeMap<String, String> {
    let queue: CosmosQueue = serde_json::from_value(json!({
        "apiVersion": "cosmosq.io/v1alpha1", "kind": "CosmosQueue",
        "metadata": {"name": "orders", "namespace": "shop", "uid": "q"},
        "spec": {"endpoint": "https://acct.documents.azure.com:443/",
                 "credentials": {"secretKeyRef": {"name": "cosmos-key"}},
                 "database": "shop", "container": "orders"}
    }))
    .unwrap();
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
    let d = deployment(&group, &settings, &queue, &Defaults::new("sidecar:test")).unwrap();
    let pod = d.spec.unwrap().template.spec.unwrap();
    let sidecar = pod
        .containers
        .into_iter()
        .find(|c| c.name == SIDECAR_CONTAINER)
        .unwrap();
    sidecar
        .env
        .unwrap_or_default()
        .into_iter()
        .map(|e| {
            let value = match (e.value, e.value_from) {
                (Some(v), _) => v,
                (None, Some(from)) => match from.field_ref.map(|f| f.field_path).as_deref() {
                    Some("metadata.name") => "billing-workers-abc".into(),
                    Some("metadata.namespace") => "shop".into(),
                    other => panic!("{}: an unexpected source {other:?}", e.name),
                },
                (None, None) => String::new(),
            };
            (e.name, value)
        })
        .collect()
}

/// Parses an environment with the sidecar's `Config`, as flags: every variable must be one
/// the sidecar reads.
fn parse(environment: &BTreeMap<String, String>) -> Config {
    let command = Config::command();
    let mut args = vec!["cosmosq-sidecar".to_owned()];
    for (name, value) in environment {
        let arg = command
            .get_arguments()
            .find(|a| a.get_env().and_then(|e| e.to_str()) == Some(name.as_str()))
            .unwrap_or_else(|| panic!("the sidecar reads no variable {name}"));
        let long = arg.get_long().expect("a long flag");
        if arg.get_action().takes_values() {
            args.push(format!("--{long}={value}"));
        } else {
            // A switch reads its variable as a boolean, as clap's env handling does.
            match value.as_str() {
                "true" => args.push(format!("--{long}")),
                "false" => {}
                other => panic!("{name}={other:?}: a switch wants true or false"),
            }
        }
    }
    <Config as clap::Parser>::try_parse_from(args).unwrap_or_else(|e| panic!("{e}"))
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
    ] {
        let environment = sidecar_environment(group.clone());
        let config = parse(&environment);
        let debug = format!("{config:?}");
        assert_eq!(config.queue, "orders", "{group}");
        assert_eq!(config.group, "billing", "{group}");
        assert_eq!(config.pod_name.as_deref(), Some("billing-workers-abc"));
        if group.get("deliveryMode").is_some() {
            assert!(debug.contains("Stream"), "{group}: {debug}");
            assert!(debug.contains("Beginning"), "{group}: {debug}");
            assert_eq!(config.app_port, 9000);
        } else {
            assert!(debug.contains("Exclusive"), "{debug}");
            assert_eq!(config.app_port, 8080);
            // The drain outlasts the longest delivery (app.timeout 60 s by default).
            assert_eq!(config.grace_period, std::time::Duration::from_secs(70));
        }
        assert_eq!(config.ordered, group["ordered"] == true, "{group}");
        if group["app"]["timeout"] == "5m" {
            assert_eq!(config.app_timeout, std::time::Duration::from_secs(300));
            assert_eq!(config.grace_period, std::time::Duration::from_secs(310));
        }
    }
}
