//! Consumers running concurrently against the emulator: exclusivity, recovery, bad input, throttling.

use std::sync::Arc;
use std::time::Duration;

use cosmosq_emulator::EmulatorOptions;
use cosmosq_queue::{
    Clock, Consumer, ConsumerOptions, Delivery, DeliveryMode, GroupConfig, NewMessage, Outcome,
    QueueConfig, StartFrom, Throughput,
};
use cosmosq_tests::{recording, Fixture, Ledger};
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// Fast polling; the sweep (a scan of state documents on the emulator) only as often as the
/// test needs recovery.
fn options(holder: String, sweep_interval: Duration) -> ConsumerOptions {
    ConsumerOptions {
        min_poll: Duration::from_millis(5),
        max_poll: Duration::from_millis(100),
        sweep_interval,
        ..ConsumerOptions::new(holder)
    }
}

const RARE_SWEEP: Duration = Duration::from_secs(2);
const FAST_SWEEP: Duration = Duration::from_millis(100);

fn spawn_consumer<F, Fut>(
    fixture: &Fixture,
    group: GroupConfig,
    holder: String,
    sweep: Duration,
    handler: F,
    shutdown: &CancellationToken,
) -> tokio::task::JoinHandle<Arc<cosmosq_queue::ConsumerStats>>
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Outcome> + Send + 'static,
{
    let consumer = Consumer::new(fixture.group(group), handler, options(holder, sweep));
    let stats = consumer.stats();
    let shutdown = shutdown.clone();
    tokio::spawn(async move {
        consumer.run(shutdown).await.expect("consumer runs");
        stats
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_claimers_two_groups_each_message_completed_once_per_group() {
    const MESSAGES: usize = 2_000;
    let fixture = Fixture::new(4).await;
    let batch: Vec<_> = (0..MESSAGES)
        .map(|i| {
            NewMessage::json(json!({"i": i}))
                .with_id(format!("m{i}"))
                .with_partition_key(format!("k{}", i % 50))
        })
        .collect();
    fixture.enqueue_all(batch).await;

    let ledger = Arc::new(Ledger::default());
    let shutdown = CancellationToken::new();
    let mut consumers = Vec::new();
    for group in ["billing", "audit"] {
        for host in 0..8 {
            let config = GroupConfig::new(group).with_start_from(StartFrom::Beginning);
            consumers.push(spawn_consumer(
                &fixture,
                config,
                format!("{group}-{host}"),
                RARE_SWEEP,
                recording(&ledger),
                &shutdown,
            ));
        }
    }
    ledger
        .wait_until(|l| l.delivered("billing") == MESSAGES && l.delivered("audit") == MESSAGES)
        .await;
    shutdown.cancel();
    let mut completed = 0;
    for c in consumers {
        completed += cosmosq_queue::ConsumerStats::get(&c.await.unwrap().completed);
    }
    assert_eq!(
        completed as usize,
        2 * MESSAGES,
        "every delivery was recorded as complete"
    );
    assert!(
        ledger.overlaps.lock().unwrap().is_empty(),
        "held by two at once: {:?}",
        ledger.overlaps.lock().unwrap()
    );
    for group in ["billing", "audit"] {
        ledger.assert_each_once(group);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_consumers_messages_come_back_with_delivery_count_two() {
    let clock = Clock::manual(cosmosq_queue::clock::system_now_ms());
    let fixture = Fixture::with(
        EmulatorOptions::default(),
        QueueConfig::new("db", "q"),
        clock.clone(),
    )
    .await;
    let config = GroupConfig::new("g")
        .with_start_from(StartFrom::Beginning)
        .with_lock_duration(Duration::from_secs(30));
    // Fewer than the consumer's concurrency, so the hung consumer takes them all.
    const MESSAGES: usize = 12;
    for i in 0..MESSAGES {
        fixture
            .queue
            .enqueue(NewMessage::json(json!(i)).with_id(format!("m{i}")))
            .await
            .unwrap();
    }
    // The first consumer claims everything and hangs: it never settles, like a killed pod.
    let hung = Arc::new(Ledger::default());
    let shutdown_dead = CancellationToken::new();
    let dead = {
        let hung = Arc::clone(&hung);
        spawn_consumer(
            &fixture,
            config.clone(),
            "dead".into(),
            RARE_SWEEP,
            move |d: Delivery| {
                let hung = Arc::clone(&hung);
                async move {
                    hung.begin(&d);
                    hung.done.notify_waiters();
                    std::future::pending::<Outcome>().await
                }
            },
            &shutdown_dead,
        )
    };
    hung.wait_until(|l| l.delivered("g") == MESSAGES).await;
    dead.abort();

    let ledger = Arc::new(Ledger::default());
    let shutdown = CancellationToken::new();
    let alive = spawn_consumer(
        &fixture,
        config,
        "alive".into(),
        FAST_SWEEP,
        recording(&ledger),
        &shutdown,
    );
    // Lock duration passes; the next sweep recovers everything.
    clock.advance(Duration::from_secs(31));
    ledger.wait_until(|l| l.delivered("g") == MESSAGES).await;
    shutdown.cancel();
    alive.await.unwrap();
    let deliveries = ledger.deliveries.lock().unwrap();
    assert!(
        deliveries.values().all(|counts| counts == &vec![2]),
        "{deliveries:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_documents_are_skipped_with_a_reason_not_a_crash() {
    let fixture = Fixture::new(2).await;
    let messages = fixture.queue.messages();
    for (id, doc) in [
        (
            "no-body",
            json!({"id": "no-body", "pk": "x", "enqueuedAt": 1}),
        ),
        ("no-time", json!({"id": "no-time", "pk": "x", "body": 1})),
        (
            "bad-b64",
            json!({"id": "bad-b64", "pk": "x", "bodyBase64": "@@", "enqueuedAt": 1}),
        ),
    ] {
        messages.create_item("x", id, doc, None).await.unwrap();
    }
    for i in 0..10 {
        fixture
            .queue
            .enqueue(NewMessage::json(json!(i)))
            .await
            .unwrap();
    }
    let ledger = Arc::new(Ledger::default());
    let shutdown = CancellationToken::new();
    let consumer = spawn_consumer(
        &fixture,
        GroupConfig::new("g").with_start_from(StartFrom::Beginning),
        "h".into(),
        RARE_SWEEP,
        recording(&ledger),
        &shutdown,
    );
    ledger.wait_until(|l| l.delivered("g") == 10).await;
    shutdown.cancel();
    let stats = consumer.await.unwrap();
    assert_eq!(cosmosq_queue::ConsumerStats::get(&stats.malformed), 3);
    assert_eq!(cosmosq_queue::ConsumerStats::get(&stats.completed), 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttled_account_loses_nothing() {
    let mut config = QueueConfig::new("db", "q");
    config.throughput = Some(Throughput::Manual(400));
    let fixture = Fixture::with(
        EmulatorOptions {
            partitions: 1,
            throughput: Some(400),
            ..Default::default()
        },
        config,
        Clock::system(),
    )
    .await;
    const MESSAGES: usize = 300;
    let enqueues = (0..MESSAGES).map(|i| {
        let q = fixture.queue.clone();
        async move {
            q.enqueue(
                NewMessage::json(json!({"i": i, "pad": "p".repeat(200)})).with_id(format!("m{i}")),
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

    let ledger = Arc::new(Ledger::default());
    let shutdown = CancellationToken::new();
    let mut consumers = Vec::new();
    for host in 0..4 {
        consumers.push(spawn_consumer(
            &fixture,
            GroupConfig::new("g").with_start_from(StartFrom::Beginning),
            format!("h{host}"),
            RARE_SWEEP,
            recording(&ledger),
            &shutdown,
        ));
    }
    ledger.wait_until(|l| l.delivered("g") == MESSAGES).await;
    shutdown.cancel();
    for c in consumers {
        c.await.unwrap();
    }
    ledger.assert_each_once("g");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_consumer_retries_failures_and_dead_letters_drops() {
    let fixture = Fixture::new(2).await;
    for i in 0..100 {
        fixture
            .queue
            .enqueue(NewMessage::json(json!(i)).with_id(format!("m{i}")))
            .await
            .unwrap();
    }
    let before = fixture.queue.charges().snapshot();
    let ledger = Arc::new(Ledger::default());
    let shutdown = CancellationToken::new();
    let handler = {
        let ledger = Arc::clone(&ledger);
        move |d: Delivery| {
            let ledger = Arc::clone(&ledger);
            async move {
                ledger.begin(&d);
                ledger.end(&d);
                match (d.message.id.as_str(), d.delivery_count) {
                    ("m7", 1) => Outcome::Retry {
                        error: "busy".into(),
                        delay: Some(Duration::from_millis(1)),
                    },
                    ("m9", _) => Outcome::DeadLetter {
                        reason: "Dropped".into(),
                        error: "app said DROP".into(),
                    },
                    _ => Outcome::Complete,
                }
            }
        }
    };
    let config = GroupConfig::new("s")
        .with_mode(DeliveryMode::Stream)
        .with_start_from(StartFrom::Beginning);
    let consumer = spawn_consumer(
        &fixture,
        config.clone(),
        "h".into(),
        FAST_SWEEP,
        handler,
        &shutdown,
    );
    ledger
        .wait_until(|l| {
            l.delivered("s") == 100
                && l.deliveries.lock().unwrap()[&("s".to_string(), "m7".to_string())].len() == 2
        })
        .await;
    shutdown.cancel();
    let stats = consumer.await.unwrap();
    assert_eq!(cosmosq_queue::ConsumerStats::get(&stats.completed), 99);
    assert_eq!(cosmosq_queue::ConsumerStats::get(&stats.dead_lettered), 1);
    let dead = fixture.group(config).dead_letters(None).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].message_id, "m9");
    // Writes happened only for the two messages that failed.
    let spent = fixture.queue.charges().snapshot().since(&before);
    let writes: u64 = ["claim", "complete", "retry", "dead-letter"]
        .iter()
        .filter_map(|op| spent.by_operation.get(op))
        .map(|c| c.calls)
        .sum();
    assert_eq!(
        writes, 4,
        "retry m7, claim m7, complete m7, dead-letter m9: {spent:?}"
    );
}
