//! Wiring: the HTTP surface, leader election, the two controllers and the scaling loop, and a
//! graceful shutdown. `main` only parses the configuration and waits for a signal.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use cosmosq_crds::{CosmosQueue, QueueConsumerGroup};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::reflector;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::utils::{predicates, Predicate};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::json;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::arm::Arm;
use crate::auth::Authorizer;
use crate::build::Defaults;
use crate::cached::CachedDeployment;
use crate::certs::{self, Keeper};
use crate::config::Config;
use crate::context::{Context, ReconcileFailure};
use crate::cosmos::{Backend, Cosmos, Management};
use crate::group::reconcile_group;
use crate::http::{self, HttpError, Shared};
use crate::leader::{ElectionSettings, LeaderElection, LeaderError};
use crate::queue::reconcile_queue;
use crate::scaler::Scaler;
use crate::tls::{ServingTls, Source, TlsError};
use cosmosq_program::telemetry::Telemetry;

/// The label the leader puts on its own pod; the external-metrics Service selects it.
pub const LEADER_LABEL: &str = "cosmosq.io/leader";
/// Objects the operator applies carry this label; only they are watched.
const MANAGED: &str = crate::build::MANAGED_SELECTOR;

/// What stops the operator.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The API server could not be reached.
    #[error("Kubernetes client: {0}")]
    Client(#[from] kube::Error),
    /// A listener failed.
    #[error(transparent)]
    Http(#[from] HttpError),
    /// The serving certificate is unusable.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// Leading ended.
    #[error(transparent)]
    Leader(#[from] LeaderError),
    /// The span export settings are unusable.
    #[error(transparent)]
    Telemetry(#[from] cosmosq_program::telemetry::TelemetryError),
    /// The console cannot listen.
    #[error(transparent)]
    Console(#[from] cosmosq_console::ConsoleError),
    /// The ARM client (--identity-management) cannot be set up.
    #[error("--identity-management: {0}")]
    Management(String),
}

/// Runs until `shutdown`, or until leadership is lost (an error: the process exits and
/// Kubernetes restarts it as a candidate).
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), RunError> {
    cosmosq_queue::cosmos::tls::install_crypto_provider();
    let client = Client::try_default().await?;
    let backend = Backend::Azure {
        region: config.region.clone(),
        identity_grants: config.identity_grants.clone(),
        endpoints: crate::endpoint::EndpointPolicy::new(config.allowed_endpoints.clone()),
    };
    let management = management(&config)?;
    run_with_management(client, backend, management, config, shutdown).await
}

/// The ARM side, where an admin named accounts to manage: the same Entra credential as the
/// data plane's.
fn management(config: &Config) -> Result<Option<Management>, RunError> {
    if config.identity_management.is_empty() {
        return Ok(None);
    }
    let credential = cosmosq_queue::cosmos::connection::identity_credential()
        .map_err(|e| RunError::Management(e.to_string()))?;
    let arm = Arm::new(
        config.arm_endpoint.clone(),
        credential,
        crate::arm::Timing::default(),
        Arc::new(crate::arm::TokioPause),
    )
    .map_err(|e| RunError::Management(e.to_string()))?;
    Ok(Some(Management {
        grants: config.identity_grants.clone(),
        scopes: config.identity_management.clone(),
        arm,
        max_throughput: config.arm_max_throughput,
    }))
}

/// Runs with this client and backend (the emulator's in tests and the local run).
pub async fn run_with(
    client: Client,
    backend: Backend,
    config: Config,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    run_with_management(client, backend, None, config, shutdown).await
}

/// [`run_with`], identity queues also provisioned through ARM where `management` says.
pub async fn run_with_management(
    client: Client,
    backend: Backend,
    management: Option<Management>,
    config: Config,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    let identity = config.identity();
    let defaults = Defaults {
        sidecar_image: config.sidecar_image.clone(),
        worker_cluster_role: config.worker_cluster_role.clone(),
        rollout: crate::rollout::RolloutPolicy {
            update: config.sidecar_update,
            max_concurrent: usize::from(config.sidecar_update_max_concurrent),
        },
        rollout_scope: config.watch_namespace.clone(),
        rollout_lock: Default::default(),
    };
    let mut cosmos = Cosmos::new(backend, client.clone());
    if let Some(management) = management {
        cosmos = cosmos.with_management(management);
    }
    let mut ctx = Context::new(client.clone(), defaults, cosmos, Some(identity.clone()));
    ctx.telemetry = Telemetry::start(&config.otlp, "cosmosq-operator")?;
    let (changed_tx, changed_rx) = mpsc::unbounded_channel();
    ctx.changed = Some(changed_tx);
    let (reconcile_tx, reconcile_rx) = mpsc::unbounded_channel();
    ctx.reconcile = Some(reconcile_tx);
    let ctx = Arc::new(ctx);

    // The HTTP surface comes first: the kubelet probes a standby too.
    let mut shared = Shared::new(ctx.metrics.clone(), ctx.figures.clone());
    let (wakes_tx, wakes_rx) = mpsc::channel(crate::wake::WAKE_BACKLOG);
    if config.wake_endpoint {
        shared.wakes = Some(wakes_tx);
    }
    let listener = http::bind(config.listen).await?;
    let source = match (
        &config.tls_cert_file,
        &config.tls_key_file,
        &config.serving_cert_secret,
    ) {
        (Some(cert), Some(key), _) => Some(Source::Files {
            cert: cert.clone(),
            key: key.clone(),
        }),
        (_, _, Some(name)) => Some(Source::Secret {
            secrets: Box::new(Api::namespaced(client.clone(), &config.lease_namespace)),
            name: name.clone(),
        }),
        _ => None,
    };
    let secure = match source {
        Some(source) => Some((
            http::bind(config.secure_listen).await?,
            Arc::new(ServingTls::load(source, client.clone()).await?),
        )),
        None => None,
    };
    let keeper = certificate_keeper(&client, &config, secure.as_ref().map(|(_, tls)| tls));
    let insecure_metrics = match config.insecure_metrics_listen {
        Some(addr) => Some((addr, http::bind(addr).await?)),
        None => None,
    };
    let mut servers = tokio::task::JoinSet::new();
    servers.spawn(http::serve(
        listener,
        http::router(shared.clone()),
        shutdown.clone(),
    ));
    if let Some((addr, listener)) = insecure_metrics {
        if !addr.ip().is_loopback() {
            warn!(%addr, "/metrics is served without authentication where other pods may reach it");
        }
        servers.spawn(http::serve(
            listener,
            http::insecure_metrics_router(shared.clone()),
            shutdown.clone(),
        ));
    }
    let authorizer = Arc::new(Authorizer::new(client.clone()));
    if let Some(address) = config.console_listen {
        if !address.ip().is_loopback() {
            warn!(%address, "the console listens where other pods may reach it: sign-in tokens cross the pod network in clear text");
        }
        let options = cosmosq_console::ConsoleOptions {
            sample_every: config.console_sample_every,
            ..Default::default()
        };
        let console = crate::console::bind(
            watch_api(&client, config.watch_namespace.as_deref()),
            ctx.clone(),
            authorizer.clone(),
            options,
            address,
        )
        .await?;
        info!(address = %console.local_addr(), "serving the console (kubectl port-forward reaches it)");
        let stop = shutdown.clone();
        servers.spawn(async move {
            if let Err(e) = console.run(stop).await {
                warn!(error = %e, "the console stopped");
            }
            Ok(())
        });
    }
    match secure {
        Some((listener, tls)) => {
            let router = http::secure_router(
                shared.clone(),
                authorizer,
                config.token_audience.clone(),
                config.keda_endpoint,
            );
            let reload = tls.clone().run(shutdown.clone());
            servers.spawn(async move {
                reload.await;
                Ok(())
            });
            servers.spawn(http::serve_tls(listener, router, tls, shutdown.clone()));
        }
        None if config.insecure_metrics_listen.is_none() => {
            info!("/metrics is not served: it needs the TLS listener (--tls-cert-file, --tls-key-file)");
        }
        None => {}
    }
    let pod = config.identity.clone().map(|name| {
        (
            Api::<Pod>::namespaced(client.clone(), &config.lease_namespace),
            name,
        )
    });
    if let Some((pods, name)) = &pod {
        label_own_pod(pods, name, false).await;
    }

    let election = config.leader_election.then(|| {
        LeaderElection::new(
            Api::<Lease>::namespaced(client.clone(), &config.lease_namespace),
            ElectionSettings::new(config.lease_name.clone(), identity.clone()),
        )
    });
    if let Some(election) = &election {
        match election.acquire(&shutdown).await {
            Ok(()) => {}
            Err(LeaderError::Cancelled) => return stop_servers(servers).await,
            Err(e) => return Err(e.into()),
        }
    }
    shared.leader.store(true, Ordering::Relaxed);
    ctx.metrics.leader.set(1);
    // The Service reaches this pod once it is labelled: it serves a certificate by then.
    if let Some(keeper) = &keeper {
        if let Err(e) = keeper.round(std::time::SystemTime::now()).await {
            warn!(error = %e, "could not issue the serving certificate yet; trying again");
        }
    }
    if let Some((pods, name)) = &pod {
        label_own_pod(pods, name, true).await;
    }

    // Controllers stop when `work` is cancelled: on shutdown, or when leadership is lost.
    let work = shutdown.child_token();
    let lost = match &election {
        Some(election) => {
            let work = work.clone();
            let hold = async move {
                let outcome = election.hold(&work).await;
                work.cancel();
                outcome
            };
            Some(hold)
        }
        None => None,
    };
    let controllers = async {
        let keeping = async {
            if let Some(keeper) = &keeper {
                keeper.run(work.clone()).await;
                info!("certificate keeping stopped");
            }
        };
        tokio::join!(
            run_controllers(
                &client,
                &config,
                ctx.clone(),
                shared.clone(),
                Inbox {
                    changed: changed_rx,
                    reconcile: reconcile_rx,
                    wakes: wakes_rx,
                },
                work.clone(),
            ),
            keeping
        );
    };
    let outcome = match lost {
        Some(hold) => {
            let (outcome, ()) = tokio::join!(hold, controllers);
            match outcome {
                LeaderError::Cancelled => Ok(()),
                lost => Err(lost),
            }
        }
        None => {
            controllers.await;
            Ok(())
        }
    };
    info!("controllers stopped");
    // No reconcile runs any more: its spans are sent before the process ends.
    ctx.telemetry.shutdown().await;
    shared.leader.store(false, Ordering::Relaxed);
    ctx.metrics.leader.set(0);
    if let Some((pods, name)) = &pod {
        label_own_pod(pods, name, false).await;
    }
    if let Some(election) = &election {
        if outcome.is_ok() {
            election.release().await;
        }
    }
    shutdown.cancel();
    stop_servers(servers).await?;
    outcome.map_err(RunError::from)
}

/// The leader's keeper of the certificate it issues itself (`--serving-cert-secret`).
fn certificate_keeper(
    client: &Client,
    config: &Config,
    tls: Option<&Arc<ServingTls>>,
) -> Option<Keeper> {
    let (Some(name), Some(service), Some(tls)) = (
        &config.serving_cert_secret,
        &config.serving_cert_service,
        tls,
    ) else {
        return None;
    };
    Some(Keeper::new(
        Api::namespaced(client.clone(), &config.lease_namespace),
        name.clone(),
        config
            .api_service
            .as_ref()
            .map(|name| (Api::all(client.clone()), name.clone())),
        certs::Settings::for_service(
            service,
            &config.lease_namespace,
            config.serving_cert_validity,
            config.serving_ca_validity,
        ),
        tls.clone(),
    ))
}

async fn stop_servers(
    mut servers: tokio::task::JoinSet<Result<(), HttpError>>,
) -> Result<(), RunError> {
    while let Some(result) = servers.join_next().await {
        if let Ok(Err(e)) = result {
            return Err(e.into());
        }
    }
    Ok(())
}

fn watch_api<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    <K as Resource>::DynamicType: Default,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// What a watcher needs of a resource.
pub trait Watched:
    Resource<DynamicType = ()>
    + Clone
    + std::fmt::Debug
    + serde::de::DeserializeOwned
    + Send
    + Sync
    + 'static
{
}

impl<K> Watched for K where
    K: Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static
{
}

/// What of a workers' Deployment its group's reconcile reacts to: its spec but the replicas
/// (a scale by the scaling loop or an HPA bumps the generation and needs no reconcile) and its
/// conditions (availability, pods refused).
fn deployment_signature(d: &CachedDeployment) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (d.spec_hash, &d.conditions).hash(&mut hasher);
    hasher.finish()
}

/// The objects `api` watches, each when first seen, when deleted, and when `signature`
/// changes: what a controller must react to, without the chatter of status writes.
fn changes<K>(
    api: Api<K>,
    config: watcher::Config,
    signature: fn(&K) -> u64,
) -> impl futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static
where
    K: Watched,
{
    changed_objects(watcher(api, config).default_backoff(), signature)
}

/// The objects of a watch's `events` when first seen, deleted, or changed by `signature`.
fn changed_objects<K>(
    events: impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    signature: fn(&K) -> u64,
) -> impl futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static
where
    K: Resource<DynamicType = ()> + Send + 'static,
{
    let mut seen = std::collections::HashMap::<ObjectRef<K>, u64>::new();
    events.filter_map(move |event| {
        let passed = match event {
            Ok(watcher::Event::Delete(object)) => {
                seen.remove(&ObjectRef::from_obj(&object));
                Some(Ok(object))
            }
            Ok(watcher::Event::Apply(object) | watcher::Event::InitApply(object)) => {
                let key = ObjectRef::from_obj(&object);
                let now = signature(&object);
                (seen.insert(key, now) != Some(now)).then_some(Ok(object))
            }
            Ok(_) => None,
            Err(e) => Some(Err(e)),
        };
        futures::future::ready(passed)
    })
}

/// Field managers are half of a small object and nothing here reads them.
fn trim_managed_fields<K: Resource>(object: &mut K) {
    object.meta_mut().managed_fields = None;
}

/// A hash of a group's pause annotations and its reconcile and rollout requests.
fn pause_annotations(qcg: &QueueConsumerGroup) -> Option<u64> {
    annotations_hash(
        qcg,
        &[
            crate::spec::PAUSED_REPLICAS,
            crate::spec::PAUSED,
            crate::spec::RECONCILE_REQUESTED,
            crate::rollout::ROLLOUT_REQUESTED,
        ],
    )
}

/// A hash of a queue's reconcile request.
fn reconcile_requested(cq: &CosmosQueue) -> Option<u64> {
    annotations_hash(cq, &[crate::spec::RECONCILE_REQUESTED])
}

fn annotations_hash(object: &impl Resource, keys: &[&str]) -> Option<u64> {
    use std::hash::{Hash, Hasher};
    let annotations = object.annotations();
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    for key in keys {
        annotations.get(*key).hash(&mut hasher);
    }
    Some(hasher.finish())
}

/// A cache of `K` and the stream of its spec and finalizer changes, and of what `also`
/// hashes. Only those trigger reconciles: the status writes of the reconcilers and the scaling
/// loop must not trigger reconciles of their own.
fn spec_changes<K>(
    client: &Client,
    namespace: Option<&str>,
    also: impl Predicate<K> + Send + 'static,
) -> (
    reflector::Store<K>,
    impl futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static,
)
where
    K: Watched + Resource<Scope = k8s_openapi::NamespaceResourceScope>,
{
    let (store, writer) = reflector::store();
    let changes = watcher(
        watch_api::<K>(client, namespace),
        watcher::Config::default().any_semantic(),
    )
    .default_backoff()
    .modify(trim_managed_fields::<K>)
    .reflect(writer)
    .applied_objects()
    .predicate_filter(
        predicates::generation
            .combine(predicates::finalizers)
            .combine(also),
        Default::default(),
    );
    (store, changes)
}

/// What the controllers and the scaling loop are told from elsewhere.
struct Inbox {
    /// Groups whose spec changed: a round at once.
    changed: mpsc::UnboundedReceiver<ObjectRef<QueueConsumerGroup>>,
    /// Groups to reconcile again (a Secret they read changed).
    reconcile: mpsc::UnboundedReceiver<ObjectRef<QueueConsumerGroup>>,
    /// Queues a producer wrote to ([`crate::wake`]).
    wakes: mpsc::Receiver<ObjectRef<CosmosQueue>>,
}

/// The two controllers, the scaling loop and its wakes, until `work` is cancelled.
async fn run_controllers(
    client: &Client,
    config: &Config,
    ctx: Arc<Context>,
    shared: Shared,
    Inbox {
        changed,
        reconcile,
        wakes,
    }: Inbox,
    work: CancellationToken,
) {
    let ns = config.watch_namespace.as_deref();
    let (queue_store, queue_changes) = spec_changes(client, ns, reconcile_requested);
    let limits = controller::Config::default().concurrency(config.reconcile_concurrency);
    let queues = Controller::for_stream(queue_changes, queue_store.clone())
        .with_config(limits.clone())
        .graceful_shutdown_on(work.clone().cancelled_owned());
    // A pause is an annotation: it changes no generation, yet its HPA must go (or come back).
    // So are reconcile and rollout requests.
    let (group_store, group_changes) = spec_changes(client, ns, pause_annotations);
    // The workers' Deployments, as much as the scaling loop reads of them, cached for it (no
    // GET per group per round) from the watch the group controller runs anyway.
    let (deployment_store, deployment_writer) = reflector::store();
    let deployment_events = watcher(
        watch_api::<Deployment>(client, ns),
        watcher::Config::default().labels(MANAGED).any_semantic(),
    )
    .default_backoff()
    .map_ok(crate::cached::event)
    .reflect(deployment_writer);
    let groups = Controller::for_stream(group_changes, group_store.clone())
        .with_config(limits)
        // An owned object's deletion, a spec change by someone else, or (Deployments) a
        // change of its conditions: not every replica count of a rollout or HPA status write.
        .owns_stream(changed_objects(deployment_events, deployment_signature))
        // A key the group reads was rotated (the scaling loop's key checks).
        .reconcile_on(futures::stream::unfold(reconcile, |mut rx| async move {
            rx.recv().await.map(|group| (group, rx))
        }))
        .owns_stream(changes(
            watch_api::<HorizontalPodAutoscaler>(client, ns),
            watcher::Config::default().labels(MANAGED).any_semantic(),
            |hpa: &HorizontalPodAutoscaler| hpa.metadata.generation.unwrap_or(0) as u64,
        ))
        .graceful_shutdown_on(work.clone().cancelled_owned());
    // A queue's spec change (endpoint, credentials) reaches the groups that use it (consume or
    // publish to it; a queue created later reaches the groups waiting for it); its status
    // (written every scaling round) does not.
    let groups_of_queue = group_store.clone();
    let groups = groups.watches_stream(
        changes(
            watch_api::<CosmosQueue>(client, ns),
            watcher::Config::default().any_semantic(),
            |cq: &CosmosQueue| cq.metadata.generation.unwrap_or(0) as u64,
        ),
        move |cq: CosmosQueue| {
            let namespace = cq.namespace();
            groups_of_queue
                .state()
                .into_iter()
                .filter(|g| g.namespace() == namespace && g.uses_queue(&cq.name_any()))
                .map(|g| ObjectRef::from_obj(&*g))
                .collect::<Vec<_>>()
        },
    );

    let queue_loop = queues
        .run(reconcile_queue, error_policy, ctx.clone())
        .for_each(|result| async move {
            if let Err(e) = result {
                warn!(error = %e, "CosmosQueue controller");
            }
        });
    let group_loop = groups
        .run(reconcile_group, error_policy, ctx.clone())
        .for_each(|result| async move {
            if let Err(e) = result {
                warn!(error = %e, "QueueConsumerGroup controller");
            }
        });
    let scaler = Arc::new(Scaler::new(
        ctx.clone(),
        group_store.clone(),
        queue_store.clone(),
        deployment_store.clone(),
    ));
    let interval = config.scale_interval;
    let scaling = async {
        // Scaling needs every cache: a half-filled one would read as "no queue" or "no
        // workers".
        tokio::select! {
            _ = work.cancelled() => return,
            ready = async { tokio::join!(queue_store.wait_until_ready(), group_store.wait_until_ready(), deployment_store.wait_until_ready()) } => {
                if ready.0.is_err() || ready.1.is_err() || ready.2.is_err() {
                    return;
                }
            }
        }
        shared.synced.store(true, Ordering::Relaxed);
        info!(
            queues = queue_store.state().len(),
            groups = group_store.state().len(),
            "caches synced; scaling every {}",
            humantime::format_duration(interval)
        );
        tokio::join!(
            scaler.clone().run(interval, changed, work.clone()),
            crate::wake::run(scaler.clone(), wakes, work.clone()),
        );
    };
    tokio::join!(
        async {
            queue_loop.await;
            info!("CosmosQueue controller stopped");
        },
        async {
            group_loop.await;
            info!("QueueConsumerGroup controller stopped");
        },
        async {
            scaling.await;
            info!("scaling loop stopped");
        }
    );
}

/// Counts the failure and retries after a back-off that grows with this object's failures in
/// a row (the controller's queue deduplicates).
fn error_policy<K, E>(object: Arc<K>, error: &E, ctx: Arc<Context>) -> Action
where
    K: Resource,
    E: ReconcileFailure,
{
    ctx.metrics
        .reconcile_errors
        .with_label_values(&[E::RESOURCE, error.kind()])
        .inc();
    let wait = ctx.failed(E::RESOURCE, object.as_ref());
    warn!(kind = E::RESOURCE, name = %object.name_any(), namespace = ?object.namespace(), %error, retry_in = ?wait, "reconcile failed");
    Action::requeue(wait)
}

/// Marks this replica's pod as leader or not (best effort: a failure only affects which pod
/// the external-metrics Service reaches, and a standby answers 503 there).
async fn label_own_pod(pods: &Api<Pod>, name: &str, leader: bool) {
    let patch = json!({"metadata": {"labels": {LEADER_LABEL: leader.to_string()}}});
    if let Err(e) = pods
        .patch(
            name,
            &PatchParams {
                field_manager: Some(crate::apply::FIELD_MANAGER.into()),
                ..PatchParams::default()
            },
            &Patch::Merge(&patch),
        )
        .await
    {
        warn!(pod = %name, error = %e, "could not label this pod");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trimmed(replicas: i32, generation: i64, image: &str) -> CachedDeployment {
        let d: Deployment = serde_json::from_value(json!({
            "metadata": {"name": "billing-workers", "namespace": "shop", "generation": generation,
                         "annotations": {"cosmosq.io/built-from": "a long record"},
                         "managedFields": [{"manager": "cosmosq-operator"}]},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": "billing"}},
                     "template": {"spec": {"containers": [{"name": "app", "image": image}]}}}
        }))
        .unwrap();
        CachedDeployment::from(d)
    }

    #[test]
    fn a_scale_reconciles_nothing_and_a_spec_change_does() {
        let before = trimmed(1, 1, "example/app:1");
        assert_eq!(
            before.replicas,
            Some(1),
            "the scaling loop reads the replicas"
        );
        assert!(before.metadata.managed_fields.is_none());
        assert!(before.metadata.annotations.is_none());
        let scaled = trimmed(0, 2, "example/app:1");
        assert_eq!(
            deployment_signature(&before),
            deployment_signature(&scaled),
            "a scale bumps the generation only"
        );
        let edited = trimmed(1, 2, "example/app:2");
        assert_ne!(
            deployment_signature(&before),
            deployment_signature(&edited),
            "someone changed the template"
        );
    }

    #[test]
    fn the_cache_keeps_owner_and_conditions_and_not_their_messages_nor_the_labels() {
        let deployment = |available: &str, message: &str, at: &str| {
            let d: Deployment = serde_json::from_value(json!({
                "metadata": {"name": "billing-workers", "namespace": "shop", "uid": "d-1",
                             "labels": {"app.kubernetes.io/managed-by": "cosmosq-operator"},
                             "annotations": {"cosmosq.io/spec-hash": "abc"},
                             "ownerReferences": [{"apiVersion": "cosmosq.io/v1alpha1",
                                 "kind": "QueueConsumerGroup", "name": "billing", "uid": "u-1",
                                 "controller": true}]},
                "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "billing"}},
                         "template": {}},
                "status": {"replicas": 2, "conditions": [
                    {"type": "Available", "status": available, "reason": "MinimumReplicasAvailable",
                     "message": message, "lastUpdateTime": at, "lastTransitionTime": at}]}
            }))
            .unwrap();
            CachedDeployment::from(d)
        };
        let kept = deployment(
            "True",
            "Deployment has minimum availability.",
            "2026-12-06T08:00:00Z",
        );
        assert!(kept.metadata.labels.is_none() && kept.metadata.annotations.is_none());
        assert_eq!(kept.metadata.uid.as_deref(), Some("d-1"));
        assert_eq!(
            kept.metadata.owner_references.as_ref().unwrap()[0].uid,
            "u-1"
        );
        assert_eq!((kept.replicas, kept.running), (Some(2), Some(2)));
        assert_eq!(kept.selector["app"], "billing");
        assert_eq!(
            kept.conditions,
            vec![(
                "Available".to_owned(),
                "True".to_owned(),
                Some("MinimumReplicasAvailable".to_owned())
            )]
        );
        // Another message or time alone is no change; another status is.
        let touched = deployment("True", "Still available.", "2026-12-06T09:00:00Z");
        assert_eq!(deployment_signature(&kept), deployment_signature(&touched));
        let down = deployment(
            "False",
            "Deployment does not have minimum availability.",
            "2026-12-06T09:00:00Z",
        );
        assert_ne!(deployment_signature(&kept), deployment_signature(&down));
    }
}
