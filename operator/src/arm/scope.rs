//! Where the operator may manage an account through Azure Resource Manager: the flags'
//! values, checked when the operator starts (pure).

use std::fmt;
use std::str::FromStr;

/// Azure's public cloud; sovereign clouds have their own (e.g. `https://management.usgovcloudapi.net`).
pub const DEFAULT_ENDPOINT: &str = "https://management.azure.com";

/// A Cosmos DB account's ARM resource id,
/// `/subscriptions/<id>/resourceGroups/<rg>/providers/Microsoft.DocumentDB/databaseAccounts/<name>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AccountId {
    subscription: String,
    resource_group: String,
    name: String,
}

impl AccountId {
    /// The account's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl fmt::Display for AccountId {
    /// The id in ARM's canonical spelling (what goes into request paths and `az` commands).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "/subscriptions/{}/resourceGroups/{}/providers/Microsoft.DocumentDB/databaseAccounts/{}",
            self.subscription, self.resource_group, self.name
        )
    }
}

impl FromStr for AccountId {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let shape = "expected /subscriptions/<id>/resourceGroups/<group>/providers/\
                     Microsoft.DocumentDB/databaseAccounts/<account>";
        let segments: Vec<&str> = text.trim().split('/').collect();
        let [empty, subscriptions, subscription, groups, resource_group, providers, namespace, accounts, name] =
            segments.as_slice()
        else {
            return Err(format!("{text:?}: {shape}"));
        };
        // ARM compares these segments without regard to case; ids copied from the portal or
        // `az` differ in it (`resourcegroups`, `Microsoft.DocumentDb`).
        let fixed = [
            (*subscriptions, "subscriptions"),
            (*groups, "resourceGroups"),
            (*providers, "providers"),
            (*namespace, "Microsoft.DocumentDB"),
            (*accounts, "databaseAccounts"),
        ];
        if !empty.is_empty()
            || fixed
                .iter()
                .any(|(seen, want)| !seen.eq_ignore_ascii_case(want))
        {
            return Err(format!("{text:?}: {shape}"));
        }
        if !is_guid(subscription) {
            return Err(format!("{text:?}: the subscription id is not a GUID"));
        }
        // Resource group: letters, digits, `-_.()`, up to 90, not ending in a period.
        let group_ok = !resource_group.is_empty()
            && resource_group.len() <= 90
            && !resource_group.ends_with('.')
            && resource_group
                .chars()
                .all(|c| c.is_alphanumeric() || "-_.()".contains(c));
        if !group_ok {
            return Err(format!(
                "{text:?}: {resource_group:?} is not a resource group name"
            ));
        }
        // Account: 3-44 lowercase letters, digits and hyphens (it is also a DNS label).
        let name_ok = (3..=44).contains(&name.len())
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
        if !name_ok {
            return Err(format!(
                "{text:?}: {name:?} is not a Cosmos DB account name"
            ));
        }
        Ok(Self {
            subscription: subscription.to_ascii_lowercase(),
            resource_group: (*resource_group).to_owned(),
            name: (*name).to_owned(),
        })
    }
}

fn is_guid(text: &str) -> bool {
    let groups: Vec<&str> = text.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, len)| g.len() == len && g.chars().all(|c| c.is_ascii_hexdigit()))
}

/// `<endpoint>=<account resource id>`: the account at `endpoint` (the data plane's, as
/// queues name it) is the ARM resource `account`, where the operator may create what a
/// granted identity queue is missing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ManagementScope {
    /// The account's endpoint, `https://host:port` (as grants spell it).
    pub endpoint: String,
    /// Its ARM resource id.
    pub account: AccountId,
}

impl FromStr for ManagementScope {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let (endpoint, id) = text.split_once('=').ok_or_else(|| {
            format!(
                "{text:?}: expected endpoint=account-resource-id, e.g. \
                 https://acct.documents.azure.com:443/=/subscriptions/<id>/resourceGroups/<group>/\
                 providers/Microsoft.DocumentDB/databaseAccounts/acct"
            )
        })?;
        let normalized = crate::grants::normalize_text(endpoint)
            .ok_or_else(|| format!("{text:?}: {endpoint:?} is not an https:// account endpoint"))?;
        Ok(Self {
            endpoint: normalized,
            account: id.parse()?,
        })
    }
}

/// The account id managed for `endpoint`, if an admin gave one (pure; the first match).
pub fn account_for<'a>(scopes: &'a [ManagementScope], endpoint: &str) -> Option<&'a AccountId> {
    let endpoint = crate::grants::normalize_text(endpoint)?;
    scopes
        .iter()
        .find(|s| s.endpoint == endpoint)
        .map(|s| &s.account)
}

/// The Azure Resource Manager endpoint: an https origin, nothing else. The operator's ARM
/// token goes there and nowhere else.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArmEndpoint(url::Url);

impl ArmEndpoint {
    /// The origin, `https://host[:port]`, without a trailing slash.
    pub fn origin(&self) -> String {
        self.0.origin().ascii_serialization()
    }

    /// The token scope for it, `<origin>/.default`.
    pub fn token_scope(&self) -> String {
        format!("{}/.default", self.origin())
    }

    /// Whether `url` is on this endpoint (scheme, host and port): the only place the
    /// operator's bearer token is sent.
    pub fn owns(&self, url: &url::Url) -> bool {
        url.origin() == self.0.origin() && url.username().is_empty() && url.password().is_none()
    }

    /// A plain-http endpoint, for the in-process fake ARM server only.
    #[cfg(test)]
    pub(crate) fn insecure_for_tests(url: url::Url) -> Self {
        Self(url)
    }
}

impl FromStr for ArmEndpoint {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let url =
            url::Url::parse(text.trim()).map_err(|_| format!("{text:?} is not an https:// URL"))?;
        if url.scheme() != "https" || url.host_str().is_none() {
            return Err(format!(
                "{text:?}: the ARM endpoint must be https:// (the operator's token goes there)"
            ));
        }
        if url.path() != "/"
            || url.query().is_some()
            || url.fragment().is_some()
            || !url.username().is_empty()
            || url.password().is_some()
        {
            return Err(format!(
                "{text:?}: give the ARM endpoint's origin only, e.g. {DEFAULT_ENDPOINT}"
            ));
        }
        Ok(Self(url))
    }
}

impl fmt::Display for ArmEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.origin())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "/subscriptions/0b1f6471-1bf0-4dda-aec3-cb9272f09590/resourceGroups/shop-rg/\
                      providers/Microsoft.DocumentDB/databaseAccounts/shop-acct";

    #[test]
    fn an_account_id_is_read_whatever_the_case_of_its_fixed_segments() {
        let id: AccountId = ID.parse().unwrap();
        assert_eq!(id.to_string(), ID);
        assert_eq!(id.name(), "shop-acct");
        let portal = "/subscriptions/0B1F6471-1BF0-4DDA-AEC3-CB9272F09590/resourcegroups/shop-rg/\
                      providers/microsoft.documentdb/DatabaseAccounts/shop-acct";
        assert_eq!(portal.parse::<AccountId>().unwrap(), id);
    }

    #[test]
    fn anything_but_a_cosmos_db_account_id_is_refused() {
        for (bad, says) in [
            ("", "expected /subscriptions"),
            // Another provider's resource, or a child of the account.
            (
                "/subscriptions/0b1f6471-1bf0-4dda-aec3-cb9272f09590/resourceGroups/rg/providers/Microsoft.Storage/storageAccounts/acct",
                "expected /subscriptions",
            ),
            (
                "/subscriptions/0b1f6471-1bf0-4dda-aec3-cb9272f09590/resourceGroups/rg/providers/Microsoft.DocumentDB/databaseAccounts/acct/sqlDatabases/db",
                "expected /subscriptions",
            ),
            // A whole subscription or resource group is not an account.
            ("/subscriptions/0b1f6471-1bf0-4dda-aec3-cb9272f09590", "expected /subscriptions"),
            (
                "subscriptions/0b1f6471-1bf0-4dda-aec3-cb9272f09590/resourceGroups/rg/providers/Microsoft.DocumentDB/databaseAccounts/acct/",
                "expected /subscriptions",
            ),
            (
                "/subscriptions/not-a-guid/resourceGroups/rg/providers/Microsoft.DocumentDB/databaseAccounts/acct",
                "not a GUID",
            ),
            (
                "/subscriptions/0b1f6471-1bf0-4dda-aec3-cb9272f09590/resourceGroups/r%2Fg/providers/Microsoft.DocumentDB/databaseAccounts/acct",
                "not a resource group name",
            ),
            (
                "/subscriptions/0b1f6471-1bf0-4dda-aec3-cb9272f09590/resourceGroups/rg/providers/Microsoft.DocumentDB/databaseAccounts/Acct?x=1",
                "not a Cosmos DB account name",
            ),
        ] {
            let err = bad.parse::<AccountId>().unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn a_management_scope_names_an_https_endpoint_and_an_account() {
        let scope: ManagementScope = format!("https://Shop-Acct.documents.azure.com/={ID}")
            .parse()
            .unwrap();
        assert_eq!(scope.endpoint, "https://shop-acct.documents.azure.com:443");
        assert_eq!(scope.account.to_string(), ID);
        let scopes = [scope];
        // However a queue spells the endpoint.
        assert!(account_for(&scopes, "https://shop-acct.documents.azure.com:443/").is_some());
        assert!(account_for(&scopes, "https://other.documents.azure.com:443/").is_none());
        assert!(account_for(&scopes, "http://shop-acct.documents.azure.com:443/").is_none());
        for (bad, says) in [
            (
                "https://a.documents.azure.com/",
                "expected endpoint=account-resource-id",
            ),
            (
                &format!("http://a.documents.azure.com/={ID}"),
                "not an https://",
            ),
            (
                "https://a.documents.azure.com/=/subscriptions/x",
                "expected /subscriptions",
            ),
        ] {
            let err = bad.parse::<ManagementScope>().unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn the_arm_endpoint_is_an_https_origin() {
        let public: ArmEndpoint = DEFAULT_ENDPOINT.parse().unwrap();
        assert_eq!(
            public.token_scope(),
            "https://management.azure.com/.default"
        );
        let gov: ArmEndpoint = "https://management.usgovcloudapi.net/".parse().unwrap();
        assert_eq!(gov.origin(), "https://management.usgovcloudapi.net");
        for bad in [
            "http://management.azure.com",
            "https://management.azure.com/tenant",
            "https://user:pw@management.azure.com",
            "https://management.azure.com/?x=1",
            "management.azure.com",
        ] {
            assert!(bad.parse::<ArmEndpoint>().is_err(), "{bad}");
        }
        let owned = |u: &str| public.owns(&url::Url::parse(u).unwrap());
        assert!(owned(
            "https://management.azure.com/subscriptions/x/operationsStatus/1"
        ));
        assert!(owned("https://MANAGEMENT.azure.com:443/x"));
        assert!(!owned("https://management.azure.com.evil.example/x"));
        assert!(!owned("http://management.azure.com/x"));
        assert!(!owned("https://management.azure.com:8443/x"));
        assert!(!owned("https://user@management.azure.com/x"));
    }
}
