//! The console at scale: 100 queues of 5 groups each (500 groups) on the in-process emulator.
//! Prints how long the sampler's first round over all of them takes, then the time to load the
//! overview, a group page and the JSON snapshot over HTTP (p50 / p99 of 50 loads each) while
//! the sampler keeps reading. The brief's target: a page in ≤ 200 ms at this size.
//!
//! `cargo bench -p cosmosq-console --bench console`

use std::time::{Duration, Instant};

use cosmosq_console::{Console, ConsoleOptions};
use cosmosq_emulator::{Emulator, EmulatorOptions};
use cosmosq_queue::lease::LeaseStore;
use cosmosq_queue::{provision, NewMessage, QueueConfig};
use tokio_util::sync::CancellationToken;

const QUEUES: usize = 100;
const GROUPS: usize = 5;
const LOADS: usize = 50;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

async fn load(http: &reqwest::Client, url: &str) -> Duration {
    let started = Instant::now();
    let answer = http.get(url).send().await.expect("request");
    assert!(answer.status().is_success(), "{url}: {}", answer.status());
    answer.bytes().await.expect("body");
    started.elapsed()
}

/// Groups in the console's last round.
async fn groups_seen(http: &reqwest::Client, base: &str) -> usize {
    let body = http
        .get(format!("{base}/api/snapshot"))
        .send()
        .await
        .expect("snapshot")
        .bytes()
        .await
        .expect("body");
    let snapshot: serde_json::Value = serde_json::from_slice(&body).expect("json");
    snapshot["queues"]
        .as_array()
        .map(|q| {
            q.iter()
                .map(|q| q["groups"].as_array().map_or(0, Vec::len))
                .sum()
        })
        .unwrap_or(0)
}

#[tokio::main]
async fn main() {
    let emulator = Emulator::in_process(EmulatorOptions {
        partitions: 1,
        ..Default::default()
    })
    .expect("emulator");
    let client = emulator.client().await.expect("client");
    let set_up = Instant::now();
    for q in 0..QUEUES {
        let (queue, _) = provision(&client, &QueueConfig::new("bench", format!("queue-{q:03}")))
            .await
            .expect("provision");
        queue
            .enqueue(NewMessage::json(serde_json::json!({"n": q})))
            .await
            .expect("enqueue");
        for g in 0..GROUPS {
            LeaseStore::new(queue.clone(), format!("group-{g}"))
                .reconcile(cosmosq_queue::clock::system_now_ms(), 60_000)
                .await
                .expect("leases");
        }
    }
    println!(
        "{QUEUES} queues x {GROUPS} groups set up in {:.1}s",
        set_up.elapsed().as_secs_f64()
    );

    let options = ConsoleOptions {
        sample_every: Duration::from_secs(1),
        ..ConsoleOptions::default()
    };
    let console = Console::bind(client, "bench", vec![], options, ([127, 0, 0, 1], 0).into())
        .await
        .expect("bind");
    let base = format!("http://localhost:{}", console.local_addr().port());
    let cancel = CancellationToken::new();
    let started = Instant::now();
    let served = tokio::spawn(console.run(cancel.clone()));
    let http = cosmosq_queue::cosmos::tls::http_client_builder()
        .build()
        .expect("an HTTP client");
    // Polled: the bench has no event for the end of the sampler's first round.
    while groups_seen(&http, &base).await < QUEUES * GROUPS {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "first round over {} groups: {:.1}s",
        QUEUES * GROUPS,
        started.elapsed().as_secs_f64()
    );

    println!("{:<28} {:>9} {:>9}", "page", "p50", "p99");
    for (name, url) in [
        ("overview /", format!("{base}/")),
        (
            "group page",
            format!("{base}/queues/queue-050/groups/group-2"),
        ),
        ("snapshot /api/snapshot", format!("{base}/api/snapshot")),
    ] {
        let mut times = Vec::with_capacity(LOADS);
        for _ in 0..LOADS {
            times.push(load(&http, &url).await);
        }
        times.sort();
        println!(
            "{name:<28} {:>7.1}ms {:>7.1}ms",
            percentile(&times, 0.5).as_secs_f64() * 1000.0,
            percentile(&times, 0.99).as_secs_f64() * 1000.0
        );
    }
    cancel.cancel();
    served.await.expect("join").expect("served");
    full_window();
}

/// The overview of the same 500 groups with an hour of history each (a sample every 5 s:
/// 720 per group), rendered as the server renders it: the page's cost once the console has
/// run for an hour.
fn full_window() {
    use cosmosq_console::history::{History, Sample};
    use cosmosq_console::watch::{GroupView, QueueView, RangeView, Snapshot};
    let now = cosmosq_queue::clock::system_now_ms();
    let mut history = History::new(3_600_000);
    let mut queues = Vec::new();
    for q in 0..QUEUES {
        let name = format!("queue-{q:03}");
        let mut groups = Vec::new();
        for g in 0..GROUPS {
            let group = format!("group-{g}");
            for i in 0..720_i64 {
                history.push(
                    &name,
                    &group,
                    Sample {
                        at_ms: now - 3_600_000 + i * 5_000,
                        backlog: ((i * 37 + g as i64 * 11) % 1000) as u64,
                        ..Sample::default()
                    },
                );
            }
            groups.push(GroupView {
                queue: name.clone(),
                name: group,
                backlog: 500,
                ranges: vec![RangeView {
                    owner: Some("pod".into()),
                    ..RangeView::default()
                }],
                ..GroupView::default()
            });
        }
        queues.push(QueueView {
            namespace: None,
            name,
            groups,
            error: None,
        });
    }
    let snapshot = Snapshot {
        at_ms: now,
        queues,
        error: None,
    };
    let mut times = Vec::with_capacity(LOADS);
    let mut size = 0;
    for _ in 0..LOADS {
        let started = Instant::now();
        size = cosmosq_console::overview_html(&snapshot, &history, now).len();
        times.push(started.elapsed());
    }
    times.sort();
    println!(
        "{:<28} {:>7.1}ms {:>7.1}ms  ({} KiB, an hour of history per group, rendered only)",
        "overview, full hour",
        percentile(&times, 0.5).as_secs_f64() * 1000.0,
        percentile(&times, 0.99).as_secs_f64() * 1000.0,
        size / 1024
    );
}
