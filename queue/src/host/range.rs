//! One leased range: reading it from its checkpoint, handing messages out, keeping the lease
//! (renewals, checkpoints, hand-over, release).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use azure_data_cosmos::FeedScope;
use tokio::sync::{mpsc, oneshot, watch, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, instrument, warn};

use crate::buggify::{self, Bug};
use crate::checkpoint::{Checkpoint, Completion, Fate, PageEnd};
use crate::config::DeliveryMode;
use crate::cosmos::feed::FeedReader;
use crate::error::Result;
use crate::group::Group;
use crate::handler::{ConsumerStats, Handler, LockedUntil};
use crate::host::deliver::{Deliverer, LeaseLock, Promotion, Route};
use crate::host::recovery::{Handling, Inherited};
use crate::lease::{Lease, LeaseError, LeaseStore, Marker};
use crate::message::{Message, MessageKey};

use super::order::{
    abandon, forget_settled_keys, KeyState, RangeDelivery, Report, StartAsk, StartRequest, Stops,
    Turn,
};
use super::poll::AdaptivePoll;
use super::probe::{Probes, Wake};
use super::reading::{continuation_ranges, Reading, Rewind, Seek, SubFeed};
use super::replay_guard::Seen;
use super::{
    Beaten, HostOptions, Leftovers, Listed, RangeExit, LEASE_READ_TRIES, LOST_AGAIN,
    MAX_IDLE_CHAINS, RELEASE_TRIES,
};

/// Reads one leased range and keeps its lease: renewals, checkpoints, release.
pub(super) struct RangeProcessor<H> {
    pub(super) store: LeaseStore,
    pub(super) group: Group,
    pub(super) deliverer: Arc<Deliverer<H>>,
    pub(super) permits: Arc<Semaphore>,
    pub(super) options: HostOptions,
    pub(super) stats: Arc<ConsumerStats>,
    /// Every delivery, including those a lost range leaves to finish under their own claims:
    /// the host waits for them before it returns, or the process would exit mid-settle.
    pub(super) deliveries: TaskTracker,
    /// Where those go when the range ends.
    pub(super) leftovers: Leftovers,
    /// This host's last heartbeat that landed (see [`crate::lease::Beat`]).
    pub(super) beat: watch::Receiver<Option<Beaten>>,
    /// The host's last listing of the leases.
    pub(super) listed: watch::Receiver<Option<Listed>>,
    /// Its deadline, which the host watches (see [`Reading::held`]).
    pub(super) held: Arc<super::ordered_watch::Sender<Instant>>,
    /// Where the range rests once idle (see `probe`).
    pub(super) probes: Option<Probes>,
}

/// What a step of a range's loop leaves it with: go on, or stop with this exit (the lease is
/// gone: what waits steps aside, what is under way finishes under its own claims).
pub(super) type Step = Option<RangeExit>;

/// A message read from the feed, ready to be handed out.
pub(super) struct Handed {
    pub(super) message: Message,
    pub(super) identity: String,
    pub(super) path: Route,
    /// The previous owner may have started it without listing it ([`Handling::Unsure`]).
    pub(super) unsure: bool,
}

impl<H: Handler> RangeProcessor<H> {
    pub(super) fn now(&self) -> i64 {
        self.group.queue().clock().now_ms()
    }

    /// Whether starts are listed on the lease (the lease write path): each delivery asks its
    /// range to start (see [`StartRequest`]).
    pub(super) fn records_starts(&self) -> bool {
        self.group.config().lease_recorded()
    }

    #[instrument(skip_all, fields(group = %lease.group, lease = %lease.range_label()))]
    pub(super) async fn run(
        self,
        lease: Lease,
        acquired: Instant,
        stop: CancellationToken,
    ) -> RangeExit {
        let mut r = match self.start(lease, acquired).await {
            Ok(r) => r,
            Err(e) => return RangeExit::Failed(e),
        };
        let mut flush = tokio::time::interval(self.options.checkpoint_interval);
        while !r.drained() {
            let delay = r.poll.delay();
            let idle = r.reading && delay >= self.options.max_poll;
            // Idle without a probe (its partition split, or none could be found): it looks
            // for the one of the partition it now lies in, once an `idleRead` at most.
            if idle
                && r.read_at.is_none()
                && self.probes.is_some()
                && r.wake.as_ref().is_none_or(Wake::ended)
                && r.joined_at.elapsed() >= self.options.idle_read
            {
                r.wake = self.join_probe(&r.lease).await;
                r.joined_at = Instant::now();
            }
            let read_at = *r.read_at.get_or_insert_with(|| {
                // Idle: the partition's probe wakes it, its own read only backs that up.
                match &r.wake {
                    Some(wake) if idle && wake.shared() => {
                        r.resting = Some(wake.rest());
                        Instant::now() + self.options.idle_read
                    }
                    _ => Instant::now() + delay,
                }
            });
            let held = *r.held.borrow();
            let step = tokio::select! {
                biased;
                _ = stop.cancelled(), if r.reading => {
                    r.drain();
                    None
                }
                Some(report) = r.done_rx.recv() => {
                    r.delivered(report);
                    None
                }
                Some(request) = r.start_rx.recv() => self.grant(&mut r, request).await,
                _ = tokio::time::sleep_until(held), if !buggify::on(Bug::StartUnderExpiredLease) => {
                    warn!(owner = %self.options.holder(), in_flight = r.in_flight, "the lease could not be renewed in time; stopped reading the range");
                    Some(RangeExit::Lost)
                }
                _ = tokio::time::sleep_until(r.renew_at) => self.renew(&mut r).await,
                _ = flush.tick(), if r.checkpoint_due() => self.flush(&mut r).await,
                // The range's last message read got its permit: reading may go on.
                _ = async { r.in_feed_order.as_mut().expect("checked").await }, if r.in_feed_order.is_some() => {
                    r.in_feed_order = None;
                    None
                }
                _ = async { r.wake.as_mut().expect("resting").changed().await }, if r.resting.is_some() => {
                    r.resting = None;
                    r.read_at = Some(Instant::now());
                    None
                }
                _ = tokio::time::sleep_until(read_at), if r.reading && self.room(&r) => {
                    r.read_at = None;
                    r.resting = None;
                    if let Some(wake) = &mut r.wake {
                        wake.seen();
                    }
                    self.read_page(&mut r).await
                }
            };
            if let Some(exit) = step {
                abandon(&r.stops, &mut r.deliveries, &self.leftovers);
                // Completions no lease write recorded (they came while a failing write was
                // retried, or the lease was found lost): kept as state documents, as
                // `write_record` keeps its own.
                while let Ok(report) = r.done_rx.try_recv() {
                    r.delivered(report);
                }
                let left = r.checkpoint.take_unwritten();
                if r.windowed && !left.is_empty() {
                    self.complete_by_documents(left).await;
                }
                return exit;
            }
        }
        self.finish(r).await
    }

    /// Whether the range may read another page: fewer messages in flight than its limit,
    /// (exclusive groups) a window small enough to write with the lease, and, once the range
    /// has caught up with its feed, each message it read has its permit (see [`read_wanted`]).
    pub(super) fn room(&self, r: &Reading) -> bool {
        let limit = self.options.max_in_flight_per_range;
        r.in_flight < limit
            && (!r.windowed || (r.checkpoint.window_docs() as usize) < limit * 4)
            && read_wanted(r.poll.delay().is_zero(), r.in_feed_order.is_some())
    }

    pub(super) async fn start(&self, lease: Lease, acquired: Instant) -> Result<Reading> {
        let range = lease.feed_range()?;
        let config = self.group.config();
        let windowed = config.mode == DeliveryMode::Exclusive;
        let inherited = windowed.then(|| {
            let wrote_claims = lease.writes != Some(crate::config::ExclusiveWrites::Lease);
            let look_up = match config.lease_recorded() && wrote_claims {
                true => self.options.max_in_flight_per_range,
                false => 0,
            };
            Inherited::new(&lease.window, look_up)
        });
        // The lease's markers (a split child holds its parent's, of both halves).
        let markers: Vec<(String, Marker)> = lease
            .window
            .markers()
            .into_iter()
            .filter_map(|marker| {
                let key = MessageKey::from_json(marker.pk.clone()).ok()?;
                Some((self.group.queue().message_epk(&key), marker))
            })
            .collect();
        let rewind = config.lease_recorded().then(|| {
            let whole = (lease.min_epk.clone(), lease.max_epk.clone());
            Rewind::start(&markers, &continuation_ranges(&lease.continuation, &whole))
        });
        let mut checkpoint = Checkpoint::new(lease.continuation.clone()).after(markers);
        if let Some(inherited) = inherited {
            checkpoint = checkpoint.tracking_ids().inheriting(inherited);
        }
        // An ordered key's earlier messages that hold their own state lie behind the
        // checkpoint (long work, retries, parked): the key's next message read here waits
        // for them, though the window no longer lists them.
        let held_back = match config.ordered && !buggify::on(Bug::OrderedMoveForgetsPredecessor) {
            true => {
                self.group
                    .unsettled_in(&lease.min_epk, &lease.max_epk)
                    .await?
            }
            false => BTreeMap::new(),
        };
        let reader = FeedReader::new(
            self.group.queue().messages().clone(),
            FeedScope::range(range),
            self.group.config().start_from,
            lease.continuation.clone(),
            self.options.page_size,
            Arc::clone(self.group.queue().charges()),
        );
        let wake = self.join_probe(&lease).await;
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        let (start_tx, start_rx) = mpsc::unbounded_channel();
        let mut r = Reading {
            wake,
            joined_at: Instant::now(),
            resting: None,
            checkpoint,
            lease,
            reader,
            done_tx,
            done_rx,
            start_tx,
            start_rx,
            deliveries: JoinSet::new(),
            stops: Stops {
                step_aside: CancellationToken::new(),
                draining: CancellationToken::new(),
                give_up: CancellationToken::new(),
                promote_now: CancellationToken::new(),
            },
            in_flight: 0,
            poll: AdaptivePoll::new(self.options.min_poll, self.options.max_poll),
            read_at: None,
            reading: true,
            chains: HashMap::new(),
            held_back,
            read: 0,
            in_feed_order: None,
            windowed,
            unwritten: false,
            checked_at: acquired,
            renew_at: acquired,
            held: Arc::clone(&self.held),
            seen: config.lease_recorded().then(Seen::default),
            rewind,
        };
        r.written(acquired, &self.options);
        Ok(r)
    }

    /// Renews the lease. Fencing: when another host owns the range now, nothing more is read
    /// from it; when renewals keep failing, the range stops once the lease is no longer
    /// surely its own (see [`Reading::held`]).
    ///
    /// A lease whose window holds nothing the app may have rides on the host's heartbeat
    /// instead (other hosts judge it by that, see [`crate::lease::Beat`]): it is checked, not
    /// written, to notice a hand-over request or a new owner as a renewal would — in the host's
    /// listing when one was made since the last check, else by a read (1 RU, not a replace) —
    /// and is surely this range's until the heartbeat's own deadline.
    pub(super) async fn renew(&self, r: &mut Reading) -> Step {
        let sent = Instant::now();
        if let Some(until) = self.rides(r, sent) {
            let unchanged = match self.listed_since(r) {
                Some(listed) => Ok(Some(listed)),
                None => self.store.read(&r.lease.id).await.map(|stored| {
                    stored
                        .filter(|stored| same_version(stored, &r.lease))
                        .map(|_| sent)
                }),
            };
            return match unchanged {
                Ok(Some(checked)) => {
                    r.held.send_if_modified(|held| {
                        let later = until > *held;
                        if later {
                            *held = until;
                        }
                        later
                    });
                    r.checked_at = checked;
                    r.renew_at = sent + self.options.lease_renew;
                    None
                }
                Ok(_) => self.changed(r).await,
                Err(e) => {
                    warn!(error = %e, "lease check failed; retrying");
                    r.renew_at = sent + Duration::from_millis(200).min(self.options.lease_renew);
                    None
                }
            };
        }
        match self.store.renew(&r.lease, self.now()).await {
            Ok(renewed) => {
                r.lease = renewed;
                r.written(sent, &self.options);
            }
            Err(LeaseError::Lost) => return self.changed(r).await,
            Err(LeaseError::Other(e)) => {
                warn!(error = %e, "lease renewal failed; retrying");
                r.renew_at =
                    Instant::now() + Duration::from_millis(200).min(self.options.lease_renew);
            }
        }
        None
    }

    /// Until when the host's heartbeat keeps this range's lease, if it does and will until the
    /// next check: the range has nothing in flight and nothing of the window may be in the app
    /// (what the lease advertises then is judged by the lease alone), and a heartbeat that lists
    /// the lease landed recently enough.
    fn rides(&self, r: &Reading, now: Instant) -> Option<Instant> {
        let busy = r.in_flight > 0 || r.lease.window.may_be_in_app();
        if busy && !buggify::on(Bug::HeartbeatKeepsWindow) {
            return None;
        }
        let expire = self.options.lease_expire;
        let sent = self
            .beat
            .borrow()
            .as_ref()
            .filter(|b| b.leases.contains(&r.lease.id))?
            .sent;
        let until = sent + expire - expire / 10;
        (until > now + self.options.lease_renew).then_some(until)
    }

    /// When the host's listing, made since this range last knew its lease unchanged, found it
    /// unchanged still.
    fn listed_since(&self, r: &Reading) -> Option<Instant> {
        let listed = self.listed.borrow();
        let listed = listed.as_ref().filter(|l| l.at > r.checked_at)?;
        let etag = listed.versions.get(&r.lease.id)?;
        (Some(bare(etag)) == r.lease.etag.as_deref().map(bare)).then_some(listed.at)
    }

    /// The lease changed under this range. Still ours: another host asked for it, or an
    /// earlier write whose answer was lost landed (the SDK's retry of it then finds a new
    /// ETag); renewed again on what is there now, soon but not at once (a write that keeps
    /// landing unanswered must not spin). Otherwise the range stops.
    async fn changed(&self, r: &mut Reading) -> Step {
        match self.current(&r.lease).await {
            Ok(Some(current)) if current.handover_to.is_some() => {
                r.hand_over(current);
                r.renew_at = Instant::now() + LOST_AGAIN;
            }
            Ok(Some(current)) => {
                r.lease = current;
                r.renew_at = Instant::now() + LOST_AGAIN;
            }
            _ => {
                warn!(owner = %self.options.holder(), in_flight = r.in_flight, "lease lost; stopped reading the range");
                return Some(RangeExit::Lost);
            }
        }
        None
    }

    /// Lets the deliveries that ask start, their starts listed with the range's next write,
    /// or written first where a next owner must know of them (see [`StartRequest`]).
    pub(super) async fn grant(&self, r: &mut Reading, first: StartRequest) -> Step {
        let mut requests = vec![first];
        while let Ok(more) = r.start_rx.try_recv() {
            requests.push(more);
        }
        let answer = answer_starts(
            requests
                .iter()
                .map(|request| (request.unsure, request.follows)),
            r.checkpoint.unwritten_completions(),
            Instant::now(),
            *r.held.borrow(),
        );
        for request in &requests {
            r.checkpoint.start(request.seq, &request.identity);
        }
        r.unwritten = true;
        let (granted, step) = match answer {
            StartAnswer::WriteFirst => match self.write_record(r).await {
                Ok(_) => (true, None),
                Err(exit) => (false, Some(exit)),
            },
            StartAnswer::Granted => (true, None),
            StartAnswer::Refused => (false, None),
        };
        for request in requests {
            let _ = request.reply.send(granted);
        }
        step
    }

    /// The probe of the partition the lease lies in, if the host runs probes and one is found.
    async fn join_probe(&self, lease: &Lease) -> Option<Wake> {
        let probes = self.probes.as_ref()?;
        probes
            .wake_for(&lease.min_epk, &lease.max_epk)
            .await
            .unwrap_or_else(|e| {
                info!(error = %e, "no probe for the range; it polls by itself for now");
                None
            })
    }

    /// Reads the next page and hands its messages out; permits are taken as they free.
    pub(super) async fn read_page(&self, r: &mut Reading) -> Step {
        let max = self.options.page_size;
        let crate::cosmos::feed::Page {
            docs,
            token,
            partition,
        } = match r.reader.next_page_of(max).await {
            Ok(page) => page,
            Err(e) => {
                ConsumerStats::bump(&self.stats.errors);
                r.poll.idle();
                warn!(error = %e, "change feed read failed; retrying");
                // Not resting: what woke the range may be unread, and the probe has moved on.
                r.read_at = Some(Instant::now() + r.poll.delay());
                return None;
            }
        };
        if docs.is_empty() {
            r.poll.idle();
            tracing::trace!(
                next_read_ms = r.poll.delay().as_millis() as u64,
                "feed idle; backing off"
            );
            // Everything there is was read: what a previous owner recorded and this range
            // never read again is not in it any more (the other half of a split, expired).
            if let Some(inherited) = r.checkpoint.inherited() {
                r.unwritten |= inherited.caught_up();
            }
        } else {
            r.poll.observed(docs.len(), max as usize);
            // Stream mode has no claims to stop a second reader: check the lease is still
            // ours before handing out a page (1 RU a page). The lease write path's record of
            // the page does the same, below.
            if self.group.config().mode == DeliveryMode::Stream {
                match self.current_confirmed(&r.lease).await {
                    Err(()) => {
                        warn!(owner = %self.options.holder(), in_flight = r.in_flight, "lease taken by another host; stopped reading the range");
                        return Some(RangeExit::Lost);
                    }
                    Ok(Some(current)) if current.handover_to.is_some() => {
                        // Asked for: this page is left to the next owner.
                        r.hand_over(current);
                        return None;
                    }
                    Ok(_) => {}
                }
            }
        }
        let mut last = None;
        let mut docs = docs;
        if !docs.is_empty() {
            if let Some(rewind) = r.rewind.as_mut() {
                let whole = (r.lease.min_epk.clone(), r.lease.max_epk.clone());
                let range = self.page_range(&docs, &token, &whole);
                let feed = rewind.feed(&range);
                if feed.seek.is_none()
                    && partition.is_some()
                    && feed.partition.is_some()
                    && feed.partition != partition
                {
                    // Split or merged: after a merge the emulator numbers the documents
                    // anew, and the position may read again what was read before it.
                    debug!(from = ?feed.partition, to = ?partition, "the range moved to another partition; checking its next page against the last document read");
                    feed.seek = feed.last.clone().map(Seek::new);
                }
                docs = self.past_marker(feed, partition.as_deref(), docs).await;
                feed.partition = partition.or(feed.partition.take());
                if let Some(seen) = r.seen.as_mut() {
                    docs =
                        seen.first_reads(docs, self.group.queue().config().partition_key_field());
                }
                last = docs
                    .iter()
                    .rev()
                    .find_map(|doc| self.marker(doc))
                    .map(|(epk, marker)| {
                        feed.last = Some((epk.clone(), marker.clone()));
                        PageEnd { marker, epk, range }
                    });
            }
        }
        let count = docs.len() as u32;
        let (handed, known) = self.handling(r, docs);
        let turns: Vec<(Turn, Option<watch::Sender<KeyState>>)> =
            handed.iter().map(|h| self.turn(r, &h.message)).collect();
        let listed: Vec<String> = handed.iter().map(|h| h.identity.clone()).collect();
        let seq = r.checkpoint.read_docs(token, count, &listed, last);
        for (identity, fate) in known {
            r.checkpoint.known(seq, &identity, fate);
            r.unwritten = true;
        }
        if self.records_starts() && !handed.is_empty() {
            // The page is listed before any of it starts (unstarted; each start is listed with
            // a later write): a next owner after a crash waits for the lock of what the app
            // may have. Also the fence: it fails once the lease is another host's.
            if let Err(exit) = self.write_record(r).await {
                return Some(exit);
            }
        }
        self.dispatch(r, seq, handed, turns);
        if r.chains.len() > MAX_IDLE_CHAINS {
            forget_settled_keys(&mut r.chains);
        }
        None
    }

    /// When a message read now may start: ordered groups after its key's previous messages
    /// (in this range, or left unsettled by a previous owner); unordered ones take permits in
    /// feed order. With it, the sender of its state for the key's next message.
    pub(super) fn turn(
        &self,
        r: &mut Reading,
        message: &Message,
    ) -> (Turn, Option<watch::Sender<KeyState>>) {
        if self.group.config().ordered {
            let key = message.partition_key.canonical();
            let (tx, rx) = watch::channel(None);
            let previous = r.chains.insert(key.clone(), rx).filter(|previous| {
                // A predecessor settled for good (recorded) is nothing to wait for.
                match &*previous.borrow() {
                    Some((_, Fate::Settled)) => false,
                    Some((id, Fate::Completed)) => r.checkpoint.is_unwritten(id),
                    _ => true,
                }
            });
            let mut waits_for = r.held_back.remove(&key).unwrap_or_default();
            waits_for.retain(|id| *id != message.id);
            let turn = Turn::Key {
                previous,
                waits_for,
            };
            return (turn, Some(tx));
        }
        let (tx, rx) = oneshot::channel();
        let turn = Turn::Feed {
            previous: r.in_feed_order.replace(rx),
            next: Some(tx),
        };
        (turn, None)
    }

    /// The page without the documents read before (see [`Rewind`]), when its sub-range is
    /// being checked: up to the marker when the page holds it; otherwise those older than the
    /// marker by LSN, as the feed numbers documents now (a few point reads, once per
    /// sub-range when a range is taken or moves partition). When the marker's LSN does not
    /// compare (another partition holds it, or it is gone), everything is delivered: at least
    /// once, never skipped unread.
    pub(super) async fn past_marker(
        &self,
        feed: &mut SubFeed,
        partition: Option<&str>,
        docs: Vec<serde_json::Value>,
    ) -> Vec<serde_json::Value> {
        let Some(seek) = feed.seek.as_mut() else {
            return docs;
        };
        let field = self.group.queue().config().partition_key_field();
        if let Some(at) = docs
            .iter()
            .position(|d| crate::identity::is(d, field, &seek.marker.id, &seek.marker.pk))
        {
            if at > 0 || seek.seeking {
                warn!(skipped = at + 1, "the feed served documents before the checkpoint again; skipped up to the last one recorded");
            }
            feed.seek = None;
            return docs.into_iter().skip(at + 1).collect();
        }
        if seek.position.is_none() {
            let marker = serde_json::json!({"id": seek.marker.id, field: seek.marker.pk});
            seek.position = Some(self.group.item_position(&marker).await.ok().flatten());
        }
        let marker = match seek.position.clone().flatten() {
            Some((lsn, held_by)) if partition.is_none() || held_by.as_deref() == partition => lsn,
            _ => {
                feed.seek = None;
                return docs;
            }
        };
        // Documents come in LSN order: find the first one not older than the marker. One of
        // the marker's LSN is not older: a transactional batch is one write, and the feed
        // resumes within it; once renumbered by a merge, every document has its own.
        let newer = |i: usize| {
            let doc = &docs[i];
            async move {
                self.group
                    .item_lsn(doc)
                    .await
                    .ok()
                    .flatten()
                    .map(|lsn| lsn >= marker)
            }
        };
        // The usual answer first: nothing served again.
        if newer(0).await != Some(false) {
            feed.seek = None;
            return docs;
        }
        let Some(last_newer) = newer(docs.len() - 1).await else {
            feed.seek = None;
            return docs;
        };
        if !last_newer {
            seek.seeking = true;
            debug!(
                skipped = docs.len(),
                "skipping documents before the checkpoint"
            );
            return Vec::new();
        }
        // The first is older, the last newer.
        let (mut lo, mut hi) = (1, docs.len() - 1);
        while lo < hi {
            let mid = (lo + hi) / 2;
            match newer(mid).await {
                Some(true) => hi = mid,
                Some(false) => lo = mid + 1,
                // Cannot tell: deliver from the oldest that may be unread.
                None => break,
            }
        }
        feed.seek = None;
        if lo > 0 {
            warn!(skipped = lo, "the feed served documents before the checkpoint again; skipped those older than the last one recorded");
        }
        docs.into_iter().skip(lo).collect()
    }

    /// The sub-range of the continuation that served `docs` (the one holding its first
    /// document); the lease's range when the token does not say.
    pub(super) fn page_range(
        &self,
        docs: &[serde_json::Value],
        token: &Option<String>,
        whole: &(String, String),
    ) -> (String, String) {
        let Some(epk) = docs
            .iter()
            .find_map(|doc| self.marker(doc))
            .map(|(epk, _)| epk)
        else {
            return whole.clone();
        };
        continuation_ranges(token, whole)
            .into_iter()
            .find(|(lo, hi)| crate::range::epk_in(&epk, lo, hi))
            .unwrap_or_else(|| whole.clone())
    }

    /// A feed document as a marker, with its EPK; `None` without an id or a valid key.
    pub(super) fn marker(&self, doc: &serde_json::Value) -> Option<(String, Marker)> {
        let field = self.group.queue().config().partition_key_field();
        let pk = doc.get(field)?.clone();
        let key = crate::message::MessageKey::from_json(pk.clone()).ok()?;
        let marker = Marker {
            id: doc.get("id")?.as_str()?.to_owned(),
            pk,
        };
        Some((self.group.queue().message_epk(&key), marker))
    }

    /// A page's messages and how each is delivered, and the documents the lease's window says
    /// are done or pending already. Malformed documents are counted and skipped with a reason.
    pub(super) fn handling(
        &self,
        r: &mut Reading,
        docs: Vec<serde_json::Value>,
    ) -> (Vec<Handed>, Vec<(String, Fate)>) {
        let config = self.group.config();
        let field = self.group.queue().config().partition_key_field();
        let check_stream = config.mode == DeliveryMode::Stream && config.ordered;
        let (mut handed, mut known) = (Vec::new(), Vec::new());
        for doc in docs {
            let message = match Message::from_document(&doc, field) {
                Ok(message) => message,
                Err(reason) => {
                    ConsumerStats::bump(&self.stats.malformed);
                    warn!(queue = self.group.queue().name(), id = ?doc.get("id"), %reason, "skipping a malformed document in the messages container");
                    if let Some(inherited) = r.checkpoint.inherited() {
                        inherited.skipped();
                    }
                    continue;
                }
            };
            let identity = crate::identity::fingerprint(&message.id, &message.partition_key);
            let handling = match r.checkpoint.inherited() {
                Some(inherited) => inherited.next(&identity, &message.id, config.ordered),
                None if check_stream && r.read < self.options.max_in_flight_per_range => {
                    Handling::Deliver(Route::Checked)
                }
                None => Handling::Deliver(Route::Feed),
            };
            r.read += 1;
            match handling {
                Handling::Deliver(path) => handed.push(Handed {
                    message,
                    identity,
                    path,
                    unsure: false,
                }),
                Handling::Unsure(path) => handed.push(Handed {
                    message,
                    identity,
                    path,
                    unsure: true,
                }),
                Handling::Known(fate) => known.push((identity, fate)),
            }
        }
        (handed, known)
    }

    /// One delivery task per message of page `seq`, each taking its turn.
    pub(super) fn dispatch(
        &self,
        r: &mut Reading,
        seq: u64,
        handed: Vec<Handed>,
        turns: Vec<(Turn, Option<watch::Sender<KeyState>>)>,
    ) {
        let config = self.group.config();
        let lease_locked = config.lease_recorded();
        let promoting = config.mode == DeliveryMode::Exclusive;
        let page_started = Arc::new(AtomicBool::new(false));
        for (
            Handed {
                message,
                identity,
                path,
                unsure,
            },
            (turn, key_state),
        ) in handed.into_iter().zip(turns)
        {
            r.in_flight += 1;
            let recovered = path == Route::Recovered;
            let reached = Arc::new(AtomicBool::new(false));
            let (promoted_tx, mut promoted) = oneshot::channel();
            let promotion = promoting.then(|| Promotion {
                after: self.options.promote_after,
                now: r.stops.promote_now.clone(),
                promoted: Some(promoted_tx),
            });
            let lease = lease_locked.then(|| LeaseLock {
                lost: r.stops.step_aside.clone(),
                held: r.held.subscribe(),
            });
            let start = self.records_starts().then(|| StartAsk {
                seq,
                identity: identity.clone(),
                unsure,
                requests: r.start_tx.clone(),
            });
            let delivery = RangeDelivery {
                deliverer: Arc::clone(&self.deliverer),
                permits: Arc::clone(&self.permits),
                stop: r.stops.clone(),
                page_started: (!r.windowed).then(|| Arc::clone(&page_started)),
                path,
                promotion,
                lease,
                start,
                locked_until: LockedUntil::default(),
                reached: Arc::clone(&reached),
            };
            let done = r.done_tx.clone();
            let (id, key) = (message.id.clone(), message.partition_key.clone());
            let (enqueued_at, expires_at) = (
                message.enqueued_at,
                self.group.queue().message_expires_at(&message),
            );
            r.deliveries.spawn(self.deliveries.track_future(async move {
                let report = |fate| Report {
                    seq,
                    identity: identity.clone(),
                    id: id.clone(),
                    key: key.clone(),
                    enqueued_at,
                    expires_at,
                    fate,
                    reached: reached.load(Ordering::SeqCst),
                    recovered,
                };
                let run = delivery.run(message, turn);
                tokio::pin!(run);
                // A delivery that stops holding the range (its long work has a lock of its
                // own, or it was parked) is reported as pending at once: the range may pass
                // it, the key's next message waits on its state, and the delivery goes on.
                let fate = tokio::select! {
                    biased;
                    fate = &mut run => fate,
                    Ok(()) = &mut promoted => {
                        if let Some(state) = &key_state {
                            state.send_replace(Some((id.clone(), Fate::Pending)));
                        }
                        let _ = done.send(report(Fate::Pending));
                        run.await;
                        return;
                    }
                };
                if let Some(state) = &key_state {
                    state.send_replace(Some((id.clone(), fate)));
                }
                let _ = done.send(report(fate));
            }));
        }
    }

    /// Drained: record where the range is and hand the lease back.
    pub(super) async fn finish(&self, mut r: Reading) -> RangeExit {
        // Deliveries with locks of their own go on after the range; the host waits for them.
        self.leftovers.adopt(&mut r.deliveries);
        if r.checkpoint_due() {
            if let Some(exit) = self.flush(&mut r).await {
                return exit;
            }
        }
        let mut lease = r.lease.clone();
        for _ in 0..RELEASE_TRIES {
            match self.store.release(&lease).await {
                Ok(()) => {
                    info!(owner = %self.options.holder(), "lease released");
                    crate::ledger::lease_released(
                        self.group.name(),
                        &lease.id,
                        &self.options.holder(),
                    );
                    return RangeExit::Released;
                }
                // Changed by another host asking for it (a hand-over request), not taken:
                // still ours, so release what is there now. Left alone, it would stay in this
                // host's name until it expired.
                Err(LeaseError::Lost) => match self.current_confirmed(&lease).await {
                    Ok(Some(current)) => lease = current,
                    _ => return RangeExit::Lost,
                },
                Err(LeaseError::Other(e)) => return RangeExit::Failed(e),
            }
        }
        RangeExit::Lost
    }

    /// Writes what the range recorded: the checkpoint, and in exclusive groups the window
    /// past it. `Some(exit)` when the lease is gone.
    pub(super) async fn flush(&self, r: &mut Reading) -> Step {
        if !r.windowed {
            return self.write_checkpoint(r).await;
        }
        self.write_record(r).await.err()
    }

    /// Writes the lease with the checkpoint and the window (exclusive groups), and counts the
    /// completions it records (a hand-over request the written lease shows starts the
    /// drain); a write that keeps failing is retried until the lease would no longer surely
    /// be this range's, then the range stops (the lease, still in this host's name, is taken
    /// back at the next acquire round, and what the write would have recorded is delivered
    /// again).
    ///
    /// Completions are counted (and announced on the ledger) once the write landed; a write
    /// whose answer is lost (a timeout after the service applied it) is read back.
    pub(super) async fn write_record(&self, r: &mut Reading) -> Result<(), RangeExit> {
        let completions = r.checkpoint.take_unwritten();
        let (written, result) = self.try_record(r).await;
        if written {
            if !r.lease.window.started.is_empty() {
                crate::ledger::starts_listed(
                    self.group.name(),
                    &r.lease.window.started,
                    &self.options.holder(),
                );
            }
            self.stats
                .completed
                .fetch_add(completions.len() as u64, Ordering::Relaxed);
            for c in &completions {
                crate::ledger::completion_recorded(self.group.name(), &c.id, &c.key);
            }
        } else if result.is_err() {
            // The range stops with completions its lease could not record (an outage outlasted
            // the lease, or another host has it now): they are written as state documents
            // instead, so a success is not thrown away and delivered again.
            self.complete_by_documents(completions).await;
        } else {
            r.checkpoint.restore_unwritten(completions);
        }
        result
    }

    /// Records completions the lease could not, one state document each (best effort: what
    /// cannot be written is delivered again by the range's next owner).
    pub(super) async fn complete_by_documents(&self, completions: Vec<Completion>) {
        for c in completions {
            match self
                .group
                .record_completion(&c.id, &c.key, c.enqueued_at, c.expires_at)
                .await
            {
                Ok(true) => {
                    ConsumerStats::bump(&self.stats.completed);
                    crate::ledger::completion_recorded(self.group.name(), &c.id, &c.key);
                }
                Ok(false) => {
                    debug!(message_id = %c.id, "a state document owns the message already; its completion here is not recorded")
                }
                Err(e) => {
                    warn!(message_id = %c.id, error = %e, "its completion could not be recorded; the range's next owner delivers it again")
                }
            }
        }
    }

    /// The lock duration the lease advertises while it holds started deliveries: the group's,
    /// when shorter than the lease expiry (see [`Lease::lock_ms`]).
    pub(super) fn lease_lock_ms(&self) -> Option<u64> {
        let lock = self.group.config().lock_duration;
        (self.records_starts() && lock < self.options.lease_expire)
            .then_some(lock.as_millis() as u64)
    }

    /// [`Self::write_record`]'s write: whether it landed, and what the range does next.
    pub(super) async fn try_record(&self, r: &mut Reading) -> (bool, Result<(), RangeExit>) {
        let writes = self.group.config().exclusive_writes;
        let position = r.checkpoint.position().clone();
        let mut window = r.checkpoint.record();
        // Until the range has drained, what it handed out unstarted may start before the
        // next write lists it (a page's record is written before its messages are handed out).
        window.starts_lag |= self.records_starts() && !r.drained() && r.checkpoint.has_unstarted();
        let mut attempt = 0u32;
        // A write found landed may be any attempt's: the lease is held from the first's send.
        let first_sent = Instant::now();
        let holds = |lease: &Lease| lease.window == window && lease.continuation == position;
        // Tried while the lease is surely this range's: giving up sooner would throw
        // completions away (the next owner delivers them again) while the lease may be good.
        while Instant::now() < *r.held.borrow() || buggify::on(Bug::StartUnderExpiredLease) {
            attempt += 1;
            let sent = Instant::now();
            let written = self
                .store
                .record(
                    &r.lease,
                    position.clone(),
                    window.clone(),
                    writes,
                    self.lease_lock_ms(),
                    self.now(),
                )
                .await;
            match written {
                Ok(written) => {
                    r.recorded(written, sent, &self.options);
                    return (true, Ok(()));
                }
                Err(LeaseError::Lost) => match self.current(&r.lease).await {
                    // Still ours (asked for, or an earlier write landed unanswered): done if it
                    // holds this record, else written again on what is there now (and handed
                    // over after, if asked).
                    Ok(Some(current)) if holds(&current) => {
                        r.recorded(current, first_sent, &self.options);
                        return (true, Ok(()));
                    }
                    Ok(Some(current)) => r.lease = current,
                    Ok(None) => {}
                    Err(()) => {
                        warn!(owner = %self.options.holder(), in_flight = r.in_flight, "lease taken by another host; stopped reading the range");
                        return (false, Err(RangeExit::Lost));
                    }
                },
                Err(LeaseError::Other(e)) => {
                    ConsumerStats::bump(&self.stats.errors);
                    debug!(error = %e, attempt, "lease write failed; retrying");
                    // It may have landed with its answer lost: then it is done.
                    match self.current(&r.lease).await {
                        Ok(Some(current)) if holds(&current) => {
                            r.recorded(current, first_sent, &self.options);
                            return (true, Ok(()));
                        }
                        Ok(Some(current)) => r.lease = current,
                        _ => {}
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50 << attempt.min(4))).await;
        }
        warn!(group = self.group.name(), lease = %r.lease.range_label(), "the lease could not be written before it ran out; stopped reading the range");
        (false, Err(RangeExit::Lost))
    }

    /// The lease as stored when it still names this host (`Ok(None)`: a read error; renewal
    /// decides); `Err(())` when another host owns it or it is gone.
    pub(super) async fn current(&self, lease: &Lease) -> Result<Option<Lease>, ()> {
        match self.store.read(&lease.id).await {
            Ok(Some(current))
                if current.owner.as_deref() == Some(self.options.holder().as_str()) =>
            {
                Ok(Some(current))
            }
            Ok(_) => Err(()),
            Err(_) => Ok(None),
        }
    }

    /// [`Self::current`] where a read error is not taken for "still ours": read again a few
    /// times, then treat the lease as lost (the range stops; the lease, still in this host's
    /// name, is taken back at the next acquire round and read again from its checkpoint).
    pub(super) async fn current_confirmed(&self, lease: &Lease) -> Result<Option<Lease>, ()> {
        for attempt in 0..LEASE_READ_TRIES {
            match self.current(lease).await? {
                Some(current) => return Ok(Some(current)),
                None => {
                    tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
                }
            }
        }
        warn!(group = self.group.name(), lease = %lease.range_label(), "the lease could not be read; stopped reading the range");
        Err(())
    }

    /// Writes a moved checkpoint (groups without a window); `Some(exit)` when the lease is
    /// gone.
    pub(super) async fn write_checkpoint(&self, r: &mut Reading) -> Step {
        let token = r.checkpoint.position().clone()?;
        loop {
            let sent = Instant::now();
            match self
                .store
                .checkpoint(&r.lease, token.clone(), self.now())
                .await
            {
                Ok(written) => {
                    debug!(group = self.group.name(), lease = %r.lease.range_label(), "checkpoint");
                    r.lease = written;
                    r.written(sent, &self.options);
                    return None;
                }
                Err(LeaseError::Lost) => {
                    // Still ours (another host asked for it): write again on what is stored.
                    if let Ok(Some(current)) = self.current(&r.lease).await {
                        r.lease = current;
                        tokio::time::sleep(LOST_AGAIN).await;
                        continue;
                    }
                    warn!(group = self.group.name(), lease = %r.lease.range_label(), "lease lost at checkpoint; stopped reading the range");
                    return Some(RangeExit::Lost);
                }
                Err(LeaseError::Other(e)) => {
                    warn!(group = self.group.name(), lease = %r.lease.range_label(), error = %e, "checkpoint failed; retrying");
                    return None;
                }
            }
        }
    }
}

/// How a range answers a batch of start requests (the lease write path).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum StartAnswer {
    /// A next owner must know of one of them: the starts are written before any starts.
    WriteFirst,
    /// They start now, listed with the range's next write.
    Granted,
    /// The lease is not surely this host's: nothing starts.
    Refused,
}

/// Whether `stored` is the version of the lease `held` was written or read as (ETags compare
/// without their quotes: a write's header and a read's body may quote them differently).
fn same_version(stored: &Lease, held: &Lease) -> bool {
    fn etag(l: &Lease) -> Option<&str> {
        l.etag.as_deref().map(bare)
    }
    etag(stored).is_some() && etag(stored) == etag(held)
}

/// An ETag without its quotes.
fn bare(etag: &str) -> &str {
    etag.trim_matches('"')
}

/// The answer to start requests `(unsure, follows)` (pure). A start is written first where a
/// next owner must know of it: a message the previous owner may have started unlisted, and an
/// ordered key's next message while `unwritten_completions` wait for a write (else a next owner
/// would deliver its predecessor again after it started). Otherwise the lease is the lock, and
/// only while it is live: nothing starts at or past `held_until` (its last write plus the
/// expiry others judge it by, minus a margin).
pub(super) fn answer_starts(
    requests: impl IntoIterator<Item = (bool, bool)>,
    unwritten_completions: usize,
    now: Instant,
    held_until: Instant,
) -> StartAnswer {
    let write_first = requests
        .into_iter()
        .any(|(unsure, follows)| unsure || (follows && unwritten_completions > 0));
    if write_first {
        StartAnswer::WriteFirst
    } else if now < held_until || buggify::on(Bug::StartUnderExpiredLease) {
        StartAnswer::Granted
    } else {
        StartAnswer::Refused
    }
}

/// Whether a range reads its feed again: at once while its last page came back full (more is
/// waiting there); once caught up, only when each message it read has its permit. A message
/// read now starts after those (unordered groups take permits in feed order), so polling
/// while they wait buys no latency and costs a read (1 RU) every `minPoll`: with 8 groups
/// sharing a process, over a quarter of their reads were such polls, empty.
pub(super) fn read_wanted(behind: bool, waiting_for_permits: bool) -> bool {
    behind || !waiting_for_permits
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Which starts are written first, which start on the lease, and which wait (paused time:
    /// the lease is held for 10 s from the first look).
    #[tokio::test(start_paused = true)]
    async fn starts_are_written_first_only_where_a_next_owner_must_know() {
        let held_until = Instant::now() + Duration::from_secs(10);
        let (plain, unsure, follows) = ((false, false), (true, false), (false, true));
        /// A batch of requests `(unsure, follows)`, completions unwritten, seconds after the
        /// first look: the answer.
        struct Case(&'static str, Vec<(bool, bool)>, usize, u64, StartAnswer);
        #[rustfmt::skip]
        let cases = [
            Case("a first delivery, lease live", vec![plain], 0, 0, StartAnswer::Granted),
            Case("a first delivery, lease past its hold", vec![plain], 0, 10, StartAnswer::Refused),
            Case("maybe started unlisted by the previous owner", vec![unsure], 0, 0, StartAnswer::WriteFirst),
            Case("maybe started unlisted, even past the hold", vec![unsure], 0, 10, StartAnswer::WriteFirst),
            Case("a key's next, completions unwritten", vec![follows], 2, 0, StartAnswer::WriteFirst),
            Case("a key's next, nothing unwritten", vec![follows], 0, 0, StartAnswer::Granted),
            Case("completions unwritten, nobody follows", vec![plain, plain], 2, 0, StartAnswer::Granted),
            Case("one unsure in a batch writes for all", vec![plain, unsure, plain], 0, 0, StartAnswer::WriteFirst),
        ];
        let start = Instant::now();
        for Case(what, requests, unwritten, after, expected) in cases {
            let now = start + Duration::from_secs(after);
            assert_eq!(
                answer_starts(requests, unwritten, now, held_until),
                expected,
                "{what}"
            );
        }
    }
}
