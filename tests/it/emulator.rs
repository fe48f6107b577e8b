//! The emulator as a shared local account: over HTTP, with partitions and TTL.

use std::sync::Arc;
use std::time::Duration;

use cosmosq_emulator::{Emulator, EmulatorOptions};
use cosmosq_queue::{
    provision, ClaimOutcome, ConnectionArgs, GroupConfig, NewMessage, QueueConfig, StartFrom,
};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clients_share_one_account_over_http() {
    cosmosq_tests::init_tracing();
    let options = EmulatorOptions {
        partitions: 2,
        ..Default::default()
    };
    let served = Emulator::serve_localhost(0, options).await.unwrap();
    let endpoint = served.endpoint.clone();

    let producer = ConnectionArgs::emulator(&endpoint).connect().await.unwrap();
    let consumer = ConnectionArgs::emulator(&endpoint).connect().await.unwrap();
    let config = QueueConfig::new("shared", "orders");
    let (queue, created) = provision(&producer, &config).await.unwrap();
    assert!(
        created.created_database
            && created.created_messages_container
            && created.created_lease_container
    );
    let (_, again) = provision(&producer, &config).await.unwrap();
    assert!(
        !again.created_messages_container,
        "provisioning twice changes nothing"
    );

    let ranges = queue.messages().read_feed_ranges(None).await.unwrap();
    assert_eq!(
        ranges.len(),
        2,
        "the partition count applies to containers created over HTTP"
    );

    queue
        .enqueue(NewMessage::json(json!({"sku": 1})).with_id("o1"))
        .await
        .unwrap();
    let other = cosmosq_queue::Queue::open(&consumer, config).await.unwrap();
    let message = other
        .read_message(&"o1".into(), "o1")
        .await
        .unwrap()
        .expect("visible to the other client");
    let group = other
        .group(GroupConfig::new("g").with_start_from(StartFrom::Beginning))
        .unwrap();
    let ClaimOutcome::Claimed(claim) = group.claim(&message, "h").await.unwrap() else {
        panic!("claimable")
    };
    group.complete(&claim).await.unwrap();

    served.stop.cancel();
    served.task.await.unwrap().unwrap();
}

/// The operator's scaling loop opens a group's queue while the queue's own reconcile creates
/// it. The SDK's metadata cache shares one lookup per container: the open at the end of
/// provisioning joined a lookup begun before the container existed and got its 404, so the
/// queue was reported failed and looked at again 30 s later. Here that early lookup is the
/// 404 the service gave before the create, delivered late (fault injection, once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provisioning_succeeds_while_an_earlier_lookup_is_in_flight() {
    use cosmosq_emulator::fault_injection::{
        CustomResponseBuilder, FaultInjectionConditionBuilder, FaultInjectionResultBuilder,
        FaultInjectionRuleBuilder, FaultOperationType,
    };
    cosmosq_tests::init_tracing();
    let emulator = Emulator::in_process(EmulatorOptions::default()).unwrap();
    let not_yet = Arc::new(
        FaultInjectionRuleBuilder::new(
            "lookup-before-create",
            FaultInjectionResultBuilder::new()
                .with_custom_response(
                    CustomResponseBuilder::new(azure_core::http::StatusCode::NotFound)
                        .with_body(
                            r#"{"code":"NotFound","message":"Container 'q' does not exist"}"#,
                        )
                        .build(),
                )
                .with_delay(Duration::from_millis(300))
                .build(),
        )
        .with_condition(
            FaultInjectionConditionBuilder::new()
                .with_operation_type(FaultOperationType::MetadataReadContainer)
                .with_container_id("q")
                .build(),
        )
        .with_hit_limit(1)
        .build(),
    );
    let client = emulator
        .client_with_faults(vec![Arc::clone(&not_yet)])
        .await
        .unwrap();
    let config = QueueConfig::new("db", "q");
    let early = tokio::spawn({
        let (client, config) = (client.clone(), config.clone());
        async move { cosmosq_queue::Queue::open(&client, config).await.err() }
    });
    cosmosq_tests::eventually("the early lookup is sent", Duration::from_secs(10), || {
        let hits = not_yet.hit_count();
        async move { hits == 1 }
    })
    .await;

    let (queue, created) = provision(&client, &config)
        .await
        .expect("provisioning is not failed by a lookup begun before it");
    assert!(created.created_messages_container);
    queue
        .enqueue(NewMessage::json(json!({"n": 1})))
        .await
        .expect("the provisioned queue takes messages");
    let early = early
        .await
        .unwrap()
        .expect("the early lookup found nothing");
    assert_eq!(early.status(), Some(404), "{early}");
}

#[tokio::test]
async fn ttl_sweep_expires_messages_after_retention() {
    cosmosq_tests::init_tracing();
    let emulator = Emulator::in_process(EmulatorOptions::default()).unwrap();
    let client = emulator.client().await.unwrap();
    let mut config = QueueConfig::new("db", "q");
    config.retention = Some(Duration::from_secs(3600));
    let (queue, _) = provision(&client, &config).await.unwrap();
    queue
        .enqueue(NewMessage::json(json!(1)).with_id("long"))
        .await
        .unwrap();
    queue
        .enqueue(
            NewMessage::json(json!(2))
                .with_id("short")
                .with_ttl(Duration::from_secs(60)),
        )
        .await
        .unwrap();
    // Keys other producers write: a number and a boolean expire like strings.
    for (id, key) in [("short-number", json!(42)), ("short-bool", json!(true))] {
        queue
            .enqueue(
                NewMessage::json(json!(3))
                    .with_id(id)
                    .with_partition_key(cosmosq_queue::MessageKey::from_json(key).unwrap())
                    .with_ttl(Duration::from_secs(60)),
            )
            .await
            .unwrap();
    }
    let now = cosmosq_queue::clock::system_now_ms() / 1000;

    assert_eq!(emulator.sweep_ttl(&client, now).await.unwrap(), 0);
    assert_eq!(
        emulator.sweep_ttl(&client, now + 120).await.unwrap(),
        3,
        "per-message ttl first, whatever the key's type"
    );
    assert!(queue
        .read_message(&"short".into(), "short")
        .await
        .unwrap()
        .is_none());
    assert!(queue
        .read_message(&"long".into(), "long")
        .await
        .unwrap()
        .is_some());
    assert_eq!(
        emulator.sweep_ttl(&client, now + 3700).await.unwrap(),
        1,
        "then retention"
    );
    assert!(queue
        .read_message(&"long".into(), "long")
        .await
        .unwrap()
        .is_none());
}

/// Every claim, lease and checkpoint is an ETag compare-and-swap, which multi-region writes
/// break (last writer wins): connecting to such an account fails, naming the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_account_with_multi_region_writes_is_refused_at_connect() {
    cosmosq_tests::init_tracing();
    let served = Emulator::serve_localhost(
        0,
        EmulatorOptions {
            partitions: 1,
            multi_region_writes: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let err = ConnectionArgs::emulator(&served.endpoint)
        .connect()
        .await
        .expect_err("multi-region writes are refused");
    assert!(
        err.to_string().contains("enableMultipleWriteLocations"),
        "{err}"
    );
    served.stop.cancel();
}

/// A lease container made by an earlier version gets the index the per-range sweep filters on
/// when the queue is provisioned again; its other settings stay.
#[tokio::test]
async fn provisioning_again_indexes_what_an_older_lease_container_lacks() {
    use azure_data_cosmos::models::ContainerProperties;
    let emulator = Emulator::in_process(EmulatorOptions {
        partitions: 1,
        ..Default::default()
    })
    .unwrap();
    let client = emulator.client().await.unwrap();
    let config = QueueConfig::new("db", "q");
    client.create_database("db", None).await.unwrap();
    let db = client.database_client("db");
    let mut old = cosmosq_queue::cosmos::provision::lease_container(&config);
    let policy = old.indexing_policy.as_mut().unwrap();
    policy.included_paths.retain(|p| p.path != "/epk/?");
    db.create_container(old, None).await.unwrap();

    let leases = || async {
        let container = client
            .database_client("db")
            .container_client(config.lease_container_name().as_str(), None)
            .await
            .unwrap();
        let properties: ContainerProperties =
            container.read(None).await.unwrap().into_model().unwrap();
        properties
    };
    let before = leases().await;
    assert!(!before
        .indexing_policy
        .as_ref()
        .unwrap()
        .included_paths
        .iter()
        .any(|p| p.path == "/epk/?"));
    provision(&client, &config).await.unwrap();
    let after = leases().await;
    let paths: Vec<_> = after
        .indexing_policy
        .as_ref()
        .unwrap()
        .included_paths
        .iter()
        .map(|p| p.path.as_str())
        .collect();
    assert!(paths.contains(&"/epk/?"), "{paths:?}");
    assert!(paths.contains(&"/due/?"), "{paths:?}");
    assert_eq!(after.default_ttl, before.default_ttl);
}

/// A process configured with another partition key path than the container's uses the
/// container's: keys, EPKs and the per-range sweep agree with where Cosmos put the messages.
#[tokio::test]
async fn the_partition_key_path_is_the_containers() {
    let emulator = Emulator::in_process(EmulatorOptions {
        partitions: 1,
        ..Default::default()
    })
    .unwrap();
    let client = emulator.client().await.unwrap();
    let mut config = QueueConfig::new("db", "q");
    config.partition_key_path = "/tenant".into();
    provision(&client, &config).await.unwrap();
    let queue = cosmosq_queue::Queue::open(&client, QueueConfig::new("db", "q"))
        .await
        .unwrap();
    assert_eq!(queue.config().partition_key_path, "/tenant");
    queue
        .enqueue(
            NewMessage::json(json!({"n": 1}))
                .with_id("m")
                .with_partition_key("acme"),
        )
        .await
        .unwrap();
    let message = queue.read_message(&"acme".into(), "m").await.unwrap();
    assert!(
        message.is_some(),
        "stored and found under the container's key path"
    );
}

/// What an Entra identity can do with data-plane roles: verify, create nothing, and say what
/// an admin must create or change, until what they made is what the engine needs.
#[tokio::test]
async fn verifying_creates_nothing_and_names_what_is_missing_or_unlike_the_engines() {
    use azure_data_cosmos::models::{ContainerProperties, TimeToLive};
    use cosmosq_queue::cosmos::provision::{
        lease_container, messages_container, verify, Shortfall,
    };
    let emulator = Emulator::in_process(EmulatorOptions {
        partitions: 1,
        ..Default::default()
    })
    .unwrap();
    let client = emulator.client().await.unwrap();
    let config = QueueConfig::new("db", "q");
    let shortfalls = |found: Result<_, Vec<Shortfall>>| found.err().expect("not verified");
    assert_eq!(
        shortfalls(verify(&client, &config).await.unwrap()),
        [Shortfall::Database("db".into())]
    );
    assert!(
        client.database_client("db").read(None).await.is_err(),
        "verify created the database"
    );

    client.create_database("db", None).await.unwrap();
    assert_eq!(
        shortfalls(verify(&client, &config).await.unwrap()),
        [
            Shortfall::Container {
                name: "q".into(),
                partition_key: "/pk".into()
            },
            Shortfall::Container {
                name: "q-leases".into(),
                partition_key: "/pk".into()
            },
        ]
    );

    // An admin's containers: the messages one as the docs say; the lease one on another key,
    // with time to live off, and an indexing policy that indexes nothing but `/type/?`.
    let db = client.database_client("db");
    db.create_container(messages_container(&config), None)
        .await
        .unwrap();
    let mut leases = lease_container(&config);
    leases = ContainerProperties::new(
        leases.id.clone(),
        serde_json::from_value(json!({"paths": ["/id"], "kind": "Hash", "version": 2})).unwrap(),
    )
    .with_default_ttl(TimeToLive::Forever)
    .with_indexing_policy(
        serde_json::from_value(json!({"indexingMode": "consistent", "automatic": true,
            "includedPaths": [{"path": "/type/?"}], "excludedPaths": [{"path": "/*"}]}))
        .unwrap(),
    );
    db.create_container(leases, None).await.unwrap();
    let found = shortfalls(verify(&client, &config).await.unwrap());
    let said: Vec<String> = found.iter().map(ToString::to_string).collect();
    assert_eq!(
        said[..3],
        [
            "container q-leases is partitioned on /id, not /pk",
            "container q-leases has no time to live for them (settled message states would never expire)",
            "container q-leases does not index /group/?",
        ],
        "{said:#?}"
    );
    assert_eq!(found.len(), 2 + 5, "{said:#?}"); // and /state, /due, /enqueuedAt, /epk

    // Made again as the engine needs it (the service's default indexing policy indexes all).
    db.container_client("q-leases", None)
        .await
        .unwrap()
        .delete(None)
        .await
        .unwrap();
    let mut leases = lease_container(&config);
    leases.indexing_policy = None;
    db.create_container(leases, None).await.unwrap();
    let queue = verify(&client, &config).await.unwrap().expect("verified");
    queue
        .enqueue(NewMessage::json(json!({"n": 1})))
        .await
        .unwrap();
}

/// The containers docs/identity.md tells an admin to create (its indexing policies, partition
/// keys and time to live) are what the engine makes itself, and pass the operator's check.
#[tokio::test]
async fn the_containers_the_identity_docs_describe_pass_verification() {
    use azure_data_cosmos::models::{ContainerProperties, IndexingPolicy, TimeToLive};
    use cosmosq_queue::cosmos::provision::{lease_container, messages_container, verify};
    let doc = |name: &str| -> IndexingPolicy {
        let path = format!("{}/../docs/identity/{name}", env!("CARGO_MANIFEST_DIR"));
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
    };
    let config = QueueConfig::new("shop", "orders");
    assert_eq!(
        Some(doc("messages-indexing.json")),
        messages_container(&config).indexing_policy
    );
    assert_eq!(
        Some(doc("leases-indexing.json")),
        lease_container(&config).indexing_policy
    );
    let emulator = Emulator::in_process(EmulatorOptions::default()).unwrap();
    let client = emulator.client().await.unwrap();
    client.create_database("shop", None).await.unwrap();
    let db = client.database_client("shop");
    let hash = |path: &str| {
        serde_json::from_value(json!({"paths": [path], "kind": "Hash", "version": 2})).unwrap()
    };
    // `--ttl 604800` (retention 7d) and `--ttl -1`, as the docs' commands give them.
    db.create_container(
        ContainerProperties::new("orders", hash("/pk"))
            .with_default_ttl(TimeToLive::Seconds(604_800))
            .with_indexing_policy(doc("messages-indexing.json")),
        None,
    )
    .await
    .unwrap();
    db.create_container(
        ContainerProperties::new("orders-leases", hash("/pk"))
            .with_default_ttl(TimeToLive::NoDefault)
            .with_indexing_policy(doc("leases-indexing.json")),
        None,
    )
    .await
    .unwrap();
    verify(&client, &config)
        .await
        .unwrap()
        .expect("the docs' containers verify");
}
