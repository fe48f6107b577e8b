//! Randomized histories: the next broken guarantee found by a machine, not a reader.
//!
//! Each case is a history generated from a seed: a retention (1 h to 30 d), one or two groups
//! (either mode, ordered or not), messages with keys of every JSON type and length and short
//! schedules, what the app answers to each delivery (success, retry, drop, a crash mid-request,
//! a refused connection), pods with skewed clocks, kills and restarts at random points (lease
//! moves), and a window of 429s, 503s or writes applied but unanswered from the SDK's fault
//! injection. It runs on the emulator; then the full ledger is checked:
//! - every message ends completed or dead-lettered with a reason (none lost);
//! - `exclusive`: no completion recorded twice, never in the app twice at once;
//! - ordered groups: per key, messages are first completed in enqueue order;
//! - no state document may expire before its message has an outcome.
//!
//! A failing case is shrunk (fewer kills, faults, pods, groups, messages, failing answers)
//! while it keeps failing, and printed as JSON that replays it:
//! `COSMOSQ_HISTORY='<json>' cargo test -p cosmosq-tests --test it histories:: -- --nocapture`.
//! CI runs `COSMOSQ_HISTORY_CASES` cases (6 by default); a long run:
//! `COSMOSQ_HISTORY_CASES=1000 cargo test -p cosmosq-tests --test it histories:: -- --nocapture`.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use cosmosq_emulator::fault_injection::{
    FaultInjectionConditionBuilder, FaultInjectionErrorType, FaultInjectionResultBuilder,
    FaultInjectionRule, FaultInjectionRuleBuilder, FaultOperationType,
};
use cosmosq_emulator::EmulatorOptions;
use cosmosq_queue::host::Host;
use cosmosq_queue::{
    Clock, ConsumerStats, Delivery, DeliveryMode, GroupConfig, MessageKey, MessageState,
    NewMessage, Outcome, Queue, QueueConfig, RetryPolicy, StartFrom,
};
use cosmosq_tests::{fast_host, Fixture, Ledger};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

#[derive(Clone, Debug, Serialize, Deserialize)]
struct History {
    seed: u64,
    retention_secs: u32,
    partitions: u32,
    groups: Vec<GroupSpec>,
    messages: Vec<MessageSpec>,
    /// Clock skew of each pod, ms.
    pods: Vec<i64>,
    /// (after this many deliveries, kill this pod; it restarts at once).
    kills: Vec<(u64, usize)>,
    faults: Option<FaultSpec>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct GroupSpec {
    stream: bool,
    ordered: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct MessageSpec {
    key: Value,
    delay_ms: u64,
    /// The app's answer to its n-th delivery in each group; `Complete` after the list.
    answers: Vec<Answer>,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
enum Answer {
    Complete,
    Retry,
    Drop,
    Crash,
    Refused,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct FaultSpec {
    /// "429", "503" or "lost-answer" (applied by the service, the answer lost).
    error: String,
    /// "create", "replace", "read", "query" or "feed".
    operation: String,
    probability: f32,
    window_ms: u64,
}

const KEYS: usize = 7;

fn key(n: usize) -> Value {
    match n % KEYS {
        0 => json!("a"),
        1 => json!("b"),
        2 => json!(7),
        3 => json!(2.5),
        4 => json!(true),
        5 => Value::Null,
        _ => json!("k".repeat(1500)),
    }
}

impl History {
    fn generate(seed: u64) -> History {
        let mut rng = StdRng::seed_from_u64(seed);
        let groups = (0..rng.random_range(1..=2))
            .map(|_| GroupSpec {
                stream: rng.random_bool(0.5),
                ordered: rng.random_bool(0.5),
            })
            .collect();
        let messages = (0..rng.random_range(5..=40))
            .map(|_| MessageSpec {
                key: key(rng.random_range(0..KEYS)),
                delay_ms: if rng.random_bool(0.2) {
                    rng.random_range(0..1500)
                } else {
                    0
                },
                answers: (0..rng.random_range(0..=3))
                    .map(|_| match rng.random_range(0..100) {
                        0..40 => Answer::Retry,
                        40..55 => Answer::Drop,
                        55..70 => Answer::Crash,
                        70..85 => Answer::Refused,
                        _ => Answer::Complete,
                    })
                    .collect(),
            })
            .collect();
        let pods: Vec<i64> = (0..rng.random_range(1..=3))
            .map(|_| rng.random_range(-400..=400))
            .collect();
        let kills = (0..rng.random_range(0..=2))
            .map(|_| (rng.random_range(0..40), rng.random_range(0..pods.len())))
            .collect();
        let faults = rng.random_bool(0.5).then(|| FaultSpec {
            error: ["429", "503", "lost-answer"][rng.random_range(0..3)].into(),
            operation: ["create", "replace", "read", "query", "feed"][rng.random_range(0..5)]
                .into(),
            probability: rng.random_range(0.1..0.5),
            window_ms: rng.random_range(500..3000),
        });
        History {
            seed,
            retention_secs: [3600, 86_400, 30 * 86_400][rng.random_range(0..3)],
            partitions: rng.random_range(1..=3),
            groups,
            messages,
            pods,
            kills,
            faults,
        }
    }

    fn group_config(&self, g: usize) -> GroupConfig {
        let spec = &self.groups[g];
        GroupConfig::new(group_name(g))
            .with_mode(if spec.stream {
                DeliveryMode::Stream
            } else {
                DeliveryMode::Exclusive
            })
            .with_ordering(spec.ordered)
            .with_start_from(StartFrom::Beginning)
            .with_lock_duration(Duration::from_secs(2))
            .with_retry(RetryPolicy {
                max_delivery_attempts: 3,
                initial_backoff: Duration::from_millis(20),
                max_backoff: Duration::from_millis(100),
                ..RetryPolicy::default()
            })
    }

    /// Smaller histories that may still fail, most promising first.
    fn shrinks(&self) -> Vec<History> {
        let mut out = Vec::new();
        let with = |change: &dyn Fn(&mut History)| {
            let mut h = self.clone();
            change(&mut h);
            h
        };
        if self.faults.is_some() {
            out.push(with(&|h| h.faults = None));
        }
        for i in 0..self.kills.len() {
            out.push(with(&|h| {
                h.kills.remove(i);
            }));
        }
        if self.pods.len() > 1 {
            out.push(with(&|h| {
                h.pods.pop();
                let pods = h.pods.len();
                h.kills.iter_mut().for_each(|k| k.1 %= pods);
            }));
        }
        if self.groups.len() > 1 {
            for g in 0..self.groups.len() {
                out.push(with(&|h| {
                    h.groups.remove(g);
                }));
            }
        }
        let n = self.messages.len();
        if n > 1 {
            out.push(with(&|h| h.messages.truncate(n / 2)));
            out.push(with(&|h| {
                h.messages.drain(..n / 2);
            }));
            for i in 0..n {
                out.push(with(&|h| {
                    h.messages.remove(i);
                }));
            }
        }
        for i in 0..n {
            if !self.messages[i].answers.is_empty() {
                out.push(with(&|h| h.messages[i].answers.clear()));
            }
            if self.messages[i].delay_ms > 0 {
                out.push(with(&|h| h.messages[i].delay_ms = 0));
            }
        }
        out
    }
}

/// The app of group `g`: answers each message as the history says for its n-th call; the
/// shared ledger records what it was given and answered.
fn handler(
    ledger: &Arc<Ledger>,
    history: &Arc<History>,
    g: usize,
) -> impl Fn(Delivery) -> futures::future::BoxFuture<'static, Outcome> + Send + Sync + 'static {
    let (calls, history) = (Arc::clone(ledger), Arc::clone(history));
    ledger.handler(move |d: Delivery| {
        let (calls, history) = (Arc::clone(&calls), Arc::clone(&history));
        async move {
            let m: usize = d.message.id[1..].parse().expect("ids are m<n>");
            let n = calls
                .record(&group_name(g), &d.message.id)
                .delivery_counts
                .len();
            tokio::task::yield_now().await;
            let answer = history.messages[m]
                .answers
                .get(n - 1)
                .copied()
                .unwrap_or(Answer::Complete);
            match answer {
                Answer::Complete => Outcome::Complete,
                Answer::Retry => Outcome::Retry {
                    reason: "the app failed".into(),
                    delay: None,
                },
                Answer::Drop => Outcome::DeadLetter {
                    reason: "DroppedByApp".into(),
                    description: "the app dropped it".into(),
                },
                Answer::Crash => panic!("the app crashed on m{m}"),
                Answer::Refused => Outcome::Undelivered {
                    reason: "connection refused".into(),
                    delay: Some(Duration::from_millis(20)),
                },
            }
        }
    })
}

fn group_name(g: usize) -> String {
    format!("g{g}")
}

fn fault_rule(spec: &FaultSpec) -> Arc<FaultInjectionRule> {
    let error = match spec.error.as_str() {
        "429" => FaultInjectionErrorType::TooManyRequests,
        "503" => FaultInjectionErrorType::ServiceUnavailable,
        _ => FaultInjectionErrorType::ResponseTimeoutAfterService,
    };
    let operation = match spec.operation.as_str() {
        "create" => FaultOperationType::CreateItem,
        "replace" => FaultOperationType::ReplaceItem,
        "read" => FaultOperationType::ReadItem,
        "query" => FaultOperationType::QueryItem,
        _ => FaultOperationType::ChangeFeedItem,
    };
    Arc::new(
        FaultInjectionRuleBuilder::new(
            "history",
            FaultInjectionResultBuilder::new()
                .with_error(error)
                .with_probability(spec.probability)
                .build(),
        )
        .with_condition(
            FaultInjectionConditionBuilder::new()
                .with_operation_type(operation)
                .build(),
        )
        .with_end_time(std::time::Instant::now() + Duration::from_millis(spec.window_ms))
        .build(),
    )
}

struct Pod {
    tasks: Vec<tokio::task::JoinHandle<cosmosq_queue::Result<()>>>,
    stop: CancellationToken,
}

struct Run {
    history: Arc<History>,
    fixture: Fixture,
    ledger: Arc<Ledger>,
    client: cosmosq_queue::CosmosClient,
    stats: Vec<(usize, Arc<ConsumerStats>)>,
}

impl Run {
    async fn pod(&mut self, p: usize) -> Pod {
        let clock = Clock::skewed(self.history.pods[p]);
        let queue = Queue::open_with_clock(&self.client, QueueConfig::new("db", "q"), clock)
            .await
            .expect("open");
        let stop = CancellationToken::new();
        let mut tasks = Vec::new();
        for g in 0..self.history.groups.len() {
            let host = Host::new(
                queue.group(self.history.group_config(g)).expect("group"),
                handler(&self.ledger, &self.history, g),
                fast_host(&format!("p{p}")),
            );
            self.stats.push((g, host.stats()));
            tasks.push(tokio::spawn(host.run(stop.clone())));
        }
        Pod { tasks, stop }
    }

    /// Whether the group is done with message `m`: completed (the app said so, and in
    /// exclusive mode the state says so) or dead-lettered with a reason.
    async fn settled(&self, g: usize, m: usize) -> Result<bool, String> {
        let group = self.fixture.group(self.history.group_config(g));
        let key = MessageKey::from_json(self.history.messages[m].key.clone()).unwrap();
        let state = group
            .read_state(&key, &format!("m{m}"))
            .await
            .map_err(|e| e.to_string())?;
        let completed_by_app = self
            .ledger
            .records(&group_name(g))
            .get(&(format!("m{m}"), key.canonical()))
            .is_some_and(|r| r.completions > 0);
        Ok(match state.as_ref().map(|s| s.state) {
            Some(MessageState::DeadLettered) => state.unwrap().reason.is_some(),
            Some(MessageState::Completed) => completed_by_app,
            _ => self.history.groups[g].stream && completed_by_app,
        })
    }

    async fn all_settled(&self) -> bool {
        for g in 0..self.history.groups.len() {
            for m in 0..self.history.messages.len() {
                if !self.settled(g, m).await.unwrap_or(false) {
                    return false;
                }
            }
        }
        true
    }

    /// Every invariant on the full ledger; the first one broken.
    async fn check(&self) -> Result<(), String> {
        let h = &self.history;
        for g in 0..h.groups.len() {
            for m in 0..h.messages.len() {
                if !self.settled(g, m).await? {
                    return Err(format!("g{g}: m{m} is neither completed nor dead-lettered"));
                }
            }
            if !h.groups[g].stream {
                let group = self.fixture.group(h.group_config(g));
                let mut completed_docs = 0;
                for (m, spec) in h.messages.iter().enumerate() {
                    let key = MessageKey::from_json(spec.key.clone()).unwrap();
                    let state = group.read_state(&key, &format!("m{m}")).await;
                    completed_docs += usize::from(
                        state
                            .map_err(|e| e.to_string())?
                            .is_some_and(|s| s.state == MessageState::Completed),
                    );
                }
                let recorded: u64 = self
                    .stats
                    .iter()
                    .filter(|(sg, _)| *sg == g)
                    .map(|(_, s)| s.completed.load(Ordering::Relaxed))
                    .sum();
                if recorded != completed_docs as u64 {
                    return Err(format!(
                        "g{g}: {recorded} completions recorded for {completed_docs} messages"
                    ));
                }
            }
            if h.groups[g].ordered {
                // The first completion of each message, per key, in enqueue order. (A stream
                // group delivers again what it completed since its last checkpoint when a
                // lease moves without a hand-over: those repeats come after, by design.)
                let order: Vec<usize> = self
                    .ledger
                    .completed_order(&group_name(g))
                    .iter()
                    .map(|(id, _)| id[1..].parse().expect("ids are m<n>"))
                    .collect();
                let mut first: HashMap<usize, usize> = HashMap::new();
                for (at, m) in order.iter().enumerate() {
                    first.entry(*m).or_insert(at);
                }
                let last = first;
                for k in 0..KEYS {
                    let of_key: Vec<usize> = (0..h.messages.len())
                        .filter(|m| h.messages[*m].key == key(k) && last.contains_key(m))
                        .collect();
                    for pair in of_key.windows(2) {
                        if last[&pair[0]] > last[&pair[1]] {
                            return Err(format!(
                                "g{g}: key {}: m{} completed after m{} (completions {order:?})",
                                key(k),
                                pair[0],
                                pair[1]
                            ));
                        }
                    }
                }
            }
        }
        for g in (0..h.groups.len()).filter(|g| !h.groups[*g].stream) {
            if let Some(overlap) = self.ledger.overlaps(&group_name(g)).first() {
                return Err(format!("g{g}: in the app twice at once: {overlap}"));
            }
        }
        self.state_outlives_messages().await
    }

    /// Every state document lives at least as long as its message (the TTL it was written with).
    async fn state_outlives_messages(&self) -> Result<(), String> {
        let retention_ms = i64::from(self.history.retention_secs) * 1000;
        let mut pages = self
            .fixture
            .queue
            .leases()
            .query_items::<Value>(
                azure_data_cosmos::Query::from(
                    "SELECT * FROM c WHERE c.type = 'message'".to_owned(),
                ),
                azure_data_cosmos::FeedScope::full_container(),
                None,
            )
            .await
            .map_err(|e| e.to_string())?
            .into_pages();
        use futures::StreamExt;
        while let Some(page) = pages.next().await {
            for doc in page.map_err(|e| e.to_string())?.into_items() {
                let written_ms = doc["_ts"].as_i64().unwrap_or(0) * 1000;
                let until = doc["ttl"].as_i64().map(|t| written_ms + t * 1000);
                let message_expiry = doc["enqueuedAt"].as_i64().unwrap_or(0) + retention_ms;
                let due = doc["due"].as_i64().unwrap_or(0);
                if until.is_some_and(|u| u < message_expiry.max(due)) {
                    return Err(format!("state expires before its message: {doc}"));
                }
            }
        }
        Ok(())
    }
}

/// Runs one history; `Err` names the first broken invariant.
async fn run(history: History) -> Result<(), String> {
    let history = Arc::new(history);
    let mut config = QueueConfig::new("db", "q");
    config.retention = Some(Duration::from_secs(u64::from(history.retention_secs)));
    let fixture = Fixture::with(
        EmulatorOptions {
            partitions: history.partitions,
            ..Default::default()
        },
        config,
        Clock::system(),
    )
    .await;
    let batch: Vec<NewMessage> = history
        .messages
        .iter()
        .enumerate()
        .map(|(m, spec)| {
            NewMessage::json(json!({"m": m}))
                .with_id(format!("m{m}"))
                .with_partition_key(MessageKey::from_json(spec.key.clone()).unwrap())
                .with_delay(Duration::from_millis(spec.delay_ms))
        })
        .collect();
    // One by one, so the feed's order is the enqueue order (a batch is one write).
    for message in batch {
        fixture
            .queue
            .enqueue(message)
            .await
            .map_err(|e| e.to_string())?;
    }
    let rules: Vec<_> = history.faults.iter().map(fault_rule).collect();
    let client = if rules.is_empty() {
        fixture.client.clone()
    } else {
        fixture
            .emulator
            .client_with_faults(rules)
            .await
            .map_err(|e| e.to_string())?
    };
    let mut run = Run {
        history: Arc::clone(&history),
        fixture,
        ledger: Ledger::new(),
        client,
        stats: Vec::new(),
    };
    let mut pods = Vec::new();
    for p in 0..history.pods.len() {
        pods.push(run.pod(p).await);
    }
    let mut kills = history.kills.clone();
    kills.sort();
    for (after, victim) in kills {
        let reached = run.ledger.wait_until(|l| l.deliveries() >= after);
        if tokio::time::timeout(Duration::from_secs(10), reached)
            .await
            .is_err()
        {
            break; // fewer deliveries than that in this history
        }
        for task in &pods[victim].tasks {
            task.abort();
        }
        let fresh = run.pod(victim).await;
        let dead = std::mem::replace(&mut pods[victim], fresh);
        for task in dead.tasks {
            let _ = task.await;
        }
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !run.all_settled().await {
        if tokio::time::Instant::now() > deadline {
            break; // `check` names what is missing
        }
        let changed = run.ledger.changed().notified();
        // State written by the sweep or a retry announces nothing to the app: look again soon.
        let _ = tokio::time::timeout(Duration::from_millis(200), changed).await;
    }
    for pod in &pods {
        pod.stop.cancel();
    }
    for pod in pods {
        for task in pod.tasks {
            let _ = task.await;
        }
    }
    run.check().await
}

/// Shrinks a failing history while it keeps failing (at most `budget` runs).
async fn shrink(mut history: History, mut error: String, budget: usize) -> (History, String) {
    let mut runs = 0;
    'smaller: loop {
        for candidate in history.shrinks() {
            if runs >= budget {
                break 'smaller;
            }
            runs += 1;
            if let Err(e) = run(candidate.clone()).await {
                (history, error) = (candidate, e);
                continue 'smaller;
            }
        }
        break;
    }
    (history, error)
}

fn cases() -> u64 {
    std::env::var("COSMOSQ_HISTORY_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_histories_keep_every_guarantee() {
    cosmosq_tests::init_tracing();
    if let Ok(text) = std::env::var("COSMOSQ_HISTORY") {
        let history: History =
            serde_json::from_str(&text).expect("COSMOSQ_HISTORY: a history a failing case printed");
        if let Err(error) = run(history).await {
            panic!("the replayed history breaks a guarantee: {error}");
        }
        return;
    }
    let first: u64 = std::env::var("COSMOSQ_HISTORY_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let started = std::time::Instant::now();
    let mut message_groups = 0;
    for seed in first..first + cases() {
        let history = History::generate(seed);
        message_groups += history.messages.len() * history.groups.len();
        if let Err(error) = run(history.clone()).await {
            let (small, small_error) = shrink(history, error.clone(), 30).await;
            panic!(
                "history {seed} broke a guarantee: {error}\n\
                 shrunk to: {small_error}\n\
                 replay: COSMOSQ_HISTORY='{}' cargo test -p cosmosq-tests --test it histories:: -- --nocapture",
                serde_json::to_string(&small).unwrap()
            );
        }
    }
    println!(
        "histories | {} cases from seed {first} | {message_groups} message-groups | {:.1}s",
        cases(),
        started.elapsed().as_secs_f64()
    );
}
