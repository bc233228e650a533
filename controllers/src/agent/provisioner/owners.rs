//! Which volume owns each of the plugin's volumes ([`Ownership`], issue 77): the
//! provisioner is the records' one writer. It makes a record (created if absent: of
//! two volumes naming one plugin volume, the first recorded keeps it) when it learns a
//! plugin volume is a volume's (CreateVolume's answer, a registration validated),
//! refuses a volume that names another's plugin volume before any call about it, and
//! calls DeleteVolume only for a plugin volume its volume owns.
//!
//! Upgrade: records are made for the plugin's Ready volumes, group snapshots (and their
//! members) and snapshots once, when a leader first starts without the plugin's
//! [`MIGRATED`] record (what the objects said before moor kept records; created volumes
//! before registrations, and of two naming one plugin volume the first keeps it; one
//! of another namespace is reported and shared with, so both keep working until an
//! operator picks), then that record is written. Until it exists the controller admits
//! claims of a volume without a record as before; after, only an owner's.

use super::*;

pub(super) use crate::agent::owners::Owner;

/// A CSI-shaped final answer for a step refused because another volume owns the
/// plugin volume (`why`, [`owner_for`]): the step's schedule records it as a final
/// failure (retried at the cap).
pub(super) fn owned_elsewhere(rpc: &'static str, why: &str) -> CsiError {
    CsiError {
        rpc,
        code: tonic::Code::AlreadyExists,
        message: format!("the plugin volume is {why}: this volume may not use it"),
        tries: 0,
    }
}

impl Provisioner {
    /// What the record of plugin volume `ext` says of `vol`, and the record.
    pub(super) async fn owner(
        &self,
        vol: &Volume,
        ext: &ExternalVolumeId,
    ) -> Result<(Owner, Option<Ownership>), ProvisionError> {
        Ok(self
            .ctx
            .owner(OwnedResource::Volume, ext.as_str(), vol)
            .await?)
    }

    /// Records that `vol` owns `ext` unless a volume of another namespace does:
    /// `Ok(Err(why))` then. `provisioned`: what CreateVolume answered, kept in the
    /// record (a created volume's; none for a registration).
    pub(super) async fn take_ownership(
        &self,
        vol: &Volume,
        ext: &ExternalVolumeId,
        provisioned: Option<Provisioned>,
    ) -> Result<Result<(), String>, ProvisionError> {
        Ok(self
            .ctx
            .take_ownership_with(OwnedResource::Volume, ext.as_str(), vol, provisioned)
            .await?)
    }

    /// Why a clone of `vol` may not be made from the plugin volume `source` names:
    /// the source volume (in `vol`'s namespace) must own it by its record (or a volume
    /// of its namespace must). `None` when it may, or when the source is no volume.
    pub(super) async fn source_not_owned(
        &self,
        vol: &Volume,
        source: Option<&requests::ContentSource>,
    ) -> Result<Option<String>, ProvisionError> {
        // A restore: never from a snapshot id another namespace's snapshot owns (the
        // source snapshot's status, or an external id, is its writer's word).
        if let Some(requests::ContentSource::Snapshot(id)) = source {
            return Ok(
                match self.ctx.owner(OwnedResource::Snapshot, id, vol).await?.0 {
                    Owner::Another(why) => Some(why),
                    _ => None,
                },
            );
        }
        let (Some(VolumeSource::Volume(name)), Some(requests::ContentSource::Volume(id))) =
            (&vol.spec.source, source)
        else {
            return Ok(None);
        };
        let Ok(ext) = ExternalVolumeId::new(id.clone()) else {
            return Ok(Some("owned by no volume".into()));
        };
        let src = self
            .ctx
            .reads
            .try_get(&Volume::key_for(&vol.metadata.namespace, name))
            .await?;
        let Some(src) = src else {
            return Ok(Some(format!(
                "named by source volume {name}, which is gone"
            )));
        };
        Ok(match self.owner(&src, &ext).await?.0 {
            Owner::Mine | Owner::Sibling | Owner::Shared => None,
            Owner::Another(why) => Some(why),
            Owner::Nobody => Some("owned by no volume (no ownership record names it)".into()),
        })
    }

    /// Removes `vol`'s record of `ext` once the plugin volume is deleted or left to
    /// the storage; another volume's record stays.
    pub(super) async fn drop_ownership(
        &self,
        vol: &Volume,
        ext: &ExternalVolumeId,
    ) -> Result<(), ProvisionError> {
        Ok(self
            .ctx
            .drop_ownership(OwnedResource::Volume, ext.as_str(), vol)
            .await?)
    }

    /// The upgrade's records, once per plugin: every Ready volume of the plugin that
    /// names a plugin volume gets its record unless another volume listed first has
    /// it (reported with a Warning on the volume left without); then the plugin's
    /// [`MIGRATED`] record.
    pub(super) async fn migrate(&self) -> Result<(), ProvisionError> {
        let marker = Ownership::migrated_key(&self.ctx.plugin.id);
        let done = self.ctx.reads.try_get(&marker).await?;
        if done.is_some() {
            return Ok(());
        }
        let volumes = self.ctx.reads.list(&KeyScope::<VolumeSpec>::all()).await?;
        let mut made = 0usize;
        // The volumes moor created first: a registration of the same plugin volume (in
        // the same namespace) then finds it owned by its creator, whose deletion
        // deletes it, and not the reverse.
        let mut ours: Vec<&Volume> = volumes
            .items
            .iter()
            .filter(|v| v.spec.plugin_id == self.ctx.plugin.id)
            .collect();
        ours.sort_by_key(|v| v.spec.external_id.is_some());
        for vol in ours {
            let p = &vol.status.provisioning;
            let Some(ext) = p
                .external_id
                .as_ref()
                .filter(|_| p.phase == VolumePhase::Ready)
            else {
                continue;
            };
            // A created volume's facts as its status shows them: the best word there
            // is at the upgrade (the status was written by the provisioner or by
            // whoever writes the volume, as before this version).
            let provisioned = (!vol.spec.is_registration()).then(|| Provisioned::of_status(p));
            match self.take_ownership(vol, ext, provisioned).await? {
                Ok(()) => made += 1,
                // Both named it before this version: both keep working (the record
                // shares it with this volume's namespace) until an operator picks.
                Err(why) => {
                    self.ctx
                        .share_with(OwnedResource::Volume, ext.as_str(), vol)
                        .await?;
                    self.event(
                        vol,
                        "Volume ownership shared",
                        EventType::Warning,
                        format!(
                            "its plugin volume is {why}, which also named it before this version kept owners: both keep working, this one without deleting it, until an operator picks (moorctl volume own, or moorctl volume unshare on the owner)"
                        ),
                    )
                    .await;
                }
            }
        }
        // The plugin's group snapshots, their ids and their members' (before the
        // member Snapshots: a member's id is its group's, deleted only with it).
        let groups = self
            .ctx
            .reads
            .list(&KeyScope::<VolumeGroupSnapshotSpec>::all())
            .await?;
        for group in groups.items.iter().filter(|g| {
            g.status.plugin_id.as_ref() == Some(&self.ctx.plugin.id)
                && g.status.phase == SnapshotPhase::Ready
        }) {
            let Some(id) = &group.status.group_snapshot_id else {
                continue;
            };
            let members = group.status.members.iter().map(|m| m.snapshot_id.as_str());
            for (resource, id) in crate::agent::group_snapshotter::group_ids(Some(id), members) {
                match self.ctx.take_ownership(resource, id, group).await? {
                    Ok(()) => made += 1,
                    Err(why) => {
                        tracing::warn!(group = %group.key(), %why, "group snapshot ownership refused at upgrade")
                    }
                }
            }
        }
        // The plugin's snapshots likewise (their snapshotter runs beside).
        let snapshots = self
            .ctx
            .reads
            .list(&KeyScope::<SnapshotSpec>::all())
            .await?;
        for snap in snapshots.items.iter().filter(|s| {
            s.status.plugin_id.as_ref() == Some(&self.ctx.plugin.id)
                && s.status.phase == SnapshotPhase::Ready
        }) {
            let Some(id) = &snap.status.snapshot_id else {
                continue;
            };
            match self
                .ctx
                .take_ownership(OwnedResource::Snapshot, id, snap)
                .await?
            {
                Ok(()) => made += 1,
                Err(why) => {
                    tracing::warn!(snapshot = %snap.key(), %why, "snapshot ownership refused at upgrade")
                }
            }
        }
        match self
            .ctx
            .writer
            .create(&Ownership::migrated(&self.ctx.plugin.id))
            .await
        {
            Ok(_) | Err(StoreError::AlreadyExists { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        tracing::info!(plugin = %self.ctx.plugin.id, records = made, "volume ownership recorded for the plugin's existing volumes");
        Ok(())
    }
}
