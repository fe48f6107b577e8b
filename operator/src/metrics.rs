//! The operator's Prometheus metrics. Labels stay bounded: resource kinds, error kinds, and one
//! series per consumer group (removed when the group is deleted).

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use cosmosq_queue::metric_names;
use prometheus::core::{Collector, Desc, Describer};
use prometheus::proto::{Gauge, LabelPair, Metric, MetricFamily, MetricType};
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
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
    /// Each group's backlog, lag, oldest age and desired workers.
    pub groups: GroupGauges,
    /// Rounds whose estimate failed.
    pub estimate_errors: IntCounterVec,
    /// Replica changes applied, by direction.
    pub scale_events: IntCounterVec,
    /// How long a scaling round took.
    pub scaling_round: Histogram,
    /// 1 while this replica leads.
    pub leader: IntGauge,
    /// Wakes run: a producer's word that a queue has new messages, its groups at zero looked
    /// at before the next round (folded: at most one a second per queue).
    pub wakes: IntCounter,
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
        let groups = GroupGauges::default();
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
        let wakes = IntCounter::new(
            "cosmosq_operator_wakes_total",
            "Wakes run: a queue's groups at zero looked at before the next round because a producer said it wrote to the queue",
        )
        .expect("valid metric");
        let mut metrics = Self {
            collectors: Vec::new(),
            names: Vec::new(),
            reconciles,
            reconcile_errors,
            reconcile_duration,
            groups,
            estimate_errors,
            scale_events,
            scaling_round,
            leader,
            wakes,
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
            Box::new(self.estimate_errors.clone()),
            Box::new(self.scale_events.clone()),
            Box::new(self.scaling_round.clone()),
            Box::new(self.leader.clone()),
            Box::new(self.wakes.clone()),
        ];
        every.extend(self.groups.families());
        #[cfg(target_os = "linux")]
        every.push(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ));
        every
    }

    /// Forgets a deleted group's series.
    pub fn remove_group(&self, labels: &[&str; 3]) {
        self.groups.remove(labels);
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

/// A group's gauges as its last round set them.
#[derive(Clone, Copy, Debug, Default)]
struct GroupSeries {
    /// Backlog, lag and oldest age, from the last estimate that succeeded (kept while one
    /// fails: a gauge holds its last value).
    estimated: Option<[i64; 3]>,
    desired_replicas: i64,
}

/// The per-group gauges, one small record per group rendered at scrape time. A
/// `prometheus` gauge vector keeps for every series its own copy of the family's
/// description and label pairs: four families over 5,000 groups held ≈ 13 MB that way.
#[derive(Clone, Default)]
pub struct GroupGauges(Arc<RwLock<BTreeMap<[String; 3], GroupSeries>>>);

/// Which of a group's figures a family shows.
type Figure = fn(&GroupSeries) -> Option<i64>;

impl GroupGauges {
    /// A round's estimate of the group (labels: namespace, queue, group).
    pub fn estimated(&self, labels: &[&str; 3], backlog: i64, lag: i64, oldest_age: i64) {
        self.update(labels, |s| s.estimated = Some([backlog, lag, oldest_age]));
    }

    /// The workers the round's decision wants.
    pub fn desired(&self, labels: &[&str; 3], replicas: i64) {
        self.update(labels, |s| s.desired_replicas = replicas);
    }

    /// Forgets a group.
    pub fn remove(&self, labels: &[&str; 3]) {
        self.0
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&labels.map(str::to_owned));
    }

    fn update(&self, labels: &[&str; 3], change: impl FnOnce(&mut GroupSeries)) {
        let mut series = self.0.write().unwrap_or_else(|e| e.into_inner());
        change(series.entry(labels.map(str::to_owned)).or_default());
    }

    /// One collector per family, each rendering only its own.
    fn families(&self) -> Vec<Box<dyn Collector>> {
        let family = |name: &str, help: &str, figure: Figure| -> Box<dyn Collector> {
            let desc = Opts::new(name, help)
                .const_label(metric_names::SCOPE, metric_names::SCOPE_GROUP)
                .variable_labels(GROUP_LABELS.iter().map(|l| l.to_string()).collect())
                .describe()
                .expect("valid metric");
            Box::new(GroupFamily {
                desc,
                figure,
                series: Arc::clone(&self.0),
            })
        };
        vec![
            family(
                metric_names::BACKLOG,
                "Messages the group has not settled yet",
                |s| s.estimated.map(|e| e[0]),
            ),
            family(
                metric_names::LAG,
                "Messages the group has not read yet",
                |s| s.estimated.map(|e| e[1]),
            ),
            family(
                metric_names::OLDEST_MESSAGE_AGE,
                "Age of the oldest message the group has not settled",
                |s| s.estimated.map(|e| e[2]),
            ),
            family(
                metric_names::DESIRED_REPLICAS,
                "Workers the scaling decision wants",
                |s| Some(s.desired_replicas),
            ),
        ]
    }
}

/// One gauge family over every group.
struct GroupFamily {
    desc: Desc,
    figure: Figure,
    series: Arc<RwLock<BTreeMap<[String; 3], GroupSeries>>>,
}

impl Collector for GroupFamily {
    fn desc(&self) -> Vec<&Desc> {
        vec![&self.desc]
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let pair = |name: &str, value: &str| {
            let mut pair = LabelPair::default();
            pair.set_name(name.to_owned());
            pair.set_value(value.to_owned());
            pair
        };
        let series = self.series.read().unwrap_or_else(|e| e.into_inner());
        let metrics = series
            .iter()
            .filter_map(|(labels, s)| {
                let value = (self.figure)(s)?;
                let mut gauge = Gauge::default();
                gauge.set_value(value as f64);
                let mut metric = Metric::from_gauge(gauge);
                let mut pairs: Vec<LabelPair> = GROUP_LABELS
                    .iter()
                    .zip(labels)
                    .map(|(name, value)| pair(name, value))
                    .chain(
                        self.desc
                            .const_label_pairs
                            .iter()
                            .map(|p| pair(p.name(), p.value())),
                    )
                    .collect();
                pairs.sort_by(|a, b| a.name().cmp(b.name()));
                metric.set_label(pairs);
                Some(metric)
            })
            .collect();
        let mut family = MetricFamily::default();
        family.set_name(self.desc.fq_name.clone());
        family.set_help(self.desc.help.clone());
        family.set_field_type(MetricType::GAUGE);
        family.set_metric(metrics);
        vec![family]
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
            metrics.groups.estimated(&labels, backlog, backlog / 2, 3);
            metrics.groups.desired(&labels, 1);
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

    /// The group gauges scrape as the `prometheus` gauge vectors they replaced did: the same
    /// families, labels and values, a value kept through a failed estimate, a group gone
    /// once removed.
    #[test]
    fn group_gauges_scrape_as_gauge_vectors_did() {
        let metrics = OperatorMetrics::new();
        let registry = Registry::new();
        let vector = |name: &str, help: &str| {
            let v = prometheus::IntGaugeVec::new(
                Opts::new(name, help).const_label(metric_names::SCOPE, metric_names::SCOPE_GROUP),
                GROUP_LABELS,
            )
            .unwrap();
            registry.register(Box::new(v.clone())).unwrap();
            v
        };
        let backlog = vector(
            metric_names::BACKLOG,
            "Messages the group has not settled yet",
        );
        let lag = vector(metric_names::LAG, "Messages the group has not read yet");
        let oldest = vector(
            metric_names::OLDEST_MESSAGE_AGE,
            "Age of the oldest message the group has not settled",
        );
        let desired = vector(
            metric_names::DESIRED_REPLICAS,
            "Workers the scaling decision wants",
        );
        // Rounds: an estimate, a failed one (only the desired workers change), a group that
        // never had an estimate, and a group removed.
        let rounds: [(&str, &str, Option<[i64; 3]>, i64); 6] = [
            ("shop", "billing", Some([250, 40, 12]), 3),
            ("shop", "audit", Some([0, 0, 0]), 0),
            ("bank", "ledger", Some([9, 9, 1]), 1),
            ("shop", "billing", None, 2),
            ("shop", "fresh", None, 1),
            ("bank", "ledger", Some([5, 0, 2]), 1),
        ];
        for (namespace, group, estimated, replicas) in rounds {
            let labels = [namespace, "orders", group];
            if let Some([b, l, o]) = estimated {
                metrics.groups.estimated(&labels, b, l, o);
                backlog.with_label_values(&labels).set(b);
                lag.with_label_values(&labels).set(l);
                oldest.with_label_values(&labels).set(o);
            }
            metrics.groups.desired(&labels, replicas);
            desired.with_label_values(&labels).set(replicas);
        }
        let gone = ["shop", "orders", "audit"];
        metrics.remove_group(&gone);
        for v in [&backlog, &lag, &oldest, &desired] {
            v.remove_label_values(&gone).unwrap();
        }
        let mut gathered = Vec::new();
        TextEncoder::new()
            .encode(&registry.gather(), &mut gathered)
            .unwrap();
        let gathered = String::from_utf8(gathered).unwrap();
        let rendered = metrics.render();
        let families = [
            metric_names::BACKLOG,
            metric_names::LAG,
            metric_names::OLDEST_MESSAGE_AGE,
            metric_names::DESIRED_REPLICAS,
        ];
        let of_groups = |text: &str| {
            text.lines()
                .filter(|l| families.iter().any(|f| l.contains(f)))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        };
        assert_eq!(of_groups(&rendered), of_groups(&gathered));
        assert!(
            rendered.contains(r#"cosmosq_backlog_messages{group="billing",namespace="shop",queue="orders",scope="group"} 250"#),
            "{rendered}"
        );
        assert!(!rendered.contains(r#"group="audit""#), "{rendered}");
        assert!(
            !rendered.contains(r#"cosmosq_backlog_messages{group="fresh""#),
            "{rendered}"
        );
    }
}
