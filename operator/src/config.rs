//! The operator's configuration, by flags and environment (the Helm chart sets both).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

fn duration(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if d.is_zero() {
        return Err("must be more than 0".into());
    }
    Ok(d)
}

/// Reconciles CosmosQueues and QueueConsumerGroups and scales their workers.
///
/// Every setting is a flag or its `COSMOSQ_*` variable (`POD_*` from the downward API).
#[derive(Parser, Clone, Debug)]
#[command(name = "cosmosq-operator", version, args_override_self = true)]
#[command(group(clap::ArgGroup::new("serving").args(["tls_cert_file", "serving_cert_secret"])))]
pub struct Config {
    /// The sidecar image injected into worker pods (a group's spec.sidecar.image overrides it).
    #[arg(
        long,
        env = "COSMOSQ_SIDECAR_IMAGE",
        default_value = concat!("ghcr.io/cosmosq/cosmosq-sidecar:", env!("CARGO_PKG_VERSION"))
    )]
    pub sidecar_image: String,
    /// Whether an upgrade of the operator (a new sidecar image or pod template) rolls the
    /// groups' workers by itself: `manual` (default) waits for each group's next spec change
    /// or `cosmosq.io/rollout-requested-at`; `rolling` rolls them, a few at a time.
    #[arg(long, env = "COSMOSQ_SIDECAR_UPDATE", value_enum, default_value_t)]
    pub sidecar_update: crate::rollout::SidecarUpdate,
    /// How many groups may roll at once for the operator's reasons or a rotated key.
    #[arg(long, env = "COSMOSQ_SIDECAR_UPDATE_MAX_CONCURRENT", default_value_t = 5, value_parser = clap::value_parser!(u16).range(1..))]
    pub sidecar_update_max_concurrent: u16,
    /// The ClusterRole every group's RoleBinding grants its workers (the chart's
    /// `<release>-worker`).
    #[arg(long, env = "COSMOSQ_WORKER_CLUSTER_ROLE", default_value = crate::build::WORKER_CLUSTER_ROLE)]
    pub worker_cluster_role: String,
    /// Health and readiness probes (plain HTTP, no authentication, nothing else).
    #[arg(long, env = "COSMOSQ_LISTEN", default_value = "0.0.0.0:8080")]
    pub listen: SocketAddr,
    /// `/metrics` (for bearer tokens whose holder may `get` the non-resource URL `/metrics`),
    /// the external metrics API and the KEDA endpoint over TLS, when --tls-cert-file and
    /// --tls-key-file (read again when they change) or --serving-cert-secret are set.
    #[arg(long, env = "COSMOSQ_SECURE_LISTEN", default_value = "0.0.0.0:6443")]
    pub secure_listen: SocketAddr,
    /// Also serve `/metrics` here without authentication: a loopback address, for
    /// kube-rbac-proxy in the same pod or a local run. Off by default: the series name every
    /// namespace's queues and backlogs.
    #[arg(long, env = "COSMOSQ_INSECURE_METRICS_LISTEN")]
    pub insecure_metrics_listen: Option<SocketAddr>,
    /// Serve the web console here (off by default): the queues of every CosmosQueue, to
    /// callers who sign in with a Kubernetes token, each cut to what its RBAC allows. Keep it
    /// on loopback (`127.0.0.1:8090`): `kubectl port-forward` reaches it, other pods do not.
    #[arg(long, env = "COSMOSQ_CONSOLE_LISTEN")]
    pub console_listen: Option<SocketAddr>,
    /// How often the console reads every queue and group (each read costs request units).
    #[arg(long, env = "COSMOSQ_CONSOLE_SAMPLE_EVERY", default_value = "15s", value_parser = duration)]
    pub console_sample_every: Duration,
    /// The serving certificate (PEM) of the TLS listener.
    #[arg(
        long,
        env = "COSMOSQ_TLS_CERT_FILE",
        requires = "tls_key_file",
        conflicts_with = "serving_cert_secret"
    )]
    pub tls_cert_file: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, env = "COSMOSQ_TLS_KEY_FILE", requires = "tls_cert_file")]
    pub tls_key_file: Option<PathBuf>,
    /// Issue the TLS listener's serving certificate (and its CA) itself, kept in this Secret of
    /// the operator's namespace (--lease-namespace): the leader renews it at 2/3 of its life and
    /// rotates the CA with an overlap; every replica serves what the Secret holds.
    #[arg(
        long,
        env = "COSMOSQ_SERVING_CERT_SECRET",
        requires = "serving_cert_service"
    )]
    pub serving_cert_secret: Option<String>,
    /// The Service (of the operator's namespace) the issued certificate names:
    /// `<service>.<namespace>.svc`, `<service>.<namespace>`, `<service>`.
    #[arg(
        long,
        env = "COSMOSQ_SERVING_CERT_SERVICE",
        requires = "serving_cert_secret"
    )]
    pub serving_cert_service: Option<String>,
    /// The life of an issued serving certificate.
    #[arg(long, env = "COSMOSQ_SERVING_CERT_VALIDITY", default_value = "365d", value_parser = duration)]
    pub serving_cert_validity: Duration,
    /// The life of an issued CA.
    #[arg(long, env = "COSMOSQ_SERVING_CA_VALIDITY", default_value = "3650d", value_parser = duration)]
    pub serving_ca_validity: Duration,
    /// The APIService whose `spec.caBundle` (only) the leader keeps to the issued CAs (the
    /// chart's `v1beta1.external.metrics.k8s.io`).
    #[arg(long, env = "COSMOSQ_API_SERVICE", requires = "serving_cert_secret")]
    pub api_service: Option<String>,
    /// Serve `/keda/namespaces/<ns>/queueconsumergroups/<name>` on the TLS listener, for
    /// callers whose bearer token may `get` that QueueConsumerGroup.
    #[arg(long, env = "COSMOSQ_KEDA_ENDPOINT", default_value_t = false, action = clap::ArgAction::Set, requires = "serving")]
    pub keda_endpoint: bool,
    /// Serve `POST /v1/namespaces/<ns>/cosmosqueues/<name>/wake` on the TLS listener: a
    /// producer whose bearer token may `create` `cosmosqueues/wake` of that queue says it wrote
    /// to it, and the queue's groups at zero are looked at at once instead of at the next round.
    #[arg(long, env = "COSMOSQ_WAKE_ENDPOINT", default_value_t = true, action = clap::ArgAction::Set)]
    pub wake_endpoint: bool,
    /// The audience a bearer token for the KEDA and wake endpoints must be minted for
    /// (`kubectl create token <account> --audience cosmosq`): a token for the API server or any
    /// other audience is refused, so one handed out elsewhere cannot be replayed to it.
    #[arg(long, env = "COSMOSQ_TOKEN_AUDIENCE", default_value = crate::auth::DEFAULT_TOKEN_AUDIENCE, value_parser = clap::builder::NonEmptyStringValueParser::new())]
    pub token_audience: String,
    /// How often every group's remaining work is estimated and its replicas decided.
    #[arg(long, env = "COSMOSQ_SCALE_INTERVAL", default_value = "15s", value_parser = duration)]
    pub scale_interval: Duration,
    /// Reconciles in flight at once, per kind (0: no limit). Each holds an API connection and
    /// its buffers: a start with hundreds of objects otherwise opens hundreds at once.
    #[arg(long, env = "COSMOSQ_RECONCILE_CONCURRENCY", default_value_t = 8)]
    pub reconcile_concurrency: u16,
    /// Watch only this namespace (all namespaces when unset).
    #[arg(long, env = "COSMOSQ_WATCH_NAMESPACE")]
    pub watch_namespace: Option<String>,
    /// Elect a leader among replicas with a coordination Lease; only the leader acts.
    #[arg(long, env = "COSMOSQ_LEADER_ELECTION", default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_election: bool,
    /// The leader Lease's name.
    #[arg(
        long,
        env = "COSMOSQ_LEADER_ELECTION_LEASE",
        default_value = "cosmosq-operator"
    )]
    pub lease_name: String,
    /// Namespace of the leader Lease: the operator's own.
    #[arg(long, env = "POD_NAMESPACE", default_value = "cosmosq-system")]
    pub lease_namespace: String,
    /// This replica's identity in the Lease and in Events.
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Namespaces whose workloadIdentity queues may use the operator's own Entra identity, per
    /// account and database: `shop,billing@https://acct.documents.azure.com:443/shop-db`
    /// (`/*` for every database; repeat the flag, or separate grants with `;` in the
    /// environment). None by default.
    #[arg(
        long = "identity-grant",
        env = "COSMOSQ_IDENTITY_GRANTS",
        value_delimiter = ';'
    )]
    pub identity_grants: Vec<crate::grants::IdentityGrant>,
    /// Accounts where the operator's identity creates what a granted workloadIdentity queue
    /// is missing (and deletes its containers at `deletionPolicy: Delete`) through Azure
    /// Resource Manager: `<endpoint>=<account resource id>`, e.g.
    /// `https://acct.documents.azure.com:443/=/subscriptions/<id>/resourceGroups/<group>/providers/Microsoft.DocumentDB/databaseAccounts/acct`
    /// (repeat the flag, or separate with `;` in the environment). The identity needs a role
    /// there such as "Cosmos DB Operator" (docs/identity.md). None by default: an admin
    /// creates the containers.
    #[arg(
        long = "identity-management",
        env = "COSMOSQ_IDENTITY_MANAGEMENT",
        value_delimiter = ';'
    )]
    pub identity_management: Vec<crate::arm::ManagementScope>,
    /// The Azure Resource Manager endpoint (https; sovereign clouds have their own, e.g.
    /// `https://management.usgovcloudapi.net`).
    #[arg(long, env = "COSMOSQ_ARM_ENDPOINT", default_value = crate::arm::scope::DEFAULT_ENDPOINT)]
    pub arm_endpoint: crate::arm::ArmEndpoint,
    /// The most request units per second a queue may ask for (`spec.throughput`) on a
    /// container the operator creates through ARM: the account's admin pays for them. Unset,
    /// a queue there may not ask for any; its containers get the account's default.
    #[arg(long, env = "COSMOSQ_ARM_MAX_THROUGHPUT")]
    pub arm_max_throughput: Option<u32>,
    /// Endpoints queues may name besides Azure's account endpoints
    /// (`https://<account>.documents.azure.{com,us,cn}:443`): `[scheme://]host[:port]`, with
    /// `*.` for one label, e.g. an emulator `http://cosmos-emulator.dev.svc:8081` (repeat the
    /// flag, or separate with `,` in the environment). The operator dials no other endpoint.
    #[arg(
        long = "allowed-endpoint",
        env = "COSMOSQ_ALLOWED_ENDPOINTS",
        value_delimiter = ','
    )]
    pub allowed_endpoints: Vec<crate::endpoint::EndpointPattern>,
    /// The Azure region the Cosmos DB SDK should prefer.
    #[arg(long, env = "COSMOSQ_REGION", default_value = "eastus")]
    pub region: String,
    /// Shutdown grace: how long in-flight reconciles may take after SIGTERM.
    #[arg(long, env = "COSMOSQ_GRACE_PERIOD", default_value = "20s", value_parser = duration)]
    pub grace_period: Duration,
    /// OTLP export of reconcile spans: the standard `OTEL_*` variables (off without an
    /// endpoint).
    #[command(flatten)]
    pub otlp: cosmosq_program::telemetry::OtlpArgs,
    /// Without a command the operator runs.
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// What else the operator's binary does.
#[derive(clap::Subcommand, Clone, Debug)]
pub enum Command {
    /// Checks an installed operator and exits: its CRDs established, a ready replica, a leader
    /// renewing its Lease (the chart's `helm test`).
    Check(crate::check::CheckArgs),
}

impl Config {
    /// The identity in the Lease: the pod's name, or a unique fallback outside a pod.
    pub fn identity(&self) -> String {
        self.identity
            .clone()
            .unwrap_or_else(|| format!("cosmosq-operator-{}", uuid::Uuid::new_v4().simple()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_suit_a_cluster() {
        let config = Config::try_parse_from(["cosmosq-operator"]).unwrap();
        assert!(config.leader_election);
        assert_eq!(config.scale_interval, Duration::from_secs(15));
        assert_eq!(config.listen.port(), 8080);
        assert_eq!(
            config.insecure_metrics_listen, None,
            "no /metrics without auth"
        );
        assert_eq!(config.console_listen, None, "no console unless asked for");
        assert_eq!(config.token_audience, "cosmosq");
        assert_eq!(config.reconcile_concurrency, 8);
        assert!(config
            .sidecar_image
            .starts_with("ghcr.io/cosmosq/cosmosq-sidecar:"));
    }

    #[test]
    fn identity_grants_come_as_the_chart_renders_them() {
        let config = Config::try_parse_from([
            "cosmosq-operator",
            "--identity-grant=shop,billing@https://a.documents.azure.com:443/shop,billing",
            "--identity-grant=*@https://shared.documents.azure.com/*",
        ])
        .unwrap();
        assert_eq!(config.identity_grants.len(), 2);
        assert_eq!(config.identity_grants[0].namespaces, ["shop", "billing"]);
        assert_eq!(config.identity_grants[0].databases, ["shop", "billing"]);
        let none = Config::try_parse_from(["cosmosq-operator"]).unwrap();
        assert!(none.identity_grants.is_empty(), "no namespace by default");
        let err = Config::try_parse_from(["cosmosq-operator", "--identity-grant=shop"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("namespaces@endpoint"), "{err}");
    }

    #[test]
    fn management_scopes_come_as_the_chart_renders_them() {
        let id = "/subscriptions/0b1f6471-1bf0-4dda-aec3-cb9272f09590/resourceGroups/shop-rg/\
                  providers/Microsoft.DocumentDB/databaseAccounts/shop";
        let config = Config::try_parse_from([
            "cosmosq-operator".to_owned(),
            format!("--identity-management=https://shop.documents.azure.com:443/={id}"),
            "--arm-endpoint=https://management.usgovcloudapi.net".to_owned(),
        ])
        .unwrap();
        assert_eq!(config.identity_management.len(), 1);
        assert_eq!(
            config.identity_management[0].endpoint,
            "https://shop.documents.azure.com:443"
        );
        assert_eq!(config.identity_management[0].account.to_string(), id);
        assert_eq!(
            config.arm_endpoint.token_scope(),
            "https://management.usgovcloudapi.net/.default"
        );
        let none = Config::try_parse_from(["cosmosq-operator"]).unwrap();
        assert!(
            none.identity_management.is_empty(),
            "nothing managed by default"
        );
        assert_eq!(none.arm_endpoint.origin(), "https://management.azure.com");
        for (bad, says) in [
            (
                "--arm-endpoint=http://management.azure.com",
                "--arm-endpoint",
            ),
            (
                "--identity-management=https://shop.documents.azure.com/=/subscriptions/x",
                "--identity-management",
            ),
        ] {
            let err = Config::try_parse_from(["cosmosq-operator", bad])
                .unwrap_err()
                .to_string();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn bad_settings_are_named() {
        let err = Config::try_parse_from(["cosmosq-operator", "--scale-interval", "0s"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("--scale-interval"), "{err}");
        let err = Config::try_parse_from(["cosmosq-operator", "--tls-cert-file", "c.pem"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("--tls-key-file"), "{err}");
    }

    #[test]
    fn the_certificate_comes_from_files_or_from_the_operator_never_both() {
        let config = Config::try_parse_from([
            "cosmosq-operator",
            "--serving-cert-secret=cosmosq-operator-tls",
            "--serving-cert-service=cosmosq-external-metrics",
            "--api-service=v1beta1.external.metrics.k8s.io",
            "--keda-endpoint=true",
        ])
        .unwrap();
        assert_eq!(
            config.serving_cert_validity,
            Duration::from_secs(365 * 86_400)
        );
        assert_eq!(
            config.serving_ca_validity,
            Duration::from_secs(3650 * 86_400)
        );
        let err = Config::try_parse_from([
            "cosmosq-operator",
            "--serving-cert-secret=s",
            "--serving-cert-service=svc",
            "--tls-cert-file=c.pem",
            "--tls-key-file=k.pem",
        ])
        .unwrap_err()
        .to_string();
        assert!(err.contains("cannot be used with"), "{err}");
        let err = Config::try_parse_from(["cosmosq-operator", "--serving-cert-secret=s"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("--serving-cert-service"), "{err}");
        let err = Config::try_parse_from(["cosmosq-operator", "--keda-endpoint=true"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("required"), "{err}");
    }
}
