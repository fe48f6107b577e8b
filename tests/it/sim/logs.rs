//! The engine's logs of one history, kept in memory with simulated timestamps and written out
//! only when the history fails (`COSMOSQ_SIM_LOG` sets the filter; `warn` by default), and its
//! ledger events (`cosmosq::ledger`: when a completion, a dead letter or a start became
//! durable), which the checks read.

use std::io::Write;
use std::sync::{Arc, Mutex};

use tracing::field::{Field, Visit};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::FormatTime;
use tracing_subscriber::layer::{Context, SubscriberExt as _};
use tracing_subscriber::Layer;

#[derive(Clone)]
struct Buffer(Arc<Mutex<Vec<u8>>>);

impl Write for Buffer {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let mut buffer = self.0.lock().unwrap_or_else(|e| e.into_inner());
        // The tail is what explains a failure: keep the last 4 MB.
        if buffer.len() > 8 << 20 {
            buffer.drain(..4 << 20);
        }
        buffer.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Simulated milliseconds since the history began.
struct Simulated(tokio::time::Instant);

impl FormatTime for Simulated {
    fn format_time(&self, w: &mut Writer<'_>) -> std::fmt::Result {
        write!(w, "{:>8}ms", self.0.elapsed().as_millis())
    }
}

/// A promise the engine recorded as durable.
#[derive(Clone, Debug, Default)]
pub struct Recorded {
    pub at: u64,
    /// `completed`, `dead-lettered`, `started` (its `id`: the identities listed), or a lease
    /// event.
    pub event: String,
    pub group: String,
    pub id: String,
    pub key: String,
    /// Lease events: the lease, its owner, and who asked.
    pub lease: String,
    pub owner: String,
    pub by: String,
}

#[derive(Default)]
struct Fields(Recorded);

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        let slot = match field.name() {
            "event" => &mut self.0.event,
            "group" => &mut self.0.group,
            "id" => &mut self.0.id,
            "key" => &mut self.0.key,
            "lease" => &mut self.0.lease,
            "owner" => &mut self.0.owner,
            "by" => &mut self.0.by,
            _ => return,
        };
        *slot = value.to_owned();
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        // `key = %…` arrives as Display through Debug.
        self.record_str(field, &format!("{value:?}"));
    }
}

struct Ledgered {
    into: Arc<Mutex<Vec<Recorded>>>,
    origin: tokio::time::Instant,
}

impl<S: tracing::Subscriber> Layer<S> for Ledgered {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        fields.0.at = self.origin.elapsed().as_millis() as u64;
        self.into
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(fields.0);
    }
}

/// Sends this thread's logs to `log` and its ledger events to `recorded` until the guard
/// drops. Made inside the history's runtime (its clock is the simulated one).
pub fn capture(
    log: &Arc<Mutex<Vec<u8>>>,
    recorded: &Arc<Mutex<Vec<Recorded>>>,
) -> tracing::subscriber::DefaultGuard {
    let buffer = Buffer(Arc::clone(log));
    let filter = tracing_subscriber::EnvFilter::try_from_env("COSMOSQ_SIM_LOG")
        .unwrap_or_else(|_| "warn".into());
    let origin = tokio::time::Instant::now();
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(false)
        .with_target(false)
        .with_timer(Simulated(origin))
        .with_writer(move || buffer.clone())
        .with_filter(filter);
    let ledger = Ledgered {
        into: Arc::clone(recorded),
        origin,
    }
    .with_filter(
        tracing_subscriber::filter::Targets::new()
            .with_target(cosmosq_queue::ledger::TARGET, tracing::Level::DEBUG),
    );
    let subscriber = tracing_subscriber::registry().with(fmt).with(ledger);
    tracing::subscriber::set_default(subscriber)
}
