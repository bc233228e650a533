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
//! - [`config`]: a `--plugin` option, parsed.
//! - [`context`]: what the executors of a led controller plugin share.
//! - [`step_error`]: what their passes fail with.
//! - [`owners`]: the ownership records of a led plugin's ids (issue 77).
//! - [`reports`]: what a led plugin observes of its attachments and volumes, written
//!   in its reports (issue 77).

pub mod attacher;
pub mod config;
pub mod context;
pub mod contract;
#[cfg(test)]
mod executor_tests;
pub mod group_snapshotter;
pub mod node;
pub mod owners;
pub mod plugins;
pub mod provisioner;
pub mod reports;
pub mod snapshotter;
pub mod state;
pub mod step_error;
pub mod survey;
pub mod volume_plan;
pub mod volume_plugin;
pub mod volume_view;

use anyhow::Context;
use moor::api::*;
use moor::csi::policy::{CsiMetrics, Policy};
use moor::runtime::leader::{self, LeaderConfig};
use moor::runtime::metrics::Metrics;
use prometheus_client::registry::Registry;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

use crate::common::{EtcdArgs, KeyedLocks};
use config::PluginConfig;
use context::ControllerPluginCtx;

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
