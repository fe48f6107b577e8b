//! The secure listener's TLS settings: the serving certificate, and which client certificates
//! are believed (those of the API server's front proxy), both reloaded while the operator runs.
//!
//! `helm upgrade`, a cert-manager renewal, the operator's own rotation (`certs`) or a rotated
//! front-proxy CA change them under a running operator. Each new connection takes the newest settings, as client-go's dynamic
//! certificate controllers do; a change that does not load keeps the previous settings.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::Api;
use kube::Client;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::auth::{RequestHeader, AUTHENTICATION_CONFIG_MAP, AUTHENTICATION_NAMESPACE};

/// How often the certificate (files or Secret) and the front proxy's ConfigMap are read again
/// (the kubelet updates a mounted Secret within about a minute).
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(30);

/// Why the TLS listener cannot serve.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The certificate or key is unreadable or invalid.
    #[error("TLS certificate or key {path}: {reason}")]
    File {
        /// The file.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The operator's own certificate Secret is unreadable or invalid.
    #[error("TLS certificate or key in Secret {name}: {reason}")]
    Secret {
        /// The Secret.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The front proxy's CA is unusable.
    #[error("the front proxy's CA: {0}")]
    ClientCa(String),
}

/// Where the serving certificate comes from.
pub enum Source {
    /// PEM files, mounted by the kubelet from a Secret (cert-manager's, yours, the chart's).
    Files {
        /// The certificate.
        cert: PathBuf,
        /// Its key.
        key: PathBuf,
    },
    /// `tls.crt` and `tls.key` of the Secret the operator issues itself (`certs`). Until the
    /// leader has written it there is nothing to serve, and connections are closed.
    Secret {
        /// The operator's namespace's Secrets.
        secrets: Box<Api<Secret>>,
        /// The Secret's name.
        name: String,
    },
}

impl Source {
    /// What errors name: a file's path or the Secret.
    fn error(&self, reason: impl ToString) -> TlsError {
        match self {
            Source::Files { cert, .. } => TlsError::File {
                path: cert.display().to_string(),
                reason: reason.to_string(),
            },
            Source::Secret { name, .. } => TlsError::Secret {
                name: name.clone(),
                reason: reason.to_string(),
            },
        }
    }

    /// The certificate and key, PEM; `None` when the Secret does not hold them yet.
    async fn read(&self) -> Result<Option<(Vec<u8>, Vec<u8>)>, TlsError> {
        match self {
            Source::Files { cert, key } => {
                let read = |path: &Path| {
                    let path = path.to_owned();
                    async move {
                        tokio::fs::read(&path).await.map_err(|e| TlsError::File {
                            path: path.display().to_string(),
                            reason: e.to_string(),
                        })
                    }
                };
                Ok(Some((read(cert).await?, read(key).await?)))
            }
            Source::Secret { secrets, name } => {
                let secret = secrets.get_opt(name).await.map_err(|e| self.error(e))?;
                let mut data = secret.and_then(|s| s.data).unwrap_or_default();
                Ok(
                    match (
                        data.remove(crate::certs::keys::CERT),
                        data.remove(crate::certs::keys::KEY),
                    ) {
                        (Some(cert), Some(key)) => Some((cert.0, key.0)),
                        _ => None,
                    },
                )
            }
        }
    }
}

/// What connections are served with.
pub struct Snapshot {
    /// The TLS settings.
    pub config: Arc<ServerConfig>,
    /// How the front proxy authenticates, or why that is unknown (then no client certificate
    /// is asked for and the external metrics API answers 401 saying why).
    pub front_proxy: Result<Arc<RequestHeader>, String>,
}

/// What a snapshot is built from, kept to see whether anything changed.
#[derive(Clone, PartialEq)]
struct Inputs {
    /// The certificate and key, PEM (none yet: the operator has not issued them).
    pair: Option<(Vec<u8>, Vec<u8>)>,
    front_proxy: Result<RequestHeader, String>,
}

/// The serving certificate and the front proxy's CA, reloaded when their files (or Secret) or
/// the ConfigMap change.
pub struct ServingTls {
    source: Source,
    client: Client,
    current: RwLock<(Inputs, Option<Arc<Snapshot>>)>,
}

impl ServingTls {
    /// Loads the certificate (an error stops the operator: it was asked to serve TLS; a Secret
    /// the leader has not written yet is no error) and the front proxy's settings (a failure
    /// there is logged and retried on every reload).
    pub async fn load(source: Source, client: Client) -> Result<Self, TlsError> {
        let inputs = read_inputs(&source, &client).await?;
        if let Err(reason) = &inputs.front_proxy {
            warn!(%reason, "the external metrics API cannot authenticate the API server's front proxy yet");
        }
        if inputs.pair.is_none() {
            info!("no serving certificate yet: the leader issues it");
        }
        let snapshot = build(&source, &inputs)?.map(Arc::new);
        Ok(Self {
            source,
            client,
            current: RwLock::new((inputs, snapshot)),
        })
    }

    /// What new connections are served with now (none before a certificate exists).
    pub fn current(&self) -> Option<Arc<Snapshot>> {
        self.current.read().expect("tls settings").1.clone()
    }

    /// Reads everything again; true when the settings changed.
    pub async fn reload(&self) -> Result<bool, TlsError> {
        let inputs = read_inputs(&self.source, &self.client).await?;
        if self.current.read().expect("tls settings").0 == inputs {
            return Ok(false);
        }
        let snapshot = build(&self.source, &inputs)?.map(Arc::new);
        *self.current.write().expect("tls settings") = (inputs, snapshot);
        Ok(true)
    }

    /// Reloads every [`RELOAD_INTERVAL`] until `shutdown`.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        let mut interval = tokio::time::interval(RELOAD_INTERVAL);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        interval.tick().await;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = interval.tick() => {}
            }
            match self.reload().await {
                Ok(true) => info!(
                    front_proxy = self.current().is_some_and(|s| s.front_proxy.is_ok()),
                    "reloaded the TLS certificate and the front proxy's CA"
                ),
                Ok(false) => {}
                Err(e) => warn!(error = %e, "keeping the previous TLS settings"),
            }
        }
    }
}

async fn read_inputs(source: &Source, client: &Client) -> Result<Inputs, TlsError> {
    let front_proxy = match Api::<ConfigMap>::namespaced(client.clone(), AUTHENTICATION_NAMESPACE)
        .get_opt(AUTHENTICATION_CONFIG_MAP)
        .await
    {
        Ok(Some(map)) => match RequestHeader::from_data(&map.data.unwrap_or_default()) {
            Ok(Some(header)) => Ok(header),
            Ok(None) => Err(format!(
                "{AUTHENTICATION_NAMESPACE}/{AUTHENTICATION_CONFIG_MAP} names no front-proxy CA \
                 (kube-apiserver runs without --requestheader-client-ca-file)"
            )),
            Err(e) => Err(e.to_string()),
        },
        Ok(None) => Err(format!(
            "{AUTHENTICATION_NAMESPACE}/{AUTHENTICATION_CONFIG_MAP} does not exist"
        )),
        Err(e) => Err(format!(
            "reading {AUTHENTICATION_NAMESPACE}/{AUTHENTICATION_CONFIG_MAP}: {e}"
        )),
    };
    Ok(Inputs {
        pair: source.read().await?,
        front_proxy,
    })
}

fn build(source: &Source, inputs: &Inputs) -> Result<Option<Snapshot>, TlsError> {
    let Some((cert, key)) = &inputs.pair else {
        return Ok(None);
    };
    let certs = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| source.error(e))?;
    if certs.is_empty() {
        return Err(source.error("no certificate in it"));
    }
    let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| match source {
        Source::Files { key, .. } => TlsError::File {
            path: key.display().to_string(),
            reason: e.to_string(),
        },
        Source::Secret { .. } => source.error(format!("the key: {e}")),
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| source.error(e))?;
    let builder = match &inputs.front_proxy {
        Ok(header) => {
            let mut roots = RootCertStore::empty();
            for ca in &header.client_ca {
                roots
                    .add(ca.clone())
                    .map_err(|e| TlsError::ClientCa(e.to_string()))?;
            }
            // Unauthenticated clients may connect: KEDA presents a bearer token instead, and
            // the external metrics API refuses a request without a certificate itself.
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .allow_unauthenticated()
                .build()
                .map_err(|e| TlsError::ClientCa(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
        Err(_) => builder.with_no_client_auth(),
    };
    let config = builder
        .with_single_cert(certs, key)
        .map_err(|e| source.error(e))?;
    Ok(Some(Snapshot {
        config: Arc::new(config),
        front_proxy: inputs.front_proxy.clone().map(Arc::new),
    }))
}
