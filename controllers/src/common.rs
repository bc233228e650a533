//! What both daemons share: connecting to etcd (with a probe, since the client connects
//! lazily), the /metrics and /healthz server, per-key locks, and small helpers.

use anyhow::Context;
use moor::api::*;
use moor::store::{Store, StoreError};
use prometheus_client::registry::Registry;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Flags of the daemons that record events.
#[derive(Debug, Clone, clap::Args)]
pub struct EventArgs {
    /// Repeats of an event (same object, reason and message but for its numbers) fold
    /// into one event whose count and last time are written at most this often.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub event_window: std::time::Duration,
}

impl EventArgs {
    /// The process's recorder for `source`.
    pub fn recorder(
        &self,
        store: moor::store::Store,
        source: &str,
    ) -> moor::runtime::events::Recorder {
        moor::runtime::events::Recorder::with_fold_window(store, source, self.event_window)
    }
}

/// How long a stopping daemon waits for its queued events to be written.
pub const EVENT_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// Flags every daemon takes for etcd.
#[derive(Debug, Clone, clap::Args)]
pub struct EtcdArgs {
    /// etcd endpoints, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "http://127.0.0.1:2379")]
    pub etcd: Vec<String>,
    /// Key prefix moor uses.
    #[arg(long, default_value = moor::store::DEFAULT_PREFIX)]
    pub prefix: String,
    /// Serve /metrics and /healthz on this address (e.g. 127.0.0.1:9090).
    #[arg(long)]
    pub http: Option<std::net::SocketAddr>,
    /// TLS and etcd auth.
    #[command(flatten)]
    pub auth: moor::store::EtcdAuth,
}

impl EtcdArgs {
    /// Connects and checks that etcd answers, retrying for up to `wait`.
    pub async fn connect(&self, wait: Duration) -> anyhow::Result<Store> {
        let store = self.auth.connect(&self.etcd, &self.prefix).await?;
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            // Any answer will do: an agent's role may not read that key, and a refusal
            // says etcd is up as well as a value does.
            match store
                .try_get(&Node::key_for(&NodeName::new("probe")?))
                .await
            {
                Ok(_) => return Ok(store),
                Err(e) if e.is_permission_denied() => return Ok(store),
                Err(e) if tokio::time::Instant::now() < deadline => {
                    tracing::info!(error = %e, endpoints = ?self.etcd, "waiting for etcd");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => {
                    return Err(e)
                        .with_context(|| format!("etcd at {:?} does not answer", self.etcd))
                }
            }
        }
    }
}

/// Serves `/metrics` (Prometheus text) and `/healthz` until `shutdown`.
pub async fn serve_http(
    addr: std::net::SocketAddr,
    registry: Arc<Registry>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    use axum::routing::get;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    tracing::info!(%addr, "serving /metrics and /healthz");
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let registry = registry.clone();
                async move {
                    (
                        [(
                            "content-type",
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        moor::runtime::metrics::encode(&registry),
                    )
                }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }));
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
        .context("serving http")
}

/// Async locks by key, so at most one task works on a key (one in-flight CSI call per
/// volume). Unused entries are dropped when their last holder goes.
#[derive(Clone, Default)]
pub struct KeyedLocks {
    locks: Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>,
}

impl KeyedLocks {
    /// Waits for the key's lock.
    pub async fn lock(&self, key: &str) -> KeyGuard {
        let lock = {
            let mut map = self.locks.lock().unwrap_or_else(|p| p.into_inner());
            map.entry(key.to_string()).or_default().clone()
        };
        let guard = lock.clone().lock_owned().await;
        KeyGuard {
            _guard: guard,
            key: key.to_string(),
            locks: self.clone(),
            lock,
        }
    }
}

/// Holds a key's lock.
pub struct KeyGuard {
    _guard: tokio::sync::OwnedMutexGuard<()>,
    key: String,
    locks: KeyedLocks,
    lock: Arc<tokio::sync::Mutex<()>>,
}

impl Drop for KeyGuard {
    fn drop(&mut self) {
        let mut map = self.locks.locks.lock().unwrap_or_else(|p| p.into_inner());
        // The map, this guard and the guard's own handle: nobody else is waiting.
        if Arc::strong_count(&self.lock) <= 3 {
            map.remove(&self.key);
        }
    }
}

/// A reference to an object, for events.
pub fn object_ref<S: Spec>(obj: &Object<S>) -> ObjectRef {
    ObjectRef {
        kind: S::KIND.to_string(),
        namespace: obj.metadata.namespace.clone(),
        name: obj.metadata.name.clone(),
    }
}

/// The Plugin object of plugin `id`, which events and breaches about the plugin itself
/// are recorded on.
pub fn plugin_ref(id: &PluginId) -> ObjectRef {
    ObjectRef {
        kind: PluginSpec::KIND.to_string(),
        namespace: Default::default(),
        name: Name::new(id.as_str()).unwrap_or_default(),
    }
}

/// Treats "already gone" as done.
pub fn ignore_not_found(r: Result<(), StoreError>) -> Result<(), StoreError> {
    match r {
        Err(StoreError::NotFound { .. }) => Ok(()),
        other => other,
    }
}

/// Details for an event, from pairs.
pub fn details<const N: usize>(
    pairs: [(&str, String); N],
) -> std::collections::BTreeMap<String, String> {
    pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

/// The key, the event reference and the cache lookup of a projection of a Volume (a
/// type with `namespace`, `name` and `resource_version` fields): the controller's and
/// the plugin leader's `VolumeView`s.
macro_rules! volume_view_keys {
    ($view:ty) => {
        impl $view {
            /// The volume's key.
            pub fn object_key(&self) -> moor::api::ObjectKey<moor::api::VolumeSpec> {
                moor::api::Volume::key_for(&self.namespace, &self.name)
            }

            /// The volume, as events name it.
            pub fn object_ref(&self) -> moor::api::ObjectRef {
                moor::api::ObjectRef {
                    kind: <moor::api::VolumeSpec as moor::api::Spec>::KIND.to_string(),
                    namespace: self.namespace.clone(),
                    name: self.name.clone(),
                }
            }
        }

        impl moor::runtime::Resource for $view {
            fn key(&self) -> String {
                self.object_key().into_string()
            }

            fn version(&self) -> i64 {
                self.resource_version
            }
        }

        /// The cache is looked up by the volume's typed key.
        impl moor::runtime::reflector::Lookup<$view>
            for moor::api::ObjectKey<moor::api::VolumeSpec>
        {
            fn cache_key(&self) -> &str {
                self.as_str()
            }
        }
    };
}
pub(crate) use volume_view_keys;

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn keyed_locks_exclude_per_key_and_clean_up() {
        let locks = KeyedLocks::default();
        let a = locks.lock("a").await;
        let _b = locks.lock("b").await;
        let again = tokio::time::timeout(Duration::from_millis(50), locks.lock("a")).await;
        assert!(again.is_err(), "a second holder of one key must wait");
        drop(a);
        let a2 = tokio::time::timeout(Duration::from_millis(50), locks.lock("a")).await;
        assert!(a2.is_ok());
        drop(a2);
        assert_eq!(locks.locks.lock().unwrap().len(), 1, "only b is still held");
    }
}
