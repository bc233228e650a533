//! The typed CSI client: one method per RPC moor drives, each knowing its deadline and
//! retries (the [`Policy`]) and which answers of a reverse call mean "already done", so
//! no call site repeats them.
//!
//! | RPC | already done | a timeout / cut-off |
//! |---|---|---|
//! | CreateVolume | (idempotent by name) | uncertain: DeleteVolume after re-asking |
//! | DeleteVolume | NotFound | uncertain: repeated |
//! | ControllerPublishVolume | OK on repeat | uncertain: ControllerUnpublish owed |
//! | ControllerUnpublishVolume | NotFound (volume or node gone) | uncertain: repeated |
//! | NodeStageVolume | OK on repeat | uncertain: NodeUnstage owed |
//! | NodeUnstageVolume | NotFound | uncertain: repeated |
//! | NodePublishVolume | OK on repeat | uncertain: NodeUnpublish owed |
//! | NodeUnpublishVolume | NotFound | uncertain: repeated |

use tonic::transport::Channel;

use super::policy::{request, CsiError, Policy};
use super::v1;
use v1::controller_client::ControllerClient;
use v1::node_client::NodeClient;

/// A plugin's controller and node services under one call policy (cheap to clone).
#[derive(Clone)]
pub struct Csi {
    channel: Channel,
    policy: Policy,
}

macro_rules! rpc {
    ($(#[$doc:meta])* $name:ident, $client:ident, $method:ident, $rpc:literal, $req:ty, $resp:ty) => {
        $(#[$doc])*
        pub async fn $name(&self, req: $req) -> Result<$resp, CsiError> {
            let channel = self.channel.clone();
            self.policy
                .call($rpc, |t| {
                    let mut c = $client::new(channel.clone());
                    let req = req.clone();
                    async move { c.$method(request(req, t)).await }
                })
                .await
        }
    };
}

macro_rules! reverse_rpc {
    ($(#[$doc:meta])* $name:ident, $client:ident, $method:ident, $rpc:literal, $req:ty) => {
        $(#[$doc])*
        pub async fn $name(&self, req: $req) -> Result<(), CsiError> {
            let channel = self.channel.clone();
            let r = self
                .policy
                .call($rpc, |t| {
                    let mut c = $client::new(channel.clone());
                    let req = req.clone();
                    async move { c.$method(request(req, t)).await }
                })
                .await;
            match r {
                Ok(_) => Ok(()),
                // The spec's answer for something already gone: the reverse is done.
                Err(e) if e.is_not_found() => Ok(()),
                Err(e) => Err(e),
            }
        }
    };
}

impl Csi {
    /// A client over `channel` (see [`super::channel`]) under `policy`.
    pub fn new(channel: Channel, policy: Policy) -> Csi {
        Csi { channel, policy }
    }

    rpc!(
        /// CreateVolume.
        create_volume, ControllerClient, create_volume, "CreateVolume",
        v1::CreateVolumeRequest, v1::CreateVolumeResponse
    );
    reverse_rpc!(
        /// DeleteVolume; NotFound is done.
        delete_volume, ControllerClient, delete_volume, "DeleteVolume",
        v1::DeleteVolumeRequest
    );
    rpc!(
        /// ControllerPublishVolume.
        controller_publish, ControllerClient, controller_publish_volume,
        "ControllerPublishVolume", v1::ControllerPublishVolumeRequest,
        v1::ControllerPublishVolumeResponse
    );
    reverse_rpc!(
        /// ControllerUnpublishVolume; NotFound (volume or node gone) is done.
        controller_unpublish, ControllerClient, controller_unpublish_volume,
        "ControllerUnpublishVolume", v1::ControllerUnpublishVolumeRequest
    );
    rpc!(
        /// NodeStageVolume.
        node_stage, NodeClient, node_stage_volume, "NodeStageVolume",
        v1::NodeStageVolumeRequest, v1::NodeStageVolumeResponse
    );
    reverse_rpc!(
        /// NodeUnstageVolume; NotFound is done.
        node_unstage, NodeClient, node_unstage_volume, "NodeUnstageVolume",
        v1::NodeUnstageVolumeRequest
    );
    rpc!(
        /// NodePublishVolume.
        node_publish, NodeClient, node_publish_volume, "NodePublishVolume",
        v1::NodePublishVolumeRequest, v1::NodePublishVolumeResponse
    );
    reverse_rpc!(
        /// NodeUnpublishVolume; NotFound is done.
        node_unpublish, NodeClient, node_unpublish_volume, "NodeUnpublishVolume",
        v1::NodeUnpublishVolumeRequest
    );
}
