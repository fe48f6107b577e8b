//! Leader election on a `coordination.k8s.io/v1` Lease, with client-go's semantics: the holder
//! renews every `retry` period; every write carries the resourceVersion it read, so two
//! candidates can never both win; a leader that cannot renew within the renew deadline stops
//! acting (the process exits and Kubernetes restarts it as a candidate); a graceful shutdown
//! releases the lease so a standby takes over at once.
//!
//! Expiry is judged as client-go judges it: by when *this* replica last saw the record change
//! (its own monotonic clock), plus the record's duration. The holder's `renewTime` is written
//! by another node's clock and is never compared with ours, so clock skew between nodes can
//! neither let two replicas lead nor keep a dead leader's lease alive.

use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::Api;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

#[derive(Debug, thiserror::Error)]
enum AttemptError {
    #[error(transparent)]
    Api(#[from] kube::Error),
    #[error("no answer within {0:?}")]
    TimedOut(Duration),
}

/// How leading ends.
#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    /// Renewals failed past the renew deadline.
    #[error("lost the leader lease {0}: could not renew it within the renew deadline")]
    Lost(String),
    /// The operator is stopping.
    #[error("shutting down")]
    Cancelled,
}

/// What a candidate should do with the lease it read (pure).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseAction {
    /// Free, released or expired: take it.
    Acquire,
    /// Ours: renew it.
    Renew,
    /// Someone else holds it and it is fresh.
    Wait {
        /// The Lease's `holderIdentity`.
        holder: String,
    },
}

/// The last record this replica saw, and when (by its own clock) it first saw it.
#[derive(Clone, Debug, PartialEq)]
pub struct Observed {
    /// The record, or `None` when there was no Lease.
    pub record: Option<LeaseSpec>,
    /// When this replica first saw it (its own monotonic clock).
    pub at: Instant,
}

/// Judges the record just read against what was observed before; returns the verdict and
/// what is observed now. A record that changed restarts the expiry clock; one unchanged for
/// its `leaseDurationSeconds` (or `default_duration`) has expired.
pub fn verdict(
    observed: Option<&Observed>,
    read: Option<&LeaseSpec>,
    me: &str,
    now: Instant,
    default_duration: Duration,
) -> (LeaseAction, Observed) {
    let at = match observed {
        Some(o) if o.record.as_ref() == read => o.at,
        _ => now,
    };
    let seen = Observed {
        record: read.cloned(),
        at,
    };
    let holder = read
        .and_then(|r| r.holder_identity.clone())
        .unwrap_or_default();
    let verdict = if holder.is_empty() {
        LeaseAction::Acquire
    } else if holder == me {
        LeaseAction::Renew
    } else {
        let duration = read
            .and_then(|r| r.lease_duration_seconds)
            .and_then(|s| u64::try_from(s).ok())
            .map_or(default_duration, Duration::from_secs);
        if now >= at + duration {
            LeaseAction::Acquire
        } else {
            LeaseAction::Wait { holder }
        }
    };
    (verdict, seen)
}

/// Writes of the Lease carry the operator's field manager, as every write does.
fn post_params() -> PostParams {
    PostParams {
        field_manager: Some(crate::apply::FIELD_MANAGER.into()),
        ..PostParams::default()
    }
}

/// How leader election runs.
#[derive(Clone, Debug)]
pub struct ElectionSettings {
    /// The coordination Lease's name.
    pub lease_name: String,
    /// This replica's identity in it.
    pub identity: String,
    /// How long a lease is valid after its last renewal (client-go: 15 s).
    pub lease_duration: Duration,
    /// How long the leader keeps trying to renew before it gives up (client-go: 10 s).
    pub renew_deadline: Duration,
    /// How often candidates retry and the leader renews (client-go: 2 s).
    pub retry_period: Duration,
}

impl ElectionSettings {
    /// Settings with client-go's timings.
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

/// Leader election on a coordination Lease, as client-go does it.
pub struct LeaderElection {
    api: Api<Lease>,
    settings: ElectionSettings,
    observed: Mutex<Option<Observed>>,
}

impl LeaderElection {
    /// Election on the Lease `api` holds.
    pub fn new(api: Api<Lease>, settings: ElectionSettings) -> Self {
        Self {
            api,
            settings,
            observed: Mutex::new(None),
        }
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
        let (verdict, seen) = {
            let observed = self.observed.lock().expect("observed lease");
            verdict(
                observed.as_ref(),
                spec,
                &self.settings.identity,
                Instant::now(),
                self.settings.lease_duration,
            )
        };
        *self.observed.lock().expect("observed lease") = Some(seen);
        let result = match verdict {
            LeaseAction::Wait { .. } => return Ok(false),
            LeaseAction::Acquire | LeaseAction::Renew => match existing {
                None => {
                    let lease = Lease {
                        metadata: ObjectMeta {
                            name: Some(name.clone()),
                            ..ObjectMeta::default()
                        },
                        spec: Some(self.spec(None, now)),
                    };
                    self.api.create(&post_params(), &lease).await
                }
                Some(mut lease) => {
                    // The resourceVersion read above makes this write conditional.
                    lease.spec = Some(self.spec(lease.spec.as_ref(), now));
                    self.api.replace(name, &post_params(), &lease).await
                }
            },
        };
        match result {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// One attempt that gives up after `limit` (a hung request must not outlast the deadline).
    async fn attempt(&self, limit: Duration) -> Result<bool, AttemptError> {
        match tokio::time::timeout(limit, self.try_once()).await {
            Ok(result) => result.map_err(AttemptError::Api),
            Err(_) => Err(AttemptError::TimedOut(limit)),
        }
    }

    /// Waits until this candidate leads.
    pub async fn acquire(&self, shutdown: &CancellationToken) -> Result<(), LeaderError> {
        let mut waiting_logged = false;
        loop {
            match self.attempt(self.settings.renew_deadline).await {
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
        let mut last_renewed = Instant::now();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return LeaderError::Cancelled,
                _ = tokio::time::sleep(self.settings.retry_period) => {}
            }
            // Each renewal may take only what is left of the deadline.
            let left = self
                .settings
                .renew_deadline
                .saturating_sub(last_renewed.elapsed())
                .max(Duration::from_millis(1));
            match self.attempt(left).await {
                Ok(true) => last_renewed = Instant::now(),
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
        match self.api.replace(name, &post_params(), &lease).await {
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
    use k8s_openapi::jiff::SignedDuration;
    use serde_json::json;

    const LEASE: &str = "/apis/coordination.k8s.io/v1/namespaces/cosmosq/leases/cosmosq-operator";
    const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/cosmosq/leases";

    fn held_by(holder: &str, renewed: i64) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(holder.into()),
            lease_duration_seconds: Some(15),
            renew_time: Some(MicroTime(
                Timestamp::from_second(1_800_000_000 + renewed).unwrap(),
            )),
            ..LeaseSpec::default()
        }
    }

    #[test]
    fn verdicts_follow_the_local_clock_not_the_holders() {
        let t0 = Instant::now();
        let secs = |s: u64| t0 + Duration::from_secs(s);
        let default = Duration::from_secs(15);
        let wait = LeaseAction::Wait { holder: "b".into() };
        let seen = |record: LeaseSpec, at: u64| Observed {
            record: Some(record),
            at: secs(at),
        };
        // (observed before, read now, now) -> verdict, and when the read was first seen.
        for (observed, read, now, expected, first_seen) in [
            (None, None, 0, LeaseAction::Acquire, 0),
            (None, Some(LeaseSpec::default()), 0, LeaseAction::Acquire, 0), // released
            (None, Some(held_by("a", 0)), 100, LeaseAction::Renew, 100),    // ours, even if late
            // First sight of someone else's record: fresh, whatever its renewTime says (a
            // holder whose clock runs an hour behind is not taken over).
            (None, Some(held_by("b", -3600)), 5, wait.clone(), 5),
            // Unchanged for less than its duration: fresh; for its duration: expired.
            (
                Some(seen(held_by("b", 0), 5)),
                Some(held_by("b", 0)),
                19,
                wait.clone(),
                5,
            ),
            (
                Some(seen(held_by("b", 0), 5)),
                Some(held_by("b", 0)),
                20,
                LeaseAction::Acquire,
                5,
            ),
            // Renewed (changed) since: the clock restarts, whatever renewTime says.
            (
                Some(seen(held_by("b", 0), 5)),
                Some(held_by("b", -7200)),
                30,
                wait.clone(),
                30,
            ),
            // The record's own duration counts.
            (
                Some(seen(
                    LeaseSpec {
                        lease_duration_seconds: Some(60),
                        ..held_by("b", 0)
                    },
                    0,
                )),
                Some(LeaseSpec {
                    lease_duration_seconds: Some(60),
                    ..held_by("b", 0)
                }),
                59,
                wait.clone(),
                0,
            ),
        ] {
            let (verdict, now_seen) =
                verdict(observed.as_ref(), read.as_ref(), "a", secs(now), default);
            assert_eq!(
                verdict, expected,
                "{read:?} at {now}, observed {observed:?}"
            );
            assert_eq!(now_seen.at, secs(first_seen), "{read:?} at {now}");
        }
    }

    fn election(client: kube::Client) -> LeaderElection {
        LeaderElection::new(
            Api::namespaced(client, "cosmosq"),
            ElectionSettings::new("cosmosq-operator", "pod-a"),
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

    #[tokio::test(start_paused = true)]
    async fn a_lease_unchanged_for_its_duration_is_taken_over_conditionally() {
        let (client, mut server) = client();
        // Its renewTime is far in the future (the holder's clock runs ahead): irrelevant.
        let stale = lease_json(
            "pod-b",
            Timestamp::now() + SignedDuration::from_secs(3600),
            "7",
        );
        let verifier = tokio::spawn(async move {
            for _ in 0..2 {
                server
                    .answer(Method::GET, LEASE, json_response(StatusCode::OK, &stale))
                    .await;
            }
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
        let election = election(client);
        // First sight: fresh, however its times read.
        assert!(!election.try_once().await.unwrap());
        // Unchanged for the lease's 15 s by this replica's clock: expired.
        tokio::time::advance(Duration::from_secs(15)).await;
        assert!(!election.try_once().await.unwrap());
        verifier.await.unwrap();
    }

    /// Holds the lease while the API server answers every request with `answer` (or never,
    /// for `None`); returns how long the leader held on before it gave up.
    async fn held_while_the_api_server(answer: Option<StatusCode>) -> Duration {
        let (client, mut server) = client();
        let verifier = tokio::spawn(async move {
            let mut pending = Vec::new();
            loop {
                let seen = server.next().await;
                match answer {
                    Some(code) => seen.send.send_response(json_response(
                        code,
                        &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                "reason": "ServiceUnavailable", "code": code.as_u16(),
                                "message": "down"}),
                    )),
                    None => pending.push(seen.send),
                }
            }
        });
        let started = Instant::now();
        let outcome = election(client).hold(&CancellationToken::new()).await;
        verifier.abort();
        assert!(matches!(outcome, LeaderError::Lost(_)), "{outcome}");
        started.elapsed()
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_that_cannot_renew_gives_up_after_the_deadline() {
        // Every renewal fails (the API server is unavailable), or hangs: either way the leader
        // stops acting at the renew deadline, never later.
        for answer in [Some(StatusCode::SERVICE_UNAVAILABLE), None] {
            let held = held_while_the_api_server(answer).await;
            assert!(
                held >= Duration::from_secs(10) && held < Duration::from_secs(13),
                "{answer:?}: {held:?}"
            );
        }
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
