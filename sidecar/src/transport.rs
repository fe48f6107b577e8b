//! How a delivery reaches the app: one call, and what its answer means. HTTP (Dapr's pub/sub
//! contract, built and read by `app.rs`) or gRPC (Dapr's `AppCallback`, `callback.rs`), each an
//! [`AppTransport`]: everything around a call — the circuit breaker, crash isolation, metrics
//! and the outcome the engine records — stays in `delivery.rs`, the same for every transport.

use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cosmosq_queue::Delivery;
use tracing::warn;

use crate::app::{self, Answer, AppFormat};
use crate::bulk::{self, Bulker};
use crate::subscribe::{Route, Subscription};

/// The most of an answer's body we read: enough for `{"status": ...}`. A longer answer is
/// judged by [`app::classify_prefix`]; the rest is dropped with the connection.
const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// What one call to the app came to.
#[derive(Clone, Debug, PartialEq)]
pub struct Called {
    /// What the app's answer means for the message.
    pub answer: Answer,
    /// The app could not take work at all (unreachable, timed out, failing without a
    /// `Retry-After`): what the circuit breaker counts, and the kind the metrics count it
    /// under (`connect`, `timeout`, `status`, `transport`).
    pub failure: Option<&'static str>,
    /// The app went down under it (the connection reset, or the answer cut off): judged by
    /// the crash isolation, not the breaker.
    pub crashed: bool,
}

/// A way to hand one delivery to the app.
pub trait AppTransport: Send + Sync + 'static {
    /// Delivers once and reads the answer; never longer than the app's timeout.
    fn call(&self, delivery: &Delivery) -> impl Future<Output = Called> + Send;
}

/// The app's transport, by its protocol (`--app-protocol`).
pub enum Transport {
    /// Dapr's HTTP pub/sub contract.
    Http(HttpTransport),
    /// Dapr's gRPC `AppCallback`.
    Grpc(crate::callback::GrpcTransport),
}

impl Transport {
    /// Routes by the app's own subscription from now on; the first one set stays.
    pub fn subscribe(&self, subscription: Subscription) {
        match self {
            Self::Http(t) => t.subscribe(subscription),
            Self::Grpc(t) => t.subscribe(subscription),
        }
    }
}

impl AppTransport for Transport {
    async fn call(&self, delivery: &Delivery) -> Called {
        match self {
            Self::Http(t) => t.call(delivery).await,
            Self::Grpc(t) => t.call(delivery).await,
        }
    }
}

/// `POST http://127.0.0.1:<port><path>`, as Dapr's pub/sub delivers.
pub struct HttpTransport {
    http: reqwest::Client,
    base: String,
    path: String,
    format: AppFormat,
    timeout: Duration,
    /// The app's own subscription, once discovered (before the first delivery).
    subscription: OnceLock<Subscription>,
    /// Its bulk deliveries, when it asked for them.
    bulker: OnceLock<Arc<Bulker>>,
}

/// An HTTP client for calls to the app: no proxy, and, when the group has one, the app token
/// on every request (`dapr-api-token`, as Dapr's `APP_API_TOKEN`), marked sensitive so no
/// debug output shows it.
pub fn app_http(token: Option<&crate::settings::Token>) -> reqwest::ClientBuilder {
    let builder = cosmosq_queue::cosmos::tls::http_client_builder().no_proxy();
    let Some(token) = token else {
        return builder;
    };
    let mut value = reqwest::header::HeaderValue::from_str(token.expose())
        .expect("a token is visible ASCII (checked when parsed)");
    value.set_sensitive(true);
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(crate::api::API_TOKEN_HEADER, value);
    builder.default_headers(headers)
}

impl HttpTransport {
    /// The app at `127.0.0.1:<port><path>`, answering within `timeout`, told it is its sidecar
    /// calling by `token`.
    pub fn new(
        port: u16,
        path: &str,
        format: AppFormat,
        timeout: Duration,
        token: Option<&crate::settings::Token>,
    ) -> Self {
        Self {
            http: app_http(token)
                .pool_idle_timeout(Duration::from_secs(30))
                .build()
                .expect("a plain HTTP client builds"),
            base: format!("http://127.0.0.1:{port}"),
            path: path.to_owned(),
            format,
            timeout,
            subscription: OnceLock::new(),
            bulker: OnceLock::new(),
        }
    }

    /// Routes by the app's own subscription (from `GET /dapr/subscribe`) instead of the
    /// path, from now on; the first one set stays.
    pub fn subscribe(&self, subscription: Subscription) {
        let _ = self.subscription.set(subscription);
    }

    /// The path and request of a delivery, or why it has no route (pure but for the clock
    /// of a new trace).
    fn request(&self, delivery: &Delivery) -> Result<(&str, app::AppRequest), String> {
        let trace = app::trace(delivery);
        let Some(subscription) = self.subscription.get() else {
            let request = app::build_request(delivery, self.format, &trace);
            return Ok((&self.path, request));
        };
        let (path, event) = self.routed(subscription, delivery, &trace)?;
        Ok((path, app::request_with_event(delivery, event, &trace)))
    }

    /// Where the subscription sends a delivery, and its CloudEvent (`None`: the raw body).
    fn routed<'a>(
        &self,
        subscription: &'a Subscription,
        delivery: &Delivery,
        trace: &cosmosq_queue::TraceContext,
    ) -> Result<(&'a str, Option<serde_json::Value>), String> {
        let event = app::cloud_event(delivery, trace, &subscription.pubsub_name);
        let path = match subscription.route(&event) {
            Route::Path(path) => path,
            Route::Unmatched(reason) => return Err(reason),
        };
        let raw = subscription.raw_payload || self.format == AppFormat::Raw;
        Ok((path, (!raw).then_some(event)))
    }

    /// A delivery as an entry of a bulk request, waiting with others for the same path.
    async fn call_in_bulk(
        &self,
        subscription: &Subscription,
        settings: bulk::BulkSettings,
        delivery: &Delivery,
    ) -> Called {
        let trace = app::trace(delivery);
        let (path, event) = match self.routed(subscription, delivery, &trace) {
            Ok(routed) => routed,
            Err(reason) => return unrouted(reason),
        };
        let (event, content_type) = match event {
            Some(event) => (event, "application/cloudevents+json".to_owned()),
            None => {
                let content_type = app::body_content_type(delivery);
                (
                    app::body_json(&delivery.message.body, &content_type).0,
                    content_type,
                )
            }
        };
        let entry = bulk::Entry {
            // Unique in the request (message ids are unique per partition key only).
            id: uuid::Uuid::new_v4().to_string(),
            event,
            content_type,
            metadata: delivery.message.metadata.clone(),
            raw: None,
        };
        let bulker = self.bulker.get_or_init(|| {
            Bulker::new(
                settings,
                bulk::Sink::Http {
                    http: self.http.clone(),
                    base: self.base.clone(),
                },
                self.timeout,
                subscription.pubsub_name.clone(),
                delivery.queue.clone(),
            )
        });
        bulker.deliver(path, entry).await
    }
}

/// No route for a delivery: not dropped as Dapr would, dead-lettered with the reason, for
/// someone to see.
fn unrouted(reason: String) -> Called {
    Called {
        answer: Answer::Drop { reason },
        failure: None,
        crashed: false,
    }
}

impl AppTransport for HttpTransport {
    async fn call(&self, delivery: &Delivery) -> Called {
        if let Some(subscription) = self.subscription.get() {
            if let Some(settings) = subscription.bulk {
                return self.call_in_bulk(subscription, settings, delivery).await;
            }
        }
        let (path, request) = match self.request(delivery) {
            Ok(routed) => routed,
            Err(reason) => return unrouted(reason),
        };
        let mut builder = self
            .http
            .post(format!("{}{path}", self.base))
            .timeout(self.timeout)
            .header(reqwest::header::CONTENT_TYPE, request.content_type)
            .body(request.body);
        for (name, value) in &request.headers {
            builder = builder.header(name.as_str(), value.as_str());
        }
        let retry = |reason: String| Answer::Retry {
            reason,
            delay: None,
        };
        match builder.send().await {
            Ok(mut response) => {
                let status = response.status().as_u16();
                let retry_after = retry_after(&response);
                let mut body = Vec::new();
                let mut cut_off = None;
                while body.len() <= MAX_ANSWER_BYTES {
                    match tokio::time::timeout(self.timeout, response.chunk()).await {
                        Ok(Ok(Some(chunk))) => body.extend_from_slice(&chunk),
                        Ok(Ok(None)) => break,
                        Ok(Err(e)) => {
                            cut_off = Some(format!("the app's answer was cut off: {e}"));
                            break;
                        }
                        Err(_) => {
                            cut_off = Some(format!(
                                "the app's answer did not finish within {:?}",
                                self.timeout
                            ));
                            break;
                        }
                    }
                }
                let crashed = cut_off.is_some();
                let answer = match cut_off {
                    // Half an answer is no answer: the app may have crashed mid-way.
                    Some(reason) => retry(reason),
                    None if body.len() > MAX_ANSWER_BYTES => {
                        body.truncate(MAX_ANSWER_BYTES);
                        warn!(message_id = %delivery.message.id, limit = MAX_ANSWER_BYTES, "the app's answer is longer than the limit; judging it by its start");
                        app::classify_prefix(status, retry_after.as_deref(), &body)
                    }
                    None => app::classify(status, retry_after.as_deref(), &body),
                };
                let hard = crashed
                    || status >= 500 && !matches!(answer, Answer::Retry { delay: Some(_), .. });
                Called {
                    answer,
                    failure: hard.then_some("status"),
                    crashed,
                }
            }
            Err(e) => unanswered(&e, self.timeout),
        }
    }
}

/// The app's `Retry-After`, as sent.
pub(crate) fn retry_after(response: &reqwest::Response) -> Option<String> {
    response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// A request that got no answer: refused (never delivered), timed out, or cut (the app may
/// have gone down under it).
pub(crate) fn unanswered(e: &reqwest::Error, timeout: Duration) -> Called {
    let retry = |reason: String| Answer::Retry {
        reason,
        delay: None,
    };
    if e.is_timeout() {
        Called {
            answer: retry(format!("the app did not answer within {timeout:?}")),
            failure: Some("timeout"),
            crashed: false,
        }
    } else if e.is_connect() {
        Called {
            answer: Answer::Undelivered {
                reason: "the app refused the connection".to_owned(),
            },
            failure: Some("connect"),
            crashed: false,
        }
    } else {
        Called {
            answer: retry(format!("the request to the app failed: {e}")),
            failure: Some("transport"),
            crashed: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cosmosq_queue::NewMessage;
    use serde_json::json;

    fn delivery(data: serde_json::Value) -> Delivery {
        Delivery {
            message: NewMessage::json(data)
                .with_id("m-1")
                .into_message(0)
                .unwrap(),
            delivery_count: 1,
            group: "billing".into(),
            queue: "orders".into(),
            locked_until: Default::default(),
        }
    }

    fn subscribed(entry: serde_json::Value) -> HttpTransport {
        let transport = HttpTransport::new(
            1,
            "/configured",
            AppFormat::Cloudevents,
            Duration::ZERO,
            None,
        );
        let body = serde_json::to_vec(&json!([entry])).unwrap();
        transport.subscribe(crate::subscribe::parse(&body, "orders").unwrap().unwrap());
        transport
    }

    #[test]
    fn a_subscription_picks_the_path_the_body_and_the_pubsub_name() {
        let plain = HttpTransport::new(
            1,
            "/configured",
            AppFormat::Cloudevents,
            Duration::ZERO,
            None,
        );
        let (path, _) = plain.request(&delivery(json!({"kind": "a"}))).unwrap();
        assert_eq!(path, "/configured", "no subscription: the configured path");

        let routed = subscribed(
            json!({"pubsubname": "pubsub", "topic": "orders", "routes": {
            "rules": [{"match": "event.data.kind == \"a\"", "path": "/a"}]}}),
        );
        let (path, request) = routed.request(&delivery(json!({"kind": "a"}))).unwrap();
        assert_eq!(path, "/a");
        let event: serde_json::Value = serde_json::from_slice(&request.body).unwrap();
        assert_eq!(event["pubsubname"], "pubsub");
        assert_eq!(request.content_type, "application/cloudevents+json");
        let unmatched = routed.request(&delivery(json!({"kind": "b"}))).unwrap_err();
        assert!(
            unmatched.contains("no subscription rule matched"),
            "{unmatched}"
        );

        let raw = subscribed(json!({"pubsubname": "pubsub", "topic": "orders",
            "route": "/raw", "metadata": {"rawPayload": "true"}}));
        let (path, request) = raw.request(&delivery(json!({"kind": "b"}))).unwrap();
        assert_eq!(path, "/raw");
        assert_eq!(request.content_type, "application/json");
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&request.body).unwrap(),
            json!({"kind": "b"}),
            "rawPayload: the body as it was enqueued"
        );
    }
}
