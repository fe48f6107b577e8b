//! The change-feed lease loop: several hosts per group, balance, fencing, splits, kills.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use cosmosq_emulator::fault_injection::{
    FaultInjectionErrorType, FaultInjectionResultBuilder, FaultInjectionRuleBuilder,
};
use cosmosq_queue::host::{Host, HostOptions};
use cosmosq_queue::lease::LeaseStore;
use cosmosq_queue::{
    ConsumerStats, Delivery, DeliveryMode, ExclusiveWrites, GroupConfig, MessageState, NewMessage,
    Outcome, Queue, QueueConfig, StartFrom,
};
use cosmosq_tests::{eventually, fast_host, wait_on, Fixture, Ledger};
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// [`fast_host`], sweeping every 250 ms.
fn fast(name: &str) -> HostOptions {
    HostOptions {
        sweep_interval: Duration::from_millis(250),
        ..fast_host(name)
    }
}

struct RunningHost {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<cosmosq_queue::Result<()>>,
    stats: Arc<ConsumerStats>,
}

fn start<F, Fut>(
    fixture: &Fixture,
    group: &GroupConfig,
    options: HostOptions,
    handler: F,
) -> RunningHost
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Outcome> + Send + 'static,
{
    let host = Host::new(fixture.group(group.clone()), handler, options);
    let stats = host.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(host.run(stop.clone()));
    RunningHost { stop, task, stats }
}

async fn enqueue(fixture: &Fixture, range: std::ops::Range<usize>) {
    let batch: Vec<_> = range
        .map(|i| {
            NewMessage::json(json!({"i": i}))
                .with_id(format!("m{i}"))
                .with_partition_key(format!("k{}", i % 97))
        })
        .collect();
    for chunk in batch.chunks(500) {
        fixture.enqueue_all(chunk.to_vec()).await;
    }
}

/// Group `g`, reading from the beginning, with its leases created (nothing read yet).
async fn unread_from_the_start(fixture: &Fixture) -> cosmosq_queue::Group {
    let group = fixture.group(GroupConfig::new("g").with_start_from(StartFrom::Beginning));
    LeaseStore::new(fixture.queue.clone(), "g")
        .reconcile(0, 60_000)
        .await
        .unwrap();
    group
}

/// Waits for message `slow`'s lock to be renewed past its first half second while it stays
/// locked (the app still works on it).
async fn the_slow_lock_is_renewed(group: &cosmosq_queue::Group) {
    let first_due = group
        .read_state(&"k".into(), "slow")
        .await
        .unwrap()
        .unwrap()
        .due
        .unwrap();
    eventually("the lock was renewed", Duration::from_secs(3), || async {
        let state = group
            .read_state(&"k".into(), "slow")
            .await
            .unwrap()
            .unwrap();
        state.state == MessageState::Locked && state.due.unwrap() > first_due + 500
    })
    .await;
}

/// Group `g`'s lease on a one-range fixture.
async fn the_lease(fixture: &Fixture) -> cosmosq_queue::lease::Lease {
    LeaseStore::new(fixture.queue.clone(), "g")
        .list()
        .await
        .unwrap()
        .remove(0)
}

/// A host on one range whose app holds message `slow` (key `k`) until `release` is notified,
/// and 200 messages enqueued behind it, all delivered.
async fn a_slow_message_then_200(
    fixture: &Fixture,
    config: &GroupConfig,
) -> (RunningHost, Arc<Ledger>, Arc<tokio::sync::Notify>) {
    let release = Arc::new(tokio::sync::Notify::new());
    let ledger = Ledger::new();
    let handler = {
        let release = Arc::clone(&release);
        ledger.handler(move |d: Delivery| {
            let release = Arc::clone(&release);
            async move {
                if d.message.id == "slow" {
                    release.notified().await;
                }
                Outcome::Complete
            }
        })
    };
    fixture
        .queue
        .enqueue(
            NewMessage::json(json!(0))
                .with_id("slow")
                .with_partition_key("k"),
        )
        .await
        .unwrap();
    let host = start(
        fixture,
        config,
        HostOptions {
            page_size: 10,
            ..fast("h")
        },
        handler,
    );
    ledger.wait_until(|l| l.delivered("g") == 1).await;
    enqueue(fixture, 0..200).await;
    ledger.wait_until(|l| l.delivered("g") == 201).await;
    (host, ledger, release)
}

/// Each lease's owner, as the pod it names (a lease names its holder `<pod>#<incarnation>`).
async fn owners(fixture: &Fixture, group: &str) -> Vec<Option<String>> {
    LeaseStore::new(fixture.queue.clone(), group)
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|l| l.owner.as_deref().map(pod).map(str::to_owned))
        .collect()
}

/// The pod a holder (`<pod>#<incarnation>`) is.
fn pod(holder: &str) -> &str {
    holder.split('#').next().unwrap_or(holder)
}

/// Stops the hosts gracefully (drain, release) and returns how many messages they completed.
async fn stop_all(hosts: Vec<RunningHost>) -> u64 {
    for h in &hosts {
        h.stop.cancel();
    }
    let mut total = 0;
    for h in hosts {
        h.task.await.unwrap().unwrap();
        total += h.stats.completed.load(Ordering::Relaxed);
    }
    total
}

fn completed(hosts: &[&Arc<ConsumerStats>]) -> u64 {
    hosts
        .iter()
        .map(|s| s.completed.load(Ordering::Relaxed))
        .sum()
}

#[tokio::test(start_paused = true)]
async fn three_hosts_two_groups_balance_and_settle_every_message_once() {
    const MESSAGES: usize = 5_000;
    let fixture = Fixture::paused(4).await;
    enqueue(&fixture, 0..MESSAGES).await;
    let ledger = Ledger::new();
    let mut hosts = Vec::new();
    for group in ["billing", "audit"] {
        let config = GroupConfig::new(group).with_start_from(StartFrom::Beginning);
        for h in 0..3 {
            hosts.push(start(
                &fixture,
                &config,
                fast(&format!("{group}-{h}")),
                ledger.completing(),
            ));
        }
    }
    ledger
        .wait_until(|l| l.delivered("billing") == MESSAGES && l.delivered("audit") == MESSAGES)
        .await;
    for group in ["billing", "audit"] {
        eventually(
            "leases balanced 1-2 per host",
            Duration::from_secs(10),
            || async {
                let owners = owners(&fixture, group).await;
                (0..3).all(|h| {
                    let n = owners
                        .iter()
                        .filter(|o| o.as_deref() == Some(&format!("{group}-{h}")))
                        .count();
                    (1..=2).contains(&n)
                })
            },
        )
        .await;
    }
    assert_eq!(
        stop_all(hosts).await as usize,
        2 * MESSAGES,
        "no message completed twice"
    );
    for group in ["billing", "audit"] {
        ledger.assert_each_once(group);
    }
}

#[tokio::test(start_paused = true)]
async fn graceful_stop_releases_leases_for_another_host_at_once() {
    let fixture = Fixture::paused(4).await;
    let ledger = Ledger::new();
    let config = GroupConfig::new("g");
    let mut slow_to_expire = fast("a");
    slow_to_expire.lease_expire = Duration::from_secs(3600);
    let a = start(
        &fixture,
        &config,
        slow_to_expire.clone(),
        ledger.completing(),
    );
    eventually("a holds all leases", Duration::from_secs(5), || async {
        owners(&fixture, "g")
            .await
            .iter()
            .all(|o| o.as_deref() == Some("a"))
    })
    .await;
    eventually("a reports four leases", Duration::from_secs(2), || async {
        a.stats.leases_owned.load(Ordering::Relaxed) == 4
    })
    .await;
    let a_stats = Arc::clone(&a.stats);
    let mut b_options = slow_to_expire.clone();
    b_options.owner = "b".into();
    let b = start(&fixture, &config, b_options, ledger.completing());
    a.stop.cancel();
    a.task.await.unwrap().unwrap();
    assert_eq!(a_stats.leases_owned.load(Ordering::Relaxed), 0);
    assert_eq!(
        a_stats.leases_lost.load(Ordering::Relaxed),
        0,
        "released, not lost"
    );
    // Released, not left to expire (expiry is an hour here): b takes them on its next rounds.
    eventually("b holds all leases", Duration::from_secs(3), || async {
        owners(&fixture, "g")
            .await
            .iter()
            .all(|o| o.as_deref() == Some("b"))
    })
    .await;
    enqueue(&fixture, 0..50).await;
    ledger.wait_until(|l| l.delivered("g") == 50).await;
    b.stop.cancel();
    b.task.await.unwrap().unwrap();
    assert!(
        owners(&fixture, "g").await.iter().all(Option::is_none),
        "all released"
    );
}

/// One heartbeat per host keeps its idle leases, in both modes and on both exclusive write
/// paths: a host running four idle leases writes its heartbeat once a renewal interval and
/// renews none of them (its listing shows each unchanged, so it reads none either); another
/// host gets two of them for balance (by hand-over, or stolen on the claims path), never by
/// expiry, however long they stay idle; and once the first host dies, the other takes the
/// rest, only after the lease expiry.
#[tokio::test(start_paused = true)]
async fn idle_leases_live_on_one_heartbeat_per_host_and_expire_with_it() {
    for (config, stolen) in [
        (GroupConfig::new("g"), 0),
        (
            GroupConfig::new("g").with_exclusive_writes(ExclusiveWrites::Claims),
            2,
        ),
        (GroupConfig::new("g").with_mode(DeliveryMode::Stream), 0),
    ] {
        idle_on_one_heartbeat(config, stolen).await;
    }
}

/// The test above for one group: `stolen`, how many leases balance steals from the first host
/// (the claims path does not hand leases over).
async fn idle_on_one_heartbeat(config: GroupConfig, stolen: u64) {
    let what = format!("{:?} {:?}", config.mode, config.exclusive_writes);
    let fixture = Fixture::paused(4).await;
    let ledger = Ledger::new();
    let options = fast("a");
    let (renew, expire) = (options.lease_renew, options.lease_expire);
    let a = start(&fixture, &config, options, ledger.completing());
    eventually("a runs all four leases", Duration::from_secs(5), || async {
        a.stats.leases_owned.load(Ordering::Relaxed) == 4
    })
    .await;
    let calls = |op: &str| fixture.queue.charges().snapshot().calls(op);
    // Past the acquisitions' own deadlines: from here on the heartbeat keeps them.
    tokio::time::sleep(expire).await;
    let before = [
        calls("renew lease"),
        calls("write heartbeat"),
        calls("read lease"),
    ];
    tokio::time::sleep(renew * 20).await;
    let after = [
        calls("renew lease"),
        calls("write heartbeat"),
        calls("read lease"),
    ];
    let [renewals, beats, reads] = [0, 1, 2].map(|i| after[i] - before[i]);
    assert_eq!(
        renewals, 0,
        "{what}: idle leases are not renewed one by one"
    );
    assert!(
        (19..=21).contains(&beats),
        "{what}: one heartbeat a renewal interval: {beats}"
    );
    // The host lists its leases every acquire interval, shorter than the renewal's: each
    // check finds its lease unchanged there, and reads nothing.
    assert_eq!(
        reads, 0,
        "{what}: no lease is read while the listing shows it"
    );

    let b = start(&fixture, &config, fast("b"), ledger.completing());
    tokio::time::sleep(expire * 4).await;
    let mut held = owners(&fixture, "g").await;
    held.sort();
    let two_each: Vec<Option<String>> = ["a", "a", "b", "b"].map(|h| Some(h.into())).to_vec();
    assert_eq!(held, two_each, "{what}: balanced");
    assert_eq!(
        a.stats.leases_lost.load(Ordering::Relaxed),
        stolen,
        "{what}: what balance did not move is not taken as expired"
    );

    // a dies: no release, no last heartbeat.
    a.task.abort();
    let died = tokio::time::Instant::now();
    let mut a_held = 2;
    while a_held > 0 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        a_held = owners(&fixture, "g")
            .await
            .iter()
            .filter(|o| o.as_deref() == Some("a"))
            .count();
        if a_held > 0 {
            assert!(
                died.elapsed() < expire * 3,
                "{what}: a's leases were never taken"
            );
        }
    }
    // Its last heartbeat may have been written up to a renewal interval before it died.
    assert!(
        died.elapsed() >= expire - renew,
        "{what}: taken {:?} after a died, before the expiry",
        died.elapsed()
    );
    enqueue(&fixture, 0..50).await;
    ledger.wait_until(|l| l.delivered("g") == 50).await;
    b.stop.cancel();
    b.task.await.unwrap().unwrap();
}

/// Idle ranges of one physical partition on one host share one read of it: a host with four
/// leases of a partition, all idle, reads the partition once a `maxPoll` (the probe) and each
/// range by itself only every `idleRead`; a message written at any moment still reaches the
/// app within about `maxPoll`, as when every range polls.
#[tokio::test(start_paused = true)]
async fn idle_ranges_of_one_partition_share_one_read_and_still_deliver_within_max_poll() {
    for config in [
        GroupConfig::new("g"),
        GroupConfig::new("g").with_exclusive_writes(ExclusiveWrites::Claims),
        GroupConfig::new("g").with_ordering(true),
        GroupConfig::new("g").with_mode(DeliveryMode::Stream),
    ] {
        one_read_per_partition(config).await;
    }
}

/// The resting tests' timings: `maxPoll` 1 s, `idleRead` 30 s.
const MAX_POLL: Duration = Duration::from_secs(1);
const IDLE_READ: Duration = Duration::from_secs(30);

/// One host running all four leases of a one-partition queue, with the resting tests'
/// timings.
async fn four_leases_of_one_partition(config: &GroupConfig) -> (Fixture, Arc<Ledger>, RunningHost) {
    let fixture = Fixture::paused(1).await;
    let ledger = Ledger::new();
    let options = HostOptions {
        leases_per_partition: 4,
        max_poll: MAX_POLL,
        idle_read: IDLE_READ,
        ..fast("a")
    };
    let a = start(&fixture, config, options, ledger.completing());
    eventually("a runs all four leases", Duration::from_secs(5), || async {
        a.stats.leases_owned.load(Ordering::Relaxed) == 4
    })
    .await;
    (fixture, ledger, a)
}

/// The ranges' own reads and the probes' over two `idleRead`s from now.
async fn reads_and_probes_over_two_idle_reads(fixture: &Fixture) -> (u64, u64) {
    let calls = || {
        let spent = fixture.queue.charges().snapshot();
        (
            spent.calls("read change feed"),
            spent.calls("probe partition"),
        )
    };
    let before = calls();
    tokio::time::sleep(IDLE_READ * 2).await;
    let after = calls();
    (after.0 - before.0, after.1 - before.1)
}

async fn one_read_per_partition(config: GroupConfig) {
    let what = format!(
        "{:?} {:?}, ordered {}",
        config.mode, config.exclusive_writes, config.ordered
    );
    let (fixture, ledger, a) = four_leases_of_one_partition(&config).await;
    // Backed off and resting.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let (reads, probes) = reads_and_probes_over_two_idle_reads(&fixture).await;
    // Each range reads by itself once an idleRead (2 each here), not once a maxPoll (60 each).
    assert!(
        reads <= 12,
        "{what}: idle ranges read by themselves: {reads}"
    );
    assert!(
        (58..=61).contains(&probes),
        "{what}: one probe of the partition a maxPoll: {probes}"
    );

    // Messages written at moments that fall anywhere between probes, each to a key of any
    // of the four ranges: each is delivered within maxPoll (and the reads it wakes).
    each_delivered_within_max_poll(&fixture, &ledger, &what, 24).await;
    a.stop.cancel();
    a.task.await.unwrap().unwrap();
}

/// A partition that splits under resting ranges, or before its probe first read it: the
/// probe, which reads the parent's bounds, then answers for one child only; it ends, and the
/// ranges poll by themselves until they join the probe of the child they lie in, so a
/// message to either child still arrives within about `maxPoll`, not at `idleRead`, and the
/// ranges rest again.
#[tokio::test(start_paused = true)]
async fn resting_ranges_of_a_partition_that_splits_still_deliver_within_max_poll() {
    for resting_first in [true, false] {
        split_under_resting_ranges(resting_first).await;
    }
}

async fn split_under_resting_ranges(resting_first: bool) {
    let what = match resting_first {
        true => "split under resting ranges",
        false => "split before the probe's first read",
    };
    let (fixture, ledger, a) = four_leases_of_one_partition(&GroupConfig::new("g")).await;
    let probes = || fixture.queue.charges().snapshot().calls("probe partition");
    if resting_first {
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(probes() > 0, "the ranges rest on the probe");
    } else {
        assert_eq!(probes(), 0, "the ranges are not idle yet");
    }
    split_the_first_partition(&fixture).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    each_delivered_within_max_poll(&fixture, &ledger, what, 24).await;
    // And they rest again, on the probes of the partitions they now lie in: over two
    // idleReads, a few reads of their own rather than one a maxPoll each (about 240).
    let (reads, probes) = reads_and_probes_over_two_idle_reads(&fixture).await;
    println!("{what}, over two idleReads: {reads} range reads, {probes} probes");
    assert!(
        reads <= 16,
        "{what}: idle ranges read by themselves: {reads}"
    );
    assert!(
        probes >= 100,
        "{what}: two partitions, one probe each a maxPoll: {probes}"
    );
    a.stop.cancel();
    a.task.await.unwrap().unwrap();
}

/// Splits the queue's first physical partition at its midpoint, at once.
async fn split_the_first_partition(fixture: &Fixture) {
    let store = fixture.emulator.store();
    let ids = fixture.emulator.partition_ids("db", "q").await.unwrap();
    let epk = store.midpoint_split_epk("db", "q", ids[0]).unwrap();
    store
        .split_partition_and_wait("db", "q", ids[0], epk, Duration::ZERO)
        .await
        .unwrap();
}

/// `count` messages, each written at a seeded random moment to a random key once the one
/// before was delivered, and each delivered within `maxPoll` (and the reads it wakes).
async fn each_delivered_within_max_poll(
    fixture: &Fixture,
    ledger: &Ledger,
    what: &str,
    count: usize,
) {
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = |below: u64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % below
    };
    for i in 0..count {
        tokio::time::sleep(Duration::from_millis(next(2_500))).await;
        let written = tokio::time::Instant::now();
        fixture
            .enqueue_all(vec![NewMessage::json(json!({"i": i}))
                .with_id(format!("m{i}"))
                .with_partition_key(format!("k{}", next(1_000)))])
            .await;
        ledger.wait_until(|l| l.delivered("g") == i + 1).await;
        let took = written.elapsed();
        assert!(
            took <= MAX_POLL + Duration::from_millis(250),
            "{what}: message {i} reached the app {took:?} after it was written"
        );
        // Resting again before the next one.
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
}

/// The claims write path: the slow message's claim is its lock, renewed while the app works;
/// once it runs past `promoteAfter` it holds its range no more, so the checkpoint passes it
/// (its claim brings it back if its holder dies) and a drain or hand-over does not wait for
/// it. (The lease write path first gives it a lock of its own: next test.)
#[tokio::test(start_paused = true)]
async fn a_slow_message_on_claims_keeps_its_claim_and_the_checkpoint_passes_it() {
    let fixture = Fixture::paused(1).await;
    let config = GroupConfig::new("g")
        .with_start_from(StartFrom::Beginning)
        .with_exclusive_writes(ExclusiveWrites::Claims)
        .with_lock_duration(Duration::from_secs(1));
    let (host, _ledger, release) = a_slow_message_then_200(&fixture, &config).await;
    eventually(
        "the range kept flowing past the slow message",
        Duration::from_secs(5),
        || async { host.stats.completed.load(Ordering::Relaxed) == 200 },
    )
    .await;

    // The lock is renewed while the app works (lock 1 s, we wait past it).
    let group = fixture.group(config.clone());
    the_slow_lock_is_renewed(&group).await;

    // Its claim holds it, not the range: the checkpoint passed it.
    eventually(
        "the checkpoint passed the slow message",
        Duration::from_secs(5),
        || async {
            let lease = the_lease(&fixture).await;
            !read_ids_from(&fixture, &lease)
                .await
                .contains(&"slow".to_string())
        },
    )
    .await;
    let state = group
        .read_state(&"k".into(), "slow")
        .await
        .unwrap()
        .unwrap();
    assert_eq!((state.state, state.attempts), (MessageState::Locked, 1));

    release.notify_waiters();
    eventually(
        "slow settles and the checkpoint moves past everything",
        Duration::from_secs(5),
        || async {
            let lease = the_lease(&fixture).await;
            group
                .read_state(&"k".into(), "slow")
                .await
                .unwrap()
                .unwrap()
                .state
                == MessageState::Completed
                && read_ids_from(&fixture, &lease).await.is_empty()
        },
    )
    .await;
    host.stop.cancel();
    host.task.await.unwrap().unwrap();
}

/// Message ids a fresh reader sees when resuming a lease's range from its checkpoint.
async fn read_ids_from(fixture: &Fixture, lease: &cosmosq_queue::lease::Lease) -> Vec<String> {
    use azure_data_cosmos::feed::ContinuationToken;
    use azure_data_cosmos::options::{ChangeFeedOptions, ChangeFeedStartFrom};
    use futures::StreamExt;
    let mut options = ChangeFeedOptions::default();
    if let Some(token) = &lease.continuation {
        options = options.with_continuation_token(ContinuationToken::from_string(token.clone()));
    }
    let mut pages = fixture
        .queue
        .messages()
        .query_change_feed::<serde_json::Value>(
            azure_data_cosmos::FeedScope::range(lease.feed_range().unwrap()),
            ChangeFeedStartFrom::Beginning,
            Some(options),
        )
        .await
        .unwrap();
    let page = pages.next().await.unwrap().unwrap();
    page.items()
        .iter()
        .filter_map(|i| i.current()?.get("id")?.as_str().map(str::to_owned))
        .collect()
}

/// Hosts "a" and "b" of group "g" working through `messages`, once `delivered` are done.
async fn two_hosts_midway(
    fixture: &Fixture,
    messages: usize,
    delivered: usize,
) -> (Arc<Ledger>, RunningHost, RunningHost) {
    let config = GroupConfig::new("g").with_start_from(StartFrom::Beginning);
    let ledger = Ledger::new();
    enqueue(fixture, 0..messages).await;
    let a = start(fixture, &config, fast("a"), ledger.completing());
    let b = start(fixture, &config, fast("b"), ledger.completing());
    ledger.wait_until(|l| l.delivered("g") >= delivered).await;
    (ledger, a, b)
}

#[tokio::test(start_paused = true)]
async fn a_split_during_processing_skips_nothing_and_children_take_over() {
    let fixture = Fixture::paused(2).await;
    let (ledger, a, b) = two_hosts_midway(&fixture, 600, 200).await;

    split_the_first_partition(&fixture).await;
    enqueue(&fixture, 600..1_000).await;

    ledger.wait_until(|l| l.delivered("g") == 1_000).await;
    eventually(
        "three leases, parent gone, all owned",
        Duration::from_secs(10),
        || async {
            let owners = owners(&fixture, "g").await;
            owners.len() == 3 && owners.iter().all(Option::is_some)
        },
    )
    .await;
    assert_eq!(stop_all(vec![a, b]).await, 1_000);
    ledger.assert_each_once("g");
}

#[tokio::test(start_paused = true)]
async fn estimator_matches_the_known_unsettled_work() {
    let fixture = Fixture::paused(2).await;
    let config = GroupConfig::new("g").with_start_from(StartFrom::Beginning);
    let group = fixture.group(config.clone());
    let now_group = fixture.group(GroupConfig::new("late"));
    for g in ["g", "late"] {
        LeaseStore::new(fixture.queue.clone(), g)
            .reconcile(0, 60_000)
            .await
            .unwrap();
    }
    enqueue(&fixture, 0..100).await;

    // 1. Nothing read yet.
    let estimate = group.estimate().await.unwrap();
    assert_eq!(estimate.ranges.len(), 2);
    assert_eq!(estimate.lag(), 100);
    assert_eq!(estimate.backlog(), 100);
    assert!(
        estimate.ranges.iter().all(|r| r.lag.unwrap() > 0),
        "both ranges have work: {estimate:?}"
    );
    let late = now_group.estimate().await.unwrap();
    assert!(
        late.ranges.iter().all(|r| r.lag.is_none()),
        "no checkpoint, starts from now: unknown, not the whole container"
    );
    assert_eq!(late.backlog(), 0);

    // 2. A host settles everything but ten messages that wait for a retry half a minute away
    // (within the estimate's horizon: work due later is no backlog).
    let ledger = Ledger::new();
    let handler = ledger.handler(|d: Delivery| async move {
        let n: usize = d.message.id[1..].parse().unwrap();
        if n.is_multiple_of(10) {
            Outcome::Retry {
                reason: "later".into(),
                delay: Some(Duration::from_secs(30)),
            }
        } else {
            Outcome::Complete
        }
    });
    let host = start(&fixture, &config, fast("h"), handler);
    ledger.wait_until(|l| l.delivered("g") == 100).await;
    eventually(
        "checkpoints reach the end of both ranges",
        Duration::from_secs(5),
        || async {
            let e = group.estimate().await.unwrap();
            e.lag() == 0 && e.ranges.iter().all(|r| r.checkpointed)
        },
    )
    .await;
    host.stop.cancel();
    host.task.await.unwrap().unwrap();
    let estimate = group.estimate().await.unwrap();
    assert_eq!(
        estimate.backlog(),
        10,
        "the retries are the backlog: {estimate:?}"
    );
    let oldest = fixture
        .queue
        .read_message(&"k0".into(), "m0")
        .await
        .unwrap()
        .unwrap()
        .enqueued_at;
    assert_eq!(estimate.oldest_unsettled_at(), Some(oldest));

    // 3. More arrives while nobody reads.
    enqueue(&fixture, 100..130).await;
    let estimate = group.estimate().await.unwrap();
    assert_eq!(estimate.lag(), 30);
    assert_eq!(estimate.backlog(), 40);
}

#[tokio::test(start_paused = true)]
async fn large_lags_come_from_lsns_where_a_batch_is_one_write() {
    let fixture = Fixture::paused(1).await;
    let group = unread_from_the_start(&fixture).await;
    let writes = (0..600).map(|i| {
        let q = fixture.queue.clone();
        async move { q.enqueue(NewMessage::json(json!(i))).await.unwrap() }
    });
    futures::future::join_all(writes).await;
    let batch = (0..100)
        .map(|i| NewMessage::json(json!(i)).with_partition_key("b"))
        .collect();
    fixture.enqueue_all(batch).await;
    // 700 messages in 601 writes: above the exact-count limit the estimate is the LSN distance.
    assert_eq!(group.estimate().await.unwrap().lag(), 601);
}

/// Below the exact-count limit in LSNs a few large batches can hold many messages: the
/// estimate reads a few pages of them at most and extrapolates, so what it costs does not
/// grow with the backlog.
#[tokio::test(start_paused = true)]
async fn a_batched_backlog_is_estimated_from_a_few_pages_whatever_its_size() {
    let fixture = Fixture::paused(1).await;
    let group = unread_from_the_start(&fixture).await;
    let estimate_reads = || fixture.queue.charges().snapshot().calls("estimate");
    let (mut unread, mut reads) = (0, Vec::new());
    for total in [500, 6_000, 12_000] {
        // Batches of 100 messages on one key each: one transactional batch, one LSN, each.
        let batch: Vec<_> = (unread..total)
            .map(|i| NewMessage::json(json!(i)).with_partition_key(format!("b{}", i / 100)))
            .collect();
        for chunk in batch.chunks(100) {
            fixture.enqueue_all(chunk.to_vec()).await;
        }
        unread = total;
        let already = estimate_reads();
        let lag = group.estimate().await.unwrap().lag();
        reads.push(estimate_reads() - already);
        let error = lag.abs_diff(total as u64) as f64 / total as f64;
        assert!(error < 0.05, "{total} unread, estimated {lag}");
    }
    // Past a few pages (and a read of the last item's LSN) nothing more, however many.
    assert!(reads[1] <= reads[0] + 5, "{reads:?}");
    assert_eq!(
        reads[1], reads[2],
        "reads for 6,000 and 12,000 unread: {reads:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_merge_during_processing_keeps_each_lease_on_its_range() {
    let fixture = Fixture::paused(2).await;
    let (ledger, a, b) = two_hosts_midway(&fixture, 400, 100).await;

    let ids = fixture.emulator.partition_ids("db", "q").await.unwrap();
    fixture
        .emulator
        .store()
        .merge_partitions_and_wait("db", "q", ids[0], ids[1], Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(
        fixture
            .emulator
            .partition_ids("db", "q")
            .await
            .unwrap()
            .len(),
        1
    );
    enqueue(&fixture, 400..700).await;

    ledger.wait_until(|l| l.delivered("g") == 700).await;
    // Both leases stay: each reads its half of the merged partition.
    assert_eq!(owners(&fixture, "g").await.len(), 2);
    assert_eq!(stop_all(vec![a, b]).await, 700);
    ledger.assert_each_once("g");
}

#[tokio::test(start_paused = true)]
async fn finer_leases_let_more_hosts_than_partitions_share_the_work() {
    let fixture = Fixture::paused(1).await;
    let config = GroupConfig::new("g").with_start_from(StartFrom::Beginning);
    let ledger = Ledger::new();
    let hosts: Vec<_> = (0..3)
        .map(|h| {
            start(
                &fixture,
                &config,
                HostOptions {
                    leases_per_partition: 3,
                    ..fast(&format!("h{h}"))
                },
                ledger.completing(),
            )
        })
        .collect();
    eventually("one lease per host", Duration::from_secs(10), || async {
        let owners = owners(&fixture, "g").await;
        owners.len() == 3
            && (0..3).all(|h| {
                owners
                    .iter()
                    .any(|o| o.as_deref() == Some(&format!("h{h}")))
            })
    })
    .await;
    enqueue(&fixture, 0..600).await;
    ledger.wait_until(|l| l.delivered("g") == 600).await;
    let stats: Vec<_> = hosts.iter().map(|h| Arc::clone(&h.stats)).collect();
    stop_all(hosts).await;
    assert_eq!(completed(&stats.iter().collect::<Vec<_>>()), 600);
    ledger.assert_each_once("g");
    let per_host: Vec<u64> = stats
        .iter()
        .map(|s| s.completed.load(Ordering::Relaxed))
        .collect();
    assert!(
        per_host.iter().all(|&n| n > 0),
        "every host did part of the work: {per_host:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn ordered_groups_deliver_each_key_in_order_even_across_retries() {
    let fixture = Fixture::paused(2).await;
    let retry = cosmosq_queue::RetryPolicy {
        initial_backoff: Duration::from_millis(20),
        ..Default::default()
    };
    let config = GroupConfig::new("g")
        .with_start_from(StartFrom::Beginning)
        .with_ordering(true)
        .with_retry(retry);
    for n in 0..20 {
        let batch = (0..8)
            .map(|k| {
                NewMessage::json(json!({"n": n}))
                    .with_id(format!("k{k}-{n:02}"))
                    .with_partition_key(format!("k{k}"))
            })
            .collect();
        fixture.enqueue_all(batch).await;
    }
    // Per key: messages completed, in order; and how many were in the app at once.
    let seen: Arc<std::sync::Mutex<std::collections::HashMap<String, Vec<u32>>>> = Arc::default();
    let busy: Arc<std::sync::Mutex<std::collections::HashSet<String>>> = Arc::default();
    let overlaps = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let done = Arc::new(tokio::sync::Notify::new());
    let handler = {
        let (seen, busy, overlaps, done) = (
            Arc::clone(&seen),
            Arc::clone(&busy),
            Arc::clone(&overlaps),
            Arc::clone(&done),
        );
        move |d: Delivery| {
            let (seen, busy, overlaps, done) = (
                Arc::clone(&seen),
                Arc::clone(&busy),
                Arc::clone(&overlaps),
                Arc::clone(&done),
            );
            async move {
                let key = d.message.partition_key.to_string();
                if !busy.lock().unwrap().insert(key.clone()) {
                    overlaps.fetch_add(1, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(rand::random_range(0..3))).await;
                let n = d.message.id[d.message.id.len() - 2..]
                    .parse::<u32>()
                    .unwrap();
                busy.lock().unwrap().remove(&key);
                if n % 5 == 2 && d.delivery_count == 1 {
                    return Outcome::Retry {
                        reason: "transient".into(),
                        delay: None,
                    };
                }
                seen.lock().unwrap().entry(key).or_default().push(n);
                done.notify_waiters();
                Outcome::Complete
            }
        }
    };
    let hosts: Vec<_> = (0..2)
        .map(|h| start(&fixture, &config, fast(&format!("h{h}")), handler.clone()))
        .collect();
    wait_on(&done, "all 160 completed", || {
        seen.lock().unwrap().values().map(Vec::len).sum::<usize>() >= 160
    })
    .await;
    stop_all(hosts).await;
    assert_eq!(
        overlaps.load(Ordering::SeqCst),
        0,
        "two messages of one key in the app at once"
    );
    for (key, order) in seen.lock().unwrap().iter() {
        assert_eq!(order, &(0..20).collect::<Vec<u32>>(), "{key} out of order");
    }
}

#[tokio::test(start_paused = true)]
async fn idle_polling_backs_off_to_the_ceiling_and_work_resets_it() {
    let fixture = Fixture::paused(1).await;
    let config = GroupConfig::new("g").with_start_from(StartFrom::Beginning);
    let ledger = Ledger::new();
    let options = HostOptions {
        min_poll: Duration::from_millis(100),
        max_poll: Duration::from_secs(5),
        sweep_interval: Duration::from_secs(3600),
        ..HostOptions::new("h")
    };
    let host = start(&fixture, &config, options, ledger.completing());
    let reads = || fixture.queue.charges().snapshot().calls("read change feed");
    // Warm up: the lease is taken and the feed found empty.
    tokio::time::sleep(Duration::from_secs(60)).await;
    let before = reads();
    let spent_before = fixture.queue.charges().snapshot();
    tokio::time::sleep(Duration::from_secs(60)).await;
    let idle_reads = reads() - before;
    let idle = fixture.queue.charges().snapshot().since(&spent_before);
    println!(
        "idle, one lease, default intervals except the hour-long sweep: {:.3} RU/s ({idle:?})",
        idle.total_request_units() / 60.0
    );
    assert!(
        (11..=13).contains(&idle_reads),
        "one read per 5 s ceiling while idle, got {idle_reads} a minute"
    );
    // Alone on its partition, the range polls by itself: a probe would cost as much.
    assert!(
        !idle.by_operation.contains_key("probe partition"),
        "a lone range rested on a probe: {idle:?}"
    );

    // New work is picked up within the ceiling, then reading speeds up again.
    let started = tokio::time::Instant::now();
    enqueue(&fixture, 0..300).await;
    ledger.wait_until(|l| l.delivered("g") == 300).await;
    assert!(
        started.elapsed() <= Duration::from_secs(6),
        "{:?}",
        started.elapsed()
    );
    host.stop.cancel();
    host.task.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_lease_stolen_mid_delivery_hands_the_rest_over_and_settles_each_message_once() {
    // Regression: a host that lost a range went on delivering every message it had read ahead
    // (a page waiting for permits), so in stream mode the app got each of them twice.
    for mode in [DeliveryMode::Stream, DeliveryMode::Exclusive] {
        stolen_mid_delivery(mode).await;
    }
}

async fn stolen_mid_delivery(mode: DeliveryMode) {
    const MESSAGES: usize = 20;
    let fixture = Fixture::paused(1).await;
    // Exclusive: the claims path, where the delivery under way has a claim of its own.
    let config = GroupConfig::new("s")
        .with_mode(mode)
        .with_exclusive_writes(ExclusiveWrites::Claims)
        .with_start_from(StartFrom::Beginning);
    enqueue(&fixture, 0..MESSAGES).await;
    let a_got = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let (gate, gate_rx) = tokio::sync::watch::channel(false);
    let a = start(
        &fixture,
        &config,
        HostOptions {
            max_concurrency: 1,
            ..fast("a")
        },
        {
            let a_got = Arc::clone(&a_got);
            move |d: Delivery| {
                a_got.lock().unwrap().push(d.message.id.clone());
                let mut gate = gate_rx.clone();
                async move {
                    let _ = gate.wait_for(|open| *open).await;
                    Outcome::Complete
                }
            }
        },
    );
    let a_count = || a_got.lock().unwrap().len();
    eventually(
        "a is working on its first message",
        Duration::from_secs(5),
        || async { a_count() == 1 },
    )
    .await;
    // Another host takes the range (as after a pause longer than the lease expiry).
    let store = LeaseStore::new(fixture.queue.clone(), "s");
    let lease = store.list().await.unwrap().remove(0);
    store
        .acquire(&lease, "thief", fixture.queue.clock().now_ms())
        .await
        .unwrap();
    eventually("a notices the loss", Duration::from_secs(5), || async {
        a.stats.leases_lost.load(Ordering::Relaxed) == 1
    })
    .await;
    // a leaves (so it cannot win the range back); its delivery under way is still at the app
    // and settles under its own claim once the app answers. a's host returns only after that
    // (its process must not exit mid-settle).
    let a_stats = Arc::clone(&a.stats);
    a.stop.cancel();
    gate.send(true).unwrap();
    stop_all(vec![a]).await;
    let in_flight = a_got.lock().unwrap()[0].clone();
    // The thief never renews; b takes the range once it expires.
    let ledger = Ledger::new();
    let b = start(&fixture, &config, fast("b"), ledger.completing());
    let b_stats = Arc::clone(&b.stats);
    if mode == DeliveryMode::Stream {
        // Stream mode: b reads from the checkpoint, so it delivers a's message again too.
        ledger.wait_until(|l| l.delivered("s") == MESSAGES).await;
    } else {
        eventually("a's delivery completes", Duration::from_secs(5), || async {
            a_stats.completed.load(Ordering::Relaxed) == 1
        })
        .await;
        ledger
            .wait_until(|l| l.delivered("s") == MESSAGES - 1)
            .await;
        assert_eq!(
            ledger.counts("s").len(),
            MESSAGES - 1,
            "{mode:?}: b skips the message a still held"
        );
        eventually(
            "b's completions are written",
            Duration::from_secs(5),
            || async { b_stats.completed.load(Ordering::Relaxed) == MESSAGES as u64 - 1 },
        )
        .await;
        let group = fixture.group(config.clone());
        for i in 0..MESSAGES {
            let state = group
                .read_state(&format!("k{}", i % 97).into(), &format!("m{i}"))
                .await
                .unwrap();
            assert_eq!(
                state.map(|s| s.state),
                Some(MessageState::Completed),
                "m{i}"
            );
        }
    }
    assert_eq!(
        *a_got.lock().unwrap(),
        vec![in_flight],
        "{mode:?}: a delivered only what was under way when it lost the range"
    );
    stop_all(vec![b]).await;
    if mode == DeliveryMode::Exclusive {
        assert_eq!(
            a_stats.completed.load(Ordering::Relaxed) + b_stats.completed.load(Ordering::Relaxed),
            MESSAGES as u64,
            "each message completed once"
        );
        ledger.assert_each_once("s");
    }
}

#[tokio::test(start_paused = true)]
async fn stream_hosts_hand_leases_over_for_balance_without_delivering_anything_twice() {
    const MESSAGES: usize = 1_500;
    let fixture = Fixture::paused(4).await;
    let config = GroupConfig::new("s")
        .with_mode(DeliveryMode::Stream)
        .with_start_from(StartFrom::Beginning);
    enqueue(&fixture, 0..MESSAGES).await;
    let ledger = Ledger::new();
    let slow = |ledger: &Arc<Ledger>| {
        ledger.handler(|_| async {
            tokio::time::sleep(Duration::from_millis(2)).await;
            Outcome::Complete
        })
    };
    let narrow = |name: &str| HostOptions {
        max_concurrency: 4,
        ..fast(name)
    };
    let a = start(&fixture, &config, narrow("a"), slow(&ledger));
    ledger.wait_until(|l| l.delivered("s") >= 100).await;
    // b joins while a holds all four ranges with work in flight: a hands ranges over.
    let b = start(&fixture, &config, narrow("b"), slow(&ledger));
    ledger.wait_until(|l| l.delivered("s") == MESSAGES).await;
    let (a_stats, b_stats) = (Arc::clone(&a.stats), Arc::clone(&b.stats));
    stop_all(vec![a, b]).await;
    ledger.assert_each_once("s");
    assert!(
        b_stats.leases_acquired.load(Ordering::Relaxed) >= 1,
        "a range was handed to b"
    );
    assert_eq!(
        a_stats.leases_lost.load(Ordering::Relaxed),
        0,
        "handed over, not stolen"
    );
}

/// A host splits a free parent from the version it read. If another host took the parent in
/// between (its view did not show the split yet) and moved the checkpoint, the split must
/// write nothing: children next to a live parent would be read a second time, from the older
/// checkpoint, by other hosts. Once the parent is free again, the split happens from its
/// newest checkpoint.
#[tokio::test(start_paused = true)]
async fn a_split_from_a_stale_read_of_the_parent_writes_nothing() {
    use cosmosq_queue::range::split_children;
    let fixture = Fixture::paused(1).await;
    let store = LeaseStore::new(fixture.queue.clone(), "g");
    let now = 1_000_000;
    let expire = 10_000;
    let read = store.reconcile(now, expire).await.unwrap().leases;
    assert_eq!(read.len(), 1);
    let stale = read[0].clone();

    let taken = store.acquire(&stale, "b", now).await.unwrap();
    let taken = store
        .checkpoint(
            &taken,
            stale.continuation.clone().unwrap_or_default(),
            now + 1,
        )
        .await
        .unwrap();
    fixture
        .emulator
        .set_partition_count("db", "q", 2)
        .await
        .unwrap();
    let physical = cosmosq_tests::physical_ranges(&fixture.queue).await;
    let children = split_children(&stale.min_epk, &stale.max_epk, &physical);
    assert_eq!(children.len(), 2);

    store.split(&stale, &children, now).await.unwrap();
    let after = store.list().await.unwrap();
    assert_eq!(
        after.iter().map(|l| l.id.as_str()).collect::<Vec<_>>(),
        vec![stale.id.as_str()],
        "only the parent, still held by b"
    );
    assert_eq!(after[0].owner.as_deref(), Some("b"));

    store.release(&taken).await.unwrap();
    let split = store.reconcile(now + 2, expire).await.unwrap().leases;
    assert_eq!(split.len(), 2, "{split:?}");
    assert!(split.iter().all(|l| l.id != stale.id && l.owner.is_none()));
    assert!(
        split.iter().all(|l| l.timestamp == now + 2),
        "the children come from the split of the released parent"
    );
}

/// The lease write path: a message that outlives `promoteAfter` gets a lock of its own (a state
/// document, renewed while the app works), so the checkpoint passes it and nothing waits on
/// it; it then settles through that document.
#[tokio::test(start_paused = true)]
async fn a_slow_message_gets_a_lock_of_its_own_and_the_checkpoint_passes_it() {
    let fixture = Fixture::paused(1).await;
    let config = GroupConfig::new("g")
        .with_start_from(StartFrom::Beginning)
        .with_lock_duration(Duration::from_secs(1));
    let (host, ledger, release) = a_slow_message_then_200(&fixture, &config).await;
    let group = fixture.group(config.clone());
    eventually(
        "the slow message has a lock of its own, renewed",
        Duration::from_secs(5),
        || async {
            let state = group.read_state(&"k".into(), "slow").await.unwrap();
            state.is_some_and(|s| {
                s.state == MessageState::Locked
                    && s.owner.as_deref().map(pod) == Some("h")
                    && s.attempts == 1
            })
        },
    )
    .await;
    eventually(
        "the range flowed past it and the checkpoint passed everything",
        Duration::from_secs(5),
        || async {
            let lease = the_lease(&fixture).await;
            host.stats.completed.load(Ordering::Relaxed) == 200
                && read_ids_from(&fixture, &lease).await.is_empty()
                && lease.window.pending.is_empty()
        },
    )
    .await;
    the_slow_lock_is_renewed(&group).await;
    release.notify_waiters();
    eventually(
        "slow completes through its document",
        Duration::from_secs(5),
        || async {
            group
                .read_state(&"k".into(), "slow")
                .await
                .unwrap()
                .unwrap()
                .state
                == MessageState::Completed
        },
    )
    .await;
    host.stop.cancel();
    host.task.await.unwrap().unwrap();
    assert_eq!(host.stats.completed.load(Ordering::Relaxed), 201);
    ledger.assert_each_once("g");
}

/// The lease write path, a lease taken from a live owner (as after a pause past the expiry):
/// the delivery under way, which had no lock of its own, is cut, and the next owner delivers
/// it again as a redelivery (count 2); every message ends completed once.
#[tokio::test(start_paused = true)]
async fn a_lease_taken_mid_delivery_cuts_the_call_and_the_next_owner_redelivers_it() {
    const MESSAGES: usize = 20;
    let fixture = Fixture::paused(1).await;
    let config = GroupConfig::new("x").with_start_from(StartFrom::Beginning);
    enqueue(&fixture, 0..MESSAGES).await;
    let cut = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    struct Cut(Arc<std::sync::atomic::AtomicUsize>);
    impl Drop for Cut {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let a_got = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let a = start(
        &fixture,
        &config,
        HostOptions {
            max_concurrency: 1,
            promote_after: Duration::from_secs(60),
            ..fast("a")
        },
        {
            let (a_got, cut) = (Arc::clone(&a_got), Arc::clone(&cut));
            move |d: Delivery| {
                a_got.lock().unwrap().push(d.message.id.clone());
                let guard = Cut(Arc::clone(&cut));
                async move {
                    let _guard = guard;
                    std::future::pending::<Outcome>().await
                }
            }
        },
    );
    eventually(
        "a is working on its first message",
        Duration::from_secs(5),
        || async { a_got.lock().unwrap().len() == 1 },
    )
    .await;
    let store = LeaseStore::new(fixture.queue.clone(), "x");
    let lease = store.list().await.unwrap().remove(0);
    store
        .acquire(&lease, "thief", fixture.queue.clock().now_ms())
        .await
        .unwrap();
    eventually("a's call is cut", Duration::from_secs(5), || async {
        cut.load(Ordering::SeqCst) == 1
    })
    .await;
    let in_flight = a_got.lock().unwrap()[0].clone();
    a.stop.cancel();
    stop_all(vec![a]).await;
    let ledger = Ledger::new();
    let b = start(&fixture, &config, fast("b"), ledger.completing());
    ledger.wait_until(|l| l.delivered("x") == MESSAGES).await;
    eventually(
        "b's completions are written",
        Duration::from_secs(5),
        || async { b.stats.completed.load(Ordering::Relaxed) == MESSAGES as u64 },
    )
    .await;
    let i: usize = in_flight[1..].parse().unwrap();
    let state = fixture
        .group(config.clone())
        .read_state(&format!("k{}", i % 97).into(), &in_flight)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (state.state, state.attempts),
        (MessageState::Completed, 2),
        "{in_flight} was redelivered as its second attempt"
    );
    stop_all(vec![b]).await;
    ledger.assert_each_once("x");
}

/// A graceful stop whose release races a hand-over request (another host asking for the
/// lease while this one drains) still releases: the request changed the lease's ETag, not
/// its owner, so nothing is left in the stopped host's name until it expires.
#[tokio::test(start_paused = true)]
async fn a_release_that_races_a_hand_over_request_still_releases() {
    let fixture = Fixture::paused(4).await;
    let config = GroupConfig::new("g");
    let mut options = fast("a");
    options.lease_expire = Duration::from_secs(3600);
    let ledger = Ledger::new();
    let a = start(&fixture, &config, options, ledger.completing());
    eventually("a holds all leases", Duration::from_secs(5), || async {
        owners(&fixture, "g")
            .await
            .iter()
            .all(|o| o.as_deref() == Some("a"))
    })
    .await;
    // Another host keeps asking for every lease while a stops.
    let store = LeaseStore::new(fixture.queue.clone(), "g");
    let asking = CancellationToken::new();
    let asker = {
        let (store, asking) = (store.clone(), asking.clone());
        tokio::spawn(async move {
            let mut asks = 0u32;
            while !asking.is_cancelled() {
                for lease in store.list().await.unwrap() {
                    if lease.owner.as_deref().map(pod) == Some("a")
                        && store
                            .request_handover(&lease, "b", lease.timestamp)
                            .await
                            .is_ok()
                    {
                        asks += 1;
                    }
                }
                // A round every few milliseconds: on paused time the clock moves only while
                // every task waits, and a loop that never waits would hold it still.
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            asks
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    a.stop.cancel();
    a.task.await.unwrap().unwrap();
    asking.cancel();
    assert!(asker.await.unwrap() > 0, "the requests were written");
    assert_eq!(
        owners(&fixture, "g").await,
        vec![None; 4],
        "every lease released, none left to expire"
    );
}

/// A host whose range stopped because its lease writes failed takes the lease back at its next
/// acquire round. A hand-over asked of it meanwhile still stands then: the new range hands the
/// lease over at once (it was kept until the host stopped, the request wiped by the take-back).
#[tokio::test(start_paused = true)]
async fn a_lease_its_owner_takes_back_is_still_handed_over_to_the_host_that_asked() {
    let fixture = Fixture::paused(1).await;
    let config = GroupConfig::new("g");
    // Host a's own client, cut off from Cosmos DB while the rule is on.
    let cut = Arc::new(
        FaultInjectionRuleBuilder::new(
            "cut",
            FaultInjectionResultBuilder::new()
                .with_error(FaultInjectionErrorType::ConnectionError)
                .with_probability(1.0)
                .build(),
        )
        .build(),
    );
    cut.disable();
    let client = fixture
        .emulator
        .client_with_faults(vec![Arc::clone(&cut)])
        .await
        .unwrap();
    let queue = Queue::open_with_clock(
        &client,
        QueueConfig::new("db", "q"),
        fixture.queue.clock().clone(),
    )
    .await
    .unwrap();
    let ledger = Ledger::new();
    let host = Host::new(queue.group(config).unwrap(), ledger.completing(), fast("a"));
    let stats = host.stats();
    let stop = CancellationToken::new();
    let task = tokio::spawn(host.run(stop.clone()));
    eventually("a holds the lease", Duration::from_secs(5), || async {
        owners(&fixture, "g").await == vec![Some("a".to_owned())]
    })
    .await;
    // a's lease writes fail: its range stops at the lease's deadline.
    cut.enable();
    eventually("a's range stopped", Duration::from_secs(5), || async {
        stats.leases_lost.load(Ordering::Relaxed) == 1
    })
    .await;
    // Another host asks a for the lease; then a reaches Cosmos DB again.
    let store = LeaseStore::new(fixture.queue.clone(), "g");
    let lease = the_lease(&fixture).await;
    store
        .request_handover(&lease, "b#1", fixture.queue.clock().now_ms())
        .await
        .unwrap();
    cut.disable();
    eventually(
        "a takes the lease back and hands it over to b",
        Duration::from_secs(10),
        || async {
            let lease = the_lease(&fixture).await;
            lease.owner.is_none() && lease.handover_to.as_deref() == Some("b#1")
        },
    )
    .await;
    assert_eq!(
        stats.leases_acquired.load(Ordering::Relaxed),
        2,
        "taken, then taken back"
    );
    stop.cancel();
    task.await.unwrap().unwrap();
}

/// A transactional batch is one write, one LSN: a range handed over inside one resumes inside
/// it, and the next owner's check of where its predecessor stopped must not take the rest of
/// the batch (same LSN as the last document recorded) for documents read before.
#[tokio::test(start_paused = true)]
async fn a_range_handed_over_inside_a_batch_delivers_the_rest_of_it_once() {
    const MESSAGES: usize = 60;
    let fixture = Fixture::paused(1).await;
    let batch = (0..MESSAGES)
        .map(|i| {
            NewMessage::json(json!(i))
                .with_id(format!("m{i:02}"))
                .with_partition_key("one-key")
        })
        .collect();
    fixture.enqueue_all(batch).await;
    let config = GroupConfig::new("g").with_start_from(StartFrom::Beginning);
    let ledger = Ledger::new();
    let small = |name: &str| HostOptions {
        page_size: 5,
        max_in_flight_per_range: 5,
        ..fast(name)
    };
    // a stops after 20 deliveries, its last ones held until it is told to stop.
    let release = CancellationToken::new();
    let record = ledger.completing();
    let held = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let a = start(&fixture, &config, small("a"), {
        let (release, held) = (release.clone(), Arc::clone(&held));
        move |d: Delivery| {
            let n = held.fetch_add(1, Ordering::SeqCst);
            let (release, done) = (release.clone(), record(d));
            async move {
                if n >= 20 {
                    release.cancelled().await;
                }
                done.await
            }
        }
    });
    eventually("a holds deliveries", Duration::from_secs(30), || async {
        held.load(Ordering::SeqCst) > 20
    })
    .await;
    a.stop.cancel();
    release.cancel();
    let a_completed = stop_all(vec![a]).await;
    assert!(
        (20..MESSAGES as u64).contains(&a_completed),
        "a stopped inside the batch: {a_completed}"
    );
    let b = start(&fixture, &config, small("b"), ledger.completing());
    tokio::time::timeout(
        Duration::from_secs(60),
        ledger.wait_until(|l| l.delivered("g") == MESSAGES),
    )
    .await
    .expect("b delivers the rest of the batch");
    assert_eq!(
        a_completed + stop_all(vec![b]).await,
        MESSAGES as u64,
        "no message completed twice"
    );
    ledger.assert_each_once("g");
}

/// A range whose messages wait for a permit does not poll its feed: what it would read starts
/// after them (unordered groups take permits in feed order), so each poll is a request unit
/// for nothing. Once they have their permits, it reads again and delivers what came meanwhile.
#[tokio::test(start_paused = true)]
async fn a_range_whose_messages_wait_for_permits_does_not_poll_its_feed() {
    for (what, config) in [
        ("exclusive", GroupConfig::new("x")),
        (
            "exclusive (claims)",
            GroupConfig::new("c").with_exclusive_writes(cosmosq_queue::ExclusiveWrites::Claims),
        ),
        (
            "stream",
            GroupConfig::new("s").with_mode(cosmosq_queue::DeliveryMode::Stream),
        ),
    ] {
        let fixture = Fixture::paused(1).await;
        enqueue(&fixture, 0..20).await;
        let config = config.with_start_from(StartFrom::Beginning);
        // One permit, held by the first delivery until the gate opens.
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let (arrived_tx, mut arrived) = tokio::sync::mpsc::unbounded_channel();
        let handler = {
            let gate = Arc::clone(&gate);
            move |d: Delivery| {
                let (gate, arrived) = (Arc::clone(&gate), arrived_tx.clone());
                async move {
                    let _ = arrived.send(d.message.id.clone());
                    gate.acquire().await.expect("open").forget();
                    Outcome::Complete
                }
            }
        };
        let options = HostOptions {
            max_concurrency: 1,
            min_poll: Duration::from_millis(20),
            max_poll: Duration::from_secs(1),
            ..fast("host")
        };
        let host = start(&fixture, &config, options, handler);
        let first = arrived.recv().await.expect("a first delivery");
        let before = fixture.queue.charges().snapshot();
        tokio::time::sleep(Duration::from_secs(10)).await;
        let spent = fixture.queue.charges().snapshot().since(&before);
        let reads = spent.calls("read change feed");
        assert!(
            reads <= 1,
            "{what}: the range read its feed {reads} times in 10 s while 19 messages waited for the one permit"
        );
        // A message written meanwhile is read once they have their permits, and delivered.
        enqueue(&fixture, 20..21).await;
        gate.add_permits(1_000);
        let mut seen = std::collections::BTreeSet::from([first]);
        while seen.len() < 21 {
            seen.insert(arrived.recv().await.expect("deliveries"));
        }
        host.stop.cancel();
        host.task.await.unwrap().unwrap();
        assert_eq!(ConsumerStats::get(&host.stats.completed), 21, "{what}");
    }
}
