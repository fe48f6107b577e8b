//! `cosmosq-operator check`: what the chart's `helm test` runs, from the operator's own image
//! (no other image to pull or mirror). It passes when the CRDs are established (the API server
//! serves the kinds), every replica of the operator's Deployment runs its current template and
//! one is ready (the kubelet's readiness probe got an answer from `/readyz`), and a leader
//! renewed the leader Lease while the check watched (an operator that acts, not only one that
//! runs). The conditions are awaited in turn, all within `--timeout`; a failure names the
//! condition and what was seen last.
//!
//! The decisions are pure (`crd_established`, `deployment_ready`, `lease_renewed`); `run`
//! does the reads.

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::{Api, Client};

/// The kinds the operator serves, by CRD name.
pub const CRDS: [&str; 2] = ["cosmosqueues.cosmosq.io", "queueconsumergroups.cosmosq.io"];

fn duration(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if d < Duration::from_secs(5) {
        return Err("at least 5s (a leader renews every few seconds)".into());
    }
    Ok(d)
}

/// What `check` looks at (the chart's test hook sets them).
#[derive(clap::Args, Clone, Debug)]
pub struct CheckArgs {
    /// The operator's namespace (its Deployment and leader Lease).
    #[arg(long, env = "POD_NAMESPACE", default_value = "cosmosq-system")]
    pub namespace: String,
    /// The operator's Deployment.
    #[arg(long, default_value = "cosmosq-operator")]
    pub deployment: String,
    /// The leader Lease (the operator's --lease-name).
    #[arg(long, default_value = "cosmosq-operator")]
    pub lease_name: String,
    /// How long all the conditions together may take to hold (keep it under `helm test
    /// --timeout`, 5 minutes by default, so that the check's own message is what fails).
    #[arg(long, default_value = "120s", value_parser = duration)]
    pub timeout: Duration,
}

/// Why the check failed.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// A read the check needs was refused or failed (RBAC, a missing object's 404 is not one).
    #[error("reading {what}: {source}")]
    Read {
        /// What was being read.
        what: String,
        /// The API server's answer.
        #[source]
        source: kube::Error,
    },
    /// A condition did not hold within the timeout.
    #[error("{condition} within {timeout:?}: {seen}")]
    NotMet {
        /// The condition.
        condition: String,
        /// How long it was awaited.
        timeout: Duration,
        /// What was seen last.
        seen: String,
    },
}

/// Whether a CRD's kinds are served: its `Established` condition is `True`.
pub fn crd_established(crd: &CustomResourceDefinition) -> Result<(), String> {
    let conditions = crd
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default();
    match conditions.iter().find(|c| c.type_ == "Established") {
        Some(c) if c.status == "True" => Ok(()),
        Some(c) => Err(format!(
            "Established is {}{}",
            c.status,
            c.message
                .as_deref()
                .map(|m| format!(" ({m})"))
                .unwrap_or_default()
        )),
        None => Err("no Established condition yet".into()),
    }
}

/// Whether every replica of the Deployment runs its current template and one is ready and
/// available: the kubelet's readiness probe (`/readyz`) answered.
pub fn deployment_ready(deployment: &Deployment) -> Result<(), String> {
    let status = deployment.status.clone().unwrap_or_default();
    let observed = status.observed_generation.unwrap_or(0);
    let generation = deployment.metadata.generation.unwrap_or(0);
    let ready = status.ready_replicas.unwrap_or(0);
    let updated = status.updated_replicas.unwrap_or(0);
    let available = status.available_replicas.unwrap_or(0);
    let replicas = status.replicas.unwrap_or(0);
    if observed < generation {
        return Err(format!(
            "the Deployment controller has not seen generation {generation} yet"
        ));
    }
    // Mid-rollout an old ready pod beside a new unready one would pass a looser test.
    if updated < replicas {
        return Err(format!(
            "{updated} of {replicas} replicas run the current template (a rollout in progress)"
        ));
    }
    if ready < 1 || available < 1 {
        return Err(format!(
            "{ready} ready of {replicas} replicas (pods not running or not answering /readyz)"
        ));
    }
    Ok(())
}

/// Whether the leader renewed the Lease between two reads: a holder is named and the record
/// changed (its renew time). Judged by change, not by comparing the holder's clock with ours.
pub fn lease_renewed(first: &Lease, now: &Lease) -> Result<String, String> {
    let spec = now.spec.clone().unwrap_or_default();
    let Some(holder) = spec.holder_identity.filter(|h| !h.is_empty()) else {
        return Err("no leader holds it".into());
    };
    let before = first.spec.as_ref().and_then(|s| s.renew_time.clone());
    if spec.renew_time.is_some() && spec.renew_time != before {
        Ok(holder)
    } else {
        Err(format!("{holder} holds it but has not renewed it"))
    }
}

/// Polls `read` every second until `decide` accepts what it returns or the deadline passes.
/// A failed read (a 429, a 5xx, a 403 while the hook's RoleBinding propagates) is tried again;
/// the last one is the answer when time runs out.
async fn await_condition<T, R, F>(
    condition: &str,
    (deadline, timeout): (tokio::time::Instant, Duration),
    mut read: impl FnMut() -> F,
    mut decide: impl FnMut(Option<&T>) -> Result<R, String>,
) -> Result<R, CheckError>
where
    F: std::future::Future<Output = Result<Option<T>, CheckError>>,
{
    loop {
        let failure = match read().await {
            Ok(seen) => match decide(seen.as_ref()) {
                Ok(result) => return Ok(result),
                Err(seen) => CheckError::NotMet {
                    condition: condition.to_owned(),
                    timeout,
                    seen,
                },
            },
            Err(error) => error,
        };
        if tokio::time::Instant::now() >= deadline {
            return Err(failure);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

async fn get_opt<K>(api: &Api<K>, name: &str, what: &str) -> Result<Option<K>, CheckError>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.get_opt(name).await.map_err(|source| CheckError::Read {
        what: what.to_owned(),
        source,
    })
}

/// Runs the checks in order; returns one line per condition that held.
pub async fn run(client: Client, args: &CheckArgs) -> Result<Vec<String>, CheckError> {
    let mut passed = Vec::new();
    let within = (tokio::time::Instant::now() + args.timeout, args.timeout);
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for name in CRDS {
        let what = format!("CustomResourceDefinition {name}");
        await_condition(
            &format!("{what} established"),
            within,
            || get_opt(&crds, name, &what),
            |crd| crd.map_or(Err("not found".into()), crd_established),
        )
        .await?;
        passed.push(format!("{what} is established"));
    }

    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &args.namespace);
    let what = format!("Deployment {}/{}", args.namespace, args.deployment);
    await_condition(
        &format!("{what} ready"),
        within,
        || get_opt(&deployments, &args.deployment, &what),
        |d| d.map_or(Err("not found".into()), deployment_ready),
    )
    .await?;
    passed.push(format!("{what} has a ready replica"));

    let leases: Api<Lease> = Api::namespaced(client, &args.namespace);
    let what = format!("Lease {}/{}", args.namespace, args.lease_name);
    let mut first: Option<Lease> = None;
    let holder = await_condition(
        &format!("{what} renewed by a leader"),
        within,
        || get_opt(&leases, &args.lease_name, &what),
        |lease| {
            let lease = lease.ok_or_else(|| "not found".to_owned())?;
            let start = first.get_or_insert_with(|| lease.clone());
            lease_renewed(start, lease)
        },
    )
    .await?;
    passed.push(format!("{what} is held and renewed by {holder}"));
    Ok(passed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn crd(conditions: serde_json::Value) -> CustomResourceDefinition {
        serde_json::from_value(json!({
            "metadata": {"name": "cosmosqueues.cosmosq.io"},
            "spec": {"group": "cosmosq.io", "scope": "Namespaced",
                     "names": {"plural": "cosmosqueues", "kind": "CosmosQueue"}, "versions": []},
            "status": {"conditions": conditions}
        }))
        .unwrap()
    }

    fn deployment(generation: i64, status: serde_json::Value) -> Deployment {
        serde_json::from_value(json!({
            "metadata": {"name": "cosmosq", "generation": generation},
            "status": status
        }))
        .unwrap()
    }

    fn lease(holder: Option<&str>, renewed: Option<&str>) -> Lease {
        serde_json::from_value(json!({
            "metadata": {"name": "cosmosq"},
            "spec": {"holderIdentity": holder, "renewTime": renewed}
        }))
        .unwrap()
    }

    #[test]
    fn a_crd_counts_once_the_api_server_says_established() {
        let names = |status: &str| {
            json!([{"type": "NamesAccepted", "status": "True"},
                   {"type": "Established", "status": status, "message": "installing"}])
        };
        assert!(crd_established(&crd(names("True"))).is_ok());
        let not = crd_established(&crd(names("False"))).unwrap_err();
        assert!(not.contains("False") && not.contains("installing"), "{not}");
        assert!(crd_established(&crd(json!([]))).is_err());
    }

    #[test]
    fn a_deployment_counts_with_a_ready_replica_of_its_current_generation() {
        let ready = json!({"observedGeneration": 2, "replicas": 1, "readyReplicas": 1,
                           "availableReplicas": 1, "updatedReplicas": 1});
        assert!(deployment_ready(&deployment(2, ready.clone())).is_ok());
        // Pods Pending (no node), or running but not answering /readyz.
        let pending = json!({"observedGeneration": 2, "replicas": 1, "updatedReplicas": 1});
        let why = deployment_ready(&deployment(2, pending)).unwrap_err();
        assert!(why.contains("0 ready"), "{why}");
        // A new spec the controller has not rolled yet: the old replica does not count.
        assert!(deployment_ready(&deployment(3, ready)).is_err());
        // Mid-rollout: the old pod ready, the new one not.
        let rolling = json!({"observedGeneration": 2, "replicas": 2, "readyReplicas": 1,
                             "availableReplicas": 1, "updatedReplicas": 1});
        let why = deployment_ready(&deployment(2, rolling)).unwrap_err();
        assert!(why.contains("rollout"), "{why}");
        assert!(deployment_ready(&deployment(1, json!(null))).is_err());
    }

    #[test]
    fn a_lease_counts_when_its_holder_renews_it_while_watched() {
        let first = lease(Some("op-0"), Some("2026-12-05T10:00:00.000000Z"));
        let later = lease(Some("op-0"), Some("2026-12-05T10:00:02.000000Z"));
        assert_eq!(lease_renewed(&first, &later), Ok("op-0".into()));
        // A dead leader's record does not change, however recent its time looks.
        assert!(lease_renewed(&first, &first).is_err());
        // Released (graceful shutdown) or never held.
        assert!(lease_renewed(&first, &lease(None, Some("2026-12-05T10:00:03.000000Z"))).is_err());
        assert!(lease_renewed(&first, &lease(Some(""), None)).is_err());
    }
}
