//! How often a range reads its feed: at once while pages come back full, shortly after a
//! partial page, backing off while they come back empty.

use std::time::Duration;

/// Exponential back-off of the poll interval while the feed is empty.
#[derive(Clone, Debug)]
pub(crate) struct AdaptivePoll {
    min: Duration,
    max: Duration,
    current: Duration,
    /// Empty reads since the last page with work.
    empty: u32,
    /// Empty reads at `min` before backing off: [`HOLD_AT_MIN`] of them.
    hold: u32,
}

/// How long the feed stays at the shortest interval after work before backing off: a steady
/// trickle (a message every few tens of ms per range) leaves gaps of a few hundred ms, and
/// doubling within them makes the next message wait the longer interval (the latency's tail).
/// An idle range pays for it once per spell of work (250 ms of reads at `min`), not per second.
const HOLD_AT_MIN: Duration = Duration::from_millis(250);

impl AdaptivePoll {
    /// Starting at `min`.
    pub(crate) fn new(min: Duration, max: Duration) -> Self {
        let hold = HOLD_AT_MIN.as_millis() / min.as_millis().max(1);
        Self {
            min,
            max,
            current: Duration::ZERO,
            empty: 0,
            hold: hold.clamp(1, 64) as u32,
        }
    }

    /// The wait before the next read.
    pub(crate) fn delay(&self) -> Duration {
        self.current
    }

    /// A page came back with `items` of at most `page_size`: read again at once while pages
    /// come back full (more is waiting), shortly after a partial page (caught up), and back
    /// off while they come back empty.
    pub(crate) fn observed(&mut self, items: usize, page_size: usize) {
        if items > 0 {
            self.empty = 0;
        }
        self.current = match items {
            0 => return self.idle(),
            n if n >= page_size => Duration::ZERO,
            _ => self.min,
        };
    }

    /// A page came back empty: after [`HOLD_AT_MIN`] of reads at the shortest interval, wait
    /// longer, up to the ceiling.
    pub(crate) fn idle(&mut self) {
        self.empty = self.empty.saturating_add(1);
        self.current = if self.current.is_zero() || self.empty <= self.hold {
            self.min
        } else {
            (self.current * 2).min(self.max)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polling_backs_off_to_the_ceiling_and_resets_on_work() {
        let mut poll = AdaptivePoll::new(Duration::from_millis(100), Duration::from_secs(1));
        assert_eq!(poll.delay(), Duration::ZERO);
        let mut seen = Vec::new();
        for _ in 0..9 {
            poll.observed(0, 100);
            seen.push(poll.delay().as_millis());
        }
        assert_eq!(seen, vec![100, 100, 200, 400, 800, 1000, 1000, 1000, 1000]);
        poll.observed(100, 100);
        assert_eq!(
            poll.delay(),
            Duration::ZERO,
            "a full page: read again at once"
        );
        poll.observed(3, 100);
        assert_eq!(
            poll.delay(),
            Duration::from_millis(100),
            "a partial page: caught up"
        );
        poll.observed(0, 100);
        assert_eq!(
            poll.delay(),
            Duration::from_millis(100),
            "a few empty reads at the shortest interval after work"
        );
        // At the production floor (20 ms), a quarter of a second of reads before backing off.
        let mut poll = AdaptivePoll::new(Duration::from_millis(20), Duration::from_secs(5));
        let at_min = (0..40)
            .map(|_| {
                poll.idle();
                poll.delay()
            })
            .take_while(|d| *d == Duration::from_millis(20))
            .count();
        assert_eq!(at_min, 12);
    }
}
