//! `moord backup check FILE` (issue 50, item 3): what an etcd snapshot holds, read from
//! a temporary etcd restored from it. Real etcd, etcdctl and moord processes.

mod common;

use common::{fixtures::volume, Etcd};
use moor::api::*;
use moor::store::Keyring;
use std::path::Path;
use std::process::Command;

/// `moord backup check ARGS...` with its temporary directory in `tmp`: exit code,
/// stdout, stderr.
fn check(tmp: &Path, args: &[&str]) -> (i32, String, String) {
    // An operator's shell may name their own cluster to etcdctl and etcd: the scratch
    // server is set by flags, which etcd refuses beside a variable of the same setting.
    let out = Command::new(common::bin("moord"))
        .env("TMPDIR", tmp)
        .env("ETCDCTL_ENDPOINTS", "http://127.0.0.1:1")
        .env("ETCD_NAME", "not-check")
        .args(["backup", "check"])
        .args(args)
        .output()
        .expect("run moord backup check");
    let (o, e) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    eprintln!("$ moord backup check {}\n{o}{e}", args.join(" "));
    (out.status.code().unwrap_or(-1), o, e)
}

fn with_secret(name: &str) -> Volume {
    let mut v = volume(name);
    v.spec.secrets = Secrets::new([("token".to_string(), "s3cret".to_string())].into()).into();
    v
}

/// The temporary etcds' directories left in `tmp` (the test's own: another run's
/// check on the same machine was counted when this looked in the machine's /tmp).
fn scratch_dirs(tmp: &Path) -> usize {
    std::fs::read_dir(tmp)
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| {
                    e.file_name()
                        .to_string_lossy()
                        .starts_with("moord-backup-check-")
                })
                .count()
        })
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_check_reads_a_snapshot_and_refuses_a_bad_file_or_a_wrong_key() {
    common::need("etcdctl");
    let etcd = Etcd::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let key_file = |id: &str| {
        let path = tmp.path().join(format!("{id}.key"));
        std::fs::write(&path, Keyring::generate(id).unwrap()).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        path
    };
    let (k1, k2) = (key_file("k1"), key_file("k2"));
    let sealed = etcd
        .store("/moor/")
        .await
        .with_keyring(Keyring::load(&k1).unwrap());
    for i in 0..3 {
        sealed.create(&with_secret(&format!("s{i}"))).await.unwrap();
    }
    let plain = etcd.store("/moor/").await;
    plain.create(&with_secret("p0")).await.unwrap();
    plain.create(&volume("n0")).await.unwrap();
    // One value no version of moor would write.
    let mut raw = etcd.raw_client().await;
    raw.put("/moor/volumes/default/garbage", "{not json", None)
        .await
        .unwrap();
    let snap = tmp.path().join("moor.db");
    let out = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={}", etcd.client_url))
        .args(["snapshot", "save"])
        .arg(&snap)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let scratch = tmp.path().join("scratch");
    std::fs::create_dir(&scratch).unwrap();
    let before = scratch_dirs(&scratch);
    let snap_s = snap.to_str().unwrap();

    // With the key that sealed them: every secret opens; the garbage value is named.
    let (code, out, err) = check(
        &scratch,
        &[snap_s, "--encryption-key-file", k1.to_str().unwrap()],
    );
    assert_eq!(code, 1, "a malformed value is a failed check: {out}{err}");
    assert!(
        out.starts_with(&format!("snapshot {snap_s}: revision ")),
        "{out}"
    );
    let volumes = out.lines().find(|l| l.starts_with("Volume ")).unwrap();
    assert_eq!(
        volumes.split_whitespace().collect::<Vec<_>>(),
        ["Volume", "5", "objects", "1", "malformed"],
        "{out}"
    );
    assert!(out.contains("volumes/default/garbage"), "{out}");
    assert!(
        out.contains("secrets: 1 in clear, 3 sealed with a key the key file holds (k1), 0 sealed with a key it does not hold"),
        "{out}"
    );
    assert!(
        !out.contains("s3cret") && !err.contains("s3cret"),
        "a secret printed"
    );

    // The garbage gone (a later snapshot): the same check passes.
    raw.delete("/moor/volumes/default/garbage", None)
        .await
        .unwrap();
    let clean = tmp.path().join("clean.db");
    let saved = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={}", etcd.client_url))
        .args(["snapshot", "save"])
        .arg(&clean)
        .status()
        .unwrap();
    assert!(saved.success());
    let clean_s = clean.to_str().unwrap();
    let (code, out, _) = check(
        &scratch,
        &[clean_s, "--encryption-key-file", k1.to_str().unwrap()],
    );
    assert_eq!(code, 0, "{out}");

    // Another key: the sealed secrets would stay sealed after a restore.
    let (code, out, _) = check(
        &scratch,
        &[clean_s, "--encryption-key-file", k2.to_str().unwrap()],
    );
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("3 sealed with a key it does not hold (k1)")
            && out.contains("does not hold key(s) k1"),
        "{out}"
    );

    // No key file: said, not failed.
    let (code, out, _) = check(&scratch, &[clean_s]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("give the cluster's key file"), "{out}");

    // A truncated snapshot and a file that is none: refused, with etcdctl's reason.
    let bytes = std::fs::read(&clean).unwrap();
    let cut = tmp.path().join("cut.db");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let junk = tmp.path().join("junk.db");
    std::fs::write(&junk, b"not a snapshot at all").unwrap();
    for bad in [&cut, &junk, &tmp.path().join("missing.db")] {
        let (code, out, err) = check(&scratch, &[bad.to_str().unwrap()]);
        assert_eq!(code, 2, "{}: {out}{err}", bad.display());
        assert!(
            err.contains("is not an etcd snapshot etcdctl can read"),
            "{}: {err}",
            bad.display()
        );
    }
    assert_eq!(
        scratch_dirs(&scratch),
        before,
        "a temporary etcd's directory was left behind"
    );
}

/// Issue 77, item 6: `moord backup check` of a snapshot of a cluster with
/// authentication on failed after 30 s ("user name is empty"), and with it off said "0
/// in clear" while the snapshot's history held a secret in clear. The temporary etcd
/// now serves TLS and the check connects as root by its certificate's CN; the
/// revisions the snapshot keeps are read too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_check_reads_a_snapshot_with_auth_on_and_counts_secrets_in_its_history() {
    common::need("etcdctl");
    common::need("openssl");
    let etcd = Etcd::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let store = etcd.store("/moor/").await;
    // A secret in clear, then removed: the current state has none, the history one.
    let h1 = store.create(&with_secret("h1")).await.unwrap();
    store
        .modify_spec(&h1.object_key(), |s| {
            s.secrets = Default::default();
            true
        })
        .await
        .unwrap();
    let ctl = |args: &[&str]| {
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", etcd.client_url))
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "etcdctl {args:?}: {out:?}");
    };
    ctl(&["user", "add", "root:pw", "--interactive=false"]);
    ctl(&["auth", "enable"]);
    let snap = tmp.path().join("auth.db");
    ctl(&[
        "--user",
        "root:pw",
        "snapshot",
        "save",
        snap.to_str().unwrap(),
    ]);
    let scratch = tmp.path().join("scratch");
    std::fs::create_dir(&scratch).unwrap();
    let (code, out, err) = check(&scratch, &[snap.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    let volumes = out.lines().find(|l| l.starts_with("Volume ")).unwrap();
    assert_eq!(
        volumes.split_whitespace().collect::<Vec<_>>(),
        ["Volume", "1", "objects", "0", "malformed"],
        "{out}"
    );
    assert!(out.contains("secrets: 0 in clear"), "{out}");
    assert!(
        out.contains("history: 1 value(s) with secrets in clear"),
        "{out}"
    );
    assert!(
        !out.contains("s3cret") && !err.contains("s3cret"),
        "a secret printed"
    );
    assert_eq!(
        scratch_dirs(&scratch),
        0,
        "the temporary etcd's directory is left"
    );
}
