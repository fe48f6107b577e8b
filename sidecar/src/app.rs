//! The app contract (compatible with Dapr pub/sub over HTTP): what we send, how we read the
//! answer. Pure functions; the HTTP calls live in `transport`.

use std::time::Duration;

use base64::Engine as _;
use cosmosq_queue::clock::format_ms;
use cosmosq_queue::trace::{TRACEPARENT, TRACESTATE};
use cosmosq_queue::{Body, Delivery, TraceContext};
use serde_json::{json, Value};

/// How a message is put in the request body.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum AppFormat {
    /// A CloudEvents 1.0 structured event (`application/cloudevents+json`), message in `data`.
    #[default]
    Cloudevents,
    /// The message body as it is.
    Raw,
}

pub use cosmosq_queue::PUBSUB_NAME;

/// Header names, shared with the app's documentation.
pub mod headers {
    /// The message's id.
    pub const MESSAGE_ID: &str = "cosmosq-message-id";
    /// This delivery's number, 1 for the first.
    pub const DELIVERY_COUNT: &str = "cosmosq-delivery-count";
    /// When the message was enqueued (RFC 3339).
    pub const ENQUEUED_TIME: &str = "cosmosq-enqueued-time";
    /// The message's partition key, as JSON when it is not a string.
    pub const PARTITION_KEY: &str = "cosmosq-partition-key";
    /// The queue.
    pub const QUEUE: &str = "cosmosq-queue";
    /// The consumer group.
    pub const GROUP: &str = "cosmosq-group";
    /// Before each metadata key.
    pub const METADATA_PREFIX: &str = "cosmosq-metadata-";
    /// W3C trace context.
    pub const TRACEPARENT: &str = "traceparent";
    /// W3C trace context: the vendors' entries, when the producer gave any.
    pub const TRACESTATE: &str = "tracestate";
}

/// A request to the app, ready to send.
#[derive(Clone, Debug, PartialEq)]
pub struct AppRequest {
    /// The `Content-Type` of the request.
    pub content_type: String,
    /// Headers beside it: the message's metadata, ids and trace context.
    pub headers: Vec<(String, String)>,
    /// The request body.
    pub body: Vec<u8>,
}

/// The trace context of a message: the producer's (metadata `traceparent`, `tracestate`) or,
/// for a message enqueued without one, a new trace per delivery.
pub fn trace(delivery: &Delivery) -> TraceContext {
    TraceContext::from_metadata(&delivery.message.metadata).unwrap_or_else(TraceContext::new_root)
}

/// Header values must be visible ASCII; anything else is left out (it is in the event).
fn header_safe(value: &str) -> bool {
    value.bytes().all(|b| (0x20..0x7f).contains(&b))
}

/// The request a delivery becomes (pure): a CloudEvent or the raw body, with its headers.
pub fn build_request(delivery: &Delivery, format: AppFormat, trace: &TraceContext) -> AppRequest {
    let event =
        (format == AppFormat::Cloudevents).then(|| cloud_event(delivery, trace, PUBSUB_NAME));
    request_with_event(delivery, event, trace)
}

/// The `Content-Type` of a message's body: its own, or what its body is.
pub fn body_content_type(delivery: &Delivery) -> String {
    let message = &delivery.message;
    message
        .content_type
        .clone()
        .unwrap_or_else(|| match message.body {
            Body::Json(_) => "application/json".into(),
            Body::Bytes(_) => "application/octet-stream".into(),
        })
}

/// The CloudEvent of a delivery (pure), under the pub/sub name the app knows: what the app
/// receives, and what subscription rules are judged on.
pub fn cloud_event(delivery: &Delivery, trace: &TraceContext, pubsub_name: &str) -> Value {
    let message = &delivery.message;
    let body_content_type = body_content_type(delivery);
    let mut event = json!({
        "specversion": "1.0",
        "id": message.id,
        "source": format!("cosmosq/{}", delivery.queue),
        "type": "io.cosmosq.message",
        "datacontenttype": body_content_type,
        "time": format_ms(message.enqueued_at),
        "subject": message.partition_key.to_string(),
        "topic": delivery.queue,
        "pubsubname": pubsub_name,
        // As Dapr writes them: `traceid` holds the traceparent too.
        "traceid": trace.traceparent,
        "traceparent": trace.traceparent,
    });
    if let Some(state) = &trace.tracestate {
        event["tracestate"] = json!(state);
    }
    match body_json(&message.body, &body_content_type) {
        (data, false) => event["data"] = data,
        (data, true) => event["data_base64"] = data,
    }
    event
}

/// A body as JSON (pure): JSON as it is, text (a `text/*` media type, valid UTF-8) as a
/// string, as Dapr delivers what was published as text; other bytes base64 (`true`).
pub fn body_json(body: &Body, content_type: &str) -> (Value, bool) {
    match body {
        Body::Json(v) => (v.clone(), false),
        Body::Bytes(b) if content_type.starts_with("text/") && std::str::from_utf8(b).is_ok() => {
            (json!(String::from_utf8_lossy(b)), false)
        }
        Body::Bytes(b) => (
            json!(base64::engine::general_purpose::STANDARD.encode(b)),
            true,
        ),
    }
}

/// The request of a delivery (pure): `event` as the body when given (a CloudEvent), else
/// the message's body as it is; the headers either way.
pub fn request_with_event(
    delivery: &Delivery,
    event: Option<Value>,
    trace: &TraceContext,
) -> AppRequest {
    let message = &delivery.message;
    let mut headers = vec![
        (headers::MESSAGE_ID.to_owned(), message.id.clone()),
        (
            headers::DELIVERY_COUNT.to_owned(),
            delivery.delivery_count.to_string(),
        ),
        (
            headers::ENQUEUED_TIME.to_owned(),
            format_ms(message.enqueued_at),
        ),
        (
            headers::PARTITION_KEY.to_owned(),
            message.partition_key.to_string(),
        ),
        (headers::QUEUE.to_owned(), delivery.queue.clone()),
        (headers::GROUP.to_owned(), delivery.group.clone()),
        (headers::TRACEPARENT.to_owned(), trace.traceparent.clone()),
    ];
    if let Some(state) = &trace.tracestate {
        headers.push((headers::TRACESTATE.to_owned(), state.clone()));
    }
    for (key, value) in &message.metadata {
        let name = format!("{}{}", headers::METADATA_PREFIX, key.to_ascii_lowercase());
        let name_ok = name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if name_ok && header_safe(value) && key != TRACEPARENT && key != TRACESTATE {
            headers.push((name, value.clone()));
        }
    }
    headers.retain(|(_, v)| header_safe(v));
    match event {
        None => AppRequest {
            content_type: body_content_type(delivery),
            headers,
            body: message.body.to_bytes(),
        },
        Some(event) => AppRequest {
            content_type: "application/cloudevents+json".into(),
            headers,
            body: serde_json::to_vec(&event).unwrap_or_default(),
        },
    }
}

/// What the app's answer means.
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    /// 2xx with an empty body or `SUCCESS`: complete.
    Success,
    /// Deliver again: after `delay` when the app said so (`Retry-After`), else with back-off.
    Retry {
        /// Why, for the last error.
        reason: String,
        /// The app's `Retry-After`.
        delay: Option<Duration>,
    },
    /// Dead-letter now.
    Drop {
        /// Why, for the dead letter.
        reason: String,
    },
    /// The app never got it (the connection was refused): no delivery attempt.
    Undelivered {
        /// Why the app could not be reached.
        reason: String,
    },
}

/// Maps an HTTP answer to an outcome, as Dapr does: 2xx with an empty body, a body that is not
/// JSON, or `{"status":"SUCCESS"}` (or no status) is success; `RETRY` retries; `DROP`
/// dead-letters; 429/503 honour `Retry-After`; everything else is retried, never dropped.
pub fn classify(status: u16, retry_after: Option<&str>, body: &[u8]) -> Answer {
    if (200..300).contains(&status) {
        let trimmed = body.iter().filter(|b| !b.is_ascii_whitespace()).count();
        if trimmed == 0 {
            return Answer::Success;
        }
        let Ok(value) = serde_json::from_slice::<Value>(body) else {
            return Answer::Success;
        };
        let status_field = value.get("status").and_then(Value::as_str).unwrap_or("");
        return match status_field.to_ascii_uppercase().as_str() {
            "" | "SUCCESS" => Answer::Success,
            "RETRY" => Answer::Retry {
                reason: "the app answered RETRY".into(),
                delay: None,
            },
            "DROP" => Answer::Drop {
                reason: "the app answered DROP".into(),
            },
            other => Answer::Retry {
                reason: format!("the app answered an unknown status {other:?}"),
                delay: None,
            },
        };
    }
    let after = match status {
        429 | 503 => retry_after.and_then(parse_retry_after),
        _ => None,
    };
    Answer::Retry {
        reason: format!("the app answered HTTP {status}"),
        delay: after,
    }
}

/// Judges an answer from its first bytes only (it was longer than the sidecar reads). A 2xx
/// JSON answer counts by a `status` found in those bytes; without one it is retried, never
/// taken as success, since the status may sit beyond the cut. Other answers count as whole.
pub fn classify_prefix(status: u16, retry_after: Option<&str>, prefix: &[u8]) -> Answer {
    let json = prefix
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|b| *b == b'{');
    if !(200..300).contains(&status) || !json {
        return classify(status, retry_after, prefix);
    }
    match status_in_prefix(prefix) {
        Some(value) => classify(
            status,
            retry_after,
            &serde_json::to_vec(&json!({ "status": value })).expect("a string serializes"),
        ),
        None => Answer::Retry {
            reason: format!(
                "the app's answer is over {0} KB and holds no status in its first {0} KB",
                prefix.len() / 1024
            ),
            delay: None,
        },
    }
}

/// The string value of the first `"status"` key in a JSON text cut short.
fn status_in_prefix(prefix: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(prefix);
    let mut rest = text.as_ref();
    while let Some(at) = rest.find("\"status\"") {
        rest = &rest[at + "\"status\"".len()..];
        let after_colon = rest.trim_start().strip_prefix(':')?.trim_start();
        if let Some(value) = after_colon.strip_prefix('"') {
            return value.find('"').map(|end| value[..end].to_owned());
        }
    }
    None
}

/// `Retry-After` in seconds (the HTTP-date form is treated as absent: back-off applies).
fn parse_retry_after(value: &str) -> Option<Duration> {
    value.trim().parse::<u64>().ok().map(Duration::from_secs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cosmosq_queue::NewMessage;

    const PRODUCER_TRACE: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    /// A delivery of a message its producer traced.
    fn delivery(body: Body) -> Delivery {
        let new = match body {
            Body::Json(v) => NewMessage::json(v),
            Body::Bytes(b) => NewMessage::bytes(b),
        };
        let message = new
            .with_id("m-1")
            .with_partition_key("tenant-7")
            .with_metadata("source", "web")
            .with_metadata("bad", "naïve")
            .with_trace_context(
                &TraceContext::parse(PRODUCER_TRACE, Some("congo=t61rcWkgMzE")).unwrap(),
            )
            .into_message(0)
            .unwrap();
        Delivery {
            message,
            delivery_count: 3,
            group: "billing".into(),
            queue: "orders".into(),
            locked_until: Default::default(),
        }
    }

    #[test]
    fn answers_map_like_dapr() {
        let cases: Vec<(u16, Option<&str>, &str, Answer)> = vec![
            (200, None, "", Answer::Success),
            (204, None, "  ", Answer::Success),
            (200, None, r#"{"status":"SUCCESS"}"#, Answer::Success),
            (200, None, r#"{"status":"success"}"#, Answer::Success),
            (200, None, r#"{"ok":true}"#, Answer::Success),
            (200, None, "not json at all", Answer::Success),
            (
                200,
                None,
                r#"{"status":"DROP"}"#,
                Answer::Drop {
                    reason: "the app answered DROP".into(),
                },
            ),
            (
                200,
                None,
                r#"{"status":"RETRY"}"#,
                Answer::Retry {
                    reason: "the app answered RETRY".into(),
                    delay: None,
                },
            ),
            (
                200,
                None,
                r#"{"status":"MAYBE"}"#,
                Answer::Retry {
                    reason: "the app answered an unknown status \"MAYBE\"".into(),
                    delay: None,
                },
            ),
            (
                500,
                None,
                "",
                Answer::Retry {
                    reason: "the app answered HTTP 500".into(),
                    delay: None,
                },
            ),
            (
                404,
                None,
                "",
                Answer::Retry {
                    reason: "the app answered HTTP 404".into(),
                    delay: None,
                },
            ),
            (
                429,
                Some("7"),
                "",
                Answer::Retry {
                    reason: "the app answered HTTP 429".into(),
                    delay: Some(Duration::from_secs(7)),
                },
            ),
            (
                503,
                Some(" 2 "),
                "",
                Answer::Retry {
                    reason: "the app answered HTTP 503".into(),
                    delay: Some(Duration::from_secs(2)),
                },
            ),
            (
                503,
                Some("Wed, 21 Oct 2015 07:28:00 GMT"),
                "",
                Answer::Retry {
                    reason: "the app answered HTTP 503".into(),
                    delay: None,
                },
            ),
            (
                500,
                Some("9"),
                "",
                Answer::Retry {
                    reason: "the app answered HTTP 500".into(),
                    delay: None,
                },
            ),
        ];
        for (status, retry_after, body, expected) in cases {
            assert_eq!(
                classify(status, retry_after, body.as_bytes()),
                expected,
                "{status} {body:?}"
            );
        }
    }

    #[test]
    fn cloudevents_carry_the_message_and_its_context() {
        let d = delivery(Body::Json(json!({"sku": 42})));
        let req = build_request(&d, AppFormat::Cloudevents, &trace(&d));
        assert_eq!(req.content_type, "application/cloudevents+json");
        let event: Value = serde_json::from_slice(&req.body).unwrap();
        assert_eq!(event["specversion"], "1.0");
        assert_eq!(event["id"], "m-1");
        assert_eq!(event["source"], "cosmosq/orders");
        assert_eq!(event["data"], json!({"sku": 42}));
        assert_eq!(event["datacontenttype"], "application/json");
        assert_eq!(event["time"], "1970-01-01T00:00:00.000Z");
        assert_eq!(event["traceparent"], PRODUCER_TRACE);
        assert_eq!(event["traceid"], PRODUCER_TRACE, "Dapr's field too");
        assert_eq!(event["tracestate"], "congo=t61rcWkgMzE");
        let header = |name: &str| {
            req.headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(header(headers::MESSAGE_ID), Some("m-1"));
        assert_eq!(header(headers::DELIVERY_COUNT), Some("3"));
        assert_eq!(header(headers::PARTITION_KEY), Some("tenant-7"));
        assert_eq!(header(headers::GROUP), Some("billing"));
        assert_eq!(header(headers::TRACEPARENT), Some(PRODUCER_TRACE));
        assert_eq!(header(headers::TRACESTATE), Some("congo=t61rcWkgMzE"));
        assert_eq!(header("cosmosq-metadata-traceparent"), None, "not twice");
        assert_eq!(header("cosmosq-metadata-source"), Some("web"));
        assert_eq!(
            header("cosmosq-metadata-bad"),
            None,
            "non-ASCII stays out of headers"
        );
    }

    #[test]
    fn an_answer_cut_at_the_limit_counts_by_the_status_in_its_start() {
        let padding = "x".repeat(70_000);
        let cut = |text: String| text.into_bytes()[..64 * 1024].to_vec();
        let retry_first = cut(format!(r#"{{"status": "RETRY", "log": "{padding}"}}"#));
        assert!(matches!(
            classify_prefix(200, None, &retry_first),
            Answer::Retry { ref reason, .. } if reason == "the app answered RETRY"
        ));
        let success_first = cut(format!(
            r#"{{"log0": "x", "status":"SUCCESS", "log": "{padding}"}}"#
        ));
        assert_eq!(classify_prefix(200, None, &success_first), Answer::Success);
        // The status may be beyond the cut: never taken for a success.
        let status_last = cut(format!(r#"{{"log": "{padding}", "status": "DROP"}}"#));
        assert!(matches!(
            classify_prefix(200, None, &status_last),
            Answer::Retry { ref reason, .. } if reason.contains("no status in its first 64 KB")
        ));
        // Not JSON, or not 2xx: the start says all there is.
        assert_eq!(
            classify_prefix(200, None, &cut(padding.clone())),
            Answer::Success
        );
        assert!(matches!(
            classify_prefix(500, None, &cut(format!("{{{padding}"))),
            Answer::Retry { ref reason, .. } if reason == "the app answered HTTP 500"
        ));
    }

    #[test]
    fn raw_mode_sends_the_body_as_it_is() {
        let d = delivery(Body::Bytes(vec![1, 2, 3]));
        let req = build_request(&d, AppFormat::Raw, &trace(&d));
        assert_eq!(req.body, vec![1, 2, 3]);
        assert_eq!(req.content_type, "application/octet-stream");
        assert!(req
            .headers
            .contains(&(headers::TRACEPARENT.to_owned(), PRODUCER_TRACE.to_owned())));
        let event = build_request(&d, AppFormat::Cloudevents, &trace(&d));
        let event: Value = serde_json::from_slice(&event.body).unwrap();
        assert_eq!(event["data_base64"], "AQID");
        // Text (a Dapr publish's default type) is a string in `data`, as Dapr delivers it.
        let mut d = delivery(Body::Bytes(b"hello".to_vec()));
        d.message.content_type = Some("text/plain; charset=utf-8".into());
        let event = build_request(&d, AppFormat::Cloudevents, &trace(&d));
        let event: Value = serde_json::from_slice(&event.body).unwrap();
        assert_eq!(
            (event["data"].as_str(), event.get("data_base64")),
            (Some("hello"), None)
        );
        assert_eq!(event["datacontenttype"], "text/plain; charset=utf-8");
        let raw = build_request(&d, AppFormat::Raw, &trace(&d));
        assert_eq!(raw.body, b"hello", "raw: the bytes as they are");
    }

    #[test]
    fn the_producers_trace_is_kept_and_a_message_without_one_gets_its_own() {
        let mut d = delivery(Body::Json(json!(1)));
        assert_eq!(trace(&d).traceparent, PRODUCER_TRACE);
        d.message.metadata.remove(TRACEPARENT);
        let made = trace(&d);
        assert_ne!(made.traceparent, PRODUCER_TRACE);
        assert_eq!(
            made.tracestate, None,
            "no tracestate without its traceparent"
        );
        d.message
            .metadata
            .insert(TRACEPARENT.into(), "garbage".into());
        assert_ne!(trace(&d).traceparent, "garbage");
    }
}
