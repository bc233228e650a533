//! The group snapshotter: CreateVolumeGroupSnapshot / DeleteVolumeGroupSnapshot /
//! GetVolumeGroupSnapshot for the VolumeGroupSnapshots of one plugin's volumes, run by
//! the agent leading that plugin's election beside the snapshotter. It writes what it
//! observes of a group in its report ([`VolumeGroupSnapshotReport`],
//! [`super::reports`]): the status, and what it asks of the
//! `moor.dev/group-snapshotter` finalizer; the controller copies it, adds or removes
//! the finalizer, and makes and deletes the member Snapshots the status lists (issue
//! 77: the agent writes no group and no Snapshot). Its own report's status is the one
//! it acts on.
//!
//! Expected flow for a group (decided by [`next`], pure and unit tested):
//! 1. Its volumes' plugin is this one (or, once cut, `status.plugin_id` is); volumes of
//!    more than one plugin are Failed, never called.
//! 2. The plugin must advertise GROUP_CONTROLLER_SERVICE and
//!    CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT: otherwise Failed with a Warning.
//! 3. Ask for the finalizer (`Hold`) and wait until the controller added it; wait
//!    until every volume is created (its external id).
//! 4. One CreateVolumeGroupSnapshot named by its namespace, name and uid (`plugin_name`, idempotent) of the
//!    volumes' external ids, recorded before the call (in doubt from then on). The
//!    answer must hold one snapshot of each volume asked (the contract monitor's
//!    `group_members_mismatch` otherwise, and the group Failed with the reason);
//!    recorded as the group's id and members. Not yet ready to use: asked again
//!    (GetVolumeGroupSnapshot) until it is.
//! 5. Ready: the controller makes each member a Snapshot `GROUP-VOLUME` (`spec.group`,
//!    its `snapshot_id` and a Ready status), once (condition `MembersCreated`): one the
//!    user deletes later is not made again, and its snapshot stays in the plugin until
//!    the group goes.
//! 6. Imported (`spec.group_snapshot_id`): GetVolumeGroupSnapshot of that id instead of
//!    a cut; its members must be of the volumes named, as above.
//! 7. Deleted: DeleteVolumeGroupSnapshot with every member's id (NotFound is done; a
//!    group whose create was in doubt is asked for again first, so it is not leaked),
//!    an imported group kept in the plugin; then the finalizer is reported `Released`
//!    and the controller deletes the member Snapshots and removes it.

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

use super::reports::Reports;
use super::volume_view::VolumeView;
use crate::agent::context::ControllerPluginCtx;
use crate::agent::owners::Owner;
use crate::common::{details, object_ref};

/// The finalizer that holds a group's deletion until DeleteVolumeGroupSnapshot.
pub const FINALIZER: &str = GROUP_SNAPSHOTTER_FINALIZER;

/// Why a group could not be converged.
pub type GroupError = crate::agent::step_error::StepError;

/// What the group snapshotter does next for a group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Not this plugin's, or converged.
    Nothing,
    /// Add the finalizer.
    AddFinalizer,
    /// A volume is not created yet.
    WaitForVolumes,
    /// CreateVolumeGroupSnapshot of these external volume ids.
    Create(Vec<String>),
    /// GetVolumeGroupSnapshot of this group id (cut, not yet ready to use).
    Poll(String),
    /// GetVolumeGroupSnapshot of this group id, made outside moor (imported), whose
    /// members must be of these external volume ids.
    Import(String, Vec<String>),
    /// DeleteVolumeGroupSnapshot.
    Delete,
    /// Failed with this message, never called.
    Refuse(String),
}

/// Whether `group` is plugin `plugin`'s: the one its status records (once cut), else
/// its first existing volume's (`first`).
pub fn ours(group: &VolumeGroupSnapshot, first: Option<&Volume>, plugin: &PluginId) -> bool {
    match (&group.status.plugin_id, first) {
        (Some(p), _) => p == plugin,
        (None, Some(v)) => &v.spec.plugin_id == plugin,
        (None, None) => false,
    }
}

/// The step owed for `group`, given its volumes (in `spec.volumes` order, `None` for
/// one that does not exist) and the plugin's capabilities; `plugin` is this
/// snapshotter's plugin.
pub fn next(
    group: &VolumeGroupSnapshot,
    volumes: &[Option<&Volume>],
    plugin: &PluginId,
    caps: &PluginCapabilities,
) -> Step {
    let first = volumes.iter().flatten().next();
    if !ours(group, first.copied(), plugin) {
        return Step::Nothing;
    }
    let has = |f: &str| group.metadata.finalizers.iter().any(|x| x == f);
    if group.is_deleting() {
        return if has(FINALIZER) {
            Step::Delete
        } else {
            Step::Nothing
        };
    }
    let st = &group.status;
    if st.phase == SnapshotPhase::Ready && st.ready_to_use {
        // The controller makes the members.
        return Step::Nothing;
    }
    let refuse = |msg: String| {
        if st.phase == SnapshotPhase::Failed && st.meta.last_error.as_deref() == Some(&msg) {
            Step::Nothing
        } else {
            Step::Refuse(msg)
        }
    };
    if let Some(v) = volumes
        .iter()
        .flatten()
        .find(|v| &v.spec.plugin_id != plugin)
    {
        return refuse(format!(
            "volume {} is of plugin {}, not {plugin}: a group snapshot is of one plugin's volumes",
            v.metadata.name, v.spec.plugin_id
        ));
    }
    let serves = caps.plugin.has(PluginCapability::Service(
        PluginService::GroupControllerService,
    )) && caps.group.has(GroupRpc::CreateDeleteGetVolumeGroupSnapshot);
    if !serves {
        return refuse(format!(
            "plugin {plugin} does not advertise GROUP_CONTROLLER_SERVICE with CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT"
        ));
    }
    if !has(FINALIZER) {
        return Step::AddFinalizer;
    }
    let sources: Option<Vec<String>> = volumes
        .iter()
        .map(|v| {
            v.filter(|v| v.status.provisioning.phase == VolumePhase::Ready)
                .and_then(|v| v.status.provisioning.external_id.as_ref())
                .map(|e| e.to_string())
        })
        .collect();
    if let Some(id) = &group.spec.group_snapshot_id {
        // The volumes' ids are what the members are matched against.
        return match sources {
            Some(s) => Step::Import(id.clone(), s),
            None => Step::WaitForVolumes,
        };
    }
    if let Some(id) = &st.group_snapshot_id {
        // A group whose answer did not match its volumes stays Failed until its spec
        // changes (or it is deleted, which deletes what was cut).
        if st.phase == SnapshotPhase::Failed
            && st.meta.observed_generation == group.metadata.generation
        {
            return Step::Nothing;
        }
        return Step::Poll(id.clone());
    }
    // Once asked, the sources are what was recorded (a volume may have gone since).
    if !st.source_volume_ids.is_empty() {
        return Step::Create(st.source_volume_ids.clone());
    }
    match sources {
        Some(s) => Step::Create(s),
        None => Step::WaitForVolumes,
    }
}

/// Matches a group's answer to the volumes asked: the member of each volume (by its
/// external id `sources[i]`), in that order; `None` when the answer is not one
/// snapshot of each.
fn members(
    group: &VolumeGroupSnapshot,
    sources: &[String],
    answer: &v1::VolumeGroupSnapshot,
) -> Result<Vec<GroupMember>, String> {
    let mut out = Vec::new();
    for (volume, src) in group.spec.volumes.iter().zip(sources) {
        let mut of = answer
            .snapshots
            .iter()
            .filter(|s| &s.source_volume_id == src);
        let (Some(s), None) = (of.next(), of.next()) else {
            return Err(format!(
                "the plugin's group {} does not hold exactly one snapshot of volume {volume} ({src})",
                answer.group_snapshot_id
            ));
        };
        out.push(GroupMember {
            volume: volume.clone(),
            snapshot: group.member_name(volume)?,
            snapshot_id: s.snapshot_id.clone(),
            source_volume_id: src.clone(),
            size_bytes: (s.size_bytes > 0).then_some(s.size_bytes as u64),
        });
    }
    if answer.snapshots.len() != out.len() {
        return Err(format!(
            "the plugin's group {} holds {} snapshots for {} volumes",
            answer.group_snapshot_id,
            answer.snapshots.len(),
            out.len()
        ));
    }
    Ok(out)
}

/// The group snapshotter of one plugin.
pub struct GroupSnapshotter {
    /// Shared with the provisioner and the snapshotter.
    pub ctx: ControllerPluginCtx,
    /// Group snapshots.
    pub groups: Informer<VolumeGroupSnapshot>,
    /// Volumes, as viewed (a group's volumes are taken whole through
    /// `ControllerPluginCtx::read_volume`).
    pub volumes: Informer<VolumeView>,
    /// This plugin's reports on its groups.
    pub reports: Reports<VolumeGroupSnapshotSpec>,
}

impl GroupSnapshotter {
    /// Runs until `stop`.
    pub async fn run(self, metrics: ControllerMetrics, stop: CancellationToken) {
        let reader = self.groups.reader();
        let groups = reader.clone();
        let this = Arc::new(self);
        Controller::new("group-snapshotter", reader, Config::default())
            .with_metrics(metrics)
            .owns(this.groups.subscribe())
            // A report whose group is gone is deleted by the group's pass.
            .watches(
                this.reports.cache.subscribe(),
                |r: &VolumeGroupSnapshotReport| r.about_key().into_iter().collect(),
            )
            // A volume becoming ready lets the groups waiting for it be cut.
            .watches(this.volumes.subscribe(), move |v: &VolumeView| {
                groups
                    .state()
                    .iter()
                    .filter(|g| {
                        g.metadata.namespace == v.namespace
                            && g.spec.volumes.iter().any(|n| n.as_str() == v.name.as_str())
                            && g.status.group_snapshot_id.is_none()
                    })
                    .map(|g| g.object_key())
                    .collect()
            })
            .run(
                |this: Arc<Self>, key| async move {
                    steps::requeue_backing_off(this.reconcile(key).await, GroupError::backing_off)
                },
                this,
                stop,
            )
            .await;
    }

    async fn reconcile(
        &self,
        key: ObjectKey<VolumeGroupSnapshotSpec>,
    ) -> Result<Action, GroupError> {
        let reader = self.groups.reader();
        reader.wait_until_ready().await;
        self.volumes.reader().wait_until_ready().await;
        self.reports.cache.reader().wait_until_ready().await;
        let Some(cached) = reader.get(key.as_str()) else {
            self.reports.forget(&key).await?;
            return Ok(Action::AwaitChange);
        };
        let group_key = cached.object_key();
        let _guard = self.ctx.locks.lock(group_key.as_str()).await;
        let Some(group) = self.ctx.writer.fresh(&reader, &group_key).await? else {
            self.reports.forget(&key).await?;
            return Ok(Action::AwaitChange);
        };
        // What this plugin reported of it, not what its key says (its requester's).
        let (group, asked) = self.reports.reported_asking(&group).await?;
        if group.is_deleting() && asked == FinalizerAsk::Released {
            // Released: the controller deletes the members and drops the finalizer.
            return Ok(Action::AwaitChange);
        }
        let mut volumes: Vec<Option<Arc<Volume>>> = Vec::new();
        for v in &group.spec.volumes {
            let key = Volume::key_for(&group.metadata.namespace, v);
            volumes.push(self.ctx.read_volume(&self.volumes.reader(), &key).await?);
        }
        let refs: Vec<Option<&Volume>> = volumes.iter().map(|v| v.as_deref()).collect();
        let caps = self
            .ctx
            .supervisor
            .status(&self.ctx.plugin.id)
            .filter(|s| !s.capabilities.plugin.is_empty())
            .map(|s| s.capabilities);
        let Some(caps) = caps else {
            // Not fingerprinted yet: decide once the capabilities are known.
            return Ok(Action::Requeue(Duration::from_secs(1)));
        };
        let first = refs.iter().flatten().next().copied();
        if !ours(&group, first, &self.ctx.plugin.id) {
            self.reports.forget(&key).await?;
            return Ok(Action::AwaitChange);
        }
        match next(&group, &refs, &self.ctx.plugin.id, &caps) {
            Step::Nothing | Step::WaitForVolumes => Ok(Action::AwaitChange),
            Step::AddFinalizer => {
                // The controller adds it; cut only once it is there.
                (self.reports)
                    .write(&group, Some(FinalizerAsk::Hold), |_| {})
                    .await?;
                Ok(Action::AwaitChange)
            }
            Step::Refuse(msg) => {
                self.write_status(&group, |st| {
                    st.phase = SnapshotPhase::Failed;
                    st.meta.last_error = Some(msg.clone());
                    st.meta
                        .set_condition("Created", false, "GroupSnapshotsUnsupported", &msg);
                })
                .await?;
                self.event(
                    &group,
                    "Group snapshot create failed",
                    EventType::Warning,
                    msg,
                )
                .await;
                Ok(Action::AwaitChange)
            }
            Step::Create(sources) => {
                let first = self.for_calls(&group, first).await?;
                self.create(&group, first.as_deref(), sources).await
            }
            Step::Poll(id) => {
                let sources = group.status.source_volume_ids.clone();
                let first = self.for_calls(&group, first).await?;
                self.get(&group, first.as_deref(), id, sources).await
            }
            Step::Import(id, sources) => {
                let first = self.for_calls(&group, first).await?;
                self.get(&group, first.as_deref(), id, sources).await
            }
            Step::Delete => {
                let first = self.for_calls(&group, first).await?;
                self.delete(&group, first.as_deref()).await
            }
        }
    }

    fn inputs(&self, group: &VolumeGroupSnapshot) -> u64 {
        steps::inputs((
            &group.metadata.uid,
            group.metadata.generation,
            self.ctx.supervisor.epoch(),
        ))
    }

    /// The group's first volume as the group calls see it, when the group has no
    /// secrets of its own: with the Secret it names for snapshot calls, read now.
    async fn for_calls<'a>(
        &self,
        group: &VolumeGroupSnapshot,
        first: Option<&'a Volume>,
    ) -> Result<Option<std::borrow::Cow<'a, Volume>>, GroupError> {
        match first {
            Some(v) if group.spec.secrets.is_empty() => {
                Ok(Some(self.ctx.for_family(v, SecretFamily::Snapshot).await?))
            }
            v => Ok(v.map(std::borrow::Cow::Borrowed)),
        }
    }

    /// One CreateVolumeGroupSnapshot of `sources`, recorded before it is sent.
    async fn create(
        &self,
        group: &VolumeGroupSnapshot,
        first: Option<&Volume>,
        sources: Vec<String>,
    ) -> Result<Action, GroupError> {
        const STEP: &str = "CreateVolumeGroupSnapshot";
        let key = group.key();
        let step = self.ctx.steps.begin(&key, STEP, self.inputs(group))?;
        // The sources are the volumes' (or the recorded) plugin volumes: never another
        // namespace's.
        if let Some(why) = self.not_its(group, &sources, None, &[]).await? {
            return self
                .failed(group, step.fail(owned_elsewhere(STEP, &why)))
                .await;
        }
        if group.status.source_volume_ids.is_empty() {
            // In doubt from here on: a deletion asks again before deleting.
            let plugin = self.ctx.plugin.id.clone();
            let src = sources.clone();
            self.write_status(group, |st| {
                st.phase = SnapshotPhase::Creating;
                st.plugin_id = Some(plugin.clone());
                st.source_volume_ids = src.clone();
            })
            .await?;
        }
        let req = requests::create_group_snapshot(group, first, &sources)?;
        let csi = self.ctx.csi()?.about(object_ref(group));
        let answer = step
            .call(async {
                let r = csi.create_group_snapshot(req).await?;
                answered(STEP, r.group_snapshot)
            })
            .await;
        self.record(group, STEP, &sources, answer).await
    }

    /// GetVolumeGroupSnapshot: of a group cut but not ready yet, or of one made
    /// outside moor; its members must be of `sources`.
    async fn get(
        &self,
        group: &VolumeGroupSnapshot,
        first: Option<&Volume>,
        id: String,
        sources: Vec<String>,
    ) -> Result<Action, GroupError> {
        const STEP: &str = "GetVolumeGroupSnapshot";
        let key = group.key();
        let step = self.ctx.steps.begin(&key, STEP, self.inputs(group))?;
        let known: Vec<String> = group
            .status
            .members
            .iter()
            .map(|m| m.snapshot_id.clone())
            .collect();
        // The ids are the status's (or an import's) word: never another namespace's.
        if let Some(why) = self.not_its(group, &[], Some(&id), &known).await? {
            return self
                .failed(group, step.fail(owned_elsewhere(STEP, &why)))
                .await;
        }
        let req = requests::get_group_snapshot(group, first, &id, known)?;
        let csi = self.ctx.csi()?.about(object_ref(group));
        let answer = step
            .call(async {
                let r = csi.get_group_snapshot(req, &sources).await?;
                answered(STEP, r.group_snapshot)
            })
            .await;
        self.record(group, STEP, &sources, answer).await
    }

    /// Records what the group call (`step`) answered: the group's id and members,
    /// Ready once ready to use (the members are then made), else Creating and asked
    /// again in a second. An answer whose members are not one of each volume is a
    /// breach of the contract and leaves the group Failed with the reason (its id is
    /// kept, so that deleting it deletes what was cut).
    async fn record(
        &self,
        group: &VolumeGroupSnapshot,
        step: &'static str,
        sources: &[String],
        answer: Result<v1::VolumeGroupSnapshot, Failed>,
    ) -> Result<Action, GroupError> {
        let cut = match answer {
            Ok(cut) => cut,
            Err(failed) => return self.failed(group, failed).await,
        };
        // The group's id and its members' are this group's from now on, unless an
        // object of another namespace has one (a plugin that answered with another's).
        let member_ids: Vec<String> = cut
            .snapshots
            .iter()
            .map(|s| s.snapshot_id.clone())
            .collect();
        if let Err(why) = self
            .take_ownership(group, &cut.group_snapshot_id, &member_ids)
            .await?
        {
            let failed = self
                .ctx
                .steps
                .begin(&group.key(), step, self.inputs(group))?
                .fail(owned_elsewhere(step, &why));
            return self.failed(group, failed).await;
        }
        let ready = cut.ready_to_use;
        let generation = group.metadata.generation;
        let matched = members(group, sources, &cut);
        let created = moor::csi::convert::time_of(cut.creation_time.as_ref());
        let plugin = &self.ctx.plugin.id;
        self.write_status(group, |st| {
            // The plugin that holds it and what it was taken of: recorded before a
            // CreateVolumeGroupSnapshot, learned here for an import.
            st.plugin_id.get_or_insert_with(|| plugin.clone());
            if st.source_volume_ids.is_empty() {
                st.source_volume_ids = sources.to_vec();
            }
            st.group_snapshot_id = Some(cut.group_snapshot_id.clone());
            st.creation_time = created;
            st.meta.observed_generation = generation;
            match &matched {
                Ok(m) => {
                    st.members = m.clone();
                    st.ready_to_use = ready;
                    st.phase = if ready {
                        SnapshotPhase::Ready
                    } else {
                        SnapshotPhase::Creating
                    };
                    st.meta.clear_failure();
                    st.meta.set_condition("Created", true, step, "");
                }
                Err(why) => {
                    st.phase = SnapshotPhase::Failed;
                    st.ready_to_use = false;
                    st.meta.last_error = Some(why.clone());
                    st.meta
                        .set_condition("Created", false, "MembersMismatch", why);
                }
            }
        })
        .await?;
        if let Err(why) = matched {
            self.event(
                group,
                "Group snapshot create failed",
                EventType::Warning,
                why,
            )
            .await;
            return Ok(Action::AwaitChange);
        }
        if !ready {
            return Ok(Action::Requeue(Duration::from_secs(1)));
        }
        self.event(
            group,
            "Group snapshot created",
            EventType::Normal,
            format!(
                "{} cut from {}",
                cut.group_snapshot_id,
                group
                    .spec
                    .volumes
                    .iter()
                    .map(|v| v.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
        .await;
        // The controller makes the members once it copied this.
        Ok(Action::AwaitChange)
    }

    /// What the group's namespace may be told of the first of these plugin ids that an
    /// object of another namespace owns: source `volumes`, the group's `id`, its
    /// `members`' snapshot ids. `None` when none is.
    async fn not_its(
        &self,
        group: &VolumeGroupSnapshot,
        volumes: &[String],
        id: Option<&str>,
        members: &[String],
    ) -> Result<Option<String>, GroupError> {
        let ids = (volumes.iter().map(|v| (OwnedResource::Volume, v.as_str())))
            .chain(group_ids(id, members.iter().map(String::as_str)));
        for (resource, id) in ids {
            if let Owner::Another(why) = self.ctx.owner(resource, id, group).await?.0 {
                return Ok(Some(why));
            }
        }
        Ok(None)
    }

    /// Why DeleteVolumeGroupSnapshot (and, in doubt, the CreateVolumeGroupSnapshot that
    /// finds the id) may not name these ids: one is owned by an object other than this
    /// group (of another namespace, or another of its own).
    async fn not_deletable(
        &self,
        group: &VolumeGroupSnapshot,
        in_doubt: bool,
        id: Option<&str>,
        members: &[String],
    ) -> Result<Option<String>, GroupError> {
        let sources: &[String] = if in_doubt {
            &group.status.source_volume_ids
        } else {
            &[]
        };
        if let Some(why) = self.not_its(group, sources, None, &[]).await? {
            return Ok(Some(why));
        }
        for (resource, id) in group_ids(id, members.iter().map(String::as_str)) {
            match self.ctx.owner(resource, id, group).await?.0 {
                Owner::Mine | Owner::Nobody => {}
                Owner::Sibling => {
                    return Ok(Some(format!(
                        "owned by another {} of this namespace",
                        resource.as_str()
                    )))
                }
                Owner::Shared => {
                    return Ok(Some(format!(
                        "a {} shared with this namespace by its owner's",
                        resource.as_str()
                    )))
                }
                Owner::Another(why) => return Ok(Some(why)),
            }
        }
        Ok(None)
    }

    /// Records that the group owns its `id` and its members' snapshot ids; why not,
    /// when an object of another namespace owns one.
    pub(super) async fn take_ownership(
        &self,
        group: &VolumeGroupSnapshot,
        id: &str,
        members: &[String],
    ) -> Result<Result<(), String>, GroupError> {
        for (resource, id) in group_ids(Some(id), members.iter().map(String::as_str)) {
            if let Err(why) = self.ctx.take_ownership(resource, id, group).await? {
                return Ok(Err(why));
            }
        }
        Ok(Ok(()))
    }

    /// Removes the group's records of its `id` and members once they are deleted.
    async fn drop_ownership(
        &self,
        group: &VolumeGroupSnapshot,
        id: &str,
        members: &[String],
    ) -> Result<(), GroupError> {
        for (resource, id) in group_ids(Some(id), members.iter().map(String::as_str)) {
            self.ctx.drop_ownership(resource, id, group).await?;
        }
        Ok(())
    }

    /// DeleteVolumeGroupSnapshot with every member, on its step's schedule (asking
    /// CreateVolumeGroupSnapshot again first when the create was in doubt), or nothing
    /// for an imported group; then the member Snapshots, then the finalizer.
    async fn delete(
        &self,
        group: &VolumeGroupSnapshot,
        first: Option<&Volume>,
    ) -> Result<Action, GroupError> {
        let key = group.key();
        let st = &group.status;
        let mut id = st.group_snapshot_id.clone();
        let mut ids: Vec<String> = st.members.iter().map(|m| m.snapshot_id.clone()).collect();
        let in_doubt = id.is_none() && !st.source_volume_ids.is_empty();
        if group.spec.group_snapshot_id.is_some() {
            self.ctx.steps.forget(&key);
            if let Some(id) = &id {
                self.event(
                    group,
                    "Group snapshot released",
                    EventType::Normal,
                    format!("{id} kept in the plugin (imported)"),
                )
                .await;
            }
        } else if let Some(why) = self
            .not_deletable(group, in_doubt, id.as_deref(), &ids)
            .await?
        {
            self.ctx.steps.forget(&key);
            self.event(
                group,
                "Group snapshot not deleted from the plugin",
                EventType::Warning,
                format!("a plugin id its status names is {why}: no DeleteVolumeGroupSnapshot; only the group is deleted"),
            )
            .await;
        } else if id.is_some() || in_doubt {
            let step =
                self.ctx
                    .steps
                    .begin(&key, "DeleteVolumeGroupSnapshot", self.inputs(group))?;
            let csi = self.ctx.csi()?.about(object_ref(group));
            if in_doubt {
                let req = requests::create_group_snapshot(group, first, &st.source_volume_ids)?;
                match csi.create_group_snapshot(req).await {
                    Ok(r) => {
                        if let Some(g) =
                            r.group_snapshot.filter(|g| !g.group_snapshot_id.is_empty())
                        {
                            ids = g.snapshots.iter().map(|s| s.snapshot_id.clone()).collect();
                            id = Some(g.group_snapshot_id);
                        }
                    }
                    // A volume is gone, or the plugin refuses for good: nothing was cut.
                    Err(e) if e.class() == Class::Final => {}
                    Err(e) => return self.failed(group, step.fail(e)).await,
                }
            }
            if let Some(id) = id {
                let req = requests::delete_group_snapshot(group, first, &id, ids.clone())?;
                let done = step
                    .call(async {
                        match csi.delete_group_snapshot(req).await {
                            Err(e) if e.is_not_found() => Ok(()),
                            r => r.map(|_| ()),
                        }
                    })
                    .await;
                if let Err(failed) = done {
                    return self.failed(group, failed).await;
                }
                self.event(
                    group,
                    "Group snapshot deleted",
                    EventType::Normal,
                    format!("{id} deleted"),
                )
                .await;
                self.drop_ownership(group, &id, &ids).await?;
            }
            self.ctx.steps.forget(&key);
        }
        // The controller deletes its member Snapshots and removes the finalizer.
        (self.reports)
            .write(group, Some(FinalizerAsk::Released), |_| {})
            .await?;
        Ok(Action::AwaitChange)
    }

    /// A failed step: its failure and the retry on the status, a Warning; a final
    /// answer to CreateVolumeGroupSnapshot makes the group Failed (retried at the cap or
    /// when its spec changes).
    async fn failed(
        &self,
        group: &VolumeGroupSnapshot,
        failed: Failed,
    ) -> Result<Action, GroupError> {
        let step = failed.failure.step.clone();
        let msg = failed.message();
        let deleting = step == "DeleteVolumeGroupSnapshot";
        let refused = !deleting && failed.is_final();
        self.write_status(group, |st| {
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
            "Group snapshot delete failed"
        } else {
            "Group snapshot create failed"
        };
        self.event(group, reason, EventType::Warning, msg).await;
        Ok(Action::Requeue(failed.retry_in))
    }

    async fn write_status(
        &self,
        group: &VolumeGroupSnapshot,
        mut f: impl FnMut(&mut VolumeGroupSnapshotStatus),
    ) -> Result<(), GroupError> {
        self.reports.write(group, None, |st| f(st)).await?;
        Ok(())
    }

    async fn event(
        &self,
        group: &VolumeGroupSnapshot,
        reason: &str,
        type_: EventType,
        message: String,
    ) {
        let vols: Vec<&str> = group.spec.volumes.iter().map(|v| v.as_str()).collect();
        let d = details([("volume_ids", vols.join(","))]);
        self.ctx
            .recorder
            .record(object_ref(group), type_, reason, message, d)
            .await;
    }
}

/// The group an answer of `rpc` holds; one without an id is an error.
fn answered(
    rpc: &'static str,
    group: Option<v1::VolumeGroupSnapshot>,
) -> Result<v1::VolumeGroupSnapshot, CsiError> {
    group
        .filter(|g| !g.group_snapshot_id.is_empty())
        .ok_or_else(|| CsiError {
            rpc,
            code: tonic::Code::Internal,
            message: format!("{rpc} answered without a group_snapshot_id"),
            tries: 1,
        })
}

/// A CSI-shaped final answer for a step refused because an object of another namespace
/// owns a plugin id it would name (`why`, [`owner_for`]).
fn owned_elsewhere(rpc: &'static str, why: &str) -> CsiError {
    CsiError {
        rpc,
        code: tonic::Code::AlreadyExists,
        message: format!("a plugin id it names is {why}: this group may not use it"),
        tries: 0,
    }
}

/// The plugin ids a group owns, each with what it names: the group's `id` (when
/// known), then its members' snapshot ids. Every ownership check, record and removal
/// of a group goes over these.
/// (A list, not an iterator: the callers hold it across awaits.)
pub(crate) fn group_ids<'a>(
    id: Option<&'a str>,
    members: impl IntoIterator<Item = &'a str>,
) -> Vec<(OwnedResource, &'a str)> {
    (id.map(|id| (OwnedResource::GroupSnapshot, id)).into_iter())
        .chain(members.into_iter().map(|m| (OwnedResource::Snapshot, m)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plugin() -> PluginId {
        PluginId::new("p").unwrap()
    }

    fn caps(group: bool) -> PluginCapabilities {
        let mut c = PluginCapabilities::default();
        if group {
            c.plugin.insert(PluginCapability::Service(
                PluginService::GroupControllerService,
            ));
            c.group.insert(GroupRpc::CreateDeleteGetVolumeGroupSnapshot);
        }
        c
    }

    fn group(vols: &[&str]) -> VolumeGroupSnapshot {
        VolumeGroupSnapshot::new(
            &Namespace::default_ns(),
            Name::new("g").unwrap(),
            VolumeGroupSnapshotSpec {
                volumes: vols.iter().map(|v| VolumeId::new(*v).unwrap()).collect(),
                ..Default::default()
            },
        )
    }

    fn volume(name: &str, plugin: &str, ready: bool) -> Volume {
        let mut v = Volume::new(
            &Namespace::default_ns(),
            Name::new(name).unwrap(),
            VolumeSpec {
                plugin_id: PluginId::new(plugin).unwrap(),
                ..Default::default()
            },
        );
        if ready {
            v.status.provisioning.phase = VolumePhase::Ready;
            v.status.provisioning.external_id =
                Some(ExternalVolumeId::new(format!("ext-{name}")).unwrap());
        }
        v
    }

    #[test]
    fn a_group_is_cut_once_all_its_volumes_are_created_and_only_by_a_plugin_that_can() {
        let (a, b) = (volume("a", "p", true), volume("b", "p", false));
        let mut g = group(&["a", "b"]);
        assert_eq!(
            next(&g, &[Some(&a), Some(&b)], &plugin(), &caps(true)),
            Step::AddFinalizer
        );
        g.metadata.finalizers.push(FINALIZER.into());
        assert_eq!(
            next(&g, &[Some(&a), Some(&b)], &plugin(), &caps(true)),
            Step::WaitForVolumes
        );
        let b = volume("b", "p", true);
        assert_eq!(
            next(&g, &[Some(&a), Some(&b)], &plugin(), &caps(true)),
            Step::Create(vec!["ext-a".into(), "ext-b".into()])
        );
        assert!(matches!(
            next(&g, &[Some(&a), Some(&b)], &plugin(), &caps(false)),
            Step::Refuse(m) if m.contains("GROUP_CONTROLLER_SERVICE")
        ));
        let other = volume("b", "q", true);
        assert!(matches!(
            next(&g, &[Some(&a), Some(&other)], &plugin(), &caps(true)),
            Step::Refuse(m) if m.contains("one plugin's volumes")
        ));
        // Another plugin's group is not this snapshotter's.
        assert_eq!(
            next(&g, &[Some(&other), Some(&a)], &plugin(), &caps(true)),
            Step::Nothing
        );
    }

    #[test]
    fn a_cut_group_is_polled_made_into_members_once_and_deleted() {
        let (a, b) = (volume("a", "p", true), volume("b", "p", true));
        let vols = [Some(&a), Some(&b)];
        let mut g = group(&["a", "b"]);
        g.metadata.finalizers.push(FINALIZER.into());
        g.status.source_volume_ids = vec!["ext-a".into(), "ext-b".into()];
        // In doubt: the same call again, whatever the volumes are now.
        assert_eq!(
            next(&g, &[None, None], &plugin(), &caps(true)),
            Step::Nothing,
            "no plugin known from the status yet"
        );
        g.status.plugin_id = Some(plugin());
        assert_eq!(
            next(&g, &[None, None], &plugin(), &caps(true)),
            Step::Create(vec!["ext-a".into(), "ext-b".into()])
        );
        g.status.group_snapshot_id = Some("grp".into());
        assert_eq!(
            next(&g, &vols, &plugin(), &caps(true)),
            Step::Poll("grp".into())
        );
        // Failed on a mismatched answer: left alone until the spec changes.
        let mut failed = g.clone();
        failed.status.phase = SnapshotPhase::Failed;
        failed.status.meta.observed_generation = failed.metadata.generation;
        assert_eq!(next(&failed, &vols, &plugin(), &caps(true)), Step::Nothing);
        failed.metadata.generation += 1;
        assert_eq!(
            next(&failed, &vols, &plugin(), &caps(true)),
            Step::Poll("grp".into())
        );
        g.status.phase = SnapshotPhase::Ready;
        g.status.ready_to_use = true;
        // Cut: the members are the controller's to make.
        assert_eq!(next(&g, &vols, &plugin(), &caps(true)), Step::Nothing);
        g.metadata.deletion_timestamp = Some(Timestamp::now());
        assert_eq!(next(&g, &vols, &plugin(), &caps(true)), Step::Delete);
    }

    #[test]
    fn an_answer_is_matched_member_by_member_or_refused() {
        let g = group(&["a", "b"]);
        let snap = |id: &str, src: &str| v1::Snapshot {
            snapshot_id: id.into(),
            source_volume_id: src.into(),
            size_bytes: 5,
            ..Default::default()
        };
        let sources = ["ext-a".to_string(), "ext-b".to_string()];
        let answer = v1::VolumeGroupSnapshot {
            group_snapshot_id: "grp".into(),
            snapshots: vec![snap("s-b", "ext-b"), snap("s-a", "ext-a")],
            ..Default::default()
        };
        let m = members(&g, &sources, &answer).unwrap();
        assert_eq!(m[0].snapshot.as_str(), "g-a");
        assert_eq!(m[0].snapshot_id, "s-a");
        assert_eq!(m[1].snapshot_id, "s-b");
        let short = v1::VolumeGroupSnapshot {
            snapshots: vec![snap("s-a", "ext-a")],
            ..answer.clone()
        };
        assert!(members(&g, &sources, &short)
            .unwrap_err()
            .contains("volume b"));
        let extra = v1::VolumeGroupSnapshot {
            snapshots: vec![
                snap("s-a", "ext-a"),
                snap("s-b", "ext-b"),
                snap("s-c", "ext-c"),
            ],
            ..answer
        };
        assert!(members(&g, &sources, &extra)
            .unwrap_err()
            .contains("3 snapshots"));
    }
}
