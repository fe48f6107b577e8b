//! Events that say when a promise became durable, for whoever watches the engine closely (the
//! simulation's checker; an operator debugging a duplicate): `debug` events with the target
//! [`TARGET`], cheap when that target is off.

use crate::message::MessageKey;

/// The tracing target of ledger events.
pub const TARGET: &str = "cosmosq::ledger";

/// A completion is recorded: the group will never deliver this message again.
pub(crate) fn completion_recorded(group: &str, id: &str, key: &MessageKey) {
    tracing::debug!(target: TARGET, event = "completed", group, id, key = %key.canonical(), "completion recorded");
}

/// A message is dead-lettered for the group: no delivery follows unless it is replayed.
pub(crate) fn dead_lettered(group: &str, id: &str, key: &MessageKey, reason: &str) {
    tracing::debug!(target: TARGET, event = "dead-lettered", group, id, key = %key.canonical(), reason, "dead letter recorded");
}

/// A lease write of `owner` landed that lists these deliveries (identities) as started: the
/// group's next owner of the range counts each as delivered.
pub(crate) fn starts_listed(group: &str, identities: &[String], owner: &str) {
    tracing::debug!(target: TARGET, event = "started", group, id = %identities.join(","), owner, "starts listed");
}

/// A host asked another for a lease (a hand-over, for balance).
pub(crate) fn lease_asked(group: &str, lease: &str, owner: &str, by: &str) {
    tracing::debug!(target: TARGET, event = "asked", group, lease, owner, by, "lease asked for");
}

/// A host took a lease (its previous owner, if another, holds the range no more).
pub(crate) fn lease_acquired(group: &str, lease: &str, owner: &str) {
    tracing::debug!(target: TARGET, event = "acquired", group, lease, owner, "lease acquired");
}

/// A host released a lease (it stopped, or handed the lease over).
pub(crate) fn lease_released(group: &str, lease: &str, owner: &str) {
    tracing::debug!(target: TARGET, event = "released", group, lease, owner, "lease released");
}
