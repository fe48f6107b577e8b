//! Ordered groups under failures: a key's next message waits for the one before it to have an
//! outcome, across outages, dead owners, schedules and drains.

use std::sync::Arc;
use std::time::Duration;

use cosmosq_queue::host::{Host, HostOptions};
use cosmosq_queue::{
    Delivery, DeliveryMode, GroupConfig, MessageState, NewMessage, Outcome, QueueConfig, StartFrom,
};
use cosmosq_tests::{fast_host, Fixture, Ledger};
use serde_json::json;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ordered_keys_next_message_waits_while_a_failed_retry_cannot_be_recorded() {
    use cosmosq_emulator::fault_injection::FaultOperationType as Op;
    for mode in [DeliveryMode::Exclusive, DeliveryMode::Stream] {
        let fixture = Fixture::new(1).await;
        for id in ["m1", "m2"] {
            fixture
                .queue
                .enqueue(
                    NewMessage::json(json!(id))
                        .with_id(id)
                        .with_partition_key("k"),
                )
                .await
                .unwrap();
        }
        // The retry of m1 (a replace of its state in exclusive mode, a create in stream mode)
        // meets a second of 503s; before the fix the key's task ended there and m2 overtook.
        let rules = vec![outage(Op::ReplaceItem), outage(Op::CreateItem)];
        let client = fixture
            .emulator
            .client_with_faults(rules.clone())
            .await
            .unwrap();
        let queue = cosmosq_queue::Queue::open(&client, QueueConfig::new("db", "q"))
            .await
            .unwrap();
        let config = GroupConfig::new("g")
            .with_mode(mode)
            .with_start_from(StartFrom::Beginning)
            .with_ordering(true)
            .with_lock_duration(Duration::from_secs(3))
            .with_retry(cosmosq_queue::RetryPolicy {
                initial_backoff: Duration::from_millis(20),
                ..Default::default()
            });
        let ledger = Ledger::new();
        let handler = {
            let rules = rules.clone();
            ledger.handler(move |d: Delivery| {
                let rules = rules.clone();
                async move {
                    if d.message.id == "m1" && d.delivery_count == 1 {
                        rules.iter().for_each(|r| r.enable());
                        tokio::spawn(async move {
                            tokio::time::sleep(Duration::from_secs(1)).await;
                            rules.iter().for_each(|r| r.disable());
                        });
                        return Outcome::Retry {
                            reason: "not yet".into(),
                            delay: None,
                        };
                    }
                    Outcome::Complete
                }
            })
        };
        let options = HostOptions {
            lease_expire: Duration::from_secs(10),
            ..fast_host("h")
        };
        let host = Host::new(queue.group(config).unwrap(), handler, options);
        let stop = CancellationToken::new();
        let task = tokio::spawn(host.run(stop.clone()));
        ledger.wait_until(|l| l.completed("g") >= 2).await;
        stop.cancel();
        task.await.unwrap().unwrap();
        assert!(
            rules.iter().any(|r| r.hit_count() > 0),
            "{mode:?}: the outage was met"
        );
        let completed: Vec<String> = ledger
            .completed_order("g")
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        assert_eq!(completed, vec!["m1", "m2"], "{mode:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ordered_stream_range_taken_from_a_dead_owner_waits_for_the_message_it_was_retrying() {
    let fixture = Fixture::new(1).await;
    for id in ["m1", "m2"] {
        fixture
            .queue
            .enqueue(
                NewMessage::json(json!(id))
                    .with_id(id)
                    .with_partition_key("k"),
            )
            .await
            .unwrap();
    }
    let config = GroupConfig::new("g")
        .with_mode(DeliveryMode::Stream)
        .with_start_from(StartFrom::Beginning)
        .with_ordering(true)
        .with_lock_duration(Duration::from_secs(2))
        .with_retry(cosmosq_queue::RetryPolicy {
            initial_backoff: Duration::from_millis(10),
            ..Default::default()
        });
    // Pod A fails m1 once (recorded as an in-place retry that holds the key), starts it
    // again, and dies mid-delivery.
    let retrying = Arc::new(Notify::new());
    let a = {
        let retrying = Arc::clone(&retrying);
        Host::new(
            fixture.group(config.clone()),
            move |d: Delivery| {
                let retrying = Arc::clone(&retrying);
                async move {
                    if d.delivery_count == 1 {
                        return Outcome::Retry {
                            reason: "not yet".into(),
                            delay: None,
                        };
                    }
                    retrying.notify_one();
                    std::future::pending().await
                }
            },
            fast_host("a"),
        )
    };
    let a = tokio::spawn(a.run(CancellationToken::new()));
    retrying.notified().await;
    a.abort();
    let _ = a.await;

    // Pod B takes the range once A's lease expires, and reads m1 and m2 again.
    let ledger = Ledger::new();
    let b = Host::new(
        fixture.group(config.clone()),
        ledger.completing(),
        fast_host("b"),
    );
    let stop = CancellationToken::new();
    let b = tokio::spawn(b.run(stop.clone()));
    ledger
        .wait_until(|l| l.given("g").contains(&"m2".to_owned()))
        .await;
    let group = fixture.group(config);
    cosmosq_tests::eventually("m1 settled", Duration::from_secs(30), || {
        let group = group.clone();
        async move {
            let state = group.read_state(&"k".into(), "m1").await.unwrap();
            state.is_some_and(|s| s.state.is_settled())
        }
    })
    .await;
    stop.cancel();
    b.await.unwrap().unwrap();
    assert_eq!(
        ledger.given("g"),
        vec!["m1", "m2"],
        "m1 (held by A's in-place retry) first, once, then m2"
    );
    let m1 = ledger.record("g", "m1");
    assert!(
        m1.delivery_counts[0] >= 2,
        "m1's delivery count goes on from A's: {m1:?}"
    );
}

/// Found by the randomized histories (seed 63, shrunk): an ordered stream group waited for a
/// schedule, then delivered past its state document, which delivered the message again later,
/// after the key's next message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ordered_stream_schedule_is_delivered_once_and_before_the_keys_next_message() {
    let fixture = Fixture::new(1).await;
    for id in ["m0", "m1"] {
        fixture
            .queue
            .enqueue(
                NewMessage::json(json!(id))
                    .with_id(id)
                    .with_partition_key(true)
                    .with_delay(Duration::from_millis(500)),
            )
            .await
            .unwrap();
    }
    let config = GroupConfig::new("g")
        .with_mode(DeliveryMode::Stream)
        .with_start_from(StartFrom::Beginning)
        .with_ordering(true);
    let ledger = Ledger::new();
    let handler = answering(&ledger, &["m0"]);
    let host = Host::new(fixture.group(config.clone()), handler, fast_host("h"));
    let stop = CancellationToken::new();
    let task = tokio::spawn(host.run(stop.clone()));
    ledger
        .wait_until(|l| l.given("g").contains(&"m1".to_owned()))
        .await;
    // Long enough for the sweep (every 100 ms) to find a schedule left behind.
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.cancel();
    task.await.unwrap().unwrap();
    assert_eq!(ledger.given("g"), vec!["m0", "m1"]);
    let state = fixture
        .group(config)
        .read_state(&true.into(), "m0")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(state.state, MessageState::DeadLettered);
}

/// Found by the randomized histories (seed 93): an ordered stream range drained (a hand-over)
/// while a schedule waited; the schedule counted as unrecorded, its page held the checkpoint,
/// and the next owner delivered that page's dead-lettered and completed messages again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_while_an_ordered_stream_schedule_waits_does_not_hold_its_page_back() {
    let fixture = Fixture::new(1).await;
    let batch = vec![
        NewMessage::json(json!(0))
            .with_id("dropped")
            .with_partition_key("b"),
        NewMessage::json(json!(1))
            .with_id("later")
            .with_partition_key("a")
            .with_delay(Duration::from_secs(3600)),
        NewMessage::json(json!(2))
            .with_id("done")
            .with_partition_key("b"),
    ];
    for message in batch {
        fixture.queue.enqueue(message).await.unwrap();
    }
    let config = GroupConfig::new("g")
        .with_mode(DeliveryMode::Stream)
        .with_start_from(StartFrom::Beginning)
        .with_ordering(true);
    let ledger = Ledger::new();
    let handler = answering(&ledger, &["dropped"]);
    let group = fixture.group(config.clone());
    let host = Host::new(group.clone(), handler.clone(), fast_host("a"));
    let stop = CancellationToken::new();
    let task = tokio::spawn(host.run(stop.clone()));
    ledger
        .wait_until(|l| l.given("g").contains(&"done".to_owned()))
        .await;
    // Pod "a" drains (SIGTERM) while "later" waits for its time: the page is settled or
    // recorded, so the checkpoint it leaves passes it.
    stop.cancel();
    task.await.unwrap().unwrap();
    let lag = group.estimate().await.unwrap().lag();
    assert_eq!(lag, 0, "the drained range's checkpoint passes the page");
    // Pod "b" takes the range and finds nothing to deliver again.
    let host = Host::new(group.clone(), handler.clone(), fast_host("b"));
    let stats = host.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(host.run(stop.clone()));
    cosmosq_tests::eventually("b holds the range", Duration::from_secs(10), || {
        let stats = Arc::clone(&stats);
        async move {
            stats
                .leases_owned
                .load(std::sync::atomic::Ordering::Relaxed)
                == 1
        }
    })
    .await;
    stop.cancel();
    task.await.unwrap().unwrap();
    assert_eq!(
        ledger.given("g"),
        vec!["dropped", "done"],
        "nothing delivered again by the next owner"
    );
}
