//! The operator binary at scale: 50 CosmosQueues and 100 QueueConsumerGroups, against the
//! in-memory API server (served over HTTP, reached through a kubeconfig) and the Cosmos DB
//! emulator on localhost (reached with the account key from a Secret) — the same code paths a
//! cluster uses. Prints convergence time, the latency from a group's spec change to its
//! Deployment's change, and the operator's resident memory.
//!
//! `cargo bench -p cosmosq-operator --features testkit --bench operator`

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cosmosq_crds::{CosmosQueue, QueueConsumerGroup};
use cosmosq_emulator::{Emulator, EmulatorOptions};
use cosmosq_queue::{NewMessage, Queue, QueueConfig};
use cosmosq_testkit::fake::FakeApiServer;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{json, Value};

const QUEUES: usize = 50;
const GROUPS_PER_QUEUE: usize = 2;
const LATENCY_SAMPLES: usize = 40;

/// `VmRSS` and `VmHWM` (peak) of a process, in KiB (Linux).
fn memory_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn env_of(deployment: &Value, name: &str) -> Option<String> {
    deployment["spec"]["template"]["spec"]["containers"]
        .as_array()?
        .iter()
        .flat_map(|c| c["env"].as_array().into_iter().flatten())
        .find(|e| e["name"] == name)
        .and_then(|e| e["value"].as_str().map(str::to_owned))
}

/// Polls `done` every millisecond; fails if the operator exits or `timeout` passes.
async fn until(
    what: &str,
    timeout: Duration,
    operator: &mut Child,
    mut done: impl FnMut() -> bool,
) -> Duration {
    let started = Instant::now();
    while !done() {
        if let Ok(Some(status)) = operator.try_wait() {
            panic!("the operator exited ({status}) while waiting for {what}; see operator.log");
        }
        assert!(started.elapsed() < timeout, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    started.elapsed()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    cosmosq_program::measure::percentile(sorted, p).unwrap_or(f64::NAN)
}

#[tokio::main]
async fn main() {
    let cosmos = Emulator::serve_localhost(0, EmulatorOptions::default())
        .await
        .expect("emulator");
    let fake = FakeApiServer::new();
    let dir = std::env::temp_dir().join(format!("cosmosq-operator-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (kubeconfig, stop) = fake.serve_localhost(&dir).await.unwrap();
    let client = fake.client();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), "bench");
    let secret = json!({"metadata": {"name": "cosmos-key"},
                        "data": {"key": base64_key(cosmos.emulator.key())}});
    secrets
        .create(
            &PostParams::default(),
            &serde_json::from_value(secret).unwrap(),
        )
        .await
        .unwrap();

    let log = std::fs::File::create(dir.join("operator.log")).unwrap();
    // Another build of the binary (the image's profile, say) when named.
    let binary = std::env::var("COSMOSQ_BENCH_OPERATOR")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_cosmosq-operator").to_owned());
    let mut operator = Command::new(&binary)
        .env("KUBECONFIG", &kubeconfig)
        .env("RUST_LOG", "warn")
        .args(["--listen", "127.0.0.1:0"]) // nothing here reads it
        .args(["--lease-namespace", "bench", "--identity", "operator-0"])
        .args(["--scale-interval", "5s"])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("the operator binary");
    let pid = operator.id();

    // Declare everything at once, as `kubectl apply -f` of a directory would.
    let queues: Api<CosmosQueue> = Api::namespaced(client.clone(), "bench");
    let groups: Api<QueueConsumerGroup> = Api::namespaced(client.clone(), "bench");
    for q in 0..QUEUES {
        let queue = json!({
            "apiVersion": "cosmosq.io/v1alpha1", "kind": "CosmosQueue",
            "metadata": {"name": format!("q{q}")},
            "spec": {"endpoint": cosmos.endpoint, "credentials": {"secretKeyRef": {"name": "cosmos-key"}},
                     "database": "bench", "container": format!("q{q}")}
        });
        queues
            .create(
                &PostParams::default(),
                &serde_json::from_value(queue).unwrap(),
            )
            .await
            .unwrap();
        for g in 0..GROUPS_PER_QUEUE {
            let group = json!({
                "apiVersion": "cosmosq.io/v1alpha1", "kind": "QueueConsumerGroup",
                "metadata": {"name": format!("q{q}-g{g}")},
                "spec": {"queueRef": {"name": format!("q{q}")}, "startFrom": "beginning",
                         "template": {"spec": {"containers": [{"name": "app", "image": "example/app"}]}},
                         "app": {"port": 8080}, "scaling": {"targetBacklogPerReplica": 50}}
            });
            groups
                .create(
                    &PostParams::default(),
                    &serde_json::from_value(group).unwrap(),
                )
                .await
                .unwrap();
        }
    }
    let groups_total = QUEUES * GROUPS_PER_QUEUE;
    let converged = until(
        "every queue ready and every Deployment applied",
        Duration::from_secs(300),
        &mut operator,
        || {
            let ready = (0..QUEUES).all(|q| {
                fake.get(
                    "apis/cosmosq.io/v1alpha1/cosmosqueues",
                    "bench",
                    &format!("q{q}"),
                )
                .is_some_and(|o| o["status"]["partitions"] == 4)
            });
            ready
                && (0..groups_total).all(|i| {
                    let name = format!(
                        "q{}-g{}-workers",
                        i / GROUPS_PER_QUEUE,
                        i % GROUPS_PER_QUEUE
                    );
                    fake.get("apis/apps/v1/deployments", "bench", &name)
                        .is_some()
                })
        },
    )
    .await;
    let after_start = memory_kib(pid);

    // A backlog on one queue: both of its groups scale up.
    let q0 = Queue::open(
        &cosmos.emulator.client().await.unwrap(),
        QueueConfig::new("bench", "q0"),
    )
    .await
    .unwrap();
    for result in q0
        .enqueue_batch(
            (0..200)
                .map(|i| NewMessage::json(json!({"n": i})))
                .collect(),
        )
        .await
    {
        result.unwrap();
    }
    let scaled = until(
        "q0's groups to scale",
        Duration::from_secs(60),
        &mut operator,
        || {
            (0..GROUPS_PER_QUEUE).all(|g| {
                fake.get(
                    "apis/apps/v1/deployments",
                    "bench",
                    &format!("q0-g{g}-workers"),
                )
                .is_some_and(|d| d["spec"]["replicas"] == 4)
            })
        },
    )
    .await;

    // Spec change → Deployment change, one group at a time.
    let mut latencies = Vec::with_capacity(LATENCY_SAMPLES);
    for n in 0..LATENCY_SAMPLES {
        let q = n % QUEUES;
        let name = format!("q{q}-g{}", n % GROUPS_PER_QUEUE);
        let concurrency = 100 + n;
        let sent = Instant::now();
        groups
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"concurrency": concurrency}})),
            )
            .await
            .unwrap();
        let deployment = format!("{name}-workers");
        until(
            "the Deployment to follow its group",
            Duration::from_secs(30),
            &mut operator,
            || {
                fake.get("apis/apps/v1/deployments", "bench", &deployment)
                    .and_then(|d| env_of(&d, "COSMOSQ_MAX_CONCURRENCY"))
                    == Some(concurrency.to_string())
            },
        )
        .await;
        latencies.push(sent.elapsed().as_secs_f64() * 1000.0);
    }
    latencies.sort_by(f64::total_cmp);

    // Idle: a few scaling rounds over every group.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let (idle_rss, peak_rss) = memory_kib(pid);
    let requests = fake.requests();
    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let exit = operator.wait().unwrap();
    stop.cancel();
    cosmos.stop.cancel();

    println!("cosmosq operator ({binary}) with {QUEUES} queues and {groups_total} groups");
    println!("API server: in-memory over HTTP; Cosmos DB: emulator over HTTP with the key from a Secret\n");
    println!(
        "converged        {:>8.2} s   (all queues provisioned and ready, all Deployments applied)",
        converged.as_secs_f64()
    );
    println!("scaled up        {:>8.2} s   (200 messages enqueued → both groups at 4 replicas, 5 s rounds)", scaled.as_secs_f64());
    println!(
        "spec → Deployment p50 {:>6.1} ms, p99 {:.1} ms, max {:.1} ms ({LATENCY_SAMPLES} changes)",
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        latencies[latencies.len() - 1]
    );
    println!(
        "resident memory  {:>8.1} MiB after converging, {:.1} MiB idle after 2 rounds, {:.1} MiB peak",
        after_start.0 as f64 / 1024.0,
        idle_rss as f64 / 1024.0,
        peak_rss as f64 / 1024.0
    );
    let total: u64 = requests.values().sum();
    println!("API requests     {total:>8} in total; busiest:");
    let mut busiest: Vec<_> = requests.into_iter().collect();
    busiest.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    for (what, n) in busiest.into_iter().take(6) {
        println!("    {n:>6}  {what}");
    }
    println!("exit on SIGTERM  {exit}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn base64_key(key: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(key)
}
