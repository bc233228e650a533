//! The survey's GetCapacity: the plugin as a whole and each segment its volumes require.

use moor::api::*;
use moor::csi::v1;
use std::collections::BTreeSet;

use super::Survey;

impl Survey {
    /// GetCapacity, whole and per required segment; recorded on the Plugin and shared
    /// with the provisioner.
    pub(super) async fn capacity(
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
}
