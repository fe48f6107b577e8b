//! Request-unit accounting.
//!
//! Every Cosmos call the engine makes reports its `x-ms-request-charge` here, by operation,
//! so benchmarks, the demo and metrics can say what a message costs per group.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use azure_data_cosmos::diagnostics::DiagnosticsContext;

/// Request units and calls spent by a queue's operations, from the SDK's diagnostics, and the throttled (429) answers.
#[derive(Debug, Default)]
pub struct RequestCharges {
    by_operation: Mutex<BTreeMap<&'static str, OperationCharge>>,
    throttled: AtomicU64,
}

/// Calls and request units spent on one kind of operation.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OperationCharge {
    /// Calls made.
    pub calls: u64,
    /// Request units they cost.
    pub request_units: f64,
}

/// A copy of the counters at one moment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChargeSnapshot {
    /// Charges by operation (`claim`, `complete`, `feed`, …).
    pub by_operation: BTreeMap<&'static str, OperationCharge>,
}

impl ChargeSnapshot {
    /// Request units of every operation.
    pub fn total_request_units(&self) -> f64 {
        self.by_operation.values().map(|c| c.request_units).sum()
    }

    /// Calls of every operation.
    pub fn total_calls(&self) -> u64 {
        self.by_operation.values().map(|c| c.calls).sum()
    }

    /// Calls of one operation (none made: 0).
    pub fn calls(&self, operation: &str) -> u64 {
        self.by_operation.get(operation).map_or(0, |c| c.calls)
    }

    /// What was spent between `earlier` and this snapshot.
    pub fn since(&self, earlier: &ChargeSnapshot) -> ChargeSnapshot {
        let by_operation = self
            .by_operation
            .iter()
            .map(|(op, now)| {
                let before = earlier.by_operation.get(op).copied().unwrap_or_default();
                (
                    *op,
                    OperationCharge {
                        calls: now.calls - before.calls,
                        request_units: now.request_units - before.request_units,
                    },
                )
            })
            .filter(|(_, c)| c.calls > 0)
            .collect();
        ChargeSnapshot { by_operation }
    }
}

impl RequestCharges {
    /// Counts one call of `operation` and its charge (`None`: the answer had none).
    pub fn record(&self, operation: &'static str, request_units: Option<f64>) {
        let mut map = self.by_operation.lock().unwrap_or_else(|p| p.into_inner());
        let entry = map.entry(operation).or_default();
        entry.calls += 1;
        entry.request_units += request_units.unwrap_or(0.0);
    }

    /// Records an operation from its diagnostics: the charge of every attempt the SDK made
    /// (retries included), and each 429 it absorbed.
    pub(crate) fn record_diagnostics(
        &self,
        operation: &'static str,
        diagnostics: &DiagnosticsContext,
    ) {
        self.record(operation, Some(diagnostics.total_request_charge().value()));
        let throttled = diagnostics
            .requests()
            .iter()
            .filter(|r| u16::from(r.status().status_code()) == 429)
            .count() as u64;
        if throttled > 0 {
            self.throttled.fetch_add(throttled, Ordering::Relaxed);
        }
    }

    /// Requests the service answered with 429 (the SDK retried them).
    pub fn throttled(&self) -> u64 {
        self.throttled.load(Ordering::Relaxed)
    }

    /// The counters now.
    pub fn snapshot(&self) -> ChargeSnapshot {
        let map = self.by_operation.lock().unwrap_or_else(|p| p.into_inner());
        ChargeSnapshot {
            by_operation: map.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_by_operation_and_diffs_snapshots() {
        let charges = RequestCharges::default();
        charges.record("claim", Some(6.5));
        let before = charges.snapshot();
        charges.record("claim", Some(6.5));
        charges.record("complete", Some(10.0));
        charges.record("complete", None);
        let now = charges.snapshot();
        assert_eq!(now.total_calls(), 4);
        assert!((now.total_request_units() - 23.0).abs() < 1e-9);
        let delta = now.since(&before);
        assert_eq!(delta.by_operation["claim"].calls, 1);
        assert_eq!(delta.by_operation["complete"].calls, 2);
        assert!((delta.total_request_units() - 16.5).abs() < 1e-9);
    }
}
