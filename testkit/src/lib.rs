//! Test kits shared by cosmosq's tests and benchmarks: an in-memory Kubernetes API server
//! ([`fake`]), a certificate authority for TLS tests ([`pki`]), host options that make the
//! lease loop fast, and free ports. A dev-dependency only, so production binaries carry none of
//! their dependencies.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod fake;
pub mod pki;

use std::time::Duration;

use cosmosq_queue::host::HostOptions;

/// A port on 127.0.0.1 that was free a moment ago (the OS picks it).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("a loopback port can be bound")
        .local_addr()
        .expect("a bound socket has an address")
        .port()
}

/// Host options for tests: the lease loop's timings scaled from seconds to milliseconds, so a
/// take-over, a sweep or a checkpoint happens within a test's patience.
pub fn fast_host(name: &str) -> HostOptions {
    HostOptions {
        min_poll: Duration::from_millis(5),
        max_poll: Duration::from_millis(50),
        sweep_interval: Duration::from_millis(100),
        lease_acquire: Duration::from_millis(100),
        lease_renew: Duration::from_millis(300),
        lease_expire: Duration::from_millis(1_500),
        checkpoint_interval: Duration::from_millis(50),
        promote_after: Duration::from_millis(300),
        ..HostOptions::new(name)
    }
}
