//! The scaling loop: every interval (and at once when a group's spec changes) it estimates
//! each group's remaining work, decides its replicas with the pure `scaling::decide`, applies
//! them through the Deployment's scale subresource (Direct mode), and writes what it saw to
//! the group's status, metrics and the figures the metrics APIs serve (HPA mode).
//!
//! A failed estimate keeps the replicas as they are and sets `Degraded`: never scale down on an
//! error.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cosmosq_crds::{CosmosQueue, QueueConsumerGroup, RangeStatus, ScalingMode};
use cosmosq_queue::estimate::GroupEstimate;
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::EventType;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, ResourceExt};
use serde_json::{json, Value};
use tokio::sync::{mpsc, Mutex};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::build::{group_name, workers_name};
use crate::context::{Context, GroupFigures};
use crate::cosmos::{group_config, CosmosError};
use crate::scaling::{self, Decision, History, Observation, Policy, Reason, Sample};
use crate::status::{self, SCALER_MANAGER};

/// Ranges listed in a group's status; beyond this the status would grow past what `kubectl`
/// shows usefully (the metrics carry the totals).
const MAX_RANGES_IN_STATUS: usize = 256;
/// Groups estimated at the same time in a round.
const CONCURRENT_ESTIMATES: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum ScalerError {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
}

/// What the loop remembers of a group between rounds.
#[derive(Default)]
struct GroupState {
    history: History,
    last_sample: Option<Sample>,
    last_scale: Option<(Time, String)>,
    /// The status last written, so an unchanged one is not written again.
    written: Option<Value>,
}

/// What one group's round did (for tests and logs).
#[derive(Clone, Debug, PartialEq)]
pub enum Round {
    /// Nothing to do yet: no queue, an invalid spec, or no Deployment (the reconciler reports).
    Skipped(&'static str),
    Decided {
        decision: Decision,
        /// Replicas before; the Deployment was scaled when they differ from the decision.
        current: u32,
        scaled: bool,
    },
}

pub struct Scaler {
    ctx: Arc<Context>,
    groups: Store<QueueConsumerGroup>,
    queues: Store<CosmosQueue>,
    state: Mutex<HashMap<ObjectRef<QueueConsumerGroup>, Arc<Mutex<GroupState>>>>,
    queue_written: Mutex<HashMap<ObjectRef<CosmosQueue>, Value>>,
}

fn millis(field: &'static str, value: &str) -> Result<i64, CosmosError> {
    humantime::parse_duration(value)
        .map(|d| d.as_millis().min(i64::MAX as u128) as i64)
        .map_err(|e| CosmosError::InvalidSpec {
            field,
            reason: e.to_string(),
        })
}

/// The decision's policy from the group's spec.
pub fn policy(qcg: &QueueConsumerGroup) -> Result<Policy, CosmosError> {
    let s = &qcg.spec.scaling;
    Ok(Policy {
        min_replicas: s.min_replicas.max(0) as u32,
        max_replicas: s.max_replicas.max(0) as u32,
        target_backlog_per_replica: s.target_backlog_per_replica.max(1) as u64,
        scale_down_stabilization_ms: millis(
            "spec.scaling.scaleDownStabilization",
            &s.scale_down_stabilization,
        )?,
        scale_to_zero_cooldown_ms: millis(
            "spec.scaling.scaleToZeroCooldown",
            &s.scale_to_zero_cooldown,
        )?,
        activation_threshold: s.activation_threshold.max(1) as u64,
    })
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}

impl Scaler {
    pub fn new(
        ctx: Arc<Context>,
        groups: Store<QueueConsumerGroup>,
        queues: Store<CosmosQueue>,
    ) -> Self {
        Self {
            ctx,
            groups,
            queues,
            state: Mutex::default(),
            queue_written: Mutex::default(),
        }
    }

    /// Rounds every `interval`, and a group at once when the reconciler reports it changed.
    pub async fn run(
        self: Arc<Self>,
        interval: Duration,
        mut changed: mpsc::UnboundedReceiver<ObjectRef<QueueConsumerGroup>>,
        shutdown: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tick.tick() => self.round().await,
                Some(group) = changed.recv() => {
                    if let Some(qcg) = self.groups.get(&group) {
                        self.scale_logged(&qcg, now_ms()).await;
                    }
                }
            }
        }
    }

    /// One round over every group, then the queues' totals.
    pub async fn round(&self) {
        let started = Instant::now();
        let groups = self.groups.state();
        let now = now_ms();
        futures::stream::iter(groups.iter())
            .for_each_concurrent(CONCURRENT_ESTIMATES, |qcg| self.scale_logged(qcg, now))
            .await;
        self.forget_deleted().await;
        if let Err(e) = self.write_queue_totals().await {
            warn!(error = %e, "could not write the queues' backlog");
        }
        self.ctx
            .metrics
            .scaling_round
            .observe(started.elapsed().as_secs_f64());
        debug!(groups = groups.len(), elapsed = ?started.elapsed(), "scaling round");
    }

    async fn scale_logged(&self, qcg: &QueueConsumerGroup, now: i64) {
        if let Err(e) = self.scale_group(qcg, now).await {
            warn!(group = %qcg.name_any(), namespace = ?qcg.namespace(), error = %e, "scaling round failed");
        }
    }

    /// Estimate → decide → scale → status, for one group.
    pub async fn scale_group(
        &self,
        qcg: &QueueConsumerGroup,
        now: i64,
    ) -> Result<Round, ScalerError> {
        let namespace = qcg.namespace().unwrap_or_default();
        let queue_ref = ObjectRef::new(&qcg.spec.queue_ref.name).within(&namespace);
        let Some(cq) = self.queues.get(&queue_ref) else {
            return Ok(Round::Skipped("queue not found"));
        };
        let (Ok(policy), Ok(group_config)) = (policy(qcg), group_config(qcg)) else {
            return Ok(Round::Skipped("invalid spec"));
        };
        let deployments: Api<Deployment> = Api::namespaced(self.ctx.client.clone(), &namespace);
        let name = workers_name(qcg);
        let Some(deployment) = deployments.get_opt(&name).await? else {
            return Ok(Round::Skipped("no Deployment yet"));
        };
        let current = deployment
            .spec
            .as_ref()
            .and_then(|s| s.replicas)
            .unwrap_or(1)
            .max(0) as u32;
        let running = deployment
            .status
            .as_ref()
            .and_then(|s| s.replicas)
            .unwrap_or(0);

        let estimate: Result<GroupEstimate, CosmosError> = async {
            let queue = self.ctx.cosmos.queue(&cq).await?;
            Ok(queue.group(group_config)?.estimate().await?)
        }
        .await;
        if estimate.is_err() {
            // Reconnect next time: the key may have been rotated or the account moved.
            self.ctx.cosmos.forget(&cq).await;
        }

        let key = ObjectRef::from_obj(qcg);
        let state = self.state.lock().await.entry(key).or_default().clone();
        let mut state = state.lock().await;
        let sample = estimate.as_ref().ok().map(|e| Sample {
            at_ms: now,
            lsn: e.lsn(),
            backlog: e.backlog(),
            replicas: current,
        });
        let (arrival_rate, rate_per_replica) = match (&state.last_sample, &sample) {
            (Some(prev), Some(next)) => scaling::rates(prev, next),
            _ => (None, None),
        };
        if sample.is_some() {
            state.last_sample = sample;
        }
        let backlog = estimate.as_ref().ok().map(GroupEstimate::backlog);
        let observation = Observation {
            now_ms: now,
            backlog,
            arrival_rate,
            rate_per_replica,
            leases: estimate.as_ref().map_or(0, |e| e.ranges.len() as u32),
            current_replicas: current,
        };
        let decision = scaling::decide(&policy, &observation, &mut state.history);
        let description = decision.reason.describe(&decision, backlog);
        let labels = [
            namespace.as_str(),
            qcg.spec.queue_ref.name.as_str(),
            &group_name(qcg),
        ];
        let direct = qcg.spec.scaling.mode == ScalingMode::Direct;

        let mut scaled = false;
        if direct && decision.replicas != current {
            deployments
                .patch_scale(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"replicas": decision.replicas}})),
                )
                .await?;
            scaled = true;
            let direction = if decision.replicas > current {
                "up"
            } else {
                "down"
            };
            self.ctx
                .metrics
                .scale_events
                .with_label_values(&[labels[0], labels[1], labels[2], direction])
                .inc();
            info!(group = %qcg.name_any(), %namespace, from = current, to = decision.replicas, "{description}");
            self.ctx
                .event(
                    qcg,
                    EventType::Normal,
                    "Scaled",
                    "Scale",
                    format!("{description} (from {current})"),
                )
                .await;
            state.last_scale = Some((status::now(), description.clone()));
        }
        // In HPA mode the HPA decides; what it set is the desired count.
        let desired = if direct { decision.replicas } else { current };

        let previous_conditions = qcg
            .status
            .as_ref()
            .map(|s| s.conditions.clone())
            .unwrap_or_default();
        let was_degraded = previous_conditions
            .iter()
            .any(|c| c.type_ == status::DEGRADED && c.status == "True");
        let degraded = match &estimate {
            Ok(e) => status::condition(
                &previous_conditions,
                status::DEGRADED,
                false,
                "EstimateHealthy",
                format!("remaining work is estimated over {} ranges", e.ranges.len()),
                qcg.metadata.generation,
                status::now(),
            ),
            Err(e) => {
                let message = format!("estimate failed; keeping {current} replicas: {e}");
                warn!(group = %qcg.name_any(), %namespace, "{message}");
                self.ctx
                    .metrics
                    .estimate_errors
                    .with_label_values(&labels)
                    .inc();
                if !was_degraded {
                    self.ctx
                        .event(
                            qcg,
                            EventType::Warning,
                            "EstimateFailed",
                            "Estimate",
                            message.clone(),
                        )
                        .await;
                }
                status::condition(
                    &previous_conditions,
                    status::DEGRADED,
                    true,
                    "EstimateFailed",
                    message,
                    qcg.metadata.generation,
                    status::now(),
                )
            }
        };

        let mut figures = GroupFigures {
            namespace: namespace.clone(),
            queue: qcg.spec.queue_ref.name.clone(),
            group: group_name(qcg),
            backlog,
            lag: None,
            oldest_message_age_seconds: None,
            desired_replicas: desired,
            error: estimate.as_ref().err().map(ToString::to_string),
            measured_at: now,
        };
        let mut status = json!({
            "replicas": running,
            "desiredReplicas": desired,
            "conditions": [degraded],
        });
        if let Ok(e) = &estimate {
            let lag = e.lag();
            figures.lag = Some(lag);
            figures.oldest_message_age_seconds =
                e.oldest_unsettled_at().map(|at| ((now - at) / 1000).max(0));
            status["backlog"] = json!(e.backlog());
            status["lag"] = json!(lag);
            status["ranges"] = json!(ranges(e));
            self.ctx
                .metrics
                .backlog
                .with_label_values(&labels)
                .set(e.backlog() as i64);
            self.ctx
                .metrics
                .lag
                .with_label_values(&labels)
                .set(lag as i64);
            self.ctx
                .metrics
                .oldest_age
                .with_label_values(&labels)
                .set(figures.oldest_message_age_seconds.unwrap_or(0));
        }
        self.ctx
            .metrics
            .desired_replicas
            .with_label_values(&labels)
            .set(i64::from(desired));
        if let Some((at, reason)) = &state.last_scale {
            status["lastScaleTime"] = json!(at);
            status["lastScaleReason"] = json!(reason);
        }
        self.ctx
            .figures
            .write()
            .await
            .insert((namespace.clone(), qcg.name_any()), figures);

        // Written only when it changed: a busy group changes every round, an idle one rarely.
        let comparable = {
            let mut s = status.clone();
            s["conditions"][0]["lastTransitionTime"] = Value::Null;
            s
        };
        if state.written.as_ref() != Some(&comparable) {
            let groups: Api<QueueConsumerGroup> =
                Api::namespaced(self.ctx.client.clone(), &namespace);
            groups
                .patch_status(
                    &qcg.name_any(),
                    &PatchParams::apply(SCALER_MANAGER).force(),
                    &Patch::Apply(json!({
                        "apiVersion": "cosmosq.io/v1alpha1", "kind": "QueueConsumerGroup",
                        "status": status
                    })),
                )
                .await?;
            state.written = Some(comparable);
        }
        if decision.reason == Reason::EstimateFailed {
            debug!(group = %qcg.name_any(), "replicas kept: the estimate failed");
        }
        Ok(Round::Decided {
            decision,
            current,
            scaled,
        })
    }

    /// Drops what the loop kept for groups that no longer exist.
    async fn forget_deleted(&self) {
        let live: Vec<ObjectRef<QueueConsumerGroup>> = self
            .groups
            .state()
            .iter()
            .map(|g| ObjectRef::from_obj(&**g))
            .collect();
        let mut state = self.state.lock().await;
        state.retain(|key, _| live.contains(key));
        let mut figures = self.ctx.figures.write().await;
        figures.retain(|(namespace, name), f| {
            let keep = live
                .iter()
                .any(|r| r.namespace.as_deref() == Some(namespace) && &r.name == name);
            if !keep {
                self.ctx
                    .metrics
                    .remove_group(&[&f.namespace, &f.queue, &f.group]);
            }
            keep
        });
    }

    /// Each queue's backlog and oldest age, summed over its groups, into its status.
    async fn write_queue_totals(&self) -> Result<(), ScalerError> {
        let mut totals: BTreeMap<(String, String), (u64, Option<i64>)> = BTreeMap::new();
        for f in self.ctx.figures.read().await.values() {
            let entry = totals
                .entry((f.namespace.clone(), f.queue.clone()))
                .or_default();
            entry.0 += f.backlog.unwrap_or(0);
            entry.1 = entry.1.max(f.oldest_message_age_seconds);
        }
        let mut written = self.queue_written.lock().await;
        for ((namespace, name), (backlog, oldest)) in totals {
            let key = ObjectRef::new(&name).within(&namespace);
            if self.queues.get(&key).is_none() {
                continue;
            }
            let mut status = json!({"backlog": backlog});
            if let Some(oldest) = oldest {
                status["oldestMessageAgeSeconds"] = json!(oldest);
            }
            if written.get(&key) == Some(&status) {
                continue;
            }
            let api: Api<CosmosQueue> = Api::namespaced(self.ctx.client.clone(), &namespace);
            api.patch_status(
                &name,
                &PatchParams::apply(SCALER_MANAGER).force(),
                &Patch::Apply(json!({
                    "apiVersion": "cosmosq.io/v1alpha1", "kind": "CosmosQueue", "status": status
                })),
            )
            .await?;
            written.insert(key, status);
        }
        Ok(())
    }
}

fn ranges(estimate: &GroupEstimate) -> Vec<RangeStatus> {
    estimate
        .ranges
        .iter()
        .take(MAX_RANGES_IN_STATUS)
        .map(|r| RangeStatus {
            range: format!("{}-{}", r.min_epk, r.max_epk),
            owner: r.owner.clone(),
            lag: r.lag.map(|l| l as i64),
            backlog: r.backlog as i64,
        })
        .collect()
}
