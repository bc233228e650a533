//! Scale: a controller and an agent starting against a store that already holds a big
//! cluster (default 100,000 volumes, allocations and published claims).
//!
//! Expected flow:
//! 1. A real system (controller, one agent on node `sn0000` with moor-hostpath
//!    --no-mount, without PUBLISH_UNPUBLISH so no attachments) creates and publishes
//!    `per_node` volumes and claims through the plugin.
//! 2. The controller stops. Every object the system wrote for claim 0 (volume,
//!    allocation, claim, mounts) is the template for the rest: copies with the names,
//!    node and uids changed are written in batched txns, `per_node` claims per node,
//!    plus a Node object (on a lease the harness keeps) for every simulated node. The
//!    store then holds what the real system would have written for all of them, and
//!    the harness checks that it all decodes.
//! 3. A fresh controller starts; synced = every volume, allocation and claim
//!    reconciled and every queue empty (from its /metrics). Its time, RSS, CPU and the
//!    writes it made on the way are reported.
//! 4. The same for a restarted agent of node `sn0000` (its `per_node` claims, and as
//!    the plugin's controller node, every volume), with the CSI calls it made.
//! 5. `moord console` on all of it: until listed, its memory, its time per page.
//!
//! # Layout
//! - this file: steps 1, 3 and 4, and the figures.
//! - `seed`: step 2, the templates written again under new names, and checked.
//! - `console`: step 5.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures::{stream, StreamExt, TryStreamExt};
use moor::api::*;
use moor::store::Store;
use serde::Serialize;
use tokio::process::Command;

use crate::cluster::{self, free_port, http_get, Bins, Proc};

mod console;
mod seed;

use crate::phases;
use seed::{check_seeded, create_real, read_templates, seed};

/// What the scale phase measured.
#[derive(Debug, Serialize, Default)]
pub struct ScaleRun {
    /// Volumes, allocations and claims stored.
    pub claims: usize,
    /// Simulated nodes (two run a real agent).
    pub nodes: usize,
    /// Claims on each real agent's node.
    pub agent_claims: usize,
    /// Keys written by the seeding, and how fast.
    pub seeded_keys: usize,
    pub seed_keys_per_s: f64,
    /// One typed list of every claim, as a client would do it.
    pub list_claims_s: f64,
    /// Bytes etcd stores for one claim's objects as the system wrote them (claim 0's
    /// Volume, Allocation, Claim, Mount and any Attachment; values only), by kind
    /// directory and in all: what etcd's space quota is spent on per claim.
    pub stored_bytes_by_kind: BTreeMap<String, usize>,
    pub stored_bytes_per_set: usize,
    pub controller: Synced,
    /// The agent of `sn0000`, which also runs the plugin's controller side (so it
    /// caches every volume and attachment).
    pub controller_agent: Synced,
    /// The node-only agent of `sn0001` with every claim stored.
    pub node_agent: Synced,
    /// The node-only agent restarted at each size of the cluster (claims stored): it
    /// reads only its own node's claims and mounts, so these should be flat.
    pub node_agent_by_cluster_claims: BTreeMap<usize, Synced>,
    /// The web console on all of it (none from a build without `moord console`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub console: Option<console::ConsoleRun>,
}

/// One process from start until synced.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Synced {
    /// From start until the listed kinds' caches are filled and no change is due
    /// (`moor_queue_change_wait_seconds` 0 in two scrapes 100 ms apart): only
    /// repair-pass keys and later requeues wait (for a controller that trusts
    /// converged status, when it serves new changes at once). Taken
    /// only where the run names the kinds to wait for; else the same as `synced_s`.
    pub serving_s: f64,
    /// RSS then.
    pub serving_rss_mib: f64,
    /// From start until every object was reconciled and every queue is empty.
    pub synced_s: f64,
    pub rss_mib: f64,
    pub peak_rss_mib: f64,
    pub cpu_s: f64,
    /// Successful reconciles per controller when synced.
    pub reconciles: BTreeMap<String, u64>,
    /// CPU seconds the store used meanwhile.
    pub store_cpu_s: f64,
    /// Store revisions written between its start and synced.
    pub writes: i64,
    /// CSI calls made between its start and synced (agents only).
    pub csi_calls: usize,
}

impl Synced {
    /// `12.3 s, RSS 456 MiB (peak 500), CPU 20.1 s`.
    pub fn cell(&self) -> String {
        format!(
            "{:.1} s, RSS {:.0} MiB (peak {:.0}), CPU {:.1} s (store {:.1} s)",
            self.synced_s, self.rss_mib, self.peak_rss_mib, self.cpu_s, self.store_cpu_s
        )
    }

    /// `1.9 s, RSS 400 MiB`.
    pub fn serving_cell(&self) -> String {
        format!(
            "{:.1} s, RSS {:.0} MiB",
            self.serving_s, self.serving_rss_mib
        )
    }
}

/// Node names of the scale cluster: `sn0000` runs the real agent.
fn node_name(i: usize) -> String {
    format!("sn{i:04}")
}
fn volume_name(i: usize) -> String {
    format!("sv{i:06}")
}
fn allocation_name(i: usize) -> String {
    format!("sa-{i:06}")
}

/// Runs the scale phase on a fresh store of `backend` in `dir`.
pub async fn run(
    bins: &Bins,
    backend: cluster::Backend,
    dir: &Path,
    claims: usize,
    per_node: usize,
) -> anyhow::Result<ScaleRun> {
    let per_node = per_node.clamp(1, claims.max(1));
    // Two real nodes: sn0000 (monolith: its agent also leads the plugin's controller
    // side) and sn0001 (node only).
    let claims = claims.max(2 * per_node);
    let nodes = claims.div_ceil(per_node);
    let srv = cluster::start_store(backend, bins, dir).await?;
    let store = Store::connect(std::slice::from_ref(&srv.url), moor::store::DEFAULT_PREFIX).await?;
    let sys = System::new(bins, &srv.url, dir)?;
    let mut controller = sys.controller(None)?;
    let mut agents = [sys.agent(0, None)?, sys.agent(1, None)?];
    sys.wait_nodes(&store).await?;

    // 1. The real part.
    crate::step(&format!(
        "scale: {per_node} real claims on each of {} and {}",
        node_name(0),
        node_name(1)
    ));
    let long = Duration::from_secs(600);
    create_real(&store, per_node, long).await?;
    controller.terminate().await;

    // 2. The template and the copies, in two steps: the node-only agent is restarted
    // at 10,000 claims stored and again at the end.
    let templates = read_templates(&store).await?;
    let stored_bytes_by_kind = templates.bytes_by_kind();
    let node_lease = store.grant_lease(Duration::from_secs(60)).await?;
    let keeper = {
        let mut keep = store.keep_alive(node_lease).await?;
        tokio::spawn(async move {
            while keep.renew().await.is_ok() {
                tokio::time::sleep(Duration::from_secs(10)).await;
            }
        })
    };
    let checkpoint = claims.min(10_000).max(2 * per_node);
    let mut node_agent_by_cluster_claims = BTreeMap::new();
    let mut seeded = 0;
    let mut seeding_s = 0.0;
    let mut from = 2 * per_node;
    for upto in [checkpoint, claims] {
        if upto > from {
            crate::step(&format!(
                "scale: seeding volumes and claims {from}..{upto} on {} nodes",
                upto.div_ceil(per_node)
            ));
            let t = Instant::now();
            seeded += seed(&store, &templates, from..upto, per_node, node_lease).await?;
            seeding_s += t.elapsed().as_secs_f64();
            from = upto;
        }
        if upto == checkpoint && upto < claims {
            crate::step(&format!(
                "scale: node-only agent of {} restart with {upto} claims stored",
                node_name(1)
            ));
            let synced = sys
                .restart_node_agent(&srv, &store, &mut agents[1], per_node, long)
                .await?;
            node_agent_by_cluster_claims.insert(upto, synced);
        }
    }
    let seed_keys_per_s = seeded as f64 / seeding_s.max(1e-9);
    let t = Instant::now();
    let listed = store.list::<ClaimSpec>(&moor::api::KeyScope::all()).await?;
    let list_claims_s = t.elapsed().as_secs_f64();
    // Not kept: a million decoded claims would sit beside the controller measured next.
    drop(listed);
    check_seeded(&store, claims).await?;

    // 3. A controller starting on all of it.
    crate::step("scale: controller start until synced");
    let want = [
        ("claims", claims as u64),
        ("allocations", claims as u64),
        ("volumes", claims as u64),
    ];
    let port = free_port();
    let rev = phases::revision(&store).await?;
    let started = Instant::now();
    let mut controller = sys.controller(Some(port))?;
    let store_cpu = srv.proc.cpu_seconds();
    let listed = ["Claim", "Allocation", "Volume"];
    let mut ctrl = wait_synced(&controller, port, &want, &listed, started, long).await?;
    ctrl.writes = phases::revision(&store).await? - rev;
    ctrl.store_cpu_s = srv.proc.cpu_seconds() - store_cpu;

    // 4. The agents, restarted: the node-only one, then the plugin's controller node.
    crate::step(&format!(
        "scale: node-only agent of {} restart until synced",
        node_name(1)
    ));
    let node_agent = sys
        .restart_node_agent(&srv, &store, &mut agents[1], per_node, long)
        .await?;
    node_agent_by_cluster_claims.insert(claims, node_agent.clone());
    crate::step(&format!(
        "scale: agent of {} (plugin controller) restart until synced",
        node_name(0)
    ));
    let want = [("node", per_node as u64), ("provisioner", claims as u64)];
    let controller_agent = sys
        .restart_agent(&srv, &store, &mut agents[0], 0, &want, long)
        .await?;

    // 5. The console, with the system running beside it.
    crate::step("scale: console start until listed, then its pages");
    let console = console::measure(&sys.bins, &sys.url, dir, claims, long).await?;

    keeper.abort();
    controller.terminate().await;
    drop(agents);
    Ok(ScaleRun {
        claims,
        nodes,
        agent_claims: per_node,
        seeded_keys: seeded,
        seed_keys_per_s,
        list_claims_s,
        stored_bytes_per_set: stored_bytes_by_kind.values().sum(),
        stored_bytes_by_kind,
        controller: ctrl,
        controller_agent,
        node_agent,
        node_agent_by_cluster_claims,
        console,
    })
}

/// The processes of the scale cluster: the plugins of the two real nodes.
struct System {
    bins: Bins,
    url: String,
    dir: std::path::PathBuf,
    _plugins: Vec<Proc>,
}

/// The real nodes' plugin types: sn0000 serves the controller side too.
const REAL_NODES: [&str; 2] = ["monolith", "node"];

impl System {
    fn new(bins: &Bins, url: &str, dir: &Path) -> anyhow::Result<System> {
        let mut plugins = Vec::new();
        for (i, mode) in REAL_NODES.iter().enumerate() {
            let ndir = dir.join(node_name(i));
            std::fs::create_dir_all(&ndir)?;
            plugins.push(Proc::spawn(
                &format!("plugin {}", node_name(i)),
                Command::new(bins.dir.join("moor-hostpath"))
                    .arg("--endpoint")
                    .arg(format!("unix://{}", ndir.join("csi.sock").display()))
                    .args(["--node-id", &node_name(i), "--mode", mode, "--no-mount"])
                    .args(["--publish-unpublish", "false"])
                    .arg("--state-dir")
                    .arg(ndir.join("plugin")),
                &ndir.join("plugin.log"),
            )?);
        }
        Ok(System {
            bins: bins.clone(),
            url: url.to_string(),
            dir: dir.to_path_buf(),
            _plugins: plugins,
        })
    }

    fn call_log(&self, node: usize) -> std::path::PathBuf {
        self.dir.join(node_name(node)).join("plugin/calls.jsonl")
    }

    fn controller(&self, http: Option<u16>) -> anyhow::Result<Proc> {
        let mut cmd = Command::new(self.bins.dir.join("moord"));
        cmd.args(["controller", "--etcd", &self.url, "--identity", "scale"]);
        if let Some(port) = http {
            cmd.arg("--http").arg(format!("127.0.0.1:{port}"));
        }
        let log = self
            .dir
            .join(format!("controller-{}.log", http.unwrap_or(0)));
        Proc::spawn("controller", &mut cmd, &log)
    }

    /// The agent of real node `node` (0 or 1).
    fn agent(&self, node: usize, http: Option<u16>) -> anyhow::Result<Proc> {
        let ndir = self.dir.join(node_name(node));
        let mut cmd = Command::new(self.bins.dir.join("moord"));
        cmd.args(["agent", "--node", &node_name(node), "--etcd", &self.url])
            .arg("--data-dir")
            .arg(ndir.join("agent"))
            .arg("--plugin")
            .arg(format!(
                "id={},type={},endpoint=unix://{},mount-dir={}",
                cluster::PLUGIN_ID,
                REAL_NODES[node],
                ndir.join("csi.sock").display(),
                ndir.join("mnt").display()
            ))
            // The seeded volumes' ids are made up: the plugin's survey would flag each
            // as missing from it. What is measured here is syncing, not the survey.
            .arg("--survey-interval=1h");
        if let Some(port) = http {
            cmd.arg("--http").arg(format!("127.0.0.1:{port}"));
        }
        let log = ndir.join(format!("agent-{}.log", http.unwrap_or(0)));
        Proc::spawn(&format!("agent {}", node_name(node)), &mut cmd, &log)
    }

    /// Stops `agent` (of real node `node`) and starts it again with /metrics, until
    /// synced: its time, memory, CPU, and the writes and CSI calls it made meanwhile.
    async fn restart_agent(
        &self,
        srv: &cluster::StoreProc,
        store: &Store,
        agent: &mut Proc,
        node: usize,
        want: &[(&str, u64)],
        long: Duration,
    ) -> anyhow::Result<Synced> {
        agent.terminate().await;
        let calls_before = count_lines(&self.call_log(node));
        let port = free_port();
        let rev = phases::revision(store).await?;
        let started = Instant::now();
        *agent = self.agent(node, Some(port))?;
        let store_cpu = srv.proc.cpu_seconds();
        let mut synced = wait_synced(agent, port, want, &[], started, long).await?;
        synced.writes = phases::revision(store).await? - rev;
        synced.store_cpu_s = srv.proc.cpu_seconds() - store_cpu;
        synced.csi_calls = count_lines(&self.call_log(node)).saturating_sub(calls_before);
        Ok(synced)
    }

    /// [`System::restart_agent`] for the node-only agent (`sn0001`, `per_node` claims).
    async fn restart_node_agent(
        &self,
        srv: &cluster::StoreProc,
        store: &Store,
        agent: &mut Proc,
        per_node: usize,
        long: Duration,
    ) -> anyhow::Result<Synced> {
        let want = [("node", per_node as u64)];
        self.restart_agent(srv, store, agent, 1, &want, long).await
    }

    /// Until both real nodes run the plugin's node side.
    async fn wait_nodes(&self, store: &Store) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let healthy = matches!(
                store.try_get(&Plugin::key_for(&PluginId::new(cluster::PLUGIN_ID)?)).await,
                Ok(Some(p)) if p.status.nodes_healthy as usize >= REAL_NODES.len()
            );
            if healthy {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "the scale cluster's plugin was not healthy on both real nodes within 120 s; logs in {}",
                    self.dir.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Polls `port`'s /metrics until every controller in `want` has reconciled at least
/// that many times and every queue is empty on two polls in a row.
async fn wait_synced(
    proc: &Proc,
    port: u16,
    want: &[(&str, u64)],
    listed: &[&str],
    started: Instant,
    timeout: Duration,
) -> anyhow::Result<Synced> {
    let mut first_empty: Option<(Instant, BTreeMap<String, u64>)> = None;
    let mut first_serving: Option<Instant> = None;
    let mut serving: Option<(f64, f64)> = None;
    loop {
        if started.elapsed() > timeout {
            bail!("not synced within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let Ok(text) = http_get(port, "/metrics").await else {
            continue;
        };
        let m = parse_metrics(&text);
        if serving.is_none() && !listed.is_empty() {
            let filled = listed.iter().all(|k| m.listed.get(*k) == Some(&1));
            let changes_done = m.change_wait.values().all(|w| *w == 0.0);
            match (filled && changes_done, first_serving) {
                (false, _) => first_serving = None,
                (true, None) => first_serving = Some(Instant::now()),
                (true, Some(at)) => {
                    serving = Some(((at - started).as_secs_f64(), proc.memory_mib().0));
                }
            }
        }
        let enough = want
            .iter()
            .all(|(c, n)| m.reconciles.get(*c).copied().unwrap_or(0) >= *n);
        let empty = m.depth.values().all(|d| *d == 0);
        if !(enough && empty) {
            first_empty = None;
            continue;
        }
        match first_empty.take() {
            None => first_empty = Some((Instant::now(), m.reconciles)),
            Some((at, reconciles)) => {
                let (rss, peak) = proc.memory_mib();
                let synced_s = (at - started).as_secs_f64();
                let (serving_s, serving_rss_mib) = serving.unwrap_or((synced_s, rss));
                return Ok(Synced {
                    serving_s,
                    serving_rss_mib,
                    synced_s,
                    rss_mib: rss,
                    peak_rss_mib: peak,
                    cpu_s: proc.cpu_seconds(),
                    reconciles,
                    ..Default::default()
                });
            }
        }
    }
}

/// What the scale phase reads of a process's /metrics.
#[derive(Debug, Default)]
struct Scraped {
    /// Successful reconciles (`moor_reconciles_total` less
    /// `moor_reconcile_failures_total`), per controller.
    reconciles: BTreeMap<String, u64>,
    /// `moor_queue_depth` and `moor_queue_repairs`, per controller.
    depth: BTreeMap<String, i64>,
    repairs: BTreeMap<String, i64>,
    /// `moor_queue_change_wait_seconds`, per controller.
    change_wait: BTreeMap<String, f64>,
    /// `moor_cache_listed`, per kind.
    listed: BTreeMap<String, i64>,
}

fn parse_metrics(text: &str) -> Scraped {
    let mut m = Scraped::default();
    let mut failures = BTreeMap::new();
    for line in text.lines() {
        let Some((name_labels, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Some((name, labels)) = name_labels.split_once('{') else {
            continue;
        };
        let label = |l: &str| {
            labels
                .split(&format!("{l}=\""))
                .nth(1)
                .and_then(|s| s.split('"').next())
                .map(str::to_string)
        };
        let Ok(v) = value.parse::<f64>() else {
            continue;
        };
        let (table, key) = match name {
            "moor_reconciles_total" => (&mut m.reconciles, label("controller")),
            "moor_reconcile_failures_total" => (&mut failures, label("controller")),
            "moor_queue_depth" => {
                if let Some(c) = label("controller") {
                    m.depth.insert(c, v as i64);
                }
                continue;
            }
            "moor_queue_repairs" => {
                if let Some(c) = label("controller") {
                    m.repairs.insert(c, v as i64);
                }
                continue;
            }
            "moor_queue_change_wait_seconds" => {
                if let Some(c) = label("controller") {
                    m.change_wait.insert(c, v);
                }
                continue;
            }
            "moor_cache_listed" => {
                if let Some(k) = label("kind") {
                    m.listed.insert(k, v as i64);
                }
                continue;
            }
            _ => continue,
        };
        if let Some(key) = key {
            table.insert(key, v as u64);
        }
    }
    for (controller, failed) in failures {
        if let Some(r) = m.reconciles.get_mut(&controller) {
            *r = r.saturating_sub(failed);
        }
    }
    m
}

fn count_lines(path: &Path) -> usize {
    std::fs::read_to_string(path)
        .map(|t| t.lines().count())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_read_per_controller() {
        let text = "# HELP moor_reconciles Reconciles run\n\
            moor_reconciles_total{controller=\"claims\"} 1200\n\
            moor_reconcile_failures_total{controller=\"claims\"} 200\n\
            moor_queue_depth{controller=\"claims\"} 3\n\
            moor_queue_repairs{controller=\"claims\"} 2\n\
            moor_cache_listed{kind=\"Claim\"} 1\n\
            moor_queue_change_wait_seconds{controller=\"claims\"} 0.25\n\
            moor_reconcile_duration_seconds_bucket{controller=\"claims\",le=\"0.001\"} 5\n";
        let m = parse_metrics(text);
        assert_eq!(m.reconciles.get("claims"), Some(&1000));
        assert_eq!(m.depth.get("claims"), Some(&3));
        assert_eq!(m.repairs.get("claims"), Some(&2));
        assert_eq!(m.listed.get("Claim"), Some(&1));
        assert_eq!(m.change_wait.get("claims"), Some(&0.25));
        assert_eq!(m.reconciles.len(), 1);
    }
}
