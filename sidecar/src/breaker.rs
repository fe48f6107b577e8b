//! A circuit breaker on the app: after enough consecutive hard failures (connection refused,
//! timeouts, 5xx) the sidecar stops handing out work, then lets one probe through after a
//! cool-down; the probe's success closes it, its failure opens it again for longer.

use std::time::Duration;

use tokio::time::Instant;

/// Where the breaker stands.
#[derive(Clone, Debug, PartialEq)]
pub enum State {
    /// Deliveries go through.
    Closed {
        /// Hard failures in a row so far.
        failures: u32,
    },
    /// Deliveries wait.
    Open {
        /// Until a probe may go.
        until: Instant,
        /// How long it stayed open this time (doubled when the probe fails).
        cool_down: Duration,
    },
    /// One probe is out; everyone else waits for its result.
    HalfOpen {
        /// How long it stayed open before the probe.
        cool_down: Duration,
    },
}

/// A circuit breaker on the app: after `threshold` hard failures in a row, deliveries wait,
/// then one probe tells whether the app is back.
#[derive(Clone, Debug)]
pub struct Breaker {
    threshold: u32,
    min_cool_down: Duration,
    max_cool_down: Duration,
    state: State,
}

/// What a caller may do now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Go.
    Go,
    /// Go, as the probe: report its result.
    Probe,
    /// Wait (at most this long) and ask again.
    Wait(Duration),
}

impl Breaker {
    /// Closed, opening after `threshold` failures for `min_cool_down`, doubling up to `max_cool_down`.
    pub fn new(threshold: u32, min_cool_down: Duration, max_cool_down: Duration) -> Self {
        Self {
            threshold: threshold.max(1),
            min_cool_down,
            max_cool_down,
            state: State::Closed { failures: 0 },
        }
    }

    /// What a delivery may do at `now`.
    pub fn permit(&mut self, now: Instant) -> Admission {
        match self.state.clone() {
            State::Closed { .. } => Admission::Go,
            State::Open { until, cool_down } if now >= until => {
                self.state = State::HalfOpen { cool_down };
                Admission::Probe
            }
            State::Open { until, .. } => Admission::Wait(until - now),
            State::HalfOpen { .. } => Admission::Wait(Duration::from_millis(100)),
        }
    }

    /// Records a delivery's result; `hard_failure` means the app could not take it at all.
    pub fn record(&mut self, hard_failure: bool, now: Instant) {
        self.state = match (self.state.clone(), hard_failure) {
            (_, false) => State::Closed { failures: 0 },
            (State::Closed { failures }, true) if failures + 1 >= self.threshold => State::Open {
                until: now + self.min_cool_down,
                cool_down: self.min_cool_down,
            },
            (State::Closed { failures }, true) => State::Closed {
                failures: failures + 1,
            },
            (State::HalfOpen { cool_down }, true) | (State::Open { cool_down, .. }, true) => {
                let next = (cool_down * 2).min(self.max_cool_down);
                State::Open {
                    until: now + next,
                    cool_down: next,
                }
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_consecutive_failures_and_probes_after_cool_down() {
        let t0 = Instant::now();
        let mut b = Breaker::new(3, Duration::from_secs(1), Duration::from_secs(8));
        b.record(true, t0);
        b.record(true, t0);
        assert_eq!(b.permit(t0), Admission::Go, "two failures: still closed");
        b.record(false, t0);
        b.record(true, t0);
        b.record(true, t0);
        assert_eq!(b.permit(t0), Admission::Go, "a success resets the count");
        b.record(true, t0);
        assert_eq!(b.permit(t0), Admission::Wait(Duration::from_secs(1)));
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(b.permit(t1), Admission::Probe);
        assert!(
            matches!(b.permit(t1), Admission::Wait(_)),
            "one probe at a time"
        );
        b.record(true, t1);
        assert_eq!(
            b.permit(t1),
            Admission::Wait(Duration::from_secs(2)),
            "failed probe: longer"
        );
        let t2 = t1 + Duration::from_secs(2);
        assert_eq!(b.permit(t2), Admission::Probe);
        b.record(false, t2);
        assert_eq!(b.permit(t2), Admission::Go);
        assert_eq!(b.state, State::Closed { failures: 0 });
    }

    #[test]
    fn cool_down_is_capped() {
        let t = Instant::now();
        let mut b = Breaker::new(1, Duration::from_secs(1), Duration::from_secs(4));
        for _ in 0..10 {
            b.record(true, t);
        }
        assert_eq!(b.permit(t), Admission::Wait(Duration::from_secs(4)));
    }
}
