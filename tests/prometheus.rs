//! deploy/prometheus: the rules pass promtool's checks and unit cases, and a real
//! Prometheus (Debian's `prometheus` package) scrapes a running moor with the shipped
//! rules loaded and evaluates every expression of the shipped dashboard.

#[path = "common/cluster.rs"]
mod cluster;
mod common;

use cluster::{Cluster, PluginOpts};
use moor::api::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/prometheus")
}

fn promtool(args: &[&str]) -> String {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(deploy())
        .output()
        .expect("promtool (apt-get install prometheus; tests/run.sh installs it)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?}:\n{text}");
    text
}

#[test]
fn the_rules_and_the_scrape_config_pass_promtool() {
    let checked = promtool(&["check", "rules", "rules.yml"]);
    assert!(checked.contains("SUCCESS"), "{checked}");
    let tested = promtool(&["test", "rules", "rules_test.yml"]);
    assert!(tested.contains("SUCCESS"), "{tested}");
    promtool(&["check", "config", "prometheus.yml"]);
    // Every alert has its unit case.
    let rules = std::fs::read_to_string(deploy().join("rules.yml")).unwrap();
    let cases = std::fs::read_to_string(deploy().join("rules_test.yml")).unwrap();
    for alert in rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
    {
        assert!(
            cases.contains(&format!("alertname: {alert}")),
            "no unit case for {alert}"
        );
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Percent-encodes a query parameter.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// GETs a path from `addr`; returns the body parsed as JSON (`Null` when it is not).
async fn get_json(addr: &str, path: &str) -> Value {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        return Value::Null;
    };
    // HTTP/1.0: the body comes whole, not chunked.
    let req = format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n");
    if s.write_all(req.as_bytes()).await.is_err() {
        return Value::Null;
    }
    let mut out = String::new();
    let _ = s.read_to_string(&mut out).await;
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    serde_json::from_str(body).unwrap_or(Value::Null)
}

async fn query(addr: &str, q: &str) -> Value {
    get_json(addr, &format!("/api/v1/query?query={}", encode(q))).await
}

/// The first sample's value of an instant query, if any.
async fn value(addr: &str, q: &str) -> Option<f64> {
    query(addr, q).await["data"]["result"][0]["value"][1]
        .as_str()
        .and_then(|v| v.parse().ok())
}

struct Prometheus(Child);

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_moor_with_the_rules_and_the_dashboard() {
    let controller_http = format!("127.0.0.1:{}", free_port());
    let opts = PluginOpts {
        controller_args: vec![format!("--http={controller_http}")],
        ..Default::default()
    };
    let c = Cluster::start(1, 1, opts).await;
    c.apply(c.volume("v1", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v1").await;
    c.apply(c.allocation("a1", "n1", "v1", false)).await;
    c.wait_claim("a1", "n1", ClaimPhase::Published, T).await;

    let dir = tempfile::tempdir().unwrap();
    let web = format!("127.0.0.1:{}", free_port());
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: moor-controller\n    static_configs:\n      - targets: [\"{controller_http}\"]\n  - job_name: moor-agent\n    static_configs:\n      - targets: [\"{}\"]\n",
        deploy().join("rules.yml").display(),
        c.node("n1").http
    );
    std::fs::write(dir.path().join("prometheus.yml"), config).unwrap();
    let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
    let child = Command::new("prometheus")
        .arg(format!(
            "--config.file={}",
            dir.path().join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("data").display()
        ))
        .arg(format!("--web.listen-address={web}"))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("prometheus (apt-get install prometheus; tests/run.sh installs it)");
    let _prometheus = Prometheus(child);
    let prom_log =
        || std::fs::read_to_string(dir.path().join("prometheus.log")).unwrap_or_default();

    // moor's series, scraped from both daemons.
    let wait = |what: &'static str, q: &'static str, want: f64| {
        let web = web.clone();
        async move {
            let deadline = tokio::time::Instant::now() + T;
            loop {
                if value(&web, q).await == Some(want) {
                    return;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{what}: {q} is not {want} after {T:?}: {}\n{}",
                    query(&web, q).await,
                    prom_log()
                );
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    };
    wait(
        "the controller leads",
        "moor_leader{job=\"moor-controller\",election=\"controller\"}",
        1.0,
    )
    .await;
    wait(
        "one claim Published",
        "moor_claims{job=\"moor-controller\",phase=\"Published\"}",
        1.0,
    )
    .await;
    wait(
        "the agent's NodeStage, by plugin",
        "sum(moor_csi_call_duration_seconds_count{job=\"moor-agent\",plugin=\"hostpath.moor.dev\",rpc=\"NodeStageVolume\",code=\"Ok\"})",
        1.0,
    )
    .await;
    wait(
        "the plugin's node instance healthy",
        "moor_plugin_instances_healthy{plugin=\"hostpath.moor.dev\",type=\"node\"}",
        1.0,
    )
    .await;

    // The shipped rules are loaded and evaluated.
    let rules = get_json(&web, "/api/v1/rules").await;
    let names: Vec<&str> = rules["data"]["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        .filter_map(|r| r["name"].as_str())
        .collect();
    for want in [
        "MoorClaimStuck",
        "MoorNoControllerLeader",
        "moor:csi_errors:ratio_rate5m",
    ] {
        assert!(names.contains(&want), "{want} not loaded: {names:?}");
    }
    // Nothing fires on a healthy cluster.
    let alerts = get_json(&web, "/api/v1/alerts").await;
    let firing: Vec<&Value> = alerts["data"]["alerts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|a| a["state"] == "firing")
        .collect();
    assert!(firing.is_empty(), "{firing:#?}");

    // Every expression of the dashboard is valid PromQL over what is scraped.
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(deploy().join("grafana-dashboard.json")).unwrap(),
    )
    .unwrap();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            let answer = query(&web, expr).await;
            assert_eq!(
                answer["status"], "success",
                "panel {}: {expr}: {answer}",
                panel["title"]
            );
        }
    }
}
