//! The TLS crypto provider of every HTTPS client in a cosmosq process.
//!
//! reqwest is built without a provider of its own: its default, aws-lc, was 0.9 MB of every
//! binary and a C library to build. rustls then takes the process-wide default, which
//! [`install_crypto_provider`] sets to ring, the provider kube's client and the operator's
//! listener already use. The Azure SDK's clients (data plane, identity, account check) are
//! reqwest clients too, so this runs before any of them is built.

/// Makes ring the process's rustls provider; later calls, and a provider installed first by
/// the embedding program, leave it as it is.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// A reqwest client builder whose TLS has its provider: reqwest panics when it builds a
/// client and finds none.
pub fn http_client_builder() -> reqwest::ClientBuilder {
    install_crypto_provider();
    reqwest::Client::builder()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_an_https_client_with_ring() {
        let client = http_client_builder().build();
        assert!(client.is_ok(), "{client:?}");
        assert!(rustls::crypto::CryptoProvider::get_default().is_some());
    }
}
