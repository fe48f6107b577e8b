//! A range's checkpoint: the position its next reader resumes from, never past a message
//! whose fate is not written. Pages are settled out of order (one slow message must not stall
//! the range), so the checkpoint is the position after the longest run of settled pages at the
//! front of the window; the window is bounded by the range's in-flight limit. Pure.

use std::collections::VecDeque;

use crate::lease::{Marker, Window};

/// What became of one message of a page, as the checkpoint counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Settle {
    /// Completed with nothing written yet: the next lease write records it, and it is
    /// counted as completed only once that write landed.
    Completed,
    /// Settled by a state document (dead-lettered, or settled before this read).
    Done,
    /// A state document brings it back (a retry, a schedule, work under its own lock).
    Pending,
    /// Nothing could be recorded: the checkpoint stays before it and the next reader
    /// delivers it again, as a redelivery.
    Unrecorded,
    /// Never started (the range drained first): the next reader delivers it as new.
    Unstarted,
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
    /// The lease write path's record of the page (see [`Window`]); empty on other paths.
    done: Vec<String>,
    pending: Vec<String>,
    unstarted: Vec<String>,
    /// The page's last document.
    last: Option<Marker>,
}

/// The pages of a range in flight, and the position that is safe to write.
#[derive(Debug)]
pub(crate) struct Checkpoint {
    window: VecDeque<PageSlot>,
    position: Option<String>,
    next_seq: u64,
    /// Keep the ids of settled messages (the lease write path writes them with the lease).
    track_ids: bool,
    /// Completions in the window that no lease write has recorded yet.
    unwritten_completions: u64,
    /// The last document before the position.
    passed: Option<Marker>,
}

impl Checkpoint {
    /// Starting at the lease's continuation.
    pub(crate) fn new(position: Option<String>) -> Self {
        Self {
            window: VecDeque::new(),
            position,
            next_seq: 0,
            track_ids: false,
            unwritten_completions: 0,
            passed: None,
        }
    }

    /// Knowing `marker` as the last document before the starting position.
    pub(crate) fn after(mut self, marker: Option<Marker>) -> Self {
        self.passed = marker;
        self
    }

    /// Keeping the ids of what settles past the position, for [`Self::record`].
    pub(crate) fn tracking_ids(mut self) -> Self {
        self.track_ids = true;
        self
    }

    /// A page was read: `messages` of it are handed out, and `token` is the position after it.
    /// Returns the page's number, for [`Self::settled`].
    #[cfg(test)]
    pub(crate) fn read(&mut self, token: Option<String>, messages: usize) -> u64 {
        self.read_docs(token, messages as u32, messages, None)
    }

    /// [`Self::read`] of a page of `docs` feed documents, `messages` of which are handed out.
    pub(crate) fn read_docs(
        &mut self,
        token: Option<String>,
        docs: u32,
        messages: usize,
        last: Option<Marker>,
    ) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.window.push_back(PageSlot {
            seq,
            token,
            docs,
            remaining: messages,
            unrecorded: false,
            done: Vec::new(),
            pending: Vec::new(),
            unstarted: Vec::new(),
            last,
        });
        self.advance();
        seq
    }

    /// A message of page `seq` is done; `recorded` when its fate is written (settled, or left
    /// to a state document that brings it back).
    #[cfg(test)]
    pub(crate) fn settled(&mut self, seq: u64, recorded: bool) {
        let fate = if recorded {
            Settle::Pending
        } else {
            Settle::Unrecorded
        };
        self.settle(seq, "", fate);
    }

    /// Message `id` of page `seq` came to `fate`.
    pub(crate) fn settle(&mut self, seq: u64, id: &str, fate: Settle) {
        let track = self.track_ids;
        if let Some(slot) = self.window.iter_mut().find(|s| s.seq == seq) {
            slot.remaining = slot.remaining.saturating_sub(1);
            slot.unrecorded |= matches!(fate, Settle::Unrecorded | Settle::Unstarted);
            if track {
                Self::note(slot, id, fate);
            }
            if fate == Settle::Completed {
                self.unwritten_completions += 1;
            }
        }
        self.advance();
    }

    /// A document of page `seq` that was not handed out, since the lease's window says it is
    /// `fate` already (done, or pending on its state document).
    pub(crate) fn known(&mut self, seq: u64, id: &str, fate: Settle) {
        if let Some(slot) = self.window.iter_mut().find(|s| s.seq == seq) {
            Self::note(slot, id, fate);
        }
    }

    fn note(slot: &mut PageSlot, id: &str, fate: Settle) {
        match fate {
            Settle::Completed | Settle::Done => slot.done.push(id.to_owned()),
            Settle::Pending => slot.pending.push(id.to_owned()),
            Settle::Unstarted => slot.unstarted.push(id.to_owned()),
            Settle::Unrecorded => {}
        }
    }

    /// The position that is safe to write now.
    pub(crate) fn position(&self) -> &Option<String> {
        &self.position
    }

    /// What is past the position, as a lease records it.
    pub(crate) fn record(&self) -> Window {
        let mut window = Window {
            after: self.passed.clone(),
            ..Window::default()
        };
        for slot in &self.window {
            window.read += slot.docs;
            window.done.extend(slot.done.iter().cloned());
            window.pending.extend(slot.pending.iter().cloned());
            window.unstarted.extend(slot.unstarted.iter().cloned());
        }
        window
    }

    /// Feed documents read past the position.
    pub(crate) fn window_docs(&self) -> u32 {
        self.window.iter().map(|s| s.docs).sum()
    }

    /// Completions no lease write has recorded yet.
    pub(crate) fn unwritten_completions(&self) -> u64 {
        self.unwritten_completions
    }

    /// A lease write that was to record `n` completions did not land: they are unwritten again.
    pub(crate) fn completions_unwritten(&mut self, n: u64) {
        self.unwritten_completions += n;
    }

    /// A lease write recorded `n` of the completions (those counted before it started).
    pub(crate) fn completions_written(&mut self, n: u64) {
        self.unwritten_completions = self.unwritten_completions.saturating_sub(n);
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
                if next.last.is_none() {
                    next.last = slot.last;
                }
                continue;
            }
            let slot = self.window.pop_front().expect("checked");
            if slot.token.is_some() {
                self.position = slot.token;
                if slot.last.is_some() {
                    self.passed = slot.last;
                }
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

    #[test]
    fn the_record_lists_what_settled_past_the_position() {
        let mut c = Checkpoint::new(token("start")).tracking_ids();
        let p0 = c.read_docs(token("t0"), 3, 2, None);
        let p1 = c.read_docs(token("t1"), 2, 2, None);
        c.known(p0, "skipped", Settle::Done);
        c.settle(p0, "a", Settle::Completed);
        c.settle(p1, "c", Settle::Pending);
        c.settle(p1, "d", Settle::Unstarted);
        let record = c.record();
        assert_eq!(record.read, 5, "every document read past the position");
        assert_eq!(record.done, ["skipped", "a"]);
        assert_eq!(record.pending, ["c"]);
        assert_eq!(record.unstarted, ["d"]);
        assert_eq!(c.unwritten_completions(), 1);
        c.completions_written(1);
        assert_eq!(c.unwritten_completions(), 0);
        c.settle(p0, "b", Settle::Completed);
        assert_eq!(c.position(), &token("t0"), "page 0 settled; page 1 holds");
        let record = c.record();
        assert_eq!(record.read, 2, "page 0 left the window");
        assert!(record.done.is_empty());
        assert_eq!(
            record.unstarted,
            ["d"],
            "an unstarted message holds its page"
        );
    }

    #[test]
    fn a_page_without_a_position_passes_its_record_on() {
        let mut c = Checkpoint::new(token("start")).tracking_ids();
        let p0 = c.read_docs(None, 1, 1, None);
        c.settle(p0, "a", Settle::Completed);
        assert_eq!(c.record().done, ["a"], "kept: nothing after it yet");
        let p1 = c.read_docs(token("t1"), 1, 1, None);
        assert_eq!(c.record().done, ["a"]);
        assert_eq!(c.record().read, 2);
        c.settle(p1, "b", Settle::Completed);
        assert_eq!(c.position(), &token("t1"));
        assert!(c.record().is_empty());
    }
}
