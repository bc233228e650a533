//! How a process reaches etcd: endpoints, prefix, TLS files and an etcd user. The same
//! flags (and `MOOR_*` variables) for moorctl and moord.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};

use super::{Keyring, Store, StoreError};

/// The client options every connection uses: a bounded connect, keep-alives that
/// notice a dead etcd while a watch is idle, and every request marked "requires a
/// leader" (etcd's `hasleader` metadata): a member cut off from the quorum refuses
/// requests at once with "etcdserver: no leader" (sent again elsewhere, see
/// `send.rs`) and cancels its watches, which are opened again on a member that can
/// serve them; without it such a member's watches go silent, as if nothing changed.
pub(super) fn options() -> ConnectOptions {
    ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(5))
        .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5))
        .with_keep_alive_while_idle(true)
        .with_require_leader(true)
}

/// TLS and authentication for etcd.
#[derive(Clone, Default, clap::Args)]
pub struct EtcdAuth {
    /// CA certificate (PEM) that signed etcd's server certificate; turns TLS on.
    #[arg(long, env = "MOOR_CACERT", global = true)]
    pub cacert: Option<PathBuf>,
    /// Client certificate (PEM) for etcd's client-cert auth; needs --key.
    #[arg(long, env = "MOOR_CERT", global = true, requires = "key")]
    pub cert: Option<PathBuf>,
    /// Client key (PEM) for --cert.
    #[arg(long, env = "MOOR_KEY", global = true, requires = "cert")]
    pub key: Option<PathBuf>,
    /// etcd user as NAME:PASSWORD (etcd auth); prefer MOOR_USER to keep it out of `ps`.
    #[arg(long, env = "MOOR_USER", global = true, hide_env_values = true)]
    pub user: Option<String>,
    /// Key file for secrets at rest (`moord keys new`; a node agent's: `moord keys
    /// node`): secrets are sealed when written and opened when read.
    #[arg(long, env = "MOOR_ENCRYPTION_KEY_FILE", global = true)]
    pub encryption_key_file: Option<PathBuf>,
}

impl std::fmt::Debug for EtcdAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdAuth")
            .field("cacert", &self.cacert)
            .field("cert", &self.cert)
            .field("key", &self.key)
            .field(
                "user",
                &self.user.as_ref().map(|u| {
                    let name = u.split(':').next().unwrap_or_default();
                    format!("{name}:[redacted]")
                }),
            )
            .field("encryption_key_file", &self.encryption_key_file)
            .finish()
    }
}

impl EtcdAuth {
    /// Connects to `endpoints` under `prefix` with these credentials.
    pub async fn connect(&self, endpoints: &[String], prefix: &str) -> anyhow::Result<Store> {
        self.connect_within(endpoints, prefix, super::DEFAULT_REQUEST_DEADLINE)
            .await
    }

    /// [`EtcdAuth::connect`], the connection (and etcd's authentication of `--user`)
    /// bounded by `deadline`, which also bounds each request of the store returned
    /// ([`Store::with_deadline`]).
    pub async fn connect_within(
        &self,
        endpoints: &[String],
        prefix: &str,
        deadline: Duration,
    ) -> anyhow::Result<Store> {
        // The key file first: a bad one is an error before any connection is tried.
        let keyring = match &self.encryption_key_file {
            Some(path) => Some(Keyring::load(path)?),
            None => None,
        };
        let mut opts = options();
        let mut cert_pem = None;
        if let Some(user) = &self.user {
            let (name, password) = user
                .split_once(':')
                .context("--user must be NAME:PASSWORD")?;
            opts = opts.with_user(name, password);
        }
        if self.cacert.is_some() || self.cert.is_some() {
            let mut tls = TlsOptions::new();
            if let Some(ca) = &self.cacert {
                let pem = std::fs::read(ca).with_context(|| format!("reading {}", ca.display()))?;
                tls = tls.ca_certificate(Certificate::from_pem(pem));
            }
            if let (Some(cert), Some(key)) = (&self.cert, &self.key) {
                let pem =
                    std::fs::read(cert).with_context(|| format!("reading {}", cert.display()))?;
                let key_pem =
                    std::fs::read(key).with_context(|| format!("reading {}", key.display()))?;
                tls = tls.identity(Identity::from_pem(pem.clone(), key_pem));
                cert_pem = Some(pem);
            }
            opts = opts.with_tls(tls);
        }
        let started = tokio::time::Instant::now();
        let client =
            match tokio::time::timeout(deadline, Client::connect(endpoints, Some(opts))).await {
                Ok(connected) => connected.map_err(StoreError::from_etcd),
                Err(_) => Err(StoreError::Unavailable(super::send::no_answer(
                    started.elapsed(),
                ))),
            }
            .with_context(|| format!("connecting to etcd at {}", endpoints.join(",")))?;
        let identity = super::identity::of(self.user.as_deref(), cert_pem.as_deref());
        let store = Store::new(client, prefix)
            .with_deadline(deadline)
            .with_identity(identity);
        Ok(match keyring {
            Some(k) => store.with_keyring(k),
            None => store,
        })
    }
}
