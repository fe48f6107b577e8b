//! Remaining work per group per range: what the operator scales on and what metrics show.
//!
//! - **Lag** (unread by the group), as the change feed processor's estimator and KEDA compute
//!   it: read one item from the lease's checkpoint; lag = the partition's LSN (page header) −
//!   that item's LSN + 1, and 0 when nothing is there (304). The real service puts `_lsn` on
//!   change-feed items; the emulator does not, so the item's LSN then comes from a point read
//!   of it (`x-ms-item-lsn`). A lease that has no checkpoint yet is not reported as the whole
//!   container: for a group that starts from now its lag is unknown (`None`) until the first
//!   checkpoint; for one that starts from the beginning it is counted from the beginning.
//!   LSNs count writes and a transactional batch is one write, so a small estimate (≤ 500,
//!   where scale-from-zero and scale-in are decided) is refined by counting the unread items.
//! - **Backlog** (not yet settled) = lag + messages the group has read and must still deliver
//!   soon: state documents whose retry or scheduled time falls within [`DUE_HORIZON`], and
//!   every locked message (redeliveries, long work under a lock of its own past the
//!   checkpoint, locks whose holder died). What the lease's window settled past the checkpoint
//!   is taken off the lag. Work due later is no backlog: a schedule a week out must not hold a
//!   group at its maximum or block scale to zero. At most [`MAX_PENDING`] state documents are
//!   counted per estimate.
//! - **Oldest unsettled**: the earliest enqueue time among those, and the first unread message.

use std::collections::BTreeMap;

use azure_data_cosmos::FeedScope;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::buggify::{self, Bug};
use crate::config::StartFrom;
use crate::cosmos::feed;
use crate::cosmos::sql;
use crate::error::{QueueError, Result};
use crate::group::Group;
use crate::lease::{Lease, LeaseStore};
use crate::range::epk_in;
use crate::state::STATE_DOC_TYPE;

/// What is left in one feed range for a group.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RangeEstimate {
    /// The range's lower bound (inclusive, hex EPK).
    pub min_epk: String,
    /// The range's upper bound (exclusive, hex EPK).
    pub max_epk: String,
    /// Who holds the range's lease.
    pub owner: Option<String>,
    /// Messages not yet read by the group; `None` while unknown (no checkpoint, start from now).
    pub lag: Option<u64>,
    /// Messages not yet settled: the unread lag plus those read and still due.
    pub backlog: u64,
    /// Enqueue time (epoch ms) of the oldest message not yet settled.
    pub oldest_unsettled_at: Option<i64>,
    /// Whether the lease has a checkpoint (without one, the lag may be unknown).
    pub checkpointed: bool,
    /// The range's latest LSN when it was read: it counts writes to the messages container
    /// (messages are append-only), so its growth over time is the arrival rate.
    pub lsn: Option<u64>,
}

/// What is left for a group, range by range.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupEstimate {
    /// The group.
    pub group: String,
    /// Its ranges (its leases).
    pub ranges: Vec<RangeEstimate>,
}

impl GroupEstimate {
    /// Messages not yet read, over the ranges whose lag is known.
    pub fn lag(&self) -> u64 {
        self.ranges.iter().filter_map(|r| r.lag).sum()
    }

    /// Messages not yet settled, over every range.
    pub fn backlog(&self) -> u64 {
        self.ranges.iter().map(|r| r.backlog).sum()
    }

    /// Sum of the ranges' LSNs, when every range reported one.
    pub fn lsn(&self) -> Option<u64> {
        self.ranges.iter().map(|r| r.lsn).sum()
    }

    /// The enqueue time of the oldest message not yet settled.
    pub fn oldest_unsettled_at(&self) -> Option<i64> {
        self.ranges
            .iter()
            .filter_map(|r| r.oldest_unsettled_at)
            .min()
    }
}

/// Retries and schedules due within this long count as backlog; later ones do not.
pub const DUE_HORIZON: std::time::Duration = std::time::Duration::from_secs(60);
/// The most state documents one estimate reads (the backlog is then a lower bound).
pub const MAX_PENDING: usize = 10_000;

/// Below this LSN distance the lag is counted item by item instead of estimated.
const EXACT_COUNT_LIMIT: u64 = 500;
const EXACT_COUNT_PAGE: u32 = 1000;
/// The most pages one range's count reads (a page may stop short of its size at the
/// service's response limit, so an end is an empty page, not a short one).
const EXACT_COUNT_PAGES: usize = 5;

/// What a range's LSNs say of its lag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LsnLag {
    /// About this many messages are unread.
    Estimated(u64),
    /// Few enough to count them by reading: LSNs count writes, and a transactional batch is
    /// one write, so a small estimate (where scale-from-zero and scale-in are decided) is
    /// made exact.
    CountExactly,
    /// An LSN is missing.
    Unknown,
}

/// The lag of a range from its session LSN (the feed page's header) and the LSN of its first
/// unread item: the distance, plus that item itself (pure). A session LSN behind the item (a
/// replica that lags the one that served the item) counts as the item alone.
pub fn lsn_lag(session_lsn: Option<u64>, first_unread_lsn: Option<u64>) -> LsnLag {
    match (session_lsn, first_unread_lsn) {
        (Some(session), Some(item)) => match session.saturating_sub(item) + 1 {
            n if n <= EXACT_COUNT_LIMIT => LsnLag::CountExactly,
            n => LsnLag::Estimated(n),
        },
        _ => LsnLag::Unknown,
    }
}

/// The unread count of a range when the pages read, `items` (the first unread at LSN
/// `first_lsn`, the last read at `last_lsn`), did not reach the feed's end: those, plus the
/// LSNs after them up to the partition's `session_lsn` at the items per LSN they showed (a
/// transactional batch is one LSN; single writes are one each). Pure. Without the last item's
/// LSN, at least one a write.
pub fn extrapolated_lag(
    items: u64,
    first_lsn: u64,
    last_lsn: Option<u64>,
    session_lsn: u64,
) -> u64 {
    let Some(last) = last_lsn.filter(|last| *last >= first_lsn) else {
        return items + session_lsn.saturating_sub(first_lsn);
    };
    let span = last - first_lsn + 1;
    let rest = session_lsn.saturating_sub(last);
    items + (rest * items).div_ceil(span)
}

/// Where each physical partition of a queue's messages container stands: its bounds and
/// its feed's LSN. The operator probes it each round (one small read per partition) and
/// re-estimates an idle group only when it moved ([`head_unchanged`]): no message written
/// means no new work for a group that had none.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FeedHead(pub Vec<((String, String), Option<u64>)>);

/// Whether nothing was written between two probes (pure): the same partitions, each at the
/// same LSN. An LSN not known is a change: only a proven standstill may skip an estimate.
pub fn head_unchanged(before: &FeedHead, now: &FeedHead) -> bool {
    before == now && now.0.iter().all(|(_, lsn)| lsn.is_some()) && !now.0.is_empty()
}

impl crate::Queue {
    /// The messages container's [`FeedHead`]: per physical partition, a change-feed read from
    /// now of at most one item (nothing is read; the response says the partition's LSN).
    pub async fn feed_head(&self) -> Result<FeedHead> {
        let partitions = self.feed_ranges().await?;
        let mut head = Vec::with_capacity(partitions.len());
        for range in partitions {
            let bounds = crate::range::range_bounds(&range);
            let lsn = self.partition_head(range, "feed head").await?.lsn;
            head.push((bounds, lsn));
        }
        Ok(FeedHead(head))
    }

    /// Where one scope's feed stands: a change-feed read from now of at most one item, counted
    /// as `operation`.
    pub(crate) async fn partition_head(
        &self,
        range: azure_data_cosmos::feed::FeedRange,
        operation: &'static str,
    ) -> Result<PartitionHead> {
        let mut pages = feed::open(
            self.messages(),
            FeedScope::range(range),
            StartFrom::Now,
            None,
            1,
            operation,
        )
        .await?;
        let Some(page) = pages.next().await else {
            return Ok(PartitionHead::default());
        };
        let page = page.map_err(QueueError::cosmos(operation))?;
        self.charges()
            .record_diagnostics(operation, &page.diagnostics());
        Ok(PartitionHead {
            partition: page.headers().partition_key_range_id().map(str::to_owned),
            lsn: page.headers().lsn(),
        })
    }
}

/// What a read of a partition's feed from now says: the physical partition that answered,
/// and its LSN.
#[derive(Debug, Default)]
pub(crate) struct PartitionHead {
    pub(crate) partition: Option<String>,
    pub(crate) lsn: Option<u64>,
}

/// What a lease's window accounts for past its checkpoint, which the feed's lag counts: the
/// messages settled there, and those a state document holds (counted with the state documents
/// when due). Nothing for lists a split copied from the parent: they may name the other half.
fn accounted(window: &crate::lease::Window) -> u64 {
    if window.split {
        return 0;
    }
    (window.done.len() + window.pending.len()) as u64
}

/// What the change feed says about one lease: unread count and the first unread message.
#[derive(Debug, Default)]
struct FeedLag {
    lag: Option<u64>,
    first_enqueued_at: Option<i64>,
    lsn: Option<u64>,
}

/// A state document as the estimator reads it.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Pending {
    message_pk: crate::message::MessageKey,
    enqueued_at: i64,
}

impl Group {
    /// Estimates remaining work per lease of this group (see the module docs): the
    /// operator's job, once per group.
    pub async fn estimate(&self) -> Result<GroupEstimate> {
        let leases = LeaseStore::new(self.queue().clone(), self.name())
            .list()
            .await?;
        self.estimate_of(leases).await
    }

    /// [`estimate`](Self::estimate) of leases the caller listed (and needs too: a console
    /// shows their heartbeats beside the estimate without listing them twice).
    pub async fn estimate_of(&self, leases: Vec<Lease>) -> Result<GroupEstimate> {
        let pending = self.pending_by_range(&leases).await?;
        self.estimate_leases(leases, pending).await
    }

    /// The lag of the leases `owner` holds, for a host's own metrics: one small feed read per
    /// owned range, no query over the group's state documents.
    pub async fn estimate_owned(&self, owner: &str) -> Result<GroupEstimate> {
        let leases: Vec<Lease> = LeaseStore::new(self.queue().clone(), self.name())
            .list()
            .await?
            .into_iter()
            .filter(|l| l.owner.as_deref() == Some(owner))
            .collect();
        let pending = leases.iter().map(|_| Vec::new()).collect();
        self.estimate_leases(leases, pending).await
    }

    async fn estimate_leases(
        &self,
        leases: Vec<Lease>,
        pending: Vec<Vec<Pending>>,
    ) -> Result<GroupEstimate> {
        // The SDK routes each page by its cached topology: after a split or a merge it would
        // serve a first page from a partition that no longer holds the range (empty, which is
        // no end of the feed). Reading the ranges afresh is a metadata read, no request units.
        let partitions: Vec<(String, String)> = self
            .queue()
            .feed_ranges()
            .await?
            .iter()
            .map(crate::range::range_bounds)
            .collect();
        let mut ranges = Vec::with_capacity(leases.len());
        for (i, lease) in leases.iter().enumerate() {
            let spanned =
                crate::range::partitions_spanned(&partitions, &lease.min_epk, &lease.max_epk);
            let mut feed = self.feed_lag(lease, spanned).await?;
            feed.lag = feed
                .lag
                .map(|lag| lag.saturating_sub(accounted(&lease.window)));
            let waiting = &pending[i];
            let oldest = waiting
                .iter()
                .map(|p| p.enqueued_at)
                .chain(feed.first_enqueued_at)
                .min();
            ranges.push(RangeEstimate {
                min_epk: lease.min_epk.clone(),
                max_epk: lease.max_epk.clone(),
                owner: lease.owner.clone(),
                lag: feed.lag,
                backlog: feed.lag.unwrap_or(0) + waiting.len() as u64,
                oldest_unsettled_at: oldest,
                checkpointed: lease.continuation.is_some(),
                lsn: feed.lsn,
            });
        }
        Ok(GroupEstimate {
            group: self.name().to_owned(),
            ranges,
        })
    }

    /// [`estimate`](Self::estimate) for a scaler. A group no host has started yet (or one
    /// sitting at zero workers) has no leases, so its backlog would be invisible and could
    /// never wake it: its leases are created first, at the group's start position.
    pub async fn estimate_or_create_leases(
        &self,
        now: i64,
        lease_expire_ms: i64,
    ) -> Result<GroupEstimate> {
        let estimate = self.estimate().await?;
        if !estimate.ranges.is_empty() {
            return Ok(estimate);
        }
        LeaseStore::new(self.queue().clone(), self.name())
            .with_start_from(self.config().start_from)
            .reconcile(now, lease_expire_ms)
            .await?;
        self.estimate().await
    }

    /// Messages read and not yet settled that the lag does not count, bucketed by lease.
    async fn pending_by_range(&self, leases: &[Lease]) -> Result<Vec<Vec<Pending>>> {
        let horizon = self.queue().clock().now_ms() + crate::clock::duration_ms(DUE_HORIZON);
        // Every locked message counts: redeliveries, locks whose holder died (due: at zero
        // replicas they must wake the group), and work running long under a lock of its own,
        // which its range's checkpoint has passed (so the lag no longer counts it). A first
        // delivery's claim younger than `promoteAfter` on the `claims` path is counted twice,
        // in the lag too: over by what is in flight, never under.
        let query = sql::query(
            "SELECT TOP @limit c.messagePk, c.enqueuedAt FROM c WHERE c.type = @type \
             AND c.group = @group AND (((c.state = 'retry' OR c.state = 'scheduled') \
             AND c.due <= @horizon) OR c.state = 'locked')",
            &[
                ("@limit", json!(MAX_PENDING)),
                ("@type", json!(STATE_DOC_TYPE)),
                ("@group", json!(self.name())),
                ("@horizon", json!(horizon)),
            ],
        )?;
        let docs: Vec<Pending> = sql::collect(
            self.queue().leases(),
            query,
            FeedScope::full_container(),
            Some(MAX_PENDING),
            self.queue().charges(),
            "estimate",
        )
        .await?;
        let mut buckets: Vec<Vec<Pending>> = leases.iter().map(|_| Vec::new()).collect();
        let mut key_to_lease: BTreeMap<String, Option<usize>> = BTreeMap::new();
        for doc in docs {
            let slot = *key_to_lease
                .entry(doc.message_pk.canonical())
                .or_insert_with(|| {
                    let epk = self.queue().message_epk(&doc.message_pk);
                    leases
                        .iter()
                        .position(|l| epk_in(&epk, &l.min_epk, &l.max_epk))
                });
            if let Some(i) = slot {
                buckets[i].push(doc);
            }
        }
        Ok(buckets)
    }

    /// `spanned`: the physical partitions the lease's range covers (see [`Self::next_items`]).
    async fn feed_lag(&self, lease: &Lease, spanned: usize) -> Result<FeedLag> {
        if lease.continuation.is_none() && self.config().start_from == StartFrom::Now {
            return Ok(FeedLag::default());
        }
        let mut pages = feed::open(
            self.queue().messages(),
            FeedScope::range(lease.feed_range()?),
            StartFrom::Beginning,
            lease.continuation.as_deref(),
            1,
            "estimate lag",
        )
        .await?;
        let Some(page) = self.next_items(&mut pages, spanned).await? else {
            return Ok(FeedLag {
                lag: Some(0),
                ..FeedLag::default()
            });
        };
        let partition_lsn = page.headers().lsn();
        let Some(first) = page.items().first().and_then(|i| i.current().cloned()) else {
            return Ok(FeedLag {
                lag: Some(0),
                first_enqueued_at: None,
                lsn: partition_lsn,
            });
        };
        let first_enqueued_at = first.get("enqueuedAt").and_then(Value::as_i64);
        let item_lsn = match first.get("_lsn").and_then(Value::as_u64) {
            Some(lsn) => Some(lsn),
            None => self.item_lsn(&first).await?,
        };
        let lag = match lsn_lag(partition_lsn, item_lsn) {
            LsnLag::Estimated(n) => Some(n),
            LsnLag::CountExactly => {
                let (session, first) = (partition_lsn.unwrap_or(0), item_lsn.unwrap_or(0));
                Some(self.count_unread(lease, first, session, spanned).await?)
            }
            LsnLag::Unknown => None,
        };
        Ok(FeedLag {
            lag,
            first_enqueued_at,
            lsn: partition_lsn,
        })
    }

    /// Counts the messages after the lease's checkpoint by reading them (small LSN lags only):
    /// up to [`EXACT_COUNT_PAGES`] pages, until an empty one (exact); past them the rest is
    /// extrapolated from the items per LSN they showed (see [`extrapolated_lag`]), so an
    /// estimate costs the same however many messages a few large batches wrote.
    async fn count_unread(
        &self,
        lease: &Lease,
        first_lsn: u64,
        session_lsn: u64,
        spanned: usize,
    ) -> Result<u64> {
        let mut pages = feed::open(
            self.queue().messages(),
            FeedScope::range(lease.feed_range()?),
            StartFrom::Beginning,
            lease.continuation.as_deref(),
            EXACT_COUNT_PAGE,
            "estimate lag",
        )
        .await?;
        let (mut items, mut last) = (0u64, None);
        for _ in 0..EXACT_COUNT_PAGES {
            let Some(page) = self.next_items(&mut pages, spanned).await? else {
                return Ok(items);
            };
            if page.items().is_empty() {
                return Ok(items);
            }
            items += page.items().len() as u64;
            last = page.items().last().and_then(|i| i.current().cloned());
        }
        let last_lsn = match last {
            Some(last) => match last.get("_lsn").and_then(Value::as_u64) {
                Some(lsn) => Some(lsn),
                None => self.item_lsn(&last).await?,
            },
            None => None,
        };
        Ok(extrapolated_lag(items, first_lsn, last_lsn, session_lsn))
    }

    /// The next page of `pages` that has items, or the last empty one once every physical
    /// partition the scope spans answered empty. One page comes from one partition: a lease
    /// whose range spans several (it split, and the lease did not yet), or a topology the SDK
    /// has not refreshed since a split or merge, answers empty for one while another has
    /// items, which is no end of the feed. How many it spans is the larger of `spanned` (the
    /// partitions read fresh) and what the continuation lists: a read that starts after a
    /// split lists only the part it is on until it moves to the next. `None` when the feed
    /// ended.
    async fn next_items(
        &self,
        pages: &mut feed::Pages,
        spanned: usize,
    ) -> Result<Option<feed::PageOf>> {
        let spanned = match buggify::on(Bug::EstimateTrustsTheToken) {
            true => 1, // the defect: only the continuation's parts count
            false => spanned,
        };
        let mut looked = 0;
        loop {
            let Some(page) = pages.next().await else {
                return Ok(None);
            };
            let page = page.map_err(QueueError::cosmos("estimate lag"))?;
            self.queue()
                .charges()
                .record_diagnostics("estimate", &page.diagnostics());
            looked += 1;
            let spans = pages
                .to_continuation_token()
                .ok()
                .and_then(|t| crate::range::continuation_ranges(t.as_str()))
                .map_or(1, |ranges| ranges.len())
                .max(spanned);
            if !page.items().is_empty() || looked >= spans {
                return Ok(Some(page));
            }
        }
    }

    /// The LSN of a message from a point read (for feeds whose items carry no `_lsn`).
    pub(crate) async fn item_lsn(&self, doc: &Value) -> Result<Option<u64>> {
        Ok(self.item_position(doc).await?.map(|(lsn, _)| lsn))
    }

    /// [`Self::item_lsn`], with the physical partition that holds the message: LSNs compare
    /// only within one partition.
    pub(crate) async fn item_position(&self, doc: &Value) -> Result<Option<(u64, Option<String>)>> {
        let field = self.queue().config().partition_key_field();
        let (Some(id), Some(pk)) = (
            doc.get("id").and_then(Value::as_str),
            doc.get(field)
                .and_then(|v| crate::message::MessageKey::from_json(v.clone()).ok()),
        ) else {
            return Ok(None);
        };
        match self
            .queue()
            .messages()
            .read_item(pk.to_partition_key(), id, None)
            .await
        {
            Ok(r) => {
                self.queue()
                    .charges()
                    .record_diagnostics("estimate", &r.diagnostics());
                let partition = r.headers().partition_key_range_id().map(str::to_owned);
                Ok(r.headers().item_lsn().map(|lsn| (lsn, partition)))
            }
            Err(e) if crate::error::status_of(&e) == crate::error::NOT_FOUND => Ok(None),
            Err(e) => Err(QueueError::cosmos("estimate lag")(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_cut_short_is_extrapolated_at_its_items_per_lsn() {
        for (items, first, last, session, expected) in [
            // Ten batches of 100 read, 40 more LSNs after them: 40 more batches.
            (1_000, 11, Some(20), 60, 5_000),
            // Single writes: one item per LSN.
            (1_000, 1, Some(1_000), 1_500, 1_500),
            // The pages end where the partition does (the session read before the last write).
            (1_000, 1, Some(10), 10, 1_000),
            (1_000, 1, Some(10), 5, 1_000),
            // One batch larger than what was read: its one LSN sets the rate.
            (1_000, 7, Some(7), 9, 3_000),
            // The last item's LSN unknown, or before the first (a replica behind): one a write.
            (1_000, 11, None, 60, 1_049),
            (1_000, 11, Some(5), 60, 1_049),
        ] {
            assert_eq!(
                extrapolated_lag(items, first, last, session),
                expected,
                "{items} items, LSNs {first}..{last:?} of {session}"
            );
        }
    }

    #[test]
    fn the_lag_is_the_lsn_distance_plus_the_first_unread_item() {
        let limit = EXACT_COUNT_LIMIT;
        for (session, first, expected) in [
            (Some(5_000), Some(1_000), LsnLag::Estimated(4_001)),
            (Some(limit + 1), Some(1), LsnLag::Estimated(limit + 1)),
            (Some(limit), Some(1), LsnLag::CountExactly), // the limit itself is counted
            (Some(1_000), Some(1_000), LsnLag::CountExactly),
            (Some(900), Some(1_000), LsnLag::CountExactly), // a session behind the item
            (None, Some(1_000), LsnLag::Unknown),
            (Some(1_000), None, LsnLag::Unknown),
        ] {
            assert_eq!(lsn_lag(session, first), expected, "{session:?} {first:?}");
        }
    }
}
