//! What a queue and a consumer group are, and what makes them valid.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::backoff::RetryPolicy;
use crate::error::{QueueError, Result};
use crate::message::RESERVED_FIELDS;

/// A queue: one messages container plus its lease container.
#[derive(Clone, Debug, PartialEq)]
pub struct QueueConfig {
    /// The database that holds both containers.
    pub database: String,
    /// The messages container; it is also the queue's name.
    pub container: String,
    /// Leases and per-group message state. Default: `<container>-leases`.
    pub lease_container: Option<String>,
    /// Partition key path of the messages container: one top-level property, `/pk` by default.
    pub partition_key_path: String,
    /// How long a message is kept (Cosmos TTL). `None` keeps messages forever.
    pub retention: Option<Duration>,
    /// Throughput provisioned on the messages container when it is created.
    pub throughput: Option<Throughput>,
}

/// Throughput provisioned with a new messages container.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Throughput {
    /// Fixed RU/s.
    Manual(u32),
    /// Autoscale up to this many RU/s.
    Autoscale(u32),
}

impl QueueConfig {
    /// A queue on `container` in `database`, with the default key path and no retention set.
    pub fn new(database: impl Into<String>, container: impl Into<String>) -> Self {
        Self {
            database: database.into(),
            container: container.into(),
            lease_container: None,
            partition_key_path: "/pk".into(),
            retention: Some(Duration::from_secs(7 * 24 * 3600)),
            throughput: None,
        }
    }

    /// The lease container's name: `<container>-leases`.
    pub fn lease_container_name(&self) -> String {
        self.lease_container
            .clone()
            .unwrap_or_else(|| format!("{}-leases", self.container))
    }

    /// The property holding the partition key in message documents.
    pub fn partition_key_field(&self) -> &str {
        self.partition_key_path.trim_start_matches('/')
    }

    /// The retention in whole seconds (the container's default TTL).
    pub fn retention_secs(&self) -> Option<i64> {
        self.retention.map(|r| r.as_secs() as i64)
    }

    /// Refuses settings Cosmos DB would refuse (names, key path, retention).
    pub fn validate(&self) -> Result<()> {
        validate_resource_name("database", &self.database)?;
        validate_resource_name("container", &self.container)?;
        validate_resource_name("leaseContainer", &self.lease_container_name())?;
        if self.lease_container_name() == self.container {
            return Err(QueueError::Config(
                "leaseContainer must differ from container".into(),
            ));
        }
        let field = self.partition_key_field();
        if !self.partition_key_path.starts_with('/')
            || field.is_empty()
            || field.contains('/')
            || RESERVED_FIELDS.contains(&field)
        {
            return Err(QueueError::Config(format!(
                "partitionKeyPath {:?} must be one top-level property such as \"/pk\", and not one of {:?}",
                self.partition_key_path, RESERVED_FIELDS
            )));
        }
        if let Some(r) = self.retention {
            if r < Duration::from_secs(60) || r.as_secs() > i32::MAX as u64 {
                return Err(QueueError::Config(
                    "retention must be between 1 minute and about 68 years".into(),
                ));
            }
        }
        if let Some(Throughput::Manual(ru) | Throughput::Autoscale(ru)) = self.throughput {
            if ru < 400 {
                return Err(QueueError::Config(
                    "throughput must be at least 400 RU/s (autoscale: 1000)".into(),
                ));
            }
        }
        Ok(())
    }
}

/// Cosmos resource ids: 1–255 characters, none of `/ \ ? #`.
fn validate_resource_name(setting: &str, name: &str) -> Result<()> {
    if name.is_empty() || name.len() > 255 || name.contains(['/', '\\', '?', '#']) {
        return Err(QueueError::Config(format!(
            "{setting} {name:?} must be 1-255 characters without '/', '\\', '?' or '#'"
        )));
    }
    Ok(())
}

/// How a group settles messages (see `docs/design.md`, "Guarantees, per mode and
/// configuration").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "camelCase")]
pub enum DeliveryMode {
    /// One holder per message at a time (ETag claims); never redelivered after success.
    #[default]
    Exclusive,
    /// The range's lease fences delivery and the checkpoint is the progress: nothing is
    /// written per message on success; at-least-once across lease hand-overs.
    Stream,
}

/// How an `exclusive` group records its deliveries (see `docs/design.md`, "The exclusive
/// write path"). Both keep the same guarantees; they differ in what each message costs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "camelCase")]
pub enum ExclusiveWrites {
    /// The range's lease is the lock: first deliveries write nothing per message, completions
    /// are recorded with the checkpoint, and each page's delivery is recorded on the lease
    /// before it starts. Work that runs long, retries, dead letters and schedules get a state
    /// document, as with `claims`. Leases move by hand-over.
    #[default]
    Lease,
    /// Every delivery claims its message with a state document (create), and completes it
    /// (replace): about 23 RU per message; leases may be stolen for balance.
    Claims,
}

/// Where a new group starts reading.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "camelCase")]
pub enum StartFrom {
    /// Only messages enqueued after the group starts.
    #[default]
    Now,
    /// Every message still retained.
    Beginning,
}

/// A consumer group of a queue.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupConfig {
    /// The group's name in the queue: it names its state documents and leases.
    pub name: String,
    /// How deliveries are kept apart.
    pub mode: DeliveryMode,
    /// How an `exclusive` group records deliveries (ignored in `stream` mode).
    pub exclusive_writes: ExclusiveWrites,
    /// Where a new group starts reading.
    pub start_from: StartFrom,
    /// How long a claim is exclusive without renewal.
    pub lock_duration: Duration,
    /// Retries and dead letters.
    pub retry: RetryPolicy,
    /// FIFO per partition key: a key's next message waits until the previous one is settled
    /// (failures are retried in place, holding the key). Default: unordered.
    pub ordered: bool,
}

impl GroupConfig {
    /// A group with the defaults: exclusive, from now, 60 s locks, unordered.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            mode: DeliveryMode::Exclusive,
            exclusive_writes: ExclusiveWrites::Lease,
            start_from: StartFrom::Now,
            lock_duration: Duration::from_secs(60),
            retry: RetryPolicy::default(),
            ordered: false,
        }
    }

    /// With another delivery mode.
    pub fn with_mode(mut self, mode: DeliveryMode) -> Self {
        self.mode = mode;
        self
    }

    /// With another write path for `exclusive` deliveries.
    pub fn with_exclusive_writes(mut self, writes: ExclusiveWrites) -> Self {
        self.exclusive_writes = writes;
        self
    }

    /// Whether first deliveries are fenced by the range's lease and write nothing per
    /// message: `stream` groups, and `exclusive` groups on the lease write path.
    pub fn lease_fenced(&self) -> bool {
        self.mode == DeliveryMode::Stream || self.exclusive_writes == ExclusiveWrites::Lease
    }

    /// Whether this is an `exclusive` group on the lease write path: its completions are
    /// recorded with the checkpoint, and a range's next owner skips them.
    pub fn lease_recorded(&self) -> bool {
        self.mode == DeliveryMode::Exclusive && self.exclusive_writes == ExclusiveWrites::Lease
    }

    /// Starting elsewhere.
    pub fn with_start_from(mut self, start_from: StartFrom) -> Self {
        self.start_from = start_from;
        self
    }

    /// With another lock duration.
    pub fn with_lock_duration(mut self, lock: Duration) -> Self {
        self.lock_duration = lock;
        self
    }

    /// FIFO per partition key, or not.
    pub fn with_ordering(mut self, ordered: bool) -> Self {
        self.ordered = ordered;
        self
    }

    /// With another retry policy.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// Refuses names Cosmos DB keys cannot hold and policies no delivery could follow.
    pub fn validate(&self) -> Result<()> {
        let ok_chars = self
            .name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        // "lease" would share the partition key prefix of the lease documents.
        if self.name.is_empty() || self.name.len() > 63 || !ok_chars || self.name == "lease" {
            return Err(QueueError::Config(format!(
                "group name {:?} must be 1-63 characters of letters, digits, '-', '_' or '.', and not \"lease\"",
                self.name
            )));
        }
        if self.lock_duration < Duration::from_secs(1) {
            return Err(QueueError::Config(
                "lockDuration must be at least 1s".into(),
            ));
        }
        self.retry.validate().map_err(QueueError::Config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        QueueConfig::new("db", "orders").validate().unwrap();
        GroupConfig::new("billing").validate().unwrap();
        assert_eq!(
            QueueConfig::new("db", "orders").lease_container_name(),
            "orders-leases"
        );
    }

    #[test]
    fn invalid_settings_are_named() {
        let mut q = QueueConfig::new("db", "orders");
        q.partition_key_path = "/a/b".into();
        assert!(q
            .validate()
            .unwrap_err()
            .to_string()
            .contains("partitionKeyPath"));
        q.partition_key_path = "/body".into();
        assert!(q
            .validate()
            .unwrap_err()
            .to_string()
            .contains("partitionKeyPath"));
        let mut q = QueueConfig::new("db", "orders");
        q.retention = Some(Duration::from_secs(1));
        assert!(q.validate().unwrap_err().to_string().contains("retention"));
        let mut q = QueueConfig::new("db", "or/ders");
        q.lease_container = Some("x".into());
        assert!(q.validate().unwrap_err().to_string().contains("container"));
        for name in ["bad|name", "", "lease"] {
            let g = GroupConfig::new(name);
            assert!(
                g.validate().unwrap_err().to_string().contains("group name"),
                "{name:?}"
            );
        }
        let g = GroupConfig::new("g").with_lock_duration(Duration::from_millis(10));
        assert!(g
            .validate()
            .unwrap_err()
            .to_string()
            .contains("lockDuration"));
    }
}
