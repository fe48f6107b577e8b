//! What every reconcile and the scaling loop share.

use std::collections::BTreeMap;
use std::sync::Arc;

use cosmosq_crds::QueueConsumerGroup;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::{Client, Resource};
use serde::Serialize;
use tokio::sync::{mpsc, RwLock};
use tracing::warn;

use crate::build::Defaults;
use crate::cosmos::Cosmos;
use crate::metrics::Metrics;

/// The latest estimate of one group, as the metrics APIs serve it.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupFigures {
    pub namespace: String,
    /// The CosmosQueue resource.
    pub queue: String,
    /// The consumer group's name in the queue.
    pub group: String,
    /// `None` while the estimate fails: the metrics APIs then answer with an error, so an HPA
    /// or KEDA keeps the replicas it has instead of reading a zero.
    pub backlog: Option<u64>,
    pub lag: Option<u64>,
    pub oldest_message_age_seconds: Option<i64>,
    pub desired_replicas: u32,
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

pub struct Context {
    pub client: Client,
    pub defaults: Defaults,
    pub cosmos: Cosmos,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    pub figures: Figures,
    /// Tells the scaling loop a group changed, so it does not wait for its next round.
    pub changed: Option<mpsc::UnboundedSender<ObjectRef<QueueConsumerGroup>>>,
}

impl Context {
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
            metrics: Arc::new(Metrics::new()),
            figures: Figures::default(),
            changed: None,
        }
    }

    /// Counts and times one reconcile of `kind`.
    pub async fn measured<T>(&self, kind: &str, work: impl std::future::Future<Output = T>) -> T {
        let started = std::time::Instant::now();
        self.metrics.reconciles.with_label_values(&[kind]).inc();
        let result = work.await;
        self.metrics
            .reconcile_duration
            .with_label_values(&[kind])
            .observe(started.elapsed().as_secs_f64());
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
