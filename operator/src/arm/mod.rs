//! Creating and deleting a workload-identity queue's database and containers through Azure
//! Resource Manager, where an admin gave the operator a management scope for the account.
//!
//! Cosmos DB's data-plane roles (all an Entra identity has on the account's endpoint) do not
//! cover creating or deleting databases and containers; ARM's control plane does, with a role
//! such as the built-in "Cosmos DB Operator". The operator only ever creates what is missing
//! (ARM's PUT is create-or-replace, so an existing container is never sent one) and deletes
//! the queue's two containers at `deletionPolicy: Delete`.
//!
//! Trust boundary: nothing ARM answers reaches status, Events or logs but its status code and
//! request ids (sanitized); the bearer token goes only to the configured ARM origin (operation
//! URLs elsewhere are refused, redirects are not followed).
//!
//! Written from ARM's documentation (the `Microsoft.DocumentDB` "Sql Resources" REST reference
//! and "Track asynchronous Azure operations"), tested against a fake written from the same
//! documentation (`fake`), not against Azure.

pub mod scope;

#[cfg(test)]
pub(crate) mod fake;

use std::sync::Arc;
use std::time::Duration;

use azure_core::credentials::TokenCredential;
use cosmosq_queue::cosmos::provision::{self, Provisioned, Shortfall};
use cosmosq_queue::{QueueConfig, Throughput};
use futures::future::BoxFuture;
use http::{HeaderMap, Method, StatusCode};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use serde_json::{json, Value};
use tracing::{debug, info, instrument};

pub use scope::{AccountId, ArmEndpoint, ManagementScope};

/// The ARM tag a container the operator creates carries: the uid of the queue it was created
/// for. Only containers with the deleting queue's uid are deleted (ARM tag names cannot hold
/// `/`, so not `cosmosq.io/…`).
pub const OWNER_TAG: &str = "cosmosq.io-queue-uid";

/// The `Microsoft.DocumentDB` API version: a stable (not preview) one that has every field
/// the queue's containers use, and that sovereign clouds serve too.
pub const API_VERSION: &str = "2024-11-15";

/// What an ARM request for a queue can meet. Each says the operation and, from what ARM
/// answered, only its status code and request ids.
#[derive(Debug, thiserror::Error)]
pub enum ArmError {
    /// The identity lacks the role (401/403).
    #[error(
        "{what}: Azure Resource Manager refused the operator's identity (status {status}{ids}); \
         it needs the built-in \"Cosmos DB Operator\" role on {account} (az role assignment \
         create --role \"Cosmos DB Operator\" --scope {account}), or a role allowing {actions}"
    )]
    Denied {
        /// The operation.
        what: String,
        /// 401 or 403.
        status: u16,
        /// ARM's request ids.
        ids: RequestIds,
        /// The account's resource id.
        account: String,
        /// The actions the operation needs.
        actions: &'static str,
    },
    /// Any other answer that is not success (after retrying throttling and server errors).
    #[error("{what}: Azure Resource Manager answered status {status}{ids}")]
    Status {
        /// The operation.
        what: String,
        /// The status code.
        status: u16,
        /// ARM's request ids.
        ids: RequestIds,
    },
    /// The long-running operation ended `Failed` or `Canceled`.
    #[error("{what}: the operation ended {outcome}{ids}")]
    Failed {
        /// The operation.
        what: String,
        /// `Failed` or `Canceled`.
        outcome: &'static str,
        /// ARM's request ids.
        ids: RequestIds,
    },
    /// The operation's status could not be read.
    #[error("{what}: the operation's status could not be read{ids}")]
    Unreadable {
        /// The operation.
        what: String,
        /// ARM's request ids.
        ids: RequestIds,
    },
    /// Not done within the bound; the next reconcile looks again.
    #[error("{what}: not done after waiting {}s; the next reconcile looks again", .waited.as_secs())]
    Timeout {
        /// The operation.
        what: String,
        /// How long was waited.
        waited: Duration,
    },
    /// An operation URL off the ARM endpoint: following it would send the token there.
    #[error(
        "{what}: Azure Resource Manager gave an operation URL that is not on {endpoint}; not \
         followed (the operator's token goes to {endpoint} only)"
    )]
    ForeignUrl {
        /// The operation.
        what: String,
        /// The configured ARM endpoint.
        endpoint: String,
    },
    /// Accepted (202) without saying where to follow it.
    #[error("{what}: accepted without an Azure-AsyncOperation or Location header{ids}")]
    NoOperationUrl {
        /// The operation.
        what: String,
        /// ARM's request ids.
        ids: RequestIds,
    },
    /// No token for ARM (the identity's federation or managed identity is unusable).
    #[error("{what}: getting a token for {scope}: {kind}")]
    Token {
        /// The operation.
        what: String,
        /// The token scope.
        scope: String,
        /// The kind of failure (not the identity provider's answer).
        kind: String,
    },
    /// The queue's containers that ARM has were not created by this queue (no owner tag with
    /// its uid): an admin's, or another queue's of the same names. Never deleted.
    #[error(
        "{what}: {} not created by this queue through Azure Resource Manager (no tag \
         {OWNER_TAG}={owner}); the operator deletes only what it created",
        containers.join(", ")
    )]
    NotCreatedHere {
        /// The operation.
        what: String,
        /// The containers kept.
        containers: Vec<String>,
        /// The queue's uid.
        owner: String,
    },
    /// The request could not be sent or its answer read.
    #[error("{what}: {source}")]
    Transport {
        /// The operation.
        what: String,
        /// reqwest's error, without its URL.
        source: reqwest::Error,
    },
}

impl ArmError {
    /// Whether ARM refused the identity: retrying does not help until a role is assigned.
    pub fn is_denied(&self) -> bool {
        matches!(self, ArmError::Denied { .. })
    }

    /// Whether retrying the same request cannot help until someone changes something: a
    /// refusal, an operation that failed, a request ARM calls bad (4xx but a timeout, a
    /// conflict with an operation in progress, throttling), an answer the operator will not
    /// follow. Throttling, server errors, timeouts and transport failures pass.
    pub fn is_permanent(&self) -> bool {
        match self {
            ArmError::Denied { .. }
            | ArmError::NotCreatedHere { .. }
            | ArmError::Failed { .. }
            | ArmError::ForeignUrl { .. }
            | ArmError::NoOperationUrl { .. } => true,
            ArmError::Status { status, .. } => {
                (400..500).contains(status) && !matches!(status, 408 | 409 | 429)
            }
            ArmError::Unreadable { .. }
            | ArmError::Timeout { .. }
            | ArmError::Token { .. }
            | ArmError::Transport { .. } => false,
        }
    }

    /// Whether the operator will not delete, whatever a retry sees: refused, or not its own.
    pub fn keeps_containers(&self) -> bool {
        matches!(
            self,
            ArmError::Denied { .. } | ArmError::NotCreatedHere { .. }
        )
    }
}

/// `x-ms-request-id` and `x-ms-correlation-request-id`, for support cases. Kept only when
/// they look like ids: they are still text a response chose.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestIds {
    request: Option<String>,
    correlation: Option<String>,
}

impl RequestIds {
    fn of(headers: &HeaderMap) -> Self {
        let id = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .filter(|v| {
                    !v.is_empty()
                        && v.len() <= 64
                        && v.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                })
                .map(str::to_owned)
        };
        Self {
            request: id("x-ms-request-id"),
            correlation: id("x-ms-correlation-request-id"),
        }
    }
}

impl std::fmt::Display for RequestIds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(id) = &self.request {
            write!(f, ", request id {id}")?;
        }
        if let Some(id) = &self.correlation {
            write!(f, ", correlation id {id}")?;
        }
        Ok(())
    }
}

/// What to create for a queue whose verification fell short.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Creation {
    /// The database.
    pub database: bool,
    /// The messages container.
    pub messages: bool,
    /// The lease container.
    pub leases: bool,
}

/// What the operator may create for `shortfalls` (pure): only missing resources. Anything
/// that exists but is unlike what the engine needs is an admin's to change, so then nothing
/// is created and the shortfalls are returned.
pub fn plan(shortfalls: &[Shortfall], config: &QueueConfig) -> Result<Creation, Vec<Shortfall>> {
    let mut plan = Creation::default();
    for shortfall in shortfalls {
        match shortfall {
            // `verify` looks no further when the database is missing.
            Shortfall::Database(_) => {
                plan = Creation {
                    database: true,
                    messages: true,
                    leases: true,
                }
            }
            Shortfall::Container { name, .. } if *name == config.container => plan.messages = true,
            Shortfall::Container { name, .. } if *name == config.lease_container_name() => {
                plan.leases = true
            }
            _ => return Err(shortfalls.to_vec()),
        }
    }
    Ok(plan)
}

/// Characters left as they are in a path segment (RFC 3986's unreserved).
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// `{arm}{account}/sqlDatabases/{database}[/containers/{container}]?api-version=...` (pure),
/// names percent-encoded.
pub fn resource_url(
    endpoint: &ArmEndpoint,
    account: &AccountId,
    database: &str,
    container: Option<&str>,
) -> url::Url {
    let mut path = format!(
        "{}{account}/sqlDatabases/{}",
        endpoint.origin(),
        utf8_percent_encode(database, SEGMENT)
    );
    if let Some(container) = container {
        path.push_str("/containers/");
        path.extend(utf8_percent_encode(container, SEGMENT));
    }
    let mut url = url::Url::parse(&path).expect("an origin and encoded segments form a URL");
    url.query_pairs_mut()
        .append_pair("api-version", API_VERSION);
    url
}

/// The body of a database PUT (pure): no shared throughput, as the key path creates it.
pub fn database_body(database: &str) -> Value {
    json!({"properties": {"resource": {"id": database}, "options": {}}})
}

/// The body of a container PUT (pure): `properties.resource` is the container as the engine
/// defines it (`provision::messages_container`/`lease_container`: id, partition key,
/// indexing policy, default TTL), `properties.options` its throughput if any, `tags` the
/// queue it is created for ([`OWNER_TAG`]).
pub fn container_body(
    container: &azure_data_cosmos::models::ContainerProperties,
    throughput: Option<Throughput>,
    owner: &str,
) -> Value {
    let defined = serde_json::to_value(container).expect("container properties serialize");
    let mut resource = serde_json::Map::new();
    for key in ["id", "partitionKey", "indexingPolicy", "defaultTtl"] {
        if let Some(value) = defined.get(key) {
            resource.insert(key.to_owned(), value.clone());
        }
    }
    let options = match throughput {
        None => json!({}),
        Some(Throughput::Manual(ru)) => json!({"throughput": ru}),
        Some(Throughput::Autoscale(ru)) => json!({"autoscaleSettings": {"maxThroughput": ru}}),
    };
    json!({"tags": {OWNER_TAG: owner}, "properties": {"resource": resource, "options": options}})
}

/// How a long-running operation is followed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Follow {
    /// `Azure-AsyncOperation`: a status resource, `{"status": ...}`.
    AsyncOperation,
    /// `Location`: 202 until done, then 200/204.
    Location,
}

/// Where to follow an accepted operation (pure): `Azure-AsyncOperation` if given, else
/// `Location`; `None` if neither. Only URLs on the ARM endpoint.
fn operation_url(
    endpoint: &ArmEndpoint,
    headers: &HeaderMap,
    what: &str,
) -> Result<Option<(url::Url, Follow)>, ArmError> {
    let found = [
        ("azure-asyncoperation", Follow::AsyncOperation),
        ("location", Follow::Location),
    ]
    .into_iter()
    .find_map(|(name, follow)| headers.get(name).map(|v| (v, follow)));
    let Some((value, follow)) = found else {
        return Ok(None);
    };
    let foreign = || ArmError::ForeignUrl {
        what: what.to_owned(),
        endpoint: endpoint.origin(),
    };
    let url = value
        .to_str()
        .ok()
        .and_then(|v| url::Url::parse(v).ok())
        .ok_or_else(foreign)?;
    if !endpoint.owns(&url) {
        return Err(foreign());
    }
    Ok(Some((url, follow)))
}

/// `Retry-After` in seconds (pure); ARM sends seconds, an HTTP date is ignored.
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get(http::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs)
}

/// What one poll of an operation says (pure).
#[derive(Debug, PartialEq, Eq)]
enum Poll {
    Pending,
    Done,
    Ended(&'static str),
    Unreadable,
    Status(u16),
}

fn poll_outcome(follow: Follow, status: StatusCode, body: &[u8]) -> Poll {
    match (follow, status.as_u16()) {
        (Follow::Location, 202) => Poll::Pending,
        (Follow::Location, 200 | 201 | 204) => Poll::Done,
        (Follow::AsyncOperation, 200) => {
            #[derive(serde::Deserialize)]
            struct Operation {
                status: String,
            }
            match serde_json::from_slice::<Operation>(body) {
                Ok(op) if op.status.eq_ignore_ascii_case("Succeeded") => Poll::Done,
                Ok(op) if op.status.eq_ignore_ascii_case("Failed") => Poll::Ended("Failed"),
                Ok(op) if op.status.eq_ignore_ascii_case("Canceled") => Poll::Ended("Canceled"),
                // `InProgress`, or a provider's own non-terminal state.
                Ok(_) => Poll::Pending,
                Err(_) => Poll::Unreadable,
            }
        }
        (_, status) => Poll::Status(status),
    }
}

/// Waits between requests: tokio's clock in production; tests record the waits instead.
pub trait Pause: Send + Sync {
    /// Waits `duration`.
    fn pause(&self, duration: Duration) -> BoxFuture<'static, ()>;
}

/// [`Pause`] on tokio's clock.
#[derive(Debug)]
pub struct TokioPause;

impl Pause for TokioPause {
    fn pause(&self, duration: Duration) -> BoxFuture<'static, ()> {
        Box::pin(tokio::time::sleep(duration))
    }
}

/// The shortest wait between two requests of one operation.
const MIN_PAUSE: Duration = Duration::from_secs(1);

/// How long the operator waits on ARM.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// The most one provisioning or deletion waits in all (Retry-After, backoff, polls):
    /// the reconcile holds a worker meanwhile. Past it, the next reconcile looks again.
    pub max_wait: Duration,
    /// Between polls when ARM sends no Retry-After.
    pub poll_interval: Duration,
    /// The first wait after a 429, a 5xx or a connection failure without Retry-After; doubles.
    pub backoff: Duration,
    /// The longest single wait (a longer Retry-After is cut to it).
    pub max_pause: Duration,
    /// One request's own timeout.
    pub request_timeout: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            max_wait: Duration::from_secs(300),
            poll_interval: Duration::from_secs(5),
            backoff: Duration::from_secs(1),
            max_pause: Duration::from_secs(60),
            request_timeout: Duration::from_secs(60),
        }
    }
}

/// An ARM client acting as the operator's identity.
pub struct Arm {
    http: reqwest::Client,
    endpoint: ArmEndpoint,
    credential: Arc<dyn TokenCredential>,
    timing: Timing,
    pause: Arc<dyn Pause>,
}

/// What an ARM request answered.
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: bytes::Bytes,
}

/// What one try of a request came to.
enum Attempt {
    /// An answer to act on.
    Answered(Answer),
    /// Throttled, a server error or no connection: try again after this.
    Again(Duration),
}

/// The waits left in one provisioning or deletion.
struct Budget {
    left: Duration,
    waited: Duration,
}

impl Arm {
    /// A client for `endpoint` with `credential` (the operator's workload or managed
    /// identity; a fixed token in tests). Redirects are never followed: the token stays on
    /// `endpoint`.
    pub fn new(
        endpoint: ArmEndpoint,
        credential: Arc<dyn TokenCredential>,
        timing: Timing,
        pause: Arc<dyn Pause>,
    ) -> Result<Self, reqwest::Error> {
        let http = cosmosq_queue::cosmos::tls::http_client_builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(timing.request_timeout)
            .build()?;
        Ok(Self {
            http,
            endpoint,
            credential,
            timing,
            pause,
        })
    }

    /// Creates what `plan` says is missing, database first. Never sends a PUT for a resource
    /// the plan does not name, nor for one ARM says exists: read just before (an admin may have
    /// created it since the verification, or while an earlier operation ran), since ARM's PUT
    /// would replace it.
    #[instrument(skip_all, fields(account = account.name(), database = %config.database))]
    pub async fn create(
        &self,
        account: &AccountId,
        config: &QueueConfig,
        plan: Creation,
        owner: &str,
    ) -> Result<Provisioned, ArmError> {
        const ACTIONS: &str = "Microsoft.DocumentDB/databaseAccounts/sqlDatabases/write, \
                               Microsoft.DocumentDB/databaseAccounts/sqlDatabases/containers/write \
                               and their read";
        let mut budget = self.budget();
        let database = &config.database;
        let mut provisioned = Provisioned::default();
        if plan.database {
            let url = resource_url(&self.endpoint, account, database, None);
            let what = format!("creating database {database}");
            if !self
                .exists(&what, account, ACTIONS, url.clone(), &mut budget)
                .await?
            {
                let body = database_body(database);
                provisioned.created_database = self
                    .put(&what, account, ACTIONS, url, &body, &mut budget)
                    .await?;
            }
        }
        let containers = [
            (
                plan.messages,
                provision::messages_container(config),
                config.throughput,
            ),
            (plan.leases, provision::lease_container(config), None),
        ];
        let mut created = [false; 2];
        for ((wanted, container, throughput), created) in containers.into_iter().zip(&mut created) {
            if !wanted {
                continue;
            }
            let name = container.id.to_string();
            let url = resource_url(&self.endpoint, account, database, Some(&name));
            let what = format!("creating container {database}/{name}");
            if self
                .exists(&what, account, ACTIONS, url.clone(), &mut budget)
                .await?
            {
                continue;
            }
            let body = container_body(&container, throughput, owner);
            *created = self
                .put(&what, account, ACTIONS, url, &body, &mut budget)
                .await?;
        }
        [
            provisioned.created_messages_container,
            provisioned.created_lease_container,
        ] = created;
        info!(?provisioned, "created through Azure Resource Manager");
        Ok(provisioned)
    }

    /// Deletes the queue's two containers (the database may hold other queues and stays).
    /// One already gone counts as deleted.
    #[instrument(skip_all, fields(account = account.name(), database = %config.database))]
    pub async fn delete(
        &self,
        account: &AccountId,
        config: &QueueConfig,
        owner: &str,
    ) -> Result<(), ArmError> {
        const ACTIONS: &str =
            "Microsoft.DocumentDB/databaseAccounts/sqlDatabases/containers/delete and read";
        let mut budget = self.budget();
        let mut kept = Vec::new();
        for name in [config.container.clone(), config.lease_container_name()] {
            let url = resource_url(&self.endpoint, account, &config.database, Some(&name));
            let what = format!("deleting container {}/{name}", config.database);
            // Only what was created for this queue: a queue may name any container of a
            // granted database, and deleting one is not the data-plane access a grant gives.
            match self
                .read(&what, account, ACTIONS, url.clone(), &mut budget)
                .await?
            {
                None => continue,
                Some(found) if found["tags"][OWNER_TAG] == owner => {}
                Some(_) => {
                    kept.push(format!("{}/{name}", config.database));
                    continue;
                }
            }
            let answer = self
                .send(
                    &what,
                    account,
                    ACTIONS,
                    Method::DELETE,
                    url,
                    None,
                    &mut budget,
                )
                .await?;
            match answer.status.as_u16() {
                200 | 204 | 404 => {}
                202 => {
                    self.follow(&what, account, ACTIONS, answer, &mut budget)
                        .await?
                }
                status => return Err(status_error(&what, status, &answer.headers)),
            }
            info!(container = %name, "container deleted through Azure Resource Manager");
        }
        if kept.is_empty() {
            Ok(())
        } else {
            Err(ArmError::NotCreatedHere {
                what: format!("deleting the containers of database {}", config.database),
                containers: kept,
                owner: owner.to_owned(),
            })
        }
    }

    fn budget(&self) -> Budget {
        Budget {
            left: self.timing.max_wait,
            waited: Duration::ZERO,
        }
    }

    /// Whether ARM has the resource at `url` (200), or not (404).
    async fn exists(
        &self,
        what: &str,
        account: &AccountId,
        actions: &'static str,
        url: url::Url,
        budget: &mut Budget,
    ) -> Result<bool, ArmError> {
        let found = self.read(what, account, actions, url, budget).await?;
        if found.is_some() {
            info!(
                what,
                "exists in Azure Resource Manager already; not sent a PUT"
            );
        }
        Ok(found.is_some())
    }

    /// The resource at `url` as ARM has it (an unreadable body reads as `{}`), or `None`.
    async fn read(
        &self,
        what: &str,
        account: &AccountId,
        actions: &'static str,
        url: url::Url,
        budget: &mut Budget,
    ) -> Result<Option<Value>, ArmError> {
        let answer = self
            .send(what, account, actions, Method::GET, url, None, budget)
            .await?;
        match answer.status.as_u16() {
            200 => Ok(Some(
                serde_json::from_slice(&answer.body).unwrap_or_else(|_| json!({})),
            )),
            404 => Ok(None),
            status => Err(status_error(what, status, &answer.headers)),
        }
    }

    /// PUT, then follow the operation to its end. False when, before a PUT was tried again,
    /// ARM turned out to have the resource: then it was not sent again.
    async fn put(
        &self,
        what: &str,
        account: &AccountId,
        actions: &'static str,
        url: url::Url,
        body: &Value,
        budget: &mut Budget,
    ) -> Result<bool, ArmError> {
        let body = Some(serde_json::to_vec(body).expect("a JSON value serializes"));
        let mut backoff = self.timing.backoff;
        let answer = loop {
            match self
                .attempt(
                    what,
                    account,
                    actions,
                    &Method::PUT,
                    &url,
                    &body,
                    backoff,
                    budget,
                )
                .await?
            {
                Attempt::Answered(answer) => break answer,
                Attempt::Again(delay) => {
                    self.wait(what, delay, budget).await?;
                    // Read again before each new PUT: it replaces what exists, and an admin
                    // (or this PUT, its answer lost) may have made the resource meanwhile.
                    if self
                        .exists(what, account, actions, url.clone(), budget)
                        .await?
                    {
                        return Ok(false);
                    }
                }
            }
            backoff = (backoff * 2).min(self.timing.max_pause);
        };
        match answer.status.as_u16() {
            200 => Ok(true),
            201 | 202 => self
                .follow(what, account, actions, answer, budget)
                .await
                .map(|()| true),
            status => Err(status_error(what, status, &answer.headers)),
        }
    }

    /// Follows an accepted operation until it ends or the budget runs out.
    async fn follow(
        &self,
        what: &str,
        account: &AccountId,
        actions: &'static str,
        accepted: Answer,
        budget: &mut Budget,
    ) -> Result<(), ArmError> {
        let Some((url, follow)) = operation_url(&self.endpoint, &accepted.headers, what)? else {
            // A 201 without one is done (the resource is there); a 202 cannot be followed.
            return if accepted.status == StatusCode::CREATED {
                Ok(())
            } else {
                Err(ArmError::NoOperationUrl {
                    what: what.to_owned(),
                    ids: RequestIds::of(&accepted.headers),
                })
            };
        };
        let mut delay = retry_after(&accepted.headers).unwrap_or(self.timing.poll_interval);
        loop {
            self.wait(what, delay, budget).await?;
            let answer = self
                .send(
                    what,
                    account,
                    actions,
                    Method::GET,
                    url.clone(),
                    None,
                    budget,
                )
                .await?;
            match poll_outcome(follow, answer.status, &answer.body) {
                Poll::Done => return Ok(()),
                Poll::Pending => {
                    debug!(what, "operation in progress");
                    delay = retry_after(&answer.headers).unwrap_or(self.timing.poll_interval);
                }
                Poll::Ended(outcome) => {
                    return Err(ArmError::Failed {
                        what: what.to_owned(),
                        outcome,
                        ids: RequestIds::of(&answer.headers),
                    })
                }
                Poll::Unreadable => {
                    return Err(ArmError::Unreadable {
                        what: what.to_owned(),
                        ids: RequestIds::of(&answer.headers),
                    })
                }
                Poll::Status(status) => return Err(status_error(what, status, &answer.headers)),
            }
        }
    }

    /// Waits `delay` (at least a second, at most `max_pause`) out of the budget: a
    /// `Retry-After: 0` cannot make the operator poll without pause.
    async fn wait(&self, what: &str, delay: Duration, budget: &mut Budget) -> Result<(), ArmError> {
        let delay = delay.clamp(MIN_PAUSE, self.timing.max_pause.max(MIN_PAUSE));
        if delay > budget.left {
            return Err(ArmError::Timeout {
                what: what.to_owned(),
                waited: budget.waited,
            });
        }
        budget.left -= delay;
        budget.waited += delay;
        self.pause.pause(delay).await;
        Ok(())
    }

    /// Sends one request with the identity's ARM token, retrying throttling (429), server
    /// errors (5xx) and failed connections within the budget. 401/403 are `Denied`.
    #[allow(clippy::too_many_arguments)]
    async fn send(
        &self,
        what: &str,
        account: &AccountId,
        actions: &'static str,
        method: Method,
        url: url::Url,
        body: Option<Vec<u8>>,
        budget: &mut Budget,
    ) -> Result<Answer, ArmError> {
        let mut backoff = self.timing.backoff;
        loop {
            match self
                .attempt(
                    what, account, actions, &method, &url, &body, backoff, budget,
                )
                .await?
            {
                Attempt::Answered(answer) => return Ok(answer),
                Attempt::Again(delay) => self.wait(what, delay, budget).await?,
            }
            backoff = (backoff * 2).min(self.timing.max_pause);
        }
    }

    /// One try of a request: its answer, or how long to wait before the next try (throttled,
    /// a server error, a failed connection), or the error when the budget does not allow one.
    #[allow(clippy::too_many_arguments)]
    #[instrument(skip_all, fields(method = %method, path = url.path()))]
    async fn attempt(
        &self,
        what: &str,
        account: &AccountId,
        actions: &'static str,
        method: &Method,
        url: &url::Url,
        body: &Option<Vec<u8>>,
        backoff: Duration,
        budget: &Budget,
    ) -> Result<Attempt, ArmError> {
        // Checked here too, whatever the caller: the token goes to the ARM endpoint only.
        if !self.endpoint.owns(url) {
            return Err(ArmError::ForeignUrl {
                what: what.to_owned(),
                endpoint: self.endpoint.origin(),
            });
        }
        let scope = self.endpoint.token_scope();
        let token = self
            .credential
            .get_token(&[&scope], None)
            .await
            .map_err(|e| ArmError::Token {
                what: what.to_owned(),
                scope: scope.clone(),
                kind: e.kind().to_string(),
            })?;
        let mut request = self
            .http
            .request(method.clone(), url.clone())
            .bearer_auth(token.token.secret())
            .header(http::header::ACCEPT, "application/json");
        if let Some(body) = body {
            request = request
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(body.clone());
        }
        let sent = async {
            let response = request.send().await?;
            let status = response.status();
            let headers = response.headers().clone();
            let body = response.bytes().await?;
            Ok::<_, reqwest::Error>(Answer {
                status,
                headers,
                body,
            })
        }
        .await;
        match sent {
            Ok(answer) => match answer.status.as_u16() {
                401 | 403 => Err(ArmError::Denied {
                    what: what.to_owned(),
                    status: answer.status.as_u16(),
                    ids: RequestIds::of(&answer.headers),
                    account: account.to_string(),
                    actions,
                }),
                429 | 500..=599 => {
                    let delay = retry_after(&answer.headers).unwrap_or(backoff);
                    debug!(status = answer.status.as_u16(), ?delay, "retrying");
                    if delay.min(self.timing.max_pause) > budget.left {
                        return Err(status_error(what, answer.status.as_u16(), &answer.headers));
                    }
                    Ok(Attempt::Again(delay))
                }
                _ => Ok(Attempt::Answered(answer)),
            },
            Err(e) if e.is_connect() || e.is_timeout() => {
                let e = e.without_url();
                debug!(error = %e, "retrying");
                if backoff > budget.left {
                    return Err(ArmError::Transport {
                        what: what.to_owned(),
                        source: e,
                    });
                }
                Ok(Attempt::Again(backoff))
            }
            Err(e) => Err(ArmError::Transport {
                what: what.to_owned(),
                source: e.without_url(),
            }),
        }
    }
}

fn status_error(what: &str, status: u16, headers: &HeaderMap) -> ArmError {
    ArmError::Status {
        what: what.to_owned(),
        status,
        ids: RequestIds::of(headers),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn account() -> AccountId {
        "/subscriptions/0b1f6471-1bf0-4dda-aec3-cb9272f09590/resourceGroups/rg/providers/\
         Microsoft.DocumentDB/databaseAccounts/acct"
            .parse()
            .unwrap()
    }

    fn config() -> QueueConfig {
        QueueConfig::new("shop", "orders")
    }

    #[test]
    fn names_are_percent_encoded_in_the_path() {
        let endpoint: ArmEndpoint = scope::DEFAULT_ENDPOINT.parse().unwrap();
        let url = resource_url(&endpoint, &account(), "shop db", Some("orders/../x"));
        assert_eq!(
            url.as_str(),
            "https://management.azure.com/subscriptions/0b1f6471-1bf0-4dda-aec3-cb9272f09590/\
             resourceGroups/rg/providers/Microsoft.DocumentDB/databaseAccounts/acct/\
             sqlDatabases/shop%20db/containers/orders%2F..%2Fx?api-version=2024-11-15"
        );
    }

    #[test]
    fn the_container_body_is_the_engines_definition() {
        let mut config = config();
        config.throughput = Some(Throughput::Autoscale(4000));
        let messages = provision::messages_container(&config);
        let body = container_body(&messages, config.throughput, "q-uid");
        // The queue it is created for: only that queue deletes it.
        assert_eq!(body["tags"], json!({OWNER_TAG: "q-uid"}));
        let resource = &body["properties"]["resource"];
        assert_eq!(resource["id"], "orders");
        assert_eq!(
            resource["partitionKey"],
            serde_json::to_value(&messages.partition_key).unwrap()
        );
        assert_eq!(resource["partitionKey"]["kind"], "Hash");
        assert_eq!(resource["partitionKey"]["version"], 2);
        assert_eq!(
            resource["indexingPolicy"]["includedPaths"][0]["path"],
            "/enqueuedAt/?"
        );
        assert!(resource["defaultTtl"].is_number());
        // Only the documented resource fields: no system properties.
        assert_eq!(resource.as_object().unwrap().len(), 4, "{resource}");
        assert_eq!(
            body["properties"]["options"],
            json!({"autoscaleSettings": {"maxThroughput": 4000}})
        );
        let leases = container_body(&provision::lease_container(&config), None, "q-uid");
        assert_eq!(leases["properties"]["resource"]["defaultTtl"], -1);
        assert_eq!(leases["properties"]["options"], json!({}));
        let manual = container_body(&messages, Some(Throughput::Manual(400)), "q-uid");
        assert_eq!(manual["properties"]["options"], json!({"throughput": 400}));
    }

    #[test]
    fn only_missing_resources_are_planned() {
        let config = config();
        let missing = |name: &str| Shortfall::Container {
            name: name.into(),
            partition_key: "/p".into(),
        };
        assert_eq!(
            plan(&[Shortfall::Database("shop".into())], &config),
            Ok(Creation {
                database: true,
                messages: true,
                leases: true
            })
        );
        assert_eq!(
            plan(&[missing("orders-leases")], &config),
            Ok(Creation {
                leases: true,
                ..Creation::default()
            })
        );
        // An existing container unlike the engine's: nothing is created, an admin decides.
        let wrong = Shortfall::TimeToLive {
            name: "orders".into(),
            what: "messages",
        };
        let shortfalls = vec![missing("orders-leases"), wrong];
        assert_eq!(plan(&shortfalls, &config), Err(shortfalls.clone()));
        // A name that is neither of the queue's (cannot happen): not created either.
        assert!(plan(&[missing("other")], &config).is_err());
    }

    #[test]
    fn operations_are_followed_on_the_arm_endpoint_only() {
        let endpoint: ArmEndpoint = scope::DEFAULT_ENDPOINT.parse().unwrap();
        let headers = |pairs: &[(&'static str, &str)]| {
            let mut map = HeaderMap::new();
            for (k, v) in pairs {
                map.insert(*k, v.parse().unwrap());
            }
            map
        };
        let ours = "https://management.azure.com/subscriptions/x/providers/Microsoft.DocumentDB/\
                    locations/westus/operationsStatus/1?api-version=2024-11-15";
        let (url, follow) = operation_url(
            &endpoint,
            &headers(&[
                ("location", "https://management.azure.com/elsewhere"),
                ("azure-asyncoperation", ours),
            ]),
            "w",
        )
        .unwrap()
        .unwrap();
        assert_eq!((url.as_str(), follow), (ours, Follow::AsyncOperation));
        let (_, follow) = operation_url(&endpoint, &headers(&[("location", ours)]), "w")
            .unwrap()
            .unwrap();
        assert_eq!(follow, Follow::Location);
        assert!(operation_url(&endpoint, &HeaderMap::new(), "w")
            .unwrap()
            .is_none());
        for bad in [
            "https://attacker.example/op",
            "http://management.azure.com/op",
            "/relative/op",
        ] {
            let err = operation_url(&endpoint, &headers(&[("azure-asyncoperation", bad)]), "w")
                .unwrap_err();
            assert!(matches!(err, ArmError::ForeignUrl { .. }), "{bad}");
            assert!(!err.to_string().contains("attacker"), "{err}");
        }
    }

    #[test]
    fn polls_end_only_on_a_terminal_status() {
        let ok = StatusCode::OK;
        let poll = |body: &str| poll_outcome(Follow::AsyncOperation, ok, body.as_bytes());
        assert_eq!(poll(r#"{"status":"InProgress"}"#), Poll::Pending);
        assert_eq!(poll(r#"{"status":"Enqueued"}"#), Poll::Pending);
        assert_eq!(poll(r#"{"status":"Succeeded"}"#), Poll::Done);
        assert_eq!(
            poll(r#"{"status":"Failed","error":{"message":"x"}}"#),
            Poll::Ended("Failed")
        );
        assert_eq!(poll(r#"{"status":"Canceled"}"#), Poll::Ended("Canceled"));
        assert_eq!(poll("<html>"), Poll::Unreadable);
        let location =
            |s: u16| poll_outcome(Follow::Location, StatusCode::from_u16(s).unwrap(), b"");
        assert_eq!(location(202), Poll::Pending);
        assert_eq!(location(204), Poll::Done);
        assert_eq!(location(409), Poll::Status(409));
    }

    #[test]
    fn request_ids_are_kept_only_when_they_look_like_ids() {
        let mut headers = HeaderMap::new();
        headers.insert("x-ms-request-id", "7f3c-1234".parse().unwrap());
        headers.insert(
            "x-ms-correlation-request-id",
            "see https://evil.example for details".parse().unwrap(),
        );
        assert_eq!(
            RequestIds::of(&headers).to_string(),
            ", request id 7f3c-1234"
        );
        assert_eq!(
            retry_after(&{
                let mut h = HeaderMap::new();
                h.insert("retry-after", "7".parse().unwrap());
                h
            }),
            Some(Duration::from_secs(7))
        );
    }

    /// The fake ARM (carrying out on a fresh emulator) and a client for it.
    /// The fake ARM on an emulator, and a client of it whose waits are recorded.
    async fn served(
        script: fake::Script,
    ) -> (fake::FakeArm, Arm, CosmosClientHandle, Arc<fake::Recorded>) {
        let emulator = cosmosq_emulator::Emulator::in_process(Default::default()).unwrap();
        let cosmos = emulator.client().await.unwrap();
        let arm = fake::FakeArm::start(cosmos.clone(), script).await;
        let pauses = Arc::new(fake::Recorded::default());
        let client = fake::client(&arm, pauses.clone());
        (arm, client, cosmos, pauses)
    }

    type CosmosClientHandle = cosmosq_queue::CosmosClient;

    fn everything() -> Creation {
        Creation {
            database: true,
            messages: true,
            leases: true,
        }
    }

    #[tokio::test]
    async fn a_failed_operation_is_an_error_without_what_arm_said() {
        let (served, arm, cosmos, _) = served(fake::Script {
            fail: true,
            ..Default::default()
        })
        .await;
        let err = arm
            .create(&fake::scope().account, &config(), everything(), "q-uid")
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                ArmError::Failed {
                    outcome: "Failed",
                    ..
                }
            ),
            "{err:?}"
        );
        let said = err.to_string();
        assert_eq!(said, "creating database shop: the operation ended Failed");
        assert!(!format!("{err:?}").contains(fake::SECRET));
        // It stopped there: no container was asked for.
        assert_eq!(served.puts().len(), 1);
        assert!(cosmos.database_client("shop").read(None).await.is_err());
    }

    #[tokio::test]
    async fn an_operation_url_on_another_host_is_not_followed() {
        let (served, arm, _cosmos, _) = served(fake::Script {
            foreign_operation_url: true,
            ..Default::default()
        })
        .await;
        let err = arm
            .create(&fake::scope().account, &config(), everything(), "q-uid")
            .await
            .unwrap_err();
        assert!(matches!(err, ArmError::ForeignUrl { .. }), "{err:?}");
        assert!(!err.to_string().contains("attacker"), "{err}");
        // The read and the PUT, and no poll: the token went nowhere else.
        let methods: Vec<Method> = served.seen().into_iter().map(|s| s.method).collect();
        assert_eq!(methods, [Method::GET, Method::PUT]);
    }

    #[tokio::test]
    async fn throttling_is_waited_out_within_the_bound() {
        // Throttled for longer than the whole bound: given up, not waited for.
        let (_served, mut arm, _cosmos, pauses) = served(fake::Script {
            throttle_first: Some(3600),
            ..Default::default()
        })
        .await;
        arm.timing.max_wait = Duration::from_secs(30);
        arm.timing.max_pause = Duration::from_secs(60);
        let err = arm
            .create(&fake::scope().account, &config(), everything(), "q-uid")
            .await
            .unwrap_err();
        assert!(
            matches!(err, ArmError::Status { status: 429, .. }),
            "{err:?}"
        );
        assert!(pauses.0.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_resource_arm_has_is_never_put_even_if_the_plan_names_it() {
        // Created by an admin after the verification: the plan is out of date.
        let (served, arm, cosmos, _) = served(Default::default()).await;
        let config = config();
        cosmos.create_database("shop", None).await.unwrap();
        cosmos
            .database_client("shop")
            .create_container(provision::messages_container(&config), None)
            .await
            .unwrap();
        let provisioned = arm
            .create(&fake::scope().account, &config, everything(), "q-uid")
            .await
            .unwrap();
        assert_eq!(
            provisioned,
            Provisioned {
                created_lease_container: true,
                ..Provisioned::default()
            }
        );
        let puts = served.puts();
        assert_eq!(puts.len(), 1, "{puts:?}");
        assert!(puts[0].ends_with("/containers/orders-leases"), "{puts:?}");
    }

    #[tokio::test]
    async fn a_put_is_not_sent_again_over_a_resource_made_while_it_was_throttled() {
        let (served, arm, cosmos, _pauses) = served(fake::Script {
            made_while_first_put_throttled: true,
            ..Default::default()
        })
        .await;
        cosmos.create_database("shop", None).await.unwrap();
        let plan = Creation {
            messages: true,
            ..Creation::default()
        };
        let provisioned = arm
            .create(&fake::scope().account, &config(), plan, "q-uid")
            .await
            .unwrap();
        // Read, PUT (throttled: an admin made it meanwhile), read again: not PUT again, and
        // not reported as made.
        let seen: Vec<_> = served
            .seen()
            .into_iter()
            .map(|s| (s.method, s.path.rsplit('/').next().unwrap().to_owned()))
            .collect();
        assert_eq!(
            seen,
            [
                (Method::GET, "orders".to_owned()),
                (Method::PUT, "orders".to_owned()),
                (Method::GET, "orders".to_owned()),
            ]
        );
        assert_eq!(provisioned, Provisioned::default());
    }

    #[test]
    fn what_no_retry_gets_past_is_told_from_what_may_pass() {
        let status = |status| ArmError::Status {
            what: "creating".into(),
            status,
            ids: RequestIds::default(),
        };
        for permanent in [400, 404, 422] {
            assert!(status(permanent).is_permanent(), "{permanent}");
        }
        for passing in [408, 409, 429, 500, 503] {
            assert!(!status(passing).is_permanent(), "{passing}");
        }
        let failed = ArmError::Failed {
            what: "creating".into(),
            outcome: "Failed",
            ids: RequestIds::default(),
        };
        let timeout = ArmError::Timeout {
            what: "creating".into(),
            waited: Duration::from_secs(300),
        };
        assert!(failed.is_permanent() && !timeout.is_permanent());
    }

    #[tokio::test]
    async fn a_retry_after_of_zero_still_pauses() {
        let (_served, arm, _cosmos, pauses) = served(fake::Script {
            throttle_first: Some(0),
            ..Default::default()
        })
        .await;
        arm.create(&fake::scope().account, &config(), everything(), "q-uid")
            .await
            .unwrap();
        assert_eq!(pauses.0.lock().unwrap()[0], Duration::from_secs(1));
    }
}
