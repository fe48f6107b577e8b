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
