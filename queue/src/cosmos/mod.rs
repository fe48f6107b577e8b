//! The engine's Cosmos DB plumbing, in one place: connecting (key, Entra identity, the local
//! emulator) and the account check, the change feed's pages, SQL queries, request charges,
//! provisioning the containers, and the TLS provider of every HTTPS client. Everything above
//! it speaks in queues, groups and leases.

pub mod account;
pub mod charge;
pub mod connection;
pub(crate) mod feed;
pub mod provision;
pub(crate) mod sql;
pub mod tls;
