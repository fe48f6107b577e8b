//! Scheduled messages: work due later is not backlog and holds nothing while it waits.

use std::time::Duration;

use cosmosq_queue::host::{Host, HostOptions};
use cosmosq_queue::{DeliveryMode, GroupConfig, NewMessage, StartFrom};
use cosmosq_tests::{fast_host, Fixture, Ledger};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::*;

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
        let ledger = Ledger::new();
        let handler = answering(&ledger, &[]);
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
        ledger
            .wait_until(|l| l.given(&name).contains(&now_id))
            .await;
        stop.cancel();
        task.await.unwrap().unwrap();
        let seen = ledger.given(&name);
        assert!(
            !seen.iter().any(|id| id.contains("later")),
            "{mode:?}: a schedule was delivered early: {seen:?}"
        );
    }
}
