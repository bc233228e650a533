//! The in-process rig the executors are tested on: the embedded store, the controller
//! and one agent per node (`n1`, `n2`, ...), each beside its own moor-hostpath (`n1`'s as a
//! monolith, serving the controller service too; the others as node plugins), all as
//! tasks of the test's own runtime, each on a temporary port, socket and directory. No
//! daemon is spawned; what an executor did is read from the store (its effects) and
//! from each plugin's call log (the calls, in order), and faults are set on a plugin's
//! admin socket, as the system tests do with processes. Every part is configured as a
//! typed value ([`RigConfig`] edits moor-hostpath's `Config` and the agent's `Args`),
//! not as argv strings; a node's agent can be stopped on its own ([`Rig::stop_agent`]).
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
}

impl Default for RigConfig {
    fn default() -> Self {
        RigConfig {
            nodes: 1,
            plugin: Box::new(|_, _| {}),
            agent: Box::new(|_, _| {}),
            controller: Box::new(|_| {}),
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
    /// Its plugin's state dir (call log, admin socket).
    plugin_dir: PathBuf,
    /// Stops its agent alone.
    agent: CancellationToken,
}

/// One store, a plugin per node, the controller and an agent per node, stopped when
/// dropped.
pub struct Rig {
    /// A client of the rig's store.
    pub store: Store,
    dir: tempfile::TempDir,
    stop: CancellationToken,
    nodes: Vec<RigNode>,
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
            (cfg.agent)(&name, a);
            let agent_stop = node_stop.child_token();
            tokio::spawn(crate::agent::run(agent.args, agent_stop.clone()));
            nodes.push(RigNode {
                name,
                plugin_dir,
                agent: agent_stop,
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
        }
        rig
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
        self.node(name).agent.cancel();
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
