//! Routes, the request guard and the live updates.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Extension;
use axum::Router;
use cosmosq_queue::clock::system_now_ms;
use cosmosq_queue::{GroupConfig, MessageKey};
use futures::Stream;
use serde::Deserialize;
use subtle::ConstantTimeEq;
use tokio_util::sync::CancellationToken;
use tracing::{info, instrument, warn};

use crate::access::{self, Access, Gate, Refusal};
use crate::pages::{self, Act, Action, Scope};
use crate::watch::{Snapshot, Watch, DEAD_LETTER_COUNT_LIMIT};
use crate::{ConsoleError, ConsoleOptions};

/// Dead letters one page lists.
const LIST_LIMIT: usize = 500;
/// Work in progress a group page lists.
const IN_PROGRESS_LIMIT: usize = 100;
/// A gated console's live stream ends after this long, and the browser reconnects (asked
/// again): a caller whose rights were taken away stops seeing updates within it.
const STREAM_REAUTHORIZE: std::time::Duration = std::time::Duration::from_secs(60);

/// What every handler shares.
#[derive(Clone)]
pub(crate) struct App {
    pub watch: Arc<Watch>,
    /// The token every action must carry (random per process, in every form it renders).
    pub token: Arc<str>,
    hosts: Arc<Vec<String>>,
    /// Who may see and do what, when the console serves several tenants.
    gate: Option<Arc<dyn Gate>>,
    /// Ends the live streams, so a graceful shutdown does not wait on an open tab.
    stop: CancellationToken,
}

pub(crate) fn router(
    watch: Arc<Watch>,
    gate: Option<Arc<dyn Gate>>,
    options: &ConsoleOptions,
    address: SocketAddr,
    stop: CancellationToken,
) -> Router {
    let mut hosts = vec![
        "localhost".to_owned(),
        "127.0.0.1".to_owned(),
        "[::1]".to_owned(),
    ];
    if !address.ip().is_unspecified() {
        hosts.push(match address {
            SocketAddr::V4(a) => a.ip().to_string(),
            SocketAddr::V6(a) => format!("[{}]", a.ip()),
        });
    }
    hosts.extend(options.allowed_hosts.iter().map(|h| h.to_ascii_lowercase()));
    let app = App {
        watch,
        token: random_token().into(),
        hosts: Arc::new(hosts),
        gate,
        stop,
    };
    Router::new()
        .route("/", get(overview))
        .route("/queues/{queue}/groups/{group}", get(group))
        .route("/queues/{queue}/groups/{group}/charts", get(charts))
        .route(
            "/queues/{queue}/groups/{group}/dead-letters",
            get(dead_letters).post(act),
        )
        .route("/queues/{queue}/messages", get(message))
        .route("/events", get(events))
        .route("/login", get(sign_in_page).post(sign_in))
        .route("/api/snapshot", get(snapshot))
        .route("/assets/console.css", get(css))
        .route("/assets/console.js", get(js))
        .route("/assets/icon.svg", get(icon))
        .route(
            "/favicon.ico",
            get(|| async { Redirect::permanent("/assets/icon.svg") }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .layer(middleware::from_fn_with_state(app.clone(), guard))
        .with_state(app)
}

fn random_token() -> String {
    use rand::Rng;
    let bytes: [u8; 16] = rand::rng().random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether a `Host` header names the console: one of `allowed` (names, IPv4 addresses,
/// bracketed IPv6 addresses), with any port. A page on another site that resolves its own
/// name to 127.0.0.1 (DNS rebinding) sends its own name, and is refused.
pub fn host_allowed(host: &str, allowed: &[String]) -> bool {
    let host = host.trim().to_ascii_lowercase();
    let name = if host.starts_with('[') {
        host.split_inclusive(']').next().unwrap_or_default()
    } else {
        host.split(':').next().unwrap_or_default()
    };
    !name.is_empty() && allowed.iter().any(|a| a == name)
}

/// Refuses requests for other hosts, cross-site actions and, on a gated console, callers
/// without a token it admits; gives the handlers the caller's [`Access`]; adds the security
/// headers to every answer.
async fn guard(State(app): State<App>, mut request: Request, next: Next) -> Response {
    let headers = request.headers();
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    if !host_allowed(&host, &app.hosts) {
        return secured(refused(StatusCode::MISDIRECTED_REQUEST, "this console does not answer to that host name (start it with --allow-host to add one)"));
    }
    if request.method() == Method::POST {
        let origin = headers.get(header::ORIGIN).and_then(|h| h.to_str().ok());
        if origin.is_some_and(|o| o != format!("http://{host}") && o != format!("https://{host}")) {
            return secured(refused(
                StatusCode::FORBIDDEN,
                "a request from another site",
            ));
        }
    }
    // The request itself is not `Sync`: the gate is asked with what it needs of it.
    let asked = (
        request.method().clone(),
        request.uri().path().to_owned(),
        request.headers().clone(),
    );
    match admit(&app, &asked.0, &asked.1, &asked.2).await {
        Ok(access) => {
            request.extensions_mut().insert(access);
            secured(next.run(request).await)
        }
        Err(refusal) => secured(refusal),
    }
}

/// Paths a gated console serves to anyone who reaches it: the sign-in page and what draws it.
fn open_path(path: &str) -> bool {
    matches!(path, "/login" | "/healthz" | "/favicon.ico") || path.starts_with("/assets/")
}

/// The caller's access: everything without a gate; with one, what it admits for the
/// request's token over the namespaces shown now.
async fn admit(
    app: &App,
    method: &Method,
    path: &str,
    headers: &HeaderMap,
) -> Result<Access, Response> {
    let Some(gate) = &app.gate else {
        return Ok(Access::Everything);
    };
    if open_path(path) {
        return Ok(Access::Namespaces {
            read: Default::default(),
            act: Default::default(),
        });
    }
    let wants_page = method == Method::GET && accepts_html(headers);
    let Some(token) = access::request_token(headers) else {
        return Err(gate_refusal(
            gate.as_ref(),
            Refusal {
                status: StatusCode::UNAUTHORIZED,
                message: "sign in with a Kubernetes token".into(),
                retry_after: None,
            },
            wants_page,
        ));
    };
    let namespaces = app.watch.latest().namespaces();
    gate.admit(&token, &namespaces)
        .await
        .map_err(|refusal| gate_refusal(gate.as_ref(), refusal, wants_page))
}

fn accepts_html(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/html"))
}

/// A gate's refusal: the sign-in page for a browser that is not signed in, text otherwise.
fn gate_refusal(gate: &dyn Gate, refusal: Refusal, wants_page: bool) -> Response {
    let mut response = if refusal.status == StatusCode::UNAUTHORIZED && wants_page {
        sign_in_answer(gate, refusal.status, Some(&refusal.message))
    } else {
        refused(refusal.status, &refusal.message)
    };
    if let Some(seconds) = refusal.retry_after {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
    response
}

/// The headers every answer carries.
fn secured(mut response: Response) -> Response {
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
             connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    // Not `no-referrer`: with it, browsers send `Origin: null` on the console's own forms.
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    h.entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    response
}

/// The sign-in page, with what went wrong if anything did.
fn sign_in_answer(gate: &dyn Gate, status: StatusCode, problem: Option<&str>) -> Response {
    let page = pages::sign_in(&gate.sign_in_hint(), problem).into_string();
    (status, Html(page)).into_response()
}

async fn sign_in_page(State(app): State<App>) -> Response {
    match &app.gate {
        Some(gate) => sign_in_answer(gate.as_ref(), StatusCode::OK, None),
        None => Redirect::to("/").into_response(),
    }
}

/// Checks the pasted token with the gate and keeps it in the console's cookie.
async fn sign_in(State(app): State<App>, body: Bytes) -> Response {
    let Some(gate) = &app.gate else {
        return Redirect::to("/").into_response();
    };
    let token = form_urlencoded::parse(&body)
        .find(|(k, _)| k == "token")
        .map(|(_, v)| v.trim().to_owned())
        .unwrap_or_default();
    if !access::cookie_safe(&token) {
        return sign_in_answer(
            gate.as_ref(),
            StatusCode::BAD_REQUEST,
            Some("that is not a token: paste the output of the command below"),
        );
    }
    match gate.admit(&token, &Default::default()).await {
        Ok(_) => {
            let mut response = Redirect::to("/").into_response();
            if let Ok(cookie) = HeaderValue::from_str(&access::token_cookie(&token)) {
                response.headers_mut().insert(header::SET_COOKIE, cookie);
            }
            response
        }
        Err(refusal) => sign_in_answer(gate.as_ref(), refusal.status, Some(&refusal.message)),
    }
}

fn refused(status: StatusCode, why: &str) -> Response {
    (status, why.to_owned()).into_response()
}

impl IntoResponse for ConsoleError {
    fn into_response(self) -> Response {
        let status = match &self {
            ConsoleError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ConsoleError::NotFound(_) => StatusCode::NOT_FOUND,
            ConsoleError::Forbidden(_) => StatusCode::FORBIDDEN,
            _ => StatusCode::BAD_GATEWAY,
        };
        (
            status,
            Html(pages::error(status, &self.to_string()).into_string()),
        )
            .into_response()
    }
}

type Page = Result<Html<String>, ConsoleError>;

async fn overview(State(app): State<App>, Extension(access): Extension<Access>) -> Page {
    let snapshot = app.watch.latest().visible(&access);
    Ok(Html(
        app.watch
            .with_history(|h| pages::overview(&snapshot, h, system_now_ms()))
            .into_string(),
    ))
}

/// The last round's snapshot, when it saw the group and the caller may read its queue.
fn known_group(
    app: &App,
    access: &Access,
    queue: &str,
    group: &str,
) -> Result<Arc<Snapshot>, ConsoleError> {
    let snapshot = known_queue(app, access, queue)?;
    if snapshot.group(queue, group).is_none() {
        return Err(ConsoleError::NotFound(format!(
            "no group {group} in queue {queue} (yet)"
        )));
    }
    Ok(snapshot)
}

/// The last round's snapshot, when it saw the queue and the caller may read it (only the
/// queues the console shows are opened, whatever a URL names).
fn known_queue(app: &App, access: &Access, queue: &str) -> Result<Arc<Snapshot>, ConsoleError> {
    let snapshot = app.watch.latest();
    let Some(view) = snapshot.queue(queue) else {
        return Err(ConsoleError::NotFound(format!("no queue {queue} (yet)")));
    };
    if !access.may_read(view.namespace.as_deref()) {
        return Err(ConsoleError::Forbidden(format!(
            "you may not read the queues of namespace {}",
            view.namespace.as_deref().unwrap_or("(none)")
        )));
    }
    Ok(snapshot)
}

#[instrument(skip(app, access))]
async fn group(
    State(app): State<App>,
    Extension(access): Extension<Access>,
    Path((queue, group)): Path<(String, String)>,
) -> Page {
    let snapshot = known_group(&app, &access, &queue, &group)?;
    let view = snapshot
        .group(&queue, &group)
        .ok_or_else(|| ConsoleError::NotFound(format!("no group {group}")))?;
    let handle = app
        .watch
        .queue(&queue)
        .await?
        .group(GroupConfig::new(group.clone()))?;
    let in_progress = handle.unsettled(IN_PROGRESS_LIMIT).await?;
    Ok(Html(
        app.watch
            .with_history(|h| pages::group(view, &in_progress, h, system_now_ms()))
            .into_string(),
    ))
}

async fn charts(
    State(app): State<App>,
    Extension(access): Extension<Access>,
    Path((queue, group)): Path<(String, String)>,
) -> Page {
    known_group(&app, &access, &queue, &group)?;
    Ok(Html(
        app.watch
            .with_history(|h| pages::charts(h.get(&queue, &group), h.window_ms(), system_now_ms()))
            .into_string(),
    ))
}

/// The dead-letter list's filter and the result of the last action.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct ListQuery {
    pub reason: Option<String>,
    /// Dead-lettered within this long (`15m`, `2h`, `1d`).
    pub within: Option<String>,
    /// The last action's verb and counts (after its redirect).
    pub done: Option<String>,
    pub n: Option<usize>,
    pub of: Option<usize>,
}

#[instrument(skip(app, access))]
async fn dead_letters(
    State(app): State<App>,
    Extension(access): Extension<Access>,
    Path((queue, group)): Path<(String, String)>,
    Query(query): Query<ListQuery>,
) -> Page {
    known_group(&app, &access, &queue, &group)?;
    let filter = pages::Filter::parse(query.reason.as_deref(), query.within.as_deref())?;
    let handle = app
        .watch
        .queue(&queue)
        .await?
        .group(GroupConfig::new(group.clone()))?;
    let all = handle.dead_letters(Some(DEAD_LETTER_COUNT_LIMIT)).await?;
    Ok(Html(
        pages::dead_letters(
            &queue,
            &group,
            &all,
            &filter,
            &query,
            LIST_LIMIT,
            &app.token,
            system_now_ms(),
        )
        .into_string(),
    ))
}

/// Replay or purge: a confirmation page first, then the action, then back to the list.
#[instrument(skip(app, access, body))]
async fn act(
    State(app): State<App>,
    Extension(access): Extension<Access>,
    Path((queue, group)): Path<(String, String)>,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    let pairs: Vec<(String, String)> = form_urlencoded::parse(&body).into_owned().collect();
    let token = pairs
        .iter()
        .find(|(k, _)| k == "token")
        .map(|(_, v)| v.as_str());
    if !token.is_some_and(|t| bool::from(t.as_bytes().ct_eq(app.token.as_bytes()))) {
        return Ok(refused(
            StatusCode::FORBIDDEN,
            "the form's token is not this console's: reload the page",
        ));
    }
    let snapshot = known_group(&app, &access, &queue, &group)?;
    let namespace = snapshot.queue(&queue).and_then(|q| q.namespace.as_deref());
    if !access.may_act(namespace) {
        return Err(ConsoleError::Forbidden(format!(
            "you may read but not act on the queues of namespace {}",
            namespace.unwrap_or("(none)")
        )));
    }
    let act = Act::parse(&pairs)?;
    let handle = app
        .watch
        .queue(&queue)
        .await?
        .group(GroupConfig::new(group.clone()))?;
    // What matched when the confirmation page was shown: dead letters that arrive between
    // it and the click are not acted on.
    let as_of = act.as_of.unwrap_or_else(system_now_ms);
    let targets: Vec<(String, MessageKey)> = match &act.scope {
        Scope::Selected(list) => list.clone(),
        Scope::Matching(filter) => handle
            .dead_letters(Some(DEAD_LETTER_COUNT_LIMIT))
            .await?
            .into_iter()
            .filter(|d| filter.matches(d, as_of) && d.dead_lettered_at.is_none_or(|t| t <= as_of))
            .map(|d| (d.message_id, d.partition_key))
            .collect(),
    };
    if !act.confirmed {
        let page = pages::confirm(&queue, &group, &act, &targets, as_of, &app.token);
        return Ok(Html(page.into_string()).into_response());
    }
    // Each one on its own: an error on one leaves the others done, and the count says so.
    let (mut done, mut failed) = (0, 0);
    for (id, key) in &targets {
        let changed = match act.action {
            Action::Replay => handle.replay(key, id).await,
            Action::Purge => handle.purge(key, id).await,
        };
        match changed {
            Ok(changed) => done += usize::from(changed),
            Err(e) => {
                failed += 1;
                warn!(queue, group, message_id = %id, error = %e, action = act.action.verb(), "a dead letter was not acted on");
            }
        }
    }
    info!(
        queue,
        group,
        action = act.action.verb(),
        done,
        failed,
        of = targets.len(),
        "dead letters acted on from the console"
    );
    let back = pages::dead_letters_url(
        &queue,
        &group,
        act.scope.filter(),
        Some((act.action, done, targets.len())),
    );
    Ok(Redirect::to(&back).into_response())
}

#[derive(Debug, Deserialize)]
pub(crate) struct MessageQuery {
    pub id: Option<String>,
    /// The partition key as text (the id when empty).
    pub key: Option<String>,
    /// The partition key as JSON (exact: numbers, booleans, null).
    #[serde(rename = "keyJson")]
    pub key_json: Option<String>,
}

#[instrument(skip(app, access))]
async fn message(
    State(app): State<App>,
    Extension(access): Extension<Access>,
    Path(queue): Path<String>,
    Query(query): Query<MessageQuery>,
) -> Page {
    let Some(id) = query.id.as_deref().map(str::trim).filter(|s| !s.is_empty()) else {
        return Err(ConsoleError::BadRequest(
            "look a message up by its id".into(),
        ));
    };
    let key = pages::message_key(id, query.key.as_deref(), query.key_json.as_deref())?;
    known_queue(&app, &access, &queue)?;
    let handle = app.watch.queue(&queue).await?;
    let message = handle.read_message(&key, id).await?;
    let mut states = Vec::new();
    for name in handle.group_names().await? {
        let state = handle
            .group(GroupConfig::new(name.clone()))?
            .read_state(&key, id)
            .await?;
        states.push((name, state));
    }
    Ok(Html(
        pages::message(&queue, id, &key, message.as_ref(), &states, system_now_ms()).into_string(),
    ))
}

async fn snapshot(
    State(app): State<App>,
    Extension(access): Extension<Access>,
) -> impl IntoResponse {
    axum::Json(app.watch.latest().visible(&access))
}

/// Every round's figures as they come: the overview's cells and sparklines, of the queues the
/// caller may read. On a gated console the stream ends after [`STREAM_REAUTHORIZE`] and the
/// browser opens a new one, admitted again.
async fn events(
    State(app): State<App>,
    Extension(access): Extension<Access>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let receiver = app.watch.subscribe();
    let stop = app.stop.clone();
    let reauthorize = app.gate.is_some();
    let state = (app, access, receiver);
    let stream = futures::stream::unfold(state, |(app, access, mut receiver)| async move {
        receiver.changed().await.ok()?;
        let snapshot = receiver.borrow_and_update().visible(&access);
        let data = app
            .watch
            .with_history(|h| pages::live(&snapshot, h, system_now_ms()));
        let event = Event::default().event("round").json_data(data).ok()?;
        Some((Ok(event), (app, access, receiver)))
    });
    let end = async move {
        let expiry = async {
            if reauthorize {
                tokio::time::sleep(STREAM_REAUTHORIZE).await;
            } else {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            () = stop.cancelled() => {}
            () = expiry => {}
        }
    };
    Sse::new(futures::StreamExt::take_until(stream, end)).keep_alive(KeepAlive::default())
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("max-age=300"),
    );
    (headers, body).into_response()
}

async fn css() -> Response {
    asset(
        "text/css; charset=utf-8",
        include_str!("assets/console.css"),
    )
}

async fn icon() -> Response {
    asset("image/svg+xml", include_str!("assets/icon.svg"))
}

async fn js() -> Response {
    asset(
        "text/javascript; charset=utf-8",
        include_str!("assets/console.js"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_console_s_own_host_names_are_answered() {
        let allowed: Vec<String> = ["localhost", "127.0.0.1", "[::1]", "console.example"]
            .map(String::from)
            .to_vec();
        for (host, ok) in [
            ("localhost:8090", true),
            ("LOCALHOST", true),
            ("127.0.0.1:8090", true),
            ("[::1]:8090", true),
            ("console.example:443", true),
            ("evil.example:8090", false),
            ("localhost.evil.example", false),
            ("127.0.0.1.nip.io", false),
            ("", false),
            ("[::2]:8090", false),
        ] {
            assert_eq!(host_allowed(host, &allowed), ok, "{host}");
        }
    }
}
