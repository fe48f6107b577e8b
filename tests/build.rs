//! A test that needs a cluster is compiled ignored without one, so `cargo test` reports it as
//! skipped rather than passed; given `COSMOSQ_E2E_KUBECONFIG` it runs with the rest.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(cosmosq_e2e)");
    println!("cargo::rerun-if-env-changed=COSMOSQ_E2E_KUBECONFIG");
    if std::env::var_os("COSMOSQ_E2E_KUBECONFIG").is_some() {
        println!("cargo::rustc-cfg=cosmosq_e2e");
    }
}
