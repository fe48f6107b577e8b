//! Pull consumers (receive-and-lock, as Storage Queue, SQS and Service Bus' peek-lock work) on
//! the same lease loop, claims and guarantees as pushed delivery: [`Pull`] is a [`Handler`]
//! that parks each delivery the [`Host`](crate::host::Host) makes until a worker
//! [`Puller::receive`]s it, then waits for the worker's verdict. A worker that never settles
//! (it crashed) loses its lock at the visibility timeout: the message is delivered again at
//! once, its delivery count one higher, and reaches the dead letters after
//! `maxDeliveryAttempts` like any failing message.
//!
//! While a delivery waits or is locked, the host holds its claim and renews it, so nothing
//! else of the group delivers it; the visibility timeout is the worker's lock on top.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{oneshot, watch, Notify};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::handler::{Delivery, Handler, Outcome};

/// Most messages one receive returns (Storage Queue's limit).
pub const MAX_RECEIVE: usize = 32;

/// A settle or renew whose lock the worker no longer holds: it expired (the message went back
/// to the group), it was settled already, or the token is unknown.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("lock {0} is not held: it expired, was settled already, or never existed")]
pub struct LockLost(pub String);

/// One message a worker received, locked to it until `locked_until`.
#[derive(Debug, Clone)]
pub struct Received {
    /// The delivery (message, delivery count, group, queue).
    pub delivery: Delivery,
    /// What settles or renews it.
    pub lock_token: String,
    /// When the lock expires unless renewed.
    pub locked_until: Instant,
}

/// What a worker decided for a received message.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Done: never delivered again in the group.
    Complete,
    /// Deliver again: after `delay`, or with the group's back-off.
    Abandon {
        /// Why (kept as the message's last error).
        reason: String,
        /// When to deliver it again, instead of the back-off.
        delay: Option<Duration>,
    },
    /// Straight to the dead letters.
    DeadLetter {
        /// Why (recorded with the dead letter).
        reason: String,
    },
}

impl Verdict {
    fn outcome(self) -> Outcome {
        match self {
            Verdict::Complete => Outcome::Complete,
            Verdict::Abandon { reason, delay } => Outcome::Retry { reason, delay },
            Verdict::DeadLetter { reason } => Outcome::DeadLetter {
                description: reason.clone(),
                reason,
            },
        }
    }
}

struct Waiting {
    delivery: Delivery,
    token: String,
    verdict: oneshot::Sender<Verdict>,
    deadline: watch::Sender<Option<Instant>>,
}

struct Locked {
    verdict: oneshot::Sender<Verdict>,
    deadline: watch::Sender<Option<Instant>>,
    until: Instant,
}

#[derive(Default)]
struct State {
    waiting: VecDeque<Waiting>,
    locked: HashMap<String, Locked>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    arrived: Notify,
}

impl Shared {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Drops what a delivery left (its handler ended or was cancelled).
    fn forget(&self, token: &str) {
        let mut state = self.state();
        state.waiting.retain(|w| w.token != token);
        state.locked.remove(token);
    }

    /// Takes back a delivery no worker has received; `false` if one has.
    fn unpark(&self, token: &str) -> bool {
        let mut state = self.state();
        let before = state.waiting.len();
        state.waiting.retain(|w| w.token != token);
        state.waiting.len() != before
    }

    /// Takes a lock whose time has come; `false` if it was settled or renewed meanwhile.
    fn expire(&self, token: &str, now: Instant) -> bool {
        let mut state = self.state();
        match state.locked.get(token) {
            Some(locked) if locked.until <= now => {
                state.locked.remove(token);
                true
            }
            _ => false,
        }
    }
}

/// The handler half: give it to a [`Host`](crate::host::Host).
pub struct Pull {
    shared: Arc<Shared>,
    stop: CancellationToken,
}

/// The worker half: receive, settle, renew. Cloned freely.
#[derive(Clone)]
pub struct Puller {
    shared: Arc<Shared>,
}

/// A pull handler and the puller that serves its deliveries to workers.
pub fn pull() -> (Pull, Puller) {
    let shared = Arc::new(Shared::default());
    (
        Pull {
            shared: Arc::clone(&shared),
            stop: CancellationToken::new(),
        },
        Puller { shared },
    )
}

impl Pull {
    /// When `stop` is cancelled (the host is stopping), deliveries no worker has received
    /// yet are given back undelivered, no attempt counted, so the drain does not wait for
    /// workers; received ones still wait for their worker's verdict or lock expiry.
    pub fn stopping_with(mut self, stop: CancellationToken) -> Self {
        self.stop = stop;
        self
    }
}

/// Removes a delivery's traces when its handler ends, however it ends.
struct Forget<'a>(&'a Shared, &'a str);

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        self.0.forget(self.1);
    }
}

impl Handler for Pull {
    async fn handle(&self, delivery: Delivery) -> Outcome {
        let token = uuid::Uuid::new_v4().to_string();
        let (verdict, mut decided) = oneshot::channel();
        let (deadline, mut deadlines) = watch::channel(None);
        self.shared.state().waiting.push_back(Waiting {
            delivery,
            token: token.clone(),
            verdict,
            deadline,
        });
        let _forget = Forget(&self.shared, &token);
        self.shared.arrived.notify_waiters();
        loop {
            let until = *deadlines.borrow_and_update();
            let expired = async {
                match until {
                    Some(until) => tokio::time::sleep_until(until).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                verdict = &mut decided => {
                    return match verdict {
                        Ok(verdict) => verdict.outcome(),
                        // Not reachable while the entry lives (it holds the sender).
                        Err(_) => Outcome::Undelivered {
                            reason: "the puller went away".into(),
                            delay: None,
                        },
                    };
                }
                changed = deadlines.changed() => {
                    if changed.is_err() {
                        // Settled: the verdict is on its way.
                        if let Ok(verdict) = (&mut decided).await {
                            return verdict.outcome();
                        }
                    }
                }
                () = self.stop.cancelled(), if until.is_none() => {
                    if self.shared.unpark(&token) {
                        return Outcome::Undelivered {
                            reason: "the consumer stopped before a worker received it".into(),
                            delay: None,
                        };
                    }
                    // Received meanwhile: its worker decides.
                    let _ = deadlines.changed().await;
                }
                () = expired => {
                    if self.shared.expire(&token, Instant::now()) {
                        return Outcome::Retry {
                            reason: "the worker's lock expired (visibility timeout) before it settled the message".into(),
                            delay: Some(Duration::ZERO),
                        };
                    }
                }
            }
        }
    }
}

impl Puller {
    /// Up to `max` messages (at most [`MAX_RECEIVE`]), each locked for `visibility`. Waits up
    /// to `wait` for the first and answers as soon as any are there (long polling); an empty
    /// answer after `wait`.
    pub async fn receive(&self, max: usize, visibility: Duration, wait: Duration) -> Vec<Received> {
        let max = max.clamp(1, MAX_RECEIVE);
        let give_up = Instant::now() + wait;
        loop {
            let arrived = self.shared.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            let taken = self.take(max, visibility);
            if !taken.is_empty() || Instant::now() >= give_up {
                return taken;
            }
            tokio::select! {
                () = arrived => {}
                () = tokio::time::sleep_until(give_up) => {}
            }
        }
    }

    fn take(&self, max: usize, visibility: Duration) -> Vec<Received> {
        let until = Instant::now() + visibility;
        let mut state = self.shared.state();
        let mut taken = Vec::new();
        while taken.len() < max {
            let Some(w) = state.waiting.pop_front() else {
                break;
            };
            // Its handler may have just been cancelled (the lease moved): skip it.
            if w.verdict.is_closed() {
                continue;
            }
            let _ = w.deadline.send(Some(until));
            state.locked.insert(
                w.token.clone(),
                Locked {
                    verdict: w.verdict,
                    deadline: w.deadline,
                    until,
                },
            );
            taken.push(Received {
                delivery: w.delivery,
                lock_token: w.token,
                locked_until: until,
            });
        }
        taken
    }

    /// Settles a received message as the worker decided.
    pub fn settle(&self, lock_token: &str, verdict: Verdict) -> Result<(), LockLost> {
        let locked = self.shared.state().locked.remove(lock_token);
        let locked = locked.ok_or_else(|| LockLost(lock_token.to_owned()))?;
        locked
            .verdict
            .send(verdict)
            .map_err(|_| LockLost(lock_token.to_owned()))
    }

    /// Extends a lock to `visibility` from now (long work).
    pub fn renew(&self, lock_token: &str, visibility: Duration) -> Result<Instant, LockLost> {
        let mut state = self.shared.state();
        let locked = state
            .locked
            .get_mut(lock_token)
            .filter(|l| !l.verdict.is_closed())
            .ok_or_else(|| LockLost(lock_token.to_owned()))?;
        locked.until = Instant::now() + visibility;
        let _ = locked.deadline.send(Some(locked.until));
        Ok(locked.until)
    }

    /// Deliveries waiting for a worker, and locked to one.
    pub fn counts(&self) -> (usize, usize) {
        let state = self.shared.state();
        (state.waiting.len(), state.locked.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::NewMessage;

    fn delivery(id: &str, count: u32) -> Delivery {
        Delivery {
            message: NewMessage::json(serde_json::json!({"id": id}))
                .with_id(id)
                .into_message(0)
                .unwrap(),
            delivery_count: count,
            group: "g".into(),
            queue: "q".into(),
            locked_until: Default::default(),
        }
    }

    /// Handlers for `ids`, running, and their outcomes when they end.
    fn park(pull: &Arc<Pull>, ids: &[&str]) -> Vec<tokio::task::JoinHandle<Outcome>> {
        ids.iter()
            .map(|id| {
                let pull = Arc::clone(pull);
                let d = delivery(id, 1);
                tokio::spawn(async move { pull.handle(d).await })
            })
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_receive_waits_for_the_first_message_and_takes_what_is_there() {
        let (pull, puller) = pull();
        let pull = Arc::new(pull);
        let waiting = {
            let puller = puller.clone();
            tokio::spawn(async move {
                puller
                    .receive(10, Duration::from_secs(30), Duration::from_secs(20))
                    .await
            })
        };
        tokio::time::sleep(Duration::from_secs(3)).await;
        let started = Instant::now();
        let handlers = park(&pull, &["a"]);
        let got = waiting.await.unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(
            Instant::now(),
            started,
            "answered as it arrived, not at the wait's end"
        );
        assert_eq!(got[0].delivery.message.id, "a");
        puller
            .settle(&got[0].lock_token, Verdict::Complete)
            .unwrap();
        assert_eq!(
            handlers.into_iter().next().unwrap().await.unwrap(),
            Outcome::Complete
        );
        // Nothing there: empty after the wait.
        let empty = puller
            .receive(10, Duration::from_secs(30), Duration::from_secs(20))
            .await;
        assert!(empty.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn verdicts_become_outcomes_and_a_lock_is_settled_once() {
        let (pull, puller) = pull();
        let pull = Arc::new(pull);
        let handlers = park(&pull, &["done", "again", "later", "dead"]);
        tokio::task::yield_now().await;
        let got = puller
            .receive(32, Duration::from_secs(30), Duration::ZERO)
            .await;
        let ids: Vec<&str> = got.iter().map(|r| r.delivery.message.id.as_str()).collect();
        assert_eq!(
            ids,
            ["done", "again", "later", "dead"],
            "in the order they came"
        );
        let verdicts = [
            Verdict::Complete,
            Verdict::Abandon {
                reason: "busy".into(),
                delay: None,
            },
            Verdict::Abandon {
                reason: "not yet".into(),
                delay: Some(Duration::from_secs(10)),
            },
            Verdict::DeadLetter {
                reason: "bad order".into(),
            },
        ];
        for (r, v) in got.iter().zip(verdicts) {
            puller.settle(&r.lock_token, v).unwrap();
        }
        let mut outcomes = Vec::new();
        for h in handlers {
            outcomes.push(h.await.unwrap());
        }
        assert_eq!(
            outcomes,
            [
                Outcome::Complete,
                Outcome::Retry {
                    reason: "busy".into(),
                    delay: None
                },
                Outcome::Retry {
                    reason: "not yet".into(),
                    delay: Some(Duration::from_secs(10))
                },
                Outcome::DeadLetter {
                    reason: "bad order".into(),
                    description: "bad order".into()
                },
            ]
        );
        assert_eq!(
            puller.settle(&got[0].lock_token, Verdict::Complete),
            Err(LockLost(got[0].lock_token.clone()))
        );
        assert_eq!(puller.counts(), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn an_unsettled_lock_expires_at_the_visibility_timeout_unless_renewed() {
        let (pull, puller) = pull();
        let pull = Arc::new(pull);
        let mut handlers = park(&pull, &["crashed", "renewed"]);
        tokio::task::yield_now().await;
        let got = puller
            .receive(2, Duration::from_secs(30), Duration::ZERO)
            .await;
        let renewed = handlers.pop().unwrap();
        let crashed = handlers.pop().unwrap();
        tokio::time::sleep(Duration::from_secs(20)).await;
        puller
            .renew(&got[1].lock_token, Duration::from_secs(30))
            .unwrap();
        tokio::time::sleep(Duration::from_secs(11)).await;
        // The worker that never came back: the message goes back to the group at once.
        assert!(crashed.is_finished());
        assert!(matches!(
            crashed.await.unwrap(),
            Outcome::Retry { delay: Some(d), .. } if d.is_zero()
        ));
        assert_eq!(
            puller.settle(&got[0].lock_token, Verdict::Complete),
            Err(LockLost(got[0].lock_token.clone())),
            "too late: the lock expired"
        );
        // Renewed at 20 s for 30 s: still held at 31 s, expired after 50 s.
        assert!(!renewed.is_finished());
        tokio::time::sleep(Duration::from_secs(20)).await;
        assert!(renewed.is_finished());
        assert!(puller
            .renew(&got[1].lock_token, Duration::from_secs(1))
            .is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn a_stopping_consumer_gives_back_what_no_worker_received() {
        let stop = CancellationToken::new();
        let (pull, puller) = pull();
        let pull = Arc::new(pull.stopping_with(stop.clone()));
        let handlers = park(&pull, &["received", "waiting"]);
        tokio::task::yield_now().await;
        let got = puller
            .receive(1, Duration::from_secs(30), Duration::ZERO)
            .await;
        stop.cancel();
        let mut handlers = handlers.into_iter();
        let (received, waiting) = (handlers.next().unwrap(), handlers.next().unwrap());
        assert!(matches!(
            waiting.await.unwrap(),
            Outcome::Undelivered { .. }
        ));
        // The received one is its worker's to settle, even now.
        assert!(!received.is_finished());
        puller
            .settle(&got[0].lock_token, Verdict::Complete)
            .unwrap();
        assert_eq!(received.await.unwrap(), Outcome::Complete);
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancelled_delivery_cannot_be_received_or_settled() {
        let (pull, puller) = pull();
        let pull = Arc::new(pull);
        let handlers = park(&pull, &["moved", "received"]);
        tokio::task::yield_now().await;
        let got = puller
            .receive(1, Duration::from_secs(30), Duration::ZERO)
            .await;
        assert_eq!(got[0].delivery.message.id, "moved");
        // The host lost the range: both handlers are dropped.
        for h in &handlers {
            h.abort();
        }
        for h in handlers {
            let _ = h.await;
        }
        assert!(puller
            .settle(&got[0].lock_token, Verdict::Complete)
            .is_err());
        assert!(puller
            .receive(1, Duration::from_secs(30), Duration::ZERO)
            .await
            .is_empty());
        assert_eq!(puller.counts(), (0, 0));
    }
}
