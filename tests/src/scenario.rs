//! The operator end to end, as a user drives it: create a queue and a group, enqueue a backlog,
//! watch the Deployment scale, delete both and see the cleanup. It runs against the in-memory
//! API server in every test run and against a real cluster when one is given
//! (`COSMOSQ_E2E_KUBECONFIG`, see `tests/`); it needs no running pods.

use std::time::Duration;

use clap::Parser;
use cosmosq_crds::{CosmosQueue, QueueConsumerGroup};
use cosmosq_queue::{CosmosClient, NewMessage, Queue, QueueConfig};
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::wait::await_condition;
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::health::{argocd, assert_health, kstatus, Kstatus};
pub use cosmosq_emulator::container_exists;
use cosmosq_operator::config::Config;
use cosmosq_operator::cosmos::Backend;
use cosmosq_operator::run::run_with;

pub struct Scenario {
    /// What the user's side (kubectl) uses.
    pub client: Client,
    /// What the operator uses (the same client on a real cluster).
    pub operator_client: Client,
    /// Where the queues live (the emulator).
    pub cosmos: CosmosClient,
    /// Everything is created in this namespace; it must exist.
    pub namespace: String,
    /// The operator's pod, if one exists for it to label.
    pub identity: Option<String>,
    /// The cluster runs kube-controller-manager: also check what its controllers make of the
    /// operator's objects (the Deployment's ReplicaSet). The in-memory API server has none.
    pub controllers: bool,
    /// More operator flags (e.g. the TLS listener's).
    pub operator_args: Vec<String>,
    /// Run while the group has figures (backlog 100, 3 replicas), e.g. to read them as the
    /// HPA or KEDA would.
    pub while_scaled: Option<Check>,
}

/// A check the scenario runs at one of its steps.
pub type Check = Box<dyn FnOnce() -> futures::future::BoxFuture<'static, ()> + Send>;

/// Waits, through a watch, until `name` satisfies `condition`.
pub async fn until<K>(api: &Api<K>, name: &str, what: &str, condition: impl Fn(Option<&K>) -> bool)
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
{
    tokio::time::timeout(
        Duration::from_secs(120),
        await_condition(api.clone(), name, move |o: Option<&K>| condition(o)),
    )
    .await
    .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
    .unwrap_or_else(|e| panic!("watching for {what}: {e}"));
}

/// Waits (by watching) until the objects `api` lists satisfy `condition`, for at most 2 min.
pub async fn until_listed<K>(api: &Api<K>, what: &str, condition: impl Fn(&[K]) -> bool)
where
    K: cosmosq_operator::run::Watched,
{
    use futures::TryStreamExt;
    use kube::runtime::{reflector, watcher};
    let (store, writer) = reflector::store();
    // Every event, not only applied objects: the store commits the initial list on `InitDone`.
    let events = reflector(writer, watcher(api.clone(), watcher::Config::default()));
    let found = async {
        futures::pin_mut!(events);
        while events
            .try_next()
            .await
            .unwrap_or_else(|e| panic!("watching for {what}: {e}"))
            .is_some()
        {
            let objects: Vec<K> = store.state().iter().map(|o| K::clone(o)).collect();
            if condition(&objects) {
                return;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(120), found)
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}: {:?}", store.state()));
}

/// Whether the Deployment asks for `n` replicas.
fn replicas(d: Option<&Deployment>, n: i32) -> bool {
    d.and_then(|d| d.spec.as_ref()).and_then(|s| s.replicas) == Some(n)
}

/// Merges `patch` into the group `name`, as `kubectl patch --type merge` does.
async fn change(groups: &Api<QueueConsumerGroup>, name: &str, patch: serde_json::Value) {
    groups
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap_or_else(|e| panic!("patch the group with {patch}: {e}"));
}

fn ready(conditions: &[Condition]) -> bool {
    conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True")
}

/// Starts an operator process (in this one) as the scenario's operator identity.
fn start_operator(
    s: &Scenario,
    args: &[String],
) -> (
    CancellationToken,
    tokio::task::JoinHandle<Result<(), cosmosq_operator::run::RunError>>,
) {
    let config = Config::try_parse_from(args).expect("valid settings");
    let shutdown = CancellationToken::new();
    let operator = tokio::spawn(run_with(
        s.operator_client.clone(),
        Backend::Fixed(s.cosmos.clone()),
        config,
        shutdown.clone(),
    ));
    (shutdown, operator)
}

/// Creates queue `name` with `policy` on the operator's identity, which may not create
/// containers: the queue says what is missing (kstatus Failed, Argo CD Degraded) until an admin
/// creates them (as `az` would, here through the SDK) and asks for a reconcile; then it is
/// ready.
async fn create_ready_queue(
    cosmos: &CosmosClient,
    queues: &Api<CosmosQueue>,
    ns: &str,
    name: &str,
    policy: &str,
) {
    let queue = json!({
        "apiVersion": "cosmosq.io/v1alpha1", "kind": "CosmosQueue",
        "metadata": {"name": name},
        "spec": {"endpoint": "https://cosmosq.emulator.local/",
                 "credentials": {"workloadIdentity": {}},
                 "database": ns, "container": name, "deletionPolicy": policy}
    });
    queues
        .create(
            &PostParams::default(),
            &serde_json::from_value(queue).unwrap(),
        )
        .await
        .unwrap_or_else(|e| panic!("create the CosmosQueue {name}: {e}"));
    until(
        queues,
        name,
        &format!("the queue {name} to say what an admin must create"),
        |q| {
            q.and_then(|q| q.status.as_ref()).is_some_and(|s| {
                s.conditions.iter().any(|c| {
                    c.type_ == "Stalled"
                        && c.status == "True"
                        && c.reason == "NeedsProvisioning"
                        && c.message.contains(" does not exist")
                })
            })
        },
    )
    .await;
    assert_health(
        &queues.get(name).await.unwrap(),
        Kstatus::Failed,
        "Degraded",
    );
    assert!(
        !container_exists(cosmos, ns, name).await,
        "the operator's identity created {name}"
    );
    cosmosq_queue::provision(cosmos, &QueueConfig::new(ns, name))
        .await
        .expect("the admin creates the containers");
    let requested = json!({"metadata": {"annotations": {
        "cosmosq.io/reconcile-requested-at": format!("{:?}", std::time::SystemTime::now())}}});
    queues
        .patch(name, &PatchParams::default(), &Patch::Merge(&requested))
        .await
        .expect("ask for a reconcile");
    until(
        queues,
        name,
        &format!("the queue {name} to be ready"),
        |q| {
            q.and_then(|q| q.status.as_ref())
                .is_some_and(|s| ready(&s.conditions))
        },
    )
    .await;
}

/// The operator is upgraded (a new sidecar image) while `operator` runs: no worker rolls by
/// itself; the group says what it would roll onto, and a rollout request takes it. Returns the
/// upgraded operator.
async fn an_upgrade_rolls_nothing_by_itself(
    s: &Scenario,
    traced: &[String],
    shutdown: CancellationToken,
    operator: tokio::task::JoinHandle<Result<(), cosmosq_operator::run::RunError>>,
) -> (
    CancellationToken,
    tokio::task::JoinHandle<Result<(), cosmosq_operator::run::RunError>>,
) {
    let deployments: Api<Deployment> = Api::namespaced(s.client.clone(), &s.namespace);
    let groups: Api<QueueConsumerGroup> = Api::namespaced(s.client.clone(), &s.namespace);
    let sidecar_image = |d: &Deployment| {
        d.spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .and_then(|p| p.containers.iter().find(|c| c.name == "cosmosq-sidecar"))
            .and_then(|c| c.image.clone())
    };
    let before = deployments.get("billing-workers").await.unwrap();
    shutdown.cancel();
    operator
        .await
        .expect("the operator task")
        .expect("the operator stops cleanly");
    let upgraded = "ghcr.io/cosmosq/sidecar:upgraded";
    let (shutdown, operator) = start_operator(
        s,
        &[traced.to_vec(), vec![format!("--sidecar-image={upgraded}")]].concat(),
    );
    until(&groups, "billing", "the update the group waits for", |g| {
        g.and_then(|g| g.status.as_ref())
            .and_then(|s| s.pending_update.as_deref())
            .is_some_and(|p| p.contains(upgraded) && p.contains("rollout-requested-at"))
    })
    .await;
    let held = deployments.get("billing-workers").await.unwrap();
    assert_eq!(
        (held.metadata.generation, sidecar_image(&held)),
        (before.metadata.generation, sidecar_image(&before)),
        "the upgrade rolled the workers"
    );
    let running = groups.get("billing").await.unwrap().status.unwrap();
    assert!(
        running
            .workers_built_by
            .as_deref()
            .is_some_and(|b| b.ends_with(sidecar_image(&before).unwrap().as_str())),
        "{running:?}"
    );
    let request = json!({"metadata": {"annotations": {
        "cosmosq.io/rollout-requested-at": "2026-12-03T12:00:00Z"}}});
    change(&groups, "billing", request).await;
    until(
        &deployments,
        "billing-workers",
        "the requested rollout",
        |d| d.and_then(sidecar_image).as_deref() == Some(upgraded),
    )
    .await;
    until(&groups, "billing", "the group to run the upgrade", |g| {
        g.and_then(|g| g.status.as_ref()).is_some_and(|s| {
            s.pending_update.is_none()
                && s.workers_built_by
                    .as_deref()
                    .is_some_and(|b| b.ends_with(upgraded))
        })
    })
    .await;

    (shutdown, operator)
}

/// `spec.app.generateApiTokens`: the operator makes a Secret of tokens the group owns, never
/// takes a team's Secret of that name, and a deleted Secret is made anew and rolls the workers
/// onto it.
async fn api_tokens_are_made_for_the_group_and_never_taken(s: &Scenario) {
    use k8s_openapi::api::core::v1::Secret;
    let ns = s.namespace.as_str();
    let groups: Api<QueueConsumerGroup> = Api::namespaced(s.client.clone(), ns);
    let deployments: Api<Deployment> = Api::namespaced(s.client.clone(), ns);
    let secrets: Api<Secret> = Api::namespaced(s.client.clone(), ns);
    let group = |name: &str| {
        let group = json!({
            "apiVersion": "cosmosq.io/v1alpha1", "kind": "QueueConsumerGroup",
            "metadata": {"name": name},
            "spec": {"queueRef": {"name": "orders"},
                     "template": {"spec": {"containers": [{"name": "app", "image": "example/app"}]}},
                     "app": {"port": 8080, "generateApiTokens": true},
                     "scaling": {"maxReplicas": 1}}
        });
        serde_json::from_value::<QueueConsumerGroup>(group).unwrap()
    };

    // A team's Secret has the name: the group is refused, and the Secret stays as it was.
    let team = json!({"metadata": {"name": "receipts-api-tokens"},
        "stringData": {"dapr-api-token": "the-teams", "app-api-token": "the-teams"}});
    let team: Secret = secrets
        .create(
            &PostParams::default(),
            &serde_json::from_value(team).unwrap(),
        )
        .await
        .expect("create the team's Secret");
    groups
        .create(&PostParams::default(), &group("receipts"))
        .await
        .expect("create the group named like the team's Secret");
    until(&groups, "receipts", "the group refused as NotOwned", |g| {
        g.and_then(|g| g.status.as_ref()).is_some_and(|s| {
            s.conditions.iter().any(|c| {
                c.type_ == "Ready"
                    && c.reason == "NotOwned"
                    && c.message.contains("Secret")
                    && c.message.contains("receipts-api-tokens")
            })
        })
    })
    .await;
    let kept = secrets.get("receipts-api-tokens").await.unwrap();
    assert_eq!(
        (
            kept.metadata.resource_version,
            kept.data,
            kept.metadata.owner_references
        ),
        (team.metadata.resource_version, team.data, None),
        "the team's Secret was written"
    );
    assert!(deployments
        .get_opt("receipts-workers")
        .await
        .unwrap()
        .is_none());

    // Made for the group, owned by it, and what its workers read.
    let invoices = groups
        .create(&PostParams::default(), &group("invoices"))
        .await
        .expect("create a group with generated tokens");
    let digest_of =
        |secret: &Secret| cosmosq_operator::build::api_tokens_digest(secret).expect("both tokens");
    let made = |previous: Option<String>| {
        let secrets = secrets.clone();
        let uid = invoices.uid();
        async move {
            until(
                &secrets,
                "invoices-api-tokens",
                "the group's API tokens",
                |t| t.is_some_and(|t| t.metadata.uid != previous),
            )
            .await;
            let made = secrets.get("invoices-api-tokens").await.unwrap();
            let owner = &made.metadata.owner_references.as_ref().unwrap()[0];
            assert_eq!(
                (owner.controller, Some(&owner.uid)),
                (Some(true), uid.as_ref())
            );
            assert_eq!(made.immutable, Some(true));
            let data = made.data.as_ref().expect("the tokens");
            assert!(data.values().all(|v| v.0.len() == 43), "256-bit tokens");
            made
        }
    };
    let first = made(None).await;
    let carries = |digest: String| {
        move |d: Option<&Deployment>| {
            d.and_then(|d| d.spec.as_ref())
                .and_then(|s| s.template.metadata.as_ref())
                .and_then(|m| m.annotations.as_ref())
                .and_then(|a| a.get("cosmosq.io/api-tokens-digest"))
                == Some(&digest)
        }
    };
    until(
        &deployments,
        "invoices-workers",
        "workers carrying the tokens' digest",
        carries(digest_of(&first)),
    )
    .await;

    // Rotated by deleting it: made anew at the group's next reconcile (asked for here), and
    // the workers roll onto it (a container restarted in an old pod would read the new tokens
    // and its app the old ones).
    secrets
        .delete("invoices-api-tokens", &DeleteParams::default())
        .await
        .expect("delete the tokens");
    let request = json!({"metadata": {"annotations": {
        "cosmosq.io/reconcile-requested-at": "2026-12-03T17:00:00Z"}}});
    change(&groups, "invoices", request).await;
    let second = made(first.metadata.uid.clone()).await;
    assert_ne!(digest_of(&second), digest_of(&first), "new tokens");
    until(
        &deployments,
        "invoices-workers",
        "workers rolled onto the new tokens",
        carries(digest_of(&second)),
    )
    .await;

    for name in ["invoices", "receipts"] {
        groups
            .delete(name, &DeleteParams::default())
            .await
            .expect("delete the group");
    }
    if s.controllers {
        // The garbage collector takes the group's tokens with it, and leaves the team's.
        until(
            &secrets,
            "invoices-api-tokens",
            "the tokens to go with their group",
            |t| t.is_none(),
        )
        .await;
        assert!(secrets
            .get_opt("receipts-api-tokens")
            .await
            .unwrap()
            .is_some());
    }
}

/// Runs the operator and the scenario; panics with what did not happen.
/// Whether a container of the Deployment's pod template sets `name` to a value that `holds`.
fn env_holds(deployment: Option<&Deployment>, name: &str, holds: impl Fn(&str) -> bool) -> bool {
    deployment
        .and_then(|d| d.spec.as_ref())
        .and_then(|s| s.template.spec.as_ref())
        .into_iter()
        .flat_map(|p| p.containers.iter())
        .flat_map(|c| c.env.iter().flatten())
        .any(|e| e.name == name && e.value.as_deref().is_some_and(&holds))
}

pub async fn operator_scenario(mut s: Scenario) {
    let ns = s.namespace.as_str();
    let mut args = vec![
        "cosmosq-operator".to_owned(),
        "--listen=127.0.0.1:0".into(),
        "--scale-interval=200ms".into(),
        format!("--lease-namespace={ns}"),
        format!("--watch-namespace={ns}"),
        "--lease-name=cosmosq-operator-e2e".into(),
    ];
    if let Some(identity) = &s.identity {
        args.push(format!("--identity={identity}"));
    }
    args.extend(s.operator_args.iter().cloned());
    // Its reconciles are traced to a local collector (OTLP/JSON here; the sidecar's test
    // covers protobuf).
    let collector = crate::otlp::OtlpReceiver::start().await;

    // The group exists before the operator starts, with what a version before the worker
    // ClusterRole left for it: a Role and a binding to it, both owned by the group.
    let groups: Api<QueueConsumerGroup> = Api::namespaced(s.client.clone(), ns);
    let group = json!({
        "apiVersion": "cosmosq.io/v1alpha1", "kind": "QueueConsumerGroup",
        "metadata": {"name": "billing"},
        "spec": {"queueRef": {"name": "orders"}, "startFrom": "beginning",
                 "template": {"spec": {"containers": [{"name": "app", "image": "example/app"}]}},
                 "app": {"port": 8080},
                 "scaling": {"targetBacklogPerReplica": 10, "maxReplicas": 3}}
    });
    let billing = groups
        .create(
            &PostParams::default(),
            &serde_json::from_value(group).unwrap(),
        )
        .await
        .expect("create the QueueConsumerGroup");
    let owned_by_billing = json!([{"apiVersion": "cosmosq.io/v1alpha1",
        "kind": "QueueConsumerGroup", "name": "billing", "uid": billing.uid(),
        "controller": true}]);
    let roles: Api<Role> = Api::namespaced(s.client.clone(), ns);
    let bindings: Api<RoleBinding> = Api::namespaced(s.client.clone(), ns);
    let legacy_role = json!({"metadata": {"name": "billing-workers",
            "ownerReferences": owned_by_billing},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}]});
    roles
        .create(
            &PostParams::default(),
            &serde_json::from_value(legacy_role).unwrap(),
        )
        .await
        .expect("create the old per-group Role");
    let legacy_binding = json!({"metadata": {"name": "billing-workers",
            "ownerReferences": owned_by_billing},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "billing-workers"},
        "subjects": [{"kind": "ServiceAccount", "name": "billing-workers", "namespace": ns}]});
    bindings
        .create(
            &PostParams::default(),
            &serde_json::from_value(legacy_binding).unwrap(),
        )
        .await
        .expect("create the old binding");

    let traced = [
        args.clone(),
        vec![
            format!("--otlp-endpoint={}", collector.endpoint),
            "--otlp-protocol=http/json".into(),
        ],
    ]
    .concat();
    let (mut shutdown, mut operator) = start_operator(&s, &traced);

    // Applied before its queue (as GitOps applies a folder), the group waits for it: GitOps
    // tools read it as in progress, not failed and not done.
    let has_condition =
        |g: Option<&QueueConsumerGroup>, type_: &str, status: &str, reason: &str| {
            g.and_then(|g| g.status.as_ref()).is_some_and(|s| {
                s.conditions
                    .iter()
                    .any(|c| c.type_ == type_ && c.status == status && c.reason == reason)
            })
        };
    until(&groups, "billing", "the group to wait for its queue", |g| {
        has_condition(g, "Reconciling", "True", "QueueNotFound")
    })
    .await;
    assert_health(
        &groups.get("billing").await.unwrap(),
        Kstatus::InProgress,
        "Progressing",
    );

    // A queue is provisioned and reported ready.
    let queues: Api<CosmosQueue> = Api::namespaced(s.client.clone(), ns);
    Box::pin(create_ready_queue(
        &s.cosmos, &queues, ns, "orders", "Delete",
    ))
    .await;
    until(&queues, "orders", "the queue's partitions", |q| {
        q.and_then(|q| q.status.as_ref())
            .is_some_and(|s| s.partitions == Some(4))
    })
    .await;
    assert_health(
        &queues.get("orders").await.unwrap(),
        Kstatus::Current,
        "Healthy",
    );
    assert!(container_exists(&s.cosmos, ns, "orders").await);
    assert!(container_exists(&s.cosmos, ns, "orders-leases").await);
    let finalizers = |q: &CosmosQueue| q.metadata.finalizers.clone().unwrap_or_default();
    assert_eq!(
        finalizers(&queues.get("orders").await.unwrap()),
        vec!["cosmosq.io/deletion-policy".to_owned()],
        "a Delete queue is held until its containers are deleted"
    );
    // A Retain queue has nothing to do at deletion, so nothing holds it (or its namespace).
    Box::pin(create_ready_queue(
        &s.cosmos, &queues, ns, "archive", "Retain",
    ))
    .await;
    assert!(finalizers(&queues.get("archive").await.unwrap()).is_empty());
    queues
        .delete("archive", &DeleteParams::default())
        .await
        .expect("delete the Retain queue");
    until(&queues, "archive", "the Retain queue to go", |q| {
        q.is_none()
    })
    .await;
    assert!(
        container_exists(&s.cosmos, ns, "archive").await,
        "Retain keeps the containers"
    );

    // The group gets its Deployment with the sidecar injected once its queue exists.
    let deployments: Api<Deployment> = Api::namespaced(s.client.clone(), ns);
    until(&deployments, "billing-workers", "the Deployment", |d| {
        d.and_then(|d| d.spec.as_ref())
            .and_then(|s| s.template.spec.as_ref())
            .is_some_and(|p| p.containers.iter().any(|c| c.name == "cosmosq-sidecar"))
    })
    .await;

    // Its workers are bound to the worker ClusterRole; the old Role is gone.
    until(
        &bindings,
        "billing-workers",
        "the binding to the worker ClusterRole",
        |b| b.is_some_and(|b| b.role_ref.kind == "ClusterRole"),
    )
    .await;
    assert!(roles.get_opt("billing-workers").await.unwrap().is_none());

    // A spec change reaches the Deployment.
    change(&groups, "billing", json!({"spec": {"concurrency": 4}})).await;
    until(
        &deployments,
        "billing-workers",
        "the changed concurrency",
        |d| env_holds(d, "COSMOSQ_MAX_CONCURRENCY", |v| v == "4"),
    )
    .await;

    // A pipeline: granted a queue that does not exist yet, the group says so and waits; once
    // the queue is there (its creation reaches the group), its sidecar may publish to it.
    change(
        &groups,
        "billing",
        json!({"spec": {"publishTo": [{"queueRef": {"name": "invoices"}}]}}),
    )
    .await;
    until(&groups, "billing", "the group to wait for invoices", |g| {
        has_condition(g, "Ready", "False", "PublishQueueNotFound")
    })
    .await;
    Box::pin(create_ready_queue(
        &s.cosmos, &queues, ns, "invoices", "Delete",
    ))
    .await;
    until(
        &deployments,
        "billing-workers",
        "the queue to publish to",
        |d| {
            env_holds(d, "COSMOSQ_PUBLISH_TO", |v| {
                v.contains(r#""queue":"invoices""#)
            })
        },
    )
    .await;
    until(&groups, "billing", "the group ready again", |g| {
        has_condition(g, "Ready", "True", "Applied")
    })
    .await;

    // A backlog scales it to the maximum, and the status says why.
    let q = Queue::open(&s.cosmos, QueueConfig::new(ns, "orders"))
        .await
        .expect("open the queue");
    let batch = (0..100)
        .map(|i| NewMessage::json(json!({"n": i})))
        .collect();
    for result in q.enqueue_batch(batch).await {
        result.expect("enqueue");
    }
    until(&deployments, "billing-workers", "3 replicas", |d| {
        replicas(d, 3)
    })
    .await;

    // A team's own Deployment has the name a new group needs: the group is refused, naming
    // it, and the Deployment is neither taken over nor scaled (the backlog would scale it),
    // nor deleted with the group.
    let team = json!({"apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "payments-workers"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "payments"}},
                 "template": {"metadata": {"labels": {"app": "payments"}},
                              "spec": {"containers": [{"name": "team-app", "image": "team/app"}]}}}});
    let team: Deployment = deployments
        .create(
            &PostParams::default(),
            &serde_json::from_value(team).unwrap(),
        )
        .await
        .expect("create the team's Deployment");
    let payments = json!({
        "apiVersion": "cosmosq.io/v1alpha1", "kind": "QueueConsumerGroup",
        "metadata": {"name": "payments"},
        "spec": {"queueRef": {"name": "orders"}, "startFrom": "beginning",
                 "template": {"spec": {"containers": [{"name": "app", "image": "example/app"}]}},
                 "app": {"port": 8080},
                 "scaling": {"targetBacklogPerReplica": 10, "maxReplicas": 3}}
    });
    groups
        .create(
            &PostParams::default(),
            &serde_json::from_value(payments).unwrap(),
        )
        .await
        .expect("create the group named like the team's Deployment");
    until(&groups, "payments", "the group refused as NotOwned", |g| {
        g.and_then(|g| g.status.as_ref()).is_some_and(|s| {
            s.conditions.iter().any(|c| {
                c.type_ == "Ready"
                    && c.status == "False"
                    && c.reason == "NotOwned"
                    && c.message.contains("Deployment")
                    && c.message.contains("payments-workers")
            })
        }) && has_condition(g, "Stalled", "True", "NotOwned")
    })
    .await;
    // Waiting for a person, not retrying its way out: Flux's wait and Argo CD say failed.
    assert_health(
        &groups.get("payments").await.unwrap(),
        Kstatus::Failed,
        "Degraded",
    );
    Box::pin(api_tokens_are_made_for_the_group_and_never_taken(&s)).await;
    if s.controllers {
        // The Deployment is valid to the cluster's own controller: it observed the scaled
        // spec and made 3 Pods (Pending without nodes; the concurrency change above rolls out
        // a second ReplicaSet, so they may be spread over two).
        until(
            &deployments,
            "billing-workers",
            "the Deployment controller to make 3 pods",
            |d: Option<&Deployment>| {
                d.is_some_and(|d| {
                    d.status.as_ref().is_some_and(|st| {
                        st.observed_generation == d.metadata.generation && st.replicas >= Some(3)
                    })
                })
            },
        )
        .await;
        let sets: Api<ReplicaSet> = Api::namespaced(s.client.clone(), ns);
        until_listed(
            &sets,
            "ReplicaSets of the sidecar-injected template",
            |list| {
                list.iter().any(|rs| {
                    rs.name_any().starts_with("billing-workers-")
                        && rs
                            .spec
                            .as_ref()
                            .and_then(|s| s.template.as_ref())
                            .and_then(|t| t.spec.as_ref())
                            .is_some_and(|p| {
                                p.containers.iter().any(|c| c.name == "cosmosq-sidecar")
                            })
                })
            },
        )
        .await;
        // The Deployment controller's verdict on the workers reaches the group's conditions.
        let available = |conditions: &[Condition]| {
            conditions
                .iter()
                .find(|c| c.type_ == "Available")
                .map(|c| c.status.clone())
        };
        // (Pods stay Pending without nodes, so the Deployment's Available holds still.)
        until(
            &deployments,
            "billing-workers",
            "the Deployment's Available",
            |d| {
                d.and_then(|d| d.status.as_ref())
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| c.iter().any(|c| c.type_ == "Available"))
            },
        )
        .await;
        let of_deployment = deployments
            .get("billing-workers")
            .await
            .unwrap()
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .into_iter()
            .find(|c| c.type_ == "Available")
            .map(|c| c.status);
        until(
            &groups,
            "billing",
            "the group to mirror its Deployment's Available",
            |g| {
                g.and_then(|g| g.status.as_ref())
                    .is_some_and(|s| available(&s.conditions) == of_deployment)
            },
        )
        .await;
    }
    until(&groups, "billing", "the group's status", |g| {
        g.and_then(|g| g.status.as_ref()).is_some_and(|s| {
            s.backlog == Some(100) && s.desired_replicas == Some(3) && ready(&s.conditions)
        })
    })
    .await;
    let status = groups.get("billing").await.unwrap().status.unwrap();
    assert_eq!(
        status.last_scale_reason.as_deref(),
        Some("backlog 100: scaling up to 3")
    );
    assert_eq!(status.ranges.len(), 4, "lag and owner per range");
    let types: Vec<&str> = status.conditions.iter().map(|c| c.type_.as_str()).collect();
    assert!(
        types.contains(&"Ready") && types.contains(&"Degraded"),
        "{types:?}"
    );
    until(&queues, "orders", "the queue's backlog", |q| {
        q.and_then(|q| q.status.as_ref()).and_then(|s| s.backlog) == Some(100)
    })
    .await;
    if let Some(check) = s.while_scaled.take() {
        check().await;
    }
    let leases: Api<Lease> = Api::namespaced(s.client.clone(), ns);
    let holder = leases
        .get("cosmosq-operator-e2e")
        .await
        .expect("the leader Lease")
        .spec
        .and_then(|s| s.holder_identity);
    assert!(holder.is_some(), "a leader holds the Lease");

    // HPA mode: the operator writes an HPA on its external metric; switching back to Direct
    // removes it (two scalers on one Deployment would fight).
    let hpas: Api<HorizontalPodAutoscaler> = Api::namespaced(s.client.clone(), ns);
    for (mode, present) in [("HPA", true), ("Direct", false)] {
        change(
            &groups,
            "billing",
            json!({"spec": {"scaling": {"mode": mode}}}),
        )
        .await;
        until(
            &hpas,
            "billing-workers",
            &format!("{mode} mode's HPA"),
            |h| h.is_some() == present,
        )
        .await;
    }

    // Paused in HPA mode: the HPA goes (it would scale the paused workers) and comes back
    // when the pause is lifted.
    let annotate = |value: Option<&str>| {
        let patch = json!({"metadata": {"annotations": {"cosmosq.io/paused-replicas": value}}});
        change(&groups, "billing", patch)
    };
    let mode = |mode: &str| {
        change(
            &groups,
            "billing",
            json!({"spec": {"scaling": {"mode": mode}}}),
        )
    };
    mode("HPA").await;
    until(&hpas, "billing-workers", "HPA mode's HPA", |h| h.is_some()).await;
    annotate(Some("1")).await;
    until(
        &hpas,
        "billing-workers",
        "the paused group's HPA to go",
        |h| h.is_none(),
    )
    .await;
    until(
        &deployments,
        "billing-workers",
        "the pause's 1 replica",
        |d| replicas(d, 1),
    )
    .await;
    annotate(None).await;
    until(
        &hpas,
        "billing-workers",
        "the HPA back after the pause",
        |h| h.is_some(),
    )
    .await;

    // External mode: the group's scale subresource (what `kubectl scale qcg`, an HPA or a KEDA
    // ScaledObject use) sets the workers; the operator only measures.
    mode("External").await;
    until(
        &hpas,
        "billing-workers",
        "External mode without an HPA",
        |h| h.is_none(),
    )
    .await;
    groups
        .patch_scale(
            "billing",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 2}})),
        )
        .await
        .expect("scale the group");
    until(
        &deployments,
        "billing-workers",
        "the group's 2 replicas",
        |d| replicas(d, 2),
    )
    .await;
    let selector = "app.kubernetes.io/instance=billing,app.kubernetes.io/name=cosmosq-worker";
    until(&groups, "billing", "External mode's status", |g| {
        g.and_then(|g| g.status.as_ref()).is_some_and(|s| {
            s.desired_replicas == Some(2)
                && s.backlog == Some(100)
                && s.selector.as_deref() == Some(selector)
        })
    })
    .await;
    let scale = groups
        .get_scale("billing")
        .await
        .expect("the group's scale");
    assert_eq!(scale.spec.and_then(|s| s.replicas), Some(2));
    assert_eq!(
        scale.status.and_then(|s| s.selector).as_deref(),
        Some(selector),
        "an HPA on the group finds its pods"
    );
    // A pause wins over spec.replicas, and lifting it gives the workers back to it.
    annotate(Some("0")).await;
    until(
        &deployments,
        "billing-workers",
        "the pause's 0 replicas",
        |d| replicas(d, 0),
    )
    .await;
    until(&groups, "billing", "the Paused condition", |g| {
        g.and_then(|g| g.status.as_ref()).is_some_and(|s| {
            s.conditions
                .iter()
                .any(|c| c.type_ == "Paused" && c.status == "True")
        })
    })
    .await;
    let paused = serde_json::to_value(groups.get("billing").await.unwrap()).unwrap();
    assert_ne!(kstatus(&paused), Kstatus::Failed, "{paused}");
    let (health, message) = argocd(&paused);
    assert_eq!(health, "Suspended", "{message}");
    annotate(None).await;
    until(
        &deployments,
        "billing-workers",
        "spec.replicas again",
        |d| replicas(d, 2),
    )
    .await;

    // The operator is upgraded (a new sidecar image): no worker rolls by itself.
    (shutdown, operator) = Box::pin(an_upgrade_rolls_nothing_by_itself(
        &s, &traced, shutdown, operator,
    ))
    .await;

    // Through every scaling round since, the team's Deployment stayed as the team made it;
    // deleting the group that was refused leaves it.
    let untouched = |d: &Deployment| {
        d.metadata.owner_references.is_none()
            && d.spec.as_ref().and_then(|s| s.replicas) == Some(1)
            && d.spec
                .as_ref()
                .and_then(|s| s.template.spec.as_ref())
                .map(|p| p.containers.len())
                == Some(1)
            && d.metadata.uid == team.metadata.uid
    };
    let theirs = deployments.get("payments-workers").await.unwrap();
    assert!(
        untouched(&theirs),
        "the team's Deployment changed: {theirs:?}"
    );
    groups
        .delete("payments", &DeleteParams::background())
        .await
        .expect("delete the refused group");
    until(&groups, "payments", "the refused group to go", |g| {
        g.is_none()
    })
    .await;
    let theirs = deployments.get("payments-workers").await.unwrap();
    assert!(
        untouched(&theirs),
        "the team's Deployment changed: {theirs:?}"
    );
    deployments
        .delete("payments-workers", &DeleteParams::background())
        .await
        .expect("delete the team's Deployment");

    // Deleting the group removes what it owned; deleting the queue honours `Delete`.
    groups
        .delete("billing", &DeleteParams::background())
        .await
        .expect("delete the group");
    until(
        &deployments,
        "billing-workers",
        "the Deployment to go",
        |d| d.is_none(),
    )
    .await;
    queues
        .delete("orders", &DeleteParams::default())
        .await
        .expect("delete the queue");
    until(&queues, "orders", "the queue to go", |q| q.is_none()).await;
    assert!(!container_exists(&s.cosmos, ns, "orders").await);
    assert!(!container_exists(&s.cosmos, ns, "orders-leases").await);

    // A graceful stop releases the Lease at once.
    shutdown.cancel();
    operator
        .await
        .expect("the operator task")
        .expect("the operator stops cleanly");
    let released = leases
        .get("cosmosq-operator-e2e")
        .await
        .unwrap()
        .spec
        .and_then(|s| s.holder_identity);
    assert_eq!(released, None, "released on shutdown");
    // Each reconcile was a span, sent before the operator ended; a failed one says why.
    let spans = collector.spans();
    for (kind, name) in [("CosmosQueue", "orders"), ("QueueConsumerGroup", "billing")] {
        let reconciles: Vec<_> = spans
            .iter()
            .filter(|span| {
                span.name == format!("reconcile {kind}")
                    && span.attr("cosmosq.resource.name") == name
            })
            .collect();
        assert!(
            !reconciles.is_empty(),
            "no reconcile span for the {kind} {name}: {spans:#?}"
        );
        assert!(reconciles
            .iter()
            .all(|span| span.service == "cosmosq-operator"
                && span.kind == "internal"
                && span.attr("k8s.namespace.name") == ns
                && span.parent_span_id.is_empty()));
    }

    if s.controllers {
        // A new operator process takes the released Lease over and carries on; then the
        // namespace is deleted while a `Delete` queue still exists in it: the queue's
        // containers are deleted and the namespace goes (a finalizer must never hold it).
        let (shutdown, operator) = start_operator(&s, &args);
        Box::pin(create_ready_queue(&s.cosmos, &queues, ns, "last", "Delete")).await;
        let namespaces: Api<Namespace> = Api::all(s.client.clone());
        namespaces
            .delete(ns, &DeleteParams::background())
            .await
            .expect("delete the namespace");
        until(&namespaces, ns, "the namespace to go", |n| n.is_none()).await;
        assert!(!container_exists(&s.cosmos, ns, "last").await);
        shutdown.cancel();
        // Its leader Lease went with the namespace: the process ends, cleanly or not.
        let _ = operator.await.expect("the operator task");
    }
}
