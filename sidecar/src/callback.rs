//! Delivery to a gRPC app (`app.protocol: Grpc`, Dapr's `--app-protocol grpc`): the app serves
//! Dapr's `AppCallback` (as apps on the Python SDK's `dapr-ext-grpc`, the JavaScript SDK's
//! `DaprServer` over gRPC, the Java, .NET and Go SDKs do). The sidecar lists its subscriptions
//! with `ListTopicSubscriptions` at start and delivers each message with `OnTopicEvent`, whose
//! `TopicEventResponse` status (`SUCCESS`, `RETRY`, `DROP`) settles it as the HTTP answers do;
//! a bulk subscription's messages go together through `OnBulkTopicEvent` (batched by
//! `bulk.rs`, each entry settled by its own status).
//! Everything around a call (breaker, crash isolation, lock renewal, metrics) is
//! `delivery.rs`'s, the same as over HTTP.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cosmosq_queue::Delivery;
use dapr::dapr::proto::runtime::v1 as pb;
use pb::app_callback_client::AppCallbackClient;
use pb::topic_event_response::TopicEventResponseStatus;
use serde_json::{json, Value};
use tonic::transport::Channel;
use tonic::Code;

use crate::app::{self, Answer};
use crate::bulk::Bulker;
use crate::settings::Token;
use crate::subscribe::{self, Route, SubscribeError, Subscription};
use crate::transport::{AppTransport, Called};

/// Calls to the app's `AppCallback` at `127.0.0.1:<port>`.
#[derive(Clone)]
pub struct Callback {
    client: AppCallbackClient<Channel>,
    token: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
    timeout: Duration,
}

/// The app's `AppCallback` as the group's transport.
pub struct GrpcTransport {
    callback: Callback,
    /// The app's subscription to this queue, once listed.
    subscription: OnceLock<Subscription>,
    /// Its bulk deliveries (`OnBulkTopicEvent`), when it asked for them.
    bulker: OnceLock<Arc<Bulker>>,
}

impl GrpcTransport {
    /// The app at `127.0.0.1:<port>`, answering within `timeout`, told it is its sidecar
    /// calling by `token` (`dapr-api-token` metadata, as Dapr's `APP_API_TOKEN`).
    pub fn new(port: u16, timeout: Duration, token: Option<&Token>) -> Self {
        let channel = Channel::from_shared(format!("http://127.0.0.1:{port}"))
            .expect("a loopback URI")
            .connect_timeout(Duration::from_secs(2))
            .connect_lazy();
        Self {
            callback: Callback {
                client: AppCallbackClient::new(channel),
                token: token.map(|t| {
                    let mut value: tonic::metadata::MetadataValue<_> = t
                        .expose()
                        .parse()
                        .expect("a token is visible ASCII (checked when parsed)");
                    value.set_sensitive(true);
                    value
                }),
                timeout,
            },
            subscription: OnceLock::new(),
            bulker: OnceLock::new(),
        }
    }

    /// Routes by `subscription` from now on; the first one set stays.
    pub fn subscribe(&self, subscription: Subscription) {
        let _ = self.subscription.set(subscription);
    }

    /// The app's subscription to `topic`, from `ListTopicSubscriptions` (once, at start);
    /// `None` when it subscribes to other topics only.
    pub async fn subscriptions(&self, topic: &str) -> Result<Option<Subscription>, SubscribeError> {
        let callback = &self.callback;
        let listed = callback
            .client
            .clone()
            .list_topic_subscriptions(callback.request(()))
            .await
            .map_err(|e| SubscribeError::Call(format!("ListTopicSubscriptions: {e}")))?
            .into_inner();
        let entries = as_dapr_entries(&listed);
        subscribe::parse(&serde_json::to_vec(&entries).unwrap_or_default(), topic)
    }
}

impl Callback {
    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(self.timeout);
        if let Some(token) = &self.token {
            request
                .metadata_mut()
                .insert(crate::api::API_TOKEN_HEADER, token.clone());
        }
        request
    }

    /// One batch through `OnBulkTopicEvent`: each entry's answer by its own status; a failed
    /// call means for every entry what it would for one message.
    pub async fn bulk(
        &self,
        route: &str,
        entries: &[crate::bulk::Entry],
        pubsub_name: &str,
        topic: &str,
    ) -> Vec<Called> {
        let request = bulk_request(route, entries, pubsub_name, topic);
        let answer = self
            .client
            .clone()
            .on_bulk_topic_event(self.request(request))
            .await;
        match answer {
            Ok(response) => {
                let statuses: std::collections::HashMap<String, i32> = response
                    .into_inner()
                    .statuses
                    .into_iter()
                    .map(|s| (s.entry_id, s.status))
                    .collect();
                entries
                    .iter()
                    .map(|entry| {
                        let status = statuses.get(&entry.id).map(|s| {
                            TopicEventResponseStatus::try_from(*s)
                                .map_or("unknown", |s| s.as_str_name())
                        });
                        Called {
                            answer: crate::bulk::entry_answer(&entry.id, status),
                            failure: None,
                            crashed: false,
                        }
                    })
                    .collect()
            }
            Err(status) => vec![classify(Err(status), self.timeout); entries.len()],
        }
    }
}

/// The `OnBulkTopicEvent` request of a batch bound for `route` (pure): each entry its
/// CloudEvent (as [`event_request`] makes it) or, with `rawPayload`, its bytes.
pub fn bulk_request(
    route: &str,
    entries: &[crate::bulk::Entry],
    pubsub_name: &str,
    topic: &str,
) -> pb::TopicEventBulkRequest {
    use pb::topic_event_bulk_request_entry::Event;
    pb::TopicEventBulkRequest {
        id: uuid::Uuid::new_v4().to_string(),
        entries: entries
            .iter()
            .map(|entry| {
                let event = match &entry.raw {
                    Some(bytes) => Event::Bytes(bytes.clone()),
                    None => {
                        let e = event_request(&entry.event, "", None);
                        Event::CloudEvent(pb::TopicEventCeRequest {
                            id: e.id,
                            source: e.source,
                            r#type: e.r#type,
                            spec_version: e.spec_version,
                            data_content_type: e.data_content_type,
                            data: e.data,
                            extensions: e.extensions,
                        })
                    }
                };
                pb::TopicEventBulkRequestEntry {
                    entry_id: entry.id.clone(),
                    content_type: entry.content_type.clone(),
                    metadata: entry
                        .metadata
                        .iter()
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect(),
                    event: Some(event),
                }
            })
            .collect(),
        metadata: Default::default(),
        topic: topic.to_owned(),
        pubsub_name: pubsub_name.to_owned(),
        r#type: "com.dapr.event.sent.bulk".into(),
        path: path_of(route).to_owned(),
    }
}

/// A gRPC app's subscriptions as the entries of Dapr's HTTP `GET /dapr/subscribe` answer
/// (pure), so both are read by one parser. A gRPC route is a name the app gets back in
/// `TopicEventRequest.path`, often empty (the SDKs' handler for the whole topic); each is
/// written here behind a `/` (`""` → `/`), which [`path_of`] takes off again.
pub fn as_dapr_entries(listed: &pb::ListTopicSubscriptionsResponse) -> Value {
    let route = |path: &str| format!("/{path}");
    let entries: Vec<Value> = listed
        .subscriptions
        .iter()
        .map(|s| {
            let routes = s.routes.clone().unwrap_or_default();
            let mut listed = json!({
                "rules": routes.rules.iter()
                    .map(|r| json!({"match": r.r#match, "path": route(&r.path)}))
                    .collect::<Vec<_>>(),
            });
            // As daprd reads them: a default route only when one is named, or when there are
            // no rules (the topic's own handler, path ""); with rules and none, a message no
            // rule matches has no route (daprd drops it, the sidecar dead-letters it).
            if !routes.default.is_empty() || routes.rules.is_empty() {
                listed["default"] = json!(route(&routes.default));
            }
            let mut entry = json!({
                "pubsubname": s.pubsub_name,
                "topic": s.topic,
                "routes": listed,
                "metadata": s.metadata.iter().collect::<BTreeMap<_, _>>(),
            });
            if let Some(bulk) = &s.bulk_subscribe {
                entry["bulkSubscribe"] = json!({
                    "enabled": bulk.enabled,
                    "maxMessagesCount": bulk.max_messages_count,
                    "maxAwaitDurationMs": bulk.max_await_duration_ms,
                });
            }
            entry
        })
        .collect();
    Value::Array(entries)
}

/// The gRPC path of a route written by [`as_dapr_entries`] (pure).
pub fn path_of(route: &str) -> &str {
    route.strip_prefix('/').unwrap_or(route)
}

/// The `OnTopicEvent` request of a delivery (pure but for the clock of a new trace): the
/// CloudEvent's attributes in their fields, its data as bytes (JSON as JSON text, text as
/// UTF-8, `data_base64` decoded), every other attribute (trace context, time, subject) in
/// `extensions`; with `raw`, the message's body as it was enqueued.
pub fn event_request(
    event: &Value,
    path: &str,
    raw: Option<(&[u8], String)>,
) -> pb::TopicEventRequest {
    let text = |name: &str| event[name].as_str().unwrap_or_default().to_owned();
    let (data, data_content_type) = match raw {
        Some((body, content_type)) => (body.to_vec(), content_type),
        None => {
            let data = match (&event["data"], event["data_base64"].as_str()) {
                (_, Some(b64)) => {
                    use base64::Engine as _;
                    base64::engine::general_purpose::STANDARD
                        .decode(b64)
                        .unwrap_or_default()
                }
                // Text as text; a JSON string stays JSON (`"hello"`), which SDKs decode.
                (Value::String(string), None) if !is_json(&text("datacontenttype")) => {
                    string.clone().into_bytes()
                }
                (Value::Null, None) => Vec::new(),
                (data, None) => serde_json::to_vec(data).unwrap_or_default(),
            };
            (data, text("datacontenttype"))
        }
    };
    const FIELDS: [&str; 9] = [
        "id",
        "source",
        "type",
        "specversion",
        "datacontenttype",
        "data",
        "data_base64",
        "topic",
        "pubsubname",
    ];
    let extensions = event
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(name, _)| !FIELDS.contains(&name.as_str()))
        .map(|(name, value)| (name.clone(), proto_value(value)))
        .collect();
    pb::TopicEventRequest {
        id: text("id"),
        source: text("source"),
        r#type: text("type"),
        spec_version: text("specversion"),
        data_content_type,
        data,
        topic: text("topic"),
        pubsub_name: text("pubsubname"),
        path: path.to_owned(),
        extensions: Some(prost_types::Struct { fields: extensions }),
    }
}

/// Whether a media type is JSON's (`application/json`, `…+json`).
fn is_json(media_type: &str) -> bool {
    let media = media_type.split(';').next().unwrap_or_default().trim();
    media.eq_ignore_ascii_case("application/json") || media.to_ascii_lowercase().ends_with("+json")
}

/// A JSON value as protobuf's `Value`.
fn proto_value(value: &Value) -> prost_types::Value {
    use prost_types::value::Kind;
    let kind = match value {
        Value::Null => Kind::NullValue(0),
        Value::Bool(b) => Kind::BoolValue(*b),
        Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or_default()),
        Value::String(s) => Kind::StringValue(s.clone()),
        Value::Array(items) => Kind::ListValue(prost_types::ListValue {
            values: items.iter().map(proto_value).collect(),
        }),
        Value::Object(fields) => Kind::StructValue(prost_types::Struct {
            fields: fields
                .iter()
                .map(|(k, v)| (k.clone(), proto_value(v)))
                .collect(),
        }),
    };
    prost_types::Value { kind: Some(kind) }
}

/// What an `OnTopicEvent` answer means (pure): its status as the HTTP answer's `status`; an
/// error is retried, as Dapr retries it, except a call that never reached the app.
pub fn classify(answer: Result<i32, tonic::Status>, timeout: Duration) -> Called {
    let retry = |reason: String| Answer::Retry {
        reason,
        delay: None,
    };
    let called = |answer, failure| Called {
        answer,
        failure,
        crashed: false,
    };
    match answer {
        Ok(status) => match TopicEventResponseStatus::try_from(status) {
            Ok(TopicEventResponseStatus::Success) => called(Answer::Success, None),
            Ok(TopicEventResponseStatus::Retry) => {
                called(retry("the app answered RETRY".into()), None)
            }
            Ok(TopicEventResponseStatus::Drop) => called(
                Answer::Drop {
                    reason: "the app answered DROP".into(),
                },
                None,
            ),
            Err(_) => called(
                retry(format!("the app answered an unknown status {status}")),
                None,
            ),
        },
        // The app's deadline passed: the server's answer, or the client's own timer (tonic's
        // channel cancels the call itself, "Timeout expired").
        Err(status)
            if status.code() == Code::DeadlineExceeded
                || status.code() == Code::Cancelled && status.message().contains("Timeout") =>
        {
            called(
                retry(format!("the app did not answer within {timeout:?}")),
                Some("timeout"),
            )
        }
        Err(status) if status.code() == Code::Unavailable && refused(&status) => called(
            Answer::Undelivered {
                reason: "the app refused the connection".into(),
            },
            Some("connect"),
        ),
        // The connection went down under the call: the app may have crashed with it.
        Err(status) if status.code() == Code::Unavailable => Called {
            answer: retry(format!("the call to the app failed: {}", status.message())),
            failure: Some("transport"),
            crashed: true,
        },
        Err(status) => called(
            retry(format!(
                "the app answered {:?}: {}",
                status.code(),
                status.message()
            )),
            Some("status"),
        ),
    }
}

/// Whether an `UNAVAILABLE` call never connected (the app not listening).
fn refused(status: &tonic::Status) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    while let Some(error) = source {
        if let Some(io) = error.downcast_ref::<std::io::Error>() {
            return io.kind() == std::io::ErrorKind::ConnectionRefused;
        }
        source = error.source();
    }
    status.message().contains("Connection refused")
}

impl AppTransport for GrpcTransport {
    async fn call(&self, delivery: &Delivery) -> Called {
        let Some(subscription) = self.subscription.get() else {
            // Listed at start; an app without one for this topic gets nothing routed to it.
            return Called {
                answer: Answer::Drop {
                    reason: format!(
                        "the gRPC app has no subscription to topic {}",
                        delivery.queue
                    ),
                },
                failure: None,
                crashed: false,
            };
        };
        let trace = app::trace(delivery);
        let event = app::cloud_event(delivery, &trace, &subscription.pubsub_name);
        let route = match subscription.route(&event) {
            Route::Path(route) => route,
            Route::Unmatched(reason) => {
                return Called {
                    answer: Answer::Drop { reason },
                    failure: None,
                    crashed: false,
                }
            }
        };
        if let Some(settings) = subscription.bulk {
            return self
                .call_in_bulk(subscription, settings, route, event, delivery)
                .await;
        }
        let raw = subscription.raw_payload.then(|| {
            (
                delivery.message.body.to_bytes(),
                app::body_content_type(delivery),
            )
        });
        let message = event_request(
            &event,
            path_of(route),
            raw.as_ref().map(|(b, c)| (b.as_slice(), c.clone())),
        );
        let callback = &self.callback;
        let mut request = callback.request(message);
        if let Ok(value) = trace.traceparent.parse() {
            request.metadata_mut().insert("traceparent", value);
        }
        if let Some(Ok(value)) = trace.tracestate.as_ref().map(|s| s.parse()) {
            request.metadata_mut().insert("tracestate", value);
        }
        let answer = callback
            .client
            .clone()
            .on_topic_event(request)
            .await
            .map(|r| r.into_inner().status);
        classify(answer, callback.timeout)
    }
}

impl GrpcTransport {
    /// A delivery as an entry of an `OnBulkTopicEvent` batch, waiting with others for the same
    /// route.
    async fn call_in_bulk(
        &self,
        subscription: &Subscription,
        settings: crate::bulk::BulkSettings,
        route: &str,
        event: Value,
        delivery: &Delivery,
    ) -> Called {
        let raw = subscription.raw_payload;
        let entry = crate::bulk::Entry {
            // Unique in the request (message ids are unique per partition key only).
            id: uuid::Uuid::new_v4().to_string(),
            event,
            content_type: if raw {
                app::body_content_type(delivery)
            } else {
                "application/cloudevents+json".into()
            },
            metadata: delivery.message.metadata.clone(),
            raw: raw.then(|| delivery.message.body.to_bytes()),
        };
        let bulker = self.bulker.get_or_init(|| {
            Bulker::new(
                settings,
                crate::bulk::Sink::Grpc(self.callback.clone()),
                self.callback.timeout,
                subscription.pubsub_name.clone(),
                delivery.queue.clone(),
            )
        });
        bulker.deliver(route, entry).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grpc_apps_subscription_is_read_as_daprs_and_its_paths_come_back() {
        let listed = pb::ListTopicSubscriptionsResponse {
            subscriptions: vec![pb::TopicSubscription {
                pubsub_name: "pubsub".into(),
                topic: "orders".into(),
                routes: Some(pb::TopicRoutes {
                    rules: vec![pb::TopicRule {
                        r#match: "event.data.kind == \"widget\"".into(),
                        path: "widgets".into(),
                    }],
                    default: String::new(),
                }),
                ..Default::default()
            }],
        };
        let parsed = |listed: &pb::ListTopicSubscriptionsResponse| {
            subscribe::parse(
                &serde_json::to_vec(&as_dapr_entries(listed)).unwrap(),
                "orders",
            )
            .unwrap()
            .unwrap()
        };
        let route = |subscription: &Subscription, data: Value| match subscription
            .route(&json!({"data": data}))
        {
            Route::Path(route) => Some(path_of(route).to_owned()),
            Route::Unmatched(_) => None,
        };
        let ruled = parsed(&listed);
        assert_eq!(ruled.pubsub_name, "pubsub");
        assert_eq!(
            route(&ruled, json!({"kind": "widget"})).as_deref(),
            Some("widgets")
        );
        // Rules and no default: as daprd, no route for the rest (dead-lettered here).
        assert_eq!(route(&ruled, json!({"kind": "gadget"})), None);
        // A named default, or no rules at all (the topic's own handler, path "").
        let mut with_default = listed.clone();
        with_default.subscriptions[0]
            .routes
            .as_mut()
            .unwrap()
            .default = "others".into();
        assert_eq!(
            route(&parsed(&with_default), json!({"kind": "gadget"})).as_deref(),
            Some("others")
        );
        let mut plain = listed.clone();
        plain.subscriptions[0].routes = None;
        assert_eq!(
            route(&parsed(&plain), json!({"kind": "gadget"})).as_deref(),
            Some("")
        );
    }

    #[test]
    fn an_event_request_carries_the_cloud_event() {
        let event = json!({"specversion": "1.0", "id": "m-1", "source": "cosmosq/orders",
            "type": "io.cosmosq.message", "datacontenttype": "application/json",
            "data": {"n": 1}, "topic": "orders", "pubsubname": "pubsub",
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "subject": "customer-1"});
        let request = event_request(&event, "", None);
        assert_eq!(
            (
                request.id.as_str(),
                request.topic.as_str(),
                request.pubsub_name.as_str()
            ),
            ("m-1", "orders", "pubsub")
        );
        assert_eq!(request.data, br#"{"n":1}"#);
        assert_eq!(request.data_content_type, "application/json");
        let extensions = request.extensions.unwrap().fields;
        assert!(extensions.contains_key("traceparent"));
        assert!(extensions.contains_key("subject"));
        assert!(!extensions.contains_key("data") && !extensions.contains_key("id"));
        let text = event_request(
            &json!({"data": "hello", "datacontenttype": "text/plain"}),
            "p",
            None,
        );
        assert_eq!(
            (text.data.as_slice(), text.path.as_str()),
            (&b"hello"[..], "p")
        );
        let binary = event_request(&json!({"data_base64": "AAE="}), "", None);
        assert_eq!(binary.data, [0, 1]);
        // A JSON string stays JSON, as SDKs decode a JSON content type.
        let string = event_request(
            &json!({"data": "hello", "datacontenttype": "application/json"}),
            "",
            None,
        );
        assert_eq!(string.data, br#""hello""#);
    }

    #[test]
    fn answers_settle_as_over_http() {
        let t = Duration::from_secs(1);
        assert_eq!(classify(Ok(0), t).answer, Answer::Success);
        assert!(matches!(classify(Ok(1), t).answer, Answer::Retry { .. }));
        assert!(matches!(classify(Ok(2), t).answer, Answer::Drop { .. }));
        assert!(
            matches!(classify(Ok(7), t).answer, Answer::Retry { .. }),
            "never dropped"
        );
        let failed = classify(Err(tonic::Status::unknown("boom")), t);
        assert!(matches!(failed.answer, Answer::Retry { .. }));
        assert_eq!(failed.failure, Some("status"));
        let late = classify(Err(tonic::Status::deadline_exceeded("late")), t);
        assert_eq!(late.failure, Some("timeout"));
        // What tonic's channel says when the request's own timeout passes.
        let timed_out = classify(Err(tonic::Status::cancelled("Timeout expired")), t);
        assert_eq!(timed_out.failure, Some("timeout"));
    }
}
