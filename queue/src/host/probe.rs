//! One read per physical partition wakes a host's idle ranges on it.
//!
//! An idle range polls its feed every `maxPoll`, one request each time (1 RU empty), so a
//! host holding many finer leases of one partition pays one read per lease per interval for
//! nothing. Instead, once a range's polling has backed off to `maxPoll`, it rests: it reads
//! again only when the partition's probe says something was written there, or after
//! [`HostOptions::idle_read`] (a slow read of its own, in case the probe cannot read). The
//! probe reads the whole partition's feed every `maxPoll` while any range on it is resting, so
//! a message still reaches a resting range within about `maxPoll`: the latency is the same, the
//! cost per partition rather than per lease.
//!
//! The probe is a position, not a copy of the data: it asks "anything since?" of the
//! partition's feed from a position taken at *now*. Nothing between a resting range's last
//! read and that position is missed because every new position is announced (the wake
//! generation bumped) only after it is taken, and a range marks what it saw before each read:
//! a range whose last read was before the position wakes and reads again; what comes after
//! the position the probe sees.
//!
//! [`HostOptions::idle_read`]: super::HostOptions::idle_read

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use azure_data_cosmos::feed::FeedRange;
use azure_data_cosmos::{ContainerClient, FeedScope};
use tokio::sync::watch;
use tracing::{debug, instrument};

use crate::config::StartFrom;
use crate::cosmos::charge::RequestCharges;
use crate::cosmos::feed::FeedReader;
use crate::error::Result;
use crate::queue::Queue;
use crate::range::{epk_cmp, label, range_bounds};

/// A host's probes, one per physical partition that has a range of this host on it.
#[derive(Clone)]
pub(crate) struct Probes {
    queue: Queue,
    interval: Duration,
    inner: Arc<Mutex<Known>>,
}

#[derive(Default)]
struct Known {
    /// The partitions as last read (refreshed when a range lies in none of them).
    partitions: Vec<FeedRange>,
    /// Running probes, by partition bounds.
    running: HashMap<(String, String), Running>,
}

struct Running {
    wake: watch::Receiver<u64>,
    resting: Arc<AtomicUsize>,
    members: Arc<AtomicUsize>,
}

/// A range's end of its partition's probe.
pub(crate) struct Wake {
    rx: watch::Receiver<u64>,
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
        self.members.load(Ordering::Acquire) > 1
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

    /// Resolves once the probe announces something the range has not seen (never, if the
    /// probe ended).
    pub(crate) async fn changed(&mut self) {
        if self.rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
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
        let within = |partitions: &[FeedRange]| {
            partitions
                .iter()
                .find(|p| {
                    let (lo, hi) = range_bounds(p);
                    epk_cmp(&lo, min).is_le()
                        && (hi.eq_ignore_ascii_case("FF") || epk_cmp(max, &hi).is_le())
                })
                .cloned()
        };
        let known = within(&self.lock().partitions);
        let partition = match known {
            Some(p) => p,
            None => {
                let fresh = self.queue.feed_ranges().await?;
                let found = within(&fresh);
                self.lock().partitions = fresh;
                match found {
                    Some(p) => p,
                    None => return Ok(None),
                }
            }
        };
        let bounds = range_bounds(&partition);
        let mut known = self.lock();
        let running = known.running.entry(bounds.clone()).or_insert_with(|| {
            let (tx, rx) = watch::channel(0);
            let resting = Arc::new(AtomicUsize::new(0));
            let members = Arc::new(AtomicUsize::new(0));
            tokio::spawn(probe(
                Probe {
                    container: self.queue.messages().clone(),
                    partition,
                    interval: self.interval,
                    wake: tx,
                    resting: Arc::clone(&resting),
                    charges: Arc::clone(self.queue.charges()),
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
    container: ContainerClient,
    partition: FeedRange,
    interval: Duration,
    wake: watch::Sender<u64>,
    resting: Arc<AtomicUsize>,
    charges: Arc<RequestCharges>,
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
        known.running.remove(&self.bounds);
        true
    }
}

/// Reads `partition`'s feed every `interval` while a range on it is resting, and announces
/// what it finds; ends when no range holds its [`Wake`] any more.
#[instrument(skip_all, fields(partition = %{ let (lo, hi) = range_bounds(&probe.partition); label(&lo, &hi) }))]
async fn probe(probe: Probe, owner: Owner) {
    let Probe {
        container,
        partition,
        interval,
        wake,
        resting,
        charges,
    } = probe;
    let scope = FeedScope::range(partition);
    // The feed's position when last asked, or none: the next read takes it at now.
    let mut position: Option<FeedReader> = None;
    let announce = || wake.send_modify(|g| *g = g.wrapping_add(1));
    // A position at now: a reader whose first (empty) page is read.
    let now = || async {
        let mut reader = FeedReader::new(
            container.clone(),
            scope.clone(),
            StartFrom::Now,
            None,
            1,
            Arc::clone(&charges),
        )
        .counted_as("probe partition");
        reader.next_page().await.map(|_| reader)
    };
    loop {
        tokio::time::sleep(interval).await;
        if owner.leave_if_unused() {
            return;
        }
        if resting.load(Ordering::Acquire) == 0 {
            // Nobody waits on it: no reads, and the position is taken again when one does.
            position = None;
            continue;
        }
        let written = match &mut position {
            // No position yet: ranges that read before the one taken now read once more.
            None => true,
            Some(reader) => match reader.next_page().await {
                Ok(page) => !page.docs.is_empty(),
                Err(e) => {
                    debug!(error = %e, "the probe could not read; ranges read");
                    true
                }
            },
        };
        if written {
            // The position is taken again first, then announced: what a woken range's read
            // misses comes after the position, where the probe sees it.
            position = match now().await {
                Ok(reader) => Some(reader),
                Err(e) => {
                    debug!(error = %e, "the probe could not take its position");
                    None
                }
            };
            announce();
        }
    }
}
