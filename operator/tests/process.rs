//! The operator binary as Kubernetes runs it: configured by flags, reaching the API server
//! through a kubeconfig (here the in-memory one, served over HTTP), becoming leader, serving
//! its probes (and `/metrics` only where asked to without TLS), and on SIGTERM releasing its
//! Lease and exiting 0.

use cosmosq_testkit::free_port;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cosmosq_testkit::fake::FakeApiServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const LEASES: &str = "apis/coordination.k8s.io/v1/leases";

/// A plain HTTP/1.0 GET: status code and body.
async fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    let code = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((code, body))
}

// Several threads: the in-memory API server must keep answering while the test waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_leads_serves_probes_and_stops_cleanly_on_sigterm() {
    let fake = FakeApiServer::new();
    let dir = std::env::temp_dir().join(format!("cosmosq-operator-process-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (kubeconfig, stop) = fake.serve_localhost(&dir).await.unwrap();
    let port = free_port();
    let metrics_port = free_port();
    let mut operator = Command::new(env!("CARGO_BIN_EXE_cosmosq-operator"))
        .env("KUBECONFIG", &kubeconfig)
        .env(
            "RUST_LOG",
            std::env::var("COSMOSQ_TEST_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .env_remove("KUBERNETES_SERVICE_HOST")
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args([
            "--insecure-metrics-listen",
            &format!("127.0.0.1:{metrics_port}"),
        ])
        .args(["--lease-namespace", "cosmosq", "--identity", "operator-0"])
        .stdout(if std::env::var_os("COSMOSQ_TEST_LOG").is_some() {
            Stdio::inherit()
        } else {
            Stdio::null()
        })
        .spawn()
        .expect("the operator binary");

    // It takes the Lease and becomes ready.
    let started = Instant::now();
    loop {
        if let Ok(Some(status)) = operator.try_wait() {
            panic!("the operator exited early: {status}");
        }
        let leading = fake
            .get(LEASES, "cosmosq", "cosmosq-operator")
            .is_some_and(|l| l["spec"]["holderIdentity"] == "operator-0");
        if leading
            && get(port, "/readyz")
                .await
                .is_some_and(|(code, _)| code == 200)
        {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "never became ready"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The probes' port, which every pod can reach, does not list the tenants' queues.
    assert_eq!(get(port, "/metrics").await.unwrap().0, 404);
    let (code, metrics) = get(metrics_port, "/metrics").await.unwrap();
    assert_eq!(code, 200);
    assert!(metrics.contains("cosmosq_operator_leader 1"), "{metrics}");

    let _ = Command::new("kill")
        .args(["-TERM", &operator.id().to_string()])
        .status();
    let status = tokio::task::spawn_blocking(move || operator.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status}");
    let lease = fake.get(LEASES, "cosmosq", "cosmosq-operator").unwrap();
    assert!(
        lease["spec"].get("holderIdentity").is_none(),
        "released: {lease}"
    );
    stop.cancel();
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_port_stops_the_binary_with_a_clear_error() {
    let fake = FakeApiServer::new();
    let dir = std::env::temp_dir().join(format!("cosmosq-operator-port-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (kubeconfig, stop) = fake.serve_localhost(&dir).await.unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let operator = Command::new(env!("CARGO_BIN_EXE_cosmosq-operator"))
        .env("KUBECONFIG", &kubeconfig)
        .env("RUST_LOG", "warn")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--lease-namespace", "cosmosq"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("the operator binary");
    let output = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::task::spawn_blocking(move || operator.wait_with_output()),
    )
    .await
    .expect("the operator exits at once")
    .unwrap()
    .unwrap();
    assert!(!output.status.success(), "{}", output.status);
    let logs = String::from_utf8_lossy(&output.stdout);
    assert!(
        logs.contains(&format!("listening on 127.0.0.1:{port}")),
        "{logs}"
    );
    assert!(
        fake.get(LEASES, "cosmosq", "cosmosq-operator").is_none(),
        "it never competed for leadership"
    );
    drop(taken);
    stop.cancel();
    let _ = std::fs::remove_dir_all(&dir);
}

/// `cosmosq-operator check` (the chart's `helm test`) speaks TLS to the API server as the
/// operator does: against an https endpoint that answers nothing it fails with the condition
/// and the read error named and exit code 1, never a panic (two TLS providers are linked in,
/// and a client without a process default panics on its first connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_check_reaches_an_https_api_server_and_fails_with_a_message() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    // Accepts and closes: every TLS handshake fails.
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            drop(stream);
        }
    });
    let dir = std::env::temp_dir().join(format!("cosmosq-operator-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: c\n\
             clusters: [{{name: c, cluster: {{server: 'https://127.0.0.1:{port}', insecure-skip-tls-verify: true}}}}]\n\
             users: [{{name: u, user: {{token: t}}}}]\n\
             contexts: [{{name: c, context: {{cluster: c, user: u}}}}]\n"
        ),
    )
    .unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_cosmosq-operator"))
        .args(["check", "--namespace=ops", "--timeout=5s"])
        .env("KUBECONFIG", &kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("check failed: reading CustomResourceDefinition cosmosqueues.cosmosq.io"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}
