//! The hostile-writer suite (issue 77): beside ordinary workloads, seeded adversaries
//! write forged objects into every key their grants allow, on a TLS etcd with auth on
//! and deploy/etcd/roles.sh's roles, and a checker fails the run on any harm beyond
//! their reach.
//!
//! The cluster: the controller, node n1 (hosting the hostpath controller plugin) and
//! node n2, each under its own certificate. The victim, namespace `default`, written by
//! an operator: two created volumes, a snapshot, a group snapshot, an allocation
//! published on n1, and a workload run on n1 by `moorctl alloc run` in a cgroup of its
//! own (the victim never uses n2, so any call about its ids on n2 is the
//! adversaries').
//! The adversaries, each with the identity roles.sh makes for it and nothing more:
//! - `moor-edit-a`, a namespace writer (its volumes, allocations, snapshots, group
//!   snapshots of namespace `a`);
//! - `moor-agent-n3`, an engine-serving node (`allocations/engines/`,
//!   `volumes/engines/`);
//! - `moor-agent-n2`, a node agent (its own `mounts/n2/`), whose forged orphans an
//!   operator then tries to adopt without `--insist`, and whose forged events about
//!   the victim's objects no view may show;
//! - `moor-console` and `moor-agent-n4` (the controller of another plugin), each
//!   writing at every key of the victim's beyond its grants (all refused by etcd);
//! - the people of namespace `a` (issue 79): `bo` (`edit:a`, moor-edit-a's role under
//!   another user, with objects of its own) and `ann` (`view:a`: every forgery must be
//!   refused). An operator is not an adversary: its reach is the cluster.
//!
//! Each adversary knows the victim's plugin ids, uids, names and its workload's cgroup
//! (a leak: stronger than a guess) and copies whatever it can read of its own objects (finalizers). The
//! script of forgeries (which, in which order, naming which id) comes from the seed.
//!
//! The checker fails the run on: a CSI call naming a victim's plugin id that the
//! victim's own lifecycle did not make (the plugin's call logs, after the victim
//! settled); a victim object whose phase, plugin id or claim changed; an ownership
//! record of a victim id naming anyone else; a forged orphan adopted; an event n2
//! forged about the victim's objects shown by `moorctl events` or `describe`; a claim on n2
//! (whose node key the node adversary holds) carrying the victim's secret; the victim's
//! workload signalled (an allocation of theirs on n1 naming its cgroup, then ended).
//!
//! A run prints its seed (uncaptured, so also when it passes). `CI` set: the seeds in
//! [`CI_SEEDS`]. `MOOR_HOSTILE_SEEDS=1,2,3`: those seeds, with a table of what each
//! adversary tried (the long mode: `MOOR_HOSTILE_SEEDS=$(seq -s, 1 20)`). Otherwise a
//! new seed.

mod common;
#[path = "common/secure.rs"]
mod secure;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use common::wait_for;
use moor::api::*;
use moor::store::Store;
use moor_hostpath::calllog::{Call, CallLog};
use secure::Secure;

const T: Duration = Duration::from_secs(90);
const PLUGIN: &str = "hostpath.moor.dev";
const VICTIM_SECRET: &str = "victim-s3cret";

/// The seeds CI runs: each runs every adversary.
const CI_SEEDS: [u64; 3] = [2, 3, 4];

/// Forgeries per adversary and seed.
const OPS: usize = 7;

fn seeds() -> Vec<u64> {
    if let Ok(list) = std::env::var("MOOR_HOSTILE_SEEDS") {
        return list
            .split(',')
            .map(|s| s.trim().parse().expect("MOOR_HOSTILE_SEEDS: numbers"))
            .collect();
    }
    if std::env::var_os("CI").is_some() {
        return CI_SEEDS.to_vec();
    }
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap();
    vec![now.as_nanos() as u64 % 1_000_000]
}

#[tokio::test]
async fn adversaries_with_every_identity_s_grants_harm_nothing_beyond_their_reach() {
    let mut table = Vec::new();
    for seed in seeds() {
        eprintln!("hostile: seed {seed} (rerun with MOOR_HOSTILE_SEEDS={seed})");
        table.push(run(seed).await);
    }
    eprintln!("hostile: seed | forgeries per adversary | calls checked");
    for row in table {
        eprintln!("hostile: {row}");
    }
}

/// The victim's ids and names, as the adversaries are told them.
struct Victim {
    volumes: Vec<(String, Uid, ExternalVolumeId)>,
    snapshot: String,
    snapshot_id: String,
    /// Its group snapshot's id and its members' snapshot ids.
    group_id: String,
    members: Vec<String>,
    /// Where its volumes' data is (the `path` of their plugin context).
    paths: Vec<String>,
    /// Its workload on n1: the runner, the workload's pid and its recorded cgroup.
    runner: Ends,
    pid: String,
    cgroup: String,
    /// An operator's view, to wait on what a forgery set going.
    operator: Store,
}

/// A runner ended (SIGTERM, then waited for) however the run ends: nothing is left
/// running.
struct Ends(Child);

impl Drop for Ends {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = Command::new("kill")
                .args(["-TERM", &self.0.id().to_string()])
                .status();
            let _ = self.0.wait();
        }
    }
}

/// Whether process `pid` lives (and is no zombie).
fn alive(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z'))
    })
}

impl Victim {
    fn ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.volumes.iter().map(|(_, _, e)| e.to_string()).collect();
        ids.push(self.snapshot_id.clone());
        ids.push(self.group_id.clone());
        ids.extend(self.members.iter().cloned());
        ids
    }
}

/// One adversary: an identity and the namespace its grants let it write.
struct Adversary {
    who: &'static str,
    ns: Namespace,
    /// Its own volume (and allocation, and snapshot) and its spare volume: named
    /// apart from another adversary's of the same namespace.
    own: String,
    spare: String,
    /// What its forgeries' names start with.
    tag: &'static str,
    raw: etcd_client::Client,
    store: Store,
    /// The finalizers its own volume and snapshot carry (copied into forgeries).
    volume_finalizers: Vec<Term>,
    snapshot_finalizers: Vec<Term>,
    /// What it forged, for the table and the failure messages.
    tried: Vec<String>,
    /// Writes its grants refused, of all it tried.
    denied: usize,
    puts: usize,
}

async fn run(seed: u64) -> String {
    let mut rng = fastrand::Rng::with_seed(seed);
    // n4 hosts another plugin's controller (an identity only: no agent runs there).
    let s = Secure::start_nodes(
        &["n1", "n2", "n3", "n4"],
        "n1=hostpath.moor.dev n4=other.example",
        "n3",
        &[],
    )
    .await;
    let keys = Some(s.cluster_keys.as_path());
    let _controller = s.controller("controller", &[]);
    let _n1 = s.node("n1", "monolith", &s.cluster_keys);
    let _n2 = s.node("n2", "node", &s.n2_keys);
    let operator = s.store("moor-controller", keys).await;
    let victim = victim(&s, &operator).await;

    // Each adversary's own, ordinary objects: a volume used on n2 and (the namespace
    // writer) a snapshot of it, whose finalizers it can read and copy.
    let mut adversaries = Vec::new();
    // The people of namespace a too (secure::PEOPLE): Bo edits it as moor-edit-a does
    // (the same role, another user), Ann views it (every write refused; her objects
    // are moor-edit-a's, made first).
    for (who, ns, tag) in [
        ("moor-edit-a", "a", ""),
        ("moor-agent-n3", "engines", ""),
        ("bo", "a", "bo-"),
        ("ann", "a", "ann-"),
    ] {
        adversaries.push(adversary(&s, who, ns, tag).await);
    }
    let own_calls = Calls::of(&s);
    // What the victim's own lifecycle keeps calling (none expected once settled):
    // counted from here.
    let baseline = own_calls.marks();

    // The script.
    let mut orphans = Vec::new();
    for _ in 0..OPS {
        for a in adversaries.iter_mut() {
            forge(a, &victim, &mut rng).await;
        }
        orphans.push(forge_orphan(&s, &victim, &mut rng).await);
        forge_event(&s, &victim, &mut rng).await;
    }
    let reported = forge_report(&s, &victim, &operator, &mut rng).await;
    // Every forged orphan is refused to an operator adopting it without --insist.
    for (ns, claim) in &orphans {
        let out = s.moorctl(
            "moor-controller",
            keys,
            &["mount", "adopt", claim, "-n", ns, "--timeout", "5s"],
        );
        assert!(
            !out.status.success(),
            "seed {seed}: the forged orphan {ns}/{claim} was adopted: {out:?}"
        );
    }

    // Settled: no CSI call that changes anything for 4 s, and at least 15 s after the
    // script, with a deadline. (Probes, capability, capacity and health reads go on.)
    let script_end = Instant::now();
    let mut last = (0, Instant::now());
    loop {
        let acting: Vec<Call> = own_calls
            .since(&baseline)
            .into_iter()
            .filter(acts)
            .collect();
        if acting.len() != last.0 {
            last = (acting.len(), Instant::now());
        }
        if last.1.elapsed() >= Duration::from_secs(4)
            && script_end.elapsed() >= Duration::from_secs(15)
        {
            break;
        }
        let recent = &acting[acting.len().saturating_sub(12)..];
        assert!(
            script_end.elapsed() < T,
            "seed {seed}: the plugins never went quiet after the script; the last calls:\n{recent:#?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let calls = own_calls.since(&baseline);
    let ids = victim.ids();
    let harmful: Vec<&Call> = calls
        .iter()
        .filter(|c| {
            [&c.volume_id, &c.snapshot_id, &c.result_volume_id]
                .into_iter()
                .flatten()
                .any(|id| ids.contains(id))
                || c.context_path
                    .as_ref()
                    .is_some_and(|p| victim.paths.contains(p))
        })
        .collect();
    let tried: Vec<String> = adversaries
        .iter()
        .map(|a| format!("{}: {}", a.who, a.tried.join(", ")))
        .collect();
    assert!(
        harmful.is_empty(),
        "seed {seed}: calls about the victim's plugin ids after the adversaries wrote:\n{harmful:#?}\nthey tried:\n{}",
        tried.join("\n")
    );
    if std::env::var_os("MOOR_HOSTILE_SHOW").is_some() {
        show(&operator, &calls).await;
    }
    // A viewer writes nothing: every forgery of Ann's was refused by etcd.
    for a in adversaries.iter().filter(|a| a.who == "ann") {
        assert_eq!(
            (a.denied, a.puts > 0),
            (a.puts, true),
            "seed {seed}: ann (view:a) wrote; she tried {:?}",
            a.tried
        );
    }
    check_victim(&operator, &victim, seed).await;
    let now = operator.get(&reported.object_key()).await;
    assert!(
        now.as_ref()
            .is_ok_and(|a| a.metadata.uid == reported.metadata.uid && a.status == reported.status),
        "seed {seed}: the victim's attachment after n4's report: {now:?}, was {reported:?}"
    );
    check_secrets(&s, seed).await;
    check_events(&s, &victim, seed);
    let refused = confined(&s, &victim, seed).await;
    // The victim's workload ends by its own runner's SIGTERM, with the exit it chose.
    let mut runner = victim.runner;
    let ok = Command::new("kill")
        .args(["-TERM", &runner.0.id().to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "seed {seed}: SIGTERM to the victim's runner");
    let status = runner.0.wait().expect("wait for the victim's runner");
    assert_eq!(
        status.code(),
        Some(0),
        "seed {seed}: the victim's workload chose its own exit"
    );
    let counts: Vec<String> = adversaries
        .iter()
        .map(|a| {
            format!(
                "{} [{}] ({} refused by etcd)",
                a.who,
                a.tried.join(" "),
                a.denied
            )
        })
        .collect();
    format!(
        "{seed} | {}, moor-agent-n2 {} orphans, {refused} writes of moor-console and moor-agent-n4 (another plugin's controller) refused | {} calls",
        counts.join(", "),
        orphans.len(),
        calls.len()
    )
}

/// Whether a call may change something (not a probe or a read of capabilities,
/// capacity, health or lists, which go on in a settled cluster).
fn acts(c: &Call) -> bool {
    let rpc = c.rpc.as_str();
    !(rpc == "Probe" || rpc.contains("Get") || rpc.starts_with("List"))
}

/// The call logs of both plugin instances.
struct Calls(Vec<PathBuf>);

impl Calls {
    fn of(s: &Secure) -> Calls {
        Calls(
            ["n1", "n2"]
                .map(|n| s.tmp.path().join(n).join("plugin/calls.jsonl"))
                .to_vec(),
        )
    }

    /// How many calls each log holds now.
    fn marks(&self) -> Vec<usize> {
        self.0
            .iter()
            .map(|p| CallLog::read(p).unwrap_or_default().len())
            .collect()
    }

    /// Every call after `marks` (as [`Calls::marks`] returned), n1's then n2's: each
    /// log only grows.
    fn since(&self, marks: &[usize]) -> Vec<Call> {
        let mut calls = Vec::new();
        for (path, mark) in self.0.iter().zip(marks) {
            let log = CallLog::read(path).unwrap_or_default();
            calls.extend(log.into_iter().skip(*mark));
        }
        calls
    }
}

/// The victim's volumes, snapshot and published allocation, applied by an operator.
async fn victim(s: &Secure, operator: &Store) -> Victim {
    let manifest = s.tmp.path().join("victim.yaml");
    let volume = |name: &str| {
        format!(
            "apiVersion: moor/v1\nkind: Volume\nmetadata: {{name: {name}}}\nspec:\n  plugin_id: {PLUGIN}\n  capacity_min: 1MiB\n  secrets: {{token: {VICTIM_SECRET}}}\n  capabilities:\n    - {{access_mode: single-node-writer, attachment_mode: file-system}}\n---\n"
        )
    };
    std::fs::write(
        &manifest,
        volume("vv1")
            + &volume("vv2")
            + "apiVersion: moor/v1\nkind: Allocation\nmetadata: {name: va1}\nspec:\n  node: n1\n  volumes:\n    - {name: data, volume: vv1}\n---\n\
               apiVersion: moor/v1\nkind: Snapshot\nmetadata: {name: vs1}\nspec: {volume: vv2}\n",
    )
    .unwrap();
    let out = s.moorctl(
        "moor-controller",
        Some(&s.cluster_keys),
        &["apply", "-f", manifest.to_str().unwrap()],
    );
    assert!(out.status.success(), "{out:?}");
    let ns = Namespace::default_ns();
    wait_for("the victim's claim published on n1", T, || async {
        claim_phase(operator, "n1", &ns, "va1.data").await == Some(ClaimPhase::Published)
    })
    .await;
    let vs1 = Snapshot::key_for(&ns, "vs1");
    wait_object(operator, &vs1, "the victim's snapshot ready", |s| {
        s.status.ready_to_use
    })
    .await;
    let mut volumes = Vec::new();
    let mut paths = Vec::new();
    for name in ["vv1", "vv2"] {
        let v = operator.get(&Volume::key_for(&ns, name)).await.unwrap();
        let ext = v.status.provisioning.external_id.clone().unwrap();
        volumes.push((name.to_string(), v.metadata.uid.clone(), ext));
        paths.extend(v.status.provisioning.volume_context.get("path").cloned());
    }
    let out = s.moorctl(
        "moor-controller",
        Some(&s.cluster_keys),
        &["volume", "snapshot", "create", "vg1", "--group", "vv1,vv2"],
    );
    assert!(out.status.success(), "{out:?}");
    let group_key = VolumeGroupSnapshot::key_for(&ns, "vg1");
    wait_object(
        operator,
        &group_key,
        "the victim's group snapshot ready",
        |g| g.status.ready_to_use,
    )
    .await;
    let group = operator.get(&group_key).await.unwrap();
    let snap = operator.get(&Snapshot::key_for(&ns, "vs1")).await.unwrap();
    // The workload, on n1 with vv2, in a cgroup of its own (CI runs as root with
    // cgroup2, as tests/workload.rs needs too).
    let pidfile = s.tmp.path().join("victim.pid");
    let script = format!(
        "echo $$ > {p}; trap 'exit 0' TERM; echo started; while :; do sleep 0.1; done",
        p = pidfile.display()
    );
    let mut child = s
        .cmd("moorctl", "moor-controller", Some(&s.cluster_keys))
        .args([
            "alloc", "run", "vw1", "--node", "n1", "--volume", "data=vv2",
        ])
        .args(["--", "sh", "-c", &script])
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn moorctl alloc run");
    let stdout = child.stdout.take().expect("stdout");
    let runner = Ends(child);
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("read the workload's first line");
    assert_eq!(line.trim(), "started", "the victim's workload runs");
    let pid = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .to_string();
    let cgroup = operator
        .get(&Allocation::key_for(&ns, "vw1"))
        .await
        .unwrap()
        .spec
        .workload_cgroup
        .expect("the victim's workload cgroup is on its allocation (root with cgroup2)");
    Victim {
        runner,
        pid,
        cgroup,
        operator: operator.clone(),
        volumes,
        snapshot: "vs1".into(),
        snapshot_id: snap.status.snapshot_id.unwrap(),
        group_id: group.status.group_snapshot_id.clone().unwrap(),
        members: group
            .status
            .members
            .iter()
            .map(|m| m.snapshot_id.clone())
            .collect(),
        paths,
    }
}

/// Waits (with the deadline) until the object at `key` exists and `ok` holds of it.
async fn wait_object<S: Spec>(
    store: &Store,
    key: &ObjectKey<S>,
    what: &str,
    ok: impl Fn(&Object<S>) -> bool,
) {
    let ok = &ok;
    wait_for(what, T, || async move {
        store
            .try_get(key)
            .await
            .ok()
            .flatten()
            .is_some_and(|o| ok(&o))
    })
    .await;
}

async fn claim_phase(store: &Store, node: &str, ns: &Namespace, name: &str) -> Option<ClaimPhase> {
    let key = Claim::key_for(&NodeName::new(node).unwrap(), ns, name);
    store
        .try_get(&key)
        .await
        .ok()
        .flatten()
        .map(|c| c.status.phase)
}

fn name(n: &str) -> Name {
    Name::new(n).unwrap()
}

fn hostpath_volume(ns: &Namespace, n: &str) -> Volume {
    Volume::new(
        ns,
        name(n),
        VolumeSpec {
            plugin_id: PluginId::new(PLUGIN).unwrap(),
            capacity_min: Some(Size(1 << 20)),
            capabilities: vec![VolumeCapability {
                access_mode: AccessMode::SingleNodeWriter,
                attachment_mode: AttachmentMode::FileSystem,
            }],
            ..Default::default()
        },
    )
}

fn allocation_on_n2(ns: &Namespace, n: &str, volume: &str) -> Allocation {
    allocation_on(ns, n, volume, "n2")
}

fn allocation_on(ns: &Namespace, n: &str, volume: &str, node: &str) -> Allocation {
    Allocation::new(
        ns,
        name(n),
        AllocationSpec {
            node: NodeName::new(node).unwrap(),
            volumes: vec![VolumeRequest {
                name: name("data"),
                volume: VolumeId::new(volume).unwrap(),
                ..Default::default()
            }],
            ..Default::default()
        },
    )
}

/// An adversary with `who`'s identity writing namespace `ns`, once its own volume is
/// published on n2 (its own objects named with `tag`). An identity that may write
/// nothing there (a viewer) takes the namespace's untagged objects as its own.
async fn adversary(s: &Secure, who: &'static str, ns: &str, tag: &'static str) -> Adversary {
    let ns = Namespace::new(ns).unwrap();
    let store = s.store(who, None).await;
    let raw = s.raw(who).await;
    let (own, spare) = (format!("{tag}own"), format!("{tag}spare"));
    let writes = match store.create(&hostpath_volume(&ns, &own)).await {
        Ok(_) => true,
        Err(e) if e.is_permission_denied() => false,
        Err(e) => panic!("{who}: its own volume: {e}"),
    };
    let (own, spare) = if writes {
        // A volume of its own it has not used yet, for a forged context.
        store.create(&hostpath_volume(&ns, &spare)).await.unwrap();
        store
            .create(&allocation_on_n2(&ns, &own, &own))
            .await
            .unwrap();
        (own, spare)
    } else {
        ("own".to_string(), "spare".to_string())
    };
    let operator = s.store("moor-controller", Some(&s.cluster_keys)).await;
    let what = format!("{who}'s own claim published on n2");
    wait_for(&what, T, || async {
        claim_phase(&operator, "n2", &ns, &format!("{own}.data")).await
            == Some(ClaimPhase::Published)
    })
    .await;
    let spare_key = Volume::key_for(&ns, spare.as_str());
    wait_object(
        &store,
        &spare_key,
        &format!("{who}'s spare volume created"),
        |v| v.status.provisioning.phase == VolumePhase::Ready,
    )
    .await;
    let volume = store
        .get(&Volume::key_for(&ns, own.as_str()))
        .await
        .unwrap();
    let mut snapshot_finalizers = Vec::new();
    // An engine-serving node may not write snapshots, nor a viewer.
    let snap = Snapshot::new(
        &ns,
        name(&own),
        SnapshotSpec {
            volume: VolumeId::new(&own).unwrap(),
            ..Default::default()
        },
    );
    let key = Snapshot::key_for(&ns, own.as_str());
    if !writes || store.create(&snap).await.is_ok() {
        if let Ok(Some(_)) = store.try_get(&key).await {
            wait_object(&store, &key, &format!("{who}'s own snapshot ready"), |s| {
                s.status.ready_to_use
            })
            .await;
            snapshot_finalizers = store.get(&key).await.unwrap().metadata.finalizers;
        }
    }
    Adversary {
        who,
        ns,
        own,
        spare,
        tag,
        raw,
        store,
        volume_finalizers: volume.metadata.finalizers,
        snapshot_finalizers,
        tried: Vec::new(),
        denied: 0,
        puts: 0,
    }
}

impl Adversary {
    /// Writes `obj` as it is (status, finalizers, uid and all) at its key: the raw
    /// write any holder of the grant can make. Whether etcd allowed it.
    async fn put<S: Spec>(&mut self, obj: &Object<S>) -> bool {
        let key = format!("/moor/{}", obj.key());
        // Stamped as a create would (a uid, generation 1, a creation time) unless the
        // forgery chose its own.
        let mut obj = obj.clone();
        let meta = &mut obj.metadata;
        if meta.uid.is_empty() {
            meta.uid = Uid::random();
        }
        meta.generation = meta.generation.max(1);
        meta.creation_timestamp.get_or_insert_with(Timestamp::now);
        let value = serde_json::to_vec(&obj).unwrap();
        self.puts += 1;
        match self.raw.put(key.clone(), value, None).await {
            Ok(_) => true,
            Err(e) => {
                assert!(secure::denied(&e), "{}: put {key}: {e}", self.who);
                self.denied += 1;
                false
            }
        }
    }

    fn fresh(&self, what: &str) -> String {
        format!("{}x{}-{what}", self.tag, self.tried.len())
    }
}

/// One forgery, chosen by `rng`, with whatever `a`'s grants allow.
async fn forge(a: &mut Adversary, v: &Victim, rng: &mut fastrand::Rng) {
    let (vname, vuid, vext) = v.volumes[rng.usize(..v.volumes.len())].clone();
    let ns = a.ns.clone();
    let (own, spare) = (a.own.clone(), a.spare.clone());
    let op = rng.usize(..13);
    let n = a.fresh(&op.to_string());
    let forged_volume = |status_ext: bool| {
        let mut vol = hostpath_volume(&ns, &n);
        if status_ext {
            vol.status.provisioning.phase = VolumePhase::Ready;
            vol.status.provisioning.external_id = Some(vext.clone());
        }
        vol
    };
    let what = match op {
        // A registration of the victim's plugin volume, used on n2.
        0 => {
            let mut vol = forged_volume(false);
            vol.spec.external_id = Some(vext.clone());
            vol.spec.capacity_min = None;
            a.put(&vol).await;
            a.put(&allocation_on_n2(&ns, &n, &n)).await;
            "register"
        }
        // A status naming the victim's plugin volume, with the provisioner's
        // finalizers, then deleted.
        1 => {
            let mut vol = forged_volume(true);
            vol.metadata.finalizers = a.volume_finalizers.clone();
            vol.metadata.uid = Uid::random();
            a.put(&vol).await;
            let _ = a.store.delete(&Volume::key_for(&ns, &n), None).await;
            "status-then-delete"
        }
        // The same status, used on n2.
        2 => {
            let mut vol = forged_volume(true);
            vol.metadata.finalizers = a.volume_finalizers.clone();
            a.put(&vol).await;
            a.put(&allocation_on_n2(&ns, &n, &n)).await;
            "status-then-use"
        }
        // The victim's uid (which older versions named CreateVolume by); used on n2.
        3 => {
            let mut vol = forged_volume(false);
            vol.metadata.uid = vuid.clone();
            a.put(&vol).await;
            a.put(&allocation_on_n2(&ns, &n, &n)).await;
            "copied-uid"
        }
        // A clone of a volume whose status names the victim's.
        4 => {
            let src = forged_volume(true);
            a.put(&src).await;
            let mut clone = hostpath_volume(&ns, &format!("{n}c"));
            clone.spec.source = Some(VolumeSource::Volume(VolumeId::new(&n).unwrap()));
            a.put(&clone).await;
            "clone"
        }
        // A restore of the victim's snapshot by its plugin id.
        5 => {
            let mut vol = forged_volume(false);
            vol.spec.source = Some(VolumeSource::ExternalSnapshotId(v.snapshot_id.clone()));
            a.put(&vol).await;
            "restore-by-id"
        }
        // An import of the victim's snapshot, then a restore of it.
        6 => {
            let snap = Snapshot::new(
                &ns,
                name(&n),
                SnapshotSpec {
                    volume: VolumeId::new(&own).unwrap(),
                    snapshot_id: Some(v.snapshot_id.clone()),
                    ..Default::default()
                },
            );
            a.put(&snap).await;
            let mut vol = hostpath_volume(&ns, &format!("{n}r"));
            vol.spec.source = Some(VolumeSource::Snapshot(name(&n)));
            a.put(&vol).await;
            "import"
        }
        // A snapshot whose status names the victim's, as cut (deleted) or being cut
        // (polled).
        7 => {
            let mut snap = Snapshot::new(
                &ns,
                name(&n),
                SnapshotSpec {
                    volume: VolumeId::new(&own).unwrap(),
                    ..Default::default()
                },
            );
            snap.metadata.finalizers = a.snapshot_finalizers.clone();
            snap.status.plugin_id = Some(PluginId::new(PLUGIN).unwrap());
            snap.status.snapshot_id = Some(v.snapshot_id.clone());
            snap.status.source_volume_id = Some(vext.to_string());
            let deleted = rng.bool();
            if deleted {
                snap.status.phase = SnapshotPhase::Ready;
                snap.status.ready_to_use = true;
            }
            a.put(&snap).await;
            if deleted {
                let _ = a.store.delete(&Snapshot::key_for(&ns, &n), None).await;
            }
            if deleted {
                "snapshot-status-then-delete"
            } else {
                "snapshot-status-polled"
            }
        }
        // A snapshot of a volume whose status names the victim's.
        8 => {
            a.put(&forged_volume(true)).await;
            let snap = Snapshot::new(
                &ns,
                name(&format!("{n}s")),
                SnapshotSpec {
                    volume: VolumeId::new(&n).unwrap(),
                    ..Default::default()
                },
            );
            a.put(&snap).await;
            "snapshot-of-forged"
        }
        // A group snapshot whose status names the victim's group and members (the
        // group snapshotter's finalizer is public), deleted or left to be polled; or
        // an import of the victim's group.
        9 => {
            let mut group = VolumeGroupSnapshot::new(
                &ns,
                name(&n),
                VolumeGroupSnapshotSpec {
                    volumes: vec![VolumeId::new(&own).unwrap()],
                    ..Default::default()
                },
            );
            let import = rng.u8(..3);
            if import == 0 {
                group.spec.group_snapshot_id = Some(v.group_id.clone());
            } else {
                group.metadata.finalizers = vec![Term::new("moor.dev/group-snapshotter")];
                let st = &mut group.status;
                st.plugin_id = Some(PluginId::new(PLUGIN).unwrap());
                st.group_snapshot_id = Some(v.group_id.clone());
                st.source_volume_ids = vec![vext.to_string()];
                st.members = v
                    .members
                    .iter()
                    .map(|id| GroupMember {
                        volume: VolumeId::new(&own).unwrap(),
                        snapshot: name(&format!("{n}-own")),
                        snapshot_id: id.clone(),
                        source_volume_id: vext.to_string(),
                        size_bytes: None,
                    })
                    .collect();
                st.phase = if import == 1 {
                    SnapshotPhase::Ready
                } else {
                    SnapshotPhase::Creating
                };
                st.ready_to_use = import == 1;
            }
            a.put(&group).await;
            if import == 1 {
                let _ = a
                    .store
                    .delete(&VolumeGroupSnapshot::key_for(&ns, &n), None)
                    .await;
            }
            [
                "group-import",
                "group-status-then-delete",
                "group-status-polled",
            ][import as usize]
        }
        // Its own volume's status says the victim's data is its data (the plugin's
        // context names the directory); then used on n2.
        10 => {
            let key = Volume::key_for(&ns, spare.as_str());
            if let Ok(mut forged) = a.store.get(&key).await {
                let path = v.paths[rng.usize(..v.paths.len())].clone();
                forged
                    .status
                    .provisioning
                    .volume_context
                    .insert("path".into(), path);
                a.put(&forged).await;
                a.put(&allocation_on_n2(&ns, &n, &spare)).await;
            }
            "forged-context"
        }
        // Garbage where the victim's names would be, and a copy of the victim's
        // volume under its own name (status and all).
        11 => {
            let key = format!("/moor/volumes/{ns}/{vname}");
            let garbage: Vec<u8> = (0..rng.usize(1..200)).map(|_| rng.u8(..)).collect();
            let _ = a.raw.put(key, garbage, None).await;
            let mut copy = forged_volume(true);
            copy.metadata.name = name(&vname);
            copy.metadata.uid = vuid.clone();
            copy.metadata.finalizers = a.volume_finalizers.clone();
            a.put(&copy).await;
            a.put(&allocation_on_n2(&ns, &n, &vname)).await;
            "garbage-and-copy"
        }
        // An allocation on n1 (the victim's workload's node) naming the victim's
        // workload cgroup, running until its claim is published, then ended: its
        // release must signal nothing there.
        _ => {
            a.put(&forged_volume(false)).await;
            let mut alloc = allocation_on(&ns, &n, &n, "n1");
            alloc.spec.client_status = ClientStatus::Running;
            alloc.spec.workload_cgroup = Some(v.cgroup.clone());
            // One allocation, ended: the same uid, the next generation.
            alloc.metadata.uid = Uid::random();
            if a.put(&alloc).await {
                // Published (or, at the deadline, not): ended either way.
                let claim = format!("{n}.data");
                let deadline = Instant::now() + Duration::from_secs(30);
                while Instant::now() < deadline
                    && claim_phase(&v.operator, "n1", &ns, &claim).await
                        != Some(ClaimPhase::Published)
                {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                alloc.spec.client_status = ClientStatus::Failed;
                alloc.metadata.generation = 2;
                a.put(&alloc).await;
            }
            "cgroup"
        }
    };
    a.tried.push(what.to_string());
}

/// A Mount node n2 writes as an orphan naming one of the victim's plugin volumes, in
/// the victim's namespace (which n2 never served) or in namespace `a` (which it did);
/// where it is, to adopt.
async fn forge_orphan(s: &Secure, v: &Victim, rng: &mut fastrand::Rng) -> (String, String) {
    let (vname, _, vext) = v.volumes[rng.usize(..v.volumes.len())].clone();
    let ns = if rng.bool() {
        Namespace::default_ns()
    } else {
        Namespace::new("a").unwrap()
    };
    let claim = format!("o{}.data", rng.u32(..));
    let mut m = Mount::new(
        &ns,
        name(&claim),
        MountSpec {
            claim: name(&claim),
            allocation: AllocationId::new(claim.split('.').next().unwrap()).unwrap(),
            volume: VolumeId::new(if rng.bool() { &vname } else { "own" }).unwrap(),
            node: NodeName::new("n2").unwrap(),
            claim_uid: Uid::random(),
            staging_path: None,
            target_path: format!("/forged/{claim}"),
        },
    );
    m.status.published = true;
    m.status.orphan = Some(Box::new(Orphan {
        since: Timestamp::now(),
        plugin_id: PluginId::new(PLUGIN).unwrap(),
        external_id: vext,
        request: Some(name("data")),
        mode: ClaimMode::Write,
        holders: Vec::new(),
        capability: VolumeCapability {
            access_mode: AccessMode::SingleNodeWriter,
            attachment_mode: AttachmentMode::FileSystem,
        },
    }));
    let mut raw = s.raw("moor-agent-n2").await;
    let key = format!("/moor/{}", m.key());
    raw.put(key.clone(), serde_json::to_vec(&m).unwrap(), None)
        .await
        .unwrap_or_else(|e| panic!("n2 writes its own mount {key}: {e}"));
    (ns.to_string(), claim)
}

/// What the identities that may write no request of the victim's try: the console
/// (read-only) and the agent hosting another plugin's controller (n4, plugin
/// `other.example`), each at every key of the victim's that moor acts on and is not
/// theirs: its requests, claims, mounts, the plugin's ownership records, Secrets,
/// election and capacity report, its attachments, volumes, snapshots and groups and the
/// plugin's reports on them. etcd must refuse each write (and each read of the plugin's
/// Secrets); returns how many it refused.
async fn confined(s: &Secure, v: &Victim, seed: u64) -> usize {
    let (vname, _, vext) = &v.volumes[0];
    let record = Ownership::key_for(
        &PluginId::new(PLUGIN).unwrap(),
        OwnedResource::Volume,
        vext.as_str(),
    );
    let theirs = [
        format!(
            "owners/{PLUGIN}/{}",
            record.as_str().rsplit('/').next().unwrap()
        ),
        format!("secrets/{PLUGIN}/default/forged"),
        format!("leaders/plugin.{PLUGIN}"),
        format!("capacities/{PLUGIN}"),
        "claims/n1/default/va1.data".to_string(),
        "mounts/n1/default/va1.data".to_string(),
        "nodes/n1".to_string(),
        "allocations/default/va1".to_string(),
        // The victim's attachment (which the controller alone writes: a rewrite
        // would publish its volume to a node of n4's choosing) and the victim
        // plugin's report on it (which would say it is attached, or detached).
        format!("attachments/default/{vname}/n1"),
        format!("attachment-reports/{PLUGIN}/default/{vname}/n1"),
        // The victim's volume (marked deleted, its leader would delete the data) and
        // the victim plugin's report on it.
        format!("volumes/default/{vname}"),
        format!("volume-reports/{PLUGIN}/default/{vname}"),
        // The victim's snapshot and group (marked deleted, their leader would delete
        // them in the plugin; a group's members made by hand would name any ids) and
        // the victim plugin's reports on them.
        format!("snapshots/default/{}", v.snapshot),
        format!("snapshot-reports/{PLUGIN}/default/{}", v.snapshot),
        "groupsnapshots/default/vg1".to_string(),
        format!("groupsnapshot-reports/{PLUGIN}/default/vg1"),
        "snapshots/default/vg1-forged".to_string(),
    ];
    let mut refused = 0;
    for who in ["moor-console", "moor-agent-n4"] {
        let mut raw = s.raw(who).await;
        for key in &theirs {
            let key = format!("/moor/{key}");
            match raw.put(key.clone(), b"{}".to_vec(), None).await {
                Err(e) if secure::denied(&e) => refused += 1,
                other => panic!("seed {seed}: {who} put {key}: {other:?}"),
            }
        }
        let secrets = format!("/moor/secrets/{PLUGIN}/");
        let read = raw
            .get(
                secrets.clone(),
                Some(etcd_client::GetOptions::new().with_prefix()),
            )
            .await;
        match read {
            Err(e) if secure::denied(&e) => refused += 1,
            other => panic!("seed {seed}: {who} read {secrets}: {other:?}"),
        }
    }
    refused
}

/// n4 (another plugin's controller) reports on the victim's attachment on n1, its
/// volume, its snapshot and its group under its own plugin's prefix, which its grant
/// allows: Detached, with a publish context of its own; Failed, another id, released;
/// another snapshot id; another group id with a member of its choosing, released. The
/// controller takes only the report of the object's own plugin: the attachment must
/// stay as it was (returned, as read before), and `check_victim` finds the volume,
/// snapshot and group as they were and no member made.
async fn forge_report(
    s: &Secure,
    v: &Victim,
    operator: &Store,
    rng: &mut fastrand::Rng,
) -> Attachment {
    let (vname, _, _) = &v.volumes[0];
    let n1 = NodeName::new("n1").unwrap();
    let key = Attachment::key_for(&Namespace::default_ns(), vname, &n1);
    let att = operator
        .get(&key)
        .await
        .expect("the victim's attachment on n1");
    assert_eq!(att.status.phase, AttachmentPhase::Attached, "{att:?}");
    let status = AttachmentStatus {
        phase: AttachmentPhase::Detached,
        publish_context: [("forged".to_string(), "by n4".to_string())].into(),
        ..Default::default()
    };
    // Its spec names n4's plugin, as its key does (a spec naming the victim's plugin
    // under n4's key is malformed: decoding checks an object's key).
    let other = PluginId::new("other.example").unwrap();
    let mut report = AttachmentReport::of(&other, &att, status, FinalizerAsk::Unasked);
    report.metadata.uid = "0b4c2f7e-3d1a-4e5b-9c6d-7a8b9c0d1e2f".into();
    if rng.bool() {
        // Or about an attachment it only guesses the uid of.
        report.spec.uid = "5f1e2d3c-4b5a-4697-8887-a6b5c4d3e2f1".into();
    }
    let at = format!("/moor/attachment-reports/other.example/default/{vname}/n1");
    let mut raw = s.raw("moor-agent-n4").await;
    raw.put(at.clone(), serde_json::to_vec(&report).unwrap(), None)
        .await
        .unwrap_or_else(|e| panic!("n4 writes its own plugin's report {at}: {e}"));
    // And on the victim's volume: failed, naming another plugin volume, released (the
    // controller would drop the provisioner's finalizer). `check_victim` finds the
    // volume Ready with its own id and record.
    let vol = operator
        .get(&Volume::key_for(&Namespace::default_ns(), vname))
        .await
        .expect("the victim's volume");
    let forged = ProvisioningStatus {
        phase: VolumePhase::Failed,
        external_id: Some(ExternalVolumeId::new("forged-by-n4").unwrap()),
        ..Default::default()
    };
    let mut report = VolumeReport::of(&other, &vol, forged, FinalizerAsk::Released);
    report.metadata.uid = "1c5d3e8f-4e2b-4f6c-8d7e-8b9cad1e2f30".into();
    let at = format!("/moor/volume-reports/other.example/default/{vname}");
    raw.put(at.clone(), serde_json::to_vec(&report).unwrap(), None)
        .await
        .unwrap_or_else(|e| panic!("n4 writes its own plugin's report {at}: {e}"));
    let ns = Namespace::default_ns();
    let snap = operator
        .get(&Snapshot::key_for(&ns, &v.snapshot))
        .await
        .expect("the victim's snapshot");
    let forged = SnapshotStatus {
        phase: SnapshotPhase::Ready,
        plugin_id: Some(other.clone()),
        snapshot_id: Some("forged-by-n4".into()),
        ready_to_use: true,
        ..Default::default()
    };
    let report = SnapshotReport::of(&other, &snap, forged, FinalizerAsk::Released);
    let at = format!(
        "/moor/snapshot-reports/other.example/default/{}",
        v.snapshot
    );
    raw.put(at.clone(), serde_json::to_vec(&report).unwrap(), None)
        .await
        .unwrap_or_else(|e| panic!("n4 writes its own plugin's report {at}: {e}"));
    let group = operator
        .get(&VolumeGroupSnapshot::key_for(&ns, "vg1"))
        .await
        .expect("the victim's group");
    let mut forged = group.status.clone();
    forged.plugin_id = Some(other.clone());
    forged.group_snapshot_id = Some("forged-by-n4".into());
    forged.members = vec![GroupMember {
        volume: VolumeId::new(vname).unwrap(),
        snapshot: Name::new("vg1-forged").unwrap(),
        snapshot_id: "forged-by-n4".into(),
        source_volume_id: "forged-by-n4".into(),
        size_bytes: None,
    }];
    forged.meta.conditions.clear();
    let report = VolumeGroupSnapshotReport::of(&other, &group, forged, FinalizerAsk::Released);
    let at = "/moor/groupsnapshot-reports/other.example/default/vg1".to_string();
    raw.put(at.clone(), serde_json::to_vec(&report).unwrap(), None)
        .await
        .unwrap_or_else(|e| panic!("n4 writes its own plugin's report {at}: {e}"));
    att
}

/// Reasons of the events n2 forges: no view shows them.
const FORGED_EVENT: &str = "Forged by n2";

/// An event n2 writes under its own prefix about one of the victim's objects (on n1,
/// where n2 never was): its own source, or the controller's (a lie its key belies).
async fn forge_event(s: &Secure, v: &Victim, rng: &mut fastrand::Rng) {
    let (vname, _, _) = v.volumes[rng.usize(..v.volumes.len())].clone();
    let ns = Namespace::default_ns();
    let (kind, about) = if rng.bool() {
        ("Volume", vname)
    } else {
        ("Claim", "va1.data".to_string())
    };
    let source = if rng.bool() { "agent/n2" } else { "controller" };
    let n = format!("e{}", rng.u32(..));
    let mut e = Event::new(
        &ns,
        name(&n),
        EventSpec {
            reason: FORGED_EVENT.into(),
            message: format!("{about}'s data was deleted"),
            type_: EventType::Warning,
            object: ObjectRef {
                kind: kind.into(),
                namespace: ns.clone(),
                name: name(&about),
            },
            source: source.into(),
            time: Some(Timestamp::now()),
            ..Default::default()
        },
    );
    e.metadata.uid = Uid::random();
    e.metadata.creation_timestamp = Some(Timestamp::now());
    let key = format!("/moor/events/node/n2/{ns}/{n}");
    let mut raw = s.raw("moor-agent-n2").await;
    raw.put(key.clone(), serde_json::to_vec(&e).unwrap(), None)
        .await
        .unwrap_or_else(|e| panic!("n2 writes its own event {key}: {e}"));
}

/// No view an operator reads shows n2's forged events about the victim's objects.
fn check_events(s: &Secure, v: &Victim, seed: u64) {
    let keys = Some(s.cluster_keys.as_path());
    let mut views: Vec<Vec<String>> = vec![
        vec!["events".into()],
        vec!["events".into(), "--for".into(), "claim/va1.data".into()],
    ];
    for (vname, _, _) in &v.volumes {
        views.push(vec![
            "events".into(),
            "--for".into(),
            format!("volume/{vname}"),
        ]);
        views.push(vec!["describe".into(), "volume".into(), vname.clone()]);
    }
    for args in views {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = s.moorctl("moor-controller", keys, &args);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "seed {seed}: moorctl {args:?}: {out:?}"
        );
        assert!(
            !text.contains(FORGED_EVENT),
            "seed {seed}: moorctl {args:?} shows n2's forged event:\n{text}"
        );
    }
}

/// The victim's objects are as they were: volumes Ready with their plugin ids and
/// owned by them, the snapshot ready with its id, the claim published on n1.
async fn check_victim(operator: &Store, v: &Victim, seed: u64) {
    let ns = Namespace::default_ns();
    for (vname, uid, ext) in &v.volumes {
        let vol = operator.get(&Volume::key_for(&ns, vname)).await.unwrap();
        assert_eq!(
            (
                &vol.metadata.uid,
                vol.status.provisioning.phase,
                vol.status.provisioning.external_id.as_ref()
            ),
            (uid, VolumePhase::Ready, Some(ext)),
            "seed {seed}: victim volume {vname}"
        );
        let rec = operator
            .get(&Ownership::key_for(
                &vol.spec.plugin_id,
                OwnedResource::Volume,
                ext.as_str(),
            ))
            .await
            .unwrap();
        assert!(
            owned_by(&rec, &vol),
            "seed {seed}: {vname}'s record: {rec:?}"
        );
    }
    let snap = operator
        .get(&Snapshot::key_for(&ns, &v.snapshot))
        .await
        .unwrap();
    assert!(
        snap.status.ready_to_use
            && snap.status.snapshot_id.as_deref() == Some(v.snapshot_id.as_str())
            && snap.status.plugin_id.as_ref().map(|p| p.as_str()) == Some(PLUGIN)
            && !snap.is_deleting(),
        "seed {seed}: victim snapshot {snap:?}"
    );
    let group = operator
        .get(&VolumeGroupSnapshot::key_for(&ns, "vg1"))
        .await
        .unwrap();
    assert!(
        group.status.ready_to_use
            && group.status.group_snapshot_id.as_deref() == Some(v.group_id.as_str())
            && group.status.plugin_id.as_ref().map(|p| p.as_str()) == Some(PLUGIN)
            && group
                .metadata
                .finalizers
                .iter()
                .any(|f| f == GROUP_SNAPSHOTTER_FINALIZER),
        "seed {seed}: victim group {group:?}"
    );
    let forged_member = operator
        .try_get(&Snapshot::key_for(&ns, "vg1-forged"))
        .await
        .unwrap();
    assert!(
        forged_member.is_none(),
        "seed {seed}: a member named by n4's report was made: {forged_member:?}"
    );
    for claim in ["va1.data", "vw1.data"] {
        assert_eq!(
            claim_phase(operator, "n1", &ns, claim).await,
            Some(ClaimPhase::Published),
            "seed {seed}: the victim's claim {claim}"
        );
    }
    assert!(
        alive(&v.pid),
        "seed {seed}: the victim's workload {} (cgroup {}) was killed",
        v.pid,
        v.cgroup
    );
    // Nothing of the victim's namespace appeared on n2.
    let on_n2 = operator
        .list(&Claim::node_scope(&NodeName::new("n2").unwrap()))
        .await
        .unwrap();
    let theirs: BTreeMap<String, ClaimPhase> = on_n2
        .items
        .iter()
        .filter(|c| c.metadata.namespace == ns)
        .map(|c| (c.key(), c.status.phase))
        .collect();
    assert!(
        theirs.is_empty(),
        "seed {seed}: victim claims on n2: {theirs:?}"
    );
}

/// No claim n2 can open (its node key) carries the victim's secret.
async fn check_secrets(s: &Secure, seed: u64) {
    let n2 = s.store("moor-agent-n2", Some(&s.n2_keys)).await;
    let claims = n2
        .list(&Claim::node_scope(&NodeName::new("n2").unwrap()))
        .await
        .unwrap();
    for c in claims.items {
        let text = serde_json::to_string(&c.spec).unwrap();
        assert!(
            !text.contains(VICTIM_SECRET),
            "seed {seed}: {} on n2 carries the victim's secret",
            c.key()
        );
    }
}

/// What moor made of the forgeries (`MOOR_HOSTILE_SHOW`): each forged volume's and
/// snapshot's phase and last condition, and the acting calls after the baseline.
async fn show(operator: &Store, calls: &[Call]) {
    for ns in ["a", "engines"] {
        let ns = Namespace::new(ns).unwrap();
        for v in operator
            .list::<VolumeSpec>(&KeyScope::namespace(&ns).unwrap())
            .await
            .unwrap()
            .items
        {
            let c = v.status.provisioning.meta.conditions.last();
            eprintln!(
                "hostile: volume {} {:?} {:?}",
                v.key(),
                v.status.provisioning.phase,
                c.map(|c| (&c.reason, &c.message))
            );
        }
        for sn in operator
            .list::<SnapshotSpec>(&KeyScope::namespace(&ns).unwrap())
            .await
            .unwrap()
            .items
        {
            let c = sn.status.meta.conditions.last();
            eprintln!(
                "hostile: snapshot {} {:?} {:?}",
                sn.key(),
                sn.status.phase,
                c.map(|c| (&c.reason, &c.message))
            );
        }
    }
    for c in calls.iter().filter(|c| acts(c)) {
        eprintln!(
            "hostile: call {} {} vol={:?} snap={:?} result={:?} {:?}",
            c.plugin_node, c.rpc, c.volume_id, c.snapshot_id, c.result_volume_id, c.message
        );
    }
}
