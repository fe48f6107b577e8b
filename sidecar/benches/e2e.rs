//! End-to-end figures for one sidecar process: throughput to a trivial app, enqueue→delivery
//! latency at light load, the sidecar's CPU time per message and its resident memory idle and
//! under load; then the same messages taken by pull workers (receive 32, settle the batch)
//! through a second sidecar of another group.
//!
//! `cargo bench -p cosmosq-sidecar --bench e2e` — the emulator is served over HTTP on
//! localhost in this process, the sidecar is the real binary in a child process (the one
//! `COSMOSQ_BENCH_SIDECAR` names, else this build's), the app is a trivial HTTP server in this
//! process.

use cosmosq_testkit::free_port;
use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cosmosq_emulator::{Emulator, EmulatorOptions};
use cosmosq_queue::{provision, ConnectionArgs, NewMessage, QueueConfig};
use serde_json::json;

const THROUGHPUT_MESSAGES: usize = 5_000;
const LIGHT_LOAD_MESSAGES: usize = 300;

type Received = Arc<Mutex<HashMap<String, Instant>>>;

/// Resident memory of a process in KiB (Linux).
fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// CPU time a process has used, user and system, in seconds (Linux; clock ticks of 10 ms).
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0)
}

async fn wait_for(received: &Received, n: usize, peak_rss: &mut u64, pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(300);
    while received.lock().unwrap().len() < n {
        assert!(
            Instant::now() < deadline,
            "the sidecar did not deliver everything in time"
        );
        *peak_rss = (*peak_rss).max(rss_kib(pid).unwrap_or(0));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    cosmosq_program::measure::percentile(sorted, p).unwrap_or(f64::NAN)
}

#[tokio::main]
async fn main() {
    // The account, served where a separate process can reach it.
    let served = Emulator::serve_localhost(0, EmulatorOptions::default())
        .await
        .unwrap();
    let endpoint = served.endpoint.clone();
    let client = ConnectionArgs::emulator(&endpoint).connect().await.unwrap();
    let (queue, _) = provision(&client, &QueueConfig::new("bench", "orders"))
        .await
        .unwrap();

    // The trivial app: answers 200 at once, remembers when each message arrived.
    let received: Received = Arc::default();
    let app_port = free_port();
    let seen = Arc::clone(&received);
    let app = axum::Router::new().route(
        "/",
        axum::routing::post(move |headers: axum::http::HeaderMap| {
            let seen = Arc::clone(&seen);
            async move {
                let id = headers
                    .get("cosmosq-message-id")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                seen.lock().unwrap().entry(id).or_insert_with(Instant::now);
                ""
            }
        }),
    );
    let app_listener = tokio::net::TcpListener::bind(("127.0.0.1", app_port))
        .await
        .unwrap();
    tokio::spawn(async move { axum::serve(app_listener, app).await });

    // The sidecar, as it runs in a pod.
    let api_port = free_port();
    let mut sidecar = start_sidecar(
        &endpoint,
        "workers",
        api_port,
        &[("COSMOSQ_APP_PORT", &app_port.to_string())],
    )
    .await;
    let pid = sidecar.id();
    tokio::time::sleep(Duration::from_secs(2)).await; // leases taken, feed idle
    let idle_rss = rss_kib(pid).unwrap_or(0);

    // Throughput: a burst, from the first enqueue to the last delivery.
    let started = Instant::now();
    let cpu_before = cpu_seconds(pid).unwrap_or(0.0);
    let burst: Vec<_> = (0..THROUGHPUT_MESSAGES)
        .map(|i| {
            NewMessage::json(json!({"i": i}))
                .with_id(format!("t{i}"))
                .with_partition_key(format!("k{}", i % 64))
        })
        .collect();
    for chunk in burst.chunks(500) {
        for r in queue.enqueue_batch(chunk.to_vec()).await {
            r.unwrap();
        }
    }
    let mut peak_rss = idle_rss;
    wait_for(&received, THROUGHPUT_MESSAGES, &mut peak_rss, pid).await;
    let burst_seconds = started.elapsed().as_secs_f64();
    let burst_cpu = cpu_seconds(pid).unwrap_or(0.0) - cpu_before;

    // Light load: one message every 10 ms; latency from the enqueue call's return.
    let mut sent = HashMap::new();
    for i in 0..LIGHT_LOAD_MESSAGES {
        let id = format!("l{i}");
        queue
            .enqueue(NewMessage::json(json!({"i": i})).with_id(id.clone()))
            .await
            .unwrap();
        sent.insert(id, Instant::now());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    wait_for(
        &received,
        THROUGHPUT_MESSAGES + LIGHT_LOAD_MESSAGES,
        &mut peak_rss,
        pid,
    )
    .await;
    let got = received.lock().unwrap().clone();
    let mut latencies: Vec<f64> = sent
        .iter()
        .map(|(id, at)| got[id].saturating_duration_since(*at).as_secs_f64() * 1000.0)
        .collect();
    latencies.sort_by(f64::total_cmp);

    // SIGTERM: the sidecar drains and exits 0.
    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let status = sidecar.wait().unwrap();

    println!("cosmosq sidecar, one process, emulator over localhost HTTP, trivial app\n");
    println!(
        "throughput       {:>8.0} msg/s ({THROUGHPUT_MESSAGES} messages, enqueue to last delivery)",
        THROUGHPUT_MESSAGES as f64 / burst_seconds
    );
    println!(
        "sidecar CPU      {:>8.1} ms per 1,000 messages of the burst (user + system)",
        burst_cpu * 1000.0 / (THROUGHPUT_MESSAGES as f64 / 1000.0)
    );
    println!(
        "latency p50      {:>8.1} ms   (enqueue→delivery, 1 message / 10 ms)",
        percentile(&latencies, 0.5)
    );
    println!("latency p99      {:>8.1} ms", percentile(&latencies, 0.99));
    println!(
        "resident memory  {:>8.1} MiB idle, {:.1} MiB peak under load",
        idle_rss as f64 / 1024.0,
        peak_rss as f64 / 1024.0
    );
    println!("exit on SIGTERM  {status}");

    // Pull workers: another group takes every message so far, receiving and settling in
    // batches of 32 through its own sidecar (no app port: the workers come to it).
    let total = THROUGHPUT_MESSAGES + LIGHT_LOAD_MESSAGES;
    let pull_port = free_port();
    let started = Instant::now();
    let mut puller = start_sidecar(
        &endpoint,
        "pullers",
        pull_port,
        &[("COSMOSQ_APP_MODE", "pull")],
    )
    .await;
    let settled = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let workers: Vec<_> = (0..PULL_WORKERS)
        .map(|_| tokio::spawn(pull_worker(pull_port, Arc::clone(&settled), total)))
        .collect();
    let mut pull_peak = 0;
    let deadline = Instant::now() + Duration::from_secs(300);
    while settled.load(std::sync::atomic::Ordering::Relaxed) < total {
        assert!(
            Instant::now() < deadline,
            "the pull workers did not finish in time"
        );
        pull_peak = pull_peak.max(rss_kib(puller.id()).unwrap_or(0));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let pull_seconds = started.elapsed().as_secs_f64();
    for worker in workers {
        worker.await.unwrap();
    }
    let _ = Command::new("kill")
        .args(["-TERM", &puller.id().to_string()])
        .status();
    let pull_status = puller.wait().unwrap();
    println!(
        "pull throughput  {:>8.0} msg/s ({total} messages, {PULL_WORKERS} workers receiving 32 and settling the batch; from the sidecar's start)",
        total as f64 / pull_seconds
    );
    println!(
        "pull memory      {:>8.1} MiB peak",
        pull_peak as f64 / 1024.0
    );
    println!("pull exit        {pull_status}");
    served.stop.cancel();
}

/// Pull workers side by side.
const PULL_WORKERS: usize = 4;

/// Starts the sidecar binary for `group` against the served emulator and waits until it is
/// ready.
async fn start_sidecar(endpoint: &str, group: &str, api_port: u16, env: &[(&str, &str)]) -> Child {
    // Another build of the binary (another profile, the image's musl build) when named.
    let binary = std::env::var("COSMOSQ_BENCH_SIDECAR")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_cosmosq-sidecar").to_owned());
    let grpc_listen = format!("127.0.0.1:{}", free_port());
    let child = Command::new(binary)
        .envs([
            ("COSMOSQ_ENDPOINT", endpoint),
            ("COSMOSQ_AUTH", "emulator"),
            ("COSMOSQ_DATABASE", "bench"),
            ("COSMOSQ_QUEUE", "orders"),
            ("COSMOSQ_GROUP", group),
            ("COSMOSQ_START_FROM", "beginning"),
            ("COSMOSQ_LISTEN", &format!("127.0.0.1:{api_port}")),
            ("COSMOSQ_PROBE_LISTEN", ""),
            // Dapr's gRPC API served, as in a pod (its memory is the sidecar's).
            ("COSMOSQ_GRPC_LISTEN", &grpc_listen),
            ("COSMOSQ_MAX_CONCURRENCY", "64"),
            ("COSMOSQ_LEASE_ACQUIRE", "500ms"),
            ("POD_NAME", &format!("{group}-0")),
            ("RUST_LOG", "warn"),
            // As the image sets it (sidecar/Dockerfile), also when the bench binary is run
            // without cargo's environment (.cargo/config.toml): with a backtrace captured for
            // each error value the SDK makes, unwinding at startup left 0.7 MiB of unwind
            // tables resident in the idle figure.
            ("RUST_LIB_BACKTRACE", "0"),
        ])
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the sidecar binary starts");
    let http = cosmosq_queue::cosmos::tls::http_client_builder()
        .build()
        .expect("an HTTP client");
    let ready_deadline = Instant::now() + Duration::from_secs(60);
    while !http
        .get(format!("http://127.0.0.1:{api_port}/readyz"))
        .send()
        .await
        .is_ok_and(|r| r.status() == 200)
    {
        assert!(
            Instant::now() < ready_deadline,
            "the sidecar never became ready"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    child
}

/// Receives up to 32, settles them all in one call, until `total` are settled by all.
async fn pull_worker(port: u16, settled: Arc<std::sync::atomic::AtomicUsize>, total: usize) {
    use std::sync::atomic::Ordering;
    let http = cosmosq_queue::cosmos::tls::http_client_builder()
        .build()
        .expect("an HTTP client");
    let api = format!("http://127.0.0.1:{port}");
    while settled.load(Ordering::Relaxed) < total {
        let answer = http
            .post(format!("{api}/v1/receive?max=32&wait=1s"))
            .send()
            .await
            .expect("receive")
            .text()
            .await
            .expect("a receive answer");
        let answer: serde_json::Value = serde_json::from_str(&answer).expect("JSON");
        let batch: Vec<serde_json::Value> = answer["messages"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|m| json!({"lockToken": m["lockToken"], "action": "complete"}))
            .collect();
        if batch.is_empty() {
            continue;
        }
        let results = http
            .post(format!("{api}/v1/settle"))
            .header("content-type", "application/json")
            .body(serde_json::Value::from(batch.clone()).to_string())
            .send()
            .await
            .expect("settle")
            .text()
            .await
            .expect("a settle answer");
        let results: serde_json::Value = serde_json::from_str(&results).expect("JSON");
        let done = results["results"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|r| r["settled"] == true)
            .count();
        assert_eq!(done, batch.len(), "every lock held: {results}");
        settled.fetch_add(done, Ordering::Relaxed);
    }
}
