//! `cosmosq enqueue`: bulk input with a progress bar; `cosmosq wake`: the operator told.

use std::io::BufRead;
use std::path::PathBuf;

use clap::Args;
use cosmosq_program::wake::{OperatorArgs, Waker};
use cosmosq_queue::message::MessageInput;
use cosmosq_queue::{MessageKey, NewMessage, TraceContext};
use indicatif::{ProgressBar, ProgressStyle};

use crate::args::QueueArgs;

#[derive(Args, Debug)]
pub struct EnqueueArgs {
    #[command(flatten)]
    pub queue: QueueArgs,
    /// One message body (JSON); without it, messages are read as JSON lines
    /// (`{"id":..,"partitionKey":..,"body":..,"delay":"30s",..}`) from --file or stdin.
    #[arg(long)]
    pub body: Option<String>,
    /// File of JSON lines ("-" for stdin).
    #[arg(long, short, default_value = "-")]
    pub file: PathBuf,
    /// Partition key for messages that do not name one.
    #[arg(long)]
    pub partition_key: Option<String>,
    /// Messages per request round.
    #[arg(long, default_value_t = 100)]
    pub batch: usize,
    /// W3C trace context stored with messages that carry none of their own, so the trace goes
    /// on at the delivery (`TRACEPARENT`: the OpenTelemetry convention for processes).
    #[arg(long, env = "TRACEPARENT")]
    pub traceparent: Option<String>,
    /// W3C `tracestate` beside --traceparent.
    #[arg(long, env = "TRACESTATE", requires = "traceparent")]
    pub tracestate: Option<String>,
    /// Once enqueued, tell the operator this CosmosQueue (`<namespace>/<name>`) was written
    /// to, so its groups at zero start now (needs --operator-url).
    #[arg(long, value_name = "NAMESPACE/NAME", requires = "operator_url")]
    pub wake: Option<String>,
    #[command(flatten)]
    pub operator: OperatorArgs,
}

/// `cosmosq wake`.
#[derive(Args, Debug)]
pub struct WakeArgs {
    /// The CosmosQueue written to, as `<namespace>/<name>`.
    #[arg(value_name = "NAMESPACE/NAME")]
    pub queue: String,
    #[command(flatten)]
    pub operator: OperatorArgs,
}

/// Tells the operator; an operator that cannot be told is an error here (it is all this
/// command does).
pub async fn wake(args: WakeArgs) -> anyhow::Result<()> {
    cosmosq_program::wake::split_queue(&args.queue)?;
    let waker = Waker::from_args(&args.operator)?
        .ok_or_else(|| anyhow::anyhow!("--operator-url (COSMOSQ_OPERATOR_URL) is required"))?;
    waker.wake(&args.queue).await?;
    println!("told the operator: {} was written to", args.queue);
    Ok(())
}

impl EnqueueArgs {
    /// The trace context given, refused with the reason when it is not W3C's.
    fn trace(&self) -> anyhow::Result<Option<TraceContext>> {
        self.traceparent
            .as_deref()
            .map(|parent| {
                TraceContext::parse(parent, self.tracestate.as_deref()).ok_or_else(|| {
                    anyhow::anyhow!(
                        "--traceparent {parent:?} is not a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>)"
                    )
                })
            })
            .transpose()
    }
}

/// Parses one input line; errors say which line and why.
pub fn parse_line(
    line_no: usize,
    line: &str,
    default_key: Option<&str>,
) -> anyhow::Result<NewMessage> {
    let input: MessageInput = serde_json::from_str(line)
        .map_err(|e| anyhow::anyhow!("line {line_no}: not a message: {e}"))?;
    let mut message =
        NewMessage::try_from(input).map_err(|e| anyhow::anyhow!("line {line_no}: {e}"))?;
    if message.partition_key.is_none() {
        message.partition_key = default_key.map(MessageKey::from);
    }
    Ok(message)
}

pub async fn run(args: EnqueueArgs) -> anyhow::Result<()> {
    let trace = args.trace()?;
    // Only when asked: the operator's settings in the environment do not stop a plain enqueue.
    let waker = match &args.wake {
        Some(queue) => {
            cosmosq_program::wake::split_queue(queue)?;
            Waker::from_args(&args.operator)?
        }
        None => None,
    };
    let queue = args.queue.open().await?;
    let messages: Vec<NewMessage> = match &args.body {
        Some(body) => {
            let body = serde_json::from_str(body)
                .map_err(|e| anyhow::anyhow!("--body is not JSON: {e}"))?;
            let mut m = NewMessage::json(body);
            m.partition_key = args.partition_key.as_deref().map(MessageKey::from);
            vec![m]
        }
        None => {
            let reader: Box<dyn BufRead> = if args.file.as_os_str() == "-" {
                Box::new(std::io::stdin().lock())
            } else {
                Box::new(std::io::BufReader::new(std::fs::File::open(&args.file)?))
            };
            let mut out = Vec::new();
            for (i, line) in reader.lines().enumerate() {
                let line = line?;
                if line.trim().is_empty() {
                    continue;
                }
                out.push(parse_line(i + 1, &line, args.partition_key.as_deref())?);
            }
            out
        }
    };
    let messages: Vec<NewMessage> = messages
        .into_iter()
        .map(|m| m.inherit_trace(trace.as_ref()))
        .collect();
    let bar = ProgressBar::new(messages.len() as u64).with_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} messages, {per_sec}, eta {eta}")
            .expect("static template"),
    );
    let (mut enqueued, mut duplicates, mut failed) = (0usize, 0usize, 0usize);
    let mut chunk = Vec::with_capacity(args.batch.max(1));
    let mut iter = messages.into_iter().peekable();
    while iter.peek().is_some() {
        chunk.extend(iter.by_ref().take(args.batch.max(1)));
        for result in queue.enqueue_batch(std::mem::take(&mut chunk)).await {
            match result {
                Ok(o) if o.is_duplicate() => duplicates += 1,
                Ok(_) => enqueued += 1,
                Err(e) => {
                    failed += 1;
                    bar.suspend(|| eprintln!("not enqueued: {e}"));
                }
            }
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    let ru = queue.charges().snapshot().total_request_units();
    println!("enqueued {enqueued}, duplicates {duplicates}, failed {failed} ({ru:.1} RU)");
    // The messages are stored either way: a wake that fails only waits for the next round.
    if let (Some(name), Some(waker)) = (&args.wake, &waker) {
        match waker.wake(name).await {
            Ok(()) => println!("told the operator: {name} was written to"),
            Err(e) => eprintln!("warning: {e} (the next scaling round finds the messages)"),
        }
    }
    if failed > 0 {
        anyhow::bail!("{failed} messages were not enqueued");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_get_the_default_key_and_errors_name_the_line() {
        let m = parse_line(1, r#"{"body": {"a": 1}}"#, Some("k")).unwrap();
        assert_eq!(m.partition_key, Some(MessageKey::from("k")));
        let m = parse_line(1, r#"{"body": 1, "partitionKey": "own"}"#, Some("k")).unwrap();
        assert_eq!(m.partition_key, Some(MessageKey::from("own")));
        let err = parse_line(7, r#"{"body": 1, "delay": "soon"}"#, None).unwrap_err();
        assert!(err.to_string().starts_with("line 7:"), "{err}");
        assert!(parse_line(3, "not json", None)
            .unwrap_err()
            .to_string()
            .contains("line 3"));
    }

    #[test]
    fn a_traceparent_that_is_not_w3c_is_refused_by_name() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: EnqueueArgs,
        }
        let parse = |extra: &[&str]| {
            let mut argv = vec!["cosmosq", "--queue", "q"];
            argv.extend_from_slice(extra);
            Cli::try_parse_from(argv).unwrap().args.trace()
        };
        let err = parse(&["--traceparent", "abc"]).unwrap_err();
        assert!(err.to_string().contains("--traceparent \"abc\""), "{err}");
        let trace = parse(&[
            "--traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "--tracestate",
            "congo=t61rcWkgMzE",
        ])
        .unwrap()
        .unwrap();
        assert_eq!(trace.tracestate.as_deref(), Some("congo=t61rcWkgMzE"));
    }
}
