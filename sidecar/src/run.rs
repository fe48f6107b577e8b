//! Wiring: connect, wait for the app, serve the local API, run the lease loop, drain.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use cosmosq_program::telemetry::Telemetry;
use cosmosq_queue::host::Host;
use cosmosq_queue::pull::Pull;
use cosmosq_queue::{CosmosClient, Delivery, Handler, Outcome, Queue};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::api::{self, ApiState};
use crate::callback::GrpcTransport;
use crate::deletion_cost::{self, PodPatcher};
use crate::delivery::AppClient;
use crate::error::SidecarError;
use crate::metrics::SidecarMetrics;
use crate::settings::{AppMode, AppProtocol, SidecarSettings};
use crate::spans;
use crate::subscribe;
use crate::transport::{HttpTransport, Transport};

/// Who takes the group's deliveries: the app pushed to, or the workers' pull queue.
enum App {
    Push(Arc<AppClient<Transport>>),
    Pull(Pull),
}

/// The group's handler: each delivery attempt in its span, whoever takes it.
struct Traced {
    app: App,
    telemetry: Telemetry,
}

impl Handler for Traced {
    async fn handle(&self, mut delivery: Delivery) -> Outcome {
        let span = spans::process(&self.telemetry, &mut delivery);
        let outcome = match &self.app {
            App::Push(app) => app.handle(delivery).await,
            App::Pull(pull) => pull.handle(delivery).await,
        };
        spans::settled(span, &outcome);
        outcome
    }
}

/// The queues of `--publish-to`, each through the sidecar's own client when it is on the same
/// account with the same credentials, else through a client of its own. A queue that cannot
/// be opened stops the start, as the sidecar's own queue does (as daprd stops on a component
/// that fails to initialise): an app would otherwise learn it only from its publishes.
async fn open_publish_targets(
    config: &SidecarSettings,
    client: &CosmosClient,
) -> Result<Vec<Queue>, SidecarError> {
    let own = &config.connection;
    let mut queues = Vec::new();
    for target in &config.publish_to.0 {
        let same_account = own.key.is_none()
            && target.endpoint == own.endpoint
            && target.auth == own.auth
            && target.key_file == own.key_file;
        let opened = async {
            let client = match same_account {
                true => client.clone(),
                false => target.connection(&own.region).connect().await?,
            };
            Queue::open(&client, target.queue_config()).await
        };
        let queue = opened.await.map_err(|e| {
            SidecarError::Config(format!(
                "--publish-to (COSMOSQ_PUBLISH_TO) queue {}/{} at {}: {e}",
                target.database, target.queue, target.endpoint
            ))
        })?;
        info!(queue = %target.queue, database = %target.database, "the app may publish to this queue too");
        queues.push(queue);
    }
    Ok(queues)
}

/// Connects with the configured account and runs until `shutdown` has been drained.
pub async fn run(config: SidecarSettings, shutdown: CancellationToken) -> Result<(), SidecarError> {
    config.validate()?;
    let client = config.connection.connect().await?;
    run_with_client(config, client, shutdown).await
}

/// [`run`] on a client made elsewhere (tests use the emulator's in-process client).
pub async fn run_with_client(
    config: SidecarSettings,
    client: CosmosClient,
    shutdown: CancellationToken,
) -> Result<(), SidecarError> {
    run_on(config, client, None, shutdown).await
}

/// [`run_with_client`] serving the local API on a listener the caller bound (the demo binds it
/// first, so that its app knows the sidecar's port, as `DAPR_HTTP_PORT` tells a pod's app);
/// `--listen` is not bound.
pub async fn run_with_listener(
    config: SidecarSettings,
    client: CosmosClient,
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
) -> Result<(), SidecarError> {
    run_on(config, client, Some(listener), shutdown).await
}

async fn run_on(
    config: SidecarSettings,
    client: CosmosClient,
    listener: Option<tokio::net::TcpListener>,
    shutdown: CancellationToken,
) -> Result<(), SidecarError> {
    config.validate()?;
    let telemetry = Telemetry::start(&config.otlp, "cosmosq-sidecar")
        .map_err(|e| SidecarError::Config(e.to_string()))?;
    let result = serve(config, client, listener, shutdown, telemetry.clone()).await;
    // The last spans (the drain's deliveries among them) are sent before the process ends.
    telemetry.shutdown().await;
    result
}

async fn serve(
    config: SidecarSettings,
    client: CosmosClient,
    listener: Option<tokio::net::TcpListener>,
    shutdown: CancellationToken,
    telemetry: Telemetry,
) -> Result<(), SidecarError> {
    let queue = Queue::open(&client, config.queue_config())
        .await
        .map_err(|e| {
            SidecarError::Config(format!(
                "queue {}/{} (is it provisioned? the operator creates it): {e}",
                config.database, config.queue
            ))
        })?;
    let publish_to = open_publish_targets(&config, &client).await?;
    let group = queue.group(config.group_config())?;
    let metrics = Arc::new(SidecarMetrics::new(&config.queue, &config.group));
    let options = config.host_options();
    let owner = options.holder();
    // The app pushed to, at its port; or none: pull workers come to the API.
    let (pushed, handler, puller) = match (config.app_mode, config.app_port) {
        (AppMode::Push, Some(port)) => {
            let transport = match config.app_protocol {
                AppProtocol::Http => Transport::Http(HttpTransport::new(
                    port,
                    &config.app_path,
                    config.app_format,
                    config.app_timeout,
                    config.app_api_token.as_ref(),
                )),
                AppProtocol::Grpc => Transport::Grpc(GrpcTransport::new(
                    port,
                    config.app_timeout,
                    config.app_api_token.as_ref(),
                )),
            };
            let app = Arc::new(AppClient::new(transport, Arc::clone(&metrics)));
            (Some((Arc::clone(&app), port)), App::Push(app), None)
        }
        (AppMode::Push, None) => {
            return Err(SidecarError::Config(
                "--app-port (COSMOSQ_APP_PORT): required in push mode".into(),
            ))
        }
        (AppMode::Pull, _) => {
            let (pull, puller) = cosmosq_queue::pull::pull();
            (
                None,
                App::Pull(pull.stopping_with(shutdown.clone())),
                Some(puller),
            )
        }
    };
    let handler = Traced {
        app: handler,
        telemetry: telemetry.clone(),
    };
    let host = Host::new(group.clone(), handler, options);
    let state = Arc::new(ApiState {
        queue: queue.clone(),
        publish_to,
        metrics: Arc::clone(&metrics),
        stats: host.stats(),
        ready: false.into(),
        stopping: shutdown.clone(),
        drained: CancellationToken::new(),
        pubsub_name: std::sync::OnceLock::new(),
        subscribed: CancellationToken::new(),
        subscription: std::sync::OnceLock::new(),
        about: crate::dapr::metadata::About {
            id: config.group.clone(),
            app_port: config.app_port.filter(|_| config.app_mode == AppMode::Push),
            max_concurrency: config.max_concurrency,
            protocol: match config.app_protocol {
                AppProtocol::Http => "http",
                AppProtocol::Grpc => "grpc",
            },
        },
        attributes: Default::default(),
        puller,
        telemetry,
    });

    let listener = match listener {
        Some(listener) => listener,
        None => tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|e| {
                SidecarError::Config(format!("--listen (COSMOSQ_LISTEN) {}: {e}", config.listen))
            })?,
    };
    let api_stop = CancellationToken::new();
    // The local API, Dapr's gRPC API and the probes: each stopped by `api_stop`.
    let mut servers = Vec::new();
    {
        let stop = api_stop.clone();
        let router = api::guarded(api::router(Arc::clone(&state)), config.api_token.clone());
        servers.push(tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, router)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
            {
                warn!(error = %e, "the local API stopped");
            }
        }));
    }
    if let Some(addr) = config.grpc_addr()? {
        // Optional for the app: a port taken (an app of its own on 50001) costs the gRPC API,
        // not the pod's deliveries.
        match tokio::net::TcpListener::bind(addr).await {
            Ok(listener) => {
                info!(grpc = %listener.local_addr().unwrap_or(addr), "serving Dapr's gRPC API");
                let api =
                    crate::dapr::grpc::DaprApi::new(Arc::clone(&state), config.api_token.clone());
                let stop = api_stop.clone();
                servers.push(tokio::spawn(async move {
                    if let Err(e) = crate::dapr::grpc::serve(api, listener, stop).await {
                        warn!(error = %e, "Dapr's gRPC API stopped");
                    }
                }));
            }
            Err(e) => warn!(
                %addr, error = %e,
                "Dapr's gRPC API is not served: --grpc-listen (COSMOSQ_GRPC_LISTEN) cannot be bound"
            ),
        }
    }
    if let Some(addr) = config.probe_addr()? {
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
            SidecarError::Config(format!("--probe-listen (COSMOSQ_PROBE_LISTEN) {addr}: {e}"))
        })?;
        let stop = api_stop.clone();
        let router = api::probe_router(Arc::clone(&state));
        servers.push(tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, router)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
            {
                warn!(error = %e, "the probe endpoints stopped");
            }
        }));
    }
    info!(listen = %config.listen, queue = %config.queue, group = %config.group, %owner, "sidecar started; waiting for the app");

    let background = CancellationToken::new();
    // Nothing is delivered to routes the app did not mean: broken subscriptions stop the
    // sidecar, saying why.
    let started = match &pushed {
        // Workers come to the sidecar: there is no app port to wait for.
        None => Ok(true),
        Some((app, port)) => start_pushing(app, *port, &config, &state, &shutdown).await,
    };
    state.subscribed.cancel();
    if !matches!(started, Ok(true)) {
        state.drained.cancel();
        api_stop.cancel();
        futures::future::join_all(servers).await;
        return started.map(|_| ());
    }
    state.ready.store(true, Ordering::Relaxed);
    info!(app_port = ?config.app_port, "the app is ready; taking leases");

    // The background tasks, each stopped by `background` and awaited before the sidecar ends.
    let tasks = TaskTracker::new();
    {
        let (group, metrics, stop, owner) = (
            group.clone(),
            Arc::clone(&metrics),
            background.clone(),
            owner.clone(),
        );
        tasks.spawn(async move { estimate_loop(group, metrics, owner, stop).await });
    }
    if config.pod_deletion_cost {
        if let (Some(namespace), Some(pod)) = (&config.pod_namespace, &config.pod_name) {
            match PodPatcher::in_cluster(namespace, pod) {
                Ok(Some(patcher)) => {
                    tasks.spawn(deletion_cost::run(
                        patcher,
                        metrics.in_flight.clone(),
                        deletion_cost::IDLE_AFTER,
                        background.clone(),
                    ));
                }
                Ok(None) => {}
                Err(e) => warn!(error = %e, "pod deletion cost disabled"),
            }
        }
    }

    let result = host.run(shutdown.clone()).await;
    state.ready.store(false, Ordering::Relaxed);
    state.drained.cancel();
    background.cancel();
    tasks.close();
    tasks.wait().await;
    api_stop.cancel();
    futures::future::join_all(servers).await;
    info!("sidecar drained: deliveries settled, leases released");
    result.map_err(SidecarError::from)
}

/// Waits for the app at `port`, then sets up its subscription: `Ok(false)` if shut down
/// first; an error for a subscription that cannot be followed (nothing is delivered to routes
/// the app did not mean).
async fn start_pushing(
    app: &AppClient<Transport>,
    port: u16,
    config: &SidecarSettings,
    state: &ApiState,
    shutdown: &CancellationToken,
) -> Result<bool, SidecarError> {
    let known = |subscription: &subscribe::Subscription| {
        let _ = state.pubsub_name.set(subscription.pubsub_name.clone());
        let declared = config.app_subscription.is_some();
        let listed = crate::dapr::metadata::listed(subscription, &config.queue, declared);
        let _ = state.subscription.set(listed);
        state.subscribed.cancel();
    };
    // A declared subscription is known before the app answers: its pub/sub name is usable at
    // once.
    let declared = config
        .app_subscription
        .as_ref()
        .map(|entry| subscribe::declared(entry, &config.queue))
        .transpose()
        .map_err(|e| SidecarError::Config(e.to_string()))?;
    if let Some(subscription) = &declared {
        known(subscription);
    }
    if !wait_for_app(port, config, shutdown).await {
        return Ok(false);
    }
    let discovered = match (declared, app.transport()) {
        (Some(subscription), _) => Ok(Some(subscription)),
        (None, Transport::Http(_)) => {
            subscribe::discover(port, &config.queue, config.app_api_token.as_ref()).await
        }
        (None, Transport::Grpc(grpc)) => grpc.subscriptions(&config.queue).await,
    };
    let subscription = discovered.map_err(|e| SidecarError::Config(e.to_string()))?;
    // Over gRPC there is no path to fall back to: an app that does not subscribe to the queue
    // would have every message dead-lettered; it is refused instead, saying why.
    if subscription.is_none() && matches!(app.transport(), Transport::Grpc(_)) {
        return Err(SidecarError::Config(format!(
            "--app-protocol grpc: the app's ListTopicSubscriptions lists no subscription to \
             topic {:?} (the queue); subscribe to it, or declare the subscription in the group",
            config.queue
        )));
    }
    if let Some(subscription) = subscription {
        known(&subscription);
        app.transport().subscribe(subscription);
    }
    Ok(true)
}

/// Waits until the app answers (its health path with 2xx, or a TCP connect). `false` if
/// shut down first.
async fn wait_for_app(port: u16, config: &SidecarSettings, shutdown: &CancellationToken) -> bool {
    let http = crate::transport::app_http(config.app_api_token.as_ref())
        .timeout(Duration::from_secs(2))
        .build()
        .expect("plain client");
    let mut delay = Duration::from_millis(100);
    loop {
        // A gRPC app's health is its port (`app.healthPath` is an HTTP path).
        let health_path = match config.app_protocol {
            AppProtocol::Http => config.app_health_path.as_ref(),
            AppProtocol::Grpc => None,
        };
        let ready = match health_path {
            Some(path) => http
                .get(format!("http://127.0.0.1:{port}{path}"))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success()),
            None => tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok(),
        };
        if ready {
            return true;
        }
        tokio::select! {
            _ = shutdown.cancelled() => return false,
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(Duration::from_secs(2));
    }
}

/// Publishes the remaining work of the ranges this pod owns (lag and backlog per owned
/// range). The group-wide estimate is the operator's, once per group; of the group's dead
/// letters only the pod that owns the first range reports a count (bounded), so a group's
/// pods do not all read them.
async fn estimate_loop(
    group: cosmosq_queue::Group,
    metrics: Arc<SidecarMetrics>,
    owner: String,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(15));
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let owns_first_range = match group.estimate_owned(&owner).await {
            Ok(estimate) => {
                metrics.record_estimate(&estimate, &owner);
                estimate.ranges.iter().any(|r| r.min_epk.is_empty())
            }
            Err(e) => {
                warn!(error = %e, "estimating the backlog failed");
                false
            }
        };
        if owns_first_range {
            if let Ok(dead) = group.count_dead_letters(DEAD_LETTER_COUNT_LIMIT).await {
                metrics.dead_letters.set(dead as i64);
            }
        }
    }
}

/// The most dead letters a sidecar counts (the gauge then reads this many).
const DEAD_LETTER_COUNT_LIMIT: usize = 10_000;
