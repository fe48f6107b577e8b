//! What every reconcile and the scaling loop share.

use std::collections::BTreeMap;
use std::sync::Arc;

use cosmosq_crds::QueueConsumerGroup;
use kube::runtime::events::{Event, EventType, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::{Client, Resource};
use serde::Serialize;
use tokio::sync::{mpsc, RwLock};
use tracing::warn;

use cosmosq_program::telemetry::{self, Attribute, Telemetry};

use crate::build::Defaults;
use crate::cosmos::Cosmos;
use crate::events::Recorder;
use crate::metrics::OperatorMetrics;

/// The latest estimate of one group, as the metrics APIs serve it.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupFigures {
    /// The group's namespace.
    pub namespace: String,
    /// The CosmosQueue resource.
    pub queue: String,
    /// The consumer group's name in the queue.
    pub group: String,
    /// `None` while the estimate fails: the metrics APIs then answer with an error, so an HPA
    /// or KEDA keeps the replicas it has instead of reading a zero.
    pub backlog: Option<u64>,
    /// Messages the group has not read; `None` while the estimate fails.
    pub lag: Option<u64>,
    /// Age of the oldest unsettled message.
    pub oldest_message_age_seconds: Option<i64>,
    /// Workers the decision wants.
    pub desired_replicas: u32,
    /// Why the estimate failed.
    pub error: Option<String>,
    /// When it was measured (epoch ms).
    pub measured_at: i64,
}

/// Latest figures by QueueConsumerGroup (namespace, name).
pub type Figures = Arc<RwLock<BTreeMap<(String, String), GroupFigures>>>;

/// A reconciler's error, as the errors metric counts it.
pub trait ReconcileFailure: std::fmt::Display {
    /// The resource kind the reconciler serves.
    const RESOURCE: &'static str;
    /// A bounded label: what kind of error.
    fn kind(&self) -> &'static str;
}

/// What every reconcile and round shares.
pub struct Context {
    /// The API server.
    pub client: Client,
    /// This installation's defaults.
    pub defaults: Defaults,
    /// Connections to the queues' accounts.
    pub cosmos: Cosmos,
    /// Publishes Events.
    pub recorder: Recorder,
    /// The operator's metrics.
    pub metrics: Arc<OperatorMetrics>,
    /// The figures the metrics APIs serve.
    pub figures: Figures,
    /// Tells the scaling loop a group changed, so it does not wait for its next round.
    pub changed: Option<mpsc::UnboundedSender<ObjectRef<QueueConsumerGroup>>>,
    /// Asks the group controller for a reconcile (a key the group reads was rotated).
    pub reconcile: Option<mpsc::UnboundedSender<ObjectRef<QueueConsumerGroup>>>,
    /// Where reconcile spans go (nowhere unless OTLP export is on).
    pub telemetry: Telemetry,
    /// Failed reconciles in a row, per object: each waits longer before its retry.
    failures: std::sync::Mutex<std::collections::HashMap<String, u32>>,
}

/// How often a queue that reconciled cleanly is looked at again (a resync: drift that no
/// watch event reports, such as containers deleted behind the operator's back).
pub const RESYNC: std::time::Duration = std::time::Duration::from_secs(300);
/// How often a group that reconciled cleanly is looked at again, give or take a tenth
/// ([`group_resync`]): its changes, its queues' and its workers' reach it through watches and
/// a rotated key through the key checks ([`crate::keys`]), so this only repairs drift no
/// watch reports (a ServiceAccount or RoleBinding changed by hand). At 5,000 groups, every 5
/// minutes was 10,000 requests a minute to the API server for nothing.
pub const GROUP_RESYNC: std::time::Duration = std::time::Duration::from_secs(3600);

/// When a group is resynced (pure): [`GROUP_RESYNC`] spread by its uid over ±10 %, so groups
/// made together (an operator start, `kubectl apply` of a directory) are not all looked at
/// again in the same second.
pub fn group_resync(uid: &str) -> std::time::Duration {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    uid.hash(&mut hasher);
    let spread = (hasher.finish() % 2001) as f64 / 10_000.0; // 0 ..= 0.2
    GROUP_RESYNC.mul_f64(0.9 + spread)
}
/// How soon an object waiting on something outside it (a missing queue, a Cosmos DB error) is
/// looked at again.
pub const RECHECK: std::time::Duration = std::time::Duration::from_secs(30);

/// The first retry after a failed reconcile, doubled per failure in a row up to
/// [`RETRY_MAX`] (as controller-runtime's per-item rate limiter does): an object that keeps
/// failing does not keep the API server or Cosmos DB busy.
pub const RETRY_FIRST: std::time::Duration = std::time::Duration::from_secs(5);
/// The longest back-off between retries of a failing object.
pub const RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(300);

/// How long to wait after the `failures`-th failure in a row (pure).
pub fn retry_after(failures: u32) -> std::time::Duration {
    let factor = 1u32 << failures.saturating_sub(1).min(16);
    RETRY_FIRST.saturating_mul(factor).min(RETRY_MAX)
}

fn failure_key<K: kube::Resource>(kind: &str, object: &K) -> String {
    format!(
        "{kind}/{}/{}",
        object.meta().namespace.as_deref().unwrap_or_default(),
        object.meta().name.as_deref().unwrap_or_default()
    )
}

impl Context {
    /// A context over `client`; `changed` tells the scaling loop which groups changed.
    pub fn new(
        client: Client,
        defaults: Defaults,
        cosmos: Cosmos,
        instance: Option<String>,
    ) -> Self {
        let reporter = Reporter {
            controller: crate::apply::FIELD_MANAGER.into(),
            instance,
        };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            defaults,
            cosmos,
            metrics: Arc::new(OperatorMetrics::new()),
            figures: Figures::default(),
            changed: None,
            reconcile: None,
            telemetry: Telemetry::off(),
            failures: Default::default(),
        }
    }

    /// Counts a failed reconcile of `object`; returns how long to wait before the retry.
    pub fn failed<K: kube::Resource>(&self, kind: &str, object: &K) -> std::time::Duration {
        let mut failures = self.failures.lock().expect("failures");
        let count = failures.entry(failure_key(kind, object)).or_insert(0);
        *count = count.saturating_add(1);
        retry_after(*count)
    }

    /// A reconcile of `object` succeeded: its next failure starts the back-off again.
    pub fn succeeded<K: kube::Resource>(&self, kind: &str, object: &K) {
        self.failures
            .lock()
            .expect("failures")
            .remove(&failure_key(kind, object));
    }

    /// Counts, times and traces one reconcile of `object`, a `kind`.
    pub async fn measured<K: Resource, T, E: std::fmt::Display>(
        &self,
        kind: &'static str,
        object: &K,
        work: impl std::future::Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        let mut span = self.telemetry.span(telemetry::Kind::Internal, None, || {
            let meta = object.meta();
            let attributes = vec![
                Attribute::new(
                    "k8s.namespace.name",
                    meta.namespace.clone().unwrap_or_default(),
                ),
                Attribute::new("cosmosq.resource.kind", kind),
                Attribute::new(
                    "cosmosq.resource.name",
                    meta.name.clone().unwrap_or_default(),
                ),
                Attribute::new("cosmosq.resource.generation", meta.generation.unwrap_or(0)),
            ];
            (format!("reconcile {kind}"), attributes)
        });
        let started = std::time::Instant::now();
        self.metrics.reconciles.with_label_values(&[kind]).inc();
        let result = work.await;
        self.metrics
            .reconcile_duration
            .with_label_values(&[kind])
            .observe(started.elapsed().as_secs_f64());
        if let Err(e) = &result {
            span.fail(e.to_string());
        }
        result
    }

    /// Publishes an Event; failing to is logged, never fatal (Events are best effort).
    pub async fn event<K>(
        &self,
        object: &K,
        type_: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) where
        K: Resource<DynamicType = ()>,
    {
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(truncate(note, 1000)),
            action: action.into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&event, &object.object_ref(&())).await {
            warn!(reason, error = %e, "could not publish an Event");
        }
    }
}

/// Event notes are limited to 1 kB.
fn truncate(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_back_off_per_failure_up_to_five_minutes() {
        let secs = |n| retry_after(n).as_secs();
        assert_eq!(
            [1, 2, 3, 4, 5, 6, 7, 100].map(secs),
            [5, 10, 20, 40, 80, 160, 300, 300]
        );
    }

    #[test]
    fn groups_made_together_are_resynced_apart_within_a_tenth_of_the_hour() {
        let resyncs: Vec<_> = (0..1000)
            .map(|n| group_resync(&format!("uid-{n}")))
            .collect();
        assert!(resyncs
            .iter()
            .all(|r| *r >= GROUP_RESYNC.mul_f64(0.9) && *r <= GROUP_RESYNC.mul_f64(1.1)));
        let minutes: std::collections::BTreeSet<u64> =
            resyncs.iter().map(|r| r.as_secs() / 60).collect();
        assert!(
            minutes.len() >= 12,
            "spread over the 12 minutes: {minutes:?}"
        );
        assert_eq!(
            group_resync("uid-7"),
            group_resync("uid-7"),
            "the same each time"
        );
    }
}
