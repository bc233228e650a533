//! Versions people can name (issue 50, item 1): `moord --version` and `moorctl version`
//! print the version, commit and tree state; the leading controller says its version in
//! its election record; moorctl warns, once per command, when that is another minor
//! version. Real etcd, real moord and moorctl processes.

#[path = "common/cluster.rs"]
mod cluster;
mod common;

use cluster::{Cluster, PluginOpts};
use std::process::Command;

/// `moorctl --endpoints URL ARGS...`: exit code, stdout, stderr.
fn moorctl(url: &str, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(common::bin("moorctl"))
        .arg(format!("--endpoints={url}"))
        .args(args)
        .output()
        .expect("run moorctl");
    let (o, e) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    eprintln!("$ moorctl {}\n{o}{e}", args.join(" "));
    (out.status.code().unwrap_or(-1), o, e)
}

/// What `--version` promises: `NAME X.Y.Z (commit C, clean|dirty|unknown tree)`.
fn assert_long_version(line: &str, name: &str) {
    let rest = line
        .strip_prefix(&format!("{name} {} (commit ", moor::VERSION))
        .unwrap_or_else(|| panic!("{line:?} does not start with {name} and the version"));
    let (commit, tree) = rest.split_once(", ").expect("commit, tree");
    assert!(
        commit == "unknown"
            || (commit.len() == 12 && commit.chars().all(|c| c.is_ascii_hexdigit())),
        "commit {commit:?}"
    );
    assert!(
        ["clean tree)", "dirty tree)", "unknown tree)"].contains(&tree),
        "tree {tree:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moorctl_version_names_the_leading_controller_s_version() {
    for name in ["moord", "moorctl"] {
        let out = Command::new(common::bin(name))
            .arg("--version")
            .output()
            .expect("--version");
        assert!(out.status.success());
        assert_long_version(String::from_utf8_lossy(&out.stdout).trim(), name);
    }
    let c = Cluster::start(1, 1, PluginOpts::default()).await;
    c.wait(
        "a controller leads",
        std::time::Duration::from_secs(30),
        || async {
            moor::runtime::leader::holder(&c.store, "controller")
                .await
                .is_ok_and(|r| r.is_some())
        },
    )
    .await;
    let (code, out, err) = moorctl(&c.etcd.client_url, &["version"]);
    assert_eq!(code, 0, "{out}{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_long_version(lines[0], "moorctl");
    assert!(
        lines[1].starts_with(&format!("controller {} (controller", moor::VERSION)),
        "{out}"
    );
    assert!(!err.contains("warning"), "same version: no warning: {err}");
    let (code, _, err) = moorctl(&c.etcd.client_url, &["get", "volumes"]);
    assert_eq!(code, 0);
    assert!(!err.contains("warning"), "{err}");
}

/// An election record of another minor version (and one of a controller from before
/// versions were recorded) makes every command warn once on stderr; a patch release
/// of the same minor version does not. Its output on stdout is unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_minor_version_of_the_controller_is_warned_about_once() {
    // Without etcd, this build's line still answers.
    let (code, out, _) = moorctl("http://127.0.0.1:1", &["version"]);
    assert_eq!(code, 0, "{out}");
    assert_long_version(out.lines().next().unwrap_or_default(), "moorctl");
    assert!(out.contains("controller: cannot tell"), "{out}");
    let etcd = common::Etcd::start().await;
    let mut raw = etcd.raw_client().await;
    let (major, minor) = moor::minor_of(moor::VERSION).unwrap();
    let key = format!(
        "{}{}",
        moor::store::DEFAULT_PREFIX,
        moor::api::election_key("controller")
    );
    let record = |version: &str| {
        let mut r = serde_json::json!({
            "holder": "controller@old-host/1",
            "campaign": 7,
            "ttl_ms": 600000,
            "renewals": 0,
        });
        if !version.is_empty() {
            r["version"] = version.into();
        }
        r.to_string()
    };
    let (_, quiet, _) = moorctl(&etcd.client_url, &["get", "volumes"]);
    for (version, warns) in [
        (format!("{major}.{}.0", minor + 1), true),
        (String::new(), true),
        (format!("{major}.{minor}.99"), false),
    ] {
        raw.put(key.as_str(), record(&version), None).await.unwrap();
        let (code, out, err) = moorctl(&etcd.client_url, &["get", "volumes"]);
        assert_eq!(code, 0, "{err}");
        assert_eq!(out, quiet, "stdout is the verb's alone");
        assert_eq!(
            err.matches("warning: the leading controller runs").count(),
            usize::from(warns),
            "controller {version:?}: {err}"
        );
        let (_, out, _) = moorctl(&etcd.client_url, &["version"]);
        let shown = if version.is_empty() {
            "before 0.2 (unstated)"
        } else {
            &version
        };
        assert!(
            out.contains(&format!("controller {shown} (controller@old-host/1)")),
            "{out}"
        );
    }
}

/// Issue 50, item 2: every stored type is decoded by skipping the fields this version
/// does not know, and written back whole; before, a newer version's fields were
/// dropped by the first write of an older one. An allocation carrying fields this
/// version does not know (as a newer moorctl or controller would write them) keeps
/// them through moorctl's stop and the controller's status writes, on a real etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fields_of_a_newer_version_survive_this_version_s_writes() {
    let c = Cluster::start(1, 1, PluginOpts::default()).await;
    c.apply(c.volume("v1", moor::api::AccessMode::SingleNodeWriter))
        .await;
    c.volume_ready("v1").await;
    c.apply(c.allocation("a1", "n1", "v1", false)).await;
    let t = std::time::Duration::from_secs(60);
    c.wait_claim("a1", "n1", moor::api::ClaimPhase::Published, t)
        .await;
    let key = format!("{}allocations/default/a1", moor::store::DEFAULT_PREFIX);
    let mut raw = c.etcd.raw_client().await;
    let read = |raw: &mut etcd_client::Client| {
        let key = key.clone();
        let mut raw = raw.clone();
        async move {
            let resp = raw.get(key, None).await.unwrap();
            serde_json::from_slice::<serde_json::Value>(resp.kvs()[0].value()).unwrap()
        }
    };
    let mut newer = read(&mut raw).await;
    newer["future_top"] = 1.into();
    newer["spec"]["future_spec"] = serde_json::json!({"k": "v"});
    newer["spec"]["volumes"][0]["future_request"] = true.into();
    newer["status"]["future_status"] = "x".into();
    raw.put(key.as_str(), newer.to_string(), None)
        .await
        .unwrap();
    let (ok, out) = c.moorctl(&["alloc", "stop", "a1"]);
    assert!(ok, "{out}");
    c.wait_claim("a1", "n1", moor::api::ClaimPhase::Released, t)
        .await;
    c.wait("the controller wrote a1's status Released", t, || async {
        read(&mut raw.clone()).await["status"]["phase"] == "released"
    })
    .await;
    let written = read(&mut raw).await;
    assert_eq!(written["spec"]["desired_status"], "stop", "moorctl's write");
    assert_eq!(written["future_top"], 1, "{written}");
    assert_eq!(written["spec"]["future_spec"]["k"], "v", "{written}");
    assert_eq!(
        written["spec"]["volumes"][0]["future_request"], true,
        "{written}"
    );
    assert_eq!(written["status"]["future_status"], "x", "{written}");
    c.check_calls(true);
}

/// Issue 78, item 4: an agent whose journal a later minor version wrote (its stamp,
/// `state.jsonl.version`) refuses to start, naming both versions, and leaves the
/// journal and its stamp as they were; a 0.2 agent called such a journal corrupt. The
/// versions printed are Debian-ordered (`~`, never `-`).
#[test]
fn an_agent_refuses_a_later_minor_s_journal_naming_both_versions() {
    assert!(!moor::VERSION.contains('-'), "{}", moor::VERSION);
    let dir = tempfile::tempdir().unwrap();
    let (major, minor) = moor::minor_of(moor::VERSION).unwrap();
    let later = format!("{major}.{}.0", minor + 1);
    let journal = dir.path().join("state.jsonl");
    std::fs::write(&journal, "").unwrap();
    std::fs::write(dir.path().join("state.jsonl.version"), format!("{later}\n")).unwrap();
    let out = Command::new(common::bin("moord"))
        .args([
            "agent",
            "--node",
            "n1",
            "--etcd",
            "http://127.0.0.1:1",
            "--data-dir",
        ])
        .arg(dir.path())
        .arg("--plugin")
        .arg(format!(
            "id=x,type=node,endpoint=unix://{}/x.sock,mount-dir={}/m",
            dir.path().display(),
            dir.path().display()
        ))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("was written by moor {later}"))
            && stderr.contains(&format!("this one ({})", moor::VERSION))
            && !stderr.contains("corrupt"),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("state.jsonl.version")).unwrap(),
        format!("{later}\n")
    );
}
