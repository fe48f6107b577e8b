//! An in-process Azure Resource Manager for tests, written from ARM's documentation (the
//! `Microsoft.DocumentDB` "Sql Resources" REST reference, "Track asynchronous Azure
//! operations"), not from the client in `arm`: it checks the bearer token, the api-version,
//! the path's shape and the body, answers GETs from the emulator, PUTs with 201/202 and an `Azure-AsyncOperation`
//! URL that reports `InProgress` then `Succeeded`, DELETEs with 202 and a `Location` URL, and
//! carries out what succeeded on the in-memory Cosmos DB emulator, so the operator's
//! data-plane verification afterwards sees real containers. Every error body it sends holds
//! [`SECRET`], which must never reach a status, an Event or a log.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use azure_core::credentials::{AccessToken, TokenCredential, TokenRequestOptions};
use azure_data_cosmos::models::{ContainerProperties, ThroughputProperties};
use azure_data_cosmos::options::CreateContainerOptions;
use cosmosq_queue::CosmosClient;
use futures::future::BoxFuture;
use serde_json::{json, Value};

/// The token the fake accepts.
pub const TOKEN: &str = "fake-arm-token";
/// In every error body the fake sends.
pub const SECRET: &str = "arm-body-secret-7c1e";
/// The api-version it serves.
const API_VERSION: &str = "2024-11-15";

/// How the fake misbehaves.
#[derive(Clone, Debug, Default)]
pub struct Script {
    /// Answer every request with this status (401/403) and an error body.
    pub deny: Option<u16>,
    /// The operation's status ends `Failed` (with an error body).
    pub fail: bool,
    /// The first request is throttled: 429 with this Retry-After (seconds).
    pub throttle_first: Option<u64>,
    /// Operation URLs point at another host.
    pub foreign_operation_url: bool,
    /// The first container PUT is throttled (429, Retry-After 1), and meanwhile "an admin"
    /// creates that container on the emulator.
    pub made_while_first_put_throttled: bool,
}

/// One request as the fake saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArmCall {
    /// The method.
    pub method: Method,
    /// The path.
    pub path: String,
}

/// An operation in progress.
struct Operation {
    polls: u32,
    action: Action,
}

#[derive(Clone)]
enum Action {
    CreateDatabase(String),
    CreateContainer {
        database: String,
        resource: Value,
        options: Value,
    },
    DeleteContainer {
        database: String,
        container: String,
    },
}

struct Inner {
    script: Script,
    seen: Vec<ArmCall>,
    operations: HashMap<String, Operation>,
    next: u32,
    base: String,
    /// The tags each container was PUT with, by (database, container).
    tags: HashMap<(String, String), Value>,
}

#[derive(Clone)]
struct Shared {
    inner: Arc<Mutex<Inner>>,
    cosmos: CosmosClient,
}

/// The fake, serving on 127.0.0.1 until dropped.
pub struct FakeArm {
    /// `http://127.0.0.1:<port>`.
    pub url: url::Url,
    shared: Shared,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeArm {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeArm {
    /// Serves, carrying out operations on `cosmos`.
    pub async fn start(cosmos: CosmosClient, script: Script) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let shared = Shared {
            inner: Arc::new(Mutex::new(Inner {
                script,
                seen: Vec::new(),
                operations: HashMap::new(),
                next: 0,
                base: base.clone(),
                tags: HashMap::new(),
            })),
            cosmos,
        };
        let router = axum::Router::new()
            .fallback(handle)
            .with_state(shared.clone());
        let task = tokio::spawn(async move {
            axum::serve(listener, router).await.unwrap();
        });
        Self {
            url: base.parse().unwrap(),
            shared,
            task,
        }
    }

    /// Every request so far.
    pub fn seen(&self) -> Vec<ArmCall> {
        self.shared.inner.lock().unwrap().seen.clone()
    }

    /// Tags a container as if it had been PUT with them (one made through ARM before).
    pub fn tag(&self, database: &str, container: &str, tags: Value) {
        self.shared
            .inner
            .lock()
            .unwrap()
            .tags
            .insert((database.to_owned(), container.to_owned()), tags);
    }

    /// The PUTs so far, by path.
    pub fn puts(&self) -> Vec<String> {
        self.seen()
            .into_iter()
            .filter(|s| s.method == Method::PUT)
            .map(|s| s.path)
            .collect()
    }
}

fn error(status: StatusCode, code: &str) -> Response {
    let body = json!({"error": {"code": code, "message": format!("{code}: {SECRET}")}});
    (
        status,
        [
            ("x-ms-request-id", "0f1e2d3c-fake-request"),
            ("x-ms-correlation-request-id", "9a8b7c6d-fake-correlation"),
        ],
        body.to_string(),
    )
        .into_response()
}

/// The `sqlDatabases/{db}[/containers/{c}]` a path names under a Cosmos DB account, if it
/// has ARM's shape for them.
fn resource(path: &str) -> Option<(String, Option<String>)> {
    let segments: Vec<String> = path
        .split('/')
        .map(|s| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8()
                .map(|s| s.into_owned())
                .unwrap_or_default()
        })
        .collect();
    let fixed = |i: usize, want: &str| {
        segments
            .get(i)
            .is_some_and(|s| s.eq_ignore_ascii_case(want))
    };
    let shaped = segments.first().is_some_and(String::is_empty)
        && fixed(1, "subscriptions")
        && fixed(3, "resourceGroups")
        && fixed(5, "providers")
        && fixed(6, "Microsoft.DocumentDB")
        && fixed(7, "databaseAccounts")
        && fixed(9, "sqlDatabases");
    if !shaped {
        return None;
    }
    match segments.len() {
        11 => Some((segments[10].clone(), None)),
        13 if fixed(11, "containers") => Some((segments[10].clone(), Some(segments[12].clone()))),
        _ => None,
    }
}

/// The request's problem with its body, if any (the reference's required fields).
fn bad_body(body: &Value, name: &str, container: bool) -> Option<&'static str> {
    let resource = &body["properties"]["resource"];
    if resource["id"] != name {
        return Some("properties.resource.id must be the resource's name");
    }
    if !body["properties"]["options"].is_object() && !body["properties"]["options"].is_null() {
        return Some("properties.options must be an object");
    }
    if container {
        let key = &resource["partitionKey"];
        let paths_ok = key["paths"]
            .as_array()
            .is_some_and(|p| p.len() == 1 && p[0].as_str().is_some_and(|p| p.starts_with('/')));
        if !paths_ok || key["kind"] != "Hash" || key["version"] != 2 {
            return Some("properties.resource.partitionKey must be {paths, kind Hash, version 2}");
        }
        if !resource["indexingPolicy"].is_object() {
            return Some("the queue's containers come with their indexing policy");
        }
    }
    None
}

async fn handle(
    State(shared): State<Shared>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path().to_owned();
    let base = {
        let mut inner = shared.inner.lock().unwrap();
        inner.seen.push(ArmCall {
            method: method.clone(),
            path: path.clone(),
        });
        if let Some(status) = inner.script.deny {
            let status = StatusCode::from_u16(status).unwrap();
            return error(status, "AuthorizationFailed");
        }
        if let Some(seconds) = inner.script.throttle_first.take() {
            return (
                StatusCode::TOO_MANY_REQUESTS,
                [("retry-after", seconds.to_string())],
                format!("{{\"error\":{{\"message\":\"{SECRET}\"}}}}"),
            )
                .into_response();
        }
        inner.base.clone()
    };
    let bearer = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if bearer != Some(TOKEN) {
        return error(StatusCode::UNAUTHORIZED, "InvalidAuthenticationToken");
    }
    let query: HashMap<String, String> = uri
        .query()
        .map(|q| {
            url::form_urlencoded::parse(q.as_bytes())
                .into_owned()
                .collect()
        })
        .unwrap_or_default();
    if query.get("api-version").map(String::as_str) != Some(API_VERSION) {
        return error(StatusCode::BAD_REQUEST, "InvalidApiVersionParameter");
    }
    if method == Method::GET && path.contains("/operationsStatus/") {
        return poll(&shared, &path, false).await;
    }
    if method == Method::GET && path.contains("/operationResults/") {
        return poll(&shared, &path, true).await;
    }
    let Some((database, container)) = resource(&path) else {
        return error(StatusCode::NOT_FOUND, "InvalidResourceType");
    };
    let action = match method {
        // Read: 200 with the resource if the emulator has it, else 404.
        Method::GET => {
            let exists = match &container {
                Some(c) => cosmosq_emulator::container_exists(&shared.cosmos, &database, c).await,
                None => shared
                    .cosmos
                    .database_client(&database)
                    .read(None)
                    .await
                    .is_ok(),
            };
            if !exists {
                return error(StatusCode::NOT_FOUND, "NotFound");
            }
            let tags = container
                .as_ref()
                .and_then(|c| {
                    let inner = shared.inner.lock().unwrap();
                    inner.tags.get(&(database.clone(), c.clone())).cloned()
                })
                .unwrap_or_else(|| json!({}));
            let name = container.unwrap_or(database);
            return (
                StatusCode::OK,
                json!({"id": path, "name": name, "tags": tags,
                       "properties": {"resource": {"id": name}}})
                .to_string(),
            )
                .into_response();
        }
        Method::PUT => {
            if headers.get("content-type").and_then(|v| v.to_str().ok()) != Some("application/json")
            {
                return error(StatusCode::UNSUPPORTED_MEDIA_TYPE, "UnsupportedMediaType");
            }
            let Ok(body) = serde_json::from_slice::<Value>(&body) else {
                return error(StatusCode::BAD_REQUEST, "InvalidRequestContent");
            };
            let name = container.as_deref().unwrap_or(&database);
            if let Some(_problem) = bad_body(&body, name, container.is_some()) {
                return error(StatusCode::BAD_REQUEST, "BadRequest");
            }
            let admin_first = container.is_some() && {
                let mut inner = shared.inner.lock().unwrap();
                std::mem::take(&mut inner.script.made_while_first_put_throttled)
            };
            if admin_first {
                let properties: ContainerProperties =
                    serde_json::from_value(body["properties"]["resource"].clone()).unwrap();
                shared
                    .cosmos
                    .database_client(&database)
                    .create_container(properties, None)
                    .await
                    .unwrap();
                return (
                    StatusCode::TOO_MANY_REQUESTS,
                    [("retry-after", "1")],
                    format!("{{\"error\":{{\"message\":\"{SECRET}\"}}}}"),
                )
                    .into_response();
            }
            if let (Some(container), Some(tags)) = (&container, body.get("tags")) {
                shared
                    .inner
                    .lock()
                    .unwrap()
                    .tags
                    .insert((database.clone(), container.clone()), tags.clone());
            }
            match container {
                None => Action::CreateDatabase(database),
                Some(_) => Action::CreateContainer {
                    database,
                    resource: body["properties"]["resource"].clone(),
                    options: body["properties"]["options"].clone(),
                },
            }
        }
        Method::DELETE => {
            let Some(container) = container else {
                return error(StatusCode::METHOD_NOT_ALLOWED, "NotSupported");
            };
            if !cosmosq_emulator::container_exists(&shared.cosmos, &database, &container).await {
                // Nothing to delete: ARM answers 204.
                return StatusCode::NO_CONTENT.into_response();
            }
            Action::DeleteContainer {
                database,
                container,
            }
        }
        _ => return error(StatusCode::METHOD_NOT_ALLOWED, "NotSupported"),
    };
    let (id, foreign) = {
        let mut inner = shared.inner.lock().unwrap();
        inner.next += 1;
        let id = format!("op-{}", inner.next);
        inner.operations.insert(
            id.clone(),
            Operation {
                polls: 0,
                action: action.clone(),
            },
        );
        (id, inner.script.foreign_operation_url)
    };
    let host = if foreign {
        "http://attacker.example:1".to_owned()
    } else {
        base
    };
    let location = "/subscriptions/0b1f6471-1bf0-4dda-aec3-cb9272f09590/providers/\
                    Microsoft.DocumentDB/locations/eastus";
    match action {
        Action::DeleteContainer { .. } => (
            StatusCode::ACCEPTED,
            [
                (
                    "location",
                    format!("{host}{location}/operationResults/{id}?api-version={API_VERSION}"),
                ),
                ("retry-after", "2".to_owned()),
            ],
        )
            .into_response(),
        // A database comes back 201, a container 202: the contract allows either.
        _ => {
            let status = if matches!(action, Action::CreateDatabase(_)) {
                StatusCode::CREATED
            } else {
                StatusCode::ACCEPTED
            };
            (
                status,
                [
                    (
                        "azure-asyncoperation",
                        format!("{host}{location}/operationsStatus/{id}?api-version={API_VERSION}"),
                    ),
                    (
                        "location",
                        format!("{host}{location}/operationResults/{id}?api-version={API_VERSION}"),
                    ),
                    ("retry-after", "3".to_owned()),
                ],
            )
                .into_response()
        }
    }
}

/// A poll: the first says in progress; the second carries the operation out and says so.
async fn poll(shared: &Shared, path: &str, location: bool) -> Response {
    let id = path.rsplit('/').next().unwrap_or_default().to_owned();
    let (action, fail) = {
        let mut inner = shared.inner.lock().unwrap();
        let fail = inner.script.fail;
        let Some(op) = inner.operations.get_mut(&id) else {
            return error(StatusCode::NOT_FOUND, "OperationNotFound");
        };
        op.polls += 1;
        if op.polls == 1 {
            return if location {
                (StatusCode::ACCEPTED, [("retry-after", "2")]).into_response()
            } else {
                (
                    StatusCode::OK,
                    [("retry-after", "4")],
                    json!({"id": id, "name": id, "status": "InProgress"}).to_string(),
                )
                    .into_response()
            };
        }
        (op.action.clone(), fail)
    };
    if fail {
        return (
            StatusCode::OK,
            json!({"id": id, "status": "Failed",
                   "error": {"code": "BadRequest", "message": SECRET}})
            .to_string(),
        )
            .into_response();
    }
    carry_out(&shared.cosmos, action).await;
    if location {
        StatusCode::NO_CONTENT.into_response()
    } else {
        (
            StatusCode::OK,
            json!({"id": id, "name": id, "status": "Succeeded"}).to_string(),
        )
            .into_response()
    }
}

/// What ARM's resource provider does when the operation succeeds, on the emulator.
async fn carry_out(cosmos: &CosmosClient, action: Action) {
    match action {
        Action::CreateDatabase(name) => {
            cosmos.create_database(&name, None).await.unwrap();
        }
        Action::CreateContainer {
            database,
            resource,
            options,
        } => {
            // ARM's container resource has the data plane's field names.
            let properties: ContainerProperties = serde_json::from_value(resource).unwrap();
            let throughput = if let Some(ru) = options["throughput"].as_u64() {
                Some(ThroughputProperties::manual(ru))
            } else {
                options["autoscaleSettings"]["maxThroughput"]
                    .as_u64()
                    .map(|ru| ThroughputProperties::autoscale(ru, None))
            };
            let options = throughput.map(|t| CreateContainerOptions::default().with_throughput(t));
            cosmos
                .database_client(&database)
                .create_container(properties, options)
                .await
                .unwrap();
        }
        Action::DeleteContainer {
            database,
            container,
        } => {
            let client = cosmos
                .database_client(&database)
                .container_client(&container, None)
                .await
                .unwrap();
            client.delete(None).await.unwrap();
        }
    }
}

/// A credential that hands out [`TOKEN`] for ARM's scope only.
#[derive(Debug)]
pub struct FixedToken {
    /// The scope it serves.
    pub scope: String,
}

#[async_trait::async_trait]
impl TokenCredential for FixedToken {
    async fn get_token(
        &self,
        scopes: &[&str],
        _: Option<TokenRequestOptions<'_>>,
    ) -> azure_core::Result<AccessToken> {
        assert_eq!(scopes, [self.scope.as_str()], "a token for ARM only");
        Ok(AccessToken::new(
            TOKEN,
            azure_core::time::OffsetDateTime::now_utc() + Duration::from_secs(3600),
        ))
    }
}

/// Records the client's waits instead of waiting.
#[derive(Debug, Default)]
pub struct Recorded(pub Mutex<Vec<Duration>>);

impl super::Pause for Recorded {
    fn pause(&self, duration: Duration) -> BoxFuture<'static, ()> {
        self.0.lock().unwrap().push(duration);
        Box::pin(std::future::ready(()))
    }
}

/// An ARM client for `fake` with the fixed token, recording its waits in `pauses`.
pub fn client(fake: &FakeArm, pauses: Arc<Recorded>) -> super::Arm {
    let endpoint = super::ArmEndpoint::insecure_for_tests(fake.url.clone());
    let credential = Arc::new(FixedToken {
        scope: endpoint.token_scope(),
    });
    super::Arm::new(endpoint, credential, super::Timing::default(), pauses).unwrap()
}

/// The account the fake's tests manage: `https://acct.documents.azure.com:443/` (the queue's
/// endpoint in `testing::queue_json`).
pub fn scope() -> super::ManagementScope {
    "https://acct.documents.azure.com:443/=/subscriptions/0b1f6471-1bf0-4dda-aec3-cb9272f09590/\
     resourceGroups/shop-rg/providers/Microsoft.DocumentDB/databaseAccounts/acct"
        .parse()
        .unwrap()
}
