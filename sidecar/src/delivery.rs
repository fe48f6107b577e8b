//! Delivering messages to the app over localhost HTTP, and what its answers become.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cosmosq_queue::{Delivery, Handler, Outcome};
use tracing::{debug, warn};

use crate::app::{self, Answer, Format};
use crate::breaker::{Breaker, Permit};
use crate::isolation::{Isolation, Verdict};
use crate::metrics::Metrics;

/// The most of an answer's body we read: enough for `{"status": ...}`. A longer answer is
/// judged by [`app::classify_prefix`]; the rest is dropped with the connection.
const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// The app behind localhost, as a [`Handler`].
/// Hard failures in a row (refused, timed out, 5xx) that open the breaker on the app.
const BREAKER_FAILURES: u32 = 5;
/// How long the breaker first stays open before one probe is let through; doubled each time
/// the probe fails, up to `BREAKER_MAX_OPEN`.
const BREAKER_FIRST_OPEN: Duration = Duration::from_secs(1);
const BREAKER_MAX_OPEN: Duration = Duration::from_secs(30);

/// The app on localhost, as the engine's [`Handler`]: breaker, isolation and metrics around each delivery.
pub struct AppClient {
    http: reqwest::Client,
    url: String,
    format: Format,
    timeout: Duration,
    breaker: Mutex<Breaker>,
    isolation: Mutex<Isolation>,
    /// Shared by deliveries side by side, exclusive while isolating (see [`crate::isolation`]).
    gate: tokio::sync::RwLock<()>,
    metrics: Arc<Metrics>,
}

impl AppClient {
    /// The app at `127.0.0.1:<port><path>`.
    pub fn new(
        port: u16,
        path: &str,
        format: Format,
        timeout: Duration,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            http: reqwest::Client::builder()
                .no_proxy()
                .pool_idle_timeout(Duration::from_secs(30))
                .build()
                .expect("a plain HTTP client builds"),
            url: format!("http://127.0.0.1:{port}{path}"),
            format,
            timeout,
            breaker: Mutex::new(Breaker::new(
                BREAKER_FAILURES,
                BREAKER_FIRST_OPEN,
                BREAKER_MAX_OPEN,
            )),
            isolation: Mutex::default(),
            gate: tokio::sync::RwLock::new(()),
            metrics,
        }
    }

    /// Waits until the breaker lets a delivery through; `true` if this one is the probe.
    async fn admitted(&self) -> bool {
        loop {
            let permit = self
                .breaker
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .permit(tokio::time::Instant::now());
            match permit {
                Permit::Go => return false,
                Permit::Probe => return true,
                Permit::Wait(d) => tokio::time::sleep(d.max(Duration::from_millis(10))).await,
            }
        }
    }

    fn lock_isolation(&self) -> std::sync::MutexGuard<'_, Isolation> {
        self.isolation.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn record(&self, hard_failure: bool) {
        self.breaker
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .record(hard_failure, tokio::time::Instant::now());
    }

    /// The app's answer; whether it means the app could not take work at all (unreachable,
    /// timing out, 5xx without `Retry-After`): what the circuit breaker counts; and whether
    /// the app went down under it (the connection reset, or the answer cut off).
    async fn call(&self, delivery: &Delivery) -> (Answer, bool, bool) {
        let traceparent = app::traceparent(delivery);
        let request = app::build_request(delivery, self.format, &traceparent);
        let mut builder = self
            .http
            .post(&self.url)
            .timeout(self.timeout)
            .header(reqwest::header::CONTENT_TYPE, request.content_type)
            .body(request.body);
        for (name, value) in &request.headers {
            builder = builder.header(name.as_str(), value.as_str());
        }
        let started = std::time::Instant::now();
        let result = builder.send().await;
        let answer = match result {
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
                    Some(reason) => Answer::Retry {
                        reason,
                        after: None,
                    },
                    None if body.len() > MAX_ANSWER_BYTES => {
                        body.truncate(MAX_ANSWER_BYTES);
                        warn!(message_id = %delivery.message.id, limit = MAX_ANSWER_BYTES, "the app's answer is longer than the limit; judging it by its start");
                        app::classify_prefix(status, retry_after.as_deref(), &body)
                    }
                    None => app::classify(status, retry_after.as_deref(), &body),
                };
                let hard = crashed
                    || status >= 500 && !matches!(answer, Answer::Retry { after: Some(_), .. });
                if hard {
                    self.metrics.app_errors.with_label_values(&["status"]).inc();
                }
                (answer, hard, crashed)
            }
            Err(e) if e.is_timeout() => {
                self.metrics
                    .app_errors
                    .with_label_values(&["timeout"])
                    .inc();
                let reason = format!("the app did not answer within {:?}", self.timeout);
                (
                    Answer::Retry {
                        reason,
                        after: None,
                    },
                    true,
                    false,
                )
            }
            Err(e) if e.is_connect() => {
                self.metrics
                    .app_errors
                    .with_label_values(&["connect"])
                    .inc();
                let reason = "the app refused the connection".to_owned();
                (Answer::Undelivered { reason }, true, false)
            }
            Err(e) => {
                self.metrics
                    .app_errors
                    .with_label_values(&["transport"])
                    .inc();
                let reason = format!("the request to the app failed: {e}");
                (
                    Answer::Retry {
                        reason,
                        after: None,
                    },
                    true,
                    true,
                )
            }
        };
        self.metrics
            .app_latency
            .observe(started.elapsed().as_secs_f64());
        answer
    }
}

impl Handler for AppClient {
    async fn handle(&self, delivery: Delivery) -> Outcome {
        let probe = self.admitted().await;
        let alone = self.lock_isolation().active();
        let (_shared, _alone) = if alone {
            (None, Some(self.gate.write().await))
        } else {
            (Some(self.gate.read().await), None)
        };
        self.metrics.in_flight.inc();
        let (answer, hard, crashed) = self.call(&delivery).await;
        self.metrics.in_flight.dec();
        // A crash is judged per message by the isolation below, not by the breaker: a poison
        // message that crashes the app would otherwise open it for ever longer cool-downs and
        // stall every other message. An app that stays down refuses connections, which count.
        self.record(hard && !crashed);
        if self.lock_isolation().observe(crashed, alone) == Verdict::Isolate {
            warn!(message_id = %delivery.message.id, "the app went down with other deliveries in flight; delivering them again one at a time, uncounted");
            return Outcome::Undelivered {
                error: format!(
                    "{} with other deliveries in flight (not counted: delivered again alone)",
                    answer_reason(&answer)
                ),
                delay: None,
            };
        }
        if probe {
            debug!(message_id = %delivery.message.id, recovered = !hard, "probe delivery to a failing app");
        }
        let now = cosmosq_queue::clock::system_now_ms();
        let waited = (now - delivery.message.enqueued_at).max(0) as f64 / 1000.0;
        self.metrics.end_to_end.observe(waited);
        match answer {
            Answer::Success => Outcome::Complete,
            Answer::Retry { reason, after } => {
                warn!(message_id = %delivery.message.id, delivery_count = delivery.delivery_count, %reason, "delivery failed; retrying");
                Outcome::Retry {
                    error: reason,
                    delay: after,
                }
            }
            Answer::Drop { reason } => Outcome::DeadLetter {
                reason: "DroppedByApp".into(),
                error: reason,
            },
            Answer::Undelivered { reason } => Outcome::Undelivered {
                error: reason,
                delay: None,
            },
        }
    }
}

fn answer_reason(answer: &Answer) -> &str {
    match answer {
        Answer::Success => "success",
        Answer::Retry { reason, .. } | Answer::Drop { reason } | Answer::Undelivered { reason } => {
            reason
        }
    }
}
