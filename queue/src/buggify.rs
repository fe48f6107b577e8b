//! Defects put back on purpose, so that the simulation's power is measured rather than
//! assumed (FoundationDB's "buggify", TigerBeetle's VOPR): each [`Bug`] restores, where its
//! fix is, the behaviour that broke a promise, and the simulation must find it within its
//! budget.
//!
//! The switches exist only in builds with the `simulation` feature (the test suite's); without it
//! [`on`] is a constant `false` and the code behind it is dead. They are per thread: the
//! simulation runs each history on its own single-threaded runtime, so histories running side
//! by side never see each other's switches.

/// A defect the simulation must find when it is put back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Bug {
    /// Scenario 1: the lease path knows a message by its id alone, not by (id, key).
    IdentityById,
    /// Scenario 2: a range's next owner delivers an ordered key's next message without
    /// waiting for a predecessor that the checkpoint had passed (long work, a retry).
    OrderedMoveForgetsPredecessor,
    /// Scenario 3: a host takes back at once a lease in its own name that it does not run
    /// (the pod name is the owner, not the process incarnation).
    RestartRetakesLease,
    /// Scenario 4: what waits for a permit starts later without checking that the lease is
    /// still live; the range never stops at its lease's deadline (it notices a lapsed lease
    /// only when a write of it is refused), nor does its write retry stop there.
    StartUnderExpiredLease,
    /// Scenario 5: a range's window counts positions, so a split child treats documents of its
    /// parent's window as redeliveries.
    PositionalWindow,
    /// Scenario 6: a promotion refused for good leaves the message pending with no record.
    PromoteRefusalForgotten,
    /// Scenario 7: a redelivery with a lock of its own holds its range until the app answers.
    RecordedClaimHoldsRange,
    /// Scenario 9: a dead owner's first deliveries come back only at the lease's expiry,
    /// whatever the lock duration.
    RecoveryWaitsForLeaseExpiry,
    /// Counts: a range's next owner delivers what the window lists started as first
    /// deliveries, so the app sees a count again that a lease write had recorded.
    ListedStartForgotten,
    /// Estimates: a range's feed is taken to end at its first empty page when the
    /// continuation lists one part, so a group at zero whose messages sit in another split
    /// child estimates no backlog and is never woken.
    EstimateTrustsTheToken,
    /// A completion its range's lease could not record is written late as a state document
    /// while the range's next owner, unsure whether it started, delivers it lease-fenced (no
    /// document of its own to collide with), and a late write whose answer was lost takes
    /// any completed document for its own: the completion is recorded twice.
    LateCompletionRace,
    /// A message read before it is visible has its start listed before its schedule is
    /// written: a holder killed before that write lands leaves a listed start the app never
    /// saw, delivered at count 2 by the next owner.
    ScheduledStartListed,
    /// Heartbeats: a range whose window may be in the app lets the host's heartbeat keep its
    /// lease (reads it instead of renewing it, and counts it as held until the heartbeat's
    /// deadline), while other hosts judge such a lease by itself and its lock: a live owner's
    /// deliveries are taken over while the app still has them.
    HeartbeatKeepsWindow,
    /// Counts: a message a range's previous holder listed started, handed out again by the
    /// next one but not started before it handed the range over (it waited for a permit), is
    /// listed unstarted: the range's third holder delivers it at count 1 again.
    InheritedStartHandedOver,
    /// Counts: the time a delivery's refusals began is kept after the app was reached, so a
    /// refusal after an in-place retry (an ordered group's, once the app crashed) counts as
    /// a whole lock duration of them at once: an attempt the app never saw is counted.
    RefusalsNeverForgotten,
    /// Recovery: a host without leases does not sweep, so a dead owner's claims whose lock ran
    /// out wait for its lease to expire when the group runs more pods than leases.
    LeaselessHostsDoNotSweep,
}

impl Bug {
    /// Every defect, in the order of the numbered scenarios (`tests/it/sim/scenarios.rs`), then
    /// the checks' own.
    pub const ALL: [Bug; 16] = [
        Bug::IdentityById,
        Bug::OrderedMoveForgetsPredecessor,
        Bug::RestartRetakesLease,
        Bug::StartUnderExpiredLease,
        Bug::PositionalWindow,
        Bug::PromoteRefusalForgotten,
        Bug::RecordedClaimHoldsRange,
        Bug::RecoveryWaitsForLeaseExpiry,
        Bug::ListedStartForgotten,
        Bug::EstimateTrustsTheToken,
        Bug::LateCompletionRace,
        Bug::ScheduledStartListed,
        Bug::HeartbeatKeepsWindow,
        Bug::InheritedStartHandedOver,
        Bug::RefusalsNeverForgotten,
        Bug::LeaselessHostsDoNotSweep,
    ];

    /// Whether the random search must find it by itself (the mutation test): the others
    /// line up only in a written history (`scenarios.rs`), which pins each.
    pub fn searched(self) -> bool {
        !matches!(
            self,
            Bug::LateCompletionRace
                | Bug::ScheduledStartListed
                | Bug::InheritedStartHandedOver
                | Bug::RefusalsNeverForgotten
                | Bug::LeaselessHostsDoNotSweep
        )
    }

    #[cfg(feature = "simulation")]
    fn bit(self) -> u32 {
        1 << (self as u32)
    }
}

#[cfg(feature = "simulation")]
thread_local! {
    static ON: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Whether `bug` is put back on this thread.
#[inline]
pub fn on(bug: Bug) -> bool {
    #[cfg(feature = "simulation")]
    {
        ON.with(|on| on.get() & bug.bit() != 0)
    }
    #[cfg(not(feature = "simulation"))]
    {
        let _ = bug;
        false
    }
}

/// Puts `bugs` back on this thread (and only these); `false` in builds without the feature.
pub fn set(bugs: &[Bug]) -> bool {
    #[cfg(feature = "simulation")]
    {
        ON.with(|on| on.set(bugs.iter().fold(0, |all, b| all | b.bit())));
        true
    }
    #[cfg(not(feature = "simulation"))]
    {
        let _ = bugs;
        false
    }
}

#[cfg(all(test, feature = "simulation"))]
mod tests {
    use super::*;

    #[test]
    fn switches_are_per_thread() {
        assert!(set(&[Bug::IdentityById]));
        assert!(on(Bug::IdentityById) && !on(Bug::PositionalWindow));
        std::thread::spawn(|| assert!(!on(Bug::IdentityById)))
            .join()
            .unwrap();
        set(&[]);
        assert!(!on(Bug::IdentityById));
    }
}
