//! Reports copied into their objects: the controller, the one writer of Attachments
//! and of what moor adds to a Volume, takes from each report the agent leading the
//! object's plugin writes ([`ReportSpec`]) what it says of the object: the reported
//! section of its status, the plugin's finalizer added or removed, an attachment
//! deleted once detached (issue 77: the agents of controller plugins no longer write
//! these objects).
//!
//! A report counts only under the key of the object's own plugin and only for the
//! object it names by uid ([`Report::is_about`]): another plugin's agent cannot report
//! on it, and a report left from an object made again under the same key is not about
//! the new one. An object no report is about keeps what it holds (written by an older
//! agent, or not acted on yet).
//!
//! Driven by the reports: one pass per report written (and one for each at the start).
//! A pass its own write brings finds the object saying what the report says and
//! writes nothing. What each kind takes from a report is decided by a pure function
//! ([`attachment`], [`volume`]).

use moor::api::*;
use moor::runtime::controller::{Action, Config, Controller};
use moor::runtime::informer::Informer;
use moor::runtime::metrics::ControllerMetrics;
use moor::store::StoreError;
use std::future::Future;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

use super::context::Ctx;

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

/// What an Attachment takes from its report: deleted once Detached while asked to
/// detach, else the report's status.
pub fn attachment(att: &Attachment, report: &AttachmentReport) -> Mirror<AttachmentSpec> {
    if !report.is_about(att) {
        return Mirror::Nothing;
    }
    if att.spec.detach && report.status.phase == AttachmentPhase::Detached {
        return Mirror::Delete;
    }
    copied(att, report)
}

/// What a Volume takes from its report: `status.provisioning`, and the provisioner's
/// finalizer added before a creation (never to a volume being deleted) or removed
/// once released (only from a volume being deleted).
pub fn volume(vol: &Volume, report: &VolumeReport) -> Mirror<VolumeSpec> {
    if !report.is_about(vol) {
        return Mirror::Nothing;
    }
    let mut next = vol.clone();
    let has = vol
        .metadata
        .finalizers
        .iter()
        .any(|f| f == PROVISIONER_FINALIZER);
    match report.spec.finalizer {
        FinalizerAsk::Hold if !has && !vol.is_deleting() => {
            next.metadata.finalizers.push(PROVISIONER_FINALIZER.into())
        }
        FinalizerAsk::Released if has && vol.is_deleting() => next
            .metadata
            .finalizers
            .retain(|f| f != PROVISIONER_FINALIZER),
        _ => {}
    }
    next.status.provisioning = report.status.clone();
    if next == *vol {
        return Mirror::Nothing;
    }
    Mirror::Write(Box::new(next))
}

fn copied<K: Reported>(obj: &Object<K>, report: &Report<K>) -> Mirror<K> {
    if K::section(&obj.status) == &report.status {
        return Mirror::Nothing;
    }
    let mut next = obj.clone();
    *K::section_mut(&mut next.status) = report.status.clone();
    Mirror::Write(Box::new(next))
}

/// What one kind's copy reads and decides with.
struct Copier<K: Reported, R> {
    ctx: Ctx,
    cache: moor::runtime::reflector::Store<Report<K>>,
    read: R,
    decide: fn(&Object<K>, &Report<K>) -> Mirror<K>,
}

/// Runs the copy of `K`'s reports until `stop`: `read` gives an object as stored now
/// (or as this process last wrote it), `decide` what its report asks of it. `read`
/// must not take an object its cache lacks or shows older for gone or unchanged: a
/// report is written after its agent saw the object as stored, and nothing but the
/// next report brings the pass again (attachments: only this process writes them, so
/// its own last write is as new as anything an agent saw; volumes: read from the
/// store).
pub async fn run<K, R, Fut>(
    ctx: Ctx,
    reports: Informer<Report<K>>,
    read: R,
    decide: fn(&Object<K>, &Report<K>) -> Mirror<K>,
    config: Config,
    metrics: ControllerMetrics,
    stop: CancellationToken,
) where
    K: Reported,
    R: Fn(Ctx, ObjectKey<K>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Option<Arc<Object<K>>>, StoreError>> + Send + 'static,
{
    let name = format!("{}s", K::REPORT_KIND.to_lowercase());
    let this = Arc::new(Copier {
        ctx,
        cache: reports.reader(),
        read,
        decide,
    });
    Controller::new(&name, reports.reader(), config)
        .with_metrics(metrics)
        .owns(reports.subscribe())
        .run(
            |this: Arc<Copier<K, R>>, key: ObjectKey<ReportSpec<K>>| async move {
                // Every cache listed first: a read of an attachment through a cache
                // not listed yet finds nothing, and the pass would end there (seen in
                // the benchmark's controller restart: 70 of 300 attachments never
                // copied).
                this.ctx.ready().await;
                this.cache.wait_until_ready().await;
                let Some(report) = this.cache.get(&key) else {
                    return Ok(Action::AwaitChange);
                };
                let Some(about) = report.about_key() else {
                    return Ok(Action::AwaitChange);
                };
                let Some(obj) = (this.read)(this.ctx.clone(), about).await? else {
                    return Ok(Action::AwaitChange);
                };
                write(&this.ctx, &obj, (this.decide)(&obj, &report)).await
            },
            this,
            stop,
        )
        .await;
}

async fn write<K: Reported>(
    ctx: &Ctx,
    obj: &Object<K>,
    mirror: Mirror<K>,
) -> Result<Action, StoreError> {
    let done = match mirror {
        Mirror::Nothing => return Ok(Action::AwaitChange),
        Mirror::Write(next) => ctx.writer.update(obj, &next).await.map(|_| ()),
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

    fn attachment_of(plugin: &str) -> Attachment {
        let mut a = crate::controller::plan::tests::attachment(AccessMode::SingleNodeWriter, false);
        a.spec.plugin_id = PluginId::new(plugin).unwrap();
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
        AttachmentReport::of(att, st, FinalizerAsk::Unasked)
    }

    #[test]
    fn a_report_is_copied_once() {
        let att = attachment_of("p.example");
        let r = report(&att, attached());
        let Mirror::Write(copy) = attachment(&att, &r) else {
            panic!("not copied")
        };
        assert_eq!(copy.status, attached());
        assert_eq!(attachment(&copy, &r), Mirror::Nothing);
    }

    #[test]
    fn only_a_report_about_the_attachment_under_its_own_plugin_counts() {
        let att = attachment_of("p.example");
        // Another plugin's leader reporting on it, at its own plugin's prefix.
        let forged = report(&attachment_of("other.example"), attached());
        assert_eq!(attachment(&att, &forged), Mirror::Nothing);
        // A report on an earlier attachment under the same key.
        let mut earlier = att.clone();
        earlier.metadata.uid = "att-0".into();
        assert_eq!(
            attachment(&att, &report(&earlier, attached())),
            Mirror::Nothing
        );
    }

    #[test]
    fn detached_deletes_only_what_was_asked_to_detach() {
        let mut att = attachment_of("p.example");
        let detached = AttachmentStatus {
            phase: AttachmentPhase::Detached,
            ..Default::default()
        };
        let r = report(&att, detached);
        assert!(matches!(attachment(&att, &r), Mirror::Write(_)));
        att.spec.detach = true;
        assert_eq!(attachment(&att, &r), Mirror::Delete);
    }

    fn created_volume() -> Volume {
        let mut v = Volume::new(
            &Namespace::default_ns(),
            Name::new("v").unwrap(),
            VolumeSpec {
                plugin_id: PluginId::new("p.example").unwrap(),
                ..Default::default()
            },
        );
        v.metadata.uid = "vol-1".into();
        v
    }

    fn finalizers(m: &Mirror<VolumeSpec>) -> Vec<String> {
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
        let hold = VolumeReport::of(&vol, section.clone(), FinalizerAsk::Hold);
        assert_eq!(finalizers(&volume(&vol, &hold)), [PROVISIONER_FINALIZER]);
        let mut held = vol.clone();
        held.metadata.finalizers.push(PROVISIONER_FINALIZER.into());
        assert_eq!(volume(&held, &hold), Mirror::Nothing);
        // Released: removed only from a volume being deleted.
        let released = VolumeReport::of(&vol, section.clone(), FinalizerAsk::Released);
        assert_eq!(volume(&held, &released), Mirror::Nothing);
        let mut deleting = held.clone();
        deleting.metadata.deletion_timestamp = Some(Timestamp::now());
        assert!(finalizers(&volume(&deleting, &released)).is_empty());
        // Never added to a volume being deleted; never removed unasked (a volume an
        // older agent made holds it until a report says released).
        let mut bare = deleting.clone();
        bare.metadata.finalizers.clear();
        assert_eq!(volume(&bare, &hold), Mirror::Nothing);
        let unasked = VolumeReport::of(&vol, section, FinalizerAsk::Unasked);
        assert_eq!(volume(&deleting, &unasked), Mirror::Nothing);
    }

    #[test]
    fn a_volume_takes_its_provisioning_only_from_its_own_plugin_s_report() {
        let vol = created_volume();
        let section = ProvisioningStatus {
            phase: VolumePhase::Ready,
            external_id: Some(ExternalVolumeId::new("ext-1").unwrap()),
            ..Default::default()
        };
        let own = VolumeReport::of(&vol, section.clone(), FinalizerAsk::Unasked);
        let Mirror::Write(copy) = volume(&vol, &own) else {
            panic!("not copied")
        };
        assert_eq!(copy.status.provisioning, section);
        let mut theirs = vol.clone();
        theirs.spec.plugin_id = PluginId::new("other.example").unwrap();
        let forged = VolumeReport::of(&theirs, section, FinalizerAsk::Released);
        assert_eq!(volume(&vol, &forged), Mirror::Nothing);
    }
}
