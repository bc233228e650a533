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
    // What it already had stays.
    for a in ["a1", "a2"] {
        let k = claim(&c, a, "n2").await.unwrap();
        assert_eq!(k.status.phase, ClaimPhase::Published, "{a}");
    }
    // Uncordoned: admitted.
    let (ok, out) = c.moorctl(&["node", "uncordon", "n2"]);
    assert!(ok, "{out}");
    c.wait_claim("a3", "n2", ClaimPhase::Published, T).await;

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
