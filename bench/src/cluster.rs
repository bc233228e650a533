//! The system under test, as real processes: a store (etcd or moor-store), one `moord
//! controller`, and per node a `moord agent` with a moor-hostpath plugin that does no
//! real mounts (or a plugin the operator started).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use moor::api::{Node, NodeName, Plugin, PluginId};
use moor::store::Store;
use tokio::process::{Child, Command};

/// Which server speaks the etcd API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// etcd (`--etcd-bin`).
    Etcd,
    /// moor's embedded store (`moor-store`).
    Embedded,
}

impl Backend {
    /// Its name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Etcd => "etcd",
            Backend::Embedded => "moor-store",
        }
    }
}

/// Where the binaries are and how to run the store.
#[derive(Debug, Clone)]
pub struct Bins {
    /// Directory with moord and moor-hostpath (and moor-store).
    pub dir: PathBuf,
    /// The etcd binary.
    pub etcd: PathBuf,
    /// Its `--quota-backend-bytes`.
    pub etcd_quota_bytes: u64,
    /// Its `--snapshot-count`, when given.
    pub etcd_snapshot_count: Option<u64>,
}

/// A plugin the operator runs: its endpoint and type.
#[derive(Debug, Clone)]
pub struct ExternalPlugin {
    /// `unix:///path`.
    pub endpoint: String,
    /// monolith, node or controller.
    pub plugin_type: String,
}

/// A free loopback port.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(0)
}

/// A child killed when dropped.
pub struct Proc {
    child: Child,
}

impl Proc {
    /// Starts `cmd` with stderr to `log`.
    pub fn spawn(name: &str, cmd: &mut Command, log: &Path) -> anyhow::Result<Proc> {
        let log = std::fs::File::create(log)?;
        let child = cmd
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {name} ({:?})", cmd.as_std().get_program()))?;
        Ok(Proc { child })
    }

    /// Whether the process has ended (its status reaped).
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// CPU seconds (user + system) the process has used so far.
    pub fn cpu_seconds(&self) -> f64 {
        self.child
            .id()
            .map_or(0.0, |pid| cpu_seconds(&format!("/proc/{pid}/stat")))
    }

    /// Resident and peak resident memory in MiB (VmRSS, VmHWM); 0 if unreadable.
    pub fn memory_mib(&self) -> (f64, f64) {
        let Some(pid) = self.child.id() else {
            return (0.0, 0.0);
        };
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let kib = |field: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        (kib("VmRSS:") / 1024.0, kib("VmHWM:") / 1024.0)
    }

    /// SIGTERM (a graceful stop: a leader resigns), then SIGKILL after 20 s.
    pub async fn terminate(&mut self) {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
            if tokio::time::timeout(Duration::from_secs(20), self.child.wait())
                .await
                .is_ok()
            {
                return;
            }
        }
        self.kill().await;
    }

    /// SIGKILL and reap.
    pub async fn kill(&mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }
}

/// CPU seconds (user + system) from a `/proc/PID/stat` file; 0 if unreadable.
pub fn cpu_seconds(stat: &str) -> f64 {
    let Ok(text) = std::fs::read_to_string(stat) else {
        return 0.0;
    };
    // Fields after the command name (which may hold spaces) start at state (field 3);
    // utime and stime are fields 14 and 15, in clock ticks (100 per second on Linux).
    let after = text.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

/// CPU seconds used by each part of the system.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Cpu {
    /// The store.
    pub store: f64,
    /// moord controller(s).
    pub controller: f64,
    /// All agents.
    pub agents: f64,
    /// All plugins the harness started.
    pub plugins: f64,
    /// The harness itself (its writers and watchers).
    pub harness: f64,
}

impl Cpu {
    /// What was used between `earlier` and `self`.
    pub fn since(&self, earlier: &Cpu) -> Cpu {
        Cpu {
            store: self.store - earlier.store,
            controller: self.controller - earlier.controller,
            agents: self.agents - earlier.agents,
            plugins: self.plugins - earlier.plugins,
            harness: self.harness - earlier.harness,
        }
    }

    /// Milliseconds of CPU per claim when `n` claims took `self`.
    pub fn per_claim_ms(&self, n: usize) -> Cpu {
        let f = 1000.0 / n.max(1) as f64;
        Cpu {
            store: self.store * f,
            controller: self.controller * f,
            agents: self.agents * f,
            plugins: self.plugins * f,
            harness: self.harness * f,
        }
    }

    /// `s1.2+c0.5+a0.7+p0.1`: milliseconds per claim of store, controller, agents and
    /// plugins (the harness left out).
    pub fn ms_cell(&self) -> String {
        format!(
            "s{:.2}+c{:.2}+a{:.2}+p{:.2}",
            self.store, self.controller, self.agents, self.plugins
        )
    }

    /// `store 1.2 / controller 3.4 / agents 2.0 / plugins 0.3 / harness 0.8 s`.
    pub fn cell(&self) -> String {
        format!(
            "store {:.1}, ctrl {:.1}, agents {:.1}, plugins {:.1}, bench {:.1} s",
            self.store, self.controller, self.agents, self.plugins, self.harness
        )
    }
}

/// The store process.
pub struct StoreProc {
    /// Its client URL.
    pub url: String,
    /// Its version, as the report names it.
    pub version: String,
    /// The process.
    pub proc: Proc,
}

/// Starts the store in `dir` and waits until it answers.
pub async fn start_store(backend: Backend, bins: &Bins, dir: &Path) -> anyhow::Result<StoreProc> {
    let (client, peer) = (free_port(), free_port());
    let url = format!("http://127.0.0.1:{client}");
    let (mut cmd, version) = match backend {
        Backend::Etcd => {
            let out = std::process::Command::new(&bins.etcd)
                .arg("--version")
                .output()
                .with_context(|| format!("running {} --version", bins.etcd.display()))?;
            let version = String::from_utf8_lossy(&out.stdout)
                .lines()
                .next()
                .unwrap_or("etcd ?")
                .to_string();
            let mut cmd = Command::new(&bins.etcd);
            cmd.args(["--name", "bench", "--data-dir"])
                .arg(dir.join("etcd"))
                .arg(format!("--listen-client-urls={url}"))
                .arg(format!("--advertise-client-urls={url}"))
                .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer}"))
                .arg(format!(
                    "--initial-advertise-peer-urls=http://127.0.0.1:{peer}"
                ))
                .arg(format!("--initial-cluster=bench=http://127.0.0.1:{peer}"))
                .arg(format!("--quota-backend-bytes={}", bins.etcd_quota_bytes));
            if let Some(n) = bins.etcd_snapshot_count {
                cmd.arg(format!("--snapshot-count={n}"));
            }
            (cmd, version)
        }
        Backend::Embedded => {
            let mut cmd = Command::new(bins.dir.join("moor-store"));
            cmd.arg("--listen")
                .arg(format!("127.0.0.1:{client}"))
                .arg("--data-dir")
                .arg(dir.join("moor-store"));
            (cmd, format!("moor-store {}", moor::VERSION))
        }
    };
    let proc = Proc::spawn(backend.name(), &mut cmd, &dir.join("store.log"))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(mut c) = etcd_client::Client::connect([&url], None).await {
            if c.get("probe", None).await.is_ok() {
                break;
            }
        }
        if Instant::now() > deadline {
            bail!("{} did not answer on {url} within 30 s", backend.name());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(StoreProc { url, version, proc })
}

/// What each agent's `--plugin` names besides its endpoint.
#[derive(Clone, Copy)]
pub struct AgentFlags<'a> {
    /// The plugin's id.
    pub plugin_id: &'a str,
    /// More `--plugin` options (`serialize-per-node=true`), comma-separated; may be
    /// empty.
    pub plugin_options: &'a str,
}

/// moord controller and the nodes.
pub struct Cluster {
    /// The controller (killed and restarted by the restart phase).
    pub controller: Proc,
    controller_cmd: Vec<String>,
    /// Agents, killed when the cluster is dropped.
    agents: Vec<Proc>,
    /// Plugins the harness started, likewise.
    plugins: Vec<Proc>,
    /// CPU used by controllers killed so far.
    dead_controller_cpu: f64,
    /// Node names, n1..nM.
    pub nodes: Vec<NodeName>,
    /// Each node's call log, when the harness started its plugin.
    pub call_logs: Vec<Option<PathBuf>>,
    /// Each agent's /metrics port (moor's own record of its CSI calls).
    pub metrics_ports: Vec<u16>,
    dir: PathBuf,
    bins: Bins,
}

/// The plugin id the harness uses.
pub const PLUGIN_ID: &str = "hostpath.moor.dev";

impl Cluster {
    /// CSI calls of `rpc` the agents have made so far (any answer), from their
    /// /metrics: moor's own record, whatever the plugin logs.
    pub async fn csi_calls(&self, rpc: &str) -> anyhow::Result<u64> {
        let mut total = 0;
        for port in &self.metrics_ports {
            let text = http_get(*port, "/metrics").await?;
            total += csi_calls_in(&text, rpc);
        }
        Ok(total)
    }

    /// The agents' node journal so far, summed: (commits appended, fdatasyncs), from
    /// their /metrics; (0, 0) from a build that does not count them.
    pub async fn journal(&self) -> anyhow::Result<Journal> {
        let mut total = Journal::default();
        for port in &self.metrics_ports {
            let text = http_get(*port, "/metrics").await?;
            total.commits += counter_in(&text, "moor_agent_journal_commits_total");
            total.syncs += counter_in(&text, "moor_agent_journal_syncs_total");
        }
        Ok(total)
    }

    /// Starts the controller and `nodes` agents (with plugins unless `external`).
    pub async fn start(
        bins: &Bins,
        url: &str,
        dir: &Path,
        nodes: usize,
        external: &[ExternalPlugin],
        plugin_id: &str,
        plugin_options: &str,
    ) -> anyhow::Result<Cluster> {
        let agent = AgentFlags {
            plugin_id,
            plugin_options,
        };
        Cluster::start_with(bins, url, dir, nodes, external, &agent, &[]).await
    }

    /// [`Cluster::start`] with more flags for the controller.
    pub async fn start_with(
        bins: &Bins,
        url: &str,
        dir: &Path,
        nodes: usize,
        external: &[ExternalPlugin],
        agent_flags: &AgentFlags<'_>,
        controller_extra: &[String],
    ) -> anyhow::Result<Cluster> {
        let AgentFlags {
            plugin_id,
            plugin_options,
        } = *agent_flags;
        let nodes = if external.is_empty() {
            nodes
        } else {
            external.len()
        };
        let mut controller_cmd = vec![
            "controller".to_string(),
            "--etcd".into(),
            url.into(),
            "--identity".into(),
            "bench".into(),
        ];
        controller_cmd.extend(controller_extra.iter().cloned());
        let controller = Proc::spawn(
            "controller",
            Command::new(bins.dir.join("moord")).args(&controller_cmd),
            &dir.join("controller.log"),
        )?;
        let mut agents = Vec::new();
        let mut plugins = Vec::new();
        let mut names = Vec::new();
        let mut call_logs = Vec::new();
        let mut metrics_ports = Vec::new();
        for i in 0..nodes {
            let node = format!("n{}", i + 1);
            let ndir = dir.join(&node);
            std::fs::create_dir_all(&ndir)?;
            let (endpoint, plugin_type) = match external.get(i) {
                Some(p) => {
                    call_logs.push(None);
                    (p.endpoint.clone(), p.plugin_type.clone())
                }
                None => {
                    let socket = ndir.join("csi.sock");
                    let mode = if i == 0 { "monolith" } else { "node" };
                    let plugin = Proc::spawn(
                        &format!("plugin {node}"),
                        Command::new(bins.dir.join("moor-hostpath"))
                            .arg("--endpoint")
                            .arg(format!("unix://{}", socket.display()))
                            .args(["--node-id", &node, "--mode", mode, "--no-mount"])
                            .arg("--state-dir")
                            .arg(ndir.join("plugin"))
                            // The nodes the controller instance may publish to.
                            .arg("--node-registry")
                            .arg(ndir.with_file_name("hostpath-nodes")),
                        &ndir.join("plugin.log"),
                    )?;
                    plugins.push(plugin);
                    call_logs.push(Some(ndir.join("plugin/calls.jsonl")));
                    (format!("unix://{}", socket.display()), mode.to_string())
                }
            };
            let port = free_port();
            let agent = Proc::spawn(
                &format!("agent {node}"),
                Command::new(bins.dir.join("moord"))
                    .args(["agent", "--node", &node, "--etcd", url, "--data-dir"])
                    .arg(ndir.join("agent"))
                    .arg("--plugin")
                    .arg(format!(
                        "id={plugin_id},type={plugin_type},endpoint={endpoint},mount-dir={}{}",
                        ndir.join("mnt").display(),
                        if plugin_options.is_empty() {
                            String::new()
                        } else {
                            format!(",{plugin_options}")
                        }
                    ))
                    .arg("--http")
                    .arg(format!("127.0.0.1:{port}")),
                &ndir.join("agent.log"),
            )?;
            metrics_ports.push(port);
            agents.push(agent);
            names.push(NodeName::new(&node)?);
        }
        Ok(Cluster {
            controller,
            controller_cmd,
            agents,
            plugins,
            dead_controller_cpu: 0.0,
            nodes: names,
            call_logs,
            metrics_ports,
            dir: dir.to_path_buf(),
            bins: bins.clone(),
        })
    }

    /// Waits until every node has a healthy plugin and the Plugin object counts them.
    /// Makes every ControllerPublish and ControllerUnpublish of the plugins the harness
    /// started take `ms` longer (moor-hostpath's latency fault, sent to its admin
    /// socket): a plugin as slow as a cloud's attach API.
    pub async fn slow_controller_calls(&self, ms: u64) -> anyhow::Result<()> {
        use moor_hostpath::faults::{send, Command};
        for log in self.call_logs.iter().flatten() {
            let admin = log.with_file_name("admin.sock");
            for rpc in ["ControllerPublishVolume", "ControllerUnpublishVolume"] {
                let rpc = rpc.to_string();
                send(&admin, &Command::Latency { rpc, ms })
                    .await
                    .with_context(|| format!("slowing the plugin at {}", admin.display()))?;
            }
        }
        Ok(())
    }

    pub async fn wait_ready(&self, store: &Store, plugin_id: &str) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let mut healthy = 0;
            for node in &self.nodes {
                if let Ok(Some(n)) = store.try_get(&Node::key_for(node)).await {
                    if n.status.plugins.values().any(|p| p.healthy) {
                        healthy += 1;
                    }
                }
            }
            let plugin_ok = matches!(
                store.try_get(&Plugin::key_for(&PluginId::new(plugin_id)?)).await,
                Ok(Some(p)) if p.status.nodes_healthy as usize == self.nodes.len()
            );
            if healthy == self.nodes.len() && plugin_ok {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "{healthy}/{} nodes healthy after 120 s; logs in {}",
                    self.nodes.len(),
                    self.dir.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// CPU used so far by each part (the store's from `store`).
    pub fn cpu(&self, store: &Proc) -> Cpu {
        Cpu {
            store: store.cpu_seconds(),
            controller: self.dead_controller_cpu + self.controller.cpu_seconds(),
            agents: self.agents.iter().map(Proc::cpu_seconds).sum(),
            plugins: self.plugins.iter().map(Proc::cpu_seconds).sum(),
            harness: cpu_seconds("/proc/self/stat"),
        }
    }

    /// Kills the controller with SIGKILL and starts a new one.
    pub async fn restart_controller(&mut self) -> anyhow::Result<()> {
        self.dead_controller_cpu += self.controller.cpu_seconds();
        self.controller.kill().await;
        self.controller = Proc::spawn(
            "controller",
            Command::new(self.bins.dir.join("moord")).args(&self.controller_cmd),
            &self.dir.join("controller-2.log"),
        )?;
        Ok(())
    }
}

/// Agents' journal counts ([`Cluster::journal`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct Journal {
    pub commits: u64,
    pub syncs: u64,
}

/// Per claim between two readings: commits and fdatasyncs of the node journals.
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct JournalPerClaim {
    pub commits: f64,
    pub syncs: f64,
}

impl Journal {
    pub fn per_claim_since(&self, before: &Journal, n: usize) -> JournalPerClaim {
        let n = n.max(1) as f64;
        JournalPerClaim {
            commits: self.commits.saturating_sub(before.commits) as f64 / n,
            syncs: self.syncs.saturating_sub(before.syncs) as f64 / n,
        }
    }
}

/// The value of an unlabelled counter in a /metrics text (0 when absent).
fn counter_in(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// The calls of `rpc` counted in a /metrics text (`moor_csi_call_duration_seconds_count`,
/// summed over answers).
pub fn csi_calls_in(text: &str, rpc: &str) -> u64 {
    let label = format!("rpc=\"{rpc}\"");
    text.lines()
        .filter(|l| l.starts_with("moor_csi_call_duration_seconds_count{") && l.contains(&label))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// The gRPC messages the store has received so far, by method (`Range`, `Txn`,
/// `LeaseKeepAlive`, `Watch`, ...), from etcd's own /metrics
/// (`grpc_server_msg_received_total`): a unary request is one message, a stream's
/// every message counts. Empty for a store that serves no /metrics (moor-store).
pub async fn store_requests(url: &str) -> std::collections::BTreeMap<String, f64> {
    let port = url
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse::<u16>().ok());
    let Some(text) = (match port {
        Some(port) => http_get(port, "/metrics").await.ok(),
        None => None,
    }) else {
        return Default::default();
    };
    store_requests_in(&text)
}

/// [`store_requests`] of a /metrics text.
pub fn store_requests_in(text: &str) -> std::collections::BTreeMap<String, f64> {
    let mut by_method = std::collections::BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("grpc_server_msg_received_total{") else {
            continue;
        };
        let Some(method) = rest
            .split_once("grpc_method=\"")
            .and_then(|(_, m)| m.split_once('"'))
            .map(|(m, _)| m)
        else {
            continue;
        };
        let Some(v) = line
            .rsplit_once(' ')
            .and_then(|(_, v)| v.parse::<f64>().ok())
        else {
            continue;
        };
        *by_method.entry(method.to_string()).or_insert(0.0) += v;
    }
    by_method
}

/// Requests by method between two [`store_requests`] readings, per claim (`n`),
/// leaving out methods with none.
pub fn requests_per_claim(
    before: &std::collections::BTreeMap<String, f64>,
    after: &std::collections::BTreeMap<String, f64>,
    n: usize,
) -> std::collections::BTreeMap<String, f64> {
    after
        .iter()
        .map(|(m, v)| {
            (
                m.clone(),
                (v - before.get(m).copied().unwrap_or(0.0)) / n.max(1) as f64,
            )
        })
        .filter(|(_, v)| *v > 0.0)
        .map(|(m, v)| (m, (v * 1000.0).round() / 1000.0))
        .collect()
}

/// A plain HTTP/1.0 GET on loopback; the body.
pub(crate) async fn http_get(port: u16, path: &str) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await??;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .context("no end of HTTP headers")?;
    anyhow::ensure!(head.contains(" 200 "), "GET {path}: {head}");
    Ok(body.to_string())
}

#[cfg(test)]
mod tests {
    #[test]
    fn csi_calls_are_summed_over_answers() {
        let text = "# HELP x\n\
moor_csi_call_duration_seconds_count{rpc=\"ControllerPublishVolume\",code=\"Ok\"} 7\n\
moor_csi_call_duration_seconds_count{rpc=\"ControllerPublishVolume\",code=\"Unavailable\"} 2\n\
moor_csi_call_duration_seconds_sum{rpc=\"ControllerPublishVolume\",code=\"Ok\"} 0.5\n\
moor_csi_call_duration_seconds_count{rpc=\"NodePublishVolume\",code=\"Ok\"} 3\n";
        assert_eq!(super::csi_calls_in(text, "ControllerPublishVolume"), 9);
        assert_eq!(super::csi_calls_in(text, "NodePublishVolume"), 3);
        assert_eq!(super::csi_calls_in(text, "NodeStageVolume"), 0);
    }

    #[test]
    fn store_requests_are_summed_by_method_and_divided_per_claim() {
        let before = super::store_requests_in(
            "grpc_server_msg_received_total{grpc_method=\"Range\",grpc_service=\"etcdserverpb.KV\",grpc_type=\"unary\"} 10\n\
grpc_server_msg_received_total{grpc_method=\"Txn\",grpc_service=\"etcdserverpb.KV\",grpc_type=\"unary\"} 4\n",
        );
        let after = super::store_requests_in(
            "# TYPE grpc_server_msg_received_total counter\n\
grpc_server_msg_received_total{grpc_method=\"Range\",grpc_service=\"etcdserverpb.KV\",grpc_type=\"unary\"} 30\n\
grpc_server_msg_received_total{grpc_method=\"Txn\",grpc_service=\"etcdserverpb.KV\",grpc_type=\"unary\"} 4\n\
grpc_server_msg_received_total{grpc_method=\"LeaseKeepAlive\",grpc_service=\"etcdserverpb.Lease\",grpc_type=\"bidi_stream\"} 5\n\
grpc_server_msg_sent_total{grpc_method=\"Range\",grpc_service=\"etcdserverpb.KV\",grpc_type=\"unary\"} 99\n",
        );
        let per = super::requests_per_claim(&before, &after, 10);
        assert_eq!(per.get("Range"), Some(&2.0));
        assert_eq!(per.get("LeaseKeepAlive"), Some(&0.5));
        assert_eq!(per.get("Txn"), None, "no Txn in between");
    }
}
