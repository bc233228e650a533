//! Workloads through `moorctl alloc run` (issue 25): a real etcd, `moord controller`,
//! agents and moor-hostpath; the runner and its workload are real processes, and the
//! plugins' call logs are checked against the invariants.

#[path = "common/cluster.rs"]
mod cluster;
mod common;

use cluster::{Cluster, PluginOpts};
use moor::api::*;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;
use tokio::sync::Semaphore;

static SLOTS: Semaphore = Semaphore::const_new(2);

const T: Duration = Duration::from_secs(30);

async fn cluster() -> Cluster {
    let c = Cluster::start(1, 2, PluginOpts::default()).await;
    c.apply(c.volume("v1", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v1").await;
    c
}

/// `moorctl alloc run ARGS...` against the cluster.
fn runner(c: &Cluster, args: &[&str]) -> Command {
    let mut cmd = Command::new(common::bin("moorctl"));
    cmd.arg(format!("--endpoints={}", c.etcd.client_url))
        .args(["alloc", "run"])
        .args(args);
    cmd
}

fn run(c: &Cluster, args: &[&str]) -> Output {
    let out = runner(c, args).output().expect("run moorctl alloc run");
    eprintln!(
        "$ moorctl alloc run {}\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

async fn allocation(c: &Cluster, name: &str) -> Allocation {
    c.store
        .get(&Allocation::key_for(&Namespace::default_ns(), name))
        .await
        .expect("allocation")
}

/// Spawns `moorctl alloc run NAME --node NODE --volume data=v1 [FLAGS...] -- sh -c
/// SCRIPT`, whose script prints `started` once it runs; returns when it has.
fn start(c: &Cluster, name: &str, node: &str, flags: &[&str], script: &str) -> Child {
    let mut args = vec![name, "--node", node, "--volume", "data=v1"];
    args.extend_from_slice(flags);
    args.extend_from_slice(&["--", "sh", "-c", script]);
    let mut child = runner(c, &args)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn moorctl alloc run");
    let stdout = child.stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("read the workload's first line");
    assert_eq!(line.trim(), "started", "the workload runs");
    child
}

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .expect("kill")
        .success();
    assert!(ok, "kill {sig}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workload_gets_its_volume_and_its_end_releases_it() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = cluster().await;
    let env_file = c.dir.path().join("w1.env");
    let bg = c.dir.path().join("bg.pid");
    let script = format!(
        "sleep 300 & echo $! > {}; echo kept > \"$MOOR_VOLUME_DATA/f\" && test \"$MOOR_ALLOC\" = w1 && exit 3",
        bg.display()
    );
    // The first run writes into the volume, leaves a process behind, and fails with 3.
    let out = run(
        &c,
        &[
            "w1",
            "--node",
            "n2",
            "--volume",
            "data=v1",
            "--env-file",
            env_file.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            &script,
        ],
    );
    assert_eq!(out.status.code(), Some(3), "the workload's exit code");
    // Issue 37, item 7: what the workload left in its process group was ended before
    // its volume was released (moorctl returns after the release).
    let pid = std::fs::read_to_string(&bg).unwrap();
    assert!(
        !std::path::Path::new(&format!("/proc/{}", pid.trim())).exists(),
        "the workload's background process {pid} outlived it"
    );
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&env_file).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "the env file is the owner's alone");
    }
    let w1 = allocation(&c, "w1").await;
    assert_eq!(w1.spec.client_status, ClientStatus::Failed);
    assert_eq!(w1.spec.exit.as_ref().and_then(|e| e.code), Some(3));
    assert_eq!(w1.spec.desired_status, DesiredStatus::Stop);
    assert_eq!(
        c.claim("w1", "n2").await.unwrap().status.phase,
        ClaimPhase::Released,
        "released before moorctl returned"
    );
    let env = std::fs::read_to_string(&env_file).unwrap();
    assert!(
        env.contains("MOOR_ALLOC=w1\n") && env.contains("MOOR_NODE=n2\n"),
        "{env}"
    );
    assert!(env.contains("MOOR_VOLUME_DATA=/"), "{env}");

    // A second allocation on the same volume reads it back, read-only.
    let out = run(
        &c,
        &[
            "w2",
            "--node",
            "n2",
            "--volume",
            "data=v1:ro",
            "--",
            "sh",
            "-c",
            "cat \"$MOOR_VOLUME_DATA/f\"",
        ],
    );
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "kept");
    let w2 = allocation(&c, "w2").await;
    assert_eq!(w2.spec.client_status, ClientStatus::Complete);
    assert_eq!(w2.spec.exit.as_ref().and_then(|e| e.code), Some(0));
    assert_eq!(
        c.claim("w2", "n2").await.unwrap().spec.mode,
        ClaimMode::Read
    );
    assert_eq!(
        c.claim("w2", "n2").await.unwrap().status.phase,
        ClaimPhase::Released
    );
    // The runner's lease is gone with it.
    let leases = c
        .store
        .list::<LeaseSpec>(&KeyScope::all())
        .await
        .unwrap()
        .items;
    assert!(leases.is_empty(), "{leases:?}");
    c.check_calls(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_to_the_runner_reaches_the_workload() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = cluster().await;
    let child = start(
        &c,
        "w1",
        "n1",
        &[],
        "trap 'exit 7' TERM; echo started; while :; do sleep 0.1; done",
    );
    // While it runs, where its data is.
    let (ok, out) = c.moorctl(&["alloc", "paths", "w1"]);
    assert!(ok && out.starts_with("data=/"), "{out}");
    let (ok, out) = c.moorctl(&["alloc", "paths", "w1", "--export"]);
    assert!(ok && out.starts_with("export MOOR_VOLUME_DATA='/"), "{out}");
    let (ok, out) = c.moorctl(&["describe", "allocation", "w1", "-o", "wide"]);
    assert!(ok && out.contains("Client:     running"), "{out}");
    assert!(
        out.contains("TARGET PATH") && out.contains("STAGING PATH"),
        "{out}"
    );
    assert!(out.contains("/per-alloc/default/w1/v1/"), "{out}");
    signal(&child, "-TERM");
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(7), "the workload's own exit");
    let w1 = allocation(&c, "w1").await;
    assert_eq!(w1.spec.client_status, ClientStatus::Failed);
    assert_eq!(w1.spec.exit.as_ref().and_then(|e| e.code), Some(7));
    assert_eq!(
        c.claim("w1", "n1").await.unwrap().status.phase,
        ClaimPhase::Released
    );
    c.check_calls(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_runner_s_allocation_is_lost_and_released_in_order() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = cluster().await;
    let mark = c.dir.path().join("terminated");
    let stubborn = c.dir.path().join("stubborn.pid");
    // The workload starts a process of its own that ignores SIGTERM (issue 37, item 7:
    // such a child outlived a killed runner and kept the volume busy after release).
    let script = format!(
        "sh -c 'trap \"\" TERM; echo $$ > {}; while :; do sleep 0.1; done' & trap 'echo term > {}; exit 0' TERM; echo started; while :; do sleep 0.1; done",
        stubborn.display(),
        mark.display()
    );
    let mut child = start(&c, "w1", "n2", &["--lease-ttl", "3s"], &script);
    c.wait("the stubborn child runs", T, || async { stubborn.exists() })
        .await;
    let stubborn_pid = std::fs::read_to_string(&stubborn)
        .unwrap()
        .trim()
        .to_string();
    let stubborn_alive = || std::path::Path::new(&format!("/proc/{stubborn_pid}")).exists();
    assert!(stubborn_alive());
    assert_eq!(
        allocation(&c, "w1").await.spec.client_status,
        ClientStatus::Running
    );
    signal(&child, "-KILL");
    let _ = child.wait();
    // The workload is told (the runner's death signal) ...
    c.wait("the workload terminated", T, || async { mark.exists() })
        .await;
    // ... and the controller finds the lease unrenewed: lost, claims released.
    c.wait("w1 lost", T, || async {
        allocation(&c, "w1").await.status.lost
    })
    .await;
    // Every process of the workload is gone by the time its volume is unpublished:
    // looked at once n2 acknowledged the teardown (its Mount released, after
    // NodeUnpublish; the agent ends what is left in the cgroup before that call), not
    // when the claim leaves Published (the controller's write that orders the release
    // marks it Releasing before the node acts; under the full suite's load the test
    // looked in between, as a44e369 found for the guard's test).
    let mount = Mount::key_for(&Claim::key_for(
        &NodeName::new("n2").unwrap(),
        &Namespace::default_ns(),
        "w1.data",
    ));
    c.wait("n2 acknowledges the teardown of w1's claim", T, || async {
        match c.store.try_get(&mount).await {
            Ok(Some(m)) => m.status.released,
            Ok(None) => true,
            Err(_) => false,
        }
    })
    .await;
    assert!(
        !stubborn_alive(),
        "the workload's child outlived the runner into the release"
    );
    c.wait_claim("w1", "n2", ClaimPhase::Released, T).await;
    let w1 = allocation(&c, "w1").await;
    assert_eq!(w1.client_status(), ClientStatus::Lost);
    assert_eq!(
        w1.spec.desired_status,
        DesiredStatus::Run,
        "the controller does not write the runner's spec"
    );
    // NodeUnpublish, NodeUnstage, then ControllerUnpublish: the checker holds the order.
    let n2 = c.node("n2");
    assert_eq!(n2.count("NodeUnpublishVolume", "OK"), 1);
    assert_eq!(n2.count("NodeUnstageVolume", "OK"), 1);
    assert_eq!(c.node("n1").count("ControllerUnpublishVolume", "OK"), 1);
    c.check_calls(true);
}

/// Issue 37, item 7: an --env-file that is a symbolic link, request names that give
/// one variable, and more requests than an allocation may make are refused before
/// anything is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alloc_run_refuses_a_linked_env_file_and_ambiguous_or_too_many_requests() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = cluster().await;
    let target = c.dir.path().join("target-of-link");
    let link = c.dir.path().join("w.env");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let out = run(
        &c,
        &[
            "w1",
            "--node",
            "n1",
            "--volume",
            "data=v1",
            "--env-file",
            link.to_str().unwrap(),
            "--",
            "true",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("symbolic link"), "{err}");
    assert!(!target.exists(), "the link was followed");
    let out = run(
        &c,
        &[
            "w2",
            "--node",
            "n1",
            "--volume",
            "a-b=v1:ro",
            "--volume",
            "a_b=v1:ro",
            "--",
            "true",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("would both be MOOR_VOLUME_A_B"), "{err}");
    let mut args = vec!["w3".to_string(), "--node".into(), "n1".into()];
    for i in 0..=MAX_VOLUME_REQUESTS {
        args.push("--volume".into());
        args.push(format!("r{i}=v1:ro"));
    }
    args.extend(["--".into(), "true".into()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = run(&c, &args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("at most 128 requests"), "{err}");
    for name in ["w1", "w2", "w3"] {
        let stored = c
            .store
            .try_get(&Allocation::key_for(&Namespace::default_ns(), name))
            .await
            .unwrap();
        assert!(stored.is_none(), "{name} was created");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_or_timed_out_run_leaves_nothing_claimed() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = cluster().await;
    // w1 writes v1 (single-node-writer) on n1.
    let holder = start(
        &c,
        "w1",
        "n1",
        &[],
        "echo started; while :; do sleep 0.1; done",
    );
    // w2 wants to write it on n2: denied, named, stopped.
    let out = run(
        &c,
        &["w2", "--node", "n2", "--volume", "data=v1", "--", "true"],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("denied") && err.contains("allocation w1 on node n1"),
        "{err}"
    );
    let w2 = allocation(&c, "w2").await;
    assert_eq!(w2.spec.desired_status, DesiredStatus::Stop);
    c.wait_claim("w2", "n2", ClaimPhase::Released, T).await;
    // A node that never comes: the timeout, then the same.
    let out = run(
        &c,
        &[
            "w3",
            "--node",
            "nowhere",
            "--timeout",
            "2s",
            "--volume",
            "data=v1:ro",
            "--",
            "true",
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("timed out"), "{err}");
    assert!(!err.contains("etcd"), "a timeout is not etcd's: {err}");
    // Its claim says why it waits.
    assert!(err.contains("node nowhere is not registered"), "{err}");
    assert_eq!(
        allocation(&c, "w3").await.spec.desired_status,
        DesiredStatus::Stop
    );
    c.wait_claim("w3", "nowhere", ClaimPhase::Released, T).await;
    // Without --timeout: the node's own bound (issue 78, item 2: it waited 5 minutes),
    // named.
    let out = run(
        &c,
        &[
            "w5",
            "--node",
            "nowhere",
            "--node-timeout",
            "3s",
            "--volume",
            "data=v1:ro",
            "--",
            "true",
        ],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("node nowhere has not been registered for 3s")
            && err.contains("--node-timeout"),
        "{err}"
    );
    // A volume whose plugin no node runs a controller of: its claim says so.
    let mut orphan_plugin = c.volume("nv", AccessMode::SingleNodeWriter);
    orphan_plugin.spec.plugin_id = PluginId::new("nobody.example").unwrap();
    c.apply(orphan_plugin).await;
    let mut a = c.allocation("w6", "n1", "nv", false);
    a.spec.volumes[0].name = Name::new("data").unwrap();
    c.apply(a).await;
    c.wait("w6's claim to say why it waits", T, || async {
        c.claim("w6", "n1").await.is_some_and(|cl| {
            cl.status.reason.as_deref().is_some_and(|r| {
                r.contains("no node runs a healthy controller of plugin nobody.example")
            })
        })
    })
    .await;
    let (ok, out) = c.moorctl(&["describe", "allocation", "w6"]);
    assert!(
        ok && out.contains("Waiting:    data: Pending (volume nv is being created, but no node runs a healthy controller"),
        "{out}"
    );
    let (ok, _) = c.moorctl(&["alloc", "stop", "w6"]);
    assert!(ok);
    // Interrupted while it waits: the same.
    let waiting = runner(
        &c,
        &[
            "w4",
            "--node",
            "nowhere",
            "--volume",
            "data=v1:ro",
            "--",
            "true",
        ],
    )
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    c.wait("w4 created", T, || async {
        c.store
            .try_get(&Allocation::key_for(&Namespace::default_ns(), "w4"))
            .await
            .ok()
            .flatten()
            .is_some()
    })
    .await;
    signal(&waiting, "-TERM");
    let out = waiting.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("interrupted"), "{err}");
    assert_eq!(
        allocation(&c, "w4").await.spec.desired_status,
        DesiredStatus::Stop
    );
    // Adopting: a running allocation on another node is refused, with why.
    let out = run(
        &c,
        &["w1", "--node", "n2", "--volume", "data=v1", "--", "true"],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("is run by") || err.contains("runs on node n1"),
        "{err}"
    );
    signal(&holder, "-TERM");
    let out = holder.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(128 + 15), "killed by SIGTERM");
    assert_eq!(
        allocation(&c, "w1").await.spec.exit,
        Some(ClientExit {
            code: None,
            signal: Some("SIGTERM".into())
        })
    );
    c.check_calls(true);
}

/// `moorctl alloc plan` against what the controller then does: a seeded random walk over
/// cluster states (volumes of every access mode held by writers and readers on two
/// nodes, max_volumes_per_node 2, an unregistered node), and in each state a candidate
/// allocation planned on one node and then applied there. Plan says it fits exactly when
/// the controller admits it. `MOOR_PLAN_SEED` replays a walk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alloc_plan_agrees_with_the_controller_s_admission() {
    let _slot = SLOTS.acquire().await.unwrap();
    let seed = std::env::var("MOOR_PLAN_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(7_u64);
    eprintln!("plan walk: seed {seed} (MOOR_PLAN_SEED)");
    let mut rng = fastrand::Rng::with_seed(seed);
    let opts = PluginOpts {
        extra: vec!["--max-volumes-per-node=2".into()],
        ..Default::default()
    };
    let c = Cluster::start(1, 2, opts).await;
    let modes = [
        ("v1", AccessMode::SingleNodeWriter),
        ("v2", AccessMode::MultiNodeReaderOnly),
        ("v3", AccessMode::MultiNodeSingleWriter),
        ("v4", AccessMode::MultiNodeMultiWriter),
    ];
    for (v, m) in modes {
        c.apply(c.volume(v, m)).await;
    }
    for (v, _) in modes {
        c.volume_ready(v).await;
    }
    let settled = |cl: &Claim| {
        matches!(
            cl.status.phase,
            ClaimPhase::Admitted | ClaimPhase::Published | ClaimPhase::Denied
        ) || (cl.status.phase == ClaimPhase::Pending && cl.status.reason.is_some())
    };
    let mut live: Vec<(String, String)> = Vec::new();
    let (mut agreed_fit, mut agreed_no) = (0, 0);
    for round in 0..14 {
        // The state: start or stop a holder.
        if live.len() < 2 || rng.bool() {
            let name = format!("h{round}");
            let (v, m) = modes[rng.usize(..modes.len())];
            let node = ["n1", "n2"][rng.usize(..2)];
            let ro = !m.allows_write() || rng.bool();
            c.apply(c.allocation(&name, node, v, ro)).await;
            c.wait("the holder settled", T, || async {
                c.claim(&name, node).await.is_some_and(|cl| settled(&cl))
            })
            .await;
            live.push((name, node.to_string()));
        } else {
            let (name, node) = live.remove(rng.usize(..live.len()));
            c.stop_alloc(&name).await;
            c.wait_claim(&name, &node, ClaimPhase::Released, T).await;
        }
        // The candidate: planned, then applied.
        let (v, m) = modes[rng.usize(..modes.len())];
        let node = ["n1", "n2", "ghost"][rng.usize(..3)];
        let ro = !m.allows_write() || rng.bool();
        let name = format!("c{round}");
        let cand = c.allocation(&name, node, v, ro);
        let file = c.dir.path().join(format!("{name}.json"));
        std::fs::write(&file, serde_json::to_string(&cand).unwrap()).unwrap();
        let (_, out) = c.moorctl(&[
            "alloc",
            "plan",
            "-f",
            file.to_str().unwrap(),
            "--node",
            node,
            "-o",
            "json",
        ]);
        let json_start = out.find('[').expect("plan's JSON");
        let plan: serde_json::Value = serde_json::Deserializer::from_str(&out[json_start..])
            .into_iter()
            .next()
            .expect("a JSON document")
            .expect("valid JSON");
        let fits = plan[0]["fits"].as_bool().expect("fits");
        c.apply(cand).await;
        c.wait("the candidate settled", T, || async {
            c.claim(&name, node).await.is_some_and(|cl| settled(&cl))
        })
        .await;
        let claim = c.claim(&name, node).await.unwrap();
        let admitted = matches!(
            claim.status.phase,
            ClaimPhase::Admitted | ClaimPhase::Published
        );
        assert_eq!(
            fits, admitted,
            "round {round}: plan said fits={fits} for {name} ({v} {m:?}, ro={ro}) on {node}: {plan}; \
             the controller: {:?} {:?}",
            claim.status.phase, claim.status.reason
        );
        if fits {
            agreed_fit += 1;
        } else {
            agreed_no += 1;
        }
        // Kept as a holder now and then, else gone again.
        if admitted && rng.u32(..3) == 0 {
            live.push((name, node.to_string()));
        } else {
            c.stop_alloc(&name).await;
            c.wait_claim(&name, node, ClaimPhase::Released, T).await;
        }
    }
    eprintln!("plan walk: {agreed_fit} fits and {agreed_no} refusals agreed");
    assert!(
        agreed_fit > 0 && agreed_no > 0,
        "the walk tried both answers"
    );
}

/// The allocation reconciler's own status write comes back to it (the runtime does not
/// filter a process's own writes out of its watches): that pass must find nothing to do.
/// Counted by the controller's reconciles and by etcd's own count of writes to each
/// allocation, up to a later allocation's settling as the marker that every earlier
/// watch event was delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allocation_s_own_status_write_costs_one_quiet_pass() {
    let http = format!("127.0.0.1:{}", common::free_port());
    let opts = PluginOpts {
        controller_args: vec![format!("--http={http}")],
        ..Default::default()
    };
    let c = Cluster::start(1, 2, opts).await;
    c.apply(c.volume("v1", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v1").await;
    let puts = common::count_puts(&c.etcd.client_url, "/moor/allocations/").await;
    let reconciles = || async {
        let page = common::http_get(&http, "/metrics").await;
        common::metric(&page, r#"moor_reconciles_total{controller="allocations"}"#).unwrap_or(0.0)
    };
    let phase = |name: &'static str| {
        let c = &c;
        async move {
            c.store
                .try_get(&Allocation::key_for(&Namespace::default_ns(), name))
                .await
                .ok()
                .flatten()
                .map(|a| a.status.phase)
        }
    };
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait("a1 Ready", Duration::from_secs(30), || async {
        phase("a1").await == Some(AllocationPhase::Ready)
    })
    .await;
    let writes = |name: &str| {
        let key = format!("/moor/allocations/default/{name}");
        puts.lock().unwrap().get(&key).copied().unwrap_or(0)
    };
    let a1_writes = writes("a1");
    let before = reconciles().await;
    // Two markers with no requests: each is created (one pass) and writes its phase
    // once (which brings one more pass, which must write nothing).
    for name in ["m1", "m2"] {
        c.apply(Allocation::new(
            &Namespace::default_ns(),
            Name::new(name).unwrap(),
            AllocationSpec {
                node: NodeName::new("n2").unwrap(),
                ..Default::default()
            },
        ))
        .await;
        c.wait(
            &format!("{name} written twice"),
            Duration::from_secs(30),
            || async { writes(name) >= 2 },
        )
        .await;
    }
    c.wait("m1's passes", Duration::from_secs(30), || async {
        reconciles().await >= before + 3.0
    })
    .await;
    assert_eq!(writes("m1"), 2, "m1: its creation and one status write");
    assert_eq!(phase("m1").await, Some(AllocationPhase::Ready));
    assert_eq!(writes("a1"), a1_writes, "a1 settled: not written again");
    // Per object, not a process-wide count in a window: m2's pass brought by its own
    // status write also wrote nothing, however the passes interleaved.
    c.wait("m2's passes", Duration::from_secs(30), || async {
        reconciles().await >= before + 4.0
    })
    .await;
    assert_eq!(writes("m2"), 2, "m2: its creation and one status write");
    assert_eq!(writes("m1"), 2, "m1 not written again");
}

/// Issue 49, item 7: a `setsid` child escaped the workload's process group and wrote on
/// after its claim was released. The workload runs in a cgroup of its own (cgroup v2),
/// so the child is ended before the claim leaves Published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_setsid_child_is_ended_before_the_claim_leaves_published() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = cluster().await;
    let pidfile = c.dir.path().join("escaped.pid");
    let script = format!(
        "setsid sh -c 'echo $$ > {p}; exec sleep 300' & while [ ! -s {p} ]; do sleep 0.05; done; exit 0",
        p = pidfile.display()
    );
    let out = run(
        &c,
        &[
            "esc", "--node", "n2", "--volume", "data=v1", "--", "sh", "-c", &script,
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("without a cgroup of its own"),
        "the cgroup path must run here (CI runs as root with cgroup2): {out:?}"
    );
    let pid = std::fs::read_to_string(&pidfile).unwrap();
    assert!(
        !std::path::Path::new(&format!("/proc/{}", pid.trim())).exists(),
        "the setsid child {pid} outlived the release"
    );
    assert_eq!(
        c.claim("esc", "n2").await.unwrap().status.phase,
        ClaimPhase::Released
    );
    c.check_calls(true);
}

/// Issue 49, item 7: `kill -9` of both moorctl processes (the runner and its guard)
/// left the workload's `setsid` child running while the controller released the claim
/// as lost. The runner records the workload's cgroup on the allocation; the node's
/// agent kills what is left in it before NodeUnpublish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workload_whose_runner_and_guard_were_killed_is_ended_by_the_agent() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = cluster().await;
    let guard = c.dir.path().join("guard.pid");
    let escaped = c.dir.path().join("escaped.pid");
    // The workload's parent is the guard; its setsid child leaves the process group.
    let script = format!(
        "echo $PPID > {g}; setsid sh -c 'echo $$ > {e}; exec sleep 300' & while [ ! -s {e} ]; do sleep 0.05; done; echo started; while :; do sleep 0.1; done",
        g = guard.display(),
        e = escaped.display()
    );
    let mut runner = start(&c, "k9", "n2", &["--lease-ttl", "3s"], &script);
    let read_pid = |p: &std::path::Path| std::fs::read_to_string(p).unwrap().trim().to_string();
    let (guard_pid, escaped_pid) = (read_pid(&guard), read_pid(&escaped));
    // A killed process whose reaper is gone stays a zombie (state Z) until init reaps
    // it: it runs no more.
    let alive = |pid: &str| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
            stat.rsplit_once(") ")
                .is_some_and(|(_, rest)| !rest.starts_with('Z'))
        })
    };
    assert!(alive(&escaped_pid));
    let recorded = allocation(&c, "k9").await.spec.workload_cgroup;
    assert!(
        recorded.is_some(),
        "the workload's cgroup is on the allocation (CI runs as root with cgroup2)"
    );
    // Both moorctl processes at once, the guard first: nobody of moorctl ends anything.
    let ok = Command::new("kill")
        .args(["-KILL", &guard_pid, &runner.id().to_string()])
        .status()
        .expect("kill")
        .success();
    assert!(ok, "kill -9 the guard and the runner");
    let _ = runner.wait();
    // The node's acknowledgement of the teardown (its Mount released, after
    // NodeUnpublish and NodeUnstage): the agent ends what is left in the cgroup before
    // NodeUnpublish, so by then nothing of it runs. (Not the claim leaving Published:
    // the controller's write that orders the release also marks it Releasing, before
    // the node has acted; under load the test could look in between.)
    let mount = Mount::key_for(&Claim::key_for(
        &NodeName::new("n2").unwrap(),
        &Namespace::default_ns(),
        "k9.data",
    ));
    c.wait(
        "n2 acknowledges the teardown of k9's claim",
        Duration::from_secs(60),
        || async {
            match c.store.try_get(&mount).await {
                Ok(Some(m)) => m.status.released,
                Ok(None) => true,
                Err(_) => false,
            }
        },
    )
    .await;
    if alive(&escaped_pid) {
        c.dump_logs();
        eprintln!("{:#?}", c.claim("k9", "n2").await);
        panic!("the workload's setsid child {escaped_pid} outlived both moorctl processes into the release");
    }
    c.wait_claim("k9", "n2", ClaimPhase::Released, T).await;
    let claim = c.claim("k9", "n2").await.unwrap();
    assert_eq!(
        claim.spec.workload_cgroup.as_deref().map(String::as_str),
        recorded.as_deref(),
        "copied at release"
    );
    c.check_calls(true);
}

/// Issue 77, item 3: a workload's cgroup is the one its own allocation made. An
/// allocation of another namespace on the same node names k9's recorded cgroup (a
/// writer copies it from the allocation it may read); its release must not signal
/// anything in it, while k9's runner and workload go on. Before the owner tag, the
/// agent killed k9's workload at the forger's release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cgroup_named_by_another_namespace_s_allocation_is_never_signalled() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = cluster().await;
    let pidfile = c.dir.path().join("victim.pid");
    let script = format!(
        "echo $$ > {p}; trap 'exit 0' TERM; echo started; while :; do sleep 0.1; done",
        p = pidfile.display()
    );
    // Ended (SIGTERM, then waited for) however the test ends: nothing left running.
    struct Ends(Child);
    impl Drop for Ends {
        fn drop(&mut self) {
            if self.0.try_wait().ok().flatten().is_none() {
                let _ = Command::new("kill")
                    .args(["-TERM", &self.0.id().to_string()])
                    .status();
                let _ = self.0.wait();
            }
        }
    }
    let mut runner = Ends(start(&c, "k9", "n2", &[], &script));
    let victim = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .to_string();
    let recorded = allocation(&c, "k9")
        .await
        .spec
        .workload_cgroup
        .expect("the workload's cgroup is on the allocation (CI runs as root with cgroup2)");
    let alive = |pid: &str| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
            stat.rsplit_once(") ")
                .is_some_and(|(_, rest)| !rest.starts_with('Z'))
        })
    };
    // The forger: namespace b, its own volume, an allocation on n2 naming k9's cgroup.
    let b = Namespace::new("b").unwrap();
    let mut vol = c.volume("bv", AccessMode::SingleNodeWriter);
    vol.metadata.namespace = b.clone();
    c.apply(vol).await;
    let mut evil = c.allocation("evil", "n2", "bv", false);
    evil.metadata.namespace = b.clone();
    evil.spec.client_status = ClientStatus::Running;
    evil.spec.workload_cgroup = Some(recorded.clone());
    let evil = c.apply(evil).await.object_key();
    let claim = Claim::key_for(&NodeName::new("n2").unwrap(), &b, "evil.data");
    c.wait("evil's claim is published", T, || async {
        c.store
            .try_get(&claim)
            .await
            .ok()
            .flatten()
            .is_some_and(|cl| cl.status.phase == ClaimPhase::Published)
    })
    .await;
    // The forger ends its allocation: the controller copies the named cgroup onto the
    // claim it releases, and n2's agent tears it down.
    c.store
        .modify_spec(&evil, |s| {
            s.client_status = ClientStatus::Failed;
            true
        })
        .await
        .expect("end evil");
    c.wait("evil's claim is released", T, || async {
        c.store
            .try_get(&claim)
            .await
            .ok()
            .flatten()
            .is_some_and(|cl| {
                cl.status.phase == ClaimPhase::Released
                    && cl.spec.workload_cgroup.as_deref() == Some(&recorded)
            })
    })
    .await;
    let survived = alive(&victim);
    // k9's own end, by its runner (SIGTERM), whatever the outcome: nothing left running.
    signal(&runner.0, "-TERM");
    let status = runner.0.wait().expect("wait for k9's runner");
    assert!(
        survived,
        "k9's workload {victim} was killed by another namespace's release"
    );
    assert_eq!(status.code(), Some(0), "k9's workload chose its own exit");
    c.wait_claim("k9", "n2", ClaimPhase::Released, T).await;
    c.check_calls(true);
}

/// Issue 78, item 1: a stop is graceful. `moorctl alloc stop` makes the runner send the
/// workload SIGTERM once; its trap runs with the volume still mounted (the claims stay
/// until the runner records the end) and the exit it chose is recorded. A trap that
/// sleeps past the allocation's kill timeout is killed (SIGKILL) at it: one SIGTERM
/// counted, the end no sooner than the timeout. Both with the workload in a cgroup of
/// its own and without (the runner in a mount namespace whose /sys/fs/cgroup is not
/// cgroup2, where it falls back to the process group).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_sends_sigterm_keeps_the_volume_until_the_end_and_kills_at_the_kill_timeout() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = cluster().await;
    let no_children = NoChildren::new();
    // (in a cgroup, the trap too slow, stopped by SIGTERM to the runner as `systemctl
    // stop` does rather than by `alloc stop`)
    for (cgroup, slow, by_signal) in [
        (true, false, false),
        (true, true, false),
        (false, false, false),
        (false, true, false),
        (true, false, true),
        (true, true, true),
    ] {
        let name = format!(
            "{}{}{}",
            if slow { "s" } else { "g" },
            if cgroup { "c" } else { "p" },
            if by_signal { "t" } else { "" }
        );
        let log = c.dir.path().join(format!("{name}.log"));
        let trap = if slow {
            format!("echo TERM >> {l}; sleep 100", l = log.display())
        } else {
            format!(
                "echo TERM >> {l}; sleep 1; test -f \"$MOOR_VOLUME_DATA/mark-{name}\" && echo mounted >> {l}; exit 7",
                l = log.display()
            )
        };
        let script = format!(
            "echo x > \"$MOOR_VOLUME_DATA/mark-{name}\"; trap '{trap}' TERM; echo started; while :; do sleep 0.1; done"
        );
        let moorctl = common::bin("moorctl");
        let mut cmd = if cgroup {
            Command::new(&moorctl)
        } else {
            // The runner in a cgroup that may have no child (max.descendants 0):
            // it cannot make the workload's, and falls back to the process group.
            let mut cmd = Command::new("sh");
            cmd.args([
                "-c",
                "echo $$ > \"$1/cgroup.procs\" && shift && exec \"$@\"",
                "sh",
            ])
            .arg(no_children.path())
            .arg(&moorctl);
            cmd
        };
        cmd.arg(format!("--endpoints={}", c.etcd.client_url))
            .args(["alloc", "run", &name, "--node", "n1", "--volume", "data=v1"])
            .args(["--kill-timeout", "2s", "--", "sh", "-c", &script])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn moorctl alloc run");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "started", "{name}: the workload runs");
        if by_signal {
            let runner = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
            rustix::process::kill_process(runner, rustix::process::Signal::TERM).unwrap();
        } else {
            let (ok, out) = c.moorctl(&["alloc", "stop", &name]);
            assert!(ok && out.contains("SIGTERM"), "{out}");
        }
        let stopped = std::time::Instant::now();
        let runner = child.id();
        let ended = tokio::time::timeout(
            T,
            tokio::task::spawn_blocking(move || child.wait_with_output().unwrap()),
        )
        .await;
        let Ok(out) = ended else {
            // Its guard ends the workload when the runner dies.
            let _ = Command::new("kill")
                .args(["-KILL", &runner.to_string()])
                .status();
            panic!("{name}: the runner did not end within {T:?} of the stop");
        };
        let out = out.unwrap();
        let took = stopped.elapsed();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            stderr.contains("without a cgroup of its own"),
            !cgroup,
            "{name}: {stderr}"
        );
        let said = std::fs::read_to_string(&log).unwrap_or_default();
        assert_eq!(
            said.matches("TERM").count(),
            1,
            "{name}: one SIGTERM: {said:?}"
        );
        let a = allocation(&c, &name).await;
        let exit = a.spec.exit.clone().unwrap_or_default();
        if slow {
            assert_eq!(out.status.code(), Some(137), "{name}: {stderr}");
            assert_eq!(exit.signal.as_deref(), Some("SIGKILL"), "{name}");
            assert!(
                took >= Duration::from_secs(2),
                "{name}: killed after {took:?}"
            );
            assert!(
                stderr.contains("did not end within its kill timeout"),
                "{stderr}"
            );
        } else {
            assert_eq!(out.status.code(), Some(7), "{name}: {stderr}");
            assert_eq!(exit.code, Some(7), "{name}");
            assert!(
                said.contains("mounted"),
                "{name}: the trap ran without its volume: {said:?}"
            );
        }
        assert_eq!(a.spec.client_status, ClientStatus::Failed, "{name}");
        assert_eq!(
            c.claim(&name, "n1").await.unwrap().status.phase,
            ClaimPhase::Released,
            "{name}"
        );
    }
    // A stop nobody carries out (no runner: the allocation says `running` itself, with
    // no lease): its claims stay for its kill timeout, then go, with a Warning.
    let mut a = c.allocation("nr", "n1", "v1", false);
    a.spec.client_status = ClientStatus::Running;
    a.spec.kill_timeout = Some("6s".into());
    c.apply(a).await;
    c.wait_claim("nr", "n1", ClaimPhase::Published, T).await;
    let (ok, out) = c.moorctl(&["alloc", "stop", "nr"]);
    assert!(ok, "{out}");
    let stopped = std::time::Instant::now();
    common::wait_for("the stop seen", T, || async {
        allocation(&c, "nr").await.status.stop_seen_at.is_some()
    })
    .await;
    assert_eq!(
        c.claim("nr", "n1").await.unwrap().status.phase,
        ClaimPhase::Published,
        "released before the kill timeout"
    );
    c.wait_claim("nr", "n1", ClaimPhase::Released, T).await;
    assert!(
        stopped.elapsed() >= Duration::from_secs(6),
        "{:?}",
        stopped.elapsed()
    );
    assert!(allocation(&c, "nr").await.status.stop_expired);
    let (ok, out) = c.moorctl(&["describe", "allocation", "nr"]);
    assert!(
        ok && out.contains("Allocation stopping") && out.contains("Allocation stop expired"),
        "{out}"
    );
    c.check_calls(true);
}

/// A cgroup2 cgroup that may have no child cgroup (`cgroup.max.descendants` 0), removed
/// when dropped (its processes have ended by then).
struct NoChildren(std::path::PathBuf);

impl NoChildren {
    fn new() -> NoChildren {
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
        let root = mounts
            .lines()
            .find_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f.get(2) == Some(&"cgroup2")).then(|| f[1].to_string())
            })
            .expect("a cgroup2 hierarchy (CI runs as root with one)");
        let dir =
            std::path::Path::new(&root).join(format!("moor-test-nochild-{}", std::process::id()));
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("cgroup.max.descendants"), "0").unwrap();
        NoChildren(dir)
    }

    fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for NoChildren {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}
