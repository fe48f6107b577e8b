//! How to reach a Cosmos DB account: flags and environment shared by every cosmosq program.

use std::path::PathBuf;
use std::sync::Arc;

use azure_core::credentials::{Secret, TokenCredential};
use azure_data_cosmos::options::Region;
use azure_data_cosmos::{
    AccountEndpoint, AccountReference, CosmosClient, CosmosClientBuilder, RoutingStrategy,
};
use url::Url;

use crate::cosmos::account::{self, AccountCredential};
use crate::error::{QueueError, Result};

/// The account key every Cosmos DB emulator accepts (public, documented by Microsoft).
pub const EMULATOR_KEY: &str =
    "C2y6yDjf5/R+ob0N8A7Cgv30VRDJIWEHLM+4QDU5DE2nQ9nDuVTqobD4b8mGGyPMbIZnqyMsEcaGQy67XIw/Jw==";

/// How a program authenticates to the account.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Auth {
    /// Account key from --key or --key-file (a mounted Secret).
    Key,
    /// Microsoft Entra ID: Azure workload identity in Kubernetes
    /// (AZURE_FEDERATED_TOKEN_FILE is set), managed identity otherwise.
    Identity,
    /// A `cosmosq emulator` on this machine, with the emulator's well-known key.
    #[default]
    Emulator,
}

/// Connection settings (`--endpoint`, `--auth`, ...; each also from `COSMOSQ_*` variables).
#[derive(Clone, clap::Args)]
pub struct ConnectionArgs {
    /// Account endpoint, e.g. https://myaccount.documents.azure.com:443/
    #[arg(
        long,
        env = crate::env::ENDPOINT,
        default_value = "http://127.0.0.1:8081"
    )]
    pub endpoint: String,
    /// How requests are authenticated.
    #[arg(long, env = crate::env::AUTH, value_enum, default_value_t = Auth::Emulator)]
    pub auth: Auth,
    /// Account key (prefer --key-file: values in flags show in process listings).
    #[arg(long, env = crate::env::KEY, hide_env_values = true)]
    pub key: Option<String>,
    /// File holding the account key, e.g. a mounted Kubernetes Secret.
    #[arg(long, env = crate::env::KEY_FILE)]
    pub key_file: Option<PathBuf>,
    /// The region the SDK should prefer (the one nearest to this process).
    #[arg(long, env = crate::env::REGION, default_value = "eastus")]
    pub region: String,
}

impl std::fmt::Debug for ConnectionArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectionArgs")
            .field("endpoint", &self.endpoint)
            .field("auth", &self.auth)
            .field("key", &self.key.as_ref().map(|_| "<redacted>"))
            .field("key_file", &self.key_file)
            .field("region", &self.region)
            .finish()
    }
}

impl ConnectionArgs {
    /// Settings for a `cosmosq emulator` served at `endpoint`.
    pub fn emulator(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            auth: Auth::Emulator,
            key: None,
            key_file: None,
            region: "eastus".into(),
        }
    }

    /// Checks the settings without connecting; errors name the setting.
    pub fn validate(&self) -> Result<()> {
        let endpoint: AccountEndpoint = self.endpoint.parse().map_err(|_| {
            QueueError::Config(format!("--endpoint {:?} is not a URL", self.endpoint))
        })?;
        let _ = endpoint;
        if self.auth == Auth::Key && self.key.is_none() && self.key_file.is_none() {
            return Err(QueueError::Config(
                "--auth key needs --key/COSMOSQ_KEY or --key-file/COSMOSQ_KEY_FILE".into(),
            ));
        }
        Ok(())
    }

    fn account_key(&self) -> Result<Secret> {
        if let Some(key) = &self.key {
            return Ok(Secret::new(key.trim().to_owned()));
        }
        let path = self
            .key_file
            .as_ref()
            .ok_or_else(|| QueueError::Config("--auth key needs --key or --key-file".into()))?;
        let key = std::fs::read_to_string(path)
            .map_err(|e| QueueError::Config(format!("--key-file {}: {e}", path.display())))?;
        Ok(Secret::new(key.trim().to_owned()))
    }

    /// Connects, after checking that the account can hold a queue ([`account`]); the SDK
    /// discovers the account's regions on first use.
    pub async fn connect(&self) -> Result<CosmosClient> {
        self.validate()?;
        super::tls::install_crypto_provider();
        let endpoint: AccountEndpoint = self.endpoint.parse().map_err(|_| {
            QueueError::Config(format!("--endpoint {:?} is not a URL", self.endpoint))
        })?;
        let credential = match self.auth {
            Auth::Key => AccountCredential::Key(self.account_key()?),
            Auth::Emulator => AccountCredential::Key(Secret::new(EMULATOR_KEY)),
            Auth::Identity => AccountCredential::Token(identity_credential()?),
        };
        let url = Url::parse(&self.endpoint).map_err(|_| {
            QueueError::Config(format!("--endpoint {:?} is not a URL", self.endpoint))
        })?;
        account::read(&*azure_core::http::new_http_client(None), &url, &credential)
            .await?
            .check()?;
        let account = match credential {
            AccountCredential::Key(key) => AccountReference::with_authentication_key(endpoint, key),
            AccountCredential::Token(token) => AccountReference::with_credential(endpoint, token),
        };
        CosmosClientBuilder::new()
            .build(
                account,
                RoutingStrategy::ProximityTo(Region::from(self.region.clone())),
            )
            .await
            .map_err(QueueError::cosmos("connect"))
    }
}

/// Workload identity when the pod has a federated token, managed identity otherwise (the
/// operator's ARM client uses the same one).
pub fn identity_credential() -> Result<Arc<dyn TokenCredential>> {
    let credential: Arc<dyn TokenCredential> =
        if std::env::var_os("AZURE_FEDERATED_TOKEN_FILE").is_some() {
            azure_identity::WorkloadIdentityCredential::new(None)
                .map_err(|e| QueueError::Config(format!("workload identity: {e}")))?
        } else {
            azure_identity::ManagedIdentityCredential::new(None)
                .map_err(|e| QueueError::Config(format!("managed identity: {e}")))?
        };
    Ok(credential)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        conn: ConnectionArgs,
    }

    #[test]
    fn key_auth_needs_a_key_and_never_prints_it() {
        let cli = Cli::parse_from([
            "x",
            "--auth",
            "key",
            "--endpoint",
            "https://a.documents.azure.com/",
        ]);
        let err = cli.conn.validate().unwrap_err().to_string();
        assert!(err.contains("--key"), "{err}");
        let cli = Cli::parse_from(["x", "--auth", "key", "--key", "s3cr3t"]);
        cli.conn.validate().unwrap();
        assert!(!format!("{:?}", cli.conn).contains("s3cr3t"));
    }

    #[test]
    fn bad_endpoint_is_named() {
        let cli = Cli::parse_from(["x", "--endpoint", "not a url"]);
        assert!(cli
            .conn
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--endpoint"));
    }

    #[test]
    fn key_file_is_read_and_trimmed() {
        let dir = std::env::temp_dir().join(format!("cosmosq-key-{}", std::process::id()));
        std::fs::write(&dir, "abc==\n").unwrap();
        let cli = Cli::parse_from(["x", "--auth", "key", "--key-file", dir.to_str().unwrap()]);
        assert_eq!(cli.conn.account_key().unwrap().secret(), "abc==");
        std::fs::remove_file(dir).unwrap();
    }
}
