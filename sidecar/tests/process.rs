//! The real `cosmosq-sidecar` binary: how it starts, fails and stops as a process.

use cosmosq_testkit::free_port;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cosmosq_emulator::{Emulator, EmulatorOptions};
use cosmosq_queue::{provision, ConnectionArgs, QueueConfig};

#[test]
fn invalid_configuration_exits_2_naming_the_setting() {
    let output = Command::new(env!("CARGO_BIN_EXE_cosmosq-sidecar"))
        .args([
            "--database",
            "db",
            "--queue",
            "q",
            "--group",
            "g",
            "--app-port",
            "8080",
            "--listen",
            "0.0.0.0:3500",
        ])
        .env_clear()
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--listen"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_and_a_second_signal_exits_at_once() {
    let served = Emulator::serve_localhost(0, EmulatorOptions::default())
        .await
        .unwrap();
    let endpoint = served.endpoint.clone();
    let client = ConnectionArgs::emulator(&endpoint).connect().await.unwrap();
    provision(&client, &QueueConfig::new("db", "q"))
        .await
        .unwrap();

    let start = |app_port: u16| {
        Command::new(env!("CARGO_BIN_EXE_cosmosq-sidecar"))
            .envs([
                ("COSMOSQ_ENDPOINT", endpoint.as_str()),
                ("COSMOSQ_DATABASE", "db"),
                ("COSMOSQ_QUEUE", "q"),
                ("COSMOSQ_GROUP", "g"),
                ("COSMOSQ_APP_PORT", &app_port.to_string()),
                ("COSMOSQ_LISTEN", &format!("127.0.0.1:{}", free_port())),
                (
                    "COSMOSQ_PROBE_LISTEN",
                    &format!("127.0.0.1:{}", free_port()),
                ),
                ("COSMOSQ_GRPC_LISTEN", &format!("127.0.0.1:{}", free_port())),
                ("RUST_LOG", "warn"),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let kill = |pid: u32| {
        Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap();
    };
    let wait = |child: &mut std::process::Child| {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "the sidecar did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    };

    // Waiting for an app that never comes: SIGTERM ends it with success.
    let mut child = start(free_port());
    std::thread::sleep(Duration::from_millis(500));
    kill(child.id());
    assert_eq!(wait(&mut child).code(), Some(0));

    // An app that never answers: the first SIGTERM waits for the delivery (grace period 25 s),
    // the second ends the process at once.
    let got = Arc::new(tokio::sync::Notify::new());
    let app_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app_port = app_listener.local_addr().unwrap().port();
    let notify = Arc::clone(&got);
    let app = axum::Router::new().route(
        "/",
        axum::routing::post(move || {
            let notify = Arc::clone(&notify);
            async move {
                notify.notify_one();
                std::future::pending::<&str>().await
            }
        }),
    );
    tokio::spawn(async move { axum::serve(app_listener, app).await });
    let queue = cosmosq_queue::Queue::open(&client, QueueConfig::new("db", "q"))
        .await
        .unwrap();
    let mut child = start(app_port);
    // Start-from-now: enqueue once the sidecar reads, until the app sees one.
    let delivered = async {
        loop {
            queue
                .enqueue(cosmosq_queue::NewMessage::json(serde_json::json!(1)))
                .await
                .unwrap();
            if tokio::time::timeout(Duration::from_millis(500), got.notified())
                .await
                .is_ok()
            {
                return;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(60), delivered)
        .await
        .expect("a delivery reached the app");
    kill(child.id());
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        child.try_wait().unwrap().is_none(),
        "still draining after the first signal"
    );
    let second = Instant::now();
    kill(child.id());
    assert_eq!(wait(&mut child).code(), Some(130));
    assert!(
        second.elapsed() < Duration::from_secs(5),
        "the second signal ends it at once"
    );
    served.stop.cancel();
}
