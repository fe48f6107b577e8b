//! The fault suite. Every scenario runs three pods, each hosting both groups (`x` in
//! `exclusive` mode, `s` in `stream` mode), over a burst that includes poison messages, and ends
//! with the full ledger: every message is completed once per group (at least once in `stream`)
//! or sits in that group's dead letters with a reason. Nothing lost, nothing completed twice.
//!
//! `COSMOSQ_FAULT_TRIALS` sets the kill/restart trials (10 by default; the long run is 100):
//! `COSMOSQ_FAULT_TRIALS=100 cargo test -p cosmosq-tests --test it faults:: -- --nocapture`.
//! Each scenario prints one `fault-suite` line with its figures.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cosmosq_emulator::fault_injection::{
    FaultInjectionConditionBuilder, FaultInjectionErrorType, FaultInjectionResultBuilder,
    FaultInjectionRule, FaultInjectionRuleBuilder, FaultOperationType,
};
use cosmosq_emulator::EmulatorOptions;
use cosmosq_queue::host::Host;
use cosmosq_queue::{
    Clock, ConsumerStats, CosmosClient, Delivery, DeliveryMode, GroupConfig, MessageKey,
    MessageState, NewMessage, Outcome, Queue, QueueConfig, RetryPolicy, StartFrom, Throughput,
};
use cosmosq_tests::{eventually, fast_host, Fixture, Identity, Ledger};
use rand::{Rng, SeedableRng};
use serde_json::json;
use tokio_util::sync::CancellationToken;

const GROUPS: [(&str, DeliveryMode); 2] =
    [("x", DeliveryMode::Exclusive), ("s", DeliveryMode::Stream)];

fn poison(i: usize) -> bool {
    i % 40 == 13
}

fn id(i: usize) -> String {
    format!("m{i}")
}

fn pk(i: usize) -> String {
    format!("k{}", i % 31)
}

fn group_config(name: &str, mode: DeliveryMode, lock: Duration) -> GroupConfig {
    GroupConfig::new(name)
        .with_mode(mode)
        .with_start_from(StartFrom::Beginning)
        .with_lock_duration(lock)
        .with_retry(RetryPolicy {
            max_delivery_attempts: 3,
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(100),
            ..RetryPolicy::default()
        })
}

/// The app: the shared ledger records what it was given and answered.
#[derive(Default)]
struct App {
    ledger: Arc<Ledger>,
    /// Messages whose first delivery panics in the handler (the app crashing mid-request).
    panics: Mutex<Vec<String>>,
}

/// The ledger's name for message `i`.
fn identity(i: usize) -> Identity {
    (id(i), MessageKey::from(pk(i)).canonical())
}

fn handler(
    app: &Arc<App>,
) -> impl Fn(Delivery) -> futures::future::BoxFuture<'static, Outcome> + Send + Sync + 'static {
    let crashing = Arc::clone(app);
    app.ledger.handler(move |d: Delivery| {
        let app = Arc::clone(&crashing);
        async move {
            tokio::task::yield_now().await;
            let i: usize = d.message.id[1..].parse().expect("ids are m<i>");
            let crash = d.delivery_count == 1 && app.panics.lock().unwrap().contains(&d.message.id);
            if crash {
                panic!("the app crashed on {}", d.message.id);
            } else if poison(i) {
                Outcome::Retry {
                    reason: "poison: the payment service rejects this order".into(),
                    delay: None,
                }
            } else {
                Outcome::Complete
            }
        }
    })
}

/// A worker pod: one lease-loop host per group, on its own client and clock.
struct Pod {
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<cosmosq_queue::Result<()>>>,
    stats: Vec<(&'static str, Arc<ConsumerStats>)>,
}

struct Scenario {
    fixture: Fixture,
    app: Arc<App>,
    messages: usize,
    lock: Duration,
    /// Every pod that ever ran, for the completions they counted.
    stats: Vec<(&'static str, Arc<ConsumerStats>)>,
}

impl Scenario {
    async fn new(partitions: u32, messages: usize) -> Scenario {
        Self::on(Fixture::new(partitions).await, messages)
    }

    fn on(fixture: Fixture, messages: usize) -> Scenario {
        Scenario {
            fixture,
            app: Arc::default(),
            messages,
            lock: Duration::from_secs(1),
            stats: Vec::new(),
        }
    }

    async fn enqueue(&self, range: std::ops::Range<usize>) {
        let batch: Vec<NewMessage> = range
            .map(|i| {
                NewMessage::json(json!({"i": i}))
                    .with_id(id(i))
                    .with_partition_key(pk(i))
            })
            .collect();
        for chunk in batch.chunks(100) {
            self.fixture.enqueue_all(chunk.to_vec()).await;
        }
    }

    async fn pod(&mut self, name: &str, client: &CosmosClient, clock: Clock) -> Pod {
        let queue = Queue::open_with_clock(client, self.fixture.queue.config().clone(), clock)
            .await
            .unwrap();
        let stop = CancellationToken::new();
        let mut pod = Pod {
            stop: stop.clone(),
            tasks: Vec::new(),
            stats: Vec::new(),
        };
        for (group, mode) in GROUPS {
            let host = Host::new(
                queue.group(group_config(group, mode, self.lock)).unwrap(),
                handler(&self.app),
                fast_host(name),
            );
            pod.stats.push((group, host.stats()));
            self.stats.push((group, host.stats()));
            pod.tasks.push(tokio::spawn(host.run(stop.clone())));
        }
        pod
    }

    async fn pods(&mut self, client: &CosmosClient) -> Vec<Pod> {
        let mut pods = Vec::new();
        for name in ["p0", "p1", "p2"] {
            pods.push(self.pod(name, client, Clock::system()).await);
        }
        pods
    }

    /// Waits until the app completed every good message in both groups and every poison
    /// message is in the dead letters, then stops the pods and checks the whole ledger.
    async fn finish(&self, pods: Vec<Pod>, what: &str) -> Report {
        let good = (0..self.messages).filter(|&i| !poison(i)).count();
        let ledger = &self.app.ledger;
        let all_completed =
            ledger.wait_until(|l| GROUPS.iter().all(|(g, _)| l.completed(g) == good));
        if tokio::time::timeout(Duration::from_secs(90), all_completed)
            .await
            .is_err()
        {
            let report = self.ledger(what).await;
            panic!("{what}: not every good message was completed: {report:?}");
        }
        let poisoned = self.messages - good;
        for (g, mode) in GROUPS {
            let group = self.fixture.group(group_config(g, mode, self.lock));
            eventually(
                &format!("{what}: group {g} settles every message in the database"),
                Duration::from_secs(60),
                || async {
                    let dead = group.dead_letters(None).await.map(|d| d.len()).unwrap_or(0);
                    dead == poisoned
                        && (mode == DeliveryMode::Stream
                            || self.settled_in_database(g, MessageState::Completed).await == good)
                },
            )
            .await;
        }
        for pod in &pods {
            pod.stop.cancel();
        }
        for pod in pods {
            for task in pod.tasks {
                task.await.unwrap().unwrap();
            }
        }
        self.ledger(what).await
    }

    async fn settled_in_database(&self, g: &str, state: MessageState) -> usize {
        let group = self.fixture.group(GroupConfig::new(g));
        let mut n = 0;
        for i in 0..self.messages {
            if let Ok(Some(doc)) = group.read_state(&pk(i).into(), &id(i)).await {
                n += usize::from(doc.state == state);
            }
        }
        n
    }

    /// The full ledger, per group: lost = neither completed nor dead-lettered with a reason;
    /// doubles = completions counted beyond the messages completed (exclusive).
    async fn ledger(&self, what: &str) -> Report {
        let mut report = Report {
            messages: self.messages,
            ..Report::default()
        };
        for (g, mode) in GROUPS {
            let records = self.app.ledger.records(g);
            let group = self.fixture.group(GroupConfig::new(g));
            let dead: HashMap<Identity, _> = group
                .dead_letters(None)
                .await
                .unwrap()
                .into_iter()
                .map(|d| ((d.message_id.clone(), d.partition_key.canonical()), d))
                .collect();
            let mut completed_docs = 0;
            for i in 0..self.messages {
                let app_done = records.get(&identity(i)).is_some_and(|r| r.completions > 0);
                let state = group.read_state(&pk(i).into(), &id(i)).await.unwrap();
                let ok = if poison(i) {
                    dead.get(&identity(i))
                        .is_some_and(|d| d.reason.is_some() && d.last_error.is_some())
                } else if mode == DeliveryMode::Exclusive {
                    let completed = state.is_some_and(|s| s.state == MessageState::Completed);
                    completed_docs += usize::from(completed);
                    completed && app_done
                } else {
                    app_done && !dead.contains_key(&identity(i))
                };
                if !ok {
                    report.lost += 1;
                    eprintln!(
                        "{what}: group {g}: m{i} is neither completed nor dead-lettered: app {:?}, state {:?}",
                        records.get(&identity(i)),
                        group.read_state(&pk(i).into(), &id(i)).await.unwrap()
                    );
                }
            }
            if mode == DeliveryMode::Exclusive {
                let counted: u64 = self
                    .stats
                    .iter()
                    .filter(|(sg, _)| *sg == g)
                    .map(|(_, s)| s.completed.load(Ordering::Relaxed))
                    .sum();
                report.doubles += counted.saturating_sub(completed_docs as u64);
            }
        }
        report.deliveries = self.app.ledger.deliveries();
        report
    }
}

#[derive(Debug, Default)]
struct Report {
    messages: usize,
    deliveries: u64,
    lost: usize,
    doubles: u64,
}

impl Report {
    fn assert_clean(&self, scenario: &str, trials: usize, faults: u64, started: Instant) {
        println!(
            "fault-suite | {scenario:<34} | trials {trials:>3} | messages {:>5} | deliveries {:>6} | faults {faults:>5} | lost {} | doubles {} | {:.1}s",
            self.messages * trials,
            self.deliveries,
            self.lost,
            self.doubles,
            started.elapsed().as_secs_f64()
        );
        assert_eq!(self.lost, 0, "{scenario}: messages lost");
        assert_eq!(self.doubles, 0, "{scenario}: messages completed twice");
    }

    fn add(&mut self, other: Report) {
        self.messages = other.messages;
        self.deliveries += other.deliveries;
        self.lost += other.lost;
        self.doubles += other.doubles;
    }
}

fn trials() -> u64 {
    std::env::var("COSMOSQ_FAULT_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10)
}

/// Seeded: in each trial a random pod is killed (its tasks aborted: nothing released, no
/// checkpoint, deliveries cut wherever they were) at a random point, and comes back after a
/// random downtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_and_restarted_pods_lose_nothing_and_complete_nothing_twice() {
    const MESSAGES: usize = 120;
    let started = Instant::now();
    let trials = trials();
    let mut total = Report::default();
    for seed in 0..trials {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut s = Scenario::new(4, MESSAGES).await;
        s.enqueue(0..MESSAGES).await;
        let client = s.fixture.client.clone();
        let mut pods = s.pods(&client).await;
        let kill_after = rng.random_range(0..MESSAGES as u64 * 2);
        let victim = rng.random_range(0..3);
        s.app
            .ledger
            .wait_until(|l| l.deliveries() >= kill_after)
            .await;
        let dead = pods.remove(victim);
        for task in &dead.tasks {
            task.abort();
        }
        for task in dead.tasks {
            let _ = task.await;
        }
        // The pod is down for a while (time passing, not synchronisation).
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..400))).await;
        pods.push(s.pod(&format!("p{victim}"), &client, Clock::system()).await);
        total.add(s.finish(pods, &format!("kill trial {seed}")).await);
    }
    total.assert_clean(
        "kill/restart, 3 pods x 2 groups",
        trials as usize,
        trials,
        started,
    );
}

fn rule(
    id: &str,
    error: FaultInjectionErrorType,
    operation: FaultOperationType,
    probability: f32,
) -> Arc<FaultInjectionRule> {
    Arc::new(
        FaultInjectionRuleBuilder::new(
            id,
            FaultInjectionResultBuilder::new()
                .with_error(error)
                .with_probability(probability)
                .build(),
        )
        .with_condition(
            FaultInjectionConditionBuilder::new()
                .with_operation_type(operation)
                .build(),
        )
        .with_end_time(std::time::Instant::now() + FAULTS_FOR)
        .build(),
    )
}

/// How long a rule injects, from when the pods start: then the pods settle what is left.
const FAULTS_FOR: Duration = Duration::from_secs(10);

/// The pods' clients inject the rules `rules` builds; the producer's does not. Built as the
/// pods start, so a slow setup (a loaded machine) does not spend their time.
async fn under_faults(scenario: &str, rules: impl FnOnce() -> Vec<Arc<FaultInjectionRule>>) {
    const MESSAGES: usize = 200;
    let started = Instant::now();
    let mut s = Scenario::new(4, MESSAGES).await;
    s.enqueue(0..MESSAGES).await;
    let rules = rules();
    let firsts: Vec<_> = rules.iter().map(|r| first_of(r)).collect();
    let client = s
        .fixture
        .emulator
        .client_with_faults([firsts.clone(), rules.clone()].concat())
        .await
        .unwrap();
    let pods = s.pods(&client).await;
    let report = s.finish(pods, scenario).await;
    let mut injected = 0;
    for (r, first) in rules.iter().zip(&firsts) {
        let fired = r.hit_count() + first.hit_count();
        println!(
            "fault-suite | {scenario}: rule {} fired {fired} times",
            r.id()
        );
        assert!(fired > 0, "{scenario}: rule {} never fired", r.id());
        injected += u64::from(fired);
    }
    report.assert_clean(scenario, 1, injected, started);
}

/// `rule`'s fault on the first operation it applies to, for sure: left to chance within its
/// window, a rule on a rare operation may meet none on a loaded machine, and then tests
/// nothing (the run says so and fails).
fn first_of(rule: &FaultInjectionRule) -> Arc<FaultInjectionRule> {
    let given = rule.result();
    let mut result = FaultInjectionResultBuilder::new().with_probability(1.0);
    if let Some(error) = given.error_type() {
        result = result.with_error(error);
    }
    if let Some(response) = given.custom_response() {
        result = result.with_custom_response(response.clone());
    }
    if let Some(delay) = given.delay() {
        result = result.with_delay(delay);
    }
    Arc::new(
        FaultInjectionRuleBuilder::new(format!("{}-first", rule.id()), result.build())
            .with_condition(rule.condition().clone())
            .with_hit_limit(1)
            .build(),
    )
}

use FaultInjectionErrorType as E;
use FaultOperationType as Op;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_storm_on_every_operation_loses_nothing() {
    let rules = || {
        [
            Op::ReadItem,
            Op::QueryItem,
            Op::CreateItem,
            Op::ReplaceItem,
            Op::ChangeFeedItem,
        ]
        .into_iter()
        .map(|op| rule(&format!("429-{op:?}"), E::TooManyRequests, op, 0.5))
        .collect()
    };
    under_faults("429 storm, all operations", rules).await;
}

/// The emulator's own throttling (a container at 400 RU/s: 429s with the service's retry-after
/// whenever the second's budget is spent), not injected faults: 300 concurrent enqueues of
/// padded messages, then three pods in both modes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_account_at_its_provisioned_throughput_loses_nothing() {
    const MESSAGES: usize = 300;
    let started = Instant::now();
    let mut config = QueueConfig::new("db", "q");
    config.throughput = Some(Throughput::Manual(400));
    let options = EmulatorOptions {
        partitions: 1,
        throughput: Some(400),
        ..Default::default()
    };
    let fixture = Fixture::with(options, config, Clock::system()).await;
    let mut s = Scenario::on(fixture, MESSAGES);
    let enqueues = (0..MESSAGES).map(|i| {
        let q = s.fixture.queue.clone();
        async move {
            q.enqueue(
                NewMessage::json(json!({"i": i, "pad": "p".repeat(200)}))
                    .with_id(id(i))
                    .with_partition_key(pk(i)),
            )
            .await
        }
    });
    let results = futures::future::join_all(enqueues).await;
    let failed: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(
        failed.is_empty(),
        "enqueue errors under throttling: {failed:?}"
    );
    let client = s.fixture.client.clone();
    let pods = s.pods(&client).await;
    let throttled = s.fixture.queue.charges().throttled();
    assert!(
        throttled > 0,
        "the enqueues met no 429: this test would prove nothing"
    );
    s.finish(pods, "provisioned throughput").await.assert_clean(
        "400 RU/s, the emulator's own 429s",
        1,
        throttled,
        started,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_unavailable_on_claims_settles_leases_and_checkpoints_loses_nothing() {
    // Claims and stream failures are creates; settles, lock and lease renewals, checkpoints
    // and releases are replaces.
    let rules = || {
        vec![
            rule("503-create", E::ServiceUnavailable, Op::CreateItem, 0.3),
            rule("503-replace", E::ServiceUnavailable, Op::ReplaceItem, 0.3),
            rule("503-read", E::ServiceUnavailable, Op::ReadItem, 0.3),
        ]
    };
    under_faults("503s on writes and reads", rules).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_and_resets_including_writes_applied_but_unanswered_lose_nothing() {
    let rules = || {
        vec![
            // The write happened; the answer was lost: the caller cannot know.
            rule(
                "lost-answer-replace",
                E::ResponseTimeoutAfterService,
                Op::ReplaceItem,
                0.15,
            ),
            rule(
                "lost-answer-create",
                E::ResponseTimeoutAfterService,
                Op::CreateItem,
                // Creates are few here (leases, first failures' state): often enough to fire.
                0.5,
            ),
            rule("reset-feed", E::ConnectionError, Op::ChangeFeedItem, 0.3),
            rule("timeout-query", E::Timeout, Op::QueryItem, 0.3),
            rule("timeout-read", E::ResponseTimeout, Op::ReadItem, 0.2),
        ]
    };
    under_faults("timeouts and connection resets", rules).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_and_a_merge_mid_flight_lose_nothing() {
    const MESSAGES: usize = 300;
    let started = Instant::now();
    let mut s = Scenario::new(2, MESSAGES).await;
    s.enqueue(0..150).await;
    let client = s.fixture.client.clone();
    let pods = s.pods(&client).await;
    s.app.ledger.wait_until(|l| l.deliveries() >= 100).await;
    let store = s.fixture.emulator.store();
    let ids = s.fixture.emulator.partition_ids("db", "q").await.unwrap();
    let epk = store.midpoint_split_epk("db", "q", ids[0]).unwrap();
    store
        .split_partition_and_wait("db", "q", ids[0], epk, Duration::ZERO)
        .await
        .unwrap();
    s.enqueue(150..220).await;
    s.app.ledger.wait_until(|l| l.deliveries() >= 250).await;
    let ids = s.fixture.emulator.partition_ids("db", "q").await.unwrap();
    store
        .merge_partitions_and_wait("db", "q", ids[0], ids[1], Duration::ZERO)
        .await
        .unwrap();
    s.enqueue(220..MESSAGES).await;
    s.finish(pods, "split and merge").await.assert_clean(
        "partition split, then merge",
        1,
        2,
        started,
    );
    // No pod died and no write failed: the app saw no exclusive success a second time, however
    // the feed's positions moved (after the merge the emulator numbers documents anew).
    assert_eq!(
        s.app.ledger.completed_twice("x"),
        Vec::<Identity>::new(),
        "completed twice by the app"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clocks_skewed_within_the_lease_expiry_lose_nothing() {
    const MESSAGES: usize = 200;
    let started = Instant::now();
    let mut s = Scenario::new(4, MESSAGES).await;
    // Locks must outlast the skew (plus a renewal): a host whose clock runs ahead sees a lock
    // expire that much early.
    s.lock = Duration::from_secs(2);
    s.enqueue(0..MESSAGES).await;
    let client = s.fixture.client.clone();
    let mut pods = Vec::new();
    for (name, skew) in [("behind", -600), ("on-time", 0), ("ahead", 600)] {
        pods.push(s.pod(name, &client, Clock::skewed(skew)).await);
    }
    s.finish(pods, "clock skew")
        .await
        .assert_clean("clock skew of +-600 ms", 1, 2, started);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_documents_and_crashing_handlers_lose_nothing() {
    const MESSAGES: usize = 200;
    let started = Instant::now();
    let mut s = Scenario::new(4, MESSAGES).await;
    // Some handlers panic on a message's first delivery.
    *s.app.panics.lock().unwrap() = (0..MESSAGES).filter(|i| i % 17 == 3).map(id).collect();
    s.enqueue(0..MESSAGES / 2).await;
    let client = s.fixture.client.clone();
    let pods = s.pods(&client).await;
    // Documents written into the messages container behind the producer's back.
    let messages = s.fixture.queue.messages();
    let bad = [
        json!({"id": "no-body", "pk": "x", "enqueuedAt": 1}),
        json!({"id": "no-time", "pk": "x", "body": 1}),
        json!({"id": "bad-b64", "pk": "x", "bodyBase64": "@@", "enqueuedAt": 1}),
        json!({"id": "wrong-types", "pk": "x", "body": {"i": 1}, "enqueuedAt": "yesterday"}),
    ];
    for doc in &bad {
        let id = doc["id"].as_str().unwrap().to_owned();
        messages
            .create_item("x", &id, doc.clone(), None)
            .await
            .unwrap();
    }
    s.enqueue(MESSAGES / 2..MESSAGES).await;
    let report = s.finish(pods, "malformed documents").await;
    for (g, _) in GROUPS {
        let skipped: u64 = s
            .stats
            .iter()
            .filter(|(sg, _)| *sg == g)
            .map(|(_, st)| st.malformed.load(Ordering::Relaxed))
            .sum();
        assert!(
            skipped >= bad.len() as u64,
            "group {g} skipped {skipped} malformed documents"
        );
    }
    let panicked = s.app.panics.lock().unwrap().len() as u64;
    report.assert_clean(
        "malformed documents, handler panics",
        1,
        bad.len() as u64 + panicked * 2,
        started,
    );
}
