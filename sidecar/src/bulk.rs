//! Dapr's bulk subscribe: when the app's subscription asks for it (`bulkSubscribe.enabled`),
//! deliveries bound for one path wait together (up to `maxMessagesCount`, at most
//! `maxAwaitDurationMs`) and go to the app in one request; its per-entry statuses (`SUCCESS`,
//! `RETRY`, `DROP`) settle each message on its own. Everything around a call (breaker, crash
//! isolation, metrics, the outcome) stays per message in `delivery.rs`: each delivery waits for
//! its entry's answer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::oneshot;
use tracing::warn;

use crate::app::{self, Answer};
use crate::transport::Called;

/// The most of a bulk answer read: statuses for the largest request, with room.
const MAX_ANSWER_BYTES: usize = 4 * 1024 * 1024;

/// What `bulkSubscribe` asks for, with Dapr's defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BulkSettings {
    /// `maxMessagesCount`: a request carries at most this many.
    pub max_messages: usize,
    /// `maxAwaitDurationMs`: the first entry of a request waits at most this long for others.
    pub max_await: Duration,
}

impl Default for BulkSettings {
    fn default() -> Self {
        Self {
            max_messages: 100,
            max_await: Duration::from_millis(1000),
        }
    }
}

/// One message of a bulk request: its entry and who waits for its answer.
pub struct Entry {
    /// `entryId`: unique within the request.
    pub id: String,
    /// The CloudEvent, or the raw body (`rawPayload`).
    pub event: Value,
    /// `contentType` of `event`.
    pub content_type: String,
    /// The message's metadata.
    pub metadata: std::collections::BTreeMap<String, String>,
    /// With `rawPayload`, the body's bytes as enqueued (what a gRPC app gets; HTTP sends
    /// `event`).
    pub raw: Option<Vec<u8>>,
}

/// Where a batch goes.
pub enum Sink {
    /// `POST <base><path>` with Dapr's JSON bulk envelope.
    Http {
        /// The client, with the app token.
        http: reqwest::Client,
        /// `http://127.0.0.1:<port>`.
        base: String,
    },
    /// The app's `AppCallback.OnBulkTopicEvent`.
    Grpc(crate::callback::Callback),
}

struct Waiting {
    batch: u64,
    entries: Vec<(Entry, oneshot::Sender<Called>)>,
}

/// Collects deliveries per path and posts them together.
pub struct Bulker {
    settings: BulkSettings,
    sink: Sink,
    timeout: Duration,
    pubsub_name: String,
    topic: String,
    pending: Mutex<HashMap<String, Waiting>>,
    next_batch: std::sync::atomic::AtomicU64,
}

impl Bulker {
    /// Sends batches to `sink`, each answered within `timeout`.
    pub fn new(
        settings: BulkSettings,
        sink: Sink,
        timeout: Duration,
        pubsub_name: String,
        topic: String,
    ) -> Arc<Self> {
        Arc::new(Self {
            settings,
            sink,
            timeout,
            pubsub_name,
            topic,
            pending: Mutex::default(),
            next_batch: Default::default(),
        })
    }

    /// Adds `entry` to the batch bound for `path` and waits for its answer: the batch goes
    /// when it is full, or `max_await` after its first entry.
    pub async fn deliver(self: &Arc<Self>, path: &str, entry: Entry) -> Called {
        let (tx, rx) = oneshot::channel();
        let full = {
            let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            let waiting = pending.entry(path.to_owned()).or_insert_with(|| {
                let batch = self
                    .next_batch
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let this = Arc::clone(self);
                let path = path.to_owned();
                tokio::spawn(async move {
                    tokio::time::sleep(this.settings.max_await).await;
                    if let Some(waiting) = this.take(&path, batch) {
                        this.send(&path, waiting).await;
                    }
                });
                Waiting {
                    batch,
                    entries: Vec::new(),
                }
            });
            waiting.entries.push((entry, tx));
            // Taken at once, under the lock: the next entry starts another batch.
            (waiting.entries.len() >= self.settings.max_messages)
                .then(|| pending.remove(path))
                .flatten()
        };
        if let Some(waiting) = full {
            let this = Arc::clone(self);
            let path = path.to_owned();
            tokio::spawn(async move { this.send(&path, waiting).await });
        }
        rx.await.unwrap_or_else(|_| Called {
            answer: Answer::Retry {
                reason: "the bulk request to the app was abandoned".into(),
                delay: None,
            },
            failure: None,
            crashed: false,
        })
    }

    /// Entries waiting for `path` now.
    #[cfg(test)]
    fn waiting(&self, path: &str) -> usize {
        let pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        pending.get(path).map_or(0, |w| w.entries.len())
    }

    /// Batch `batch` of `path`, when its timer fires and it is still waiting (a full batch
    /// went already, and the next one has its own timer).
    fn take(&self, path: &str, batch: u64) -> Option<Waiting> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        match pending.get(path) {
            Some(w) if w.batch == batch => pending.remove(path),
            _ => None,
        }
    }

    /// Posts a batch and hands each entry its answer.
    async fn send(&self, path: &str, waiting: Waiting) {
        // A delivery cancelled while it waited (its lock lost, the sidecar stopping) is left
        // out: its message may be another's to deliver by now.
        let (entries, waiters): (Vec<Entry>, Vec<_>) = waiting
            .entries
            .into_iter()
            .filter(|(_, waiter)| !waiter.is_closed())
            .unzip();
        if entries.is_empty() {
            return;
        }
        let ids: Vec<String> = entries.iter().map(|e| e.id.clone()).collect();
        let answers = match &self.sink {
            Sink::Http { http, base } => {
                let body = request_body(&entries, &self.pubsub_name, &self.topic);
                self.post(http, base, path, body, &ids).await
            }
            Sink::Grpc(callback) => {
                callback
                    .bulk(path, &entries, &self.pubsub_name, &self.topic)
                    .await
            }
        };
        for (waiter, called) in waiters.into_iter().zip(answers) {
            let _ = waiter.send(called);
        }
    }

    async fn post(
        &self,
        http: &reqwest::Client,
        base: &str,
        path: &str,
        body: Value,
        ids: &[String],
    ) -> Vec<Called> {
        let each = |called: Called| vec![called; ids.len()];
        let sent = http
            .post(format!("{base}{path}"))
            .timeout(self.timeout)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(serde_json::to_vec(&body).unwrap_or_default())
            .send()
            .await;
        let mut response = match sent {
            Ok(response) => response,
            Err(e) => return each(crate::transport::unanswered(&e, self.timeout)),
        };
        let status = response.status().as_u16();
        let retry_after = crate::transport::retry_after(&response);
        let mut bytes = Vec::new();
        let read = loop {
            match response.chunk().await {
                Ok(Some(chunk)) if bytes.len() < MAX_ANSWER_BYTES => {
                    bytes.extend_from_slice(&chunk)
                }
                // Longer than any list of statuses: not an answer to judge.
                Ok(Some(_)) => {
                    break Err("the app's bulk answer is longer than the limit".to_owned())
                }
                Ok(None) => break Ok(bytes),
                Err(e) => break Err(format!("the app's answer was cut off: {e}")),
            }
        };
        match read {
            Ok(bytes) => answers(status, retry_after.as_deref(), &bytes, ids)
                .into_iter()
                .map(|answer| {
                    let hard =
                        status >= 500 && !matches!(answer, Answer::Retry { delay: Some(_), .. });
                    Called {
                        answer,
                        failure: hard.then_some("status"),
                        crashed: false,
                    }
                })
                .collect(),
            Err(reason) => each(Called {
                answer: Answer::Retry {
                    reason,
                    delay: None,
                },
                failure: Some("status"),
                crashed: true,
            }),
        }
    }
}

/// The bulk request (pure), as Dapr posts it.
pub fn request_body(entries: &[Entry], pubsub_name: &str, topic: &str) -> Value {
    let entries: Vec<Value> = entries
        .iter()
        .map(|e| {
            json!({
                "entryId": e.id,
                "event": e.event,
                "contentType": e.content_type,
                "metadata": e.metadata,
            })
        })
        .collect();
    json!({
        "id": uuid::Uuid::new_v4().to_string(),
        "entries": entries,
        "metadata": {},
        "pubsubname": pubsub_name,
        "topic": topic,
        "type": "com.dapr.event.sent.bulk",
    })
}

/// What the app's answer to a bulk request means for each entry (pure). A `2xx` with
/// `statuses` settles each entry by its own (`SUCCESS`, `RETRY`, `DROP`); an entry it leaves
/// out, or gives another status, is retried: never taken as done unsaid. Any other answer
/// means for every entry what it would for one message.
pub fn answers(status: u16, retry_after: Option<&str>, body: &[u8], ids: &[String]) -> Vec<Answer> {
    let statuses = (200..300)
        .contains(&status)
        .then(|| serde_json::from_slice::<Value>(body).ok())
        .flatten()
        .and_then(|mut v| {
            // Field names as daprd's Go decoder reads them (`entryID`, `Statuses`).
            crate::dapr::go_json::fold(&mut v, &["statuses"]);
            let mut statuses = v.get_mut("statuses")?.take();
            crate::dapr::go_json::fold_each(&mut statuses, &["entryId", "status"]);
            statuses.as_array().cloned()
        });
    let Some(statuses) = statuses else {
        let answer = app::classify(status, retry_after, body);
        return vec![answer; ids.len()];
    };
    let by_id: HashMap<&str, &str> = statuses
        .iter()
        .filter_map(|s| Some((s.get("entryId")?.as_str()?, s.get("status")?.as_str()?)))
        .collect();
    ids.iter()
        .map(|id| entry_answer(id, by_id.get(id.as_str()).copied()))
        .collect()
}

/// What an entry's status in a bulk answer means (pure): `SUCCESS`, `DROP` or `RETRY` (in any
/// case); none, or another, is retried: never taken as done unsaid.
pub fn entry_answer(id: &str, status: Option<&str>) -> Answer {
    match status.map(str::to_ascii_uppercase) {
        Some(s) if s == "SUCCESS" => Answer::Success,
        Some(s) if s == "DROP" => Answer::Drop {
            reason: "the app answered DROP for this entry".into(),
        },
        Some(s) if s == "RETRY" => Answer::Retry {
            reason: "the app answered RETRY for this entry".into(),
            delay: None,
        },
        other => {
            warn!(entry = %id, status = ?other, "the app's bulk answer has no known status for an entry; retrying it");
            Answer::Retry {
                reason: format!("the app's bulk answer gave this entry {other:?}"),
                delay: None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("e{i}")).collect()
    }

    #[tokio::test]
    async fn a_delivery_cancelled_while_it_waits_is_not_posted() {
        let posted: Arc<Mutex<Vec<Vec<String>>>> = Arc::default();
        let app = {
            let posted = posted.clone();
            axum::Router::new().route(
                "/bulk",
                axum::routing::post(move |axum::Json(body): axum::Json<Value>| {
                    let posted = posted.clone();
                    async move {
                        let ids: Vec<String> = body["entries"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .map(|e| e["entryId"].as_str().unwrap_or_default().to_owned())
                            .collect();
                        let statuses: Vec<Value> = ids
                            .iter()
                            .map(|id| json!({"entryId": id, "status": "SUCCESS"}))
                            .collect();
                        posted.lock().unwrap().push(ids);
                        axum::Json(json!({ "statuses": statuses }))
                    }
                }),
            )
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        // Full at three; the timer is far off, so only a full batch goes.
        let settings = BulkSettings {
            max_messages: 3,
            max_await: Duration::from_secs(600),
        };
        let bulker = Bulker::new(
            settings,
            Sink::Http {
                http: cosmosq_queue::cosmos::tls::http_client_builder()
                    .build()
                    .expect("an HTTP client"),
                base,
            },
            Duration::from_secs(10),
            "cosmosq".into(),
            "q".into(),
        );
        let entry = |id: &str| Entry {
            id: id.into(),
            event: json!({"id": id}),
            content_type: "application/json".into(),
            metadata: Default::default(),
            raw: None,
        };
        let spawn = |id: &str| {
            let (bulker, entry) = (Arc::clone(&bulker), entry(id));
            tokio::spawn(async move { bulker.deliver("/bulk", entry).await })
        };
        let first = spawn("a");
        let cancelled = spawn("b");
        while bulker.waiting("/bulk") < 2 {
            tokio::task::yield_now().await;
        }
        cancelled.abort();
        assert!(cancelled.await.unwrap_err().is_cancelled());
        // The third fills the batch, which goes at once without the cancelled entry.
        assert_eq!(
            bulker.deliver("/bulk", entry("c")).await.answer,
            Answer::Success
        );
        assert_eq!(first.await.unwrap().answer, Answer::Success);
        assert_eq!(
            *posted.lock().unwrap(),
            [vec!["a".to_owned(), "c".to_owned()]]
        );
    }

    #[test]
    fn each_entry_is_settled_by_its_own_status() {
        let body = json!({"statuses": [
            {"entryId": "e0", "status": "SUCCESS"},
            {"entryId": "e1", "status": "RETRY"},
            {"entryId": "e2", "status": "DROP"},
            {"entryId": "e3", "status": "MAYBE"}
        ]});
        let answers = answers(200, None, &serde_json::to_vec(&body).unwrap(), &ids(5));
        assert_eq!(answers[0], Answer::Success);
        assert!(matches!(answers[1], Answer::Retry { .. }));
        assert!(matches!(answers[2], Answer::Drop { .. }));
        assert!(
            matches!(answers[3], Answer::Retry { .. }),
            "unknown: retried"
        );
        assert!(
            matches!(answers[4], Answer::Retry { .. }),
            "left out: retried, not done"
        );
    }

    #[test]
    fn statuses_are_read_with_go_field_names() {
        // As daprd reads an SDK's answer: names in any case.
        let body = json!({"Statuses": [
            {"entryID": "e0", "Status": "SUCCESS"},
            {"EntryId": "e1", "status": "DROP"}
        ]});
        let answers = answers(200, None, &serde_json::to_vec(&body).unwrap(), &ids(2));
        assert_eq!(answers[0], Answer::Success);
        assert!(matches!(answers[1], Answer::Drop { .. }));
    }

    #[test]
    fn an_answer_without_statuses_means_for_each_what_it_would_for_one() {
        assert_eq!(answers(200, None, b"", &ids(2)), vec![Answer::Success; 2]);
        let failed = answers(503, Some("7"), b"", &ids(2));
        assert!(failed.iter().all(|a| matches!(
            a,
            Answer::Retry {
                delay: Some(d),
                ..
            } if *d == Duration::from_secs(7)
        )));
        // A 5xx that lists statuses is still a failure of the whole request.
        let listed = json!({"statuses": [{"entryId": "e0", "status": "SUCCESS"}]});
        let failed = answers(500, None, &serde_json::to_vec(&listed).unwrap(), &ids(1));
        assert!(matches!(failed[0], Answer::Retry { .. }));
    }

    #[test]
    fn the_request_is_dapr_s_bulk_envelope() {
        let entry = Entry {
            id: "e0".into(),
            event: json!({"specversion": "1.0", "data": {"n": 1}}),
            content_type: "application/cloudevents+json".into(),
            metadata: Default::default(),
            raw: None,
        };
        let body = request_body(&[entry], "pubsub", "orders");
        assert_eq!(body["type"], "com.dapr.event.sent.bulk");
        assert_eq!(
            (&body["pubsubname"], &body["topic"]),
            (&json!("pubsub"), &json!("orders"))
        );
        assert_eq!(body["entries"][0]["entryId"], "e0");
        assert_eq!(body["entries"][0]["event"]["data"]["n"], 1);
        assert_eq!(
            body["entries"][0]["contentType"],
            "application/cloudevents+json"
        );
    }
}
