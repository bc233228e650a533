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

fn proxied() -> PluginOpts {
    PluginOpts {
        proxied: true,
        agent_args: vec!["--retry-initial=200ms".into(), "--retry-cap=1s".into()],
        ..Default::default()
    }
}

/// When a call started, by the plugin's clock (its log has the end and the duration).
fn started(c: &Call) -> Option<SystemTime> {
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
            .is_some_and(|t| t.starts_with("node/n2/")),
        "NodeStage carries the node's registration term: {first:?}"
    );
    let last = first.clone();

    c.proxy("agent-n2").heal();
    c.wait_claim("a1", "n2", ClaimPhase::Published, Duration::from_secs(60))
        .await;
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
    c.stop_alloc("a1").await;
    c.wait_claim("a1", "n2", ClaimPhase::Released, Duration::from_secs(60))
        .await;
    c.check_calls(true);
}
