//! The app's side of the engine tests: one recorder of what a handler was given and what it
//! answered, per group and message. A message is (id, partition key) here as everywhere: two
//! messages that share an id under different keys are two rows.
//!
//! The simulation keeps its own ledger (`it/sim/world.rs`): it also records the lease writes of
//! every pod incarnation, in deterministic order, for its checker.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};

use cosmosq_queue::{Delivery, Outcome};
use futures::future::BoxFuture;
use futures::FutureExt as _;
use tokio::sync::Notify;

/// A message as the ledger names it: its id and its key's canonical JSON.
pub type Identity = (String, String);

/// What one group's app saw of one message.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Record {
    /// The delivery count of each delivery, in the order the app was given them.
    pub delivery_counts: Vec<u32>,
    /// How many times the app answered `Complete`.
    pub completions: u32,
    /// How many times the app answered `DeadLetter`.
    pub dead_letters: u32,
}

#[derive(Default)]
struct Book {
    records: HashMap<(String, Identity), Record>,
    /// Deliveries the app is working on now.
    in_app: HashSet<(String, Identity)>,
    /// A delivery given while the same message was still in the app, per group.
    overlaps: HashMap<String, Vec<String>>,
    /// Ids in the order the app was given them, per group.
    given: HashMap<String, Vec<String>>,
    /// Identities in the order the app completed them, per group.
    completed: HashMap<String, Vec<Identity>>,
    deliveries: u64,
}

/// What the apps of every group were given and answered (see the module docs).
#[derive(Default)]
pub struct Ledger {
    book: Mutex<Book>,
    changed: Notify,
}

/// A delivery in the app. It leaves the in-flight set when dropped, however the call ends: an
/// answer, a panic, or a killed pod's task dropped.
pub struct InApp {
    ledger: Arc<Ledger>,
    at: (String, Identity),
}

impl Drop for InApp {
    fn drop(&mut self) {
        self.ledger.book().in_app.remove(&self.at);
        self.ledger.changed.notify_waiters();
    }
}

fn identity(d: &Delivery) -> Identity {
    (d.message.id.clone(), d.message.partition_key.canonical())
}

impl Ledger {
    pub fn new() -> Arc<Ledger> {
        Arc::default()
    }

    fn book(&self) -> MutexGuard<'_, Book> {
        // A handler that panics on purpose (an app crash) must not poison the record.
        self.book
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records a delivery given to the app; the app works on it until the guard drops.
    pub fn begin(self: &Arc<Self>, d: &Delivery) -> InApp {
        let at = (d.group.clone(), identity(d));
        {
            let mut book = self.book();
            if !book.in_app.insert(at.clone()) {
                book.overlaps
                    .entry(d.group.clone())
                    .or_default()
                    .push(format!(
                        "{:?} delivery {} while in the app",
                        at.1, d.delivery_count
                    ));
            }
            book.records
                .entry(at.clone())
                .or_default()
                .delivery_counts
                .push(d.delivery_count);
            book.given
                .entry(d.group.clone())
                .or_default()
                .push(d.message.id.clone());
            book.deliveries += 1;
        }
        self.changed.notify_waiters();
        InApp {
            ledger: Arc::clone(self),
            at,
        }
    }

    /// Records the app's answer to `d`.
    pub fn answered(&self, d: &Delivery, outcome: &Outcome) {
        {
            let mut book = self.book();
            let record = book
                .records
                .entry((d.group.clone(), identity(d)))
                .or_default();
            match outcome {
                Outcome::Complete => {
                    record.completions += 1;
                    book.completed
                        .entry(d.group.clone())
                        .or_default()
                        .push(identity(d));
                }
                Outcome::DeadLetter { .. } => record.dead_letters += 1,
                _ => {}
            }
        }
        self.changed.notify_waiters();
    }

    /// A handler that records each delivery and the answer `app` gives it.
    pub fn handler<F, Fut>(
        self: &Arc<Self>,
        app: F,
    ) -> impl Fn(Delivery) -> BoxFuture<'static, Outcome> + Clone + Send + Sync + 'static
    where
        F: Fn(Delivery) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Outcome> + Send + 'static,
    {
        let ledger = Arc::clone(self);
        let app = Arc::new(app);
        move |d: Delivery| {
            let (ledger, app) = (Arc::clone(&ledger), Arc::clone(&app));
            async move {
                let in_app = ledger.begin(&d);
                let outcome = app(d.clone()).await;
                ledger.answered(&d, &outcome);
                drop(in_app);
                outcome
            }
            .boxed()
        }
    }

    /// A handler that records each delivery and completes it after a yield.
    pub fn completing(
        self: &Arc<Self>,
    ) -> impl Fn(Delivery) -> BoxFuture<'static, Outcome> + Clone + Send + Sync + 'static {
        self.handler(|_| async {
            tokio::task::yield_now().await;
            Outcome::Complete
        })
    }

    /// Messages of `group` the app was given at least once.
    pub fn delivered(&self, group: &str) -> usize {
        self.book()
            .records
            .iter()
            .filter(|((g, _), r)| g == group && !r.delivery_counts.is_empty())
            .count()
    }

    /// Messages of `group` the app completed at least once.
    pub fn completed(&self, group: &str) -> usize {
        self.book()
            .records
            .iter()
            .filter(|((g, _), r)| g == group && r.completions > 0)
            .count()
    }

    /// Messages of `group` the app completed more than once, sorted.
    pub fn completed_twice(&self, group: &str) -> Vec<Identity> {
        let mut twice: Vec<Identity> = self
            .book()
            .records
            .iter()
            .filter(|((g, _), r)| g == group && r.completions > 1)
            .map(|((_, m), _)| m.clone())
            .collect();
        twice.sort();
        twice
    }

    /// Deliveries per message of `group`.
    pub fn counts(&self, group: &str) -> Vec<usize> {
        self.book()
            .records
            .iter()
            .filter(|((g, _), _)| g == group)
            .map(|(_, r)| r.delivery_counts.len())
            .collect()
    }

    /// Every message's record in `group`.
    pub fn records(&self, group: &str) -> HashMap<Identity, Record> {
        self.book()
            .records
            .iter()
            .filter(|((g, _), _)| g == group)
            .map(|((_, m), r)| (m.clone(), r.clone()))
            .collect()
    }

    /// The record of the message `id` of `group`; panics if the id was given under two keys
    /// (say which then) — an id alone does not name a message.
    pub fn record(&self, group: &str, id: &str) -> Record {
        let matching: Vec<Record> = self
            .records(group)
            .into_iter()
            .filter(|((i, _), _)| i == id)
            .map(|(_, r)| r)
            .collect();
        assert!(
            matching.len() <= 1,
            "{group}: {id} was given under two keys"
        );
        matching.into_iter().next().unwrap_or_default()
    }

    /// Every delivery, all groups.
    pub fn deliveries(&self) -> u64 {
        self.book().deliveries
    }

    /// The ids `group`'s app was given, in order.
    pub fn given(&self, group: &str) -> Vec<String> {
        self.book().given.get(group).cloned().unwrap_or_default()
    }

    /// The messages `group`'s app completed, in order.
    pub fn completed_order(&self, group: &str) -> Vec<Identity> {
        self.book()
            .completed
            .get(group)
            .cloned()
            .unwrap_or_default()
    }

    /// Deliveries of `group` given while the same message was in the app.
    pub fn overlaps(&self, group: &str) -> Vec<String> {
        self.book().overlaps.get(group).cloned().unwrap_or_default()
    }

    /// Panics unless the app was given every message of `group` exactly once, one at a time.
    pub fn assert_each_once(&self, group: &str) {
        let overlaps = self.overlaps(group);
        assert!(
            overlaps.is_empty(),
            "{group}: held by two at once: {overlaps:?}"
        );
        let again: Vec<Identity> = self
            .records(group)
            .into_iter()
            .filter(|(_, r)| r.delivery_counts.len() != 1)
            .map(|(m, _)| m)
            .collect();
        assert!(
            again.is_empty(),
            "{group}: delivered more than once: {again:?}"
        );
    }

    /// Wakes each time a delivery begins, is answered or leaves the app.
    pub fn changed(&self) -> &Notify {
        &self.changed
    }

    /// Waits until `pred` holds, woken by the ledger's changes (no polling sleeps).
    pub async fn wait_until(&self, pred: impl Fn(&Ledger) -> bool) {
        crate::wait_on(&self.changed, "the app's deliveries", || pred(self)).await;
    }
}
