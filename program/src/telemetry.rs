//! Optional OTLP export of the programs' spans (the sidecar's publish and process spans, the
//! operator's reconciles), so a trace given at enqueue shows the queue's part in the user's
//! tracing backend. Off unless `OTEL_EXPORTER_OTLP_ENDPOINT` (or `…_TRACES_ENDPOINT`) is set,
//! as OpenTelemetry SDKs do; OTLP over HTTP (`http/protobuf`, the spec's default, or
//! `http/json`), sent by the reqwest client already in the tree rather than a gRPC stack.
//!
//! Each program holds its own [`Telemetry`] (no global provider), so several sidecars in one test
//! process export apart and a program that never turns it on pays one `Option` per span.
//! That is also why spans are not exported through `tracing-opentelemetry`: its layer hangs on
//! tracing's subscriber, which is one per process (or per thread, which spawned tasks leave),
//! so the sidecars of `cosmosq demo` and of the tests could not each export to their own
//! collector, and `tracing`'s spans would still need the W3C context carried into and out of
//! messages by hand.
//! Headers (`OTEL_EXPORTER_OTLP_HEADERS`, often an API key) are read by the exporter from the
//! environment and never pass through the configuration, so they cannot reach a log.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId,
    TraceState, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use opentelemetry_sdk::Resource;

use cosmosq_queue::trace::TraceContext;

pub use opentelemetry::trace::SpanKind as Kind;
pub use opentelemetry::KeyValue as Attribute;

/// How long a stopping program waits for its last spans to be sent.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// Why export could not start: the setting is named.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// A setting the exporter cannot use.
    #[error("{setting}: {why}")]
    Config {
        /// The environment variable.
        setting: &'static str,
        /// What is wrong with it, and what to use.
        why: String,
    },
    /// The exporter refused its configuration.
    #[error("the OTLP exporter: {0}")]
    Exporter(String),
}

/// The standard `OTEL_*` settings this program reads.
#[derive(clap::Args, Clone, Debug, Default, PartialEq, Eq)]
pub struct OtlpArgs {
    /// Where OTLP/HTTP goes (`/v1/traces` is appended); export is off without it.
    #[arg(long = "otlp-endpoint", env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// The full URL for traces, taken as it is (wins over `--otlp-endpoint`).
    #[arg(
        long = "otlp-traces-endpoint",
        env = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    )]
    pub otlp_traces_endpoint: Option<String>,
    /// `http/protobuf` (default) or `http/json`.
    #[arg(long = "otlp-protocol", env = "OTEL_EXPORTER_OTLP_PROTOCOL")]
    pub otlp_protocol: Option<String>,
    /// The protocol for traces (wins over `--otlp-protocol`).
    #[arg(
        long = "otlp-traces-protocol",
        env = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
    )]
    pub otlp_traces_protocol: Option<String>,
    /// `otlp` (default when an endpoint is set) or `none`.
    #[arg(long = "otel-traces-exporter", env = "OTEL_TRACES_EXPORTER")]
    pub otel_traces_exporter: Option<String>,
    /// `true` turns every export off.
    #[arg(long = "otel-sdk-disabled", env = "OTEL_SDK_DISABLED")]
    pub otel_sdk_disabled: Option<String>,
    /// The service name spans carry (`OTEL_RESOURCE_ATTRIBUTES` adds to the resource).
    #[arg(long = "otel-service-name", env = "OTEL_SERVICE_NAME")]
    pub otel_service_name: Option<String>,
}

/// What the settings ask for (pure).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Export {
    /// The URL spans are posted to.
    pub url: String,
    /// Protobuf or JSON bodies.
    pub json: bool,
}

fn given(value: &Option<String>) -> Option<&str> {
    value.as_deref().map(str::trim).filter(|v| !v.is_empty())
}

impl OtlpArgs {
    /// The standard variables that are set, for a child process or container to read back.
    pub fn to_env(&self) -> Vec<(&'static str, String)> {
        [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &self.otlp_endpoint),
            (
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                &self.otlp_traces_endpoint,
            ),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", &self.otlp_protocol),
            (
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                &self.otlp_traces_protocol,
            ),
            ("OTEL_TRACES_EXPORTER", &self.otel_traces_exporter),
            ("OTEL_SDK_DISABLED", &self.otel_sdk_disabled),
            ("OTEL_SERVICE_NAME", &self.otel_service_name),
        ]
        .into_iter()
        .filter_map(|(name, value)| Some((name, value.clone()?)))
        .collect()
    }

    /// Export to an endpoint (tests and the local run).
    pub fn to_endpoint(endpoint: impl Into<String>) -> Self {
        Self {
            otlp_endpoint: Some(endpoint.into()),
            ..Self::default()
        }
    }

    /// Where and how spans go; `None` when export is off (pure).
    pub fn export(&self) -> Result<Option<Export>, TelemetryError> {
        let bad = |setting, why: String| Err(TelemetryError::Config { setting, why });
        if given(&self.otel_sdk_disabled).is_some_and(|v| v.eq_ignore_ascii_case("true")) {
            return Ok(None);
        }
        match given(&self.otel_traces_exporter) {
            None | Some("otlp") => {}
            Some("none") => return Ok(None),
            Some(other) => {
                return bad(
                    "OTEL_TRACES_EXPORTER",
                    format!("{other:?}: this program exports with \"otlp\" or \"none\""),
                )
            }
        }
        let url = match (
            given(&self.otlp_traces_endpoint),
            given(&self.otlp_endpoint),
        ) {
            (Some(url), _) => url.to_owned(),
            (None, Some(base)) => format!("{}/v1/traces", base.trim_end_matches('/')),
            (None, None) => return Ok(None),
        };
        let setting = if given(&self.otlp_traces_endpoint).is_some() {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
        } else {
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        };
        match url::Url::parse(&url) {
            Ok(u) if matches!(u.scheme(), "http" | "https") && u.host().is_some() => {}
            _ => {
                return bad(
                    setting,
                    format!("{url:?} is not an http(s) URL such as http://collector:4318"),
                )
            }
        }
        let protocol = given(&self.otlp_traces_protocol).or(given(&self.otlp_protocol));
        let json = match protocol {
            None | Some("http/protobuf") => false,
            Some("http/json") => true,
            Some(other) => {
                let setting = if given(&self.otlp_traces_protocol).is_some() {
                    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
                } else {
                    "OTEL_EXPORTER_OTLP_PROTOCOL"
                };
                return bad(
                    setting,
                    format!(
                        "{other:?} is not supported: use \"http/protobuf\" or \"http/json\" \
                         (a collector takes OTLP/HTTP on port 4318)"
                    ),
                );
            }
        };
        Ok(Some(Export { url, json }))
    }
}

/// This program's tracer: spans go to OTLP when export is on, nowhere otherwise.
#[derive(Clone, Default)]
pub struct Telemetry {
    inner: Option<Arc<Exporting>>,
}

struct Exporting {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

impl fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Telemetry")
            .field("exporting", &self.inner.is_some())
            .finish()
    }
}

impl Telemetry {
    /// No export: spans cost nothing and traces pass through unchanged.
    pub fn off() -> Self {
        Self::default()
    }

    /// Export as `args` say, as `service` unless `OTEL_SERVICE_NAME` names it; must run
    /// inside the tokio runtime that sends the spans.
    pub fn start(args: &OtlpArgs, service: &str) -> Result<Self, TelemetryError> {
        let Some(export) = args.export()? else {
            return Ok(Self::off());
        };
        let client = OnRuntime {
            client: cosmosq_queue::cosmos::tls::http_client_builder()
                .build()
                .map_err(|e| TelemetryError::Exporter(e.to_string()))?,
            runtime: tokio::runtime::Handle::current(),
        };
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(client)
            .with_endpoint(export.url.clone())
            .with_protocol(if export.json {
                Protocol::HttpJson
            } else {
                Protocol::HttpBinary
            })
            .build()
            .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
        let name = given(&args.otel_service_name).unwrap_or(service).to_owned();
        let provider = SdkTracerProvider::builder()
            .with_resource(Resource::builder().with_service_name(name).build())
            .with_batch_exporter(exporter)
            .build();
        let tracer = provider.tracer("cosmosq");
        tracing::info!(url = %without_credentials(&export.url), json = export.json, "exporting spans over OTLP");
        Ok(Self {
            inner: Some(Arc::new(Exporting { provider, tracer })),
        })
    }

    /// Whether spans are exported.
    pub fn enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// Starts a span under `parent` (a remote context, such as a message's), or a new trace;
    /// `describe` gives its name and attributes, and runs only when spans are exported (it is
    /// on the publish and delivery paths).
    pub fn span(
        &self,
        kind: SpanKind,
        parent: Option<&TraceContext>,
        describe: impl FnOnce() -> (String, Vec<KeyValue>),
    ) -> Span {
        let Some(exporting) = &self.inner else {
            return Span::inert();
        };
        let (name, attributes) = describe();
        let cx = parent
            .and_then(remote_context)
            .map_or_else(Context::new, |sc| {
                Context::new().with_remote_span_context(sc)
            });
        let span = exporting
            .tracer
            .span_builder(name)
            .with_kind(kind)
            .with_attributes(attributes)
            .start_with_context(&exporting.tracer, &cx);
        Span { inner: Some(span) }
    }

    /// Sends what is still buffered and stops; spans started later are dropped.
    pub async fn shutdown(&self) {
        let Some(exporting) = self.inner.clone() else {
            return;
        };
        let ended = tokio::task::spawn_blocking(move || {
            exporting.provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT)
        })
        .await;
        match ended {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "the last spans may not have been sent"),
            Err(e) => tracing::warn!(error = %e, "the span exporter did not stop cleanly"),
        }
    }
}

/// One span; ends when dropped (or at [`Span::end`]).
pub struct Span {
    inner: Option<opentelemetry_sdk::trace::Span>,
}

impl Span {
    /// A span that records nothing (export off).
    pub fn inert() -> Self {
        Self { inner: None }
    }

    /// The context to hand on (`traceparent` naming this span), when exported and valid.
    pub fn context(&self) -> Option<TraceContext> {
        let sc = self.inner.as_ref()?.span_context();
        if !sc.is_valid() {
            return None;
        }
        let traceparent = format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        );
        let state = sc.trace_state().header();
        TraceContext::parse(&traceparent, Some(&state))
    }

    /// Adds an attribute.
    pub fn set(&mut self, attribute: KeyValue) {
        if let Some(span) = &mut self.inner {
            span.set_attribute(attribute);
        }
    }

    /// Marks the span failed, with why.
    pub fn fail(&mut self, why: impl Into<Cow<'static, str>>) {
        if let Some(span) = &mut self.inner {
            span.set_status(Status::error(why));
        }
    }

    /// Ends the span now.
    pub fn end(mut self) {
        if let Some(span) = &mut self.inner {
            span.end();
        }
    }
}

/// A URL fit for a log: user and password dropped (pure).
fn without_credentials(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) => {
            let _ = u.set_username("");
            let _ = u.set_password(None);
            u.to_string()
        }
        Err(_) => "(unparsable)".into(),
    }
}

/// A W3C context as OpenTelemetry's (pure; `None` for what it cannot read).
fn remote_context(trace: &TraceContext) -> Option<SpanContext> {
    let parts: Vec<&str> = trace.traceparent.split('-').collect();
    let [_, trace_id, span_id, flags] = parts[..] else {
        return None;
    };
    let flags = u8::from_str_radix(flags, 16).ok()?;
    let state = trace
        .tracestate
        .as_deref()
        .and_then(|s| TraceState::from_str(s).ok())
        .unwrap_or_default();
    Some(SpanContext::new(
        TraceId::from_hex(trace_id).ok()?,
        SpanId::from_hex(span_id).ok()?,
        TraceFlags::new(flags) & TraceFlags::SAMPLED,
        true,
        state,
    ))
}

/// reqwest on the program's runtime: the SDK's batch processor exports from its own thread,
/// where no tokio reactor runs, so each request is sent by a task on the runtime.
#[derive(Debug)]
struct OnRuntime {
    client: reqwest::Client,
    runtime: tokio::runtime::Handle,
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for OnRuntime {
    async fn send_bytes(
        &self,
        request: http::Request<bytes::Bytes>,
    ) -> Result<http::Response<bytes::Bytes>, opentelemetry_http::HttpError> {
        let client = self.client.clone();
        self.runtime
            .spawn(async move { client.send_bytes(request).await })
            .await?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(pairs: &[(&str, &str)]) -> OtlpArgs {
        let mut a = OtlpArgs::default();
        for (k, v) in pairs {
            let v = Some((*v).to_owned());
            match *k {
                "endpoint" => a.otlp_endpoint = v,
                "traces_endpoint" => a.otlp_traces_endpoint = v,
                "protocol" => a.otlp_protocol = v,
                "traces_protocol" => a.otlp_traces_protocol = v,
                "exporter" => a.otel_traces_exporter = v,
                "disabled" => a.otel_sdk_disabled = v,
                _ => unreachable!(),
            }
        }
        a
    }

    #[test]
    fn export_is_off_unless_an_endpoint_is_set_and_follows_the_standard_variables() {
        assert_eq!(OtlpArgs::default().export().unwrap(), None);
        assert_eq!(args(&[("endpoint", " ")]).export().unwrap(), None);
        let on = |pairs: &[(&str, &str)]| args(pairs).export().unwrap().unwrap();
        assert_eq!(
            on(&[("endpoint", "http://collector:4318/")]),
            Export {
                url: "http://collector:4318/v1/traces".into(),
                json: false
            }
        );
        assert_eq!(
            on(&[
                ("endpoint", "http://collector:4318"),
                ("traces_endpoint", "https://x.example/otlp/traces")
            ])
            .url,
            "https://x.example/otlp/traces",
            "the signal's own URL is taken as it is"
        );
        assert!(on(&[("endpoint", "http://c:4318"), ("protocol", "http/json")]).json);
        assert!(
            !on(&[
                ("endpoint", "http://c:4318"),
                ("protocol", "http/json"),
                ("traces_protocol", "http/protobuf")
            ])
            .json
        );
        for off in [
            &[("endpoint", "http://c:4318"), ("exporter", "none")][..],
            &[("endpoint", "http://c:4318"), ("disabled", "TRUE")][..],
        ] {
            assert_eq!(args(off).export().unwrap(), None, "{off:?}");
        }
    }

    #[test]
    fn unusable_settings_are_refused_with_the_variable_named() {
        let err = |pairs: &[(&str, &str)]| args(pairs).export().unwrap_err().to_string();
        let grpc = err(&[("endpoint", "http://c:4317"), ("protocol", "grpc")]);
        assert!(grpc.starts_with("OTEL_EXPORTER_OTLP_PROTOCOL:"), "{grpc}");
        assert!(grpc.contains("4318"), "says what to use: {grpc}");
        let url = err(&[("endpoint", "collector:4318")]);
        assert!(url.starts_with("OTEL_EXPORTER_OTLP_ENDPOINT:"), "{url}");
        let url = err(&[("traces_endpoint", "not a url")]);
        assert!(
            url.starts_with("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT:"),
            "{url}"
        );
        let exporter = err(&[("endpoint", "http://c:4318"), ("exporter", "zipkin")]);
        assert!(exporter.starts_with("OTEL_TRACES_EXPORTER:"), "{exporter}");
    }

    #[test]
    fn a_logged_url_carries_no_credentials() {
        assert_eq!(
            without_credentials("https://user:s3cret@collector:4318/v1/traces"),
            "https://collector:4318/v1/traces"
        );
    }

    #[test]
    fn a_w3c_context_becomes_the_remote_parent_it_names() {
        let trace = TraceContext::parse(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            Some("congo=t61rcWkgMzE"),
        )
        .unwrap();
        let sc = remote_context(&trace).unwrap();
        assert_eq!(
            sc.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(sc.span_id().to_string(), "00f067aa0ba902b7");
        assert!(sc.is_sampled() && sc.is_remote());
        assert_eq!(sc.trace_state().header(), "congo=t61rcWkgMzE");
        let unsampled = TraceContext::parse(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
            None,
        )
        .unwrap();
        assert!(!remote_context(&unsampled).unwrap().is_sampled());
    }

    #[test]
    fn spans_without_export_are_inert() {
        let telemetry = Telemetry::off();
        let mut span = telemetry.span(SpanKind::Producer, None, || unreachable!("not exported"));
        span.set(KeyValue::new("a", 1));
        span.fail("no");
        assert_eq!(
            span.context(),
            None,
            "the caller's context passes unchanged"
        );
        span.end();
    }
}
