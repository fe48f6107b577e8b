//! What each host does for the ranges it owns, and only those: sweeps and estimates.

use std::time::Duration;

use cosmosq_queue::host::Host;
use cosmosq_queue::{GroupConfig, QueueConfig, StartFrom};
use cosmosq_tests::{fast_host, Fixture, Ledger};
use tokio_util::sync::CancellationToken;

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_sweeping_together_read_each_due_message_once() {
    let fixture = Fixture::new(2).await;
    // Starting from now, the hosts read none of these messages from the feed: every delivery
    // comes from the sweep.
    let config = GroupConfig::new("g");
    let group = fixture.group(config.clone());
    const MESSAGES: usize = 30;
    for i in 0..MESSAGES {
        enqueued_and_failed(
            &fixture,
            &group,
            &format!("k{i}"),
            &format!("m{i}"),
            Duration::from_millis(300),
        )
        .await;
    }
    // Three hosts, each with its own queue handle (its own request counters), sweep the two
    // ranges' retries: each message is found by its range's owner.
    let ledger = Ledger::new();
    let handler = ledger.completing();
    let mut hosts = Vec::new();
    for name in ["a", "b", "c"] {
        let queue = cosmosq_queue::Queue::open(&fixture.client, QueueConfig::new("db", "q"))
            .await
            .unwrap();
        let host = Host::new(
            queue.group(config.clone()).unwrap(),
            handler.clone(),
            fast_host(name),
        );
        let stop = CancellationToken::new();
        hosts.push((queue, stop.clone(), tokio::spawn(host.run(stop))));
    }
    ledger.wait_until(|l| l.given("g").len() >= MESSAGES).await;
    let mut reads = 0;
    for (queue, stop, task) in hosts {
        stop.cancel();
        task.await.unwrap().unwrap();
        reads += queue
            .charges()
            .snapshot()
            .by_operation
            .get("read message")
            .map_or(0, |c| c.calls);
    }
    assert_eq!(ledger.given("g").len(), MESSAGES, "each delivered once");
    ledger.assert_each_once("g");
    assert_eq!(
        reads, MESSAGES as u64,
        "only the host that took a message over reads it"
    );
}

/// Each host sweeps the state of the ranges it owns (and documents from before state carried an
/// EPK), so hosts do not query, read and race on the same documents.
#[tokio::test]
async fn hosts_sweep_disjoint_sets_of_due_messages_by_owned_range() {
    let (fixture, clock) = Fixture::with_manual_clock(2).await;
    let group = fixture.group(GroupConfig::new("g"));
    const MESSAGES: usize = 40;
    for i in 0..MESSAGES {
        let (key, id) = (format!("k{i}"), format!("m{i}"));
        enqueued_and_failed(&fixture, &group, &key, &id, Duration::from_secs(1)).await;
    }
    // A document an earlier version wrote carries no EPK.
    let legacy = group.read_state(&"k0".into(), "m0").await.unwrap().unwrap();
    assert!(legacy.epk.is_some(), "new state documents carry the EPK");
    let mut raw = serde_json::to_value(&legacy).unwrap();
    raw.as_object_mut().unwrap().remove("epk");
    fixture
        .queue
        .leases()
        .upsert_item(legacy.pk.clone(), &legacy.id, raw, None)
        .await
        .unwrap();
    clock.advance(Duration::from_secs(2));

    let ranges = cosmosq_tests::physical_ranges(&fixture.queue).await;
    assert_eq!(ranges.len(), 2);
    let ids = |docs: Vec<cosmosq_queue::StateDoc>| -> std::collections::BTreeSet<String> {
        docs.into_iter().map(|d| d.id).collect()
    };
    let first = ids(group.due(100, Some(&ranges[..1])).await.unwrap());
    let second = ids(group.due(100, Some(&ranges[1..])).await.unwrap());
    let all = ids(group.due(100, None).await.unwrap());
    assert_eq!(all.len(), MESSAGES);
    let shared: Vec<_> = first.intersection(&second).cloned().collect();
    assert_eq!(
        shared,
        vec!["m0".to_owned()],
        "only the legacy document is in both"
    );
    assert!(first.len() > 1 && second.len() > 1, "{first:?} {second:?}");
    assert_eq!(&first | &second, all, "every due message is some range's");
    let both = ids(group.due(100, Some(&ranges)).await.unwrap());
    assert_eq!(both, all, "a host owning every range sweeps everything");
    for id in first.iter().filter(|id| *id != "m0") {
        let i: usize = id[1..].parse().unwrap();
        let epk = fixture.queue.message_epk(&format!("k{i}").into());
        assert!(
            cosmosq_queue::range::epk_in(&epk, &ranges[0].0, &ranges[0].1),
            "{id} belongs to the first range"
        );
    }
}

#[tokio::test]
async fn a_sidecar_estimates_only_the_ranges_it_owns() {
    let fixture = Fixture::new(2).await;
    let group = fixture.group(GroupConfig::new("g").with_start_from(StartFrom::Beginning));
    let store = cosmosq_queue::lease::LeaseStore::new(fixture.queue.clone(), "g")
        .with_start_from(StartFrom::Beginning);
    let now = fixture.queue.clock().now_ms();
    store.reconcile(now, 60_000).await.unwrap();
    let leases = store.list().await.unwrap();
    assert_eq!(leases.len(), 2);
    store.acquire(&leases[0], "me", now).await.unwrap();
    let mine = group.estimate_owned("me").await.unwrap();
    assert_eq!(mine.ranges.len(), 1);
    assert_eq!(mine.ranges[0].owner.as_deref(), Some("me"));
    assert_eq!(group.estimate().await.unwrap().ranges.len(), 2);
    assert!(group
        .estimate_owned("nobody")
        .await
        .unwrap()
        .ranges
        .is_empty());
}
