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
use cosmosq_queue::clock::{duration_ms, system_now_ms as now_ms};
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
use crate::scaling::{Autoscaler, Decision, Policy, Reason};
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
    scaling: Autoscaler,
    last_scale: Option<(Time, String)>,
    /// The status last written, so an unchanged one is not written again, and when.
    written: Option<(Value, tokio::time::Instant)>,
}

/// How often a status whose only change is in the figures (backlog, lag, ranges) is written:
/// a busy group's figures change every round, and 100 groups must not mean 400 writes a minute.
/// Replicas, decisions and conditions are written at once.
pub const FIGURES_STATUS_INTERVAL: Duration = Duration::from_secs(60);

/// Whether a new status is worth a write (pure): anything but the figures changed, or the
/// figures changed and the last write is `FIGURES_STATUS_INTERVAL` old.
fn status_due(
    written: Option<&(Value, tokio::time::Instant)>,
    status: &Value,
    now: tokio::time::Instant,
) -> bool {
    let Some((before, at)) = written else {
        return true;
    };
    if before == status {
        return false;
    }
    let without_figures = |s: &Value| {
        let mut s = s.clone();
        if let Some(map) = s.as_object_mut() {
            for figure in ["backlog", "lag", "ranges"] {
                map.remove(figure);
            }
        }
        s
    };
    without_figures(before) != without_figures(status)
        || now.duration_since(*at) >= FIGURES_STATUS_INTERVAL
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
            let group = queue.group(group_config)?;
            Ok(group
                .estimate_or_create_leases(
                    now,
                    duration_ms(cosmosq_queue::host::DEFAULT_LEASE_EXPIRE),
                )
                .await?)
        }
        .await;
        if estimate.is_err() {
            // Reconnect next time: the key may have been rotated or the account moved.
            self.ctx.cosmos.forget(&cq).await;
        }

        let key = ObjectRef::from_obj(qcg);
        let state = self.state.lock().await.entry(key).or_default().clone();
        let mut state = state.lock().await;
        if state.last_scale.is_none() {
            // After a restart, the last scale is what the status says (not forgotten).
            let status = qcg.status.as_ref();
            if let (Some(at), Some(reason)) = (
                status.and_then(|s| s.last_scale_time.clone()),
                status.and_then(|s| s.last_scale_reason.clone()),
            ) {
                state.last_scale = Some((at, reason));
            }
        }
        let (observation, decision) =
            state
                .scaling
                .round(&policy, now, estimate.as_ref().ok(), current);
        let backlog = observation.backlog;
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
                    &PatchParams {
                        field_manager: Some(SCALER_MANAGER.into()),
                        ..PatchParams::default()
                    },
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
        let now_instant = tokio::time::Instant::now();
        if status_due(state.written.as_ref(), &comparable, now_instant) {
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
            state.written = Some((comparable, now_instant));
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

    /// Each queue's backlog and oldest age, summed over its groups, into its status. A queue
    /// with a group whose estimate failed keeps its last total: a partial sum would read low.
    async fn write_queue_totals(&self) -> Result<(), ScalerError> {
        let mut totals: BTreeMap<(String, String), (Option<u64>, Option<i64>)> = BTreeMap::new();
        for f in self.ctx.figures.read().await.values() {
            let entry = totals
                .entry((f.namespace.clone(), f.queue.clone()))
                .or_insert((Some(0), None));
            entry.0 = entry.0.zip(f.backlog).map(|(a, b)| a + b);
            entry.1 = entry.1.max(f.oldest_message_age_seconds);
        }
        let mut written = self.queue_written.lock().await;
        for ((namespace, name), (backlog, oldest)) in totals {
            let key = ObjectRef::new(&name).within(&namespace);
            let Some(backlog) = backlog else { continue };
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_alone_are_written_at_a_bounded_rate() {
        let t0 = tokio::time::Instant::now();
        let status = |backlog: u64, desired: u32| json!({"replicas": 2, "desiredReplicas": desired, "backlog": backlog, "lag": backlog});
        let written = (status(100, 2), t0);
        let at = |s: u64| t0 + Duration::from_secs(s);
        for (new, now, due) in [
            (status(100, 2), 100, false), // nothing changed
            (status(120, 2), 15, false),  // figures only, 15 s after the last write
            (status(120, 2), 60, true),   // figures only, a minute after
            (status(120, 3), 15, true),   // a decision: at once
        ] {
            assert_eq!(
                status_due(Some(&written), &new, at(now)),
                due,
                "{new} at {now}"
            );
        }
        assert!(
            status_due(None, &status(0, 0), t0),
            "the first status is written"
        );
    }
    use crate::testing::{
        emulator_context, group_json, json_response, queue_json, ApiServerVerifier,
    };
    use cosmosq_queue::lease::LeaseStore;
    use cosmosq_queue::NewMessage;
    use http::{Method, StatusCode};
    use kube::runtime::reflector::store::Writer;
    use kube::runtime::watcher;

    const DEPLOYMENT: &str = "/apis/apps/v1/namespaces/shop/deployments/billing-workers";
    const SCALE: &str = "/apis/apps/v1/namespaces/shop/deployments/billing-workers/scale";
    const GROUP_STATUS: &str =
        "/apis/cosmosq.io/v1alpha1/namespaces/shop/queueconsumergroups/billing/status";
    const QUEUE_STATUS: &str =
        "/apis/cosmosq.io/v1alpha1/namespaces/shop/cosmosqueues/orders/status";

    fn store<K>(objects: Vec<Value>) -> Store<K>
    where
        K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + 'static,
    {
        let mut writer = Writer::<K>::default();
        for object in objects {
            let object: K = serde_json::from_value(object).unwrap();
            writer.apply_watcher_event(&watcher::Event::Apply(object));
        }
        writer.as_reader()
    }

    fn deployment(replicas: i32) -> Value {
        json!({"apiVersion": "apps/v1", "kind": "Deployment",
               "metadata": {"name": "billing-workers", "namespace": "shop"},
               "spec": {"replicas": replicas, "selector": {}, "template": {}},
               "status": {"replicas": replicas}})
    }

    impl ApiServerVerifier {
        async fn deployment(&mut self, replicas: i32) {
            self.answer(
                Method::GET,
                DEPLOYMENT,
                json_response(StatusCode::OK, &deployment(replicas)),
            )
            .await;
        }

        async fn scale(&mut self) -> Value {
            let seen = self.expect(Method::PATCH, SCALE).await;
            let scale = json!({"apiVersion": "autoscaling/v1", "kind": "Scale",
                               "metadata": {"name": "billing-workers", "namespace": "shop"},
                               "spec": seen.body["spec"].clone()});
            seen.send
                .send_response(json_response(StatusCode::OK, &scale));
            seen.body
        }

        /// A status written by the scaling loop's own field manager.
        async fn scaler_status(&mut self, path: &str, object: Value) -> Value {
            let seen = self.expect(Method::PATCH, path).await;
            assert!(
                seen.query.contains("fieldManager=cosmosq-operator-scaler"),
                "{}",
                seen.query
            );
            let mut object = object;
            object["status"] = seen.body["status"].clone();
            seen.send
                .send_response(json_response(StatusCode::OK, &object));
            seen.body["status"].clone()
        }
    }

    /// A provisioned queue holding `messages` unread by group `billing` (4 leases, reading from
    /// the beginning), and a scaler whose stores hold the queue and the group.
    async fn setup(
        scaling: Value,
        messages: usize,
        container: &str,
    ) -> (Scaler, ApiServerVerifier, Value) {
        let (ctx, server, _cosmos) = emulator_context().await;
        let mut queue = queue_json();
        let provisioned: CosmosQueue = serde_json::from_value(queue.clone()).unwrap();
        let q = ctx.cosmos.provision(&provisioned).await.unwrap().0;
        LeaseStore::new(q.clone(), "billing")
            .reconcile(now_ms(), 60_000)
            .await
            .unwrap();
        let batch = (0..messages)
            .map(|i| NewMessage::json(json!({"n": i})))
            .collect();
        for result in q.enqueue_batch(batch).await {
            result.unwrap();
        }
        queue["spec"]["container"] = json!(container);
        ctx.cosmos.forget(&provisioned).await;
        let group = group_json(json!({"startFrom": "beginning", "scaling": scaling}));
        let scaler = Scaler::new(ctx, store(vec![group.clone()]), store(vec![queue]));
        (scaler, server, group)
    }

    #[tokio::test]
    async fn a_backlog_scales_the_workers_up_and_is_reported() {
        let (scaler, mut server, group) =
            setup(json!({"targetBacklogPerReplica": 100}), 250, "orders").await;
        let verifier = tokio::spawn(async move {
            server.deployment(1).await;
            let scale = server.scale().await;
            assert_eq!(scale, json!({"spec": {"replicas": 3}}));
            let event = server.event().await;
            assert_eq!(event["reason"], "Scaled");
            assert!(event["note"]
                .as_str()
                .unwrap()
                .contains("backlog 250: scaling up to 3 (from 1)"));
            let status = server.scaler_status(GROUP_STATUS, group.clone()).await;
            let queue = server.scaler_status(QUEUE_STATUS, queue_json()).await;
            // Next round: the three replicas run; only that changed in the status.
            server.deployment(3).await;
            let next = server.scaler_status(GROUP_STATUS, group.clone()).await;
            assert_eq!(
                (next["replicas"].as_i64(), next["backlog"].as_i64()),
                (Some(3), Some(250))
            );
            // And then nothing changed, so nothing is written.
            server.deployment(3).await;
            (server, status, queue)
        });
        for _ in 0..3 {
            scaler.round().await;
        }
        let (server, status, queue) = verifier.await.unwrap();
        assert_eq!(status["backlog"], 250);
        assert_eq!(status["lag"], 250);
        assert_eq!(status["desiredReplicas"], 3);
        assert_eq!(status["ranges"].as_array().unwrap().len(), 4);
        assert_eq!(
            status["ranges"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["backlog"].as_i64().unwrap())
                .sum::<i64>(),
            250
        );
        assert_eq!(status["lastScaleReason"], "backlog 250: scaling up to 3");
        assert_eq!(status["conditions"][0]["type"], "Degraded");
        assert_eq!(status["conditions"][0]["status"], "False");
        assert_eq!(queue["backlog"], 250);
        let figures = scaler.ctx.figures.read().await;
        let f = &figures[&("shop".to_owned(), "billing".to_owned())];
        assert_eq!((f.backlog, f.desired_replicas), (Some(250), 3));
        assert_eq!(
            scaler
                .ctx
                .metrics
                .backlog
                .with_label_values(&["shop", "orders", "billing"])
                .get(),
            250
        );
        drop(figures);
        drop(scaler);
        server.done().await;
    }

    #[tokio::test]
    async fn an_empty_queue_scales_down_after_the_window() {
        let (scaler, mut server, group) = setup(
            json!({"minReplicas": 1, "scaleDownStabilization": "0s"}),
            0,
            "orders",
        )
        .await;
        let verifier = tokio::spawn(async move {
            server.deployment(5).await;
            assert_eq!(server.scale().await, json!({"spec": {"replicas": 1}}));
            server.event().await;
            server.scaler_status(GROUP_STATUS, group).await
        });
        let round = scaler
            .scale_group(&scaler.groups.state()[0], now_ms())
            .await
            .unwrap();
        assert_eq!(
            round,
            Round::Decided {
                decision: Decision {
                    replicas: 1,
                    reason: Reason::ScaleDown
                },
                current: 5,
                scaled: true
            }
        );
        let status = verifier.await.unwrap();
        assert_eq!(status["backlog"], 0);
    }

    #[tokio::test]
    async fn a_failed_estimate_keeps_the_replicas_and_degrades_the_group() {
        // The queue resource points at a container that does not exist.
        let (scaler, mut server, group) = setup(json!({}), 10, "missing").await;
        let verifier = tokio::spawn(async move {
            server.deployment(5).await;
            // No scale request: straight to the Warning and the status.
            let event = server.event().await;
            assert_eq!(
                (&event["type"], &event["reason"]),
                (&json!("Warning"), &json!("EstimateFailed"))
            );
            let status = server.scaler_status(GROUP_STATUS, group).await;
            (server, status)
        });
        scaler.round().await;
        let (server, status) = verifier.await.unwrap();
        assert_eq!(status["conditions"][0]["status"], "True");
        assert_eq!(status["conditions"][0]["reason"], "EstimateFailed");
        assert!(status.get("backlog").is_none(), "unknown, not zero");
        assert_eq!(status["desiredReplicas"], 5);
        let figures = scaler.ctx.figures.read().await;
        assert_eq!(
            figures[&("shop".to_owned(), "billing".to_owned())].backlog,
            None
        );
        drop(figures);
        drop(scaler);
        server.done().await; // and no queue total was written from a partial sum
    }

    #[tokio::test]
    async fn hpa_mode_measures_but_leaves_the_replicas_to_the_hpa() {
        let (scaler, mut server, mut group) = setup(json!({"mode": "HPA"}), 150, "orders").await;
        // What an earlier operator process recorded survives this one's first write.
        group["status"] = json!({"lastScaleTime": "2026-11-30T09:00:00Z",
                                 "lastScaleReason": "backlog 900: scaling up to 9"});
        let scaler = Scaler::new(
            scaler.ctx.clone(),
            store(vec![group.clone()]),
            scaler.queues.clone(),
        );
        let verifier = tokio::spawn(async move {
            server.deployment(2).await;
            server.scaler_status(GROUP_STATUS, group).await
        });
        let round = scaler
            .scale_group(&scaler.groups.state()[0], now_ms())
            .await
            .unwrap();
        assert!(
            matches!(
                round,
                Round::Decided {
                    scaled: false,
                    current: 2,
                    ..
                }
            ),
            "{round:?}"
        );
        let status = verifier.await.unwrap();
        assert_eq!(
            (
                status["backlog"].as_u64(),
                status["desiredReplicas"].as_u64()
            ),
            (Some(150), Some(2))
        );
        assert_eq!(status["lastScaleReason"], "backlog 900: scaling up to 9");
        assert_eq!(status["lastScaleTime"], "2026-11-30T09:00:00Z");
        let figures = scaler.ctx.figures.read().await;
        assert_eq!(
            figures[&("shop".to_owned(), "billing".to_owned())].backlog,
            Some(150)
        );
    }

    #[tokio::test]
    async fn a_group_no_sidecar_has_started_is_seen_and_woken_from_zero() {
        let (ctx, mut server, _cosmos) = emulator_context().await;
        let cq: CosmosQueue = serde_json::from_value(queue_json()).unwrap();
        let queue = ctx.cosmos.provision(&cq).await.unwrap().0;
        // Enqueued before the group exists: "now" excludes it.
        queue
            .enqueue(NewMessage::json(json!({"early": true})))
            .await
            .unwrap();
        let group = group_json(json!({"scaling": {"minReplicas": 0, "activationThreshold": 3}}));
        let scaler = Scaler::new(ctx, store(vec![group.clone()]), store(vec![queue_json()]));
        let verifier = tokio::spawn(async move {
            server.deployment(0).await;
            let first = server.scaler_status(GROUP_STATUS, group.clone()).await;
            server.scaler_status(QUEUE_STATUS, queue_json()).await;
            server.deployment(0).await;
            assert_eq!(server.scale().await, json!({"spec": {"replicas": 1}}));
            let event = server.event().await;
            assert!(
                event["note"]
                    .as_str()
                    .unwrap()
                    .contains("activation threshold"),
                "{event}"
            );
            server.scaler_status(GROUP_STATUS, group).await;
            first
        });
        // Round 1 creates the leases at the feed's current position: nothing to do yet.
        scaler.round().await;
        for i in 0..3 {
            queue
                .enqueue(NewMessage::json(json!({"n": i})))
                .await
                .unwrap();
        }
        // Round 2 sees the three messages: the threshold wakes the group.
        let round = scaler
            .scale_group(&scaler.groups.state()[0], now_ms())
            .await
            .unwrap();
        assert_eq!(
            round,
            Round::Decided {
                decision: Decision {
                    replicas: 1,
                    reason: Reason::Activated
                },
                current: 0,
                scaled: true
            }
        );
        let first = verifier.await.unwrap();
        assert_eq!(
            first["backlog"], 0,
            "the message from before the group is not its work"
        );
        assert_eq!(
            first["ranges"].as_array().unwrap().len(),
            4,
            "one lease per partition"
        );
    }
}
