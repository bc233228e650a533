//! The controller-plugin executors in-process (see `crate::rig`): the attacher's
//! ControllerPublish and ControllerUnpublish, the claims' detach that waits for the
//! node, and the provisioner's CreateVolume and DeleteVolume, for each class of answer.

use crate::rig::Rig;
use moor::api::{AccessMode, ClaimPhase, Namespace, Volume};

fn count(steps: &[String], step: &str) -> usize {
    steps.iter().filter(|s| *s == step).count()
}

fn position(steps: &[String], step: &str) -> usize {
    steps
        .iter()
        .position(|s| s == step)
        .unwrap_or_else(|| panic!("no {step} in {steps:?}"))
}

/// A final answer to ControllerPublish: no node step is taken until a ControllerPublish
/// answers OK; the step is tried again on its schedule, one call per try.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_node_step_before_controller_publish_answers_ok() {
    let rig = Rig::start(&[]).await;
    rig.volume("v1", AccessMode::SingleNodeWriter).await;
    rig.fail("ControllerPublishVolume", "FailedPrecondition", 2)
        .await;
    rig.run("a1", "v1").await;
    rig.wait_claim("a1", ClaimPhase::Published).await;
    let steps = rig.steps();
    assert_eq!(
        steps,
        [
            "CreateVolume",
            "ControllerPublishVolume:FailedPrecondition",
            "ControllerPublishVolume:FailedPrecondition",
            "ControllerPublishVolume",
            "NodeStageVolume",
            "NodePublishVolume"
        ]
    );
}

/// An uncertain answer to ControllerPublish (the volume may be attached): a claim
/// released before any ControllerPublish answered OK still gets its
/// ControllerUnpublish, and no node step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncertain_controller_publish_is_unpublished_on_release() {
    let rig = Rig::start(&[]).await;
    rig.volume("v1", AccessMode::SingleNodeWriter).await;
    rig.fail("ControllerPublishVolume", "Internal", 1000).await;
    rig.run("a1", "v1").await;
    rig.wait("a ControllerPublish answered Internal", || async {
        count(&rig.steps(), "ControllerPublishVolume:Internal") >= 1
    })
    .await;
    rig.stop("a1").await;
    rig.wait_claim("a1", ClaimPhase::Released).await;
    let steps = rig.steps();
    assert!(
        !steps.iter().any(|s| s.starts_with("Node")),
        "a node step without an attachment: {steps:?}"
    );
    assert_eq!(
        steps.last().map(String::as_str),
        Some("ControllerUnpublishVolume")
    );
    assert_eq!(count(&steps, "ControllerUnpublishVolume"), 1, "{steps:?}");
}

/// The detach waits for the node: while NodeUnstage fails (uncertain), no
/// ControllerUnpublish is sent; it follows the NodeUnstage that answers OK.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_detach_waits_for_the_node_to_unstage() {
    let rig = Rig::start(&[]).await;
    rig.volume("v1", AccessMode::SingleNodeWriter).await;
    rig.run("a1", "v1").await;
    rig.wait_claim("a1", ClaimPhase::Published).await;
    rig.fail("NodeUnstageVolume", "Internal", 3).await;
    rig.stop("a1").await;
    rig.wait_claim("a1", ClaimPhase::Released).await;
    let steps = rig.steps();
    assert_eq!(count(&steps, "NodeUnstageVolume:Internal"), 3, "{steps:?}");
    assert_eq!(count(&steps, "ControllerUnpublishVolume"), 1, "{steps:?}");
    assert!(
        position(&steps, "NodeUnstageVolume") < position(&steps, "ControllerUnpublishVolume"),
        "{steps:?}"
    );
    let claim = rig.claim("a1").await.expect("the claim");
    assert_eq!(claim.status.phase, ClaimPhase::Released);
}

/// CreateVolume: a transient answer is repeated within the try, a final one on the
/// step's schedule; the volume is made once. Deleting it sends one DeleteVolume, after
/// which its finalizer is removed and the object is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_provisioner_creates_once_and_deletes_once() {
    let rig = Rig::start(&[]).await;
    rig.fail("CreateVolume", "ResourceExhausted", 1).await;
    rig.volume("v1", AccessMode::SingleNodeWriter).await;
    rig.fail("CreateVolume", "InvalidArgument", 1).await;
    rig.volume("v2", AccessMode::SingleNodeWriter).await;
    let steps = rig.steps();
    assert_eq!(
        steps,
        [
            "CreateVolume:ResourceExhausted",
            "CreateVolume",
            "CreateVolume:InvalidArgument",
            "CreateVolume"
        ]
    );
    let ns = Namespace::default_ns();
    for name in ["v1", "v2"] {
        rig.store
            .delete(&Volume::key_for(&ns, name), None)
            .await
            .expect("delete the volume");
    }
    rig.wait("both volumes gone", || async {
        let mut gone = true;
        for name in ["v1", "v2"] {
            gone &= rig
                .store
                .try_get(&Volume::key_for(&ns, name))
                .await
                .is_ok_and(|v| v.is_none());
        }
        gone
    })
    .await;
    assert_eq!(count(&rig.steps(), "DeleteVolume"), 2, "{:?}", rig.steps());
}
