//! Retry back-off: exponential with jitter, capped, and the dead-letter threshold.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How a group retries a message whose delivery failed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct RetryPolicy {
    /// Deliveries after which a still-failing message is dead-lettered (Service Bus'
    /// `MaxDeliveryCount`). At least 1.
    pub max_delivery_attempts: u32,
    /// Back-off after the first failure.
    #[serde(with = "humantime_serde")]
    pub initial_backoff: Duration,
    /// The longest back-off.
    #[serde(with = "humantime_serde")]
    pub max_backoff: Duration,
    /// Growth per failed attempt; at least 1.
    pub multiplier: f64,
    /// Fraction of the delay randomised either way (0 = none, 0.2 = ±20 %); in `[0, 1]`.
    pub jitter: f64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_delivery_attempts: 10,
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(300),
            multiplier: 2.0,
            jitter: 0.2,
        }
    }
}

impl RetryPolicy {
    /// Refuses policies no delivery could follow (no attempt, back-offs out of order).
    pub fn validate(&self) -> Result<(), String> {
        if self.max_delivery_attempts == 0 {
            return Err("retry.maxDeliveryAttempts must be at least 1".into());
        }
        if !(self.multiplier.is_finite() && self.multiplier >= 1.0) {
            return Err("retry.multiplier must be a number >= 1".into());
        }
        if !(0.0..=1.0).contains(&self.jitter) {
            return Err("retry.jitter must be between 0 and 1".into());
        }
        if self.initial_backoff > self.max_backoff {
            return Err("retry.initialBackoff must not exceed retry.maxBackoff".into());
        }
        Ok(())
    }

    /// The delay before the next delivery after `failed_attempts` failed deliveries (≥ 1).
    ///
    /// `unit` is a uniform sample from `[0, 1)`; it is a parameter so the schedule is a pure
    /// function. The un-jittered delay is `initial · multiplier^(n-1)`, capped at `max_backoff`;
    /// jitter spreads it over `±jitter` and the result never exceeds `max_backoff`.
    pub fn backoff(&self, failed_attempts: u32, unit: f64) -> Duration {
        let exponent = failed_attempts.saturating_sub(1).min(64) as i32;
        let base = self.initial_backoff.as_secs_f64() * self.multiplier.powi(exponent);
        let capped = base.min(self.max_backoff.as_secs_f64());
        let spread = (unit.clamp(0.0, 1.0) * 2.0 - 1.0) * self.jitter;
        let jittered = (capped * (1.0 + spread)).clamp(0.0, self.max_backoff.as_secs_f64());
        Duration::from_secs_f64(jittered)
    }

    /// [`Self::backoff`] with a fresh random sample.
    pub fn backoff_random(&self, failed_attempts: u32) -> Duration {
        self.backoff(failed_attempts, crate::chance::unit())
    }

    /// Whether a message that has been delivered `attempts` times and failed must be
    /// dead-lettered rather than retried.
    pub fn exhausted(&self, attempts: u32) -> bool {
        attempts >= self.max_delivery_attempts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> RetryPolicy {
        RetryPolicy {
            max_delivery_attempts: 5,
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(30),
            multiplier: 2.0,
            jitter: 0.25,
        }
    }

    #[test]
    fn schedule_doubles_then_caps() {
        let p = policy();
        // unit = 0.5 means no jitter.
        let delays: Vec<u64> = (1..=7).map(|n| p.backoff(n, 0.5).as_secs()).collect();
        assert_eq!(delays, vec![1, 2, 4, 8, 16, 30, 30]);
    }

    #[test]
    fn jitter_stays_within_bounds_and_under_the_cap() {
        let p = policy();
        for n in 1..=10 {
            let base = p.backoff(n, 0.5).as_secs_f64();
            let low = p.backoff(n, 0.0).as_secs_f64();
            let high = p.backoff(n, 0.999_999).as_secs_f64();
            assert!(
                (low - base * 0.75).abs() < 1e-6,
                "attempt {n}: {low} vs {base}"
            );
            assert!(high <= 30.0 + 1e-9, "attempt {n}: {high} over the cap");
            if base * 1.25 <= 30.0 {
                assert!((high - base * 1.25).abs() < 1e-3, "attempt {n}: {high}");
            }
        }
        for _ in 0..1_000 {
            let d = p.backoff_random(3).as_secs_f64();
            assert!((3.0..=5.0).contains(&d), "{d}");
        }
    }

    #[test]
    fn zero_jitter_is_exact() {
        let p = RetryPolicy {
            jitter: 0.0,
            ..policy()
        };
        assert_eq!(p.backoff(3, 0.0), Duration::from_secs(4));
        assert_eq!(p.backoff(3, 0.99), Duration::from_secs(4));
    }

    #[test]
    fn huge_attempt_counts_do_not_overflow() {
        assert_eq!(policy().backoff(u32::MAX, 0.5), Duration::from_secs(30));
    }

    #[test]
    fn exhausted_exactly_at_max_attempts() {
        let p = policy();
        assert!(!p.exhausted(4));
        assert!(p.exhausted(5));
        assert!(p.exhausted(6));
    }

    #[test]
    fn validation_names_the_setting() {
        let bad = RetryPolicy {
            max_delivery_attempts: 0,
            ..policy()
        };
        assert!(bad.validate().unwrap_err().contains("maxDeliveryAttempts"));
        let bad = RetryPolicy {
            jitter: 1.5,
            ..policy()
        };
        assert!(bad.validate().unwrap_err().contains("jitter"));
        assert!(policy().validate().is_ok());
    }

    #[test]
    fn parses_humantime_json() {
        let p: RetryPolicy = serde_json::from_str(
            r#"{"maxDeliveryAttempts":3,"initialBackoff":"250ms","maxBackoff":"1m"}"#,
        )
        .unwrap();
        assert_eq!(p.max_delivery_attempts, 3);
        assert_eq!(p.initial_backoff, Duration::from_millis(250));
        assert_eq!(p.max_backoff, Duration::from_secs(60));
        assert_eq!(p.multiplier, 2.0);
    }
}
