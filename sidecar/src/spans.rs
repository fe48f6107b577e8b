//! The sidecar's spans, exported when OTLP is on (see `cosmosq_program::telemetry`), named and
//! attributed as OpenTelemetry's messaging conventions say: one `send <queue>` (producer) per
//! publish request, one `process <queue>` (consumer) per delivery attempt, from the hand-over
//! to the app (or a pull worker) until the outcome. Each hands its own context on — to the
//! stored message, to the app — so the app's work is a child of the delivery, and the
//! delivery of the publish. With export off, contexts pass through unchanged.

use axum::http::HeaderMap;
use cosmosq_program::telemetry::{Attribute, Kind, Span, Telemetry};
use cosmosq_queue::{Delivery, NewMessage, Outcome, TraceContext};

use crate::api::ApiState;

/// `messaging.system` for this queue (not one of the conventions' well-known values).
const SYSTEM: &str = "cosmosq";

/// The span of one publish request, and the context what it enqueues carries.
pub struct Publish {
    span: Span,
    /// The span's own context, what its messages carry (`None` without export).
    context: Option<TraceContext>,
    parent: Option<TraceContext>,
}

impl Publish {
    /// Starts the span of publishing `count` messages to `queue`, under `parent` (the
    /// caller's context or, for one message, the one it carries).
    pub fn start(
        telemetry: &Telemetry,
        queue: &str,
        parent: Option<TraceContext>,
        count: usize,
    ) -> Self {
        let span = telemetry.span(Kind::Producer, parent.as_ref(), || {
            let mut attributes = vec![
                Attribute::new("messaging.system", SYSTEM),
                Attribute::new("messaging.operation.type", "send"),
                Attribute::new("messaging.operation.name", "send"),
                Attribute::new("messaging.destination.name", queue.to_owned()),
            ];
            if count != 1 {
                attributes.push(Attribute::new(
                    "messaging.batch.message_count",
                    i64::try_from(count).unwrap_or(i64::MAX),
                ));
            }
            (format!("send {queue}"), attributes)
        });
        let context = span.context();
        Self {
            span,
            context,
            parent,
        }
    }

    /// The span of publishing one message through the local API: under the context it
    /// carries, or the caller's.
    pub(crate) fn one(
        state: &ApiState,
        queue: &str,
        headers: &HeaderMap,
        message: &NewMessage,
    ) -> Self {
        let parent = TraceContext::from_metadata(&message.metadata)
            .or_else(|| crate::api::caller_trace(headers));
        Self::start(&state.telemetry, queue, parent, 1)
    }

    /// A message as it is enqueued: a context of its own that is not this span's parent
    /// stays; otherwise it carries this span's context (or, without export, the caller's).
    pub fn stamp(&self, message: NewMessage) -> NewMessage {
        let Some(context) = &self.context else {
            return message.inherit_trace(self.parent.as_ref());
        };
        let own = TraceContext::from_metadata(&message.metadata);
        if own.is_none() || own == self.parent {
            message.with_trace_context(context)
        } else {
            message
        }
    }

    /// Records that some of the request's messages were not enqueued.
    pub fn failed(&mut self, refused: usize, why: &str) {
        self.span.set(Attribute::new(
            "cosmosq.publish.refused",
            i64::try_from(refused).unwrap_or(i64::MAX),
        ));
        self.span.fail(why.to_owned());
    }
}

/// Starts the span of one delivery attempt, under the context the message carries, and puts
/// the span's own context in the delivery, so the app's request names it as its parent.
pub fn process(telemetry: &Telemetry, delivery: &mut Delivery) -> Span {
    if !telemetry.enabled() {
        return Span::inert(); // nor the message's context parsed
    }
    let parent = TraceContext::from_metadata(&delivery.message.metadata);
    let span = telemetry.span(Kind::Consumer, parent.as_ref(), || {
        let attributes = vec![
            Attribute::new("messaging.system", SYSTEM),
            Attribute::new("messaging.operation.type", "process"),
            Attribute::new("messaging.operation.name", "process"),
            Attribute::new("messaging.destination.name", delivery.queue.clone()),
            Attribute::new("messaging.consumer.group.name", delivery.group.clone()),
            Attribute::new("messaging.message.id", delivery.message.id.clone()),
            Attribute::new(
                "cosmosq.message.delivery_count",
                i64::from(delivery.delivery_count),
            ),
        ];
        (format!("process {}", delivery.queue), attributes)
    });
    if let Some(context) = span.context() {
        context.store(&mut delivery.message.metadata);
    }
    span
}

/// Ends a delivery's span with what became of the message.
pub fn settled(mut span: Span, outcome: &Outcome) {
    let (name, error) = match outcome {
        Outcome::Complete => ("complete", None),
        Outcome::Retry { reason: error, .. } => ("retry", Some(error)),
        Outcome::DeadLetter {
            description: error, ..
        } => ("dead_letter", Some(error)),
        Outcome::Undelivered { reason: error, .. } => ("undelivered", Some(error)),
    };
    span.set(Attribute::new("cosmosq.outcome", name));
    if let Some(error) = error {
        span.fail(error.clone());
    }
    span.end();
}
