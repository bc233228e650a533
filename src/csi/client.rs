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
//! | ValidateVolumeCapabilities, ControllerGetVolume | (reads) | repeated |
//! | ControllerExpandVolume, NodeExpandVolume | OK on repeat (idempotent by size) | repeated |
//! | ControllerModifyVolume | OK on repeat (idempotent by parameters) | repeated |
//! | CreateSnapshot | (idempotent by name) | repeated; DeleteSnapshot after re-asking |
//! | DeleteSnapshot | NotFound | uncertain: repeated |

use std::future::Future;
use tonic::transport::Channel;
use tracing::Instrument;

use super::contract::{self, Breach, Monitor};
use super::policy::{request, CsiError, Policy};
use super::v1;
use crate::api::ObjectRef;
use crate::runtime::term::Term;
use std::sync::Arc;
use v1::controller_client::ControllerClient;
use v1::group_controller_client::GroupControllerClient;
use v1::node_client::NodeClient;

/// The gRPC header naming the term a call was made under (see [`Csi::under`]).
pub const TERM_HEADER: &str = "moor-term";
/// The gRPC header saying when a try made under a term was sent (Unix ms).
pub const SENT_HEADER: &str = "moor-sent";

/// A plugin's controller and node services under one call policy (cheap to clone).
#[derive(Clone)]
pub struct Csi {
    channel: Channel,
    policy: Policy,
    term: Option<Term>,
    /// Where the answers' breaches of the contract go ([`Csi::checked`]).
    monitor: Option<Arc<dyn Monitor>>,
    /// The object the calls are about ([`Csi::about`]).
    about: Option<ObjectRef>,
}

/// A reverse call's answer: NotFound is the spec's answer for something already gone,
/// so the reverse is done.
fn done_if_gone<T>(r: Result<T, CsiError>) -> Result<(), CsiError> {
    match r {
        Ok(_) => Ok(()),
        Err(e) if e.is_not_found() => Ok(()),
        Err(e) => Err(e),
    }
}

/// What a CSI request is about, for the span of its call: the volume (the plugin's id,
/// or the name a CreateVolume asks for) and, for controller calls, the CSI node id.
/// Never a secret.
pub trait Target {
    /// The volume, if the request names one.
    fn volume(&self) -> &str {
        ""
    }
    /// The node, if the request names one.
    fn node(&self) -> &str {
        ""
    }
}

macro_rules! targets {
    ($($t:ident => $vol:ident $(, $node:ident)?;)*) => {$(
        impl Target for v1::$t {
            fn volume(&self) -> &str {
                &self.$vol
            }
            $(fn node(&self) -> &str {
                &self.$node
            })?
        }
    )*};
}

targets! {
    CreateVolumeRequest => name;
    DeleteVolumeRequest => volume_id;
    ControllerPublishVolumeRequest => volume_id, node_id;
    ControllerUnpublishVolumeRequest => volume_id, node_id;
    ValidateVolumeCapabilitiesRequest => volume_id;
    ControllerGetVolumeRequest => volume_id;
    ControllerExpandVolumeRequest => volume_id;
    ControllerModifyVolumeRequest => volume_id;
    CreateSnapshotRequest => source_volume_id;
    NodeStageVolumeRequest => volume_id;
    NodeUnstageVolumeRequest => volume_id;
    NodePublishVolumeRequest => volume_id;
    NodeUnpublishVolumeRequest => volume_id;
    NodeGetVolumeStatsRequest => volume_id;
    NodeExpandVolumeRequest => volume_id;
    NodeGetVolumeHealthRequest => volume_id;
    ControllerGetVolumeHealthRequest => volume_id;
}

impl Target for v1::GetSnapshotRequest {}
impl Target for v1::ListSnapshotsRequest {}
impl Target for v1::DeleteSnapshotRequest {}
impl Target for v1::GetCapacityRequest {}
impl Target for v1::ListVolumesRequest {}
impl Target for v1::ControllerListVolumeHealthRequest {}
impl Target for v1::CreateVolumeGroupSnapshotRequest {}
impl Target for v1::DeleteVolumeGroupSnapshotRequest {}
impl Target for v1::GetVolumeGroupSnapshotRequest {}

impl Csi {
    /// A client over `channel` (see [`super::channel`]) under `policy`.
    pub fn new(channel: Channel, policy: Policy) -> Csi {
        Csi {
            channel,
            policy,
            term: None,
            monitor: None,
            about: None,
        }
    }

    /// This client with its answers checked against the contract's rules
    /// ([`contract`]) wherever it is called, each breach reported to `monitor`; the
    /// caller goes on with the answer as given.
    pub fn checked(self, monitor: Arc<dyn Monitor>) -> Csi {
        Csi {
            monitor: Some(monitor),
            ..self
        }
    }

    /// This client's calls are about `object` (a volume, a claim, a snapshot): the
    /// object a breach is reported on (the plugin itself without one).
    pub fn about(self, object: ObjectRef) -> Csi {
        Csi {
            about: Some(object),
            ..self
        }
    }

    /// The monitor this client reports to, if it is checked.
    pub(super) fn monitor(&self) -> Option<&dyn Monitor> {
        self.monitor.as_deref()
    }

    /// Runs `rules` against the monitor, if the client is checked, and reports what
    /// they find.
    async fn check<I>(&self, rules: impl FnOnce(&dyn Monitor) -> I)
    where
        I: IntoIterator<Item = Breach>,
    {
        let Some(monitor) = &self.monitor else {
            return;
        };
        let found: Vec<Breach> = rules(monitor.as_ref()).into_iter().collect();
        if !found.is_empty() {
            monitor.report(self.about.as_ref(), found).await;
        }
    }

    /// This client under `term`: each try of every call is sent only while the term is
    /// held (checked right before it goes), and carries the term's label as the
    /// `moor-term` header and its send time as `moor-sent`.
    pub fn under(self, term: Term) -> Csi {
        Csi {
            term: Some(term),
            ..self
        }
    }

    /// Sends `req` as `rpc` under the policy; `send` makes one try on a fresh client
    /// of the channel.
    ///
    /// The call (with its tries) is a span exported with the caller's trace: `rpc`,
    /// `volume`, `node`, and the answer's `code`.
    async fn call<Q, R, F, Fut>(&self, rpc: &'static str, req: &Q, send: F) -> Result<R, CsiError>
    where
        Q: Clone + Target,
        F: Fn(Channel, tonic::Request<Q>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<R>, tonic::Status>>,
    {
        let span = tracing::info_span!(
            target: "moor::trace",
            "csi",
            otel.name = rpc,
            rpc,
            volume = req.volume(),
            node = req.node(),
            code = tracing::field::Empty,
        );
        let answer = self
            .policy
            .call_gated(rpc, self.term.as_ref(), |t| {
                let mut r = request(req.clone(), t);
                if let Some(v) = self.term.as_ref().and_then(|t| t.label().parse().ok()) {
                    r.metadata_mut().insert(TERM_HEADER, v);
                    // When the try left, by this host's clock: a plugin that serves it
                    // late (paused, overloaded) still tells when it was sent.
                    let sent = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map(|d| d.as_millis() as u64)
                        .unwrap_or_default();
                    if let Ok(v) = sent.to_string().parse() {
                        r.metadata_mut().insert(SENT_HEADER, v);
                    }
                }
                send(self.channel.clone(), r)
            })
            .instrument(span.clone())
            .await;
        let code = match &answer {
            Ok(_) => tonic::Code::Ok,
            Err(e) => e.code,
        };
        span.record("code", format!("{code:?}"));
        answer
    }

    /// CreateVolume.
    pub async fn create_volume(
        &self,
        req: v1::CreateVolumeRequest,
    ) -> Result<v1::CreateVolumeResponse, CsiError> {
        let resp = self
            .call("CreateVolume", &req, |ch, r| async move {
                ControllerClient::new(ch).create_volume(r).await
            })
            .await?;
        if let Some(v) = resp.volume.as_ref().filter(|v| !v.volume_id.is_empty()) {
            self.check(|m| {
                let earlier = m.earlier_id(&req.name, &v.volume_id);
                contract::create_volume(&req, v, earlier.as_deref())
            })
            .await;
        }
        Ok(resp)
    }

    /// DeleteVolume; NotFound is done.
    pub async fn delete_volume(&self, req: v1::DeleteVolumeRequest) -> Result<(), CsiError> {
        done_if_gone(
            self.call("DeleteVolume", &req, |ch, r| async move {
                ControllerClient::new(ch).delete_volume(r).await
            })
            .await,
        )
    }

    /// ControllerPublishVolume.
    pub async fn controller_publish(
        &self,
        req: v1::ControllerPublishVolumeRequest,
    ) -> Result<v1::ControllerPublishVolumeResponse, CsiError> {
        self.call("ControllerPublishVolume", &req, |ch, r| async move {
            ControllerClient::new(ch).controller_publish_volume(r).await
        })
        .await
    }

    /// ControllerUnpublishVolume; NotFound (volume or node gone) is done.
    pub async fn controller_unpublish(
        &self,
        req: v1::ControllerUnpublishVolumeRequest,
    ) -> Result<(), CsiError> {
        done_if_gone(
            self.call("ControllerUnpublishVolume", &req, |ch, r| async move {
                ControllerClient::new(ch)
                    .controller_unpublish_volume(r)
                    .await
            })
            .await,
        )
    }

    /// NodeStageVolume.
    pub async fn node_stage(
        &self,
        req: v1::NodeStageVolumeRequest,
    ) -> Result<v1::NodeStageVolumeResponse, CsiError> {
        self.call("NodeStageVolume", &req, |ch, r| async move {
            NodeClient::new(ch).node_stage_volume(r).await
        })
        .await
    }

    /// NodeUnstageVolume; NotFound is done.
    pub async fn node_unstage(&self, req: v1::NodeUnstageVolumeRequest) -> Result<(), CsiError> {
        done_if_gone(
            self.call("NodeUnstageVolume", &req, |ch, r| async move {
                NodeClient::new(ch).node_unstage_volume(r).await
            })
            .await,
        )
    }

    /// NodePublishVolume.
    pub async fn node_publish(
        &self,
        req: v1::NodePublishVolumeRequest,
    ) -> Result<v1::NodePublishVolumeResponse, CsiError> {
        self.call("NodePublishVolume", &req, |ch, r| async move {
            NodeClient::new(ch).node_publish_volume(r).await
        })
        .await
    }

    /// NodeUnpublishVolume; NotFound is done.
    pub async fn node_unpublish(
        &self,
        req: v1::NodeUnpublishVolumeRequest,
    ) -> Result<(), CsiError> {
        done_if_gone(
            self.call("NodeUnpublishVolume", &req, |ch, r| async move {
                NodeClient::new(ch).node_unpublish_volume(r).await
            })
            .await,
        )
    }
}

impl Csi {
    /// ValidateVolumeCapabilities.
    pub async fn validate_volume_capabilities(
        &self,
        req: v1::ValidateVolumeCapabilitiesRequest,
    ) -> Result<v1::ValidateVolumeCapabilitiesResponse, CsiError> {
        let resp = self
            .call("ValidateVolumeCapabilities", &req, |ch, r| async move {
                ControllerClient::new(ch)
                    .validate_volume_capabilities(r)
                    .await
            })
            .await?;
        self.check(|_| contract::validated(&req, &resp)).await;
        Ok(resp)
    }

    /// ControllerGetVolume (GET_VOLUME).
    pub async fn controller_get_volume(
        &self,
        req: v1::ControllerGetVolumeRequest,
    ) -> Result<v1::ControllerGetVolumeResponse, CsiError> {
        self.call("ControllerGetVolume", &req, |ch, r| async move {
            ControllerClient::new(ch).controller_get_volume(r).await
        })
        .await
    }

    /// ControllerExpandVolume (EXPAND_VOLUME).
    pub async fn controller_expand(
        &self,
        req: v1::ControllerExpandVolumeRequest,
    ) -> Result<v1::ControllerExpandVolumeResponse, CsiError> {
        let resp = self
            .call("ControllerExpandVolume", &req, |ch, r| async move {
                ControllerClient::new(ch).controller_expand_volume(r).await
            })
            .await?;
        let range = req.capacity_range.as_ref();
        let rpc = "ControllerExpandVolume";
        self.check(|_| contract::expanded(rpc, &req.volume_id, range, resp.capacity_bytes))
            .await;
        Ok(resp)
    }

    /// ControllerModifyVolume (MODIFY_VOLUME).
    pub async fn controller_modify(
        &self,
        req: v1::ControllerModifyVolumeRequest,
    ) -> Result<v1::ControllerModifyVolumeResponse, CsiError> {
        self.call("ControllerModifyVolume", &req, |ch, r| async move {
            ControllerClient::new(ch).controller_modify_volume(r).await
        })
        .await
    }

    /// CreateSnapshot (CREATE_DELETE_SNAPSHOT; idempotent by name: asking again is how
    /// a snapshot not yet ready to use is polled).
    pub async fn create_snapshot(
        &self,
        req: v1::CreateSnapshotRequest,
    ) -> Result<v1::CreateSnapshotResponse, CsiError> {
        let resp = self
            .call("CreateSnapshot", &req, |ch, r| async move {
                ControllerClient::new(ch).create_snapshot(r).await
            })
            .await?;
        if let Some(cut) = resp.snapshot.as_ref().filter(|s| !s.snapshot_id.is_empty()) {
            self.check(|_| contract::snapshot_created(&req, cut)).await;
        }
        Ok(resp)
    }

    /// ListSnapshots (LIST_SNAPSHOTS): how a snapshot made outside moor is found by
    /// its id before it is imported.
    pub async fn list_snapshots(
        &self,
        req: v1::ListSnapshotsRequest,
    ) -> Result<v1::ListSnapshotsResponse, CsiError> {
        self.call("ListSnapshots", &req, |ch, r| async move {
            ControllerClient::new(ch).list_snapshots(r).await
        })
        .await
    }

    /// GetSnapshot (GET_SNAPSHOT): how a snapshot not yet ready to use is polled.
    pub async fn get_snapshot(
        &self,
        req: v1::GetSnapshotRequest,
    ) -> Result<v1::GetSnapshotResponse, CsiError> {
        self.call("GetSnapshot", &req, |ch, r| async move {
            ControllerClient::new(ch).get_snapshot(r).await
        })
        .await
    }

    /// DeleteSnapshot; NotFound is done.
    pub async fn delete_snapshot(&self, req: v1::DeleteSnapshotRequest) -> Result<(), CsiError> {
        done_if_gone(
            self.call("DeleteSnapshot", &req, |ch, r| async move {
                ControllerClient::new(ch).delete_snapshot(r).await
            })
            .await,
        )
    }

    /// NodeGetVolumeStats (GET_VOLUME_STATS).
    pub async fn node_get_volume_stats(
        &self,
        req: v1::NodeGetVolumeStatsRequest,
    ) -> Result<v1::NodeGetVolumeStatsResponse, CsiError> {
        self.call("NodeGetVolumeStats", &req, |ch, r| async move {
            NodeClient::new(ch).node_get_volume_stats(r).await
        })
        .await
    }

    /// NodeGetVolumeHealth (node GET_VOLUME_HEALTH, CSI 1.13).
    pub async fn node_get_volume_health(
        &self,
        req: v1::NodeGetVolumeHealthRequest,
    ) -> Result<v1::NodeGetVolumeHealthResponse, CsiError> {
        self.call("NodeGetVolumeHealth", &req, |ch, r| async move {
            NodeClient::new(ch).node_get_volume_health(r).await
        })
        .await
    }

    /// ControllerGetVolumeHealth (GET_VOLUME_HEALTH, CSI 1.13).
    pub async fn controller_get_volume_health(
        &self,
        req: v1::ControllerGetVolumeHealthRequest,
    ) -> Result<v1::ControllerGetVolumeHealthResponse, CsiError> {
        self.call("ControllerGetVolumeHealth", &req, |ch, r| async move {
            ControllerClient::new(ch)
                .controller_get_volume_health(r)
                .await
        })
        .await
    }

    /// ControllerListVolumeHealth (LIST_VOLUME_HEALTH, CSI 1.13), one page.
    pub async fn controller_list_volume_health(
        &self,
        req: v1::ControllerListVolumeHealthRequest,
    ) -> Result<v1::ControllerListVolumeHealthResponse, CsiError> {
        self.call("ControllerListVolumeHealth", &req, |ch, r| async move {
            ControllerClient::new(ch)
                .controller_list_volume_health(r)
                .await
        })
        .await
    }

    /// CreateVolumeGroupSnapshot (CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT).
    pub async fn create_group_snapshot(
        &self,
        req: v1::CreateVolumeGroupSnapshotRequest,
    ) -> Result<v1::CreateVolumeGroupSnapshotResponse, CsiError> {
        let resp = self
            .call("CreateVolumeGroupSnapshot", &req, |ch, r| async move {
                GroupControllerClient::new(ch)
                    .create_volume_group_snapshot(r)
                    .await
            })
            .await?;
        let rpc = "CreateVolumeGroupSnapshot";
        self.check_group(rpc, &req.source_volume_ids, resp.group_snapshot.as_ref())
            .await;
        Ok(resp)
    }

    /// DeleteVolumeGroupSnapshot (CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT).
    pub async fn delete_group_snapshot(
        &self,
        req: v1::DeleteVolumeGroupSnapshotRequest,
    ) -> Result<v1::DeleteVolumeGroupSnapshotResponse, CsiError> {
        self.call("DeleteVolumeGroupSnapshot", &req, |ch, r| async move {
            GroupControllerClient::new(ch)
                .delete_volume_group_snapshot(r)
                .await
        })
        .await
    }

    /// GetVolumeGroupSnapshot (CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT) of a group of
    /// the plugin's volumes `sources` (what its members are checked against: the
    /// request does not name them).
    pub async fn get_group_snapshot(
        &self,
        req: v1::GetVolumeGroupSnapshotRequest,
        sources: &[String],
    ) -> Result<v1::GetVolumeGroupSnapshotResponse, CsiError> {
        let resp = self
            .call("GetVolumeGroupSnapshot", &req, |ch, r| async move {
                GroupControllerClient::new(ch)
                    .get_volume_group_snapshot(r)
                    .await
            })
            .await?;
        self.check_group(
            "GetVolumeGroupSnapshot",
            sources,
            resp.group_snapshot.as_ref(),
        )
        .await;
        Ok(resp)
    }

    /// A group snapshot's answer (with an id: one without is the caller's error) against
    /// the volumes asked.
    async fn check_group(
        &self,
        rpc: &str,
        sources: &[String],
        group: Option<&v1::VolumeGroupSnapshot>,
    ) {
        if let Some(g) = group.filter(|g| !g.group_snapshot_id.is_empty()) {
            self.check(|_| contract::group_snapshot(rpc, sources, g))
                .await;
        }
    }

    /// GetCapacity (GET_CAPACITY).
    pub async fn get_capacity(
        &self,
        req: v1::GetCapacityRequest,
    ) -> Result<v1::GetCapacityResponse, CsiError> {
        let resp = self
            .call("GetCapacity", &req, |ch, r| async move {
                ControllerClient::new(ch).get_capacity(r).await
            })
            .await?;
        self.check(|_| contract::capacity(resp.available_capacity))
            .await;
        Ok(resp)
    }

    /// ListVolumes (LIST_VOLUMES), one page.
    pub async fn list_volumes(
        &self,
        req: v1::ListVolumesRequest,
    ) -> Result<v1::ListVolumesResponse, CsiError> {
        self.call("ListVolumes", &req, |ch, r| async move {
            ControllerClient::new(ch).list_volumes(r).await
        })
        .await
    }

    /// NodeExpandVolume (node EXPAND_VOLUME).
    pub async fn node_expand(
        &self,
        req: v1::NodeExpandVolumeRequest,
    ) -> Result<v1::NodeExpandVolumeResponse, CsiError> {
        let resp = self
            .call("NodeExpandVolume", &req, |ch, r| async move {
                NodeClient::new(ch).node_expand_volume(r).await
            })
            .await?;
        let range = req.capacity_range.as_ref();
        let rpc = "NodeExpandVolume";
        self.check(|_| contract::expanded(rpc, &req.volume_id, range, resp.capacity_bytes))
            .await;
        Ok(resp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    fn failed(code: Code) -> Result<(), CsiError> {
        Err(CsiError {
            rpc: "NodeUnstageVolume",
            code,
            message: String::new(),
            tries: 1,
        })
    }

    #[test]
    fn a_reverse_is_done_when_the_plugin_says_it_is_gone() {
        assert!(done_if_gone(failed(Code::NotFound)).is_ok());
        for code in [
            Code::Internal,
            Code::DeadlineExceeded,
            Code::FailedPrecondition,
        ] {
            assert_eq!(done_if_gone(failed(code)).unwrap_err().code, code);
        }
    }
}
