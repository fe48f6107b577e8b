//! Certificates for TLS tests (the operator's listener, the API server's front proxy).

/// A certificate authority for TLS tests, and what it signs (PEM).
pub struct TestCa {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    /// The CA's certificate (PEM), as a client or a caBundle trusts it.
    pub pem: String,
}

impl TestCa {
    /// A CA named `name`, with a fresh key.
    pub fn new(name: &str) -> Self {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let pem = params.self_signed(&key).unwrap().pem();
        Self {
            issuer: rcgen::Issuer::new(params, key),
            pem,
        }
    }

    fn sign(
        &self,
        names: Vec<String>,
        cn: &str,
        usage: rcgen::ExtendedKeyUsagePurpose,
    ) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(names).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        params.extended_key_usages = vec![usage];
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// A serving certificate for `localhost` and 127.0.0.1: (certificate, key).
    pub fn server(&self) -> (String, String) {
        self.server_for(&[])
    }

    /// A serving certificate for `localhost`, 127.0.0.1 and `names`: (certificate, key).
    pub fn server_for(&self, names: &[&str]) -> (String, String) {
        let mut all = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
        all.extend(names.iter().map(|n| n.to_string()));
        self.sign(all, "localhost", rcgen::ExtendedKeyUsagePurpose::ServerAuth)
    }

    /// A client certificate with common name `cn`: (certificate, key).
    pub fn client(&self, cn: &str) -> (String, String) {
        self.sign(Vec::new(), cn, rcgen::ExtendedKeyUsagePurpose::ClientAuth)
    }
}

/// TLS settings of a client that trusts `ca` (PEM) and presents `identity` (certificate and
/// key, PEM) if given; ring, as the operator's listener.
pub fn client_config(ca: &str, identity: Option<&(String, String)>) -> rustls::ClientConfig {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots);
    match identity {
        Some((cert, key)) => builder
            .with_client_auth_cert(
                vec![CertificateDer::from_pem_slice(cert.as_bytes()).unwrap()],
                PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    }
}
