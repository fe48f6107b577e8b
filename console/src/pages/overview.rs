//! Every queue and group at a glance, kept current by the script over server-sent events.

use maud::{html, Markup};
use serde_json::{json, Value};

use super::{encode, group_url, layout, relative};
use crate::history::History;
use crate::svg;
use crate::watch::{GroupView, Snapshot, DEAD_LETTER_COUNT_LIMIT};
use cosmosq_queue::clock::format_ms;

/// A group's cells, by name: what the page shows and what a round's event updates.
fn cells(group: &GroupView, history: &History, now_ms: i64) -> Vec<(&'static str, String)> {
    let series = history.get(&group.queue, &group.name);
    let owners: std::collections::BTreeSet<&str> = group
        .ranges
        .iter()
        .filter_map(|r| r.owner.as_deref())
        .collect();
    vec![
        ("backlog", group.backlog.to_string()),
        ("lag", group.lag.to_string()),
        ("locked", at_least(group.locked, group.capped)),
        ("retrying", at_least(group.retrying, group.capped)),
        (
            "oldest",
            group
                .oldest_unsettled_at
                .map_or("–".into(), |at| relative(now_ms, at)),
        ),
        (
            "trend",
            series
                .and_then(|s| s.trend_rate())
                .map_or("–".into(), trend_text),
        ),
        ("deadLetters", dead_count(group.dead_letters)),
        (
            "owners",
            format!("{} / {}", owners.len(), group.ranges.len()),
        ),
    ]
}

/// The backlog's change per second, signed: "−12/s" drains, "+3.5/s" grows.
fn trend_text(rate: f64) -> String {
    match rate {
        r if r.abs() < 0.05 => "0/s".into(),
        r if r < 0.0 => format!("−{}/s", svg::short(-r)),
        r => format!("+{}/s", svg::short(r)),
    }
}

/// A count, with "+" when it was cut at the reading's limit.
pub(crate) fn at_least(n: usize, capped: bool) -> String {
    if capped {
        format!("{n}+")
    } else {
        n.to_string()
    }
}

fn dead_count(n: usize) -> String {
    if n >= DEAD_LETTER_COUNT_LIMIT {
        format!("{n}+")
    } else {
        n.to_string()
    }
}

fn sparkline(group: &GroupView, history: &History, now_ms: i64) -> Markup {
    let series = history.get(&group.queue, &group.name);
    let points: Vec<(i64, f64)> = series
        .map(|s| s.samples().map(|x| (x.at_ms, x.backlog as f64)).collect())
        .unwrap_or_default();
    let from = super::group::shown_from(series, history.window_ms(), now_ms);
    svg::sparkline(&points, from, now_ms)
}

/// The cell's id in the page: `<queue>/<group>/<cell>` (group names cannot hold `/`; a
/// queue's may, as `<namespace>/<name>`, so the last two parts are the group's and the cell's).
fn cell_id(group: &GroupView, cell: &str) -> String {
    format!("{}/{}/{cell}", group.queue, group.name)
}

pub(crate) fn overview(snapshot: &Snapshot, history: &History, now_ms: i64) -> Markup {
    let content = html! {
        h1 #overview { "Queues" }
        @if let Some(error) = &snapshot.error { p.error { (error) } }
        @if snapshot.at_ms == 0 {
            p.muted #waiting { "Reading the queues for the first time…" }
        } @else if snapshot.queues.is_empty() && snapshot.error.is_none() {
            p.muted { "No queues to show yet: a queue is a container with its " code { "-leases" } " container beside it (in the operator's console, a CosmosQueue of a namespace you may read)." }
        }
        @for queue in &snapshot.queues {
            section.queue data-queue=(queue.name) {
                h2 { (queue.name) }
                @if let Some(error) = &queue.error { p.error { (error) } }
                form.lookup method="get" action=(format!("/queues/{}/messages", encode(&queue.name))) {
                    label { "Message id " input type="search" name="id" required placeholder="id" accesskey="f"; }
                    label { "key " input type="text" name="key" placeholder="the id when empty"; }
                    button type="submit" { "Look up" }
                }
                @if queue.groups.is_empty() && queue.error.is_none() {
                    p.muted { "No consumer groups yet (a group appears once it has leases)." }
                } @else {
                    div.scroll { table.groups {
                        thead { tr {
                            th { "Group" } th.n { "Backlog" } th.n { "Lag" } th.n title="held under a lock by a worker now" { "Locked" }
                            th.n { "Retrying" } th.n { "Oldest" } th.n title="how fast the backlog grows (+) or drains (−)" { "Trend" } th.n { "Dead letters" }
                            th.n { "Owners / ranges" } th { "Backlog" }
                        } }
                        tbody {
                            @for group in &queue.groups {
                                tr {
                                    td { a href=(group_url(&group.queue, &group.name)) { (group.name) } }
                                    @if let Some(error) = &group.error {
                                        td.error colspan="9" { (error) }
                                    } @else {
                                        @for (name, value) in cells(group, history, now_ms) {
                                            td.n data-cell=(cell_id(group, name)) {
                                                @if name == "deadLetters" && value != "0" {
                                                    a href=(format!("{}/dead-letters", group_url(&group.queue, &group.name))) { (value) }
                                                } @else { (value) }
                                            }
                                        }
                                        td data-spark=(cell_id(group, "spark")) { (sparkline(group, history, now_ms)) }
                                    }
                                }
                            }
                        }
                    } }
                }
            }
        }
        (footer(snapshot, now_ms))
    };
    html! { (layout("Queues", &[], content)) }
}

fn footer(snapshot: &Snapshot, now_ms: i64) -> Markup {
    html! {
        footer.muted {
            "Read " span #round title=(if snapshot.at_ms == 0 { String::new() } else { format_ms(snapshot.at_ms) }) {
                (if snapshot.at_ms == 0 { "–".to_owned() } else { relative(now_ms, snapshot.at_ms) })
            }
        }
    }
}

/// What a round's event carries: each group's cells and sparkline, by cell id.
pub(crate) fn live(snapshot: &Snapshot, history: &History, now_ms: i64) -> Value {
    let mut cells_out = serde_json::Map::new();
    let mut sparks = serde_json::Map::new();
    for group in snapshot.queues.iter().flat_map(|q| &q.groups) {
        if group.error.is_some() {
            continue;
        }
        for (name, value) in cells(group, history, now_ms) {
            cells_out.insert(cell_id(group, name), json!(value));
        }
        sparks.insert(
            cell_id(group, "spark"),
            json!(sparkline(group, history, now_ms).into_string()),
        );
    }
    let known: Vec<String> = snapshot
        .queues
        .iter()
        .flat_map(|q| q.groups.iter().filter(|g| g.error.is_none()))
        .map(|g| format!("{}/{}", g.queue, g.name))
        .collect();
    json!({"at": snapshot.at_ms, "cells": cells_out, "sparks": sparks, "groups": known})
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::Sample;
    use crate::watch::{QueueView, RangeView};

    fn snapshot() -> (Snapshot, History) {
        let group = GroupView {
            queue: "orders".into(),
            name: "<billing>".into(),
            backlog: 12,
            lag: 10,
            locked: 1,
            dead_letters: 3,
            oldest_unsettled_at: Some(1_000_000 - 90_000),
            ranges: vec![RangeView {
                owner: Some("pod-a".into()),
                started: 2,
                ..RangeView::default()
            }],
            ..GroupView::default()
        };
        let mut history = History::new(3_600_000);
        history.push(
            "orders",
            "<billing>",
            Sample {
                at_ms: 900_000,
                backlog: 20,
                ..Sample::default()
            },
        );
        history.push(
            "orders",
            "<billing>",
            Sample {
                at_ms: 1_000_000,
                backlog: 12,
                ..Sample::default()
            },
        );
        let snapshot = Snapshot {
            at_ms: 1_000_000,
            queues: vec![
                QueueView {
                    name: "orders".into(),
                    namespace: None,
                    groups: vec![group],
                    error: None,
                },
                QueueView {
                    name: "empty".into(),
                    namespace: None,
                    groups: vec![],
                    error: None,
                },
            ],
            error: None,
        };
        (snapshot, history)
    }

    #[test]
    fn a_trend_says_which_way() {
        assert_eq!(trend_text(-12.0), "−12/s");
        assert_eq!(trend_text(3.5), "+3.5/s");
        assert_eq!(trend_text(0.01), "0/s");
    }

    #[test]
    fn the_overview_lists_queues_groups_and_their_figures() {
        let (snapshot, history) = snapshot();
        let page = overview(&snapshot, &history, 1_000_000).into_string();
        assert!(
            page.contains("&lt;billing&gt;") && !page.contains("<billing>"),
            "{page}"
        );
        assert!(
            page.contains("/queues/orders/groups/%3Cbilling%3E"),
            "{page}"
        );
        assert!(page.contains("No consumer groups yet"), "{page}");
        let live = live(&snapshot, &history, 1_000_000);
        let cells = &live["cells"];
        assert_eq!(cells["orders/<billing>/backlog"], "12");
        assert_eq!(cells["orders/<billing>/locked"], "1");
        assert_eq!(cells["orders/<billing>/oldest"], "1m ago");
        // The backlog fell by 8 over 100 s.
        assert_eq!(cells["orders/<billing>/trend"], "−0.1/s");
        assert_eq!(cells["orders/<billing>/owners"], "1 / 1");
        assert!(live["sparks"]["orders/<billing>/spark"]
            .as_str()
            .unwrap()
            .contains("<path"));
    }
}
