//! Change-feed leases: one document per feed range per consumer group, in the lease container.
//!
//! The model is the change feed processor's lease that users know: owner, continuation,
//! timestamp, ETag. Every change is a replace with `If-Match`, so an owner learns it lost a
//! lease (stolen, or split away) on its next renew or checkpoint, and stops.

use azure_core::http::Etag;
use azure_data_cosmos::feed::FeedRange;
use azure_data_cosmos::models::EffectivePartitionKey;
use azure_data_cosmos::options::{BatchDeleteOptions, ItemWriteOptions, Precondition};
use azure_data_cosmos::{FeedScope, PartitionKey, TransactionalBatch};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tracing::{info, warn};

use crate::config::StartFrom;
use crate::cosmos::sql;
use crate::error::{status_of, QueueError, Result, CONFLICT, NOT_FOUND, PRECONDITION_FAILED};
use crate::queue::Queue;
use crate::range::{epk_cmp, missing_leases, narrow_continuation, range_bounds, split_children};

/// The `type` of lease documents in the lease container.
pub const LEASE_DOC_TYPE: &str = "lease";

/// The `type` of host heartbeat documents in the lease container (see [`Beat`]).
pub const BEAT_DOC_TYPE: &str = "host";

/// A host's heartbeat: one document per live lease holder of a group, next to the group's
/// leases (same partition, so the listing that reads them reads it). Renewed every
/// `leaseRenew`, it keeps alive each lease it lists (those its holder runs) whose window
/// holds nothing the app may have ([`Window::may_be_in_app`]): a host with twenty idle
/// leases renews one document, not twenty. A lease that may have deliveries in the app is
/// still renewed by itself, since what it advertises (the lock of those deliveries) is judged
/// by it alone; a lease its holder no longer runs (its range stopped) is left out of the next
/// heartbeat, and expires as it always did.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Beat {
    /// `host|<group>|<pod>|<incarnation>` (see [`beat_id`]).
    pub id: String,
    /// The group's lease partition ([`lease_pk`]).
    pub pk: String,
    /// Always [`BEAT_DOC_TYPE`].
    #[serde(rename = "type")]
    pub doc_type: String,
    /// The group.
    pub group: String,
    /// The lease holder it speaks for, as leases name it (`<owner>#<incarnation>`).
    pub holder: String,
    /// When it was last written, epoch ms (the holder's clock; for people and tools: hosts
    /// judge by how long they have seen a version unchanged).
    pub timestamp: i64,
    /// The ids of the leases its holder runs, as it wrote them.
    #[serde(default)]
    pub leases: Vec<String>,
    /// Cosmos per-item TTL (s): a dead holder's document goes by itself.
    pub ttl: i64,
    /// The document's ETag as last read.
    #[serde(rename = "_etag", default, skip_serializing)]
    pub etag: Option<String>,
}

impl Beat {
    /// The heartbeat of `holder` in `group`, running `leases`, written at `now`.
    pub fn new(group: &str, holder: &str, leases: Vec<String>, now: i64, expire_ms: i64) -> Self {
        Self {
            id: beat_id(group, holder),
            pk: lease_pk(group),
            doc_type: BEAT_DOC_TYPE.into(),
            group: group.into(),
            holder: holder.into(),
            timestamp: now,
            leases,
            ttl: (expire_ms / 1000 * 10).max(BEAT_TTL_FLOOR_SECS),
            etag: None,
        }
    }
}

/// A heartbeat outlives its last write by at least this (s), and ten lease expiries.
const BEAT_TTL_FLOOR_SECS: i64 = 3600;

/// The id of `holder`'s heartbeat in `group`: `host|<group>|<pod>|<incarnation>` (Cosmos DB
/// ids may not hold `#`, which holders do).
pub fn beat_id(group: &str, holder: &str) -> String {
    format!("host|{group}|{}", holder.replace('#', "|"))
}

/// A change-feed lease: one feed range of one group.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Lease {
    /// `lease|<group>|<min epk>|<max epk>`.
    pub id: String,
    /// `lease|<group>`: a group's leases share one logical partition, so listing them is cheap.
    pub pk: String,
    /// Always [`LEASE_DOC_TYPE`].
    #[serde(rename = "type")]
    pub doc_type: String,
    /// The group whose lease it is.
    pub group: String,
    /// The feed range, as effective partition key bounds in hex (`""` .. `"FF"`).
    pub min_epk: String,
    /// The range's upper bound (exclusive).
    pub max_epk: String,
    /// The host holding it; `None` when free.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// Where reading resumes (the SDK's change-feed continuation token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub continuation: Option<String>,
    /// Last acquire, renew or checkpoint by the owner, epoch ms: the owner's heartbeat.
    pub timestamp: i64,
    /// When the last checkpoint was written (epoch ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpointed_at: Option<i64>,
    /// A host that asked for this lease (stream groups hand leases over instead of having them
    /// stolen: the owner drains, checkpoints and releases, so nothing is delivered twice).
    /// Kept on release: the freed lease is reserved for the asker until `handover_at` expires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handover_to: Option<String>,
    /// When the hand-over was asked for (epoch ms); the reservation ends a lease expiry later.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handover_at: Option<i64>,
    /// What the owner handed out past the continuation (exclusive groups on the lease write
    /// path): written before a page is delivered and with every checkpoint, so the range's
    /// next owner skips what is done and knows what is a redelivery.
    #[serde(default, skip_serializing_if = "Window::is_empty")]
    pub window: Window,
    /// The write path of the exclusive host that last recorded the lease. A lease-path host
    /// taking a lease last written otherwise (an older version, or `claims`) looks for state
    /// documents through its first window, since its deliveries wrote claims.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writes: Option<crate::config::ExclusiveWrites>,
    /// Set while the app may have deliveries of the window ([`Window::may_be_in_app`]) whose
    /// only lock is this lease and the group's lock duration (ms) is shorter than the lease
    /// expiry: the lease is then expired once unchanged for this long, so a dead owner's
    /// deliveries come back within the lock duration, as claims' do. Its owner renews it at
    /// least three times per this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lock_ms: Option<u64>,
    /// The document's ETag as last read: every change is `If-Match` on it.
    #[serde(rename = "_etag", default, skip_serializing)]
    pub etag: Option<String>,
}

/// The messages past a lease's continuation that its owner has read and handed out: the
/// in-flight window, bounded by the range's in-flight limit.
///
/// The continuation moves by whole pages, so one slow message holds it while later ones
/// settle; this records their fate without a write per message. Each list names messages by
/// identity ([`crate::identity::fingerprint`] of id and key), never by position: a document
/// that leaves by TTL, or a split that gives half of the window's documents to another range,
/// moves positions, never identities.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Window {
    /// [`WINDOW_IDENTITIES`] when the lists hold identities. Absent in windows of older
    /// versions: their lists hold ids, and `read` counts positions.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub v: u32,
    /// Older versions: feed documents read past the continuation and handed out.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub read: u32,
    /// Settled: completed (recorded here and nowhere else) or settled by a state document.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub done: Vec<String>,
    /// A state document brings them back (a retry, a schedule, long work under its own lock).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pending: Vec<String>,
    /// Older versions: handed out but never started, listed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unstarted: Vec<String>,
    /// Handed out but never started (the range drained first, or an ordered message still
    /// waits for its key's turn): first deliveries still. Kept as filters, not lists: what
    /// they say "maybe" to is looked up before it is delivered, which costs a reader a state
    /// read for the rare false "maybe", and saves every write of a page 18 bytes a message.
    /// One filter of the writer's own, and those it inherited and has not read past.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub maybe_unstarted: Vec<crate::identity::IdentityFilter>,
    /// Started with no outcome recorded: the app may have them. A next owner that took the
    /// lease without a hand-over delivers them again, as redeliveries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub started: Vec<String>,
    /// The last document before the continuation. A feed that serves the continuation from
    /// an earlier position (the emulator after a partition merge renumbers its LSNs) would
    /// deliver again what was completed here, with no state document to say so: the next
    /// reader skips up to this document instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<Marker>,
    /// `after` for each EPK sub-range the continuation keeps its own position for (once the
    /// range spanned several partitions), when there are several: `after` alone is the last
    /// document of one of them, and says nothing of where the others stand. Older versions
    /// read `after` only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub after_each: Vec<Marker>,
    /// The lists came with a split: they may name documents of the sibling range, which this
    /// range never reads (estimates do not count them as this range's).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub split: bool,
    /// Deliveries may have started since this write: a start is listed with the range's next
    /// write, not before it happens (one write a page, not one per batch of starts), so
    /// `maybe_unstarted` may hold messages the app has. A next owner that takes the lease from its
    /// holder waits for their lock, and lists each one's start before it starts it: a count
    /// may then repeat, never skip. A holder's last write (it drained, or handed the lease
    /// over) lists every start.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub starts_lag: bool,
}

/// [`Window::v`] of windows whose lists hold identities.
pub const WINDOW_IDENTITIES: u32 = 2;

/// A message of the messages container: its id and partition key value.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Marker {
    /// The document's id.
    pub id: String,
    /// Its partition key value as stored.
    pub pk: serde_json::Value,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl Window {
    /// The last document before the continuation, in each sub-range that has one.
    pub fn markers(&self) -> Vec<Marker> {
        match self.after_each.is_empty() {
            true => self.after.iter().cloned().collect(),
            false => self.after_each.clone(),
        }
    }

    /// Nothing handed out past the continuation.
    pub fn is_empty(&self) -> bool {
        self.read == 0
            && self.after.is_none()
            && self.after_each.is_empty()
            && self.done.is_empty()
            && self.pending.is_empty()
            && self.unstarted.is_empty()
            && self.maybe_unstarted.is_empty()
            && self.started.is_empty()
    }

    /// Whether the app may have messages of this window: started ones, or unstarted ones
    /// whose starts lag (see [`Self::starts_lag`]).
    pub fn may_be_in_app(&self) -> bool {
        let unstarted = !self.maybe_unstarted.is_empty() || !self.unstarted.is_empty();
        !self.started.is_empty() || (self.starts_lag && unstarted)
    }

    /// Whether the lists hold identities (this version's windows) rather than ids.
    pub fn by_identity(&self) -> bool {
        self.v >= WINDOW_IDENTITIES
    }

    /// Whether `id` under `key` is in `list` (identities, or ids in older windows).
    pub fn lists(&self, list: &[String], id: &str, key: &crate::message::MessageKey) -> bool {
        match self.by_identity() {
            true => {
                let fingerprint = crate::identity::fingerprint(id, key);
                list.contains(&fingerprint)
            }
            false => list.iter().any(|x| x == id),
        }
    }
}

impl Lease {
    /// A free lease of `group` on `[min_epk, max_epk)`, starting at `continuation`.
    pub fn new(
        group: &str,
        min_epk: &str,
        max_epk: &str,
        continuation: Option<String>,
        now: i64,
    ) -> Self {
        Self {
            id: format!("lease|{group}|{min_epk}|{max_epk}"),
            pk: lease_pk(group),
            doc_type: LEASE_DOC_TYPE.into(),
            group: group.into(),
            min_epk: min_epk.into(),
            max_epk: max_epk.into(),
            owner: None,
            continuation,
            timestamp: now,
            checkpointed_at: None,
            handover_to: None,
            handover_at: None,
            window: Window::default(),
            writes: None,
            lock_ms: None,
            etag: None,
        }
    }

    /// Whether a hand-over to someone other than `me` is pending (asked within `expire_ms`).
    pub fn reserved_for_other(&self, me: &str, now: i64, expire_ms: i64) -> bool {
        self.handover_to.as_deref().is_some_and(|to| to != me)
            && self.handover_at.is_some_and(|at| now - at < expire_ms)
    }

    /// The range this lease reads.
    pub fn feed_range(&self) -> Result<FeedRange> {
        let bound = |hex: &str| {
            EffectivePartitionKey::try_from(hex).map_err(|e| {
                QueueError::Config(format!("lease {}: bad range bound {hex:?}: {e}", self.id))
            })
        };
        FeedRange::new(bound(&self.min_epk)?, bound(&self.max_epk)?)
            .map_err(|e| QueueError::Config(format!("lease {}: {e}", self.id)))
    }

    /// Whether its owner missed renewing it for `expire_ms`, by the owner's wall clock (what
    /// tools outside a host judge by; hosts judge by their own observation, see
    /// [`Self::unchanged_expiry_ms`]). `beats`: the group's heartbeats, which keep a lease
    /// alive while nothing of its window may be in the app (see [`Beat`]).
    pub fn is_expired(&self, beats: &[Beat], now: i64, expire_ms: i64) -> bool {
        self.owner.is_none() || self.heartbeat(beats) + expire_ms < now
    }

    /// When its owner last showed it was alive, epoch ms: the lease's own timestamp, or its
    /// holder's heartbeat where that keeps the lease (see [`Beat`]).
    pub fn heartbeat(&self, beats: &[Beat]) -> i64 {
        match self.riding(beats) {
            Some(beat) => beat.timestamp.max(self.timestamp),
            None => self.timestamp,
        }
    }

    /// The heartbeat that keeps this lease alive, if one does: its owner's, when it lists the
    /// lease and nothing of the window may be in the app.
    pub fn riding<'a>(&self, beats: &'a [Beat]) -> Option<&'a Beat> {
        let owner = self.owner.as_deref()?;
        if self.window.may_be_in_app() {
            return None;
        }
        beats
            .iter()
            .find(|b| b.holder == owner && b.leases.contains(&self.id))
    }

    /// How long this version of the lease must stay unchanged before another host may take it:
    /// `expire_ms`, or the lock duration it advertises while it is the only lock of started
    /// deliveries (see [`Self::lock_ms`]).
    pub fn unchanged_expiry_ms(&self, expire_ms: i64) -> i64 {
        if crate::buggify::on(crate::buggify::Bug::RecoveryWaitsForLeaseExpiry) {
            return expire_ms;
        }
        match self.lock_ms {
            Some(lock) if self.window.may_be_in_app() => expire_ms.min(lock as i64),
            _ => expire_ms,
        }
    }

    /// A short name for logs: the range bounds.
    pub fn range_label(&self) -> String {
        format!("{}..{}", short(&self.min_epk), short(&self.max_epk))
    }
}

fn short(hex: &str) -> &str {
    if hex.is_empty() {
        "00"
    } else {
        &hex[..hex.len().min(8)]
    }
}

/// The partition key of a group's leases.
pub fn lease_pk(group: &str) -> String {
    format!("lease|{group}")
}

/// What [`LeaseStore::reconcile`] found.
#[derive(Clone, Debug)]
pub struct Reconciled {
    /// The group's leases, including those just created.
    pub leases: Vec<Lease>,
    /// Leases whose range split; a host splits them once it owns them.
    pub split_pending: Vec<String>,
    /// The group's hosts' heartbeats, as listed with the leases.
    pub beats: Vec<Beat>,
}

/// Reads and writes a group's leases.
#[derive(Clone)]
pub struct LeaseStore {
    queue: Queue,
    group: String,
    start_from: StartFrom,
    writes: Option<crate::config::ExclusiveWrites>,
}

impl LeaseStore {
    /// The leases of `group` in `queue`'s lease container.
    pub fn new(queue: Queue, group: impl Into<String>) -> Self {
        Self {
            queue,
            group: group.into(),
            start_from: StartFrom::Beginning,
            writes: None,
        }
    }

    /// Marks the leases this store creates as written by an exclusive host on `writes`: a
    /// new lease has no deliveries behind it, so its first owner need not look for claims.
    pub fn with_writes(mut self, writes: crate::config::ExclusiveWrites) -> Self {
        self.writes = Some(writes);
        self
    }

    /// Where a new group's leases start. `Now` pins each new lease at the feed's current
    /// position when it is created, so "now" means the group's creation — whoever creates the
    /// leases (the first host, or the operator for a group still at zero replicas) — and what
    /// arrives before the first host starts is counted by the estimator and delivered.
    pub fn with_start_from(mut self, start_from: StartFrom) -> Self {
        self.start_from = start_from;
        self
    }

    /// The feed's current position in a range (a token that reads only what comes after).
    async fn position_now(&self, min: &str, max: &str) -> Result<Option<String>> {
        let range = Lease::new(&self.group, min, max, None, 0).feed_range()?;
        let mut pages = crate::cosmos::feed::open(
            self.queue.messages(),
            FeedScope::range(range),
            StartFrom::Now,
            None,
            1,
            "pin lease at now",
        )
        .await?;
        if let Some(page) = pages.next().await {
            let page = page.map_err(QueueError::cosmos("pin lease at now"))?;
            self.queue
                .charges()
                .record_diagnostics("pin lease at now", &page.diagnostics());
        }
        Ok(pages
            .to_continuation_token()
            .ok()
            .map(|t| t.as_str().to_owned()))
    }

    /// The group.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// All of the group's leases, in range order.
    pub async fn list(&self) -> Result<Vec<Lease>> {
        Ok(self.list_with_beats().await?.0)
    }

    /// The group's leases, in range order, and its hosts' heartbeats: one query.
    pub async fn list_with_beats(&self) -> Result<(Vec<Lease>, Vec<Beat>)> {
        let query = sql::query(
            "SELECT * FROM c WHERE c.type = @lease OR c.type = @beat",
            &[
                ("@lease", json!(LEASE_DOC_TYPE)),
                ("@beat", json!(BEAT_DOC_TYPE)),
            ],
        )?;
        let docs: Vec<serde_json::Value> = sql::collect(
            self.queue.leases(),
            query,
            FeedScope::partition(PartitionKey::from(lease_pk(&self.group))),
            None,
            self.queue.charges(),
            "list leases",
        )
        .await?;
        let mut leases: Vec<Lease> = Vec::new();
        let mut beats: Vec<Beat> = Vec::new();
        for doc in docs {
            let beat = doc.get("type").and_then(|t| t.as_str()) == Some(BEAT_DOC_TYPE);
            let parsed = match beat {
                true => serde_json::from_value(doc).map(|b| beats.push(b)),
                false => serde_json::from_value(doc).map(|l| leases.push(l)),
            };
            parsed.map_err(|e| {
                QueueError::Config(format!(
                    "group {}: a lease document that does not parse: {e}",
                    self.group
                ))
            })?;
        }
        leases.sort_by(|a, b| epk_cmp(&a.min_epk, &b.min_epk));
        Ok((leases, beats))
    }

    /// Writes `holder`'s heartbeat for the `leases` it runs (creating it if it is gone): the
    /// one write a round that keeps every idle lease of the holder alive.
    pub async fn beat(
        &self,
        holder: &str,
        leases: Vec<String>,
        now: i64,
        expire_ms: i64,
    ) -> Result<Beat> {
        let beat = Beat::new(&self.group, holder, leases, now, expire_ms);
        let r = self
            .queue
            .leases()
            .upsert_item(beat.pk.clone(), &beat.id, &beat, None)
            .await
            .map_err(QueueError::cosmos("write heartbeat"))?;
        self.queue
            .charges()
            .record_diagnostics("write heartbeat", &r.diagnostics());
        Ok(Beat {
            etag: r.headers().etag().map(|e| e.to_string()),
            ..beat
        })
    }

    /// Removes `holder`'s heartbeat (a graceful stop, once its leases are released).
    pub async fn forget_beat(&self, holder: &str) -> Result<()> {
        match self
            .queue
            .leases()
            .delete_item(lease_pk(&self.group), &beat_id(&self.group, holder), None)
            .await
        {
            Ok(r) => {
                self.queue
                    .charges()
                    .record_diagnostics("delete heartbeat", &r.diagnostics());
                Ok(())
            }
            Err(e) if status_of(&e) == NOT_FOUND => Ok(()),
            Err(e) => Err(QueueError::cosmos("delete heartbeat")(e)),
        }
    }

    /// One lease as stored now.
    pub async fn read(&self, id: &str) -> Result<Option<Lease>> {
        match self
            .queue
            .leases()
            .read_item(lease_pk(&self.group), id, None)
            .await
        {
            Ok(r) => {
                self.queue
                    .charges()
                    .record_diagnostics("read lease", &r.diagnostics());
                Ok(Some(
                    r.into_model().map_err(QueueError::cosmos("read lease"))?,
                ))
            }
            Err(e) if status_of(&e) == NOT_FOUND => Ok(None),
            Err(e) => Err(QueueError::cosmos("read lease")(e)),
        }
    }

    /// Makes sure every physical range of the messages container is covered by a lease:
    /// creates the leases of a new group, and splits the lease of a range that split once
    /// nobody holds it. Returns the leases and the ids of held leases whose range split (their
    /// owners should hand them back so they can be split).
    pub async fn reconcile(&self, now: i64, expire_ms: i64) -> Result<Reconciled> {
        self.reconcile_with(now, expire_ms, 1).await
    }

    /// [`Self::reconcile`]; a new group gets `per_partition` leases per physical range (finer
    /// leases, so more hosts than physical partitions can share the work).
    pub async fn reconcile_with(
        &self,
        now: i64,
        expire_ms: i64,
        per_partition: u32,
    ) -> Result<Reconciled> {
        self.reconcile_judged(now, per_partition, |l: &Lease, beats: &[Beat]| {
            l.is_expired(beats, now, expire_ms)
        })
        .await
    }

    /// [`Self::reconcile_with`] where `expired` says which leases nobody holds (a host judges
    /// by how long it has seen a lease unchanged, not by another host's clock).
    pub async fn reconcile_judged(
        &self,
        now: i64,
        per_partition: u32,
        expired: impl Fn(&Lease, &[Beat]) -> bool,
    ) -> Result<Reconciled> {
        // Refreshed each round: the SDK's cached topology would hide a split.
        let ranges = self.queue.feed_ranges().await?;
        let physical: Vec<(String, String)> = ranges.iter().map(range_bounds).collect();
        let (mut leases, mut beats) = self.list_with_beats().await?;
        // A new group's leases, or those an interrupted creation (an error after some were
        // written) left out: a range without a lease would never be read.
        let bounds: Vec<(String, String)> = leases
            .iter()
            .map(|l| (l.min_epk.clone(), l.max_epk.clone()))
            .collect();
        let missing = missing_leases(&physical, &bounds, per_partition);
        if !missing.is_empty() {
            for (lo, hi) in &missing {
                let position = match self.start_from {
                    StartFrom::Now => self.position_now(lo, hi).await?,
                    StartFrom::Beginning => None,
                };
                let mut lease = Lease::new(&self.group, lo, hi, position, now);
                lease.writes = self.writes;
                self.create(&lease).await?;
            }
            info!(group = %self.group, leases = missing.len(), existing = leases.len(), "created leases for the ranges without one");
            (leases, beats) = self.list_with_beats().await?;
            if bounds.is_empty() {
                return Ok(Reconciled {
                    leases,
                    split_pending: Vec::new(),
                    beats,
                });
            }
        }
        let mut split_pending = Vec::new();
        let mut changed = false;
        for lease in &leases {
            let children = split_children(&lease.min_epk, &lease.max_epk, &physical);
            if children.is_empty() {
                continue;
            }
            if expired(lease, &beats) {
                self.split(lease, &children, now).await?;
                changed = true;
            } else {
                split_pending.push(lease.id.clone());
            }
        }
        if changed {
            (leases, beats) = self.list_with_beats().await?;
        }
        Ok(Reconciled {
            leases,
            split_pending,
            beats,
        })
    }

    /// Replaces a free lease whose range split by one lease per child range, each continuing
    /// from the parent's position. One transactional batch (a group's leases share a partition
    /// key) deletes the parent `If-Match` the version read and writes the children, so either
    /// the split happens from that version or nothing is written: if another host took the
    /// parent meanwhile (its view did not show the split yet) and moved its checkpoint, children
    /// from the older checkpoint never appear next to it, to be read a second time.
    pub async fn split(
        &self,
        parent: &Lease,
        children: &[(String, String)],
        now: i64,
    ) -> Result<()> {
        let mut batch = TransactionalBatch::new(parent.pk.clone()).delete_item(
            parent.id.clone(),
            Some(
                BatchDeleteOptions::default().with_precondition(Precondition::if_match(
                    Etag::from(parent.etag.clone().unwrap_or_default()),
                )),
            ),
        );
        for (min, max) in children {
            let continuation = parent.continuation.as_deref().map(|t| {
                narrow_continuation(t, min, max).unwrap_or_else(|| {
                    warn!(group = %self.group, lease = %parent.id, "continuation format not understood; child resumes from the parent's token");
                    t.to_owned()
                })
            });
            // Upsert: children an interrupted split of an earlier version left behind are
            // brought up to the parent's checkpoint.
            // The parent's window goes to both children: each finds the messages of its own
            // range in it, by identity, and the other child's never appear in its feed.
            let mut child = Lease::new(&self.group, min, max, continuation, now);
            child.window = parent.window.clone();
            child.window.split = parent.window.by_identity();
            child.writes = parent.writes;
            batch = batch
                .upsert_item(child, None)
                .map_err(QueueError::cosmos("build lease split"))?;
        }
        let status = match self
            .queue
            .leases()
            .execute_transactional_batch(batch, None)
            .await
        {
            Ok(response) => {
                self.queue
                    .charges()
                    .record_diagnostics("split lease", &response.diagnostics());
                let whole = u16::from(response.status().status_code());
                if whole == 207 || !(200..300).contains(&whole) {
                    // A rejected batch names the operation that failed; the others say 424.
                    response
                        .into_model()
                        .ok()
                        .and_then(|m| {
                            m.results()
                                .iter()
                                .map(|r| r.status_code())
                                .find(|s| !(200..300).contains(s) && *s != 424)
                        })
                        .unwrap_or(if whole == 207 { 500 } else { whole })
                } else {
                    whole
                }
            }
            Err(e) => status_of(&e),
        };
        match status {
            200..=299 => {
                info!(group = %self.group, parent = %parent.range_label(), children = children.len(), "lease split: children continue from the parent's checkpoint");
                Ok(())
            }
            PRECONDITION_FAILED | NOT_FOUND => {
                info!(group = %self.group, parent = %parent.range_label(), "lease split skipped: the parent changed since it was read (taken, or split by another host)");
                Ok(())
            }
            status => Err(QueueError::Cosmos {
                operation: "split lease",
                status,
                sub_status: None,
                message: format!("splitting lease {}", parent.id),
                answered: false,
                request_id: None,
            }),
        }
    }

    async fn create(&self, lease: &Lease) -> Result<()> {
        match self
            .queue
            .leases()
            .create_item(lease.pk.clone(), &lease.id, lease, None)
            .await
        {
            Ok(r) => {
                self.queue
                    .charges()
                    .record_diagnostics("create lease", &r.diagnostics());
                Ok(())
            }
            Err(e) if status_of(&e) == CONFLICT => Ok(()),
            Err(e) => Err(QueueError::cosmos("create lease")(e)),
        }
    }

    /// Writes `next` over the lease as last seen (`If-Match`); `Lost` when someone else changed
    /// it since (stolen, split, or released).
    pub async fn replace(&self, next: &Lease, op: &'static str) -> Result<Lease, LeaseError> {
        let options = ItemWriteOptions::default().with_precondition(Precondition::if_match(
            Etag::from(next.etag.clone().unwrap_or_default()),
        ));
        match self
            .queue
            .leases()
            .replace_item(next.pk.clone(), &next.id, next, Some(options))
            .await
        {
            Ok(r) => {
                self.queue
                    .charges()
                    .record_diagnostics(op, &r.diagnostics());
                let mut written = next.clone();
                written.etag = r.headers().etag().map(|e| e.to_string());
                Ok(written)
            }
            Err(e) if matches!(status_of(&e), PRECONDITION_FAILED | NOT_FOUND) => {
                Err(LeaseError::Lost)
            }
            Err(e) => Err(LeaseError::Other(QueueError::cosmos(op)(e))),
        }
    }

    /// Takes `lease` for `owner` (free, expired, or stolen: the caller decided). A hand-over
    /// asked of `owner` itself stands when it takes its own lease back (its range stopped when
    /// lease writes failed): the new range sees the request and hands the lease over at once.
    /// Cleared, the request would go unanswered and the owner keep the lease from the asker.
    pub async fn acquire(&self, lease: &Lease, owner: &str, now: i64) -> Result<Lease, LeaseError> {
        let mut next = lease.clone();
        let asked_of_owner = lease.owner.as_deref() == Some(owner)
            && lease.handover_to.as_deref().is_some_and(|to| to != owner);
        next.owner = Some(owner.into());
        next.timestamp = now;
        if !asked_of_owner {
            next.handover_to = None;
            next.handover_at = None;
        }
        self.replace(&next, "acquire lease").await
    }

    /// Asks the owner of `lease` to hand it over to `to` (the owner's heartbeat is kept).
    pub async fn request_handover(
        &self,
        lease: &Lease,
        to: &str,
        now: i64,
    ) -> Result<Lease, LeaseError> {
        let mut next = lease.clone();
        next.handover_to = Some(to.into());
        next.handover_at = Some(now);
        self.replace(&next, "request lease").await
    }

    /// Renews an owned lease (its heartbeat); [`LeaseError::Lost`] when it is no longer ours.
    pub async fn renew(&self, lease: &Lease, now: i64) -> Result<Lease, LeaseError> {
        let mut next = lease.clone();
        next.timestamp = now;
        self.replace(&next, "renew lease").await
    }

    /// Writes a checkpoint on an owned lease.
    pub async fn checkpoint(
        &self,
        lease: &Lease,
        continuation: String,
        now: i64,
    ) -> Result<Lease, LeaseError> {
        let mut next = lease.clone();
        next.continuation = Some(continuation);
        next.timestamp = now;
        next.checkpointed_at = Some(now);
        self.replace(&next, "checkpoint").await
    }

    /// Writes the continuation and the window past it (the lease write path's record): also a
    /// renewal, and a fence, since it fails once another host owns the lease. `lock_ms`: the
    /// lock duration the lease advertises for its started deliveries (see [`Lease::lock_ms`]).
    pub async fn record(
        &self,
        lease: &Lease,
        continuation: Option<String>,
        window: Window,
        writes: crate::config::ExclusiveWrites,
        lock_ms: Option<u64>,
        now: i64,
    ) -> Result<Lease, LeaseError> {
        let mut next = lease.clone();
        next.writes = Some(writes);
        next.lock_ms = lock_ms.filter(|_| window.may_be_in_app());
        if continuation != next.continuation {
            next.checkpointed_at = Some(now);
        }
        next.continuation = continuation;
        next.window = window;
        next.timestamp = now;
        self.replace(&next, "record window").await
    }

    /// Hands a lease back at once (graceful stop) so another host takes it without waiting
    /// for expiry.
    pub async fn release(&self, lease: &Lease) -> Result<(), LeaseError> {
        let mut next = lease.clone();
        next.owner = None;
        self.replace(&next, "release lease").await.map(|_| ())
    }
}

/// Why a lease write did not happen.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// Someone else changed the lease: it was stolen, split or released; stop using it.
    #[error("lease lost")]
    Lost,
    /// Any other failure; retried.
    #[error(transparent)]
    Other(QueueError),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expiry_and_ids() {
        let mut lease = Lease::new("g", "", "FF", None, 1_000);
        assert_eq!(lease.id, "lease|g||FF");
        assert!(
            lease.is_expired(&[], 1_000, 60_000),
            "free leases are available"
        );
        lease.owner = Some("a".into());
        assert!(!lease.is_expired(&[], 61_000, 60_000));
        assert!(lease.is_expired(&[], 61_001, 60_000));
        // Its holder's heartbeat keeps an idle lease, not one whose window may be in the app.
        let beats = [Beat::new("g", "a", vec![lease.id.clone()], 50_000, 60_000)];
        assert!(!lease.is_expired(&beats, 110_000, 60_000));
        assert!(lease.is_expired(&beats, 110_001, 60_000));
        assert_eq!(lease.heartbeat(&beats), 50_000);
        let others = [Beat::new("g", "b", vec![lease.id.clone()], 50_000, 60_000)];
        assert!(
            lease.is_expired(&others, 61_001, 60_000),
            "another holder's beat"
        );
        let stopped = [Beat::new("g", "a", Vec::new(), 50_000, 60_000)];
        assert!(
            lease.is_expired(&stopped, 61_001, 60_000),
            "a beat that does not list it"
        );
        lease.window.started.push("x".into());
        assert!(
            lease.is_expired(&beats, 61_001, 60_000),
            "in the app: the lease alone"
        );
        assert_eq!(beats[0].ttl, 3600);
        assert_eq!(
            beat_id("g", "pod-1#5c1e9a0b"),
            "host|g|pod-1|5c1e9a0b",
            "Cosmos DB ids may not hold '#'"
        );
        assert_eq!(lease.range_label(), "00..FF");
    }
}
