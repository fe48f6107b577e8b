//! The SDK's in-memory Cosmos DB emulator, as a local account: in process, or served over
//! HTTP on localhost so several processes (CLI, sidecars, operator) share one account.
//!
//! Two things the SDK's emulator does not do are added here: item TTL is applied by a
//! periodic sweep (it stores `ttl` and `defaultTtl` but never expires anything), and new
//! containers get the number of physical partitions asked for (it always creates 4).
//!
//! It is its own crate so that the engine (`cosmosq-queue`) carries neither the SDK's emulator
//! nor an HTTP server: the CLI's local run and the tests depend on it, production builds do not.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use azure_core::credentials::Secret;
use azure_core::http::{Method, Request};
use azure_data_cosmos::options::{ChangeFeedStartFrom, Region};
use azure_data_cosmos::{
    AccountEndpoint, AccountReference, CosmosClient, CosmosClientBuilder, CosmosRuntimeBuilder,
    FeedScope, RoutingStrategy,
};
/// What sees every request the account handles (the simulation records them).
pub use azure_data_cosmos_driver::in_memory_emulator::RequestObserver;
use azure_data_cosmos_driver::in_memory_emulator::{
    ConsistencyLevel, EmulatorStore, InMemoryEmulatorHttpClient, VirtualAccountConfig,
    VirtualRegion, WriteMode,
};
use futures::StreamExt;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use url::Url;

use cosmosq_queue::cosmos::connection::EMULATOR_KEY;
use cosmosq_queue::{QueueError, Result};

/// The SDK's fault injection, for the fault suite ([`Emulator::client_with_faults`]).
#[cfg(feature = "fault-injection")]
pub use azure_data_cosmos::fault_injection;

/// The emulator's one region.
const REGION_NAME: &str = "East US";

/// How an emulated account behaves.
#[derive(Clone, Debug)]
pub struct EmulatorOptions {
    /// Physical partitions of every container created through the SDK.
    pub partitions: u32,
    /// Throttle each container at this many RU/s (429s with retry-after), like a real account.
    pub throughput: Option<u64>,
    /// Advertise multi-region writes, as an account with that setting on does (cosmosq
    /// refuses such accounts; this lets the refusal be tried).
    pub multi_region_writes: bool,
    /// Told of every request before the account handles it (tests: a trace of what crossed
    /// the Cosmos boundary).
    pub observer: Option<Arc<dyn RequestObserver>>,
}

impl Default for EmulatorOptions {
    fn default() -> Self {
        Self {
            partitions: 4,
            throughput: None,
            multi_region_writes: false,
            observer: None,
        }
    }
}

/// Whether a container exists (tests check provisioning and deletion with it).
pub async fn container_exists(client: &CosmosClient, db: &str, name: &str) -> bool {
    match client
        .database_client(db)
        .container_client(name, None)
        .await
    {
        Ok(container) => container.read(None).await.is_ok(),
        Err(_) => false,
    }
}

/// An emulator served on 127.0.0.1 (see [`Emulator::serve_localhost`]).
pub struct Served {
    /// The account served.
    pub emulator: Arc<Emulator>,
    /// What clients connect to (`COSMOSQ_ENDPOINT`).
    pub endpoint: String,
    /// Cancel to stop serving; `task` then ends.
    pub stop: CancellationToken,
    /// The HTTP server; it ends when the shutdown token is cancelled.
    pub task: tokio::task::JoinHandle<Result<()>>,
}

/// One emulated account.
pub struct Emulator {
    http: Arc<InMemoryEmulatorHttpClient>,
    endpoint: Url,
    options: EmulatorOptions,
}

impl Emulator {
    /// An account answering at `endpoint` (for [`Self::serve`], the URL it is served on).
    pub fn new(endpoint: Url, options: EmulatorOptions) -> Result<Arc<Self>> {
        if !(1..=64).contains(&options.partitions) {
            return Err(QueueError::Config(
                "partitions must be between 1 and 64".into(),
            ));
        }
        let config =
            VirtualAccountConfig::new(vec![VirtualRegion::new(REGION_NAME, endpoint.clone())])
                .map_err(|e| QueueError::Config(format!("emulator: {e}")))?
                .with_consistency(ConsistencyLevel::Session)
                .with_throttling_enabled(options.throughput.is_some())
                .with_write_mode(if options.multi_region_writes {
                    WriteMode::Multi
                } else {
                    WriteMode::Single
                });
        let mut http = InMemoryEmulatorHttpClient::try_new(config)
            .map_err(|e| QueueError::Config(format!("emulator: {e}")))?;
        if let Some(observer) = &options.observer {
            http = http.with_request_observer(Arc::clone(observer));
        }
        Ok(Arc::new(Self {
            http: Arc::new(http),
            endpoint,
            options,
        }))
    }

    /// An account used only inside this process.
    pub fn in_process(options: EmulatorOptions) -> Result<Arc<Self>> {
        Self::new(
            Url::parse("https://cosmosq.emulator.local/").expect("static URL"),
            options,
        )
    }

    /// The account endpoint clients connect to.
    pub fn endpoint(&self) -> &Url {
        &self.endpoint
    }

    /// The account key: the one every Cosmos DB emulator accepts.
    pub fn key(&self) -> &'static str {
        EMULATOR_KEY
    }

    /// The store, for test hooks (splits, merges, faults).
    pub fn store(&self) -> Arc<EmulatorStore> {
        self.http.store()
    }

    /// A client whose requests go straight to the in-memory store (no sockets).
    pub async fn client(&self) -> Result<CosmosClient> {
        self.build_client(CosmosClientBuilder::new()).await
    }

    /// [`Self::client`] with the SDK's fault injection in front of the store: the rules see
    /// every request this client makes, after the SDK's own retry policies decide to send it.
    #[cfg(feature = "fault-injection")]
    pub async fn client_with_faults(
        &self,
        rules: Vec<Arc<azure_data_cosmos::fault_injection::FaultInjectionRule>>,
    ) -> Result<CosmosClient> {
        let builder = CosmosClientBuilder::new()
            .with_fault_injection_rules(rules)
            .map_err(QueueError::cosmos("fault injection rules"))?;
        self.build_client(builder).await
    }

    async fn build_client(&self, builder: CosmosClientBuilder) -> Result<CosmosClient> {
        cosmosq_queue::cosmos::tls::install_crypto_provider();
        let runtime = CosmosRuntimeBuilder::from(self.http.runtime_builder())
            .build()
            .await
            .map_err(QueueError::cosmos("emulator runtime"))?;
        let endpoint: AccountEndpoint = self
            .endpoint
            .as_str()
            .parse()
            .map_err(|_| QueueError::Config("emulator endpoint".into()))?;
        builder
            .with_runtime(runtime)
            .build(
                AccountReference::with_authentication_key(endpoint, Secret::new(EMULATOR_KEY)),
                RoutingStrategy::ProximityTo(Region::EAST_US),
            )
            .await
            .map_err(QueueError::cosmos("emulator client"))
    }

    /// Gives a container the configured partition count (splits or merges the 4 it starts with).
    pub async fn apply_partition_count(&self, database: &str, container: &str) -> Result<()> {
        self.set_partition_count(database, container, self.options.partitions)
            .await
    }

    /// Splits or merges a container's physical partitions until it has `count`.
    pub async fn set_partition_count(
        &self,
        database: &str,
        container: &str,
        count: u32,
    ) -> Result<()> {
        let store = self.store();
        let control = |e: azure_data_cosmos_driver::error::CosmosError| {
            QueueError::Config(format!(
                "emulator partitions of {database}/{container}: {e}"
            ))
        };
        loop {
            let ids = self.partition_ids(database, container).await?;
            let current = ids.len() as u32;
            if current == count || current == 0 {
                return Ok(());
            }
            if current < count {
                // Split the first partitions in EPK order: their children come out even.
                for id in ids.iter().take((count - current) as usize) {
                    let epk = store
                        .midpoint_split_epk(database, container, *id)
                        .map_err(control)?;
                    store
                        .split_partition_and_wait(database, container, *id, epk, Duration::ZERO)
                        .await
                        .map_err(control)?;
                }
            } else {
                for pair in ids.chunks(2).take((current - count) as usize) {
                    if let [a, b] = pair {
                        store
                            .merge_partitions_and_wait(database, container, *a, *b, Duration::ZERO)
                            .await
                            .map_err(control)?;
                    }
                }
            }
        }
    }

    /// Physical partition ids in EPK order, from the account's partition key ranges.
    pub async fn partition_ids(&self, database: &str, container: &str) -> Result<Vec<u32>> {
        let url = self
            .endpoint
            .join(&format!("dbs/{database}/colls/{container}/pkranges"))
            .map_err(|e| QueueError::Config(format!("emulator: {e}")))?;
        let request = Request::new(url, Method::Get);
        let failed = |e: String| QueueError::Config(format!("emulator partition key ranges: {e}"));
        let response = self
            .http
            .execute_request(&request)
            .await
            .map_err(|e| failed(e.to_string()))?;
        let raw = response
            .try_into_raw_response()
            .await
            .map_err(|e| failed(e.to_string()))?;
        if u16::from(raw.status()) == 404 {
            return Ok(Vec::new());
        }
        let body: Value = serde_json::from_slice(raw.body()).map_err(|e| failed(e.to_string()))?;
        let mut ranges: Vec<(String, u32)> = body["PartitionKeyRanges"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| {
                let min = r["minInclusive"].as_str()?.to_owned();
                let id = r["id"].as_str()?.parse().ok()?;
                Some((min, id))
            })
            .collect();
        ranges.sort();
        Ok(ranges.into_iter().map(|(_, id)| id).collect())
    }

    /// Deletes every item whose TTL has passed at `now_secs` (epoch seconds), in every
    /// container with TTL on; returns how many. `_ts + (ttl ?? defaultTtl)` as Cosmos does.
    pub async fn sweep_ttl(&self, client: &CosmosClient, now_secs: i64) -> Result<usize> {
        let mut removed = 0;
        let mut dbs = client
            .query_databases("SELECT * FROM root", None)
            .await
            .map_err(QueueError::cosmos("list databases"))?;
        while let Some(db) = dbs.next().await {
            let db = db.map_err(QueueError::cosmos("list databases"))?;
            let Some(db_id) = db.id else { continue };
            let db_client = client.database_client(db_id.as_str());
            let mut containers = db_client
                .query_containers("SELECT * FROM root", None)
                .await
                .map_err(QueueError::cosmos("list containers"))?;
            while let Some(props) = containers.next().await {
                let props = props.map_err(QueueError::cosmos("list containers"))?;
                debug!(database = %db_id, container = %props.id, ttl = ?props.default_ttl, "TTL sweep");
                let default_ttl = match props.default_ttl {
                    azure_data_cosmos::models::TimeToLive::Forever => continue,
                    azure_data_cosmos::models::TimeToLive::NoDefault => None,
                    azure_data_cosmos::models::TimeToLive::Seconds(s) => Some(i64::from(s)),
                    _ => continue,
                };
                let Some(pk_path) = props.partition_key.paths().first().map(|p| p.to_string())
                else {
                    continue;
                };
                let container = db_client
                    .container_client(props.id.as_ref(), None)
                    .await
                    .map_err(QueueError::cosmos("open container"))?;
                removed += sweep_container(&container, &pk_path, default_ttl, now_secs).await?;
            }
        }
        Ok(removed)
    }

    /// Runs [`Self::sweep_ttl`] every `every` until `shutdown`.
    pub fn spawn_ttl_sweeper(
        self: &Arc<Self>,
        client: CosmosClient,
        every: Duration,
        shutdown: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let emulator = Arc::clone(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let now = cosmosq_queue::clock::system_now_ms() / 1000;
                match emulator.sweep_ttl(&client, now).await {
                    Ok(0) => {}
                    Ok(n) => debug!(removed = n, "TTL sweep removed expired items"),
                    Err(e) => warn!(error = %e, "TTL sweep failed"),
                }
            }
        })
    }

    /// A new account served on `127.0.0.1:port` (0: any free port) until `stop` is cancelled.
    /// The port is bound before the account is made, so its region URL is the served one.
    pub async fn serve_localhost(port: u16, options: EmulatorOptions) -> Result<Served> {
        let listener = TcpListener::bind(("127.0.0.1", port))
            .await
            .map_err(|e| QueueError::Config(format!("emulator port {port}: {e}")))?;
        let port = listener
            .local_addr()
            .map_err(|e| QueueError::Config(format!("emulator listener: {e}")))?
            .port();
        let endpoint = format!("http://127.0.0.1:{port}/");
        let emulator = Emulator::new(endpoint.parse().expect("a localhost URL"), options)?;
        let stop = CancellationToken::new();
        let task = tokio::spawn(Arc::clone(&emulator).serve(listener, stop.clone()));
        Ok(Served {
            emulator,
            endpoint,
            stop,
            task,
        })
    }

    /// Serves the account over HTTP until `shutdown`. The listener's address must be the
    /// endpoint's (the SDK talks to the region URL the account advertises).
    pub async fn serve(
        self: Arc<Self>,
        listener: TcpListener,
        shutdown: CancellationToken,
    ) -> Result<()> {
        let addr: SocketAddr = listener
            .local_addr()
            .map_err(|e| QueueError::Config(format!("emulator listener: {e}")))?;
        info!(%addr, endpoint = %self.endpoint, "emulator serving");
        let app = axum::Router::new().fallback(gateway).with_state(self);
        axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await
            .map_err(|e| QueueError::Config(format!("emulator server: {e}")))
    }
}

/// Whether an item written at `ts` (epoch s) with per-item `ttl` has expired at `now`.
pub fn is_expired(ts: i64, item_ttl: Option<i64>, default_ttl: Option<i64>, now: i64) -> bool {
    match item_ttl.or(default_ttl) {
        Some(ttl) if ttl >= 0 => ts + ttl <= now,
        _ => false, // -1 or no TTL: never
    }
}

async fn sweep_container(
    container: &azure_data_cosmos::ContainerClient,
    pk_path: &str,
    default_ttl: Option<i64>,
    now: i64,
) -> Result<usize> {
    // Every item's latest version, range by range, from the change feed.
    let field = pk_path.trim_start_matches('/');
    let mut items = Vec::new();
    let ranges = container
        .read_feed_ranges(None)
        .await
        .map_err(QueueError::cosmos("TTL sweep ranges"))?;
    for range in ranges {
        let mut pages = container
            .query_change_feed::<Value>(
                FeedScope::range(range),
                ChangeFeedStartFrom::Beginning,
                None,
            )
            .await
            .map_err(QueueError::cosmos("TTL sweep read"))?;
        while let Some(page) = pages.next().await {
            let page = page.map_err(QueueError::cosmos("TTL sweep read"))?;
            if page.items().is_empty() {
                break;
            }
            items.extend(page.items().iter().filter_map(|i| i.current().cloned()));
        }
    }
    let mut removed = 0;
    for item in items {
        let ts = item
            .get("_ts")
            .and_then(Value::as_i64)
            .unwrap_or(i64::MAX / 2);
        let ttl = item.get("ttl").and_then(Value::as_i64);
        if !is_expired(ts, ttl, default_ttl, now) {
            continue;
        }
        // Keys of every JSON type (other producers write numbers and booleans); an item
        // without the key property, or with one that is not a key, is not the queue's.
        let (Some(id), Some(key)) = (
            item.get("id").and_then(Value::as_str),
            item.get(field)
                .and_then(|k| cosmosq_queue::MessageKey::from_json(k.clone()).ok()),
        ) else {
            continue;
        };
        match container
            .delete_item(key.to_partition_key(), id, None)
            .await
        {
            Ok(_) => removed += 1,
            Err(e) if cosmosq_queue::error::status_of(&e) == cosmosq_queue::error::NOT_FOUND => {}
            Err(e) => return Err(QueueError::cosmos("TTL sweep delete")(e)),
        }
    }
    Ok(removed)
}

/// Translates one HTTP request into the emulator's transport call and back.
async fn gateway(
    axum::extract::State(emulator): axum::extract::State<Arc<Emulator>>,
    request: axum::extract::Request,
) -> axum::response::Response {
    match forward(&emulator, request).await {
        Ok(response) => response,
        Err(message) => {
            warn!(%message, "emulator gateway error");
            axum::response::Response::builder()
                .status(500)
                .body(axum::body::Body::from(message))
                .expect("static response")
        }
    }
}

async fn forward(
    emulator: &Emulator,
    request: axum::extract::Request,
) -> std::result::Result<axum::response::Response, String> {
    let (parts, body) = request.into_parts();
    let path = resource_path(parts.uri.path());
    let path_and_query = match parts.uri.query() {
        Some(query) => format!("{path}?{query}"),
        None => path.to_owned(),
    };
    let url = emulator
        .endpoint
        .join(&path_and_query)
        .map_err(|e| e.to_string())?;
    let method: Method = parts
        .method
        .as_str()
        .parse()
        .map_err(|_| format!("unsupported method {}", parts.method))?;
    let mut core = Request::new(url, method);
    for (name, value) in &parts.headers {
        if let Ok(value) = value.to_str() {
            core.insert_header(name.as_str().to_owned(), value.to_owned());
        }
    }
    let body = axum::body::to_bytes(body, 64 * 1024 * 1024)
        .await
        .map_err(|e| e.to_string())?;
    let is_create_container = parts.method == axum::http::Method::POST && path.ends_with("/colls");
    core.set_body(body.to_vec());
    let response = emulator
        .http
        .execute_request(&core)
        .await
        .map_err(|e| e.to_string())?;
    let raw = response
        .try_into_raw_response()
        .await
        .map_err(|e| e.to_string())?;
    let status = u16::from(raw.status());
    let bytes: Vec<u8> = raw.body().to_vec();
    if is_create_container && status == 201 {
        created_container(emulator, path, &bytes).await;
    }
    let mut builder = axum::response::Response::builder().status(status);
    for (name, value) in raw.headers().iter() {
        builder = builder.header(name.as_str(), value.as_str());
    }
    builder
        .body(axum::body::Body::from(bytes))
        .map_err(|e| e.to_string())
}

/// A request path as the SDK's emulator routes it. The Python, JavaScript, .NET and Java SDKs
/// end resource paths with a slash (`/dbs/d/colls/c/`), which the service ignores and the
/// emulator rejects; the Rust SDK does not.
fn resource_path(path: &str) -> &str {
    match path.trim_end_matches('/') {
        "" => "/",
        trimmed => trimmed,
    }
}

/// Applies the partition count to a container just created over HTTP.
async fn created_container(emulator: &Emulator, path: &str, body: &[u8]) {
    let database = path
        .trim_start_matches('/')
        .split('/')
        .nth(1)
        .unwrap_or_default()
        .to_owned();
    let Some(container) = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.get("id").and_then(Value::as_str).map(str::to_owned))
    else {
        return;
    };
    if let Err(e) = emulator.apply_partition_count(&database, &container).await {
        warn!(error = %e, "could not set the partition count");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resource_paths_lose_the_trailing_slash_other_sdks_send() {
        assert_eq!(resource_path("/dbs/d/colls/c/"), "/dbs/d/colls/c");
        assert_eq!(
            resource_path("/dbs/d/colls/c/docs/a/"),
            "/dbs/d/colls/c/docs/a"
        );
        assert_eq!(resource_path("/dbs"), "/dbs");
        assert_eq!(resource_path("/"), "/", "the account itself");
        assert_eq!(resource_path(""), "/");
    }

    #[test]
    fn ttl_rules_match_cosmos() {
        assert!(is_expired(100, None, Some(10), 110));
        assert!(!is_expired(100, None, Some(10), 109));
        assert!(is_expired(100, Some(5), Some(10), 105), "item ttl wins");
        assert!(
            !is_expired(100, Some(-1), Some(10), 1_000_000),
            "-1 never expires"
        );
        assert!(!is_expired(100, None, None, 1_000_000), "no default: never");
    }
}
