//! Volumes made for the workload (issue 41): an allocation's request carries a
//! template, and the controller makes the volume in the topology of the allocation's
//! node. Each test runs etcd, a `moord controller` and per node a `moord agent` with
//! its moor-hostpath; the controller instance (n1) serves two segments, zone=a (64 MiB)
//! and zone=b (8 MiB), and node n2 is in zone=b.

#[path = "common/cluster.rs"]
mod cluster;
mod common;

use cluster::{Cluster, PluginOpts};
use moor::api::*;
use std::time::Duration;
use tokio::sync::Semaphore;

/// Clusters are several processes each: run two tests at a time on two cores.
static SLOTS: Semaphore = Semaphore::const_new(2);

const T: Duration = Duration::from_secs(30);

fn zoned() -> PluginOpts {
    PluginOpts::zoned()
}

/// An allocation `name` on `node` with request `data` made from a template of
/// `size` with `lifecycle`.
fn templated(name: &str, node: &str, size: &str, lifecycle: &str) -> String {
    format!(
        "apiVersion: moor/v1\nkind: Allocation\nmetadata: {{name: {name}}}\nspec:\n  node: {node}\n  \
         volumes:\n    - name: data\n      template: {{plugin_id: {}, capacity_min: {size}, \
         lifecycle: {lifecycle}}}\n",
        cluster::PLUGIN
    )
}

fn apply_yaml(c: &Cluster, name: &str, yaml: &str) {
    let path = c.dir.path().join(format!("{name}.yaml"));
    std::fs::write(&path, yaml).unwrap();
    let (ok, out) = c.moorctl(&["apply", "-f", path.to_str().unwrap()]);
    assert!(ok, "{out}");
}

async fn volume(c: &Cluster, name: &str) -> Option<Volume> {
    c.store
        .try_get(&Volume::key_for(&Namespace::default_ns(), name))
        .await
        .ok()
        .flatten()
}

/// The volumes the plugin holds.
async fn plugin_volumes(c: &Cluster) -> Vec<String> {
    c.csi()
        .list_volumes(moor::csi::v1::ListVolumesRequest::default())
        .await
        .unwrap()
        .entries
        .into_iter()
        .filter_map(|e| e.volume.map(|v| v.volume_id))
        .collect()
}

async fn delete_alloc(c: &Cluster, name: &str) {
    let (ok, out) = c.moorctl(&["delete", "allocation", name]);
    assert!(ok, "{out}");
    c.wait(&format!("allocation {name} gone"), T, || async {
        c.store
            .try_get(&Allocation::key_for(&Namespace::default_ns(), name))
            .await
            .is_ok_and(|a| a.is_none())
    })
    .await;
}

/// Waits until allocation `name` is Blocked with a reason containing each of `needles`.
async fn wait_blocked(c: &Cluster, name: &str, needles: &[&str]) {
    c.wait(&format!("{name} blocked: {needles:?}"), T, || async {
        c.store
            .try_get(&Allocation::key_for(&Namespace::default_ns(), name))
            .await
            .ok()
            .flatten()
            .is_some_and(|a| {
                a.status.phase == AllocationPhase::Blocked
                    && a.status
                        .meta
                        .last_error
                        .as_deref()
                        .is_some_and(|e| needles.iter().all(|n| e.contains(n)))
            })
    })
    .await;
}

/// The backing directory of volume `name` (moor-hostpath's volume_context path).
async fn backing(c: &Cluster, name: &str) -> std::path::PathBuf {
    let v = volume(c, name).await.expect("the volume");
    std::path::PathBuf::from(v.status.provisioning.volume_context.get("path").unwrap())
}

/// An ephemeral template on a node of segment B: the volume asks for B, is created in
/// B, is published and written to, and once the allocation ends it is deleted through
/// DeleteVolume; nothing is left in the plugin or in etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ephemeral_template_makes_a_volume_in_the_node_s_segment_and_deletes_it_after() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 2, zoned()).await;
    apply_yaml(&c, "a1", &templated("a1", "n2", "1MiB", "ephemeral"));
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    let v = volume(&c, "a1.data").await.expect("the volume made");
    let zone_b: Topology = [("zone".to_string(), "b".to_string())].into();
    let asked = v
        .spec
        .topology_request
        .as_deref()
        .expect("a topology request");
    assert_eq!(asked.required, std::slice::from_ref(&zone_b));
    assert_eq!(v.status.provisioning.accessible_topology, [zone_b]);
    let made = v.spec.made_for.as_deref().expect("made_for");
    assert_eq!(
        (
            made.allocation.as_str(),
            made.request.as_str(),
            made.lifecycle
        ),
        ("a1", "data", VolumeLifecycle::Ephemeral)
    );
    let (ok, out) = c.moorctl(&["get", "volumes"]);
    assert!(ok && out.contains("a1/data (ephemeral)"), "{out}");
    // The workload writes.
    std::fs::write(backing(&c, "a1.data").await.join("data"), b"x").unwrap();
    if cluster::can_mount() {
        let m = c
            .store
            .try_get(&Mount::key_for(&Claim::key_for(
                &cluster::node("n2"),
                &Namespace::default_ns(),
                "a1.data",
            )))
            .await
            .unwrap()
            .unwrap();
        std::fs::write(std::path::Path::new(&m.spec.target_path).join("w"), b"w").unwrap();
    }

    c.stop_alloc("a1").await;
    c.wait("the volume deleted", T, || async {
        volume(&c, "a1.data").await.is_none()
    })
    .await;
    assert_eq!(c.node("n1").count("CreateVolume", "OK"), 1);
    assert_eq!(c.node("n1").count("DeleteVolume", "OK"), 1);
    assert!(plugin_volumes(&c).await.is_empty());
    c.check_calls(true);
}

/// Retain: the volume outlives its allocation, and the next allocation of the same
/// name gets it back with its data; a template that changed more than its size is
/// refused with the reason. Each allocation of another name gets its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retained_template_volume_goes_to_the_next_allocation_of_the_same_name() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 2, zoned()).await;
    apply_yaml(&c, "db", &templated("db", "n2", "1MiB", "retain"));
    c.wait_claim("db", "n2", ClaimPhase::Published, T).await;
    let first = volume(&c, "db.data").await.unwrap();
    std::fs::write(backing(&c, "db.data").await.join("rows"), b"42").unwrap();
    delete_alloc(&c, "db").await;
    // Kept, with its data.
    let kept = volume(&c, "db.data").await.expect("retained");
    assert!(!kept.is_deleting());
    assert_eq!(c.node("n1").tried("DeleteVolume"), 0);

    // The same name again, asking for more: the same volume, grown, its data there.
    apply_yaml(&c, "db", &templated("db", "n2", "2MiB", "retain"));
    c.wait_claim("db", "n2", ClaimPhase::Published, T).await;
    let again = volume(&c, "db.data").await.unwrap();
    assert_eq!(again.metadata.uid, first.metadata.uid);
    assert_eq!(
        again.status.provisioning.external_id,
        first.status.provisioning.external_id
    );
    assert_eq!(
        std::fs::read(backing(&c, "db.data").await.join("rows")).unwrap(),
        b"42"
    );
    c.wait("grown to 2 MiB", T, || async {
        volume(&c, "db.data")
            .await
            .is_some_and(|v| v.status.provisioning.capacity_bytes == Some(2 << 20))
    })
    .await;
    assert_eq!(c.node("n1").count("CreateVolume", "OK"), 1);

    // Another name: its own volume.
    for name in ["web-0", "web-1"] {
        apply_yaml(&c, name, &templated(name, "n2", "1MiB", "retain"));
        c.wait_claim(name, "n2", ClaimPhase::Published, T).await;
    }
    assert_eq!(c.node("n1").count("CreateVolume", "OK"), 3);

    // A template that changes what cannot change: refused, the volume untouched.
    delete_alloc(&c, "web-0").await;
    let other = format!(
        "apiVersion: moor/v1\nkind: Allocation\nmetadata: {{name: web-0}}\nspec:\n  node: n2\n  \
         volumes:\n    - name: data\n      template: {{plugin_id: {}, capacity_min: 1MiB, \
         parameters: {{tier: gold}}, lifecycle: retain}}\n",
        cluster::PLUGIN
    );
    apply_yaml(&c, "web-0b", &other);
    wait_blocked(&c, "web-0", &["parameters"]).await;
    // Deleting a retained volume is the operator's act: with its allocation
    // (`delete allocation --volumes`), or by itself.
    let (ok, out) = c.moorctl(&["delete", "allocation", "db", "--volumes"]);
    assert!(ok && out.contains("volume db.data"), "{out}");
    for a in ["web-1", "web-0"] {
        delete_alloc(&c, a).await;
    }
    for v in ["web-0.data", "web-1.data"] {
        let (ok, out) = c.moorctl(&["delete", "volume", v]);
        assert!(ok, "{out}");
    }
    c.wait("every volume gone", T, || async {
        plugin_volumes(&c).await.is_empty()
    })
    .await;
    c.check_calls(true);
}

/// Capacity: a template too big for its node's segment is refused by `alloc plan` and
/// by the controller with the same reason, and nothing is created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_too_big_for_its_node_s_segment_is_refused_by_plan_and_admission() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 2, zoned()).await;
    let id = PluginId::new(cluster::PLUGIN).unwrap();
    c.wait("zone b's capacity reported", T, || async {
        c.store.capacity(&id).await.ok().flatten().is_some_and(|r| {
            r.iter()
                .any(|e| e.topology.get("zone").map(String::as_str) == Some("b"))
        })
    })
    .await;
    let big = templated("big", "n2", "16MiB", "ephemeral");
    let file = c.dir.path().join("big.yaml");
    std::fs::write(&file, &big).unwrap();
    let (ok, plan) = c.moorctl(&[
        "alloc",
        "plan",
        "-f",
        file.to_str().unwrap(),
        "--node",
        "n2",
    ]);
    assert!(!ok, "{plan}");
    assert!(plan.contains("in segment zone=b"), "{plan}");
    // The same template fits n1's segment.
    let (ok, plan_a) = c.moorctl(&[
        "alloc",
        "plan",
        "-f",
        file.to_str().unwrap(),
        "--node",
        "n1",
    ]);
    assert!(ok, "{plan_a}");

    apply_yaml(&c, "big", &big);
    wait_blocked(&c, "big", &["in segment zone=b"]).await;
    assert!(volume(&c, "big.data").await.is_none());
    assert_eq!(c.node("n1").tried("CreateVolume"), 0);
}

/// The controller and the agent leading the plugin killed while CreateVolume has taken
/// effect but not answered: after they restart, exactly one volume exists, in moor and
/// in the plugin (the volume's name is the allocation's and the request's, and
/// CreateVolume is named by the volume's namespace, name and uid), and the claim is published on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_killed_while_a_template_s_volume_is_made_leaves_exactly_one() {
    use moor_hostpath::faults::Command;
    let _slot = SLOTS.acquire().await.unwrap();
    let mut c = Cluster::start(1, 2, zoned()).await;
    c.node("n1")
        .fault(Command::Hang {
            rpc: "CreateVolume".into(),
            after: true,
        })
        .await;
    apply_yaml(&c, "k1", &templated("k1", "n2", "1MiB", "ephemeral"));
    let n1 = c.node("n1");
    c.wait("CreateVolume to take effect and hang", T, || async move {
        n1.hanging("CreateVolume").await > 0
    })
    .await;
    assert!(volume(&c, "k1.data").await.is_some());
    c.controllers[0].kill();
    c.node_mut("n1").agent.kill();
    c.node("n1")
        .fault(Command::Release {
            rpc: "CreateVolume".into(),
        })
        .await;
    c.controllers[0].restart();
    c.node_mut("n1").agent.restart();
    c.wait_claim("k1", "n2", ClaimPhase::Published, Duration::from_secs(60))
        .await;
    let volumes = c
        .store
        .list::<VolumeSpec>(&KeyScope::all())
        .await
        .unwrap()
        .items;
    assert_eq!(volumes.len(), 1, "one Volume object");
    assert_eq!(
        plugin_volumes(&c).await.len(),
        1,
        "one volume in the plugin"
    );
    c.stop_alloc("k1").await;
    c.wait("the volume deleted", T, || async {
        plugin_volumes(&c).await.is_empty() && volume(&c, "k1.data").await.is_none()
    })
    .await;
    c.check_calls(true);
}

/// 100 workloads in a row through `moorctl alloc run`, each with a fresh ephemeral
/// volume: 100 CreateVolume, 100 DeleteVolume, and no volume left in the plugin or in
/// etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_alloc_runs_with_fresh_volumes_leave_nothing_behind() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 1, PluginOpts::default()).await;
    const RUNS: usize = 100;
    for i in 0..RUNS {
        let name = format!("e{i}");
        let out = std::process::Command::new(common::bin("moorctl"))
            .arg(format!("--endpoints={}", c.etcd.client_url))
            .args(["alloc", "run", &name, "--node", "n1"])
            .args(["--volume", "scratch=new:1MiB"])
            .args(["--", "sh", "-c", "test -n \"$MOOR_VOLUME_SCRATCH\""])
            .output()
            .expect("run moorctl alloc run");
        assert!(
            out.status.success(),
            "run {i}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    c.wait("every volume deleted", Duration::from_secs(120), || async {
        c.store
            .list::<VolumeSpec>(&KeyScope::all())
            .await
            .is_ok_and(|l| l.items.is_empty())
            && plugin_volumes(&c).await.is_empty()
    })
    .await;
    assert_eq!(c.node("n1").count("CreateVolume", "OK"), RUNS);
    assert_eq!(c.node("n1").count("DeleteVolume", "OK"), RUNS);
    c.check_calls(true);
}

/// A template whose CreateVolume fails for good blocks its allocation with the
/// plugin's reason, shown by `describe`; no claim is published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_the_plugin_refuses_blocks_its_allocation_with_the_reason() {
    use moor_hostpath::faults::Command;
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 2, zoned()).await;
    c.node("n1")
        .fault(Command::Fail {
            rpc: "CreateVolume".into(),
            code: "InvalidArgument".into(),
            times: 100,
        })
        .await;
    apply_yaml(&c, "f1", &templated("f1", "n2", "1MiB", "ephemeral"));
    wait_blocked(&c, "f1", &["request data:", "injected fault"]).await;
    let (ok, out) = c.moorctl(&["describe", "allocation", "f1"]);
    assert!(ok && out.contains("injected fault"), "{out}");
    assert_eq!(c.node("n1").count("CreateVolume", "InvalidArgument"), 1);
    assert_eq!(c.node("n2").tried("NodePublishVolume"), 0);
}

/// Issue 49, item 10: `alloc run` printed `Blocked; scratch: no claim yet` until its
/// timeout while the reason sat in the allocation's status. Now it says why, and a
/// template refused for good (no room in the node's segment) ends the run at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alloc_run_says_why_a_template_is_blocked_and_does_not_wait_for_its_timeout() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 2, zoned()).await;
    let capacity = PluginId::new(cluster::PLUGIN).unwrap();
    c.wait("zone b's capacity reported", T, || async {
        c.store
            .capacity(&capacity)
            .await
            .ok()
            .flatten()
            .is_some_and(|r| {
                r.iter()
                    .any(|e| e.topology.get("zone").map(String::as_str) == Some("b"))
            })
    })
    .await;
    let out = std::process::Command::new(common::bin("moorctl"))
        .arg(format!("--endpoints={}", c.etcd.client_url))
        .args(["alloc", "run", "big", "--node", "n2", "--timeout", "5m"])
        .args(["--volume", "scratch=new:16MiB", "--", "true"])
        .output()
        .expect("run moorctl alloc run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("request scratch is blocked") && stderr.contains("zone=b"),
        "{stderr}"
    );
    // Its own refusal, not the timeout's (which would say "timed out after 5m").
    assert!(!stderr.contains("timed out"), "{stderr}");
    assert!(c.all_claims_released().await);
}

/// Issue 78, item 7: `alloc run --volume REQ=new:SIZE` without `plugin=` takes the
/// default VolumeClass (its plugin and parameters), as an applied template does; it
/// took the node's plugin and ignored the class.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alloc_run_s_new_volume_takes_the_default_class() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 1, PluginOpts::default()).await;
    apply_yaml(
        &c,
        "std",
        &format!(
            "kind: VolumeClass\nmetadata: {{name: std}}\nspec: {{plugin_id: {}, parameters: {{tier: ssd}}, default: true}}\n",
            cluster::PLUGIN
        ),
    );
    let out = std::process::Command::new(common::bin("moorctl"))
        .arg(format!("--endpoints={}", c.etcd.client_url))
        .args(["alloc", "run", "k", "--node", "n1"])
        .args(["--volume", "scratch=new:1MiB,retain", "--", "true"])
        .output()
        .expect("run moorctl alloc run");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let made = volume(&c, "k.scratch").await.expect("the retained volume");
    assert_eq!(
        made.spec.parameters.get("tier").map(String::as_str),
        Some("ssd"),
        "{:?}",
        made.spec
    );
    assert_eq!(made.spec.plugin_id.as_str(), cluster::PLUGIN);
}
