//! The cosmosq queue engine: a durable work queue on an Azure Cosmos DB container.
//!
//! The messages container is an append-only log that only producers write. Everything a
//! consumer group knows about a message (its lock, attempts, retry time, completion, dead
//! letter) lives in a small per-group state document in the lease container, so groups never
//! rewrite messages, never echo into the change feed the others read, and need no index of
//! their own. `docs/design.md` explains the documents and why.
//!
//! Nothing here knows about HTTP or Kubernetes; the sidecar and the operator build on it.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod backoff;
pub mod balance;
pub mod buggify;
pub mod chance;
mod checkpoint;
pub mod clock;
pub mod config;
pub mod cosmos;
pub mod deadletter;
pub mod env;
pub mod error;
pub mod estimate;
pub mod group;
pub mod handler;
pub mod host;
pub mod identity;
pub mod lease;
pub mod ledger;
pub mod message;
pub mod metric_names;
pub mod producer;
pub mod pull;
pub mod queue;
pub mod range;
pub mod state;
pub mod trace;

pub use azure_data_cosmos::CosmosClient;

/// The pub/sub name of cosmosq's Dapr-compatible API: what deliveries carry (`pubsubname`)
/// and what publishing accepts, unless the app's subscription names its own.
pub const PUBSUB_NAME: &str = "cosmosq";
pub use backoff::RetryPolicy;
pub use clock::Clock;
pub use config::{DeliveryMode, ExclusiveWrites, GroupConfig, QueueConfig, StartFrom, Throughput};
pub use cosmos::charge::{ChargeSnapshot, OperationCharge, RequestCharges};
pub use cosmos::connection::{Auth, ConnectionArgs};
pub use cosmos::provision::provision;
pub use deadletter::DeadLetter;
pub use error::{QueueError, Result};
pub use group::{Claim, ClaimOutcome, Group, RetryOutcome};
pub use handler::{ConsumerStats, Delivery, Handler, Outcome};
pub use message::{Body, Message, MessageError, MessageKey, NewMessage};
pub use producer::{EnqueueError, EnqueueOutcome};
pub use queue::Queue;
pub use state::{MessageState, StateDoc};
pub use trace::TraceContext;
