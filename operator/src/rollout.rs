//! When a group's workers roll.
//!
//! A worker pod template is built from the group's spec, its queue's spec, the account key's
//! digest and the operator itself (its version and the sidecar image it injects). A change of
//! the first two is the user's: it rolls the group at once. A change of the operator's own
//! (an upgrade of the chart) would roll every group of the cluster within a minute — an image
//! pull storm, every lease handed over at once, a spike of request units — so, as Linkerd,
//! Istio and Dapr leave running pods alone, it waits: for the group's next spec change, for a
//! new value of its `cosmosq.io/rollout-requested-at` annotation, or, with the opt-in
//! `--sidecar-update=rolling`, for a place among `--sidecar-update-max-concurrent` groups
//! rolling at a time. A rotated key must reach the workers before the old one is regenerated,
//! so it rolls under that budget whatever the policy.
//!
//! What a Deployment was built from is recorded on it ([`BUILT_FROM`]), so the decision needs
//! nothing but the metadata the ownership check already reads.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::Deployment;
use serde::{Deserialize, Serialize};

/// The Deployment annotation recording what its pod template was built from (JSON).
pub const BUILT_FROM: &str = "cosmosq.io/built-from";
/// The Deployment annotation saying why it last rolled: `operator` rollouts count against the
/// budget until they complete.
pub const ROLLOUT_CAUSE: &str = "cosmosq.io/rollout-cause";
/// The group annotation whose every new value lets the group take what the operator builds
/// now (a new sidecar, a rotated key), like `kubectl rollout restart`.
pub const ROLLOUT_REQUESTED: &str = "cosmosq.io/rollout-requested-at";

/// What a worker pod template was built from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuiltFrom {
    /// The group's generation.
    pub group: Option<i64>,
    /// The queue's generation.
    pub queue: Option<i64>,
    /// The generations of the queues of `spec.publishTo`, by name (none recorded for a group
    /// without: its record reads as before pipelines).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub targets: BTreeMap<String, i64>,
    /// The group's [`ROLLOUT_REQUESTED`] value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<String>,
    /// The operator: `<version>+t<template revision>/<default sidecar image>`.
    pub operator: String,
    /// The account key's digest (key Secrets only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// The API tokens' digest (groups with tokens only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<String>,
}

impl BuiltFrom {
    /// What a Deployment's annotations say it was built from; `None` for one built before
    /// this was recorded, or whose record is not ours to read.
    pub fn of(annotations: &BTreeMap<String, String>) -> Option<Self> {
        serde_json::from_str(annotations.get(BUILT_FROM)?).ok()
    }

    /// As the annotation holds it.
    pub fn annotation(&self) -> String {
        serde_json::to_string(self).expect("plain fields serialize")
    }
}

/// Bumped with every change to how the workers' pod templates are built that reaches every
/// group (a variable added or spelled anew): an operator built from it rolls the groups under
/// its budget, as a new version does, even when the version number did not change. 2: every
/// sidecar setting written from `SidecarSettings`; 3: the app's protocol and Dapr's gRPC API
/// (`COSMOSQ_APP_PROTOCOL`, `COSMOSQ_GRPC_LISTEN`, `DAPR_GRPC_PORT`); 4: the range's
/// progress interval (`COSMOSQ_CHECKPOINT_INTERVAL`).
pub const TEMPLATE_REVISION: u32 = 4;

/// The operator as [`BuiltFrom::operator`] names it.
pub fn operator(sidecar_image: &str) -> String {
    format!(
        "{}+t{TEMPLATE_REVISION}/{sidecar_image}",
        env!("CARGO_PKG_VERSION")
    )
}

/// Why the built template differs from the running one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cause {
    /// It does not (or nothing runs yet): applying changes nothing, or creates the workers.
    Unchanged,
    /// The group's or the queue's spec changed: the user's change, rolled at once.
    Spec,
    /// The group asked for it ([`ROLLOUT_REQUESTED`]).
    Request,
    /// The group's API tokens were rotated: its own Secret, rolled at once (a container
    /// restarted in an old pod would read the new tokens and its pod's others the old).
    Tokens,
    /// The account key was rotated (the operator may have changed too).
    Key,
    /// The operator changed (an upgrade, another default sidecar image), or the running
    /// template's record is unknown (built by a version before the record).
    Operator,
}

/// Why `desired` differs from what runs (pure). `spec_changed` says whether the group's spec
/// changed since its status was last written, for Deployments with no record.
pub fn cause(running: Option<&BuiltFrom>, desired: &BuiltFrom, spec_changed: bool) -> Cause {
    let Some(running) = running else {
        return if spec_changed {
            Cause::Spec
        } else {
            Cause::Operator
        };
    };
    if running.group != desired.group
        || running.queue != desired.queue
        || running.targets != desired.targets
    {
        // A queue the group publishes to changed (moved, re-created): the user's change too.
        Cause::Spec
    } else if running.request != desired.request {
        Cause::Request
    } else if running.tokens.is_some() && running.tokens != desired.tokens {
        // Only a change between two known digests: a record without one was written before
        // tokens were recorded (or while their Secret was missing), and its digest arriving
        // with an upgrade is the operator's change, held or budgeted like it.
        Cause::Tokens
    } else if running.key != desired.key {
        // Before the operator's own change: a rotated key must reach the workers even while
        // an upgrade waits (it brings the upgrade along, under the budget).
        Cause::Key
    } else if running.operator != desired.operator {
        Cause::Operator
    } else {
        Cause::Unchanged
    }
}

/// Whether the operator's own changes roll groups by themselves.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SidecarUpdate {
    /// No: a group takes them at its next spec change or rollout request.
    #[default]
    Manual,
    /// Yes, a few groups at a time.
    Rolling,
}

/// The operator's rollout policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RolloutPolicy {
    /// Whether operator changes roll by themselves.
    pub update: SidecarUpdate,
    /// How many groups may roll for the operator's reasons (and rotated keys) at once.
    pub max_concurrent: usize,
}

impl Default for RolloutPolicy {
    fn default() -> Self {
        Self {
            update: SidecarUpdate::Manual,
            max_concurrent: 5,
        }
    }
}

/// What to do with a group's Deployment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RolloutDecision {
    /// Apply what was built; `budgeted` when the rollout counts against the budget.
    Apply {
        /// It counts until it completes.
        budgeted: bool,
    },
    /// Leave the Deployment as it is, and say why.
    Hold(&'static str),
}

/// What to do for `cause` (pure); `rolling` is the number of budgeted rollouts in progress
/// (other groups'), asked only for the causes that need it.
pub fn decide(
    cause: Cause,
    policy: &RolloutPolicy,
    rolling: impl FnOnce() -> usize,
) -> RolloutDecision {
    match cause {
        Cause::Unchanged | Cause::Spec | Cause::Request | Cause::Tokens => {
            RolloutDecision::Apply { budgeted: false }
        }
        Cause::Operator if policy.update == SidecarUpdate::Manual => RolloutDecision::Hold(
            "the operator changed; the workers take it at the group's next spec change or \
             rollout request (cosmosq.io/rollout-requested-at)",
        ),
        Cause::Operator | Cause::Key => {
            if rolling() < policy.max_concurrent {
                RolloutDecision::Apply { budgeted: true }
            } else {
                RolloutDecision::Hold("waiting for a place among the groups rolling at a time")
            }
        }
    }
}

/// Whether [`decide`] needs the number of rollouts in progress for `cause` (pure).
pub fn counts(cause: Cause, policy: &RolloutPolicy) -> bool {
    cause == Cause::Key || (cause == Cause::Operator && policy.update == SidecarUpdate::Rolling)
}

/// Whether a Deployment's rollout is still going (pure): its controller has not seen the last
/// spec, or pods of an older template are still there. Not availability: a group scaled up
/// onto a full cluster (Pending pods) is not rolling. A rollout past its progress deadline
/// has stopped: it is failed, not going (it would hold a place in the budget for ever).
pub fn in_progress(d: &Deployment) -> bool {
    let Some(status) = &d.status else {
        return true;
    };
    if deadline_exceeded(d) {
        return false;
    }
    let updated = status.updated_replicas.unwrap_or(0);
    status.observed_generation < d.metadata.generation
        || updated < d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1)
        || status.replicas.unwrap_or(0) > updated
}

/// Whether the Deployment controller gave up on its rollout (`Progressing=False`,
/// `ProgressDeadlineExceeded`): a new template whose pods never become available.
pub fn deadline_exceeded(d: &Deployment) -> bool {
    d.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| {
            c.type_ == "Progressing"
                && c.status == "False"
                && c.reason.as_deref() == Some("ProgressDeadlineExceeded")
        })
}

/// Where a Deployment's rollout stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rollout {
    /// Every pod runs the current template.
    Done,
    /// Its controller is on it.
    Going,
    /// Its controller gave up (the progress deadline passed), saying why.
    Stopped(String),
}

/// Where `d`'s rollout stands (pure).
pub fn rollout(d: &Deployment) -> Rollout {
    if deadline_exceeded(d) {
        let said = d
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .find(|c| c.type_ == "Progressing")
            .and_then(|c| c.message.clone())
            .unwrap_or_default();
        Rollout::Stopped(said)
    } else if in_progress(d) {
        Rollout::Going
    } else {
        Rollout::Done
    }
}

/// How many budgeted rollouts are in progress among `deployments` (pure): the workers of a
/// group (controlled by a QueueConsumerGroup, named after it) rolled for the operator's
/// reasons, but `except` (a group is not its own rival). A Deployment anyone else made, even
/// with the same label and annotation, does not take a place.
pub fn budgeted_in_progress<'a>(
    deployments: impl IntoIterator<Item = &'a Deployment>,
    except: &str,
) -> usize {
    deployments
        .into_iter()
        .filter(|d| d.metadata.uid.as_deref() != Some(except))
        .filter(|d| {
            d.metadata.owner_references.iter().flatten().any(|o| {
                o.controller == Some(true)
                    && o.kind == "QueueConsumerGroup"
                    && d.metadata.name.as_deref() == Some(&format!("{}-workers", o.name))
            })
        })
        .filter(|d| {
            d.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ROLLOUT_CAUSE))
                .is_some_and(|c| c == "operator")
        })
        .filter(|d| in_progress(d))
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn built(group: i64, operator: &str, key: Option<&str>) -> BuiltFrom {
        BuiltFrom {
            group: Some(group),
            queue: Some(1),
            targets: BTreeMap::new(),
            request: None,
            operator: operator.into(),
            key: key.map(Into::into),
            tokens: None,
        }
    }

    #[test]
    fn a_queue_the_group_publishes_to_changing_is_the_users_change() {
        let running = BuiltFrom {
            targets: BTreeMap::from([("invoices".to_owned(), 1)]),
            ..built(3, "0.4.0/sidecar:0.4.0", Some("k1"))
        };
        let moved = BuiltFrom {
            targets: BTreeMap::from([("invoices".to_owned(), 2)]),
            // An upgrade waiting too: it does not hold the user's change.
            operator: "0.5.0/sidecar:0.5.0".into(),
            ..running.clone()
        };
        assert_eq!(cause(Some(&running), &moved, false), Cause::Spec);
        // A record written before pipelines reads as one without targets.
        let old = r#"{"group":3,"queue":1,"operator":"0.4.0/sidecar:0.4.0","key":"k1"}"#;
        let read = BuiltFrom::of(&BTreeMap::from([(BUILT_FROM.to_owned(), old.to_owned())]));
        assert_eq!(read, Some(built(3, "0.4.0/sidecar:0.4.0", Some("k1"))));
        assert!(!built(3, "o", None).annotation().contains("targets"));
    }

    #[test]
    fn the_users_changes_roll_at_once_and_the_operators_wait() {
        let running = built(3, "0.4.0/sidecar:0.4.0", Some("k1"));
        let upgraded = built(3, "0.5.0/sidecar:0.5.0", Some("k1"));
        let rotated = built(3, "0.4.0/sidecar:0.4.0", Some("k2"));
        let edited = built(4, "0.5.0/sidecar:0.5.0", Some("k2"));
        let requested = BuiltFrom {
            request: Some("2026-12-03T10:00:00Z".into()),
            ..upgraded.clone()
        };
        assert_eq!(cause(Some(&running), &running, false), Cause::Unchanged);
        assert_eq!(cause(Some(&running), &upgraded, false), Cause::Operator);
        assert_eq!(cause(Some(&running), &rotated, false), Cause::Key);
        // Upgraded (held) and then rotated: the key is not held with the upgrade.
        let both = built(3, "0.5.0/sidecar:0.5.0", Some("k2"));
        assert_eq!(cause(Some(&running), &both, false), Cause::Key);
        assert_eq!(cause(Some(&running), &edited, false), Cause::Spec);
        assert_eq!(cause(Some(&running), &requested, false), Cause::Request);
        // New API tokens roll the group at once, an upgrade held or not: a container
        // restarted in an old pod would read them, and its pod's others the old ones.
        let new_tokens = BuiltFrom {
            tokens: Some("t2".into()),
            ..upgraded.clone()
        };
        let with_tokens = BuiltFrom {
            tokens: Some("t1".into()),
            ..running.clone()
        };
        assert_eq!(cause(Some(&with_tokens), &new_tokens, false), Cause::Tokens);
        // Workers built before tokens were recorded: the digest arriving with an upgrade does
        // not roll every such group at once.
        assert_eq!(cause(Some(&running), &new_tokens, false), Cause::Operator);
        // Built before the record: the user's change if the spec moved, else the operator's.
        assert_eq!(cause(None, &upgraded, true), Cause::Spec);
        assert_eq!(cause(None, &upgraded, false), Cause::Operator);

        let manual = RolloutPolicy::default();
        let rolling = RolloutPolicy {
            update: SidecarUpdate::Rolling,
            max_concurrent: 2,
        };
        let never = || -> usize { panic!("the budget is not asked for a user's change") };
        for cause in [Cause::Unchanged, Cause::Spec, Cause::Request, Cause::Tokens] {
            assert!(!counts(cause, &rolling));
            assert_eq!(
                decide(cause, &manual, never),
                RolloutDecision::Apply { budgeted: false }
            );
        }
        assert!(!counts(Cause::Operator, &manual));
        assert!(matches!(
            decide(Cause::Operator, &manual, never),
            RolloutDecision::Hold(_)
        ));
        assert!(counts(Cause::Operator, &rolling) && counts(Cause::Key, &manual));
        assert_eq!(
            decide(Cause::Operator, &rolling, || 1),
            RolloutDecision::Apply { budgeted: true }
        );
        assert!(matches!(
            decide(Cause::Operator, &rolling, || 2),
            RolloutDecision::Hold(_)
        ));
        // A rotated key rolls under the budget even when upgrades wait for the user.
        assert_eq!(
            decide(Cause::Key, &manual, || 4),
            RolloutDecision::Apply { budgeted: true }
        );
        assert!(matches!(
            decide(Cause::Key, &manual, || 5),
            RolloutDecision::Hold(_)
        ));
    }

    #[test]
    fn only_unfinished_rollouts_of_the_operators_groups_count() {
        let deployment = |name: &str, cause: &str, observed: i64, updated: i32, replicas: i32| {
            serde_json::from_value::<Deployment>(json!({
                "metadata": {"name": format!("{name}-workers"), "uid": name, "generation": 2,
                             "annotations": {ROLLOUT_CAUSE: cause},
                             "ownerReferences": [{"apiVersion": "cosmosq.io/v1alpha1",
                                 "kind": "QueueConsumerGroup", "name": name, "uid": "g",
                                 "controller": true}]},
                "spec": {"replicas": 2, "selector": {}, "template": {}},
                "status": {"observedGeneration": observed, "replicas": replicas,
                           "updatedReplicas": updated, "availableReplicas": 0}
            }))
            .unwrap()
        };
        let mut forged = deployment("f", "operator", 2, 1, 2);
        forged.metadata.owner_references = None; // a tenant's, with the label and annotation
        let mut gave_up = deployment("x", "operator", 2, 1, 3);
        gave_up.status.as_mut().unwrap().conditions = Some(vec![serde_json::from_value(
            json!({"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}),
        )
        .unwrap()]);
        let all = [
            deployment("a", "operator", 2, 1, 3), // rolling: an old pod is still there
            deployment("b", "operator", 1, 2, 2), // its controller has not seen it yet
            deployment("c", "operator", 2, 2, 2), // done, though nothing is available yet
            deployment("d", "spec", 2, 0, 2),     // the user's: not budgeted
            forged,
            gave_up,
        ];
        assert_eq!(budgeted_in_progress(&all, ""), 2);
        assert_eq!(
            budgeted_in_progress(&all, "a"),
            1,
            "a group is not its own rival"
        );
        assert!(
            !in_progress(&all[2]),
            "Pending pods of a scale-up are not a rollout"
        );
    }

    #[test]
    fn a_record_round_trips_and_a_foreign_one_is_unknown() {
        let record = built(3, "0.5.0/sidecar:0.5.0", None);
        let annotations = BTreeMap::from([(BUILT_FROM.to_owned(), record.annotation())]);
        assert_eq!(BuiltFrom::of(&annotations), Some(record));
        let garbage = BTreeMap::from([(BUILT_FROM.to_owned(), "{".to_owned())]);
        assert_eq!(BuiltFrom::of(&garbage), None);
    }
}
