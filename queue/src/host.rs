//! The change-feed lease loop: a host holds leases on feed ranges of the messages container,
//! reads each owned range from its checkpoint, hands messages to the handler through the
//! group's state machine, and checkpoints the lowest unsettled position.
//!
//! Several hosts of one group balance the leases between them (`balance::plan`); a host that
//! cannot renew a lease stops reading that range (fencing); a graceful stop drains, checkpoints
//! and releases its leases at once so others take them without waiting for expiry.
//!
//! Each process is its own lease holder (`<owner>#<incarnation>`): a sidecar restarted in its
//! pod does not take back at once what its previous life may still have in the app. Whether a
//! lease is expired is judged on this host's monotonic clock, from how long it has seen the
//! lease unchanged, never from another host's wall clock.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use azure_data_cosmos::FeedScope;
use tokio::sync::{mpsc, oneshot, watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::{AbortOnDropHandle, TaskTracker};
use tracing::{debug, info, instrument, warn};

use crate::balance::{self, LeaseView};
use crate::buggify::{self, Bug};
use crate::checkpoint::{Checkpoint, Completion, PageEnd, Settle};
use crate::clock::duration_ms;
use crate::config::DeliveryMode;
use crate::consumer::{AdaptivePoll, ConsumerStats, Handler, LockedUntil};
use crate::cosmos::feed::FeedReader;
use crate::delivery::{Deliverer, Fate, LeaseLock, Path, Permit, Promotion, Watch};
use crate::error::{QueueError, Result};
use crate::group::Group;
use crate::lease::{Lease, LeaseError, LeaseStore, Marker};
use crate::message::{Message, MessageKey};
use crate::recovery::{Handling, Inherited};

/// How a [`Host`] runs: its identity, concurrency, polling and lease timings.
#[derive(Clone, Debug)]
pub struct HostOptions {
    /// This host's name: the pod's. With [`Self::incarnation`] it names the holder of its
    /// leases and locks.
    pub owner: String,
    /// This process among the lives of `owner` (a container restarted in its pod is a new
    /// one): random by default.
    pub incarnation: String,
    /// Deliveries in flight on this host at most.
    pub max_concurrency: usize,
    /// Messages read but not yet settled per range at most; reading a range pauses at this
    /// many, and its checkpoint never passes the oldest of them.
    pub max_in_flight_per_range: usize,
    /// Items per change-feed page.
    pub page_size: u32,
    /// The shortest wait between reads of a range.
    pub min_poll: Duration,
    /// The longest wait between reads of an empty range.
    pub max_poll: Duration,
    /// Look for expired locks and due retries this often.
    pub sweep_interval: Duration,
    /// Change feed processor defaults: renew 17 s, acquire 13 s, expire 60 s.
    pub lease_renew: Duration,
    /// How often free and expired leases are looked for.
    pub lease_acquire: Duration,
    /// How long a lease another host holds must stay unchanged before this one takes it.
    pub lease_expire: Duration,
    /// Write a moved checkpoint at most this often.
    pub checkpoint_interval: Duration,
    /// Leases per physical partition when the group's leases are first created (finer
    /// leases: more hosts than physical partitions can share the work).
    pub leases_per_partition: u32,
    /// Exclusive groups: a delivery still under way after this long stops holding its range
    /// (its page may pass it); on the lease write path it first gets a lock of its own (a
    /// state document), so that it does not depend on the range's lease either.
    pub promote_after: Duration,
}

impl HostOptions {
    /// Options with the change feed processor's defaults, as `owner`.
    pub fn new(owner: impl Into<String>) -> Self {
        Self {
            owner: owner.into(),
            incarnation: crate::state::new_lock_token()[..8].to_owned(),
            max_concurrency: 64,
            max_in_flight_per_range: 256,
            page_size: 100,
            min_poll: Duration::from_millis(20),
            max_poll: Duration::from_secs(5),
            sweep_interval: Duration::from_secs(5),
            lease_renew: Duration::from_secs(17),
            lease_acquire: Duration::from_secs(13),
            lease_expire: DEFAULT_LEASE_EXPIRE,
            checkpoint_interval: Duration::from_secs(1),
            leases_per_partition: 1,
            promote_after: Duration::from_secs(5),
        }
    }

    /// What this process writes as the owner of its leases and locks: `<owner>#<incarnation>`.
    pub fn holder(&self) -> String {
        format!("{}#{}", self.owner, self.incarnation)
    }

    /// Refuses timings under which leases could not be kept (renewal slower than expiry, …).
    pub fn validate(&self) -> Result<()> {
        if self.lease_renew >= self.lease_expire {
            return Err(QueueError::Config(
                "leaseRenew must be shorter than leaseExpire".into(),
            ));
        }
        if !(1..=64).contains(&self.leases_per_partition) {
            return Err(QueueError::Config(
                "leasesPerPartition must be between 1 and 64".into(),
            ));
        }
        if self.max_concurrency == 0 || self.max_in_flight_per_range == 0 || self.page_size == 0 {
            return Err(QueueError::Config(
                "maxConcurrency, maxInFlightPerRange and pageSize must be at least 1".into(),
            ));
        }
        if self.owner.contains('#') || self.incarnation.contains('#') {
            return Err(QueueError::Config(
                "a host's owner and incarnation cannot hold '#'".into(),
            ));
        }
        Ok(())
    }
}

/// Reads of a lease before a stream page is handed out, when reads keep failing.
const LEASE_READ_TRIES: u32 = 4;

/// Releases tried when each one loses to another host's hand-over request: every host asks
/// once per acquire round, so a few hosts asking at once must not leave the lease in this
/// host's name until it expires (the race test asks without pause).
const RELEASE_TRIES: u32 = 32;

/// Keys remembered for FIFO ordering before settled ones are forgotten.
const MAX_IDLE_CHAINS: usize = 4096;

/// Back-off before a range delivers again a message nothing could be recorded for.
const UNRECORDED_AGAIN: crate::backoff::RetryPolicy = crate::backoff::RetryPolicy {
    max_delivery_attempts: u32::MAX,
    initial_backoff: Duration::from_secs(1),
    max_backoff: Duration::from_secs(60),
    multiplier: 2.0,
    jitter: 0.2,
};

/// The pause before a lease write refused on an ETag is tried again on the lease as it now is
/// (it is still this host's: asked for, or changed by an earlier write whose answer was lost).
const LOST_AGAIN: Duration = Duration::from_millis(50);

/// The shortest pause between looks at the leases while another host's short lock is watched.
const MIN_WATCH: Duration = Duration::from_millis(100);

/// How a range processor ended.
#[derive(Debug)]
enum RangeExit {
    Released,
    Lost,
    Failed(QueueError),
}

/// A range processor this host runs. Dropping it aborts the processor and, with it, every
/// delivery task it spawned: a host that dies takes all its work down with it.
struct Running {
    stop: CancellationToken,
    task: AbortOnDropHandle<RangeExit>,
    /// The lease's EPK range: this host sweeps the state of the messages in it.
    range: (String, String),
}

/// When this host first saw each lease's last write by its owner (its owner and the time
/// the owner wrote). A lease held by another host is expired once this host has seen that
/// write as the last for its expiry, on this host's monotonic clock: another host's wall
/// clock says nothing here (one 45 s ahead would see every live lease as expired), as in
/// Kubernetes' leader election. Writes by others (a hand-over request) are no sign of the
/// owner's life and do not restart the count.
#[derive(Debug, Default)]
struct Observed(BTreeMap<String, (OwnerWrite, Instant)>);

/// A lease's last write by its owner.
type OwnerWrite = (Option<String>, i64);

fn owner_write(lease: &Lease) -> OwnerWrite {
    (lease.owner.clone(), lease.timestamp)
}

impl Observed {
    /// Notes the leases as read now; forgets those that are gone.
    fn see(&mut self, leases: &[Lease], now: Instant) {
        self.0.retain(|id, _| leases.iter().any(|l| &l.id == id));
        for lease in leases {
            let write = owner_write(lease);
            match self.0.get(&lease.id) {
                Some((seen, _)) if *seen == write => {}
                _ => {
                    self.0.insert(lease.id.clone(), (write, now));
                }
            }
        }
    }

    /// How long this host has seen `lease`'s owner's last write as the last.
    fn unchanged_for(&self, lease: &Lease, now: Instant) -> Duration {
        match self.0.get(&lease.id) {
            Some((seen, since)) if *seen == owner_write(lease) => now - *since,
            _ => Duration::ZERO,
        }
    }
}

/// Deliveries that outlive their range (long work under a lock of its own, settles that keep
/// trying until their lock expires), owned by the host: they go on after the range ends, and
/// end with the host — a host dropped (its process killed) leaves nothing running.
#[derive(Clone, Default)]
struct Leftovers(Arc<std::sync::Mutex<JoinSet<()>>>);

impl Leftovers {
    /// Takes over a range's deliveries.
    fn adopt(&self, deliveries: &mut JoinSet<()>) {
        let mut orphans = std::mem::take(deliveries);
        if orphans.is_empty() {
            return;
        }
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        while all.try_join_next().is_some() {}
        all.spawn(async move { while orphans.join_next().await.is_some() {} });
    }
}

/// One consumer host of a group.
pub struct Host<H> {
    group: Group,
    store: LeaseStore,
    handler: Arc<H>,
    options: HostOptions,
    stats: Arc<ConsumerStats>,
    leftovers: Leftovers,
}

impl<H: Handler> Host<H> {
    /// Whether leases move by hand-over rather than theft: wherever the lease alone fences
    /// first deliveries, a theft would deliver again what the owner has under way.
    fn hands_over(&self) -> bool {
        self.group.config().lease_fenced()
    }

    /// A host of `group` handing messages to `handler`.
    pub fn new(group: Group, handler: H, options: HostOptions) -> Self {
        let store = LeaseStore::new(group.queue().clone(), group.name())
            .with_start_from(group.config().start_from);
        let store = match group.config().mode {
            DeliveryMode::Exclusive => store.with_writes(group.config().exclusive_writes),
            DeliveryMode::Stream => store,
        };
        Self {
            group,
            store,
            handler: Arc::new(handler),
            options,
            stats: Arc::default(),
            leftovers: Leftovers::default(),
        }
    }

    /// Its counters, live.
    pub fn stats(&self) -> Arc<ConsumerStats> {
        Arc::clone(&self.stats)
    }

    fn deliverer(&self) -> Arc<Deliverer<H>> {
        Arc::new(Deliverer {
            group: self.group.clone(),
            handler: Arc::clone(&self.handler),
            owner: self.options.holder(),
            stats: Arc::clone(&self.stats),
        })
    }

    fn now(&self) -> i64 {
        self.group.queue().clock().now_ms()
    }

    /// Runs until `shutdown`; then stops reading, lets deliveries in flight settle,
    /// checkpoints and releases every lease.
    pub async fn run(self, shutdown: CancellationToken) -> Result<()> {
        self.options.validate()?;
        let permits = Arc::new(Semaphore::new(self.options.max_concurrency));
        let deliverer = self.deliverer();
        let mut owned: BTreeMap<String, Running> = BTreeMap::new();
        let mut observed = Observed::default();
        let mut sweeps = JoinSet::new();
        let tracker = TaskTracker::new();
        let mut acquire_at = Instant::now();
        let mut sweep = tokio::time::interval(self.options.sweep_interval);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            while sweeps.try_join_next().is_some() {}
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep_until(acquire_at) => {
                    let round = self
                        .balance_round(&mut owned, &mut observed, &permits, &deliverer, &tracker)
                        .await;
                    let every = match round {
                        Ok(watch) => watch.unwrap_or(self.options.lease_acquire),
                        Err(e) => {
                            ConsumerStats::bump(&self.stats.errors);
                            warn!(group = self.group.name(), host = %self.options.holder(), error = %e, "lease round failed; trying again next interval");
                            self.options.lease_acquire
                        }
                    };
                    acquire_at = Instant::now() + every.min(self.options.lease_acquire);
                }
                _ = sweep.tick() => {
                    let ranges: Vec<_> = owned.values().map(|r| r.range.clone()).collect();
                    self.sweep(&ranges, &permits, &deliverer, &mut sweeps).await
                }
            }
        }
        info!(group = self.group.name(), host = %self.options.holder(), leases = owned.len(), "stopping: draining and releasing leases");
        for running in owned.values() {
            running.stop.cancel();
        }
        for (_, running) in owned {
            let _ = running.task.await;
        }
        while sweeps.join_next().await.is_some() {}
        tracker.close();
        if !tracker.is_empty() {
            info!(group = self.group.name(), host = %self.options.holder(), deliveries = tracker.len(), "waiting for deliveries of lost ranges to settle");
        }
        tracker.wait().await;
        self.stats
            .leases_owned
            .store(0, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// How long `lease` must be seen unchanged before it is expired, as this host judges it.
    fn expiry_of(&self, lease: &Lease) -> Duration {
        let expire = duration_ms(self.options.lease_expire);
        Duration::from_millis(lease.unchanged_expiry_ms(expire).max(0) as u64)
    }

    /// Whether another host may take `lease` now without its owner handing it over: it is
    /// free, or this host has seen it unchanged for its expiry, or it is a previous life of
    /// this very host whose window holds nothing that may still be in the app.
    fn takeable(&self, lease: &Lease, observed: &Observed, now: Instant) -> bool {
        let Some(owner) = &lease.owner else {
            return true;
        };
        let holder = self.options.holder();
        let mine = owner
            .split_once('#')
            .map_or(owner.as_str(), |(name, _)| name)
            == self.options.owner;
        if mine && *owner != holder {
            if buggify::on(Bug::RestartRetakesLease) {
                return true; // the defect: the pod name was the owner
            }
            // This process restarted: its previous life is gone (a container runs once at a
            // time), so only what it may have started, which the app may still hold, waits
            // for the lock to run out.
            if !lease.window.may_be_in_app() {
                return true;
            }
        }
        observed.unchanged_for(lease, now) >= self.expiry_of(lease)
    }

    /// One acquire round: reap ended ranges, create/split leases, take what balance needs.
    /// Returns how soon to look again when another host's lease is watched for a short lock
    /// (its started deliveries come back within the lock duration, not the lease expiry).
    async fn balance_round(
        &self,
        owned: &mut BTreeMap<String, Running>,
        observed: &mut Observed,
        permits: &Arc<Semaphore>,
        deliverer: &Arc<Deliverer<H>>,
        tracker: &TaskTracker,
    ) -> Result<Option<Duration>> {
        let ended: Vec<String> = owned
            .iter()
            .filter(|(_, r)| r.task.is_finished())
            .map(|(id, _)| id.clone())
            .collect();
        for id in ended {
            if let Some(running) = owned.remove(&id) {
                let exit = running.task.await;
                if matches!(exit, Ok(RangeExit::Lost)) {
                    ConsumerStats::bump(&self.stats.leases_lost);
                }
                match exit {
                    Ok(RangeExit::Failed(e)) => {
                        warn!(group = self.group.name(), lease = %id, error = %e, "range processor failed")
                    }
                    Ok(exit) => {
                        debug!(group = self.group.name(), lease = %id, ?exit, "range processor ended")
                    }
                    Err(e) => {
                        warn!(group = self.group.name(), lease = %id, error = %e, "range processor panicked")
                    }
                }
            }
        }
        let now = self.now();
        let seen_at = Instant::now();
        let expire = duration_ms(self.options.lease_expire);
        // Splits are judged as takes are, by what this host observed before this round (a
        // lease that changed since is not expired).
        let reconciled = self
            .store
            .reconcile_judged(now, self.options.leases_per_partition, |l| {
                !owned.contains_key(&l.id) && self.takeable(l, observed, seen_at)
            })
            .await?;
        observed.see(&reconciled.leases, seen_at);
        for id in &reconciled.split_pending {
            if let Some(running) = owned.get(id) {
                info!(group = self.group.name(), lease = %id, "range split: handing the lease back so it can be split");
                running.stop.cancel();
            }
        }
        let me = self.options.holder();
        let views: Vec<LeaseView> = reconciled
            .leases
            .iter()
            .map(|l| LeaseView {
                id: l.id.clone(),
                owner: l.owner.clone(),
                expired: !owned.contains_key(&l.id) && self.takeable(l, observed, seen_at),
            })
            .collect();
        for take in balance::plan(&views, &me) {
            if owned.contains_key(&take.lease_id)
                || reconciled.split_pending.contains(&take.lease_id)
            {
                continue;
            }
            let Some(lease) = reconciled.leases.iter().find(|l| l.id == take.lease_id) else {
                continue;
            };
            // Being handed over to the host that asked for it — unless its owner is gone
            // (expired by what this host has seen): whoever saw that first recovers it.
            if lease.reserved_for_other(&me, now, expire)
                && (lease.owner.is_none() || !self.takeable(lease, observed, seen_at))
            {
                continue;
            }
            // Where the lease fences first deliveries (stream groups, and exclusive ones on the
            // lease write path), a live owner is asked to hand the lease over rather than have
            // it stolen: a steal makes the new owner deliver again what the owner has under
            // way. It is taken without a hand-over only once it expired.
            if let (Some(victim), true) = (&take.steal_from, self.hands_over()) {
                if lease.handover_to.as_deref() != Some(me.as_str()) {
                    match self.store.request_handover(lease, &me, now).await {
                        Ok(_) => {
                            info!(group = self.group.name(), lease = %lease.range_label(), owner = %victim, to = %me, "asked for the lease for balance");
                            crate::ledger::lease_asked(self.group.name(), &lease.id, victim, &me);
                        }
                        Err(LeaseError::Lost) => {}
                        Err(LeaseError::Other(e)) => return Err(e),
                    }
                    continue;
                }
                let timed_out = lease.handover_at.is_some_and(|at| now - at >= expire);
                if !(buggify::on(Bug::StartUnderExpiredLease) && timed_out) {
                    continue; // asked; the owner drains, or its lease expires
                }
                warn!(group = self.group.name(), lease = %lease.range_label(), owner = %victim, "the owner did not hand the lease over in time; taking it");
            }
            match self.store.acquire(lease, &me, now).await {
                Ok(lease) => {
                    match &take.steal_from {
                        Some(victim) => {
                            info!(group = self.group.name(), lease = %lease.range_label(), owner = %me, from = %victim, "lease stolen for balance")
                        }
                        None => {
                            info!(group = self.group.name(), lease = %lease.range_label(), owner = %me, previous = ?take_previous(&reconciled.leases, &lease.id), "lease acquired")
                        }
                    }
                    let stop = CancellationToken::new();
                    let processor = RangeProcessor {
                        store: self.store.clone(),
                        group: self.group.clone(),
                        deliverer: Arc::clone(deliverer),
                        permits: Arc::clone(permits),
                        options: self.options.clone(),
                        stats: Arc::clone(&self.stats),
                        deliveries: tracker.clone(),
                        leftovers: self.leftovers.clone(),
                    };
                    let id = lease.id.clone();
                    let range = (lease.min_epk.clone(), lease.max_epk.clone());
                    let sent = Instant::now();
                    let task = AbortOnDropHandle::new(tokio::spawn(processor.run(
                        lease,
                        sent,
                        stop.clone(),
                    )));
                    owned.insert(id, Running { stop, task, range });
                    ConsumerStats::bump(&self.stats.leases_acquired);
                }
                Err(LeaseError::Lost) => {
                    debug!(group = self.group.name(), lease = %take.lease_id, "another host took the lease first")
                }
                Err(LeaseError::Other(e)) => return Err(e),
            }
        }
        self.stats
            .leases_owned
            .store(owned.len() as u64, std::sync::atomic::Ordering::Relaxed);
        // Another host's lease that holds started deliveries under a lock shorter than the
        // lease expiry is looked at again within half that lock, so that if its owner died its
        // deliveries come back within the lock duration (plus this look), as claims' do.
        let watch = reconciled
            .leases
            .iter()
            .filter(|l| l.owner.is_some() && !owned.contains_key(&l.id))
            .map(|l| self.expiry_of(l))
            .filter(|d| *d < self.options.lease_expire)
            .min()
            .map(|d| (d / 2).max(MIN_WATCH));
        Ok(watch)
    }

    /// Delivers the due retries, schedules and expired locks of the ranges this host owns
    /// (a host without leases has nothing to sweep; another host owns every range).
    async fn sweep(
        &self,
        ranges: &[(String, String)],
        permits: &Arc<Semaphore>,
        deliverer: &Arc<Deliverer<H>>,
        sweeps: &mut JoinSet<()>,
    ) {
        if ranges.is_empty() {
            return;
        }
        let limit = self
            .options
            .max_concurrency
            .saturating_sub(sweeps.len())
            .max(1);
        match self.group.due(limit, Some(ranges)).await {
            Ok(docs) => {
                if !docs.is_empty() {
                    debug!(group = self.group.name(), due = docs.len(), "sweep");
                }
                for doc in docs {
                    let deliverer = Arc::clone(deliverer);
                    let permits = Arc::clone(permits);
                    sweeps.spawn(async move {
                        let mut permit = Permit::acquire(permits).await;
                        deliverer.process_due(doc, &mut permit).await;
                    });
                }
            }
            Err(e) => {
                ConsumerStats::bump(&self.stats.errors);
                warn!(group = self.group.name(), error = %e, "sweep failed; trying again next interval");
            }
        }
    }
}

/// Who held `id` before (for the log).
fn take_previous(leases: &[Lease], id: &str) -> Option<String> {
    leases
        .iter()
        .find(|l| l.id == id)
        .and_then(|l| l.owner.clone())
}

/// The lease expiry hosts use unless told otherwise (the change feed processor's 60 s); also
/// what tools that create or judge leases from outside a host assume.
pub const DEFAULT_LEASE_EXPIRE: Duration = Duration::from_secs(60);

/// Reads one leased range and keeps its lease: renewals, checkpoints, release.
struct RangeProcessor<H> {
    store: LeaseStore,
    group: Group,
    deliverer: Arc<Deliverer<H>>,
    permits: Arc<Semaphore>,
    options: HostOptions,
    stats: Arc<ConsumerStats>,
    /// Every delivery, including those a lost range leaves to finish under their own claims:
    /// the host waits for them before it returns, or the process would exit mid-settle.
    deliveries: TaskTracker,
    /// Where those go when the range ends.
    leftovers: Leftovers,
}

/// What a message of an ordered group tells the next message of its key: its id and where it
/// stands — `None` while it is under way, `Pending` once its own state document holds it (its
/// long work got a lock of its own, it was parked, it waits for a retry), then its fate.
type KeyState = Option<(String, Fate)>;

/// When a delivery may start.
enum Turn {
    /// Ordered groups: after the previous message of the key has settled (`previous`, in
    /// this range) and after the messages `waits_for` of the key that the range's previous
    /// owner left unsettled behind the checkpoint.
    Key {
        previous: Option<watch::Receiver<KeyState>>,
        waits_for: Vec<String>,
    },
    /// Unordered groups: permits are taken in feed order.
    Feed {
        previous: Option<oneshot::Receiver<()>>,
        next: Option<oneshot::Sender<()>>,
    },
}

/// A range's stop signals, as its deliveries see them.
#[derive(Clone)]
struct Stops {
    /// The range is lost: deliveries waiting for a permit step aside (unrecorded, so the
    /// checkpoint stays before them and the next owner reads them).
    step_aside: CancellationToken,
    /// The range drains or is handed over: the same, except in stream groups within a page
    /// that has started (the checkpoint moves by whole pages and no window lists what
    /// settled, so a page half done would be delivered again by the next owner). The drain
    /// then takes at most about a page.
    draining: CancellationToken,
    /// The range is lost or drains: deliveries stop retrying failed writes, and what they
    /// could not record holds the checkpoint.
    give_up: CancellationToken,
    /// The range drains or is handed over: long work stops holding it at once (see
    /// [`Promotion`]), so the drain does not wait for it.
    promote_now: CancellationToken,
}

/// A delivery's report to its range.
struct Report {
    seq: u64,
    identity: String,
    id: String,
    key: MessageKey,
    /// The message's enqueue time and expiry, should its completion need a state document.
    enqueued_at: i64,
    expires_at: Option<i64>,
    fate: Fate,
    /// Whether the app may have had it: what nothing could be recorded for is a redelivery
    /// for the range's next reader then, a first delivery otherwise.
    reached: bool,
}

/// A delivery asks its range to start (the lease write path). Its start is listed on the
/// lease with the range's next write (see [`crate::lease::Window::starts_lag`]); it is
/// written first where a next owner must know of it: a message the previous owner may have
/// started unlisted (else its count could repeat forever), and an ordered key's next message
/// while completions wait for a write (else a next owner would deliver its predecessor again
/// after it started).
struct StartRequest {
    seq: u64,
    identity: String,
    /// The previous owner may have started it without listing it: its start is written
    /// before it starts.
    unsure: bool,
    /// It follows a message of its key that this range delivered: its start is written first
    /// while completions wait for a write.
    follows: bool,
    reply: oneshot::Sender<bool>,
}

/// Where a delivery of the lease write path asks to start.
struct StartAsk {
    seq: u64,
    identity: String,
    /// The previous owner may have started it without listing it.
    unsure: bool,
    requests: mpsc::UnboundedSender<StartRequest>,
}

/// How a waiting ordered message goes on.
enum Wait {
    /// Its turn came.
    Go,
    /// Its turn came after waiting on its predecessors' state documents.
    GoChecked,
    /// Its predecessors `0` hold their own state: it waits behind them in a state of its own
    /// (parked), and holds its range no more.
    Park(Vec<String>),
    /// The range stopped first: never started.
    Stop,
}

/// One message of a range on its way to the handler.
struct RangeDelivery<H> {
    deliverer: Arc<Deliverer<H>>,
    permits: Arc<Semaphore>,
    stop: Stops,
    /// Set once a delivery of its page started. `None` where a window lists each message's
    /// fate (exclusive groups): a drained range lists what never started, and its next owner
    /// delivers just those, so nothing waits for a permit once the range drains.
    page_started: Option<Arc<AtomicBool>>,
    /// How the message is claimed. [`Path::Checked`] in an ordered stream group's first window
    /// read after taking a range: its previous owner may have left messages there that it was
    /// retrying in place (it died), that wait for their schedule, or that it settled in a page
    /// it could not checkpoint whole (it drained or handed the range over while a message of
    /// that page waited): those are waited for, or skipped, not delivered past. One point read
    /// per message of that window; none after it, none in other groups. Exclusive groups
    /// learn the same from the lease's window ([`Inherited`]).
    path: Path,
    /// Exclusive groups: when long work stops holding the range.
    promotion: Option<Promotion>,
    /// The lease write path: the lease as the lock of a first delivery.
    lease: Option<LeaseLock>,
    /// The lease write path: where the delivery asks to start.
    start: Option<StartAsk>,
    locked_until: LockedUntil,
    /// Set once the app may have had the message (see [`Watch::reached`]).
    reached: Arc<AtomicBool>,
}

impl<H: Handler> RangeDelivery<H> {
    async fn run(mut self, message: Message, turn: Turn) -> Fate {
        match turn {
            Turn::Key {
                previous,
                waits_for,
            } => {
                let follows = previous.is_some();
                match self
                    .after_previous_of_key(&message, previous, waits_for)
                    .await
                {
                    Wait::Go => self.start_when_granted(message, follows).await,
                    Wait::GoChecked => {
                        // It waited on its predecessors' state: a state of its own may exist
                        // too (its schedule, or a park whose answer was lost).
                        self.path = Path::Checked;
                        self.start_when_granted(message, follows).await
                    }
                    Wait::Park(ids) => self.park(message, ids).await,
                    Wait::Stop => Fate::Unstarted,
                }
            }
            Turn::Feed { previous, next } => {
                if let Some(previous) = previous {
                    let _ = previous.await;
                }
                self.deliver(message, next, None).await
            }
        }
    }

    /// Waits until the key's previous messages are settled: the one before it in this range,
    /// and those the previous owner left unsettled. One whose predecessors hold their own
    /// state (long work, a retry, parked) parks itself after `promoteAfter`, or at once when
    /// the range drains: the range need not hold it.
    async fn after_previous_of_key(
        &self,
        message: &Message,
        previous: Option<watch::Receiver<KeyState>>,
        mut waits_for: Vec<String>,
    ) -> Wait {
        let began = Instant::now();
        if let Some(mut previous) = previous {
            loop {
                let state = previous.borrow_and_update().clone();
                match state {
                    Some((_, Fate::Settled | Fate::Completed)) => break,
                    Some((id, Fate::Pending)) => {
                        waits_for.push(id);
                        break;
                    }
                    Some((_, Fate::Unrecorded | Fate::Unstarted)) => return Wait::Stop,
                    None => {}
                }
                tokio::select! {
                    biased;
                    _ = self.stop.step_aside.cancelled() => return Wait::Stop,
                    _ = self.stop.draining.cancelled() => return Wait::Stop,
                    changed = previous.changed() => {
                        if changed.is_err() {
                            return Wait::Stop; // its task ended without a word: the range stops
                        }
                    }
                }
            }
        }
        waits_for.retain(|id| *id != message.id);
        if waits_for.is_empty() {
            return Wait::Go;
        }
        debug!(message_id = %message.id, ?waits_for, "waiting for the earlier messages of its key");
        let promote_after = self.promotion.as_ref().map(|p| p.after);
        let park = {
            let settled = self
                .deliverer
                .all_settled(&message.partition_key, &waits_for);
            tokio::pin!(settled);
            tokio::select! {
                biased;
                _ = self.stop.step_aside.cancelled() => return Wait::Stop,
                _ = &mut settled => return Wait::GoChecked,
                _ = self.stop.promote_now.cancelled(), if promote_after.is_some() => true,
                _ = async {
                    match promote_after {
                        Some(after) => tokio::time::sleep_until(began + after).await,
                        None => std::future::pending().await,
                    }
                } => true,
                // Groups without promotion wait in place; a drain leaves the message unstarted.
                _ = self.stop.draining.cancelled(), if promote_after.is_none() => false,
            }
        };
        match park {
            true => Wait::Park(waits_for),
            false => Wait::Stop,
        }
    }

    /// Parks `message` behind its key's predecessors `ids`; where it cannot (a state document
    /// of its own exists, or the write failed), it waits here and then starts.
    async fn park(mut self, message: Message, ids: Vec<String>) -> Fate {
        match self.deliverer.group.park(&message, ids.clone()).await {
            Ok(true) => {
                debug!(message_id = %message.id, waits_for = ?ids, "parked behind the earlier messages of its key");
                Fate::Pending
            }
            parked => {
                debug!(message_id = %message.id, ?parked, "not parked: waiting in place");
                tokio::select! {
                    biased;
                    _ = self.stop.step_aside.cancelled() => return Fate::Unstarted,
                    _ = self.stop.draining.cancelled() => return Fate::Unstarted,
                    _ = self.deliverer.all_settled(&message.partition_key, &ids) => {}
                }
                self.path = Path::Checked;
                self.start_when_granted(message, false).await
            }
        }
    }

    /// Takes a permit and, on the lease write path, asks to start; then delivers.
    async fn start_when_granted(self, message: Message, follows: bool) -> Fate {
        let permit = tokio::select! {
            biased;
            _ = self.stop.step_aside.cancelled() => return Fate::Unstarted,
            _ = self.stop.draining.cancelled() => return Fate::Unstarted,
            permit = Arc::clone(&self.permits).acquire_owned() => permit.expect("never closed"),
        };
        if !self.granted(follows).await {
            return Fate::Unstarted;
        }
        self.deliver(message, None, Some(permit)).await
    }

    /// On the lease write path, asks the range to start this delivery (see [`StartRequest`]):
    /// `false` when it may not (the lease is not surely the range's, or a write it needed
    /// first did not land).
    async fn granted(&self, follows: bool) -> bool {
        let Some(ask) = &self.start else {
            return true;
        };
        let (reply, granted) = oneshot::channel();
        let request = StartRequest {
            seq: ask.seq,
            identity: ask.identity.clone(),
            unsure: ask.unsure,
            follows,
            reply,
        };
        ask.requests.send(request).is_ok() && granted.await == Ok(true)
    }

    async fn deliver(
        self,
        message: Message,
        turn_done: Option<oneshot::Sender<()>>,
        permit: Option<OwnedSemaphorePermit>,
    ) -> Fate {
        let permit = match permit {
            Some(permit) => permit,
            None => {
                let mut stay = false;
                let permit = loop {
                    tokio::select! {
                        biased;
                        _ = self.stop.step_aside.cancelled() => return Fate::Unstarted,
                        _ = self.stop.draining.cancelled(), if !stay => {
                            stay = self
                                .page_started
                                .as_ref()
                                .is_some_and(|started| started.load(Ordering::SeqCst));
                            if !stay {
                                return Fate::Unstarted;
                            }
                        }
                        permit = Arc::clone(&self.permits).acquire_owned() => break permit.expect("never closed"),
                    }
                };
                // Listed unstarted with its page: it asks to start.
                if !self.granted(false).await {
                    return Fate::Unstarted;
                }
                permit
            }
        };
        // The lease is a lock only while it is live: nothing starts under one whose last
        // write is older than the expiry others judge it by (minus a margin).
        if let Some(lease) = &self.lease {
            let held = *lease.held.borrow();
            if Instant::now() >= held && !buggify::on(Bug::StartUnderExpiredLease) {
                debug!(message_id = %message.id, "not started: the range's lease was not renewed in time");
                return Fate::Unstarted;
            }
        }
        if let Some(started) = &self.page_started {
            started.store(true, Ordering::SeqCst);
        }
        drop(turn_done);
        let mut permit = Permit::held(Arc::clone(&self.permits), permit);
        let reached = Arc::clone(&self.reached);
        let watch = Watch::new(
            self.promotion,
            self.lease,
            self.locked_until.clone(),
            Arc::clone(&reached),
        );
        // Boxed: a range reads up to `max_in_flight_per_range` ahead, and each waiting task
        // would otherwise be as large as a delivery in progress (its HTTP and SDK futures,
        // ≈ 14 KB): 14 MiB for 1,024 waiting messages where 64 are processed.
        let first_path = self.path;
        let mut fate = Box::pin(self.deliverer.process(
            message.clone(),
            &self.stop.give_up,
            &mut permit,
            first_path,
            watch,
        ))
        .await;
        // Nothing could be recorded (Cosmos DB refused it, even as a dead letter): while the
        // range lives nobody else would bring the message back, so it is delivered again
        // after a back-off, as a redelivery (claimed first: a refusal that lasts reaches no
        // app), until something is recorded or the range stops.
        let mut tries = 0;
        let mut lock = self.locked_until.clone();
        while fate == Fate::Unrecorded && !self.stop.give_up.is_cancelled() {
            tries += 1;
            // What the app may still be working on is not handed out again before the lock
            // it was told of runs out.
            let told = match reached.load(Ordering::SeqCst) {
                true => lock.get().map(|until| self.deliverer.until(until)),
                false => None,
            };
            let wait = UNRECORDED_AGAIN
                .backoff_random(tries)
                .max(told.unwrap_or_default());
            warn!(message_id = %message.id, retry_in_ms = wait.as_millis() as u64, "nothing could be recorded for the message; delivering it again later");
            let give_up = self.stop.give_up.clone();
            let waited = permit
                .released_while(async {
                    tokio::select! {
                        _ = give_up.cancelled() => false,
                        _ = tokio::time::sleep(wait) => true,
                    }
                })
                .await;
            if !waited {
                break;
            }
            // A redelivery stays one, as does a delivery whose call may have reached the app.
            let path = match first_path == Path::Recovered || reached.load(Ordering::SeqCst) {
                true => Path::Recovered,
                false => Path::Checked,
            };
            // Each delivery the app gets has its own lock to watch.
            lock = LockedUntil::default();
            let watch = Watch::new(None, None, lock.clone(), Arc::clone(&reached));
            fate = Box::pin(self.deliverer.process(
                message.clone(),
                &self.stop.give_up,
                &mut permit,
                path,
                watch,
            ))
            .await;
        }
        fate
    }
}

/// Drops the chains of keys whose last message settled (bounded memory); a key whose last
/// message is still pending keeps its chain, so its next message still waits.
fn forget_settled_keys(chains: &mut HashMap<String, watch::Receiver<KeyState>>) {
    chains.retain(|_, rx| matches!(*rx.borrow(), None | Some((_, Fate::Pending))));
}

/// The range's lease is gone. Deliveries already under way finish and settle under their own
/// claims; those still waiting for a permit are not started: the checkpoint never passed them,
/// so the new owner reads them again. (Delivering them anyway would only hand the app a second
/// copy in stream mode, and waste a claim attempt in exclusive mode.)
fn abandon(stops: &Stops, deliveries: &mut JoinSet<()>, leftovers: &Leftovers) {
    stops.step_aside.cancel();
    // Waits (schedules, held messages, back-offs of writes that keep failing) end: the range's
    // next owner brings those messages back. Settles of recorded claims keep trying until
    // their locks expire; the host waits for them before it returns.
    stops.give_up.cancel();
    leftovers.adopt(deliveries);
}

/// What one range's processing keeps while its lease is held.
struct Reading {
    lease: Lease,
    reader: FeedReader,
    /// Deliveries report here.
    done_tx: mpsc::UnboundedSender<Report>,
    done_rx: mpsc::UnboundedReceiver<Report>,
    /// Waiting deliveries ask to start here (the lease write path).
    start_tx: mpsc::UnboundedSender<StartRequest>,
    start_rx: mpsc::UnboundedReceiver<StartRequest>,
    deliveries: JoinSet<()>,
    stops: Stops,
    checkpoint: Checkpoint,
    in_flight: usize,
    poll: AdaptivePoll,
    /// When the next read is due: fixed once the last read's back-off is known, so the other
    /// events of the loop (settlements, renewals, flushes) do not push it back.
    read_at: Option<Instant>,
    /// Still reading the feed (not draining or handing over).
    reading: bool,
    /// Ordered groups: where each key's last message stands, which its next message waits for.
    chains: HashMap<String, watch::Receiver<KeyState>>,
    /// Ordered groups: the messages of each key that the range's previous owners left
    /// unsettled (behind the checkpoint); the key's next message read here waits for them.
    held_back: BTreeMap<String, Vec<String>>,
    /// Messages read so far; the first window after taking a range is checked for state the
    /// previous owner left (see `RangeDelivery::path`).
    read: usize,
    /// The last delivery's "got a permit" signal (unordered groups).
    in_feed_order: Option<oneshot::Receiver<()>>,
    /// Exclusive groups: the lease records the window.
    windowed: bool,
    /// The window changed since the lease was last written.
    unwritten: bool,
    /// When the last lease write that landed was sent, and the next renewal is due.
    written_at: Instant,
    renew_at: Instant,
    /// Until when the lease is surely this range's: its last write plus the expiry other
    /// hosts judge that version by, minus a margin. Past it nothing starts, and first
    /// deliveries whose lock is the lease are cut.
    held: watch::Sender<Instant>,
    /// The lease write path: where each sub-range of the feed was read up to (see [`SubFeed`]).
    rewind: Option<Rewind>,
    /// The lease write path: identities this processor has read, newest last (bounded): a
    /// feed that serves earlier documents again mid-read (the emulator renumbers LSNs when
    /// partitions merge) must not deliver again what this range completed with nothing but
    /// its lease.
    seen: Option<Seen>,
}

/// Identities read lately, in read order, at most [`SEEN_CAP`]. Each is stored once, shared
/// by the set and the order.
#[derive(Debug, Default)]
struct Seen {
    ids: std::collections::HashSet<Arc<str>>,
    order: std::collections::VecDeque<Arc<str>>,
}

/// How many identities a range remembers having read (about 70 bytes each, with the set's
/// slot).
const SEEN_CAP: usize = 20_000;

impl Seen {
    /// Drops the documents read before (keeping the first of repeats within the page), and
    /// remembers the rest. Documents are known by identity (id and key): the same id under
    /// another key is another message.
    fn first_reads(
        &mut self,
        docs: Vec<serde_json::Value>,
        key_field: &str,
    ) -> Vec<serde_json::Value> {
        let before = docs.len();
        let fresh: Vec<serde_json::Value> = docs
            .into_iter()
            .filter(|doc| match crate::identity::of_document(doc, key_field) {
                Some(identity) if self.ids.contains(identity.as_str()) => false,
                Some(identity) => {
                    let identity: Arc<str> = Arc::from(identity);
                    self.ids.insert(Arc::clone(&identity));
                    self.order.push_back(identity);
                    true
                }
                None => true,
            })
            .collect();
        while self.order.len() > SEEN_CAP {
            if let Some(old) = self.order.pop_front() {
                self.ids.remove(&old);
            }
        }
        if fresh.len() < before {
            warn!(
                again = before - fresh.len(),
                "the feed served documents this range already read; skipped them"
            );
        }
        fresh
    }
}

/// The lease write path's guard against a feed that serves again what was read before, with
/// no state document to say it was completed: the emulator renumbers LSNs when partitions
/// merge, so a position taken before the merge reads from elsewhere after it. One entry per
/// EPK sub-range the continuation keeps a position for (a range that spanned a split has
/// several, each read on its own, from its own partition).
#[derive(Debug, Default)]
struct Rewind {
    feeds: Vec<SubFeed>,
}

#[derive(Debug)]
struct SubFeed {
    range: (String, String),
    /// The last document read, with its EPK (before this processor read any: the lease's).
    last: Option<(String, Marker)>,
    /// The partition that served the last page: a change (a split or a merge) arms `seek`.
    partition: Option<String>,
    /// The next page is checked against this (see `RangeProcessor::past_marker`).
    seek: Option<Seek>,
}

/// Checking pages against the last document read before.
#[derive(Debug)]
struct Seek {
    marker: Marker,
    epk: String,
    /// The marker's LSN and partition, once read (the pages are compared with it).
    position: Option<Option<(u64, Option<String>)>>,
    /// Pages came that were all before the marker: skipping until it.
    seeking: bool,
}

impl Seek {
    fn new((epk, marker): (String, Marker)) -> Self {
        Seek {
            marker,
            epk,
            position: None,
            seeking: false,
        }
    }
}

impl Rewind {
    /// What the range starts from: for each sub-range of the continuation, the lease's
    /// newest marker in it, checked on the sub-range's first page. A sub-range without one (a
    /// split child whose parent last read the other half) is checked against the newest
    /// marker of all: by LSN, which compares while both are in one partition.
    fn start(markers: &[(String, Marker)], ranges: &[(String, String)]) -> Self {
        let feeds = ranges
            .iter()
            .filter_map(|(lo, hi)| {
                let own = markers
                    .iter()
                    .rev()
                    .find(|(epk, _)| crate::range::epk_in(epk, lo, hi));
                let marker = own.or(markers.last())?.clone();
                Some(SubFeed {
                    range: (lo.clone(), hi.clone()),
                    last: Some(marker.clone()),
                    partition: None,
                    seek: Some(Seek::new(marker)),
                })
            })
            .collect();
        Rewind { feeds }
    }

    /// The entry of sub-range `range`; a new one (the range split since) inherits what the
    /// narrowest entry holding it knew.
    fn feed(&mut self, range: &(String, String)) -> &mut SubFeed {
        if let Some(i) = self.feeds.iter().position(|f| &f.range == range) {
            return &mut self.feeds[i];
        }
        let parent = self
            .feeds
            .iter()
            .filter(|f| crate::range::epk_in(&range.0, &f.range.0, &f.range.1))
            .max_by(|a, b| crate::range::epk_cmp(&a.range.0, &b.range.0));
        let feed = SubFeed {
            range: range.clone(),
            last: parent.and_then(|p| p.last.clone()),
            partition: parent.and_then(|p| p.partition.clone()),
            seek: parent
                .and_then(|p| p.seek.as_ref())
                .map(|s| Seek::new((s.epk.clone(), s.marker.clone()))),
        };
        self.feeds.push(feed);
        self.feeds.last_mut().expect("pushed")
    }
}

impl Reading {
    /// Nothing in flight and nothing more to read: the range is drained.
    fn drained(&self) -> bool {
        self.in_flight == 0 && !self.reading
    }

    fn checkpoint_due(&self) -> bool {
        self.unwritten || self.checkpoint.position() != &self.lease.continuation
    }

    /// Stop reading; long work stops holding the range; let what is under way settle.
    fn stop_reading(&mut self) {
        self.reading = false;
        self.stops.give_up.cancel();
        self.stops.draining.cancel();
        self.stops.promote_now.cancel();
    }

    /// The host stops.
    fn drain(&mut self) {
        self.stop_reading();
        debug!(in_flight = self.in_flight, "draining range");
    }

    fn delivered(&mut self, report: Report) {
        while self.deliveries.try_join_next().is_some() {}
        self.in_flight -= 1;
        let completion = (report.fate == Fate::Completed).then_some(Completion {
            id: report.id,
            key: report.key,
            enqueued_at: report.enqueued_at,
            expires_at: report.expires_at,
        });
        // Nothing recorded and the app never had it: the next reader delivers it as new.
        let settle = match (report.fate, report.reached) {
            (Fate::Unrecorded, false) => Settle::Unstarted,
            (fate, _) => fate.settle(),
        };
        self.checkpoint
            .settle(report.seq, &report.identity, settle, completion);
        self.unwritten |= self.windowed;
    }

    /// Another host asked for the range: stop reading, let what is under way settle, then the
    /// drain checkpoints and releases it (the release keeps the reservation).
    fn hand_over(&mut self, current: Lease) {
        self.lease = current;
        if self.reading {
            info!(
                to = self.lease.handover_to.as_deref().unwrap_or_default(),
                "handing the range over: draining, then checkpoint and release"
            );
            self.stop_reading();
        }
    }

    /// The range's record landed as `lease` (sent at `sent`).
    fn recorded(&mut self, lease: Lease, sent: Instant, options: &HostOptions) {
        self.lease = lease;
        self.unwritten = false;
        self.written(sent, options);
    }

    /// A lease write that landed was sent at `sent`: the lease is surely this range's until
    /// the expiry others judge this version by (minus a margin), and is renewed well before.
    fn written(&mut self, sent: Instant, options: &HostOptions) {
        let expiry = self
            .lease
            .unchanged_expiry_ms(duration_ms(options.lease_expire))
            .max(1) as u64;
        let expiry = Duration::from_millis(expiry);
        self.written_at = sent;
        self.renew_at = sent + options.lease_renew.min(expiry / 3);
        self.held.send_replace(sent + expiry - expiry / 10);
        // A hand-over request may have come between this range's writes (one retried on the
        // lease as it now is carries the request on): noticed whichever write shows it.
        if self.reading && self.lease.handover_to.is_some() {
            let current = self.lease.clone();
            self.hand_over(current);
        }
    }
}

/// The EPK sub-ranges `token` keeps a position for; `whole` alone when it does not say.
fn continuation_ranges(token: &Option<String>, whole: &(String, String)) -> Vec<(String, String)> {
    token
        .as_deref()
        .and_then(crate::range::continuation_ranges)
        .filter(|ranges| !ranges.is_empty())
        .unwrap_or_else(|| vec![whole.clone()])
}

/// What a step of a range's loop leaves it with: go on, or stop with this exit (the lease is
/// gone: what waits steps aside, what is under way finishes under its own claims).
type Step = Option<RangeExit>;

/// A message read from the feed, ready to be handed out.
struct Handed {
    message: Message,
    identity: String,
    path: Path,
    /// The previous owner may have started it without listing it ([`Handling::Unsure`]).
    unsure: bool,
}

impl<H: Handler> RangeProcessor<H> {
    fn now(&self) -> i64 {
        self.group.queue().clock().now_ms()
    }

    /// Whether starts are listed on the lease (the lease write path): each delivery asks its
    /// range to start (see [`StartRequest`]).
    fn records_starts(&self) -> bool {
        self.group.config().lease_recorded()
    }

    #[instrument(skip_all, fields(group = %lease.group, lease = %lease.range_label()))]
    async fn run(self, lease: Lease, acquired: Instant, stop: CancellationToken) -> RangeExit {
        let mut r = match self.start(lease, acquired).await {
            Ok(r) => r,
            Err(e) => return RangeExit::Failed(e),
        };
        let mut flush = tokio::time::interval(self.options.checkpoint_interval);
        while !r.drained() {
            let delay = r.poll.delay();
            let read_at = *r.read_at.get_or_insert_with(|| Instant::now() + delay);
            let held = *r.held.borrow();
            let step = tokio::select! {
                biased;
                _ = stop.cancelled(), if r.reading => {
                    r.drain();
                    None
                }
                Some(report) = r.done_rx.recv() => {
                    r.delivered(report);
                    None
                }
                Some(request) = r.start_rx.recv() => self.grant(&mut r, request).await,
                _ = tokio::time::sleep_until(held), if !buggify::on(Bug::StartUnderExpiredLease) => {
                    warn!(owner = %self.options.holder(), in_flight = r.in_flight, "the lease could not be renewed in time; stopped reading the range");
                    Some(RangeExit::Lost)
                }
                _ = tokio::time::sleep_until(r.renew_at) => self.renew(&mut r).await,
                _ = flush.tick(), if r.checkpoint_due() => self.flush(&mut r).await,
                _ = tokio::time::sleep_until(read_at), if r.reading && self.room(&r) => {
                    r.read_at = None;
                    self.read_page(&mut r).await
                }
            };
            if let Some(exit) = step {
                abandon(&r.stops, &mut r.deliveries, &self.leftovers);
                return exit;
            }
        }
        self.finish(r).await
    }

    /// Whether the range may read another page: fewer messages in flight than its limit,
    /// and (exclusive groups) a window small enough to write with the lease.
    fn room(&self, r: &Reading) -> bool {
        let limit = self.options.max_in_flight_per_range;
        r.in_flight < limit && (!r.windowed || (r.checkpoint.window_docs() as usize) < limit * 4)
    }

    async fn start(&self, lease: Lease, acquired: Instant) -> Result<Reading> {
        let range = lease.feed_range()?;
        let config = self.group.config();
        let windowed = config.mode == DeliveryMode::Exclusive;
        let inherited = windowed.then(|| {
            let wrote_claims = lease.writes != Some(crate::config::ExclusiveWrites::Lease);
            let look_up = match config.lease_recorded() && wrote_claims {
                true => self.options.max_in_flight_per_range,
                false => 0,
            };
            Inherited::new(&lease.window, look_up)
        });
        // The lease's markers (a split child holds its parent's, of both halves).
        let markers: Vec<(String, Marker)> = lease
            .window
            .markers()
            .into_iter()
            .filter_map(|marker| {
                let key = MessageKey::from_json(marker.pk.clone()).ok()?;
                Some((self.group.queue().message_epk(&key), marker))
            })
            .collect();
        let rewind = config.lease_recorded().then(|| {
            let whole = (lease.min_epk.clone(), lease.max_epk.clone());
            Rewind::start(&markers, &continuation_ranges(&lease.continuation, &whole))
        });
        let mut checkpoint = Checkpoint::new(lease.continuation.clone()).after(markers);
        if let Some(inherited) = inherited {
            checkpoint = checkpoint.tracking_ids().inheriting(inherited);
        }
        // An ordered key's earlier messages that hold their own state lie behind the
        // checkpoint (long work, retries, parked): the key's next message read here waits
        // for them, though the window no longer lists them.
        let held_back = match config.ordered && !buggify::on(Bug::OrderedMoveForgetsPredecessor) {
            true => {
                self.group
                    .unsettled_in(&lease.min_epk, &lease.max_epk)
                    .await?
            }
            false => BTreeMap::new(),
        };
        let reader = FeedReader::new(
            self.group.queue().messages().clone(),
            FeedScope::range(range),
            self.group.config().start_from,
            lease.continuation.clone(),
            self.options.page_size,
            Arc::clone(self.group.queue().charges()),
        );
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        let (start_tx, start_rx) = mpsc::unbounded_channel();
        let (held, _) = watch::channel(acquired);
        let mut r = Reading {
            checkpoint,
            lease,
            reader,
            done_tx,
            done_rx,
            start_tx,
            start_rx,
            deliveries: JoinSet::new(),
            stops: Stops {
                step_aside: CancellationToken::new(),
                draining: CancellationToken::new(),
                give_up: CancellationToken::new(),
                promote_now: CancellationToken::new(),
            },
            in_flight: 0,
            poll: AdaptivePoll::new(self.options.min_poll, self.options.max_poll),
            read_at: None,
            reading: true,
            chains: HashMap::new(),
            held_back,
            read: 0,
            in_feed_order: None,
            windowed,
            unwritten: false,
            written_at: acquired,
            renew_at: acquired,
            held,
            seen: config.lease_recorded().then(Seen::default),
            rewind,
        };
        r.written(acquired, &self.options);
        Ok(r)
    }

    /// Renews the lease. Fencing: when another host owns the range now, nothing more is read
    /// from it; when renewals keep failing, the range stops once the lease is no longer
    /// surely its own (see [`Reading::held`]).
    async fn renew(&self, r: &mut Reading) -> Step {
        let sent = Instant::now();
        match self.store.renew(&r.lease, self.now()).await {
            Ok(renewed) => {
                r.lease = renewed;
                r.written(sent, &self.options);
            }
            // Changed but still ours: another host asked for it, or an earlier write whose
            // answer was lost landed (the SDK's retry of it then finds a new ETag). Renewed
            // again on what is there now, soon but not at once: a write that keeps landing
            // unanswered must not spin.
            Err(LeaseError::Lost) => match self.current(&r.lease).await {
                Ok(Some(current)) if current.handover_to.is_some() => {
                    r.hand_over(current);
                    r.renew_at = Instant::now() + LOST_AGAIN;
                }
                Ok(Some(current)) => {
                    r.lease = current;
                    r.renew_at = Instant::now() + LOST_AGAIN;
                }
                _ => {
                    warn!(owner = %self.options.holder(), in_flight = r.in_flight, "lease lost; stopped reading the range");
                    return Some(RangeExit::Lost);
                }
            },
            Err(LeaseError::Other(e)) => {
                warn!(error = %e, "lease renewal failed; retrying");
                r.renew_at =
                    Instant::now() + Duration::from_millis(200).min(self.options.lease_renew);
            }
        }
        None
    }

    /// Lets the deliveries that ask start, their starts listed with the range's next write,
    /// or written first where a next owner must know of them (see [`StartRequest`]).
    async fn grant(&self, r: &mut Reading, first: StartRequest) -> Step {
        let mut requests = vec![first];
        while let Ok(more) = r.start_rx.try_recv() {
            requests.push(more);
        }
        let write_first = requests.iter().any(|request| {
            request.unsure || (request.follows && r.checkpoint.unwritten_completions() > 0)
        });
        for request in &requests {
            r.checkpoint.start(request.seq, &request.identity);
        }
        r.unwritten = true;
        let (granted, step) = match write_first {
            true => match self.write_record(r).await {
                Ok(_) => (true, None),
                Err(exit) => (false, Some(exit)),
            },
            // The lease is a lock only while it is live: nothing starts under one whose last
            // write is older than the expiry others judge it by (minus a margin).
            false => (
                Instant::now() < *r.held.borrow() || buggify::on(Bug::StartUnderExpiredLease),
                None,
            ),
        };
        for request in requests {
            let _ = request.reply.send(granted);
        }
        step
    }

    /// Reads the next page and hands its messages out; permits are taken as they free.
    async fn read_page(&self, r: &mut Reading) -> Step {
        let max = self.options.page_size;
        let crate::cosmos::feed::Page {
            docs,
            token,
            partition,
        } = match r.reader.next_page_of(max).await {
            Ok(page) => page,
            Err(e) => {
                ConsumerStats::bump(&self.stats.errors);
                r.poll.idle();
                warn!(error = %e, "change feed read failed; retrying");
                return None;
            }
        };
        if docs.is_empty() {
            r.poll.idle();
            tracing::trace!(
                next_read_ms = r.poll.delay().as_millis() as u64,
                "feed idle; backing off"
            );
            // Everything there is was read: what a previous owner recorded and this range
            // never read again is not in it any more (the other half of a split, expired).
            if let Some(inherited) = r.checkpoint.inherited() {
                r.unwritten |= inherited.caught_up();
            }
        } else {
            r.poll.observed(docs.len(), max as usize);
            // Stream mode has no claims to stop a second reader: check the lease is still
            // ours before handing out a page (1 RU a page). The lease write path's record of
            // the page does the same, below.
            if self.group.config().mode == DeliveryMode::Stream {
                match self.current_confirmed(&r.lease).await {
                    Err(()) => {
                        warn!(owner = %self.options.holder(), in_flight = r.in_flight, "lease taken by another host; stopped reading the range");
                        return Some(RangeExit::Lost);
                    }
                    Ok(Some(current)) if current.handover_to.is_some() => {
                        // Asked for: this page is left to the next owner.
                        r.hand_over(current);
                        return None;
                    }
                    Ok(_) => {}
                }
            }
        }
        let mut last = None;
        let mut docs = docs;
        if !docs.is_empty() {
            if let Some(rewind) = r.rewind.as_mut() {
                let whole = (r.lease.min_epk.clone(), r.lease.max_epk.clone());
                let range = self.page_range(&docs, &token, &whole);
                let feed = rewind.feed(&range);
                if feed.seek.is_none()
                    && partition.is_some()
                    && feed.partition.is_some()
                    && feed.partition != partition
                {
                    // Split or merged: after a merge the emulator numbers the documents
                    // anew, and the position may read again what was read before it.
                    debug!(from = ?feed.partition, to = ?partition, "the range moved to another partition; checking its next page against the last document read");
                    feed.seek = feed.last.clone().map(Seek::new);
                }
                docs = self.past_marker(feed, partition.as_deref(), docs).await;
                feed.partition = partition.or(feed.partition.take());
                if let Some(seen) = r.seen.as_mut() {
                    docs =
                        seen.first_reads(docs, self.group.queue().config().partition_key_field());
                }
                last = docs
                    .iter()
                    .rev()
                    .find_map(|doc| self.marker(doc))
                    .map(|(epk, marker)| {
                        feed.last = Some((epk.clone(), marker.clone()));
                        PageEnd { marker, epk, range }
                    });
            }
        }
        let count = docs.len() as u32;
        let (handed, known) = self.handling(r, docs);
        let turns: Vec<(Turn, Option<watch::Sender<KeyState>>)> =
            handed.iter().map(|h| self.turn(r, &h.message)).collect();
        let listed: Vec<String> = handed.iter().map(|h| h.identity.clone()).collect();
        let seq = r.checkpoint.read_docs(token, count, &listed, last);
        for (identity, fate) in known {
            r.checkpoint.known(seq, &identity, fate);
            r.unwritten = true;
        }
        if self.records_starts() && !handed.is_empty() {
            // The page is listed before any of it starts (unstarted; each start is listed with
            // a later write): a next owner after a crash waits for the lock of what the app
            // may have. Also the fence: it fails once the lease is another host's.
            if let Err(exit) = self.write_record(r).await {
                return Some(exit);
            }
        }
        self.dispatch(r, seq, handed, turns);
        if r.chains.len() > MAX_IDLE_CHAINS {
            forget_settled_keys(&mut r.chains);
        }
        None
    }

    /// When a message read now may start: ordered groups after its key's previous messages
    /// (in this range, or left unsettled by a previous owner); unordered ones take permits in
    /// feed order. With it, the sender of its state for the key's next message.
    fn turn(&self, r: &mut Reading, message: &Message) -> (Turn, Option<watch::Sender<KeyState>>) {
        if self.group.config().ordered {
            let key = message.partition_key.canonical();
            let (tx, rx) = watch::channel(None);
            let previous = r.chains.insert(key.clone(), rx).filter(|previous| {
                // A predecessor settled for good (recorded) is nothing to wait for.
                match &*previous.borrow() {
                    Some((_, Fate::Settled)) => false,
                    Some((id, Fate::Completed)) => r.checkpoint.is_unwritten(id),
                    _ => true,
                }
            });
            let mut waits_for = r.held_back.remove(&key).unwrap_or_default();
            waits_for.retain(|id| *id != message.id);
            let turn = Turn::Key {
                previous,
                waits_for,
            };
            return (turn, Some(tx));
        }
        let (tx, rx) = oneshot::channel();
        let turn = Turn::Feed {
            previous: r.in_feed_order.replace(rx),
            next: Some(tx),
        };
        (turn, None)
    }

    /// The page without the documents read before (see [`Rewind`]), when its sub-range is
    /// being checked: up to the marker when the page holds it; otherwise those older than the
    /// marker by LSN, as the feed numbers documents now (a few point reads, once per
    /// sub-range when a range is taken or moves partition). When the marker's LSN does not
    /// compare (another partition holds it, or it is gone), everything is delivered: at least
    /// once, never skipped unread.
    async fn past_marker(
        &self,
        feed: &mut SubFeed,
        partition: Option<&str>,
        docs: Vec<serde_json::Value>,
    ) -> Vec<serde_json::Value> {
        let Some(seek) = feed.seek.as_mut() else {
            return docs;
        };
        let field = self.group.queue().config().partition_key_field();
        if let Some(at) = docs
            .iter()
            .position(|d| crate::identity::is(d, field, &seek.marker.id, &seek.marker.pk))
        {
            if at > 0 || seek.seeking {
                warn!(skipped = at + 1, "the feed served documents before the checkpoint again; skipped up to the last one recorded");
            }
            feed.seek = None;
            return docs.into_iter().skip(at + 1).collect();
        }
        if seek.position.is_none() {
            let marker = serde_json::json!({"id": seek.marker.id, field: seek.marker.pk});
            seek.position = Some(self.group.item_position(&marker).await.ok().flatten());
        }
        let marker = match seek.position.clone().flatten() {
            Some((lsn, held_by)) if partition.is_none() || held_by.as_deref() == partition => lsn,
            _ => {
                feed.seek = None;
                return docs;
            }
        };
        // Documents come in LSN order: find the first one not older than the marker. One of
        // the marker's LSN is not older: a transactional batch is one write, and the feed
        // resumes within it; once renumbered by a merge, every document has its own.
        let newer = |i: usize| {
            let doc = &docs[i];
            async move {
                self.group
                    .item_lsn(doc)
                    .await
                    .ok()
                    .flatten()
                    .map(|lsn| lsn >= marker)
            }
        };
        // The usual answer first: nothing served again.
        if newer(0).await != Some(false) {
            feed.seek = None;
            return docs;
        }
        let Some(last_newer) = newer(docs.len() - 1).await else {
            feed.seek = None;
            return docs;
        };
        if !last_newer {
            seek.seeking = true;
            debug!(
                skipped = docs.len(),
                "skipping documents before the checkpoint"
            );
            return Vec::new();
        }
        // The first is older, the last newer.
        let (mut lo, mut hi) = (1, docs.len() - 1);
        while lo < hi {
            let mid = (lo + hi) / 2;
            match newer(mid).await {
                Some(true) => hi = mid,
                Some(false) => lo = mid + 1,
                // Cannot tell: deliver from the oldest that may be unread.
                None => break,
            }
        }
        feed.seek = None;
        if lo > 0 {
            warn!(skipped = lo, "the feed served documents before the checkpoint again; skipped those older than the last one recorded");
        }
        docs.into_iter().skip(lo).collect()
    }

    /// The sub-range of the continuation that served `docs` (the one holding its first
    /// document); the lease's range when the token does not say.
    fn page_range(
        &self,
        docs: &[serde_json::Value],
        token: &Option<String>,
        whole: &(String, String),
    ) -> (String, String) {
        let Some(epk) = docs
            .iter()
            .find_map(|doc| self.marker(doc))
            .map(|(epk, _)| epk)
        else {
            return whole.clone();
        };
        continuation_ranges(token, whole)
            .into_iter()
            .find(|(lo, hi)| crate::range::epk_in(&epk, lo, hi))
            .unwrap_or_else(|| whole.clone())
    }

    /// A feed document as a marker, with its EPK; `None` without an id or a valid key.
    fn marker(&self, doc: &serde_json::Value) -> Option<(String, Marker)> {
        let field = self.group.queue().config().partition_key_field();
        let pk = doc.get(field)?.clone();
        let key = crate::message::MessageKey::from_json(pk.clone()).ok()?;
        let marker = Marker {
            id: doc.get("id")?.as_str()?.to_owned(),
            pk,
        };
        Some((self.group.queue().message_epk(&key), marker))
    }

    /// A page's messages and how each is delivered, and the documents the lease's window says
    /// are done or pending already. Malformed documents are counted and skipped with a reason.
    fn handling(
        &self,
        r: &mut Reading,
        docs: Vec<serde_json::Value>,
    ) -> (Vec<Handed>, Vec<(String, Settle)>) {
        let config = self.group.config();
        let field = self.group.queue().config().partition_key_field();
        let check_stream = config.mode == DeliveryMode::Stream && config.ordered;
        let (mut handed, mut known) = (Vec::new(), Vec::new());
        for doc in docs {
            let message = match Message::from_document(&doc, field) {
                Ok(message) => message,
                Err(reason) => {
                    ConsumerStats::bump(&self.stats.malformed);
                    warn!(queue = self.group.queue().name(), id = ?doc.get("id"), %reason, "skipping a malformed document in the messages container");
                    if let Some(inherited) = r.checkpoint.inherited() {
                        inherited.skipped();
                    }
                    continue;
                }
            };
            let identity = crate::identity::fingerprint(&message.id, &message.partition_key);
            let handling = match r.checkpoint.inherited() {
                Some(inherited) => inherited.next(&identity, &message.id, config.ordered),
                None if check_stream && r.read < self.options.max_in_flight_per_range => {
                    Handling::Deliver(Path::Checked)
                }
                None => Handling::Deliver(Path::Feed),
            };
            r.read += 1;
            match handling {
                Handling::Deliver(path) => handed.push(Handed {
                    message,
                    identity,
                    path,
                    unsure: false,
                }),
                Handling::Unsure(path) => handed.push(Handed {
                    message,
                    identity,
                    path,
                    unsure: true,
                }),
                Handling::Known(fate) => known.push((identity, fate)),
            }
        }
        (handed, known)
    }

    /// One delivery task per message of page `seq`, each taking its turn.
    fn dispatch(
        &self,
        r: &mut Reading,
        seq: u64,
        handed: Vec<Handed>,
        turns: Vec<(Turn, Option<watch::Sender<KeyState>>)>,
    ) {
        let config = self.group.config();
        let lease_locked = config.lease_recorded();
        let promoting = config.mode == DeliveryMode::Exclusive;
        let page_started = Arc::new(AtomicBool::new(false));
        for (
            Handed {
                message,
                identity,
                path,
                unsure,
            },
            (turn, key_state),
        ) in handed.into_iter().zip(turns)
        {
            r.in_flight += 1;
            let reached = Arc::new(AtomicBool::new(false));
            let (promoted_tx, mut promoted) = oneshot::channel();
            let promotion = promoting.then(|| Promotion {
                after: self.options.promote_after,
                now: r.stops.promote_now.clone(),
                promoted: Some(promoted_tx),
            });
            let lease = lease_locked.then(|| LeaseLock {
                lost: r.stops.step_aside.clone(),
                held: r.held.subscribe(),
            });
            let start = self.records_starts().then(|| StartAsk {
                seq,
                identity: identity.clone(),
                unsure,
                requests: r.start_tx.clone(),
            });
            let delivery = RangeDelivery {
                deliverer: Arc::clone(&self.deliverer),
                permits: Arc::clone(&self.permits),
                stop: r.stops.clone(),
                page_started: (!r.windowed).then(|| Arc::clone(&page_started)),
                path,
                promotion,
                lease,
                start,
                locked_until: LockedUntil::default(),
                reached: Arc::clone(&reached),
            };
            let done = r.done_tx.clone();
            let (id, key) = (message.id.clone(), message.partition_key.clone());
            let (enqueued_at, expires_at) = (
                message.enqueued_at,
                self.group.queue().message_expires_at(&message),
            );
            r.deliveries.spawn(self.deliveries.track_future(async move {
                let report = |fate| Report {
                    seq,
                    identity: identity.clone(),
                    id: id.clone(),
                    key: key.clone(),
                    enqueued_at,
                    expires_at,
                    fate,
                    reached: reached.load(Ordering::SeqCst),
                };
                let run = delivery.run(message, turn);
                tokio::pin!(run);
                // A delivery that stops holding the range (its long work has a lock of its
                // own, or it was parked) is reported as pending at once: the range may pass
                // it, the key's next message waits on its state, and the delivery goes on.
                let fate = tokio::select! {
                    biased;
                    fate = &mut run => fate,
                    Ok(()) = &mut promoted => {
                        if let Some(state) = &key_state {
                            state.send_replace(Some((id.clone(), Fate::Pending)));
                        }
                        let _ = done.send(report(Fate::Pending));
                        run.await;
                        return;
                    }
                };
                if let Some(state) = &key_state {
                    state.send_replace(Some((id.clone(), fate)));
                }
                let _ = done.send(report(fate));
            }));
        }
    }

    /// Drained: record where the range is and hand the lease back.
    async fn finish(&self, mut r: Reading) -> RangeExit {
        // Deliveries with locks of their own go on after the range; the host waits for them.
        self.leftovers.adopt(&mut r.deliveries);
        if r.checkpoint_due() {
            if let Some(exit) = self.flush(&mut r).await {
                return exit;
            }
        }
        let mut lease = r.lease.clone();
        for _ in 0..RELEASE_TRIES {
            match self.store.release(&lease).await {
                Ok(()) => {
                    info!(owner = %self.options.holder(), "lease released");
                    crate::ledger::lease_released(
                        self.group.name(),
                        &lease.id,
                        &self.options.holder(),
                    );
                    return RangeExit::Released;
                }
                // Changed by another host asking for it (a hand-over request), not taken:
                // still ours, so release what is there now. Left alone, it would stay in this
                // host's name until it expired.
                Err(LeaseError::Lost) => match self.current_confirmed(&lease).await {
                    Ok(Some(current)) => lease = current,
                    _ => return RangeExit::Lost,
                },
                Err(LeaseError::Other(e)) => return RangeExit::Failed(e),
            }
        }
        RangeExit::Lost
    }

    /// Writes what the range recorded: the checkpoint, and in exclusive groups the window
    /// past it. `Some(exit)` when the lease is gone.
    async fn flush(&self, r: &mut Reading) -> Step {
        if !r.windowed {
            return self.write_checkpoint(r).await;
        }
        self.write_record(r).await.err()
    }

    /// Writes the lease with the checkpoint and the window (exclusive groups), and counts the
    /// completions it records (a hand-over request the written lease shows starts the
    /// drain); a write that keeps failing is retried until the lease would no longer surely
    /// be this range's, then the range stops (the lease, still in this host's name, is taken
    /// back at the next acquire round, and what the write would have recorded is delivered
    /// again).
    ///
    /// Completions are counted (and announced on the ledger) once the write landed; a write
    /// whose answer is lost (a timeout after the service applied it) is read back.
    async fn write_record(&self, r: &mut Reading) -> Result<(), RangeExit> {
        let completions = r.checkpoint.take_unwritten();
        let (written, result) = self.try_record(r).await;
        if written {
            if !r.lease.window.started.is_empty() {
                crate::ledger::starts_listed(self.group.name(), &r.lease.window.started);
            }
            self.stats
                .completed
                .fetch_add(completions.len() as u64, Ordering::Relaxed);
            for c in &completions {
                crate::ledger::completion_recorded(self.group.name(), &c.id, &c.key);
            }
        } else if result.is_err() {
            // The range stops with completions its lease could not record (an outage outlasted
            // the lease, or another host has it now): they are written as state documents
            // instead, so a success is not thrown away and delivered again.
            self.complete_by_documents(completions).await;
        } else {
            r.checkpoint.restore_unwritten(completions);
        }
        result
    }

    /// Records completions the lease could not, one state document each (best effort: what
    /// cannot be written is delivered again by the range's next owner).
    async fn complete_by_documents(&self, completions: Vec<Completion>) {
        for c in completions {
            match self
                .group
                .record_completion(&c.id, &c.key, c.enqueued_at, c.expires_at)
                .await
            {
                Ok(true) => {
                    ConsumerStats::bump(&self.stats.completed);
                    crate::ledger::completion_recorded(self.group.name(), &c.id, &c.key);
                }
                Ok(false) => {
                    debug!(message_id = %c.id, "a state document owns the message already; its completion here is not recorded")
                }
                Err(e) => {
                    warn!(message_id = %c.id, error = %e, "its completion could not be recorded; the range's next owner delivers it again")
                }
            }
        }
    }

    /// The lock duration the lease advertises while it holds started deliveries: the group's,
    /// when shorter than the lease expiry (see [`Lease::lock_ms`]).
    fn lease_lock_ms(&self) -> Option<u64> {
        let lock = self.group.config().lock_duration;
        (self.records_starts() && lock < self.options.lease_expire)
            .then_some(lock.as_millis() as u64)
    }

    /// [`Self::write_record`]'s write: whether it landed, and what the range does next.
    async fn try_record(&self, r: &mut Reading) -> (bool, Result<(), RangeExit>) {
        let writes = self.group.config().exclusive_writes;
        let position = r.checkpoint.position().clone();
        let mut window = r.checkpoint.record();
        // Until the range has drained, what it handed out unstarted may start before the
        // next write lists it (a page's record is written before its messages are handed out).
        window.starts_lag |= self.records_starts() && !r.drained() && r.checkpoint.has_unstarted();
        let mut attempt = 0u32;
        // A write found landed may be any attempt's: the lease is held from the first's send.
        let first_sent = Instant::now();
        let holds = |lease: &Lease| lease.window == window && lease.continuation == position;
        // Tried while the lease is surely this range's: giving up sooner would throw
        // completions away (the next owner delivers them again) while the lease may be good.
        while Instant::now() < *r.held.borrow() || buggify::on(Bug::StartUnderExpiredLease) {
            attempt += 1;
            let sent = Instant::now();
            let written = self
                .store
                .record(
                    &r.lease,
                    position.clone(),
                    window.clone(),
                    writes,
                    self.lease_lock_ms(),
                    self.now(),
                )
                .await;
            match written {
                Ok(written) => {
                    r.recorded(written, sent, &self.options);
                    return (true, Ok(()));
                }
                Err(LeaseError::Lost) => match self.current(&r.lease).await {
                    // Still ours (asked for, or an earlier write landed unanswered): done if it
                    // holds this record, else written again on what is there now (and handed
                    // over after, if asked).
                    Ok(Some(current)) if holds(&current) => {
                        r.recorded(current, first_sent, &self.options);
                        return (true, Ok(()));
                    }
                    Ok(Some(current)) => r.lease = current,
                    Ok(None) => {}
                    Err(()) => {
                        warn!(owner = %self.options.holder(), in_flight = r.in_flight, "lease taken by another host; stopped reading the range");
                        return (false, Err(RangeExit::Lost));
                    }
                },
                Err(LeaseError::Other(e)) => {
                    ConsumerStats::bump(&self.stats.errors);
                    debug!(error = %e, attempt, "lease write failed; retrying");
                    // It may have landed with its answer lost: then it is done.
                    match self.current(&r.lease).await {
                        Ok(Some(current)) if holds(&current) => {
                            r.recorded(current, first_sent, &self.options);
                            return (true, Ok(()));
                        }
                        Ok(Some(current)) => r.lease = current,
                        _ => {}
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50 << attempt.min(4))).await;
        }
        warn!(group = self.group.name(), lease = %r.lease.range_label(), "the lease could not be written before it ran out; stopped reading the range");
        (false, Err(RangeExit::Lost))
    }

    /// The lease as stored when it still names this host (`Ok(None)`: a read error; renewal
    /// decides); `Err(())` when another host owns it or it is gone.
    async fn current(&self, lease: &Lease) -> Result<Option<Lease>, ()> {
        match self.store.read(&lease.id).await {
            Ok(Some(current))
                if current.owner.as_deref() == Some(self.options.holder().as_str()) =>
            {
                Ok(Some(current))
            }
            Ok(_) => Err(()),
            Err(_) => Ok(None),
        }
    }

    /// [`Self::current`] where a read error is not taken for "still ours": read again a few
    /// times, then treat the lease as lost (the range stops; the lease, still in this host's
    /// name, is taken back at the next acquire round and read again from its checkpoint).
    async fn current_confirmed(&self, lease: &Lease) -> Result<Option<Lease>, ()> {
        for attempt in 0..LEASE_READ_TRIES {
            match self.current(lease).await? {
                Some(current) => return Ok(Some(current)),
                None => {
                    tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
                }
            }
        }
        warn!(group = self.group.name(), lease = %lease.range_label(), "the lease could not be read; stopped reading the range");
        Err(())
    }

    /// Writes a moved checkpoint (groups without a window); `Some(exit)` when the lease is
    /// gone.
    async fn write_checkpoint(&self, r: &mut Reading) -> Step {
        let token = r.checkpoint.position().clone()?;
        loop {
            let sent = Instant::now();
            match self
                .store
                .checkpoint(&r.lease, token.clone(), self.now())
                .await
            {
                Ok(written) => {
                    debug!(group = self.group.name(), lease = %r.lease.range_label(), "checkpoint");
                    r.lease = written;
                    r.written(sent, &self.options);
                    return None;
                }
                Err(LeaseError::Lost) => {
                    // Still ours (another host asked for it): write again on what is stored.
                    if let Ok(Some(current)) = self.current(&r.lease).await {
                        r.lease = current;
                        tokio::time::sleep(LOST_AGAIN).await;
                        continue;
                    }
                    warn!(group = self.group.name(), lease = %r.lease.range_label(), "lease lost at checkpoint; stopped reading the range");
                    return Some(RangeExit::Lost);
                }
                Err(LeaseError::Other(e)) => {
                    warn!(group = self.group.name(), lease = %r.lease.range_label(), error = %e, "checkpoint failed; retrying");
                    return None;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(ids: &[&str]) -> Vec<serde_json::Value> {
        ids.iter()
            .map(|id| serde_json::json!({ "id": id, "pk": "k" }))
            .collect()
    }

    fn ids(docs: &[serde_json::Value]) -> Vec<&str> {
        docs.iter()
            .map(|d| d["id"].as_str().unwrap_or("-"))
            .collect()
    }

    #[test]
    fn a_range_delivers_each_message_it_read_once_and_forgets_the_oldest_past_the_cap() {
        let mut seen = Seen::default();
        assert_eq!(
            ids(&seen.first_reads(page(&["a", "b", "a"]), "pk")),
            ["a", "b"]
        );
        // Served again after a merge renumbered the feed: skipped; documents without an id
        // are left for the malformed-document path; the same id under another key is another
        // message.
        let again = seen.first_reads(
            vec![
                serde_json::json!({"id": "b", "pk": "k"}),
                serde_json::json!({"no": "id"}),
                serde_json::json!({"id": "c", "pk": "k"}),
                serde_json::json!({"id": "b", "pk": "other"}),
            ],
            "pk",
        );
        assert_eq!(ids(&again), ["-", "c", "b"]);
        let many: Vec<String> = (0..SEEN_CAP).map(|i| format!("m{i}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert_eq!(seen.first_reads(page(&many), "pk").len(), SEEN_CAP);
        assert_eq!((seen.ids.len(), seen.order.len()), (SEEN_CAP, SEEN_CAP));
        // "a", "b" and "c" were the oldest: forgotten, so read as new; "m0" is still known.
        assert_eq!(
            ids(&seen.first_reads(page(&["a", "m0", "c"]), "pk")),
            ["a", "c"]
        );
    }
}
