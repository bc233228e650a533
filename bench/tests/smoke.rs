//! A small run of the harness on both stores keeps it working: every phase runs, the
//! JSON has every figure, and the figures are consistent with what was asked. (No
//! timing is asserted: speed is what the harness reports, not what a test checks.)

use std::path::PathBuf;
use std::process::Command;

fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    exe.parent()
        .and_then(|d| d.parent())
        .expect("target dir")
        .to_path_buf()
}

#[test]
fn a_small_run_reports_every_figure_on_both_stores() {
    // The harness drives other packages' binaries: make sure they are built.
    let status = Command::new(env!("CARGO"))
        .args(["build", "--workspace", "--bins"])
        .status()
        .expect("cargo build");
    assert!(status.success());
    let json = tempfile::NamedTempFile::new().unwrap();
    let out = Command::new(target_dir().join("moor-bench"))
        .args([
            "--claims",
            "24",
            "--nodes",
            "2",
            "--reaction-samples",
            "10",
            "--attach",
            "12",
            "--single-attaches",
            "2",
            "--ceiling-seconds",
            "1",
            "--scale",
            "300",
            "--scale-per-node",
            "60",
            "--json",
        ])
        .arg(json.path())
        .output()
        .expect("moor-bench runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "moor-bench failed:\n{stderr}\n{stdout}"
    );
    assert!(stdout.contains("write_rate_ceiling_ratio"), "{stdout}");
    let runs: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(json.path()).unwrap()).unwrap();
    let stores: Vec<&str> = runs.iter().map(|r| r["store"].as_str().unwrap()).collect();
    assert_eq!(stores, ["etcd", "moor-store"]);
    for r in &runs {
        let version = r["store_version"].as_str().unwrap();
        assert!(
            version.contains("Version") || version.starts_with("moor-store"),
            "{r}"
        );
        for f in [
            "claims_per_s_publish",
            "claims_per_s_release",
            "write_rate_ceiling_ratio",
            "etcd_writes_per_claim_publish",
        ] {
            assert!(r[f].as_f64().unwrap() > 0.0, "{f} in {r}");
        }
        assert!(
            r["ceiling"]["cas_updates_per_s"].as_f64().unwrap() > 0.0,
            "{r}"
        );
        assert_eq!(r["ceiling"]["put_watch_ms"]["n"], 1000, "{r}");
        let batched = r["ceiling"]["batched_cas_ops_per_s"].as_array().unwrap();
        let sizes: Vec<u64> = batched
            .iter()
            .map(|b| b["ops_per_txn"].as_u64().unwrap())
            .collect();
        assert_eq!(sizes, [8, 32, 64], "{r}");
        assert!(
            batched
                .iter()
                .all(|b| b["ops_per_s"].as_f64().unwrap() > 0.0),
            "{r}"
        );
        // Every stop was matched to its NodeUnpublish in the call logs.
        assert_eq!(r["reaction_idle_ms"]["n"], 10, "{r}");
        assert_eq!(r["reaction_burst_ms"]["n"], 24, "{r}");
        assert_eq!(r["attach"]["volumes"], 12, "{r}");
        assert_eq!(r["attach"]["single_attach_ms"]["n"], 2, "{r}");
        let per = r["attach"]["controller_publish_calls_per_attachment"]
            .as_f64()
            .unwrap();
        assert!(per >= 1.0, "{r}");
        // moor's own count (the agents' metrics) and the plugin's log agree.
        let logged = r["attach"]["controller_publish_calls_per_attachment_plugin_log"]
            .as_f64()
            .unwrap();
        assert!((per - logged).abs() < 1e-9, "{r}");
        for phase in ["publish", "release"] {
            let ms = &r[format!("cpu_ms_per_claim_{phase}")];
            assert!(ms["controller"].as_f64().unwrap() > 0.0, "{r}");
            assert!(ms["agents"].as_f64().unwrap() > 0.0, "{r}");
        }
        for phase in ["attach", "detach"] {
            let ms = &r["attach"][format!("cpu_ms_per_claim_{phase}")];
            assert!(ms["controller"].as_f64().unwrap() > 0.0, "{r}");
        }
        assert_eq!(r["restart"]["claims"], 24, "{r}");
        // The scale phase seeded what was asked and both processes got synced.
        let scale = &r["scale"];
        assert_eq!(scale["claims"], 300, "{r}");
        assert_eq!(scale["nodes"], 5, "{r}");
        assert_eq!(scale["agent_claims"], 60, "{r}");
        // Every kind of claim 0's objects is weighed, and they add up.
        let by_kind = scale["stored_bytes_by_kind"].as_object().unwrap();
        for dir in ["volumes", "allocations", "claims", "mounts"] {
            assert!(by_kind[dir].as_u64().unwrap() > 0, "{dir}: {r}");
        }
        let sum: u64 = by_kind.values().map(|b| b.as_u64().unwrap()).sum();
        assert_eq!(scale["stored_bytes_per_set"].as_u64(), Some(sum), "{r}");
        assert!(
            scale["node_agent_by_cluster_claims"]["300"].is_object(),
            "{r}"
        );
        for who in ["controller", "controller_agent", "node_agent"] {
            assert!(scale[who]["synced_s"].as_f64().unwrap() > 0.0, "{r}");
            assert!(scale[who]["rss_mib"].as_f64().unwrap() > 0.0, "{r}");
            assert!(
                scale[who]["reconciles"]
                    .as_object()
                    .is_some_and(|m| !m.is_empty()),
                "{r}"
            );
        }
    }
}
