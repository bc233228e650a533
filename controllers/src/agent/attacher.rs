//! The attacher: ControllerPublish / ControllerUnpublish for the Attachments of one
//! plugin, run by the agent leading that plugin's election.
//!
//! Expected flow for an Attachment (created by the controller, one per volume + node):
//! 1. Not attached: record the attempt as uncertain, call ControllerPublish with the
//!    external volume id and the CSI node id; on success record Attached and the
//!    publish_context. A timeout or cut-off leaves it uncertain; a final error leaves
//!    what was known before.
//! 2. `spec.detach` (set by the controller once no claim on the node needs it):
//!    ControllerUnpublish if it is or may be attached (Attached, Detaching, or an
//!    uncertain publish); Detached is reported only after it returned OK or NotFound,
//!    and the controller then deletes the Attachment.
//! 3. A failed call is recorded (`last_error`, `retry`) and tried again on its step's
//!    schedule ([`moor::runtime::steps`]): the status write does not bring the retry
//!    forward.
//!
//! What is recorded goes to this plugin's report on the attachment
//! ([`AttachmentReport`], [`super::reports`]), never to the Attachment, which the
//! controller alone writes (it copies the report into the Attachment's status).
//!
//! One controller call per volume at a time (a lock shared with the provisioner); with
//! the plugin's `serialize-per-node`, also one ControllerPublish/Unpublish per node at a
//! time (taken after the volume's lock, around the call only).

use moor::api::*;
use moor::csi::requests;
use moor::runtime::controller::{Action, Config, Controller};
use moor::runtime::informer::Informer;
use moor::runtime::metrics::ControllerMetrics;
use moor::runtime::steps;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

use super::volume_view::VolumeView;
use crate::agent::context::ControllerPluginCtx;
use crate::common::{details, object_ref};

/// Why an attachment could not be converged.
pub type AttachError = crate::agent::step_error::StepError;

/// The attacher of one plugin.
pub struct Attacher {
    /// Shared with the provisioner.
    pub ctx: ControllerPluginCtx,
    /// Volumes (secrets, context).
    pub volumes: Informer<VolumeView>,
    /// Attachments.
    pub attachments: Informer<Attachment>,
    /// This plugin's reports on them.
    pub reports: super::reports::Reports<AttachmentSpec>,
}

impl Attacher {
    /// Runs until `stop`.
    pub async fn run(self, metrics: ControllerMetrics, stop: CancellationToken) {
        let reader = self.attachments.reader();
        let events = self.attachments.subscribe();
        let secrets = self.ctx.secrets.subscribe();
        let reports = self.reports.cache.subscribe();
        let (volumes, attachments) = (self.volumes.reader(), reader.clone());
        let plugin = self.ctx.plugin.id.clone();
        let this = Arc::new(self);
        Controller::new("attacher", reader, Config::default())
            .with_metrics(metrics)
            .owns(events)
            // A report whose attachment is gone is deleted by the attachment's pass.
            .watches(reports, |r: &AttachmentReport| {
                r.about_key().into_iter().collect()
            })
            // A Secret made or rotated: the attachments of the volumes that name it.
            .watches(secrets, move |s: &Secret| {
                let named: std::collections::HashSet<ObjectKey<VolumeSpec>> =
                    ControllerPluginCtx::naming(&volumes, &plugin, s)
                        .into_iter()
                        .collect();
                attachments
                    .state()
                    .iter()
                    .filter(|a| {
                        named.contains(&Volume::key_for(&a.metadata.namespace, &a.spec.volume))
                    })
                    .map(|a| a.object_key())
                    .collect()
            })
            .run(
                |this: Arc<Self>, key| async move {
                    moor::runtime::steps::requeue_backing_off(
                        this.reconcile(key).await,
                        AttachError::backing_off,
                    )
                },
                this,
                stop,
            )
            .await;
    }

    async fn reconcile(&self, key: ObjectKey<AttachmentSpec>) -> Result<Action, AttachError> {
        let reader = self.attachments.reader();
        reader.wait_until_ready().await;
        self.reports.cache.reader().wait_until_ready().await;
        let Some(att) = reader.get(key.as_str()) else {
            self.reports.forget(&key).await?;
            return Ok(Action::AwaitChange);
        };
        if att.spec.plugin_id != self.ctx.plugin.id {
            // Edited onto another plugin (only an older build's agent could): this
            // plugin's report on it, if any, is no longer about it.
            self.reports.forget(&key).await?;
            return Ok(Action::AwaitChange);
        }
        let _guard = self
            .ctx
            .locks
            .lock(Volume::key_for(&att.metadata.namespace, &att.spec.volume).as_str())
            .await;
        // The cache may lag our own last write: then act on what etcd holds now.
        let Some(att) = self.ctx.writer.fresh(&reader, &att.object_key()).await? else {
            return Ok(Action::AwaitChange);
        };
        let att = self.reports.reported(&att).await?;
        // A step of the trace of the claim the attachment was made for.
        let span = moor::telemetry::step_span(
            "attach",
            key.as_str(),
            att.spec.volume.as_str(),
            att.spec.node.as_str(),
            att.metadata.trace.as_deref(),
        );
        let step = async {
            if att.spec.detach {
                self.detach(&att).await
            } else if att.status.phase != AttachmentPhase::Attached {
                self.attach(&att).await
            } else {
                Ok(Action::AwaitChange)
            }
        };
        tracing::Instrument::instrument(step, span).await
    }

    fn volume(&self, att: &Attachment) -> Option<Arc<VolumeView>> {
        self.volumes
            .reader()
            .get(&Volume::key_for(&att.metadata.namespace, &att.spec.volume))
    }

    /// The fingerprint of what the attachment's steps depend on: its spec and the
    /// plugin's fingerprint. The attacher's own status writes change neither.
    fn inputs(&self, att: &Attachment) -> u64 {
        steps::inputs((
            &att.metadata.uid,
            att.metadata.generation,
            self.ctx.supervisor.epoch(),
        ))
    }

    async fn attach(&self, att: &Attachment) -> Result<Action, AttachError> {
        let key = att.key();
        let step = self
            .ctx
            .steps
            .begin(&key, "ControllerPublishVolume", self.inputs(att))?;
        let was_uncertain = att.status.uncertain;
        let vol = (self.ctx)
            .attach_inputs(self.volume(att).as_deref(), SecretFamily::Controller)
            .await?;
        let req = requests::controller_publish(att, vol.as_ref(), self.ctx.multi_writer_cap())?;
        // Checkpoint: from here on the volume may be attached.
        let att = &self
            .reports
            .write(att, None, |st| st.uncertain = true)
            .await?;
        let csi = self.ctx.csi()?;
        let call = step.call(csi.controller_publish(req));
        match self
            .ctx
            .in_node_turn(att.spec.csi_node_id.as_str(), call)
            .await
        {
            Ok(resp) => {
                self.reports
                    .write(att, None, |st| {
                        st.phase = AttachmentPhase::Attached;
                        st.publish_context = resp.publish_context.clone().into();
                        st.uncertain = false;
                        st.meta.clear_failure();
                        st.meta.set_condition("Attached", true, "Published", "");
                    })
                    .await?;
                self.event(att, "Attach volume", None).await;
                Ok(Action::AwaitChange)
            }
            Err(failed) => {
                let uncertain = was_uncertain || failed.is_uncertain();
                let msg = failed.message();
                self.reports
                    .write(att, None, |st| {
                        st.uncertain = uncertain;
                        failed.record(&mut st.meta);
                        st.meta
                            .set_condition("Attached", false, "PublishFailed", &msg);
                    })
                    .await?;
                self.event(att, "Attach volume", Some(msg)).await;
                Ok(Action::Requeue(failed.retry_in))
            }
        }
    }

    /// ControllerUnpublish when the volume is or may be attached (Attached, a detach
    /// under way, or an uncertain publish), then the Attachment is deleted: only after
    /// an OK (or NotFound: the volume or node is gone). Any other answer keeps the
    /// Attachment, so the reverse stays owed and is retried on the step's schedule.
    async fn detach(&self, att: &Attachment) -> Result<Action, AttachError> {
        if !owes_unpublish(&att.status) {
            return self.detached(att).await;
        }
        // Another volume naming the same plugin volume (a second registration, one
        // shared with another namespace) still has it published to this node, and
        // owes that ControllerUnpublish itself: this one would pull the volume from
        // under its claims. Only this attachment goes.
        if self.attached_for_another(att) {
            // "volume kept attached on node N": another volume's claims use it there.
            self.event(att, "Volume kept attached", None).await;
            return self.detached(att).await;
        }
        let key = att.key();
        let step = self
            .ctx
            .steps
            .begin(&key, "ControllerUnpublishVolume", self.inputs(att))?;
        let vol = (self.ctx)
            .attach_inputs(self.volume(att).as_deref(), SecretFamily::Controller)
            .await?;
        let req = requests::controller_unpublish(att, vol.as_ref())?;
        // No checkpoint before the call: Attached is owed a ControllerUnpublish as much
        // as Detaching is, and `spec.detach` is final (no claim is granted on this
        // attachment again), so a crash mid-call repeats the call either way. Detaching
        // is written when the call fails, with the failure.
        let csi = self.ctx.csi()?;
        let call = step.call(csi.controller_unpublish(req));
        if let Err(failed) = self
            .ctx
            .in_node_turn(att.spec.csi_node_id.as_str(), call)
            .await
        {
            self.reports
                .write(att, None, |st| {
                    st.phase = AttachmentPhase::Detaching;
                    failed.record(&mut st.meta);
                })
                .await?;
            self.event(att, "Detach volume", Some(failed.message()))
                .await;
            return Ok(Action::Requeue(failed.retry_in));
        }
        self.event(att, "Detach volume", None).await;
        self.detached(att).await
    }

    /// Whether another attachment of the same plugin volume to the same node, not
    /// itself detaching, owes a ControllerUnpublish of it.
    fn attached_for_another(&self, att: &Attachment) -> bool {
        let key = att.key();
        self.attachments
            .reader()
            .by_index(BY_PLUGIN_VOLUME.0, &plugin_volume(att))
            .iter()
            .any(|other| {
                other.key() != key
                    && other.spec.csi_node_id == att.spec.csi_node_id
                    && !other.spec.detach
                    && !other.is_deleting()
                    && owes_unpublish(&self.reports.cached(other))
            })
    }

    /// Reports the attachment detached (nothing of it is published to its node any
    /// more, or another attachment keeps what is): the controller deletes it.
    async fn detached(&self, att: &Attachment) -> Result<Action, AttachError> {
        self.ctx.steps.forget(&att.key());
        self.reports
            .write(att, None, |st| {
                st.phase = AttachmentPhase::Detached;
                st.uncertain = false;
                st.meta.clear_failure();
            })
            .await?;
        Ok(Action::AwaitChange)
    }

    async fn event(&self, att: &Attachment, reason: &str, error: Option<String>) {
        let (type_, message) = match &error {
            None => (
                EventType::Normal,
                format!("{} on node {}", reason.to_lowercase(), att.spec.node),
            ),
            Some(e) => (
                EventType::Warning,
                format!(
                    "{} on node {} failed: {e}",
                    reason.to_lowercase(),
                    att.spec.node
                ),
            ),
        };
        let d = details([
            ("volume_id", att.spec.volume.to_string()),
            ("node", att.spec.node.to_string()),
            ("success", error.is_none().to_string()),
            ("error", error.unwrap_or_default()),
        ]);
        self.ctx
            .recorder
            .record(object_ref(att), type_, reason, message, d)
            .await;
    }
}

/// The attachments of one plugin volume (its plugin and id), whichever volume object
/// names it: the attacher detaches a plugin volume from a node only when none of them
/// still needs it there.
pub const BY_PLUGIN_VOLUME: moor::runtime::reflector::Index<Attachment> =
    ("plugin-volume", |a| vec![plugin_volume(a)]);

fn plugin_volume(a: &Attachment) -> String {
    format!("{}\n{}", a.spec.plugin_id, a.spec.external_id)
}

/// Whether an attachment with status `st` has its plugin volume (or may) published to
/// its node (Attached, a detach under way, or an uncertain publish): a
/// ControllerUnpublish is owed.
fn owes_unpublish(st: &AttachmentStatus) -> bool {
    matches!(
        st.phase,
        AttachmentPhase::Attached | AttachmentPhase::Detaching
    ) || st.uncertain
}
