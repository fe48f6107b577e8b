//! The per-group state machine, driven directly with a manual clock.

use std::time::Duration;

use cosmosq_queue::state::REASON_MAX_ATTEMPTS;
use cosmosq_queue::{
    ClaimOutcome, DeliveryMode, GroupConfig, MessageError, MessageState, NewMessage, QueueError,
    RetryOutcome, RetryPolicy,
};
use cosmosq_tests::Fixture;
use serde_json::json;

fn claimed(outcome: ClaimOutcome) -> cosmosq_queue::Claim {
    match outcome {
        ClaimOutcome::Claimed(c) => c,
        other => panic!("expected a claim, got {other:?}"),
    }
}

async fn enqueue(fixture: &Fixture, id: &str) -> cosmosq_queue::Message {
    fixture
        .queue
        .enqueue(
            NewMessage::json(json!({"n": id}))
                .with_id(id)
                .with_partition_key("k"),
        )
        .await
        .unwrap();
    fixture
        .queue
        .read_message(&"k".into(), id)
        .await
        .unwrap()
        .unwrap()
}

#[tokio::test]
async fn one_holder_at_a_time_until_the_lock_expires() {
    let (fixture, clock) = Fixture::with_manual_clock(1).await;
    let group = fixture.group(GroupConfig::new("g").with_lock_duration(Duration::from_secs(30)));
    let message = enqueue(&fixture, "m1").await;

    let first = claimed(group.claim(&message, "a").await.unwrap());
    assert_eq!(first.attempt, 1);
    match group.claim(&message, "b").await.unwrap() {
        ClaimOutcome::Held { owner, .. } => assert_eq!(owner.as_deref(), Some("a")),
        other => panic!("b must not get a held message: {other:?}"),
    }
    assert!(
        group.due(10, None).await.unwrap().is_empty(),
        "a valid lock is not due"
    );

    // "a" dies. After the lock expires the sweep finds it and "b" gets delivery 2.
    clock.advance(Duration::from_secs(31));
    let due = group.due(10, None).await.unwrap();
    assert_eq!(due.len(), 1);
    let second = claimed(group.take_over(due[0].clone(), "b").await.unwrap());
    assert_eq!(second.attempt, 2);

    // "a" comes back and tries to settle: refused, b's delivery stands.
    let late = group.complete(&first).await.unwrap_err();
    assert!(matches!(late, QueueError::LockLost { .. }), "{late}");
    group.complete(&second).await.unwrap();
    assert!(matches!(
        group.claim(&message, "c").await.unwrap(),
        ClaimOutcome::Settled(MessageState::Completed)
    ));
    assert!(group.due(10, None).await.unwrap().is_empty());
}

#[tokio::test]
async fn writes_whose_answer_was_lost_are_recognised_by_their_lock_token() {
    let (fixture, clock) = Fixture::with_manual_clock(1).await;
    let group = fixture.group(GroupConfig::new("g").with_lock_duration(Duration::from_secs(30)));
    let message = enqueue(&fixture, "m1").await;

    // A claim that took effect without an answer: retried with its token, it is ours at once
    // (a fresh token would find the message held, by us, until the lock expired).
    let token = "t-1";
    let first = claimed(group.claim_with_token(&message, "a", token).await.unwrap());
    let again = claimed(group.claim_with_token(&message, "a", token).await.unwrap());
    assert_eq!(
        again.attempt, first.attempt,
        "the same delivery, not a new one"
    );
    assert!(matches!(
        group.claim(&message, "a").await.unwrap(),
        ClaimOutcome::Held { .. }
    ));

    // A renewal the service applied but whose answer never came: the holder's copy keeps the
    // old ETag. Completing with it still works: the document carries the holder's token.
    let mut applied = first.clone();
    group.renew(&mut applied).await.unwrap();
    group.complete(&first).await.unwrap();
    // And a retry of that completion (its answer lost too) is done, not a lost lock.
    group.complete(&first).await.unwrap();
    assert!(matches!(
        group.claim(&message, "c").await.unwrap(),
        ClaimOutcome::Settled(MessageState::Completed)
    ));

    // Another holder's lock is never taken for ours.
    let other = enqueue(&fixture, "m2").await;
    let stale = claimed(group.claim(&other, "a").await.unwrap());
    clock.advance(Duration::from_secs(31));
    let due = group.due(10, None).await.unwrap();
    let current = claimed(group.take_over(due[0].clone(), "b").await.unwrap());
    let late = group.complete(&stale).await.unwrap_err();
    assert!(matches!(late, QueueError::LockLost { .. }), "{late}");
    group.complete(&current).await.unwrap();
}

#[tokio::test]
async fn renewal_keeps_the_lock() {
    let (fixture, clock) = Fixture::with_manual_clock(1).await;
    let group = fixture.group(GroupConfig::new("g").with_lock_duration(Duration::from_secs(30)));
    let message = enqueue(&fixture, "m1").await;
    let mut claim = claimed(group.claim(&message, "a").await.unwrap());
    for _ in 0..4 {
        clock.advance(Duration::from_secs(20));
        group.renew(&mut claim).await.unwrap();
        assert!(
            group.due(10, None).await.unwrap().is_empty(),
            "renewed locks are not due"
        );
    }
    group.complete(&claim).await.unwrap();
}

#[tokio::test]
async fn retries_back_off_and_dead_letter_exactly_at_max_attempts() {
    let (fixture, clock) = Fixture::with_manual_clock(1).await;
    let retry = RetryPolicy {
        max_delivery_attempts: 3,
        initial_backoff: Duration::from_secs(10),
        max_backoff: Duration::from_secs(60),
        multiplier: 2.0,
        jitter: 0.0,
    };
    let group = fixture.group(GroupConfig::new("g").with_retry(retry));
    let message = enqueue(&fixture, "poison").await;

    let mut claim = claimed(group.claim(&message, "a").await.unwrap());
    for (attempt, backoff) in [(1u32, 10u64), (2, 20)] {
        assert_eq!(claim.attempt, attempt);
        let now = clock.now_ms();
        let outcome = group.retry(&claim, "boom", None).await.unwrap();
        assert_eq!(
            outcome,
            RetryOutcome::Scheduled {
                at: now + backoff as i64 * 1000
            }
        );
        // Not before its time...
        clock.advance(Duration::from_secs(backoff - 1));
        assert!(group.due(10, None).await.unwrap().is_empty());
        // ...then due, to anyone.
        clock.advance(Duration::from_secs(1));
        let due = group.due(10, None).await.unwrap();
        assert_eq!(due.len(), 1);
        claim = claimed(group.take_over(due[0].clone(), "b").await.unwrap());
    }
    assert_eq!(claim.attempt, 3);
    assert_eq!(
        group.retry(&claim, "boom again", None).await.unwrap(),
        RetryOutcome::DeadLettered
    );

    let dead = group.dead_letters(None).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(group.count_dead_letters(10).await.unwrap(), 1);
    assert_eq!(dead[0].message_id, "poison");
    assert_eq!(dead[0].attempts, 3);
    assert_eq!(dead[0].reason.as_deref(), Some(REASON_MAX_ATTEMPTS));
    assert_eq!(dead[0].last_error.as_deref(), Some("boom again"));
    assert!(dead[0].dead_lettered_at.is_some());
    let (peeked, body) = group
        .peek_dead_letter(&"k".into(), "poison")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(peeked, dead[0]);
    assert_eq!(
        body.unwrap().body,
        cosmosq_queue::Body::Json(json!({"n": "poison"}))
    );

    // Replay: deliverable again with a fresh budget.
    assert!(group.replay(&"k".into(), "poison").await.unwrap());
    assert!(group.dead_letters(None).await.unwrap().is_empty());
    assert_eq!(group.count_dead_letters(10).await.unwrap(), 0);
    let due = group.due(10, None).await.unwrap();
    let again = claimed(group.take_over(due[0].clone(), "c").await.unwrap());
    assert_eq!(again.attempt, 1);
    group.complete(&again).await.unwrap();
    assert!(
        !group.replay(&"k".into(), "poison").await.unwrap(),
        "only dead letters replay"
    );
}

#[tokio::test]
async fn drop_dead_letters_at_once_and_purge_removes_for_good() {
    let (fixture, _clock) = Fixture::with_manual_clock(1).await;
    let group = fixture.group(GroupConfig::new("g"));
    let message = enqueue(&fixture, "bad").await;
    let claim = claimed(group.claim(&message, "a").await.unwrap());
    group
        .dead_letter(&claim, "Dropped", "app said DROP")
        .await
        .unwrap();
    assert_eq!(group.dead_letters(None).await.unwrap().len(), 1);

    assert!(group.purge(&"k".into(), "bad").await.unwrap());
    assert!(group.dead_letters(None).await.unwrap().is_empty());
    assert!(matches!(
        group.claim(&message, "a").await.unwrap(),
        ClaimOutcome::Settled(MessageState::Purged)
    ));
    assert!(group.due(10, None).await.unwrap().is_empty());
}

#[tokio::test]
async fn holder_that_dies_on_its_last_attempt_is_dead_lettered_not_redelivered() {
    let (fixture, clock) = Fixture::with_manual_clock(1).await;
    let retry = RetryPolicy {
        max_delivery_attempts: 1,
        ..RetryPolicy::default()
    };
    let group = fixture.group(
        GroupConfig::new("g")
            .with_retry(retry)
            .with_lock_duration(Duration::from_secs(5)),
    );
    let message = enqueue(&fixture, "crashy").await;
    claimed(group.claim(&message, "a").await.unwrap());
    clock.advance(Duration::from_secs(6));
    let due = group.due(10, None).await.unwrap();
    assert!(matches!(
        group.take_over(due[0].clone(), "b").await.unwrap(),
        ClaimOutcome::DeadLettered
    ));
    let dead = group.dead_letters(None).await.unwrap();
    assert_eq!(dead[0].reason.as_deref(), Some(REASON_MAX_ATTEMPTS));
    assert!(dead[0].last_error.as_deref().unwrap().contains("expired"));
}

#[tokio::test]
async fn scheduled_messages_are_not_claimable_before_their_time() {
    let (fixture, clock) = Fixture::with_manual_clock(1).await;
    let group = fixture.group(GroupConfig::new("g"));
    fixture
        .queue
        .enqueue(
            NewMessage::json(json!(1))
                .with_id("later")
                .with_partition_key("k")
                .with_delay(Duration::from_secs(60)),
        )
        .await
        .unwrap();
    let message = fixture
        .queue
        .read_message(&"k".into(), "later")
        .await
        .unwrap()
        .unwrap();
    for holder in ["a", "b"] {
        assert!(matches!(
            group.claim(&message, holder).await.unwrap(),
            ClaimOutcome::NotYetDue { .. }
        ));
    }
    clock.advance(Duration::from_secs(59));
    assert!(group.due(10, None).await.unwrap().is_empty());
    clock.advance(Duration::from_secs(1));
    let due = group.due(10, None).await.unwrap();
    assert_eq!(due.len(), 1);
    let claim = claimed(group.take_over(due[0].clone(), "a").await.unwrap());
    assert_eq!(
        claim.attempt, 1,
        "waiting for the schedule is not a delivery"
    );
}

#[tokio::test]
async fn groups_are_independent() {
    let (fixture, _clock) = Fixture::with_manual_clock(1).await;
    let a = fixture.group(GroupConfig::new("a"));
    let b = fixture.group(GroupConfig::new("b"));
    let message = enqueue(&fixture, "m").await;
    let claim_a = claimed(a.claim(&message, "h").await.unwrap());
    a.complete(&claim_a).await.unwrap();
    let claim_b = claimed(b.claim(&message, "h").await.unwrap());
    assert_eq!(claim_b.attempt, 1);
    b.dead_letter(&claim_b, "r", "e").await.unwrap();
    assert!(a.dead_letters(None).await.unwrap().is_empty());
    assert_eq!(b.dead_letters(None).await.unwrap().len(), 1);
}

#[tokio::test]
async fn stream_mode_writes_nothing_on_success_and_records_failures() {
    let (fixture, clock) = Fixture::with_manual_clock(1).await;
    let group = fixture.group(GroupConfig::new("s").with_mode(DeliveryMode::Stream));
    let ok = enqueue(&fixture, "ok").await;
    let failing = enqueue(&fixture, "fails").await;
    let before = fixture.queue.charges().snapshot();

    let claim = claimed(group.claim(&ok, "a").await.unwrap());
    assert_eq!(
        claim.locked_until, None,
        "the lease fences stream deliveries"
    );
    group.complete(&claim).await.unwrap();
    let spent = fixture.queue.charges().snapshot().since(&before);
    assert_eq!(
        spent.total_calls(),
        0,
        "happy path writes nothing: {spent:?}"
    );
    assert!(group.read_state(&"k".into(), "ok").await.unwrap().is_none());

    let claim = claimed(group.claim(&failing, "a").await.unwrap());
    let RetryOutcome::Scheduled { at } = group
        .retry(&claim, "nope", Some(Duration::from_secs(5)))
        .await
        .unwrap()
    else {
        panic!("first failure retries");
    };
    assert_eq!(at, clock.now_ms() + 5_000, "Retry-After overrides back-off");
    clock.advance(Duration::from_secs(5));
    let due = group.due(10, None).await.unwrap();
    let again = claimed(group.take_over(due[0].clone(), "b").await.unwrap());
    assert_eq!(again.attempt, 2);
    group.complete(&again).await.unwrap();
    assert_eq!(
        group
            .read_state(&"k".into(), "fails")
            .await
            .unwrap()
            .unwrap()
            .state,
        MessageState::Completed
    );
}

#[tokio::test]
async fn duplicates_are_reported_and_batches_answer_per_message() {
    let fixture = Fixture::new(1).await;
    let q = &fixture.queue;
    let first = q
        .enqueue(
            NewMessage::json(json!(1))
                .with_id("a")
                .with_partition_key("k"),
        )
        .await
        .unwrap();
    assert!(!first.is_duplicate());
    let again = q
        .enqueue(
            NewMessage::json(json!(2))
                .with_id("a")
                .with_partition_key("k"),
        )
        .await
        .unwrap();
    assert!(
        again.is_duplicate(),
        "same id and key: a duplicate, not an error"
    );

    let results = q
        .enqueue_batch(vec![
            NewMessage::json(json!(1))
                .with_id("b")
                .with_partition_key("k"),
            NewMessage::json(json!(1))
                .with_id("a")
                .with_partition_key("k"),
            NewMessage::json(json!(1))
                .with_id("c")
                .with_partition_key("k"),
            NewMessage::json(json!(1)).with_id("bad/id"),
            NewMessage::json(json!(1))
                .with_id("d")
                .with_partition_key("other"),
        ])
        .await;
    let summary: Vec<String> = results
        .iter()
        .map(|r| match r {
            Ok(o) if o.is_duplicate() => format!("dup {}", o.id()),
            Ok(o) => format!("ok {}", o.id()),
            Err(e) => format!("err {e}"),
        })
        .collect();
    assert_eq!(summary[0], "ok b");
    assert_eq!(summary[1], "dup a");
    assert_eq!(summary[2], "ok c");
    assert!(
        summary[3].starts_with("err invalid message: message id"),
        "{}",
        summary[3]
    );
    assert_eq!(summary[4], "ok d");
    // The duplicate kept its first body.
    let a = q.read_message(&"k".into(), "a").await.unwrap().unwrap();
    assert_eq!(a.body, cosmosq_queue::Body::Json(json!(1)));

    // A clean batch on one key goes as one transactional batch.
    let before = q.charges().snapshot();
    let clean: Vec<_> = (0..50)
        .map(|i| NewMessage::json(json!(i)).with_partition_key("same"))
        .collect();
    assert!(q.enqueue_batch(clean).await.iter().all(|r| r.is_ok()));
    let spent = q.charges().snapshot().since(&before);
    assert_eq!(spent.by_operation["enqueue batch"].calls, 1, "{spent:?}");
    assert!(!spent.by_operation.contains_key("enqueue"));
}

#[tokio::test]
async fn oversized_messages_are_rejected_whole() {
    let fixture = Fixture::new(1).await;
    let big = "x".repeat(2 * 1024 * 1024);
    let err = fixture
        .queue
        .enqueue(
            NewMessage::json(json!(big))
                .with_id("big")
                .with_partition_key("k"),
        )
        .await
        .unwrap_err();
    match err {
        QueueError::InvalidMessage(MessageError::TooLarge { size }) => {
            assert!(size > 2 * 1024 * 1024)
        }
        other => panic!("expected TooLarge, got {other}"),
    }
    assert!(
        fixture
            .queue
            .read_message(&"k".into(), "big")
            .await
            .unwrap()
            .is_none(),
        "nothing stored"
    );
}
