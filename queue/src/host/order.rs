//! A range's deliveries: when each may start (per-key turns and chains in ordered groups,
//! feed order otherwise), the stops they obey, and what they report to their range.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot, watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::buggify::{self, Bug};
use crate::checkpoint::Fate;
use crate::handler::{Handler, LockedUntil};
use crate::host::deliver::{Deliverer, LeaseLock, Permit, Promotion, Route, Watch};
use crate::message::{Message, MessageKey};

use super::{Leftovers, UNRECORDED_AGAIN};

/// What a message of an ordered group tells the next message of its key: its id and where it
/// stands — `None` while it is under way, `Pending` once its own state document holds it (its
/// long work got a lock of its own, it was parked, it waits for a retry), then its fate.
pub(super) type KeyState = Option<(String, Fate)>;

/// When a delivery may start.
pub(super) enum Turn {
    /// Ordered groups: after the previous message of the key has settled (`previous`, in
    /// this range) and after the messages `waits_for` of the key that the range's previous
    /// owner left unsettled behind the checkpoint.
    Key {
        previous: Option<watch::Receiver<KeyState>>,
        waits_for: Vec<String>,
    },
    /// Unordered groups: permits are taken in feed order.
    Feed {
        previous: Option<oneshot::Receiver<()>>,
        next: Option<oneshot::Sender<()>>,
    },
}

/// A range's stop signals, as its deliveries see them.
#[derive(Clone)]
pub(super) struct Stops {
    /// The range is lost: deliveries waiting for a permit step aside (unrecorded, so the
    /// checkpoint stays before them and the next owner reads them).
    pub(super) step_aside: CancellationToken,
    /// The range drains or is handed over: the same, except in stream groups within a page
    /// that has started (the checkpoint moves by whole pages and no window lists what
    /// settled, so a page half done would be delivered again by the next owner). The drain
    /// then takes at most about a page.
    pub(super) draining: CancellationToken,
    /// The range is lost or drains: deliveries stop retrying failed writes, and what they
    /// could not record holds the checkpoint.
    pub(super) give_up: CancellationToken,
    /// The range drains or is handed over: long work stops holding it at once (see
    /// [`Promotion`]), so the drain does not wait for it.
    pub(super) promote_now: CancellationToken,
}

/// A delivery's report to its range.
pub(super) struct Report {
    pub(super) seq: u64,
    pub(super) identity: String,
    pub(super) id: String,
    pub(super) key: MessageKey,
    /// The message's enqueue time and expiry, should its completion need a state document.
    pub(super) enqueued_at: i64,
    pub(super) expires_at: Option<i64>,
    pub(super) fate: Fate,
    /// Whether the app may have had it: what nothing could be recorded for is a redelivery
    /// for the range's next reader then, a first delivery otherwise.
    pub(super) reached: bool,
    /// The range's previous holder listed it started: the app may have had it from that one,
    /// whatever this range did with it.
    pub(super) recovered: bool,
}

/// A delivery asks its range to start (the lease write path). Its start is listed on the
/// lease with the range's next write (see [`crate::lease::Window::starts_lag`]); it is
/// written first where a next owner must know of it: a message the previous owner may have
/// started unlisted (else its count could repeat forever), and an ordered key's next message
/// while completions wait for a write (else a next owner would deliver its predecessor again
/// after it started).
pub(super) struct StartRequest {
    pub(super) seq: u64,
    pub(super) identity: String,
    /// The previous owner may have started it without listing it: its start is written
    /// before it starts.
    pub(super) unsure: bool,
    /// It follows a message of its key that this range delivered: its start is written first
    /// while completions wait for a write.
    pub(super) follows: bool,
    pub(super) reply: oneshot::Sender<bool>,
}

/// Where a delivery of the lease write path asks to start.
pub(super) struct StartAsk {
    pub(super) seq: u64,
    pub(super) identity: String,
    /// The previous owner may have started it without listing it.
    pub(super) unsure: bool,
    pub(super) requests: mpsc::UnboundedSender<StartRequest>,
}

/// How a waiting ordered message goes on.
pub(super) enum Wait {
    /// Its turn came.
    Go,
    /// Its turn came after waiting on its predecessors' state documents.
    GoChecked,
    /// Its predecessors `0` hold their own state: it waits behind them in a state of its own
    /// (parked), and holds its range no more.
    Park(Vec<String>),
    /// The range stopped first: never started.
    Stop,
}

/// What the next message of a key makes of where its predecessor in the range stands.
#[derive(Debug, PartialEq)]
pub(super) enum Predecessor {
    /// Still under way: wait for its next word.
    UnderWay,
    /// Settled or completed: the key's turn passes on.
    Done,
    /// Its own state document holds it (long work with a lock of its own, parked, a retry):
    /// wait for that document to settle, not for the range.
    HoldsItsOwnState(String),
    /// It never started or nothing could be recorded: the range is stopping, and the next
    /// message must not start ahead of it.
    Stopped,
}

/// Reads a predecessor's [`KeyState`] (see [`Predecessor`]). Pure.
pub(super) fn after_predecessor(state: KeyState) -> Predecessor {
    match state {
        None => Predecessor::UnderWay,
        Some((_, Fate::Settled | Fate::Completed)) => Predecessor::Done,
        Some((id, Fate::Pending)) => Predecessor::HoldsItsOwnState(id),
        Some((_, Fate::Unrecorded | Fate::Unstarted)) => Predecessor::Stopped,
    }
}

/// Whether a delivery of the lease write path writes its schedule under a lock of its own
/// instead of starting (see `RangeDelivery::due_later`): a message not yet `visible`, unless
/// it `follows` a message of its key in this range or is a redelivery of what the previous
/// owner handed out (`Route::Recovered`: that one's start is known). Pure.
pub(super) fn schedule_takes_its_own_lock(
    lease_path: bool,
    follows: bool,
    visible: bool,
    route: Route,
) -> bool {
    lease_path
        && !follows
        && !visible
        && route != Route::Recovered
        && !buggify::on(Bug::ScheduledStartListed)
}

/// One message of a range on its way to the handler.
pub(super) struct RangeDelivery<H> {
    pub(super) deliverer: Arc<Deliverer<H>>,
    pub(super) permits: Arc<Semaphore>,
    pub(super) stop: Stops,
    /// Set once a delivery of its page started. `None` where a window lists each message's
    /// fate (exclusive groups): a drained range lists what never started, and its next owner
    /// delivers just those, so nothing waits for a permit once the range drains.
    pub(super) page_started: Option<Arc<AtomicBool>>,
    /// How the message is claimed. [`Route::Checked`] in an ordered stream group's first window
    /// read after taking a range: its previous owner may have left messages there that it was
    /// retrying in place (it died), that wait for their schedule, or that it settled in a page
    /// it could not checkpoint whole (it drained or handed the range over while a message of
    /// that page waited): those are waited for, or skipped, not delivered past. One point read
    /// per message of that window; none after it, none in other groups. Exclusive groups
    /// learn the same from the lease's window ([`Inherited`]).
    pub(super) path: Route,
    /// Exclusive groups: when long work stops holding the range.
    pub(super) promotion: Option<Promotion>,
    /// The lease write path: the lease as the lock of a first delivery.
    pub(super) lease: Option<LeaseLock>,
    /// The lease write path: where the delivery asks to start.
    pub(super) start: Option<StartAsk>,
    pub(super) locked_until: LockedUntil,
    /// Set once the app may have had the message (see [`Watch::reached`]).
    pub(super) reached: Arc<AtomicBool>,
}

impl<H: Handler> RangeDelivery<H> {
    pub(super) async fn run(mut self, message: Message, turn: Turn) -> Fate {
        match turn {
            Turn::Key {
                previous,
                waits_for,
            } => {
                let follows = previous.is_some();
                match self
                    .after_previous_of_key(&message, previous, waits_for)
                    .await
                {
                    Wait::Go => self.start_when_granted(message, follows).await,
                    Wait::GoChecked => {
                        // It waited on its predecessors' state: a state of its own may exist
                        // too (its schedule, or a park whose answer was lost).
                        self.path = Route::Checked;
                        self.start_when_granted(message, follows).await
                    }
                    Wait::Park(ids) => self.park(message, ids).await,
                    Wait::Stop => Fate::Unstarted,
                }
            }
            Turn::Feed { previous, next } => {
                if let Some(previous) = previous {
                    let _ = previous.await;
                }
                self.deliver(message, next, None).await
            }
        }
    }

    /// Waits until the key's previous messages are settled: the one before it in this range,
    /// and those the previous owner left unsettled. One whose predecessors hold their own
    /// state (long work, a retry, parked) parks itself after `promoteAfter`, or at once when
    /// the range drains: the range need not hold it.
    pub(super) async fn after_previous_of_key(
        &self,
        message: &Message,
        previous: Option<watch::Receiver<KeyState>>,
        mut waits_for: Vec<String>,
    ) -> Wait {
        let began = Instant::now();
        if let Some(mut previous) = previous {
            loop {
                let state = previous.borrow_and_update().clone();
                match after_predecessor(state) {
                    Predecessor::Done => break,
                    Predecessor::HoldsItsOwnState(id) => {
                        waits_for.push(id);
                        break;
                    }
                    Predecessor::Stopped => return Wait::Stop,
                    Predecessor::UnderWay => {}
                }
                tokio::select! {
                    biased;
                    _ = self.stop.step_aside.cancelled() => return Wait::Stop,
                    _ = self.stop.draining.cancelled() => return Wait::Stop,
                    changed = previous.changed() => {
                        if changed.is_err() {
                            return Wait::Stop; // its task ended without a word: the range stops
                        }
                    }
                }
            }
        }
        waits_for.retain(|id| *id != message.id);
        if waits_for.is_empty() {
            return Wait::Go;
        }
        debug!(message_id = %message.id, ?waits_for, "waiting for the earlier messages of its key");
        let promote_after = self.promotion.as_ref().map(|p| p.after);
        let park = {
            let settled = self
                .deliverer
                .all_settled(&message.partition_key, &waits_for);
            tokio::pin!(settled);
            tokio::select! {
                biased;
                _ = self.stop.step_aside.cancelled() => return Wait::Stop,
                _ = &mut settled => return Wait::GoChecked,
                _ = self.stop.promote_now.cancelled(), if promote_after.is_some() => true,
                _ = async {
                    match promote_after {
                        Some(after) => tokio::time::sleep_until(began + after).await,
                        None => std::future::pending().await,
                    }
                } => true,
                // Groups without promotion wait in place; a drain leaves the message unstarted.
                _ = self.stop.draining.cancelled(), if promote_after.is_none() => false,
            }
        };
        match park {
            true => Wait::Park(waits_for),
            false => Wait::Stop,
        }
    }

    /// Parks `message` behind its key's predecessors `ids`; where it cannot (a state document
    /// of its own exists, or the write failed), it waits here and then starts.
    pub(super) async fn park(mut self, message: Message, ids: Vec<String>) -> Fate {
        match self.deliverer.group.park(&message, ids.clone()).await {
            Ok(true) => {
                debug!(message_id = %message.id, waits_for = ?ids, "parked behind the earlier messages of its key");
                Fate::Pending
            }
            parked => {
                debug!(message_id = %message.id, ?parked, "not parked: waiting in place");
                tokio::select! {
                    biased;
                    _ = self.stop.step_aside.cancelled() => return Fate::Unstarted,
                    _ = self.stop.draining.cancelled() => return Fate::Unstarted,
                    _ = self.deliverer.all_settled(&message.partition_key, &ids) => {}
                }
                self.path = Route::Checked;
                self.start_when_granted(message, false).await
            }
        }
    }

    /// Takes a permit and, on the lease write path, asks to start; then delivers.
    pub(super) async fn start_when_granted(mut self, message: Message, follows: bool) -> Fate {
        let permit = tokio::select! {
            biased;
            _ = self.stop.step_aside.cancelled() => return Fate::Unstarted,
            _ = self.stop.draining.cancelled() => return Fate::Unstarted,
            permit = Arc::clone(&self.permits).acquire_owned() => permit.expect("never closed"),
        };
        if !self.due_later(&message, follows) && !self.granted(follows).await {
            return Fate::Unstarted;
        }
        self.deliver(message, None, Some(permit)).await
    }

    /// On the lease write path, a message not yet visible is not started: its delivery writes
    /// its schedule (a state document) and nothing reaches the app, so no start is listed —
    /// one its holder died with before the schedule landed would count, at the next owner, as
    /// a delivery the app never saw. It takes a document of its own instead
    /// ([`Route::Locked`]), which a next owner's claim of it collides with (its window shows
    /// it handed out unstarted under `startsLag` until it is pending on that document).
    /// `true` when so. Not for an ordered key's next message (`follows`): its start is written
    /// first while its predecessor's completion waits for a write, or a next owner could
    /// deliver the predecessor again while its schedule comes due.
    fn due_later(&mut self, message: &Message, follows: bool) -> bool {
        let now = self.deliverer.group.queue().clock().now_ms();
        let later = schedule_takes_its_own_lock(
            self.start.is_some(),
            follows,
            message.is_visible(now),
            self.path,
        );
        if later {
            self.path = Route::Locked;
        }
        later
    }

    /// On the lease write path, asks the range to start this delivery (see [`StartRequest`]):
    /// `false` when it may not (the lease is not surely the range's, or a write it needed
    /// first did not land).
    pub(super) async fn granted(&self, follows: bool) -> bool {
        let Some(ask) = &self.start else {
            return true;
        };
        let (reply, granted) = oneshot::channel();
        let request = StartRequest {
            seq: ask.seq,
            identity: ask.identity.clone(),
            unsure: ask.unsure,
            follows,
            reply,
        };
        ask.requests.send(request).is_ok() && granted.await == Ok(true)
    }

    pub(super) async fn deliver(
        mut self,
        message: Message,
        turn_done: Option<oneshot::Sender<()>>,
        permit: Option<OwnedSemaphorePermit>,
    ) -> Fate {
        let permit = match permit {
            Some(permit) => permit,
            None => {
                let mut stay = false;
                let permit = loop {
                    tokio::select! {
                        biased;
                        _ = self.stop.step_aside.cancelled() => return Fate::Unstarted,
                        _ = self.stop.draining.cancelled(), if !stay => {
                            stay = self
                                .page_started
                                .as_ref()
                                .is_some_and(|started| started.load(Ordering::SeqCst));
                            if !stay {
                                return Fate::Unstarted;
                            }
                        }
                        permit = Arc::clone(&self.permits).acquire_owned() => break permit.expect("never closed"),
                    }
                };
                // Listed unstarted with its page: it asks to start.
                if !self.due_later(&message, false) && !self.granted(false).await {
                    return Fate::Unstarted;
                }
                permit
            }
        };
        // The lease is a lock only while it is live: nothing starts under one whose last
        // write is older than the expiry others judge it by (minus a margin).
        if let Some(lease) = &self.lease {
            let held = *lease.held.borrow();
            if Instant::now() >= held && !buggify::on(Bug::StartUnderExpiredLease) {
                debug!(message_id = %message.id, "not started: the range's lease was not renewed in time");
                return Fate::Unstarted;
            }
        }
        if let Some(started) = &self.page_started {
            started.store(true, Ordering::SeqCst);
        }
        drop(turn_done);
        let mut permit = Permit::held(Arc::clone(&self.permits), permit);
        let reached = Arc::clone(&self.reached);
        let watch = Watch::new(
            self.promotion,
            self.lease,
            self.locked_until.clone(),
            Arc::clone(&reached),
        );
        // Boxed: a range reads up to `max_in_flight_per_range` ahead, and each waiting task
        // would otherwise be as large as a delivery in progress (its HTTP and SDK futures,
        // ≈ 14 KB): 14 MiB for 1,024 waiting messages where 64 are processed.
        let first_path = self.path;
        let mut fate = Box::pin(self.deliverer.process(
            message.clone(),
            &self.stop.give_up,
            &mut permit,
            first_path,
            watch,
        ))
        .await;
        // Nothing could be recorded (Cosmos DB refused it, even as a dead letter): while the
        // range lives nobody else would bring the message back, so it is delivered again
        // after a back-off, as a redelivery (claimed first: a refusal that lasts reaches no
        // app), until something is recorded or the range stops.
        let mut tries = 0;
        let mut lock = self.locked_until.clone();
        while fate == Fate::Unrecorded {
            // What the app may still be working on is not handed out again before the lock
            // it was told of runs out.
            let told = match reached.load(Ordering::SeqCst) {
                true => lock.get().map(|until| self.deliverer.until(until)),
                false => None,
            };
            if self.stop.give_up.is_cancelled() {
                // The range drains or is handed over: its next owner, taking the released lease
                // at once, delivers the listed start at once, so the range waits for the lock
                // here first. (A lost lease is taken only once it expired, which is later.)
                if let Some(told) = told.filter(|_| !self.stop.step_aside.is_cancelled()) {
                    drop(permit); // it only waits now
                    tokio::time::sleep(told).await;
                }
                break;
            }
            tries += 1;
            let wait = UNRECORDED_AGAIN
                .backoff_random(tries)
                .max(told.unwrap_or_default());
            warn!(message_id = %message.id, retry_in_ms = wait.as_millis() as u64, "nothing could be recorded for the message; delivering it again later");
            let give_up = self.stop.give_up.clone();
            let waited = permit
                .released_while(async {
                    tokio::select! {
                        biased;
                        _ = give_up.cancelled() => false,
                        _ = tokio::time::sleep(wait) => true,
                    }
                })
                .await;
            if !waited {
                continue; // the range stops: above
            }
            // A redelivery stays one, as does a delivery whose call may have reached the app;
            // one that had to take a lock of its own still does.
            let path = match (first_path, reached.load(Ordering::SeqCst)) {
                (Route::Recovered, _) | (_, true) => Route::Recovered,
                (Route::Locked, false) => Route::Locked,
                _ => Route::Checked,
            };
            // Each delivery the app gets has its own lock to watch.
            lock = LockedUntil::default();
            let watch = Watch::new(None, None, lock.clone(), Arc::clone(&reached));
            fate = Box::pin(self.deliverer.process(
                message.clone(),
                &self.stop.give_up,
                &mut permit,
                path,
                watch,
            ))
            .await;
        }
        fate
    }
}

/// Drops the chains of keys whose last message settled (bounded memory); a key whose last
/// message is still pending keeps its chain, so its next message still waits.
pub(super) fn forget_settled_keys(chains: &mut HashMap<String, watch::Receiver<KeyState>>) {
    chains.retain(|_, rx| matches!(*rx.borrow(), None | Some((_, Fate::Pending))));
}

/// The range's lease is gone. Deliveries already under way finish and settle under their own
/// claims; those still waiting for a permit are not started: the checkpoint never passed them,
/// so the new owner reads them again. (Delivering them anyway would only hand the app a second
/// copy in stream mode, and waste a claim attempt in exclusive mode.)
pub(super) fn abandon(stops: &Stops, deliveries: &mut JoinSet<()>, leftovers: &Leftovers) {
    stops.step_aside.cancel();
    // Waits (schedules, held messages, back-offs of writes that keep failing) end: the range's
    // next owner brings those messages back. Settles of recorded claims keep trying until
    // their locks expire; the host waits for them before it returns.
    stops.give_up.cancel();
    leftovers.adopt(deliveries);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_message_of_a_key_reads_its_predecessor_as_the_table_says() {
        let id = || "m1".to_owned();
        let table = [
            (None, Predecessor::UnderWay),
            (Some((id(), Fate::Settled)), Predecessor::Done),
            (Some((id(), Fate::Completed)), Predecessor::Done),
            (
                Some((id(), Fate::Pending)),
                Predecessor::HoldsItsOwnState(id()),
            ),
            (Some((id(), Fate::Unrecorded)), Predecessor::Stopped),
            (Some((id(), Fate::Unstarted)), Predecessor::Stopped),
        ];
        for (state, expected) in table {
            let row = format!("{state:?}");
            assert_eq!(after_predecessor(state), expected, "{row}");
        }
    }

    #[test]
    fn only_an_unlisted_schedule_of_the_lease_write_path_takes_a_lock_of_its_own() {
        // (lease path, follows a message of its key, visible, route) → its own lock
        let table = [
            ((true, false, false, Route::Feed), true),
            ((true, false, false, Route::Checked), true),
            ((true, false, false, Route::Locked), true),
            // A redelivery: its start is known to the window already.
            ((true, false, false, Route::Recovered), false),
            // An ordered key's next message: its start is written first instead.
            ((true, true, false, Route::Feed), false),
            // Due now: it starts.
            ((true, false, true, Route::Feed), false),
            // Claims and stream groups write a schedule by the claim anyway.
            ((false, false, false, Route::Feed), false),
        ];
        for ((lease_path, follows, visible, route), expected) in table {
            assert_eq!(
                schedule_takes_its_own_lock(lease_path, follows, visible, route),
                expected,
                "lease path {lease_path}, follows {follows}, visible {visible}, {route:?}"
            );
        }
    }
}
