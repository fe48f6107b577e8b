//! One group: its figures and charts, its ranges with their owners, the work in progress.

use cosmosq_queue::{MessageState, StateDoc};
use maud::{html, Markup};

use super::overview::at_least;
use super::{encode, group_url, key_text, layout, message_url, when};
use crate::history::{History, Series};
use crate::svg;
use crate::watch::GroupView;

pub(crate) fn group(
    view: &GroupView,
    in_progress: &[StateDoc],
    history: &History,
    now_ms: i64,
) -> Markup {
    let url = group_url(&view.queue, &view.name);
    let series = history.get(&view.queue, &view.name);
    let content = html! {
        h1 { (view.name) span.muted { " on " (view.queue) } }
        @if let Some(error) = &view.error { p.error { (error) } }
        dl.figures {
            div { dt { "Backlog" } dd { (view.backlog) } }
            div { dt { "Lag" } dd { (view.lag) } }
            div { dt { "Locked" } dd { (at_least(view.locked, view.capped)) } }
            div { dt { "Retrying" } dd { (at_least(view.retrying, view.capped)) } }
            div { dt { "Scheduled" } dd { (at_least(view.scheduled, view.capped)) } }
            div { dt { "Oldest" } dd { (when(now_ms, view.oldest_unsettled_at)) } }
            div { dt { "Dead letters" } dd { a href=(format!("{url}/dead-letters")) { (view.dead_letters) } } }
        }
        section {
            h2 { "Recent history" }
            div.charts #charts data-src=(format!("{url}/charts")) { (charts(series, history.window_ms(), now_ms)) }
        }
        section {
            h2 { "Ranges" }
            div.scroll { table {
                thead { tr { th { "Range" } th { "Owner" } th { "Heartbeat" } th { "Checkpoint" } th.n { "Lag" } th.n { "Backlog" } th.n title="first deliveries the lease lists as started with no outcome recorded yet; settled ones leave the list at the range's next checkpoint" { "Started" } } }
                tbody {
                    @for r in &view.ranges {
                        tr {
                            td { code { (cosmosq_queue::range::label(&r.min_epk, &r.max_epk)) } }
                            td { @match &r.owner { Some(o) => (o), None => span.muted { "free" } } @if r.expired { " " span.badge.warn { "expired" } } }
                            td { (when(now_ms, r.heartbeat_at)) }
                            td { (when(now_ms, r.checkpointed_at)) }
                            td.n { @match r.lag { Some(l) => (l), None => span.muted { "unknown" } } }
                            td.n { (r.backlog) }
                            td.n { (r.started) }
                        }
                    }
                }
            } }
        }
        section {
            h2 { "In progress" }
            p.muted { "Locked, waiting to retry, or scheduled (first deliveries of stream groups and of the lease write path are counted per range above)." }
            @if in_progress.is_empty() { p.muted { "Nothing." } } @else {
                div.scroll { table {
                    thead { tr { th { "Message" } th { "Key" } th { "State" } th.n { "Attempt" } th { "Owner" } th { "Until / at" } th { "Last error" } } }
                    tbody {
                        @for doc in in_progress {
                            tr {
                                td { a href=(message_url(&view.queue, &doc.id, &doc.message_pk)) { (doc.id) } }
                                td { (key_text(&doc.message_pk)) }
                                td { span.badge { (state_text(doc.state)) } }
                                td.n { (doc.attempts) }
                                td { (doc.owner.as_deref().unwrap_or("–")) }
                                td { (when(now_ms, doc.due)) }
                                td.clip { (doc.last_error.as_deref().unwrap_or("")) }
                            }
                        }
                    }
                } }
            }
        }
        section {
            h2 { "Find a message" }
            form.lookup method="get" action=(format!("/queues/{}/messages", encode(&view.queue))) {
                label { "Message id " input type="search" name="id" required accesskey="f"; }
                label { "key " input type="text" name="key" placeholder="the id when empty"; }
                button type="submit" { "Look up" }
            }
        }
    };
    layout(
        &view.name,
        &[
            (view.queue.as_str(), "/".into()),
            (view.name.as_str(), url.clone()),
        ],
        content,
    )
}

/// The charts of a group's last window: what the page shows and what it fetches each round.
pub(crate) fn charts(series: Option<&Series>, window_ms: i64, now_ms: i64) -> Markup {
    let from = shown_from(series, window_ms, now_ms);
    let of = |f: fn(&crate::history::Sample) -> f64| -> Vec<(i64, f64)> {
        series
            .map(|s| s.samples().map(|x| (x.at_ms, f(x))).collect())
            .unwrap_or_default()
    };
    let trend = series.map(Series::trend).unwrap_or_default();
    html! {
        (svg::chart("Backlog", "messages", &of(|s| s.backlog as f64), from, now_ms))
        (svg::chart("Backlog change", "/s", &trend, from, now_ms))
        (svg::chart("Locked", "messages", &of(|s| s.locked as f64), from, now_ms))
        (svg::chart("Retrying", "messages", &of(|s| s.retrying as f64), from, now_ms))
        (svg::chart("Dead letters", "messages", &of(|s| s.dead_letters as f64), from, now_ms))
    }
}

/// Where a chart's time axis starts: the window, or the first sample when the console has
/// run for less (a chart of a few minutes drawn into an hour is a line at the right edge).
pub(crate) fn shown_from(series: Option<&Series>, window_ms: i64, now_ms: i64) -> i64 {
    let from = now_ms - window_ms;
    series
        .and_then(Series::since)
        .map_or(from, |since| since.max(from))
}

pub(crate) fn state_text(state: MessageState) -> &'static str {
    match state {
        MessageState::Scheduled => "scheduled",
        MessageState::Locked => "locked",
        MessageState::Retry => "waiting to retry",
        MessageState::Completed => "completed",
        MessageState::DeadLettered => "dead-lettered",
        MessageState::Purged => "purged",
    }
}
