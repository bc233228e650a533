//! The requests of a claim's publish steps, built without I/O: one function per RPC,
//! filling every field the CSI spec defines for it. The controller steps take the
//! Attachment and its volume; the node steps a claim, the plugin's view of the paths
//! and the secrets. The reconcilers decide which to send and when.

use std::collections::BTreeMap;

use super::{convert, v1};
use crate::api::{
    AttachInputs, Attachment, Claim, ClaimMode, ExternalVolumeId, SealedSecrets, Secrets, Snapshot,
    Volume, VolumeGroupSnapshot,
};

/// ControllerPublishVolume of an attachment: its volume and CSI node ids, capability
/// (as sent to a controller service that advertises SINGLE_NODE_MULTI_WRITER or not,
/// `multi_writer_cap`: [`crate::api::AccessMode::as_sent`]) and read-only flag; the
/// volume's mount options and secrets, and the context the attachment records (an
/// older controller's attachment: the volume's spec's, then what its status says
/// CreateVolume answered). Without the volume (deleted since), its fields are left
/// empty. Sealed
/// secrets this process cannot open are an error.
pub fn controller_publish(
    att: &Attachment,
    volume: Option<&AttachInputs>,
    multi_writer_cap: bool,
) -> Result<v1::ControllerPublishVolumeRequest, SealedSecrets> {
    let (secrets, mut context, mount_options) = match volume {
        Some(v) => {
            let mut context = (*v.context).clone();
            context.extend(v.volume_context.clone());
            (
                v.secrets.expose()?.clone(),
                context,
                (*v.mount_options).clone(),
            )
        }
        None => Default::default(),
    };
    // The context the claims were admitted with, where the controller recorded it
    // (never the volume's status, which whoever writes the volume writes).
    if let Some(admitted) = &att.spec.volume_context {
        context = admitted.clone().into();
    }
    Ok(v1::ControllerPublishVolumeRequest {
        volume_id: att.spec.external_id.to_string(),
        node_id: att.spec.csi_node_id.to_string(),
        volume_capability: Some(convert::capability(
            att.spec.capability.as_sent(multi_writer_cap),
            &mount_options,
        )),
        readonly: att.spec.read_only,
        secrets,
        volume_context: context,
    })
}

/// ControllerUnpublishVolume of an attachment, with its volume's secrets (none when
/// the volume is gone).
pub fn controller_unpublish(
    att: &Attachment,
    volume: Option<&AttachInputs>,
) -> Result<v1::ControllerUnpublishVolumeRequest, SealedSecrets> {
    controller_unpublish_of(
        att.spec.external_id.as_str(),
        att.spec.csi_node_id.as_str(),
        volume,
    )
}

/// ControllerUnpublishVolume of volume `volume_id` from CSI node `node_id` (an
/// attachment moor does not hold, which the survey found), with the volume's secrets
/// (none when it is gone). Sealed secrets this process cannot open are an error: the
/// call is not made without them.
pub fn controller_unpublish_of(
    volume_id: &str,
    node_id: &str,
    volume: Option<&AttachInputs>,
) -> Result<v1::ControllerUnpublishVolumeRequest, SealedSecrets> {
    Ok(v1::ControllerUnpublishVolumeRequest {
        volume_id: volume_id.to_string(),
        node_id: node_id.to_string(),
        secrets: match volume {
            Some(v) => v.secrets.expose()?.clone(),
            None => BTreeMap::new(),
        },
    })
}

/// The content a volume is created from, by the plugin's ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ContentSource {
    /// A snapshot's id.
    Snapshot(String),
    /// A volume's id.
    Volume(String),
}

/// CreateVolume of a volume: named by [`crate::api::plugin_name`] (so the call is
/// idempotent, a name made again is another volume, and a copied uid names nothing of
/// another's), its capacity range (none when
/// neither bound is set), every capability it offers as sent to a controller that
/// advertises SINGLE_NODE_MULTI_WRITER or not ([`volume_capabilities`]), parameters,
/// mutable parameters, secrets, content source and topology request.
pub fn create_volume(
    volume: &Volume,
    source: Option<ContentSource>,
    multi_writer_cap: bool,
) -> Result<v1::CreateVolumeRequest, SealedSecrets> {
    use v1::volume_content_source::{SnapshotSource, Type, VolumeSource};
    let spec = &volume.spec;
    let bytes = |s: Option<crate::api::Size>| {
        s.map(|s| i64::try_from(s.0).unwrap_or(i64::MAX))
            .unwrap_or_default()
    };
    Ok(v1::CreateVolumeRequest {
        name: crate::api::plugin_name_of(volume),
        capacity_range: (spec.capacity_min.is_some() || spec.capacity_max.is_some()).then(|| {
            v1::CapacityRange {
                required_bytes: bytes(spec.capacity_min),
                limit_bytes: bytes(spec.capacity_max),
            }
        }),
        volume_capabilities: volume_capabilities(spec, multi_writer_cap),
        parameters: (*spec.parameters).clone(),
        secrets: spec.secrets.expose()?.clone(),
        volume_content_source: source.map(|s| v1::VolumeContentSource {
            r#type: Some(match s {
                ContentSource::Snapshot(snapshot_id) => {
                    Type::Snapshot(SnapshotSource { snapshot_id })
                }
                ContentSource::Volume(volume_id) => Type::Volume(VolumeSource { volume_id }),
            }),
        }),
        accessibility_requirements: spec.topology_request.as_ref().map(|t| {
            v1::TopologyRequirement {
                requisite: t.required.iter().map(convert::topology).collect(),
                preferred: t.preferred.iter().map(convert::topology).collect(),
            }
        }),
        mutable_parameters: (*spec.mutable_parameters).clone(),
    })
}

/// Every capability a volume offers, as CreateVolume and ValidateVolumeCapabilities
/// carry them (with its mount options) to a controller service that advertises
/// SINGLE_NODE_MULTI_WRITER or not (`multi_writer_cap`): what the volume will be
/// used as ([`crate::api::AccessMode::as_sent`]). Two offered modes sent as one are
/// sent once.
pub fn volume_capabilities(
    spec: &crate::api::VolumeSpec,
    multi_writer_cap: bool,
) -> Vec<v1::VolumeCapability> {
    let mut sent: Vec<crate::api::VolumeCapability> = Vec::new();
    for c in spec
        .capabilities
        .iter()
        .map(|c| c.as_sent(multi_writer_cap))
    {
        if !sent.contains(&c) {
            sent.push(c);
        }
    }
    sent.iter()
        .map(|c| convert::capability(*c, &spec.mount_options))
        .collect()
}

/// ValidateVolumeCapabilities of a volume registered with the plugin's id `volume_id`:
/// every capability of its spec (with its mount options), its context, parameters,
/// mutable parameters and secrets.
pub fn validate_volume_capabilities(
    volume: &Volume,
    volume_id: &str,
    multi_writer_cap: bool,
) -> Result<v1::ValidateVolumeCapabilitiesRequest, SealedSecrets> {
    let spec = &volume.spec;
    Ok(v1::ValidateVolumeCapabilitiesRequest {
        volume_id: volume_id.to_string(),
        volume_context: (*spec.context).clone(),
        volume_capabilities: volume_capabilities(spec, multi_writer_cap),
        parameters: (*spec.parameters).clone(),
        secrets: spec.secrets.expose()?.clone(),
        mutable_parameters: (*spec.mutable_parameters).clone(),
    })
}

/// DeleteVolume of a volume, by the plugin's id `volume_id`, with its secrets.
pub fn delete_volume(
    volume: &Volume,
    volume_id: &str,
) -> Result<v1::DeleteVolumeRequest, SealedSecrets> {
    Ok(v1::DeleteVolumeRequest {
        volume_id: volume_id.to_string(),
        secrets: volume.spec.secrets.expose()?.clone(),
    })
}

/// ControllerExpandVolume of a volume to `required..=limit` bytes (0: no limit), with
/// its secrets and the capability it is used with (its first, as sent: see
/// [`volume_capabilities`]).
pub fn controller_expand(
    volume: &Volume,
    volume_id: &str,
    required: u64,
    limit: u64,
    multi_writer_cap: bool,
) -> Result<v1::ControllerExpandVolumeRequest, SealedSecrets> {
    let spec = &volume.spec;
    Ok(v1::ControllerExpandVolumeRequest {
        volume_id: volume_id.to_string(),
        capacity_range: Some(v1::CapacityRange {
            required_bytes: i64::try_from(required).unwrap_or(i64::MAX),
            limit_bytes: i64::try_from(limit).unwrap_or(i64::MAX),
        }),
        secrets: spec.secrets.expose()?.clone(),
        volume_capability: spec
            .capabilities
            .first()
            .map(|c| convert::capability(c.as_sent(multi_writer_cap), &spec.mount_options)),
    })
}

/// ControllerModifyVolume of a volume with its spec's mutable parameters and secrets.
pub fn controller_modify(
    volume: &Volume,
    volume_id: &str,
) -> Result<v1::ControllerModifyVolumeRequest, SealedSecrets> {
    Ok(v1::ControllerModifyVolumeRequest {
        volume_id: volume_id.to_string(),
        secrets: volume.spec.secrets.expose()?.clone(),
        mutable_parameters: (*volume.spec.mutable_parameters).clone(),
    })
}

/// The secrets a snapshot's calls carry: its own, else its volume's (none when the
/// volume is gone). Sealed secrets this process cannot open are an error.
pub fn snapshot_secrets(
    snap: &Snapshot,
    volume: Option<&Volume>,
) -> Result<BTreeMap<String, String>, SealedSecrets> {
    own_or_volume_secrets(&snap.spec.secrets, volume)
}

/// `own` secrets when there are any, else `volume`'s (none without a volume).
fn own_or_volume_secrets(
    own: &Secrets,
    volume: Option<&Volume>,
) -> Result<BTreeMap<String, String>, SealedSecrets> {
    if !own.is_empty() {
        return Ok(own.expose()?.clone());
    }
    Ok(match volume {
        Some(v) => v.spec.secrets.expose()?.clone(),
        None => BTreeMap::new(),
    })
}

/// CreateSnapshot of the plugin's volume `source`, named by
/// [`crate::api::plugin_name`] (so a repeat is idempotent), with its parameters and secrets.
pub fn create_snapshot(
    snap: &Snapshot,
    volume: Option<&Volume>,
    source: &str,
) -> Result<v1::CreateSnapshotRequest, SealedSecrets> {
    Ok(v1::CreateSnapshotRequest {
        source_volume_id: source.to_string(),
        name: crate::api::plugin_name_of(snap),
        secrets: snapshot_secrets(snap, volume)?,
        parameters: snap.spec.parameters.clone(),
        accessibility_requirements: None,
    })
}

/// GetSnapshot of the plugin's snapshot `id`, with the snapshot's secrets.
pub fn get_snapshot(
    snap: &Snapshot,
    volume: Option<&Volume>,
    id: &str,
) -> Result<v1::GetSnapshotRequest, SealedSecrets> {
    Ok(v1::GetSnapshotRequest {
        snapshot_id: id.to_string(),
        secrets: snapshot_secrets(snap, volume)?,
    })
}

/// ListSnapshots of the one snapshot `id` (an import), with the snapshot's secrets.
pub fn list_snapshot(
    snap: &Snapshot,
    volume: Option<&Volume>,
    id: &str,
) -> Result<v1::ListSnapshotsRequest, SealedSecrets> {
    Ok(v1::ListSnapshotsRequest {
        snapshot_id: id.to_string(),
        secrets: snapshot_secrets(snap, volume)?,
        ..Default::default()
    })
}

/// DeleteSnapshot of the plugin's snapshot `id`, with the snapshot's secrets.
pub fn delete_snapshot(
    snap: &Snapshot,
    volume: Option<&Volume>,
    id: &str,
) -> Result<v1::DeleteSnapshotRequest, SealedSecrets> {
    Ok(v1::DeleteSnapshotRequest {
        snapshot_id: id.to_string(),
        secrets: snapshot_secrets(snap, volume)?,
    })
}

/// A group snapshot's secrets: its own, else its first volume's.
pub fn group_secrets(
    group: &VolumeGroupSnapshot,
    first: Option<&Volume>,
) -> Result<BTreeMap<String, String>, SealedSecrets> {
    own_or_volume_secrets(&group.spec.secrets, first)
}

/// CreateVolumeGroupSnapshot of the plugin's volumes `sources`, named by
/// [`crate::api::plugin_name`] (so a repeat is idempotent), with its parameters and secrets.
pub fn create_group_snapshot(
    group: &VolumeGroupSnapshot,
    first: Option<&Volume>,
    sources: &[String],
) -> Result<v1::CreateVolumeGroupSnapshotRequest, SealedSecrets> {
    Ok(v1::CreateVolumeGroupSnapshotRequest {
        name: crate::api::plugin_name_of(group),
        source_volume_ids: sources.to_vec(),
        secrets: group_secrets(group, first)?,
        parameters: group.spec.parameters.clone(),
    })
}

/// GetVolumeGroupSnapshot of the plugin's group `id` (its members `snapshot_ids`,
/// when known), with the group's secrets.
pub fn get_group_snapshot(
    group: &VolumeGroupSnapshot,
    first: Option<&Volume>,
    id: &str,
    snapshot_ids: Vec<String>,
) -> Result<v1::GetVolumeGroupSnapshotRequest, SealedSecrets> {
    Ok(v1::GetVolumeGroupSnapshotRequest {
        group_snapshot_id: id.to_string(),
        snapshot_ids,
        secrets: group_secrets(group, first)?,
    })
}

/// DeleteVolumeGroupSnapshot of the plugin's group `id` with every member
/// `snapshot_ids` (the spec requires them all), with the group's secrets.
pub fn delete_group_snapshot(
    group: &VolumeGroupSnapshot,
    first: Option<&Volume>,
    id: &str,
    snapshot_ids: Vec<String>,
) -> Result<v1::DeleteVolumeGroupSnapshotRequest, SealedSecrets> {
    Ok(v1::DeleteVolumeGroupSnapshotRequest {
        group_snapshot_id: id.to_string(),
        snapshot_ids,
        secrets: group_secrets(group, first)?,
    })
}

/// What every node request of a claim carries.
#[derive(Debug, Clone, Copy)]
pub struct NodeVolume<'a> {
    /// The claim.
    pub claim: &'a Claim,
    /// The plugin's id of the volume.
    pub volume_id: &'a ExternalVolumeId,
    /// The claim's capability with its mount options ([`super::convert::node_capability`]).
    pub capability: &'a v1::VolumeCapability,
    /// The secrets NodeStage and NodeExpand carry (the claim's node secrets, opened).
    pub secrets: &'a BTreeMap<String, String>,
    /// The secrets NodePublish carries (the claim's node-publish secrets, else its
    /// node secrets).
    pub publish_secrets: &'a BTreeMap<String, String>,
}

/// NodeStageVolume to `staging_target_path` (the plugin's view).
pub fn node_stage(v: &NodeVolume, staging_target_path: &str) -> v1::NodeStageVolumeRequest {
    v1::NodeStageVolumeRequest {
        volume_id: v.volume_id.to_string(),
        publish_context: v.claim.spec.publish_context.clone().into(),
        staging_target_path: staging_target_path.to_string(),
        volume_capability: Some(v.capability.clone()),
        secrets: v.secrets.clone(),
        volume_context: v.claim.spec.volume_context.clone().into(),
    }
}

/// NodePublishVolume to `target_path`, from `staging_target_path` when the plugin
/// stages (the plugin's views); read-only for a reading claim.
pub fn node_publish(
    v: &NodeVolume,
    staging_target_path: Option<&str>,
    target_path: &str,
) -> v1::NodePublishVolumeRequest {
    v1::NodePublishVolumeRequest {
        volume_id: v.volume_id.to_string(),
        publish_context: v.claim.spec.publish_context.clone().into(),
        staging_target_path: staging_target_path.unwrap_or_default().to_string(),
        target_path: target_path.to_string(),
        volume_capability: Some(v.capability.clone()),
        readonly: v.claim.spec.mode == ClaimMode::Read,
        secrets: v.publish_secrets.clone(),
        volume_context: v.claim.spec.volume_context.clone().into(),
    }
}

/// NodeExpandVolume of the volume at `volume_path` (published, or staged for an
/// offline expansion) to at least `bytes`.
pub fn node_expand(
    v: &NodeVolume,
    volume_path: &str,
    staging_target_path: Option<&str>,
    bytes: u64,
) -> v1::NodeExpandVolumeRequest {
    v1::NodeExpandVolumeRequest {
        volume_id: v.volume_id.to_string(),
        volume_path: volume_path.to_string(),
        capacity_range: Some(v1::CapacityRange {
            required_bytes: i64::try_from(bytes).unwrap_or(i64::MAX),
            limit_bytes: 0,
        }),
        staging_target_path: staging_target_path.unwrap_or_default().to_string(),
        volume_capability: Some(v.capability.clone()),
        secrets: v.secrets.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::*;

    fn claim(mode: ClaimMode) -> Claim {
        Claim::new(
            &Namespace::default_ns(),
            Name::new("a1.data").unwrap(),
            ClaimSpec {
                mode,
                publish_context: [("lun".to_string(), "3".to_string())].into(),
                volume_context: [("pool".to_string(), "fast".to_string())].into(),
                ..Default::default()
            },
        )
    }

    fn id() -> ExternalVolumeId {
        ExternalVolumeId::new("vol-1").unwrap()
    }

    fn capability() -> v1::VolumeCapability {
        crate::csi::convert::node_capability(
            VolumeCapability {
                access_mode: AccessMode::SingleNodeWriter,
                attachment_mode: AttachmentMode::FileSystem,
            },
            &MountOptions::default(),
            false,
        )
    }

    fn attachment() -> Attachment {
        Attachment::new(
            &Namespace::default_ns(),
            Name::new("v1.n1").unwrap(),
            AttachmentSpec {
                volume: VolumeId::new("v1").unwrap(),
                node: NodeName::new("n1").unwrap(),
                external_id: id(),
                plugin_id: PluginId::new("p").unwrap(),
                csi_node_id: CsiNodeId::new("csi-n1").unwrap(),
                capability: VolumeCapability {
                    access_mode: AccessMode::SingleNodeWriter,
                    attachment_mode: AttachmentMode::FileSystem,
                },
                read_only: true,
                detach: false,
                volume_context: None,
            },
        )
    }

    fn volume() -> Volume {
        let mut v = Volume::new(
            &Namespace::default_ns(),
            Name::new("v1").unwrap(),
            VolumeSpec {
                secrets: Secrets::new([("k".to_string(), "s".to_string())].into()).into(),
                context: BTreeMap::from([("from".to_string(), "spec".to_string())]).into(),
                mount_options: MountOptions {
                    fs_type: Some("ext4".into()),
                    ..Default::default()
                }
                .into(),
                ..Default::default()
            },
        );
        v.status.provisioning.volume_context = [("created".to_string(), "yes".to_string())].into();
        v
    }

    #[test]
    fn controller_publish_carries_every_field_the_spec_defines() {
        let (att, v) = (attachment(), volume().attach_inputs());
        let r = controller_publish(&att, Some(&v), false).unwrap();
        assert_eq!(r.volume_id, "vol-1");
        assert_eq!(r.node_id, "csi-n1");
        assert!(r.readonly);
        assert_eq!(r.secrets.get("k").map(String::as_str), Some("s"));
        assert_eq!(
            r.volume_context.len(),
            2,
            "the spec's and CreateVolume's context"
        );
        // An attachment that records the context its claims were admitted with sends
        // that one, never the volume's status.
        let mut recorded = att.clone();
        recorded.spec.volume_context =
            Some([("path".to_string(), "/from/record".to_string())].into());
        let r2 = controller_publish(&recorded, Some(&v), false).unwrap();
        assert_eq!(
            r2.volume_context,
            [("path".to_string(), "/from/record".to_string())].into(),
            "the attachment's context alone"
        );
        let cap = r.volume_capability.expect("capability");
        assert_eq!(
            cap.access_mode.map(|m| m.mode),
            Some(v1::volume_capability::access_mode::Mode::SingleNodeWriter as i32)
        );
        match cap.access_type {
            Some(v1::volume_capability::AccessType::Mount(m)) => assert_eq!(m.fs_type, "ext4"),
            other => panic!("mount access expected, got {other:?}"),
        }
        // A controller that advertises SINGLE_NODE_MULTI_WRITER gets the mode that
        // lets the volume's claims share its node.
        let r = controller_publish(&att, Some(&v), true).unwrap();
        assert_eq!(
            r.volume_capability
                .and_then(|c| c.access_mode)
                .map(|m| m.mode),
            Some(v1::volume_capability::access_mode::Mode::SingleNodeMultiWriter as i32)
        );
        // The volume gone: the ids and capability still, nothing of the volume.
        let r = controller_publish(&att, None, false).unwrap();
        assert!(r.secrets.is_empty() && r.volume_context.is_empty());
        assert_eq!(r.node_id, "csi-n1");
        let r = controller_unpublish(&att, Some(&v)).unwrap();
        assert_eq!(
            (r.volume_id.as_str(), r.node_id.as_str(), r.secrets.len()),
            ("vol-1", "csi-n1", 1)
        );
    }

    #[test]
    fn an_unpublish_of_an_unknown_attachment_carries_the_volume_s_secrets_or_is_not_made() {
        let v = volume().attach_inputs();
        let r = controller_unpublish_of("vol-9", "csi-n2", Some(&v)).unwrap();
        assert_eq!(
            (r.volume_id.as_str(), r.node_id.as_str()),
            ("vol-9", "csi-n2")
        );
        assert_eq!(r.secrets.get("k").map(String::as_str), Some("s"));
        let r = controller_unpublish_of("vol-9", "csi-n2", None).unwrap();
        assert!(r.secrets.is_empty(), "no volume, no secrets");
        // Sealed with a key this process does not hold: no request, never empty secrets.
        let mut sealed = volume();
        sealed.spec.secrets = Secrets::sealed_text("moor:sealed:v1:k9:AAAA".into()).into();
        let sealed = sealed.attach_inputs();
        let err = controller_unpublish_of("vol-9", "csi-n2", Some(&sealed)).unwrap_err();
        assert_eq!(err.key_id, "k9");
        let att = attachment();
        assert!(controller_unpublish(&att, Some(&sealed)).is_err());
    }

    #[test]
    fn create_volume_carries_every_field_the_spec_defines() {
        let mut v = volume();
        v.metadata.uid = "uid-7".into();
        v.spec.capabilities = vec![VolumeCapability {
            access_mode: AccessMode::SingleNodeWriter,
            attachment_mode: AttachmentMode::FileSystem,
        }];
        v.spec.capacity_min = Some(Size(1 << 20));
        v.spec.parameters = BTreeMap::from([("tier".to_string(), "gold".to_string())]).into();
        v.spec.mutable_parameters =
            BTreeMap::from([("iops".to_string(), "300".to_string())]).into();
        v.spec.topology_request = Some(Box::new(TopologyRequest {
            required: vec![[("zone".to_string(), "a".to_string())].into()],
            preferred: vec![],
        }));
        let r = create_volume(&v, Some(ContentSource::Snapshot("snap-1".into())), true).unwrap();
        assert_eq!(
            r.name,
            plugin_name_of(&v),
            "named by its namespace, name and uid"
        );
        assert!(
            r.name.starts_with("moor-") && r.name.len() == 37,
            "{}",
            r.name
        );
        // The same uid copied into another namespace names another plugin volume.
        let mut copy = v.clone();
        copy.metadata.namespace = Namespace::new("other").unwrap();
        let other = create_volume(&copy, None, true).unwrap();
        assert_ne!(other.name, r.name);
        let range = r.capacity_range.expect("a range");
        assert_eq!((range.required_bytes, range.limit_bytes), (1 << 20, 0));
        assert_eq!(r.parameters["tier"], "gold");
        assert_eq!(r.mutable_parameters["iops"], "300");
        assert_eq!(r.secrets.get("k").map(String::as_str), Some("s"));
        assert_eq!(
            r.volume_capabilities
                .iter()
                .filter_map(|c| c.access_mode.as_ref().map(|m| m.mode))
                .collect::<Vec<_>>(),
            [v1::volume_capability::access_mode::Mode::SingleNodeMultiWriter as i32]
        );
        match r.volume_content_source.and_then(|s| s.r#type) {
            Some(v1::volume_content_source::Type::Snapshot(s)) => {
                assert_eq!(s.snapshot_id, "snap-1")
            }
            other => panic!("a snapshot source expected, got {other:?}"),
        }
        let t = r.accessibility_requirements.expect("topology");
        assert_eq!(t.requisite.len(), 1);
        assert_eq!(t.requisite[0].segments["zone"], "a");
        // From a volume; no bounds, no range.
        v.spec.capacity_min = None;
        let r = create_volume(&v, Some(ContentSource::Volume("vol-0".into())), false).unwrap();
        assert!(r.capacity_range.is_none());
        assert!(matches!(
            r.volume_content_source.and_then(|s| s.r#type),
            Some(v1::volume_content_source::Type::Volume(ref s)) if s.volume_id == "vol-0"
        ));
        // Sealed secrets this process cannot open: no request.
        v.spec.secrets = Secrets::sealed_text("moor:sealed:v1:k9:AAAA".into()).into();
        assert!(create_volume(&v, None, false).is_err());
    }

    #[test]
    fn a_volume_s_controller_requests_carry_every_field_the_spec_defines() {
        let mut v = volume();
        v.spec.capabilities = vec![
            VolumeCapability {
                access_mode: AccessMode::MultiNodeReaderOnly,
                attachment_mode: AttachmentMode::FileSystem,
            },
            VolumeCapability {
                access_mode: AccessMode::SingleNodeWriter,
                attachment_mode: AttachmentMode::BlockDevice,
            },
        ];
        v.spec.parameters = BTreeMap::from([("tier".to_string(), "gold".to_string())]).into();
        v.spec.mutable_parameters =
            BTreeMap::from([("iops".to_string(), "300".to_string())]).into();
        let secret = |m: &BTreeMap<String, String>| m.get("k").cloned();

        let r = validate_volume_capabilities(&v, "vol-9", false).unwrap();
        assert_eq!(r.volume_id, "vol-9");
        assert_eq!(
            r.volume_capabilities.len(),
            2,
            "every capability of the spec"
        );
        let modes = |caps: &[v1::VolumeCapability]| -> Vec<i32> {
            caps.iter()
                .filter_map(|c| c.access_mode.as_ref().map(|m| m.mode))
                .collect()
        };
        use v1::volume_capability::access_mode::Mode;
        assert_eq!(
            modes(&r.volume_capabilities),
            [
                Mode::MultiNodeReaderOnly as i32,
                Mode::SingleNodeWriter as i32
            ]
        );
        let r = validate_volume_capabilities(&v, "vol-9", true).unwrap();
        assert_eq!(
            modes(&r.volume_capabilities),
            [
                Mode::MultiNodeReaderOnly as i32,
                Mode::SingleNodeMultiWriter as i32
            ],
            "what the volume is used as where the plugin advertises SINGLE_NODE_MULTI_WRITER"
        );
        assert_eq!(r.volume_context["from"], "spec");
        assert_eq!(r.parameters["tier"], "gold");
        assert_eq!(r.mutable_parameters["iops"], "300");
        assert_eq!(secret(&r.secrets).as_deref(), Some("s"));

        let r = delete_volume(&v, "vol-9").unwrap();
        assert_eq!(
            (r.volume_id.as_str(), secret(&r.secrets).as_deref()),
            ("vol-9", Some("s"))
        );

        let r = controller_expand(&v, "vol-9", 2 << 30, 0, false).unwrap();
        assert_eq!(r.volume_id, "vol-9");
        let range = r.capacity_range.unwrap();
        assert_eq!((range.required_bytes, range.limit_bytes), (2 << 30, 0));
        assert_eq!(secret(&r.secrets).as_deref(), Some("s"));
        let cap = r.volume_capability.expect("the first capability");
        assert_eq!(
            cap.access_mode.map(|m| m.mode),
            Some(v1::volume_capability::access_mode::Mode::MultiNodeReaderOnly as i32)
        );
        assert_eq!(
            controller_expand(&v, "x", u64::MAX, u64::MAX, false)
                .unwrap()
                .capacity_range
                .unwrap()
                .required_bytes,
            i64::MAX,
            "clamped, never negative"
        );

        let r = controller_modify(&v, "vol-9").unwrap();
        assert_eq!(r.volume_id, "vol-9");
        assert_eq!(r.mutable_parameters["iops"], "300");
        assert_eq!(secret(&r.secrets).as_deref(), Some("s"));

        // Sealed with a key this process does not hold: none of them is built.
        v.spec.secrets = Secrets::sealed_text("moor:sealed:v1:k9:AAAA".into()).into();
        assert!(validate_volume_capabilities(&v, "vol-9", false).is_err());
        assert!(delete_volume(&v, "vol-9").is_err());
        assert!(controller_expand(&v, "vol-9", 1, 0, false).is_err());
        assert!(controller_modify(&v, "vol-9").is_err());
    }

    #[test]
    fn a_snapshot_s_requests_carry_its_secrets_else_its_volume_s() {
        let v = volume();
        let mut snap = Snapshot::new(
            &Namespace::default_ns(),
            Name::new("s1").unwrap(),
            SnapshotSpec {
                volume: VolumeId::new("v1").unwrap(),
                parameters: BTreeMap::from([("kind".to_string(), "full".to_string())]),
                ..Default::default()
            },
        );
        snap.metadata.uid = "uid-s1".into();
        let r = create_snapshot(&snap, Some(&v), "vol-1").unwrap();
        assert_eq!(
            (r.source_volume_id.as_str(), r.name.as_str()),
            ("vol-1", plugin_name_of(&snap).as_str())
        );
        assert_eq!(r.parameters["kind"], "full");
        assert_eq!(
            r.secrets["k"], "s",
            "the volume's, the snapshot having none"
        );
        let r = get_snapshot(&snap, None, "snap-1").unwrap();
        assert_eq!(r.snapshot_id, "snap-1");
        assert!(r.secrets.is_empty(), "no volume, no secrets of its");
        let r = list_snapshot(&snap, Some(&v), "snap-1").unwrap();
        assert_eq!((r.snapshot_id.as_str(), r.max_entries), ("snap-1", 0));
        assert!(r.source_volume_id.is_empty() && r.starting_token.is_empty());
        assert_eq!(r.secrets["k"], "s");
        snap.spec.secrets = Secrets::new([("own".to_string(), "o".to_string())].into());
        let r = delete_snapshot(&snap, Some(&v), "snap-1").unwrap();
        assert_eq!(r.snapshot_id, "snap-1");
        assert_eq!(
            r.secrets.keys().collect::<Vec<_>>(),
            ["own"],
            "its own first"
        );
        // Sealed where this process has no key: none is built.
        snap.spec.secrets = Secrets::sealed_text("moor:sealed:v1:k9:AAAA".into());
        assert!(create_snapshot(&snap, Some(&v), "vol-1").is_err());
        assert!(get_snapshot(&snap, Some(&v), "x").is_err());
        assert!(list_snapshot(&snap, Some(&v), "x").is_err());
        assert!(delete_snapshot(&snap, Some(&v), "x").is_err());
    }

    #[test]
    fn stage_carries_every_field_the_spec_defines() {
        let c = claim(ClaimMode::Write);
        let (id, cap) = (id(), capability());
        let secrets = [("token".to_string(), "t".to_string())].into();
        let v = NodeVolume {
            claim: &c,
            volume_id: &id,
            capability: &cap,
            secrets: &secrets,
            publish_secrets: &BTreeMap::new(),
        };
        let r = node_stage(&v, "/csi/staging/x");
        assert_eq!(r.volume_id, "vol-1");
        assert_eq!(r.publish_context["lun"], "3");
        assert_eq!(r.staging_target_path, "/csi/staging/x");
        assert_eq!(r.volume_capability, Some(cap.clone()));
        assert_eq!(r.secrets, secrets);
        assert_eq!(r.volume_context["pool"], "fast");
    }

    #[test]
    fn publish_is_read_only_for_a_reader_and_names_the_staging_path_only_when_staged() {
        let (id, cap) = (id(), capability());
        let secrets = BTreeMap::new();
        let publish: BTreeMap<String, String> = [("p".to_string(), "1".to_string())].into();
        let writer = claim(ClaimMode::Write);
        let v = NodeVolume {
            claim: &writer,
            volume_id: &id,
            capability: &cap,
            secrets: &secrets,
            publish_secrets: &publish,
        };
        let r = node_publish(&v, Some("/csi/staging/x"), "/csi/target/y");
        assert_eq!(r.secrets, publish, "NodePublish carries its own family's");
        assert!(!r.readonly);
        assert_eq!(r.staging_target_path, "/csi/staging/x");
        assert_eq!(r.target_path, "/csi/target/y");
        assert_eq!(r.publish_context["lun"], "3");
        assert_eq!(r.volume_context["pool"], "fast");
        assert_eq!(r.volume_capability, Some(cap.clone()));
        let reader = claim(ClaimMode::Read);
        let v = NodeVolume {
            claim: &reader,
            ..v
        };
        let r = node_publish(&v, None, "/csi/target/y");
        assert!(r.readonly);
        assert_eq!(r.staging_target_path, "");
    }

    #[test]
    fn expand_asks_for_at_least_the_capacity_without_a_limit() {
        let c = claim(ClaimMode::Write);
        let (id, cap) = (id(), capability());
        let secrets = BTreeMap::new();
        let v = NodeVolume {
            claim: &c,
            volume_id: &id,
            capability: &cap,
            secrets: &secrets,
            publish_secrets: &secrets,
        };
        let r = node_expand(&v, "/csi/target/y", Some("/csi/staging/x"), 4 << 20);
        assert_eq!(r.volume_path, "/csi/target/y");
        assert_eq!(r.staging_target_path, "/csi/staging/x");
        let range = r.capacity_range.unwrap();
        assert_eq!((range.required_bytes, range.limit_bytes), (4 << 20, 0));
        // Sizes past i64 are clamped, not wrapped negative.
        let r = node_expand(&v, "/p", None, u64::MAX);
        assert_eq!(r.capacity_range.unwrap().required_bytes, i64::MAX);
        assert_eq!(r.staging_target_path, "");
    }
}
