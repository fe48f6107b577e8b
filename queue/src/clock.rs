//! Wall-clock time for locks, schedules and back-off.
//!
//! Lock expiry and visibility times are compared across hosts, so they are wall-clock
//! milliseconds since the Unix epoch stored in documents, not `Instant`s. Tests swap in a
//! manual clock so that a lock can expire without anybody sleeping, and the simulation a clock
//! that follows tokio's paused time, skewed per host and jumped at will.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The time source of a [`crate::Queue`]; cheap to clone (clones share the source and skew).
#[derive(Clone, Debug, Default)]
pub struct Clock {
    source: Source,
    /// Added to the source's time: a host whose clock drifted, or jumped.
    skew: Arc<AtomicI64>,
}

#[derive(Clone, Debug, Default)]
enum Source {
    #[default]
    System,
    /// Moves only when told to.
    Manual(Arc<AtomicI64>),
    /// `start_ms` at `origin`, then as tokio's clock moves (paused time in tests).
    Tokio {
        origin: tokio::time::Instant,
        start_ms: i64,
    },
}

impl Clock {
    /// The machine's clock.
    pub fn system() -> Self {
        Self::default()
    }

    /// A clock that only moves when told to, starting at `start_ms`.
    pub fn manual(start_ms: i64) -> Self {
        Self {
            source: Source::Manual(Arc::new(AtomicI64::new(start_ms))),
            ..Self::default()
        }
    }

    /// A clock at `start_ms` now that then follows tokio's clock: with time paused (the
    /// simulation), wall-clock time moves exactly as the runtime's timers do. Must be made
    /// and read inside a tokio runtime.
    pub fn following_tokio(start_ms: i64) -> Self {
        Self {
            source: Source::Tokio {
                origin: tokio::time::Instant::now(),
                start_ms,
            },
            ..Self::default()
        }
    }

    /// The machine's clock, off by `skew_ms` (what a host whose clock drifted sees; the
    /// fault suite runs hosts with skews within the lease expiry).
    pub fn skewed(skew_ms: i64) -> Self {
        Self::system().with_skew(skew_ms)
    }

    /// This clock's source, off by `skew_ms`, with a skew of its own (not shared with `self`).
    pub fn with_skew(&self, skew_ms: i64) -> Self {
        Self {
            source: self.source.clone(),
            skew: Arc::new(AtomicI64::new(skew_ms)),
        }
    }

    /// Moves this clock (and its clones) by `by_ms`, forward or back: a clock jump.
    pub fn jump(&self, by_ms: i64) {
        self.skew.fetch_add(by_ms, Ordering::SeqCst);
    }

    /// How far this clock is off its source, ms.
    pub fn skew_ms(&self) -> i64 {
        self.skew.load(Ordering::SeqCst)
    }

    /// Milliseconds since the Unix epoch.
    pub fn now_ms(&self) -> i64 {
        let now = match &self.source {
            Source::System => system_now_ms(),
            Source::Manual(ms) => ms.load(Ordering::SeqCst),
            Source::Tokio { origin, start_ms } => {
                start_ms.saturating_add(duration_ms(origin.elapsed()))
            }
        };
        now + self.skew_ms()
    }

    /// Moves a manual clock forward. Returns `false` (and does nothing) on other clocks.
    pub fn advance(&self, by: Duration) -> bool {
        match &self.source {
            Source::Manual(ms) => {
                ms.fetch_add(duration_ms(by), Ordering::SeqCst);
                true
            }
            _ => false,
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

    #[tokio::test(start_paused = true)]
    async fn a_clock_following_paused_time_moves_with_the_runtime_and_jumps_when_told() {
        let clock = Clock::following_tokio(10_000);
        let ahead = clock.with_skew(500);
        assert_eq!((clock.now_ms(), ahead.now_ms()), (10_000, 10_500));
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!((clock.now_ms(), ahead.now_ms()), (13_000, 13_500));
        ahead.jump(-2_000);
        assert_eq!(ahead.now_ms(), 11_500, "a jump back");
        assert_eq!(
            clock.now_ms(),
            13_000,
            "a skew of its own: the source is untouched"
        );
        assert!(
            !clock.advance(Duration::from_secs(1)),
            "only manual clocks advance"
        );
    }

    #[test]
    fn formats_rfc3339() {
        assert_eq!(format_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(format_ms(1_500), "1970-01-01T00:00:01.500Z");
    }
}
