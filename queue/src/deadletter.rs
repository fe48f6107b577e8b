//! A group's dead letters: list, peek, replay, purge.

use azure_data_cosmos::FeedScope;
use serde::Serialize;
use serde_json::json;
use tracing::info;

use crate::cosmos::sql;
use crate::error::Result;
use crate::group::Group;
use crate::message::{Message, MessageKey};
use crate::state::{MessageState, StateDoc, STATE_DOC_TYPE};

/// A dead-lettered message as users see it.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetter {
    /// The message's id.
    pub message_id: String,
    /// Its partition key (with its id, what replay and purge need).
    pub partition_key: MessageKey,
    /// The group it was dead-lettered in.
    pub group: String,
    /// Why: `MaxDeliveryAttemptsExceeded`, `DroppedByApp`, `MessageExpired`, `PermanentError`, ….
    pub reason: Option<String>,
    /// The last delivery's error.
    pub last_error: Option<String>,
    /// Deliveries made.
    pub attempts: u32,
    /// When it was enqueued (epoch ms).
    pub enqueued_at: i64,
    /// When it was first delivered (epoch ms).
    pub first_attempt_at: Option<i64>,
    /// When it was last delivered (epoch ms).
    pub last_attempt_at: Option<i64>,
    /// When it was dead-lettered (epoch ms).
    pub dead_lettered_at: Option<i64>,
}

impl From<&StateDoc> for DeadLetter {
    fn from(doc: &StateDoc) -> Self {
        Self {
            message_id: doc.id.clone(),
            partition_key: doc.message_pk.clone(),
            group: doc.group.clone(),
            reason: doc.reason.clone(),
            last_error: doc.last_error.clone(),
            attempts: doc.attempts,
            enqueued_at: doc.enqueued_at,
            first_attempt_at: doc.first_attempt_at,
            last_attempt_at: doc.last_attempt_at,
            dead_lettered_at: doc.settled_at,
        }
    }
}

/// A group's dead letters among the state documents (`@type`, `@group`).
const DEAD_LETTERED: &str = "c.type = @type AND c.group = @group AND c.state = 'deadLettered'";

impl Group {
    /// The group's dead letters (at most `limit`).
    pub async fn dead_letters(&self, limit: Option<usize>) -> Result<Vec<DeadLetter>> {
        Ok(self
            .dead_letter_docs(limit)
            .await?
            .iter()
            .map(DeadLetter::from)
            .collect())
    }

    /// How many messages the group dead-lettered, counting at most `limit`. Ids only: a
    /// gauge read every few seconds must not load (and hold) every dead letter's document.
    pub async fn count_dead_letters(&self, limit: usize) -> Result<usize> {
        let query = sql::query(
            &format!("SELECT VALUE c.id FROM c WHERE {DEAD_LETTERED}"),
            &[
                ("@type", json!(STATE_DOC_TYPE)),
                ("@group", json!(self.name())),
            ],
        )?;
        let ids: Vec<String> = sql::collect(
            self.queue().leases(),
            query,
            FeedScope::full_container(),
            Some(limit),
            self.queue().charges(),
            "count dead letters",
        )
        .await?;
        Ok(ids.len())
    }

    async fn dead_letter_docs(&self, limit: Option<usize>) -> Result<Vec<StateDoc>> {
        let query = sql::query(
            &format!("SELECT * FROM c WHERE {DEAD_LETTERED}"),
            &[
                ("@type", json!(STATE_DOC_TYPE)),
                ("@group", json!(self.name())),
            ],
        )?;
        sql::collect(
            self.queue().leases(),
            query,
            FeedScope::full_container(),
            limit,
            self.queue().charges(),
            "list dead letters",
        )
        .await
    }

    /// One dead letter with its message (the message is `None` once retention removed it).
    pub async fn peek_dead_letter(
        &self,
        partition_key: &MessageKey,
        message_id: &str,
    ) -> Result<Option<(DeadLetter, Option<Message>)>> {
        let Some(doc) = self.read_doc(partition_key, message_id).await? else {
            return Ok(None);
        };
        if doc.state != MessageState::DeadLettered {
            return Ok(None);
        }
        let message = self.queue().read_message(partition_key, message_id).await?;
        Ok(Some((DeadLetter::from(&doc), message)))
    }

    /// Sends a dead letter back to its group with a fresh attempt budget; it is delivered at
    /// the next sweep. Returns `false` when it is not (or no longer) a dead letter.
    pub async fn replay(&self, partition_key: &MessageKey, message_id: &str) -> Result<bool> {
        self.transition_dead_letter(
            partition_key,
            message_id,
            |doc, now| {
                doc.state = MessageState::Retry;
                doc.due = Some(now);
                doc.attempts = 0;
                doc.settled_at = None;
                doc.reason = None;
            },
            "replay",
        )
        .await
    }

    /// Discards a dead letter for good: it is never delivered to this group again.
    pub async fn purge(&self, partition_key: &MessageKey, message_id: &str) -> Result<bool> {
        self.transition_dead_letter(
            partition_key,
            message_id,
            |doc, now| {
                doc.state = MessageState::Purged;
                doc.settled_at = Some(now);
            },
            "purge",
        )
        .await
    }

    /// Replays every dead letter; returns how many.
    pub async fn replay_all(&self) -> Result<usize> {
        self.for_all_dead_letters(|g, pk, id| async move { g.replay(&pk, &id).await })
            .await
    }

    /// Purges every dead letter; returns how many.
    pub async fn purge_all(&self) -> Result<usize> {
        self.for_all_dead_letters(|g, pk, id| async move { g.purge(&pk, &id).await })
            .await
    }

    async fn for_all_dead_letters<F, Fut>(&self, action: F) -> Result<usize>
    where
        F: Fn(Group, MessageKey, String) -> Fut,
        Fut: std::future::Future<Output = Result<bool>>,
    {
        let mut done = 0;
        for doc in self.dead_letter_docs(None).await? {
            if action(self.clone(), doc.message_pk.clone(), doc.id.clone()).await? {
                done += 1;
            }
        }
        Ok(done)
    }

    async fn transition_dead_letter(
        &self,
        partition_key: &MessageKey,
        message_id: &str,
        change: impl FnOnce(&mut StateDoc, i64),
        op: &'static str,
    ) -> Result<bool> {
        let Some(doc) = self.read_doc(partition_key, message_id).await? else {
            return Ok(false);
        };
        if doc.state != MessageState::DeadLettered {
            return Ok(false);
        }
        let etag = doc.etag.clone().unwrap_or_default();
        let mut next = doc;
        let now = self.queue().clock().now_ms();
        change(&mut next, now);
        next.refresh_ttl(now, self.queue().config().retention_secs());
        let done = matches!(
            self.replace(&next, &etag, op).await?,
            crate::group::Write::Done(_)
        );
        if done {
            info!(group = self.name(), message_id, op, "dead letter moved");
        }
        Ok(done)
    }
}
