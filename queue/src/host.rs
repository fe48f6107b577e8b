//! The change-feed lease loop: a host holds leases on feed ranges of the messages container,
//! reads each owned range from its checkpoint, hands messages to the handler through the
//! group's state machine, and checkpoints the lowest unsettled position.
//!
//! Several hosts of one group balance the leases between them (`balance::plan`); a host that
//! cannot renew a lease stops reading that range (fencing); a graceful stop drains, checkpoints
//! and releases its leases at once so others take them without waiting for expiry.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use azure_data_cosmos::FeedScope;
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tokio_util::task::{AbortOnDropHandle, TaskTracker};
use tracing::{debug, info, instrument, warn};

use crate::balance::{self, LeaseView};
use crate::checkpoint::{Checkpoint, PageEnd, Settle};
use crate::clock::duration_ms;
use crate::config::DeliveryMode;
use crate::consumer::{AdaptivePoll, ConsumerStats, Handler};
use crate::cosmos::feed::FeedReader;
use crate::delivery::{Deliverer, Fate, Fence, Path, Permit};
use crate::error::{QueueError, Result};
use crate::group::Group;
use crate::lease::{Lease, LeaseError, LeaseStore, Marker};
use crate::message::Message;

/// How a [`Host`] runs: its identity, concurrency, polling and lease timings.
#[derive(Clone, Debug)]
pub struct HostOptions {
    /// This host's identity: the owner its leases and locks name (the pod name).
    pub owner: String,
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
    /// How long an unrenewed lease stays its owner's.
    pub lease_expire: Duration,
    /// Write a moved checkpoint at most this often.
    pub checkpoint_interval: Duration,
    /// Leases per physical partition when the group's leases are first created (finer
    /// leases: more hosts than physical partitions can share the work).
    pub leases_per_partition: u32,
    /// Exclusive groups on the lease write path: a delivery still under way after this long
    /// gets a lock of its own (a state document), so that it neither holds the range's
    /// checkpoint nor depends on the range's lease.
    pub promote_after: Duration,
}

impl HostOptions {
    /// Options with the change feed processor's defaults, as `owner`.
    pub fn new(owner: impl Into<String>) -> Self {
        Self {
            owner: owner.into(),
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

/// One consumer host of a group.
pub struct Host<H> {
    group: Group,
    store: LeaseStore,
    handler: Arc<H>,
    options: HostOptions,
    stats: Arc<ConsumerStats>,
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
            owner: self.options.owner.clone(),
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
        let mut owned: HashMap<String, Running> = HashMap::new();
        let mut sweeps = JoinSet::new();
        let tracker = TaskTracker::new();
        let mut acquire = tokio::time::interval(self.options.lease_acquire);
        let mut sweep = tokio::time::interval(self.options.sweep_interval);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        acquire.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            while sweeps.try_join_next().is_some() {}
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = acquire.tick() => {
                    if let Err(e) = self.balance_round(&mut owned, &permits, &deliverer, &tracker).await {
                        ConsumerStats::bump(&self.stats.errors);
                        warn!(group = self.group.name(), host = %self.options.owner, error = %e, "lease round failed; trying again next interval");
                    }
                }
                _ = sweep.tick() => {
                    let ranges: Vec<_> = owned.values().map(|r| r.range.clone()).collect();
                    self.sweep(&ranges, &permits, &deliverer, &mut sweeps).await
                }
            }
        }
        info!(group = self.group.name(), host = %self.options.owner, leases = owned.len(), "stopping: draining and releasing leases");
        for running in owned.values() {
            running.stop.cancel();
        }
        for (_, running) in owned {
            let _ = running.task.await;
        }
        while sweeps.join_next().await.is_some() {}
        tracker.close();
        if !tracker.is_empty() {
            info!(group = self.group.name(), host = %self.options.owner, deliveries = tracker.len(), "waiting for deliveries of lost ranges to settle");
        }
        tracker.wait().await;
        self.stats
            .leases_owned
            .store(0, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// One acquire round: reap ended ranges, create/split leases, take what balance needs.
    async fn balance_round(
        &self,
        owned: &mut HashMap<String, Running>,
        permits: &Arc<Semaphore>,
        deliverer: &Arc<Deliverer<H>>,
        tracker: &TaskTracker,
    ) -> Result<()> {
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
        let expire = duration_ms(self.options.lease_expire);
        let reconciled = self
            .store
            .reconcile_with(now, expire, self.options.leases_per_partition)
            .await?;
        for id in &reconciled.split_pending {
            if let Some(running) = owned.get(id) {
                info!(group = self.group.name(), lease = %id, "range split: handing the lease back so it can be split");
                running.stop.cancel();
            }
        }
        let views: Vec<LeaseView> = reconciled
            .leases
            .iter()
            .map(|l| LeaseView {
                id: l.id.clone(),
                owner: l.owner.clone(),
                // A lease in our name that this process does not run is left over from a
                // previous life of this host (a restarted pod): take it back at once.
                expired: (l.is_expired(now, expire)
                    || l.owner.as_deref() == Some(self.options.owner.as_str()))
                    && !owned.contains_key(&l.id),
            })
            .collect();
        for take in balance::plan(&views, &self.options.owner) {
            if owned.contains_key(&take.lease_id)
                || reconciled.split_pending.contains(&take.lease_id)
            {
                continue;
            }
            let Some(lease) = reconciled.leases.iter().find(|l| l.id == take.lease_id) else {
                continue;
            };
            let me = self.options.owner.as_str();
            if lease.reserved_for_other(me, now, expire) {
                continue; // being handed over to the host that asked for it
            }
            // Where the lease fences first deliveries (stream groups, and exclusive ones on the
            // lease write path), a live owner is asked to hand the lease over rather than have
            // it stolen: a steal makes the new owner deliver again what the owner has under
            // way. Only an owner that does not answer within the expiry has the lease taken.
            if let (Some(victim), true) = (&take.steal_from, self.hands_over()) {
                if lease.handover_to.as_deref() != Some(me) {
                    match self.store.request_handover(lease, me, now).await {
                        Ok(_) => {
                            info!(group = self.group.name(), lease = %lease.range_label(), owner = %victim, to = %me, "asked for the lease for balance")
                        }
                        Err(LeaseError::Lost) => {}
                        Err(LeaseError::Other(e)) => return Err(e),
                    }
                    continue;
                }
                if lease.handover_at.is_some_and(|at| now - at < expire) {
                    continue; // asked; the owner is draining
                }
                warn!(group = self.group.name(), lease = %lease.range_label(), owner = %victim, "the owner did not hand the lease over in time; taking it");
            }
            match self.store.acquire(lease, &self.options.owner, now).await {
                Ok(lease) => {
                    match &take.steal_from {
                        Some(victim) => {
                            info!(group = self.group.name(), lease = %lease.range_label(), owner = %self.options.owner, from = %victim, "lease stolen for balance")
                        }
                        None => {
                            info!(group = self.group.name(), lease = %lease.range_label(), owner = %self.options.owner, "lease acquired")
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
                    };
                    let id = lease.id.clone();
                    let range = (lease.min_epk.clone(), lease.max_epk.clone());
                    let task =
                        AbortOnDropHandle::new(tokio::spawn(processor.run(lease, stop.clone())));
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
        Ok(())
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
}

/// What a message of an ordered group tells the next message of its key: its id and fate.
type KeyFate = (String, Fate);

/// When a delivery may start.
enum Turn {
    /// Ordered groups: after the previous message of the key has settled.
    Key {
        previous: Option<oneshot::Receiver<KeyFate>>,
        next: oneshot::Sender<KeyFate>,
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
    /// The range drains or is handed over: the same, except within a page that has started
    /// (the checkpoint moves by whole pages, so a page half done would be delivered again by
    /// the next owner). The drain then takes at most about a page.
    draining: CancellationToken,
    /// The range is lost or drains: deliveries stop retrying failed writes, and what they
    /// could not record holds the checkpoint.
    give_up: CancellationToken,
    /// The range drains or is handed over: lease-fenced deliveries of the lease write path
    /// get locks of their own, so the drain does not wait for long work.
    promote_now: CancellationToken,
}

/// What a range's next owner learns from the lease's window (exclusive groups): which of
/// the documents past the continuation are done, pending on a state document, never
/// started, or delivered without a recorded outcome (redeliveries).
#[derive(Debug, Default)]
struct Recovery {
    /// Documents of the window still to come.
    left: u32,
    done: std::collections::HashSet<String>,
    pending: std::collections::HashSet<String>,
    unstarted: std::collections::HashSet<String>,
    /// Documents to look up the state of first: the lease was last written by a host whose
    /// first deliveries wrote claims (another version, or the `claims` path).
    check: usize,
}

/// What the range does with a document it read.
#[derive(Debug, PartialEq)]
enum Handling {
    /// Deliver it this way.
    Deliver(Path),
    /// Hand nothing out: the window says it is already this.
    Known(Settle),
}

impl Recovery {
    fn new(lease: &Lease, look_up_first: usize) -> Self {
        let w = &lease.window;
        Self {
            left: w.read,
            done: w.done.iter().cloned().collect(),
            pending: w.pending.iter().cloned().collect(),
            unstarted: w.unstarted.iter().cloned().collect(),
            check: look_up_first,
        }
    }

    /// The next document read, in feed order (pure). Ordered groups deliver a pending
    /// message through its state document rather than skip it: the key's later messages
    /// must wait behind it.
    fn next(&mut self, id: &str, ordered: bool) -> Handling {
        if self.left > 0 {
            self.left -= 1;
            self.check = self.check.saturating_sub(1);
            return if self.done.contains(id) {
                Handling::Known(Settle::Done)
            } else if self.pending.contains(id) {
                match ordered {
                    true => Handling::Deliver(Path::Checked),
                    false => Handling::Known(Settle::Pending),
                }
            } else if self.unstarted.contains(id) {
                Handling::Deliver(Path::Feed)
            } else {
                Handling::Deliver(Path::Recovered)
            };
        }
        if self.check > 0 {
            self.check -= 1;
            return Handling::Deliver(Path::Checked);
        }
        Handling::Deliver(Path::Feed)
    }
}

/// One message of a range on its way to the handler.
struct RangeDelivery<H> {
    deliverer: Arc<Deliverer<H>>,
    permits: Arc<Semaphore>,
    stop: Stops,
    page_started: Arc<AtomicBool>,
    /// How the message is claimed. [`Path::Checked`] in an ordered stream group's first window
    /// read after taking a range: its previous owner may have left messages there that it was
    /// retrying in place (it died), that wait for their schedule, or that it settled in a page
    /// it could not checkpoint whole (it drained or handed the range over while a message of
    /// that page waited): those are waited for, or skipped, not delivered past. One point read
    /// per message of that window; none after it, none in other groups. Exclusive groups
    /// learn the same from the lease's window ([`Recovery`]).
    path: Path,
    /// The lease write path's signals, for a first delivery that the lease fences.
    fence: Option<Fence>,
}

impl<H: Handler> RangeDelivery<H> {
    async fn run(self, message: Message, turn: Turn) -> Fate {
        match turn {
            Turn::Key { previous, next } => {
                let id = message.id.clone();
                let fate = match self.after_previous_of_key(&message, previous).await {
                    true => self.deliver(message, None).await,
                    false => Fate::Unstarted,
                };
                let _ = next.send((id, fate));
                fate
            }
            Turn::Feed { previous, next } => {
                if let Some(previous) = previous {
                    let _ = previous.await;
                }
                self.deliver(message, next).await
            }
        }
    }

    /// Waits until the key's previous message is settled; `false` when it never will be here
    /// (nothing recorded, or the range stopped meanwhile): this one must not overtake it.
    async fn after_previous_of_key(
        &self,
        message: &Message,
        previous: Option<oneshot::Receiver<KeyFate>>,
    ) -> bool {
        let Some(previous) = previous else {
            return true;
        };
        let (previous_id, fate) = previous
            .await
            .unwrap_or_else(|_| (String::new(), Fate::Unrecorded));
        match fate {
            Fate::Settled | Fate::Completed => true,
            Fate::Unrecorded | Fate::Unstarted => false,
            // Its state document brings it back (its lock was lost, or expires): another
            // delivery settles it, and only then may this one go.
            Fate::Pending => tokio::select! {
                biased;
                _ = self.stop.step_aside.cancelled() => false,
                _ = self.stop.draining.cancelled() => false,
                _ = self.deliverer.settled(&message.partition_key, &previous_id) => true,
            },
        }
    }

    async fn deliver(self, message: Message, turn_done: Option<oneshot::Sender<()>>) -> Fate {
        let mut stay = false;
        let permit = loop {
            tokio::select! {
                biased;
                _ = self.stop.step_aside.cancelled() => return Fate::Unstarted,
                _ = self.stop.draining.cancelled(), if !stay => {
                    stay = self.page_started.load(Ordering::SeqCst);
                    if !stay {
                        return Fate::Unstarted;
                    }
                }
                permit = Arc::clone(&self.permits).acquire_owned() => break permit.expect("never closed"),
            }
        };
        self.page_started.store(true, Ordering::SeqCst);
        drop(turn_done);
        let mut permit = Permit::held(Arc::clone(&self.permits), permit);
        // Boxed: a range reads up to `max_in_flight_per_range` ahead, and each waiting task
        // would otherwise be as large as a delivery in progress (its HTTP and SDK futures,
        // ≈ 14 KB): 14 MiB for 1,024 waiting messages where 64 are processed.
        Box::pin(self.deliverer.process(
            message,
            &self.stop.give_up,
            &mut permit,
            self.path,
            self.fence,
        ))
        .await
    }
}

/// Drops the chains of keys whose last message settled (bounded memory); a key whose last
/// message is still pending keeps its chain, so its next message still waits.
fn forget_settled_keys(chains: &mut HashMap<String, oneshot::Receiver<KeyFate>>) {
    chains.retain(|_, rx| match rx.try_recv() {
        Err(oneshot::error::TryRecvError::Empty) => true,
        Ok((id, Fate::Pending)) => {
            let (tx, again) = oneshot::channel();
            let _ = tx.send((id, Fate::Pending));
            *rx = again;
            true
        }
        Ok(_) | Err(oneshot::error::TryRecvError::Closed) => false,
    });
}

/// The range's lease is gone. Deliveries already under way finish and settle under their own
/// claims; those still waiting for a permit are not started: the checkpoint never passed them,
/// so the new owner reads them again. (Delivering them anyway would only hand the app a second
/// copy in stream mode, and waste a claim attempt in exclusive mode.)
fn abandon(stops: &Stops, deliveries: &mut JoinSet<()>) {
    stops.step_aside.cancel();
    // Waits (schedules, held messages, back-offs of writes that keep failing) end: the range's
    // next owner brings those messages back. Settles of recorded claims keep trying until
    // their locks expire; the host waits for them before it returns.
    stops.give_up.cancel();
    deliveries.detach_all();
}

/// The lease expiry hosts use unless told otherwise (the change feed processor's 60 s); also
/// what tools that create or judge leases from outside a host assume.
pub const DEFAULT_LEASE_EXPIRE: Duration = Duration::from_secs(60);

/// What one range's processing keeps while its lease is held.
struct Reading {
    lease: Lease,
    reader: FeedReader,
    /// Deliveries report here: (page, message id, fate).
    done_tx: mpsc::UnboundedSender<(u64, String, Fate)>,
    done_rx: mpsc::UnboundedReceiver<(u64, String, Fate)>,
    deliveries: JoinSet<()>,
    stops: Stops,
    checkpoint: Checkpoint,
    in_flight: usize,
    poll: AdaptivePoll,
    /// When the next read is due: fixed once the last read's back-off is known, so the other
    /// events of the loop (settlements, renewals, flushes) do not push it back.
    read_at: Option<tokio::time::Instant>,
    /// Still reading the feed (not draining or handing over).
    reading: bool,
    /// Ordered groups: each key's last message's fate, which its next message waits for.
    chains: HashMap<String, oneshot::Receiver<KeyFate>>,
    /// Messages read so far; the first window after taking a range is checked for state the
    /// previous owner left (see `RangeDelivery::check_state`).
    read: usize,
    /// The last delivery's "got a permit" signal (unordered groups).
    in_feed_order: Option<oneshot::Receiver<()>>,
    /// Exclusive groups: what the lease's window says of what comes next.
    recovery: Option<Recovery>,
    /// The lease write path: the window changed since the lease was last written.
    unwritten: bool,
    /// The lease write path: where each sub-range of the feed was read up to (see [`SubFeed`]).
    rewind: Option<Rewind>,
    /// The lease write path: ids this processor has read, newest last (bounded): a feed that
    /// serves earlier documents again mid-read (the emulator renumbers LSNs when partitions
    /// merge) must not deliver again what this range completed with nothing but its lease.
    seen: Option<Seen>,
}

/// Ids read lately, in read order, at most [`SEEN_CAP`]. Each id is stored once, shared by
/// the set and the order (a range at the cap holds ≈ 2 MB instead of ≈ 3 MB).
#[derive(Debug, Default)]
struct Seen {
    ids: std::collections::HashSet<Arc<str>>,
    order: std::collections::VecDeque<Arc<str>>,
}

/// How many ids a range remembers having read (about 100 bytes each, with the set's slot).
const SEEN_CAP: usize = 20_000;

impl Seen {
    /// Drops the documents read before (keeping the first of repeats within the page), and
    /// remembers the rest.
    fn first_reads(&mut self, docs: Vec<serde_json::Value>) -> Vec<serde_json::Value> {
        let before = docs.len();
        let fresh: Vec<serde_json::Value> = docs
            .into_iter()
            .filter(
                |doc| match doc.get("id").and_then(serde_json::Value::as_str) {
                    Some(id) if self.ids.contains(id) => false,
                    Some(id) => {
                        let id: Arc<str> = Arc::from(id);
                        self.ids.insert(Arc::clone(&id));
                        self.order.push_back(id);
                        true
                    }
                    None => true,
                },
            )
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

    /// The host stops: stop reading, let what is under way settle.
    fn drain(&mut self) {
        self.reading = false;
        self.stops.give_up.cancel();
        self.stops.draining.cancel();
        self.stops.promote_now.cancel();
        debug!(in_flight = self.in_flight, "draining range");
    }

    fn delivered(&mut self, seq: u64, id: &str, fate: Fate) {
        while self.deliveries.try_join_next().is_some() {}
        self.in_flight -= 1;
        self.checkpoint.settle(seq, id, fate.settle());
        self.unwritten |= self.recovery.is_some();
    }

    /// Another host asked for the range (stream groups): stop reading, let what is under way
    /// settle, then the drain checkpoints and releases it (the release keeps the reservation).
    fn hand_over(&mut self, current: Lease) {
        self.lease = current;
        if self.reading {
            info!(
                to = self.lease.handover_to.as_deref().unwrap_or_default(),
                "handing the range over: draining, then checkpoint and release"
            );
            self.reading = false;
            self.stops.give_up.cancel();
            self.stops.draining.cancel();
            self.stops.promote_now.cancel();
        }
    }

    /// When a delivery may start: FIFO per key waits for the key's previous message;
    /// otherwise permits are taken in feed order, so that when the range stops, what is under
    /// way is the oldest, and what steps aside comes after it, behind the checkpoint, with
    /// nothing done after it.
    fn turn(&mut self, ordered: bool, message: &Message) -> Turn {
        if ordered {
            let (tx, rx) = oneshot::channel();
            Turn::Key {
                previous: self.chains.insert(message.partition_key.canonical(), rx),
                next: tx,
            }
        } else {
            let (tx, rx) = oneshot::channel();
            Turn::Feed {
                previous: self.in_feed_order.replace(rx),
                next: Some(tx),
            }
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

impl<H: Handler> RangeProcessor<H> {
    fn now(&self) -> i64 {
        self.group.queue().clock().now_ms()
    }

    #[instrument(skip_all, fields(group = %lease.group, lease = %lease.range_label()))]
    async fn run(self, lease: Lease, stop: CancellationToken) -> RangeExit {
        let mut r = match self.start(lease) {
            Ok(r) => r,
            Err(e) => return RangeExit::Failed(e),
        };
        let mut renew = tokio::time::interval(self.options.lease_renew);
        renew.reset(); // acquiring just renewed it
        let mut flush = tokio::time::interval(self.options.checkpoint_interval);
        while !r.drained() {
            let delay = r.poll.delay();
            let read_at = *r
                .read_at
                .get_or_insert_with(|| tokio::time::Instant::now() + delay);
            let step = tokio::select! {
                biased;
                _ = stop.cancelled(), if r.reading => {
                    r.drain();
                    None
                }
                Some((seq, id, fate)) = r.done_rx.recv() => {
                    r.delivered(seq, &id, fate);
                    None
                }
                _ = renew.tick() => self.renew(&mut r).await,
                _ = flush.tick(), if r.checkpoint_due() => self.flush(&mut r).await,
                _ = tokio::time::sleep_until(read_at), if r.reading && self.room(&r) => {
                    r.read_at = None;
                    self.read_page(&mut r).await
                }
            };
            if let Some(exit) = step {
                abandon(&r.stops, &mut r.deliveries);
                return exit;
            }
        }
        self.finish(r).await
    }

    /// Whether the range may read another page: fewer messages in flight than its limit,
    /// and (exclusive groups) a window small enough to write with the lease.
    fn room(&self, r: &Reading) -> bool {
        let limit = self.options.max_in_flight_per_range;
        r.in_flight < limit
            && (r.recovery.is_none() || (r.checkpoint.window_docs() as usize) < limit * 4)
    }

    fn start(&self, lease: Lease) -> Result<Reading> {
        let range = lease.feed_range()?;
        let config = self.group.config();
        let recovery = (config.mode == DeliveryMode::Exclusive).then(|| {
            let wrote_claims = lease.writes != Some(crate::config::ExclusiveWrites::Lease);
            let look_up = match config.lease_recorded() && wrote_claims {
                true => self.options.max_in_flight_per_range,
                false => 0,
            };
            Recovery::new(&lease, look_up)
        });
        // The lease's markers (a split child holds its parent's, of both halves).
        let markers: Vec<(String, Marker)> = lease
            .window
            .markers()
            .into_iter()
            .filter_map(|marker| {
                let key = crate::message::MessageKey::from_json(marker.pk.clone()).ok()?;
                Some((self.group.queue().message_epk(&key), marker))
            })
            .collect();
        let rewind = config.lease_recorded().then(|| {
            let whole = (lease.min_epk.clone(), lease.max_epk.clone());
            Rewind::start(&markers, &continuation_ranges(&lease.continuation, &whole))
        });
        let checkpoint = Checkpoint::new(lease.continuation.clone()).after(markers);
        let checkpoint = match recovery.is_some() {
            true => checkpoint.tracking_ids(),
            false => checkpoint,
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
        Ok(Reading {
            checkpoint,
            lease,
            reader,
            done_tx,
            done_rx,
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
            read: 0,
            in_feed_order: None,
            recovery,
            unwritten: false,
            seen: config.lease_recorded().then(Seen::default),
            rewind,
        })
    }

    /// Renews the lease. Fencing: when another host owns the range now, or the lease expired
    /// without a renewal, nothing more is read from it.
    async fn renew(&self, r: &mut Reading) -> Step {
        // A record or checkpoint written since the last tick renewed it already.
        if self.now() - r.lease.timestamp < duration_ms(self.options.lease_renew) / 2 {
            return None;
        }
        match self.store.renew(&r.lease, self.now()).await {
            Ok(renewed) => r.lease = renewed,
            Err(LeaseError::Lost) => match self.current(&r.lease).await {
                // Changed but still ours: another host asked for it (stream groups).
                Ok(Some(current)) if current.handover_to.is_some() => r.hand_over(current),
                Ok(Some(current)) => r.lease = current,
                _ => {
                    warn!(owner = %self.options.owner, in_flight = r.in_flight, "lease lost; stopped reading the range");
                    return Some(RangeExit::Lost);
                }
            },
            Err(LeaseError::Other(e)) => {
                warn!(error = %e, "lease renewal failed; retrying");
                if self.now() - r.lease.timestamp > duration_ms(self.options.lease_expire) {
                    warn!("lease expired without renewal; stopped reading the range");
                    return Some(RangeExit::Lost);
                }
            }
        }
        None
    }

    /// Reads the next page and hands its messages out.
    async fn read_page(&self, r: &mut Reading) -> Step {
        let crate::cosmos::feed::Page {
            docs,
            token,
            partition,
        } = match r.reader.next_page().await {
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
        } else {
            r.poll.observed(docs.len(), self.options.page_size as usize);
            // Stream mode has no claims to stop a second reader: check the lease is still
            // ours before handing out a page (1 RU a page). The lease write path's record of
            // the page does the same, below.
            if self.group.config().mode == DeliveryMode::Stream {
                match self.current_confirmed(&r.lease).await {
                    Err(()) => {
                        warn!(owner = %self.options.owner, in_flight = r.in_flight, "lease taken by another host; stopped reading the range");
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
                    docs = seen.first_reads(docs);
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
        let (deliveries, known) = self.handling(r, docs);
        let seq = r.checkpoint.read_docs(token, count, deliveries.len(), last);
        for (id, fate) in known {
            r.checkpoint.known(seq, &id, fate);
            r.unwritten = true;
        }
        if self.group.config().lease_recorded() && !deliveries.is_empty() {
            // The page's delivery is recorded before it starts: a next owner after a crash
            // then knows these are redeliveries. Also the fence: it fails once the lease is
            // another host's.
            match self.write_record(r).await {
                Ok(true) => {}
                Ok(false) => {
                    for (message, _) in &deliveries {
                        r.checkpoint.settle(seq, &message.id, Settle::Unstarted);
                    }
                    return None;
                }
                Err(exit) => return Some(exit),
            }
        }
        self.dispatch(r, seq, deliveries);
        if r.chains.len() > MAX_IDLE_CHAINS {
            forget_settled_keys(&mut r.chains);
        }
        None
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
        let id = |doc: &serde_json::Value| {
            doc.get("id")
                .and_then(serde_json::Value::as_str)
                .map(str::to_owned)
        };
        if let Some(at) = docs
            .iter()
            .position(|d| id(d).as_deref() == Some(&seek.marker.id))
        {
            if at > 0 || seek.seeking {
                warn!(skipped = at + 1, "the feed served documents before the checkpoint again; skipped up to the last one recorded");
            }
            feed.seek = None;
            return docs.into_iter().skip(at + 1).collect();
        }
        if seek.position.is_none() {
            let field = self.group.queue().config().partition_key_field();
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
    #[allow(clippy::type_complexity)]
    fn handling(
        &self,
        r: &mut Reading,
        docs: Vec<serde_json::Value>,
    ) -> (Vec<(Message, Path)>, Vec<(String, Settle)>) {
        let config = self.group.config();
        let field = self.group.queue().config().partition_key_field();
        let check_stream = config.mode == DeliveryMode::Stream && config.ordered;
        let (mut deliveries, mut known) = (Vec::new(), Vec::new());
        for doc in docs {
            let message = match Message::from_document(&doc, field) {
                Ok(message) => message,
                Err(reason) => {
                    ConsumerStats::bump(&self.stats.malformed);
                    warn!(queue = self.group.queue().name(), id = ?doc.get("id"), %reason, "skipping a malformed document in the messages container");
                    if let Some(recovery) = &mut r.recovery {
                        recovery.left = recovery.left.saturating_sub(1);
                    }
                    continue;
                }
            };
            let handling = match &mut r.recovery {
                Some(recovery) => recovery.next(&message.id, config.ordered),
                None if check_stream && r.read < self.options.max_in_flight_per_range => {
                    Handling::Deliver(Path::Checked)
                }
                None => Handling::Deliver(Path::Feed),
            };
            r.read += 1;
            match handling {
                Handling::Deliver(path) => deliveries.push((message, path)),
                Handling::Known(fate) => known.push((message.id, fate)),
            }
        }
        (deliveries, known)
    }

    /// One delivery task per message of page `seq`, each taking its turn.
    fn dispatch(&self, r: &mut Reading, seq: u64, messages: Vec<(Message, Path)>) {
        let config = self.group.config();
        let ordered = config.ordered;
        let fenced = config.lease_recorded();
        let page_started = Arc::new(AtomicBool::new(false));
        for (message, path) in messages {
            r.in_flight += 1;
            let turn = r.turn(ordered, &message);
            let (promoted_tx, mut promoted) = oneshot::channel();
            let fence = fenced.then(|| Fence {
                promote_after: self.options.promote_after,
                promote_now: r.stops.promote_now.clone(),
                lost: r.stops.step_aside.clone(),
                promoted: Some(promoted_tx),
            });
            let delivery = RangeDelivery {
                deliverer: Arc::clone(&self.deliverer),
                permits: Arc::clone(&self.permits),
                stop: r.stops.clone(),
                page_started: Arc::clone(&page_started),
                path,
                fence,
            };
            let done = r.done_tx.clone();
            r.deliveries.spawn(self.deliveries.track_future(async move {
                let id = message.id.clone();
                let run = delivery.run(message, turn);
                tokio::pin!(run);
                // A delivery that gets a lock of its own is reported as pending at once: the
                // range may pass it, and the delivery goes on under its lock.
                let fate = tokio::select! {
                    biased;
                    fate = &mut run => fate,
                    Ok(()) = &mut promoted => {
                        let _ = done.send((seq, id, Fate::Pending));
                        run.await;
                        return;
                    }
                };
                let _ = done.send((seq, id, fate));
            }));
        }
    }

    /// Drained: record where the range is and hand the lease back.
    async fn finish(&self, mut r: Reading) -> RangeExit {
        // Deliveries with locks of their own go on after the range; the host waits for them.
        r.deliveries.detach_all();
        if r.checkpoint_due() {
            if let Some(exit) = self.flush(&mut r).await {
                return exit;
            }
        }
        let mut lease = r.lease.clone();
        for _ in 0..RELEASE_TRIES {
            match self.store.release(&lease).await {
                Ok(()) => {
                    info!(owner = %self.options.owner, "lease released");
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
        if r.recovery.is_none() {
            return self
                .write_checkpoint(&mut r.lease, r.checkpoint.position())
                .await;
        }
        self.write_record(r).await.err()
    }

    /// Writes the lease with the checkpoint and the window (exclusive groups), and counts the
    /// completions it records. `Ok(false)` when the lease is being handed over (the range
    /// drains); a write that keeps failing is retried until the lease would expire, then the
    /// range stops (the lease, still in this host's name, is taken back at the next acquire
    /// round, and what the write would have recorded is delivered again).
    ///
    /// Completions are counted as the write is sent, and taken back when it is known not to
    /// have landed: a write whose answer is lost (a timeout after the service applied it) is
    /// recorded, and the process may die before it learns so, while a refusal is known at once.
    async fn write_record(&self, r: &mut Reading) -> Result<bool, RangeExit> {
        let completions = r.checkpoint.unwritten_completions();
        r.checkpoint.completions_written(completions);
        self.stats
            .completed
            .fetch_add(completions, std::sync::atomic::Ordering::Relaxed);
        let (written, result) = self.try_record(r).await;
        if !written {
            r.checkpoint.completions_unwritten(completions);
            self.stats
                .completed
                .fetch_sub(completions, std::sync::atomic::Ordering::Relaxed);
        }
        result
    }

    /// [`Self::write_record`]'s write: whether it landed, and what the range does next.
    async fn try_record(&self, r: &mut Reading) -> (bool, Result<bool, RangeExit>) {
        let writes = self.group.config().exclusive_writes;
        let position = r.checkpoint.position().clone();
        let window = r.checkpoint.record();
        let expire = duration_ms(self.options.lease_expire);
        let mut attempt = 0u32;
        // Tried until the lease would expire: giving up sooner would throw completions away
        // (the next owner delivers them again) while the lease may still be good.
        while self.now() - r.lease.timestamp < expire {
            attempt += 1;
            let now = self.now();
            let written = self
                .store
                .record(&r.lease, position.clone(), window.clone(), writes, now)
                .await;
            match written {
                Ok(written) => {
                    r.lease = written;
                    r.unwritten = false;
                    if r.reading && r.lease.handover_to.is_some() {
                        let current = r.lease.clone();
                        r.hand_over(current);
                        return (true, Ok(false));
                    }
                    return (true, Ok(true));
                }
                Err(LeaseError::Lost) => match self.current(&r.lease).await {
                    Ok(Some(current)) if current.handover_to.is_some() && r.reading => {
                        r.hand_over(current);
                        return (false, Ok(false));
                    }
                    // Still ours (asked for, or an earlier write landed unanswered): again.
                    Ok(Some(current)) => r.lease = current,
                    Ok(None) => {}
                    Err(()) => {
                        warn!(owner = %self.options.owner, in_flight = r.in_flight, "lease taken by another host; stopped reading the range");
                        return (false, Err(RangeExit::Lost));
                    }
                },
                Err(LeaseError::Other(e)) => {
                    ConsumerStats::bump(&self.stats.errors);
                    debug!(error = %e, attempt, "lease write failed; retrying");
                    // It may have landed with its answer lost: then it is done.
                    if let Ok(Some(current)) = self.current(&r.lease).await {
                        let landed = current.window == window && current.continuation == position;
                        r.lease = current;
                        if landed {
                            r.unwritten = false;
                            return (true, Ok(true));
                        }
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50 << attempt.min(4))).await;
        }
        warn!(group = self.group.name(), lease = %r.lease.range_label(), "the lease could not be written before it expired; stopped reading the range");
        (false, Err(RangeExit::Lost))
    }

    /// The lease as stored when it still names this host (`Ok(None)`: a read error; renewal
    /// decides); `Err(())` when another host owns it or it is gone.
    async fn current(&self, lease: &Lease) -> Result<Option<Lease>, ()> {
        match self.store.read(&lease.id).await {
            Ok(Some(current)) if current.owner.as_deref() == Some(self.options.owner.as_str()) => {
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

    /// `Some(exit)` when the lease is gone.
    async fn write_checkpoint(
        &self,
        lease: &mut Lease,
        checkpoint: &Option<String>,
    ) -> Option<RangeExit> {
        let token = checkpoint.clone()?;
        match self.store.checkpoint(lease, token, self.now()).await {
            Ok(written) => {
                debug!(group = self.group.name(), lease = %lease.range_label(), "checkpoint");
                *lease = written;
                None
            }
            Err(LeaseError::Lost) => {
                // Still ours (another host asked for it): write again on what is stored.
                if let Ok(Some(current)) = self.current(lease).await {
                    *lease = current;
                    return Box::pin(self.write_checkpoint(lease, checkpoint)).await;
                }
                warn!(group = self.group.name(), lease = %lease.range_label(), "lease lost at checkpoint; stopped reading the range");
                Some(RangeExit::Lost)
            }
            Err(LeaseError::Other(e)) => {
                warn!(group = self.group.name(), lease = %lease.range_label(), error = %e, "checkpoint failed; retrying");
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(ids: &[&str]) -> Vec<serde_json::Value> {
        ids.iter()
            .map(|id| serde_json::json!({ "id": id }))
            .collect()
    }

    fn ids(docs: &[serde_json::Value]) -> Vec<&str> {
        docs.iter()
            .map(|d| d["id"].as_str().unwrap_or("-"))
            .collect()
    }

    #[test]
    fn a_range_delivers_each_id_it_read_once_and_forgets_the_oldest_past_the_cap() {
        let mut seen = Seen::default();
        assert_eq!(ids(&seen.first_reads(page(&["a", "b", "a"]))), ["a", "b"]);
        // Served again after a merge renumbered the feed: skipped; documents without an id
        // are left for the malformed-document path.
        let again = seen.first_reads(vec![
            serde_json::json!({"id": "b"}),
            serde_json::json!({"no": "id"}),
            serde_json::json!({"id": "c"}),
        ]);
        assert_eq!(ids(&again), ["-", "c"]);
        let many: Vec<String> = (0..SEEN_CAP).map(|i| format!("m{i}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert_eq!(seen.first_reads(page(&many)).len(), SEEN_CAP);
        assert_eq!((seen.ids.len(), seen.order.len()), (SEEN_CAP, SEEN_CAP));
        // "a", "b" and "c" were the oldest: forgotten, so read as new; "m0" is still known.
        assert_eq!(ids(&seen.first_reads(page(&["a", "m0", "c"]))), ["a", "c"]);
    }
}
