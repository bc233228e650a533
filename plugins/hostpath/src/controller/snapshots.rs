//! The Controller service's snapshots: directories copied under
//! `<state-dir>/snapshots`, cut by CreateSnapshot (idempotent by name), read by
//! GetSnapshot and ListSnapshots (paged), dropped by DeleteSnapshot (not one that
//! belongs to a group snapshot).

use moor_csi::v1::{
    list_snapshots_response, CreateSnapshotRequest, CreateSnapshotResponse, DeleteSnapshotRequest,
    DeleteSnapshotResponse, GetSnapshotRequest, GetSnapshotResponse, ListSnapshotsRequest,
    ListSnapshotsResponse,
};
use tonic::{Request, Response, Status};

use super::page;
use crate::calllog::Call;
use crate::state::SnapshotRec;
use crate::{require, Plugin};

impl Plugin {
    pub(crate) async fn create_snapshot_rpc(
        &self,
        request: Request<CreateSnapshotRequest>,
    ) -> Result<Response<CreateSnapshotResponse>, Status> {
        let req = request.into_inner();
        let c = Call {
            volume_id: Some(req.source_volume_id.clone()),
            name: Some(req.name.clone()),
            secret_keys: req.secrets.keys().cloned().collect(),
            ..Call::new("CreateSnapshot")
        };
        self.call(c, async {
            require(&req.source_volume_id, "source_volume_id")?;
            require(&req.name, "name")?;
            let dir = self.cfg().state_dir.clone();
            let snap = self
                .mutate(|st| {
                    if let Some(s) = st.snapshots.values().find(|s| s.name == req.name) {
                        return if s.source_volume_id == req.source_volume_id {
                            Ok(s.clone())
                        } else {
                            Err(Status::already_exists(format!(
                                "snapshot {:?} exists for another volume",
                                req.name
                            )))
                        };
                    }
                    Plugin::cut(&dir, st, &req.source_volume_id, &req.name, None)
                })
                .await?;
            let mut snapshot = self.read_snapshot(&snap);
            if self.lies(crate::faults::Lie::SnapshotSource) {
                snapshot.source_volume_id = format!("{}-other", snapshot.source_volume_id);
            }
            Ok(CreateSnapshotResponse {
                snapshot: Some(snapshot),
            })
        })
        .await
    }

    pub(crate) async fn delete_snapshot_rpc(
        &self,
        request: Request<DeleteSnapshotRequest>,
    ) -> Result<Response<DeleteSnapshotResponse>, Status> {
        let req = request.into_inner();
        let c = Call {
            snapshot_id: Some(req.snapshot_id.clone()),
            secret_keys: req.secrets.keys().cloned().collect(),
            ..Call::new("DeleteSnapshot")
        };
        self.call(c, async {
            require(&req.snapshot_id, "snapshot_id")?;
            self.mutate(|st| {
                if let Some(g) = st
                    .snapshots
                    .get(&req.snapshot_id)
                    .and_then(|s| s.group_id.clone())
                {
                    return Err(Status::failed_precondition(format!(
                        "snapshot {} belongs to group snapshot {g}: delete the group",
                        req.snapshot_id
                    )));
                }
                Plugin::drop_snapshot(st, &req.snapshot_id)
            })
            .await?;
            Ok(DeleteSnapshotResponse {})
        })
        .await
    }

    pub(crate) async fn list_snapshots_rpc(
        &self,
        request: Request<ListSnapshotsRequest>,
    ) -> Result<Response<ListSnapshotsResponse>, Status> {
        let req = request.into_inner();
        self.call(Call::new("ListSnapshots"), async {
            let all: Vec<SnapshotRec> = self
                .read(|st| {
                    st.snapshots
                        .values()
                        .filter(|s| req.snapshot_id.is_empty() || s.id == req.snapshot_id)
                        .filter(|s| {
                            req.source_volume_id.is_empty()
                                || s.source_volume_id == req.source_volume_id
                        })
                        .cloned()
                        .collect()
                })
                .await;
            let (items, next_token) = page(&all, req.max_entries, &req.starting_token)?;
            Ok(ListSnapshotsResponse {
                entries: items
                    .iter()
                    .map(|s| list_snapshots_response::Entry {
                        snapshot: Some(self.read_snapshot(s)),
                    })
                    .collect(),
                next_token,
            })
        })
        .await
    }

    pub(crate) async fn get_snapshot_rpc(
        &self,
        request: Request<GetSnapshotRequest>,
    ) -> Result<Response<GetSnapshotResponse>, Status> {
        let req = request.into_inner();
        let c = Call {
            snapshot_id: Some(req.snapshot_id.clone()),
            ..Call::new("GetSnapshot")
        };
        self.call(c, async {
            require(&req.snapshot_id, "snapshot_id")?;
            let snap = self
                .read(|st| st.snapshots.get(&req.snapshot_id).cloned())
                .await
                .ok_or_else(|| {
                    Status::not_found(format!("snapshot {} not found", req.snapshot_id))
                })?;
            Ok(GetSnapshotResponse {
                snapshot: Some(self.read_snapshot(&snap)),
            })
        })
        .await
    }
}
