//! What a range's next owner makes of the window its lease carries (the lease write path):
//! which of the documents it reads again were done, pending on a state document, never
//! started, or started with no outcome recorded (redeliveries). Pure.
//!
//! Windows name messages by identity, so a split child finds exactly the messages of its own
//! half, and a document that left by TTL changes nothing. What the previous owner recorded
//! stays in this owner's records until it is read again here, or until the range has read
//! everything there is (an empty page): what was never read again by then is not in this
//! range any more (the other half of a split, or expired).

use std::collections::BTreeSet;

use crate::buggify::{self, Bug};
use crate::checkpoint::Fate;
use crate::host::deliver::Route;
use crate::identity::IdentityFilter;
use crate::lease::Window;

/// What the range does with a document it read.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Handling {
    /// Deliver it this way.
    Deliver(Route),
    /// Deliver it this way, its start listed on the lease before it starts: the previous
    /// owner may have started it without listing it (see [`Window::starts_lag`]).
    Unsure(Route),
    /// Hand nothing out: the window says it is already this.
    Known(Fate),
}

/// A previous owner's window, as far as this range has not read it again.
#[derive(Debug, Default)]
pub(crate) struct Inherited {
    done: BTreeSet<String>,
    pending: BTreeSet<String>,
    /// Older windows' lists of what they handed out unstarted.
    unstarted: BTreeSet<String>,
    /// This version's filters of it: kept whole until the range has read everything (a
    /// filter's members cannot be taken out one by one).
    maybe_unstarted: Vec<IdentityFilter>,
    started: BTreeSet<String>,
    /// The lists may name the other half of a split.
    split: bool,
    /// What it handed out unstarted may hold messages the previous owner started (see
    /// [`Window::starts_lag`]).
    starts_lag: bool,
    /// Windows of older versions: their lists hold ids, and `left` documents from the
    /// position on are the ones they handed out.
    by_id: bool,
    left: u32,
    /// Documents to look up the state of first: the lease was last written by a host whose
    /// first deliveries wrote claims (another version, or the `claims` path).
    check: usize,
}

impl Inherited {
    /// What `window` says; the first `look_up_first` documents after it are looked up.
    pub(crate) fn new(window: &Window, look_up_first: usize) -> Self {
        let set = |list: &[String]| list.iter().cloned().collect::<BTreeSet<_>>();
        let by_id = !window.by_identity();
        let positional = buggify::on(Bug::PositionalWindow) && window.split;
        let maybe_unstarted: u32 = window.maybe_unstarted.iter().map(|f| f.n).sum();
        let handed_out = (window.done.len()
            + window.pending.len()
            + window.unstarted.len()
            + window.started.len()) as u32
            + maybe_unstarted;
        Self {
            done: set(&window.done),
            pending: set(&window.pending),
            unstarted: set(&window.unstarted),
            maybe_unstarted: window.maybe_unstarted.clone(),
            started: set(&window.started),
            split: window.split,
            starts_lag: window.starts_lag,
            by_id,
            left: match (by_id, positional) {
                (true, _) => window.read,
                // The defect: a split child counting its parent's documents as its own.
                (false, true) => handed_out,
                (false, false) => 0,
            },
            check: look_up_first,
        }
    }

    /// The next document read, in feed order: `identity` is its fingerprint, `id` its id
    /// (what older windows list). Ordered groups deliver a pending message through its state
    /// document rather than skip it: the key's later messages must wait behind it.
    pub(crate) fn next(&mut self, identity: &str, id: &str, ordered: bool) -> Handling {
        let name = if self.by_id { id } else { identity };
        // The exact lists first: a filter may say "maybe" to what a list names.
        let listed = if self.done.remove(name) {
            Some(Handling::Known(Fate::Settled))
        } else if self.pending.remove(name) {
            Some(match ordered {
                true => Handling::Deliver(Route::Checked),
                false => Handling::Known(Fate::Pending),
            })
        } else if self.started.remove(name) {
            Some(Handling::Deliver(
                match buggify::on(Bug::ListedStartForgotten) {
                    true => Route::Feed, // the defect: a listed start is not counted
                    false => Route::Recovered,
                },
            ))
        } else if self.unstarted.remove(name)
            || self.maybe_unstarted.iter().any(|f| f.may_hold(name))
        {
            // Not started by that reader, as far as it listed (or one a filter imagines:
            // looked up for nothing). Looked up first where a state of its own may exist: an
            // ordered message's from before (parked, then delivered by a sweep); any message
            // its reader may have started unlisted (it failed, and its retry is due, or it
            // ran long).
            // A window a `claims` host wrote last is looked up as well (`check`): its
            // claims are not in the window.
            Some(match (self.starts_lag, ordered || self.check > 0) {
                (true, _) => Handling::Unsure(Route::Locked),
                (false, true) => Handling::Deliver(Route::Checked),
                (false, false) => Handling::Deliver(Route::Feed),
            })
        } else {
            None
        };
        let within = self.left > 0;
        self.left = self.left.saturating_sub(1);
        if let Some(handling) = listed {
            self.check = self.check.saturating_sub(1);
            return handling;
        }
        if within {
            // Older windows: handed out, no outcome listed.
            self.check = self.check.saturating_sub(1);
            return Handling::Deliver(Route::Recovered);
        }
        if self.check > 0 {
            self.check -= 1;
            return Handling::Deliver(Route::Checked);
        }
        Handling::Deliver(Route::Feed)
    }

    /// A document that is not a message was read (skipped with its reason): older windows
    /// counted it among their positions.
    pub(crate) fn skipped(&mut self) {
        self.left = self.left.saturating_sub(1);
    }

    /// The range read everything there is: what was not read again is not in it any more.
    /// Whether that dropped anything the lease still records.
    pub(crate) fn caught_up(&mut self) -> bool {
        let dropped = !self.is_empty() && !self.by_id;
        *self = Self {
            check: self.check,
            ..Self::default()
        };
        dropped
    }

    /// Adds what was not read again to a record of this range's own (identities only: what an
    /// older window listed by id is not written on).
    pub(crate) fn carry_into(&self, window: &mut Window) {
        if self.by_id {
            return;
        }
        window.done.extend(self.done.iter().cloned());
        window.pending.extend(self.pending.iter().cloned());
        window.started.extend(self.started.iter().cloned());
        if !self.unstarted.is_empty() {
            // An older window's list, written on as a filter.
            window
                .maybe_unstarted
                .push(IdentityFilter::of(self.unstarted.iter()));
        }
        window
            .maybe_unstarted
            .extend(self.maybe_unstarted.iter().cloned());
        window.split |= self.split && !self.is_empty();
        window.starts_lag |= self.starts_lag && self.holds_unstarted();
    }

    fn holds_unstarted(&self) -> bool {
        !self.unstarted.is_empty() || !self.maybe_unstarted.is_empty()
    }

    fn is_empty(&self) -> bool {
        self.done.is_empty()
            && self.pending.is_empty()
            && !self.holds_unstarted()
            && self.started.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::WINDOW_IDENTITIES;

    fn window(done: &[&str], pending: &[&str], unstarted: &[&str], started: &[&str]) -> Window {
        let list = |l: &[&str]| l.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let unstarted = list(unstarted);
        Window {
            v: WINDOW_IDENTITIES,
            done: list(done),
            pending: list(pending),
            maybe_unstarted: match unstarted.is_empty() {
                true => Vec::new(),
                false => vec![IdentityFilter::of(unstarted.iter())],
            },
            started: list(started),
            ..Window::default()
        }
    }

    #[test]
    fn each_document_is_handled_as_its_identity_was_recorded() {
        use Handling::*;
        let w = window(&["d"], &["p"], &["u"], &["s"]);
        for (name, identity, ordered, expected) in [
            ("done is skipped", "d", false, Known(Fate::Settled)),
            ("pending is its state's", "p", false, Known(Fate::Pending)),
            (
                "pending holds an ordered key",
                "p",
                true,
                Deliver(Route::Checked),
            ),
            (
                "unstarted is a first delivery",
                "u",
                false,
                Deliver(Route::Feed),
            ),
            (
                "started is a redelivery",
                "s",
                false,
                Deliver(Route::Recovered),
            ),
            ("anything else is new", "n", false, Deliver(Route::Feed)),
        ] {
            let mut inherited = Inherited::new(&w, 0);
            assert_eq!(inherited.next(identity, "id", ordered), expected, "{name}");
        }
    }

    #[test]
    fn what_a_lagging_window_lists_unstarted_has_its_start_listed_first_and_stays_unsure() {
        let mut w = window(&[], &[], &["u", "v"], &["s"]);
        w.starts_lag = true;
        let mut inherited = Inherited::new(&w, 0);
        assert_eq!(
            inherited.next("u", "id", false),
            Handling::Unsure(Route::Locked),
            "the previous owner may have started it: its state may exist"
        );
        assert_eq!(
            inherited.next("s", "id", false),
            Handling::Deliver(Route::Recovered),
            "a listed start is a redelivery"
        );
        let mut record = Window::default();
        inherited.carry_into(&mut record);
        assert_eq!(record.maybe_unstarted, w.maybe_unstarted, "kept whole");
        assert!(
            record.starts_lag,
            "carried on as unsure, not as never started"
        );
        // A holder's last write lists every start: its unstarted never started.
        w.starts_lag = false;
        let mut exact = Inherited::new(&w, 0);
        assert_eq!(exact.next("u", "id", false), Handling::Deliver(Route::Feed));
    }

    #[test]
    fn a_start_a_landed_write_listed_is_a_redelivery_whatever_a_filter_imagines() {
        // A filter says "maybe" to what it never held, now and then; the exact lists speak
        // first, so a listed start keeps its count and a done message stays done.
        let mut w = window(&["d"], &[], &["d", "s", "u"], &["s"]);
        w.starts_lag = true;
        let mut inherited = Inherited::new(&w, 0);
        assert_eq!(
            inherited.next("d", "id", false),
            Handling::Known(Fate::Settled)
        );
        assert_eq!(
            inherited.next("s", "id", false),
            Handling::Deliver(Route::Recovered)
        );
        assert_eq!(
            inherited.next("u", "id", false),
            Handling::Unsure(Route::Locked)
        );
    }

    #[test]
    fn what_may_be_unstarted_is_looked_up_where_the_window_says_to_look_up_first() {
        // A window a `claims` host wrote last: its claims are not listed, so the first
        // documents are looked up, those its filter may hold too.
        let w = window(&[], &[], &["u"], &[]);
        let mut inherited = Inherited::new(&w, 2);
        assert_eq!(
            inherited.next("u", "id", false),
            Handling::Deliver(Route::Checked)
        );
        assert_eq!(
            inherited.next("n", "id", false),
            Handling::Deliver(Route::Checked)
        );
        assert_eq!(
            inherited.next("m", "id", false),
            Handling::Deliver(Route::Feed)
        );
    }

    #[test]
    fn an_older_window_lists_unstarted_and_is_carried_on_as_a_filter() {
        let mut w = window(&[], &[], &[], &[]);
        w.unstarted = vec!["u".into(), "v".into()];
        w.starts_lag = true;
        let mut inherited = Inherited::new(&w, 0);
        assert_eq!(
            inherited.next("u", "id", false),
            Handling::Unsure(Route::Locked)
        );
        let mut record = Window::default();
        inherited.carry_into(&mut record);
        assert!(record.unstarted.is_empty(), "this version writes filters");
        assert!(record.maybe_unstarted[0].may_hold("v"));
        assert!(record.starts_lag && record.may_be_in_app());
    }

    #[test]
    fn a_split_child_finds_only_its_own_half_and_carries_the_rest_until_caught_up() {
        let mut parent = window(&["mine-done", "theirs-done"], &[], &[], &["theirs-started"]);
        parent.split = true;
        let mut child = Inherited::new(&parent, 0);
        // Its feed holds its own documents only: none is taken for a redelivery by position.
        assert_eq!(
            child.next("mine-done", "x", false),
            Handling::Known(Fate::Settled)
        );
        assert_eq!(
            child.next("mine-new", "y", false),
            Handling::Deliver(Route::Feed)
        );
        let mut record = Window::default();
        child.carry_into(&mut record);
        assert_eq!(record.done, ["theirs-done"], "carried: not read again yet");
        assert_eq!(record.started, ["theirs-started"]);
        assert!(record.split, "names documents this range may never read");
        child.caught_up();
        let mut record = Window::default();
        child.carry_into(&mut record);
        assert!(record.is_empty() && !record.split, "{record:?}");
    }

    #[test]
    fn older_windows_are_read_by_id_and_position() {
        let old = Window {
            read: 3,
            done: vec!["a".into()],
            ..Window::default()
        };
        let mut inherited = Inherited::new(&old, 0);
        assert_eq!(
            inherited.next("fa", "a", false),
            Handling::Known(Fate::Settled)
        );
        assert_eq!(
            inherited.next("fb", "b", false),
            Handling::Deliver(Route::Recovered)
        );
        assert_eq!(
            inherited.next("fc", "c", false),
            Handling::Deliver(Route::Recovered)
        );
        assert_eq!(
            inherited.next("fd", "d", false),
            Handling::Deliver(Route::Feed),
            "past `read`"
        );
        let mut record = Window::default();
        inherited.carry_into(&mut record);
        assert!(record.is_empty(), "ids are not written on as identities");
    }

    #[test]
    fn a_claims_written_lease_has_its_first_documents_looked_up() {
        let mut inherited = Inherited::new(&Window::default(), 2);
        assert_eq!(
            inherited.next("a", "a", false),
            Handling::Deliver(Route::Checked)
        );
        assert_eq!(
            inherited.next("b", "b", false),
            Handling::Deliver(Route::Checked)
        );
        assert_eq!(
            inherited.next("c", "c", false),
            Handling::Deliver(Route::Feed)
        );
    }
}
