//! A range's checkpoint: the position its next reader resumes from, never past a message
//! whose fate is not written. Pages are settled out of order (one slow message must not stall
//! the range), so the checkpoint is the position after the longest run of settled pages at the
//! front of the window; the window is bounded by the range's in-flight limit. Pure.
//!
//! On the lease write path it also keeps the lease's window: which messages past the position
//! are done, pending, unstarted or started, by identity, plus what the range's previous owner
//! recorded that this one has not read again yet ([`Inherited`]).

use std::collections::VecDeque;

use crate::host::recovery::Inherited;
use crate::identity::IdentityFilter;
use crate::lease::{Marker, Window, WINDOW_IDENTITIES};
use crate::message::MessageKey;

/// What became of a message a delivery task was given: what the task reports and what the
/// checkpoint counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fate {
    /// The group is done with it (completed, dead-lettered), or it is not this task's to
    /// deliver (already settled, expired, a state another version owns): settled by a state
    /// document, or before this read.
    Settled,
    /// Completed with nothing written (the lease write path): the range's next lease write
    /// records it, and it is counted as completed only once that write landed.
    Completed,
    /// A state document brings it back (a retry, a schedule, a lock that will expire, another
    /// holder): the checkpoint may pass it, but it is not settled yet.
    Pending,
    /// Nothing is recorded (Cosmos kept failing until the range stopped): the checkpoint
    /// stays before it and the range's next reader delivers it again, as a redelivery.
    Unrecorded,
    /// Never started (the range stopped before its turn came, or the app never had it): the
    /// next reader delivers it as new.
    Unstarted,
}

/// A completion no lease write has recorded yet: what a write that lands reports.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Completion {
    pub(crate) id: String,
    pub(crate) key: MessageKey,
    pub(crate) enqueued_at: i64,
    pub(crate) expires_at: Option<i64>,
}

/// A page of the feed whose messages are not all settled yet.
#[derive(Debug)]
struct PageSlot {
    seq: u64,
    /// The position after this page: where reading resumes once it and all before it settle.
    token: Option<String>,
    /// Feed documents in the page (messages, malformed documents, and ones skipped as done).
    docs: u32,
    remaining: usize,
    /// A message whose fate could not be written: the checkpoint stays before this page, so
    /// the range's next reader delivers it again.
    unrecorded: bool,
    /// The lease write path's record of the page, by identity (see [`Window`]); empty on
    /// other paths.
    done: Vec<String>,
    pending: Vec<String>,
    unstarted: Vec<String>,
    started: Vec<String>,
    /// The page's last document (several once token-less pages are carried into this one).
    last: Vec<PageEnd>,
}

impl PageSlot {
    /// Takes `identity` out of whichever list of handed-out messages holds it.
    fn unlist(&mut self, identity: &str) {
        for list in [&mut self.started, &mut self.unstarted] {
            if let Some(i) = list.iter().position(|x| x == identity) {
                list.swap_remove(i);
                return;
            }
        }
    }
}

/// A page's last document, and the EPK sub-range of the feed the page was read from: the
/// continuation keeps one position per sub-range, so each keeps its own last document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PageEnd {
    pub(crate) marker: Marker,
    /// The document's effective partition key.
    pub(crate) epk: String,
    pub(crate) range: (String, String),
}

/// The pages of a range in flight, and the position that is safe to write.
#[derive(Debug)]
pub(crate) struct Checkpoint {
    window: VecDeque<PageSlot>,
    position: Option<String>,
    next_seq: u64,
    /// Keep the identities of what is handed out past the position (the lease write path
    /// writes them with the lease).
    track_ids: bool,
    /// Completions in the window that no lease write has recorded yet.
    unwritten: Vec<Completion>,
    /// The last document before the position in each sub-range, with its EPK; newest last.
    passed: Vec<(String, Marker)>,
    /// What the previous owner recorded past the position that this range has not read
    /// again yet: written on with every record until it is read, or known gone.
    inherited: Option<Inherited>,
}

impl Checkpoint {
    /// Starting at the lease's continuation.
    pub(crate) fn new(position: Option<String>) -> Self {
        Self {
            window: VecDeque::new(),
            position,
            next_seq: 0,
            track_ids: false,
            unwritten: Vec::new(),
            passed: Vec::new(),
            inherited: None,
        }
    }

    /// Knowing `markers` (with their EPKs) as the last documents before the starting position.
    pub(crate) fn after(mut self, markers: Vec<(String, Marker)>) -> Self {
        self.passed = markers;
        self
    }

    /// Keeping the identities of what is handed out past the position, for [`Self::record`].
    pub(crate) fn tracking_ids(mut self) -> Self {
        self.track_ids = true;
        self
    }

    /// With what the previous owner's window recorded (see [`Inherited`]).
    pub(crate) fn inheriting(mut self, inherited: Inherited) -> Self {
        self.inherited = Some(inherited);
        self
    }

    /// What the previous owner recorded and this range has not read again.
    pub(crate) fn inherited(&mut self) -> Option<&mut Inherited> {
        self.inherited.as_mut()
    }

    /// A page was read: `messages` of it are handed out, and `token` is the position after it.
    /// Returns the page's number, for [`Self::settle`].
    #[cfg(test)]
    pub(crate) fn read(&mut self, token: Option<String>, messages: usize) -> u64 {
        let handed: Vec<String> = (0..messages).map(|i| format!("#{i}")).collect();
        let seq = self.read_docs(token, messages as u32, &handed, None);
        for identity in &handed {
            self.start(seq, identity);
        }
        seq
    }

    /// [`Self::read`] of a page of `docs` feed documents; `handed` are the identities handed
    /// out for delivery, unstarted until [`Self::start`].
    pub(crate) fn read_docs(
        &mut self,
        token: Option<String>,
        docs: u32,
        handed: &[String],
        last: Option<PageEnd>,
    ) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        let unstarted = match self.track_ids {
            true => handed.to_vec(),
            false => Vec::new(),
        };
        self.window.push_back(PageSlot {
            seq,
            token,
            docs,
            remaining: handed.len(),
            unrecorded: false,
            done: Vec::new(),
            pending: Vec::new(),
            unstarted,
            started: Vec::new(),
            last: last.into_iter().collect(),
        });
        self.advance();
        seq
    }

    /// A message of page `seq` is done; `recorded` when its fate is written (settled, or left
    /// to a state document that brings it back).
    #[cfg(test)]
    pub(crate) fn settled(&mut self, seq: u64, recorded: bool) {
        let fate = if recorded {
            Fate::Pending
        } else {
            Fate::Unrecorded
        };
        self.settle(seq, "", fate, None);
    }

    /// Message `identity` of page `seq` came to `fate`; a completion names the message.
    pub(crate) fn settle(
        &mut self,
        seq: u64,
        identity: &str,
        fate: Fate,
        completion: Option<Completion>,
    ) {
        let track = self.track_ids;
        if let Some(slot) = self.window.iter_mut().find(|s| s.seq == seq) {
            slot.remaining = slot.remaining.saturating_sub(1);
            slot.unrecorded |= matches!(fate, Fate::Unrecorded | Fate::Unstarted);
            if track {
                slot.unlist(identity);
                Self::note(slot, identity, fate);
            }
            if fate == Fate::Completed {
                self.unwritten.extend(completion);
            }
        }
        self.advance();
    }

    /// A message of page `seq` handed out unstarted starts now (listed with the next write).
    pub(crate) fn start(&mut self, seq: u64, identity: &str) {
        if let Some(slot) = self.window.iter_mut().find(|s| s.seq == seq) {
            if let Some(i) = slot.unstarted.iter().position(|x| x == identity) {
                let identity = slot.unstarted.swap_remove(i);
                slot.started.push(identity);
            }
        }
    }

    /// A document of page `seq` that was not handed out, since the lease's window says it is
    /// `fate` already (done, or pending on its state document).
    pub(crate) fn known(&mut self, seq: u64, identity: &str, fate: Fate) {
        if let Some(slot) = self.window.iter_mut().find(|s| s.seq == seq) {
            Self::note(slot, identity, fate);
        }
    }

    fn note(slot: &mut PageSlot, identity: &str, fate: Fate) {
        match fate {
            Fate::Completed | Fate::Settled => slot.done.push(identity.to_owned()),
            Fate::Pending => slot.pending.push(identity.to_owned()),
            // Recorded as started: the app may have had it, its next reader redelivers it.
            Fate::Unrecorded => slot.started.push(identity.to_owned()),
            Fate::Unstarted => slot.unstarted.push(identity.to_owned()),
        }
    }

    /// The position that is safe to write now.
    pub(crate) fn position(&self) -> &Option<String> {
        &self.position
    }

    /// What is past the position, as a lease records it: this range's pages, then what it
    /// inherited and has not read again.
    pub(crate) fn record(&self) -> Window {
        let mut window = Window {
            v: WINDOW_IDENTITIES,
            after: self.passed.last().map(|(_, m)| m.clone()),
            after_each: match self.passed.len() {
                0 | 1 => Vec::new(),
                _ => self.passed.iter().map(|(_, m)| m.clone()).collect(),
            },
            ..Window::default()
        };
        for slot in &self.window {
            window.done.extend(slot.done.iter().cloned());
            window.pending.extend(slot.pending.iter().cloned());
            window.started.extend(slot.started.iter().cloned());
        }
        let unstarted: Vec<&String> = self.window.iter().flat_map(|s| &s.unstarted).collect();
        if !unstarted.is_empty() {
            let filter = IdentityFilter::of(unstarted.into_iter());
            window.maybe_unstarted.push(filter);
        }
        if let Some(inherited) = &self.inherited {
            inherited.carry_into(&mut window);
        }
        window
    }

    /// Whether a message handed out has not started yet.
    pub(crate) fn has_unstarted(&self) -> bool {
        self.window.iter().any(|slot| !slot.unstarted.is_empty())
    }

    /// Feed documents read past the position.
    pub(crate) fn window_docs(&self) -> u32 {
        self.window.iter().map(|s| s.docs).sum()
    }

    /// The completions no lease write has recorded yet, handed to the write that records
    /// them ([`Self::restore_unwritten`] if it does not land).
    pub(crate) fn take_unwritten(&mut self) -> Vec<Completion> {
        std::mem::take(&mut self.unwritten)
    }

    /// A lease write that was to record `completions` did not land: they are unwritten again.
    pub(crate) fn restore_unwritten(&mut self, mut completions: Vec<Completion>) {
        completions.append(&mut self.unwritten);
        self.unwritten = completions;
    }

    /// Whether the completion of message `id` waits for a lease write.
    pub(crate) fn is_unwritten(&self, id: &str) -> bool {
        self.unwritten.iter().any(|c| c.id == id)
    }

    /// Completions no lease write has recorded yet.
    pub(crate) fn unwritten_completions(&self) -> usize {
        self.unwritten.len()
    }

    /// A split child starts with its parent's markers, of both halves: one of the other half
    /// stands in for its own (see `host::Rewind`) until each of the position's sub-ranges has
    /// one of its own, then it goes.
    fn forget_foreign_markers(&mut self) {
        if self.passed.len() < 2 {
            return; // nothing stands in for another
        }
        let Some(ranges) = self
            .position
            .as_deref()
            .and_then(crate::range::continuation_ranges)
        else {
            return;
        };
        let within = |epk: &str| {
            ranges
                .iter()
                .any(|(lo, hi)| crate::range::epk_in(epk, lo, hi))
        };
        let covered = ranges.iter().all(|(lo, hi)| {
            self.passed
                .iter()
                .any(|(epk, _)| crate::range::epk_in(epk, lo, hi))
        });
        if covered {
            self.passed.retain(|(epk, _)| within(epk));
        }
    }

    /// Pops the settled pages at the front of the window; the position becomes the one after
    /// the last of them — never past a page with an unsettled or unrecorded message.
    fn advance(&mut self) {
        while self
            .window
            .front()
            .is_some_and(|s| s.remaining == 0 && !s.unrecorded)
        {
            if self.track_ids && self.window.front().is_some_and(|s| s.token.is_none()) {
                // No position after it: the next reader reads this page again, so what it
                // recorded moves on to the next page (or stays, when there is none yet).
                if self.window.len() == 1 {
                    break;
                }
                let slot = self.window.pop_front().expect("checked");
                let next = self.window.front_mut().expect("checked");
                next.docs += slot.docs;
                next.done.splice(0..0, slot.done);
                next.pending.splice(0..0, slot.pending);
                next.unstarted.splice(0..0, slot.unstarted);
                next.started.splice(0..0, slot.started);
                next.last.splice(0..0, slot.last);
                continue;
            }
            let slot = self.window.pop_front().expect("checked");
            if slot.token.is_some() {
                self.position = slot.token;
                for end in slot.last {
                    // The newer last document of its sub-range replaces what was before it.
                    let (lo, hi) = &end.range;
                    self.passed
                        .retain(|(epk, _)| !crate::range::epk_in(epk, lo, hi));
                    self.passed.push((end.epk, end.marker));
                }
                self.forget_foreign_markers();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(t: &str) -> Option<String> {
        Some(t.to_owned())
    }

    #[test]
    fn the_checkpoint_never_passes_an_unsettled_page() {
        let mut c = Checkpoint::new(token("start"));
        let p0 = c.read(token("t0"), 1);
        let p1 = c.read(token("t1"), 2);
        c.read(token("t2"), 0);
        assert_eq!(
            c.position(),
            &token("start"),
            "page 0 still has a message out"
        );
        c.settled(p1, true);
        c.settled(p1, true);
        assert_eq!(
            c.position(),
            &token("start"),
            "settled out of order: still held"
        );
        c.settled(p0, true);
        assert_eq!(
            c.position(),
            &token("t2"),
            "then past every settled page at once"
        );
    }

    #[test]
    fn the_checkpoint_never_passes_a_message_whose_fate_was_not_written() {
        let mut c = Checkpoint::new(token("start"));
        let p0 = c.read(token("t0"), 1);
        let p1 = c.read(token("t1"), 1);
        let p2 = c.read(token("t2"), 1);
        c.settled(p0, true);
        c.settled(p1, false);
        c.settled(p2, true);
        assert_eq!(
            c.position(),
            &token("t0"),
            "held at the unrecorded page for good"
        );
    }

    #[test]
    fn empty_pages_move_it_and_a_page_without_a_token_keeps_it() {
        let mut c = Checkpoint::new(None);
        c.read(token("t0"), 0);
        assert_eq!(c.position(), &token("t0"), "an empty page moves it at once");
        c.read(None, 0);
        assert_eq!(c.position(), &token("t0"), "no position after it: kept");
        let p = c.read(token("t2"), 1);
        c.settled(p + 7, true); // a page not in the window changes nothing
        assert_eq!(c.position(), &token("t0"));
    }

    fn handed(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|id| (*id).to_owned()).collect()
    }

    fn completion(id: &str) -> Option<Completion> {
        Some(Completion {
            id: id.into(),
            key: MessageKey::from("k"),
            enqueued_at: 0,
            expires_at: None,
        })
    }

    #[test]
    fn the_record_lists_what_was_handed_out_past_the_position_by_fate() {
        let mut c = Checkpoint::new(token("start")).tracking_ids();
        let p0 = c.read_docs(token("t0"), 3, &handed(&["a", "b"]), None);
        let p1 = c.read_docs(token("t1"), 3, &handed(&["c", "d", "e"]), None);
        for (page, identity) in [(p0, "a"), (p0, "b"), (p1, "c"), (p1, "d")] {
            c.start(page, identity);
        }
        c.known(p0, "skipped", Fate::Settled);
        c.settle(p0, "a", Fate::Completed, completion("a"));
        c.settle(p1, "c", Fate::Pending, None);
        c.settle(p1, "d", Fate::Unstarted, None);
        let record = c.record();
        assert_eq!(record.v, WINDOW_IDENTITIES);
        assert_eq!(record.read, 0, "no positions");
        assert_eq!(record.done, ["skipped", "a"]);
        assert_eq!(record.pending, ["c"]);
        assert_eq!(record.started, ["b"], "handed out, no outcome yet");
        let [unstarted] = &record.maybe_unstarted[..] else {
            panic!("one filter: {:?}", record.maybe_unstarted);
        };
        assert_eq!(unstarted.n, 2, "drained first, and waiting for its turn");
        assert!(unstarted.may_hold("d") && unstarted.may_hold("e"));
        assert!(record.unstarted.is_empty(), "lists are older versions'");
        c.start(p1, "e");
        assert_eq!(c.record().started, ["b", "e"], "its turn came");
        let written = c.take_unwritten();
        assert_eq!(written, vec![completion("a").unwrap()]);
        c.restore_unwritten(written);
        assert_eq!(c.unwritten_completions(), 1, "a write that did not land");
        c.settle(p0, "b", Fate::Completed, completion("b"));
        assert_eq!(c.position(), &token("t0"), "page 0 settled; page 1 holds");
        let record = c.record();
        assert!(record.done.is_empty(), "page 0 left the window");
        assert_eq!(
            record.maybe_unstarted[0].n, 1,
            "an unstarted message holds its page"
        );
        assert!(record.maybe_unstarted[0].may_hold("d"));
    }

    #[test]
    fn a_page_without_a_position_passes_its_record_on() {
        let mut c = Checkpoint::new(token("start")).tracking_ids();
        let p0 = c.read_docs(None, 1, &handed(&["a"]), None);
        c.settle(p0, "a", Fate::Completed, None);
        assert_eq!(c.record().done, ["a"], "kept: nothing after it yet");
        let p1 = c.read_docs(token("t1"), 1, &handed(&["b"]), None);
        c.start(p1, "b");
        assert_eq!(c.record().done, ["a"]);
        assert_eq!(c.record().started, ["b"]);
        c.settle(p1, "b", Fate::Completed, None);
        assert_eq!(c.position(), &token("t1"));
        assert!(c.record().is_empty());
    }

    fn end(id: &str, epk: &str, range: (&str, &str)) -> PageEnd {
        PageEnd {
            marker: Marker {
                id: id.into(),
                pk: serde_json::json!(id),
            },
            epk: epk.into(),
            range: (range.0.into(), range.1.into()),
        }
    }

    #[test]
    fn each_sub_range_keeps_its_own_last_document() {
        let left = ("", "40");
        let right = ("40", "80");
        let mut c = Checkpoint::new(token("start")).tracking_ids();
        let p0 = c.read_docs(token("t0"), 1, &handed(&["a"]), Some(end("a", "10", left)));
        let p1 = c.read_docs(token("t1"), 1, &handed(&["b"]), Some(end("b", "50", right)));
        // A page without a position carries its last document into the next page.
        let p2 = c.read_docs(None, 1, &handed(&["c"]), Some(end("c", "20", left)));
        let p3 = c.read_docs(token("t3"), 1, &handed(&["d"]), Some(end("d", "60", right)));
        for (p, id) in [(p0, "a"), (p1, "b"), (p2, "c"), (p3, "d")] {
            c.settle(p, id, Fate::Completed, None);
        }
        let record = c.record();
        assert_eq!(
            record.after.map(|m| m.id).as_deref(),
            Some("d"),
            "the newest, for older readers"
        );
        let each: Vec<String> = record.after_each.into_iter().map(|m| m.id).collect();
        assert_eq!(
            each,
            ["c", "d"],
            "one per sub-range, the newer replacing the older"
        );
        // One sub-range only: `after` says it all.
        let mut c =
            Checkpoint::new(token("start")).after(vec![("10".into(), end("a", "10", left).marker)]);
        c.read_docs(token("t0"), 0, &[], Some(end("b", "20", left)));
        let record = c.record();
        assert_eq!(record.after.map(|m| m.id).as_deref(), Some("b"));
        assert!(record.after_each.is_empty());
    }

    fn split_token(ranges: &[(&str, &str)]) -> Option<String> {
        use base64::Engine as _;
        let active: Vec<serde_json::Value> = ranges
            .iter()
            .map(|(lo, hi)| serde_json::json!({"min_epk": lo, "max_epk": hi, "server_continuation": "x"}))
            .collect();
        let state = serde_json::json!({"root": {"active_tokens": active}});
        Some(format!(
            "c1.{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .encode(serde_json::to_vec(&state).unwrap())
        ))
    }

    #[test]
    fn a_split_childs_parent_marker_stands_in_until_it_has_its_own() {
        let child = ("", "40");
        let foreign = end("other-half", "50", ("40", "80"));
        let mut c = Checkpoint::new(split_token(&[child]))
            .tracking_ids()
            .after(vec![(foreign.epk.clone(), foreign.marker.clone())]);
        c.read_docs(split_token(&[child]), 0, &[], None);
        assert_eq!(
            c.record().after,
            Some(foreign.marker.clone()),
            "kept while the child has none of its own"
        );
        let p = c.read_docs(
            split_token(&[child]),
            1,
            &handed(&["mine"]),
            Some(end("mine", "10", child)),
        );
        c.settle(p, "mine", Fate::Completed, None);
        let record = c.record();
        assert_eq!(record.after.map(|m| m.id).as_deref(), Some("mine"));
        assert!(
            record.after_each.is_empty(),
            "the parent's went: {:?}",
            record.after_each
        );
    }
}
