//! Cosmos DB's TTL, on simulated time: the SDK's emulator stores `ttl` but expires nothing,
//! and stamps `_ts` with the machine's clock, so the simulation removes what has expired by
//! the producer's clock (`enqueuedAt` + the message's TTL or the queue's retention).

use azure_data_cosmos::options::ChangeFeedStartFrom;
use azure_data_cosmos::FeedScope;
use cosmosq_queue::{MessageKey, Queue};
use futures::StreamExt;
use serde_json::Value;

/// Deletes every message whose life is over.
pub async fn sweep(queue: &Queue) {
    let now = queue.clock().now_ms();
    let retention = queue.config().retention_secs();
    let field = queue.config().partition_key_field().to_owned();
    let Ok(ranges) = queue.messages().read_feed_ranges(None).await else {
        return;
    };
    let mut expired = Vec::new();
    for range in ranges {
        let Ok(mut pages) = queue
            .messages()
            .query_change_feed::<Value>(
                FeedScope::range(range),
                ChangeFeedStartFrom::Beginning,
                None,
            )
            .await
        else {
            return;
        };
        while let Some(Ok(page)) = pages.next().await {
            if page.items().is_empty() {
                break;
            }
            for item in page.items().iter().filter_map(|i| i.current()) {
                let enqueued = item.get("enqueuedAt").and_then(Value::as_i64).unwrap_or(0);
                let ttl = item.get("ttl").and_then(Value::as_i64).or(retention);
                let Some(ttl) = ttl.filter(|t| *t >= 0) else {
                    continue;
                };
                if enqueued + ttl * 1000 > now {
                    continue;
                }
                let (Some(id), Some(key)) = (
                    item.get("id").and_then(Value::as_str),
                    item.get(&field)
                        .and_then(|k| MessageKey::from_json(k.clone()).ok()),
                ) else {
                    continue;
                };
                expired.push((id.to_owned(), key));
            }
        }
    }
    for (id, key) in expired {
        let _ = queue
            .messages()
            .delete_item(key.to_partition_key(), &id, None)
            .await;
    }
}
