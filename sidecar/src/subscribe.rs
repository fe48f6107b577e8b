//! Programmatic subscriptions, the Dapr way: at start the sidecar asks the app
//! `GET /dapr/subscribe` and routes each message of the queue's topic by the app's entry for it
//! (`route`, or `routes` with CEL `rules` over the CloudEvent and a `default`; `metadata`
//! `rawPayload`). An app without the endpoint keeps the configured `app.path`.
//!
//! Parsing and routing are pure; [`discover`] is the one request.

use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;
use tracing::{info, warn};

/// The path Dapr asks apps for their subscriptions.
pub const SUBSCRIBE_PATH: &str = "/dapr/subscribe";

/// What makes an app's subscriptions unusable: the sidecar does not start on them (nothing is
/// delivered to a route the app did not mean).
#[derive(Debug, thiserror::Error)]
pub enum SubscribeError {
    /// The answer is a JSON list, but not of subscriptions.
    #[error("GET {SUBSCRIBE_PATH}: not a list of subscriptions: {0}")]
    Shape(serde_json::Error),
    /// A rule's `match` is not CEL.
    #[error("GET {SUBSCRIBE_PATH}: topic {topic:?}: rule {index} ({source_text:?}) is not a CEL expression: {error}")]
    Rule {
        /// The entry's topic.
        topic: String,
        /// The rule's position, from 0.
        index: usize,
        /// Its `match`.
        source_text: String,
        /// The parser's complaint.
        error: String,
    },
    /// A declared subscription for another topic than the queue.
    #[error("the declared subscription is for topic {declared:?}, not this queue's {queue:?}")]
    Topic {
        /// Its topic.
        declared: String,
        /// The queue.
        queue: String,
    },
    /// A gRPC app's `ListTopicSubscriptions` failed.
    #[error("the app's {0}")]
    Call(String),
    /// A route that is not a path.
    #[error(
        "GET {SUBSCRIBE_PATH}: topic {topic:?}: {path:?} is not a path (it must start with '/')"
    )]
    Path {
        /// The entry's topic.
        topic: String,
        /// The route.
        path: String,
    },
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Entry {
    #[serde(default)]
    pubsubname: String,
    topic: String,
    #[serde(default)]
    route: Option<String>,
    #[serde(default)]
    routes: Option<Routes>,
    #[serde(default)]
    metadata: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    bulk_subscribe: Option<BulkEntry>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct BulkEntry {
    #[serde(default)]
    enabled: bool,
    #[serde(default)]
    max_messages_count: Option<u32>,
    #[serde(default)]
    max_await_duration_ms: Option<u64>,
}

#[derive(Deserialize)]
struct Routes {
    #[serde(default)]
    rules: Vec<RuleEntry>,
    #[serde(default)]
    default: Option<String>,
}

#[derive(Deserialize)]
struct RuleEntry {
    #[serde(rename = "match")]
    matches: String,
    path: String,
}

/// One CEL rule and where what it matches goes.
pub struct Rule {
    program: cel::Program,
    /// The expression, for logs and dead letters.
    pub source: String,
    /// The path matched messages are posted to.
    pub path: String,
}

impl std::fmt::Debug for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rule")
            .field("source", &self.source)
            .field("path", &self.path)
            .finish()
    }
}

/// The app's subscription to this queue's topic.
#[derive(Debug)]
pub struct Subscription {
    /// The pub/sub name the app gave, which the CloudEvents carry back to it.
    pub pubsub_name: String,
    /// Tried in order; the first that matches routes the message.
    pub rules: Vec<Rule>,
    /// Where messages no rule matches go (`route`, or `routes.default`); without one they
    /// are dead-lettered, never dropped.
    pub default: Option<String>,
    /// `metadata.rawPayload: "true"`: the body as it is, not a CloudEvent.
    pub raw_payload: bool,
    /// `bulkSubscribe.enabled`: messages go to the app together (see [`crate::bulk`]).
    pub bulk: Option<crate::bulk::BulkSettings>,
}

/// Where a message goes.
#[derive(Debug, PartialEq, Eq)]
pub enum Route<'a> {
    /// This path.
    Path(&'a str),
    /// Nowhere: no rule matched and there is no default (the reason says which rules).
    Unmatched(String),
}

impl Subscription {
    /// The path for a message, judged on its CloudEvent (`event` in the rules, as Dapr
    /// names it). A rule that fails to evaluate (a missing field, a type mismatch) does not
    /// match, as in Dapr.
    pub fn route(&self, event: &Value) -> Route<'_> {
        if !self.rules.is_empty() {
            let mut context = cel::Context::default();
            match cel::to_value(event) {
                Ok(value) => context.add_variable_from_value("event", value),
                Err(e) => warn!(error = %e, "the CloudEvent does not convert to CEL"),
            }
            for rule in &self.rules {
                if let Ok(cel::Value::Bool(true)) = rule.program.execute(&context) {
                    return Route::Path(&rule.path);
                }
            }
        }
        match &self.default {
            Some(path) => Route::Path(path),
            None => Route::Unmatched(format!(
                "no subscription rule matched ({}) and the subscription has no default route",
                self.rules
                    .iter()
                    .map(|r| r.source.as_str())
                    .collect::<Vec<_>>()
                    .join("; ")
            )),
        }
    }
}

/// A subscription list with its field names as daprd's Go decoder reads them (`pubSubName`,
/// `Route`, `maxMessagesCount` in any case); values and metadata keys untouched. Pure.
fn go_fields(mut list: Value) -> Value {
    use crate::dapr::go_json::{fold, fold_each};
    const ENTRY: [&str; 6] = [
        "pubsubname",
        "topic",
        "route",
        "routes",
        "metadata",
        "bulkSubscribe",
    ];
    fold_each(&mut list, &ENTRY);
    for entry in list.as_array_mut().into_iter().flatten() {
        if let Some(routes) = entry.get_mut("routes") {
            fold(routes, &["rules", "default"]);
            if let Some(rules) = routes.get_mut("rules") {
                fold_each(rules, &["match", "path"]);
            }
        }
        if let Some(bulk) = entry.get_mut("bulkSubscribe") {
            fold(bulk, &["enabled", "maxMessagesCount", "maxAwaitDurationMs"]);
        }
    }
    list
}

/// The app's subscription to `topic` in a `GET /dapr/subscribe` answer (pure). `Ok(None)`
/// when the app subscribes to other topics only, or did not answer with a list (an app that
/// is not a Dapr app and answers every path).
pub fn parse(body: &[u8], topic: &str) -> Result<Option<Subscription>, SubscribeError> {
    let Ok(value) = serde_json::from_slice::<Value>(body) else {
        return Ok(None);
    };
    if !value.is_array() {
        return Ok(None);
    }
    let entries: Vec<Entry> =
        serde_json::from_value(go_fields(value)).map_err(SubscribeError::Shape)?;
    let Some(entry) = entries.into_iter().find(|e| e.topic == topic) else {
        return Ok(None);
    };
    let path = |path: String| {
        if path.starts_with('/') {
            Ok(path)
        } else if path.is_empty() {
            Err(SubscribeError::Path {
                topic: topic.to_owned(),
                path,
            })
        } else {
            // Dapr's SDKs write routes without the slash too (`"route": "orders"`).
            Ok(format!("/{path}"))
        }
    };
    let (rules, default) = match entry.routes {
        Some(routes) => {
            let rules = routes
                .rules
                .into_iter()
                .enumerate()
                .map(|(index, rule)| {
                    let program =
                        cel::Program::compile(&rule.matches).map_err(|e| SubscribeError::Rule {
                            topic: topic.to_owned(),
                            index,
                            source_text: rule.matches.clone(),
                            error: e.to_string(),
                        })?;
                    Ok(Rule {
                        program,
                        source: rule.matches,
                        path: path(rule.path)?,
                    })
                })
                .collect::<Result<Vec<_>, SubscribeError>>()?;
            let default = routes.default.or(entry.route).map(path).transpose()?;
            (rules, default)
        }
        None => (Vec::new(), entry.route.map(path).transpose()?),
    };
    Ok(Some(Subscription {
        pubsub_name: entry.pubsubname,
        rules,
        default,
        raw_payload: entry
            .metadata
            .get("rawPayload")
            .is_some_and(|v| v.eq_ignore_ascii_case("true")),
        bulk: entry.bulk_subscribe.filter(|b| b.enabled).map(|b| {
            let defaults = crate::bulk::BulkSettings::default();
            crate::bulk::BulkSettings {
                max_messages: b
                    .max_messages_count
                    .filter(|n| *n > 0)
                    .map_or(defaults.max_messages, |n| n as usize),
                max_await: b
                    .max_await_duration_ms
                    .map_or(defaults.max_await, Duration::from_millis),
            }
        }),
    }))
}

/// A subscription declared in the sidecar's settings (`--app-subscription`, from the group's
/// `app.subscription`): one entry in Dapr's format, for `topic`.
pub fn declared(entry: &str, topic: &str) -> Result<Subscription, SubscribeError> {
    let entry: Value = serde_json::from_str(entry).map_err(SubscribeError::Shape)?;
    let named = entry
        .get("topic")
        .and_then(Value::as_str)
        .map(str::to_owned);
    let body = serde_json::to_vec(&[entry]).unwrap_or_default();
    parse(&body, topic)?.ok_or_else(|| SubscribeError::Topic {
        declared: named.unwrap_or_default(),
        queue: topic.to_owned(),
    })
}

/// Asks the app for its subscriptions (once, at start). An app that does not serve them (an
/// error status, a refused or failed request) keeps the configured path.
pub async fn discover(
    port: u16,
    topic: &str,
    token: Option<&crate::settings::Token>,
) -> Result<Option<Subscription>, SubscribeError> {
    let http = crate::transport::app_http(token)
        .timeout(Duration::from_secs(5))
        .build()
        .expect("a plain HTTP client builds");
    let answer = http
        .get(format!("http://127.0.0.1:{port}{SUBSCRIBE_PATH}"))
        .send()
        .await;
    let body = match answer {
        Ok(r) if r.status().is_success() => r.bytes().await.unwrap_or_default(),
        Ok(r) => {
            info!(
                status = r.status().as_u16(),
                "the app serves no {SUBSCRIBE_PATH}; delivering to the configured path"
            );
            return Ok(None);
        }
        Err(e) => {
            warn!(error = %e, "GET {SUBSCRIBE_PATH} failed; delivering to the configured path");
            return Ok(None);
        }
    };
    let subscription = parse(&body, topic)?;
    match &subscription {
        Some(s) => info!(
            pubsub = %s.pubsub_name,
            rules = s.rules.len(),
            default = ?s.default,
            raw_payload = s.raw_payload,
            "routing by the app's subscription"
        ),
        None => warn!(
            topic,
            "the app's {SUBSCRIBE_PATH} has no subscription to this queue's topic; delivering to the configured path"
        ),
    }
    Ok(subscription)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn subscription(entries: Value) -> Subscription {
        parse(&serde_json::to_vec(&entries).unwrap(), "orders")
            .unwrap()
            .expect("a subscription to orders")
    }

    #[test]
    fn field_names_are_read_as_daprd_reads_them() {
        let s = subscription(json!([{
            "PubsubName": "bus", "Topic": "orders",
            "Routes": {"Rules": [{"Match": "event.type == \"b\"", "Path": "/b"}], "Default": "/all"},
            "BulkSubscribe": {"Enabled": true, "MaxMessagesCount": 7},
            "Metadata": {"rawPayload": "true"}
        }]));
        assert_eq!(s.pubsub_name, "bus");
        assert_eq!(s.rules.len(), 1);
        assert_eq!(s.rules[0].path, "/b");
        assert_eq!(s.default.as_deref(), Some("/all"));
        assert!(s.raw_payload);
        assert!(s.bulk.is_some(), "bulk subscription read");
    }

    #[test]
    fn rules_route_in_order_then_the_default() {
        // As Dapr's documentation writes them.
        let s = subscription(json!([
            {"pubsubname": "pubsub", "topic": "other", "route": "/other"},
            {"pubsubname": "pubsub", "topic": "orders", "routes": {
                "rules": [
                    {"match": "event.type == \"widget\"", "path": "/widgets"},
                    {"match": "event.data.price > 100", "path": "/expensive"},
                    {"match": "event.data.tags.exists(t, t == \"rush\")", "path": "rush"}
                ],
                "default": "/orders"}}
        ]));
        assert_eq!(s.pubsub_name, "pubsub");
        assert!(!s.raw_payload);
        for (event, expected) in [
            (
                json!({"type": "widget", "data": {"price": 500}}),
                "/widgets",
            ),
            (
                json!({"type": "gadget", "data": {"price": 101}}),
                "/expensive",
            ),
            (
                json!({"type": "gadget", "data": {"price": 100.5}}),
                "/expensive",
            ),
            (
                json!({"type": "gadget", "data": {"price": 3, "tags": ["rush"]}}),
                "/rush",
            ),
            (json!({"type": "gadget", "data": {"price": 100}}), "/orders"),
            // A rule over a field the event lacks does not match (nor fail the others).
            (json!({"type": "gadget", "data": "text"}), "/orders"),
        ] {
            assert_eq!(s.route(&event), Route::Path(expected), "{event}");
        }
    }

    #[test]
    fn bulk_subscribe_takes_its_limits_or_dapr_s_defaults() {
        let entry = |bulk: Value| {
            subscription(json!([{"pubsubname": "p", "topic": "orders", "route": "/o",
                "bulkSubscribe": bulk}]))
            .bulk
        };
        let asked =
            entry(json!({"enabled": true, "maxMessagesCount": 5, "maxAwaitDurationMs": 300}));
        assert_eq!(
            asked,
            Some(crate::bulk::BulkSettings {
                max_messages: 5,
                max_await: Duration::from_millis(300)
            })
        );
        assert_eq!(
            entry(json!({"enabled": true})),
            Some(crate::bulk::BulkSettings::default())
        );
        assert_eq!(
            entry(json!({"enabled": false, "maxMessagesCount": 5})),
            None
        );
        assert!(subscription(json!([{"topic": "orders", "route": "/o"}]))
            .bulk
            .is_none());
    }

    #[test]
    fn route_alone_and_raw_payload() {
        let s = subscription(json!([{"pubsubname": "pubsub", "topic": "orders",
            "route": "orders", "metadata": {"rawPayload": "true"}}]));
        assert_eq!(s.route(&json!({})), Route::Path("/orders"));
        assert!(s.raw_payload);
    }

    #[test]
    fn without_a_default_an_unmatched_message_is_said_so() {
        let s = subscription(json!([{"pubsubname": "p", "topic": "orders", "routes": {
            "rules": [{"match": "event.type == \"a\"", "path": "/a"}]}}]));
        let Route::Unmatched(reason) = s.route(&json!({"type": "b"})) else {
            panic!("unmatched")
        };
        assert!(reason.contains("event.type == \"a\""), "{reason}");
    }

    #[test]
    fn what_is_not_a_dapr_answer_keeps_the_configured_path() {
        for body in [&b"OK"[..], b"{\"status\": \"up\"}", b"[]", b""] {
            assert!(parse(body, "orders").unwrap().is_none(), "{body:?}");
        }
        let other = serde_json::to_vec(&json!([{"topic": "other", "route": "/x"}])).unwrap();
        assert!(parse(&other, "orders").unwrap().is_none());
    }

    #[test]
    fn a_declared_subscription_reads_as_a_discovered_one() {
        let s = declared(
            r#"{"pubsubname": "cosmosq", "topic": "orders", "routes": {"rules": [{"match": "event.data.n > 1", "path": "/big"}], "default": "/small"}}"#,
            "orders",
        )
        .unwrap();
        assert_eq!(s.route(&json!({"data": {"n": 2}})), Route::Path("/big"));
        assert_eq!(s.route(&json!({"data": {"n": 1}})), Route::Path("/small"));
        let other = declared(r#"{"topic": "payments", "route": "/p"}"#, "orders").unwrap_err();
        assert!(other.to_string().contains("payments"), "{other}");
    }

    #[test]
    fn a_broken_subscription_is_refused_with_what_is_wrong() {
        let rule = serde_json::to_vec(&json!([{"topic": "orders", "routes": {
            "rules": [{"match": "event.type ==", "path": "/a"}]}}]))
        .unwrap();
        let e = parse(&rule, "orders").unwrap_err().to_string();
        assert!(e.contains("rule 0") && e.contains("event.type =="), "{e}");
        let shape = serde_json::to_vec(&json!([{"route": "/a"}])).unwrap();
        assert!(matches!(
            parse(&shape, "orders"),
            Err(SubscribeError::Shape(_))
        ));
        let empty = serde_json::to_vec(&json!([{"topic": "orders", "route": ""}])).unwrap();
        assert!(matches!(
            parse(&empty, "orders"),
            Err(SubscribeError::Path { .. })
        ));
    }
}
