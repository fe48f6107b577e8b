//! Documents written by others: keys of every JSON type and length, other producers' shapes,
//! state written by a newer version, batches that fall back to one by one.

use std::time::Duration;

use cosmosq_queue::state::state_pk;
use cosmosq_queue::{Clock, GroupConfig, MessageKey, MessageState, NewMessage, QueueError};
use cosmosq_tests::Fixture;
use serde_json::{json, Value};

use super::*;

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
