//! The operator's Prometheus metrics. Labels stay bounded: resource kinds, error kinds, and one
//! series per consumer group (removed when the group is deleted).

use cosmosq_queue::metric_names;
use prometheus::core::Collector;
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

const GROUP_LABELS: &[&str] = &["namespace", "queue", "group"];

/// The operator's Prometheus metrics (group figures named in [`cosmosq_queue::metric_names`]).
pub struct OperatorMetrics {
    /// Every metric, rendered one family at a time: at 5,000 groups, gathering every family
    /// before encoding any held 13.5 MB for a scrape.
    collectors: Vec<Box<dyn Collector>>,
    /// The names of the families registered, for [`OperatorMetrics::names`].
    names: Vec<String>,
    /// Reconciles, by kind.
    pub reconciles: IntCounterVec,
    /// Failed reconciles, by kind and error.
    pub reconcile_errors: IntCounterVec,
    /// How long reconciles took.
    pub reconcile_duration: HistogramVec,
    /// A group's unsettled messages.
    pub backlog: IntGaugeVec,
    /// A group's unread messages.
    pub lag: IntGaugeVec,
    /// A group's oldest unsettled message's age.
    pub oldest_age: IntGaugeVec,
    /// A group's desired workers.
    pub desired_replicas: IntGaugeVec,
    /// Rounds whose estimate failed.
    pub estimate_errors: IntCounterVec,
    /// Replica changes applied, by direction.
    pub scale_events: IntCounterVec,
    /// How long a scaling round took.
    pub scaling_round: Histogram,
    /// 1 while this replica leads.
    pub leader: IntGauge,
}

impl OperatorMetrics {
    /// Every metric, registered.
    pub fn new() -> Self {
        // Checks the families' names and labels, once.
        let registry = Registry::new();
        let reconciles = IntCounterVec::new(
            Opts::new(
                "cosmosq_operator_reconciles_total",
                "Reconciles, by resource kind",
            ),
            &["kind"],
        )
        .expect("valid metric");
        let reconcile_errors = IntCounterVec::new(
            Opts::new(
                "cosmosq_operator_reconcile_errors_total",
                "Failed reconciles, by resource kind and error kind",
            ),
            &["kind", "error"],
        )
        .expect("valid metric");
        let reconcile_duration = HistogramVec::new(
            HistogramOpts::new(
                "cosmosq_operator_reconcile_duration_seconds",
                "Time one reconcile took",
            )
            .buckets(vec![
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ]),
            &["kind"],
        )
        .expect("valid metric");
        let backlog = IntGaugeVec::new(
            Opts::new(
                metric_names::BACKLOG,
                "Messages the group has not settled yet",
            )
            .const_label(metric_names::SCOPE, metric_names::SCOPE_GROUP),
            GROUP_LABELS,
        )
        .expect("valid metric");
        let lag = IntGaugeVec::new(
            Opts::new(metric_names::LAG, "Messages the group has not read yet")
                .const_label(metric_names::SCOPE, metric_names::SCOPE_GROUP),
            GROUP_LABELS,
        )
        .expect("valid metric");
        let oldest_age = IntGaugeVec::new(
            Opts::new(
                metric_names::OLDEST_MESSAGE_AGE,
                "Age of the oldest message the group has not settled",
            )
            .const_label(metric_names::SCOPE, metric_names::SCOPE_GROUP),
            GROUP_LABELS,
        )
        .expect("valid metric");
        let desired_replicas = IntGaugeVec::new(
            Opts::new(
                metric_names::DESIRED_REPLICAS,
                "Workers the scaling decision wants",
            )
            .const_label(metric_names::SCOPE, metric_names::SCOPE_GROUP),
            GROUP_LABELS,
        )
        .expect("valid metric");
        let estimate_errors = IntCounterVec::new(
            Opts::new(
                "cosmosq_operator_estimate_errors_total",
                "Rounds in which a group's estimate failed (replicas were kept)",
            ),
            GROUP_LABELS,
        )
        .expect("valid metric");
        let scale_events = IntCounterVec::new(
            Opts::new(
                "cosmosq_operator_scale_total",
                "Replica changes the operator applied, by direction",
            ),
            &["namespace", "queue", "group", "direction"],
        )
        .expect("valid metric");
        let scaling_round = Histogram::with_opts(
            HistogramOpts::new(
                "cosmosq_operator_scaling_round_seconds",
                "Time one scaling round over every group took",
            )
            .buckets(vec![0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]),
        )
        .expect("valid metric");
        let leader = IntGauge::new(
            "cosmosq_operator_leader",
            "1 while this replica holds the leader lease",
        )
        .expect("valid metric");
        let mut metrics = Self {
            collectors: Vec::new(),
            names: Vec::new(),
            reconciles,
            reconcile_errors,
            reconcile_duration,
            backlog,
            lag,
            oldest_age,
            desired_replicas,
            estimate_errors,
            scale_events,
            scaling_round,
            leader,
        };
        for collector in metrics.every() {
            metrics
                .names
                .extend(collector.desc().iter().map(|d| d.fq_name.clone()));
            registry.register(collector).expect("unique metric");
        }
        metrics.collectors = metrics.every();
        metrics
            .collectors
            .sort_by_key(|c| c.desc().first().map(|d| d.fq_name.clone()));
        metrics
    }

    /// Every metric this process exports, boxed (handles to the same series).
    fn every(&self) -> Vec<Box<dyn Collector>> {
        let mut every: Vec<Box<dyn Collector>> = vec![
            Box::new(self.reconciles.clone()),
            Box::new(self.reconcile_errors.clone()),
            Box::new(self.reconcile_duration.clone()),
            Box::new(self.backlog.clone()),
            Box::new(self.lag.clone()),
            Box::new(self.oldest_age.clone()),
            Box::new(self.desired_replicas.clone()),
            Box::new(self.estimate_errors.clone()),
            Box::new(self.scale_events.clone()),
            Box::new(self.scaling_round.clone()),
            Box::new(self.leader.clone()),
        ];
        #[cfg(target_os = "linux")]
        every.push(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ));
        every
    }

    /// Forgets a deleted group's series.
    pub fn remove_group(&self, labels: &[&str; 3]) {
        for gauge in [
            &self.backlog,
            &self.lag,
            &self.oldest_age,
            &self.desired_replicas,
        ] {
            let _ = gauge.remove_label_values(labels);
        }
        let _ = self.estimate_errors.remove_label_values(labels);
    }

    /// The metric families this process exports (the dashboard's queries are checked
    /// against them).
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut buffer = Vec::new();
        let encoder = TextEncoder::new();
        // As `Registry::gather` has them: no empty family, families by name, series by
        // their labels' values.
        let by_values = |a: &prometheus::proto::Metric, b: &prometheus::proto::Metric| {
            a.get_label()
                .iter()
                .map(|l| l.value())
                .cmp(b.get_label().iter().map(|l| l.value()))
        };
        for collector in &self.collectors {
            let mut families = collector.collect();
            families.retain(|family| !family.get_metric().is_empty());
            families.sort_by(|a, b| a.name().cmp(b.name()));
            for family in &mut families {
                family.mut_metric().sort_by(by_values);
            }
            encoder
                .encode(&families, &mut buffer)
                .expect("metrics encode");
        }
        String::from_utf8(buffer).expect("metrics are UTF-8")
    }
}

impl Default for OperatorMetrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scrape_renders_what_a_registry_gathers_one_family_at_a_time() {
        let metrics = OperatorMetrics::new();
        for (group, backlog) in [("orders", 7), ("audit", 0), ("billing", 120)] {
            let labels = ["shop", "q", group];
            metrics.backlog.with_label_values(&labels).set(backlog);
            metrics.lag.with_label_values(&labels).set(backlog / 2);
            metrics.desired_replicas.with_label_values(&labels).set(1);
        }
        metrics.reconciles.with_label_values(&["group"]).inc();
        metrics
            .scale_events
            .with_label_values(&["shop", "q", "orders", "up"])
            .inc();
        metrics.scaling_round.observe(0.3);
        metrics.leader.set(1);
        let registry = Registry::new();
        for collector in metrics.every() {
            registry.register(collector).unwrap();
        }
        let mut gathered = Vec::new();
        TextEncoder::new()
            .encode(&registry.gather(), &mut gathered)
            .unwrap();
        // The process' own figures move between two reads.
        let ours = |text: &str| {
            text.lines()
                .filter(|l| !l.contains("process_"))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        };
        let rendered = metrics.render();
        assert_eq!(ours(&rendered), ours(&String::from_utf8(gathered).unwrap()));
        assert!(rendered.contains("cosmosq_operator_leader 1"), "{rendered}");
        #[cfg(target_os = "linux")]
        assert!(
            rendered.contains("process_resident_memory_bytes"),
            "{rendered}"
        );
    }
}
