//! Dead-letter triage: the list with its filter, and replay or purge of a selection or of
//! everything matching the filter, each through a confirmation page.

use cosmosq_queue::{DeadLetter, MessageKey};
use maud::{html, Markup};

use super::{group_url, key_text, layout, message_url, when};
use crate::server::ListQuery;
use crate::watch::DEAD_LETTER_COUNT_LIMIT;
use crate::ConsoleError;

/// Which dead letters a list or an action means.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Filter {
    /// Exactly this reason.
    pub reason: Option<String>,
    /// Dead-lettered at most this long ago, as written (`2h`).
    pub within: Option<String>,
    within_ms: Option<i64>,
}

impl Filter {
    pub fn parse(reason: Option<&str>, within: Option<&str>) -> Result<Self, ConsoleError> {
        let reason = reason
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned);
        let within = within
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned);
        let within_ms = within
            .as_deref()
            .map(|w| {
                humantime::parse_duration(w)
                    .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
                    .map_err(|e| {
                        ConsoleError::BadRequest(format!(
                            "\"within\" is a duration such as 15m, 2h or 1d: {e}"
                        ))
                    })
            })
            .transpose()?;
        Ok(Self {
            reason,
            within,
            within_ms,
        })
    }

    pub fn matches(&self, dead: &DeadLetter, now_ms: i64) -> bool {
        self.reason
            .as_ref()
            .is_none_or(|r| dead.reason.as_ref() == Some(r))
            && self.within_ms.is_none_or(|w| {
                dead.dead_lettered_at
                    .is_some_and(|at| at >= now_ms.saturating_sub(w))
            })
    }

    fn is_empty(&self) -> bool {
        self.reason.is_none() && self.within.is_none()
    }

    fn describe(&self) -> String {
        match (&self.reason, &self.within) {
            (None, None) => "every dead letter".into(),
            (Some(r), None) => format!("dead letters with reason {r}"),
            (None, Some(w)) => format!("dead letters of the last {w}"),
            (Some(r), Some(w)) => format!("dead letters with reason {r} of the last {w}"),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Action {
    Replay,
    Purge,
}

impl Action {
    pub fn verb(self) -> &'static str {
        match self {
            Action::Replay => "replay",
            Action::Purge => "purge",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Action::Replay => "Replay",
            Action::Purge => "Purge",
        }
    }

    fn done(self) -> &'static str {
        match self {
            Action::Replay => "Replayed",
            Action::Purge => "Purged",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Scope {
    /// These messages (id, key).
    Selected(Vec<(String, MessageKey)>),
    /// Every dead letter the filter matches when the action runs.
    Matching(Filter),
}

impl Scope {
    pub fn filter(&self) -> Option<&Filter> {
        match self {
            Scope::Matching(f) => Some(f),
            Scope::Selected(_) => None,
        }
    }
}

/// A replay or purge as the form asked for it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Act {
    pub action: Action,
    pub scope: Scope,
    /// The confirmation page was shown and confirmed.
    pub confirmed: bool,
    /// When the confirmation page listed what matched (epoch ms): a confirmed `Matching`
    /// acts on what matched then, not on dead letters that came since.
    pub as_of: Option<i64>,
}

impl Act {
    /// From the form's fields: `action`, `scope` (`selected` with `m` = `[id, key]` each, or
    /// `matching` with `reason` and `within`), `confirmed`.
    pub fn parse(pairs: &[(String, String)]) -> Result<Self, ConsoleError> {
        let field = |name: &str| {
            pairs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
        };
        let bad = |why: String| ConsoleError::BadRequest(why);
        let action = match field("action") {
            Some("replay") => Action::Replay,
            Some("purge") => Action::Purge,
            other => return Err(bad(format!("action is replay or purge, not {other:?}"))),
        };
        let scope = match field("scope") {
            Some("selected") => {
                let mut list = Vec::new();
                for (_, m) in pairs.iter().filter(|(k, _)| k == "m") {
                    let (id, key): (String, serde_json::Value) = serde_json::from_str(m)
                        .map_err(|e| bad(format!("a selected message is not [id, key]: {e}")))?;
                    let key = MessageKey::from_json(key)
                        .map_err(|e| bad(format!("message {id}: {e}")))?;
                    list.push((id, key));
                }
                if list.is_empty() {
                    return Err(bad("select at least one dead letter".into()));
                }
                Scope::Selected(list)
            }
            Some("matching") => Scope::Matching(Filter::parse(field("reason"), field("within"))?),
            other => return Err(bad(format!("scope is selected or matching, not {other:?}"))),
        };
        let as_of = field("asOf")
            .map(|t| {
                t.parse::<i64>()
                    .map_err(|e| bad(format!("asOf is epoch milliseconds: {e}")))
            })
            .transpose()?;
        Ok(Self {
            action,
            scope,
            confirmed: field("confirmed") == Some("1"),
            as_of,
        })
    }
}

/// The list's address with its filter, and the result of an action to announce.
pub(crate) fn dead_letters_url(
    queue: &str,
    group: &str,
    filter: Option<&Filter>,
    result: Option<(Action, usize, usize)>,
) -> String {
    let mut query = form_urlencoded::Serializer::new(String::new());
    if let Some(f) = filter {
        if let Some(r) = &f.reason {
            query.append_pair("reason", r);
        }
        if let Some(w) = &f.within {
            query.append_pair("within", w);
        }
    }
    if let Some((action, n, of)) = result {
        query.append_pair("done", action.verb());
        query.append_pair("n", &n.to_string());
        query.append_pair("of", &of.to_string());
    }
    let query = query.finish();
    let base = format!("{}/dead-letters", group_url(queue, group));
    if query.is_empty() {
        base
    } else {
        format!("{base}?{query}")
    }
}

fn selection_value(id: &str, key: &MessageKey) -> String {
    serde_json::json!([id, key.as_json()]).to_string()
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn dead_letters(
    queue: &str,
    group: &str,
    all: &[DeadLetter],
    filter: &Filter,
    query: &ListQuery,
    limit: usize,
    token: &str,
    now_ms: i64,
) -> Markup {
    let mut reasons: Vec<&str> = all.iter().filter_map(|d| d.reason.as_deref()).collect();
    reasons.sort_unstable();
    reasons.dedup();
    let mut matching: Vec<&DeadLetter> = all.iter().filter(|d| filter.matches(d, now_ms)).collect();
    matching.sort_by_key(|d| std::cmp::Reverse(d.dead_lettered_at));
    let url = dead_letters_url(queue, group, None, None);
    let result = match (query.done.as_deref(), query.n, query.of) {
        (Some("replay"), Some(n), Some(of)) => Some((Action::Replay, n, of)),
        (Some("purge"), Some(n), Some(of)) => Some((Action::Purge, n, of)),
        _ => None,
    };
    let content = html! {
        h1 { "Dead letters" span.muted { " of " (group) " on " (queue) } }
        @if let Some((action, n, of)) = result {
            p.result role="status" {
                (action.done()) " " (n) " of " (of) "."
                @if n < of { " The others were no longer dead letters (replayed or purged meanwhile), or could not be reached (the console's log says which)." }
                @if action == Action::Replay && n > 0 { " They are delivered again at the group's next sweep." }
            }
        }
        form.filter method="get" action=(url) {
            label { "Reason "
                select name="reason" {
                    option value="" { "any" }
                    @for r in &reasons { option value=(r) selected[filter.reason.as_deref() == Some(*r)] { (r) } }
                }
            }
            label { "Within " input type="text" name="within" size="6" placeholder="e.g. 2h" value=(filter.within.as_deref().unwrap_or("")); }
            button type="submit" { "Filter" }
            @if !filter.is_empty() { " " a href=(url) { "clear" } }
        }
        p.muted { (matching.len()) " of " @if all.len() >= DEAD_LETTER_COUNT_LIMIT { "the first " } (all.len()) " dead letters match"
            @if matching.len() > limit { "; the " (limit) " most recent are listed" } "." }
        @if !matching.is_empty() {
            form.act method="post" action=(url) {
                input type="hidden" name="token" value=(token);
                input type="hidden" name="scope" value="selected";
                div.scroll { table.dead {
                    thead { tr {
                        th { input type="checkbox" #select-all title="select all (a)" aria-label="select all"; }
                        th { "Message" } th { "Key" } th { "Reason" } th { "Last error" } th.n { "Attempts" }
                        th { "First attempt" } th { "Last attempt" } th { "Dead-lettered" }
                    } }
                    tbody {
                        @for d in matching.iter().take(limit) {
                            tr {
                                td { input type="checkbox" name="m" value=(selection_value(&d.message_id, &d.partition_key)) aria-label=(format!("select {}", d.message_id)); }
                                td { a href=(message_url(queue, &d.message_id, &d.partition_key)) { (d.message_id) } }
                                td { (key_text(&d.partition_key)) }
                                td { span.badge.bad { (d.reason.as_deref().unwrap_or("–")) } }
                                td.clip title=(d.last_error.as_deref().unwrap_or("")) { (d.last_error.as_deref().unwrap_or("")) }
                                td.n { (d.attempts) }
                                td { (when(now_ms, d.first_attempt_at)) }
                                td { (when(now_ms, d.last_attempt_at)) }
                                td { (when(now_ms, d.dead_lettered_at)) }
                            }
                        }
                    }
                } }
                div.buttons {
                    button type="submit" name="action" value="replay" { "Replay selected" }
                    button.danger type="submit" name="action" value="purge" { "Purge selected" }
                }
            }
            form.act method="post" action=(url) {
                input type="hidden" name="token" value=(token);
                input type="hidden" name="scope" value="matching";
                @if let Some(r) = &filter.reason { input type="hidden" name="reason" value=(r); }
                @if let Some(w) = &filter.within { input type="hidden" name="within" value=(w); }
                div.buttons {
                    button type="submit" name="action" value="replay" { "Replay all " (matching.len()) " matching" }
                    button.danger type="submit" name="action" value="purge" { "Purge all " (matching.len()) " matching" }
                }
            }
        }
    };
    layout(
        "Dead letters",
        &[
            (queue, "/".into()),
            (group, group_url(queue, group)),
            ("dead letters", url.clone()),
        ],
        content,
    )
}

/// What the action will touch, and the button that does it.
pub(crate) fn confirm(
    queue: &str,
    group: &str,
    act: &Act,
    targets: &[(String, MessageKey)],
    as_of: i64,
    token: &str,
) -> Markup {
    let url = dead_letters_url(queue, group, None, None);
    let shown = 50;
    let what = match &act.scope {
        Scope::Selected(_) => format!("{} selected dead letters", targets.len()),
        Scope::Matching(f) => format!("{} ({} now)", f.describe(), targets.len()),
    };
    let content = html! {
        h1 { (act.action.title()) " " (what) "?" }
        p {
            @match act.action {
                Action::Replay => "They go back to the group with a fresh budget of attempts and are delivered at its next sweep.",
                Action::Purge => "They are discarded for good: never delivered to this group again. This cannot be undone.",
            }
        }
        ul.targets {
            @for (id, key) in targets.iter().take(shown) { li { code { (id) } span.muted { " key " (key_text(key)) } } }
            @if targets.len() > shown { li.muted { "and " (targets.len() - shown) " more" } }
        }
        form method="post" action=(url) {
            input type="hidden" name="token" value=(token);
            input type="hidden" name="action" value=(act.action.verb());
            input type="hidden" name="confirmed" value="1";
            @match &act.scope {
                Scope::Selected(list) => {
                    input type="hidden" name="scope" value="selected";
                    @for (id, key) in list { input type="hidden" name="m" value=(selection_value(id, key)); }
                }
                Scope::Matching(f) => {
                    input type="hidden" name="scope" value="matching";
                    input type="hidden" name="asOf" value=(as_of);
                    @if let Some(r) = &f.reason { input type="hidden" name="reason" value=(r); }
                    @if let Some(w) = &f.within { input type="hidden" name="within" value=(w); }
                }
            }
            div.buttons {
                button.danger[act.action == Action::Purge] #confirm type="submit" autofocus { "Yes, " (act.action.verb()) " " (targets.len()) }
                " " a href=(dead_letters_url(queue, group, act.scope.filter(), None)) { "Cancel" }
            }
        }
    };
    layout(
        "Confirm",
        &[
            (queue, "/".into()),
            (group, group_url(queue, group)),
            ("dead letters", url.clone()),
        ],
        content,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dead(id: &str, reason: &str, at: i64) -> DeadLetter {
        DeadLetter {
            message_id: id.into(),
            partition_key: MessageKey::from(id),
            group: "g".into(),
            reason: Some(reason.into()),
            last_error: Some("<boom>".into()),
            attempts: 5,
            enqueued_at: 0,
            first_attempt_at: Some(at - 1000),
            last_attempt_at: Some(at),
            dead_lettered_at: Some(at),
        }
    }

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_filter_matches_by_reason_and_age() {
        let now = 10_000_000;
        let f = Filter::parse(Some("DroppedByApp"), Some("1h")).unwrap();
        assert!(f.matches(&dead("a", "DroppedByApp", now - 60_000), now));
        assert!(!f.matches(&dead("b", "MaxDeliveryAttemptsExceeded", now - 60_000), now));
        assert!(!f.matches(&dead("c", "DroppedByApp", now - 7_200_000), now));
        assert!(Filter::parse(Some(" "), Some(""))
            .unwrap()
            .matches(&dead("d", "x", 0), now));
        assert!(matches!(
            Filter::parse(None, Some("soon")),
            Err(ConsoleError::BadRequest(_))
        ));
    }

    #[test]
    fn a_form_is_read_into_an_action_with_keys_of_every_type() {
        let act = Act::parse(&pairs(&[
            ("action", "replay"),
            ("scope", "selected"),
            ("m", r#"["m1","eu"]"#),
            ("m", r#"["m1",5]"#),
            ("m", r#"["m2",null]"#),
        ]))
        .unwrap();
        assert_eq!(act.action, Action::Replay);
        assert!(!act.confirmed);
        let Scope::Selected(list) = act.scope else {
            panic!()
        };
        let keys: Vec<String> = list.iter().map(|(_, k)| k.canonical()).collect();
        assert_eq!(
            keys,
            ["\"eu\"", "5", "null"],
            "the same id under two keys is two messages"
        );
        let act = Act::parse(&pairs(&[
            ("action", "purge"),
            ("scope", "matching"),
            ("reason", "X"),
            ("confirmed", "1"),
            ("asOf", "1700000000000"),
        ]))
        .unwrap();
        assert_eq!(
            act.as_of,
            Some(1_700_000_000_000),
            "what matched when it was confirmed"
        );
        assert_eq!(
            act.scope,
            Scope::Matching(Filter::parse(Some("X"), None).unwrap())
        );
        assert!(act.confirmed);
        for bad in [
            pairs(&[("action", "delete"), ("scope", "matching")]),
            pairs(&[("action", "replay"), ("scope", "selected")]),
            pairs(&[("action", "replay"), ("scope", "selected"), ("m", "m1")]),
            pairs(&[("action", "replay")]),
            pairs(&[("action", "purge"), ("scope", "matching"), ("asOf", "soon")]),
        ] {
            assert!(
                matches!(Act::parse(&bad), Err(ConsoleError::BadRequest(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn the_list_offers_each_row_and_everything_matching_and_escapes_errors() {
        let now = 10_000_000;
        let all = vec![
            dead("a", "DroppedByApp", now - 1000),
            dead("b", "Other", now - 2000),
        ];
        let filter = Filter::parse(Some("DroppedByApp"), None).unwrap();
        let page = dead_letters(
            "q",
            "g",
            &all,
            &filter,
            &ListQuery::default(),
            500,
            "t0k",
            now,
        )
        .into_string();
        assert!(page.contains("1 of 2 dead letters match"), "{page}");
        assert!(
            page.contains(r#"value="[&quot;a&quot;,&quot;a&quot;]""#),
            "{page}"
        );
        assert!(
            !page.contains(r#"[&quot;b&quot;"#),
            "b is filtered out: {page}"
        );
        assert!(page.contains("Replay all 1 matching"), "{page}");
        assert!(
            page.contains("&lt;boom&gt;") && !page.contains("<boom>"),
            "{page}"
        );
        assert!(page.contains(r#"name="token" value="t0k""#), "{page}");
    }

    #[test]
    fn after_an_action_the_list_says_what_was_done() {
        let url = dead_letters_url(
            "q",
            "g",
            Some(&Filter::parse(Some("a b"), None).unwrap()),
            Some((Action::Replay, 2, 3)),
        );
        assert_eq!(
            url,
            "/queues/q/groups/g/dead-letters?reason=a+b&done=replay&n=2&of=3"
        );
        let query = ListQuery {
            done: Some("replay".into()),
            n: Some(2),
            of: Some(3),
            ..ListQuery::default()
        };
        let page =
            dead_letters("q", "g", &[], &Filter::default(), &query, 500, "t", 0).into_string();
        assert!(page.contains("Replayed 2 of 3."), "{page}");
        assert!(page.contains("no longer dead letters"), "{page}");
    }
}
