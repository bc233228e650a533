//! `moord agent`: the node agent.
//!
//! Expected flow:
//! 1. Connect to etcd; grant the node's lease and keep it alive; the Node object lives
//!    under it (a dead agent's Node disappears when the lease expires).
//! 2. Supervise each configured plugin ([`plugins`]): probe until ready, fingerprint on
//!    an interval, publish what was found in the Node object.
//! 3. Run the node reconciler ([`node`]) over the claims of this node.
//! 4. For each plugin hosted here as `controller` or `monolith`, campaign for
//!    `plugin.<id>`; the leader runs that plugin's provisioner, attacher, snapshotter,
//!    group snapshotter and survey.
//!
//! # Layout
//! - [`plugins`]: plugin supervision and the node's registration.
//! - [`node`]: the node reconciler.
//! - [`state`]: the node's journal of what it staged and published.
//! - [`provisioner`], [`volume_plan`]: CreateVolume, validation, expansion,
//!   modification, DeleteVolume, and their decision.
//! - [`attacher`]: ControllerPublish and ControllerUnpublish.
//! - [`snapshotter`]: CreateSnapshot, polling, DeleteSnapshot.
//! - [`group_snapshotter`]: CreateVolumeGroupSnapshot, polling, import,
//!   DeleteVolumeGroupSnapshot, and the member Snapshots.
//! - [`survey`]: GetCapacity and ListVolumes against moor's view.
//! - [`volume_view`]: what the plugin's leader caches of each volume.
//! - [`contract`]: the live contract monitor.
//! - [`volume_plugin`]: the Docker volume-plugin endpoint.

pub mod attacher;
pub mod contract;
#[cfg(test)]
mod executor_tests;
pub mod group_snapshotter;
pub mod node;
pub mod plugins;
pub mod provisioner;
pub mod snapshotter;
pub mod state;
pub mod survey;
pub mod volume_plan;
pub mod volume_plugin;
pub mod volume_view;

use anyhow::Context;
use moor::api::*;
use moor::csi::policy::{CsiMetrics, Policy};
use moor::runtime::events::Recorder;
use moor::runtime::leader::{self, LeaderConfig};
use moor::runtime::metrics::Metrics;
use prometheus_client::registry::Registry;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

use crate::common::{EtcdArgs, KeyedLocks};
use volume_view::VolumeView;

/// Flags of `moord agent`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// This node's name.
    #[arg(long)]
    pub node: String,
    #[command(flatten)]
    pub etcd: EtcdArgs,
    #[command(flatten)]
    pub events: crate::common::EventArgs,
    /// Where the agent keeps what it staged and published.
    #[arg(long)]
    pub data_dir: PathBuf,
    /// A plugin on this node:
    /// `id=ID,type=node|controller|monolith,endpoint=unix://PATH,mount-dir=HOST_PATH[,container-mount-dir=PATH][,serialize-per-node=true][,selinux-mount=true]`.
    #[arg(long = "plugin", required = true)]
    pub plugins: Vec<String>,
    /// How often plugins are fingerprinted.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub fingerprint_interval: Duration,
    /// TTL of the node's lease: how long after the agent dies its Node disappears.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub node_ttl: Duration,
    /// Deadline of each CSI call.
    #[arg(long, default_value = "2m", value_parser = humantime::parse_duration)]
    pub csi_timeout: Duration,
    /// Tries per CSI call for retryable errors.
    #[arg(long, default_value_t = 5)]
    pub csi_tries: u32,
    /// TTL of the per-plugin controller election.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub leader_ttl: Duration,
    /// First delay before a failed CSI step is tried again (doubling, jittered).
    #[arg(long, default_value = "500ms", value_parser = humantime::parse_duration)]
    pub retry_initial: Duration,
    /// How often the usage and health of each published volume are read
    /// (NodeGetVolumeStats, where the plugin advertises GET_VOLUME_STATS).
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub volume_stats_interval: Duration,
    /// How often the leader of a controller plugin surveys it: GetCapacity, and
    /// ListVolumes compared with moor's volumes and attachments.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub survey_interval: Duration,
    /// Unpublish (ControllerUnpublishVolume) an attachment the plugin reports on a node
    /// where moor has none, once two surveys in a row saw it; off: only reported.
    #[arg(long)]
    pub unpublish_unknown_attachments: bool,
    /// Longest delay before a failed CSI step is tried again; a final answer (such as
    /// InvalidArgument) waits this long unless the step's inputs change.
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    pub retry_cap: Duration,
    /// Serve the Docker volume-plugin protocol on this unix socket, one per engine:
    /// `[ENGINE=]PATH`, repeatable (`docker=/run/docker/plugins/moor.sock`,
    /// `podman=/run/podman/moor.sock` named in containers.conf [engine.volume_plugins];
    /// a bare PATH is engine `docker`). The socket tells the endpoint which engine
    /// calls: an engine's Remove deletes only volumes that engine made.
    #[arg(long, value_name = "[ENGINE=]PATH")]
    pub volume_plugin: Vec<String>,
    /// The namespace of the volumes and allocations the volume-plugin endpoint serves.
    #[arg(long, default_value = "default")]
    pub volume_plugin_namespace: String,
    /// The plugin a volume-plugin Create without `-o plugin=` uses (default: the first
    /// node plugin of --plugin).
    #[arg(long)]
    pub volume_plugin_default: Option<String>,
    /// How long a volume-plugin Mount waits for its volume to be published (Docker
    /// waits 2 min; Podman 5 s unless its volume_plugin_timeout is raised).
    #[arg(long, default_value = "110s", value_parser = humantime::parse_duration)]
    pub volume_plugin_mount_timeout: Duration,
    /// How often the volume-plugin endpoint looks for callers whose Unmount never came
    /// (no mount namespace of this machine uses the path their Mount answered).
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub volume_plugin_orphan_interval: Duration,
    /// How old an endpoint allocation must be before it may be found without a caller
    /// (longer than a Mount may take, and a container to start after it).
    #[arg(long, default_value = "140s", value_parser = humantime::parse_duration)]
    pub volume_plugin_orphan_grace: Duration,
    /// How long an engine's hold on a volume outlives its last Unmount: a Mount of the
    /// same volume by the same engine meanwhile is answered from the publish still in
    /// place (Docker mounts and unmounts twice per `docker run` of an image that has
    /// the target directory; a restarting container unmounts and mounts again). A
    /// claim by another node waits this much longer for the release; 0 releases at once.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub volume_plugin_linger: Duration,
    /// How long a caller's connection to the volume-plugin endpoint may wait to send a
    /// request (after it opened, or after its last answer began) before it is closed;
    /// a request being answered is never cut.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub volume_plugin_idle_timeout: Duration,
}

/// One configured plugin.
#[derive(Debug, Clone, PartialEq)]
pub struct PluginConfig {
    /// The plugin id (the name volumes use in `plugin_id`).
    pub id: PluginId,
    /// Which services this instance serves.
    pub plugin_type: PluginType,
    /// `unix:///path`.
    pub endpoint: String,
    /// Host directory under which staging and target paths are made.
    pub mount_dir: PathBuf,
    /// The same directory as the plugin sees it (containerised plugins).
    pub container_mount_dir: PathBuf,
    /// `serialize-per-node=true`: one ControllerPublish or ControllerUnpublish at a
    /// time per node of this plugin (for plugins that fail when two volumes attach to
    /// one node at once); off by default. The agent leading the plugin's controller
    /// election applies its own setting.
    pub serialize_per_node: bool,
    /// `selinux-mount=true`: the node plugin takes SELinux labels as the mount flag
    /// `context="..."` of NodeStage/NodePublish (a claim's `selinux_label`); off by
    /// default, when a label is never sent to it.
    pub selinux_mount: bool,
}

impl PluginConfig {
    /// Whether this instance serves the node service.
    pub fn is_node(&self) -> bool {
        matches!(self.plugin_type, PluginType::Node | PluginType::Monolith)
    }

    /// Whether this instance serves the controller service.
    pub fn is_controller(&self) -> bool {
        matches!(
            self.plugin_type,
            PluginType::Controller | PluginType::Monolith
        )
    }
}

impl std::str::FromStr for PluginConfig {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (mut id, mut ty, mut endpoint, mut mount_dir, mut container) =
            (None, None, None, None, None);
        let (mut serialize_per_node, mut selinux_mount) = (false, false);
        for part in s.split(',').filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("{part:?} is not key=value"))?;
            match k {
                "id" => id = Some(PluginId::new(v).map_err(|e| format!("id: {e}"))?),
                "type" => {
                    ty = Some(match v {
                        "node" => PluginType::Node,
                        "controller" => PluginType::Controller,
                        "monolith" => PluginType::Monolith,
                        _ => return Err(format!("type {v:?} is not node, controller or monolith")),
                    })
                }
                "endpoint" => {
                    if !v.starts_with("unix:///") {
                        return Err(format!("endpoint {v:?} is not unix:///PATH"));
                    }
                    endpoint = Some(v.to_string())
                }
                "mount-dir" => mount_dir = Some(PathBuf::from(v)),
                "container-mount-dir" => container = Some(PathBuf::from(v)),
                "serialize-per-node" => serialize_per_node = on_off(k, v)?,
                "selinux-mount" => selinux_mount = on_off(k, v)?,
                _ => return Err(format!("unknown plugin option {k:?}")),
            }
        }
        let id = id.ok_or("id= is required")?;
        let plugin_type = ty.ok_or("type= is required")?;
        let endpoint = endpoint.ok_or("endpoint= is required")?;
        let mount_dir = match mount_dir {
            Some(d) => d,
            None if plugin_type == PluginType::Controller => PathBuf::new(),
            None => return Err("mount-dir= is required for a node plugin".into()),
        };
        if plugin_type != PluginType::Controller && !mount_dir.is_absolute() {
            return Err(format!("mount-dir {} is not absolute", mount_dir.display()));
        }
        let container_mount_dir = container.unwrap_or_else(|| mount_dir.clone());
        Ok(PluginConfig {
            id,
            plugin_type,
            endpoint,
            mount_dir,
            container_mount_dir,
            serialize_per_node,
            selinux_mount,
        })
    }
}

/// A `--plugin` option's `true` or `false`.
fn on_off(option: &str, value: &str) -> Result<bool, String> {
    match value {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(format!("{option} {value:?} is not true or false")),
    }
}

/// Runs the agent until `shutdown`.
pub async fn run(args: Args, shutdown: CancellationToken) -> anyhow::Result<()> {
    let node = NodeName::new(&args.node).context("--node")?;
    let mut configs = Vec::new();
    for p in &args.plugins {
        let cfg: PluginConfig = p
            .parse()
            .map_err(|e: String| anyhow::anyhow!("--plugin {p:?}: {e}"))?;
        if configs.iter().any(|c: &PluginConfig| c.id == cfg.id) {
            anyhow::bail!("--plugin {} is given twice", cfg.id);
        }
        configs.push(cfg);
    }
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("creating {}", args.data_dir.display()))?;
    let local = Arc::new(tokio::sync::Mutex::new(state::LocalState::load(
        &args.data_dir,
    )?));
    let store = args.etcd.connect(Duration::from_secs(30)).await?;
    if let Some(owner) = store.keyring().and_then(|k| k.node()) {
        anyhow::ensure!(
            owner == args.node,
            "the key file is node {owner:?}'s; this agent is node {:?} (make its own with `moord keys node --node {}`)",
            args.node,
            args.node
        );
    }

    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    let policy = Policy {
        per_try_timeout: args.csi_timeout,
        tries: args.csi_tries,
        metrics: CsiMetrics::register(&mut registry),
        ..Policy::default()
    };
    let registry = Arc::new(registry);
    let schedule = moor::runtime::steps::Schedule {
        initial: args.retry_initial,
        cap: args.retry_cap.max(args.retry_initial),
        jitter: true,
    };
    let mut tasks = tokio::task::JoinSet::new();
    if let Some(addr) = args.etcd.http {
        let (registry, shutdown) = (registry.clone(), shutdown.clone());
        tasks.spawn(async move {
            if let Err(e) = crate::common::serve_http(addr, registry, shutdown).await {
                tracing::error!(error = format!("{e:#}"), "http server failed");
            }
        });
    }

    let recorder = args
        .events
        .recorder(store.clone(), &format!("agent/{node}"));
    let monitor = contract::Monitor::new(recorder.clone(), configs.iter().map(|c| &c.id));
    let supervisor = plugins::Supervisor::start(
        store.clone(),
        node.clone(),
        &configs,
        recorder.clone(),
        plugins::Published {
            local: local.clone(),
            monitor: monitor.clone(),
        },
        args.fingerprint_interval,
        args.node_ttl,
        &mut tasks,
        shutdown.clone(),
    );

    // The node pass wakes the endpoint's waits for a publish.
    let wake = moor::workload::Wake::default();
    let mut seen_engines = std::collections::BTreeSet::new();
    for (i, flag) in args.volume_plugin.iter().enumerate() {
        let (engine, path) = volume_plugin::engine_socket(flag)
            .map_err(|e| anyhow::anyhow!("--volume-plugin {flag}: {e}"))?;
        anyhow::ensure!(
            seen_engines.insert(engine.clone()),
            "--volume-plugin: engine {engine} is given two sockets"
        );
        let namespace = Namespace::new(&args.volume_plugin_namespace)
            .map_err(|e| anyhow::anyhow!("--volume-plugin-namespace: {e}"))?;
        let default_plugin = match &args.volume_plugin_default {
            Some(p) => {
                PluginId::new(p).map_err(|e| anyhow::anyhow!("--volume-plugin-default: {e}"))?
            }
            None => configs
                .iter()
                .find(|c| c.is_node())
                .map(|c| c.id.clone())
                .context(
                "--volume-plugin needs a node plugin on this node (--plugin type=node or monolith)",
            )?,
        };
        let cfg = volume_plugin::Config {
            path,
            engine,
            // One watcher of forgotten mounts per agent, whatever the engines.
            watch_orphans: i == 0,
            namespace,
            default_plugin,
            mount_timeout: args.volume_plugin_mount_timeout,
            orphan_interval: args.volume_plugin_orphan_interval,
            orphan_grace: args.volume_plugin_orphan_grace,
            linger: args.volume_plugin_linger,
            idle_timeout: args.volume_plugin_idle_timeout,
            wake: wake.clone(),
            plugins: supervisor.clone(),
        };
        let (store, node, shutdown) = (store.clone(), node.clone(), shutdown.clone());
        let recorder = recorder.clone();
        tasks.spawn(async move {
            if let Err(e) = volume_plugin::serve(cfg, store, node, recorder, shutdown.clone()).await
            {
                tracing::error!(
                    error = format!("{e:#}"),
                    "the volume-plugin endpoint failed"
                );
                shutdown.cancel();
            }
        });
    }

    let node_ctx = node::NodeReconciler {
        store: store.clone(),
        node: node.clone(),
        plugins: configs.iter().filter(|c| c.is_node()).cloned().collect(),
        supervisor: supervisor.clone(),
        local,
        monitor: monitor.clone(),
        locks: KeyedLocks::default(),
        policy: policy.clone(),
        steps: moor::runtime::steps::Steps::new(schedule.clone()),
        recorder: recorder.clone(),
        stats_interval: args.volume_stats_interval,
        declarations: Default::default(),
        wake,
    };
    {
        let (shutdown, metrics) = (shutdown.clone(), metrics.controller("node"));
        tasks.spawn(async move { node_ctx.run(metrics, shutdown).await });
    }

    for cfg in configs.iter().filter(|c| c.is_controller()) {
        let election = LeaderConfig {
            name: format!("plugin.{}", cfg.id),
            identity: format!("agent@{node}"),
            ttl: args.leader_ttl,
        };
        let base = store.clone();
        let cfg = cfg.clone();
        let schedule = schedule.clone();
        let (survey_interval, unpublish_unknown) =
            (args.survey_interval, args.unpublish_unknown_attachments);
        let (policy, recorder, supervisor, metrics, monitor) = (
            policy.clone(),
            recorder.clone(),
            supervisor.clone(),
            metrics.clone(),
            monitor.clone(),
        );
        let shutdown = shutdown.clone();
        tasks.spawn(async move {
            leader::lead(base.clone(), election, shutdown, |fenced, stop, term| {
                let ctx = ControllerPluginCtx {
                    term,
                    reads: base.clone(),
                    writer: moor::runtime::writer::Writer::new(fenced),
                    plugin: cfg.clone(),
                    supervisor: supervisor.clone(),
                    policy: policy.clone(),
                    recorder: recorder.clone(),
                    locks: KeyedLocks::default(),
                    node_calls: KeyedLocks::default(),
                    steps: moor::runtime::steps::Steps::new(schedule.clone()),
                    capacity: Default::default(),
                    surveyed: Arc::new(tokio::sync::watch::channel(0).0),
                    survey_interval,
                    unpublish_unknown,
                    monitor: monitor.clone(),
                    // This plugin's Secrets only (the grant roles.sh gives it).
                    secrets: moor::runtime::informer::Informer::<Secret>::spawn(
                        base.clone(),
                        Secret::scope_for(&cfg.id),
                        stop.clone(),
                    ),
                };
                let metrics = metrics.clone();
                async move { ctx.run(metrics, stop).await }
            })
            .await
        });
    }

    while let Some(r) = tasks.join_next().await {
        if let Err(e) = r {
            tracing::error!(error = %e, "agent task failed");
            shutdown.cancel();
        }
    }
    Ok(())
}

/// What the provisioner and the attacher of one controller plugin share while this
/// agent leads it.
#[derive(Clone)]
pub struct ControllerPluginCtx {
    /// Unfenced store for watches and reads.
    pub reads: moor::store::Store,
    /// Fenced store (every write carries the election's fence); records the volumes,
    /// attachments and snapshots this agent writes.
    pub writer: moor::runtime::writer::Writer,
    /// The plugin.
    pub plugin: PluginConfig,
    /// Its supervisor (channel, fingerprint).
    pub supervisor: plugins::Supervisor,
    /// CSI call policy.
    pub policy: Policy,
    /// Events.
    pub recorder: Recorder,
    /// One in-flight controller call per volume.
    pub locks: KeyedLocks,
    /// One in-flight ControllerPublish/Unpublish per node, by CSI node id, when the
    /// plugin is configured so ([`ControllerPluginCtx::in_node_turn`]).
    pub node_calls: KeyedLocks,
    /// Retry gates of failing controller steps.
    pub steps: moor::runtime::steps::Steps,
    /// GetCapacity's answers from the last survey (none yet: unknown).
    pub capacity: Arc<std::sync::RwLock<Option<Vec<CapacityEntry>>>>,
    /// Ticks after each survey that asked GetCapacity.
    pub surveyed: Arc<tokio::sync::watch::Sender<u64>>,
    /// `--survey-interval`.
    pub survey_interval: Duration,
    /// `--unpublish-unknown-attachments`.
    pub unpublish_unknown: bool,
    /// The live contract monitor.
    pub monitor: contract::Monitor,
    /// This agent's leadership of the plugin by its own clock: every CSI call checks
    /// it right before it is sent (no fence guards a call to the plugin).
    pub term: moor::runtime::term::Term,
    /// The plugin's Secrets, which its volumes and snapshots name per call family:
    /// read when a call is built, so a rotated Secret goes into every later call.
    pub secrets: moor::runtime::informer::Informer<Secret>,
}

/// What a pass of a controller-plugin executor (attacher, provisioner, snapshotter)
/// fails with; the provisioner adds its own cases to it ([`provisioner::ProvisionError`]).
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// A step's gate is closed: not a failure, the key is looked at again when it
    /// opens.
    #[error(transparent)]
    BackingOff(#[from] moor::runtime::steps::BackingOff),
    /// A CSI call failed.
    #[error("CSI call failed")]
    Csi(#[from] moor::csi::policy::CsiError),
    /// Reading or writing etcd failed.
    #[error("store operation failed")]
    Store(#[from] moor::store::StoreError),
    /// The plugin has no channel.
    #[error(transparent)]
    NoChannel(#[from] NoChannel),
    /// The secrets are sealed with a key this agent does not hold.
    #[error(transparent)]
    Sealed(#[from] moor::api::SealedSecrets),
    /// A Secret the call needs is not there.
    #[error(transparent)]
    MissingSecret(#[from] moor::api::MissingSecret),
}

impl moor::runtime::controller::ReconcileError for StepError {
    fn policy(&self) -> moor::runtime::controller::ErrorPolicy {
        match self {
            StepError::Store(e) => e.policy(),
            _ => moor::runtime::controller::ErrorPolicy::Backoff,
        }
    }
}

impl StepError {
    /// The closed gate, for [`moor::runtime::steps::requeue_backing_off`].
    pub fn backing_off(&self) -> Option<moor::runtime::steps::BackingOff> {
        match self {
            StepError::BackingOff(b) => Some(*b),
            _ => None,
        }
    }
}

/// `?` on what a [`StepError`] carries, for an error type `$error` with a
/// `Step(StepError)` case: each `$source` goes into it through the StepError.
macro_rules! through_step_error {
    ($error:ty, $($source:ty),* $(,)?) => {
        $(impl From<$source> for $error {
            fn from(e: $source) -> Self {
                Self::Step(e.into())
            }
        })*
    };
}
pub(crate) use through_step_error;

/// The plugin has no channel (its endpoint could not be used).
#[derive(Debug, thiserror::Error)]
#[error("plugin {0} has no channel")]
pub struct NoChannel(pub PluginId);

impl ControllerPluginCtx {
    /// The typed CSI client of the plugin.
    pub fn csi(&self) -> Result<moor::csi::client::Csi, NoChannel> {
        let ch = self
            .supervisor
            .channel(&self.plugin.id)
            .ok_or_else(|| NoChannel(self.plugin.id.clone()))?;
        Ok(
            moor::csi::client::Csi::new(ch, self.policy.for_plugin(self.plugin.id.as_str()))
                .under(self.term.clone()),
        )
    }

    /// Runs `call` (a ControllerPublish or ControllerUnpublish to `csi_node`) in the
    /// node's turn: with `serialize-per-node`, only once no other such call of this
    /// plugin is in flight to that node, the node held until `call` ends; at once
    /// otherwise. Taken after the volume's lock, never before it, so the two cannot
    /// deadlock. The waiting are counted in `moor_controller_calls_waiting_for_node`.
    pub async fn in_node_turn<T>(
        &self,
        csi_node: &str,
        call: impl std::future::Future<Output = T>,
    ) -> T {
        if !self.plugin.serialize_per_node {
            return call.await;
        }
        let _turn = {
            let _waiting = moor::runtime::metrics::waiting_for_node(self.plugin.id.as_str());
            self.node_calls.lock(csi_node).await
        };
        call.await
    }

    /// Whether the plugin advertises controller capability `rpc` (false until its
    /// capabilities are known).
    pub fn advertises(&self, rpc: moor::api::ControllerRpc) -> bool {
        self.supervisor
            .status(&self.plugin.id)
            .is_some_and(|s| s.capabilities.controller.has(rpc))
    }

    /// Whether the plugin's controller service advertises SINGLE_NODE_MULTI_WRITER:
    /// the access modes its calls carry follow it ([`moor::api::AccessMode::as_sent`]).
    pub fn multi_writer_cap(&self) -> bool {
        self.advertises(moor::api::ControllerRpc::SingleNodeMultiWriter)
    }

    /// Reports `breaches` of the plugin about volume `vol` to the contract monitor.
    pub async fn breached(
        &self,
        vol: &ObjectRef,
        breaches: impl IntoIterator<Item = moor::csi::contract::Breach>,
    ) {
        self.monitor.report(&self.plugin.id, vol, breaches).await;
    }

    /// How long a call that names a Secret waits for this agent's first list of the
    /// plugin's Secrets (a leader just elected), before the Secret counts as missing.
    const SECRETS_LISTED: Duration = Duration::from_secs(5);

    /// The plugin's Secrets through which a call's secrets are looked up, once listed
    /// (or after [`Self::SECRETS_LISTED`]: a missing Secret is then reported).
    pub async fn secret_book(&self) -> impl Fn(&ObjectKey<SecretSpec>) -> Option<Arc<Secret>> {
        let secrets = self.secrets.reader();
        if !secrets.is_ready() {
            let _ = tokio::time::timeout(Self::SECRETS_LISTED, secrets.wait_until_ready()).await;
        }
        move |key| secrets.get(key)
    }

    /// `vol` as `family`'s calls see it: with the Secret it names for them, read now.
    pub async fn for_family<'v>(
        &self,
        vol: &'v Volume,
        family: SecretFamily,
    ) -> Result<std::borrow::Cow<'v, Volume>, moor::api::MissingSecret> {
        if vol.spec.secret_refs.get(family).is_none() {
            return Ok(std::borrow::Cow::Borrowed(vol));
        }
        let resolved = vol.for_family(family, self.secret_book().await);
        self.missing_secret(&crate::common::object_ref(vol), &resolved)
            .await;
        resolved
    }

    /// A volume's call waits for the Secret it names (on the step's backoff, and for
    /// the Secret's event): the volume says why.
    async fn missing_secret<T>(&self, vol: &ObjectRef, resolved: &Result<T, MissingSecret>) {
        if let Err(missing) = resolved {
            self.volume_event(
                vol,
                "Secret missing",
                EventType::Warning,
                missing.to_string(),
            )
            .await;
        }
    }

    /// The keys of the volumes (in `volumes`, this plugin's) that name Secret `s`, for
    /// a watch: a Secret made or changed wakes the calls that wait on it.
    pub fn naming(
        volumes: &moor::runtime::reflector::Store<VolumeView>,
        plugin: &PluginId,
        s: &Secret,
    ) -> Vec<String> {
        if s.spec.plugin_id != *plugin {
            return Vec::new();
        }
        volumes
            .state()
            .iter()
            .filter(|v| {
                v.namespace == s.metadata.namespace
                    && v.attach.secret_refs.names_secret(&s.metadata.name)
            })
            .map(|v| moor::runtime::Resource::key(&**v))
            .collect()
    }

    /// Volume `key` as stored now, when the plugin's volume cache (`views`) holds it:
    /// what acts on a whole volume reads it first (the cache keeps views), unless the
    /// view holds it whole or this agent wrote it last (`Writer::current`). A volume
    /// the cache does not hold, or stored now under another plugin, is absent.
    pub async fn read_volume(
        &self,
        views: &moor::runtime::reflector::Store<VolumeView>,
        key: &ObjectKey<VolumeSpec>,
    ) -> Result<Option<Arc<Volume>>, moor::store::StoreError> {
        let Some(view) = views.get(key) else {
            return Ok(None);
        };
        let stored = self.writer.current(views, key, view.whole.clone()).await?;
        Ok(stored.filter(|v| v.spec.plugin_id == self.plugin.id))
    }

    /// What `family`'s attach calls take from a volume that may be gone (none stays
    /// none): its inputs, with the Secret it names for them, read now.
    pub async fn attach_inputs(
        &self,
        vol: Option<&VolumeView>,
        family: SecretFamily,
    ) -> Result<Option<AttachInputs>, MissingSecret> {
        let Some(v) = vol else {
            return Ok(None);
        };
        if v.attach.secret_refs.get(family).is_none() {
            return Ok(Some(v.attach.clone()));
        }
        let book = self.secret_book().await;
        let resolved = v
            .attach
            .for_family(family, &self.plugin.id, &v.namespace, book)
            .map(std::borrow::Cow::into_owned);
        self.missing_secret(&v.object_ref(), &resolved).await;
        resolved.map(Some)
    }

    /// Records an event about a volume.
    pub async fn volume_event(
        &self,
        vol: &ObjectRef,
        reason: &str,
        type_: EventType,
        message: String,
    ) {
        let d = crate::common::details([("volume_id", vol.name.to_string())]);
        self.recorder
            .record(vol.clone(), type_, reason, message, d)
            .await;
    }

    async fn run(mut self, metrics: Metrics, stop: CancellationToken) {
        use moor::runtime::informer::Informer;
        tracing::info!(plugin = %self.plugin.id, "leading the controller plugin");
        // Only this plugin's volumes (a cluster of several plugins caches each
        // plugin's share in its own agent): the provisioner, snapshotter, survey and
        // attacher treat another plugin's volume exactly as an absent one (they skip
        // it), so a volume edited onto another plugin, which leaves this cache as a
        // deletion, is seen as before. Each as a view (`volume_view`): what acts on a
        // whole volume takes it through `Writer::current`.
        let plugin = self.plugin.id.clone();
        let volumes = Informer::<VolumeView>::spawn_projected(
            self.reads.clone(),
            KeyScope::all(),
            Some(Arc::new(move |v: &Volume| v.spec.plugin_id == plugin)),
            VolumeView::of_provisioned,
            stop.clone(),
        );
        let attachments =
            Informer::<Attachment>::spawn(self.reads.clone(), KeyScope::all(), stop.clone());
        let snapshots =
            Informer::<Snapshot>::spawn(self.reads.clone(), KeyScope::all(), stop.clone());
        let groups = Informer::<VolumeGroupSnapshot>::spawn(
            self.reads.clone(),
            KeyScope::all(),
            stop.clone(),
        );
        self.writer = self
            .writer
            .tracking_as::<VolumeSpec, _>(&volumes.reader())
            .tracking(&attachments.reader())
            .tracking(&snapshots.reader())
            .tracking(&groups.reader());
        let prov = provisioner::Provisioner {
            ctx: self.clone(),
            volumes: volumes.clone(),
            snapshots: snapshots.clone(),
        };
        let group = group_snapshotter::GroupSnapshotter {
            ctx: self.clone(),
            groups,
            snapshots: snapshots.clone(),
            volumes: volumes.clone(),
        };
        let snap = snapshotter::Snapshotter {
            ctx: self.clone(),
            snapshots,
            volumes: volumes.clone(),
        };
        let survey = survey::Survey {
            ctx: self.clone(),
            volumes: volumes.clone(),
            attachments: attachments.clone(),
            every: self.survey_interval,
            unpublish_unknown: self.unpublish_unknown,
        };
        let att = attacher::Attacher {
            ctx: self,
            volumes,
            attachments,
        };
        tokio::join!(
            prov.run(metrics.controller("provisioner"), stop.clone()),
            snap.run(metrics.controller("snapshotter"), stop.clone()),
            group.run(metrics.controller("group-snapshotter"), stop.clone()),
            survey.run(stop.clone()),
            att.run(metrics.controller("attacher"), stop)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plugin_flags_parse_and_explain_mistakes() {
        let p: PluginConfig =
            "id=hostpath.moor.dev,type=monolith,endpoint=unix:///run/p.sock,mount-dir=/var/lib/moor"
                .parse()
                .unwrap();
        assert_eq!(p.container_mount_dir, PathBuf::from("/var/lib/moor"));
        assert!(p.is_node() && p.is_controller());
        let p: PluginConfig =
            "id=x,type=node,endpoint=unix:///s,mount-dir=/h,container-mount-dir=/c"
                .parse()
                .unwrap();
        assert_eq!(p.container_mount_dir, PathBuf::from("/c"));
        let c: PluginConfig = "id=x,type=controller,endpoint=unix:///s".parse().unwrap();
        assert!(!c.is_node());
        assert!(!c.serialize_per_node, "off unless asked");
        let c: PluginConfig = "id=x,type=controller,endpoint=unix:///s,serialize-per-node=true"
            .parse()
            .unwrap();
        assert!(c.serialize_per_node);
        for (bad, says) in [
            ("type=node,endpoint=unix:///s,mount-dir=/h", "id="),
            ("id=x,type=nope,endpoint=unix:///s,mount-dir=/h", "type"),
            ("id=x,type=node,endpoint=tcp://h,mount-dir=/h", "endpoint"),
            ("id=x,type=node,endpoint=unix:///s", "mount-dir"),
            (
                "id=x,type=node,endpoint=unix:///s,mount-dir=rel",
                "absolute",
            ),
            (
                "id=x,type=node,endpoint=unix:///s,mount-dir=/h,colour=red",
                "colour",
            ),
            (
                "id=x,type=controller,endpoint=unix:///s,serialize-per-node=yes",
                "serialize-per-node",
            ),
        ] {
            let e = bad.parse::<PluginConfig>().unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
