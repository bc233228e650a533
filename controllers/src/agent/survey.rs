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
//!    in the list, `Present` true.
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
//! Steps 2-4 are decided per volume by [`judge`] (pure); the pass carries its
//! [`Finding`] out.

use moor::api::*;
use moor::csi::v1;
use moor::runtime::informer::Informer;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

use super::volume_view::VolumeView;
use super::ControllerPluginCtx;
use moor::runtime::Resource;

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
    /// How often.
    pub every: Duration,
    /// `--unpublish-unknown-attachments`.
    pub unpublish_unknown: bool,
}

/// What one ListVolumes said of a volume.
struct Listed {
    published: BTreeSet<String>,
    condition: Option<VolumeHealth>,
    capacity_bytes: u64,
}

/// The VolumeCondition of a 1.9-1.12 plugin, as moor keeps health.
fn legacy(c: Option<v1::VolumeCondition>) -> Option<VolumeHealth> {
    c.map(|c| VolumeHealth {
        abnormal: c.abnormal,
        message: printable_bounded(&c.message, 1024),
        conditions: Vec::new(),
    })
}

/// What a survey pass goes by, besides the volume and its listing.
struct Seen<'a> {
    plugin: &'a PluginId,
    /// The plugin reports volume health (VOLUME_CONDITION, or the 1.13 health RPCs).
    with_condition: bool,
    /// The plugin lists the nodes each volume is published to.
    with_nodes: bool,
    /// The volumes the previous pass found missing.
    missing_before: &'a BTreeSet<String>,
    /// The attachments (volume key, CSI node id) the previous pass found unknown.
    unknown_before: &'a BTreeSet<(String, String)>,
}

/// What one pass found of one volume, and what it does about it.
#[derive(Debug, Default, PartialEq)]
struct Finding {
    /// The plugin does not list it.
    missing: bool,
    /// Unlisted two passes in a row, and moor created it: a breach of the contract.
    breach: bool,
    /// CSI node ids the plugin says it is published to where moor has no attachment.
    strangers: Vec<String>,
    /// Those of `strangers` the previous pass found too.
    confirmed: Vec<String>,
    /// Conditions to set on the volume's provisioning section: type, status, reason,
    /// message.
    set: Vec<(&'static str, bool, String, String)>,
    /// Warnings to record: reason, message.
    warn: Vec<(&'static str, String)>,
    /// Normal events to record: reason, message.
    normal: Vec<(&'static str, String)>,
}

/// Judges one ready volume (external id `ext`) against what ListVolumes said of it
/// (`entry`) and the CSI node ids moor attached it to (`ours`). A finding acts only
/// when two passes in a row agree; a condition is written only when it changes.
fn judge(
    seen: &Seen<'_>,
    vol: &VolumeView,
    ext: &str,
    entry: Option<&Listed>,
    ours: &BTreeSet<String>,
) -> Finding {
    let mut f = Finding::default();
    let cond = |t: &str| vol.condition(t);
    let Some(entry) = entry else {
        f.missing = true;
        let again = seen.missing_before.contains(ext);
        if again && cond(PRESENT).is_none_or(|c| c.status) {
            let msg = format!("plugin {} does not list volume {ext}", seen.plugin);
            f.set
                .push((PRESENT, false, "MissingFromPlugin".into(), msg.clone()));
            f.warn.push(("Volume missing", msg));
        }
        // One it created for moor and was never asked to delete.
        f.breach = again && vol.registered_id().is_none();
        return f;
    };
    if cond(PRESENT).is_some_and(|c| !c.status) {
        f.set.push((PRESENT, true, "Listed".into(), String::new()));
    }
    if let Some(c) = entry.condition.as_ref().filter(|_| seen.with_condition) {
        let shown = cond(HEALTHY);
        let healthy = !c.abnormal;
        if shown.is_none_or(|s| s.status != healthy || s.message != c.message)
            && (!healthy || shown.is_some())
        {
            let reason = if healthy { "Normal" } else { "VolumeAbnormal" };
            f.set
                .push((HEALTHY, healthy, reason.into(), c.message.clone()));
            if !healthy {
                f.warn
                    .push(("Volume abnormal", format!("{ext}: {}", c.message)));
            } else if shown.is_some_and(|s| !s.status) {
                f.normal
                    .push(("Volume healthy", format!("{ext}: healthy again")));
            }
        }
    }
    if !seen.with_nodes {
        return f;
    }
    f.strangers = entry
        .published
        .iter()
        .filter(|n| !ours.contains(*n))
        .cloned()
        .collect();
    f.confirmed = f
        .strangers
        .iter()
        .filter(|n| seen.unknown_before.contains(&(vol.key(), (*n).clone())))
        .cloned()
        .collect();
    let shown = cond(ATTACHMENTS);
    if f.confirmed.is_empty() {
        if shown.is_some_and(|s| !s.status) {
            f.set
                .push((ATTACHMENTS, true, "Known".into(), String::new()));
        }
        return f;
    }
    let msg = format!(
        "plugin {} reports {ext} published to node(s) {} where moor has no attachment",
        seen.plugin,
        f.confirmed.join(", ")
    );
    if shown.is_none_or(|s| s.status || s.message != msg) {
        f.set
            .push((ATTACHMENTS, false, "UnknownAttachment".into(), msg.clone()));
        f.warn.push(("Unknown attachment", msg));
    }
    f
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
            let listing = if lists_all {
                Some(self.list().await)
            } else if caps.controller.has(ControllerRpc::GetVolume) {
                Some(self.get_each().await)
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

    /// Every page of ListSnapshots (the plugin's own snapshots, moor's or not), kept in
    /// the plugin's snapshot list key for `moorctl volume snapshot list --plugin`: the
    /// first [`MAX_LISTED_SNAPSHOTS`], and how many more. Written when it changed.
    async fn snapshots(&self) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let csi = self.ctx.csi()?;
        let mut list = PluginSnapshots::default();
        let mut token = String::new();
        // Bounded however the plugin pages: a plugin that repeats a token ends the list.
        for _ in 0..1024 {
            let page = csi
                .list_snapshots(v1::ListSnapshotsRequest {
                    starting_token: token.clone(),
                    ..Default::default()
                })
                .await?;
            for e in page.entries {
                let Some(s) = e.snapshot else { continue };
                if list.snapshots.len() >= MAX_LISTED_SNAPSHOTS {
                    list.more += 1;
                    continue;
                }
                list.snapshots.push(ListedSnapshot {
                    snapshot_id: printable_bounded(&s.snapshot_id, 128),
                    source_volume_id: printable_bounded(&s.source_volume_id, 128),
                    size_bytes: u64::try_from(s.size_bytes).unwrap_or(0),
                    created_secs: s.creation_time.map(|t| t.seconds),
                    ready: s.ready_to_use,
                });
            }
            if page.next_token.is_empty() || page.next_token == token {
                break;
            }
            token = page.next_token;
        }
        let id = &self.ctx.plugin.id;
        if !matches!(self.ctx.reads.snapshot_list(id).await, Ok(Some(ref known)) if *known == list)
        {
            self.ctx.writer.store().put_snapshot_list(id, &list).await?;
        }
        Ok(())
    }

    /// GetCapacity, whole and per required segment; recorded on the Plugin and shared
    /// with the provisioner.
    async fn capacity(
        &self,
        caps: &PluginCapabilities,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let mut segments: BTreeSet<Topology> = BTreeSet::new();
        segments.insert(Topology::new());
        if caps.plugin.has(PluginCapability::Service(
            PluginService::VolumeAccessibilityConstraints,
        )) {
            // Each node instance's segment, where a template's volume would be made.
            let plugin = self
                .ctx
                .reads
                .try_get(&Plugin::key_for(&self.ctx.plugin.id))
                .await
                .ok()
                .flatten();
            for t in plugin
                .iter()
                .flat_map(|p| p.status.instances.values())
                .filter_map(|i| i.topology.as_ref())
            {
                if segments.len() < 64 {
                    segments.insert(t.clone());
                }
            }
            for v in self.volumes.reader().state() {
                for t in v.required_topology() {
                    if segments.len() < 64 {
                        segments.insert(t.clone());
                    }
                }
            }
        }
        let csi = self.ctx.csi()?;
        let mut entries = Vec::new();
        for t in segments {
            let req = v1::GetCapacityRequest {
                volume_capabilities: Vec::new(),
                parameters: Default::default(),
                accessible_topology: (!t.is_empty()).then(|| moor::csi::convert::topology(&t)),
            };
            let r = csi.get_capacity(req).await?;
            let breach = moor::csi::contract::capacity(r.available_capacity);
            if breach.is_some() {
                let plugin = ObjectRef {
                    kind: "Plugin".into(),
                    namespace: Default::default(),
                    name: Name::new(self.ctx.plugin.id.as_str()).unwrap_or_default(),
                };
                self.ctx
                    .monitor
                    .report(&self.ctx.plugin.id, &plugin, breach)
                    .await;
            }
            let size = |v: Option<i64>| v.and_then(|v| u64::try_from(v).ok()).filter(|v| *v > 0);
            entries.push(CapacityEntry {
                topology: t,
                available_bytes: u64::try_from(r.available_capacity).unwrap_or(0),
                maximum_volume_size: size(r.maximum_volume_size),
                minimum_volume_size: size(r.minimum_volume_size),
            });
        }
        // Written to the plugin's capacity key (its only grant besides the election and
        // the volumes and attachments it serves), when it changed.
        let id = &self.ctx.plugin.id;
        if !matches!(self.ctx.reads.capacity(id).await, Ok(Some(ref known)) if *known == entries) {
            self.ctx.writer.store().put_capacity(id, &entries).await?;
        }
        *self.ctx.capacity.write().unwrap_or_else(|e| e.into_inner()) = Some(entries);
        self.ctx.surveyed.send_modify(|n| *n += 1);
        Ok(())
    }

    /// A CSI 1.13 plugin's health of the listed volumes, in place of any condition the
    /// listing carried: every page of ControllerListVolumeHealth (LIST_VOLUME_HEALTH),
    /// or ControllerGetVolumeHealth of each (GET_VOLUME_HEALTH). A volume the list
    /// leaves out is healthy only when the previous list (`before`) left it out too: a
    /// paged list may skip an entry. A failed call leaves the health unknown this pass
    /// (nothing changes). Returns the volumes this list held.
    async fn health(
        &self,
        caps: &PluginCapabilities,
        listed: &mut BTreeMap<String, Listed>,
        before: &BTreeSet<String>,
    ) -> BTreeSet<String> {
        let list = caps.controller.has(ControllerRpc::ListVolumeHealth);
        if !list && !caps.controller.has(ControllerRpc::GetVolumeHealth) {
            return BTreeSet::new();
        }
        for entry in listed.values_mut() {
            entry.condition = None;
        }
        let csi = match self.ctx.csi() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(plugin = %self.ctx.plugin.id, error = %e, "health survey");
                return before.clone();
            }
        };
        if !list {
            for (ext, entry) in listed.iter_mut() {
                let req = v1::ControllerGetVolumeHealthRequest {
                    volume_id: ext.clone(),
                    secrets: Default::default(),
                };
                match csi.controller_get_volume_health(req).await {
                    Ok(r) => {
                        entry.condition =
                            Some(moor::csi::convert::volume_health(r.volume_health.as_ref()));
                    }
                    Err(e) if e.is_not_found() => {}
                    Err(e) => {
                        tracing::warn!(plugin = %self.ctx.plugin.id, volume_id = %ext, error = %e, "ControllerGetVolumeHealth");
                    }
                }
            }
            return BTreeSet::new();
        }
        let mut unhealthy: BTreeMap<String, VolumeHealth> = BTreeMap::new();
        let mut token = String::new();
        for _ in 0..100_000 {
            let page = match csi
                .controller_list_volume_health(v1::ControllerListVolumeHealthRequest {
                    max_entries: 500,
                    starting_token: token.clone(),
                    secrets: Default::default(),
                })
                .await
            {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(plugin = %self.ctx.plugin.id, error = %e, "ControllerListVolumeHealth");
                    return before.clone();
                }
            };
            for h in &page.entries {
                unhealthy.insert(
                    h.volume_id.clone(),
                    moor::csi::convert::volume_health(Some(h)),
                );
            }
            if page.next_token.is_empty() || page.next_token == token {
                break;
            }
            token = page.next_token;
        }
        for (ext, entry) in listed.iter_mut() {
            entry.condition = match unhealthy.get(ext) {
                Some(h) => Some(h.clone()),
                None if !before.contains(ext) => Some(VolumeHealth::default()),
                None => None,
            };
        }
        unhealthy
            .into_iter()
            .filter(|(_, h)| h.abnormal)
            .map(|(ext, _)| ext)
            .collect()
    }

    /// Every page of ListVolumes, by the plugin's volume id.
    async fn list(
        &self,
    ) -> Result<BTreeMap<String, Listed>, Box<dyn std::error::Error + Send + Sync>> {
        let csi = self.ctx.csi()?;
        let mut out = BTreeMap::new();
        let mut token = String::new();
        for _ in 0..100_000 {
            let page = csi
                .list_volumes(v1::ListVolumesRequest {
                    max_entries: 500,
                    starting_token: token.clone(),
                })
                .await?;
            for e in page.entries {
                let Some(vol) = e.volume else { continue };
                let status = e.status.unwrap_or_default();
                out.insert(
                    vol.volume_id,
                    Listed {
                        published: status.published_node_ids.into_iter().collect(),
                        condition: legacy(status.volume_condition),
                        capacity_bytes: u64::try_from(vol.capacity_bytes).unwrap_or(0),
                    },
                );
            }
            if page.next_token.is_empty() {
                return Ok(out);
            }
            token = page.next_token;
        }
        Err("ListVolumes did not end".into())
    }

    /// Without LIST_VOLUMES: ControllerGetVolume (GET_VOLUME) of each Ready volume of
    /// this plugin, as a list (NotFound: not in it; any other error ends the pass).
    async fn get_each(
        &self,
    ) -> Result<BTreeMap<String, Listed>, Box<dyn std::error::Error + Send + Sync>> {
        let csi = self.ctx.csi()?;
        let mut out = BTreeMap::new();
        for vol in self.volumes.reader().state() {
            let Some(ext) = vol
                .external_id
                .as_ref()
                .filter(|_| vol.phase == VolumePhase::Ready)
            else {
                continue;
            };
            let req = v1::ControllerGetVolumeRequest {
                volume_id: ext.to_string(),
            };
            match csi.controller_get_volume(req).await {
                Ok(r) => {
                    let status = r.status.unwrap_or_default();
                    out.insert(
                        ext.to_string(),
                        Listed {
                            published: status.published_node_ids.into_iter().collect(),
                            condition: legacy(status.volume_condition),
                            capacity_bytes: r
                                .volume
                                .map_or(0, |v| u64::try_from(v.capacity_bytes).unwrap_or(0)),
                        },
                    );
                }
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(out)
    }

    /// Compares the list with moor's volumes and attachments ([`judge`] for each of
    /// the plugin's ready volumes) and carries out the findings: the breach reported,
    /// the conditions and events written, the confirmed unknown attachments unpublished
    /// when asked to. Returns what was missing and which attachments were unknown in
    /// this pass.
    async fn compare(
        &self,
        caps: &PluginCapabilities,
        listed: &BTreeMap<String, Listed>,
        missing_before: &BTreeSet<String>,
        unknown_before: &BTreeSet<(String, String)>,
    ) -> (BTreeSet<String>, BTreeSet<(String, String)>) {
        let seen = Seen {
            plugin: &self.ctx.plugin.id,
            with_condition: caps.controller.has(ControllerRpc::VolumeCondition)
                || caps.controller.has(ControllerRpc::GetVolumeHealth)
                || caps.controller.has(ControllerRpc::ListVolumeHealth),
            with_nodes: caps
                .controller
                .has(ControllerRpc::ListVolumesPublishedNodes),
            missing_before,
            unknown_before,
        };
        // moor's attachments, by volume key: the CSI node ids it published to.
        let mut known: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for a in self.attachments.reader().state() {
            known
                .entry(Volume::key_for(&a.metadata.namespace, &a.spec.volume).into_string())
                .or_default()
                .insert(a.spec.csi_node_id.to_string());
        }
        let mut missing = BTreeSet::new();
        let mut unknown = BTreeSet::new();
        for vol in self.volumes.reader().state() {
            let Some(ext) = vol.ready_id().map(|e| e.to_string()) else {
                continue;
            };
            let ours = known.get(&vol.key()).cloned().unwrap_or_default();
            let f = judge(&seen, &vol, &ext, listed.get(&ext), &ours);
            if f.missing {
                missing.insert(ext.clone());
            }
            if f.breach {
                self.ctx
                    .breached(&vol.object_ref(), [moor::csi::contract::not_listed(&ext)])
                    .await;
            }
            unknown.extend(f.strangers.into_iter().map(|n| (vol.key(), n)));
            if self.unpublish_unknown {
                for node in &f.confirmed {
                    self.unpublish(&vol, &ext, node).await;
                }
            }
            self.write(&vol, f.set, f.warn, f.normal).await;
        }
        (missing, unknown)
    }

    /// Volumes the plugin lists that no Volume of moor names (by the id the plugin
    /// gave it, in any phase): after an older etcd snapshot is restored, those made
    /// since; or volumes made outside moor. Those listed in the previous pass too are
    /// reported in the plugin's unknown-volumes key (written when it changed) and, when
    /// new ones appear, with an "Unknown volumes" Warning on the Plugin. Never deleted:
    /// an operator registers one (a Volume with its `external_id`) or deletes it by
    /// the plugin's own means. Returns this pass's findings.
    async fn strangers(
        &self,
        listed: &BTreeMap<String, Listed>,
        before: &BTreeSet<String>,
    ) -> BTreeSet<String> {
        let id = &self.ctx.plugin.id;
        let known: BTreeSet<String> = self
            .volumes
            .reader()
            .state()
            .iter()
            .filter_map(|v| {
                v.external_id
                    .as_ref()
                    .or(v.registered_id())
                    .map(|e| e.to_string())
            })
            .collect();
        let now: BTreeSet<String> = listed
            .keys()
            .filter(|ext| !known.contains(*ext))
            .cloned()
            .collect();
        let mut report = UnknownVolumes::default();
        for ext in now.intersection(before) {
            if report.volumes.len() >= MAX_UNKNOWN_VOLUMES {
                report.more += 1;
                continue;
            }
            let entry = &listed[ext];
            report.volumes.push(UnknownVolume {
                volume_id: printable_bounded(ext, 128),
                capacity_bytes: entry.capacity_bytes,
                published_nodes: entry
                    .published
                    .iter()
                    .map(|n| printable_bounded(n, 128))
                    .collect(),
            });
        }
        let stored = self.ctx.reads.unknown_volumes(id).await;
        let unchanged = match &stored {
            Ok(Some(known)) => *known == report,
            Ok(None) => report == UnknownVolumes::default(),
            Err(_) => false,
        };
        if !unchanged {
            let was: BTreeSet<&str> = match &stored {
                Ok(Some(k)) => k.volumes.iter().map(|v| v.volume_id.as_str()).collect(),
                _ => BTreeSet::new(),
            };
            let new: Vec<&str> = report
                .volumes
                .iter()
                .map(|v| v.volume_id.as_str())
                .filter(|v| !was.contains(v))
                .collect();
            if !new.is_empty() {
                let shown: Vec<&str> = new.iter().take(5).copied().collect();
                let msg = format!(
                    "plugin {id} lists {} volume(s) moor does not know ({}{}); after an etcd restore these are volumes made since the snapshot. Nothing deletes them: register each as a Volume with its external_id, or remove it with the plugin's own tools (moorctl get volumes --orphaned)",
                    new.len(),
                    shown.join(", "),
                    if new.len() > shown.len() { ", ..." } else { "" }
                );
                tracing::warn!(plugin = %id, count = new.len(), "{msg}");
                let object = ObjectRef {
                    kind: "Plugin".into(),
                    namespace: Namespace::default(),
                    name: Name::new(id.as_str()).unwrap_or_default(),
                };
                self.ctx
                    .recorder
                    .record(
                        object,
                        EventType::Warning,
                        "Unknown volumes",
                        msg,
                        Default::default(),
                    )
                    .await;
            }
            if let Err(e) = self
                .ctx
                .writer
                .store()
                .put_unknown_volumes(id, &report)
                .await
            {
                tracing::warn!(plugin = %id, error = %e, "cannot write the unknown-volumes report");
            }
        }
        now
    }

    /// Attachments moor holds Attached that the plugin no longer lists as published
    /// to their node (LIST_VOLUMES_PUBLISHED_NODES): those found in the previous pass
    /// too are published again ([`Survey::reattach`]). Returns this pass's findings, by
    /// attachment key. Called only once the plugin has filled some volume's published
    /// nodes in a pass: from a plugin that never does, an empty list proves nothing.
    async fn absent(
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
    async fn reattach(&self, att: &Attachment) {
        let _guard = self
            .ctx
            .locks
            .lock(Volume::key_for(&att.metadata.namespace, &att.spec.volume).as_str())
            .await;
        let reader = self.attachments.reader();
        let att = match self.ctx.writer.fresh(&reader, &att.object_key()).await {
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
            .ctx
            .writer
            .write_status(&att, |st| {
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
                        crate::common::object_ref(&*att),
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
    async fn unpublish(&self, vol: &VolumeView, ext: &str, node: &str) {
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

    /// Sets conditions on the volume's provisioning section and records the Warnings.
    async fn write(
        &self,
        vol: &VolumeView,
        set: Vec<(&'static str, bool, String, String)>,
        warn: Vec<(&'static str, String)>,
        normal: Vec<(&'static str, String)>,
    ) {
        if !set.is_empty() {
            let r = self
                .ctx
                .writer
                .modify_status(&vol.object_key(), |_, st| {
                    for (t, status, reason, msg) in &set {
                        st.provisioning.meta.set_condition(t, *status, reason, msg);
                    }
                    true
                })
                .await;
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

/// An attachment of `plugin` moor holds Attached and does not mean to detach.
fn held(att: &Attachment, plugin: &PluginId) -> bool {
    &att.spec.plugin_id == plugin
        && att.status.phase == AttachmentPhase::Attached
        && !att.spec.detach
        && !att.is_deleting()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volume() -> Volume {
        let mut v = Volume::new(
            &Namespace::default_ns(),
            Name::new("v1").unwrap(),
            VolumeSpec::default(),
        );
        v.status.provisioning.external_id = Some(ExternalVolumeId::new("ext-1").unwrap());
        v
    }

    fn listed(published: &[&str], abnormal: Option<&str>) -> Listed {
        Listed {
            published: published.iter().map(|n| n.to_string()).collect(),
            condition: abnormal.map(|m| VolumeHealth {
                abnormal: !m.is_empty(),
                message: m.to_string(),
                conditions: Vec::new(),
            }),
            capacity_bytes: 0,
        }
    }

    /// Judges `vol` with the previous pass's findings.
    fn judged(
        vol: &Volume,
        entry: Option<&Listed>,
        ours: &[&str],
        missing_before: &[&str],
        unknown_before: &[&str],
    ) -> Finding {
        let plugin = PluginId::new("p").unwrap();
        let missing_before = missing_before.iter().map(|s| s.to_string()).collect();
        let unknown_before = unknown_before
            .iter()
            .map(|n| (vol.key(), n.to_string()))
            .collect();
        let seen = Seen {
            plugin: &plugin,
            with_condition: true,
            with_nodes: true,
            missing_before: &missing_before,
            unknown_before: &unknown_before,
        };
        let ours = ours.iter().map(|s| s.to_string()).collect();
        judge(
            &seen,
            &VolumeView::of_provisioned(vol.clone()),
            "ext-1",
            entry,
            &ours,
        )
    }

    /// Applies a finding's conditions, as the survey's write does.
    fn written(mut vol: Volume, f: &Finding) -> Volume {
        for (t, status, reason, msg) in &f.set {
            vol.status
                .provisioning
                .meta
                .set_condition(t, *status, reason, msg);
        }
        vol
    }

    #[test]
    fn a_volume_missing_twice_in_a_row_is_said_once_and_is_a_breach_if_moor_made_it() {
        let v = volume();
        let once = judged(&v, None, &[], &[], &[]);
        assert!(once.missing && !once.breach && once.set.is_empty() && once.warn.is_empty());
        let twice = judged(&v, None, &[], &["ext-1"], &[]);
        assert!(twice.breach, "{twice:?}");
        assert_eq!(twice.set[0].0, PRESENT);
        assert!(!twice.set[0].1);
        assert_eq!(twice.warn.len(), 1);
        // Said: the next pass writes nothing more, until it is listed again.
        let v = written(v, &twice);
        let thrice = judged(&v, None, &[], &["ext-1"], &[]);
        assert!(thrice.set.is_empty() && thrice.warn.is_empty() && thrice.breach);
        let back = judged(&v, Some(&listed(&[], None)), &[], &["ext-1"], &[]);
        assert_eq!(back.set, [(PRESENT, true, "Listed".into(), String::new())]);
        // A registered volume missing is said, but it is not the plugin's breach.
        let mut reg = volume();
        reg.spec.external_id = Some(ExternalVolumeId::new("ext-1").unwrap());
        assert!(!judged(&reg, None, &[], &["ext-1"], &[]).breach);
    }

    #[test]
    fn an_abnormal_condition_is_written_when_it_changes_and_warned_once() {
        let v = volume();
        // Healthy and never said otherwise: nothing to write.
        assert!(judged(&v, Some(&listed(&[], Some(""))), &[], &[], &[])
            .set
            .is_empty());
        let sick = judged(&v, Some(&listed(&[], Some("disk failing"))), &[], &[], &[]);
        assert_eq!(sick.set[0].0, HEALTHY);
        assert!(!sick.set[0].1);
        assert_eq!(sick.warn.len(), 1);
        let v = written(v, &sick);
        let same = judged(&v, Some(&listed(&[], Some("disk failing"))), &[], &[], &[]);
        assert!(same.set.is_empty() && same.warn.is_empty(), "{same:?}");
        let well = judged(&v, Some(&listed(&[], Some(""))), &[], &[], &[]);
        assert_eq!(well.set[0].0, HEALTHY);
        assert!(well.set[0].1 && well.warn.is_empty());
        assert_eq!(well.normal.len(), 1);
    }

    #[test]
    fn an_unknown_attachment_acts_only_when_two_passes_agree() {
        let v = volume();
        let entry = listed(&["csi-n1", "csi-n2"], None);
        let once = judged(&v, Some(&entry), &["csi-n1"], &[], &[]);
        assert_eq!(once.strangers, ["csi-n2"]);
        assert!(once.confirmed.is_empty() && once.set.is_empty());
        let twice = judged(&v, Some(&entry), &["csi-n1"], &[], &["csi-n2"]);
        assert_eq!(twice.confirmed, ["csi-n2"]);
        assert_eq!(twice.set[0].0, ATTACHMENTS);
        assert!(!twice.set[0].1);
        assert!(twice.warn[0].1.contains("csi-n2"));
        // Known again (moor attached it, or the plugin unpublished it): said once.
        let v = written(v, &twice);
        let known = judged(&v, Some(&entry), &["csi-n1", "csi-n2"], &[], &["csi-n2"]);
        assert!(known.strangers.is_empty() && known.confirmed.is_empty());
        assert_eq!(
            known.set,
            [(ATTACHMENTS, true, "Known".into(), String::new())]
        );
    }
}
