//! The sidecar's settings: its flags and environment, and the one contract between the
//! operator and the sidecar. The operator builds a [`SidecarSettings`] from a group's spec and
//! writes it as the container's environment with [`SidecarSettings::to_env`]; the sidecar reads
//! it back with clap (`SidecarSettings::parse`); the demo and the tests build the same type.
//! `tests/it/contract.rs` parses what the operator writes with [`SidecarSettings::from_vars`].

use cosmosq_queue::env;
use std::net::SocketAddr;
use std::time::Duration;

use clap::{CommandFactory, FromArgMatches, Parser, ValueEnum};
use cosmosq_program::telemetry::OtlpArgs;
use cosmosq_queue::host::HostOptions;
use cosmosq_queue::{
    Auth, ConnectionArgs, DeliveryMode, ExclusiveWrites, GroupConfig, QueueConfig, RetryPolicy,
    StartFrom,
};

use crate::app::AppFormat;
use crate::error::SidecarError;

fn duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|e| e.to_string())
}

/// How messages reach the app.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum AppMode {
    /// Posted to the app, one request per message.
    #[default]
    Push,
    /// Received by workers through the localhost API.
    Pull,
}

/// How the sidecar calls the app, as Dapr's `--app-protocol`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum AppProtocol {
    /// Dapr's HTTP pub/sub contract: `GET /dapr/subscribe`, a POST per message.
    #[default]
    Http,
    /// Dapr's gRPC `AppCallback`: `ListTopicSubscriptions`, `OnTopicEvent` per message.
    Grpc,
}

/// A shared secret between the sidecar and the app: never printed (`Debug` says `<redacted>`).
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl Token {
    /// The token, for the one header it goes into.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether `presented` is this token, in time independent of where they differ.
    pub fn matches(&self, presented: &[u8]) -> bool {
        use subtle::ConstantTimeEq;
        self.0.as_bytes().ct_eq(presented).into()
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl std::str::FromStr for Token {
    type Err = std::convert::Infallible;

    /// Takes any value: [`Token::check`] refuses a bad one without printing it (clap's own
    /// errors quote the value).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Token(s.to_owned()))
    }
}

impl Token {
    /// Why the token cannot be used, never saying what it is: it travels in a header, so it is
    /// visible ASCII, and what the app's SDK sends is compared byte for byte (no trimming).
    pub fn check(&self, setting: &str) -> Result<(), String> {
        if self.0.is_empty() {
            return Err(format!("{setting}: empty"));
        }
        if !self.0.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(format!(
                "{setting}: a token is visible ASCII, without spaces or line breaks (the value \
                 is not shown)"
            ));
        }
        Ok(())
    }
}

/// Another queue the app may publish to: the next stage of a pipeline. Its topic is its
/// messages container's name, as the sidecar's own queue's is.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PublishTarget {
    /// The database holding it.
    pub database: String,
    /// Its messages container: the topic the app publishes under.
    pub queue: String,
    /// Its account's endpoint.
    pub endpoint: String,
    /// How to authenticate there: `key`, `identity` or `emulator`.
    #[serde(with = "auth_name")]
    pub auth: Auth,
    /// The file holding that account's key (with `key`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_file: Option<std::path::PathBuf>,
}

impl PublishTarget {
    /// The connection to its account, in the sidecar's region.
    pub fn connection(&self, region: &str) -> ConnectionArgs {
        ConnectionArgs {
            endpoint: self.endpoint.clone(),
            auth: self.auth,
            key: None,
            key_file: self.key_file.clone(),
            region: region.to_owned(),
        }
    }

    /// Its queue's settings.
    pub fn queue_config(&self) -> QueueConfig {
        QueueConfig::new(self.database.clone(), self.queue.clone())
    }
}

/// [`Auth`] by its flag's name in JSON, as `COSMOSQ_AUTH` spells it.
mod auth_name {
    use clap::ValueEnum;
    use cosmosq_queue::Auth;

    pub fn serialize<S: serde::Serializer>(auth: &Auth, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::value_name(*auth))
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Auth, D::Error> {
        let name: String = serde::Deserialize::deserialize(d)?;
        Auth::from_str(&name, true).map_err(serde::de::Error::custom)
    }
}

/// The queues of `--publish-to` (`COSMOSQ_PUBLISH_TO`), a JSON list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PublishTargets(pub Vec<PublishTarget>);

impl std::str::FromStr for PublishTargets {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        serde_json::from_str(text).map(PublishTargets).map_err(|e| {
            format!("a JSON list of {{database, queue, endpoint, auth, keyFile}}: {e}")
        })
    }
}

impl std::fmt::Display for PublishTargets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = serde_json::to_string(&self.0).map_err(|_| std::fmt::Error)?;
        f.write_str(&text)
    }
}

/// Delivers a cosmosq queue to the app next to it.
///
/// Every setting is a flag or the `COSMOSQ_*` variable the operator sets.
#[derive(Parser, Clone, Debug)]
#[command(name = "cosmosq-sidecar", version, args_override_self = true)]
pub struct SidecarSettings {
    /// How to reach the account.
    #[command(flatten)]
    pub connection: ConnectionArgs,
    /// The database holding the queue.
    #[arg(long, env = env::DATABASE)]
    pub database: String,
    /// The queue (messages container).
    #[arg(long, env = env::QUEUE)]
    pub queue: String,
    /// The messages container's partition key path (used when it is created).
    #[arg(long, env = env::PARTITION_KEY_PATH, default_value = "/pk")]
    pub partition_key_path: String,
    /// The consumer group this pod belongs to.
    #[arg(long, env = env::GROUP)]
    pub group: String,
    /// `exclusive` or `stream`.
    #[arg(long, env = env::DELIVERY_MODE, value_enum, default_value_t = DeliveryMode::Exclusive)]
    pub mode: DeliveryMode,
    /// How an exclusive group records deliveries: `lease` or `claims`.
    #[arg(long, env = env::EXCLUSIVE_WRITES, value_enum, default_value_t = ExclusiveWrites::Lease)]
    pub exclusive_writes: ExclusiveWrites,
    /// Where a new group starts: `now` or `beginning`.
    #[arg(long, env = env::START_FROM, value_enum, default_value_t = StartFrom::Now)]
    pub start_from: StartFrom,
    /// FIFO per partition key.
    #[arg(long, env = env::ORDERED, default_value_t = false)]
    pub ordered: bool,
    /// The app's port on localhost (required in push mode; pull workers come to the API).
    #[arg(long, env = env::APP_PORT)]
    pub app_port: Option<u16>,
    /// The path messages are POSTed to.
    #[arg(long, env = env::APP_PATH, default_value = "/")]
    pub app_path: String,
    /// `push`: each message is posted to the app; `pull`: workers receive and settle them
    /// through the localhost API (`/v1/receive`), and the app's port is not waited for.
    #[arg(long, env = env::APP_MODE, value_enum, default_value_t = AppMode::Push)]
    pub app_mode: AppMode,
    /// `http` (Dapr's HTTP pub/sub contract) or `grpc` (Dapr's `AppCallback` service at the
    /// app's port).
    #[arg(long, env = env::APP_PROTOCOL, value_enum, default_value_t = AppProtocol::Http)]
    pub app_protocol: AppProtocol,
    /// What the app receives: `cloudevents` or `raw`.
    #[arg(long, env = env::APP_FORMAT, value_enum, default_value_t = AppFormat::Cloudevents)]
    pub app_format: AppFormat,
    /// Longest the app may take with one message; the lock is renewed meanwhile.
    #[arg(long, env = env::APP_TIMEOUT, default_value = "60s", value_parser = duration)]
    pub app_timeout: Duration,
    /// A declared subscription (one entry of Dapr's `GET /dapr/subscribe` answer, as JSON):
    /// routes by it instead of asking the app.
    #[arg(long, env = env::APP_SUBSCRIPTION)]
    pub app_subscription: Option<String>,
    /// A path answering 2xx when the app is ready; without it, a TCP connect is the check.
    #[arg(long, env = env::APP_HEALTH_PATH)]
    pub app_health_path: Option<String>,
    /// What the app must present (`dapr-api-token` header) to this API, as Dapr's
    /// `DAPR_API_TOKEN`: another container of the pod (or, with `hostNetwork`, the node) cannot
    /// enqueue or settle. The Dapr SDKs send it from the app's own `DAPR_API_TOKEN`.
    /// (The sidecar's own variable, not Dapr's: a developer's shell with `DAPR_API_TOKEN` set
    /// does not turn it on for `cosmosq demo`.)
    #[arg(long, env = env::API_TOKEN, hide_env_values = true)]
    pub api_token: Option<Token>,
    /// What this sidecar presents to the app (`dapr-api-token` header) on every call, as
    /// Dapr's `APP_API_TOKEN`: the app can tell its sidecar's deliveries from anyone's.
    #[arg(long, env = env::APP_API_TOKEN, hide_env_values = true)]
    pub app_api_token: Option<Token>,
    /// Other queues the app may publish to, as a JSON list of `{"database", "queue",
    /// "endpoint", "auth", "keyFile"}` (the operator writes it from `spec.publishTo`): a publish
    /// whose topic is one of those queues is enqueued there.
    #[arg(long, env = env::PUBLISH_TO, default_value = "[]")]
    pub publish_to: PublishTargets,
    /// Deliveries in flight at once.
    #[arg(long, env = env::MAX_CONCURRENCY, default_value_t = 16)]
    pub max_concurrency: usize,
    /// Deliveries before a message is dead-lettered.
    #[arg(long, env = env::MAX_DELIVERY_ATTEMPTS, default_value_t = 10)]
    pub max_delivery_attempts: u32,
    /// Back-off after the first failure.
    #[arg(long, env = env::RETRY_INITIAL_BACKOFF, default_value = "1s", value_parser = duration)]
    pub retry_initial_backoff: Duration,
    /// The longest back-off.
    #[arg(long, env = env::RETRY_MAX_BACKOFF, default_value = "5m", value_parser = duration)]
    pub retry_max_backoff: Duration,
    /// How long a claim is exclusive without renewal.
    #[arg(long, env = env::LOCK_DURATION, default_value = "60s", value_parser = duration)]
    pub lock_duration: Duration,
    /// How often leases are renewed.
    #[arg(long, env = env::LEASE_RENEW, default_value = "17s", value_parser = duration)]
    pub lease_renew: Duration,
    /// Exclusive groups on the lease write path: a delivery still under way after this long
    /// gets a lock of its own (a state document), so it neither holds the range's checkpoint
    /// nor depends on the range's lease.
    #[arg(long, env = env::PROMOTE_AFTER, default_value = "5s", value_parser = duration)]
    pub promote_after: Duration,
    /// How often a range writes its progress: exclusive groups, the starts and completions
    /// waiting to be listed on its lease (a write of its whole window, while messages keep
    /// starting); stream groups, a checkpoint that moved. Longer costs fewer request units on
    /// a busy range, and after a crash more is delivered again, and more with its count
    /// unchanged.
    #[arg(long, env = env::CHECKPOINT_INTERVAL, default_value = "1s", value_parser = duration)]
    pub checkpoint_interval: Duration,
    /// How often free and expired leases are looked for.
    #[arg(long, env = env::LEASE_ACQUIRE, default_value = "13s", value_parser = duration)]
    pub lease_acquire: Duration,
    /// How long an unrenewed lease stays its owner's.
    #[arg(long, env = env::LEASE_EXPIRE, default_value = "60s", value_parser = duration)]
    pub lease_expire: Duration,
    /// Leases per physical partition when the group's leases are created.
    #[arg(long, env = env::LEASES_PER_PARTITION, default_value_t = 1)]
    pub leases_per_partition: u32,
    /// Longest wait between reads of an idle feed range.
    #[arg(long, env = env::MAX_POLL, default_value = "5s", value_parser = duration)]
    pub max_poll: Duration,
    /// Idle ranges of one physical partition share one read of its feed every --max-poll (a
    /// probe) and read by themselves only this often; at --max-poll or less, each range polls
    /// by itself.
    #[arg(long, env = env::IDLE_READ, default_value = "60s", value_parser = duration)]
    pub idle_read: Duration,
    /// How often expired locks and due retries are looked for.
    #[arg(long, env = env::SWEEP_INTERVAL, default_value = "5s", value_parser = duration)]
    pub sweep_interval: Duration,
    /// The localhost API (enqueue, health, metrics); loopback addresses only.
    #[arg(long, env = env::LISTEN, default_value = "127.0.0.1:3500")]
    pub listen: SocketAddr,
    /// Dapr's gRPC API (publish, bulk publish, metadata, shutdown), where Dapr SDKs find it as
    /// `DAPR_GRPC_PORT`; loopback addresses only. Empty to turn off.
    #[arg(long, env = env::GRPC_LISTEN, default_value = "127.0.0.1:50001")]
    pub grpc_listen: String,
    /// Health, readiness and metrics for the kubelet and Prometheus (read-only; the enqueue API
    /// stays on --listen). Empty to turn off.
    #[arg(long, env = env::PROBE_LISTEN, default_value = "0.0.0.0:9464")]
    pub probe_listen: String,
    /// Time to finish in-flight work after SIGTERM (keep it under the pod's grace period).
    #[arg(long, env = env::GRACE_PERIOD, default_value = "25s", value_parser = duration)]
    pub grace_period: Duration,
    /// This pod (downward API); names the host in leases and locks.
    #[arg(long, env = env::POD_NAME)]
    pub pod_name: Option<String>,
    /// This pod's namespace (downward API).
    #[arg(long, env = env::POD_NAMESPACE)]
    pub pod_namespace: Option<String>,
    /// Mark the pod with a higher `controller.kubernetes.io/pod-deletion-cost` while busy
    /// (only in Kubernetes).
    #[arg(long, env = env::POD_DELETION_COST, default_value_t = true, action = clap::ArgAction::Set)]
    pub pod_deletion_cost: bool,
    /// OTLP export of spans: the standard `OTEL_*` variables (off without an endpoint).
    #[command(flatten)]
    pub otlp: OtlpArgs,
}

impl SidecarSettings {
    /// Every check that can run without connecting; the error names the setting.
    pub fn validate(&self) -> Result<(), SidecarError> {
        let bad =
            |setting: &str, why: String| Err(SidecarError::Config(format!("{setting}: {why}")));
        self.connection
            .validate()
            .map_err(|e| SidecarError::Config(e.to_string()))?;
        for (token, setting) in [
            (&self.api_token, "--api-token (COSMOSQ_API_TOKEN)"),
            (
                &self.app_api_token,
                "--app-api-token (COSMOSQ_APP_API_TOKEN)",
            ),
        ] {
            if let Some(token) = token {
                token.check(setting).map_err(SidecarError::Config)?;
            }
        }
        self.queue_config()
            .validate()
            .map_err(|e| SidecarError::Config(e.to_string()))?;
        self.group_config()
            .validate()
            .map_err(|e| SidecarError::Config(e.to_string()))?;
        let mut topics = std::collections::BTreeSet::from([self.queue.as_str()]);
        for target in &self.publish_to.0 {
            let setting = format!("--publish-to (COSMOSQ_PUBLISH_TO) {}", target.queue);
            let config_error =
                |e: cosmosq_queue::QueueError| SidecarError::Config(format!("{setting}: {e}"));
            if target.auth == Auth::Key && target.key_file.is_none() {
                return bad(&setting, "auth key needs keyFile, the key's file".into());
            }
            target.queue_config().validate().map_err(config_error)?;
            target
                .connection(&self.connection.region)
                .validate()
                .map_err(config_error)?;
            if !topics.insert(&target.queue) {
                return bad(
                    &setting,
                    "named twice, or the sidecar's own queue: a topic is one queue".into(),
                );
            }
        }
        self.host_options()
            .validate()
            .map_err(|e| SidecarError::Config(e.to_string()))?;
        match (self.app_mode, self.app_port) {
            (AppMode::Push, None) => {
                return bad(
                    "--app-port (COSMOSQ_APP_PORT)",
                    "required: messages are posted to the app (workers that receive them \
                     need --app-mode pull)"
                        .into(),
                )
            }
            (_, Some(0)) => return bad("--app-port (COSMOSQ_APP_PORT)", "must be 1-65535".into()),
            _ => {}
        }
        if !self.app_path.starts_with('/') {
            return bad(
                "--app-path (COSMOSQ_APP_PATH)",
                format!("{:?} must start with '/'", self.app_path),
            );
        }
        if let Some(path) = &self.app_health_path {
            if !path.starts_with('/') {
                return bad(
                    "--app-health-path (COSMOSQ_APP_HEALTH_PATH)",
                    format!("{path:?} must start with '/'"),
                );
            }
        }
        if self.app_timeout.is_zero() {
            return bad(
                "--app-timeout (COSMOSQ_APP_TIMEOUT)",
                "must be more than 0".into(),
            );
        }
        if self.max_concurrency == 0 {
            return bad(
                "--max-concurrency (COSMOSQ_MAX_CONCURRENCY)",
                "must be at least 1".into(),
            );
        }
        if !self.listen.ip().is_loopback() {
            return bad(
                "--listen (COSMOSQ_LISTEN)",
                format!(
                    "{} is not a loopback address; the API is for the app next to it only",
                    self.listen
                ),
            );
        }
        if let Some(grpc) = self.grpc_addr()? {
            if !grpc.ip().is_loopback() {
                return bad(
                    "--grpc-listen (COSMOSQ_GRPC_LISTEN)",
                    format!(
                        "{grpc} is not a loopback address; the API is for the app next to it only"
                    ),
                );
            }
            let probe_port = self.probe_addr()?.map(|p| p.port());
            if grpc.port() != 0
                && (grpc.port() == self.listen.port()
                    || Some(grpc.port()) == self.app_port
                    || Some(grpc.port()) == probe_port)
            {
                return bad(
                    "--grpc-listen (COSMOSQ_GRPC_LISTEN)",
                    "must use its own port".into(),
                );
            }
        }
        let probe = self.probe_addr()?;
        if probe.is_some_and(|p| p.port() == self.listen.port() || Some(p.port()) == self.app_port)
        {
            return bad(
                "--probe-listen (COSMOSQ_PROBE_LISTEN)",
                "must use its own port".into(),
            );
        }
        if Some(self.listen.port()) == self.app_port {
            return bad("--listen (COSMOSQ_LISTEN)", "uses the app's port".into());
        }
        self.otlp
            .export()
            .map_err(|e| SidecarError::Config(e.to_string()))?;
        Ok(())
    }

    /// Where Dapr's gRPC API listens; `None` when turned off.
    pub fn grpc_addr(&self) -> Result<Option<SocketAddr>, SidecarError> {
        if self.grpc_listen.trim().is_empty() {
            return Ok(None);
        }
        self.grpc_listen.trim().parse().map(Some).map_err(|_| {
            SidecarError::Config(format!(
                "--grpc-listen (COSMOSQ_GRPC_LISTEN): {:?} is not an address such as 127.0.0.1:50001",
                self.grpc_listen
            ))
        })
    }

    /// Where the probe endpoints listen; `None` when turned off.
    pub fn probe_addr(&self) -> Result<Option<SocketAddr>, SidecarError> {
        if self.probe_listen.trim().is_empty() {
            return Ok(None);
        }
        self.probe_listen.trim().parse().map(Some).map_err(|_| {
            SidecarError::Config(format!(
                "--probe-listen (COSMOSQ_PROBE_LISTEN): {:?} is not an address such as 0.0.0.0:9464",
                self.probe_listen
            ))
        })
    }

    /// This sidecar's identity in leases and locks: the pod's name, or a generated one.
    pub fn owner(&self) -> String {
        self.pod_name.clone().unwrap_or_else(|| {
            format!(
                "sidecar-{}",
                &uuid::Uuid::new_v4().simple().to_string()[..8]
            )
        })
    }

    /// The engine's queue settings.
    pub fn queue_config(&self) -> QueueConfig {
        let mut config = QueueConfig::new(self.database.clone(), self.queue.clone());
        config.partition_key_path = self.partition_key_path.clone();
        config
    }

    /// The engine's group settings.
    pub fn group_config(&self) -> GroupConfig {
        GroupConfig::new(self.group.clone())
            .with_mode(self.mode)
            .with_exclusive_writes(self.exclusive_writes)
            .with_start_from(self.start_from)
            .with_ordering(self.ordered)
            .with_lock_duration(self.lock_duration)
            .with_retry(RetryPolicy {
                max_delivery_attempts: self.max_delivery_attempts,
                initial_backoff: self.retry_initial_backoff,
                max_backoff: self.retry_max_backoff,
                ..RetryPolicy::default()
            })
    }

    /// The lease loop's settings.
    pub fn host_options(&self) -> HostOptions {
        let defaults = HostOptions::new(self.owner());
        HostOptions {
            max_concurrency: self.max_concurrency,
            lease_renew: self.lease_renew,
            lease_acquire: self.lease_acquire,
            lease_expire: self.lease_expire,
            leases_per_partition: self.leases_per_partition,
            max_poll: self.max_poll,
            idle_read: self.idle_read,
            sweep_interval: self.sweep_interval,
            promote_after: self.promote_after,
            checkpoint_interval: self.checkpoint_interval,
            // The shortest poll is not a setting here: it follows a maximum set below it.
            min_poll: defaults.min_poll.min(self.max_poll),
            ..defaults
        }
    }

    /// A group's defaults, read from nothing else (not this process's environment): what the
    /// demo and the tests build on before they set what they need.
    pub fn new(database: &str, queue: &str, group: &str) -> Self {
        Self::from_vars([
            (env::DATABASE, database),
            (env::QUEUE, queue),
            (env::GROUP, group),
        ])
        .expect("a database, a queue and a group are all the sidecar needs")
    }

    /// The settings a container environment gives, read from `vars` alone (not this
    /// process's environment), exactly as the sidecar reads its own: a variable it does not
    /// read is an error, so a name the operator misspells fails here, not in a cluster.
    pub fn from_vars<K: AsRef<str>, V: AsRef<str>>(
        vars: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Self, clap::Error> {
        // The same command without its environment: the values come from `vars` only.
        let command = Self::command().mut_args(|arg| arg.env(None::<&str>));
        let with_env = Self::command();
        let mut args = vec!["cosmosq-sidecar".to_owned()];
        for (name, value) in vars {
            let (name, value) = (name.as_ref(), value.as_ref());
            let arg = with_env
                .get_arguments()
                .find(|a| a.get_env().and_then(|e| e.to_str()) == Some(name))
                .ok_or_else(|| {
                    clap::Error::raw(
                        clap::error::ErrorKind::UnknownArgument,
                        format!("the sidecar reads no variable {name}\n"),
                    )
                })?;
            let long = arg.get_long().expect("every setting has a long flag");
            if arg.get_action().takes_values() {
                args.push(format!("--{long}={value}"));
            } else if value == "true" {
                // A switch: its variable is read as a boolean.
                args.push(format!("--{long}"));
            } else if value != "false" {
                return Err(clap::Error::raw(
                    clap::error::ErrorKind::InvalidValue,
                    format!("{name}={value:?}: a switch is true or false\n"),
                ));
            }
        }
        let matches = command.try_get_matches_from(args)?;
        Self::from_arg_matches(&matches)
    }

    /// Every setting as the variable the sidecar reads and a value it parses back to the same
    /// setting: what the operator puts on the sidecar container. Left out are settings with
    /// no value and secrets (the API tokens, the account key), which travel by reference (a
    /// Secret's key, a mounted file), never as a value in the pod's spec.
    pub fn to_env(&self) -> Vec<(&'static str, String)> {
        let duration = |d: Duration| humantime::format_duration(d).to_string();
        let c = &self.connection;
        let mut vars = vec![
            (env::ENDPOINT, c.endpoint.clone()),
            (env::AUTH, value_name(c.auth)),
            (env::REGION, c.region.clone()),
            (env::DATABASE, self.database.clone()),
            (env::QUEUE, self.queue.clone()),
            (env::PARTITION_KEY_PATH, self.partition_key_path.clone()),
            (env::GROUP, self.group.clone()),
            (env::DELIVERY_MODE, value_name(self.mode)),
            (env::EXCLUSIVE_WRITES, value_name(self.exclusive_writes)),
            (env::START_FROM, value_name(self.start_from)),
            (env::ORDERED, self.ordered.to_string()),
            (env::APP_PATH, self.app_path.clone()),
            (env::APP_MODE, value_name(self.app_mode)),
            (env::APP_PROTOCOL, value_name(self.app_protocol)),
            (env::APP_FORMAT, value_name(self.app_format)),
            (env::APP_TIMEOUT, duration(self.app_timeout)),
            (env::MAX_CONCURRENCY, self.max_concurrency.to_string()),
            (
                env::MAX_DELIVERY_ATTEMPTS,
                self.max_delivery_attempts.to_string(),
            ),
            (
                env::RETRY_INITIAL_BACKOFF,
                duration(self.retry_initial_backoff),
            ),
            (env::RETRY_MAX_BACKOFF, duration(self.retry_max_backoff)),
            (env::LOCK_DURATION, duration(self.lock_duration)),
            (env::LEASE_RENEW, duration(self.lease_renew)),
            (env::PROMOTE_AFTER, duration(self.promote_after)),
            (env::CHECKPOINT_INTERVAL, duration(self.checkpoint_interval)),
            (env::LEASE_ACQUIRE, duration(self.lease_acquire)),
            (env::LEASE_EXPIRE, duration(self.lease_expire)),
            (
                env::LEASES_PER_PARTITION,
                self.leases_per_partition.to_string(),
            ),
            (env::MAX_POLL, duration(self.max_poll)),
            (env::IDLE_READ, duration(self.idle_read)),
            (env::SWEEP_INTERVAL, duration(self.sweep_interval)),
            (env::LISTEN, self.listen.to_string()),
            (env::GRPC_LISTEN, self.grpc_listen.clone()),
            (env::PROBE_LISTEN, self.probe_listen.clone()),
            (env::GRACE_PERIOD, duration(self.grace_period)),
            (env::POD_DELETION_COST, self.pod_deletion_cost.to_string()),
        ];
        if !self.publish_to.0.is_empty() {
            vars.push((env::PUBLISH_TO, self.publish_to.to_string()));
        }
        let optional = [
            (
                env::KEY_FILE,
                c.key_file.as_ref().map(|p| p.display().to_string()),
            ),
            (env::APP_PORT, self.app_port.map(|p| p.to_string())),
            (env::APP_SUBSCRIPTION, self.app_subscription.clone()),
            (env::APP_HEALTH_PATH, self.app_health_path.clone()),
            (env::POD_NAME, self.pod_name.clone()),
            (env::POD_NAMESPACE, self.pod_namespace.clone()),
        ];
        vars.extend(
            optional
                .into_iter()
                .filter_map(|(name, value)| Some((name, value?))),
        );
        vars.extend(self.otlp.to_env());
        vars
    }

    /// Timings for consumers that all run on one machine (the demo, the tests): a stopped
    /// holder's leases are taken within about two seconds and an idle range is read every
    /// 100 ms; the API on a free loopback port, no gRPC API, no probe port and no pod to mark.
    pub fn on_one_machine(self) -> Self {
        Self {
            lease_acquire: Duration::from_millis(100),
            lease_renew: Duration::from_millis(300),
            lease_expire: Duration::from_secs(2),
            max_poll: Duration::from_millis(100),
            sweep_interval: Duration::from_millis(100),
            retry_initial_backoff: Duration::from_millis(50),
            retry_max_backoff: Duration::from_millis(200),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            probe_listen: String::new(),
            grpc_listen: String::new(),
            pod_deletion_cost: false,
            ..self
        }
    }
}

/// A setting's value as its flag spells it (`exclusive`, `cloudevents`): clap's own name, so
/// what is written is what is parsed.
fn value_name(value: impl ValueEnum) -> String {
    value
        .to_possible_value()
        .expect("no value of a setting is skipped")
        .get_name()
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(extra: &[&str]) -> Result<SidecarSettings, clap::Error> {
        let mut args = vec![
            "sidecar",
            "--database",
            "db",
            "--queue",
            "orders",
            "--group",
            "billing",
            "--app-port",
            "8080",
        ];
        args.extend_from_slice(extra);
        SidecarSettings::try_parse_from(args)
    }

    #[test]
    fn every_setting_written_is_read_back_as_it_was() {
        let defaults = SidecarSettings::new("db", "orders", "billing");
        let mut changed = defaults.clone().on_one_machine();
        changed.connection.endpoint = "https://acct.documents.azure.com:443/".into();
        changed.connection.auth = cosmosq_queue::Auth::Key;
        changed.connection.key_file = Some("/var/run/cosmosq/key".into());
        changed.connection.region = "westeurope".into();
        changed.partition_key_path = "/tenant".into();
        changed.mode = DeliveryMode::Stream;
        changed.exclusive_writes = ExclusiveWrites::Claims;
        changed.start_from = StartFrom::Beginning;
        changed.ordered = true;
        changed.app_port = Some(9000);
        changed.app_path = "/orders".into();
        changed.app_mode = AppMode::Pull;
        changed.app_format = AppFormat::Raw;
        changed.app_timeout = Duration::from_millis(90_500);
        changed.app_subscription = Some(r#"{"topic":"orders","routes":{"default":"/o"}}"#.into());
        changed.app_health_path = Some("/healthz".into());
        changed.max_concurrency = 3;
        changed.max_delivery_attempts = 7;
        changed.promote_after = Duration::from_secs(2);
        changed.checkpoint_interval = Duration::from_secs(5);
        changed.leases_per_partition = 4;
        changed.idle_read = Duration::from_secs(30);
        changed.grace_period = Duration::from_secs(310);
        changed.pod_name = Some("billing-workers-abc".into());
        changed.pod_namespace = Some("shop".into());
        changed.otlp = OtlpArgs::to_endpoint("http://otel:4318");
        changed.grpc_listen = "127.0.0.1:50002".into();
        changed.app_protocol = AppProtocol::Grpc;
        changed.publish_to = PublishTargets(vec![
            target("invoices", Auth::Key, Some("/var/run/cosmosq/key")),
            target("audit", Auth::Identity, None),
        ]);
        // Every variable the sidecar reads is written, but for the secrets and OTLP settings
        // left unset: a setting added to the struct and forgotten in `to_env` fails here even
        // where its default would read back equal.
        let written: Vec<&str> = changed.to_env().iter().map(|(name, _)| *name).collect();
        for arg in SidecarSettings::command().get_arguments() {
            let Some(name) = arg.get_env().and_then(|e| e.to_str()) else {
                continue;
            };
            let secret = [env::KEY, env::API_TOKEN, env::APP_API_TOKEN].contains(&name);
            let unset_otlp = name.starts_with("OTEL_") && name != "OTEL_EXPORTER_OTLP_ENDPOINT";
            assert!(
                written.contains(&name) || secret || unset_otlp,
                "{name} is never written"
            );
        }
        for settings in [defaults, changed] {
            let read = SidecarSettings::from_vars(settings.to_env()).unwrap();
            assert_eq!(format!("{read:?}"), format!("{settings:?}"));
        }
    }

    fn target(queue: &str, auth: Auth, key_file: Option<&str>) -> PublishTarget {
        PublishTarget {
            database: "db".into(),
            queue: queue.into(),
            endpoint: "https://acct.documents.azure.com:443/".into(),
            auth,
            key_file: key_file.map(Into::into),
        }
    }

    #[test]
    fn publish_targets_are_other_queues_each_once_with_their_credentials() {
        let with = |targets: Vec<PublishTarget>| {
            let mut settings = SidecarSettings::new("db", "orders", "billing");
            settings.app_port = Some(8080);
            settings.publish_to = PublishTargets(targets);
            settings.validate().map_err(|e| e.to_string())
        };
        assert_eq!(with(vec![target("invoices", Auth::Identity, None)]), Ok(()));
        for (targets, said) in [
            (
                vec![target("orders", Auth::Identity, None)],
                "orders: named twice, or the sidecar's own queue",
            ),
            (
                vec![
                    target("invoices", Auth::Identity, None),
                    target("invoices", Auth::Identity, None),
                ],
                "invoices: named twice",
            ),
            (
                vec![target("invoices", Auth::Key, None)],
                "invoices: auth key needs keyFile",
            ),
            (vec![target("in/voices", Auth::Identity, None)], "in/voices"),
        ] {
            let e = with(targets).unwrap_err();
            assert!(e.contains("--publish-to (COSMOSQ_PUBLISH_TO)"), "{e}");
            assert!(e.contains(said), "{e}");
        }
        // As the operator writes it, and a typo refused with what is expected.
        let parsed: PublishTargets = r#"[{"database":"db","queue":"invoices","endpoint":"https://a.documents.azure.com:443/","auth":"key","keyFile":"/k"}]"#
            .parse()
            .unwrap();
        assert_eq!(parsed.0[0].auth, Auth::Key);
        let e = r#"[{"database":"db","queue":"q","endpoint":"e","auth":"key","keyfile":"/k"}]"#
            .parse::<PublishTargets>()
            .unwrap_err();
        assert!(e.contains("unknown field `keyfile`"), "{e}");
        let e = r#"[{"database":"db","queue":"q","endpoint":"e","auth":"password"}]"#
            .parse::<PublishTargets>()
            .unwrap_err();
        assert!(e.contains("password"), "{e}");
    }

    #[test]
    fn secrets_are_never_written_as_values() {
        let mut settings = SidecarSettings::new("db", "q", "g");
        settings.connection.key = Some("account-key".into());
        settings.api_token = Some("api-token".parse().unwrap());
        settings.app_api_token = Some("app-api-token".parse().unwrap());
        let env = settings.to_env();
        let names: Vec<_> = env.iter().map(|(name, _)| *name).collect();
        for secret in [env::KEY, env::API_TOKEN, env::APP_API_TOKEN] {
            assert!(!names.contains(&secret), "{secret} in {names:?}");
        }
        assert!(
            !format!("{env:?}").contains("token") && !format!("{env:?}").contains("account-key")
        );
    }

    #[test]
    fn a_variable_the_sidecar_does_not_read_is_refused() {
        let err = SidecarSettings::from_vars([(env::DATABASE, "db"), ("COSMOSQ_LOCK", "1s")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("COSMOSQ_LOCK"), "{err}");
        let err = SidecarSettings::from_vars([(env::ORDERED, "yes")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("true or false"), "{err}");
    }

    #[test]
    fn defaults_are_valid() {
        let config = parse(&[]).unwrap();
        config.validate().unwrap();
        assert_eq!(config.lock_duration, Duration::from_secs(60));
        assert_eq!(config.host_options().lease_renew, Duration::from_secs(17));
        assert_eq!(config.listen.to_string(), "127.0.0.1:3500");
        // What the lease loop is given, the library's default unless set.
        assert_eq!(
            config.host_options().checkpoint_interval,
            HostOptions::new("x").checkpoint_interval
        );
        let set = parse(&["--checkpoint-interval", "5s"]).unwrap();
        assert_eq!(
            set.host_options().checkpoint_interval,
            Duration::from_secs(5)
        );
        // A maximum poll under the library's shortest is taken, the shortest following it.
        let fast = parse(&["--max-poll", "10ms"]).unwrap();
        fast.validate().unwrap();
        assert_eq!(fast.host_options().min_poll, Duration::from_millis(10));
    }

    #[test]
    fn each_invalid_setting_is_named() {
        let cases: &[(&[&str], &str)] = &[
            (&["--listen", "0.0.0.0:3500"], "--listen"),
            (&["--app-path", "messages"], "--app-path"),
            (&["--max-delivery-attempts", "0"], "maxDeliveryAttempts"),
            (&["--group", "a|b"], "group name"),
            (&["--lease-renew", "90s"], "leaseRenew"),
            (&["--sweep-interval", "0s"], "sweepInterval"),
            (&["--checkpoint-interval", "0s"], "checkpointInterval"),
            (&["--lease-acquire", "0ms"], "leaseAcquire"),
            (&["--max-poll", "0s"], "maxPoll"),
            (&["--idle-read", "0s"], "idleRead"),
            (&["--auth", "key"], "--key"),
            (&["--listen", "127.0.0.1:8080"], "--listen"),
            (&["--probe-listen", "0.0.0.0:3500"], "--probe-listen"),
            (&["--probe-listen", "nowhere"], "--probe-listen"),
        ];
        for (args, setting) in cases {
            let err = parse(args).unwrap().validate().unwrap_err().to_string();
            assert!(err.contains(setting), "{args:?}: {err}");
        }
        let err = parse(&["--app-timeout", "soon"]).unwrap_err().to_string();
        assert!(err.contains("--app-timeout"), "{err}");
    }

    #[test]
    fn only_pushed_deliveries_need_the_apps_port() {
        let without_port = SidecarSettings::new("db", "q", "g");
        let pull = SidecarSettings {
            app_mode: AppMode::Pull,
            ..without_port.clone()
        };
        pull.validate().unwrap();
        let err = without_port.validate().unwrap_err().to_string();
        assert!(err.contains("--app-port") && err.contains("pull"), "{err}");
        let zero = SidecarSettings {
            app_port: Some(0),
            ..without_port
        };
        let err = zero.validate().unwrap_err().to_string();
        assert!(err.contains("1-65535"), "{err}");
    }
}
