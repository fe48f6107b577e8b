//! The serving certificate the operator issues, renews and rotates itself (the chart's
//! `externalMetrics.certGeneratedBy: operator`), as metrics-server and KEDA do: a CA and a
//! serving certificate kept in one Secret of the operator's namespace, and the CAs written to
//! the APIService's `spec.caBundle`. Helm renders none of it, so `helm template` is stable.
//!
//! Only the leader writes; the Secret's `resourceVersion` (and `create` failing on a name that
//! exists) guards the moment two replicas both believe they lead. Every replica serves what
//! the Secret holds (`tls::Source::Secret`).
//!
//! The serving certificate is renewed at 2/3 of its life. The CA is renewed at 2/3 of its life
//! in two steps, so that no handshake of the aggregator fails: the next CA is first only
//! trusted (in `ca.crt` and the APIService's bundle), and signs once the APIService is seen to
//! hold it and [`PROPAGATION`] has passed; the retired CA stays trusted until the certificate
//! it signed has been replaced for [`PROPAGATION`].

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService;
use k8s_openapi::ByteString;
use kube::api::{Api, Patch, PatchParams, PostParams};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, instrument, warn};
use x509_parser::extensions::GeneralName;

use crate::tls::ServingTls;

/// How long a new CA (or a retired one) is given to reach every reader of the bundle (the
/// aggregators of every API server, replicas reloading the Secret every 30 s) before the
/// serving certificate depends on it (or no longer does).
pub const PROPAGATION: Duration = Duration::from_secs(10 * 60);
/// Certificates are valid from this long before they are issued: a reader whose clock is a
/// little behind accepts them at once.
pub const BACKDATE: Duration = Duration::from_secs(5 * 60);
/// The field manager of the APIService's `spec.caBundle`.
pub const CA_BUNDLE_MANAGER: &str = "cosmosq-operator-ca-bundle";
/// How often the leader looks at the certificates (and every replica reloads them).
pub const CHECK_INTERVAL: Duration = crate::tls::RELOAD_INTERVAL;

/// The Secret's keys. `ca.crt` is what clients trust (the APIService's bundle); the others are
/// the operator's state.
pub mod keys {
    /// Every CA a client should trust now, PEM.
    pub const TRUSTED: &str = "ca.crt";
    /// The serving certificate, PEM.
    pub const CERT: &str = "tls.crt";
    /// Its key, PEM.
    pub const KEY: &str = "tls.key";
    /// The CA that signs serving certificates.
    pub const ISSUER_CERT: &str = "issuer.crt";
    /// Its key.
    pub const ISSUER_KEY: &str = "issuer.key";
    /// The CA that will sign once every reader trusts it.
    pub const NEXT_CERT: &str = "next-issuer.crt";
    /// Its key.
    pub const NEXT_KEY: &str = "next-issuer.key";
    /// CAs that signed before, trusted until what they signed is replaced everywhere.
    pub const RETIRED: &str = "retired.crt";
}

/// Why certificates could not be issued or kept.
#[derive(Debug, thiserror::Error)]
pub enum CertsError {
    /// rcgen refused to generate or sign.
    #[error("generating a certificate: {0}")]
    Generate(#[from] rcgen::Error),
    /// The Secret or the APIService could not be read or written.
    #[error("Kubernetes: {0}")]
    Kube(#[from] kube::Error),
}

/// A certificate and its private key, PEM. `Debug` never shows the key.
#[derive(Clone, PartialEq, Eq)]
pub struct Pair {
    /// The certificate.
    pub cert: String,
    key: String,
}

impl fmt::Debug for Pair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pair")
            .field("cert", &self.cert)
            .field("key", &"<redacted>")
            .finish()
    }
}

/// What the service's certificate must say and how long what is issued lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// The names clients dial: the Service's.
    pub dns_names: Vec<String>,
    /// The serving certificate's life.
    pub validity: Duration,
    /// A CA's life.
    pub ca_validity: Duration,
}

impl Settings {
    /// The names of Service `service` in `namespace`, as the aggregator (`<svc>.<ns>.svc`) and
    /// in-cluster clients dial it.
    pub fn for_service(
        service: &str,
        namespace: &str,
        validity: Duration,
        ca_validity: Duration,
    ) -> Self {
        Self {
            dns_names: vec![
                format!("{service}.{namespace}.svc"),
                format!("{service}.{namespace}"),
                service.to_owned(),
            ],
            validity,
            ca_validity,
        }
    }
}

/// When a certificate is valid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Validity {
    /// Not before.
    pub not_before: SystemTime,
    /// Not after.
    pub not_after: SystemTime,
}

impl Validity {
    /// When it is renewed: at 2/3 of its life.
    pub fn renew_at(&self) -> SystemTime {
        let life = self
            .not_after
            .duration_since(self.not_before)
            .unwrap_or_default();
        self.not_before + life * 2 / 3
    }
}

/// What the decision needs to know of the stored certificates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Facts {
    /// The signing CA.
    pub issuer: Validity,
    /// The next CA, trusted but not signing yet.
    pub next: Option<Validity>,
    /// The serving certificate.
    pub serving: Validity,
    /// The serving certificate names the Service's DNS names and was signed by the issuer.
    pub serving_current: bool,
    /// Whoever must trust the next CA before it signs (the APIService) holds it.
    pub next_published: bool,
    /// How many retired CAs are still trusted.
    pub retired: usize,
}

/// What to change; empty when nothing is due.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rotation {
    /// Start over with a new CA and serving certificate: nothing usable is stored, or the CA
    /// expired (no overlap is possible then).
    pub issue: bool,
    /// Trust a next CA (the issuer is at 2/3 of its life).
    pub add_next: bool,
    /// Sign with the next CA from now on; the issuer retires.
    pub promote: bool,
    /// Issue a new serving certificate.
    pub renew: bool,
    /// Stop trusting retired CAs.
    pub drop_retired: bool,
}

impl Rotation {
    /// Nothing to change.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// What to change at `now`, given what is stored (`None`: nothing usable).
pub fn decide(facts: Option<&Facts>, now: SystemTime) -> Rotation {
    let Some(f) = facts else {
        return Rotation {
            issue: true,
            ..Rotation::default()
        };
    };
    if now >= f.issuer.not_after {
        return Rotation {
            issue: true,
            ..Rotation::default()
        };
    }
    let mut plan = Rotation::default();
    match f.next {
        None => plan.add_next = now >= f.issuer.renew_at(),
        Some(next) => {
            plan.promote = f.next_published && now >= next.not_before + BACKDATE + PROPAGATION
        }
    }
    plan.renew = plan.promote || !f.serving_current || now >= f.serving.renew_at();
    plan.drop_retired =
        f.retired > 0 && !plan.renew && now >= f.serving.not_before + BACKDATE + PROPAGATION;
    plan
}

/// What the Secret holds: the CAs and the serving certificate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pki {
    /// The CA that signs.
    pub issuer: Pair,
    /// The CA that will sign.
    pub next: Option<Pair>,
    /// CAs that signed before, PEM.
    pub retired: Vec<String>,
    /// The serving certificate.
    pub serving: Pair,
}

impl Pki {
    /// A new CA and a serving certificate it signed.
    pub fn issue(settings: &Settings, now: SystemTime) -> Result<Self, CertsError> {
        let issuer = new_ca(settings, now)?;
        let serving = sign(&issuer, settings, now)?;
        Ok(Self {
            issuer,
            next: None,
            retired: Vec::new(),
            serving,
        })
    }

    /// These certificates with `plan` carried out.
    pub fn rotate(
        mut self,
        plan: Rotation,
        settings: &Settings,
        now: SystemTime,
    ) -> Result<Self, CertsError> {
        if plan.issue {
            return Self::issue(settings, now);
        }
        if plan.drop_retired {
            self.retired.clear();
        }
        if plan.add_next {
            self.next = Some(new_ca(settings, now)?);
        }
        if plan.promote {
            if let Some(next) = self.next.take() {
                let retired = std::mem::replace(&mut self.issuer, next);
                self.retired.push(retired.cert);
            }
        }
        if plan.renew {
            self.serving = sign(&self.issuer, settings, now)?;
        }
        Ok(self)
    }

    /// Every CA a client must trust: the issuer, the next one, the retired ones (PEM).
    pub fn bundle(&self) -> String {
        let mut bundle = self.issuer.cert.clone();
        bundle.extend(self.next.iter().map(|n| n.cert.as_str()));
        bundle.extend(self.retired.iter().map(String::as_str));
        bundle
    }

    /// The Secret's data.
    pub fn to_data(&self) -> BTreeMap<String, ByteString> {
        let mut data = BTreeMap::new();
        let mut put = |key: &str, value: &str| {
            data.insert(key.to_owned(), ByteString(value.as_bytes().to_vec()));
        };
        put(keys::TRUSTED, &self.bundle());
        put(keys::CERT, &self.serving.cert);
        put(keys::KEY, &self.serving.key);
        put(keys::ISSUER_CERT, &self.issuer.cert);
        put(keys::ISSUER_KEY, &self.issuer.key);
        if let Some(next) = &self.next {
            put(keys::NEXT_CERT, &next.cert);
            put(keys::NEXT_KEY, &next.key);
        }
        if !self.retired.is_empty() {
            put(keys::RETIRED, &self.retired.concat());
        }
        data
    }

    /// Reads the Secret's data; the error says what is missing, never what is there.
    pub fn from_data(data: &BTreeMap<String, ByteString>) -> Result<Self, String> {
        let text = |key: &str| -> Result<Option<String>, String> {
            data.get(key)
                .map(|v| String::from_utf8(v.0.clone()).map_err(|_| format!("{key} is not PEM")))
                .transpose()
        };
        let required = |key: &str| text(key)?.ok_or_else(|| format!("{key} is missing"));
        let pair = |cert: &str, key: &str| -> Result<Pair, String> {
            Ok(Pair {
                cert: required(cert)?,
                key: required(key)?,
            })
        };
        let next = match text(keys::NEXT_CERT)? {
            Some(_) => Some(pair(keys::NEXT_CERT, keys::NEXT_KEY)?),
            None => None,
        };
        let retired = text(keys::RETIRED)?
            .map(|text| pem_blocks(&text))
            .unwrap_or_default();
        Ok(Self {
            issuer: pair(keys::ISSUER_CERT, keys::ISSUER_KEY)?,
            next,
            retired,
            serving: pair(keys::CERT, keys::KEY)?,
        })
    }

    /// What [`decide`] needs; an error says why these certificates cannot be used.
    /// `next_published`: whoever must trust the next CA before it signs does.
    pub fn facts(&self, settings: &Settings, next_published: bool) -> Result<Facts, String> {
        let issuer = parse_pair(&self.issuer, "the CA")?;
        let next = self
            .next
            .as_ref()
            .map(|n| parse_pair(n, "the next CA"))
            .transpose()?;
        let serving = parse_pair(&self.serving, "the serving certificate")?;
        for retired in &self.retired {
            parse(retired).map_err(|e| format!("a retired CA: {e}"))?;
        }
        let serving_cert = x509(&serving.der)?;
        let issuer_cert = x509(&issuer.der)?;
        let signed_by_issuer = serving_cert
            .verify_signature(Some(issuer_cert.public_key()))
            .is_ok();
        let mut names = dns_names(&serving_cert);
        names.sort();
        let mut wanted = settings.dns_names.clone();
        wanted.sort();
        Ok(Facts {
            issuer: issuer.validity,
            next: next.map(|n| n.validity),
            serving: serving.validity,
            serving_current: signed_by_issuer && names == wanted,
            next_published,
            retired: self.retired.len(),
        })
    }
}

/// Whether PEM `bundle` holds the certificate `ca` (PEM).
pub fn holds(bundle: &[u8], ca: &str) -> bool {
    let Ok(ca) = CertificateDer::from_pem_slice(ca.as_bytes()) else {
        return false;
    };
    CertificateDer::pem_slice_iter(bundle).any(|c| c.is_ok_and(|c| c == ca))
}

/// The PEM blocks of `text`, each ending with a newline.
fn pem_blocks(text: &str) -> Vec<String> {
    text.split_inclusive("-----END CERTIFICATE-----")
        .map(str::trim)
        .filter(|block| !block.is_empty())
        .map(|block| format!("{block}\n"))
        .collect()
}

struct Parsed {
    der: CertificateDer<'static>,
    validity: Validity,
}

fn parse(pem: &str) -> Result<Parsed, String> {
    let der = CertificateDer::from_pem_slice(pem.as_bytes()).map_err(|_| "not PEM".to_owned())?;
    let cert = x509(&der)?;
    let time = |t: x509_parser::time::ASN1Time| {
        u64::try_from(t.timestamp())
            .map(|s| UNIX_EPOCH + Duration::from_secs(s))
            .map_err(|_| "valid before 1970".to_owned())
    };
    let validity = Validity {
        not_before: time(cert.validity().not_before)?,
        not_after: time(cert.validity().not_after)?,
    };
    Ok(Parsed { der, validity })
}

fn parse_pair(pair: &Pair, what: &str) -> Result<Parsed, String> {
    let parsed = parse(&pair.cert).map_err(|e| format!("{what}: {e}"))?;
    let key = rcgen::KeyPair::from_pem(&pair.key)
        .map_err(|_| format!("{what}'s key is not a PEM key"))?;
    use rcgen::PublicKeyData;
    if x509(&parsed.der)?.public_key().raw != key.subject_public_key_info().as_slice() {
        return Err(format!("{what}'s key does not match it"));
    }
    Ok(parsed)
}

fn x509<'a>(
    der: &'a CertificateDer<'_>,
) -> Result<x509_parser::certificate::X509Certificate<'a>, String> {
    x509_parser::parse_x509_certificate(der)
        .map(|(_, cert)| cert)
        .map_err(|_| "not an X.509 certificate".to_owned())
}

fn dns_names(cert: &x509_parser::certificate::X509Certificate<'_>) -> Vec<String> {
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            GeneralName::DNSName(name) => Some((*name).to_owned()),
            _ => None,
        })
        .collect()
}

fn unix_seconds(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs()
}

/// A new CA, valid for `settings.ca_validity`, named by when it was made.
fn new_ca(settings: &Settings, now: SystemTime) -> Result<Pair, CertsError> {
    let key = rcgen::KeyPair::generate()?;
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.distinguished_name.push(
        rcgen::DnType::CommonName,
        format!("cosmosq-serving-ca@{}", unix_seconds(now)),
    );
    params.not_before = (now - BACKDATE).into();
    params.not_after = (now + settings.ca_validity).into();
    let cert = params.self_signed(&key)?;
    Ok(Pair {
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

/// A serving certificate for the Service's names, signed by `issuer`, valid for
/// `settings.validity` but never past the issuer.
fn sign(issuer: &Pair, settings: &Settings, now: SystemTime) -> Result<Pair, CertsError> {
    let issuer_until = parse(&issuer.cert)
        .map(|p| p.validity.not_after)
        .map_err(|_| rcgen::Error::CouldNotParseCertificate)?;
    let signer =
        rcgen::Issuer::from_ca_cert_pem(&issuer.cert, rcgen::KeyPair::from_pem(&issuer.key)?)?;
    let key = rcgen::KeyPair::generate()?;
    let mut params = rcgen::CertificateParams::new(settings.dns_names.clone())?;
    params.distinguished_name = rcgen::DistinguishedName::new();
    if let Some(name) = settings.dns_names.first() {
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name.as_str());
    }
    params.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    params.not_before = (now - BACKDATE).into();
    params.not_after = (now + settings.validity).min(issuer_until).into();
    let cert = params.signed_by(&key, &signer)?;
    Ok(Pair {
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

/// What the APIService holds, as the leader read it this round.
#[derive(Debug, PartialEq, Eq)]
enum Published {
    /// No APIService is kept (the KEDA endpoint alone): nobody to wait for.
    NotKept,
    /// The APIService does not exist (yet).
    Missing,
    /// Its `spec.caBundle` (empty when unset).
    Bundle(Vec<u8>),
}

/// The leader's side: issues, renews and rotates the certificates in their Secret and keeps
/// the APIService's `spec.caBundle` to what they need trusted.
pub struct Keeper {
    secrets: Api<Secret>,
    name: String,
    api_service: Option<(Api<APIService>, String)>,
    settings: Settings,
    tls: Arc<ServingTls>,
}

impl Keeper {
    /// Keeps Secret `name` of `secrets`' namespace, and the caBundle of APIService `api_service`
    /// when one is named; `tls` is told when the Secret changes.
    pub fn new(
        secrets: Api<Secret>,
        name: String,
        api_service: Option<(Api<APIService>, String)>,
        settings: Settings,
        tls: Arc<ServingTls>,
    ) -> Self {
        Self {
            secrets,
            name,
            api_service,
            settings,
            tls,
        }
    }

    /// Rounds every [`CHECK_INTERVAL`] until `stop` (the first at once).
    pub async fn run(&self, stop: CancellationToken) {
        let mut interval = tokio::time::interval(CHECK_INTERVAL);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = interval.tick() => {}
            }
            if let Err(e) = self.round(SystemTime::now()).await {
                warn!(secret = %self.name, error = %e, "could not keep the serving certificate; trying again");
            }
        }
    }

    /// One look at `now`: carries out what [`decide`] finds due, writes the Secret, then the
    /// APIService's bundle. Losing a race for the Secret to another replica is no error: the
    /// next round reads what it wrote.
    #[instrument(skip_all, fields(secret = %self.name))]
    pub async fn round(&self, now: SystemTime) -> Result<(), CertsError> {
        let stored = self.secrets.get_opt(&self.name).await?;
        let published = self.published().await?;
        let pki = stored.as_ref().and_then(|secret| {
            Pki::from_data(secret.data.as_ref().unwrap_or(&BTreeMap::new()))
                .map_err(
                    |reason| warn!(%reason, "the stored certificates are unusable; starting over"),
                )
                .ok()
        });
        let facts = pki.as_ref().and_then(|pki| {
            let next_published = match (&published, &pki.next) {
                (Published::NotKept, _) => true,
                (Published::Bundle(bundle), Some(next)) => holds(bundle, &next.cert),
                _ => false,
            };
            pki.facts(&self.settings, next_published)
                .map_err(
                    |reason| warn!(%reason, "the stored certificates are unusable; starting over"),
                )
                .ok()
        });
        let plan = decide(facts.as_ref(), now);
        let pki = match pki {
            Some(pki) if plan.is_empty() => pki,
            Some(pki) => pki.rotate(plan, &self.settings, now)?,
            None => Pki::issue(&self.settings, now)?,
        };
        if !plan.is_empty() {
            if !self.write(stored, &pki).await? {
                return Ok(());
            }
            let until = parse(&pki.serving.cert).map(|p| p.validity.not_after);
            info!(
                issued = plan.issue,
                added_next_ca = plan.add_next,
                promoted_next_ca = plan.promote,
                renewed = plan.renew,
                dropped_retired_cas = plan.drop_retired,
                serving_not_after = %until.map(|t| humantime::format_rfc3339_seconds(t).to_string()).unwrap_or_default(),
                "wrote the serving certificate"
            );
        }
        self.publish(&published, &pki).await?;
        if !plan.is_empty() {
            // This replica serves the new certificate now, not at its next reload.
            if let Err(e) = self.tls.reload().await {
                warn!(error = %e, "keeping the previous TLS settings");
            }
        }
        Ok(())
    }

    async fn published(&self) -> Result<Published, CertsError> {
        let Some((api, name)) = &self.api_service else {
            return Ok(Published::NotKept);
        };
        Ok(match api.get_opt(name).await? {
            Some(service) => Published::Bundle(
                service
                    .spec
                    .and_then(|s| s.ca_bundle)
                    .map(|b| b.0)
                    .unwrap_or_default(),
            ),
            None => Published::Missing,
        })
    }

    /// Creates or replaces (on the `resourceVersion` read) the Secret; false when another
    /// writer came first.
    async fn write(&self, stored: Option<Secret>, pki: &Pki) -> Result<bool, CertsError> {
        let mut secret = Secret {
            metadata: kube::api::ObjectMeta {
                name: Some(self.name.clone()),
                labels: Some(BTreeMap::from([(
                    "app.kubernetes.io/managed-by".to_owned(),
                    "cosmosq-operator".to_owned(),
                )])),
                ..Default::default()
            },
            type_: Some("Opaque".into()),
            data: Some(pki.to_data()),
            ..Default::default()
        };
        let written = match stored {
            Some(stored) => {
                secret.metadata.resource_version = stored.metadata.resource_version;
                self.secrets
                    .replace(&self.name, &PostParams::default(), &secret)
                    .await
            }
            None => self.secrets.create(&PostParams::default(), &secret).await,
        };
        match written {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(e)) if e.code == 409 => {
                info!("another replica wrote the certificates first; reading them next round");
                Ok(false)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Sets the APIService's `spec.caBundle` (and nothing else) to the bundle, if it differs.
    async fn publish(&self, published: &Published, pki: &Pki) -> Result<(), CertsError> {
        let Some((api, name)) = &self.api_service else {
            return Ok(());
        };
        let bundle = pki.bundle().into_bytes();
        match published {
            Published::Bundle(live) if *live == bundle => return Ok(()),
            Published::Missing => {
                debug!(api_service = %name, "no APIService to give the CA bundle to yet");
                return Ok(());
            }
            _ => {}
        }
        let patch = json!({
            "apiVersion": "apiregistration.k8s.io/v1",
            "kind": "APIService",
            "metadata": {"name": name},
            "spec": {"caBundle": ByteString(bundle)},
        });
        api.patch(
            name,
            &PatchParams::apply(CA_BUNDLE_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await?;
        info!(api_service = %name, cas = pem_blocks(&pki.bundle()).len(), "wrote the CA bundle");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{self, json_response, not_found};
    use cosmosq_testkit::fake::FakeApiServer;
    use http::{Method, StatusCode};
    use rustls::client::danger::ServerCertVerifier;
    use rustls::client::WebPkiServerVerifier;
    use rustls::pki_types::{ServerName, UnixTime};
    use rustls::RootCertStore;

    const DAY: Duration = Duration::from_secs(86_400);
    const HOUR: Duration = Duration::from_secs(3_600);
    const NAMESPACE: &str = "cosmosq";
    const SECRET: &str = "cosmosq-operator-tls";
    const API_SERVICE: &str = "v1beta1.external.metrics.k8s.io";
    const HOST: &str = "cosmosq-external-metrics.cosmosq.svc";

    fn at(days: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_700_000_000) + DAY * days as u32
    }

    fn settings() -> Settings {
        Settings::for_service("cosmosq-external-metrics", NAMESPACE, 30 * DAY, 90 * DAY)
    }

    /// Stored certificates as the decision sees them: a CA made on day 0 for 90 days, a
    /// serving certificate of day `serving_from` for 30 days.
    fn facts(serving_from: u64) -> Facts {
        let validity = |from: u64, days: u64| Validity {
            not_before: at(from) - BACKDATE,
            not_after: at(from + days),
        };
        Facts {
            issuer: validity(0, 90),
            next: None,
            serving: validity(serving_from, 30),
            serving_current: true,
            next_published: false,
            retired: 0,
        }
    }

    #[test]
    fn renewals_are_due_at_two_thirds_of_a_life() {
        let none = Rotation::default();
        let issue = Rotation {
            issue: true,
            ..none
        };
        let renew = Rotation {
            renew: true,
            ..none
        };
        let add_next = Rotation {
            add_next: true,
            ..none
        };
        // (what is stored, when, what is due)
        let cases: Vec<(&str, Option<Facts>, SystemTime, Rotation)> = vec![
            ("nothing stored", None, at(0), issue),
            ("all fresh", Some(facts(0)), at(1), none),
            (
                "the serving certificate just before 2/3",
                Some(facts(0)),
                at(19),
                none,
            ),
            (
                "the serving certificate at 2/3",
                Some(facts(0)),
                at(20),
                renew,
            ),
            (
                "a serving certificate for other names, or by another CA",
                Some(Facts {
                    serving_current: false,
                    ..facts(0)
                }),
                at(1),
                renew,
            ),
            ("the CA at 2/3", Some(facts(50)), at(60), add_next),
            (
                "the CA at 2/3 and the serving certificate due",
                Some(facts(40)),
                at(60),
                Rotation {
                    add_next: true,
                    renew: true,
                    ..none
                },
            ),
            (
                "the CA expired: no overlap possible",
                Some(facts(80)),
                at(90),
                issue,
            ),
        ];
        for (case, facts, now, want) in cases {
            assert_eq!(decide(facts.as_ref(), now), want, "{case}");
        }
    }

    #[test]
    fn the_next_ca_signs_only_once_published_and_propagated() {
        let added = at(60);
        let pending = Facts {
            next: Some(Validity {
                not_before: added - BACKDATE,
                not_after: added + 90 * DAY,
            }),
            ..facts(50)
        };
        let promote = Rotation {
            promote: true,
            renew: true,
            ..Rotation::default()
        };
        // Not in the APIService's bundle yet: it waits, however long.
        assert_eq!(decide(Some(&pending), added + 5 * DAY), Rotation::default());
        let published = Facts {
            next_published: true,
            ..pending
        };
        assert_eq!(
            decide(
                Some(&published),
                added + PROPAGATION - Duration::from_secs(1)
            ),
            Rotation::default(),
            "published, but the aggregators may not have it yet"
        );
        assert_eq!(decide(Some(&published), added + PROPAGATION), promote);
    }

    #[test]
    fn a_retired_ca_is_trusted_until_its_certificate_is_replaced_everywhere() {
        let promoted = at(61);
        let after_promotion = Facts {
            issuer: Validity {
                not_before: at(60) - BACKDATE,
                not_after: at(150),
            },
            serving: Validity {
                not_before: promoted - BACKDATE,
                not_after: promoted + 30 * DAY,
            },
            retired: 1,
            ..facts(0)
        };
        assert_eq!(
            decide(Some(&after_promotion), promoted + PROPAGATION / 2),
            Rotation::default(),
            "replicas may still serve the certificate the retired CA signed"
        );
        assert_eq!(
            decide(Some(&after_promotion), promoted + PROPAGATION),
            Rotation {
                drop_retired: true,
                ..Rotation::default()
            }
        );
    }

    /// Whether a client trusting `bundle` accepts `serving` for the Service's name at `now`.
    fn trusts(bundle: &str, serving: &str, now: SystemTime) -> Result<(), String> {
        cosmosq_queue::cosmos::tls::install_crypto_provider();
        let mut roots = RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(bundle.as_bytes()) {
            roots.add(ca.unwrap()).unwrap();
        }
        let verifier = WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            Arc::new(rustls::crypto::ring::default_provider()),
        )
        .build()
        .unwrap();
        let leaf = CertificateDer::from_pem_slice(serving.as_bytes()).unwrap();
        verifier
            .verify_server_cert(
                &leaf,
                &[],
                &ServerName::try_from(HOST).unwrap(),
                &[],
                UnixTime::since_unix_epoch(now.duration_since(UNIX_EPOCH).unwrap()),
            )
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn issued_certificates_are_read_back_from_their_secret_and_kept() {
        let s = settings();
        let pki = Pki::issue(&s, at(0)).unwrap();
        let read = Pki::from_data(&pki.to_data()).unwrap();
        assert_eq!(read, pki);
        let facts = read.facts(&s, false).unwrap();
        assert!(facts.serving_current);
        assert_eq!(facts.serving.not_after, at(30));
        assert_eq!(facts.issuer.not_after, at(90));
        assert_eq!(
            decide(Some(&facts), at(1)),
            Rotation::default(),
            "reused as is"
        );
        trusts(&read.bundle(), &read.serving.cert, at(1)).unwrap();
        assert_eq!(
            pki.to_data()[keys::TRUSTED].0,
            pki.bundle().into_bytes(),
            "ca.crt is what clients trust"
        );

        // Another Service's name: the certificate is issued again, by the same CA.
        let moved = Settings::for_service("other", NAMESPACE, s.validity, s.ca_validity);
        let facts = read.facts(&moved, false).unwrap();
        assert!(!facts.serving_current);
        let renewed = read
            .clone()
            .rotate(decide(Some(&facts), at(1)), &moved, at(1))
            .unwrap();
        assert_eq!(renewed.issuer, read.issuer);
        assert!(renewed.facts(&moved, false).unwrap().serving_current);

        // A serving certificate of another CA is not current.
        let foreign = Pki::issue(&s, at(0)).unwrap();
        let mixed = Pki {
            serving: foreign.serving,
            ..read.clone()
        };
        assert!(!mixed.facts(&s, false).unwrap().serving_current);
    }

    #[test]
    fn what_is_unusable_is_named_without_its_content() {
        let pki = Pki::issue(&settings(), at(0)).unwrap();
        let mut data = pki.to_data();
        data.remove(keys::ISSUER_KEY);
        assert_eq!(Pki::from_data(&data).unwrap_err(), "issuer.key is missing");
        let mut data = pki.to_data();
        data.insert(
            keys::KEY.into(),
            ByteString(b"TOP-SECRET-MATERIAL".to_vec()),
        );
        let err = Pki::from_data(&data)
            .unwrap()
            .facts(&settings(), false)
            .unwrap_err();
        assert!(!err.contains("TOP-SECRET"), "{err}");
        assert!(err.contains("the serving certificate's key"), "{err}");
        // A key that does not match its certificate.
        let other = Pki::issue(&settings(), at(0)).unwrap();
        let swapped = Pki {
            serving: Pair {
                cert: pki.serving.cert.clone(),
                key: other.serving.key.clone(),
            },
            ..pki.clone()
        };
        let err = swapped.facts(&settings(), false).unwrap_err();
        assert!(err.contains("does not match"), "{err}");
        let debug = format!("{pki:?}");
        assert!(!debug.contains("PRIVATE KEY"), "{debug}");
    }

    /// Two CA lives, round by round (every 6 hours), the APIService's bundle updated at the
    /// end of each round as the keeper does: whatever a replica serves (the new certificate,
    /// or the one it has not reloaded yet) is trusted by whatever bundle the aggregator holds
    /// (the new one, or the one before), so no aggregated read fails.
    #[test]
    fn a_ca_rotation_keeps_every_served_certificate_trusted() {
        let s = settings();
        let step = 6 * HOUR;
        let mut now = at(0);
        let mut pki = Pki::issue(&s, now).unwrap();
        let mut published = pki.bundle();
        let mut seen = Rotation::default();
        let (mut promotions, mut renewals, mut drops) = (0, 0, 0);
        while now < at(200) {
            now += step;
            let next_published = pki
                .next
                .as_ref()
                .is_some_and(|n| holds(published.as_bytes(), &n.cert));
            let facts = pki.facts(&s, next_published).unwrap();
            let plan = decide(Some(&facts), now);
            assert!(!plan.issue, "never starts over: {now:?}");
            let before = pki.clone();
            pki = pki.rotate(plan, &s, now).unwrap();
            for (bundle, serving, what) in [
                (
                    &published,
                    &pki.serving.cert,
                    "the new certificate, the old bundle",
                ),
                (
                    &pki.bundle(),
                    &before.serving.cert,
                    "the old certificate, the new bundle",
                ),
                (
                    &pki.bundle(),
                    &pki.serving.cert,
                    "the new certificate, the new bundle",
                ),
            ] {
                if let Err(e) = trusts(bundle, serving, now) {
                    panic!("{what} at {now:?} after {plan:?}: {e}");
                }
            }
            published = pki.bundle();
            promotions += usize::from(plan.promote);
            renewals += usize::from(plan.renew);
            drops += usize::from(plan.drop_retired);
            seen.add_next |= plan.add_next;
        }
        assert!(seen.add_next);
        assert_eq!(promotions, 3, "the CA rotated on days 60, 120 and 180");
        assert_eq!(drops, 3, "each retired CA left the bundle");
        assert!(renewals >= 9, "{renewals}");
        assert!(pem_blocks(&pki.bundle()).len() <= 2);
    }

    #[test]
    fn a_ca_not_yet_in_the_apiservice_never_signs() {
        let s = settings();
        let mut pki = Pki::issue(&s, at(0)).unwrap();
        let published = pki.bundle();
        // The APIService is not updated (its patch fails) from day 55 on.
        let mut now = at(55);
        while now < at(89) {
            now += 6 * HOUR;
            let next_published = pki
                .next
                .as_ref()
                .is_some_and(|n| holds(published.as_bytes(), &n.cert));
            let plan = decide(Some(&pki.facts(&s, next_published).unwrap()), now);
            assert!(!plan.promote, "{now:?}");
            pki = pki.rotate(plan, &s, now).unwrap();
            trusts(&published, &pki.serving.cert, now).unwrap();
        }
        assert!(pki.next.is_some());
    }

    fn keeper(client: kube::Client, tls: Arc<ServingTls>) -> Keeper {
        Keeper::new(
            Api::namespaced(client.clone(), NAMESPACE),
            SECRET.into(),
            Some((Api::all(client), API_SERVICE.into())),
            settings(),
            tls,
        )
    }

    async fn serving_tls(server: &FakeApiServer) -> Arc<ServingTls> {
        cosmosq_queue::cosmos::tls::install_crypto_provider();
        Arc::new(
            ServingTls::load(
                crate::tls::Source::Secret {
                    secrets: Box::new(Api::namespaced(server.client(), NAMESPACE)),
                    name: SECRET.into(),
                },
                server.client(),
            )
            .await
            .unwrap(),
        )
    }

    fn apiservice() -> APIService {
        serde_json::from_value(json!({
            "apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
            "metadata": {"name": API_SERVICE},
            "spec": {"group": "external.metrics.k8s.io", "version": "v1beta1",
                     "groupPriorityMinimum": 100, "versionPriority": 100,
                     "service": {"name": "cosmosq-external-metrics", "namespace": NAMESPACE, "port": 443}}
        }))
        .unwrap()
    }

    /// The first round issues and writes only `spec.caBundle` of the one APIService, with its
    /// own field manager; the certificate is served at once.
    #[tokio::test]
    async fn the_first_round_issues_and_patches_only_the_ca_bundle() {
        let cluster = FakeApiServer::new();
        let tls = serving_tls(&cluster).await;
        assert!(
            tls.current().is_none(),
            "nothing to serve before the leader issues"
        );
        let (client, mut api) = testing::client();
        // The keeper talks to the mock; the listener reads the in-memory cluster, which gets
        // what the keeper writes.
        let keeper = keeper(client, tls.clone());
        let cluster_secrets: Api<Secret> = Api::namespaced(cluster.client(), NAMESPACE);
        let round = tokio::spawn(async move { keeper.round(at(0)).await });
        api.answer(
            Method::GET,
            &format!("/api/v1/namespaces/{NAMESPACE}/secrets/{SECRET}"),
            not_found(),
        )
        .await;
        api.answer(
            Method::GET,
            &format!("/apis/apiregistration.k8s.io/v1/apiservices/{API_SERVICE}"),
            json_response(StatusCode::OK, &serde_json::to_value(apiservice()).unwrap()),
        )
        .await;
        let created = api
            .expect(
                Method::POST,
                &format!("/api/v1/namespaces/{NAMESPACE}/secrets"),
            )
            .await;
        let secret: Secret = serde_json::from_value(created.body.clone()).unwrap();
        cluster_secrets
            .create(&PostParams::default(), &secret)
            .await
            .unwrap();
        created
            .send
            .send_response(json_response(StatusCode::CREATED, &created.body));
        let patch = api
            .expect(
                Method::PATCH,
                &format!("/apis/apiregistration.k8s.io/v1/apiservices/{API_SERVICE}"),
            )
            .await;
        assert!(patch.content_type.starts_with("application/apply-patch"));
        assert!(
            patch
                .query
                .contains("fieldManager=cosmosq-operator-ca-bundle")
                && patch.query.contains("force=true"),
            "{}",
            patch.query
        );
        let data = secret.data.unwrap();
        let bundle = &data[keys::TRUSTED].0;
        assert_eq!(
            patch.body,
            json!({"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
                   "metadata": {"name": API_SERVICE},
                   "spec": {"caBundle": ByteString(bundle.clone())}}),
            "only the CA bundle"
        );
        patch
            .send
            .send_response(json_response(StatusCode::OK, &patch.body));
        round.await.unwrap().unwrap();
        assert_eq!(
            secret.metadata.labels.unwrap()["app.kubernetes.io/managed-by"],
            "cosmosq-operator"
        );
        assert!(tls.current().is_some(), "served once written");
    }

    /// Rounds in a cluster: the second reuses what the first wrote (no write), a replica
    /// that read before another wrote loses the race (no overwrite), and the listener serves
    /// what the Secret holds to a client trusting the APIService's bundle.
    #[tokio::test]
    async fn replicas_share_one_certificate_and_one_writer_wins() {
        let cluster = FakeApiServer::new();
        let apiservices: Api<APIService> = Api::all(cluster.client());
        apiservices
            .create(&PostParams::default(), &apiservice())
            .await
            .unwrap();
        let tls = serving_tls(&cluster).await;
        let leader = keeper(cluster.client(), tls.clone());
        leader.round(SystemTime::now()).await.unwrap();
        let secrets: Api<Secret> = Api::namespaced(cluster.client(), NAMESPACE);
        let stored = secrets.get(SECRET).await.unwrap();
        let bundle = apiservices
            .get(API_SERVICE)
            .await
            .unwrap()
            .spec
            .unwrap()
            .ca_bundle
            .unwrap();
        assert_eq!(bundle, stored.data.as_ref().unwrap()[keys::TRUSTED]);

        let writes = |log: &BTreeMap<String, u64>| {
            log.iter()
                .filter(|(k, _)| !k.starts_with("GET"))
                .map(|(k, v)| (k.clone(), *v))
                .collect::<Vec<_>>()
        };
        let before = writes(&cluster.requests());
        leader.round(SystemTime::now()).await.unwrap();
        assert_eq!(
            writes(&cluster.requests()),
            before,
            "reused: nothing written"
        );

        // A second replica, which read the Secret before the leader wrote it (or its old
        // version), writes nothing over it.
        let other = keeper(cluster.client(), serving_tls(&cluster).await);
        let theirs = Pki::issue(&settings(), SystemTime::now()).unwrap();
        assert!(
            !other.write(None, &theirs).await.unwrap(),
            "create lost the race"
        );
        let stale = Secret {
            metadata: kube::api::ObjectMeta {
                resource_version: Some("1".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        assert!(
            !other.write(Some(stale), &theirs).await.unwrap(),
            "replace lost the race"
        );
        assert_eq!(secrets.get(SECRET).await.unwrap().data, stored.data);

        // What a replica serves: the Secret's certificate, trusted by the APIService's bundle.
        let listener = crate::http::bind(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .unwrap();
        let port = listener.local_addr().unwrap().port();
        let shutdown = CancellationToken::new();
        let router = axum::Router::new().route("/", axum::routing::get(|| async { "served" }));
        tokio::spawn(crate::http::serve_tls(
            listener,
            router,
            tls.clone(),
            shutdown.clone(),
        ));
        let https = cosmosq_queue::cosmos::tls::http_client_builder()
            .tls_backend_preconfigured(cosmosq_testkit::pki::client_config(
                std::str::from_utf8(&bundle.0).unwrap(),
                None,
            ))
            .resolve(HOST, std::net::SocketAddr::from(([127, 0, 0, 1], port)))
            .build()
            .unwrap();
        let answer = https
            .get(format!("https://{HOST}:{port}/"))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.text().await.unwrap(), "served");
        shutdown.cancel();
    }
}
