//! End-to-end tests through the Azure SDK against its in-memory emulator.
//! One test binary on purpose: linking is the slow part here.

mod console;
mod consume;
mod contract;
mod crds;
mod emulator;
mod examples;
mod faults;
mod guarantees;
mod histories;
mod leases;
mod operator;
mod sidecar;
mod sim;
mod state_machine;

/// The emulator allocates on every request; mimalloc runs the suite ~10 % faster than glibc's
/// allocator (see the workspace's Cargo.toml). Production binaries keep the system allocator.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
