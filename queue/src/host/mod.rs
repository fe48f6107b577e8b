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
//!
//! This file is the host: its options, balancing and acquiring leases, the sweep of due
//! retries. One held range is `range` (its loop) over `reading` (what it keeps); its
//! messages go out through `order` (when each may start) and `deliver` (one delivery:
//! claim, the handler, the outcome recorded); `recovery` is what a new owner makes of its
//! predecessor's window, `replay_guard` what the range already read, `poll` how often it
//! reads. The handler contract is [`crate::handler`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::{AbortOnDropHandle, TaskTracker};
use tracing::{debug, info, warn};

use crate::balance::{self, LeaseView};
use crate::buggify::{self, Bug};
use crate::clock::duration_ms;
use crate::config::DeliveryMode;
use crate::error::{QueueError, Result};
use crate::group::Group;
use crate::handler::{ConsumerStats, Handler};
use crate::host::deliver::{Deliverer, Permit};
use crate::lease::{Beat, Lease, LeaseError, LeaseStore};

pub(crate) mod deliver;
mod order;
mod ordered_watch;
mod poll;
mod probe;
mod range;
mod reading;
pub(crate) mod recovery;
mod replay_guard;

use range::RangeProcessor;

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
    /// Keep idle leases alive with one heartbeat document per host rather than a renewal of
    /// each (see [`crate::lease::Beat`]); off, every lease is renewed by itself, as the change
    /// feed processor and earlier cosmosq versions do.
    pub host_heartbeat: bool,
    /// A range whose polling has backed off to `max_poll` rests on its physical partition's
    /// probe (one read of the partition every `max_poll` for all of this host's ranges on
    /// it, see `probe`) and reads by itself only this often; at `max_poll` or less, each
    /// range polls by itself, as earlier versions did.
    pub idle_read: Duration,
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
            host_heartbeat: true,
            idle_read: Duration::from_secs(60),
        }
    }

    /// What this process writes as the owner of its leases and locks: `<owner>#<incarnation>`.
    pub fn holder(&self) -> String {
        format!("{}#{}", self.owner, self.incarnation)
    }

    /// Refuses timings under which leases could not be kept (renewal slower than expiry, …).
    pub fn validate(&self) -> Result<()> {
        // Each is a period something is done at: zero would spin (a read, a listing, a write
        // in a loop) or panic (a tokio interval of zero).
        for (name, period) in [
            ("maxPoll", self.max_poll),
            ("minPoll", self.min_poll),
            ("sweepInterval", self.sweep_interval),
            ("leaseRenew", self.lease_renew),
            ("leaseAcquire", self.lease_acquire),
            ("leaseExpire", self.lease_expire),
            ("checkpointInterval", self.checkpoint_interval),
            ("idleRead", self.idle_read),
        ] {
            if period.is_zero() {
                return Err(QueueError::Config(format!("{name} must be more than 0")));
            }
        }
        if self.min_poll > self.max_poll {
            return Err(QueueError::Config(
                "minPoll must not be longer than maxPoll".into(),
            ));
        }
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
    /// Until when the range surely holds its lease (see `Reading::held`): a range past it
    /// (stopped, or stuck) is left out of the host's heartbeat.
    held: ordered_watch::Receiver<Instant>,
}

/// When this host first saw each lease's last write by its owner, and each heartbeat's last
/// write. A lease held by another host is expired once this host has seen that write as the
/// last for its expiry, on this host's monotonic clock: another host's wall clock says
/// nothing here (one 45 s ahead would see every live lease as expired), as in Kubernetes'
/// leader election. Writes by others (a hand-over request) are no sign of the owner's life
/// and do not restart the count.
#[derive(Debug, Default)]
struct Observed(BTreeMap<String, (String, Instant)>);

/// A lease's last write by its owner: its owner and the time the owner wrote.
fn lease_version(lease: &Lease) -> String {
    format!("{:?}@{}", lease.owner, lease.timestamp)
}

/// A heartbeat's last write (only its holder writes it).
fn beat_version(beat: &Beat) -> String {
    beat.etag
        .clone()
        .unwrap_or_else(|| beat.timestamp.to_string())
}

impl Observed {
    /// Notes the leases and heartbeats as read now; forgets those that are gone.
    fn see(&mut self, leases: &[Lease], beats: &[Beat], now: Instant) {
        let versions: BTreeMap<&str, String> = leases
            .iter()
            .map(|l| (l.id.as_str(), lease_version(l)))
            .chain(beats.iter().map(|b| (b.id.as_str(), beat_version(b))))
            .collect();
        self.0.retain(|id, _| versions.contains_key(id.as_str()));
        for (id, version) in versions {
            match self.0.get(id) {
                Some((seen, _)) if *seen == version => {}
                _ => {
                    self.0.insert(id.to_owned(), (version, now));
                }
            }
        }
    }

    /// How long this host has seen `version` as the last of document `id`.
    fn unchanged_for(&self, id: &str, version: &str, now: Instant) -> Duration {
        match self.0.get(id) {
            Some((seen, since)) if seen == version => now - *since,
            _ => Duration::ZERO,
        }
    }
}

/// A heartbeat that landed: when it was sent, and the leases it listed.
#[derive(Clone, Debug)]
pub(crate) struct Beaten {
    pub(crate) sent: Instant,
    pub(crate) leases: Vec<String>,
}

/// A listing of the group's leases: when it was asked for, and each lease's ETag.
#[derive(Clone, Debug)]
pub(crate) struct Listed {
    pub(crate) at: Instant,
    pub(crate) versions: BTreeMap<String, String>,
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
    /// This host's last heartbeat that landed: its ranges whose leases ride on it are surely
    /// theirs until it was sent plus the expiry (see [`crate::lease::Beat`]).
    beat: watch::Sender<Option<Beaten>>,
    /// The leases' versions as this host's last listing found them: a riding range whose
    /// lease is listed unchanged since its last check need not read it.
    listed: watch::Sender<Option<Listed>>,
    /// Where idle ranges rest (see `probe`); none when each polls by itself.
    probes: Option<probe::Probes>,
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
        let probes = (options.idle_read > options.max_poll)
            .then(|| probe::Probes::new(group.queue().clone(), options.max_poll));
        Self {
            probes,
            group,
            store,
            handler: Arc::new(handler),
            options,
            stats: Arc::default(),
            leftovers: Leftovers::default(),
            beat: watch::Sender::new(None),
            listed: watch::Sender::new(None),
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
        let mut beat_at = Instant::now();
        let mut beat_failures = 0;
        loop {
            while sweeps.try_join_next().is_some() {}
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                // A host without leases has nothing to keep alive.
                _ = tokio::time::sleep_until(beat_at), if self.options.host_heartbeat && !owned.is_empty() => {
                    // The ranges that run and hold their leases: a range that ended, or is past
                    // its deadline, leaves its lease to expire as it always did.
                    let now = Instant::now();
                    let live = owned
                        .iter()
                        .filter(|(_, r)| !r.task.is_finished() && *r.held.borrow() > now)
                        .map(|(id, _)| id.clone())
                        .collect();
                    (beat_at, beat_failures) = self.heartbeat(live, beat_failures).await;
                }
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
        if self.options.host_heartbeat {
            if let Err(e) = self.store.forget_beat(&self.options.holder()).await {
                debug!(group = self.group.name(), error = %e, "heartbeat not removed; it expires by itself");
            }
        }
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

    /// Writes this host's heartbeat for the leases it runs; returns when the next one is due
    /// (sooner after a failure, backing off to the renewal interval) and the failures in a row.
    async fn heartbeat(&self, leases: Vec<String>, failures: u32) -> (Instant, u32) {
        let sent = Instant::now();
        let expire = duration_ms(self.options.lease_expire);
        let holder = self.options.holder();
        match self
            .store
            .beat(&holder, leases.clone(), self.now(), expire)
            .await
        {
            Ok(_) => {
                self.beat.send_replace(Some(Beaten { sent, leases }));
                (sent + self.options.lease_renew, 0)
            }
            Err(e) => {
                ConsumerStats::bump(&self.stats.errors);
                warn!(group = self.group.name(), host = %self.options.holder(), error = %e, failures = failures + 1, "heartbeat failed; trying again (ranges renew their own leases before the last heartbeat's deadline)");
                let wait = Duration::from_millis(200).saturating_mul(1 << failures.min(8));
                (
                    Instant::now() + wait.min(self.options.lease_renew),
                    failures + 1,
                )
            }
        }
    }

    /// How long `lease` must be seen unchanged before it is expired, as this host judges it.
    fn expiry_of(&self, lease: &Lease) -> Duration {
        expiry_of(&self.options, lease)
    }

    fn takeable(&self, lease: &Lease, beats: &[Beat], observed: &Observed, now: Instant) -> bool {
        takeable(&self.options, lease, beats, observed, now)
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
            .reconcile_judged(now, self.options.leases_per_partition, |l, beats| {
                !owned.contains_key(&l.id) && self.takeable(l, beats, observed, seen_at)
            })
            .await?;
        observed.see(&reconciled.leases, &reconciled.beats, seen_at);
        self.listed.send_replace(Some(Listed {
            at: seen_at,
            versions: reconciled
                .leases
                .iter()
                .filter_map(|l| Some((l.id.clone(), l.etag.clone()?)))
                .collect(),
        }));
        let beats = &reconciled.beats;
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
            .map(|l| {
                let expired =
                    !owned.contains_key(&l.id) && self.takeable(l, beats, observed, seen_at);
                LeaseView {
                    id: l.id.clone(),
                    owner: l.owner.clone(),
                    expired,
                    recovers: expired
                        && l.owner.is_some()
                        && self.expiry_of(l) < self.options.lease_expire,
                }
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
                && (lease.owner.is_none() || !self.takeable(lease, beats, observed, seen_at))
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
            // The lease is surely this host's from when the acquiring write was sent.
            let sent = Instant::now();
            match self.store.acquire(lease, &me, now).await {
                Ok(lease) => {
                    crate::ledger::lease_acquired(self.group.name(), &lease.id, &me);
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
                        beat: self.beat.subscribe(),
                        listed: self.listed.subscribe(),
                        probes: self.probes.clone(),
                        // What the range's first write makes it (the range sets it as it
                        // starts): so the host's next heartbeat lists the lease.
                        held: Arc::new(ordered_watch::Sender::new(
                            sent + self.options.lease_expire - self.options.lease_expire / 10,
                        )),
                    };
                    let id = lease.id.clone();
                    let range = (lease.min_epk.clone(), lease.max_epk.clone());
                    let held = processor.held.subscribe();
                    let task = AbortOnDropHandle::new(tokio::spawn(processor.run(
                        lease,
                        sent,
                        stop.clone(),
                    )));
                    owned.insert(
                        id,
                        Running {
                            stop,
                            task,
                            range,
                            held,
                        },
                    );
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

    /// Delivers the due retries, schedules and expired locks of the ranges this host owns,
    /// and the locks that ran out a while ago anywhere (their range's owner may be dead): a host
    /// without leases sweeps those too, or a dead owner's claims would wait for its lease to
    /// expire wherever the group runs more pods than leases.
    async fn sweep(
        &self,
        ranges: &[(String, String)],
        permits: &Arc<Semaphore>,
        deliverer: &Arc<Deliverer<H>>,
        sweeps: &mut JoinSet<()>,
    ) {
        if ranges.is_empty() && buggify::on(Bug::LeaselessHostsDoNotSweep) {
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

/// How long `lease` must be seen unchanged before it is expired, as a host with `options`
/// judges it: the lease expiry, or the lock's when what its window started may be in the app.
fn expiry_of(options: &HostOptions, lease: &Lease) -> Duration {
    let expire = duration_ms(options.lease_expire);
    Duration::from_millis(lease.unchanged_expiry_ms(expire).max(0) as u64)
}

/// Whether a host with `options` may take `lease` now without its owner handing it over
/// (pure): it is free, or this host has seen it unchanged for its expiry (and, where its
/// holder's heartbeat keeps it, that heartbeat unchanged for the lease expiry), or it is a
/// previous life of this very host whose window holds nothing that may still be in the app.
fn takeable(
    options: &HostOptions,
    lease: &Lease,
    beats: &[Beat],
    observed: &Observed,
    now: Instant,
) -> bool {
    let Some(owner) = &lease.owner else {
        return true;
    };
    let mine = owner
        .split_once('#')
        .map_or(owner.as_str(), |(name, _)| name)
        == options.owner;
    if mine && *owner != options.holder() {
        if buggify::on(Bug::RestartRetakesLease) {
            return true; // the defect: the pod name was the owner
        }
        // This process restarted: its previous life is gone (a container runs once at a
        // time), so only what it may have started, which the app may still hold, waits for
        // the lock to run out.
        if !lease.window.may_be_in_app() {
            return true;
        }
    }
    observed.unchanged_for(&lease.id, &lease_version(lease), now) >= expiry_of(options, lease)
        && lease.riding(beats).is_none_or(|beat| {
            observed.unchanged_for(&beat.id, &beat_version(beat), now) >= options.lease_expire
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Timings that would spin or panic (zero, a shortest poll over the longest) are refused
    /// by name; the defaults pass.
    #[test]
    fn timings_that_would_spin_or_panic_are_refused_by_name() {
        assert!(HostOptions::new("pod").validate().is_ok());
        let zero = Duration::ZERO;
        let base = || HostOptions::new("pod");
        #[rustfmt::skip]
        let cases = [
            ("minPoll", HostOptions { min_poll: zero, ..base() }),
            ("maxPoll", HostOptions { max_poll: zero, ..base() }),
            ("sweepInterval", HostOptions { sweep_interval: zero, ..base() }),
            ("leaseRenew", HostOptions { lease_renew: zero, ..base() }),
            ("leaseAcquire", HostOptions { lease_acquire: zero, ..base() }),
            ("leaseExpire", HostOptions { lease_expire: zero, ..base() }),
            ("checkpointInterval", HostOptions { checkpoint_interval: zero, ..base() }),
            ("minPoll must not be longer", HostOptions { min_poll: Duration::from_secs(6), ..base() }),
        ];
        for (name, options) in cases {
            let error = options.validate().expect_err(name).to_string();
            assert!(error.contains(name), "{name}: {error}");
        }
    }

    /// What happens to a lease between the first look and the decision.
    #[derive(Clone, Copy, Debug)]
    enum Meanwhile {
        Nothing,
        /// Its owner renews it halfway.
        Renewed,
        /// Another host asks for it halfway (a hand-over request, no sign of the owner's life).
        Asked,
        /// Its owner has a heartbeat, written again halfway.
        Beaten,
        /// Its owner has a heartbeat, not written since.
        BeatSilent,
    }

    /// Take-over on this host's monotonic clock, on paused time: a lease of another host
    /// is taken only once seen unchanged for its expiry (the lock's, when what it started may
    /// be in the app), and a previous life of this host's pod gives back at once what
    /// nothing in the app can still hold.
    #[tokio::test(start_paused = true)]
    async fn a_lease_is_taken_only_when_its_owner_is_silent_for_its_expiry() {
        let options = HostOptions {
            lease_expire: Duration::from_secs(60),
            ..HostOptions::new("pod-a")
        };
        let other = "pod-b#1";
        let previous_life = "pod-a#0ld1ife";
        let secs = Duration::from_secs;
        /// A lease of `owner`, with work `out` in the app or not, looked at `after` the
        /// first look with `meanwhile` in between: `takeable` or not.
        struct Case<'a>(&'a str, Option<&'a str>, bool, Meanwhile, Duration, bool);
        let holder = options.holder();
        #[rustfmt::skip]
        let cases = [
            Case("a free lease, at once", None, false, Meanwhile::Nothing, secs(0), true),
            Case("another's, just seen", Some(other), false, Meanwhile::Nothing, secs(0), false),
            Case("another's, silent under its expiry", Some(other), false, Meanwhile::Nothing, secs(59), false),
            Case("another's, silent for its expiry", Some(other), false, Meanwhile::Nothing, secs(60), true),
            Case("another's, renewed meanwhile", Some(other), false, Meanwhile::Renewed, secs(60), false),
            Case("another's, asked for meanwhile", Some(other), false, Meanwhile::Asked, secs(60), true),
            Case("another's with work out, silent under the lock", Some(other), true, Meanwhile::Nothing, secs(9), false),
            Case("another's with work out, silent for the lock", Some(other), true, Meanwhile::Nothing, secs(10), true),
            Case("a previous life's, nothing out", Some(previous_life), false, Meanwhile::Nothing, secs(0), true),
            Case("a previous life's with work out, under the lock", Some(previous_life), true, Meanwhile::Nothing, secs(9), false),
            Case("a previous life's with work out, at the lock", Some(previous_life), true, Meanwhile::Nothing, secs(10), true),
            Case("this life's own, silent", Some(&holder), false, Meanwhile::Nothing, secs(59), false),
            Case("another's, silent, its heartbeat written meanwhile", Some(other), false, Meanwhile::Beaten, secs(60), false),
            Case("another's, silent, its heartbeat silent too", Some(other), false, Meanwhile::BeatSilent, secs(60), true),
            Case("another's with work out, its heartbeat written meanwhile", Some(other), true, Meanwhile::Beaten, secs(10), true),
        ];
        for Case(what, owner, started, meanwhile, after, expected) in cases {
            let mut lease = Lease::new("g", "", "FF", None, 1_000);
            lease.owner = owner.map(str::to_owned);
            lease.lock_ms = Some(10_000);
            if started {
                lease.window.started = vec!["m|\"k\"".into()];
            }
            let mut beats = match meanwhile {
                Meanwhile::Beaten | Meanwhile::BeatSilent => {
                    vec![Beat {
                        etag: Some("1".into()),
                        ..Beat::new("g", other, vec![lease.id.clone()], 1_000, 60_000)
                    }]
                }
                _ => Vec::new(),
            };
            let mut observed = Observed::default();
            let start = Instant::now();
            observed.see(std::slice::from_ref(&lease), &beats, start);
            tokio::time::advance(after / 2).await;
            match meanwhile {
                Meanwhile::Nothing | Meanwhile::BeatSilent => {}
                Meanwhile::Beaten => beats[0].etag = Some("2".into()),
                Meanwhile::Renewed => lease.timestamp += 30_000,
                Meanwhile::Asked => {
                    lease.handover_to = Some("pod-c#2".into());
                    lease.handover_at = Some(31_000);
                }
            }
            observed.see(std::slice::from_ref(&lease), &beats, Instant::now());
            tokio::time::advance(after - after / 2).await;
            assert_eq!(
                takeable(&options, &lease, &beats, &observed, Instant::now()),
                expected,
                "{what}"
            );
        }
    }
}
