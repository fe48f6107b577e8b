//! `cosmosq emulator`: one local account for several processes.

use std::time::Duration;

use clap::Args;
use cosmosq_emulator::{Emulator, EmulatorOptions};

#[derive(Args, Debug)]
pub struct EmulatorArgs {
    /// Port on 127.0.0.1 (the SDK only speaks plain HTTP to localhost).
    #[arg(long, default_value_t = 8081)]
    pub port: u16,
    /// Physical partitions of each container created.
    #[arg(long, default_value_t = 4)]
    pub partitions: u32,
    /// Throttle each container at this many RU/s, as a real account would (429s).
    #[arg(long)]
    pub throughput: Option<u64>,
    /// How often expired items (TTL) are removed.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub ttl_sweep: Duration,
}

pub async fn run(args: EmulatorArgs) -> anyhow::Result<()> {
    let served = Emulator::serve_localhost(
        args.port,
        EmulatorOptions {
            partitions: args.partitions,
            throughput: args.throughput,
            ..Default::default()
        },
    )
    .await?;
    let (emulator, endpoint, shutdown) = (&served.emulator, &served.endpoint, served.stop.clone());
    let sweeper =
        emulator.spawn_ttl_sweeper(emulator.client().await?, args.ttl_sweep, shutdown.clone());
    println!(
        "cosmosq emulator: an in-memory Cosmos DB account ({} partitions per container)",
        args.partitions
    );
    println!("  COSMOSQ_ENDPOINT={endpoint}");
    println!("  COSMOSQ_AUTH=emulator   (key: {})", emulator.key());
    println!("Ctrl-C stops it; everything is in memory and goes with it.");
    let stop = shutdown.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        stop.cancel();
    });
    served.task.await??;
    sweeper.await?;
    Ok(())
}
