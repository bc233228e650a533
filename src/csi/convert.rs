//! Conversions between moor's types and CSI messages.

use super::v1;
use crate::api::{AccessMode, AttachmentMode, MountOptions, Topology, VolumeCapability};

/// The CSI capability for a moor capability, with the mount options for file systems,
/// as the controller calls carry it (no mount group and no SELinux context: those are
/// the node's).
pub fn capability(cap: VolumeCapability, options: &MountOptions) -> v1::VolumeCapability {
    let mut c = node_capability(cap, options, false);
    if let Some(v1::volume_capability::AccessType::Mount(m)) = &mut c.access_type {
        m.volume_mount_group.clear();
    }
    c
}

/// The CSI capability NodeStage / NodePublish carry: with the mount group (when the
/// claim has one; admission requires VOLUME_MOUNT_GROUP for it), and, when the node's
/// plugin takes SELinux labels (`selinux_mount`), the claim's label as the last mount
/// flag, `context="LABEL"`. A plugin that does not take labels never gets one.
pub fn node_capability(
    cap: VolumeCapability,
    options: &MountOptions,
    selinux_mount: bool,
) -> v1::VolumeCapability {
    use v1::volume_capability::{access_mode::Mode, AccessType, BlockVolume, MountVolume};
    let mode = match cap.access_mode {
        AccessMode::SingleNodeWriter => Mode::SingleNodeWriter,
        AccessMode::SingleNodeReaderOnly => Mode::SingleNodeReaderOnly,
        AccessMode::MultiNodeReaderOnly => Mode::MultiNodeReaderOnly,
        AccessMode::MultiNodeSingleWriter => Mode::MultiNodeSingleWriter,
        AccessMode::MultiNodeMultiWriter => Mode::MultiNodeMultiWriter,
        AccessMode::SingleNodeSingleWriter => Mode::SingleNodeSingleWriter,
        AccessMode::SingleNodeMultiWriter => Mode::SingleNodeMultiWriter,
    };
    let access_type = match cap.attachment_mode {
        AttachmentMode::BlockDevice => AccessType::Block(BlockVolume {}),
        AttachmentMode::FileSystem => AccessType::Mount(MountVolume {
            fs_type: options.fs_type.clone().unwrap_or_default(),
            mount_flags: options
                .mount_flags
                .expose()
                .iter()
                .cloned()
                .chain(options.selinux_context_flag().filter(|_| selinux_mount))
                .collect(),
            volume_mount_group: options.mount_group.clone().unwrap_or_default(),
        }),
    };
    v1::VolumeCapability {
        access_mode: Some(v1::volume_capability::AccessMode { mode: mode as i32 }),
        access_type: Some(access_type),
    }
}

/// CSI topology segments.
pub fn topology(t: &Topology) -> v1::Topology {
    v1::Topology {
        segments: t.clone(),
    }
}

/// The names of plugin capabilities (`CONTROLLER_SERVICE`, ...).
pub fn plugin_capability_names(resp: &v1::GetPluginCapabilitiesResponse) -> Vec<String> {
    use v1::plugin_capability::{service, Type};
    resp.capabilities
        .iter()
        .filter_map(|c| match &c.r#type {
            Some(Type::Service(s)) => service::Type::try_from(s.r#type)
                .ok()
                .map(|t| t.as_str_name().to_string()),
            // Whether a volume in use can be expanded (ONLINE) or only while not
            // published (OFFLINE).
            Some(Type::VolumeExpansion(e)) => Some(
                match v1::plugin_capability::volume_expansion::Type::try_from(e.r#type) {
                    Ok(v1::plugin_capability::volume_expansion::Type::Online) => {
                        "VOLUME_EXPANSION_ONLINE"
                    }
                    Ok(v1::plugin_capability::volume_expansion::Type::Offline) => {
                        "VOLUME_EXPANSION_OFFLINE"
                    }
                    _ => "VOLUME_EXPANSION",
                }
                .to_string(),
            ),
            None => None,
        })
        .collect()
}

/// The names of a service's RPC capabilities, one function per service: every
/// capability message is `oneof type { RPC rpc = 1; }` with an enum `RPC.Type`.
macro_rules! rpc_capability_names {
    ($($(#[$doc:meta])* $name:ident($resp:ty, $module:ident);)*) => {$(
        $(#[$doc])*
        pub fn $name(resp: &$resp) -> Vec<String> {
            use v1::$module::{rpc, Type};
            resp.capabilities
                .iter()
                .filter_map(|c| match &c.r#type {
                    Some(Type::Rpc(r)) => rpc::Type::try_from(r.r#type)
                        .ok()
                        .map(|t| t.as_str_name().to_string()),
                    None => None,
                })
                .collect()
        }
    )*};
}

rpc_capability_names! {
    /// The names of controller capabilities (`PUBLISH_UNPUBLISH_VOLUME`, ...).
    controller_capability_names(v1::ControllerGetCapabilitiesResponse, controller_service_capability);
    /// The names of group controller capabilities
    /// (`CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT`).
    group_capability_names(v1::GroupControllerGetCapabilitiesResponse, group_controller_service_capability);
    /// The names of node capabilities (`STAGE_UNSTAGE_VOLUME`, ...).
    node_capability_names(v1::NodeGetCapabilitiesResponse, node_service_capability);
}

/// A plugin's creation time (a snapshot's, a group's) as moor keeps it; none when
/// absent or out of range.
pub fn time_of(t: Option<&prost_types::Timestamp>) -> Option<crate::api::Timestamp> {
    let t = t?;
    let d = std::time::Duration::new(t.seconds.max(0) as u64, t.nanos.max(0) as u32);
    std::time::UNIX_EPOCH
        .checked_add(d)
        .map(crate::api::Timestamp::from_system)
}

/// The most conditions moor keeps of one health answer, and the longest text of each.
const MAX_HEALTH: usize = 16;
const MAX_HEALTH_TEXT: usize = 256;

fn health_text(s: &str) -> String {
    crate::process::printable_bounded(s, MAX_HEALTH_TEXT)
}

/// A volume's health from a CSI 1.13 VolumeHealth (absent: healthy). A condition of a
/// type this moor does not know is left out, as the spec requires of a CO; so is one
/// repeating a (status, reason) already kept.
pub fn volume_health(h: Option<&v1::VolumeHealth>) -> crate::api::VolumeHealth {
    use v1::VolumeHealthErrorType as T;
    let mut out: Vec<crate::api::HealthCondition> = Vec::new();
    for e in h.map(|h| h.health_statuses.as_slice()).unwrap_or_default() {
        let status = match T::try_from(e.status) {
            Ok(T::Degraded) => "Degraded",
            Ok(T::Inaccessible) => "Inaccessible",
            Ok(T::DataLoss) => "DataLoss",
            Ok(T::UnknownVolumeHealthType) | Err(_) => continue,
        };
        let c = crate::api::HealthCondition {
            status: status.into(),
            reason: health_text(&e.reason),
            message: health_text(&e.message),
            capability: String::new(),
        };
        if out.len() < MAX_HEALTH
            && !out
                .iter()
                .any(|o| o.status == c.status && o.reason == c.reason)
        {
            out.push(c);
        }
    }
    crate::api::VolumeHealth::of(out)
}

/// The storage's health from NodeGetStorageHealth, unknown types left out.
pub fn storage_health(r: &v1::NodeGetStorageHealthResponse) -> Vec<crate::api::HealthCondition> {
    use v1::StorageHealthErrorType as T;
    let mut out: Vec<crate::api::HealthCondition> = Vec::new();
    for e in &r.backend_health {
        let status = match T::try_from(e.status) {
            Ok(T::StorageDegraded) => "StorageDegraded",
            Ok(T::StorageUnreachable) => "StorageUnreachable",
            Ok(T::UnknownStorageHealthErrorType) | Err(_) => continue,
        };
        let c = crate::api::HealthCondition {
            status: status.into(),
            reason: health_text(&e.reason),
            message: health_text(&e.message),
            capability: e
                .volume_capability
                .as_ref()
                .map(capability_name)
                .unwrap_or_default(),
        };
        if out.len() < MAX_HEALTH && !out.contains(&c) {
            out.push(c);
        }
    }
    out
}

/// `SINGLE_NODE_WRITER/mount`: a capability named for display.
fn capability_name(c: &v1::VolumeCapability) -> String {
    use v1::volume_capability::{access_mode::Mode, AccessType};
    let mode = c
        .access_mode
        .as_ref()
        .and_then(|m| Mode::try_from(m.mode).ok())
        .map_or("UNKNOWN", |m| m.as_str_name());
    let kind = match c.access_type {
        Some(AccessType::Block(_)) => "block",
        Some(AccessType::Mount(_)) => "mount",
        None => "any",
    };
    format!("{mode}/{kind}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_keeps_the_known_types_once_and_ignores_the_rest() {
        use v1::volume_health::VolumeHealthEntry as E;
        let e = |status: i32, reason: &str| E {
            status,
            reason: reason.into(),
            message: "m".into(),
        };
        let h = v1::VolumeHealth {
            volume_id: "x".into(),
            health_statuses: vec![
                e(99, "FromTheFuture"),
                e(0, "Unknown"),
                e(2, "PathMissing"),
                e(2, "PathMissing"),
                e(1, "Slow"),
            ],
        };
        let got = volume_health(Some(&h));
        assert!(got.abnormal);
        let kept: Vec<_> = got.conditions.iter().map(|c| c.line()).collect();
        assert_eq!(kept, ["Inaccessible/PathMissing: m", "Degraded/Slow: m"]);
        assert_eq!(got.message, "Inaccessible/PathMissing: m; Degraded/Slow: m");
        // Only types moor does not know: healthy.
        let future = v1::VolumeHealth {
            volume_id: "x".into(),
            health_statuses: vec![e(7, "New")],
        };
        assert_eq!(
            volume_health(Some(&future)),
            crate::api::VolumeHealth::default()
        );
        assert!(!volume_health(None).abnormal);

        let r = v1::NodeGetStorageHealthResponse {
            backend_health: vec![
                v1::node_get_storage_health_response::StorageBackendHealth {
                    status: 2,
                    reason: "NetworkPartition".into(),
                    message: String::new(),
                    volume_capability: Some(capability(
                        VolumeCapability {
                            access_mode: AccessMode::MultiNodeMultiWriter,
                            attachment_mode: AttachmentMode::FileSystem,
                        },
                        &MountOptions::default(),
                    )),
                },
                v1::node_get_storage_health_response::StorageBackendHealth {
                    status: 5,
                    reason: "Later".into(),
                    ..Default::default()
                },
            ],
        };
        let got = storage_health(&r);
        assert_eq!(got.len(), 1);
        assert_eq!(
            got[0].line(),
            "StorageUnreachable/NetworkPartition (MULTI_NODE_MULTI_WRITER/mount)"
        );
    }
    use crate::api::MountFlags;

    #[test]
    fn capability_carries_mode_and_mount_options() {
        let opts = MountOptions {
            fs_type: Some("ext4".into()),
            mount_flags: MountFlags::new(vec!["noatime".into()]),
            mount_group: Some("4321".into()),
            selinux_label: Some("system_u:object_r:container_file_t:s0:c5".into()),
        };
        let fs = VolumeCapability {
            access_mode: AccessMode::MultiNodeSingleWriter,
            attachment_mode: AttachmentMode::FileSystem,
        };
        // The node's calls carry the mount group; the controller's do not. The SELinux
        // context only to a node plugin that takes it.
        match node_capability(fs, &opts, true).access_type {
            Some(v1::volume_capability::AccessType::Mount(m)) => {
                assert_eq!(m.volume_mount_group, "4321");
                assert_eq!(
                    m.mount_flags,
                    [
                        "noatime",
                        "context=\"system_u:object_r:container_file_t:s0:c5\""
                    ]
                );
            }
            other => panic!("{other:?}"),
        }
        match node_capability(fs, &opts, false).access_type {
            Some(v1::volume_capability::AccessType::Mount(m)) => {
                assert_eq!(m.mount_flags, ["noatime"])
            }
            other => panic!("{other:?}"),
        }
        let c = capability(
            VolumeCapability {
                access_mode: AccessMode::MultiNodeSingleWriter,
                attachment_mode: AttachmentMode::FileSystem,
            },
            &opts,
        );
        assert_eq!(c.access_mode.unwrap().mode, 4);
        match c.access_type {
            Some(v1::volume_capability::AccessType::Mount(m)) => {
                assert_eq!(m.fs_type, "ext4");
                assert_eq!(m.mount_flags, ["noatime"]);
                assert_eq!(m.volume_mount_group, "");
            }
            other => panic!("{other:?}"),
        }
        let b = capability(
            VolumeCapability {
                access_mode: AccessMode::SingleNodeWriter,
                attachment_mode: AttachmentMode::BlockDevice,
            },
            &opts,
        );
        assert!(matches!(
            b.access_type,
            Some(v1::volume_capability::AccessType::Block(_))
        ));
    }
}
