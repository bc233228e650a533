//! The GroupController service: a volume group snapshot copies several volumes in one
//! call, each copy a snapshot that belongs to the group (deleted only with it).

use moor_csi::v1::{
    group_controller_server::GroupController, group_controller_service_capability,
    CreateVolumeGroupSnapshotRequest, CreateVolumeGroupSnapshotResponse,
    DeleteVolumeGroupSnapshotRequest, DeleteVolumeGroupSnapshotResponse,
    GetVolumeGroupSnapshotRequest, GetVolumeGroupSnapshotResponse,
    GroupControllerGetCapabilitiesRequest, GroupControllerGetCapabilitiesResponse,
    GroupControllerServiceCapability, VolumeGroupSnapshot,
};
use tonic::{Request, Response, Status};

use crate::calllog::Call;
use crate::state::{GroupRec, State};
use crate::{require, Plugin};

impl Plugin {
    fn group_message(st: &State, g: &GroupRec) -> VolumeGroupSnapshot {
        VolumeGroupSnapshot {
            group_snapshot_id: g.id.clone(),
            snapshots: g
                .snapshot_ids
                .iter()
                .filter_map(|id| st.snapshots.get(id))
                .map(Plugin::snapshot_message)
                .collect(),
            creation_time: Some(prost_types::Timestamp {
                seconds: g.created_secs,
                nanos: 0,
            }),
            ready_to_use: true,
        }
    }

    /// The group as answered: without its last member while told to lie so.
    fn lie_about_members(&self, mut group: VolumeGroupSnapshot) -> VolumeGroupSnapshot {
        if self.lies(crate::faults::Lie::GroupMembers) {
            group.snapshots.pop();
        }
        group
    }

    /// The group `id`, checked against the snapshot ids a request names (when it names
    /// any): another set is INVALID_ARGUMENT.
    fn group_named<'a>(
        st: &'a State,
        id: &str,
        snapshot_ids: &[String],
    ) -> Result<Option<&'a GroupRec>, Status> {
        let Some(g) = st.groups.get(id) else {
            return Ok(None);
        };
        let mut asked = snapshot_ids.to_vec();
        let mut held = g.snapshot_ids.clone();
        asked.sort();
        held.sort();
        if !asked.is_empty() && asked != held {
            return Err(Status::invalid_argument(format!(
                "group snapshot {id} holds snapshots {}",
                held.join(", ")
            )));
        }
        Ok(Some(g))
    }
}

#[tonic::async_trait]
impl GroupController for Plugin {
    async fn group_controller_get_capabilities(
        &self,
        _: Request<GroupControllerGetCapabilitiesRequest>,
    ) -> Result<Response<GroupControllerGetCapabilitiesResponse>, Status> {
        use group_controller_service_capability::rpc::Type;
        self.call(Call::new("GroupControllerGetCapabilities"), async {
            Ok(GroupControllerGetCapabilitiesResponse {
                capabilities: vec![GroupControllerServiceCapability {
                    r#type: Some(group_controller_service_capability::Type::Rpc(
                        group_controller_service_capability::Rpc {
                            r#type: Type::CreateDeleteGetVolumeGroupSnapshot as i32,
                        },
                    )),
                }],
            })
        })
        .await
    }

    async fn create_volume_group_snapshot(
        &self,
        request: Request<CreateVolumeGroupSnapshotRequest>,
    ) -> Result<Response<CreateVolumeGroupSnapshotResponse>, Status> {
        let req = request.into_inner();
        let c = Call {
            name: Some(req.name.clone()),
            ..Call::new("CreateVolumeGroupSnapshot")
        };
        self.call(c, async {
            require(&req.name, "name")?;
            if req.source_volume_ids.is_empty() {
                return Err(Status::invalid_argument("source_volume_ids is required"));
            }
            let dir = self.cfg().state_dir.clone();
            let group = self
                .mutate(|st| {
                    if let Some(g) = st.groups.values().find(|g| g.name == req.name) {
                        let sources: Vec<&str> = g
                            .snapshot_ids
                            .iter()
                            .filter_map(|id| st.snapshots.get(id))
                            .map(|s| s.source_volume_id.as_str())
                            .collect();
                        return if sources == req.source_volume_ids {
                            Ok(Plugin::group_message(st, g))
                        } else {
                            Err(Status::already_exists(format!(
                                "group snapshot {:?} exists for other volumes",
                                req.name
                            )))
                        };
                    }
                    if let Some(v) = req
                        .source_volume_ids
                        .iter()
                        .find(|v| !st.volumes.contains_key(*v))
                    {
                        return Err(Status::not_found(format!("volume {v} not found")));
                    }
                    let id = format!("group-{}", uuid::Uuid::new_v4().simple());
                    let mut snapshot_ids = Vec::new();
                    for v in &req.source_volume_ids {
                        let name = format!("{}-{v}", req.name);
                        snapshot_ids.push(Plugin::cut(&dir, st, v, &name, Some(&id))?.id);
                    }
                    let g = GroupRec {
                        id: id.clone(),
                        name: req.name.clone(),
                        snapshot_ids,
                        created_secs: crate::controller::now_secs(),
                    };
                    st.groups.insert(id, g.clone());
                    Ok(Plugin::group_message(st, &g))
                })
                .await?;
            Ok(CreateVolumeGroupSnapshotResponse {
                group_snapshot: Some(self.lie_about_members(group)),
            })
        })
        .await
    }

    async fn delete_volume_group_snapshot(
        &self,
        request: Request<DeleteVolumeGroupSnapshotRequest>,
    ) -> Result<Response<DeleteVolumeGroupSnapshotResponse>, Status> {
        let req = request.into_inner();
        let c = Call {
            snapshot_id: Some(req.group_snapshot_id.clone()),
            ..Call::new("DeleteVolumeGroupSnapshot")
        };
        self.call(c, async {
            require(&req.group_snapshot_id, "group_snapshot_id")?;
            self.mutate(|st| {
                let Some(g) =
                    Plugin::group_named(st, &req.group_snapshot_id, &req.snapshot_ids)?.cloned()
                else {
                    // Gone already: done.
                    return Ok(());
                };
                for id in &g.snapshot_ids {
                    Plugin::drop_snapshot(st, id)?;
                }
                st.groups.remove(&g.id);
                Ok(())
            })
            .await?;
            Ok(DeleteVolumeGroupSnapshotResponse {})
        })
        .await
    }

    async fn get_volume_group_snapshot(
        &self,
        request: Request<GetVolumeGroupSnapshotRequest>,
    ) -> Result<Response<GetVolumeGroupSnapshotResponse>, Status> {
        let req = request.into_inner();
        let c = Call {
            snapshot_id: Some(req.group_snapshot_id.clone()),
            ..Call::new("GetVolumeGroupSnapshot")
        };
        self.call(c, async {
            require(&req.group_snapshot_id, "group_snapshot_id")?;
            let group = self
                .read(|st| {
                    Plugin::group_named(st, &req.group_snapshot_id, &req.snapshot_ids)
                        .map(|g| g.map(|g| Plugin::group_message(st, g)))
                })
                .await?
                .ok_or_else(|| {
                    Status::not_found(format!(
                        "group snapshot {} not found",
                        req.group_snapshot_id
                    ))
                })?;
            Ok(GetVolumeGroupSnapshotResponse {
                group_snapshot: Some(self.lie_about_members(group)),
            })
        })
        .await
    }
}
