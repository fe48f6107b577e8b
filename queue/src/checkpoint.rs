//! A range's checkpoint: the position its next reader resumes from, never past a message
//! whose fate is not written. Pages are settled out of order (one slow message must not stall
//! the range), so the checkpoint is the position after the longest run of settled pages at the
//! front of the window; the window is bounded by the range's in-flight limit. Pure.

use std::collections::VecDeque;

/// A page of the feed whose messages are not all settled yet.
#[derive(Debug)]
struct PageSlot {
    seq: u64,
    /// The position after this page: where reading resumes once it and all before it settle.
    token: Option<String>,
    remaining: usize,
    /// A message whose fate could not be written: the checkpoint stays before this page, so
    /// the range's next reader delivers it again.
    unrecorded: bool,
}

/// The pages of a range in flight, and the position that is safe to write.
#[derive(Debug)]
pub(crate) struct Checkpoint {
    window: VecDeque<PageSlot>,
    position: Option<String>,
    next_seq: u64,
}

impl Checkpoint {
    /// Starting at the lease's continuation.
    pub(crate) fn new(position: Option<String>) -> Self {
        Self {
            window: VecDeque::new(),
            position,
            next_seq: 0,
        }
    }

    /// A page was read: `messages` of it are handed out, and `token` is the position after it.
    /// Returns the page's number, for [`Self::settled`].
    pub(crate) fn read(&mut self, token: Option<String>, messages: usize) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.window.push_back(PageSlot {
            seq,
            token,
            remaining: messages,
            unrecorded: false,
        });
        self.advance();
        seq
    }

    /// A message of page `seq` is done; `recorded` when its fate is written (settled, or left
    /// to a state document that brings it back).
    pub(crate) fn settled(&mut self, seq: u64, recorded: bool) {
        if let Some(slot) = self.window.iter_mut().find(|s| s.seq == seq) {
            slot.remaining = slot.remaining.saturating_sub(1);
            slot.unrecorded |= !recorded;
        }
        self.advance();
    }

    /// The position that is safe to write now.
    pub(crate) fn position(&self) -> &Option<String> {
        &self.position
    }

    /// Pops the settled pages at the front of the window; the position becomes the one after
    /// the last of them — never past a page with an unsettled or unrecorded message.
    fn advance(&mut self) {
        while self
            .window
            .front()
            .is_some_and(|s| s.remaining == 0 && !s.unrecorded)
        {
            let slot = self.window.pop_front().expect("checked");
            if slot.token.is_some() {
                self.position = slot.token;
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
}
