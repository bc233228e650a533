//! The Docker volume-plugin endpoint (issue 38) at its socket: a real etcd, `moord
//! controller`, agents serving `--volume-plugin` and moor-hostpath; requests are sent
//! as Docker and Podman send them, and the plugins' call logs are checked against the
//! invariants.

#[path = "common/cluster.rs"]
mod cluster;
mod common;

use cluster::{Cluster, PluginOpts, PLUGIN};
use moor::api::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const T: Duration = Duration::from_secs(60);

/// The endpoint's socket of node `name`.
fn socket(c: &Cluster, name: &str) -> PathBuf {
    c.node(name).dir.join("moor.sock")
}

/// POSTs `body` (raw bytes) to `path` over the unix socket, with `content_type` if
/// any (Docker sends none); returns the status and the body as JSON.
async fn post_raw(
    sock: &Path,
    path: &str,
    content_type: Option<&str>,
    body: &[u8],
) -> (u16, Value) {
    let mut s = tokio::net::UnixStream::connect(sock)
        .await
        .expect("connect to the endpoint");
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nHost: plugin\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if let Some(ct) = content_type {
        head.push_str(&format!("Content-Type: {ct}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).await.unwrap();
    // A server may answer (and close) before it has read an oversized body.
    let _ = s.write_all(body).await;
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out).await;
    let text = String::from_utf8_lossy(&out);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {text:?}"));
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_string()
    };
    let value =
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {body:?}"));
    (status, value)
}

fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&after[..n]);
        rest = &after[n + 2..];
    }
    out
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
    let (status, v) = call(c, node, verb, body.clone()).await;
    assert_eq!(status, 200, "{verb} {body}: {v}");
    assert!(
        v.get("Err").is_none_or(|e| e.as_str() == Some("")),
        "{verb}: {v}"
    );
    v
}

/// A verb that must fail with a message containing `needle`.
async fn refused(c: &Cluster, node: &str, verb: &str, body: Value, needle: &str) {
    let (status, v) = call(c, node, verb, body.clone()).await;
    let err = v["Err"].as_str().unwrap_or_default();
    assert!(
        status != 200 && err.contains(needle),
        "{verb} {body}: {status} {v}"
    );
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
    let opts = PluginOpts {
        agent_args: vec!["--volume-plugin={dir}/moor.sock".into()],
        ..PluginOpts::default()
    };
    let c = Cluster::start(1, 2, opts).await;
    c.wait_nodes_healthy().await;
    for n in ["n1", "n2"] {
        let sock = socket(&c, n);
        c.wait("the endpoint's socket", T, || async { sock.exists() })
            .await;
    }
    c
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
    c.wait("c2's claim released", T, || async {
        c.store
            .list(&KeyScope::<ClaimSpec>::all())
            .await
            .unwrap()
            .items
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

    // Unmount answers once n1 no longer publishes it for c1.
    ok(&c, "n1", "Unmount", json!({"Name": "web", "ID": "c1"})).await;
    assert_eq!(c.node("n1").count("NodeUnpublishVolume", "OK"), 1);
    // A second container, after the first ended, reads the data back.
    let m3 = ok(&c, "n1", "Mount", json!({"Name": "web", "ID": "c3"})).await;
    let path3 = PathBuf::from(m3["Mountpoint"].as_str().unwrap());
    assert_eq!(
        std::fs::read_to_string(path3.join("hello")).unwrap(),
        "kept"
    );
    ok(&c, "n1", "Unmount", json!({"Name": "web", "ID": "c3"})).await;
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
        c.store
            .list(&KeyScope::<ClaimSpec>::all())
            .await
            .unwrap()
            .items
            .iter()
            .all(|cl| cl.status.phase == ClaimPhase::Released)
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
        ("Create", json!({"Name": 7}), "Name is not a string"),
        ("Create", json!({}), "Name is missing"),
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
