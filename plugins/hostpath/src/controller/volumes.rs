//! The Controller service's volumes: directories under `<state-dir>/volumes`, made by
//! CreateVolume (idempotent by name; empty, or a copy of a snapshot or volume), and
//! validated, listed (paged), read, expanded, modified and deleted.

use super::*;
use crate::faults::Lie;

impl Plugin {
    pub(crate) async fn create_volume_rpc(
        &self,
        request: Request<CreateVolumeRequest>,
    ) -> Result<Response<CreateVolumeResponse>, Status> {
        let req = request.into_inner();
        let c = Call {
            name: Some(req.name.clone()),
            secret_keys: req.secrets.keys().cloned().collect(),
            ..Call::new("CreateVolume")
        };
        self.call(c, async {
            require(&req.name, "name")?;
            if req.volume_capabilities.is_empty() {
                return Err(Status::invalid_argument("volume_capabilities is required"));
            }
            let mut single_node = false;
            for cap in &req.volume_capabilities {
                single_node |= is_single_node(check_capability(Some(cap))?.1);
            }
            self.check_mutable(&req.mutable_parameters)?;
            let (required, limit) = req
                .capacity_range
                .as_ref()
                .map(|r| (r.required_bytes, r.limit_bytes))
                .unwrap_or_default();
            if required < 0 || limit < 0 {
                return Err(Status::invalid_argument(
                    "capacity_range may not be negative",
                ));
            }
            if limit > 0 && limit < required {
                return Err(Status::invalid_argument(
                    "capacity_range.limit_bytes is below required_bytes",
                ));
            }
            self.within_max_size(required)?;
            let size = if required > 0 {
                required
            } else if limit > 0 {
                limit.min(DEFAULT_CAPACITY)
            } else {
                DEFAULT_CAPACITY
            };
            let at = self.place(req.accessibility_requirements.as_ref())?;
            if at.is_none() && !self.topology_fits(req.accessibility_requirements.as_ref()) {
                return Err(Status::resource_exhausted(
                    "no requisite topology matches this plugin's segments",
                ));
            }
            let (total, topology) = self.segment(at);
            let segmented = at.is_some();
            let source = req
                .volume_content_source
                .as_ref()
                .and_then(|s| s.r#type.as_ref())
                .map(|t| match t {
                    volume_content_source::Type::Snapshot(s) => {
                        Source::Snapshot(s.snapshot_id.clone())
                    }
                    volume_content_source::Type::Volume(v) => Source::Volume(v.volume_id.clone()),
                });
            let dir = self.cfg().state_dir.clone();
            let vol = self
                .mutate(|st| {
                    if let Some(existing) = st.volume_by_name(&req.name) {
                        let fits = existing.capacity >= required
                            && (limit == 0 || existing.capacity <= limit)
                            && existing.parameters == req.parameters
                            && existing.source == source;
                        return if fits {
                            Ok(existing.clone())
                        } else {
                            Err(Status::already_exists(format!(
                                "volume {:?} exists with other capacity, parameters or source",
                                req.name
                            )))
                        };
                    }
                    let used = if segmented {
                        st.used_capacity_in(&topology)
                    } else {
                        st.used_capacity()
                    };
                    if used.checked_add(size).is_none_or(|after| after > total) {
                        return Err(Status::resource_exhausted(format!(
                            "{size} bytes requested, {} available",
                            total.saturating_sub(used).max(0)
                        )));
                    }
                    let id = format!("vol-{}", uuid::Uuid::new_v4().simple());
                    let path = dir.join("volumes").join(&id);
                    match &source {
                        Some(Source::Snapshot(sid)) => {
                            let snap = st.snapshots.get(sid).ok_or_else(|| {
                                Status::not_found(format!("snapshot {sid} not found"))
                            })?;
                            copy_dir(&snap.path, &path)
                                .map_err(|e| internal("copying the snapshot", e))?;
                        }
                        Some(Source::Volume(vid)) => {
                            let src = st.volumes.get(vid).ok_or_else(|| {
                                Status::not_found(format!("volume {vid} not found"))
                            })?;
                            copy_dir(&src.path, &path)
                                .map_err(|e| internal("cloning the volume", e))?;
                        }
                        None => std::fs::create_dir_all(&path)
                            .map_err(|e| internal("creating the volume", e))?,
                    }
                    let rec = VolumeRec {
                        id: id.clone(),
                        name: req.name.clone(),
                        capacity: size,
                        parameters: req.parameters.clone(),
                        source: source.clone(),
                        path,
                        topology: topology.clone(),
                        published: BTreeMap::new(),
                        single_node,
                        mutable_parameters: req.mutable_parameters.clone(),
                    };
                    st.volumes.insert(id, rec.clone());
                    Ok(rec)
                })
                .await?;
            let mut volume = self.volume_message(&vol);
            if self.lies(Lie::Capacity) {
                volume.capacity_bytes = match &req.capacity_range {
                    Some(r) if r.required_bytes > 1 => r.required_bytes / 2,
                    Some(r) if r.limit_bytes > 0 => r.limit_bytes.saturating_mul(2),
                    _ => volume.capacity_bytes,
                };
            }
            if self.lies(Lie::Topology) {
                volume.accessible_topology = vec![moor_csi::v1::Topology {
                    segments: [("lie".to_string(), "elsewhere".to_string())].into(),
                }];
            }
            Ok(CreateVolumeResponse {
                volume: Some(volume),
            })
        })
        .await
    }

    pub(crate) async fn delete_volume_rpc(
        &self,
        request: Request<DeleteVolumeRequest>,
    ) -> Result<Response<DeleteVolumeResponse>, Status> {
        let req = request.into_inner();
        let c = Call {
            volume_id: Some(req.volume_id.clone()),
            secret_keys: req.secrets.keys().cloned().collect(),
            ..Call::new("DeleteVolume")
        };
        self.call(c, async {
            require(&req.volume_id, "volume_id")?;
            self.mutate(|st| {
                let Some(vol) = st.volumes.get(&req.volume_id) else {
                    return Ok(());
                };
                if !vol.published.is_empty() {
                    return Err(Status::failed_precondition(format!(
                        "volume {} is still published to {:?}",
                        vol.id,
                        vol.published.keys().collect::<Vec<_>>()
                    )));
                }
                match std::fs::remove_dir_all(&vol.path) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                        return Err(internal("removing the volume", e))
                    }
                    _ => {}
                }
                // Its attach markers' directory, empty once nothing is published.
                let mut markers = vol.path.as_os_str().to_owned();
                markers.push(".attached");
                let _ = std::fs::remove_dir(std::path::PathBuf::from(markers));
                st.volumes.remove(&req.volume_id);
                Ok(())
            })
            .await?;
            Ok(DeleteVolumeResponse {})
        })
        .await
    }

    pub(crate) async fn validate_volume_capabilities_rpc(
        &self,
        request: Request<ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<ValidateVolumeCapabilitiesResponse>, Status> {
        let req = request.into_inner();
        let c = Call {
            volume_id: Some(req.volume_id.clone()),
            ..Call::new("ValidateVolumeCapabilities")
        };
        self.call(c, async {
            require(&req.volume_id, "volume_id")?;
            if req.volume_capabilities.is_empty() {
                return Err(Status::invalid_argument("volume_capabilities is required"));
            }
            let mut modes = Vec::new();
            for cap in &req.volume_capabilities {
                modes.push(check_capability(Some(cap))?.1);
            }
            let Some(single_node) = self
                .read(|st| st.volumes.get(&req.volume_id).map(|v| v.single_node))
                .await
            else {
                return Err(Status::not_found(format!(
                    "volume {} not found",
                    req.volume_id
                )));
            };
            // A volume created for one node cannot be shared: not confirmed, with why.
            if single_node {
                if let Some(m) = modes.iter().find(|m| !is_single_node(**m)) {
                    let name = volume_capability::access_mode::Mode::try_from(*m)
                        .map(|m| m.as_str_name())
                        .unwrap_or("?");
                    return Ok(ValidateVolumeCapabilitiesResponse {
                        confirmed: None,
                        message: format!(
                            "volume {} was created for a single node; {name} is not supported",
                            req.volume_id
                        ),
                    });
                }
            }
            let confirmed_caps = if self.lies(Lie::Validation) {
                Vec::new()
            } else {
                req.volume_capabilities.clone()
            };
            Ok(ValidateVolumeCapabilitiesResponse {
                confirmed: Some(validate_volume_capabilities_response::Confirmed {
                    volume_context: req.volume_context.clone(),
                    volume_capabilities: confirmed_caps,
                    parameters: req.parameters.clone(),
                    mutable_parameters: Default::default(),
                }),
                message: String::new(),
            })
        })
        .await
    }

    pub(crate) async fn list_volumes_rpc(
        &self,
        request: Request<ListVolumesRequest>,
    ) -> Result<Response<ListVolumesResponse>, Status> {
        let req = request.into_inner();
        self.call(Call::new("ListVolumes"), async {
            if !self.cfg().list_volumes {
                return Err(Status::unimplemented("LIST_VOLUMES is not advertised"));
            }
            let mut all: Vec<VolumeRec> =
                self.read(|st| st.volumes.values().cloned().collect()).await;
            if self.lies(Lie::Unlisted) {
                all.clear();
            }
            let (items, next_token) = page(&all, req.max_entries, &req.starting_token)?;
            Ok(ListVolumesResponse {
                entries: items
                    .iter()
                    .map(|v| list_volumes_response::Entry {
                        volume: Some(self.volume_message(v)),
                        status: Some(list_volumes_response::VolumeStatus {
                            published_node_ids: v.published.keys().cloned().collect(),
                            volume_condition: self.legacy_condition(&v.id),
                        }),
                    })
                    .collect(),
                next_token,
            })
        })
        .await
    }

    pub(crate) async fn controller_expand_volume_rpc(
        &self,
        request: Request<ControllerExpandVolumeRequest>,
    ) -> Result<Response<ControllerExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        let c = Call {
            volume_id: Some(req.volume_id.clone()),
            secret_keys: req.secrets.keys().cloned().collect(),
            ..Call::new("ControllerExpandVolume")
        };
        self.call(c, async {
            require(&req.volume_id, "volume_id")?;
            let range = req
                .capacity_range
                .ok_or_else(|| Status::invalid_argument("capacity_range is required"))?;
            self.within_max_size(range.required_bytes)?;
            let total = self.inner.capacity;
            let offline = self.cfg().expansion == crate::Expansion::Offline;
            let capacity = self
                .mutate(|st| {
                    let used = st.used_capacity();
                    let vol = st.volumes.get_mut(&req.volume_id).ok_or_else(|| {
                        Status::not_found(format!("volume {} not found", req.volume_id))
                    })?;
                    if offline && !vol.published.is_empty() {
                        return Err(Status::failed_precondition(
                            "VOLUME_EXPANSION is OFFLINE: the volume is published",
                        ));
                    }
                    if range.limit_bytes > 0 && range.limit_bytes < vol.capacity {
                        return Err(Status::out_of_range("volumes do not shrink"));
                    }
                    let new = range.required_bytes.max(vol.capacity);
                    if used
                        .saturating_sub(vol.capacity)
                        .checked_add(new)
                        .is_none_or(|after| after > total)
                    {
                        return Err(Status::resource_exhausted("not enough capacity to expand"));
                    }
                    vol.capacity = new;
                    Ok(new)
                })
                .await?;
            Ok(ControllerExpandVolumeResponse {
                capacity_bytes: if self.lies(Lie::Expansion) {
                    range.required_bytes - 1
                } else {
                    capacity
                },
                node_expansion_required: self.cfg().node_expansion_required,
            })
        })
        .await
    }

    pub(crate) async fn controller_get_volume_rpc(
        &self,
        request: Request<ControllerGetVolumeRequest>,
    ) -> Result<Response<ControllerGetVolumeResponse>, Status> {
        let req = request.into_inner();
        let c = Call {
            volume_id: Some(req.volume_id.clone()),
            ..Call::new("ControllerGetVolume")
        };
        self.call(c, async {
            require(&req.volume_id, "volume_id")?;
            let vol = self
                .read(|st| st.volumes.get(&req.volume_id).cloned())
                .await
                .filter(|_| !self.lies(Lie::Unlisted))
                .ok_or_else(|| Status::not_found(format!("volume {} not found", req.volume_id)))?;
            Ok(ControllerGetVolumeResponse {
                volume: Some(self.volume_message(&vol)),
                status: Some(moor_csi::v1::controller_get_volume_response::VolumeStatus {
                    published_node_ids: vol.published.keys().cloned().collect(),
                    volume_condition: self.legacy_condition(&vol.id),
                }),
            })
        })
        .await
    }

    pub(crate) async fn controller_modify_volume_rpc(
        &self,
        request: Request<ControllerModifyVolumeRequest>,
    ) -> Result<Response<ControllerModifyVolumeResponse>, Status> {
        let req = request.into_inner();
        let c = Call {
            volume_id: Some(req.volume_id.clone()),
            secret_keys: req.secrets.keys().cloned().collect(),
            ..Call::new("ControllerModifyVolume")
        };
        self.call(c, async {
            if self.cfg().mutable_parameters.is_empty() {
                return Err(Status::unimplemented("MODIFY_VOLUME is not advertised"));
            }
            require(&req.volume_id, "volume_id")?;
            if req.mutable_parameters.is_empty() {
                return Err(Status::invalid_argument("mutable_parameters is required"));
            }
            self.check_mutable(&req.mutable_parameters)?;
            self.mutate(|st| {
                let vol = st.volumes.get_mut(&req.volume_id).ok_or_else(|| {
                    Status::not_found(format!("volume {} not found", req.volume_id))
                })?;
                vol.mutable_parameters
                    .extend(req.mutable_parameters.clone());
                Ok(())
            })
            .await?;
            Ok(ControllerModifyVolumeResponse {})
        })
        .await
    }
}
