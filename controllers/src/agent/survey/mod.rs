//! The survey of a controller plugin, run by the agent leading it every
//! `--survey-interval`: what the plugin says against what moor holds. Nothing is ever
//! deleted here; what differs is shown (conditions, Warning events) and, only where an
//! operator opted in, an unknown attachment is unpublished.
//!
//! Expected flow of one pass:
//! 1. GET_CAPACITY: GetCapacity for the plugin as a whole and, with
//!    VOLUME_ACCESSIBILITY_CONSTRAINTS, for each segment its volumes require; recorded in
//!    the plugin's capacity key (`capacities/ID`) and handed to the provisioner, which refuses a
//!    CreateVolume that fits nowhere (and looks again after each pass).
//! 2. LIST_VOLUMES: every page of ListVolumes (a failed page ends the pass: no
//!    conclusion from half a list); without it, with GET_VOLUME, ControllerGetVolume of
//!    each Ready volume (NotFound counts as not listed). A Ready volume of this plugin missing from two
//!    lists in a row gets condition `Present` false and a `Volume missing` Warning; back
//!    in the list, `Present` true. One the plugin created for moor (not registered) is
//!    also the plugin's breach of the contract (volume_not_listed): the typed client
//!    checks its whole listing against what moor expects (`Csi::list_every_volume`,
//!    `Csi::get_every_volume`) and reports it, about the volume.
//! 3. Health: from a CSI 1.13 plugin, every page of ControllerListVolumeHealth
//!    (LIST_VOLUME_HEALTH; a volume it leaves out is healthy once two lists in a row
//!    leave it out, since a paged list may skip an entry) or ControllerGetVolumeHealth
//!    of each listed volume (GET_VOLUME_HEALTH); from a 1.9-1.12 plugin, the condition
//!    ListVolumes or ControllerGetVolume carries (VOLUME_CONDITION). It becomes the
//!    volume's `Healthy` condition; turning abnormal (or abnormal otherwise) is a
//!    `Volume abnormal` Warning, healthy again a `Volume healthy` event.
//! 4. LIST_VOLUMES_PUBLISHED_NODES: a node the plugin says a volume is published to,
//!    where moor has no Attachment of it, seen in two lists in a row, is condition
//!    `Attachments` false and an `Unknown attachment` Warning; with
//!    `--unpublish-unknown-attachments` it is also ControllerUnpublishVolume'd.
//! 5. The other way (detached behind moor's back: a console, a script, a plugin that
//!    lost its attachments): an Attachment moor holds Attached, not being detached,
//!    whose node the plugin no longer lists for its volume in two lists in a row, is
//!    set back to Pending with condition `Attached` false (`NotListedByPlugin`) and a
//!    `Detached behind moor's back` Warning; the attacher then ControllerPublishes it
//!    again. Nothing is unpublished. A plugin that has not yet listed a published node
//!    for any volume since the agent started surveying it (it advertises the
//!    capability but does not fill the field) is left alone.
//!
//! Steps 2-4 are decided per volume by `volumes::judge` (pure); the pass carries its
//! finding out.
//!
//! # Layout
//! - `capacity`: GetCapacity, whole and per required segment (step 1).
//! - `snapshots`: every page of ListSnapshots, kept for `moorctl volume snapshot list`.
//! - `volumes`: ListVolumes (or ControllerGetVolume of each), the health RPCs, the pure
//!   judgement of each volume and the volumes the plugin has that moor does not (steps
//!   2-4).
//! - `attachments`: attachments the plugin no longer lists, set back to Pending, and
//!   unknown attachments unpublished when asked to (steps 4-5).

use moor::api::*;
use moor::csi::contract::Expected;
use moor::runtime::informer::Informer;
use std::collections::BTreeSet;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

use super::volume_view::VolumeView;
use crate::agent::context::ControllerPluginCtx;
use moor::runtime::Resource;

mod attachments;
mod capacity;
mod snapshots;
mod volumes;

/// Condition: the plugin lists the volume.
pub const PRESENT: &str = "Present";
/// Condition: the plugin's view of the volume's health.
pub const HEALTHY: &str = "Healthy";
/// Condition: no attachment the plugin reports is unknown to moor.
pub const ATTACHMENTS: &str = "Attachments";

/// The survey of one plugin.
pub struct Survey {
    /// Shared with the provisioner.
    pub ctx: ControllerPluginCtx,
    /// Volumes.
    pub volumes: Informer<VolumeView>,
    /// Attachments.
    pub attachments: Informer<Attachment>,
    /// This plugin's reports on them (their status as the attacher keeps it).
    pub reports: crate::agent::reports::Reports<AttachmentSpec>,
    /// This plugin's reports on its volumes (the conditions it finds are written
    /// there).
    pub volume_reports: crate::agent::reports::Reports<VolumeSpec>,
    /// How often.
    pub every: Duration,
    /// `--unpublish-unknown-attachments`.
    pub unpublish_unknown: bool,
}

impl Survey {
    /// Runs a pass every `every` until `stop`.
    pub async fn run(self, stop: CancellationToken) {
        let mut tick = tokio::time::interval(self.every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // What the previous pass found (missing volumes, unknown attachments): a
        // finding acts only when two passes in a row agree.
        let mut missing_before = BTreeSet::new();
        let mut unknown_before = BTreeSet::new();
        let mut absent_before = BTreeSet::new();
        let mut strangers_before = BTreeSet::new();
        // Whether the plugin has filled any volume's published nodes in a pass yet.
        let mut fills_published = false;
        // The volumes the previous ControllerListVolumeHealth listed.
        let mut health_before = BTreeSet::new();
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            self.volumes.reader().wait_until_ready().await;
            self.attachments.reader().wait_until_ready().await;
            let Some(caps) = self
                .ctx
                .supervisor
                .status(&self.ctx.plugin.id)
                .filter(|s| !s.capabilities.plugin.is_empty())
                .map(|s| s.capabilities)
            else {
                continue;
            };
            if caps.controller.has(ControllerRpc::GetCapacity) {
                if let Err(e) = self.capacity(&caps).await {
                    tracing::warn!(plugin = %self.ctx.plugin.id, error = %moor::process::error_chain(&*e), "GetCapacity survey");
                }
            }
            if caps.controller.has(ControllerRpc::ListSnapshots) {
                if let Err(e) = self.snapshots().await {
                    tracing::warn!(plugin = %self.ctx.plugin.id, error = %moor::process::error_chain(&*e), "ListSnapshots survey");
                }
            }
            let lists_all = caps.controller.has(ControllerRpc::ListVolumes);
            let made = self.made();
            let expected = Expected {
                made: &made,
                missing_before: &missing_before,
            };
            let listing = if lists_all {
                Some(self.list(expected).await)
            } else if caps.controller.has(ControllerRpc::GetVolume) {
                Some(self.get_each(expected).await)
            } else {
                None
            };
            if let Some(listing) = listing {
                match listing {
                    Ok(mut listed) => {
                        health_before = self.health(&caps, &mut listed, &health_before).await;
                        let (missing, unknown) = self
                            .compare(&caps, &listed, &missing_before, &unknown_before)
                            .await;
                        missing_before = missing;
                        unknown_before = unknown;
                        // Only a whole ListVolumes shows volumes moor does not know.
                        if lists_all {
                            strangers_before = self.strangers(&listed, &strangers_before).await;
                        }
                        fills_published |= listed.values().any(|l| !l.published.is_empty());
                        absent_before = if fills_published {
                            self.absent(&caps, &listed, &absent_before).await
                        } else {
                            BTreeSet::new()
                        };
                    }
                    Err(e) => {
                        tracing::warn!(plugin = %self.ctx.plugin.id, error = %e, "ListVolumes survey");
                    }
                }
            }
        }
    }

    /// Sets conditions on the volume's provisioning section and records the Warnings.
    async fn write(
        &self,
        vol: &VolumeView,
        set: Vec<(&'static str, bool, String, String)>,
        warn: Vec<(&'static str, String)>,
        normal: Vec<(&'static str, String)>,
    ) {
        if !set.is_empty() {
            // Into this plugin's report on the volume, written from the whole volume
            // (a view is not a base to write from): the view's own while it keeps
            // it, else this process's last write or a read.
            let (reader, key) = (self.volumes.reader(), vol.object_key());
            let whole = self.ctx.writer.current(&reader, &key, vol.whole.clone());
            let r = match whole.await {
                Ok(Some(whole)) if whole.spec.plugin_id == self.ctx.plugin.id => self
                    .volume_reports
                    .write(&whole, None, |p| {
                        for (t, status, reason, msg) in &set {
                            p.meta.set_condition(t, *status, reason, msg);
                        }
                    })
                    .await
                    .map(|_| ()),
                Ok(_) => Ok(()),
                Err(e) => Err(e),
            };
            if let Err(e) = r {
                tracing::warn!(volume = %vol.key(), error = %e, "survey write");
            }
        }
        let vol = vol.object_ref();
        for (reason, msg) in warn {
            self.event(&vol, reason, EventType::Warning, msg).await;
        }
        for (reason, msg) in normal {
            self.event(&vol, reason, EventType::Normal, msg).await;
        }
    }

    async fn event(&self, vol: &ObjectRef, reason: &str, type_: EventType, message: String) {
        self.ctx.volume_event(vol, reason, type_, message).await;
    }
}
