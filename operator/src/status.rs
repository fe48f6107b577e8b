//! Status conditions and the names users read: condition types, condition reasons and Event
//! reasons of both resources, defined here and nowhere else.
//!
//! Conditions are a list keyed by type (see the CRDs), and each condition has one writer: the
//! reconcilers own `Ready`, `Available`, `Provisioned`, `Reconciling`, `Stalled` and the queue's
//! `Degraded`; the scaling loop owns a group's `Degraded` (the estimate's health) and `Paused`. Each writes with its own
//! server-side-apply field manager, so neither erases the other's.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::Patch;
use serde::Serialize;

/// Condition type: the resource's objects are applied (group) or its containers exist (queue).
pub const READY: &str = "Ready";
/// Condition type: the group's Deployment's own `Available`, mirrored.
pub const AVAILABLE: &str = "Available";
/// Condition type: the estimate failed (group), or provisioning did (queue).
pub const DEGRADED: &str = "Degraded";
/// Condition type of a group: a pause annotation holds its workers.
pub const PAUSED: &str = "Paused";
/// Condition type of a queue: its database and containers exist.
pub const PROVISIONED: &str = "Provisioned";
/// Condition type (kstatus, abnormal-true): the operator is still working toward the spec and
/// retries by itself (a queue being provisioned, a rollout, a queue not yet created).
pub const RECONCILING: &str = "Reconciling";
/// Condition type (kstatus, abnormal-true): the operator cannot make progress until someone
/// changes something (the spec, a grant, an object of the group's name).
pub const STALLED: &str = "Stalled";

/// Where a reconcile left the resource, as kstatus readers (Flux, kpt, `kubectl wait`, the
/// Argo CD health check in docs/gitops.md) need to know it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// The spec is realised.
    Done,
    /// Not yet; the operator retries by itself.
    Reconciling,
    /// Not until its owner (or an admin) acts.
    Stalled,
}

/// The `Reconciling` and `Stalled` conditions of `progress`, both always present (status
/// `False` when they do not apply) so a reader never mistakes a missing condition for an old
/// operator, each with the reconcile's reason and message.
pub fn progress(
    existing: &[Condition],
    progress: Progress,
    reason: &str,
    message: &str,
    generation: Option<i64>,
    now: &Time,
) -> [Condition; 2] {
    [
        (RECONCILING, progress == Progress::Reconciling),
        (STALLED, progress == Progress::Stalled),
    ]
    .map(|(type_, on)| {
        condition(
            existing,
            type_,
            on,
            reason,
            message.to_owned(),
            generation,
            now.clone(),
        )
    })
}

/// Reasons of conditions and Events. A condition's reason is also its Event's reason, so a
/// user who sees one can search for the other.
pub mod reasons {
    /// A group's objects are applied and up to date.
    pub const APPLIED: &str = "Applied";
    /// A group's queue does not exist (yet).
    pub const QUEUE_NOT_FOUND: &str = "QueueNotFound";
    /// A queue of a group's `spec.publishTo` does not exist (yet).
    pub const PUBLISH_QUEUE_NOT_FOUND: &str = "PublishQueueNotFound";
    /// A field of the spec cannot be used; the message names it.
    pub const INVALID_SPEC: &str = "InvalidSpec";
    /// The API server (its validation or an admission webhook/policy) refused an object.
    pub const APPLY_REJECTED: &str = "ApplyRejected";
    /// An object of a name the group needs exists and is not the group's: it is left alone.
    pub const NOT_OWNED: &str = "NotOwned";
    /// The Deployment cannot create the worker pods (quota, admission).
    pub const REPLICA_FAILURE: &str = "ReplicaFailure";
    /// A queue's database and containers exist (or were just created).
    pub const PROVISIONED: &str = "Provisioned";
    /// Creating or reading a queue's containers failed; retried.
    pub const PROVISIONING_FAILED: &str = "ProvisioningFailed";
    /// The scaling loop estimated the group's remaining work.
    pub const ESTIMATE_HEALTHY: &str = "EstimateHealthy";
    /// The estimate failed: the replicas are kept as they are.
    pub const ESTIMATE_FAILED: &str = "EstimateFailed";
    /// A pause annotation holds the group's workers.
    pub const PAUSED: &str = "PausedByAnnotation";
    /// A pause annotation cannot be read: the workers are held where they are.
    pub const INVALID_PAUSE: &str = "InvalidPauseAnnotation";
    /// No pause annotation.
    pub const NOT_PAUSED: &str = "NotPaused";
    /// Event: `spec.replicas` is set but the mode is not `External`.
    pub const REPLICAS_IGNORED: &str = "ReplicasIgnored";
    /// Event: the scaling loop changed the workers' replicas.
    pub const SCALED: &str = "Scaled";
    /// Event: a deleted `Retain` queue's containers were kept.
    pub const RETAINED: &str = "Retained";
    /// Event: a deleted `Delete` queue's containers were deleted.
    pub const DELETED: &str = "Deleted";
    /// A queue's database or containers, which its credentials may not create, are missing
    /// or unlike what the engine needs: an admin creates them.
    pub const NEEDS_PROVISIONING: &str = "NeedsProvisioning";
    /// A group's Deployment is rolling out its current template.
    pub const ROLLING_OUT: &str = "RollingOut";
    /// A group's Deployment gave up its rollout (its progress deadline passed).
    pub const ROLLOUT_STOPPED: &str = "ProgressDeadlineExceeded";
    /// Event: the operator would roll a group's workers onto what it builds now, and waits
    /// (its rollout policy).
    pub const UPDATE_HELD: &str = "UpdateHeld";
    /// Event: deleting a `Delete` queue's containers failed; retried.
    pub const DELETE_FAILED: &str = "DeleteFailed";
    /// Event: a deleted `Delete` queue was released without deleting its containers.
    pub const DELETE_SKIPPED: &str = "DeleteSkipped";
}

/// A server-side apply of `status` alone, as `K`'s own kind and API version.
pub fn patch<K, S>(status: &S) -> Patch<serde_json::Value>
where
    K: kube::Resource<DynamicType = ()>,
    S: Serialize,
{
    Patch::Apply(serde_json::json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "status": status,
    }))
}

/// The field manager of the scaling loop's status fields.
pub const SCALER_MANAGER: &str = "cosmosq-operator-scaler";

/// The time now, as conditions record it.
pub fn now() -> Time {
    Time(k8s_openapi::jiff::Timestamp::now())
}

/// A condition, keeping its last transition time when its status did not change.
pub fn condition(
    existing: &[Condition],
    type_: &str,
    ok: bool,
    reason: &str,
    message: String,
    generation: Option<i64>,
    now: Time,
) -> Condition {
    let status = if ok { "True" } else { "False" };
    let since = existing
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or(now);
    Condition {
        type_: type_.into(),
        status: status.into(),
        reason: reason.into(),
        message,
        observed_generation: generation,
        last_transition_time: since,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transition_time_moves_only_when_the_status_flips() {
        let t0 = Time(k8s_openapi::jiff::Timestamp::from_second(1_000).unwrap());
        let t1 = Time(k8s_openapi::jiff::Timestamp::from_second(2_000).unwrap());
        let first = condition(
            &[],
            "Ready",
            true,
            "Applied",
            "ok".into(),
            Some(1),
            t0.clone(),
        );
        let same = condition(
            std::slice::from_ref(&first),
            "Ready",
            true,
            "Applied",
            "ok".into(),
            Some(2),
            t1.clone(),
        );
        assert_eq!(same.last_transition_time, t0);
        let flipped = condition(
            &[first],
            "Ready",
            false,
            reasons::INVALID_SPEC,
            "bad".into(),
            Some(3),
            t1.clone(),
        );
        assert_eq!(flipped.last_transition_time, t1);
    }
}
