//! Which endpoints the operator dials for a queue.
//!
//! The operator signs requests to a queue's `spec.endpoint` with the key of the queue's Secret
//! or with its own identity, from inside the cluster. An endpoint any namespace user may write
//! would make it a confused deputy: probing services the user cannot reach, or sending
//! requests signed with another team's key to a host of the user's (replayable for 15
//! minutes). So the operator dials account endpoints only — `https://<account>.documents.
//! azure.{com,us,cn}` on port 443 — and the hosts an admin adds (`--allowed-endpoint`, the
//! chart's `allowedEndpoints`): an emulator, or a private endpoint under another name. The
//! check runs before the Secret is read.

use std::fmt;
use std::str::FromStr;

/// Azure's public, US Government and China clouds.
const ACCOUNT_ZONES: [&str; 3] = [
    "documents.azure.com",
    "documents.azure.us",
    "documents.azure.cn",
];

/// Why an endpoint is not dialled.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EndpointError {
    /// Not `scheme://host[:port]/`.
    #[error("spec.endpoint: {0:?} is not an account endpoint: expected scheme://host[:port]/ with no user, path, query or fragment")]
    Shape(String),
    /// A well-formed endpoint that no pattern allows.
    #[error(
        "spec.endpoint: {endpoint} is not an endpoint this operator may dial (it dials {allowed}; \
         an admin allows an emulator or a private endpoint's host with --allowed-endpoint, \
         the chart's allowedEndpoints)"
    )]
    NotAllowed {
        /// The endpoint as `scheme://host:port`.
        endpoint: String,
        /// The patterns that are allowed.
        allowed: String,
    },
}

/// `scheme://host:port`, lower-cased, from an endpoint of the expected shape.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Origin {
    scheme: String,
    host: String,
    port: u16,
}

impl Origin {
    fn parse(endpoint: &str) -> Option<Origin> {
        let url = url::Url::parse(endpoint.trim()).ok()?;
        let plain = url.username().is_empty()
            && url.password().is_none()
            && matches!(url.path(), "" | "/")
            && url.query().is_none()
            && url.fragment().is_none()
            && matches!(url.scheme(), "https" | "http");
        if !plain {
            return None;
        }
        Some(Origin {
            scheme: url.scheme().to_owned(),
            host: url.host_str()?.to_ascii_lowercase(),
            port: url.port_or_known_default()?,
        })
    }
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}:{}", self.scheme, self.host, self.port)
    }
}

/// One allowed origin: `[scheme://]host[:port]`, where a host `*.zone` stands for one DNS label
/// under `zone` (an account name), not for deeper names. The scheme defaults to `https`, the
/// port to the scheme's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointPattern {
    scheme: String,
    host: String,
    port: u16,
}

impl EndpointPattern {
    fn matches(&self, origin: &Origin) -> bool {
        let host = match self.host.strip_prefix("*.") {
            Some(zone) => origin
                .host
                .strip_suffix(zone)
                .and_then(|label| label.strip_suffix('.'))
                .is_some_and(|label| {
                    !label.is_empty()
                        && label
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'-')
                }),
            None => origin.host == self.host,
        };
        host && origin.scheme == self.scheme && origin.port == self.port
    }
}

impl FromStr for EndpointPattern {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let with_scheme = if text.contains("://") {
            text.to_owned()
        } else {
            format!("https://{text}")
        };
        // `*` is not a host character to the URL parser: parse with a stand-in label.
        let wildcard = with_scheme.contains("://*.");
        let parsable = with_scheme.replacen("://*.", "://wildcard.", 1);
        let origin = Origin::parse(&parsable).ok_or_else(|| {
            format!("{text:?}: expected [https://]host[:port] or [https://]*.zone[:port]")
        })?;
        let zone = if wildcard {
            &origin.host["wildcard.".len()..]
        } else {
            &origin.host
        };
        if zone.contains('*') || zone.trim_matches('.').is_empty() {
            return Err(format!("{text:?}: '*' stands only for a whole first label"));
        }
        let host = if wildcard {
            format!("*.{zone}")
        } else {
            zone.to_owned()
        };
        Ok(Self {
            scheme: origin.scheme,
            host,
            port: origin.port,
        })
    }
}

impl fmt::Display for EndpointPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}:{}", self.scheme, self.host, self.port)
    }
}

/// The origins the operator dials: Azure's account endpoints and what an admin added.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointPolicy {
    patterns: Vec<EndpointPattern>,
}

impl EndpointPolicy {
    /// Azure's account endpoints, and `extra`.
    pub fn new(extra: impl IntoIterator<Item = EndpointPattern>) -> Self {
        let mut patterns: Vec<EndpointPattern> = ACCOUNT_ZONES
            .iter()
            .map(|zone| EndpointPattern {
                scheme: "https".into(),
                host: format!("*.{zone}"),
                port: 443,
            })
            .collect();
        patterns.extend(extra);
        Self { patterns }
    }

    /// Whether the operator may dial `endpoint` (pure).
    pub fn check(&self, endpoint: &str) -> Result<(), EndpointError> {
        let origin =
            Origin::parse(endpoint).ok_or_else(|| EndpointError::Shape(endpoint.to_owned()))?;
        if self.patterns.iter().any(|p| p.matches(&origin)) {
            return Ok(());
        }
        Err(EndpointError::NotAllowed {
            endpoint: origin.to_string(),
            allowed: self
                .patterns
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", "),
        })
    }
}

impl Default for EndpointPolicy {
    fn default() -> Self {
        Self::new([])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_account_endpoints_are_dialled_by_default() {
        let policy = EndpointPolicy::default();
        for endpoint in [
            "https://shop.documents.azure.com:443/",
            "https://shop.documents.azure.com/",
            "https://Shop-EastUS.documents.azure.com",
            "https://gov.documents.azure.us/",
            "https://cn.documents.azure.cn:443/",
        ] {
            assert_eq!(policy.check(endpoint), Ok(()), "{endpoint}");
        }
        for (endpoint, shape) in [
            // Services inside the cluster, the cloud's metadata endpoint, a host of the user's.
            ("http://kube-dns.kube-system.svc:53/", false),
            ("http://169.254.169.254/", false),
            ("https://attacker.example.com/", false),
            // Look-alikes: another zone, a deeper name, another port, plain HTTP.
            ("https://shop.documents.azure.com.attacker.example/", false),
            ("https://a.b.documents.azure.com/", false),
            ("https://shop.documents.azure.com:8443/", false),
            ("http://shop.documents.azure.com/", false),
            // Paths, queries, users and fragments are never part of an account endpoint.
            ("https://shop.documents.azure.com/dbs/x", true),
            ("https://shop.documents.azure.com/?a=b", true),
            ("https://user@shop.documents.azure.com/", true),
            ("https://shop.documents.azure.com/#f", true),
            ("ftp://shop.documents.azure.com/", true),
            ("not a url", true),
        ] {
            let err = policy.check(endpoint).unwrap_err();
            assert_eq!(
                matches!(err, EndpointError::Shape(_)),
                shape,
                "{endpoint}: {err}"
            );
            assert!(err.to_string().starts_with("spec.endpoint: "), "{err}");
        }
        let err = policy
            .check("http://169.254.169.254/")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("http://169.254.169.254:80")
                && err.contains("https://*.documents.azure.com:443")
                && err.contains("--allowed-endpoint"),
            "{err}"
        );
    }

    #[test]
    fn an_admin_adds_an_emulator_or_a_private_zone() {
        let policy = EndpointPolicy::new(
            [
                "http://cosmos-emulator.dev.svc:8081",
                "*.privatelink.contoso.net",
            ]
            .map(|p| p.parse().unwrap()),
        );
        assert_eq!(policy.check("http://cosmos-emulator.dev.svc:8081/"), Ok(()));
        assert!(policy
            .check("https://cosmos-emulator.dev.svc:8081/")
            .is_err());
        assert!(policy.check("http://cosmos-emulator.dev.svc/").is_err());
        assert_eq!(
            policy.check("https://shop.privatelink.contoso.net/"),
            Ok(())
        );
        assert!(policy.check("https://privatelink.contoso.net/").is_err());
        assert_eq!(policy.check("https://shop.documents.azure.com/"), Ok(()));
    }

    #[test]
    fn patterns_are_origins_with_a_wildcard_only_for_the_first_label() {
        let pattern: EndpointPattern = "HTTPS://*.Documents.Azure.com".parse().unwrap();
        assert_eq!(pattern.to_string(), "https://*.documents.azure.com:443");
        for bad in [
            "*",
            "https://a.*.com",
            "https://*/",
            "https://h/path",
            "https://h/?q",
        ] {
            assert!(bad.parse::<EndpointPattern>().is_err(), "{bad}");
        }
    }
}
