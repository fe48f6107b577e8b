//! The delivery guarantees outside the happy configuration: retentions other than the
//! default, schedules, keys of every JSON type and length, documents written by other
//! producers and by other versions, ordered groups under failures. Each test names the
//! scenario it pins; each failed before the fix it guards.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cosmosq_emulator::EmulatorOptions;
use cosmosq_queue::host::{Host, HostOptions};
use cosmosq_queue::state::{state_pk, state_ttl_secs, REASON_EXPIRED};
use cosmosq_queue::{
    ClaimOutcome, Clock, Delivery, DeliveryMode, GroupConfig, Message, MessageKey, MessageState,
    NewMessage, Outcome, QueueConfig, QueueError, StartFrom,
};
use cosmosq_tests::{fast_host, wait_on, Fixture};
use serde_json::{json, Value};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

const DAY: Duration = Duration::from_secs(86_400);

fn claimed(outcome: ClaimOutcome) -> cosmosq_queue::Claim {
    match outcome {
        ClaimOutcome::Claimed(c) => c,
        other => panic!("expected a claim, got {other:?}"),
    }
}

/// A queue provisioned with `retention`, opened the way a sidecar opens it: with the
/// engine's default settings (7 days), not the queue's.
async fn queue_with_retention(retention: Duration, clock: Clock) -> Fixture {
    let mut config = QueueConfig::new("db", "q");
    config.retention = Some(retention);
    let fixture = Fixture::with(
        EmulatorOptions {
            partitions: 1,
            ..Default::default()
        },
        config,
        clock.clone(),
    )
    .await;
    let as_a_sidecar_opens_it =
        cosmosq_queue::Queue::open_with_clock(&fixture.client, QueueConfig::new("db", "q"), clock)
            .await
            .unwrap();
    Fixture {
        queue: as_a_sidecar_opens_it,
        ..fixture
    }
}

async fn stored(fixture: &Fixture, key: &MessageKey, id: &str) -> Message {
    fixture.queue.read_message(key, id).await.unwrap().unwrap()
}

/// Enqueues `id` under `key`, delivers it once to a holder that fails it, and leaves it
/// waiting for a retry after `delay` (as the app's `Retry-After` asks). Returns the message.
async fn enqueued_and_failed(
    fixture: &Fixture,
    group: &cosmosq_queue::Group,
    key: &str,
    id: &str,
    delay: Duration,
) -> Message {
    fixture
        .queue
        .enqueue(
            NewMessage::json(json!(id))
                .with_id(id)
                .with_partition_key(key),
        )
        .await
        .unwrap();
    let message = stored(fixture, &key.into(), id).await;
    let claim = claimed(group.claim(&message, "gone").await.unwrap());
    group.retry(&claim, "later", Some(delay)).await.unwrap();
    message
}

#[tokio::test]
async fn retention_is_the_containers_so_a_ten_day_schedule_on_a_thirty_day_queue_is_kept() {
    let clock = Clock::manual(cosmosq_queue::clock::system_now_ms());
    let fixture = queue_with_retention(30 * DAY, clock.clone()).await;
    assert_eq!(fixture.queue.config().retention, Some(30 * DAY));
    let group = fixture.group(GroupConfig::new("g"));

    fixture
        .queue
        .enqueue(
            NewMessage::json(json!(1))
                .with_id("later")
                .with_partition_key("k")
                .with_delay(10 * DAY),
        )
        .await
        .unwrap();
    let message = stored(&fixture, &"k".into(), "later").await;
    assert!(matches!(
        group.claim(&message, "a").await.unwrap(),
        ClaimOutcome::NotYetDue { .. }
    ));
    let state = group
        .read_state(&"k".into(), "later")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(state.state, MessageState::Scheduled);
    let ttl = state.ttl.expect("the schedule expires with its message");
    assert!(
        ttl >= (30 * DAY).as_secs() as i64,
        "a schedule 10 days out must outlive its due time and live as long as its message \
         (30 days), not 7 days + 1 h: ttl {ttl} s"
    );

    // Due after ten days: delivered, completed; the completion lives as long as the message.
    clock.advance(10 * DAY + Duration::from_secs(1));
    let due = group.due(10, None).await.unwrap();
    assert_eq!(due.len(), 1, "the schedule is due");
    let claim = claimed(group.take_over(due[0].clone(), "a").await.unwrap());
    group.complete(&claim).await.unwrap();
    let done = group
        .read_state(&"k".into(), "later")
        .await
        .unwrap()
        .unwrap();
    let ttl = done.ttl.unwrap();
    let message_left =
        (message.enqueued_at + (30 * DAY).as_millis() as i64 - clock.now_ms()) / 1000;
    assert!(
        ttl >= message_left,
        "a completion must outlive its message, or a re-read of the feed delivers it again: \
         ttl {ttl} s, message left {message_left} s"
    );
}

#[tokio::test]
async fn state_of_an_hour_long_queue_does_not_outlive_its_messages_by_days() {
    let clock = Clock::manual(cosmosq_queue::clock::system_now_ms());
    let fixture = queue_with_retention(Duration::from_secs(3600), clock).await;
    let group = fixture.group(GroupConfig::new("g"));
    fixture
        .queue
        .enqueue(
            NewMessage::json(json!(1))
                .with_id("m")
                .with_partition_key("k"),
        )
        .await
        .unwrap();
    let message = stored(&fixture, &"k".into(), "m").await;
    let claim = claimed(group.claim(&message, "a").await.unwrap());
    group.complete(&claim).await.unwrap();
    let ttl = group
        .read_state(&"k".into(), "m")
        .await
        .unwrap()
        .unwrap()
        .ttl
        .unwrap();
    assert!(
        ttl <= 2 * 3600,
        "an hour-long queue's state lives about 2 h, not 7 days: {ttl} s"
    );
}

#[test]
fn no_state_expires_before_what_it_describes_has_an_outcome() {
    use cosmosq_queue::StateDoc;
    let now = 1_000_000_000_000;
    let base: StateDoc = serde_json::from_value(json!({
        "id": "m", "pk": "g|k", "type": "message", "group": "g", "messagePk": "k",
        "state": "retry", "attempts": 1, "enqueuedAt": now,
        "expiresAt": now + 3_600_000
    }))
    .unwrap();
    let retention = Some(3600);
    // (state, due, the earliest the document may expire)
    let day = 86_400_000;
    let cases = [
        (
            MessageState::Scheduled,
            Some(now + 10 * day),
            now + 10 * day,
        ),
        (MessageState::Retry, Some(now + 2 * day), now + 2 * day),
        (MessageState::Locked, Some(now + 60_000), now + 3_600_000),
        (MessageState::Completed, None, now + 3_600_000),
        (MessageState::DeadLettered, None, now + 3_600_000),
    ];
    for (state, due, earliest) in cases {
        let doc = StateDoc {
            state,
            due,
            ..base.clone()
        };
        let ttl = state_ttl_secs(&doc, now, retention).unwrap();
        assert!(
            now + ttl * 1000 >= earliest,
            "{state:?} due {due:?}: expires at {} before {earliest}",
            now + ttl * 1000
        );
    }
    // A dead letter stays listable a retention after it was dead-lettered, even when its
    // message is about to go.
    let late = StateDoc {
        state: MessageState::DeadLettered,
        ..base.clone()
    };
    let at = now + 3_500_000;
    assert!(at + state_ttl_secs(&late, at, retention).unwrap() * 1000 >= at + 3_600_000);
    // A message that never expires has state that never does.
    let forever = StateDoc {
        expires_at: None,
        ..base
    };
    assert_eq!(state_ttl_secs(&forever, now, retention), None);
}

/// Writes `doc` into the messages container as another producer would (any SDK, any shape).
async fn foreign(fixture: &Fixture, key: Value, doc: Value) {
    let key = MessageKey::from_json(key).unwrap();
    fixture
        .queue
        .messages()
        .create_item(
            key.to_partition_key(),
            doc["id"].as_str().unwrap(),
            doc.clone(),
            None,
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn keys_of_every_json_type_keep_their_type_through_retries() {
    let clock = Clock::manual(cosmosq_queue::clock::system_now_ms());
    let fixture = queue_with_retention(DAY, clock.clone()).await;
    let group = fixture.group(GroupConfig::new("g"));
    let keys = [
        json!(5),
        json!("5"),
        json!(2.5),
        json!(true),
        json!(null),
        json!(""),
    ];
    for key in &keys {
        // The same id under each key: six messages, as Cosmos sees them.
        foreign(
            &fixture,
            key.clone(),
            json!({"id": "m", "pk": key, "body": {"k": key}, "enqueuedAt": clock.now_ms()}),
        )
        .await;
    }
    for key in &keys {
        let key = MessageKey::from_json(key.clone()).unwrap();
        let message = stored(&fixture, &key, "m").await;
        assert_eq!(message.partition_key, key);
        let first = claimed(group.claim(&message, "a").await.unwrap());
        group
            .retry(&first, "try again", Some(Duration::ZERO))
            .await
            .unwrap();
    }
    // Each key has its own state document, and each retry finds its message again (before,
    // `5` was read back as `"5"`, found nothing, and was dead-lettered as expired).
    clock.advance(Duration::from_millis(1));
    let due = group.due(100, None).await.unwrap();
    assert_eq!(due.len(), keys.len(), "one state per key: {due:?}");
    for doc in due {
        let message = fixture
            .queue
            .read_message(&doc.message_pk, &doc.id)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("the retry of key {} finds its message", doc.message_pk));
        assert_eq!(
            message.body,
            cosmosq_queue::Body::Json(json!({"k": doc.message_pk}))
        );
        let second = claimed(group.take_over(doc, "b").await.unwrap());
        assert_eq!(second.attempt, 2);
        group.complete(&second).await.unwrap();
    }
    assert!(group.dead_letters(None).await.unwrap().is_empty());
    assert_ne!(
        state_pk("g", &MessageKey::from(5)),
        state_pk("g", &MessageKey::from("5"))
    );
}

#[tokio::test]
async fn a_key_near_cosmos_limit_is_claimed_and_settled_not_refused_forever() {
    let fixture = Fixture::new(1).await;
    let group = fixture.group(GroupConfig::new("a-group-name-of-some-length"));
    for (i, len) in [1024usize, 2040, 2048].into_iter().enumerate() {
        let key = "k".repeat(len);
        let id = format!("m{i}");
        fixture
            .queue
            .enqueue(
                NewMessage::json(json!(i))
                    .with_id(&id)
                    .with_partition_key(key.as_str()),
            )
            .await
            .unwrap();
        let message = stored(&fixture, &key.as_str().into(), &id).await;
        let claim = claimed(group.claim(&message, "a").await.unwrap());
        group.complete(&claim).await.unwrap();
        let state = group.read_state(&key.as_str().into(), &id).await.unwrap();
        assert_eq!(
            state.unwrap().state,
            MessageState::Completed,
            "key of {len} bytes"
        );
        assert!(state_pk(group.name(), &key.as_str().into()).len() <= 1024);
    }
    let err = fixture
        .queue
        .enqueue(NewMessage::json(json!(1)).with_partition_key("k".repeat(2049)))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("partition key"), "{err}");
}

#[tokio::test]
async fn a_state_written_by_a_newer_version_is_left_alone_and_does_not_stop_the_sweep() {
    let (fixture, clock) = Fixture::with_manual_clock(1).await;
    let group = fixture.group(GroupConfig::new("g"));
    for id in ["new", "old"] {
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
    let old = stored(&fixture, &"k".into(), "old").await;
    let claim = claimed(group.claim(&old, "a").await.unwrap());
    group
        .retry(&claim, "later", Some(Duration::ZERO))
        .await
        .unwrap();
    // A future version records "new" with a state and a field shape this one does not know.
    let future = json!({
        "id": "new", "pk": "g|k", "type": "message", "group": "g", "messagePk": "k",
        "state": "locked", "attempts": "several", "enqueuedAt": 0, "due": 0
    });
    fixture
        .queue
        .leases()
        .create_item("g|k".to_owned(), "new", future, None)
        .await
        .unwrap();
    clock.advance(Duration::from_millis(1));
    let due = group.due(10, None).await.unwrap();
    assert_eq!(
        due.iter().map(|d| d.id.as_str()).collect::<Vec<_>>(),
        vec!["old"],
        "the unreadable document is left out, the rest of the sweep goes on"
    );
    let new = stored(&fixture, &"k".into(), "new").await;
    let err = group.claim(&new, "a").await.unwrap_err();
    assert!(matches!(err, QueueError::UnknownState { .. }), "{err}");
    assert!(err.is_permanent(), "not retried forever");
}

#[tokio::test]
async fn a_batch_keeps_each_keys_order_through_its_one_by_one_fallback() {
    let fixture = Fixture::new(1).await;
    // A duplicate in the second chunk makes that batch fail as a whole, so its messages go
    // one by one; the third chunk must still come after them.
    fixture
        .queue
        .enqueue(
            NewMessage::json(json!(0))
                .with_id("m150")
                .with_partition_key("k"),
        )
        .await
        .unwrap();
    let batch: Vec<_> = (0..250)
        .map(|i| {
            NewMessage::json(json!(i))
                .with_id(format!("m{i}"))
                .with_partition_key("k")
        })
        .collect();
    let results = fixture.queue.enqueue_batch(batch).await;
    assert!(results[150].as_ref().unwrap().is_duplicate());
    // A change feed read just after the writes may come back empty; read until it shows them.
    let mut messages = Vec::new();
    for _ in 0..20 {
        messages = fixture.queue.peek(1000).await.unwrap().0;
        if messages.len() == 250 {
            break;
        }
    }
    // One chunk's batch is one write (one LSN): the feed orders its items as it likes (the
    // emulator: by id). Across chunks, and for messages written one by one, the order is the
    // input's: chunk 1 (m0-m99), then chunk 2 one by one (m100-m199, m150 the duplicate),
    // then chunk 3 (m200-m249).
    let number = |id: &str| id[1..].parse::<usize>().unwrap();
    let read: Vec<usize> = messages.iter().skip(1).map(|m| number(&m.id)).collect();
    let chunks: Vec<usize> = read.iter().map(|n| n / 100).collect();
    assert!(
        chunks.windows(2).all(|w| w[0] <= w[1]),
        "a key's chunks were written out of order: {read:?}"
    );
    let one_by_one: Vec<usize> = read.iter().copied().filter(|n| n / 100 == 1).collect();
    let expected: Vec<usize> = (100..200).filter(|n| *n != 150).collect();
    assert_eq!(one_by_one, expected, "the fallback writes in input order");
}

#[tokio::test]
async fn work_due_next_week_is_not_backlog() {
    let (fixture, _clock) = Fixture::with_manual_clock(1).await;
    let group = fixture.group(GroupConfig::new("g").with_start_from(StartFrom::Beginning));
    let now = fixture.queue.clock().now_ms();
    for (id, delay) in [("soon", Duration::from_secs(10)), ("next-week", 7 * DAY)] {
        fixture
            .queue
            .enqueue(
                NewMessage::json(json!(id))
                    .with_id(id)
                    .with_partition_key(id)
                    .with_delay(delay),
            )
            .await
            .unwrap();
        let message = stored(&fixture, &id.into(), id).await;
        group.claim(&message, "a").await.unwrap();
    }
    // Both were read (the checkpoint passed them), so the estimate sees only their state.
    let store = cosmosq_queue::lease::LeaseStore::new(fixture.queue.clone(), "g")
        .with_start_from(StartFrom::Beginning);
    store.reconcile(now, 60_000).await.unwrap();
    let estimate = group.estimate().await.unwrap();
    let lag = estimate.lag();
    assert_eq!(
        estimate.backlog() - lag,
        1,
        "only the schedule due within the horizon counts: {estimate:?}"
    );
}

/// A handler that records the ids it is given, in order, and wakes the `Notify` each time; it
/// dead-letters the ids in `dropped` and completes the rest.
#[allow(clippy::type_complexity)]
fn recorder(
    dropped: &'static [&'static str],
) -> (
    Arc<Mutex<Vec<String>>>,
    Arc<Notify>,
    impl Fn(Delivery) -> futures::future::BoxFuture<'static, Outcome> + Clone + Send + Sync + 'static,
) {
    let seen = Arc::new(Mutex::new(Vec::<String>::new()));
    let notify = Arc::new(Notify::new());
    let handler = {
        let (seen, notify) = (Arc::clone(&seen), Arc::clone(&notify));
        move |d: Delivery| {
            let (seen, notify) = (Arc::clone(&seen), Arc::clone(&notify));
            Box::pin(async move {
                seen.lock().unwrap().push(d.message.id.clone());
                notify.notify_waiters();
                if dropped.contains(&d.message.id.as_str()) {
                    Outcome::DeadLetter {
                        reason: "DroppedByApp".into(),
                        description: "no".into(),
                    }
                } else {
                    Outcome::Complete
                }
            }) as futures::future::BoxFuture<'static, Outcome>
        }
    };
    (seen, notify, handler)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduled_message_of_an_ordered_group_holds_no_permit_while_it_waits() {
    let fixture = Fixture::new(1).await;
    for mode in [DeliveryMode::Exclusive, DeliveryMode::Stream] {
        let name = format!("{mode:?}").to_lowercase();
        let config = GroupConfig::new(name.as_str())
            .with_mode(mode)
            .with_start_from(StartFrom::Beginning)
            .with_ordering(true);
        let waiting: Vec<_> = (0..3)
            .map(|i| {
                NewMessage::json(json!(i))
                    .with_id(format!("{name}-later-{i}"))
                    .with_partition_key(format!("{name}-{i}"))
                    .with_delay(Duration::from_secs(3600))
            })
            .collect();
        fixture.enqueue_all(waiting).await;
        fixture
            .queue
            .enqueue(
                NewMessage::json(json!("now"))
                    .with_id(format!("{name}-now"))
                    .with_partition_key(format!("{name}-now")),
            )
            .await
            .unwrap();
        let (seen, notify, handler) = recorder(&[]);
        // Two permits, three schedules an hour out ahead of the message due now: before the
        // fix, each waiting schedule held a permit (and polled once a second) for its hour.
        let options = HostOptions {
            max_concurrency: 2,
            ..fast_host("h")
        };
        let host = Host::new(fixture.group(config), handler, options);
        let stop = CancellationToken::new();
        let task = tokio::spawn(host.run(stop.clone()));
        let now_id = format!("{name}-now");
        wait_on(&notify, "the message due now", || {
            seen.lock().unwrap().contains(&now_id)
        })
        .await;
        stop.cancel();
        task.await.unwrap().unwrap();
        let seen = seen.lock().unwrap();
        assert!(
            !seen.iter().any(|id| id.contains("later")),
            "{mode:?}: a schedule was delivered early: {seen:?}"
        );
    }
}

#[tokio::test]
async fn a_message_that_expired_while_it_waited_is_dead_lettered_with_the_reason() {
    // The app asks for a retry in two hours; the message expires in one: the retry is due a
    // minute before the expiry, and its state outlives the message. If the message is gone
    // by then all the same, the sweep finds no message and records why.
    let clock = Clock::manual(cosmosq_queue::clock::system_now_ms());
    let fixture = queue_with_retention(Duration::from_secs(3600), clock.clone()).await;
    let group = fixture.group(GroupConfig::new("g"));
    let message = enqueued_and_failed(&fixture, &group, "k", "m", Duration::from_secs(7200)).await;
    let state = group.read_state(&"k".into(), "m").await.unwrap().unwrap();
    let expiry = message.enqueued_at + 3_600_000;
    assert!(
        state.due.unwrap() <= expiry - 60_000,
        "a Retry-After past the message's life is capped: due {:?}, expiry {expiry}",
        state.due
    );
    assert!(
        state.ttl.unwrap() >= 3600,
        "the retry's state outlives its message so its fate is still recorded"
    );
    // The emulator keeps items past their TTL; the real service removes the message.
    fixture
        .queue
        .messages()
        .delete_item("k".to_owned(), "m", None)
        .await
        .unwrap();
    clock.advance(Duration::from_secs(7201));
    let ledger = Arc::new(cosmosq_tests::Ledger::default());
    let host = Host::new(
        group.clone(),
        cosmosq_tests::recording(&ledger),
        fast_host("h"),
    );
    let stop = CancellationToken::new();
    let task = tokio::spawn(host.run(stop.clone()));
    cosmosq_tests::eventually(
        "the expired message is dead-lettered",
        Duration::from_secs(30),
        || {
            let group = group.clone();
            async move { !group.dead_letters(None).await.unwrap().is_empty() }
        },
    )
    .await;
    stop.cancel();
    task.await.unwrap().unwrap();
    let dead = group.dead_letters(None).await.unwrap();
    assert_eq!(dead[0].reason.as_deref(), Some(REASON_EXPIRED));
}

/// A rule that answers 503 to every `operation` while enabled (it starts disabled).
fn outage(
    operation: cosmosq_emulator::fault_injection::FaultOperationType,
) -> Arc<cosmosq_emulator::fault_injection::FaultInjectionRule> {
    use cosmosq_emulator::fault_injection::{
        FaultInjectionConditionBuilder, FaultInjectionErrorType, FaultInjectionResultBuilder,
        FaultInjectionRuleBuilder,
    };
    let rule = FaultInjectionRuleBuilder::new(
        format!("outage-{operation:?}"),
        FaultInjectionResultBuilder::new()
            .with_error(FaultInjectionErrorType::ServiceUnavailable)
            .with_probability(1.0)
            .build(),
    )
    .with_condition(
        FaultInjectionConditionBuilder::new()
            .with_operation_type(operation)
            .build(),
    )
    .build();
    rule.disable();
    Arc::new(rule)
}

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
        let completed = Arc::new(Mutex::new(Vec::<String>::new()));
        let notify = Arc::new(Notify::new());
        let handler = {
            let (completed, notify, rules) =
                (Arc::clone(&completed), Arc::clone(&notify), rules.clone());
            move |d: Delivery| {
                let (completed, notify, rules) =
                    (Arc::clone(&completed), Arc::clone(&notify), rules.clone());
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
                    completed.lock().unwrap().push(d.message.id.clone());
                    notify.notify_waiters();
                    Outcome::Complete
                }
            }
        };
        let options = HostOptions {
            lease_expire: Duration::from_secs(10),
            ..fast_host("h")
        };
        let host = Host::new(queue.group(config).unwrap(), handler, options);
        let stop = CancellationToken::new();
        let task = tokio::spawn(host.run(stop.clone()));
        wait_on(&notify, "both completed", || {
            completed.lock().unwrap().len() >= 2
        })
        .await;
        stop.cancel();
        task.await.unwrap().unwrap();
        assert!(
            rules.iter().any(|r| r.hit_count() > 0),
            "{mode:?}: the outage was met"
        );
        assert_eq!(*completed.lock().unwrap(), vec!["m1", "m2"], "{mode:?}");
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
    let seen = Arc::new(Mutex::new(Vec::<(String, u32)>::new()));
    let notify = Arc::new(Notify::new());
    let b = {
        let (seen, notify) = (Arc::clone(&seen), Arc::clone(&notify));
        Host::new(
            fixture.group(config.clone()),
            move |d: Delivery| {
                let (seen, notify) = (Arc::clone(&seen), Arc::clone(&notify));
                async move {
                    seen.lock()
                        .unwrap()
                        .push((d.message.id.clone(), d.delivery_count));
                    notify.notify_waiters();
                    Outcome::Complete
                }
            },
            fast_host("b"),
        )
    };
    let stop = CancellationToken::new();
    let b = tokio::spawn(b.run(stop.clone()));
    wait_on(&notify, "m2 delivered", || {
        seen.lock().unwrap().iter().any(|(id, _)| id == "m2")
    })
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
    let seen = seen.lock().unwrap().clone();
    let ids: Vec<&str> = seen.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(
        ids,
        vec!["m1", "m2"],
        "m1 (held by A's in-place retry) first, once, then m2: {seen:?}"
    );
    assert!(
        seen[0].1 >= 2,
        "m1's delivery count goes on from A's: {seen:?}"
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
    let (seen, notify, handler) = recorder(&["m0"]);
    let host = Host::new(fixture.group(config.clone()), handler, fast_host("h"));
    let stop = CancellationToken::new();
    let task = tokio::spawn(host.run(stop.clone()));
    wait_on(&notify, "m1 delivered", || {
        seen.lock().unwrap().contains(&"m1".to_owned())
    })
    .await;
    // Long enough for the sweep (every 100 ms) to find a schedule left behind.
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.cancel();
    task.await.unwrap().unwrap();
    assert_eq!(*seen.lock().unwrap(), vec!["m0", "m1"]);
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
    let (seen, notify, handler) = recorder(&["dropped"]);
    let group = fixture.group(config.clone());
    let host = Host::new(group.clone(), handler.clone(), fast_host("a"));
    let stop = CancellationToken::new();
    let task = tokio::spawn(host.run(stop.clone()));
    wait_on(&notify, "the page delivered", || {
        seen.lock().unwrap().contains(&"done".to_owned())
    })
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
        *seen.lock().unwrap(),
        vec!["dropped", "done"],
        "nothing delivered again by the next owner"
    );
}

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
    let ledger = Arc::new(cosmosq_tests::Ledger::default());
    let host = Host::new(
        queue.group(config.clone()).unwrap(),
        cosmosq_tests::recording(&ledger),
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
async fn hosts_sweeping_together_read_each_due_message_once() {
    let fixture = Fixture::new(2).await;
    // Starting from now, the hosts read none of these messages from the feed: every delivery
    // comes from the sweep.
    let config = GroupConfig::new("g");
    let group = fixture.group(config.clone());
    const MESSAGES: usize = 30;
    for i in 0..MESSAGES {
        enqueued_and_failed(
            &fixture,
            &group,
            &format!("k{i}"),
            &format!("m{i}"),
            Duration::from_millis(300),
        )
        .await;
    }
    // Three hosts, each with its own queue handle (its own request counters), sweep the two
    // ranges' retries: each message is found by its range's owner.
    let (seen, notify, handler) = recorder(&[]);
    let mut hosts = Vec::new();
    for name in ["a", "b", "c"] {
        let queue = cosmosq_queue::Queue::open(&fixture.client, QueueConfig::new("db", "q"))
            .await
            .unwrap();
        let host = Host::new(
            queue.group(config.clone()).unwrap(),
            handler.clone(),
            fast_host(name),
        );
        let stop = CancellationToken::new();
        hosts.push((queue, stop.clone(), tokio::spawn(host.run(stop))));
    }
    wait_on(&notify, "the retries delivered", || {
        seen.lock().unwrap().len() >= MESSAGES
    })
    .await;
    let mut reads = 0;
    for (queue, stop, task) in hosts {
        stop.cancel();
        task.await.unwrap().unwrap();
        reads += queue
            .charges()
            .snapshot()
            .by_operation
            .get("read message")
            .map_or(0, |c| c.calls);
    }
    assert_eq!(seen.lock().unwrap().len(), MESSAGES, "each delivered once");
    assert_eq!(
        reads, MESSAGES as u64,
        "only the host that took a message over reads it"
    );
}

#[tokio::test]
async fn a_sidecar_estimates_only_the_ranges_it_owns() {
    let fixture = Fixture::new(2).await;
    let group = fixture.group(GroupConfig::new("g").with_start_from(StartFrom::Beginning));
    let store = cosmosq_queue::lease::LeaseStore::new(fixture.queue.clone(), "g")
        .with_start_from(StartFrom::Beginning);
    let now = fixture.queue.clock().now_ms();
    store.reconcile(now, 60_000).await.unwrap();
    let leases = store.list().await.unwrap();
    assert_eq!(leases.len(), 2);
    store.acquire(&leases[0], "me", now).await.unwrap();
    let mine = group.estimate_owned("me").await.unwrap();
    assert_eq!(mine.ranges.len(), 1);
    assert_eq!(mine.ranges[0].owner.as_deref(), Some("me"));
    assert_eq!(group.estimate().await.unwrap().ranges.len(), 2);
    assert!(group
        .estimate_owned("nobody")
        .await
        .unwrap()
        .ranges
        .is_empty());
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

/// Each host sweeps the state of the ranges it owns (and documents from before state carried an
/// EPK), so hosts do not query, read and race on the same documents.
#[tokio::test]
async fn hosts_sweep_disjoint_sets_of_due_messages_by_owned_range() {
    let (fixture, clock) = Fixture::with_manual_clock(2).await;
    let group = fixture.group(GroupConfig::new("g"));
    const MESSAGES: usize = 40;
    for i in 0..MESSAGES {
        let (key, id) = (format!("k{i}"), format!("m{i}"));
        enqueued_and_failed(&fixture, &group, &key, &id, Duration::from_secs(1)).await;
    }
    // A document an earlier version wrote carries no EPK.
    let legacy = group.read_state(&"k0".into(), "m0").await.unwrap().unwrap();
    assert!(legacy.epk.is_some(), "new state documents carry the EPK");
    let mut raw = serde_json::to_value(&legacy).unwrap();
    raw.as_object_mut().unwrap().remove("epk");
    fixture
        .queue
        .leases()
        .upsert_item(legacy.pk.clone(), &legacy.id, raw, None)
        .await
        .unwrap();
    clock.advance(Duration::from_secs(2));

    let ranges = cosmosq_tests::physical_ranges(&fixture.queue).await;
    assert_eq!(ranges.len(), 2);
    let ids = |docs: Vec<cosmosq_queue::StateDoc>| -> std::collections::BTreeSet<String> {
        docs.into_iter().map(|d| d.id).collect()
    };
    let first = ids(group.due(100, Some(&ranges[..1])).await.unwrap());
    let second = ids(group.due(100, Some(&ranges[1..])).await.unwrap());
    let all = ids(group.due(100, None).await.unwrap());
    assert_eq!(all.len(), MESSAGES);
    let shared: Vec<_> = first.intersection(&second).cloned().collect();
    assert_eq!(
        shared,
        vec!["m0".to_owned()],
        "only the legacy document is in both"
    );
    assert!(first.len() > 1 && second.len() > 1, "{first:?} {second:?}");
    assert_eq!(&first | &second, all, "every due message is some range's");
    let both = ids(group.due(100, Some(&ranges)).await.unwrap());
    assert_eq!(both, all, "a host owning every range sweeps everything");
    for id in first.iter().filter(|id| *id != "m0") {
        let i: usize = id[1..].parse().unwrap();
        let epk = fixture.queue.message_epk(&format!("k{i}").into());
        assert!(
            cosmosq_queue::range::epk_in(&epk, &ranges[0].0, &ranges[0].1),
            "{id} belongs to the first range"
        );
    }
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
