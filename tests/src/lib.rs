//! Shared fixtures for the end-to-end tests: an emulated account with a provisioned queue.
#![forbid(unsafe_code)]

use std::sync::{Arc, Once};

use azure_data_cosmos::CosmosClient;
use cosmosq_queue::emulator::{Emulator, EmulatorOptions};
use cosmosq_queue::{provision, Clock, Group, GroupConfig, Queue, QueueConfig};

/// An emulated account with one provisioned queue.
pub struct Fixture {
    pub emulator: Arc<Emulator>,
    pub client: CosmosClient,
    pub queue: Queue,
}

pub fn init_tracing() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_env("COSMOSQ_TEST_LOG")
                    .unwrap_or_else(|_| "warn".into()),
            )
            .with_test_writer()
            .try_init();
    });
}

impl Fixture {
    /// A queue on a fresh in-process account with `partitions` physical partitions.
    pub async fn new(partitions: u32) -> Fixture {
        Self::with(
            EmulatorOptions {
                partitions,
                ..Default::default()
            },
            QueueConfig::new("db", "q"),
            Clock::system(),
        )
        .await
    }

    /// Like [`Self::new`] with a manual clock starting now.
    pub async fn with_manual_clock(partitions: u32) -> (Fixture, Clock) {
        let clock = Clock::manual(cosmosq_queue::clock::system_now_ms());
        let fixture = Self::with(
            EmulatorOptions {
                partitions,
                ..Default::default()
            },
            QueueConfig::new("db", "q"),
            clock.clone(),
        )
        .await;
        (fixture, clock)
    }

    pub async fn with(options: EmulatorOptions, config: QueueConfig, clock: Clock) -> Fixture {
        init_tracing();
        let emulator = Emulator::in_process(options).expect("emulator");
        let client = emulator.client().await.expect("client");
        provision(&client, &config).await.expect("provision");
        emulator
            .apply_partition_count(&config.database, &config.container)
            .await
            .expect("partitions");
        let queue = Queue::open_with_clock(&client, config, clock)
            .await
            .expect("open");
        Fixture {
            emulator,
            client,
            queue,
        }
    }

    pub fn group(&self, config: GroupConfig) -> Group {
        self.queue.group(config).expect("valid group")
    }
}
