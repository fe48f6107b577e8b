//! The operator on a real cluster, when one is given: `COSMOSQ_E2E_KUBECONFIG=<kubeconfig>`
//! (any cluster; a control plane without nodes is enough: no pod needs to run). It applies the
//! CRDs and the chart's RBAC, runs the operator in this process as the chart's ServiceAccount
//! (impersonated, so the API server's real authorizer judges every call against the chart's
//! grants), with queues on the embedded emulator, and plays the scenario the in-memory API
//! server runs in every test run: a queue, a group, a backlog, the Deployment scaling (the
//! real apps controller makes its ReplicaSet and Pods), deletion by the real garbage collector.
//! Needs `helm` (`COSMOSQ_HELM`, `target/tools/helm` as `.ci/run` installs it, or `PATH`).

use std::path::PathBuf;

use cosmosq_crds::{CosmosQueue, QueueConsumerGroup};
use cosmosq_operator::scenario::{operator_scenario, until, Scenario};
use cosmosq_queue::emulator::{Emulator, EmulatorOptions};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::wait::{conditions, Condition};
use kube::{Client, CustomResourceExt, ResourceExt};
use serde_json::{json, Value};

const MANAGER: &str = "cosmosq-e2e";

#[tokio::test]
async fn the_operator_on_a_real_cluster() {
    let Some(path) = std::env::var_os("COSMOSQ_E2E_KUBECONFIG") else {
        eprintln!(
            "skipped: set COSMOSQ_E2E_KUBECONFIG to a kubeconfig to run the operator end to end on a cluster"
        );
        return;
    };
    cosmosq_operator::run::install_crypto_provider();
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
    operator_scenario(Scenario {
        client: client.clone(),
        operator_client,
        cosmos: emulator.client().await.expect("emulator client"),
        namespace: namespace.clone(),
        identity: None,
        controllers: true,
    })
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
    cluster_roles
        .delete(&release, &DeleteParams::default())
        .await
        .expect("delete the chart's ClusterRole");
    bindings
        .delete(&release, &DeleteParams::default())
        .await
        .expect("delete the chart's ClusterRoleBinding");
}

/// Renders the chart's ServiceAccount and RBAC for `release` in `namespace` with helm and
/// applies them; returns the ServiceAccount's name.
async fn apply_chart_rbac(client: &Client, release: &str, namespace: &str) -> String {
    let chart = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../charts/cosmosq");
    let output = std::process::Command::new(helm())
        .args(["template", release])
        .arg(&chart)
        .args(["--namespace", namespace])
        .args(["--show-only", "templates/serviceaccount.yaml"])
        .args(["--show-only", "templates/rbac.yaml"])
        .output()
        .expect("run helm");
    assert!(
        output.status.success(),
        "helm template: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let rendered = String::from_utf8(output.stdout).expect("UTF-8");
    let apply = PatchParams::apply(MANAGER).force();
    let mut account = None;
    let mut kinds = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&rendered) {
        let object: Value = serde::Deserialize::deserialize(doc).expect("a YAML document");
        if object.is_null() {
            continue;
        }
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
            "Role" => {
                Api::<Role>::namespaced(client.clone(), namespace)
                    .patch(&name, &apply, &patch)
                    .await
                    .expect("apply the Role");
            }
            "RoleBinding" => {
                Api::<RoleBinding>::namespaced(client.clone(), namespace)
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
    ] {
        assert!(
            kinds.iter().any(|k| k == kind),
            "the chart renders a {kind}: {kinds:?}"
        );
    }
    account.expect("the chart's ServiceAccount")
}

/// helm: `COSMOSQ_HELM`, then `target/tools/helm` (where `.ci/run` installs it), then `PATH`.
fn helm() -> PathBuf {
    if let Some(path) = std::env::var_os("COSMOSQ_HELM") {
        return path.into();
    }
    let installed = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/tools/helm");
    if installed.exists() {
        return installed;
    }
    PathBuf::from("helm")
}

/// Every CEL rule of the CRDs, judged by the API server itself: a valid object is accepted,
/// an invalid one refused with the rule's message; immutable fields refuse a change.
async fn the_api_server_enforces_the_crd_rules(client: &Client, namespace: &str) {
    let queues: Api<CosmosQueue> = Api::namespaced(client.clone(), namespace);
    let groups: Api<QueueConsumerGroup> = Api::namespaced(client.clone(), namespace);
    let queue = |name: &str, credentials: Value| {
        json!({
            "apiVersion": "cosmosq.io/v1alpha1", "kind": "CosmosQueue",
            "metadata": {"name": name},
            "spec": {"endpoint": "https://a.documents.azure.com/", "credentials": credentials,
                     "database": "db", "container": name}
        })
    };
    let group = |name: &str, extra: Value| {
        let mut g = json!({
            "apiVersion": "cosmosq.io/v1alpha1", "kind": "QueueConsumerGroup",
            "metadata": {"name": name},
            "spec": {"queueRef": {"name": "rules"},
                     "template": {"spec": {"containers": [{"name": "app", "image": "example/app"}]}},
                     "app": {"port": 8080}}
        });
        g["spec"]
            .as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        g
    };
    let refused = |result: Result<Value, kube::Error>, message: &str| match result {
        Err(kube::Error::Api(e)) => {
            assert_eq!(e.code, 422, "{e:?}");
            assert!(
                e.message.contains(message),
                "{message:?} not in {:?}",
                e.message
            );
        }
        other => panic!("accepted, want {message:?}: {other:?}"),
    };
    let create_queue = |object: Value| {
        let queues = queues.clone();
        async move {
            queues
                .create(
                    &PostParams::default(),
                    &serde_json::from_value(object).unwrap(),
                )
                .await
                .map(|q| serde_json::to_value(q).unwrap())
        }
    };
    let create_group = |object: Value| {
        let groups = groups.clone();
        async move {
            groups
                .create(
                    &PostParams::default(),
                    &serde_json::from_value(object).unwrap(),
                )
                .await
                .map(|g| serde_json::to_value(g).unwrap())
        }
    };

    // Exactly one credential.
    create_queue(queue("rules", json!({"workloadIdentity": {}})))
        .await
        .expect("a valid queue");
    refused(
        create_queue(queue(
            "two-credentials",
            json!({"workloadIdentity": {}, "secretKeyRef": {"name": "k"}}),
        ))
        .await,
        "set exactly one of secretKeyRef and workloadIdentity",
    );
    refused(
        create_queue(queue("no-credentials", json!({}))).await,
        "set exactly one of secretKeyRef and workloadIdentity",
    );
    // Back-off and replica bounds.
    create_group(group(
        "rules",
        json!({"retry": {"initialBackoff": "1s", "maxBackoff": "1m"},
               "scaling": {"minReplicas": 1, "maxReplicas": 2}}),
    ))
    .await
    .expect("a valid group");
    refused(
        create_group(group(
            "backoff",
            json!({"retry": {"initialBackoff": "2m", "maxBackoff": "1m"}}),
        ))
        .await,
        "initialBackoff must not exceed maxBackoff",
    );
    refused(
        create_group(group(
            "replicas",
            json!({"scaling": {"minReplicas": 3, "maxReplicas": 2}}),
        ))
        .await,
        "minReplicas must not exceed maxReplicas",
    );
    // Immutable fields: a change would silently abandon the messages or the group's state.
    let patch_queue = |spec: Value| {
        let queues = queues.clone();
        async move {
            queues
                .patch(
                    "rules",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": spec})),
                )
                .await
                .map(|q| serde_json::to_value(q).unwrap())
        }
    };
    for (spec, message) in [
        (
            json!({"endpoint": "https://b.documents.azure.com/"}),
            "endpoint is immutable",
        ),
        (json!({"database": "other"}), "database is immutable"),
        (json!({"container": "other"}), "container is immutable"),
        (
            json!({"partitionKeyPath": "/tenant"}),
            "partitionKeyPath is immutable",
        ),
    ] {
        refused(patch_queue(spec).await, message);
    }
    patch_queue(json!({"deletionPolicy": "Delete"}))
        .await
        .expect("a mutable field changes");
    let patch_group = |spec: Value| {
        let groups = groups.clone();
        async move {
            groups
                .patch(
                    "rules",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": spec})),
                )
                .await
                .map(|g| serde_json::to_value(g).unwrap())
        }
    };
    for (spec, message) in [
        (
            json!({"queueRef": {"name": "other"}}),
            "queueRef is immutable",
        ),
        (
            json!({"deliveryMode": "stream"}),
            "deliveryMode is immutable",
        ),
        (json!({"ordered": true}), "ordered is immutable"),
        (json!({"group": "renamed"}), "group is immutable"),
    ] {
        refused(patch_group(spec).await, message);
    }
    patch_group(json!({"concurrency": 7}))
        .await
        .expect("a mutable field changes");
    groups
        .delete("rules", &DeleteParams::default())
        .await
        .expect("delete the rules group");
    queues
        .delete("rules", &DeleteParams::default())
        .await
        .expect("delete the rules queue");
}
