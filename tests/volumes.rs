//! The rest of a volume's life, through moorctl against real processes: deregistering
//! (forced), plugin instance counts, validated registration, expansion and
//! modification. Each test runs etcd, a `moord controller` and one `moord agent` with
//! its own moor-hostpath per node.

#[path = "common/cluster.rs"]
mod cluster;
mod common;

use cluster::{node, plugin_key, Cluster, PluginOpts};
use moor::api::*;
use std::time::Duration;
use tokio::sync::Semaphore;

/// Clusters are several processes each: run two tests at a time on two cores.
static SLOTS: Semaphore = Semaphore::const_new(2);

const T: Duration = Duration::from_secs(30);

fn vol_key(name: &str) -> ObjectKey<VolumeSpec> {
    Volume::key_for(&Namespace::default_ns(), name)
}

async fn plugin(c: &Cluster) -> Option<Plugin> {
    c.store.try_get(&plugin_key()).await.ok().flatten()
}

/// Waits until the Plugin's status satisfies `f`.
async fn wait_plugin(c: &Cluster, what: &str, f: impl Fn(&PluginStatus) -> bool) {
    c.wait(what, T, || async {
        plugin(c).await.is_some_and(|p| f(&p.status))
    })
    .await;
}

/// Waits until the plugin's capacity report satisfies `f`.
async fn wait_capacity(c: &Cluster, what: &str, f: impl Fn(&[CapacityEntry]) -> bool) {
    let id = PluginId::new(cluster::PLUGIN).unwrap();
    c.wait(what, T, || async {
        c.store
            .capacity(&id)
            .await
            .ok()
            .flatten()
            .is_some_and(|e| f(&e))
    })
    .await;
}

async fn schedulable(c: &Cluster, name: &str) -> bool {
    c.store
        .try_get(&vol_key(name))
        .await
        .ok()
        .flatten()
        .is_some_and(|v| v.status.claims.schedulable)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deregister_is_refused_while_claimed_and_force_drops_terminal_claims_without_plugin_calls()
{
    let _slot = SLOTS.acquire().await.unwrap();
    let mut c = Cluster::start(1, 2, PluginOpts::default()).await;
    c.apply(c.volume("v1", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v1").await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;

    // Claimed: refused, and nothing changes.
    let (ok, out) = c.moorctl(&["volume", "deregister", "v1"]);
    assert!(!ok, "{out}");
    assert!(out.contains("is claimed") && out.contains("a1"), "{out}");
    // --force drops only the claims of terminal allocations.
    let (ok, out) = c.moorctl(&["volume", "deregister", "v1", "--force"]);
    assert!(!ok, "{out}");
    assert!(out.contains("is running"), "{out}");
    assert!(c.store.try_get(&vol_key("v1")).await.unwrap().is_some());

    // The node dies for good; the stopped allocation's claim cannot be released.
    c.node_mut("n2").agent.kill();
    c.node_mut("n2").plugin.kill();
    c.stop_alloc("a1").await;
    c.wait_claim("a1", "n2", ClaimPhase::Releasing, T).await;
    let (ok, out) = c.moorctl(&["volume", "deregister", "v1"]);
    assert!(!ok && out.contains("releasing"), "{out}");
    let n1 = c.node("n1");
    let before: Vec<usize> = ["ControllerUnpublishVolume", "DeleteVolume"]
        .iter()
        .map(|rpc| n1.calls().iter().filter(|k| k.rpc == *rpc).count())
        .collect();

    let (ok, out) = c.moorctl(&["volume", "deregister", "v1", "--force"]);
    assert!(ok, "{out}");
    assert!(out.contains("dropping claim a1.data"), "{out}");
    assert!(
        out.contains("dropping attachment of v1 to node n2"),
        "{out}"
    );
    assert!(out.contains("is kept"), "{out}");
    c.wait("v1 gone", T, || async {
        c.store.try_get(&vol_key("v1")).await.unwrap().is_none()
    })
    .await;
    assert!(c.claim("a1", "n2").await.is_none());
    assert!(c.attachment("v1", "n2").await.is_none());
    // The controller and the provisioner had time to act on the deletions.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after: Vec<usize> = ["ControllerUnpublishVolume", "DeleteVolume"]
        .iter()
        .map(|rpc| n1.calls().iter().filter(|k| k.rpc == *rpc).count())
        .collect();
    assert_eq!(before, after, "no plugin call for a deregistration");
    let (ok, out) = c.moorctl(&["volume", "deregister", "v1"]);
    assert!(!ok && out.contains("not found"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deregister_without_claims_removes_a_registered_volume_without_plugin_calls() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 1, PluginOpts::default()).await;
    c.apply(c.volume("v1", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v1").await;
    let ext = c.store.get(&vol_key("v1")).await.unwrap();
    let ext = ext.status.provisioning.external_id.unwrap();
    let mut reg = c.volume("r1", AccessMode::SingleNodeWriter);
    reg.spec.capacity_min = None;
    reg.spec.external_id = Some(ext);
    c.apply(reg).await;
    c.volume_ready("r1").await;
    let (ok, out) = c.moorctl(&["volume", "deregister", "r1"]);
    assert!(ok, "{out}");
    assert!(out.contains("volume r1 deregistered"), "{out}");
    assert!(c.store.try_get(&vol_key("r1")).await.unwrap().is_none());
    assert_eq!(c.node("n1").count("DeleteVolume", "OK"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_instance_stays_expected_until_deregistered_and_schedulable_needs_both_sides() {
    let _slot = SLOTS.acquire().await.unwrap();
    let mut c = Cluster::start(1, 2, PluginOpts::default()).await;
    c.apply(c.volume("v1", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v1").await;
    c.wait("v1 schedulable", T, || schedulable(&c, "v1")).await;

    // n2 dies: 1 of 2 nodes healthy, not 1 of 1.
    c.node_mut("n2").agent.kill();
    c.node_mut("n2").plugin.kill();
    wait_plugin(&c, "n2's instance unhealthy and still expected", |s| {
        s.nodes_healthy == 1
            && s.nodes_expected == 2
            && s.instances.get(&node("n2")).is_some_and(|i| !i.healthy)
    })
    .await;
    let (ok, out) = c.moorctl(&["plugin", "status", cluster::PLUGIN]);
    assert!(ok, "{out}");
    let line = |label: &str| {
        out.lines()
            .find(|l| l.starts_with(label))
            .map(|l| l.split_whitespace().last().unwrap_or("").to_string())
    };
    assert_eq!(line("Nodes Healthy").as_deref(), Some("1"), "{out}");
    assert_eq!(line("Nodes Expected").as_deref(), Some("2"), "{out}");
    assert!(out.contains("its node is gone"), "{out}");

    // A live node's instance cannot be deregistered; the dead one can.
    let (ok, out) = c.moorctl(&["plugin", "deregister", cluster::PLUGIN, "--node", "n1"]);
    assert!(!ok && out.contains("is live"), "{out}");
    let (ok, out) = c.moorctl(&["plugin", "deregister", cluster::PLUGIN, "--node", "n2"]);
    assert!(ok, "{out}");
    wait_plugin(&c, "n2 forgotten", |s| {
        s.nodes_expected == 1 && !s.instances.contains_key(&node("n2"))
    })
    .await;

    // n2 comes back: a new registration, counted again despite the old entry.
    c.node_mut("n2").plugin.restart();
    c.node_mut("n2").agent.restart();
    wait_plugin(&c, "n2 back", |s| {
        s.nodes_expected == 2 && s.nodes_healthy == 2
    })
    .await;

    // The controller side (n1's monolith) dies: node instances remain, but a plugin
    // that needs ControllerPublish cannot serve the volume.
    c.node_mut("n1").plugin.kill();
    wait_plugin(&c, "no healthy controller", |s| s.controllers_healthy == 0).await;
    c.wait("v1 not schedulable", T, || async {
        !schedulable(&c, "v1").await
    })
    .await;
    c.node_mut("n1").plugin.restart();
    c.wait("v1 schedulable again", T, || schedulable(&c, "v1"))
        .await;
}

/// Writes `yaml` to a file in the cluster's dir and applies it with moorctl.
fn apply_yaml(c: &Cluster, name: &str, yaml: &str) {
    let path = c.dir.path().join(format!("{name}.yaml"));
    std::fs::write(&path, yaml).unwrap();
    let (ok, out) = c.moorctl(&["apply", "-f", path.to_str().unwrap()]);
    assert!(ok, "{out}");
}

fn registered(name: &str, ext: &str, mode: &str) -> String {
    format!(
        "apiVersion: moor/v1\nkind: Volume\nmetadata: {{name: {name}}}\nspec:\n  plugin_id: {}\n  \
         external_id: {ext}\n  parameters: {{tier: gold}}\n  accessible_topology: [{{rack: r1}}]\n  \
         capabilities:\n    - {{access_mode: {mode}, attachment_mode: file-system}}\n",
        cluster::PLUGIN
    )
}

async fn volume(c: &Cluster, name: &str) -> Volume {
    c.store.get(&vol_key(name)).await.expect("volume")
}

async fn wait_phase(c: &Cluster, name: &str, phase: VolumePhase) {
    c.wait(&format!("{name} {phase:?}"), T, || async {
        c.store
            .try_get(&vol_key(name))
            .await
            .ok()
            .flatten()
            .is_some_and(|v| v.status.provisioning.phase == phase)
    })
    .await;
}

fn field(out: &str, label: &str) -> String {
    out.lines()
        .find(|l| l.starts_with(label) && l[label.len()..].trim_start().starts_with('='))
        .and_then(|l| l.split_once('='))
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_is_validated_by_the_plugin_and_a_volume_it_cannot_serve_fails() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 1, PluginOpts::default()).await;
    c.apply(c.volume("v1", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v1").await;
    let ext = volume(&c, "v1")
        .await
        .status
        .provisioning
        .external_id
        .unwrap();

    apply_yaml(
        &c,
        "ok",
        &registered("r-ok", ext.as_str(), "single-node-writer"),
    );
    apply_yaml(
        &c,
        "missing",
        &registered("r-missing", "no-such-volume", "single-node-writer"),
    );
    apply_yaml(
        &c,
        "shared",
        &registered("r-shared", ext.as_str(), "multi-node-multi-writer"),
    );
    wait_phase(&c, "r-ok", VolumePhase::Ready).await;
    wait_phase(&c, "r-missing", VolumePhase::Failed).await;
    wait_phase(&c, "r-shared", VolumePhase::Failed).await;

    let ok = volume(&c, "r-ok").await;
    // ControllerGetVolume (GET_VOLUME) gave the capacity; the declared topology holds.
    assert_eq!(ok.status.provisioning.capacity_bytes, Some(1 << 20));
    assert_eq!(
        ok.status.provisioning.accessible_topology,
        vec![[("rack".to_string(), "r1".to_string())].into()]
    );
    let n1 = c.node("n1");
    let validations: Vec<_> = n1
        .calls()
        .into_iter()
        .filter(|k| k.rpc == "ValidateVolumeCapabilities")
        .collect();
    assert!(validations
        .iter()
        .any(|k| k.volume_id.as_deref() == Some(ext.as_str()) && k.code == "OK"));
    assert!(n1.count("ControllerGetVolume", "OK") >= 1);

    let (ok_run, out) = c.moorctl(&["volume", "status", "r-missing"]);
    assert!(ok_run, "{out}");
    assert_eq!(field(&out, "Phase"), "failed", "{out}");
    assert!(field(&out, "Last Error").contains("not found"), "{out}");
    let (_, out) = c.moorctl(&["volume", "status", "r-shared"]);
    assert!(
        field(&out, "Last Error").contains("created for a single node"),
        "{out}"
    );
    let (_, out) = c.moorctl(&["volume", "status", "r-ok"]);
    assert_eq!(field(&out, "Phase"), "ready", "{out}");
    assert_eq!(field(&out, "Capacity"), "1.0 MiB", "{out}");
    c.wait("the validation failure's event", T, || async {
        let (_, out) = c.moorctl(&["events", "--for", "volume/r-missing"]);
        out.contains("Volume validation failed")
    })
    .await;

    // A claim on a failed volume is denied with the plugin's reason.
    c.apply(c.allocation("a1", "n1", "r-missing", false)).await;
    c.wait_denied("a1", "n1", "not found", T).await;
    // Fixed by the operator: validated again at the new generation; the declared
    // topology (rack r1) does not reach n1, then, declared away, it is claimed.
    apply_yaml(
        &c,
        "fixed",
        &registered("r-missing", ext.as_str(), "single-node-writer"),
    );
    wait_phase(&c, "r-missing", VolumePhase::Ready).await;
    c.wait("a1's claim denied by topology", T, || async {
        c.claim("a1", "n1").await.is_some_and(|cl| {
            cl.status
                .reason
                .as_deref()
                .is_some_and(|r| r.contains("not accessible"))
        })
    })
    .await;
    let anywhere = registered("r-missing", ext.as_str(), "single-node-writer")
        .replace("  accessible_topology: [{rack: r1}]\n", "");
    apply_yaml(&c, "anywhere", &anywhere);
    let deadline = std::time::Instant::now() + T;
    loop {
        let cl = c.claim("a1", "n1").await.expect("claim");
        if cl.status.phase == ClaimPhase::Published {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "claim not published: {:?} {:?}",
            cl.status,
            volume(&c, "r-missing").await.status
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn created(name: &str, range: &str) -> String {
    format!(
        "apiVersion: moor/v1\nkind: Volume\nmetadata: {{name: {name}}}\nspec:\n  plugin_id: {}\n  \
         {range}\n  capabilities:\n    - {{access_mode: single-node-writer, attachment_mode: file-system}}\n",
        cluster::PLUGIN
    )
}

async fn mount(c: &Cluster, alloc: &str, node_name: &str) -> Option<Mount> {
    let claim = Claim::key_for(
        &node(node_name),
        &Namespace::default_ns(),
        format!("{alloc}.data"),
    );
    c.store
        .try_get(&Mount::key_for(&claim))
        .await
        .ok()
        .flatten()
}

async fn events_of(c: &Cluster, reason: &str) -> Vec<Event> {
    c.store
        .list::<EventSpec>(&KeyScope::all())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.spec.reason == reason)
        .collect()
}

const MIB: u64 = 1 << 20;

/// A cluster's plugins started with these flags.
fn plugin_flags(flags: &[&str]) -> PluginOpts {
    PluginOpts {
        extra: flags.iter().map(|f| f.to_string()).collect(),
        ..Default::default()
    }
}

/// Applies volume `name` of 1 MiB through moorctl and waits until it is created.
async fn create_ready(c: &Cluster, name: &str) {
    apply_yaml(c, name, &created(name, "capacity_min: 1MiB"));
    c.volume_ready(name).await;
}

/// `moorctl volume snapshot create VOLUME NAME`, then `moorctl wait` until it is ready.
fn snapshot_ready(c: &Cluster, volume: &str, name: &str) {
    let (ok, out) = c.moorctl(&["volume", "snapshot", "create", volume, name]);
    assert!(ok, "{out}");
    let wait = format!("snapshot/{name}");
    let (ok, out) = c.moorctl(&["wait", &wait, "--for", "phase=ready", "--timeout", "30s"]);
    assert!(ok, "{out}");
}

/// Waits until a condition of volume `name` is false with `reason`.
async fn wait_refused(c: &Cluster, name: &str, reason: &str) {
    c.wait(&format!("{name}: {reason}"), T, || async {
        let v = volume(c, name).await;
        v.status
            .provisioning
            .meta
            .conditions
            .iter()
            .chain(&v.status.claims.meta.conditions)
            .any(|k| k.reason == reason && !k.status)
    })
    .await;
}

/// Waits until `n` events with `reason` are stored (events are written in batches,
/// after the status that caused them), then checks there are no more.
/// Waits until `reason` happened `n` times (repeats fold into one event's count).
async fn wait_events(c: &Cluster, reason: &str, n: u32) {
    let times = || async {
        events_of(c, reason)
            .await
            .iter()
            .map(|e| e.spec.count())
            .sum::<u32>()
    };
    c.wait(&format!("{n} {reason:?} events"), T, || async {
        times().await >= n
    })
    .await;
    assert_eq!(times().await, n, "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raising_capacity_min_expands_the_volume_and_the_node_online_and_shrinking_is_refused() {
    let _slot = SLOTS.acquire().await.unwrap();
    let opts = plugin_flags(&["--node-expansion-required"]);
    let c = Cluster::start(1, 2, opts).await;
    create_ready(&c, "v1").await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;

    apply_yaml(&c, "v1-4", &created("v1", "capacity_min: 4MiB"));
    c.wait("v1 expanded to 4MiB", T, || async {
        volume(&c, "v1").await.status.provisioning.capacity_bytes == Some(4 * MIB)
    })
    .await;
    assert_eq!(c.node("n1").count("ControllerExpandVolume", "OK"), 1);
    // The plugin asked for node expansion: n2, where the volume is published, expands
    // it online at the target path.
    c.wait("n2 expanded", T, || async {
        mount(&c, "a1", "n2")
            .await
            .is_some_and(|m| m.status.expanded_bytes == Some(4 * MIB))
    })
    .await;
    let target = mount(&c, "a1", "n2").await.unwrap().spec.target_path;
    let expands: Vec<_> = c
        .node("n2")
        .calls()
        .into_iter()
        .filter(|k| k.rpc == "NodeExpandVolume")
        .collect();
    assert_eq!(expands.len(), 1, "{expands:?}");
    assert_eq!(expands[0].code, "OK");
    assert!(expands[0]
        .target_path
        .as_deref()
        .is_some_and(|t| target.ends_with(t) || t.ends_with(&target)));
    let (_, out) = c.moorctl(&["volume", "status", "v1"]);
    assert_eq!(field(&out, "Capacity"), "4.0 MiB", "{out}");
    assert_eq!(field(&out, "Requested Capacity"), "4.0 MiB..", "{out}");
    assert!(field(&out, "Conditions").contains("Expanded=true"), "{out}");
    wait_events(&c, "Volume expanded", 1).await;

    // A capacity_min below the capacity asks for nothing: applied, and said (issue 78,
    // item 5: it was accepted without a word).
    let path = c.dir.path().join("v1-min2.yaml");
    std::fs::write(&path, created("v1", "capacity_min: 2MiB")).unwrap();
    let (ok, out) = c.moorctl(&["apply", "-f", path.to_str().unwrap()]);
    assert!(
        ok && out.contains("spec.capacity_min 2.0 MiB is below the volume's capacity 4.0 MiB")
            && out.contains("volumes do not shrink"),
        "{out}"
    );
    // Shrinking: refused once, with a Warning, and no call.
    apply_yaml(&c, "v1-2", &created("v1", "capacity_max: 2MiB"));
    wait_refused(&c, "v1", "ShrinkRefused").await;
    wait_events(&c, "ShrinkRefused", 1).await;
    assert_eq!(c.node("n1").count("ControllerExpandVolume", "OK"), 1);
    c.check_calls(false);
}

/// An expansion the plugin refuses for good (OUT_OF_RANGE: moor-hostpath makes volumes
/// of at most 8 MiB) does not wedge the volume (Kubernetes' RecoverVolumeExpansionFailure):
/// lowered to a size the plugin takes, the volume expands to it; lowered to what the
/// volume already has, the failure is withdrawn, with no call. The volume is used
/// before, during and after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_expansion_recovers_when_the_request_is_lowered() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 2, plugin_flags(&["--max-volume-size=8MiB"])).await;
    create_ready(&c, "v1").await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    let n1 = c.node("n1");
    let refused = || async {
        let v = volume(&c, "v1").await;
        let p = &v.status.provisioning;
        p.meta.retry.as_ref().is_some_and(|r| r.final_answer)
            && p.meta
                .conditions
                .iter()
                .any(|k| k.type_ == "Expanded" && !k.status)
    };

    apply_yaml(&c, "v1-64", &created("v1", "capacity_min: 64MiB"));
    c.wait("the expansion refused", T, refused).await;
    assert_eq!(n1.count("ControllerExpandVolume", "OutOfRange"), 1);
    // Lowered to a size the plugin takes: expanded to it at once (not after the
    // refusal's backoff).
    apply_yaml(&c, "v1-4", &created("v1", "capacity_min: 4MiB"));
    c.wait("v1 expanded to 4MiB", T, || async {
        let v = volume(&c, "v1").await;
        let p = &v.status.provisioning;
        p.capacity_bytes == Some(4 * MIB) && p.meta.retry.is_none()
    })
    .await;

    // Refused again, then lowered to what the volume has: withdrawn, no call.
    apply_yaml(&c, "v1-64b", &created("v1", "capacity_min: 64MiB"));
    c.wait("the expansion refused again", T, refused).await;
    let calls = n1.tried("ControllerExpandVolume");
    apply_yaml(&c, "v1-2", &created("v1", "capacity_min: 2MiB"));
    c.wait("the failure withdrawn", T, || async {
        let v = volume(&c, "v1").await;
        let p = &v.status.provisioning;
        p.meta.retry.is_none()
            && p.meta.last_error.is_none()
            && p.meta
                .conditions
                .iter()
                .any(|k| k.type_ == "Expanded" && k.status && k.reason == "ExpansionWithdrawn")
    })
    .await;
    wait_events(&c, "Volume expansion withdrawn", 1).await;
    assert_eq!(
        n1.tried("ControllerExpandVolume"),
        calls,
        "no call to withdraw"
    );
    assert_eq!(
        volume(&c, "v1").await.status.provisioning.capacity_bytes,
        Some(4 * MIB),
        "never shrunk"
    );
    let (_, out) = c.moorctl(&["volume", "status", "v1"]);
    assert!(field(&out, "Conditions").contains("Expanded=true"), "{out}");

    // Still usable: released, and claimed again.
    c.stop_alloc("a1").await;
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    c.apply(c.allocation("a2", "n2", "v1", false)).await;
    c.wait_claim("a2", "n2", ClaimPhase::Published, T).await;
    assert_eq!(n1.count("ControllerExpandVolume", "OK"), 1);
    assert_eq!(n1.count("ControllerExpandVolume", "OutOfRange"), 2);
    c.check_calls(false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offline_plugin_expands_once_released_and_the_node_expands_at_the_next_stage() {
    let _slot = SLOTS.acquire().await.unwrap();
    let opts = plugin_flags(&["--node-expansion-required", "--expansion=offline"]);
    let c = Cluster::start(1, 2, opts).await;
    create_ready(&c, "v1").await;
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;

    apply_yaml(&c, "v1-4", &created("v1", "capacity_min: 4MiB"));
    wait_refused(&c, "v1", "ExpansionWaitsForRelease").await;
    assert_eq!(
        c.node("n1").tried("ControllerExpandVolume"),
        0,
        "never called while the volume is in use"
    );
    c.stop_alloc("a1").await;
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    c.wait("v1 expanded once released", T, || async {
        volume(&c, "v1").await.status.provisioning.capacity_bytes == Some(4 * MIB)
    })
    .await;
    assert_eq!(c.node("n1").count("ControllerExpandVolume", "OK"), 1);

    // The next claim: staged, expanded at the staging path, then published.
    c.apply(c.allocation("a2", "n2", "v1", false)).await;
    c.wait_claim("a2", "n2", ClaimPhase::Published, T).await;
    let m = mount(&c, "a2", "n2").await.unwrap();
    assert_eq!(m.status.expanded_bytes, Some(4 * MIB));
    let calls: Vec<_> = c
        .node("n2")
        .calls()
        .into_iter()
        .filter(|k| k.code == "OK")
        .map(|k| k.rpc)
        .collect();
    let at = |rpc: &str| calls.iter().rposition(|r| r == rpc).unwrap();
    assert!(at("NodeStageVolume") < at("NodeExpandVolume"), "{calls:?}");
    assert!(
        at("NodeExpandVolume") < at("NodePublishVolume"),
        "{calls:?}"
    );
    c.check_calls(false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changed_mutable_parameters_call_controller_modify_volume() {
    let _slot = SLOTS.acquire().await.unwrap();
    let opts = plugin_flags(&["--mutable-parameters=iops,tier"]);
    let c = Cluster::start(1, 1, opts).await;
    let with = |params: &str| {
        created(
            "m1",
            &format!("capacity_min: 1MiB\n  mutable_parameters: {{{params}}}"),
        )
    };
    apply_yaml(&c, "m1", &with("iops: '100'"));
    c.volume_ready("m1").await;
    // CreateVolume carried them: nothing to modify.
    let params = |v: &Volume| (*v.status.provisioning.mutable_parameters).clone();
    assert_eq!(
        params(&volume(&c, "m1").await),
        [("iops".into(), "100".into())].into()
    );
    assert_eq!(c.node("n1").tried("ControllerModifyVolume"), 0);

    apply_yaml(&c, "m1-200", &with("iops: '200', tier: gold"));
    c.wait("m1 modified", T, || async {
        params(&volume(&c, "m1").await)
            .get("iops")
            .map(String::as_str)
            == Some("200")
    })
    .await;
    assert_eq!(c.node("n1").count("ControllerModifyVolume", "OK"), 1);
    let (_, out) = c.moorctl(&["volume", "status", "m1"]);
    assert_eq!(field(&out, "Mutable Parameters"), "iops,tier", "{out}");
    assert!(field(&out, "Conditions").contains("Modified=true"), "{out}");
    wait_events(&c, "Volume modified", 1).await;

    // A parameter the plugin does not accept: its final answer, shown and backed off.
    apply_yaml(&c, "m1-bad", &with("iops: '200', tier: gold, color: red"));
    c.wait("modification failed", T, || async {
        volume(&c, "m1")
            .await
            .status
            .provisioning
            .meta
            .last_error
            .is_some_and(|e| e.contains("color"))
    })
    .await;
    wait_events(&c, "Volume modification failed", 1).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        c.node("n1")
            .count("ControllerModifyVolume", "InvalidArgument"),
        1,
        "a final answer is not repeated before the cap"
    );
    // A removed parameter cannot be unset through CSI: refused, no call.
    apply_yaml(&c, "m1-less", &with("iops: '200'"));
    wait_refused(&c, "m1", "ParameterRemovalUnsupported").await;
    assert_eq!(c.node("n1").tried("ControllerModifyVolume"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_without_modify_volume_gets_a_warning_and_no_call() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 1, PluginOpts::default()).await;
    create_ready(&c, "m1").await;
    apply_yaml(
        &c,
        "m1-p",
        &created(
            "m1",
            "capacity_min: 1MiB\n  mutable_parameters: {iops: '5'}",
        ),
    );
    wait_refused(&c, "m1", "ModifyUnsupported").await;
    wait_events(&c, "ModifyUnsupported", 1).await;
    assert_eq!(c.node("n1").tried("ControllerModifyVolume"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_are_cut_listed_restored_and_deleted_through_moorctl() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 1, PluginOpts::default()).await;
    create_ready(&c, "v1").await;
    // Data in the volume, to find again in the restored one.
    let data = |v: &Volume| {
        std::path::PathBuf::from(v.status.provisioning.volume_context.get("path").unwrap())
    };
    std::fs::write(data(&volume(&c, "v1").await).join("hello"), b"from v1").unwrap();

    // A volume restored from a snapshot that does not exist yet waits for it.
    apply_yaml(
        &c,
        "r1",
        &created("r1", "capacity_min: 1MiB\n  source: {snapshot: s1}"),
    );
    wait_refused(&c, "r1", "WaitingForSource").await;

    snapshot_ready(&c, "v1", "s1");
    let (ok, out) = c.moorctl(&["volume", "snapshot", "list"]);
    assert!(ok, "{out}");
    for header in ["SNAPSHOT ID", "VOLUME ID", "SIZE", "CREATE TIME", "READY"] {
        assert!(out.contains(header), "{out}");
    }
    let row = out
        .lines()
        .find(|l| l.starts_with("s1 "))
        .expect("s1 listed");
    assert!(
        row.contains("v1") && row.contains("yes") && row.contains("snap-"),
        "{row}"
    );
    let (ok, out) = c.moorctl(&["get", "snapshots"]);
    assert!(ok && out.contains("s1"), "{out}");
    let (ok, out) = c.moorctl(&["describe", "snapshot", "s1"]);
    assert!(ok && out.contains("ready_to_use"), "{out}");
    assert_eq!(c.node("n1").count("CreateSnapshot", "OK"), 1);

    // Restored once the snapshot is ready: the data came along.
    wait_phase(&c, "r1", VolumePhase::Ready).await;
    let restored = data(&volume(&c, "r1").await).join("hello");
    assert_eq!(std::fs::read(&restored).unwrap(), b"from v1");
    // A clone of v1 and a restore by the plugin's own snapshot id.
    let sid = c
        .store
        .get(&Snapshot::key_for(&Namespace::default_ns(), "s1"))
        .await
        .unwrap()
        .status
        .snapshot_id
        .unwrap();
    apply_yaml(
        &c,
        "c1",
        &created("c1", "capacity_min: 1MiB\n  source: {volume: v1}"),
    );
    apply_yaml(
        &c,
        "r2",
        &created(
            "r2",
            &format!("capacity_min: 1MiB\n  source: {{external_snapshot_id: {sid}}}"),
        ),
    );
    wait_phase(&c, "c1", VolumePhase::Ready).await;
    wait_phase(&c, "r2", VolumePhase::Ready).await;
    assert_eq!(
        std::fs::read(data(&volume(&c, "c1").await).join("hello")).unwrap(),
        b"from v1"
    );

    // Deleted through the plugin; the finalizer held it until then.
    let (ok, out) = c.moorctl(&["volume", "snapshot", "delete", "s1"]);
    assert!(ok, "{out}");
    c.wait("s1 gone", T, || async {
        c.store
            .try_get(&Snapshot::key_for(&Namespace::default_ns(), "s1"))
            .await
            .unwrap()
            .is_none()
    })
    .await;
    assert_eq!(c.node("n1").count("DeleteSnapshot", "OK"), 1);
    c.wait("the snapshot's created and deleted events", T, || async {
        let (_, out) = c.moorctl(&["events", "--for", "snapshot/s1"]);
        out.contains("Snapshot created") && out.contains("Snapshot deleted")
    })
    .await;
    // A snapshot of a volume that does not exist is refused.
    let (ok, out) = c.moorctl(&["volume", "snapshot", "create", "nope", "s9"]);
    assert!(!ok && out.contains("not found"), "{out}");
}

/// A group snapshot's object.
async fn group_snapshot(c: &Cluster, name: &str) -> Option<VolumeGroupSnapshot> {
    c.store
        .try_get(&VolumeGroupSnapshot::key_for(
            &Namespace::default_ns(),
            name,
        ))
        .await
        .unwrap()
}

async fn snapshot_of(c: &Cluster, name: &str) -> Option<Snapshot> {
    c.store
        .try_get(&Snapshot::key_for(&Namespace::default_ns(), name))
        .await
        .unwrap()
}

/// Issue 53, part 2: a group snapshot is one CreateVolumeGroupSnapshot; each member is
/// a Snapshot restored like any other (the data came along); deleting the group is one
/// DeleteVolumeGroupSnapshot and takes its members; a group made elsewhere is imported
/// (GetVolumeGroupSnapshot) and kept when deleted; a plugin whose answer leaves out a
/// member is named by the contract monitor and the group is Failed, never half made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_snapshots_are_cut_in_one_call_restored_by_member_deleted_and_imported() {
    use moor_hostpath::faults::{Command, Lie};
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 1, PluginOpts::default()).await;
    let data = |v: &Volume| {
        std::path::PathBuf::from(v.status.provisioning.volume_context.get("path").unwrap())
    };
    for v in ["v1", "v2"] {
        create_ready(&c, v).await;
        std::fs::write(
            data(&volume(&c, v).await).join("hello"),
            format!("from {v}"),
        )
        .unwrap();
    }
    let (ok, out) = c.moorctl(&[
        "volume", "snapshot", "create", "nightly", "--group", "v1,v2",
    ]);
    assert!(ok, "{out}");
    let (ok, out) = c.moorctl(&[
        "wait",
        "volumegroupsnapshot/nightly",
        "--for",
        "phase=ready",
        "--timeout",
        "30s",
    ]);
    assert!(ok, "{out}");
    let g = group_snapshot(&c, "nightly").await.unwrap();
    let gid = g.status.group_snapshot_id.clone().unwrap();
    assert_eq!(g.status.members.len(), 2);
    c.wait("both members made", T, || async {
        snapshot_of(&c, "nightly-v1").await.is_some()
            && snapshot_of(&c, "nightly-v2").await.is_some()
    })
    .await;
    for (v, m) in [("v1", &g.status.members[0]), ("v2", &g.status.members[1])] {
        let s = snapshot_of(&c, &format!("nightly-{v}")).await.unwrap();
        assert_eq!(s.spec.group.as_ref().map(|n| n.as_str()), Some("nightly"));
        assert_eq!(s.spec.volume.as_str(), v);
        assert_eq!(
            s.status.snapshot_id.as_deref(),
            Some(m.snapshot_id.as_str())
        );
        assert!(s.status.ready_to_use && s.status.phase == SnapshotPhase::Ready);
    }
    // One call for the group, none per member.
    assert_eq!(c.node("n1").tried("CreateVolumeGroupSnapshot"), 1);
    assert_eq!(c.node("n1").tried("CreateSnapshot"), 0);
    let (ok, out) = c.moorctl(&["get", "vgs"]);
    assert!(
        ok && out
            .lines()
            .any(|l| l.starts_with("nightly ") && l.contains(&gid)),
        "{out}"
    );
    let (ok, out) = c.moorctl(&["describe", "volumegroupsnapshot", "nightly"]);
    assert!(ok && out.contains("Group snapshot created"), "{out}");

    // Each member restores like any snapshot.
    for v in ["v1", "v2"] {
        let r = format!("r-{v}");
        apply_yaml(
            &c,
            &r,
            &created(
                &r,
                &format!("capacity_min: 1MiB\n  source: {{snapshot: nightly-{v}}}"),
            ),
        );
        wait_phase(&c, &r, VolumePhase::Ready).await;
        assert_eq!(
            std::fs::read(data(&volume(&c, &r).await).join("hello")).unwrap(),
            format!("from {v}").as_bytes()
        );
    }

    // Deleted: one DeleteVolumeGroupSnapshot, the members with it.
    let (ok, out) = c.moorctl(&["volume", "snapshot", "delete", "nightly", "--group"]);
    assert!(ok, "{out}");
    c.wait("nightly and its members gone", T, || async {
        group_snapshot(&c, "nightly").await.is_none()
            && snapshot_of(&c, "nightly-v1").await.is_none()
            && snapshot_of(&c, "nightly-v2").await.is_none()
    })
    .await;
    assert_eq!(c.node("n1").count("DeleteVolumeGroupSnapshot", "OK"), 1);
    assert_eq!(c.node("n1").tried("DeleteSnapshot"), 0);

    // A group made elsewhere: imported, restorable, kept in the plugin when deleted.
    let ext = |v: Volume| v.status.provisioning.external_id.unwrap().to_string();
    let sources = vec![ext(volume(&c, "v1").await), ext(volume(&c, "v2").await)];
    let made = c
        .csi()
        .create_group_snapshot(moor::csi::v1::CreateVolumeGroupSnapshotRequest {
            name: "by-hand".into(),
            source_volume_ids: sources,
            ..Default::default()
        })
        .await
        .unwrap()
        .group_snapshot
        .unwrap();
    let (ok, out) = c.moorctl(&[
        "volume",
        "snapshot",
        "import",
        "imp",
        "--group-snapshot-id",
        &made.group_snapshot_id,
        "--source-volume",
        "v1,v2",
    ]);
    assert!(ok, "{out}");
    let (ok, out) = c.moorctl(&[
        "wait",
        "volumegroupsnapshot/imp",
        "--for",
        "phase=ready",
        "--timeout",
        "30s",
    ]);
    assert!(ok, "{out}");
    c.wait("imported members made", T, || async {
        snapshot_of(&c, "imp-v2")
            .await
            .is_some_and(|s| s.status.ready_to_use)
    })
    .await;
    assert!(c.node("n1").count("GetVolumeGroupSnapshot", "OK") >= 1);
    assert_eq!(
        c.node("n1").tried("CreateVolumeGroupSnapshot"),
        2,
        "the test's own"
    );
    let (ok, out) = c.moorctl(&["volume", "snapshot", "delete", "imp", "--group"]);
    assert!(ok, "{out}");
    c.wait("imp gone", T, || async {
        group_snapshot(&c, "imp").await.is_none() && snapshot_of(&c, "imp-v1").await.is_none()
    })
    .await;
    assert_eq!(
        c.node("n1").count("DeleteVolumeGroupSnapshot", "OK"),
        1,
        "kept"
    );
    c.csi()
        .get_group_snapshot(
            moor::csi::v1::GetVolumeGroupSnapshotRequest {
                group_snapshot_id: made.group_snapshot_id.clone(),
                ..Default::default()
            },
            &[],
        )
        .await
        .expect("still in the plugin");

    // A plugin that answers a member short: named once, the group Failed with the
    // reason and no member made; deleting it still deletes what was cut.
    c.node("n1")
        .fault(Command::Lie {
            lie: Lie::GroupMembers,
            on: true,
        })
        .await;
    let (ok, out) = c.moorctl(&["volume", "snapshot", "create", "short", "--group", "v1,v2"]);
    assert!(ok, "{out}");
    c.wait("short Failed", T, || async {
        group_snapshot(&c, "short")
            .await
            .is_some_and(|g| g.status.phase == SnapshotPhase::Failed)
    })
    .await;
    c.wait("group_members_mismatch named", T, || async {
        contract_warnings(&c, "group_members_mismatch", "VolumeGroupSnapshot", "short").await == 1
    })
    .await;
    let g = group_snapshot(&c, "short").await.unwrap();
    assert!(
        g.status
            .meta
            .last_error
            .as_deref()
            .unwrap_or_default()
            .contains("exactly one snapshot of volume v2"),
        "{:?}",
        g.status
    );
    assert!(snapshot_of(&c, "short-v1").await.is_none());
    c.node("n1")
        .fault(Command::Lie {
            lie: Lie::GroupMembers,
            on: false,
        })
        .await;
    let (ok, out) = c.moorctl(&["volume", "snapshot", "delete", "short", "--group"]);
    assert!(ok, "{out}");
    c.wait("short gone", T, || async {
        group_snapshot(&c, "short").await.is_none()
    })
    .await;
    assert_eq!(c.node("n1").count("DeleteVolumeGroupSnapshot", "OK"), 2);

    // Refused up front: a volume that does not exist.
    let (ok, out) = c.moorctl(&["volume", "snapshot", "create", "bad", "--group", "v1,nope"]);
    assert!(!ok && out.contains("not found"), "{out}");
    c.check_calls(false);
}

/// Issue 40, item 4: a snapshot made outside moor (here: CreateSnapshot sent to the
/// plugin directly) is imported by its id, confirmed through ListSnapshots, restored
/// into a new volume with its data, and kept in the plugin when its Snapshot is
/// deleted; an id the plugin does not list fails with the reason and is never cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_made_elsewhere_is_imported_restored_and_kept() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 1, surveyed()).await;
    create_ready(&c, "v1").await;
    let v1 = volume(&c, "v1").await;
    let path = std::path::PathBuf::from(v1.status.provisioning.volume_context.get("path").unwrap());
    std::fs::write(path.join("hello"), b"cut elsewhere").unwrap();
    let made = c
        .csi()
        .create_snapshot(moor::csi::v1::CreateSnapshotRequest {
            source_volume_id: v1
                .status
                .provisioning
                .external_id
                .clone()
                .unwrap()
                .to_string(),
            name: "by-hand".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .snapshot
        .unwrap();
    let id = made.snapshot_id.clone();
    let (ok, out) = c.moorctl(&[
        "volume",
        "snapshot",
        "import",
        "s9",
        "--snapshot-id",
        &id,
        "--source-volume",
        "v1",
    ]);
    assert!(ok, "{out}");
    let (ok, out) = c.moorctl(&[
        "wait",
        "snapshot/s9",
        "--for",
        "phase=ready",
        "--timeout",
        "30s",
    ]);
    assert!(ok, "{out}");
    let snap = c
        .store
        .get(&Snapshot::key_for(&Namespace::default_ns(), "s9"))
        .await
        .unwrap();
    assert_eq!(snap.status.snapshot_id.as_deref(), Some(id.as_str()));
    assert!(snap.status.ready_to_use);
    assert!(c.node("n1").count("ListSnapshots", "OK") >= 1);
    assert_eq!(
        c.node("n1").tried("CreateSnapshot"),
        1,
        "only the test's own"
    );

    // The plugin's own list (the survey's ListSnapshots) shows it, and the Snapshot
    // that names it.
    let listed = || c.moorctl(&["volume", "snapshot", "list", "--plugin", cluster::PLUGIN]);
    c.wait("the plugin's list to show s9", T, || async {
        let (ok, out) = listed();
        ok && out
            .lines()
            .any(|l| l.starts_with(id.as_str()) && l.trim_end().ends_with("default/s9"))
    })
    .await;
    let (ok, out) = c.moorctl(&["volume", "snapshot", "list", "--plugin", "nope.example.com"]);
    assert!(!ok && out.contains("no snapshot list"), "{out}");

    // Restored like any snapshot: the data came along.
    apply_yaml(
        &c,
        "r9",
        &created("r9", "capacity_min: 1MiB\n  source: {snapshot: s9}"),
    );
    wait_phase(&c, "r9", VolumePhase::Ready).await;
    let restored = volume(&c, "r9").await;
    let restored = std::path::PathBuf::from(
        restored
            .status
            .provisioning
            .volume_context
            .get("path")
            .unwrap(),
    );
    assert_eq!(
        std::fs::read(restored.join("hello")).unwrap(),
        b"cut elsewhere"
    );

    // An id the plugin does not list: Failed with the reason, never cut.
    let (ok, out) = c.moorctl(&[
        "volume",
        "snapshot",
        "import",
        "s8",
        "--snapshot-id",
        "no-such-snap",
        "--source-volume",
        "v1",
    ]);
    assert!(ok, "{out}");
    let store = c.store.clone();
    c.wait("s8 to fail", T, || {
        let store = store.clone();
        async move {
            store
                .try_get(&Snapshot::key_for(&Namespace::default_ns(), "s8"))
                .await
                .ok()
                .flatten()
                .is_some_and(|s| {
                    s.status
                        .meta
                        .last_error
                        .as_deref()
                        .is_some_and(|e| e.contains("no-such-snap"))
                })
        }
    })
    .await;
    assert_eq!(c.node("n1").tried("CreateSnapshot"), 1);
    // A malformed id is refused before anything is written.
    let (ok, out) = c.moorctl(&[
        "volume",
        "snapshot",
        "import",
        "s7",
        "--snapshot-id",
        "",
        "--source-volume",
        "v1",
    ]);
    assert!(!ok && out.contains("snapshot_id"), "{out}");

    // Deleted: kept in the plugin (moor did not make it).
    let (ok, out) = c.moorctl(&["volume", "snapshot", "delete", "s9"]);
    assert!(ok, "{out}");
    c.wait("s9 gone", T, || async {
        c.store
            .try_get(&Snapshot::key_for(&Namespace::default_ns(), "s9"))
            .await
            .unwrap()
            .is_none()
    })
    .await;
    assert_eq!(c.node("n1").tried("DeleteSnapshot"), 0);
    let listed = c
        .csi()
        .list_snapshots(moor::csi::v1::ListSnapshotsRequest {
            snapshot_id: id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(listed.entries.len(), 1, "still in the plugin");
}

/// An allocation `name` on `node` writing (or reading) volume `volume` in `mode`.
fn moded_alloc(name: &str, node: &str, volume: &str, mode: &str, read_only: bool) -> String {
    format!(
        "apiVersion: moor/v1\nkind: Allocation\nmetadata: {{name: {name}}}\nspec:\n  node: {node}\n  \
         volumes:\n    - {{name: data, volume: {volume}, access_mode: {mode}, \
         attachment_mode: file-system, read_only: {read_only}}}\n"
    )
}

/// Issue 40, item 1: the spec's two newer single-node modes. single-node-single-writer
/// (Kubernetes' ReadWriteOncePod) admits one claim at a time, anywhere, readers too;
/// single-node-multi-writer publishes several writers on one node. Both need the
/// plugin's SINGLE_NODE_MULTI_WRITER: without it the volume is not created with them
/// and no call asks for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_single_node_single_and_multi_writer_modes() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 2, PluginOpts::default()).await;
    let moded = |name: &str, mode: &str| {
        created(name, "capacity_min: 1MiB").replace("single-node-writer", mode)
    };
    apply_yaml(&c, "once", &moded("once", "single-node-single-writer"));
    apply_yaml(&c, "shared", &moded("shared", "single-node-multi-writer"));
    c.volume_ready("once").await;
    c.volume_ready("shared").await;

    // One claim at a time: a reader on the same node is denied, and says why.
    apply_yaml(
        &c,
        "w1",
        &moded_alloc("w1", "n2", "once", "single-node-single-writer", false),
    );
    c.wait_claim("w1", "n2", ClaimPhase::Published, T).await;
    apply_yaml(
        &c,
        "r1",
        &moded_alloc("r1", "n2", "once", "single-node-single-writer", true),
    );
    c.wait_claim("r1", "n2", ClaimPhase::Denied, T).await;
    let why = c
        .claim("r1", "n2")
        .await
        .unwrap()
        .status
        .reason
        .unwrap_or_default();
    assert!(why.contains("one claim at a time"), "{why}");

    // Two writers on one node, published; a third elsewhere is denied.
    for a in ["m1", "m2"] {
        apply_yaml(
            &c,
            a,
            &moded_alloc(a, "n2", "shared", "single-node-multi-writer", false),
        );
        c.wait_claim(a, "n2", ClaimPhase::Published, T).await;
    }
    apply_yaml(
        &c,
        "m3",
        &moded_alloc("m3", "n1", "shared", "single-node-multi-writer", false),
    );
    c.wait_claim("m3", "n1", ClaimPhase::Denied, T).await;
    // What the node was asked for: the mode itself, never SINGLE_NODE_WRITER.
    let published: Vec<_> = c
        .node("n2")
        .calls()
        .into_iter()
        .filter(|k| k.rpc == "NodePublishVolume" && k.code == "OK")
        .collect();
    assert_eq!(published.len(), 3, "w1, m1, m2");
    let modes: Vec<_> = published
        .iter()
        .map(|k| k.access_mode.clone().unwrap_or_default())
        .collect();
    assert_eq!(
        modes
            .iter()
            .filter(|m| *m == "SINGLE_NODE_MULTI_WRITER")
            .count(),
        2,
        "{modes:?}"
    );
    assert_eq!(
        modes
            .iter()
            .filter(|m| *m == "SINGLE_NODE_SINGLE_WRITER")
            .count(),
        1,
        "{modes:?}"
    );
    c.check_calls(false);

    // A cluster whose plugin does not advertise it: the volume is refused, uncreated.
    drop(c);
    let c = Cluster::start(1, 1, plugin_flags(&["--single-node-multi-writer=false"])).await;
    apply_yaml(&c, "once", &moded("once", "single-node-single-writer"));
    wait_refused(&c, "once", "AccessModeUnsupported").await;
    assert_eq!(c.node("n1").tried("CreateVolume"), 0);
}

/// The access modes a node's plugin was sent in its successful `rpc` calls.
fn modes_sent(c: &Cluster, node: &str, rpc: &str) -> Vec<String> {
    c.node(node)
        .calls()
        .into_iter()
        .filter(|k| k.rpc == rpc && k.code == "OK")
        .map(|k| k.access_mode.unwrap_or_default())
        .collect()
}

/// Issue 40, item 1: a single-node-writer volume with a writer and a reader on one
/// node, on moor-hostpath strict (it refuses a second target path under a mode that
/// does not share a node). Where the plugin advertises SINGLE_NODE_MULTI_WRITER, both
/// are published, and every call about the volume carries that mode; where it does
/// not, admission refuses the reader and says why (`alloc plan` too), nothing the
/// plugin would refuse is sent, and the reader is admitted once the writer is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_node_writer_volume_shares_a_node_only_where_the_plugin_allows_it() {
    let _slot = SLOTS.acquire().await.unwrap();
    for multi_writer_cap in [true, false] {
        let flag = format!("--single-node-multi-writer={multi_writer_cap}");
        let c = Cluster::start(1, 1, plugin_flags(&[flag.as_str()])).await;
        create_ready(&c, "v1").await;
        apply_yaml(&c, "w", &alloc_yaml("w", "n1", "v1", "file-system", ""));
        c.wait_claim("w", "n1", ClaimPhase::Published, T).await;
        let reader = alloc_yaml("r", "n1", "v1", "file-system", ", read_only: true");
        let file = c.dir.path().join("r.yaml");
        std::fs::write(&file, &reader).unwrap();
        let (_, plan) = c.moorctl(&[
            "alloc",
            "plan",
            "-f",
            file.to_str().unwrap(),
            "--node",
            "n1",
            "-o",
            "json",
        ]);
        apply_yaml(&c, "r", &reader);
        if multi_writer_cap {
            c.wait_claim("r", "n1", ClaimPhase::Published, T).await;
            for rpc in [
                "ControllerPublishVolume",
                "NodeStageVolume",
                "NodePublishVolume",
            ] {
                let modes = modes_sent(&c, "n1", rpc);
                assert!(
                    !modes.is_empty() && modes.iter().all(|m| m == "SINGLE_NODE_MULTI_WRITER"),
                    "{rpc}: {modes:?}"
                );
            }
            assert_eq!(modes_sent(&c, "n1", "NodePublishVolume").len(), 2);
            assert!(!plan.contains("once per node"), "{plan}");
        } else {
            c.wait_claim("r", "n1", ClaimPhase::Denied, T).await;
            let why = c.claim("r", "n1").await.unwrap().status.reason;
            let why = why.unwrap_or_default();
            assert!(
                why.contains("once per node") && why.contains("SINGLE_NODE_MULTI_WRITER"),
                "{why}"
            );
            assert!(plan.contains("once per node"), "alloc plan: {plan}");
            // The writer gone, the reader is admitted and published in its turn.
            c.stop_alloc("w").await;
            c.wait_claim("r", "n1", ClaimPhase::Published, T).await;
            let modes = modes_sent(&c, "n1", "NodePublishVolume");
            assert_eq!(modes, ["SINGLE_NODE_WRITER", "SINGLE_NODE_WRITER"]);
        }
        // Nothing the strict plugin refused, and nothing its checker finds.
        for rpc in ["ControllerPublishVolume", "NodePublishVolume"] {
            assert_eq!(c.node("n1").count(rpc, "FailedPrecondition"), 0, "{rpc}");
            assert_eq!(c.node("n1").count(rpc, "AlreadyExists"), 0, "{rpc}");
        }
        c.check_calls(false);
    }
}

/// How many "Plugin broke the CSI contract" Warnings name `rule` on object `kind`
/// `name`.
async fn contract_warnings(c: &Cluster, rule: &str, kind: &str, name: &str) -> u32 {
    events_of(c, "Plugin broke the CSI contract")
        .await
        .iter()
        .filter(|e| {
            e.spec.message.contains(&format!("rule {rule}:"))
                && e.spec.object.kind == kind
                && e.spec.object.name.as_str() == name
        })
        .map(|e| e.spec.count())
        .sum()
}

/// Issue 40, item 5: the live contract monitor. moor-hostpath is told to break one MUST
/// of the spec after another; each breach raises one "Plugin broke the CSI contract"
/// Warning on its object and counts once in
/// `moor_plugin_contract_violations_total{plugin,rule}`, however often the plugin
/// repeats it, and moor goes on as it would: the claims publish and release and the
/// volumes are deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_that_breaks_the_contract_is_named_once_per_rule_and_object() {
    use moor_hostpath::faults::{Command, Lie};
    let _slot = SLOTS.acquire().await.unwrap();
    let mut opts = surveyed();
    opts.extra = vec!["--topology=zone=a".into()];
    let c = Cluster::start(1, 1, opts).await;
    let n1 = c.node("n1");
    let lie = |lie: Lie, on: bool| n1.fault(Command::Lie { lie, on });
    let c = &c;
    let warned = |rule, kind, name| contract_warnings(c, rule, kind, name);
    let wait_warned = |rule: &'static str, kind: &'static str, name: &'static str| async move {
        c.wait(&format!("{rule} on {kind} {name}"), T, || async move {
            contract_warnings(c, rule, kind, name).await >= 1
        })
        .await;
    };

    // CreateVolume: a capacity below the range, and a topology outside the requisite.
    // (The topology lie only for v2: a volume answered outside its node's topology
    // cannot be claimed there, as the plugin said.)
    lie(Lie::Capacity, true).await;
    create_ready(c, "v1").await;
    lie(Lie::Topology, true).await;
    apply_yaml(
        c,
        "v2",
        &created(
            "v2",
            "capacity_min: 1MiB\n  topology_request: {required: [{zone: a}]}",
        ),
    );
    c.volume_ready("v2").await;
    lie(Lie::Capacity, false).await;
    lie(Lie::Topology, false).await;
    wait_warned("capacity_out_of_range", "Volume", "v1").await;
    wait_warned("capacity_out_of_range", "Volume", "v2").await;
    wait_warned("topology_outside_requisite", "Volume", "v2").await;
    assert_eq!(
        warned("topology_outside_requisite", "Volume", "v1").await,
        0
    );
    create_ready(c, "v3").await;

    // Two volumes published; then NodeGetInfo changes its node id and lowers its limit.
    for (a, v) in [("a1", "v1"), ("a3", "v3")] {
        c.apply(c.allocation(a, "n1", v, false)).await;
        c.wait_claim(a, "n1", ClaimPhase::Published, T).await;
    }
    lie(Lie::NodeId, true).await;
    lie(Lie::MaxVolumes, true).await;
    wait_warned("node_id_changed", "Node", "n1").await;
    wait_warned("max_volumes_below_published", "Node", "n1").await;
    lie(Lie::NodeId, false).await;
    lie(Lie::MaxVolumes, false).await;

    // ListVolumes leaves out what it created, survey after survey: named once each
    // (r1, registered later, was not created by it).
    lie(Lie::Unlisted, true).await;
    for v in ["v1", "v2", "v3"] {
        wait_warned("volume_not_listed", "Volume", v).await;
    }
    lie(Lie::NegativeCapacity, true).await;
    wait_warned("negative_capacity", "Plugin", cluster::PLUGIN).await;
    // A few more surveys with both lies still told.
    for _ in 0..3 {
        let before = c.node("n1").tried("ListVolumes");
        c.wait("another survey", T, || async {
            c.node("n1").tried("ListVolumes") > before
        })
        .await;
    }
    lie(Lie::Unlisted, false).await;
    lie(Lie::NegativeCapacity, false).await;

    // An expansion answered short, a snapshot of another volume, a registration
    // confirmed with other capabilities.
    lie(Lie::Expansion, true).await;
    apply_yaml(c, "v3-2", &created("v3", "capacity_min: 2MiB"));
    wait_warned("capacity_out_of_range", "Volume", "v3").await;
    lie(Lie::Expansion, false).await;
    lie(Lie::SnapshotSource, true).await;
    let (ok, out) = c.moorctl(&["volume", "snapshot", "create", "v1", "s1"]);
    assert!(ok, "{out}");
    wait_warned("snapshot_of_other_volume", "Snapshot", "s1").await;
    lie(Lie::SnapshotSource, false).await;
    lie(Lie::Validation, true).await;
    let ext = volume(c, "v1")
        .await
        .status
        .provisioning
        .external_id
        .unwrap();
    apply_yaml(
        c,
        "r1",
        &registered("r1", ext.as_str(), "single-node-writer"),
    );
    wait_warned("confirmed_other_capabilities", "Volume", "r1").await;
    lie(Lie::Validation, false).await;

    // Once each, and counted once each.
    let once = [
        ("capacity_out_of_range", "Volume", "v1"),
        ("capacity_out_of_range", "Volume", "v2"),
        ("capacity_out_of_range", "Volume", "v3"),
        ("topology_outside_requisite", "Volume", "v2"),
        ("node_id_changed", "Node", "n1"),
        ("max_volumes_below_published", "Node", "n1"),
        ("volume_not_listed", "Volume", "v1"),
        ("volume_not_listed", "Volume", "v2"),
        ("volume_not_listed", "Volume", "v3"),
        ("negative_capacity", "Plugin", cluster::PLUGIN),
        ("snapshot_of_other_volume", "Snapshot", "s1"),
        ("confirmed_other_capabilities", "Volume", "r1"),
    ];
    for (rule, kind, name) in once {
        assert_eq!(warned(rule, kind, name).await, 1, "{rule} on {kind} {name}");
    }
    let page = c.node("n1").http_get("/metrics").await;
    for (rule, n) in [
        ("capacity_out_of_range", 3.0),
        ("topology_outside_requisite", 1.0),
        ("node_id_changed", 1.0),
        ("max_volumes_below_published", 1.0),
        ("volume_not_listed", 3.0),
        ("negative_capacity", 1.0),
        ("snapshot_of_other_volume", 1.0),
        ("confirmed_other_capabilities", 1.0),
    ] {
        let series = format!(
            "moor_plugin_contract_violations_total{{plugin=\"{}\",rule=\"{rule}\"}}",
            cluster::PLUGIN
        );
        assert_eq!(common::metric(&page, &series), Some(n), "{series}");
    }

    // moor went on as it would: released, deleted, nothing left behind.
    for a in ["a1", "a3"] {
        c.stop_alloc(a).await;
        c.wait_claim(a, "n1", ClaimPhase::Released, T).await;
    }
    let (ok, out) = c.moorctl(&["volume", "snapshot", "delete", "s1"]);
    assert!(ok, "{out}");
    for v in ["r1", "v1", "v2", "v3"] {
        let (ok, out) = c.moorctl(&["delete", "volume", v]);
        assert!(ok, "{out}");
    }
    c.wait("every volume gone", T, || async {
        c.store
            .list::<VolumeSpec>(&KeyScope::all())
            .await
            .is_ok_and(|l| l.items.is_empty())
    })
    .await;
    c.check_calls(true);
}

fn alloc_yaml(name: &str, node: &str, volume: &str, attach: &str, extra: &str) -> String {
    format!(
        "apiVersion: moor/v1\nkind: Allocation\nmetadata: {{name: {name}}}\nspec:\n  node: {node}\n  \
         volumes:\n    - {{name: data, volume: {volume}, access_mode: single-node-writer, \
         attachment_mode: {attach}{extra}}}\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mount_group_reaches_the_node_calls_only_where_the_node_advertises_it() {
    let _slot = SLOTS.acquire().await.unwrap();
    let opts = plugin_flags(&["--volume-mount-group"]);
    let c = Cluster::start(1, 2, opts).await;
    create_ready(&c, "v1").await;
    let group = ", mount_options: {mount_group: '4321'}";
    apply_yaml(
        &c,
        "a1",
        &alloc_yaml("a1", "n2", "v1", "file-system", group),
    );
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    for rpc in ["NodeStageVolume", "NodePublishVolume"] {
        let calls: Vec<_> = c
            .node("n2")
            .calls()
            .into_iter()
            .filter(|k| k.rpc == rpc && k.code == "OK")
            .collect();
        assert_eq!(calls.len(), 1, "{rpc}");
        assert_eq!(calls[0].mount_group.as_deref(), Some("4321"), "{rpc}");
    }
    let (ok, out) = c.moorctl(&["get", "claims", "-o", "yaml"]);
    assert!(ok && out.contains("mount_group: '4321'"), "{out}");
    // A malformed group is refused at apply time.
    let bad = alloc_yaml(
        "a2",
        "n2",
        "v1",
        "file-system",
        ", mount_options: {mount_group: 'a b'}",
    );
    let path = c.dir.path().join("bad.yaml");
    std::fs::write(&path, bad).unwrap();
    let (ok, out) = c.moorctl(&["apply", "-f", path.to_str().unwrap()]);
    assert!(!ok && out.contains("mount_group"), "{out}");
    c.check_calls(false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mount_group_is_denied_at_admission_where_the_node_lacks_volume_mount_group() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 2, PluginOpts::default()).await;
    create_ready(&c, "v1").await;
    let group = ", mount_options: {mount_group: '4321'}";
    apply_yaml(
        &c,
        "a1",
        &alloc_yaml("a1", "n2", "v1", "file-system", group),
    );
    c.wait_denied("a1", "n2", "VOLUME_MOUNT_GROUP", T).await;
    assert_eq!(
        c.node("n2")
            .calls()
            .iter()
            .filter(|k| k.rpc.starts_with("Node") && k.rpc.contains("Stage"))
            .count(),
        0
    );
    let (_, out) = c.moorctl(&["get", "claims", "-o", "wide"]);
    assert!(out.contains("VOLUME_MOUNT_GROUP"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_volume_is_staged_published_and_released_as_a_device() {
    let _slot = SLOTS.acquire().await.unwrap();
    // Real loop devices where the machine allows them; a file standing for the device
    // otherwise.
    let loops = cluster::can_loop();
    let flags: &[&str] = if loops { &["--loop-devices"] } else { &[] };
    let c = Cluster::start(1, 2, plugin_flags(flags)).await;
    let block = format!(
        "apiVersion: moor/v1\nkind: Volume\nmetadata: {{name: b1}}\nspec:\n  plugin_id: {}\n  \
         capacity_min: 1MiB\n  capabilities:\n    - {{access_mode: single-node-writer, attachment_mode: block-device}}\n",
        cluster::PLUGIN
    );
    apply_yaml(&c, "b1", &block);
    c.volume_ready("b1").await;
    apply_yaml(&c, "a1", &alloc_yaml("a1", "n2", "b1", "block-device", ""));
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    let m = mount(&c, "a1", "n2").await.unwrap();
    assert!(
        m.spec.target_path.contains("block-device"),
        "{}",
        m.spec.target_path
    );
    let target = std::path::Path::new(&m.spec.target_path);
    let backing = std::path::PathBuf::from(
        volume(&c, "b1")
            .await
            .status
            .provisioning
            .volume_context
            .get("path")
            .unwrap(),
    )
    .join("block");
    if loops {
        use std::os::unix::fs::FileTypeExt;
        let kind = std::fs::metadata(target).unwrap().file_type();
        assert!(
            kind.is_block_device(),
            "{} is not a block device",
            target.display()
        );
        assert!(cluster::loops_of(&backing).contains("/dev/loop"));
    } else if cluster::can_mount() {
        // The "device": a file bind-mounted on a file.
        assert!(target.is_file());
    }
    for rpc in ["NodeStageVolume", "NodePublishVolume"] {
        assert_eq!(c.node("n2").count(rpc, "OK"), 1, "{rpc}");
    }
    let (ok, out) = c.moorctl(&["alloc", "stop", "a1"]);
    assert!(ok, "{out}");
    c.wait_claim("a1", "n2", ClaimPhase::Released, T).await;
    assert_eq!(c.node("n2").count("NodeUnstageVolume", "OK"), 1);
    // Released: no loop device left behind.
    assert_eq!(cluster::loops_of(&backing), "");
    c.check_calls(true);
}

fn surveyed() -> PluginOpts {
    PluginOpts {
        agent_args: vec![
            "--volume-stats-interval=1s".into(),
            "--survey-interval=1s".into(),
        ],
        ..Default::default()
    }
}

fn condition(v: &Volume, t: &str) -> Option<Condition> {
    v.status
        .provisioning
        .meta
        .conditions
        .iter()
        .chain(&v.status.claims.meta.conditions)
        .find(|c| c.type_ == t)
        .cloned()
}

/// A 1.13 health condition for moor-hostpath's faults.
fn entry(status: &str, reason: &str, message: &str) -> moor_hostpath::faults::HealthEntry {
    moor_hostpath::faults::HealthEntry {
        status: status.into(),
        reason: reason.into(),
        message: message.into(),
    }
}

/// The value of one series of a node's /metrics, if it is there.
async fn metric(c: &Cluster, node: &str, series: &str) -> Option<String> {
    let text = c.node(node).http_get("/metrics").await;
    text.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')
            .map(str::to_string)
    })
}

/// How a test makes a plugin report a volume unhealthy (or healthy: `None`), in one
/// generation of the health API.
type SetHealth = fn(&str, Option<(&str, &str)>) -> moor_hostpath::faults::Command;

/// Volume health through the node plugin and the controller plugin, whichever
/// generation of the API the plugin serves (`health_api`, moor-hostpath's flag): each
/// change shows in describe, `volume status`, the node's metric and an event.
async fn volume_health_is_read_from_node_and_controller(health_api: &str, set: SetHealth) {
    let _slot = SLOTS.acquire().await.unwrap();
    let mut opts = surveyed();
    opts.extra.push(format!("--health-api={health_api}"));
    let c = Cluster::start(1, 2, opts).await;
    create_ready(&c, "v1").await;
    let ext = volume(&c, "v1")
        .await
        .status
        .provisioning
        .external_id
        .unwrap()
        .to_string();
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    // NodeGetVolumeStats at the target path, on the Mount and in n2's /metrics.
    c.wait("usage on the Mount", T, || async {
        mount(&c, "a1", "n2").await.is_some_and(|m| {
            m.status
                .usage
                .is_some_and(|u| u.bytes_total.unwrap_or(0) > 0)
        })
    })
    .await;
    let series = r#"moor_volume{namespace="default",volume="v1",resource="abnormal"}"#;
    c.wait("healthy in the metric", T, || async {
        metric(&c, "n2", series).await.as_deref() == Some("0")
    })
    .await;
    assert!(metric(
        &c,
        "n2",
        r#"moor_volume{namespace="default",volume="v1",resource="bytes_total"}"#
    )
    .await
    .is_some());
    let (_, out) = c.moorctl(&["volume", "status", "v1"]);
    let row = out
        .lines()
        .find(|l| l.starts_with("a1 "))
        .unwrap_or_default();
    assert!(row.contains("normal") && row.contains('/'), "{out}");

    // n2's plugin reports the volume unhealthy: a condition on the volume, a Warning,
    // the metric, describe and `volume status`.
    c.node("n2")
        .fault(set(&ext, Some(("PathMissing", "disk on fire"))))
        .await;
    c.wait("HealthyOnNodes false", T, || async {
        condition(&volume(&c, "v1").await, "HealthyOnNodes").is_some_and(|k| {
            !k.status
                && k.message.contains("node n2: ")
                && k.message.contains("disk on fire")
                && !k.message.contains("FromALaterSpec")
        })
    })
    .await;
    wait_events(&c, "Volume abnormal", 1).await;
    assert_eq!(metric(&c, "n2", series).await.as_deref(), Some("1"));
    let (_, out) = c.moorctl(&["volume", "status", "v1"]);
    assert!(
        out.contains("abnormal: ") && out.contains("disk on fire"),
        "{out}"
    );
    assert!(
        field(&out, "Conditions").contains("HealthyOnNodes=false"),
        "{out}"
    );
    assert!(
        field(&out, "Health").starts_with("unhealthy: node n2: "),
        "{out}"
    );
    let (_, out) = c.moorctl(&["describe", "volume", "v1"]);
    assert!(
        out.contains("disk on fire") && out.contains("Volume abnormal"),
        "{out}"
    );
    let (_, out) = c.moorctl(&["get", "volumes", "-o", "wide"]);
    assert!(
        out.lines()
            .any(|l| l.starts_with("v1 ") && l.contains("unhealthy")),
        "{out}"
    );

    // Healthy again: the condition, a Normal event, the metric.
    c.node("n2").fault(set(&ext, None)).await;
    c.wait("HealthyOnNodes true again", T, || async {
        condition(&volume(&c, "v1").await, "HealthyOnNodes").is_some_and(|k| k.status)
    })
    .await;
    wait_events(&c, "Volume healthy", 1).await;
    assert_eq!(metric(&c, "n2", series).await.as_deref(), Some("0"));
    let (_, out) = c.moorctl(&["volume", "status", "v1"]);
    assert_eq!(field(&out, "Health"), "healthy", "{out}");

    // The controller plugin's view.
    c.node("n1")
        .fault(set(&ext, Some(("ReplicaLost", "replica lost"))))
        .await;
    c.wait("Healthy false", T, || async {
        condition(&volume(&c, "v1").await, "Healthy")
            .is_some_and(|k| !k.status && k.message.contains("replica lost"))
    })
    .await;
    wait_events(&c, "Volume abnormal", 2).await;
    let (_, out) = c.moorctl(&["describe", "volume", "v1"]);
    assert!(out.contains("replica lost"), "{out}");
    c.node("n1").fault(set(&ext, None)).await;
    c.wait("Healthy true again", T, || async {
        condition(&volume(&c, "v1").await, "Healthy").is_some_and(|k| k.status)
    })
    .await;
    wait_events(&c, "Volume healthy", 2).await;
    let calls = c.node("n1").calls();
    let called = |rpc: &str| calls.iter().any(|k| k.rpc == rpc);
    let calls2 = c.node("n2").calls();
    let called2 = |rpc: &str| calls2.iter().any(|k| k.rpc == rpc);
    if health_api == "1.13" {
        assert!(called("ControllerListVolumeHealth") && called2("NodeGetVolumeHealth"));
    } else {
        assert!(!called("ControllerListVolumeHealth") && !called2("NodeGetVolumeHealth"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volume_health_from_a_1_12_plugin_is_read_from_its_volume_conditions() {
    fn set(ext: &str, bad: Option<(&str, &str)>) -> moor_hostpath::faults::Command {
        moor_hostpath::faults::Command::Condition {
            volume_id: ext.to_string(),
            abnormal: bad.is_some(),
            message: bad.map(|(_, m)| m.to_string()).unwrap_or_default(),
        }
    }
    volume_health_is_read_from_node_and_controller("1.12", set).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volume_health_from_a_1_13_plugin_is_read_from_the_health_rpcs() {
    fn set(ext: &str, bad: Option<(&str, &str)>) -> moor_hostpath::faults::Command {
        moor_hostpath::faults::Command::Health {
            volume_id: ext.to_string(),
            // A type this moor does not know (9) is ignored, as the spec requires.
            statuses: bad
                .map(|(reason, msg)| {
                    vec![
                        entry("9", "FromALaterSpec", "ignored"),
                        entry("INACCESSIBLE", reason, msg),
                    ]
                })
                .unwrap_or_default(),
        }
    }
    volume_health_is_read_from_node_and_controller("1.13", set).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn storage_health_seen_from_a_node_shows_on_the_node_with_an_event_and_a_metric() {
    use moor_hostpath::faults::Command;
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 2, surveyed()).await;
    let series = format!(
        r#"moor_storage_unhealthy{{plugin="{}",status="StorageUnreachable"}}"#,
        cluster::PLUGIN
    );
    c.wait("the storage healthy in n2's metric", T, || async {
        metric(&c, "n2", &series).await.as_deref() == Some("0")
    })
    .await;
    let (_, out) = c.moorctl(&["get", "nodes", "-o", "wide"]);
    assert!(
        out.lines()
            .any(|l| l.starts_with("n2 ") && l.contains(&format!("{}(healthy)", cluster::PLUGIN))),
        "{out}"
    );

    // Only a type moor does not know: still healthy, nothing said.
    c.node("n2")
        .fault(Command::StorageHealth {
            statuses: vec![entry("7", "FromALaterSpec", "")],
        })
        .await;
    let asked = || async {
        c.node("n2")
            .calls()
            .iter()
            .filter(|k| k.rpc == "NodeGetStorageHealth")
            .count()
    };
    let before = asked().await;
    c.wait("two more NodeGetStorageHealth", T, || async {
        asked().await >= before + 2
    })
    .await;
    assert_eq!(metric(&c, "n2", &series).await.as_deref(), Some("0"));
    assert!(events_of(&c, "Storage unhealthy").await.is_empty());
    c.node("n2")
        .fault(Command::StorageHealth {
            statuses: vec![
                entry("7", "FromALaterSpec", ""),
                entry(
                    "STORAGE_UNREACHABLE",
                    "NetworkPartition",
                    "no route to the array",
                ),
            ],
        })
        .await;
    c.wait("unreachable in n2's metric", T, || async {
        metric(&c, "n2", &series).await.as_deref() == Some("1")
    })
    .await;
    wait_events(&c, "Storage unhealthy", 1).await;
    let warned = events_of(&c, "Storage unhealthy").await;
    assert!(
        warned[0]
            .spec
            .message
            .contains("StorageUnreachable/NetworkPartition: no route to the array")
            && !warned[0].spec.message.contains("FromALaterSpec"),
        "{:?}",
        warned[0].spec
    );
    let (_, out) = c.moorctl(&["get", "nodes", "-o", "wide"]);
    assert!(
        out.lines().any(|l| l.starts_with("n2 ")
            && l.contains(&format!(
                "{}(StorageUnreachable/NetworkPartition)",
                cluster::PLUGIN
            ))),
        "{out}"
    );
    let (_, out) = c.moorctl(&["describe", "node", "n2"]);
    assert!(
        out.contains("no route to the array") && out.contains("Storage unhealthy"),
        "{out}"
    );
    // n1 sees its storage well.
    assert_eq!(metric(&c, "n1", &series).await.as_deref(), Some("0"));

    c.node("n2")
        .fault(Command::StorageHealth { statuses: vec![] })
        .await;
    c.wait("healthy again in n2's metric", T, || async {
        metric(&c, "n2", &series).await.as_deref() == Some("0")
    })
    .await;
    wait_events(&c, "Storage healthy", 1).await;
    wait_events(&c, "Storage unhealthy", 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_capacity_is_recorded_and_a_volume_that_fits_nowhere_is_not_created() {
    let _slot = SLOTS.acquire().await.unwrap();
    let mut opts = surveyed();
    opts.extra.push("--capacity=10MiB".into());
    let c = Cluster::start(1, 1, opts).await;
    wait_capacity(&c, "capacity recorded", |s| {
        s.iter()
            .any(|e| e.topology.is_empty() && e.available_bytes == 10 * MIB)
    })
    .await;
    let (_, out) = c.moorctl(&["plugin", "status", cluster::PLUGIN]);
    assert!(
        field(&out, "Capacity").contains("10.0 MiB available"),
        "{out}"
    );

    apply_yaml(&c, "big", &created("big", "capacity_min: 20MiB"));
    wait_refused(&c, "big", "InsufficientCapacity").await;
    let big = volume(&c, "big").await;
    assert_eq!(big.status.provisioning.phase, VolumePhase::Pending);
    wait_events(&c, "InsufficientCapacity", 1).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let creates = c
        .node("n1")
        .calls()
        .into_iter()
        .filter(|k| {
            k.rpc == "CreateVolume" && k.name.as_deref() == Some(plugin_name_of(&big).as_str())
        })
        .count();
    assert_eq!(creates, 0, "never called while it cannot fit");

    // A smaller one fits; the big one, shrunk by its operator, too.
    apply_yaml(&c, "big", &created("big", "capacity_min: 4MiB"));
    wait_phase(&c, "big", VolumePhase::Ready).await;
    wait_capacity(&c, "capacity updated", |s| {
        s.iter().any(|e| e.available_bytes == 6 * MIB)
    })
    .await;
}

async fn csi_volume(c: &Cluster, name: &str) -> String {
    let req = moor::csi::v1::CreateVolumeRequest {
        name: name.to_string(),
        capacity_range: Some(moor::csi::v1::CapacityRange {
            required_bytes: 1 << 20,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![moor::csi::convert::capability(
            VolumeCapability {
                access_mode: AccessMode::SingleNodeWriter,
                attachment_mode: AttachmentMode::FileSystem,
            },
            &MountOptions::default(),
        )],
        ..Default::default()
    };
    c.csi()
        .create_volume(req)
        .await
        .unwrap()
        .volume
        .unwrap()
        .volume_id
}

/// A volume moor registered that the plugin then loses, and an attachment the plugin
/// reports that moor never made; returns the cluster and that volume's id.
/// ControllerPublishVolume of `volume_id` to `node_id`, sent to the plugin directly.
async fn publish_behind_moor_s_back(c: &Cluster, volume_id: &str, node_id: &str) {
    c.csi()
        .controller_publish(moor::csi::v1::ControllerPublishVolumeRequest {
            volume_id: volume_id.to_string(),
            node_id: node_id.to_string(),
            volume_capability: Some(moor::csi::convert::capability(
                VolumeCapability {
                    access_mode: AccessMode::SingleNodeWriter,
                    attachment_mode: AttachmentMode::FileSystem,
                },
                &MountOptions::default(),
            )),
            ..Default::default()
        })
        .await
        .unwrap();
}

async fn drift(opts: PluginOpts) -> (Cluster, String) {
    let c = Cluster::start(1, 2, opts).await;
    // Registered volumes over volumes made behind moor's back.
    let lost = csi_volume(&c, "lost").await;
    let stray = csi_volume(&c, "stray").await;
    apply_yaml(
        &c,
        "lost",
        &registered("lost", &lost, "single-node-writer")
            .replace("  accessible_topology: [{rack: r1}]\n", ""),
    );
    apply_yaml(
        &c,
        "stray",
        &registered("stray", &stray, "single-node-writer")
            .replace("  accessible_topology: [{rack: r1}]\n", ""),
    );
    wait_phase(&c, "lost", VolumePhase::Ready).await;
    wait_phase(&c, "stray", VolumePhase::Ready).await;
    c.csi()
        .delete_volume(moor::csi::v1::DeleteVolumeRequest {
            volume_id: lost,
            ..Default::default()
        })
        .await
        .unwrap();
    publish_behind_moor_s_back(&c, &stray, "csi-n2").await;
    wait_refused(&c, "lost", "MissingFromPlugin").await;
    c.wait("stray attachment reported", T, || async {
        condition(&volume(&c, "stray").await, "Attachments")
            .is_some_and(|k| !k.status && k.message.contains("csi-n2"))
    })
    .await;
    wait_events(&c, "Volume missing", 1).await;
    wait_events(&c, "Unknown attachment", 1).await;
    // Flagged, never deleted.
    assert!(c.store.try_get(&vol_key("lost")).await.unwrap().is_some());
    (c, stray)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drift_is_reported_and_nothing_is_deleted_or_unpublished_by_default() {
    let _slot = SLOTS.acquire().await.unwrap();
    let (c, _) = drift(surveyed()).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(c.node("n1").tried("ControllerUnpublishVolume"), 0);
    let (_, out) = c.moorctl(&["volume", "status", "lost"]);
    assert!(
        field(&out, "Conditions").contains("Present=false(MissingFromPlugin)"),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_attachment_is_unpublished_when_the_operator_opted_in() {
    let _slot = SLOTS.acquire().await.unwrap();
    let mut opts = surveyed();
    opts.agent_args
        .push("--unpublish-unknown-attachments".into());
    let (c, stray) = drift(opts).await;
    c.wait("stray unpublished", T, || async {
        c.node("n1").calls().iter().any(|k| {
            k.rpc == "ControllerUnpublishVolume"
                && k.code == "OK"
                && k.volume_id.as_deref() == Some(stray.as_str())
                && k.node_id.as_deref() == Some("csi-n2")
        })
    })
    .await;
    c.wait("Attachments true again", T, || async {
        condition(&volume(&c, "stray").await, "Attachments").is_some_and(|k| k.status)
    })
    .await;
    wait_events(&c, "Unknown attachment unpublished", 1).await;
}

/// Issue 40, item 2: a volume detached behind moor's back (here: ControllerUnpublish
/// sent to the plugin directly) is noticed within two survey passes, warned about, and
/// published again; nothing is unpublished by moor, and the claim stays published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_detached_behind_moor_s_back_is_published_again() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 2, surveyed()).await;
    // Two volumes published on n2: v2 stays listed, which shows the plugin fills the
    // published nodes (a plugin that never does is left alone).
    for (v, a) in [("v1", "a1"), ("v2", "a2")] {
        create_ready(&c, v).await;
        apply_yaml(&c, a, &alloc_yaml(a, "n2", v, "file-system", ""));
        c.wait_claim(a, "n2", ClaimPhase::Published, T).await;
    }
    let publishes = || c.node("n1").count("ControllerPublishVolume", "OK");
    assert_eq!(publishes(), 2);
    let att = c
        .store
        .list::<AttachmentSpec>(&KeyScope::all())
        .await
        .unwrap()
        .items
        .into_iter()
        .find(|a| a.spec.volume.as_str() == "v1")
        .expect("the claim's attachment");
    assert_eq!(att.status.phase, AttachmentPhase::Attached);
    c.csi()
        .controller_unpublish(moor::csi::v1::ControllerUnpublishVolumeRequest {
            volume_id: att.spec.external_id.to_string(),
            node_id: att.spec.csi_node_id.to_string(),
            ..Default::default()
        })
        .await
        .unwrap();
    c.wait("the volume published again", T, || async {
        publishes() == 3
    })
    .await;
    wait_events(&c, "Detached behind moor's back", 1).await;
    let store = c.store.clone();
    let key = att.object_key();
    c.wait("the attachment Attached again", T, || {
        let (store, key) = (store.clone(), key.clone());
        async move {
            store
                .try_get(&key)
                .await
                .ok()
                .flatten()
                .is_some_and(|a| a.status.phase == AttachmentPhase::Attached)
        }
    })
    .await;
    // The plugin attached it again as another device (its publish_context names
    // it): the node stages and publishes v1 again with the new context, which the
    // plugin checks (a stale one is FAILED_PRECONDITION), and leaves v2 alone.
    let n2 = c.node("n2");
    c.wait("v1 staged again", T, || async move {
        n2.count("NodeStageVolume", "OK") == 3 && n2.count("NodePublishVolume", "OK") == 3
    })
    .await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    let n2 = c.node("n2");
    assert_eq!(n2.count("NodeStageVolume", "FailedPrecondition"), 0);
    assert_eq!(n2.count("NodePublishVolume", "FailedPrecondition"), 0);
    assert_eq!(
        (
            n2.tried("NodeUnpublishVolume"),
            n2.tried("NodeUnstageVolume")
        ),
        (1, 1),
        "v1's old stage and publish torn down, once"
    );
    if cluster::can_mount() {
        // The workload's next write lands in the volume.
        let target = mount(&c, "a1", "n2").await.unwrap().spec.target_path;
        std::fs::write(std::path::Path::new(&target).join("after.txt"), "ok").unwrap();
    }
    // moor unpublished nothing (the one call is the test's), and a listed attachment
    // is left alone: no third publish over a few more passes.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(c.node("n1").tried("ControllerUnpublishVolume"), 1);
    assert_eq!(publishes(), 3);
    assert_eq!(c.node("n2").tried("NodeStageVolume"), 3);
    // (No call-log check: the test's own unpublish breaks invariant 3 on purpose, as a
    // console detaching a volume in use would.)
}

/// Issue 40, item 3: the survey's ControllerUnpublishVolume of an unknown attachment
/// runs on the step runner's schedule. It was made on every pass (each
/// `--survey-interval`), however the plugin answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_survey_s_unpublish_follows_the_step_schedule() {
    use moor_hostpath::faults::Command;
    let _slot = SLOTS.acquire().await.unwrap();
    let mut opts = surveyed();
    opts.agent_args
        .push("--unpublish-unknown-attachments".into());
    let (c, stray) = drift(opts).await;
    c.node("n1")
        .fault(Command::Fail {
            rpc: "ControllerUnpublishVolume".into(),
            code: "Unavailable".into(),
            times: 100_000,
        })
        .await;
    // drift() leaves it found; the survey may have unpublished it already: publish it
    // behind moor's back again, now that unpublishing it fails.
    publish_behind_moor_s_back(&c, &stray, "csi-n2").await;
    let n1 = c.node("n1");
    c.wait("the unpublish to fail", T, || async move {
        n1.count("ControllerUnpublishVolume", "Unavailable") > 0
    })
    .await;
    let first = c.node("n1").tried("ControllerUnpublishVolume");
    // A pass a second: twelve passes in the window.
    let window = Duration::from_secs(12);
    tokio::time::sleep(window).await;
    let made = (c.node("n1").tried("ControllerUnpublishVolume") - first) as u32;
    // The harness's agents make 2 tries per call (`--csi-tries=2`).
    let bound = moor::runtime::steps::Schedule::default().max_attempts_within(window, false) * 2;
    assert!(
        made <= bound,
        "{made} ControllerUnpublish calls of {stray} in {window:?}, at most {bound} allowed"
    );
    assert!(made >= 1, "the step is still retried on its schedule");
    // Nothing else was unpublished; each failed attempt is one Warning.
    assert!(c.node("n1").calls().iter().all(|k| {
        k.rpc != "ControllerUnpublishVolume" || k.volume_id.as_deref() == Some(stray.as_str())
    }));
    c.wait("a failed attempt's Warning", T, || async {
        events_of(&c, "Unknown attachment unpublished")
            .await
            .iter()
            .any(|e| e.spec.type_ == EventType::Warning && e.spec.message.contains("Unavailable"))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_list_volumes_the_survey_asks_controller_get_volume_per_volume() {
    use moor_hostpath::faults::Command;
    let _slot = SLOTS.acquire().await.unwrap();
    let mut opts = surveyed();
    opts.extra.push("--list-volumes=false".into());
    // The condition ControllerGetVolume carries is the 1.12 generation's.
    opts.extra.push("--health-api=1.12".into());
    let c = Cluster::start(1, 1, opts).await;
    create_ready(&c, "v1").await;
    let ext = volume(&c, "v1")
        .await
        .status
        .provisioning
        .external_id
        .unwrap();
    let lost = csi_volume(&c, "lost").await;
    let reg = registered("lost", &lost, "single-node-writer")
        .replace("  accessible_topology: [{rack: r1}]\n", "");
    apply_yaml(&c, "lost", &reg);
    wait_phase(&c, "lost", VolumePhase::Ready).await;
    c.csi()
        .delete_volume(moor::csi::v1::DeleteVolumeRequest {
            volume_id: lost,
            ..Default::default()
        })
        .await
        .unwrap();
    c.node("n1")
        .fault(Command::Condition {
            volume_id: ext.to_string(),
            abnormal: true,
            message: "replica lost".into(),
        })
        .await;
    wait_refused(&c, "lost", "MissingFromPlugin").await;
    c.wait("v1 Healthy false", T, || async {
        condition(&volume(&c, "v1").await, "Healthy").is_some_and(|k| !k.status)
    })
    .await;
    assert_eq!(
        c.node("n1").tried("ListVolumes"),
        0,
        "not advertised, never called"
    );
    assert!(c.node("n1").count("ControllerGetVolume", "OK") >= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_not_yet_ready_is_polled_with_get_snapshot() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 1, plugin_flags(&["--snapshot-ready-after=2"])).await;
    create_ready(&c, "v1").await;
    snapshot_ready(&c, "v1", "s1");
    // Cut once, then read until ready: CreateSnapshot (not ready), GetSnapshot (not
    // ready), GetSnapshot (ready).
    assert_eq!(c.node("n1").tried("CreateSnapshot"), 1);
    assert_eq!(c.node("n1").count("GetSnapshot", "OK"), 2);
    wait_events(&c, "Snapshot created", 1).await;
}

/// Fails the next `times` calls of `rpc` on `node`'s plugin with `code`.
async fn fail(c: &Cluster, node: &str, rpc: &str, code: &str, times: u32) {
    use moor_hostpath::faults::Command;
    c.node(node)
        .fault(Command::Fail {
            rpc: rpc.into(),
            code: code.into(),
            times,
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_new_steps_retry_on_retryable_and_uncertain_answers_and_not_on_final_ones() {
    let _slot = SLOTS.acquire().await.unwrap();
    // The agents make 2 tries per call (--csi-tries=2), then the step's gate retries
    // after 500 ms: 2 failures injected cost exactly one failed step, then it succeeds.
    let c = Cluster::start(1, 2, plugin_flags(&["--node-expansion-required"])).await;
    create_ready(&c, "v1").await;
    let ext = volume(&c, "v1")
        .await
        .status
        .provisioning
        .external_id
        .unwrap();

    // Retryable (Unavailable): registration validated on the third call.
    fail(&c, "n1", "ValidateVolumeCapabilities", "Unavailable", 2).await;
    let reg = registered("r1", ext.as_str(), "single-node-writer")
        .replace("  accessible_topology: [{rack: r1}]\n", "");
    apply_yaml(&c, "r1", &reg);
    wait_phase(&c, "r1", VolumePhase::Ready).await;
    assert_eq!(c.node("n1").tried("ValidateVolumeCapabilities"), 3);

    // Uncertain (Internal) on the controller, retryable on the node: both expand on
    // their third call.
    c.apply(c.allocation("a1", "n2", "v1", false)).await;
    c.wait_claim("a1", "n2", ClaimPhase::Published, T).await;
    fail(&c, "n1", "ControllerExpandVolume", "Internal", 2).await;
    fail(&c, "n2", "NodeExpandVolume", "Unavailable", 2).await;
    apply_yaml(&c, "v1-4", &created("v1", "capacity_min: 4MiB"));
    c.wait("n2 expanded", T, || async {
        mount(&c, "a1", "n2")
            .await
            .is_some_and(|m| m.status.expanded_bytes == Some(4 * MIB))
    })
    .await;
    assert_eq!(c.node("n1").tried("ControllerExpandVolume"), 3);
    assert_eq!(c.node("n2").tried("NodeExpandVolume"), 3);

    // Transient (ResourceExhausted): the snapshot is cut on the third call.
    fail(&c, "n1", "CreateSnapshot", "ResourceExhausted", 2).await;
    snapshot_ready(&c, "v1", "s1");
    assert_eq!(c.node("n1").tried("CreateSnapshot"), 3);

    // Final (FailedPrecondition): shown, and not asked again before the cap (5 min).
    fail(&c, "n1", "ControllerExpandVolume", "FailedPrecondition", 1).await;
    apply_yaml(&c, "v1-8", &created("v1", "capacity_min: 8MiB"));
    wait_refused(&c, "v1", "ControllerExpandVolumeFailed").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(c.node("n1").tried("ControllerExpandVolume"), 4);
    assert_eq!(
        volume(&c, "v1").await.status.provisioning.capacity_bytes,
        Some(4 * MIB)
    );
    wait_events(&c, "Volume expansion failed", 3).await;
}

/// Issue 77, item 1: a plugin volume belongs to the volume whose plugin's leader
/// recorded it (`owners/PLUGIN/`, a key no requester writes), not to whoever names it.
/// Namespace b (1) registers the plugin volume behind a volume of `default`: refused
/// before any call about it, without naming the owner; (2) writes the same id into its
/// own volume's status: that volume's claim waits, and its deletion calls no
/// DeleteVolume of it. Before the records, (1) was validated and published in b and
/// (2) deleted `default`'s data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_namespace_can_neither_register_use_nor_delete_a_volume_s_plugin_volume() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 1, PluginOpts::default()).await;
    c.apply(c.volume("v1", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v1").await;
    let v1 = volume(&c, "v1").await;
    let ext = v1.status.provisioning.external_id.clone().unwrap();
    let plugin = PluginId::new(cluster::PLUGIN).unwrap();
    let rec = c
        .store
        .get(&Ownership::key_for(
            &plugin,
            OwnedResource::Volume,
            ext.as_str(),
        ))
        .await
        .expect("the provisioner recorded v1 as the owner of its plugin volume");
    assert!(owned_by(&rec, &v1), "{rec:?}");
    let about_ext = |rpc: &str| {
        c.node("n1")
            .calls()
            .iter()
            .filter(|k| k.rpc == rpc && k.volume_id.as_deref() == Some(ext.as_str()))
            .count()
    };
    let b = Namespace::new("b").unwrap();

    // (1) A registration in b.
    let mut reg = c.volume("steal", AccessMode::SingleNodeWriter);
    reg.metadata.namespace = b.clone();
    reg.spec.capacity_min = None;
    reg.spec.external_id = Some(ext.clone());
    c.apply(reg).await;
    let steal = Volume::key_for(&b, "steal");
    c.wait("b/steal refused", T, || async {
        c.store.get(&steal).await.is_ok_and(|v| {
            v.status.provisioning.meta.conditions.iter().any(|k| {
                k.type_ == "Validated" && !k.status && k.message.contains("owned by another volume")
            })
        })
    })
    .await;
    let refused = c.store.get(&steal).await.unwrap();
    assert_ne!(refused.status.provisioning.phase, VolumePhase::Ready);
    let said = format!("{:?}", refused.status);
    assert!(
        !said.contains("v1"),
        "the owner in another namespace is named: {said}"
    );
    assert_eq!(
        about_ext("ValidateVolumeCapabilities"),
        0,
        "a call about default/v1's plugin volume for b's registration"
    );

    // (2) b's own volume, made by the provisioner, then its status forged to name v1's
    // plugin volume.
    let mut forged = c.volume("forged", AccessMode::SingleNodeWriter);
    forged.metadata.namespace = b.clone();
    c.apply(forged).await;
    let forged = Volume::key_for(&b, "forged");
    c.wait("b/forged created", T, || async {
        c.store
            .get(&forged)
            .await
            .is_ok_and(|v| v.status.provisioning.phase == VolumePhase::Ready)
    })
    .await;
    c.store
        .modify_status(&forged, |_, st| {
            st.provisioning.external_id = Some(ext.clone());
            true
        })
        .await
        .expect("forge b/forged's status");
    let mut alloc = c.allocation("a1", "n1", "forged", false);
    alloc.metadata.namespace = b.clone();
    let alloc = c.apply(alloc).await.object_key();
    let claim = Claim::key_for(&node("n1"), &b, "a1.data");
    c.wait("b's claim waits for an owner", T, || async {
        c.store
            .try_get(&claim)
            .await
            .ok()
            .flatten()
            .is_some_and(|cl| {
                cl.status.phase == ClaimPhase::Pending
                    && cl
                        .status
                        .reason
                        .as_deref()
                        .is_some_and(|r| r.contains("owned by another volume"))
            })
    })
    .await;
    c.store.delete(&alloc, None).await.expect("delete b/a1");
    c.wait("b/a1's claim gone", T, || async {
        c.store.try_get(&claim).await.ok().flatten().is_none()
    })
    .await;
    c.store
        .delete(&forged, None)
        .await
        .expect("delete b/forged");
    c.wait("b/forged gone", T, || async {
        c.store.try_get(&forged).await.ok().flatten().is_none()
    })
    .await;
    assert_eq!(
        about_ext("DeleteVolume"),
        0,
        "b's deletion deleted default/v1's plugin volume"
    );
    assert_eq!(about_ext("ControllerPublishVolume"), 0);
    assert_eq!(
        about_ext("NodeStageVolume") + about_ext("NodePublishVolume"),
        0
    );

    // (3) A clone in b of b's own volume whose status was forged to name v1's plugin
    // volume: refused before CreateVolume (no CreateVolume names the clone).
    let mut src = c.volume("src", AccessMode::SingleNodeWriter);
    src.metadata.namespace = b.clone();
    c.apply(src).await;
    let src = Volume::key_for(&b, "src");
    c.wait("b/src created", T, || async {
        c.store
            .get(&src)
            .await
            .is_ok_and(|v| v.status.provisioning.phase == VolumePhase::Ready)
    })
    .await;
    c.store
        .modify_status(&src, |_, st| {
            st.provisioning.external_id = Some(ext.clone());
            true
        })
        .await
        .expect("forge b/src's status");
    let mut clone = c.volume("clone", AccessMode::SingleNodeWriter);
    clone.metadata.namespace = b.clone();
    clone.spec.source = Some(VolumeSource::Volume(VolumeId::new("src").unwrap()));
    let clone = c.apply(clone).await;
    let clone_key = clone.object_key();
    c.wait("b/clone refused", T, || async {
        c.store.get(&clone_key).await.is_ok_and(|v| {
            v.status
                .provisioning
                .meta
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains("owned by another volume"))
        })
    })
    .await;
    let uid = plugin_name_of(&clone);
    assert!(
        !c.node("n1").calls().iter().any(|k| k.rpc == "CreateVolume"
            && k.name.as_deref().is_some_and(|n| n.contains(&uid))),
        "CreateVolume cloned v1's plugin volume into b"
    );
    // (4) Snapshots: default/s1 of v1 owns its plugin snapshot. b's own snapshot,
    // its status forged to name s1's id, is deleted without DeleteSnapshot of it; a
    // restore in b from s1's id as an external snapshot id is refused before
    // CreateVolume; a snapshot in b of b/src (its status naming v1's plugin volume)
    // is refused before CreateSnapshot.
    let snapshot = |ns: &Namespace, name: &str, volume: &str| {
        Snapshot::new(
            ns,
            Name::new(name).unwrap(),
            SnapshotSpec {
                volume: VolumeId::new(volume).unwrap(),
                ..Default::default()
            },
        )
    };
    let ready = |key: ObjectKey<SnapshotSpec>| {
        let store = c.store.clone();
        async move {
            store.get(&key).await.is_ok_and(|s| {
                s.status.phase == SnapshotPhase::Ready && s.status.snapshot_id.is_some()
            })
        }
    };
    let s1 = c
        .apply(snapshot(&Namespace::default_ns(), "s1", "v1"))
        .await
        .object_key();
    c.wait("default/s1 cut", T, || ready(s1.clone())).await;
    let s1_id = c.store.get(&s1).await.unwrap().status.snapshot_id.unwrap();
    let mut own = c.volume("own", AccessMode::SingleNodeWriter);
    own.metadata.namespace = b.clone();
    c.apply(own).await;
    let bs = c.apply(snapshot(&b, "bs", "own")).await.object_key();
    c.wait("b/bs cut", T, || ready(bs.clone())).await;
    c.store
        .modify_status(&bs, |_, st| {
            st.snapshot_id = Some(s1_id.clone());
            true
        })
        .await
        .expect("forge b/bs's status");
    c.store.delete(&bs, None).await.expect("delete b/bs");
    c.wait("b/bs gone", T, || async {
        c.store.try_get(&bs).await.ok().flatten().is_none()
    })
    .await;
    let about_s1 = |rpc: &str| {
        c.node("n1")
            .calls()
            .iter()
            .filter(|k| k.rpc == rpc && k.snapshot_id.as_deref() == Some(s1_id.as_str()))
            .count()
    };
    assert_eq!(
        about_s1("DeleteSnapshot"),
        0,
        "b deleted default/s1's snapshot"
    );
    let mut restored = c.volume("restored", AccessMode::SingleNodeWriter);
    restored.metadata.namespace = b.clone();
    restored.spec.source = Some(VolumeSource::ExternalSnapshotId(s1_id.clone()));
    let restored = c.apply(restored).await;
    let restored_key = restored.object_key();
    c.wait("b/restored refused", T, || async {
        c.store.get(&restored_key).await.is_ok_and(|v| {
            v.status
                .provisioning
                .meta
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains("owned by another snapshot"))
        })
    })
    .await;
    let uid = plugin_name_of(&restored);
    assert!(
        !c.node("n1").calls().iter().any(|k| k.rpc == "CreateVolume"
            && k.name.as_deref().is_some_and(|n| n.contains(&uid))),
        "CreateVolume restored default/s1 into b"
    );
    let from_src = c.apply(snapshot(&b, "from-src", "src")).await;
    let from_src_key = from_src.object_key();
    c.wait("b/from-src refused", T, || async {
        c.store.get(&from_src_key).await.is_ok_and(|s| {
            s.status
                .meta
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains("owned by another volume"))
        })
    })
    .await;
    let uid = plugin_name_of(&from_src);
    assert!(
        !c.node("n1")
            .calls()
            .iter()
            .any(|k| k.rpc == "CreateSnapshot"
                && k.name.as_deref().is_some_and(|n| n.contains(&uid))),
        "CreateSnapshot of v1's plugin volume for b"
    );
    // v1 and its record are as they were.
    let v1_after = volume(&c, "v1").await;
    assert_eq!(v1_after.status.provisioning.phase, VolumePhase::Ready);
    assert!(c
        .store
        .try_get(&Ownership::key_for(
            &plugin,
            OwnedResource::Volume,
            ext.as_str()
        ))
        .await
        .unwrap()
        .is_some_and(|r| owned_by(&r, &v1)));
}

/// Issue 77, item 4: an orphan is a node's word. A node writes, under its own
/// `mounts/NODE/` (as its identity may), an "orphaned mount" of another namespace's
/// volume, or of its own namespace's volume on a plugin volume that is not that
/// volume's; `moorctl mount adopt` refuses both, says whose word it is, and writes no
/// allocation. Before, adopt built the allocation from the Mount alone and handed the
/// node the volume's claim and a publish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orphan_the_stored_state_does_not_bear_out_is_not_adopted() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 2, PluginOpts::default()).await;
    c.apply(c.volume("v1", AccessMode::SingleNodeWriter)).await;
    c.volume_ready("v1").await;
    c.apply(c.allocation("a1", "n1", "v1", false)).await;
    c.wait_claim("a1", "n1", ClaimPhase::Published, T).await;
    let b = Namespace::new("b").unwrap();
    let mut bv = c.volume("bv", AccessMode::SingleNodeWriter);
    bv.metadata.namespace = b.clone();
    c.apply(bv).await;
    let bv = Volume::key_for(&b, "bv");
    c.wait("b/bv created", T, || async {
        c.store
            .get(&bv)
            .await
            .is_ok_and(|v| v.status.provisioning.phase == VolumePhase::Ready)
    })
    .await;
    let bv_ext = c
        .store
        .get(&bv)
        .await
        .unwrap()
        .status
        .provisioning
        .external_id
        .unwrap();
    let forge = |ns: &Namespace, node: &str, claim: &str, volume: &str, ext: &ExternalVolumeId| {
        let mut m = Mount::new(
            ns,
            Name::new(claim).unwrap(),
            MountSpec {
                claim: Name::new(claim).unwrap(),
                allocation: AllocationId::new(claim.split('.').next().unwrap()).unwrap(),
                volume: VolumeId::new(volume).unwrap(),
                node: cluster::node(node),
                claim_uid: Uid::random(),
                staging_path: None,
                target_path: format!("/forged/{claim}"),
            },
        );
        m.status.published = true;
        m.status.orphan = Some(Box::new(Orphan {
            since: Timestamp::now(),
            plugin_id: PluginId::new(cluster::PLUGIN).unwrap(),
            external_id: ext.clone(),
            request: Some(Name::new("data").unwrap()),
            mode: ClaimMode::Write,
            holders: Vec::new(),
            capability: VolumeCapability {
                access_mode: AccessMode::SingleNodeWriter,
                attachment_mode: AttachmentMode::FileSystem,
            },
        }));
        m
    };
    // n2 never served namespace b.
    c.apply(forge(&b, "n2", "x.data", "bv", &bv_ext)).await;
    let (ok, out) = c.moorctl(&["mount", "adopt", "x.data", "-n", "b", "--timeout", "5s"]);
    assert!(!ok, "adopted on n2's word: {out}");
    assert!(
        out.contains("node n2 has no claim of namespace b") && out.contains("only its word"),
        "{out}"
    );
    // n1 served default, but names v1 on b/bv's plugin volume.
    c.apply(forge(
        &Namespace::default_ns(),
        "n1",
        "y.data",
        "v1",
        &bv_ext,
    ))
    .await;
    let (ok, out) = c.moorctl(&["mount", "adopt", "y.data", "--timeout", "5s"]);
    assert!(!ok, "adopted on n1's word: {out}");
    assert!(out.contains("not the volume's"), "{out}");
    for key in [
        Allocation::key_for(&b, "x"),
        Allocation::key_for(&Namespace::default_ns(), "y"),
    ] {
        assert!(
            c.store.try_get(&key).await.unwrap().is_none(),
            "{key} was written"
        );
    }
}

/// Issue 77: an operator's grant over a plugin volume (`moorctl volume share`,
/// `unshare`, `own`, which write its ownership record; no requester can). Namespace b's
/// registration of default/v1's plugin volume is refused until v1 shares it with b;
/// then it validates at once (the refusal's back-off does not hold it: the record is
/// the step's input), its claims are admitted read-only only, carry what CreateVolume
/// answered, and its deletion deletes nothing; unshared, a new registration is refused
/// again. A plugin volume nobody owns (retained) is first come: x's registration takes
/// it, y's is refused, and `own` makes y's the owner (x's new claims wait); a created
/// volume's plugin volume is never handed to a registration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_shares_a_plugin_volume_across_namespaces_and_evicts_a_squatter() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 1, PluginOpts::default()).await;
    c.apply(c.volume("v1", AccessMode::MultiNodeMultiWriter))
        .await;
    c.volume_ready("v1").await;
    let v1 = volume(&c, "v1").await;
    let ext = v1.status.provisioning.external_id.clone().unwrap();
    let plugin = PluginId::new(cluster::PLUGIN).unwrap();
    let about = |rpc: &str, id: &ExternalVolumeId| {
        c.node("n1")
            .calls()
            .iter()
            .filter(|k| k.rpc == rpc && k.volume_id.as_deref() == Some(id.as_str()))
            .count()
    };
    let ns = |n: &str| Namespace::new(n).unwrap();
    let register = |namespace: &Namespace, name: &str, id: &ExternalVolumeId| {
        let mut reg = c.volume(name, AccessMode::MultiNodeMultiWriter);
        reg.metadata.namespace = namespace.clone();
        reg.spec.capacity_min = None;
        reg.spec.external_id = Some(id.clone());
        reg
    };
    let validated = |key: ObjectKey<VolumeSpec>, ok: bool| {
        let store = c.store.clone();
        async move {
            store.get(&key).await.is_ok_and(|v| {
                let p = &v.status.provisioning;
                if ok {
                    p.phase == VolumePhase::Ready
                } else {
                    p.meta.conditions.iter().any(|k| {
                        k.type_ == "Validated"
                            && !k.status
                            && k.message.contains("owned by another volume")
                    })
                }
            })
        }
    };
    let claim_in = |namespace: &Namespace, alloc: &str| {
        Claim::key_for(&node("n1"), namespace, format!("{alloc}.data"))
    };
    let claim_reason = |key: ObjectKey<ClaimSpec>, want: &'static str| {
        let store = c.store.clone();
        async move {
            store.try_get(&key).await.ok().flatten().is_some_and(|cl| {
                cl.status.phase == ClaimPhase::Pending
                    && cl
                        .status
                        .reason
                        .as_deref()
                        .is_some_and(|r| r.contains(want))
            })
        }
    };
    let (b, x, y) = (ns("b"), ns("x"), ns("y"));

    // b's registration: refused, before any call about v1's plugin volume.
    let reader = c.apply(register(&b, "reader", &ext)).await.object_key();
    c.wait("b/reader refused", T, || validated(reader.clone(), false))
        .await;
    assert_eq!(about("ValidateVolumeCapabilities", &ext), 0);

    // Only the owner shares: from b/reader it is refused, naming the owner (the
    // operator reads everything).
    let (ok, out) = c.moorctl(&["volume", "share", "reader", "-n", "b", "--with", "c"]);
    assert!(
        !ok && out.contains("does not own") && out.contains("default/v1"),
        "{out}"
    );
    let (ok, out) = c.moorctl(&["volume", "share", "v1", "--with", "default"]);
    assert!(!ok && out.contains("the volume's own"), "{out}");
    let (ok, out) = c.moorctl(&["volume", "share", "v1", "--with", "b"]);
    assert!(
        ok && out.contains("shared with b (read-only claims)"),
        "{out}"
    );
    let rec_key = Ownership::key_for(&plugin, OwnedResource::Volume, ext.as_str());
    let rec = c.store.get(&rec_key).await.unwrap();
    assert!(owned_by(&rec, &v1), "{rec:?}");
    assert_eq!(rec.spec.shared_with(&b).map(|s| s.write), Some(false));
    // Validated at once, not after the refusal's back-off (5 minutes at its cap).
    c.wait("b/reader validated once shared", T, || {
        validated(reader.clone(), true)
    })
    .await;
    assert!(about("ValidateVolumeCapabilities", &ext) >= 1);

    // default's own claim of v1 on n1, beside b's below.
    let own = c
        .apply(c.allocation("own", "n1", "v1", false))
        .await
        .object_key();
    c.wait_claim("own", "n1", ClaimPhase::Published, T).await;
    // A writing claim of it waits; a read-only one is published, with v1's context.
    let mut writer = c.allocation("w1", "n1", "reader", false);
    writer.metadata.namespace = b.clone();
    let writer = c.apply(writer).await.object_key();
    c.wait("b's writing claim waits", T, || {
        claim_reason(claim_in(&b, "w1"), "for reading only")
    })
    .await;
    c.store.delete(&writer, None).await.unwrap();
    let mut r1 = c.allocation("r1", "n1", "reader", true);
    r1.metadata.namespace = b.clone();
    let r1 = c.apply(r1).await.object_key();
    let r1_claim = claim_in(&b, "r1");
    c.wait("b's read-only claim published", T, || async {
        c.store
            .try_get(&r1_claim)
            .await
            .ok()
            .flatten()
            .is_some_and(|cl| cl.status.phase == ClaimPhase::Published)
    })
    .await;
    let published = c.store.get(&r1_claim).await.unwrap();
    let made = rec
        .spec
        .provisioned
        .as_ref()
        .expect("v1's record keeps its context");
    assert_eq!(published.spec.volume_context, made.volume_context);
    assert_eq!(published.spec.mode, ClaimMode::Read);
    c.store.delete(&r1, None).await.unwrap();
    c.wait("b's claim released", T, || async {
        c.store.try_get(&r1_claim).await.ok().flatten().is_none()
    })
    .await;
    // Two volumes, one plugin volume on n1: b's release left it published for
    // default's claim (no ControllerUnpublish under it); default's release unpublishes.
    assert_eq!(about("ControllerUnpublishVolume", &ext), 0);
    c.store.delete(&own, None).await.unwrap();
    c.wait(
        "v1 unpublished from n1 once both are released",
        T,
        || async { about("ControllerUnpublishVolume", &ext) == 1 },
    )
    .await;
    c.store.delete(&reader, None).await.unwrap();
    c.wait("b/reader gone", T, || async {
        c.store.try_get(&reader).await.ok().flatten().is_none()
    })
    .await;
    assert_eq!(
        about("DeleteVolume", &ext),
        0,
        "b's share deleted v1's data"
    );
    assert!(c.store.get(&rec_key).await.is_ok_and(|r| owned_by(&r, &v1)));

    // Unshared: a new registration in b is refused again; `own` never hands a created
    // volume's plugin volume to a registration.
    let (ok, out) = c.moorctl(&["volume", "unshare", "v1", "--with", "b"]);
    assert!(ok && out.contains("no longer shared with b"), "{out}");
    let again = c.apply(register(&b, "again", &ext)).await.object_key();
    c.wait("b/again refused", T, || validated(again.clone(), false))
        .await;
    let (ok, out) = c.moorctl(&["volume", "own", "again", "-n", "b"]);
    assert!(!ok && out.contains("created by volume default/v1"), "{out}");
    assert!(c
        .store
        .get(&rec_key)
        .await
        .is_ok_and(|r| owned_by(&r, &v1) && r.spec.shared_with.is_empty() && !r.spec.chosen));

    // A plugin volume nobody owns: v2, retained at its deletion.
    let mut v2 = c.volume("v2", AccessMode::MultiNodeMultiWriter);
    v2.spec.on_delete = Some(OnDelete::Retain);
    c.apply(v2).await;
    c.volume_ready("v2").await;
    let v2 = volume(&c, "v2").await;
    let ext2 = v2.status.provisioning.external_id.clone().unwrap();
    let rec2_key = Ownership::key_for(&plugin, OwnedResource::Volume, ext2.as_str());
    c.store.delete(&v2.object_key(), None).await.unwrap();
    c.wait("v2 gone, its record with it", T, || async {
        c.store
            .try_get(&v2.object_key())
            .await
            .ok()
            .flatten()
            .is_none()
            && c.store.try_get(&rec2_key).await.ok().flatten().is_none()
    })
    .await;
    // First come: x registers it, then y is refused.
    let squat = c.apply(register(&x, "squat", &ext2)).await.object_key();
    c.wait("x/squat validated", T, || validated(squat.clone(), true))
        .await;
    let real = c.apply(register(&y, "real", &ext2)).await.object_key();
    c.wait("y/real refused", T, || validated(real.clone(), false))
        .await;
    // The operator picks y: at once, and x's new claims wait.
    let (ok, out) = c.moorctl(&["volume", "own", "real", "-n", "y"]);
    assert!(
        ok && out.contains("now owns") && out.contains("x/squat"),
        "{out}"
    );
    c.wait("y/real validated once chosen", T, || {
        validated(real.clone(), true)
    })
    .await;
    let rec2 = c.store.get(&rec2_key).await.unwrap();
    assert!(
        rec2.spec.chosen && rec2.spec.owner.namespace == y,
        "{rec2:?}"
    );
    let mut xa = c.allocation("xa", "n1", "squat", true);
    xa.metadata.namespace = x.clone();
    c.apply(xa).await;
    c.wait("x's claim waits for an owner", T, || {
        claim_reason(claim_in(&x, "xa"), "owned by another volume")
    })
    .await;
    let mut ya = c.allocation("ya", "n1", "real", false);
    ya.metadata.namespace = y.clone();
    let ya = c.apply(ya).await.object_key();
    let ya_claim = claim_in(&y, "ya");
    c.wait("y's claim published", T, || async {
        c.store
            .try_get(&ya_claim)
            .await
            .ok()
            .flatten()
            .is_some_and(|cl| cl.status.phase == ClaimPhase::Published)
    })
    .await;
    c.store.delete(&ya, None).await.unwrap();
    c.wait("y's claim released", T, || async {
        c.store.try_get(&ya_claim).await.ok().flatten().is_none()
    })
    .await;
    assert_eq!(about("DeleteVolume", &ext2), 0);
    c.check_calls(true);
}

/// Issue 78, item 6: deleting a volume a live workload holds is refused, naming the
/// holders, and leaves it as it was; `--when-unused` marks it, and it goes after the
/// last release. A holder already being released (its allocation stopped) does not
/// hold a delete back: the volume goes after that release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimed_volume_s_delete_is_refused_naming_its_holders_unless_when_unused() {
    let _slot = SLOTS.acquire().await.unwrap();
    let c = Cluster::start(1, 1, PluginOpts::default()).await;
    for v in ["v1", "v2"] {
        c.apply(c.volume(v, AccessMode::SingleNodeWriter)).await;
        c.volume_ready(v).await;
    }
    c.apply(c.allocation("a1", "n1", "v1", false)).await;
    c.apply(c.allocation("a2", "n1", "v2", false)).await;
    c.wait_claim("a1", "n1", ClaimPhase::Published, T).await;
    c.wait_claim("a2", "n1", ClaimPhase::Published, T).await;
    let (ok, out) = c.moorctl(&["delete", "volume", "v1"]);
    assert!(
        !ok && out.contains("volume default/v1 is in use by allocation a1 on node n1")
            && out.contains("--when-unused"),
        "{out}"
    );
    assert!(!volume(&c, "v1").await.is_deleting(), "refused, yet marked");
    let (ok, out) = c.moorctl(&["delete", "volume", "v1", "--when-unused"]);
    assert!(ok && out.contains("marked for deletion"), "{out}");
    assert!(volume(&c, "v1").await.is_deleting());
    assert_eq!(
        c.claim("a1", "n1").await.unwrap().status.phase,
        ClaimPhase::Published,
        "marked, and the workload keeps it"
    );
    // a2 stopped: its release is under way, so v2's delete goes ahead and waits for it.
    let (ok, out) = c.moorctl(&["alloc", "stop", "a2"]);
    assert!(ok, "{out}");
    let (ok, out) = c.moorctl(&["delete", "volume", "v2"]);
    assert!(ok && out.contains("marked for deletion"), "{out}");
    c.stop_alloc("a1").await;
    c.wait("both volumes gone after their releases", T, || async {
        let left = c
            .store
            .list::<VolumeSpec>(&KeyScope::all())
            .await
            .map(|l| l.items.len());
        left.is_ok_and(|n| n == 0)
    })
    .await;
    c.check_calls(true);
}
