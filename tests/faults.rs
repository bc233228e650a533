//! Faults that are not crashes (issue 42): a moor process cut off from etcd (a TCP
//! partition made by the harness's fault proxy: packets held, nothing refused), a
//! process paused with SIGSTOP, and a full disk under an agent's journal. Each test
//! checks one rule of docs/architecture.md ("Faults that are not crashes") against the
//! plugin's call log, and that everything converges once the fault is lifted.

#[path = "common/cluster.rs"]
mod cluster;
mod common;

use cluster::{Cluster, PluginOpts};
use moor::api::*;
use moor_hostpath::calllog::Call;
use moor_hostpath::faults::Command;
use std::time::{Duration, SystemTime};

/// The harness's `--node-ttl` and `--leader-ttl`.
const TTL: Duration = Duration::from_secs(3);
const T: Duration = Duration::from_secs(30);

fn proxied() -> PluginOpts {
    PluginOpts {
        proxied: true,
        agent_args: vec!["--retry-initial=200ms".into(), "--retry-cap=1s".into()],
        ..Default::default()
    }
}

/// Stops allocation `alloc` and waits for its claim on `node` to be Released.
async fn stop_and_release(c: &Cluster, alloc: &str, node: &str) {
    c.stop_alloc(alloc).await;
    c.wait_claim(alloc, node, ClaimPhase::Released, Duration::from_secs(60))
        .await;
}

/// When a call was sent: its `moor-sent` header, or else its start by the plugin's
/// clock (its log has the end and the duration).
fn started(c: &Call) -> Option<SystemTime> {
    if let Some(ms) = c.sent_ms {
        return Some(std::time::UNIX_EPOCH + Duration::from_millis(ms));
    }
    let end = humantime::parse_rfc3339(&c.time).ok()?;
    end.checked_sub(Duration::from_secs_f64(c.duration_ms.max(0.0) / 1000.0))
}

/// An agent is cut off from etcd while its NodeStage hangs in the plugin (the agent and
/// its plugin keep running). The agent's own reads of etcd hang too, but a try already
/// under way times out (`--csi-timeout=5s`) and the policy sends the next one without
/// asking etcd: past the TTL less the margin the agent cannot prove its registration,
/// and that next try must not be sent. Healed, the agent registers again, reads the
/// claim fresh and publishes it, under a new registration term.
#[tokio::test]
async fn an_agent_cut_off_from_etcd_takes_no_forward_step_once_its_registration_lapsed() {
    let c = Cluster::start(1, 2, proxied()).await;
    c.apply(c.volume("v1", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v1").await;
    let n2 = c.node("n2");
    n2.fault(Command::Hang {
        rpc: "NodeStageVolume".into(),
        after: false,
    })
    .await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait("n2's NodeStage hangs", Duration::from_secs(30), || async {
        n2.hanging("NodeStageVolume").await == 1
    })
    .await;
    let cut_at = SystemTime::now();
    c.proxy("agent-n2").cut();
    // The first try times out at 5 s; the policy's second try would follow at once.
    tokio::time::sleep(Duration::from_secs(8)).await;
    n2.fault(Command::Release {
        rpc: "NodeStageVolume".into(),
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let stages: Vec<Call> = n2
        .calls()
        .into_iter()
        .filter(|x| x.rpc == "NodeStageVolume")
        .collect();
    let late: Vec<&Call> = stages
        .iter()
        .filter(|x| started(x).is_some_and(|t| t > cut_at + TTL))
        .collect();
    assert!(
        late.is_empty(),
        "n2 sent NodeStage more than {TTL:?} after it was cut off at {}: {late:#?}",
        humantime::format_rfc3339_millis(cut_at)
    );
    let first = stages.first().expect("the hung NodeStage is logged");
    assert!(
        first
            .term
            .as_deref()
            .is_some_and(|t| t.starts_with("node.n2/")),
        "NodeStage carries the node's registration term: {first:?}"
    );
    let last = first.clone();

    c.proxy("agent-n2").heal();
    let healed = std::time::Instant::now();
    c.wait_claim("a1", "n2", ClaimPhase::Published, Duration::from_secs(60))
        .await;
    eprintln!(
        "recovery: published {:?} after the partition healed",
        healed.elapsed()
    );
    // Staged and published under a later registration term than the one cut off.
    let ok: Vec<Call> = n2
        .calls()
        .into_iter()
        .filter(|x| x.rpc == "NodeStageVolume" && x.ok())
        .collect();
    assert_eq!(ok.len(), 1, "one NodeStage answered OK: {ok:#?}");
    assert_ne!(
        ok[0].term, last.term,
        "the stage after the partition was made in a new registration term"
    );
    stop_and_release(&c, "a1", "n2").await;
    c.check_calls(true);
}

/// An agent whose data dir (its journal) is full cannot record the steps it would
/// take, so it takes none: no NodeStage reaches the plugin. It says why on the claim's
/// Mount, as a Warning event and in `moor_agent_journal_write_failures_total`. Once
/// space is freed it records, stages and publishes without anyone's help.
#[tokio::test]
async fn an_agent_whose_journal_disk_is_full_takes_no_step_and_says_why() {
    let c = Cluster::start(
        1,
        2,
        PluginOpts {
            small_disk_mib: Some(4),
            ..proxied()
        },
    )
    .await;
    if !c.fill_disk("n2") {
        // Without root there is no disk of its own to fill (cluster::can_mount has
        // already failed the test unless MOOR_TESTS_NO_MOUNT=1 said to skip mounts).
        eprintln!("no tmpfs for the agent's data dir (not root): nothing to check");
        return;
    }
    c.apply(c.volume("v1", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v1").await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    let key = Mount::key_for(&Claim::key_for(
        &cluster::node("n2"),
        &Namespace::default_ns(),
        "a1.data",
    ));
    c.wait(
        "the Mount says the journal cannot be written",
        T,
        || async {
            c.store
                .try_get(&key)
                .await
                .ok()
                .flatten()
                .and_then(|m| m.status.meta.last_error)
                .is_some_and(|e| e.contains("cannot record the node's local state"))
        },
    )
    .await;
    c.wait("a Warning event", T, || async {
        c.store
            .list::<EventSpec>(&KeyScope::all())
            .await
            .is_ok_and(|l| {
                l.items
                    .iter()
                    .any(|e| e.spec.reason == "Journal write failed")
            })
    })
    .await;
    let page = c.node("n2").http_get("/metrics").await;
    let failures = common::metric(&page, "moor_agent_journal_write_failures_total");
    assert!(failures.is_some_and(|n| n >= 1.0), "{failures:?}");
    assert_eq!(
        c.node("n2").tried("NodeStageVolume"),
        0,
        "no step is taken that the journal could not record"
    );

    c.free_disk("n2");
    let freed = std::time::Instant::now();
    c.wait_claim("a1", "n2", ClaimPhase::Published, Duration::from_secs(60))
        .await;
    eprintln!(
        "recovery: published {:?} after the disk was freed",
        freed.elapsed()
    );
    stop_and_release(&c, "a1", "n2").await;
    c.check_calls(true);
}

/// The agent that leads the controller plugin is paused (SIGSTOP) while its
/// ControllerPublish keeps failing, past its leadership's TTL, and then resumed: it
/// wakes with its term lapsed by its own clock, and sends nothing more under that
/// term (each try checks the term right before it goes); it campaigns again and
/// publishes under a new term.
#[tokio::test]
async fn a_plugin_leader_paused_past_its_term_sends_nothing_under_it_when_it_wakes() {
    let mut c = Cluster::start(1, 2, proxied()).await;
    c.apply(c.volume("v1", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v1").await;
    c.node("n1")
        .fault(Command::Fail {
            rpc: "ControllerPublishVolume".into(),
            code: "Unavailable".into(),
            times: 100_000,
        })
        .await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait("n1 tries ControllerPublish", T, || async {
        c.node("n1").tried("ControllerPublishVolume") >= 2
    })
    .await;
    let before = c
        .node("n1")
        .calls()
        .into_iter()
        .rev()
        .find(|x| x.rpc == "ControllerPublishVolume")
        .and_then(|x| x.term)
        .expect("ControllerPublish names its term");
    assert!(before.starts_with("plugin.hostpath.moor.dev/"), "{before}");
    let paused_at = SystemTime::now();
    c.node_mut("n1").agent.pause(true);
    tokio::time::sleep(TTL * 2).await;
    c.node("n1").fault(Command::Clear).await;
    c.node_mut("n1").agent.pause(false);
    let resumed = std::time::Instant::now();
    c.wait_claim("a1", "n2", ClaimPhase::Published, Duration::from_secs(60))
        .await;
    eprintln!(
        "recovery: published {:?} after the leader resumed",
        resumed.elapsed()
    );
    let calls = c.node("n1").calls();
    let late: Vec<&Call> = calls
        .iter()
        .filter(|x| x.term.as_deref() == Some(before.as_str()))
        .filter(|x| started(x).is_some_and(|t| t > paused_at + TTL))
        .collect();
    assert!(
        late.is_empty(),
        "calls under the lapsed term {before}: {late:#?}"
    );
    let published = calls
        .iter()
        .find(|x| x.rpc == "ControllerPublishVolume" && x.ok())
        .expect("published");
    assert_ne!(published.term.as_deref(), Some(before.as_str()));
    stop_and_release(&c, "a1", "n2").await;
    // Invariant 9 among the others: no two terms of the plugin's election overlapped.
    c.check_calls(true);
}

/// moor on a 3-member etcd, each member in a network namespace of its own: the member
/// that leads is partitioned from the other two (packets dropped; moor still reaches
/// it). The other two elect a leader; every moor process must go on through them: a
/// new allocation's claim is published, an old one released, while the partition
/// holds. Then the member rejoins and the call log is checked.
#[tokio::test]
async fn moor_goes_on_when_the_leading_etcd_member_is_partitioned_from_the_others() {
    if !cluster::can_mount() {
        eprintln!("network namespaces need root: nothing to check");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let members = common::members::Members::start(tmp.path()).await;
    let etcd = common::Etcd::external(members.client_urls());
    let c = Cluster::start_on(etcd, 1, 2, PluginOpts::default()).await;
    for v in ["v1", "v2"] {
        c.apply(c.volume(v, AccessMode::SingleNodeWriter)).await;
        c.volume_ready(v).await;
    }
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;

    let leader = members.leader().await.expect("a leader");
    members.isolate(leader);
    let cut = std::time::Instant::now();
    // The test's own writes, as moorctl's: a request that timed out on the cut-off
    // member (its outcome unknown) is made again (a create that did land says so).
    let a2 = c.allocation("a2", "n1", "v2", false);
    c.wait("a2 created", T, || async {
        match c.store.create(&a2).await {
            Ok(_) | Err(moor::store::StoreError::AlreadyExists { .. }) => true,
            Err(e) => {
                eprintln!("create a2: {e}");
                false
            }
        }
    })
    .await;
    c.wait("a1 stopped", T, || async {
        let key = Allocation::key_for(&Namespace::default_ns(), "a1");
        let Ok(mut a) = c.store.get(&key).await else {
            return false;
        };
        a.spec.desired_status = DesiredStatus::Stop;
        c.store.replace(&a).await.is_ok()
    })
    .await;
    c.wait_claim("a2", "n1", ClaimPhase::Published, Duration::from_secs(60))
        .await;
    eprintln!(
        "recovery: a new claim published {:?} after the leading member was cut off",
        cut.elapsed()
    );
    c.wait_claim("a1", "n2", ClaimPhase::Released, Duration::from_secs(60))
        .await;
    eprintln!(
        "recovery: an old claim released {:?} after the leading member was cut off",
        cut.elapsed()
    );

    members.rejoin(leader);
    stop_and_release(&c, "a2", "n1").await;
    c.check_calls(true);
}
