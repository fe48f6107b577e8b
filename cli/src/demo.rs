//! `cosmosq demo`: the whole loop on the embedded emulator, with live figures.
//!
//! A burst of orders is enqueued; a `fulfilment` group (exclusive mode, several consumers
//! racing on claims) and an `analytics` group (stream mode) consume it through the engine;
//! some deliveries fail and are retried with back-off, a few poison messages end up in the
//! dead letters. It ends when both groups have settled every message.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use cosmosq_queue::emulator::{Emulator, EmulatorOptions};
use cosmosq_queue::{
    provision, ChargeSnapshot, Consumer, ConsumerOptions, ConsumerStats, Delivery, DeliveryMode,
    GroupConfig, NewMessage, Outcome, Queue, QueueConfig, RetryPolicy, StartFrom,
};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::output::table;

#[derive(Args, Clone, Debug)]
pub struct DemoArgs {
    /// Messages in the burst.
    #[arg(long, default_value_t = 2000)]
    pub messages: usize,
    /// Consumers in the exclusive-mode group.
    #[arg(long, default_value_t = 4)]
    pub consumers: usize,
    /// Physical partitions of the queue.
    #[arg(long, default_value_t = 4)]
    pub partitions: u32,
    /// Share of first deliveries the sample app fails (retried with back-off).
    #[arg(long, default_value_t = 0.05)]
    pub failure_rate: f64,
    /// Messages the sample app always fails (they end in the dead letters).
    #[arg(long, default_value_t = 3)]
    pub poison: usize,
    /// Longest simulated work per message.
    #[arg(long, default_value = "3ms", value_parser = humantime::parse_duration)]
    pub work: Duration,
    /// No live figures, only the summary.
    #[arg(long)]
    pub quiet: bool,
}

/// One group's results.
#[derive(Debug, Clone)]
pub struct GroupSummary {
    pub name: &'static str,
    pub mode: DeliveryMode,
    pub consumers: usize,
    pub delivered: u64,
    pub completed: u64,
    pub retried: u64,
    pub dead_lettered: u64,
    pub request_units: f64,
}

#[derive(Debug, Clone)]
pub struct Summary {
    pub messages: usize,
    pub enqueue_seconds: f64,
    pub enqueue_request_units: f64,
    pub seconds: f64,
    pub groups: Vec<GroupSummary>,
    pub dead_letters_listed: usize,
}

struct RunningGroup {
    name: &'static str,
    mode: DeliveryMode,
    queue: Queue,
    stats: Vec<Arc<ConsumerStats>>,
    bar: ProgressBar,
}

impl RunningGroup {
    fn sum(&self, pick: fn(&ConsumerStats) -> &AtomicU64) -> u64 {
        self.stats
            .iter()
            .map(|s| pick(s).load(Ordering::Relaxed))
            .sum()
    }

    fn settled(&self) -> u64 {
        self.sum(|s| &s.completed) + self.sum(|s| &s.dead_lettered)
    }
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let summary = run_demo(&args).await?;
    print!("{}", render(&summary));
    Ok(())
}

pub async fn run_demo(args: &DemoArgs) -> anyhow::Result<Summary> {
    let started = Instant::now();
    let emulator = Emulator::in_process(EmulatorOptions {
        partitions: args.partitions,
        ..Default::default()
    })?;
    let client = emulator.client().await?;
    let config = QueueConfig::new("cosmosq-demo", "orders");
    provision(&client, &config).await?;
    emulator
        .apply_partition_count(&config.database, &config.container)
        .await?;
    let producer = Queue::open(&client, config.clone()).await?;

    let enqueue_started = Instant::now();
    let poison_every = args
        .messages
        .checked_div(args.poison)
        .unwrap_or(usize::MAX)
        .max(1);
    let burst: Vec<NewMessage> = (0..args.messages)
        .map(|i| {
            let poison = args.poison > 0 && i % poison_every == poison_every - 1;
            NewMessage::json(
                json!({"order": i, "sku": format!("sku-{}", i % 97), "poison": poison}),
            )
            .with_id(format!("order-{i:06}"))
            .with_partition_key(format!("customer-{}", i % 64))
        })
        .collect();
    for chunk in burst.chunks(500) {
        for result in producer.enqueue_batch(chunk.to_vec()).await {
            result?;
        }
    }
    let enqueue_seconds = enqueue_started.elapsed().as_secs_f64();
    let enqueue_request_units = producer.charges().snapshot().total_request_units();

    let retry = RetryPolicy {
        max_delivery_attempts: 4,
        initial_backoff: Duration::from_millis(100),
        max_backoff: Duration::from_secs(1),
        ..RetryPolicy::default()
    };
    let bars = MultiProgress::with_draw_target(if args.quiet {
        ProgressDrawTarget::hidden()
    } else {
        ProgressDrawTarget::stderr()
    });
    let shutdown = CancellationToken::new();
    let mut groups = Vec::new();
    let mut tasks = Vec::new();
    // Stream mode is fenced by range leases; until several hosts share ranges, one consumer.
    for (name, mode, consumers) in [
        ("fulfilment", DeliveryMode::Exclusive, args.consumers.max(1)),
        ("analytics", DeliveryMode::Stream, 1),
    ] {
        let queue = Queue::open(&client, config.clone()).await?;
        let group = queue.group(
            GroupConfig::new(name)
                .with_mode(mode)
                .with_start_from(StartFrom::Beginning)
                .with_retry(retry.clone()),
        )?;
        let bar = bars.add(
            ProgressBar::new(args.messages as u64).with_style(
                ProgressStyle::with_template("{prefix:>11} {bar:30} {pos}/{len} {msg}")
                    .expect("static template"),
            ),
        );
        bar.set_prefix(name);
        let mut stats = Vec::new();
        for host in 0..consumers {
            let options = ConsumerOptions {
                min_poll: Duration::from_millis(10),
                max_poll: Duration::from_millis(250),
                sweep_interval: Duration::from_millis(100),
                ..ConsumerOptions::new(format!("{name}-{host}"))
            };
            let consumer = Consumer::new(
                group.clone(),
                sample_app(args.work, args.failure_rate),
                options,
            );
            stats.push(consumer.stats());
            let shutdown = shutdown.clone();
            tasks.push(tokio::spawn(async move { consumer.run(shutdown).await }));
        }
        groups.push(RunningGroup {
            name,
            mode,
            queue,
            stats,
            bar,
        });
    }

    let deadline = Instant::now() + Duration::from_secs(600);
    let target = args.messages as u64;
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        tick.tick().await;
        let elapsed = enqueue_started.elapsed().as_secs_f64().max(0.001);
        for g in &groups {
            let settled = g.settled();
            g.bar.set_position(settled);
            g.bar.set_message(format!(
                "{:>6.0} msg/s  retries {}  dead letters {}  {:.1} RU/msg",
                settled as f64 / elapsed,
                g.sum(|s| &s.retried),
                g.sum(|s| &s.dead_lettered),
                per_message(&g.queue.charges().snapshot(), settled)
            ));
        }
        if groups.iter().all(|g| g.settled() >= target) {
            break;
        }
        if Instant::now() > deadline {
            shutdown.cancel();
            anyhow::bail!("the demo did not drain within 10 minutes");
        }
    }
    shutdown.cancel();
    for task in tasks {
        task.await??;
    }
    for g in &groups {
        g.bar.finish();
    }
    let seconds = enqueue_started.elapsed().as_secs_f64();
    let dead_letters_listed = groups[0]
        .queue
        .group(GroupConfig::new(groups[0].name))?
        .dead_letters(None)
        .await?
        .len();
    let _ = started;
    Ok(Summary {
        messages: args.messages,
        enqueue_seconds,
        enqueue_request_units,
        seconds,
        dead_letters_listed,
        groups: groups
            .iter()
            .map(|g| GroupSummary {
                name: g.name,
                mode: g.mode,
                consumers: g.stats.len(),
                delivered: g.sum(|s| &s.delivered),
                completed: g.sum(|s| &s.completed),
                retried: g.sum(|s| &s.retried),
                dead_lettered: g.sum(|s| &s.dead_lettered),
                request_units: g.queue.charges().snapshot().total_request_units(),
            })
            .collect(),
    })
}

fn per_message(charges: &ChargeSnapshot, messages: u64) -> f64 {
    charges.total_request_units() / messages.max(1) as f64
}

/// The sample app: a little work, some transient failures, poison messages that always fail.
fn sample_app(
    work: Duration,
    failure_rate: f64,
) -> impl Fn(Delivery) -> futures::future::BoxFuture<'static, Outcome> + Send + Sync + 'static {
    move |delivery: Delivery| {
        Box::pin(async move {
            let pause = work.mul_f64(rand::random::<f64>());
            tokio::time::sleep(pause).await;
            let poison = matches!(&delivery.message.body, cosmosq_queue::Body::Json(v) if v["poison"] == json!(true));
            if poison {
                return Outcome::Retry {
                    error: "payment service rejected the order".into(),
                    delay: None,
                };
            }
            if delivery.delivery_count == 1 && rand::random::<f64>() < failure_rate {
                return Outcome::Retry {
                    error: "inventory service timed out".into(),
                    delay: None,
                };
            }
            Outcome::Complete
        })
    }
}

pub fn render(s: &Summary) -> String {
    let rows: Vec<Vec<String>> = s
        .groups
        .iter()
        .map(|g| {
            vec![
                g.name.to_string(),
                format!("{:?}", g.mode).to_lowercase(),
                g.consumers.to_string(),
                g.delivered.to_string(),
                g.completed.to_string(),
                g.retried.to_string(),
                g.dead_lettered.to_string(),
                format!("{:.1}", g.request_units / s.messages.max(1) as f64),
            ]
        })
        .collect();
    let mut out = format!(
        "\ncosmosq demo: {} messages enqueued in {:.2}s ({:.0} msg/s, {:.2} RU/msg), all settled in {:.2}s\n\n",
        s.messages,
        s.enqueue_seconds,
        s.messages as f64 / s.enqueue_seconds.max(0.001),
        s.enqueue_request_units / s.messages.max(1) as f64,
        s.seconds
    );
    out.push_str(&table(
        &[
            "GROUP",
            "MODE",
            "CONSUMERS",
            "DELIVERIES",
            "COMPLETED",
            "RETRIED",
            "DEAD LETTERS",
            "RU/MSG",
        ],
        &rows,
    ));
    out.push_str(&format!(
        "\n{} dead letters listed for fulfilment (`cosmosq dlq list` shows them on a served emulator).\n",
        s.dead_letters_listed
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_small_burst_settles_every_message_once_per_group() {
        let args = DemoArgs {
            messages: 200,
            consumers: 3,
            partitions: 2,
            failure_rate: 0.1,
            poison: 2,
            work: Duration::from_millis(1),
            quiet: true,
        };
        let summary = run_demo(&args).await.unwrap();
        for g in &summary.groups {
            assert_eq!(g.completed + g.dead_lettered, 200, "{g:?}");
            assert_eq!(g.dead_lettered, 2, "{g:?}");
            assert!(g.retried > 0, "{g:?}");
        }
        assert_eq!(summary.dead_letters_listed, 2);
        let text = render(&summary);
        assert!(
            text.contains("fulfilment") && text.contains("analytics"),
            "{text}"
        );
    }
}
