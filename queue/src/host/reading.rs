//! What a range's processing keeps while its lease is held: the feed reader, the window of
//! what was handed out, and rewinds of the feed.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::{debug, info};

use crate::buggify::{self, Bug};
use crate::checkpoint::{Checkpoint, Completion, Fate};
use crate::clock::duration_ms;
use crate::cosmos::feed::FeedReader;
use crate::lease::{Lease, Marker};

use super::order::{KeyState, Report, StartRequest, Stops};
use super::poll::AdaptivePoll;
use super::probe::{Resting, Wake};
use super::replay_guard::Seen;
use super::HostOptions;

/// What one range's processing keeps while its lease is held.
pub(super) struct Reading {
    pub(super) lease: Lease,
    pub(super) reader: FeedReader,
    /// Its partition's probe, which wakes it while it is resting (see `probe`).
    pub(super) wake: Option<Wake>,
    /// When it last looked for its partition's probe.
    pub(super) joined_at: Instant,
    /// Held while it is resting: its next read waits for the probe, or `idle_read`.
    pub(super) resting: Option<Resting>,
    /// Deliveries report here.
    pub(super) done_tx: mpsc::UnboundedSender<Report>,
    pub(super) done_rx: mpsc::UnboundedReceiver<Report>,
    /// Waiting deliveries ask to start here (the lease write path).
    pub(super) start_tx: mpsc::UnboundedSender<StartRequest>,
    pub(super) start_rx: mpsc::UnboundedReceiver<StartRequest>,
    pub(super) deliveries: JoinSet<()>,
    pub(super) stops: Stops,
    pub(super) checkpoint: Checkpoint,
    pub(super) in_flight: usize,
    pub(super) poll: AdaptivePoll,
    /// When the next read is due: fixed once the last read's back-off is known, so the other
    /// events of the loop (settlements, renewals, flushes) do not push it back.
    pub(super) read_at: Option<Instant>,
    /// Still reading the feed (not draining or handing over).
    pub(super) reading: bool,
    /// Ordered groups: where each key's last message stands, which its next message waits for.
    pub(super) chains: HashMap<String, watch::Receiver<KeyState>>,
    /// Ordered groups: the messages of each key that the range's previous owners left
    /// unsettled (behind the checkpoint); the key's next message read here waits for them.
    pub(super) held_back: BTreeMap<String, Vec<String>>,
    /// Messages read so far; the first window after taking a range is checked for state the
    /// previous owner left (see `RangeDelivery::path`).
    pub(super) read: usize,
    /// The last delivery's "got a permit" signal (unordered groups).
    pub(super) in_feed_order: Option<oneshot::Receiver<()>>,
    /// Exclusive groups: the lease records the window.
    pub(super) windowed: bool,
    /// The window changed since the lease was last written.
    pub(super) unwritten: bool,
    /// When the lease was last known to be this range's version: a write of it that landed
    /// was sent, or a check found it unchanged.
    pub(super) checked_at: Instant,
    /// When the lease is next renewed (or checked, when it rides on the heartbeat).
    pub(super) renew_at: Instant,
    /// Until when the lease is surely this range's: its last write plus the expiry other
    /// hosts judge that version by, minus a margin. Past it nothing starts, and first
    /// deliveries whose lock is the lease are cut.
    pub(super) held: std::sync::Arc<super::ordered_watch::Sender<Instant>>,
    /// The lease write path: where each sub-range of the feed was read up to (see [`SubFeed`]).
    pub(super) rewind: Option<Rewind>,
    /// The lease write path: identities this processor has read, newest last (bounded): a
    /// feed that serves earlier documents again mid-read (the emulator renumbers LSNs when
    /// partitions merge) must not deliver again what this range completed with nothing but
    /// its lease.
    pub(super) seen: Option<Seen>,
}

/// The lease write path's guard against a feed that serves again what was read before, with
/// no state document to say it was completed: the emulator renumbers LSNs when partitions
/// merge, so a position taken before the merge reads from elsewhere after it. One entry per
/// EPK sub-range the continuation keeps a position for (a range that spanned a split has
/// several, each read on its own, from its own partition).
#[derive(Debug, Default)]
pub(super) struct Rewind {
    pub(super) feeds: Vec<SubFeed>,
}

#[derive(Debug)]
pub(super) struct SubFeed {
    pub(super) range: (String, String),
    /// The last document read, with its EPK (before this processor read any: the lease's).
    pub(super) last: Option<(String, Marker)>,
    /// The partition that served the last page: a change (a split or a merge) arms `seek`.
    pub(super) partition: Option<String>,
    /// The next page is checked against this (see `RangeProcessor::past_marker`).
    pub(super) seek: Option<Seek>,
}

/// Checking pages against the last document read before.
#[derive(Debug)]
pub(super) struct Seek {
    pub(super) marker: Marker,
    pub(super) epk: String,
    /// The marker's LSN and partition, once read (the pages are compared with it).
    pub(super) position: Option<Option<(u64, Option<String>)>>,
    /// Pages came that were all before the marker: skipping until it.
    pub(super) seeking: bool,
}

impl Seek {
    pub(super) fn new((epk, marker): (String, Marker)) -> Self {
        Seek {
            marker,
            epk,
            position: None,
            seeking: false,
        }
    }
}

impl Rewind {
    /// What the range starts from: for each sub-range of the continuation, the lease's
    /// newest marker in it, checked on the sub-range's first page. A sub-range without one (a
    /// split child whose parent last read the other half) is checked against the newest
    /// marker of all: by LSN, which compares while both are in one partition.
    pub(super) fn start(markers: &[(String, Marker)], ranges: &[(String, String)]) -> Self {
        let feeds = ranges
            .iter()
            .filter_map(|(lo, hi)| {
                let own = markers
                    .iter()
                    .rev()
                    .find(|(epk, _)| crate::range::epk_in(epk, lo, hi));
                let marker = own.or(markers.last())?.clone();
                Some(SubFeed {
                    range: (lo.clone(), hi.clone()),
                    last: Some(marker.clone()),
                    partition: None,
                    seek: Some(Seek::new(marker)),
                })
            })
            .collect();
        Rewind { feeds }
    }

    /// The entry of sub-range `range`; a new one (the range split since) inherits what the
    /// narrowest entry holding it knew.
    pub(super) fn feed(&mut self, range: &(String, String)) -> &mut SubFeed {
        if let Some(i) = self.feeds.iter().position(|f| &f.range == range) {
            return &mut self.feeds[i];
        }
        let parent = self
            .feeds
            .iter()
            .filter(|f| crate::range::epk_in(&range.0, &f.range.0, &f.range.1))
            .max_by(|a, b| crate::range::epk_cmp(&a.range.0, &b.range.0));
        let feed = SubFeed {
            range: range.clone(),
            last: parent.and_then(|p| p.last.clone()),
            partition: parent.and_then(|p| p.partition.clone()),
            seek: parent
                .and_then(|p| p.seek.as_ref())
                .map(|s| Seek::new((s.epk.clone(), s.marker.clone()))),
        };
        self.feeds.push(feed);
        self.feeds.last_mut().expect("pushed")
    }
}

impl Reading {
    /// Nothing in flight and nothing more to read: the range is drained.
    pub(super) fn drained(&self) -> bool {
        self.in_flight == 0 && !self.reading
    }

    pub(super) fn checkpoint_due(&self) -> bool {
        self.unwritten || self.checkpoint.position() != &self.lease.continuation
    }

    /// Stop reading; long work stops holding the range; let what is under way settle.
    pub(super) fn stop_reading(&mut self) {
        self.reading = false;
        self.resting = None;
        self.stops.give_up.cancel();
        self.stops.draining.cancel();
        self.stops.promote_now.cancel();
    }

    /// The host stops.
    pub(super) fn drain(&mut self) {
        self.stop_reading();
        debug!(in_flight = self.in_flight, "draining range");
    }

    pub(super) fn delivered(&mut self, report: Report) {
        while self.deliveries.try_join_next().is_some() {}
        self.in_flight -= 1;
        let completion = (report.fate == Fate::Completed).then_some(Completion {
            id: report.id,
            key: report.key,
            enqueued_at: report.enqueued_at,
            expires_at: report.expires_at,
        });
        // Nothing recorded and the app never had it: the next reader delivers it as new. One
        // the previous holder listed started stays listed so, though this range never started
        // it (it waited for a permit when the range was handed over): the app may have it from
        // that holder, and its next reader delivers it again with the next count.
        let recovered = report.recovered && !buggify::on(Bug::InheritedStartHandedOver);
        let fate = match (report.fate, report.reached || recovered) {
            (Fate::Unrecorded | Fate::Unstarted, true) if recovered => Fate::Unrecorded,
            (Fate::Unrecorded, false) => Fate::Unstarted,
            (fate, _) => fate,
        };
        self.checkpoint
            .settle(report.seq, &report.identity, fate, completion);
        self.unwritten |= self.windowed;
    }

    /// Another host asked for the range: stop reading, let what is under way settle, then the
    /// drain checkpoints and releases it (the release keeps the reservation).
    pub(super) fn hand_over(&mut self, current: Lease) {
        self.lease = current;
        if self.reading {
            info!(
                to = self.lease.handover_to.as_deref().unwrap_or_default(),
                "handing the range over: draining, then checkpoint and release"
            );
            self.stop_reading();
        }
    }

    /// The range's record landed as `lease` (sent at `sent`).
    pub(super) fn recorded(&mut self, lease: Lease, sent: Instant, options: &HostOptions) {
        self.lease = lease;
        self.unwritten = false;
        self.written(sent, options);
    }

    /// A lease write that landed was sent at `sent`: the lease is surely this range's until
    /// the expiry others judge this version by (minus a margin), and is renewed well before.
    pub(super) fn written(&mut self, sent: Instant, options: &HostOptions) {
        let expiry = self
            .lease
            .unchanged_expiry_ms(duration_ms(options.lease_expire))
            .max(1) as u64;
        let expiry = Duration::from_millis(expiry);
        self.checked_at = sent;
        self.renew_at = sent + options.lease_renew.min(expiry / 3);
        self.held.send_replace(sent + expiry - expiry / 10);
        // A hand-over request may have come between this range's writes (one retried on the
        // lease as it now is carries the request on): noticed whichever write shows it.
        if self.reading && self.lease.handover_to.is_some() {
            let current = self.lease.clone();
            self.hand_over(current);
        }
    }
}

/// The EPK sub-ranges `token` keeps a position for; `whole` alone when it does not say.
pub(super) fn continuation_ranges(
    token: &Option<String>,
    whole: &(String, String),
) -> Vec<(String, String)> {
    token
        .as_deref()
        .and_then(crate::range::continuation_ranges)
        .filter(|ranges| !ranges.is_empty())
        .unwrap_or_else(|| vec![whole.clone()])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn marker(epk: &str, id: &str) -> (String, Marker) {
        let pk = serde_json::json!(id);
        let id = id.to_owned();
        (epk.to_owned(), Marker { id, pk })
    }

    fn range(lo: &str, hi: &str) -> (String, String) {
        (lo.to_owned(), hi.to_owned())
    }

    /// What each sub-range checks its first page against after a take-over: the newest marker
    /// in it, else the newest of all.
    #[test]
    fn a_rewind_starts_each_sub_range_from_its_own_newest_marker() {
        // (the lease's markers, newest last; the continuation's sub-ranges) → the marker
        // each sub-range's first page is checked against.
        let table = [
            (
                vec![marker("10", "a"), marker("20", "b")],
                vec![range("", "FF")],
                vec![Some("b")],
            ),
            // A split: each half its own newest.
            (
                vec![marker("10", "x"), marker("90", "y"), marker("20", "z")],
                vec![range("", "80"), range("80", "FF")],
                vec![Some("z"), Some("y")],
            ),
            // A half its parent never read in: the newest of all (compared by LSN).
            (
                vec![marker("10", "x")],
                vec![range("", "80"), range("80", "FF")],
                vec![Some("x"), Some("x")],
            ),
            // EPKs compare without regard to case.
            (
                vec![marker("9a", "lower"), marker("10", "other")],
                vec![range("80", "FF")],
                vec![Some("lower")],
            ),
            // A lease that never read anything: nothing to check.
            (vec![], vec![range("", "FF")], vec![]),
        ];
        for (markers, ranges, expected) in table {
            let rewind = Rewind::start(&markers, &ranges);
            let checked: Vec<Option<&str>> = rewind
                .feeds
                .iter()
                .map(|f| f.seek.as_ref().map(|s| s.marker.id.as_str()))
                .collect();
            assert_eq!(checked, expected, "{markers:?} over {ranges:?}");
            for feed in &rewind.feeds {
                assert_eq!(
                    feed.last.as_ref().map(|(_, m)| &m.id),
                    feed.seek.as_ref().map(|s| &s.marker.id),
                    "the last document read is the marker checked"
                );
            }
        }
    }

    /// A sub-range met mid-read (the range split since the rewind started) inherits what the
    /// narrowest entry holding it knew; a known one is itself.
    #[test]
    fn a_sub_range_met_later_inherits_from_the_narrowest_entry_holding_it() {
        let mut rewind = Rewind::start(
            &[marker("10", "left"), marker("90", "right")],
            &[range("", "80"), range("80", "FF")],
        );
        // (the sub-range met, the marker it is checked against, entries after)
        let table = [
            (range("80", "FF"), Some("right"), 2),
            (range("C0", "FF"), Some("right"), 3),
            (range("", "40"), Some("left"), 4),
            // Nested: "C0".."E0" lies in both "80".."FF" and "C0".."FF"; the narrower wins
            // (they agree here, as they do whenever the wider one has not read since).
            (range("C0", "E0"), Some("right"), 5),
        ];
        for (met, expected, entries) in table {
            let feed = rewind.feed(&met);
            assert_eq!(
                feed.seek.as_ref().map(|s| s.marker.id.as_str()),
                expected,
                "{met:?}"
            );
            assert_eq!(rewind.feeds.len(), entries, "{met:?}");
        }
        // What the narrowest knows wins: "C0".."E0" read on since, "D0".."D8" learns that.
        let narrow = rewind.feed(&range("C0", "E0"));
        narrow.last = Some(marker("D5", "newer"));
        narrow.seek = Some(Seek::new(marker("D5", "newer")));
        let nested = rewind.feed(&range("D0", "D8"));
        assert_eq!(
            nested.seek.as_ref().map(|s| s.marker.id.as_str()),
            Some("newer")
        );
        assert_eq!(
            nested.last.as_ref().map(|(_, m)| m.id.as_str()),
            Some("newer")
        );
    }
}
