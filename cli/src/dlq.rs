//! `cosmosq dlq`: a group's dead letters.

use clap::{Args, Subcommand};
use cosmosq_queue::clock::format_ms;
use cosmosq_queue::{Body, GroupConfig, MessageKey};

use crate::args::QueueArgs;
use crate::output::{table, Format};

#[derive(Args, Debug)]
pub struct DlqArgs {
    #[command(flatten)]
    pub queue: QueueArgs,
    /// The consumer group.
    #[arg(long, short, env = "COSMOSQ_GROUP")]
    pub group: String,
    #[arg(long, short, value_enum, default_value_t = Format::Table, global = true)]
    pub output: Format,
    #[command(subcommand)]
    pub action: DlqAction,
}

#[derive(Subcommand, Debug)]
pub enum DlqAction {
    /// List dead letters.
    List {
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Show one dead letter with its message.
    Peek(Target),
    /// Send dead letters back to the group (fresh attempts).
    Replay(TargetOrAll),
    /// Discard dead letters for good.
    Purge(TargetOrAll),
}

#[derive(Args, Debug)]
pub struct Target {
    /// Message id.
    #[arg(long)]
    pub id: String,
    /// The message's partition key (defaults to the id, as for messages enqueued without one).
    #[arg(long)]
    pub partition_key: Option<String>,
    /// The partition key as JSON, for keys that are not strings (`5`, `true`, `null`).
    #[arg(long, conflicts_with = "partition_key")]
    pub partition_key_json: Option<String>,
}

#[derive(Args, Debug)]
pub struct TargetOrAll {
    #[arg(long, required_unless_present = "all")]
    pub id: Option<String>,
    #[arg(long)]
    pub partition_key: Option<String>,
    /// The partition key as JSON, for keys that are not strings (`5`, `true`, `null`).
    #[arg(long, conflicts_with = "partition_key")]
    pub partition_key_json: Option<String>,
    /// Every dead letter of the group.
    #[arg(long, conflicts_with = "id")]
    pub all: bool,
}

pub async fn run(args: DlqArgs) -> anyhow::Result<()> {
    let queue = args.queue.open().await?;
    let group = queue.group(GroupConfig::new(args.group.clone()))?;
    match args.action {
        DlqAction::List { limit } => {
            let dead = group.dead_letters(Some(limit)).await?;
            match args.output {
                Format::Json => println!("{}", serde_json::to_string_pretty(&dead)?),
                Format::Table => {
                    let rows: Vec<Vec<String>> = dead
                        .iter()
                        .map(|d| {
                            vec![
                                d.message_id.clone(),
                                d.partition_key.to_string(),
                                d.attempts.to_string(),
                                d.reason.clone().unwrap_or_default(),
                                d.dead_lettered_at.map(format_ms).unwrap_or_default(),
                                d.last_error
                                    .clone()
                                    .unwrap_or_default()
                                    .chars()
                                    .take(60)
                                    .collect(),
                            ]
                        })
                        .collect();
                    print!(
                        "{}",
                        table(
                            &[
                                "ID",
                                "PARTITION KEY",
                                "ATTEMPTS",
                                "REASON",
                                "DEAD-LETTERED",
                                "LAST ERROR"
                            ],
                            &rows
                        )
                    );
                }
            }
        }
        DlqAction::Peek(target) => {
            let pk = message_key(
                &target.id,
                target.partition_key.as_deref(),
                target.partition_key_json.as_deref(),
            )?;
            let Some((dead, message)) = group.peek_dead_letter(&pk, &target.id).await? else {
                anyhow::bail!("no dead letter {} in group {}", target.id, args.group);
            };
            let body = message.map(|m| match m.body {
                Body::Json(v) => v,
                Body::Bytes(b) => serde_json::json!({"bytes": b.len()}),
            });
            let view = serde_json::json!({"deadLetter": dead, "body": body});
            println!("{}", serde_json::to_string_pretty(&view)?);
        }
        DlqAction::Replay(t) if t.all => {
            println!("replayed {} dead letters", group.replay_all().await?)
        }
        DlqAction::Purge(t) if t.all => {
            println!("purged {} dead letters", group.purge_all().await?)
        }
        DlqAction::Replay(t) => {
            let (id, pk) = target(&t)?;
            report(group.replay(&pk, &id).await?, "replayed", &id)?;
        }
        DlqAction::Purge(t) => {
            let (id, pk) = target(&t)?;
            report(group.purge(&pk, &id).await?, "purged", &id)?;
        }
    }
    Ok(())
}

fn target(t: &TargetOrAll) -> anyhow::Result<(String, MessageKey)> {
    let id =
        t.id.clone()
            .ok_or_else(|| anyhow::anyhow!("--id or --all"))?;
    let pk = message_key(
        &id,
        t.partition_key.as_deref(),
        t.partition_key_json.as_deref(),
    )?;
    Ok((id, pk))
}

/// The key given as text or as JSON; the id when neither is given.
fn message_key(id: &str, text: Option<&str>, json: Option<&str>) -> anyhow::Result<MessageKey> {
    match (text, json) {
        (_, Some(json)) => {
            let value = serde_json::from_str(json)
                .map_err(|e| anyhow::anyhow!("--partition-key-json is not JSON: {e}"))?;
            Ok(MessageKey::from_json(value)
                .map_err(|e| anyhow::anyhow!("--partition-key-json: {e}"))?)
        }
        (Some(text), None) => Ok(MessageKey::from(text)),
        (None, None) => Ok(MessageKey::from(id)),
    }
}

fn report(done: bool, verb: &str, id: &str) -> anyhow::Result<()> {
    if done {
        println!("{verb} {id}");
        Ok(())
    } else {
        anyhow::bail!("{id} is not a dead letter of this group")
    }
}
