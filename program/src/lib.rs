//! What each cosmosq program (the operator, the sidecar, the CLI's demo and benchmarks) runs
//! its work inside, kept out of the engine crate: JSON logs and a run that stops gracefully on
//! SIGTERM ([`process`]), optional OTLP export of spans ([`telemetry`]), reporting
//! measurements ([`measure`]), and a producer's wake of the operator ([`wake`]).

pub mod measure;
pub mod process;
pub mod telemetry;
pub mod wake;
