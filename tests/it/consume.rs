//! Hosts of the lease loop running concurrently against the emulator: exclusivity while
//! leases move between hosts, recovery from a dead host, stream mode, pull. (Bad input and
//! throttling are the fault suite's, with its full ledger.)

use std::sync::Arc;
use std::time::Duration;

use cosmosq_emulator::EmulatorOptions;
use cosmosq_queue::host::{Host, HostOptions};
use cosmosq_queue::{
    Clock, ConsumerStats, Delivery, DeliveryMode, GroupConfig, Handler, NewMessage, Outcome,
    QueueConfig, StartFrom,
};
use cosmosq_tests::{fast_host, Fixture, Ledger};
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// The sweep (a scan of state documents on the emulator) only as often as the test needs
/// recovery.
const RARE_SWEEP: Duration = Duration::from_secs(2);
const FAST_SWEEP: Duration = Duration::from_millis(100);

/// A host of `group` named `owner`, running until `shutdown`; its counters when it stopped.
fn spawn_host<H: Handler>(
    fixture: &Fixture,
    group: GroupConfig,
    owner: String,
    sweep: Duration,
    handler: H,
    shutdown: &CancellationToken,
) -> tokio::task::JoinHandle<Arc<ConsumerStats>> {
    let options = HostOptions {
        sweep_interval: sweep,
        ..fast_host(&owner)
    };
    let host = Host::new(fixture.group(group), handler, options);
    let stats = host.stats();
    let shutdown = shutdown.clone();
    tokio::spawn(async move {
        host.run(shutdown).await.expect("the host runs");
        stats
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_hosts_two_groups_each_message_completed_once_per_group() {
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

    let ledger = Ledger::new();
    let shutdown = CancellationToken::new();
    let mut hosts = Vec::new();
    for group in ["billing", "audit"] {
        for host in 0..8 {
            let config = GroupConfig::new(group).with_start_from(StartFrom::Beginning);
            hosts.push(spawn_host(
                &fixture,
                config,
                format!("{group}-{host}"),
                RARE_SWEEP,
                ledger.completing(),
                &shutdown,
            ));
        }
    }
    ledger
        .wait_until(|l| l.delivered("billing") == MESSAGES && l.delivered("audit") == MESSAGES)
        .await;
    shutdown.cancel();
    let mut completed = 0;
    for c in hosts {
        completed += ConsumerStats::get(&c.await.unwrap().completed);
    }
    assert_eq!(
        completed as usize,
        2 * MESSAGES,
        "every delivery was recorded as complete"
    );
    for group in ["billing", "audit"] {
        ledger.assert_each_once(group);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_hosts_messages_come_back_with_delivery_count_two() {
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
    // Fewer than the host's concurrency, so the hung host takes them all.
    const MESSAGES: usize = 12;
    for i in 0..MESSAGES {
        fixture
            .queue
            .enqueue(NewMessage::json(json!(i)).with_id(format!("m{i}")))
            .await
            .unwrap();
    }
    // The first host claims everything and hangs: it never settles, like a killed pod. It
    // keeps its leases (it is aborted, not stopped): the second host takes them when they
    // expire, and the messages when their locks do.
    let hung = Ledger::new();
    let shutdown_dead = CancellationToken::new();
    let dead = {
        let hung = Arc::clone(&hung);
        spawn_host(
            &fixture,
            config.clone(),
            "dead".into(),
            RARE_SWEEP,
            move |d: Delivery| {
                let hung = Arc::clone(&hung);
                async move {
                    let _in_app = hung.begin(&d);
                    std::future::pending::<Outcome>().await
                }
            },
            &shutdown_dead,
        )
    };
    hung.wait_until(|l| l.delivered("g") == MESSAGES).await;
    // On the lease write path a start is listed with the range's next lease write (within
    // `checkpointInterval`): the host dies once its leases list every start, so each comes
    // back as a redelivery. (A start not listed yet comes back with the same count: the
    // simulation checks that one.)
    let store = cosmosq_queue::lease::LeaseStore::new(fixture.queue.clone(), "g");
    loop {
        let leases = store.list().await.unwrap();
        let started: usize = leases.iter().map(|l| l.window.started.len()).sum();
        if started == MESSAGES {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    dead.abort();

    let ledger = Ledger::new();
    let shutdown = CancellationToken::new();
    let alive = spawn_host(
        &fixture,
        config,
        "alive".into(),
        FAST_SWEEP,
        ledger.completing(),
        &shutdown,
    );
    // The lock duration passes (and the dead host's lease expiry): everything is recovered.
    clock.advance(Duration::from_secs(31));
    ledger.wait_until(|l| l.delivered("g") == MESSAGES).await;
    shutdown.cancel();
    alive.await.unwrap();
    let records = ledger.records("g");
    assert!(
        records.values().all(|r| r.delivery_counts == vec![2]),
        "{records:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_host_retries_failures_and_dead_letters_drops() {
    let fixture = Fixture::new(2).await;
    for i in 0..100 {
        fixture
            .queue
            .enqueue(NewMessage::json(json!(i)).with_id(format!("m{i}")))
            .await
            .unwrap();
    }
    let before = fixture.queue.charges().snapshot();
    let ledger = Ledger::new();
    let shutdown = CancellationToken::new();
    let handler = ledger.handler(|d: Delivery| async move {
        match (d.message.id.as_str(), d.delivery_count) {
            ("m7", 1) => Outcome::Retry {
                reason: "busy".into(),
                delay: Some(Duration::from_millis(1)),
            },
            ("m9", _) => Outcome::DeadLetter {
                reason: "Dropped".into(),
                description: "app said DROP".into(),
            },
            _ => Outcome::Complete,
        }
    });
    let config = GroupConfig::new("s")
        .with_mode(DeliveryMode::Stream)
        .with_start_from(StartFrom::Beginning);
    let running = spawn_host(
        &fixture,
        config.clone(),
        "h".into(),
        FAST_SWEEP,
        handler,
        &shutdown,
    );
    ledger
        .wait_until(|l| l.delivered("s") == 100 && l.record("s", "m7").delivery_counts.len() == 2)
        .await;
    shutdown.cancel();
    let stats = running.await.unwrap();
    assert_eq!(ConsumerStats::get(&stats.completed), 99);
    assert_eq!(ConsumerStats::get(&stats.dead_lettered), 1);
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

/// A pull consumer that stops while messages wait for a worker gives them back at once,
/// without counting a delivery (nobody saw them), in both write paths and stream mode: the
/// next consumer receives each as its first delivery, and the stop did not wait out a lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_consumer_stopping_gives_back_what_no_worker_received() {
    use cosmosq_queue::pull::{pull, Verdict};
    for (name, config) in [
        ("lease", GroupConfig::new("pull-lease")),
        (
            "claims",
            GroupConfig::new("pull-claims")
                .with_exclusive_writes(cosmosq_queue::ExclusiveWrites::Claims),
        ),
        (
            "stream",
            GroupConfig::new("pull-stream").with_mode(DeliveryMode::Stream),
        ),
    ] {
        let fixture = Fixture::new(1).await;
        let config = config
            .with_start_from(StartFrom::Beginning)
            .with_lock_duration(Duration::from_secs(300));
        fixture
            .enqueue_all(
                (0..3)
                    .map(|i| NewMessage::json(json!({"i": i})).with_id(format!("m{i}")))
                    .collect(),
            )
            .await;
        let stop = CancellationToken::new();
        let (handler, puller) = pull();
        let first = spawn_host(
            &fixture,
            config.clone(),
            "first".into(),
            FAST_SWEEP,
            handler.stopping_with(stop.clone()),
            &stop,
        );
        cosmosq_tests::eventually(
            &format!("{name}: the messages wait for a worker"),
            Duration::from_secs(30),
            || async { puller.counts().0 == 3 },
        )
        .await;
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(30), first)
            .await
            .unwrap_or_else(|_| panic!("{name}: the stop waited for a worker or a lock"))
            .unwrap();

        let again = CancellationToken::new();
        let (handler, puller) = pull();
        let second = spawn_host(
            &fixture,
            config,
            "second".into(),
            FAST_SWEEP,
            handler,
            &again,
        );
        let mut seen = Vec::new();
        while seen.len() < 3 {
            for r in puller
                .receive(3, Duration::from_secs(30), Duration::from_secs(30))
                .await
            {
                seen.push((r.delivery.message.id.clone(), r.delivery.delivery_count));
                puller.settle(&r.lock_token, Verdict::Complete).unwrap();
            }
        }
        seen.sort();
        assert_eq!(
            seen,
            [("m0".into(), 1), ("m1".into(), 1), ("m2".into(), 1)],
            "{name}: no delivery counted for what nobody received"
        );
        again.cancel();
        second.await.unwrap();
    }
}
