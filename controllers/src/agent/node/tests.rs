//! The node executor in-process (see `crate::rig`): the calls it sends, in order, and
//! what it records, for each class of answer the plugin gives.

use crate::rig::{Rig, RigConfig};
use moor::api::{AccessMode, ClaimPhase};

const CREATED: [&str; 2] = ["CreateVolume", "ControllerPublishVolume"];

fn owned(s: &[&str]) -> Vec<String> {
    s.iter().map(|s| s.to_string()).collect()
}

/// Stage before publish; on release, unpublish before unstage, and the detach only
/// after both. Each call exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_is_staged_then_published_and_torn_down_in_reverse() {
    let rig = Rig::start().await;
    rig.volume("v1", AccessMode::SingleNodeWriter).await;
    rig.run("a1", "v1").await;
    rig.wait_claim("a1", ClaimPhase::Published).await;
    let mut expect = owned(&CREATED);
    expect.extend(owned(&["NodeStageVolume", "NodePublishVolume"]));
    assert_eq!(rig.steps(), expect);
    let m = rig.mount("a1").await.expect("the claim's Mount");
    assert!(m.status.staged && m.status.published, "{:?}", m.status);
    assert!(!m.status.stage_uncertain && !m.status.publish_uncertain);

    rig.stop("a1").await;
    rig.wait_claim("a1", ClaimPhase::Released).await;
    expect.extend(owned(&[
        "NodeUnpublishVolume",
        "NodeUnstageVolume",
        "ControllerUnpublishVolume",
    ]));
    assert_eq!(rig.steps(), expect);
}

/// A final answer to NodeStage: the step took no effect, so it is tried again on the
/// step's schedule (each try one call: a final answer is not repeated within a try)
/// and, once released, owes no NodeUnstage and no NodeUnpublish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_answer_to_node_stage_owes_no_reverse() {
    let rig = Rig::start().await;
    rig.volume("v1", AccessMode::SingleNodeWriter).await;
    rig.fail("NodeStageVolume", "InvalidArgument", 1000).await;
    rig.run("a1", "v1").await;
    rig.wait("two tries of NodeStage", || async {
        rig.steps()
            .iter()
            .filter(|s| s.starts_with("NodeStage"))
            .count()
            >= 2
    })
    .await;
    // The Mount says the failure and that nothing is staged, not even in doubt
    // (written after the answer: waited for).
    rig.wait("the Mount to show the final answer", || async {
        rig.mount("a1").await.is_some_and(|m| {
            !m.status.staged
                && !m.status.stage_uncertain
                && m.status
                    .meta
                    .last_error
                    .as_deref()
                    .is_some_and(|e| e.contains("InvalidArgument"))
        })
    })
    .await;
    rig.stop("a1").await;
    rig.wait_claim("a1", ClaimPhase::Released).await;
    let steps = rig.steps();
    assert!(
        steps.iter().all(|s| s == "NodeStageVolume:InvalidArgument"
            || CREATED.contains(&s.as_str())
            || s == "ControllerUnpublishVolume"),
        "{steps:?}"
    );
    assert_eq!(
        steps.last().map(String::as_str),
        Some("ControllerUnpublishVolume")
    );
}

/// An uncertain answer to NodePublish (it may have taken effect): once released, the
/// node owes NodeUnpublish although no NodePublish ever answered OK, then NodeUnstage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncertain_node_publish_is_reversed_on_release() {
    let rig = Rig::start().await;
    rig.volume("v1", AccessMode::SingleNodeWriter).await;
    rig.fail("NodePublishVolume", "Internal", 1000).await;
    rig.run("a1", "v1").await;
    rig.wait("a NodePublish answered Internal", || async {
        rig.steps()
            .iter()
            .any(|s| s == "NodePublishVolume:Internal")
    })
    .await;
    // The Mount is written after the call's answer: waited for, not read at once.
    rig.wait("the Mount to say the publish is uncertain", || async {
        rig.mount("a1")
            .await
            .is_some_and(|m| m.status.publish_uncertain && !m.status.published)
    })
    .await;
    rig.stop("a1").await;
    rig.wait_claim("a1", ClaimPhase::Released).await;
    let steps = rig.steps();
    let tail: Vec<&str> = steps
        .iter()
        .map(String::as_str)
        .filter(|s| !s.starts_with("NodePublishVolume"))
        .collect();
    assert_eq!(
        tail,
        [
            "CreateVolume",
            "ControllerPublishVolume",
            "NodeStageVolume",
            "NodeUnpublishVolume",
            "NodeUnstageVolume",
            "ControllerUnpublishVolume"
        ]
    );
}

/// A transient answer (ResourceExhausted) is repeated within the try (`--csi-tries=2`):
/// two failures cost one try, and the step succeeds on the third call with no backoff
/// of the step itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transient_answer_is_repeated_within_the_try() {
    let rig = Rig::start().await;
    rig.volume("v1", AccessMode::SingleNodeWriter).await;
    rig.fail("NodeStageVolume", "ResourceExhausted", 2).await;
    rig.run("a1", "v1").await;
    rig.wait_claim("a1", ClaimPhase::Published).await;
    let stages: Vec<String> = rig
        .steps()
        .into_iter()
        .filter(|s| s.starts_with("NodeStage"))
        .collect();
    assert_eq!(
        stages,
        [
            "NodeStageVolume:ResourceExhausted",
            "NodeStageVolume:ResourceExhausted",
            "NodeStageVolume"
        ]
    );
}

/// The claim of a live allocation, deleted: its allocation makes it again (another
/// uid). Where the store lost the node's Mount with it (an older snapshot restored),
/// the node keeps the mount as an orphan and the claim made again adopts it: no call
/// at all, the volume never unpublished. Where the Mount stayed (the claim alone was
/// deleted, behind the controller's back), it is torn down and published again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_lost_with_its_mount_is_adopted_and_one_deleted_alone_is_redone() {
    use moor::api::Mount;
    let rig = Rig::start().await;
    rig.volume("v1", AccessMode::SingleNodeWriter).await;
    rig.run("a1", "v1").await;
    rig.wait_claim("a1", ClaimPhase::Published).await;
    let before = rig.steps();
    let first = rig.claim("a1").await.expect("claim");
    // Lost with its Mount, in one transaction: as a restore of a snapshot from before
    // the claim would.
    let mount_key = Mount::key_for(&first.object_key());
    let prefix = rig.store.prefix().to_string();
    let both = [mount_key.as_str(), first.object_key().as_str()]
        .map(|k| etcd_client::TxnOp::delete(format!("{prefix}{k}"), None));
    rig.store
        .client()
        .txn(etcd_client::Txn::new().and_then(both))
        .await
        .expect("delete the claim and its Mount");
    rig.wait("the claim made again and published", || async {
        rig.claim("a1").await.is_some_and(|c| {
            c.metadata.uid != first.metadata.uid && c.status.phase == ClaimPhase::Published
        })
    })
    .await;
    let m = rig.mount("a1").await.expect("the claim's Mount");
    assert!(
        m.status.published && m.status.orphan.is_none(),
        "{:?}",
        m.status
    );
    assert_eq!(rig.steps(), before, "adopted without a call");

    // Deleted alone, its Mount kept: torn down, then staged and published again.
    let second = rig.claim("a1").await.expect("claim");
    rig.store
        .delete(&second.object_key(), None)
        .await
        .expect("delete the claim");
    rig.wait("torn down and published again", || async {
        let steps = rig.steps();
        steps.len() >= before.len() + 4
            && rig.claim("a1").await.is_some_and(|c| {
                c.metadata.uid != second.metadata.uid && c.status.phase == ClaimPhase::Published
            })
    })
    .await;
    let mut expect = before.clone();
    expect.extend(owned(&[
        "NodeUnpublishVolume",
        "NodeUnstageVolume",
        "NodeStageVolume",
        "NodePublishVolume",
    ]));
    assert_eq!(rig.steps(), expect);
}

/// An online expansion asked of the node (the plugin answers ControllerExpandVolume
/// with `node_expansion_required`): NodeExpandVolume of the published volume is the
/// pass's only step (nothing staged or published again), recorded on the Mount.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_online_expansion_is_the_published_volume_s_only_step() {
    let rig = Rig::start_with(RigConfig::plugin(|p| p.node_expansion_required = true)).await;
    rig.volume("v1", AccessMode::SingleNodeWriter).await;
    rig.run("a1", "v1").await;
    rig.wait_claim("a1", ClaimPhase::Published).await;
    rig.edit_volume("v1", |s| s.capacity_min = Some(moor::api::Size(4 << 20)))
        .await;
    rig.wait("the node to expand a1's volume", || async {
        rig.mount("a1")
            .await
            .is_some_and(|m| m.status.expanded_bytes == Some(4 << 20))
    })
    .await;
    let mut expect = owned(&CREATED);
    expect.extend(owned(&[
        "NodeStageVolume",
        "NodePublishVolume",
        "ControllerExpandVolume",
        "NodeExpandVolume",
    ]));
    assert_eq!(rig.steps(), expect);
    let expand = rig
        .calls()
        .into_iter()
        .find(|c| c.rpc == "NodeExpandVolume")
        .expect("the call");
    let target = rig.mount("a1").await.expect("Mount").spec.target_path;
    assert!(
        expand
            .target_path
            .as_deref()
            .is_some_and(|t| target.ends_with(t)),
        "expanded at the target path {target}: {expand:?}"
    );
}

/// An offline plugin: the volume is expanded once released, and the next claim's
/// node expands it on the staged volume, between NodeStage and NodePublish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offline_expansion_runs_between_stage_and_publish() {
    let rig = Rig::start_with(RigConfig::plugin(|p| {
        p.node_expansion_required = true;
        p.expansion = moor_hostpath::Expansion::Offline;
    }))
    .await;
    rig.volume("v1", AccessMode::SingleNodeWriter).await;
    rig.run("a1", "v1").await;
    rig.wait_claim("a1", ClaimPhase::Published).await;
    rig.stop("a1").await;
    rig.wait_claim("a1", ClaimPhase::Released).await;
    rig.edit_volume("v1", |s| s.capacity_min = Some(moor::api::Size(4 << 20)))
        .await;
    rig.wait("the controller to expand v1", || async {
        rig.steps().iter().any(|s| s == "ControllerExpandVolume")
    })
    .await;
    let before = rig.steps().len();
    rig.run("a2", "v1").await;
    rig.wait_claim("a2", ClaimPhase::Published).await;
    let steps = rig.steps();
    assert_eq!(
        steps[before..],
        owned(&[
            "ControllerPublishVolume",
            "NodeStageVolume",
            "NodeExpandVolume",
            "NodePublishVolume"
        ])
    );
    let m = rig.mount("a2").await.expect("Mount");
    assert_eq!(m.status.expanded_bytes, Some(4 << 20), "{:?}", m.status);
}
