//! The in-process rig the executors are tested on: the embedded store, the controller
//! and one agent per node (`n1`, `n2`, ...), each beside its own moor-hostpath (`n1`'s as a
//! monolith, serving the controller service too; the others as node plugins), all as
//! tasks of the test's own runtime, each on a temporary port, socket and directory. No
//! daemon is spawned; what an executor did is read from the store (its effects) and
//! from each plugin's call log (the calls, in order), and faults are set on a plugin's
//! admin socket, as the system tests do with processes. Every part is configured as a
//! typed value ([`RigConfig`] edits moor-hostpath's `Config` and the agent's `Args`),
//! not as argv strings; a node's agent can be stopped or restarted on its own
//! ([`Rig::stop_agent`], [`Rig::restart_agent`]), and an operator's force-detach is the
//! store's own transaction ([`Rig::force_detach`], as `moorctl volume detach`).
//!
//! The plugin never mounts (`no_mount`): its state and its rules are the same, and the
//! tests check calls and order, which the system tests also check for real mounts.
//!
//! # Layout
//! - `mod.rs`: the configuration, starting the parts, each node's agent stopped or
//!   restarted, the operator's force-detach.
//! - `act`: what a test does and reads: volumes, allocations, claims, mounts, faults,
//!   call logs, the engine endpoint.

use std::path::PathBuf;
use std::time::Duration;

use moor::api::*;
use moor::store::Store;
use tokio_util::sync::CancellationToken;

mod act;

/// The plugin id the rig's volumes use.
pub const PLUGIN: &str = "hostpath.moor.dev";
/// The rig's first node (the plugin's controller service runs there).
pub const NODE: &str = "n1";

/// Edits a part's configuration on a node (its name given).
pub type Edit<T> = Box<dyn Fn(&str, &mut T)>;

/// How the rig runs: how many nodes, and each part's configuration as the rig made it,
/// edited by the test.
pub struct RigConfig {
    /// Nodes `n1`..`nN` (at least one).
    pub nodes: usize,
    /// Edits moor-hostpath's configuration on every node.
    pub plugin: Edit<moor_hostpath::Config>,
    /// Edits every agent's arguments.
    pub agent: Edit<crate::agent::Args>,
    /// Edits the controller's arguments.
    pub controller: Box<dyn Fn(&mut crate::controller::Args)>,
    /// Every agent serves Docker's volume-plugin protocol (engine `docker`) on a
    /// socket of its node ([`Rig::engine`] calls it).
    pub engine: bool,
}

impl Default for RigConfig {
    fn default() -> Self {
        RigConfig {
            nodes: 1,
            plugin: Box::new(|_, _| {}),
            agent: Box::new(|_, _| {}),
            controller: Box::new(|_| {}),
            engine: false,
        }
    }
}

impl RigConfig {
    /// One node whose plugin `edit` configures.
    pub fn plugin(edit: impl Fn(&mut moor_hostpath::Config) + 'static) -> RigConfig {
        RigConfig {
            plugin: Box::new(move |_, c| edit(c)),
            ..Default::default()
        }
    }
}

/// One node of the rig.
struct RigNode {
    name: String,
    /// Its directory (agent data, sockets).
    dir: PathBuf,
    /// Its plugin's state dir (call log, admin socket).
    plugin_dir: PathBuf,
    /// The node's own stop (its plugin's; its agent's parent).
    stop: CancellationToken,
    /// Its agent as it runs now: its arguments, its stop, its task.
    agent: std::sync::Mutex<RigAgent>,
}

/// A node's agent task.
struct RigAgent {
    args: crate::agent::Args,
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl RigAgent {
    fn start(args: crate::agent::Args, parent: &CancellationToken) -> RigAgent {
        let stop = parent.child_token();
        let task = tokio::spawn(crate::agent::run(args.clone(), stop.clone()));
        RigAgent {
            args,
            stop,
            task: Some(task),
        }
    }
}

/// One store, a plugin per node, the controller and an agent per node, stopped when
/// dropped.
pub struct Rig {
    /// A client of the rig's store.
    pub store: Store,
    dir: tempfile::TempDir,
    stop: CancellationToken,
    nodes: Vec<RigNode>,
    /// The agents serve the engine endpoint.
    engine: bool,
}

/// A clap configuration with only its required values given: every other field is
/// its declared default, which the rig then sets as typed fields.
fn defaults<T: clap::Parser>(required: &[(&str, String)]) -> T {
    let mut argv = vec!["rig".to_string()];
    for (flag, value) in required {
        argv.push(format!("--{flag}"));
        argv.push(value.clone());
    }
    T::try_parse_from(argv).expect("the required values")
}

#[derive(clap::Parser)]
struct ControllerArgv {
    #[command(flatten)]
    args: crate::controller::Args,
}

#[derive(clap::Parser)]
struct AgentArgv {
    #[command(flatten)]
    args: crate::agent::Args,
}

impl Rig {
    /// Starts the rig with one node and the defaults; returns once the node's plugin is
    /// healthy.
    pub async fn start() -> Rig {
        Rig::start_with(RigConfig::default()).await
    }

    /// Starts the rig as `cfg` says; returns once every node's plugin is healthy.
    pub async fn start_with(cfg: RigConfig) -> Rig {
        let dir = tempfile::tempdir().expect("temp dir");
        let stop = CancellationToken::new();
        let store = moor_embedded::EmbeddedStore::open(&dir.path().join("store"), 100_000)
            .expect("open the embedded store");
        let listener = moor_embedded::bind("127.0.0.1:0", false, false)
            .await
            .expect("bind the store");
        let url = format!("http://{}", listener.local_addr().expect("store address"));
        tokio::spawn(moor_embedded::serve(store, listener, None, stop.clone()));

        let mut controller: ControllerArgv = defaults(&[("etcd", url.clone())]);
        controller.args.identity = Some("rig".into());
        controller.args.leader_ttl = Duration::from_secs(3);
        (cfg.controller)(&mut controller.args);
        tokio::spawn(crate::controller::run(controller.args, stop.clone()));

        let nodes = (1..=cfg.nodes.max(1))
            .map(|i| start_node(i, dir.path(), &url, &cfg, &stop))
            .collect();

        let client = Store::connect(&[url], moor::store::DEFAULT_PREFIX)
            .await
            .expect("connect to the rig's store");
        let rig = Rig {
            store: client,
            dir,
            stop,
            nodes,
            engine: cfg.engine,
        };
        for n in &rig.nodes {
            let key = Node::key_for(&NodeName::new(&n.name).expect("node name"));
            rig.wait(&format!("{}'s plugin to be healthy", n.name), || async {
                rig.store
                    .try_get(&key)
                    .await
                    .ok()
                    .flatten()
                    .is_some_and(|n| n.status.plugins.values().any(|p| p.healthy))
            })
            .await;
            rig.wait_engine(&n.name).await;
        }
        rig
    }

    /// With the engine endpoint, waits until node `name`'s agent accepts on it.
    async fn wait_engine(&self, name: &str) {
        if !self.engine {
            return;
        }
        let sock = self.node(name).dir.join("engine.sock");
        self.wait(&format!("{name}'s engine endpoint"), || async {
            tokio::net::UnixStream::connect(&sock).await.is_ok()
        })
        .await;
    }

    fn node(&self, name: &str) -> &RigNode {
        self.nodes
            .iter()
            .find(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node {name} in the rig"))
    }

    /// Stops node `name`'s agent (its plugin goes on serving): the node is gone to the
    /// control plane once its registration's lease expires.
    pub fn stop_agent(&self, name: &str) {
        self.node(name)
            .agent
            .lock()
            .expect("the agent")
            .stop
            .cancel();
    }

    /// Stops node `name`'s agent, waits for it to end, and starts it again with the
    /// same arguments (its journal, its data dir): a restart of the agent alone.
    pub async fn restart_agent(&self, name: &str) {
        let node = self.node(name);
        let (task, args) = {
            let mut agent = node.agent.lock().expect("the agent");
            agent.stop.cancel();
            (agent.task.take(), agent.args.clone())
        };
        if let Some(task) = task {
            let ended = tokio::time::timeout(Duration::from_secs(30), task).await;
            ended
                .expect("the agent to stop")
                .expect("the agent's task")
                .expect("the agent's run");
        }
        *node.agent.lock().expect("the agent") = RigAgent::start(args, &node.stop);
        self.wait_engine(name).await;
    }

    /// Declares node `node` gone for volume `volume` as `moorctl volume detach` does
    /// (the volume's force-detach entry and the node's declarations, one transaction).
    pub async fn force_detach(&self, volume: &str, node: &str) {
        let key = Volume::key_for(&Namespace::default_ns(), Name::new(volume).expect("name"));
        let node = NodeName::new(node).expect("node name");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            match self.store.declare_node_gone(&key, &node, false).await {
                Ok(_) => return,
                Err(moor::store::StoreError::Conflict { .. })
                    if tokio::time::Instant::now() < deadline => {}
                Err(e) => panic!("declare {node} gone for {volume}: {e}"),
            }
        }
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Starts node `n{i}` below `root` (`n1` in `root` itself): its moor-hostpath (`n1`'s a
/// monolith, the others node plugins sharing one node registry) and its agent, as
/// `cfg` edits them, on the store at `url`.
fn start_node(
    i: usize,
    root: &std::path::Path,
    url: &str,
    cfg: &RigConfig,
    stop: &CancellationToken,
) -> RigNode {
    let name = format!("n{i}");
    let node_dir = match i {
        1 => root.to_path_buf(),
        _ => root.join(&name),
    };
    let sock = node_dir.join("csi.sock");
    let plugin_dir = node_dir.join("plugin");
    let mut plugin: moor_hostpath::Config = defaults(&[
        ("endpoint", format!("unix://{}", sock.display())),
        ("node-id", format!("csi-{name}")),
        ("state-dir", plugin_dir.display().to_string()),
    ]);
    plugin.mode = match i {
        1 => moor_hostpath::Mode::Monolith,
        _ => moor_hostpath::Mode::Node,
    };
    plugin.no_mount = true;
    // The nodes the controller instance may publish to: every node's.
    plugin.node_registry = Some(root.join("hostpath-nodes"));
    (cfg.plugin)(&name, &mut plugin);
    let node_stop = stop.child_token();
    tokio::spawn(moor_hostpath::run(plugin, node_stop.clone()));

    let kind = if i == 1 { "monolith" } else { "node" };
    let mount_dir = node_dir.join("mnt");
    let mut agent: AgentArgv = defaults(&[
        ("node", name.clone()),
        ("etcd", url.to_string()),
        ("data-dir", node_dir.join("agent").display().to_string()),
        (
            "plugin",
            format!(
                "id={PLUGIN},type={kind},endpoint=unix://{},mount-dir={}",
                sock.display(),
                mount_dir.display()
            ),
        ),
    ]);
    let a = &mut agent.args;
    a.fingerprint_interval = Duration::from_secs(1);
    a.node_ttl = Duration::from_secs(3);
    a.leader_ttl = Duration::from_secs(3);
    a.csi_timeout = Duration::from_secs(5);
    a.csi_tries = 2;
    a.retry_initial = Duration::from_millis(200);
    a.retry_cap = Duration::from_secs(2);
    a.events.event_window = Duration::from_secs(1);
    if cfg.engine {
        let sock = node_dir.join("engine.sock");
        a.volume_plugin = vec![format!("docker={}", sock.display())];
    }
    (cfg.agent)(&name, a);
    let agent = RigAgent::start(agent.args, &node_stop);
    RigNode {
        name,
        dir: node_dir,
        plugin_dir,
        stop: node_stop,
        agent: std::sync::Mutex::new(agent),
    }
}
