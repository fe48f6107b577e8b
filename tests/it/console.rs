//! The web console: a dead letter triaged in a real browser, with a real sidecar delivering,
//! and the console's guard against other sites.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use axum::http::HeaderMap;
use cosmosq_console::{Console, ConsoleOptions};
use cosmosq_queue::{GroupConfig, NewMessage};
use cosmosq_tests::{free_port, wait_on, Fixture};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::sidecar::{settings, start_sidecar};

/// An app that drops orders marked poison until it is fixed, and completes everything else.
#[derive(Clone, Default)]
struct App {
    fixed: Arc<std::sync::atomic::AtomicBool>,
    /// (id, data) of every message it completed: the two order-7s differ by their data.
    completed: Arc<Mutex<BTreeSet<(String, String)>>>,
    changed: Arc<Notify>,
}

impl App {
    async fn serve(&self) -> u16 {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let app = self.clone();
        let router = axum::Router::new().route(
            "/messages",
            axum::routing::post(move |headers: HeaderMap, body: String| {
                let app = app.clone();
                async move { app.answer(&headers, &body) }
            }),
        );
        tokio::spawn(async move { axum::serve(listener, router).await });
        port
    }

    fn answer(&self, headers: &HeaderMap, body: &str) -> axum::Json<Value> {
        let event: Value = serde_json::from_str(body).unwrap_or_default();
        let poison = event["data"]["poison"] == json!(true);
        if poison && !self.fixed.load(std::sync::atomic::Ordering::SeqCst) {
            return axum::Json(json!({"status": "DROP"}));
        }
        let id = headers
            .get("cosmosq-message-id")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        self.completed
            .lock()
            .unwrap()
            .insert((id.to_owned(), event["data"].to_string()));
        self.changed.notify_waiters();
        axum::Json(json!({"status": "SUCCESS"}))
    }

    fn completed(&self) -> usize {
        self.completed.lock().unwrap().len()
    }
}

async fn start_console(fixture: &Fixture, cancel: &CancellationToken) -> String {
    let options = ConsoleOptions {
        sample_every: std::time::Duration::from_millis(300),
        ..ConsoleOptions::default()
    };
    let console = Console::bind(
        fixture.client.clone(),
        "db",
        vec![],
        options,
        ([127, 0, 0, 1], 0).into(),
    )
    .await
    .unwrap();
    let url = format!("http://localhost:{}/", console.local_addr().port());
    tokio::spawn(console.run(cancel.clone()));
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_is_found_read_and_replayed_in_a_real_browser() {
    let (modules, chromium) = cosmosq_tests::browser();
    let fixture = Fixture::new(2).await;
    let app = App::default();
    let app_port = app.serve().await;
    let sidecar = start_sidecar(&fixture, settings("billing", app_port, free_port()));

    // The poison order's id is also a healthy order's id under another key (a string "7"
    // beside the number 7): only the poison one may be dead-lettered, replayed, completed.
    let mut messages: Vec<NewMessage> = (0..5)
        .map(|i| NewMessage::json(json!({"order": i})).with_id(format!("order-{i}")))
        .collect();
    let poison_key = json!(7);
    messages.push(
        NewMessage::json(json!({"order": 7, "poison": true}))
            .with_id("order-7")
            .with_partition_key(cosmosq_queue::MessageKey::from_json(poison_key.clone()).unwrap()),
    );
    messages.push(
        NewMessage::json(json!({"order": 7}))
            .with_id("order-7")
            .with_partition_key("7"),
    );
    fixture.enqueue_all(messages).await;
    let group = fixture.group(GroupConfig::new("billing"));
    wait_on(&app.changed, "the six healthy orders completed", || {
        app.completed() == 6
    })
    .await;
    cosmosq_tests::eventually(
        "the poison order dead-lettered",
        std::time::Duration::from_secs(20),
        || async { group.count_dead_letters(10).await.unwrap() == 1 },
    )
    .await;

    let cancel = CancellationToken::new();
    let url = start_console(&fixture, &cancel).await;
    app.fixed.store(true, std::sync::atomic::Ordering::SeqCst);

    let shots =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/console-screenshots");
    // Written by this run only: an earlier run's screenshots must not pass for these.
    let _ = std::fs::remove_dir_all(&shots);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/node/console_browser.cjs");
    let mut browser = tokio::process::Command::new("node")
        .arg(script)
        .args([&url, "q", "billing", "order-7", &poison_key.to_string()])
        .arg(&shots)
        .env("NODE_PATH", &modules)
        .env("COSMOSQ_CHROMIUM", &chromium)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("node");
    let mut stdin = Some(browser.stdin.take().unwrap());
    let mut lines = BufReader::new(browser.stdout.take().unwrap()).lines();
    let mut steps: Vec<Value> = Vec::new();
    while let Some(line) = lines.next_line().await.unwrap() {
        let step: Value =
            serde_json::from_str(&line).unwrap_or_else(|_| json!({"step": "output", "line": line}));
        let replayed = step["step"] == "replayed";
        steps.push(step);
        if replayed {
            // The browser waits while the sidecar delivers the replayed order to the fixed app.
            tokio::time::timeout(
                std::time::Duration::from_secs(30),
                wait_on(&app.changed, "the replayed order completed", || {
                    app.completed() == 7
                }),
            )
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "the replayed order was not delivered: {:?}",
                    app.completed.lock().unwrap()
                )
            });
            // The app answered; the browser looks once the sidecar has recorded it.
            cosmosq_tests::eventually(
                "the replayed order recorded completed",
                std::time::Duration::from_secs(20),
                || async {
                    let key = cosmosq_queue::MessageKey::from_json(poison_key.clone()).unwrap();
                    group
                        .read_state(&key, "order-7")
                        .await
                        .unwrap()
                        .is_some_and(|s| s.state == cosmosq_queue::MessageState::Completed)
                },
            )
            .await;
            let mut input = stdin.take().expect("one replay");
            input.write_all(b"go\n").await.unwrap();
            drop(input); // the script's end of input: it may exit when done
        }
    }
    let status = browser.wait().await.unwrap();
    let mut stderr = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut browser.stderr.take().unwrap(), &mut stderr)
        .await
        .unwrap();
    assert!(
        status.success(),
        "the browser's run failed:\n{steps:#?}\n{stderr}"
    );
    let step = |name: &str| {
        steps
            .iter()
            .find(|s| s["step"] == name)
            .unwrap_or_else(|| panic!("no step {name}: {steps:#?}"))
            .clone()
    };

    assert_eq!(step("overview")["deadLetters"], "1");
    let charts = step("group")["charts"].as_array().unwrap().clone();
    assert!(
        charts.len() >= 5 && charts.iter().all(|c| c["drawn"] == true),
        "{charts:?}"
    );
    assert_eq!(step("theme")["theme"], "dark");
    assert_eq!(step("dead letters")["reason"], "DroppedByApp");
    assert_eq!(
        step("dead letters")["rows"],
        1,
        "one dead letter: the healthy order-7 is not one"
    );
    assert_eq!(
        step("message")["body"],
        json!({"order": 7, "poison": true}),
        "the poison one's body, not its namesake's"
    );
    assert!(
        step("message")["state"]
            .as_str()
            .unwrap()
            .starts_with("dead-lettered (DroppedByApp)"),
        "{steps:#?}"
    );
    assert_eq!(
        step("confirm")["question"],
        "Replay 1 selected dead letters?"
    );
    assert!(
        step("replayed")["result"]
            .as_str()
            .unwrap()
            .starts_with("Replayed 1 of 1."),
        "{steps:#?}"
    );
    assert!(
        step("delivered")["state"]
            .as_str()
            .unwrap()
            .starts_with("completed"),
        "{steps:#?}"
    );
    assert!(
        step("phone")["overflow"].as_i64().unwrap() <= 0,
        "the overview fits a phone's width: {steps:#?}"
    );
    assert_eq!(group.count_dead_letters(10).await.unwrap(), 0);
    let poison = json!({"order": 7, "poison": true}).to_string();
    assert!(app
        .completed
        .lock()
        .unwrap()
        .contains(&("order-7".to_owned(), poison)));
    for name in [
        "overview",
        "group",
        "dead-letters",
        "message",
        "confirm",
        "replayed",
        "message-completed",
    ] {
        assert!(
            shots.join(format!("{name}.png")).exists(),
            "screenshot {name}"
        );
    }
    cancel.cancel();
    sidecar.stop.cancel();
    sidecar.task.await.unwrap().unwrap();
}

/// Another site in the same browser cannot act through the console: requests naming another
/// host (DNS rebinding) are refused, and an action needs the console's token and its origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_refuses_other_sites_and_actions_without_its_token() {
    let fixture = Fixture::new(1).await;
    let group = fixture.group(GroupConfig::new("billing"));
    cosmosq_queue::lease::LeaseStore::new(fixture.queue.clone(), "billing")
        .reconcile(cosmosq_queue::clock::system_now_ms(), 60_000)
        .await
        .unwrap();
    fixture
        .enqueue_all(vec![NewMessage::json(json!({})).with_id("m1")])
        .await;
    let m1 = fixture
        .queue
        .read_message(&"m1".into(), "m1")
        .await
        .unwrap()
        .unwrap();
    let cosmosq_queue::ClaimOutcome::Claimed(claim) = group.claim(&m1, "t").await.unwrap() else {
        panic!("m1 is free")
    };
    group.dead_letter(&claim, "poison", "bad").await.unwrap();

    let cancel = CancellationToken::new();
    let url = start_console(&fixture, &cancel).await;
    let http = cosmosq_queue::cosmos::tls::http_client_builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let list = format!("{url}queues/q/groups/billing/dead-letters");
    // The first round has to have seen the group.
    cosmosq_tests::eventually(
        "the console saw the group",
        std::time::Duration::from_secs(20),
        || async {
            http.get(&list)
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        },
    )
    .await;
    let page = http.get(&list).send().await.unwrap();
    let csp = page.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        csp.contains("script-src 'self'") && csp.contains("frame-ancestors 'none'"),
        "{csp}"
    );
    let html = page.text().await.unwrap();
    let token = html
        .split(r#"name="token" value=""#)
        .nth(1)
        .and_then(|s| s.split('"').next())
        .expect("the page's forms carry the token")
        .to_owned();
    let form = |token: &str| format!("token={token}&action=purge&scope=matching&confirmed=1");

    let rebound = http
        .get(&list)
        .header("host", "evil.example")
        .send()
        .await
        .unwrap();
    assert_eq!(
        rebound.status(),
        421,
        "a name rebound to the console is refused"
    );
    let no_token = http
        .post(&list)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form(""))
        .send()
        .await
        .unwrap();
    assert_eq!(no_token.status(), 403);
    let cross_site = http
        .post(&list)
        .header("content-type", "application/x-www-form-urlencoded")
        .header("origin", "http://evil.example")
        .body(form(&token))
        .send()
        .await
        .unwrap();
    assert_eq!(cross_site.status(), 403);
    assert_eq!(
        group.count_dead_letters(10).await.unwrap(),
        1,
        "nothing was purged"
    );

    // The console's own form, from its own origin: a confirmed purge, then back to the list.
    let own = http
        .post(&list)
        .header("content-type", "application/x-www-form-urlencoded")
        .header("origin", url.trim_end_matches('/'))
        .body(form(&token))
        .send()
        .await
        .unwrap();
    assert_eq!(own.status(), 303);
    assert_eq!(
        own.headers()["location"],
        "/queues/q/groups/billing/dead-letters?done=purge&n=1&of=1"
    );
    assert_eq!(group.count_dead_letters(10).await.unwrap(), 0);
    cancel.cancel();
}

/// A queue of `namespace` on the emulator, as a CosmosQueue in the API server, with one dead
/// letter (`poison-<namespace>`) in its group `billing`.
async fn tenant_queue(
    server: &cosmosq_testkit::fake::FakeApiServer,
    cosmos: &cosmosq_queue::CosmosClient,
    namespace: &str,
    name: &str,
) -> cosmosq_queue::Group {
    let cq: cosmosq_crds::CosmosQueue = serde_json::from_value(json!({
        "apiVersion": "cosmosq.io/v1alpha1", "kind": "CosmosQueue",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"endpoint": "https://acct.documents.azure.com:443/",
                 "credentials": {"secretKeyRef": {"name": "cosmos-key"}},
                 "database": namespace, "container": name}
    }))
    .unwrap();
    kube::Api::<cosmosq_crds::CosmosQueue>::namespaced(server.client(), namespace)
        .create(&Default::default(), &cq)
        .await
        .unwrap();
    let config = cosmosq_operator::spec::queue(&cq.spec).unwrap();
    let (queue, _) = cosmosq_queue::cosmos::provision::provision(cosmos, &config)
        .await
        .unwrap();
    cosmosq_queue::lease::LeaseStore::new(queue.clone(), "billing")
        .reconcile(cosmosq_queue::clock::system_now_ms(), 60_000)
        .await
        .unwrap();
    let id = format!("poison-{namespace}");
    queue
        .enqueue(NewMessage::json(json!({"tenant": namespace})).with_id(id.clone()))
        .await
        .unwrap();
    let message = queue
        .read_message(&id.as_str().into(), &id)
        .await
        .unwrap()
        .unwrap();
    let group = queue.group(GroupConfig::new("billing")).unwrap();
    let cosmosq_queue::ClaimOutcome::Claimed(claim) = group.claim(&message, "t").await.unwrap()
    else {
        panic!("{id} is free")
    };
    group.dead_letter(&claim, "poison", "bad").await.unwrap();
    group
}

/// The operator's console in the cluster: each caller, named by its Kubernetes token, sees
/// the queues of the namespaces where it may get CosmosQueues and acts only where it may also
/// update QueueConsumerGroups (the in-memory API server answers the reviews from its grants).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_s_console_shows_and_does_only_what_the_caller_s_rbac_allows() {
    use cosmosq_operator::auth::Authorizer;
    use cosmosq_operator::cosmos::{Backend, Cosmos};
    use cosmosq_testkit::fake::FakeApiServer;

    let server = FakeApiServer::new();
    let emulator = cosmosq_emulator::Emulator::in_process(Default::default()).unwrap();
    let cosmos = emulator.client().await.unwrap();
    let shop = tenant_queue(&server, &cosmos, "shop", "orders").await;
    let bank = tenant_queue(&server, &cosmos, "bank", "payments").await;
    let (q, crd) = ("cosmosq.io", "cosmosqueues");
    // Alice runs the shop; Bob audits both and acts on neither; Carol is cluster-wide.
    server.issue_token("alice-token", "alice");
    server.grant("alice", "get", q, crd, "shop");
    server.grant("alice", "update", q, "queueconsumergroups", "shop");
    server.issue_token("bob-token", "bob");
    server.grant("bob", "get", q, crd, "shop");
    server.grant("bob", "get", q, crd, "bank");
    server.issue_token("carol-token", "carol");
    server.grant("carol", "get", q, crd, "");
    server.grant("carol", "update", q, "queueconsumergroups", "");

    let operator = server.client_as("operator");
    let ctx = cosmosq_operator::context::Context::new(
        operator.clone(),
        cosmosq_operator::build::Defaults::new("s:t"),
        Cosmos::new(Backend::Fixed(cosmos.clone()), operator.clone()),
        None,
    );
    let options = ConsoleOptions {
        sample_every: std::time::Duration::from_millis(300),
        ..ConsoleOptions::default()
    };
    let console = cosmosq_operator::console::bind(
        kube::Api::all(operator.clone()),
        Arc::new(ctx),
        Arc::new(Authorizer::new(operator)),
        options,
        ([127, 0, 0, 1], 0).into(),
    )
    .await
    .unwrap();
    let base = format!("http://localhost:{}", console.local_addr().port());
    let cancel = CancellationToken::new();
    tokio::spawn(console.run(cancel.clone()));
    let http = cosmosq_queue::cosmos::tls::http_client_builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let get = |path: &str, token: Option<&str>| {
        let request = http
            .get(format!("{base}{path}"))
            .header("accept", "text/html");
        match token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    };
    let queues_seen = |token: &'static str| {
        let request = get("/api/snapshot", Some(token));
        async move {
            let text = request.send().await.unwrap().text().await.unwrap();
            let snapshot: Value = serde_json::from_str(&text).unwrap();
            snapshot["queues"]
                .as_array()
                .unwrap()
                .iter()
                .map(|q| q["name"].as_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        }
    };
    cosmosq_tests::eventually(
        "the console read both tenants' queues",
        std::time::Duration::from_secs(20),
        || async { queues_seen("carol-token").await.len() == 2 },
    )
    .await;

    // Nobody signed in: the sign-in page (a browser) or 401; a token the API server does not
    // know: 401 too.
    let anonymous = get("/", None).send().await.unwrap();
    assert_eq!(anonymous.status(), 401);
    assert!(anonymous.text().await.unwrap().contains("Sign in"));
    assert_eq!(
        get("/api/snapshot", Some("forged"))
            .send()
            .await
            .unwrap()
            .status(),
        401
    );

    // Each sees its namespaces only: in the list, the pages, and message lookups.
    assert_eq!(queues_seen("alice-token").await, ["shop/orders"]);
    assert_eq!(
        queues_seen("bob-token").await,
        ["bank/payments", "shop/orders"]
    );
    let bank_list = "/queues/bank%2Fpayments/groups/billing/dead-letters";
    let shop_list = "/queues/shop%2Forders/groups/billing/dead-letters";
    let refused = get(bank_list, Some("alice-token")).send().await.unwrap();
    assert_eq!(refused.status(), 403);
    assert!(refused.text().await.unwrap().contains("namespace bank"));
    let lookup = "/queues/bank%2Fpayments/messages?id=poison-bank";
    assert_eq!(
        get(lookup, Some("alice-token"))
            .send()
            .await
            .unwrap()
            .status(),
        403
    );
    let page = get(lookup, Some("bob-token")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    let html = page.text().await.unwrap();
    assert!(
        html.contains("tenant") && html.contains("(poison)"),
        "{html}"
    );

    // Acting needs `update` on the namespace's groups: Bob reads the bank's dead letters and
    // may not purge them; Alice purges the shop's.
    let purge = |path: &str, token: &str, form_token: &str| {
        http.post(format!("{base}{path}"))
            .bearer_auth(token)
            .header("origin", &base)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(format!(
                "token={form_token}&action=purge&scope=matching&confirmed=1"
            ))
    };
    let form_token = |html: String| {
        html.split(r#"name="token" value=""#)
            .nth(1)
            .and_then(|s| s.split('"').next())
            .expect("the page's forms carry the token")
            .to_owned()
    };
    let listed = get(bank_list, Some("bob-token")).send().await.unwrap();
    assert_eq!(listed.status(), 200);
    let html = listed.text().await.unwrap();
    assert!(html.contains("poison-bank"), "{html}");
    let bob_form = form_token(html);
    let refused = purge(bank_list, "bob-token", &bob_form)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 403);
    assert_eq!(
        bank.count_dead_letters(10).await.unwrap(),
        1,
        "nothing purged"
    );
    let alice_form = form_token(
        get(shop_list, Some("alice-token"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
    );
    let done = purge(shop_list, "alice-token", &alice_form)
        .send()
        .await
        .unwrap();
    assert_eq!(done.status(), 303);
    assert_eq!(shop.count_dead_letters(10).await.unwrap(), 0);

    // A browser signs in once: the token is kept in the console's cookie.
    let sign_in = |token: &str| {
        http.post(format!("{base}/login"))
            .header("origin", &base)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(format!("token={token}"))
            .send()
    };
    let signed_in = sign_in("alice-token").await.unwrap();
    assert_eq!(signed_in.status(), 303);
    let cookie = signed_in.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    let overview = http
        .get(format!("{base}/"))
        .header("cookie", cookie.split(';').next().unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(overview.status(), 200);
    let html = overview.text().await.unwrap();
    assert!(
        html.contains("shop/orders") && !html.contains("bank/payments"),
        "{html}"
    );
    let wrong = sign_in("forged").await.unwrap();
    assert_eq!(wrong.status(), 401);
    assert!(wrong.headers().get("set-cookie").is_none());
    cancel.cancel();
}
