//! The sidecar end to end: the emulator behind it, a real HTTP app on localhost in front.

use cosmosq_tests::free_port;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use cosmosq_program::telemetry::OtlpArgs;
use cosmosq_queue::lease::LeaseStore;
use cosmosq_queue::{
    DeliveryMode, ExclusiveWrites, GroupConfig, MessageState, NewMessage, StartFrom,
};
use cosmosq_sidecar::settings::{AppMode, PublishTarget, PublishTargets, SidecarSettings, Token};
use cosmosq_tests::{eventually, wait_on, Fixture};
use serde_json::json;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// What the test app does with one delivery.
#[derive(Clone, Debug)]
enum Act {
    Answer(u16, &'static str),
    Hang,
    Sleep(Duration, u16),
    Wait, // until released
    /// Starts a 200 answer, then dies mid-body (the process crashing mid-request).
    Crash,
    /// A 200 answer of ten megabytes, in this shape.
    Huge(HugeBody),
}

#[derive(Clone, Copy, Debug)]
enum HugeBody {
    /// `{"status":"RETRY", "log": "xxx…"}`: the status is in the part the sidecar reads.
    JsonStatusFirst,
    /// `{"log": "xxx…", "status":"SUCCESS"}`: the status is beyond it.
    JsonStatusLast,
    /// Ten megabytes of text: not JSON, so a success (Dapr's rule).
    Text,
}

/// What a delivery carried beside the message.
#[derive(Clone, Debug, Default)]
struct Context {
    key: String,
    traceparent: String,
    tracestate: String,
    event_traceparent: String,
    event_tracestate: String,
}

const TEN_MB: usize = 10 * 1024 * 1024;

type Script = Arc<dyn Fn(&str, u32) -> Act + Send + Sync>;

/// A real HTTP app on localhost that records every request it gets.
#[derive(Clone)]
struct TestApp {
    seen: Arc<Mutex<Vec<(String, u32, String)>>>, // id, delivery count, group
    context: Arc<Mutex<HashMap<String, Context>>>, // id → what came with its last delivery
    waiting: Arc<Mutex<usize>>,
    release: Arc<Notify>,
    changed: Arc<Notify>,
}

impl TestApp {
    fn new() -> Self {
        Self {
            seen: Arc::default(),
            context: Arc::default(),
            waiting: Arc::default(),
            release: Arc::new(Notify::new()),
            changed: Arc::new(Notify::new()),
        }
    }

    async fn serve(
        &self,
        listener: tokio::net::TcpListener,
        script: Script,
    ) -> tokio::task::JoinHandle<()> {
        let app = self.clone();
        let router = axum::Router::new()
            .route("/health", axum::routing::get(|| async { "ok" }))
            .route(
                "/messages",
                axum::routing::post(move |headers: HeaderMap, body: String| {
                    let app = app.clone();
                    let script = Arc::clone(&script);
                    async move { app.answer(headers, body, script).await }
                }),
            );
        tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        })
    }

    async fn answer(
        &self,
        headers: HeaderMap,
        body: String,
        script: Script,
    ) -> axum::response::Response {
        let header = |n: &str| {
            headers
                .get(n)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned()
        };
        let id = header("cosmosq-message-id");
        let count: u32 = header("cosmosq-delivery-count").parse().unwrap_or(0);
        let event: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        assert_eq!(
            event["id"],
            id.as_str(),
            "the CloudEvent carries the message id"
        );
        let context = Context {
            key: header("cosmosq-partition-key"),
            traceparent: header("traceparent"),
            tracestate: header("tracestate"),
            event_traceparent: event["traceparent"].as_str().unwrap_or_default().into(),
            event_tracestate: event["tracestate"].as_str().unwrap_or_default().into(),
        };
        self.context.lock().unwrap().insert(id.clone(), context);
        self.seen
            .lock()
            .unwrap()
            .push((id.clone(), count, header("cosmosq-group")));
        self.changed.notify_waiters();
        let act = script(&id, count);
        let (status, text) = match act {
            Act::Answer(status, text) => (status, text),
            Act::Hang => {
                std::future::pending::<()>().await;
                unreachable!()
            }
            Act::Sleep(d, status) => {
                tokio::time::sleep(d).await;
                (status, "")
            }
            Act::Wait => {
                *self.waiting.lock().unwrap() += 1;
                self.changed.notify_waiters();
                self.release.notified().await;
                (200, "")
            }
            Act::Crash => {
                let parts: Vec<Result<&'static str, std::io::Error>> = vec![
                    Ok(r#"{"status":"#),
                    Err(std::io::Error::other("the app crashed")),
                ];
                return axum::body::Body::from_stream(futures::stream::iter(parts)).into_response();
            }
            Act::Huge(shape) => {
                let padding = "x".repeat(TEN_MB);
                let body = match shape {
                    HugeBody::JsonStatusFirst => {
                        format!(r#"{{"status":"RETRY","log":"{padding}"}}"#)
                    }
                    HugeBody::JsonStatusLast => {
                        format!(r#"{{"log":"{padding}","status":"SUCCESS"}}"#)
                    }
                    HugeBody::Text => padding,
                };
                return (StatusCode::OK, body).into_response();
            }
        };
        let mut response = (StatusCode::from_u16(status).unwrap(), text.to_owned()).into_response();
        if status == 429 {
            response
                .headers_mut()
                .insert("retry-after", "0".parse().unwrap());
        }
        response
    }

    fn deliveries(&self, id: &str) -> Vec<u32> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(i, _, _)| i == id)
            .map(|(_, c, _)| *c)
            .collect()
    }

    async fn wait_for(&self, what: &str, check: impl Fn(&TestApp) -> bool) {
        wait_on(&self.changed, what, || check(self)).await;
    }
}

/// A sidecar on this machine's timings, reading group `group` of `db/q` from the beginning
/// and posting to `app_port`, with a lock short enough that expiry tests take a second.
pub(crate) fn settings(group: &str, app_port: u16, api_port: u16) -> SidecarSettings {
    SidecarSettings {
        start_from: StartFrom::Beginning,
        app_port: Some(app_port),
        app_path: "/messages".into(),
        listen: SocketAddr::from(([127, 0, 0, 1], api_port)),
        probe_listen: format!("127.0.0.1:{}", free_port()),
        app_timeout: Duration::from_millis(1500),
        lock_duration: Duration::from_secs(1),
        max_delivery_attempts: 3,
        ..SidecarSettings::new("db", "q", group).on_one_machine()
    }
}

pub(crate) struct RunningSidecar {
    pub(crate) stop: CancellationToken,
    pub(crate) task: tokio::task::JoinHandle<Result<(), cosmosq_sidecar::error::SidecarError>>,
    pub(crate) api: String,
}

pub(crate) fn start_sidecar(fixture: &Fixture, config: SidecarSettings) -> RunningSidecar {
    let api = format!("http://{}", config.listen);
    let stop = CancellationToken::new();
    let task = tokio::spawn(cosmosq_sidecar::run::run_with_client(
        config,
        fixture.client.clone(),
        stop.clone(),
    ));
    RunningSidecar { stop, task, api }
}

async fn state(fixture: &Fixture, group: &str, id: &str) -> Option<MessageState> {
    let g = fixture.group(GroupConfig::new(group));
    g.read_state(&id.into(), id).await.unwrap().map(|s| s.state)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_answer_settles_as_the_contract_says() {
    let fixture = Fixture::new(2).await;
    let app = TestApp::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app_port = listener.local_addr().unwrap().port();
    let script: Script = Arc::new(|id: &str, count: u32| match (id, count) {
        ("ok", _) => Act::Answer(204, ""),
        ("ok-json", _) => Act::Answer(200, r#"{"status":"SUCCESS"}"#),
        ("retry-then-ok", 1) => Act::Answer(200, r#"{"status":"RETRY"}"#),
        ("retry-then-ok", _) => Act::Answer(200, ""),
        ("drop", _) => Act::Answer(200, r#"{"status":"DROP"}"#),
        ("fails", _) => Act::Answer(500, "boom"),
        ("throttled-then-ok", 1) => Act::Answer(429, ""),
        ("throttled-then-ok", _) => Act::Answer(200, ""),
        ("hangs-once", 1) => Act::Hang,
        ("hangs-once", _) => Act::Answer(200, ""),
        ("slow", _) => Act::Sleep(Duration::from_millis(1300), 200),
        ("garbage", _) => Act::Answer(200, "<html>not json</html>"),
        ("unknown-status", 1) => Act::Answer(200, r#"{"status":"MAYBE"}"#),
        ("unknown-status", _) => Act::Answer(200, ""),
        ("crashes-once", 1) => Act::Crash, // crashes whenever its delivery count is 1
        ("huge-retry-once", 1) => Act::Huge(HugeBody::JsonStatusFirst),
        ("huge-status-last-once", 1) => Act::Huge(HugeBody::JsonStatusLast),
        ("huge-text", _) => Act::Huge(HugeBody::Text),
        _ => Act::Answer(200, ""),
    });
    app.serve(listener, script).await;
    let ids = [
        "ok",
        "ok-json",
        "retry-then-ok",
        "drop",
        "fails",
        "throttled-then-ok",
        "hangs-once",
        "slow",
        "garbage",
        "unknown-status",
        "crashes-once",
        "huge-retry-once",
        "huge-status-last-once",
        "huge-text",
    ];
    for id in ids {
        fixture
            .queue
            .enqueue(NewMessage::json(json!({"case": id})).with_id(id))
            .await
            .unwrap();
    }
    let sidecar = start_sidecar(&fixture, settings("g", app_port, free_port()));

    let expected: HashMap<&str, (MessageState, Vec<u32>)> = HashMap::from([
        ("ok", (MessageState::Completed, vec![1])),
        ("ok-json", (MessageState::Completed, vec![1])),
        ("retry-then-ok", (MessageState::Completed, vec![1, 2])),
        ("drop", (MessageState::DeadLettered, vec![1])),
        ("fails", (MessageState::DeadLettered, vec![1, 2, 3])),
        ("throttled-then-ok", (MessageState::Completed, vec![1, 2])),
        ("hangs-once", (MessageState::Completed, vec![1, 2])),
        ("slow", (MessageState::Completed, vec![1])),
        ("garbage", (MessageState::Completed, vec![1])),
        ("unknown-status", (MessageState::Completed, vec![1, 2])),
        // Half an answer is no answer. A crash is first taken for the app going down under
        // everything it had in flight: not counted, tried again alone (count 1 again); the
        // crash alone counts (count 2).
        ("crashes-once", (MessageState::Completed, vec![1, 1, 2])),
        // Ten megabytes: read up to 64 KB, judged by a status found there, else retried.
        ("huge-retry-once", (MessageState::Completed, vec![1, 2])),
        (
            "huge-status-last-once",
            (MessageState::Completed, vec![1, 2]),
        ),
        ("huge-text", (MessageState::Completed, vec![1])),
    ]);
    for (id, (final_state, _)) in &expected {
        eventually(
            &format!("{id} settles"),
            Duration::from_secs(30),
            || async { state(&fixture, "g", id).await == Some(*final_state) },
        )
        .await;
    }
    for (id, (_, counts)) in &expected {
        assert_eq!(
            &app.deliveries(id),
            counts,
            "{id}: delivery counts the app saw"
        );
    }
    let dead = fixture
        .group(GroupConfig::new("g"))
        .dead_letters(None)
        .await
        .unwrap();
    let reasons: HashMap<String, Option<String>> = dead
        .iter()
        .map(|d| (d.message_id.clone(), d.reason.clone()))
        .collect();
    assert_eq!(reasons["drop"].as_deref(), Some("DroppedByApp"));
    assert_eq!(
        reasons["fails"].as_deref(),
        Some("MaxDeliveryAttemptsExceeded")
    );
    // The gauge's count (ids only) agrees with the listing, and stops at its limit.
    let group = fixture.group(GroupConfig::new("g"));
    assert_eq!(group.count_dead_letters(10_000).await.unwrap(), dead.len());
    assert!(dead.len() > 1);
    assert_eq!(group.count_dead_letters(1).await.unwrap(), 1);

    // The metrics say what the app saw.
    let text = reqwest::get(format!("{}/metrics", sidecar.api))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let samples = parse_prometheus(&text);
    let get = |series: &str| {
        *samples
            .get(series)
            .unwrap_or_else(|| panic!("no {series} in\n{text}"))
    };
    assert_eq!(
        get(r#"cosmosq_deliveries_total{group="g",outcome="completed",queue="q",scope="pod"}"#),
        12.0
    );
    assert_eq!(
        get(r#"cosmosq_deliveries_total{group="g",outcome="dead_lettered",queue="q",scope="pod"}"#),
        2.0
    );
    let app_seen = app.seen.lock().unwrap().len() as f64;
    assert_eq!(
        get(r#"cosmosq_app_request_duration_seconds_count{group="g",queue="q",scope="pod"}"#),
        app_seen
    );
    assert!(
        get(r#"cosmosq_request_units_total{group="g",operation="claim",queue="q",scope="pod"}"#)
            > 0.0
    );

    sidecar.stop.cancel();
    sidecar.task.await.unwrap().unwrap();
}

/// Parses Prometheus text exposition: every sample line must be `name{labels} value`.
fn parse_prometheus(text: &str) -> HashMap<String, f64> {
    let mut samples = HashMap::new();
    for line in text
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("bad sample line {line:?}"));
        let value: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("bad value in {line:?}"));
        let (name, labels) = series.split_once('{').unwrap_or((series, "}"));
        assert!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad name in {line:?}"
        );
        let mut labels: Vec<&str> = labels
            .trim_end_matches('}')
            .split(',')
            .filter(|l| !l.is_empty())
            .collect();
        assert!(
            labels.iter().all(|l| l.contains("=\"") && l.ends_with('"')),
            "bad labels in {line:?}"
        );
        labels.sort();
        let key = if labels.is_empty() {
            name.to_owned()
        } else {
            format!("{name}{{{}}}", labels.join(","))
        };
        samples.insert(key, value);
    }
    samples
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_waits_for_an_app_that_starts_late() {
    let fixture = Fixture::new(1).await;
    let app_port = free_port();
    let api_port = free_port();
    let probe_listen = format!("127.0.0.1:{}", free_port());
    let sidecar = start_sidecar(
        &fixture,
        SidecarSettings {
            app_health_path: Some("/health".into()),
            probe_listen: probe_listen.clone(),
            ..settings("g", app_port, api_port)
        },
    );
    fixture
        .queue
        .enqueue(NewMessage::json(json!(1)).with_id("early"))
        .await
        .unwrap();
    let api = format!("http://127.0.0.1:{api_port}");
    eventually("the API answers", Duration::from_secs(5), || async {
        reqwest::get(format!("{api}/healthz")).await.is_ok()
    })
    .await;
    let ready = reqwest::get(format!("{api}/readyz"))
        .await
        .unwrap()
        .status();
    assert_eq!(ready, 503, "not ready before the app is");

    let app = TestApp::new();
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", app_port))
        .await
        .unwrap();
    app.serve(listener, Arc::new(|_: &str, _: u32| Act::Answer(200, "")))
        .await;
    app.wait_for("the message", |a| !a.deliveries("early").is_empty())
        .await;
    assert_eq!(
        app.deliveries("early"),
        vec![1],
        "no delivery was wasted on a closed port"
    );
    assert_eq!(
        reqwest::get(format!("{api}/readyz"))
            .await
            .unwrap()
            .status(),
        200
    );
    // The probe port answers the kubelet and Prometheus, and offers no enqueue.
    let probe = format!("http://{probe_listen}");
    assert_eq!(
        reqwest::get(format!("{probe}/readyz"))
            .await
            .unwrap()
            .status(),
        200
    );
    let metrics = reqwest::get(format!("{probe}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("cosmosq_in_flight"));
    let enqueue = cosmosq_queue::cosmos::tls::http_client_builder()
        .build()
        .expect("an HTTP client")
        .post(format!("{probe}/v1/enqueue"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(enqueue.status(), 404);
    sidecar.stop.cancel();
    sidecar.task.await.unwrap().unwrap();
}

/// After a drain: messages `m0..m{count}` of `group` completed, each delivered once, and every
/// lease of the group released.
async fn drained_once_and_released(fixture: &Fixture, app: &TestApp, group: &str, count: usize) {
    for i in 0..count {
        let id = format!("m{i}");
        assert_eq!(
            state(fixture, group, &id).await,
            Some(MessageState::Completed),
            "{id}"
        );
        assert_eq!(app.deliveries(&id), vec![1]);
    }
    let leases = LeaseStore::new(fixture.queue.clone(), group)
        .list()
        .await
        .unwrap();
    assert!(
        leases.iter().all(|l| l.owner.is_none()),
        "released: {leases:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_fifty_in_flight_loses_nothing_and_releases_leases() {
    let fixture = Fixture::new(2).await;
    let app = TestApp::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app_port = listener.local_addr().unwrap().port();
    app.serve(listener, Arc::new(|_: &str, _: u32| Act::Wait))
        .await;
    let batch = (0..50)
        .map(|i| NewMessage::json(json!(i)).with_id(format!("m{i}")))
        .collect();
    fixture.enqueue_all(batch).await;
    let settings = SidecarSettings {
        max_concurrency: 64,
        lock_duration: Duration::from_secs(10),
        app_timeout: Duration::from_secs(30),
        ..settings("g", app_port, free_port())
    };
    let probe = settings.probe_addr().unwrap();
    let sidecar = start_sidecar(&fixture, settings);
    app.wait_for("50 in flight", |a| *a.waiting.lock().unwrap() == 50)
        .await;

    // The app container's preStop hook (what the kubelet calls when the pod is deleted).
    // Without SIGTERM to the sidecar (the app container alone restarting) it does not hold
    // the app up beyond the wait for a drain to begin.
    let drained = format!("http://{}/drained", probe.expect("a probe listener"));
    let answer = reqwest::get(&drained).await.unwrap();
    assert_eq!(answer.text().await.unwrap(), "not stopping");
    let pre_stop = tokio::spawn(async move {
        let text = reqwest::get(&drained).await.unwrap().text().await.unwrap();
        (text, tokio::time::Instant::now())
    });
    sidecar.stop.cancel(); // what SIGTERM does
    tokio::time::sleep(Duration::from_millis(200)).await; // the app is still busy for a while
    assert!(
        !pre_stop.is_finished(),
        "the app must keep serving while deliveries are in flight"
    );
    let released = tokio::time::Instant::now();
    app.release.notify_waiters();
    sidecar.task.await.unwrap().unwrap();
    let (text, answered) = pre_stop.await.unwrap();
    assert_eq!(text, "drained");
    assert!(answered >= released);

    drained_once_and_released(&fixture, &app, "g", 50).await;
}

/// Dapr's shutdown API (a Job's app calls it when done): behind the API token; the sidecar
/// drains as on SIGTERM — what is in flight is settled once, leases are released — and ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shutdown_api_drains_like_sigterm() {
    let fixture = Fixture::new(1).await;
    let app = TestApp::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app_port = listener.local_addr().unwrap().port();
    app.serve(listener, Arc::new(|_: &str, _: u32| Act::Wait))
        .await;
    let batch = (0..5)
        .map(|i| NewMessage::json(json!(i)).with_id(format!("m{i}")))
        .collect();
    fixture.enqueue_all(batch).await;
    let settings = SidecarSettings {
        lock_duration: Duration::from_secs(10),
        app_timeout: Duration::from_secs(30),
        api_token: Some("api-s3cret".parse().unwrap()),
        ..settings("g", app_port, free_port())
    };
    let sidecar = start_sidecar(&fixture, settings);
    app.wait_for("5 in flight", |a| *a.waiting.lock().unwrap() == 5)
        .await;

    let url = format!("{}/v1.0/shutdown", sidecar.api);
    let client = cosmosq_queue::cosmos::tls::http_client_builder()
        .build()
        .expect("an HTTP client");
    let refused = client.post(&url).send().await.unwrap();
    assert_eq!(refused.status(), 401, "without the API token");
    assert!(!sidecar.stop.is_cancelled());
    let answer = client
        .post(&url)
        .header("dapr-api-token", "api-s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 204);
    assert!(sidecar.stop.is_cancelled(), "the drain has begun");
    assert!(!sidecar.task.is_finished(), "and waits for the app");
    app.release.notify_waiters();
    sidecar.task.await.unwrap().unwrap();

    drained_once_and_released(&fixture, &app, "g", 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_through_one_sidecar_consume_through_another() {
    let fixture = Fixture::new(2).await;
    let app = TestApp::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app_port = listener.local_addr().unwrap().port();
    app.serve(listener, Arc::new(|_: &str, _: u32| Act::Answer(200, "")))
        .await;
    let producer = start_sidecar(
        &fixture,
        SidecarSettings {
            start_from: StartFrom::Now,
            ..settings("producers", app_port, free_port())
        },
    );
    let consumer = start_sidecar(&fixture, settings("workers", app_port, free_port()));
    let http = cosmosq_queue::cosmos::tls::http_client_builder()
        .build()
        .expect("an HTTP client");
    eventually(
        "the producer sidecar is up",
        Duration::from_secs(5),
        || async {
            http.get(format!("{}/readyz", producer.api))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        },
    )
    .await;

    let post = |path: &str, body: serde_json::Value| {
        http.post(format!("{}{path}", producer.api))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
    };
    // The caller's trace goes on at the delivery: W3C headers on the enqueue call.
    const TRACE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let r = http
        .post(format!("{}/v1/enqueue", producer.api))
        .header("traceparent", TRACE)
        .header("tracestate", "congo=t61rcWkgMzE")
        .header("content-type", "application/json")
        .body(json!({"id": "one", "body": {"n": 1}}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let r = post("/v1/enqueue", json!({"id": "one", "body": {"n": 1}}))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let answer: serde_json::Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    assert_eq!(answer["duplicate"], true);
    let r = post("/v1/enqueue", json!({"bdy": 1})).await.unwrap();
    assert_eq!(r.status(), 422, "unknown fields are rejected");
    let r = post("/v1/enqueue", json!({"id": "a/b", "body": 1}))
        .await
        .unwrap();
    assert_eq!(r.status(), 400, "an invalid id is named");
    assert!(r.text().await.unwrap().contains("message id"));
    let r = post("/v1/enqueue", json!({"body": "x".repeat(2_100_000)}))
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    // A batch under one trace, but for a message that names its own.
    const OWN: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let batch: Vec<_> = (0..20)
        .map(|i| json!({"id": format!("b{i}"), "partitionKey": "k", "body": i}))
        .chain([json!({"id": "own-trace", "metadata": {"traceparent": OWN}})])
        .chain([json!({"id": "bad/id"})])
        .collect();
    let r = http
        .post(format!("{}/v1/enqueue/batch", producer.api))
        .header("traceparent", TRACE)
        .header("content-type", "application/json")
        .body(json!(batch).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 207);
    let answer: serde_json::Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    let results = answer["results"].as_array().unwrap().clone();
    assert_eq!(results.len(), 22);
    assert!(results[21].get("error").is_some());

    // Publishing the Dapr way (an app written against Dapr's pub/sub API, unchanged).
    let dapr = |path: &str, content_type: &str, body: String| {
        http.post(format!("{}{path}", producer.api))
            .header("content-type", content_type)
            .body(body)
            .send()
    };
    let r = http
        .get(format!("{}/v1.0/healthz/outbound", producer.api))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204, "what Dapr SDKs wait on");
    let r = dapr(
        "/v1.0/publish/cosmosq/q?metadata.ttlInSeconds=600",
        "application/json",
        json!({"status": "completed"}).to_string(),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 204);
    let event = json!({"specversion": "1.0", "id": "evt-1", "source": "checkout",
        "type": "order.created", "datacontenttype": "application/json", "data": {"sku": 7}});
    for _ in 0..2 {
        let r = dapr(
            "/v1.0/publish/cosmosq/q",
            "application/cloudevents+json",
            event.to_string(),
        )
        .await
        .unwrap();
        assert_eq!(r.status(), 204, "the same event twice: one message");
    }
    let r = dapr("/v1.0/publish/pubsub/q", "application/json", "{}".into())
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let answer: serde_json::Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    assert_eq!(answer["errorCode"], "ERR_PUBSUB_NOT_FOUND");
    let r = dapr(
        "/v1.0/publish/cosmosq/other",
        "application/json",
        "{}".into(),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 403, "{:?}", r.text().await);

    app.wait_for("the consumer got everything", |a| {
        a.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, _, g)| g == "workers")
            .count()
            == 24
    })
    .await;
    let seen = app.seen.lock().unwrap().clone();
    let workers: Vec<_> = seen.iter().filter(|(_, _, g)| g == "workers").collect();
    assert!(workers.iter().all(|(_, count, _)| *count == 1));
    let context = app.context.lock().unwrap().clone();
    let one = &context["one"];
    assert_eq!(
        (one.traceparent.as_str(), one.tracestate.as_str()),
        (TRACE, "congo=t61rcWkgMzE"),
        "W3C headers at the app"
    );
    assert_eq!(
        (
            one.event_traceparent.as_str(),
            one.event_tracestate.as_str()
        ),
        (TRACE, "congo=t61rcWkgMzE"),
        "and in the CloudEvent"
    );
    assert_eq!(context["b7"].traceparent, TRACE, "the batch's trace");
    assert_eq!(context["b7"].tracestate, "");
    assert_eq!(
        context["own-trace"].traceparent, OWN,
        "a message's own wins"
    );

    for s in [producer, consumer] {
        s.stop.cancel();
        s.task.await.unwrap().unwrap();
    }
}

/// One trace from the caller's enqueue to the app's work, exported by both sidecars to a
/// local OTLP receiver: the producer's `send` under the caller's span, each delivery attempt's
/// `process` under the `send`, and the app handed the `process` span as its parent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_from_enqueue_to_the_app_is_exported_over_otlp() {
    use cosmosq_tests::otlp::{OtlpReceiver, ReceivedSpan};
    let receiver = OtlpReceiver::start().await;
    let fixture = Fixture::new(2).await;
    // Producer and consumer each with an app of their own, so each context is the group's.
    let (producer_app, app) = (TestApp::new(), TestApp::new());
    let mut ports = Vec::new();
    for (test_app, script) in [
        (
            &producer_app,
            Arc::new(|_: &str, _: u32| Act::Answer(200, "")) as Script,
        ),
        (
            &app,
            Arc::new(|id: &str, count: u32| match (id, count) {
                ("one", 1) => Act::Answer(500, "not yet"),
                _ => Act::Answer(200, ""),
            }),
        ),
    ] {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        ports.push(listener.local_addr().unwrap().port());
        test_app.serve(listener, script).await;
    }
    let producer = start_sidecar(
        &fixture,
        SidecarSettings {
            start_from: StartFrom::Now,
            otlp: OtlpArgs {
                otel_service_name: Some("shop-api".into()),
                ..OtlpArgs::to_endpoint(&receiver.endpoint)
            },
            ..settings("producers", ports[0], free_port())
        },
    );
    let consumer = start_sidecar(
        &fixture,
        SidecarSettings {
            otlp: OtlpArgs {
                otlp_protocol: Some("http/json".into()),
                ..OtlpArgs::to_endpoint(&receiver.endpoint)
            },
            ..settings("workers", ports[1], free_port())
        },
    );
    let http = cosmosq_queue::cosmos::tls::http_client_builder()
        .build()
        .expect("an HTTP client");
    eventually("the producer is up", Duration::from_secs(5), || async {
        http.get(format!("{}/readyz", producer.api))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
    })
    .await;
    const CALLER_SPAN: &str = "00f067aa0ba902b7";
    const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    let traceparent = format!("00-{TRACE_ID}-{CALLER_SPAN}-01");
    let r = http
        .post(format!("{}/v1/enqueue", producer.api))
        .header("traceparent", &traceparent)
        .header("tracestate", "congo=t61rcWkgMzE")
        .header("content-type", "application/json")
        .body(json!({"id": "one", "body": 1}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let batch: Vec<_> = (0..3)
        .map(|i| json!({"id": format!("b{i}"), "body": i}))
        .collect();
    let r = http
        .post(format!("{}/v1/enqueue/batch", producer.api))
        .header("traceparent", &traceparent)
        .header("content-type", "application/json")
        .body(json!(batch).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // A Dapr publisher's CloudEvent carries its own trace: the publish joins that one.
    const OWN_TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
    let event = json!({"specversion": "1.0", "id": "evt", "source": "s", "type": "t",
        "traceparent": format!("00-{OWN_TRACE}-b7ad6b7169203331-01"), "data": {"n": 1}});
    let r = http
        .post(format!("{}/v1.0/publish/cosmosq/q", producer.api))
        .header("content-type", "application/cloudevents+json")
        .body(event.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    app.wait_for("every message completed, one after a retry", |a| {
        a.deliveries("one") == [1, 2]
            && ["b0", "b1", "b2", "evt"]
                .iter()
                .all(|id| a.deliveries(id) == [1])
    })
    .await;
    // Stopping sends what is buffered: nothing is awaited by sleeping.
    for s in [producer, consumer] {
        s.stop.cancel();
        s.task.await.unwrap().unwrap();
    }

    let spans = receiver.spans();
    let of = |service: &str, name: &str| -> Vec<ReceivedSpan> {
        spans
            .iter()
            .filter(|s| s.service == service && s.name == name)
            .cloned()
            .collect()
    };
    let sends = of("shop-api", "send q");
    assert_eq!(sends.len(), 3, "one per publish request: {sends:#?}");
    assert!(sends.iter().all(|s| s.kind == "producer"
        && s.attr("messaging.destination.name") == "q"
        && s.attr("messaging.operation.type") == "send"));
    let under_caller: Vec<_> = sends
        .iter()
        .filter(|s| s.trace_id == TRACE_ID && s.parent_span_id == CALLER_SPAN)
        .collect();
    assert_eq!(
        under_caller.len(),
        2,
        "the single and the batch: {sends:#?}"
    );
    let batch_send = under_caller
        .iter()
        .find(|s| s.attr("messaging.batch.message_count") == "3")
        .expect("the batch's span counts its messages");
    let single_send = under_caller
        .iter()
        .find(|s| !s.attributes.contains_key("messaging.batch.message_count"))
        .unwrap();
    let dapr_send = sends
        .iter()
        .find(|s| s.trace_id == OWN_TRACE && s.parent_span_id == "b7ad6b7169203331")
        .expect("the CloudEvent's publish under its own trace");

    let processed = of("cosmosq-sidecar", "process q");
    let by_id = |id: &str| -> Vec<&ReceivedSpan> {
        let mut found: Vec<_> = processed
            .iter()
            .filter(|s| s.attr("messaging.message.id") == id)
            .collect();
        found.sort_by_key(|s| s.attr("cosmosq.message.delivery_count"));
        found
    };
    let one = by_id("one");
    assert_eq!(
        one.len(),
        2,
        "one span per delivery attempt: {processed:#?}"
    );
    for (span, count) in one.iter().zip(["1", "2"]) {
        assert_eq!(span.kind, "consumer");
        assert_eq!(span.trace_id, TRACE_ID);
        assert_eq!(
            span.parent_span_id, single_send.span_id,
            "under the publish"
        );
        assert_eq!(span.attr("messaging.consumer.group.name"), "workers");
        assert_eq!(span.attr("cosmosq.message.delivery_count"), count);
    }
    assert_eq!(one[0].attr("cosmosq.outcome"), "retry");
    assert!(
        one[0].error.as_deref().is_some_and(|e| e.contains("500")),
        "{:?}",
        one[0]
    );
    assert_eq!(one[1].attr("cosmosq.outcome"), "complete");
    assert_eq!(one[1].error, None);
    for id in ["b0", "b1", "b2"] {
        let spans = by_id(id);
        assert_eq!(spans.len(), 1, "{id}");
        assert_eq!(
            spans[0].parent_span_id, batch_send.span_id,
            "{id} under the batch"
        );
    }
    let evt = by_id("evt");
    assert_eq!(evt.len(), 1);
    assert_eq!(
        (evt[0].trace_id.as_str(), evt[0].parent_span_id.as_str()),
        (OWN_TRACE, dapr_send.span_id.as_str())
    );

    // The app's work is a child of its delivery: the last attempt's span is its parent, in
    // the headers and the CloudEvent, with the caller's tracestate passed on.
    let context = app.context.lock().unwrap().clone();
    let expected = format!("00-{TRACE_ID}-{}-01", one[1].span_id);
    assert_eq!(context["one"].traceparent, expected);
    assert_eq!(context["one"].event_traceparent, expected);
    assert_eq!(context["one"].tracestate, "congo=t61rcWkgMzE");
    let types = receiver.content_types();
    assert!(
        types.iter().any(|t| t == "application/x-protobuf"),
        "{types:?}"
    );
    assert!(types.iter().any(|t| t == "application/json"), "{types:?}");
}

#[tokio::test]
async fn invalid_configuration_stops_the_sidecar_with_the_setting_named() {
    let fixture = Fixture::new(1).await;
    let bad_listen = SidecarSettings {
        listen: "0.0.0.0:9999".parse().unwrap(),
        ..settings("g", 8080, free_port())
    };
    let err = cosmosq_sidecar::run::run_with_client(
        bad_listen,
        fixture.client.clone(),
        CancellationToken::new(),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("--listen"), "{err}");
    let missing = SidecarSettings::new("db", "q", "g").validate().unwrap_err();
    assert!(
        missing.to_string().contains("--app-port"),
        "pushed deliveries need it: {missing}"
    );
    // A queue nobody provisioned.
    let mut unprovisioned = settings("g", 8080, free_port());
    unprovisioned.queue = "nope".into();
    let err = cosmosq_sidecar::run::run_with_client(
        unprovisioned,
        fixture.client.clone(),
        CancellationToken::new(),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("provisioned"), "{err}");
    // A collector's gRPC port: refused at start, saying what to use.
    let grpc = SidecarSettings {
        otlp: OtlpArgs {
            otlp_protocol: Some("grpc".into()),
            ..OtlpArgs::to_endpoint("http://c:4317")
        },
        ..settings("g", 8080, free_port())
    };
    let err = cosmosq_sidecar::run::run_with_client(
        grpc,
        fixture.client.clone(),
        CancellationToken::new(),
    )
    .await
    .unwrap_err();
    assert!(
        err.to_string().contains("OTEL_EXPORTER_OTLP_PROTOCOL"),
        "{err}"
    );
}

/// An app that crashes whenever the poison message reaches it: every request it is working
/// on then ends mid-answer, as when the process dies.
async fn crashing_app(listener: tokio::net::TcpListener) -> tokio::task::JoinHandle<()> {
    let crash = Arc::new(tokio::sync::watch::channel(0u64).0);
    let router = axum::Router::new()
        .route("/health", axum::routing::get(|| async { "ok" }))
        .route(
            "/messages",
            axum::routing::post(move |headers: HeaderMap| {
                let crash = Arc::clone(&crash);
                async move {
                    let id = headers
                        .get("cosmosq-message-id")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_owned();
                    let mut crashes = crash.subscribe();
                    let crashed = if id == "poison" {
                        crash.send_modify(|n| *n += 1);
                        true
                    } else {
                        // Work for a while; a crash meanwhile takes this request down too.
                        tokio::select! {
                            _ = crashes.changed() => true,
                            _ = tokio::time::sleep(Duration::from_millis(300)) => false,
                        }
                    };
                    if !crashed {
                        return StatusCode::OK.into_response();
                    }
                    let parts: Vec<Result<&'static str, std::io::Error>> = vec![
                        Ok(r#"{"status":"#),
                        Err(std::io::Error::other("the app crashed")),
                    ];
                    axum::body::Body::from_stream(futures::stream::iter(parts)).into_response()
                }
            }),
        );
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_that_crashes_the_app_is_counted_alone_never_its_neighbours() {
    let fixture = Fixture::new(1).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app_port = listener.local_addr().unwrap().port();
    crashing_app(listener).await;
    let mut batch: Vec<NewMessage> = (0..10)
        .map(|i| {
            NewMessage::json(json!({"n": i}))
                .with_id(format!("n{i}"))
                .with_partition_key(format!("k{i}"))
        })
        .collect();
    batch.insert(4, NewMessage::json(json!("x")).with_id("poison"));
    fixture.enqueue_all(batch).await;
    let sidecar = start_sidecar(&fixture, settings("g", app_port, free_port()));
    let group = fixture.group(GroupConfig::new("g"));
    eventually(
        "the poison message is dead-lettered and every neighbour completed",
        Duration::from_secs(60),
        || async {
            let mut done = state(&fixture, "g", "poison").await == Some(MessageState::DeadLettered);
            for i in 0..10 {
                let key = format!("k{i}");
                let s = group
                    .read_state(&key.into(), &format!("n{i}"))
                    .await
                    .unwrap();
                done &= s.is_some_and(|s| s.state.is_settled());
            }
            done
        },
    )
    .await;
    sidecar.stop.cancel();
    sidecar.task.await.unwrap().unwrap();
    for i in 0..10 {
        let key = format!("k{i}");
        let s = group
            .read_state(&key.into(), &format!("n{i}"))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            (s.state, s.attempts),
            (MessageState::Completed, 1),
            "n{i} was counted for the poison message's crashes: {s:?}"
        );
    }
    let dead = group.dead_letters(None).await.unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].message_id, "poison");
}

/// An app team's own producer: the official Python SDK, pointed at `cosmosq emulator`'s
/// endpoint with the well-known key as its emulator guide says, creates, reads, queries and
/// deletes items, then writes messages with keys of three JSON types into the queue. The
/// sidecar delivers each, its key's type kept, and a failed first attempt is retried under the
/// same key rather than dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_the_official_python_sdk_wrote_are_delivered_with_their_key_types() {
    cosmosq_tests::init_tracing();
    let python = cosmosq_tests::python_cosmos_sdk();
    let served = cosmosq_emulator::Emulator::serve_localhost(
        0,
        cosmosq_emulator::EmulatorOptions {
            partitions: 2,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let client = cosmosq_queue::ConnectionArgs::emulator(&served.endpoint)
        .connect()
        .await
        .unwrap();
    cosmosq_queue::provision(&client, &cosmosq_queue::QueueConfig::new("db", "q"))
        .await
        .unwrap();

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/sdk_interop.py");
    let key = served.emulator.key();
    let args = [script, &served.endpoint, key, "db", "q"].map(str::to_owned);
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(&python).args(args).output()
    })
    .await
    .unwrap()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the Python SDK failed against the emulator:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let steps: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let names: Vec<_> = steps.iter().map(|s| s["step"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "database",
            "container",
            "read",
            "query",
            "delete",
            "enqueued"
        ]
    );
    assert_eq!(steps[3]["count"], 2, "a cross-partition aggregate");

    let app = TestApp::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app_port = listener.local_addr().unwrap().port();
    // Each message fails its first attempt: the retry must find the message by its key.
    app.serve(
        listener,
        Arc::new(|_: &str, count: u32| {
            if count == 1 {
                Act::Answer(500, "")
            } else {
                Act::Answer(200, "")
            }
        }),
    )
    .await;
    let stop = CancellationToken::new();
    let sidecar = tokio::spawn(cosmosq_sidecar::run::run_with_client(
        settings("workers", app_port, free_port()),
        client.clone(),
        stop.clone(),
    ));
    let ids = ["py-string", "py-number", "py-bool"];
    app.wait_for("each Python message delivered twice", |a| {
        ids.iter().all(|id| a.deliveries(id) == [1, 2])
    })
    .await;
    let context = app.context.lock().unwrap().clone();
    assert_eq!(context["py-string"].key, "customer-7");
    assert_eq!(context["py-number"].key, "42");
    assert_eq!(context["py-bool"].key, "true");
    let queue = cosmosq_queue::Queue::open(&client, cosmosq_queue::QueueConfig::new("db", "q"))
        .await
        .unwrap();
    let group = queue.group(GroupConfig::new("workers")).unwrap();
    // The app has the second delivery; its completion is recorded once the answer is read.
    eventually(
        "each Python message completed under its own key",
        Duration::from_secs(30),
        || async {
            let mut completed = true;
            for (id, key) in [
                ("py-string", json!("customer-7")),
                ("py-number", json!(42)),
                ("py-bool", json!(true)),
            ] {
                let key = cosmosq_queue::MessageKey::from_json(key).unwrap();
                let state = group.read_state(&key, id).await.unwrap().map(|s| s.state);
                completed &= state == Some(MessageState::Completed);
            }
            completed
        },
    )
    .await;
    stop.cancel();
    sidecar.await.unwrap().unwrap();
    served.stop.cancel();
}

/// Ends the child process when the test ends, passed or not.
struct Killed(std::process::Child);

/// Starts an app process and hands over its standard output line by line; the process ends
/// with the returned guard.
fn spawn_app(
    command: &mut std::process::Command,
) -> (Killed, tokio::sync::mpsc::UnboundedReceiver<String>) {
    use std::io::BufRead;
    let mut child = command
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{command:?} runs: {e}"));
    let stdout = child.stdout.take().unwrap();
    let (lines, events) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = lines.send(line);
        }
    });
    (Killed(child), events)
}

/// The app's next printed line, as JSON, within a minute; `so_far` is shown if none comes.
async fn next_event(
    events: &mut tokio::sync::mpsc::UnboundedReceiver<String>,
    so_far: &impl std::fmt::Debug,
) -> serde_json::Value {
    let line = tokio::time::timeout(Duration::from_secs(60), events.recv())
        .await
        .unwrap_or_else(|_| panic!("the app printed only {so_far:#?}"))
        .unwrap_or_else(|| panic!("the app exited: {so_far:#?}"));
    serde_json::from_str(&line)
        .unwrap_or_else(|e| panic!("the app printed {line:?}, not a JSON line: {e}"))
}

/// `tests/node/dapr_sdk_app.cjs` on the official JavaScript SDK, subscribed to topic `q`,
/// with the sidecar's API at `api_port`.
fn node_sdk_app(
    app_port: u16,
    api_port: u16,
    mode: &[&str],
) -> (Killed, tokio::sync::mpsc::UnboundedReceiver<String>) {
    spawn_app(
        node("dapr_sdk_app.cjs", &[&app_port.to_string(), "q"])
            .args(mode)
            .env("DAPR_HTTP_PORT", api_port.to_string()),
    )
}

/// `node tests/node/<script> <args>`, with the JavaScript SDK the tools installed on its path.
fn node(script: &str, args: &[&str]) -> std::process::Command {
    let mut command = std::process::Command::new("node");
    command
        .arg(format!("{}/node/{script}", env!("CARGO_MANIFEST_DIR")))
        .args(args)
        .env("NODE_PATH", cosmosq_tests::dapr_js());
    command
}

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A Dapr pub/sub app written from Dapr's documentation alone (`tests/python/dapr_app.py`, a
/// Python process that knows nothing of cosmosq) runs unchanged next to the sidecar: its
/// programmatic subscription is discovered, each message goes to the route its CEL rules pick
/// (or the default), its `RETRY` and `DROP` answers settle as Dapr's do, and what it publishes
/// through `DAPR_HTTP_PORT` under its own pub/sub name is enqueued and routed in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmodified_dapr_app_subscribes_routes_and_publishes() {
    dapr_app(false).await;
}

/// The same app subscribed with `bulkSubscribe` (5 entries, 300 ms): messages reach it several
/// to a request, never more than it asked, and its per-entry statuses settle each on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmodified_dapr_app_takes_messages_in_bulk() {
    dapr_app(true).await;
}

async fn dapr_app(bulk: bool) {
    let fixture = Fixture::new(2).await;
    let (app_port, api_port) = (free_port(), free_port());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/dapr_app.py");
    let mode = if bulk { "bulk" } else { "single" };
    // The bulk run also uses Dapr's API tokens, both ways, as a pod with
    // `spec.app.apiTokenSecret` has them.
    let (api_token, app_token) = ("dapr-side-s3cret", "app-side-s3cret");
    let mut command = std::process::Command::new("python3");
    command
        .args([script, &app_port.to_string(), "q", mode])
        .env("DAPR_HTTP_PORT", api_port.to_string());
    if bulk {
        command
            .env("DAPR_API_TOKEN", api_token)
            .env("APP_API_TOKEN", app_token);
    }
    let (_app, mut events) = spawn_app(&mut command);
    let mut settings = settings("dapr", app_port, api_port);
    if bulk {
        settings.api_token = Some(api_token.parse().unwrap());
        settings.app_api_token = Some(app_token.parse().unwrap());
    }
    let sidecar = start_sidecar(&fixture, settings);

    let messages = [
        ("widget", json!({"kind": "widget"})),
        ("urgent", json!({"priority": 9})),
        ("plain", json!({"priority": 1})),
        ("flaky", json!({"flaky": true})),
        ("publisher", json!({"publish": true})),
        ("dropped", json!({"drop": true})),
        ("bulk-publisher", json!({"bulk": true})),
    ];
    for (id, data) in &messages {
        fixture
            .queue
            .enqueue(NewMessage::json(data.clone()).with_id(*id))
            .await
            .unwrap();
    }
    // Eleven events: one per message, the flaky one twice, the one the app published and the
    // two it published in bulk.
    let mut seen: Vec<serde_json::Value> = Vec::new();
    while seen.len() < 11 {
        let line = tokio::time::timeout(Duration::from_secs(60), events.recv())
            .await
            .unwrap_or_else(|_| panic!("the app got only {seen:?}"))
            .expect("the app is running");
        seen.push(serde_json::from_str(&line).unwrap());
    }
    let routes = |id: &str| -> Vec<&str> {
        seen.iter()
            .filter(|e| e["id"] == id)
            .map(|e| e["route"].as_str().unwrap())
            .collect()
    };
    assert_eq!(routes("widget"), ["/widgets"], "rule 1");
    assert_eq!(routes("urgent"), ["/urgent"], "rule 2");
    assert_eq!(routes("plain"), ["/orders"], "the default");
    assert_eq!(
        routes("flaky"),
        ["/orders", "/orders"],
        "RETRY delivers again"
    );
    assert_eq!(routes("publisher"), ["/orders"]);
    assert_eq!(routes("dropped"), ["/orders"]);
    let published = seen
        .iter()
        .find(|e| e["data"]["from"] == "app")
        .expect("what the app published came back");
    assert_eq!(published["route"], "/widgets", "routed by its own rules");
    let bulk_widget = seen
        .iter()
        .find(|e| e["data"]["from"] == "bulk")
        .expect("the bulk JSON entry");
    assert_eq!(bulk_widget["route"], "/widgets");
    let bulk_text = seen
        .iter()
        .find(|e| e["data"] == "bulk text")
        .expect("the bulk text entry, its data a string as Dapr delivers text");
    assert_eq!(
        bulk_text["route"], "/orders",
        "no rule matches a string's fields"
    );
    for event in &seen {
        assert_eq!(
            (&event["pubsubname"], &event["topic"]),
            (&json!("pubsub"), &json!("q")),
            "the names the app subscribed with: {event}"
        );
    }
    let batches: Vec<u64> = seen.iter().map(|e| e["batch"].as_u64().unwrap()).collect();
    if bulk {
        assert!(
            batches.iter().any(|&n| n > 1) && batches.iter().all(|&n| n <= 5),
            "several to a request, at most maxMessagesCount: {batches:?}"
        );
    } else {
        assert!(batches.iter().all(|&n| n == 1), "{batches:?}");
    }

    let ids: Vec<String> = messages
        .iter()
        .map(|(id, _)| (*id).to_owned())
        .chain([published, bulk_widget, bulk_text].map(|e| e["id"].as_str().unwrap().to_owned()))
        .collect();
    eventually("every message settled", Duration::from_secs(30), || async {
        let mut settled = true;
        for id in &ids {
            let want = if id == "dropped" {
                MessageState::DeadLettered
            } else {
                MessageState::Completed
            };
            let now = state(&fixture, "dapr", id).await;
            if now != Some(want) {
                eprintln!("{id}: {now:?}, want {want:?}");
                settled = false;
            }
        }
        settled
    })
    .await;
    sidecar.stop.cancel();
    sidecar.task.await.unwrap().unwrap();
}

/// An app on the official Dapr JavaScript SDK (`@dapr/dapr` from npm, unchanged, in
/// `tests/node/dapr_sdk_app.cjs`): its `DaprServer` and `DaprClient` start (they wait on
/// `GET /v1.0/metadata`), the metadata names the app, its pub/sub and its subscription, and
/// what it publishes (`publish`, and `publishBulk`, whose entries the SDK spells `entryID`)
/// comes back to its subscriber with what the queue already held, each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_app_on_the_official_dapr_javascript_sdk_starts_subscribes_and_publishes() {
    javascript_sdk_app(false).await;
}

/// The same app with the SDK's gRPC protocol: its `DaprServer` is a gRPC app the sidecar calls
/// through Dapr's `AppCallback`, its `DaprClient` calls Dapr's gRPC API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_app_on_the_javascript_sdk_over_grpc_starts_subscribes_and_publishes() {
    javascript_sdk_app(true).await;
}

async fn javascript_sdk_app(grpc: bool) {
    let fixture = Fixture::new(1).await;
    let (app_port, api_port, grpc_port) = (free_port(), free_port(), free_port());
    let (_app, mut events) = spawn_app(
        node("dapr_sdk_app.cjs", &[&app_port.to_string(), "q"])
            .args(grpc.then_some("grpc"))
            .env("DAPR_HTTP_PORT", api_port.to_string())
            .env("DAPR_GRPC_PORT", grpc_port.to_string()),
    );
    fixture
        .queue
        .enqueue(NewMessage::json(json!({"from": "rust"})).with_id("from-rust"))
        .await
        .unwrap();
    let protocol = if grpc {
        cosmosq_sidecar::settings::AppProtocol::Grpc
    } else {
        cosmosq_sidecar::settings::AppProtocol::Http
    };
    let sidecar = start_sidecar(
        &fixture,
        SidecarSettings {
            app_protocol: protocol,
            grpc_listen: format!("127.0.0.1:{grpc_port}"),
            // Over gRPC, the other delivery mode, in order per key.
            mode: if grpc {
                DeliveryMode::Stream
            } else {
                DeliveryMode::Exclusive
            },
            ordered: grpc,
            ..settings("orders-app", app_port, api_port)
        },
    );

    let mut steps: Vec<serde_json::Value> = Vec::new();
    let received = |steps: &[serde_json::Value]| {
        steps
            .iter()
            .filter(|s| s["step"] == "received")
            .map(|s| s["data"].clone())
            .collect::<Vec<_>>()
    };
    while received(&steps).len() < 4 || !steps.iter().any(|s| s["step"] == "metadata") {
        let step = next_event(&mut events, &steps).await;
        assert_ne!(step["step"], "failed", "{step}");
        steps.push(step);
    }
    let metadata = &steps
        .iter()
        .find(|s| s["step"] == "metadata")
        .expect("the client read the metadata")["metadata"];
    assert_eq!(metadata["id"], "orders-app", "{metadata}");
    let components = metadata["components"].as_array().expect("components");
    assert!(
        components
            .iter()
            .any(|c| c["name"] == "pubsub" && c["type"] == "pubsub.cosmosq"),
        "{metadata}"
    );
    // The SDK's gRPC client returns no subscriptions from the metadata (its HTTP one does).
    if !grpc {
        let subscriptions = metadata["subscriptions"].as_array().expect("subscriptions");
        assert_eq!(subscriptions.len(), 1, "{metadata}");
        assert_eq!(
            (&subscriptions[0]["pubsubname"], &subscriptions[0]["topic"]),
            (&json!("pubsub"), &json!("q"))
        );
    }
    let bulk = steps
        .iter()
        .find(|s| s["step"] == "published in bulk")
        .unwrap();
    // No failed entry reported (the SDK reads a failure answer's entries by `entryID`, so this
    // alone would miss a refusal: the events received below are what prove the bulk).
    assert_eq!(bulk["failed"], 0, "{bulk}");
    assert_eq!(
        metadata["extended"]["team"], "payments",
        "the attribute the app set: {metadata}"
    );

    let group = fixture.group(GroupConfig::new("orders-app"));
    eventually("every message settled", Duration::from_secs(30), || async {
        group.estimate().await.unwrap().backlog() == 0
            && state(&fixture, "orders-app", "from-rust").await == Some(MessageState::Completed)
    })
    .await;
    while let Ok(line) = events.try_recv() {
        steps.push(serde_json::from_str(&line).expect("a JSON line"));
    }
    let mut got: Vec<String> = received(&steps).iter().map(|d| d.to_string()).collect();
    got.sort();
    assert_eq!(
        got,
        [
            r#""node bulk text""#,
            r#"{"from":"node"}"#,
            r#"{"from":"node-bulk"}"#,
            r#"{"from":"rust"}"#
        ],
        "each message once, its data as published"
    );
    sidecar.stop.cancel();
    sidecar.task.await.unwrap().unwrap();
}

/// A two-stage pipeline (orders → invoices) of apps on Dapr's JavaScript SDK, each unchanged
/// next to its own sidecar (`tests/node/dapr_pipeline_stage.cjs`): the billing group, granted
/// the invoices queue (`--publish-to`, as the operator writes `spec.publishTo`), publishes one
/// invoice per order as a CloudEvent; the mailer group consumes the invoices queue. Every order
/// becomes exactly one invoice, also the one the first stage published twice (a retried
/// delivery: the same event id is enqueued once), each invoice carries its order's trace, and
/// a topic the group was not granted is refused with Dapr's `ERR_PUBSUB_FORBIDDEN`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_of_sdk_apps_publishes_each_order_once_to_the_next_queue() {
    let fixture = Fixture::new(1).await;
    cosmosq_queue::provision(
        &fixture.client,
        &cosmosq_queue::QueueConfig::new("db", "invoices"),
    )
    .await
    .unwrap();
    let stage = |app_port: u16, api_port: u16, input: &str, output: &str| {
        spawn_app(
            node(
                "dapr_pipeline_stage.cjs",
                &[&app_port.to_string(), input, output],
            )
            .env("DAPR_HTTP_PORT", api_port.to_string()),
        )
    };
    let (billing_app, billing_api, mailer_app, mailer_api) =
        (free_port(), free_port(), free_port(), free_port());
    let (_billing, mut billing_events) = stage(billing_app, billing_api, "q", "invoices");
    let (_mailer, mut mailer_events) = stage(mailer_app, mailer_api, "invoices", "-");

    let trace = |n: u32| format!("00-{:032x}-{:016x}-01", 0xab00 + n, 0xcd00 + n);
    for n in 1..=3 {
        let context = cosmosq_queue::TraceContext::parse(&trace(n), None).unwrap();
        fixture
            .queue
            .enqueue(
                NewMessage::json(json!({"order": n}))
                    .with_id(format!("order-{n}"))
                    .inherit_trace(Some(&context)),
            )
            .await
            .unwrap();
    }
    let mut billing = settings("billing", billing_app, billing_api);
    billing.publish_to = PublishTargets(vec![PublishTarget {
        database: "db".into(),
        queue: "invoices".into(),
        endpoint: billing.connection.endpoint.clone(),
        auth: billing.connection.auth,
        key_file: None,
    }]);
    let mailer = SidecarSettings {
        queue: "invoices".into(),
        ..settings("mailer", mailer_app, mailer_api)
    };
    let sidecars = [
        start_sidecar(&fixture, billing),
        start_sidecar(&fixture, mailer),
    ];

    // The first stage: refused a topic it was not granted; order 2 published twice.
    let mut billed: Vec<serde_json::Value> = Vec::new();
    while billed.iter().filter(|s| s["step"] == "published").count() < 4
        || !billed.iter().any(|s| s["step"] == "forbidden")
    {
        let step = next_event(&mut billing_events, &billed).await;
        assert!(
            !["failed", "publish failed"].contains(&step["step"].as_str().unwrap_or_default()),
            "{step}"
        );
        billed.push(step);
    }
    let forbidden = billed.iter().find(|s| s["step"] == "forbidden").unwrap();
    let error = forbidden["error"].as_str().expect("refused");
    assert!(
        error.contains("ERR_PUBSUB_FORBIDDEN") && error.contains("403"),
        "{forbidden}"
    );
    assert!(
        error.contains("'q', 'invoices'"),
        "names what is granted: {error}"
    );

    // The second stage: each order once, with its data and its trace.
    let mut mailed: Vec<serde_json::Value> = Vec::new();
    while mailed.len() < 3 {
        let step = next_event(&mut mailer_events, &mailed).await;
        assert_ne!(step["step"], "failed", "{step}");
        if step["step"] == "received" {
            mailed.push(step);
        }
    }
    let invoices_group = cosmosq_queue::Queue::open(
        &fixture.client,
        cosmosq_queue::QueueConfig::new("db", "invoices"),
    )
    .await
    .unwrap()
    .group(GroupConfig::new("mailer"))
    .unwrap();
    eventually("both stages settled", Duration::from_secs(30), || async {
        invoices_group.estimate().await.unwrap().backlog() == 0
            && fixture
                .group(GroupConfig::new("billing"))
                .estimate()
                .await
                .unwrap()
                .backlog()
                == 0
    })
    .await;
    while let Ok(line) = mailer_events.try_recv() {
        let step: serde_json::Value = serde_json::from_str(&line).unwrap();
        if step["step"] == "received" {
            mailed.push(step);
        }
    }
    mailed.sort_by_key(|s| s["data"]["order"].as_u64());
    let got: Vec<(serde_json::Value, String)> = mailed
        .iter()
        .map(|s| {
            let traceparent = s["traceparent"].as_str().unwrap_or_default();
            // The trace id: the same trace, whichever span the hops made.
            (
                s["data"].clone(),
                traceparent.split('-').nth(1).unwrap_or_default().to_owned(),
            )
        })
        .collect();
    let want: Vec<(serde_json::Value, String)> = (1..=3u32)
        .map(|n| {
            (
                json!({"order": n, "q": "done"}),
                format!("{:032x}", 0xab00 + n),
            )
        })
        .collect();
    assert_eq!(got, want, "each order invoiced once, with its trace");
    for sidecar in sidecars {
        sidecar.stop.cancel();
        sidecar.task.await.unwrap().unwrap();
    }
}

/// A publisher on Dapr's Python SDK (`tests/python/dapr_grpc_client.py`: `DaprClient`, which
/// speaks Dapr's gRPC API) and a subscriber on Dapr's JavaScript SDK (`DaprServer` over HTTP),
/// both unchanged, next to one sidecar: what Python publishes, singly (with a TTL and a trace
/// context in its gRPC metadata) and in bulk, reaches the JavaScript handler once each, with
/// its data and its trace; the metadata call sees the pub/sub and the attribute it set; a topic
/// not granted is refused with gRPC's `PERMISSION_DENIED` and Dapr's reason
/// `DAPR_PUBSUB_FORBIDDEN`; a building block the sidecar does not serve is `UNIMPLEMENTED`,
/// named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_python_sdk_publishes_over_grpc_the_javascript_sdk_receives() {
    let fixture = Fixture::new(1).await;
    let (app_port, api_port, grpc_port) = (free_port(), free_port(), free_port());
    let (_subscriber, mut received) = node_sdk_app(app_port, api_port, &["subscribe"]);
    let sidecar = start_sidecar(
        &fixture,
        SidecarSettings {
            grpc_listen: format!("127.0.0.1:{grpc_port}"),
            ..settings("orders-app", app_port, api_port)
        },
    );
    // The subscriber is up (and subscribed) before the publisher starts.
    let started = next_event(&mut received, &"nothing").await;
    assert_eq!(started["step"], "server started", "{started}");

    let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/dapr_grpc_client.py");
    let (_publisher, mut published) = spawn_app(
        std::process::Command::new(cosmosq_tests::python_with("dapr.clients"))
            .args([script, "q", traceparent])
            .env("DAPR_HTTP_PORT", api_port.to_string())
            .env("DAPR_GRPC_PORT", grpc_port.to_string()),
    );
    let mut steps: Vec<serde_json::Value> = Vec::new();
    while !steps.iter().any(|s| s["step"] == "state") {
        steps.push(next_event(&mut published, &steps).await);
    }
    let step = |name: &str| steps.iter().find(|s| s["step"] == name).unwrap().clone();
    assert_eq!(step("published in bulk")["failed"], 0);
    let metadata = step("metadata");
    assert_eq!(metadata["id"], "orders-app", "{metadata}");
    assert!(
        metadata["components"]
            .as_array()
            .unwrap()
            .contains(&json!({"name": "pubsub", "type": "pubsub.cosmosq"})),
        "{metadata}"
    );
    assert_eq!(metadata["extended"]["team"], "payments", "{metadata}");
    let forbidden = &step("forbidden")["error"];
    assert_eq!(
        (&forbidden["code"], &forbidden["reason"]),
        (&json!("PERMISSION_DENIED"), &json!("DAPR_PUBSUB_FORBIDDEN")),
        "{forbidden}"
    );
    let state = &step("state")["error"];
    assert_eq!(state["code"], "UNIMPLEMENTED", "{state}");
    assert!(
        state["message"]
            .as_str()
            .unwrap()
            .contains("dapr.proto.runtime.v1.Dapr/SaveState is not served"),
        "{state}"
    );

    let mut events: Vec<serde_json::Value> = Vec::new();
    while events.len() < 3 {
        let event = next_event(&mut received, &events).await;
        assert_ne!(event["step"], "failed", "{event}");
        events.push(event);
    }
    let group = fixture.group(GroupConfig::new("orders-app"));
    eventually("every message settled", Duration::from_secs(30), || async {
        group.estimate().await.unwrap().backlog() == 0
    })
    .await;
    while let Ok(line) = received.try_recv() {
        events.push(serde_json::from_str(&line).expect("a JSON line"));
    }
    let mut data: Vec<String> = events.iter().map(|e| e["data"].to_string()).collect();
    data.sort();
    assert_eq!(
        data,
        [
            r#"{"from":"python"}"#,
            r#"{"from":"python-bulk","n":1}"#,
            r#"{"from":"python-bulk","n":2}"#
        ],
        "each once, as published"
    );
    let single = events
        .iter()
        .find(|e| e["data"]["from"] == "python")
        .unwrap();
    let trace_id = |t: &serde_json::Value| {
        t.as_str()
            .unwrap_or_default()
            .split('-')
            .nth(1)
            .map(str::to_owned)
    };
    assert_eq!(
        trace_id(&single["traceparent"]),
        trace_id(&json!(traceparent)),
        "the publisher's trace: {single}"
    );
    sidecar.stop.cancel();
    sidecar.task.await.unwrap().unwrap();
}

/// A gRPC app on Dapr's Python SDK (`dapr-ext-grpc` from PyPI, unchanged:
/// `tests/python/dapr_grpc_app.py`), called through its `AppCallback` (`--app-protocol
/// grpc`): its subscriptions are listed, a routing rule sends widgets to their own handler and
/// the rest to the topic's, each message arrives with its trace context, `retry` delivers
/// again, `drop` dead-letters with the reason, and everything else is settled once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_app_on_the_python_sdk_is_called_through_its_app_callback() {
    grpc_python_app(false).await;
}

/// The same app with a bulk subscription declared in the group: its messages come through
/// `OnBulkTopicEvent`, each entry settled by its own status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_app_s_bulk_subscription_is_called_through_on_bulk_topic_event() {
    grpc_python_app(true).await;
}

async fn grpc_python_app(bulk: bool) {
    let fixture = Fixture::new(1).await;
    let (app_port, api_port) = (free_port(), free_port());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/dapr_grpc_app.py");
    let (_app, mut events) = spawn_app(
        std::process::Command::new(cosmosq_tests::python_with("dapr.ext.grpc")).args([
            script,
            &app_port.to_string(),
            "q",
        ]),
    );
    let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let context = cosmosq_queue::TraceContext::parse(traceparent, None).unwrap();
    for (id, kind) in [
        ("w", "widget"),
        ("g", "gadget"),
        ("f", "flaky"),
        ("p", "poison"),
    ] {
        fixture
            .queue
            .enqueue(
                NewMessage::json(json!({"kind": kind}))
                    .with_id(id)
                    .with_metadata("tenant", "t1")
                    .inherit_trace(Some(&context)),
            )
            .await
            .unwrap();
    }
    let sidecar = start_sidecar(
        &fixture,
        SidecarSettings {
            app_protocol: cosmosq_sidecar::settings::AppProtocol::Grpc,
            // In bulk, on the other exclusive write path (a state document per delivery).
            exclusive_writes: if bulk {
                ExclusiveWrites::Claims
            } else {
                ExclusiveWrites::Lease
            },
            // Declared, as `app.subscription` with `bulk` writes it (the SDK cannot ask).
            app_subscription: bulk.then(|| {
                json!({"pubsubname": "pubsub", "topic": "q", "routes": {"default": "/orders"},
                       "bulkSubscribe": {"enabled": true, "maxMessagesCount": 10,
                                         "maxAwaitDurationMs": 200}})
                .to_string()
            }),
            ..settings("grpc-app", app_port, api_port)
        },
    );
    let mut received: Vec<serde_json::Value> = Vec::new();
    // w, g, p once; f twice (retried).
    while received.iter().filter(|e| e["step"] == "received").count() < 5 {
        received.push(next_event(&mut events, &received).await);
    }
    let group = fixture.group(GroupConfig::new("grpc-app"));
    eventually("every message settled", Duration::from_secs(30), || async {
        group.estimate().await.unwrap().backlog() == 0
            && state(&fixture, "grpc-app", "f").await == Some(MessageState::Completed)
    })
    .await;
    let mut handled: Vec<(String, String)> = received
        .iter()
        .filter(|e| e["step"] == "received")
        .map(|e| {
            assert_eq!(e["traceparent"], traceparent, "{e}");
            if bulk {
                // An entry of a bulk call: its own metadata, no call of its own.
                assert_eq!(e["tenant"], "t1", "{e}");
                assert!(e["metadata_traceparent"].is_null(), "{e}");
            } else {
                assert!(e["tenant"].is_null(), "{e}");
                assert_eq!(e["metadata_traceparent"], traceparent, "{e}");
            }
            (
                e["id"].as_str().unwrap().to_owned(),
                e["handler"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    handled.sort();
    // The declared subscription has no rule: widgets go to the topic's handler too.
    let widgets = if bulk { "orders" } else { "widgets" };
    assert_eq!(
        handled,
        [
            ("f".to_owned(), "orders".to_owned()),
            ("f".to_owned(), "orders".to_owned()),
            ("g".to_owned(), "orders".to_owned()),
            ("p".to_owned(), "orders".to_owned()),
            ("w".to_owned(), widgets.to_owned()),
        ]
    );
    let dead = group.dead_letters(None).await.unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].message_id, "p");
    assert!(
        format!("{:?}", dead[0]).contains("the app answered DROP"),
        "{:?}",
        dead[0]
    );
    sidecar.stop.cancel();
    sidecar.task.await.unwrap().unwrap();
}

/// An app on Dapr's Python SDK (`dapr-ext-fastapi` from PyPI, unchanged, in
/// `tests/python/dapr_fastapi_app.py`): `DaprApp.subscribe` is discovered, every message reaches
/// its handler as a CloudEvent with the pub/sub and topic it subscribed to (an id repeated
/// under a number key included), and the handler's exception (FastAPI's 500) is retried as
/// Dapr retries it, until it succeeds, each message settled once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_app_on_dapr_s_python_fastapi_extension_subscribes_and_is_retried() {
    let fixture = Fixture::new(2).await;
    let (app_port, api_port) = (free_port(), free_port());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/dapr_fastapi_app.py");
    let python = cosmosq_tests::python_with("dapr.ext.fastapi");
    let (_app, mut events) = spawn_app(
        std::process::Command::new(python)
            .args([script, &app_port.to_string(), "q"])
            .env("DAPR_HTTP_PORT", api_port.to_string()),
    );
    let messages = [
        NewMessage::json(json!({"n": 1})).with_id("one"),
        NewMessage::json(json!({"n": 2}))
            .with_id("one")
            .with_partition_key(7_i64),
        NewMessage::json(json!({"flaky": true})).with_id("flaky"),
        NewMessage::json(json!("text")).with_id("three"),
    ];
    fixture.enqueue_all(messages.into()).await;
    let sidecar = start_sidecar(&fixture, settings("fastapi-app", app_port, api_port));

    let mut handled: Vec<serde_json::Value> = Vec::new();
    let mut failed_once = 0;
    while handled.len() < 4 {
        let event = next_event(&mut events, &handled).await;
        if event["step"] == "failed once" {
            failed_once += 1;
            continue;
        }
        assert_eq!(
            (&event["pubsubname"], &event["topic"]),
            (&json!("pubsub"), &json!("q")),
            "{event}"
        );
        handled.push(event);
    }
    assert_eq!(failed_once, 1, "the flaky message failed once");
    let mut data: Vec<String> = handled.iter().map(|e| e["data"].to_string()).collect();
    data.sort();
    assert_eq!(
        data,
        [r#""text""#, r#"{"flaky":true}"#, r#"{"n":1}"#, r#"{"n":2}"#],
        "each message once (the same id under two keys is two messages)"
    );
    let group = fixture.group(GroupConfig::new("fastapi-app"));
    eventually("every message settled", Duration::from_secs(30), || async {
        group.estimate().await.unwrap().backlog() == 0
            && state(&fixture, "fastapi-app", "flaky").await == Some(MessageState::Completed)
            && state(&fixture, "fastapi-app", "three").await == Some(MessageState::Completed)
    })
    .await;
    sidecar.stop.cancel();
    sidecar.task.await.unwrap().unwrap();
}

/// The JavaScript SDK's `subscribeWithOptions` with a routing rule (CEL over the CloudEvent)
/// and a default, each route with its own `subscribeToRoute` handler: a widget the SDK's
/// client publishes reaches the widgets handler, a gadget and a message another producer
/// enqueued the default's, each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_javascript_sdk_s_routing_rules_route_what_it_publishes() {
    let fixture = Fixture::new(1).await;
    let (app_port, api_port) = (free_port(), free_port());
    let (_app, mut events) = node_sdk_app(app_port, api_port, &["rules"]);
    fixture
        .queue
        .enqueue(NewMessage::json(json!({"kind": "rust"})).with_id("from-rust"))
        .await
        .unwrap();
    let sidecar = start_sidecar(&fixture, settings("routed-app", app_port, api_port));

    // (route, the data's kind) of each event a handler received.
    let mut received: Vec<(String, String)> = Vec::new();
    let record = |step: &serde_json::Value, received: &mut Vec<(String, String)>| {
        if step["step"] == "received" {
            let route = step["route"].as_str().unwrap().to_owned();
            received.push((route, step["data"]["kind"].as_str().unwrap().to_owned()));
        }
    };
    let mut published = false;
    while received.len() < 3 || !published {
        let step = next_event(&mut events, &received).await;
        assert_ne!(step["step"], "failed", "{step}");
        published |= step["step"] == "published";
        record(&step, &mut received);
    }
    let group = fixture.group(GroupConfig::new("routed-app"));
    eventually("every message settled", Duration::from_secs(30), || async {
        group.estimate().await.unwrap().backlog() == 0
            && state(&fixture, "routed-app", "from-rust").await == Some(MessageState::Completed)
    })
    .await;
    while let Ok(line) = events.try_recv() {
        record(
            &serde_json::from_str(&line).expect("a JSON line"),
            &mut received,
        );
    }
    received.sort();
    assert_eq!(
        received,
        [
            ("others".to_owned(), "gadget".to_owned()),
            ("others".to_owned(), "rust".to_owned()),
            ("widgets".to_owned(), "widget".to_owned()),
        ],
        "each message once, on the route its rule chose"
    );
    sidecar.stop.cancel();
    sidecar.task.await.unwrap().unwrap();
}

/// An app whose subscription cannot be used (a rule that is not CEL) stops the sidecar with
/// the rule named, before any lease is taken: nothing goes to a route the app did not mean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_dapr_subscription_stops_the_sidecar_with_the_rule_named() {
    let fixture = Fixture::new(1).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app_port = listener.local_addr().unwrap().port();
    let router = axum::Router::new().route(
        "/dapr/subscribe",
        axum::routing::get(|| async {
            axum::Json(json!([{"pubsubname": "pubsub", "topic": "q", "routes": {
                "rules": [{"match": "event.data.kind ==", "path": "/x"}]}}]))
        }),
    );
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    fixture
        .queue
        .enqueue(NewMessage::json(json!({"kind": "x"})).with_id("kept"))
        .await
        .unwrap();
    let sidecar = start_sidecar(&fixture, settings("broken", app_port, free_port()));
    let error = tokio::time::timeout(Duration::from_secs(30), sidecar.task)
        .await
        .expect("the sidecar stops")
        .unwrap()
        .expect_err("a refused subscription")
        .to_string();
    assert!(
        error.contains("/dapr/subscribe") && error.contains("event.data.kind =="),
        "{error}"
    );
    assert_eq!(
        state(&fixture, "broken", "kept").await,
        None,
        "never delivered"
    );
}

/// Runs `tests/python/pull_worker.py` with `args` to its end; its JSON lines.
async fn pull_worker(args: Vec<String>) -> (bool, Vec<serde_json::Value>) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/pull_worker.py");
    let run = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3")
            .arg(script)
            .args(args)
            .output()
            .expect("python3 runs the worker")
    });
    let out = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the worker ends")
        .unwrap();
    let lines = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    if !out.status.success() {
        eprintln!("worker stderr: {}", String::from_utf8_lossy(&out.stderr));
    }
    (out.status.success(), lines)
}

/// A pull group (`--app-mode pull`) served to a worker process that only pulls: a first
/// worker takes a batch and crashes without settling it, and its messages come back to the
/// next worker after the visibility timeout, their delivery count one higher; that worker
/// receives in batches with long polling, completes in a batch, renews, abandons and
/// dead-letters, and every message ends as it decided.
/// In each delivery mode and exclusive write path, and in an ordered group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_worker_receives_settles_in_batches_and_a_crashed_ones_messages_come_back() {
    for (group, choose) in [
        ("pullers", (|_| {}) as fn(&mut SidecarSettings)),
        ("stream-pullers", |s| s.mode = DeliveryMode::Stream),
        ("claims-pullers", |s| {
            s.exclusive_writes = ExclusiveWrites::Claims
        }),
        ("ordered-pullers", |s| s.ordered = true),
    ] {
        pull_group(group, choose).await;
    }
}

async fn pull_group(group: &str, choose: fn(&mut SidecarSettings)) {
    let fixture = Fixture::new(2).await;
    let api_port = free_port();
    // No app listens: a pull group does not wait for one.
    let mut config = SidecarSettings {
        app_mode: AppMode::Pull,
        app_port: None, // workers come to the sidecar: no app port of theirs
        ..settings(group, free_port(), api_port)
    };
    choose(&mut config);
    let sidecar = start_sidecar(&fixture, config);
    let fate = |i: usize| match i {
        3 => "abandon-once",
        7 => "dead",
        _ => "ok",
    };
    let batch = (0..20)
        .map(|i| NewMessage::json(json!({"fate": fate(i)})).with_id(format!("m{i:02}")))
        .collect();
    for result in fixture.queue.enqueue_batch(batch).await {
        result.unwrap();
    }
    let api = sidecar.api.clone();
    let http = cosmosq_queue::cosmos::tls::http_client_builder()
        .build()
        .expect("an HTTP client");
    eventually("the sidecar is ready", Duration::from_secs(10), || async {
        http.get(format!("{api}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
    })
    .await;

    let (clean, crashed) = pull_worker(vec![api.clone(), "crash".into()]).await;
    assert!(!clean, "{group}: the first worker died");
    assert!(!crashed.is_empty(), "it had received a batch");
    assert!(
        crashed.iter().all(|m| m["deliveryCount"] == 1),
        "{crashed:?}"
    );

    let (clean, worked) = pull_worker(vec![api.clone(), "work".into(), "20".into()]).await;
    assert!(clean, "{group}: {worked:?}");
    let counts = |id: &str| -> Vec<(u64, String)> {
        worked
            .iter()
            .filter(|m| m["id"] == id)
            .map(|m| {
                (
                    m["deliveryCount"].as_u64().unwrap(),
                    m["action"].as_str().unwrap().to_owned(),
                )
            })
            .collect()
    };
    for m in &crashed {
        let id = m["id"].as_str().unwrap();
        let (count, _) = counts(id)[0].clone();
        assert_eq!(
            count, 2,
            "{group} {id}: back after the visibility timeout, count + 1"
        );
    }
    let abandoned = counts("m03");
    assert_eq!(abandoned.len(), 2, "{abandoned:?}");
    assert_eq!(abandoned[0].1, "abandon");
    assert_eq!(
        abandoned[1].0,
        abandoned[0].0 + 1,
        "delivered again after abandon"
    );
    assert_eq!(counts("m07").last().unwrap().1, "dead-letter");

    eventually(
        "every message as the worker decided",
        Duration::from_secs(30),
        || async {
            let mut settled = true;
            for i in 0..20 {
                let want = if i == 7 {
                    MessageState::DeadLettered
                } else {
                    MessageState::Completed
                };
                settled &= state(&fixture, group, &format!("m{i:02}")).await == Some(want);
            }
            settled
        },
    )
    .await;
    // A lock that is no longer held is refused, not settled twice.
    let gone = http
        .post(format!("{api}/v1/messages/not-a-token/complete"))
        .send()
        .await
        .unwrap();
    assert_eq!(gone.status(), 410);
    sidecar.stop.cancel();
    sidecar.task.await.unwrap().unwrap();
}

/// Dapr's API tokens, both ways: the app must present `DAPR_API_TOKEN` to the sidecar's API
/// (health stays open), and every call the sidecar makes to the app carries `APP_API_TOKEN`;
/// neither shows in the settings' debug output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_and_the_app_are_told_apart_by_dapr_api_tokens() {
    let fixture = Fixture::new(1).await;
    let presented: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let changed = Arc::new(Notify::new());
    let app = {
        let presented = Arc::clone(&presented);
        let changed = Arc::clone(&changed);
        axum::Router::new().fallback(
            move |method: axum::http::Method, uri: axum::http::Uri, headers: HeaderMap| {
                let presented = Arc::clone(&presented);
                let changed = Arc::clone(&changed);
                async move {
                    let token = headers
                        .get("dapr-api-token")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("<none>")
                        .to_owned();
                    presented
                        .lock()
                        .unwrap()
                        .push((format!("{method} {}", uri.path()), token));
                    changed.notify_waiters();
                    if uri.path() == "/messages" {
                        StatusCode::OK
                    } else {
                        StatusCode::NOT_FOUND
                    }
                }
            },
        )
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app_port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let grpc_port = free_port();
    let config = SidecarSettings {
        api_token: Some("api-s3cret".parse().unwrap()),
        app_api_token: Some("app-s3cret".parse().unwrap()),
        app_health_path: Some("/messages".into()),
        grpc_listen: format!("127.0.0.1:{grpc_port}"),
        ..settings("g", app_port, free_port())
    };
    let said = format!("{config:?}");
    assert!(!said.contains("s3cret"), "{said}");
    // A token that cannot travel in a header (a wrapped `openssl rand -base64` output) is
    // refused by name, never by value.
    let wrapped = SidecarSettings {
        api_token: Some(Token::from_str("s3cret\nwrapped").unwrap()),
        ..settings("g", app_port, free_port())
    };
    let refused = wrapped.validate().unwrap_err().to_string();
    assert!(
        refused.contains("--api-token (COSMOSQ_API_TOKEN)") && !refused.contains("s3cret"),
        "{refused}"
    );
    let sidecar = start_sidecar(&fixture, config);
    let http = cosmosq_queue::cosmos::tls::http_client_builder()
        .build()
        .expect("an HTTP client");
    let enqueue = |token: Option<&'static str>| {
        let mut request = http
            .post(format!("{}/v1/enqueue", sidecar.api))
            .header("content-type", "application/json")
            .body(json!({"id": "one", "body": {"n": 1}}).to_string());
        if let Some(token) = token {
            request = request.header("dapr-api-token", token);
        }
        request.send()
    };
    eventually("the API to listen", Duration::from_secs(10), || async {
        http.get(format!("{}/v1.0/healthz", sidecar.api))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
    })
    .await;
    for refused in [None, Some("api-s3cre"), Some("app-s3cret")] {
        let answer = enqueue(refused).await.unwrap();
        assert_eq!(answer.status(), 401, "{refused:?}");
    }
    let answer = enqueue(Some("api-s3cret")).await.unwrap();
    assert!(answer.status().is_success(), "{}", answer.status());
    // Dapr's metadata API is behind the token too: it names the app and takes its attributes.
    let metadata = format!("{}/v1.0/metadata", sidecar.api);
    let answer = http.get(&metadata).send().await.unwrap();
    assert_eq!(answer.status(), 401);
    let answer = http
        .put(format!("{metadata}/team"))
        .body("payments")
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 401);
    let answer = http
        .get(&metadata)
        .header("dapr-api-token", "api-s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    wait_on(&changed, "the delivery", || {
        presented
            .lock()
            .unwrap()
            .iter()
            .any(|(p, _)| p == "POST /messages")
    })
    .await;
    // Dapr's gRPC API asks for the same token (Dapr's Rust SDK's generated client): a call
    // without it is refused; with it, a publish is taken and Shutdown drains the sidecar,
    // which then ends on its own.
    use dapr::dapr::proto::runtime::v1 as pb;
    let mut grpc = pb::dapr_client::DaprClient::connect(format!("http://127.0.0.1:{grpc_port}"))
        .await
        .expect("the gRPC API listens");
    fn with_token<T>(token: Option<&str>, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        if let Some(token) = token {
            request
                .metadata_mut()
                .insert("dapr-api-token", token.parse().unwrap());
        }
        request
    }
    let event = pb::PublishEventRequest {
        pubsub_name: "cosmosq".into(),
        topic: "q".into(),
        data: br#"{"n": 2}"#.to_vec(),
        data_content_type: "application/json".into(),
        ..Default::default()
    };
    for refused in [None, Some("app-s3cret")] {
        let status = grpc
            .publish_event(with_token(refused, event.clone()))
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated, "{refused:?}");
    }
    grpc.publish_event(with_token(Some("api-s3cret"), event))
        .await
        .expect("published with the token");
    grpc.shutdown(with_token(Some("api-s3cret"), pb::ShutdownRequest {}))
        .await
        .expect("shut down");
    tokio::time::timeout(Duration::from_secs(30), sidecar.task)
        .await
        .expect("the sidecar stops after Shutdown, not told by its caller")
        .unwrap()
        .unwrap();
    let presented = presented.lock().unwrap().clone();
    // The health checks, the subscription lookup and the delivery all said who is calling.
    assert!(presented.len() >= 3, "{presented:?}");
    for (path, token) in &presented {
        assert_eq!(token, "app-s3cret", "{path}");
    }
}
