//! Reconciling a CosmosQueue: provision the database, the messages container and the lease
//! container (create if missing, never modify what exists), report partitions and health; on
//! deletion, honour the deletion policy before kube-runtime's `finalizer` helper lets the
//! resource go.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cosmosq_crds::{CosmosQueue, DeletionPolicy};
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::finalizer::{finalizer, Event as Finalizer};
use kube::{Api, ResourceExt};
use serde_json::json;
use tracing::{info, warn};

use crate::apply::FIELD_MANAGER;
use crate::context::Context;
use crate::cosmos::CosmosError;
use crate::status;

pub const KIND: &str = "CosmosQueue";
/// Held while the deletion policy has not been carried out.
pub const FINALIZER: &str = "cosmosq.io/deletion-policy";

#[derive(Debug, thiserror::Error)]
pub enum QueueReconcileError {
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("deleting the queue's containers: {0}")]
    Deprovision(CosmosError),
    #[error("finalizer: {0}")]
    Finalizer(String),
    #[error("{0} has no namespace")]
    NoNamespace(String),
}

impl QueueReconcileError {
    pub fn kind(&self) -> &'static str {
        match self {
            QueueReconcileError::Kube(_) => "kube",
            QueueReconcileError::Deprovision(_) => "cosmos",
            QueueReconcileError::Finalizer(_) => "finalizer",
            QueueReconcileError::NoNamespace(_) => "invalid_object",
        }
    }
}

pub async fn reconcile_queue(
    cq: Arc<CosmosQueue>,
    ctx: Arc<Context>,
) -> Result<Action, QueueReconcileError> {
    let started = Instant::now();
    ctx.metrics.reconciles.with_label_values(&[KIND]).inc();
    let namespace = cq
        .namespace()
        .ok_or_else(|| QueueReconcileError::NoNamespace(cq.name_any()))?;
    let api: Api<CosmosQueue> = Api::namespaced(ctx.client.clone(), &namespace);
    let result = finalizer(&api, FINALIZER, cq, |event| async {
        match event {
            Finalizer::Apply(cq) => apply(&cq, &ctx).await,
            Finalizer::Cleanup(cq) => cleanup(&cq, &ctx).await,
        }
    })
    .await
    .map_err(|e| match e {
        kube::runtime::finalizer::Error::ApplyFailed(e)
        | kube::runtime::finalizer::Error::CleanupFailed(e) => e,
        other => QueueReconcileError::Finalizer(other.to_string()),
    });
    ctx.metrics
        .reconcile_duration
        .with_label_values(&[KIND])
        .observe(started.elapsed().as_secs_f64());
    result
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
    let generation = cq.metadata.generation;
    let previous = cq.status.clone().unwrap_or_default();
    let now = status::now();
    let (conditions, partitions, action) = match provisioned {
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
            info!(queue = %cq.name_any(), %namespace, partitions, "{message}");
            if !created.is_empty() {
                ctx.event(
                    cq,
                    EventType::Normal,
                    "Provisioned",
                    "Provision",
                    message.clone(),
                )
                .await;
            }
            let c = |type_, ok, reason| {
                status::condition(
                    &previous.conditions,
                    type_,
                    ok,
                    reason,
                    message.clone(),
                    generation,
                    now.clone(),
                )
            };
            (
                vec![
                    c(status::READY, true, "Provisioned"),
                    c(status::PROVISIONED, true, "Provisioned"),
                    c(status::DEGRADED, false, "Provisioned"),
                ],
                Some(partitions as i32),
                Action::requeue(Duration::from_secs(300)),
            )
        }
        Err(e) => {
            // Spec errors wait for a change; Cosmos errors (throttling, outage, a wrong
            // endpoint) are retried. Neither message can hold the key: it is never formatted.
            let (reason, action) = if e.is_spec_error() {
                ("InvalidSpec", Action::await_change())
            } else {
                (
                    "ProvisioningFailed",
                    Action::requeue(Duration::from_secs(30)),
                )
            };
            ctx.cosmos.forget(cq).await;
            let message = e.to_string();
            warn!(queue = %cq.name_any(), %namespace, reason, "{message}");
            ctx.metrics
                .reconcile_errors
                .with_label_values(&[KIND, reason])
                .inc();
            ctx.event(cq, EventType::Warning, reason, "Provision", message.clone())
                .await;
            let c = |type_, ok| {
                status::condition(
                    &previous.conditions,
                    type_,
                    ok,
                    reason,
                    message.clone(),
                    generation,
                    now.clone(),
                )
            };
            (
                vec![
                    c(status::READY, false),
                    c(status::PROVISIONED, false),
                    c(status::DEGRADED, true),
                ],
                previous.partitions,
                action,
            )
        }
    };
    let mut status = json!({"conditions": conditions, "observedGeneration": generation});
    if let Some(partitions) = partitions {
        status["partitions"] = json!(partitions);
    }
    let api: Api<CosmosQueue> = Api::namespaced(ctx.client.clone(), &namespace);
    api.patch_status(
        &cq.name_any(),
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(json!({"apiVersion": "cosmosq.io/v1alpha1", "kind": KIND, "status": status})),
    )
    .await?;
    Ok(action)
}

async fn cleanup(cq: &CosmosQueue, ctx: &Context) -> Result<Action, QueueReconcileError> {
    let what = format!("{}/{}", cq.spec.database, cq.spec.container);
    match cq.spec.deletion_policy {
        DeletionPolicy::Retain => {
            ctx.cosmos.forget(cq).await;
            let note = format!("deletionPolicy Retain: kept the containers of {what}");
            info!(queue = %cq.name_any(), "{note}");
            ctx.event(cq, EventType::Normal, "Retained", "Delete", note)
                .await;
        }
        DeletionPolicy::Delete => {
            if let Err(e) = ctx.cosmos.deprovision(cq).await {
                ctx.event(
                    cq,
                    EventType::Warning,
                    "DeleteFailed",
                    "Delete",
                    e.to_string(),
                )
                .await;
                return Err(QueueReconcileError::Deprovision(e));
            }
            let note = format!("deletionPolicy Delete: deleted the containers of {what}");
            info!(queue = %cq.name_any(), "{note}");
            ctx.event(cq, EventType::Normal, "Deleted", "Delete", note)
                .await;
        }
    }
    Ok(Action::await_change())
}
