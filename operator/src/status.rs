//! Status conditions, shared by both resources.
//!
//! Conditions are a list keyed by type (see the CRDs), and each condition has one writer: the
//! reconcilers own `Ready`, `Provisioned` and the queue's `Degraded`; the scaling loop owns a
//! group's `Degraded` (the estimate's health). Each writes with its own server-side-apply field
//! manager, so neither erases the other's.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

pub const READY: &str = "Ready";
pub const DEGRADED: &str = "Degraded";
pub const PROVISIONED: &str = "Provisioned";

/// The field manager of the scaling loop's status fields.
pub const SCALER_MANAGER: &str = "cosmosq-operator-scaler";

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
            "InvalidSpec",
            "bad".into(),
            Some(3),
            t1.clone(),
        );
        assert_eq!(flipped.last_transition_time, t1);
    }
}
