//! The CRDs' CEL rules, judged by a CEL interpreter (`kube::core::cel`) in every test run, on
//! the same cases the real-cluster suite sends to a real API server.

use cosmosq_crds::{CosmosQueue, QueueConsumerGroup};
use cosmosq_tests::crd_rules::{cases, Kind};
use kube::core::cel::Validator;
use kube::CustomResourceExt;
use serde_json::Value;

fn schema(kind: Kind) -> Value {
    let crd = match kind {
        Kind::Queue => CosmosQueue::crd(),
        Kind::Group => QueueConsumerGroup::crd(),
    };
    serde_json::to_value(
        crd.spec.versions[0]
            .schema
            .as_ref()
            .and_then(|s| s.open_api_v3_schema.as_ref())
            .expect("an openAPIV3Schema"),
    )
    .expect("the schema as JSON")
}

/// Every `x-kubernetes-validations` message in a schema.
fn rule_messages(schema: &Value, out: &mut Vec<String>) {
    match schema {
        Value::Object(map) => {
            for rule in map
                .get("x-kubernetes-validations")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                out.push(rule["message"].as_str().unwrap_or_default().to_owned());
            }
            map.values().for_each(|v| rule_messages(v, out));
        }
        Value::Array(items) => items.iter().for_each(|v| rule_messages(v, out)),
        _ => {}
    }
}

#[test]
fn the_cel_rules_accept_and_refuse_what_the_api_server_does() {
    let validator = Validator::new();
    for case in cases().into_iter().filter(|c| c.cel) {
        let object = case.object(&case.spec);
        let old = case.old.as_ref().map(|o| case.object(o));
        let result = validator.validate(&schema(case.kind), &object, old.as_ref());
        match (case.refused_with, result) {
            (None, Ok(())) => {}
            (Some(message), Err(errors)) => assert!(
                errors.iter().any(|e| e.message.contains(message)),
                "{}: refused, but not with {message:?}: {errors}",
                case.id
            ),
            (None, Err(errors)) => panic!("{}: refused: {errors}", case.id),
            (Some(message), Ok(())) => panic!("{}: accepted, want {message:?}", case.id),
        }
    }
}

#[test]
fn every_cel_rule_has_a_case_it_refuses() {
    let refusals: Vec<&str> = cases()
        .iter()
        .filter(|c| c.cel)
        .filter_map(|c| c.refused_with)
        .collect();
    for kind in [Kind::Queue, Kind::Group] {
        let mut messages = Vec::new();
        rule_messages(&schema(kind), &mut messages);
        assert!(!messages.is_empty());
        for message in messages {
            assert!(
                refusals.iter().any(|r| message.contains(r)),
                "no case is refused by the rule {message:?}"
            );
        }
    }
}
