//! Regression tests for the lifecycle off the happy path (issue 11): each names the
//! defect it guards and fails on the code before its fix. Real etcd, `moord` processes
//! and moor-hostpath plugins (strict: NodeStage of a volume not controller-published to
//! the node is FAILED_PRECONDITION).

#[path = "common/cluster.rs"]
mod cluster;
mod common;

use cluster::{Cluster, PluginOpts};
use moor::api::*;
use moor::runtime::steps::Schedule;
use moor_hostpath::faults::Command;
use std::time::Duration;
use tokio::sync::Semaphore;

static SLOTS: Semaphore = Semaphore::const_new(2);

const T: Duration = Duration::from_secs(30);

/// The agents' retry schedule as the harness runs them (moord's defaults).
fn schedule() -> Schedule {
    Schedule::default()
}

/// Calls per attempt: the harness runs agents with `--csi-tries=2`.
const TRIES: u32 = 2;

async fn ready_cluster(nodes: usize, opts: PluginOpts) -> Cluster {
    let c = Cluster::start(1, nodes, opts).await;
    c.apply(c.volume("v1", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v1").await;
    c
}

/// The attachment (uid) the claim of `alloc` on `node` is granted on.
async fn granted_on(c: &Cluster, alloc: &str, node: &str) -> Option<Uid> {
    c.claim(alloc, node).await.and_then(|cl| cl.spec.attachment)
}

fn calls(c: &Cluster, node: &str, rpc: &str) -> usize {
    c.node(node).calls().iter().filter(|x| x.rpc == rpc).count()
}

/// Defect 1: with the plugin's controller capabilities unknown, a claim was let onto
/// the node as if no ControllerPublish were needed, and NodeStage came first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_controller_capabilities_keep_the_claim_off_the_node() {
    let _slot = SLOTS.acquire().await.unwrap();
    let mut c = ready_cluster(2, PluginOpts::default()).await;
    // The only controller instance goes away, and the Plugin object is set to say
    // nothing of whether ControllerPublish is needed, as on a fresh cluster before the
    // first fingerprint (the controller keeps that answer while no controller instance
    // is registered).
    c.node_mut("n1").agent.kill();
    c.node_mut("n1").plugin.kill();
    let store = c.store.clone();
    c.wait("n1's Node to expire", T, || {
        let store = store.clone();
        async move {
            matches!(
                store
                    .try_get(&crate::common::key::<NodeSpec>("nodes/n1"))
                    .await,
                Ok(None)
            )
        }
    })
    .await;
    // What a fresh cluster's Plugin says before its first controller fingerprint.
    loop {
        let mut p = c.store.get(&cluster::plugin_key()).await.unwrap();
        p.status.controller_required = None;
        match c.store.replace_status(&p).await {
            Ok(_) => break,
            Err(moor::store::StoreError::Conflict { .. }) => continue,
            Err(e) => panic!("{e}"),
        }
    }
    let plugin = c.store.get(&cluster::plugin_key()).await.unwrap();
    assert_eq!(plugin.status.controller_required, None);

    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    let claim_waits = || async {
        c.claim("a1", "n2").await.is_some_and(|cl| {
            cl.status
                .reason
                .as_deref()
                .is_some_and(|r| r.contains("controller capabilities"))
        })
    };
    c.wait("the claim to wait for the capabilities", T, claim_waits)
        .await;
    let claim = c.claim("a1", "n2").await.unwrap();
    assert!(!claim.spec.publish, "not let onto the node");
    assert_eq!(calls(&c, "n2", "NodeStageVolume"), 0);

    // The controller instance comes back: ControllerPublish, then the node.
    c.node_mut("n1").plugin.restart();
    c.node_mut("n1").agent.restart();
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    assert_eq!(c.node("n1").count("ControllerPublishVolume", "OK"), 1);
    assert_eq!(calls(&c, "n2", "NodeStageVolume"), 1);
    c.stop_alloc("a1").await;
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    c.check_calls(true);
}

/// Defect 2: after a failed ControllerUnpublish the retry thought nothing was owed and
/// deleted the Attachment; the volume stayed attached in the plugin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_controller_unpublish_is_retried_until_it_succeeds() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = ready_cluster(2, PluginOpts::default()).await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    c.node("n1")
        .fault(Command::Fail {
            rpc: "ControllerUnpublishVolume".into(),
            code: "Unavailable".into(),
            times: 5,
        })
        .await;
    c.stop_alloc("a1").await;
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    let n1 = c.node("n1");
    assert_eq!(n1.count("ControllerUnpublishVolume", "Unavailable"), 5);
    assert_eq!(
        n1.count("ControllerUnpublishVolume", "OK"),
        1,
        "released only after an unpublish that succeeded"
    );
    assert!(c.attachment("v1", "n2").await.is_none());
    c.check_calls(true);
}

/// Defect 3: a final NodeStage answer was tried again about 200 times a second,
/// because the step's own status write re-triggered it; retryable ones never backed off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_node_steps_follow_their_backoff_schedule() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = ready_cluster(2, PluginOpts::default()).await;
    c.node("n2")
        .fault(Command::Fail {
            rpc: "NodeStageVolume".into(),
            code: "InvalidArgument".into(),
            times: 100_000,
        })
        .await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    let n2 = c.node("n2");
    c.wait("NodeStage to fail", T, || async move {
        n2.count("NodeStageVolume", "InvalidArgument") > 0
    })
    .await;
    // What the claim shows: the step, the final answer, the attempts, the next retry.
    c.wait("the claim to show the failing step", T, || async {
        c.claim("a1", "n2").await.is_some_and(|cl| {
            cl.status.meta.retry.as_ref().is_some_and(|r| {
                r.step == "NodeStageVolume" && r.code == "InvalidArgument" && r.final_answer
            })
        })
    })
    .await;
    let window = Duration::from_secs(6);
    tokio::time::sleep(window).await;
    // A final answer waits for the cap (5 minutes): one attempt in the window.
    let bound = schedule().max_attempts_within(window + Duration::from_secs(2), true);
    let made = calls(&c, "n2", "NodeStageVolume") as u32;
    assert!(
        made <= bound,
        "{made} NodeStage calls, at most {bound} allowed"
    );
    let claim = c.claim("a1", "n2").await.unwrap();
    let retry = claim.status.meta.retry.expect("retry shown");
    assert_eq!(retry.attempts, 1);
    assert!(retry.next_retry.system() > retry.since.system() + Duration::from_secs(200));

    // A retryable answer backs off from 500 ms, doubling.
    c.node("n2").fault(Command::Clear).await;
    c.node("n2")
        .fault(Command::Fail {
            rpc: "NodePublishVolume".into(),
            code: "Unavailable".into(),
            times: 100_000,
        })
        .await;
    // A volume of its own (a1 holds v1, single-node-writer).
    c.apply(c.volume("v2", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v2").await;
    c.apply(c.allocation("a3", "n2", "v2", false)).await;
    c.wait("NodePublish of a3 to fail", T, || async move {
        n2.count("NodePublishVolume", "Unavailable") > 0
    })
    .await;
    let first = n2
        .calls()
        .iter()
        .filter(|x| x.rpc == "NodePublishVolume")
        .count();
    tokio::time::sleep(window).await;
    let made = (n2
        .calls()
        .iter()
        .filter(|x| x.rpc == "NodePublishVolume")
        .count()
        - first) as u32;
    let bound = schedule().max_attempts_within(window, false) * TRIES;
    assert!(
        made <= bound,
        "{made} NodePublish calls in {window:?}, at most {bound} allowed"
    );
}

/// Defect 3, provisioner: a CreateVolume refused for good was called again and again
/// and the volume showed "creating".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_refused_for_good_is_failed_and_not_hammered() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 1, PluginOpts::default()).await;
    // The plugin cannot serve the requested range (as a vendor answers a size it
    // does not offer).
    c.node("n1")
        .fault(Command::Fail {
            rpc: "CreateVolume".into(),
            code: "OutOfRange".into(),
            times: 100_000,
        })
        .await;
    c.apply(c.volume("big", AccessMode::SingleNodeWriter)).await;
    let store = c.store.clone();
    c.wait("the volume to fail", T, || {
        let store = store.clone();
        async move {
            store
                .try_get(&crate::common::key::<VolumeSpec>("volumes/default/big"))
                .await
                .ok()
                .flatten()
                .is_some_and(|v| v.status.provisioning.phase == VolumePhase::Failed)
        }
    })
    .await;
    let v = c
        .store
        .get(&crate::common::key::<VolumeSpec>("volumes/default/big"))
        .await
        .unwrap();
    let retry = v.status.provisioning.meta.retry.expect("retry shown");
    assert_eq!(retry.step, "CreateVolume");
    assert!(retry.final_answer);
    tokio::time::sleep(Duration::from_secs(4)).await;
    let made = calls(&c, "n1", "CreateVolume");
    assert_eq!(made, 1, "a final answer is not retried before the cap");
}

/// Issue 40, item 3: the CreateVolume a deletion asks again (the create may have taken
/// effect without moor learning the volume's id) runs on CreateVolume's schedule. It
/// was called outside the step runner, so every pass of the volume (any change to
/// it) asked a plugin failing it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_asked_again_before_a_delete_follows_the_step_schedule() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 1, PluginOpts::default()).await;
    c.node("n1")
        .fault(Command::Fail {
            rpc: "CreateVolume".into(),
            code: "Unavailable".into(),
            times: 100_000,
        })
        .await;
    c.apply(c.volume("v9", AccessMode::SingleNodeWriter)).await;
    let key = crate::common::key::<VolumeSpec>("volumes/default/v9");
    let store = c.store.clone();
    c.wait("the create to fail retryably", T, || {
        let (store, key) = (store.clone(), key.clone());
        async move {
            store.try_get(&key).await.ok().flatten().is_some_and(|v| {
                v.status.provisioning.phase == VolumePhase::Creating
                    && v.status.provisioning.external_id.is_none()
                    && v.status
                        .provisioning
                        .meta
                        .retry
                        .as_ref()
                        .is_some_and(|r| r.step == "CreateVolume")
            })
        }
    })
    .await;
    let (ok, out) = c.moorctl(&["delete", "volume", "v9"]);
    assert!(ok, "{out}");
    let first = calls(&c, "n1", "CreateVolume");
    // Every pass of the volume would ask again: touch it every 200 ms meanwhile.
    let window = Duration::from_secs(6);
    let until = std::time::Instant::now() + window;
    while std::time::Instant::now() < until {
        if let Ok(Some(mut v)) = c.store.try_get(&key).await {
            let n = v.metadata.labels.len();
            let mut labels = (*v.metadata.labels).clone();
            labels.insert(format!("touch{n}"), "1".into());
            v.metadata.labels = labels.into();
            let _ = c.store.replace(&v).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let made = (calls(&c, "n1", "CreateVolume") - first) as u32;
    let bound = schedule().max_attempts_within(window, false) * TRIES;
    assert!(
        made <= bound,
        "{made} CreateVolume calls in {window:?} while deleting, at most {bound} allowed"
    );
    // Nothing is leaked: the volume waits for the plugin, and shows why.
    let v = c.store.get(&key).await.unwrap();
    assert!(v.is_deleting());
    let retry = v.status.provisioning.meta.retry.expect("retry shown");
    assert_eq!(retry.step, "CreateVolume");
    assert_eq!(retry.code, "Unavailable");
}

/// Defect 4: `force_detach` was never cleared, so after the node came back a new claim
/// there got ControllerUnpublish while its NodeUnpublish was still in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_force_detach_does_not_apply_to_a_claim_admitted_after_it() {
    let _slot = SLOTS.acquire().await.unwrap();
    let mut c = ready_cluster(2, PluginOpts::default()).await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    c.node_mut("n2").agent.kill();
    c.stop_alloc("a1").await;
    // `moorctl volume detach v1 --node n2`, as moorctl writes it.
    let out = std::process::Command::new(cluster::bin("moorctl"))
        .args([
            "--endpoints",
            &c.etcd.client_url,
            "volume",
            "detach",
            "v1",
            "--node",
            "n2",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    assert_eq!(c.node("n1").count("ControllerUnpublishVolume", "OK"), 1);

    // The node comes back; a new claim there is published.
    c.node_mut("n2").agent.restart();
    c.apply(c.allocation("a2", "n2", "v1", false)).await;
    c.wait_claim("a2", "n2", ClaimPhase::Published, T).await;
    // Its release waits for the node: no ControllerUnpublish while NodeUnpublish hangs.
    c.node("n2")
        .fault(Command::Hang {
            rpc: "NodeUnpublishVolume".into(),
            after: false,
        })
        .await;
    c.stop_alloc("a2").await;
    let n2 = c.node("n2");
    c.wait("NodeUnpublish held", T, || async move {
        n2.hanging("NodeUnpublishVolume").await > 0
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        c.node("n1").count("ControllerUnpublishVolume", "OK"),
        1,
        "no detach under a live node's publish"
    );
    assert_eq!(
        c.claim("a2", "n2").await.unwrap().status.phase,
        ClaimPhase::Releasing
    );
    c.node("n2")
        .fault(Command::Release {
            rpc: "NodeUnpublishVolume".into(),
        })
        .await;
    c.node("n2").fault(Command::Clear).await;
    c.wait_claim("a2", "n2", ClaimPhase::Released, T).await;
    assert_eq!(c.node("n1").count("ControllerUnpublishVolume", "OK"), 2);
}

/// Defect 7: a claim denied by max_volumes_per_node waited for an unrelated event
/// (or the 5-minute resync) after the claim blocking it was released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_admits_the_claims_it_was_blocking() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = ready_cluster(
        2,
        PluginOpts {
            extra: vec!["--max-volumes-per-node=1".into()],
            ..Default::default()
        },
    )
    .await;
    c.apply(c.volume("v2", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v2").await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    c.apply(c.allocation("a2", "n2", "v2", false)).await;
    c.wait_claim("a2", "n2", ClaimPhase::Denied, T).await;
    c.stop_alloc("a1").await;
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    c.wait_claim("a2", "n2", ClaimPhase::Published, Duration::from_secs(15))
        .await;
    c.stop_alloc("a2").await;
    c.wait_claim("a2", "n2", ClaimPhase::Released, T).await;
    c.check_calls(true);
}

/// Defect 9: a stopped allocation set back to `run` stayed Pending forever, its claim
/// Released, with no event and no reason. It runs again, with new claims.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_allocation_set_back_to_run_runs_again() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = ready_cluster(2, PluginOpts::default()).await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    let first = c.claim("a1", "n2").await.unwrap().metadata.uid;
    c.stop_alloc("a1").await;
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    loop {
        let mut a = c
            .store
            .get(&crate::common::key::<AllocationSpec>(
                "allocations/default/a1",
            ))
            .await
            .unwrap();
        a.spec.desired_status = DesiredStatus::Run;
        if c.store.replace(&a).await.is_ok() {
            break;
        }
    }
    c.wait("a new claim published", T, || async {
        c.claim("a1", "n2")
            .await
            .is_some_and(|cl| cl.metadata.uid != first && cl.status.phase == ClaimPhase::Published)
    })
    .await;
    assert_eq!(c.node("n2").count("NodePublishVolume", "OK"), 2);
    c.stop_alloc("a1").await;
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    c.check_calls(true);
}

/// Found by the randomized suite (seed 2): the Mount of a claim that never reached the
/// node outlived the claim when the claim was deleted while the agent was down. The
/// agent's local state knew nothing of it, so nothing looked at it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mount_whose_claim_went_while_the_agent_was_down_is_deleted() {
    let _slot = SLOTS.acquire().await.unwrap();
    let mut c = ready_cluster(2, PluginOpts::default()).await;
    // a2 never reaches n2: v1 is single-node and a1 holds it on n1.
    c.apply(c.allocation("a1", "n1", "v1", false)).await;
    c.wait_claim("a1", "n1", ClaimPhase::Published, T).await;
    c.apply(c.allocation("a2", "n2", "v1", false)).await;
    c.wait_claim("a2", "n2", ClaimPhase::Denied, T).await;
    c.stop_alloc("a2").await;
    c.wait_claim("a2", "n2", ClaimPhase::Released, T).await;
    let store = c.store.clone();
    let mount = &crate::common::key::<MountSpec>("mounts/n2/default/a2.data");
    c.wait("n2's Mount of a2 written", T, || {
        let store = store.clone();
        async move { matches!(store.try_get(mount).await, Ok(Some(_))) }
    })
    .await;
    c.node_mut("n2").agent.kill();
    c.store
        .delete(
            &crate::common::key::<AllocationSpec>("allocations/default/a2"),
            None,
        )
        .await
        .unwrap();
    c.wait("a2's claim deleted", T, || async {
        c.claim("a2", "n2").await.is_none()
    })
    .await;
    c.node_mut("n2").agent.restart();
    c.wait("the Mount deleted by the restarted agent", T, || {
        let store = store.clone();
        async move { matches!(store.try_get(mount).await, Ok(None)) }
    })
    .await;
    assert_eq!(calls(&c, "n2", "NodeStageVolume"), 0);
}

/// Found by the randomized suite (seed 204 at 600 ops): a NodePublish refused for good
/// and then refused as retryable (ResourceExhausted: the plugin refused, nothing took
/// effect) was left "uncertain", and releasing the claim called NodeUnpublish for a
/// publish that never happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_publish_is_not_reversed() {
    let _slot = SLOTS.acquire().await.unwrap();
    // A final answer waits the cap: a short one, so the retryable refusals follow.
    let opts = PluginOpts {
        agent_args: vec!["--retry-cap=2s".into()],
        ..Default::default()
    };
    let c = ready_cluster(2, opts).await;
    let n2 = c.node("n2");
    n2.fault(Command::Fail {
        rpc: "NodePublishVolume".into(),
        code: "NotFound".into(),
        times: 1,
    })
    .await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait("NodePublish refused for good", T, || async move {
        n2.count("NodePublishVolume", "NotFound") == 1
    })
    .await;
    n2.fault(Command::Fail {
        rpc: "NodePublishVolume".into(),
        code: "ResourceExhausted".into(),
        times: 100_000,
    })
    .await;
    c.wait("NodePublish refused as retryable", T, || async move {
        n2.count("NodePublishVolume", "ResourceExhausted") > 0
    })
    .await;
    c.stop_alloc("a1").await;
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    assert_eq!(calls(&c, "n2", "NodeUnpublishVolume"), 0);
    assert_eq!(calls(&c, "n2", "NodeUnstageVolume"), 1);
    c.check_calls(true);
}

/// Issue 24: n2 was lost past the GC timeout while a1 (a writer, published) and a2 (a
/// reader, granted on the same attachment but not yet staged) held v1 there. The
/// forced release of a1 detached v1 from n2, but a2 kept its grant, so the returning
/// agent staged a2 on a volume no longer attached to n2. Now the force-detach
/// withdraws a2's grant in the same transaction, and the returning node acts only on
/// a grant made after v1 is attached to it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_node_s_return_acts_only_after_the_volume_is_attached_again() {
    let _slot = SLOTS.acquire().await.unwrap();
    let opts = PluginOpts {
        controller_args: vec!["--node-gc-timeout=3s".into()],
        ..Default::default()
    };
    let mut c = ready_cluster(2, opts).await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;

    // n2 is lost (agent and plugin); a2 is admitted there before its Node expires and
    // is let onto the node on the attachment a1 stands on.
    let lost_at = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
    c.node_mut("n2").agent.kill();
    c.node_mut("n2").plugin.kill();
    c.apply(c.allocation("a2", "n2", "v1", true)).await;
    c.wait("a2 granted on n2", T, || async {
        c.claim("a2", "n2").await.is_some_and(|cl| cl.spec.publish)
    })
    .await;
    let first = c
        .attachment("v1", "n2")
        .await
        .expect("v1's attachment to n2");
    assert_eq!(
        granted_on(&c, "a2", "n2").await,
        Some(first.metadata.uid.clone()),
        "a grant names the attachment it stands on"
    );

    // a1 ends; n2 stays gone past the GC timeout: a1 is released without the node,
    // v1 force-detached, and a2's grant withdrawn.
    c.stop_alloc("a1").await;
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    assert_eq!(c.node("n1").count("ControllerUnpublishVolume", "OK"), 1);
    let a2 = c.claim("a2", "n2").await.unwrap();
    assert!(
        !a2.spec.publish && a2.spec.revoked && a2.spec.attachment.is_none(),
        "a2's grant is withdrawn with the force-detach: {:?}",
        a2.spec
    );

    // n2 comes back while v1's new ControllerPublish hangs: its agent tears down a1's
    // leftovers and does nothing for a2.
    c.node("n1")
        .fault(Command::Hang {
            rpc: "ControllerPublishVolume".into(),
            after: false,
        })
        .await;
    let back_at = std::time::SystemTime::now();
    c.node_mut("n2").plugin.restart();
    c.node_mut("n2").agent.restart();
    let n1 = c.node("n1");
    c.wait("the new ControllerPublish held", T, || async move {
        n1.hanging("ControllerPublishVolume").await > 0
    })
    .await;
    let n2 = c.node("n2");
    c.wait("a1's leftovers torn down on n2", T, || async move {
        n2.count("NodeUnstageVolume", "OK") >= 1
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let since_back = |rpc: &str| {
        c.node("n2")
            .calls()
            .iter()
            .filter(|x| x.rpc == rpc)
            .filter(|x| humantime::parse_rfc3339(&x.time).is_ok_and(|t| t >= back_at))
            .count()
    };
    assert_eq!(
        since_back("NodeStageVolume"),
        0,
        "no stage before the attach"
    );
    assert_eq!(
        since_back("NodePublishVolume"),
        0,
        "no publish before the attach"
    );

    // Attached again: a2 is granted on the new attachment and published.
    c.node("n1")
        .fault(Command::Release {
            rpc: "ControllerPublishVolume".into(),
        })
        .await;
    c.wait_claim("a2", "n2", ClaimPhase::Published, T).await;
    let second = c.attachment("v1", "n2").await.expect("v1 attached again");
    assert_ne!(second.metadata.uid, first.metadata.uid);
    assert_eq!(
        granted_on(&c, "a2", "n2").await,
        Some(second.metadata.uid.clone())
    );
    c.stop_alloc("a2").await;
    c.wait_claim("a2", "n2", ClaimPhase::Released, T).await;
    // Nothing on n2 ran before the new ControllerPublish succeeded; the declaration
    // excuses only what n2 held when it was lost.
    c.check_calls_forced(
        true,
        [("csi-n2".to_string(), vec![lost_at])]
            .into_iter()
            .collect(),
    );
}

/// Found by the long chaos runs (seeds 1001-1004 at 1,000 ops, then 1002 again): after
/// `moorctl volume detach` of a node, a release there (even of a claim that was never
/// admitted) detached the volume under the node's live claims, withdrew their grants
/// and, in the first version of the withdrawal, did so again after each new grant
/// (ControllerPublish and ControllerUnpublish alternating every 30 ms); a node that had
/// come back had published those claims again meanwhile, so the ControllerUnpublish
/// came under live publishes. An operator's force-detach skips the node steps of the
/// releases it covers; it never detaches a volume that live claims on the node use (only
/// a node collected after `--node-gc-timeout` loses those).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_force_detach_never_detaches_a_volume_under_live_claims() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 2, PluginOpts::default()).await;
    c.apply(c.volume("v1", AccessMode::MultiNodeReaderOnly))
        .await;
    c.volume_ready("v1").await;
    for a in ["a1", "a2", "a3"] {
        c.apply(c.allocation(a, "n2", "v1", true)).await;
    }
    for a in ["a1", "a2", "a3"] {
        c.wait_claim(a, "n2", ClaimPhase::Published, T).await;
    }
    let detach_at = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
    let (ok, out) = c.moorctl(&["volume", "detach", "v1", "--node", "n2"]);
    assert!(ok, "{out}");
    // a1 ends: the force-detach covers it, but n2 is present, so it is asked (it
    // unpublishes); a2 and a3 still use the attachment: it stays, and so do their
    // grants.
    c.stop_alloc("a1").await;
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    assert_eq!(c.node("n2").count("NodeUnpublishVolume", "OK"), 1);
    // a2 ends too; then a last look once the controller has settled a2's release.
    c.stop_alloc("a2").await;
    c.wait_claim("a2", "n2", ClaimPhase::Released, T).await;
    let controller_calls = |c: &Cluster| -> Vec<String> {
        c.node("n1")
            .calls()
            .iter()
            .filter(|x| x.rpc.starts_with("Controller"))
            .map(|x| format!("{} {} {}", x.time, x.rpc, x.code))
            .collect()
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        c.node("n1").count("ControllerUnpublishVolume", "OK"),
        0,
        "{:#?}",
        controller_calls(&c)
    );
    assert_eq!(
        c.node("n1").count("ControllerPublishVolume", "OK"),
        1,
        "{:#?}",
        controller_calls(&c)
    );
    let a3 = c.claim("a3", "n2").await.unwrap();
    assert!(a3.spec.publish && !a3.spec.revoked, "{:?}", a3.spec);
    assert_eq!(a3.status.phase, ClaimPhase::Published);
    // The last claim ends: now the volume is detached.
    c.stop_alloc("a3").await;
    c.wait_claim("a3", "n2", ClaimPhase::Released, T).await;
    assert_eq!(c.node("n1").count("ControllerUnpublishVolume", "OK"), 1);
    c.check_calls_forced(
        true,
        [("csi-n2".to_string(), vec![detach_at])]
            .into_iter()
            .collect(),
    );
}

/// Found by the long chaos runs (seed 2008): `moorctl volume detach v19 --node n3`
/// while n3 was down and a claim there had been granted a second before; n3 came back
/// and staged and published that claim, and when it ended its release skipped the node,
/// as the declaration says, and detached the volume under the publish. A node now
/// takes no forward step for a claim a declaration covers (it reads its node's
/// declarations, written in the declaration's transaction, before each), and a
/// declaration skips only a node that is absent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_back_after_a_force_detach_takes_no_step_on_an_earlier_grant() {
    let _slot = SLOTS.acquire().await.unwrap();
    let mut c = ready_cluster(2, PluginOpts::default()).await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;

    // n2 goes down; a2 is granted there (on a1's attachment) before its Node expires.
    c.node_mut("n2").agent.kill();
    c.node_mut("n2").plugin.kill();
    c.apply(c.allocation("a2", "n2", "v1", true)).await;
    c.wait("a2 granted on n2", T, || async {
        c.claim("a2", "n2").await.is_some_and(|cl| cl.spec.publish)
    })
    .await;
    let detach_at = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
    let (ok, out) = c.moorctl(&["volume", "detach", "v1", "--node", "n2"]);
    assert!(ok, "{out}");

    // n2 comes back: a2's grant predates the declaration, so nothing is done for it.
    let back_at = std::time::SystemTime::now();
    c.node_mut("n2").plugin.restart();
    c.node_mut("n2").agent.restart();
    c.wait("a2's Mount says why nothing is done", T, || async {
        let key = Mount::key_for(&c.claim("a2", "n2").await.unwrap().object_key());
        c.store.try_get(&key).await.ok().flatten().is_some_and(|m| {
            m.status
                .meta
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains("declared node n2 gone for volume v1"))
        })
    })
    .await;
    let since_back = |c: &Cluster, rpc: &str| {
        c.node("n2")
            .calls()
            .iter()
            .filter(|x| x.rpc == rpc)
            .filter(|x| humantime::parse_rfc3339(&x.time).is_ok_and(|t| t >= back_at))
            .count()
    };
    assert_eq!(since_back(&c, "NodeStageVolume"), 0);
    assert_eq!(since_back(&c, "NodePublishVolume"), 0);

    // n2 goes again, its Node expires; both allocations end: released without it.
    c.node_mut("n2").agent.kill();
    c.node_mut("n2").plugin.kill();
    c.wait("n2's Node gone", T, || async {
        c.store
            .try_get(&Node::key_for(&cluster::node("n2")))
            .await
            .is_ok_and(|n| n.is_none())
    })
    .await;
    c.stop_alloc("a1").await;
    c.stop_alloc("a2").await;
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    c.wait_claim("a2", "n2", ClaimPhase::Released, T).await;
    assert_eq!(c.node("n1").count("ControllerUnpublishVolume", "OK"), 1);
    // n2 comes back once more: it tears down what a1 left, and nothing else.
    c.node_mut("n2").plugin.restart();
    c.node_mut("n2").agent.restart();
    let n2 = c.node("n2");
    c.wait("a1's leftovers torn down on n2", T, || async move {
        n2.count("NodeUnstageVolume", "OK") >= 1
    })
    .await;
    assert_eq!(since_back(&c, "NodeStageVolume"), 0);
    assert_eq!(since_back(&c, "NodePublishVolume"), 0);
    c.check_calls_forced(
        true,
        [("csi-n2".to_string(), vec![detach_at])]
            .into_iter()
            .collect(),
    );
}

/// Defect (found moving the snapshotter onto the step runner): deleting a snapshot
/// whose CreateSnapshot may have taken effect unanswered asks CreateSnapshot again to
/// learn its id. That call bypassed the DeleteSnapshot step's gate, so each failure's
/// own status write (one more attempt shown) triggered the next call at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_deleted_in_doubt_is_asked_again_on_its_schedule() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = ready_cluster(1, PluginOpts::default()).await;
    c.node("n1")
        .fault(Command::Fail {
            rpc: "CreateSnapshot".into(),
            code: "Unavailable".into(),
            times: 100_000,
        })
        .await;
    let (ok, out) = c.moorctl(&["volume", "snapshot", "create", "v1", "s1"]);
    assert!(ok, "{out}");
    let key = crate::common::key::<SnapshotSpec>("snapshots/default/s1");
    let store = c.store.clone();
    c.wait("the snapshot to be in doubt", T, || {
        let (store, key) = (store.clone(), key.clone());
        async move {
            store.try_get(&key).await.ok().flatten().is_some_and(|s| {
                s.status.source_volume_id.is_some() && s.status.meta.retry.is_some()
            })
        }
    })
    .await;
    let (ok, out) = c.moorctl(&["volume", "snapshot", "delete", "s1"]);
    assert!(ok, "{out}");
    c.wait("the deletion's first ask", T, || {
        let (store, key) = (store.clone(), key.clone());
        async move {
            store.try_get(&key).await.ok().flatten().is_some_and(|s| {
                s.status
                    .meta
                    .retry
                    .as_ref()
                    .is_some_and(|r| r.step == "DeleteSnapshot")
            })
        }
    })
    .await;
    let first = calls(&c, "n1", "CreateSnapshot");
    let window = Duration::from_secs(4);
    tokio::time::sleep(window).await;
    let made = (calls(&c, "n1", "CreateSnapshot") - first) as u32;
    let bound = schedule().max_attempts_within(window, false) * TRIES;
    assert!(
        made <= bound,
        "{made} CreateSnapshot calls in {window:?} while deleting, at most {bound} allowed"
    );
    // Still owed: the snapshot keeps its finalizer until the plugin answers.
    assert!(c.store.try_get(&key).await.unwrap().is_some());
}

/// Defect (noticed moving node expansion into the plan): a claim published before its
/// node was declared gone got NodeExpandVolume when the node came back, because the
/// agent's fresh read of the declarations guarded only NodeStage and NodePublish. An
/// expansion the controller asked for after the declaration would resize a volume the
/// node no longer holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_back_after_a_force_detach_does_not_expand_the_volume() {
    let _slot = SLOTS.acquire().await.unwrap();
    let opts = PluginOpts {
        extra: vec!["--node-expansion-required".into()],
        ..Default::default()
    };
    let mut c = ready_cluster(2, opts).await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;

    // n2 goes down and is declared gone for v1; then v1 is expanded.
    c.node_mut("n2").agent.kill();
    c.node_mut("n2").plugin.kill();
    let (ok, out) = c.moorctl(&["volume", "detach", "v1", "--node", "n2"]);
    assert!(ok, "{out}");
    let key = Volume::key_for(&Namespace::default_ns(), "v1");
    let v = c.store.get(&key).await.unwrap();
    let mut bigger = v.clone();
    bigger.spec.capacity_min = Some(Size(4 << 20));
    c.store.update(&v, &bigger).await.unwrap();
    c.wait("the claim to ask its node for the expansion", T, || async {
        c.claim("a1", "n2")
            .await
            .is_some_and(|cl| cl.spec.node_expansion_bytes.is_some())
    })
    .await;

    // n2 comes back: whatever it does for a1, it does not expand v1.
    let back_at = std::time::SystemTime::now();
    c.node_mut("n2").plugin.restart();
    c.node_mut("n2").agent.restart();
    let since_back = |c: &Cluster, rpc: &str| {
        c.node("n2")
            .calls()
            .iter()
            .filter(|x| x.rpc == rpc)
            .filter(|x| humantime::parse_rfc3339(&x.time).is_ok_and(|t| t >= back_at))
            .count()
    };
    c.wait("n2 to have reconciled a1", T, || async {
        since_back(&c, "NodeExpandVolume") > 0
            || c.store
                .try_get(&Mount::key_for(
                    &c.claim("a1", "n2").await.unwrap().object_key(),
                ))
                .await
                .ok()
                .flatten()
                .is_some_and(|m| {
                    m.status
                        .meta
                        .last_error
                        .as_deref()
                        .is_some_and(|e| e.contains("declared node n2 gone for volume v1"))
                })
    })
    .await;
    assert_eq!(since_back(&c, "NodeExpandVolume"), 0);
}

/// Issue 49, item 3: ended work is collected, but a claim released without its node
/// (the node GC timeout here; a force-detach is the same) is collected only once that
/// node, back, has torn down what it held: its allocation goes after the retention,
/// the claim stays Released until the node's Mount says it is released, then both go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_released_without_its_node_is_collected_only_after_the_node_tore_down() {
    let _slot = SLOTS.acquire().await.unwrap();
    let opts = PluginOpts {
        controller_args: vec!["--node-gc-timeout=3s".into(), "--retention=1s".into()],
        ..Default::default()
    };
    let mut c = ready_cluster(2, opts).await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    let lost_at = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
    c.node_mut("n2").agent.kill();
    c.node_mut("n2").plugin.kill();
    c.stop_alloc("a1").await;
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    let alloc_key = Allocation::key_for(&Namespace::default_ns(), "a1");
    c.wait("a1 collected after its retention", T, || async {
        c.store.try_get(&alloc_key).await.ok().flatten().is_none()
    })
    .await;
    // Its claim stays while n2 has not confirmed: through a few of the claim
    // reconciler's passes (a Mount of n2 would bring one; none comes).
    let until = std::time::Instant::now() + Duration::from_secs(3);
    while std::time::Instant::now() < until {
        let claim = c.claim("a1", "n2").await;
        assert!(
            claim.is_some_and(|cl| cl.status.phase == ClaimPhase::Released),
            "a1's claim was collected before n2 tore down"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // n2 comes back, tears down, says so: the claim and its Mount go.
    c.node_mut("n2").plugin.restart();
    c.node_mut("n2").agent.restart();
    let claim_key = Claim::key_for(&cluster::node("n2"), &Namespace::default_ns(), "a1.data");
    c.wait("a1's claim and Mount collected", T, || async {
        c.claim("a1", "n2").await.is_none()
            && c.store
                .try_get(&Mount::key_for(&claim_key))
                .await
                .ok()
                .flatten()
                .is_none()
    })
    .await;
    assert!(calls(&c, "n2", "NodeUnpublishVolume") >= 1);
    c.check_calls_forced(
        true,
        [("csi-n2".to_string(), vec![lost_at])]
            .into_iter()
            .collect(),
    );
}
