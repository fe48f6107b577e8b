//! The scaling loop: every interval (and at once when a group's spec changes) each group goes
//! through one round, a pipeline of steps that each talk to one system at most:
//!
//! 1. read the group's workers (Kubernetes) and validate its spec (`spec::group`, pure);
//! 2. estimate its remaining work (Cosmos, [`Scaler::estimate`]);
//! 3. decide its replicas (`scaling::decide` through the group's `Autoscaler`, pure);
//! 4. build what the round says: figures and status ([`group_figures`], [`group_status`],
//!    pure and table-tested);
//! 5. apply: the Deployment's scale subresource, Events, metrics, the status.
//!
//! Who sets the replicas is [`spec::control`]'s answer: the decision (Direct mode), nobody
//! (HPA mode: the HPA scales the Deployment), `spec.replicas` (External mode: whoever scales
//! the group through its scale subresource) or a pause annotation. The figures are estimated
//! and published in every mode.
//!
//! A failed estimate keeps the replicas as they are and sets `Degraded`: never scale down on an
//! error.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cosmosq_crds::{
    CosmosQueue, CosmosQueueStatus, QueueConsumerGroup, QueueConsumerGroupStatus, RangeStatus,
    ScalingMode,
};
use cosmosq_queue::clock::{duration_ms, system_now_ms as now_ms};
use cosmosq_queue::config::GroupConfig;
use cosmosq_queue::estimate::{head_unchanged, FeedHead, GroupEstimate, DUE_HORIZON};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Patch, PatchParams};
use kube::runtime::events::EventType;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, ResourceExt};
use serde_json::json;
use tokio::sync::{mpsc, Mutex, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, instrument, warn};

use crate::build::workers_name;
use crate::cached::CachedDeployment;
use crate::context::{Context, GroupFigures};
use crate::cosmos::CosmosError;
use crate::scaling::{Autoscaler, Decision, Reason};
use crate::spec::{self, group_name, Control};
use crate::status::{self, reasons, SCALER_MANAGER};

/// Ranges listed in a group's status; beyond this the status would grow past what `kubectl`
/// shows usefully (the metrics carry the totals).
const MAX_RANGES_IN_STATUS: usize = 256;
/// Groups estimated at the same time in a round, at least: one round must fit its interval
/// whatever the number of groups, so the width grows with the groups and their latency
/// ([`round_width`]) up to `MAX_CONCURRENT_ESTIMATES`.
const MIN_CONCURRENT_ESTIMATES: usize = 8;
/// At most: each estimate in flight holds a connection and a few pages of a feed.
const MAX_CONCURRENT_ESTIMATES: usize = 128;

/// How many groups a round estimates at once (pure): enough for `groups` rounds of
/// `per_group` each to take half the `interval`, leaving the other half as headroom for slow
/// accounts, within `MIN_CONCURRENT_ESTIMATES..=MAX_CONCURRENT_ESTIMATES`.
pub fn round_width(groups: usize, per_group: Duration, interval: Duration) -> usize {
    let budget = (interval / 2).as_secs_f64().max(0.001);
    let needed = (groups as f64 * per_group.as_secs_f64() / budget).ceil() as usize;
    needed.clamp(MIN_CONCURRENT_ESTIMATES, MAX_CONCURRENT_ESTIMATES)
}

/// What can fail a group's round.
#[derive(Debug, thiserror::Error)]
pub enum ScalerError {
    /// An API call failed.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
}

/// What the loop remembers of a group between rounds.
#[derive(Default)]
struct GroupState {
    scaling: Autoscaler,
    last_scale: Option<(Time, String)>,
    /// The status last written (as [`Written`]), so an unchanged one is not written again,
    /// and when.
    written: Option<(Written, tokio::time::Instant)>,
    /// The generation whose ignored `spec.replicas` was last reported (once per change).
    replicas_ignored: Option<i64>,
    /// The spec's settings as last validated, by (uid, generation): its CEL rules are
    /// compiled once per change, not every round.
    settings: Option<(SpecVersion, Option<spec::GroupSettings>)>,
    /// The last estimate, when it found no work: reused while the feed stands still.
    idle: Option<Idle>,
    /// Whether the last estimate found work (then the next one is made without a probe).
    busy: bool,
    /// The latest `now` (ms) a round of this group ran with.
    latest: i64,
    /// The replicas its last round decided (or found, when someone else decides).
    desired: Option<u32>,
    /// The replicas this loop last set on the Deployment, and when.
    applied: Option<(u32, tokio::time::Instant)>,
}

/// How long the Deployment's cache may lag the scale this loop set: a watch event, normally
/// milliseconds.
const CACHE_LAG: Duration = Duration::from_secs(10);

/// The workers a round counts (pure): what the cache says, unless this loop set another count
/// less than [`CACHE_LAG`] ago that the cache has not caught up with yet.
fn believed(
    cached: u32,
    applied: Option<(u32, tokio::time::Instant)>,
    now: tokio::time::Instant,
) -> u32 {
    match applied {
        Some((replicas, at)) if replicas != cached && now.duration_since(at) < CACHE_LAG => {
            replicas
        }
        _ => cached,
    }
}

/// Who runs a group's round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Turn {
    /// The scaling loop: every interval, or a spec change.
    Round,
    /// A producer's wake: only for a group at zero.
    Wake,
}

/// How far back a round's clock may read behind one that ran before it and still be taken as
/// the two interleaving (a wake beside a round); past it, the wall clock was stepped back
/// and is believed.
const INTERLEAVE: i64 = 60_000;

/// A group's clock for a round at `now` after one at `latest` (pure): not back for a round
/// and a wake interleaving, back for a wall clock stepped back.
fn monotone(latest: i64, now: i64) -> i64 {
    if now < latest && latest - now <= INTERLEAVE {
        latest
    } else {
        now
    }
}

/// An estimate that found no work, the feed head probed before it (`None`: not probed), and
/// when it was made (ms).
#[derive(Clone, Debug)]
pub struct Idle {
    /// The queue's feed head, probed before the estimate.
    pub head: Option<FeedHead>,
    /// The estimate.
    pub estimate: GroupEstimate,
    /// When it was made (ms).
    pub at: i64,
    /// How long it may be kept (ms): within the estimator's due horizon, shorter by a share
    /// of it that differs from group to group ([`idle_horizon`]).
    pub horizon: i64,
    /// The queue it was made on (uid, generation): another container's head says nothing.
    pub queue: SpecVersion,
}

/// How long a group's idle estimate is kept (pure): between half the estimator's due horizon
/// and all of it, by a hash of the group's uid. Idle estimates made in one round (a start, a
/// quiet spell) then fall due over several rounds, not all in one: at 5,000 groups that one
/// round took 15–19 s here, and a message from zero arriving before it waited up to 31 s.
pub fn idle_horizon(group: Option<&str>) -> i64 {
    use std::hash::{Hash, Hasher};
    let full = duration_ms(DUE_HORIZON);
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    group.hash(&mut hasher);
    let half = full / 2;
    full - (hasher.finish() % half.max(1) as u64) as i64
}

/// Whether an estimate found no work (pure): every range's lag known and nothing unread or
/// pending anywhere.
pub fn found_no_work(estimate: &GroupEstimate) -> bool {
    !estimate.ranges.is_empty()
        && estimate.ranges.iter().all(|r| r.lag.is_some())
        && estimate.backlog() == 0
}

/// Whether an idle group's last estimate still holds now (pure), so the round skips its
/// estimate: nothing was written to the queue since the probe made before that estimate
/// (no new message, so no new lag; and with no work there is no delivery to leave a lock or a
/// retry behind), and it is younger than the estimator's due horizon (a retry or scheduled
/// message due within it was counted in it, so one falling due since cannot be missed).
pub fn still_idle(idle: &Idle, head: &FeedHead, now: i64) -> bool {
    let young = now.saturating_sub(idle.at) < idle.horizon.min(duration_ms(DUE_HORIZON));
    young
        && idle
            .head
            .as_ref()
            .is_some_and(|before| head_unchanged(before, head))
}

/// A queue's feed head, probed once per round by whichever of its groups asks first.
type HeadCell = Arc<tokio::sync::OnceCell<Option<FeedHead>>>;

/// A spec as its object's uid and generation tell it.
type SpecVersion = (Option<String>, Option<i64>);

impl GroupState {
    /// The group's settings, `None` for an invalid spec (the reconciler reports why).
    fn settings(&mut self, qcg: &QueueConsumerGroup) -> Option<spec::GroupSettings> {
        let version = (qcg.uid(), qcg.metadata.generation);
        match &self.settings {
            Some((seen, settings)) if *seen == version => settings.clone(),
            _ => {
                let settings = spec::group(qcg).ok();
                self.settings = Some((version, settings.clone()));
                // Another spec may read other leases (`spec.group`, `startFrom`).
                self.idle = None;
                self.busy = false;
                settings
            }
        }
    }
}

/// How often a status whose only change is in the figures (backlog, lag, ranges) is written:
/// a busy group's figures change every round, and 100 groups must not mean 400 writes a minute.
/// Replicas, decisions and conditions are written at once.
pub const FIGURES_STATUS_INTERVAL: Duration = Duration::from_secs(60);

/// A status as rounds compare it, kept as two hashes (not a copy of the status per group):
/// of the whole, and of all but the figures. Transition times are left out (they are kept,
/// not chosen).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Written {
    whole: u64,
    without_figures: u64,
}

impl Written {
    /// The hashes of `status` (pure).
    fn of(status: &QueueConsumerGroupStatus) -> Self {
        use std::hash::{Hash, Hasher};
        let mut s = status.clone();
        for c in &mut s.conditions {
            c.last_transition_time = Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
        }
        let hash = |s: &QueueConsumerGroupStatus| {
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            serde_json::to_vec(s)
                .expect("a status serializes")
                .hash(&mut hasher);
            hasher.finish()
        };
        let whole = hash(&s);
        s.backlog = None;
        s.lag = None;
        s.ranges = Vec::new();
        Self {
            whole,
            without_figures: hash(&s),
        }
    }
}

/// Whether a new status is worth a write (pure): anything but the figures changed, or the
/// figures changed and the last write is `FIGURES_STATUS_INTERVAL` old.
fn status_due(
    written: Option<&(Written, tokio::time::Instant)>,
    status: Written,
    now: tokio::time::Instant,
) -> bool {
    let Some((before, at)) = written else {
        return true;
    };
    if *before == status {
        return false;
    }
    before.without_figures != status.without_figures
        || now.duration_since(*at) >= FIGURES_STATUS_INTERVAL
}

/// What one group's round did (for tests and logs).
#[derive(Clone, Debug, PartialEq)]
pub enum Round {
    /// Nothing to do yet: no queue, an invalid spec, or no Deployment (the reconciler reports).
    Skipped(&'static str),
    /// The round decided (Direct mode).
    Decided {
        /// What it decided.
        decision: Decision,
        /// Replicas before; the Deployment was scaled when they differ from the decision.
        current: u32,
        /// Whether the Deployment was scaled.
        scaled: bool,
    },
    /// Someone else sets the replicas (HPA, External, paused); the round measured.
    Held {
        /// Who.
        by: Control,
        /// Replicas the round leaves the Deployment at.
        replicas: u32,
        /// Replicas before.
        current: u32,
        /// Whether the Deployment was scaled.
        scaled: bool,
    },
}

/// The replicas the round sets, and why, when it sets any (pure): the decision in Direct
/// mode, `spec.replicas` in External mode, a pause's count; `None` leaves the Deployment to
/// its HPA, or where it is.
pub fn target(
    control: &Control,
    decision: &Decision,
    backlog: Option<u64>,
) -> Option<(u32, String)> {
    match control {
        Control::Operator => Some((
            decision.replicas,
            decision.reason.describe(decision, backlog),
        )),
        Control::External(Some(n)) => Some((*n, format!("spec.replicas {n} (External mode)"))),
        Control::Paused(Some(n)) => {
            Some((*n, format!("paused at {n} ({})", spec::PAUSED_REPLICAS)))
        }
        Control::Hpa | Control::External(None) | Control::Paused(None) => None,
    }
}

/// The `Paused` condition's status, reason and message (pure).
pub(crate) fn pause_condition(
    control: &Control,
    error: Option<&spec::PauseError>,
) -> (bool, &'static str, String) {
    match (control, error) {
        (_, Some(e)) => (true, reasons::INVALID_PAUSE, e.to_string()),
        (Control::Paused(Some(n)), None) => (
            true,
            reasons::PAUSED,
            format!("held at {n} replicas by {}", spec::PAUSED_REPLICAS),
        ),
        (Control::Paused(None), None) => (
            true,
            reasons::PAUSED,
            format!("held where they are by {}", spec::PAUSED),
        ),
        _ => (
            false,
            reasons::NOT_PAUSED,
            "scaling is not paused".to_owned(),
        ),
    }
}

/// The group's workers as the round found them.
#[derive(Clone, Debug, PartialEq)]
struct Workers {
    /// The Deployment's `spec.replicas`: what the last scale asked for.
    current: u32,
    /// Its `status.replicas`: pods that exist.
    running: i32,
    /// Its pods' label selector, as the scale subresource gives it (`k=v,k2=v2`).
    selector: Option<String>,
}

impl Workers {
    fn of(deployment: &CachedDeployment) -> Self {
        Self {
            current: deployment.replicas.unwrap_or(1).max(0) as u32,
            running: deployment.running.unwrap_or(0),
            selector: Some(&deployment.selector)
                .filter(|labels| !labels.is_empty())
                .map(|labels| {
                    labels
                        .iter()
                        .map(|(k, v)| format!("{k}={v}"))
                        .collect::<Vec<_>>()
                        .join(",")
                }),
        }
    }
}

/// What a round knows when it builds the status (the inputs of [`group_status`]).
#[derive(Debug)]
pub struct RoundView<'a> {
    /// The status before this round (conditions keep their transition times).
    pub previous: Option<&'a QueueConsumerGroupStatus>,
    /// The group's generation.
    pub generation: Option<i64>,
    /// Pods that exist.
    pub running: i32,
    /// Replicas the round leaves the Deployment at.
    pub desired: u32,
    /// The workers' label selector.
    pub selector: Option<String>,
    /// The `Paused` condition: paused, its reason and message.
    pub paused: (bool, &'a str, String),
    /// The estimate, or why it failed (the message says what was kept).
    pub estimate: Result<&'a GroupEstimate, String>,
    /// The last scale: when, and why.
    pub last_scale: Option<&'a (Time, String)>,
    /// Now, for transition times.
    pub now: Time,
}

/// Whether the group's status says `Degraded=True`.
fn is_degraded(status: Option<&QueueConsumerGroupStatus>) -> bool {
    status.is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.type_ == status::DEGRADED && c.status == "True")
    })
}

/// The `Degraded` message of a failed estimate.
fn estimate_failed(current: u32, error: &CosmosError) -> String {
    format!("estimate failed; keeping {current} replicas: {error}")
}

/// The scaling loop's part of a group's status (pure). The reconciler owns the rest (`Ready`,
/// `Available`, `observedGeneration`) through its own field manager.
pub fn group_status(view: &RoundView<'_>) -> QueueConsumerGroupStatus {
    let previous: &[Condition] = view.previous.map_or(&[], |s| &s.conditions);
    let degraded = |failed: bool, reason: &str, message: String| {
        status::condition(
            previous,
            status::DEGRADED,
            failed,
            reason,
            message,
            view.generation,
            view.now.clone(),
        )
    };
    let paused = status::condition(
        previous,
        status::PAUSED,
        view.paused.0,
        view.paused.1,
        view.paused.2.clone(),
        view.generation,
        view.now.clone(),
    );
    let mut status = QueueConsumerGroupStatus {
        replicas: Some(view.running),
        selector: view.selector.clone(),
        desired_replicas: Some(i32::try_from(view.desired).unwrap_or(i32::MAX)),
        last_scale_time: view.last_scale.map(|(at, _)| at.clone()),
        last_scale_reason: view.last_scale.map(|(_, reason)| reason.clone()),
        ..QueueConsumerGroupStatus::default()
    };
    match &view.estimate {
        Ok(e) => {
            status.conditions = vec![degraded(
                false,
                reasons::ESTIMATE_HEALTHY,
                format!("remaining work is estimated over {} ranges", e.ranges.len()),
            )];
            status.backlog = Some(saturating(e.backlog()));
            status.lag = Some(saturating(e.lag()));
            status.ranges = ranges(e);
        }
        // Unknown, not zero: the figures are left out.
        Err(message) => {
            status.conditions = vec![degraded(true, reasons::ESTIMATE_FAILED, message.clone())];
        }
    }
    status.conditions.push(paused);
    status
}

fn saturating(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The figures the metrics APIs serve for a group (pure).
pub fn group_figures(
    qcg: &QueueConsumerGroup,
    estimate: Result<&GroupEstimate, &CosmosError>,
    desired: u32,
    now: i64,
) -> GroupFigures {
    let ok = estimate.ok();
    GroupFigures {
        namespace: qcg.namespace().unwrap_or_default(),
        queue: qcg.spec.queue_ref.name.clone(),
        group: group_name(qcg),
        backlog: ok.map(GroupEstimate::backlog),
        lag: ok.map(GroupEstimate::lag),
        oldest_message_age_seconds: ok
            .and_then(GroupEstimate::oldest_unsettled_at)
            .map(|at| ((now - at) / 1000).max(0)),
        desired_replicas: desired,
        error: estimate.err().map(ToString::to_string),
        measured_at: now,
    }
}

/// Each queue's total backlog and oldest age over its groups, as its status (pure). A queue
/// with a group whose estimate failed is left out: a partial sum would read low, so it keeps
/// its last total.
pub fn queue_totals<'a>(
    figures: impl IntoIterator<Item = &'a GroupFigures>,
) -> BTreeMap<(String, String), CosmosQueueStatus> {
    let mut totals: BTreeMap<(String, String), (Option<u64>, Option<i64>)> = BTreeMap::new();
    for f in figures {
        let entry = totals
            .entry((f.namespace.clone(), f.queue.clone()))
            .or_insert((Some(0), None));
        entry.0 = entry.0.zip(f.backlog).map(|(a, b)| a + b);
        entry.1 = entry.1.max(f.oldest_message_age_seconds);
    }
    totals
        .into_iter()
        .filter_map(|(queue, (backlog, oldest))| {
            let status = CosmosQueueStatus {
                backlog: Some(saturating(backlog?)),
                oldest_message_age_seconds: oldest,
                ..CosmosQueueStatus::default()
            };
            Some((queue, status))
        })
        .collect()
}

/// The scaling loop over every group.
pub struct Scaler {
    ctx: Arc<Context>,
    groups: Store<QueueConsumerGroup>,
    queues: Store<CosmosQueue>,
    /// The workers' Deployments, as much as is read here ([`CachedDeployment`]), not fetched.
    deployments: Store<CachedDeployment>,
    state: Mutex<HashMap<ObjectRef<QueueConsumerGroup>, Arc<Mutex<GroupState>>>>,
    queue_written:
        Mutex<HashMap<ObjectRef<CosmosQueue>, (CosmosQueueStatus, tokio::time::Instant)>>,
    /// Each queue's feed head as the newest round that asked probed it (that round's `now`,
    /// ms): a round, or a wake ([`Self::wake`]) running beside it.
    heads: std::sync::Mutex<HashMap<ObjectRef<CosmosQueue>, (i64, HeadCell)>>,
    /// The Secrets the workers read, as last read, for rotations ([`crate::rotation`]).
    secrets: Mutex<crate::rotation::SecretWatch>,
    /// The round of a group that made an estimate, as the last round with any measured it
    /// (mean, in microseconds): the next round's width follows it.
    per_group_micros: std::sync::atomic::AtomicU64,
    /// Time spent (microseconds) and groups, of the rounds that made an estimate since the
    /// last round ended.
    estimated: (std::sync::atomic::AtomicU64, std::sync::atomic::AtomicU64),
}

impl Scaler {
    /// A loop over the groups and queues the stores hold.
    pub fn new(
        ctx: Arc<Context>,
        groups: Store<QueueConsumerGroup>,
        queues: Store<CosmosQueue>,
        deployments: Store<CachedDeployment>,
    ) -> Self {
        Self {
            ctx,
            groups,
            queues,
            deployments,
            state: Mutex::default(),
            queue_written: Mutex::default(),
            per_group_micros: std::sync::atomic::AtomicU64::new(0),
            estimated: Default::default(),
            secrets: Mutex::default(),
            heads: std::sync::Mutex::default(),
        }
    }

    /// Rounds every `interval`, and a group at once when the reconciler reports it changed.
    pub async fn run(
        self: Arc<Self>,
        interval: Duration,
        mut changed: mpsc::UnboundedReceiver<ObjectRef<QueueConsumerGroup>>,
        shutdown: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tick.tick() => self.round_within(interval).await,
                Some(group) = changed.recv() => {
                    if let Some(qcg) = self.groups.get(&group) {
                        self.scale_logged(&qcg, now_ms()).await;
                    }
                }
            }
        }
    }

    /// One round over every group at the default interval (tests).
    pub async fn round(&self) {
        self.round_within(Duration::from_secs(15)).await;
    }

    /// A producer said `queue` has new messages ([`crate::wake`]): its groups at zero go
    /// through a round now, beside the scheduled ones: a fresh probe of the feed head, an
    /// estimate if it moved, a scale from zero if there is work. Groups running are left to
    /// the rounds (their workers read the feed). At most `width`'s permits of groups are looked
    /// at at once, across all wakes. Returns how many groups it looked at.
    #[instrument(skip(self, width), fields(queue = %queue))]
    pub async fn wake(&self, queue: &ObjectRef<CosmosQueue>, width: &Semaphore) -> usize {
        if self.queues.get(queue).is_none() {
            return 0;
        }
        let namespace = queue.namespace.as_deref().unwrap_or_default();
        let groups: Vec<_> = self
            .groups
            .state()
            .into_iter()
            .filter(|g| {
                g.namespace().as_deref() == Some(namespace) && g.spec.queue_ref.name == queue.name
            })
            .collect();
        if groups.is_empty() {
            return 0;
        }
        // The producer wrote after any probe made so far: the groups probe again.
        self.heads.lock().expect("heads").remove(queue);
        let now = now_ms();
        let looked = &std::sync::atomic::AtomicUsize::new(0);
        futures::stream::iter(groups)
            .for_each_concurrent(None, |qcg| async move {
                let Ok(_permit) = width.acquire().await else {
                    return;
                };
                match self.scale_group_as(&qcg, now, Turn::Wake).await {
                    Ok(Round::Skipped(_)) => {}
                    Ok(_) => {
                        looked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    Err(e) => warn!(group = %qcg.name_any(), namespace = ?qcg.namespace(), error = %e, "woken round failed"),
                }
            })
            .await;
        self.ctx.metrics.wakes.inc();
        looked.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// One round over every group, as wide as fitting it in `interval` takes, then the
    /// queues' totals.
    #[instrument(skip(self), fields(groups = tracing::field::Empty))]
    pub async fn round_within(&self, interval: Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        let started = Instant::now();
        // Each group's copy is let go once its turn is over: the round's status writes put
        // a new copy of each in the cache, and holding the old ones to the end held two of
        // every group at once (5,000 groups: tens of MB at the round's peak).
        let groups = self.groups.state();
        let count = groups.len();
        tracing::Span::current().record("groups", count);
        let now = now_ms();
        // As wide as if every group estimated: they do together every `DUE_HORIZON` (idle
        // estimates made in one round fall due in one round) and when their queues move. A
        // width from the mean of all groups, most of them idle and cheap, made those rounds
        // take 19 s at 5,000 groups (width 8), and a message from zero waited 27–31 s.
        let per_group = Duration::from_micros(self.per_group_micros.load(Relaxed));
        let width = round_width(count, per_group, interval);
        futures::stream::iter(groups)
            .for_each_concurrent(
                width,
                |qcg| async move { self.scale_logged(&qcg, now).await },
            )
            .await;
        let spent = self.estimated.0.swap(0, Relaxed);
        if let Some(mean) = spent.checked_div(self.estimated.1.swap(0, Relaxed)) {
            self.per_group_micros.store(mean, Relaxed);
        }
        self.forget_deleted().await;
        if let Err(e) = self.write_queue_totals().await {
            warn!(error = %e, "could not write the queues' backlog");
        }
        self.ctx
            .metrics
            .scaling_round
            .observe(started.elapsed().as_secs_f64());
        debug!(elapsed = ?started.elapsed(), width, "scaling round");
        self.check_secrets().await;
    }

    /// Reads the Secrets the workers read that are due a check (each once every
    /// `rotation::SECRET_CHECK`, however many groups name it) and asks for a reconcile of
    /// each group that reads one that changed.
    async fn check_secrets(&self) {
        let Some(reconcile) = &self.ctx.reconcile else {
            return;
        };
        let groups = self.groups.state();
        let wanted = groups
            .iter()
            .flat_map(|g| crate::rotation::secrets_of(g, &self.queues))
            .collect();
        let now = tokio::time::Instant::now();
        let changed = self
            .secrets
            .lock()
            .await
            .check(&self.ctx.client, &wanted, now)
            .await;
        if changed.is_empty() {
            return;
        }
        for group in crate::rotation::groups_reading(&changed, &groups, &self.queues) {
            // Closed only when the controllers stop, and this loop with them.
            let _ = reconcile.send(group);
        }
    }

    async fn scale_logged(&self, qcg: &QueueConsumerGroup, now: i64) {
        if let Err(e) = self.scale_group(qcg, now).await {
            warn!(group = %qcg.name_any(), namespace = ?qcg.namespace(), error = %e, "scaling round failed");
        }
    }

    /// The queue's feed head as this round (`round`: its clock, ms) or a later one probed it:
    /// once per queue per round, whichever of its groups asks first (Cosmos). A later probe
    /// serves an earlier round still under way (a wake beside it): it is at least as fresh.
    /// One more than [`INTERLEAVE`] later is a wall clock stepped back, not a later round.
    /// `None` when it cannot be read: the groups are then estimated.
    async fn head(&self, cq: &CosmosQueue, round: i64) -> Option<FeedHead> {
        let cell = {
            let mut heads = self.heads.lock().expect("heads");
            let (probed, cell) = heads
                .entry(ObjectRef::from_obj(cq))
                .or_insert_with(|| (round, HeadCell::default()));
            // Not a newer round's probe (one interleaving with this round): this round's own.
            if !(round..=round + INTERLEAVE).contains(probed) {
                *probed = round;
                *cell = HeadCell::default();
            }
            cell.clone()
        };
        cell.get_or_init(|| async {
            match self.ctx.cosmos.queue(cq).await {
                Ok(queue) => queue
                    .feed_head()
                    .await
                    .inspect_err(|e| debug!(error = %e, "could not probe the feed head"))
                    .ok(),
                Err(_) => None,
            }
        })
        .await
        .clone()
    }

    /// The remaining work of a group (Cosmos). A failure drops the queue's connection, so
    /// the next round reconnects: the key may have been rotated or the account moved.
    async fn estimate(
        &self,
        cq: &CosmosQueue,
        config: GroupConfig,
        now: i64,
    ) -> Result<GroupEstimate, CosmosError> {
        let estimate = async {
            let queue = self.ctx.cosmos.queue(cq).await?;
            let group = queue.group(config)?;
            Ok(group
                .estimate_or_create_leases(
                    now,
                    duration_ms(cosmosq_queue::host::DEFAULT_LEASE_EXPIRE),
                )
                .await?)
        }
        .await;
        if estimate.is_err() {
            self.ctx.cosmos.forget(cq).await;
        }
        estimate
    }

    /// One group's round: read → validate → estimate → decide → build → apply. It composes
    /// the steps; each step talks to one system at most. `now` (ms) also names the round:
    /// groups scaled with the same `now` share one probe of their queue's feed head.
    pub async fn scale_group(
        &self,
        qcg: &QueueConsumerGroup,
        now: i64,
    ) -> Result<Round, ScalerError> {
        self.scale_group_as(qcg, now, Turn::Round).await
    }

    /// [`Self::scale_group`], as a round or a wake (which skips a group that runs).
    #[instrument(skip_all, fields(namespace = ?qcg.namespace(), group = %qcg.name_any(), ?turn))]
    async fn scale_group_as(
        &self,
        qcg: &QueueConsumerGroup,
        now: i64,
        turn: Turn,
    ) -> Result<Round, ScalerError> {
        let started = Instant::now();
        let namespace = qcg.namespace().unwrap_or_default();
        let queue_ref = ObjectRef::new(&qcg.spec.queue_ref.name).within(&namespace);
        let Some(cq) = self.queues.get(&queue_ref) else {
            return Ok(Round::Skipped("queue not found"));
        };
        let key = ObjectRef::from_obj(qcg);
        let state = self.state.lock().await.entry(key).or_default().clone();
        let mut state = state.lock().await;
        // A wake and a round may take turns on a group in either order: its clock does not go
        // back for that (the autoscaler's windows and idle time read it).
        let now = monotone(state.latest, now);
        state.latest = now;
        let Some(settings) = state.settings(qcg) else {
            return Ok(Round::Skipped("invalid spec"));
        };
        let Some(mut workers) = self.workers(qcg) else {
            return Ok(Round::Skipped("no Deployment of its own yet"));
        };
        // What this loop last applied, until the Deployment's cache says so: a wake right
        // after a round (or a round after a wake) decides from it, not from the count before.
        workers.current = believed(workers.current, state.applied, tokio::time::Instant::now());
        // Read under the group's lock: a round that just decided zero counts, though the
        // Deployment's cache may not say so yet.
        if turn == Turn::Wake && workers.current > 0 && state.desired != Some(0) {
            return Ok(Round::Skipped("running: left to the rounds"));
        }

        // An idle group is estimated again only when its queue's feed moved (one probe per
        // queue per round, shared by its groups); a busy one at once.
        let queue_version = (cq.uid(), cq.metadata.generation);
        let head = match state.idle.is_some() || !state.busy {
            true => self.head(&cq, now).await,
            false => None,
        };
        let reused = match (&state.idle, &head) {
            (Some(idle), Some(head))
                if idle.queue == queue_version && still_idle(idle, head, now) =>
            {
                Some(idle.estimate.clone())
            }
            _ => None,
        };
        let estimate = match &reused {
            Some(estimate) => Ok(estimate.clone()),
            None => self.estimate(&cq, settings.config, now).await,
        };
        if reused.is_none() {
            state.busy = estimate.as_ref().is_ok_and(|e| !found_no_work(e));
            state.idle = match &estimate {
                Ok(e) if found_no_work(e) => Some(Idle {
                    head,
                    estimate: e.clone(),
                    at: now,
                    horizon: idle_horizon(qcg.metadata.uid.as_deref()),
                    queue: queue_version,
                }),
                _ => None,
            };
        }

        if state.last_scale.is_none() {
            // After a restart, the last scale is what the status says (not forgotten).
            let status = qcg.status.as_ref();
            state.last_scale = status
                .and_then(|s| s.last_scale_time.clone())
                .zip(status.and_then(|s| s.last_scale_reason.clone()));
        }
        // Every round feeds the autoscaler, so its rates and windows are current when it
        // decides again (after a pause, or a switch to Direct).
        let (observation, decision) = state.scaling.round(
            &settings.policy,
            now,
            estimate.as_ref().ok(),
            workers.current,
        );
        let (control, pause_error) = spec::control(qcg);
        let target = target(&control, &decision, observation.backlog);
        let scaled = target
            .as_ref()
            .is_some_and(|(replicas, _)| *replicas != workers.current);
        if let Some((replicas, description)) = target.as_ref().filter(|_| scaled) {
            self.scale(qcg, workers.current, *replicas, description)
                .await?;
            state.last_scale = Some((status::now(), description.clone()));
            state.applied = Some((*replicas, tokio::time::Instant::now()));
        }
        // Left to the HPA or held: what the Deployment runs is the desired count.
        let desired = target.as_ref().map_or(workers.current, |(r, _)| *r);
        state.desired = Some(desired);
        self.report_control(qcg, &control, pause_error.as_ref(), &mut state)
            .await;

        let figures = group_figures(qcg, estimate.as_ref(), desired, now);
        let seen = estimate
            .as_ref()
            .map_err(|e| estimate_failed(workers.current, e));
        let status = group_status(&RoundView {
            previous: qcg.status.as_ref(),
            generation: qcg.metadata.generation,
            running: workers.running,
            desired,
            selector: workers.selector.clone(),
            paused: pause_condition(&control, pause_error.as_ref()),
            estimate: seen.clone(),
            last_scale: state.last_scale.as_ref(),
            now: status::now(),
        });

        if let Err(message) = seen {
            warn!("{message}");
            if !is_degraded(qcg.status.as_ref()) {
                self.ctx
                    .event(
                        qcg,
                        EventType::Warning,
                        reasons::ESTIMATE_FAILED,
                        "Estimate",
                        message,
                    )
                    .await;
            }
        }
        self.publish((namespace.clone(), qcg.name_any()), figures)
            .await;

        // Written only when it changed: a busy group changes every round, an idle one rarely.
        let written = Written::of(&status);
        let now_instant = tokio::time::Instant::now();
        if status_due(state.written.as_ref(), written, now_instant) {
            self.write_status(qcg, &status).await?;
            state.written = Some((written, now_instant));
        }
        if decision.reason == Reason::EstimateFailed {
            debug!("replicas kept: the estimate failed");
        }
        if reused.is_none() {
            use std::sync::atomic::Ordering::Relaxed;
            let micros = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
            self.estimated.0.fetch_add(micros, Relaxed);
            self.estimated.1.fetch_add(1, Relaxed);
        }
        Ok(match control {
            Control::Operator => Round::Decided {
                decision,
                current: workers.current,
                scaled,
            },
            by => Round::Held {
                by,
                replicas: desired,
                current: workers.current,
                scaled,
            },
        })
    }

    /// Events for who scales, once per change: a pause that starts or cannot be read, and a
    /// `spec.replicas` that this mode ignores (someone ran `kubectl scale` or pointed KEDA at
    /// a group the operator scales).
    async fn report_control(
        &self,
        qcg: &QueueConsumerGroup,
        control: &Control,
        pause_error: Option<&spec::PauseError>,
        state: &mut GroupState,
    ) {
        let was_paused = qcg.status.as_ref().and_then(|s| {
            s.conditions
                .iter()
                .find(|c| c.type_ == status::PAUSED)
                .map(|c| (c.status == "True", c.reason.clone()))
        });
        let (paused, reason, message) = pause_condition(control, pause_error);
        if paused && was_paused != Some((true, reason.to_owned())) {
            let kind = if pause_error.is_some() {
                EventType::Warning
            } else {
                EventType::Normal
            };
            info!(reason, "{message}");
            self.ctx.event(qcg, kind, reason, "Pause", message).await;
        }
        let mode = qcg.spec.scaling.mode;
        let ignored = qcg.spec.replicas.is_some() && mode != ScalingMode::External;
        if ignored && state.replicas_ignored != qcg.metadata.generation {
            state.replicas_ignored = qcg.metadata.generation;
            let (mode, decides) = if mode == ScalingMode::Hpa {
                ("HPA", "its HorizontalPodAutoscaler decides")
            } else {
                ("Direct", "the operator decides")
            };
            let message = format!(
                "spec.replicas is ignored in {mode} mode: {decides}; set spec.scaling.mode: External to scale the group with kubectl, an HPA or KEDA"
            );
            warn!("{message}");
            self.ctx
                .event(
                    qcg,
                    EventType::Warning,
                    reasons::REPLICAS_IGNORED,
                    "Scale",
                    message,
                )
                .await;
        }
    }

    fn deployment_api(&self, qcg: &QueueConsumerGroup) -> Api<Deployment> {
        Api::namespaced(
            self.ctx.client.clone(),
            &qcg.namespace().unwrap_or_default(),
        )
    }

    /// The group's workers as its Deployment says (the watch's cache); `None` before the
    /// reconciler made it, or while a Deployment of that name is someone else's (never scaled).
    fn workers(&self, qcg: &QueueConsumerGroup) -> Option<Workers> {
        let key = ObjectRef::new(&workers_name(qcg)).within(&qcg.namespace().unwrap_or_default());
        self.deployments
            .get(&key)
            .filter(|d| crate::apply::controlled_by(&d.metadata, qcg))
            .map(|d| Workers::of(&d))
    }

    /// The scaling loop's part of the group's status (Kubernetes).
    async fn write_status(
        &self,
        qcg: &QueueConsumerGroup,
        status: &QueueConsumerGroupStatus,
    ) -> Result<(), ScalerError> {
        Api::<QueueConsumerGroup>::namespaced(
            self.ctx.client.clone(),
            &qcg.namespace().unwrap_or_default(),
        )
        .patch_status(
            &qcg.name_any(),
            &PatchParams::apply(SCALER_MANAGER).force(),
            &status::patch::<QueueConsumerGroup, _>(status),
        )
        .await?;
        Ok(())
    }

    /// The round's replicas to the Deployment's scale subresource, with its Event
    /// (Kubernetes).
    async fn scale(
        &self,
        qcg: &QueueConsumerGroup,
        current: u32,
        replicas: u32,
        description: &str,
    ) -> Result<(), ScalerError> {
        self.deployment_api(qcg)
            .patch_scale(
                &workers_name(qcg),
                &PatchParams {
                    field_manager: Some(SCALER_MANAGER.into()),
                    ..PatchParams::default()
                },
                &Patch::Merge(json!({"spec": {"replicas": replicas}})),
            )
            .await?;
        let direction = if replicas > current { "up" } else { "down" };
        let namespace = qcg.namespace().unwrap_or_default();
        self.ctx
            .metrics
            .scale_events
            .with_label_values(&[
                namespace.as_str(),
                qcg.spec.queue_ref.name.as_str(),
                &group_name(qcg),
                direction,
            ])
            .inc();
        info!(from = current, to = replicas, "{description}");
        self.ctx
            .event(
                qcg,
                EventType::Normal,
                reasons::SCALED,
                "Scale",
                format!("{description} (from {current})"),
            )
            .await;
        Ok(())
    }

    /// A group's figures to the metrics and to what the metrics APIs serve, under the group
    /// resource's (namespace, name).
    async fn publish(&self, resource: (String, String), figures: GroupFigures) {
        let labels = [
            figures.namespace.as_str(),
            figures.queue.as_str(),
            figures.group.as_str(),
        ];
        let metrics = &self.ctx.metrics;
        match figures.backlog {
            Some(backlog) => metrics.groups.estimated(
                &labels,
                saturating(backlog),
                saturating(figures.lag.unwrap_or(0)),
                figures.oldest_message_age_seconds.unwrap_or(0),
            ),
            None => metrics.estimate_errors.with_label_values(&labels).inc(),
        }
        metrics
            .groups
            .desired(&labels, i64::from(figures.desired_replicas));
        self.ctx.figures.write().await.insert(resource, figures);
    }

    /// Drops what the loop kept for groups that no longer exist (linear in the groups).
    async fn forget_deleted(&self) {
        let live: HashSet<ObjectRef<QueueConsumerGroup>> = self
            .groups
            .state()
            .iter()
            .map(|g| ObjectRef::from_obj(&**g))
            .collect();
        let mut state = self.state.lock().await;
        state.retain(|key, _| live.contains(key));
        drop(state);
        self.heads
            .lock()
            .expect("heads")
            .retain(|queue, _| self.queues.get(queue).is_some());
        let mut figures = self.ctx.figures.write().await;
        figures.retain(|(namespace, name), f| {
            let keep = live.contains(&ObjectRef::new(name).within(namespace));
            if !keep {
                self.ctx
                    .metrics
                    .remove_group(&[&f.namespace, &f.queue, &f.group]);
            }
            keep
        });
    }

    /// Each queue's backlog and oldest age, summed over its groups, into its status. A queue
    /// with a group whose estimate failed keeps its last total: a partial sum would read low.
    /// As a group's figures, a total is written at once when it starts or ends a backlog, and
    /// otherwise at most every `FIGURES_STATUS_INTERVAL`.
    async fn write_queue_totals(&self) -> Result<(), ScalerError> {
        let totals = queue_totals(self.ctx.figures.read().await.values());
        let mut written = self.queue_written.lock().await;
        let now = tokio::time::Instant::now();
        for ((namespace, name), status) in totals {
            let key = ObjectRef::new(&name).within(&namespace);
            if self.queues.get(&key).is_none() || !total_due(written.get(&key), &status, now) {
                continue;
            }
            let api: Api<CosmosQueue> = Api::namespaced(self.ctx.client.clone(), &namespace);
            api.patch_status(
                &name,
                &PatchParams::apply(SCALER_MANAGER).force(),
                &status::patch::<CosmosQueue, _>(&status),
            )
            .await?;
            written.insert(key, (status, now));
        }
        Ok(())
    }
}

/// Whether a queue's total is worth a write (pure): the first, one that starts or ends a
/// backlog, or a changed one whose last write is `FIGURES_STATUS_INTERVAL` old.
fn total_due(
    written: Option<&(CosmosQueueStatus, tokio::time::Instant)>,
    status: &CosmosQueueStatus,
    now: tokio::time::Instant,
) -> bool {
    let Some((before, at)) = written else {
        return true;
    };
    let busy = |s: &CosmosQueueStatus| s.backlog.unwrap_or(0) > 0;
    before != status
        && (busy(before) != busy(status) || now.duration_since(*at) >= FIGURES_STATUS_INTERVAL)
}

fn ranges(estimate: &GroupEstimate) -> Vec<RangeStatus> {
    estimate
        .ranges
        .iter()
        .take(MAX_RANGES_IN_STATUS)
        .map(|r| RangeStatus {
            range: format!("{}-{}", r.min_epk, r.max_epk),
            owner: r.owner.clone(),
            lag: r.lag.map(|l| l as i64),
            backlog: r.backlog as i64,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(backlog: i64, desired: i32) -> QueueConsumerGroupStatus {
        QueueConsumerGroupStatus {
            replicas: Some(2),
            desired_replicas: Some(desired),
            backlog: Some(backlog),
            lag: Some(backlog),
            ..QueueConsumerGroupStatus::default()
        }
    }

    #[test]
    fn figures_alone_are_written_at_a_bounded_rate() {
        let t0 = tokio::time::Instant::now();
        let written = (Written::of(&status(100, 2)), t0);
        let at = |s: u64| t0 + Duration::from_secs(s);
        for (new, now, due) in [
            (status(100, 2), 100, false), // nothing changed
            (status(120, 2), 15, false),  // figures only, 15 s after the last write
            (status(120, 2), 60, true),   // figures only, a minute after
            (status(120, 3), 15, true),   // a decision: at once
        ] {
            assert_eq!(
                status_due(Some(&written), Written::of(&new), at(now)),
                due,
                "{new:?} at {now}"
            );
        }
        assert!(
            status_due(None, Written::of(&status(0, 0)), t0),
            "the first status is written"
        );
        // A condition's transition time is kept, not chosen: alone, it is no change.
        let ready_at = |second: i64| QueueConsumerGroupStatus {
            conditions: vec![status::condition(
                &[],
                status::READY,
                true,
                "Ready",
                "ok".into(),
                Some(1),
                Time(k8s_openapi::jiff::Timestamp::from_second(second).unwrap()),
            )],
            ..status(100, 2)
        };
        let written = (Written::of(&ready_at(1_800_000_000)), t0);
        let later = Written::of(&ready_at(1_800_000_100));
        assert!(!status_due(Some(&written), later, at(100)));
    }

    #[test]
    fn an_idle_estimate_holds_while_the_feed_stands_still_within_the_due_horizon() {
        let head = |lsns: &[u64]| {
            FeedHead(
                lsns.iter()
                    .enumerate()
                    .map(|(i, lsn)| ((i.to_string(), (i + 1).to_string()), Some(*lsn)))
                    .collect(),
            )
        };
        let idle = Idle {
            head: Some(head(&[7, 3])),
            estimate: estimate(&[(0, Some(0), None), (0, Some(0), None)]),
            at: 1_000,
            horizon: duration_ms(DUE_HORIZON),
            queue: (Some("q1".into()), Some(1)),
        };
        assert!(found_no_work(&idle.estimate));
        assert!(still_idle(&idle, &head(&[7, 3]), 30_000));
        assert!(!still_idle(&idle, &head(&[7, 4]), 30_000), "a write");
        assert!(!still_idle(&idle, &head(&[7]), 30_000), "a split or merge");
        assert!(
            !still_idle(&idle, &head(&[7, 3]), 61_000),
            "older than the due horizon: a scheduled message may be due"
        );
        let unprobed = Idle {
            head: None,
            ..idle.clone()
        };
        assert!(!still_idle(&unprobed, &head(&[7, 3]), 30_000));
        let shorter = Idle {
            horizon: 40_000,
            ..idle
        };
        assert!(
            !still_idle(&shorter, &head(&[7, 3]), 41_000),
            "its own horizon"
        );
        assert!(
            !found_no_work(&estimate(&[(0, None, None)])),
            "a lag not known"
        );
        assert!(!found_no_work(&estimate(&[(2, Some(2), None)])));
    }

    #[test]
    fn a_changed_spec_forgets_the_idle_estimate() {
        let mut qcg: QueueConsumerGroup =
            serde_json::from_value(crate::testing::group_json(json!({}))).unwrap();
        let mut state = GroupState::default();
        assert!(state.settings(&qcg).is_some());
        state.idle = Some(Idle {
            head: Some(FeedHead::default()),
            estimate: estimate(&[(0, Some(0), None)]),
            at: 0,
            horizon: duration_ms(DUE_HORIZON),
            queue: (None, None),
        });
        assert!(state.settings(&qcg).is_some());
        assert!(state.idle.is_some(), "the same spec");
        // Another generation may name another group (`spec.group`) and so other leases.
        qcg.metadata.generation = Some(4);
        assert!(state.settings(&qcg).is_some());
        assert!(state.idle.is_none());
    }

    #[test]
    fn a_round_is_as_wide_as_fitting_its_interval_takes() {
        let ms = Duration::from_millis;
        let interval = Duration::from_secs(15);
        assert_eq!(
            round_width(100, ms(20), interval),
            8,
            "2 s of work: the floor"
        );
        assert_eq!(
            round_width(5_000, ms(20), interval),
            14,
            "100 s of work in 7.5 s"
        );
        assert_eq!(round_width(5_000, ms(500), interval), 128, "at most");
        assert_eq!(
            round_width(5_000, Duration::ZERO, interval),
            8,
            "nothing measured yet"
        );
    }

    #[test]
    fn a_queue_total_is_written_when_a_backlog_starts_or_ends_and_else_at_a_bounded_rate() {
        let total = |backlog: i64| CosmosQueueStatus {
            backlog: Some(backlog),
            ..CosmosQueueStatus::default()
        };
        let t0 = tokio::time::Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        for (before, new, now, due) in [
            (40, 40, 100, false), // nothing changed
            (40, 55, 15, false),  // a busy queue's total moved, 15 s after the last write
            (40, 55, 60, true),   // and a minute after
            (0, 3, 1, true),      // work arrived: at once
            (3, 0, 1, true),      // and it is done: at once
        ] {
            assert_eq!(
                total_due(Some(&(total(before), t0)), &total(new), at(now)),
                due,
                "{before} → {new} at {now} s"
            );
        }
        assert!(total_due(None, &total(0), t0), "the first total is written");
    }

    fn estimate(ranges: &[(u64, Option<u64>, Option<&str>)]) -> GroupEstimate {
        GroupEstimate {
            group: "billing".into(),
            ranges: ranges
                .iter()
                .enumerate()
                .map(
                    |(i, (backlog, lag, owner))| cosmosq_queue::estimate::RangeEstimate {
                        min_epk: format!("{i:02}"),
                        max_epk: format!("{:02}", i + 1),
                        owner: owner.map(Into::into),
                        lag: *lag,
                        backlog: *backlog,
                        oldest_unsettled_at: None,
                        checkpointed: true,
                        lsn: None,
                    },
                )
                .collect(),
        }
    }

    fn at(second: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(second).unwrap())
    }

    #[test]
    fn the_status_says_what_the_round_saw() {
        let healthy = estimate(&[(30, Some(40), Some("pod-a")), (5, None, None)]);
        let scaled = (at(500), "backlog 35: scaling up to 2".to_owned());
        let degraded_before = QueueConsumerGroupStatus {
            conditions: vec![status::condition(
                &[],
                status::DEGRADED,
                true,
                reasons::ESTIMATE_FAILED,
                "x".into(),
                Some(1),
                at(100),
            )],
            ..QueueConsumerGroupStatus::default()
        };
        struct Case<'a> {
            name: &'a str,
            view: RoundView<'a>,
            degraded: (&'a str, &'a str, Time),
            figures: (Option<i64>, Option<i64>, usize),
        }
        let view = |previous, estimate| RoundView {
            previous,
            generation: Some(3),
            running: 1,
            desired: 2,
            selector: Some("group=billing,queue=orders".into()),
            paused: (false, reasons::NOT_PAUSED, "scaling is not paused".into()),
            estimate,
            last_scale: Some(&scaled),
            now: at(1_000),
        };
        for case in [
            Case {
                name: "healthy",
                view: view(None, Ok(&healthy)),
                degraded: ("False", reasons::ESTIMATE_HEALTHY, at(1_000)),
                figures: (Some(35), Some(40), 2),
            },
            Case {
                name: "failed: figures unknown, not zero",
                view: view(None, Err("estimate failed; keeping 1 replicas: 503".into())),
                degraded: ("True", reasons::ESTIMATE_FAILED, at(1_000)),
                figures: (None, None, 0),
            },
            Case {
                name: "still failing: the transition time is kept",
                view: view(Some(&degraded_before), Err("again".into())),
                degraded: ("True", reasons::ESTIMATE_FAILED, at(100)),
                figures: (None, None, 0),
            },
            Case {
                name: "recovered: a new transition",
                view: view(Some(&degraded_before), Ok(&healthy)),
                degraded: ("False", reasons::ESTIMATE_HEALTHY, at(1_000)),
                figures: (Some(35), Some(40), 2),
            },
        ] {
            let s = group_status(&case.view);
            let [c, paused] = s.conditions.as_slice() else {
                panic!(
                    "{}: the scaler's two conditions: {:?}",
                    case.name, s.conditions
                )
            };
            assert_eq!(
                (paused.type_.as_str(), paused.status.as_str()),
                (status::PAUSED, "False")
            );
            assert_eq!(s.selector.as_deref(), Some("group=billing,queue=orders"));
            assert_eq!(
                (c.type_.as_str(), c.status.as_str(), c.reason.as_str()),
                (status::DEGRADED, case.degraded.0, case.degraded.1),
                "{}",
                case.name
            );
            assert_eq!(c.last_transition_time, case.degraded.2, "{}", case.name);
            assert_eq!(c.observed_generation, Some(3), "{}", case.name);
            assert_eq!(
                (s.backlog, s.lag, s.ranges.len()),
                case.figures,
                "{}",
                case.name
            );
            assert_eq!((s.replicas, s.desired_replicas), (Some(1), Some(2)));
            assert_eq!(s.last_scale_reason.as_deref(), Some(scaled.1.as_str()));
            assert_eq!(s.observed_generation, None, "the reconciler's field");
        }
        let listed = group_status(&view(None, Ok(&healthy))).ranges;
        assert_eq!(
            listed[0],
            RangeStatus {
                range: "00-01".into(),
                owner: Some("pod-a".into()),
                lag: Some(40),
                backlog: 30
            }
        );
    }

    #[test]
    fn a_queue_total_is_written_only_when_every_group_was_estimated() {
        let figures = |queue: &str, backlog: Option<u64>, oldest: Option<i64>| GroupFigures {
            namespace: "shop".into(),
            queue: queue.into(),
            group: "g".into(),
            backlog,
            lag: backlog,
            oldest_message_age_seconds: oldest,
            desired_replicas: 1,
            error: None,
            measured_at: 0,
        };
        let all = [
            figures("orders", Some(10), Some(30)),
            figures("orders", Some(5), Some(90)),
            figures("returns", Some(1), None),
            figures("returns", None, None),
            figures("empty", Some(0), None),
        ];
        let totals = queue_totals(&all);
        let total = |q: &str| {
            totals
                .get(&("shop".to_owned(), q.to_owned()))
                .map(|s| (s.backlog, s.oldest_message_age_seconds))
        };
        assert_eq!(total("orders"), Some((Some(15), Some(90))));
        assert_eq!(total("returns"), None, "a partial sum would read low");
        assert_eq!(total("empty"), Some((Some(0), None)));
    }

    use crate::testing::{
        emulator_context, group_json, json_response, queue_json, ApiServerVerifier,
    };
    use cosmosq_queue::lease::LeaseStore;
    use cosmosq_queue::NewMessage;
    use http::{Method, StatusCode};
    use kube::runtime::reflector::store::Writer;
    use kube::runtime::watcher;
    use serde_json::Value;

    const SCALE: &str = "/apis/apps/v1/namespaces/shop/deployments/billing-workers/scale";
    const GROUP_STATUS: &str =
        "/apis/cosmosq.io/v1alpha1/namespaces/shop/queueconsumergroups/billing/status";
    const QUEUE_STATUS: &str =
        "/apis/cosmosq.io/v1alpha1/namespaces/shop/cosmosqueues/orders/status";

    fn store<K>(objects: Vec<Value>) -> Store<K>
    where
        K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + 'static,
    {
        let mut writer = Writer::<K>::default();
        for object in objects {
            let object: K = serde_json::from_value(object).unwrap();
            writer.apply_watcher_event(&watcher::Event::Apply(object));
        }
        writer.as_reader()
    }

    fn deployment(replicas: i32) -> Value {
        json!({"apiVersion": "apps/v1", "kind": "Deployment",
               "metadata": {"name": "billing-workers", "namespace": "shop",
                            "ownerReferences": [{"apiVersion": "cosmosq.io/v1alpha1",
                                "kind": "QueueConsumerGroup", "name": "billing", "uid": "g1",
                                "controller": true}]},
               "spec": {"replicas": replicas, "selector": {}, "template": {}},
               "status": {"replicas": replicas}})
    }

    /// The workers' Deployment as the watch's cache holds it; each test sets it.
    #[derive(Clone)]
    struct Cached(
        Arc<std::sync::Mutex<Writer<CachedDeployment>>>,
        Store<CachedDeployment>,
    );

    impl Cached {
        fn new() -> Self {
            let writer = Writer::default();
            let store = writer.as_reader();
            Self(Arc::new(std::sync::Mutex::new(writer)), store)
        }

        /// The Deployment runs `replicas` (as its spec and status say).
        fn at(&self, replicas: i32) {
            let object: Deployment = serde_json::from_value(deployment(replicas)).unwrap();
            let object = CachedDeployment::from(object);
            self.0
                .lock()
                .unwrap()
                .apply_watcher_event(&watcher::Event::Apply(object));
        }
    }

    impl ApiServerVerifier {
        async fn scale(&mut self) -> Value {
            let seen = self.expect(Method::PATCH, SCALE).await;
            let scale = json!({"apiVersion": "autoscaling/v1", "kind": "Scale",
                               "metadata": {"name": "billing-workers", "namespace": "shop"},
                               "spec": seen.body["spec"].clone()});
            seen.send
                .send_response(json_response(StatusCode::OK, &scale));
            seen.body
        }

        /// A status written by the scaling loop's own field manager.
        async fn scaler_status(&mut self, path: &str, object: Value) -> Value {
            let seen = self.expect(Method::PATCH, path).await;
            assert!(
                seen.query.contains("fieldManager=cosmosq-operator-scaler"),
                "{}",
                seen.query
            );
            let mut object = object;
            object["status"] = seen.body["status"].clone();
            seen.send
                .send_response(json_response(StatusCode::OK, &object));
            seen.body["status"].clone()
        }
    }

    /// A provisioned queue holding `messages` unread by group `billing` (4 leases, reading from
    /// the beginning), and a scaler whose stores hold the queue and the group.
    async fn setup(
        scaling: Value,
        messages: usize,
        container: &str,
    ) -> (Scaler, ApiServerVerifier, Value, Cached) {
        let (ctx, server, _cosmos) = emulator_context().await;
        let mut queue = queue_json();
        let provisioned: CosmosQueue = serde_json::from_value(queue.clone()).unwrap();
        let q = ctx.cosmos.provision(&provisioned).await.unwrap().0;
        LeaseStore::new(q.clone(), "billing")
            .reconcile(now_ms(), 60_000)
            .await
            .unwrap();
        let batch = (0..messages)
            .map(|i| NewMessage::json(json!({"n": i})))
            .collect();
        for result in q.enqueue_batch(batch).await {
            result.unwrap();
        }
        queue["spec"]["container"] = json!(container);
        ctx.cosmos.forget(&provisioned).await;
        let group = group_json(json!({"startFrom": "beginning", "scaling": scaling}));
        let cached = Cached::new();
        let scaler = Scaler::new(
            ctx,
            store(vec![group.clone()]),
            store(vec![queue]),
            cached.1.clone(),
        );
        (scaler, server, group, cached)
    }

    #[tokio::test]
    async fn a_backlog_scales_the_workers_up_and_is_reported() {
        let (scaler, mut server, group, cached) =
            setup(json!({"targetBacklogPerReplica": 100}), 250, "orders").await;
        let verifier = tokio::spawn(async move {
            let scale = server.scale().await;
            assert_eq!(scale, json!({"spec": {"replicas": 3}}));
            let event = server.event().await;
            assert_eq!(event["reason"], "Scaled");
            assert!(event["note"]
                .as_str()
                .unwrap()
                .contains("backlog 250: scaling up to 3 (from 1)"));
            let status = server.scaler_status(GROUP_STATUS, group.clone()).await;
            let queue = server.scaler_status(QUEUE_STATUS, queue_json()).await;
            // Next round: the three replicas run; only that changed in the status.
            let next = server.scaler_status(GROUP_STATUS, group.clone()).await;
            assert_eq!(
                (next["replicas"].as_i64(), next["backlog"].as_i64()),
                (Some(3), Some(250))
            );
            // And then nothing changed, so nothing is written.
            (server, status, queue)
        });
        cached.at(1);
        scaler.round().await;
        cached.at(3);
        scaler.round().await;
        scaler.round().await;
        let (server, status, queue) = verifier.await.unwrap();
        assert_eq!(status["backlog"], 250);
        assert_eq!(status["lag"], 250);
        assert_eq!(status["desiredReplicas"], 3);
        assert_eq!(status["ranges"].as_array().unwrap().len(), 4);
        assert_eq!(
            status["ranges"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["backlog"].as_i64().unwrap())
                .sum::<i64>(),
            250
        );
        assert_eq!(status["lastScaleReason"], "backlog 250: scaling up to 3");
        assert_eq!(status["conditions"][0]["type"], "Degraded");
        assert_eq!(status["conditions"][0]["status"], "False");
        assert_eq!(queue["backlog"], 250);
        let figures = scaler.ctx.figures.read().await;
        let f = &figures[&("shop".to_owned(), "billing".to_owned())];
        assert_eq!((f.backlog, f.desired_replicas), (Some(250), 3));
        let scraped = scaler.ctx.metrics.render();
        assert!(
            scraped.contains(
                r#"cosmosq_backlog_messages{group="billing",namespace="shop",queue="orders",scope="group"} 250"#
            ),
            "{scraped}"
        );
        drop(figures);
        drop(scaler);
        server.done().await;
    }

    #[tokio::test]
    async fn an_empty_queue_scales_down_after_the_window() {
        let (scaler, mut server, group, cached) = setup(
            json!({"minReplicas": 1, "scaleDownStabilization": "0s"}),
            0,
            "orders",
        )
        .await;
        cached.at(5);
        let verifier = tokio::spawn(async move {
            assert_eq!(server.scale().await, json!({"spec": {"replicas": 1}}));
            server.event().await;
            server.scaler_status(GROUP_STATUS, group).await
        });
        let round = one_round(&scaler).await;
        assert_eq!(
            round,
            Round::Decided {
                decision: Decision {
                    replicas: 1,
                    reason: Reason::ScaleDown
                },
                current: 5,
                scaled: true
            }
        );
        let status = verifier.await.unwrap();
        assert_eq!(status["backlog"], 0);
    }

    #[tokio::test]
    async fn a_failed_estimate_keeps_the_replicas_and_degrades_the_group() {
        // The queue resource points at a container that does not exist.
        let (scaler, mut server, group, cached) = setup(json!({}), 10, "missing").await;
        cached.at(5);
        let verifier = tokio::spawn(async move {
            // No scale request: straight to the Warning and the status.
            let event = server.event().await;
            assert_eq!(
                (&event["type"], &event["reason"]),
                (&json!("Warning"), &json!("EstimateFailed"))
            );
            let status = server.scaler_status(GROUP_STATUS, group).await;
            (server, status)
        });
        scaler.round().await;
        let (server, status) = verifier.await.unwrap();
        assert_eq!(status["conditions"][0]["status"], "True");
        assert_eq!(status["conditions"][0]["reason"], "EstimateFailed");
        assert!(status.get("backlog").is_none(), "unknown, not zero");
        assert_eq!(status["desiredReplicas"], 5);
        let figures = scaler.ctx.figures.read().await;
        assert_eq!(
            figures[&("shop".to_owned(), "billing".to_owned())].backlog,
            None
        );
        drop(figures);
        drop(scaler);
        server.done().await; // and no queue total was written from a partial sum
    }

    #[tokio::test]
    async fn hpa_mode_measures_but_leaves_the_replicas_to_the_hpa() {
        let (scaler, mut server, mut group, cached) =
            setup(json!({"mode": "HPA"}), 150, "orders").await;
        // What an earlier operator process recorded survives this one's first write.
        group["status"] = json!({"lastScaleTime": "2026-11-30T09:00:00Z",
                                 "lastScaleReason": "backlog 900: scaling up to 9"});
        let scaler = Scaler::new(
            scaler.ctx.clone(),
            store(vec![group.clone()]),
            scaler.queues.clone(),
            scaler.deployments.clone(),
        );
        cached.at(2);
        let verifier = tokio::spawn(async move { server.scaler_status(GROUP_STATUS, group).await });
        let round = one_round(&scaler).await;
        assert_eq!(
            round,
            Round::Held {
                by: Control::Hpa,
                replicas: 2,
                current: 2,
                scaled: false
            }
        );
        let status = verifier.await.unwrap();
        assert_eq!(
            (
                status["backlog"].as_u64(),
                status["desiredReplicas"].as_u64()
            ),
            (Some(150), Some(2))
        );
        assert_eq!(status["lastScaleReason"], "backlog 900: scaling up to 9");
        assert_eq!(status["lastScaleTime"], "2026-11-30T09:00:00Z");
        let figures = scaler.ctx.figures.read().await;
        assert_eq!(
            figures[&("shop".to_owned(), "billing".to_owned())].backlog,
            Some(150)
        );
    }

    /// What a group at zero writes when a later round (or a wake) finds a message: the status
    /// of its first round, then the scale to 1, its Event and the new status (returned).
    fn woken_from_zero(
        mut server: ApiServerVerifier,
        group: Value,
    ) -> tokio::task::JoinHandle<(ApiServerVerifier, Value)> {
        tokio::spawn(async move {
            server.scaler_status(GROUP_STATUS, group.clone()).await;
            assert_eq!(server.scale().await, json!({"spec": {"replicas": 1}}));
            server.event().await;
            let status = server.scaler_status(GROUP_STATUS, group).await;
            (server, status)
        })
    }

    /// One round of the (only) group a scaler has.
    async fn one_round(scaler: &Scaler) -> Round {
        scaler
            .scale_group(&scaler.groups.state()[0], now_ms())
            .await
            .unwrap()
    }

    /// A scaler over `group` (its spec or metadata changed), on `setup`'s queue.
    fn with_group(scaler: &Scaler, group: &Value) -> Scaler {
        Scaler::new(
            scaler.ctx.clone(),
            store(vec![group.clone()]),
            scaler.queues.clone(),
            scaler.deployments.clone(),
        )
    }

    #[tokio::test]
    async fn external_mode_runs_spec_replicas_whatever_the_backlog() {
        let (scaler, mut server, mut group, cached) =
            setup(json!({"mode": "External", "maxReplicas": 3}), 500, "orders").await;
        group["spec"]["replicas"] = json!(5);
        let scaler = with_group(&scaler, &group);
        cached.at(1);
        let verifier = tokio::spawn(async move {
            assert_eq!(server.scale().await, json!({"spec": {"replicas": 5}}));
            let event = server.event().await;
            assert!(
                event["note"]
                    .as_str()
                    .unwrap()
                    .contains("spec.replicas 5 (External mode) (from 1)"),
                "{event}"
            );
            server.scaler_status(GROUP_STATUS, group).await
        });
        let round = one_round(&scaler).await;
        assert_eq!(
            round,
            Round::Held {
                by: Control::External(Some(5)),
                replicas: 5,
                current: 1,
                scaled: true
            },
            "not capped by maxReplicas: the external scaler's bounds are its own"
        );
        let status = verifier.await.unwrap();
        assert_eq!(status["backlog"], 500, "the figures are published");
        assert_eq!(status["desiredReplicas"], 5);
        assert_eq!(status["lastScaleReason"], "spec.replicas 5 (External mode)");
        let figures = scaler.ctx.figures.read().await;
        let f = &figures[&("shop".to_owned(), "billing".to_owned())];
        assert_eq!((f.backlog, f.desired_replicas), (Some(500), 5));
    }

    #[tokio::test]
    async fn external_mode_without_replicas_leaves_the_workers_where_they_are() {
        let (scaler, mut server, group, cached) =
            setup(json!({"mode": "External"}), 500, "orders").await;
        cached.at(2);
        let verifier = tokio::spawn(async move {
            // No scale request, no Event: straight to the status.
            server.scaler_status(GROUP_STATUS, group).await
        });
        let round = one_round(&scaler).await;
        assert_eq!(
            round,
            Round::Held {
                by: Control::External(None),
                replicas: 2,
                current: 2,
                scaled: false
            }
        );
        assert_eq!(verifier.await.unwrap()["desiredReplicas"], 2);
    }

    #[tokio::test]
    async fn a_pause_holds_the_workers_at_its_count_in_every_mode() {
        for mode in ["Direct", "External", "HPA"] {
            let (scaler, mut server, mut group, cached) =
                setup(json!({"mode": mode}), 500, "orders").await;
            group["spec"]["replicas"] = json!(4);
            group["metadata"]["annotations"] = json!({"cosmosq.io/paused-replicas": "1"});
            let scaler = with_group(&scaler, &group);
            cached.at(3);
            let verifier = tokio::spawn(async move {
                assert_eq!(server.scale().await, json!({"spec": {"replicas": 1}}));
                server.event().await; // Scaled
                let paused = server.event().await;
                assert_eq!(
                    (&paused["type"], &paused["reason"]),
                    (&json!("Normal"), &json!("PausedByAnnotation"))
                );
                if mode != "External" {
                    // spec.replicas means nothing here; the pause still wins.
                    assert_eq!(server.event().await["reason"], "ReplicasIgnored");
                }
                server.scaler_status(GROUP_STATUS, group).await
            });
            let round = one_round(&scaler).await;
            assert_eq!(
                round,
                Round::Held {
                    by: Control::Paused(Some(1)),
                    replicas: 1,
                    current: 3,
                    scaled: true
                },
                "{mode}"
            );
            let status = verifier.await.unwrap();
            let paused = status["conditions"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["type"] == "Paused")
                .unwrap()
                .clone();
            assert_eq!(paused["status"], "True", "{mode}");
            assert_eq!(
                paused["message"], "held at 1 replicas by cosmosq.io/paused-replicas",
                "{mode}"
            );
            assert_eq!(status["backlog"], 500, "{mode}: still measured");
        }
    }

    #[tokio::test]
    async fn an_unreadable_pause_holds_the_workers_and_warns_once() {
        let (unpaused, mut server, mut group, cached) = setup(json!({}), 500, "orders").await;
        group["metadata"]["annotations"] = json!({"cosmosq.io/paused-replicas": "two"});
        let scaler = with_group(&unpaused, &group);
        drop(unpaused);
        cached.at(1);
        let verifier = tokio::spawn(async move {
            let warning = server.event().await;
            assert_eq!(
                (&warning["type"], &warning["reason"]),
                (&json!("Warning"), &json!("InvalidPauseAnnotation"))
            );
            assert!(
                warning["note"].as_str().unwrap().contains("\"two\""),
                "{warning}"
            );
            let status = server.scaler_status(GROUP_STATUS, group.clone()).await;
            let mut group = group;
            group["status"] = status;
            (server, group)
        });
        let round = one_round(&scaler).await;
        assert_eq!(
            round,
            Round::Held {
                by: Control::Paused(None),
                replicas: 1,
                current: 1,
                scaled: false
            },
            "a backlog of 500 does not scale a group its user meant to pause"
        );
        // The next round (a new process: its first status write) sees the status the first
        // wrote: no second Warning.
        let (mut server, group) = verifier.await.unwrap();
        let next = with_group(&scaler, &group);
        cached.at(1);
        let verifier = tokio::spawn(async move {
            server.scaler_status(GROUP_STATUS, group).await;
            server
        });
        one_round(&next).await;
        let server = verifier.await.unwrap();
        drop((scaler, next));
        server.done().await;
    }

    #[tokio::test]
    async fn an_idle_group_is_estimated_again_only_when_its_queue_moved() {
        let (scaler, server, group, cached) = setup(json!({}), 0, "orders").await;
        cached.at(0);
        // Round 2 changes nothing and writes nothing; round 3 finds the message.
        let verifier = woken_from_zero(server, group);
        let cq = scaler.queues.state()[0].clone();
        let queue = scaler.ctx.cosmos.queue(&cq).await.unwrap();
        let calls = |since: &cosmosq_queue::ChargeSnapshot, operation: &str| {
            let spent = queue.charges().snapshot().since(since);
            spent.by_operation.get(operation).map_or(0, |c| c.calls)
        };

        let first = queue.charges().snapshot();
        let round = one_round(&scaler).await;
        assert!(
            matches!(
                round,
                Round::Decided {
                    decision: Decision { replicas: 0, .. },
                    ..
                }
            ),
            "{round:?}"
        );
        assert!(calls(&first, "estimate") > 0, "the first round estimates");

        let second = queue.charges().snapshot();
        let group = scaler.groups.state()[0].clone();
        let round = scaler.scale_group(&group, now_ms() + 500).await.unwrap();
        assert!(
            matches!(
                round,
                Round::Decided {
                    decision: Decision { replicas: 0, .. },
                    ..
                }
            ),
            "{round:?}"
        );
        assert_eq!(
            calls(&second, "estimate"),
            0,
            "nothing was written: nothing estimated"
        );
        assert_eq!(calls(&second, "feed head"), 4, "one probe per partition");

        queue
            .enqueue(NewMessage::json(json!({"late": true})))
            .await
            .unwrap();
        let third = queue.charges().snapshot();
        // A later round (rounds are told apart by their start; these come within a millisecond).
        let round = scaler.scale_group(&group, now_ms() + 1_000).await.unwrap();
        assert!(
            matches!(
                round,
                Round::Decided {
                    decision: Decision { replicas: 1, .. },
                    scaled: true,
                    ..
                }
            ),
            "the feed moved: estimated, and woken: {round:?}"
        );
        assert!(calls(&third, "estimate") > 0);
        let (server, status) = verifier.await.unwrap();
        assert_eq!(status["backlog"], 1);
        drop(scaler);
        server.done().await;
    }

    #[tokio::test]
    async fn a_group_no_sidecar_has_started_is_seen_and_woken_from_zero() {
        let (ctx, mut server, _cosmos) = emulator_context().await;
        let cq: CosmosQueue = serde_json::from_value(queue_json()).unwrap();
        let queue = ctx.cosmos.provision(&cq).await.unwrap().0;
        // Enqueued before the group exists: "now" excludes it.
        queue
            .enqueue(NewMessage::json(json!({"early": true})))
            .await
            .unwrap();
        let group = group_json(json!({"scaling": {"minReplicas": 0, "activationThreshold": 3}}));
        let cached = Cached::new();
        cached.at(0);
        let scaler = Scaler::new(
            ctx,
            store(vec![group.clone()]),
            store(vec![queue_json()]),
            cached.1.clone(),
        );
        let verifier = tokio::spawn(async move {
            let first = server.scaler_status(GROUP_STATUS, group.clone()).await;
            server.scaler_status(QUEUE_STATUS, queue_json()).await;
            assert_eq!(server.scale().await, json!({"spec": {"replicas": 1}}));
            let event = server.event().await;
            assert!(
                event["note"]
                    .as_str()
                    .unwrap()
                    .contains("activation threshold"),
                "{event}"
            );
            server.scaler_status(GROUP_STATUS, group).await;
            first
        });
        // Round 1 creates the leases at the feed's current position: nothing to do yet.
        scaler.round().await;
        for i in 0..3 {
            queue
                .enqueue(NewMessage::json(json!({"n": i})))
                .await
                .unwrap();
        }
        // Round 2 sees the three messages: the threshold wakes the group.
        let round = one_round(&scaler).await;
        assert_eq!(
            round,
            Round::Decided {
                decision: Decision {
                    replicas: 1,
                    reason: Reason::Activated
                },
                current: 0,
                scaled: true
            }
        );
        let first = verifier.await.unwrap();
        assert_eq!(
            first["backlog"], 0,
            "the message from before the group is not its work"
        );
        assert_eq!(
            first["ranges"].as_array().unwrap().len(),
            4,
            "one lease per partition"
        );
    }

    #[tokio::test]
    async fn a_wake_looks_at_the_queues_groups_at_zero_at_once() {
        let (scaler, server, group, cached) = setup(json!({}), 0, "orders").await;
        cached.at(0);
        // The wake, in the same millisecond as the round or not, finds the message.
        let verifier = woken_from_zero(server, group);
        // A round whose clock reads no earlier than the wake's (the same millisecond, or a
        // later one here): its probe of the head is older than the message all the same.
        let now = now_ms() + 5_000;
        let round = scaler.scale_group(&scaler.groups.state()[0], now).await;
        assert!(
            matches!(round, Ok(Round::Decided { scaled: false, .. })),
            "nothing to do yet: {round:?}"
        );
        enqueue_one(&scaler).await;

        // Another queue's wake, or one in another namespace, looks at none of these groups.
        let width = Semaphore::new(crate::wake::WAKE_WIDTH);
        let other = ObjectRef::<CosmosQueue>::new("other").within("shop");
        assert_eq!(scaler.wake(&other, &width).await, 0);
        let elsewhere = ObjectRef::<CosmosQueue>::new("orders").within("elsewhere");
        assert_eq!(scaler.wake(&elsewhere, &width).await, 0);
        // Its own: the feed moved since the round's probe, so the group is estimated and
        // scaled from zero now, not at the next round.
        let orders = ObjectRef::<CosmosQueue>::new("orders").within("shop");
        assert_eq!(scaler.wake(&orders, &width).await, 1);
        let (server, status) = timeout(verifier).await;
        assert_eq!(status["backlog"], 1);
        // Running, the group is the rounds' again: a wake looks at nothing.
        cached.at(1);
        assert_eq!(scaler.wake(&orders, &width).await, 0);
        assert_eq!(
            scaler.ctx.metrics.wakes.get(),
            2,
            "wakes of queues that exist"
        );
        drop(scaler);
        server.done().await;
    }

    #[tokio::test(start_paused = true)]
    async fn wakes_handed_to_the_loop_scale_the_group_from_zero_once() {
        let (scaler, server, group, cached) = setup(json!({}), 0, "orders").await;
        cached.at(0);
        let verifier = woken_from_zero(server, group);
        one_round(&scaler).await;
        enqueue_one(&scaler).await;
        let scaler = Arc::new(scaler);
        let (wakes, inbox) = mpsc::channel(crate::wake::WAKE_BACKLOG);
        let stop = CancellationToken::new();
        let running = tokio::spawn(crate::wake::run(scaler.clone(), inbox, stop.clone()));
        // Told three times at once: one wake, and one more folded behind it.
        for _ in 0..3 {
            wakes
                .send(ObjectRef::new("orders").within("shop"))
                .await
                .unwrap();
        }
        let (server, _) = timeout(verifier).await;
        // The folded one comes a spacing later, finds the group running and leaves it.
        cached.at(1);
        tokio::time::sleep(crate::wake::WAKE_SPACING * 3).await;
        stop.cancel();
        running.await.unwrap();
        assert_eq!(scaler.ctx.metrics.wakes.get(), 2);
        drop(scaler);
        server.done().await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_scale_just_applied_counts_until_the_cache_says_so() {
        let at = tokio::time::Instant::now();
        assert_eq!(believed(0, None, at), 0);
        assert_eq!(
            believed(0, Some((1, at)), at),
            1,
            "the cache is behind the scale"
        );
        assert_eq!(believed(1, Some((1, at)), at), 1);
        // Long after, the cache is the truth (someone else scaled, or the scale was undone).
        assert_eq!(believed(2, Some((1, at)), at + CACHE_LAG), 2);
    }

    #[test]
    fn idle_estimates_fall_due_spread_over_the_second_half_of_the_horizon() {
        let full = duration_ms(DUE_HORIZON);
        let horizons: Vec<i64> = (0..1_000)
            .map(|i| idle_horizon(Some(&format!("uid-{i}"))))
            .collect();
        assert!(horizons.iter().all(|h| (full / 2..=full).contains(h)));
        // Spread: each quarter of that half holds a fair share of 1,000 groups.
        for quarter in 0..4 {
            let from = full / 2 + quarter * full / 8;
            let n = horizons
                .iter()
                .filter(|h| (from..from + full / 8).contains(h))
                .count();
            assert!((150..=350).contains(&n), "{n} in quarter {quarter}");
        }
        assert_eq!(idle_horizon(Some("uid-1")), idle_horizon(Some("uid-1")));
    }

    #[test]
    fn a_groups_clock_holds_for_an_interleaved_round_and_follows_a_clock_stepped_back() {
        assert_eq!(monotone(10_000, 12_000), 12_000, "forward");
        assert_eq!(
            monotone(10_000, 9_000),
            10_000,
            "a wake's clock before a round's"
        );
        assert_eq!(
            monotone(100_000, 10_000),
            10_000,
            "the wall clock stepped back"
        );
    }

    /// One message on the scaler's (only) queue.
    async fn enqueue_one(scaler: &Scaler) {
        let cq = scaler.queues.state()[0].clone();
        let queue = scaler.ctx.cosmos.queue(&cq).await.unwrap();
        queue
            .enqueue(NewMessage::json(json!({"woken": true})))
            .await
            .unwrap();
    }

    /// A verifier's end, or a failure if what it waits for never comes.
    async fn timeout<T>(verifier: tokio::task::JoinHandle<T>) -> T {
        tokio::time::timeout(Duration::from_secs(60), verifier)
            .await
            .expect("the API calls the test waits for")
            .unwrap()
    }
}
