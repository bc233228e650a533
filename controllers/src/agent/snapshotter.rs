//! The snapshotter: CreateSnapshot / DeleteSnapshot for the Snapshots of one plugin's
//! volumes, run by the agent leading that plugin's election beside the provisioner. It
//! writes what it observes of a Snapshot in its report ([`SnapshotReport`],
//! [`super::reports`]): the status, and what it asks of the `moor.dev/snapshotter`
//! finalizer, which the controller copies and adds or removes (issue 77: the agent
//! does not write Snapshots). Its own report's status is the one it acts on.
//!
//! Expected flow for a Snapshot (decided by [`next`], pure and unit tested):
//! 1. Its volume's plugin is this one (or, once cut, `status.plugin_id` is).
//! 2. The plugin must advertise CREATE_DELETE_SNAPSHOT: otherwise Failed with a
//!    Warning, never called.
//! 3. Ask for the finalizer (`Hold`) and wait until the controller added it; wait
//!    until the volume is created (its external id).
//! 4. CreateSnapshot named by `plugin_name` (idempotent), from the volume's
//!    external id; record the plugin's id, size, creation time and ready_to_use
//!    (Ready); not yet ready to use: asked again until it is (Creating).
//! 5. Deleted: DeleteSnapshot (NotFound is done; a snapshot whose CreateSnapshot was in
//!    doubt is asked for again first, so it is not leaked), then report the finalizer
//!    `Released` (the controller removes it).
//! 6. Imported (`spec.snapshot_id`, a snapshot made outside moor): the plugin must
//!    advertise LIST_SNAPSHOTS (else Failed, never called); ListSnapshots by that id
//!    instead of CreateSnapshot, asked again until it is ready to use; an id the
//!    plugin does not list, or a snapshot of another volume than `spec.volume`'s, is
//!    Failed with the reason (looked at again on the step's schedule). Deleted: no
//!    DeleteSnapshot (moor did not make it), only the finalizer is released.
//! 7. Owned ids ([`Ownership`], issue 77): the id a CreateSnapshot or an import
//!    answers is recorded as this snapshot's if no snapshot of another namespace has
//!    it; an import of, a CreateSnapshot from, or a DeleteSnapshot of an id another
//!    namespace's object owns is refused before any call about it (the snapshot's
//!    `status.snapshot_id` and `status.source_volume_id` are in the key its writer
//!    writes). An id without a record is taken as before (group members, records
//!    older than the owners).

use moor::api::*;
use moor::csi::policy::{Class, CsiError};
use moor::csi::{requests, v1};
use moor::runtime::controller::{Action, Config, Controller};
use moor::runtime::informer::Informer;
use moor::runtime::metrics::ControllerMetrics;
use moor::runtime::steps::{self, Failed};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

use super::owners::Owner;
use super::reports::Reports;
use super::volume_view::VolumeView;
use crate::agent::context::ControllerPluginCtx;
use crate::common::{details, object_ref};
use std::borrow::Cow;

/// The finalizer that holds a snapshot's deletion until DeleteSnapshot.
pub const FINALIZER: &str = SNAPSHOTTER_FINALIZER;

/// Why a snapshot could not be converged.
pub type SnapshotError = crate::agent::step_error::StepError;

/// What the snapshotter does next for a snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Not this plugin's, or converged.
    Nothing,
    /// Add the finalizer.
    AddFinalizer,
    /// The volume has no external id yet.
    WaitForVolume,
    /// CreateSnapshot from this external volume id (first time, or polling a plugin
    /// without GET_SNAPSHOT).
    Create(String),
    /// GetSnapshot of this snapshot id (cut, not yet ready to use).
    Poll(String),
    /// ListSnapshots of this snapshot id, made outside moor (imported).
    Import(String),
    /// DeleteSnapshot (asking CreateSnapshot again first when its id is unknown).
    Delete,
    /// The plugin cannot snapshot: Failed with this message.
    Refuse(String),
}

/// Whether `snap` is plugin `plugin`'s: the one its status records (once cut), else
/// its volume's.
pub fn ours(snap: &Snapshot, volume: Option<&Volume>, plugin: &PluginId) -> bool {
    match (&snap.status.plugin_id, volume) {
        (Some(p), _) => p == plugin,
        (None, Some(v)) => &v.spec.plugin_id == plugin,
        (None, None) => false,
    }
}

/// The step owed for `snap`, given its volume (if it exists) and the plugin's
/// controller capabilities; `plugin` is this snapshotter's plugin.
pub fn next(
    snap: &Snapshot,
    volume: Option<&Volume>,
    plugin: &PluginId,
    controller: &CapabilitySet<ControllerRpc>,
) -> Step {
    if !ours(snap, volume, plugin) {
        return Step::Nothing;
    }
    let has = |f: &str| snap.metadata.finalizers.iter().any(|x| x == f);
    if snap.is_deleting() {
        return if has(FINALIZER) {
            Step::Delete
        } else {
            Step::Nothing
        };
    }
    if snap.status.phase == SnapshotPhase::Ready && snap.status.ready_to_use {
        return Step::Nothing;
    }
    if let Some(id) = &snap.spec.snapshot_id {
        if !controller.has(ControllerRpc::ListSnapshots) {
            let msg = format!(
                "plugin {plugin} does not advertise LIST_SNAPSHOTS: a snapshot made outside moor cannot be imported"
            );
            if snap.status.phase == SnapshotPhase::Failed
                && snap.status.meta.last_error.as_deref() == Some(msg.as_str())
            {
                return Step::Nothing;
            }
            return Step::Refuse(msg);
        }
        if !has(FINALIZER) {
            return Step::AddFinalizer;
        }
        return Step::Import(id.clone());
    }
    if !controller.has(ControllerRpc::CreateDeleteSnapshot) {
        let msg = format!("plugin {plugin} does not advertise CREATE_DELETE_SNAPSHOT");
        if snap.status.phase == SnapshotPhase::Failed
            && snap.status.meta.last_error.as_deref() == Some(msg.as_str())
        {
            return Step::Nothing;
        }
        return Step::Refuse(msg);
    }
    if !has(FINALIZER) {
        return Step::AddFinalizer;
    }
    if let Some(id) = snap
        .status
        .snapshot_id
        .as_ref()
        .filter(|_| controller.has(ControllerRpc::GetSnapshot))
    {
        return Step::Poll(id.clone());
    }
    // Once cut, the source is what was recorded (the volume may have gone since).
    if let Some(src) = &snap.status.source_volume_id {
        return Step::Create(src.clone());
    }
    match volume.and_then(|v| v.status.provisioning.external_id.clone()) {
        Some(ext) if volume.is_some_and(|v| v.status.provisioning.phase == VolumePhase::Ready) => {
            Step::Create(ext.to_string())
        }
        _ => Step::WaitForVolume,
    }
}

/// The snapshotter of one plugin.
pub struct Snapshotter {
    /// Shared with the provisioner and the attacher.
    pub ctx: ControllerPluginCtx,
    /// Snapshots.
    pub snapshots: Informer<Snapshot>,
    /// Volumes, as viewed (a snapshot's volume is taken whole through
    /// `ControllerPluginCtx::read_volume`).
    pub volumes: Informer<VolumeView>,
    /// This plugin's reports on its snapshots.
    pub reports: Reports<SnapshotSpec>,
    /// Quotas: a snapshot is cut or imported only once every quota of its namespace
    /// charged it (the controller's charges).
    pub quotas: Informer<Quota>,
}

impl Snapshotter {
    /// Runs until `stop`.
    pub async fn run(self, metrics: ControllerMetrics, stop: CancellationToken) {
        let reader = self.snapshots.reader();
        let snapshots = reader.clone();
        let quoted = reader.clone();
        let this = Arc::new(self);
        Controller::new("snapshotter", reader, Config::default())
            .with_metrics(metrics)
            .owns(this.snapshots.subscribe())
            // A report whose snapshot is gone is deleted by the snapshot's pass.
            .watches(this.reports.cache.subscribe(), |r: &SnapshotReport| {
                r.about_key().into_iter().collect()
            })
            // A volume becoming ready lets its waiting snapshots be cut (snapshots are
            // few: a scan per volume change is cheap).
            .watches(this.volumes.subscribe(), move |v: &VolumeView| {
                snapshots
                    .state()
                    .iter()
                    .filter(|s| {
                        s.metadata.namespace == v.namespace
                            && s.spec.volume.as_str() == v.name.as_str()
                            && s.status.snapshot_id.is_none()
                    })
                    .map(|s| s.object_key())
                    .collect()
            })
            // A quota's charges changed: its namespace's snapshots not cut yet.
            .watches(this.quotas.subscribe(), move |q: &Quota| {
                quoted
                    .state()
                    .iter()
                    .filter(|s| {
                        s.metadata.namespace == q.metadata.namespace
                            && s.status.snapshot_id.is_none()
                    })
                    .map(|s| s.object_key())
                    .collect()
            })
            .run(
                |this: Arc<Self>, key| async move {
                    moor::runtime::steps::requeue_backing_off(
                        this.reconcile(key).await,
                        SnapshotError::backing_off,
                    )
                },
                this,
                stop,
            )
            .await;
    }

    async fn reconcile(&self, key: ObjectKey<SnapshotSpec>) -> Result<Action, SnapshotError> {
        let reader = self.snapshots.reader();
        reader.wait_until_ready().await;
        self.volumes.reader().wait_until_ready().await;
        self.reports.cache.reader().wait_until_ready().await;
        let Some(cached) = reader.get(&key) else {
            self.reports.forget(&key).await?;
            return Ok(Action::AwaitChange);
        };
        let snap_key = cached.object_key();
        let _guard = self.ctx.locks.lock(snap_key.as_str()).await;
        let Some(snap) = self.ctx.writer.fresh(&reader, &snap_key).await? else {
            self.reports.forget(&key).await?;
            return Ok(Action::AwaitChange);
        };
        // What this plugin reported of it, not what its key says (its requester's).
        let (snap, asked) = self.reports.reported_asking(&snap).await?;
        if snap.is_deleting() && asked == FinalizerAsk::Released {
            // Released: the controller drops the finalizer.
            return Ok(Action::AwaitChange);
        }
        let volume_key = Volume::key_for(&snap.metadata.namespace, &snap.spec.volume);
        let volume = (self.ctx)
            .read_volume(&self.volumes.reader(), &volume_key)
            .await?;
        let controller = self
            .ctx
            .supervisor
            .status(&self.ctx.plugin.id)
            .filter(|s| !s.capabilities.plugin.is_empty())
            .map(|s| s.capabilities.controller);
        let Some(controller) = controller else {
            // Not fingerprinted yet: decide once the capabilities are known.
            return Ok(Action::Requeue(Duration::from_secs(1)));
        };
        if !ours(&snap, volume.as_deref(), &self.ctx.plugin.id) {
            self.reports.forget(&key).await?;
            return Ok(Action::AwaitChange);
        }
        let step = next(&snap, volume.as_deref(), &self.ctx.plugin.id, &controller);
        // Cut or imported only once every quota of the namespace charged it.
        if matches!(step, Step::Create(_) | Step::Import(_)) {
            if let Some(why) = self.over_quota(&snap).await? {
                return self.waiting_for_quota(&snap, why).await;
            }
        }
        match step {
            Step::Nothing | Step::WaitForVolume => Ok(Action::AwaitChange),
            Step::AddFinalizer => {
                // The controller adds it; cut only once it is there.
                (self.reports)
                    .write(&snap, Some(FinalizerAsk::Hold), |_| {})
                    .await?;
                Ok(Action::AwaitChange)
            }
            Step::Refuse(msg) => {
                self.write_status(&snap, |st| {
                    st.phase = SnapshotPhase::Failed;
                    st.meta.last_error = Some(msg.clone());
                    st.meta
                        .set_condition("Created", false, "SnapshotsUnsupported", &msg);
                })
                .await?;
                self.event(&snap, "Snapshot create failed", EventType::Warning, msg)
                    .await;
                Ok(Action::AwaitChange)
            }
            Step::Create(src) => self.create(&snap, volume.as_deref(), src).await,
            Step::Poll(id) => self.poll(&snap, volume.as_deref(), id).await,
            Step::Import(id) => self.import(&snap, volume.as_deref(), id).await,
            Step::Delete => self.delete(&snap, volume.as_deref()).await,
        }
    }

    /// Waiting for a quota: the `Created` condition false with why, and a Warning,
    /// each once for the same why; the quota's next change looks again.
    async fn waiting_for_quota(
        &self,
        snap: &Snapshot,
        why: String,
    ) -> Result<Action, SnapshotError> {
        let shown = snap
            .status
            .meta
            .conditions
            .iter()
            .any(|c| c.type_ == "Created" && c.reason == "QuotaExceeded" && c.message == why);
        if !shown {
            self.write_status(snap, |st| {
                st.meta
                    .set_condition("Created", false, "QuotaExceeded", &why);
            })
            .await?;
            self.event(snap, "QuotaExceeded", EventType::Warning, why)
                .await;
        }
        Ok(Action::AwaitChange)
    }

    /// Why the namespace's quotas keep `snap` from being cut: a quota that has not
    /// charged it (read from etcd: a quota set just before is seen).
    async fn over_quota(&self, snap: &Snapshot) -> Result<Option<String>, SnapshotError> {
        super::provisioner::quota_gate(
            &self.ctx.reads,
            &snap.metadata.namespace,
            Charged::Snapshot,
            snap.metadata.name.as_str(),
            &snap.metadata.uid,
            0,
        )
        .await
        .map_err(crate::agent::step_error::StepError::from)
    }

    fn inputs(&self, snap: &Snapshot) -> u64 {
        steps::inputs((
            &snap.metadata.uid,
            snap.metadata.generation,
            self.ctx.supervisor.epoch(),
        ))
    }

    async fn create(
        &self,
        snap: &Snapshot,
        volume: Option<&Volume>,
        source: String,
    ) -> Result<Action, SnapshotError> {
        const STEP: &str = "CreateSnapshot";
        let key = snap.key();
        let step = self.ctx.steps.begin(&key, STEP, self.inputs(snap))?;
        // The source is the volume's (or the recorded) plugin volume: never another
        // namespace's.
        if let Some(why) = self.another_s(OwnedResource::Volume, &source, snap).await? {
            return self
                .failed(snap, step.fail(owned_elsewhere(STEP, &why)))
                .await;
        }
        let first = snap.status.source_volume_id.is_none();
        if first {
            // In doubt from here on: a deletion asks again before DeleteSnapshot.
            let plugin = self.ctx.plugin.id.clone();
            let src = source.clone();
            self.write_status(snap, |st| {
                st.phase = SnapshotPhase::Creating;
                st.plugin_id = Some(plugin.clone());
                st.source_volume_id = Some(src.clone());
            })
            .await?;
        }
        let (s, v) = self.for_calls(snap, volume).await?;
        let req = requests::create_snapshot(&s, v.as_deref(), &source)?;
        let csi = self.ctx.csi()?.about(object_ref(snap));
        let answer = step
            .call(async { cut(STEP, csi.create_snapshot(req).await?.snapshot) })
            .await;
        self.record(snap, STEP, answer).await
    }

    /// The snapshot and its volume as the snapshot calls see them: the Secret the
    /// snapshot names, else its own secrets, else the volume's snapshot Secret, else
    /// the volume's secrets ([`requests::snapshot_secrets`]), each Secret read now.
    async fn for_calls<'a>(
        &self,
        snap: &'a Snapshot,
        volume: Option<&'a Volume>,
    ) -> Result<(Cow<'a, Snapshot>, Option<Cow<'a, Volume>>), SnapshotError> {
        let s = match &snap.spec.secret_ref {
            None => Cow::Borrowed(snap),
            Some(_) => {
                let book = self.ctx.secret_book().await;
                match snap.with_secret(&self.ctx.plugin.id, book) {
                    Ok(s) => s,
                    Err(missing) => {
                        let msg = missing.to_string();
                        self.event(snap, "Secret missing", EventType::Warning, msg)
                            .await;
                        return Err(missing.into());
                    }
                }
            }
        };
        let v = match volume {
            Some(v) if s.spec.secrets.is_empty() => {
                Some(self.ctx.for_family(v, SecretFamily::Snapshot).await?)
            }
            v => v.map(Cow::Borrowed),
        };
        Ok((s, v))
    }

    /// What `snap`'s namespace may be told of the owner of plugin `resource` `id`, when
    /// an object of another namespace owns it; `None` when it is `snap`'s, its
    /// namespace's or nobody's.
    async fn another_s(
        &self,
        resource: OwnedResource,
        id: &str,
        snap: &Snapshot,
    ) -> Result<Option<String>, SnapshotError> {
        Ok(match self.ctx.owner(resource, id, snap).await?.0 {
            Owner::Another(why) => Some(why),
            _ => None,
        })
    }

    /// GetSnapshot of a snapshot cut but not yet ready to use.
    async fn poll(
        &self,
        snap: &Snapshot,
        volume: Option<&Volume>,
        id: String,
    ) -> Result<Action, SnapshotError> {
        const STEP: &str = "GetSnapshot";
        let key = snap.key();
        let step = self.ctx.steps.begin(&key, STEP, self.inputs(snap))?;
        // The id is the status's word: never another namespace's snapshot.
        if let Some(why) = self.another_s(OwnedResource::Snapshot, &id, snap).await? {
            return self
                .failed(snap, step.fail(owned_elsewhere(STEP, &why)))
                .await;
        }
        let (s, v) = self.for_calls(snap, volume).await?;
        let req = requests::get_snapshot(&s, v.as_deref(), &id)?;
        let csi = self.ctx.csi()?;
        let answer = step
            .call(async { cut(STEP, csi.get_snapshot(req).await?.snapshot) })
            .await;
        self.record(snap, STEP, answer).await
    }

    /// ListSnapshots of a snapshot made outside moor, by its id: recorded as cut when
    /// the plugin lists it as a snapshot of the volume's external id (a volume not
    /// created yet is not compared), failed with the reason otherwise.
    async fn import(
        &self,
        snap: &Snapshot,
        volume: Option<&Volume>,
        id: String,
    ) -> Result<Action, SnapshotError> {
        const STEP: &str = "ListSnapshots";
        let key = snap.key();
        let step = self.ctx.steps.begin(&key, STEP, self.inputs(snap))?;
        if let Some(why) = self.another_s(OwnedResource::Snapshot, &id, snap).await? {
            return self
                .failed(snap, step.fail(owned_elsewhere(STEP, &why)))
                .await;
        }
        let (s, v) = self.for_calls(snap, volume).await?;
        let req = requests::list_snapshot(&s, v.as_deref(), &id)?;
        let source = volume.and_then(|v| v.status.provisioning.external_id.clone());
        let plugin = self.ctx.plugin.id.clone();
        let csi = self.ctx.csi()?;
        let answer = step
            .call(async {
                let listed = csi.list_snapshots(req).await?;
                let found = listed
                    .entries
                    .into_iter()
                    .filter_map(|e| e.snapshot)
                    .find(|s| s.snapshot_id == id);
                let refuse = |message: String| CsiError {
                    rpc: STEP,
                    code: tonic::Code::NotFound,
                    message,
                    tries: 1,
                };
                let Some(found) = found else {
                    return Err(refuse(format!("plugin {plugin} lists no snapshot {id}")));
                };
                if let Some(src) = source.filter(|s| s.as_str() != found.source_volume_id) {
                    return Err(refuse(format!(
                        "snapshot {id} was taken of the plugin's volume {}, not of {} ({src})",
                        found.source_volume_id, snap.spec.volume
                    )));
                }
                Ok(found)
            })
            .await;
        self.record(snap, STEP, answer).await
    }

    /// Records what CreateSnapshot or GetSnapshot (`step`) said of the snapshot: Ready
    /// once it is ready to use, else Creating and asked again in a second.
    async fn record(
        &self,
        snap: &Snapshot,
        step: &'static str,
        answer: Result<v1::Snapshot, Failed>,
    ) -> Result<Action, SnapshotError> {
        let cut = match answer {
            Ok(cut) => cut,
            Err(failed) => return self.failed(snap, failed).await,
        };
        // This snapshot's id from now on, unless a snapshot of another namespace has
        // it (a plugin that answered with another's).
        if let Err(why) = self
            .ctx
            .take_ownership(OwnedResource::Snapshot, &cut.snapshot_id, snap)
            .await?
        {
            let failed = self
                .ctx
                .steps
                .begin(&snap.key(), step, self.inputs(snap))?
                .fail(owned_elsewhere(step, &why));
            return self.failed(snap, failed).await;
        }
        let ready = cut.ready_to_use;
        let generation = snap.metadata.generation;
        let plugin = &self.ctx.plugin.id;
        self.write_status(snap, |st| {
            st.phase = if ready {
                SnapshotPhase::Ready
            } else {
                SnapshotPhase::Creating
            };
            st.snapshot_id = Some(cut.snapshot_id.clone());
            // The plugin that holds it and what it was taken of: recorded before a
            // CreateSnapshot, learned here for an import.
            st.plugin_id.get_or_insert_with(|| plugin.clone());
            if st.source_volume_id.is_none() && !cut.source_volume_id.is_empty() {
                st.source_volume_id = Some(cut.source_volume_id.clone());
            }
            st.size_bytes = (cut.size_bytes > 0).then_some(cut.size_bytes as u64);
            st.creation_time = moor::csi::convert::time_of(cut.creation_time.as_ref());
            st.ready_to_use = ready;
            st.meta.clear_failure();
            st.meta.observed_generation = generation;
            st.meta.set_condition("Created", true, step, "");
        })
        .await?;
        if ready {
            self.event(
                snap,
                "Snapshot created",
                EventType::Normal,
                format!("{} cut from {}", cut.snapshot_id, snap.spec.volume),
            )
            .await;
            return Ok(Action::AwaitChange);
        }
        // Not ready to use yet (a plugin still uploading): ask again.
        Ok(Action::Requeue(Duration::from_secs(1)))
    }

    /// DeleteSnapshot, on its step's schedule. A snapshot whose CreateSnapshot may have
    /// taken effect unanswered has no id yet: CreateSnapshot is asked again first (by
    /// name) to learn it, as part of the same step, so a failing plugin is asked no
    /// more often than the schedule says, whatever triggers the reconcile.
    async fn delete(
        &self,
        snap: &Snapshot,
        volume: Option<&Volume>,
    ) -> Result<Action, SnapshotError> {
        let key = snap.key();
        let mut id = snap.status.snapshot_id.clone();
        let in_doubt = id.is_none() && snap.status.source_volume_id.is_some();
        let imported = snap.spec.snapshot_id.is_some();
        if imported {
            // Made outside moor: kept in the plugin.
            self.ctx.steps.forget(&key);
            if let Some(id) = &id {
                self.event(
                    snap,
                    "Snapshot released",
                    EventType::Normal,
                    format!("{id} kept in the plugin (imported)"),
                )
                .await;
            }
        } else if id.is_some() || in_doubt {
            let step = self
                .ctx
                .steps
                .begin(&key, "DeleteSnapshot", self.inputs(snap))?;
            let csi = self.ctx.csi()?.about(object_ref(snap));
            // A cut in doubt is found by cutting again (idempotent by name): only of
            // a plugin volume no other namespace owns (the source is the status's word).
            let src = match (&id, &snap.status.source_volume_id) {
                (None, Some(src)) => self
                    .another_s(OwnedResource::Volume, src, snap)
                    .await?
                    .is_none()
                    .then_some(src),
                _ => None,
            };
            if let Some(src) = src {
                let (s, v) = self.for_calls(snap, volume).await?;
                let req = requests::create_snapshot(&s, v.as_deref(), src)?;
                match csi.create_snapshot(req).await {
                    Ok(r) => id = r.snapshot.map(|s| s.snapshot_id).filter(|s| !s.is_empty()),
                    // The volume is gone, or the plugin refuses for good: nothing was cut.
                    Err(e) if e.class() == Class::Final => {}
                    Err(e) => return self.failed(snap, step.fail(e)).await,
                }
            }
            let owner = match &id {
                Some(id) => self.ctx.owner(OwnedResource::Snapshot, id, snap).await?.0,
                None => Owner::Nobody,
            };
            match (id, owner) {
                (Some(_), Owner::Another(why)) => {
                    self.not_deleted(snap, &why).await;
                }
                (Some(_), Owner::Shared) => {
                    self.not_deleted(snap, "shared with this namespace by its owner's")
                        .await;
                }
                (Some(_), Owner::Sibling) => {
                    self.not_deleted(snap, "owned by another snapshot of this namespace")
                        .await;
                }
                (Some(id), _) => {
                    let (s, v) = self.for_calls(snap, volume).await?;
                    let req = requests::delete_snapshot(&s, v.as_deref(), &id)?;
                    if let Err(failed) = step.call(csi.delete_snapshot(req)).await {
                        return self.failed(snap, failed).await;
                    }
                    self.ctx
                        .drop_ownership(OwnedResource::Snapshot, &id, snap)
                        .await?;
                    self.event(
                        snap,
                        "Snapshot deleted",
                        EventType::Normal,
                        format!("{id} deleted"),
                    )
                    .await;
                }
                (None, _) => {}
            }
            self.ctx.steps.forget(&key);
        }
        // The controller removes the finalizer.
        (self.reports)
            .write(snap, Some(FinalizerAsk::Released), |_| {})
            .await?;
        Ok(Action::AwaitChange)
    }

    /// A snapshot whose plugin id another object owns (`why`): deleted from moor with
    /// no call about the id, said in a Warning.
    async fn not_deleted(&self, snap: &Snapshot, why: &str) {
        self.event(
            snap,
            "Snapshot not deleted from the plugin",
            EventType::Warning,
            format!("the plugin snapshot its status names is {why}: no DeleteSnapshot; only the snapshot is deleted"),
        )
        .await;
    }

    /// A failed step: its failure and the retry on the status, a Warning; a final
    /// answer to CreateSnapshot makes the snapshot Failed (retried at the cap or when
    /// its spec changes).
    async fn failed(&self, snap: &Snapshot, failed: Failed) -> Result<Action, SnapshotError> {
        let step = failed.failure.step.clone();
        let msg = failed.message();
        let refused = step == "CreateSnapshot" && failed.is_final();
        let deleting = step == "DeleteSnapshot";
        self.write_status(snap, |st| {
            if refused {
                st.phase = SnapshotPhase::Failed;
            }
            failed.record(&mut st.meta);
            let cond = if deleting { "Deleted" } else { "Created" };
            st.meta
                .set_condition(cond, false, &format!("{step}Failed"), &msg);
        })
        .await?;
        let reason = if deleting {
            "Snapshot delete failed"
        } else {
            "Snapshot create failed"
        };
        self.event(snap, reason, EventType::Warning, msg).await;
        Ok(Action::Requeue(failed.retry_in))
    }

    async fn write_status(
        &self,
        snap: &Snapshot,
        mut f: impl FnMut(&mut SnapshotStatus),
    ) -> Result<(), SnapshotError> {
        self.reports.write(snap, None, |st| f(st)).await?;
        Ok(())
    }

    async fn event(&self, snap: &Snapshot, reason: &str, type_: EventType, message: String) {
        let d = details([("volume_id", snap.spec.volume.to_string())]);
        self.ctx
            .recorder
            .record(object_ref(snap), type_, reason, message, d)
            .await;
    }
}

/// The snapshot an answer of `rpc` names; one without an id is an error.
/// A final answer for a step refused because an object of another namespace owns the
/// id it is about (`why`, [`owner_for`]).
fn owned_elsewhere(rpc: &'static str, why: &str) -> CsiError {
    CsiError {
        rpc,
        code: tonic::Code::AlreadyExists,
        message: format!("the plugin's id is {why}: this snapshot may not use it"),
        tries: 0,
    }
}

fn cut(rpc: &'static str, snapshot: Option<v1::Snapshot>) -> Result<v1::Snapshot, CsiError> {
    snapshot
        .filter(|s| !s.snapshot_id.is_empty())
        .ok_or_else(|| CsiError {
            rpc,
            code: tonic::Code::Internal,
            message: format!("{rpc} answered without a snapshot id"),
            tries: 1,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plugin() -> PluginId {
        PluginId::new("p").unwrap()
    }

    fn caps(rpcs: &[ControllerRpc]) -> CapabilitySet<ControllerRpc> {
        rpcs.iter().copied().collect()
    }

    fn snap() -> Snapshot {
        Snapshot::new(
            &Namespace::default_ns(),
            Name::new("s").unwrap(),
            SnapshotSpec {
                volume: VolumeId::new("v").unwrap(),
                ..Default::default()
            },
        )
    }

    fn volume(ready: bool) -> Volume {
        let mut v = Volume::new(
            &Namespace::default_ns(),
            Name::new("v").unwrap(),
            VolumeSpec {
                plugin_id: plugin(),
                ..Default::default()
            },
        );
        if ready {
            v.status.provisioning.phase = VolumePhase::Ready;
            v.status.provisioning.external_id = Some(ExternalVolumeId::new("e1").unwrap());
        }
        v
    }

    #[test]
    fn a_snapshot_is_cut_once_its_volume_is_created_and_deleted_through_the_plugin() {
        let all = caps(&[ControllerRpc::CreateDeleteSnapshot]);
        let mut s = snap();
        assert_eq!(
            next(&s, Some(&volume(true)), &plugin(), &all),
            Step::AddFinalizer
        );
        s.metadata.finalizers.push(FINALIZER.into());
        assert_eq!(
            next(&s, Some(&volume(false)), &plugin(), &all),
            Step::WaitForVolume
        );
        assert_eq!(
            next(&s, Some(&volume(true)), &plugin(), &all),
            Step::Create("e1".into())
        );
        // Another plugin's volume, or no volume and never cut: not ours.
        assert_eq!(
            next(&s, Some(&volume(true)), &PluginId::new("q").unwrap(), &all),
            Step::Nothing
        );
        assert_eq!(next(&s, None, &plugin(), &all), Step::Nothing);
        // Cut, not yet ready to use: polled from the recorded source, even with the
        // volume gone.
        s.status.plugin_id = Some(plugin());
        s.status.source_volume_id = Some("e1".into());
        s.status.phase = SnapshotPhase::Creating;
        assert_eq!(next(&s, None, &plugin(), &all), Step::Create("e1".into()));
        // Its id known: polled with GetSnapshot where the plugin has it.
        s.status.snapshot_id = Some("snap-1".into());
        assert_eq!(next(&s, None, &plugin(), &all), Step::Create("e1".into()));
        let with_get = caps(&[
            ControllerRpc::CreateDeleteSnapshot,
            ControllerRpc::GetSnapshot,
        ]);
        assert_eq!(
            next(&s, None, &plugin(), &with_get),
            Step::Poll("snap-1".into())
        );
        s.status.phase = SnapshotPhase::Ready;
        s.status.ready_to_use = true;
        assert_eq!(next(&s, None, &plugin(), &all), Step::Nothing);
        s.metadata.deletion_timestamp = Some(Timestamp::now());
        assert_eq!(next(&s, None, &plugin(), &all), Step::Delete);
        s.metadata.finalizers.clear();
        assert_eq!(next(&s, None, &plugin(), &all), Step::Nothing);
    }

    #[test]
    fn an_imported_snapshot_is_found_by_id_and_never_cut() {
        let list = caps(&[ControllerRpc::ListSnapshots]);
        let mut s = snap();
        s.spec.snapshot_id = Some("made-elsewhere".into());
        assert_eq!(
            next(&s, Some(&volume(true)), &plugin(), &list),
            Step::AddFinalizer
        );
        s.metadata.finalizers.push(FINALIZER.into());
        // No CREATE_DELETE_SNAPSHOT needed; the volume need not be created yet.
        for v in [volume(true), volume(false)] {
            assert_eq!(
                next(&s, Some(&v), &plugin(), &list),
                Step::Import("made-elsewhere".into())
            );
        }
        // Found but not ready to use: asked again the same way, even with the
        // plugin's GetSnapshot.
        s.status.plugin_id = Some(plugin());
        s.status.snapshot_id = Some("made-elsewhere".into());
        s.status.phase = SnapshotPhase::Creating;
        let both = caps(&[ControllerRpc::ListSnapshots, ControllerRpc::GetSnapshot]);
        assert_eq!(
            next(&s, None, &plugin(), &both),
            Step::Import("made-elsewhere".into())
        );
        s.status.phase = SnapshotPhase::Ready;
        s.status.ready_to_use = true;
        assert_eq!(next(&s, None, &plugin(), &both), Step::Nothing);
        // Without LIST_SNAPSHOTS: refused once, never called.
        let mut t = snap();
        t.spec.snapshot_id = Some("x".into());
        let all = caps(&[ControllerRpc::CreateDeleteSnapshot]);
        let Step::Refuse(msg) = next(&t, Some(&volume(true)), &plugin(), &all) else {
            panic!("not refused")
        };
        assert!(msg.contains("LIST_SNAPSHOTS"), "{msg}");
        t.status.phase = SnapshotPhase::Failed;
        t.status.meta.last_error = Some(msg);
        assert_eq!(
            next(&t, Some(&volume(true)), &plugin(), &all),
            Step::Nothing
        );
    }

    #[test]
    fn an_import_s_snapshot_id_is_checked() {
        let mut spec = snap().spec;
        for (id, ok) in [("snap-1", true), ("", false), ("a\nb", false)] {
            spec.snapshot_id = Some(id.to_string());
            let mut e = ValidationErrors::default();
            spec.validate(&mut e);
            assert_eq!(e.is_empty(), ok, "{id:?}: {e}");
        }
        spec.snapshot_id = Some("x".repeat(MAX_SNAPSHOT_ID_BYTES + 1));
        let mut e = ValidationErrors::default();
        spec.validate(&mut e);
        assert!(!e.is_empty());
    }

    #[test]
    fn a_plugin_without_snapshots_is_refused_once() {
        let mut s = snap();
        let Step::Refuse(msg) = next(&s, Some(&volume(true)), &plugin(), &caps(&[])) else {
            panic!("not refused")
        };
        s.status.phase = SnapshotPhase::Failed;
        s.status.meta.last_error = Some(msg);
        assert_eq!(
            next(&s, Some(&volume(true)), &plugin(), &caps(&[])),
            Step::Nothing
        );
    }
}
