//! Shared fixtures for the end-to-end tests: an emulated account with a provisioned queue.
#![forbid(unsafe_code)]
// The operator's futures (kube-runtime controllers, hyper) nest deeper than the default limit
// when the scenario spawns it and its `Send` bound is checked.
#![recursion_limit = "256"]

pub mod crd_rules;
pub mod health;
pub mod ledger;
pub mod otlp;
pub mod scenario;

use std::sync::{Arc, Once};
use std::time::Duration;

use tokio::sync::Notify;

use azure_data_cosmos::CosmosClient;
use cosmosq_emulator::{Emulator, EmulatorOptions};
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
        Self::on_clock(partitions, Clock::system()).await
    }

    /// Like [`Self::new`] on tokio's clock, for tests on paused time (`start_paused`): lease
    /// expiries, locks and back-offs pass as the runtime advances it, not on the machine's
    /// clock. The in-process emulator opens no sockets, so nothing waits on real time.
    pub async fn paused(partitions: u32) -> Fixture {
        let clock = Clock::following_tokio(cosmosq_queue::clock::system_now_ms());
        Self::on_clock(partitions, clock).await
    }

    async fn on_clock(partitions: u32, clock: Clock) -> Fixture {
        let emulator = EmulatorOptions {
            partitions,
            ..Default::default()
        };
        Self::with(emulator, QueueConfig::new("db", "q"), clock).await
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

    /// Enqueues a batch; every message must be taken.
    pub async fn enqueue_all(&self, messages: Vec<cosmosq_queue::NewMessage>) {
        for result in self.queue.enqueue_batch(messages).await {
            result.expect("enqueued");
        }
    }

    pub fn group(&self, config: GroupConfig) -> Group {
        self.queue.group(config).expect("valid group")
    }
}

/// Waits until `check` holds, re-checking each time `notify` fires (no polling sleeps).
pub async fn wait_on(notify: &Notify, what: &str, check: impl Fn() -> bool) {
    tokio::time::timeout(Duration::from_secs(300), async {
        loop {
            let notified = notify.notified();
            if check() {
                return;
            }
            notified.await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("timed out waiting for {what}"));
}

/// Waits until `check` passes, re-checking every 50 ms, for state that several hosts converge
/// on in the database (no single event announces it). Panics with `what` after `timeout`.
pub async fn eventually<F, Fut>(what: &str, timeout: Duration, check: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub use cosmosq_testkit::{fast_host, free_port};
pub use ledger::{Identity, Ledger, Record};

/// The messages container's physical ranges as the service has them now (the SDK's cached
/// topology would hide a split or merge made a moment ago).
pub async fn physical_ranges(queue: &Queue) -> Vec<(String, String)> {
    queue
        .messages()
        .read_feed_ranges(Some(
            azure_data_cosmos::options::ReadFeedRangesOptions::default().with_force_refresh(true),
        ))
        .await
        .expect("read feed ranges")
        .iter()
        .map(cosmosq_queue::range::range_bounds)
        .collect()
}

/// Where `.ci/install-test-tools` installs what the tests drive besides Rust.
pub fn tools_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/tools")
}

/// Runs `.ci/install-test-tools` (pinned helm, kubectl, Python packages and npm packages; it
/// skips what is there) at most once per test process. A test that needs a tool fails when it
/// cannot be had, naming why: it never passes without having run.
pub fn install_test_tools() {
    static INSTALLED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    let result = INSTALLED.get_or_init(|| {
        let script =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.ci/install-test-tools");
        std::process::Command::new(&script)
            .output()
            .map_err(|e| format!("{}: {e}", script.display()))
            .and_then(|o| {
                o.status.success().then_some(()).ok_or_else(|| {
                    format!(
                        "{} failed (it needs python3, npm and their registries): {}",
                        script.display(),
                        String::from_utf8_lossy(&o.stderr)
                    )
                })
            })
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// A Python interpreter with the official Cosmos DB SDK (`azure-cosmos`, pinned in
/// `.ci/install-test-tools`), for tests of what other SDKs see. See [`python_with`].
pub fn python_cosmos_sdk() -> std::path::PathBuf {
    python_with("azure.cosmos")
}

/// A Python interpreter that imports `module`: `COSMOSQ_PYTHON` when set, else the virtualenv
/// `.ci/install-test-tools` makes (made on first use when missing).
pub fn python_with(module: &str) -> std::path::PathBuf {
    let imports = |python: &std::path::Path| {
        std::process::Command::new(python)
            .args(["-c", &format!("import {module}")])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if let Some(python) = std::env::var_os("COSMOSQ_PYTHON") {
        let python = std::path::PathBuf::from(python);
        assert!(
            imports(&python),
            "COSMOSQ_PYTHON={} does not import {module}",
            python.display()
        );
        return python;
    }
    let python = tools_dir().join("python/bin/python");
    if !imports(&python) {
        install_test_tools();
    }
    assert!(
        imports(&python),
        "{} does not import {module} after .ci/install-test-tools",
        python.display()
    );
    python
}

/// KEDA's CRD schema as its published models carry it (`@kubernetes-models/keda` from npm,
/// generated from KEDA's CRDs, with TypeScript to check objects against them), as
/// `.ci/install-test-tools` installs them (on first use when missing).
pub fn keda_models() -> std::path::PathBuf {
    let dir = tools_dir().join("keda-models");
    let installed = |dir: &std::path::Path| {
        dir.join("node_modules/typescript/bin/tsc").exists()
            && dir
                .join("node_modules/@kubernetes-models/keda/package.json")
                .exists()
    };
    if !installed(&dir) {
        install_test_tools();
    }
    assert!(
        installed(&dir),
        "{} is incomplete after .ci/install-test-tools",
        dir.display()
    );
    dir
}

/// The official Dapr JavaScript SDK (`@dapr/dapr` from npm, pinned in
/// `.ci/install-test-tools`): the `node_modules` folder a script's `require` resolves it from
/// (`NODE_PATH`), installed on first use when missing.
pub fn dapr_js() -> std::path::PathBuf {
    let modules = tools_dir().join("dapr-js/node_modules");
    let installed = |m: &std::path::Path| m.join("@dapr/dapr/package.json").exists();
    if !installed(&modules) {
        install_test_tools();
    }
    assert!(
        installed(&modules),
        "{} is incomplete after .ci/install-test-tools",
        modules.display()
    );
    modules
}

/// A headless browser for the console's tests: the `node_modules` folder that holds
/// `playwright-core` (for `NODE_PATH`) and Debian's chromium it drives (`chromium` on the
/// `PATH`, as `.ci/install-test-tools` looks for it, or `COSMOSQ_CHROMIUM`), installed on
/// first use when missing.
pub fn browser() -> (std::path::PathBuf, std::path::PathBuf) {
    let modules = tools_dir().join("browser/node_modules");
    let find = || {
        std::env::var_os("COSMOSQ_CHROMIUM")
            .map(std::path::PathBuf::from)
            .or_else(|| {
                std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
                    .map(|dir| dir.join("chromium"))
                    .find(|path| path.is_file())
            })
            .unwrap_or_else(|| "chromium".into())
    };
    let installed = |chromium: &std::path::Path| {
        modules.join("playwright-core/package.json").exists() && chromium.is_file()
    };
    if !installed(&find()) {
        install_test_tools();
    }
    let chromium = find();
    assert!(
        installed(&chromium),
        "{} or {} is missing after .ci/install-test-tools",
        modules.display(),
        chromium.display()
    );
    (modules, chromium)
}

/// The repository's chart rendered by `helm template <release>` in `namespace` with `args`
/// (`--set …`, `--show-only …`), one JSON value per document (empty documents left out).
pub fn helm_template(release: &str, namespace: &str, args: &[&str]) -> Vec<serde_json::Value> {
    let chart = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/cosmosq");
    let helm = helm();
    let output = std::process::Command::new(&helm)
        .args(["template", release])
        .arg(&chart)
        .args(["--namespace", namespace])
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("helm at {}: {e}", helm.display()));
    assert!(
        output.status.success(),
        "helm template: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_yaml::Deserializer::from_slice(&output.stdout)
        .map(|doc| serde::Deserialize::deserialize(doc).expect("a YAML document"))
        .filter(|object: &serde_json::Value| !object.is_null())
        .collect()
}

/// helm: `COSMOSQ_HELM`, else the one `.ci/install-test-tools` installs (on first use when
/// missing).
pub fn helm() -> std::path::PathBuf {
    if let Some(path) = std::env::var_os("COSMOSQ_HELM") {
        return path.into();
    }
    let helm = tools_dir().join("helm");
    if !helm.exists() {
        install_test_tools();
    }
    helm
}
