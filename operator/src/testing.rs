//! Test support: kube's mock-service pattern. The verifier plays the API server and asserts
//! each request the code under test makes, in order.

use http::{Method, Request, Response, StatusCode};
use kube::client::Body;
use kube::Client;
use serde_json::{json, Value};
use tower_test::mock::{Handle, SendResponse};

pub struct ApiServerVerifier(pub Handle<Request<Body>, Response<Body>>);

pub fn client() -> (Client, ApiServerVerifier) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    (Client::new(service, "shop"), ApiServerVerifier(handle))
}

pub fn json_response(status: StatusCode, value: &Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .body(Body::from(serde_json::to_vec(value).unwrap()))
        .unwrap()
}

pub fn not_found() -> Response<Body> {
    json_response(
        StatusCode::NOT_FOUND,
        &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "reason": "NotFound", "code": 404, "message": "not found"}),
    )
}

/// One request as the verifier saw it.
pub struct Seen {
    pub method: Method,
    pub path: String,
    pub query: String,
    pub content_type: String,
    pub body: Value,
    pub send: SendResponse<Response<Body>>,
}

impl ApiServerVerifier {
    pub async fn next(&mut self) -> Seen {
        // A request that never comes fails the test instead of hanging it.
        let (request, send) =
            tokio::time::timeout(std::time::Duration::from_secs(20), self.0.next_request())
                .await
                .expect("the expected request did not come within 20 s")
                .expect("another request");
        let method = request.method().clone();
        let path = request.uri().path().to_owned();
        let query = request.uri().query().unwrap_or_default().to_owned();
        let content_type = request
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let bytes = request.into_body().collect_bytes().await.unwrap();
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Seen {
            method,
            path,
            query,
            content_type,
            body,
            send,
        }
    }

    /// The next request must be `method path`.
    pub async fn expect(&mut self, method: Method, path: &str) -> Seen {
        let seen = self.next().await;
        assert_eq!(
            (&seen.method, seen.path.as_str()),
            (&method, path),
            "unexpected request (body {})",
            seen.body
        );
        seen
    }

    /// The next request is `method path`; answers `response`; returns the request body.
    pub async fn answer(&mut self, method: Method, path: &str, response: Response<Body>) -> Value {
        let seen = self.expect(method, path).await;
        seen.send.send_response(response);
        seen.body
    }

    /// The next request reads the queue's key Secret (`shop/cosmos-key`); answered with key
    /// `key`. Returns the digest the worker pods should carry.
    pub async fn key_read(&mut self, key: &str) -> String {
        use base64::Engine;
        let secret = json!({"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "cosmos-key", "namespace": "shop"},
            "data": {"key": base64::engine::general_purpose::STANDARD.encode(key)}});
        self.answer(
            Method::GET,
            "/api/v1/namespaces/shop/secrets/cosmos-key",
            json_response(StatusCode::OK, &secret),
        )
        .await;
        crate::build::key_digest(key.as_bytes())
    }

    /// The next request writes `path` (apply, patch, create); it is echoed back as stored.
    pub async fn echo(&mut self, method: Method, path: &str) -> Value {
        let seen = self.expect(method, path).await;
        seen.send
            .send_response(json_response(StatusCode::OK, &seen.body));
        seen.body
    }

    /// The next request patches the status of `object` at `path`; answered with the object
    /// carrying that status, as the API server would. Returns the request body.
    pub async fn status(&mut self, path: &str, mut object: Value) -> Value {
        let seen = self.expect(Method::PATCH, path).await;
        assert!(path.ends_with("/status"), "{path}");
        object["status"] = seen.body["status"].clone();
        seen.send
            .send_response(json_response(StatusCode::OK, &object));
        seen.body
    }

    /// The next request publishes an Event in namespace `shop`; returns it.
    pub async fn event(&mut self) -> Value {
        let seen = self
            .expect(
                Method::POST,
                "/apis/events.k8s.io/v1/namespaces/shop/events",
            )
            .await;
        seen.send
            .send_response(json_response(StatusCode::CREATED, &seen.body));
        seen.body
    }

    /// Nothing else is requested once every client is dropped.
    pub async fn done(mut self) {
        if let Some((request, _)) = self.0.next_request().await {
            panic!("unexpected request {} {}", request.method(), request.uri());
        }
    }
}

/// The condition `type_` of a written status; panics naming the status when it has none.
pub fn condition<'a>(status: &'a Value, type_: &str) -> &'a Value {
    status["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == type_)
        .unwrap_or_else(|| panic!("no {type_} in {status}"))
}

pub fn queue_json() -> Value {
    json!({
        "apiVersion": "cosmosq.io/v1alpha1", "kind": "CosmosQueue",
        "metadata": {"name": "orders", "namespace": "shop", "uid": "q1", "generation": 1},
        "spec": {"endpoint": "https://acct.documents.azure.com:443/",
                 "credentials": {"secretKeyRef": {"name": "cosmos-key"}},
                 "database": "shop", "container": "orders"}
    })
}

pub fn group_json(spec_extra: Value) -> Value {
    let mut group = json!({
        "apiVersion": "cosmosq.io/v1alpha1", "kind": "QueueConsumerGroup",
        "metadata": {"name": "billing", "namespace": "shop", "uid": "g1", "generation": 3},
        "spec": {"queueRef": {"name": "orders"},
                 "template": {"spec": {"containers": [{"name": "app", "image": "example/app"}]}},
                 "app": {"port": 8080}}
    });
    let spec = group["spec"].as_object_mut().unwrap();
    spec.extend(spec_extra.as_object().cloned().unwrap_or_default());
    group
}

/// A Context whose queues live on a fresh in-process emulator (4 partitions), with the API
/// server played by the returned verifier.
/// A context whose Cosmos connections are Azure's (credentials read from Secrets through the
/// mock API server); not yet shared, so a test can set its channels first.
pub fn azure_context() -> (crate::context::Context, ApiServerVerifier) {
    azure_context_dialling(crate::endpoint::EndpointPolicy::default())
}

/// An Azure context that dials `endpoints`.
pub fn azure_context_dialling(
    endpoints: crate::endpoint::EndpointPolicy,
) -> (crate::context::Context, ApiServerVerifier) {
    let (client, server) = client();
    let cosmos = crate::cosmos::Cosmos::new(
        crate::cosmos::Backend::Azure {
            region: "eastus".into(),
            identity_grants: Vec::new(),
            endpoints,
        },
        client.clone(),
    );
    let defaults = crate::build::Defaults::new("s:t");
    (
        crate::context::Context::new(client, defaults, cosmos, None),
        server,
    )
}

pub async fn emulator_context() -> (
    std::sync::Arc<crate::context::Context>,
    ApiServerVerifier,
    cosmosq_queue::CosmosClient,
) {
    use cosmosq_emulator::{Emulator, EmulatorOptions};
    let emulator = Emulator::in_process(EmulatorOptions::default()).expect("emulator");
    let cosmos_client = emulator.client().await.expect("emulator client");
    let (client, server) = client();
    let cosmos = crate::cosmos::Cosmos::new(
        crate::cosmos::Backend::Fixed(cosmos_client.clone()),
        client.clone(),
    );
    let defaults = crate::build::Defaults::new("s:t");
    let ctx = crate::context::Context::new(client, defaults, cosmos, None);
    (std::sync::Arc::new(ctx), server, cosmos_client)
}

pub use cosmosq_emulator::container_exists;

/// What an emulator context with a fake ARM holds.
pub struct ArmContext {
    pub ctx: std::sync::Arc<crate::context::Context>,
    pub server: ApiServerVerifier,
    pub cosmos: cosmosq_queue::CosmosClient,
    pub arm: crate::arm::fake::FakeArm,
    pub pauses: std::sync::Arc<crate::arm::fake::Recorded>,
}

/// A context whose data plane is a fresh in-process emulator and whose ARM is the fake
/// (carrying out on that emulator), managing `testing::queue_json`'s account, the identity
/// granted per `grants`.
pub async fn arm_context(script: crate::arm::fake::Script, grants: &[&str]) -> ArmContext {
    use cosmosq_emulator::{Emulator, EmulatorOptions};
    let emulator = Emulator::in_process(EmulatorOptions::default()).expect("emulator");
    let cosmos_client = emulator.client().await.expect("emulator client");
    let arm = crate::arm::fake::FakeArm::start(cosmos_client.clone(), script).await;
    let pauses = std::sync::Arc::new(crate::arm::fake::Recorded::default());
    let management = crate::cosmos::Management {
        grants: grants.iter().map(|g| g.parse().unwrap()).collect(),
        scopes: vec![crate::arm::fake::scope()],
        arm: crate::arm::fake::client(&arm, pauses.clone()),
        max_throughput: Some(4000),
    };
    let (client, server) = client();
    let cosmos = crate::cosmos::Cosmos::new(
        crate::cosmos::Backend::Fixed(cosmos_client.clone()),
        client.clone(),
    )
    .with_management(management);
    let defaults = crate::build::Defaults::new("s:t");
    let ctx = crate::context::Context::new(client, defaults, cosmos, None);
    ArmContext {
        ctx: std::sync::Arc::new(ctx),
        server,
        cosmos: cosmos_client,
        arm,
        pauses,
    }
}
