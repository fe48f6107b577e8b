//! `cosmosq demo`: the whole loop on the embedded emulator, with live figures.
//!
//! A burst of orders is enqueued; a `fulfilment` group (exclusive mode, several consumers
//! sharing the feed ranges by leases) and an `analytics` group (stream mode) consume it;
//! some deliveries fail and are retried with back-off, a few poison messages end up in the
//! dead letters. It ends when both groups have settled every message.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use cosmosq_queue::emulator::{Emulator, EmulatorOptions};
use cosmosq_queue::host::{Host, HostOptions};
use cosmosq_queue::{
    provision, ChargeSnapshot, ConsumerStats, Delivery, DeliveryMode, GroupConfig, NewMessage,
    Outcome, Queue, QueueConfig, RetryPolicy, StartFrom,
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
    /// Deliveries made, retries and redeliveries included.
    pub deliveries: u64,
    /// Distinct messages the app completed.
    pub completed: u64,
    pub retried: u64,
    /// Dead letters the group holds (listed from the database).
    pub dead_letters: u64,
    pub request_units: f64,
}

#[derive(Debug, Clone)]
pub struct Summary {
    pub messages: usize,
    pub enqueue_seconds: f64,
    pub enqueue_request_units: f64,
    pub seconds: f64,
    pub groups: Vec<GroupSummary>,
}

struct RunningGroup {
    name: &'static str,
    mode: DeliveryMode,
    queue: Queue,
    /// The same group on the producer's handle, so estimates do not count as its cost.
    estimator: cosmosq_queue::Group,
    stats: Vec<Arc<ConsumerStats>>,
    app: Arc<AppLedger>,
    dead_letters: u64,
    bar: ProgressBar,
}

impl RunningGroup {
    fn sum(&self, pick: fn(&ConsumerStats) -> &AtomicU64) -> u64 {
        self.stats
            .iter()
            .map(|s| pick(s).load(Ordering::Relaxed))
            .sum()
    }

    /// Distinct messages done with: completed by the app, or in the dead letters.
    fn settled(&self) -> u64 {
        AppLedger::count(&self.app.completed) + self.dead_letters
    }
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let summary = run_demo(&args).await?;
    print!("{}", render(&summary));
    Ok(())
}

pub async fn run_demo(args: &DemoArgs) -> anyhow::Result<Summary> {
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
    for (name, mode) in [
        ("fulfilment", DeliveryMode::Exclusive),
        ("analytics", DeliveryMode::Stream),
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
        let app = Arc::new(AppLedger::default());
        for host in 0..args.consumers.max(1) {
            // Short lease intervals so the hosts balance within the demo's few seconds.
            let options = HostOptions {
                min_poll: Duration::from_millis(10),
                max_poll: Duration::from_millis(250),
                sweep_interval: Duration::from_millis(100),
                lease_acquire: Duration::from_millis(250),
                lease_renew: Duration::from_secs(1),
                lease_expire: Duration::from_secs(5),
                checkpoint_interval: Duration::from_millis(100),
                ..HostOptions::new(format!("{name}-{host}"))
            };
            let consumer = Host::new(
                group.clone(),
                sample_app(args.work, args.failure_rate, Arc::clone(&app)),
                options,
            );
            stats.push(consumer.stats());
            let shutdown = shutdown.clone();
            tasks.push(tokio::spawn(async move { consumer.run(shutdown).await }));
        }
        let estimator =
            producer.group(GroupConfig::new(name).with_start_from(StartFrom::Beginning))?;
        groups.push(RunningGroup {
            name,
            mode,
            queue,
            estimator,
            stats,
            app,
            dead_letters: 0,
            bar,
        });
    }

    let deadline = Instant::now() + Duration::from_secs(600);
    let target = args.messages as u64;
    let mut tick = tokio::time::interval(Duration::from_millis(400));
    loop {
        tick.tick().await;
        let elapsed = enqueue_started.elapsed().as_secs_f64().max(0.001);
        for g in groups.iter_mut() {
            if let Ok(dead) = g.estimator.dead_letters(None).await {
                g.dead_letters = dead.len() as u64;
            }
            let settled = g.settled();
            // The estimator is what the operator scales on: remaining work per range.
            let backlog = match g.estimator.estimate().await {
                Ok(e) => format!(
                    "backlog {:>5} [{}]",
                    e.backlog(),
                    e.ranges
                        .iter()
                        .map(|r| r.backlog.to_string())
                        .collect::<Vec<_>>()
                        .join(" ")
                ),
                Err(e) => format!("backlog unknown ({e})"),
            };
            g.bar.set_position(settled);
            g.bar.set_message(format!(
                "{:>6.0} msg/s  {backlog}  retries {}  dead {}  {:.1} RU/msg",
                settled as f64 / elapsed,
                g.sum(|s| &s.retried),
                g.dead_letters,
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
    Ok(Summary {
        messages: args.messages,
        enqueue_seconds,
        enqueue_request_units,
        seconds,
        groups: groups
            .iter()
            .map(|g| GroupSummary {
                name: g.name,
                mode: g.mode,
                consumers: g.stats.len(),
                deliveries: g.sum(|s| &s.delivered),
                completed: AppLedger::count(&g.app.completed),
                retried: g.sum(|s| &s.retried),
                dead_letters: g.dead_letters,
                request_units: g.queue.charges().snapshot().total_request_units(),
            })
            .collect(),
    })
}

fn per_message(charges: &ChargeSnapshot, messages: u64) -> f64 {
    charges.total_request_units() / messages.max(1) as f64
}

/// The sample app: a little work, some transient failures, poison messages that always fail.
/// What the sample app saw: every message it got, and those it completed.
#[derive(Default)]
struct AppLedger {
    delivered: Mutex<HashSet<String>>,
    completed: Mutex<HashSet<String>>,
}

impl AppLedger {
    fn count(set: &Mutex<HashSet<String>>) -> u64 {
        set.lock().unwrap_or_else(|p| p.into_inner()).len() as u64
    }
}

/// The sample app: a little work, some transient failures, poison messages that always fail.
fn sample_app(
    work: Duration,
    failure_rate: f64,
    ledger: Arc<AppLedger>,
) -> impl Fn(Delivery) -> futures::future::BoxFuture<'static, Outcome> + Send + Sync + 'static {
    move |delivery: Delivery| {
        let ledger = Arc::clone(&ledger);
        Box::pin(async move {
            let id = delivery.message.id.clone();
            ledger
                .delivered
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(id.clone());
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
            ledger
                .completed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(id);
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
                g.deliveries.to_string(),
                g.completed.to_string(),
                g.retried.to_string(),
                g.dead_letters.to_string(),
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
    out.push_str(
        "\nCOMPLETED counts distinct messages; DELIVERIES also counts retries and, in stream mode,\n\
         redeliveries after a lease moved (at-least-once). Dead letters: `cosmosq dlq list`.\n",
    );
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
            assert_eq!(g.completed + g.dead_letters, 200, "{g:?}");
            assert_eq!(g.dead_letters, 2, "the poison messages: {g:?}");
            assert!(g.retried > 0, "{g:?}");
        }
        let exclusive = &summary.groups[0];
        assert_eq!(exclusive.mode, DeliveryMode::Exclusive);
        assert_eq!(
            exclusive.deliveries,
            exclusive.completed + exclusive.retried + 2,
            "exclusive: one delivery per completion, retry and dead letter; no duplicates: {exclusive:?}"
        );
        let text = render(&summary);
        assert!(
            text.contains("fulfilment") && text.contains("analytics"),
            "{text}"
        );
    }
}
