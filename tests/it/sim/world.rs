//! One history, run: the engine's hosts (one per pod, as sidecars run), the producer, the app
//! and every fault of the plan, in one thread on tokio's paused time, against the SDK's
//! in-memory emulator through the SDK's own calls. Faults are the SDK's fault injection,
//! switched on and off at the plan's times, so whether a request fails is decided by the
//! plan, not by chance.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cosmosq_emulator::fault_injection::{
    CustomResponseBuilder, FaultInjectionConditionBuilder, FaultInjectionErrorType,
    FaultInjectionResultBuilder, FaultInjectionRule, FaultInjectionRuleBuilder, FaultOperationType,
};
use cosmosq_emulator::{Emulator, EmulatorOptions, RequestObserver};
use cosmosq_queue::host::{Host, HostOptions};
use cosmosq_queue::pull::{pull, Puller, Verdict};
use cosmosq_queue::{
    provision, Clock, Delivery, DeliveryMode, ExclusiveWrites, GroupConfig, MessageKey, NewMessage,
    Outcome, Queue, QueueConfig, RetryPolicy, StartFrom,
};
use futures::future::BoxFuture;
use serde_json::json;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::check;
use super::plan::{AnswerKind, Event, Fault, Op, Plan, FAULTS, OPS};

/// The wall-clock time every history starts at (the SDK's signing uses the machine's clock;
/// nothing the engine decides does).
pub const START_MS: i64 = 1_800_000_000_000;

/// How long one history may run on the machine's clock before it counts as hung.
const WALL_LIMIT: Duration = Duration::from_secs(120);

/// How long a history may take to settle after its last event, simulated.
const SETTLE_WITHIN: Duration = Duration::from_secs(600);

/// A message's identity: its id and its key, as Cosmos DB knows an item.
pub type Identity = (String, String);

pub fn identity(id: &str, key: &MessageKey) -> Identity {
    (id.to_owned(), key.canonical())
}

/// One delivery as the app saw it.
#[derive(Clone, Debug)]
pub struct AppDelivery {
    pub group: usize,
    pub msg: usize,
    pub pod: usize,
    pub incarnation: u32,
    pub count: u32,
    pub begin: u64,
    /// When the app's work ends, whether or not anyone waits for the answer: the app
    /// outlives a sidecar that dies, and a call the sidecar drops.
    pub work_end: u64,
    /// The answer the app gave, when the call lasted that long.
    pub answered: Option<(u64, AnswerKind)>,
    /// The sidecar dropped the call (lock lost, killed) at this time.
    pub cut: Option<u64>,
    /// Until when the engine told the app the delivery was its alone (by the holder's clock),
    /// as last renewed.
    pub lock: Option<cosmosq_queue::handler::LockedUntil>,
    /// The same, as it was when the app got the delivery.
    pub lock_at_begin: Option<i64>,
}

/// Everything a history did that the checks read.
#[derive(Default)]
pub struct Ledger {
    pub deliveries: Vec<AppDelivery>,
    /// Handler calls per (group, message), refused ones included: the n-th gets answer n.
    pub calls: BTreeMap<(usize, usize), u32>,
    /// Which plan message each stored identity is (the first enqueue that stored it).
    pub stored: BTreeMap<Identity, usize>,
    /// When each plan message was stored, simulated ms; `None`: a duplicate or never.
    pub stored_at: BTreeMap<usize, u64>,
    /// The order messages were stored in (the feed's order within a key).
    pub stored_seq: BTreeMap<usize, u64>,
    /// (ms, pod, incarnation) of each kill.
    pub kills: Vec<(u64, usize, u32)>,

    /// Deliveries of messages no producer stored.
    pub strays: Vec<String>,
    /// The operator's estimates, taken as the history runs: (began at ms, group, backlog).
    pub estimates: Vec<(u64, usize, u64)>,
    /// What happened, in order: app events and every request to the emulator.
    pub trace: Vec<String>,
}

pub struct Shared {
    pub plan: Plan,
    pub origin: Instant,
    pub ledger: Mutex<Ledger>,
    /// What the engine recorded as durable, when (its ledger events).
    pub recorded: Arc<Mutex<Vec<super::logs::Recorded>>>,
    pub changed: Notify,
}

impl Shared {
    pub fn now(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Records every request the emulator handles, with its simulated time.
#[derive(Debug)]
struct Requests(Arc<Mutex<Vec<String>>>, Instant);

impl RequestObserver for Requests {
    fn on_request(&self, request: &azure_core::http::Request) {
        let line = format!(
            "{} {} {}",
            self.1.elapsed().as_millis(),
            request.method(),
            request.url().path()
        );
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(line);
    }
}

/// What a run produced.
pub struct Report {
    pub verdict: Result<(), String>,
    /// The operator's estimates as the history took them: (ms, group, backlog).
    pub estimates: Vec<(u64, usize, u64)>,
    /// The app's events and the requests, for comparing two runs of a seed.
    pub trace: Vec<String>,
    pub simulated_ms: u64,
    pub log: String,
}

/// The app's planned crashes are panics the engine catches: they must not fill the output.
fn quiet_planned_crashes() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let planned = info
                .payload()
                .downcast_ref::<String>()
                .is_some_and(|s| s.starts_with(PLANNED_CRASH));
            if !planned {
                previous(info);
            }
        }));
    });
}

const PLANNED_CRASH: &str = "the app crashed on purpose";

/// The SDK asks the machine once per process whether it is an Azure VM (IMDS, with a 2 s
/// connect timeout that paused time would skip in whichever history came first): asked here,
/// on real time, before any history.
fn ask_the_machine_once() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let emulator = Emulator::in_process(EmulatorOptions::default()).expect("emulator");
            emulator.client().await.expect("client");
        });
    });
}

/// Runs `plan` with `bugs` put back, on a thread of its own.
pub fn run(plan: &Plan, bugs: &[cosmosq_queue::buggify::Bug]) -> Report {
    quiet_planned_crashes();
    ask_the_machine_once();
    let (plan, bugs) = (plan.clone(), bugs.to_vec());
    let log = Arc::new(Mutex::new(Vec::<u8>::new()));
    let log_out = Arc::clone(&log);
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let history = std::thread::Builder::new()
        .name(format!("sim-{}", plan.seed))
        .stack_size(16 << 20)
        .spawn(move || {
            cosmosq_queue::buggify::set(&bugs);
            cosmosq_queue::chance::seed_thread(plan.seed);
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .start_paused(true)
                .build()
                .expect("runtime");
            let recorded = Arc::new(Mutex::new(Vec::new()));
            let report = runtime.block_on(async {
                let _log = super::logs::capture(&log, &recorded);
                World::run(plan, recorded.clone()).await
            });
            let _ = done_tx.send(());
            report
        })
        .expect("thread");
    // A loop that never waits on time keeps simulated time still: the history would never
    // end. It is reported (and its thread left behind) instead of hanging the suite.
    if done_rx.recv_timeout(WALL_LIMIT).is_err() && !history.is_finished() {
        return Report {
            verdict: Err(format!(
                "hang: the history did not end within {} s of wall time (a loop that never waits?)",
                WALL_LIMIT.as_secs()
            )),
            estimates: Vec::new(),
            trace: Vec::new(),
            simulated_ms: 0,
            log: String::from_utf8_lossy(&log_out.lock().unwrap_or_else(|e| e.into_inner())).into(),
        };
    }
    let joined = history.join();
    let log = String::from_utf8_lossy(&log_out.lock().unwrap_or_else(|e| e.into_inner())).into();
    match joined {
        Ok(mut report) => {
            report.log = log;
            report
        }
        Err(panic) => Report {
            verdict: Err(format!(
                "panic: the history panicked: {}",
                panic_text(&panic)
            )),
            estimates: Vec::new(),
            trace: Vec::new(),
            simulated_ms: 0,
            log,
        },
    }
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string payload".into())
}

/// The host timings of every pod: the change feed processor's, scaled down so that a history
/// sees many lease moves in little simulated time.
pub fn host_options(
    owner: &str,
    incarnation: u32,
    concurrency: usize,
    promote_after: Duration,
    leases_per_partition: u32,
) -> HostOptions {
    HostOptions {
        leases_per_partition,
        incarnation: incarnation.to_string(),
        max_concurrency: concurrency,
        max_in_flight_per_range: 16,
        page_size: 8,
        min_poll: Duration::from_millis(20),
        max_poll: Duration::from_secs(1),
        sweep_interval: Duration::from_secs(1),
        lease_renew: Duration::from_secs(2),
        lease_acquire: Duration::from_millis(1_500),
        lease_expire: Duration::from_secs(6),
        checkpoint_interval: Duration::from_millis(200),
        promote_after,
        ..HostOptions::new(owner)
    }
}

pub fn group_config(plan: &Plan, g: usize) -> GroupConfig {
    let spec = &plan.groups[g];
    GroupConfig::new(format!("g{g}"))
        .with_mode(if spec.stream {
            DeliveryMode::Stream
        } else {
            DeliveryMode::Exclusive
        })
        .with_exclusive_writes(if spec.claims {
            ExclusiveWrites::Claims
        } else {
            ExclusiveWrites::Lease
        })
        .with_ordering(spec.ordered)
        .with_start_from(StartFrom::Beginning)
        .with_lock_duration(Duration::from_millis(spec.lock_ms))
        .with_retry(RetryPolicy {
            max_delivery_attempts: spec.max_attempts,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(2),
            ..RetryPolicy::default()
        })
}

/// The fault switches: one rule per (fault, operation), shared by every pod's client, and a
/// partition rule per pod. All start off.
struct Faults {
    shared: BTreeMap<(u8, u8), Vec<Arc<FaultInjectionRule>>>,
    partitions: Vec<Arc<FaultInjectionRule>>,
}

fn fault_code(f: Fault) -> u8 {
    f as u8
}

fn op_code(o: Op) -> u8 {
    o as u8
}

impl Faults {
    fn new(pods: usize) -> Self {
        let mut shared = BTreeMap::new();
        for fault in FAULTS {
            for op in OPS {
                let result = match fault {
                    Fault::Throttled => FaultInjectionResultBuilder::new().with_custom_response(
                        CustomResponseBuilder::new(azure_core::http::StatusCode::TooManyRequests)
                            .with_header("x-ms-retry-after-ms", "40")
                            .build(),
                    ),
                    Fault::Overloaded => FaultInjectionResultBuilder::new().with_custom_response(
                        CustomResponseBuilder::new(azure_core::http::StatusCode::TooManyRequests)
                            .with_header("x-ms-retry-after-ms", "2000")
                            .build(),
                    ),
                    Fault::Unavailable => FaultInjectionResultBuilder::new()
                        .with_error(FaultInjectionErrorType::ServiceUnavailable),
                    Fault::Timeout => FaultInjectionResultBuilder::new()
                        .with_error(FaultInjectionErrorType::ResponseTimeout),
                    Fault::LostAnswer => FaultInjectionResultBuilder::new()
                        .with_error(FaultInjectionErrorType::ResponseTimeoutAfterService),
                    Fault::Refused => FaultInjectionResultBuilder::new().with_custom_response(
                        CustomResponseBuilder::new(azure_core::http::StatusCode::BadRequest)
                            .with_body(
                                br#"{"code":"BadRequest","message":"refused by the simulation"}"#
                                    .to_vec(),
                            )
                            .build(),
                    ),
                };
                // A write of a document that exists: a replace, and the upserts and deletes
                // of the hosts' heartbeats (a seed draws the same `Op`s as before).
                let operations: &[FaultOperationType] = match op {
                    Op::Create => &[FaultOperationType::CreateItem],
                    Op::Replace => &[
                        FaultOperationType::ReplaceItem,
                        FaultOperationType::UpsertItem,
                        FaultOperationType::DeleteItem,
                    ],
                    Op::Read => &[FaultOperationType::ReadItem],
                    Op::Query => &[FaultOperationType::QueryItem],
                    Op::Feed => &[FaultOperationType::ChangeFeedItem],
                    Op::Batch => &[FaultOperationType::BatchItem],
                };
                let result = result.with_probability(1.0).build();
                let rules = operations
                    .iter()
                    .map(|operation| {
                        let rule = FaultInjectionRuleBuilder::new(
                            format!("{fault:?}-{operation:?}"),
                            result.clone(),
                        )
                        .with_condition(
                            FaultInjectionConditionBuilder::new()
                                .with_operation_type(*operation)
                                .build(),
                        )
                        .build();
                        rule.disable();
                        Arc::new(rule)
                    })
                    .collect();
                shared.insert((fault_code(fault), op_code(op)), rules);
            }
        }
        let partitions = (0..pods)
            .map(|p| {
                let rule = FaultInjectionRuleBuilder::new(
                    format!("partition-{p}"),
                    FaultInjectionResultBuilder::new()
                        .with_error(FaultInjectionErrorType::ConnectionError)
                        .with_probability(1.0)
                        .build(),
                )
                .build();
                rule.disable();
                Arc::new(rule)
            })
            .collect();
        Faults { shared, partitions }
    }

    fn rules_of(&self, pod: usize) -> Vec<Arc<FaultInjectionRule>> {
        std::iter::once(Arc::clone(&self.partitions[pod]))
            .chain(self.shared.values().flatten().cloned())
            .collect()
    }

    fn all_off(&self) {
        for rule in self.shared.values().flatten().chain(&self.partitions) {
            rule.disable();
        }
    }
}

/// A pod: one sidecar's host of one group, started and killed as the plan says.
#[derive(Default)]
struct Pod {
    incarnation: u32,
    running: Option<Running>,
    clock: Option<Clock>,
}

struct Running {
    host: tokio::task::JoinHandle<cosmosq_queue::Result<()>>,
    stop: CancellationToken,
    /// The app's pull workers take no more once the sidecar is gone.
    workers_stop: CancellationToken,
}

pub struct World {
    shared: Arc<Shared>,
    emulator: Arc<Emulator>,
    producer: Queue,
    base_clock: Clock,
    faults: Faults,
    pods: Vec<Arc<tokio::sync::Mutex<Pod>>>,
    requests: Arc<Mutex<Vec<String>>>,
}

impl World {
    async fn run(plan: Plan, recorded: Arc<Mutex<Vec<super::logs::Recorded>>>) -> Report {
        let origin = Instant::now();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let emulator = Emulator::in_process(EmulatorOptions {
            partitions: plan.partitions,
            observer: Some(Arc::new(Requests(Arc::clone(&requests), origin))),
            ..Default::default()
        })
        .expect("emulator");
        let debug = std::env::var_os("COSMOSQ_SIM_DEBUG").is_some();
        if debug {
            eprintln!("emulator at {:?}", origin.elapsed());
        }
        let client = emulator.client().await.expect("client");
        if debug {
            eprintln!("client at {:?}", origin.elapsed());
        }
        let mut config = QueueConfig::new("db", "q");
        config.retention = Some(Duration::from_secs(u64::from(plan.retention_secs)));
        provision(&client, &config).await.expect("provision");
        if debug {
            eprintln!("provisioned at {:?}", origin.elapsed());
        }
        emulator
            .apply_partition_count("db", "q")
            .await
            .expect("partitions");
        if debug {
            eprintln!("partitions at {:?}", origin.elapsed());
        }
        let base_clock = Clock::following_tokio(START_MS);
        let producer = Queue::open_with_clock(&client, config, base_clock.clone())
            .await
            .expect("open");
        let faults = Faults::new(plan.pods.len());
        let pods = plan.pods.iter().map(|_| Arc::default()).collect();
        let world = Arc::new(World {
            shared: Arc::new(Shared {
                plan,
                origin,
                ledger: Mutex::default(),
                recorded,
                changed: Notify::new(),
            }),
            emulator,
            producer,
            base_clock,
            faults,
            pods,
            requests,
        });
        let verdict = Arc::clone(&world).play().await;
        let simulated_ms = world.shared.now();
        let mut trace = std::mem::take(&mut world.shared.ledger().trace);
        trace.extend(std::mem::take(
            &mut *world.requests.lock().unwrap_or_else(|e| e.into_inner()),
        ));
        let estimates = world.shared.ledger().estimates.clone();
        Report {
            verdict,
            estimates,
            trace,
            simulated_ms,
            log: String::new(),
        }
    }

    fn plan(&self) -> &Plan {
        &self.shared.plan
    }

    /// The timeline, then healing, settling and the checks.
    async fn play(self: Arc<Self>) -> Result<(), String> {
        let plan = self.plan().clone();
        let mut timeline: Vec<(u64, Step)> = Vec::new();
        for (p, pod) in plan.pods.iter().enumerate() {
            timeline.push((pod.start_ms, Step::Start(p)));
        }
        let mut batches: BTreeMap<(u64, String), Vec<usize>> = BTreeMap::new();
        for (m, message) in plan.messages.iter().enumerate() {
            if message.batch {
                batches
                    .entry((message.at_ms, message.key.to_string()))
                    .or_default()
                    .push(m);
            } else {
                timeline.push((message.at_ms, Step::Enqueue(vec![m])));
            }
        }
        for ((at, _), ms) in batches {
            timeline.push((at, Step::Enqueue(ms)));
        }
        for (i, timed) in plan.events.iter().enumerate() {
            timeline.push((timed.at_ms, Step::Event(i)));
        }
        // Stable: at one time, pods start first, then messages, then faults, in plan order.
        timeline.sort_by_key(|(at, step)| (*at, step.rank()));
        let mut lifecycle = Vec::new();
        let estimating = CancellationToken::new();
        let estimator = tokio::spawn(Arc::clone(&self).estimate(estimating.clone()));
        for (at, step) in timeline {
            tokio::time::sleep_until(self.shared.origin + Duration::from_millis(at)).await;
            match step {
                // A pod cut off from Cosmos DB starts when it can; the timeline goes on.
                Step::Start(p) => lifecycle.push(tokio::spawn(Arc::clone(&self).start(p))),
                Step::Enqueue(ms) => self.enqueue(&ms).await,
                Step::Event(i) => {
                    if let Some(task) = Arc::clone(&self).event(plan.events[i].event.clone()).await
                    {
                        lifecycle.push(task);
                    }
                }
            }
        }
        // Heal once the last fault has run its course: no more faults, every pod up.
        let healed = plan
            .events
            .iter()
            .map(|e| match e.event {
                Event::Partition { for_ms, .. } | Event::Fault { for_ms, .. } => e.at_ms + for_ms,
                _ => e.at_ms,
            })
            .max()
            .unwrap_or(0);
        tokio::time::sleep_until(self.shared.origin + Duration::from_millis(healed)).await;
        self.faults.all_off();
        estimating.cancel();
        let _ = estimator.await;
        for task in lifecycle {
            let _ = task.await;
        }
        for p in 0..plan.pods.len() {
            let up = self.pods[p].lock().await.running.is_some();
            if !up {
                Arc::clone(&self).start(p).await;
            }
        }
        self.settle().await;
        let stops: Vec<_> = {
            let mut running = Vec::new();
            for pod in &self.pods {
                if let Some(r) = pod.lock().await.running.take() {
                    r.stop.cancel();
                    r.workers_stop.cancel();
                    running.push(r.host);
                }
            }
            running
        };
        for host in stops {
            match tokio::time::timeout(Duration::from_secs(300), host).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => return Err(format!("host failed: it ended with an error: {e}")),
                Ok(Err(e)) => return Err(format!("host failed: it panicked: {e}")),
                Err(_) => return Err("host failed: it did not stop within 300 s of SIGTERM".into()),
            }
        }
        check::all(&self.shared, &self.producer).await
    }

    /// Takes the operator's estimate of every group every few seconds, as a scaler would.
    async fn estimate(self: Arc<Self>, stop: CancellationToken) {
        let groups: Vec<_> = (0..self.plan().groups.len())
            .map(|g| {
                self.producer
                    .group(group_config(self.plan(), g))
                    .expect("group")
            })
            .collect();
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_secs(5)) => {}
            }
            for (g, group) in groups.iter().enumerate() {
                let began = self.shared.now();
                // As the operator's scaler asks (a group at zero has its leases made first).
                let estimate = group
                    .estimate_or_create_leases(self.base_clock.now_ms(), 6_000)
                    .await;
                if let Ok(estimate) = estimate {
                    self.shared
                        .ledger()
                        .estimates
                        .push((began, g, estimate.backlog()));
                }
            }
        }
    }

    /// Waits until the app has given every message a final answer (or it expired), then until
    /// the group's state says so, at most [`SETTLE_WITHIN`].
    async fn settle(&self) {
        let deadline = Instant::now() + SETTLE_WITHIN;
        // A history where nothing reaches the app for this long is stuck: no retry waits
        // longer, no lock or lease runs longer.
        let quiet_limit = Duration::from_secs(120);
        let mut last = (self.shared.ledger().deliveries.len(), Instant::now());
        while Instant::now() < deadline {
            if check::app_done(&self.shared) {
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
            let seen = self.shared.ledger().deliveries.len();
            if seen != last.0 {
                last = (seen, Instant::now());
            } else if last.1.elapsed() > quiet_limit {
                break;
            }
        }
        // The app is done: what it answered is recorded within a few lease writes and sweeps.
        let deadline = deadline.min(Instant::now() + Duration::from_secs(60));
        while Instant::now() < deadline {
            if check::recorded(&self.shared, &self.producer).await.is_ok() {
                return;
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
    }

    async fn enqueue(&self, ms: &[usize]) {
        let plan = self.plan();
        let messages: Vec<NewMessage> = ms
            .iter()
            .map(|&m| {
                let spec = &plan.messages[m];
                let mut message = NewMessage::json(json!({"m": m}))
                    .with_id(spec.id.clone())
                    .with_partition_key(MessageKey::from_json(spec.key.clone()).expect("key"))
                    .with_delay(Duration::from_millis(spec.delay_ms));
                if let Some(ttl) = spec.ttl_secs {
                    message = message.with_ttl(Duration::from_secs(u64::from(ttl)));
                }
                message
            })
            .collect();
        let results = match messages.len() {
            1 => vec![
                self.producer
                    .enqueue(messages.into_iter().next().expect("one"))
                    .await,
            ],
            _ => self.producer.enqueue_batch(messages).await,
        };
        let now = self.shared.now();
        let mut ledger = self.shared.ledger();
        // One write, one place in the feed: the SDK's emulator orders a batch's items by id,
        // so FIFO is checked between writes, not within a batch.
        let seq = ledger.stored_seq.values().max().map_or(0, |s| s + 1);
        for (&m, result) in ms.iter().zip(results) {
            let spec = &plan.messages[m];
            let id = identity(
                &spec.id,
                &MessageKey::from_json(spec.key.clone()).expect("key"),
            );
            match result {
                Ok(outcome) if !outcome.is_duplicate() => {
                    ledger.stored.entry(id).or_insert(m);
                    ledger.stored_at.insert(m, now);
                    ledger.stored_seq.insert(m, seq);
                    ledger.trace.push(format!("{now} enqueued m{m}"));
                }
                Ok(_) => ledger.trace.push(format!("{now} duplicate m{m}")),
                Err(e) => ledger
                    .strays
                    .push(format!("the producer could not enqueue m{m}: {e}")),
            }
        }
    }

    async fn start(self: Arc<Self>, p: usize) {
        let plan = self.plan();
        let g = plan.pods[p].group;
        let spec = &plan.groups[g];
        let mut pod = self.pods[p].lock().await;
        if pod.running.is_some() {
            return;
        }
        pod.incarnation += 1;
        let incarnation = pod.incarnation;
        let clock = pod
            .clock
            .get_or_insert_with(|| self.base_clock.with_skew(plan.pods[p].skew_ms))
            .clone();
        // A sidecar cut off from Cosmos DB at its start tries again, as the real one's
        // startup does (the operator's probes wait for it).
        let queue = loop {
            let opened = match self
                .emulator
                .client_with_faults(self.faults.rules_of(p))
                .await
            {
                Ok(client) => {
                    Queue::open_with_clock(&client, QueueConfig::new("db", "q"), clock.clone())
                        .await
                        .map_err(|e| e.to_string())
                }
                Err(e) => Err(e.to_string()),
            };
            match opened {
                Ok(queue) => break queue,
                Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        };
        let group = queue.group(group_config(plan, g)).expect("group");
        let options = host_options(
            &format!("g{g}-p{p}"),
            incarnation,
            spec.concurrency,
            Duration::from_millis(spec.promote_after_ms),
            plan.leases_per_partition,
        );
        let stop = CancellationToken::new();
        let workers_stop = CancellationToken::new();
        let host = if spec.pull {
            let (handler, puller) = pull();
            let handler = handler.stopping_with(stop.clone());
            for _ in 0..spec.concurrency.min(4) {
                tokio::spawn(worker(
                    Arc::clone(&self.shared),
                    puller.clone(),
                    g,
                    p,
                    incarnation,
                    workers_stop.clone(),
                ));
            }
            tokio::spawn(Host::new(group, handler, options).run(stop.clone()))
        } else {
            let handler = app(Arc::clone(&self.shared), g, p, incarnation);
            tokio::spawn(Host::new(group, handler, options).run(stop.clone()))
        };
        let now = self.shared.now();
        self.shared
            .ledger()
            .trace
            .push(format!("{now} start p{p}#{incarnation}"));
        pod.running = Some(Running {
            host,
            stop,
            workers_stop,
        });
    }

    /// Carries out one event; a restart to come is returned as a task.
    async fn event(self: Arc<Self>, event: Event) -> Option<tokio::task::JoinHandle<()>> {
        let now = self.shared.now();
        self.shared.ledger().trace.push(format!("{now} {event:?}"));
        match event {
            Event::Kill {
                pod: p,
                restart_after_ms,
            } => {
                let mut pod = self.pods[p].lock().await;
                let running = pod.running.take()?;
                running.host.abort();
                running.workers_stop.cancel();
                let _ = running.host.await;
                self.shared.ledger().kills.push((now, p, pod.incarnation));
                drop(pod);
                Some(tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(restart_after_ms)).await;
                    self.start(p).await;
                }))
            }
            Event::Stop {
                pod: p,
                restart_after_ms,
            } => {
                let running = self.pods[p].lock().await.running.take()?;
                running.stop.cancel();
                Some(tokio::spawn(async move {
                    let _ = running.host.await;
                    running.workers_stop.cancel();
                    tokio::time::sleep(Duration::from_millis(restart_after_ms)).await;
                    self.start(p).await;
                }))
            }
            Event::Partition { pod, for_ms } => {
                let rule = Arc::clone(&self.faults.partitions[pod]);
                rule.enable();
                Some(tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(for_ms)).await;
                    rule.disable();
                }))
            }
            Event::Fault { fault, op, for_ms } => {
                let rules = self.faults.shared[&(fault_code(fault), op_code(op))].clone();
                for rule in &rules {
                    rule.enable();
                }
                Some(tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(for_ms)).await;
                    for rule in &rules {
                        rule.disable();
                    }
                }))
            }
            Event::ClockJump { pod, by_ms } => {
                let mut pod = self.pods[pod].lock().await;
                if let Some(clock) = &pod.clock {
                    clock.jump(by_ms);
                } else {
                    let clock = self.base_clock.with_skew(by_ms);
                    pod.clock = Some(clock);
                }
                None
            }
            Event::Split { partitions } => {
                let now_partitions = self
                    .emulator
                    .partition_ids("db", "q")
                    .await
                    .map(|ids| ids.len() as u32)
                    .unwrap_or(partitions);
                if now_partitions >= partitions {
                    return None;
                }
                if let Err(e) = self
                    .emulator
                    .set_partition_count("db", "q", partitions)
                    .await
                {
                    self.shared
                        .ledger()
                        .strays
                        .push(format!("repartition failed: {e}"));
                }
                None
            }
            Event::TtlSweep => {
                super::ttl::sweep(&self.producer).await;
                None
            }
        }
    }
}

enum Step {
    Start(usize),
    Enqueue(Vec<usize>),
    Event(usize),
}

impl Step {
    fn rank(&self) -> u8 {
        match self {
            Step::Start(_) => 0,
            Step::Enqueue(_) => 1,
            Step::Event(_) => 2,
        }
    }
}

/// Marks a delivery cut when the sidecar drops the call before the app answered.
struct Cut {
    shared: Arc<Shared>,
    index: usize,
    answered: bool,
}

impl Drop for Cut {
    fn drop(&mut self) {
        if !self.answered {
            let now = self.shared.now();
            let mut ledger = self.shared.ledger();
            ledger.deliveries[self.index].cut = Some(now);
            ledger.trace.push(format!("{now} cut #{}", self.index));
            drop(ledger);
            self.shared.changed.notify_waiters();
        }
    }
}

/// Which message a delivery is, and the answer the app gives it: `None` when no producer
/// stored that identity (recorded as a stray).
fn answer_for(
    shared: &Shared,
    g: usize,
    d: &Delivery,
) -> Option<(usize, u32, super::plan::Answer)> {
    let id = identity(&d.message.id, &d.message.partition_key);
    let mut ledger = shared.ledger();
    let Some(&m) = ledger.stored.get(&id) else {
        ledger
            .strays
            .push(format!("g{g} delivered {id:?}, which no producer stored"));
        return None;
    };
    let calls = ledger.calls.entry((g, m)).or_default();
    *calls += 1;
    let n = *calls;
    Some((m, n, shared.plan.answer(m, n)))
}

/// Starts a delivery in the ledger; its index.
fn begin(
    shared: &Shared,
    (g, m, p, inc): (usize, usize, usize, u32),
    d: &Delivery,
    work: u64,
) -> usize {
    let count = d.delivery_count;
    let now = shared.now();
    let mut ledger = shared.ledger();
    ledger.deliveries.push(AppDelivery {
        group: g,
        msg: m,
        pod: p,
        incarnation: inc,
        count,
        begin: now,
        work_end: now + work,
        answered: None,
        cut: None,
        lock: Some(d.locked_until.clone()),
        lock_at_begin: d.locked_until.get(),
    });
    ledger
        .trace
        .push(format!("{now} begin g{g} m{m} #{count} p{p}#{inc}"));
    ledger.deliveries.len() - 1
}

fn answered(shared: &Shared, index: usize, kind: AnswerKind) {
    let now = shared.now();
    let mut ledger = shared.ledger();
    ledger.deliveries[index].answered = Some((now, kind));
    ledger.trace.push(format!("{now} answer #{index} {kind:?}"));
    drop(ledger);
    shared.changed.notify_waiters();
}

/// The app of a pushing pod: works as the plan says, answers as the plan says.
fn app(
    shared: Arc<Shared>,
    g: usize,
    p: usize,
    inc: u32,
) -> impl Fn(Delivery) -> BoxFuture<'static, Outcome> + Send + Sync + 'static {
    move |d: Delivery| {
        let shared = Arc::clone(&shared);
        Box::pin(async move {
            let Some((m, _, answer)) = answer_for(&shared, g, &d) else {
                return Outcome::Complete;
            };
            if answer.kind == AnswerKind::Refused {
                return Outcome::Undelivered {
                    reason: "connection refused".into(),
                    delay: Some(Duration::from_millis(50)),
                };
            }
            let index = begin(&shared, (g, m, p, inc), &d, answer.work_ms);
            let mut cut = Cut {
                shared: Arc::clone(&shared),
                index,
                answered: false,
            };
            tokio::time::sleep(Duration::from_millis(answer.work_ms)).await;
            cut.answered = true;
            answered(&shared, index, answer.kind);
            match answer.kind {
                AnswerKind::Complete => Outcome::Complete,
                AnswerKind::Retry | AnswerKind::Refused => Outcome::Retry {
                    reason: "the app failed".into(),
                    delay: None,
                },
                AnswerKind::Drop => Outcome::DeadLetter {
                    reason: "DroppedByApp".into(),
                    description: "the app dropped it".into(),
                },
                AnswerKind::Crash => panic!("{PLANNED_CRASH}: m{m}"),
            }
        })
    }
}

/// A pull worker of a pod's app: receives, works, settles; it crashes (never settles) where
/// the plan says so, and its lock then expires.
async fn worker(
    shared: Arc<Shared>,
    puller: Puller,
    g: usize,
    p: usize,
    inc: u32,
    stop: CancellationToken,
) {
    const VISIBILITY: Duration = Duration::from_secs(20);
    while !stop.is_cancelled() {
        let received = tokio::select! {
            _ = stop.cancelled() => return,
            received = puller.receive(4, VISIBILITY, Duration::from_secs(5)) => received,
        };
        // Each message received is worked on at once (the worker's threads).
        for r in received {
            let Some((m, _, answer)) = answer_for(&shared, g, &r.delivery) else {
                let _ = puller.settle(&r.lock_token, Verdict::Complete);
                continue;
            };
            let index = begin(&shared, (g, m, p, inc), &r.delivery, answer.work_ms);
            let (shared, puller) = (Arc::clone(&shared), puller.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(answer.work_ms)).await;
                answered(&shared, index, answer.kind);
                let verdict = match answer.kind {
                    AnswerKind::Complete => Verdict::Complete,
                    AnswerKind::Retry | AnswerKind::Refused => Verdict::Abandon {
                        reason: "the worker failed".into(),
                        delay: None,
                    },
                    AnswerKind::Drop => Verdict::DeadLetter {
                        reason: "DroppedByApp".into(),
                    },
                    AnswerKind::Crash => return,
                };
                let _ = puller.settle(&r.lock_token, verdict);
            });
        }
    }
}
