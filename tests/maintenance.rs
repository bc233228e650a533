//! Taking nodes and volumes out of service (issue 54, parts 1 and 2): cordon, drain and
//! uncordon a node; pause, drain and activate a volume; a plugin still needed on a dead
//! node is not deregistered. A real etcd, `moord controller`, agents with their
//! moor-hostpath, and `moorctl alloc run` runners as real processes; the plugins' call
//! logs are checked against the invariants.

#[path = "common/cluster.rs"]
mod cluster;
mod common;

use cluster::{Cluster, PluginOpts};
use moor::api::*;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tokio::sync::Semaphore;

static SLOTS: Semaphore = Semaphore::const_new(2);

const T: Duration = Duration::from_secs(30);

/// Spawns `moorctl alloc run NAME --node NODE --volume data=VOLUME -- sh -c ...` whose
/// workload prints `started` and sleeps; returns once it runs.
fn run(c: &Cluster, name: &str, node: &str, volume: &str) -> Child {
    let mut child = Command::new(common::bin("moorctl"))
        .arg(format!("--endpoints={}", c.etcd.client_url))
        .args(["alloc", "run", name, "--node", node, "--volume"])
        .arg(format!("data={volume}"))
        .args(["--", "sh", "-c", "echo started; exec sleep 600"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn moorctl alloc run");
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().expect("stdout"))
        .read_line(&mut line)
        .expect("the workload's first line");
    assert_eq!(line.trim(), "started", "{name} runs");
    child
}

/// Waits (with a deadline) until `child` exits.
async fn exited(c: &Cluster, what: &str, child: &mut Child) {
    c.wait(what, T, || {
        let done = child.try_wait().ok().flatten().is_some();
        async move { done }
    })
    .await;
}

/// The claim `alloc`.data on `node`.
async fn claim(c: &Cluster, alloc: &str, node: &str) -> Option<Claim> {
    c.claim(alloc, node).await
}

async fn volume(c: &Cluster, name: &str) -> Volume {
    c.store
        .get(&Volume::key_for(&Namespace::default_ns(), name))
        .await
        .unwrap()
}

/// A claim that waits says why, in its status.
async fn wait_reason(c: &Cluster, alloc: &str, node: &str, says: &str) {
    c.wait(&format!("{alloc} on {node} waiting: {says}"), T, || async {
        claim(c, alloc, node).await.is_some_and(|k| {
            k.status.phase == ClaimPhase::Pending
                && k.status.reason.as_deref().is_some_and(|r| r.contains(says))
        })
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cordoned_node_admits_nothing_new_and_a_drain_returns_once_its_holders_are_gone() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 2, PluginOpts::default()).await;
    for v in ["v1", "v2", "v3"] {
        c.apply(c.volume(v, AccessMode::SingleNodeWriter)).await;
        c.volume_ready(v).await;
    }
    // On n2: a workload under `alloc run` (a runner that can be stopped) and a plain
    // allocation (no runner).
    let mut runner = run(&c, "a1", "n2", "v1");
    c.apply(c.allocation("a2", "n2", "v2", false)).await;
    c.wait_claim("a2", "n2", ClaimPhase::Published, T).await;

    let (ok, out) = c.moorctl(&["node", "cordon", "n2", "--reason", "disk swap"]);
    assert!(ok, "{out}");
    let (ok, out) = c.moorctl(&["get", "cordons"]);
    assert!(
        ok && out
            .lines()
            .any(|l| l.starts_with("n2 ") && l.contains("disk swap")),
        "{out}"
    );
    // A new claim there waits, saying why; the placement answer agrees; n1 takes it.
    c.apply(c.allocation("a3", "n2", "v3", false)).await;
    wait_reason(&c, "a3", "n2", "node n2 is cordoned: disk swap").await;
    let plan = c.dir.path().join("a4.yaml");
    std::fs::write(
        &plan,
        "kind: Allocation\nmetadata: {name: a4}\nspec:\n  node: n1\n  volumes: [{name: data, volume: v3}]\n",
    )
    .unwrap();
    let (_, out) = c.moorctl(&["alloc", "plan", "-f", plan.to_str().unwrap()]);
    let row = |n: &str| {
        out.lines()
            .find(|l| l.starts_with(n))
            .unwrap_or_default()
            .to_string()
    };
    assert!(
        row("n2 ").contains("cordoned: disk swap") && row("n2 ").contains(" no "),
        "{out}"
    );
    assert!(row("n1 ").contains(" yes "), "{out}");
    // Nor is a volume made there for a template: the allocation waits, saying why.
    let mut t1 = c.allocation("t1", "n2", "unused", false);
    t1.spec.volumes[0].volume = VolumeId::default();
    t1.spec.volumes[0].template = Some(Box::new(VolumeTemplate {
        plugin_id: PluginId::new(cluster::PLUGIN).unwrap(),
        capacity_min: Some(Size(1 << 20)),
        ..Default::default()
    }));
    c.apply(t1).await;
    c.wait("t1 waits for the cordon", T, || async {
        c.store
            .get(&Allocation::key_for(&Namespace::default_ns(), "t1"))
            .await
            .unwrap()
            .status
            .meta
            .last_error
            .is_some_and(|e| e.contains("node n2 is cordoned"))
    })
    .await;
    assert!(
        c.store
            .try_get(&Volume::key_for(&Namespace::default_ns(), "t1.data"))
            .await
            .unwrap()
            .is_none(),
        "no volume is made on a cordoned node"
    );
    // What it already had stays.
    for a in ["a1", "a2"] {
        let k = claim(&c, a, "n2").await.unwrap();
        assert_eq!(k.status.phase, ClaimPhase::Published, "{a}");
    }
    // Uncordoned: admitted.
    let (ok, out) = c.moorctl(&["node", "uncordon", "n2"]);
    assert!(ok, "{out}");
    c.wait_claim("a3", "n2", ClaimPhase::Published, T).await;
    c.wait_claim("t1", "n2", ClaimPhase::Published, T).await;
    c.stop_alloc("t1").await;

    // Drain with --stop: a1's runner is stopped; a2 and a3 have none and are named as
    // holding until they are stopped by hand; then it returns.
    let mut drain = Command::new(common::bin("moorctl"))
        .arg(format!("--endpoints={}", c.etcd.client_url))
        .args(["node", "drain", "n2", "--stop", "--timeout", "60s"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn moorctl node drain");
    let mut drained = BufReader::new(drain.stdout.take().unwrap());
    let mut seen = String::new();
    while !(seen.contains("default/a2 holds volume default/v2")
        && seen.contains("plugin hostpath.moor.dev is still needed here"))
    {
        let mut line = String::new();
        assert!(
            drained.read_line(&mut line).unwrap() > 0,
            "drain ended early:\n{seen}"
        );
        seen.push_str(&line);
    }
    assert!(seen.contains("allocation default/a1 stopped"), "{seen}");
    assert!(
        seen.contains("allocation default/a2 has no runner"),
        "{seen}"
    );
    exited(&c, "a1's runner ends with its workload", &mut runner).await;
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    // Still cordoned while draining: nothing new lands there.
    let k = claim(&c, "a2", "n2").await.unwrap();
    assert_eq!(k.status.phase, ClaimPhase::Published);
    for a in ["a2", "a3"] {
        let (ok, out) = c.moorctl(&["alloc", "stop", a]);
        assert!(ok, "{out}");
    }
    let status = drain.wait().unwrap();
    drained.read_to_string(&mut seen).unwrap();
    assert!(status.success(), "{seen}");
    assert!(seen.contains("node n2 drained"), "{seen}");
    for a in ["a2", "a3"] {
        let k = claim(&c, a, "n2").await.unwrap();
        assert_eq!(k.status.phase, ClaimPhase::Released, "{a}");
    }
    let (_, out) = c.moorctl(&["get", "cordons"]);
    assert!(
        out.lines()
            .any(|l| l.starts_with("n2 ") && l.contains("yes")),
        "{out}"
    );
    c.check_calls(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_volume_keeps_its_claims_and_a_drained_one_is_released() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 2, PluginOpts::default()).await;
    c.apply(c.volume("v1", AccessMode::MultiNodeMultiWriter))
        .await;
    c.volume_ready("v1").await;
    let mut r1 = run(&c, "a1", "n1", "v1");

    let (ok, out) = c.moorctl(&["volume", "pause", "v1"]);
    assert!(ok, "{out}");
    let (_, out) = c.moorctl(&["get", "volumes"]);
    assert!(
        out.lines()
            .next()
            .unwrap_or_default()
            .contains("AVAILABILITY"),
        "{out}"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with("v1 ") && l.contains("pause")),
        "{out}"
    );
    c.apply(c.allocation("a2", "n2", "v1", false)).await;
    wait_reason(&c, "a2", "n2", "volume v1 is paused").await;
    assert_eq!(
        claim(&c, "a1", "n1").await.unwrap().status.phase,
        ClaimPhase::Published
    );
    let (ok, out) = c.moorctl(&["volume", "activate", "v1"]);
    assert!(ok, "{out}");
    c.wait_claim("a2", "n2", ClaimPhase::Published, T).await;
    let (ok, out) = c.moorctl(&["alloc", "stop", "a2"]);
    assert!(ok, "{out}");
    c.wait_claim("a2", "n2", ClaimPhase::Released, T).await;

    // Drained: a1's runner is stopped and the volume released; nothing new comes.
    let mut r3 = run(&c, "a3", "n2", "v1");
    let (ok, out) = c.moorctl(&["volume", "drain", "v1", "--timeout", "60s"]);
    assert!(ok, "{out}");
    assert!(out.contains("volume default/v1 drained"), "{out}");
    exited(&c, "a1's runner ends", &mut r1).await;
    exited(&c, "a3's runner ends", &mut r3).await;
    let v = volume(&c, "v1").await;
    assert_eq!(v.spec.availability, Availability::Drain);
    assert!(v.status.claims.read_claims.is_empty() && v.status.claims.write_claims.is_empty());
    c.apply(c.allocation("a4", "n1", "v1", false)).await;
    wait_reason(&c, "a4", "n1", "volume v1 is drained").await;
    let (ok, out) = c.moorctl(&["volume", "activate", "v1"]);
    assert!(ok, "{out}");
    c.wait_claim("a4", "n1", ClaimPhase::Published, T).await;
    c.stop_alloc("a4").await;
    c.wait_claim("a4", "n1", ClaimPhase::Released, T).await;
    c.check_calls(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_node_s_plugin_is_not_deregistered_while_it_has_volumes_to_unpublish() {
    let _slot = SLOTS.acquire().await.unwrap();
    let mut c = Cluster::start(1, 2, PluginOpts::default()).await;
    c.apply(c.volume("v1", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v1").await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    c.node_mut("n2").agent.kill();
    c.node_mut("n2").plugin.kill();
    c.wait("n2 gone", T, || async {
        c.store
            .try_get(&Node::key_for(&NodeName::new("n2").unwrap()))
            .await
            .is_ok_and(|n| n.is_none())
    })
    .await;
    let (ok, out) = c.moorctl(&["plugin", "deregister", cluster::PLUGIN, "--node", "n2"]);
    assert!(
        !ok && out.contains("default/v1") && out.contains("still has volume"),
        "{out}"
    );
    // Stopped, and released without the node (the operator declares it gone): then
    // the plugin instance may go.
    let (ok, out) = c.moorctl(&["alloc", "stop", "a1"]);
    assert!(ok, "{out}");
    let (ok, out) = c.moorctl(&["volume", "detach", "v1", "--node", "n2"]);
    assert!(ok, "{out}");
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    let (ok, out) = c.moorctl(&["plugin", "deregister", cluster::PLUGIN, "--node", "n2"]);
    assert!(ok, "{out}");
}

/// Issue 54, part 5: the Snapshots schedule `name` made, not being deleted, oldest
/// slot first.
async fn scheduled(c: &Cluster, name: &str) -> Vec<Snapshot> {
    let mut snaps: Vec<Snapshot> = c
        .store
        .list::<SnapshotSpec>(&KeyScope::all())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|s| {
            !s.is_deleting()
                && s.metadata.labels.get(SCHEDULE_LABEL).map(String::as_str) == Some(name)
        })
        .collect();
    snaps.sort_by(|a, b| {
        a.metadata
            .labels
            .get(SLOT_LABEL)
            .cmp(&b.metadata.labels.get(SLOT_LABEL))
    });
    snaps
}

/// Volume `name`, labelled `tier: TIER` when given, created and ready.
async fn labelled_volume(c: &Cluster, name: &str, tier: Option<&str>) {
    let mut v = c.volume(name, AccessMode::SingleNodeWriter);
    if let Some(t) = tier {
        *v.metadata.labels = [("tier".to_string(), t.to_string())].into();
    }
    c.apply(v).await;
    c.volume_ready(name).await;
}

fn schedule_yaml(name: &str, cadence: &str, retention: &str) -> String {
    format!(
        "apiVersion: moor/v1\nkind: SnapshotSchedule\nmetadata: {{name: {name}}}\nspec:\n  \
         selector: {{tier: gold}}\n  {cadence}\n  retention: {{{retention}}}\n"
    )
}

fn apply_yaml(c: &Cluster, name: &str, yaml: &str) {
    let path = c.dir.path().join(format!("{name}.yaml"));
    std::fs::write(&path, yaml).unwrap();
    let (ok, out) = c.moorctl(&["apply", "-f", path.to_str().unwrap()]);
    assert!(ok, "{out}");
}

async fn schedule(c: &Cluster, name: &str) -> SnapshotSchedule {
    c.store
        .get(&SnapshotSchedule::key_for(&Namespace::default_ns(), name))
        .await
        .unwrap()
}

/// The names the plugin was asked to cut (CreateSnapshot's name: a Snapshot's `plugin_name`).
fn cut_names(c: &Cluster) -> std::collections::BTreeSet<String> {
    c.node("n1")
        .calls()
        .into_iter()
        .filter(|k| k.rpc == "CreateSnapshot")
        .filter_map(|k| k.name)
        .collect()
}

/// A schedule cuts the volumes its selector picks on its interval, names and labels
/// each cut by slot, prunes by count (DeleteSnapshot through the snapshotter) and by
/// age, cuts nothing while paused (the slots pass in its status), and shows in `get`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schedule_cuts_on_its_interval_and_prunes_by_count_and_by_age() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 1, PluginOpts::default()).await;
    labelled_volume(&c, "v1", Some("gold")).await;
    labelled_volume(&c, "v2", Some("gold")).await;
    labelled_volume(&c, "v3", None).await;

    // By count: every 2 s, keep 2.
    apply_yaml(
        &c,
        "count",
        &schedule_yaml("count", "interval: 2s", "keep: 2"),
    );
    c.wait("4 slots of count cut and pruned to 2 each", T, || async {
        let s = schedule(&c, "count").await;
        let snaps = scheduled(&c, "count").await;
        let per = |v: &str| snaps.iter().filter(|s| s.spec.volume.as_str() == v).count();
        c.node("n1").count("DeleteSnapshot", "OK") >= 4
            && s.status.last_cut_volumes == 2
            && per("v1") <= 3
            && per("v2") <= 3
    })
    .await;
    let snaps = scheduled(&c, "count").await;
    assert!(
        snaps.iter().all(|s| s.spec.volume.as_str() != "v3"),
        "v3 is not selected"
    );
    for s in &snaps {
        let slot = s.metadata.labels.get(SLOT_LABEL).unwrap();
        assert_eq!(
            s.metadata.name.as_str(),
            format!("count-{}-{}", s.spec.volume, slot.to_ascii_lowercase()),
        );
    }
    // Never more than `keep` ready ones of a volume once pruning ran.
    c.wait("count keeps at most 2 ready snapshots of v1", T, || async {
        scheduled(&c, "count")
            .await
            .iter()
            .filter(|s| s.spec.volume.as_str() == "v1" && s.status.phase == SnapshotPhase::Ready)
            .count()
            == 2
    })
    .await;
    let (ok, out) = c.moorctl(&["get", "snapshotschedules"]);
    assert!(
        ok && out.contains("every 2s") && out.contains("tier=gold") && out.contains("NEXT SLOT"),
        "{out}"
    );

    // Paused: the slots pass in the status, nothing is cut.
    let paused = schedule_yaml("count", "interval: 2s", "keep: 2") + "  paused: true\n";
    apply_yaml(&c, "count", &paused);
    c.wait("count paused", T, || async {
        schedule(&c, "count").await.spec.paused
    })
    .await;
    // A cut already asked for may still reach the plugin: wait until every Snapshot
    // is cut before counting.
    c.wait("every scheduled snapshot cut", T, || async {
        scheduled(&c, "count")
            .await
            .iter()
            .all(|s| s.status.phase == SnapshotPhase::Ready)
    })
    .await;
    let before = c.node("n1").tried("CreateSnapshot");
    let from = schedule(&c, "count").await.status.last_slot.unwrap();
    c.wait("two slots passed while paused", T, || async {
        schedule(&c, "count")
            .await
            .status
            .last_slot
            .is_some_and(|l| l.system() >= from.system() + Duration::from_secs(4))
    })
    .await;
    assert_eq!(
        c.node("n1").tried("CreateSnapshot"),
        before,
        "nothing cut while paused"
    );
    assert_eq!(schedule(&c, "count").await.status.missed_slots, 0);

    // By age: every second, keep any number younger than 3 s.
    apply_yaml(
        &c,
        "age",
        &schedule_yaml("age", "interval: 1s", "keep: 100, max_age: 3s"),
    );
    c.wait("age's first cuts ready", T, || async {
        scheduled(&c, "age")
            .await
            .iter()
            .filter(|s| s.status.phase == SnapshotPhase::Ready)
            .count()
            >= 2
    })
    .await;
    let first = scheduled(&c, "age").await[0].metadata.name.clone();
    c.wait("age's first cut pruned for its age", T, || async {
        c.store
            .try_get(&Snapshot::key_for(&Namespace::default_ns(), &first))
            .await
            .unwrap()
            .is_none()
    })
    .await;
    // What is left is young: nothing ready is older than 3 s and a margin for the
    // tick, the delete and the plugin's call.
    let oldest_kept = slot_label(std::time::SystemTime::now() - Duration::from_secs(8));
    for s in scheduled(&c, "age").await {
        let slot = s.metadata.labels.get(SLOT_LABEL).unwrap();
        assert!(
            slot.as_str() >= oldest_kept.as_str(),
            "{slot} kept past its age"
        );
    }
    c.check_calls(false);
}

/// After the controller was down across at least three slots, the schedule cuts one
/// catch-up snapshot for the latest slot (none for the missed ones: counted in the
/// plugin's log), reports the missed slots in its status and a Warning, and goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_controller_outage_a_schedule_cuts_one_catch_up_snapshot() {
    let _slot = SLOTS.acquire().await.unwrap();
    let mut c = Cluster::start(1, 1, PluginOpts::default()).await;
    labelled_volume(&c, "v1", Some("gold")).await;
    apply_yaml(&c, "s", &schedule_yaml("s", "interval: 2s", "keep: 100"));
    c.wait("a first cut ready", T, || async {
        scheduled(&c, "s")
            .await
            .iter()
            .any(|s| s.status.phase == SnapshotPhase::Ready)
    })
    .await;

    c.controllers[0].stop();
    let last = schedule(&c, "s").await.status.last_slot.unwrap().system();
    let before: Vec<Name> = scheduled(&c, "s")
        .await
        .into_iter()
        .map(|s| s.metadata.name)
        .collect();
    // Down until four more slots have passed: three are missed, the fourth is cut.
    let back = last + Duration::from_secs(8);
    if let Ok(wait) = back.duration_since(std::time::SystemTime::now()) {
        tokio::time::sleep(wait).await;
    }
    c.controllers[0].restart();

    c.wait("the missed slots reported", T, || async {
        schedule(&c, "s").await.status.missed_slots >= 3
    })
    .await;
    let st = schedule(&c, "s").await.status;
    assert!(st.last_missed.is_some());
    let catch_up = st.last_slot.unwrap().system();
    let missed = (catch_up.duration_since(last).unwrap().as_secs() / 2) - 1;
    assert_eq!(
        st.missed_slots, missed,
        "every slot between {last:?} and {catch_up:?}"
    );
    c.wait("the catch-up snapshot ready", T, || async {
        scheduled(&c, "s")
            .await
            .iter()
            .filter(|s| !before.contains(&s.metadata.name))
            .any(|s| s.status.phase == SnapshotPhase::Ready)
    })
    .await;
    // Exactly one new Snapshot for the slots up to the catch-up, at its slot.
    let (after_last, catch_label) = (slot_label(last), slot_label(catch_up));
    let snaps = scheduled(&c, "s").await;
    let between: Vec<&Snapshot> = snaps
        .iter()
        .filter(|s| {
            let slot = s.metadata.labels.get(SLOT_LABEL).unwrap();
            slot.as_str() > after_last.as_str() && slot.as_str() <= catch_label.as_str()
        })
        .collect();
    assert_eq!(between.len(), 1, "{between:?}");
    assert_eq!(
        between[0].metadata.labels.get(SLOT_LABEL),
        Some(&catch_label)
    );
    // The plugin was asked for no snapshot moor does not hold: every CreateSnapshot
    // name is a scheduled Snapshot's (`plugin_name`; pruning is off here).
    let names: std::collections::BTreeSet<String> = snaps.iter().map(plugin_name_of).collect();
    for name in cut_names(&c) {
        assert!(
            names.contains(&name),
            "CreateSnapshot {name} is no Snapshot's"
        );
    }
    c.wait("the Missed slots Warning", T, || async {
        let (_, out) = c.moorctl(&["events", "--for", "snapshotschedule/s"]);
        out.contains("Missed slots")
    })
    .await;
    // And it goes on at its interval.
    c.wait("the next slot cut", T, || async {
        schedule(&c, "s")
            .await
            .status
            .last_slot
            .is_some_and(|l| l.system() > catch_up)
    })
    .await;
    c.check_calls(false);
}

/// The secret names the last call of `rpc` on `node` carried (never their values).
fn last_secret_keys(c: &Cluster, node: &str, rpc: &str) -> Option<Vec<String>> {
    c.node(node)
        .calls()
        .into_iter()
        .rev()
        .find(|k| k.rpc == rpc && k.code == "OK")
        .map(|k| k.secret_keys)
}

fn secret_yaml(name: &str, key: &str, value: &str) -> String {
    format!(
        "apiVersion: moor/v1\nkind: Secret\nmetadata: {{name: {name}}}\nspec:\n  \
         plugin_id: {}\n  secrets: {{{key}: {value}}}\n",
        cluster::PLUGIN
    )
}

/// Secrets by reference (issue 54, part 4): a volume names a Secret per call family;
/// each call carries its family's Secret as it is when the call is made; a rotation
/// is copied into the claim already published (an event on it says so, with no
/// value), and the next NodeStage, on another node, carries the new value; a volume
/// naming a Secret not there yet waits and is created once it is; a Secret in use is
/// not deleted, and no value is ever shown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_secret_reaches_live_claims_and_the_next_call_and_cannot_be_deleted_in_use() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 2, PluginOpts::default()).await;
    apply_yaml(&c, "creds", &secret_yaml("creds", "user1", "one-value"));
    apply_yaml(&c, "pub", &secret_yaml("pub", "pubkey", "pub-value"));
    let mut v = c.volume("v1", AccessMode::SingleNodeWriter);
    v.spec.secret_refs = Rare::new(SecretRefs {
        controller: Some(Name::new("creds").unwrap()),
        node_stage: Some(Name::new("creds").unwrap()),
        node_publish: Some(Name::new("pub").unwrap()),
        snapshot: Some(Name::new("creds").unwrap()),
        ..Default::default()
    });
    c.apply(v).await;
    c.volume_ready("v1").await;
    assert_eq!(
        last_secret_keys(&c, "n1", "CreateVolume"),
        Some(vec!["user1".to_string()])
    );
    c.apply(c.allocation("a1", "n1", "v1", false)).await;
    c.wait_claim("a1", "n1", ClaimPhase::Published, T).await;
    assert_eq!(
        last_secret_keys(&c, "n1", "NodeStageVolume"),
        Some(vec!["user1".to_string()])
    );
    assert_eq!(
        last_secret_keys(&c, "n1", "NodePublishVolume"),
        Some(vec!["pubkey".to_string()]),
        "NodePublish carries its own family's Secret"
    );
    assert_eq!(
        last_secret_keys(&c, "n1", "ControllerPublishVolume"),
        Some(vec!["user1".to_string()])
    );

    // Rotated: the published claim's copy follows, with an event naming the Secret.
    apply_yaml(&c, "creds", &secret_yaml("creds", "user2", "two-value"));
    c.wait("a1's node copy rotated", T, || async {
        claim(&c, "a1", "n1").await.is_some_and(|k| {
            k.spec
                .node_secrets
                .expose()
                .is_ok_and(|m| m.get("user2").map(String::as_str) == Some("two-value"))
        })
    })
    .await;
    let k = claim(&c, "a1", "n1").await.unwrap();
    assert_eq!(k.status.phase, ClaimPhase::Published, "nothing else moved");
    assert!(
        k.spec
            .node_publish_secrets
            .expose()
            .is_ok_and(|m| m.contains_key("pubkey")),
        "{:?}",
        k.spec
            .node_publish_secrets
            .expose()
            .map(|m| m.keys().cloned().collect::<Vec<_>>())
    );
    c.wait("the rotation shown on a1's claim", T, || async {
        let (_, out) = c.moorctl(&["describe", "claim", "a1.data"]);
        out.contains("Secrets updated") && out.contains("node_stage: Secret creds generation 2")
    })
    .await;
    // The next calls carry the new value: a snapshot (the volume's snapshot family),
    // and NodeStage on another node once a1 is gone.
    let (ok, out) = c.moorctl(&["volume", "snapshot", "create", "v1", "s1"]);
    assert!(ok, "{out}");
    c.wait("s1 cut", T, || async {
        last_secret_keys(&c, "n1", "CreateSnapshot").is_some()
    })
    .await;
    assert_eq!(
        last_secret_keys(&c, "n1", "CreateSnapshot"),
        Some(vec!["user2".to_string()])
    );
    c.stop_alloc("a1").await;
    c.wait_claim("a1", "n1", ClaimPhase::Released, T).await;
    let k = claim(&c, "a1", "n1").await.unwrap();
    assert!(k.spec.node_secrets.is_empty() && k.spec.node_publish_secrets.is_empty());
    c.apply(c.allocation("a2", "n2", "v1", false)).await;
    c.wait_claim("a2", "n2", ClaimPhase::Published, T).await;
    assert_eq!(
        last_secret_keys(&c, "n2", "NodeStageVolume"),
        Some(vec!["user2".to_string()])
    );
    assert_eq!(
        last_secret_keys(&c, "n1", "ControllerPublishVolume"),
        Some(vec!["user2".to_string()])
    );

    // In use: refused, naming who uses it; nothing shows a value.
    let (ok, out) = c.moorctl(&["delete", "secret", "creds"]);
    assert!(!ok, "{out}");
    assert!(
        out.contains("secret default/creds is in use by volume v1"),
        "{out}"
    );
    for args in [
        &["get", "secrets"][..],
        &["get", "secret", "creds", "-o", "yaml"],
        &["describe", "secret", "creds"],
        &["describe", "claim", "a2.data"],
        &["get", "events"],
    ] {
        let (ok, out) = c.moorctl(args);
        assert!(ok, "{out}");
        assert!(
            !out.contains("two-value") && !out.contains("pub-value"),
            "{args:?}: {out}"
        );
    }
    let (_, out) = c.moorctl(&["get", "secrets"]);
    assert!(
        out.lines()
            .any(|l| l.starts_with("creds ") && l.contains(cluster::PLUGIN)),
        "{out}"
    );

    // A volume naming a Secret that is not there waits, saying so, and is made once
    // the Secret is.
    let mut v2 = c.volume("v2", AccessMode::SingleNodeWriter);
    v2.spec.secret_refs = Rare::new(SecretRefs {
        controller: Some(Name::new("later").unwrap()),
        ..Default::default()
    });
    c.apply(v2).await;
    c.wait("v2 waits for its Secret", T, || async {
        let (_, out) = c.moorctl(&["describe", "volume", "v2"]);
        out.contains("Secret default/later of plugin hostpath.moor.dev, named for the controller calls, does not exist")
    })
    .await;
    apply_yaml(&c, "later", &secret_yaml("later", "late", "late-value"));
    c.volume_ready("v2").await;
    assert_eq!(
        last_secret_keys(&c, "n1", "CreateVolume"),
        Some(vec!["late".to_string()])
    );
    c.stop_alloc("a2").await;
    c.wait_claim("a2", "n2", ClaimPhase::Released, T).await;
    c.check_calls(true);
}
