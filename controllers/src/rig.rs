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

use std::path::PathBuf;
use std::time::Duration;

use moor::api::*;
use moor::store::Store;
use moor_hostpath::calllog::{Call, CallLog};
use moor_hostpath::faults::Command;
use tokio_util::sync::CancellationToken;

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

        let mut nodes = Vec::new();
        for i in 1..=cfg.nodes.max(1) {
            let name = format!("n{i}");
            let node_dir = match i {
                1 => dir.path().to_path_buf(),
                _ => dir.path().join(&name),
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
            plugin.node_registry = Some(dir.path().join("hostpath-nodes"));
            (cfg.plugin)(&name, &mut plugin);
            let node_stop = stop.child_token();
            tokio::spawn(moor_hostpath::run(plugin, node_stop.clone()));

            let kind = if i == 1 { "monolith" } else { "node" };
            let mount_dir = node_dir.join("mnt");
            let mut agent: AgentArgv = defaults(&[
                ("node", name.clone()),
                ("etcd", url.clone()),
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
            nodes.push(RigNode {
                name,
                dir: node_dir,
                plugin_dir,
                stop: node_stop,
                agent: std::sync::Mutex::new(agent),
            });
        }

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

    /// Calls `VolumeDriver.VERB` on node `node`'s engine endpoint ([`RigConfig::engine`])
    /// as Docker does (a POST of JSON over its unix socket); the status and the JSON
    /// answer.
    pub async fn engine(
        &self,
        node: &str,
        verb: &str,
        body: serde_json::Value,
    ) -> (u16, serde_json::Value) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let sock = self.node(node).dir.join("engine.sock");
        let mut s = tokio::net::UnixStream::connect(&sock)
            .await
            .unwrap_or_else(|e| panic!("connect to {}: {e}", sock.display()));
        let body = body.to_string();
        let req = format!(
            "POST /VolumeDriver.{verb} HTTP/1.1\r\nHost: plugin\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).await.expect("send the request");
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.expect("read the answer");
        let text = String::from_utf8_lossy(&out);
        let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok());
        let status = status.unwrap_or_else(|| panic!("no status in {text:?}"));
        let rest = if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(rest)
        } else {
            rest.to_string()
        };
        let value = serde_json::from_str(&rest)
            .unwrap_or_else(|e| panic!("{verb}: not JSON ({e}): {rest:?}"));
        (status, value)
    }

    /// A CSI client of the rig's plugin, for what a test does behind moor's back.
    pub fn csi(&self) -> moor::csi::client::Csi {
        let sock = self.dir.path().join("csi.sock");
        let channel = moor::csi::channel(&format!("unix://{}", sock.display())).expect("a channel");
        let policy = moor::csi::policy::Policy {
            tries: 1,
            per_try_timeout: Duration::from_secs(3),
            ..Default::default()
        };
        moor::csi::client::Csi::new(channel, policy)
    }

    /// Volume `name` as stored now.
    pub async fn get_volume(&self, name: &str) -> Option<Volume> {
        let key = Volume::key_for(&Namespace::default_ns(), name);
        self.store.try_get(&key).await.ok().flatten()
    }

    /// Sets a fault on `n1`'s plugin (the controller service's).
    pub async fn fault(&self, cmd: Command) {
        self.fault_on(NODE, cmd).await
    }

    /// Sets a fault on node `name`'s plugin.
    pub async fn fault_on(&self, name: &str, cmd: Command) {
        let admin = self.node(name).plugin_dir.join("admin.sock");
        moor_hostpath::faults::send(&admin, &cmd)
            .await
            .expect("fault command");
    }

    /// Fails the next `times` calls of `rpc` with `code`.
    pub async fn fail(&self, rpc: &str, code: &str, times: u32) {
        self.fault(Command::Fail {
            rpc: rpc.into(),
            code: code.into(),
            times,
        })
        .await;
    }

    /// Every call `n1`'s plugin saw, in the order they ended.
    pub fn calls(&self) -> Vec<Call> {
        self.calls_on(NODE)
    }

    /// Every call node `name`'s plugin saw, in the order they ended.
    pub fn calls_on(&self, name: &str) -> Vec<Call> {
        CallLog::read(&self.node(name).plugin_dir.join("calls.jsonl")).unwrap_or_default()
    }

    /// The calls of the volume lifecycle `n1`'s plugin saw (not the identity,
    /// capability and survey calls), as `RPC` or `RPC:Code` when not OK, in order.
    pub fn steps(&self) -> Vec<String> {
        self.steps_on(NODE)
    }

    /// [`Rig::steps`] of node `name`'s plugin.
    pub fn steps_on(&self, name: &str) -> Vec<String> {
        const LIFECYCLE: [&str; 12] = [
            "ControllerExpandVolume",
            "CreateSnapshot",
            "DeleteSnapshot",
            "CreateVolume",
            "DeleteVolume",
            "ControllerPublishVolume",
            "ControllerUnpublishVolume",
            "NodeStageVolume",
            "NodeUnstageVolume",
            "NodePublishVolume",
            "NodeUnpublishVolume",
            "NodeExpandVolume",
        ];
        self.calls_on(name)
            .into_iter()
            .filter(|c| LIFECYCLE.contains(&c.rpc.as_str()))
            .map(|c| {
                if c.ok() {
                    c.rpc
                } else {
                    format!("{}:{}", c.rpc, c.code)
                }
            })
            .collect()
    }

    /// Waits up to 30 s for `cond`; on timeout fails with `what` and the calls so far.
    pub async fn wait<F, Fut>(&self, what: &str, mut cond: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !cond().await {
            if tokio::time::Instant::now() > deadline {
                let calls: Vec<(&str, Vec<String>)> = self
                    .nodes
                    .iter()
                    .map(|n| (n.name.as_str(), self.steps_on(&n.name)))
                    .collect();
                panic!("timed out waiting for {what}; calls: {calls:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Creates a volume the provisioner makes, in `mode`, and waits until it is.
    pub async fn volume(&self, name: &str, mode: AccessMode) {
        let v = Volume::new(
            &Namespace::default_ns(),
            Name::new(name).expect("volume name"),
            VolumeSpec {
                plugin_id: PluginId::new(PLUGIN).expect("plugin id"),
                capacity_min: Some(Size(1 << 20)),
                capabilities: vec![VolumeCapability {
                    access_mode: mode,
                    attachment_mode: AttachmentMode::FileSystem,
                }],
                ..Default::default()
            },
        );
        self.store.create(&v).await.expect("create the volume");
        let key = Volume::key_for(&Namespace::default_ns(), name);
        self.wait(&format!("volume {name} to be created"), || async {
            self.store
                .try_get(&key)
                .await
                .ok()
                .flatten()
                .is_some_and(|v| v.status.provisioning.external_id.is_some())
        })
        .await;
    }

    /// Runs allocation `name` on `n1` with `volume` (as `data`).
    pub async fn run(&self, name: &str, volume: &str) {
        self.run_on(name, NODE, volume).await
    }

    /// Runs allocation `name` on node `node` with `volume` (as `data`).
    pub async fn run_on(&self, name: &str, node: &str, volume: &str) {
        let volume = VolumeId::new(volume).expect("volume id");
        self.run_request(name, node, |r| r.volume = volume).await;
    }

    /// Runs allocation `name` on the rig's node with a volume made from a template of
    /// the rig's plugin (ephemeral, 1 MiB at least), as its `data` request.
    pub async fn run_templated(&self, name: &str) {
        self.run_request(name, NODE, |r| {
            r.template = Some(Box::new(VolumeTemplate {
                plugin_id: PluginId::new(PLUGIN).expect("plugin id"),
                capacity_min: Some(Size(1 << 20)),
                ..Default::default()
            }))
        })
        .await;
    }

    /// Runs allocation `name` on the rig's node with one request, `data`, as `fill`
    /// makes it.
    async fn run_request(&self, name: &str, node: &str, fill: impl FnOnce(&mut VolumeRequest)) {
        let mut request = VolumeRequest {
            name: Name::new("data").expect("request name"),
            ..Default::default()
        };
        fill(&mut request);
        let a = Allocation::new(
            &Namespace::default_ns(),
            Name::new(name).expect("allocation name"),
            AllocationSpec {
                node: NodeName::new(node).expect("node name"),
                volumes: vec![request],
                ..Default::default()
            },
        );
        moor::workload::create_or_adopt(&self.store, &a, moor::workload::IfEnded::Refuse, false)
            .await
            .expect("create the allocation");
    }

    /// Edits volume `name`'s spec (read, changed, written back guarded, again on a
    /// conflict).
    pub async fn edit_volume(&self, name: &str, mut edit: impl FnMut(&mut VolumeSpec)) {
        let key = Volume::key_for(&Namespace::default_ns(), name);
        self.store
            .modify_spec(&key, |spec| {
                edit(spec);
                true
            })
            .await
            .expect("edit the volume");
    }

    /// Stops allocation `name` (its desired status).
    pub async fn stop(&self, name: &str) {
        let key = Allocation::key_for(&Namespace::default_ns(), name);
        moor::workload::end(&self.store, &key, moor::workload::End::Stop)
            .await
            .expect("stop the allocation");
    }

    /// Allocation `alloc`'s claim of its `data` volume, on `n1`.
    pub async fn claim(&self, alloc: &str) -> Option<Claim> {
        self.claim_on(NODE, alloc).await
    }

    /// Allocation `alloc`'s claim of its `data` volume, on node `node`.
    pub async fn claim_on(&self, node: &str, alloc: &str) -> Option<Claim> {
        let key = claim_key(node, alloc);
        self.store.try_get(&key).await.ok().flatten()
    }

    /// The Mount of allocation `alloc`'s claim on `n1`, as the agent wrote it.
    pub async fn mount(&self, alloc: &str) -> Option<Mount> {
        self.mount_on(NODE, alloc).await
    }

    /// The Mount of allocation `alloc`'s claim on node `node`.
    pub async fn mount_on(&self, node: &str, alloc: &str) -> Option<Mount> {
        let claim = claim_key(node, alloc);
        self.store
            .try_get(&Mount::key_for(&claim))
            .await
            .ok()
            .flatten()
    }

    /// Waits until allocation `alloc`'s claim on `n1` is in `phase`.
    pub async fn wait_claim(&self, alloc: &str, phase: ClaimPhase) {
        self.wait_claim_on(NODE, alloc, phase).await
    }

    /// Waits until allocation `alloc`'s claim on node `node` is in `phase`.
    pub async fn wait_claim_on(&self, node: &str, alloc: &str, phase: ClaimPhase) {
        self.wait(
            &format!("claim {alloc}.data on {node} to be {phase:?}"),
            || async {
                self.claim_on(node, alloc)
                    .await
                    .is_some_and(|c| c.status.phase == phase)
            },
        )
        .await;
    }
}

/// The key of allocation `alloc`'s claim of its `data` volume on `node`.
fn claim_key(node: &str, alloc: &str) -> ObjectKey<ClaimSpec> {
    Claim::key_for(
        &NodeName::new(node).expect("node name"),
        &Namespace::default_ns(),
        format!("{alloc}.data"),
    )
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A chunked HTTP body, joined.
fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    out
}
