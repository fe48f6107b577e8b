//! The web console in the cluster (`--console-listen`, off by default): the queues of every
//! CosmosQueue the operator reconciles, for people who sign in with their Kubernetes token.
//!
//! Each request is authenticated by a TokenReview and authorized by SubjectAccessReviews, as
//! the KEDA endpoint and `/metrics` are ([`crate::auth`], answers cached for ten seconds): a
//! caller sees the queues of the namespaces where it may `get` CosmosQueues — their groups,
//! figures, dead letters and message bodies — and replays or purges dead letters only where it
//! may also `update` QueueConsumerGroups. A caller granted either cluster-wide is asked once,
//! not once per namespace.
//!
//! Tokens are the API server's audience: a person pastes the token their own `kubectl` uses (or
//! `kubectl create token`), which already is an API credential of that caller, so accepting it
//! grants nothing RBAC does not. The console listens on the pod's loopback by default, which
//! `kubectl port-forward` reaches and no other pod does.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;
use cosmosq_console::{
    Access, Catalog, Console, ConsoleError, ConsoleOptions, Gate, Listed, Refusal,
};
use cosmosq_crds::CosmosQueue;
use cosmosq_queue::Queue;
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use kube::api::ListParams;
use kube::{Api, ResourceExt};

use crate::auth::{Attributes, Audience, AuthError, Authorizer};
use crate::context::Context;

/// The console of the CosmosQueues `api` lists, opened through `ctx`, each request gated by
/// Kubernetes RBAC through `authorizer`. Every replica may serve it: it reads Cosmos DB, not
/// the leader's figures.
pub async fn bind(
    api: Api<CosmosQueue>,
    ctx: Arc<Context>,
    authorizer: Arc<Authorizer>,
    options: ConsoleOptions,
    address: SocketAddr,
) -> Result<Console, ConsoleError> {
    let console = Console::bind_catalog(Arc::new(Queues::new(api, ctx)), options, address).await?;
    Ok(console.with_gate(Arc::new(KubernetesGate::new(authorizer))))
}

/// SubjectAccessReviews asked at once for one caller.
const REVIEWS_AT_ONCE: usize = 8;

/// The CosmosQueues the operator reconciles (every namespace, or `--watch-namespace`'s), named
/// `<namespace>/<name>`, opened with the operator's own connections.
pub struct Queues {
    api: Api<CosmosQueue>,
    ctx: Arc<Context>,
    /// The last list, by console name: only what it listed is opened.
    listed: Mutex<BTreeMap<String, CosmosQueue>>,
}

impl Queues {
    /// The queues `api` lists, opened through `ctx`'s connections.
    pub fn new(api: Api<CosmosQueue>, ctx: Arc<Context>) -> Self {
        Self {
            api,
            ctx,
            listed: Mutex::default(),
        }
    }

    async fn list_queues(&self) -> Result<Vec<Listed>, ConsoleError> {
        let queues = self
            .api
            .list(&ListParams::default())
            .await
            .map_err(|e| ConsoleError::List(e.to_string()))?;
        let mut listed = BTreeMap::new();
        for cq in queues.items {
            if cq.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let namespace = cq.namespace().unwrap_or_default();
            listed.insert(format!("{namespace}/{}", cq.name_any()), cq);
        }
        let names = listed
            .iter()
            .map(|(name, cq)| Listed {
                name: name.clone(),
                namespace: cq.namespace(),
            })
            .collect();
        *self.listed.lock().unwrap_or_else(|e| e.into_inner()) = listed;
        Ok(names)
    }

    async fn open_queue(&self, name: &str) -> Result<Queue, ConsoleError> {
        let cq = self
            .listed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
            .ok_or_else(|| ConsoleError::NotFound(format!("no queue {name}")))?;
        // The operator's errors are written for status and Events: no secret, no answer of
        // the endpoint.
        self.ctx
            .cosmos
            .queue(&cq)
            .await
            .map_err(|e| ConsoleError::Open(e.to_string()))
    }
}

impl Catalog for Queues {
    fn list(&self) -> BoxFuture<'_, Result<Vec<Listed>, ConsoleError>> {
        self.list_queues().boxed()
    }

    fn open<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Queue, ConsoleError>> {
        self.open_queue(name).boxed()
    }
}

/// Kubernetes decides: TokenReview for who, SubjectAccessReview for what.
pub struct KubernetesGate {
    authorizer: Arc<Authorizer>,
}

/// What reading a namespace's queues asks of RBAC…
fn read_in(namespace: &str) -> Attributes {
    Attributes::Resource {
        group: cosmosq_crds::GROUP.into(),
        version: cosmosq_crds::VERSION.into(),
        resource: "cosmosqueues".into(),
        namespace: namespace.into(),
        name: None,
        subresource: None,
        verb: "get".into(),
    }
}

/// …and acting on their dead letters.
fn act_in(namespace: &str) -> Attributes {
    Attributes::Resource {
        group: cosmosq_crds::GROUP.into(),
        version: cosmosq_crds::VERSION.into(),
        resource: "queueconsumergroups".into(),
        namespace: namespace.into(),
        name: None,
        subresource: None,
        verb: "update".into(),
    }
}

fn refusal(error: AuthError) -> Refusal {
    let (status, retry_after) = match &error {
        AuthError::Unauthenticated(_) | AuthError::Config(_) => (StatusCode::UNAUTHORIZED, None),
        AuthError::Forbidden(_) => (StatusCode::FORBIDDEN, None),
        AuthError::TooManyRequests(wait) => (
            StatusCode::TOO_MANY_REQUESTS,
            Some(crate::auth::retry_after_seconds(*wait)),
        ),
        AuthError::Api(_) => (StatusCode::BAD_GATEWAY, None),
    };
    Refusal {
        status,
        message: error.to_string(),
        retry_after,
    }
}

impl KubernetesGate {
    /// Reviews through `authorizer` (its answers cached, unknown tokens rate-limited).
    pub fn new(authorizer: Arc<Authorizer>) -> Self {
        Self { authorizer }
    }

    /// The namespaces of `namespaces` where `user` may do `attributes` (cluster-wide first).
    async fn allowed(
        &self,
        user: &crate::auth::UserInfo,
        namespaces: &BTreeSet<String>,
        attributes: fn(&str) -> Attributes,
    ) -> Result<BTreeSet<String>, Refusal> {
        if namespaces.is_empty() {
            return Ok(BTreeSet::new());
        }
        let decide = |namespace: String| async move {
            match self
                .authorizer
                .authorize(user, &attributes(&namespace))
                .await
            {
                Ok(()) => Ok(Some(namespace)),
                Err(AuthError::Forbidden(_)) => Ok(None),
                Err(e) => Err(refusal(e)),
            }
        };
        if decide(String::new()).await?.is_some() {
            return Ok(namespaces.clone());
        }
        let decided: Vec<Result<Option<String>, Refusal>> =
            futures::stream::iter(namespaces.iter().cloned())
                .map(decide)
                .buffer_unordered(REVIEWS_AT_ONCE)
                .collect()
                .await;
        decided.into_iter().filter_map(Result::transpose).collect()
    }

    async fn access(&self, token: &str, namespaces: &BTreeSet<String>) -> Result<Access, Refusal> {
        let user = self
            .authorizer
            .token_user(token, &Audience::ApiServer)
            .await
            .map_err(refusal)?;
        let read = self.allowed(&user, namespaces, read_in).await?;
        let act = self.allowed(&user, &read, act_in).await?;
        Ok(Access::Namespaces { read, act })
    }
}

impl Gate for KubernetesGate {
    fn admit<'a>(
        &'a self,
        token: &'a str,
        namespaces: &'a BTreeSet<String>,
    ) -> BoxFuture<'a, Result<Access, Refusal>> {
        self.access(token, namespaces).boxed()
    }

    fn sign_in_hint(&self) -> String {
        "kubectl create token <service-account> --namespace <namespace>\n\
         # or the token your own kubeconfig's user holds"
            .to_owned()
    }
}
