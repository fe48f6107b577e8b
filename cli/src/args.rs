//! Command-line surface and dispatch.

use clap::{Args, Parser, Subcommand};
use cosmosq_queue::{ConnectionArgs, Queue, QueueConfig};

#[derive(Parser)]
#[command(name = "cosmosq", version, about = "Work queues on Azure Cosmos DB", long_about = None)]
pub struct Cli {
    /// More logs (-v info, -vv debug); RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Run the whole loop on the embedded emulator: producers, consumers, live figures.
    #[cfg(feature = "emulator")]
    Demo(crate::demo::DemoArgs),
    /// Serve the embedded Cosmos DB emulator on localhost for other processes.
    #[cfg(feature = "emulator")]
    Emulator(crate::emulator::EmulatorArgs),
    /// Create the queue's database and containers if missing.
    Provision(QueueArgs),
    /// Enqueue messages: JSON lines from a file or stdin, or one --body.
    Enqueue(crate::enqueue::EnqueueArgs),
    /// Tell the operator a queue was written to: its groups at zero start now, not at the next
    /// scaling round.
    Wake(crate::enqueue::WakeArgs),
    /// Inspect and act on a group's dead letters.
    Dlq(crate::dlq::DlqArgs),
    /// Per group: backlog, lag, oldest message, dead letters; per range: owner, lag, backlog.
    Stats(crate::inspect::InspectArgs),
    /// Who holds which feed range, per group.
    Leases(crate::inspect::InspectArgs),
    /// Look at the oldest retained messages without consuming them.
    Peek(crate::inspect::PeekArgs),
    /// A web console: queues, groups, live charts, dead-letter triage, message lookup.
    Console(crate::console::ConsoleArgs),
    /// Measure request units and throughput of the engine on the embedded emulator.
    #[cfg(feature = "emulator")]
    Bench(crate::bench::BenchArgs),
}

/// Which queue, on which account.
#[derive(Args, Clone, Debug)]
pub struct QueueArgs {
    #[command(flatten)]
    pub connection: ConnectionArgs,
    #[arg(long, env = "COSMOSQ_DATABASE", default_value = "cosmosq")]
    pub database: String,
    /// The queue (its messages container).
    #[arg(long, short, env = "COSMOSQ_QUEUE")]
    pub queue: String,
    /// Partition key path of the messages container.
    #[arg(long, env = "COSMOSQ_PARTITION_KEY_PATH", default_value = "/pk")]
    pub partition_key_path: String,
    /// Message retention (used when the queue is created), e.g. "7d".
    #[arg(long, env = "COSMOSQ_RETENTION", default_value = "7d", value_parser = humantime::parse_duration)]
    pub retention: std::time::Duration,
}

impl QueueArgs {
    pub fn config(&self) -> QueueConfig {
        let mut config = QueueConfig::new(self.database.clone(), self.queue.clone());
        config.partition_key_path = self.partition_key_path.clone();
        config.retention = Some(self.retention);
        config
    }

    pub async fn open(&self) -> anyhow::Result<Queue> {
        let client = self.connection.connect().await?;
        Ok(Queue::open(&client, self.config()).await?)
    }
}

impl Command {
    /// Commands that draw live figures keep logs to errors unless asked (-v).
    pub fn quiet_logs(&self) -> bool {
        #[cfg(feature = "emulator")]
        if matches!(self, Command::Demo(_) | Command::Bench(_)) {
            return true;
        }
        false
    }
}

pub fn init_tracing(verbose: u8, quiet: bool) {
    let default = match verbose {
        0 if quiet => "error",
        0 => "warn",
        1 => "info,cosmosq_queue=info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

pub async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        #[cfg(feature = "emulator")]
        Command::Demo(args) => crate::demo::run(args).await,
        #[cfg(feature = "emulator")]
        Command::Emulator(args) => crate::emulator::run(args).await,
        Command::Provision(args) => {
            let client = args.connection.connect().await?;
            let (_, created) = cosmosq_queue::provision(&client, &args.config()).await?;
            println!(
                "queue {} ready (created: database {}, messages container {}, lease container {})",
                args.queue,
                created.created_database,
                created.created_messages_container,
                created.created_lease_container
            );
            Ok(())
        }
        Command::Enqueue(args) => crate::enqueue::run(args).await,
        Command::Wake(args) => crate::enqueue::wake(args).await,
        Command::Dlq(args) => crate::dlq::run(args).await,
        Command::Stats(args) => crate::inspect::run_stats(args).await,
        Command::Leases(args) => crate::inspect::run_leases(args).await,
        Command::Peek(args) => crate::inspect::run_peek(args).await,
        Command::Console(args) => crate::console::run(args).await,
        #[cfg(feature = "emulator")]
        Command::Bench(args) => crate::bench::run(args).await,
    }
}
