//! The operator on a real cluster, when one is given: `COSMOSQ_E2E_KUBECONFIG=<kubeconfig>`
//! (any cluster; a control plane without nodes is enough: no pod needs to run). It applies the
//! CRDs and the chart's RBAC, runs the operator in this process as the chart's ServiceAccount
//! (impersonated, so the API server's real authorizer judges every call against the chart's
//! grants), with queues on the embedded emulator, and plays the scenario the in-memory API
//! server runs in every test run: a queue, a group, a backlog, the Deployment scaling (the
//! real apps controller makes its ReplicaSet and Pods), deletion by the real garbage collector.
//! Needs `helm` (`COSMOSQ_HELM`, or the one `.ci/install-test-tools` installs).
//!
//! The operator's TLS listener is checked as the cluster's callers reach it: straight (no
//! front-proxy certificate: refused) and with ServiceAccount tokens (KEDA's bearer mode, minted
//! for the `cosmosq` audience by the TokenRequest API, and Prometheus' scrape of `/metrics`
//! with the chart's metrics-reader ClusterRole: TokenReview and SubjectAccessReview by the real
//! API server). When the API server can also reach this process
//! (`COSMOSQ_E2E_OPERATOR_ADDRESS=<an IP of this host the API server can dial>`), a second test
//! plays the same scenario, registers the chart's APIService and reads the figures through the
//! aggregation layer; without that address it is reported as skipped.
//! The listener runs as the chart's default configures it: the operator issues its serving
//! certificate into a Secret and writes the APIService's caBundle itself.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use cosmosq_crds::{CosmosQueue, QueueConsumerGroup};
use cosmosq_emulator::{Emulator, EmulatorOptions};
use cosmosq_testkit::fake::FakeApiServer;
use cosmosq_testkit::pki::client_config;
use cosmosq_tests::crd_rules::Kind;
use cosmosq_tests::scenario::{operator_scenario, until, Check, Scenario};
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::core::v1::{Namespace, Service, ServiceAccount};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::wait::{conditions, Condition};
use kube::{Client, CustomResourceExt, ResourceExt};
use serde_json::{json, Value};

const MANAGER: &str = "cosmosq-e2e";
/// The ServiceAccount that scrapes `/metrics` as Prometheus would (bound by the chart's
/// `metrics.readers`).
const SCRAPER: &str = "metrics-scraper";
/// The audience the operator asks KEDA's tokens to carry (its default).
const AUDIENCE: &str = "cosmosq";

#[tokio::test]
#[cfg_attr(
    not(cosmosq_e2e),
    ignore = "needs a cluster: set COSMOSQ_E2E_KUBECONFIG to a kubeconfig"
)]
async fn the_operator_on_a_real_cluster() {
    on_a_real_cluster(None).await;
}

#[tokio::test]
#[cfg_attr(
    not(cosmosq_e2e_aggregator),
    ignore = "needs a cluster that can dial this host: set COSMOSQ_E2E_KUBECONFIG and \
              COSMOSQ_E2E_OPERATOR_ADDRESS (an IP of this host the API server can reach)"
)]
async fn the_operator_serves_hpas_through_the_aggregation_layer() {
    let address = std::env::var("COSMOSQ_E2E_OPERATOR_ADDRESS")
        .expect("COSMOSQ_E2E_OPERATOR_ADDRESS: an IP of this host the API server can reach");
    on_a_real_cluster(Some(address)).await;
}

/// The scenario on the cluster of `COSMOSQ_E2E_KUBECONFIG`; with `aggregator`, the address the
/// API server dials to reach this process, the figures are also read as an HPA reads them.
async fn on_a_real_cluster(aggregator: Option<String>) {
    let path = std::env::var_os("COSMOSQ_E2E_KUBECONFIG")
        .expect("COSMOSQ_E2E_KUBECONFIG: the kubeconfig of the cluster to run on");
    cosmosq_queue::cosmos::tls::install_crypto_provider();
    let kubeconfig = Kubeconfig::read_from(&path).expect("a readable kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .expect("a usable kubeconfig");
    let client = Client::try_from(config.clone()).expect("a client");

    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in [CosmosQueue::crd(), QueueConsumerGroup::crd()] {
        let name = crd.name_any();
        crds.patch(
            &name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&crd),
        )
        .await
        .expect("apply the CRD");
        until(&crds, &name, "the CRD to be established", |c| {
            conditions::is_crd_established().matches_object(c)
        })
        .await;
    }
    let suffix = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let namespace = format!("cosmosq-e2e-{suffix}");
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns = serde_json::from_value(json!({"metadata": {"name": namespace}})).unwrap();
    namespaces
        .create(&PostParams::default(), &ns)
        .await
        .expect("create the test namespace");

    the_api_server_enforces_the_crd_rules(&client, &namespace).await;
    the_chart_keeps_its_certificate_across_upgrades(&client, &path, &namespace, &suffix).await;

    // The operator runs as the chart's ServiceAccount, with the chart's grants and no others.
    let release = format!("cosmosq-{suffix}");
    let account = apply_chart_rbac(&client, &release, &namespace).await;
    let mut as_operator = config.clone();
    as_operator.auth_info.impersonate =
        Some(format!("system:serviceaccount:{namespace}:{account}"));
    as_operator.auth_info.impersonate_groups = Some(vec![
        "system:serviceaccounts".into(),
        format!("system:serviceaccounts:{namespace}"),
        "system:authenticated".into(),
    ]);
    let operator_client = Client::try_from(as_operator).expect("an impersonating client");

    let emulator = Emulator::in_process(EmulatorOptions::default()).expect("emulator");
    let listener = SecureListener::new(&namespace, &release);
    // Boxed: the scenario's future is too large for a test thread's stack.
    Box::pin(operator_scenario(Scenario {
        client: client.clone(),
        operator_client,
        cosmos: emulator.client().await.expect("emulator client"),
        namespace: namespace.clone(),
        identity: None,
        controllers: true,
        operator_args: [
            listener.operator_args(),
            vec![format!("--worker-cluster-role={release}-worker")],
        ]
        .concat(),
        while_scaled: Some(while_scaled(
            config.clone(),
            namespace.clone(),
            listener,
            aggregator,
        )),
    }))
    .await;

    // The scenario deleted the namespace itself (with a queue still in it).
    assert!(
        namespaces
            .get_opt(&namespace)
            .await
            .expect("read namespaces")
            .is_none(),
        "the test namespace is gone"
    );
    let cluster_roles: Api<ClusterRole> = Api::all(client.clone());
    let bindings: Api<ClusterRoleBinding> = Api::all(client.clone());
    for role in [
        "worker",
        "queues",
        "metrics-reader",
        "ca-bundle",
        "edit",
        "view",
        "queue-waker",
    ] {
        cluster_roles
            .delete(&format!("{release}-{role}"), &DeleteParams::default())
            .await
            .expect("delete the chart's ClusterRoles");
    }
    for binding in ["auth-delegator", "queues", "metrics-reader", "ca-bundle"] {
        bindings
            .delete(&format!("{release}-{binding}"), &DeleteParams::default())
            .await
            .expect("delete the chart's ClusterRoleBindings");
    }
    let policy = format!("{release}-worker-own-pod");
    Api::<ValidatingAdmissionPolicyBinding>::all(client.clone())
        .delete(&policy, &DeleteParams::default())
        .await
        .expect("delete the chart's admission policy binding");
    Api::<ValidatingAdmissionPolicy>::all(client.clone())
        .delete(&policy, &DeleteParams::default())
        .await
        .expect("delete the chart's admission policy");
    Api::<RoleBinding>::namespaced(client.clone(), "kube-system")
        .delete(&format!("{release}-auth-reader"), &DeleteParams::default())
        .await
        .expect("delete the chart's RoleBinding in kube-system");
}

/// Renders the chart's ServiceAccount and RBAC for `release` in `namespace` with helm and
/// applies them; returns the ServiceAccount's name.
async fn apply_chart_rbac(client: &Client, release: &str, namespace: &str) -> String {
    let watched = format!("watchNamespace={namespace}");
    let scraper =
        format!("metrics.readers[0].name={SCRAPER},metrics.readers[0].namespace={namespace}");
    let rendered = cosmosq_tests::helm_template(
        release,
        namespace,
        &[
            // The TLS listener's grants too (delegated authentication and authorization),
            // and the least of them: only the test namespace is watched, so only it is
            // granted.
            "--set",
            "externalMetrics.enabled=true,kedaEndpoint.enabled=true",
            "--set",
            &watched,
            // The scraper this test plays is bound to the metrics-reader ClusterRole.
            "--set",
            &scraper,
            "--show-only",
            "templates/serviceaccount.yaml",
            "--show-only",
            "templates/metrics-reader.yaml",
            "--show-only",
            "templates/rbac.yaml",
            "--show-only",
            "templates/workers.yaml",
            // The roles for the cluster's users, with the producers' queue-waker.
            "--show-only",
            "templates/user-roles.yaml",
        ],
    );
    let apply = PatchParams::apply(MANAGER).force();
    let mut account = None;
    let mut kinds = Vec::new();
    for object in rendered {
        let kind = object["kind"].as_str().expect("a kind").to_owned();
        let name = object["metadata"]["name"]
            .as_str()
            .expect("a name")
            .to_owned();
        let patch = Patch::Apply(&object);
        match kind.as_str() {
            "ServiceAccount" => {
                Api::<ServiceAccount>::namespaced(client.clone(), namespace)
                    .patch(&name, &apply, &patch)
                    .await
                    .expect("apply the ServiceAccount");
                account = Some(name);
            }
            "ClusterRole" => {
                Api::<ClusterRole>::all(client.clone())
                    .patch(&name, &apply, &patch)
                    .await
                    .expect("apply the ClusterRole");
            }
            "ClusterRoleBinding" => {
                Api::<ClusterRoleBinding>::all(client.clone())
                    .patch(&name, &apply, &patch)
                    .await
                    .expect("apply the ClusterRoleBinding");
            }
            "ValidatingAdmissionPolicy" => {
                Api::<ValidatingAdmissionPolicy>::all(client.clone())
                    .patch(&name, &apply, &patch)
                    .await
                    .expect("apply the ValidatingAdmissionPolicy");
            }
            "ValidatingAdmissionPolicyBinding" => {
                Api::<ValidatingAdmissionPolicyBinding>::all(client.clone())
                    .patch(&name, &apply, &patch)
                    .await
                    .expect("apply the ValidatingAdmissionPolicyBinding");
            }
            "Role" => {
                let at = object["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or(namespace);
                Api::<Role>::namespaced(client.clone(), at)
                    .patch(&name, &apply, &patch)
                    .await
                    .expect("apply the Role");
            }
            "RoleBinding" => {
                let at = object["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or(namespace);
                Api::<RoleBinding>::namespaced(client.clone(), at)
                    .patch(&name, &apply, &patch)
                    .await
                    .expect("apply the RoleBinding");
            }
            other => panic!("the chart's RBAC templates rendered an unexpected {other}"),
        }
        kinds.push(kind);
    }
    for kind in [
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ] {
        assert!(
            kinds.iter().any(|k| k == kind),
            "the chart renders a {kind}: {kinds:?}"
        );
    }
    account.expect("the chart's ServiceAccount")
}

/// `helm install`, then `helm upgrade`: the generated serving certificate and its CA (which
/// the APIService trusts) survive the upgrade, so HPA mode keeps working through it.
async fn the_chart_keeps_its_certificate_across_upgrades(
    client: &Client,
    kubeconfig: &std::ffi::OsStr,
    namespace: &str,
    suffix: &str,
) {
    let chart = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../charts/cosmosq");
    let release = format!("cosmosq-upgrade-{suffix}");
    let helm_run = |args: &[&str]| {
        let output = std::process::Command::new(cosmosq_tests::helm())
            .args(args)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(["--namespace", namespace])
            .output()
            .expect("run helm");
        assert!(
            output.status.success(),
            "helm {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    };
    let chart = chart.to_str().expect("a UTF-8 path");
    let values = format!(
        "kedaEndpoint.enabled=true,externalMetrics.certGeneratedBy=helm,watchNamespace={namespace}"
    );
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(client.clone(), namespace);
    let secret = format!("{release}-external-metrics-tls");
    let certificate = || async {
        let secret = secrets.get(&secret).await.expect("the serving certificate");
        let data = secret.data.expect("its data");
        (data["tls.crt"].clone(), data["ca.crt"].clone())
    };
    helm_run(&["upgrade", "--install", &release, chart, "--set", &values]);
    let installed = certificate().await;
    helm_run(&["upgrade", "--install", &release, chart, "--set", &values]);
    assert!(
        installed == certificate().await,
        "helm upgrade replaced the serving certificate"
    );
    helm_run(&["uninstall", &release, "--wait"]);
}

/// Every rule of the CRDs (CEL, patterns, lengths), judged by the API server itself on the
/// cases `cargo test` also runs through a CEL interpreter: a valid object is accepted, an
/// invalid one refused with the rule's message; immutable fields refuse a change.
async fn the_api_server_enforces_the_crd_rules(client: &Client, namespace: &str) {
    use kube::api::{ApiResource, DynamicObject};
    for case in cosmosq_tests::crd_rules::cases() {
        let resource = match case.kind {
            Kind::Queue => ApiResource::erase::<CosmosQueue>(&()),
            Kind::Group => ApiResource::erase::<QueueConsumerGroup>(&()),
        };
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &resource);
        let object = |spec: &Value| -> DynamicObject {
            serde_json::from_value(case.object(spec)).expect("a valid object")
        };
        let result = match &case.old {
            None => {
                api.create(&PostParams::default(), &object(&case.spec))
                    .await
            }
            Some(old) => {
                let created = api
                    .create(&PostParams::default(), &object(old))
                    .await
                    .unwrap_or_else(|e| panic!("{}: create the old object: {e}", case.id));
                let mut changed = object(&case.spec);
                changed.metadata.resource_version = created.metadata.resource_version;
                api.replace(&case.name(), &PostParams::default(), &changed)
                    .await
            }
        };
        match (case.refused_with, &result) {
            (None, Ok(_)) => {}
            (Some(message), Err(kube::Error::Api(e))) => {
                assert_eq!(e.code, 422, "{}: {e:?}", case.id);
                assert!(
                    e.message.contains(message),
                    "{}: {message:?} not in {:?}",
                    case.id,
                    e.message
                );
            }
            (_, other) => panic!("{}: want {:?}, got {other:?}", case.id, case.refused_with),
        }
        if result.is_ok() || case.old.is_some() {
            api.delete(&case.name(), &DeleteParams::default())
                .await
                .unwrap_or_else(|e| panic!("{}: delete: {e}", case.id));
        }
    }
}

/// The chart's templates `show` rendered for `release` in `namespace` as the suite installs
/// it (the TLS listener on, only `namespace` watched), one JSON value per document.
fn chart_documents(release: &str, namespace: &str, show: &[&str]) -> Vec<Value> {
    let watched = format!("watchNamespace={namespace}");
    let templates: Vec<String> = show.iter().map(|t| format!("templates/{t}")).collect();
    let mut args = vec![
        "--set",
        "externalMetrics.enabled=true,kedaEndpoint.enabled=true",
        "--set",
        &watched,
    ];
    for template in &templates {
        args.extend(["--show-only", template]);
    }
    cosmosq_tests::helm_template(release, namespace, &args)
}

/// The operator's TLS listener for this run: a port, and the chart's settings of the
/// certificate the operator issues itself for the chart's Service.
struct SecureListener {
    port: u16,
    namespace: String,
    /// The chart's operator arguments of the listener (certificate, APIService, KEDA).
    args: Vec<String>,
    service: String,
    secret: String,
    release: String,
}

impl SecureListener {
    fn new(namespace: &str, release: &str) -> Self {
        let port = std::net::TcpListener::bind("0.0.0.0:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let deployment = chart_documents(release, namespace, &["deployment.yaml"]);
        let args: Vec<String> = deployment[0]["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_array()
            .expect("the operator's arguments")
            .iter()
            .filter_map(|a| a.as_str())
            .filter(|a| {
                [
                    "--serving-cert-",
                    "--api-service=",
                    "--keda-endpoint=",
                    "--wake-endpoint=",
                    "--token-audience=",
                ]
                .iter()
                .any(|p| a.starts_with(p))
            })
            .map(str::to_owned)
            .collect();
        let value = |flag: &str| {
            args.iter()
                .find_map(|a| a.strip_prefix(flag))
                .unwrap_or_else(|| panic!("the chart sets {flag} by default: {args:?}"))
                .to_owned()
        };
        Self {
            port,
            namespace: namespace.to_owned(),
            service: value("--serving-cert-service="),
            secret: value("--serving-cert-secret="),
            args,
            release: release.to_owned(),
        }
    }

    fn operator_args(&self) -> Vec<String> {
        let mut args = self.args.clone();
        args.push(format!("--secure-listen=0.0.0.0:{}", self.port));
        args
    }

    /// The name the certificate is for: the Service's, as the aggregator dials it.
    fn host(&self) -> String {
        format!("{}.{}.svc", self.service, self.namespace)
    }

    /// `path` on this process's listener, dialled by the Service's name.
    fn url(&self, path: &str) -> String {
        format!("https://{}:{}{path}", self.host(), self.port)
    }

    /// The CAs the operator's Secret says to trust (`ca.crt`), once the leader issued them.
    async fn trusted(&self, client: &Client) -> String {
        let secrets: Api<k8s_openapi::api::core::v1::Secret> =
            Api::namespaced(client.clone(), &self.namespace);
        until(
            &secrets,
            &self.secret,
            "the operator's serving certificate",
            |s| {
                s.and_then(|s| s.data.as_ref())
                    .is_some_and(|d| d.contains_key("ca.crt"))
            },
        )
        .await;
        let secret = secrets.get(&self.secret).await.expect("the Secret");
        String::from_utf8(secret.data.expect("its data")["ca.crt"].0.clone()).expect("PEM")
    }

    /// An HTTPS client trusting `ca`, reaching this process by the Service's name.
    fn client(&self, ca: &str) -> reqwest::Client {
        cosmosq_queue::cosmos::tls::http_client_builder()
            .tls_backend_preconfigured(client_config(ca, None))
            .resolve(
                &self.host(),
                std::net::SocketAddr::from(([127, 0, 0, 1], self.port)),
            )
            .build()
            .expect("an HTTPS client")
    }
}

/// What is checked while the group runs 3 (Pending) pods and has figures.
fn while_scaled(
    config: kube::Config,
    namespace: String,
    listener: SecureListener,
    aggregator: Option<String>,
) -> Check {
    Box::new(move || {
        Box::pin(async move {
            let client = Client::try_from(config.clone()).expect("a client");
            the_figures_are_served_only_to_authorized_callers(&client, &namespace, &listener).await;
            if let Some(address) = &aggregator {
                read_through_the_aggregator(&client, &namespace, &listener, address).await;
            }
            a_worker_changes_only_its_own_deletion_cost(&config, &namespace).await;
        })
    })
}

/// The workers' grant (patch pods) as the chart's admission policy narrows it: a token bound
/// to one worker pod changes that pod's deletion cost and nothing else; the app container has
/// no token at all.
async fn a_worker_changes_only_its_own_deletion_cost(config: &kube::Config, namespace: &str) {
    let client = Client::try_from(config.clone()).expect("a client");
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let workers = pods
        .list(&kube::api::ListParams::default().labels("app.kubernetes.io/instance=billing"))
        .await
        .expect("list the worker pods");
    assert!(
        workers.items.len() >= 2,
        "{} worker pods",
        workers.items.len()
    );
    let (own, other) = (&workers.items[0], &workers.items[1]);
    let spec = own.spec.as_ref().expect("a pod spec");
    assert_eq!(spec.automount_service_account_token, Some(false));
    for container in &spec.containers {
        let has_token = container
            .volume_mounts
            .iter()
            .flatten()
            .any(|m| m.mount_path == "/var/run/secrets/kubernetes.io/serviceaccount");
        assert_eq!(
            has_token,
            container.name == "cosmosq-sidecar",
            "only the sidecar has an API token ({})",
            container.name
        );
        if container.name != "cosmosq-sidecar" {
            // Scale-in waits for the sidecar's drain before the app gets SIGTERM.
            let pre_stop = container
                .lifecycle
                .as_ref()
                .and_then(|l| l.pre_stop.as_ref())
                .and_then(|p| p.http_get.as_ref())
                .and_then(|h| h.path.as_deref());
            assert_eq!(pre_stop, Some("/drained"), "{}", container.name);
        }
    }

    // What the kubelet would mount for the sidecar: a token bound to its pod.
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let token = |bound: Option<&Pod>| {
        let request = TokenRequest {
            spec: TokenRequestSpec {
                audiences: Vec::new(),
                expiration_seconds: Some(600),
                bound_object_ref: bound.map(|pod| {
                    k8s_openapi::api::authentication::v1::BoundObjectReference {
                        api_version: Some("v1".into()),
                        kind: Some("Pod".into()),
                        name: Some(pod.name_any()),
                        uid: pod.metadata.uid.clone(),
                    }
                }),
            },
            ..TokenRequest::default()
        };
        let accounts = accounts.clone();
        async move {
            accounts
                .create_token_request("billing-workers", &PostParams::default(), &request)
                .await
                .expect("a worker token")
                .status
                .expect("its status")
                .token
        }
    };
    let as_worker = |token: String| {
        let mut config = config.clone();
        config.auth_info = kube::config::AuthInfo {
            token: Some(token.into()),
            ..kube::config::AuthInfo::default()
        };
        Api::<Pod>::namespaced(Client::try_from(config).expect("a client"), namespace)
    };
    let patch = |annotations: Value, labels: Value| {
        Patch::Merge(json!({"metadata": {"annotations": annotations, "labels": labels}}))
    };
    let cost = json!({"controller.kubernetes.io/pod-deletion-cost": "5"});
    let worker = as_worker(token(Some(own)).await);
    // The RoleBinding's grant may reach the authorizer a moment after the binding.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match worker
            .patch(
                &own.name_any(),
                &PatchParams::default(),
                &patch(cost.clone(), json!({})),
            )
            .await
        {
            Ok(pod) => {
                assert_eq!(
                    pod.annotations()["controller.kubernetes.io/pod-deletion-cost"],
                    "5"
                );
                break;
            }
            Err(kube::Error::Api(e)) if e.code == 403 && !e.message.contains("cosmosq") => {
                assert!(tokio::time::Instant::now() < deadline, "{e:?}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => panic!("a worker sets its own deletion cost: {e:?}"),
        }
    }
    let refused = |result: Result<Pod, kube::Error>, message: &str| match result {
        Err(kube::Error::Api(e)) => assert!(e.message.contains(message), "{message:?}: {e:?}"),
        Ok(_) => panic!("allowed, want {message:?}"),
        Err(e) => panic!("{e:?}"),
    };
    let own_only = "may change only its own pod";
    let cost_only = "only its pod's controller.kubernetes.io/pod-deletion-cost annotation";
    let params = PatchParams::default();
    refused(
        worker
            .patch(&other.name_any(), &params, &patch(cost.clone(), json!({})))
            .await,
        own_only,
    );
    let relabel = patch(
        json!({}),
        json!({"app.kubernetes.io/instance": "elsewhere"}),
    );
    refused(
        worker.patch(&own.name_any(), &params, &relabel).await,
        cost_only,
    );
    let annotate = patch(json!({"note": "x"}), json!({}));
    refused(
        worker.patch(&own.name_any(), &params, &annotate).await,
        cost_only,
    );
    // Nor its owner references or finalizers (which would hand the pod to another owner, or
    // hold its deletion).
    let adopt = Patch::Merge(json!({"metadata": {"finalizers": ["example.com/hold"]}}));
    refused(
        worker.patch(&own.name_any(), &params, &adopt).await,
        cost_only,
    );
    // A token of the worker account that is bound to no pod changes none.
    let unbound = as_worker(token(None).await);
    refused(
        unbound
            .patch(&own.name_any(), &params, &patch(cost.clone(), json!({})))
            .await,
        own_only,
    );
    // A worker account whose group is gone (deleted with --cascade=orphan: its binding stays)
    // is held to the same, though no group of its name exists to judge it by.
    let orphan = token_of(&client, namespace, "orphaned-workers", &[]).await;
    let bindings: Api<RoleBinding> = Api::namespaced(client.clone(), namespace);
    let worker_role = own_worker_role(&client, namespace).await;
    let binding = serde_json::from_value(json!({"metadata": {"name": "orphaned-workers"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": worker_role},
        "subjects": [{"kind": "ServiceAccount", "name": "orphaned-workers", "namespace": namespace}]}))
        .unwrap();
    bindings
        .create(&PostParams::default(), &binding)
        .await
        .expect("bind the worker role as an orphaned group left it");
    let orphan = as_worker(orphan);
    let image =
        Patch::Strategic(json!({"spec": {"containers": [{"name": "app", "image": "evil/app"}]}}));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match orphan.patch(&other.name_any(), &params, &image).await {
            Err(kube::Error::Api(e)) if e.code == 403 && !e.message.contains("cosmosq") => {
                // The binding has not reached the authorizer yet.
                assert!(tokio::time::Instant::now() < deadline, "{e:?}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            result => {
                refused(result, own_only);
                break;
            }
        }
    }
}

/// The worker ClusterRole the group's RoleBinding names.
async fn own_worker_role(client: &Client, namespace: &str) -> String {
    Api::<RoleBinding>::namespaced(client.clone(), namespace)
        .get("billing-workers")
        .await
        .expect("the group's binding")
        .role_ref
        .name
}

/// Asks until the operator answers `wanted` (the body), refused (403) meanwhile: a decision is
/// cached for 10 s, and a new binding may reach the authorizer after a first ask.
async fn once_allowed(request: impl Fn() -> reqwest::RequestBuilder, wanted: u16) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (status, body) = get(request()).await;
        if status == wanted {
            return body;
        }
        assert_eq!(status, 403, "{body}");
        assert!(
            tokio::time::Instant::now() < deadline,
            "still refused: {body}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

async fn get(request: reqwest::RequestBuilder) -> (u16, Value) {
    let response = request.send().await.expect("the operator answers");
    let status = response.status().as_u16();
    let body = response.bytes().await.unwrap_or_default();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

/// A token of ServiceAccount `name` (created if need be) for `audiences` (the API server's when
/// empty), as `kubectl create token --audience` mints it for KEDA's TriggerAuthentication.
async fn token_of(client: &Client, namespace: &str, name: &str, audiences: &[&str]) -> String {
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let account = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    match accounts.create(&PostParams::default(), &account).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("create a ServiceAccount: {e}"),
    }
    let request = TokenRequest {
        spec: TokenRequestSpec {
            audiences: audiences.iter().map(|a| a.to_string()).collect(),
            expiration_seconds: Some(600),
            ..TokenRequestSpec::default()
        },
        ..TokenRequest::default()
    };
    accounts
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .expect("a token")
        .status
        .expect("the token's status")
        .token
}

async fn the_figures_are_served_only_to_authorized_callers(
    client: &Client,
    namespace: &str,
    listener: &SecureListener,
) {
    let https = listener.client(&listener.trusted(client).await);
    // Straight to the operator, claiming to be an admin: refused for want of the front
    // proxy's certificate. The message shows the operator read the front proxy's CA, which the
    // chart's RoleBinding in kube-system allows.
    let backlog = format!(
        "/apis/external.metrics.k8s.io/v1beta1/namespaces/{namespace}/cosmosq_backlog_messages"
    );
    let (status, body) = get(https
        .get(listener.url(&backlog))
        .header("X-Remote-User", "kubernetes-admin")
        .header("X-Remote-Group", "system:masters"))
    .await;
    assert_eq!(status, 401, "{body}");
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("front proxy is required")),
        "{body}"
    );

    // KEDA's bearer mode, judged by the API server: the operator reviews tokens as the chart's
    // ServiceAccount (system:auth-delegator).
    let reader = token_of(client, namespace, "keda-reader", &[AUDIENCE]).await;
    let stranger = token_of(client, namespace, "stranger", &[AUDIENCE]).await;
    let role = serde_json::from_value(json!({
        "metadata": {"name": "read-groups"},
        "rules": [{"apiGroups": ["cosmosq.io"], "resources": ["queueconsumergroups"], "verbs": ["get"]}]
    }))
    .unwrap();
    Api::<Role>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &role)
        .await
        .expect("create the Role");
    let binding = serde_json::from_value(json!({
        "metadata": {"name": "keda-reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "read-groups"},
        "subjects": [{"kind": "ServiceAccount", "name": "keda-reader", "namespace": namespace}]
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &binding)
        .await
        .expect("create the RoleBinding");
    let keda = listener.url(&format!(
        "/keda/namespaces/{namespace}/queueconsumergroups/billing"
    ));
    let body = once_allowed(|| https.get(&keda).bearer_auth(&reader), 200).await;
    assert_eq!(body["backlog"], 100, "{body}");
    assert_eq!(body["desiredReplicas"], 3, "{body}");
    let (status, body) = get(https.get(&keda).bearer_auth(&stranger)).await;
    assert_eq!(status, 403, "{body}");
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("stranger")),
        "{body}"
    );
    let (status, body) = get(https.get(&keda).bearer_auth("not-a-token")).await;
    assert_eq!(status, 401, "{body}");
    let (status, _) = get(https.get(&keda)).await;
    assert_eq!(status, 401);
    // The same reader's token minted for the API server (what its pod would mount): the real
    // API server refuses it for the audience the operator asks.
    let api_token = token_of(client, namespace, "keda-reader", &[]).await;
    let (status, body) = get(https.get(&keda).bearer_auth(&api_token)).await;
    assert_eq!(status, 401, "{body}");
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains(AUDIENCE)),
        "{body}"
    );

    // A producer's wake: the chart's queue-waker ClusterRole, bound in the namespace, grants
    // the operator's own subresource `cosmosqueues/wake`; the API server's RBAC judges it by
    // that name, so a reader of the groups is refused, and so is a wake of another namespace.
    let binding = serde_json::from_value(json!({
        "metadata": {"name": "producer-wakes"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": format!("{}-queue-waker", listener.release)},
        "subjects": [{"kind": "ServiceAccount", "name": "producer", "namespace": namespace}]
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &binding)
        .await
        .expect("bind the queue-waker ClusterRole");
    let producer = token_of(client, namespace, "producer", &[AUDIENCE]).await;
    let wake = listener.url(&format!(
        "/v1/namespaces/{namespace}/cosmosqueues/orders/wake"
    ));
    once_allowed(|| https.post(&wake).bearer_auth(&producer), 202).await;
    let (status, body) = get(https.post(&wake).bearer_auth(&reader)).await;
    assert_eq!(status, 403, "{body}");
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("create cosmosqueues.cosmosq.io/wake")),
        "{body}"
    );
    let elsewhere = listener.url("/v1/namespaces/default/cosmosqueues/orders/wake");
    let (status, body) = get(https.post(&elsewhere).bearer_auth(&producer)).await;
    assert_eq!(status, 403, "{body}");

    // /metrics: Prometheus' own token (the API server's audience), bound to the chart's
    // metrics-reader ClusterRole; nobody else.
    let metrics = listener.url("/metrics");
    let (status, body) = get(https.get(&metrics)).await;
    assert_eq!(status, 401, "anonymous: {body}");
    let unbound = token_of(client, namespace, "stranger", &[]).await;
    let (status, body) = get(https.get(&metrics).bearer_auth(&unbound)).await;
    assert_eq!(status, 403, "{body}");
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("get /metrics")),
        "{body}"
    );
    let scraper = token_of(client, namespace, SCRAPER, &[]).await;
    let response = https
        .get(&metrics)
        .bearer_auth(&scraper)
        .send()
        .await
        .expect("the operator answers");
    assert_eq!(response.status().as_u16(), 200);
    let text = response.text().await.expect("the metrics");
    assert!(text.contains("cosmosq_operator_leader 1"), "{text}");
}

/// Registers the operator as `v1beta1.external.metrics.k8s.io` with the chart's APIService
/// (no caBundle: the operator writes it) and reads the backlog as an HPA does, through the API
/// server: TLS verified by the bundle the operator wrote, the front proxy's certificate
/// verified by the operator, the caller authorized by both.
async fn read_through_the_aggregator(
    client: &Client,
    namespace: &str,
    listener: &SecureListener,
    address: &str,
) {
    const NAME: &str = "v1beta1.external.metrics.k8s.io";
    let apiservices: Api<APIService> = Api::all(client.clone());
    // Another provider's registration is not ours to replace: the test asks for a cluster
    // without one rather than passing without reading anything.
    assert!(
        apiservices
            .get_opt(NAME)
            .await
            .expect("read APIServices")
            .is_none(),
        "{NAME} already exists (KEDA or prometheus-adapter?): run on a cluster without it"
    );
    // The chart's Service selects the leader's pod; this operator is a process of this host.
    let service = serde_json::from_value(json!({
        "metadata": {"name": listener.service},
        "spec": {"ports": [{"name": "https", "port": 443, "targetPort": listener.port}]}
    }))
    .unwrap();
    Api::<Service>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &service)
        .await
        .expect("create the Service");
    let slice = serde_json::from_value(json!({
        "metadata": {"name": format!("{}-e2e", listener.service),
                     "labels": {"kubernetes.io/service-name": listener.service}},
        "addressType": if address.contains(':') { "IPv6" } else { "IPv4" },
        "endpoints": [{"addresses": [address], "conditions": {"ready": true}}],
        "ports": [{"name": "https", "port": listener.port, "protocol": "TCP"}]
    }))
    .unwrap();
    Api::<EndpointSlice>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &slice)
        .await
        .expect("create the EndpointSlice");
    let apiservice = chart_documents(&listener.release, namespace, &["external-metrics.yaml"])
        .into_iter()
        .find(|d| d["kind"] == "APIService")
        .expect("the chart's APIService");
    assert!(
        apiservice["spec"].get("caBundle").is_none(),
        "the chart renders no caBundle: {apiservice}"
    );
    apiservices
        .patch(
            NAME,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&apiservice),
        )
        .await
        .expect("apply the chart's APIService");
    // The leader gives it the bundle within a round (30 s).
    until(&apiservices, NAME, "the APIService to be available", |a| {
        a.and_then(|a| a.status.as_ref())
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| {
                c.iter()
                    .any(|c| c.type_ == "Available" && c.status == "True")
            })
    })
    .await;
    let available = apiservices.get(NAME).await.expect("the APIService");
    let bundle = available
        .spec
        .as_ref()
        .and_then(|s| s.ca_bundle.as_ref())
        .expect("the operator wrote the caBundle");
    assert_eq!(
        String::from_utf8_lossy(&bundle.0),
        listener.trusted(client).await,
        "the APIService trusts what the Secret's ca.crt says"
    );
    // The operator's field manager owns spec.caBundle and nothing else.
    let owned: Vec<_> = available
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|f| f.manager.as_deref() == Some(cosmosq_operator::certs::CA_BUNDLE_MANAGER))
        .map(|f| serde_json::to_value(&f.fields_v1).unwrap())
        .collect();
    assert_eq!(owned, [json!({"f:spec": {"f:caBundle": {}}})]);
    let path = format!(
        "/apis/external.metrics.k8s.io/v1beta1/namespaces/{namespace}/cosmosq_backlog_messages?labelSelector=group%3Dbilling"
    );
    let list: Value = client
        .request(http::Request::get(&path).body(Vec::new()).unwrap())
        .await
        .expect("the backlog through the aggregation layer");
    assert_eq!(list["items"][0]["value"], "100", "{list}");
    apiservices
        .delete(NAME, &DeleteParams::default())
        .await
        .expect("delete the APIService");
}

/// The same scenario on the in-memory API server, in every test run; it also proves the
/// chart's RBAC allows every call the operator makes, and grants nothing it never makes.
#[tokio::test]
async fn the_operator_provisions_runs_scales_and_cleans_up() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let server = FakeApiServer::new();
    let client = server.client();
    let emulator = Emulator::in_process(EmulatorOptions::default()).unwrap();
    let cosmos = emulator.client().await.unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), "shop");
    let pod = serde_json::from_value(json!({"metadata": {"name": "operator-0"}})).unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();

    // Boxed: the scenario's future is too large for a test thread's stack.
    Box::pin(operator_scenario(Scenario {
        client: client.clone(),
        operator_client: server.client_as("operator"),
        cosmos,
        namespace: "shop".into(),
        identity: Some("operator-0".into()),
        controllers: false,
        operator_args: Vec::new(),
        while_scaled: None,
    }))
    .await;

    // The leader labelled its pod while leading and unlabelled it on the way out.
    let log = server.requests();
    assert!(
        log.get("PATCH api/v1/pods").copied().unwrap_or(0) >= 3,
        "{log:?}"
    );
    assert_eq!(
        pods.get("operator-0").await.unwrap().labels()[cosmosq_operator::run::LEADER_LABEL],
        "false"
    );
    assert!(
        log.get("PATCH apis/apps/v1/deployments/scale")
            .copied()
            .unwrap_or(0)
            <= 5,
        "scaled once per change the scenario makes (the backlog, two pauses and their ends, \
         External mode), not every round: {log:?}"
    );

    // The chart's RBAC allows every call the operator made, and grants nothing it never
    // makes (but for the calls of paths this scenario does not take, named here).
    let granted = chart_rbac();
    let used = server.verbs_of("operator");
    let denied: Vec<_> = used.difference(&granted).collect();
    assert!(
        denied.is_empty(),
        "the chart's RBAC does not allow {denied:?}"
    );
    let not_taken: BTreeSet<(String, String, String)> = [
        ("cosmosq.io", "queueconsumergroups/finalizers", "update"), // blockOwnerDeletion
        ("autoscaling", "horizontalpodautoscalers", "create"),      // HPA mode
        ("autoscaling", "horizontalpodautoscalers", "patch"),       // HPA mode
        ("", "secrets", "get"),                                     // key Secrets
        ("events.k8s.io", "events", "patch"),                       // repeated Events
        ("coordination.k8s.io", "leases", "update"),                // renewals (2 s)
        ("rbac.authorization.k8s.io", "clusterroles", "bind"),      // checked by real RBAC only
        // The certificate the operator issues itself (its TLS listener is off here; the real
        // cluster's run judges these calls). Its `create` is the API tokens' too.
        ("", "secrets", "update"),
        ("apiregistration.k8s.io", "apiservices", "get"),
        ("apiregistration.k8s.io", "apiservices", "patch"),
    ]
    .into_iter()
    .map(|(g, r, v)| (g.to_owned(), r.to_owned(), v.to_owned()))
    .collect();
    let unused: Vec<_> = granted
        .difference(&used)
        .filter(|rule| !not_taken.contains(*rule))
        .collect();
    assert!(
        unused.is_empty(),
        "the chart grants what the operator never uses: {unused:?}"
    );
}

/// (API group, resource, verb) of every rule in the chart's RBAC template.
fn chart_rbac() -> BTreeSet<(String, String, String)> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../charts/cosmosq/templates/rbac.yaml"
    );
    // The rules are plain YAML; only names and labels are templated.
    let text: String = std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|l| !l.contains("{{"))
        .map(|l| format!("{l}\n"))
        .collect();
    let mut granted = BTreeSet::new();
    for document in serde_yaml::Deserializer::from_str(&text) {
        let doc: serde_json::Value = serde::Deserialize::deserialize(document).unwrap();
        for rule in doc["rules"].as_array().into_iter().flatten() {
            for group in rule["apiGroups"].as_array().unwrap() {
                for resource in rule["resources"].as_array().unwrap() {
                    for verb in rule["verbs"].as_array().unwrap() {
                        granted.insert((
                            group.as_str().unwrap().to_owned(),
                            resource.as_str().unwrap().to_owned(),
                            verb.as_str().unwrap().to_owned(),
                        ));
                    }
                }
            }
        }
    }
    granted
}

/// What Flux/kpt (kstatus) and Argo CD (the shipped health check) make of each state a
/// resource's status can be in; the scenario checks the states the operator really writes.
#[test]
fn gitops_tools_read_each_state_of_a_resource() {
    use cosmosq_tests::health::{argocd, kstatus, Kstatus};
    let condition = |type_: &str, status: &str, reason: &str| {
        json!({"type": type_, "status": status, "reason": reason, "message": format!("{reason} said"),
               "observedGeneration": 2, "lastTransitionTime": "2026-12-03T00:00:00Z"})
    };
    let group = |conditions: Vec<Value>, observed: i64| {
        json!({"apiVersion": "cosmosq.io/v1alpha1", "kind": "QueueConsumerGroup",
               "metadata": {"name": "billing", "namespace": "shop", "generation": 2},
               "status": {"observedGeneration": observed, "conditions": conditions}})
    };
    let done = || {
        vec![
            condition("Ready", "True", "Applied"),
            condition("Reconciling", "False", "Applied"),
            condition("Stalled", "False", "Applied"),
        ]
    };
    let with = |type_: &str, status: &str, reason: &str| {
        let mut c = done();
        c.retain(|c| c["type"] != type_);
        c.push(condition(type_, status, reason));
        c
    };
    let no_status = json!({"apiVersion": "cosmosq.io/v1alpha1", "kind": "CosmosQueue",
        "metadata": {"name": "orders", "namespace": "shop", "generation": 1}});
    let cases = [
        // kstatus cannot tell a resource no controller has seen; the health check can.
        (
            no_status,
            Kstatus::Current,
            "Progressing",
            "Waiting for the operator",
        ),
        (
            group(done(), 1),
            Kstatus::InProgress,
            "Progressing",
            "generation 2",
        ),
        (
            group(done(), 2),
            Kstatus::Current,
            "Healthy",
            "Applied said",
        ),
        (
            group(with("Reconciling", "True", "QueueNotFound"), 2),
            Kstatus::InProgress,
            "Progressing",
            "QueueNotFound: QueueNotFound said",
        ),
        (
            group(with("Stalled", "True", "NotOwned"), 2),
            Kstatus::Failed,
            "Degraded",
            "NotOwned: NotOwned said",
        ),
        (
            group(with("Paused", "True", "PausedByAnnotation"), 2),
            Kstatus::Current,
            "Suspended",
            "PausedByAnnotation",
        ),
        // A failed estimate keeps the workers running: kstatus has no word for it.
        (
            group(with("Degraded", "True", "EstimateFailed"), 2),
            Kstatus::Current,
            "Degraded",
            "EstimateFailed",
        ),
    ];
    for (obj, expected, argo, message) in cases {
        assert_eq!(kstatus(&obj), expected, "{obj}");
        let (status, said) = argocd(&obj);
        assert_eq!(status, argo, "{obj}");
        assert!(said.contains(message), "{said:?} for {obj}");
    }
    let mut deleted = group(done(), 2);
    deleted["metadata"]["deletionTimestamp"] = json!("2026-12-03T00:00:00Z");
    assert_eq!(kstatus(&deleted), Kstatus::Terminating);
}
