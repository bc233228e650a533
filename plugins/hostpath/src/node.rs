//! The Node service: NodeStage bind-mounts the volume's directory at the staging path,
//! NodePublish bind-mounts it (from the staging path when staging) at the target path,
//! read-only when asked; block volumes are a file bind-mounted on a file.

use moor_csi::v1::{
    node_server::Node, node_service_capability, volume_usage, NodeExpandVolumeRequest,
    NodeExpandVolumeResponse, NodeGetCapabilitiesRequest, NodeGetCapabilitiesResponse,
    NodeGetInfoRequest, NodeGetInfoResponse, NodeGetVolumeStatsRequest, NodeGetVolumeStatsResponse,
    NodePublishVolumeRequest, NodePublishVolumeResponse, NodeServiceCapability,
    NodeStageVolumeRequest, NodeStageVolumeResponse, NodeUnpublishVolumeRequest,
    NodeUnpublishVolumeResponse, NodeUnstageVolumeRequest, NodeUnstageVolumeResponse, Topology,
    VolumeUsage,
};

use std::path::{Path, PathBuf};
use tonic::{Request, Response, Status};

use crate::calllog::Call;
use crate::controller::check_capability;
use crate::state::{PublishRec, StageRec};
use crate::{mounts, require, Plugin};

/// Size of the file that stands for a block device.
const BLOCK_FILE_SIZE: u64 = 1 << 20;

fn io_err(what: &str, e: std::io::Error) -> Status {
    Status::internal(format!("{what}: {e}"))
}

impl Plugin {
    /// The directory holding a volume's data: the volume context's `path` (set by the
    /// controller instance), or this instance's own record.
    async fn volume_dir(
        &self,
        volume_id: &str,
        context: &std::collections::BTreeMap<String, String>,
    ) -> Result<PathBuf, Status> {
        let dir = match context.get("path") {
            Some(p) => PathBuf::from(p),
            None => self
                .read(|st| st.volumes.get(volume_id).map(|v| v.path.clone()))
                .await
                .ok_or_else(|| Status::not_found(format!("volume {volume_id} not found")))?,
        };
        if !dir.is_dir() {
            return Err(Status::not_found(format!(
                "volume {volume_id} has no data at {}",
                dir.display()
            )));
        }
        Ok(dir)
    }

    /// Honours a capability's volume_mount_group: INVALID_ARGUMENT unless
    /// VOLUME_MOUNT_GROUP is advertised; when mounting, a numeric group becomes the
    /// group of the data the mount shows.
    fn apply_mount_group(
        &self,
        cap: Option<&moor_csi::v1::VolumeCapability>,
        data: &std::path::Path,
    ) -> Result<(), Status> {
        let Some(group) = crate::mount_group_of(cap) else {
            return Ok(());
        };
        if !self.cfg().volume_mount_group {
            return Err(Status::invalid_argument(
                "volume_mount_group is set but VOLUME_MOUNT_GROUP is not advertised",
            ));
        }
        if let (Ok(gid), false) = (group.parse::<u32>(), self.no_mount()) {
            std::os::unix::fs::chown(data, None, Some(gid))
                .map_err(|e| io_err("setting the mount group", e))?;
        }
        Ok(())
    }

    /// Checks the request names a volume this node published at `path` (or staged there,
    /// when `staged_ok`): NOT_FOUND otherwise.
    async fn volume_at(
        &self,
        volume_id: &str,
        path: &str,
        staged_ok: bool,
    ) -> Result<PathBuf, Status> {
        require(volume_id, "volume_id")?;
        require(path, "volume_path")?;
        let path = PathBuf::from(path);
        let known = self
            .read(|st| {
                st.publishes
                    .get(&path)
                    .is_some_and(|p| p.volume_id == volume_id)
                    || (staged_ok
                        && st
                            .stages
                            .get(&path)
                            .is_some_and(|s| s.volume_id == volume_id))
            })
            .await;
        if !known {
            return Err(Status::not_found(format!(
                "volume {volume_id} is not published{} at {}",
                if staged_ok { " or staged" } else { "" },
                path.display()
            )));
        }
        Ok(path)
    }

    /// With PUBLISH_UNPUBLISH_VOLUME advertised, the volume must be controller-published
    /// to this node before it is staged (or published without staging): the publish
    /// context names this node and, when the data directory is known, its attach marker
    /// exists. FAILED_PRECONDITION otherwise, as a strict plugin answers.
    fn check_attached(
        &self,
        volume_id: &str,
        publish_context: &std::collections::BTreeMap<String, String>,
        volume_dir: &Path,
    ) -> Result<(), Status> {
        if !self.cfg().publish_unpublish {
            return Ok(());
        }
        let me = &self.cfg().node_id;
        let context_ok = publish_context.get("attached_to") == Some(me);
        if !context_ok || !crate::attach_marker::is_set(volume_dir, me) {
            return Err(Status::failed_precondition(format!(
                "volume {volume_id} is not controller-published to node {me}"
            )));
        }
        // The device it is attached as now: a publish_context of an earlier attachment
        // names a device that is gone.
        let now = crate::attach_marker::device(volume_dir, me);
        if let (Some(asked), Some(now)) = (publish_context.get("device"), now) {
            if *asked != now {
                return Err(Status::failed_precondition(format!(
                    "volume {volume_id} is attached to node {me} as {now}, not {asked}: the \
                     publish_context is of an earlier attachment"
                )));
            }
        }
        Ok(())
    }

    fn no_mount(&self) -> bool {
        self.cfg().no_mount
    }
}

fn ensure_block_file(dir: &Path) -> Result<PathBuf, Status> {
    let file = dir.join("block");
    if !file.exists() {
        let f = std::fs::File::create(&file).map_err(|e| io_err("creating the block file", e))?;
        f.set_len(BLOCK_FILE_SIZE)
            .map_err(|e| io_err("sizing the block file", e))?;
    }
    Ok(file)
}

fn path_call(rpc: &str, volume_id: &str, staging: &str, target: &str) -> Call {
    let some = |s: &str| (!s.is_empty()).then(|| s.to_string());
    Call {
        volume_id: Some(volume_id.to_string()),
        staging_target_path: some(staging),
        target_path: some(target),
        ..Call::new(rpc)
    }
}

#[tonic::async_trait]
impl Node for Plugin {
    async fn node_stage_volume(
        &self,
        request: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        let req = request.into_inner();
        let c = Call {
            access_mode: crate::access_mode_name(req.volume_capability.as_ref()),
            mount_group: crate::mount_group_of(req.volume_capability.as_ref()),
            selinux_context: crate::selinux_context_of(req.volume_capability.as_ref()),
            secret_keys: req.secrets.keys().cloned().collect(),
            context_path: req.volume_context.get("path").cloned(),
            ..path_call(
                "NodeStageVolume",
                &req.volume_id,
                &req.staging_target_path,
                "",
            )
        };
        self.call(c, async {
            if !self.cfg().stage_unstage {
                return Err(Status::unimplemented(
                    "STAGE_UNSTAGE_VOLUME is not advertised",
                ));
            }
            require(&req.volume_id, "volume_id")?;
            require(&req.staging_target_path, "staging_target_path")?;
            let (block, _) = check_capability(req.volume_capability.as_ref())?;
            let source = self.volume_dir(&req.volume_id, &req.volume_context).await?;
            self.check_attached(&req.volume_id, &req.publish_context, &source)?;
            self.apply_mount_group(req.volume_capability.as_ref(), &source)?;
            let block_file = if block {
                Some(ensure_block_file(&source)?)
            } else {
                None
            };
            let staging = PathBuf::from(&req.staging_target_path);
            let with_loop = self.loop_devices();
            let no_mount = self.no_mount();
            self.mutate(|st| {
                if let Some(existing) = st.stages.get(&staging) {
                    return if existing.volume_id == req.volume_id {
                        Ok(())
                    } else {
                        Err(Status::already_exists(format!(
                            "{} already stages volume {}",
                            staging.display(),
                            existing.volume_id
                        )))
                    };
                }
                std::fs::create_dir_all(&staging)
                    .map_err(|e| io_err("creating the staging path", e))?;
                mounts::bind(&source, &staging, false, no_mount)
                    .map_err(|e| io_err("bind-mounting", e))?;
                let loop_device = match block_file.as_ref().filter(|_| with_loop) {
                    Some(file) => Some(
                        mounts::loop_attach(file)
                            .map_err(|e| io_err("attaching a loop device", e))?,
                    ),
                    None => None,
                };
                st.stages.insert(
                    staging.clone(),
                    StageRec {
                        volume_id: req.volume_id.clone(),
                        staging_path: staging.clone(),
                        block,
                        loop_device,
                    },
                );
                Ok(())
            })
            .await?;
            Ok(NodeStageVolumeResponse {})
        })
        .await
    }

    async fn node_unstage_volume(
        &self,
        request: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        let req = request.into_inner();
        let c = path_call(
            "NodeUnstageVolume",
            &req.volume_id,
            &req.staging_target_path,
            "",
        );
        self.call(c, async {
            if !self.cfg().stage_unstage {
                return Err(Status::unimplemented(
                    "STAGE_UNSTAGE_VOLUME is not advertised",
                ));
            }
            require(&req.volume_id, "volume_id")?;
            require(&req.staging_target_path, "staging_target_path")?;
            let staging = PathBuf::from(&req.staging_target_path);
            let no_mount = self.no_mount();
            self.mutate(|st| {
                if st
                    .stages
                    .get(&staging)
                    .is_some_and(|s| s.volume_id == req.volume_id)
                {
                    mounts::unmount(&staging, no_mount).map_err(|e| io_err("unmounting", e))?;
                    if let Some(dev) = st.stages.get(&staging).and_then(|s| s.loop_device.clone()) {
                        mounts::loop_detach(&dev)
                            .map_err(|e| io_err("detaching the loop device", e))?;
                    }
                    st.stages.remove(&staging);
                }
                Ok(())
            })
            .await?;
            Ok(NodeUnstageVolumeResponse {})
        })
        .await
    }

    async fn node_publish_volume(
        &self,
        request: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let c = Call {
            readonly: Some(req.readonly),
            access_mode: crate::access_mode_name(req.volume_capability.as_ref()),
            mount_group: crate::mount_group_of(req.volume_capability.as_ref()),
            selinux_context: crate::selinux_context_of(req.volume_capability.as_ref()),
            secret_keys: req.secrets.keys().cloned().collect(),
            context_path: req.volume_context.get("path").cloned(),
            ..path_call(
                "NodePublishVolume",
                &req.volume_id,
                &req.staging_target_path,
                &req.target_path,
            )
        };
        self.call(c, async {
            require(&req.volume_id, "volume_id")?;
            require(&req.target_path, "target_path")?;
            let (block, mode) = check_capability(req.volume_capability.as_ref())?;
            let staging = (!req.staging_target_path.is_empty())
                .then(|| PathBuf::from(&req.staging_target_path));
            if self.cfg().stage_unstage {
                let staging = staging.as_ref().ok_or_else(|| {
                    Status::failed_precondition(
                        "staging_target_path is required: the volume must be staged first",
                    )
                })?;
                let staged = self
                    .read(|st| {
                        st.stages
                            .get(staging)
                            .is_some_and(|s| s.volume_id == req.volume_id)
                    })
                    .await;
                if !staged {
                    return Err(Status::failed_precondition(format!(
                        "volume {} is not staged at {}",
                        req.volume_id,
                        staging.display()
                    )));
                }
            }
            // Publish from the staging mount when there is one; without staging (or with
            // --no-mount, where the staging path holds no data) from the volume's own data.
            if !self.cfg().stage_unstage {
                let data = self.volume_dir(&req.volume_id, &req.volume_context).await?;
                self.check_attached(&req.volume_id, &req.publish_context, &data)?;
            }
            let source_dir = match &staging {
                Some(staging) if self.cfg().stage_unstage && !self.no_mount() => staging.clone(),
                _ => self.volume_dir(&req.volume_id, &req.volume_context).await?,
            };
            self.apply_mount_group(req.volume_capability.as_ref(), &source_dir)?;
            let source = if block {
                ensure_block_file(&source_dir)?
            } else {
                source_dir
            };
            let target = PathBuf::from(&req.target_path);
            let no_mount = self.no_mount();
            let with_loop = block && self.loop_devices();
            let strict = self.cfg().strict;
            self.mutate(|st| {
                if let Some(existing) = st.publishes.get(&target) {
                    let same_mode = !strict || existing.access_mode.is_none_or(|m| m == mode);
                    return if existing.volume_id == req.volume_id
                        && existing.readonly == req.readonly
                        && same_mode
                    {
                        Ok(())
                    } else {
                        Err(Status::already_exists(format!(
                            "{} is already published with another volume, readonly flag or \
                             access mode",
                            target.display()
                        )))
                    };
                }
                if strict {
                    // The spec's "exceeds capabilities": a second target path on this
                    // node needs a mode that shares a node, on both publishes.
                    let elsewhere = st.publishes.values().find(|p| {
                        p.volume_id == req.volume_id
                            && !(crate::controller::shares_a_node(mode)
                                && p.access_mode.is_some_and(crate::controller::shares_a_node))
                    });
                    if let Some(p) = elsewhere {
                        return Err(Status::failed_precondition(format!(
                            "volume {} is published at {} on this node: a second target path \
                             needs a MULTI_NODE mode or SINGLE_NODE_MULTI_WRITER on both",
                            req.volume_id,
                            p.target_path.display()
                        )));
                    }
                }
                if block {
                    if let Some(parent) = target.parent() {
                        std::fs::create_dir_all(parent)
                            .map_err(|e| io_err("creating the target's parent", e))?;
                    }
                    if !target.exists() {
                        std::fs::File::create(&target)
                            .map_err(|e| io_err("creating the target file", e))?;
                    }
                } else {
                    std::fs::create_dir_all(&target)
                        .map_err(|e| io_err("creating the target path", e))?;
                }
                // A real device: the stage's loop device, or one attached here when the
                // volume is not staged.
                let staged_loop = staging
                    .as_ref()
                    .and_then(|s| st.stages.get(s))
                    .and_then(|s| s.loop_device.clone());
                let own_loop = match (with_loop, &staged_loop) {
                    (true, None) => Some(
                        mounts::loop_attach(&source)
                            .map_err(|e| io_err("attaching a loop device", e))?,
                    ),
                    _ => None,
                };
                let from = own_loop.clone().or(staged_loop).filter(|_| with_loop);
                let from = from.as_deref().unwrap_or(&source);
                mounts::bind(from, &target, req.readonly, no_mount)
                    .map_err(|e| io_err("bind-mounting", e))?;
                st.publishes.insert(
                    target.clone(),
                    PublishRec {
                        volume_id: req.volume_id.clone(),
                        target_path: target.clone(),
                        staging_path: staging.clone(),
                        readonly: req.readonly,
                        block,
                        loop_device: own_loop,
                        access_mode: Some(mode),
                    },
                );
                Ok(())
            })
            .await?;
            Ok(NodePublishVolumeResponse {})
        })
        .await
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let c = path_call("NodeUnpublishVolume", &req.volume_id, "", &req.target_path);
        self.call(c, async {
            require(&req.volume_id, "volume_id")?;
            require(&req.target_path, "target_path")?;
            let target = PathBuf::from(&req.target_path);
            let no_mount = self.no_mount();
            self.mutate(|st| {
                mounts::unmount(&target, no_mount).map_err(|e| io_err("unmounting", e))?;
                if let Some(dev) = st
                    .publishes
                    .get(&target)
                    .and_then(|p| p.loop_device.clone())
                {
                    mounts::loop_detach(&dev)
                        .map_err(|e| io_err("detaching the loop device", e))?;
                }
                let removed = if target.is_dir() {
                    std::fs::remove_dir(&target)
                } else {
                    std::fs::remove_file(&target)
                };
                match removed {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                        return Err(io_err("removing the target path", e))
                    }
                    _ => {}
                }
                st.publishes.remove(&target);
                Ok(())
            })
            .await?;
            Ok(NodeUnpublishVolumeResponse {})
        })
        .await
    }

    async fn node_get_volume_health(
        &self,
        request: Request<moor_csi::v1::NodeGetVolumeHealthRequest>,
    ) -> Result<Response<moor_csi::v1::NodeGetVolumeHealthResponse>, Status> {
        self.node_get_volume_health_rpc(request).await
    }

    async fn node_get_storage_health(
        &self,
        request: Request<moor_csi::v1::NodeGetStorageHealthRequest>,
    ) -> Result<Response<moor_csi::v1::NodeGetStorageHealthResponse>, Status> {
        self.node_get_storage_health_rpc(request).await
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<NodeGetVolumeStatsRequest>,
    ) -> Result<Response<NodeGetVolumeStatsResponse>, Status> {
        let req = request.into_inner();
        let c = path_call(
            "NodeGetVolumeStats",
            &req.volume_id,
            &req.staging_target_path,
            &req.volume_path,
        );
        self.call(c, async {
            let path = self
                .volume_at(&req.volume_id, &req.volume_path, true)
                .await?;
            let fs = rustix::fs::statvfs(&path).map_err(|e| io_err("statvfs", e.into()))?;
            let bytes = |blocks: u64| (blocks.saturating_mul(fs.f_frsize)) as i64;
            Ok(NodeGetVolumeStatsResponse {
                usage: vec![
                    VolumeUsage {
                        available: bytes(fs.f_bavail),
                        total: bytes(fs.f_blocks),
                        used: bytes(fs.f_blocks.saturating_sub(fs.f_bfree)),
                        unit: volume_usage::Unit::Bytes as i32,
                    },
                    VolumeUsage {
                        available: fs.f_favail as i64,
                        total: fs.f_files as i64,
                        used: fs.f_files.saturating_sub(fs.f_ffree) as i64,
                        unit: volume_usage::Unit::Inodes as i32,
                    },
                ],
                volume_condition: self.legacy_condition(&req.volume_id),
            })
        })
        .await
    }

    async fn node_expand_volume(
        &self,
        request: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        let c = path_call(
            "NodeExpandVolume",
            &req.volume_id,
            &req.staging_target_path,
            &req.volume_path,
        );
        self.call(c, async {
            // Online: where it is published; offline: where it is staged.
            self.volume_at(&req.volume_id, &req.volume_path, true)
                .await?;
            // A directory needs no filesystem resize.
            let short = i64::from(self.lies(crate::faults::Lie::Expansion));
            Ok(NodeExpandVolumeResponse {
                capacity_bytes: req
                    .capacity_range
                    .map(|r| r.required_bytes - short)
                    .unwrap_or_default(),
            })
        })
        .await
    }

    async fn node_get_capabilities(
        &self,
        _: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        use node_service_capability::rpc::Type;
        self.call(Call::new("NodeGetCapabilities"), async {
            let mut types = vec![Type::GetVolumeStats, Type::ExpandVolume];
            match self.cfg().health_api {
                crate::HealthApi::V113 => {
                    types.extend([Type::GetVolumeHealth, Type::GetStorageHealth]);
                }
                crate::HealthApi::V112 => types.push(Type::VolumeCondition),
            }
            if self.cfg().volume_mount_group {
                types.push(Type::VolumeMountGroup);
            }
            if self.cfg().single_node_multi_writer {
                types.push(Type::SingleNodeMultiWriter);
            }
            if self.cfg().stage_unstage {
                types.insert(0, Type::StageUnstageVolume);
            }
            Ok(NodeGetCapabilitiesResponse {
                capabilities: types
                    .into_iter()
                    .map(|t| NodeServiceCapability {
                        r#type: Some(node_service_capability::Type::Rpc(
                            node_service_capability::Rpc { r#type: t as i32 },
                        )),
                    })
                    .collect(),
            })
        })
        .await
    }

    async fn node_get_info(
        &self,
        _: Request<NodeGetInfoRequest>,
    ) -> Result<Response<NodeGetInfoResponse>, Status> {
        self.call(Call::new("NodeGetInfo"), async {
            use crate::faults::Lie;
            Ok(NodeGetInfoResponse {
                node_id: if self.lies(Lie::NodeId) {
                    format!("{}-other", self.cfg().node_id)
                } else {
                    self.cfg().node_id.clone()
                },
                max_volumes_per_node: if self.lies(Lie::MaxVolumes) {
                    1
                } else {
                    self.max_volumes()
                },
                accessible_topology: (!self.inner.topology.is_empty()).then(|| Topology {
                    segments: self.inner.topology.clone(),
                }),
            })
        })
        .await
    }
}
