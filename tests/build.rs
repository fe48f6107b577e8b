//! A test that needs a cluster is compiled ignored without one, so `cargo test` reports it as
//! skipped rather than passed; given `COSMOSQ_E2E_KUBECONFIG` it runs with the rest.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(cosmosq_e2e)");
    println!("cargo::rustc-check-cfg=cfg(cosmosq_e2e_aggregator)");
    println!("cargo::rerun-if-env-changed=COSMOSQ_E2E_KUBECONFIG");
    println!("cargo::rerun-if-env-changed=COSMOSQ_E2E_OPERATOR_ADDRESS");
    if std::env::var_os("COSMOSQ_E2E_KUBECONFIG").is_some() {
        println!("cargo::rustc-cfg=cosmosq_e2e");
        // The aggregated read also needs the API server to dial this process.
        if std::env::var_os("COSMOSQ_E2E_OPERATOR_ADDRESS").is_some() {
            println!("cargo::rustc-cfg=cosmosq_e2e_aggregator");
        }
    }
}
