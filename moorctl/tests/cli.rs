//! moorctl as a user runs it.

use std::io::Write;
use std::process::{Command, Stdio};

fn moorctl(args: &[&str], stdin: &str) -> (i32, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_moorctl"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run moorctl");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn validate_accepts_the_design_example() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/examples/design.yaml"
    );
    let (code, out, err) = moorctl(&["validate", "-f", path], "");
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        [
            "valid   volumes/default/db-data",
            "valid   volumes/default/archive",
            "valid   allocations/default/web-1"
        ]
    );
}

#[test]
fn validate_reports_every_problem_and_never_prints_secrets() {
    let manifest = r#"
kind: Volume
metadata: {name: "..", namespace: "a b"}
spec:
  plugin_id: "not a plugin"
  capacity_min: 2GiB
  capacity_max: 1GiB
  secrets: {password: hunter2}
  mount_options: {mount_flags: ["password=hunter2"]}
"#;
    let (code, out, err) = moorctl(&["validate", "-f", "-"], manifest);
    assert_eq!(code, 1, "{out}{err}");
    for field in [
        "metadata.name",
        "metadata.namespace",
        "spec.plugin_id",
        "spec.capabilities",
        "spec.capacity_max",
    ] {
        assert!(out.contains(field), "{field} missing from: {out}");
    }
    assert!(!out.contains("hunter2") && !err.contains("hunter2"));
}

#[test]
fn validate_of_a_missing_file_is_a_clear_error() {
    let (code, _, err) = moorctl(&["validate", "-f", "/nonexistent/x.yaml"], "");
    assert_eq!(code, 2);
    assert!(err.contains("reading /nonexistent/x.yaml"), "{err}");
}

#[test]
fn an_unreachable_etcd_is_one_line_that_says_what_to_do() {
    // A port nothing listens on: bound, then released.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let (code, out, err) = moorctl(&["--endpoints", &url, "get", "volumes"], "");
    assert_eq!((code, out.as_str()), (2, ""), "{err}");
    assert_eq!(
        err,
        format!(
            "moorctl: cannot reach etcd at {url}: connection refused; is etcd (or moord dev) \
             running there? set --endpoints or MOOR_ENDPOINTS\n"
        )
    );
    let (_, _, err) = moorctl(&["--endpoints", &url, "get", "volumes", "-v"], "");
    assert!(
        err.lines().count() > 2 && err.contains("  root: ") && err.contains("ConnectionRefused"),
        "{err}"
    );
}

/// Issue 26: `moorctl get volumes -o yaml | head -1` exited 101 with a panic. A reader
/// that goes away ends moorctl quietly. The completion script (over 64 KiB, more than a
/// pipe holds) is read for 10 bytes, then the pipe is closed.
#[test]
fn a_closed_pipe_ends_moorctl_quietly() {
    use std::io::Read;
    let mut child = Command::new(env!("CARGO_BIN_EXE_moorctl"))
        .args(["completion", "bash"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run moorctl");
    let mut head = [0u8; 10];
    child.stdout.take().unwrap().read_exact(&mut head).unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// Issue 37, item 6: `apply -f /dev/zero` (or an endless stdin) grew without bound
/// (6.5 GB in 8 s). Every input is read up to the 64 MiB cap, then refused; the peak
/// memory of the process stays near the cap.
#[test]
fn an_endless_input_is_refused_at_the_cap() {
    for args in [
        &["validate", "-f", "/dev/zero"][..],
        &["apply", "-f", "/dev/zero"][..],
        &["validate", "-f", "-"][..],
    ] {
        let mut child = Command::new("/usr/bin/time")
            .arg("-f")
            .arg("maxrss=%M")
            .arg(env!("CARGO_BIN_EXE_moorctl"))
            .args(args)
            .env("MOOR_ENDPOINTS", "http://127.0.0.1:1")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run moorctl under /usr/bin/time");
        let stdin = child.stdin.take().unwrap();
        // An endless stdin: zeros until moorctl stops reading.
        let feeder = std::thread::spawn(move || {
            use std::io::Write;
            let mut stdin = stdin;
            let block = vec![0u8; 1 << 20];
            while stdin.write_all(&block).is_ok() {}
        });
        let out = child.wait_with_output().unwrap();
        feeder.join().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("non-zero status"), "{args:?}: {err}");
        assert!(
            err.contains("longer than 67108864 bytes"),
            "{args:?}: {err}"
        );
        let kib: u64 = err
            .rsplit("maxrss=")
            .next()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(u64::MAX);
        assert!(kib < 200 * 1024, "{args:?}: peak RSS {kib} KiB");
    }
}
