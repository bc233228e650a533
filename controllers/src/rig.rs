//! The in-process rig the executors are tested on: the embedded store, moor-hostpath,
//! the controller and one agent (node `n1`, the plugin as a monolith) as tasks of the
//! test's own runtime, each on a temporary port, socket and directory. No daemon is
//! spawned; what an executor did is read from the store (its effects) and from the
//! plugin's call log (the calls, in order), and faults are set on the plugin's admin
//! socket, as the system tests do with processes.
//!
//! The plugin never mounts (`--no-mount`): its state and its rules are the same, and the
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
/// The rig's node.
pub const NODE: &str = "n1";

/// One store, one plugin, the controller and one agent, stopped when dropped.
pub struct Rig {
    /// A client of the rig's store.
    pub store: Store,
    dir: tempfile::TempDir,
    stop: CancellationToken,
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
    /// Starts the rig with these extra moor-hostpath flags; returns once the node's
    /// plugin is healthy.
    pub async fn start(plugin_flags: &[&str]) -> Rig {
        Rig::start_with(plugin_flags, &[]).await
    }

    /// [`Rig::start`] with extra agent flags too.
    pub async fn start_with(plugin_flags: &[&str], agent_flags: &[&str]) -> Rig {
        use clap::Parser;
        let dir = tempfile::tempdir().expect("temp dir");
        let stop = CancellationToken::new();
        let store = moor_embedded::EmbeddedStore::open(&dir.path().join("store"), 100_000)
            .expect("open the embedded store");
        let listener = moor_embedded::bind("127.0.0.1:0", false, false)
            .await
            .expect("bind the store");
        let url = format!("http://{}", listener.local_addr().expect("store address"));
        tokio::spawn(moor_embedded::serve(store, listener, None, stop.clone()));

        let sock = dir.path().join("csi.sock");
        let state = dir.path().join("plugin");
        let mut pflags = vec![
            "moor-hostpath".to_string(),
            format!("--endpoint=unix://{}", sock.display()),
            format!("--node-id=csi-{NODE}"),
            format!("--state-dir={}", state.display()),
            "--mode=monolith".into(),
            "--no-mount".into(),
        ];
        pflags.extend(plugin_flags.iter().map(|f| f.to_string()));
        let pcfg = moor_hostpath::Config::try_parse_from(pflags).expect("plugin flags");
        tokio::spawn(moor_hostpath::run(pcfg, stop.clone()));

        let controller = ControllerArgv::try_parse_from([
            "controller",
            &format!("--etcd={url}"),
            "--identity=rig",
            "--leader-ttl=3s",
        ])
        .expect("controller flags")
        .args;
        let mount_dir = dir.path().join("mnt");
        let mut agent_argv = vec![
            "agent".to_string(),
            format!("--node={NODE}"),
            format!("--etcd={url}"),
            format!("--data-dir={}", dir.path().join("agent").display()),
            format!(
                "--plugin=id={PLUGIN},type=monolith,endpoint=unix://{},mount-dir={}",
                sock.display(),
                mount_dir.display()
            ),
            "--fingerprint-interval=1s".into(),
            "--node-ttl=3s".into(),
            "--leader-ttl=3s".into(),
            "--csi-timeout=5s".into(),
            "--csi-tries=2".into(),
            "--retry-initial=200ms".into(),
            "--retry-cap=2s".into(),
            "--event-window=1s".into(),
        ];
        agent_argv.extend(agent_flags.iter().map(|f| f.to_string()));
        let agent = AgentArgv::try_parse_from(agent_argv)
            .expect("agent flags")
            .args;
        tokio::spawn(crate::controller::run(controller, stop.clone()));
        tokio::spawn(crate::agent::run(agent, stop.clone()));

        let client = Store::connect(&[url], moor::store::DEFAULT_PREFIX)
            .await
            .expect("connect to the rig's store");
        let rig = Rig {
            store: client,
            dir,
            stop,
        };
        let key = Node::key_for(&NodeName::new(NODE).expect("node name"));
        rig.wait("the node's plugin to be healthy", || async {
            rig.store
                .try_get(&key)
                .await
                .ok()
                .flatten()
                .is_some_and(|n| n.status.plugins.values().any(|p| p.healthy))
        })
        .await;
        rig
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

    /// The plugin's admin socket.
    fn admin(&self) -> PathBuf {
        self.dir.path().join("plugin").join("admin.sock")
    }

    /// Sets a fault on the plugin.
    pub async fn fault(&self, cmd: Command) {
        moor_hostpath::faults::send(&self.admin(), &cmd)
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

    /// Every call the plugin saw, in the order they ended.
    pub fn calls(&self) -> Vec<Call> {
        CallLog::read(&self.dir.path().join("plugin").join("calls.jsonl")).unwrap_or_default()
    }

    /// The calls of the volume lifecycle (not the identity, capability and survey
    /// calls), as `RPC` or `RPC:Code` when not OK, in order.
    pub fn steps(&self) -> Vec<String> {
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
        self.calls()
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
                panic!("timed out waiting for {what}; calls: {:?}", self.steps());
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

    /// Runs allocation `name` on the rig's node with `volume` (as `data`).
    pub async fn run(&self, name: &str, volume: &str) {
        let volume = VolumeId::new(volume).expect("volume id");
        self.run_request(name, |r| r.volume = volume).await;
    }

    /// Runs allocation `name` on the rig's node with a volume made from a template of
    /// the rig's plugin (ephemeral, 1 MiB at least), as its `data` request.
    pub async fn run_templated(&self, name: &str) {
        self.run_request(name, |r| {
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
    async fn run_request(&self, name: &str, fill: impl FnOnce(&mut VolumeRequest)) {
        let mut request = VolumeRequest {
            name: Name::new("data").expect("request name"),
            ..Default::default()
        };
        fill(&mut request);
        let a = Allocation::new(
            &Namespace::default_ns(),
            Name::new(name).expect("allocation name"),
            AllocationSpec {
                node: NodeName::new(NODE).expect("node name"),
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

    /// Allocation `alloc`'s claim of its `data` volume.
    pub async fn claim(&self, alloc: &str) -> Option<Claim> {
        let key = Claim::key_for(
            &NodeName::new(NODE).expect("node name"),
            &Namespace::default_ns(),
            format!("{alloc}.data"),
        );
        self.store.try_get(&key).await.ok().flatten()
    }

    /// The Mount of allocation `alloc`'s claim, as the agent wrote it.
    pub async fn mount(&self, alloc: &str) -> Option<Mount> {
        let claim = Claim::key_for(
            &NodeName::new(NODE).expect("node name"),
            &Namespace::default_ns(),
            format!("{alloc}.data"),
        );
        self.store
            .try_get(&Mount::key_for(&claim))
            .await
            .ok()
            .flatten()
    }

    /// Waits until allocation `alloc`'s claim is in `phase`.
    pub async fn wait_claim(&self, alloc: &str, phase: ClaimPhase) {
        self.wait(&format!("claim {alloc}.data to be {phase:?}"), || async {
            self.claim(alloc)
                .await
                .is_some_and(|c| c.status.phase == phase)
        })
        .await;
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
