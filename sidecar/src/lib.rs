//! The cosmosq sidecar: runs next to the app in every worker pod. It holds change-feed leases
//! through the queue engine's lease loop, delivers each message to the app over localhost HTTP
//! (compatible with Dapr pub/sub), settles it from the answer, and serves a localhost API for
//! enqueue, health and metrics. `main.rs` only parses, handles signals and runs [`run::run`].
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod api;
pub mod app;
pub mod breaker;
pub mod bulk;
pub mod callback;
pub mod dapr;
pub mod deletion_cost;
pub mod delivery;
pub mod error;
pub mod isolation;
pub mod metrics;
pub mod pull;
pub mod run;
pub mod settings;
pub mod spans;
pub mod subscribe;
pub mod transport;
