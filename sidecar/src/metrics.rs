//! Prometheus metrics. Labels are bounded: queue and group (constant), outcome, operation,
//! event and range (the group's feed ranges) — never message ids.

use std::collections::HashMap;
use std::sync::Mutex;

use cosmosq_queue::estimate::GroupEstimate;
use cosmosq_queue::metric_names;
use cosmosq_queue::{ConsumerStats, RequestCharges};
use prometheus::{
    histogram_opts, opts, CounterVec, Encoder, Histogram, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Registry, TextEncoder,
};

/// The sidecar's Prometheus metrics (names in [`cosmosq_queue::metric_names`] where the operator reports the same figure).
pub struct SidecarMetrics {
    registry: Registry,
    /// The names of the families registered, for [`SidecarMetrics::names`].
    names: Vec<String>,
    /// Settled deliveries, by outcome.
    pub deliveries: IntCounterVec,
    /// How long the app took.
    pub app_latency: Histogram,
    /// From enqueue to the app's answer.
    pub end_to_end: Histogram,
    /// Deliveries the app is working on.
    pub in_flight: IntGauge,
    /// Leases held.
    pub leases_owned: IntGauge,
    /// Leases acquired and lost.
    pub lease_events: IntCounterVec,
    /// Unread messages per owned range.
    pub lag: IntGaugeVec,
    /// Unsettled messages of the owned ranges.
    pub backlog: IntGauge,
    /// The group's dead letters (from the owner of its first range).
    pub dead_letters: IntGauge,
    /// Request units by operation.
    pub request_units: CounterVec,
    /// Requests answered 429.
    pub throttled: IntCounter,
    /// Messages enqueued through the local API, by result.
    pub enqueued: IntCounterVec,
    /// Deliveries the app could not take, by kind.
    pub app_errors: IntCounterVec,
    request_units_seen: Mutex<HashMap<&'static str, f64>>,
    owned_ranges: Mutex<Vec<String>>,
}

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

impl SidecarMetrics {
    /// `n` messages the local API refused to enqueue.
    pub fn rejected(&self, n: usize) {
        self.enqueued
            .with_label_values(&["rejected"])
            .inc_by(n as u64);
    }

    /// Metrics of a sidecar of `group` on `queue` (both constant labels).
    pub fn new(queue: &str, group: &str) -> Self {
        let registry = Registry::new_custom(
            None,
            Some(HashMap::from([
                ("queue".to_string(), queue.to_string()),
                ("group".to_string(), group.to_string()),
                (
                    metric_names::SCOPE.to_string(),
                    metric_names::SCOPE_POD.to_string(),
                ),
            ])),
        )
        .expect("valid registry");
        let mut names = Vec::new();
        macro_rules! register {
            ($metric:expr) => {{
                let m = $metric.expect("valid metric");
                names.extend(
                    prometheus::core::Collector::desc(&m)
                        .iter()
                        .map(|d| d.fq_name.clone()),
                );
                registry
                    .register(Box::new(m.clone()))
                    .expect("metric registered once");
                m
            }};
        }
        let mut metrics = Self {
            deliveries: register!(IntCounterVec::new(opts!("cosmosq_deliveries_total", "Deliveries to the app by outcome once settled (completed, retried, dead_lettered, lock_lost, failed)."), &["outcome"])),
            app_latency: register!(Histogram::with_opts(histogram_opts!("cosmosq_app_request_duration_seconds", "Time the app took to answer one delivery.", LATENCY_BUCKETS.to_vec()))),
            end_to_end: register!(Histogram::with_opts(histogram_opts!("cosmosq_end_to_end_latency_seconds", "Time from enqueue to the app's answer.", LATENCY_BUCKETS.to_vec()))),
            in_flight: register!(IntGauge::new("cosmosq_in_flight", "Deliveries the app is working on.")),
            leases_owned: register!(IntGauge::new("cosmosq_leases_owned", "Feed-range leases this sidecar holds.")),
            lease_events: register!(IntCounterVec::new(opts!("cosmosq_lease_events_total", "Leases acquired and lost."), &["event"])),
            lag: register!(IntGaugeVec::new(opts!(metric_names::LAG, "Messages not yet read, per feed range this sidecar owns."), &["range"])),
            backlog: register!(IntGauge::new(metric_names::BACKLOG, "Messages not yet settled in the ranges this pod owns.")),
            dead_letters: register!(IntGauge::new(metric_names::DEAD_LETTERS, "Messages in the group's dead letters.")),
            request_units: register!(CounterVec::new(opts!("cosmosq_request_units_total", "Cosmos DB request units spent, by operation."), &["operation"])),
            throttled: register!(IntCounter::new("cosmosq_throttled_requests_total", "Cosmos DB requests answered 429 (retried by the SDK).")),
            enqueued: register!(IntCounterVec::new(opts!("cosmosq_enqueued_total", "Messages enqueued through the local API, by result."), &["result"])),
            app_errors: register!(IntCounterVec::new(opts!("cosmosq_app_errors_total", "Deliveries the app could not take, by kind (timeout, connect, status)."), &["kind"])),
            request_units_seen: Mutex::default(),
            owned_ranges: Mutex::default(),
            registry,
            names: Vec::new(),
        };
        metrics.names = names;
        #[cfg(target_os = "linux")]
        {
            let process = prometheus::process_collector::ProcessCollector::for_self();
            let _ = metrics.registry.register(Box::new(process));
        }
        metrics
    }

    /// Brings counters kept by the engine into the registry (called before each scrape).
    pub fn sync(&self, stats: &ConsumerStats, charges: &RequestCharges) {
        let read = ConsumerStats::get;
        for (outcome, value) in [
            ("completed", read(&stats.completed)),
            ("retried", read(&stats.retried)),
            ("dead_lettered", read(&stats.dead_lettered)),
            ("lock_lost", read(&stats.lock_lost)),
            ("failed", read(&stats.errors)),
        ] {
            advance(&self.deliveries.with_label_values(&[outcome]), value);
        }
        advance(
            &self.lease_events.with_label_values(&["acquired"]),
            read(&stats.leases_acquired),
        );
        advance(
            &self.lease_events.with_label_values(&["lost"]),
            read(&stats.leases_lost),
        );
        self.leases_owned.set(read(&stats.leases_owned) as i64);
        advance(&self.throttled, charges.throttled());
        let mut seen = self
            .request_units_seen
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        for (operation, charge) in charges.snapshot().by_operation {
            let before = seen.insert(operation, charge.request_units).unwrap_or(0.0);
            let delta = charge.request_units - before;
            if delta > 0.0 {
                self.request_units
                    .with_label_values(&[operation])
                    .inc_by(delta);
            }
        }
    }

    /// Publishes an estimate: lag of the ranges `owner` owns, and their backlog.
    pub fn record_estimate(&self, estimate: &GroupEstimate, owner: &str) {
        let mut owned = self.owned_ranges.lock().unwrap_or_else(|p| p.into_inner());
        for label in owned.drain(..) {
            let _ = self.lag.remove_label_values(&[&label]);
        }
        for range in estimate
            .ranges
            .iter()
            .filter(|r| r.owner.as_deref() == Some(owner))
        {
            let label = format!("{}-{}", short(&range.min_epk), short(&range.max_epk));
            if let Some(lag) = range.lag {
                self.lag.with_label_values(&[&label]).set(lag as i64);
                owned.push(label);
            }
        }
        self.backlog.set(estimate.backlog() as i64);
    }

    /// The metric families this sidecar exports (the dashboard's queries are checked against
    /// them).
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

fn short(hex: &str) -> &str {
    if hex.is_empty() {
        "00"
    } else {
        &hex[..hex.len().min(8)]
    }
}

/// Moves a counter up to `value` (the engine's counters only grow).
fn advance(counter: &IntCounter, value: u64) {
    let current = counter.get();
    if value > current {
        counter.inc_by(value - current);
    }
}
