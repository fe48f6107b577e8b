//! Dapr's gRPC API (`dapr.proto.runtime.v1.Dapr`) on `--grpc-listen`, the port Dapr SDKs call
//! as `DAPR_GRPC_PORT` (50001): most SDKs' default client (Python's `DaprClient`, Java, .NET,
//! Go) speaks it rather than HTTP. The methods a pub/sub app uses — `PublishEvent`,
//! `BulkPublishEvent` (and its `Alpha1`), `GetMetadata`, `SetMetadata`, `Shutdown` — run the
//! same code as the HTTP API, with Dapr's status codes and an `ErrorInfo` detail naming Dapr's
//! reason; every other method (state, bindings, actors, …) answers `UNIMPLEMENTED` naming it.
//!
//! The messages are Dapr's own protos as Dapr's Rust SDK ships them; the routing is written
//! here rather than through the generated `Dapr` trait, which would have this implement some
//! ninety methods only to refuse them.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::http::{self, HeaderMap};
use dapr::dapr::proto::runtime::v1 as pb;
use futures::future::BoxFuture;
use tonic::server::{Grpc, NamedService};
use tonic::{Code, Request, Response, Status};
use tonic_prost::ProstCodec;
use tonic_types::{ErrorDetails, StatusExt};

use super::{entry_messages, metadata, publish_entries, publish_one, PublishError, RawEntry};
use crate::api::{ApiState, API_TOKEN_HEADER};
use crate::settings::Token;

/// The service's full name: its methods are `/<SERVICE>/<Method>`.
pub const SERVICE: &str = "dapr.proto.runtime.v1.Dapr";

/// The methods served; the rest are refused naming these.
const SERVED: &str = "PublishEvent, BulkPublishEvent, BulkPublishEventAlpha1, GetMetadata, \
                      SetMetadata, Shutdown";

/// Dapr's gRPC API on the sidecar's state, behind the API token when one is set.
#[derive(Clone)]
pub struct DaprApi {
    state: Arc<ApiState>,
    token: Option<Arc<Token>>,
}

impl DaprApi {
    /// The API over `state`; with `token`, a call without `dapr-api-token: <token>` in its
    /// metadata is refused (`UNAUTHENTICATED`), as daprd refuses it.
    pub fn new(state: Arc<ApiState>, token: Option<Token>) -> Self {
        Self {
            state,
            token: token.map(Arc::new),
        }
    }
}

impl NamedService for DaprApi {
    const NAME: &'static str = SERVICE;
}

/// The gRPC status of a refused publish (pure): daprd's code for it, Dapr's reason as an
/// `ErrorInfo` (the HTTP API's error code under gRPC's spelling, `DAPR_PUBSUB_NOT_FOUND` for
/// `ERR_PUBSUB_NOT_FOUND`) and the message.
pub fn status_of(error: &PublishError) -> Status {
    let code = match error.status().as_u16() {
        403 => Code::PermissionDenied,
        429 => Code::ResourceExhausted,
        413 | 400 => Code::InvalidArgument,
        _ => Code::Internal,
    };
    let reason = error.code().replacen("ERR_", "DAPR_", 1);
    let details = ErrorDetails::with_error_info(reason, "dapr.io", HashMap::new());
    Status::with_error_details(code, error.to_string(), details)
}

/// A request's metadata as HTTP headers: the trace context it carries (`traceparent`).
fn headers_of<T>(request: &Request<T>) -> HeaderMap {
    request.metadata().clone().into_headers()
}

/// A request's `metadata` map as the HTTP API's `metadata.*` query parameters.
fn as_query(metadata: HashMap<String, String>) -> HashMap<String, String> {
    metadata
        .into_iter()
        .map(|(key, value)| (format!("metadata.{key}"), value))
        .collect()
}

fn content_type(given: String) -> Option<String> {
    Some(given).filter(|c| !c.is_empty())
}

async fn publish_event(
    state: Arc<ApiState>,
    request: Request<pb::PublishEventRequest>,
) -> Result<Response<()>, Status> {
    let headers = headers_of(&request);
    let event = request.into_inner();
    publish_one(
        &state,
        &event.pubsub_name,
        &event.topic,
        content_type(event.data_content_type).as_deref(),
        &as_query(event.metadata),
        &headers,
        &event.data,
    )
    .await
    .map(Response::new)
    .map_err(|e| status_of(&e))
}

async fn bulk_publish_event(
    state: Arc<ApiState>,
    request: Request<pb::BulkPublishRequest>,
) -> Result<Response<pb::BulkPublishResponse>, Status> {
    let headers = headers_of(&request);
    let bulk = request.into_inner();
    let entries = bulk
        .entries
        .into_iter()
        .map(|entry| RawEntry {
            entry_id: entry.entry_id,
            event: entry.event,
            content_type: content_type(entry.content_type),
            metadata: entry.metadata,
        })
        .collect();
    let messages = entry_messages(&as_query(bulk.metadata), entries);
    let failed = publish_entries(&state, &bulk.pubsub_name, &bulk.topic, &headers, messages)
        .await
        .map_err(|e| status_of(&e))?;
    // As daprd: the entries not enqueued in the answer, the call itself a success.
    Ok(Response::new(pb::BulkPublishResponse {
        failed_entries: failed
            .into_iter()
            .map(|(entry_id, error)| pb::BulkPublishResponseFailedEntry { entry_id, error })
            .collect(),
    }))
}

/// The HTTP API's metadata document in the gRPC API's message (pure).
pub fn metadata_message(document: &serde_json::Value) -> pb::GetMetadataResponse {
    let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_owned();
    let list = |v: &serde_json::Value| v.as_array().cloned().unwrap_or_default();
    let map = |v: &serde_json::Value| -> HashMap<String, String> {
        v.as_object()
            .map(|o| o.iter().map(|(k, v)| (k.clone(), text(v))).collect())
            .unwrap_or_default()
    };
    pb::GetMetadataResponse {
        id: text(&document["id"]),
        runtime_version: text(&document["runtimeVersion"]),
        registered_components: list(&document["components"])
            .iter()
            .map(|c| pb::RegisteredComponents {
                name: text(&c["name"]),
                r#type: text(&c["type"]),
                version: text(&c["version"]),
                capabilities: Vec::new(),
            })
            .collect(),
        extended_metadata: map(&document["extended"]),
        subscriptions: list(&document["subscriptions"])
            .iter()
            .map(|s| pb::PubsubSubscription {
                pubsub_name: text(&s["pubsubname"]),
                topic: text(&s["topic"]),
                metadata: map(&s["metadata"]),
                rules: Some(pb::PubsubSubscriptionRules {
                    rules: list(&s["rules"])
                        .iter()
                        .map(|r| pb::PubsubSubscriptionRule {
                            r#match: text(&r["match"]),
                            path: text(&r["path"]),
                        })
                        .collect(),
                }),
                dead_letter_topic: String::new(),
                r#type: match s["type"].as_str() {
                    Some("DECLARATIVE") => pb::PubsubSubscriptionType::Declarative,
                    _ => pb::PubsubSubscriptionType::Programmatic,
                } as i32,
            })
            .collect(),
        app_connection_properties: document.get("appConnectionProperties").map(|a| {
            pb::AppConnectionProperties {
                port: a["port"].as_i64().unwrap_or_default() as i32,
                protocol: text(&a["protocol"]),
                channel_address: text(&a["channelAddress"]),
                max_concurrency: a["maxConcurrency"].as_i64().unwrap_or_default() as i32,
                health: None,
            }
        }),
        ..Default::default()
    }
}

async fn get_metadata(
    state: Arc<ApiState>,
    _: Request<pb::GetMetadataRequest>,
) -> Result<Response<pb::GetMetadataResponse>, Status> {
    Ok(Response::new(metadata_message(&metadata::current(&state))))
}

async fn set_metadata(
    state: Arc<ApiState>,
    request: Request<pb::SetMetadataRequest>,
) -> Result<Response<()>, Status> {
    let pb::SetMetadataRequest { key, value } = request.into_inner();
    if value.len() > metadata::MAX_ATTRIBUTE_BYTES {
        return Err(Status::invalid_argument(format!(
            "metadata {key:?}: a value is at most {} bytes",
            metadata::MAX_ATTRIBUTE_BYTES
        )));
    }
    metadata::set(&state, key, value)
        .map(Response::new)
        .map_err(Status::invalid_argument)
}

async fn shutdown(
    state: Arc<ApiState>,
    _: Request<pb::ShutdownRequest>,
) -> Result<Response<()>, Status> {
    super::stop(&state);
    Ok(Response::new(()))
}

/// Serves one unary method with `handler`, decoding `Req` and encoding `Resp` with prost.
async fn unary<Req, Resp, F, Fut>(
    state: Arc<ApiState>,
    request: http::Request<tonic::body::Body>,
    handler: F,
) -> http::Response<tonic::body::Body>
where
    Req: prost::Message + Default + Send + 'static,
    Resp: prost::Message + Send + 'static,
    F: Fn(Arc<ApiState>, Request<Req>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<Response<Resp>, Status>> + Send + 'static,
{
    let service =
        tower::service_fn(move |request: Request<Req>| handler(Arc::clone(&state), request));
    Grpc::new(ProstCodec::<Resp, Req>::default())
        .unary(service, request)
        .await
}

impl tower::Service<http::Request<tonic::body::Body>> for DaprApi {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let state = Arc::clone(&self.state);
        if let Some(token) = &self.token {
            let presented = request
                .headers()
                .get(API_TOKEN_HEADER)
                .map(|v| v.as_bytes())
                .unwrap_or_default();
            if !token.matches(presented) {
                let status = Status::unauthenticated(format!(
                    "a valid {API_TOKEN_HEADER} is required in the call's metadata"
                ));
                return Box::pin(async move { Ok(status.into_http()) });
            }
        }
        let method = request
            .uri()
            .path()
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_owned();
        Box::pin(async move {
            Ok(match method.as_str() {
                "PublishEvent" => unary(state, request, publish_event).await,
                "BulkPublishEvent" | "BulkPublishEventAlpha1" => {
                    unary(state, request, bulk_publish_event).await
                }
                "GetMetadata" => unary(state, request, get_metadata).await,
                "SetMetadata" => unary(state, request, set_metadata).await,
                "Shutdown" => unary(state, request, shutdown).await,
                other => Status::unimplemented(format!(
                    "{SERVICE}/{other} is not served: the cosmosq sidecar serves Dapr's \
                     pub/sub API ({SERVED}); state, bindings, actors and Dapr's other building \
                     blocks are not part of it"
                ))
                .into_http(),
            })
        })
    }
}

/// Serves the API on `listener` until `stop`.
pub async fn serve(
    api: DaprApi,
    listener: tokio::net::TcpListener,
    stop: tokio_util::sync::CancellationToken,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .add_service(api)
        .serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(listener),
            stop.cancelled_owned(),
        )
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_refused_publish_has_daprs_code_and_reason() {
        let cases = [
            (
                PublishError::PubsubNotFound("redis".into()),
                Code::InvalidArgument,
                "DAPR_PUBSUB_NOT_FOUND",
            ),
            (
                PublishError::TopicForbidden {
                    topic: "payments".into(),
                    allowed: "'orders'".into(),
                },
                Code::PermissionDenied,
                "DAPR_PUBSUB_FORBIDDEN",
            ),
            (
                PublishError::CloudEvent("not JSON".into()),
                Code::InvalidArgument,
                "DAPR_PUBSUB_CLOUD_EVENTS_SER",
            ),
        ];
        for (error, code, reason) in cases {
            let status = status_of(&error);
            assert_eq!(status.code(), code, "{error}");
            assert_eq!(status.message(), error.to_string());
            let info = status.get_details_error_info().expect("an ErrorInfo");
            assert_eq!(
                (info.reason.as_str(), info.domain.as_str()),
                (reason, "dapr.io")
            );
        }
    }

    #[test]
    fn the_metadata_message_carries_what_the_http_document_says() {
        let document = json!({
            "id": "billing", "runtimeVersion": "0.1.0",
            "components": [{"name": "pubsub", "type": "pubsub.cosmosq", "version": "v1"}],
            "subscriptions": [{"pubsubname": "pubsub", "topic": "orders", "type": "DECLARATIVE",
                "rules": [{"match": "event.type == \"widget\"", "path": "/widgets"},
                          {"path": "/orders"}],
                "metadata": {"rawPayload": "true"}}],
            "extended": {"team": "payments"},
            "appConnectionProperties": {"port": 3000, "protocol": "http",
                "channelAddress": "127.0.0.1", "maxConcurrency": 8}
        });
        let message = metadata_message(&document);
        assert_eq!(message.id, "billing");
        assert_eq!(message.registered_components[0].r#type, "pubsub.cosmosq");
        let subscription = &message.subscriptions[0];
        assert_eq!(subscription.topic, "orders");
        assert_eq!(
            subscription.r#type,
            pb::PubsubSubscriptionType::Declarative as i32
        );
        let rules = &subscription.rules.as_ref().unwrap().rules;
        assert_eq!(
            (rules[0].r#match.as_str(), rules[1].path.as_str()),
            ("event.type == \"widget\"", "/orders")
        );
        assert_eq!(subscription.metadata["rawPayload"], "true");
        assert_eq!(message.extended_metadata["team"], "payments");
        let app = message.app_connection_properties.unwrap();
        assert_eq!((app.port, app.max_concurrency), (3000, 8));
    }
}
