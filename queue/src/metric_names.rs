//! The names of the figures cosmosq publishes, defined once for the operator's Prometheus
//! metrics, its external metrics API (what an HPA names), and the sidecar's metrics. One figure
//! has one name wherever it appears; its scope shows in the labels and the scrape target: the
//! operator reports a whole group (`namespace`, `queue`, `group`), a sidecar the ranges its pod
//! owns (`queue`, `group`, and `range` where per range). Units are in the names.
//!
//! Both carry the constant label [`SCOPE`]: `scope="group"` on the operator's series,
//! `scope="pod"` on a sidecar's, so that a query picks one of them and a sum counts no
//! message twice.

/// The label that tells a whole group's figure from one pod's.
pub const SCOPE: &str = "scope";
/// [`SCOPE`] of the operator's figures: the whole group.
pub const SCOPE_GROUP: &str = "group";
/// [`SCOPE`] of a sidecar's figures: the ranges its pod owns.
pub const SCOPE_POD: &str = "pod";

/// Messages a group has not settled yet (read or not): what scaling is decided on.
pub const BACKLOG: &str = "cosmosq_backlog_messages";
/// Messages a group has not read yet (the change feed's remaining work).
pub const LAG: &str = "cosmosq_lag_messages";
/// Age of the oldest message a group has not settled.
pub const OLDEST_MESSAGE_AGE: &str = "cosmosq_oldest_message_age_seconds";
/// Workers the scaling decision wants for a group.
pub const DESIRED_REPLICAS: &str = "cosmosq_desired_replicas";
/// Messages in a group's dead letters.
pub const DEAD_LETTERS: &str = "cosmosq_dead_letters";

/// External metric names served before they were [`BACKLOG`] and [`LAG`]: the external
/// metrics API still answers to them, so an HPA written against them keeps working.
pub const LEGACY_EXTERNAL: [(&str, &str); 2] = [("cosmosq_backlog", BACKLOG), ("cosmosq_lag", LAG)];

/// The figure an external metric name stands for, old names included.
pub fn external(name: &str) -> Option<&'static str> {
    [BACKLOG, LAG].into_iter().find(|n| *n == name).or_else(|| {
        LEGACY_EXTERNAL
            .iter()
            .find(|(old, _)| *old == name)
            .map(|(_, new)| *new)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn external_names_old_and_new_mean_one_figure() {
        assert_eq!(external("cosmosq_backlog_messages"), Some(BACKLOG));
        assert_eq!(external("cosmosq_backlog"), Some(BACKLOG));
        assert_eq!(external("cosmosq_lag_messages"), Some(LAG));
        assert_eq!(external("cosmosq_lag"), Some(LAG));
        assert_eq!(
            external("cosmosq_dead_letters"),
            None,
            "not an external metric"
        );
        assert_eq!(external("cpu"), None);
    }
}
