//! Who may use the operator's own Entra identity.
//!
//! A CosmosQueue with `credentials.workloadIdentity` is verified, estimated and read by the
//! operator as itself: whatever its identity may do in any account, a namespace that names
//! that account could make it do. So, like cert-manager's ClusterIssuers, the operator's
//! identity serves only the namespaces an admin granted it to, per account and database
//! (`--identity-grant`): two teams granted on one account do not reach each other's
//! databases through it. A queue with a key Secret uses credentials its own namespace holds and
//! needs no grant; the sidecars always run as the group's own ServiceAccount.

use std::str::FromStr;

/// `namespaces@endpoint/databases`: the namespaces (comma-separated; `*` for all) whose queues
/// may use the operator's identity on the databases (comma-separated; `*` for all) of the
/// account at `endpoint`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdentityGrant {
    /// Namespaces allowed.
    pub namespaces: Vec<String>,
    /// The account endpoint they may use the identity on (`https://host:port`).
    pub endpoint: String,
    /// The databases of that account they may use.
    pub databases: Vec<String>,
}

impl FromStr for IdentityGrant {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        const EXAMPLE: &str = "e.g. shop,billing@https://acct.documents.azure.com:443/shop-db";
        let (namespaces, target) = text.rsplit_once('@').ok_or_else(|| {
            format!("{text:?}: expected namespaces@endpoint/databases, {EXAMPLE}")
        })?;
        let namespaces = list(namespaces);
        if namespaces.is_empty() {
            return Err(format!("{text:?}: no namespace before '@'"));
        }
        let url = url::Url::parse(target.trim())
            .map_err(|_| format!("{text:?}: {target:?} is not an https:// endpoint"))?;
        let endpoint = normalize(&url)
            .ok_or_else(|| format!("{text:?}: {target:?} is not an https:// endpoint"))?;
        let databases = list(url.path().trim_start_matches('/'));
        // Names as written: a percent-encoded one (`a%20b`) would match neither `a b` nor
        // what an admin meant.
        if databases.iter().any(|d| d.contains('%')) {
            return Err(format!(
                "{text:?}: database names in a grant cannot be percent-encoded"
            ));
        }
        if databases.is_empty() || databases.iter().any(|d| d.contains('/')) {
            return Err(format!(
                "{text:?}: name the databases after the endpoint ({EXAMPLE}; `/*` for every \
                 database of the account)"
            ));
        }
        Ok(Self {
            namespaces,
            endpoint,
            databases,
        })
    }
}

/// The comma-separated names of `text`, trimmed, empty ones dropped.
fn list(text: &str) -> Vec<String> {
    text.split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(str::to_owned)
        .collect()
}

/// `https://host:port` in one spelling, so a grant matches however the queue writes it. Only
/// https: the identity's token (scoped to every account it may reach) never goes in clear.
pub(crate) fn normalize(url: &url::Url) -> Option<String> {
    if url.scheme() != "https" {
        return None;
    }
    let host = url.host_str()?.to_ascii_lowercase();
    let port = url.port_or_known_default()?;
    Some(format!("{}://{host}:{port}", url.scheme()))
}

/// [`normalize`] of an endpoint as a queue or a flag writes it; `None` unless https.
pub(crate) fn normalize_text(endpoint: &str) -> Option<String> {
    url::Url::parse(endpoint.trim())
        .ok()
        .and_then(|u| normalize(&u))
}

/// Whether a queue in `namespace` on `database` of the account at `endpoint` may use the
/// operator's identity (pure).
pub fn identity_allowed(
    grants: &[IdentityGrant],
    namespace: &str,
    endpoint: &str,
    database: &str,
) -> bool {
    let Some(endpoint) = normalize_text(endpoint) else {
        return false;
    };
    let names = |list: &[String], name: &str| list.iter().any(|n| n == "*" || n == name);
    grants.iter().any(|g| {
        g.endpoint == endpoint && names(&g.namespaces, namespace) && names(&g.databases, database)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(text: &str) -> IdentityGrant {
        text.parse().unwrap()
    }

    #[test]
    fn only_granted_namespaces_use_the_operators_identity_on_the_granted_databases() {
        let grants = [
            grant("shop, shop-staging@https://Shop.documents.azure.com:443/shop,shop-staging"),
            grant("billing@https://shop.documents.azure.com/billing"),
            grant("*@https://shared.documents.azure.com/*"),
        ];
        for (namespace, endpoint, database, allowed) in [
            (
                "shop",
                "https://shop.documents.azure.com:443/",
                "shop",
                true,
            ),
            ("shop", "https://shop.documents.azure.com/", "shop", true), // default port
            (
                "shop-staging",
                "https://SHOP.documents.azure.com",
                "shop-staging",
                true,
            ),
            (
                "shop",
                "https://shop.documents.azure.com/",
                "shop-staging",
                true,
            ),
            // Both granted on the account; neither reaches the other's database.
            (
                "shop",
                "https://shop.documents.azure.com/",
                "billing",
                false,
            ),
            (
                "billing",
                "https://shop.documents.azure.com/",
                "shop",
                false,
            ),
            (
                "billing",
                "https://shop.documents.azure.com/",
                "billing",
                true,
            ),
            (
                "payments",
                "https://shop.documents.azure.com:443/",
                "shop",
                false,
            ),
            (
                "shop",
                "https://billing.documents.azure.com:443/",
                "shop",
                false,
            ), // account
            (
                "anyone",
                "https://shared.documents.azure.com:443/",
                "any",
                true,
            ),
            ("shop", "not a url", "shop", false),
        ] {
            assert_eq!(
                identity_allowed(&grants, namespace, endpoint, database),
                allowed,
                "{namespace} on {endpoint} {database}"
            );
        }
        assert!(!identity_allowed(
            &[],
            "shop",
            "https://shop.documents.azure.com/",
            "shop"
        ));
    }

    #[test]
    fn grants_that_do_not_parse_are_named() {
        for (bad, says) in [
            ("shop", "expected namespaces@endpoint/databases"),
            ("@https://a.documents.azure.com/db", "no namespace"),
            ("shop@ftp://a/db", "not an https:// endpoint"),
            // A grant of every database must say so.
            (
                "shop@https://a.documents.azure.com:443/",
                "name the databases",
            ),
            (
                "shop@https://a.documents.azure.com/db/colls",
                "name the databases",
            ),
            // The identity's token never goes in clear.
            (
                "shop@http://a.documents.azure.com/db",
                "not an https:// endpoint",
            ),
            // `a%20b` would match neither `a b` nor a database the admin meant.
            (
                "shop@https://a.documents.azure.com/a%20b",
                "percent-encoded",
            ),
        ] {
            let err = bad.parse::<IdentityGrant>().unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }
}
