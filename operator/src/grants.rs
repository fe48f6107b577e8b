//! Who may use the operator's own Entra identity.
//!
//! A CosmosQueue with `credentials.workloadIdentity` is provisioned, estimated and deleted by
//! the operator as itself: whatever its identity may do in any account, a namespace that
//! names that account could make it do. So, like cert-manager's ClusterIssuers, the operator's
//! identity serves only the namespaces an admin granted it to, per account
//! (`--identity-grant`). A queue with a key Secret uses credentials its own namespace holds and
//! needs no grant; the sidecars always run as the group's own ServiceAccount.

use std::str::FromStr;

/// `namespaces@endpoint`: the namespaces (comma-separated; `*` for all) whose queues may use
/// the operator's identity on the account at `endpoint`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdentityGrant {
    /// Namespaces allowed.
    pub namespaces: Vec<String>,
    /// The account endpoint they may use the identity on.
    pub endpoint: String,
}

impl FromStr for IdentityGrant {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let (namespaces, endpoint) = text.rsplit_once('@').ok_or_else(|| {
            format!("{text:?}: expected namespaces@endpoint, e.g. shop,billing@https://acct.documents.azure.com:443/")
        })?;
        let namespaces: Vec<String> = namespaces
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(str::to_owned)
            .collect();
        if namespaces.is_empty() {
            return Err(format!("{text:?}: no namespace before '@'"));
        }
        let endpoint = normalize(endpoint)
            .ok_or_else(|| format!("{text:?}: {endpoint:?} is not an https:// endpoint"))?;
        Ok(Self {
            namespaces,
            endpoint,
        })
    }
}

/// `https://host[:443]/` in one spelling, so a grant matches however the queue writes it.
fn normalize(endpoint: &str) -> Option<String> {
    let url = url::Url::parse(endpoint.trim()).ok()?;
    if url.scheme() != "https" && url.scheme() != "http" {
        return None;
    }
    let host = url.host_str()?.to_ascii_lowercase();
    let port = url.port_or_known_default()?;
    Some(format!("{}://{host}:{port}", url.scheme()))
}

/// Whether a queue in `namespace` on `endpoint` may use the operator's identity (pure).
pub fn identity_allowed(grants: &[IdentityGrant], namespace: &str, endpoint: &str) -> bool {
    let Some(endpoint) = normalize(endpoint) else {
        return false;
    };
    grants
        .iter()
        .any(|g| g.endpoint == endpoint && g.namespaces.iter().any(|n| n == "*" || n == namespace))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(text: &str) -> IdentityGrant {
        text.parse().unwrap()
    }

    #[test]
    fn only_granted_namespaces_use_the_operators_identity_on_the_granted_account() {
        let grants = [
            grant("shop, shop-staging@https://Shop.documents.azure.com:443/"),
            grant("*@https://shared.documents.azure.com/"),
        ];
        for (namespace, endpoint, allowed) in [
            ("shop", "https://shop.documents.azure.com:443/", true),
            ("shop", "https://shop.documents.azure.com/", true), // default port, any case
            ("shop-staging", "https://SHOP.documents.azure.com", true),
            ("billing", "https://shop.documents.azure.com:443/", false), // not granted
            ("shop", "https://billing.documents.azure.com:443/", false), // another account
            ("anyone", "https://shared.documents.azure.com:443/", true),
            ("shop", "not a url", false),
        ] {
            assert_eq!(
                identity_allowed(&grants, namespace, endpoint),
                allowed,
                "{namespace} on {endpoint}"
            );
        }
        assert!(!identity_allowed(
            &[],
            "shop",
            "https://shop.documents.azure.com/"
        ));
    }

    #[test]
    fn grants_that_do_not_parse_are_named() {
        for bad in ["shop", "@https://a.documents.azure.com/", "shop@ftp://a/"] {
            assert!(bad.parse::<IdentityGrant>().is_err(), "{bad}");
        }
    }
}
