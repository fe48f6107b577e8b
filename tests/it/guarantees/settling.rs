//! A message's result under failures: a claim refused for good, a lock lost mid-call, a success
//! met by an outage while the pod drains.

use std::sync::Arc;
use std::time::Duration;

use cosmosq_queue::host::Host;
use cosmosq_queue::{
    Delivery, GroupConfig, MessageState, NewMessage, Outcome, QueueConfig, StartFrom,
};
use cosmosq_tests::{fast_host, wait_on, Fixture, Ledger};
use serde_json::json;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_refused_for_good_ends_in_the_dead_letters_with_the_cause_not_in_a_loop() {
    use cosmosq_emulator::fault_injection::{
        CustomResponseBuilder, FaultInjectionConditionBuilder, FaultInjectionResultBuilder,
        FaultInjectionRuleBuilder, FaultOperationType,
    };
    let fixture = Fixture::new(1).await;
    // The claims write path: its first write is the claim.
    let config = GroupConfig::new("g")
        .with_start_from(StartFrom::Beginning)
        .with_exclusive_writes(cosmosq_queue::ExclusiveWrites::Claims);
    cosmosq_queue::lease::LeaseStore::new(fixture.queue.clone(), "g")
        .with_start_from(StartFrom::Beginning)
        .reconcile(fixture.queue.clock().now_ms(), 60_000)
        .await
        .unwrap();
    fixture
        .queue
        .enqueue(
            NewMessage::json(json!(1))
                .with_id("m")
                .with_partition_key("k"),
        )
        .await
        .unwrap();
    // The first state write (the claim) is refused as a request: 403, as for a missing grant
    // or a key Cosmos cannot take.
    let forbidden = Arc::new(
        FaultInjectionRuleBuilder::new(
            "forbidden-claim",
            FaultInjectionResultBuilder::new()
                .with_custom_response(
                    CustomResponseBuilder::new(azure_core::http::StatusCode::Forbidden).build(),
                )
                .build(),
        )
        .with_condition(
            FaultInjectionConditionBuilder::new()
                .with_operation_type(FaultOperationType::CreateItem)
                .with_container_id("q-leases")
                .build(),
        )
        .with_hit_limit(1)
        .build(),
    );
    let client = fixture
        .emulator
        .client_with_faults(vec![Arc::clone(&forbidden)])
        .await
        .unwrap();
    let queue = cosmosq_queue::Queue::open(&client, QueueConfig::new("db", "q"))
        .await
        .unwrap();
    let ledger = Ledger::new();
    let host = Host::new(
        queue.group(config.clone()).unwrap(),
        ledger.completing(),
        fast_host("h"),
    );
    let stop = CancellationToken::new();
    let task = tokio::spawn(host.run(stop.clone()));
    let group = fixture.group(config);
    cosmosq_tests::eventually(
        "the refused message is dead-lettered",
        Duration::from_secs(10),
        || {
            let group = group.clone();
            async move { !group.dead_letters(None).await.unwrap().is_empty() }
        },
    )
    .await;
    stop.cancel();
    task.await.unwrap().unwrap();
    assert_eq!(forbidden.hit_count(), 1);
    let dead = group.dead_letters(None).await.unwrap();
    assert_eq!(dead[0].reason.as_deref(), Some("PermanentError"));
    assert!(
        dead[0]
            .last_error
            .as_deref()
            .unwrap_or_default()
            .contains("403"),
        "the cause is named: {dead:?}"
    );
    assert_eq!(ledger.delivered("g"), 0, "never delivered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lock_cancels_the_apps_call_and_is_counted() {
    // On the lease write path the lock is the one the delivery gets once it runs long.
    for writes in [
        cosmosq_queue::ExclusiveWrites::Claims,
        cosmosq_queue::ExclusiveWrites::Lease,
    ] {
        lost_lock_cancels_the_call(writes).await;
    }
}

async fn lost_lock_cancels_the_call(writes: cosmosq_queue::ExclusiveWrites) {
    let (fixture, clock) = Fixture::with_manual_clock(1).await;
    let config = GroupConfig::new("g")
        .with_start_from(StartFrom::Beginning)
        .with_exclusive_writes(writes)
        .with_lock_duration(Duration::from_secs(3));
    fixture
        .queue
        .enqueue(
            NewMessage::json(json!(1))
                .with_id("m")
                .with_partition_key("k"),
        )
        .await
        .unwrap();
    /// Counts calls of the app that ended without an answer (dropped mid-way).
    struct Cut(Arc<std::sync::atomic::AtomicUsize>, Arc<Notify>);
    impl Drop for Cut {
        fn drop(&mut self) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            self.1.notify_waiters();
        }
    }
    let cut = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Arc::new(Notify::new());
    let notify = Arc::new(Notify::new());
    let handler = {
        let (cut, started, notify) = (Arc::clone(&cut), Arc::clone(&started), Arc::clone(&notify));
        move |_d: Delivery| {
            let guard = Cut(Arc::clone(&cut), Arc::clone(&notify));
            let started = Arc::clone(&started);
            async move {
                let _guard = guard;
                started.notify_one();
                std::future::pending::<Outcome>().await
            }
        }
    };
    let host = Host::new(fixture.group(config.clone()), handler, fast_host("h"));
    let stats = host.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(host.run(stop.clone()));
    started.notified().await;
    let group = fixture.group(config);
    cosmosq_tests::eventually(
        "the delivery holds a lock",
        Duration::from_secs(5),
        || async {
            group
                .read_state(&"k".into(), "m")
                .await
                .unwrap()
                .is_some_and(|s| s.state == MessageState::Locked)
        },
    )
    .await;
    // The lock runs out (the clock jumps past it) and another consumer takes the message.
    clock.advance(Duration::from_secs(4));
    let doc = group.read_state(&"k".into(), "m").await.unwrap().unwrap();
    let _ = group.take_over(doc, "thief").await.unwrap();
    wait_on(&notify, "the first call cut", || {
        cut.load(std::sync::atomic::Ordering::SeqCst) >= 1
    })
    .await;
    assert!(stats.lock_lost.load(std::sync::atomic::Ordering::SeqCst) >= 1);
    stop.cancel();
    task.abort();
    let _ = task.await;
}

/// The app finished its work while the pod was draining (scale-in, rolling update), and the
/// write that records it meets two seconds of 503s: the drain keeps trying until the lock
/// expires instead of throwing the success away (which would deliver the message again with
/// one more attempt, or dead-letter it on its last). The outage also costs the host its lease
/// (renewals fail past the expiry); the host still does not return, and so the process does
/// not exit, before the settle lands (found by this test: it did).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_success_is_recorded_while_draining_through_an_outage() {
    use cosmosq_emulator::fault_injection::FaultOperationType as Op;
    let fixture = Fixture::new(1).await;
    fixture
        .queue
        .enqueue(
            NewMessage::json(json!("m"))
                .with_id("m")
                .with_partition_key("k"),
        )
        .await
        .unwrap();
    let rules = vec![outage(Op::ReplaceItem)];
    let client = fixture
        .emulator
        .client_with_faults(rules.clone())
        .await
        .unwrap();
    let queue = cosmosq_queue::Queue::open(&client, QueueConfig::new("db", "q"))
        .await
        .unwrap();
    let config = GroupConfig::new("g")
        .with_start_from(StartFrom::Beginning)
        .with_lock_duration(Duration::from_secs(15));
    let (in_app, finish) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = {
        let (in_app, finish) = (Arc::clone(&in_app), Arc::clone(&finish));
        move |_: Delivery| {
            let (in_app, finish) = (Arc::clone(&in_app), Arc::clone(&finish));
            async move {
                in_app.notify_one();
                finish.notified().await;
                Outcome::Complete
            }
        }
    };
    let host = Host::new(
        queue.group(config.clone()).unwrap(),
        handler,
        fast_host("h"),
    );
    let stop = CancellationToken::new();
    let task = tokio::spawn(host.run(stop.clone()));
    in_app.notified().await;
    stop.cancel();
    rules.iter().for_each(|r| r.enable());
    let lift = {
        let rules = rules.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            rules.iter().for_each(|r| r.disable());
        })
    };
    finish.notify_one();
    task.await.unwrap().unwrap();
    lift.await.unwrap();
    assert!(rules[0].hit_count() > 0, "the outage was met");
    let state = fixture
        .group(config)
        .read_state(&"k".into(), "m")
        .await
        .unwrap()
        .expect("a state document");
    assert_eq!(state.state, MessageState::Completed, "{state:?}");
    assert_eq!(state.attempts, 1);
}
