//! One message: its body and where it stands in every group of its queue.

use base64::Engine;
use cosmosq_queue::{Body, Message, MessageKey, MessageState, StateDoc};
use maud::{html, Markup};

use super::group::state_text;
use super::{group_url, key_text, layout, when};
use crate::ConsoleError;

/// Bytes shown as hex (the rest is in the base64 form).
const HEX_SHOWN: usize = 4096;

/// The key a lookup means: JSON when given so (exact type), else the text, else the id (as
/// for messages enqueued without a key).
pub(crate) fn message_key(
    id: &str,
    text: Option<&str>,
    json: Option<&str>,
) -> Result<MessageKey, ConsoleError> {
    let bad = |why: String| ConsoleError::BadRequest(why);
    match (
        text.filter(|t| !t.is_empty()),
        json.filter(|j| !j.is_empty()),
    ) {
        (_, Some(json)) => {
            let value =
                serde_json::from_str(json).map_err(|e| bad(format!("the key is not JSON: {e}")))?;
            MessageKey::from_json(value).map_err(|e| bad(format!("the key: {e}")))
        }
        (Some(text), None) => Ok(MessageKey::from(text)),
        (None, None) => Ok(MessageKey::from(id)),
    }
}

/// What a group's state document says, in words.
fn standing(state: Option<&StateDoc>, now_ms: i64) -> Markup {
    let Some(doc) = state else {
        return html! { span.muted { "no record: not delivered yet, or delivered in a stream group (which records only failures)" } };
    };
    html! {
        span.badge.(class_of(doc.state)) { (state_text(doc.state)) }
        @match doc.state {
            MessageState::Locked => { " by " (doc.owner.as_deref().unwrap_or("?")) " until " (when(now_ms, doc.due)) }
            MessageState::Retry => { " at " (when(now_ms, doc.due)) }
            MessageState::Scheduled => { " for " (when(now_ms, doc.due)) }
            MessageState::DeadLettered => { " (" (doc.reason.as_deref().unwrap_or("no reason")) ") " (when(now_ms, doc.settled_at)) }
            MessageState::Completed | MessageState::Purged => { " " (when(now_ms, doc.settled_at)) }
        }
    }
}

fn class_of(state: MessageState) -> &'static str {
    match state {
        MessageState::Completed => "good",
        MessageState::DeadLettered | MessageState::Purged => "bad",
        MessageState::Retry => "warn",
        MessageState::Locked | MessageState::Scheduled => "info",
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes
        .chunks(16)
        .enumerate()
        .map(|(i, row)| {
            let cells: Vec<String> = row.iter().map(|b| format!("{b:02x}")).collect();
            format!("{:08x}  {}", i * 16, cells.join(" "))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

pub(crate) fn message(
    queue: &str,
    id: &str,
    key: &MessageKey,
    message: Option<&Message>,
    states: &[(String, Option<StateDoc>)],
    now_ms: i64,
) -> Markup {
    let content = html! {
        h1 { "Message " code { (id) } }
        p.muted { "Key " code { (key_text(key)) } " on " (queue) }
        @match message {
            None => p.error { "No message " code { (id) } " under this key: never enqueued, or past the queue's retention. (The same id under another key is another message.)" },
            Some(m) => {
                dl.facts {
                    div { dt { "Enqueued" } dd { (when(now_ms, Some(m.enqueued_at))) } }
                    @if let Some(v) = m.visible_at { div { dt { "Visible" } dd { (when(now_ms, Some(v))) } } }
                    div { dt { "Content type" } dd { (m.content_type.as_deref().unwrap_or("–")) } }
                    @for (k, v) in &m.metadata { div { dt { (k) } dd { (v) } } }
                }
                h2 { "Body" }
                @match &m.body {
                    Body::Json(v) => pre.body { (serde_json::to_string_pretty(v).unwrap_or_default()) },
                    Body::Bytes(b) => {
                        p.muted { (b.len()) " bytes" @if b.len() > HEX_SHOWN { " (the first " (HEX_SHOWN) " in hex)" } }
                        pre.body { (hex(&b[..b.len().min(HEX_SHOWN)])) }
                        details { summary { "base64" } pre.body { (base64::engine::general_purpose::STANDARD.encode(b)) } }
                    }
                }
            }
        }
        h2 { "In each group" }
        @if states.is_empty() { p.muted { "The queue has no consumer groups yet." } } @else {
            div.scroll { table {
                thead { tr { th { "Group" } th { "State" } th.n { "Attempts" } th { "Last error" } } }
                tbody {
                    @for (group, state) in states {
                        tr data-group=(group) {
                            td { a href=(group_url(queue, group)) { (group) } }
                            td.state { (standing(state.as_ref(), now_ms)) }
                            td.n { (state.as_ref().map_or(0, |s| s.attempts)) }
                            td.clip { (state.as_ref().and_then(|s| s.last_error.as_deref()).unwrap_or("")) }
                        }
                    }
                }
            } }
        }
    };
    layout(&format!("Message {id}"), &[(queue, "/".into())], content)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lookup_key_is_json_text_or_the_id() {
        assert_eq!(message_key("m", None, Some("5")).unwrap().canonical(), "5");
        assert_eq!(
            message_key("m", Some("5"), None).unwrap().canonical(),
            "\"5\""
        );
        assert_eq!(
            message_key("m", Some(""), Some("")).unwrap().canonical(),
            "\"m\""
        );
        assert!(matches!(
            message_key("m", None, Some("{")),
            Err(ConsoleError::BadRequest(_))
        ));
    }

    #[test]
    fn bytes_show_as_hex_rows() {
        assert_eq!(hex(&[0, 255, 16]), "00000000  00 ff 10");
        assert_eq!(hex(&[7; 17]).lines().nth(1), Some("00000010  07"));
    }
}
