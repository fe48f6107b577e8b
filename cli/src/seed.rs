//! A faithful implementation of the seed design, for `cosmosq bench` to measure against: every
//! consumer reads the whole change feed and flips a per-group status on the message document,
//! Pending → InProgress → Completed, each flip a replace with `If-Match`. Each flip rewrites the
//! whole message and echoes into the feed every consumer reads.

use std::time::{Duration, Instant};

use azure_core::http::Etag;
use azure_data_cosmos::options::{
    ChangeFeedOptions, ChangeFeedStartFrom, ItemWriteOptions, MaxItemCountHint, Precondition,
};
use azure_data_cosmos::{ContainerClient, FeedScope};
use futures::StreamExt;
use serde_json::{json, Value};

/// Request units and time to settle `messages` for each of `groups` the seed way.
pub struct SeedRun {
    pub seconds: f64,
    pub request_units: f64,
}

fn charge(diagnostics: &azure_data_cosmos::diagnostics::DiagnosticsContext) -> f64 {
    diagnostics.total_request_charge().value()
}

/// Enqueues the seed's documents (one status field per group) into `container` (pk `/pk`).
/// The message body both designs carry in the benchmark.
pub fn body(i: usize, padding: &str) -> Value {
    json!({"order": i, "sku": "sku-1", "qty": 2, "note": padding})
}

pub async fn enqueue(
    container: &ContainerClient,
    messages: usize,
    groups: usize,
    padding: &str,
) -> anyhow::Result<f64> {
    let statuses: serde_json::Map<String, Value> = (0..groups)
        .map(|g| (format!("g{g}"), json!("Pending")))
        .collect();
    let mut ru = 0.0;
    for i in 0..messages {
        let id = format!("s{i}");
        let pk = format!("k{}", i % 64);
        let doc = json!({"id": id, "pk": pk, "body": body(i, padding), "status": statuses});
        let response = container.create_item(pk, &id, doc, None).await?;
        ru += charge(&response.diagnostics());
    }
    Ok(ru)
}

/// One consumer per group, each reading the whole feed, until every message is Completed for
/// every group.
pub async fn consume(
    container: &ContainerClient,
    messages: usize,
    groups: usize,
) -> anyhow::Result<SeedRun> {
    let started = Instant::now();
    let consumers =
        (0..groups).map(|g| consume_group(container.clone(), format!("g{g}"), messages));
    let spent: Vec<f64> = futures::future::try_join_all(consumers).await?;
    Ok(SeedRun {
        seconds: started.elapsed().as_secs_f64(),
        request_units: spent.iter().sum(),
    })
}

async fn consume_group(
    container: ContainerClient,
    group: String,
    messages: usize,
) -> anyhow::Result<f64> {
    let options = ChangeFeedOptions::default().with_max_item_count(MaxItemCountHint::Limit(
        std::num::NonZeroU32::new(500).expect("non-zero"),
    ));
    let mut pages = container
        .query_change_feed::<Value>(
            FeedScope::full_container(),
            ChangeFeedStartFrom::Beginning,
            Some(options),
        )
        .await?;
    let (mut ru, mut completed) = (0.0, 0usize);
    let deadline = Instant::now() + Duration::from_secs(600);
    while completed < messages {
        anyhow::ensure!(Instant::now() < deadline, "the seed design did not finish");
        let Some(page) = pages.next().await else {
            anyhow::bail!("the change feed ended")
        };
        let page = page?;
        ru += charge(&page.diagnostics());
        if page.items().is_empty() {
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        }
        for item in page.items() {
            let Some(doc) = item.current() else { continue };
            if doc["status"][&group] != "Pending" {
                continue; // an echo of some group's flip: read, paid for, skipped
            }
            let (Some(id), Some(pk), Some(etag)) = (
                doc["id"].as_str(),
                doc["pk"].as_str(),
                doc["_etag"].as_str(),
            ) else {
                continue;
            };
            let mut next = doc.clone();
            next["status"][&group] = json!("InProgress");
            let claim = container
                .replace_item(
                    pk.to_owned(),
                    id,
                    &next,
                    Some(
                        ItemWriteOptions::default()
                            .with_precondition(Precondition::if_match(Etag::from(etag.to_owned()))),
                    ),
                )
                .await;
            // Another group's flip may have won the ETag race: read it again from the feed later.
            let Ok(claimed) = claim else { continue };
            ru += charge(&claimed.diagnostics());
            let mut etag = claimed
                .headers()
                .etag()
                .map(|e| e.to_string())
                .unwrap_or_default();
            loop {
                next["status"][&group] = json!("Completed");
                match container
                    .replace_item(
                        pk.to_owned(),
                        id,
                        &next,
                        Some(
                            ItemWriteOptions::default().with_precondition(Precondition::if_match(
                                Etag::from(etag.clone()),
                            )),
                        ),
                    )
                    .await
                {
                    Ok(done) => {
                        ru += charge(&done.diagnostics());
                        completed += 1;
                        break;
                    }
                    Err(_) => {
                        // Another group flipped its own field meanwhile: re-read, keep ours.
                        let fresh = container.read_item(pk.to_owned(), id, None).await?;
                        ru += charge(&fresh.diagnostics());
                        etag = fresh
                            .headers()
                            .etag()
                            .map(|e| e.to_string())
                            .unwrap_or_default();
                        let mut current: Value = fresh.into_model()?;
                        current["status"][&group] = json!("Completed");
                        next = current;
                    }
                }
            }
        }
    }
    Ok(ru)
}
