//! moor-hostpath as a black box over its unix socket.

mod harness;

use harness::{can_mount, cap, mnmw, mount_count, snmw, sw, HostPath};
use moor_csi::v1::*;
use moor_hostpath::faults::Command;
use std::time::{Duration, Instant};
use tonic::{Code, Request};
use volume_capability::access_mode::Mode;

fn create(name: &str, caps: Vec<VolumeCapability>, required: i64) -> CreateVolumeRequest {
    CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(CapacityRange {
            required_bytes: required,
            limit_bytes: 0,
        }),
        volume_capabilities: caps,
        ..Default::default()
    }
}

async fn new_volume(hp: &HostPath, name: &str, caps: Vec<VolumeCapability>) -> Volume {
    hp.controller()
        .create_volume(create(name, caps, 1 << 20))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
}

fn stage_req(v: &Volume, staging: &std::path::Path, c: VolumeCapability) -> NodeStageVolumeRequest {
    NodeStageVolumeRequest {
        volume_id: v.volume_id.clone(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(c),
        volume_context: v.volume_context.clone(),
        publish_context: attached_context(),
        ..Default::default()
    }
}

fn publish_req(
    v: &Volume,
    staging: Option<&std::path::Path>,
    target: &std::path::Path,
    ro: bool,
    c: VolumeCapability,
) -> NodePublishVolumeRequest {
    NodePublishVolumeRequest {
        volume_id: v.volume_id.clone(),
        staging_target_path: staging.map(|s| s.display().to_string()).unwrap_or_default(),
        target_path: target.display().to_string(),
        volume_capability: Some(c),
        readonly: ro,
        volume_context: v.volume_context.clone(),
        publish_context: attached_context(),
        ..Default::default()
    }
}

/// The publish context ControllerPublish to the harness's node returns.
fn attached_context() -> std::collections::BTreeMap<String, String> {
    [("attached_to".to_string(), "node-1".to_string())].into()
}

/// A new volume, controller-published to the harness's node (`node-1`).
async fn attached_volume(hp: &HostPath, name: &str, caps: Vec<VolumeCapability>) -> Volume {
    let v = new_volume(hp, name, caps.clone()).await;
    hp.controller()
        .controller_publish_volume(ControllerPublishVolumeRequest {
            volume_id: v.volume_id.clone(),
            node_id: "node-1".into(),
            volume_capability: caps.into_iter().next(),
            ..Default::default()
        })
        .await
        .unwrap();
    v
}

#[tokio::test]
async fn identity_reports_name_capabilities_and_readiness() {
    let hp = HostPath::start(&["--topology=zone=z1"]).await;
    let info = hp
        .identity()
        .get_plugin_info(GetPluginInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.name, "hostpath.moor.dev");
    assert!(!info.vendor_version.is_empty());
    let caps = hp
        .identity()
        .get_plugin_capabilities(GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    let services: Vec<i32> = caps
        .capabilities
        .iter()
        .filter_map(|c| match &c.r#type {
            Some(plugin_capability::Type::Service(s)) => Some(s.r#type),
            _ => None,
        })
        .collect();
    use plugin_capability::service::Type;
    assert!(services.contains(&(Type::ControllerService as i32)));
    assert!(services.contains(&(Type::VolumeAccessibilityConstraints as i32)));
    let probe = hp
        .identity()
        .probe(ProbeRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(probe.ready, Some(true));
    let node = hp
        .node()
        .node_get_info(NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(node.node_id, "node-1");
    assert_eq!(node.accessible_topology.unwrap().segments["zone"], "z1");

    let node_only = HostPath::start(&["--mode=node", "--driver-name=other.example.com"]).await;
    let caps = node_only
        .identity()
        .get_plugin_capabilities(GetPluginCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(!caps.capabilities.iter().any(|c| matches!(&c.r#type,
        Some(plugin_capability::Type::Service(s)) if s.r#type == Type::ControllerService as i32)));
    let err = node_only
        .controller()
        .create_volume(create("v", vec![sw()], 0))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented);
    let info = node_only
        .identity()
        .get_plugin_info(GetPluginInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.name, "other.example.com");
}

#[tokio::test]
async fn create_volume_is_idempotent_by_name_and_checks_its_arguments() {
    let hp = HostPath::start(&["--capacity=10MiB"]).await;
    let mut c = hp.controller();
    let a = c
        .create_volume(create("v1", vec![sw()], 1 << 20))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(a.capacity_bytes, 1 << 20);
    let again = c
        .create_volume(create("v1", vec![sw()], 1 << 20))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(
        again.volume_id, a.volume_id,
        "a repeat must not create a second volume"
    );
    let err = c
        .create_volume(create("v1", vec![sw()], 4 << 20))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists);
    assert_eq!(
        c.create_volume(create("", vec![sw()], 0))
            .await
            .unwrap_err()
            .code(),
        Code::InvalidArgument
    );
    assert_eq!(
        c.create_volume(create("v2", vec![], 0))
            .await
            .unwrap_err()
            .code(),
        Code::InvalidArgument
    );
    assert_eq!(
        c.create_volume(create("v2", vec![cap(Mode::Unknown, false)], 0))
            .await
            .unwrap_err()
            .code(),
        Code::InvalidArgument
    );
    let mut bad_range = create("v2", vec![sw()], 4 << 20);
    bad_range.capacity_range.as_mut().unwrap().limit_bytes = 1 << 20;
    assert_eq!(
        c.create_volume(bad_range).await.unwrap_err().code(),
        Code::InvalidArgument
    );
    assert_eq!(
        c.create_volume(create("big", vec![sw()], 20 << 20))
            .await
            .unwrap_err()
            .code(),
        Code::ResourceExhausted
    );
    // Issue 26: i64::MAX bytes overflowed the capacity sum (created past --capacity in
    // release builds, a panic in debug ones). It is refused, and capacity stays right.
    assert_eq!(
        c.create_volume(create("huge", vec![sw()], i64::MAX))
            .await
            .unwrap_err()
            .code(),
        Code::ResourceExhausted
    );
    let cap_left = c
        .get_capacity(GetCapacityRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(cap_left.available_capacity, 9 << 20);

    // Delete is idempotent.
    c.delete_volume(DeleteVolumeRequest {
        volume_id: a.volume_id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    c.delete_volume(DeleteVolumeRequest {
        volume_id: a.volume_id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(
        c.delete_volume(DeleteVolumeRequest::default())
            .await
            .unwrap_err()
            .code(),
        Code::InvalidArgument
    );
    let got = c
        .controller_get_volume(ControllerGetVolumeRequest {
            volume_id: a.volume_id,
        })
        .await
        .unwrap_err();
    assert_eq!(got.code(), Code::NotFound);
}

#[tokio::test]
async fn controller_publish_follows_the_spec_rules() {
    let hp = HostPath::start(&["--max-volumes-per-node=2"]).await;
    let mut c = hp.controller();
    let v = new_volume(&hp, "v1", vec![sw()]).await;
    let publish = |node: &str, ro: bool| ControllerPublishVolumeRequest {
        volume_id: v.volume_id.clone(),
        node_id: node.into(),
        volume_capability: Some(sw()),
        readonly: ro,
        ..Default::default()
    };
    let ctx = c
        .controller_publish_volume(publish("n1", false))
        .await
        .unwrap()
        .into_inner()
        .publish_context;
    assert!(!ctx.is_empty());
    let again = c
        .controller_publish_volume(publish("n1", false))
        .await
        .unwrap()
        .into_inner()
        .publish_context;
    assert_eq!(ctx, again, "a repeat is OK with the same context");
    assert_eq!(
        c.controller_publish_volume(publish("n1", true))
            .await
            .unwrap_err()
            .code(),
        Code::AlreadyExists
    );
    assert_eq!(
        c.controller_publish_volume(publish("n2", false))
            .await
            .unwrap_err()
            .code(),
        Code::FailedPrecondition
    );
    let mut missing = publish("n1", false);
    missing.volume_capability = None;
    assert_eq!(
        c.controller_publish_volume(missing)
            .await
            .unwrap_err()
            .code(),
        Code::InvalidArgument
    );
    // A node that is not in the cloud (neither this instance's nor registered).
    assert_eq!(
        c.controller_publish_volume(publish("some-fake-node-id", false))
            .await
            .unwrap_err()
            .code(),
        Code::NotFound
    );
    let mut unknown = publish("n1", false);
    unknown.volume_id = "vol-nope".into();
    assert_eq!(
        c.controller_publish_volume(unknown)
            .await
            .unwrap_err()
            .code(),
        Code::NotFound
    );
    // In use: DeleteVolume refuses.
    let del = c
        .delete_volume(DeleteVolumeRequest {
            volume_id: v.volume_id.clone(),
            ..Default::default()
        })
        .await;
    assert_eq!(del.unwrap_err().code(), Code::FailedPrecondition);

    // ListVolumes shows the published node, page by page.
    for i in 0..4 {
        new_volume(&hp, &format!("extra{i}"), vec![mnmw()]).await;
    }
    let mut token = String::new();
    let mut seen = Vec::new();
    loop {
        let page = c
            .list_volumes(ListVolumesRequest {
                max_entries: 2,
                starting_token: token,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(page.entries.len() <= 2);
        seen.extend(page.entries);
        if page.next_token.is_empty() {
            break;
        }
        token = page.next_token;
    }
    assert_eq!(seen.len(), 5);
    let entry = seen
        .iter()
        .find(|e| e.volume.as_ref().unwrap().volume_id == v.volume_id)
        .unwrap();
    assert_eq!(entry.status.as_ref().unwrap().published_node_ids, ["n1"]);
    let bad = c
        .list_volumes(ListVolumesRequest {
            max_entries: 2,
            starting_token: "zzz".into(),
        })
        .await;
    assert_eq!(bad.unwrap_err().code(), Code::Aborted);

    // max_volumes_per_node: n1 has 1; a second fits, a third does not.
    for (i, expect_ok) in [(0, true), (1, false)] {
        let e = &seen
            .iter()
            .filter(|e| e.volume.as_ref().unwrap().volume_id != v.volume_id)
            .nth(i)
            .unwrap();
        let r = c
            .controller_publish_volume(ControllerPublishVolumeRequest {
                volume_id: e.volume.as_ref().unwrap().volume_id.clone(),
                node_id: "n1".into(),
                volume_capability: Some(mnmw()),
                ..Default::default()
            })
            .await;
        assert_eq!(r.is_ok(), expect_ok, "{r:?}");
        if !expect_ok {
            assert_eq!(r.unwrap_err().code(), Code::ResourceExhausted);
        }
    }

    // Unpublish twice, and of what is not published: OK.
    for node in ["n1", "n1", "n9"] {
        c.controller_unpublish_volume(ControllerUnpublishVolumeRequest {
            volume_id: v.volume_id.clone(),
            node_id: node.into(),
            ..Default::default()
        })
        .await
        .unwrap();
    }
    c.controller_publish_volume(publish("n2", false))
        .await
        .expect("free again after unpublish");
}

#[tokio::test]
async fn snapshots_clones_expansion_and_validation() {
    let hp = HostPath::start(&[]).await;
    let mut c = hp.controller();
    let v = new_volume(&hp, "src", vec![sw()]).await;
    std::fs::write(
        std::path::Path::new(&v.volume_context["path"]).join("data.txt"),
        "hello",
    )
    .unwrap();
    let snap = c
        .create_snapshot(CreateSnapshotRequest {
            source_volume_id: v.volume_id.clone(),
            name: "s1".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert!(snap.ready_to_use);
    let again = c
        .create_snapshot(CreateSnapshotRequest {
            source_volume_id: v.volume_id.clone(),
            name: "s1".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert_eq!(again.snapshot_id, snap.snapshot_id);
    let listed = c
        .list_snapshots(ListSnapshotsRequest {
            source_volume_id: v.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.entries.len(), 1);

    let mut from_snap = create("restored", vec![sw()], 1 << 20);
    from_snap.volume_content_source = Some(VolumeContentSource {
        r#type: Some(volume_content_source::Type::Snapshot(
            volume_content_source::SnapshotSource {
                snapshot_id: snap.snapshot_id.clone(),
            },
        )),
    });
    let restored = c
        .create_volume(from_snap)
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let text = std::fs::read_to_string(
        std::path::Path::new(&restored.volume_context["path"]).join("data.txt"),
    )
    .unwrap();
    assert_eq!(text, "hello");
    let mut clone = create("clone", vec![sw()], 1 << 20);
    clone.volume_content_source = Some(VolumeContentSource {
        r#type: Some(volume_content_source::Type::Volume(
            volume_content_source::VolumeSource {
                volume_id: "vol-missing".into(),
            },
        )),
    });
    assert_eq!(
        c.create_volume(clone).await.unwrap_err().code(),
        Code::NotFound
    );

    c.delete_snapshot(DeleteSnapshotRequest {
        snapshot_id: snap.snapshot_id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    c.delete_snapshot(DeleteSnapshotRequest {
        snapshot_id: snap.snapshot_id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();

    let grown = c
        .controller_expand_volume(ControllerExpandVolumeRequest {
            volume_id: v.volume_id.clone(),
            capacity_range: Some(CapacityRange {
                required_bytes: 8 << 20,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(grown.capacity_bytes, 8 << 20);
    let valid = c
        .validate_volume_capabilities(ValidateVolumeCapabilitiesRequest {
            volume_id: v.volume_id.clone(),
            volume_capabilities: vec![sw()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(valid.confirmed.is_some());
    let missing = c
        .validate_volume_capabilities(ValidateVolumeCapabilitiesRequest {
            volume_id: "vol-nope".into(),
            volume_capabilities: vec![sw()],
            ..Default::default()
        })
        .await;
    assert_eq!(missing.unwrap_err().code(), Code::NotFound);
}

/// The spec's NodePublishVolume table, strictly (the default): a second target path on
/// the node needs a mode that shares a node on both publishes (FAILED_PRECONDITION,
/// "exceeds capabilities"), and a target path published again under another mode is
/// ALREADY_EXISTS. `--strict=false` accepts both, as lenient drivers do.
#[tokio::test]
async fn a_second_target_path_needs_a_mode_that_shares_the_node() {
    for strict in [true, false] {
        let flags: &[&str] = if strict { &[] } else { &["--strict=false"] };
        let hp = HostPath::start(flags).await;
        let mut n = hp.node();
        let v = attached_volume(&hp, "v1", vec![sw()]).await;
        let staging = hp.path("staging/v1");
        let (t1, t2, t3) = (hp.path("pods/a"), hp.path("pods/b"), hp.path("pods/c"));
        std::fs::create_dir_all(&staging).unwrap();
        n.node_stage_volume(stage_req(&v, &staging, sw()))
            .await
            .unwrap();
        n.node_publish_volume(publish_req(&v, Some(&staging), &t1, false, sw()))
            .await
            .unwrap();
        let code = |r: Result<_, tonic::Status>| r.err().map(|e| e.code());
        let reader = n
            .node_publish_volume(publish_req(&v, Some(&staging), &t2, true, sw()))
            .await;
        let shared_beside = n
            .node_publish_volume(publish_req(&v, Some(&staging), &t3, true, snmw()))
            .await;
        let other_mode = n
            .node_publish_volume(publish_req(&v, Some(&staging), &t1, false, snmw()))
            .await;
        if strict {
            assert_eq!(code(reader), Some(Code::FailedPrecondition));
            assert_eq!(code(shared_beside), Some(Code::FailedPrecondition));
            assert_eq!(code(other_mode), Some(Code::AlreadyExists));
        } else {
            assert_eq!(code(reader), None);
            assert_eq!(code(shared_beside), None);
            assert_eq!(code(other_mode), None);
        }
    }
}

#[tokio::test]
async fn stage_and_publish_mount_for_real_and_tear_down() {
    let hp = HostPath::start(&[]).await;
    let mut n = hp.node();
    let v = attached_volume(&hp, "v1", vec![sw()]).await;
    let staging = hp.path("staging/v1");
    let rw = hp.path("pods/a/v1");
    let ro = hp.path("pods/b/v1");

    // Publish before stage on a stage-requiring plugin.
    let early = n
        .node_publish_volume(publish_req(&v, Some(&staging), &rw, false, sw()))
        .await;
    assert_eq!(early.unwrap_err().code(), Code::FailedPrecondition);

    std::fs::create_dir_all(&staging).unwrap();
    n.node_stage_volume(stage_req(&v, &staging, sw()))
        .await
        .unwrap();
    n.node_stage_volume(stage_req(&v, &staging, sw()))
        .await
        .expect("a repeat stage is OK");
    // Two target paths on one node: under SINGLE_NODE_MULTI_WRITER, which allows it.
    n.node_publish_volume(publish_req(&v, Some(&staging), &rw, false, snmw()))
        .await
        .unwrap();
    n.node_publish_volume(publish_req(&v, Some(&staging), &rw, false, snmw()))
        .await
        .expect("a repeat publish is OK");
    n.node_publish_volume(publish_req(&v, Some(&staging), &ro, true, snmw()))
        .await
        .unwrap();
    let conflict = n
        .node_publish_volume(publish_req(&v, Some(&staging), &rw, true, snmw()))
        .await;
    assert_eq!(conflict.unwrap_err().code(), Code::AlreadyExists);

    if can_mount() {
        assert_eq!(mount_count(&staging), 1);
        assert_eq!(mount_count(&rw), 1, "a repeat publish must not mount twice");
        std::fs::write(rw.join("written.txt"), "data").unwrap();
        let vol_dir = std::path::Path::new(&v.volume_context["path"]);
        assert_eq!(
            std::fs::read_to_string(vol_dir.join("written.txt")).unwrap(),
            "data"
        );
        assert_eq!(
            std::fs::read_to_string(ro.join("written.txt")).unwrap(),
            "data"
        );
        let err = std::fs::write(ro.join("nope.txt"), "x").unwrap_err();
        assert_eq!(
            err.raw_os_error(),
            Some(30),
            "a read-only publish must refuse writes (EROFS)"
        );
    }
    let stats = n
        .node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: v.volume_id.clone(),
            volume_path: rw.display().to_string(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.usage.len(), 2);
    let unknown = n
        .node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: v.volume_id.clone(),
            volume_path: "/nowhere".into(),
            ..Default::default()
        })
        .await;
    assert_eq!(unknown.unwrap_err().code(), Code::NotFound);
    let expanded = n
        .node_expand_volume(NodeExpandVolumeRequest {
            volume_id: v.volume_id.clone(),
            volume_path: rw.display().to_string(),
            capacity_range: Some(CapacityRange {
                required_bytes: 2 << 20,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(expanded.capacity_bytes, 2 << 20);
    let not_published = n
        .node_expand_volume(NodeExpandVolumeRequest {
            volume_id: v.volume_id.clone(),
            volume_path: "/nowhere".into(),
            ..Default::default()
        })
        .await;
    assert_eq!(not_published.unwrap_err().code(), Code::NotFound);

    for target in [&rw, &ro, &rw] {
        n.node_unpublish_volume(NodeUnpublishVolumeRequest {
            volume_id: v.volume_id.clone(),
            target_path: target.display().to_string(),
        })
        .await
        .expect("unpublish, also of what is gone");
    }
    assert!(!rw.exists() && !ro.exists(), "unpublish removes the target");
    for _ in 0..2 {
        n.node_unstage_volume(NodeUnstageVolumeRequest {
            volume_id: v.volume_id.clone(),
            staging_target_path: staging.display().to_string(),
        })
        .await
        .unwrap();
    }
    assert_eq!(mount_count(&staging), 0);
    let missing = n
        .node_stage_volume(NodeStageVolumeRequest {
            volume_id: v.volume_id.clone(),
            ..Default::default()
        })
        .await;
    assert_eq!(missing.unwrap_err().code(), Code::InvalidArgument);
}

#[tokio::test]
async fn without_stage_unstage_publish_goes_direct_and_block_is_a_file() {
    let hp = HostPath::start(&["--stage-unstage=false", "--publish-unpublish=false"]).await;
    let caps = hp
        .node()
        .node_get_capabilities(NodeGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(!caps.capabilities.iter().any(|c| matches!(&c.r#type,
        Some(node_service_capability::Type::Rpc(r)) if r.r#type == node_service_capability::rpc::Type::StageUnstageVolume as i32)));
    let ccaps = hp
        .controller()
        .controller_get_capabilities(ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(!ccaps.capabilities.iter().any(|c| matches!(&c.r#type,
        Some(controller_service_capability::Type::Rpc(r)) if r.r#type == controller_service_capability::rpc::Type::PublishUnpublishVolume as i32)));
    let v = new_volume(&hp, "v1", vec![cap(Mode::SingleNodeWriter, true)]).await;
    let staging = hp.path("staging");
    let stage = hp
        .node()
        .node_stage_volume(stage_req(&v, &staging, cap(Mode::SingleNodeWriter, true)))
        .await;
    assert_eq!(stage.unwrap_err().code(), Code::Unimplemented);
    let target = hp.path("pods/a/dev");
    hp.node()
        .node_publish_volume(publish_req(
            &v,
            None,
            &target,
            false,
            cap(Mode::SingleNodeWriter, true),
        ))
        .await
        .unwrap();
    assert!(target.is_file(), "a block volume is published as a file");
    if can_mount() {
        assert_eq!(mount_count(&target), 1);
    }
    hp.node()
        .node_unpublish_volume(NodeUnpublishVolumeRequest {
            volume_id: v.volume_id.clone(),
            target_path: target.display().to_string(),
        })
        .await
        .unwrap();
    assert!(!target.exists());
}

#[tokio::test]
async fn a_restarted_plugin_knows_what_it_did() {
    let mut hp = HostPath::start(&[]).await;
    let v = attached_volume(&hp, "v1", vec![sw()]).await;
    hp.controller()
        .controller_publish_volume(ControllerPublishVolumeRequest {
            volume_id: v.volume_id.clone(),
            node_id: "node-1".into(),
            volume_capability: Some(sw()),
            ..Default::default()
        })
        .await
        .unwrap();
    let snap = hp
        .controller()
        .create_snapshot(CreateSnapshotRequest {
            source_volume_id: v.volume_id.clone(),
            name: "s".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    let staging = hp.path("staging/v1");
    let target = hp.path("pods/a/v1");
    std::fs::create_dir_all(&staging).unwrap();
    hp.node()
        .node_stage_volume(stage_req(&v, &staging, sw()))
        .await
        .unwrap();
    hp.node()
        .node_publish_volume(publish_req(&v, Some(&staging), &target, false, sw()))
        .await
        .unwrap();

    hp.restart().await; // kill -9, then start again on the same state dir

    let vols = hp
        .controller()
        .list_volumes(ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(vols.entries.len(), 1);
    assert_eq!(
        vols.entries[0].status.as_ref().unwrap().published_node_ids,
        ["node-1"]
    );
    let snaps = hp
        .controller()
        .list_snapshots(ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        snaps.entries[0].snapshot.as_ref().unwrap().snapshot_id,
        snap.snapshot_id
    );
    let again = hp
        .controller()
        .create_volume(create("v1", vec![sw()], 1 << 20))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.volume.unwrap().volume_id, v.volume_id);
    // It still knows the publish: a conflicting one is refused, a repeat is OK without a
    // second mount.
    let conflict = hp
        .node()
        .node_publish_volume(publish_req(&v, Some(&staging), &target, true, sw()))
        .await;
    assert_eq!(conflict.unwrap_err().code(), Code::AlreadyExists);
    hp.node()
        .node_publish_volume(publish_req(&v, Some(&staging), &target, false, sw()))
        .await
        .unwrap();
    if can_mount() {
        assert_eq!(mount_count(&target), 1);
    }
    let del = hp
        .controller()
        .delete_volume(DeleteVolumeRequest {
            volume_id: v.volume_id.clone(),
            ..Default::default()
        })
        .await;
    assert_eq!(
        del.unwrap_err().code(),
        Code::FailedPrecondition,
        "it remembers the attachment"
    );
}

#[tokio::test]
async fn injected_failures_latency_hangs_and_exit() {
    let mut hp = HostPath::start(&[]).await;
    let v = attached_volume(&hp, "v1", vec![sw()]).await;
    let staging = hp.path("staging/v1");
    std::fs::create_dir_all(&staging).unwrap();

    // Fail the next 2 NodeStage calls with Unavailable.
    hp.fault(Command::Fail {
        rpc: "NodeStageVolume".into(),
        code: "Unavailable".into(),
        times: 2,
    })
    .await;
    for _ in 0..2 {
        let e = hp
            .node()
            .node_stage_volume(stage_req(&v, &staging, sw()))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::Unavailable);
    }
    hp.node()
        .node_stage_volume(stage_req(&v, &staging, sw()))
        .await
        .expect("the third succeeds");

    // Latency.
    hp.fault(Command::Latency {
        rpc: "Probe".into(),
        ms: 300,
    })
    .await;
    let start = Instant::now();
    hp.identity().probe(ProbeRequest {}).await.unwrap();
    assert!(start.elapsed() >= Duration::from_millis(300));
    hp.fault(Command::Latency {
        rpc: "Probe".into(),
        ms: 0,
    })
    .await;

    // Hang before: the call waits until released, and the status shows it held.
    hp.fault(Command::Hang {
        rpc: "NodeUnstageVolume".into(),
        after: false,
    })
    .await;
    let mut node = hp.node();
    let req = NodeUnstageVolumeRequest {
        volume_id: v.volume_id.clone(),
        staging_target_path: staging.display().to_string(),
    };
    let held = tokio::spawn(async move { node.node_unstage_volume(req).await });
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let st = moor_hostpath::faults::status(&hp.admin).await.unwrap();
        if st.hanging.get("NodeUnstageVolume") == Some(&1) {
            break;
        }
        assert!(Instant::now() < deadline, "the call was never held");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!held.is_finished());
    hp.fault(Command::Release {
        rpc: "NodeUnstageVolume".into(),
    })
    .await;
    held.await.unwrap().expect("released calls complete");

    // Hang after: the operation takes effect, the caller times out, the log says so.
    hp.fault(Command::Hang {
        rpc: "NodeStageVolume".into(),
        after: true,
    })
    .await;
    let mut req = Request::new(stage_req(&v, &staging, sw()));
    req.set_timeout(Duration::from_millis(300));
    let e = hp.node().node_stage_volume(req).await.unwrap_err();
    assert!(
        matches!(e.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{e:?}"
    );
    // The server drops the handler when its own copy of the deadline passes, which may
    // be a little after the client gave up: wait for that before releasing the hold.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !hp
        .calls()
        .iter()
        .any(|c| c.rpc == "NodeStageVolume" && c.code == "Cancelled")
    {
        assert!(
            Instant::now() < deadline,
            "the abandoned call was not logged as Cancelled"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    hp.fault(Command::Release {
        rpc: "NodeStageVolume".into(),
    })
    .await;
    if can_mount() {
        assert_eq!(mount_count(&staging), 1, "the hung stage took effect");
    }

    // A bad command is refused with a reason.
    let bad = moor_hostpath::faults::send(
        &hp.admin,
        &Command::Fail {
            rpc: "Probe".into(),
            code: "Nope".into(),
            times: 1,
        },
    )
    .await;
    assert!(bad.unwrap_err().to_string().contains("unknown gRPC code"));

    // Exit abruptly at the 2nd GetPluginInfo.
    hp.fault(Command::ExitAt {
        rpc: "GetPluginInfo".into(),
        nth: 2,
    })
    .await;
    hp.identity()
        .get_plugin_info(GetPluginInfoRequest {})
        .await
        .unwrap();
    assert!(hp
        .identity()
        .get_plugin_info(GetPluginInfoRequest {})
        .await
        .is_err());
    assert_eq!(hp.exited(Duration::from_secs(10)).await, Some(86));
}

#[tokio::test]
async fn the_call_log_records_every_rpc_and_never_a_secret() {
    let hp = HostPath::start(&[]).await;
    let mut req = create("v1", vec![sw()], 1 << 20);
    req.secrets = [("password".to_string(), "hunter2".to_string())].into();
    let mut mflags = sw();
    if let Some(volume_capability::AccessType::Mount(m)) = mflags.access_type.as_mut() {
        m.mount_flags = vec!["password=hunter2".into()];
    }
    req.volume_capabilities = vec![mflags];
    let v = hp
        .controller()
        .create_volume(req)
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let _ = hp
        .controller()
        .delete_volume(DeleteVolumeRequest::default())
        .await;
    let calls = hp.calls();
    let create = calls.iter().find(|c| c.rpc == "CreateVolume").unwrap();
    assert_eq!(create.code, "OK");
    assert_eq!(create.name.as_deref(), Some("v1"));
    let bad = calls.iter().find(|c| c.rpc == "DeleteVolume").unwrap();
    assert_eq!(bad.code, "InvalidArgument");
    assert!(calls.iter().any(|c| c.rpc == "Probe" && c.ok()));
    let text = std::fs::read_to_string(&hp.calls).unwrap();
    assert!(!text.contains("hunter2"), "a secret reached the call log");
    assert!(
        !hp.log().contains("hunter2"),
        "a secret reached the plugin's log"
    );
    assert!(!v.volume_id.is_empty());
}

#[tokio::test]
async fn the_checker_passes_a_real_lifecycle_and_catches_a_wrong_one() {
    use moor_hostpath::checker::{check, CheckConfig};
    let hp = HostPath::start(&[]).await;
    let v = new_volume(&hp, "v1", vec![sw()]).await;
    let staging = hp.path("staging/v1");
    let target = hp.path("pods/a/v1");
    std::fs::create_dir_all(&staging).unwrap();
    let attach = ControllerPublishVolumeRequest {
        volume_id: v.volume_id.clone(),
        node_id: "node-1".into(),
        volume_capability: Some(sw()),
        ..Default::default()
    };
    let detach = ControllerUnpublishVolumeRequest {
        volume_id: v.volume_id.clone(),
        node_id: "node-1".into(),
        ..Default::default()
    };
    let unpublish = NodeUnpublishVolumeRequest {
        volume_id: v.volume_id.clone(),
        target_path: target.display().to_string(),
    };
    let unstage = NodeUnstageVolumeRequest {
        volume_id: v.volume_id.clone(),
        staging_target_path: staging.display().to_string(),
    };
    let cfg = CheckConfig {
        controller_publish_required: true,
        stage_required: true,
        expect_released: true,
        ..Default::default()
    };

    hp.controller()
        .controller_publish_volume(attach.clone())
        .await
        .unwrap();
    hp.node()
        .node_stage_volume(stage_req(&v, &staging, sw()))
        .await
        .unwrap();
    hp.node()
        .node_publish_volume(publish_req(&v, Some(&staging), &target, false, sw()))
        .await
        .unwrap();
    hp.node()
        .node_unpublish_volume(unpublish.clone())
        .await
        .unwrap();
    hp.node()
        .node_unstage_volume(unstage.clone())
        .await
        .unwrap();
    hp.controller()
        .controller_unpublish_volume(detach.clone())
        .await
        .unwrap();
    let violations = check(&hp.calls(), &cfg);
    assert!(violations.is_empty(), "{violations:?}");

    // Now in the wrong order: unstage while published, detach while staged.
    hp.controller()
        .controller_publish_volume(attach)
        .await
        .unwrap();
    hp.node()
        .node_stage_volume(stage_req(&v, &staging, sw()))
        .await
        .unwrap();
    hp.node()
        .node_publish_volume(publish_req(&v, Some(&staging), &target, false, sw()))
        .await
        .unwrap();
    hp.node().node_unstage_volume(unstage).await.unwrap();
    hp.controller()
        .controller_unpublish_volume(detach)
        .await
        .unwrap();
    hp.node().node_unpublish_volume(unpublish).await.unwrap();
    let violations = check(&hp.calls(), &cfg);
    let found: Vec<u8> = violations.iter().map(|v| v.invariant).collect();
    assert!(found.contains(&3), "{violations:?}");
    // The same checker from the command line, as an operator runs it on any logs.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_moor-hostpath"))
        .args(["check", "--expect-released"])
        .arg(&hp.calls)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let printed = String::from_utf8_lossy(&out.stdout);
    assert_eq!(printed.lines().count(), violations.len(), "{printed}");
    assert!(printed.contains("ControllerUnpublish"), "{printed}");
    // The volume was never deleted: a leak with --expect-deleted. With the node declared
    // gone from the start, the detach while it was still staged is excused (the early
    // unstage is the node's own order, and is not).
    let node = hp.calls()[0].plugin_node.clone();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_moor-hostpath"))
        .args(["check", "--expect-deleted", "--gone", &node])
        .arg(&hp.calls)
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        printed.lines().any(|l| l.starts_with("invariant 7")),
        "{printed}"
    );
    assert!(!printed.contains("ControllerUnpublish"), "{printed}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("NodeUnstage"));
}

#[tokio::test]
async fn no_mount_keeps_the_rules_without_mounting() {
    let hp = HostPath::start(&["--no-mount"]).await;
    let v = attached_volume(&hp, "v1", vec![sw()]).await;
    let staging = hp.path("staging/v1");
    let target = hp.path("pods/a/v1");
    let early = hp
        .node()
        .node_publish_volume(publish_req(&v, Some(&staging), &target, false, sw()))
        .await;
    assert_eq!(early.unwrap_err().code(), Code::FailedPrecondition);
    hp.node()
        .node_stage_volume(stage_req(&v, &staging, sw()))
        .await
        .unwrap();
    hp.node()
        .node_publish_volume(publish_req(&v, Some(&staging), &target, false, sw()))
        .await
        .unwrap();
    assert_eq!(mount_count(&staging), 0);
    assert_eq!(mount_count(&target), 0);
    let conflict = hp
        .node()
        .node_publish_volume(publish_req(&v, Some(&staging), &target, true, sw()))
        .await;
    assert_eq!(conflict.unwrap_err().code(), Code::AlreadyExists);
}

#[tokio::test]
async fn with_publish_unpublish_a_volume_not_controller_published_here_is_not_staged() {
    let hp = HostPath::start(&[]).await;
    let v = new_volume(&hp, "v1", vec![sw()]).await;
    let staging = hp.path("staging/v1");
    std::fs::create_dir_all(&staging).unwrap();
    // No ControllerPublish yet: a strict plugin refuses, whatever the context claims.
    let early = hp
        .node()
        .node_stage_volume(stage_req(&v, &staging, sw()))
        .await;
    assert_eq!(early.unwrap_err().code(), Code::FailedPrecondition);
    let attach = ControllerPublishVolumeRequest {
        volume_id: v.volume_id.clone(),
        node_id: "node-1".into(),
        volume_capability: Some(sw()),
        ..Default::default()
    };
    let ctx = hp
        .controller()
        .controller_publish_volume(attach.clone())
        .await
        .unwrap()
        .into_inner()
        .publish_context;
    // Published, but the request does not carry the publish context.
    let mut no_ctx = stage_req(&v, &staging, sw());
    no_ctx.publish_context.clear();
    let e = hp.node().node_stage_volume(no_ctx).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    let mut req = stage_req(&v, &staging, sw());
    req.publish_context = ctx;
    hp.node().node_stage_volume(req.clone()).await.unwrap();
    hp.node()
        .node_unstage_volume(NodeUnstageVolumeRequest {
            volume_id: v.volume_id.clone(),
            staging_target_path: staging.display().to_string(),
        })
        .await
        .unwrap();
    // Unpublished again: a stale context does not get it staged.
    hp.controller()
        .controller_unpublish_volume(ControllerUnpublishVolumeRequest {
            volume_id: v.volume_id.clone(),
            node_id: "node-1".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let late = hp.node().node_stage_volume(req).await.unwrap_err();
    assert_eq!(late.code(), Code::FailedPrecondition);
}

#[tokio::test]
async fn get_snapshot_answers_for_a_snapshot_and_not_found_otherwise() {
    let hp = HostPath::start(&[]).await;
    let mut c = hp.controller();
    let caps = c
        .controller_get_capabilities(ControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    let get = controller_service_capability::rpc::Type::GetSnapshot as i32;
    assert!(caps.iter().any(|k| matches!(
        &k.r#type,
        Some(controller_service_capability::Type::Rpc(r)) if r.r#type == get
    )));
    let v = new_volume(&hp, "v1", vec![sw()]).await;
    let snap = c
        .create_snapshot(CreateSnapshotRequest {
            source_volume_id: v.volume_id.clone(),
            name: "s1".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    let got = c
        .get_snapshot(GetSnapshotRequest {
            snapshot_id: snap.snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert_eq!(got, snap);
    for (id, code) in [("snap-nope", Code::NotFound), ("", Code::InvalidArgument)] {
        let e = c
            .get_snapshot(GetSnapshotRequest {
                snapshot_id: id.into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), code, "{id:?}");
    }
}

#[tokio::test]
async fn group_snapshots_cut_every_volume_and_are_deleted_whole() {
    let hp = HostPath::start(&[]).await;
    let mut g = hp.group();
    let caps = g
        .group_controller_get_capabilities(GroupControllerGetCapabilitiesRequest {})
        .await
        .unwrap()
        .into_inner()
        .capabilities;
    assert_eq!(caps.len(), 1);
    let v1 = new_volume(&hp, "v1", vec![sw()]).await;
    let v2 = new_volume(&hp, "v2", vec![sw()]).await;
    let req = CreateVolumeGroupSnapshotRequest {
        name: "g1".into(),
        source_volume_ids: vec![v1.volume_id.clone(), v2.volume_id.clone()],
        ..Default::default()
    };
    let group = g
        .create_volume_group_snapshot(req.clone())
        .await
        .unwrap()
        .into_inner()
        .group_snapshot
        .unwrap();
    assert_eq!(group.snapshots.len(), 2);
    assert!(group.ready_to_use);
    for (s, v) in group.snapshots.iter().zip([&v1, &v2]) {
        assert_eq!(s.source_volume_id, v.volume_id);
        assert_eq!(s.group_snapshot_id, group.group_snapshot_id);
    }
    // Idempotent by name; the same name for other volumes is AlreadyExists.
    let again = g
        .create_volume_group_snapshot(req.clone())
        .await
        .unwrap()
        .into_inner()
        .group_snapshot
        .unwrap();
    assert_eq!(again.group_snapshot_id, group.group_snapshot_id);
    let mut other = req.clone();
    other.source_volume_ids.pop();
    assert_eq!(
        g.create_volume_group_snapshot(other)
            .await
            .unwrap_err()
            .code(),
        Code::AlreadyExists
    );
    // A member is deleted only with its group.
    let member = group.snapshots[0].snapshot_id.clone();
    let e = hp
        .controller()
        .delete_snapshot(DeleteSnapshotRequest {
            snapshot_id: member.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    let get = |ids: Vec<String>| GetVolumeGroupSnapshotRequest {
        group_snapshot_id: group.group_snapshot_id.clone(),
        snapshot_ids: ids,
        ..Default::default()
    };
    let got = g.get_volume_group_snapshot(get(Vec::new())).await.unwrap();
    assert_eq!(got.into_inner().group_snapshot.unwrap().snapshots.len(), 2);
    assert_eq!(
        g.get_volume_group_snapshot(get(vec!["snap-other".into()]))
            .await
            .unwrap_err()
            .code(),
        Code::InvalidArgument
    );
    let del = DeleteVolumeGroupSnapshotRequest {
        group_snapshot_id: group.group_snapshot_id.clone(),
        ..Default::default()
    };
    g.delete_volume_group_snapshot(del.clone()).await.unwrap();
    g.delete_volume_group_snapshot(del).await.unwrap();
    assert_eq!(
        g.get_volume_group_snapshot(get(Vec::new()))
            .await
            .unwrap_err()
            .code(),
        Code::NotFound
    );
    let e = hp
        .controller()
        .get_snapshot(GetSnapshotRequest {
            snapshot_id: member,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    // A source that does not exist.
    let mut missing = req;
    missing.name = "g2".into();
    missing.source_volume_ids = vec!["vol-nope".into()];
    assert_eq!(
        g.create_volume_group_snapshot(missing)
            .await
            .unwrap_err()
            .code(),
        Code::NotFound
    );
}
