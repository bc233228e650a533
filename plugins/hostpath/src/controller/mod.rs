//! The Controller service: volumes are directories under `<state-dir>/volumes`,
//! snapshots copies under `<state-dir>/snapshots`, attachments a set of node ids per volume.
//!
//! # Layout
//! - this file: the service (each RPC delegating to its file), publish and unpublish,
//!   capacity and capabilities.
//! - `volumes`: CreateVolume (empty, or a copy of a snapshot or volume), validation,
//!   ListVolumes, ControllerGetVolume, expansion, modification, DeleteVolume.
//! - `snapshots`: CreateSnapshot, GetSnapshot, ListSnapshots, DeleteSnapshot.

use moor_csi::v1::{
    controller_server::Controller, controller_service_capability, list_volumes_response,
    validate_volume_capabilities_response, volume_capability, volume_content_source,
    ControllerExpandVolumeRequest, ControllerExpandVolumeResponse,
    ControllerGetCapabilitiesRequest, ControllerGetCapabilitiesResponse,
    ControllerGetVolumeRequest, ControllerGetVolumeResponse, ControllerModifyVolumeRequest,
    ControllerModifyVolumeResponse, ControllerPublishVolumeRequest,
    ControllerPublishVolumeResponse, ControllerServiceCapability, ControllerUnpublishVolumeRequest,
    ControllerUnpublishVolumeResponse, CreateSnapshotRequest, CreateSnapshotResponse,
    CreateVolumeRequest, CreateVolumeResponse, DeleteSnapshotRequest, DeleteSnapshotResponse,
    DeleteVolumeRequest, DeleteVolumeResponse, GetCapacityRequest, GetCapacityResponse,
    GetSnapshotRequest, GetSnapshotResponse, ListSnapshotsRequest, ListSnapshotsResponse,
    ListVolumesRequest, ListVolumesResponse, Snapshot, Topology, ValidateVolumeCapabilitiesRequest,
    ValidateVolumeCapabilitiesResponse, Volume, VolumeCapability,
};
use std::collections::BTreeMap;
use std::path::Path;
use tonic::{Request, Response, Status};

use crate::calllog::Call;
use crate::state::{SnapshotRec, Source, VolumeRec};
use crate::{require, Plugin};

mod snapshots;
mod volumes;

/// Seconds since the epoch.
pub(crate) fn now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or_default()
}

/// Capacity of a volume created without a capacity range.
const DEFAULT_CAPACITY: i64 = 1 << 30;

/// Checks a capability: present, with an access type and a known access mode. Returns
/// (block, access mode).
pub(crate) fn check_capability(cap: Option<&VolumeCapability>) -> Result<(bool, i32), Status> {
    let cap = cap.ok_or_else(|| Status::invalid_argument("volume_capability is required"))?;
    let block = match cap.access_type {
        Some(volume_capability::AccessType::Block(_)) => true,
        Some(volume_capability::AccessType::Mount(_)) => false,
        None => {
            return Err(Status::invalid_argument(
                "volume_capability.access_type is required",
            ))
        }
    };
    let mode = cap
        .access_mode
        .as_ref()
        .map(|m| m.mode)
        .ok_or_else(|| Status::invalid_argument("volume_capability.access_mode is required"))?;
    match volume_capability::access_mode::Mode::try_from(mode) {
        Ok(volume_capability::access_mode::Mode::Unknown) | Err(_) => Err(
            Status::invalid_argument(format!("access mode {mode} is not supported")),
        ),
        Ok(_) => Ok((block, mode)),
    }
}

fn is_single_node(mode: i32) -> bool {
    use volume_capability::access_mode::Mode;
    matches!(
        Mode::try_from(mode),
        Ok(Mode::SingleNodeWriter
            | Mode::SingleNodeReaderOnly
            | Mode::SingleNodeSingleWriter
            | Mode::SingleNodeMultiWriter)
    )
}

/// Whether the spec lets a volume of this mode be published at several target paths
/// on one node: the MULTI_NODE modes and SINGLE_NODE_MULTI_WRITER.
pub(crate) fn shares_a_node(mode: i32) -> bool {
    use volume_capability::access_mode::Mode;
    !is_single_node(mode) || Mode::try_from(mode) == Ok(Mode::SingleNodeMultiWriter)
}

fn copy_dir(src: &Path, dst: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dst)?;
    for entry in std::fs::read_dir(src)? {
        let entry = entry?;
        let to = dst.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &to)?;
        } else {
            std::fs::copy(entry.path(), to)?;
        }
    }
    Ok(())
}

fn internal(what: &str, e: std::io::Error) -> Status {
    Status::internal(format!("{what}: {e}"))
}

pub(crate) fn page<T: Clone>(
    items: &[T],
    max_entries: i32,
    token: &str,
) -> Result<(Vec<T>, String), Status> {
    if max_entries < 0 {
        return Err(Status::invalid_argument("max_entries may not be negative"));
    }
    let start = if token.is_empty() {
        0
    } else {
        token
            .parse::<usize>()
            .ok()
            .filter(|s| *s <= items.len())
            .ok_or_else(|| Status::aborted(format!("starting_token {token:?} is not valid")))?
    };
    let end = if max_entries == 0 {
        items.len()
    } else {
        (start + max_entries as usize).min(items.len())
    };
    let next = if end < items.len() {
        end.to_string()
    } else {
        String::new()
    };
    Ok((items[start..end].to_vec(), next))
}

impl Plugin {
    fn topology(&self) -> Vec<Topology> {
        if self.inner.topology.is_empty() {
            Vec::new()
        } else {
            vec![Topology {
                segments: self.inner.topology.clone(),
            }]
        }
    }

    /// Mutable parameters must be among `--mutable-parameters`.
    fn check_mutable(&self, params: &BTreeMap<String, String>) -> Result<(), Status> {
        let accepted = &self.cfg().mutable_parameters;
        match params.keys().find(|k| !accepted.contains(k)) {
            Some(k) => Err(Status::invalid_argument(format!(
                "mutable parameter {k:?} is not supported (accepted: {})",
                accepted.join(", ")
            ))),
            None => Ok(()),
        }
    }

    fn volume_message(&self, v: &VolumeRec) -> Volume {
        Volume {
            capacity_bytes: v.capacity,
            volume_id: v.id.clone(),
            volume_context: [("path".to_string(), v.path.display().to_string())].into(),
            content_source: v
                .source
                .as_ref()
                .map(|s| moor_csi::v1::VolumeContentSource {
                    r#type: Some(match s {
                        Source::Snapshot(id) => volume_content_source::Type::Snapshot(
                            volume_content_source::SnapshotSource {
                                snapshot_id: id.clone(),
                            },
                        ),
                        Source::Volume(id) => volume_content_source::Type::Volume(
                            volume_content_source::VolumeSource {
                                volume_id: id.clone(),
                            },
                        ),
                    }),
                }),
            accessible_topology: if v.topology.is_empty() {
                self.topology()
            } else {
                vec![Topology {
                    segments: v.topology.clone(),
                }]
            },
        }
    }

    /// A snapshot as a read of it answers: not ready to use until it has been read
    /// more than `--snapshot-ready-after` times.
    pub(crate) fn read_snapshot(&self, s: &SnapshotRec) -> Snapshot {
        let after = self.cfg().snapshot_ready_after;
        let mut m = Plugin::snapshot_message(s);
        if after > 0 {
            let mut reads = self
                .inner
                .snapshot_reads
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let n = reads.entry(s.id.clone()).or_default();
            *n += 1;
            m.ready_to_use = *n > after;
        }
        m
    }

    pub(crate) fn snapshot_message(s: &SnapshotRec) -> Snapshot {
        Snapshot {
            size_bytes: s.size,
            snapshot_id: s.id.clone(),
            source_volume_id: s.source_volume_id.clone(),
            creation_time: Some(prost_types::Timestamp {
                seconds: s.created_secs,
                nanos: 0,
            }),
            ready_to_use: true,
            group_snapshot_id: s.group_id.clone().unwrap_or_default(),
            accessible_topology: Vec::new(),
        }
    }

    /// Copies volume `volume_id` into a new snapshot named `name` (of group `group`).
    pub(crate) fn cut(
        dir: &Path,
        st: &mut crate::state::State,
        volume_id: &str,
        name: &str,
        group: Option<&str>,
    ) -> Result<SnapshotRec, Status> {
        let vol = st
            .volumes
            .get(volume_id)
            .ok_or_else(|| Status::not_found(format!("volume {volume_id} not found")))?;
        let id = format!("snap-{}", uuid::Uuid::new_v4().simple());
        let path = dir.join("snapshots").join(&id);
        copy_dir(&vol.path, &path).map_err(|e| internal("copying the volume", e))?;
        let rec = SnapshotRec {
            id: id.clone(),
            name: name.to_string(),
            source_volume_id: vol.id.clone(),
            size: vol.capacity,
            created_secs: now_secs(),
            path,
            group_id: group.map(str::to_string),
        };
        st.snapshots.insert(id, rec.clone());
        Ok(rec)
    }

    /// Removes a snapshot and its copy (absent: nothing to do).
    pub(crate) fn drop_snapshot(st: &mut crate::state::State, id: &str) -> Result<(), Status> {
        if let Some(s) = st.snapshots.remove(id) {
            match std::fs::remove_dir_all(&s.path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(internal("removing the snapshot", e))
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Whether a topology requirement can be met by this plugin's segments.
    /// The `--segment` a volume goes to: the first its preferred, else requisite,
    /// topology allows (the first segment when it asks for none); `Ok(None)` without
    /// segments.
    fn place(
        &self,
        req: Option<&moor_csi::v1::TopologyRequirement>,
    ) -> Result<Option<usize>, Status> {
        let segs = &self.inner.segments;
        if segs.is_empty() {
            return Ok(None);
        }
        let within = |seg: &BTreeMap<String, String>, t: &Topology| {
            t.segments.iter().all(|(k, v)| seg.get(k) == Some(v))
        };
        let asked: Vec<&Topology> = req
            .map(|r| r.preferred.iter().chain(&r.requisite).collect())
            .unwrap_or_default();
        if asked.is_empty() {
            return Ok(Some(0));
        }
        asked
            .iter()
            .find_map(|t| segs.iter().position(|(seg, _)| within(seg, t)))
            .map(Some)
            .ok_or_else(|| {
                Status::resource_exhausted("no requisite topology matches this plugin's segments")
            })
    }

    /// The capacity and topology of segment `at` (the plugin's whole `--capacity` and
    /// `--topology` without segments).
    fn segment(&self, at: Option<usize>) -> (i64, BTreeMap<String, String>) {
        match at.and_then(|i| self.inner.segments.get(i)) {
            Some((seg, cap)) => (*cap, seg.clone()),
            None => (self.inner.capacity, self.inner.topology.clone()),
        }
    }

    fn topology_fits(&self, req: Option<&moor_csi::v1::TopologyRequirement>) -> bool {
        let Some(req) = req else { return true };
        if self.inner.topology.is_empty() || req.requisite.is_empty() {
            return true;
        }
        req.requisite.iter().any(|t| {
            t.segments
                .iter()
                .all(|(k, v)| self.inner.topology.get(k) == Some(v))
        })
    }
}

#[tonic::async_trait]
impl Controller for Plugin {
    async fn create_volume(
        &self,
        request: Request<CreateVolumeRequest>,
    ) -> Result<Response<CreateVolumeResponse>, Status> {
        self.create_volume_rpc(request).await
    }

    async fn delete_volume(
        &self,
        request: Request<DeleteVolumeRequest>,
    ) -> Result<Response<DeleteVolumeResponse>, Status> {
        self.delete_volume_rpc(request).await
    }

    async fn controller_publish_volume(
        &self,
        request: Request<ControllerPublishVolumeRequest>,
    ) -> Result<Response<ControllerPublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let c = Call {
            volume_id: Some(req.volume_id.clone()),
            node_id: Some(req.node_id.clone()),
            readonly: Some(req.readonly),
            access_mode: crate::access_mode_name(req.volume_capability.as_ref()),
            secret_keys: req.secrets.keys().cloned().collect(),
            context_path: req.volume_context.get("path").cloned(),
            ..Call::new("ControllerPublishVolume")
        };
        self.call(c, async {
            if !self.cfg().publish_unpublish {
                return Err(Status::unimplemented(
                    "PUBLISH_UNPUBLISH_VOLUME is not advertised",
                ));
            }
            require(&req.volume_id, "volume_id")?;
            require(&req.node_id, "node_id")?;
            let (_, mode) = check_capability(req.volume_capability.as_ref())?;
            if !crate::node_known(self.cfg(), &req.node_id) {
                return Err(Status::not_found(format!("node {} not found", req.node_id)));
            }
            let max = self.max_volumes();
            let device = self
                .mutate(|st| {
                    // Counted only when limited: a scan of every volume per call.
                    let on_node = || {
                        st.volumes
                            .values()
                            .filter(|v| v.published.contains_key(&req.node_id))
                            .count() as i64
                    };
                    let on_node = if max > 0 { on_node() } else { 0 };
                    let vol = st.volumes.get_mut(&req.volume_id).ok_or_else(|| {
                        Status::not_found(format!("volume {} not found", req.volume_id))
                    })?;
                    match vol.published.get(&req.node_id) {
                        Some(ro) if *ro == req.readonly => {
                            return Ok(crate::attach_marker::device(&vol.path, &req.node_id))
                        }
                        Some(_) => {
                            return Err(Status::already_exists(
                                "already published to this node with another readonly flag",
                            ))
                        }
                        None => {}
                    }
                    if is_single_node(mode) {
                        if let Some(other) = vol.published.keys().next() {
                            return Err(Status::failed_precondition(format!(
                                "single-node volume {} is published to node {other}",
                                vol.id
                            )));
                        }
                    }
                    if max > 0 && on_node >= max {
                        return Err(Status::resource_exhausted(format!(
                            "node {} already has {on_node} volumes (max {max})",
                            req.node_id
                        )));
                    }
                    vol.published.insert(req.node_id.clone(), req.readonly);
                    // What a node instance sees of the attachment (a device appearing,
                    // under a name of its own each time it is attached).
                    let device = crate::attach_marker::new_device();
                    crate::attach_marker::set(&vol.path, &req.node_id, Some(&device))
                        .map_err(|e| Status::internal(format!("recording the attachment: {e}")))?;
                    Ok(Some(device))
                })
                .await?;
            let mut publish_context: BTreeMap<String, String> = [
                ("attached_to".to_string(), req.node_id.clone()),
                ("readonly".to_string(), req.readonly.to_string()),
            ]
            .into();
            if let Some(device) = device {
                publish_context.insert("device".to_string(), device);
            }
            Ok(ControllerPublishVolumeResponse { publish_context })
        })
        .await
    }

    async fn controller_unpublish_volume(
        &self,
        request: Request<ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<ControllerUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let c = Call {
            volume_id: Some(req.volume_id.clone()),
            node_id: Some(req.node_id.clone()),
            secret_keys: req.secrets.keys().cloned().collect(),
            ..Call::new("ControllerUnpublishVolume")
        };
        self.call(c, async {
            if !self.cfg().publish_unpublish {
                return Err(Status::unimplemented(
                    "PUBLISH_UNPUBLISH_VOLUME is not advertised",
                ));
            }
            require(&req.volume_id, "volume_id")?;
            self.mutate(|st| {
                if let Some(vol) = st.volumes.get_mut(&req.volume_id) {
                    let nodes: Vec<String> = if req.node_id.is_empty() {
                        vol.published.keys().cloned().collect()
                    } else {
                        vec![req.node_id.clone()]
                    };
                    for node in nodes {
                        vol.published.remove(&node);
                        crate::attach_marker::set(&vol.path, &node, None).map_err(|e| {
                            Status::internal(format!("removing the attachment: {e}"))
                        })?;
                    }
                }
                Ok(())
            })
            .await?;
            Ok(ControllerUnpublishVolumeResponse {})
        })
        .await
    }

    async fn validate_volume_capabilities(
        &self,
        request: Request<ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<ValidateVolumeCapabilitiesResponse>, Status> {
        self.validate_volume_capabilities_rpc(request).await
    }

    async fn list_volumes(
        &self,
        request: Request<ListVolumesRequest>,
    ) -> Result<Response<ListVolumesResponse>, Status> {
        self.list_volumes_rpc(request).await
    }

    async fn get_capacity(
        &self,
        request: Request<GetCapacityRequest>,
    ) -> Result<Response<GetCapacityResponse>, Status> {
        let req = request.into_inner();
        self.call(Call::new("GetCapacity"), async {
            let segs = &self.inner.segments;
            // The largest volume that fits: one segment's room, not their sum.
            let mut largest = 0i64;
            let available = if segs.is_empty() {
                let free = self
                    .inner
                    .capacity
                    .saturating_sub(self.read(|st| st.used_capacity()).await);
                largest = free;
                free
            } else {
                // The segments the asked topology names (all of them when none is asked).
                let asked = req.accessible_topology.as_ref();
                let within = |seg: &BTreeMap<String, String>| {
                    asked.is_none_or(|t| t.segments.iter().all(|(k, v)| seg.get(k) == Some(v)))
                };
                let mut sum = 0i64;
                for (seg, cap) in segs.iter().filter(|(seg, _)| within(seg)) {
                    let used = self.read(|st| st.used_capacity_in(seg)).await;
                    let free = cap.saturating_sub(used).max(0);
                    largest = largest.max(free);
                    sum = sum.saturating_add(free);
                }
                sum
            };
            let negative = self.lies(crate::faults::Lie::NegativeCapacity);
            Ok(GetCapacityResponse {
                available_capacity: if negative { -1 } else { available.max(0) },
                maximum_volume_size: Some(largest.max(0)),
                minimum_volume_size: None,
            })
        })
        .await
    }

    async fn controller_get_capabilities(
        &self,
        _: Request<ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<ControllerGetCapabilitiesResponse>, Status> {
        use controller_service_capability::rpc::Type;
        self.call(Call::new("ControllerGetCapabilities"), async {
            let mut types = vec![
                Type::CreateDeleteVolume,
                Type::GetCapacity,
                Type::CreateDeleteSnapshot,
                Type::ListSnapshots,
                Type::CloneVolume,
                Type::ExpandVolume,
                Type::GetVolume,
                Type::GetSnapshot,
            ];
            match self.cfg().health_api {
                crate::HealthApi::V113 => {
                    types.extend([Type::GetVolumeHealth, Type::ListVolumeHealth]);
                }
                crate::HealthApi::V112 => types.push(Type::VolumeCondition),
            }
            if !self.cfg().mutable_parameters.is_empty() {
                types.push(Type::ModifyVolume);
            }
            if self.cfg().list_volumes {
                types.push(Type::ListVolumes);
            }
            if self.cfg().single_node_multi_writer {
                types.push(Type::SingleNodeMultiWriter);
            }
            if self.cfg().publish_unpublish {
                types.extend([Type::PublishUnpublishVolume, Type::PublishReadonly]);
                if self.cfg().list_volumes {
                    types.push(Type::ListVolumesPublishedNodes);
                }
            }
            Ok(ControllerGetCapabilitiesResponse {
                capabilities: types
                    .into_iter()
                    .map(|t| ControllerServiceCapability {
                        r#type: Some(controller_service_capability::Type::Rpc(
                            controller_service_capability::Rpc { r#type: t as i32 },
                        )),
                    })
                    .collect(),
            })
        })
        .await
    }

    async fn create_snapshot(
        &self,
        request: Request<CreateSnapshotRequest>,
    ) -> Result<Response<CreateSnapshotResponse>, Status> {
        self.create_snapshot_rpc(request).await
    }

    async fn delete_snapshot(
        &self,
        request: Request<DeleteSnapshotRequest>,
    ) -> Result<Response<DeleteSnapshotResponse>, Status> {
        self.delete_snapshot_rpc(request).await
    }

    async fn list_snapshots(
        &self,
        request: Request<ListSnapshotsRequest>,
    ) -> Result<Response<ListSnapshotsResponse>, Status> {
        self.list_snapshots_rpc(request).await
    }

    async fn controller_expand_volume(
        &self,
        request: Request<ControllerExpandVolumeRequest>,
    ) -> Result<Response<ControllerExpandVolumeResponse>, Status> {
        self.controller_expand_volume_rpc(request).await
    }

    async fn controller_get_volume(
        &self,
        request: Request<ControllerGetVolumeRequest>,
    ) -> Result<Response<ControllerGetVolumeResponse>, Status> {
        self.controller_get_volume_rpc(request).await
    }

    async fn controller_list_volume_health(
        &self,
        request: Request<moor_csi::v1::ControllerListVolumeHealthRequest>,
    ) -> Result<Response<moor_csi::v1::ControllerListVolumeHealthResponse>, Status> {
        self.controller_list_volume_health_rpc(request).await
    }

    async fn controller_get_volume_health(
        &self,
        request: Request<moor_csi::v1::ControllerGetVolumeHealthRequest>,
    ) -> Result<Response<moor_csi::v1::ControllerGetVolumeHealthResponse>, Status> {
        self.controller_get_volume_health_rpc(request).await
    }

    async fn get_snapshot(
        &self,
        request: Request<GetSnapshotRequest>,
    ) -> Result<Response<GetSnapshotResponse>, Status> {
        self.get_snapshot_rpc(request).await
    }

    async fn controller_modify_volume(
        &self,
        request: Request<ControllerModifyVolumeRequest>,
    ) -> Result<Response<ControllerModifyVolumeResponse>, Status> {
        self.controller_modify_volume_rpc(request).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_cover_everything_once_and_bad_tokens_abort() {
        let items: Vec<u32> = (0..10).collect();
        let (a, t) = page(&items, 4, "").unwrap();
        assert_eq!((a, t.as_str()), (vec![0, 1, 2, 3], "4"));
        let (b, t) = page(&items, 4, &t).unwrap();
        let (c, t) = page(&items, 4, &t).unwrap();
        assert_eq!((b.len(), c, t.as_str()), (4, vec![8, 9], ""));
        assert_eq!(page(&items, 0, "").unwrap().0.len(), 10);
        assert_eq!(
            page(&items, 2, "x").unwrap_err().code(),
            tonic::Code::Aborted
        );
        assert_eq!(
            page(&items, 2, "11").unwrap_err().code(),
            tonic::Code::Aborted
        );
        assert_eq!(
            page(&items, -1, "").unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
    }
}
