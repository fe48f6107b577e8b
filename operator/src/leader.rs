//! Leader election on a `coordination.k8s.io/v1` Lease, with client-go's semantics: the holder
//! renews every `retry` period; others take the lease only once `renewTime +
//! leaseDurationSeconds` has passed; every write carries the resourceVersion it read, so two
//! candidates can never both win; a leader that cannot renew within the renew deadline stops
//! acting (the process exits and Kubernetes restarts it as a candidate); a graceful shutdown
//! releases the lease so a standby takes over at once.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::PostParams;
use kube::Api;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    #[error("lost the leader lease {0}: could not renew it within the renew deadline")]
    Lost(String),
    #[error("shutting down")]
    Cancelled,
}

/// What a candidate should do with the lease it read (pure).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Free, released or expired: take it.
    Acquire,
    /// Ours: renew it.
    Renew,
    /// Someone else holds it and it is fresh.
    Wait { holder: String },
}

pub fn verdict(spec: Option<&LeaseSpec>, me: &str, now: Timestamp) -> Verdict {
    let Some(spec) = spec else {
        return Verdict::Acquire;
    };
    let holder = spec.holder_identity.clone().unwrap_or_default();
    if holder.is_empty() {
        return Verdict::Acquire;
    }
    if holder == me {
        return Verdict::Renew;
    }
    let expires = spec.renew_time.as_ref().map(|t| {
        t.0 + SignedDuration::from_secs(i64::from(spec.lease_duration_seconds.unwrap_or(0)))
    });
    match expires {
        Some(expires) if expires > now => Verdict::Wait { holder },
        _ => Verdict::Acquire,
    }
}

#[derive(Clone, Debug)]
pub struct Settings {
    pub lease_name: String,
    pub identity: String,
    /// How long a lease is valid after its last renewal (client-go: 15 s).
    pub lease_duration: Duration,
    /// How long the leader keeps trying to renew before it gives up (client-go: 10 s).
    pub renew_deadline: Duration,
    /// How often candidates retry and the leader renews (client-go: 2 s).
    pub retry_period: Duration,
}

impl Settings {
    pub fn new(lease_name: impl Into<String>, identity: impl Into<String>) -> Self {
        Self {
            lease_name: lease_name.into(),
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

pub struct LeaderElection {
    api: Api<Lease>,
    settings: Settings,
}

impl LeaderElection {
    pub fn new(api: Api<Lease>, settings: Settings) -> Self {
        Self { api, settings }
    }

    fn spec(&self, previous: Option<&LeaseSpec>, now: Timestamp) -> LeaseSpec {
        let me = &self.settings.identity;
        let ours = previous.and_then(|p| p.holder_identity.as_deref()) == Some(me.as_str());
        let transitions = previous.and_then(|p| p.lease_transitions).unwrap_or(0);
        LeaseSpec {
            holder_identity: Some(me.clone()),
            lease_duration_seconds: Some(self.settings.lease_duration.as_secs().max(1) as i32),
            acquire_time: if ours {
                previous.and_then(|p| p.acquire_time.clone())
            } else {
                Some(MicroTime(now))
            },
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(if ours || previous.is_none() {
                transitions
            } else {
                transitions + 1
            }),
            ..LeaseSpec::default()
        }
    }

    /// One attempt to acquire or renew; `Ok(true)` while we lead. A conflict (someone else
    /// wrote first) is a lost race, not an error.
    pub async fn try_once(&self) -> Result<bool, kube::Error> {
        let now = Timestamp::now();
        let name = &self.settings.lease_name;
        let existing = self.api.get_opt(name).await?;
        let spec = existing.as_ref().and_then(|l| l.spec.as_ref());
        let result = match verdict(spec, &self.settings.identity, now) {
            Verdict::Wait { .. } => return Ok(false),
            Verdict::Acquire | Verdict::Renew => match existing {
                None => {
                    let lease = Lease {
                        metadata: ObjectMeta {
                            name: Some(name.clone()),
                            ..ObjectMeta::default()
                        },
                        spec: Some(self.spec(None, now)),
                    };
                    self.api.create(&PostParams::default(), &lease).await
                }
                Some(mut lease) => {
                    // The resourceVersion read above makes this write conditional.
                    lease.spec = Some(self.spec(lease.spec.as_ref(), now));
                    self.api.replace(name, &PostParams::default(), &lease).await
                }
            },
        };
        match result {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Waits until this candidate leads.
    pub async fn acquire(&self, shutdown: &CancellationToken) -> Result<(), LeaderError> {
        let mut waiting_logged = false;
        loop {
            match self.try_once().await {
                Ok(true) => {
                    info!(lease = %self.settings.lease_name, identity = %self.settings.identity, "leading");
                    return Ok(());
                }
                Ok(false) if !waiting_logged => {
                    info!(lease = %self.settings.lease_name, "another replica leads; standing by");
                    waiting_logged = true;
                }
                Ok(false) => {}
                Err(e) => warn!(lease = %self.settings.lease_name, error = %e, "leader election"),
            }
            tokio::select! {
                _ = shutdown.cancelled() => return Err(LeaderError::Cancelled),
                _ = tokio::time::sleep(self.settings.retry_period) => {}
            }
        }
    }

    /// Renews while leading; returns `Lost` once a renewal has not succeeded for the renew
    /// deadline, or `Cancelled` on shutdown.
    pub async fn hold(&self, shutdown: &CancellationToken) -> LeaderError {
        let mut last_renewed = tokio::time::Instant::now();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return LeaderError::Cancelled,
                _ = tokio::time::sleep(self.settings.retry_period) => {}
            }
            match self.try_once().await {
                Ok(true) => last_renewed = tokio::time::Instant::now(),
                Ok(false) => {
                    // Someone else holds it now: stop at once.
                    return LeaderError::Lost(self.settings.lease_name.clone());
                }
                Err(e) => {
                    warn!(lease = %self.settings.lease_name, error = %e, "could not renew the leader lease")
                }
            }
            if last_renewed.elapsed() >= self.settings.renew_deadline {
                return LeaderError::Lost(self.settings.lease_name.clone());
            }
        }
    }

    /// Gives the lease up (graceful shutdown), so a standby need not wait for it to expire.
    pub async fn release(&self) {
        let name = &self.settings.lease_name;
        let Ok(Some(mut lease)) = self.api.get_opt(name).await else {
            return;
        };
        let ours = lease
            .spec
            .as_ref()
            .and_then(|s| s.holder_identity.as_deref())
            == Some(self.settings.identity.as_str());
        if !ours {
            return;
        }
        if let Some(spec) = lease.spec.as_mut() {
            spec.holder_identity = None;
            spec.lease_duration_seconds = Some(1);
            spec.renew_time = Some(MicroTime(Timestamp::now()));
        }
        match self.api.replace(name, &PostParams::default(), &lease).await {
            Ok(_) => info!(lease = %name, "released the leader lease"),
            Err(e) => {
                warn!(lease = %name, error = %e, "could not release the leader lease; it expires on its own")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{client, json_response, not_found};
    use http::{Method, StatusCode};
    use serde_json::json;

    const LEASE: &str = "/apis/coordination.k8s.io/v1/namespaces/cosmosq/leases/cosmosq-operator";
    const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/cosmosq/leases";

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).unwrap()
    }

    fn held_by(holder: &str, renewed: i64) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(holder.into()),
            lease_duration_seconds: Some(15),
            renew_time: Some(MicroTime(at(renewed))),
            ..LeaseSpec::default()
        }
    }

    #[test]
    fn verdicts() {
        let wait = Verdict::Wait { holder: "b".into() };
        for (spec, now, expected) in [
            (None, 0, Verdict::Acquire),
            (Some(LeaseSpec::default()), 0, Verdict::Acquire), // released
            (Some(held_by("a", 0)), 100, Verdict::Renew),      // ours, even if late
            (Some(held_by("b", 0)), 14, wait.clone()),         // fresh
            (Some(held_by("b", 0)), 15, Verdict::Acquire),     // expired
            (
                Some(LeaseSpec {
                    renew_time: None,
                    ..held_by("b", 0)
                }),
                0,
                Verdict::Acquire,
            ),
        ] {
            assert_eq!(
                verdict(spec.as_ref(), "a", at(now)),
                expected,
                "{spec:?} at {now}"
            );
        }
    }

    fn election(client: kube::Client) -> LeaderElection {
        LeaderElection::new(
            Api::namespaced(client, "cosmosq"),
            Settings::new("cosmosq-operator", "pod-a"),
        )
    }

    fn lease_json(holder: &str, renewed: Timestamp, version: &str) -> serde_json::Value {
        json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
               "metadata": {"name": "cosmosq-operator", "namespace": "cosmosq", "resourceVersion": version},
               "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15,
                        "renewTime": MicroTime(renewed), "leaseTransitions": 2}})
    }

    #[tokio::test]
    async fn a_missing_lease_is_created_and_held() {
        let (client, mut server) = client();
        let verifier = tokio::spawn(async move {
            server.answer(Method::GET, LEASE, not_found()).await;
            let seen = server.expect(Method::POST, LEASES).await;
            assert_eq!(seen.body["spec"]["holderIdentity"], "pod-a");
            assert_eq!(seen.body["spec"]["leaseDurationSeconds"], 15);
            seen.send
                .send_response(json_response(StatusCode::CREATED, &seen.body));
        });
        assert!(election(client).try_once().await.unwrap());
        verifier.await.unwrap();
    }

    #[tokio::test]
    async fn a_fresh_lease_of_another_replica_is_left_alone() {
        let (client, mut server) = client();
        let verifier = tokio::spawn(async move {
            let lease = lease_json("pod-b", Timestamp::now(), "7");
            server
                .answer(Method::GET, LEASE, json_response(StatusCode::OK, &lease))
                .await;
            server // no write follows
        });
        let election = election(client);
        assert!(!election.try_once().await.unwrap());
        drop(election);
        verifier.await.unwrap().done().await;
    }

    #[tokio::test]
    async fn an_expired_lease_is_taken_over_conditionally() {
        let (client, mut server) = client();
        let verifier = tokio::spawn(async move {
            let stale = lease_json(
                "pod-b",
                Timestamp::now() - SignedDuration::from_secs(60),
                "7",
            );
            server
                .answer(Method::GET, LEASE, json_response(StatusCode::OK, &stale))
                .await;
            let seen = server.expect(Method::PUT, LEASE).await;
            assert_eq!(
                seen.body["metadata"]["resourceVersion"], "7",
                "a conditional write"
            );
            assert_eq!(seen.body["spec"]["holderIdentity"], "pod-a");
            assert_eq!(seen.body["spec"]["leaseTransitions"], 3);
            // Another candidate wrote first: a lost race, not an error.
            seen.send.send_response(json_response(
                StatusCode::CONFLICT,
                &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                        "reason": "Conflict", "code": 409, "message": "conflict"}),
            ));
        });
        assert!(!election(client).try_once().await.unwrap());
        verifier.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_that_cannot_renew_gives_up_after_the_deadline() {
        let (client, mut server) = client();
        let verifier = tokio::spawn(async move {
            // Every renewal attempt fails: the API server is unavailable.
            loop {
                let seen = server.next().await;
                seen.send.send_response(json_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                            "reason": "ServiceUnavailable", "code": 503, "message": "down"}),
                ));
            }
        });
        let started = tokio::time::Instant::now();
        let outcome = election(client).hold(&CancellationToken::new()).await;
        assert!(matches!(outcome, LeaderError::Lost(_)), "{outcome}");
        let held = started.elapsed();
        assert!(
            held >= Duration::from_secs(10) && held < Duration::from_secs(13),
            "{held:?}"
        );
        verifier.abort();
    }

    #[tokio::test]
    async fn release_hands_the_lease_back() {
        let (client, mut server) = client();
        let verifier = tokio::spawn(async move {
            let ours = lease_json("pod-a", Timestamp::now(), "9");
            server
                .answer(Method::GET, LEASE, json_response(StatusCode::OK, &ours))
                .await;
            let released = server.echo(Method::PUT, LEASE).await;
            assert!(released["spec"].get("holderIdentity").is_none());
            assert_eq!(released["spec"]["leaseDurationSeconds"], 1);
        });
        election(client).release().await;
        verifier.await.unwrap();
    }
}
