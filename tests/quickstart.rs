//! The newcomer's path, end to end and through moorctl: the README's quickstart command
//! runs as written (against binaries built for the test, on a free port and a temporary
//! data dir), and `moord dev` keeps its state across a restart.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::dev::Dev;
use common::{bin, free_port, wait_for};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn bin_dir() -> PathBuf {
    bin("moord").parent().unwrap().to_path_buf()
}

/// The README's quickstart command: the indented line that runs deploy/quickstart.sh.
fn readme_quickstart() -> String {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    readme
        .lines()
        .map(str::trim)
        .find(|l| l.contains("deploy/quickstart.sh") && !l.starts_with('#') && !l.contains('`'))
        .expect("README.md gives the quickstart command")
        .to_string()
}

#[test]
fn the_readme_quickstart_runs_workloads_on_a_volume() {
    let cmd = readme_quickstart();
    assert_eq!(
        cmd, "bash deploy/quickstart.sh",
        "the README's quickstart command changed"
    );
    let data = tempfile::tempdir().unwrap();
    let out = Command::new("bash")
        .arg("-c")
        .arg(&cmd)
        .current_dir(root())
        .env("MOOR_BIN", bin_dir())
        .env("MOOR_DEV_DATA", data.path().join("dev"))
        .env("MOOR_DEV_LISTEN", format!("127.0.0.1:{}", free_port()))
        .env_remove("KEEP")
        .output()
        .expect("bash runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let log = std::fs::read_to_string(data.path().join("dev/moord.log")).unwrap_or_default();
    assert!(
        out.status.success(),
        "quickstart failed\n--- stdout\n{stdout}\n--- stderr\n{}\n--- moord.log\n{log}",
        String::from_utf8_lossy(&out.stderr)
    );
    for expected in [
        "volume/default/web-data created",
        "volume/web-data: phase=ready",
        "# the web console shows it: http://127.0.0.1:",
        "local   yes    -",
        "web-1 wrote ",
        "web-1   local   stop      complete   released",
        "web-2 read: ",
        "Client:     complete (exit code 0)",
        "web-2.data   web-data   local   read   released",
        "Claim published",
        "Unmount volume",
        "Claim released",
        "volume/web-data: deleted",
    ] {
        assert!(
            stdout.contains(expected),
            "missing {expected:?} in\n{stdout}\n--- moord.log\n{log}"
        );
    }
}

fn moorctl(port: u16, args: &[&str]) -> (bool, String) {
    let out = Command::new(bin_dir().join("moorctl"))
        .env("MOOR_ENDPOINTS", format!("http://127.0.0.1:{port}"))
        .args(args)
        .current_dir(root())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

fn wait_claim(port: u16, phase: &str) {
    let (ok, out) = moorctl(
        port,
        &[
            "wait",
            "claim/web-1.data",
            "--for",
            &format!("phase={phase}"),
            "--timeout",
            "60s",
        ],
    );
    assert!(ok, "{out}");
    // The result once (stdout), not also as a progress line.
    let result = format!("claim/web-1.data: phase={phase}\n");
    assert_eq!(out.matches(&result).count(), 1, "{out}");
}

/// What bash's completion offers for `moorctl WORDS` (the last word the one under the
/// cursor), with moorctl's completion script loaded.
fn complete(port: u16, words: &str) -> String {
    let script = format!(
        "source <(moorctl completion bash)\n\
         COMP_WORDS=(moorctl {words}); COMP_CWORD=$((${{#COMP_WORDS[@]}} - 1))\n\
         COMP_LINE=\"${{COMP_WORDS[*]}}\"; COMP_POINT=${{#COMP_LINE}}\n\
         _moorctl_objects moorctl \"${{COMP_WORDS[COMP_CWORD]}}\" \"${{COMP_WORDS[COMP_CWORD-1]}}\"\n\
         echo \"${{COMPREPLY[*]}}\""
    );
    let path = format!(
        "{}:{}",
        bin_dir().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new("bash")
        .args(["-c", &script])
        .env("PATH", path)
        .env("MOOR_ENDPOINTS", format!("http://127.0.0.1:{port}"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[tokio::test]
async fn moord_dev_keeps_its_state_across_a_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("dev");
    let port = free_port();
    let dev = Dev::start(&data, port);
    let ready = |what: &'static str, args: &'static [&'static str], want: &'static str| async move {
        wait_for(what, Duration::from_secs(60), || async move {
            let (_, out) = moorctl(port, args);
            out.contains(want)
        })
        .await
    };
    ready("the plugin", &["plugin", "status"], "1/1").await;
    let (ok, out) = moorctl(port, &["apply", "-f", "deploy/examples/quickstart.yaml"]);
    assert!(ok, "{out}");
    let (ok, out) = moorctl(port, &["apply", "-f", "deploy/examples/web-1.yaml"]);
    assert!(ok, "{out}");
    wait_claim(port, "published");
    let (_, before) = moorctl(port, &["get", "volume", "web-data", "-o", "json"]);

    // An engine's hold is not stopped under its containers unless forced (issue 78,
    // item 1: moor cannot signal a container; its volumes would go under it).
    let hold = tmp.path().join("hold.yaml");
    std::fs::write(
        &hold,
        "kind: Allocation\nmetadata: {name: hold-1, labels: {moor.dev/hold: docker}}\nspec: {node: local}\n",
    )
    .unwrap();
    let (ok, out) = moorctl(port, &["apply", "-f", hold.to_str().unwrap()]);
    assert!(ok, "{out}");
    let (ok, out) = moorctl(port, &["alloc", "stop", "hold-1"]);
    assert!(
        !ok && out.contains("docker's hold") && out.contains("--force"),
        "{out}"
    );
    let (_, desired) = moorctl(port, &["get", "allocation", "hold-1", "-o", "json"]);
    assert!(desired.contains("\"desired_status\": \"run\""), "{desired}");
    let (ok, out) = moorctl(port, &["alloc", "stop", "hold-1", "--force"]);
    assert!(ok && out.contains("stopped"), "{out}");

    // bash completes object names from the store (issue 78, item 7), as a shell asks:
    // the completion script sourced, its function called with the line's words.
    assert_eq!(complete(port, "get volumes ''"), "web-data");
    assert_eq!(complete(port, "describe volume -n default web"), "web-data");
    // None in that namespace: clap's own offer, without the other namespace's name.
    assert!(!complete(port, "get volumes -n other ''").contains("web-data"));
    // Not a name: clap's completion, as before (kinds, an option's values).
    assert!(complete(port, "get volumec").contains("volumeclasses"));
    assert_eq!(complete(port, "get volumes -o ''"), "table wide json yaml");

    // Bad input loses nothing: a manifest with a typo is refused whole with the field
    // named, and a copy older than the stored object is not applied over it.
    let bad = tmp.path().join("bad.yaml");
    std::fs::write(
        &bad,
        "kind: Volume\nmetadata: {name: web-data}\nspec: {plugin_id: x, capacity_min: lots}\n",
    )
    .unwrap();
    let (ok, out) = moorctl(port, &["apply", "-f", bad.to_str().unwrap()]);
    assert!(!ok && out.contains("spec.capacity_min"), "{out}");
    // A good object before a bad one is not written either (issue 37, item 2).
    std::fs::write(
        &bad,
        "kind: Volume\nmetadata: {name: extra}\nspec: {plugin_id: x, capabilities: [{access_mode: single-node-writer, attachment_mode: file-system}]}\n---\nkind: Volume\nmetadata: {name: web-data}\nspec: {plugin_id: x, capacity_min: lots}\n",
    )
    .unwrap();
    let (ok, out) = moorctl(port, &["apply", "-f", bad.to_str().unwrap()]);
    assert!(
        !ok && out.contains("nothing applied: 1 of 2 documents refused"),
        "{out}"
    );
    let (ok, out) = moorctl(port, &["get", "volume", "extra"]);
    assert!(!ok, "the good document was written: {out}");
    // A size a person likely did not mean is applied with a warning (issue 78, item 7).
    std::fs::write(
        &bad,
        "kind: Volume\nmetadata: {name: si}\nspec: {plugin_id: x, capacity_min: 10, capacity_max: 10GB, capabilities: [{access_mode: single-node-writer, attachment_mode: file-system}]}\n",
    )
    .unwrap();
    let (ok, out) = moorctl(port, &["apply", "-f", bad.to_str().unwrap()]);
    assert!(
        ok && out
            .contains("warning: volumes/default/si: spec.capacity_max is 10GB (SI: powers of 1000")
            && out.contains("if you meant 10GiB, write that")
            && out.contains("spec.capacity_min is 10 bytes"),
        "{out}"
    );
    let (ok, out) = moorctl(port, &["delete", "volume", "si"]);
    assert!(ok, "{out}");
    // Not found names the namespace looked in, and where one of that name is (issue
    // 78, item 7).
    let (ok, out) = moorctl(port, &["get", "volume", "web-data", "-n", "prod"]);
    assert!(
        !ok && out.contains("not found in namespace prod; namespace default has one (-n default)"),
        "{out}"
    );
    let (ok, out) = moorctl(port, &["get", "volume", "nowhere"]);
    assert!(
        !ok && out.contains(
            "not found in namespace default (-n NAMESPACE looks in another, -A in every one)"
        ),
        "{out}"
    );
    let mut stale: serde_json::Value = serde_json::from_str(&before).unwrap();
    stale["metadata"]["resource_version"] = serde_json::json!(1);
    stale["spec"]["capacity_min"] = serde_json::json!("1GiB");
    let stale_file = tmp.path().join("stale.json");
    std::fs::write(&stale_file, stale.to_string()).unwrap();
    let (ok, out) = moorctl(port, &["apply", "-f", stale_file.to_str().unwrap()]);
    assert!(!ok && out.contains("newer than your copy"), "{out}");
    let (_, now) = moorctl(port, &["get", "volume", "web-data", "-o", "json"]);
    assert!(
        now.contains("104857600") && !now.contains("1073741824"),
        "{now}"
    );
    dev.stop();

    // Restarted on the same data: the objects, their status and the claim are all
    // there, and the system still converges (release after the restart).
    let dev = Dev::start(&data, port);
    ready("the plugin after restart", &["plugin", "status"], "1/1").await;
    let (ok, after) = moorctl(port, &["get", "volume", "web-data", "-o", "json"]);
    assert!(ok, "{after}");
    let uid = |s: &str| {
        serde_json::from_str::<serde_json::Value>(s).unwrap()["metadata"]["uid"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(
        uid(&before),
        uid(&after),
        "the volume is not the same object"
    );
    let (ok, out) = moorctl(port, &["get", "claim", "web-1.data"]);
    assert!(ok && out.contains("published"), "{out}");
    let (ok, out) = moorctl(port, &["alloc", "stop", "web-1"]);
    assert!(ok, "{out}");
    wait_claim(port, "released");
    dev.stop();
}

#[test]
fn moorctl_refuses_bad_input_with_clear_errors() {
    // No server is needed to refuse these; an unreachable one is a connection error.
    let port = free_port();
    let (ok, out) = moorctl(port, &["get", "pods"]);
    assert!(!ok && out.contains("unknown kind \"pods\""), "{out}");
    let (ok, out) = moorctl(port, &["wait", "volume/x", "--for", "color=red"]);
    assert!(!ok && out.contains("phase=PHASE or delete"), "{out}");
    // An invalid allocation given to `alloc plan` names the field (issue 78, item 7:
    // it said only "invalid").
    let tmp = tempfile::tempdir().unwrap();
    let nodeless = tmp.path().join("nodeless.yaml");
    std::fs::write(
        &nodeless,
        "kind: Allocation\nmetadata: {name: a}\nspec:\n  volumes:\n    - {name: d, volume: v}\n",
    )
    .unwrap();
    let (ok, out) = moorctl(port, &["alloc", "plan", "-f", nodeless.to_str().unwrap()]);
    assert!(
        !ok && out.contains("invalid: spec.node: is required"),
        "{out}"
    );
    let out = Command::new(bin_dir().join("moorctl"))
        .env("MOOR_ENDPOINTS", format!("http://127.0.0.1:{port}"))
        .args(["get", "volumes"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "an unreachable store is exit code 2"
    );
    let out = Command::new(bin_dir().join("moorctl"))
        .args(["completion", "bash"])
        .output()
        .unwrap();
    let script = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && script.contains("moorctl"));
    // It completes kinds (issue 78, item 7: it completed none).
    assert!(
        script.contains("volumeclasses") && script.contains("snapshotschedules"),
        "no kinds in the bash completion"
    );
}
