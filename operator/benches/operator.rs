//! The operator binary at scale: 50 CosmosQueues and 100 QueueConsumerGroups by default,
//! against the in-memory API server (served over HTTP, reached through a kubeconfig) and the
//! Cosmos DB emulator on localhost (reached with the account key from a Secret) — the same code
//! paths a cluster uses. Prints convergence time, the latency from a group's spec change to its
//! Deployment's change, one scaling round's duration, the Kubernetes API requests a minute at
//! rest, the time from a message to a Deployment scaled from zero (left to the rounds, and with
//! the operator told by a producer's wake), and resident memory.
//!
//! `cargo bench -p cosmosq-operator --bench operator`; at scale:
//! `COSMOSQ_BENCH_QUEUES=1000 COSMOSQ_BENCH_GROUPS_PER_QUEUE=5 COSMOSQ_BENCH_SCALE_INTERVAL=15s`.
//! `COSMOSQ_BENCH_OPERATOR` names another build of the binary (before/after);
//! `COSMOSQ_BENCH_REST_SECONDS` (60) the window at rest; `COSMOSQ_BENCH_FROM_ZERO` (3) the
//! from-zero samples left to the rounds; `COSMOSQ_BENCH_LOG` the operator's `RUST_LOG` (its
//! log is then kept, and each from-zero sample's enqueue time printed).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cosmosq_crds::{CosmosQueue, QueueConsumerGroup};
use cosmosq_emulator::{Emulator, EmulatorOptions};
use cosmosq_queue::{NewMessage, Queue, QueueConfig};
use cosmosq_testkit::fake::FakeApiServer;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{json, Value};

const LATENCY_SAMPLES: usize = 40;

fn setting<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A sample of the operator's own metrics (the insecure listener, loopback only).
async fn scrape(metrics: &str, name: &str) -> f64 {
    let body = reqwest::get(format!("http://{metrics}/metrics"))
        .await
        .and_then(|r| r.error_for_status())
        .expect("the operator's /metrics")
        .text()
        .await
        .unwrap_or_default();
    body.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

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
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    started.elapsed()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    cosmosq_program::measure::percentile(sorted, p).unwrap_or(f64::NAN)
}

#[tokio::main]
async fn main() {
    let queues_total: usize = setting("COSMOSQ_BENCH_QUEUES", 50);
    let per_queue: usize = setting("COSMOSQ_BENCH_GROUPS_PER_QUEUE", 2);
    let interval: String = setting("COSMOSQ_BENCH_SCALE_INTERVAL", "5s".to_owned());
    let interval_secs: u64 = interval
        .trim_end_matches('s')
        .parse()
        .expect("an interval in s");
    let groups_total = queues_total * per_queue;
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
    let free_port = || {
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        free.local_addr().unwrap().to_string()
    };
    let metrics = free_port();
    // The TLS listener, for producers' wakes: a certificate for localhost, and a producer
    // whose token (the operator's audience) may create `cosmosqueues/wake` in the namespace.
    let secure = free_port();
    let ca = cosmosq_testkit::pki::TestCa::new("bench-ca");
    let (cert, key) = ca.server();
    std::fs::write(dir.join("tls.crt"), cert).unwrap();
    std::fs::write(dir.join("tls.key"), key).unwrap();
    std::fs::write(dir.join("producer-token"), "producer-token").unwrap();
    fake.issue_token_for("producer-token", "producer", &["cosmosq"]);
    fake.grant(
        "producer",
        "create",
        "cosmosq.io",
        "cosmosqueues/wake",
        "bench",
    );
    let waker = cosmosq_program::wake::Waker::new(
        &format!("https://{secure}"),
        Some(ca.pem.as_bytes()),
        dir.join("producer-token"),
    )
    .expect("a wake client");
    let mut operator = Command::new(&binary)
        .env("KUBECONFIG", &kubeconfig)
        .env(
            "RUST_LOG",
            std::env::var("COSMOSQ_BENCH_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .args(["--listen", "127.0.0.1:0"]) // nothing here reads it
        .args(["--insecure-metrics-listen", &metrics])
        .args(["--secure-listen", &secure])
        .arg(format!("--tls-cert-file={}", dir.join("tls.crt").display()))
        .arg(format!("--tls-key-file={}", dir.join("tls.key").display()))
        .args(["--allowed-endpoint", &cosmos.endpoint])
        .args(["--lease-namespace", "bench", "--identity", "operator-0"])
        .args(["--scale-interval", &interval])
        // The operator logs to stdout; the log file takes it when asked for.
        .stdout(match std::env::var_os("COSMOSQ_BENCH_LOG") {
            Some(_) => Stdio::from(log.try_clone().unwrap()),
            None => Stdio::null(),
        })
        .stderr(log)
        .spawn()
        .expect("the operator binary");
    let pid = operator.id();

    // Declare everything at once, as `kubectl apply -f` of a directory would. Idle groups
    // scale to zero within a second, so the bench also sees wake-ups from zero.
    let queues: Api<CosmosQueue> = Api::namespaced(client.clone(), "bench");
    let groups: Api<QueueConsumerGroup> = Api::namespaced(client.clone(), "bench");
    for q in 0..queues_total {
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
        for g in 0..per_queue {
            let group = json!({
                "apiVersion": "cosmosq.io/v1alpha1", "kind": "QueueConsumerGroup",
                "metadata": {"name": format!("q{q}-g{g}")},
                "spec": {"queueRef": {"name": format!("q{q}")}, "startFrom": "beginning",
                         "template": {"spec": {"containers": [{"name": "app", "image": "example/app"}]}},
                         "app": {"port": 8080},
                         "scaling": {"targetBacklogPerReplica": 50, "scaleDownStabilization": "1s",
                                     "scaleToZeroCooldown": "1s"}}
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
    let deployment_of = |i: usize| format!("q{}-g{}-workers", i / per_queue, i % per_queue);
    // Checked in order, each once it holds: a check is cheap at any scale.
    let (mut queues_ready, mut applied) = (0, 0);
    let converged = until(
        "every queue ready and every Deployment applied",
        Duration::from_secs(1800),
        &mut operator,
        || {
            while queues_ready < queues_total
                && fake
                    .get(
                        "apis/cosmosq.io/v1alpha1/cosmosqueues",
                        "bench",
                        &format!("q{queues_ready}"),
                    )
                    .is_some_and(|o| o["status"]["partitions"] == 4)
            {
                queues_ready += 1;
            }
            while applied < groups_total
                && fake
                    .get("apis/apps/v1/deployments", "bench", &deployment_of(applied))
                    .is_some()
            {
                applied += 1;
            }
            queues_ready == queues_total && applied == groups_total
        },
    )
    .await;
    let after_start = memory_kib(pid);
    let replicas = |name: &str| {
        fake.get("apis/apps/v1/deployments", "bench", name)
            .and_then(|d| d["spec"]["replicas"].as_i64())
    };
    // Every group at zero: nothing was enqueued yet.
    let mut at_zero = 0;
    let settled = until(
        "every group scaled to zero",
        Duration::from_secs(600),
        &mut operator,
        || {
            while at_zero < groups_total && replicas(&deployment_of(at_zero)) == Some(0) {
                at_zero += 1;
            }
            at_zero == groups_total
        },
    )
    .await;

    // At rest: what a minute of rounds costs the API server, and how long a round takes.
    let rounds_before = scrape(&metrics, "cosmosq_operator_scaling_round_seconds_count").await;
    let spent_before = scrape(&metrics, "cosmosq_operator_scaling_round_seconds_sum").await;
    let requests_before = fake.requests();
    // 330 s covers a reconcile resync of every object at 5 minutes, and a key check.
    let rest = Duration::from_secs(setting("COSMOSQ_BENCH_REST_SECONDS", 60u64));
    tokio::time::sleep(rest).await;
    let requests_at_rest: Vec<(String, u64)> = {
        let mut diff: Vec<_> = fake
            .requests()
            .into_iter()
            .map(|(what, n)| {
                let before = requests_before.get(&what).copied().unwrap_or(0);
                (what, n - before)
            })
            .filter(|(_, n)| *n > 0)
            .collect();
        diff.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
        diff
    };
    let rounds =
        scrape(&metrics, "cosmosq_operator_scaling_round_seconds_count").await - rounds_before;
    let round_mean = (scrape(&metrics, "cosmosq_operator_scaling_round_seconds_sum").await
        - spent_before)
        / rounds;
    let (rest_rss, _) = memory_kib(pid);

    // From zero: a message on a queue whose groups are all at zero, left to the rounds; then
    // on other queues, told: the producer enqueues, then tells the operator (`cosmosq enqueue
    // --wake`, or the HTTP call any producer can make), and the group starts before the round.
    let (mut wakes, mut told) = (Vec::new(), Vec::new());
    let client_cosmos = cosmos.emulator.client().await.unwrap();
    // More samples when asked (`COSMOSQ_BENCH_FROM_ZERO`), spread over the queues.
    let from_zero: usize = setting("COSMOSQ_BENCH_FROM_ZERO", 3);
    let untold: Vec<usize> = (0..from_zero)
        .map(|i| match i {
            0 => 1 % queues_total,
            1 => queues_total / 2,
            2 => queues_total - 1,
            i => (queues_total / 4 + 7 * i) % queues_total,
        })
        .collect();
    let mut asked = vec![2 % queues_total, queues_total / 2 + 1, queues_total - 2];
    asked.sort_unstable();
    // Queues still at zero only (a small run has few).
    asked.retain(|q| !untold.contains(q));
    asked.dedup();
    let samples = untold.iter().map(|q| (*q, false));
    for (q, tell) in samples.chain(asked.iter().map(|q| (*q, true))) {
        let queue = Queue::open(&client_cosmos, QueueConfig::new("bench", format!("q{q}")))
            .await
            .unwrap();
        let sent = Instant::now();
        let at_ms = cosmosq_queue::clock::system_now_ms();
        queue
            .enqueue(NewMessage::json(json!({"queue": q, "told": tell})))
            .await
            .unwrap();
        if tell {
            waker.wake(&format!("bench/q{q}")).await.expect("the wake");
        }
        let name = format!("q{q}-g0-workers");
        until(
            "a group to scale from zero",
            Duration::from_secs(120),
            &mut operator,
            || replicas(&name).is_some_and(|r| r > 0),
        )
        .await;
        let samples = if tell { &mut told } else { &mut wakes };
        samples.push(sent.elapsed().as_secs_f64());
        if std::env::var_os("COSMOSQ_BENCH_LOG").is_some() {
            eprintln!(
                "from zero: q{q} told={tell} enqueued at {at_ms} ms, {:.2} s",
                sent.elapsed().as_secs_f64()
            );
        }
    }

    // A backlog on one queue: each of its groups scales up.
    let q0 = Queue::open(&client_cosmos, QueueConfig::new("bench", "q0"))
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
        Duration::from_secs(120),
        &mut operator,
        || (0..per_queue).all(|g| replicas(&format!("q0-g{g}-workers")) == Some(4)),
    )
    .await;

    // Spec change → Deployment change, one group at a time.
    let mut latencies = Vec::with_capacity(LATENCY_SAMPLES);
    for n in 0..LATENCY_SAMPLES {
        let q = n % queues_total;
        let name = format!("q{q}-g{}", n % per_queue);
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
            Duration::from_secs(60),
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

    let (idle_rss, peak_rss) = memory_kib(pid);
    let requests = fake.requests();
    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let exit = operator.wait().unwrap();
    stop.cancel();
    cosmos.stop.cancel();

    println!("cosmosq operator ({binary}) with {queues_total} queues and {groups_total} groups, {interval} rounds");
    println!("API server: in-memory over HTTP; Cosmos DB: emulator over HTTP with the key from a Secret\n");
    println!(
        "converged        {:>8.2} s   (all queues provisioned and ready, all Deployments applied)",
        converged.as_secs_f64()
    );
    println!(
        "at zero          {:>8.2} s   later (every group idle past its 1 s cool-down)",
        settled.as_secs_f64()
    );
    println!(
        "scaling round    {:>8.2} s   mean of {rounds} rounds at rest ({interval_secs} s interval)",
        round_mean
    );
    let at_rest: u64 = requests_at_rest.iter().map(|(_, n)| n).sum();
    println!(
        "API at rest      {:>8} requests in {} s ({:.0} a minute); by kind:",
        at_rest,
        rest.as_secs(),
        at_rest as f64 * 60.0 / rest.as_secs_f64()
    );
    for (what, n) in requests_at_rest.iter().take(8) {
        println!("    {n:>6}  {what}");
    }
    println!(
        "from zero        {}   (one message → its group's Deployment at 1 replica)",
        wakes
            .iter()
            .map(|s| format!("{s:.2} s"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "from zero, told  {}   (one message, then a wake → its group's Deployment at 1 replica)",
        told.iter()
            .map(|s| format!("{s:.2} s"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "scaled up        {:>8.2} s   (200 messages enqueued → each of q0's groups at 4 replicas)",
        scaled.as_secs_f64()
    );
    println!(
        "spec → Deployment p50 {:>6.1} ms, p99 {:.1} ms, max {:.1} ms ({LATENCY_SAMPLES} changes)",
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        latencies[latencies.len() - 1]
    );
    println!(
        "resident memory  {:>8.1} MiB after converging, {:.1} MiB at rest, {:.1} MiB at the end, {:.1} MiB peak",
        after_start.0 as f64 / 1024.0,
        rest_rss as f64 / 1024.0,
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
    // The operator's log stays when it was asked for (`COSMOSQ_BENCH_LOG`).
    if std::env::var_os("COSMOSQ_BENCH_LOG").is_some() {
        println!("operator log    {}", dir.join("operator.log").display());
    } else {
        let _ = std::fs::remove_dir_all(&dir);
    }
}

fn base64_key(key: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(key)
}
