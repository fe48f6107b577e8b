//! `cosmosq bench`: request units and throughput of the engine, on the embedded emulator.
//!
//! Every figure comes from one run in one process, so machine noise cancels in comparisons.
//! Request units are the emulator's `x-ms-request-charge` summed over every attempt.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use cosmosq_emulator::{Emulator, EmulatorOptions};
use cosmosq_queue::host::{Host, HostOptions};
use cosmosq_queue::{
    provision, ClaimOutcome, Delivery, DeliveryMode, ExclusiveWrites, GroupConfig, Message,
    NewMessage, OperationCharge, Outcome, Queue, QueueConfig, RetryPolicy, StartFrom,
};
use futures::{stream, StreamExt};
use tokio_util::sync::CancellationToken;

use crate::output::table;

#[derive(Args, Clone, Debug)]
pub struct BenchArgs {
    /// Messages per measurement.
    #[arg(long, default_value_t = 5000)]
    pub messages: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    #[arg(long, default_value_t = 4)]
    pub partitions: u32,
    /// Bytes of padding in each message body (request units grow with document size).
    #[arg(long, default_value_t = 1000)]
    pub body_bytes: usize,
    /// Seconds of the steady-rate latency run (100 messages a second).
    #[arg(long, default_value_t = 10)]
    pub latency_seconds: u64,
    /// Seconds an idle group is watched for its request units (production timings).
    #[arg(long, default_value_t = 40)]
    pub idle_seconds: u64,
    /// Also print each consumer row's request units by operation (where a message's cost goes).
    #[arg(long)]
    pub by_operation: bool,
}

struct Row {
    what: String,
    messages: usize,
    seconds: f64,
    request_units: f64,
    groups: usize,
    /// Request units by operation, for `--by-operation` (consumer rows only).
    spent: Vec<(&'static str, OperationCharge)>,
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let emulator = Emulator::in_process(EmulatorOptions {
        partitions: args.partitions,
        ..Default::default()
    })?;
    let client = emulator.client().await?;
    let mut rows = Vec::new();
    let mut n = 0;
    let mut fresh = || {
        n += 1;
        QueueConfig::new("bench", format!("q{n}"))
    };
    let open = |config: QueueConfig| {
        let client = client.clone();
        let emulator = Arc::clone(&emulator);
        async move {
            provision(&client, &config).await?;
            emulator
                .apply_partition_count(&config.database, &config.container)
                .await?;
            anyhow::Ok(Queue::open(&client, config).await?)
        }
    };
    let padding = "x".repeat(args.body_bytes);
    let messages = |count: usize| -> Vec<NewMessage> {
        (0..count)
            .map(|i| {
                NewMessage::json(crate::seed::body(i, &padding))
                    .with_partition_key(format!("k{}", i % 64))
            })
            .collect()
    };

    // Enqueue, one request per message.
    let queue = open(fresh()).await?;
    let started = Instant::now();
    let results: Vec<_> = stream::iter(messages(args.messages))
        .map(|m| {
            let q = queue.clone();
            async move { q.enqueue(m).await }
        })
        .buffer_unordered(args.concurrency)
        .collect()
        .await;
    results.into_iter().collect::<Result<Vec<_>, _>>()?;
    rows.push(Row {
        what: "enqueue, single".into(),
        messages: args.messages,
        seconds: started.elapsed().as_secs_f64(),
        request_units: queue.charges().snapshot().total_request_units(),
        groups: 1,
        spent: Vec::new(),
    });

    // Enqueue in transactional batches per partition key.
    let queue = open(fresh()).await?;
    let started = Instant::now();
    let chunks: Vec<Vec<NewMessage>> = messages(args.messages)
        .chunks(1000)
        .map(<[NewMessage]>::to_vec)
        .collect();
    for chunk in chunks {
        for r in queue.enqueue_batch(chunk).await {
            r?;
        }
    }
    rows.push(Row {
        what: "enqueue, batched by key".into(),
        messages: args.messages,
        seconds: started.elapsed().as_secs_f64(),
        request_units: queue.charges().snapshot().total_request_units(),
        groups: 1,
        spent: Vec::new(),
    });

    // Claim + complete, the exclusive-mode state machine alone.
    let stored: Vec<Message> = messages(args.messages)
        .into_iter()
        .map(|m| m.into_message(cosmosq_queue::clock::system_now_ms()))
        .collect::<Result<_, _>>()?;
    let group = queue.group(GroupConfig::new("bench"))?;
    let before = queue.charges().snapshot();
    let started = Instant::now();
    let claims: Vec<_> = stream::iter(stored)
        .map(|m| {
            let g = group.clone();
            async move {
                match g.claim(&m, "bench").await? {
                    ClaimOutcome::Claimed(c) => g.complete(&c).await,
                    other => Err(cosmosq_queue::QueueError::Config(format!(
                        "unexpected {other:?}"
                    ))),
                }
            }
        })
        .buffer_unordered(args.concurrency)
        .collect()
        .await;
    claims.into_iter().collect::<Result<Vec<_>, _>>()?;
    rows.push(Row {
        what: "SDK floor: claim + complete, tight loop".into(),
        messages: args.messages,
        seconds: started.elapsed().as_secs_f64(),
        request_units: queue
            .charges()
            .snapshot()
            .since(&before)
            .total_request_units(),
        groups: 1,
        spent: Vec::new(),
    });

    // Consumers end to end: change feed + state machine, per mode and group count. Rows
    // compared per message per group read the same count; the claims path's eight groups (two
    // writes per message per group) read fewer to keep the run short.
    //
    // Eight groups sharing this process's cores deliver each at a fraction of one group's rate,
    // and a range's time-driven requests (its window written every `checkpointInterval` while
    // messages start, polls, sweeps, listings) are then spread over fewer messages. The paced
    // rows run one group at the rate each of the eight had (its handler holds each message
    // `concurrency / rate`), so that the cost of more groups is told from the cost of a lower
    // rate.
    let few = args.messages.min(2_000);
    use ExclusiveWrites::{Claims, Lease};
    // (mode, write path, groups, messages, 1 in 20 retried once, paced like the row before)
    #[rustfmt::skip]
    let consumer_rows = [
        (DeliveryMode::Exclusive, Lease, 1, args.messages, false, false),
        (DeliveryMode::Exclusive, Lease, 1, args.messages, true, false),
        (DeliveryMode::Exclusive, Claims, 1, args.messages, false, false),
        (DeliveryMode::Stream, Lease, 1, args.messages, false, false),
        (DeliveryMode::Exclusive, Lease, 2, args.messages, false, false),
        (DeliveryMode::Stream, Lease, 2, args.messages, false, false),
        (DeliveryMode::Exclusive, Lease, 8, args.messages, false, false),
        (DeliveryMode::Exclusive, Lease, 1, args.messages, false, true),
        (DeliveryMode::Exclusive, Claims, 8, few, false, false),
        (DeliveryMode::Stream, Lease, 8, args.messages, false, false),
        (DeliveryMode::Stream, Lease, 1, args.messages, false, true),
    ];
    // The last 8-group row: its path and the rate of each of its groups.
    let mut eight: Option<(DeliveryMode, ExclusiveWrites, f64)> = None;
    for (mode, writes, groups, count, retried, paced) in consumer_rows {
        let pace = match paced {
            true => match eight {
                Some((m, w, per_group)) if (m, w) == (mode, writes) && per_group > 0.0 => Some((
                    Duration::from_secs_f64(args.concurrency as f64 / per_group),
                    per_group,
                )),
                _ => anyhow::bail!("a paced row follows an 8-group row of its path that delivered"),
            },
            false => None,
        };
        let hold = pace.map(|(hold, _)| hold);
        let config = fresh();
        let producer = open(config.clone()).await?;
        for chunk in messages(count).chunks(1000) {
            for r in producer.enqueue_batch(chunk.to_vec()).await {
                r?;
            }
        }
        let shutdown = CancellationToken::new();
        let mut stats = Vec::new();
        let mut tasks = Vec::new();
        let mut queues = Vec::new();
        // Successes the handlers returned, over every group: the clock stops at the last one.
        // The lease write path records completions with the next page's write or the flush
        // (1 s); waiting for that tick would make a one-second run's figure the flush
        // interval's. The hosts are then stopped, their drain records the rest, and every
        // completion must have been recorded.
        let handled = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let started = Instant::now();
        for g in 0..groups {
            let queue = Queue::open(&client, config.clone()).await?;
            let group = queue.group(
                GroupConfig::new(format!("g{g}"))
                    .with_mode(mode)
                    .with_exclusive_writes(writes)
                    .with_start_from(StartFrom::Beginning)
                    .with_retry(RetryPolicy {
                        initial_backoff: Duration::from_millis(20),
                        max_backoff: Duration::from_millis(100),
                        ..RetryPolicy::default()
                    }),
            )?;
            let options = HostOptions {
                max_concurrency: args.concurrency,
                page_size: 500,
                min_poll: Duration::from_millis(5),
                max_poll: Duration::from_millis(50),
                lease_acquire: Duration::from_millis(100),
                sweep_interval: Duration::from_millis(100),
                ..HostOptions::new(format!("host-{g}"))
            };
            // One message in twenty fails its first delivery (the bodies number them).
            let handled = Arc::clone(&handled);
            let handler = move |d: Delivery| {
                let handled = Arc::clone(&handled);
                async move {
                    let i = match &d.message.body {
                        cosmosq_queue::Body::Json(body) => body["order"].as_u64(),
                        cosmosq_queue::Body::Bytes(_) => None,
                    };
                    if retried && d.delivery_count == 1 && i.is_some_and(|i| i % 20 == 0) {
                        Outcome::Retry {
                            reason: "bench: every twentieth message fails once".into(),
                            delay: None,
                        }
                    } else {
                        if let Some(hold) = hold {
                            tokio::time::sleep(hold).await;
                        }
                        handled.fetch_add(1, Ordering::Relaxed);
                        Outcome::Complete
                    }
                }
            };
            let consumer = Host::new(group, handler, options);
            stats.push(consumer.stats());
            let token = shutdown.clone();
            tasks.push(tokio::spawn(async move { consumer.run(token).await }));
            queues.push(queue);
        }
        let target = (count * groups) as u64;
        while handled.load(Ordering::Relaxed) < target {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let seconds = started.elapsed().as_secs_f64();
        shutdown.cancel();
        for t in tasks {
            t.await??;
        }
        let completed: u64 = stats
            .iter()
            .map(|s| s.completed.load(Ordering::Relaxed))
            .sum();
        anyhow::ensure!(
            completed == target,
            "{completed} completions recorded for {target} messages"
        );
        let request_units: f64 = queues
            .iter()
            .map(|q| q.charges().snapshot().total_request_units())
            .sum();
        let mut spent = std::collections::BTreeMap::<&'static str, OperationCharge>::new();
        for q in &queues {
            for (op, c) in q.charges().snapshot().by_operation {
                let e = spent.entry(op).or_default();
                e.calls += c.calls;
                e.request_units += c.request_units;
            }
        }
        let spent = spent.into_iter().collect();
        let path = match (mode, writes) {
            (DeliveryMode::Stream, _) => "stream".to_owned(),
            (_, Lease) => "exclusive (lease writes)".to_owned(),
            (_, Claims) => "exclusive (claims)".to_owned(),
        };
        if groups == 8 {
            eight = Some((mode, writes, count as f64 / seconds));
        }
        rows.push(Row {
            what: format!(
                "lease loop, {}, {path}, {groups} group{}{}",
                match pace {
                    Some((hold, _)) =>
                        format!("handler holding each {:.1} ms", hold.as_secs_f64() * 1000.0),
                    None => "no-op handler".to_owned(),
                },
                if groups > 1 { "s" } else { "" },
                match (retried, pace) {
                    (true, _) => ", 1 in 20 retried once".to_owned(),
                    (_, Some((_, rate))) => format!(", paced like one of 8 ({rate:.0} msg/s)"),
                    _ => String::new(),
                }
            ),
            messages: count,
            seconds,
            request_units,
            groups,
            spent,
        });
    }

    // The seed design on the same emulator: status flips on the message, every consumer
    // reading the whole feed.
    for groups in [1, 2, 8] {
        let queue = open(fresh()).await?;
        crate::seed::enqueue(queue.messages(), few, groups, &padding).await?;
        let run = crate::seed::consume(queue.messages(), few, groups).await?;
        rows.push(Row {
            what: format!(
                "seed design (status flips), {groups} group{}",
                if groups > 1 { "s" } else { "" }
            ),
            messages: few,
            seconds: run.seconds,
            request_units: run.request_units,
            groups,
            spent: Vec::new(),
        });
    }

    let latency = latency_run(&client, &open, fresh(), args.latency_seconds).await?;
    // Idle leases, side by side: renewed one by one and each range polling its feed (the
    // change feed processor's way, and cosmosq's before the host heartbeat and the probe),
    // kept by one heartbeat per host, and with idle ranges resting on their partition's probe;
    // with one lease per partition and with four (a host holding more leases); at the default
    // maxPoll (5 s) and at 2 s (a first delivery within 2 s).
    let mut idles = Vec::new();
    let default_poll = HostOptions::new("").max_poll;
    for (per_partition, host_heartbeat, probe, max_poll) in [
        (1, false, false, default_poll),
        (1, true, true, default_poll),
        (4, false, false, default_poll),
        (4, true, false, default_poll),
        (4, true, true, default_poll),
        (4, true, true, Duration::from_secs(2)),
    ] {
        let how = IdleHow {
            host_heartbeat,
            per_partition,
            probe,
            max_poll,
        };
        idles.push(idle_run(&client, &open, fresh(), args.idle_seconds, how).await?);
    }
    let estimate = estimate_run(&open, fresh(), args.messages).await?;
    let window = lease_write_run(&open, fresh()).await?;

    let rendered: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.what.clone(),
                r.messages.to_string(),
                format!("{:.0}", (r.messages * r.groups) as f64 / r.seconds),
                format!("{:.3}", r.request_units / (r.messages * r.groups) as f64),
            ]
        })
        .collect();
    println!(
        "cosmosq bench: {} messages of ~{} bytes, concurrency {}, {} partitions, in-memory emulator, one process\n",
        args.messages, args.body_bytes, args.concurrency, args.partitions
    );
    print!(
        "{}",
        table(
            &[
                "MEASUREMENT",
                "MESSAGES",
                "MSG/S (PER GROUP SUMMED)",
                "RU/MSG/GROUP"
            ],
            &rendered
        )
    );
    if args.by_operation {
        for r in rows.iter().filter(|r| !r.spent.is_empty()) {
            println!(
                "\n{}: request units per message per group, by operation",
                r.what
            );
            let per = (r.messages * r.groups) as f64;
            for (operation, charge) in &r.spent {
                println!(
                    "  {operation}: {:.3} ({} calls, {:.1} RU each)",
                    charge.request_units / per,
                    charge.calls,
                    charge.request_units / charge.calls.max(1) as f64
                );
            }
        }
    }
    println!(
        "\nenqueue -> delivery at 100 msg/s for {} s after a 1 s warm-up, exclusive (lease writes), production timings: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms ({} messages, {:.3} RU/msg)",
        args.latency_seconds, latency.p50, latency.p99, latency.max, latency.messages, latency.request_units_per_message
    );
    for idle in &idles {
        println!(
            "idle, production timings, exclusive (lease writes), {}, {}, maxPoll {} s, {} leases on one host over {} s: {:.3} RU/s per lease; first delivery after the idle spell {:.0} ms",
            match idle.how.host_heartbeat {
                true => "one heartbeat per host",
                false => "each lease renewed",
            },
            match idle.how.probe {
                true => "idle ranges on their partition's probe",
                false => "each range polling",
            },
            idle.how.max_poll.as_secs_f64(),
            idle.leases, args.idle_seconds, idle.request_units_per_second_per_lease, idle.first_delivery_ms
        );
        for (operation, charge) in &idle.spent.by_operation {
            println!(
                "  {operation}: {:.3} RU/s per lease ({} calls)",
                charge.request_units / args.idle_seconds as f64 / idle.leases.max(1) as f64,
                charge.calls
            );
        }
    }
    println!(
        "estimate of one group ({} ranges), as the operator makes it each round: {:.1} RU with nothing unread, {:.1} RU with {} messages unread",
        estimate.ranges, estimate.empty, estimate.loaded, args.messages
    );
    println!(
        "lease write (exclusive, lease writes): {:.2} RU with an empty window, {:.2} RU with a full one ({} messages listed, {} bytes)",
        window.empty, window.full, window.listed, window.bytes
    );
    Ok(())
}

struct LeaseWriteCost {
    empty: f64,
    full: f64,
    listed: usize,
    bytes: usize,
}

/// What one lease write costs with an empty window and with the largest the engine writes
/// (4 × `maxInFlightPerRange` identities, while a slow message holds the checkpoint): each
/// write replaces the whole lease.
async fn lease_write_run<F, Fut>(open: &F, config: QueueConfig) -> anyhow::Result<LeaseWriteCost>
where
    F: Fn(QueueConfig) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Queue>>,
{
    use cosmosq_queue::lease::{LeaseStore, Window, WINDOW_IDENTITIES};
    let queue = open(config).await?;
    let store = LeaseStore::new(queue.clone(), "window").with_writes(ExclusiveWrites::Lease);
    let now = queue.clock().now_ms();
    let lease = store
        .reconcile(now, 60_000)
        .await?
        .leases
        .into_iter()
        .next()
        .ok_or_else(|| anyhow::anyhow!("no lease"))?;
    let lease = store
        .acquire(&lease, "bench", now)
        .await
        .map_err(|e| anyhow::anyhow!("acquire: {e:?}"))?;
    let listed = 4 * HostOptions::new("bench").max_in_flight_per_range;
    let key = cosmosq_queue::MessageKey::from_json(serde_json::json!("tenant-a"))?;
    let full = Window {
        v: WINDOW_IDENTITIES,
        done: (0..listed)
            .map(|i| cosmosq_queue::identity::fingerprint(&format!("m{i}"), &key))
            .collect(),
        ..Window::default()
    };
    let bytes = serde_json::to_vec(&full)?.len();
    let cost = |window: Window, lease: cosmosq_queue::lease::Lease| {
        let (store, queue) = (&store, &queue);
        async move {
            let before = queue.charges().snapshot();
            let written = store
                .record(
                    &lease,
                    lease.continuation.clone(),
                    window,
                    ExclusiveWrites::Lease,
                    None,
                    now,
                )
                .await
                .map_err(|e| anyhow::anyhow!("record: {e:?}"))?;
            anyhow::Ok((
                queue
                    .charges()
                    .snapshot()
                    .since(&before)
                    .total_request_units(),
                written,
            ))
        }
    };
    let (empty, lease) = cost(Window::default(), lease).await?;
    let (full, _) = cost(full, lease).await?;
    Ok(LeaseWriteCost {
        empty,
        full,
        listed,
        bytes,
    })
}

struct EstimateCost {
    ranges: usize,
    empty: f64,
    loaded: f64,
}

/// What one estimate of a group costs, with an empty queue and with `messages` unread: the
/// operator makes one per group per round, so it must not grow with the queue.
async fn estimate_run<F, Fut>(
    open: &F,
    config: QueueConfig,
    messages: usize,
) -> anyhow::Result<EstimateCost>
where
    F: Fn(QueueConfig) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Queue>>,
{
    let queue = open(config).await?;
    let group = queue.group(GroupConfig::new("estimate").with_start_from(StartFrom::Beginning))?;
    let now = cosmosq_queue::clock::system_now_ms();
    let expire = cosmosq_queue::clock::duration_ms(cosmosq_queue::host::DEFAULT_LEASE_EXPIRE);
    group.estimate_or_create_leases(now, expire).await?;
    let cost = || async {
        let before = queue.charges().snapshot();
        let estimate = group.estimate().await?;
        let spent = queue.charges().snapshot().since(&before);
        anyhow::Ok((estimate, spent.total_request_units()))
    };
    let (estimate, empty) = cost().await?;
    let body = serde_json::json!({"padding": "x".repeat(100)});
    let batch: Vec<NewMessage> = (0..messages)
        .map(|i| NewMessage::json(body.clone()).with_partition_key(format!("k{}", i % 64)))
        .collect();
    for chunk in batch.chunks(1000) {
        for r in queue.enqueue_batch(chunk.to_vec()).await {
            r?;
        }
    }
    let (loaded_estimate, loaded) = cost().await?;
    anyhow::ensure!(
        loaded_estimate.lag() > 0,
        "the estimate saw none of the {messages} unread messages"
    );
    Ok(EstimateCost {
        ranges: estimate.ranges.len(),
        empty,
        loaded,
    })
}

struct Latency {
    p50: f64,
    p99: f64,
    max: f64,
    messages: usize,
    request_units_per_message: f64,
}

/// A producer at 100 messages a second; the consumer notes each message's enqueue-to-delivery
/// time (one clock: one process).
async fn latency_run<F, Fut>(
    client: &cosmosq_queue::CosmosClient,
    open: &F,
    config: QueueConfig,
    seconds: u64,
) -> anyhow::Result<Latency>
where
    F: Fn(QueueConfig) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Queue>>,
{
    let producer = open(config.clone()).await?;
    let queue = Queue::open(client, config).await?;
    let group = queue.group(GroupConfig::new("latency").with_start_from(StartFrom::Beginning))?;
    let seen = Arc::new(std::sync::Mutex::new(Vec::<(usize, f64)>::new()));
    let handler = {
        let seen = Arc::clone(&seen);
        move |d: Delivery| {
            let seen = Arc::clone(&seen);
            async move {
                let now = cosmosq_queue::clock::system_now_ms();
                let i = d.message.body.to_bytes();
                let i = serde_json::from_slice::<serde_json::Value>(&i).unwrap_or_default()["i"]
                    .as_u64()
                    .unwrap_or(0) as usize;
                seen.lock()
                    .unwrap()
                    .push((i, (now - d.message.enqueued_at) as f64));
                Outcome::Complete
            }
        }
    };
    let host = Host::new(group, handler, HostOptions::new("latency-host"));
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(host.run(shutdown.clone()));
    // Leases taken before the clock starts.
    tokio::time::sleep(Duration::from_secs(1)).await;
    // The first second of traffic is a warm-up, not counted: the ranges have been idle while
    // the leases were taken, and their first message waits out the idle back-off (the idle
    // run measures that on its own).
    let warm_up = 100;
    let total = (seconds * 100) as usize + warm_up;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    for i in 0..total {
        tick.tick().await;
        producer
            .enqueue(
                NewMessage::json(serde_json::json!({"i": i})).with_partition_key(format!("k{i}")),
            )
            .await?;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while seen.lock().unwrap().len() < total && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    task.await??;
    let seen = seen.lock().unwrap().clone();
    anyhow::ensure!(
        seen.len() >= total,
        "only {} of {total} delivered",
        seen.len()
    );
    let mut times: Vec<f64> = seen
        .iter()
        .filter(|(i, _)| *i >= warm_up)
        .map(|(_, ms)| *ms)
        .collect();
    times.sort_by(f64::total_cmp);
    let at = |q: f64| times[((times.len() as f64 * q) as usize).min(times.len() - 1)];
    Ok(Latency {
        p50: at(0.50),
        p99: at(0.99),
        max: *times.last().unwrap_or(&0.0),
        messages: times.len(),
        request_units_per_message: queue.charges().snapshot().total_request_units()
            / seen.len() as f64,
    })
}

/// How the idle group keeps its leases.
#[derive(Clone, Copy)]
struct IdleHow {
    host_heartbeat: bool,
    per_partition: u32,
    /// Idle ranges rest on their partition's probe (off: each polls every `max_poll`).
    probe: bool,
    max_poll: Duration,
}

struct Idle {
    how: IdleHow,
    leases: usize,
    spent: cosmosq_queue::ChargeSnapshot,
    request_units_per_second_per_lease: f64,
    first_delivery_ms: f64,
}

/// A group with nothing to do, on the production defaults: what its leases cost while idle,
/// and how soon the first message after the idle spell is delivered.
async fn idle_run<F, Fut>(
    client: &cosmosq_queue::CosmosClient,
    open: &F,
    config: QueueConfig,
    seconds: u64,
    how: IdleHow,
) -> anyhow::Result<Idle>
where
    F: Fn(QueueConfig) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Queue>>,
{
    let producer = open(config.clone()).await?;
    let queue = Queue::open(client, config).await?;
    let group = queue.group(GroupConfig::new("idle"))?;
    let delivered = Arc::new(tokio::sync::Notify::new());
    let handler = {
        let delivered = Arc::clone(&delivered);
        move |_d: Delivery| {
            let delivered = Arc::clone(&delivered);
            async move {
                delivered.notify_one();
                Outcome::Complete
            }
        }
    };
    let defaults = HostOptions::new("idle-host");
    let options = HostOptions {
        host_heartbeat: how.host_heartbeat,
        leases_per_partition: how.per_partition,
        max_poll: how.max_poll,
        // At `max_poll`, the probe is off.
        idle_read: match how.probe {
            true => defaults.idle_read,
            false => how.max_poll,
        },
        ..defaults
    };
    let host = Host::new(group, handler, options);
    let stats = host.stats();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(host.run(shutdown.clone()));
    // Settled in (leases taken, polling backed off), then measured.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let leases = stats.leases_owned.load(Ordering::Relaxed) as usize;
    let before = queue.charges().snapshot();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let spent = queue.charges().snapshot().since(&before);
    let started = Instant::now();
    producer
        .enqueue(NewMessage::json(serde_json::json!({"i": 0})))
        .await?;
    tokio::time::timeout(Duration::from_secs(30), delivered.notified()).await?;
    let first_delivery_ms = started.elapsed().as_secs_f64() * 1000.0;
    shutdown.cancel();
    task.await??;
    Ok(Idle {
        how,
        leases,
        request_units_per_second_per_lease: spent.total_request_units()
            / seconds as f64
            / leases.max(1) as f64,
        spent,
        first_delivery_ms,
    })
}
