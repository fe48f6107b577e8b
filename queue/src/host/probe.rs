//! One read per physical partition wakes a host's idle ranges on it.
//!
//! An idle range polls its feed every `maxPoll`, one request each time (1 RU empty), so a
//! host holding many finer leases of one partition pays one read per lease per interval for
//! nothing. Instead, once a range's polling has backed off to `maxPoll` and another range of
//! its host shares its partition, it rests: it reads again when the partition's probe says
//! something was written there, or after [`HostOptions::idle_read`] (a backstop, should the
//! probe miss a write). The probe reads the partition's feed head (its LSN, as the operator's
//! [`crate::Queue::feed_head`] does) every `maxPoll` while any range on it rests, one request
//! whatever was written, so a message still reaches a resting range within about `maxPoll`
//! and a read: the latency is the same, the cost per partition rather than per range.
//!
//! Nothing written between a resting range's last read and the probe's is missed: a range
//! marks the announcements it has seen before each read, and the probe announces (bumps the
//! wake generation) after each read whose LSN it cannot prove unchanged from the last one it
//! got, the first read and failed reads included. A write the range's read did not see comes
//! after that read, so after the range's mark: the first probe read after the write finds the
//! LSN moved, and its announcement wakes the range. (This assumes, as the change feed processor
//! does, that a read sees what was written before it; a replica that lags the probe's falls
//! back on `idle_read`.)
//!
//! A partition that split or merged answers from another partition, or is no longer listed
//! when the probe first reads it: the probe ends, and its ranges poll by themselves until
//! they join the probe of the partition they now lie in (`RangeProcessor`, once an
//! `idle_read` at most).
//!
//! [`HostOptions::idle_read`]: super::HostOptions::idle_read

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use azure_data_cosmos::feed::FeedRange;
use tracing::{debug, instrument};

use crate::error::Result;
use crate::queue::Queue;
use crate::range::{epk_cmp, label, range_bounds};

use super::ordered_watch;

/// A host's probes, one per physical partition that has a range of this host on it.
#[derive(Clone)]
pub(crate) struct Probes {
    queue: Queue,
    interval: Duration,
    inner: Arc<Mutex<Known>>,
}

#[derive(Default)]
struct Known {
    /// Running probes, by partition bounds.
    running: HashMap<(String, String), Running>,
}

struct Running {
    wake: ordered_watch::Receiver<u64>,
    resting: Arc<AtomicUsize>,
    members: Arc<AtomicUsize>,
}

/// A range's end of its partition's probe.
pub(crate) struct Wake {
    rx: ordered_watch::Receiver<u64>,
    resting: Arc<AtomicUsize>,
    /// Ranges of this host on the partition.
    members: Arc<AtomicUsize>,
}

impl Drop for Wake {
    fn drop(&mut self) {
        self.members.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Held while a range is resting: the probe reads only while some range is.
pub(crate) struct Resting(Arc<AtomicUsize>);

impl Drop for Resting {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Wake {
    /// Whether another range of this host reads the partition: alone, a range polls by
    /// itself (the probe would cost as much, and its own slow reads on top).
    pub(crate) fn shared(&self) -> bool {
        // A probe that ended wakes nobody any more.
        self.members.load(Ordering::Acquire) > 1 && !self.ended()
    }

    /// Marks every announcement so far as seen: called before each read of the range, so a
    /// later one wakes it (see the module's argument).
    pub(crate) fn seen(&mut self) {
        self.rx.borrow_and_update();
    }

    /// Rests the range until it is dropped.
    pub(crate) fn rest(&self) -> Resting {
        self.resting.fetch_add(1, Ordering::AcqRel);
        Resting(Arc::clone(&self.resting))
    }

    /// Resolves once the probe announces something the range has not seen, or has ended
    /// (the range reads, then polls by itself: see [`Wake::ended`]).
    pub(crate) async fn changed(&mut self) {
        let _ = self.rx.changed().await;
    }

    /// Whether the probe ended (its partition split or merged, or it failed): the range may
    /// join the probe of the partition it now lies in.
    pub(crate) fn ended(&self) -> bool {
        self.rx.has_changed().is_err()
    }
}

impl Probes {
    pub(crate) fn new(queue: Queue, interval: Duration) -> Self {
        Self {
            queue,
            interval,
            inner: Arc::default(),
        }
    }

    /// The probe of the physical partition `[min, max)` lies in, started if none runs; `None`
    /// when the range spans partitions (it polls by itself, as without probes).
    pub(crate) async fn wake_for(&self, min: &str, max: &str) -> Result<Option<Wake>> {
        // Read afresh (a metadata read, once per range start): a range of a partition that
        // split lies within the parent's bounds, which a remembered list would still show.
        let partitions = self.queue.feed_ranges().await?;
        let Some(partition) = partitions.into_iter().find(|p| {
            let (lo, hi) = range_bounds(p);
            epk_cmp(&lo, min).is_le()
                && (hi.eq_ignore_ascii_case("FF") || epk_cmp(max, &hi).is_le())
        }) else {
            return Ok(None);
        };
        let bounds = range_bounds(&partition);
        let mut known = self.lock();
        let running = known.running.entry(bounds.clone()).or_insert_with(|| {
            let tx = ordered_watch::Sender::new(0);
            let rx = tx.subscribe();
            let resting = Arc::new(AtomicUsize::new(0));
            let members = Arc::new(AtomicUsize::new(0));
            tokio::spawn(probe(
                Probe {
                    queue: self.queue.clone(),
                    partition,
                    interval: self.interval,
                    wake: tx,
                    resting: Arc::clone(&resting),
                },
                Owner {
                    known: Arc::clone(&self.inner),
                    bounds,
                    members: Arc::clone(&members),
                },
            ));
            Running {
                wake: rx,
                resting,
                members,
            }
        });
        // Under the lock, as the probe's check that nobody holds it any more is.
        running.members.fetch_add(1, Ordering::AcqRel);
        Ok(Some(Wake {
            rx: running.wake.clone(),
            resting: Arc::clone(&running.resting),
            members: Arc::clone(&running.members),
        }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Known> {
        lock(&self.inner)
    }
}

fn lock(known: &Mutex<Known>) -> std::sync::MutexGuard<'_, Known> {
    known.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a probe reads and whom it wakes.
struct Probe {
    queue: Queue,
    partition: FeedRange,
    interval: Duration,
    wake: ordered_watch::Sender<u64>,
    resting: Arc<AtomicUsize>,
}

/// Where a probe is listed, so it can leave once no range holds its [`Wake`].
struct Owner {
    known: Arc<Mutex<Known>>,
    bounds: (String, String),
    members: Arc<AtomicUsize>,
}

impl Owner {
    /// Whether the probe is done: if no range holds it, it is unlisted (under the lock that
    /// [`Probes::wake_for`] joins under, so no range joins a probe that ended).
    fn leave_if_unused(&self) -> bool {
        let mut known = lock(&self.known);
        if self.members.load(Ordering::Acquire) > 0 {
            return false;
        }
        self.unlist(&mut known);
        true
    }

    /// Unlists the probe, if it is still the one listed: ranges that join later get a new one.
    fn unlist(&self, known: &mut Known) {
        let ours = known
            .running
            .get(&self.bounds)
            .is_some_and(|r| Arc::ptr_eq(&r.members, &self.members));
        if ours {
            known.running.remove(&self.bounds);
        }
    }
}

/// However the probe ends (a split, or a panic), it is unlisted.
impl Drop for Owner {
    fn drop(&mut self) {
        let mut known = lock(&self.known);
        self.unlist(&mut known);
    }
}

/// Reads `partition`'s feed head every `interval` while a range on it rests, and announces
/// what it finds; ends when no range holds its [`Wake`] any more, or when the partition split
/// or merged (its ranges then find their new partitions' probes).
#[instrument(skip_all, fields(partition = %{ let (lo, hi) = range_bounds(&probe.partition); label(&lo, &hi) }))]
async fn probe(probe: Probe, owner: Owner) {
    let Probe {
        queue,
        partition,
        interval,
        wake,
        resting,
    } = probe;
    let bounds = range_bounds(&partition);
    let announce = || wake.send_modify(|g| *g = g.wrapping_add(1));
    // The LSN the last read found, kept across failed reads and ticks where nobody rests (a
    // write after it moves the next read's LSN, however late that read is); none before the
    // first read, which is announced.
    let mut last: Option<u64> = None;
    // The physical partition that answered, once one has; checked to be the one the probe
    // was started for when it first answers (it may have split since: a read of the parent's
    // bounds then answers from one child, whose id says nothing).
    let mut answered: Option<String> = None;
    let mut checked = false;
    loop {
        tokio::time::sleep(interval).await;
        if owner.leave_if_unused() {
            return;
        }
        if resting.load(Ordering::Acquire) == 0 {
            // Nobody waits on it: no reads.
            continue;
        }
        let head = match queue
            .partition_head(partition.clone(), "probe partition")
            .await
        {
            Ok(head) => head,
            Err(e) => {
                debug!(error = %e, "the probe could not read; ranges read");
                announce();
                continue;
            }
        };
        let moved = head
            .partition
            .as_ref()
            .is_some_and(|now| answered.as_ref().is_some_and(|before| before != now));
        if !checked {
            match queue.feed_ranges().await {
                Ok(partitions) => {
                    checked = true;
                    if !partitions.iter().any(|p| range_bounds(p) == bounds) {
                        debug!("the partition split or merged before the probe first read it");
                        announce();
                        return;
                    }
                }
                // Checked at the next read; meanwhile the ranges read.
                Err(e) => {
                    debug!(error = %e, "the probe could not read the partitions; ranges read");
                    announce();
                    continue;
                }
            }
        }
        if moved {
            debug!("the partition split or merged; its ranges find their new partitions");
            announce();
            return;
        }
        answered = head.partition.or(answered);
        match (last, head.lsn) {
            // Nothing written since the last read.
            (Some(before), Some(now)) if before == now => {}
            // Written, unknown, or a first read: what a woken range's read misses was
            // written after this read, and the next read's LSN shows it.
            _ => announce(),
        }
        last = head.lsn.or(last);
    }
}
