//! How a delivery reaches the app: one call, and what its answer means. HTTP (Dapr's pub/sub
//! contract, built and read by `app.rs`) is the transport today. Another protocol (gRPC, say)
//! is another [`AppTransport`]: everything around a call — the circuit breaker, crash
//! isolation, metrics and the outcome the engine records — stays in `delivery.rs`, the same
//! for every transport.

use std::future::Future;
use std::time::Duration;

use cosmosq_queue::Delivery;
use tracing::warn;

use crate::app::{self, Answer, Format};

/// The most of an answer's body we read: enough for `{"status": ...}`. A longer answer is
/// judged by [`app::classify_prefix`]; the rest is dropped with the connection.
const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// What one call to the app came to.
#[derive(Clone, Debug, PartialEq)]
pub struct Called {
    /// What the app's answer means for the message.
    pub answer: Answer,
    /// The app could not take work at all (unreachable, timed out, failing without a
    /// `Retry-After`): what the circuit breaker counts, and the kind the metrics count it
    /// under (`connect`, `timeout`, `status`, `transport`).
    pub failure: Option<&'static str>,
    /// The app went down under it (the connection reset, or the answer cut off): judged by
    /// the crash isolation, not the breaker.
    pub crashed: bool,
}

/// A way to hand one delivery to the app.
pub trait AppTransport: Send + Sync + 'static {
    /// Delivers once and reads the answer; never longer than the app's timeout.
    fn call(&self, delivery: &Delivery) -> impl Future<Output = Called> + Send;
}

/// `POST http://127.0.0.1:<port><path>`, as Dapr's pub/sub delivers.
pub struct HttpTransport {
    http: reqwest::Client,
    url: String,
    format: Format,
    timeout: Duration,
}

impl HttpTransport {
    /// The app at `127.0.0.1:<port><path>`, answering within `timeout`.
    pub fn new(port: u16, path: &str, format: Format, timeout: Duration) -> Self {
        Self {
            http: reqwest::Client::builder()
                .no_proxy()
                .pool_idle_timeout(Duration::from_secs(30))
                .build()
                .expect("a plain HTTP client builds"),
            url: format!("http://127.0.0.1:{port}{path}"),
            format,
            timeout,
        }
    }
}

impl AppTransport for HttpTransport {
    async fn call(&self, delivery: &Delivery) -> Called {
        let request = app::build_request(delivery, self.format, &app::trace(delivery));
        let mut builder = self
            .http
            .post(&self.url)
            .timeout(self.timeout)
            .header(reqwest::header::CONTENT_TYPE, request.content_type)
            .body(request.body);
        for (name, value) in &request.headers {
            builder = builder.header(name.as_str(), value.as_str());
        }
        let retry = |reason: String| Answer::Retry {
            reason,
            after: None,
        };
        match builder.send().await {
            Ok(mut response) => {
                let status = response.status().as_u16();
                let retry_after = response
                    .headers()
                    .get(reqwest::header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned);
                let mut body = Vec::new();
                let mut cut_off = None;
                while body.len() <= MAX_ANSWER_BYTES {
                    match tokio::time::timeout(self.timeout, response.chunk()).await {
                        Ok(Ok(Some(chunk))) => body.extend_from_slice(&chunk),
                        Ok(Ok(None)) => break,
                        Ok(Err(e)) => {
                            cut_off = Some(format!("the app's answer was cut off: {e}"));
                            break;
                        }
                        Err(_) => {
                            cut_off = Some(format!(
                                "the app's answer did not finish within {:?}",
                                self.timeout
                            ));
                            break;
                        }
                    }
                }
                let crashed = cut_off.is_some();
                let answer = match cut_off {
                    // Half an answer is no answer: the app may have crashed mid-way.
                    Some(reason) => retry(reason),
                    None if body.len() > MAX_ANSWER_BYTES => {
                        body.truncate(MAX_ANSWER_BYTES);
                        warn!(message_id = %delivery.message.id, limit = MAX_ANSWER_BYTES, "the app's answer is longer than the limit; judging it by its start");
                        app::classify_prefix(status, retry_after.as_deref(), &body)
                    }
                    None => app::classify(status, retry_after.as_deref(), &body),
                };
                let hard = crashed
                    || status >= 500 && !matches!(answer, Answer::Retry { after: Some(_), .. });
                Called {
                    answer,
                    failure: hard.then_some("status"),
                    crashed,
                }
            }
            Err(e) if e.is_timeout() => Called {
                answer: retry(format!("the app did not answer within {:?}", self.timeout)),
                failure: Some("timeout"),
                crashed: false,
            },
            Err(e) if e.is_connect() => Called {
                answer: Answer::Undelivered {
                    reason: "the app refused the connection".to_owned(),
                },
                failure: Some("connect"),
                crashed: false,
            },
            Err(e) => Called {
                answer: retry(format!("the request to the app failed: {e}")),
                failure: Some("transport"),
                crashed: true,
            },
        }
    }
}
