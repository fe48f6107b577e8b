//! The sampler: finds the queues (a [`Catalog`]: a database's, or the cluster's) and their
//! groups, reads each group's figures every few seconds, and keeps the latest snapshot and the
//! history the pages draw. Pages never wait on Cosmos DB for the overview: they read what the
//! last round found.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use azure_data_cosmos::CosmosClient;
use cosmosq_queue::clock::system_now_ms;
use cosmosq_queue::lease::LeaseStore;
use cosmosq_queue::{GroupConfig, MessageState, Queue, QueueConfig};
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt, TryStreamExt};
use serde::Serialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, instrument, warn};

use crate::access::Access;
use crate::history::{History, Sample};
use crate::ConsoleError;

/// Dead letters counted per group each round, and read at most by a list or an action:
/// beyond it the console says "at least" (an action on everything matching does the first
/// this many, and another click the next).
pub const DEAD_LETTER_COUNT_LIMIT: usize = 10_000;
/// Unsettled state documents read per group each round (locks, retries, schedules).
const UNSETTLED_LIMIT: usize = 1_000;
/// Groups read at once in a round.
const CONCURRENCY: usize = 8;
/// A lease not renewed for this long is up for grabs (the hosts' default).
const LEASE_EXPIRY_MS: i64 = cosmosq_queue::host::DEFAULT_LEASE_EXPIRE.as_millis() as i64;

/// What the console found in one round.
#[derive(Clone, Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    /// When the round ended (epoch ms); 0 before the first.
    pub at_ms: i64,
    pub queues: Vec<QueueView>,
    /// Why the queues could not be listed, if they could not.
    pub error: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct QueueView {
    pub name: String,
    /// The namespace whose readers may see it, on a console serving several tenants.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    pub groups: Vec<GroupView>,
    pub error: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupView {
    pub queue: String,
    pub name: String,
    pub backlog: u64,
    /// Messages not yet read, over the ranges whose lag is known.
    pub lag: u64,
    pub oldest_unsettled_at: Option<i64>,
    pub dead_letters: usize,
    pub locked: usize,
    pub retrying: usize,
    pub scheduled: usize,
    /// The unsettled documents read reached their limit: the three counts are lower bounds.
    pub capped: bool,
    pub ranges: Vec<RangeView>,
    pub error: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RangeView {
    pub min_epk: String,
    pub max_epk: String,
    pub owner: Option<String>,
    pub lag: Option<u64>,
    pub backlog: u64,
    /// The owner's last renewal or checkpoint (epoch ms).
    pub heartbeat_at: Option<i64>,
    pub checkpointed_at: Option<i64>,
    /// First deliveries the lease lists as started with no outcome recorded yet (on the lease
    /// write path; settled ones leave the list at the range's next checkpoint).
    pub started: usize,
    pub expired: bool,
}

impl Snapshot {
    pub fn group(&self, queue: &str, group: &str) -> Option<&GroupView> {
        self.queue(queue)?.groups.iter().find(|g| g.name == group)
    }

    pub fn queue(&self, queue: &str) -> Option<&QueueView> {
        self.queues.iter().find(|q| q.name == queue)
    }

    /// What a caller with `access` may see of it.
    pub fn visible(&self, access: &Access) -> Snapshot {
        Snapshot {
            at_ms: self.at_ms,
            queues: self
                .queues
                .iter()
                .filter(|q| access.may_read(q.namespace.as_deref()))
                .cloned()
                .collect(),
            error: self.error.clone(),
        }
    }

    /// The namespaces of its queues.
    pub fn namespaces(&self) -> BTreeSet<String> {
        self.queues
            .iter()
            .filter_map(|q| q.namespace.clone())
            .collect()
    }
}

/// A queue a catalog lists: its name in pages and URLs, and its namespace where the console
/// serves several tenants.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listed {
    pub name: String,
    pub namespace: Option<String>,
}

/// Where the console finds its queues and how it opens them.
pub trait Catalog: Send + Sync + 'static {
    /// The queues to show now.
    fn list(&self) -> BoxFuture<'_, Result<Vec<Listed>, ConsoleError>>;
    /// One of them, by the name [`Catalog::list`] gave it.
    fn open<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Queue, ConsoleError>>;
}

/// The queues of one database, on one account: the CLI's console.
pub struct Database {
    client: CosmosClient,
    database: String,
    /// The queues named on the command line; every queue of the database when empty.
    only: Vec<String>,
    opened: tokio::sync::Mutex<BTreeMap<String, Queue>>,
}

impl Database {
    pub fn new(client: CosmosClient, database: String, only: Vec<String>) -> Self {
        Self {
            client,
            database,
            only,
            opened: Default::default(),
        }
    }

    /// The queues: those named, or every container of the database with a lease container
    /// beside it (`<name>-leases`).
    async fn names(&self) -> Result<Vec<Listed>, ConsoleError> {
        let names = if self.only.is_empty() {
            let containers: Vec<String> = self
                .client
                .database_client(&self.database)
                .query_containers("SELECT * FROM root", None)
                .await
                .map_err(|e| ConsoleError::List(e.to_string()))?
                .map_ok(|c| c.id.to_string())
                .try_collect()
                .await
                .map_err(|e| ConsoleError::List(e.to_string()))?;
            queues_among(&containers)
        } else {
            self.only.clone()
        };
        Ok(names
            .into_iter()
            .map(|name| Listed {
                name,
                namespace: None,
            })
            .collect())
    }

    async fn opened(&self, name: &str) -> Result<Queue, ConsoleError> {
        if let Some(queue) = self.opened.lock().await.get(name) {
            return Ok(queue.clone());
        }
        let queue =
            Queue::open(&self.client, QueueConfig::new(self.database.clone(), name)).await?;
        self.opened
            .lock()
            .await
            .insert(name.to_owned(), queue.clone());
        Ok(queue)
    }
}

impl Catalog for Database {
    fn list(&self) -> BoxFuture<'_, Result<Vec<Listed>, ConsoleError>> {
        self.names().boxed()
    }

    fn open<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Queue, ConsoleError>> {
        self.opened(name).boxed()
    }
}

/// The queues the console looks at, their last round and their history.
pub struct Watch {
    catalog: Arc<dyn Catalog>,
    latest: watch::Sender<Arc<Snapshot>>,
    history: Mutex<History>,
}

impl Watch {
    pub fn new(catalog: Arc<dyn Catalog>, window: Duration) -> Self {
        Self {
            catalog,
            latest: watch::channel(Arc::new(Snapshot::default())).0,
            history: Mutex::new(History::new(window.as_millis() as i64)),
        }
    }

    pub fn latest(&self) -> Arc<Snapshot> {
        self.latest.borrow().clone()
    }

    pub fn subscribe(&self) -> watch::Receiver<Arc<Snapshot>> {
        self.latest.subscribe()
    }

    /// Reads the history under its lock.
    pub fn with_history<T>(&self, read: impl FnOnce(&History) -> T) -> T {
        read(&self.history.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// A queue by the name its catalog lists it under.
    pub async fn queue(&self, name: &str) -> Result<Queue, ConsoleError> {
        self.catalog.open(name).await
    }

    /// Rounds every `every` (from the end of one to the start of the next) until cancelled.
    pub async fn run(&self, every: Duration, cancel: CancellationToken) {
        loop {
            let snapshot = self.round().await;
            self.latest.send_replace(Arc::new(snapshot));
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(every) => {}
            }
        }
    }

    /// One round: every queue, every group.
    #[instrument(skip(self))]
    pub async fn round(&self) -> Snapshot {
        let listed = match self.catalog.list().await {
            Ok(listed) => listed,
            Err(e) => {
                warn!(error = %e, "could not list the queues");
                return Snapshot {
                    at_ms: system_now_ms(),
                    queues: vec![],
                    error: Some(e.to_string()),
                };
            }
        };
        let mut queues = Vec::new();
        for queue in listed {
            queues.push(self.queue_view(queue).await);
        }
        let at_ms = system_now_ms();
        let mut history = self.history.lock().unwrap_or_else(|e| e.into_inner());
        for group in queues.iter().flat_map(|q| &q.groups) {
            if group.error.is_none() {
                history.push(&group.queue, &group.name, sample(group, at_ms));
            }
        }
        history.forget_older_than(at_ms);
        Snapshot {
            at_ms,
            queues,
            error: None,
        }
    }

    async fn queue_view(&self, listed: Listed) -> QueueView {
        let name = listed.name.as_str();
        let groups = async {
            let queue = self.queue(name).await?;
            let names = queue.group_names().await?;
            Ok::<_, ConsoleError>((queue, names))
        };
        match groups.await {
            Ok((queue, names)) => {
                let mut groups: Vec<GroupView> = futures::stream::iter(names)
                    .map(|g| group_view(name, queue.clone(), g))
                    .buffer_unordered(CONCURRENCY)
                    .collect()
                    .await;
                groups.sort_by(|a, b| a.name.cmp(&b.name));
                QueueView {
                    name: name.to_owned(),
                    namespace: listed.namespace.clone(),
                    groups,
                    error: None,
                }
            }
            Err(e) => {
                warn!(queue = name, error = %e, "could not read the queue");
                QueueView {
                    name: name.to_owned(),
                    namespace: listed.namespace.clone(),
                    groups: vec![],
                    error: Some(e.to_string()),
                }
            }
        }
    }
}

/// Containers that are queues: those whose `<name>-leases` is there too.
pub fn queues_among(containers: &[String]) -> Vec<String> {
    let mut queues: Vec<String> = containers
        .iter()
        .filter(|c| containers.contains(&format!("{c}-leases")))
        .cloned()
        .collect();
    queues.sort();
    queues
}

fn sample(group: &GroupView, at_ms: i64) -> Sample {
    Sample {
        at_ms,
        backlog: group.backlog,
        locked: group.locked as u64,
        retrying: group.retrying as u64,
        dead_letters: group.dead_letters as u64,
    }
}

#[instrument(skip(queue))]
async fn group_view(listed_as: &str, queue: Queue, name: String) -> GroupView {
    let mut view = GroupView {
        queue: listed_as.to_owned(),
        name: name.clone(),
        ..GroupView::default()
    };
    if let Err(e) = read_group(&queue, &mut view).await {
        debug!(error = %e, "group not read");
        view.error = Some(e.to_string());
    }
    view
}

async fn read_group(queue: &Queue, view: &mut GroupView) -> Result<(), ConsoleError> {
    let group = queue.group(GroupConfig::new(view.name.clone()))?;
    let (leases, beats) = LeaseStore::new(queue.clone(), &view.name)
        .list_with_beats()
        .await?;
    let (estimate, dead_letters, unsettled) = tokio::try_join!(
        group.estimate_of(leases.clone()),
        group.count_dead_letters(DEAD_LETTER_COUNT_LIMIT),
        group.unsettled(UNSETTLED_LIMIT),
    )?;
    let now = system_now_ms();
    view.backlog = estimate.backlog();
    view.lag = estimate.lag();
    view.oldest_unsettled_at = estimate.oldest_unsettled_at();
    view.dead_letters = dead_letters;
    let count = |state| unsettled.iter().filter(|d| d.state == state).count();
    view.locked = count(MessageState::Locked);
    view.retrying = count(MessageState::Retry);
    view.scheduled = count(MessageState::Scheduled);
    view.capped = unsettled.len() >= UNSETTLED_LIMIT;
    view.ranges = estimate
        .ranges
        .into_iter()
        .map(|r| {
            let lease = leases
                .iter()
                .find(|l| l.min_epk == r.min_epk && l.max_epk == r.max_epk);
            RangeView {
                heartbeat_at: lease.map(|l| l.heartbeat(&beats)),
                checkpointed_at: lease.and_then(|l| l.checkpointed_at),
                started: lease.map_or(0, |l| l.window.started.len()),
                expired: lease.is_some_and(|l| {
                    l.owner.is_some() && l.is_expired(&beats, now, LEASE_EXPIRY_MS)
                }),
                min_epk: r.min_epk,
                max_epk: r.max_epk,
                owner: r.owner,
                lag: r.lag,
                backlog: r.backlog,
            }
        })
        .collect();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_is_a_container_with_its_lease_container() {
        let names = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            queues_among(&names(&[
                "orders",
                "orders-leases",
                "invoices-leases",
                "audit",
                "b",
                "b-leases"
            ])),
            names(&["b", "orders"])
        );
        assert!(queues_among(&names(&["x-leases-leases"])).is_empty());
    }
}
