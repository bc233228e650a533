//! The claim lifecycle end to end: real etcd, `moord controller` replicas, one `moord
//! agent` per node with its own moor-hostpath process; every test ends by checking the
//! plugins' call logs against the invariants.

#[path = "common/cluster.rs"]
mod cluster;
mod common;

use cluster::{Cluster, PluginOpts};
use moor::api::*;
use std::time::Duration;
use tokio::sync::Semaphore;

/// Clusters are several processes each: run two tests at a time on two cores.
static SLOTS: Semaphore = Semaphore::const_new(2);

const T: Duration = Duration::from_secs(30);

async fn events(c: &Cluster, reason: &str) -> Vec<Event> {
    c.store
        .list::<EventSpec>(&moor::api::KeyScope::all())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.spec.reason == reason)
        .collect()
}

/// Waits until an event with `reason` is stored: the recorder writes events after the
/// status that caused them (a batch rides with its process's next write, or goes
/// alone within `events::RIDE`), so seeing the status does not mean seeing its event.
async fn wait_event(c: &Cluster, reason: &str) -> Vec<Event> {
    c.wait(&format!("a {reason:?} event"), T, || async {
        !events(c, reason).await.is_empty()
    })
    .await;
    events(c, reason).await
}

/// Publishes one claim on n2 and releases it; returns the cluster for more checks.
async fn publish_and_release(opts: PluginOpts) -> Cluster {
    let c = Cluster::start(1, 2, opts.clone()).await;
    let mut v1 = c.volume("v1", AccessMode::SingleNodeWriter);
    v1.spec.secrets = Secrets::new([("token".to_string(), "s3cret".to_string())].into()).into();
    c.apply(v1).await;
    c.volume_ready("v1").await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    // The allocation's first pass made its claim and its pending status in one
    // transaction (issue 52): the allocation, as of the claim's creation, was written
    // at that very revision, with the generation it saw.
    let mut raw = c.etcd.raw_client().await;
    let made = raw
        .get("/moor/claims/n2/default/a1.data", None)
        .await
        .unwrap()
        .kvs()[0]
        .create_revision();
    let then = raw
        .get(
            "/moor/allocations/default/a1",
            Some(etcd_client::GetOptions::new().with_revision(made)),
        )
        .await
        .unwrap();
    let then = &then.kvs()[0];
    assert_eq!(
        then.mod_revision(),
        made,
        "claim and status in one transaction"
    );
    let status: serde_json::Value = serde_json::from_slice(then.value()).unwrap();
    assert_eq!(status["status"]["observed_generation"], 1, "{status}");
    // The node steps get the volume's secrets from the claim (the agent reads its
    // node's claims, not volumes); they leave the claim once it is released.
    let claim = c.claim("a1", "n2").await.expect("claim");
    assert_eq!(
        claim
            .spec
            .node_secrets
            .expose()
            .unwrap()
            .get("token")
            .map(String::as_str),
        Some("s3cret")
    );

    let n1 = c.node("n1");
    let n2 = c.node("n2");
    let attach = if opts.publish_unpublish { 1 } else { 0 };
    let stage = if opts.stage_unstage { 1 } else { 0 };
    assert_eq!(n1.count("ControllerPublishVolume", "OK"), attach);
    assert_eq!(n2.count("NodeStageVolume", "OK"), stage);
    assert_eq!(n2.count("NodePublishVolume", "OK"), 1);
    if opts.publish_unpublish {
        let att = c.attachment("v1", "n2").await.expect("attachment");
        assert_eq!(att.status.phase, AttachmentPhase::Attached);
        // Issue 27: an attachment exists only for an admitted claim. The admission
        // creates it in its own transaction, or right after when that transaction
        // conflicted and fell back (a cache lagging the volume), so which one happened
        // is timing: moor-bench measures it (write requests per claim); this checks
        // what holds either way.
        let mut raw = c.store.client();
        let created_at = raw
            .get(c.store.full_key(&att.key()), None)
            .await
            .unwrap()
            .kvs()[0]
            .create_revision();
        let claim_key = c.store.full_key(&claim.key());
        let then = raw
            .get(
                claim_key,
                Some(etcd_client::GetOptions::new().with_revision(created_at)),
            )
            .await
            .unwrap();
        let admitted: Claim = serde_json::from_slice(then.kvs()[0].value()).unwrap();
        assert!(then.kvs()[0].mod_revision() <= created_at);
        assert_eq!(
            admitted.status.phase,
            ClaimPhase::Admitted,
            "the claim as of the attachment's creation"
        );
        assert_eq!(
            att.spec.csi_node_id.as_str(),
            "csi-n2",
            "the CSI node id, not moor's"
        );
    } else {
        assert!(c.attachment("v1", "n2").await.is_none());
    }
    if cluster::can_mount() {
        assert_eq!(
            c.mounts_under("n2"),
            1 + stage,
            "target (and staging) mounted"
        );
    }
    let mount = c
        .store
        .get(&crate::common::key::<MountSpec>(
            "mounts/n2/default/a1.data",
        ))
        .await
        .expect("mount object");
    assert!(mount.status.published);

    // A secret changed on the volume reaches the live claim (and a claim admitted by an
    // older controller, with none, gets them the same way).
    c.store
        .modify_spec(
            &Volume::key_for(&Namespace::default_ns(), "v1"),
            |v: &mut VolumeSpec| {
                v.secrets =
                    Secrets::new([("token".to_string(), "r0tated".to_string())].into()).into();
                true
            },
        )
        .await
        .unwrap();
    let store = c.store.clone();
    crate::common::wait_for("the rotated secret on the claim", T, || {
        let store = store.clone();
        async move {
            let key = Claim::key_for(&cluster::node("n2"), &Namespace::default_ns(), "a1.data");
            store.try_get(&key).await.ok().flatten().is_some_and(|c| {
                c.spec
                    .node_secrets
                    .expose()
                    .ok()
                    .and_then(|m| m.get("token"))
                    .map(String::as_str)
                    == Some("r0tated")
            })
        }
    })
    .await;
    for call in n2
        .calls()
        .iter()
        .filter(|c| c.rpc == "NodeStageVolume" || c.rpc == "NodePublishVolume")
    {
        assert_eq!(call.secret_keys, ["token"], "{call:?}");
    }

    c.stop_alloc("a1").await;
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    let claim = c.claim("a1", "n2").await.expect("claim");
    assert!(
        claim.spec.node_secrets.is_empty(),
        "secrets left on {claim:?}"
    );
    assert_eq!(n2.count("NodeUnpublishVolume", "OK"), 1);
    assert_eq!(n2.count("NodeUnstageVolume", "OK"), stage);
    assert_eq!(n1.count("ControllerUnpublishVolume", "OK"), attach);
    assert!(c.attachment("v1", "n2").await.is_none());
    if cluster::can_mount() {
        assert_eq!(c.mounts_under("n2"), 0, "nothing left mounted");
    }
    let mounted = wait_event(&c, "Mount volume").await;
    assert!(
        mounted.iter().any(
            |e| e.spec.details.get("volume_id").map(String::as_str) == Some("v1")
                && e.spec.details.get("success").map(String::as_str) == Some("true")
        ),
        "{mounted:?}"
    );
    wait_event(&c, "Unmount volume").await;
    let vol = c
        .store
        .get(&crate::common::key::<VolumeSpec>("volumes/default/v1"))
        .await
        .unwrap();
    assert!(vol.status.claims.write_claims.is_empty());
    assert_eq!(vol.status.claims.past_claims.len(), 1);
    c.check_calls(true);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_and_release_with_attach_and_stage() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = publish_and_release(PluginOpts::default()).await;
    // The agent serves its metrics: reconciles, and CSI calls by RPC and code.
    let n2 = c.node("n2");
    assert!(n2.http_get("/healthz").await.contains("ok"));
    let metrics = n2.http_get("/metrics").await;
    for want in [
        "moor_reconciles_total{controller=\"node\"}",
        "moor_queue_depth{controller=\"node\"}",
        "moor_reconcile_duration_seconds_bucket{",
        "moor_csi_call_duration_seconds_count{plugin=\"hostpath.moor.dev\",rpc=\"NodeStageVolume\",code=\"Ok\"} 1",
    ] {
        assert!(metrics.contains(want), "{want} missing from:\n{metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_and_release_without_controller_publish() {
    let _slot = SLOTS.acquire().await.unwrap();
    publish_and_release(PluginOpts {
        publish_unpublish: false,
        ..Default::default()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_and_release_without_stage() {
    let _slot = SLOTS.acquire().await.unwrap();
    publish_and_release(PluginOpts {
        stage_unstage: false,
        ..Default::default()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_and_release_without_attach_or_stage() {
    let _slot = SLOTS.acquire().await.unwrap();
    publish_and_release(PluginOpts {
        publish_unpublish: false,
        stage_unstage: false,
        ..Default::default()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_created_volume_is_deleted_through_delete_volume_after_release() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = publish_and_release(PluginOpts::default()).await;
    let vol = c
        .store
        .get(&crate::common::key::<VolumeSpec>("volumes/default/v1"))
        .await
        .unwrap();
    let ext = vol
        .status
        .provisioning
        .external_id
        .clone()
        .expect("created");
    let created = c
        .node("n1")
        .calls()
        .into_iter()
        .find(|call| call.rpc == "CreateVolume" && call.code == "OK")
        .expect("CreateVolume was called");
    assert_eq!(created.result_volume_id.as_deref(), Some(ext.as_str()));
    c.store
        .delete(
            &crate::common::key::<VolumeSpec>("volumes/default/v1"),
            None,
        )
        .await
        .expect("delete requested");
    let store = c.store.clone();
    c.wait("volume v1 gone", T, || {
        let store = store.clone();
        async move {
            matches!(
                store
                    .try_get(&crate::common::key::<VolumeSpec>("volumes/default/v1"))
                    .await,
                Ok(None)
            )
        }
    })
    .await;
    let deletes: Vec<_> = c
        .node("n1")
        .calls()
        .into_iter()
        .filter(|call| call.rpc == "DeleteVolume" && call.code == "OK")
        .collect();
    assert_eq!(deletes.len(), 1);
    assert_eq!(deletes[0].volume_id.as_deref(), Some(ext.as_str()));
    c.check_calls(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_volume_in_use_waits_for_its_claims() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 1, PluginOpts::default()).await;
    c.apply(c.volume("v1", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v1").await;
    c.apply(c.allocation("a1", "n1", "v1", false)).await;
    c.wait_claim("a1", "n1", ClaimPhase::Published, T).await;
    c.store
        .delete(
            &crate::common::key::<VolumeSpec>("volumes/default/v1"),
            None,
        )
        .await
        .unwrap();
    // Held by the claim: still there once the controller has seen the deletion (it is
    // no longer schedulable), and DeleteVolume not called.
    let v1 = crate::common::key::<VolumeSpec>("volumes/default/v1");
    c.wait("the controller to see v1's deletion", T, || async {
        c.store
            .try_get(&v1)
            .await
            .ok()
            .flatten()
            .is_some_and(|v| v.is_deleting() && !v.status.claims.schedulable)
    })
    .await;
    assert_eq!(c.node("n1").count("DeleteVolume", "OK"), 0);
    c.stop_alloc("a1").await;
    let store = c.store.clone();
    c.wait("volume v1 gone", T, || {
        let store = store.clone();
        async move {
            matches!(
                store
                    .try_get(&crate::common::key::<VolumeSpec>("volumes/default/v1"))
                    .await,
                Ok(None)
            )
        }
    })
    .await;
    assert_eq!(c.node("n1").count("DeleteVolume", "OK"), 1);
    c.check_calls(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_writer_second_node_is_denied_then_admitted_after_release() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 2, PluginOpts::default()).await;
    c.apply(c.volume("v1", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v1").await;
    c.apply(c.allocation("a1", "n1", "v1", false)).await;
    c.wait_claim("a1", "n1", ClaimPhase::Published, T).await;
    c.apply(c.allocation("a2", "n2", "v1", false)).await;
    c.wait_claim("a2", "n2", ClaimPhase::Denied, T).await;
    let denied = c.claim("a2", "n2").await.unwrap();
    let reason = denied.status.reason.unwrap_or_default();
    assert!(reason.contains("one node"), "{reason}");
    let store = c.store.clone();
    c.wait("allocation a2 Blocked", T, || {
        let store = store.clone();
        async move {
            store
                .get(&crate::common::key::<AllocationSpec>(
                    "allocations/default/a2",
                ))
                .await
                .is_ok_and(|a| a.status.phase == AllocationPhase::Blocked)
        }
    })
    .await;
    wait_event(&c, "Claim denied").await;

    c.stop_alloc("a1").await;
    c.wait_claim("a1", "n1", ClaimPhase::Released, T).await;
    c.wait_claim("a2", "n2", ClaimPhase::Published, T).await;
    c.stop_alloc("a2").await;
    c.wait_claim("a2", "n2", ClaimPhase::Released, T).await;
    c.check_calls(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_allocations_on_one_node_share_one_attachment_and_one_stage() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 2, PluginOpts::default()).await;
    c.apply(c.volume("v1", AccessMode::MultiNodeMultiWriter))
        .await;
    c.volume_ready("v1").await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.apply(c.allocation("a2", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    c.wait_claim("a2", "n2", ClaimPhase::Published, T).await;
    let (n1, n2) = (c.node("n1"), c.node("n2"));
    assert_eq!(n1.count("ControllerPublishVolume", "OK"), 1);
    assert_eq!(n2.count("NodeStageVolume", "OK"), 1);
    assert_eq!(n2.count("NodePublishVolume", "OK"), 2);

    c.stop_alloc("a1").await;
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    assert_eq!(n2.count("NodeUnpublishVolume", "OK"), 1);
    assert_eq!(
        n2.count("NodeUnstageVolume", "OK"),
        0,
        "a2 still uses the stage"
    );
    assert_eq!(
        n1.count("ControllerUnpublishVolume", "OK"),
        0,
        "a2 still uses the attachment"
    );
    assert!(c.attachment("v1", "n2").await.is_some());

    c.stop_alloc("a2").await;
    c.wait_claim("a2", "n2", ClaimPhase::Released, T).await;
    assert_eq!(n2.count("NodeUnpublishVolume", "OK"), 2);
    assert_eq!(n2.count("NodeUnstageVolume", "OK"), 1);
    assert_eq!(n1.count("ControllerUnpublishVolume", "OK"), 1);
    if cluster::can_mount() {
        assert_eq!(c.mounts_under("n2"), 0);
    }
    c.check_calls(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_plugin_unavailable_during_release_is_retried_until_it_succeeds() {
    use moor_hostpath::faults::Command;
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 2, PluginOpts::default()).await;
    c.apply(c.volume("v1", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v1").await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    c.node("n2")
        .fault(Command::Fail {
            rpc: "NodeUnpublishVolume".into(),
            code: "Unavailable".into(),
            times: 5,
        })
        .await;
    c.stop_alloc("a1").await;
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    let n2 = c.node("n2");
    assert_eq!(n2.count("NodeUnpublishVolume", "Unavailable"), 5);
    assert_eq!(n2.count("NodeUnpublishVolume", "OK"), 1);
    let mount = c
        .store
        .get(&crate::common::key::<MountSpec>(
            "mounts/n2/default/a1.data",
        ))
        .await
        .unwrap();
    assert!(mount.status.released);
    let failed = events(&c, "Unmount volume").await;
    assert!(
        failed
            .iter()
            .any(|e| e.spec.details.get("success").map(String::as_str) == Some("false")),
        "a failed unmount is an event"
    );
    c.check_calls(true);
}

/// NodeStage fails with `code` until the allocation stops; returns the cluster.
async fn stage_fails_then_stop(code: &str) -> Cluster {
    use moor_hostpath::faults::Command;
    let c = Cluster::start(1, 2, PluginOpts::default()).await;
    c.node("n2")
        .fault(Command::Fail {
            rpc: "NodeStageVolume".into(),
            code: code.into(),
            times: 1000,
        })
        .await;
    c.apply(c.volume("v1", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v1").await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    let n2 = c.node("n2");
    c.wait(
        &format!("NodeStage to fail with {code}"),
        T,
        || async move { n2.count("NodeStageVolume", code) > 0 },
    )
    .await;
    c.stop_alloc("a1").await;
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    assert_eq!(n2.count("NodePublishVolume", "OK"), 0);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_should_unstage_after_a_stage_that_hit_its_deadline() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = stage_fails_then_stop("DeadlineExceeded").await;
    assert_eq!(c.node("n2").count("NodeUnstageVolume", "OK"), 1);
    c.check_calls(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_should_not_unstage_after_a_stage_that_failed_for_good() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = stage_fails_then_stop("InvalidArgument").await;
    let n2 = c.node("n2");
    assert_eq!(
        n2.count("NodeStageVolume", "InvalidArgument"),
        n2.calls()
            .iter()
            .filter(|c| c.rpc == "NodeStageVolume")
            .count()
    );
    assert_eq!(
        n2.calls()
            .iter()
            .filter(|c| c.rpc == "NodeUnstageVolume")
            .count(),
        0
    );
    c.check_calls(true);
}

/// The identity of the leading controller.
async fn controller_leader(c: &Cluster) -> String {
    let mut raw = c.etcd.raw_client().await;
    let resp = raw.get("/moor/leaders/controller", None).await.unwrap();
    resp.kvs()
        .first()
        .map(|kv| moor::runtime::leader::LeaderRecord::parse(kv.value()).holder)
        .unwrap_or_default()
}

async fn hold(c: &Cluster, node: &str, rpc: &str) {
    c.node(node)
        .fault(moor_hostpath::faults::Command::Hang {
            rpc: rpc.into(),
            after: false,
        })
        .await;
}

async fn wait_held(c: &Cluster, node: &str, rpc: &str) {
    let n = c.node(node);
    c.wait(&format!("{rpc} held on {node}"), T, || async move {
        n.hanging(rpc).await > 0
    })
    .await;
}

/// After the caller died: waits until the plugin dropped the held call, so releasing the
/// hold cannot let it run (the kill is seen by the server a little later than by us).
async fn wait_abandoned(c: &Cluster, node: &str, rpc: &str) {
    let n = c.node(node);
    c.wait(&format!("{rpc} abandoned on {node}"), T, || async move {
        n.hanging(rpc).await == 0
    })
    .await;
}

async fn let_go(c: &Cluster, node: &str, rpc: &str) {
    c.node(node)
        .fault(moor_hostpath::faults::Command::Release { rpc: rpc.into() })
        .await;
    c.node(node)
        .fault(moor_hostpath::faults::Command::Clear)
        .await;
}

/// After a crash: the claim published and released exactly once per step, nothing
/// left mounted, the logs clean.
async fn converges_without_repeats(c: &Cluster) {
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    let (n1, n2) = (c.node("n1"), c.node("n2"));
    assert_eq!(n2.count("NodeStageVolume", "OK"), 1, "no second stage");
    assert_eq!(n2.count("NodePublishVolume", "OK"), 1, "no second publish");
    assert_eq!(n1.count("ControllerPublishVolume", "OK"), 1);
    if cluster::can_mount() {
        assert_eq!(c.mounts_under("n2"), 2, "staged and published once each");
    }
    c.stop_alloc("a1").await;
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    assert_eq!(n2.count("NodeUnpublishVolume", "OK"), 1);
    assert_eq!(n2.count("NodeUnstageVolume", "OK"), 1);
    assert_eq!(n1.count("ControllerUnpublishVolume", "OK"), 1);
    if cluster::can_mount() {
        assert_eq!(c.mounts_under("n2"), 0, "nothing leaked");
    }
    c.check_calls(true);
}

async fn published_cluster(controllers: usize) -> Cluster {
    let c = Cluster::start(controllers, 2, PluginOpts::default()).await;
    c.apply(c.volume("v1", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v1").await;
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_killed_mid_publish_adopts_the_stage_and_finishes() {
    let _slot = SLOTS.acquire().await.unwrap();
    let mut c = published_cluster(1).await;
    hold(&c, "n2", "NodePublishVolume").await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    wait_held(&c, "n2", "NodePublishVolume").await;
    c.node_mut("n2").agent.kill();
    wait_abandoned(&c, "n2", "NodePublishVolume").await;
    let_go(&c, "n2", "NodePublishVolume").await;
    c.node_mut("n2").agent.restart();
    converges_without_repeats(&c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_killed_mid_release_finishes_the_release() {
    let _slot = SLOTS.acquire().await.unwrap();
    let mut c = published_cluster(1).await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    hold(&c, "n2", "NodeUnpublishVolume").await;
    c.stop_alloc("a1").await;
    wait_held(&c, "n2", "NodeUnpublishVolume").await;
    c.node_mut("n2").agent.kill();
    wait_abandoned(&c, "n2", "NodeUnpublishVolume").await;
    let_go(&c, "n2", "NodeUnpublishVolume").await;
    c.node_mut("n2").agent.restart();
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    let (n1, n2) = (c.node("n1"), c.node("n2"));
    assert_eq!(n2.count("NodeStageVolume", "OK"), 1);
    assert_eq!(n2.count("NodePublishVolume", "OK"), 1);
    assert_eq!(n2.count("NodeUnpublishVolume", "OK"), 1);
    assert_eq!(n2.count("NodeUnstageVolume", "OK"), 1);
    assert_eq!(n1.count("ControllerUnpublishVolume", "OK"), 1);
    if cluster::can_mount() {
        assert_eq!(c.mounts_under("n2"), 0, "nothing leaked");
    }
    c.check_calls(true);
}

/// Agents that write their journal's power-cut mark (the length known on disk after
/// each fdatasync), so a test can cut a killed agent's journal back to it.
fn power_cut_opts() -> PluginOpts {
    PluginOpts {
        agent_wrapper: vec!["env".into(), format!("{}=1", moor::journal::POWER_CUT_MARK)],
        ..Default::default()
    }
}

/// Kills `node`'s agent and cuts its journal back to what it last knew on disk, as a
/// power cut may (SIGKILL alone keeps the page cache); the records the journal holds
/// then, by table and key (a replay of its lines, each `[table, key, value]`).
fn power_cut(
    c: &mut Cluster,
    node: &str,
) -> std::collections::BTreeMap<(String, String), serde_json::Value> {
    c.node_mut(node).agent.kill();
    let journal = c.node(node).dir.join("agent").join("state.jsonl");
    let dropped = moor::journal::cut_to_synced(&journal).expect("cut the journal");
    eprintln!("power cut on {node}: {dropped} bytes of its journal were not on disk");
    let text = std::fs::read_to_string(&journal).expect("read the journal");
    let mut records = std::collections::BTreeMap::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let commit: Vec<(String, String, serde_json::Value)> =
            serde_json::from_str(line).expect("a whole commit");
        for (table, key, value) in commit {
            if value.is_null() {
                records.remove(&(table, key));
            } else {
                records.insert((table, key), value);
            }
        }
    }
    records
}

/// A power cut while NodePublish has taken effect but its answer is not back: the
/// step's record was on disk before the call, so the agent that comes back knows the
/// volume may be published, and releasing the claim unpublishes and unstages it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_power_cut_mid_publish_keeps_the_step_owed() {
    let _slot = SLOTS.acquire().await.unwrap();
    let mut c = Cluster::start(1, 2, power_cut_opts()).await;
    c.apply(c.volume("v1", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v1").await;
    c.node("n2")
        .fault(moor_hostpath::faults::Command::Hang {
            rpc: "NodePublishVolume".into(),
            after: true,
        })
        .await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    wait_held(&c, "n2", "NodePublishVolume").await;
    let records = power_cut(&mut c, "n2");
    let publish = records
        .iter()
        .find(|((table, _), _)| table == "publishes")
        .map(|(_, v)| v["steps"]["NodePublishVolume"].clone());
    assert_eq!(
        publish,
        Some(serde_json::json!("uncertain")),
        "the publish record survives the cut, uncertain: {records:?}"
    );
    wait_abandoned(&c, "n2", "NodePublishVolume").await;
    let_go(&c, "n2", "NodePublishVolume").await;
    c.stop_alloc("a1").await;
    c.node_mut("n2").agent.restart();
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    let n2 = c.node("n2");
    assert!(
        n2.count("NodeUnpublishVolume", "OK") >= 1,
        "the publish stayed owed"
    );
    assert!(
        n2.count("NodeUnstageVolume", "OK") >= 1,
        "the stage stayed owed"
    );
    if cluster::can_mount() {
        assert_eq!(c.mounts_under("n2"), 0, "nothing leaked");
    }
    c.check_calls(true);
}

/// What the node reported in a Mount survives a power cut: a release acknowledged
/// (the controller may detach the volume and collect the claim at once) and, once the
/// claim was collected, the record forgotten. Were either lost, the agent that comes
/// back would hold a record of a claim the store no longer has: an orphaned mount.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_power_cut_keeps_what_the_node_reported() {
    let _slot = SLOTS.acquire().await.unwrap();
    let mut c = Cluster::start(
        1,
        2,
        PluginOpts {
            controller_args: vec!["--retention=1s".into()],
            ..power_cut_opts()
        },
    )
    .await;
    c.apply(c.volume("v1", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v1").await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    // Released on the node, but not yet collected: the allocation's retention is
    // counted from its release, so the cut lands in it.
    hold(&c, "n1", "ControllerUnpublishVolume").await;
    c.stop_alloc("a1").await;
    wait_held(&c, "n1", "ControllerUnpublishVolume").await;
    let records = power_cut(&mut c, "n2");
    let publishes: Vec<_> = records
        .iter()
        .filter(|((table, _), _)| table == "publishes")
        .map(|(_, v)| v.clone())
        .collect();
    assert!(
        !publishes.is_empty()
            && publishes
                .iter()
                .all(|p| p["released"] == serde_json::json!(true)),
        "the release the Mount reported is on disk: {publishes:?}"
    );
    assert!(
        !records.keys().any(|(table, _)| table == "stages"),
        "the unstage is on disk: {records:?}"
    );
    c.node_mut("n2").agent.restart();
    let_go(&c, "n1", "ControllerUnpublishVolume").await;
    let store = c.store.clone();
    c.wait("the claim and its Mount collected", T, || {
        let store = store.clone();
        async move {
            let claims = store.list(&KeyScope::<ClaimSpec>::all()).await;
            let mounts = store.list(&KeyScope::<MountSpec>::all()).await;
            let (claims, mounts) = (claims.map(|l| l.items.len()), mounts.map(|l| l.items.len()));
            matches!((claims, mounts), (Ok(0), Ok(0)))
        }
    })
    .await;
    let records = power_cut(&mut c, "n2");
    assert!(
        !records.keys().any(|(table, _)| table == "publishes"),
        "the record forgotten before its Mount was deleted is gone: {records:?}"
    );
    c.check_calls(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leading_controller_killed_mid_publish_is_replaced_and_converges() {
    let _slot = SLOTS.acquire().await.unwrap();
    let mut c = published_cluster(2).await;
    hold(&c, "n1", "ControllerPublishVolume").await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    wait_held(&c, "n1", "ControllerPublishVolume").await;
    let leader = controller_leader(&c).await;
    let i = c
        .controllers
        .iter()
        .position(|p| p.name == leader)
        .expect("a controller leads");
    c.controllers[i].kill();
    let_go(&c, "n1", "ControllerPublishVolume").await;
    converges_without_repeats(&c).await;
    assert_ne!(
        controller_leader(&c).await,
        leader,
        "the other replica took over"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leading_controller_killed_mid_release_is_replaced_and_converges() {
    let _slot = SLOTS.acquire().await.unwrap();
    let mut c = published_cluster(2).await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    hold(&c, "n2", "NodeUnpublishVolume").await;
    c.stop_alloc("a1").await;
    wait_held(&c, "n2", "NodeUnpublishVolume").await;
    let leader = controller_leader(&c).await;
    let i = c
        .controllers
        .iter()
        .position(|p| p.name == leader)
        .expect("a controller leads");
    c.controllers[i].kill();
    let_go(&c, "n2", "NodeUnpublishVolume").await;
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    let (n1, n2) = (c.node("n1"), c.node("n2"));
    assert_eq!(n2.count("NodeUnpublishVolume", "OK"), 1);
    assert_eq!(n2.count("NodeUnstageVolume", "OK"), 1);
    assert_eq!(n1.count("ControllerUnpublishVolume", "OK"), 1);
    assert!(c.attachment("v1", "n2").await.is_none());
    c.controllers[i].restart();
    c.check_calls(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_that_disappears_is_unhealthy_not_forgotten() {
    let _slot = SLOTS.acquire().await.unwrap();
    let mut c = Cluster::start(1, 2, PluginOpts::default()).await;
    let plugin_on = |c: &Cluster| {
        let store = c.store.clone();
        async move {
            store
                .try_get(&crate::common::key::<NodeSpec>("nodes/n2"))
                .await
                .ok()
                .flatten()
                .and_then(|n| {
                    n.status
                        .plugins
                        .get(&PluginId::new(cluster::PLUGIN).unwrap())
                        .cloned()
                })
        }
    };
    let before = plugin_on(&c).await.expect("fingerprinted");
    assert!(before.healthy);
    assert_eq!(
        before.csi_node_id.as_ref().map(|i| i.as_str()),
        Some("csi-n2")
    );
    assert!(before.capabilities.node.has(NodeRpc::StageUnstageVolume));
    c.node_mut("n2").plugin.kill();
    c.wait("n2's plugin unhealthy", T, || async {
        plugin_on(&c).await.is_some_and(|p| !p.healthy)
    })
    .await;
    let after = plugin_on(&c).await.unwrap();
    assert_eq!(
        after.capabilities, before.capabilities,
        "what was learned is kept"
    );
    assert!(!after.health_message.is_empty());
    wait_event(&c, "Plugin unhealthy").await;
    let store = c.store.clone();
    c.wait("the plugin aggregate to count one healthy node", T, || {
        let store = store.clone();
        async move {
            store
                .try_get(&cluster::plugin_key())
                .await
                .ok()
                .flatten()
                .is_some_and(|p| p.status.nodes_healthy == 1 && p.status.nodes_expected == 2)
        }
    })
    .await;
    // A claim there is denied while it is unhealthy, and admitted when it is back.
    c.apply(c.volume("v1", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v1").await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Denied, T).await;
    c.node_mut("n2").plugin.restart();
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    wait_event(&c, "Plugin healthy").await;
    c.stop_alloc("a1").await;
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    c.check_calls(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_force_detach_releases_a_claim_on_a_dead_node() {
    let _slot = SLOTS.acquire().await.unwrap();
    let mut c = published_cluster(1).await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    // The node dies for good.
    c.node_mut("n2").agent.kill();
    c.node_mut("n2").plugin.kill();
    c.stop_alloc("a1").await;
    // Releasing: the node's steps are owed and the node is dead, so it waits there
    // until the operator's declaration below.
    c.wait_claim("a1", "n2", ClaimPhase::Releasing, T).await;
    // `moorctl volume detach v1 --node n2`.
    loop {
        let mut v = c
            .store
            .get(&crate::common::key::<VolumeSpec>("volumes/default/v1"))
            .await
            .unwrap();
        let generation = v.metadata.generation + 1;
        v.spec
            .force_detach
            .insert(NodeName::new("n2").unwrap(), generation);
        if c.store.replace(&v).await.is_ok() {
            break;
        }
    }
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    wait_event(&c, "Node steps skipped").await;
    assert_eq!(c.node("n1").count("ControllerUnpublishVolume", "OK"), 1);
    assert!(c.attachment("v1", "n2").await.is_none());
}

/// When each of `node`'s successful calls of `rpc` was at the plugin: (start, end).
fn call_spans(
    n: &cluster::TestNode,
    rpc: &str,
) -> Vec<(std::time::SystemTime, std::time::SystemTime)> {
    let mut spans: Vec<_> = n
        .calls()
        .iter()
        .filter(|c| c.rpc == rpc && c.ok())
        .map(|c| {
            let end = humantime::parse_rfc3339(&c.time).expect("a call's time");
            (end - Duration::from_secs_f64(c.duration_ms / 1000.0), end)
        })
        .collect();
    spans.sort();
    spans
}

/// Two volumes attached to one node at once, then detached at once, with the first
/// call of each held in the plugin. With the plugin's `serialize-per-node`, the second
/// call waits in the agent (counted by `moor_controller_calls_waiting_for_node`) and
/// never reaches the plugin while the first is there; without it, both are at the
/// plugin together.
async fn two_controller_calls_to_one_node(serialize: bool) {
    let _slot = SLOTS.acquire().await.unwrap();
    let opts = PluginOpts {
        plugin_options: if serialize {
            vec!["serialize-per-node=true".into()]
        } else {
            Vec::new()
        },
        // A held call must not time out while the test looks at it.
        agent_args: vec!["--csi-timeout=120s".into()],
        ..Default::default()
    };
    let c = Cluster::start(1, 2, opts).await;
    for v in ["v1", "v2"] {
        c.apply(c.volume(v, AccessMode::SingleNodeWriter)).await;
        c.volume_ready(v).await;
    }
    let n1 = c.node("n1");
    let waiting = "moor_controller_calls_waiting_for_node{plugin=\"hostpath.moor.dev\"}";
    for (rpc, step) in [
        ("ControllerPublishVolume", "attach"),
        ("ControllerUnpublishVolume", "detach"),
    ] {
        hold(&c, "n1", rpc).await;
        if step == "attach" {
            c.apply(c.allocation("a1", "n2", "v1", false)).await;
            c.apply(c.allocation("a2", "n2", "v2", false)).await;
        } else {
            c.stop_alloc("a1").await;
            c.stop_alloc("a2").await;
        }
        if serialize {
            c.wait(&format!("one {step} held, one waiting"), T, || async move {
                n1.hanging(rpc).await == 1
                    && common::metric(&n1.http_get("/metrics").await, waiting) == Some(1.0)
            })
            .await;
            // The waiting call is counted before it waits: it has not been sent.
            assert_eq!(
                n1.hanging(rpc).await,
                1,
                "the second {step} reached the plugin"
            );
        } else {
            c.wait(&format!("both {step}es held"), T, || async move {
                n1.hanging(rpc).await == 2
            })
            .await;
            let page = n1.http_get("/metrics").await;
            assert_ne!(common::metric(&page, waiting), Some(1.0));
        }
        let_go(&c, "n1", rpc).await;
        let phase = if step == "attach" {
            ClaimPhase::Published
        } else {
            ClaimPhase::Released
        };
        c.wait_claim("a1", "n2", phase, T).await;
        c.wait_claim("a2", "n2", phase, T).await;
        let spans = call_spans(n1, rpc);
        assert_eq!(spans.len(), 2, "{rpc}: {spans:?}");
        // The log's times are truncated to the millisecond (a start is its end less its
        // duration): serialized calls one after the other may seem to overlap by up to
        // a millisecond; calls held together overlap for the whole hold.
        let overlap = spans[0].1.duration_since(spans[1].0).unwrap_or_default();
        let resolution = Duration::from_millis(2);
        assert_eq!(
            overlap > resolution,
            !serialize,
            "{rpc} at the plugin: {spans:?}, overlapping {overlap:?}"
        );
    }
    c.check_calls(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serialize_per_node_sends_one_controller_call_per_node_at_a_time() {
    two_controller_calls_to_one_node(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_serialize_per_node_controller_calls_to_one_node_overlap() {
    two_controller_calls_to_one_node(false).await;
}

/// An attach limit that fell while running (Kubernetes' MutableCSINodeAllocatableCount):
/// the node can take one volume now. ControllerPublish refused with ResourceExhausted
/// (the spec's "max volumes attached") makes the node's agent ask NodeGetInfo again at
/// once, though its fingerprint interval here is an hour; the Node shows the new
/// max_volumes_per_node, admission holds the next claim by it, and the refused claim
/// attaches once a volume left the node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attach_refused_for_the_node_s_limit_refreshes_the_limit() {
    use moor_hostpath::faults::Command;
    let _slot = SLOTS.acquire().await.unwrap();
    let opts = PluginOpts {
        agent_args: vec!["--fingerprint-interval=1h".into(), "--retry-cap=2s".into()],
        ..Default::default()
    };
    let c = Cluster::start(1, 2, opts).await;
    for v in ["v1", "v2", "v3"] {
        c.apply(c.volume(v, AccessMode::SingleNodeWriter)).await;
        c.volume_ready(v).await;
    }
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    let (n1, n2) = (c.node("n1"), c.node("n2"));
    let asked_before = n2.tried("NodeGetInfo");
    // The controller instance (n1) enforces the new limit, the node instance (n2)
    // reports it.
    for n in [n1, n2] {
        n.fault(Command::MaxVolumes { max: 1 }).await;
    }
    c.apply(c.allocation("a2", "n2", "v2", false)).await;
    let store = &c.store;
    let limit = || async move {
        store
            .get(&Node::key_for(&cluster::node("n2")))
            .await
            .ok()
            .and_then(|n| {
                n.status
                    .plugins
                    .get(&PluginId::new(cluster::PLUGIN).unwrap())
                    .cloned()
            })
            .and_then(|p| p.max_volumes_per_node)
    };
    c.wait("the node's new limit on its Node", T, || async move {
        limit().await == Some(1)
    })
    .await;
    assert!(n1.count("ControllerPublishVolume", "ResourceExhausted") >= 1);
    let a2 = c.claim("a2", "n2").await.expect("a2's claim");
    let refused = a2
        .status
        .meta
        .retry
        .as_deref()
        .expect("a2 shows the refusal");
    assert_eq!(
        (refused.step.as_str(), refused.code.as_str()),
        ("ControllerPublishVolume", "ResourceExhausted")
    );
    // Asked again because of the refusals, not in a loop.
    let asked = n2.tried("NodeGetInfo") - asked_before;
    let refusals = n1.count("ControllerPublishVolume", "ResourceExhausted");
    assert!(
        asked >= 1 && asked <= refusals + 1,
        "NodeGetInfo asked {asked} times for {refusals} refusals"
    );

    // Admission now counts by the new limit.
    c.apply(c.allocation("a3", "n2", "v3", false)).await;
    c.wait_denied("a3", "n2", "(max 1)", T).await;
    // A volume leaves the node: the refused claim attaches on its retry.
    c.stop_alloc("a1").await;
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    c.wait_claim("a2", "n2", ClaimPhase::Published, T).await;
    let a3 = c.claim("a3", "n2").await.expect("a3's claim");
    assert_eq!(
        a3.status.phase,
        ClaimPhase::Denied,
        "a2 holds the one volume"
    );
    for a in ["a2", "a3"] {
        c.stop_alloc(a).await;
    }
    c.wait("every claim released", T, || c.all_claims_released())
        .await;
    c.check_calls(true);
}

/// SELinux labels on mounts (Kubernetes' SELinuxMount): a claim's label is sent as the
/// mount flag `context="..."` of NodeStage and NodePublish only to a node plugin the
/// agent is set to send it to (`selinux-mount=true`, n2 here, not n3), and a second
/// label on a volume already mounted on a node under another is denied, naming both.
/// This machine has no SELinux: what is checked is what each plugin was sent (its
/// call log records the context, the one mount flag it logs), not a labelled mount.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn selinux_labels_go_only_where_configured_and_one_volume_has_one_label_per_node() {
    let _slot = SLOTS.acquire().await.unwrap();
    let opts = PluginOpts {
        node_plugin_options: vec![("n2".into(), vec!["selinux-mount=true".into()])],
        ..Default::default()
    };
    let c = Cluster::start(1, 3, opts).await;
    c.apply(c.volume("v1", AccessMode::MultiNodeMultiWriter))
        .await;
    c.volume_ready("v1").await;
    let (l1, l2) = (
        "system_u:object_r:container_file_t:s0:c1,c2",
        "system_u:object_r:container_file_t:s0:c3,c4",
    );
    let labelled = |name: &str, node: &str, label: &str| {
        let mut a = c.allocation(name, node, "v1", false);
        a.spec.volumes[0].mount_options = Some(MountOptions {
            selinux_label: Some(label.into()),
            ..Default::default()
        });
        a
    };
    c.apply(labelled("a1", "n2", l1)).await;
    c.apply(labelled("a2", "n3", l2)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    c.wait_claim("a2", "n3", ClaimPhase::Published, T).await;
    let sent = |node: &str| -> Vec<(String, Option<String>)> {
        c.node(node)
            .calls()
            .into_iter()
            .filter(|k| k.ok() && (k.rpc == "NodeStageVolume" || k.rpc == "NodePublishVolume"))
            .map(|k| (k.rpc, k.selinux_context))
            .collect()
    };
    let l1_sent = Some(l1.to_string());
    assert_eq!(
        sent("n2"),
        [
            ("NodeStageVolume".to_string(), l1_sent.clone()),
            ("NodePublishVolume".to_string(), l1_sent.clone())
        ],
        "n2 takes labels"
    );
    assert!(
        sent("n3").len() == 2 && sent("n3").iter().all(|(_, l)| l.is_none()),
        "n3 does not take labels: {:?}",
        sent("n3")
    );

    // Another label on n2, where v1 is mounted under l1: denied, naming both.
    c.apply(labelled("a3", "n2", l2)).await;
    c.wait_claim("a3", "n2", ClaimPhase::Denied, T).await;
    let reason = c
        .claim("a3", "n2")
        .await
        .and_then(|cl| cl.status.reason)
        .unwrap_or_default();
    assert!(reason.contains(l1) && reason.contains(l2), "{reason}");
    // `moorctl alloc plan` says the same before anything is applied.
    let file = c.dir.path().join("a5.yaml");
    std::fs::write(
        &file,
        format!(
            "apiVersion: moor/v1\nkind: Allocation\nmetadata: {{name: a5}}\nspec:\n  node: n2\n  \
             volumes:\n    - {{name: data, volume: v1, mount_options: {{selinux_label: \"{l2}\"}}}}\n"
        ),
    )
    .unwrap();
    let (_, plan) = c.moorctl(&[
        "alloc",
        "plan",
        "-f",
        file.to_str().unwrap(),
        "--node",
        "n2",
    ]);
    assert!(plan.contains(l1) && plan.contains(l2), "{plan}");
    // The same label: admitted, published beside a1 (one stage, two publishes).
    c.apply(labelled("a4", "n2", l1)).await;
    c.wait_claim("a4", "n2", ClaimPhase::Published, T).await;
    assert_eq!(c.node("n2").count("NodeStageVolume", "OK"), 1);
    assert_eq!(c.node("n2").count("NodePublishVolume", "OK"), 2);
    // Once the l1 claims are gone, l2 is admitted on n2.
    for a in ["a1", "a4"] {
        c.stop_alloc(a).await;
    }
    c.wait_claim("a3", "n2", ClaimPhase::Published, T).await;
    let last_stage = c
        .node("n2")
        .calls()
        .into_iter()
        .rfind(|k| k.ok() && k.rpc == "NodeStageVolume")
        .and_then(|k| k.selinux_context);
    assert_eq!(last_stage.as_deref(), Some(l2), "staged again under l2");
    for a in ["a2", "a3"] {
        c.stop_alloc(a).await;
    }
    c.wait("every claim released", T, || c.all_claims_released())
        .await;
    c.check_calls(true);
}
