//! `cosmosq console`: the web console on localhost.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use cosmosq_console::{Catalog, Console, ConsoleOptions, Database};
use cosmosq_queue::ConnectionArgs;
use tokio_util::sync::CancellationToken;

#[derive(Args, Debug, Clone)]
pub struct ConsoleArgs {
    #[command(flatten)]
    pub connection: ConnectionArgs,
    #[arg(long, env = "COSMOSQ_DATABASE", default_value = "cosmosq")]
    pub database: String,
    /// Only this queue (repeat for several); every queue of the database when omitted.
    #[arg(long, short)]
    pub queue: Vec<String>,
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// Where the console listens and how often it reads the queues (also `cosmosq demo --console`).
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Address to serve on; keep it on localhost (reach it from elsewhere through a tunnel).
    #[arg(long, env = "COSMOSQ_CONSOLE_LISTEN", default_value = "127.0.0.1:8090")]
    pub listen: SocketAddr,
    /// Time between two readings of every queue and group.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub sample_every: Duration,
    /// A host name the console also answers to (one that resolves to it, e.g. behind a
    /// port-forward); requests naming any other host are refused (DNS rebinding).
    #[arg(long)]
    pub allow_host: Vec<String>,
}

impl ServeArgs {
    pub fn options(&self) -> ConsoleOptions {
        ConsoleOptions {
            sample_every: self.sample_every,
            allowed_hosts: self.allow_host.clone(),
            ..ConsoleOptions::default()
        }
    }
}

/// Binds and prints the link; the console then runs until `cancel`.
pub async fn start(
    catalog: Arc<dyn Catalog>,
    options: ConsoleOptions,
    listen: SocketAddr,
    cancel: CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<Result<(), cosmosq_console::ConsoleError>>> {
    let console = Console::bind_catalog(catalog, options, listen).await?;
    let address = console.local_addr();
    let host = if address.ip().is_loopback() || address.ip().is_unspecified() {
        format!("localhost:{}", address.port())
    } else {
        address.to_string()
    };
    println!("console: http://{host}/");
    Ok(tokio::spawn(console.run(cancel)))
}

pub async fn run(args: ConsoleArgs) -> anyhow::Result<()> {
    let client = args.connection.connect().await?;
    let cancel = CancellationToken::new();
    let catalog = Arc::new(Database::new(client, args.database, args.queue));
    let served = start(
        catalog,
        args.serve.options(),
        args.serve.listen,
        cancel.clone(),
    )
    .await?;
    println!("Ctrl-C stops it.");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => cancel.cancel(),
        result = served => return Ok(result??),
    }
    Ok(())
}
