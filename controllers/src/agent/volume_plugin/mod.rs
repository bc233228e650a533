//! The Docker volume-plugin endpoint (`moord agent --volume-plugin PATH`): Docker and
//! Podman ask this node's agent for moor volumes over the volume-plugin protocol, on a
//! unix socket, and get the whole CSI lifecycle behind `docker run -v NAME:/data`.
//!
//! Expected flow:
//! 1. The endpoint serves the socket systemd passed for PATH (socket activation,
//!    `moor::activation`: deploy/systemd/moor-agent.socket), else binds PATH (a stale
//!    socket left by an earlier run is replaced; any other file there is refused), and
//!    answers `POST /Plugin.Activate`, `/VolumeDriver.*`.
//! 2. Every body is read whole up to [`MAX_BODY`] and parsed as JSON whatever its
//!    Content-Type (Docker sends none, Podman its own); an answer is JSON, and an error
//!    a non-200 status with `{"Err": "..."}` (Podman reads only the status).
//! 3. Each verb is one operation of [`ops`] (Mount and Unmount: [`hold`]) on desired
//!    state in etcd: Create writes a Volume; Mount puts the caller on the engine's hold of the volume on this node
//!    (one Allocation, made by the first Mount) and waits until NodePublish returned OK
//!    for it, woken by the node pass; Unmount takes the caller off, and a hold without
//!    callers ends after the linger; Remove deletes a Volume it created. Only the
//!    linger's timer is kept in memory: an agent restart picks everything else up from
//!    etcd, and the forgotten-mount rule ends a hold whose timer was lost.
//! 4. A caller whose Unmount never came (missed while the agent was down, or a caller
//!    that gave up on a slow Mount) is found by the mount table ([`orphans`]): its
//!    allocation ends once no mount namespace of the machine uses its path.
//! 5. Each connection closes after its answer, or after an idle limit without a
//!    request (`conn`).
//!
//! # Layout
//! - this file: the socket (passed by systemd or bound), the routes, bodies parsed, and
//!   the grants checked at start.
//! - `ops`: Create, Remove, Path, Get and List on desired state.
//! - `hold`: Mount and Unmount through an engine's hold of a volume on this node.
//! - `options`: `-o KEY=VALUE` checked into a Volume.
//! - `orphans`: callers whose Unmount never came, found by the mount table.
//! - `conn`: connections with an idle deadline.

mod conn;
mod hold;
mod ops;
mod options;
pub mod orphans;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use moor::api::{Namespace, NodeName, PluginId};
use moor::store::Store;

pub use ops::Endpoint;

/// The largest request body read: the protocol's requests are a name, an id and a few
/// options.
pub const MAX_BODY: usize = 64 << 10;

/// How the endpoint is configured (`moord agent --volume-plugin*`).
#[derive(Debug, Clone)]
pub struct Config {
    /// The socket's path.
    pub path: PathBuf,
    /// The engine that calls on this socket (`docker`, `podman`, ...): each engine has
    /// a socket of its own, so the endpoint knows who asks without trusting the
    /// request, in whatever PID or mount namespace the caller runs.
    pub engine: String,
    /// Whether this socket's server also runs the agent's watcher of forgotten mounts
    /// (one per agent).
    pub watch_orphans: bool,
    /// The namespace of the volumes and allocations it serves.
    pub namespace: Namespace,
    /// The plugin a Create without `plugin=` uses.
    pub default_plugin: PluginId,
    /// How long a Mount waits for the claim to be published (Docker waits 2 min).
    pub mount_timeout: Duration,
    /// How often callers whose Unmount never came are looked for ([`orphans`]).
    pub orphan_interval: Duration,
    /// How old an allocation must be before it may be found without a caller.
    pub orphan_grace: Duration,
    /// How long a hold outlives its last Unmount (`--volume-plugin-linger`).
    pub linger: Duration,
    /// How long a caller's connection may idle (`--volume-plugin-idle-timeout`).
    pub idle_timeout: Duration,
    /// Bumped by the node pass after each Mount it writes: a Mount's wait wakes on it.
    pub wake: moor::workload::Wake,
    /// The node's plugins as this agent probes them: a Mount that needs a CSI call
    /// fails naming an unhealthy plugin instead of waiting out its timeout.
    pub plugins: crate::agent::plugins::Supervisor,
}

/// An error answered to the engine: its status and message.
#[derive(Debug)]
pub struct Failure {
    status: StatusCode,
    message: String,
    /// The store did not answer or could not be reached.
    store_unavailable: bool,
}

impl Failure {
    /// A request the endpoint refuses (bad input, a rule of moor's).
    pub fn bad(message: impl Into<String>) -> Failure {
        Failure {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            store_unavailable: false,
        }
    }

    /// A failure on moor's side (etcd, a timeout); the engine may try again.
    pub fn internal(message: impl Into<String>) -> Failure {
        Failure {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            store_unavailable: false,
        }
    }

    /// Whether the store did not answer or could not be reached.
    pub fn store_unavailable(&self) -> bool {
        self.store_unavailable
    }
}

impl From<moor::store::StoreError> for Failure {
    fn from(e: moor::store::StoreError) -> Failure {
        Failure {
            store_unavailable: e.is_transient(),
            ..Failure::internal(format!("moor's store: {}", moor::store::bounded_chain(&e)))
        }
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        json_response(self.status, &json!({ "Err": self.message }))
    }
}

/// A JSON answer (the protocol's content type).
/// Each answer closes its connection (`Connection: close`): a caller never reuses one
/// the endpoint may be closing for idleness at that moment (`conn.rs`); a unix socket
/// costs microseconds to open.
fn json_response(status: StatusCode, value: &Value) -> Response {
    (
        status,
        [
            ("content-type", "application/vnd.docker.plugins.v1+json"),
            ("connection", "close"),
        ],
        serde_json::to_vec(value).unwrap_or_default(),
    )
        .into_response()
}

/// Who is on the other end of a connection: the peer's process id as this process's
/// PID namespace numbers it (`SO_PEERCRED`), `None` when the kernel cannot number it
/// there: the caller runs in a PID namespace this process does not see into (an agent
/// in a PID namespace of its own, below the engine's).
#[derive(Debug, Clone, Copy)]
pub struct Peer {
    /// The peer's pid, when visible.
    pub pid: Option<i32>,
}

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, conn::Listener>>
    for Peer
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, conn::Listener>) -> Self {
        let pid = stream
            .io()
            .stream()
            .peer_cred()
            .ok()
            .and_then(|c| c.pid())
            .filter(|p| *p > 0);
        Peer { pid }
    }
}

/// The engine a socket serves when `--volume-plugin` names none.
pub const DEFAULT_ENGINE: &str = "docker";

/// `[ENGINE=]PATH` of `--volume-plugin`: the engine (a name: letters, digits, `.`, `_`,
/// `-`; `docker` when absent) and the socket's path.
pub fn engine_socket(flag: &str) -> Result<(String, PathBuf), String> {
    let (engine, path) = match flag.split_once('=') {
        Some((engine, path)) if !engine.contains('/') => (engine, path),
        _ => (DEFAULT_ENGINE, flag),
    };
    moor::api::Name::new(engine).map_err(|e| format!("engine {engine:?}: {e}"))?;
    if path.is_empty() {
        return Err("no socket path".into());
    }
    Ok((engine.to_string(), PathBuf::from(path)))
}

/// One verb's answer.
type Answer = Result<Value, Failure>;

/// Binds the socket and serves until `shutdown`.
pub async fn serve(
    cfg: Config,
    store: Store,
    node: NodeName,
    recorder: moor::runtime::events::Recorder,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    check_grants(&store, &cfg.namespace).await?;
    let (listener, activated) = match moor::activation::take(&cfg.path) {
        Some(l) => {
            l.set_nonblocking(true)
                .context("socket activation: setting the passed socket non-blocking")?;
            let l = tokio::net::UnixListener::from_std(l)
                .context("socket activation: serving the passed socket")?;
            (l, true)
        }
        None => (bind(&cfg.path)?, false),
    };
    tracing::info!(path = %cfg.path.display(), namespace = %cfg.namespace, activated, "serving the volume-plugin endpoint");
    let path = cfg.path.clone();
    if cfg.watch_orphans {
        tokio::spawn(orphans::watch(
            store.clone(),
            node.clone(),
            cfg.namespace.clone(),
            cfg.orphan_interval,
            cfg.orphan_grace,
            recorder,
            shutdown.clone(),
        ));
    }
    let idle_timeout = cfg.idle_timeout;
    let endpoint = Arc::new(Endpoint::new(cfg, store, node));
    let app = axum::Router::new()
        .route("/Plugin.Activate", post(activate))
        .route("/VolumeDriver.Capabilities", post(capabilities))
        .route("/VolumeDriver.{verb}", post(verb))
        .fallback(|| async { Failure::bad("no such verb").into_response() })
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(endpoint);
    let app = app.into_make_service_with_connect_info::<Peer>();
    let served = axum::serve(conn::Listener::new(listener, idle_timeout), app)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
        .context("serving the volume-plugin endpoint");
    // A socket the service manager passed stays: it holds the engines' calls while
    // the agent is away, and is passed again at the next start.
    if !activated {
        let _ = std::fs::remove_file(&path);
    }
    served
}

/// Refuses to start when this agent's etcd identity cannot do what the endpoint does:
/// read and write allocations and volumes (roles.sh grants that to the agents named in
/// VOLUME_PLUGINS). Reads are tried; writes are tried in a transaction whose condition
/// never holds (etcd checks the permission of every operation of a transaction,
/// whichever branch runs), so nothing is written.
async fn check_grants(store: &Store, ns: &Namespace) -> anyhow::Result<()> {
    use etcd_client::{Compare, CompareOp, GetOptions, Txn, TxnOp};
    let mut client = store.client();
    let hint = "roles.sh grants it to the agents named in VOLUME_PLUGINS, in the namespace VOLUME_PLUGIN_NAMESPACE (default engines), which --volume-plugin-namespace must name (deploy/etcd/roles.sh)";
    for dir in ["allocations", "volumes"] {
        let prefix = store.full_key(&format!("{dir}/{ns}/"));
        let read = client
            .get(
                prefix.as_str(),
                Some(
                    GetOptions::new()
                        .with_prefix()
                        .with_keys_only()
                        .with_limit(1),
                ),
            )
            .await;
        if let Err(e) = read {
            anyhow::bail!(
                "--volume-plugin: this agent's etcd identity cannot read {dir}/{ns}/ ({e}); {hint}"
            );
        }
        let probe = store.full_key(&format!("{dir}/{ns}/.volume-plugin-probe"));
        let txn = Txn::new()
            .when(vec![Compare::version(probe.clone(), CompareOp::Less, 0)])
            .and_then(vec![TxnOp::put(probe, "", None)]);
        if let Err(e) = client.txn(txn).await {
            anyhow::bail!(
                "--volume-plugin: this agent's etcd identity cannot write {dir}/{ns}/ ({e}); {hint}"
            );
        }
    }
    Ok(())
}

/// Binds `path`, replacing a socket left there by an earlier run (refusing anything
/// else), readable and writable by its owner only (the engines run as root).
fn bind(path: &Path) -> anyhow::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)
            .with_context(|| format!("removing the stale socket {}", path.display()))?,
        Ok(_) => anyhow::bail!(
            "--volume-plugin {}: a file that is not a socket is there",
            path.display()
        ),
        Err(_) => {}
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let listener = tokio::net::UnixListener::bind(path)
        .with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("chmod {}", path.display()))?;
    Ok(listener)
}

async fn activate() -> Response {
    json_response(StatusCode::OK, &json!({ "Implements": ["VolumeDriver"] }))
}

async fn capabilities() -> Response {
    // moor volumes are cluster-wide: the engine asks every node's endpoint alike.
    json_response(
        StatusCode::OK,
        &json!({ "Capabilities": { "Scope": "global" } }),
    )
}

/// A verb's request: its body parsed as the verb's JSON object, whatever the
/// Content-Type (fields the verb does not read are ignored).
fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Failure> {
    if body.len() > MAX_BODY {
        return Err(Failure::bad(format!(
            "the request is {} bytes; at most {MAX_BODY} are read",
            body.len()
        )));
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(v @ Value::Object(_)) => serde_json::from_value(v)
            .map_err(|e| Failure::bad(format!("the request is not valid: {e}"))),
        Ok(_) => Err(Failure::bad("the request is not a JSON object")),
        Err(e) => Err(Failure::bad(format!("the request is not JSON: {e}"))),
    }
}

async fn verb(
    State(endpoint): State<Arc<Endpoint>>,
    axum::extract::ConnectInfo(peer): axum::extract::ConnectInfo<Peer>,
    axum::extract::Path(verb): axum::extract::Path<String>,
    body: axum::body::Body,
) -> Response {
    let started = std::time::Instant::now();
    let mut reused = false;
    let answer = match read_body(body).await {
        // A Mount outlives its caller (see Endpoint::mount_for).
        Ok(bytes) if verb == "Mount" => match parse::<ops::CallerRequest>(&bytes) {
            Ok(req) => {
                let (reply, answer) = tokio::sync::oneshot::channel();
                let endpoint = endpoint.clone();
                tokio::spawn(async move { endpoint.mount_for(&req, peer, reply).await });
                match answer.await {
                    Ok(Ok((v, r))) => {
                        reused = r;
                        Ok(v)
                    }
                    Ok(Err(f)) => Err(f),
                    Err(_) => Err(Failure::internal("the Mount ended without an answer")),
                }
            }
            Err(f) => Err(f),
        },
        Ok(bytes) => endpoint.dispatch(&verb, &bytes).await,
        Err(f) => Err(f),
    };
    let elapsed_us = started.elapsed().as_micros() as u64;
    match answer {
        Ok(v) => {
            if verb == "Mount" {
                tracing::info!(verb = %verb, elapsed_us, reused, "volume-plugin request answered");
            } else if matches!(verb.as_str(), "Create" | "Remove" | "Unmount") {
                tracing::info!(verb = %verb, elapsed_us, "volume-plugin request answered");
            }
            json_response(StatusCode::OK, &v)
        }
        Err(f) => {
            tracing::info!(verb = %moor::api::printable(&verb), elapsed_us, error = %moor::api::printable(&f.message), "volume-plugin request refused");
            f.into_response()
        }
    }
}

/// Reads at most [`MAX_BODY`] + 1 bytes of a body (a longer one is refused unread).
async fn read_body(body: axum::body::Body) -> Result<Bytes, Failure> {
    axum::body::to_bytes(body, MAX_BODY + 1).await.map_err(|_| {
        Failure::bad(format!(
            "the request is larger than {MAX_BODY} bytes, or could not be read"
        ))
    })
}
