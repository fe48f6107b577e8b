//! A local OTLP/HTTP trace receiver, as a collector serves `POST /v1/traces`: protobuf bodies
//! decoded with the OpenTelemetry project's generated types, JSON bodies read field by field
//! from the OTLP JSON encoding (hex ids, camelCase, 64-bit integers as strings or numbers), so
//! the programs' export is checked against the protocol, not against itself.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::http::{HeaderMap, StatusCode};
use prost::Message as _;
use serde_json::Value;

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, KeyValue};

/// One received span, as a test asserts on it.
#[derive(Clone, Debug, PartialEq)]
pub struct ReceivedSpan {
    /// The resource's `service.name`.
    pub service: String,
    pub name: String,
    /// `internal`, `server`, `client`, `producer` or `consumer`.
    pub kind: &'static str,
    /// 32 hex digits.
    pub trace_id: String,
    /// 16 hex digits.
    pub span_id: String,
    /// 16 hex digits; empty for a root.
    pub parent_span_id: String,
    pub attributes: BTreeMap<String, Value>,
    /// The status message when the status is an error.
    pub error: Option<String>,
}

impl ReceivedSpan {
    /// An attribute as text (numbers as they print).
    pub fn attr(&self, key: &str) -> String {
        match self.attributes.get(key) {
            Some(Value::String(s)) => s.clone(),
            Some(other) => other.to_string(),
            None => String::new(),
        }
    }
}

/// A receiver on an ephemeral localhost port; stops when dropped.
pub struct OtlpReceiver {
    /// `http://127.0.0.1:<port>`: the value of `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub endpoint: String,
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    /// The content types of the requests, in order.
    content_types: Arc<Mutex<Vec<String>>>,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.server.abort();
    }
}

const KINDS: [&str; 6] = [
    "unspecified",
    "internal",
    "server",
    "client",
    "producer",
    "consumer",
];

impl OtlpReceiver {
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a port for the receiver");
        let endpoint = format!("http://{}", listener.local_addr().expect("its address"));
        let spans: Arc<Mutex<Vec<ReceivedSpan>>> = Arc::default();
        let content_types: Arc<Mutex<Vec<String>>> = Arc::default();
        let router = {
            let (spans, content_types) = (spans.clone(), content_types.clone());
            axum::Router::new().route(
                "/v1/traces",
                axum::routing::post(move |headers: HeaderMap, body: axum::body::Bytes| {
                    let (spans, content_types) = (spans.clone(), content_types.clone());
                    async move {
                        let content_type = headers
                            .get("content-type")
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or_default()
                            .to_owned();
                        content_types.lock().unwrap().push(content_type.clone());
                        let decoded = match content_type.as_str() {
                            "application/x-protobuf" => decode_protobuf(&body),
                            "application/json" => decode_json(&body),
                            other => Err(format!("unexpected content type {other:?}")),
                        };
                        match decoded {
                            Ok(received) => {
                                spans.lock().unwrap().extend(received);
                                let empty = if content_type == "application/json" {
                                    b"{}".to_vec()
                                } else {
                                    Vec::new()
                                };
                                (StatusCode::OK, [("content-type", content_type)], empty)
                            }
                            Err(e) => (
                                StatusCode::BAD_REQUEST,
                                [("content-type", "text/plain".to_owned())],
                                e.into_bytes(),
                            ),
                        }
                    }
                }),
            )
        };
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        Self {
            endpoint,
            spans,
            content_types,
            server,
        }
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans.lock().unwrap().clone()
    }

    /// The content types of the requests received so far.
    pub fn content_types(&self) -> Vec<String> {
        self.content_types.lock().unwrap().clone()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn any_json(value: &AnyValue) -> Value {
    match &value.value {
        Some(any_value::Value::StringValue(s)) => Value::from(s.clone()),
        Some(any_value::Value::BoolValue(b)) => Value::from(*b),
        Some(any_value::Value::IntValue(i)) => Value::from(*i),
        Some(any_value::Value::DoubleValue(d)) => Value::from(*d),
        other => Value::from(format!("{other:?}")),
    }
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, Value> {
    kvs.iter()
        .map(|kv| {
            let value = kv.value.as_ref().map(any_json).unwrap_or(Value::Null);
            (kv.key.clone(), value)
        })
        .collect()
}

fn decode_protobuf(body: &[u8]) -> Result<Vec<ReceivedSpan>, String> {
    let request = ExportTraceServiceRequest::decode(body).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for resource_spans in &request.resource_spans {
        let resource = resource_spans
            .resource
            .as_ref()
            .map(|r| attributes(&r.attributes))
            .unwrap_or_default();
        let service = resource
            .get("service.name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        for scope in &resource_spans.scope_spans {
            for span in &scope.spans {
                let status = span.status.as_ref();
                out.push(ReceivedSpan {
                    service: service.clone(),
                    name: span.name.clone(),
                    kind: KINDS.get(span.kind as usize).copied().unwrap_or("unknown"),
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: hex(&span.parent_span_id),
                    attributes: attributes(&span.attributes),
                    error: status.filter(|s| s.code == 2).map(|s| s.message.clone()),
                });
            }
        }
    }
    Ok(out)
}

/// OTLP JSON: an `AnyValue` object (`{"stringValue": ...}`, `{"intValue": "3"}`, ...).
fn json_any(value: &Value) -> Value {
    let Some(object) = value.as_object() else {
        return Value::Null;
    };
    if let Some(v) = object.get("stringValue") {
        return v.clone();
    }
    if let Some(v) = object.get("boolValue") {
        return v.clone();
    }
    if let Some(v) = object.get("intValue") {
        // int64 is a string in the protobuf JSON mapping; a number is accepted too.
        return match v {
            Value::String(s) => s.parse::<i64>().map(Value::from).unwrap_or(Value::Null),
            other => other.clone(),
        };
    }
    if let Some(v) = object.get("doubleValue") {
        return v.clone();
    }
    Value::from(value.to_string())
}

fn json_attributes(list: Option<&Value>) -> BTreeMap<String, Value> {
    list.and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|kv| {
            let key = kv.get("key")?.as_str()?.to_owned();
            Some((key, kv.get("value").map(json_any).unwrap_or(Value::Null)))
        })
        .collect()
}

fn decode_json(body: &[u8]) -> Result<Vec<ReceivedSpan>, String> {
    let request: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let list = |v: &Value, key: &str| -> Vec<Value> {
        v.get(key)
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let text = |v: &Value, key: &str| -> String {
        v.get(key)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    let mut out = Vec::new();
    for resource_spans in list(&request, "resourceSpans") {
        let resource = json_attributes(
            resource_spans
                .get("resource")
                .and_then(|r| r.get("attributes")),
        );
        let service = resource
            .get("service.name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        for scope in list(&resource_spans, "scopeSpans") {
            for span in list(&scope, "spans") {
                let kind = match span.get("kind") {
                    Some(Value::Number(n)) => n.as_u64().unwrap_or(99) as usize,
                    Some(Value::String(s)) => KINDS
                        .iter()
                        .position(|k| s.eq_ignore_ascii_case(&format!("SPAN_KIND_{k}")))
                        .unwrap_or(99),
                    _ => 0,
                };
                let status = span.get("status");
                let code = status.and_then(|s| s.get("code"));
                let failed = matches!(code, Some(Value::Number(n)) if n.as_u64() == Some(2))
                    || matches!(code, Some(Value::String(s)) if s == "STATUS_CODE_ERROR");
                out.push(ReceivedSpan {
                    service: service.clone(),
                    name: text(&span, "name"),
                    kind: KINDS.get(kind).copied().unwrap_or("unknown"),
                    trace_id: text(&span, "traceId").to_ascii_lowercase(),
                    span_id: text(&span, "spanId").to_ascii_lowercase(),
                    parent_span_id: text(&span, "parentSpanId").to_ascii_lowercase(),
                    attributes: json_attributes(span.get("attributes")),
                    error: failed.then(|| text(status.unwrap_or(&Value::Null), "message")),
                });
            }
        }
    }
    Ok(out)
}
