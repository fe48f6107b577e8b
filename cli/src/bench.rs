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
    provision, ClaimOutcome, Delivery, DeliveryMode, GroupConfig, Message, NewMessage, Outcome,
    Queue, QueueConfig, StartFrom,
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
}

struct Row {
    what: String,
    messages: usize,
    seconds: f64,
    request_units: f64,
    groups: usize,
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
    });

    // Consumers end to end: change feed + state machine, per mode and group count.
    // Eight groups on fewer messages keep the run short; figures are per message per group.
    let few = args.messages.min(2_000);
    for (mode, groups, count) in [
        (DeliveryMode::Exclusive, 1, args.messages),
        (DeliveryMode::Stream, 1, args.messages),
        (DeliveryMode::Exclusive, 2, args.messages),
        (DeliveryMode::Stream, 2, args.messages),
        (DeliveryMode::Exclusive, 8, few),
        (DeliveryMode::Stream, 8, few),
    ] {
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
        let started = Instant::now();
        for g in 0..groups {
            let queue = Queue::open(&client, config.clone()).await?;
            let group = queue.group(
                GroupConfig::new(format!("g{g}"))
                    .with_mode(mode)
                    .with_start_from(StartFrom::Beginning),
            )?;
            let options = HostOptions {
                max_concurrency: args.concurrency,
                page_size: 500,
                min_poll: Duration::from_millis(5),
                max_poll: Duration::from_millis(50),
                lease_acquire: Duration::from_millis(100),
                ..HostOptions::new(format!("host-{g}"))
            };
            let consumer = Host::new(group, |_d: Delivery| async { Outcome::Complete }, options);
            stats.push(consumer.stats());
            let token = shutdown.clone();
            tasks.push(tokio::spawn(async move { consumer.run(token).await }));
            queues.push(queue);
        }
        let target = (count * groups) as u64;
        while stats
            .iter()
            .map(|s| s.completed.load(Ordering::Relaxed))
            .sum::<u64>()
            < target
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let seconds = started.elapsed().as_secs_f64();
        shutdown.cancel();
        for t in tasks {
            t.await??;
        }
        let request_units: f64 = queues
            .iter()
            .map(|q| q.charges().snapshot().total_request_units())
            .sum();
        rows.push(Row {
            what: format!(
                "lease loop, no-op handler, {}, {groups} group{}",
                format!("{mode:?}").to_lowercase(),
                if groups > 1 { "s" } else { "" }
            ),
            messages: count,
            seconds,
            request_units,
            groups,
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
        });
    }

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
    Ok(())
}
