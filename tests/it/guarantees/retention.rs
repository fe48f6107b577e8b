//! Retentions other than the default: a schedule, a retry and a state document live as long as
//! the queue's messages do, and no longer.

use std::time::Duration;

use cosmosq_queue::host::Host;
use cosmosq_queue::state::{state_ttl_secs, REASON_EXPIRED};
use cosmosq_queue::{ClaimOutcome, Clock, GroupConfig, MessageState, NewMessage};
use cosmosq_tests::{fast_host, Ledger};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::*;

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
    let ledger = Ledger::new();
    let host = Host::new(group.clone(), ledger.completing(), fast_host("h"));
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
