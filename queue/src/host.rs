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
use crate::checkpoint::Checkpoint;
use crate::clock::duration_ms;
use crate::config::DeliveryMode;
use crate::consumer::{AdaptivePoll, ConsumerStats, Handler};
use crate::cosmos::feed::FeedReader;
use crate::delivery::{Deliverer, Fate, Permit};
use crate::error::{QueueError, Result};
use crate::group::Group;
use crate::lease::{Lease, LeaseError, LeaseStore};
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
    fn stream(&self) -> bool {
        self.group.config().mode == crate::config::DeliveryMode::Stream
    }

    /// A host of `group` handing messages to `handler`.
    pub fn new(group: Group, handler: H, options: HostOptions) -> Self {
        let store = LeaseStore::new(group.queue().clone(), group.name())
            .with_start_from(group.config().start_from);
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
            // Stream groups ask a live owner to hand a lease over rather than steal it: a steal
            // makes the new owner deliver again everything since the last checkpoint. Only an
            // owner that does not answer within the expiry has the lease taken.
            if let (Some(victim), true) = (&take.steal_from, self.stream()) {
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
}

/// One message of a range on its way to the handler.
struct RangeDelivery<H> {
    deliverer: Arc<Deliverer<H>>,
    permits: Arc<Semaphore>,
    stop: Stops,
    page_started: Arc<AtomicBool>,
    /// Look for a state document even in stream mode: in an ordered stream group, the first
    /// window read after taking a range. Its previous owner may have left messages there that
    /// it was retrying in place (it died), that wait for their schedule, or that it settled in
    /// a page it could not checkpoint whole (it drained or handed the range over while a
    /// message of that page waited): those are waited for, or skipped, not delivered past.
    /// One point read per message of that window; none after it, none in other groups.
    check_state: bool,
}

impl<H: Handler> RangeDelivery<H> {
    async fn run(self, message: Message, turn: Turn) -> Fate {
        match turn {
            Turn::Key { previous, next } => {
                let id = message.id.clone();
                let fate = match self.after_previous_of_key(&message, previous).await {
                    true => self.deliver(message, None).await,
                    false => Fate::Unrecorded,
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
            Fate::Settled => true,
            Fate::Unrecorded => false,
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
                _ = self.stop.step_aside.cancelled() => return Fate::Unrecorded,
                _ = self.stop.draining.cancelled(), if !stay => {
                    stay = self.page_started.load(Ordering::SeqCst);
                    if !stay {
                        return Fate::Unrecorded;
                    }
                }
                permit = Arc::clone(&self.permits).acquire_owned() => break permit.expect("never closed"),
            }
        };
        self.page_started.store(true, Ordering::SeqCst);
        drop(turn_done);
        let mut permit = Permit::held(Arc::clone(&self.permits), permit);
        self.deliverer
            .process(message, &self.stop.give_up, &mut permit, self.check_state)
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
    /// Deliveries report here: (page, whether the message's fate is recorded).
    done_tx: mpsc::UnboundedSender<(u64, bool)>,
    done_rx: mpsc::UnboundedReceiver<(u64, bool)>,
    deliveries: JoinSet<()>,
    stops: Stops,
    checkpoint: Checkpoint,
    in_flight: usize,
    poll: AdaptivePoll,
    /// Still reading the feed (not draining or handing over).
    reading: bool,
    /// Ordered groups: each key's last message's fate, which its next message waits for.
    chains: HashMap<String, oneshot::Receiver<KeyFate>>,
    /// Messages read so far; the first window after taking a range is checked for state the
    /// previous owner left (see `RangeDelivery::check_state`).
    read: usize,
    /// The last delivery's "got a permit" signal (unordered groups).
    in_feed_order: Option<oneshot::Receiver<()>>,
}

impl Reading {
    /// Nothing in flight and nothing more to read: the range is drained.
    fn drained(&self) -> bool {
        self.in_flight == 0 && !self.reading
    }

    fn checkpoint_due(&self) -> bool {
        self.checkpoint.position() != &self.lease.continuation
    }

    /// The host stops: stop reading, let what is under way settle.
    fn drain(&mut self) {
        self.reading = false;
        self.stops.give_up.cancel();
        self.stops.draining.cancel();
        debug!(in_flight = self.in_flight, "draining range");
    }

    fn delivered(&mut self, seq: u64, recorded: bool) {
        while self.deliveries.try_join_next().is_some() {}
        self.in_flight -= 1;
        self.checkpoint.settled(seq, recorded);
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
            let step = tokio::select! {
                biased;
                _ = stop.cancelled(), if r.reading => {
                    r.drain();
                    None
                }
                Some((seq, recorded)) = r.done_rx.recv() => {
                    r.delivered(seq, recorded);
                    None
                }
                _ = renew.tick() => self.renew(&mut r).await,
                _ = flush.tick(), if r.checkpoint_due() => self.write_checkpoint(&mut r.lease, r.checkpoint.position()).await,
                _ = tokio::time::sleep(r.poll.delay()), if r.reading && r.in_flight < self.options.max_in_flight_per_range => {
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

    fn start(&self, lease: Lease) -> Result<Reading> {
        let range = lease.feed_range()?;
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
            checkpoint: Checkpoint::new(lease.continuation.clone()),
            lease,
            reader,
            done_tx,
            done_rx,
            deliveries: JoinSet::new(),
            stops: Stops {
                step_aside: CancellationToken::new(),
                draining: CancellationToken::new(),
                give_up: CancellationToken::new(),
            },
            in_flight: 0,
            poll: AdaptivePoll::new(self.options.min_poll, self.options.max_poll),
            reading: true,
            chains: HashMap::new(),
            read: 0,
            in_feed_order: None,
        })
    }

    /// Renews the lease. Fencing: when another host owns the range now, or the lease expired
    /// without a renewal, nothing more is read from it.
    async fn renew(&self, r: &mut Reading) -> Step {
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
        let (docs, token) = match r.reader.next_page().await {
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
            // ours before handing out a page (1 RU a page).
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
        let messages = self.messages(docs);
        let seq = r.checkpoint.read(token, messages.len());
        self.dispatch(r, seq, messages);
        if r.chains.len() > MAX_IDLE_CHAINS {
            forget_settled_keys(&mut r.chains);
        }
        None
    }

    /// A page's messages; malformed documents are counted and skipped with a reason.
    fn messages(&self, docs: Vec<serde_json::Value>) -> Vec<Message> {
        let field = self.group.queue().config().partition_key_field();
        docs.into_iter()
            .filter_map(|doc| match Message::from_document(&doc, field) {
                Ok(message) => Some(message),
                Err(reason) => {
                    ConsumerStats::bump(&self.stats.malformed);
                    warn!(queue = self.group.queue().name(), id = ?doc.get("id"), %reason, "skipping a malformed document in the messages container");
                    None
                }
            })
            .collect()
    }

    /// One delivery task per message of page `seq`, each taking its turn.
    fn dispatch(&self, r: &mut Reading, seq: u64, messages: Vec<Message>) {
        let config = self.group.config();
        let ordered = config.ordered;
        let stream = config.mode == DeliveryMode::Stream;
        let page_started = Arc::new(AtomicBool::new(false));
        for message in messages {
            r.in_flight += 1;
            let turn = r.turn(ordered, &message);
            let check_state = stream && ordered && r.read < self.options.max_in_flight_per_range;
            r.read += 1;
            let delivery = RangeDelivery {
                deliverer: Arc::clone(&self.deliverer),
                permits: Arc::clone(&self.permits),
                stop: r.stops.clone(),
                page_started: Arc::clone(&page_started),
                check_state,
            };
            let done = r.done_tx.clone();
            r.deliveries.spawn(self.deliveries.track_future(async move {
                let fate = delivery.run(message, turn).await;
                let _ = done.send((seq, fate.is_recorded()));
            }));
        }
    }

    /// Drained: record where the range is and hand the lease back.
    async fn finish(&self, mut r: Reading) -> RangeExit {
        if r.checkpoint_due() {
            if let Some(exit) = self
                .write_checkpoint(&mut r.lease, r.checkpoint.position())
                .await
            {
                return exit;
            }
        }
        match self.store.release(&r.lease).await {
            Ok(()) => {
                info!(owner = %self.options.owner, "lease released");
                RangeExit::Released
            }
            Err(LeaseError::Lost) => RangeExit::Lost,
            Err(LeaseError::Other(e)) => RangeExit::Failed(e),
        }
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
