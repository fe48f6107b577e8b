//! The pages, as pure functions of what the handlers read: HTML by `maud`, which escapes
//! every value it is given (names, ids, keys, errors and bodies come from users' data).

mod dead_letters;
mod group;
mod message;
mod overview;

pub(crate) use dead_letters::{
    confirm, dead_letters, dead_letters_url, Act, Action, Filter, Scope,
};
pub(crate) use group::{charts, group};
pub(crate) use message::{message, message_key};
pub(crate) use overview::{live, overview};

use axum::http::StatusCode;
use cosmosq_queue::clock::format_ms;
use cosmosq_queue::MessageKey;
use maud::{html, Markup, DOCTYPE};

/// A path segment or query value, percent-encoded.
pub(crate) fn encode(part: &str) -> String {
    form_urlencoded::byte_serialize(part.as_bytes())
        .collect::<String>()
        .replace('+', "%20")
}

pub(crate) fn group_url(queue: &str, group: &str) -> String {
    format!("/queues/{}/groups/{}", encode(queue), encode(group))
}

/// A message's page: its key always as JSON, so a key of any type is looked up exactly.
pub(crate) fn message_url(queue: &str, id: &str, key: &MessageKey) -> String {
    format!(
        "/queues/{}/messages?id={}&keyJson={}",
        encode(queue),
        encode(id),
        encode(&key.canonical())
    )
}

/// "12s ago", "3m ago", "2h ago", "4d ago" (or "in …" for the future).
pub(crate) fn relative(now_ms: i64, at_ms: i64) -> String {
    let (seconds, future) = if at_ms > now_ms {
        ((at_ms - now_ms) / 1000, true)
    } else {
        ((now_ms - at_ms) / 1000, false)
    };
    let span = match seconds {
        s if s < 60 => format!("{s}s"),
        s if s < 3600 => format!("{}m", s / 60),
        s if s < 86_400 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    };
    if future {
        format!("in {span}")
    } else {
        format!("{span} ago")
    }
}

/// A time as its distance from now, with the exact time on hover.
pub(crate) fn when(now_ms: i64, at_ms: Option<i64>) -> Markup {
    html! {
        @match at_ms {
            Some(at) => time datetime=(format_ms(at)) title=(format_ms(at)) { (relative(now_ms, at)) },
            None => span.muted { "–" },
        }
    }
}

/// The page around every page's content.
pub(crate) fn layout(title: &str, crumbs: &[(&str, String)], content: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                meta name="color-scheme" content="light dark";
                title { (title) " · cosmosq" }
                link rel="icon" href="/assets/icon.svg" type="image/svg+xml";
                link rel="stylesheet" href="/assets/console.css";
                script src="/assets/console.js" defer {}
            }
            body {
                header.top {
                    a.brand href="/" accesskey="o" { "cosmosq" }
                    nav aria-label="breadcrumbs" {
                        @for (name, href) in crumbs { span.sep { "/" } a href=(href) { (name) } }
                    }
                    span.live #live title="live updates" { "●" }
                    button.theme #theme type="button" title="light or dark (t)" { "◐" }
                }
                main { (content) }
            }
        }
    }
}

/// A gated console's sign-in: a token pasted once, kept in the console's cookie.
pub(crate) fn sign_in(hint: &str, problem: Option<&str>) -> Markup {
    layout(
        "Sign in",
        &[],
        html! {
            h1 { "Sign in" }
            @if let Some(problem) = problem { p.error #problem { (problem) } }
            p { "This console shows the queues of the namespaces your Kubernetes account may read, and acts where it may update. Paste a token of that account:" }
            pre { code { (hint) } }
            form.sign-in method="post" action="/login" {
                label { "Token " textarea name="token" rows="4" required autofocus spellcheck="false" autocomplete="off" {} }
                button type="submit" { "Sign in" }
            }
        },
    )
}

pub(crate) fn error(status: StatusCode, message: &str) -> Markup {
    layout(
        status.canonical_reason().unwrap_or("error"),
        &[],
        html! {
            h1 { (status.as_u16()) " " (status.canonical_reason().unwrap_or_default()) }
            p.error { (message) }
            p { a href="/" { "Back to the overview" } }
        },
    )
}

/// A message key for people: strings as themselves, other types as JSON with their type.
pub(crate) fn key_text(key: &MessageKey) -> String {
    match key.as_json() {
        serde_json::Value::String(s) => s.clone(),
        other => format!("{other} ({})", json_type(other)),
    }
}

fn json_type(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "boolean",
        serde_json::Value::Number(_) => "number",
        serde_json::Value::String(_) => "string",
        serde_json::Value::Array(_) => "array",
        serde_json::Value::Object(_) => "object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_read_as_distances() {
        let now = 10_000_000;
        assert_eq!(relative(now, now - 12_000), "12s ago");
        assert_eq!(relative(now, now - 180_000), "3m ago");
        assert_eq!(relative(now, now - 7_200_000), "2h ago");
        assert_eq!(relative(now, now - 4 * 86_400_000), "4d ago");
        assert_eq!(relative(now, now + 5_000), "in 5s");
    }

    #[test]
    fn urls_carry_any_name_and_key_exactly() {
        assert_eq!(
            group_url("orders", "a b/c"),
            "/queues/orders/groups/a%20b%2Fc"
        );
        let key = MessageKey::from_json(serde_json::json!(5)).unwrap();
        assert_eq!(
            message_url("q", "m&1", &key),
            "/queues/q/messages?id=m%261&keyJson=5"
        );
        let key = MessageKey::from("5");
        assert_eq!(
            message_url("q", "m", &key),
            "/queues/q/messages?id=m&keyJson=%225%22"
        );
    }

    #[test]
    fn keys_say_their_type_unless_they_are_text() {
        assert_eq!(key_text(&MessageKey::from("eu")), "eu");
        let n = MessageKey::from_json(serde_json::json!(5)).unwrap();
        assert_eq!(key_text(&n), "5 (number)");
        let null = MessageKey::from_json(serde_json::Value::Null).unwrap();
        assert_eq!(key_text(&null), "null (null)");
    }

    #[test]
    fn what_users_wrote_is_escaped() {
        let page = error(StatusCode::NOT_FOUND, "<script>alert(1)</script>").into_string();
        assert!(!page.contains("<script>alert"), "{page}");
        assert!(page.contains("&lt;script&gt;"), "{page}");
    }
}
