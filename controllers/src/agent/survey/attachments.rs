//! The survey's look at attachments: those the plugin no longer lists as published
//! (set back to Pending after two passes) and unknown ones unpublished when asked to.

use moor::api::*;
use std::collections::{BTreeMap, BTreeSet};

use crate::agent::volume_view::VolumeView;
use moor::runtime::Resource;

use super::volumes::Listed;
use super::Survey;

impl Survey {
    /// Attachments moor holds Attached that the plugin no longer lists as published
    /// to their node (LIST_VOLUMES_PUBLISHED_NODES): those found in the previous pass
    /// too are published again ([`Survey::reattach`]). Returns this pass's findings, by
    /// attachment key. Called only once the plugin has filled some volume's published
    /// nodes in a pass: from a plugin that never does, an empty list proves nothing.
    pub(super) async fn absent(
        &self,
        caps: &PluginCapabilities,
        listed: &BTreeMap<String, Listed>,
        absent_before: &BTreeSet<String>,
    ) -> BTreeSet<String> {
        let mut absent = BTreeSet::new();
        if !caps
            .controller
            .has(ControllerRpc::ListVolumesPublishedNodes)
        {
            return absent;
        }
        for att in self.attachments.reader().state() {
            let mut att = (*att).clone();
            att.status = self.reports.cached(&att);
            if !held(&att, &self.ctx.plugin.id) {
                continue;
            }
            // A volume missing from the list altogether is the volume's finding
            // (`Present`), not the attachment's.
            let Some(entry) = listed.get(att.spec.external_id.as_str()) else {
                continue;
            };
            if entry.published.contains(att.spec.csi_node_id.as_str()) {
                continue;
            }
            let key = att.key();
            if absent_before.contains(&key) {
                self.reattach(&att).await;
            }
            absent.insert(key);
        }
        absent
    }

    /// Sets an attachment the plugin no longer lists back to Pending, so the attacher
    /// publishes it again: under the volume's controller lock, on the attachment as
    /// stored now, only while it is still held Attached.
    pub(super) async fn reattach(&self, att: &Attachment) {
        let _guard = self
            .ctx
            .locks
            .lock(Volume::key_for(&att.metadata.namespace, &att.spec.volume).as_str())
            .await;
        let reader = self.attachments.reader();
        let stored = match self.ctx.writer.fresh(&reader, &att.object_key()).await {
            Ok(Some(att)) => self.reports.reported(&att).await.map(Some),
            other => other.map(|_| None),
        };
        let att = match stored {
            Ok(Some(att)) if held(&att, &self.ctx.plugin.id) => att,
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(attachment = %att.key(), error = %e, "survey read");
                return;
            }
        };
        let msg = format!(
            "plugin {} no longer lists volume {} as published to node {} ({}); publishing it again",
            self.ctx.plugin.id, att.spec.external_id, att.spec.node, att.spec.csi_node_id
        );
        let r = self
            .reports
            .write(&att, None, |st| {
                st.phase = AttachmentPhase::Pending;
                st.meta
                    .set_condition("Attached", false, "NotListedByPlugin", &msg);
            })
            .await;
        if let Err(e) = r {
            tracing::warn!(attachment = %att.key(), error = %e, "survey write");
            return;
        }
        // Where an operator looks: the volume's events (`describe volume`), and the
        // attachment's condition.
        let vol_key = Volume::key_for(&att.metadata.namespace, &att.spec.volume);
        match self.volumes.reader().get(&vol_key) {
            Some(vol) => {
                let vol = vol.object_ref();
                self.event(&vol, "Detached behind moor's back", EventType::Warning, msg)
                    .await
            }
            None => {
                let d = crate::common::details([
                    ("volume_id", att.spec.volume.to_string()),
                    ("node", att.spec.node.to_string()),
                ]);
                self.ctx
                    .recorder
                    .record(
                        crate::common::object_ref(&att),
                        EventType::Warning,
                        "Detached behind moor's back",
                        msg,
                        d,
                    )
                    .await;
            }
        }
    }

    /// ControllerUnpublishVolume of an attachment moor does not know (opted in): with
    /// the volume's secrets, or not at all while they cannot be opened (a Warning says
    /// why; the next pass looks again); on the step runner's schedule, per volume and
    /// node, so a plugin failing it is not called every pass.
    pub(super) async fn unpublish(&self, vol: &VolumeView, ext: &str, node: &str) {
        let inputs = self
            .ctx
            .attach_inputs(Some(vol), SecretFamily::Controller)
            .await;
        let built = match inputs {
            Ok(v) => moor::csi::requests::controller_unpublish_of(ext, node, v.as_ref())
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        let vol_ref = vol.object_ref();
        let req = match built {
            Ok(req) => req,
            Err(e) => {
                let msg = format!("not unpublishing {ext} from node {node}: {e}");
                self.event(&vol_ref, "Unknown attachment kept", EventType::Warning, msg)
                    .await;
                return;
            }
        };
        let key = format!("{}@{node}", vol.key());
        let inputs = moor::runtime::steps::inputs((ext, node, vol.generation));
        let Ok(step) = self
            .ctx
            .steps
            .begin(&key, "ControllerUnpublishVolume", inputs)
        else {
            return; // backing off after a failure; a later pass tries again
        };
        let r = match self.ctx.csi() {
            Ok(csi) => self
                .ctx
                .in_node_turn(node, step.call(csi.controller_unpublish(req)))
                .await
                .map_err(|f| f.message()),
            Err(e) => Err(e.to_string()),
        };
        let (type_, msg) = match r {
            Ok(()) => (
                EventType::Normal,
                format!("{ext} unpublished from node {node}, where moor had no attachment"),
            ),
            Err(e) => (
                EventType::Warning,
                format!("unpublishing {ext} from node {node}: {e}"),
            ),
        };
        self.event(&vol_ref, "Unknown attachment unpublished", type_, msg)
            .await;
    }
}

/// An attachment of `plugin` moor holds Attached and does not mean to detach.
fn held(att: &Attachment, plugin: &PluginId) -> bool {
    &att.spec.plugin_id == plugin
        && att.status.phase == AttachmentPhase::Attached
        && !att.spec.detach
        && !att.is_deleting()
}
