//! moor-hostpath: a CSI plugin whose volumes are directories on the host, for demos and
//! for tests that must exercise every branch of the lifecycle.
//!
//! # Layout
//! - [`state`]: volumes, snapshots, attachments, stages and publishes, persisted in the
//!   state dir after every change.
//! - `identity`, `controller`, `node`, `group`: the CSI services (the spec's error
//!   codes).
//! - `health`: the CSI 1.13 volume and storage health RPCs (`--health-api`).
//! - [`attach_marker`]: what a node instance sees of a ControllerPublish.
//! - [`mounts`]: real bind mounts (or none, with `--no-mount`).
//! - [`faults`]: fault injection through the admin socket.
//! - [`calllog`]: one JSON line per RPC.
//! - [`checker`]: moor's invariants checked over call logs.
//! - `term`: the term a call was made under (the `moor-term` header), logged with it.

pub mod attach_marker;
pub mod calllog;
pub mod checker;

mod controller;
pub mod faults;
mod group;
mod health;
mod identity;
pub mod mounts;
mod node;
pub mod state;
mod term;

use moor_csi::journal::Journal;
use moor_csi::v1::{
    controller_server::ControllerServer, identity_server::IdentityServer, node_server::NodeServer,
};
use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use tonic::{Response, Status};

use calllog::{Call, CallLog};
use faults::Faults;
use state::State;

/// Which CSI services this instance serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Identity, Controller and Node.
    Monolith,
    /// Identity and Controller.
    Controller,
    /// Identity and Node.
    Node,
}

/// Which VOLUME_EXPANSION the plugin advertises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Expansion {
    /// Volumes in use are expanded.
    Online,
    /// Only volumes not published are expanded.
    Offline,
}

/// Which generation of the volume health API the plugin serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum HealthApi {
    /// CSI 1.13: ControllerListVolumeHealth, ControllerGetVolumeHealth,
    /// NodeGetVolumeHealth, NodeGetStorageHealth and their capabilities; no
    /// `volume_condition` anywhere.
    #[value(name = "1.13")]
    V113,
    /// CSI 1.9-1.12: VOLUME_CONDITION on both services, the condition in ListVolumes,
    /// ControllerGetVolume and NodeGetVolumeStats; the 1.13 RPCs UNIMPLEMENTED.
    #[value(name = "1.12")]
    V112,
}

/// How the plugin runs (the command line).
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "moor-hostpath", version = moor_csi::version::VERSION, about = "moor's reference CSI plugin")]
pub struct Config {
    /// How log lines are written: text, or json (one object per line).
    #[arg(long, env = "MOOR_LOG_FORMAT", default_value = "text")]
    pub log_format: moor_csi::process::LogFormat,
    /// Where to serve CSI, `unix:///path/to/csi.sock`.
    #[arg(long)]
    pub endpoint: String,
    /// This node's id, as NodeGetInfo reports it.
    #[arg(long)]
    pub node_id: String,
    /// Where volumes, state, the call log and the admin socket live.
    #[arg(long)]
    pub state_dir: PathBuf,
    /// Which services to serve.
    #[arg(long, value_enum, default_value = "monolith")]
    pub mode: Mode,
    /// The driver name GetPluginInfo reports.
    #[arg(long, default_value = "hostpath.moor.dev")]
    pub driver_name: String,
    /// NodeGetInfo's max_volumes_per_node (0: no limit); ControllerPublish enforces it.
    #[arg(long, default_value_t = 0)]
    pub max_volumes_per_node: i64,
    /// Topology segments of this node, `key=value,...`; enables
    /// VOLUME_ACCESSIBILITY_CONSTRAINTS.
    #[arg(long, value_delimiter = ',')]
    pub topology: Vec<String>,
    /// A topology segment the controller instance serves, with the capacity volumes
    /// may take in it: `KEY=VALUE[,KEY=VALUE...]:SIZE` (e.g. `zone=b:10GiB`), repeatable.
    /// CreateVolume then places a volume in the first segment its preferred, else
    /// requisite, topology allows (RESOURCE_EXHAUSTED when none, or when that segment
    /// is full), and GetCapacity answers per segment. Enables
    /// VOLUME_ACCESSIBILITY_CONSTRAINTS. Without it: `--topology` and `--capacity`.
    #[arg(long = "segment")]
    pub segments: Vec<String>,
    /// Total capacity volumes may take (bytes or units, e.g. 100GiB).
    #[arg(long, default_value = "100GiB")]
    pub capacity: String,
    /// Advertise PUBLISH_UNPUBLISH_VOLUME (ControllerPublish needed).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub publish_unpublish: bool,
    /// Advertise LIST_VOLUMES (and answer ListVolumes; UNIMPLEMENTED otherwise).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub list_volumes: bool,
    /// Advertise STAGE_UNSTAGE_VOLUME (NodeStage needed).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub stage_unstage: bool,
    /// Block volumes are real devices: the backing file is attached to a loop device
    /// (`losetup`) at NodeStage (or NodePublish without staging) and the device is
    /// bind-mounted on the target file; detached at NodeUnstage (NodeUnpublish).
    /// Ignored with --no-mount.
    #[arg(long)]
    pub loop_devices: bool,
    /// Keep the same state and rules without mounting (unprivileged machines, benchmarks).
    #[arg(long)]
    pub no_mount: bool,
    /// The largest volume the plugin makes (bytes or units, e.g. 8MiB): CreateVolume and
    /// ControllerExpandVolume asked for more answer OUT_OF_RANGE ("unsupported
    /// capacity_range"), a refusal for good. Without it: no limit but `--capacity`.
    #[arg(long)]
    pub max_volume_size: Option<String>,
    /// ControllerExpandVolume answers `node_expansion_required` (NodeExpandVolume then
    /// follows on each node using the volume).
    #[arg(long)]
    pub node_expansion_required: bool,
    /// VOLUME_EXPANSION as advertised: `online` expands volumes in use; `offline`
    /// refuses to expand a published volume (FailedPrecondition).
    #[arg(long, value_enum, default_value = "online")]
    pub expansion: Expansion,
    /// The mutable parameter names ControllerModifyVolume (and CreateVolume's
    /// mutable_parameters) accept; when set, MODIFY_VOLUME is advertised. Others are
    /// InvalidArgument.
    #[arg(long, value_delimiter = ',')]
    pub mutable_parameters: Vec<String>,
    /// Advertise VOLUME_MOUNT_GROUP: NodeStage/NodePublish honour the capability's
    /// volume_mount_group (the data directory's group, when mounting); without it a
    /// mount group is INVALID_ARGUMENT.
    #[arg(long)]
    pub volume_mount_group: bool,
    /// Advertise SINGLE_NODE_MULTI_WRITER on the controller and node services (the
    /// spec's single-node-single-writer and single-node-multi-writer modes), as the
    /// kubernetes-csi hostpath driver does. `--single-node-multi-writer=false`: the
    /// five older modes only.
    #[arg(long, default_value_t = true, num_args = 0..=1, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    pub single_node_multi_writer: bool,
    /// Answer as the spec's ControllerPublishVolume and NodePublishVolume tables say a
    /// plugin should, not leniently: a volume published on this node at one target
    /// path is published at another only when both publishes use a MULTI_NODE mode or
    /// SINGLE_NODE_MULTI_WRITER (else FAILED_PRECONDITION, "exceeds capabilities"); a
    /// target path published with another access mode is ALREADY_EXISTS. On by
    /// default, so that a test catches a lenient assumption; `--strict=false` accepts
    /// both, as many drivers do.
    #[arg(long, default_value_t = true, num_args = 0..=1, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    pub strict: bool,
    /// The nodes "in the cloud": every instance registers its node id in this
    /// directory at start, and ControllerPublishVolume for a node id neither its own nor
    /// registered there is NOT_FOUND. Without it, only its own node id is known.
    #[arg(long)]
    pub node_registry: Option<PathBuf>,
    /// A snapshot reports ready_to_use only from its (N+1)th read on (CreateSnapshot,
    /// GetSnapshot, ListSnapshots), as a plugin still uploading it would; 0: at once.
    #[arg(long, default_value_t = 0)]
    pub snapshot_ready_after: u32,
    /// The volume health API served: `1.13` (the health RPCs, set by the `health` and
    /// `storage_health` faults) or `1.12` (VolumeCondition, set by the `condition`
    /// fault).
    #[arg(long, value_enum, default_value = "1.13")]
    pub health_api: HealthApi,
    /// The fault-injection socket (default `<state-dir>/admin.sock`).
    #[arg(long)]
    pub admin_socket: Option<PathBuf>,
    /// The call log (default `<state-dir>/calls.jsonl`).
    #[arg(long)]
    pub call_log: Option<PathBuf>,
}

impl Config {
    /// The admin socket's path.
    pub fn admin_path(&self) -> PathBuf {
        self.admin_socket
            .clone()
            .unwrap_or_else(|| self.state_dir.join("admin.sock"))
    }

    /// The call log's path.
    pub fn call_log_path(&self) -> PathBuf {
        self.call_log
            .clone()
            .unwrap_or_else(|| self.state_dir.join("calls.jsonl"))
    }

    fn socket_path(&self) -> anyhow::Result<PathBuf> {
        self.endpoint
            .strip_prefix("unix://")
            .map(PathBuf::from)
            .ok_or_else(|| {
                anyhow::anyhow!("--endpoint must be unix:///path, got {:?}", self.endpoint)
            })
    }
}

struct Inner {
    cfg: Config,
    capacity: i64,
    /// `--max-volume-size`.
    max_volume: Option<i64>,
    topology: BTreeMap<String, String>,
    /// `--segment`s: the controller's segments and their capacities.
    segments: Vec<(BTreeMap<String, String>, i64)>,
    state: Mutex<Journal<State>>,
    log: CallLog,
    faults: Arc<Faults>,
    /// Reads of each snapshot so far (`--snapshot-ready-after`).
    snapshot_reads: std::sync::Mutex<std::collections::HashMap<String, u32>>,
}

/// The plugin: a cheap handle shared by the three services.
#[derive(Clone)]
pub struct Plugin {
    inner: Arc<Inner>,
}

/// Writes the call's log line when it ends, or as `Cancelled` if the caller gave up and
/// the handler was dropped.
struct LogGuard<'a> {
    log: &'a CallLog,
    call: Option<Call>,
    start: Instant,
}

impl LogGuard<'_> {
    fn finish(&mut self, result: Result<(), &Status>) {
        if let Some(mut call) = self.call.take() {
            match result {
                Ok(()) => call.code = "OK".into(),
                Err(s) => {
                    call.code = format!("{:?}", s.code());
                    call.message = Some(s.message().to_string());
                }
            }
            self.write(call);
        }
    }

    fn write(&self, mut call: Call) {
        call.time = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
        call.duration_ms = self.start.elapsed().as_secs_f64() * 1000.0;
        self.log.append(&call);
    }
}

impl Drop for LogGuard<'_> {
    fn drop(&mut self) {
        if let Some(mut call) = self.call.take() {
            call.code = "Cancelled".into();
            self.write(call);
        }
    }
}

impl Plugin {
    /// Loads the state and opens the call log.
    pub fn new(cfg: Config) -> anyhow::Result<Plugin> {
        use anyhow::Context;
        std::fs::create_dir_all(cfg.state_dir.join("volumes"))
            .with_context(|| format!("creating {}", cfg.state_dir.display()))?;
        std::fs::create_dir_all(cfg.state_dir.join("snapshots"))?;
        let capacity = size_flag("--capacity", &cfg.capacity)?;
        let max_volume = cfg
            .max_volume_size
            .as_deref()
            .map(|m| size_flag("--max-volume-size", m))
            .transpose()?;
        let mut topology = BTreeMap::new();
        for seg in &cfg.topology {
            let (k, v) = seg
                .split_once('=')
                .ok_or_else(|| anyhow::anyhow!("--topology takes key=value, got {seg:?}"))?;
            topology.insert(k.to_string(), v.to_string());
        }
        let mut segments = Vec::new();
        for seg in &cfg.segments {
            let (pairs, size) = seg.rsplit_once(':').ok_or_else(|| {
                anyhow::anyhow!("--segment takes KEY=VALUE[,KEY=VALUE]:SIZE, got {seg:?}")
            })?;
            let mut t = BTreeMap::new();
            for pair in pairs.split(',') {
                let (k, v) = pair.split_once('=').ok_or_else(|| {
                    anyhow::anyhow!("--segment {seg:?}: {pair:?} is not KEY=VALUE")
                })?;
                t.insert(k.to_string(), v.to_string());
            }
            let bytes = size_bytes(size)
                .ok_or_else(|| anyhow::anyhow!("--segment {seg:?}: {size:?} is not a size"))?;
            segments.push((t, bytes));
        }
        let state = State::load(&cfg.state_dir)?;
        let log = CallLog::open(&cfg.call_log_path())
            .with_context(|| format!("opening {}", cfg.call_log_path().display()))?;
        Ok(Plugin {
            inner: Arc::new(Inner {
                cfg,
                capacity,
                max_volume,
                topology,
                segments,
                state: Mutex::new(state),
                log,
                faults: Arc::new(Faults::default()),
                snapshot_reads: Default::default(),
            }),
        })
    }

    /// Whether block volumes are loop devices (`--loop-devices`, and mounting).
    fn loop_devices(&self) -> bool {
        self.inner.cfg.loop_devices && !self.inner.cfg.no_mount
    }

    fn cfg(&self) -> &Config {
        &self.inner.cfg
    }

    /// Whether the plugin is told to commit `lie` (a fault for the contract monitor).
    fn lies(&self, lie: faults::Lie) -> bool {
        self.inner.faults.lies(lie)
    }

    /// OUT_OF_RANGE when `required` bytes exceed `--max-volume-size`.
    fn within_max_size(&self, required: i64) -> Result<(), Status> {
        match self.inner.max_volume {
            Some(max) if required > max => Err(Status::out_of_range(format!(
                "unsupported capacity_range: {required} bytes required, this plugin makes volumes of at most {max}"
            ))),
            _ => Ok(()),
        }
    }

    /// max_volumes_per_node now: the flag's, unless a fault changed it.
    fn max_volumes(&self) -> i64 {
        self.inner
            .faults
            .max_volumes()
            .unwrap_or(self.cfg().max_volumes_per_node)
    }

    /// Runs one RPC: faults first, then the operation, then the log line.
    async fn call<T: Logged>(
        &self,
        mut call: Call,
        op: impl Future<Output = Result<T, Status>>,
    ) -> Result<Response<T>, Status> {
        call.plugin_node = self.cfg().node_id.clone();
        let named = term::current();
        call.term = named.term;
        call.sent_ms = named.sent_ms;
        let rpc = call.rpc.clone();
        let mut guard = LogGuard {
            log: &self.inner.log,
            call: Some(call),
            start: Instant::now(),
        };
        let hold = match self.inner.faults.before(&rpc).await {
            Ok(hold) => hold,
            Err(status) => {
                guard.finish(Err(&status));
                return Err(status);
            }
        };
        let result = op.await;
        if let (Ok(resp), Some(call)) = (&result, guard.call.as_mut()) {
            resp.annotate(call);
        }
        self.inner.faults.after(&rpc, hold).await;
        guard.finish(result.as_ref().map(|_| ()));
        result.map(Response::new)
    }

    /// Changes the state: what `f` changed is saved before the call goes on; if `f`
    /// fails or the save does, nothing changes.
    async fn mutate<R>(
        &self,
        f: impl FnOnce(&mut State) -> Result<R, Status>,
    ) -> Result<R, Status> {
        let mut state = self.inner.state.lock().await;
        let r = match f(state.state_mut()) {
            Ok(r) => r,
            Err(e) => {
                state.rollback();
                return Err(e);
            }
        };
        state.commit().map_err(|e| {
            Status::internal(format!(
                "cannot save state: {}",
                moor_csi::process::error_chain(&e)
            ))
        })?;
        Ok(r)
    }

    async fn read<R>(&self, f: impl FnOnce(&State) -> R) -> R {
        f(&*self.inner.state.lock().await)
    }
}

/// Serves the plugin on its unix socket, and the admin socket, until `shutdown`.
pub async fn run(cfg: Config, shutdown: CancellationToken) -> anyhow::Result<()> {
    use anyhow::Context;
    let socket = cfg.socket_path()?;
    let admin = cfg.admin_path();
    let mode = cfg.mode;
    if let Some(reg) = &cfg.node_registry {
        std::fs::create_dir_all(reg)
            .and_then(|()| std::fs::write(reg.join(attach_marker::file_name(&cfg.node_id)), b""))
            .with_context(|| format!("registering node {} in {}", cfg.node_id, reg.display()))?;
    }
    let plugin = Plugin::new(cfg)?;
    for path in [&socket, &admin] {
        if path.exists() {
            std::fs::remove_file(path)
                .with_context(|| format!("removing stale {}", path.display()))?;
        }
    }
    let admin_listener = tokio::net::UnixListener::bind(&admin)
        .with_context(|| format!("binding {}", admin.display()))?;
    tokio::spawn(plugin.inner.faults.clone().serve_admin(admin_listener));
    let listener = tokio::net::UnixListener::bind(&socket)
        .with_context(|| format!("binding {}", socket.display()))?;
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    let mut router = tonic::transport::Server::builder()
        .layer(term::TermLayer)
        .add_service(IdentityServer::new(plugin.clone()));
    if mode != Mode::Node {
        router = router.add_service(ControllerServer::new(plugin.clone()));
        router = router.add_service(
            moor_csi::v1::group_controller_server::GroupControllerServer::new(plugin.clone()),
        );
    }
    if mode != Mode::Controller {
        router = router.add_service(NodeServer::new(plugin.clone()));
    }
    tracing::info!(socket = %socket.display(), admin = %admin.display(), ?mode, "serving CSI");
    router
        .serve_with_incoming_shutdown(incoming, shutdown.cancelled())
        .await
        .context("serving CSI")?;
    Ok(())
}

/// What a response adds to its call's log line.
trait Logged {
    fn annotate(&self, _call: &mut Call) {}
}

macro_rules! logged {
    ($($t:ty),* $(,)?) => { $(impl Logged for $t {})* };
}

logged!(
    moor_csi::v1::GetPluginInfoResponse,
    moor_csi::v1::GetPluginCapabilitiesResponse,
    moor_csi::v1::ProbeResponse,
    moor_csi::v1::DeleteVolumeResponse,
    moor_csi::v1::ControllerPublishVolumeResponse,
    moor_csi::v1::ControllerUnpublishVolumeResponse,
    moor_csi::v1::ValidateVolumeCapabilitiesResponse,
    moor_csi::v1::ListVolumesResponse,
    moor_csi::v1::GetCapacityResponse,
    moor_csi::v1::ControllerGetCapabilitiesResponse,
    moor_csi::v1::CreateSnapshotResponse,
    moor_csi::v1::DeleteSnapshotResponse,
    moor_csi::v1::GetSnapshotResponse,
    moor_csi::v1::GroupControllerGetCapabilitiesResponse,
    moor_csi::v1::CreateVolumeGroupSnapshotResponse,
    moor_csi::v1::DeleteVolumeGroupSnapshotResponse,
    moor_csi::v1::GetVolumeGroupSnapshotResponse,
    moor_csi::v1::ListSnapshotsResponse,
    moor_csi::v1::ControllerExpandVolumeResponse,
    moor_csi::v1::ControllerGetVolumeResponse,
    moor_csi::v1::ControllerModifyVolumeResponse,
    moor_csi::v1::NodeStageVolumeResponse,
    moor_csi::v1::NodeUnstageVolumeResponse,
    moor_csi::v1::NodePublishVolumeResponse,
    moor_csi::v1::NodeUnpublishVolumeResponse,
    moor_csi::v1::NodeGetVolumeStatsResponse,
    moor_csi::v1::NodeExpandVolumeResponse,
    moor_csi::v1::NodeGetCapabilitiesResponse,
    moor_csi::v1::NodeGetInfoResponse,
    moor_csi::v1::ControllerListVolumeHealthResponse,
    moor_csi::v1::ControllerGetVolumeHealthResponse,
    moor_csi::v1::NodeGetVolumeHealthResponse,
    moor_csi::v1::NodeGetStorageHealthResponse,
);

impl Logged for moor_csi::v1::CreateVolumeResponse {
    fn annotate(&self, call: &mut Call) {
        call.result_volume_id = self.volume.as_ref().map(|v| v.volume_id.clone());
    }
}

/// The CSI name of a capability's access mode, for the call log.
fn access_mode_name(cap: Option<&moor_csi::v1::VolumeCapability>) -> Option<String> {
    use moor_csi::v1::volume_capability::access_mode::Mode;
    let mode = cap?.access_mode.as_ref()?.mode;
    Some(
        Mode::try_from(mode)
            .map(|m| m.as_str_name().to_string())
            .unwrap_or_else(|_| mode.to_string()),
    )
}

/// Whether `node_id` is a node this plugin can publish to: its own, or one registered
/// in `--node-registry`.
fn node_known(cfg: &Config, node_id: &str) -> bool {
    node_id == cfg.node_id
        || cfg
            .node_registry
            .as_ref()
            .is_some_and(|r| r.join(attach_marker::file_name(node_id)).exists())
}

/// The capability's volume_mount_group, if any.
fn mount_group_of(cap: Option<&moor_csi::v1::VolumeCapability>) -> Option<String> {
    match cap?.access_type.as_ref()? {
        moor_csi::v1::volume_capability::AccessType::Mount(m)
            if !m.volume_mount_group.is_empty() =>
        {
            Some(m.volume_mount_group.clone())
        }
        _ => None,
    }
}

/// A size written as bytes or with units (`10GiB`), below 2^63 bytes.
fn size_bytes(text: &str) -> Option<i64> {
    let b = text.trim().parse::<bytesize::ByteSize>().ok()?;
    i64::try_from(b.as_u64()).ok()
}

/// A size flag's bytes, or an error naming the flag.
fn size_flag(flag: &str, text: &str) -> anyhow::Result<i64> {
    size_bytes(text).ok_or_else(|| {
        anyhow::anyhow!(
            "{flag} {text:?} is not a size below 2^63 bytes (write bytes, or e.g. 10GiB)"
        )
    })
}

/// The SELinux context a capability's mount flags carry (`context="LABEL"`, the label
/// without its quotes): logged, as the one mount flag that is a label, not a secret.
fn selinux_context_of(cap: Option<&moor_csi::v1::VolumeCapability>) -> Option<String> {
    match cap?.access_type.as_ref()? {
        moor_csi::v1::volume_capability::AccessType::Mount(m) => {
            m.mount_flags.iter().find_map(|f| {
                let v = f.strip_prefix("context=")?;
                Some(v.trim_matches('"').to_string())
            })
        }
        _ => None,
    }
}

fn require(value: &str, field: &str) -> Result<(), Status> {
    if value.is_empty() {
        Err(Status::invalid_argument(format!("{field} is required")))
    } else {
        Ok(())
    }
}
