//! The operator on a real cluster, when one is given: `COSMOSQ_E2E_KUBECONFIG=<kubeconfig>`.
//! It applies the CRDs, runs the operator in this process (queues on the embedded emulator),
//! and plays the same scenario the in-memory API server runs in every test run: a queue, a
//! group, a backlog, the Deployment scaling, deletion and cleanup. No pod needs to run (they
//! may stay Pending on a cluster without nodes).

use cosmosq_crds::{CosmosQueue, QueueConsumerGroup};
use cosmosq_operator::scenario::{operator_scenario, until, Scenario};
use cosmosq_queue::emulator::{Emulator, EmulatorOptions};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::wait::{conditions, Condition};
use kube::{Client, CustomResourceExt, ResourceExt};
use serde_json::json;

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
    let client = Client::try_from(config).expect("a client");

    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in [CosmosQueue::crd(), QueueConsumerGroup::crd()] {
        let name = crd.name_any();
        crds.patch(
            &name,
            &PatchParams::apply("cosmosq-e2e").force(),
            &Patch::Apply(&crd),
        )
        .await
        .expect("apply the CRD");
        until(&crds, &name, "the CRD to be established", |c| {
            conditions::is_crd_established().matches_object(c)
        })
        .await;
    }
    let namespace = format!(
        "cosmosq-e2e-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns = serde_json::from_value(json!({"metadata": {"name": namespace}})).unwrap();
    namespaces
        .create(&PostParams::default(), &ns)
        .await
        .expect("create the test namespace");

    let emulator = Emulator::in_process(EmulatorOptions::default()).expect("emulator");
    operator_scenario(Scenario {
        client: client.clone(),
        operator_client: client.clone(),
        cosmos: emulator.client().await.expect("emulator client"),
        namespace: namespace.clone(),
        identity: None,
    })
    .await;
    namespaces
        .delete(&namespace, &DeleteParams::background())
        .await
        .expect("delete the test namespace");
}
