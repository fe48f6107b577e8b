//! A consumer group of a queue: the state machine over its state documents (the model is in
//! [`crate::state`]). Claims are in [`claim`], settling in [`settle`]; this module holds the
//! group handle and the document I/O both use.
//!
//! Every transition after the first write is a replace with `If-Match` on the ETag the
//! writer last saw, so at most one consumer of the group holds a message while its lock is
//! valid. In `stream` mode the first delivery writes nothing (the range's lease fences it);
//! only failures create a state document, and from there the path is the same.

mod claim;
mod settle;

pub use claim::{Claim, ClaimOutcome, TakeOver};
pub use settle::RetryOutcome;

use azure_core::http::Etag;
use azure_data_cosmos::options::{ItemWriteOptions, Precondition};
use azure_data_cosmos::FeedScope;
use serde_json::json;
use std::sync::Arc;
use tracing::{debug, warn};

use crate::config::GroupConfig;
use crate::cosmos::sql;
use crate::error::{status_of, QueueError, Result, CONFLICT, NOT_FOUND, PRECONDITION_FAILED};
use crate::message::{Message, MessageKey};
use crate::queue::Queue;
use crate::range::coalesce_ranges;
use crate::state::{state_pk, MessageState, StateDoc, STATE_DOC_TYPE};

/// A consumer group of a queue: the state machine over its state documents.
#[derive(Clone)]
pub struct Group {
    queue: Queue,
    config: Arc<GroupConfig>,
}

pub(crate) enum Write {
    Done(Box<StateDoc>),
    /// Conflict on create, or the ETag no longer matched on replace.
    Lost,
    /// The document does not exist (a replace after TTL removed it).
    Missing,
}

/// How long after its expiry a lock is swept by any host, not only its range's owner.
pub(crate) const STALE_LOCK: std::time::Duration = std::time::Duration::from_millis(500);

impl Group {
    pub(crate) fn new(queue: Queue, config: GroupConfig) -> Self {
        Self {
            queue,
            config: Arc::new(config),
        }
    }

    /// The group's name in the queue.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// Its settings.
    pub fn config(&self) -> &GroupConfig {
        &self.config
    }

    /// The queue it consumes.
    pub fn queue(&self) -> &Queue {
        &self.queue
    }

    fn now(&self) -> i64 {
        self.queue.clock().now_ms()
    }

    fn expires_at(&self, message: &Message) -> Option<i64> {
        self.queue.message_expires_at(message)
    }

    fn retention_secs(&self) -> Option<i64> {
        self.queue.config().retention_secs()
    }

    fn lock_lost(&self, claim: &Claim) -> QueueError {
        QueueError::LockLost {
            group: self.name().into(),
            message_id: claim.message_id.clone(),
        }
    }

    /// A state document as stored, or [`QueueError::UnknownState`] when this version cannot
    /// read it (a state a newer version added, a field of another type).
    pub(crate) fn parse_state(&self, doc: serde_json::Value) -> Result<StateDoc> {
        let id = doc
            .get("id")
            .and_then(serde_json::Value::as_str)
            .unwrap_or_default()
            .to_owned();
        serde_json::from_value(doc).map_err(|e| QueueError::UnknownState {
            group: self.name().to_owned(),
            id,
            reason: e.to_string(),
        })
    }

    /// State documents whose lock expired or whose retry/schedule time has come, longest due
    /// first (a message parked behind its key's predecessors is looked at again and again: it
    /// must not keep the others out of the `limit`). With `ranges` (the lease ranges a host owns),
    /// only messages in them, plus documents that carry no EPK yet, plus locks that ran out
    /// [`STALE_LOCK`] ago anywhere: hosts sweep disjoint sets instead of racing on the same
    /// documents, except for what a dead host left. Documents this version cannot read are
    /// reported and left out: they are another version's to handle, and must not stop the
    /// sweep of every other message.
    pub async fn due(
        &self,
        limit: usize,
        ranges: Option<&[(String, String)]>,
    ) -> Result<Vec<StateDoc>> {
        let mut params = vec![
            ("@limit".to_owned(), json!(limit)),
            ("@type".to_owned(), json!(STATE_DOC_TYPE)),
            ("@group".to_owned(), json!(self.name())),
            ("@now".to_owned(), json!(self.now())),
        ];
        let mut text = String::from(
            "SELECT TOP @limit * FROM c WHERE c.type = @type AND c.group = @group \
             AND (c.state = 'locked' OR c.state = 'retry' OR c.state = 'scheduled') \
             AND c.due <= @now",
        );
        if let Some(ranges) = ranges {
            // A lock that ran out a while ago is any host's to recover: its range's owner may
            // be dead, and waiting for its lease to expire would make the lock mean nothing.
            let mut any = vec![
                "NOT IS_DEFINED(c.epk)".to_owned(),
                "(c.state = 'locked' AND c.due <= @stale)".to_owned(),
            ];
            params.push((
                "@stale".to_owned(),
                json!(self.now() - crate::clock::duration_ms(STALE_LOCK)),
            ));
            for (i, (min, max)) in coalesce_ranges(ranges).into_iter().enumerate() {
                any.push(format!("(c.epk >= @min{i} AND c.epk < @max{i})"));
                params.push((format!("@min{i}"), json!(min)));
                params.push((format!("@max{i}"), json!(max)));
            }
            text.push_str(&format!(" AND ({})", any.join(" OR ")));
        }
        text.push_str(" ORDER BY c.due");
        let params: Vec<(&str, serde_json::Value)> = params
            .iter()
            .map(|(k, v)| (k.as_str(), v.clone()))
            .collect();
        let query = sql::query(&text, &params)?;
        self.state_docs(query, limit, "sweep").await
    }

    /// The state documents a query finds (at most `limit`), those this version cannot read
    /// reported and left out: they are another version's to handle.
    async fn state_docs(
        &self,
        query: azure_data_cosmos::Query,
        limit: usize,
        operation: &'static str,
    ) -> Result<Vec<StateDoc>> {
        let docs: Vec<serde_json::Value> = sql::collect(
            self.queue.leases(),
            query,
            FeedScope::full_container(),
            Some(limit),
            self.queue.charges(),
            operation,
        )
        .await?;
        Ok(docs
            .into_iter()
            .filter_map(|doc| match self.parse_state(doc) {
                Ok(doc) => Some(doc),
                Err(e) => {
                    warn!(group = self.name(), error = %e, "left a state document alone");
                    None
                }
            })
            .collect())
    }

    /// The messages of the EPK range `[min, max)` whose state is not settled (locked, retried,
    /// scheduled, parked), by key: what a range's new owner of an ordered group must not
    /// deliver a key's later messages past, though its checkpoint passed them.
    pub(crate) async fn unsettled_in(
        &self,
        min: &str,
        max: &str,
    ) -> Result<std::collections::BTreeMap<String, Vec<String>>> {
        #[derive(serde::Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Unsettled {
            id: String,
            message_pk: MessageKey,
        }
        let query = sql::query(
            "SELECT c.id, c.messagePk FROM c WHERE c.type = @type AND c.group = @group \
             AND (c.state = 'locked' OR c.state = 'retry' OR c.state = 'scheduled') \
             AND (NOT IS_DEFINED(c.epk) OR (c.epk >= @min AND c.epk < @max))",
            &[
                ("@type", json!(STATE_DOC_TYPE)),
                ("@group", json!(self.name())),
                ("@min", json!(min)),
                ("@max", json!(max)),
            ],
        )?;
        let docs: Vec<Unsettled> = sql::collect(
            self.queue.leases(),
            query,
            FeedScope::full_container(),
            None,
            self.queue.charges(),
            "unsettled",
        )
        .await?;
        let mut by_key: std::collections::BTreeMap<String, Vec<String>> = Default::default();
        for doc in docs {
            // Documents written before `epk` existed: placed by their key here.
            let epk = self.queue.message_epk(&doc.message_pk);
            if crate::range::epk_in(&epk, min, max) {
                by_key
                    .entry(doc.message_pk.canonical())
                    .or_default()
                    .push(doc.id);
            }
        }
        Ok(by_key)
    }

    /// Messages the group holds unsettled in state documents (locked, waiting to retry,
    /// scheduled), soonest due first, at most `limit`: what a console lists as in progress.
    /// First deliveries of stream groups and of the lease write path have no state document
    /// while they run (their range's lease records them), so they are not among these.
    pub async fn unsettled(&self, limit: usize) -> Result<Vec<StateDoc>> {
        let query = sql::query(
            "SELECT TOP @limit * FROM c WHERE c.type = @type AND c.group = @group \
             AND (c.state = 'locked' OR c.state = 'retry' OR c.state = 'scheduled') \
             ORDER BY c.due",
            &[
                ("@limit", json!(limit)),
                ("@type", json!(STATE_DOC_TYPE)),
                ("@group", json!(self.name())),
            ],
        )?;
        self.state_docs(query, limit, "list unsettled").await
    }

    /// The group's state of one message, if any. On the lease write path a completion writes
    /// no state document: a message the group's checkpoint has passed without one, or that
    /// the lease's window lists as done, is reported `Completed` (one attempt, no times;
    /// this includes messages enqueued before a group that starts from now existed). That
    /// answer costs a feed scan from the checkpoint: for inspection, not for a hot path.
    pub async fn read_state(
        &self,
        message_pk: &MessageKey,
        message_id: &str,
    ) -> Result<Option<StateDoc>> {
        if let Some(doc) = self.read_doc(message_pk, message_id).await? {
            return Ok(Some(doc));
        }
        if !self.config.lease_recorded() {
            return Ok(None);
        }
        self.completed_by_lease(message_pk, message_id).await
    }

    /// A `Completed` state for a message its range's lease says is done (see
    /// [`Self::read_state`]); `None` when it is not, or does not exist.
    async fn completed_by_lease(
        &self,
        message_pk: &MessageKey,
        message_id: &str,
    ) -> Result<Option<StateDoc>> {
        let epk = self.queue.message_epk(message_pk);
        let leases = crate::lease::LeaseStore::new(self.queue.clone(), self.name())
            .list()
            .await?;
        let Some(lease) = leases
            .iter()
            .find(|l| crate::range::epk_in(&epk, &l.min_epk, &l.max_epk))
        else {
            return Ok(None);
        };
        let w = &lease.window;
        let listed = |list: &[String]| w.lists(list, message_id, message_pk);
        // What the window handed out unstarted (`maybe_unstarted`) is past the checkpoint,
        // and found unread below.
        if listed(&w.pending) || listed(&w.unstarted) || listed(&w.started) {
            return Ok(None);
        }
        let Some(message) = self.queue.read_message(message_pk, message_id).await? else {
            return Ok(None);
        };
        if !listed(&w.done) && self.unread(lease, message_pk, message_id).await? {
            return Ok(None);
        }
        // Completed with no state document: a first delivery (redeliveries write claims).
        let mut doc = StateDoc::new(self.name(), &message, None, MessageState::Completed);
        doc.settle(MessageState::Completed, self.now());
        doc.settled_at = None;
        doc.attempts = 1;
        Ok(Some(doc))
    }

    /// Whether the message `message_id` under `message_pk` is at or past the lease's
    /// checkpoint (read from there on).
    async fn unread(
        &self,
        lease: &crate::lease::Lease,
        message_pk: &MessageKey,
        message_id: &str,
    ) -> Result<bool> {
        use futures::StreamExt;
        let field = self.queue.config().partition_key_field();
        let mut pages = crate::cosmos::feed::open(
            self.queue.messages(),
            FeedScope::range(lease.feed_range()?),
            crate::config::StartFrom::Beginning,
            lease.continuation.as_deref(),
            1000,
            "read state",
        )
        .await?;
        while let Some(page) = pages.next().await {
            let page = page.map_err(QueueError::cosmos("read state"))?;
            self.queue
                .charges()
                .record_diagnostics("read state", &page.diagnostics());
            if page.items().is_empty() {
                return Ok(false);
            }
            let found = page.items().iter().any(|item| {
                item.current().is_some_and(|doc| {
                    crate::identity::is(doc, field, message_id, message_pk.as_json())
                })
            });
            if found {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The group's state document of one message, if any.
    pub(crate) async fn read_doc(
        &self,
        message_pk: &MessageKey,
        message_id: &str,
    ) -> Result<Option<StateDoc>> {
        let pk = state_pk(self.name(), message_pk);
        match self.queue.leases().read_item(pk, message_id, None).await {
            Ok(response) => {
                self.queue
                    .charges()
                    .record_diagnostics("read state", &response.diagnostics());
                let doc: serde_json::Value = response
                    .into_model()
                    .map_err(QueueError::cosmos("read state"))?;
                self.parse_state(doc).map(Some)
            }
            Err(e) if status_of(&e) == NOT_FOUND => Ok(None),
            Err(e) => Err(QueueError::cosmos("read state")(e)),
        }
    }

    /// `doc` with its message's EPK, which every write of a state the sweep looks for carries
    /// (see [`StateDoc::epk`]); settled states leave it out (one property less to pay for).
    fn with_epk<'d>(&self, doc: &'d StateDoc) -> std::borrow::Cow<'d, StateDoc> {
        if doc.epk.is_some() || doc.state.is_settled() {
            return std::borrow::Cow::Borrowed(doc);
        }
        let mut doc = doc.clone();
        doc.epk = Some(self.queue.message_epk(&doc.message_pk));
        std::borrow::Cow::Owned(doc)
    }

    async fn create(&self, doc: &StateDoc, op: &'static str) -> Result<Write> {
        let doc = &*self.with_epk(doc);
        let result = self
            .queue
            .leases()
            .create_item(doc.pk.clone(), &doc.id, doc, None)
            .await;
        self.written(doc, result, op)
    }

    /// The document as written when `doc`'s write failed without an answer but took effect
    /// (the service applied it and the response was lost); `e` when it did not, or it
    /// cannot be told.
    async fn landed(&self, doc: &StateDoc, e: QueueError) -> Result<StateDoc> {
        match self.read_doc(&doc.message_pk, &doc.id).await {
            Ok(Some(current))
                if current.lock_token.is_some()
                    && current.lock_token == doc.lock_token
                    && current.state == doc.state
                    && current.attempts == doc.attempts =>
            {
                debug!(group = self.name(), message_id = %doc.id, error = %e, "the write took effect although its answer was lost");
                Ok(current)
            }
            _ => Err(e),
        }
    }

    /// Replaces the state document of a claim this holder has: on an ETag mismatch, looks
    /// whether the document still carries the claim's lock token. Then the change was ours
    /// (an earlier attempt whose answer was lost, or a renewal): done if it is already what
    /// `doc` says, else written again on the current ETag. Otherwise the lock is lost.
    async fn replace_own(&self, doc: &StateDoc, etag: &str, op: &'static str) -> Result<Write> {
        let lost = match self.replace(doc, etag, op).await? {
            Write::Lost => Write::Lost,
            other => return Ok(other),
        };
        let Some(current) = self.read_doc(&doc.message_pk, &doc.id).await? else {
            return Ok(Write::Missing);
        };
        if current.lock_token.is_none() || current.lock_token != doc.lock_token {
            return Ok(lost);
        }
        if current.state == doc.state && current.attempts == doc.attempts && current.due == doc.due
        {
            return Ok(Write::Done(Box::new(current)));
        }
        if current.state != MessageState::Locked {
            return Ok(lost);
        }
        let etag = current.etag.clone().unwrap_or_default();
        self.replace(doc, &etag, op).await
    }

    pub(crate) async fn replace(
        &self,
        doc: &StateDoc,
        etag: &str,
        op: &'static str,
    ) -> Result<Write> {
        let doc = &*self.with_epk(doc);
        let options = ItemWriteOptions::default()
            .with_precondition(Precondition::if_match(Etag::from(etag.to_owned())));
        let result = self
            .queue
            .leases()
            .replace_item(doc.pk.clone(), &doc.id, doc, Some(options))
            .await;
        self.written(doc, result, op)
    }

    fn written(
        &self,
        doc: &StateDoc,
        result: azure_data_cosmos::Result<azure_data_cosmos::models::ItemResponse>,
        op: &'static str,
    ) -> Result<Write> {
        match result {
            Ok(response) => {
                self.queue
                    .charges()
                    .record_diagnostics(op, &response.diagnostics());
                let mut doc = doc.clone();
                doc.etag = response.headers().etag().map(|e| e.to_string());
                Ok(Write::Done(Box::new(doc)))
            }
            Err(e) => match status_of(&e) {
                CONFLICT | PRECONDITION_FAILED => {
                    match e.diagnostics() {
                        Some(d) => self.queue.charges().record_diagnostics(op, &d),
                        None => self.queue.charges().record(op, None),
                    }
                    Ok(Write::Lost)
                }
                NOT_FOUND => Ok(Write::Missing),
                _ => Err(QueueError::cosmos(op)(e)),
            },
        }
    }
}
