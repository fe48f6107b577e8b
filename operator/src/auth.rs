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
//! The KEDA endpoint and `/metrics` take a bearer token instead: a TokenReview names the
//! caller, a SubjectAccessReview decides whether it may `get` the QueueConsumerGroup (KEDA) or
//! the non-resource URL `/metrics` (Prometheus), as controller-runtime's metrics filter and
//! kube-rbac-proxy do. A KEDA token must be minted for the operator's own audience
//! ([`DEFAULT_TOKEN_AUDIENCE`]): one minted for the API server or anything else is refused, so a
//! token handed out for another purpose cannot be replayed here. `/metrics` takes the API
//! server's audience: Prometheus sends the token its pod was given, which already is an API
//! credential of the same caller, so accepting it grants nothing RBAC does not.
//!
//! Answers are cached for ten seconds, as the API server's delegated authentication and
//! authorization cache them: an HPA reads every 15 s, so each read costs at most one review.
//! Refusals are cached too, by a hash of the token (the token itself is not kept), and tokens
//! not in the cache are reviewed at a bounded rate ([`ReviewBudget`]): a caller without a valid
//! token cannot make the operator ask the API server once per request.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use http::HeaderMap;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, TokenReviewStatus};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use kube::Client;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use sha2::{Digest, Sha256};
use tokio::time::Instant;

/// Where the cluster publishes how its front proxy authenticates.
pub const AUTHENTICATION_NAMESPACE: &str = "kube-system";
/// The ConfigMap in [`AUTHENTICATION_NAMESPACE`] that holds the front proxy's CA and header names.
pub const AUTHENTICATION_CONFIG_MAP: &str = "extension-apiserver-authentication";
/// How long a review's answer is reused (the API server's delegated auth uses the same).
pub const REVIEW_CACHE_TTL: Duration = Duration::from_secs(10);
/// The most answers each cache holds: expired ones go first, then the oldest.
pub const CACHE_CAPACITY: usize = 4096;
/// The audience a token for the KEDA endpoint must be minted for, unless configured otherwise.
pub const DEFAULT_TOKEN_AUDIENCE: &str = "cosmosq";
/// TokenReviews of tokens not in the cache that may be asked at once…
pub const REVIEW_BURST: u32 = 10;
/// …and how often one more may be asked: 5 a second. Prometheus and KEDA each need one per
/// token every [`REVIEW_CACHE_TTL`].
pub const REVIEW_REFILL: Duration = Duration::from_millis(200);

/// Why a request to the secure listener was refused.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// 401: who is calling is unknown.
    #[error("{0}")]
    Unauthenticated(String),
    /// 403: the caller is known and may not do this.
    #[error("{0}")]
    Forbidden(String),
    /// 429: too many unknown tokens lately; the caller may try again after this long.
    #[error("too many unknown bearer tokens; retry in {}s", retry_after_seconds(*.0))]
    TooManyRequests(Duration),
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
        /// A subresource (`scale`, or one no API server serves that RBAC still grants, as
        /// `cosmosqueues/wake`).
        subresource: Option<String>,
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
    /// `verb` on one named object of cosmosq's own API group (or its `subresource`).
    pub fn cosmosq_object(
        resource: &str,
        subresource: Option<&str>,
        namespace: &str,
        name: &str,
        verb: &str,
    ) -> Self {
        Self::Resource {
            group: cosmosq_crds::GROUP.into(),
            version: cosmosq_crds::VERSION.into(),
            resource: resource.into(),
            namespace: namespace.into(),
            name: Some(name.into()),
            subresource: subresource.map(str::to_owned),
            verb: verb.into(),
        }
    }

    fn describe(&self) -> String {
        match self {
            Self::Resource {
                group,
                resource,
                namespace,
                name,
                subresource,
                verb,
                ..
            } => {
                format!(
                    "{verb} {resource}{}{}{} in namespace {namespace:?}",
                    if group.is_empty() { "" } else { "." },
                    group,
                    subresource
                        .as_ref()
                        .map(|s| format!("/{s}"))
                        .unwrap_or_default(),
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

/// Whole seconds, at least one: what a `Retry-After` header says.
pub fn retry_after_seconds(wait: Duration) -> u64 {
    wait.as_secs() + u64::from(wait.subsec_nanos() > 0 || wait.is_zero())
}

/// Answers by key, each valid for [`REVIEW_CACHE_TTL`], at most [`CACHE_CAPACITY`] of them.
#[derive(Debug)]
pub struct ReviewCache<K, V> {
    entries: HashMap<K, (Instant, V)>,
}

impl<K, V> Default for ReviewCache<K, V> {
    fn default() -> Self {
        Self {
            entries: HashMap::new(),
        }
    }
}

impl<K: Eq + std::hash::Hash + Clone, V: Clone> ReviewCache<K, V> {
    /// The answer for `key`, if it was given less than [`REVIEW_CACHE_TTL`] before `now`.
    pub fn get(&self, key: &K, now: Instant) -> Option<V> {
        self.entries
            .get(key)
            .filter(|(at, _)| now.duration_since(*at) < REVIEW_CACHE_TTL)
            .map(|(_, v)| v.clone())
    }

    /// Keeps `value` for `key`; when full, expired answers go, then the oldest one.
    pub fn insert(&mut self, key: K, value: V, now: Instant) {
        if self.entries.len() >= CACHE_CAPACITY && !self.entries.contains_key(&key) {
            self.entries
                .retain(|_, (at, _)| now.duration_since(*at) < REVIEW_CACHE_TTL);
            if self.entries.len() >= CACHE_CAPACITY {
                let oldest = self
                    .entries
                    .iter()
                    .min_by_key(|(_, (at, _))| *at)
                    .map(|(k, _)| k.clone());
                if let Some(oldest) = oldest {
                    self.entries.remove(&oldest);
                }
            }
        }
        self.entries.insert(key, (now, value));
    }

    /// How many answers are held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// A token bucket: [`REVIEW_BURST`] reviews at once, one more every [`REVIEW_REFILL`].
#[derive(Debug)]
pub struct ReviewBudget {
    available: u32,
    since: Instant,
}

impl ReviewBudget {
    /// Full at `now`.
    pub fn new(now: Instant) -> Self {
        Self {
            available: REVIEW_BURST,
            since: now,
        }
    }

    /// Takes one review at `now`, or says how long until one is available.
    pub fn take(&mut self, now: Instant) -> Result<(), Duration> {
        let elapsed = now.saturating_duration_since(self.since);
        let earned = elapsed.as_nanos() / REVIEW_REFILL.as_nanos();
        let earned = u32::try_from(earned).unwrap_or(u32::MAX);
        if self.available.saturating_add(earned) >= REVIEW_BURST {
            self.available = REVIEW_BURST;
            self.since = now;
        } else {
            self.available += earned;
            self.since += REVIEW_REFILL * earned;
        }
        if self.available == 0 {
            return Err(REVIEW_REFILL - now.saturating_duration_since(self.since));
        }
        self.available -= 1;
        Ok(())
    }
}

/// Whom a bearer token must have been minted for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Audience {
    /// The API server's own (a review that names none): what a pod's projected token carries.
    ApiServer,
    /// This one: the review names it, and the answer must name it back.
    Named(String),
}

/// What a TokenReview's answer says of a token reviewed for `audience`. An authenticator that
/// ignores audiences answers without `status.audiences`: that token is the API server's, not
/// ours, and is refused (as client-go's delegated authenticator does).
pub fn token_answer(status: TokenReviewStatus, audience: &Audience) -> Result<UserInfo, String> {
    let refused = |why: String| Err(format!("the bearer token was not accepted{why}"));
    let (Some(true), Some(user)) = (status.authenticated, status.user) else {
        return refused(status.error.map(|e| format!(": {e}")).unwrap_or_default());
    };
    if let Audience::Named(wanted) = audience {
        if !status.audiences.unwrap_or_default().contains(wanted) {
            return refused(format!(": it is not a token for the audience {wanted:?}"));
        }
    }
    Ok(UserInfo {
        username: user.username.unwrap_or_default(),
        uid: user.uid,
        groups: user.groups.unwrap_or_default(),
        extra: user.extra.unwrap_or_default(),
    })
}

/// What a token's answer is cached under: a hash of the audience and the token, so the cache
/// holds no credential.
fn token_key(token: &str, audience: &Audience) -> [u8; 32] {
    let mut hash = Sha256::new();
    match audience {
        Audience::ApiServer => hash.update([0]),
        Audience::Named(name) => {
            hash.update([1]);
            hash.update(name.as_bytes());
            hash.update([0]);
        }
    }
    hash.update(token.as_bytes());
    hash.finalize().into()
}

/// Asks the API server who a token belongs to and what a caller may do.
pub struct Authorizer {
    client: Client,
    tokens: Mutex<ReviewCache<[u8; 32], Result<UserInfo, String>>>,
    budget: Mutex<ReviewBudget>,
    decisions: Mutex<ReviewCache<(UserInfo, Attributes), Result<(), String>>>,
}

impl Authorizer {
    /// Reviews through `client` (TokenReview, SubjectAccessReview), answers cached for
    /// [`REVIEW_CACHE_TTL`], unknown tokens reviewed within the [`ReviewBudget`].
    pub fn new(client: Client) -> Self {
        Self {
            client,
            tokens: Mutex::default(),
            budget: Mutex::new(ReviewBudget::new(Instant::now())),
            decisions: Mutex::default(),
        }
    }

    /// TokenReview: who holds `token`, minted for `audience`.
    pub async fn token_user(
        &self,
        token: &str,
        audience: &Audience,
    ) -> Result<UserInfo, AuthError> {
        let key = token_key(token, audience);
        let cached = self.tokens.lock().expect("cache").get(&key, Instant::now());
        if let Some(answer) = cached {
            return answer.map_err(AuthError::Unauthenticated);
        }
        self.budget
            .lock()
            .expect("budget")
            .take(Instant::now())
            .map_err(AuthError::TooManyRequests)?;
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_owned()),
                audiences: match audience {
                    Audience::ApiServer => None,
                    Audience::Named(name) => Some(vec![name.clone()]),
                },
            },
            ..TokenReview::default()
        };
        let review = Api::<TokenReview>::all(self.client.clone())
            .create(&PostParams::default(), &review)
            .await?;
        let answer = token_answer(review.status.unwrap_or_default(), audience);
        self.tokens
            .lock()
            .expect("cache")
            .insert(key, answer.clone(), Instant::now());
        answer.map_err(AuthError::Unauthenticated)
    }

    /// SubjectAccessReview: may `user` do `attributes`.
    pub async fn authorize(
        &self,
        user: &UserInfo,
        attributes: &Attributes,
    ) -> Result<(), AuthError> {
        let key = (user.clone(), attributes.clone());
        let cached = self
            .decisions
            .lock()
            .expect("cache")
            .get(&key, Instant::now());
        if let Some(answer) = cached {
            return answer.map_err(AuthError::Forbidden);
        }
        let (resource_attributes, non_resource_attributes) = match attributes {
            Attributes::Resource {
                group,
                version,
                resource,
                namespace,
                name,
                subresource,
                verb,
            } => (
                Some(ResourceAttributes {
                    group: Some(group.clone()),
                    version: Some(version.clone()),
                    resource: Some(resource.clone()),
                    namespace: Some(namespace.clone()),
                    name: name.clone(),
                    subresource: subresource.clone(),
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
        self.decisions
            .lock()
            .expect("cache")
            .insert(key, answer.clone(), Instant::now());
        answer.map_err(AuthError::Forbidden)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cosmosq_testkit::fake::{FakeApiServer, API_AUDIENCE};
    use http::HeaderValue;
    use k8s_openapi::api::authentication::v1::UserInfo as ReviewedUser;

    fn cosmosq() -> Audience {
        Audience::Named(DEFAULT_TOKEN_AUDIENCE.into())
    }

    #[tokio::test(start_paused = true)]
    async fn the_review_budget_allows_a_burst_then_one_per_refill() {
        let mut budget = ReviewBudget::new(Instant::now());
        for _ in 0..REVIEW_BURST {
            assert_eq!(budget.take(Instant::now()), Ok(()));
        }
        assert_eq!(budget.take(Instant::now()), Err(REVIEW_REFILL));
        tokio::time::advance(Duration::from_millis(50)).await;
        assert_eq!(
            budget.take(Instant::now()),
            Err(REVIEW_REFILL - Duration::from_millis(50))
        );
        tokio::time::advance(REVIEW_REFILL - Duration::from_millis(50)).await;
        assert_eq!(budget.take(Instant::now()), Ok(()));
        assert_eq!(budget.take(Instant::now()), Err(REVIEW_REFILL));
        // A long quiet spell refills the bucket, never beyond the burst.
        tokio::time::advance(Duration::from_secs(3600)).await;
        for _ in 0..REVIEW_BURST {
            assert_eq!(budget.take(Instant::now()), Ok(()));
        }
        assert!(budget.take(Instant::now()).is_err());
        assert_eq!(retry_after_seconds(REVIEW_REFILL), 1);
        assert_eq!(retry_after_seconds(Duration::from_millis(1500)), 2);
        assert_eq!(retry_after_seconds(Duration::ZERO), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn answers_expire_and_the_cache_never_outgrows_its_capacity() {
        let mut cache = ReviewCache::default();
        cache.insert(0usize, "no", Instant::now());
        tokio::time::advance(REVIEW_CACHE_TTL - Duration::from_millis(1)).await;
        assert_eq!(cache.get(&0, Instant::now()), Some("no"));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(cache.get(&0, Instant::now()), None);
        // Full of live answers: the oldest goes.
        let mut cache = ReviewCache::default();
        for key in 0..CACHE_CAPACITY + 100 {
            cache.insert(key, (), Instant::now());
            tokio::time::advance(Duration::from_micros(1)).await;
        }
        assert_eq!(cache.len(), CACHE_CAPACITY);
        assert_eq!(cache.get(&99, Instant::now()), None);
        assert_eq!(cache.get(&100, Instant::now()), Some(()));
        // Full of expired answers: they all go.
        tokio::time::advance(REVIEW_CACHE_TTL).await;
        cache.insert(usize::MAX, (), Instant::now());
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn a_token_is_accepted_only_for_the_audience_asked() {
        let user = || {
            Some(ReviewedUser {
                username: Some("system:serviceaccount:keda:keda-operator".into()),
                ..ReviewedUser::default()
            })
        };
        let answer = |authenticated: bool, audiences: Option<&[&str]>| TokenReviewStatus {
            authenticated: Some(authenticated),
            audiences: audiences.map(|a| a.iter().map(|s| s.to_string()).collect()),
            user: authenticated.then(user).flatten(),
            error: (!authenticated).then(|| "invalid bearer token".to_owned()),
        };
        let ok = token_answer(answer(true, Some(&["cosmosq"])), &cosmosq()).unwrap();
        assert_eq!(ok.username, "system:serviceaccount:keda:keda-operator");
        // An authenticator that ignores audiences vouches for the API server, not for us.
        let err = token_answer(answer(true, None), &cosmosq()).unwrap_err();
        assert!(err.contains("audience \"cosmosq\""), "{err}");
        assert!(token_answer(answer(true, Some(&[API_AUDIENCE])), &cosmosq()).is_err());
        assert!(token_answer(answer(true, None), &Audience::ApiServer).is_ok());
        let err = token_answer(answer(false, None), &Audience::ApiServer).unwrap_err();
        assert!(err.contains("invalid bearer token"), "{err}");
    }

    #[tokio::test(start_paused = true)]
    async fn refusals_are_remembered_by_a_hash_and_unknown_tokens_reviewed_at_a_bounded_rate() {
        let server = FakeApiServer::new();
        server.issue_token("api-token", "system:serviceaccount:keda:keda-operator");
        let reviews = || {
            server
                .requests()
                .get("POST apis/authentication.k8s.io/v1/tokenreviews")
                .copied()
                .unwrap_or(0)
        };
        let authorizer = Authorizer::new(server.client());
        // Accepted for the API server is not accepted for us: each audience is its own answer.
        assert!(authorizer
            .token_user("api-token", &Audience::ApiServer)
            .await
            .is_ok());
        assert!(matches!(
            authorizer.token_user("api-token", &cosmosq()).await,
            Err(AuthError::Unauthenticated(_))
        ));
        assert_eq!(reviews(), 2);
        // A refused token is asked about once per TTL, and the cache does not hold it.
        for _ in 0..3 {
            assert!(matches!(
                authorizer.token_user("forged-secret", &cosmosq()).await,
                Err(AuthError::Unauthenticated(_))
            ));
        }
        assert_eq!(reviews(), 3);
        let held = format!("{:?}", authorizer.tokens.lock().unwrap());
        assert!(!held.contains("forged-secret"), "{held}");
        // New tokens spend the rest of the burst, then wait for the bucket.
        let mut wait = None;
        for i in 0..REVIEW_BURST * 3 {
            match authorizer
                .token_user(&format!("forged-{i}"), &cosmosq())
                .await
            {
                Err(AuthError::Unauthenticated(_)) => {}
                Err(AuthError::TooManyRequests(after)) => {
                    wait = Some(after);
                    break;
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(reviews(), u64::from(REVIEW_BURST));
        assert_eq!(wait, Some(REVIEW_REFILL), "refused once the burst is spent");
        // Known answers are not held up by the empty bucket.
        assert!(authorizer
            .token_user("api-token", &Audience::ApiServer)
            .await
            .is_ok());
        tokio::time::advance(REVIEW_REFILL).await;
        assert!(matches!(
            authorizer.token_user("forged-late", &cosmosq()).await,
            Err(AuthError::Unauthenticated(_))
        ));
        assert_eq!(reviews(), u64::from(REVIEW_BURST) + 1);
        // After the TTL the refusal is asked again.
        tokio::time::advance(REVIEW_CACHE_TTL).await;
        let _ = authorizer.token_user("forged-secret", &cosmosq()).await;
        assert_eq!(reviews(), u64::from(REVIEW_BURST) + 2);
    }

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
