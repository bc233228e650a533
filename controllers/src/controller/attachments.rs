//! Attachments as their plugins' leaders report them: the controller, the one writer of
//! Attachments, copies into each one's status what the agent leading its plugin
//! reports ([`AttachmentReport`]), and deletes one asked to detach once its report says
//! Detached (issue 77: the agents of controller plugins no longer write attachments).
//!
//! A report counts only under the key of the attachment's own plugin
//! (`attachment-reports/PLUGIN/...`, which only that plugin's controller nodes may
//! write) and only for the attachment it names by uid: another plugin's agent cannot
//! report on it, and a report left from an attachment made again under the same key is
//! not about the new one. An attachment no report is about keeps its status (made by
//! an older agent, which wrote it there; or not acted on yet).
//!
//! Expected flow: the attacher reports uncertain, then Attached with a publish
//! context; this copies both into the Attachment, whose status the claims reconciler
//! reads as before. A pass this brings (its own write) finds the two equal and writes
//! nothing.

use moor::api::*;
use moor::runtime::controller::{Action, Config, Controller};
use moor::runtime::informer::Informer;
use moor::runtime::metrics::ControllerMetrics;
use moor::store::StoreError;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

use super::context::{Ctx, Informers};

/// What the report on `att` asks of it, if anything.
#[derive(Debug, PartialEq)]
pub enum Mirror {
    /// Nothing: no report about it, or its status already says the same.
    Nothing,
    /// Its status, as reported.
    Status(AttachmentStatus),
    /// Detached while asked to detach: delete it.
    Delete,
}

/// The decision for `att` given the report stored at its plugin's key (pure).
pub fn decide(att: &Attachment, report: Option<&AttachmentReport>) -> Mirror {
    let Some(report) = report.filter(|r| r.is_about(att)) else {
        return Mirror::Nothing;
    };
    if att.spec.detach && report.status.phase == AttachmentPhase::Detached {
        return Mirror::Delete;
    }
    if report.status == att.status {
        return Mirror::Nothing;
    }
    Mirror::Status(report.status.clone())
}

/// Runs the mirror until `stop`.
pub async fn run(
    ctx: Ctx,
    inf: &Informers,
    reports: Informer<AttachmentReport>,
    config: Config,
    metrics: ControllerMetrics,
    stop: CancellationToken,
) {
    let reader = reports.reader();
    let this = Arc::new((ctx, reader));
    Controller::new("attachment-reports", inf.attachments.reader(), config)
        .with_metrics(metrics)
        .owns(inf.attachments.subscribe())
        .watches(reports.subscribe(), |r: &AttachmentReport| {
            r.about_key().into_iter().collect()
        })
        .run(
            |this: Arc<(Ctx, moor::runtime::reflector::Store<AttachmentReport>)>, key| async move {
                reconcile(&this.0, &this.1, &key).await
            },
            this,
            stop,
        )
        .await;
}

async fn reconcile(
    ctx: &Ctx,
    reports: &moor::runtime::reflector::Store<AttachmentReport>,
    key: &ObjectKey<AttachmentSpec>,
) -> Result<Action, StoreError> {
    reports.wait_until_ready().await;
    let Some(att) = ctx.writer.fresh(&ctx.attachments, key).await? else {
        return Ok(Action::AwaitChange);
    };
    let report = reports.get(&AttachmentReport::key_of(&att));
    match decide(&att, report.as_deref()) {
        Mirror::Nothing => {}
        Mirror::Status(status) => {
            let mut next = (*att).clone();
            next.status = status;
            match ctx.writer.update(&att, &next).await {
                Ok(_) | Err(StoreError::NotFound { .. }) => {}
                // Changed since: the pass its change brings decides again.
                Err(StoreError::Conflict { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Mirror::Delete => match ctx.writer.delete_read(&att).await {
            Ok(_) | Err(StoreError::NotFound { .. } | StoreError::Conflict { .. }) => {}
            Err(e) => return Err(e),
        },
    }
    Ok(Action::AwaitChange)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attachment(plugin: &str) -> Attachment {
        let spec = AttachmentSpec {
            volume: VolumeId::new("v").unwrap(),
            node: NodeName::new("n1").unwrap(),
            plugin_id: PluginId::new(plugin).unwrap(),
            external_id: ExternalVolumeId::new("ext").unwrap(),
            csi_node_id: CsiNodeId::new("n1").unwrap(),
            capability: VolumeCapability {
                access_mode: AccessMode::SingleNodeWriter,
                attachment_mode: AttachmentMode::FileSystem,
            },
            read_only: false,
            detach: false,
            volume_context: None,
        };
        let mut a = Attachment::new(&Namespace::default_ns(), Name::new("v.n1").unwrap(), spec);
        a.metadata.uid = "att-1".into();
        a
    }

    fn attached() -> AttachmentStatus {
        AttachmentStatus {
            phase: AttachmentPhase::Attached,
            publish_context: [("device".to_string(), "/dev/x".to_string())].into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_report_is_copied_once() {
        let att = attachment("p.example");
        let report = AttachmentReport::of(&att, attached(), false);
        assert_eq!(decide(&att, Some(&report)), Mirror::Status(attached()));
        let mut copied = att.clone();
        copied.status = attached();
        assert_eq!(decide(&copied, Some(&report)), Mirror::Nothing);
        assert_eq!(decide(&att, None), Mirror::Nothing);
    }

    #[test]
    fn only_a_report_about_the_attachment_under_its_own_plugin_counts() {
        let att = attachment("p.example");
        // Another plugin's leader reporting on it, at its own plugin's prefix.
        let mut other = att.clone();
        other.spec.plugin_id = PluginId::new("other.example").unwrap();
        let forged = AttachmentReport::of(&other, attached(), false);
        assert_eq!(decide(&att, Some(&forged)), Mirror::Nothing);
        // A report on an earlier attachment under the same key.
        let mut earlier = att.clone();
        earlier.metadata.uid = "att-0".into();
        let stale = AttachmentReport::of(&earlier, attached(), false);
        assert_eq!(decide(&att, Some(&stale)), Mirror::Nothing);
    }

    #[test]
    fn detached_deletes_only_what_was_asked_to_detach() {
        let mut att = attachment("p.example");
        let detached = AttachmentStatus {
            phase: AttachmentPhase::Detached,
            ..Default::default()
        };
        let report = AttachmentReport::of(&att, detached.clone(), false);
        assert_eq!(decide(&att, Some(&report)), Mirror::Status(detached));
        att.spec.detach = true;
        assert_eq!(decide(&att, Some(&report)), Mirror::Delete);
    }
}
