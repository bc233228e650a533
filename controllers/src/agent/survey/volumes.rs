//! The survey's look at volumes: what the plugin lists (or answers of each) against
//! what moor holds, its health, and volumes the plugin has that moor does not.

use moor::api::*;
use moor::csi::contract::Expected;
use moor::csi::v1;
use std::collections::{BTreeMap, BTreeSet};

use crate::agent::volume_view::VolumeView;
use moor::runtime::Resource;

use super::{Survey, ATTACHMENTS, HEALTHY, PRESENT};

/// What one ListVolumes said of a volume.
pub(super) struct Listed {
    pub(super) published: BTreeSet<String>,
    pub(super) condition: Option<VolumeHealth>,
    pub(super) capacity_bytes: u64,
}

/// The VolumeCondition of a 1.9-1.12 plugin, as moor keeps health.
pub(super) fn legacy(c: Option<v1::VolumeCondition>) -> Option<VolumeHealth> {
    c.map(|c| VolumeHealth {
        abnormal: c.abnormal,
        message: printable_bounded(&c.message, 1024),
        conditions: Vec::new(),
    })
}

/// What a survey pass goes by, besides the volume and its listing.
pub(super) struct Seen<'a> {
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
pub(super) struct Finding {
    /// The plugin does not list it.
    missing: bool,
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
pub(super) fn judge(
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
    /// A CSI 1.13 plugin's health of the listed volumes, in place of any condition the
    /// listing carried: every page of ControllerListVolumeHealth (LIST_VOLUME_HEALTH),
    /// or ControllerGetVolumeHealth of each (GET_VOLUME_HEALTH). A volume the list
    /// leaves out is healthy only when the previous list (`before`) left it out too: a
    /// paged list may skip an entry. A failed call leaves the health unknown this pass
    /// (nothing changes). Returns the volumes this list held.
    pub(super) async fn health(
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

    /// The Ready volumes the plugin created for moor (not registered), by the plugin's
    /// volume id: those whose absence from a survey is the plugin's breach.
    pub(super) fn made(&self) -> BTreeMap<String, ObjectRef> {
        self.volumes
            .reader()
            .state()
            .iter()
            .filter(|v| v.registered_id().is_none())
            .filter_map(|v| Some((v.ready_id()?.to_string(), v.object_ref())))
            .collect()
    }

    /// Every page of ListVolumes, by the plugin's volume id (the client reports a
    /// volume of `expected` left out twice in a row).
    pub(super) async fn list(
        &self,
        expected: Expected<'_>,
    ) -> Result<BTreeMap<String, Listed>, Box<dyn std::error::Error + Send + Sync>> {
        let entries = self.ctx.csi()?.list_every_volume(expected).await?;
        let mut out = BTreeMap::new();
        for e in entries {
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
        Ok(out)
    }

    /// Without LIST_VOLUMES: ControllerGetVolume (GET_VOLUME) of each Ready volume of
    /// this plugin, as a list (NotFound: not in it; any other error ends the pass).
    pub(super) async fn get_each(
        &self,
        expected: Expected<'_>,
    ) -> Result<BTreeMap<String, Listed>, Box<dyn std::error::Error + Send + Sync>> {
        let ids: Vec<String> = self
            .volumes
            .reader()
            .state()
            .iter()
            .filter(|v| v.phase == VolumePhase::Ready)
            .filter_map(|v| Some(v.external_id.as_ref()?.to_string()))
            .collect();
        let answers = self.ctx.csi()?.get_every_volume(ids, expected).await?;
        Ok(answers
            .into_iter()
            .map(|(id, r)| {
                let status = r.status.unwrap_or_default();
                let listed = Listed {
                    published: status.published_node_ids.into_iter().collect(),
                    condition: legacy(status.volume_condition),
                    capacity_bytes: r
                        .volume
                        .map_or(0, |v| u64::try_from(v.capacity_bytes).unwrap_or(0)),
                };
                (id, listed)
            })
            .collect())
    }

    /// Compares the list with moor's volumes and attachments ([`judge`] for each of
    /// the plugin's ready volumes) and carries out the findings: the conditions and
    /// events written, the confirmed unknown attachments unpublished
    /// when asked to. Returns what was missing and which attachments were unknown in
    /// this pass.
    pub(super) async fn compare(
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
    pub(super) async fn strangers(
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
                let object = crate::common::plugin_ref(id);
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
    fn a_volume_missing_twice_in_a_row_is_said_once() {
        let v = volume();
        let once = judged(&v, None, &[], &[], &[]);
        assert!(once.missing && once.set.is_empty() && once.warn.is_empty());
        let twice = judged(&v, None, &[], &["ext-1"], &[]);
        assert!(twice.missing, "{twice:?}");
        assert_eq!(twice.set[0].0, PRESENT);
        assert!(!twice.set[0].1);
        assert_eq!(twice.warn.len(), 1);
        // Said: the next pass writes nothing more, until it is listed again.
        let v = written(v, &twice);
        let thrice = judged(&v, None, &[], &["ext-1"], &[]);
        assert!(thrice.set.is_empty() && thrice.warn.is_empty() && thrice.missing);
        let back = judged(&v, Some(&listed(&[], None)), &[], &["ext-1"], &[]);
        assert_eq!(back.set, [(PRESENT, true, "Listed".into(), String::new())]);
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
