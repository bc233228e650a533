//! An upgrade one process at a time (issue 50, item 2): a running cluster of an older
//! release of this repository, built from the clone's own history, is upgraded to this
//! build: the controller, then each node's agent, then moorctl, as UPGRADING.md says.
//! Claims are published on two nodes and a workload runs under the old `moorctl alloc
//! run` throughout: nothing live is torn down (no NodeUnpublish, NodeUnstage or
//! ControllerUnpublish of a claim still wanted), a new claim is published at each
//! stage, everything is released at the end and the plugins' call logs are clean.
//!
//! The release upgraded from, [`FROM`] (0.2.0), predates two changes to what is
//! stored, which the test names and checks across the upgrade:
//! - a stored-object field: `MountStatus.orphan` (a Mount a node keeps after an older
//!   etcd snapshot was restored);
//! - the node journal: each publish record's `made_for` (request, mode, capability)
//!   and `orphaned`, and its steps recorded by name (`steps`, where 0.2.0 wrote
//!   NodePublish's alone as `step`); the new agent reads the old agent's records,
//!   adopts them without a CSI call, releases them with the calls they owe, and
//!   writes the new form in records it makes.
//!
//! 0.2.0 already keeps the fields it does not know: an old agent and an old moorctl
//! write back objects carrying a field of a later version, and the field survives.
//!
//! A second test does the same from the last turn's main ([`LAST_MAIN`], before
//! ownership records, plugin names by namespace and the record's context), with a
//! registered volume and a retained template volume, and then goes back to it one
//! process at a time, as UPGRADING.md allows: nothing live is torn down either way.
//!
//! The old build: `git archive FROM` into `target/upgrade-from/<commit>/src`, built
//! with its own Cargo.lock into `target/upgrade-from/<commit>/target`, seeded with a
//! copy of this build's third-party artifacts (`target/debug`), so only moor's own
//! crates compile. Built once; later runs reuse it.

#[path = "common/cluster.rs"]
mod cluster;
mod common;

use cluster::{Cluster, PluginOpts};
use common::wait_for;
use moor::api::*;
use moor_hostpath::calllog::Call;
use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// 0.2.0: main at the end of 2026-11-27.
const FROM: &str = "c009100910a243aebe4fd1b17ad575f0a2f24ff1";
const FROM_VERSION: &str = "0.2.0";

/// The last turn's main (2026-12-06), before ownership records, plugin names by
/// namespace and the record's context: what this turn's changes upgrade from, and
/// what the version-skew policy lets an operator go back to.
const LAST_MAIN: &str = "31fb736ecd3f84294b5514f873272276ff0a6b00";

const T: Duration = Duration::from_secs(60);

/// This workspace's packages (their artifacts are never shared with the old build).
const OURS: &[&str] = &[
    "moor",
    "moor-csi",
    "moorctl",
    "moor-embedded",
    "moor-controllers",
    "moor-hostpath",
    "moor-bench",
];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Whether an artifact's name (`libfoo_bar-HASH.rlib`, `foo-bar-HASH`) is one of this
/// workspace's crates, or a test or binary of them (no `lib` prefix in deps/).
fn ours(name: &str, in_deps: bool) -> bool {
    if in_deps && !name.starts_with("lib") {
        return true;
    }
    let stem = name.strip_prefix("lib").unwrap_or(name);
    let krate = stem.rsplit_once('-').map_or(stem, |(k, _)| k);
    OURS.iter()
        .any(|p| krate == *p || krate == p.replace('-', "_"))
}

/// Copies this build's third-party artifacts into the old build's target dir, so that
/// only moor's crates compile there. Copies, not links: nothing the old build writes
/// can reach this build's files.
fn seed(from: &Path, to: &Path) {
    for (dir, in_deps) in [("deps", true), ("build", false), (".fingerprint", false)] {
        let (src, dst) = (from.join(dir), to.join(dir));
        std::fs::create_dir_all(&dst).expect("seed dir");
        let Ok(entries) = std::fs::read_dir(&src) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if ours(&name, in_deps) {
                continue;
            }
            let ok = Command::new("cp")
                .args(["-a", "--reflink=auto"])
                .arg(e.path())
                .arg(&dst)
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "copy {}", e.path().display());
        }
    }
}

/// The old release's `moord` and `moorctl`, built from the clone's history once.
fn old_build(from: &str, version: &str) -> PathBuf {
    let root = repo().join("target/upgrade-from").join(&from[..12]);
    let bin = root.join("bin");
    if bin.join("moord").exists() && bin.join("moorctl").exists() {
        return bin;
    }
    let started = Instant::now();
    // A worktree at `from`, so that the old build names its own commit (clean).
    let src = root.join("src");
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(repo())
            .args(args)
            .output()
            .expect("run git")
    };
    let _ = git(&["worktree", "remove", "--force", &src.display().to_string()]);
    let _ = std::fs::remove_dir_all(&src);
    let _ = git(&["worktree", "prune"]);
    let added = git(&[
        "worktree",
        "add",
        "--detach",
        &src.display().to_string(),
        from,
    ]);
    assert!(
        added.status.success(),
        "git worktree add {from}: {}: the upgrade test builds the release it upgrades from out of this clone's history (a shallow clone lacks it: git fetch --unshallow)",
        String::from_utf8_lossy(&added.stderr)
    );
    let target = root.join("target");
    seed(&repo().join("target/debug"), &target.join("debug"));
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(&src)
        .env("CARGO_TARGET_DIR", &target)
        .env_remove("RUSTFLAGS")
        .args([
            "build",
            "--locked",
            "-p",
            "moor-controllers",
            "-p",
            "moorctl",
            "--bins",
        ])
        .output()
        .expect("run cargo");
    assert!(
        out.status.success(),
        "building {from}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let compiled = String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| l.trim_start().starts_with("Compiling"))
        .map(|l| l.trim().to_string())
        .collect::<Vec<_>>();
    eprintln!(
        "built {version} ({}) in {:.0?}; compiled: {}",
        &from[..12],
        started.elapsed(),
        compiled.join("; ")
    );
    std::fs::create_dir_all(&bin).expect("bin dir");
    for b in ["moord", "moorctl"] {
        std::fs::copy(target.join("debug").join(b), bin.join(b)).expect("copy the old binary");
    }
    // Only the binaries are kept: the old build's target dir is large.
    let _ = std::fs::remove_dir_all(&target);
    let _ = git(&["worktree", "remove", "--force", &src.display().to_string()]);
    bin
}

/// `MOORCTL ARGS...` against the cluster, which must succeed.
fn moorctl(c: &Cluster, program: &Path, args: &[&str]) -> String {
    let (ok, text) = c.moorctl_as(program, args);
    assert!(ok, "moorctl {}: {text}", args.join(" "));
    text
}

/// A running `moorctl alloc run`; dropped (a failed assertion), it is ended so that
/// nothing of it outlives the test.
struct Run(Child);

impl Drop for Run {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = Command::new("kill")
                .args(["-TERM", &self.0.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(15);
            while Instant::now() < deadline && self.0.try_wait().ok().flatten().is_none() {
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// `MOORCTL alloc run NAME --node NODE --volume data=VOL -- sh -c ...`, whose workload
/// prints `started` and then waits for SIGTERM; returns once it runs. Its stderr goes
/// to a file of the cluster's dir (not the test's: a pipe held open by a workload
/// would keep the test's reader waiting).
fn alloc_run(c: &Cluster, program: &Path, name: &str, node: &str, volume: &str) -> Run {
    let log = std::fs::File::create(c.dir.path().join(format!("run-{name}.log"))).expect("log");
    let mut child = Command::new(program)
        .arg(format!("--endpoints={}", c.etcd.client_url))
        .args(["alloc", "run", name, "--node", node, "--volume"])
        .arg(format!("data={volume}"))
        .args(["--", "sh", "-c", "echo started; exec sleep 3600"])
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .expect("spawn moorctl alloc run");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("read the workload's first line");
    let run = Run(child);
    assert_eq!(line.trim(), "started", "the workload of {name} runs");
    run
}

/// Ends an `alloc run`'s workload (SIGTERM to the runner, which passes it on), then
/// waits until the runner has released the claims and exited.
fn end_run(mut run: Run) {
    let _ = Command::new("kill")
        .args(["-TERM", &run.0.id().to_string()])
        .status();
    let deadline = Instant::now() + T;
    while Instant::now() < deadline {
        if let Ok(Some(status)) = run.0.try_wait() {
            // CMD's own end: 128 + SIGTERM.
            assert_eq!(status.code(), Some(143), "alloc run ended with {status}");
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("moorctl alloc run did not end within {T:?} of SIGTERM");
}

/// The plugin's volume id of each volume named.
async fn external_ids(c: &Cluster, names: &[&str]) -> BTreeSet<String> {
    let mut ids = BTreeSet::new();
    for n in names {
        let v = c
            .store
            .get(&Volume::key_for(&Namespace::default_ns(), n))
            .await
            .expect("volume");
        ids.insert(
            v.status
                .provisioning
                .external_id
                .expect("created")
                .to_string(),
        );
    }
    ids
}

/// Calls that tear down one of `live` (volume ids) in every plugin's log.
fn teardowns(c: &Cluster, live: &BTreeSet<String>) -> Vec<String> {
    c.nodes
        .iter()
        .flat_map(|n| n.calls())
        .filter(|call| {
            matches!(
                call.rpc.as_str(),
                "NodeUnpublishVolume" | "NodeUnstageVolume" | "ControllerUnpublishVolume"
            ) && call.volume_id.as_ref().is_some_and(|v| live.contains(v))
        })
        .map(|call| format!("{} {:?} on {}", call.rpc, call.volume_id, call.plugin_node))
        .collect()
}

/// How many ControllerPublishVolume calls of `ids` every plugin's log holds.
fn publishes(c: &Cluster, ids: &BTreeSet<String>) -> usize {
    c.nodes
        .iter()
        .flat_map(|n| n.calls())
        .filter(|call| {
            call.rpc == "ControllerPublishVolume"
                && call.volume_id.as_ref().is_some_and(|v| ids.contains(v))
        })
        .count()
}

/// The raw JSON stored at `key` (below the cluster's prefix).
async fn raw(c: &Cluster, key: &str) -> serde_json::Value {
    let (bytes, _) = c
        .store
        .get_raw(key)
        .await
        .expect("read")
        .unwrap_or_else(|| panic!("{key} is stored"));
    serde_json::from_slice(&bytes).expect("JSON")
}

/// Writes `value` at `key` as it is: an object as a later version would write it.
async fn put_raw(c: &Cluster, key: &str, value: &serde_json::Value) {
    let mut client = c.etcd.raw_client().await;
    client
        .put(format!("/moor/{key}"), value.to_string(), None)
        .await
        .expect("put");
}

/// The old build of `from` (whose `moorctl --version` names `version` and the commit),
/// and a cluster of one controller and two nodes running it, with single-node-writer
/// volumes v1-v7 applied.
async fn old_cluster(from: &str, version: &str) -> (PathBuf, Cluster, [&'static str; 7]) {
    let old = old_build(from, version);
    let out = Command::new(old.join("moorctl"))
        .arg("--version")
        .output()
        .expect("old moorctl --version");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains(version) && said.contains(&from[..12]),
        "{said}"
    );
    let opts = PluginOpts {
        moord: Some(old.join("moord")),
        ..Default::default()
    };
    let c = Cluster::start(1, 2, opts).await;
    let names = ["v1", "v2", "v3", "v4", "v5", "v6", "v7"];
    for v in names {
        c.apply(c.volume(v, AccessMode::SingleNodeWriter)).await;
    }
    (old, c, names)
}

/// Waits until the plugin's new leader has recorded the owners of what the old build
/// made (its `migrated` record), then checks that each of the `created` volumes owns
/// its plugin volume and that its record carries what CreateVolume answered, copied
/// from the status once: the context claims carry from then on.
async fn owners_recorded(c: &Cluster, created: &[&str]) {
    let plugin = PluginId::new(cluster::PLUGIN).unwrap();
    wait_for("the plugin's volumes' owners recorded", T, || async {
        c.store
            .try_get(&Ownership::migrated_key(&plugin))
            .await
            .ok()
            .flatten()
            .is_some()
    })
    .await;
    for v in created {
        let vol = c
            .store
            .get(&Volume::key_for(&Namespace::default_ns(), v))
            .await
            .unwrap();
        let ext = vol.status.provisioning.external_id.clone().unwrap();
        let rec = c
            .store
            .get(&Ownership::key_for(
                &plugin,
                OwnedResource::Volume,
                ext.as_str(),
            ))
            .await
            .unwrap_or_else(|e| panic!("{v}'s plugin volume has no owner: {e}"));
        assert!(owned_by(&rec, &vol), "{v}: {rec:?}");
        assert_eq!(
            rec.spec.provisioned.as_ref().map(|p| &p.volume_context),
            Some(&vol.status.provisioning.volume_context),
            "{v}: {rec:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cluster_of_the_last_release_upgrades_one_process_at_a_time_without_unpublishing() {
    let (old, mut c, names) = old_cluster(FROM, FROM_VERSION).await;
    let old_moorctl = old.join("moorctl");
    let new_moorctl = common::bin("moorctl");
    // A volume as a later version would write it, with a field 0.2.0 does not know:
    // the old provisioner reads it, creates it and writes its status back.
    let mut v8 = c.volume("v8", AccessMode::SingleNodeWriter);
    v8.apply_defaults();
    v8.metadata.uid = "7c0a2b51-4a49-4c6e-9d32-5a8f0e1d2c3b".into();
    v8.metadata.generation = 1;
    v8.metadata.creation_timestamp = Some(Timestamp::now());
    let mut later = serde_json::to_value(v8).unwrap();
    later["spec"]["from_a_later_version"] = serde_json::json!({"kept": true});
    put_raw(&c, "volumes/default/v8", &later).await;
    for v in names.iter().chain(&["v8"]) {
        c.volume_ready(v).await;
    }
    let v8 = raw(&c, "volumes/default/v8").await;
    assert_eq!(
        v8["spec"]["from_a_later_version"],
        serde_json::json!({"kept": true}),
        "the old provisioner wrote v8's status back without the later field: {v8}"
    );

    // A registration, by the old build, of the plugin volume v7 was created as (the
    // same namespace: allowed before and after the owners).
    let v7_ext = c
        .store
        .get(&Volume::key_for(&Namespace::default_ns(), "v7"))
        .await
        .unwrap()
        .status
        .provisioning
        .external_id
        .unwrap();
    let mut r1 = c.volume("r1", AccessMode::SingleNodeWriter);
    r1.spec.capacity_min = None;
    r1.spec.external_id = Some(v7_ext.clone());
    c.apply(r1).await;
    c.volume_ready("r1").await;
    // And one of another namespace (b), which the upgrade keeps working beside v7,
    // shared, until an operator picks.
    let b = Namespace::new("b").unwrap();
    let mut r2 = c.volume("r2", AccessMode::SingleNodeWriter);
    r2.metadata.namespace = b.clone();
    r2.spec.capacity_min = None;
    r2.spec.external_id = Some(v7_ext.clone());
    let r2 = c.apply(r2).await.object_key();
    c.wait("b/r2 registered", T, || async {
        c.store
            .get(&r2)
            .await
            .is_ok_and(|v| v.status.provisioning.phase == VolumePhase::Ready)
    })
    .await;

    // A snapshot the old snapshotter cuts (its status and finalizer in its own key, no
    // report of it): deleted after the upgrade, through the new one.
    let s1 = Snapshot::new(
        &Namespace::default_ns(),
        Name::new("s1").unwrap(),
        SnapshotSpec {
            volume: VolumeId::new("v6").unwrap(),
            ..Default::default()
        },
    );
    let s1 = c.apply(s1).await.object_key();
    c.wait("s1 cut by the old snapshotter", T, || async {
        c.store.get(&s1).await.is_ok_and(|s| s.status.ready_to_use)
    })
    .await;

    // Claims on both nodes, and a workload under the old alloc run.
    c.apply(c.allocation("a1", "n1", "v1", false)).await;
    c.apply(c.allocation("a2", "n2", "v2", false)).await;
    let run = alloc_run(&c, &old_moorctl, "w1", "n1", "v3");
    c.wait_claim("a1", "n1", ClaimPhase::Published, T).await;
    c.wait_claim("a2", "n2", ClaimPhase::Published, T).await;
    c.wait_claim("w1", "n1", ClaimPhase::Published, T).await;
    // The old moorctl writes back an allocation carrying a later field.
    let mut a0 = c.allocation("a0", "n2", "v8", true);
    a0.apply_defaults();
    a0.metadata.uid = "0b6d9e7a-2f3c-4e1b-8a5d-6c7f8e9a0b1c".into();
    a0.metadata.generation = 1;
    a0.metadata.creation_timestamp = Some(Timestamp::now());
    let mut a0 = serde_json::to_value(a0).unwrap();
    a0["spec"]["from_a_later_version"] = serde_json::json!(7);
    put_raw(&c, "allocations/default/a0", &a0).await;
    c.wait_claim("a0", "n2", ClaimPhase::Published, T).await;
    moorctl(&c, &old_moorctl, &["alloc", "stop", "a0"]);
    let stopped = raw(&c, "allocations/default/a0").await;
    assert_eq!(stopped["spec"]["desired_status"], "stop", "{stopped}");
    assert_eq!(stopped["spec"]["from_a_later_version"], 7, "{stopped}");
    c.wait_claim("a0", "n2", ClaimPhase::Released, T).await;

    // A template naming a volume class (a field the old controller refuses), written
    // by the new moorctl while the old controller leads: refused, nothing written.
    let class_tpl = c.dir.path().join("t1.yaml");
    std::fs::write(
        &class_tpl,
        "kind: Allocation\nmetadata: {name: t1}\nspec:\n  node: n1\n  volumes:\n    \
         - name: data\n      template: {class: std, capacity_min: 1MiB}\n",
    )
    .unwrap();
    let apply_t1 = ["apply", "-f", class_tpl.to_str().unwrap()];
    let (ok, out) = c.moorctl_as(&new_moorctl, &apply_t1);
    assert!(!ok && out.contains("upgrade the controller first"), "{out}");
    assert!(
        c.store
            .try_get(&Allocation::key_for(&Namespace::default_ns(), "t1"))
            .await
            .unwrap()
            .is_none(),
        "nothing written"
    );

    let mut live = external_ids(&c, &["v1", "v2", "v3"]).await;
    let published_by_old = publishes(&c, &live);
    let mut stage_claims = Vec::new();
    // Each stage: one process replaced, then a new claim published beside the live
    // ones, and nothing live torn down.
    let stages: [(&str, &str, &str, &str); 3] = [
        ("controller", "a3", "n2", "v4"),
        ("agent n1", "a4", "n1", "v5"),
        ("agent n2", "a5", "n2", "v6"),
    ];
    for (what, alloc, node, volume) in stages {
        match what {
            "controller" => c.controllers[0].replace(common::bin("moord")),
            "agent n1" => c.node_mut("n1").agent.replace(common::bin("moord")),
            _ => c.node_mut("n2").agent.replace(common::bin("moord")),
        }
        c.wait_nodes_healthy().await;
        c.apply(c.allocation(alloc, node, volume, false)).await;
        c.wait_claim(alloc, node, ClaimPhase::Published, T).await;
        let torn = teardowns(&c, &live);
        assert!(torn.is_empty(), "after upgrading the {what}: {torn:?}");
        live.extend(external_ids(&c, &[volume]).await);
        stage_claims.push(alloc);
    }
    // The new attacher took the old one's attachments as they were stored (it has no
    // report about them): attached, so no ControllerPublish of them again.
    let first = external_ids(&c, &["v1", "v2", "v3"]).await;
    assert_eq!(
        publishes(&c, &first),
        published_by_old,
        "ControllerPublishVolume of a volume the old agent had attached"
    );
    // The new leader of the plugin recorded who owns what the old build made (issue
    // 77): every created volume its own plugin volume, v7's its creator's (not r1's,
    // listed first), then the plugin's `migrated` record; r1 is still ready.
    let created: Vec<&str> = names.iter().chain(&["v8"]).copied().collect();
    owners_recorded(&c, &created).await;
    let r1 = c
        .store
        .get(&Volume::key_for(&Namespace::default_ns(), "r1"))
        .await
        .unwrap();
    assert_eq!(r1.status.provisioning.phase, VolumePhase::Ready, "{r1:?}");
    // b/r2 named v7's plugin volume too: v7 owns it and shares it with b, writers
    // included (as before), and b's new claim of it is published.
    let plugin = PluginId::new(cluster::PLUGIN).unwrap();
    let rec = c
        .store
        .get(&Ownership::key_for(
            &plugin,
            OwnedResource::Volume,
            v7_ext.as_str(),
        ))
        .await
        .unwrap();
    assert_eq!(rec.spec.owner.name.as_str(), "v7", "{rec:?}");
    assert_eq!(
        rec.spec.shared_with(&b).map(|s| s.write),
        Some(true),
        "{rec:?}"
    );
    // On n2, where w2 claims v7 next: the plugin publishes a single-node volume to one
    // node only.
    let mut ab = c.allocation("ab", "n2", "r2", false);
    ab.metadata.namespace = b.clone();
    c.apply(ab).await;
    let ab_claim = Claim::key_for(&cluster::node("n2"), &b, "ab.data");
    c.wait("b's claim of r2 published after the upgrade", T, || async {
        c.store
            .try_get(&ab_claim)
            .await
            .ok()
            .flatten()
            .is_some_and(|cl| cl.status.phase == ClaimPhase::Published)
    })
    .await;
    live.extend(external_ids(&c, &["v7"]).await);

    // moorctl last: the new one runs a workload beside the old one's.
    let (ok, version) = c.moorctl(&["version"]);
    assert!(ok && version.contains("controller"), "{version}");
    let run2 = alloc_run(&c, &new_moorctl, "w2", "n2", "v7");
    c.wait_claim("w2", "n2", ClaimPhase::Published, T).await;
    // With the new controller leading, the template's class is taken.
    let class = c.dir.path().join("std.yaml");
    std::fs::write(
        &class,
        format!(
            "kind: VolumeClass\nmetadata: {{name: std}}\nspec: {{plugin_id: {}}}\n",
            cluster::PLUGIN
        ),
    )
    .unwrap();
    moorctl(&c, &new_moorctl, &["apply", "-f", class.to_str().unwrap()]);
    moorctl(&c, &new_moorctl, &apply_t1);
    c.wait_claim("t1", "n1", ClaimPhase::Published, T).await;
    moorctl(&c, &new_moorctl, &["alloc", "stop", "t1"]);
    c.wait_claim("t1", "n1", ClaimPhase::Released, T).await;
    live.extend(external_ids(&c, &["v7"]).await);
    let torn = teardowns(&c, &live);
    assert!(torn.is_empty(), "after upgrading moorctl: {torn:?}");

    // The node journal across the upgrade: n1's old records (a1, w1) were read and
    // kept, and the record the new agent made (a4) carries `made_for`.
    let journal =
        std::fs::read_to_string(c.node("n1").dir.join("agent/state.jsonl")).expect("n1's journal");
    let last_of = |claim: &str| {
        journal
            .lines()
            .rev()
            .find(|l| l.contains(&format!("\"claims/n1/default/{claim}\"")))
            .unwrap_or_else(|| panic!("{claim} in n1's journal"))
            .to_string()
    };
    assert!(
        last_of("a4.data").contains("\"made_for\""),
        "{}",
        last_of("a4.data")
    );
    assert!(
        !last_of("a1.data").contains("\"made_for\""),
        "{}",
        last_of("a1.data")
    );
    // The per-step record (0.3): the old agent wrote NodePublish's step alone, the new
    // one names each step it recorded.
    assert!(
        last_of("a1.data").contains("\"step\":\"done\""),
        "{}",
        last_of("a1.data")
    );
    assert!(
        last_of("a4.data").contains("\"steps\":{\"NodePublishVolume\":\"done\"}"),
        "{}",
        last_of("a4.data")
    );
    // A Mount the old agent wrote reads as this version's Mount (no orphan).
    let m = c
        .store
        .get(&Mount::key_for(
            &c.claim("a1", "n1").await.unwrap().object_key(),
        ))
        .await
        .expect("a1's Mount decodes");
    assert!(m.status.published && m.status.orphan.is_none(), "{m:?}");

    // Everything released at the end.
    end_run(run);
    end_run(run2);
    for a in ["a1", "a2"].into_iter().chain(stage_claims) {
        c.stop_alloc(a).await;
    }
    c.store
        .delete(&Allocation::key_for(&b, "ab"), None)
        .await
        .expect("delete b/ab");
    wait_for("every claim released", T, || async {
        c.all_claims_released().await
    })
    .await;
    // The old agent's records were read as the steps they say: releasing their claims
    // unpublished and unstaged what 0.2.0 had done (a record read as nothing done
    // would be released without a call, and leave the mounts). And the attachments
    // the old agent attached, of which the new one has no report, were detached by
    // their stored status (read as Pending, they would be deleted without a call).
    let old_records = external_ids(&c, &["v1", "v3"]).await;
    let torn = teardowns(&c, &old_records);
    for id in &old_records {
        for rpc in [
            "NodeUnpublishVolume",
            "NodeUnstageVolume",
            "ControllerUnpublishVolume",
        ] {
            assert!(
                torn.iter()
                    .any(|t| t.starts_with(rpc) && t.contains(id.as_str())),
                "{rpc} of {id}, published by the old agent: {torn:?}"
            );
        }
    }
    // A volume the old agent created (its finalizer added by that agent, no report of
    // it yet) is deleted through the new one: DeleteVolume, then the controller drops
    // the finalizer the new agent's report releases.
    let v1_id = external_ids(&c, &["v1"])
        .await
        .into_iter()
        .next()
        .expect("v1's id");
    let key = Volume::key_for(&Namespace::default_ns(), "v1");
    c.store.delete(&key, None).await.expect("delete v1");
    wait_for("v1 deleted", T, || async {
        c.store.try_get(&key).await.unwrap().is_none()
    })
    .await;
    let deleted = called(&c, "DeleteVolume", |call| call.volume_id);
    assert!(
        deleted.contains(&v1_id),
        "DeleteVolume of {v1_id}: {deleted:?}"
    );
    // So is the snapshot the old snapshotter cut: DeleteSnapshot, then the controller
    // drops the finalizer the new agent's report releases.
    let s1_id = (c.store.get(&s1).await.unwrap().status.snapshot_id).expect("s1's id");
    c.store.delete(&s1, None).await.expect("delete s1");
    wait_for("s1 deleted", T, || async {
        c.store.try_get(&s1).await.unwrap().is_none()
    })
    .await;
    let deleted = called(&c, "DeleteSnapshot", |call| call.snapshot_id);
    assert!(
        deleted.contains(&s1_id),
        "DeleteSnapshot of {s1_id}: {deleted:?}"
    );
    c.check_calls(true);
}

/// What `pick` takes from each call of `rpc` the plugins logged.
fn called(c: &Cluster, rpc: &str, pick: fn(Call) -> Option<String>) -> Vec<String> {
    (c.nodes.iter().flat_map(|n| n.calls()))
        .filter(|call| call.rpc == rpc)
        .filter_map(pick)
        .collect()
}

/// Volumes that must stay published, and how many teardowns of them the call logs
/// held when they became live (the retained template volume was torn down once, when
/// the allocation it was made for ended).
#[derive(Default)]
struct Live {
    ids: BTreeSet<String>,
    before: usize,
}

impl Live {
    fn extend(&mut self, c: &Cluster, ids: BTreeSet<String>) {
        self.ids.extend(ids);
        self.before = teardowns(c, &self.ids).len();
    }
}

/// The claims of allocation `alloc` on `node` published, and no `live` volume torn
/// down since it became live (`what` names the stage).
async fn stage(c: &Cluster, what: &str, alloc: &str, node: &str, live: &Live) {
    c.wait_claim(alloc, node, ClaimPhase::Published, T).await;
    let torn = teardowns(c, &live.ids);
    assert!(torn.len() == live.before, "{what}: {torn:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_last_main_upgrades_and_goes_back_one_process_at_a_time_without_unpublishing() {
    let (old, mut c, names) = old_cluster(LAST_MAIN, "0.2.0").await;
    let (old_moord, new_moord) = (old.join("moord"), common::bin("moord"));
    for v in names {
        c.volume_ready(v).await;
    }
    // A registration of the plugin volume v7 was created as.
    let v7_ext = external_ids(&c, &["v7"]).await.pop_first().unwrap();
    let mut r1 = c.volume("r1", AccessMode::SingleNodeWriter);
    r1.spec.capacity_min = None;
    r1.spec.external_id = Some(ExternalVolumeId::new(v7_ext).unwrap());
    c.apply(r1).await;
    c.volume_ready("r1").await;
    // A retained template volume: made for t1, kept after t1 ends.
    let tpl = c.dir.path().join("t1.yaml");
    std::fs::write(
        &tpl,
        format!(
            "kind: Allocation\nmetadata: {{name: t1}}\nspec:\n  node: n1\n  volumes:\n    \
             - name: data\n      template: {{plugin_id: {}, capacity_min: 1MiB, lifecycle: retain}}\n",
            cluster::PLUGIN
        ),
    )
    .unwrap();
    moorctl(
        &c,
        &old.join("moorctl"),
        &["apply", "-f", tpl.to_str().unwrap()],
    );
    c.wait_claim("t1", "n1", ClaimPhase::Published, T).await;
    c.stop_alloc("t1").await;
    c.wait_claim("t1", "n1", ClaimPhase::Released, T).await;
    let retained = "t1.data";
    c.volume_ready(retained).await;

    // Live claims on both nodes throughout.
    c.apply(c.allocation("a1", "n1", "v1", false)).await;
    c.apply(c.allocation("a2", "n2", "v2", false)).await;
    c.wait_claim("a1", "n1", ClaimPhase::Published, T).await;
    c.wait_claim("a2", "n2", ClaimPhase::Published, T).await;
    let mut live = Live::default();
    live.extend(&c, external_ids(&c, &["v1", "v2"]).await);
    let mut stopped_last = Vec::new();

    // Up: the controller, then each agent (n1 leads the plugin), each followed by a
    // new claim.
    c.controllers[0].replace(new_moord.clone());
    c.wait_nodes_healthy().await;
    c.apply(c.allocation("a3", "n2", "v3", false)).await;
    stage(&c, "after upgrading the controller", "a3", "n2", &live).await;
    c.node_mut("n1").agent.replace(new_moord.clone());
    c.wait_nodes_healthy().await;
    c.apply(c.allocation("a4", "n1", retained, false)).await;
    stage(&c, "after upgrading agent n1", "a4", "n1", &live).await;
    // The new leader recorded the owners, with what CreateVolume answered for the
    // created ones (the retained template volume among them); r1 is v7's sibling. Its
    // claim on n2 below carries v7's context from that record: admitted before it (on
    // r1's own word, which names no context, as the old build took it) it would be
    // staged on n2, whose plugin instance did not make v7, without the path
    // (NodeStageVolume NotFound, seen once under load).
    let created: Vec<&str> = names.iter().chain(&[retained]).copied().collect();
    owners_recorded(&c, &created).await;
    c.node_mut("n2").agent.replace(new_moord.clone());
    c.wait_nodes_healthy().await;
    c.apply(c.allocation("a5", "n2", "r1", false)).await;
    stage(&c, "after upgrading agent n2", "a5", "n2", &live).await;
    live.extend(&c, external_ids(&c, &["v3", retained, "r1"]).await);
    stopped_last.extend(["a3", "a4", "a5"]);

    // A new volume made and published by this version (named by namespace, name and
    // uid now), beside the old ones.
    c.apply(c.volume("n9", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("n9").await;
    c.apply(c.allocation("a6", "n1", "n9", false)).await;
    stage(&c, "a new volume after the upgrade", "a6", "n1", &live).await;
    live.extend(&c, external_ids(&c, &["n9"]).await);
    stopped_last.push("a6");

    // Down again, as UPGRADING.md allows: the agents, then the controller; each step
    // followed by a new claim on a volume the records already name, and, once the old
    // controller leads, on a volume the old agent makes.
    c.node_mut("n2").agent.replace(old_moord.clone());
    c.wait_nodes_healthy().await;
    c.apply(c.allocation("b1", "n2", "v4", false)).await;
    stage(&c, "after taking agent n2 back", "b1", "n2", &live).await;
    c.node_mut("n1").agent.replace(old_moord.clone());
    c.wait_nodes_healthy().await;
    c.apply(c.allocation("b2", "n1", "v5", false)).await;
    stage(&c, "after taking agent n1 back", "b2", "n1", &live).await;
    c.controllers[0].replace(old_moord.clone());
    c.wait_nodes_healthy().await;
    c.apply(c.volume("o9", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("o9").await;
    c.apply(c.allocation("b3", "n2", "o9", false)).await;
    stage(&c, "after taking the controller back", "b3", "n2", &live).await;
    live.extend(&c, external_ids(&c, &["v4", "v5", "o9"]).await);
    stopped_last.extend(["b1", "b2", "b3"]);

    // Everything released at the end, by the old build.
    for a in ["a1", "a2"].into_iter().chain(stopped_last) {
        c.stop_alloc(a).await;
    }
    wait_for("every claim released", T, || async {
        c.all_claims_released().await
    })
    .await;
    c.check_calls(true);
}
