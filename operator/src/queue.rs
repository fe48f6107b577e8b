//! Reconciling a CosmosQueue: provision the database, the messages container and the lease
//! container (create if missing, never modify what exists), report partitions and health; on
//! deletion, honour the deletion policy before kube-runtime's `finalizer` helper lets the
//! resource go.

use std::sync::Arc;

use cosmosq_crds::{CosmosQueue, CosmosQueueStatus, DeletionPolicy};
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::finalizer::{finalizer, Event as Finalizer};
use kube::{Api, ResourceExt};
use serde_json::json;
use tracing::{info, instrument, warn};

use crate::apply::FIELD_MANAGER;
use crate::context::{Context, ReconcileFailure};
use crate::cosmos::CosmosError;
use crate::status::{self, reasons, Progress};

/// The resource kind, as metrics and logs name it.
pub const KIND: &str = "CosmosQueue";
/// Held while the deletion policy has not been carried out.
pub const FINALIZER: &str = "cosmosq.io/deletion-policy";

/// What can fail a queue's reconcile (and is retried).
#[derive(Debug, thiserror::Error)]
pub enum QueueReconcileError {
    /// An API call failed.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// Deleting the containers failed (deletion policy `Delete`).
    #[error("deleting the queue's containers: {0}")]
    Deprovision(CosmosError),
    /// The finalizer could not be added or removed.
    #[error("finalizer: {0}")]
    Finalizer(String),
    /// The queue has no namespace.
    #[error("{0} has no namespace")]
    NoNamespace(String),
}

impl ReconcileFailure for QueueReconcileError {
    const RESOURCE: &'static str = KIND;

    fn kind(&self) -> &'static str {
        match self {
            QueueReconcileError::Kube(_) => "kube",
            QueueReconcileError::Deprovision(_) => "cosmos",
            QueueReconcileError::Finalizer(_) => "finalizer",
            QueueReconcileError::NoNamespace(_) => "invalid_object",
        }
    }
}

/// One pass over a queue: provision, or carry out its deletion policy.
pub async fn reconcile_queue(
    cq: Arc<CosmosQueue>,
    ctx: Arc<Context>,
) -> Result<Action, QueueReconcileError> {
    let result = ctx
        .measured(KIND, cq.as_ref(), reconcile(cq.clone(), &ctx))
        .await;
    if result.is_ok() {
        ctx.succeeded(KIND, cq.as_ref());
    }
    result
}

#[instrument(skip_all, fields(namespace = ?cq.namespace(), queue = %cq.name_any()))]
async fn reconcile(cq: Arc<CosmosQueue>, ctx: &Context) -> Result<Action, QueueReconcileError> {
    let namespace = cq
        .namespace()
        .ok_or_else(|| QueueReconcileError::NoNamespace(cq.name_any()))?;
    let api: Api<CosmosQueue> = Api::namespaced(ctx.client.clone(), &namespace);
    let finalized = cq.finalizers().iter().position(|f| f == FINALIZER);
    if cq.spec.deletion_policy == DeletionPolicy::Retain && cq.metadata.deletion_timestamp.is_none()
    {
        // Nothing to do at deletion, so no finalizer: deleting the queue, or its namespace,
        // never waits for the operator. One left from `Delete` comes off.
        if let Some(index) = finalized {
            remove_finalizer(&api, &cq, index).await?;
        }
        return apply(&cq, ctx).await;
    }
    if cq.metadata.deletion_timestamp.is_some() && finalized.is_none() {
        return Ok(Action::await_change());
    }
    finalizer(&api, FINALIZER, cq, |event| async {
        match event {
            Finalizer::Apply(cq) => apply(&cq, ctx).await,
            Finalizer::Cleanup(cq) => cleanup(&cq, ctx).await,
        }
    })
    .await
    .map_err(|e| match e {
        kube::runtime::finalizer::Error::ApplyFailed(e)
        | kube::runtime::finalizer::Error::CleanupFailed(e) => e,
        other => QueueReconcileError::Finalizer(other.to_string()),
    })
}

/// Takes our finalizer off, if it is still at `index` (a JSON patch that tests it first).
async fn remove_finalizer(
    api: &Api<CosmosQueue>,
    cq: &CosmosQueue,
    index: usize,
) -> Result<(), QueueReconcileError> {
    let path = format!("/metadata/finalizers/{index}");
    let patch: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": path, "value": FINALIZER},
        {"op": "remove", "path": path}
    ]))
    .expect("a valid JSON patch");
    api.patch(
        &cq.name_any(),
        &PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PatchParams::default()
        },
        &Patch::Json::<()>(patch),
    )
    .await?;
    Ok(())
}

async fn apply(cq: &CosmosQueue, ctx: &Context) -> Result<Action, QueueReconcileError> {
    let namespace = cq.namespace().unwrap_or_default();
    let provisioned = match ctx.cosmos.provision(cq).await {
        Ok((queue, provisioned)) => queue
            .partitions()
            .await
            .map(|partitions| (provisioned, partitions))
            .map_err(CosmosError::from),
        Err(e) => Err(e),
    };
    let (progress, reason, message, partitions, action) = match provisioned {
        Ok((provisioned, partitions)) => {
            let created: Vec<&str> = [
                (provisioned.created_database, "database"),
                (provisioned.created_messages_container, "messages container"),
                (provisioned.created_lease_container, "lease container"),
            ]
            .into_iter()
            .filter_map(|(created, what)| created.then_some(what))
            .collect();
            let message = if created.is_empty() {
                format!(
                    "database {} and containers {} exist ({partitions} partitions)",
                    cq.spec.database, cq.spec.container
                )
            } else {
                format!(
                    "created the {} of {}/{}",
                    created.join(", "),
                    cq.spec.database,
                    cq.spec.container
                )
            };
            info!(partitions, "{message}");
            // Something made, or a queue that was failing is ready again.
            if !created.is_empty() || was_failing(cq) {
                ctx.event(
                    cq,
                    EventType::Normal,
                    reasons::PROVISIONED,
                    "Provision",
                    message.clone(),
                )
                .await;
            }
            let action = Action::requeue(crate::context::RESYNC);
            (
                Progress::Done,
                reasons::PROVISIONED,
                message,
                Some(partitions as i32),
                action,
            )
        }
        Err(e) => {
            // Spec errors wait for a change; Cosmos errors (throttling, outage, a wrong
            // endpoint) are retried. Neither message can hold the key: it is never formatted.
            let progress = if e.is_stalled() {
                Progress::Stalled
            } else {
                Progress::Reconciling
            };
            let (reason, action) = match &e {
                e if e.is_spec_error() => (reasons::INVALID_SPEC, Action::await_change()),
                // An admin creates them outside the cluster: look again now and then.
                CosmosError::NeedsProvisioning { .. } => (
                    reasons::NEEDS_PROVISIONING,
                    Action::requeue(crate::context::RECHECK),
                ),
                // ARM's GET and PUT every 30 s would not get past it: at the resync, or at
                // once on a spec change or a reconcile request.
                CosmosError::Arm(arm) if arm.is_permanent() => (
                    reasons::PROVISIONING_FAILED,
                    Action::requeue(crate::context::RESYNC),
                ),
                _ => (
                    reasons::PROVISIONING_FAILED,
                    Action::requeue(crate::context::RECHECK),
                ),
            };
            ctx.cosmos.forget(cq).await;
            let message = e.to_string();
            warn!(reason, "{message}");
            ctx.metrics
                .reconcile_errors
                .with_label_values(&[KIND, reason])
                .inc();
            // An Event when the queue's state changes, not at every retry: the status holds
            // the latest message (each retry's request id differs).
            if transition(cq, reason) {
                ctx.event(cq, EventType::Warning, reason, "Provision", message.clone())
                    .await;
            }
            let previous = cq.status.as_ref().and_then(|s| s.partitions);
            (progress, reason, message, previous, action)
        }
    };
    let generation = cq.metadata.generation;
    let previous = cq
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    let now = status::now();
    let ok = progress == Progress::Done;
    let condition = |type_, ok| {
        status::condition(
            &previous,
            type_,
            ok,
            reason,
            message.clone(),
            generation,
            now.clone(),
        )
    };
    // Only the fields this reconciler owns; the scaling loop writes the totals.
    let status = CosmosQueueStatus {
        conditions: vec![
            condition(status::READY, ok),
            condition(status::PROVISIONED, ok),
            condition(status::DEGRADED, !ok),
        ]
        .into_iter()
        .chain(status::progress(
            &previous, progress, reason, &message, generation, &now,
        ))
        .collect(),
        partitions,
        observed_generation: generation,
        ..CosmosQueueStatus::default()
    };
    // A resync that finds what the status says writes nothing (1,000 queues: 200 writes a
    // minute for nothing otherwise).
    if !status_holds(cq.status.as_ref(), &status) {
        let api: Api<CosmosQueue> = Api::namespaced(ctx.client.clone(), &namespace);
        api.patch_status(
            &cq.name_any(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &status::patch::<CosmosQueue, _>(&status),
        )
        .await?;
    }
    Ok(action)
}

/// Whether the stored status already says what this reconciler would write (pure): its
/// conditions (transition times kept when unchanged), partitions and observed generation.
fn status_holds(stored: Option<&CosmosQueueStatus>, new: &CosmosQueueStatus) -> bool {
    stored.is_some_and(|s| {
        s.conditions == new.conditions
            && s.partitions == new.partitions
            && s.observed_generation == new.observed_generation
    })
}

/// Whether the queue's status says `Ready=False` (pure).
fn was_failing(cq: &CosmosQueue) -> bool {
    cq.status.as_ref().is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.type_ == status::READY && c.status == "False")
    })
}

/// Whether a pass ending `Ready=False` with `reason` is news (pure): the spec changed since the
/// status was written, or the queue was not already failing for that reason.
fn transition(cq: &CosmosQueue, reason: &str) -> bool {
    let Some(status) = &cq.status else {
        return true;
    };
    status.observed_generation != cq.metadata.generation
        || !status
            .conditions
            .iter()
            .any(|c| c.type_ == status::READY && c.status == "False" && c.reason == reason)
}

async fn cleanup(cq: &CosmosQueue, ctx: &Context) -> Result<Action, QueueReconcileError> {
    let what = format!("{}/{}", cq.spec.database, cq.spec.container);
    match cq.spec.deletion_policy {
        DeletionPolicy::Retain => {
            ctx.cosmos.forget(cq).await;
            let note = format!("deletionPolicy Retain: kept the containers of {what}");
            info!("{note}");
            ctx.event(cq, EventType::Normal, reasons::RETAINED, "Delete", note)
                .await;
        }
        DeletionPolicy::Delete => match ctx.cosmos.deprovision(cq).await {
            Ok(()) => {}
            Err(e)
                if e.is_refused()
                    || matches!(
                        e,
                        CosmosError::SecretNotFound(_)
                            | CosmosError::SecretForbidden(_)
                            | CosmosError::SecretKeyMissing { .. }
                            | CosmosError::IdentityNotGranted { .. }
                    ) =>
            {
                // The credentials are gone or out of reach (a namespace being deleted takes its
                // Secrets with it, and the operator's Role there with `watchNamespace`), or the
                // account refuses them (an Entra identity's data-plane roles never cover
                // deleting containers, nor ARM without a role that does): retrying does not change that, and holding the queue
                // would hold its namespace for ever. Say so, and let it go.
                let note = format!(
                    "deletionPolicy Delete: the containers of {what} were NOT deleted ({e}); \
                     delete them in Azure"
                );
                warn!("{note}");
                ctx.event(
                    cq,
                    EventType::Warning,
                    reasons::DELETE_SKIPPED,
                    "Delete",
                    note,
                )
                .await;
                return Ok(Action::await_change());
            }
            Err(e) => {
                ctx.event(
                    cq,
                    EventType::Warning,
                    reasons::DELETE_FAILED,
                    "Delete",
                    e.to_string(),
                )
                .await;
                return Err(QueueReconcileError::Deprovision(e));
            }
        },
    }
    if cq.spec.deletion_policy == DeletionPolicy::Delete {
        let note = format!("deletionPolicy Delete: deleted the containers of {what}");
        info!("{note}");
        ctx.event(cq, EventType::Normal, reasons::DELETED, "Delete", note)
            .await;
    }
    Ok(Action::await_change())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{
        container_exists, emulator_context, json_response, not_found, queue_json,
    };
    use http::{Method, StatusCode};
    use serde_json::Value;

    const QUEUE: &str = "/apis/cosmosq.io/v1alpha1/namespaces/shop/cosmosqueues/orders";
    const STATUS: &str = "/apis/cosmosq.io/v1alpha1/namespaces/shop/cosmosqueues/orders/status";

    fn queue(extra_spec: Value, finalized: bool) -> Value {
        let mut q = queue_json();
        q["spec"]
            .as_object_mut()
            .unwrap()
            .extend(extra_spec.as_object().cloned().unwrap_or_default());
        if finalized {
            q["metadata"]["finalizers"] = json!([FINALIZER]);
        }
        q
    }

    fn arc(value: &Value) -> Arc<CosmosQueue> {
        Arc::new(serde_json::from_value(value.clone()).unwrap())
    }

    fn condition<'a>(status: &'a Value, type_: &str) -> (&'a str, &'a str) {
        let c = crate::testing::condition(status, type_);
        (c["status"].as_str().unwrap(), c["reason"].as_str().unwrap())
    }

    #[tokio::test]
    async fn a_new_delete_queue_is_finalized_then_provisioned_once() {
        let (ctx, mut server, cosmos) = emulator_context().await;
        let verifier = tokio::spawn(async move {
            // 1. The finalizer goes on first, before anything exists that it must clean up.
            let seen = server.expect(Method::PATCH, QUEUE).await;
            assert!(seen.body.to_string().contains(FINALIZER), "{}", seen.body);
            seen.send.send_response(json_response(
                StatusCode::OK,
                &queue(json!({"deletionPolicy": "Delete"}), true),
            ));
            // 2. Provisioned: an Event, then the status.
            let event = server.event().await;
            assert_eq!(
                (&event["type"], &event["reason"]),
                (&json!("Normal"), &json!("Provisioned"))
            );
            assert!(event["note"]
                .as_str()
                .unwrap()
                .contains("messages container"));
            let first = server
                .status(STATUS, queue(json!({"deletionPolicy": "Delete"}), true))
                .await;
            // 3. A later pass finds everything in place: status only, no Event.
            let second = server
                .status(STATUS, queue(json!({"deletionPolicy": "Delete"}), true))
                .await;
            (server, first, second)
        });
        let action = reconcile_queue(
            arc(&queue(json!({"deletionPolicy": "Delete"}), false)),
            ctx.clone(),
        )
        .await
        .unwrap();
        assert_eq!(action, Action::await_change());
        assert!(!container_exists(&cosmos, "shop", "orders").await);
        let action = reconcile_queue(
            arc(&queue(json!({"deletionPolicy": "Delete"}), true)),
            ctx.clone(),
        )
        .await
        .unwrap();
        assert_eq!(action, Action::requeue(crate::context::RESYNC));
        assert!(container_exists(&cosmos, "shop", "orders").await);
        assert!(container_exists(&cosmos, "shop", "orders-leases").await);
        reconcile_queue(
            arc(&queue(json!({"deletionPolicy": "Delete"}), true)),
            ctx.clone(),
        )
        .await
        .unwrap();
        let (server, first, second) = verifier.await.unwrap();
        // 4. A resync of the queue as that status left it: nothing to write.
        let mut settled = queue(json!({"deletionPolicy": "Delete"}), true);
        settled["status"] = second["status"].clone();
        let action = reconcile_queue(arc(&settled), ctx.clone()).await.unwrap();
        assert_eq!(action, Action::requeue(crate::context::RESYNC));
        for body in [&first, &second] {
            assert_eq!(condition(&body["status"], "Ready"), ("True", "Provisioned"));
            assert_eq!(condition(&body["status"], "Provisioned").0, "True");
            assert_eq!(condition(&body["status"], "Degraded").0, "False");
            assert_eq!(condition(&body["status"], "Reconciling").0, "False");
            assert_eq!(condition(&body["status"], "Stalled").0, "False");
            assert_eq!(body["status"]["partitions"], 4);
            assert_eq!(body["status"]["observedGeneration"], 1);
        }
        drop(ctx);
        server.done().await;
    }

    #[tokio::test]
    async fn a_retained_queue_gets_no_finalizer_and_loses_one_left_from_delete() {
        for finalized in [false, true] {
            let (ctx, mut server, cosmos) = emulator_context().await;
            let verifier = tokio::spawn(async move {
                if finalized {
                    expect_finalizer_removed(&mut server, queue(json!({}), false)).await;
                }
                let event = server.event().await;
                assert_eq!(event["reason"], "Provisioned");
                server.status(STATUS, queue(json!({}), false)).await;
                server
            });
            reconcile_queue(arc(&queue(json!({}), finalized)), ctx.clone())
                .await
                .unwrap();
            assert!(container_exists(&cosmos, "shop", "orders").await);
            let server = verifier.await.unwrap();
            drop(ctx);
            server.done().await; // no finalizer was added
        }
    }

    #[tokio::test]
    async fn a_delete_queue_whose_secret_is_gone_or_forbidden_is_released_with_a_warning() {
        let forbidden = || {
            json_response(
                StatusCode::FORBIDDEN,
                &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                        "reason": "Forbidden", "code": 403, "message": "forbidden"}),
            )
        };
        for answer in [not_found(), forbidden()] {
            released_with_a_warning(answer).await;
        }
    }

    async fn released_with_a_warning(secret_answer: http::Response<kube::client::Body>) {
        let (ctx, mut server) = azure_context();
        let verifier = tokio::spawn(async move {
            server
                .answer(
                    Method::GET,
                    "/api/v1/namespaces/shop/secrets/cosmos-key",
                    secret_answer,
                )
                .await;
            expect_released_with_a_warning(&mut server, "shop/orders").await;
        });
        reconcile_queue(arc(&deleting("Delete")), ctx)
            .await
            .unwrap();
        verifier.await.unwrap();
    }

    /// A `DeleteSkipped` Warning saying the containers were not deleted and `why`, then the
    /// finalizer comes off.
    async fn expect_released_with_a_warning(
        server: &mut crate::testing::ApiServerVerifier,
        why: &str,
    ) {
        let event = server.event().await;
        assert_eq!(
            (&event["type"], &event["reason"]),
            (&json!("Warning"), &json!("DeleteSkipped"))
        );
        let note = event["note"].as_str().unwrap();
        assert!(note.contains("NOT deleted") && note.contains(why), "{note}");
        expect_finalizer_removed(server, deleting("Delete")).await;
    }

    /// The next request takes our finalizer off: a JSON patch that tests it is still ours.
    async fn expect_finalizer_removed(
        server: &mut crate::testing::ApiServerVerifier,
        reply: Value,
    ) {
        let seen = server.expect(Method::PATCH, QUEUE).await;
        assert_eq!(seen.content_type, "application/json-patch+json");
        assert_eq!(
            seen.body[0],
            json!({"op": "test", "path": "/metadata/finalizers/0", "value": FINALIZER})
        );
        assert_eq!(seen.body[1]["op"], "remove");
        seen.send
            .send_response(json_response(StatusCode::OK, &reply));
    }

    fn azure_context() -> (Arc<Context>, crate::testing::ApiServerVerifier) {
        let (ctx, server) = crate::testing::azure_context();
        (Arc::new(ctx), server)
    }

    /// A queue being deleted: the finalizer is present and a deletion timestamp set.
    fn deleting(policy: &str) -> Value {
        let mut q = queue(json!({"deletionPolicy": policy}), true);
        q["metadata"]["deletionTimestamp"] = json!("2026-11-30T10:00:00Z");
        q
    }

    #[tokio::test]
    async fn deletion_honours_the_policy_before_the_finalizer_is_removed() {
        for (policy, reason, kept) in [("Retain", "Retained", true), ("Delete", "Deleted", false)] {
            let (ctx, mut server, cosmos) = emulator_context().await;
            ctx.cosmos.provision(&arc(&deleting(policy))).await.unwrap();
            let verifier = tokio::spawn(async move {
                let event = server.event().await;
                assert_eq!(event["reason"], reason);
                // Then the finalizer comes off.
                expect_finalizer_removed(&mut server, deleting(policy)).await;
            });
            reconcile_queue(arc(&deleting(policy)), ctx).await.unwrap();
            verifier.await.unwrap();
            assert_eq!(
                container_exists(&cosmos, "shop", "orders").await,
                kept,
                "{policy}"
            );
            assert_eq!(
                container_exists(&cosmos, "shop", "orders-leases").await,
                kept,
                "{policy}"
            );
        }
    }

    #[tokio::test]
    async fn an_invalid_spec_is_reported_and_nothing_is_created() {
        let (ctx, mut server, cosmos) = emulator_context().await;
        let bad = queue(
            json!({"retention": "99999999999999999999d", "deletionPolicy": "Delete"}),
            true,
        );
        let verifier = tokio::spawn(async move {
            let event = server.event().await;
            assert_eq!(
                (&event["type"], &event["reason"]),
                (&json!("Warning"), &json!("InvalidSpec"))
            );
            server.status(STATUS, queue(json!({}), true)).await
        });
        let action = reconcile_queue(arc(&bad), ctx).await.unwrap();
        assert_eq!(action, Action::await_change());
        let body = verifier.await.unwrap();
        assert_eq!(
            condition(&body["status"], "Ready"),
            ("False", "InvalidSpec")
        );
        assert_eq!(condition(&body["status"], "Degraded").0, "True");
        // kstatus: Failed until its owner changes the spec, not InProgress.
        assert_eq!(
            condition(&body["status"], "Stalled"),
            ("True", "InvalidSpec")
        );
        assert_eq!(condition(&body["status"], "Reconciling").0, "False");
        let message = body["status"]["conditions"][0]["message"].as_str().unwrap();
        assert!(message.starts_with("spec.retention:"), "{message}");
        assert!(!container_exists(&cosmos, "shop", "orders").await);
    }

    /// Reconciles `input` on an Azure context and expects it refused as `InvalidSpec` (a
    /// Warning, then the status) with no other request: no Secret read, nothing dialled.
    /// Returns the condition's message.
    async fn refused_as_invalid(input: Value) -> String {
        let (ctx, mut server) = azure_context();
        let verifier = tokio::spawn(async move {
            let event = server.event().await;
            assert_eq!(
                (&event["type"], &event["reason"]),
                (&json!("Warning"), &json!("InvalidSpec"))
            );
            let body = server.status(STATUS, queue(json!({}), true)).await;
            server.done().await;
            body
        });
        let action = reconcile_queue(arc(&input), ctx).await.unwrap();
        assert_eq!(action, Action::await_change());
        let body = verifier.await.unwrap();
        body["status"]["conditions"][0]["message"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    #[tokio::test]
    async fn an_identity_queue_is_verified_not_created_and_an_admins_containers_make_it_ready() {
        let (ctx, mut server, cosmos) = emulator_context().await;
        let mut input = queue(json!({"credentials": {"workloadIdentity": {}}}), false);
        // Nothing exists: nothing is created, the status says what an admin must create, once.
        let verifier = tokio::spawn(async move {
            let event = server.event().await;
            assert_eq!(
                (&event["type"], &event["reason"]),
                (&json!("Warning"), &json!("NeedsProvisioning"))
            );
            let body = server.status(STATUS, queue(json!({}), false)).await;
            (server, body)
        });
        let action = reconcile_queue(arc(&input), ctx.clone()).await.unwrap();
        assert_eq!(action, Action::requeue(crate::context::RECHECK));
        let (mut server, body) = verifier.await.unwrap();
        assert_eq!(
            condition(&body["status"], "Ready"),
            ("False", "NeedsProvisioning")
        );
        assert_eq!(
            condition(&body["status"], "Stalled"),
            ("True", "NeedsProvisioning")
        );
        let message = body["status"]["conditions"][0]["message"].as_str().unwrap();
        assert!(
            message.starts_with("database shop does not exist; ")
                && message.contains("docs/identity.md"),
            "{message}"
        );
        assert!(!container_exists(&cosmos, "shop", "orders").await);
        assert!(
            cosmos.database_client("shop").read(None).await.is_err(),
            "the database was created"
        );

        // Looked at again, still missing: the status already says so, so nothing is written,
        // and no second Event.
        input["status"] = body["status"].clone();
        reconcile_queue(arc(&input), ctx.clone()).await.unwrap();

        // An admin creates them (as `az` or Bicep would): ready, and an Event says so.
        let config = crate::spec::queue(&arc(&input).spec).unwrap();
        cosmosq_queue::provision(&cosmos, &config).await.unwrap();
        let verifier = tokio::spawn(async move {
            let event = server.event().await;
            assert_eq!(
                (&event["type"], &event["reason"]),
                (&json!("Normal"), &json!("Provisioned"))
            );
            let body = server.status(STATUS, queue(json!({}), false)).await;
            server.done().await;
            body
        });
        let action = reconcile_queue(arc(&input), ctx).await.unwrap();
        assert_eq!(action, Action::requeue(crate::context::RESYNC));
        let body = verifier.await.unwrap();
        assert_eq!(condition(&body["status"], "Ready"), ("True", "Provisioned"));
        assert_eq!(condition(&body["status"], "Stalled").0, "False");
    }

    #[tokio::test]
    async fn a_delete_queue_whose_account_refuses_the_delete_is_released_with_a_warning() {
        // What an Entra identity meets (its data-plane roles cannot delete containers), and a
        // key behind the account's firewall: 403, which no retry changes.
        let (port, answered) = answering("403 Forbidden", "").await;
        let allowed = format!("http://127.0.0.1:{port}").parse().unwrap();
        let (ctx, mut server) =
            crate::testing::azure_context_dialling(crate::endpoint::EndpointPolicy::new([allowed]));
        let mut input = deleting("Delete");
        input["spec"]["endpoint"] = json!(format!("http://127.0.0.1:{port}/"));
        let verifier = tokio::spawn(async move {
            server
                .key_read(cosmosq_queue::cosmos::connection::EMULATOR_KEY)
                .await;
            expect_released_with_a_warning(&mut server, "status 403").await;
        });
        reconcile_queue(arc(&input), Arc::new(ctx)).await.unwrap();
        verifier.await.unwrap();
        answered.await.unwrap();
    }

    /// A local endpoint answering its first request with `status` and `body` (and a request
    /// id); the task ends with the request it read.
    async fn answering(status: &str, body: &str) -> (u16, tokio::task::JoinHandle<String>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let answer = format!(
            "HTTP/1.1 {status}\r\ncontent-length: {}\r\n\
             x-ms-activity-id: 7f3c-request\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        let task = tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = Vec::new();
            let mut buf = [0u8; 4096];
            while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = socket.read(&mut buf).await.unwrap();
                assert!(n > 0, "the request ended early");
                request.extend_from_slice(&buf[..n]);
            }
            socket.write_all(answer.as_bytes()).await.unwrap();
            String::from_utf8_lossy(&request).into_owned()
        });
        (port, task)
    }

    #[tokio::test]
    async fn a_namespace_not_granted_the_operators_identity_cannot_use_it() {
        // No grant: the operator does not act as itself for this namespace, and says why.
        let message = refused_as_invalid(queue(
            json!({"credentials": {"workloadIdentity": {}}, "deletionPolicy": "Delete"}),
            true,
        ))
        .await;
        assert!(
            message.contains("namespace shop is not granted the operator's identity")
                && message.contains("--identity-grant"),
            "{message}"
        );
    }

    #[tokio::test]
    async fn an_endpoint_that_is_not_an_account_is_refused_before_its_secret_is_read() {
        let message = refused_as_invalid(queue(
            json!({"endpoint": "http://kube-dns.kube-system.svc:53/", "deletionPolicy": "Delete"}),
            true,
        ))
        .await;
        assert!(
            message.starts_with("spec.endpoint: http://kube-dns.kube-system.svc:53")
                && message.contains("--allowed-endpoint"),
            "{message}"
        );
    }

    #[tokio::test]
    async fn what_an_endpoint_answers_never_reaches_status_or_events() {
        // An allowed endpoint (an admin's emulator entry) that answers 500 with a body: the
        // status and the Event say the status and the request id, not the body.
        let (port, answers) =
            answering("500 Internal Server Error", "internal-service-secret").await;
        let allowed = format!("http://127.0.0.1:{port}").parse().unwrap();
        let (ctx, mut server) =
            crate::testing::azure_context_dialling(crate::endpoint::EndpointPolicy::new([allowed]));
        let ctx = Arc::new(ctx);
        let verifier = tokio::spawn(async move {
            server
                .key_read(cosmosq_queue::cosmos::connection::EMULATOR_KEY)
                .await;
            let event = server.event().await;
            assert_eq!(event["reason"], "ProvisioningFailed");
            let status = server.status(STATUS, queue(json!({}), true)).await;
            (event, status)
        });
        let input = queue(
            json!({"endpoint": format!("http://127.0.0.1:{port}/"), "deletionPolicy": "Delete"}),
            true,
        );
        let action = reconcile_queue(arc(&input), ctx).await.unwrap();
        assert_eq!(action, Action::requeue(crate::context::RECHECK));
        let request = answers.await.unwrap();
        assert!(request.starts_with("GET / "), "{request}");
        let (event, status) = verifier.await.unwrap();
        let message = status["status"]["conditions"][0]["message"]
            .as_str()
            .unwrap();
        assert!(
            message.contains("status 500") && message.contains("request id 7f3c-request"),
            "{message}"
        );
        // An outage is retried by the operator: kstatus InProgress, not Failed.
        assert_eq!(
            condition(&status["status"], "Reconciling"),
            ("True", "ProvisioningFailed")
        );
        assert_eq!(condition(&status["status"], "Stalled").0, "False");
        for said in [event.to_string(), status.to_string()] {
            assert!(!said.contains("internal-service-secret"), "{said}");
        }
    }

    #[tokio::test]
    async fn a_missing_secret_or_key_is_named_and_nothing_is_tried() {
        for (secret, expected) in [
            (None, "Secret shop/cosmos-key not found"),
            (
                Some(json!({"apiVersion": "v1", "kind": "Secret",
                            "metadata": {"name": "cosmos-key", "namespace": "shop"},
                            "data": {"other": "c2VjcmV0"}})),
                "Secret shop/cosmos-key has no key \"key\"",
            ),
        ] {
            let (ctx, mut server) = azure_context();
            let verifier = tokio::spawn(async move {
                let response = match secret {
                    None => not_found(),
                    Some(secret) => json_response(StatusCode::OK, &secret),
                };
                server
                    .answer(
                        Method::GET,
                        "/api/v1/namespaces/shop/secrets/cosmos-key",
                        response,
                    )
                    .await;
                let event = server.event().await;
                assert_eq!(event["reason"], "InvalidSpec");
                server.status(STATUS, queue(json!({}), true)).await
            });
            let input = queue(json!({"deletionPolicy": "Delete"}), true);
            let action = reconcile_queue(arc(&input), ctx).await.unwrap();
            assert_eq!(action, Action::await_change());
            let body = verifier.await.unwrap();
            let message = body["status"]["conditions"][0]["message"].as_str().unwrap();
            assert!(message.contains(expected), "{message}");
            assert!(
                message.starts_with("spec.credentials.secretKeyRef"),
                "{message}"
            );
            assert!(
                !body.to_string().contains("c2VjcmV0"),
                "no secret material in status"
            );
        }
    }

    // Identity queues on an account the operator manages through ARM: the fake ARM
    // (`arm::fake`, written from ARM's documentation) carries out on the emulator.

    const GRANT: &str = "shop@https://acct.documents.azure.com:443/shop";

    fn identity_queue(policy: &str, finalized: bool) -> Value {
        queue(
            json!({"credentials": {"workloadIdentity": {}}, "deletionPolicy": policy,
                   "throughput": {"mode": "Autoscale", "requestUnits": 4000}}),
            finalized,
        )
    }

    const ACCOUNT_PATH: &str = "/subscriptions/0b1f6471-1bf0-4dda-aec3-cb9272f09590/\
                                resourceGroups/shop-rg/providers/Microsoft.DocumentDB/\
                                databaseAccounts/acct/sqlDatabases/shop";

    #[tokio::test]
    async fn a_managed_identity_queue_gets_what_is_missing_through_arm_and_becomes_ready() {
        let crate::testing::ArmContext {
            ctx,
            mut server,
            cosmos,
            arm,
            pauses,
        } = crate::testing::arm_context(
            crate::arm::fake::Script {
                throttle_first: Some(7),
                ..Default::default()
            },
            &[GRANT],
        )
        .await;
        let input = identity_queue("Retain", false);
        let verifier = tokio::spawn(async move {
            let event = server.event().await;
            let status = server.status(STATUS, queue(json!({}), false)).await;
            server.done().await;
            (event, status)
        });
        let action = reconcile_queue(arc(&input), ctx).await.unwrap();
        assert_eq!(action, Action::requeue(crate::context::RESYNC));
        let (event, status) = verifier.await.unwrap();
        assert_eq!(
            (&event["type"], &event["reason"]),
            (&json!("Normal"), &json!("Provisioned"))
        );
        assert_eq!(
            event["note"],
            "created the database, messages container, lease container of shop/orders"
        );
        assert_eq!(
            condition(&status["status"], "Ready"),
            ("True", "Provisioned")
        );
        // Database first, then the containers, each once (each read first: the first read
        // was throttled, then sent again).
        assert_eq!(
            arm.puts(),
            [
                ACCOUNT_PATH.to_owned(),
                format!("{ACCOUNT_PATH}/containers/orders"),
                format!("{ACCOUNT_PATH}/containers/orders-leases"),
            ]
        );
        // Real containers, as the engine defines them, on the data plane.
        assert!(container_exists(&cosmos, "shop", "orders").await);
        assert!(container_exists(&cosmos, "shop", "orders-leases").await);
        // The 429's Retry-After (7 s), then each operation's (3 s, then 4 s between polls).
        let waited = pauses.0.lock().unwrap().clone();
        let secs: Vec<u64> = waited.iter().map(|d| d.as_secs()).collect();
        assert_eq!(secs, [7, 3, 4, 3, 4, 3, 4]);
    }

    #[tokio::test]
    async fn an_admins_container_is_never_put_only_the_missing_one_is_created() {
        let crate::testing::ArmContext {
            ctx,
            mut server,
            cosmos,
            arm,
            ..
        } = crate::testing::arm_context(Default::default(), &[GRANT]).await;
        let input = identity_queue("Retain", false);
        // The admin made the database and the lease container (with its own throughput).
        let config = crate::spec::queue(&arc(&input).spec).unwrap();
        cosmos.create_database("shop", None).await.unwrap();
        cosmos
            .database_client("shop")
            .create_container(
                cosmosq_queue::cosmos::provision::lease_container(&config),
                None,
            )
            .await
            .unwrap();
        let verifier = tokio::spawn(async move {
            let event = server.event().await;
            server.status(STATUS, queue(json!({}), false)).await;
            event
        });
        reconcile_queue(arc(&input), ctx).await.unwrap();
        let event = verifier.await.unwrap();
        assert_eq!(
            event["note"],
            "created the messages container of shop/orders"
        );
        assert_eq!(arm.puts(), [format!("{ACCOUNT_PATH}/containers/orders")]);
        assert!(container_exists(&cosmos, "shop", "orders").await);
    }

    #[tokio::test]
    async fn an_existing_container_unlike_the_engines_stays_the_admins_to_change() {
        let crate::testing::ArmContext {
            ctx,
            mut server,
            cosmos,
            arm,
            ..
        } = crate::testing::arm_context(Default::default(), &[GRANT]).await;
        let input = identity_queue("Retain", false);
        cosmos.create_database("shop", None).await.unwrap();
        let wrong = azure_data_cosmos::models::ContainerProperties::new(
            "orders",
            serde_json::from_value(json!({"paths": ["/tenant"], "kind": "Hash", "version": 2}))
                .unwrap(),
        );
        cosmos
            .database_client("shop")
            .create_container(wrong, None)
            .await
            .unwrap();
        let verifier = tokio::spawn(async move {
            let event = server.event().await;
            let status = server.status(STATUS, queue(json!({}), false)).await;
            (event, status)
        });
        reconcile_queue(arc(&input), ctx).await.unwrap();
        let (event, status) = verifier.await.unwrap();
        assert_eq!(event["reason"], "NeedsProvisioning");
        assert_eq!(
            condition(&status["status"], "Stalled"),
            ("True", "NeedsProvisioning")
        );
        let message = status["status"]["conditions"][0]["message"]
            .as_str()
            .unwrap();
        assert!(
            message.contains("container orders is partitioned on /tenant")
                && message.contains("never changes existing ones"),
            "{message}"
        );
        // Not the wrong one, and not the missing lease container either: an admin decides.
        assert!(arm.seen().is_empty(), "{:?}", arm.seen());
    }

    #[tokio::test]
    async fn arm_refusing_the_identity_names_the_role_and_nothing_arm_said() {
        let crate::testing::ArmContext {
            ctx,
            mut server,
            cosmos,
            arm,
            ..
        } = crate::testing::arm_context(
            crate::arm::fake::Script {
                deny: Some(403),
                ..Default::default()
            },
            &[GRANT],
        )
        .await;
        let input = identity_queue("Retain", false);
        let verifier = tokio::spawn(async move {
            let event = server.event().await;
            let status = server.status(STATUS, queue(json!({}), false)).await;
            (event, status)
        });
        let action = reconcile_queue(arc(&input), ctx).await.unwrap();
        // No retry gets past a refusal until a role is assigned: looked at again at the
        // resync (or on a reconcile request), not every 30 s.
        assert_eq!(action, Action::requeue(crate::context::RESYNC));
        let (event, status) = verifier.await.unwrap();
        assert_eq!(event["type"], "Warning");
        assert_eq!(condition(&status["status"], "Ready").0, "False");
        assert_eq!(condition(&status["status"], "Stalled").0, "True");
        let message = status["status"]["conditions"][0]["message"]
            .as_str()
            .unwrap();
        assert!(
            message.contains("status 403")
                && message.contains("request id 0f1e2d3c-fake-request")
                && message.contains("\"Cosmos DB Operator\"")
                && message.contains("Microsoft.DocumentDB/databaseAccounts/sqlDatabases/write")
                && message.contains("sqlDatabases/containers/write")
                && message.contains(
                    "--scope /subscriptions/0b1f6471-1bf0-4dda-aec3-cb9272f09590/resourceGroups/shop-rg"
                ),
            "{message}"
        );
        for said in [event.to_string(), status.to_string()] {
            assert!(!said.contains(crate::arm::fake::SECRET), "{said}");
        }
        assert_eq!(arm.seen().len(), 1, "refused once, not retried");
        assert!(!container_exists(&cosmos, "shop", "orders").await);
    }

    #[tokio::test]
    async fn a_namespace_not_granted_never_reaches_arm() {
        let crate::testing::ArmContext {
            ctx,
            mut server,
            arm,
            ..
        } = crate::testing::arm_context(
            Default::default(),
            &["billing@https://acct.documents.azure.com:443/shop"],
        )
        .await;
        let verifier = tokio::spawn(async move {
            let event = server.event().await;
            assert_eq!(event["reason"], "InvalidSpec");
            let status = server.status(STATUS, queue(json!({}), true)).await;
            server.done().await;
            status
        });
        let input = identity_queue("Delete", true);
        let action = reconcile_queue(arc(&input), ctx.clone()).await.unwrap();
        assert_eq!(action, Action::await_change());
        // Nor at deletion.
        let mut identity_deleting = identity_queue("Delete", true);
        identity_deleting["metadata"]["deletionTimestamp"] = json!("2026-11-30T10:00:00Z");
        assert!(matches!(
            ctx.cosmos.deprovision(&arc(&identity_deleting)).await,
            Err(CosmosError::IdentityNotGranted { .. })
        ));
        drop(ctx);
        let status = verifier.await.unwrap();
        let message = status["status"]["conditions"][0]["message"]
            .as_str()
            .unwrap();
        assert!(
            message.contains("namespace shop is not granted"),
            "{message}"
        );
        assert!(arm.seen().is_empty(), "{:?}", arm.seen());
    }

    #[tokio::test]
    async fn a_delete_queue_is_deleted_through_arm() {
        let crate::testing::ArmContext {
            ctx,
            mut server,
            cosmos,
            arm,
            ..
        } = crate::testing::arm_context(Default::default(), &[GRANT]).await;
        let mut input = identity_queue("Delete", true);
        input["metadata"]["deletionTimestamp"] = json!("2026-11-30T10:00:00Z");
        let config = crate::spec::queue(&arc(&input).spec).unwrap();
        cosmosq_queue::provision(&cosmos, &config).await.unwrap();
        // Created through ARM for this queue (uid q1).
        for container in ["orders", "orders-leases"] {
            arm.tag("shop", container, json!({crate::arm::OWNER_TAG: "q1"}));
        }
        let verifier = tokio::spawn(async move {
            let event = server.event().await;
            assert_eq!(
                (&event["type"], &event["reason"]),
                (&json!("Normal"), &json!("Deleted"))
            );
            expect_finalizer_removed(&mut server, deleting("Delete")).await;
        });
        reconcile_queue(arc(&input), ctx).await.unwrap();
        verifier.await.unwrap();
        assert!(!container_exists(&cosmos, "shop", "orders").await);
        assert!(!container_exists(&cosmos, "shop", "orders-leases").await);
        let deletes: Vec<_> = arm
            .seen()
            .into_iter()
            .filter(|s| s.method == Method::DELETE)
            .map(|s| s.path)
            .collect();
        assert_eq!(
            deletes,
            [
                format!("{ACCOUNT_PATH}/containers/orders"),
                format!("{ACCOUNT_PATH}/containers/orders-leases"),
            ]
        );
        // The database may hold other queues: it stays.
        assert!(cosmos.database_client("shop").read(None).await.is_ok());
    }

    #[tokio::test]
    async fn containers_a_queue_did_not_create_are_never_deleted_through_arm() {
        // A queue naming containers of its granted database that an admin made (no tag), or
        // that were made for another queue of the same names (another uid): its deletion
        // deletes neither, and says so.
        for tags in [None, Some(json!({crate::arm::OWNER_TAG: "another-queue"}))] {
            let crate::testing::ArmContext {
                ctx,
                mut server,
                cosmos,
                arm,
                ..
            } = crate::testing::arm_context(Default::default(), &[GRANT]).await;
            let mut input = identity_queue("Delete", true);
            input["metadata"]["deletionTimestamp"] = json!("2026-11-30T10:00:00Z");
            let config = crate::spec::queue(&arc(&input).spec).unwrap();
            cosmosq_queue::provision(&cosmos, &config).await.unwrap();
            if let Some(tags) = &tags {
                arm.tag("shop", "orders", tags.clone());
            }
            // The lease container is this queue's: it goes.
            arm.tag(
                "shop",
                "orders-leases",
                json!({crate::arm::OWNER_TAG: "q1"}),
            );
            let verifier = tokio::spawn(async move {
                let event = server.event().await;
                assert_eq!(event["reason"], "DeleteSkipped");
                let note = event["note"].as_str().unwrap();
                assert!(
                    note.contains("NOT deleted")
                        && note.contains("shop/orders not created by this queue"),
                    "{note}"
                );
                expect_finalizer_removed(&mut server, deleting("Delete")).await;
            });
            reconcile_queue(arc(&input), ctx).await.unwrap();
            verifier.await.unwrap();
            assert!(
                container_exists(&cosmos, "shop", "orders").await,
                "{tags:?}"
            );
            assert!(!container_exists(&cosmos, "shop", "orders-leases").await);
            let deletes: Vec<_> = arm
                .seen()
                .into_iter()
                .filter(|s| s.method == Method::DELETE)
                .map(|s| s.path)
                .collect();
            assert_eq!(
                deletes,
                [format!("{ACCOUNT_PATH}/containers/orders-leases")]
            );
        }
    }

    #[tokio::test]
    async fn a_queue_asking_more_throughput_than_the_admin_allows_creates_nothing() {
        let crate::testing::ArmContext {
            ctx,
            mut server,
            cosmos,
            arm,
            ..
        } = crate::testing::arm_context(Default::default(), &[GRANT]).await;
        // The context allows 4,000 RU/s; the queue asks for 10,000.
        let mut input = identity_queue("Delete", true);
        input["spec"]["throughput"] = json!({"mode": "Manual", "requestUnits": 10000});
        let verifier = tokio::spawn(async move {
            let event = server.event().await;
            assert_eq!(event["reason"], "InvalidSpec");
            let status = server.status(STATUS, queue(json!({}), true)).await;
            let ready = crate::testing::condition(&status["status"], "Ready");
            let message = ready["message"].as_str().unwrap();
            assert!(
                message.contains("10000 RU/s is more than")
                    && message.contains("at most 4000 RU/s"),
                "{message}"
            );
            assert_eq!(
                crate::testing::condition(&status["status"], "Stalled")["status"],
                "True"
            );
        });
        reconcile_queue(arc(&input), ctx).await.unwrap();
        verifier.await.unwrap();
        assert!(arm.puts().is_empty(), "{:?}", arm.puts());
        assert!(!container_exists(&cosmos, "shop", "orders").await);
    }

    #[tokio::test]
    async fn a_delete_arm_refuses_releases_the_queue_with_a_warning() {
        let crate::testing::ArmContext {
            ctx,
            mut server,
            cosmos,
            arm: _served,
            ..
        } = crate::testing::arm_context(
            crate::arm::fake::Script {
                deny: Some(403),
                ..Default::default()
            },
            &[GRANT],
        )
        .await;
        let mut input = identity_queue("Delete", true);
        input["metadata"]["deletionTimestamp"] = json!("2026-11-30T10:00:00Z");
        let config = crate::spec::queue(&arc(&input).spec).unwrap();
        cosmosq_queue::provision(&cosmos, &config).await.unwrap();
        let verifier = tokio::spawn(async move {
            let event = server.event().await;
            assert!(
                !event.to_string().contains(crate::arm::fake::SECRET),
                "{event}"
            );
            assert_eq!(event["reason"], "DeleteSkipped");
            let note = event["note"].as_str().unwrap();
            assert!(
                note.contains("NOT deleted")
                    && note.contains("status 403")
                    && note.contains("containers/delete"),
                "{note}"
            );
            expect_finalizer_removed(&mut server, deleting("Delete")).await;
        });
        reconcile_queue(arc(&input), ctx).await.unwrap();
        verifier.await.unwrap();
        assert!(container_exists(&cosmos, "shop", "orders").await);
    }
}
