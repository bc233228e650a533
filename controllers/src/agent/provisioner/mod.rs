//! The provisioner: CreateVolume / DeleteVolume for the Volumes of one plugin, run by
//! the agent leading that plugin's election. It owns `status.provisioning`.
//!
//! Expected flow for a Volume:
//! 1. Registered (`spec.external_id`): nothing to create; provisioning is Ready with
//!    that id, so every reader finds the id in one place.
//! 2. To create: add the `moor.dev/provisioner` finalizer, record Creating, call
//!    CreateVolume (named by `plugin_name`: namespace, name and uid, so a repeat is idempotent) with the
//!    capability list, capacity range, parameters, secrets, source and topology; record
//!    Ready with the plugin's id, capacity, context and accessible topology.
//! 3. Registered, expanded or modified ([`changes`]): ValidateVolumeCapabilities (and
//!    ControllerGetVolume), ControllerExpandVolume, ControllerModifyVolume.
//! 4. Deleted: wait until the controller has released every claim (its
//!    `moor.dev/claims` finalizer is gone), DeleteVolume (none for `on_delete: retain`:
//!    a `Volume retained` event names the id kept), drop our finalizer.
//!
//! # Layout
//! - this file: the reconciler, CreateVolume and DeleteVolume (steps 1, 2 and 4).
//! - `changes`: a registered volume validated, an expansion, a modification (step 3).
//! - `owners`: the ownership records of the plugin's volumes, which only it writes.

use moor::api::*;
use moor::csi::policy::CsiError;
use moor::csi::{requests, v1};
use moor::runtime::controller::{Action, Config, Controller, ErrorPolicy, ReconcileError};
use moor::runtime::informer::Informer;
use moor::runtime::metrics::ControllerMetrics;
use moor::runtime::steps::{self, Failed};
use moor::store::StoreError;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

mod changes;
mod owners;

use super::volume_plan::{self, Step, EXPANDED, MODIFIED, VALIDATED};
use super::volume_view::VolumeView;
use crate::agent::context::ControllerPluginCtx;
use crate::common::object_ref;

/// The finalizer that holds a created volume's deletion until DeleteVolume.
pub const FINALIZER: &str = PROVISIONER_FINALIZER;
/// The controller's finalizer (held while claims remain).
pub const CLAIMS_FINALIZER: &str = "moor.dev/claims";

/// Why a volume could not be converged: what every executor's pass fails with, and
/// the provisioner's own cases.
#[derive(Debug, thiserror::Error)]
pub enum ProvisionError {
    /// What every executor's pass fails with.
    #[error(transparent)]
    Step(#[from] crate::agent::step_error::StepError),
    /// A volume whose CreateVolume may have taken effect is being deleted, and its
    /// id cannot be asked for again: the source it was made from is not there.
    #[error("cannot ask CreateVolume again for the id of a volume being deleted: {0}")]
    SourceGone(String),
    /// The plugin answered without a volume.
    #[error("CreateVolume answered without a volume id")]
    NoVolume,
}

crate::agent::step_error::through_step_error!(
    ProvisionError,
    moor::runtime::steps::BackingOff,
    CsiError,
    StoreError,
    crate::agent::step_error::NoChannel,
    SealedSecrets,
    moor::api::MissingSecret,
);

impl ReconcileError for ProvisionError {
    fn policy(&self) -> ErrorPolicy {
        match self {
            ProvisionError::Step(e) => e.policy(),
            _ => ErrorPolicy::Backoff,
        }
    }
}

/// The provisioner of one plugin.
pub struct Provisioner {
    /// Shared with the attacher.
    pub ctx: ControllerPluginCtx,
    /// Volumes, as viewed (see `volume_view`).
    pub volumes: Informer<VolumeView>,
    /// Snapshots (a volume restored from one waits until it is ready to use).
    pub snapshots: Informer<Snapshot>,
    /// The plugin's ownership records an operator wrote to (shared, or an owner
    /// chosen): few, and each wakes the registrations of its id.
    pub granted: Informer<Ownership>,
    /// This plugin's reports on its volumes: what it writes of their provisioning
    /// (the Volume is its requester's, and the controller's to copy into).
    pub reports: crate::agent::reports::Reports<VolumeSpec>,
    /// Quotas: a volume is created, or expanded, only once every quota of its
    /// namespace charged its capacity (the controller's charges).
    pub quotas: Informer<Quota>,
}

impl Provisioner {
    /// Runs until `stop`.
    pub async fn run(self, metrics: ControllerMetrics, stop: CancellationToken) {
        // The records of the volumes older versions made, before any step.
        while let Err(e) = self.migrate().await {
            tracing::warn!(plugin = %self.ctx.plugin.id, error = %moor::process::error_chain(&e), "cannot record the ownership of the plugin's volumes yet; retrying");
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
            }
        }
        let reader = self.volumes.reader();
        let events = self.volumes.subscribe();
        let restoring = reader.clone();
        let snapshots = self.snapshots.subscribe();
        // After each survey, the volumes still to be created look again at the
        // capacity the plugin reported.
        let uncreated = {
            let reader = reader.clone();
            let rx = self.ctx.surveyed.subscribe();
            futures::stream::unfold(rx, move |mut rx| {
                let reader = reader.clone();
                async move {
                    rx.changed().await.ok()?;
                    let keys: Vec<ObjectKey<VolumeSpec>> = reader
                        .state()
                        .iter()
                        .filter(|v| v.registered_id().is_none() && v.external_id.is_none())
                        .map(|v| v.object_key())
                        .collect();
                    Some((futures::stream::iter(keys), rx))
                }
            })
        };
        let secrets = self.ctx.secrets.subscribe();
        let granted = self.granted.subscribe();
        let reports = self.reports.cache.subscribe();
        let registering = reader.clone();
        let naming = reader.clone();
        let quoted = reader.clone();
        let quotas = self.quotas.subscribe();
        let plugin = self.ctx.plugin.id.clone();
        let this = Arc::new(self);
        Controller::new("provisioner", reader, Config::default())
            .with_metrics(metrics)
            .owns(events)
            // A report whose volume is gone is deleted by the volume's pass.
            .watches(reports, |r: &VolumeReport| {
                r.about_key().into_iter().collect()
            })
            // A Secret made or rotated: the volumes that name it (one waiting for it).
            .watches(secrets, move |s: &Secret| {
                ControllerPluginCtx::naming(&naming, &plugin, s)
            })
            .trigger(futures::StreamExt::flatten(uncreated))
            // A quota's charges changed: its namespace's volumes with a step owed (one
            // waiting to be created or expanded).
            .watches(quotas, move |q: &Quota| {
                quoted
                    .state()
                    .iter()
                    .filter(|v| !v.at_rest && v.namespace == q.metadata.namespace)
                    .map(|v| v.object_key())
                    .collect()
            })
            // An operator's share or choice: the registrations of that id look again
            // (one refused as another's may now validate).
            .watches(granted, move |o: &Ownership| {
                registering
                    .state()
                    .iter()
                    .filter(|v| {
                        !v.at_rest
                            && v.registered_id().map(|id| id.as_str())
                                == Some(o.spec.external_id.as_str())
                    })
                    .map(|v| v.object_key())
                    .collect()
            })
            // A snapshot becoming ready lets the volumes restored from it be created.
            .watches(snapshots, move |s: &Snapshot| {
                restoring
                    .state()
                    .iter()
                    .filter(|v| {
                        v.namespace == s.metadata.namespace
                            && v.restoring_from() == Some(&s.metadata.name)
                    })
                    .map(|v| v.object_key())
                    .collect()
            })
            .run(
                |this: Arc<Self>, key| async move {
                    moor::runtime::steps::requeue_backing_off(
                        this.reconcile(key).await,
                        |e| match e {
                            ProvisionError::Step(e) => e.backing_off(),
                            _ => None,
                        },
                    )
                },
                this,
                stop,
            )
            .await;
    }

    async fn reconcile(&self, key: ObjectKey<VolumeSpec>) -> Result<Action, ProvisionError> {
        let reader = self.volumes.reader();
        reader.wait_until_ready().await;
        self.reports.cache.reader().wait_until_ready().await;
        // A volume at rest owes nothing whatever the plugin says.
        let vol_key = match reader.get(&key) {
            Some(v) if !v.at_rest => v.object_key(),
            Some(_) => return Ok(Action::AwaitChange),
            None => {
                self.reports.forget(&key).await?;
                return Ok(Action::AwaitChange);
            }
        };
        let _guard = self.ctx.locks.lock(vol_key.as_str()).await;
        // Something may be owed: decide on the whole volume its view holds, unless the
        // cache lags this agent's own last write of it (then that write), or the view
        // holds none (read).
        let held = reader.get(&vol_key).and_then(|v| v.whole.clone());
        let vol = match self.ctx.writer.current(&reader, &vol_key, held).await? {
            Some(v) if v.spec.plugin_id == self.ctx.plugin.id => v,
            _ => {
                self.reports.forget(&key).await?;
                return Ok(Action::AwaitChange);
            }
        };
        // What this plugin reported of it, not what its key says (its requester's).
        let (vol, asked) = self.reports.reported_asking(&vol).await?;
        if vol.is_deleting() && asked == FinalizerAsk::Released {
            // Released: the controller drops the finalizer.
            return Ok(Action::AwaitChange);
        }
        let vol = Arc::new(vol);
        let caps = self.ctx.supervisor.status(&self.ctx.plugin.id);
        let known = caps
            .as_ref()
            .is_some_and(|c| !c.capabilities.plugin.is_empty());
        let caps = caps.map(|c| c.capabilities).unwrap_or_default();
        let capacity = self
            .ctx
            .capacity
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        match volume_plan::next(&vol, FINALIZER, &caps, capacity.as_deref()) {
            Step::Nothing => Ok(Action::AwaitChange),
            Step::Validate => self.validate(&vol).await,
            Step::AddFinalizer => {
                // The controller adds it; created only once it is there.
                (self.reports)
                    .write(&vol, Some(FinalizerAsk::Hold), |_| {})
                    .await?;
                Ok(Action::AwaitChange)
            }
            Step::Create => match self
                .over_quota(&vol, vol.spec.capacity_min.map_or(0, |s| s.0))
                .await?
            {
                Some(why) => self.waiting_for_quota(&vol, why).await,
                None => self.create(&vol).await,
            },
            Step::Delete => self.delete(&vol).await,
            // What the plugin advertises is not known yet: decide once it is.
            Step::Expand { .. } | Step::Modify | Step::Refuse { .. } if !known => {
                Ok(Action::Requeue(std::time::Duration::from_secs(1)))
            }
            Step::Expand { required, limit } => match self.expansion_forbidden(&vol).await? {
                // Its class forbids it, whichever front door raised the capacity.
                Some(message) => {
                    self.refuse(&vol, EXPANDED, "ExpansionNotAllowed", message)
                        .await
                }
                None => match self.over_quota(&vol, required).await? {
                    Some(why) => self.waiting_for_quota(&vol, why).await,
                    None => self.expand(&vol, required, limit).await,
                },
            },
            Step::ExpansionWithdrawn { capacity } => self.expansion_withdrawn(&vol, capacity).await,
            Step::Modify => self.modify(&vol).await,
            Step::Refuse {
                condition,
                reason,
                message,
            } => self.refuse(&vol, condition, reason, message).await,
        }
    }

    /// Why the namespace's quotas keep `vol` from being made (or grown) to `bytes`:
    /// a quota that has not charged it that much. Read from etcd, not the cache: a
    /// quota set just before the volume was written is seen (one read per creation
    /// or expansion; the cache only wakes the volumes a quota's change concerns).
    async fn over_quota(&self, vol: &Volume, bytes: u64) -> Result<Option<String>, ProvisionError> {
        Ok(quota_gate(
            &self.ctx.reads,
            &vol.metadata.namespace,
            Charged::Volume,
            vol.metadata.name.as_str(),
            &vol.metadata.uid,
            bytes,
        )
        .await?)
    }

    /// Waiting for a quota: the `Created` (or, once created, `Expanded`) condition
    /// false with why, and a Warning, each once for the same why; the quota's next
    /// change looks again.
    async fn waiting_for_quota(&self, vol: &Volume, why: String) -> Result<Action, ProvisionError> {
        let condition = if vol.status.provisioning.external_id.is_some() {
            EXPANDED
        } else {
            "Created"
        };
        let shown = vol
            .status
            .provisioning
            .meta
            .conditions
            .iter()
            .any(|c| c.type_ == condition && c.reason == "QuotaExceeded" && c.message == why);
        if !shown {
            self.refuse(vol, condition, "QuotaExceeded", why).await?;
        }
        Ok(Action::AwaitChange)
    }

    /// A step refused: its condition false with the reason, and a Warning; looked at
    /// again on the next change.
    async fn refuse(
        &self,
        vol: &Volume,
        condition: &'static str,
        reason: &'static str,
        message: String,
    ) -> Result<Action, ProvisionError> {
        self.provisioning(vol, |p| {
            p.meta.set_condition(condition, false, reason, &message);
        })
        .await?;
        self.event(vol, reason, EventType::Warning, message).await;
        Ok(Action::AwaitChange)
    }

    /// Why the volume's class, as it is now, forbids raising its capacity (read when
    /// an expansion is owed, which is rare: no cache of classes is kept).
    async fn expansion_forbidden(&self, vol: &Volume) -> Result<Option<String>, ProvisionError> {
        let Some(name) = &vol.spec.class else {
            return Ok(None);
        };
        let class = self
            .ctx
            .reads
            .try_get(&VolumeClass::key_for(name))
            .await
            .map_err(crate::agent::step_error::StepError::from)?;
        Ok(class
            .filter(|c| !c.spec.allow_expansion)
            .map(|_| format!("class {name} does not allow expansion (allow_expansion: false)")))
    }

    /// What a volume's steps depend on: its spec and the plugin's fingerprint (the
    /// status sections written by the provisioner and the controller are not part).
    fn inputs(&self, vol: &Volume) -> u64 {
        steps::inputs((
            &vol.metadata.uid,
            vol.metadata.generation,
            self.ctx.supervisor.epoch(),
        ))
    }

    /// The content source `vol` names, as the plugin knows it: the snapshot's or
    /// volume's plugin id once it is ready, else why it is not yet.
    fn source(&self, vol: &Volume) -> Source {
        let ns = &vol.metadata.namespace;
        match &vol.spec.source {
            None => Source::Ready(None),
            Some(VolumeSource::ExternalSnapshotId(id)) => {
                Source::Ready(Some(requests::ContentSource::Snapshot(id.clone())))
            }
            Some(VolumeSource::Snapshot(name)) => self
                .snapshots
                .reader()
                .get(&Snapshot::key_for(ns, name))
                .filter(|s| s.status.ready_to_use && !s.is_deleting())
                .and_then(|s| s.status.snapshot_id.clone())
                .map_or_else(
                    || Source::Waiting(format!("snapshot {name} is not ready to use yet")),
                    |id| Source::Ready(Some(requests::ContentSource::Snapshot(id))),
                ),
            Some(VolumeSource::Volume(id)) => self
                .volumes
                .reader()
                .get(&Volume::key_for(ns, id))
                .and_then(|v| v.external_id.clone())
                .map_or_else(
                    || Source::Waiting(format!("source volume {id} has no external id yet")),
                    |src| Source::Ready(Some(requests::ContentSource::Volume(src.to_string()))),
                ),
        }
    }

    /// CreateVolume of `vol`, named by `plugin_name` (a repeat is idempotent), on the step's
    /// schedule, recorded `Creating` before the call; once its content source is ready.
    async fn create(&self, vol: &Volume) -> Result<Action, ProvisionError> {
        let key = vol.key();
        let (step, source) = self.create_step(&key, vol)?;
        let source = match source {
            Source::Ready(source) => source,
            Source::Waiting(why) => return self.waiting_for_source(vol, why).await,
        };
        // A clone's source is named by the source volume's status, which whoever
        // writes that volume writes: cloned only from a plugin volume it owns.
        if let Some(why) = self.source_not_owned(vol, source.as_ref()).await? {
            let failed = step.fail(owners::owned_elsewhere("CreateVolume", &why));
            return self.create_failed(vol, failed).await;
        }
        let for_call = self.ctx.for_family(vol, SecretFamily::Controller).await?;
        let req = requests::create_volume(&for_call, source, self.ctx.multi_writer_cap())?;
        self.provisioning(vol, |p| p.phase = VolumePhase::Creating)
            .await?;
        let csi = self.ctx.csi()?.about(object_ref(vol));
        match step.call(csi.create_volume(req)).await {
            Ok(resp) => {
                let created = created_volume(resp)?;
                let ext = ExternalVolumeId::new(created.volume_id.clone())
                    .map_err(|_| ProvisionError::NoVolume)?;
                // However it was named, an answer naming another volume's plugin
                // volume (a plugin that names by parameters, a lying plugin) is not
                // ours.
                let facts = provisioned(&created);
                if let Err(why) = self.take_ownership(vol, &ext, Some(facts)).await? {
                    let failed = self
                        .create_step(&key, vol)?
                        .0
                        .fail(owners::owned_elsewhere("CreateVolume", &why));
                    return self.create_failed(vol, failed).await;
                }
                self.created(vol, created).await
            }
            Err(failed) => self.create_failed(vol, failed).await,
        }
    }

    /// CreateVolume's step of `vol`, once its gate lets it through, and the content
    /// source the request would carry.
    fn create_step<'a>(
        &'a self,
        key: &'a str,
        vol: &Volume,
    ) -> Result<(steps::Step<'a>, Source), ProvisionError> {
        let step = self
            .ctx
            .steps
            .begin(key, "CreateVolume", self.inputs(vol))?;
        Ok((step, self.source(vol)))
    }

    /// Waiting for the content source, shown once (the reason is the same each pass);
    /// looked at again in 2 s, and when a snapshot changes.
    async fn waiting_for_source(
        &self,
        vol: &Volume,
        why: String,
    ) -> Result<Action, ProvisionError> {
        let shown =
            vol.status.provisioning.meta.conditions.iter().any(|c| {
                c.type_ == "Created" && c.reason == "WaitingForSource" && c.message == why
            });
        if !shown {
            self.provisioning(vol, |p| {
                p.meta
                    .set_condition("Created", false, "WaitingForSource", &why);
            })
            .await?;
        }
        Ok(Action::Requeue(std::time::Duration::from_secs(2)))
    }

    /// Records the volume CreateVolume answered: Ready with the plugin's id, capacity,
    /// context and topology, and a "Volume created" event.
    async fn created(&self, vol: &Volume, created: v1::Volume) -> Result<Action, ProvisionError> {
        let ext = ExternalVolumeId::new(created.volume_id.clone())
            .map_err(|_| ProvisionError::NoVolume)?;
        self.provisioning(vol, |p| {
            p.phase = VolumePhase::Ready;
            p.external_id = Some(ext.clone());
            let facts = provisioned(&created);
            p.capacity_bytes = facts.capacity_bytes;
            p.volume_context = facts.volume_context;
            p.accessible_topology = facts.accessible_topology;
            p.meta.clear_failure();
            p.mutable_parameters = vol.spec.mutable_parameters.clone();
            p.meta.observed_generation = vol.metadata.generation;
            p.meta.set_condition("Created", true, "CreateVolume", "");
        })
        .await?;
        self.event(
            vol,
            "Volume created",
            EventType::Normal,
            format!("created as {ext}"),
        )
        .await;
        Ok(Action::AwaitChange)
    }

    /// A failed CreateVolume: shown on the status with its cause's chain, and in a
    /// Warning; a final answer took no effect, so the volume shows Failed (retried at
    /// the cap or when its spec or the plugin changes), not "creating".
    async fn create_failed(&self, vol: &Volume, failed: Failed) -> Result<Action, ProvisionError> {
        let msg = moor::process::error_chain(&crate::agent::step_error::StepError::Csi(
            failed.error.clone(),
        ));
        self.provisioning(vol, |p| {
            if failed.is_final() {
                p.phase = VolumePhase::Failed;
            }
            failed.record(&mut p.meta);
            p.meta.last_error = Some(msg.clone());
            p.meta
                .set_condition("Created", false, "CreateVolumeFailed", &msg);
        })
        .await?;
        self.event(vol, "Volume create failed", EventType::Warning, msg)
            .await;
        Ok(Action::Requeue(failed.retry_in))
    }

    /// Carries out the volume's [`deletion`].
    async fn delete(&self, vol: &Volume) -> Result<Action, ProvisionError> {
        let key = vol.key();
        let ext = match deletion(vol) {
            Deletion::Done | Deletion::WaitForClaims => return Ok(Action::AwaitChange),
            Deletion::Forget => None,
            Deletion::Delete(ext) => Some(ext),
            Deletion::Recover => {
                // On CreateVolume's own schedule: a plugin failing it is not asked on
                // every pass.
                let (step, source) = self.create_step(&key, vol)?;
                let source = match source {
                    Source::Ready(source) => source,
                    Source::Waiting(why) => return Err(ProvisionError::SourceGone(why)),
                };
                let for_call = self.ctx.for_family(vol, SecretFamily::Controller).await?;
                let req = requests::create_volume(&for_call, source, self.ctx.multi_writer_cap())?;
                let csi = self.ctx.csi()?.about(object_ref(vol));
                match step.call(csi.create_volume(req)).await {
                    Ok(resp) => {
                        let created = created_volume(resp)?;
                        match ExternalVolumeId::new(created.volume_id) {
                            // Ours only if no other volume owns it.
                            Ok(ext) => match self.take_ownership(vol, &ext, None).await? {
                                Ok(()) => Some(ext),
                                Err(why) => return self.not_deleted(vol, &why).await,
                            },
                            Err(_) => None,
                        }
                    }
                    Err(failed) => return self.delete_failed(vol, failed).await,
                }
            }
        };
        // Deleted or left to the storage only if this volume owns it: the id in the
        // volume's status is the word of whoever writes the volume's key.
        if let Some(ext) = &ext {
            match self.owner(vol, ext).await?.0 {
                owners::Owner::Mine => {}
                owners::Owner::Sibling => {
                    return self
                        .not_deleted(vol, "owned by another volume of this namespace")
                        .await
                }
                owners::Owner::Shared => {
                    return self
                        .not_deleted(vol, "shared with this namespace by its owner's")
                        .await
                }
                owners::Owner::Another(why) => return self.not_deleted(vol, &why).await,
                owners::Owner::Nobody => {
                    return self
                        .not_deleted(vol, "recorded as no volume's (not made or registered through moor's provisioner)")
                        .await
                }
            }
        }
        if let Some(ext) = ext
            .as_ref()
            .filter(|_| vol.spec.on_delete == Some(OnDelete::Retain))
        {
            // The deletion rule of the volume (or of its class): the storage stays.
            self.ctx.steps.forget(&key);
            self.event(
                vol,
                "Volume retained",
                EventType::Normal,
                format!(
                    "{ext} kept in plugin {} (on_delete: retain); register it again with external_id: {ext}",
                    vol.spec.plugin_id
                ),
            )
            .await;
        } else if let Some(ext) = &ext {
            let for_call = self.ctx.for_family(vol, SecretFamily::Controller).await?;
            let req = requests::delete_volume(&for_call, ext.as_str())?;
            let step = self
                .ctx
                .steps
                .begin(&key, "DeleteVolume", self.inputs(vol))?;
            if let Err(failed) = step.call(self.ctx.csi()?.delete_volume(req)).await {
                return self.delete_failed(vol, failed).await;
            }
            self.ctx.steps.forget(&key);
            self.ctx
                .monitor
                .forget_created(&self.ctx.plugin.id, &vol.metadata.uid.to_string());
            self.event(
                vol,
                "Volume deleted",
                EventType::Normal,
                format!("{ext} deleted"),
            )
            .await;
        }
        if let Some(ext) = &ext {
            self.drop_ownership(vol, ext).await?;
        }
        // The volume is gone from the plugin: the controller drops our finalizer.
        self.released(vol).await?;
        Ok(Action::AwaitChange)
    }

    /// A volume whose plugin volume it does not own (`why`): deleted from moor with
    /// no call about the plugin volume, said in a Warning.
    async fn not_deleted(&self, vol: &Volume, why: &str) -> Result<Action, ProvisionError> {
        self.ctx.steps.forget(&vol.key());
        self.event(
            vol,
            "Volume not deleted from the plugin",
            EventType::Warning,
            format!("the plugin volume its status names is {why}: no DeleteVolume; only the volume is deleted"),
        )
        .await;
        self.released(vol).await?;
        Ok(Action::AwaitChange)
    }

    /// A step of the deletion failed: shown on the status (its step, attempts and next
    /// retry) and in a Warning; looked at again when its schedule says.
    async fn delete_failed(&self, vol: &Volume, failed: Failed) -> Result<Action, ProvisionError> {
        self.provisioning(vol, |p| failed.record(&mut p.meta))
            .await?;
        self.event(
            vol,
            "Volume delete failed",
            EventType::Warning,
            failed.message(),
        )
        .await;
        Ok(Action::Requeue(failed.retry_in))
    }

    /// Writes `f` onto the volume's provisioning, into this plugin's report on it.
    pub(super) async fn provisioning(
        &self,
        vol: &Volume,
        f: impl FnMut(&mut ProvisioningStatus),
    ) -> Result<Volume, StoreError> {
        self.reports.write(vol, None, f).await
    }

    /// Reports what this plugin made of the volume gone (or kept on purpose): the
    /// controller drops the provisioner's finalizer. Read again first: the step
    /// that led here may have written the report since `vol` was read.
    async fn released(&self, vol: &Volume) -> Result<(), StoreError> {
        self.reports
            .write(vol, Some(FinalizerAsk::Released), |_| {})
            .await?;
        Ok(())
    }

    async fn event(&self, vol: &Volume, reason: &str, type_: EventType, message: String) {
        self.ctx
            .volume_event(&object_ref(vol), reason, type_, message)
            .await;
    }
}

/// Why nothing is made while this agent may not read the quotas (an etcd role of an
/// older roles.sh): nothing is made past a quota it cannot see.
const QUOTAS_REFUSED: &str = "this agent's etcd role does not let it read the \
     namespace's quotas (quotas/): nothing is created until it does (run \
     deploy/etcd/roles.sh of this version)";

/// Why namespace `ns`'s quotas keep `kind`'s object `name` of uid `uid` from being made
/// (or grown to `bytes`): a quota that has not charged it so much, read from etcd (a
/// quota set just before the object is seen); also a quota this agent may not read,
/// or one that is not a valid Quota (nothing is made past a quota it cannot see).
pub(crate) async fn quota_gate(
    reads: &moor::store::Store,
    ns: &Namespace,
    kind: Charged,
    name: &str,
    uid: &Uid,
    bytes: u64,
) -> Result<Option<String>, StoreError> {
    let Some(scope) = KeyScope::<QuotaSpec>::namespace(ns) else {
        return Ok(None);
    };
    let list = match reads.list(&scope).await {
        Ok(list) => list,
        Err(e) if e.is_permission_denied() => return Ok(Some(QUOTAS_REFUSED.into())),
        Err(e) => return Err(e),
    };
    if let Some(bad) = list.malformed.first() {
        return Ok(Some(format!(
            "a quota of namespace {ns} is not a valid Quota ({}): nothing is created \
             until an operator fixes or deletes it",
            moor::api::printable_bounded(&bad.to_string(), 200)
        )));
    }
    Ok(quota_wait(&list.items, kind, name, uid, bytes))
}

/// The volume a CreateVolume answer names; an answer without one is a plugin's lie.
/// What CreateVolume answered of `created`, as the volume's record keeps it (and its
/// status shows it).
fn provisioned(created: &v1::Volume) -> Provisioned {
    Provisioned {
        capacity_bytes: (created.capacity_bytes > 0).then_some(created.capacity_bytes as u64),
        volume_context: created.volume_context.clone().into(),
        accessible_topology: created
            .accessible_topology
            .iter()
            .map(|t| t.segments.clone())
            .collect(),
    }
}

fn created_volume(resp: v1::CreateVolumeResponse) -> Result<v1::Volume, ProvisionError> {
    resp.volume
        .filter(|v| !v.volume_id.is_empty())
        .ok_or(ProvisionError::NoVolume)
}

/// A volume's content source, resolved.
enum Source {
    /// Ready: the plugin's id of it (or no source).
    Ready(Option<requests::ContentSource>),
    /// Not ready yet, and why: the volume waits.
    Waiting(String),
}

/// What deleting a volume takes, decided from the volume alone.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Deletion {
    /// The provisioner's finalizer is gone: nothing left of ours.
    Done,
    /// Claims still hold it: the controller drops its finalizer when they are gone.
    WaitForClaims,
    /// A CreateVolume may have taken effect without us learning the id: asked again
    /// (idempotent by name) so the volume is not leaked, then deleted.
    Recover,
    /// DeleteVolume of this id, then the finalizer dropped.
    Delete(ExternalVolumeId),
    /// Never created: only the finalizer dropped.
    Forget,
}

/// Decides [`Deletion`] for a volume being deleted.
fn deletion(vol: &Volume) -> Deletion {
    let has = |f: &str| vol.metadata.finalizers.iter().any(|x| x == f);
    if !has(FINALIZER) {
        return Deletion::Done;
    }
    if has(CLAIMS_FINALIZER) {
        return Deletion::WaitForClaims;
    }
    let p = &vol.status.provisioning;
    match &p.external_id {
        Some(ext) => Deletion::Delete(ext.clone()),
        None if p.phase == VolumePhase::Creating => Deletion::Recover,
        None => Deletion::Forget,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deleting(finalizers: &[&str], phase: VolumePhase, ext: Option<&str>) -> Volume {
        let mut v = Volume::new(
            &Namespace::default_ns(),
            Name::new("v1").unwrap(),
            VolumeSpec::default(),
        );
        v.metadata.finalizers = finalizers.iter().map(|f| Term::new(f)).collect();
        v.metadata.deletion_timestamp = Some(Timestamp::now());
        v.status.provisioning.phase = phase;
        v.status.provisioning.external_id = ext.map(|e| ExternalVolumeId::new(e).unwrap());
        v
    }

    #[test]
    fn a_volume_is_deleted_from_the_plugin_only_once_no_claim_holds_it() {
        let both = [FINALIZER, CLAIMS_FINALIZER];
        let ready = VolumePhase::Ready;
        assert_eq!(
            deletion(&deleting(&both, ready, Some("e1"))),
            Deletion::WaitForClaims
        );
        assert_eq!(
            deletion(&deleting(&[FINALIZER], ready, Some("e1"))),
            Deletion::Delete(ExternalVolumeId::new("e1").unwrap())
        );
        assert_eq!(
            deletion(&deleting(&[CLAIMS_FINALIZER], ready, Some("e1"))),
            Deletion::Done
        );
    }

    #[test]
    fn a_creation_that_may_have_taken_effect_is_recovered_before_the_finalizer_goes() {
        assert_eq!(
            deletion(&deleting(&[FINALIZER], VolumePhase::Creating, None)),
            Deletion::Recover
        );
        // Failed with a final answer, or never tried: nothing was made.
        for phase in [VolumePhase::Failed, VolumePhase::Pending] {
            assert_eq!(
                deletion(&deleting(&[FINALIZER], phase, None)),
                Deletion::Forget
            );
        }
    }
}
