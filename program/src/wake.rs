//! A producer's side of a wake: after writing to a queue, tell the operator, so a group scaled
//! to zero starts within seconds instead of at the next scaling round.
//!
//! The contract is plain HTTPS, so any producer can follow it (`docs/scaling.md`):
//! `POST <operator>/v1/namespaces/<namespace>/cosmosqueues/<name>/wake` with a bearer token
//! minted for the operator's audience (`cosmosq`) whose holder may `create` the
//! `cosmosqueues/wake` subresource of that queue. A wake is a hint: the operator estimates and
//! decides as in any round, so a lost wake delays a start to the next round, never loses work.

use std::path::PathBuf;
use std::time::Duration;

/// Where a projected token for the operator's audience is mounted by convention.
pub const DEFAULT_TOKEN_FILE: &str = "/var/run/secrets/cosmosq/token";

/// How long a wake may take: it is a hint, a slow operator must not hold up a producer.
const TIMEOUT: Duration = Duration::from_secs(5);

/// Why a wake was not delivered.
#[derive(Debug, thiserror::Error)]
pub enum WakeError {
    /// The queue is not `namespace/name`.
    #[error("{0:?}: expected <namespace>/<name> of a CosmosQueue")]
    Queue(String),
    /// The operator's URL is unusable.
    #[error("--operator-url {0:?}: expected https://host[:port]")]
    Url(String),
    /// The CA file cannot be read or holds no certificate.
    #[error("--operator-ca-file {path}: {reason}")]
    Ca {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// The token file cannot be read.
    #[error("--operator-token-file {path}: {reason}")]
    Token {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// The request did not complete.
    #[error("telling the operator: {0}")]
    Http(#[from] reqwest::Error),
    /// The operator refused or failed it (its status and message).
    #[error("the operator answered {status}: {message}")]
    Refused {
        /// The HTTP status.
        status: u16,
        /// The operator's message, or the body.
        message: String,
    },
}

/// How to reach the operator, as a command line or the environment gives it.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct OperatorArgs {
    /// The operator's TLS listener (the chart's `<release>-external-metrics` Service), e.g.
    /// https://cosmosq-external-metrics.cosmosq.svc.
    #[arg(long, env = "COSMOSQ_OPERATOR_URL")]
    pub operator_url: Option<String>,
    /// The CA that signed the operator's serving certificate (PEM); the system's roots if unset.
    #[arg(long, env = "COSMOSQ_OPERATOR_CA_FILE")]
    pub operator_ca_file: Option<PathBuf>,
    /// A bearer token minted for the operator's audience (a projected ServiceAccount token,
    /// or `kubectl create token <account> --audience cosmosq`), read at each wake.
    #[arg(long, env = "COSMOSQ_OPERATOR_TOKEN_FILE", default_value = DEFAULT_TOKEN_FILE)]
    pub operator_token_file: PathBuf,
}

/// A client of the operator's wake endpoint.
#[derive(Clone, Debug)]
pub struct Waker {
    http: reqwest::Client,
    url: String,
    token_file: PathBuf,
}

impl Waker {
    /// A client for `args`; `None` when no operator URL is given.
    pub fn from_args(args: &OperatorArgs) -> Result<Option<Self>, WakeError> {
        let Some(url) = &args.operator_url else {
            return Ok(None);
        };
        let ca = args
            .operator_ca_file
            .as_ref()
            .map(|path| {
                std::fs::read(path).map_err(|e| WakeError::Ca {
                    path: path.display().to_string(),
                    reason: e.to_string(),
                })
            })
            .transpose()?;
        Self::new(url, ca.as_deref(), args.operator_token_file.clone())
            .map(Some)
            .map_err(|e| match (e, &args.operator_ca_file) {
                (WakeError::Ca { reason, .. }, Some(path)) => WakeError::Ca {
                    path: path.display().to_string(),
                    reason,
                },
                (e, _) => e,
            })
    }

    /// A client of the operator at `url` (https), trusting `ca_pem` if given, presenting the
    /// token read from `token_file` at each wake (projected tokens are rotated in place).
    pub fn new(url: &str, ca_pem: Option<&[u8]>, token_file: PathBuf) -> Result<Self, WakeError> {
        let parsed = url::Url::parse(url).map_err(|_| WakeError::Url(url.to_owned()))?;
        if parsed.scheme() != "https" || parsed.host_str().is_none() {
            // A bearer token never crosses the network in clear text.
            return Err(WakeError::Url(url.to_owned()));
        }
        let mut builder = cosmosq_queue::cosmos::tls::http_client_builder().timeout(TIMEOUT);
        if let Some(pem) = ca_pem {
            let certificates =
                reqwest::Certificate::from_pem_bundle(pem).map_err(|e| WakeError::Ca {
                    path: "(PEM)".into(),
                    reason: e.to_string(),
                })?;
            if certificates.is_empty() {
                return Err(WakeError::Ca {
                    path: "(PEM)".into(),
                    reason: "no certificate in it".into(),
                });
            }
            for certificate in certificates {
                builder = builder.add_root_certificate(certificate);
            }
        }
        Ok(Self {
            http: builder.build()?,
            url: url.trim_end_matches('/').to_owned(),
            token_file,
        })
    }

    /// Tells the operator that `queue` (`namespace/name`) was written to.
    pub async fn wake(&self, queue: &str) -> Result<(), WakeError> {
        let (namespace, name) = split_queue(queue)?;
        let token = tokio::fs::read_to_string(&self.token_file)
            .await
            .map_err(|e| WakeError::Token {
                path: self.token_file.display().to_string(),
                reason: e.to_string(),
            })?;
        let response = self
            .http
            .post(format!(
                "{}/v1/namespaces/{namespace}/cosmosqueues/{name}/wake",
                self.url
            ))
            .bearer_auth(token.trim())
            .send()
            .await?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let body = response.text().await.unwrap_or_default();
        let message = serde_json::from_str::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["message"].as_str().map(str::to_owned))
            .unwrap_or(body);
        Err(WakeError::Refused {
            status: status.as_u16(),
            message,
        })
    }
}

/// `namespace/name`, each a Kubernetes name (pure).
pub fn split_queue(queue: &str) -> Result<(&str, &str), WakeError> {
    match queue.split_once('/') {
        Some((namespace, name)) if is_object_name(namespace) && is_object_name(name) => {
            Ok((namespace, name))
        }
        _ => Err(WakeError::Queue(queue.to_owned())),
    }
}

/// Whether `name` can name a namespace or a CosmosQueue (pure): a DNS-1123 subdomain, as the
/// API server checks it (the operator checks a wake's path the same way).
pub fn is_object_name(name: &str) -> bool {
    (1..=253).contains(&name.len())
        && name.split('.').all(|label| {
            !label.is_empty()
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_is_named_by_its_namespace_and_name() {
        assert_eq!(split_queue("shop/orders").unwrap(), ("shop", "orders"));
        for bad in [
            "orders",
            "shop/",
            "/orders",
            "shop/orders/wake",
            "Shop/orders",
            "a/b?c",
            "shop/..",
            "shop/-orders",
        ] {
            let err = split_queue(bad).unwrap_err();
            assert!(
                err.to_string().contains("<namespace>/<name>"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn a_token_never_goes_to_a_plain_http_operator() {
        for url in [
            "http://cosmosq-metrics:8443",
            "cosmosq-metrics:8443",
            "https://",
        ] {
            let err = Waker::new(url, None, DEFAULT_TOKEN_FILE.into()).unwrap_err();
            assert!(matches!(err, WakeError::Url(_)), "{url}: {err}");
        }
        let err = Waker::new("https://op:8443", Some(b"not a pem"), "t".into()).unwrap_err();
        assert!(matches!(err, WakeError::Ca { .. }), "{err}");
        assert!(Waker::new("https://op:8443/", None, "t".into()).is_ok());
    }

    #[tokio::test]
    async fn an_unreadable_token_is_named() {
        let waker = Waker::new("https://127.0.0.1:1", None, "/nonexistent/token".into()).unwrap();
        let err = waker.wake("shop/orders").await.unwrap_err();
        assert!(err.to_string().contains("/nonexistent/token"), "{err}");
    }
}
