//! A whole moor cluster of real processes for lifecycle tests: one etcd, `moord
//! controller` replicas, and nodes, each a `moord agent` with its own moor-hostpath
//! plugin, data dir and mount dir. Node `n1` runs the plugin as a monolith (it hosts
//! the controller service, so its agent runs the provisioner and attacher); other
//! nodes run it in node mode and find the data through the volume context.

#![allow(dead_code)]

use moor::api::*;
use moor::store::Store;
use moor_hostpath::calllog::{Call, CallLog};
use moor_hostpath::checker::{self, CheckConfig};
use moor_hostpath::faults::{self, Command};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::Duration;

pub use crate::common::bin;
use crate::common::proxy::Proxy;
use crate::common::{wait_for, Etcd};

/// A child process that can be killed with SIGKILL and started again.
pub struct Proc {
    pub name: String,
    program: PathBuf,
    args: Vec<String>,
    log: PathBuf,
    child: Option<Child>,
}

impl Proc {
    pub fn start(name: &str, program: PathBuf, args: Vec<String>, log: PathBuf) -> Proc {
        let mut p = Proc {
            name: name.to_string(),
            program,
            args,
            log,
            child: None,
        };
        p.spawn();
        p
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("open log");
        let child = std::process::Command::new(&self.program)
            .args(&self.args)
            .env("RUST_LOG", "info,moor=debug,moord=debug")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", self.name));
        self.child = Some(child);
    }

    /// SIGKILL, as a crash.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait (a graceful stop).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = std::process::Command::new("kill")
                .arg(c.id().to_string())
                .status();
            let _ = c.wait();
        }
    }

    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Stops the process gracefully (SIGTERM) and starts `program` in its place with
    /// the same arguments: an upgrade (or downgrade) of this one process.
    pub fn replace(&mut self, program: PathBuf) {
        self.stop();
        self.program = program;
        self.spawn();
    }

    /// Stops the process gracefully (SIGTERM) and starts it again under `wrapper`
    /// (`wrapper[0]` runs with the rest of `wrapper`, then the program and its
    /// arguments): `systemd-socket-activate -l PATH`, as a socket unit starts it.
    pub fn wrap(&mut self, wrapper: &[&str]) {
        self.stop();
        let mut args: Vec<String> = wrapper[1..].iter().map(|s| s.to_string()).collect();
        args.push(self.program.to_string_lossy().into_owned());
        args.append(&mut self.args);
        self.program = PathBuf::from(wrapper[0]);
        self.args = args;
        self.spawn();
    }

    /// SIGSTOP (`true`) or SIGCONT: a process alive but frozen, as under a long GC
    /// pause, a VM migration or a stalled host. A paused process can still be killed.
    pub fn pause(&mut self, paused: bool) {
        if let Some(c) = &self.child {
            let signal = if paused { "-STOP" } else { "-CONT" };
            let _ = std::process::Command::new("kill")
                .args([signal, &c.id().to_string()])
                .status();
        }
    }

    /// The running child's pid.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// How a node's plugin is set up.
#[derive(Clone, Debug)]
pub struct PluginOpts {
    pub publish_unpublish: bool,
    pub stage_unstage: bool,
    /// More flags of the plugins.
    pub extra: Vec<String>,
    /// More flags of one node's plugin: (node name, flags).
    pub node_extra: Vec<(String, Vec<String>)>,
    /// More flags of the agents.
    pub agent_args: Vec<String>,
    /// More options of the agents' `--plugin` (`serialize-per-node=true`).
    pub plugin_options: Vec<String>,
    /// More options of one node's agent's `--plugin`: (node name, options).
    pub node_plugin_options: Vec<(String, Vec<String>)>,
    /// More flags of the controllers.
    pub controller_args: Vec<String>,
    /// A command the agents run under (`unshare --pid ...`): the agent's program and
    /// flags follow it.
    pub agent_wrapper: Vec<String>,
    /// Each controller and agent reaches etcd through a [`Proxy`] of its own (see
    /// [`Cluster::proxy`]), which a test can cut: a partition.
    pub proxied: bool,
    /// Each agent's data dir (its journal) on a tmpfs of this many MiB, which a test
    /// can fill ([`Cluster::fill_disk`]); root only (without root it is a plain dir).
    pub small_disk_mib: Option<u32>,
    /// The `moord` the controllers and agents start with (another build's, for an
    /// upgrade); this build's when `None`.
    pub moord: Option<PathBuf>,
}

impl PluginOpts {
    /// Two topology segments: n1 in zone=a and n2 in zone=b, the controller instance
    /// (on n1) serving both, zone=a with 64 MiB and zone=b with 8 MiB; the survey
    /// every second.
    pub fn zoned() -> PluginOpts {
        PluginOpts {
            node_extra: vec![
                (
                    "n1".into(),
                    vec![
                        "--topology=zone=a".into(),
                        "--segment=zone=a:64MiB".into(),
                        "--segment=zone=b:8MiB".into(),
                    ],
                ),
                ("n2".into(), vec!["--topology=zone=b".into()]),
            ],
            agent_args: vec!["--survey-interval=1s".into()],
            ..Default::default()
        }
    }
}

impl Default for PluginOpts {
    fn default() -> Self {
        PluginOpts {
            publish_unpublish: true,
            stage_unstage: true,
            extra: Vec::new(),
            node_extra: Vec::new(),
            agent_args: Vec::new(),
            plugin_options: Vec::new(),
            node_plugin_options: Vec::new(),
            controller_args: Vec::new(),
            agent_wrapper: Vec::new(),
            proxied: false,
            small_disk_mib: None,
            moord: None,
        }
    }
}

/// One node: its plugin and its agent.
pub struct TestNode {
    pub name: String,
    pub dir: PathBuf,
    pub plugin: Proc,
    pub agent: Proc,
    pub admin: PathBuf,
    pub calls: PathBuf,
    pub mount_dir: PathBuf,
    /// The agent's /metrics and /healthz address.
    pub http: String,
}

impl TestNode {
    /// GETs a path from the agent's HTTP server; returns the body.
    pub async fn http_get(&self, path: &str) -> String {
        crate::common::http_get(&self.http, path).await
    }

    pub async fn fault(&self, cmd: Command) {
        faults::send(&self.admin, &cmd)
            .await
            .unwrap_or_else(|e| panic!("fault {cmd:?} on {}: {e}", self.name));
    }

    pub fn calls(&self) -> Vec<Call> {
        CallLog::read(&self.calls).unwrap_or_default()
    }

    /// Calls of `rpc`, whatever they answered.
    pub fn tried(&self, rpc: &str) -> usize {
        self.calls().iter().filter(|c| c.rpc == rpc).count()
    }

    /// Calls of `rpc` with `code`.
    pub fn count(&self, rpc: &str, code: &str) -> usize {
        self.calls()
            .iter()
            .filter(|c| c.rpc == rpc && c.code == code)
            .count()
    }

    /// How many calls of `rpc` the plugin is holding now.
    pub async fn hanging(&self, rpc: &str) -> u64 {
        let s = faults::send(&self.admin, &Command::Status)
            .await
            .unwrap_or_default();
        let v: serde_json::Value = serde_json::from_str(&s).unwrap_or_default();
        v["hanging"][rpc].as_u64().unwrap_or(0)
    }
}

pub struct Cluster {
    pub etcd: Etcd,
    pub store: Store,
    pub dir: tempfile::TempDir,
    pub controllers: Vec<Proc>,
    pub nodes: Vec<TestNode>,
    pub opts: PluginOpts,
    /// Each proxied process's proxy to etcd, by process name (`controller-0`,
    /// `agent-n1`).
    pub proxies: BTreeMap<String, Proxy>,
    /// The tmpfs mounts made for small disks, unmounted when the cluster is dropped.
    mounts: Vec<PathBuf>,
}

pub const PLUGIN: &str = "hostpath.moor.dev";

/// The key of the reference plugin's Plugin object.
pub fn plugin_key() -> ObjectKey<PluginSpec> {
    Plugin::key_for(&PluginId::new(PLUGIN).unwrap())
}

/// The node named `name`.
pub fn node(name: &str) -> NodeName {
    NodeName::new(name).unwrap()
}

impl Cluster {
    /// etcd, `controllers` controller replicas, and `nodes` nodes n1..nN.
    pub async fn start(controllers: usize, nodes: usize, opts: PluginOpts) -> Cluster {
        Cluster::start_on(Etcd::start().await, controllers, nodes, opts).await
    }

    /// [`Cluster::start`] on a given etcd (such as an external 3-member cluster).
    pub async fn start_on(
        etcd: Etcd,
        controllers: usize,
        nodes: usize,
        opts: PluginOpts,
    ) -> Cluster {
        let store = etcd.store("/moor/").await;
        let dir = tempfile::tempdir().expect("temp dir");
        let mut c = Cluster {
            etcd,
            store,
            dir,
            controllers: Vec::new(),
            nodes: Vec::new(),
            opts,
            proxies: BTreeMap::new(),
            mounts: Vec::new(),
        };
        for i in 0..controllers {
            c.add_controller(i);
        }
        for i in 1..=nodes {
            c.add_node(&format!("n{i}"));
        }
        c.wait_nodes_healthy().await;
        c
    }

    /// The etcd endpoint process `name` is given: its own proxy when proxied.
    fn endpoint_for(&mut self, name: &str) -> String {
        if !self.opts.proxied {
            return self.etcd.client_url.clone();
        }
        let proxy = Proxy::start(&self.etcd.client_url);
        let url = proxy.url();
        self.proxies.insert(name.to_string(), proxy);
        url
    }

    /// The proxy of process `name` (`controller-0`, `agent-n1`).
    pub fn proxy(&self, name: &str) -> &Proxy {
        self.proxies
            .get(name)
            .unwrap_or_else(|| panic!("{name} has no proxy (PluginOpts::proxied)"))
    }

    fn add_controller(&mut self, i: usize) {
        let log = self.dir.path().join(format!("controller-{i}.log"));
        let etcd = self.endpoint_for(&format!("controller-{i}"));
        let mut args = vec![
            "controller".into(),
            format!("--etcd={etcd}"),
            format!("--identity=controller-{i}"),
            "--leader-ttl=3s".into(),
            "--event-window=1s".into(),
        ];
        args.extend(self.opts.controller_args.iter().cloned());
        let moord = self.opts.moord.clone().unwrap_or_else(|| bin("moord"));
        self.controllers
            .push(Proc::start(&format!("controller-{i}"), moord, args, log));
    }

    fn add_node(&mut self, name: &str) {
        let dir = self.dir.path().join(name);
        let state = dir.join("plugin");
        let mount_dir = dir.join("mnt");
        std::fs::create_dir_all(&mount_dir).expect("mount dir");
        let sock = dir.join("csi.sock");
        let monolith = self.nodes.is_empty();
        let mut pargs = vec![
            format!("--endpoint=unix://{}", sock.display()),
            format!("--node-id=csi-{name}"),
            format!("--state-dir={}", state.display()),
            format!("--mode={}", if monolith { "monolith" } else { "node" }),
            format!("--publish-unpublish={}", self.opts.publish_unpublish),
            format!("--stage-unstage={}", self.opts.stage_unstage),
            // The nodes the controller instance may publish to: every node's.
            format!(
                "--node-registry={}",
                self.dir.path().join("hostpath-nodes").display()
            ),
        ];
        if !can_mount() {
            pargs.push("--no-mount".into());
        }
        pargs.extend(self.opts.extra.iter().cloned());
        for (node, flags) in &self.opts.node_extra {
            if node == name {
                pargs.extend(flags.iter().cloned());
            }
        }
        let plugin = Proc::start(
            &format!("plugin-{name}"),
            bin("moor-hostpath"),
            pargs,
            dir.join("plugin.log"),
        );
        let kind = if monolith { "monolith" } else { "node" };
        let etcd = self.endpoint_for(&format!("agent-{name}"));
        let data_dir = dir.join("agent");
        if let Some(mib) = self.opts.small_disk_mib {
            std::fs::create_dir_all(&data_dir).expect("agent data dir");
            if can_mount() {
                let ok = std::process::Command::new("mount")
                    .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
                    .arg(&data_dir)
                    .status()
                    .is_ok_and(|s| s.success());
                assert!(ok, "mount a tmpfs on {}", data_dir.display());
                self.mounts.push(data_dir.clone());
            }
        }
        let http = format!(
            "127.0.0.1:{}",
            std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .expect("a free port")
        );
        let mut aargs = vec![
            "agent".into(),
            format!("--node={name}"),
            format!("--etcd={etcd}"),
            format!("--data-dir={}", data_dir.display()),
            format!(
                "--plugin=id={PLUGIN},type={kind},endpoint=unix://{},mount-dir={}{}",
                sock.display(),
                mount_dir.display(),
                self.opts
                    .plugin_options
                    .iter()
                    .chain(
                        self.opts
                            .node_plugin_options
                            .iter()
                            .filter(|(n, _)| n == name)
                            .flat_map(|(_, o)| o)
                    )
                    .map(|o| format!(",{o}"))
                    .collect::<String>()
            ),
            "--node-ttl=3s".into(),
            "--leader-ttl=3s".into(),
            "--csi-tries=2".into(),
            // Repeats of an event fold; their counts are written within a second.
            "--event-window=1s".into(),
            format!("--http={http}"),
        ];
        // These unless the test gives its own.
        for default in ["--fingerprint-interval=1s", "--csi-timeout=5s"] {
            let flag = default.split('=').next().unwrap_or(default);
            if !self
                .opts
                .agent_args
                .iter()
                .any(|a| a.split('=').next() == Some(flag))
            {
                aargs.push(default.into());
            }
        }
        // `{dir}` in an agent argument is the node's own directory.
        let node_dir = dir.display().to_string();
        aargs.extend(
            self.opts
                .agent_args
                .iter()
                .map(|a| a.replace("{dir}", &node_dir)),
        );
        let moord = self.opts.moord.clone().unwrap_or_else(|| bin("moord"));
        let (program, aargs) = match self.opts.agent_wrapper.split_first() {
            Some((wrapper, flags)) => {
                let mut all = flags.to_vec();
                all.push(moord.display().to_string());
                all.extend(aargs);
                (PathBuf::from(wrapper), all)
            }
            None => (moord, aargs),
        };
        let agent = Proc::start(
            &format!("agent-{name}"),
            program,
            aargs,
            dir.join("agent.log"),
        );
        self.nodes.push(TestNode {
            name: name.to_string(),
            admin: state.join("admin.sock"),
            calls: state.join("calls.jsonl"),
            dir,
            plugin,
            agent,
            mount_dir,
            http,
        });
    }

    pub fn node(&self, name: &str) -> &TestNode {
        self.nodes
            .iter()
            .find(|n| n.name == name)
            .expect("no such node")
    }

    pub fn node_mut(&mut self, name: &str) -> &mut TestNode {
        self.nodes
            .iter_mut()
            .find(|n| n.name == name)
            .expect("no such node")
    }

    /// Every node registered with a healthy plugin, and the Plugin aggregated.
    pub async fn wait_nodes_healthy(&self) {
        let n = self.nodes.len() as u32;
        let store = self.store.clone();
        self.wait(
            &format!("{n} healthy plugin nodes"),
            Duration::from_secs(30),
            || {
                let store = store.clone();
                async move {
                    store
                        .try_get(&plugin_key())
                        .await
                        .ok()
                        .flatten()
                        .is_some_and(|p| p.status.nodes_healthy == n)
                }
            },
        )
        .await;
    }

    /// Waits, and on timeout prints every process's log tail before failing.
    pub async fn wait<F, Fut>(&self, what: &str, timeout: Duration, cond: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let r = tokio::time::timeout(timeout + Duration::from_secs(1), async {
            let inner = std::panic::AssertUnwindSafe(wait_for(what, timeout, cond));
            futures::FutureExt::catch_unwind(inner).await
        })
        .await;
        if !matches!(r, Ok(Ok(()))) {
            self.dump_logs();
            panic!("timed out waiting for {what}");
        }
    }

    /// Keeps the cluster's directory (logs, call logs, state) after the test, and says
    /// where it is.
    pub fn keep_dir(&mut self) -> PathBuf {
        let fresh = tempfile::tempdir().expect("temp dir");
        let kept = std::mem::replace(&mut self.dir, fresh).keep();
        eprintln!("cluster directory kept at {}", kept.display());
        kept
    }

    pub fn dump_logs(&self) {
        let tail = |s: String| {
            let lines: Vec<&str> = s.lines().collect();
            lines[lines.len().saturating_sub(40)..].join("\n")
        };
        for c in &self.controllers {
            eprintln!("==== {} ====\n{}", c.name, tail(c.log_text()));
        }
        for n in &self.nodes {
            eprintln!("==== {} ====\n{}", n.agent.name, tail(n.agent.log_text()));
            eprintln!("==== {} ====\n{}", n.plugin.name, tail(n.plugin.log_text()));
        }
    }

    /// A CSI client of n1's plugin (the controller service), for what a test does
    /// behind moor's back.
    pub fn csi(&self) -> moor::csi::client::Csi {
        let sock = self.nodes[0].dir.join("csi.sock");
        let channel = moor::csi::channel(&format!("unix://{}", sock.display())).expect("a channel");
        let policy = moor::csi::policy::Policy {
            tries: 1,
            per_try_timeout: Duration::from_secs(3),
            ..Default::default()
        };
        moor::csi::client::Csi::new(channel, policy)
    }

    /// Runs moorctl against this cluster's etcd; returns success and stdout+stderr.
    pub fn moorctl(&self, args: &[&str]) -> (bool, String) {
        self.moorctl_as(&bin("moorctl"), args)
    }

    /// [`Cluster::moorctl`] with another build's moorctl (`program`).
    pub fn moorctl_as(&self, program: &Path, args: &[&str]) -> (bool, String) {
        let out = std::process::Command::new(program)
            .arg(format!("--endpoints={}", self.etcd.client_url))
            .args(args)
            .output()
            .expect("run moorctl");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!("$ {} {}\n{text}", program.display(), args.join(" "));
        (out.status.success(), text)
    }

    pub async fn apply<S: Spec>(&self, obj: Object<S>) -> Object<S> {
        self.store.create(&obj).await.expect("create")
    }

    /// A volume the provisioner creates.
    pub fn volume(&self, name: &str, mode: AccessMode) -> Volume {
        Volume::new(
            &Namespace::default_ns(),
            Name::new(name).unwrap(),
            VolumeSpec {
                plugin_id: PluginId::new(PLUGIN).unwrap(),
                capacity_min: Some(Size(1 << 20)),
                capabilities: vec![VolumeCapability {
                    access_mode: mode,
                    attachment_mode: AttachmentMode::FileSystem,
                }],
                ..Default::default()
            },
        )
    }

    pub fn allocation(&self, name: &str, node: &str, volume: &str, read_only: bool) -> Allocation {
        Allocation::new(
            &Namespace::default_ns(),
            Name::new(name).unwrap(),
            AllocationSpec {
                node: NodeName::new(node).unwrap(),
                volumes: vec![VolumeRequest {
                    name: Name::new("data").unwrap(),
                    volume: VolumeId::new(volume).unwrap(),
                    read_only,
                    ..Default::default()
                }],
                ..Default::default()
            },
        )
    }

    pub async fn volume_ready(&self, name: &str) {
        let store = self.store.clone();
        let key = Volume::key_for(&Namespace::default_ns(), name);
        self.wait(
            &format!("volume {name} created"),
            Duration::from_secs(30),
            || {
                let (store, key) = (store.clone(), key.clone());
                async move {
                    store
                        .try_get(&key)
                        .await
                        .ok()
                        .flatten()
                        .is_some_and(|v| v.status.provisioning.external_id.is_some())
                }
            },
        )
        .await;
    }

    pub async fn claim(&self, alloc: &str, node_name: &str) -> Option<Claim> {
        self.store
            .try_get(&Claim::key_for(
                &node(node_name),
                &Namespace::default_ns(),
                format!("{alloc}.data"),
            ))
            .await
            .ok()
            .flatten()
    }

    /// Whether every claim of the cluster is Released.
    pub async fn all_claims_released(&self) -> bool {
        self.store
            .list(&KeyScope::<ClaimSpec>::all())
            .await
            .unwrap()
            .items
            .iter()
            .all(|cl| cl.status.phase == ClaimPhase::Released)
    }

    /// Node `name`'s volume-plugin endpoint socket (agents started with
    /// `--volume-plugin={dir}/moor.sock`, as [`Cluster::start_volume_plugin`] does).
    pub fn volume_plugin_socket(&self, name: &str) -> PathBuf {
        self.node(name).dir.join("moor.sock")
    }

    /// One controller and nodes n1, n2 whose agents serve the volume-plugin endpoint
    /// (with `more` agent flags); returns once every node is healthy and serves it.
    pub async fn start_volume_plugin(more: &[&str]) -> Cluster {
        let opts = PluginOpts {
            agent_args: more.iter().map(|a| a.to_string()).collect(),
            ..PluginOpts::default()
        };
        Cluster::start_volume_plugin_with(opts).await
    }

    /// [`Cluster::start_volume_plugin`] with these options (the endpoint's flag added).
    pub async fn start_volume_plugin_with(mut opts: PluginOpts) -> Cluster {
        opts.agent_args
            .insert(0, "--volume-plugin={dir}/moor.sock".to_string());
        let c = Cluster::start(1, 2, opts).await;
        c.wait_nodes_healthy().await;
        for n in ["n1", "n2"] {
            let sock = c.volume_plugin_socket(n);
            c.wait("the endpoint's socket", Duration::from_secs(60), || async {
                sock.exists()
            })
            .await;
        }
        c
    }

    pub async fn wait_claim(&self, alloc: &str, node: &str, phase: ClaimPhase, timeout: Duration) {
        let what = format!("claim {alloc}.data on {node} to be {phase:?}");
        self.wait(&what, timeout, || async move {
            self.claim(alloc, node)
                .await
                .is_some_and(|c| c.status.phase == phase)
        })
        .await;
    }

    /// Waits until the claim of `alloc` on `node` is Denied with a reason that says
    /// `says`.
    pub async fn wait_denied(&self, alloc: &str, node: &str, says: &str, timeout: Duration) {
        let what = format!("claim {alloc}.data on {node} denied: {says}");
        self.wait(&what, timeout, || async move {
            self.claim(alloc, node).await.is_some_and(|c| {
                c.status.phase == ClaimPhase::Denied
                    && c.status.reason.as_deref().is_some_and(|r| r.contains(says))
            })
        })
        .await;
    }

    pub async fn stop_alloc(&self, alloc: &str) {
        loop {
            let mut a = self
                .store
                .get(&Allocation::key_for(&Namespace::default_ns(), alloc))
                .await
                .expect("allocation");
            a.spec.desired_status = DesiredStatus::Stop;
            match self.store.replace(&a).await {
                Ok(_) => return,
                Err(moor::store::StoreError::Conflict { .. }) => continue,
                Err(e) => panic!("stop {alloc}: {e}"),
            }
        }
    }

    pub async fn attachment(&self, volume: &str, node_name: &str) -> Option<Attachment> {
        self.store
            .try_get(&Attachment::key_for(
                &Namespace::default_ns(),
                volume,
                &node(node_name),
            ))
            .await
            .ok()
            .flatten()
    }

    /// Every plugin's call log, merged, checked against the invariants.
    pub fn check_calls(&self, expect_released: bool) {
        self.check_calls_forced(expect_released, BTreeMap::new());
    }

    /// [`Cluster::check_calls`] with nodes declared gone (CSI node id → the times of
    /// its declarations; see the checker's module docs).
    pub fn check_calls_forced(
        &self,
        expect_released: bool,
        forced_nodes: BTreeMap<String, Vec<String>>,
    ) {
        let logs: Vec<Vec<Call>> = self.nodes.iter().map(|n| n.calls()).collect();
        let merged = checker::merge(logs);
        let cfg = CheckConfig {
            controller_publish_required: self.opts.publish_unpublish,
            stage_required: self.opts.stage_unstage,
            expect_released,
            forced_nodes,
            ..Default::default()
        };
        let violations = checker::check(&merged, &cfg);
        if !violations.is_empty() {
            for c in &merged {
                eprintln!("{}", serde_json::to_string(c).unwrap_or_default());
            }
            self.dump_logs();
        }
        assert!(
            violations.is_empty(),
            "call log violations:\n{}",
            violations
                .iter()
                .map(|v| v.to_string())
                .collect::<Vec<_>>()
                .join("\n")
        );
    }

    /// Mounts currently in the mount table under a node's mount dir.
    pub fn mounts_under(&self, node: &str) -> usize {
        let dir = self.node(node).mount_dir.clone();
        count_mounts_under(&dir)
    }
}

pub fn count_mounts_under(dir: &Path) -> usize {
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let prefix = dir.to_string_lossy().to_string();
    table
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4))
        .filter(|p| p.starts_with(&prefix))
        .count()
}

/// Whether this process may mount (real bind mounts are tested only then).
/// Whether this machine lets the tests attach loop devices (root, a loop-control
/// device, and `losetup --find` finding a free one).
pub fn can_loop() -> bool {
    can_mount()
        && Path::new("/dev/loop-control").exists()
        && std::process::Command::new("losetup")
            .arg("--find")
            .output()
            .is_ok_and(|o| o.status.success())
}

/// The loop devices backed by `file` (`losetup --associated`).
pub fn loops_of(file: &Path) -> String {
    std::process::Command::new("losetup")
        .arg("--associated")
        .arg(file)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// Whether the tests mount for real: as root, always (CI runs as root). Not as root,
/// only when `MOOR_TESTS_NO_MOUNT=1` says to run without mounting (the mount checks
/// then skip); otherwise this fails the test, so that a check that cannot run never
/// passes silently.
impl Cluster {
    /// Fills node `name`'s small disk (its agent's data dir) to the last byte: the
    /// agent's next journal write fails with ENOSPC. Returns false when the disk is
    /// not a tmpfs of its own (not root), so nothing was filled.
    pub fn fill_disk(&self, name: &str) -> bool {
        let dir = self.node(name).dir.join("agent");
        if !self.mounts.contains(&dir) {
            return false;
        }
        use std::io::Write;
        let mut f = std::fs::File::create(dir.join("fill")).expect("create the fill file");
        let chunk = vec![0u8; 64 * 1024];
        loop {
            match f.write(&chunk) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(28) => break,
                Err(e) => panic!("fill {}: {e}", dir.display()),
            }
        }
        // The last partial block too.
        while f.write(&[0u8]).is_ok_and(|n| n == 1) {}
        true
    }

    /// Frees what [`Cluster::fill_disk`] took.
    pub fn free_disk(&self, name: &str) {
        let _ = std::fs::remove_file(self.node(name).dir.join("agent").join("fill"));
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for p in self.controllers.iter_mut() {
            p.kill();
        }
        for n in self.nodes.iter_mut() {
            n.agent.kill();
            n.plugin.kill();
        }
        for m in &self.mounts {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(m)
                .status();
        }
        // The bind mounts the plugins made and did not undo (a test that ends with
        // claims published, or killed a process mid-step).
        crate::common::unmount_below(self.dir.path());
    }
}

pub use moor_hostpath::mounts::can_mount;
