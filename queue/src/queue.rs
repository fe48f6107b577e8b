//! A handle on one provisioned queue.

use std::sync::Arc;

use azure_data_cosmos::models::PartitionKeyDefinition;
use azure_data_cosmos::{ContainerClient, CosmosClient};

use crate::clock::Clock;
use crate::config::{GroupConfig, QueueConfig};
use crate::cosmos::charge::RequestCharges;
use crate::error::{QueueError, Result, NOT_FOUND};
use crate::group::Group;
use crate::message::{Message, MessageKey};

/// A queue: its messages container, its lease container, the clock and the RU counters.
/// Cheap to clone; every clone shares the counters.
#[derive(Clone)]
pub struct Queue {
    inner: Arc<Inner>,
}

struct Inner {
    /// As given, except `retention`: the messages container's default TTL, read at open.
    config: QueueConfig,
    /// The messages container's, as read at open: what effective partition keys are hashed by.
    partition_key: PartitionKeyDefinition,
    /// Whether the messages container expires items at all (a per-message `ttl` needs it).
    ttl_enabled: bool,
    messages: ContainerClient,
    leases: ContainerClient,
    clock: Clock,
    charges: Arc<RequestCharges>,
}

impl Queue {
    /// Opens a queue whose containers exist (see [`crate::cosmos::provision`]).
    pub async fn open(client: &CosmosClient, config: QueueConfig) -> Result<Self> {
        Self::open_with_clock(client, config, Clock::system()).await
    }

    /// The queue's retention is the messages container's default TTL, read here: every
    /// process judges message expiry by the same number, whatever `config.retention` says
    /// (that is only what [`crate::cosmos::provision`] creates a container with).
    pub async fn open_with_clock(
        client: &CosmosClient,
        mut config: QueueConfig,
        clock: Clock,
    ) -> Result<Self> {
        config.validate()?;
        let db = client.database_client(config.database.as_str());
        let messages = db
            .container_client(config.container.as_str(), None)
            .await
            .map_err(QueueError::cosmos("open messages container"))?;
        let properties: azure_data_cosmos::models::ContainerProperties = messages
            .read(None)
            .await
            .map_err(QueueError::cosmos("read messages container"))?
            .into_model()
            .map_err(QueueError::cosmos("read messages container"))?;
        let (ttl_enabled, retention) = retention_of(&properties.default_ttl);
        let partition_key = properties.partition_key.clone();
        let path = match partition_key.paths() {
            [path] => path.to_string(),
            paths => {
                return Err(QueueError::Config(format!(
                    "the messages container {} is partitioned by {} paths ({}); cosmosq needs \
                     one partition key path",
                    config.container,
                    paths.len(),
                    paths
                        .iter()
                        .map(|p| p.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )))
            }
        };
        if config.partition_key_path != path {
            tracing::info!(queue = %config.container, configured = %config.partition_key_path, container = %path, "partition key path taken from the messages container");
            config.partition_key_path = path;
        }
        if config.retention != retention {
            tracing::debug!(queue = %config.container, configured = ?config.retention, container = ?retention, "retention taken from the messages container");
        }
        config.retention = retention;
        let leases = db
            .container_client(config.lease_container_name().as_str(), None)
            .await
            .map_err(QueueError::cosmos("open lease container"))?;
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                partition_key,
                ttl_enabled,
                messages,
                leases,
                clock,
                charges: Arc::default(),
            }),
        })
    }

    /// The queue's settings, with the retention read from the container.
    pub fn config(&self) -> &QueueConfig {
        &self.inner.config
    }

    /// The messages container's name.
    pub fn name(&self) -> &str {
        &self.inner.config.container
    }

    /// The clock every time of the queue is read from.
    pub fn clock(&self) -> &Clock {
        &self.inner.clock
    }

    /// What the queue's operations have cost.
    pub fn charges(&self) -> &Arc<RequestCharges> {
        &self.inner.charges
    }

    /// The messages container.
    pub fn messages(&self) -> &ContainerClient {
        &self.inner.messages
    }

    /// The lease container (leases and groups' state documents).
    pub fn leases(&self) -> &ContainerClient {
        &self.inner.leases
    }

    /// The effective partition key (hex) of messages with `key`: where in the container's key
    /// space, and so in which lease's range, they are.
    pub fn message_epk(&self, key: &MessageKey) -> String {
        crate::range::key_epk(key, &self.inner.partition_key)
    }

    /// When `message` leaves the container by TTL (epoch ms); `None`: never.
    pub fn message_expires_at(&self, message: &Message) -> Option<i64> {
        if !self.inner.ttl_enabled {
            return None;
        }
        message.expires_at(self.inner.config.retention_secs())
    }

    pub(crate) fn pk_field(&self) -> &str {
        self.inner.config.partition_key_field()
    }

    /// Physical partitions of the messages container, read fresh (a split shows at once).
    pub async fn partitions(&self) -> Result<usize> {
        Ok(self.feed_ranges().await?.len())
    }

    /// The messages container's physical partitions as feed ranges, read fresh: the SDK's
    /// cached topology would hide a split or a merge (a metadata read, no request units).
    pub(crate) async fn feed_ranges(&self) -> Result<Vec<azure_data_cosmos::feed::FeedRange>> {
        self.messages()
            .read_feed_ranges(Some(
                azure_data_cosmos::options::ReadFeedRangesOptions::default()
                    .with_force_refresh(true),
            ))
            .await
            .map_err(QueueError::cosmos("read feed ranges"))
    }

    /// Up to `limit` retained messages, oldest first per range, without consuming anything.
    /// Documents that are not messages (written by something else) are counted, not shown.
    pub async fn peek(&self, limit: usize) -> Result<(Vec<Message>, usize)> {
        use futures::StreamExt;
        let mut pages = crate::cosmos::feed::open(
            self.messages(),
            azure_data_cosmos::FeedScope::full_container(),
            crate::config::StartFrom::Beginning,
            None,
            limit.clamp(1, 1000) as u32,
            "peek",
        )
        .await?;
        let (mut messages, mut unreadable) = (Vec::new(), 0);
        while messages.len() < limit {
            let Some(page) = pages.next().await else {
                break;
            };
            let page = page.map_err(QueueError::cosmos("peek"))?;
            self.charges()
                .record_diagnostics("peek", &page.diagnostics());
            if page.items().is_empty() {
                break;
            }
            for doc in page.items().iter().filter_map(|i| i.current()) {
                match Message::from_document(doc, self.pk_field()) {
                    Ok(m) if messages.len() < limit => messages.push(m),
                    Ok(_) => {}
                    Err(_) => unreadable += 1,
                }
            }
        }
        Ok((messages, unreadable))
    }

    /// The consumer groups that have leases on this queue.
    pub async fn group_names(&self) -> Result<Vec<String>> {
        #[derive(serde::Deserialize)]
        struct Row {
            group: String,
        }
        let query = crate::cosmos::sql::query(
            "SELECT c.group FROM c WHERE c.type = @type",
            &[("@type", serde_json::json!(crate::lease::LEASE_DOC_TYPE))],
        )?;
        let rows: Vec<Row> = crate::cosmos::sql::collect(
            self.leases(),
            query,
            azure_data_cosmos::FeedScope::full_container(),
            None,
            self.charges(),
            "list groups",
        )
        .await?;
        let mut names: Vec<String> = rows.into_iter().map(|r| r.group).collect();
        names.sort();
        names.dedup();
        Ok(names)
    }

    /// A consumer group of this queue.
    pub fn group(&self, config: GroupConfig) -> Result<Group> {
        config.validate()?;
        Ok(Group::new(self.clone(), config))
    }

    /// Reads one message by partition key and id; `None` when it is gone (TTL) or never was.
    pub async fn read_message(
        &self,
        partition_key: &MessageKey,
        id: &str,
    ) -> Result<Option<Message>> {
        let response = match self
            .messages()
            .read_item(partition_key.to_partition_key(), id, None)
            .await
        {
            Ok(r) => r,
            Err(e) if crate::error::status_of(&e) == NOT_FOUND => return Ok(None),
            Err(e) => return Err(QueueError::cosmos("read message")(e)),
        };
        self.charges()
            .record_diagnostics("read message", &response.diagnostics());
        let doc: serde_json::Value = response
            .into_model()
            .map_err(QueueError::cosmos("read message"))?;
        Message::from_document(&doc, self.pk_field())
            .map(Some)
            .map_err(|reason| QueueError::Malformed {
                container: self.name().to_owned(),
                id: id.to_owned(),
                reason,
            })
    }
}

/// (TTL enabled, default retention) of a container's `defaultTtl`.
fn retention_of(
    ttl: &azure_data_cosmos::models::TimeToLive,
) -> (bool, Option<std::time::Duration>) {
    use azure_data_cosmos::models::TimeToLive;
    match ttl {
        TimeToLive::Seconds(secs) => (true, Some(std::time::Duration::from_secs(u64::from(*secs)))),
        TimeToLive::NoDefault => (true, None),
        _ => (false, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use azure_data_cosmos::models::TimeToLive;
    use std::time::Duration;

    #[test]
    fn retention_is_the_containers_default_ttl() {
        assert_eq!(
            retention_of(&TimeToLive::Seconds(30 * 86_400)),
            (true, Some(Duration::from_secs(30 * 86_400)))
        );
        assert_eq!(retention_of(&TimeToLive::NoDefault), (true, None));
        assert_eq!(retention_of(&TimeToLive::Forever), (false, None));
    }
}
