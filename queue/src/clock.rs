//! Wall-clock time for locks, schedules and back-off.
//!
//! Lock expiry and visibility times are compared across hosts, so they are wall-clock
//! milliseconds since the Unix epoch stored in documents, not `Instant`s. Tests swap in a
//! manual clock so that a lock can expire without anybody sleeping.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The time source of a [`crate::Queue`]; cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct Clock(Option<Arc<AtomicI64>>, i64);

impl Clock {
    /// The machine's clock.
    pub fn system() -> Self {
        Self(None, 0)
    }

    /// A clock that only moves when told to, starting at `start_ms`.
    pub fn manual(start_ms: i64) -> Self {
        Self(Some(Arc::new(AtomicI64::new(start_ms))), 0)
    }

    /// The machine's clock, off by `skew_ms` (what a host whose clock drifted sees; the
    /// fault suite runs hosts with skews within the lease expiry).
    pub fn skewed(skew_ms: i64) -> Self {
        Self(None, skew_ms)
    }

    /// Milliseconds since the Unix epoch.
    pub fn now_ms(&self) -> i64 {
        let now = match &self.0 {
            Some(ms) => ms.load(Ordering::SeqCst),
            None => system_now_ms(),
        };
        now + self.1
    }

    /// Moves a manual clock forward. Returns `false` (and does nothing) on the system clock.
    pub fn advance(&self, by: Duration) -> bool {
        match &self.0 {
            Some(ms) => {
                ms.fetch_add(duration_ms(by), Ordering::SeqCst);
                true
            }
            None => false,
        }
    }
}

/// Milliseconds since the Unix epoch on this machine.
pub fn system_now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(duration_ms)
        .unwrap_or(0)
}

/// A duration in whole milliseconds, saturating.
pub fn duration_ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Formats epoch milliseconds as RFC 3339 (UTC), for humans and CloudEvents.
pub fn format_ms(ms: i64) -> String {
    let t = UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    humantime::format_rfc3339_millis(t).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_advanced() {
        let clock = Clock::manual(1_000);
        assert_eq!(clock.now_ms(), 1_000);
        assert!(clock.advance(Duration::from_secs(2)));
        assert_eq!(clock.now_ms(), 3_000);
        let copy = clock.clone();
        copy.advance(Duration::from_millis(5));
        assert_eq!(clock.now_ms(), 3_005, "clones share one time");
    }

    #[test]
    fn a_skewed_clock_runs_ahead_or_behind_by_its_skew() {
        let (ahead, behind) = (Clock::skewed(2_000), Clock::skewed(-2_000));
        let (a, b, now) = (ahead.now_ms(), behind.now_ms(), system_now_ms());
        assert!((a - now - 2_000).abs() < 1_000, "{a} vs {now}");
        assert!((now - b - 2_000).abs() < 1_000, "{b} vs {now}");
    }

    #[test]
    fn system_clock_is_not_advanced() {
        let clock = Clock::system();
        assert!(!clock.advance(Duration::from_secs(1)));
        assert!(clock.now_ms() > 1_700_000_000_000);
    }

    #[test]
    fn formats_rfc3339() {
        assert_eq!(format_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(format_ms(1_500), "1970-01-01T00:00:01.500Z");
    }
}
