//! Which volume owns each of the plugin's volumes ([`Ownership`], issue 77): the
//! provisioner is the records' one writer. It makes a record (created if absent: of
//! two volumes naming one plugin volume, the first recorded keeps it) when it learns a
//! plugin volume is a volume's (CreateVolume's answer, a registration validated),
//! refuses a volume that names another's plugin volume before any call about it, and
//! calls DeleteVolume only for a plugin volume its volume owns.
//!
//! Upgrade: records are made for the plugin's Ready volumes once, when a leader first
//! starts without the plugin's [`MIGRATED`] record (what the volumes said before moor
//! kept records; of two naming one plugin volume the first listed keeps it, the other
//! is reported), then that record is written. Until it exists the controller admits
//! claims of a volume without a record as before; after, only an owner's.

use super::*;

/// What a record says of a volume and a plugin volume.
#[derive(Debug)]
pub(super) enum Owner {
    /// The volume owns it.
    Mine,
    /// Another volume of the same namespace owns it: the volume may be registered
    /// and used on it (whoever writes one writes both), never delete it.
    Sibling,
    /// Another volume does (what the volume's namespace may be told of it).
    Another(String),
    /// Nobody does.
    Nobody,
}

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
    /// The record of plugin volume `ext`, read from the store (a destructive step
    /// decides on it, not on a cache).
    async fn record(&self, ext: &ExternalVolumeId) -> Result<Option<Ownership>, ProvisionError> {
        let key = Ownership::key_for(&self.ctx.plugin.id, OwnedResource::Volume, ext.as_str());
        Ok(self
            .ctx
            .reads
            .try_get(&key)
            .await
            .map_err(crate::agent::step_error::StepError::from)?)
    }

    /// Whether the volume a record names is gone (deleted, or made again under the
    /// same name): then the record is stale (a registered volume's, which has no
    /// finalizer to remove it).
    async fn stale(&self, rec: &Ownership) -> Result<bool, ProvisionError> {
        let o = &rec.spec.owner;
        let key = Volume::key_for(&o.namespace, &o.name);
        let owner = self
            .ctx
            .reads
            .try_get(&key)
            .await
            .map_err(crate::agent::step_error::StepError::from)?;
        Ok(owner.is_none_or(|v| v.metadata.uid != o.uid))
    }

    /// What the record of `ext` says of `vol`; a record whose volume is gone counts
    /// as nobody's.
    pub(super) async fn owner(
        &self,
        vol: &Volume,
        ext: &ExternalVolumeId,
    ) -> Result<(Owner, Option<Ownership>), ProvisionError> {
        let Some(rec) = self.record(ext).await? else {
            return Ok((Owner::Nobody, None));
        };
        if owned_by(&rec, vol) {
            return Ok((Owner::Mine, Some(rec)));
        }
        if self.stale(&rec).await? {
            return Ok((Owner::Nobody, Some(rec)));
        }
        if rec.spec.owner.namespace == vol.metadata.namespace {
            return Ok((Owner::Sibling, Some(rec)));
        }
        let why = owner_for(&rec, &vol.metadata.namespace);
        Ok((Owner::Another(why), Some(rec)))
    }

    /// Records that `vol` owns `ext` unless another volume does: `Ok(Err(why))` when
    /// that volume is in another namespace; `Ok(Ok(()))` and the record left as it is
    /// when it is in the same one. A stale record is replaced (guarded by its
    /// revision).
    pub(super) async fn take_ownership(
        &self,
        vol: &Volume,
        ext: &ExternalVolumeId,
    ) -> Result<Result<(), String>, ProvisionError> {
        for _ in 0..3 {
            let (owner, rec) = self.owner(vol, ext).await?;
            match owner {
                Owner::Mine | Owner::Sibling => return Ok(Ok(())),
                Owner::Another(why) => return Ok(Err(why)),
                Owner::Nobody => {}
            }
            if let Some(stale) = rec {
                match self.ctx.writer.delete_read(&stale).await {
                    Ok(_) | Err(StoreError::Conflict { .. } | StoreError::NotFound { .. }) => {}
                    Err(e) => return Err(crate::agent::step_error::StepError::from(e).into()),
                }
            }
            match self
                .ctx
                .writer
                .create(&Ownership::of_volume(vol, ext))
                .await
            {
                Ok(_) => return Ok(Ok(())),
                // Another writer's record came first: read it again.
                Err(StoreError::AlreadyExists { .. }) => continue,
                Err(e) => return Err(crate::agent::step_error::StepError::from(e).into()),
            }
        }
        Ok(Err("owned by another volume".into()))
    }

    /// Why a clone of `vol` may not be made from the plugin volume `source` names:
    /// the source volume (in `vol`'s namespace) must own it by its record (or a volume
    /// of its namespace must). `None` when it may, or when the source is no volume.
    pub(super) async fn source_not_owned(
        &self,
        vol: &Volume,
        source: Option<&requests::ContentSource>,
    ) -> Result<Option<String>, ProvisionError> {
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
            .await
            .map_err(crate::agent::step_error::StepError::from)?;
        let Some(src) = src else {
            return Ok(Some(format!(
                "named by source volume {name}, which is gone"
            )));
        };
        Ok(match self.owner(&src, &ext).await?.0 {
            Owner::Mine | Owner::Sibling => None,
            Owner::Another(why) => Some(why),
            Owner::Nobody => Some("owned by no volume (no ownership record names it)".into()),
        })
    }

    /// Removes `vol`'s record of `ext` once the plugin volume is deleted or left to
    /// the storage (`on_delete: retain`, registered again later by anyone); another
    /// volume's record stays.
    pub(super) async fn drop_ownership(
        &self,
        vol: &Volume,
        ext: &ExternalVolumeId,
    ) -> Result<(), ProvisionError> {
        if let Some(rec) = self.record(ext).await?.filter(|r| owned_by(r, vol)) {
            match self.ctx.writer.delete_read(&rec).await {
                Ok(_) | Err(StoreError::Conflict { .. } | StoreError::NotFound { .. }) => {}
                Err(e) => return Err(crate::agent::step_error::StepError::from(e).into()),
            }
        }
        Ok(())
    }

    /// The upgrade's records, once per plugin: every Ready volume of the plugin that
    /// names a plugin volume gets its record unless another volume listed first has
    /// it (reported with a Warning on the volume left without); then the plugin's
    /// [`MIGRATED`] record. Returns whether the records are complete.
    pub(super) async fn migrate(&self) -> Result<(), ProvisionError> {
        let marker = Ownership::migrated_key(&self.ctx.plugin.id);
        let done = self
            .ctx
            .reads
            .try_get(&marker)
            .await
            .map_err(crate::agent::step_error::StepError::from)?;
        if done.is_some() {
            return Ok(());
        }
        let volumes = self
            .ctx
            .reads
            .list(&KeyScope::<VolumeSpec>::all())
            .await
            .map_err(crate::agent::step_error::StepError::from)?;
        let mut made = 0usize;
        for vol in volumes
            .items
            .iter()
            .filter(|v| v.spec.plugin_id == self.ctx.plugin.id)
        {
            let p = &vol.status.provisioning;
            let Some(ext) = p
                .external_id
                .as_ref()
                .filter(|_| p.phase == VolumePhase::Ready)
            else {
                continue;
            };
            match self.take_ownership(vol, ext).await? {
                Ok(()) => made += 1,
                Err(why) => {
                    self.event(
                        vol,
                        "Volume ownership refused",
                        EventType::Warning,
                        format!(
                            "its plugin volume is {why} (both named it before this version kept owners): an operator picks by deleting or re-registering one"
                        ),
                    )
                    .await;
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
            Err(e) => return Err(crate::agent::step_error::StepError::from(e).into()),
        }
        tracing::info!(plugin = %self.ctx.plugin.id, records = made, "volume ownership recorded for the plugin's existing volumes");
        Ok(())
    }
}
