//! The CSI 1.13 volume health API (`--health-api=1.13`): what the `health` and
//! `storage_health` faults set, answered by ControllerListVolumeHealth,
//! ControllerGetVolumeHealth, NodeGetVolumeHealth and NodeGetStorageHealth. With
//! `--health-api=1.12` each is UNIMPLEMENTED, as a plugin of that generation answers.

use moor_csi::v1::*;
use tonic::{Request, Response, Status};

use crate::calllog::Call;
use crate::controller::page;
use crate::{require, HealthApi, Plugin};

impl Plugin {
    /// The VolumeCondition a 1.12 plugin answers (none from a 1.13 one: the field is
    /// gone from its messages).
    pub(crate) fn legacy_condition(&self, volume_id: &str) -> Option<VolumeCondition> {
        (self.cfg().health_api == HealthApi::V112).then(|| self.inner.faults.condition(volume_id))
    }

    fn health_api(&self, rpc: &str) -> Result<(), Status> {
        match self.cfg().health_api {
            HealthApi::V113 => Ok(()),
            HealthApi::V112 => Err(Status::unimplemented(format!(
                "{rpc} is CSI 1.13; this plugin serves --health-api=1.12"
            ))),
        }
    }

    pub(crate) async fn controller_list_volume_health_rpc(
        &self,
        request: Request<ControllerListVolumeHealthRequest>,
    ) -> Result<Response<ControllerListVolumeHealthResponse>, Status> {
        let req = request.into_inner();
        self.call(Call::new("ControllerListVolumeHealth"), async {
            self.health_api("ControllerListVolumeHealth")?;
            // Only the volumes with an adverse condition, of those that exist.
            let known = self.read(|st| st.volumes.clone()).await;
            let ids: Vec<String> = self
                .inner
                .faults
                .unhealthy()
                .into_iter()
                .filter(|id| known.contains_key(id))
                .collect();
            let (items, next_token) = page(&ids, req.max_entries, &req.starting_token)?;
            Ok(ControllerListVolumeHealthResponse {
                entries: items
                    .iter()
                    .map(|id| self.inner.faults.health(id))
                    .collect(),
                next_token,
            })
        })
        .await
    }

    pub(crate) async fn controller_get_volume_health_rpc(
        &self,
        request: Request<ControllerGetVolumeHealthRequest>,
    ) -> Result<Response<ControllerGetVolumeHealthResponse>, Status> {
        let req = request.into_inner();
        let c = Call {
            volume_id: Some(req.volume_id.clone()),
            ..Call::new("ControllerGetVolumeHealth")
        };
        self.call(c, async {
            self.health_api("ControllerGetVolumeHealth")?;
            require(&req.volume_id, "volume_id")?;
            let known = self
                .read(|st| st.volumes.contains_key(&req.volume_id))
                .await;
            if !known {
                return Err(Status::not_found(format!(
                    "volume {} not found",
                    req.volume_id
                )));
            }
            Ok(ControllerGetVolumeHealthResponse {
                volume_health: Some(self.inner.faults.health(&req.volume_id)),
            })
        })
        .await
    }

    pub(crate) async fn node_get_volume_health_rpc(
        &self,
        request: Request<NodeGetVolumeHealthRequest>,
    ) -> Result<Response<NodeGetVolumeHealthResponse>, Status> {
        let req = request.into_inner();
        let c = Call {
            volume_id: Some(req.volume_id.clone()),
            ..Call::new("NodeGetVolumeHealth")
        };
        self.call(c, async {
            self.health_api("NodeGetVolumeHealth")?;
            require(&req.volume_id, "volume_id")?;
            // Paths are optional: the volume may never have been staged or published.
            for p in [&req.volume_publish_path, &req.staging_target_path] {
                if !p.is_empty() && !p.starts_with('/') {
                    return Err(Status::invalid_argument(format!(
                        "{p:?} is not an absolute path"
                    )));
                }
            }
            Ok(NodeGetVolumeHealthResponse {
                volume_health: Some(self.inner.faults.health(&req.volume_id)),
            })
        })
        .await
    }

    pub(crate) async fn node_get_storage_health_rpc(
        &self,
        _: Request<NodeGetStorageHealthRequest>,
    ) -> Result<Response<NodeGetStorageHealthResponse>, Status> {
        self.call(Call::new("NodeGetStorageHealth"), async {
            self.health_api("NodeGetStorageHealth")?;
            Ok(NodeGetStorageHealthResponse {
                backend_health: self.inner.faults.storage_health(),
            })
        })
        .await
    }
}
