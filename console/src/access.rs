//! Who may see and do what. On a user's own machine the console shows what the user's account
//! reaches ([`Access::Everything`]). Served for several tenants (the operator's console), a
//! [`Gate`] names each request's caller from a bearer token and gives it the namespaces whose
//! queues it may read and those where it may act; every page, list, live update and action
//! is cut to them.

use std::collections::BTreeSet;

use axum::http::{header, HeaderMap, StatusCode};
use futures::future::BoxFuture;

/// The cookie the sign-in page sets: the caller's token, sent back by the browser only to the
/// console (`HttpOnly`, `SameSite=Strict`).
pub const TOKEN_COOKIE: &str = "cosmosq-console-token";

/// What one request's caller may see and do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Access {
    /// Every queue, every action: the console of one account, run by its user.
    Everything,
    /// Queues of `read` only, and actions on those of `act` only (each a subset of `read`).
    Namespaces {
        read: BTreeSet<String>,
        act: BTreeSet<String>,
    },
}

impl Access {
    /// Whether the caller may see a queue of `namespace` (a queue without one: only with
    /// [`Access::Everything`]).
    pub fn may_read(&self, namespace: Option<&str>) -> bool {
        match (self, namespace) {
            (Access::Everything, _) => true,
            (Access::Namespaces { read, .. }, Some(ns)) => read.contains(ns),
            (Access::Namespaces { .. }, None) => false,
        }
    }

    /// Whether the caller may replay or purge a queue's dead letters.
    pub fn may_act(&self, namespace: Option<&str>) -> bool {
        match (self, namespace) {
            (Access::Everything, _) => true,
            (Access::Namespaces { read, act }, Some(ns)) => read.contains(ns) && act.contains(ns),
            (Access::Namespaces { .. }, None) => false,
        }
    }
}

/// Why a gate refused a request: said to the caller with this status.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    /// 401 (who is calling is unknown), 403, 429 or 5xx.
    pub status: StatusCode,
    pub message: String,
    /// For a 429: seconds until a new token may be tried.
    pub retry_after: Option<u64>,
}

/// Decides what a caller may do, for a console serving several tenants.
pub trait Gate: Send + Sync + 'static {
    /// The access of the holder of `token` to the queues of `namespaces` (the namespaces the
    /// console shows now), or why it has none.
    fn admit<'a>(
        &'a self,
        token: &'a str,
        namespaces: &'a BTreeSet<String>,
    ) -> BoxFuture<'a, Result<Access, Refusal>>;

    /// How a user gets a token, for the sign-in page (a command to run).
    fn sign_in_hint(&self) -> String;
}

/// The request's token: `Authorization: Bearer …` (scripts, `curl`), else the sign-in cookie.
pub fn request_token(headers: &HeaderMap) -> Option<String> {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let cookie = || {
        headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|pair| pair.trim().split_once('='))
            .find(|(name, _)| *name == TOKEN_COOKIE)
            .map(|(_, value)| value.trim())
    };
    bearer
        .or_else(cookie)
        .filter(|t| !t.is_empty())
        .map(str::to_owned)
}

/// The `Set-Cookie` value that keeps `token` for this console (a session cookie: it goes when
/// the browser closes, and the token's own expiry ends it sooner).
pub fn token_cookie(token: &str) -> String {
    format!("{TOKEN_COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict")
}

/// Whether `token` can be a cookie's value as is: what a bearer token is made of (JWTs are
/// base64url with dots), nothing that would end or extend the cookie.
pub fn cookie_safe(token: &str) -> bool {
    !token.is_empty()
        && token.len() <= 8192
        && token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~+/=".contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn namespaced_access_reads_and_acts_only_where_granted() {
        let access = Access::Namespaces {
            read: set(&["shop", "bank"]),
            act: set(&["shop", "hr"]),
        };
        assert!(access.may_read(Some("shop")) && access.may_act(Some("shop")));
        assert!(access.may_read(Some("bank")) && !access.may_act(Some("bank")));
        // Acting where one may not even read is not acting.
        assert!(!access.may_read(Some("hr")) && !access.may_act(Some("hr")));
        assert!(!access.may_read(None) && !access.may_act(None));
        assert!(Access::Everything.may_read(None) && Access::Everything.may_act(Some("x")));
    }

    #[test]
    fn the_token_comes_from_the_header_or_the_cookie() {
        let mut headers = HeaderMap::new();
        assert_eq!(request_token(&headers), None);
        headers.insert(
            header::COOKIE,
            "theme=dark; cosmosq-console-token=abc.def; other=1"
                .parse()
                .unwrap(),
        );
        assert_eq!(request_token(&headers).as_deref(), Some("abc.def"));
        headers.insert(header::AUTHORIZATION, "Bearer  xyz ".parse().unwrap());
        assert_eq!(request_token(&headers).as_deref(), Some("xyz"));
        headers.insert(header::AUTHORIZATION, "Basic xyz".parse().unwrap());
        assert_eq!(request_token(&headers).as_deref(), Some("abc.def"));
        let mut empty = HeaderMap::new();
        empty.insert(header::COOKIE, "cosmosq-console-token=".parse().unwrap());
        assert_eq!(request_token(&empty), None);
    }

    #[test]
    fn only_token_characters_go_into_the_cookie() {
        assert!(cookie_safe("eyJhbGciOi.eyJzdWIi-_.sig=="));
        for bad in ["", "a;b", "a b", "a\r\nSet-Cookie: x=1", "a,b", "a\"b"] {
            assert!(!cookie_safe(bad), "{bad:?}");
        }
    }
}
