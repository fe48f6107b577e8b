//! Telling a poison message from its neighbours when the app crashes.
//!
//! A crash (the connection reset, or an answer cut off mid-body) fails every delivery the app
//! was working on, and only one of them may have caused it. Counting each as a failed attempt
//! would let one poison message drag its neighbours to the dead letters. So a crash with other
//! deliveries in flight is not counted for any of them: they are delivered again one at a time
//! ("isolated"), and a crash then is the message's own and counts. After enough isolated
//! deliveries in a row succeed, deliveries run side by side again.

/// Isolated successes in a row that end isolation.
pub const SUCCESSES_TO_RESUME: u32 = 3;

/// Whether deliveries go one at a time while a crash is being pinned on one message.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Isolation {
    active: bool,
    successes: u32,
}

/// What a failed delivery means, given how it was run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Blame {
    /// The message's own failure: counts as an attempt.
    Counted,
    /// It may have failed with a neighbour: try again, isolated, without counting.
    Isolate,
}

impl Isolation {
    /// Whether deliveries must run one at a time now.
    pub fn active(&self) -> bool {
        self.active
    }

    /// A delivery ended; `crashed`: the app went down under it. `alone`: it ran isolated (no
    /// other delivery in the app at the same time).
    pub fn observe(&mut self, crashed: bool, alone: bool) -> Blame {
        match (crashed, alone) {
            (true, false) => {
                self.active = true;
                self.successes = 0;
                Blame::Isolate
            }
            (true, true) => {
                self.successes = 0;
                Blame::Counted
            }
            (false, _) => {
                if self.active && alone {
                    self.successes += 1;
                    if self.successes >= SUCCESSES_TO_RESUME {
                        *self = Isolation::default();
                    }
                }
                Blame::Counted
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_crash_among_neighbours_isolates_and_counts_nobody() {
        let mut iso = Isolation::default();
        assert_eq!(iso.observe(false, false), Blame::Counted);
        assert!(!iso.active());
        assert_eq!(iso.observe(true, false), Blame::Isolate);
        assert!(iso.active());
        // The poison message, alone, crashes the app again: that one counts.
        assert_eq!(iso.observe(true, true), Blame::Counted);
        assert!(iso.active());
        // Its neighbours succeed alone; after three in a row, side by side again.
        for n in 1..=SUCCESSES_TO_RESUME {
            assert!(iso.active(), "still isolated after {n} successes");
            assert_eq!(iso.observe(false, true), Blame::Counted);
        }
        assert!(!iso.active());
    }

    #[test]
    fn a_crash_alone_counts() {
        let mut iso = Isolation::default();
        assert_eq!(iso.observe(true, true), Blame::Counted);
        assert!(!iso.active());
    }
}
