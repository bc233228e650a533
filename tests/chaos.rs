//! The randomized fault suite (issue 11): a whole cluster of real processes (etcd, two
//! `moord controller` replicas, three nodes each with a `moord agent` and a strict
//! moor-hostpath) driven by a seeded random script of what operators and failures do:
//! volumes created and deleted, allocations started, stopped, deleted and re-run
//! (shared readers and contended single-node writers among them), every process
//! killed with SIGKILL and restarted (etcd included), nodes lost past
//! `--node-gc-timeout` or force-detached while down, and faults on every RPC: failures
//! of every class, and hangs before and after the operation took effect. Beside the
//! kills, faults that are not crashes (issue 42): a controller or agent cut off from
//! etcd by its fault proxy (shorter than the node TTL, past it, or past the TTL and
//! the GC timeout), a controller, agent or plugin paused with SIGSTOP for as long, etcd
//! itself paused (a stall), and an agent's data disk (a tmpfs of its own) full for a
//! while. Each is undone at its time on a thread of its own, whatever the script is
//! waiting on. The run's last line counts each kind.
//!
//! At the end every fault is lifted and every process runs again; every allocation is
//! stopped and must see its claims Released; then everything is deleted and must be
//! gone. The plugins' call logs are then checked: the checker's invariants (no
//! NodeStage before ControllerPublish, no reverse step out of order, nothing left
//! attached, staged, published or created, no second target path on a node under a
//! mode that does not share one, no NodeExpand where the node holds nothing, no call
//! of a term after a later term of its role acted), and each failing (call, object) within the retry
//! schedule's bound. Even seeds run plugins that advertise SINGLE_NODE_MULTI_WRITER,
//! odd seeds plugins that do not.
//!
//! A run prints its seed at its start (uncaptured, so also when it passes);
//! `MOOR_CHAOS_SEED=N cargo test --test chaos` replays it (the
//! same script; the processes' timing still varies). `MOOR_CHAOS_OPS=N` sets the
//! script's length (default 200). Without a seed the suite makes a new one, except
//! under CI, which runs the fixed [`CI_SEEDS`]. docs/benchmarks.md records long runs.

#[path = "common/cluster.rs"]
mod cluster;
mod common;

use cluster::{Cluster, PluginOpts};
use moor::api::*;
use moor::runtime::steps::Schedule;
use moor::store::StoreError;
use moor_hostpath::calllog::Call;
use moor_hostpath::checker::{self, CheckConfig};
use moor_hostpath::faults::{self, Command};
use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime};

/// The agents' retry schedule in this suite: short, so that a run drains in seconds.
const RETRY_INITIAL: Duration = Duration::from_millis(200);
const RETRY_CAP: Duration = Duration::from_secs(2);
/// Calls per attempt (the harness runs agents with `--csi-tries=2`).
const TRIES: u32 = 2;
/// The harness's `--node-ttl`, and this suite's `--node-gc-timeout`.
const NODE_TTL: Duration = Duration::from_secs(3);
const NODE_GC: Duration = Duration::from_secs(3);
const NODES: usize = 3;
const CONTROLLERS: usize = 2;
/// How long the end state may take to converge.
const DRAIN: Duration = Duration::from_secs(180);

fn schedule() -> Schedule {
    Schedule {
        initial: RETRY_INITIAL,
        cap: RETRY_CAP,
        jitter: true,
    }
}

const NODE_RPCS: [&str; 4] = [
    "NodeStageVolume",
    "NodeUnstageVolume",
    "NodePublishVolume",
    "NodeUnpublishVolume",
];
const CONTROLLER_RPCS: [&str; 4] = [
    "CreateVolume",
    "DeleteVolume",
    "ControllerPublishVolume",
    "ControllerUnpublishVolume",
];
const RETRYABLE: [&str; 4] = ["Unavailable", "Aborted", "Internal", "ResourceExhausted"];
/// Final answers a plugin may give to a step that can succeed later. NotFound is left
/// out: for a reverse step it means "already done", and a plugin that says so falsely
/// lies (moor believes it, by the spec).
const FINAL: [&str; 2] = ["InvalidArgument", "FailedPrecondition"];
const FORWARD: [&str; 3] = [
    "NodeStageVolume",
    "NodePublishVolume",
    "ControllerPublishVolume",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Process {
    Controller(usize),
    Agent(usize),
    Plugin(usize),
}

struct Vol {
    /// The name CreateVolume is called with ([`plugin_name_of`]).
    plugin_name: String,
    mode: AccessMode,
    deleted: bool,
}

struct Alloc {
    node: usize,
    volume: String,
    stopped: bool,
    deleted: bool,
}

/// Something the script undoes later: a fault lifted, a process started again.
/// (Partitions, pauses and full disks are undone on a thread of their own at their
/// time: see [`Chaos::later`].)
#[derive(Debug)]
enum Lift {
    Fault(usize, Command),
    Restart(Process),
}

/// A [`Lift`] and the op index it is due at.
type Due = (usize, Lift);

struct Chaos {
    rng: fastrand::Rng,
    c: Cluster,
    volumes: BTreeMap<String, Vol>,
    allocs: BTreeMap<String, Alloc>,
    next: u32,
    /// Processes down, since when.
    down: BTreeMap<Process, SystemTime>,
    /// Moor node names declared gone (force-detached, or collected), and when: each
    /// declaration excuses only what the node held before it (see the checker).
    forced: BTreeMap<String, Vec<SystemTime>>,
    /// Names of the volumes the script created through CSI itself and registered.
    registered: Vec<(String, AccessMode)>,
    /// Restarts of each node's agent or plugin.
    restarts: BTreeMap<usize, u32>,
    /// Each node's agent: when it was last restarted, and since when its Node has been
    /// silent. An agent killed again before it can have renewed its Node (within
    /// NODE_TTL of its restart) leaves the silence running from the earlier kill: the
    /// controller collects a node by how long its Node went unrenewed, not by how long
    /// each down period lasted (seed 2029: two kills 4.3 s and 3.9 s apart, 1.7 s of
    /// life between them, collected after 6.2 s of silence).
    agent_up: BTreeMap<usize, SystemTime>,
    silent_since: BTreeMap<usize, SystemTime>,
    /// Each agent's silences (it could not renew its Node): down, cut off or paused,
    /// from and to. Silences that follow each other closely add up (see
    /// [`Chaos::declarations_of_silences`]).
    silences: Vec<(usize, SystemTime, SystemTime)>,
    /// When each node's data disk was full (from, to).
    full_disks: Vec<(usize, SystemTime, SystemTime)>,
    /// (volume, node) → how many allocation runs asked for it there.
    runs_on: BTreeMap<(String, usize), u32>,
    due: Vec<Due>,
    /// Lifts due at a time rather than an op (partitions, pauses, full disks: their
    /// length is what matters, against the TTLs), each on its own thread: the script
    /// may be waiting on the very process paused, or on etcd.
    lifts: Vec<std::thread::JoinHandle<()>>,
    /// Processes paused (SIGSTOP), and until when; etcd's pause.
    paused: BTreeMap<Process, Instant>,
    etcd_paused: Option<Instant>,
    script: Vec<String>,
}

fn node_name(i: usize) -> String {
    format!("n{}", i + 1)
}

/// Sends `signal` (`-STOP`, `-CONT`) to `pid`.
fn signal(pid: u32, signal: &str) {
    let _ = std::process::Command::new("kill")
        .args([signal, &pid.to_string()])
        .status();
}

/// The name of a moor process's proxy to etcd.
fn proxy_name(p: Process) -> String {
    match p {
        Process::Controller(i) => format!("controller-{i}"),
        Process::Agent(i) => format!("agent-{}", node_name(i)),
        Process::Plugin(i) => format!("plugin-{}", node_name(i)),
    }
}

impl Chaos {
    fn log(&mut self, line: String) {
        eprintln!("chaos[{}] {line}", self.script.len());
        self.script.push(line);
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        if items.is_empty() {
            None
        } else {
            Some(&items[self.rng.usize(..items.len())])
        }
    }

    fn live_volumes(&self) -> Vec<String> {
        self.volumes
            .iter()
            .filter(|(_, v)| !v.deleted)
            .map(|(n, _)| n.clone())
            .collect()
    }

    fn allocs_where(&self, f: impl Fn(&Alloc) -> bool) -> Vec<String> {
        self.allocs
            .iter()
            .filter(|(_, a)| !a.deleted && f(a))
            .map(|(n, _)| n.clone())
            .collect()
    }

    fn is_down(&self, p: Process) -> bool {
        self.down.contains_key(&p)
    }

    /// One random step of the script.
    async fn step(&mut self, i: usize) {
        let weights: [(u32, u8); 23] = [
            (if self.live_volumes().len() < 6 { 3 } else { 0 }, 0),
            (1, 1),
            (6, 2),
            (3, 3),
            (1, 4),
            (1, 5),
            (5, 6),
            (2, 7),
            (1, 8),
            (2, 9),
            (0, 10),
            (1, 11),
            (2, 12),
            (if self.live_volumes().len() < 6 { 1 } else { 0 }, 13),
            (1, 14),
            (1, 15),
            (1, 16),
            (1, 17),
            (2, 18),
            (2, 19),
            (2, 20),
            (1, 21),
            (1, 22),
        ];
        let total: u32 = weights.iter().map(|w| w.0).sum();
        let mut roll = self.rng.u32(..total);
        let mut op = 12;
        for (w, o) in weights {
            if roll < w {
                op = o;
                break;
            }
            roll -= w;
        }
        match op {
            0 => self.create_volume().await,
            1 => self.delete_volume().await,
            2 => self.start_alloc().await,
            3 => self.stop_alloc().await,
            4 => self.delete_alloc().await,
            5 => self.rerun_alloc().await,
            6 => self.fail(i, false).await,
            7 => self.fail(i, true).await,
            8 => self.hang(i).await,
            9 => self.kill(i).await,
            11 => self.detach_or_lose_node(i).await,
            13 => self.register_volume().await,
            14 => self.second_claim_then_lose_node(i).await,
            15 => self.claim_on_a_down_node().await,
            16 => self.detach_racing_return().await,
            17 => self.rerun_on_a_collected_node().await,
            18 => self.start_templated_alloc().await,
            19 => self.partition(),
            20 => self.pause(),
            21 => self.fill_disk(),
            22 => self.pause_plugin(),
            _ => {
                let ms = self.rng.u64(0..1500);
                self.log(format!("pause {ms} ms"));
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
        }
    }

    async fn create_volume(&mut self) {
        self.next += 1;
        let name = format!("v{}", self.next);
        let mode = match self.rng.u32(0..5) {
            0 => AccessMode::MultiNodeReaderOnly,
            1 => AccessMode::MultiNodeMultiWriter,
            _ => AccessMode::SingleNodeWriter,
        };
        self.log(format!("create volume {name} {mode:?}"));
        let vol = self.c.volume(&name, mode);
        let created = retry(&format!("create volume {name}"), || {
            self.c.store.create(&vol)
        })
        .await;
        self.volumes.insert(
            name,
            Vol {
                plugin_name: plugin_name_of(&created),
                mode,
                deleted: false,
            },
        );
    }

    async fn delete_volume(&mut self) {
        let live = self.live_volumes();
        let Some(name) = self.pick(&live).cloned() else {
            return;
        };
        self.log(format!("delete volume {name}"));
        delete(&self.c, &Volume::key_for(&Namespace::default_ns(), &name)).await;
        if let Some(v) = self.volumes.get_mut(&name) {
            v.deleted = true;
        }
    }

    async fn start_alloc(&mut self) {
        let live = self.live_volumes();
        let Some(volume) = self.pick(&live).cloned() else {
            return;
        };
        let mode = self.volumes[&volume].mode;
        let node = self.rng.usize(0..NODES);
        let read_only = mode == AccessMode::MultiNodeReaderOnly || self.rng.u32(0..4) == 0;
        self.start_on(node, volume, read_only).await;
    }

    /// Starts allocation NAME on `node` with `volume`.
    async fn start_on(&mut self, node: usize, volume: String, read_only: bool) -> String {
        self.next += 1;
        let name = format!("a{}", self.next);
        self.log(format!(
            "start allocation {name} on {} with {volume}{}",
            node_name(node),
            if read_only { " read-only" } else { "" }
        ));
        let a = self
            .c
            .allocation(&name, &node_name(node), &volume, read_only);
        retry(&format!("create allocation {name}"), || {
            self.c.store.create(&a)
        })
        .await;
        *self.runs_on.entry((volume.clone(), node)).or_default() += 1;
        self.allocs.insert(
            name.clone(),
            Alloc {
                node,
                volume,
                stopped: false,
                deleted: false,
            },
        );
        name
    }

    /// An allocation whose volume is made for it from a template (issue 41): ephemeral
    /// (deleted once the allocation ends) or retained (kept; the drain deletes it).
    async fn start_templated_alloc(&mut self) {
        self.next += 1;
        let name = format!("t{}", self.next);
        let node = self.rng.usize(0..NODES);
        let lifecycle = if self.rng.u32(0..3) == 0 {
            VolumeLifecycle::Retain
        } else {
            VolumeLifecycle::Ephemeral
        };
        self.log(format!(
            "start allocation {name} on {} with a {lifecycle} template",
            node_name(node)
        ));
        let mut a = self.c.allocation(&name, &node_name(node), "unused", false);
        a.spec.volumes[0].volume = VolumeId::default();
        a.spec.volumes[0].template = Some(Box::new(VolumeTemplate {
            plugin_id: PluginId::new(cluster::PLUGIN).unwrap(),
            capacity_min: Some(Size(1 << 20)),
            lifecycle,
            ..Default::default()
        }));
        retry(&format!("create allocation {name}"), || {
            self.c.store.create(&a)
        })
        .await;
        self.allocs.insert(
            name.clone(),
            Alloc {
                node,
                volume: format!("{name}.data"),
                stopped: false,
                deleted: false,
            },
        );
    }

    /// What found issue 24: a second claim admitted on a node where a running
    /// allocation already holds the volume, then the node is lost (often past the GC
    /// timeout) before the new claim is staged.
    async fn second_claim_then_lose_node(&mut self, i: usize) {
        let held: Vec<(usize, String)> = self
            .allocs
            .values()
            .filter(|a| !a.deleted && !a.stopped)
            .filter(|a| !self.is_down(Process::Agent(a.node)))
            .filter(|a| self.volumes.get(&a.volume).is_some_and(|v| !v.deleted))
            .map(|a| (a.node, a.volume.clone()))
            .collect();
        let Some((node, volume)) = self.pick(&held).cloned() else {
            return;
        };
        self.log(format!(
            "second claim of {volume} on {}, then lose the node",
            node_name(node)
        ));
        self.start_on(node, volume, true).await;
        let ms = self.rng.u64(0..300);
        tokio::time::sleep(Duration::from_millis(ms)).await;
        self.lose_node(i, node);
    }

    /// An allocation started on a node whose agent is down.
    async fn claim_on_a_down_node(&mut self) {
        let down: Vec<usize> = (0..NODES)
            .filter(|n| self.is_down(Process::Agent(*n)))
            .collect();
        let live = self.live_volumes();
        let (Some(node), Some(volume)) = (self.pick(&down).copied(), self.pick(&live).cloned())
        else {
            return;
        };
        let read_only =
            self.volumes[&volume].mode == AccessMode::MultiNodeReaderOnly || self.rng.bool();
        self.log(format!("claim on down node {}", node_name(node)));
        self.start_on(node, volume, read_only).await;
    }

    /// An operator's force-detach of a down node's volume just as the node comes back.
    async fn detach_racing_return(&mut self) {
        let down: Vec<usize> = (0..NODES)
            .filter(|n| self.is_down(Process::Agent(*n)))
            .collect();
        let Some(node) = self.pick(&down).copied() else {
            return;
        };
        self.log(format!(
            "force-detach racing the return of {}",
            node_name(node)
        ));
        self.detach(node).await;
        let ms = self.rng.u64(0..200);
        tokio::time::sleep(Duration::from_millis(ms)).await;
        for p in [Process::Plugin(node), Process::Agent(node)] {
            self.restart(p).await;
        }
    }

    /// A stopped allocation set to run again on a node that was declared gone.
    async fn rerun_on_a_collected_node(&mut self) {
        let collected = self.allocs_where(|a| a.stopped);
        let collected: Vec<String> = collected
            .into_iter()
            .filter(|n| self.forced.contains_key(&node_name(self.allocs[n].node)))
            .collect();
        let Some(name) = self.pick(&collected).cloned() else {
            return;
        };
        self.log(format!("re-run allocation {name} on a collected node"));
        self.set_desired(&name, DesiredStatus::Run).await;
        if let Some(a) = self.allocs.get_mut(&name) {
            a.stopped = false;
            *self.runs_on.entry((a.volume.clone(), a.node)).or_default() += 1;
        }
    }

    async fn set_desired(&mut self, name: &str, status: DesiredStatus) {
        let key = Allocation::key_for(&Namespace::default_ns(), name);
        retry(&format!("set {name} to {status:?}"), || {
            self.c.store.modify_spec(&key, |s: &mut AllocationSpec| {
                s.desired_status = status;
                true
            })
        })
        .await;
    }

    async fn stop_alloc(&mut self) {
        let running = self.allocs_where(|a| !a.stopped);
        let Some(name) = self.pick(&running).cloned() else {
            return;
        };
        self.log(format!("stop allocation {name}"));
        self.set_desired(&name, DesiredStatus::Stop).await;
        if let Some(a) = self.allocs.get_mut(&name) {
            a.stopped = true;
        }
    }

    async fn rerun_alloc(&mut self) {
        let stopped = self.allocs_where(|a| a.stopped);
        let Some(name) = self.pick(&stopped).cloned() else {
            return;
        };
        self.log(format!("re-run allocation {name}"));
        self.set_desired(&name, DesiredStatus::Run).await;
        if let Some(a) = self.allocs.get_mut(&name) {
            a.stopped = false;
            *self.runs_on.entry((a.volume.clone(), a.node)).or_default() += 1;
        }
    }

    async fn delete_alloc(&mut self) {
        let all = self.allocs_where(|_| true);
        let Some(name) = self.pick(&all).cloned() else {
            return;
        };
        self.log(format!("delete allocation {name}"));
        delete(
            &self.c,
            &Allocation::key_for(&Namespace::default_ns(), &name),
        )
        .await;
        if let Some(a) = self.allocs.get_mut(&name) {
            a.deleted = true;
        }
    }

    /// A node whose plugin runs, and an RPC it serves.
    fn fault_target(&mut self) -> Option<(usize, &'static str)> {
        let up: Vec<usize> = (0..NODES)
            .filter(|n| !self.is_down(Process::Plugin(*n)))
            .collect();
        let busy: Vec<usize> = up
            .iter()
            .copied()
            .filter(|n| self.allocs.values().any(|a| !a.deleted && a.node == *n))
            .collect();
        let node = if !busy.is_empty() && self.rng.u32(0..4) != 0 {
            *self.pick(&busy)?
        } else {
            *self.pick(&up)?
        };
        let rpc = if node == 0 && self.rng.bool() {
            *self.pick(&CONTROLLER_RPCS)?
        } else {
            *self.pick(&NODE_RPCS)?
        };
        Some((node, rpc))
    }

    async fn fail(&mut self, i: usize, persistent: bool) {
        let Some((node, rpc)) = self.fault_target() else {
            return;
        };
        let class = self.rng.u32(0..6);
        let code = match class {
            // An uncertain answer: the call may have taken effect.
            0 => "DeadlineExceeded",
            // A final answer to a create is a refusal for good (the volume fails);
            // retryable ones only, so that every volume exists by the end.
            1 if rpc != "CreateVolume" => *self.pick(&FINAL).unwrap_or(&"InvalidArgument"),
            // NotFound is final for a forward step (for a reverse one it means done).
            2 if FORWARD.contains(&rpc) => "NotFound",
            _ => *self.pick(&RETRYABLE).unwrap_or(&"Unavailable"),
        };
        let times = if persistent {
            100_000
        } else {
            self.rng.u32(1..5)
        };
        self.log(format!(
            "fail {rpc} on {} with {code} x{}",
            node_name(node),
            if persistent {
                "until cleared".to_string()
            } else {
                times.to_string()
            }
        ));
        self.send(
            node,
            Command::Fail {
                rpc: rpc.into(),
                code: code.into(),
                times,
            },
        )
        .await;
        if persistent {
            let at = i + self.rng.usize(3..10);
            self.due.push((at, Lift::Fault(node, Command::Clear)));
        }
    }

    async fn hang(&mut self, i: usize) {
        let Some((node, rpc)) = self.fault_target() else {
            return;
        };
        let after = self.rng.bool();
        self.log(format!(
            "hang {rpc} on {} {} it takes effect",
            node_name(node),
            if after { "after" } else { "before" }
        ));
        self.send(
            node,
            Command::Hang {
                rpc: rpc.into(),
                after,
            },
        )
        .await;
        // Often past the agents' --csi-timeout (5 s): the caller gives up first.
        let at = i + self.rng.usize(1..12);
        self.due
            .push((at, Lift::Fault(node, Command::Release { rpc: rpc.into() })));
    }

    /// Sends a fault command; a plugin that is down has none to lift.
    async fn send(&self, node: usize, cmd: Command) {
        if let Err(e) = faults::send(&self.c.nodes[node].admin, &cmd).await {
            eprintln!("chaos: {cmd:?} on {}: {e}", node_name(node));
        }
    }

    async fn lift_due(&mut self, i: usize) {
        let (now, later): (Vec<Due>, Vec<Due>) = self.due.drain(..).partition(|d| d.0 <= i);
        self.due = later;
        for (_, lift) in now {
            match lift {
                Lift::Fault(node, cmd) => {
                    self.log(format!("lift {cmd:?} on {}", node_name(node)));
                    self.send(node, cmd).await;
                }
                Lift::Restart(p) => self.restart(p).await,
            }
        }
    }

    /// Runs `undo` after `d` on a thread of its own.
    fn later(&mut self, d: Duration, undo: impl FnOnce() + Send + 'static) {
        self.lifts.push(std::thread::spawn(move || {
            std::thread::sleep(d);
            undo();
        }));
    }

    /// An agent cut off or paused for `d` from `since`: silent long enough for its Node
    /// to expire and be collected, the controller may have released its claims
    /// without it, as for a node lost. The declaration is dated when the controller
    /// could first have released them: TTL and GC timeout after the silence began,
    /// less a second for the renewal it may have missed just before.
    fn silence(&mut self, p: Process, since: SystemTime, d: Duration) {
        if let Process::Agent(n) = p {
            self.silences.push((n, since, since + d));
            if d + Duration::from_secs(1) > NODE_TTL + NODE_GC {
                let at = since + NODE_TTL + NODE_GC - Duration::from_secs(1);
                self.forced.entry(node_name(n)).or_default().push(at);
            }
        }
    }

    /// The declarations the controller may have made of silences that add up: an
    /// agent silent again less than a TTL after its last silence ended may not have
    /// renewed its Node in between, so the two count as one silence from the first's
    /// start (a kill during a partition, a partition of an agent just restarted). One
    /// long enough is declared when the controller could first have released its
    /// claims (see [`Chaos::silence`]).
    fn declarations_of_silences(&self) -> Vec<(usize, SystemTime)> {
        let mut out = Vec::new();
        for n in 0..NODES {
            let mut spans: Vec<(SystemTime, SystemTime)> = self
                .silences
                .iter()
                .filter(|s| s.0 == n)
                .map(|s| (s.1, s.2))
                .collect();
            // A kill not restarted yet runs to now.
            if let Some(since) = self.down.get(&Process::Agent(n)) {
                spans.push((*since, SystemTime::now()));
            }
            spans.sort();
            let mut merged: Vec<(SystemTime, SystemTime)> = Vec::new();
            for (a, b) in spans {
                match merged.last_mut() {
                    Some(last) if a <= last.1 + NODE_TTL => last.1 = last.1.max(b),
                    _ => merged.push((a, b)),
                }
            }
            for (a, b) in merged {
                let long = b.duration_since(a).unwrap_or_default() + Duration::from_secs(1);
                if long > NODE_TTL + NODE_GC {
                    out.push((n, a + NODE_TTL + NODE_GC - Duration::from_secs(1)));
                }
            }
        }
        out
    }

    /// How long a partition or pause lasts: shorter than the node TTL, past it, or
    /// past the TTL and the GC timeout (the node is collected meanwhile).
    fn fault_length(&mut self) -> Duration {
        let ms = match self.rng.u32(0..3) {
            0 => self.rng.u64(300..2_000),
            1 => self.rng.u64(3_500..5_000),
            _ => self.rng.u64(7_000..10_000),
        };
        Duration::from_millis(ms)
    }

    /// A controller or an agent cut off from etcd (its proxy holds every byte); the
    /// process and its plugin keep running.
    fn partition(&mut self) {
        let p = if self.rng.u32(0..3) == 0 {
            Process::Controller(self.rng.usize(0..CONTROLLERS))
        } else {
            Process::Agent(self.rng.usize(0..NODES))
        };
        let switch = self.c.proxy(&proxy_name(p)).switch();
        if switch.is_cut() {
            return;
        }
        let d = self.fault_length();
        self.log(format!(
            "partition {p:?} from etcd for {} ms",
            d.as_millis()
        ));
        switch.cut();
        self.silence(p, SystemTime::now(), d);
        self.later(d, move || switch.heal());
    }

    /// A controller, an agent or etcd paused (SIGSTOP), resumed later.
    fn pause(&mut self) {
        let which = self.rng.u32(0..4);
        if which == 0 {
            if self.etcd_paused.is_some_and(|t| t > Instant::now()) {
                return;
            }
            let Some(pid) = self.c.etcd.pid() else {
                return;
            };
            let d = Duration::from_millis(self.rng.u64(300..4_000));
            self.log(format!("pause etcd for {} ms", d.as_millis()));
            signal(pid, "-STOP");
            self.etcd_paused = Some(Instant::now() + d);
            self.later(d, move || signal(pid, "-CONT"));
            return;
        }
        let p = if which == 1 {
            Process::Controller(self.rng.usize(0..CONTROLLERS))
        } else {
            Process::Agent(self.rng.usize(0..NODES))
        };
        self.pause_process(p);
    }

    /// A node's plugin paused: its socket accepts calls and answers none.
    fn pause_plugin(&mut self) {
        let p = Process::Plugin(self.rng.usize(0..NODES));
        self.pause_process(p);
    }

    fn pause_process(&mut self, p: Process) {
        let now = Instant::now();
        if self.is_down(p) || self.paused.get(&p).is_some_and(|t| *t > now) {
            return;
        }
        let Some(pid) = self.proc(p).pid() else {
            return;
        };
        let d = self.fault_length();
        self.log(format!("pause {p:?} for {} ms", d.as_millis()));
        signal(pid, "-STOP");
        self.paused.insert(p, now + d);
        self.silence(p, SystemTime::now(), d);
        // A process killed meanwhile has another pid: the old one gets the signal.
        self.later(d, move || signal(pid, "-CONT"));
    }

    /// A node's data disk (its agent's journal) full for a while.
    fn fill_disk(&mut self) {
        let node = self.rng.usize(0..NODES);
        let d = Duration::from_millis(self.rng.u64(500..6_000));
        let name = node_name(node);
        if !self.c.fill_disk(&name) {
            return;
        }
        self.log(format!("fill the disk of {name} for {} ms", d.as_millis()));
        let now = SystemTime::now();
        // Until the fill file is gone, and the half second a retry takes to notice.
        self.full_disks
            .push((node, now, now + d + Duration::from_millis(500)));
        let fill = self.c.node(&name).dir.join("agent").join("fill");
        self.later(d, move || {
            let _ = std::fs::remove_file(fill);
        });
    }

    async fn kill(&mut self, i: usize) {
        let which = self.rng.u32(0..8);
        if which == 0 {
            let ms = self.rng.u64(0..2000);
            self.log(format!("kill -9 etcd, restart after {ms} ms"));
            self.c.etcd.kill();
            tokio::time::sleep(Duration::from_millis(ms)).await;
            self.c.etcd.restart().await;
            return;
        }
        let p = match which {
            1 | 2 => Process::Controller(self.rng.usize(0..CONTROLLERS)),
            3..=5 => Process::Agent(self.rng.usize(0..NODES)),
            _ => Process::Plugin(self.rng.usize(0..NODES)),
        };
        if self.is_down(p) {
            return;
        }
        self.log(format!("kill -9 {p:?}"));
        self.proc(p).kill();
        self.paused.remove(&p);
        self.went_down(p);
        let at = i + self.rng.usize(1..4);
        self.due.push((at, Lift::Restart(p)));
    }

    /// Records `p` down from now; an agent's Node silence starts now, or keeps running
    /// when the agent was restarted too recently to have renewed its Node.
    fn went_down(&mut self, p: Process) {
        let now = SystemTime::now();
        self.down.insert(p, now);
        if let Process::Agent(n) = p {
            let renewed = self
                .agent_up
                .get(&n)
                .is_none_or(|up| now.duration_since(*up).unwrap_or_default() >= NODE_TTL);
            if renewed || !self.silent_since.contains_key(&n) {
                self.silent_since.insert(n, now);
            }
        }
    }

    fn proc(&mut self, p: Process) -> &mut cluster::Proc {
        match p {
            Process::Controller(i) => &mut self.c.controllers[i],
            Process::Agent(i) => &mut self.c.nodes[i].agent,
            Process::Plugin(i) => &mut self.c.nodes[i].plugin,
        }
    }

    async fn restart(&mut self, p: Process) {
        let Some(since) = self.down.remove(&p) else {
            return;
        };
        let gone = since.elapsed().unwrap_or_default();
        self.log(format!("restart {p:?} (down {} ms)", gone.as_millis()));
        if let Process::Agent(n) | Process::Plugin(n) = p {
            *self.restarts.entry(n).or_default() += 1;
        }
        if let Process::Agent(n) = p {
            // Silent long enough for its Node to expire and be collected: the
            // controller may have released its claims without it.
            let silent = self.silent_since.get(&n).copied().unwrap_or(since);
            let silent_for = silent.elapsed().unwrap_or_default();
            if silent_for + Duration::from_secs(1) > NODE_TTL + NODE_GC {
                self.forced.entry(node_name(n)).or_default().push(since);
            }
            self.agent_up.insert(n, SystemTime::now());
            self.silences.push((n, since, SystemTime::now()));
        }
        self.proc(p).restart();
    }

    /// `moorctl volume detach` of one of the volumes a node's allocations use; from
    /// then on the node counts as gone for that volume's invariants.
    async fn detach(&mut self, node: usize) {
        let vols: Vec<String> = self
            .allocs
            .values()
            .filter(|a| a.node == node)
            .map(|a| a.volume.clone())
            .filter(|v| self.volumes.get(v).is_some_and(|v| !v.deleted))
            .collect();
        let Some(volume) = self.pick(&vols).cloned() else {
            return;
        };
        let up = if self.is_down(Process::Agent(node)) {
            "down"
        } else {
            "up"
        };
        self.log(format!(
            "moorctl volume detach {volume} --node {} (node {up})",
            node_name(node)
        ));
        self.forced
            .entry(node_name(node))
            .or_default()
            .push(SystemTime::now());
        let out = std::process::Command::new(common::bin("moorctl"))
            .args([
                "--endpoints",
                &self.c.etcd.client_url,
                "volume",
                "detach",
                &volume,
                "--node",
                &node_name(node),
            ])
            .output()
            .expect("run moorctl");
        assert!(
            out.status.success(),
            "moorctl volume detach: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A volume created through the plugin's own CreateVolume (as an operator's storage
    /// team would) and registered by its external id.
    async fn register_volume(&mut self) {
        if self.is_down(Process::Plugin(0)) {
            return;
        }
        self.next += 1;
        let name = format!("r{}", self.next);
        let mode = if self.rng.bool() {
            AccessMode::SingleNodeWriter
        } else {
            AccessMode::MultiNodeReaderOnly
        };
        self.log(format!("register volume {name} {mode:?}"));
        // Deleted through the plugin at the end, whether this call answers or not.
        self.registered.push((name.clone(), mode));
        let created = match csi_create(&self.c, &name, mode).await {
            Ok(v) => v,
            Err(e) => {
                self.log(format!("register volume {name}: CreateVolume failed: {e}"));
                return;
            }
        };
        let mut vol = self.c.volume(&name, mode);
        vol.spec.capacity_min = None;
        vol.spec.external_id =
            Some(ExternalVolumeId::new(&created.volume_id).expect("a volume id"));
        vol.spec.context = created.volume_context.into_iter().collect();
        retry(&format!("register volume {name}"), || {
            self.c.store.create(&vol)
        })
        .await;
        self.volumes.insert(
            name.clone(),
            Vol {
                // Never created: no CreateVolume names it.
                plugin_name: name,
                mode,
                deleted: false,
            },
        );
    }

    /// A node goes away (agent and plugin); while it is down an operator may detach
    /// one of its volumes; it comes back later (a restart op, or the end).
    async fn detach_or_lose_node(&mut self, i: usize) {
        let down: Vec<usize> = (0..NODES)
            .filter(|n| self.is_down(Process::Agent(*n)))
            .collect();
        if let Some(node) = self.pick(&down).copied() {
            return self.detach(node).await;
        }
        let node = self.rng.usize(0..NODES);
        if self.rng.u32(0..3) == 0 {
            return self.detach(node).await;
        }
        self.lose_node(i, node);
    }

    /// Kills a node's agent and plugin; they come back 6 to 13 ops later.
    fn lose_node(&mut self, i: usize, node: usize) {
        self.log(format!("lose node {}", node_name(node)));
        let back = i + self.rng.usize(6..14);
        for p in [Process::Agent(node), Process::Plugin(node)] {
            if !self.is_down(p) {
                self.proc(p).kill();
                self.paused.remove(&p);
                self.went_down(p);
                self.due.push((back, Lift::Restart(p)));
            }
        }
    }

    /// Lifts every fault, runs every process, stops every allocation and waits for
    /// every claim to be Released; then deletes everything and waits for it to go.
    async fn drain(&mut self) {
        // Every partition healed, pause resumed and disk freed (each at its time).
        for t in std::mem::take(&mut self.lifts) {
            let _ = t.join();
        }
        let down: Vec<Process> = self.down.keys().copied().collect();
        for p in down {
            self.restart(p).await;
        }
        for n in 0..NODES {
            self.send(n, Command::Clear).await;
        }
        self.due.clear();
        self.c.wait_nodes_healthy().await;
        let running = self.allocs_where(|a| !a.stopped);
        for name in running {
            self.set_desired(&name, DesiredStatus::Stop).await;
            if let Some(a) = self.allocs.get_mut(&name) {
                a.stopped = true;
            }
        }
        let store = self.c.store.clone();
        self.settle("every claim Released", || async {
            match store.list::<ClaimSpec>(&moor::api::KeyScope::all()).await {
                Ok(l) => l
                    .items
                    .iter()
                    .filter(|c| c.status.phase != ClaimPhase::Released)
                    .map(|c| {
                        format!(
                            "Claim {}: {}",
                            c.key(),
                            serde_json::to_string(&c.status).unwrap_or_default()
                        )
                    })
                    .collect(),
                Err(e) => vec![format!("claims: {e}")],
            }
        })
        .await;
        for name in self.allocs_where(|_| true) {
            delete(
                &self.c,
                &Allocation::key_for(&Namespace::default_ns(), &name),
            )
            .await;
        }
        for name in self.live_volumes() {
            delete(&self.c, &Volume::key_for(&Namespace::default_ns(), &name)).await;
        }
        // Retained template volumes are the operator's to delete; ephemeral ones the
        // controller deletes itself once their allocation ended.
        let all = KeyScope::all();
        let made = retry("list volumes", || self.c.store.list::<VolumeSpec>(&all)).await;
        for v in made.items {
            if v.spec
                .made_for
                .as_ref()
                .is_some_and(|m| m.lifecycle == VolumeLifecycle::Retain)
            {
                delete(&self.c, &v.object_key()).await;
            }
        }
        self.settle("everything gone", || remaining(&store)).await;
        // The registered volumes are the storage team's to delete (moor never creates
        // or deletes them).
        for (name, mode) in self.registered.clone() {
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let r = match csi_create(&self.c, &name, mode).await {
                    Ok(v) => csi_delete(&self.c, &v.volume_id).await,
                    Err(e) => Err(e),
                };
                match r {
                    Ok(()) => break,
                    Err(e) if Instant::now() < deadline => {
                        eprintln!("chaos: delete registered {name}: {e}; retrying");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    Err(e) => panic!("delete registered {name}: {e}"),
                }
            }
        }
    }

    /// Waits for `left` to list nothing; after [`DRAIN`], fails with what it lists.
    async fn settle<F, Fut>(&mut self, what: &str, mut left: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Vec<String>>,
    {
        let deadline = Instant::now() + DRAIN;
        loop {
            let now = left().await;
            if now.is_empty() {
                return;
            }
            if Instant::now() > deadline {
                self.c.dump_logs();
                self.c.keep_dir();
                panic!(
                    "no {what} after {DRAIN:?}; these remain:\n{}\nscript:\n{}",
                    now.join("\n"),
                    self.script.join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The nodes the controller released claims without ("Node steps skipped"), and
    /// when, where the node had been silent just before: the agent's own backoff before
    /// it registers again can keep its Node away longer than the script's faults did,
    /// which the script cannot know. A skip with no silence of that node before it is
    /// left out, so the checker still fails a node released while it was renewing.
    async fn skipped_nodes(&self) -> Vec<(usize, SystemTime)> {
        let all = KeyScope::all();
        let events = retry("list events", || self.c.store.list::<EventSpec>(&all)).await;
        // Before the skip: the silence, the TTL, the GC timeout, the registration
        // backoff's cap (5 s) and a second of slack.
        let reach = NODE_TTL + NODE_GC + Duration::from_secs(6);
        let mut out = Vec::new();
        for e in events
            .items
            .iter()
            .filter(|e| e.spec.reason == "Node steps skipped")
        {
            let Some(at) = e.spec.series.as_ref().map(|s| s.first_time.system()).or(e
                .spec
                .time
                .as_ref()
                .map(|t| t.system()))
            else {
                continue;
            };
            let alloc = e
                .spec
                .object
                .name
                .as_str()
                .split('.')
                .next()
                .unwrap_or_default();
            let Some(node) = self.allocs.get(alloc).map(|a| a.node) else {
                continue;
            };
            let silent = self.silences.iter().any(|(n, from, to)| {
                *n == node && *from <= at + Duration::from_secs(1) && at <= *to + reach
            });
            if silent {
                out.push((node, at));
            }
        }
        out
    }

    /// The live contract monitor's Warnings: a correct plugin raises none, whatever
    /// the faults around it.
    async fn contract_breaches(&self) -> Vec<String> {
        let all = KeyScope::all();
        let events = retry("list events", || self.c.store.list::<EventSpec>(&all)).await;
        events
            .items
            .into_iter()
            .filter(|e| e.spec.reason == "Plugin broke the CSI contract")
            .map(|e| {
                format!(
                    "contract monitor, {} {}: {}",
                    e.spec.object.kind, e.spec.object.name, e.spec.message
                )
            })
            .collect()
    }

    /// The call logs against the invariants and the retry schedule.
    fn check(&mut self, breaches: Vec<String>, skipped: Vec<(usize, SystemTime)>) {
        // Stop the agents first, so that no call is in flight while the logs are read.
        for n in &mut self.c.nodes {
            n.agent.stop();
        }
        for n in &mut self.c.nodes {
            n.plugin.stop();
        }
        let logs: Vec<Vec<Call>> = self.c.nodes.iter().map(|n| n.calls()).collect();
        let merged = checker::merge(logs);
        for (n, at) in self.declarations_of_silences().into_iter().chain(skipped) {
            self.forced.entry(node_name(n)).or_default().push(at);
        }
        let rfc = |t: &SystemTime| humantime::format_rfc3339_millis(*t).to_string();
        let mut journal_unwritable: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
        for (n, from, to) in &self.full_disks {
            journal_unwritable
                .entry(format!("csi-{}", node_name(*n)))
                .or_default()
                .push((rfc(from), rfc(to)));
        }
        let cfg = CheckConfig {
            controller_publish_required: true,
            stage_required: true,
            expect_released: true,
            expect_deleted: true,
            forced_nodes: self
                .forced
                .iter()
                .map(|(n, ts)| {
                    let ts = ts
                        .iter()
                        .map(|t| humantime::format_rfc3339_millis(*t).to_string())
                        .collect();
                    (format!("csi-{n}"), ts)
                })
                .collect(),
            journal_unwritable,
            ..Default::default()
        };
        let mut problems: Vec<String> = checker::check(&merged, &cfg)
            .iter()
            .map(|v| format!("{v}: {}", describe(merged.get(v.index))))
            .collect();
        problems.extend(self.over_schedule(&merged));
        problems.extend(breaches);
        let mut failed: BTreeMap<&str, u32> = BTreeMap::new();
        for c in merged.iter().filter(|c| c.code != "OK") {
            *failed.entry(c.rpc.as_str()).or_default() += 1;
        }
        let count = |prefixes: &[&str]| {
            self.script
                .iter()
                .filter(|l| prefixes.iter().any(|p| l.starts_with(p)))
                .count()
        };
        let kills = count(&["kill -9", "lose node"]);
        let (partitions, pauses, disks) = (
            count(&["partition "]),
            count(&[
                "pause Controller",
                "pause Agent",
                "pause Plugin",
                "pause etcd",
            ]),
            count(&["fill the disk"]),
        );
        eprintln!(
            "chaos: {} ops, {} calls, {} failed {failed:?}, {kills} kills, {partitions} partitions, {pauses} pauses, {disks} full disks, forced nodes {:?}",
            self.script.len(),
            merged.len(),
            merged.iter().filter(|c| c.code != "OK").count(),
            self.forced
                .iter()
                .map(|(n, ts)| format!("{n} x{}", ts.len()))
                .collect::<Vec<_>>()
        );
        if !problems.is_empty() {
            self.c.dump_logs();
            self.c.keep_dir();
        }
        assert!(
            problems.is_empty(),
            "{} problems:\n{}",
            problems.len(),
            problems.join("\n")
        );
    }

    /// Each (RPC, object) that failed, against the most calls the retry schedule allows
    /// over the time it kept failing. Besides the schedule, each restart of the node's
    /// agent or plugin and each new input (a claim's spec changes a few times over its
    /// life; a re-run makes a new claim) may bring one attempt forward.
    fn over_schedule(&self, calls: &[Call]) -> Vec<String> {
        // The CSI volume id → the moor volume, through CreateVolume's name.
        let by_name: BTreeMap<&str, &str> = self
            .volumes
            .iter()
            .map(|(n, v)| (v.plugin_name.as_str(), n.as_str()))
            .collect();
        let mut names: BTreeMap<String, String> = BTreeMap::new();
        for c in calls {
            if let (Some(id), Some(name)) = (&c.result_volume_id, &c.name) {
                if let Some(n) = by_name.get(name.as_str()) {
                    names.insert(id.clone(), n.to_string());
                }
            }
        }
        type Key = (String, String, String, String);
        let mut failing: BTreeMap<Key, (u32, SystemTime, SystemTime)> = BTreeMap::new();
        for c in calls.iter().filter(|c| c.code != "OK") {
            let Ok(t) = humantime::parse_rfc3339(&c.time) else {
                continue;
            };
            let object = c
                .volume_id
                .clone()
                .or_else(|| c.name.clone())
                .unwrap_or_default();
            let place = c
                .target_path
                .clone()
                .or_else(|| c.staging_target_path.clone())
                .or_else(|| c.node_id.clone())
                .unwrap_or_default();
            let e = failing
                .entry((c.rpc.clone(), c.plugin_node.clone(), object, place))
                .or_insert((0, t, t));
            e.0 += 1;
            e.1 = e.1.min(t);
            e.2 = e.2.max(t);
        }
        let mut out = Vec::new();
        for ((rpc, plugin_node, object, place), (n, first, last)) in failing {
            let node = plugin_node
                .trim_start_matches("csi-n")
                .parse::<usize>()
                .map(|i| i - 1)
                .unwrap_or(0);
            let volume = names.get(&object).cloned().unwrap_or_default();
            // Claims that drive this call: those of the volume on the node, or on any
            // node for the controller's calls.
            let runs: u32 = self
                .runs_on
                .iter()
                .filter(|((v, on), _)| {
                    *v == volume && (*on == node || rpc.starts_with("Controller"))
                })
                .map(|(_, r)| *r)
                .sum();
            let resets = self.restarts.get(&node).copied().unwrap_or(0) + 4 * runs + 2;
            let span = last.duration_since(first).unwrap_or_default() + Duration::from_secs(1);
            let bound = TRIES * (schedule().max_attempts_within(span, false) + resets);
            if n > bound {
                out.push(format!(
                    "{rpc} of {object} ({volume}) at {place} on {plugin_node}: {n} failed calls in {span:?}, at most {bound} allowed"
                ));
            }
        }
        out
    }
}

/// The CSI client of n1's plugin (the controller service), for what the script does
/// as the storage team.
fn csi(c: &Cluster) -> moor::csi::client::Csi {
    c.csi()
}

async fn csi_create(
    c: &Cluster,
    name: &str,
    mode: AccessMode,
) -> Result<moor::csi::v1::Volume, moor::csi::policy::CsiError> {
    let cap = VolumeCapability {
        access_mode: mode,
        attachment_mode: AttachmentMode::FileSystem,
    };
    let req = moor::csi::v1::CreateVolumeRequest {
        name: name.to_string(),
        capacity_range: Some(moor::csi::v1::CapacityRange {
            required_bytes: 1 << 20,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![moor::csi::convert::capability(
            cap,
            &MountOptions::default(),
        )],
        ..Default::default()
    };
    let r = csi(c).create_volume(req).await?;
    Ok(r.volume.unwrap_or_default())
}

async fn csi_delete(c: &Cluster, id: &str) -> Result<(), moor::csi::policy::CsiError> {
    let req = moor::csi::v1::DeleteVolumeRequest {
        volume_id: id.to_string(),
        ..Default::default()
    };
    csi(c).delete_volume(req).await.map(|_| ())
}

/// What is left of the cluster's objects, one line each with its status.
async fn remaining(store: &moor::store::Store) -> Vec<String> {
    async fn of<S: Spec>(store: &moor::store::Store, out: &mut Vec<String>) {
        match store.list::<S>(&moor::api::KeyScope::all()).await {
            Ok(l) => out.extend(l.items.iter().map(|o| {
                format!(
                    "{} {}: {}",
                    S::KIND,
                    o.key(),
                    serde_json::to_string(&o.status).unwrap_or_default()
                )
            })),
            Err(e) => out.push(format!("{}: {e}", S::KIND)),
        }
    }
    let mut out = Vec::new();
    of::<ClaimSpec>(store, &mut out).await;
    of::<AttachmentSpec>(store, &mut out).await;
    of::<MountSpec>(store, &mut out).await;
    of::<VolumeSpec>(store, &mut out).await;
    out
}

fn describe(c: Option<&Call>) -> String {
    c.map(|c| serde_json::to_string(c).unwrap_or_default())
        .unwrap_or_else(|| "(end of log)".into())
}

/// Retries a store call until it succeeds (etcd may be restarting), for up to a minute.
async fn retry<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match f().await {
            Ok(v) => return v,
            Err(e) if Instant::now() < deadline => {
                eprintln!("chaos: {what}: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

async fn delete<S: Spec>(c: &Cluster, key: &ObjectKey<S>) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match c.store.delete(key, None).await {
            Ok(_) | Err(StoreError::NotFound { .. }) => return,
            Err(e) if Instant::now() < deadline => {
                eprintln!("chaos: delete {key}: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("delete {key}: {e}"),
        }
    }
}

/// The seeds CI runs (with `CI` set and no `MOOR_CHAOS_SEED`), 70 ops each: scripts
/// that passed here first, so that whether a change lands is not decided by a script
/// nobody has tried. New seeds are tried by running the suite without `CI`.
const CI_SEEDS: [u64; 3] = [1, 2, 3];

/// The scripts to run and their length: `MOOR_CHAOS_SEED`'s; else under CI the
/// [`CI_SEEDS`]; else a new seed. `MOOR_CHAOS_OPS` sets the length (200, or 70 per CI
/// seed).
fn scripts() -> (Vec<u64>, usize) {
    let env = |name: &str| std::env::var(name).ok().and_then(|s| s.parse::<u64>().ok());
    let ops = env("MOOR_CHAOS_OPS").map(|n| n as usize);
    if let Some(seed) = env("MOOR_CHAOS_SEED") {
        return (vec![seed], ops.unwrap_or(200));
    }
    if std::env::var_os("CI").is_some() {
        return (CI_SEEDS.to_vec(), ops.unwrap_or(70));
    }
    let seed = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    (vec![seed], ops.unwrap_or(200))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_faults_keep_the_invariants() {
    let (seeds, ops) = scripts();
    for seed in seeds {
        run(seed, ops).await;
    }
}

async fn run(seed: u64, ops: usize) {
    // Even seeds: the plugins advertise SINGLE_NODE_MULTI_WRITER, so a single-node
    // volume's claims share a node under it. Odd seeds: they do not, so such a volume
    // has one claim per node, sent as SINGLE_NODE_WRITER, and the checker holds its
    // one writer too.
    let multi_writer_cap = seed.is_multiple_of(2);
    // Written to the process's stderr, not through the test harness's capture: the
    // seed shows at the start of every run, passing or not.
    use std::io::Write as _;
    let _ = writeln!(
        std::io::stderr(),
        "chaos: seed {seed} ({ops} ops, SINGLE_NODE_MULTI_WRITER {}); replay with \
         MOOR_CHAOS_SEED={seed}",
        if multi_writer_cap {
            "advertised"
        } else {
            "not advertised"
        }
    );
    let opts = PluginOpts {
        extra: vec![format!("--single-node-multi-writer={multi_writer_cap}")],
        agent_args: vec![
            format!("--retry-initial={}ms", RETRY_INITIAL.as_millis()),
            format!("--retry-cap={}ms", RETRY_CAP.as_millis()),
        ],
        controller_args: vec![format!("--node-gc-timeout={}s", NODE_GC.as_secs())],
        proxied: true,
        small_disk_mib: Some(16),
        ..Default::default()
    };
    let c = Cluster::start(CONTROLLERS, NODES, opts).await;
    let mut chaos = Chaos {
        rng: fastrand::Rng::with_seed(seed),
        c,
        volumes: BTreeMap::new(),
        allocs: BTreeMap::new(),
        next: 0,
        down: BTreeMap::new(),
        forced: BTreeMap::new(),
        registered: Vec::new(),
        restarts: BTreeMap::new(),
        agent_up: BTreeMap::new(),
        silent_since: BTreeMap::new(),
        silences: Vec::new(),
        full_disks: Vec::new(),
        runs_on: BTreeMap::new(),
        due: Vec::new(),
        lifts: Vec::new(),
        paused: BTreeMap::new(),
        etcd_paused: None,
        script: Vec::new(),
    };
    let started = Instant::now();
    for i in 0..ops {
        chaos.lift_due(i).await;
        chaos.step(i).await;
        let ms = chaos.rng.u64(0..800);
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let chaos_time = started.elapsed();
    chaos.drain().await;
    eprintln!(
        "chaos: seed {seed}: script {} ms, drained in {} ms",
        chaos_time.as_millis(),
        (started.elapsed() - chaos_time).as_millis()
    );
    let breaches = chaos.contract_breaches().await;
    let skipped = chaos.skipped_nodes().await;
    chaos.check(breaches, skipped);
}
