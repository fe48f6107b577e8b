//! Change-feed leases: one document per feed range per consumer group, in the lease container.
//!
//! The model is the change feed processor's lease that users know: owner, continuation,
//! timestamp, ETag. Every change is a replace with `If-Match`, so an owner learns it lost a
//! lease (stolen, or split away) on its next renew or checkpoint, and stops.

use azure_core::http::Etag;
use azure_data_cosmos::feed::FeedRange;
use azure_data_cosmos::models::EffectivePartitionKey;
use azure_data_cosmos::options::{
    BatchDeleteOptions, ItemWriteOptions, Precondition, ReadFeedRangesOptions,
};
use azure_data_cosmos::{FeedScope, PartitionKey, TransactionalBatch};
use base64::Engine as _;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tracing::{info, warn};

use crate::config::StartFrom;
use crate::error::{status_of, QueueError, Result, CONFLICT, NOT_FOUND, PRECONDITION_FAILED};
use crate::queue::Queue;
use crate::sql;

pub const LEASE_DOC_TYPE: &str = "lease";

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Lease {
    /// `lease|<group>|<min epk>|<max epk>`.
    pub id: String,
    /// `lease|<group>`: a group's leases share one logical partition, so listing them is cheap.
    pub pk: String,
    #[serde(rename = "type")]
    pub doc_type: String,
    pub group: String,
    /// The feed range, as effective partition key bounds in hex (`""` .. `"FF"`).
    pub min_epk: String,
    pub max_epk: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// Where reading resumes (the SDK's change-feed continuation token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub continuation: Option<String>,
    /// Last acquire, renew or checkpoint by the owner, epoch ms: the owner's heartbeat.
    pub timestamp: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpointed_at: Option<i64>,
    /// A host that asked for this lease (stream groups hand leases over instead of having them
    /// stolen: the owner drains, checkpoints and releases, so nothing is delivered twice).
    /// Kept on release: the freed lease is reserved for the asker until `handover_at` expires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handover_to: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handover_at: Option<i64>,
    #[serde(rename = "_etag", default, skip_serializing)]
    pub etag: Option<String>,
}

impl Lease {
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

    pub fn is_expired(&self, now: i64, expire_ms: i64) -> bool {
        self.owner.is_none() || self.timestamp + expire_ms < now
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

pub fn lease_pk(group: &str) -> String {
    format!("lease|{group}")
}

/// Hex bounds of a feed range.
pub fn range_bounds(range: &FeedRange) -> (String, String) {
    (
        range.min_inclusive().to_hex(),
        range.max_exclusive().to_hex(),
    )
}

/// Compares hex EPKs in key order ("" is the minimum, "FF" the maximum).
pub fn epk_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    a.to_ascii_uppercase().cmp(&b.to_ascii_uppercase())
}

/// The effective partition key (hex, as lease bounds are) of a message key in a container
/// partitioned by `definition`.
pub fn key_epk(
    key: &crate::message::MessageKey,
    definition: &azure_data_cosmos::models::PartitionKeyDefinition,
) -> String {
    FeedRange::for_partition(key.to_partition_key(), definition)
        .min_inclusive()
        .to_hex()
}

/// Whether `epk` falls in the range `[min, max)`.
pub fn epk_in(epk: &str, min: &str, max: &str) -> bool {
    epk_cmp(epk, min).is_ge() && epk_cmp(epk, max).is_lt()
}

/// Narrows a continuation token of a parent range to one of its sub-ranges (a split child),
/// keeping the parent's position: the child partition continues the parent's LSNs, as the
/// change feed processor's child leases do. `None` if the token's format is not understood
/// (the child then starts from the parent's token as is: at-least-once, nothing skipped).
pub fn narrow_continuation(token: &str, min_epk: &str, max_epk: &str) -> Option<String> {
    let body = token.strip_prefix("c1.")?;
    let engine = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let mut state: Value = serde_json::from_slice(&engine.decode(body).ok()?).ok()?;
    let active = state
        .get_mut("root")?
        .get_mut("active_tokens")?
        .as_array_mut()?;
    let mut narrowed = Vec::new();
    for t in active.iter() {
        let lo = t.get("min_epk")?.as_str()?;
        let hi = t.get("max_epk")?.as_str()?;
        // Keep the parts overlapping [min_epk, max_epk), clipped to it.
        let new_lo = if epk_cmp(lo, min_epk).is_lt() {
            min_epk
        } else {
            lo
        };
        let new_hi = if epk_cmp(hi, max_epk).is_gt() {
            max_epk
        } else {
            hi
        };
        if epk_cmp(new_lo, new_hi).is_lt() {
            let mut t = t.clone();
            t["min_epk"] = json!(new_lo);
            t["max_epk"] = json!(new_hi);
            narrowed.push(t);
        }
    }
    if narrowed.is_empty() {
        return None;
    }
    *active = narrowed;
    Some(format!(
        "c1.{}",
        engine.encode(serde_json::to_vec(&state).ok()?)
    ))
}

/// Hash v2 effective partition keys have their two top bits cleared: every key is below this.
const HASH_V2_END: u128 = 0x40 << 120;

/// Splits `[min, max)` into `parts` EPK sub-ranges holding equal shares of the keys (hex
/// bounds, 16 bytes; `"FF"` ends the key space, which hash v2 fills only up to `40…`).
pub fn subdivide(min: &str, max: &str, parts: u32) -> Vec<(String, String)> {
    let value = |hex: &str| -> Option<u128> {
        if hex.eq_ignore_ascii_case("FF") {
            return Some(HASH_V2_END);
        }
        let padded = format!("{hex:0<32}");
        u128::from_str_radix(padded.get(..32)?, 16).ok()
    };
    let (Some(lo), Some(hi)) = (value(min), value(max)) else {
        return vec![(min.to_owned(), max.to_owned())];
    };
    if parts <= 1 || hi <= lo {
        return vec![(min.to_owned(), max.to_owned())];
    }
    let step = (hi - lo) / u128::from(parts);
    let mut bounds: Vec<String> = vec![min.to_owned()];
    for i in 1..parts {
        bounds.push(format!("{:032X}", lo + step * u128::from(i)));
    }
    bounds.push(max.to_owned());
    bounds
        .windows(2)
        .map(|w| (w[0].clone(), w[1].clone()))
        .collect()
}

/// The leases to create so that every physical range is read: the parts no lease covers. A
/// part is cut along the same grid as a new group's finer leases (`per_partition`), so hosts
/// that see different stages of one creation write the same leases, never overlapping ones.
pub fn missing_leases(
    physical: &[(String, String)],
    leases: &[(String, String)],
    per_partition: u32,
) -> Vec<(String, String)> {
    // Same point, same key: pad to 16 bytes ("FF" is the end of the key space).
    let key = |hex: &str| {
        if hex.eq_ignore_ascii_case("FF") {
            "FF".to_owned()
        } else {
            format!("{:0<32}", hex.to_ascii_uppercase())
        }
    };
    let mut covered: Vec<&(String, String)> = leases.iter().collect();
    covered.sort_by_key(|(min, _)| key(min));
    let mut missing = Vec::new();
    for (pmin, pmax) in physical {
        let mut gaps = Vec::new();
        let mut cursor = pmin.as_str();
        for (lmin, lmax) in &covered {
            if key(lmax) <= key(cursor) || key(lmin) >= key(pmax) {
                continue;
            }
            if key(lmin) > key(cursor) {
                gaps.push((cursor.to_owned(), lmin.clone()));
            }
            cursor = lmax;
        }
        if key(cursor) < key(pmax) {
            gaps.push((cursor.to_owned(), pmax.clone()));
        }
        let grid = subdivide(pmin, pmax, per_partition);
        for (gmin, gmax) in gaps {
            let pieces: Vec<(String, String)> = grid
                .iter()
                .filter(|(lo, hi)| key(lo) >= key(&gmin) && key(hi) <= key(&gmax))
                .cloned()
                .collect();
            let tiles = pieces.first().is_some_and(|(lo, _)| key(lo) == key(&gmin))
                && pieces.last().is_some_and(|(_, hi)| key(hi) == key(&gmax))
                && pieces.windows(2).all(|w| key(&w[0].1) == key(&w[1].0));
            if tiles {
                missing.extend(pieces);
            } else {
                missing.push((gmin, gmax));
            }
        }
    }
    missing
}

/// The physical ranges that now cover `lease`'s range, when it split into two or more;
/// empty otherwise (including when ranges merged: a lease keeps reading its EPK sub-range).
pub fn split_children(lease: &Lease, physical: &[(String, String)]) -> Vec<(String, String)> {
    let children: Vec<(String, String)> = physical
        .iter()
        .filter(|(min, max)| {
            epk_cmp(min, &lease.min_epk).is_ge() && epk_cmp(max, &lease.max_epk).is_le()
        })
        .cloned()
        .collect();
    let covers = children.len() >= 2
        && children.first().map(|c| c.0.as_str()) == Some(lease.min_epk.as_str())
        && children.last().map(|c| c.1.as_str()) == Some(lease.max_epk.as_str());
    if covers {
        children
    } else {
        Vec::new()
    }
}

/// What [`LeaseStore::reconcile`] found.
#[derive(Clone, Debug)]
pub struct Reconciled {
    pub leases: Vec<Lease>,
    pub split_pending: Vec<String>,
}

/// Reads and writes a group's leases.
#[derive(Clone)]
pub struct LeaseStore {
    queue: Queue,
    group: String,
    start_from: StartFrom,
}

impl LeaseStore {
    pub fn new(queue: Queue, group: impl Into<String>) -> Self {
        Self {
            queue,
            group: group.into(),
            start_from: StartFrom::Beginning,
        }
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
        let mut pages = crate::feed::open(
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

    pub fn group(&self) -> &str {
        &self.group
    }

    /// All of the group's leases, in range order.
    pub async fn list(&self) -> Result<Vec<Lease>> {
        let query = sql::query(
            "SELECT * FROM c WHERE c.type = @type",
            &[("@type", json!(LEASE_DOC_TYPE))],
        )?;
        let mut leases: Vec<Lease> = sql::collect(
            self.queue.leases(),
            query,
            FeedScope::partition(PartitionKey::from(lease_pk(&self.group))),
            None,
            self.queue.charges(),
            "list leases",
        )
        .await?;
        leases.sort_by(|a, b| epk_cmp(&a.min_epk, &b.min_epk));
        Ok(leases)
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
        let ranges = self
            .queue
            .messages()
            // Refreshed each round: the SDK's cached topology would hide a split.
            .read_feed_ranges(Some(
                ReadFeedRangesOptions::default().with_force_refresh(true),
            ))
            .await
            .map_err(QueueError::cosmos("read feed ranges"))?;
        let physical: Vec<(String, String)> = ranges.iter().map(range_bounds).collect();
        let mut leases = self.list().await?;
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
                self.create(&Lease::new(&self.group, lo, hi, position, now))
                    .await?;
            }
            info!(group = %self.group, leases = missing.len(), existing = leases.len(), "created leases for the ranges without one");
            leases = self.list().await?;
            if bounds.is_empty() {
                return Ok(Reconciled {
                    leases,
                    split_pending: Vec::new(),
                });
            }
        }
        let mut split_pending = Vec::new();
        let mut changed = false;
        for lease in &leases {
            let children = split_children(lease, &physical);
            if children.is_empty() {
                continue;
            }
            if lease.is_expired(now, expire_ms) {
                self.split(lease, &children, now).await?;
                changed = true;
            } else {
                split_pending.push(lease.id.clone());
            }
        }
        let leases = if changed { self.list().await? } else { leases };
        Ok(Reconciled {
            leases,
            split_pending,
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
            batch = batch
                .upsert_item(Lease::new(&self.group, min, max, continuation, now), None)
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

    /// Takes `lease` for `owner` (free, expired, or stolen: the caller decided).
    pub async fn acquire(&self, lease: &Lease, owner: &str, now: i64) -> Result<Lease, LeaseError> {
        let mut next = lease.clone();
        next.owner = Some(owner.into());
        next.timestamp = now;
        next.handover_to = None;
        next.handover_at = None;
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

    pub async fn renew(&self, lease: &Lease, now: i64) -> Result<Lease, LeaseError> {
        let mut next = lease.clone();
        next.timestamp = now;
        self.replace(&next, "renew lease").await
    }

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
    #[error(transparent)]
    Other(QueueError),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
            .collect()
    }

    #[test]
    fn missing_leases_fill_exactly_the_gaps_an_interrupted_creation_left() {
        let physical = pairs(&[("", "20"), ("20", "FF")]);
        // A new group: one lease per physical range.
        assert_eq!(missing_leases(&physical, &[], 1), physical);
        // Creation stopped after the first: only the second is missing.
        assert_eq!(
            missing_leases(&physical, &pairs(&[("", "20")]), 1),
            pairs(&[("20", "FF")])
        );
        // Every range covered (a merged partition read by its two old leases): nothing.
        let merged = pairs(&[("", "FF")]);
        assert!(missing_leases(&merged, &physical, 1).is_empty());
        // Same points written differently are the same point.
        assert!(missing_leases(&pairs(&[("", "2")]), &pairs(&[("", "20000000")]), 1).is_empty());
        // Finer leases: the missing ones are cut on the same grid as a new group's, so two
        // hosts seeing different stages of the creation write identical leases.
        let grid = subdivide("", "FF", 4);
        let made = vec![grid[0].clone(), grid[2].clone()];
        assert_eq!(
            missing_leases(&pairs(&[("", "FF")]), &made, 4),
            vec![grid[1].clone(), grid[3].clone()]
        );
    }

    fn token(active: Value) -> String {
        let state = json!({"op": "ChangeFeed", "rid": "r", "root": {"kind": "unordered_merge", "active_tokens": active, "start_from": {"kind": "beginning"}}});
        format!(
            "c1.{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .encode(serde_json::to_vec(&state).unwrap())
        )
    }

    fn decode(token: &str) -> Value {
        let body = token.strip_prefix("c1.").unwrap();
        serde_json::from_slice(
            &base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(body)
                .unwrap(),
        )
        .unwrap()
    }

    #[test]
    fn narrowing_keeps_the_parent_position_for_each_child() {
        let parent =
            token(json!([{"min_epk": "", "max_epk": "80", "server_continuation": "lsn-42"}]));
        let left = decode(&narrow_continuation(&parent, "", "40").unwrap());
        assert_eq!(
            left["root"]["active_tokens"],
            json!([{"min_epk": "", "max_epk": "40", "server_continuation": "lsn-42"}])
        );
        let right = decode(&narrow_continuation(&parent, "40", "80").unwrap());
        assert_eq!(
            right["root"]["active_tokens"],
            json!([{"min_epk": "40", "max_epk": "80", "server_continuation": "lsn-42"}])
        );
        assert_eq!(right["root"]["start_from"], json!({"kind": "beginning"}));
    }

    #[test]
    fn narrowing_picks_the_overlapping_parts() {
        let parent = token(json!([
            {"min_epk": "", "max_epk": "40", "server_continuation": "a"},
            {"min_epk": "40", "max_epk": "FF", "server_continuation": "b"}
        ]));
        let child = decode(&narrow_continuation(&parent, "40", "80").unwrap());
        assert_eq!(
            child["root"]["active_tokens"],
            json!([{"min_epk": "40", "max_epk": "80", "server_continuation": "b"}])
        );
        assert!(narrow_continuation("opaque-server-token", "", "40").is_none());
    }

    #[test]
    fn split_children_cover_the_parent_exactly() {
        let lease = Lease::new("g", "", "80", None, 0);
        let physical = vec![
            ("".to_string(), "40".to_string()),
            ("40".into(), "80".into()),
            ("80".into(), "FF".into()),
        ];
        assert_eq!(split_children(&lease, &physical), physical[..2].to_vec());
        let whole = Lease::new("g", "", "FF", None, 0);
        assert_eq!(split_children(&whole, &physical).len(), 3);
        let same = Lease::new("g", "80", "FF", None, 0);
        assert!(split_children(&same, &physical).is_empty(), "not split");
        let merged = vec![("".to_string(), "FF".to_string())];
        assert!(
            split_children(&lease, &merged).is_empty(),
            "a merge keeps the lease"
        );
    }

    #[test]
    fn subdivides_into_contiguous_equal_ranges() {
        let parts = subdivide("", "FF", 4);
        assert_eq!(parts.len(), 4);
        assert_eq!(parts[0].0, "");
        assert_eq!(parts[3].1, "FF");
        assert_eq!(
            parts[1].0, "10000000000000000000000000000000",
            "hash v2 keys end at 40…"
        );
        for w in parts.windows(2) {
            assert_eq!(w[0].1, w[1].0, "contiguous");
        }
        let halves = subdivide(
            "10000000000000000000000000000000",
            "20000000000000000000000000000000",
            2,
        );
        assert_eq!(halves[0].1, "18000000000000000000000000000000");
        assert_eq!(
            subdivide("", "FF", 1),
            vec![("".to_string(), "FF".to_string())]
        );
    }

    #[test]
    fn expiry_and_ids() {
        let mut lease = Lease::new("g", "", "FF", None, 1_000);
        assert_eq!(lease.id, "lease|g||FF");
        assert!(lease.is_expired(1_000, 60_000), "free leases are available");
        lease.owner = Some("a".into());
        assert!(!lease.is_expired(61_000, 60_000));
        assert!(lease.is_expired(61_001, 60_000));
        assert_eq!(lease.range_label(), "00..FF");
    }
}
