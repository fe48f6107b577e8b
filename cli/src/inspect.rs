//! `cosmosq stats`, `cosmosq leases`, `cosmosq peek`: what a queue and its groups are doing,
//! read without consuming anything.

use clap::Args;
use cosmosq_queue::clock::{format_ms, system_now_ms as now_ms};
use cosmosq_queue::estimate::RangeEstimate;
use cosmosq_queue::lease::LeaseStore;
use cosmosq_queue::{Body, GroupConfig, Message, Queue};
use serde::Serialize;
use serde_json::{json, Value};

use crate::args::QueueArgs;
use crate::output::{print, table, Format};

/// The lease loop's default expiry: a lease not renewed for this long is up for grabs.
const LEASE_EXPIRY_MS: i64 = cosmosq_queue::host::DEFAULT_LEASE_EXPIRE.as_millis() as i64;
/// Dead letters counted per group; beyond this `stats` says "at least".
const DEAD_LETTER_COUNT_LIMIT: usize = 10_000;

#[derive(Args, Debug)]
pub struct InspectArgs {
    #[command(flatten)]
    pub queue: QueueArgs,
    /// One consumer group (all groups with leases when omitted).
    #[arg(long, short, env = "COSMOSQ_GROUP")]
    pub group: Option<String>,
    #[arg(long, short, value_enum, default_value_t = Format::Table)]
    pub output: Format,
}

#[derive(Args, Debug)]
pub struct PeekArgs {
    #[command(flatten)]
    pub queue: QueueArgs,
    /// How many messages.
    #[arg(long, default_value_t = 10)]
    pub limit: usize,
    #[arg(long, short, value_enum, default_value_t = Format::Table)]
    pub output: Format,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupStats {
    pub group: String,
    pub backlog: u64,
    /// Unread messages over the ranges whose lag is known.
    pub lag: u64,
    pub oldest_message_age_seconds: Option<i64>,
    pub dead_letters: usize,
    pub ranges: Vec<RangeEstimate>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseRow {
    pub group: String,
    pub min_epk: String,
    pub max_epk: String,
    pub owner: Option<String>,
    pub checkpointed: bool,
    /// The owner's last renewal, checkpoint or heartbeat that keeps the lease (RFC 3339).
    pub heartbeat: String,
    pub expired: bool,
}

async fn groups(queue: &Queue, only: Option<&str>) -> anyhow::Result<Vec<String>> {
    Ok(match only {
        Some(group) => vec![group.to_owned()],
        None => queue.group_names().await?,
    })
}

/// Per group: backlog, lag, oldest message, dead letters, and the same per range with owners.
pub async fn stats(
    queue: &Queue,
    only: Option<&str>,
    now_ms: i64,
) -> anyhow::Result<Vec<GroupStats>> {
    let mut out = Vec::new();
    for name in groups(queue, only).await? {
        let group = queue.group(GroupConfig::new(name.clone()))?;
        let estimate = group.estimate().await?;
        let dead_letters = group.count_dead_letters(DEAD_LETTER_COUNT_LIMIT).await?;
        out.push(GroupStats {
            group: name,
            backlog: estimate.backlog(),
            lag: estimate.lag(),
            oldest_message_age_seconds: estimate
                .oldest_unsettled_at()
                .map(|at| ((now_ms - at) / 1000).max(0)),
            dead_letters,
            ranges: estimate.ranges,
        });
    }
    Ok(out)
}

pub fn stats_table(stats: &[GroupStats]) -> String {
    let groups: Vec<Vec<String>> = stats
        .iter()
        .map(|s| {
            let owners: std::collections::BTreeSet<&str> =
                s.ranges.iter().filter_map(|r| r.owner.as_deref()).collect();
            let dead = if s.dead_letters >= DEAD_LETTER_COUNT_LIMIT {
                format!("{}+", s.dead_letters)
            } else {
                s.dead_letters.to_string()
            };
            vec![
                s.group.clone(),
                s.backlog.to_string(),
                s.lag.to_string(),
                s.oldest_message_age_seconds
                    .map_or("-".into(), |a| format!("{a}s")),
                dead,
                s.ranges.len().to_string(),
                owners.len().to_string(),
            ]
        })
        .collect();
    let ranges: Vec<Vec<String>> = stats
        .iter()
        .flat_map(|s| {
            s.ranges.iter().map(|r| {
                vec![
                    s.group.clone(),
                    cosmosq_queue::range::label(&r.min_epk, &r.max_epk),
                    r.owner.clone().unwrap_or_else(|| "-".into()),
                    r.lag.map_or("unknown".into(), |l| l.to_string()),
                    r.backlog.to_string(),
                ]
            })
        })
        .collect();
    format!(
        "{}\n{}",
        table(
            &[
                "GROUP",
                "BACKLOG",
                "LAG",
                "OLDEST",
                "DEAD LETTERS",
                "RANGES",
                "OWNERS"
            ],
            &groups
        ),
        table(&["GROUP", "RANGE", "OWNER", "LAG", "BACKLOG"], &ranges)
    )
}

/// Who holds which range, per group.
pub async fn leases(
    queue: &Queue,
    only: Option<&str>,
    now_ms: i64,
) -> anyhow::Result<Vec<LeaseRow>> {
    let mut out = Vec::new();
    for group in groups(queue, only).await? {
        let (leases, beats) = LeaseStore::new(queue.clone(), &group)
            .list_with_beats()
            .await?;
        for lease in leases {
            out.push(LeaseRow {
                group: group.clone(),
                expired: lease.owner.is_some() && lease.is_expired(&beats, now_ms, LEASE_EXPIRY_MS),
                heartbeat: format_ms(lease.heartbeat(&beats)),
                checkpointed: lease.continuation.is_some(),
                owner: lease.owner,
                min_epk: lease.min_epk,
                max_epk: lease.max_epk,
            });
        }
    }
    Ok(out)
}

pub fn leases_table(leases: &[LeaseRow]) -> String {
    let rows: Vec<Vec<String>> = leases
        .iter()
        .map(|l| {
            vec![
                l.group.clone(),
                cosmosq_queue::range::label(&l.min_epk, &l.max_epk),
                l.owner.clone().unwrap_or_else(|| "-".into()),
                l.heartbeat.clone(),
                if l.expired { "expired" } else { "" }.into(),
                if l.checkpointed { "yes" } else { "no" }.into(),
            ]
        })
        .collect();
    table(
        &[
            "GROUP",
            "RANGE",
            "OWNER",
            "HEARTBEAT",
            "STATE",
            "CHECKPOINTED",
        ],
        &rows,
    )
}

pub fn message_json(m: &Message) -> Value {
    let body = match &m.body {
        Body::Json(v) => json!({"body": v}),
        Body::Bytes(b) => json!({"bodyBytes": b.len()}),
    };
    let mut out = json!({
        "id": m.id, "partitionKey": m.partition_key, "enqueuedAt": format_ms(m.enqueued_at),
        "contentType": m.content_type, "metadata": m.metadata,
        "visibleAt": m.visible_at.map(format_ms),
    });
    if let (Some(out), Some(body)) = (out.as_object_mut(), body.as_object()) {
        out.extend(body.clone());
    }
    out
}

pub fn peek_table(messages: &[Message]) -> String {
    let rows: Vec<Vec<String>> = messages
        .iter()
        .map(|m| {
            let body = match &m.body {
                Body::Json(v) => v.to_string().chars().take(60).collect(),
                Body::Bytes(b) => format!("<{} bytes>", b.len()),
            };
            vec![
                m.id.clone(),
                m.partition_key.to_string(),
                format_ms(m.enqueued_at),
                body,
            ]
        })
        .collect();
    table(&["ID", "PARTITION KEY", "ENQUEUED", "BODY"], &rows)
}

pub async fn run_stats(args: InspectArgs) -> anyhow::Result<()> {
    let queue = args.queue.open().await?;
    let stats = stats(&queue, args.group.as_deref(), now_ms()).await?;
    print(args.output, &stats[..], stats_table)
}

pub async fn run_leases(args: InspectArgs) -> anyhow::Result<()> {
    let queue = args.queue.open().await?;
    let leases = leases(&queue, args.group.as_deref(), now_ms()).await?;
    print(args.output, &leases[..], leases_table)
}

pub async fn run_peek(args: PeekArgs) -> anyhow::Result<()> {
    let queue = args.queue.open().await?;
    let (messages, unreadable) = queue.peek(args.limit).await?;
    match args.output {
        Format::Json => {
            let list: Vec<Value> = messages.iter().map(message_json).collect();
            println!("{}", serde_json::to_string_pretty(&list)?);
        }
        Format::Table => print!("{}", peek_table(&messages)),
    }
    if unreadable > 0 {
        eprintln!("{unreadable} documents in the container are not messages and were skipped");
    }
    Ok(())
}

#[cfg(all(test, feature = "emulator"))]
mod tests {
    use super::*;
    use cosmosq_emulator::{Emulator, EmulatorOptions};
    use cosmosq_queue::{provision, ClaimOutcome, NewMessage, QueueConfig};

    async fn queue_with_work() -> Queue {
        let emulator = Emulator::in_process(EmulatorOptions::default()).unwrap();
        let client = emulator.client().await.unwrap();
        let (queue, _) = provision(&client, &QueueConfig::new("shop", "orders"))
            .await
            .unwrap();
        // Group "billing" exists (its leases), then 5 messages arrive; one is dead-lettered.
        LeaseStore::new(queue.clone(), "billing")
            .reconcile(now_ms(), LEASE_EXPIRY_MS)
            .await
            .unwrap();
        for i in 0..5 {
            queue
                .enqueue(NewMessage::json(json!({"n": i})).with_id(format!("m{i}")))
                .await
                .unwrap();
        }
        let group = queue.group(GroupConfig::new("billing")).unwrap();
        let m0 = queue
            .read_message(&"m0".into(), "m0")
            .await
            .unwrap()
            .unwrap();
        let ClaimOutcome::Claimed(claim) = group.claim(&m0, "cli-test").await.unwrap() else {
            panic!("m0 is free");
        };
        group
            .dead_letter(&claim, "poison", "bad order")
            .await
            .unwrap();
        queue
    }

    /// An idle lease lives on its holder's heartbeat: its own timestamp is old, and it is not
    /// shown expired while a heartbeat that lists it is fresh.
    #[tokio::test]
    async fn an_idle_lease_is_shown_alive_by_its_holders_heartbeat() {
        let queue = queue_with_work().await;
        let store = LeaseStore::new(queue.clone(), "billing");
        let lease = store.list().await.unwrap().remove(0);
        let holder = "worker-1#5c1e9a0b";
        let taken = store.acquire(&lease, holder, 1_000).await.unwrap();
        let now = 1_000 + 2 * LEASE_EXPIRY_MS;
        let shown = |rows: Vec<LeaseRow>| {
            let row = rows
                .into_iter()
                .find(|r| r.owner.as_deref() == Some(holder));
            row.map(|r| (r.expired, r.heartbeat)).unwrap()
        };
        let old = shown(leases(&queue, Some("billing"), now).await.unwrap());
        assert_eq!(old, (true, format_ms(1_000)), "no heartbeat: expired");
        store
            .beat(holder, vec![taken.id.clone()], now - 1_000, LEASE_EXPIRY_MS)
            .await
            .unwrap();
        let kept = shown(leases(&queue, Some("billing"), now).await.unwrap());
        assert_eq!(
            kept,
            (false, format_ms(now - 1_000)),
            "its heartbeat keeps it"
        );
    }

    #[tokio::test]
    async fn stats_leases_and_peek_show_the_queue() {
        let queue = queue_with_work().await;
        let stats = stats(&queue, None, now_ms()).await.unwrap();
        assert_eq!(stats.len(), 1);
        assert_eq!(stats[0].group, "billing");
        assert_eq!(stats[0].ranges.len(), 4);
        assert_eq!(stats[0].dead_letters, 1);
        let json = serde_json::to_value(&stats).unwrap();
        for key in [
            "group",
            "backlog",
            "lag",
            "oldestMessageAgeSeconds",
            "deadLetters",
            "ranges",
        ] {
            assert!(
                json[0].get(key).is_some(),
                "stats -o json has {key}: {json}"
            );
        }
        assert!(json[0]["ranges"][0].get("owner").is_some());
        let text = stats_table(&stats);
        assert!(text.starts_with("GROUP    BACKLOG"), "{text}");

        let leases = leases(&queue, Some("billing"), now_ms()).await.unwrap();
        assert_eq!(leases.len(), 4);
        assert!(leases.iter().all(|l| l.owner.is_none() && !l.expired));
        let json = serde_json::to_value(&leases).unwrap();
        assert_eq!(
            json[0]
                .as_object()
                .unwrap()
                .keys()
                .cloned()
                .collect::<Vec<_>>(),
            [
                "checkpointed",
                "expired",
                "group",
                "heartbeat",
                "maxEpk",
                "minEpk",
                "owner"
            ]
        );
        assert!(leases_table(&leases).contains("billing"));

        let (messages, unreadable) = queue.peek(3).await.unwrap();
        assert_eq!((messages.len(), unreadable), (3, 0));
        let json = message_json(&messages[0]);
        assert!(json["id"].as_str().unwrap().starts_with('m'));
        assert!(json["body"]["n"].is_number());
        assert!(peek_table(&messages).contains("PARTITION KEY"));
    }
}
