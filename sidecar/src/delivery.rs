//! Delivering messages to the app, and what its answers become: the circuit breaker, crash
//! isolation and metrics around each call, the same for every transport (`transport.rs`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cosmosq_queue::{Delivery, Handler, Outcome};
use tracing::{debug, warn};

use crate::app::Answer;
use crate::breaker::{Admission, Breaker};
use crate::isolation::{Blame, Isolation};
use crate::metrics::SidecarMetrics;
use crate::transport::{AppTransport, Called, HttpTransport};

/// The app behind localhost, as a [`Handler`].
/// Hard failures in a row (refused, timed out, 5xx) that open the breaker on the app.
const BREAKER_FAILURES: u32 = 5;
/// How long the breaker first stays open before one probe is let through; doubled each time
/// the probe fails, up to `BREAKER_MAX_OPEN`.
const BREAKER_FIRST_OPEN: Duration = Duration::from_secs(1);
const BREAKER_MAX_OPEN: Duration = Duration::from_secs(30);

/// The app next to the sidecar, as the engine's [`Handler`]: breaker, isolation and metrics
/// around each call its transport makes.
pub struct AppClient<T = HttpTransport> {
    transport: T,
    breaker: Mutex<Breaker>,
    isolation: Mutex<Isolation>,
    /// Shared by deliveries side by side, exclusive while isolating (see [`crate::isolation`]).
    gate: tokio::sync::RwLock<()>,
    metrics: Arc<SidecarMetrics>,
}

impl<T: AppTransport> AppClient<T> {
    /// How it reaches the app.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// The app, reached through `transport`.
    pub fn new(transport: T, metrics: Arc<SidecarMetrics>) -> Self {
        Self {
            transport,
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
                Admission::Go => return false,
                Admission::Probe => return true,
                Admission::Wait(d) => tokio::time::sleep(d.max(Duration::from_millis(10))).await,
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
}

impl<T: AppTransport> Handler for AppClient<T> {
    async fn handle(&self, delivery: Delivery) -> Outcome {
        let probe = self.admitted().await;
        let alone = self.lock_isolation().active();
        let (_shared, _alone) = if alone {
            (None, Some(self.gate.write().await))
        } else {
            (Some(self.gate.read().await), None)
        };
        self.metrics.in_flight.inc();
        let started = std::time::Instant::now();
        let Called {
            answer,
            failure,
            crashed,
        } = self.transport.call(&delivery).await;
        self.metrics
            .app_latency
            .observe(started.elapsed().as_secs_f64());
        self.metrics.in_flight.dec();
        let hard = failure.is_some();
        if let Some(kind) = failure {
            self.metrics.app_errors.with_label_values(&[kind]).inc();
        }
        // A crash is judged per message by the isolation below, not by the breaker: a poison
        // message that crashes the app would otherwise open it for ever longer cool-downs and
        // stall every other message. An app that stays down refuses connections, which count.
        self.record(hard && !crashed);
        if self.lock_isolation().observe(crashed, alone) == Blame::Isolate {
            warn!(message_id = %delivery.message.id, "the app went down with other deliveries in flight; delivering them again one at a time, uncounted");
            return Outcome::Undelivered {
                reason: format!(
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
            Answer::Retry {
                reason,
                delay: after,
            } => {
                warn!(message_id = %delivery.message.id, delivery_count = delivery.delivery_count, %reason, "delivery failed; retrying");
                Outcome::Retry {
                    reason,
                    delay: after,
                }
            }
            Answer::Drop { reason } => Outcome::DeadLetter {
                reason: "DroppedByApp".into(),
                description: reason,
            },
            Answer::Undelivered { reason } => Outcome::Undelivered {
                reason,
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// A transport that answers from a script: the policy around calls, without HTTP.
    struct Scripted(Mutex<VecDeque<Called>>);

    impl AppTransport for Scripted {
        async fn call(&self, _: &Delivery) -> Called {
            self.0
                .lock()
                .unwrap()
                .pop_front()
                .expect("a scripted answer")
        }
    }

    fn delivery() -> Delivery {
        Delivery {
            message: cosmosq_queue::NewMessage::json(serde_json::json!({"n": 1}))
                .with_id("m-1")
                .into_message(0)
                .unwrap(),
            delivery_count: 1,
            group: "g".into(),
            queue: "q".into(),
            locked_until: Default::default(),
        }
    }

    fn called(answer: Answer, failure: Option<&'static str>) -> Called {
        Called {
            answer,
            failure,
            crashed: false,
        }
    }

    fn retry(reason: &str, after: Option<Duration>) -> Answer {
        Answer::Retry {
            reason: reason.into(),
            delay: after,
        }
    }

    #[tokio::test]
    async fn every_transport_answer_becomes_the_outcome_the_contract_names() {
        let after = Some(Duration::from_secs(7));
        let cases = [
            (called(Answer::Success, None), Outcome::Complete),
            (
                called(retry("busy", after), None),
                Outcome::Retry {
                    reason: "busy".into(),
                    delay: after,
                },
            ),
            (
                called(
                    Answer::Drop {
                        reason: "bad order".into(),
                    },
                    None,
                ),
                Outcome::DeadLetter {
                    reason: "DroppedByApp".into(),
                    description: "bad order".into(),
                },
            ),
            (
                called(
                    Answer::Undelivered {
                        reason: "refused".into(),
                    },
                    Some("connect"),
                ),
                Outcome::Undelivered {
                    reason: "refused".into(),
                    delay: None,
                },
            ),
            (
                called(retry("no answer", None), Some("timeout")),
                Outcome::Retry {
                    reason: "no answer".into(),
                    delay: None,
                },
            ),
        ];
        let metrics = Arc::new(SidecarMetrics::new("q", "g"));
        let script = cases.iter().map(|(c, _)| c.clone()).collect();
        let app = AppClient::new(Scripted(Mutex::new(script)), Arc::clone(&metrics));
        for (call, expected) in cases {
            assert_eq!(app.handle(delivery()).await, expected, "{call:?}");
        }
        let errors = |kind: &str| metrics.app_errors.with_label_values(&[kind]).get();
        assert_eq!((errors("connect"), errors("timeout")), (1, 1));
        assert_eq!(metrics.app_latency.get_sample_count(), 5);
        assert_eq!(metrics.in_flight.get(), 0);
    }

    /// Five failures in a row open the breaker: the sixth delivery waits out the cool-down
    /// instead of hammering an app that cannot take work.
    #[tokio::test(start_paused = true)]
    async fn failures_in_a_row_hold_the_next_delivery_back() {
        let down = || called(retry("503", None), Some("status"));
        let script = (0..=BREAKER_FAILURES).map(|_| down()).collect();
        let app = AppClient::new(
            Scripted(Mutex::new(script)),
            Arc::new(SidecarMetrics::new("q", "g")),
        );
        for _ in 0..BREAKER_FAILURES {
            app.handle(delivery()).await;
        }
        let before = tokio::time::Instant::now();
        app.handle(delivery()).await;
        assert!(
            before.elapsed() >= BREAKER_FIRST_OPEN,
            "the probe waited {:?}",
            before.elapsed()
        );
    }
}
