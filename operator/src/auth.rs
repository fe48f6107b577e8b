//! Who may read the figures the operator serves over TLS.
//!
//! The external metrics API is reached through the API server's aggregation layer, which
//! proxies each request with its front-proxy client certificate and names the original caller
//! in headers (`X-Remote-User`, `X-Remote-Group`, `X-Remote-Extra-*`). Like every extension API
//! server (metrics-server, prometheus-adapter, KEDA's), the operator believes those headers only
//! from a certificate signed by the CA the cluster publishes in
//! `kube-system/extension-apiserver-authentication` whose common name is an allowed one, and
//! then asks the API server whether that caller may `get` the metric (SubjectAccessReview).
//!
//! The KEDA endpoint takes a bearer token instead: a TokenReview names the caller, a
//! SubjectAccessReview decides whether it may `get` the QueueConsumerGroup.
//!
//! Answers are cached for ten seconds, as the API server's delegated authentication and
//! authorization cache them: an HPA reads every 15 s, so each read costs at most one review.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use http::HeaderMap;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use kube::Client;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

/// Where the cluster publishes how its front proxy authenticates.
pub const AUTHENTICATION_NAMESPACE: &str = "kube-system";
/// The ConfigMap in [`AUTHENTICATION_NAMESPACE`] that holds the front proxy's CA and header names.
pub const AUTHENTICATION_CONFIG_MAP: &str = "extension-apiserver-authentication";
/// How long a review's answer is reused (the API server's delegated auth uses the same).
pub const REVIEW_CACHE_TTL: Duration = Duration::from_secs(10);
/// Above this many cached answers, expired ones are dropped on the next insert.
const CACHE_PRUNE_AT: usize = 4096;

/// Why a request to the secure listener was refused.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// 401: who is calling is unknown.
    #[error("{0}")]
    Unauthenticated(String),
    /// 403: the caller is known and may not do this.
    #[error("{0}")]
    Forbidden(String),
    /// A review could not be asked.
    #[error("asking the API server: {0}")]
    Api(#[from] kube::Error),
    /// The front proxy's settings are unusable.
    #[error("{AUTHENTICATION_NAMESPACE}/{AUTHENTICATION_CONFIG_MAP}: {0}")]
    Config(String),
}

/// A caller, as Kubernetes authentication describes it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct UserInfo {
    /// The user's name.
    pub username: String,
    /// The user's uid, when given.
    pub uid: Option<String>,
    /// The user's groups.
    pub groups: Vec<String>,
    /// Extra attributes (scopes, the bound pod, …).
    pub extra: BTreeMap<String, Vec<String>>,
}

/// What a caller asks to do, as a SubjectAccessReview names it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Attributes {
    /// An API resource.
    Resource {
        /// Its API group (`""` for the core group).
        group: String,
        /// Its API version.
        version: String,
        /// Its resource (plural).
        resource: String,
        /// The namespace.
        namespace: String,
        /// One object's name, when the request names one.
        name: Option<String>,
        /// The verb.
        verb: String,
    },
    /// A path that is not a resource.
    NonResource {
        /// The path.
        path: String,
        /// The verb.
        verb: String,
    },
}

impl Attributes {
    fn describe(&self) -> String {
        match self {
            Self::Resource {
                group,
                resource,
                namespace,
                name,
                verb,
                ..
            } => {
                format!(
                    "{verb} {resource}{}{} in namespace {namespace:?}",
                    if group.is_empty() { "" } else { "." },
                    group
                ) + &name
                    .as_ref()
                    .map(|n| format!(" (name {n:?})"))
                    .unwrap_or_default()
            }
            Self::NonResource { path, verb } => format!("{verb} {path}"),
        }
    }
}

/// The front proxy's identity and header names, as the cluster publishes them.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestHeader {
    /// The CA the front proxy's client certificate must chain to.
    pub client_ca: Vec<CertificateDer<'static>>,
    /// The certificate names allowed to vouch (any, when empty).
    pub allowed_names: Vec<String>,
    /// Headers carrying the user's name.
    pub username_headers: Vec<String>,
    /// Headers carrying the user's uid.
    pub uid_headers: Vec<String>,
    /// Headers carrying the user's groups.
    pub group_headers: Vec<String>,
    /// Prefixes of headers carrying extra attributes.
    pub extra_prefixes: Vec<String>,
}

impl RequestHeader {
    /// From the ConfigMap's data; `None` when the cluster configures no front proxy.
    pub fn from_data(data: &BTreeMap<String, String>) -> Result<Option<Self>, AuthError> {
        let Some(ca) = data.get("requestheader-client-ca-file") else {
            return Ok(None);
        };
        let client_ca = CertificateDer::pem_slice_iter(ca.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| AuthError::Config(format!("requestheader-client-ca-file: {e}")))?;
        if client_ca.is_empty() {
            return Err(AuthError::Config(
                "requestheader-client-ca-file holds no certificate".into(),
            ));
        }
        // Lists are JSON arrays of strings, as kube-apiserver writes them.
        let list = |key: &str| -> Result<Vec<String>, AuthError> {
            data.get(key).map_or(Ok(Vec::new()), |v| {
                serde_json::from_str(v).map_err(|e| AuthError::Config(format!("{key}: {e}")))
            })
        };
        Ok(Some(Self {
            client_ca,
            allowed_names: list("requestheader-allowed-names")?,
            username_headers: list("requestheader-username-headers")?,
            uid_headers: list("requestheader-uid-headers")?,
            group_headers: list("requestheader-group-headers")?,
            extra_prefixes: list("requestheader-extra-headers-prefix")?,
        }))
    }

    /// The caller a front-proxy certificate vouches for. The certificate's chain was verified
    /// against `client_ca` during the handshake; its common name is checked here.
    pub fn user(
        &self,
        peer: &CertificateDer<'_>,
        headers: &HeaderMap,
    ) -> Result<UserInfo, AuthError> {
        let cn = common_name(peer)?;
        if !self.allowed_names.is_empty() && !self.allowed_names.contains(&cn) {
            return Err(AuthError::Unauthenticated(format!(
                "the client certificate {cn:?} is not an allowed front proxy"
            )));
        }
        let values = |names: &[String]| -> Vec<String> {
            names
                .iter()
                .flat_map(|name| headers.get_all(name.as_str()))
                .filter_map(|v| v.to_str().ok())
                .filter(|v| !v.is_empty())
                .map(str::to_owned)
                .collect()
        };
        let username = values(&self.username_headers)
            .into_iter()
            .next()
            .ok_or_else(|| AuthError::Unauthenticated("the front proxy named no user".into()))?;
        let mut extra = BTreeMap::<String, Vec<String>>::new();
        for (name, value) in headers {
            let name = name.as_str();
            let Some(key) = self.extra_prefixes.iter().find_map(|prefix| {
                name.get(..prefix.len())
                    .filter(|head| head.eq_ignore_ascii_case(prefix))
                    .map(|_| &name[prefix.len()..])
            }) else {
                continue;
            };
            let key = percent_encoding::percent_decode_str(key)
                .decode_utf8_lossy()
                .to_lowercase();
            if let Ok(value) = value.to_str() {
                extra.entry(key).or_default().push(value.to_owned());
            }
        }
        Ok(UserInfo {
            username,
            uid: values(&self.uid_headers).into_iter().next(),
            groups: values(&self.group_headers),
            extra,
        })
    }
}

fn common_name(der: &CertificateDer<'_>) -> Result<String, AuthError> {
    let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref()).map_err(|e| {
        AuthError::Unauthenticated(format!("the client certificate does not parse: {e}"))
    })?;
    let cn = cert
        .subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .unwrap_or_default();
    Ok(cn.to_owned())
}

type Cache<K, V> = Mutex<HashMap<K, (Instant, V)>>;

fn cached<K: Eq + std::hash::Hash, V: Clone>(cache: &Cache<K, V>, key: &K) -> Option<V> {
    let cache = cache.lock().expect("cache");
    cache
        .get(key)
        .filter(|(at, _)| at.elapsed() < REVIEW_CACHE_TTL)
        .map(|(_, v)| v.clone())
}

fn remember<K: Eq + std::hash::Hash, V>(cache: &Cache<K, V>, key: K, value: V) {
    let mut cache = cache.lock().expect("cache");
    if cache.len() >= CACHE_PRUNE_AT {
        cache.retain(|_, (at, _)| at.elapsed() < REVIEW_CACHE_TTL);
    }
    cache.insert(key, (Instant::now(), value));
}

/// Asks the API server who a token belongs to and what a caller may do.
pub struct Authorizer {
    client: Client,
    tokens: Cache<String, Result<UserInfo, String>>,
    decisions: Cache<(UserInfo, Attributes), Result<(), String>>,
}

impl Authorizer {
    /// Reviews through `client` (TokenReview, SubjectAccessReview), answers cached for [`REVIEW_CACHE_TTL`].
    pub fn new(client: Client) -> Self {
        Self {
            client,
            tokens: Mutex::default(),
            decisions: Mutex::default(),
        }
    }

    /// TokenReview: who holds `token`.
    pub async fn token_user(&self, token: &str) -> Result<UserInfo, AuthError> {
        if let Some(answer) = cached(&self.tokens, &token.to_owned()) {
            return answer.map_err(AuthError::Unauthenticated);
        }
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_owned()),
                audiences: None,
            },
            ..TokenReview::default()
        };
        let review = Api::<TokenReview>::all(self.client.clone())
            .create(&PostParams::default(), &review)
            .await?;
        let status = review.status.unwrap_or_default();
        let answer = match (status.authenticated, status.user) {
            (Some(true), Some(user)) => Ok(UserInfo {
                username: user.username.unwrap_or_default(),
                uid: user.uid,
                groups: user.groups.unwrap_or_default(),
                extra: user.extra.unwrap_or_default(),
            }),
            _ => Err(format!(
                "the bearer token was not accepted{}",
                status.error.map(|e| format!(": {e}")).unwrap_or_default()
            )),
        };
        remember(&self.tokens, token.to_owned(), answer.clone());
        answer.map_err(AuthError::Unauthenticated)
    }

    /// SubjectAccessReview: may `user` do `attributes`.
    pub async fn authorize(
        &self,
        user: &UserInfo,
        attributes: &Attributes,
    ) -> Result<(), AuthError> {
        let key = (user.clone(), attributes.clone());
        if let Some(answer) = cached(&self.decisions, &key) {
            return answer.map_err(AuthError::Forbidden);
        }
        let (resource_attributes, non_resource_attributes) = match attributes {
            Attributes::Resource {
                group,
                version,
                resource,
                namespace,
                name,
                verb,
            } => (
                Some(ResourceAttributes {
                    group: Some(group.clone()),
                    version: Some(version.clone()),
                    resource: Some(resource.clone()),
                    namespace: Some(namespace.clone()),
                    name: name.clone(),
                    verb: Some(verb.clone()),
                    ..ResourceAttributes::default()
                }),
                None,
            ),
            Attributes::NonResource { path, verb } => (
                None,
                Some(NonResourceAttributes {
                    path: Some(path.clone()),
                    verb: Some(verb.clone()),
                }),
            ),
        };
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(user.username.clone()),
                uid: user.uid.clone(),
                groups: Some(user.groups.clone()),
                extra: Some(user.extra.clone()),
                resource_attributes,
                non_resource_attributes,
            },
            ..SubjectAccessReview::default()
        };
        let review = Api::<SubjectAccessReview>::all(self.client.clone())
            .create(&PostParams::default(), &review)
            .await?;
        let status = review.status.unwrap_or_default();
        let answer = if status.allowed && !status.denied.unwrap_or(false) {
            Ok(())
        } else {
            Err(format!(
                "{:?} may not {}{}",
                user.username,
                attributes.describe(),
                status
                    .reason
                    .filter(|r| !r.is_empty())
                    .map(|r| format!(": {r}"))
                    .unwrap_or_default()
            ))
        };
        remember(&self.decisions, key, answer.clone());
        answer.map_err(AuthError::Forbidden)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn front_proxy(cn: &str) -> (String, CertificateDer<'static>) {
        let ca = cosmosq_testkit::pki::TestCa::new("front-proxy-ca");
        let (cert, _) = ca.client(cn);
        (
            ca.pem,
            CertificateDer::from_pem_slice(cert.as_bytes()).unwrap(),
        )
    }

    fn config(ca: &str, allowed: &str) -> BTreeMap<String, String> {
        BTreeMap::from([
            ("requestheader-client-ca-file".into(), ca.into()),
            ("requestheader-allowed-names".into(), allowed.into()),
            (
                "requestheader-username-headers".into(),
                r#"["X-Remote-User"]"#.into(),
            ),
            (
                "requestheader-group-headers".into(),
                r#"["X-Remote-Group"]"#.into(),
            ),
            (
                "requestheader-extra-headers-prefix".into(),
                r#"["X-Remote-Extra-"]"#.into(),
            ),
        ])
    }

    #[test]
    fn the_front_proxy_names_the_caller_in_headers() {
        let (ca, cert) = front_proxy("front-proxy-client");
        let header = RequestHeader::from_data(&config(&ca, r#"["front-proxy-client"]"#))
            .unwrap()
            .unwrap();
        let mut headers = HeaderMap::new();
        headers.insert(
            "x-remote-user",
            HeaderValue::from_static("system:serviceaccount:kube-system:horizontal-pod-autoscaler"),
        );
        headers.append(
            "x-remote-group",
            HeaderValue::from_static("system:serviceaccounts"),
        );
        headers.append(
            "x-remote-group",
            HeaderValue::from_static("system:authenticated"),
        );
        headers.insert(
            "x-remote-extra-authentication.kubernetes.io%2fpod-name",
            HeaderValue::from_static("hpa-0"),
        );
        let user = header.user(&cert, &headers).unwrap();
        assert_eq!(
            user.username,
            "system:serviceaccount:kube-system:horizontal-pod-autoscaler"
        );
        assert_eq!(
            user.groups,
            ["system:serviceaccounts", "system:authenticated"]
        );
        assert_eq!(
            user.extra["authentication.kubernetes.io/pod-name"],
            ["hpa-0"]
        );
        // No user header: nobody is vouched for.
        assert!(matches!(
            header.user(&cert, &HeaderMap::new()),
            Err(AuthError::Unauthenticated(_))
        ));
    }

    #[test]
    fn only_allowed_names_may_vouch() {
        let (ca, cert) = front_proxy("someone-else");
        let header = RequestHeader::from_data(&config(&ca, r#"["front-proxy-client"]"#))
            .unwrap()
            .unwrap();
        let mut headers = HeaderMap::new();
        headers.insert("x-remote-user", HeaderValue::from_static("admin"));
        let err = header.user(&cert, &headers).unwrap_err().to_string();
        assert!(err.contains("someone-else"), "{err}");
        // An empty list allows any certificate of the CA, as kube-apiserver documents.
        let header = RequestHeader::from_data(&config(&ca, "[]"))
            .unwrap()
            .unwrap();
        assert_eq!(header.user(&cert, &headers).unwrap().username, "admin");
    }

    #[test]
    fn a_cluster_without_a_front_proxy_or_with_a_broken_config_is_told_apart() {
        assert_eq!(RequestHeader::from_data(&BTreeMap::new()).unwrap(), None);
        let err = RequestHeader::from_data(&config("not a certificate", "[]")).unwrap_err();
        assert!(
            err.to_string().contains("requestheader-client-ca-file"),
            "{err}"
        );
        let (ca, _) = front_proxy("x");
        let err = RequestHeader::from_data(&config(&ca, "front-proxy-client")).unwrap_err();
        assert!(
            err.to_string().contains("requestheader-allowed-names"),
            "{err}"
        );
    }
}
