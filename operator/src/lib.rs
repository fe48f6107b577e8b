//! The cosmosq operator: a kube-rs controller for `CosmosQueue` (provisioning, deletion
//! policy) and `QueueConsumerGroup` (the worker Deployment with the sidecar injected, and its
//! scaling from remaining-work estimates, directly or through an HPA fed by the external
//! metrics API this operator serves).
//!
//! Pure parts decide: `spec` (each resource's spec parsed once into typed settings), `build`
//! (the owned objects), `scaling`, `scaler::{group_status, group_figures, queue_totals}`,
//! `leader::verdict`. `apply`, `queue`, `group`, `scaler`, `leader` and `http` do the I/O;
//! `run` wires them.
#![forbid(unsafe_code)]
#![warn(missing_docs)]
// The controllers' futures (kube-runtime streams, hyper, `#[instrument]` spans) nest deeper
// than the default limit when their `Send` bound is checked.
#![recursion_limit = "256"]

pub mod apply;
pub mod arm;
pub mod auth;
pub mod build;
pub mod cached;
pub mod certs;
pub mod check;
pub mod config;
pub mod console;
pub mod context;
pub mod cosmos;
pub mod endpoint;
pub mod events;
pub mod grants;
pub mod group;
pub mod http;
pub mod leader;
pub mod metrics;
pub mod queue;
pub mod rollout;
pub mod rotation;
pub mod run;
pub mod scaler;
/// The pure scaling decision, shared with `cosmosq demo`.
pub use cosmosq_scaling as scaling;
pub mod spec;
pub mod status;
#[cfg(test)]
mod testing;
pub mod tls;
pub mod wake;
