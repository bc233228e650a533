//! deploy/ works as documented: the 3-member cluster script gives a cluster moor can
//! use through a member's death. (certs.sh and roles.sh are tests/security.rs's.)

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{fixtures::volume, wait_for};
use moor::store::Store;

fn deploy(script: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("deploy/etcd")
        .join(script)
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("script runs");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

/// Ports `base`, `base+1`, `base+10`, ... `base+21` all free (cluster3.sh's layout).
fn free_base() -> u16 {
    // Below the kernel's ephemeral range (32768 up), where any connection's source port
    // and every other test's `free_port` land.
    loop {
        let base = 20000 + fastrand::u16(0..12000);
        let free = [0, 1, 10, 11, 20, 21]
            .iter()
            .all(|o| std::net::TcpListener::bind(("127.0.0.1", base + o)).is_ok());
        if free {
            return base;
        }
    }
}

struct Cluster3(PathBuf);

impl Cluster3 {
    /// Starts cluster3.sh's three members in `dir`; returns it and their endpoints.
    fn start(dir: &Path) -> (Cluster3, Vec<String>) {
        let mut tries = 0;
        let out = loop {
            tries += 1;
            let started = Command::new("bash")
                .arg(deploy("cluster3.sh"))
                .arg("start")
                .arg(dir)
                .arg(free_base().to_string())
                .output()
                .expect("cluster3.sh runs");
            let out = String::from_utf8_lossy(&started.stdout).into_owned()
                + &String::from_utf8_lossy(&started.stderr);
            if started.status.success() {
                break out;
            }
            // A port can be taken between free_base's check and etcd's bind: the script
            // names the member that exited and why; only that cause gets another base.
            if out.contains("address already in use") && tries < 3 {
                std::fs::remove_dir_all(dir).unwrap();
                continue;
            }
            // The members' own words go with the temp dir: said here. The script has
            // stopped the members it started.
            let logs: String = (1..=3)
                .map(|i| {
                    let log =
                        std::fs::read_to_string(dir.join(format!("m{i}.log"))).unwrap_or_default();
                    let tail: Vec<&str> = log.lines().rev().take(15).collect();
                    let tail: Vec<&str> = tail.into_iter().rev().collect();
                    format!("--- m{i}.log (last lines)\n{}\n", tail.join("\n"))
                })
                .collect();
            panic!("cluster3.sh start failed:\n{out}\n{logs}");
        };
        let endpoints: Vec<String> = out
            .trim()
            .lines()
            .last()
            .unwrap()
            .split(',')
            .map(String::from)
            .collect();
        assert_eq!(endpoints.len(), 3, "{out}");
        (Cluster3(dir.to_path_buf()), endpoints)
    }

    /// SIGKILLs member `m` (1-3).
    fn kill(&self, m: usize) {
        let pid = std::fs::read_to_string(self.0.join(format!("m{m}.pid"))).unwrap();
        Command::new("kill")
            .arg("-9")
            .arg(pid.trim())
            .status()
            .unwrap();
    }
}

impl Drop for Cluster3 {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(deploy("cluster3.sh"))
            .arg("stop")
            .arg(&self.0)
            .status();
    }
}

#[tokio::test]
async fn the_three_member_cluster_keeps_serving_moor_when_a_member_dies() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("etcd");
    let (cluster, endpoints) = Cluster3::start(&dir);
    let store = Store::connect(&endpoints, "/moor/").await.unwrap();
    store.create(&volume("before")).await.unwrap();
    // Kill the first member: the other two are a quorum.
    cluster.kill(1);
    wait_for(
        "a write after a member died",
        Duration::from_secs(30),
        || {
            let store = store.clone();
            async move { store.create(&volume("after")).await.is_ok() }
        },
    )
    .await;
    // A connection the client opened to the dead member before it died fails its next
    // request with a reset, which for a write means "may have been sent" (moorctl and
    // the reconcilers retry those as unknown outcomes). Reads are repeated after any
    // transport failure: a few of them find such connections (the client picks a
    // member at random for each request) and leave only refused connections behind.
    for _ in 0..30 {
        store
            .list::<moor::api::VolumeSpec>(&moor::api::KeyScope::all())
            .await
            .unwrap();
    }
    // From now on every request must succeed the first time the test makes it: the
    // client still balances over the dead member's endpoint, and the store must send a
    // request that could not reach it to a live one.
    for i in 0..30 {
        store.create(&volume(&format!("more-{i}"))).await.unwrap();
        let listed = store
            .list::<moor::api::VolumeSpec>(&moor::api::KeyScope::all())
            .await
            .unwrap();
        assert_eq!(listed.items.len(), 2 + i + 1);
        store
            .get(&crate::common::key::<moor::api::VolumeSpec>(
                "volumes/default/before",
            ))
            .await
            .unwrap();
    }
}

/// The endpoint (index) of the member that leads the cluster now.
/// Runs one of the test's own store calls again while etcd is unavailable (a member
/// just died, the others electing a leader), for up to 30 s: the checks ride out the
/// death as the verbs under test do.
async fn through_death<T, F, Fut>(mut op: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, moor::store::StoreError>>,
{
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        match op().await {
            Ok(v) => return v,
            Err(e) if e.is_transient() && std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("store call after the member's death: {e}"),
        }
    }
}

async fn leader_index(endpoints: &[String]) -> Option<usize> {
    for (i, ep) in endpoints.iter().enumerate() {
        let Ok(mut c) = etcd_client::Client::connect([ep], None).await else {
            continue;
        };
        if let Ok(s) = c.status().await {
            if s.header().map(|h| h.member_id()) == Some(s.leader()) {
                return Some(i);
            }
        }
    }
    None
}

/// `n` volumes and `n` allocations claiming them, as one manifest.
/// How many objects an apply has written so far (volumes and allocations alike; 0 on an
/// error: a member may be going).
async fn objects_written(store: &Store) -> usize {
    let v = store
        .list::<moor::api::VolumeSpec>(&moor::api::KeyScope::all())
        .await
        .map_or(0, |l| l.items.len());
    let a = store
        .list::<moor::api::AllocationSpec>(&moor::api::KeyScope::all())
        .await
        .map_or(0, |l| l.items.len());
    v + a
}

fn big_manifest(n: usize, seed: u64) -> String {
    let mut out = String::new();
    for i in 0..n {
        out.push_str(&format!(
            "apiVersion: moor/v1\nkind: Volume\nmetadata: {{name: v{i}, labels: {{seed: \"{seed}\"}}}}\nspec:\n  plugin_id: hostpath.moor.dev\n  capacity_min: {}MiB\n  capabilities:\n    - {{access_mode: single-node-writer, attachment_mode: file-system}}\n---\n",
            1 + i
        ));
        out.push_str(&format!(
            "apiVersion: moor/v1\nkind: Allocation\nmetadata: {{name: a{i}}}\nspec:\n  node: n{}\n  volumes:\n    - {{name: data, volume: v{i}}}\n---\n",
            i % 3
        ));
    }
    out
}

fn moorctl(endpoints: &[String]) -> Command {
    let mut cmd = Command::new(common::bin("moorctl"));
    cmd.arg("--endpoints").arg(endpoints.join(","));
    cmd
}

/// Issue 16: the leader member killed (SIGKILL) at a random point of an apply of a few
/// hundred objects; the apply ends with every object written exactly as the manifest
/// says and exit 0, and a second apply changes nothing.
#[tokio::test]
async fn moorctl_apply_rides_out_the_death_of_the_leader_member() {
    for seed in [1u64, 2, 3] {
        let mut rng = fastrand::Rng::with_seed(seed);
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("etcd");
        let (cluster, endpoints) = Cluster3::start(&dir);
        let manifest = tmp.path().join("many.yaml");
        std::fs::write(&manifest, big_manifest(150, seed)).unwrap();
        let apply = moorctl(&endpoints)
            .arg("apply")
            .arg("-f")
            .arg(&manifest)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut apply = apply;
        let leader = leader_index(&endpoints).await.expect("a leader");
        // Killed once the apply has written a seeded number of its 300 objects, and
        // only while it still runs: the death falls inside the apply, not after it.
        let at = rng.usize(1..250);
        let store = Store::connect(&endpoints, "/moor/").await.unwrap();
        wait_for(
            &format!("seed {seed}: {at} objects applied"),
            Duration::from_secs(60),
            || async { objects_written(&store).await >= at },
        )
        .await;
        assert!(
            apply.try_wait().unwrap().is_none(),
            "seed {seed}: the apply ended before the leader's death"
        );
        cluster.kill(leader + 1);
        let done = apply.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&done.stdout);
        let stderr = String::from_utf8_lossy(&done.stderr);
        assert!(
            done.status.success(),
            "seed {seed}: apply failed:\n{stdout}\n{stderr}"
        );
        assert_eq!(stdout.lines().count(), 300, "seed {seed}: {stdout}");
        // Every object as the manifest says, read from the surviving members.
        let store = Store::connect(&endpoints, "/moor/").await.unwrap();
        let wanted = moor::api::parse_manifests(&std::fs::read_to_string(&manifest).unwrap());
        let volumes = store
            .list::<moor::api::VolumeSpec>(&moor::api::KeyScope::all())
            .await
            .unwrap();
        let allocations = store
            .list::<moor::api::AllocationSpec>(&moor::api::KeyScope::all())
            .await
            .unwrap();
        assert_eq!(volumes.items.len(), 150, "seed {seed}");
        assert_eq!(allocations.items.len(), 150, "seed {seed}");
        for w in wanted {
            match w.unwrap() {
                moor::api::AnyObject::Volume(v) => {
                    let got = volumes.items.iter().find(|s| s.key() == v.key()).unwrap();
                    assert_eq!(got.spec, v.spec, "seed {seed}: {}", v.key());
                    assert_eq!(got.metadata.labels, v.metadata.labels);
                }
                moor::api::AnyObject::Allocation(a) => {
                    let got = allocations
                        .items
                        .iter()
                        .find(|s| s.key() == a.key())
                        .unwrap();
                    assert_eq!(got.spec, a.spec, "seed {seed}: {}", a.key());
                }
                other => panic!("unexpected {}", other.key()),
            }
        }
        // A second apply changes nothing.
        let again = moorctl(&endpoints)
            .arg("apply")
            .arg("-f")
            .arg(&manifest)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&again.stdout);
        assert!(again.status.success(), "seed {seed}: {text}");
        assert!(
            text.lines().all(|l| l.ends_with(" unchanged")),
            "seed {seed}: {text}"
        );
    }
}

/// Issue 16: the other writing verbs and a watch ride out the leader member's death.
#[tokio::test]
async fn moorctl_verbs_and_watches_ride_out_the_death_of_the_leader_member() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("etcd");
    let (cluster, endpoints) = Cluster3::start(&dir);
    let manifest = tmp.path().join("few.yaml");
    std::fs::write(&manifest, big_manifest(80, 0)).unwrap();
    run(moorctl(&endpoints).arg("apply").arg("-f").arg(&manifest));
    // A watch started before the death.
    let mut watch = moorctl(&endpoints)
        .args(["get", "volumes", "-w"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let lines = {
        use std::io::BufRead;
        let stdout = watch.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        rx
    };
    // A wait polling through the death: v79 is the last volume deleted below.
    let wait = moorctl(&endpoints)
        .args(["wait", "volume/v79", "--for", "delete", "--timeout", "60s"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Each verb, one object after another (three verbs at once), while the leader dies
    // among them: every one ends with its effect and exit 0.
    // Each thread counts the commands it finished: the leader dies once every thread
    // is a few commands in (not after a count of one verb's effects, which a loaded
    // machine let the other verbs finish before).
    let done: Vec<std::sync::Arc<std::sync::atomic::AtomicUsize>> = (0..3)
        .map(|_| std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0)))
        .collect();
    let verb = |i: usize, list: Vec<Vec<String>>| {
        let eps = endpoints.clone();
        let done = done[i].clone();
        std::thread::spawn(move || {
            let mut failures = Vec::new();
            for args in list {
                let out = moorctl(&eps).args(&args).output().unwrap();
                done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if !out.status.success() {
                    failures.push(format!(
                        "{args:?}: {}",
                        String::from_utf8_lossy(&out.stderr)
                    ));
                }
            }
            failures
        })
    };
    let words = |w: &[&str]| w.iter().map(|s| s.to_string()).collect::<Vec<String>>();
    let verbs = [
        verb(
            0,
            (0..80)
                .map(|i| words(&["alloc", "stop", &format!("a{i}")]))
                .collect(),
        ),
        verb(
            1,
            (0..40)
                .map(|i| words(&["volume", "detach", &format!("v{i}"), "--node", "n1"]))
                .collect(),
        ),
        verb(
            2,
            (40..80)
                .map(|i| words(&["delete", "volume", &format!("v{i}")]))
                .collect(),
        ),
    ];
    // Killed once every verb is under way (a random few commands into each), and only
    // while each of them still runs.
    let at = fastrand::usize(2..8);
    wait_for(
        &format!("every verb {at} commands in"),
        Duration::from_secs(60),
        || async {
            done.iter()
                .all(|d| d.load(std::sync::atomic::Ordering::SeqCst) >= at)
        },
    )
    .await;
    assert!(
        verbs.iter().all(|v| !v.is_finished()),
        "a verb ended before the leader's death"
    );
    let leader = leader_index(&endpoints).await.expect("a leader");
    cluster.kill(leader + 1);
    let failures: Vec<String> = verbs.into_iter().flat_map(|t| t.join().unwrap()).collect();
    assert!(failures.is_empty(), "{failures:#?}");
    let waited = wait.wait_with_output().unwrap();
    assert!(
        waited.status.success(),
        "wait: {}",
        String::from_utf8_lossy(&waited.stderr)
    );
    let store = Store::connect(&endpoints, "/moor/").await.unwrap();
    let volumes = through_death(|| async {
        store
            .list::<moor::api::VolumeSpec>(&moor::api::KeyScope::all())
            .await
    })
    .await;
    assert_eq!(volumes.items.len(), 40);
    assert!(volumes
        .items
        .iter()
        .all(|v| v.spec.force_detach.keys().any(|n| n.as_str() == "n1")));
    let allocations = through_death(|| async {
        store
            .list::<moor::api::AllocationSpec>(&moor::api::KeyScope::all())
            .await
    })
    .await;
    assert!(allocations
        .items
        .iter()
        .all(|a| a.spec.desired_status == moor::api::DesiredStatus::Stop));
    // The watch goes on: a volume created after the death shows up in it.
    through_death(|| async {
        match store.create(&volume("after-death")).await {
            // Only after a lost answer: that create landed.
            Err(moor::store::StoreError::AlreadyExists { .. }) => Ok(()),
            other => other.map(|_| ()),
        }
    })
    .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut seen = Vec::new();
    while std::time::Instant::now() < deadline {
        match lines.recv_timeout(Duration::from_millis(200)) {
            Ok(l) => {
                if l.contains("after-death") {
                    break;
                }
                seen.push(l);
            }
            Err(_) => continue,
        }
    }
    let _ = watch.kill();
    let _ = watch.wait();
    assert!(
        std::time::Instant::now() < deadline,
        "the watch did not show the new volume; it printed: {seen:?}"
    );
}

/// Issue 16: with the quorum gone, apply gives up after `--retry-for` and says which
/// objects it did not apply, and why.
#[tokio::test]
async fn moorctl_apply_without_a_quorum_lists_what_it_did_not_apply() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("etcd");
    let (cluster, endpoints) = Cluster3::start(&dir);
    let manifest = tmp.path().join("few.yaml");
    std::fs::write(&manifest, big_manifest(2, 0)).unwrap();
    cluster.kill(2);
    cluster.kill(3);
    let out = moorctl(&endpoints)
        .args(["--retry-for", "2s", "apply", "-f"])
        .arg(&manifest)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("0 of 4 objects applied; not applied: volumes/default/v0, allocations/default/a0, volumes/default/v1, allocations/default/a1; last error: cannot reach etcd at "),
        "{stderr}"
    );
}

/// Issue 50, item 4: deploy/systemd's units and drop-in pass `systemd-analyze verify`
/// (with the built binaries where they name /usr/local/bin: verify checks that the
/// program exists). This machine has no systemd as PID 1: what a restart does is tested
/// by replacing processes (tests/lifecycle.rs, tests/versions.rs).
#[test]
fn the_systemd_units_pass_systemd_analyze_verify() {
    common::need("systemd-analyze");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/systemd");
    let tmp = tempfile::tempdir().unwrap();
    let mut units = Vec::new();
    let copy = |from: &Path, to: &Path| {
        let text = std::fs::read_to_string(from)
            .unwrap()
            .replace(
                "/usr/local/bin/moord",
                common::bin("moord").to_str().unwrap(),
            )
            .replace(
                "/usr/local/bin/moorctl",
                common::bin("moorctl").to_str().unwrap(),
            );
        std::fs::write(to, text).unwrap();
    };
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_owned();
        if path.is_dir() {
            let dir = tmp.path().join(&name);
            std::fs::create_dir(&dir).unwrap();
            for e in std::fs::read_dir(&path).unwrap() {
                let p = e.unwrap().path();
                copy(&p, &dir.join(p.file_name().unwrap()));
            }
        } else {
            copy(&path, &tmp.path().join(&name));
            units.push(format!("./{}", name.to_string_lossy()));
        }
    }
    units.sort();
    assert!(units.len() >= 3, "{units:?}");
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .args(&units)
        .current_dir(tmp.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && err.trim().is_empty(),
        "{units:?}: {err}"
    );
}

/// How each verb is run against an etcd that cannot answer (the arguments after the
/// verb, with every wait of its own set to `VERB_TIMEOUT`); `None` for the verbs that
/// never talk to the store. A verb missing here fails the test.
fn unreachable_args(verb: &[String]) -> Option<Option<Vec<String>>> {
    let alloc = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("deploy/examples/web-1.yaml")
        .display()
        .to_string();
    let t = "4s";
    let args: &[&str] = match verb.join(" ").as_str() {
        "validate" | "completion" => return Some(None),
        "apply" => &["-f", &alloc],
        "get" => &["volumes"],
        "describe" => &["volume", "v1"],
        "delete" => &["volume", "v1"],
        "alloc run" => &["a1", "--node", "n1", "--timeout", t, "--", "true"],
        "alloc plan" => &["-f", &alloc],
        "alloc paths" => &["a1"],
        "alloc stop" => &["a1"],
        "volume detach" => &["v1", "--node", "n1"],
        "volume status" => &[],
        "volume pause" | "volume activate" | "volume own" | "volume deregister" => &["v1"],
        "volume drain" => &["v1", "--timeout", t],
        "volume snapshot create" => &["v1", "s1"],
        "volume snapshot import" => &["s1", "--source-volume", "v1", "--snapshot-id", "x"],
        "volume snapshot delete" => &["s1"],
        "volume snapshot list" => &[],
        "volume share" | "volume unshare" => &["v1", "--with", "b"],
        "plugin status" => &[],
        "plugin deregister" => &["p1", "--node", "n1"],
        "node cordon" | "node uncordon" => &["n1"],
        "node drain" => &["n1", "--timeout", t],
        "mount adopt" | "mount release" => &["c1", "--node", "n1", "--timeout", t],
        "events" => &[],
        "wait" => &["volume/v1", "--for", "delete", "--timeout", t],
        "version" => &[],
        _ => return None,
    };
    Some(Some(args.iter().map(|a| a.to_string()).collect()))
}

/// Issue 78 item 2: against a paused etcd (SIGSTOP: the kernel still completes the
/// handshake, nothing answers) and then a stopped one, every moorctl verb that talks to
/// the store ends within the bounds it names (`--request-timeout`, `--retry-for`, its
/// own `--timeout`) and says why in one line: "did not answer within 2s" for the
/// paused etcd, "connection refused" for the stopped one. The verbs come from
/// moorctl's command tree (`moorctl_verbs`); `get -w` and `events -w` are run too. Then
/// a watch open on a live etcd: quiet but answering (progress), it says nothing; paused
/// under it, it says the store went silent.
#[tokio::test]
async fn every_verb_ends_within_its_named_bound_against_a_paused_or_stopped_etcd() {
    let mut runs: Vec<(String, Vec<String>)> = Vec::new();
    let mut missing = Vec::new();
    for verb in common::moorctl_verbs() {
        match unreachable_args(&verb) {
            None => missing.push(verb.join(" ")),
            Some(None) => {}
            Some(Some(args)) => {
                let mut all = verb.clone();
                all.extend(args);
                runs.push((verb.join(" "), all));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "moorctl verbs with no entry in unreachable_args: {missing:?}"
    );
    assert!(runs.len() >= 30, "too few verbs found: {runs:?}");
    for watch in ["get", "events"] {
        let mut all = vec![watch.to_string()];
        all.extend(if watch == "get" {
            vec!["volumes".to_string()]
        } else {
            vec![]
        });
        all.push("-w".into());
        runs.push((format!("{watch} -w"), all));
    }

    let mut etcd = common::Etcd::start().await;
    // The bounds every run names: a request 2 s, a write's retries 3 s, a verb's own
    // wait 4 s. A run may take their sum plus process start-up on a loaded machine.
    let bound = Duration::from_secs(2 + 2 + 3 + 4 + 20);
    for (state, cause) in [
        ("paused", "etcd did not answer within 2s"),
        ("stopped", "connection refused"),
    ] {
        match state {
            "paused" => etcd.pause(true),
            _ => {
                etcd.pause(false);
                etcd.kill();
            }
        }
        let started = std::time::Instant::now();
        let children: Vec<_> = runs
            .iter()
            .map(|(name, args)| {
                let child = moorctl(&etcd.endpoints)
                    .args(["--request-timeout", "2s", "--retry-for", "3s"])
                    .args(args)
                    .stdin(Stdio::null())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("run moorctl");
                (name.clone(), child)
            })
            .collect();
        let mut failures = Vec::new();
        for (name, mut child) in children {
            // Every run has ended by the bound or is a failure (killed there).
            let end = started + bound;
            let status = loop {
                if let Some(status) = child.try_wait().unwrap() {
                    break Some(status);
                }
                if std::time::Instant::now() >= end {
                    let _ = child.kill();
                    let _ = child.wait();
                    break None;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            let out = child.wait_with_output().unwrap();
            let said = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            let expected_ok = name == "version";
            match status {
                None => failures.push(format!("{name}: still running after {bound:?}: {said}")),
                Some(s) if s.success() != expected_ok => {
                    failures.push(format!("{name}: exit {s}: {said}"))
                }
                Some(_) if !said.contains(cause) => {
                    failures.push(format!("{name}: does not say {cause:?}: {said}"))
                }
                Some(_) if !expected_ok && !said.contains("cannot reach etcd at") => {
                    failures.push(format!("{name}: names no endpoint: {said}"))
                }
                Some(_) => {}
            }
        }
        assert!(
            failures.is_empty(),
            "{state} etcd:\n{}",
            failures.join("\n")
        );
    }
}

/// Issue 78 item 2: a watch tells an idle store from a silent one. On a live etcd with
/// nothing changing, `get -w` says nothing on stderr for over two request deadlines
/// (3 s each: its progress requests are answered); with the server paused under it, it
/// says in one line that etcd sent nothing and did not answer a progress request, and
/// follows again once the server resumes (a volume written then is shown).
#[tokio::test]
async fn a_watch_says_when_etcd_goes_silent_and_nothing_while_it_is_idle() {
    let etcd = common::Etcd::start().await;
    let stderr_file = tempfile::NamedTempFile::new().unwrap();
    let stdout_file = tempfile::NamedTempFile::new().unwrap();
    let mut watch = moorctl(&etcd.endpoints)
        .args(["--request-timeout", "3s", "get", "volumes", "-w"])
        .stdout(stdout_file.reopen().unwrap())
        .stderr(stderr_file.reopen().unwrap())
        .spawn()
        .unwrap();
    let stderr = || std::fs::read_to_string(stderr_file.path()).unwrap_or_default();
    let stdout = || std::fs::read_to_string(stdout_file.path()).unwrap_or_default();
    wait_for(
        "the watch to print its header",
        Duration::from_secs(30),
        || async { stdout().contains("NAME") },
    )
    .await;
    // Idle: two quiet spells of a deadline, each ended by an answered progress request.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let idle = stderr();
    etcd.pause(true);
    wait_for(
        "the watch to say etcd is silent",
        Duration::from_secs(30),
        || async { stderr().contains("etcd sent nothing on a watch") },
    )
    .await;
    etcd.pause(false);
    let store = Store::connect(&etcd.endpoints, moor::store::DEFAULT_PREFIX)
        .await
        .unwrap();
    store.create(&volume("after-pause")).await.unwrap();
    let followed = tokio::time::timeout(Duration::from_secs(30), async {
        while !stdout().contains("after-pause") {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let _ = watch.kill();
    let _ = watch.wait();
    assert!(idle.is_empty(), "an idle watch said: {idle}");
    assert!(
        followed.is_ok(),
        "the watch did not follow after the pause: {}\n{}",
        stdout(),
        stderr()
    );
    let said = stderr();
    assert!(
        said.contains("cannot reach etcd at") && said.contains("watching again"),
        "{said}"
    );
}
