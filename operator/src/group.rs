//! Reconciling a QueueConsumerGroup: fetch its queue → validate and build (pure) → apply →
//! status. Invalid specs are reported in the `Ready` condition and an Event naming the field,
//! and wait for a change; transient errors go back to the controller, which retries.

use std::sync::Arc;
use std::time::Duration;

use cosmosq_crds::{CosmosQueue, QueueConsumerGroup, QueueConsumerGroupStatus};
use k8s_openapi::api::apps::v1::DeploymentStatus;
use kube::api::PatchParams;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::{Api, ResourceExt};
use tracing::{info, instrument, warn};

use crate::apply::{apply_group, ApplyError, FIELD_MANAGER};
use crate::context::{Context, ReconcileFailure};
use crate::rollout::Rollout;
use crate::status::{self, reasons, Progress};

/// The resource kind, as metrics and logs name it.
pub const KIND: &str = "QueueConsumerGroup";
/// How soon a group whose objects or pods were refused is looked at again.
const RETRY_REFUSED: Duration = Duration::from_secs(60);

/// What the Deployment says of the workers (pure).
#[derive(Debug, PartialEq)]
struct Workers {
    /// `ReplicaFailure=True`: pods cannot be created, and nothing will change that by itself.
    failure: Option<String>,
    /// The Deployment's `Available`: (status, reason, message).
    available: Option<(bool, String, String)>,
}

fn workers(status: Option<&DeploymentStatus>) -> Workers {
    let conditions = status
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default();
    let find = |type_: &str| conditions.iter().find(|c| c.type_ == type_);
    Workers {
        failure: find("ReplicaFailure")
            .filter(|c| c.status == "True")
            .map(|c| {
                format!(
                    "the Deployment cannot create worker pods ({}): {}",
                    c.reason.as_deref().unwrap_or("ReplicaFailure"),
                    c.message.as_deref().unwrap_or_default()
                )
            }),
        available: find("Available").map(|c| {
            (
                c.status == "True",
                c.reason.clone().unwrap_or_else(|| "Unknown".into()),
                c.message.clone().unwrap_or_default(),
            )
        }),
    }
}

/// What can fail a group's reconcile (and is retried).
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// The apply failed.
    #[error(transparent)]
    Apply(#[from] ApplyError),
    /// Another API call failed.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// The group has no namespace.
    #[error("{0} has no namespace")]
    NoNamespace(String),
}

impl ReconcileFailure for ReconcileError {
    const RESOURCE: &'static str = KIND;

    fn kind(&self) -> &'static str {
        match self {
            ReconcileError::Apply(_) => "apply",
            ReconcileError::Kube(_) => "kube",
            ReconcileError::NoNamespace(_) => "invalid_object",
        }
    }
}

/// The outcome of a pass, before it is written to status.
struct Outcome {
    ok: bool,
    /// What kstatus readers are told; `Done` only with `ok` and a finished rollout.
    progress: Progress,
    /// The reason and message of `Reconciling`/`Stalled` when not `Ready`'s (a rollout).
    progress_said: Option<(&'static str, String)>,
    reason: &'static str,
    message: String,
    action: Action,
}

/// One pass over a group.
pub async fn reconcile_group(
    qcg: Arc<QueueConsumerGroup>,
    ctx: Arc<Context>,
) -> Result<Action, ReconcileError> {
    let result = ctx
        .measured(KIND, qcg.as_ref(), reconcile(&qcg, &ctx))
        .await;
    if result.is_ok() {
        ctx.succeeded(KIND, qcg.as_ref());
    }
    result
}

/// The queues of `spec.publishTo`, in its order, or the name of the first that does not exist.
async fn publish_targets(
    queues: &Api<CosmosQueue>,
    qcg: &QueueConsumerGroup,
) -> Result<Result<Vec<CosmosQueue>, String>, kube::Error> {
    let mut found = Vec::new();
    for target in &qcg.spec.publish_to {
        let name = &target.queue_ref.name;
        match queues.get_opt(name).await? {
            Some(queue) => found.push(queue),
            None => return Ok(Err(name.clone())),
        }
    }
    Ok(Ok(found))
}

#[instrument(skip_all, fields(namespace = ?qcg.namespace(), group = %qcg.name_any()))]
async fn reconcile(qcg: &QueueConsumerGroup, ctx: &Context) -> Result<Action, ReconcileError> {
    let namespace = qcg
        .namespace()
        .ok_or_else(|| ReconcileError::NoNamespace(qcg.name_any()))?;
    let queues: Api<CosmosQueue> = Api::namespaced(ctx.client.clone(), &namespace);
    let queue_name = &qcg.spec.queue_ref.name;
    let mut available = None;
    // Kept as they were when nothing was applied (a missing queue, a refused apply).
    let mut built = qcg
        .status
        .as_ref()
        .map(|s| (s.workers_built_by.clone(), s.pending_update.clone()))
        .unwrap_or_default();
    let queue = queues.get_opt(queue_name).await?;
    let targets = match &queue {
        Some(_) => publish_targets(&queues, qcg).await?,
        None => Ok(Vec::new()),
    };
    let outcome = match (queue, targets) {
        (None, _) => Outcome {
            ok: false,
            reason: reasons::QUEUE_NOT_FOUND,
            progress: Progress::Reconciling,
            progress_said: None,
            message: format!("CosmosQueue {queue_name} does not exist in {namespace}"),
            action: Action::requeue(crate::context::RECHECK),
        },
        (Some(_), Err(missing)) => Outcome {
            ok: false,
            reason: reasons::PUBLISH_QUEUE_NOT_FOUND,
            progress: Progress::Reconciling,
            progress_said: None,
            message: format!(
                "spec.publishTo: CosmosQueue {missing} does not exist in {namespace} (a group \
                 publishes to queues of its own namespace)"
            ),
            action: Action::requeue(crate::context::RECHECK),
        },
        (Some(queue), Ok(targets)) => {
            match apply_group(&ctx.client, qcg, &queue, &targets, &ctx.defaults).await {
                Ok(applied) => {
                    built = (
                        applied.running.as_ref().map(|r| r.operator.clone()),
                        applied
                            .held
                            .as_ref()
                            .map(|(next, why)| format!("{}: {why}", next.operator)),
                    );
                    let state = workers(applied.workers.as_ref());
                    // A rollout is said in the Deployment's own words where it has them.
                    let deployment = &applied.deployment;
                    let (rollout_progress, progress_said) = match &applied.rollout {
                        Rollout::Done => (Progress::Done, None),
                        Rollout::Going => {
                            let said = match &state.available {
                                Some((false, _, message)) => format!(": {message}"),
                                _ => String::new(),
                            };
                            (
                                Progress::Reconciling,
                                Some((
                                    reasons::ROLLING_OUT,
                                    format!(
                                        "waiting for the rollout of Deployment {deployment}{said}"
                                    ),
                                )),
                            )
                        }
                        Rollout::Stopped(why) => (
                            Progress::Stalled,
                            Some((
                                reasons::ROLLOUT_STOPPED,
                                format!("the rollout of Deployment {deployment} stopped: {why}"),
                            )),
                        ),
                    };
                    // A group waiting for its turn in the rollout budget looks again soon.
                    let recheck = applied.held.is_some();
                    available = state.available;
                    match state.failure {
                        Some(message) => Outcome {
                            ok: false,
                            reason: reasons::REPLICA_FAILURE,
                            progress: Progress::Stalled,
                            progress_said: None,
                            message,
                            action: Action::requeue(RETRY_REFUSED),
                        },
                        None => Outcome {
                            ok: true,
                            reason: reasons::APPLIED,
                            progress: rollout_progress,
                            progress_said,
                            message: format!("Deployment {} is up to date", applied.deployment),
                            action: Action::requeue(if recheck {
                                crate::context::RECHECK
                            } else {
                                crate::context::group_resync(&qcg.uid().unwrap_or_default())
                            }),
                        },
                    }
                }
                // Refused by the API server's validation or admission: the owner must act (or
                // a policy change), so say so in status and look again now and then.
                Err(ApplyError::Kube(kube::Error::Api(e))) if matches!(e.code, 400 | 403 | 422) => {
                    Outcome {
                        ok: false,
                        reason: reasons::APPLY_REJECTED,
                        progress: Progress::Stalled,
                        progress_said: None,
                        message: format!("the API server refused the workers: {}", e.message),
                        action: Action::requeue(RETRY_REFUSED),
                    }
                }
                // An object of the group's name that someone else made: theirs until they remove
                // or rename it (a change the group does not see: look again now and then).
                Err(e @ ApplyError::NotOwned { .. }) => Outcome {
                    ok: false,
                    reason: reasons::NOT_OWNED,
                    progress: Progress::Stalled,
                    progress_said: None,
                    message: e.to_string(),
                    action: Action::requeue(RETRY_REFUSED),
                },
                // Nothing is written for an invalid spec; it waits for its owner to fix it.
                Err(ApplyError::Spec(e)) => Outcome {
                    ok: false,
                    reason: reasons::INVALID_SPEC,
                    progress: Progress::Stalled,
                    progress_said: None,
                    message: e.to_string(),
                    action: Action::await_change(),
                },
                Err(e) => return Err(e.into()),
            }
        }
    };
    let generation = qcg.metadata.generation;
    let previous = qcg.status.clone().unwrap_or_default();
    let spec_changed = previous.observed_generation != generation;
    let ready_before = previous
        .conditions
        .iter()
        .find(|c| c.type_ == status::READY)
        .map(|c| (c.status == "True", c.reason.clone()));
    let changed = spec_changed || ready_before != Some((outcome.ok, outcome.reason.to_owned()));
    let kind = if outcome.ok {
        info!("{}", outcome.message);
        EventType::Normal
    } else {
        warn!(reason = outcome.reason, "{}", outcome.message);
        EventType::Warning
    };
    if changed {
        ctx.event(qcg, kind, outcome.reason, "Apply", outcome.message.clone())
            .await;
    }
    let (progress_reason, progress_message) = match &outcome.progress_said {
        Some((reason, message)) => (*reason, message.clone()),
        None => (outcome.reason, outcome.message.clone()),
    };
    // Only the fields this reconciler owns; the scaling loop writes the rest of the status.
    let ready = status::condition(
        &previous.conditions,
        status::READY,
        outcome.ok,
        outcome.reason,
        outcome.message,
        generation,
        status::now(),
    );
    let mut conditions = vec![ready];
    conditions.extend(status::progress(
        &previous.conditions,
        outcome.progress,
        progress_reason,
        &progress_message,
        generation,
        &status::now(),
    ));
    if let Some((ok, reason, message)) = available {
        conditions.push(status::condition(
            &previous.conditions,
            status::AVAILABLE,
            ok,
            &reason,
            message,
            generation,
            status::now(),
        ));
    }
    let (workers_built_by, pending_update) = built;
    if pending_update.is_some() && pending_update != previous.pending_update {
        ctx.event(
            qcg,
            EventType::Normal,
            reasons::UPDATE_HELD,
            "Rollout",
            pending_update.clone().unwrap_or_default(),
        )
        .await;
    }
    let status = QueueConsumerGroupStatus {
        conditions,
        observed_generation: generation,
        workers_built_by,
        pending_update,
        ..QueueConsumerGroupStatus::default()
    };
    let groups: Api<QueueConsumerGroup> = Api::namespaced(ctx.client.clone(), &namespace);
    groups
        .patch_status(
            &qcg.name_any(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &status::patch::<QueueConsumerGroup, _>(&status),
        )
        .await?;
    // A pause (an annotation) is acted on at once too, not at the next round.
    let (control, pause_error) = crate::spec::control(qcg);
    let (paused, reason, message) = crate::scaler::pause_condition(&control, pause_error.as_ref());
    let pause_changed = !previous.conditions.iter().any(|c| {
        c.type_ == status::PAUSED
            && (c.status == "True") == paused
            && c.reason == reason
            && c.message == message
    }) && (paused
        || previous
            .conditions
            .iter()
            .any(|c| c.type_ == status::PAUSED));
    if (spec_changed || pause_changed) && outcome.ok {
        if let Some(changed) = &ctx.changed {
            let _ = changed.send(ObjectRef::from_obj(qcg));
        }
    }
    Ok(outcome.action)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{group_json, json_response, not_found, queue_json, ApiServerVerifier};
    use http::{Method, StatusCode};
    use serde_json::{json, Value};
    use tokio::sync::mpsc;

    const QUEUE: &str = "/apis/cosmosq.io/v1alpha1/namespaces/shop/cosmosqueues/orders";
    const STATUS: &str =
        "/apis/cosmosq.io/v1alpha1/namespaces/shop/queueconsumergroups/billing/status";

    fn setup(
        spec: Value,
    ) -> (
        Arc<QueueConsumerGroup>,
        Arc<Context>,
        ApiServerVerifier,
        mpsc::UnboundedReceiver<ObjectRef<QueueConsumerGroup>>,
    ) {
        let (mut ctx, server) = crate::testing::azure_context();
        let (tx, rx) = mpsc::unbounded_channel();
        ctx.changed = Some(tx);
        let qcg: QueueConsumerGroup = serde_json::from_value(group_json(spec)).unwrap();
        (Arc::new(qcg), Arc::new(ctx), server, rx)
    }

    /// The group's queue is read, its key's digest taken, and `applies` objects applied.
    async fn queue_read_and_applies(server: &mut ApiServerVerifier, applies: usize) {
        server
            .answer(
                Method::GET,
                QUEUE,
                json_response(StatusCode::OK, &queue_json()),
            )
            .await;
        server.key_read("k1").await;
        // The group's objects are read first (none exists yet), then applied.
        let mut applied = 0;
        while applied < applies {
            let seen = server.next().await;
            if seen.method == Method::GET {
                assert!(seen.path.ends_with("/billing-workers"), "{}", seen.path);
                seen.send.send_response(not_found());
                continue;
            }
            assert_eq!(seen.method, Method::PATCH);
            seen.send
                .send_response(json_response(StatusCode::OK, &seen.body));
            applied += 1;
        }
    }

    /// The `(status, reason)` of `Ready`, checking that only this reconciler's conditions
    /// were written (the scaler owns `Degraded` and `Paused`) and `Ready` comes first.
    fn ready(status: &Value) -> (&str, &str) {
        let conditions = status["conditions"].as_array().unwrap();
        for c in conditions {
            assert!(
                ["Ready", "Available", "Reconciling", "Stalled"]
                    .contains(&c["type"].as_str().unwrap()),
                "not this reconciler's: {c}"
            );
        }
        assert_eq!(conditions[0]["type"], "Ready");
        condition(status, "Ready")
    }

    /// The `(status, reason)` of `type_`, which must describe the group's generation (3).
    fn condition<'a>(status: &'a Value, type_: &str) -> (&'a str, &'a str) {
        let c = crate::testing::condition(status, type_);
        assert_eq!(c["observedGeneration"], 3, "{c}");
        (c["status"].as_str().unwrap(), c["reason"].as_str().unwrap())
    }

    /// Which kstatus condition is true, with its reason: `None` when the group is done.
    fn progress(status: &Value) -> Option<(&str, &str)> {
        let reconciling = condition(status, "Reconciling");
        let stalled = condition(status, "Stalled");
        match (reconciling.0, stalled.0) {
            ("False", "False") => None,
            ("True", "False") => Some(("Reconciling", reconciling.1)),
            ("False", "True") => Some(("Stalled", stalled.1)),
            both => panic!("Reconciling and Stalled both true: {both:?}"),
        }
    }

    #[test]
    fn the_deployments_conditions_fold_into_the_groups() {
        let status = |conditions: Value| -> DeploymentStatus {
            serde_json::from_value(json!({"conditions": conditions})).unwrap()
        };
        assert_eq!(
            workers(None),
            Workers {
                failure: None,
                available: None
            }
        );
        let quota = status(json!([
            {"type": "Available", "status": "False", "reason": "MinimumReplicasUnavailable",
             "message": "Deployment does not have minimum availability."},
            {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
             "message": "pods \"billing-workers-x\" is forbidden: exceeded quota: compute"}]));
        let state = workers(Some(&quota));
        assert!(state.failure.unwrap().contains("exceeded quota"));
        assert_eq!(
            state.available,
            Some((
                false,
                "MinimumReplicasUnavailable".into(),
                "Deployment does not have minimum availability.".into()
            ))
        );
        let healthy = status(json!([
            {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"},
            {"type": "ReplicaFailure", "status": "False", "reason": "Recovered"}]));
        let state = workers(Some(&healthy));
        assert_eq!(state.failure, None);
        assert!(state.available.unwrap().0);
    }

    /// Reconciles the default group with the Deployment's apply answered by `deployment`
    /// (given the applied body); returns the Warning Event and the status written.
    async fn reconcile_with_deployment_answer(
        deployment: impl FnOnce(&Value) -> http::Response<kube::client::Body> + Send + 'static,
        applied: bool,
    ) -> (Value, Value) {
        let (qcg, ctx, mut server, _changed) = setup(json!({}));
        let verifier = tokio::spawn(async move {
            queue_read_and_applies(&mut server, 2).await;
            let seen = server.next().await;
            assert!(
                seen.path.ends_with("/deployments/billing-workers"),
                "{}",
                seen.path
            );
            assert!(
                seen.query.contains("fieldValidation=Strict"),
                "{}",
                seen.query
            );
            seen.send.send_response(deployment(&seen.body));
            if applied {
                // A changed spec: an HPA left from HPA mode is looked for.
                server
                    .answer(
                        Method::GET,
                        "/apis/autoscaling/v2/namespaces/shop/horizontalpodautoscalers/billing-workers",
                        not_found(),
                    )
                    .await;
            }
            let event = server.event().await;
            let status = server.status(STATUS, group_json(json!({}))).await;
            (event, status)
        });
        reconcile_group(qcg, ctx.clone()).await.unwrap();
        verifier.await.unwrap()
    }

    #[tokio::test]
    async fn pods_the_cluster_refuses_make_the_group_not_ready() {
        let (event, body) = reconcile_with_deployment_answer(
            |applied| {
                let mut stored = applied.clone();
                stored["status"] = json!({"conditions": [
                {"type": "Available", "status": "False", "reason": "MinimumReplicasUnavailable",
                 "message": "Deployment does not have minimum availability."},
                {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                 "message": "pods is forbidden: exceeded quota: compute"}]});
                json_response(StatusCode::OK, &stored)
            },
            true,
        )
        .await;
        assert_eq!(
            (&event["type"], &event["reason"]),
            (&json!("Warning"), &json!("ReplicaFailure"))
        );
        let conditions = body["status"]["conditions"].as_array().unwrap();
        let of = |t: &str| conditions.iter().find(|c| c["type"] == t).unwrap();
        assert_eq!(of("Ready")["status"], "False");
        assert!(of("Ready")["message"]
            .as_str()
            .unwrap()
            .contains("exceeded quota"));
        assert_eq!(
            (&of("Available")["status"], &of("Available")["reason"]),
            (&json!("False"), &json!("MinimumReplicasUnavailable"))
        );
        // A quota is not lifted by retrying: kstatus Failed.
        assert_eq!(
            progress(&body["status"]),
            Some(("Stalled", "ReplicaFailure"))
        );
    }

    /// The Deployment's rollout, as Flux and Argo CD learn it from the group: going (an old
    /// pod still there, though `Available` may hold), stopped at its progress deadline, done.
    #[tokio::test]
    async fn the_workers_rollout_is_reconciling_until_done_and_stalled_when_it_stops() {
        let cases = [
            (
                json!({"observedGeneration": 1, "replicas": 3, "updatedReplicas": 2,
                       "conditions": [{"type": "Available", "status": "False",
                           "reason": "MinimumReplicasUnavailable",
                           "message": "Deployment does not have minimum availability."}]}),
                Some(("Reconciling", "RollingOut")),
                "waiting for the rollout of Deployment billing-workers: Deployment does not \
                 have minimum availability.",
            ),
            (
                json!({"observedGeneration": 1, "replicas": 3, "updatedReplicas": 1,
                       "conditions": [{"type": "Progressing", "status": "False",
                           "reason": "ProgressDeadlineExceeded",
                           "message": "ReplicaSet \"billing-workers-7d\" has timed out progressing."}]}),
                Some(("Stalled", "ProgressDeadlineExceeded")),
                "the rollout of Deployment billing-workers stopped: ReplicaSet \
                 \"billing-workers-7d\" has timed out progressing.",
            ),
            (
                json!({"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1}),
                None,
                "Deployment billing-workers is up to date",
            ),
        ];
        for (deployment_status, expected, said) in cases {
            let (_, body) = reconcile_with_deployment_answer(
                move |applied| {
                    let mut stored = applied.clone();
                    stored["metadata"]["generation"] = json!(1);
                    stored["status"] = deployment_status;
                    json_response(StatusCode::OK, &stored)
                },
                true,
            )
            .await;
            assert_eq!(ready(&body["status"]), ("True", "Applied"));
            assert_eq!(progress(&body["status"]), expected);
            let kstatus = crate::testing::condition(&body["status"], "Reconciling");
            assert_eq!(kstatus["message"], said);
        }
    }

    #[tokio::test]
    async fn a_deployment_the_api_server_refuses_is_reported_not_retried_hot() {
        let (event, body) = reconcile_with_deployment_answer(|_| {
            json_response(
                StatusCode::UNPROCESSABLE_ENTITY,
                &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                        "reason": "Invalid", "code": 422,
                        "message": "admission webhook \"policy.example.com\" denied the request: images must come from registry.example.com"}),
            )
        }, false)
        .await;
        assert_eq!(
            (&event["type"], &event["reason"]),
            (&json!("Warning"), &json!("ApplyRejected"))
        );
        assert_eq!(ready(&body["status"]), ("False", "ApplyRejected"));
        assert_eq!(
            progress(&body["status"]),
            Some(("Stalled", "ApplyRejected"))
        );
        let message = body["status"]["conditions"][0]["message"].as_str().unwrap();
        assert!(message.contains("registry.example.com"), "{message}");
    }

    #[tokio::test]
    async fn a_valid_group_is_applied_reported_ready_and_handed_to_the_scaler() {
        let (qcg, ctx, mut server, mut changed) = setup(json!({}));
        let verifier = tokio::spawn(async move {
            queue_read_and_applies(&mut server, 3).await;
            // A changed spec (generation 3, none observed yet): an HPA left from HPA mode?
            server
                .answer(
                    Method::GET,
                    "/apis/autoscaling/v2/namespaces/shop/horizontalpodautoscalers/billing-workers",
                    crate::testing::not_found(),
                )
                .await;
            let event = server.event().await;
            assert_eq!(
                (&event["type"], &event["reason"]),
                (&json!("Normal"), &json!("Applied"))
            );
            let status = server.status(STATUS, group_json(json!({}))).await;
            (server, status)
        });
        let action = reconcile_group(qcg, ctx.clone()).await.unwrap();
        assert_eq!(action, Action::requeue(crate::context::group_resync("g1")));
        let (server, body) = verifier.await.unwrap();
        assert_eq!(ready(&body["status"]), ("True", "Applied"));
        // Applied, not yet seen by the Deployment controller (no status): in progress.
        assert_eq!(
            progress(&body["status"]),
            Some(("Reconciling", "RollingOut"))
        );
        assert_eq!(body["status"]["observedGeneration"], 3);
        assert!(
            body["status"].get("backlog").is_none(),
            "the scaler's field"
        );
        assert_eq!(changed.try_recv().unwrap().name, "billing");
        assert_eq!(ctx.metrics.reconciles.with_label_values(&[KIND]).get(), 1);
        drop(ctx);
        server.done().await;
    }

    #[tokio::test]
    async fn a_missing_queue_is_reported_and_retried() {
        let (qcg, ctx, mut server, mut changed) = setup(json!({}));
        let verifier = tokio::spawn(async move {
            server.answer(Method::GET, QUEUE, not_found()).await;
            let event = server.event().await;
            assert_eq!(
                (&event["type"], &event["reason"]),
                (&json!("Warning"), &json!("QueueNotFound"))
            );
            server.status(STATUS, group_json(json!({}))).await
        });
        let action = reconcile_group(qcg, ctx).await.unwrap();
        assert_eq!(action, Action::requeue(crate::context::RECHECK));
        let body = verifier.await.unwrap();
        assert_eq!(ready(&body["status"]), ("False", "QueueNotFound"));
        // The queue may be created next (GitOps applies both at once): kstatus InProgress.
        assert_eq!(
            progress(&body["status"]),
            Some(("Reconciling", "QueueNotFound"))
        );
        assert!(changed.try_recv().is_err(), "nothing to scale yet");
    }

    #[tokio::test]
    async fn a_missing_queue_to_publish_to_is_reported_and_retried() {
        let (qcg, ctx, mut server, mut changed) =
            setup(json!({"publishTo": [{"queueRef": {"name": "invoices"}}]}));
        let verifier = tokio::spawn(async move {
            server
                .answer(
                    Method::GET,
                    QUEUE,
                    json_response(StatusCode::OK, &queue_json()),
                )
                .await;
            server
                .answer(
                    Method::GET,
                    "/apis/cosmosq.io/v1alpha1/namespaces/shop/cosmosqueues/invoices",
                    not_found(),
                )
                .await;
            // Nothing is applied: the next request is the Event.
            let event = server.event().await;
            assert_eq!(
                (&event["type"], &event["reason"]),
                (&json!("Warning"), &json!("PublishQueueNotFound"))
            );
            server.status(STATUS, group_json(json!({}))).await
        });
        let action = reconcile_group(qcg, ctx).await.unwrap();
        assert_eq!(action, Action::requeue(crate::context::RECHECK));
        let body = verifier.await.unwrap();
        assert_eq!(ready(&body["status"]), ("False", "PublishQueueNotFound"));
        let message = body["status"]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "Ready")
            .unwrap()["message"]
            .clone();
        assert_eq!(
            message,
            "spec.publishTo: CosmosQueue invoices does not exist in shop (a group publishes to \
             queues of its own namespace)"
        );
        assert!(changed.try_recv().is_err(), "nothing to scale yet");
    }

    #[tokio::test]
    async fn an_invalid_spec_is_named_in_status_and_an_event_and_nothing_is_applied() {
        for (spec, field) in [
            (
                json!({"template": {"spec": {"containers": []}}}),
                "spec.template.spec.containers",
            ),
            (
                json!({"lockDuration": "99999999999999999999s"}),
                "spec.lockDuration",
            ),
        ] {
            let (qcg, ctx, mut server, _changed) = setup(spec);
            let verifier = tokio::spawn(async move {
                server
                    .answer(
                        Method::GET,
                        QUEUE,
                        json_response(StatusCode::OK, &queue_json()),
                    )
                    .await;
                // The next request is the Event: no apply came first.
                let event = server.event().await;
                assert_eq!(event["reason"], "InvalidSpec");
                let status = server.status(STATUS, group_json(json!({}))).await;
                (event, status)
            });
            let action = reconcile_group(qcg, ctx).await.unwrap();
            assert_eq!(action, Action::await_change());
            let (event, body) = verifier.await.unwrap();
            assert_eq!(ready(&body["status"]), ("False", "InvalidSpec"));
            assert_eq!(progress(&body["status"]), Some(("Stalled", "InvalidSpec")));
            let message = body["status"]["conditions"][0]["message"].as_str().unwrap();
            assert!(message.contains(field), "{message}");
            assert!(event["note"].as_str().unwrap().contains(field));
        }
    }

    /// A periodic pass over a group applied at its generation (Ready since 2026-01-01), with
    /// `annotations`: the status written, and whether the scaler was told.
    async fn periodic_pass(annotations: Value) -> (Value, bool) {
        let mut spec = group_json(json!({}));
        spec["metadata"]["annotations"] = annotations;
        spec["status"] = json!({"observedGeneration": 3, "conditions": [{
            "type": "Ready", "status": "True", "reason": "Applied", "message": "m",
            "lastTransitionTime": "2026-01-01T00:00:00Z"}]});
        let (_, ctx, mut server, mut changed) = setup(json!({}));
        let qcg: Arc<QueueConsumerGroup> = Arc::new(serde_json::from_value(spec).unwrap());
        let verifier = tokio::spawn(async move {
            queue_read_and_applies(&mut server, 3).await;
            server.status(STATUS, group_json(json!({}))).await // straight to status: no Event
        });
        reconcile_group(qcg, ctx).await.unwrap();
        let body = verifier.await.unwrap();
        (body, changed.try_recv().is_ok())
    }

    #[tokio::test]
    async fn an_unchanged_group_publishes_no_event_on_its_periodic_pass() {
        let (body, told) = periodic_pass(json!({})).await;
        assert_eq!(
            body["status"]["conditions"][0]["lastTransitionTime"],
            "2026-01-01T00:00:00Z"
        );
        assert!(!told, "the scaler already knows this generation");
    }

    #[tokio::test]
    async fn a_pause_reaches_the_scaler_at_once() {
        let (_, told) = periodic_pass(json!({"cosmosq.io/paused-replicas": "0"})).await;
        assert!(
            told,
            "the same generation, but now paused: the scaler acts now, not at its next round"
        );
    }
}
