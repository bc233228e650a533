//! Restoring an older etcd snapshot (issue 50, item 3): claims made after the
//! snapshot are missing from the restored desired state while their mounts live on the
//! nodes. Nothing live is torn down: each such mount is kept and reported (its Mount's
//! `status.orphan`, an "Orphaned mount" Warning, `moorctl get mounts --orphaned`,
//! `moor_agent_orphaned_mounts`), a volume created after the snapshot is reported as
//! unknown and never deleted (`moorctl get volumes --orphaned`), and the operator adopts
//! one orphan and releases the other with one command each. Real etcd (`etcdctl
//! snapshot save` and `restore`), moord and moor-hostpath; the checker over every call.

#[path = "common/cluster.rs"]
mod cluster;
mod common;

use cluster::{Cluster, PluginOpts};
use common::wait_for;
use moor::api::*;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

/// The plugin's volume id of volume `name`.
async fn external_id(c: &Cluster, name: &str) -> String {
    c.store
        .get(&Volume::key_for(&Namespace::default_ns(), name))
        .await
        .expect("volume")
        .status
        .provisioning
        .external_id
        .expect("created")
        .to_string()
}

/// The calls of `rpcs` for volume id `ext` in every plugin's log.
fn calls_of(c: &Cluster, rpcs: &[&str], ext: &str) -> usize {
    c.nodes
        .iter()
        .flat_map(|n| n.calls())
        .filter(|call| rpcs.contains(&call.rpc.as_str()) && call.volume_id.as_deref() == Some(ext))
        .count()
}

/// The Mounts that say they are orphans.
async fn orphans(c: &Cluster) -> Vec<Mount> {
    c.store
        .list(&KeyScope::<MountSpec>::all())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|m| m.status.orphan.is_some())
        .collect()
}

const TEARDOWN: &[&str] = &[
    "NodeUnpublishVolume",
    "NodeUnstageVolume",
    "ControllerUnpublishVolume",
    "DeleteVolume",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_older_snapshot_restored_keeps_live_mounts_and_the_operator_adopts_or_releases_each() {
    let opts = PluginOpts {
        agent_args: vec!["--survey-interval=1s".into()],
        ..Default::default()
    };
    let mut c = Cluster::start(1, 2, opts).await;
    for v in ["v1", "v2", "v3", "v4"] {
        c.apply(c.volume(v, AccessMode::SingleNodeWriter)).await;
    }
    for v in ["v1", "v2", "v3", "v4"] {
        c.volume_ready(v).await;
    }
    // Claims published on both nodes before the snapshot.
    c.apply(c.allocation("a1", "n1", "v1", false)).await;
    c.apply(c.allocation("a2", "n2", "v2", false)).await;
    c.wait_claim("a1", "n1", ClaimPhase::Published, T).await;
    c.wait_claim("a2", "n2", ClaimPhase::Published, T).await;

    let snapshot = c.dir.path().join("moor.db");
    c.etcd.snapshot_save(&snapshot);

    // After the snapshot: two more claims (one per node) and a volume made.
    c.apply(c.allocation("a3", "n1", "v3", false)).await;
    c.apply(c.allocation("a4", "n2", "v4", false)).await;
    c.apply(c.volume("v5", AccessMode::SingleNodeWriter)).await;
    c.wait_claim("a3", "n1", ClaimPhase::Published, T).await;
    c.wait_claim("a4", "n2", ClaimPhase::Published, T).await;
    c.volume_ready("v5").await;
    let ext: Vec<String> = {
        let mut v = Vec::new();
        for name in ["v1", "v2", "v3", "v4", "v5"] {
            v.push(external_id(&c, name).await);
        }
        v
    };
    let mounted = c.mounts_under("n1") + c.mounts_under("n2");

    // The procedure: every moor process stopped, the snapshot restored, etcd started,
    // then every moor process started again. The plugins (the storage) stay up.
    for p in &mut c.controllers {
        p.stop();
    }
    for n in &mut c.nodes {
        n.agent.stop();
    }
    c.etcd.restore(&snapshot).await;
    c.store = c.etcd.store("/moor/").await;
    assert!(
        c.claim("a3", "n1").await.is_none() && c.claim("a4", "n2").await.is_none(),
        "the restored state predates claims a3 and a4"
    );
    for p in &mut c.controllers {
        p.restart();
    }
    for n in &mut c.nodes {
        n.agent.restart();
    }
    c.wait_nodes_healthy().await;

    // Both later mounts are kept and reported; the snapshot's own claims stay.
    wait_for("both orphans reported on their Mounts", T, || async {
        orphans(&c).await.len() == 2
    })
    .await;
    let found = orphans(&c).await;
    let mut names: Vec<(String, String)> = found
        .iter()
        .map(|m| (m.spec.claim.to_string(), m.spec.node.to_string()))
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            ("a3.data".to_string(), "n1".to_string()),
            ("a4.data".to_string(), "n2".to_string())
        ]
    );
    for m in &found {
        let o = m.status.orphan.as_deref().unwrap();
        assert!(m.status.published && m.status.staged, "{m:?}");
        assert_eq!(o.mode, ClaimMode::Write);
        assert_eq!(o.request.as_ref().map(|r| r.as_str()), Some("data"));
    }
    let (ok, listed) = c.moorctl(&["get", "mounts", "--orphaned", "-A", "-o", "wide"]);
    assert!(
        ok && listed.contains("a3.data") && listed.contains("a4.data"),
        "{listed}"
    );
    assert!(
        !listed.contains("a1.data"),
        "a live claim's mount is no orphan: {listed}"
    );
    wait_for("an 'Orphaned mount' Warning from each node", T, || async {
        let (_, events) = c.moorctl(&["events", "-A"]);
        events.matches("Orphaned mount").count() >= 2
    })
    .await;
    for n in ["n1", "n2"] {
        let page = c.node(n).http_get("/metrics").await;
        assert_eq!(
            common::metric(&page, "moor_agent_orphaned_mounts"),
            Some(1.0),
            "{n}"
        );
    }
    // v5 (made after the snapshot) is listed by the plugin and unknown to moor:
    // reported, never deleted.
    wait_for("v5 reported as unknown to moor", T, || async {
        let (ok, out) = c.moorctl(&["get", "volumes", "--orphaned"]);
        ok && out.contains(&ext[4])
    })
    .await;
    for (i, e) in ext.iter().enumerate() {
        assert_eq!(
            calls_of(&c, TEARDOWN, e),
            0,
            "volume v{} saw a teardown call after the restore",
            i + 1
        );
    }
    assert_eq!(
        c.mounts_under("n1") + c.mounts_under("n2"),
        mounted,
        "every mount is still in place"
    );

    // Adopted: an allocation a3 made again on n1; the node takes the mount over
    // without a call that tears it down.
    let (ok, out) = c.moorctl(&["mount", "adopt", "a3.data"]);
    assert!(ok, "{out}");
    c.wait_claim("a3", "n1", ClaimPhase::Published, T).await;
    assert_eq!(
        calls_of(&c, TEARDOWN, &ext[2]),
        0,
        "adopting v3 tore nothing down"
    );
    let mount = c
        .store
        .get(&Mount::key_for(
            &c.claim("a3", "n1").await.unwrap().object_key(),
        ))
        .await
        .unwrap();
    assert!(
        mount.status.orphan.is_none() && mount.status.published,
        "{mount:?}"
    );

    // A process works in v4's mount (issue 78, item 3): its node reports it on the
    // orphan's Mount, and the release is refused naming it; once it ends, the release
    // goes on.
    let a4 = orphans(&c)
        .await
        .into_iter()
        .find(|m| m.spec.claim.as_str() == "a4.data")
        .expect("a4's orphan");
    let mut holder = std::process::Command::new("sleep")
        .arg("300")
        .current_dir(&a4.spec.target_path)
        .spawn()
        .unwrap();
    let pid = holder.id();
    let held = |m: &Mount| {
        m.status
            .orphan
            .as_deref()
            .is_some_and(|o| o.holders.iter().any(|h| h.pid == pid))
    };
    let mut waited = wait_for_holders(&c, "a4.data", T, |m| held(m)).await;
    let (ok, out) = c.moorctl(&["mount", "release", "a4.data"]);
    let _ = holder.kill();
    let _ = holder.wait();
    assert!(
        !ok && out.contains(&format!("in use by process {pid} (sleep)")) && out.contains("--force"),
        "{out}"
    );
    assert!(waited, "the holder was never reported");
    waited = wait_for_holders(&c, "a4.data", T, |m| !held(m)).await;
    assert!(waited, "the holder's end was never reported");
    for e in &ext {
        assert_eq!(
            calls_of(&c, TEARDOWN, e),
            0,
            "the refused release tore down"
        );
    }

    // Released: NodeUnpublish, NodeUnstage and ControllerUnpublish of v4 on n2.
    let (ok, out) = c.moorctl(&["mount", "release", "a4.data"]);
    assert!(ok, "{out}");
    assert!(orphans(&c).await.is_empty());
    for rpc in [
        "NodeUnpublishVolume",
        "NodeUnstageVolume",
        "ControllerUnpublishVolume",
    ] {
        assert_eq!(calls_of(&c, &[rpc], &ext[3]), 1, "{rpc} of v4");
    }
    for n in ["n1", "n2"] {
        let page = c.node(n).http_get("/metrics").await;
        assert_eq!(
            common::metric(&page, "moor_agent_orphaned_mounts"),
            Some(0.0)
        );
    }
    // The snapshot's claims and the adopted one never saw a teardown.
    for e in &ext[0..3] {
        assert_eq!(calls_of(&c, TEARDOWN, e), 0);
    }

    // Everything released at the end, and the whole call log is clean.
    for a in ["a1", "a2", "a3"] {
        c.stop_alloc(a).await;
    }
    c.wait("every claim released", T, || async {
        c.all_claims_released().await
    })
    .await;
    assert_eq!(
        calls_of(&c, &["DeleteVolume"], &ext[4]),
        0,
        "v5 was never deleted"
    );
    c.check_calls(true);
}

/// Waits until the orphaned Mount of `claim` satisfies `cond`; whether it did by the
/// deadline.
async fn wait_for_holders(
    c: &Cluster,
    claim: &str,
    timeout: Duration,
    cond: impl Fn(&Mount) -> bool,
) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    while std::time::Instant::now() < deadline {
        let found = orphans(c)
            .await
            .into_iter()
            .find(|m| m.spec.claim.as_str() == claim);
        if found.as_ref().is_some_and(&cond) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    false
}
