//! End-to-end figures for one sidecar process: throughput to a trivial app, enqueue→delivery
//! latency at light load, and the sidecar's resident memory idle and under load.
//!
//! `cargo bench -p cosmosq-sidecar --bench e2e` — the emulator is served over HTTP on
//! localhost in this process, the sidecar is the real binary in a child process, the app is a
//! trivial HTTP server in this process.

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
    cosmosq_queue::measure::percentile(sorted, p).unwrap_or(f64::NAN)
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
    let mut sidecar: Child = Command::new(env!("CARGO_BIN_EXE_cosmosq-sidecar"))
        .envs([
            ("COSMOSQ_ENDPOINT", endpoint.as_str()),
            ("COSMOSQ_AUTH", "emulator"),
            ("COSMOSQ_DATABASE", "bench"),
            ("COSMOSQ_QUEUE", "orders"),
            ("COSMOSQ_GROUP", "workers"),
            ("COSMOSQ_START_FROM", "beginning"),
            ("COSMOSQ_APP_PORT", &app_port.to_string()),
            ("COSMOSQ_LISTEN", &format!("127.0.0.1:{api_port}")),
            ("COSMOSQ_PROBE_LISTEN", ""),
            ("COSMOSQ_MAX_CONCURRENCY", "64"),
            ("COSMOSQ_LEASE_ACQUIRE", "500ms"),
            ("POD_NAME", "bench-0"),
            ("RUST_LOG", "warn"),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the sidecar binary starts");
    let pid = sidecar.id();
    let http = reqwest::Client::new();
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
    tokio::time::sleep(Duration::from_secs(2)).await; // leases taken, feed idle
    let idle_rss = rss_kib(pid).unwrap_or(0);

    // Throughput: a burst, from the first enqueue to the last delivery.
    let started = Instant::now();
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
    served.stop.cancel();
}
