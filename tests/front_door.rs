//! The front doors under a concurrent writer: every write a person asks for without
//! naming a version (delete, alloc stop, volume detach and deregister, snapshot delete,
//! plugin deregister, apply of a copy without a version) lands while another writer
//! keeps rewriting the same key, as a reconciler's status writes do; a write that names
//! a version still refuses a stale one. Real etcd, the real moorctl.

#[path = "common/cluster.rs"]
mod cluster;
mod common;

use cluster::{Cluster, PluginOpts};
use common::{bin, Etcd};
use moor::api::*;
use moor::store::Store;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

/// Rounds per command: each is one race the command must win.
const ROUNDS: usize = 6;

fn moorctl(url: &str, args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(bin("moorctl"))
        .arg(format!("--endpoints={url}"))
        .args(args)
        .output()
        .expect("run moorctl");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("$ moorctl {}\n{text}", args.join(" "));
    (out.status.success(), text)
}

/// How long the racer writes, back to back, from its first write (just before the
/// command starts).
const BURST: Duration = Duration::from_millis(400);

/// A writer that rewrites `key` (its stored bytes, unchanged) back to back for
/// [`BURST`], as reconcilers write an object's status when something changes: each
/// write moves the key's mod_revision. A command whose read lands in the burst loses
/// its write and must read again until the burst is over (`moorctl delete` failed on
/// its first conflict before). Counts the writes, so the test can show the race ran.
struct Racer {
    stop: Arc<AtomicBool>,
    writes: Arc<AtomicU64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Racer {
    async fn start(etcd: &Etcd, store: &Store, key: &str) -> Racer {
        let stop = Arc::new(AtomicBool::new(false));
        let writes = Arc::new(AtomicU64::new(0));
        let full = store.full_key(key);
        let mut tasks = Vec::new();
        {
            let mut client = etcd.raw_client().await;
            let (stop, writes, full) = (stop.clone(), writes.clone(), full.clone());
            let started = std::time::Instant::now();
            tasks.push(tokio::spawn(async move {
                // The burst runs from the racer's first write: on a loaded machine its
                // first round trips took most of a burst counted from the spawn, and
                // it had not written three times when the burst was over.
                let mut first: Option<std::time::Instant> = None;
                while !stop.load(Ordering::Relaxed)
                    && first.is_none_or(|t| t.elapsed() < BURST)
                    && started.elapsed() < std::time::Duration::from_secs(10)
                {
                    let Ok(got) = client.get(full.as_bytes(), None).await else {
                        continue;
                    };
                    let Some(kv) = got.kvs().first() else {
                        // Gone (the command deleted it): wait for the next round's.
                        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
                        continue;
                    };
                    // Only over the version read, so a delete is never undone.
                    let put = etcd_client::TxnOp::put(kv.key(), kv.value(), None);
                    let same = etcd_client::Compare::mod_revision(
                        kv.key(),
                        etcd_client::CompareOp::Equal,
                        kv.mod_revision(),
                    );
                    let txn = etcd_client::Txn::new().when([same]).and_then([put]);
                    if let Ok(r) = client.txn(txn).await {
                        if r.succeeded() {
                            first.get_or_insert_with(std::time::Instant::now);
                            writes.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }));
        }
        // Running before the command starts.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while writes.load(Ordering::Relaxed) < 3 {
            assert!(
                std::time::Instant::now() < deadline,
                "the racer never wrote"
            );
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        Racer {
            stop,
            writes,
            tasks,
        }
    }

    async fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            let _ = t.await;
        }
        self.writes.load(Ordering::Relaxed)
    }
}

fn registered(name: &str) -> Volume {
    let spec = VolumeSpec {
        plugin_id: PluginId::new("hostpath.moor.dev").unwrap(),
        external_id: Some(ExternalVolumeId::new(format!("ext-{name}")).unwrap()),
        capabilities: vec![VolumeCapability {
            access_mode: AccessMode::SingleNodeWriter,
            attachment_mode: AttachmentMode::FileSystem,
        }],
        ..Default::default()
    };
    Volume::new(&Namespace::default_ns(), Name::new(name).unwrap(), spec)
}

fn allocation(name: &str) -> Allocation {
    let spec = AllocationSpec {
        node: NodeName::new("n1").unwrap(),
        ..Default::default()
    };
    Allocation::new(&Namespace::default_ns(), Name::new(name).unwrap(), spec)
}

/// Runs `args` while the racer rewrites `key`; the command must succeed.
async fn wins(etcd: &Etcd, store: &Store, key: &str, args: &[&str]) -> u64 {
    let racer = Racer::start(etcd, store, key).await;
    let (ok, out) = {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let url = etcd.client_url.clone();
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            moorctl(&url, &args)
        })
        .await
        .unwrap()
    };
    let writes = racer.stop().await;
    assert!(
        ok,
        "moorctl {} lost to a concurrent writer ({writes} writes): {out}",
        args.join(" ")
    );
    writes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_unversioned_moorctl_write_wins_over_a_concurrent_writer() {
    let etcd = Etcd::start().await;
    let store = etcd.store("/moor/").await;
    let mut raced = 0;
    for i in 0..ROUNDS {
        // delete volume
        let v = store
            .create(&registered(&format!("del-{i}")))
            .await
            .unwrap();
        raced += wins(
            &etcd,
            &store,
            &v.key(),
            &["delete", "volume", &format!("del-{i}")],
        )
        .await;
        assert!(store.try_get(&v.object_key()).await.unwrap().is_none());

        // alloc stop, then delete allocation
        let a = store.create(&allocation(&format!("a-{i}"))).await.unwrap();
        raced += wins(
            &etcd,
            &store,
            &a.key(),
            &["alloc", "stop", &format!("a-{i}")],
        )
        .await;
        let stopped = store.get(&a.object_key()).await.unwrap();
        assert_eq!(stopped.spec.desired_status, DesiredStatus::Stop);
        raced += wins(
            &etcd,
            &store,
            &a.key(),
            &["delete", "allocation", &format!("a-{i}")],
        )
        .await;
        assert!(store.try_get(&a.object_key()).await.unwrap().is_none());

        // volume detach
        let v = store
            .create(&registered(&format!("det-{i}")))
            .await
            .unwrap();
        raced += wins(
            &etcd,
            &store,
            &v.key(),
            &["volume", "detach", &format!("det-{i}"), "--node", "n1"],
        )
        .await;
        let detached = store.get(&v.object_key()).await.unwrap();
        assert!(detached
            .spec
            .force_detach
            .contains_key(&NodeName::new("n1").unwrap()));

        // volume deregister
        let v = store
            .create(&registered(&format!("dereg-{i}")))
            .await
            .unwrap();
        raced += wins(
            &etcd,
            &store,
            &v.key(),
            &["volume", "deregister", &format!("dereg-{i}")],
        )
        .await;
        assert!(store.try_get(&v.object_key()).await.unwrap().is_none());

        // snapshot delete
        let s = Snapshot::new(
            &Namespace::default_ns(),
            Name::new(format!("snap-{i}")).unwrap(),
            SnapshotSpec {
                volume: VolumeId::new("det-0").unwrap(),
                ..Default::default()
            },
        );
        let s = store.create(&s).await.unwrap();
        raced += wins(
            &etcd,
            &store,
            &s.key(),
            &["volume", "snapshot", "delete", &format!("snap-{i}")],
        )
        .await;
        assert!(store.try_get(&s.object_key()).await.unwrap().is_none());

        // apply of a copy without a version
        let v = store
            .create(&registered(&format!("app-{i}")))
            .await
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("v.yaml");
        std::fs::write(
            &file,
            format!(
                "apiVersion: moor/v1\nkind: Volume\nmetadata: {{name: app-{i}, labels: {{tier: gold}}}}\n\
                 spec:\n  plugin_id: hostpath.moor.dev\n  external_id: ext-app-{i}\n  capabilities:\n    \
                 - {{access_mode: single-node-writer, attachment_mode: file-system}}\n"
            ),
        )
        .unwrap();
        raced += wins(
            &etcd,
            &store,
            &v.key(),
            &["apply", "-f", file.to_str().unwrap()],
        )
        .await;
        let applied = store.get(&v.object_key()).await.unwrap();
        assert_eq!(
            applied.metadata.labels.get("tier").map(String::as_str),
            Some("gold")
        );
    }
    eprintln!("{raced} concurrent writes raced the commands");

    // Deletion protection refuses the delete from moorctl (exit 1) and the store,
    // until it is lifted.
    let mut protected = registered("prot");
    protected.spec.deletion_protection = true;
    let protected = store.create(&protected).await.unwrap();
    let out = std::process::Command::new(bin("moorctl"))
        .arg(format!("--endpoints={}", etcd.client_url))
        .args(["delete", "volume", "prot"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code() == Some(1) && text.contains("protected"),
        "{out:?}"
    );
    assert!(matches!(
        store.delete(&protected.object_key(), None).await,
        Err(moor::store::StoreError::Protected { .. })
    ));
    assert!(store
        .try_get(&protected.object_key())
        .await
        .unwrap()
        .is_some());
    store
        .modify_spec(&protected.object_key(), |s: &mut VolumeSpec| {
            s.deletion_protection = false;
            true
        })
        .await
        .unwrap();
    let (ok, out) = moorctl(&etcd.client_url, &["delete", "volume", "prot"]);
    assert!(ok, "{out}");

    // A write that names a version still refuses a stale copy.
    let v = store.create(&registered("stale")).await.unwrap();
    let stale = v.metadata.resource_version;
    store
        .modify_status(&v.object_key(), |_, st: &mut VolumeStatus| {
            st.claims.schedulable = !st.claims.schedulable;
            true
        })
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("v.yaml");
    std::fs::write(
        &file,
        format!(
            "apiVersion: moor/v1\nkind: Volume\nmetadata: {{name: stale, resource_version: {stale}, labels: {{a: b}}}}\n\
             spec:\n  plugin_id: hostpath.moor.dev\n  external_id: ext-stale\n  capabilities:\n    \
             - {{access_mode: single-node-writer, attachment_mode: file-system}}\n"
        ),
    )
    .unwrap();
    let (ok, out) = moorctl(&etcd.client_url, &["apply", "-f", file.to_str().unwrap()]);
    assert!(!ok && out.contains("newer than your copy"), "{out}");
    let err = store
        .delete(&v.object_key(), Some(stale))
        .await
        .expect_err("a delete at a stale version");
    assert!(
        matches!(err, moor::store::StoreError::Conflict { .. }),
        "{err}"
    );
}

/// Issue 49, item 2: allocation `p` asking for volume `fz1` as request `q.r`, beside
/// allocation `p.q` whose request `r` holds volume `one`, made one claim name
/// (`p.q.r`): `p` was Ready at once with `p.q`'s claim and its workload read `one`.
/// Now each gets its own claim on its own volume, both published, and releasing one
/// leaves the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_allocations_whose_names_joined_alike_get_a_claim_each() {
    let c = Cluster::start(1, 1, PluginOpts::default()).await;
    for v in ["one", "fz1"] {
        c.apply(c.volume(v, AccessMode::SingleNodeWriter)).await;
        c.volume_ready(v).await;
    }
    let request = |alloc: &str, req: &str, volume: &str| {
        Allocation::new(
            &Namespace::default_ns(),
            Name::new(alloc).unwrap(),
            AllocationSpec {
                node: NodeName::new("n1").unwrap(),
                volumes: vec![VolumeRequest {
                    name: Name::new(req).unwrap(),
                    volume: VolumeId::new(volume).unwrap(),
                    ..Default::default()
                }],
                ..Default::default()
            },
        )
    };
    let pq = c.apply(request("p.q", "r", "one")).await;
    let p = c.apply(request("p", "q.r", "fz1")).await;
    let claim_of = |a: &Allocation| {
        Claim::key_for(
            &a.spec.node,
            &a.metadata.namespace,
            a.claim_name(&a.spec.volumes[0]).unwrap(),
        )
    };
    let (pq_key, p_key) = (claim_of(&pq), claim_of(&p));
    assert_ne!(pq_key, p_key, "one claim name for two requests");
    for (key, volume) in [(&pq_key, "one"), (&p_key, "fz1")] {
        c.wait(&format!("{key} published on {volume}"), T, || async {
            c.store.try_get(key).await.ok().flatten().is_some_and(|cl| {
                cl.status.phase == ClaimPhase::Published && cl.spec.volume.as_str() == volume
            })
        })
        .await;
    }
    let p_claim = c.store.get(&p_key).await.unwrap();
    assert_eq!(
        (
            p_claim.spec.allocation.as_str(),
            p_claim.spec.request.as_str()
        ),
        ("p", "q.r")
    );
    // Each volume published once, for its own allocation.
    for key in [&pq_key, &p_key] {
        let m = c.store.get(&Mount::key_for(key)).await.unwrap();
        assert!(m.status.published, "{key}: {:?}", m.status);
    }
    assert_eq!(c.node("n1").count("NodePublishVolume", "OK"), 2);
    c.stop_alloc("p").await;
    c.wait("p's claim released", T, || async {
        c.store
            .try_get(&p_key)
            .await
            .ok()
            .flatten()
            .is_none_or(|cl| cl.status.phase == ClaimPhase::Released)
    })
    .await;
    let kept = c.store.get(&pq_key).await.unwrap();
    assert_eq!(
        kept.status.phase,
        ClaimPhase::Published,
        "p.q's claim stays"
    );
    c.stop_alloc("p.q").await;
    c.wait("every claim released", T, || c.all_claims_released())
        .await;
    c.check_calls(true);
}

/// The records of ended work: allocations, claims, Mounts, attachments and runner
/// leases, in every namespace.
async fn work_keys(c: &Cluster) -> usize {
    let s = &c.store;
    s.list(&KeyScope::<AllocationSpec>::all())
        .await
        .unwrap()
        .items
        .len()
        + s.list(&KeyScope::<ClaimSpec>::all())
            .await
            .unwrap()
            .items
            .len()
        + s.list(&KeyScope::<MountSpec>::all())
            .await
            .unwrap()
            .items
            .len()
        + s.list(&KeyScope::<AttachmentSpec>::all())
            .await
            .unwrap()
            .items
            .len()
        + s.list(&KeyScope::<LeaseSpec>::all())
            .await
            .unwrap()
            .items
            .len()
}

/// Issue 49, item 3: 100 engine Mount/Unmount cycles left +100 allocations, claims
/// and Mounts in etcd, for good. Now ended work is collected after the controller's
/// retention (1 s here): after engine cycles and scheduler-style allocations run and
/// stop, the records of ended work go back to none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ended_work_is_collected_after_the_retention_and_leaves_no_keys() {
    let c = Cluster::start_volume_plugin_with(PluginOpts {
        controller_args: vec!["--retention=1s".into()],
        ..Default::default()
    })
    .await;
    let sock = c.volume_plugin_socket("n1");
    let call = |verb: &'static str, body: serde_json::Value| {
        let sock = sock.clone();
        async move {
            let (status, v) = common::post_raw(
                &sock,
                &format!("/VolumeDriver.{verb}"),
                None,
                body.to_string().as_bytes(),
            )
            .await;
            assert!(
                status == 200 && v.get("Err").is_none_or(|e| e == ""),
                "{verb}: {v}"
            );
            v
        }
    };
    call(
        "Create",
        serde_json::json!({"Name": "cyc", "Opts": {"size": "1MiB"}}),
    )
    .await;
    c.volume_ready("cyc").await;
    c.apply(c.volume("sched", AccessMode::SingleNodeWriter))
        .await;
    c.volume_ready("sched").await;
    const CYCLES: usize = 20;
    for i in 0..CYCLES {
        // As Docker sends them: a new ID per mount.
        let id = format!("{i:064x}");
        call("Mount", serde_json::json!({"Name": "cyc", "ID": id})).await;
        call("Unmount", serde_json::json!({"Name": "cyc", "ID": id})).await;
        if i % 2 == 0 {
            let name = format!("sched-{i}");
            c.apply(c.allocation(&name, "n1", "sched", false)).await;
            c.wait_claim(&name, "n1", ClaimPhase::Published, T).await;
            let (ok, out) = c.moorctl(&["alloc", "stop", &name]);
            assert!(ok, "{out}");
        }
    }
    c.wait(
        "every ended allocation collected with its claims and Mounts",
        T,
        || async { work_keys(&c).await == 0 },
    )
    .await;
    // The volumes stay: only what ended is collected.
    for v in ["cyc", "sched"] {
        assert!(c
            .store
            .try_get(&Volume::key_for(&Namespace::default_ns(), v))
            .await
            .unwrap()
            .is_some());
    }
    c.check_calls(true);
}
