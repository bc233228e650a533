//! What an operator reads: events folded and shown where they belong, logs as JSON,
//! nothing said lost on a clean stop. Real etcd, real moord and moor-hostpath
//! processes.

#[path = "common/cluster.rs"]
mod cluster;
mod common;

use cluster::{Cluster, PluginOpts};
use moor::api::*;
use moor_hostpath::faults::Command;
use serde_json::Value;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);
/// The harness's `--event-window`.
const WINDOW: Duration = Duration::from_secs(1);

/// The JSON lines of a log; panics on a line that is not one.
fn json_lines(log: &str) -> Vec<Value> {
    log.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

/// A node step failing 100 times: its Warnings fold into one event written at most once
/// per window, `describe claim` shows it with its count, every event the agent logged
/// is in etcd after a SIGTERM (the fold's last count too), and the daemons' JSON logs
/// name the objects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_failing_100_times_costs_a_few_event_writes_and_nothing_said_is_lost() {
    let json = "--log-format=json".to_string();
    let opts = PluginOpts {
        agent_args: vec![
            json.clone(),
            "--retry-initial=10ms".into(),
            "--retry-cap=40ms".into(),
        ],
        controller_args: vec![json],
        ..Default::default()
    };
    let mut c = Cluster::start(1, 2, opts).await;
    c.apply(c.volume("v1", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v1").await;
    c.node("n2")
        .fault(Command::Fail {
            rpc: "NodeStageVolume".into(),
            code: "Unavailable".into(),
            times: 100,
        })
        .await;
    let puts = common::count_puts(&c.etcd.client_url, "/moor/events/node/n2/").await;
    let started = Instant::now();
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    let elapsed = started.elapsed();
    assert_eq!(c.node("n2").count("NodeStageVolume", "Unavailable"), 100);

    // Stopped cleanly right after: what it folded and had not written yet is written.
    c.node_mut("n2").agent.stop();
    let events = c
        .store
        .list(&KeyScope::<EventSpec>::all())
        .await
        .unwrap()
        .items;
    let failures: Vec<&Event> = events
        .iter()
        .filter(|e| {
            e.spec.source == "agent/n2"
                && e.spec.reason == "Mount volume"
                && e.spec.type_ == EventType::Warning
        })
        .collect();
    assert!(!failures.is_empty());
    let claim = c.claim("a1", "n2").await.unwrap();
    for e in &failures {
        assert_eq!(
            e.spec.related.as_ref().map(|r| r.name.as_str()),
            Some(claim.metadata.name.as_str())
        );
    }
    // Every event the agent logged, counted in etcd: per reason, the logged lines
    // equal the events' counts.
    let mut logged: BTreeMap<String, u32> = BTreeMap::new();
    for line in json_lines(&c.node("n2").agent.log_text()) {
        if line["message"] == "event" {
            *logged
                .entry(line["reason"].as_str().unwrap_or_default().to_string())
                .or_default() += 1;
        }
    }
    let mut stored: BTreeMap<String, u32> = BTreeMap::new();
    for e in events.iter().filter(|e| e.spec.source == "agent/n2") {
        *stored.entry(e.spec.reason.clone()).or_default() += e.spec.count();
    }
    assert_eq!(stored, logged, "what the agent said, and what etcd holds");
    let repeats: u32 = failures.iter().map(|e| e.spec.count()).sum();
    assert!(repeats >= 10, "{repeats} failures recorded");
    // Writes: per event, the first at once and then at most one per window.
    let most = elapsed.as_secs_f64() / WINDOW.as_secs_f64() + 2.0;
    for e in &failures {
        let key = format!("/moor/{}", e.key());
        let writes = puts.lock().unwrap().get(&key).copied().unwrap_or_default();
        eprintln!(
            "{} repeats of {:?} over {elapsed:?}: {writes} writes",
            e.spec.count(),
            e.spec.reason
        );
        assert!(
            (writes as f64) <= most,
            "{} repeats over {elapsed:?} took {writes} writes of {key} (at most {most})",
            e.spec.count()
        );
    }

    // `describe claim` shows the node's events about it, with their count.
    let (ok, out) = c.moorctl(&["describe", "claim", claim.metadata.name.as_str()]);
    assert!(ok, "{out}");
    let shown = out
        .lines()
        .find(|l| l.contains("Mount volume") && l.contains("Warning"))
        .unwrap_or_else(|| panic!("no Mount volume Warning in:\n{out}"));
    if failures.iter().any(|e| e.spec.count() > 1) {
        assert!(shown.contains(" over "), "{shown}");
    }

    // The controller's log is JSON, and its reconcile lines name the object.
    let lines = json_lines(&c.controllers[0].log_text());
    let key = claim.key();
    assert!(
        lines.iter().any(|l| l["span"]["object"] == key.as_str()),
        "no line of the reconcile of {key}"
    );
    assert!(lines
        .iter()
        .any(|l| l["message"] == "event" && l["reason"] == "Claim published"));
}
