//! `cosmosq demo`: the whole product on the embedded emulator, in one process.
//!
//! A queue is provisioned and a burst of orders enqueued; two consumer groups drain it,
//! `fulfilment` (exclusive) and `analytics` (stream). `fulfilment` is the first stage of a
//! pipeline: for each order it completes, its app publishes a shipment through its sidecar's
//! Dapr publish API to the `shipments` queue (as a group with `spec.publishTo` does), which a
//! third group, `shipping`, drains. A worker is what a worker pod holds: the real sidecar
//! ([`cosmosq_sidecar::run`]) delivering over localhost HTTP to a sample app that follows the
//! app contract. Every round, the operator's scaling decision
//! ([`cosmosq_scaling`]) runs on each group's estimate and starts workers or drains them
//! (as a SIGTERM would): from zero when the burst arrives, up to one per lease, back to zero
//! once idle. Some deliveries fail and are retried with back-off; poison orders end in the dead
//! letters. It ends, scaled to zero, once both groups have settled every message.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use axum::Router;
use clap::Args;
use cosmosq_emulator::{Emulator, EmulatorOptions};
use cosmosq_program::measure::percentile;
use cosmosq_program::telemetry::OtlpArgs;
use cosmosq_queue::clock::system_now_ms;
use cosmosq_queue::estimate::GroupEstimate;
use cosmosq_queue::{
    provision, CosmosClient, DeliveryMode, GroupConfig, NewMessage, Queue, QueueConfig, StartFrom,
};
use cosmosq_scaling::{Autoscaler, Policy};
use cosmosq_sidecar::app::headers;
use cosmosq_sidecar::error::SidecarError;
use cosmosq_sidecar::settings::{PublishTarget, PublishTargets, SidecarSettings};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{json, Value};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::output::table;

const DATABASE: &str = "cosmosq-demo";
const QUEUE: &str = "orders";
/// The pipeline's second queue: `fulfilment` publishes a shipment per order to it.
const SHIPMENTS: &str = "shipments";
const APP_PATH: &str = "/orders";
/// How often the scaling decision runs (the operator's default is 15 s; the demo is brief).
const ROUND: Duration = Duration::from_millis(500);
/// The workers' lease expiry, also given to the leases the scaler creates for a group at zero.
/// Long enough for an owner to finish a page before a lease it was asked for is taken.
const LEASE_EXPIRE: Duration = Duration::from_secs(10);
const DEADLINE: Duration = Duration::from_secs(600);

#[derive(Args, Clone, Debug)]
pub struct DemoArgs {
    /// Messages in the burst.
    #[arg(long, default_value_t = 2000)]
    pub messages: usize,
    /// Physical partitions of the queue (one lease each: the most workers a group can use).
    #[arg(long, default_value_t = 4)]
    pub partitions: u32,
    /// Most workers per group.
    #[arg(long, default_value_t = 4)]
    pub max_workers: u32,
    /// Backlog one worker is meant to carry (the CRD's `targetBacklogPerReplica`).
    #[arg(long, default_value_t = 250)]
    pub target_backlog: u64,
    /// Share of first deliveries the sample app fails (retried with back-off).
    #[arg(long, default_value_t = 0.05)]
    pub failure_rate: f64,
    /// Orders the sample app always fails (they end in the dead letters).
    #[arg(long, default_value_t = 3)]
    pub poison: usize,
    /// Longest simulated work per message.
    #[arg(long, default_value = "3ms", value_parser = humantime::parse_duration)]
    pub work: Duration,
    /// No live figures, only the summary.
    #[arg(long)]
    pub quiet: bool,
    /// Also serve the web console (on this address, 127.0.0.1:8090 when none is given) and
    /// keep it open after the demo, with its dead letters to triage, until Ctrl-C.
    #[arg(long, value_name = "ADDRESS", num_args = 0..=1, default_missing_value = "127.0.0.1:8090")]
    pub console: Option<std::net::SocketAddr>,
}

/// The demo's console reads its queue this often (the demo lasts seconds, not hours).
const CONSOLE_SAMPLE_EVERY: Duration = Duration::from_secs(1);

/// A scaling decision that changed a group's workers.
#[derive(Clone, Debug, PartialEq)]
pub struct ScaleEvent {
    pub at_seconds: f64,
    pub from: u32,
    pub to: u32,
    pub reason: String,
}

/// One group's results, from what its sample apps answered and its dead letters.
#[derive(Clone, Debug)]
pub struct GroupSummary {
    pub name: &'static str,
    /// The queue it consumes.
    pub queue: &'static str,
    pub mode: DeliveryMode,
    /// Messages it must settle: every order, or every shipment (an order that was not poison).
    pub expected: u64,
    pub peak_workers: u32,
    pub scale_events: Vec<ScaleEvent>,
    /// Requests the apps answered, failures and redeliveries included.
    pub deliveries: u64,
    /// Distinct messages the app completed.
    pub completed: u64,
    /// Messages the app completed more than once.
    pub completed_twice: u64,
    /// Deliveries the app failed (each retried with back-off, or dead-lettered at the limit).
    pub failed: u64,
    pub dead_letters: u64,
    /// Enqueue to completion, milliseconds.
    pub latency_p50_ms: Option<f64>,
    pub latency_p99_ms: Option<f64>,
}

impl GroupSummary {
    /// Messages neither completed nor dead-lettered: must be zero once the demo ends.
    pub fn missing(&self) -> u64 {
        self.expected
            .saturating_sub(self.completed + self.dead_letters)
    }

    /// What the group's mode promises: every message once (exclusive) or at least once
    /// (stream), or in the dead letters.
    pub fn kept_its_promise(&self) -> bool {
        self.missing() == 0 && (self.mode == DeliveryMode::Stream || self.completed_twice == 0)
    }
}

#[derive(Clone, Debug)]
pub struct Summary {
    pub messages: usize,
    pub enqueue_seconds: f64,
    pub seconds: f64,
    pub groups: Vec<GroupSummary>,
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let summary = run_demo(&args).await?;
    if args.console.is_none() {
        print!("{}", render(&summary));
    }
    if let Some(g) = summary.groups.iter().find(|g| !g.kept_its_promise()) {
        anyhow::bail!(
            "group {} lost track of messages: {} missing, {} completed twice",
            g.name,
            g.missing(),
            g.completed_twice
        );
    }
    Ok(())
}

pub async fn run_demo(args: &DemoArgs) -> anyhow::Result<Summary> {
    anyhow::ensure!(args.max_workers >= 1, "--max-workers must be at least 1");
    let emulator = Emulator::in_process(EmulatorOptions {
        partitions: args.partitions,
        ..Default::default()
    })?;
    let client = emulator.client().await?;
    // The orders queue (the producer's) and the pipeline's second one.
    let mut opened = Vec::new();
    for queue in [QUEUE, SHIPMENTS] {
        let config = QueueConfig::new(DATABASE, queue);
        provision(&client, &config).await?;
        emulator
            .apply_partition_count(&config.database, &config.container)
            .await?;
        opened.push(Queue::open(&client, config).await?);
    }
    let shipments = opened.pop().expect("two queues");
    let producer = opened.pop().expect("two queues");
    let console = CancellationToken::new();
    let _stop_console = console.clone().drop_guard();
    if let Some(listen) = args.console {
        let options = cosmosq_console::ConsoleOptions {
            sample_every: CONSOLE_SAMPLE_EVERY,
            ..Default::default()
        };
        let catalog = Arc::new(cosmosq_console::Database::new(
            client.clone(),
            DATABASE.to_owned(),
            vec![],
        ));
        crate::console::start(catalog, options, listen, console.clone()).await?;
    }
    let policy = Policy {
        min_replicas: 0,
        max_replicas: args.max_workers,
        target_backlog_per_replica: args.target_backlog.max(1),
        scale_down_stabilization_ms: 2_000,
        scale_to_zero_cooldown_ms: 2_000,
        activation_threshold: 1,
    };
    let app = SampleApp {
        ledger: Arc::new(Ledger::default()),
        work: args.work,
        failure_rate: args.failure_rate,
        publish: None,
        http: cosmosq_queue::cosmos::tls::http_client_builder()
            .build()
            .expect("an HTTP client"),
    };
    let display = Display::new(args.quiet);
    let mut groups = Vec::new();
    let orders = args.messages as u64;
    let shipped = orders - poison_orders(args).len() as u64;
    for (name, mode, (queue, handle), publish_to, expected) in [
        (
            "fulfilment",
            DeliveryMode::Exclusive,
            (QUEUE, &producer),
            Some(SHIPMENTS),
            orders,
        ),
        (
            "analytics",
            DeliveryMode::Stream,
            (QUEUE, &producer),
            None,
            orders,
        ),
        (
            "shipping",
            DeliveryMode::Exclusive,
            (SHIPMENTS, &shipments),
            None,
            shipped,
        ),
    ] {
        let estimator = handle.group(
            GroupConfig::new(name)
                .with_mode(mode)
                .with_start_from(StartFrom::Beginning),
        )?;
        groups.push(GroupRun {
            name,
            queue,
            publish_to,
            expected,
            mode,
            estimator,
            scaler: Autoscaler::default(),
            workers: Vec::new(),
            draining: Vec::new(),
            started_workers: 0,
            peak: 0,
            events: Vec::new(),
            dead_letters: 0,
            bar: display.bar(name, expected),
            settled_before: (Instant::now(), 0),
        });
    }

    let started = Instant::now();
    let enqueue = tokio::spawn(enqueue_burst(producer, burst(args)));
    let mut enqueue = Some(enqueue);
    let mut enqueue_seconds = None;
    let mut tick = tokio::time::interval(ROUND);
    let mut rounds = 0u64;
    let outcome: anyhow::Result<()> = async {
        loop {
            tick.tick().await;
            if enqueue.as_ref().is_some_and(JoinHandle::is_finished) {
                if let Some(task) = enqueue.take() {
                    let took = task.await??.as_secs_f64();
                    enqueue_seconds = Some(took);
                    display.line(format!(
                        "{:>5.1}s  {} orders enqueued in {took:.2}s",
                        started.elapsed().as_secs_f64(),
                        args.messages
                    ));
                }
            }
            rounds += 1;
            for g in groups.iter_mut() {
                let figures = g
                    .round(&policy, &client, &app, args, started, &display)
                    .await?;
                // Without a terminal for the bars, a line per group every few seconds.
                if rounds.is_multiple_of(4) {
                    display.progress_line(
                        started,
                        g.name,
                        g.settled(&app.ledger),
                        g.expected,
                        &figures,
                    );
                }
            }
            let done = enqueue.is_none()
                && groups.iter().all(|g| {
                    g.workers.is_empty()
                        && g.draining.is_empty()
                        && g.settled(&app.ledger) >= g.expected
                });
            if done {
                return Ok(());
            }
            anyhow::ensure!(
                started.elapsed() < DEADLINE,
                "the queue did not drain within {}",
                humantime::format_duration(DEADLINE)
            );
        }
    }
    .await;
    // On an error too, stop every worker the way Kubernetes would: drain, then the app.
    for g in groups.iter_mut() {
        g.scale_to(0);
        for worker in g.draining.drain(..) {
            worker.stopped().await?;
        }
    }
    outcome?;
    for g in &groups {
        if let Some(bar) = &g.bar {
            bar.finish();
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let summary = Summary {
        messages: args.messages,
        enqueue_seconds: enqueue_seconds.unwrap_or(seconds),
        seconds,
        groups: groups.iter().map(|g| g.summary(&app.ledger)).collect(),
    };
    if args.console.is_some() {
        // The emulator lives in this process: the console stays open while it does.
        print!("{}", render(&summary));
        println!("The console stays open to look at the queue and its dead letters: Ctrl-C ends the demo.");
        tokio::signal::ctrl_c().await?;
    }
    Ok(summary)
}

/// The orders the sample app always fails, by number.
fn poison_orders(args: &DemoArgs) -> Vec<usize> {
    let poison_every = args
        .messages
        .checked_div(args.poison)
        .unwrap_or(usize::MAX)
        .max(1);
    (0..args.messages)
        .filter(|i| args.poison > 0 && i % poison_every == poison_every - 1)
        .collect()
}

fn burst(args: &DemoArgs) -> Vec<NewMessage> {
    let poison = poison_orders(args);
    (0..args.messages)
        .map(|i| {
            let poison = poison.binary_search(&i).is_ok();
            NewMessage::json(
                json!({"order": i, "sku": format!("sku-{}", i % 97), "poison": poison}),
            )
            .with_id(format!("order-{i:06}"))
            .with_partition_key(format!("customer-{}", i % 64))
        })
        .collect()
}

/// Enqueues in batches; returns how long it took.
async fn enqueue_burst(producer: Queue, burst: Vec<NewMessage>) -> anyhow::Result<Duration> {
    let started = Instant::now();
    for chunk in burst.chunks(200) {
        for result in producer.enqueue_batch(chunk.to_vec()).await {
            result?;
        }
    }
    Ok(started.elapsed())
}

/// A consumer group's workers and the scaler deciding how many it runs.
struct GroupRun {
    name: &'static str,
    /// The queue it consumes.
    queue: &'static str,
    /// The queue its app publishes to, if any (`spec.publishTo`).
    publish_to: Option<&'static str>,
    /// Messages it must settle.
    expected: u64,
    mode: DeliveryMode,
    /// The group on the producer's handle: estimates and dead letters, as the operator reads them.
    estimator: cosmosq_queue::Group,
    scaler: Autoscaler,
    /// Running workers, oldest first.
    workers: Vec<Worker>,
    /// Workers told to stop, finishing their in-flight messages and releasing their leases.
    draining: Vec<Worker>,
    started_workers: usize,
    peak: u32,
    events: Vec<ScaleEvent>,
    dead_letters: u64,
    bar: Option<ProgressBar>,
    /// When and how many were settled at the last figure, for the throughput.
    settled_before: (Instant, u64),
}

impl GroupRun {
    /// One scaling round: estimate, decide, start or drain workers; returns the live figures.
    async fn round(
        &mut self,
        policy: &Policy,
        client: &CosmosClient,
        app: &SampleApp,
        args: &DemoArgs,
        started: Instant,
        display: &Display,
    ) -> anyhow::Result<String> {
        let mut still_draining = Vec::new();
        for worker in self.draining.drain(..) {
            if worker.sidecar.is_finished() {
                worker.stopped().await?;
            } else {
                still_draining.push(worker);
            }
        }
        self.draining = still_draining;
        if let Some(i) = self.workers.iter().position(|w| w.sidecar.is_finished()) {
            let worker = self.workers.remove(i);
            let name = worker.name.clone();
            worker.stopped().await?;
            anyhow::bail!("worker {name} stopped on its own");
        }

        let now = system_now_ms();
        let lease_expire_ms = LEASE_EXPIRE.as_millis() as i64;
        let estimate = self
            .estimator
            .estimate_or_create_leases(now, lease_expire_ms)
            .await;
        let current = self.workers.len() as u32;
        let (_, decision) = self
            .scaler
            .round(policy, now, estimate.as_ref().ok(), current);
        if decision.replicas != current {
            let backlog = estimate.as_ref().ok().map(GroupEstimate::backlog);
            let event = ScaleEvent {
                at_seconds: started.elapsed().as_secs_f64(),
                from: current,
                to: decision.replicas,
                reason: decision.reason.describe(&decision, backlog),
            };
            display.line(format!(
                "{:>5.1}s  {:<10}  workers {} -> {}: {}",
                event.at_seconds, self.name, event.from, event.to, event.reason
            ));
            self.events.push(event);
            self.scale_to(decision.replicas);
            while self.workers.len() < decision.replicas as usize {
                self.started_workers += 1;
                let name = format!("{}-{}", self.name, self.started_workers);
                let worker = Worker::start(client, self, name, app.clone(), args).await?;
                self.workers.push(worker);
            }
            self.peak = self.peak.max(decision.replicas);
        }
        if let Ok(dead) = self.estimator.dead_letters(None).await {
            self.dead_letters = dead.len() as u64;
        }
        let figures = self.figures(estimate.as_ref().ok(), decision.replicas, &app.ledger);
        if let Some(bar) = &self.bar {
            bar.set_position(self.settled(&app.ledger));
            bar.set_message(figures.clone());
        }
        Ok(figures)
    }

    /// Drains the newest workers beyond `replicas` (a Deployment scaled down would pick by
    /// deletion cost; here the newest go, which is what a Deployment does by default).
    fn scale_to(&mut self, replicas: u32) {
        while self.workers.len() > replicas as usize {
            if let Some(worker) = self.workers.pop() {
                worker.stop.cancel();
                self.draining.push(worker);
            }
        }
    }

    /// Distinct messages done with: completed by the app, or in the dead letters.
    fn settled(&self, ledger: &Ledger) -> u64 {
        ledger.read(self.name, |g| g.completions.len() as u64) + self.dead_letters
    }

    fn figures(
        &mut self,
        estimate: Option<&GroupEstimate>,
        desired: u32,
        ledger: &Ledger,
    ) -> String {
        let settled = self.settled(ledger);
        let (at, before) = self.settled_before;
        let seconds = at.elapsed().as_secs_f64();
        // Over the last second or so, so the figure follows the scaling.
        let throughput = (settled - before.min(settled)) as f64 / seconds.max(0.001);
        if seconds >= 1.0 {
            self.settled_before = (Instant::now(), settled);
        }
        let backlog = estimate.map_or("backlog unknown".to_owned(), |e| {
            format!(
                "backlog {:>5} [{}]",
                e.backlog(),
                e.ranges
                    .iter()
                    .map(|r| r.backlog.to_string())
                    .collect::<Vec<_>>()
                    .join(" ")
            )
        });
        let (p50, p99) = ledger.read(self.name, GroupLedger::latencies);
        format!(
            "workers {}/{desired}  {backlog}  {throughput:>5.0} msg/s  p50 {}  p99 {}  dead {}",
            self.workers.len() + self.draining.len(),
            millis(p50),
            millis(p99),
            self.dead_letters
        )
    }

    fn summary(&self, ledger: &Ledger) -> GroupSummary {
        ledger.read(self.name, |g| {
            let (latency_p50_ms, latency_p99_ms) = g.latencies();
            GroupSummary {
                name: self.name,
                queue: self.queue,
                mode: self.mode,
                expected: self.expected,
                peak_workers: self.peak,
                scale_events: self.events.clone(),
                deliveries: g.deliveries,
                completed: g.completions.len() as u64,
                completed_twice: g.completions.values().filter(|&&n| n > 1).count() as u64,
                failed: g.failed,
                dead_letters: self.dead_letters,
                latency_p50_ms,
                latency_p99_ms,
            }
        })
    }
}

/// A worker pod: the sidecar and, next to it, the sample app on its own localhost port.
struct Worker {
    name: String,
    stop: CancellationToken,
    sidecar: JoinHandle<Result<(), SidecarError>>,
    app_stop: CancellationToken,
    app: JoinHandle<std::io::Result<()>>,
}

impl Worker {
    async fn start(
        client: &CosmosClient,
        group: &GroupRun,
        name: String,
        mut app: SampleApp,
        args: &DemoArgs,
    ) -> anyhow::Result<Worker> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        // The sidecar's API, bound first: the app publishes to it (its `DAPR_HTTP_PORT`).
        let api = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let config = sidecar_settings(group, &name, listener.local_addr()?.port(), args)?;
        app.publish = group.publish_to.map(|topic| {
            let api = api.local_addr().map(|a| a.to_string()).unwrap_or_default();
            format!("http://{api}/v1.0/publish/cosmosq/{topic}")
        });
        let app_stop = CancellationToken::new();
        let serve = axum::serve(listener, app.router())
            .with_graceful_shutdown(app_stop.clone().cancelled_owned());
        let app_task = tokio::spawn(async move { serve.await });
        let stop = CancellationToken::new();
        let sidecar = tokio::spawn(cosmosq_sidecar::run::run_with_listener(
            config,
            client.clone(),
            api,
            stop.clone(),
        ));
        Ok(Worker {
            name,
            stop,
            sidecar,
            app_stop,
            app: app_task,
        })
    }

    /// Waits for the sidecar to drain, then stops the app (its container outlives the
    /// sidecar's in-flight requests, as in a pod).
    async fn stopped(self) -> anyhow::Result<()> {
        self.stop.cancel();
        let drained = self.sidecar.await;
        self.app_stop.cancel();
        self.app.await??;
        drained?.with_context(|| format!("worker {}", self.name))
    }
}

/// The sidecar's settings for one demo worker: the one-machine timings, with a lease expiry
/// long enough to outlast a busy laptop and a lock longer than any sample work.
fn sidecar_settings(
    group: &GroupRun,
    worker: &str,
    app_port: u16,
    args: &DemoArgs,
) -> anyhow::Result<SidecarSettings> {
    let mut settings = SidecarSettings {
        mode: group.mode,
        start_from: StartFrom::Beginning,
        pod_name: Some(worker.to_owned()),
        app_port: Some(app_port),
        app_path: APP_PATH.to_owned(),
        app_health_path: Some("/healthz".to_owned()),
        app_timeout: args.work.saturating_mul(10).max(Duration::from_secs(5)),
        max_delivery_attempts: 4,
        retry_initial_backoff: Duration::from_millis(100),
        retry_max_backoff: Duration::from_secs(1),
        lock_duration: Duration::from_secs(30),
        lease_acquire: Duration::from_millis(200),
        lease_renew: Duration::from_millis(500),
        lease_expire: LEASE_EXPIRE,
        max_poll: Duration::from_millis(200),
        otlp: shell_otlp(),
        ..SidecarSettings::new(DATABASE, group.queue, group.name).on_one_machine()
    };
    // On the same (emulated) account: the sidecar publishes through its own client.
    settings.publish_to = PublishTargets(
        group
            .publish_to
            .iter()
            .map(|queue| PublishTarget {
                database: DATABASE.into(),
                queue: (*queue).into(),
                endpoint: settings.connection.endpoint.clone(),
                auth: settings.connection.auth,
                key_file: None,
            })
            .collect(),
    );
    settings.validate()?;
    Ok(settings)
}

/// The shell's `OTEL_*` settings: with a collector's endpoint set, the demo's sidecars export
/// their spans as a pod's would (nothing else of the shell's environment is read).
fn shell_otlp() -> OtlpArgs {
    #[derive(clap::Parser)]
    struct Shell {
        #[command(flatten)]
        otlp: OtlpArgs,
    }
    <Shell as clap::Parser>::try_parse_from(["cosmosq-demo"])
        .map(|shell| shell.otlp)
        .unwrap_or_default()
}

/// What the sample apps answered, per group.
#[derive(Default)]
struct Ledger(Mutex<HashMap<String, GroupLedger>>);

#[derive(Default)]
struct GroupLedger {
    deliveries: u64,
    failed: u64,
    /// Completions per message id.
    completions: HashMap<String, u32>,
    /// Enqueue to completion, milliseconds.
    latencies_ms: Vec<f64>,
}

impl GroupLedger {
    fn latencies(&self) -> (Option<f64>, Option<f64>) {
        let mut sorted = self.latencies_ms.clone();
        sorted.sort_by(f64::total_cmp);
        (percentile(&sorted, 0.5), percentile(&sorted, 0.99))
    }
}

impl Ledger {
    fn read<T>(&self, group: &str, f: impl FnOnce(&GroupLedger) -> T) -> T {
        let groups = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match groups.get(group) {
            Some(g) => f(g),
            None => f(&GroupLedger::default()),
        }
    }

    fn record(&self, group: &str, id: &str, completed: bool, latency_ms: Option<f64>) {
        let mut groups = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let g = groups.entry(group.to_owned()).or_default();
        g.deliveries += 1;
        if completed {
            *g.completions.entry(id.to_owned()).or_default() += 1;
            g.latencies_ms.extend(latency_ms);
        } else {
            g.failed += 1;
        }
    }
}

/// The sample app: an order service following the app contract. A little work per order, some
/// transient failures on first delivery, and poison orders that always fail. With `publish`, it
/// publishes a shipment for each order it completes, through its sidecar.
#[derive(Clone)]
struct SampleApp {
    ledger: Arc<Ledger>,
    work: Duration,
    failure_rate: f64,
    /// Dapr's publish URL of the next stage's topic, on this worker's sidecar.
    publish: Option<String>,
    http: reqwest::Client,
}

impl SampleApp {
    fn router(self) -> Router {
        Router::new()
            .route(APP_PATH, post(handle_order))
            .route("/healthz", get(|| async { "ok" }))
            .with_state(self)
    }
}

async fn handle_order(
    State(app): State<SampleApp>,
    request: HeaderMap,
    body: Bytes,
) -> (StatusCode, String) {
    let header = |name: &str| request.get(name).and_then(|v| v.to_str().ok());
    let (Some(id), Some(group)) = (header(headers::MESSAGE_ID), header(headers::GROUP)) else {
        return (StatusCode::BAD_REQUEST, "not a cosmosq delivery".into());
    };
    let first = header(headers::DELIVERY_COUNT) == Some("1");
    let enqueued = header(headers::ENQUEUED_TIME).and_then(|t| humantime::parse_rfc3339(t).ok());
    let event: Value = serde_json::from_slice(&body).unwrap_or_default();
    tokio::time::sleep(app.work.mul_f64(rand::random::<f64>())).await;
    let (status, answer) = if event["data"]["poison"] == json!(true) {
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            "payment service rejected the order",
        )
    } else if first && rand::random::<f64>() < app.failure_rate {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "inventory service timed out",
        )
    } else if let Err(e) = ship(&app, id, &request, &event).await {
        tracing::warn!(order = id, error = %e, "could not publish the shipment: retried");
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "could not publish the shipment",
        )
    } else {
        (StatusCode::OK, r#"{"status":"SUCCESS"}"#)
    };
    let latency_ms = enqueued
        .and_then(|t| t.elapsed().ok())
        .map(|d| d.as_secs_f64() * 1000.0);
    app.ledger
        .record(group, id, status == StatusCode::OK, latency_ms);
    (status, answer.to_owned())
}

/// Publishes the shipment of order `id` with Dapr's publish API, when this app is a pipeline's
/// first stage: a CloudEvent whose id is derived from the order's (a retried order publishes
/// the same shipment again, which is enqueued once), in the order's trace.
async fn ship(
    app: &SampleApp,
    id: &str,
    request: &HeaderMap,
    order: &Value,
) -> Result<(), reqwest::Error> {
    let Some(url) = &app.publish else {
        return Ok(());
    };
    let mut shipment = json!({
        "specversion": "1.0",
        "id": format!("shipment-{id}"),
        "source": "fulfilment",
        "type": "shipment.requested",
        "datacontenttype": "application/json",
        "data": {"order": order["data"]["order"], "sku": order["data"]["sku"]},
    });
    if let Some(trace) = request.get("traceparent").and_then(|v| v.to_str().ok()) {
        shipment["traceparent"] = json!(trace);
    }
    app.http
        .post(url)
        .header("content-type", "application/cloudevents+json")
        .body(shipment.to_string())
        .send()
        .await?
        .error_for_status()?;
    Ok(())
}

/// Live figures: progress bars on a terminal, a line per event otherwise, nothing when quiet.
struct Display {
    bars: Option<MultiProgress>,
    lines: bool,
}

impl Display {
    fn new(quiet: bool) -> Display {
        let terminal = std::io::stderr().is_terminal();
        Display {
            bars: (!quiet && terminal)
                .then(|| MultiProgress::with_draw_target(ProgressDrawTarget::stderr())),
            lines: !quiet && !terminal,
        }
    }

    fn bar(&self, name: &str, len: u64) -> Option<ProgressBar> {
        let bar = self.bars.as_ref()?.add(
            ProgressBar::new(len).with_style(
                ProgressStyle::with_template("{prefix:>10} {bar:24} {pos:>5}/{len} {msg}")
                    .expect("static template"),
            ),
        );
        bar.set_prefix(name.to_owned());
        Some(bar)
    }

    fn progress_line(&self, started: Instant, group: &str, settled: u64, of: u64, figures: &str) {
        if self.lines {
            eprintln!(
                "{:>5.1}s  {group:<10}  {settled}/{of}  {figures}",
                started.elapsed().as_secs_f64()
            );
        }
    }

    fn line(&self, text: String) {
        if let Some(bars) = &self.bars {
            let _ = bars.println(text);
        } else if self.lines {
            eprintln!("{text}");
        }
    }
}

fn millis(ms: Option<f64>) -> String {
    match ms {
        None => "-".into(),
        Some(ms) if ms >= 1000.0 => format!("{:.1}s", ms / 1000.0),
        Some(ms) => format!("{ms:.0}ms"),
    }
}

pub fn render(s: &Summary) -> String {
    let rows: Vec<Vec<String>> = s
        .groups
        .iter()
        .map(|g| {
            vec![
                g.name.to_string(),
                g.queue.to_string(),
                format!("{:?}", g.mode).to_lowercase(),
                g.peak_workers.to_string(),
                g.deliveries.to_string(),
                g.completed.to_string(),
                g.completed_twice.to_string(),
                g.failed.to_string(),
                g.dead_letters.to_string(),
                millis(g.latency_p50_ms),
                millis(g.latency_p99_ms),
            ]
        })
        .collect();
    let mut out = format!(
        "\ncosmosq demo: {} orders enqueued in {:.2}s; every group drained and scaled back to zero in {:.1}s\n\n",
        s.messages, s.enqueue_seconds, s.seconds
    );
    out.push_str(&table(
        &[
            "GROUP",
            "QUEUE",
            "MODE",
            "PEAK WORKERS",
            "DELIVERIES",
            "COMPLETED",
            "TWICE",
            "FAILED",
            "DEAD LETTERS",
            "P50",
            "P99",
        ],
        &rows,
    ));
    out.push_str("\nScaling (the operator's decision on each group's estimate, every round):\n");
    for g in &s.groups {
        for e in &g.scale_events {
            out.push_str(&format!(
                "  {:>5.1}s  {:<10}  {} -> {}  {}\n",
                e.at_seconds, g.name, e.from, e.to, e.reason
            ));
        }
    }
    out.push('\n');
    for g in &s.groups {
        let promise = match g.mode {
            DeliveryMode::Exclusive => "exactly once",
            DeliveryMode::Stream => "at least once",
        };
        let what = if g.queue == SHIPMENTS {
            "shipment"
        } else {
            "order"
        };
        if g.kept_its_promise() {
            out.push_str(&format!(
                "ok  {}: every {what} completed {promise} ({} completed, {} twice) or dead-lettered ({})\n",
                g.name, g.completed, g.completed_twice, g.dead_letters
            ));
        } else {
            out.push_str(&format!(
                "BAD {}: {} {what}s missing, {} completed twice ({promise} promised)\n",
                g.name,
                g.missing(),
                g.completed_twice
            ));
        }
    }
    out.push_str(
        "\nFAILED deliveries were retried with back-off; orders failing every attempt went to the\n\
         dead letters with the app's answer (`cosmosq dlq list` against a served emulator).\n\
         P50/P99: enqueue to completion. TWICE: stream mode is at-least-once, so an order read\n\
         again after its lease moved to a new worker may be delivered again.\n\
         A pipeline: fulfilment's app publishes a shipment per completed order through its\n\
         sidecar (Dapr's publish API, topic `shipments`, as `spec.publishTo` grants), and\n\
         shipping drains that queue: one shipment per order that was not poison.\n",
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_small_burst_scales_up_drains_to_zero_and_delivers_every_order_once() {
        let args = DemoArgs {
            messages: 200,
            partitions: 2,
            max_workers: 3,
            target_backlog: 50,
            failure_rate: 0.1,
            poison: 2,
            work: Duration::from_millis(1),
            quiet: true,
            console: None,
        };
        let summary = run_demo(&args).await.unwrap();
        let text = render(&summary);
        assert_eq!(summary.groups.len(), 3);
        for g in &summary.groups {
            assert!(g.kept_its_promise(), "{g:?}\n{text}");
            assert!(g.failed > 0, "{g:?}");
            if g.queue == SHIPMENTS {
                // A shipment per order that was not poison, none twice.
                assert_eq!(g.expected, 198, "{g:?}");
                assert_eq!((g.completed, g.completed_twice), (198, 0), "{g:?}");
                assert_eq!(g.dead_letters, 0, "{g:?}");
            } else {
                assert_eq!(g.dead_letters, 2, "the poison orders: {g:?}");
                // Each poison order was tried the 4 times allowed.
                assert!(g.failed >= 2 * 4, "{g:?}");
            }
            // From zero to one worker per lease (2 leases cap the 3 allowed), back to zero.
            assert_eq!(g.peak_workers, 2, "{g:?}");
            let first = g.scale_events.first().expect("scaled");
            assert_eq!(first.from, 0, "{g:?}");
            assert!(first.reason.contains("activation threshold"), "{first:?}");
            let last = g.scale_events.last().expect("scaled");
            assert_eq!(last.to, 0, "{g:?}");
            assert!(g.latency_p50_ms.is_some_and(|p| p > 0.0), "{g:?}");
        }
        let exclusive = &summary.groups[0];
        assert_eq!(exclusive.mode, DeliveryMode::Exclusive);
        assert_eq!(exclusive.completed_twice, 0, "{exclusive:?}");
        assert!(
            text.contains("ok  fulfilment: every order completed exactly once"),
            "{text}"
        );
        assert!(
            text.contains("ok  analytics: every order completed at least once"),
            "{text}"
        );
        assert!(text.contains("fulfilment  0 -> "), "{text}");
        assert!(
            text.contains(
                "ok  shipping: every shipment completed exactly once (198 completed, 0 twice)"
            ),
            "{text}"
        );
    }
}
