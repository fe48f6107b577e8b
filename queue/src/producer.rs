//! Enqueue: idempotent by id, one message or many.

use std::collections::BTreeMap;

use azure_data_cosmos::TransactionalBatch;
use futures::future::join_all;
use serde_json::Value;
use tracing::{debug, warn};

use crate::error::{status_of, QueueError, Result, CONFLICT, TOO_LARGE};
use crate::message::{Message, MessageError, MessageKey, NewMessage, MAX_ITEM_BYTES};
use crate::queue::Queue;

/// Transactional batches hold at most 100 operations and 2 MB.
const BATCH_MAX_OPERATIONS: usize = 100;
const BATCH_MAX_BYTES: usize = MAX_ITEM_BYTES - 64 * 1024;

/// What happened to one message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EnqueueOutcome {
    /// Written.
    Enqueued {
        /// The message's id.
        id: String,
        /// Its partition key.
        partition_key: MessageKey,
    },
    /// A message with this id and partition key is already in the queue; nothing was written.
    Duplicate {
        /// The message's id.
        id: String,
        /// Its partition key.
        partition_key: MessageKey,
    },
}

impl EnqueueOutcome {
    /// The message's id, either way.
    pub fn id(&self) -> &str {
        match self {
            EnqueueOutcome::Enqueued { id, .. } | EnqueueOutcome::Duplicate { id, .. } => id,
        }
    }

    /// Whether it was already there.
    pub fn is_duplicate(&self) -> bool {
        matches!(self, EnqueueOutcome::Duplicate { .. })
    }
}

/// The per-message error type of [`Queue::enqueue_batch`].
pub type EnqueueError = QueueError;

impl Queue {
    /// Enqueues one message. A message whose id (within its partition key) is already stored
    /// is reported as [`EnqueueOutcome::Duplicate`], not as an error.
    pub async fn enqueue(&self, message: NewMessage) -> Result<EnqueueOutcome> {
        let message = message.into_message(self.clock().now_ms())?;
        let doc = message.to_document(self.pk_field())?;
        self.create(&message, doc).await
    }

    /// Enqueues many messages; results come back in input order. Messages sharing a partition
    /// key go in transactional batches (one request instead of many); the others, and any
    /// batch that fails as a whole (a duplicate inside it, say), go one by one so every message
    /// gets its own answer. One invalid message does not stop the rest.
    ///
    /// Keys are written concurrently, but a key's messages one after another (chunk after
    /// chunk, and one by one in input order when a batch falls back): the change feed then
    /// orders them as given, which is the order FIFO groups deliver.
    pub async fn enqueue_batch(&self, messages: Vec<NewMessage>) -> Vec<Result<EnqueueOutcome>> {
        let now = self.clock().now_ms();
        let mut results: Vec<Option<Result<EnqueueOutcome>>> = Vec::with_capacity(messages.len());
        let mut by_key: BTreeMap<String, Vec<(usize, Message, Value)>> = BTreeMap::new();
        for (index, new) in messages.into_iter().enumerate() {
            results.push(None);
            let prepared = new
                .into_message(now)
                .and_then(|m| m.to_document(self.pk_field()).map(|doc| (m, doc)));
            match prepared {
                Ok((m, doc)) => by_key
                    .entry(m.partition_key.canonical())
                    .or_default()
                    .push((index, m, doc)),
                Err(e) => results[index] = Some(Err(e.into())),
            }
        }
        let work = by_key.into_values().map(|items| async move {
            let mut done = Vec::with_capacity(items.len());
            for chunk in chunk_for_batches(items) {
                done.extend(self.enqueue_chunk(chunk).await);
            }
            done
        });
        for key_results in join_all(work).await {
            for (index, result) in key_results {
                results[index] = Some(result);
            }
        }
        results
            .into_iter()
            .map(|r| r.expect("every message gets a result"))
            .collect()
    }

    async fn enqueue_chunk(
        &self,
        chunk: Vec<(usize, Message, Value)>,
    ) -> Vec<(usize, Result<EnqueueOutcome>)> {
        if chunk.len() > 1 {
            match self.try_batch(&chunk).await {
                Ok(true) => {
                    return chunk
                        .into_iter()
                        .map(|(i, m, _)| {
                            let outcome = EnqueueOutcome::Enqueued {
                                id: m.id,
                                partition_key: m.partition_key,
                            };
                            (i, Ok(outcome))
                        })
                        .collect()
                }
                Ok(false) => debug!(
                    queue = self.name(),
                    size = chunk.len(),
                    "batch rejected as a whole; enqueueing its messages one by one"
                ),
                Err(e) => warn!(
                    queue = self.name(),
                    size = chunk.len(),
                    error = %e,
                    "batch failed; enqueueing its messages one by one"
                ),
            }
        }
        let mut done = Vec::with_capacity(chunk.len());
        for (i, m, doc) in chunk {
            done.push((i, self.create(&m, doc).await));
        }
        done
    }

    /// `Ok(false)` when the batch was rejected as a whole (an operation failed, nothing was
    /// written), so the caller can find out which message it was.
    async fn try_batch(&self, chunk: &[(usize, Message, Value)]) -> Result<bool> {
        let key = chunk[0].1.partition_key.to_partition_key();
        let mut batch = TransactionalBatch::new(key);
        for (_, _, doc) in chunk {
            batch = batch
                .create_item(doc)
                .map_err(QueueError::cosmos("build batch"))?;
        }
        let response = self
            .messages()
            .execute_transactional_batch(batch, None)
            .await
            .map_err(QueueError::cosmos("enqueue batch"))?;
        self.charges()
            .record_diagnostics("enqueue batch", &response.diagnostics());
        Ok(response.status().status_code().is_success()
            && u16::from(response.status().status_code()) != 207)
    }

    async fn create(&self, message: &Message, doc: Value) -> Result<EnqueueOutcome> {
        let result = self
            .messages()
            .create_item(
                message.partition_key.to_partition_key(),
                &message.id,
                doc,
                None,
            )
            .await;
        match result {
            Ok(response) => {
                self.charges()
                    .record_diagnostics("enqueue", &response.diagnostics());
                Ok(EnqueueOutcome::Enqueued {
                    id: message.id.clone(),
                    partition_key: message.partition_key.clone(),
                })
            }
            Err(e) if status_of(&e) == CONFLICT => Ok(EnqueueOutcome::Duplicate {
                id: message.id.clone(),
                partition_key: message.partition_key.clone(),
            }),
            Err(e) if status_of(&e) == TOO_LARGE => Err(MessageError::TooLarge {
                size: MAX_ITEM_BYTES + 1,
            }
            .into()),
            Err(e) => Err(QueueError::cosmos("enqueue")(e)),
        }
    }
}

/// Splits one partition key's messages into chunks a transactional batch accepts.
fn chunk_for_batches(items: Vec<(usize, Message, Value)>) -> Vec<Vec<(usize, Message, Value)>> {
    let mut chunks = Vec::new();
    let mut current = Vec::new();
    let mut bytes = 0;
    for item in items {
        let size = serde_json::to_vec(&item.2).map(|b| b.len()).unwrap_or(0);
        if !current.is_empty()
            && (current.len() == BATCH_MAX_OPERATIONS || bytes + size > BATCH_MAX_BYTES)
        {
            chunks.push(std::mem::take(&mut current));
            bytes = 0;
        }
        bytes += size;
        current.push(item);
    }
    if !current.is_empty() {
        chunks.push(current);
    }
    chunks
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn item(i: usize, body_bytes: usize) -> (usize, Message, Value) {
        let m = NewMessage::json(json!("x".repeat(body_bytes)))
            .with_partition_key("k")
            .into_message(0)
            .unwrap();
        let doc = m.to_document("pk").unwrap();
        (i, m, doc)
    }

    #[test]
    fn chunks_respect_operation_and_size_limits() {
        let chunks = chunk_for_batches((0..250).map(|i| item(i, 10)).collect());
        assert_eq!(
            chunks.iter().map(Vec::len).collect::<Vec<_>>(),
            vec![100, 100, 50]
        );
        let chunks = chunk_for_batches((0..5).map(|i| item(i, 800_000)).collect());
        assert!(
            chunks.iter().all(|c| c.len() <= 2),
            "{:?}",
            chunks.iter().map(Vec::len).collect::<Vec<_>>()
        );
        let order: Vec<usize> = chunks.iter().flatten().map(|c| c.0).collect();
        assert_eq!(order, vec![0, 1, 2, 3, 4]);
    }
}
