//! How many workers a consumer group should run: a pure function of the remaining work, the
//! observed processing rate, the policy and what was decided before.
//!
//! - Target replicas = the most of `ceil(backlog / targetBacklogPerReplica)` and, when rates are
//!   known, `ceil(arrival rate / rate one replica sustains)`; clamped to `[min, max]` and capped
//!   by the number of leases (a replica without a lease has nothing to read).
//! - Scale up at once; scale down only to the highest recommendation seen during the
//!   stabilization window (the HPA's behaviour), so a dip does not flap the group.
//! - From zero, only when the backlog reaches the activation threshold; to zero, only after the
//!   backlog has been empty for the cool-down.
//! - When the estimate failed, keep the current replicas: never scale down, let alone to zero,
//!   on an error (what KEDA users complain about).

use std::collections::VecDeque;

use cosmosq_queue::estimate::GroupEstimate;

/// A group's scaling settings.
#[derive(Clone, Debug, PartialEq)]
pub struct Policy {
    /// Fewest workers (0: scale to zero when idle).
    pub min_replicas: u32,
    /// Most workers.
    pub max_replicas: u32,
    /// Backlog one worker is expected to carry.
    pub target_backlog_per_replica: u64,
    /// Scale down only to the highest recommendation within this window.
    pub scale_down_stabilization_ms: i64,
    /// Idle time before scaling to zero.
    pub scale_to_zero_cooldown_ms: i64,
    /// Backlog that wakes a group scaled to zero.
    pub activation_threshold: u64,
}

/// What the operator saw this round.
#[derive(Clone, Debug, PartialEq)]
pub struct Observation {
    /// When (epoch ms).
    pub now_ms: i64,
    /// `None` when the estimate failed.
    pub backlog: Option<u64>,
    /// Messages arriving per second, and settled per second per replica, when measured.
    pub arrival_rate: Option<f64>,
    /// Messages one worker settles per second, when measured.
    pub rate_per_replica: Option<f64>,
    /// The group's leases: more workers than leases would idle.
    pub leases: u32,
    /// Workers now.
    pub current_replicas: u32,
}

/// What the decision remembers between rounds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct History {
    /// Recent recommendations (time, replicas), for the stabilization window.
    recommendations: VecDeque<(i64, u32)>,
    /// The last time the backlog was not empty.
    last_active_ms: Option<i64>,
}

/// Why a decision is what it is (for status, Events and logs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The estimate failed: replicas kept as they are.
    EstimateFailed,
    /// More backlog than the workers carry.
    ScaleUp,
    /// Less backlog, past the stabilization window.
    ScaleDown,
    /// A lower count is recommended but the stabilization window holds the higher one.
    Stabilizing,
    /// Woken from zero by a backlog at the activation threshold.
    Activated,
    /// Idle for the cool-down: scaled to zero.
    ScaledToZero,
    /// Idle, waiting out the cool-down before scaling to zero.
    CoolingDown,
    /// Nothing to change.
    Steady,
}

/// The replicas a group should run, and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Workers to run.
    pub replicas: u32,
    /// Why.
    pub reason: Reason,
}

impl Reason {
    /// For status and Events.
    pub fn describe(self, d: &Decision, backlog: Option<u64>) -> String {
        let backlog = backlog.map_or("unknown".to_owned(), |b| b.to_string());
        match self {
            Reason::EstimateFailed => format!("estimate failed; keeping {} replicas", d.replicas),
            Reason::ScaleUp => format!("backlog {backlog}: scaling up to {}", d.replicas),
            Reason::ScaleDown => format!("backlog {backlog}: scaling down to {}", d.replicas),
            Reason::Stabilizing => format!(
                "backlog {backlog}: holding {} during the stabilization window",
                d.replicas
            ),
            Reason::Activated => format!(
                "backlog {backlog} reached the activation threshold: starting {}",
                d.replicas
            ),
            Reason::ScaledToZero => "idle for the cool-down: scaled to zero".to_owned(),
            Reason::CoolingDown => format!("idle: keeping {} until the cool-down ends", d.replicas),
            Reason::Steady => format!("backlog {backlog}: {} replicas", d.replicas),
        }
    }
}

/// One round's estimate, kept to measure rates against the next.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    /// When (epoch ms).
    pub at_ms: i64,
    /// Sum of the ranges' LSNs: messages are append-only, so it grows by one per enqueue.
    pub lsn: Option<u64>,
    /// The backlog then.
    pub backlog: u64,
    /// Workers then.
    pub replicas: u32,
}

/// Arrival rate and the rate one replica settles, between two rounds.
///
/// What replicas settle only measures their capacity when they had work the whole time (a
/// backlog at both ends); otherwise they were waiting for messages and the rate would merely
/// echo the arrivals, pinning the group at its current size. Then it is `None` and the
/// backlog alone decides.
pub fn rates(prev: &Sample, now: &Sample) -> (Option<f64>, Option<f64>) {
    let secs = (now.at_ms - prev.at_ms) as f64 / 1000.0;
    if secs <= 0.0 {
        return (None, None);
    }
    let arrival = match (prev.lsn, now.lsn) {
        (Some(a), Some(b)) if b >= a => Some((b - a) as f64 / secs),
        _ => None,
    };
    let replicas = prev.replicas.min(now.replicas);
    let saturated = prev.backlog > 0 && now.backlog > 0 && replicas > 0;
    let per_replica = arrival.filter(|_| saturated).and_then(|arrival| {
        let settled = arrival * secs + prev.backlog as f64 - now.backlog as f64;
        (settled > 0.0).then(|| settled / secs / f64::from(replicas))
    });
    (arrival, per_replica)
}

/// One group's scaling across rounds: what [`decide`] remembers and the previous sample the
/// rates are measured against. The operator keeps one per QueueConsumerGroup; `cosmosq demo`
/// one per group it runs.
#[derive(Clone, Debug, Default)]
pub struct Autoscaler {
    history: History,
    last_sample: Option<Sample>,
}

impl Autoscaler {
    /// One round: measures rates against the previous estimate and decides. `estimate` is
    /// `None` when it failed (replicas are kept).
    pub fn round(
        &mut self,
        policy: &Policy,
        now_ms: i64,
        estimate: Option<&GroupEstimate>,
        current_replicas: u32,
    ) -> (Observation, Decision) {
        let sample = estimate.map(|e| Sample {
            at_ms: now_ms,
            lsn: e.lsn(),
            backlog: e.backlog(),
            replicas: current_replicas,
        });
        let (arrival_rate, rate_per_replica) = match (&self.last_sample, &sample) {
            (Some(prev), Some(next)) => rates(prev, next),
            _ => (None, None),
        };
        if sample.is_some() {
            self.last_sample = sample;
        }
        let observation = Observation {
            now_ms,
            backlog: estimate.map(GroupEstimate::backlog),
            arrival_rate,
            rate_per_replica,
            leases: estimate.map_or(0, |e| e.ranges.len() as u32),
            current_replicas,
        };
        let decision = decide(policy, &observation, &mut self.history);
        (observation, decision)
    }
}

fn div_ceil_f(a: f64, b: f64) -> u32 {
    if b <= 0.0 || !a.is_finite() {
        return 0;
    }
    (a / b).ceil().clamp(0.0, u32::MAX as f64) as u32
}

/// The replicas a group should run now (pure): from its backlog and rates, clamped, stabilized.
pub fn decide(policy: &Policy, obs: &Observation, history: &mut History) -> Decision {
    let current = obs.current_replicas;
    let Some(backlog) = obs.backlog else {
        return Decision {
            replicas: current,
            reason: Reason::EstimateFailed,
        };
    };
    // An operator that just started (a restart, a new leader) knows nothing of the past: the
    // replicas it finds count as a recommendation made now, so the stabilization window
    // starts over instead of being skipped (the HPA controller does the same), and idle time
    // counts from now, so a restart never scales a group to zero at once.
    if history.last_active_ms.is_none() && current > 0 && policy.scale_down_stabilization_ms > 0 {
        history.recommendations.push_back((obs.now_ms, current));
    }
    let last_active = history.last_active_ms.get_or_insert(obs.now_ms);
    if backlog > 0 {
        *last_active = obs.now_ms;
    }
    let idle_for = obs.now_ms.saturating_sub(*last_active);
    let by_backlog = backlog
        .div_ceil(policy.target_backlog_per_replica.max(1))
        .min(u32::MAX as u64) as u32;
    let by_rate = match (obs.arrival_rate, obs.rate_per_replica) {
        (Some(arrival), Some(per_replica)) => div_ceil_f(arrival, per_replica),
        _ => 0,
    };
    let cap = obs.leases.max(policy.min_replicas).max(1);
    let mut target = by_backlog
        .max(by_rate)
        .clamp(
            policy.min_replicas,
            policy.max_replicas.max(policy.min_replicas),
        )
        .min(cap);

    // From zero: only a backlog at the activation threshold wakes the group.
    if current == 0 {
        if backlog >= policy.activation_threshold && target == 0 {
            target = 1;
        }
        if backlog < policy.activation_threshold {
            target = policy.min_replicas;
        }
        if target > 0 {
            history.recommendations.clear();
            history.recommendations.push_back((obs.now_ms, target));
            return Decision {
                replicas: target,
                reason: Reason::Activated,
            };
        }
        return Decision {
            replicas: 0,
            reason: Reason::Steady,
        };
    }

    // To zero: only after the cool-down with nothing to do; until then one replica stays.
    let cooling = target == 0;
    if cooling {
        if idle_for >= policy.scale_to_zero_cooldown_ms {
            history.recommendations.clear();
            return Decision {
                replicas: 0,
                reason: Reason::ScaledToZero,
            };
        }
        target = 1;
    }

    // Stabilization: scale down only to the highest recommendation within the window.
    history.recommendations.push_back((obs.now_ms, target));
    let window_start = obs.now_ms - policy.scale_down_stabilization_ms;
    while history
        .recommendations
        .front()
        .is_some_and(|(t, _)| *t < window_start)
    {
        history.recommendations.pop_front();
    }
    let stable = history
        .recommendations
        .iter()
        .map(|(_, r)| *r)
        .max()
        .unwrap_or(target);
    match target.cmp(&current) {
        std::cmp::Ordering::Greater => Decision {
            replicas: target,
            reason: Reason::ScaleUp,
        },
        std::cmp::Ordering::Less if stable < current => Decision {
            replicas: stable,
            reason: Reason::ScaleDown,
        },
        std::cmp::Ordering::Less => Decision {
            replicas: current,
            reason: Reason::Stabilizing,
        },
        std::cmp::Ordering::Equal if cooling => Decision {
            replicas: current,
            reason: Reason::CoolingDown,
        },
        std::cmp::Ordering::Equal => Decision {
            replicas: current,
            reason: Reason::Steady,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restarted_operator_waits_a_full_window_before_scaling_down() {
        let policy = policy();
        let mut history = History::default();
        let at = |now_ms| Observation {
            now_ms,
            backlog: Some(0),
            arrival_rate: None,
            rate_per_replica: None,
            leases: 16,
            current_replicas: 8,
        };
        // The first round after a restart finds 8 replicas and nothing to do.
        let first = decide(&policy, &at(1_000), &mut history);
        assert_eq!((first.replicas, first.reason), (8, Reason::Stabilizing));
        let within = decide(&policy, &at(1_000 + 299_000), &mut history);
        assert_eq!(within.replicas, 8, "still inside the window");
        let after = decide(&policy, &at(1_000 + 301_000), &mut history);
        assert_eq!((after.replicas, after.reason), (1, Reason::ScaleDown));
    }

    fn policy() -> Policy {
        Policy {
            min_replicas: 0,
            max_replicas: 10,
            target_backlog_per_replica: 100,
            scale_down_stabilization_ms: 300_000,
            scale_to_zero_cooldown_ms: 600_000,
            activation_threshold: 5,
        }
    }

    fn obs(now_s: i64, backlog: Option<u64>, current: u32) -> Observation {
        Observation {
            now_ms: now_s * 1000,
            backlog,
            arrival_rate: None,
            rate_per_replica: None,
            leases: 8,
            current_replicas: current,
        }
    }

    /// Runs rounds of (time s, backlog, current replicas) → expected (replicas, reason).
    fn run(policy: &Policy, rounds: &[(i64, Option<u64>, u32, u32, Reason)]) {
        let mut history = History::default();
        for (i, &(t, backlog, current, replicas, reason)) in rounds.iter().enumerate() {
            let d = decide(policy, &obs(t, backlog, current), &mut history);
            assert_eq!(
                (d.replicas, d.reason),
                (replicas, reason),
                "round {i} (t={t}s, backlog {backlog:?}, {current} running)"
            );
        }
    }

    #[test]
    fn a_burst_scales_up_at_once_and_drains_down_after_the_window() {
        run(
            &policy(),
            &[
                (0, Some(0), 1, 1, Reason::CoolingDown), // just started: no instant scale to zero
                (10, Some(750), 1, 8, Reason::ScaleUp),  // ceil(750/100) = 8 (= leases)
                (20, Some(5_000), 8, 8, Reason::Steady), // capped by 8 leases, not 10
                (30, Some(250), 8, 8, Reason::Stabilizing), // wants 3; 8 was recommended 10 s ago
                (320, Some(250), 8, 8, Reason::Stabilizing), // 8 still inside the 300 s window (t=20)
                (331, Some(250), 8, 3, Reason::ScaleDown),
                (400, Some(0), 3, 3, Reason::Stabilizing), // idle wants 1; 3 is in the window
                (632, Some(0), 3, 1, Reason::ScaleDown),
                (900, Some(0), 1, 1, Reason::CoolingDown), // last active t=331: 569 s idle
                (932, Some(0), 1, 0, Reason::ScaledToZero), // 601 s idle
            ],
        );
    }

    #[test]
    fn activation_from_zero_needs_the_threshold() {
        run(
            &policy(),
            &[
                (0, Some(0), 0, 0, Reason::Steady),
                (10, Some(4), 0, 0, Reason::Steady), // below the activation threshold
                (20, Some(5), 0, 1, Reason::Activated),
                (30, Some(5), 1, 1, Reason::Steady),
                (40, Some(900), 0, 8, Reason::Activated), // straight to what the backlog needs
            ],
        );
    }

    #[test]
    fn errors_never_scale_down() {
        run(
            &policy(),
            &[
                (0, Some(800), 0, 8, Reason::Activated),
                (10, None, 8, 8, Reason::EstimateFailed),
                (20, None, 8, 8, Reason::EstimateFailed),
                (10_000, None, 8, 8, Reason::EstimateFailed), // however long the outage
                (10_010, None, 0, 0, Reason::EstimateFailed), // and never wakes on a guess either
            ],
        );
    }

    #[test]
    fn min_and_max_bound_everything() {
        let p = Policy {
            min_replicas: 2,
            max_replicas: 4,
            ..policy()
        };
        run(
            &p,
            &[
                (0, Some(0), 2, 2, Reason::Steady),
                (10, Some(100_000), 2, 4, Reason::ScaleUp),
                (400, Some(0), 4, 2, Reason::ScaleDown), // never below min, no scale to zero
                (2_000, Some(0), 2, 2, Reason::Steady),
            ],
        );
    }

    #[test]
    fn observed_rates_scale_for_throughput_as_well_as_backlog() {
        let mut history = History::default();
        let o = Observation {
            arrival_rate: Some(450.0),
            rate_per_replica: Some(100.0),
            ..obs(0, Some(10), 1)
        };
        let d = decide(&policy(), &o, &mut history);
        assert_eq!(
            (d.replicas, d.reason),
            (5, Reason::ScaleUp),
            "450 msg/s at 100 per replica"
        );
    }

    #[test]
    fn flapping_backlog_does_not_flap_replicas() {
        let mut history = History::default();
        let mut replicas = 1;
        let mut changes = 0;
        for step in 0..60 {
            let backlog = if step % 2 == 0 { 600 } else { 50 };
            let d = decide(
                &policy(),
                &obs(step * 10, Some(backlog), replicas),
                &mut history,
            );
            if d.replicas != replicas {
                changes += 1;
            }
            replicas = d.replicas;
        }
        assert_eq!(changes, 1, "up once to 6, then held");
        assert_eq!(replicas, 6);
    }

    #[test]
    fn reasons_read_well() {
        let d = Decision {
            replicas: 3,
            reason: Reason::ScaleDown,
        };
        assert_eq!(
            d.reason.describe(&d, Some(250)),
            "backlog 250: scaling down to 3"
        );
        let d = Decision {
            replicas: 8,
            reason: Reason::EstimateFailed,
        };
        assert_eq!(
            d.reason.describe(&d, None),
            "estimate failed; keeping 8 replicas"
        );
    }

    fn sample(at_s: i64, lsn: u64, backlog: u64, replicas: u32) -> Sample {
        Sample {
            at_ms: at_s * 1000,
            lsn: Some(lsn),
            backlog,
            replicas,
        }
    }

    #[test]
    fn rates_come_from_lsn_growth_and_the_backlog_drained() {
        // 10 s: 1,000 arrived, the backlog fell from 500 to 300, so 1,200 were settled by 4.
        let (arrival, per_replica) = rates(&sample(0, 5_000, 500, 4), &sample(10, 6_000, 300, 4));
        assert_eq!(arrival, Some(100.0));
        assert_eq!(per_replica, Some(30.0));
    }

    #[test]
    fn idle_replicas_say_nothing_about_their_capacity() {
        // Ten replicas keep up with 1 msg/s: their rate is not their capacity, and counting it
        // would pin the group at ten.
        let (arrival, per_replica) = rates(&sample(0, 100, 0, 10), &sample(10, 110, 0, 10));
        assert_eq!(arrival, Some(1.0));
        assert_eq!(per_replica, None);
        // Nor does a group with no replicas, a clock that did not move, or an unknown LSN.
        assert_eq!(
            rates(&sample(0, 100, 50, 0), &sample(10, 200, 80, 0)).1,
            None
        );
        assert_eq!(
            rates(&sample(10, 100, 5, 1), &sample(10, 200, 5, 1)),
            (None, None)
        );
        let unknown = Sample {
            lsn: None,
            ..sample(10, 0, 5, 1)
        };
        assert_eq!(rates(&sample(0, 100, 5, 1), &unknown), (None, None));
    }

    #[test]
    fn a_measured_rate_sizes_the_group_for_the_arrivals() {
        // 100 msg/s arriving, 30 msg/s per replica: 4 replicas although the backlog is small.
        let mut history = History::default();
        let d = decide(
            &policy(),
            &Observation {
                now_ms: 0,
                backlog: Some(150),
                arrival_rate: Some(100.0),
                rate_per_replica: Some(30.0),
                leases: 16,
                current_replicas: 2,
            },
            &mut history,
        );
        assert_eq!(
            d,
            Decision {
                replicas: 4,
                reason: Reason::ScaleUp
            }
        );
    }

    fn estimate(ranges: &[(u64, u64)]) -> GroupEstimate {
        GroupEstimate {
            group: "g".into(),
            ranges: ranges
                .iter()
                .map(|&(lsn, backlog)| cosmosq_queue::estimate::RangeEstimate {
                    min_epk: String::new(),
                    max_epk: "FF".into(),
                    owner: None,
                    lag: Some(backlog),
                    backlog,
                    oldest_unsettled_at: None,
                    checkpointed: true,
                    lsn: Some(lsn),
                })
                .collect(),
        }
    }

    #[test]
    fn the_autoscaler_measures_rates_between_rounds_and_keeps_replicas_on_errors() {
        let mut scaler = Autoscaler::default();
        // Round 1: 150 waiting on 2 replicas, no rate yet: the backlog alone says 2.
        let (obs, d) = scaler.round(
            &policy(),
            0,
            Some(&estimate(&[(1_000, 75), (1_000, 75)])),
            2,
        );
        assert_eq!(
            (obs.backlog, obs.leases, obs.arrival_rate),
            (Some(150), 2, None)
        );
        assert_eq!(d.replicas, 2);
        // A failed estimate in between keeps the replicas and the last sample.
        let (_, d) = scaler.round(&policy(), 5_000, None, 2);
        assert_eq!(d.reason, Reason::EstimateFailed);
        // Round 3, 10 s after the first: 1,000 arrived (LSNs), the backlog held at 150, so the
        // 2 saturated replicas settled 50 msg/s each while 100 msg/s arrive.
        let (obs, _) = scaler.round(
            &policy(),
            10_000,
            Some(&estimate(&[(1_500, 75), (1_500, 75)])),
            2,
        );
        assert_eq!(obs.arrival_rate, Some(100.0));
        assert_eq!(obs.rate_per_replica, Some(50.0));
    }
}
