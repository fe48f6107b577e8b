//! The delivery guarantees outside the happy configuration: retentions other than the
//! default, schedules, keys of every JSON type and length, documents written by other
//! producers and by other versions, ordered groups under failures. Each test names the
//! scenario it pins; each failed before the fix it guards.

mod documents;
mod ordered;
mod ownership;
mod retention;
mod schedules;
mod settling;

use std::sync::Arc;
use std::time::Duration;

use cosmosq_emulator::EmulatorOptions;
use cosmosq_queue::{
    ClaimOutcome, Clock, Delivery, Message, MessageKey, NewMessage, Outcome, QueueConfig,
};
use cosmosq_tests::{Fixture, Ledger};
use futures::future::BoxFuture;
use serde_json::json;

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

/// The app: dead-letters the ids in `dropped` and completes the rest; `ledger` records it.
fn answering(
    ledger: &Arc<Ledger>,
    dropped: &'static [&'static str],
) -> impl Fn(Delivery) -> BoxFuture<'static, Outcome> + Clone + Send + Sync + 'static {
    ledger.handler(move |d: Delivery| async move {
        if dropped.contains(&d.message.id.as_str()) {
            Outcome::DeadLetter {
                reason: "DroppedByApp".into(),
                description: "no".into(),
            }
        } else {
            Outcome::Complete
        }
    })
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
