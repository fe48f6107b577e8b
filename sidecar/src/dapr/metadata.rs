//! Dapr's metadata API: `GET /v1.0/metadata` in daprd's shape, and `PUT /v1.0/metadata/{key}`
//! for the app's own attributes. The official SDKs wait on it before they start (the
//! JavaScript SDK's `DaprClient` and `DaprServer` poll it until it answers), and apps read it
//! to learn the pub/sub they may publish to and the subscriptions the sidecar follows.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::api::ApiState;
use crate::app::PUBSUB_NAME;
use crate::subscribe::Subscription;

/// The component type the metadata gives the sidecar's pub/sub.
pub const COMPONENT_TYPE: &str = "pubsub.cosmosq";

/// What the sidecar says of itself, fixed at start.
#[derive(Clone, Debug)]
pub struct About {
    /// The app id: the consumer group's name (its pods' Deployment is `<group>-workers`).
    pub id: String,
    /// The app's port in push mode; `None` for a pull group (the sidecar calls no app).
    pub app_port: Option<u16>,
    /// Deliveries in flight at most (daprd's `--app-max-concurrency`).
    pub max_concurrency: usize,
    /// How the app is called: `http` or `grpc` (daprd's `--app-protocol`).
    pub protocol: &'static str,
}

/// The subscription as Dapr's metadata lists it (pure): each rule with its CEL `match`, then
/// the default route as a rule without one, as daprd lists `routes.default` (it omits empty
/// fields). `declared`: given by the operator (`spec.app.subscription`) rather than asked of
/// the app.
pub fn listed(subscription: &Subscription, topic: &str, declared: bool) -> Value {
    let mut rules: Vec<Value> = subscription
        .rules
        .iter()
        .map(|rule| json!({"match": rule.source, "path": rule.path}))
        .collect();
    if let Some(path) = &subscription.default {
        rules.push(json!({"path": path}));
    }
    let mut listed = json!({
        "pubsubname": subscription.pubsub_name,
        "topic": topic,
        "rules": rules,
        "type": if declared { "DECLARATIVE" } else { "PROGRAMMATIC" },
    });
    if subscription.raw_payload {
        listed["metadata"] = json!({"rawPayload": "true"});
    }
    listed
}

/// The whole `GET /v1.0/metadata` answer (pure), in the shape of daprd's (the fields a
/// pub/sub sidecar has). The pub/sub is listed under the sidecar's
/// name and, when the app subscribed under another, under that one too: both publish here.
pub fn document(
    about: &About,
    apps_pubsub: Option<&str>,
    subscription: Option<&Value>,
    attributes: &BTreeMap<String, String>,
) -> Value {
    let mut names = vec![PUBSUB_NAME];
    if let Some(name) = apps_pubsub.filter(|n| *n != PUBSUB_NAME) {
        names.push(name);
    }
    let components: Vec<Value> = names
        .into_iter()
        .map(|name| json!({"name": name, "type": COMPONENT_TYPE, "version": "v1", "capabilities": []}))
        .collect();
    let mut extended: BTreeMap<String, String> = attributes.clone();
    extended.insert("runtime".into(), "cosmosq".into());
    let mut document = json!({
        "id": about.id,
        "runtimeVersion": env!("CARGO_PKG_VERSION"),
        "enabledFeatures": [],
        "actors": [],
        "components": components,
        "httpEndpoints": [],
        "subscriptions": subscription.into_iter().collect::<Vec<_>>(),
        "extended": extended,
    });
    if let Some(port) = about.app_port {
        document["appConnectionProperties"] = json!({
            "port": port,
            "protocol": about.protocol,
            "channelAddress": "127.0.0.1",
            "maxConcurrency": about.max_concurrency,
        });
    }
    document
}

/// The metadata document of the sidecar as it is now.
pub fn current(state: &ApiState) -> Value {
    let attributes = state
        .attributes
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    document(
        &state.about,
        state.pubsub_name.get().map(String::as_str),
        state.subscription.get(),
        &attributes,
    )
}

/// `GET /v1.0/metadata`.
pub async fn get(State(state): State<Arc<ApiState>>) -> Json<Value> {
    Json(current(&state))
}

/// Sets one of the app's attributes; a new key past [`MAX_ATTRIBUTES`] is refused.
pub fn set(state: &ApiState, key: String, value: String) -> Result<(), String> {
    let mut attributes = state.attributes.lock().unwrap_or_else(|e| e.into_inner());
    if !attributes.contains_key(&key) && attributes.len() >= MAX_ATTRIBUTES {
        return Err(format!(
            "metadata {key:?}: at most {MAX_ATTRIBUTES} attributes are kept"
        ));
    }
    attributes.insert(key, value);
    Ok(())
}

/// The most attributes kept: they live in the sidecar's memory, and a loop in the app must
/// not be able to grow it without bound (daprd sets no limit).
pub const MAX_ATTRIBUTES: usize = 128;

/// The largest attribute value taken, in bytes (the route's body limit).
pub const MAX_ATTRIBUTE_BYTES: usize = 64 * 1024;

/// `PUT /v1.0/metadata/{key}`: the body, as text, is the attribute's value (daprd's
/// behaviour, bytes that are not UTF-8 replaced); it lives in memory until the sidecar
/// restarts. A new key past [`MAX_ATTRIBUTES`] is refused; a value past
/// [`MAX_ATTRIBUTE_BYTES`] is refused by the route's body limit (`413`).
pub async fn put(
    State(state): State<Arc<ApiState>>,
    Path(key): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    let value = String::from_utf8_lossy(&body).into_owned();
    match set(&state, key, value) {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(message) => {
            let body = json!({"errorCode": "ERR_METADATA_SET", "message": message});
            (StatusCode::BAD_REQUEST, Json(body)).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn about(app_port: Option<u16>) -> About {
        About {
            id: "billing".into(),
            app_port,
            max_concurrency: 8,
            protocol: "http",
        }
    }

    #[test]
    fn the_document_lists_the_pubsub_the_subscription_and_the_attributes() {
        let subscription = crate::subscribe::parse(
            br#"[{"pubsubname": "orders-bus", "topic": "q", "routes": {"rules": [{"match": "event.type == \"widget\"", "path": "/widgets"}], "default": "/orders"}}]"#,
            "q",
        )
        .unwrap()
        .unwrap();
        let listed = listed(&subscription, "q", false);
        let attributes = BTreeMap::from([("team".to_owned(), "payments".to_owned())]);
        let doc = document(
            &about(Some(3000)),
            Some("orders-bus"),
            Some(&listed),
            &attributes,
        );
        assert_eq!(doc["id"], "billing");
        assert_eq!(
            doc["components"],
            json!([
                {"name": PUBSUB_NAME, "type": COMPONENT_TYPE, "version": "v1", "capabilities": []},
                {"name": "orders-bus", "type": COMPONENT_TYPE, "version": "v1", "capabilities": []}
            ])
        );
        assert_eq!(
            doc["subscriptions"],
            json!([{
                "pubsubname": "orders-bus",
                "topic": "q",
                "rules": [
                    {"match": "event.type == \"widget\"", "path": "/widgets"},
                    {"path": "/orders"}
                ],
                "type": "PROGRAMMATIC"
            }])
        );
        assert_eq!(doc["extended"]["team"], "payments");
        assert_eq!(doc["extended"]["runtime"], "cosmosq");
        assert_eq!(doc["appConnectionProperties"]["port"], 3000);
        assert_eq!(doc["appConnectionProperties"]["maxConcurrency"], 8);
    }

    #[test]
    fn a_pull_group_before_any_subscription_lists_its_pubsub_and_no_app() {
        let doc = document(&about(None), None, None, &BTreeMap::new());
        assert_eq!(doc["components"][0]["name"], PUBSUB_NAME);
        assert_eq!(doc["components"].as_array().unwrap().len(), 1);
        assert_eq!(doc["subscriptions"], json!([]));
        assert!(doc.get("appConnectionProperties").is_none(), "{doc}");
    }

    #[test]
    fn a_declared_subscription_is_listed_as_declarative_with_its_raw_payload() {
        let subscription = crate::subscribe::declared(
            r#"{"pubsubname": "pubsub", "topic": "q", "route": "/jobs", "metadata": {"rawPayload": "true"}}"#,
            "q",
        )
        .unwrap();
        let listed = listed(&subscription, "q", true);
        assert_eq!(listed["type"], "DECLARATIVE");
        assert_eq!(listed["metadata"]["rawPayload"], "true");
        assert_eq!(listed["rules"], json!([{"path": "/jobs"}]));
    }
}
