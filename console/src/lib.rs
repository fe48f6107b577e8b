//! `cosmosq console`: a web console for queues — every queue and group with its backlog and a
//! sparkline, a group's live charts, ranges and work in progress, dead-letter triage (filter,
//! read, replay, purge), and a message's state in every group. The CLI serves the queues of
//! one database ([`watch::Database`]); the operator serves its cluster's, each request cut to
//! what its caller's Kubernetes RBAC allows (an [`access::Gate`]).
//!
//! Pages are rendered on the server from the sampler's last round ([`watch`]); a small script
//! updates them over server-sent events. Every asset is in the binary (it works air-gapped),
//! and the pages load no script or style from elsewhere (a strict Content-Security-Policy).
//! Actions are POSTs that carry the console's own token and are checked against the `Host`
//! and `Origin` headers, so a web page in the same browser cannot replay or purge through it.

pub mod access;
pub mod history;
mod pages;
mod server;
pub mod svg;
pub mod watch;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use azure_data_cosmos::CosmosClient;
use tokio_util::sync::CancellationToken;

pub use server::host_allowed;

/// The overview page as served, from a snapshot and its history: what the benchmark renders
/// with a full window of history, which a run of minutes cannot gather.
pub fn overview_html(snapshot: &Snapshot, history: &history::History, now_ms: i64) -> String {
    pages::overview(snapshot, history, now_ms).into_string()
}
pub use access::{Access, Gate, Refusal};
pub use watch::{Catalog, Database, Listed, Snapshot, Watch};

/// What the console can fail at.
#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    #[error(transparent)]
    Queue(#[from] cosmosq_queue::QueueError),
    #[error("could not list the database's containers: {0}")]
    List(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Forbidden(String),
    /// A queue of the catalog could not be opened (said without secrets).
    #[error("could not open the queue: {0}")]
    Open(String),
    #[error("could not serve the console on {address}: {source}")]
    Listen {
        address: SocketAddr,
        source: std::io::Error,
    },
}

/// How the console samples and what it accepts.
#[derive(Clone, Debug)]
pub struct ConsoleOptions {
    /// Time between the end of one sampling round and the start of the next.
    pub sample_every: Duration,
    /// How much history the charts show.
    pub window: Duration,
    /// Host names the console answers to besides localhost and the address it listens on
    /// (a name that resolves to it, behind a port-forward or a proxy).
    pub allowed_hosts: Vec<String>,
}

impl Default for ConsoleOptions {
    fn default() -> Self {
        Self {
            sample_every: Duration::from_secs(5),
            window: Duration::from_secs(3600),
            allowed_hosts: vec![],
        }
    }
}

/// A console bound to its address, ready to serve.
pub struct Console {
    listener: tokio::net::TcpListener,
    watch: Arc<Watch>,
    options: ConsoleOptions,
    gate: Option<Arc<dyn Gate>>,
}

impl Console {
    /// The queues of `database` (only `queues`, when any are named) on `client`'s account,
    /// on `address` (port 0 for any free port).
    pub async fn bind(
        client: CosmosClient,
        database: impl Into<String>,
        queues: Vec<String>,
        options: ConsoleOptions,
        address: SocketAddr,
    ) -> Result<Self, ConsoleError> {
        let catalog = Arc::new(Database::new(client, database.into(), queues));
        Self::bind_catalog(catalog, options, address).await
    }

    /// The queues `catalog` lists, on `address`.
    pub async fn bind_catalog(
        catalog: Arc<dyn Catalog>,
        options: ConsoleOptions,
        address: SocketAddr,
    ) -> Result<Self, ConsoleError> {
        let listener = tokio::net::TcpListener::bind(address)
            .await
            .map_err(|source| ConsoleError::Listen { address, source })?;
        let watch = Arc::new(Watch::new(catalog, options.window));
        Ok(Self {
            listener,
            watch,
            options,
            gate: None,
        })
    }

    /// Every request (but the sign-in page and the assets) must carry a token `gate` admits,
    /// and sees and does only what it allows.
    pub fn with_gate(mut self, gate: Arc<dyn Gate>) -> Self {
        self.gate = Some(gate);
        self
    }

    /// The address it serves on.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// Samples and serves until `cancel`.
    pub async fn run(self, cancel: CancellationToken) -> Result<(), ConsoleError> {
        let address = self.local_addr();
        let sampler = {
            let watch = self.watch.clone();
            let cancel = cancel.clone();
            let every = self.options.sample_every;
            tokio::spawn(async move { watch.run(every, cancel).await })
        };
        let app = server::router(
            self.watch,
            self.gate,
            &self.options,
            address,
            cancel.clone(),
        );
        let served = axum::serve(self.listener, app)
            .with_graceful_shutdown(cancel.cancelled_owned())
            .await
            .map_err(|source| ConsoleError::Listen { address, source });
        sampler.abort();
        served
    }
}
