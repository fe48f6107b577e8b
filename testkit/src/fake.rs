//! An in-memory Kubernetes API server, for running the whole operator (watches, controllers,
//! leader election, scaling) where no cluster exists: in tests and the operator benchmark.
//!
//! It keeps objects as JSON and serves what the operator uses: list and watch (with label
//! selectors and resource versions), get, create, server-side apply (conditions merged by type,
//! like a list-map), merge and JSON patches, the status and scale subresources, conditional
//! replace, delete with finalizers, and garbage collection of owned objects, the immutable
//! roleRef of RoleBindings, a Secret's `stringData` stored as `data`, and TokenReviews and SubjectAccessReviews answered from tables a
//! test fills. It is not a general API server: no validation, admission or field ownership.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::StreamExt;
use http::{Method, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use kube::client::Body;
use serde_json::{json, Value};
use tokio::sync::broadcast;

type ResponseBody = UnsyncBoxBody<Bytes, Infallible>;

/// A Secret's `stringData` as the API server stores it: merged into `data` (base64), and gone.
fn secret_string_data(secret: &mut Value) {
    use base64::Engine as _;
    let Some(Value::Object(text)) = secret.as_object_mut().and_then(|o| o.remove("stringData"))
    else {
        return;
    };
    if !secret["data"].is_object() {
        secret["data"] = json!({});
    }
    for (key, value) in text {
        let value = value.as_str().unwrap_or_default().as_bytes();
        secret["data"][key] = json!(base64::engine::general_purpose::STANDARD.encode(value));
    }
}

/// One change, as a watch sends it.
#[derive(Clone, Debug)]
struct Change {
    resource_version: u64,
    collection: String,
    namespace: String,
    kind: &'static str,
    object: Value,
}

#[derive(Default)]
struct State {
    resource_version: u64,
    /// Objects by collection (`apis/apps/v1/deployments`), then (namespace, name).
    objects: BTreeMap<String, BTreeMap<(String, String), Value>>,
    /// Every change, for watches that start from an older version.
    log: Vec<Change>,
    /// Requests served, by `METHOD collection[/subresource]`.
    requests: BTreeMap<String, u64>,
    /// What each client did, as RBAC sees it: (actor, API group, resource, verb).
    verbs: std::collections::BTreeSet<(String, String, String, String)>,
    /// Bearer tokens a TokenReview accepts: the user each names, and its audiences.
    tokens: BTreeMap<String, (String, Vec<String>)>,
    /// What a SubjectAccessReview allows: (user, verb, API group, resource, namespace).
    grants: std::collections::BTreeSet<(String, String, String, String, String)>,
    /// The top-level status fields each field manager last applied, by (collection,
    /// namespace, name, manager): a field a manager stops applying is removed, as server-side
    /// apply removes the fields it no longer owns.
    status_owners: BTreeMap<(String, String, String, String), std::collections::BTreeSet<String>>,
    /// Paths a SubjectAccessReview allows: (user, verb, path).
    paths: std::collections::BTreeSet<(String, String, String)>,
}

/// The audience of tokens the API server issues by default, and of reviews that name none
/// (kube-apiserver's `--api-audiences`).
pub const API_AUDIENCE: &str = "https://kubernetes.default.svc";

impl State {
    /// The stored object, if any.
    fn object(&self, collection: &str, namespace: &str, name: &str) -> Option<&Value> {
        self.objects
            .get(collection)?
            .get(&(namespace.to_owned(), name.to_owned()))
    }
}

/// The header naming who sent a request (see [`FakeApiServer::client_as`]).
const ACTOR: &str = "x-fake-actor";

/// The in-memory API server: objects by collection and name, shared by every client it hands out.
#[derive(Clone)]
pub struct FakeApiServer {
    state: Arc<Mutex<State>>,
    changes: broadcast::Sender<Change>,
}

impl Default for FakeApiServer {
    fn default() -> Self {
        Self::new()
    }
}

/// Where a request points.
#[derive(Debug)]
struct Target {
    collection: String,
    namespace: Option<String>,
    name: Option<String>,
    subresource: Option<String>,
}

impl Target {
    /// The API group and the resource (with its subresource) RBAC rules name.
    fn rbac_resource(&self) -> (String, String) {
        let mut parts = self.collection.split('/');
        let group = match parts.next() {
            Some("apis") => parts.next().unwrap_or_default().to_owned(),
            _ => String::new(),
        };
        let resource = self.collection.rsplit('/').next().unwrap_or_default();
        let resource = match &self.subresource {
            Some(sub) => format!("{resource}/{sub}"),
            None => resource.to_owned(),
        };
        (group, resource)
    }
}

fn parse(path: &str) -> Option<Target> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (prefix, rest) = match parts.as_slice() {
        ["api", version, rest @ ..] => (format!("api/{version}"), rest),
        ["apis", group, version, rest @ ..] => (format!("apis/{group}/{version}"), rest),
        _ => return None,
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some(ns.to_string()), rest),
        rest => (None, rest),
    };
    let (resource, name, subresource) = match rest {
        [resource] => (resource, None, None),
        [resource, name] => (resource, Some(name.to_string()), None),
        [resource, name, sub] => (resource, Some(name.to_string()), Some(sub.to_string())),
        _ => return None,
    };
    Some(Target {
        collection: format!("{prefix}/{resource}"),
        namespace,
        name,
        subresource,
    })
}

/// An object's `autoscaling/v1` Scale, from the paths cosmosq's CRD and Deployments use
/// (`.spec.replicas`, `.status.replicas`, `.status.selector`).
fn scale_of(object: &Value) -> Value {
    let mut scale = json!({"apiVersion": "autoscaling/v1", "kind": "Scale",
        "metadata": {"name": object["metadata"]["name"],
                     "namespace": object["metadata"]["namespace"],
                     "resourceVersion": object["metadata"]["resourceVersion"]},
        "spec": {"replicas": object["spec"]["replicas"].as_i64().unwrap_or(0)},
        "status": {"replicas": object["status"]["replicas"].as_i64().unwrap_or(0)}});
    if let Some(selector) = object["status"]["selector"].as_str() {
        scale["status"]["selector"] = json!(selector);
    }
    scale
}

fn query_param(query: &str, key: &str) -> Option<String> {
    url::form_urlencoded::parse(query.as_bytes())
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.into_owned())
}

fn selector_matches(object: &Value, selector: &str) -> bool {
    selector
        .split(',')
        .filter(|t| !t.is_empty())
        .all(|term| match term.split_once('=') {
            Some((k, v)) => {
                object["metadata"]["labels"][k].as_str() == Some(v.trim_start_matches('='))
            }
            None => object["metadata"]["labels"].get(term).is_some(),
        })
}

/// `fieldSelector` terms on `metadata.name` and `metadata.namespace` (what kube-runtime's
/// single-object watches send); other fields are not indexed by this server.
fn fields_match(object: &Value, selector: &str) -> bool {
    selector
        .split(',')
        .filter(|t| !t.is_empty())
        .all(|term| match term.split_once('=') {
            Some((field, v)) => {
                let value = match field {
                    "metadata.name" => object["metadata"]["name"].as_str(),
                    "metadata.namespace" => object["metadata"]["namespace"].as_str(),
                    _ => return true,
                };
                value == Some(v.trim_start_matches('='))
            }
            None => true,
        })
}

fn full(status: StatusCode, value: &Value) -> Response<ResponseBody> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(value.to_string())).boxed_unsync())
        .expect("valid response")
}

fn status_error(code: StatusCode, reason: &str, message: &str) -> Response<ResponseBody> {
    full(
        code,
        &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                "code": code.as_u16(), "message": message}),
    )
}

/// Server-side apply, simplified: objects merge key by key, lists are replaced, except
/// `conditions`, merged by `type` (the list-map our CRDs declare).
fn apply_merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                if k == "conditions" {
                    if let (Some(Value::Array(existing)), Value::Array(new)) = (t.get_mut(k), v) {
                        for c in new {
                            match existing.iter_mut().find(|e| e["type"] == c["type"]) {
                                Some(e) => *e = c.clone(),
                                None => existing.push(c.clone()),
                            }
                        }
                        continue;
                    }
                }
                match t.get_mut(k) {
                    Some(slot) if slot.is_object() && v.is_object() => apply_merge(slot, v),
                    _ => {
                        t.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (t, p) => *t = p.clone(),
    }
}

impl FakeApiServer {
    /// An empty cluster.
    pub fn new() -> Self {
        Self {
            state: Arc::default(),
            changes: broadcast::channel(4096).0,
        }
    }

    /// A client whose requests this server answers.
    pub fn client(&self) -> kube::Client {
        self.client_as("client")
    }

    /// A client whose calls are recorded under `actor` (see [`Self::verbs_of`]).
    pub fn client_as(&self, actor: &str) -> kube::Client {
        let server = self.clone();
        let actor = http::HeaderValue::from_str(actor).expect("a header value");
        let service = tower::service_fn(move |mut request: Request<Body>| {
            let server = server.clone();
            request.headers_mut().insert(ACTOR, actor.clone());
            async move { Ok::<_, Infallible>(server.handle(request).await) }
        });
        kube::Client::new(service, "default")
    }

    /// A token that TokenReviews accept as `user`, minted for the API server's audience.
    pub fn issue_token(&self, token: &str, user: &str) {
        self.issue_token_for(token, user, &[API_AUDIENCE]);
    }

    /// A token minted for `audiences` (`kubectl create token --audience`): a review accepts it
    /// only for one of them, and names the ones they share in `status.audiences`.
    pub fn issue_token_for(&self, token: &str, user: &str, audiences: &[&str]) {
        let mut state = self.state.lock().expect("state");
        let audiences = audiences.iter().map(|a| a.to_string()).collect();
        state.tokens.insert(token.into(), (user.into(), audiences));
    }

    /// Lets SubjectAccessReviews allow `user` to `verb` the non-resource URL `path`.
    pub fn grant_path(&self, user: &str, verb: &str, path: &str) {
        let mut state = self.state.lock().expect("state");
        state.paths.insert((user.into(), verb.into(), path.into()));
    }

    /// Lets SubjectAccessReviews allow `user` to `verb` `resource` of `group` in `namespace`
    /// (`resource/subresource` for a subresource).
    pub fn grant(&self, user: &str, verb: &str, group: &str, resource: &str, namespace: &str) {
        let mut state = self.state.lock().expect("state");
        state.grants.insert((
            user.into(),
            verb.into(),
            group.into(),
            resource.into(),
            namespace.into(),
        ));
    }

    /// Answers the reviews of `auth`: no object is stored.
    fn review(&self, target: &Target, mut review: Value) -> Option<Response<ResponseBody>> {
        let state = self.state.lock().expect("state");
        review["status"] = match target.collection.as_str() {
            "apis/authentication.k8s.io/v1/tokenreviews" => {
                let token = review["spec"]["token"].as_str().unwrap_or_default();
                // As kube-apiserver: a review that names no audience asks for its own.
                let wanted: Vec<String> = review["spec"]["audiences"]
                    .as_array()
                    .filter(|a| !a.is_empty())
                    .map(|a| {
                        a.iter()
                            .filter_map(|v| v.as_str().map(str::to_owned))
                            .collect()
                    })
                    .unwrap_or_else(|| vec![API_AUDIENCE.to_owned()]);
                match state.tokens.get(token) {
                    None => json!({"authenticated": false, "error": "invalid bearer token"}),
                    Some((user, audiences)) => {
                        let shared: Vec<&String> =
                            audiences.iter().filter(|a| wanted.contains(a)).collect();
                        if shared.is_empty() {
                            json!({"authenticated": false, "error": format!(
                                "token audiences {audiences:?} is invalid for the target audiences {wanted:?}")})
                        } else {
                            json!({"authenticated": true, "audiences": shared,
                                "user": {"username": user, "groups": ["system:authenticated"]}})
                        }
                    }
                }
            }
            "apis/authorization.k8s.io/v1/subjectaccessreviews" => {
                let spec = &review["spec"];
                let attrs = &spec["resourceAttributes"];
                let field = |v: &Value| v.as_str().unwrap_or_default().to_owned();
                let path = &spec["nonResourceAttributes"];
                if path.is_object() {
                    let key = (
                        field(&spec["user"]),
                        field(&path["verb"]),
                        field(&path["path"]),
                    );
                    review["status"] = json!({"allowed": state.paths.contains(&key)});
                    return Some(full(StatusCode::CREATED, &review));
                }
                // As RBAC: a subresource is granted as `resource/subresource`, never by the
                // resource alone.
                let resource = match field(&attrs["subresource"]) {
                    sub if sub.is_empty() => field(&attrs["resource"]),
                    sub => format!("{}/{sub}", field(&attrs["resource"])),
                };
                let key = (
                    field(&spec["user"]),
                    field(&attrs["verb"]),
                    field(&attrs["group"]),
                    resource,
                    field(&attrs["namespace"]),
                );
                json!({"allowed": state.grants.contains(&key)})
            }
            _ => return None,
        };
        Some(full(StatusCode::CREATED, &review))
    }

    /// The (API group, resource, verb) triples `actor` used: what its RBAC must allow.
    pub fn verbs_of(&self, actor: &str) -> std::collections::BTreeSet<(String, String, String)> {
        self.state
            .lock()
            .expect("state")
            .verbs
            .iter()
            .filter(|(a, ..)| a == actor)
            .map(|(_, g, r, v)| (g.clone(), r.clone(), v.clone()))
            .collect()
    }

    /// Serves over plain HTTP (for a real operator process, via a kubeconfig) until `stop`.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        stop: tokio_util::sync::CancellationToken,
    ) {
        loop {
            let stream = tokio::select! {
                _ = stop.cancelled() => return,
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => stream,
                    Err(_) => continue,
                },
            };
            let server = self.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
                        let server = server.clone();
                        async move {
                            let (parts, body) = request.into_parts();
                            let bytes = body
                                .collect()
                                .await
                                .map(|b| b.to_bytes())
                                .unwrap_or_default();
                            let request = Request::from_parts(parts, Body::from(bytes));
                            Ok::<_, Infallible>(server.handle(request).await)
                        }
                    });
                let connection = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
                tokio::select! {
                    _ = connection => {}
                    _ = stop.cancelled() => {}
                }
            });
        }
    }

    /// Serves on a free localhost port and writes a kubeconfig for it into `dir` (for a real
    /// operator process: `KUBECONFIG=<path>`). Cancel the token to stop serving.
    pub async fn serve_localhost(
        &self,
        dir: &std::path::Path,
    ) -> std::io::Result<(std::path::PathBuf, tokio_util::sync::CancellationToken)> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let stop = tokio_util::sync::CancellationToken::new();
        tokio::spawn(self.clone().serve(listener, stop.clone()));
        let kubeconfig = dir.join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\ncurrent-context: fake\n\
                 clusters: [{{name: fake, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n\
                 users: [{{name: fake, user: {{}}}}]\n\
                 contexts: [{{name: fake, context: {{cluster: fake, user: fake}}}}]\n"
            ),
        )?;
        Ok((kubeconfig, stop))
    }

    /// How many requests were served per `METHOD collection[/subresource]`.
    pub fn requests(&self) -> BTreeMap<String, u64> {
        self.state.lock().expect("state").requests.clone()
    }

    /// An object as stored, if it exists.
    pub fn get(&self, collection: &str, namespace: &str, name: &str) -> Option<Value> {
        let state = self.state.lock().expect("state");
        state.object(collection, namespace, name).cloned()
    }

    async fn handle(&self, request: Request<Body>) -> Response<ResponseBody> {
        let method = request.method().clone();
        let actor = request
            .headers()
            .get(ACTOR)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let path = request.uri().path().to_owned();
        let query = request.uri().query().unwrap_or_default().to_owned();
        let content_type = request
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let Some(target) = parse(&path) else {
            return status_error(StatusCode::NOT_FOUND, "NotFound", "unknown path");
        };
        let bytes = match request.into_body().collect_bytes().await {
            Ok(bytes) => bytes,
            Err(_) => return status_error(StatusCode::BAD_REQUEST, "BadRequest", "body"),
        };
        let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        let watching = matches!(query_param(&query, "watch").as_deref(), Some("true" | "1"));
        let creates_by_apply = method == Method::PATCH
            && content_type.starts_with("application/apply-patch")
            && target.subresource.is_none()
            && target.name.as_deref().is_some_and(|name| {
                self.get(
                    &target.collection,
                    target.namespace.as_deref().unwrap_or_default(),
                    name,
                )
                .is_none()
            });
        {
            let mut state = self.state.lock().expect("state");
            let key = match &target.subresource {
                Some(sub) => format!("{method} {}/{sub}", target.collection),
                None => format!("{method} {}", target.collection),
            };
            *state.requests.entry(key).or_default() += 1;
            let verb = match (&method, &target.name) {
                (&Method::GET, Some(_)) => "get",
                (&Method::GET, None) if watching => "watch",
                (&Method::GET, None) => "list",
                (&Method::POST, _) => "create",
                (&Method::PUT, _) => "update",
                (&Method::DELETE, _) => "delete",
                _ => "patch",
            };
            let actor = actor.unwrap_or_default();
            let (group, resource) = target.rbac_resource();
            let mut record = |verb: &str| {
                state.verbs.insert((
                    actor.clone(),
                    group.clone(),
                    resource.clone(),
                    verb.to_owned(),
                ));
            };
            record(verb);
            if creates_by_apply {
                record("create");
            }
        }
        match (&method, &target.name) {
            (&Method::GET, None) if watching => self.watch(&target, &query),
            (&Method::GET, None) => self.list(&target, &query),
            (&Method::GET, Some(name)) => match self.get(
                &target.collection,
                target.namespace.as_deref().unwrap_or_default(),
                name,
            ) {
                Some(object) if target.subresource.as_deref() == Some("scale") => {
                    full(StatusCode::OK, &scale_of(&object))
                }
                Some(object) => full(StatusCode::OK, &object),
                None => status_error(StatusCode::NOT_FOUND, "NotFound", "not found"),
            },
            (&Method::POST, _) => self.create(&target, body),
            (&Method::PATCH, Some(name)) => {
                let manager = query_param(&query, "fieldManager").unwrap_or_default();
                self.patch(&target, name, &content_type, &manager, body)
            }
            (&Method::PUT, Some(name)) => self.replace(&target, name, body),
            (&Method::DELETE, Some(name)) => self.delete(&target, name),
            _ => status_error(
                StatusCode::METHOD_NOT_ALLOWED,
                "MethodNotAllowed",
                "unsupported",
            ),
        }
    }

    fn list(&self, target: &Target, query: &str) -> Response<ResponseBody> {
        let selector = query_param(query, "labelSelector").unwrap_or_default();
        let fields = query_param(query, "fieldSelector").unwrap_or_default();
        let state = self.state.lock().expect("state");
        let items: Vec<Value> = state
            .objects
            .get(&target.collection)
            .into_iter()
            .flat_map(|c| c.iter())
            .filter(|((ns, _), o)| {
                target.namespace.as_deref().is_none_or(|want| want == ns)
                    && selector_matches(o, &selector)
                    && fields_match(o, &fields)
            })
            .map(|(_, o)| o.clone())
            .collect();
        full(
            StatusCode::OK,
            &json!({"kind": "List", "apiVersion": "v1",
                    "metadata": {"resourceVersion": state.resource_version.to_string()},
                    "items": items}),
        )
    }

    fn watch(&self, target: &Target, query: &str) -> Response<ResponseBody> {
        let selector = query_param(query, "labelSelector").unwrap_or_default();
        let fields = query_param(query, "fieldSelector").unwrap_or_default();
        let since: u64 = query_param(query, "resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let collection = target.collection.clone();
        let namespace = target.namespace.clone();
        let wanted = move |c: &Change| {
            c.collection == collection
                && namespace.as_deref().is_none_or(|ns| ns == c.namespace)
                && selector_matches(&c.object, &selector)
                && fields_match(&c.object, &fields)
        };
        // Subscribe before reading the log, so nothing falls between the two.
        let live = self.changes.subscribe();
        let backlog: Vec<Change> = {
            let state = self.state.lock().expect("state");
            state
                .log
                .iter()
                .filter(|c| c.resource_version > since && wanted(c))
                .cloned()
                .collect()
        };
        let last = backlog.last().map_or(since, |c| c.resource_version);
        let wanted_live = wanted.clone();
        let live = futures::stream::unfold(live, |mut rx| async move {
            loop {
                match rx.recv().await {
                    Ok(change) => return Some((change, rx)),
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        })
        .filter(move |c| {
            let keep = c.resource_version > last && wanted_live(c);
            async move { keep }
        });
        let frames = futures::stream::iter(backlog).chain(live).map(|c| {
            let line = json!({"type": c.kind, "object": c.object}).to_string() + "\n";
            Ok::<_, Infallible>(Frame::data(Bytes::from(line)))
        });
        Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "application/json")
            .body(StreamBody::new(frames).boxed_unsync())
            .expect("valid response")
    }

    /// Stores `object` (new version, logged and broadcast) and returns it.
    fn store(
        state: &mut State,
        changes: &broadcast::Sender<Change>,
        collection: &str,
        kind: &'static str,
        mut object: Value,
    ) -> Value {
        let text = |field: &str| {
            object["metadata"][field]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        };
        let (namespace, name) = (text("namespace"), text("name"));
        // Like the API server, a write that changes nothing is a no-op: same version, no event.
        if kind == "MODIFIED" {
            if let Some(existing) = state.object(collection, &namespace, &name) {
                let mut unversioned = existing.clone();
                unversioned["metadata"]["resourceVersion"] =
                    object["metadata"]["resourceVersion"].clone();
                if unversioned == object {
                    return existing.clone();
                }
            }
        }
        state.resource_version += 1;
        let rv = state.resource_version;
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        let objects = state.objects.entry(collection.to_owned()).or_default();
        if kind == "DELETED" {
            objects.remove(&(namespace.clone(), name));
        } else {
            objects.insert((namespace.clone(), name), object.clone());
        }
        let change = Change {
            resource_version: rv,
            collection: collection.to_owned(),
            namespace,
            kind,
            object: object.clone(),
        };
        state.log.push(change.clone());
        let _ = changes.send(change);
        object
    }

    fn create(&self, target: &Target, mut object: Value) -> Response<ResponseBody> {
        if let Some(answer) = self.review(target, object.clone()) {
            return answer;
        }
        let mut state = self.state.lock().expect("state");
        let namespace = target.namespace.clone().unwrap_or_default();
        let name = object["metadata"]["name"]
            .as_str()
            .map(str::to_owned)
            .or_else(|| {
                object["metadata"]["generateName"]
                    .as_str()
                    .map(|prefix| format!("{prefix}{}", state.resource_version + 1))
            })
            .unwrap_or_default();
        if state
            .object(&target.collection, &namespace, &name)
            .is_some()
        {
            return status_error(StatusCode::CONFLICT, "AlreadyExists", "already exists");
        }
        let meta = &mut object["metadata"];
        meta["name"] = json!(name);
        if target.namespace.is_some() {
            meta["namespace"] = json!(namespace);
        }
        meta["uid"] = json!(uuid::Uuid::new_v4().to_string());
        meta["generation"] = json!(1);
        meta["creationTimestamp"] = json!(k8s_openapi::jiff::Timestamp::now().to_string());
        if target.collection == "api/v1/secrets" {
            secret_string_data(&mut object);
        }
        let stored = Self::store(
            &mut state,
            &self.changes,
            &target.collection,
            "ADDED",
            object,
        );
        full(StatusCode::CREATED, &stored)
    }

    fn patch(
        &self,
        target: &Target,
        name: &str,
        content_type: &str,
        manager: &str,
        body: Value,
    ) -> Response<ResponseBody> {
        let mut state = self.state.lock().expect("state");
        let namespace = target.namespace.clone().unwrap_or_default();
        let existing = state.object(&target.collection, &namespace, name).cloned();
        let apply = content_type.starts_with("application/apply-patch");
        let mut object = match (existing, apply) {
            (Some(object), _) => object,
            (None, true) if target.subresource.is_none() => {
                drop(state);
                let mut new = body.clone();
                new["metadata"]["name"] = json!(name);
                return self.create(target, new);
            }
            (None, _) => return status_error(StatusCode::NOT_FOUND, "NotFound", "not found"),
        };
        let before_spec = object.get("spec").cloned();
        match target.subresource.as_deref() {
            Some("status") => {
                let status = body.get("status").cloned().unwrap_or(Value::Null);
                if apply {
                    if !object["status"].is_object() {
                        object["status"] = json!({});
                    }
                    let applied: std::collections::BTreeSet<String> = status
                        .as_object()
                        .map(|o| o.keys().cloned().collect())
                        .unwrap_or_default();
                    let key = |m: &str| {
                        (
                            target.collection.clone(),
                            namespace.clone(),
                            name.to_owned(),
                            m.to_owned(),
                        )
                    };
                    let before = state
                        .status_owners
                        .insert(key(manager), applied.clone())
                        .unwrap_or_default();
                    for dropped in before.difference(&applied) {
                        let others_own = state.status_owners.iter().any(|((c, ns, n, m), keys)| {
                            (c, ns, n) == (&target.collection, &namespace, &name.to_owned())
                                && m != manager
                                && keys.contains(dropped)
                        });
                        if !others_own && dropped != "conditions" {
                            if let Some(o) = object["status"].as_object_mut() {
                                o.remove(dropped);
                            }
                        }
                    }
                    apply_merge(&mut object["status"], &status);
                } else {
                    json_patch::merge(&mut object["status"], &status);
                }
            }
            Some("scale") => {
                if let Some(replicas) = body["spec"].get("replicas") {
                    object["spec"]["replicas"] = replicas.clone();
                    // Standing in for the Deployment controller; a custom resource's status
                    // is its controller's to write.
                    if target.collection.ends_with("/deployments") {
                        object["status"]["replicas"] = replicas.clone();
                    }
                }
            }
            Some(_) => return status_error(StatusCode::NOT_FOUND, "NotFound", "subresource"),
            None if apply => {
                let mut patch = body.clone();
                if let Some(p) = patch.as_object_mut() {
                    p.remove("status");
                }
                apply_merge(&mut object, &patch);
            }
            None if content_type.starts_with("application/json-patch") => {
                // Like the API server, a `test` for null passes on a missing path.
                let ops: Vec<Value> = body
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|op| {
                        let path = op["path"].as_str().unwrap_or_default();
                        !(op["op"] == "test"
                            && op["value"].is_null()
                            && object.pointer(path).is_none())
                    })
                    .cloned()
                    .collect();
                let Ok(patch) = serde_json::from_value::<json_patch::Patch>(Value::Array(ops))
                else {
                    return status_error(StatusCode::BAD_REQUEST, "BadRequest", "JSON patch");
                };
                if json_patch::patch(&mut object, &patch).is_err() {
                    return status_error(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        "Invalid",
                        "JSON patch failed",
                    );
                }
            }
            None => json_patch::merge(&mut object, &body),
        }
        if target.collection.ends_with("/rolebindings")
            && state
                .object(&target.collection, &namespace, name)
                .is_some_and(|old| old["roleRef"] != object["roleRef"])
        {
            // As the API server: a binding's role never changes.
            return status_error(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid",
                "RoleBinding is invalid: roleRef: Invalid value: cannot change roleRef",
            );
        }
        if object.get("spec").cloned() != before_spec {
            let generation = object["metadata"]["generation"].as_i64().unwrap_or(1);
            object["metadata"]["generation"] = json!(generation + 1);
        }
        let finalized = object["metadata"]["deletionTimestamp"].is_string()
            && object["metadata"]["finalizers"]
                .as_array()
                .is_none_or(|f| f.is_empty());
        let kind = if finalized { "DELETED" } else { "MODIFIED" };
        let stored = Self::store(&mut state, &self.changes, &target.collection, kind, object);
        if finalized {
            Self::collect_garbage(&mut state, &self.changes, &stored);
        }
        if target.subresource.as_deref() == Some("scale") {
            return full(StatusCode::OK, &scale_of(&stored));
        }
        full(StatusCode::OK, &stored)
    }

    fn replace(&self, target: &Target, name: &str, mut body: Value) -> Response<ResponseBody> {
        let mut state = self.state.lock().expect("state");
        let namespace = target.namespace.clone().unwrap_or_default();
        let Some(existing) = state.object(&target.collection, &namespace, name).cloned() else {
            return status_error(StatusCode::NOT_FOUND, "NotFound", "not found");
        };
        if body["metadata"]["resourceVersion"] != existing["metadata"]["resourceVersion"] {
            return status_error(
                StatusCode::CONFLICT,
                "Conflict",
                "the object has been modified",
            );
        }
        for field in ["uid", "creationTimestamp", "generation"] {
            body["metadata"][field] = existing["metadata"][field].clone();
        }
        let stored = Self::store(
            &mut state,
            &self.changes,
            &target.collection,
            "MODIFIED",
            body,
        );
        full(StatusCode::OK, &stored)
    }

    fn delete(&self, target: &Target, name: &str) -> Response<ResponseBody> {
        let mut state = self.state.lock().expect("state");
        let namespace = target.namespace.clone().unwrap_or_default();
        let Some(mut object) = state.object(&target.collection, &namespace, name).cloned() else {
            return status_error(StatusCode::NOT_FOUND, "NotFound", "not found");
        };
        let has_finalizers = object["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| !f.is_empty());
        if has_finalizers {
            if !object["metadata"]["deletionTimestamp"].is_string() {
                object["metadata"]["deletionTimestamp"] =
                    json!(k8s_openapi::jiff::Timestamp::now().to_string());
                // The API server bumps the generation when deletion starts.
                let generation = object["metadata"]["generation"].as_i64().unwrap_or(1);
                object["metadata"]["generation"] = json!(generation + 1);
                object = Self::store(
                    &mut state,
                    &self.changes,
                    &target.collection,
                    "MODIFIED",
                    object,
                );
            }
            return full(StatusCode::ACCEPTED, &object);
        }
        let stored = Self::store(
            &mut state,
            &self.changes,
            &target.collection,
            "DELETED",
            object,
        );
        Self::collect_garbage(&mut state, &self.changes, &stored);
        full(StatusCode::OK, &stored)
    }

    /// Deletes what `owner` owned (the garbage collector's background propagation).
    fn collect_garbage(state: &mut State, changes: &broadcast::Sender<Change>, owner: &Value) {
        let Some(uid) = owner["metadata"]["uid"].as_str() else {
            return;
        };
        let owned: Vec<(String, Value)> = state
            .objects
            .iter()
            .flat_map(|(collection, objects)| {
                objects.values().filter_map(move |o| {
                    let refs = o["metadata"]["ownerReferences"].as_array()?;
                    refs.iter()
                        .any(|r| r["uid"] == uid)
                        .then(|| (collection.clone(), o.clone()))
                })
            })
            .collect();
        for (collection, object) in owned {
            let stored = Self::store(state, changes, &collection, "DELETED", object);
            Self::collect_garbage(state, changes, &stored);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
    use kube::runtime::{watcher, WatchStreamExt};

    #[test]
    fn paths() {
        let t = parse("/apis/apps/v1/namespaces/shop/deployments/w/scale").unwrap();
        assert_eq!(
            (
                t.collection.as_str(),
                t.namespace.as_deref(),
                t.name.as_deref(),
                t.subresource.as_deref()
            ),
            (
                "apis/apps/v1/deployments",
                Some("shop"),
                Some("w"),
                Some("scale")
            )
        );
        let t = parse("/api/v1/pods").unwrap();
        assert_eq!(
            (t.collection.as_str(), t.namespace, t.name),
            ("api/v1/pods", None, None)
        );
    }

    #[tokio::test]
    async fn objects_round_trip_and_watches_see_changes() {
        let server = FakeApiServer::new();
        let api: Api<ConfigMap> = Api::namespaced(server.client(), "shop");
        let mut cm = ConfigMap::default();
        cm.metadata.name = Some("a".into());
        let created = api.create(&PostParams::default(), &cm).await.unwrap();
        assert!(
            api.create(&PostParams::default(), &cm).await.is_err(),
            "409"
        );
        let mut events = watcher(api.clone(), watcher::Config::default())
            .applied_objects()
            .boxed();
        assert_eq!(
            events
                .next()
                .await
                .unwrap()
                .unwrap()
                .metadata
                .name
                .as_deref(),
            Some("a")
        );
        api.patch(
            "a",
            &PatchParams::apply("t"),
            &Patch::Apply(json!({"apiVersion": "v1", "kind": "ConfigMap", "data": {"k": "v"}})),
        )
        .await
        .unwrap();
        let seen = events.next().await.unwrap().unwrap();
        assert_eq!(seen.data.unwrap()["k"], "v");
        // A stale replace conflicts.
        assert!(api
            .replace("a", &PostParams::default(), &created)
            .await
            .is_err());
        api.delete("a", &DeleteParams::default()).await.unwrap();
        assert!(api.get_opt("a").await.unwrap().is_none());
    }
}
