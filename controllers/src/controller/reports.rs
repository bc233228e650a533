//! Reports copied into their objects: the controller, the one writer of Attachments
//! and of what moor adds to a Volume, a Snapshot or a VolumeGroupSnapshot, takes from
//! each report the agent leading the object's plugin writes ([`ReportSpec`]) what it
//! says of the object: the reported section of its status, the plugin's finalizer
//! added or removed, an attachment deleted once detached, a group's member Snapshots
//! made once it is cut and deleted once it is released (issue 77: the agents of
//! controller plugins no longer write these objects).
//!
//! A report counts only under the key of the object's own plugin and only for the
//! object it names by uid ([`Report::is_about`]): another plugin's agent cannot report
//! on it, and a report left from an object made again under the same key is not about
//! the new one. An object's own plugin is the one its spec names (an attachment, a
//! volume), or for a snapshot and a group the one its status records once cut, else
//! its (first) volume's, read when the report is; a status copied from a report records
//! that report's plugin, whatever the report says. An object no report is about keeps
//! what it holds (written by an older agent, or not acted on yet).
//!
//! Driven by the reports: one pass per report written (and one for each at the start).
//! A pass its own write brings finds the object saying what the report says and
//! writes nothing. What each kind takes from a report is decided by a pure function
//! ([`attachment`], [`volume`], [`snapshot`], [`group`]).

use futures::future::BoxFuture;
use moor::api::*;
use moor::runtime::controller::{Action, Config, Controller};
use moor::runtime::informer::Informer;
use moor::runtime::metrics::ControllerMetrics;
use moor::store::StoreError;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

use super::context::Ctx;
use crate::common::{details, object_ref};

/// What a report asks of its object.
#[derive(Debug, PartialEq)]
pub enum Mirror<K: Reported> {
    /// Nothing: it says so already.
    Nothing,
    /// Written as this (the reported section copied, a finalizer added or removed).
    Write(Box<Object<K>>),
    /// Deleted (an attachment detached).
    Delete,
}

/// An object as the copy reads it, and its plugin: the one whose report counts.
pub type Found<K> = (Arc<Object<K>>, PluginId);

/// How the copy treats one kind.
pub trait Copied: Reported {
    /// The object at `key` and its plugin; `None` when it is gone or its plugin
    /// cannot be told. Never older than what an agent saw before reporting: a report
    /// is written after its agent read the object as stored, and nothing but the next
    /// report brings the pass again.
    fn read(
        ctx: &Ctx,
        key: ObjectKey<Self>,
    ) -> BoxFuture<'_, Result<Option<Found<Self>>, StoreError>>;

    /// What the object takes from `plugin`'s report.
    fn decide(obj: &Object<Self>, plugin: &PluginId, report: &Report<Self>) -> Mirror<Self>;

    /// Done before `next` is written over `obj` (a group's members made or deleted);
    /// may complete `next`.
    fn before<'a>(
        _ctx: &'a Ctx,
        _obj: &'a Object<Self>,
        _next: &'a mut Object<Self>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async { Ok(()) })
    }
}

/// What an Attachment takes from its report: deleted once Detached while asked to
/// detach, else the report's status.
pub fn attachment(
    att: &Attachment,
    plugin: &PluginId,
    report: &AttachmentReport,
) -> Mirror<AttachmentSpec> {
    if !report.is_about(att, plugin) {
        return Mirror::Nothing;
    }
    if att.spec.detach && report.status.phase == AttachmentPhase::Detached {
        return Mirror::Delete;
    }
    let mut next = att.clone();
    next.status = report.status.clone();
    written(att, next)
}

/// What a Volume takes from its report: `status.provisioning`, and the provisioner's
/// finalizer added before a creation (never to a volume being deleted) or removed
/// once released (only from a volume being deleted).
pub fn volume(vol: &Volume, plugin: &PluginId, report: &VolumeReport) -> Mirror<VolumeSpec> {
    if !report.is_about(vol, plugin) {
        return Mirror::Nothing;
    }
    let mut next = vol.clone();
    finalize(&mut next, PROVISIONER_FINALIZER, report.spec.finalizer);
    next.status.provisioning = report.status.clone();
    written(vol, next)
}

/// What a Snapshot takes from its report: its status (recording the report's plugin
/// as the one that holds it), and the snapshotter's finalizer as for a volume.
pub fn snapshot(
    snap: &Snapshot,
    plugin: &PluginId,
    report: &SnapshotReport,
) -> Mirror<SnapshotSpec> {
    if !report.is_about(snap, plugin) {
        return Mirror::Nothing;
    }
    let mut next = snap.clone();
    finalize(&mut next, SNAPSHOTTER_FINALIZER, report.spec.finalizer);
    next.status = report.status.clone();
    recorded(&mut next.status.plugin_id, plugin);
    written(snap, next)
}

/// What a VolumeGroupSnapshot takes from its report: as a snapshot, keeping the
/// controller's own `MembersCreated`, which is set (and the members made, by
/// [`Copied::before`]) once the report says the group is cut and ready to use.
pub fn group(
    g: &VolumeGroupSnapshot,
    plugin: &PluginId,
    report: &VolumeGroupSnapshotReport,
) -> Mirror<VolumeGroupSnapshotSpec> {
    if !report.is_about(g, plugin) {
        return Mirror::Nothing;
    }
    let mut next = g.clone();
    finalize(
        &mut next,
        GROUP_SNAPSHOTTER_FINALIZER,
        report.spec.finalizer,
    );
    next.status = report.status.clone();
    recorded(&mut next.status.plugin_id, plugin);
    let conditions = &mut next.status.meta.conditions;
    conditions.retain(|c| c.type_ != MEMBERS_CREATED);
    match members_made(g) {
        Some(made) => conditions.push(made.clone()),
        None if next.status.phase == SnapshotPhase::Ready
            && next.status.ready_to_use
            && !next.is_deleting() =>
        {
            next.status
                .meta
                .set_condition(MEMBERS_CREATED, true, "Created", "")
        }
        None => {}
    }
    written(g, next)
}

fn members_made(g: &VolumeGroupSnapshot) -> Option<&Condition> {
    (g.status.meta.conditions.iter()).find(|c| c.type_ == MEMBERS_CREATED && c.status)
}

/// The finalizer `name` on `obj` as its report asks: added before the plugin makes
/// anything (never to an object being deleted), removed once released (only from an
/// object being deleted, never unasked: one an older agent added stays until a
/// report releases it).
fn finalize<K: Spec>(obj: &mut Object<K>, name: &str, ask: FinalizerAsk) {
    let has = obj.metadata.finalizers.iter().any(|f| f == name);
    match ask {
        FinalizerAsk::Hold if !has && !obj.is_deleting() => {
            obj.metadata.finalizers.push(name.into())
        }
        FinalizerAsk::Released if has && obj.is_deleting() => {
            obj.metadata.finalizers.retain(|f| f != name)
        }
        _ => {}
    }
}

/// A recorded plugin is the reporting one: an agent cannot hand its object to
/// another plugin's leader.
fn recorded(id: &mut Option<PluginId>, plugin: &PluginId) {
    if id.as_ref().is_some_and(|p| p != plugin) {
        *id = Some(plugin.clone());
    }
}

fn written<K: Reported>(obj: &Object<K>, next: Object<K>) -> Mirror<K> {
    if next == *obj {
        return Mirror::Nothing;
    }
    Mirror::Write(Box::new(next))
}

impl Copied for AttachmentSpec {
    fn read(
        ctx: &Ctx,
        key: ObjectKey<Self>,
    ) -> BoxFuture<'_, Result<Option<Found<Self>>, StoreError>> {
        // Only this process writes attachments: its own last write is as new as
        // anything an agent saw.
        Box::pin(async move {
            let att = ctx.writer.fresh(&ctx.attachments, &key).await?;
            Ok(att.map(|a| {
                let p = a.spec.plugin_id.clone();
                (a, p)
            }))
        })
    }

    fn decide(obj: &Object<Self>, plugin: &PluginId, report: &Report<Self>) -> Mirror<Self> {
        attachment(obj, plugin, report)
    }
}

impl Copied for VolumeSpec {
    fn read(
        ctx: &Ctx,
        key: ObjectKey<Self>,
    ) -> BoxFuture<'_, Result<Option<Found<Self>>, StoreError>> {
        // From the store, never the cache: the report was written after its agent saw
        // the volume (made, or marked deleted), which this process's cache may not
        // show yet.
        Box::pin(async move {
            let vol = ctx.writer.store().try_get(&key).await?;
            Ok(vol.map(|v| {
                let p = v.spec.plugin_id.clone();
                (Arc::new(v), p)
            }))
        })
    }

    fn decide(obj: &Object<Self>, plugin: &PluginId, report: &Report<Self>) -> Mirror<Self> {
        volume(obj, plugin, report)
    }
}

/// The object at `key` from the store, as a volume, and its plugin: the one
/// `recorded` gives once cut, else the first existing of its `volumes`' (read from the
/// store too); `None` when it is gone or no plugin can be told.
async fn of_volumes<K: Spec>(
    ctx: &Ctx,
    key: ObjectKey<K>,
    recorded: fn(&Object<K>) -> Option<&PluginId>,
    volumes: fn(&Object<K>) -> &[VolumeId],
) -> Result<Option<Found<K>>, StoreError> {
    let Some(obj) = ctx.writer.store().try_get(&key).await? else {
        return Ok(None);
    };
    if let Some(p) = recorded(&obj) {
        let p = p.clone();
        return Ok(Some((Arc::new(obj), p)));
    }
    for v in volumes(&obj) {
        let vol = Volume::key_for(&obj.metadata.namespace, v);
        if let Some(vol) = ctx.writer.store().try_get(&vol).await? {
            return Ok(Some((Arc::new(obj), vol.spec.plugin_id)));
        }
    }
    Ok(None)
}

impl Copied for SnapshotSpec {
    fn read(
        ctx: &Ctx,
        key: ObjectKey<Self>,
    ) -> BoxFuture<'_, Result<Option<Found<Self>>, StoreError>> {
        Box::pin(of_volumes(
            ctx,
            key,
            |s| s.status.plugin_id.as_ref(),
            |s| std::slice::from_ref(&s.spec.volume),
        ))
    }

    fn decide(obj: &Object<Self>, plugin: &PluginId, report: &Report<Self>) -> Mirror<Self> {
        snapshot(obj, plugin, report)
    }
}

impl Copied for VolumeGroupSnapshotSpec {
    fn read(
        ctx: &Ctx,
        key: ObjectKey<Self>,
    ) -> BoxFuture<'_, Result<Option<Found<Self>>, StoreError>> {
        Box::pin(of_volumes(
            ctx,
            key,
            |g| g.status.plugin_id.as_ref(),
            |g| &g.spec.volumes,
        ))
    }

    fn decide(obj: &Object<Self>, plugin: &PluginId, report: &Report<Self>) -> Mirror<Self> {
        group(obj, plugin, report)
    }

    /// Its members made when `next` first says they are, deleted when it releases
    /// the group's finalizer.
    fn before<'a>(
        ctx: &'a Ctx,
        g: &'a VolumeGroupSnapshot,
        next: &'a mut VolumeGroupSnapshot,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let holds = |g: &VolumeGroupSnapshot| {
                (g.metadata.finalizers.iter()).any(|f| f == GROUP_SNAPSHOTTER_FINALIZER)
            };
            if g.is_deleting() && holds(g) && !holds(next) {
                return drop_members(ctx, g).await;
            }
            if members_made(g).is_none() && members_made(next).is_some() {
                let taken = make_members(ctx, next).await?;
                if !taken.is_empty() {
                    let msg = format!(
                        "snapshot name(s) {} are held by Snapshots not of this group: those members have no Snapshot of their own",
                        taken.join(", ")
                    );
                    (next.status.meta).set_condition(MEMBERS_CREATED, true, "Created", &msg);
                    let r = object_ref(next);
                    let d = details([("group", next.metadata.name.to_string())]);
                    (ctx.recorder)
                        .record(r, EventType::Warning, "Group snapshot members", msg, d)
                        .await;
                }
            }
            Ok(())
        })
    }
}

/// Makes each member's Snapshot of `g`, once: Ready, with its id, the group's plugin
/// and `spec.group`. Returns the names held by a Snapshot of something else (left
/// alone).
async fn make_members(ctx: &Ctx, g: &VolumeGroupSnapshot) -> Result<Vec<String>, StoreError> {
    let ns = &g.metadata.namespace;
    let mut taken = Vec::new();
    for m in &g.status.members {
        let key = Snapshot::key_for(ns, &m.snapshot);
        if let Some(s) = ctx.writer.store().try_get(&key).await? {
            if s.spec.group.as_ref() != Some(&g.metadata.name) {
                taken.push(m.snapshot.to_string());
            }
            continue;
        }
        let mut snap = Snapshot::new(
            ns,
            m.snapshot.clone(),
            SnapshotSpec {
                volume: m.volume.clone(),
                snapshot_id: Some(m.snapshot_id.clone()),
                group: Some(g.metadata.name.clone()),
                ..Default::default()
            },
        );
        snap.status = SnapshotStatus {
            phase: SnapshotPhase::Ready,
            plugin_id: g.status.plugin_id.clone(),
            snapshot_id: Some(m.snapshot_id.clone()),
            source_volume_id: Some(m.source_volume_id.clone()).filter(|s| !s.is_empty()),
            size_bytes: m.size_bytes,
            creation_time: g.status.creation_time,
            ready_to_use: true,
            ..Default::default()
        };
        (snap.status.meta).set_condition("Created", true, "VolumeGroupSnapshot", "");
        match ctx.writer.create(&snap).await {
            Ok(_) | Err(StoreError::AlreadyExists { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(taken)
}

/// Deletes the member Snapshots of `g` (they hold no finalizer).
async fn drop_members(ctx: &Ctx, g: &VolumeGroupSnapshot) -> Result<(), StoreError> {
    let ns = &g.metadata.namespace;
    let scope = KeyScope::<SnapshotSpec>::namespace(ns).unwrap_or_else(KeyScope::all);
    for s in ctx.writer.store().list(&scope).await?.items {
        if &s.metadata.namespace == ns && s.spec.group.as_ref() == Some(&g.metadata.name) {
            match ctx.writer.delete_read(&s).await {
                Ok(_) | Err(StoreError::NotFound { .. } | StoreError::Conflict { .. }) => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}

/// Runs the copy of `K`'s reports until `stop`.
pub async fn run<K: Copied>(
    ctx: Ctx,
    reports: Informer<Report<K>>,
    config: Config,
    metrics: ControllerMetrics,
    stop: CancellationToken,
) {
    let name = format!("{}s", K::REPORT_KIND.to_lowercase());
    let cache = reports.reader();
    Controller::new(&name, reports.reader(), config)
        .with_metrics(metrics)
        .owns(reports.subscribe())
        .run(
            move |ctx: Arc<Ctx>, key: ObjectKey<ReportSpec<K>>| {
                let cache = cache.clone();
                async move {
                    // Every cache listed first: a read of an attachment through a cache
                    // not listed yet finds nothing, and the pass would end there (seen
                    // in the benchmark's controller restart: 70 of 300 attachments
                    // never copied).
                    ctx.ready().await;
                    cache.wait_until_ready().await;
                    let Some(report) = cache.get(&key) else {
                        return Ok(Action::AwaitChange);
                    };
                    let Some(about) = report.about_key() else {
                        return Ok(Action::AwaitChange);
                    };
                    let Some((obj, plugin)) = K::read(&ctx, about).await? else {
                        return Ok(Action::AwaitChange);
                    };
                    write(&ctx, &obj, K::decide(&obj, &plugin, &report)).await
                }
            },
            Arc::new(ctx),
            stop,
        )
        .await;
}

async fn write<K: Copied>(
    ctx: &Ctx,
    obj: &Object<K>,
    mirror: Mirror<K>,
) -> Result<Action, StoreError> {
    let done = match mirror {
        Mirror::Nothing => return Ok(Action::AwaitChange),
        Mirror::Write(mut next) => {
            K::before(ctx, obj, &mut next).await?;
            ctx.writer.update(obj, &next).await.map(|_| ())
        }
        Mirror::Delete => ctx.writer.delete_read(obj).await.map(|_| ()),
    };
    match done {
        // Gone meanwhile: nothing to copy into.
        Ok(()) | Err(StoreError::NotFound { .. }) => Ok(Action::AwaitChange),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p() -> PluginId {
        PluginId::new("p.example").unwrap()
    }

    fn q() -> PluginId {
        PluginId::new("other.example").unwrap()
    }

    fn attachment_of(plugin: &PluginId) -> Attachment {
        let mut a = crate::controller::plan::tests::attachment(AccessMode::SingleNodeWriter, false);
        a.spec.plugin_id = plugin.clone();
        a
    }

    fn attached() -> AttachmentStatus {
        AttachmentStatus {
            phase: AttachmentPhase::Attached,
            publish_context: [("device".to_string(), "/dev/x".to_string())].into(),
            ..Default::default()
        }
    }

    fn report(att: &Attachment, st: AttachmentStatus) -> AttachmentReport {
        AttachmentReport::of(&att.spec.plugin_id, att, st, FinalizerAsk::Unasked)
    }

    #[test]
    fn a_report_is_copied_once() {
        let att = attachment_of(&p());
        let r = report(&att, attached());
        let Mirror::Write(copy) = attachment(&att, &p(), &r) else {
            panic!("not copied")
        };
        assert_eq!(copy.status, attached());
        assert_eq!(attachment(&copy, &p(), &r), Mirror::Nothing);
    }

    #[test]
    fn only_a_report_about_the_attachment_under_its_own_plugin_counts() {
        let att = attachment_of(&p());
        // Another plugin's leader reporting on it, at its own plugin's prefix.
        let forged = report(&attachment_of(&q()), attached());
        assert_eq!(attachment(&att, &p(), &forged), Mirror::Nothing);
        // A report on an earlier attachment under the same key.
        let mut earlier = att.clone();
        earlier.metadata.uid = "att-0".into();
        assert_eq!(
            attachment(&att, &p(), &report(&earlier, attached())),
            Mirror::Nothing
        );
    }

    #[test]
    fn detached_deletes_only_what_was_asked_to_detach() {
        let mut att = attachment_of(&p());
        let detached = AttachmentStatus {
            phase: AttachmentPhase::Detached,
            ..Default::default()
        };
        let r = report(&att, detached);
        assert!(matches!(attachment(&att, &p(), &r), Mirror::Write(_)));
        att.spec.detach = true;
        assert_eq!(attachment(&att, &p(), &r), Mirror::Delete);
    }

    fn created_volume() -> Volume {
        let mut v = Volume::new(
            &Namespace::default_ns(),
            Name::new("v").unwrap(),
            VolumeSpec {
                plugin_id: p(),
                ..Default::default()
            },
        );
        v.metadata.uid = "vol-1".into();
        v
    }

    fn finalizers<K: Reported>(m: &Mirror<K>) -> Vec<String> {
        match m {
            Mirror::Write(v) => v
                .metadata
                .finalizers
                .iter()
                .map(|f| f.to_string())
                .collect(),
            _ => panic!("no write: {m:?}"),
        }
    }

    #[test]
    fn the_provisioner_s_finalizer_comes_before_a_creation_and_goes_after_a_release() {
        let vol = created_volume();
        let section = ProvisioningStatus::default();
        let hold = VolumeReport::of(&p(), &vol, section.clone(), FinalizerAsk::Hold);
        assert_eq!(
            finalizers(&volume(&vol, &p(), &hold)),
            [PROVISIONER_FINALIZER]
        );
        let mut held = vol.clone();
        held.metadata.finalizers.push(PROVISIONER_FINALIZER.into());
        assert_eq!(volume(&held, &p(), &hold), Mirror::Nothing);
        // Released: removed only from a volume being deleted.
        let released = VolumeReport::of(&p(), &vol, section.clone(), FinalizerAsk::Released);
        assert_eq!(volume(&held, &p(), &released), Mirror::Nothing);
        let mut deleting = held.clone();
        deleting.metadata.deletion_timestamp = Some(Timestamp::now());
        assert!(finalizers(&volume(&deleting, &p(), &released)).is_empty());
        // Never added to a volume being deleted; never removed unasked (a volume an
        // older agent made holds it until a report says released).
        let mut bare = deleting.clone();
        bare.metadata.finalizers.clear();
        assert_eq!(volume(&bare, &p(), &hold), Mirror::Nothing);
        let unasked = VolumeReport::of(&p(), &vol, section, FinalizerAsk::Unasked);
        assert_eq!(volume(&deleting, &p(), &unasked), Mirror::Nothing);
    }

    #[test]
    fn a_volume_takes_its_provisioning_only_from_its_own_plugin_s_report() {
        let vol = created_volume();
        let section = ProvisioningStatus {
            phase: VolumePhase::Ready,
            external_id: Some(ExternalVolumeId::new("ext-1").unwrap()),
            ..Default::default()
        };
        let own = VolumeReport::of(&p(), &vol, section.clone(), FinalizerAsk::Unasked);
        let Mirror::Write(copy) = volume(&vol, &p(), &own) else {
            panic!("not copied")
        };
        assert_eq!(copy.status.provisioning, section);
        let forged = VolumeReport::of(&q(), &vol, section, FinalizerAsk::Released);
        assert_eq!(volume(&vol, &p(), &forged), Mirror::Nothing);
    }

    fn snap() -> Snapshot {
        let mut s = Snapshot::new(
            &Namespace::default_ns(),
            Name::new("s").unwrap(),
            SnapshotSpec {
                volume: VolumeId::new("v").unwrap(),
                ..Default::default()
            },
        );
        s.metadata.uid = "snap-1".into();
        s
    }

    #[test]
    fn a_snapshot_records_the_reporting_plugin_as_the_one_that_holds_it() {
        let s = snap();
        let cut = SnapshotStatus {
            phase: SnapshotPhase::Ready,
            plugin_id: Some(q()),
            snapshot_id: Some("sn-1".into()),
            ready_to_use: true,
            ..Default::default()
        };
        let r = SnapshotReport::of(&p(), &s, cut, FinalizerAsk::Hold);
        let m = snapshot(&s, &p(), &r);
        assert_eq!(finalizers(&m), [SNAPSHOTTER_FINALIZER]);
        let Mirror::Write(copy) = m else {
            unreachable!()
        };
        // It named another plugin: the one that reported is recorded.
        assert_eq!(copy.status.plugin_id, Some(p()));
        assert_eq!(copy.status.snapshot_id.as_deref(), Some("sn-1"));
        assert_eq!(snapshot(&copy, &p(), &r), Mirror::Nothing);
        // Not the snapshot's plugin (its volume's, or its status's): nothing.
        assert_eq!(snapshot(&s, &q(), &r), Mirror::Nothing);
    }

    fn cut_group() -> (VolumeGroupSnapshot, VolumeGroupSnapshotReport) {
        let mut g = VolumeGroupSnapshot::new(
            &Namespace::default_ns(),
            Name::new("g").unwrap(),
            VolumeGroupSnapshotSpec {
                volumes: vec![VolumeId::new("a").unwrap()],
                ..Default::default()
            },
        );
        g.metadata.uid = "g-1".into();
        g.metadata
            .finalizers
            .push(GROUP_SNAPSHOTTER_FINALIZER.into());
        let st = VolumeGroupSnapshotStatus {
            phase: SnapshotPhase::Ready,
            plugin_id: Some(p()),
            group_snapshot_id: Some("grp".into()),
            ready_to_use: true,
            ..Default::default()
        };
        let r = VolumeGroupSnapshotReport::of(&p(), &g, st, FinalizerAsk::Hold);
        (g, r)
    }

    #[test]
    fn a_cut_group_is_marked_for_its_members_once_and_keeps_the_mark() {
        let (g, r) = cut_group();
        let Mirror::Write(copy) = group(&g, &p(), &r) else {
            panic!("not copied")
        };
        assert!(members_made(&copy).is_some());
        // The report never says MembersCreated: the copy keeps the controller's own.
        assert_eq!(group(&copy, &p(), &r), Mirror::Nothing);
        // Not yet cut: no mark.
        let mut creating = r.clone();
        creating.status.ready_to_use = false;
        creating.status.phase = SnapshotPhase::Creating;
        let Mirror::Write(copy) = group(&g, &p(), &creating) else {
            panic!("not copied")
        };
        assert!(members_made(&copy).is_none());
        // Another plugin's report: nothing.
        assert_eq!(group(&g, &q(), &r), Mirror::Nothing);
        // Released while deleting: the finalizer goes (the members with it, in
        // `before`).
        let mut deleting = g.clone();
        deleting.metadata.deletion_timestamp = Some(Timestamp::now());
        let mut released = r.clone();
        released.spec.finalizer = FinalizerAsk::Released;
        assert!(finalizers(&group(&deleting, &p(), &released)).is_empty());
    }
}
