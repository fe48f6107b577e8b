//! What cosmosq checks about an account before it trusts it with a queue.
//!
//! Every claim, lease and checkpoint is a compare-and-swap on an ETag. That only holds with one
//! write region: with multi-region writes, two regions can each accept a write against the same
//! ETag and conflicts resolve last-writer-wins, so two consumers can both "win" a message. The
//! SDK reads the account's properties but does not expose them, so the account is read here, with
//! the same endpoint and credential, through the same HTTP stack (`azure_core`).

use std::sync::Arc;

use azure_core::credentials::{Secret, TokenCredential};
use azure_core::http::{HttpClient, Method, Request};
use serde::Deserialize;
use url::Url;

use crate::error::{QueueError, Result};

/// The REST API version of the account read (the one the SDK's gateway requests default to).
const API_VERSION: &str = "2020-07-15";
/// Entra ID tokens for any Cosmos DB account (the scope the SDK asks for).
const AAD_SCOPE: &str = "https://cosmos.azure.com/.default";

/// How requests to the account are signed.
#[derive(Clone)]
pub enum AccountCredential {
    /// The account key (HMAC-signed requests).
    Key(Secret),
    /// A Microsoft Entra token for the account.
    Token(Arc<dyn TokenCredential>),
}

impl std::fmt::Debug for AccountCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AccountCredential::Key(_) => "Key(<redacted>)",
            AccountCredential::Token(_) => "Token",
        })
    }
}

/// The properties of an account that decide whether cosmosq can run on it.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct AccountProperties {
    /// The account's name (`id` of the account resource).
    #[serde(default)]
    pub id: String,
    /// "Multi-region writes" in the portal; `enableMultipleWriteLocations` in the REST API.
    #[serde(rename = "enableMultipleWriteLocations", default)]
    pub multiple_write_locations: bool,
}

impl AccountProperties {
    /// Refuses an account whose writes would not serialize through one region.
    pub fn check(&self) -> Result<()> {
        if self.multiple_write_locations {
            return Err(QueueError::Config(
                "the account has multi-region writes on (enableMultipleWriteLocations): \
                 conflicting writes resolve last-writer-wins, so the ETag compare-and-swap that \
                 cosmosq's claims, leases and checkpoints rely on does not hold and a message \
                 could be delivered to two consumers at once. Use an account with a single \
                 write region (turn \"Multi-region writes\" off, or keep the queues in a \
                 separate single-write account)"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// Reads the account resource (`GET /` on the endpoint).
pub async fn read(
    http: &dyn HttpClient,
    endpoint: &Url,
    credential: &AccountCredential,
) -> Result<AccountProperties> {
    let failed = |reason: String| QueueError::Cosmos {
        operation: "read account",
        status: 0,
        sub_status: None,
        message: reason,
        answered: false,
        request_id: None,
    };
    let date = azure_core::time::to_rfc7231(&azure_core::time::OffsetDateTime::now_utc());
    let mut request = Request::new(endpoint.clone(), Method::Get);
    request.insert_header("x-ms-date", date.clone());
    request.insert_header("x-ms-version", API_VERSION);
    request.insert_header("authorization", authorization(credential, &date).await?);
    let response = http
        .execute_request(&request)
        .await
        .map_err(|e| failed(e.to_string()))?;
    let raw = response
        .try_into_raw_response()
        .await
        .map_err(|e| failed(e.to_string()))?;
    let status = u16::from(raw.status());
    if !(200..300).contains(&status) {
        return Err(QueueError::Cosmos {
            operation: "read account",
            status,
            sub_status: None,
            message: String::from_utf8_lossy(raw.body())
                .chars()
                .take(500)
                .collect(),
            answered: true,
            request_id: raw
                .headers()
                .get_optional_str(&azure_core::http::headers::HeaderName::from_static(
                    "x-ms-activity-id",
                ))
                .map(str::to_owned),
        });
    }
    // The parser's message would quote the answer: say only that it is not an account.
    serde_json::from_slice(raw.body())
        .map_err(|_| failed("the answer is not an account resource".into()))
}

/// The `authorization` header of an account read, as the SDK signs it.
async fn authorization(credential: &AccountCredential, date: &str) -> Result<String> {
    let token = match credential {
        AccountCredential::Key(key) => {
            let signature = azure_core::hmac::hmac_sha256(&string_to_sign(date), key)
                .map_err(|e| QueueError::Config(format!("signing with the account key: {e}")))?;
            format!("type=master&ver=1.0&sig={signature}")
        }
        AccountCredential::Token(credential) => {
            let token = credential
                .get_token(&[AAD_SCOPE], None)
                .await
                .map_err(|e| QueueError::Config(format!("Entra ID token for Cosmos DB: {e}")))?;
            format!("type=aad&ver=1.0&sig={}", token.token.secret())
        }
    };
    Ok(url::form_urlencoded::byte_serialize(token.as_bytes()).collect())
}

/// Master-key string to sign for the account resource: no resource type, no resource link.
fn string_to_sign(date: &str) -> String {
    format!("get\n\n\n{}\n\n", date.to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multi_region_writes_are_refused_naming_the_setting() {
        let single: AccountProperties =
            serde_json::from_str(r#"{"id":"a","enableMultipleWriteLocations":false}"#).unwrap();
        single.check().unwrap();
        let multi: AccountProperties =
            serde_json::from_str(r#"{"id":"a","enableMultipleWriteLocations":true}"#).unwrap();
        let err = multi.check().unwrap_err().to_string();
        assert!(err.contains("enableMultipleWriteLocations"), "{err}");
        assert!(err.contains("Multi-region writes"), "{err}");
        let unspecified: AccountProperties = serde_json::from_str(r#"{"id":"a"}"#).unwrap();
        unspecified.check().unwrap();
    }

    #[test]
    fn the_account_resource_is_signed_with_no_type_or_link_and_a_lowercase_date() {
        let date = "Thu, 27 Apr 2017 00:51:12 GMT";
        assert_eq!(
            string_to_sign(date),
            "get\n\n\nthu, 27 apr 2017 00:51:12 gmt\n\n"
        );
    }

    #[tokio::test]
    async fn the_key_never_appears_in_the_header_or_debug_output() {
        let key = crate::cosmos::connection::EMULATOR_KEY;
        let credential = AccountCredential::Key(Secret::new(key));
        let header = authorization(&credential, "Thu, 27 Apr 2017 00:51:12 GMT")
            .await
            .unwrap();
        assert!(
            header.starts_with("type%3Dmaster%26ver%3D1.0%26sig%3D"),
            "{header}"
        );
        assert!(!header.contains(&key[..20]));
        assert!(!format!("{credential:?}").contains(&key[..20]));
    }
}
