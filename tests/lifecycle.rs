//! The claim lifecycle end to end: real etcd, `moord controller` replicas, one `moord
//! agent` per node with its own moor-hostpath process; every test ends by checking the
//! plugins' call logs against the invariants.

mod common;

use common::cluster::{Cluster, PluginOpts};
use moor::api::*;
use std::time::Duration;
use tokio::sync::Semaphore;

/// Clusters are several processes each: run two tests at a time on two cores.
static SLOTS: Semaphore = Semaphore::const_new(2);

const T: Duration = Duration::from_secs(30);

async fn events(c: &Cluster, reason: &str) -> Vec<Event> {
    c.store
        .list::<EventSpec>("")
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.spec.reason == reason)
        .collect()
}

/// Publishes one claim on n2 and releases it; returns the cluster for more checks.
async fn publish_and_release(opts: PluginOpts) -> Cluster {
    let c = Cluster::start(1, 2, opts.clone()).await;
    c.apply(c.volume("v1", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v1").await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;

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
        assert_eq!(att.spec.csi_node_id.as_str(), "csi-n2", "the CSI node id, not moor's");
    } else {
        assert!(c.attachment("v1", "n2").await.is_none());
    }
    if common::cluster::can_mount() {
        assert_eq!(c.mounts_under("n2"), 1 + stage, "target (and staging) mounted");
    }
    let mount = c
        .store
        .get::<MountSpec>("n2/default/a1.data")
        .await
        .expect("mount object");
    assert!(mount.status.published);

    c.stop_alloc("a1").await;
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    assert_eq!(n2.count("NodeUnpublishVolume", "OK"), 1);
    assert_eq!(n2.count("NodeUnstageVolume", "OK"), stage);
    assert_eq!(n1.count("ControllerUnpublishVolume", "OK"), attach);
    assert!(c.attachment("v1", "n2").await.is_none());
    if common::cluster::can_mount() {
        assert_eq!(c.mounts_under("n2"), 0, "nothing left mounted");
    }
    let mounted = events(&c, "Mount volume").await;
    assert!(
        mounted.iter().any(|e| e.spec.details.get("volume_id").map(String::as_str) == Some("v1")
            && e.spec.details.get("success").map(String::as_str) == Some("true")),
        "{mounted:?}"
    );
    assert!(!events(&c, "Unmount volume").await.is_empty());
    let vol = c.store.get::<VolumeSpec>("default/v1").await.unwrap();
    assert!(vol.status.claims.write_claims.is_empty());
    assert_eq!(vol.status.claims.past_claims.len(), 1);
    c.check_calls(true);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_and_release_with_attach_and_stage() {
    let _slot = SLOTS.acquire().await.unwrap();
    publish_and_release(PluginOpts::default()).await;
}
