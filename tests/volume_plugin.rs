//! The Docker volume-plugin endpoint (issue 38) at its socket: a real etcd, `moord
//! controller`, agents serving `--volume-plugin` and moor-hostpath; requests are sent
//! as Docker and Podman send them, and the plugins' call logs are checked against the
//! invariants.

#[path = "common/cluster.rs"]
mod cluster;
mod common;

use cluster::{Cluster, PLUGIN};
use common::post_raw;
use moor::api::*;
use moor_hostpath::faults::Command;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

/// The endpoint's socket of node `name`.
fn socket(c: &Cluster, name: &str) -> PathBuf {
    c.volume_plugin_socket(name)
}

/// A verb as Podman sends it (its content type); the answer.
async fn call(c: &Cluster, node: &str, verb: &str, body: Value) -> (u16, Value) {
    post_raw(
        &socket(c, node),
        &format!("/VolumeDriver.{verb}"),
        Some("application/vnd.docker.plugins.v1.1+json"),
        body.to_string().as_bytes(),
    )
    .await
}

/// A verb that must succeed; its answer.
async fn ok(c: &Cluster, node: &str, verb: &str, body: Value) -> Value {
    let started = std::time::Instant::now();
    let (status, v) = call(c, node, verb, body.clone()).await;
    eprintln!("{verb} {body} answered in {:?}", started.elapsed());
    assert_eq!(status, 200, "{verb} {body}: {v}");
    assert!(
        v.get("Err").is_none_or(|e| e.as_str() == Some("")),
        "{verb}: {v}"
    );
    v
}

/// A verb that must fail with a message containing `needle`.
async fn refused(c: &Cluster, node: &str, verb: &str, body: Value, needle: &str) {
    let started = std::time::Instant::now();
    let (status, v) = call(c, node, verb, body.clone()).await;
    eprintln!("{verb} {body} refused in {:?}: {v}", started.elapsed());
    let err = v["Err"].as_str().unwrap_or_default();
    assert!(
        status != 200 && err.contains(needle),
        "{verb} {body}: {status} {v}"
    );
}

async fn claims(c: &Cluster) -> Vec<Claim> {
    c.store
        .list(&KeyScope::<ClaimSpec>::all())
        .await
        .unwrap()
        .items
}

async fn volumes(c: &Cluster) -> Vec<String> {
    c.store
        .list(&KeyScope::<VolumeSpec>::all())
        .await
        .unwrap()
        .items
        .iter()
        .map(|v| v.metadata.name.to_string())
        .collect()
}

async fn start() -> Cluster {
    Cluster::start_volume_plugin(&[]).await
}

async fn start_with(more: &[&str]) -> Cluster {
    Cluster::start_volume_plugin(more).await
}

/// Issue 41, item 4: `docker volume create` on a node makes the volume where that node
/// can use it, by the rules of a template's volume: its segment as the requisite
/// topology, and a size the plugin reports no room for in that segment is refused
/// with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_created_at_a_node_s_endpoint_is_made_in_that_node_s_segment() {
    let c = Cluster::start_volume_plugin_with(cluster::PluginOpts::zoned()).await;
    let id = PluginId::new(PLUGIN).unwrap();
    c.wait("zone b's capacity reported", T, || async {
        c.store.capacity(&id).await.ok().flatten().is_some_and(|r| {
            r.iter()
                .any(|e| e.topology.get("zone").map(String::as_str) == Some("b"))
        })
    })
    .await;
    ok(
        &c,
        "n2",
        "Create",
        json!({"Name": "small", "Opts": {"size": "1MiB"}}),
    )
    .await;
    let zone_b: Topology = [("zone".to_string(), "b".to_string())].into();
    c.wait("small made in zone b", T, || async {
        c.store
            .try_get(&Volume::key_for(&Namespace::default_ns(), "small"))
            .await
            .ok()
            .flatten()
            .is_some_and(|v| {
                v.spec
                    .topology_request
                    .as_deref()
                    .is_some_and(|t| t.required == [zone_b.clone()])
                    && v.status.provisioning.accessible_topology == [zone_b.clone()]
            })
    })
    .await;
    refused(
        &c,
        "n2",
        "Create",
        json!({"Name": "big", "Opts": {"size": "16MiB"}}),
        "in segment zone=b",
    )
    .await;
    assert!(!volumes(&c).await.contains(&"big".to_string()));
    // On n1 (zone a) the same size fits.
    ok(
        &c,
        "n1",
        "Create",
        json!({"Name": "big", "Opts": {"size": "16MiB"}}),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_s_whole_lifecycle_through_the_endpoint() {
    let c = start().await;
    // Docker's first calls: no Content-Type, empty bodies.
    let (status, v) = post_raw(&socket(&c, "n1"), "/Plugin.Activate", None, b"").await;
    assert_eq!((status, v), (200, json!({"Implements": ["VolumeDriver"]})));
    let (status, v) = post_raw(&socket(&c, "n1"), "/VolumeDriver.Capabilities", None, b"{}").await;
    assert_eq!(
        (status, v),
        (200, json!({"Capabilities": {"Scope": "global"}}))
    );

    // Create makes a moor Volume through CreateVolume, preferring n1's topology.
    ok(
        &c,
        "n1",
        "Create",
        json!({"Name": "web", "Opts": {"size": "8MiB"}}),
    )
    .await;
    c.volume_ready("web").await;
    let web = c
        .store
        .get(&Volume::key_for(&Namespace::default_ns(), "web"))
        .await
        .unwrap();
    assert_eq!(web.spec.capacity_min, Some(Size(8 << 20)));
    assert_eq!(web.spec.plugin_id.as_str(), PLUGIN);
    assert_eq!(
        c.node("n1").count("CreateVolume", "OK") + c.node("n2").count("CreateVolume", "OK"),
        1
    );
    // Created again with what it has: fine; with what contradicts it: refused, named.
    ok(
        &c,
        "n2",
        "Create",
        json!({"Name": "web", "Opts": {"size": "4MiB"}}),
    )
    .await;
    refused(
        &c,
        "n2",
        "Create",
        json!({"Name": "web", "Opts": {"mode": "multi-node-multi-writer"}}),
        "option mode=multi-node-multi-writer",
    )
    .await;

    // A container mounts it on n1 and writes.
    let m = ok(&c, "n1", "Mount", json!({"Name": "web", "ID": "c1"})).await;
    let path = PathBuf::from(m["Mountpoint"].as_str().unwrap());
    assert!(path.is_dir(), "{path:?}");
    std::fs::write(path.join("hello"), "kept").unwrap();
    // The same caller again: adopted, one allocation.
    let again = ok(&c, "n1", "Mount", json!({"Name": "web", "ID": "c1"})).await;
    assert_eq!(again["Mountpoint"], m["Mountpoint"]);
    let allocs = c
        .store
        .list(&KeyScope::<AllocationSpec>::all())
        .await
        .unwrap()
        .items;
    assert_eq!(allocs.len(), 1, "{allocs:?}");
    let p = ok(&c, "n1", "Path", json!({"Name": "web"})).await;
    assert_eq!(p["Mountpoint"], m["Mountpoint"]);
    let g = ok(&c, "n1", "Get", json!({"Name": "web"})).await;
    assert_eq!(g["Volume"]["Name"], "web");
    assert_eq!(g["Volume"]["Mountpoint"], m["Mountpoint"]);
    assert_eq!(g["Volume"]["Status"]["phase"], "Ready");
    assert_eq!(g["Volume"]["Status"]["callers"], json!(["c1"]));
    assert_eq!(g["Volume"]["Status"]["published_on"], json!(["n1"]));
    let l = ok(&c, "n2", "List", json!({})).await;
    assert_eq!(l["Volumes"], json!([{"Name": "web"}]));
    // describe names the engine callers that hold it.
    let (okd, out) = c.moorctl(&["describe", "volume", "web"]);
    let callers = out.split("Engine callers:").nth(1).unwrap_or_default();
    assert!(
        okd && callers.contains("c1") && callers.contains("n1"),
        "{out}"
    );

    // n2 asks for it while n1 writes it (single-node-writer): refused, the holder
    // named, nothing left claimed on n2.
    refused(
        &c,
        "n2",
        "Mount",
        json!({"Name": "web", "ID": "c2"}),
        "on node n1",
    )
    .await;
    // Also when n2's engine sends the same ID as n1's (Podman sends one constant ID):
    // n1's caller keeps its allocation.
    refused(
        &c,
        "n2",
        "Mount",
        json!({"Name": "web", "ID": "c1"}),
        "on node n1",
    )
    .await;
    let c1 = alloc_of(&c, "c1").await;
    assert_eq!(c1.spec.node.as_str(), "n1");
    assert!(!c1.is_terminal(), "n2's Mount ended n1's caller");
    c.wait("c2's claim released", T, || async {
        claims(&c)
            .await
            .iter()
            .filter(|cl| cl.spec.node.as_str() == "n2")
            .all(|cl| cl.status.phase == ClaimPhase::Released)
    })
    .await;
    // Removing it while claimed: refused, the claim named.
    refused(
        &c,
        "n1",
        "Remove",
        json!({"Name": "web"}),
        "in use by claim",
    )
    .await;

    // Unmount answers at once; the engine's hold lingers, so a second container
    // started right after (docker run again, a restart policy, Docker's second Mount
    // of one `docker run`) is answered from the publish in place: no CSI call.
    let publishes = c.node("n1").count("NodePublishVolume", "OK");
    ok(&c, "n1", "Unmount", json!({"Name": "web", "ID": "c1"})).await;
    let m3 = ok(&c, "n1", "Mount", json!({"Name": "web", "ID": "c3"})).await;
    assert_eq!(m3["Mountpoint"], m["Mountpoint"]);
    assert_eq!(c.node("n1").count("NodePublishVolume", "OK"), publishes);
    assert_eq!(c.node("n1").count("NodeUnpublishVolume", "OK"), 0);
    let path3 = PathBuf::from(m3["Mountpoint"].as_str().unwrap());
    assert_eq!(
        std::fs::read_to_string(path3.join("hello")).unwrap(),
        "kept"
    );

    // The last Unmount: the hold ends after the linger and the release begins; the
    // detach is held here. A container started meanwhile waits for that release
    // instead of being refused, and answers once it is done.
    for n in ["n1", "n2"] {
        c.node(n)
            .fault(Command::Hang {
                rpc: "ControllerUnpublishVolume".into(),
                after: false,
            })
            .await;
    }
    ok(&c, "n1", "Unmount", json!({"Name": "web", "ID": "c3"})).await;
    c.wait(
        "the hold ended after its linger and unpublished",
        T,
        || async { c.node("n1").count("NodeUnpublishVolume", "OK") == 1 },
    )
    .await;
    let (m6, ()) = tokio::join!(
        ok(&c, "n1", "Mount", json!({"Name": "web", "ID": "c6"})),
        async {
            // The ended hold is replaced by one of the same name, whose claim waits
            // until the ended one's is released.
            c.wait(
                "c6's hold made again, waiting for the release",
                T,
                || async {
                    c.store
                        .list(&KeyScope::<AllocationSpec>::all())
                        .await
                        .unwrap()
                        .items
                        .iter()
                        .any(|a| !a.is_terminal() && a.metadata.labels.values().any(|v| v == "c6"))
                },
            )
            .await;
            assert_eq!(c.node("n1").count("NodePublishVolume", "OK"), publishes);
            for n in ["n1", "n2"] {
                c.node(n)
                    .fault(Command::Release {
                        rpc: "ControllerUnpublishVolume".into(),
                    })
                    .await;
            }
        }
    );
    assert!(
        c.node("n1").count("ControllerUnpublishVolume", "OK")
            + c.node("n2").count("ControllerUnpublishVolume", "OK")
            >= 1,
        "c6 published before the detach completed"
    );
    let path6 = PathBuf::from(m6["Mountpoint"].as_str().unwrap());
    assert_eq!(
        std::fs::read_to_string(path6.join("hello")).unwrap(),
        "kept"
    );
    ok(&c, "n1", "Unmount", json!({"Name": "web", "ID": "c6"})).await;
    // Unmount of a caller it does not know: nothing to do.
    ok(
        &c,
        "n1",
        "Unmount",
        json!({"Name": "web", "ID": "never-mounted"}),
    )
    .await;

    // Remove deletes what Create made, through DeleteVolume, once released.
    c.wait("web's claims released", T, || async {
        let v = c
            .store
            .get(&Volume::key_for(&Namespace::default_ns(), "web"))
            .await
            .unwrap();
        v.status.claims.read_claims.is_empty() && v.status.claims.write_claims.is_empty()
    })
    .await;
    ok(&c, "n1", "Remove", json!({"Name": "web"})).await;
    c.wait("web deleted", T, || async { volumes(&c).await.is_empty() })
        .await;
    assert_eq!(
        c.node("n1").count("DeleteVolume", "OK") + c.node("n2").count("DeleteVolume", "OK"),
        1
    );

    // A volume the operator made is used, and Remove only forgets it.
    c.apply(c.volume("ops", AccessMode::MultiNodeMultiWriter))
        .await;
    c.volume_ready("ops").await;
    let a = ok(&c, "n1", "Mount", json!({"Name": "ops", "ID": "c4"})).await;
    let b = ok(&c, "n2", "Mount", json!({"Name": "ops", "ID": "c5"})).await;
    assert!(a["Mountpoint"].as_str().is_some() && b["Mountpoint"].as_str().is_some());
    ok(&c, "n1", "Unmount", json!({"Name": "ops", "ID": "c4"})).await;
    ok(&c, "n2", "Unmount", json!({"Name": "ops", "ID": "c5"})).await;
    c.wait("ops released", T, || async {
        let v = c
            .store
            .get(&Volume::key_for(&Namespace::default_ns(), "ops"))
            .await
            .unwrap();
        v.status.claims.read_claims.is_empty() && v.status.claims.write_claims.is_empty()
    })
    .await;
    ok(&c, "n1", "Remove", json!({"Name": "ops"})).await;
    assert_eq!(volumes(&c).await, ["ops"], "an operator's volume is kept");
    c.wait("every claim released", T, || async {
        c.all_claims_released().await
    })
    .await;
    c.check_calls(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_at_the_socket_is_refused_by_name_and_writes_nothing() {
    let c = start().await;
    let sock = socket(&c, "n1");
    for (verb, body, needle) in [
        (
            "Create",
            json!({"Name": "v", "Opts": {"colour": "red"}}),
            "unknown option colour",
        ),
        (
            "Create",
            json!({"Name": "v", "Opts": {"size": "lots"}}),
            "option size=lots",
        ),
        (
            "Create",
            json!({"Name": "v", "Opts": {"type": "block"}}),
            "block",
        ),
        (
            "Create",
            json!({"Name": "../etc", "Opts": {}}),
            "volume name",
        ),
        ("Create", json!({"Name": 7}), "invalid type: integer"),
        ("Create", json!({}), "missing field `Name`"),
        ("Mount", json!({"Name": "v"}), "missing field `ID`"),
        (
            "Mount",
            json!({"Name": "nope", "ID": "c1"}),
            "no such volume nope",
        ),
        ("Mount", json!({"Name": "nope", "ID": "a b"}), "ID"),
        ("Get", json!({"Name": "nope"}), "no such volume nope"),
        ("Frobnicate", json!({}), "no such verb"),
    ] {
        refused(&c, "n1", verb, body, needle).await;
    }
    for (body, needle) in [
        (b"{not json".to_vec(), "not JSON"),
        (b"[1,2]".to_vec(), "not a JSON object"),
        (vec![b' '; 200 << 10], "larger than"),
    ] {
        let (status, v) = post_raw(&sock, "/VolumeDriver.Create", None, &body).await;
        let err = v["Err"].as_str().unwrap_or_default();
        assert!(status != 200 && err.contains(needle), "{status} {v}");
    }
    assert!(volumes(&c).await.is_empty(), "nothing is created");
    assert!(
        c.store
            .list(&KeyScope::<AllocationSpec>::all())
            .await
            .unwrap()
            .items
            .is_empty(),
        "no allocation is created"
    );
    // The agent is unharmed: it still answers.
    let (status, _) = post_raw(&sock, "/Plugin.Activate", None, b"").await;
    assert_eq!(status, 200);
}

/// A process holding `path` in a mount namespace of its own, as a container does: a
/// bind mount of it, until killed.
struct Holder(std::process::Child);

impl Holder {
    fn start(path: &Path, at: &Path) -> Holder {
        use std::io::BufRead;
        std::fs::create_dir_all(at).unwrap();
        let mut child = std::process::Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c"])
            .arg("mount --bind \"$0\" \"$1\" && echo ready && exec sleep 600")
            .arg(path)
            .arg(at)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("unshare");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready", "the holder's bind mount");
        Holder(child)
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The allocation that holds a volume for `caller` (an engine's hold records each
/// caller in a `moor.dev/caller.<hash>` label).
async fn alloc_of(c: &Cluster, caller: &str) -> Allocation {
    c.store
        .list(&KeyScope::<AllocationSpec>::all())
        .await
        .unwrap()
        .items
        .into_iter()
        .find(|a| {
            a.metadata
                .labels
                .iter()
                .any(|(k, v)| k.starts_with("moor.dev/caller.") && v == caller)
        })
        .unwrap_or_else(|| panic!("no allocation of {caller}"))
}

/// Issue 38, item 3: an agent restart never releases a volume a container uses, and a
/// caller whose Unmount never came is found by the mount table and released; one that
/// still holds the path in its mount namespace is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_restart_keeps_what_containers_use_and_missed_unmounts_are_found() {
    assert!(
        cluster::can_mount(),
        "this test bind-mounts in a mount namespace: run it as root"
    );
    let mut c = start_with(&[
        "--volume-plugin-orphan-interval=1s",
        "--volume-plugin-orphan-grace=3s",
    ])
    .await;
    // Two volumes: the mount table tells volumes apart, not two callers of one
    // volume on one node (while one uses it, all of them are kept).
    for v in ["held", "ghost"] {
        ok(&c, "n1", "Create", json!({"Name": v})).await;
        c.volume_ready(v).await;
    }
    let held = ok(
        &c,
        "n1",
        "Mount",
        json!({"Name": "held", "ID": "heldcaller"}),
    )
    .await;
    let held_path = PathBuf::from(held["Mountpoint"].as_str().unwrap());
    let holder = Holder::start(&held_path, &c.dir.path().join("holder-at"));
    ok(
        &c,
        "n1",
        "Mount",
        json!({"Name": "ghost", "ID": "ghostcaller"}),
    )
    .await;

    // The agent dies and comes back: nothing is unpublished.
    c.node_mut("n1").agent.kill();
    c.node_mut("n1").agent.restart();
    let sock = socket(&c, "n1");
    c.wait("the endpoint is back", T, || async {
        tokio::net::UnixStream::connect(&sock).await.is_ok()
    })
    .await;
    assert_eq!(c.node("n1").count("NodeUnpublishVolume", "OK"), 0);

    // The ghost (its container never came, or its Unmount was lost) is released once
    // its allocation is past the grace and unused at two checks.
    c.wait("the ghost's allocation ended", T, || async {
        alloc_of(&c, "ghostcaller").await.spec.desired_status == DesiredStatus::Stop
    })
    .await;
    let ghost = alloc_of(&c, "ghostcaller").await;
    assert_eq!(ghost.spec.client_status, ClientStatus::Complete);
    c.wait("the ghost's claim released", T, || async {
        c.claim(ghost.metadata.name.as_str(), "n1")
            .await
            .is_some_and(|cl| cl.status.phase == ClaimPhase::Released)
    })
    .await;
    // The held one stays, check after check.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let held_alloc = alloc_of(&c, "heldcaller").await;
    assert_eq!(
        held_alloc.spec.desired_status,
        DesiredStatus::Run,
        "released under a live holder"
    );
    assert_eq!(
        c.claim(held_alloc.metadata.name.as_str(), "n1")
            .await
            .unwrap()
            .status
            .phase,
        ClaimPhase::Published
    );
    assert_eq!(
        c.node("n1").count("NodeUnpublishVolume", "OK"),
        1,
        "only the ghost's"
    );
    // Its holder goes without an Unmount: released too.
    drop(holder);
    c.wait(
        "the held allocation ended once its holder went",
        T,
        || async { alloc_of(&c, "heldcaller").await.spec.desired_status == DesiredStatus::Stop },
    )
    .await;
    c.wait("every claim released", T, || async {
        c.all_claims_released().await
    })
    .await;
    c.check_calls(true);
}

/// Issue 49, item 2: the endpoint hashed only a caller ID's first 63 characters, so two
/// of Docker's 64-character IDs that shared them shared one place, and the second's
/// Unmount ended the first's. Each ID is its own caller on the engine's hold (a label
/// keyed by the hash of the whole ID), and one's Unmount leaves the other published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_callers_that_share_63_characters_are_two_callers() {
    let c = start().await;
    ok(
        &c,
        "n1",
        "Create",
        json!({"Name": "shared", "Opts": {"size": "1MiB", "mode": "single-node-multi-writer"}}),
    )
    .await;
    c.volume_ready("shared").await;
    let stem = "f".repeat(63);
    let (first, second) = (format!("{stem}0"), format!("{stem}1"));
    let m1 = ok(&c, "n1", "Mount", json!({"Name": "shared", "ID": first})).await;
    let m2 = ok(&c, "n1", "Mount", json!({"Name": "shared", "ID": second})).await;
    let allocs = c
        .store
        .list(&KeyScope::<AllocationSpec>::all())
        .await
        .unwrap()
        .items;
    assert_eq!(allocs.len(), 1, "one hold: {allocs:?}");
    let callers = |a: &Allocation| {
        a.metadata
            .labels
            .keys()
            .filter(|k| k.starts_with("moor.dev/caller."))
            .count()
    };
    assert_eq!(callers(&allocs[0]), 2, "{allocs:?}");
    assert_eq!(m1["Mountpoint"], m2["Mountpoint"]);
    ok(&c, "n1", "Unmount", json!({"Name": "shared", "ID": second})).await;
    let hold = c.store.get(&allocs[0].object_key()).await.unwrap();
    assert!(!hold.is_terminal(), "the first caller's hold runs on");
    assert_eq!(callers(&hold), 1, "{hold:?}");
    // Past the linger, the first caller still holds it.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let hold = c.store.get(&allocs[0].object_key()).await.unwrap();
    assert!(!hold.is_terminal(), "the hold ended under its first caller");
    let path = PathBuf::from(m1["Mountpoint"].as_str().unwrap());
    assert!(path.is_dir(), "{path:?}");
    ok(&c, "n1", "Unmount", json!({"Name": "shared", "ID": first})).await;
    c.wait("every claim released", T, || c.all_claims_released())
        .await;
    c.check_calls(true);
}

/// Issue 49, item 5: a caller that hangs up during its Mount (Podman's 5 s default
/// timeout, a killed client) left its allocation running, with no log line: the handler
/// was dropped with the connection. Now the Mount runs on, sees its caller gone, ends
/// the allocation and says so; the claim is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mount_whose_caller_hung_up_is_ended_and_logged() {
    use tokio::io::AsyncWriteExt;
    let c = start().await;
    ok(
        &c,
        "n1",
        "Create",
        json!({"Name": "left", "Opts": {"size": "1MiB"}}),
    )
    .await;
    c.volume_ready("left").await;
    // The Mount waits on NodePublish, which hangs until released.
    c.node("n1")
        .fault(Command::Hang {
            rpc: "NodePublishVolume".into(),
            after: false,
        })
        .await;
    let body = json!({"Name": "left", "ID": "gone-caller"}).to_string();
    let mut s = tokio::net::UnixStream::connect(socket(&c, "n1"))
        .await
        .unwrap();
    let head = format!(
        "POST /VolumeDriver.Mount HTTP/1.1\r\nHost: plugin\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body.as_bytes()).await.unwrap();
    c.wait("the Mount's NodePublish held", T, || async {
        c.node("n1").hanging("NodePublishVolume").await > 0
    })
    .await;
    drop(s);
    c.node("n1")
        .fault(Command::Release {
            rpc: "NodePublishVolume".into(),
        })
        .await;
    c.wait("the allocation ended", T, || async {
        c.store
            .list(&KeyScope::<AllocationSpec>::all())
            .await
            .unwrap()
            .items
            .iter()
            .any(|a| a.is_terminal() && a.spec.client_status == ClientStatus::Failed)
    })
    .await;
    c.wait("its claim released", T, || c.all_claims_released())
        .await;
    let log = c.node("n1").agent.log_text();
    assert!(
        log.contains("its caller hung up before the answer"),
        "{log}"
    );
    c.check_calls(true);
}

/// Issue 49, item 4: with the agent in a PID namespace of its own (as a containerised
/// agent runs), the forgotten-mount rule saw no container's mount namespace and ended
/// a live container's allocation after its grace. Now it keeps the claim and says why:
/// a Warning about the allocation names the volume and the caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_cannot_see_the_containers_keeps_their_claims_and_says_why() {
    common::need("unshare");
    let c = Cluster::start_volume_plugin_with(cluster::PluginOpts {
        agent_wrapper: ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]
            .map(String::from)
            .to_vec(),
        agent_args: vec![
            "--volume-plugin-orphan-interval=300ms".into(),
            "--volume-plugin-orphan-grace=1s".into(),
        ],
        ..Default::default()
    })
    .await;
    ok(
        &c,
        "n1",
        "Create",
        json!({"Name": "unseen", "Opts": {"size": "1MiB"}}),
    )
    .await;
    c.volume_ready("unseen").await;
    ok(
        &c,
        "n1",
        "Mount",
        json!({"Name": "unseen", "ID": "live-container"}),
    )
    .await;
    c.wait("a Warning that the caller cannot be seen", T, || async {
        c.store
            .list(&KeyScope::<EventSpec>::all())
            .await
            .unwrap()
            .items
            .iter()
            .any(|e| {
                e.spec.reason == "Caller not seen"
                    && e.spec.message.contains("unseen")
                    && e.spec.message.contains("live-container")
                    && e.spec.message.contains("PID namespace")
            })
    })
    .await;
    // Many checks past its grace, the allocation runs and its claim is published.
    let allocs = c
        .store
        .list(&KeyScope::<AllocationSpec>::all())
        .await
        .unwrap()
        .items;
    assert!(allocs.len() == 1 && !allocs[0].is_terminal(), "{allocs:?}");
    assert!(claims(&c)
        .await
        .iter()
        .all(|cl| cl.status.phase == ClaimPhase::Published));
    ok(
        &c,
        "n1",
        "Unmount",
        json!({"Name": "unseen", "ID": "live-container"}),
    )
    .await;
    c.wait("its claim released", T, || c.all_claims_released())
        .await;
    c.check_calls(true);
}

/// Issue 51, item 1: an engine's hold outlives its last Unmount by the linger, in the
/// agent's memory; an agent that dies meanwhile loses that timer. The forgotten-mount
/// rule ends a hold it sees without callers at two checks in a row, so the claim is
/// released all the same (here the linger is an hour, so only the rule can end it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_left_without_callers_by_a_dead_agent_is_ended_and_released() {
    let mut c = start_with(&[
        "--volume-plugin-orphan-interval=1s",
        "--volume-plugin-linger=1h",
    ])
    .await;
    ok(&c, "n1", "Create", json!({"Name": "brief"})).await;
    c.volume_ready("brief").await;
    ok(&c, "n1", "Mount", json!({"Name": "brief", "ID": "once"})).await;
    let hold = alloc_of(&c, "once").await;
    ok(&c, "n1", "Unmount", json!({"Name": "brief", "ID": "once"})).await;
    let after = c.store.get(&hold.object_key()).await.unwrap();
    assert!(!after.is_terminal(), "the hold ended before its linger");
    c.node_mut("n1").agent.kill();
    c.node_mut("n1").agent.restart();
    c.wait("the hold without callers ended", T, || async {
        c.store
            .get(&hold.object_key())
            .await
            .is_ok_and(|a| a.is_terminal() && a.spec.client_status == ClientStatus::Complete)
    })
    .await;
    c.wait("its claim released", T, || c.all_claims_released())
        .await;
    c.check_calls(true);
}

/// Issue 51, item 2: a Mount the plugin refuses for good (FailedPrecondition) fails at
/// once, naming the step and the answer, where it waited out the mount timeout (110 s)
/// before, and nothing stays claimed; with etcd paused, the verbs answer within the
/// endpoint's store patience (5 s, then 1 s for the calls after it until the store
/// answers again) saying the store does not answer, where they hung past every
/// engine's timeout before. The messages tell the fast answers from a
/// timeout's ("was not published within").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mount_refused_for_good_or_a_silent_store_fails_at_once_and_says_why() {
    let c = start_with(&["--volume-plugin-mount-timeout=100s"]).await;
    ok(
        &c,
        "n1",
        "Create",
        json!({"Name": "final", "Opts": {"size": "1MiB"}}),
    )
    .await;
    c.volume_ready("final").await;
    c.node("n1")
        .fault(Command::Fail {
            rpc: "NodePublishVolume".into(),
            code: "FailedPrecondition".into(),
            times: 1000,
        })
        .await;
    refused(
        &c,
        "n1",
        "Mount",
        json!({"Name": "final", "ID": "f1"}),
        "NodePublishVolume was refused for good with FailedPrecondition",
    )
    .await;
    c.wait("nothing left claimed", T, || c.all_claims_released())
        .await;

    // The first call that finds the store silent waits 5 s for it; the calls after it
    // 1 s, until one gets an answer again.
    c.etcd.pause(true);
    for (verb, body, within) in [
        ("Mount", json!({"Name": "final", "ID": "f2"}), "5s"),
        ("List", json!({}), "1s"),
        ("Get", json!({"Name": "final"}), "1s"),
    ] {
        let needle = format!("etcd did not answer within {within}");
        refused(&c, "n1", verb, body, &needle).await;
    }
    c.etcd.pause(false);
    c.wait("the endpoint answers again", T, || async {
        call(&c, "n1", "List", json!({})).await.0 == 200
    })
    .await;
    c.etcd.pause(true);
    let body = json!({"Name": "final"});
    refused(&c, "n1", "Get", body, "etcd did not answer within 5s").await;
    c.etcd.pause(false);
}

/// Issue 51, item 4: caller connections get a deadline. Connections that never send a
/// request (900 were held open 60 s) are closed after the endpoint's idle limit (10 s
/// by default, 2 s here); each answer closes its connection (a caller never reuses one
/// being closed for idleness); a request being answered is never cut, even when its
/// Mount waits longer than that limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_caller_connections_are_closed_and_a_long_mount_is_not() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let c = start_with(&["--volume-plugin-idle-timeout=2s"]).await;
    ok(&c, "n1", "Create", json!({"Name": "slow"})).await;
    c.volume_ready("slow").await;
    let sock = socket(&c, "n1");
    let mut idle = Vec::new();
    for _ in 0..50 {
        idle.push(tokio::net::UnixStream::connect(&sock).await.unwrap());
    }
    // A Mount held at NodePublish for 3.5 s, longer than the idle limit (and shorter
    // than the harness's CSI call timeout, 5 s).
    c.node("n1")
        .fault(Command::Latency {
            rpc: "NodePublishVolume".into(),
            ms: 3_500,
        })
        .await;
    let mount = ok(&c, "n1", "Mount", json!({"Name": "slow", "ID": "patient"}));
    let closed = async {
        for mut s in idle {
            let mut buf = [0u8; 16];
            let n = tokio::time::timeout(T, s.read(&mut buf))
                .await
                .expect("an idle connection stayed open")
                .unwrap_or(0);
            assert_eq!(n, 0, "an idle connection got bytes");
        }
    };
    let (m, ()) = tokio::join!(mount, closed);
    assert!(m["Mountpoint"].as_str().is_some(), "{m}");
    c.node("n1")
        .fault(Command::Latency {
            rpc: "NodePublishVolume".into(),
            ms: 0,
        })
        .await;
    // A connection is closed after its answer (Connection: close).
    let mut s = tokio::net::UnixStream::connect(&sock).await.unwrap();
    let body = br#"{"Name": "slow"}"#;
    let head = format!(
        "POST /VolumeDriver.Get HTTP/1.1\r\nHost: plugin\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    let mut got = Vec::new();
    let read = tokio::time::timeout(T, s.read_to_end(&mut got)).await;
    assert!(read.is_ok(), "the connection stayed open after its answer");
    let text = String::from_utf8_lossy(&got);
    assert!(
        text.starts_with("HTTP/1.1 200") && text.to_lowercase().contains("connection: close"),
        "{text}"
    );
    ok(
        &c,
        "n1",
        "Unmount",
        json!({"Name": "slow", "ID": "patient"}),
    )
    .await;
    c.wait("every claim released", T, || c.all_claims_released())
        .await;
    c.check_calls(true);
}

/// Whether node `name` records its plugin with health `healthy`.
async fn plugin_healthy_on(c: &Cluster, name: &str, healthy: bool) -> bool {
    c.store
        .try_get(&Node::key_for(&cluster::node(name)))
        .await
        .ok()
        .flatten()
        .and_then(|n| {
            n.status
                .plugins
                .get(&PluginId::new(PLUGIN).unwrap())
                .map(|p| p.healthy)
        })
        == Some(healthy)
}

/// Issue 51, item 2: a Mount that needs the plugin's node calls while the plugin is
/// down on the node fails within the endpoint's plugin patience (5 s) naming the
/// plugin, where it waited out the mount timeout (110 s) saying only that the volume
/// was not published; a Mount answered from a hold already published needs no CSI
/// call and still works; once the plugin is back, Mounts work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mount_needing_a_plugin_that_is_down_fails_naming_it() {
    let mut c = start_with(&["--volume-plugin-mount-timeout=100s"]).await;
    for v in ["held", "cold"] {
        ok(&c, "n1", "Create", json!({"Name": v})).await;
        c.volume_ready(v).await;
    }
    ok(&c, "n1", "Mount", json!({"Name": "held", "ID": "a"})).await;
    c.node_mut("n1").plugin.kill();
    c.wait("n1 records its plugin unhealthy", T, || {
        plugin_healthy_on(&c, "n1", false)
    })
    .await;
    let started = std::time::Instant::now();
    refused(
        &c,
        "n1",
        "Mount",
        json!({"Name": "cold", "ID": "b"}),
        "is unhealthy on node n1",
    )
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "refused after {:?}",
        started.elapsed()
    );
    // The hold of `held` is published: a second caller is answered from it.
    ok(&c, "n1", "Mount", json!({"Name": "held", "ID": "c"})).await;
    c.node_mut("n1").plugin.restart();
    c.wait("n1 records its plugin healthy", T, || {
        plugin_healthy_on(&c, "n1", true)
    })
    .await;
    ok(&c, "n1", "Mount", json!({"Name": "cold", "ID": "b"})).await;
    for (v, id) in [("held", "a"), ("held", "c"), ("cold", "b")] {
        ok(&c, "n1", "Unmount", json!({"Name": v, "ID": id})).await;
    }
    c.wait("every claim released", T, || c.all_claims_released())
        .await;
    c.check_calls(true);
}

/// Issue 51, item 1: a hold records at most 56 callers (labels are bounded at 64); the
/// callers beyond get an allocation of their own on the same volume, answered with the
/// same path, and each is released by its own Unmount while the hold runs on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_beyond_a_holds_labels_get_allocations_of_their_own() {
    const CALLERS: usize = 56; // MAX_CALLERS: MAX_LABELS (64) less 8.
    let c = start().await;
    ok(
        &c,
        "n1",
        "Create",
        json!({"Name": "busy", "Opts": {"size": "1MiB"}}),
    )
    .await;
    c.volume_ready("busy").await;
    let id = |i: usize| format!("caller-{i:03}");
    let mut paths = std::collections::BTreeSet::new();
    for i in 0..CALLERS + 2 {
        let m = ok(&c, "n1", "Mount", json!({"Name": "busy", "ID": id(i)})).await;
        paths.insert(m["Mountpoint"].as_str().unwrap().to_string());
    }
    let allocs = c
        .store
        .list(&KeyScope::<AllocationSpec>::all())
        .await
        .unwrap()
        .items;
    let holds: Vec<_> = allocs
        .iter()
        .filter(|a| a.metadata.labels.contains_key("moor.dev/hold"))
        .collect();
    assert_eq!(holds.len(), 1, "{allocs:?}");
    let on_hold = holds[0]
        .metadata
        .labels
        .keys()
        .filter(|k| k.starts_with("moor.dev/caller."))
        .count();
    assert_eq!(on_hold, CALLERS, "the hold's callers");
    let own: Vec<_> = allocs
        .iter()
        .filter(|a| a.metadata.labels.contains_key("moor.dev/caller"))
        .collect();
    assert_eq!(own.len(), 2, "callers beyond the hold's: {allocs:?}");
    // Two claims on one volume on one node, each published at its own target path.
    assert_eq!(paths.len(), 3, "{paths:?}");
    for i in (CALLERS..CALLERS + 2).rev() {
        ok(&c, "n1", "Unmount", json!({"Name": "busy", "ID": id(i)})).await;
    }
    let hold = c.store.get(&holds[0].object_key()).await.unwrap();
    assert!(!hold.is_terminal(), "the hold ended under its callers");
    for a in &own {
        let a = c.store.get(&a.object_key()).await.unwrap();
        assert!(
            a.is_terminal(),
            "{} runs on after its Unmount",
            a.metadata.name
        );
    }
    for i in 0..CALLERS {
        ok(&c, "n1", "Unmount", json!({"Name": "busy", "ID": id(i)})).await;
    }
    c.wait("every claim released", T, || c.all_claims_released())
        .await;
    c.check_calls(true);
}

/// Writes `yaml` to a file and runs `moorctl apply` on it: (success, output).
fn apply_text(c: &Cluster, name: &str, yaml: &str) -> (bool, String) {
    let path = c.dir.path().join(format!("{name}.yaml"));
    std::fs::write(&path, yaml).unwrap();
    c.moorctl(&["apply", "-f", path.to_str().unwrap()])
}

async fn stored_volume(c: &Cluster, name: &str) -> Volume {
    c.store
        .get(&Volume::key_for(&Namespace::default_ns(), name))
        .await
        .unwrap()
}

/// Issue 54, part 3: one class used by a volume (`moorctl apply`), a template and the
/// engine endpoint (`-o class=`); a volume contradicting its class is refused by name;
/// the default class fills a volume that names neither a class nor a plugin and
/// forbids its expansion; re-applying a class-made volume changes nothing; the class's
/// `on_delete: retain` keeps the plugin's volume (no DeleteVolume) when the Volume is
/// deleted; a second default class is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_class_fills_volumes_from_moorctl_a_template_and_the_endpoint() {
    let c = start().await;
    let classes = format!(
        "kind: VolumeClass\nmetadata: {{name: fast}}\nspec:\n  plugin_id: {PLUGIN}\n  \
         parameters: {{tier: fast}}\n  on_delete: retain\n  capabilities:\n    \
         - {{access_mode: single-node-writer, attachment_mode: file-system}}\n---\n\
         kind: VolumeClass\nmetadata: {{name: cheap}}\nspec:\n  plugin_id: {PLUGIN}\n  \
         parameters: {{tier: cheap}}\n  allow_expansion: false\n  default: true\n  \
         capabilities:\n    - {{access_mode: single-node-writer, attachment_mode: file-system}}\n\
         ---\nkind: Volume\nmetadata: {{name: v0}}\nspec: {{class: fast, capacity_min: 1MiB}}\n"
    );
    // The classes and a volume of one, in one file.
    let (ok_, out) = apply_text(&c, "classes", &classes);
    assert!(ok_, "{out}");
    assert_eq!(
        stored_volume(&c, "v0").await.spec.plugin_id.as_str(),
        PLUGIN
    );
    let (ok_, out) = c.moorctl(&["get", "classes"]);
    assert!(
        ok_ && out.contains("cheap") && out.contains("retain"),
        "{out}"
    );
    let (ok_, out) = apply_text(
        &c,
        "second-default",
        &format!("kind: VolumeClass\nmetadata: {{name: other}}\nspec: {{plugin_id: {PLUGIN}, default: true}}\n"),
    );
    assert!(
        !ok_ && out.contains("class cheap is already the default"),
        "{out}"
    );

    // A volume naming the class: filled from it.
    let v1 = "kind: Volume\nmetadata: {name: v1}\nspec: {class: fast, capacity_min: 1MiB, parameters: {zone: a}}\n";
    let (ok_, out) = apply_text(&c, "v1", v1);
    assert!(ok_, "{out}");
    c.volume_ready("v1").await;
    let v = stored_volume(&c, "v1").await;
    assert_eq!(v.spec.plugin_id.as_str(), PLUGIN);
    assert_eq!(
        v.spec.parameters.get("tier").map(String::as_str),
        Some("fast")
    );
    assert_eq!(v.spec.parameters.get("zone").map(String::as_str), Some("a"));
    assert_eq!(v.spec.on_delete, Some(OnDelete::Retain));
    // The same manifest again changes nothing.
    let (ok_, out) = apply_text(&c, "v1", v1);
    assert!(ok_ && out.contains("unchanged"), "{out}");
    // A contradiction is refused by name, and nothing is written.
    let (ok_, out) = apply_text(
        &c,
        "v2",
        "kind: Volume\nmetadata: {name: v2}\nspec: {class: fast, capacity_min: 1MiB, parameters: {tier: slow}}\n",
    );
    assert!(
        !ok_ && out.contains("spec.parameters.tier") && out.contains("class fast"),
        "{out}"
    );
    assert!(!volumes(&c).await.contains(&"v2".to_string()));
    // Neither class nor plugin: the default class; its rule forbids expansion.
    let v3 = |size: &str| {
        format!("kind: Volume\nmetadata: {{name: v3}}\nspec: {{capacity_min: {size}}}\n")
    };
    let (ok_, out) = apply_text(&c, "v3", &v3("1MiB"));
    assert!(ok_, "{out}");
    c.volume_ready("v3").await;
    let v = stored_volume(&c, "v3").await;
    assert_eq!(v.spec.class.as_ref().map(Name::as_str), Some("cheap"));
    assert_eq!(
        v.spec.parameters.get("tier").map(String::as_str),
        Some("cheap")
    );
    let (ok_, out) = apply_text(&c, "v3", &v3("2MiB"));
    assert!(!ok_ && out.contains("does not allow expansion"), "{out}");
    // Raised behind moorctl's back (straight into the store): the provisioner refuses
    // it by the class too, and the plugin is never asked.
    let mut raised = stored_volume(&c, "v3").await;
    raised.spec.capacity_min = Some(Size(2 << 20));
    c.store.replace(&raised).await.unwrap();
    c.wait("v3's expansion refused by its class", T, || async {
        stored_volume(&c, "v3")
            .await
            .status
            .provisioning
            .meta
            .condition("Expanded")
            .is_some_and(|k| !k.status && k.reason == "ExpansionNotAllowed")
    })
    .await;
    assert_eq!(c.node("n1").tried("ControllerExpandVolume"), 0);

    // A template naming the class.
    let alloc = "kind: Allocation\nmetadata: {name: a1}\nspec:\n  node: n1\n  volumes:\n    \
                 - name: data\n      template: {class: fast, capacity_min: 1MiB}\n";
    let (ok_, out) = apply_text(&c, "a1", alloc);
    assert!(ok_, "{out}");
    c.wait_claim("a1", "n1", ClaimPhase::Published, T).await;
    let made = stored_volume(&c, "a1.data").await;
    assert_eq!(made.spec.class.as_ref().map(Name::as_str), Some("fast"));
    assert_eq!(
        made.spec.parameters.get("tier").map(String::as_str),
        Some("fast")
    );

    // The endpoint: `-o class=fast`, a class that does not exist, and the default.
    ok(
        &c,
        "n1",
        "Create",
        json!({"Name": "e1", "Opts": {"class": "fast"}}),
    )
    .await;
    let e1 = stored_volume(&c, "e1").await;
    assert_eq!(e1.spec.class.as_ref().map(Name::as_str), Some("fast"));
    assert_eq!(
        e1.spec.parameters.get("tier").map(String::as_str),
        Some("fast")
    );
    refused(
        &c,
        "n1",
        "Create",
        json!({"Name": "e2", "Opts": {"class": "nope"}}),
        "volume class nope not found",
    )
    .await;
    ok(&c, "n1", "Create", json!({"Name": "e3", "Opts": {}})).await;
    assert_eq!(
        stored_volume(&c, "e3")
            .await
            .spec
            .class
            .as_ref()
            .map(Name::as_str),
        Some("cheap")
    );
    refused(
        &c,
        "n1",
        "Create",
        json!({"Name": "e1", "Opts": {"class": "cheap"}}),
        "option class=cheap",
    )
    .await;

    // on_delete: retain: the Volume goes, the plugin's volume stays.
    let ext = stored_volume(&c, "v1")
        .await
        .status
        .provisioning
        .external_id
        .unwrap();
    let (ok_, out) = c.moorctl(&["delete", "volume", "v1"]);
    assert!(ok_, "{out}");
    c.wait("v1 gone", T, || async {
        !volumes(&c).await.contains(&"v1".to_string())
    })
    .await;
    let deleted = c
        .node("n1")
        .calls()
        .into_iter()
        .filter(|k| k.rpc == "DeleteVolume" && k.volume_id.as_deref() == Some(ext.as_str()))
        .count();
    assert_eq!(deleted, 0, "a retained volume is not deleted in the plugin");
    c.wait("the Volume retained event", T, || async {
        let (_, out) = c.moorctl(&["events", "--for", "volume/v1"]);
        out.contains("Volume retained")
    })
    .await;
    c.check_calls(false);
}
