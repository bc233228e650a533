//! The attacher's reports ([`AttachmentReport`]): what the agent leading a plugin keeps
//! of each of its attachments' status, below its own plugin's prefix, since the
//! Attachment itself is the controller's to write (issue 77).
//!
//! The status the attacher acts on is its report's, when the report is about the
//! attachment (the same uid); else the attachment's stored status: one no agent of this
//! version reported on yet (made before the upgrade, or just made), which only the
//! controller writes. A report is written with a compare on the revision read (created
//! if absent), and deleted once its attachment is gone.

use moor::api::*;
use moor::runtime::informer::Informer;
use moor::runtime::writer::Writer;
use moor::store::StoreError;
use std::sync::Arc;

/// One plugin's reports, and the writer they are written with.
#[derive(Clone)]
pub struct Reports {
    /// This plugin's reports (`attachment-reports/PLUGIN/`).
    pub cache: Informer<AttachmentReport>,
    /// The plugin leader's fenced writer, tracking the cache.
    pub writer: Writer,
}

impl Reports {
    /// The report on `att` as this process last wrote or read it.
    async fn current(&self, att: &Attachment) -> Result<Option<Arc<AttachmentReport>>, StoreError> {
        (self.writer)
            .fresh(&self.cache.reader(), &AttachmentReport::key_of(att))
            .await
    }

    /// `att` with the status its report gives it (see the module's doc).
    pub async fn reported(&self, att: &Attachment) -> Result<Attachment, StoreError> {
        let report = self.current(att).await?;
        let mut a = att.clone();
        a.status = att.reported(report.as_deref());
        Ok(a)
    }

    /// `att`'s status as the cache shows its report (for a look across attachments,
    /// which an action checks again on the one it acts on).
    pub fn cached(&self, att: &Attachment) -> AttachmentStatus {
        let report = self.cache.reader().get(&AttachmentReport::key_of(att));
        att.reported(report.as_deref())
    }

    /// Writes `f` onto the status of `att` (as [`Reports::reported`] gave it) into its
    /// report; no write when `f` changes nothing. Returns `att` with the new status.
    pub async fn write(
        &self,
        att: &Attachment,
        f: impl Fn(&mut AttachmentStatus),
    ) -> Result<Attachment, StoreError> {
        let mut next = att.clone();
        f(&mut next.status);
        let mut report = self.current(att).await?;
        let mut retry = moor::store::ConflictRetry::default();
        loop {
            let about = report.as_deref().filter(|r| r.is_about(att));
            if about.is_some_and(|r| r.status == next.status) {
                return Ok(next);
            }
            let mut wanted = AttachmentReport::of(att, next.status.clone());
            let written = match report.as_deref() {
                None => self.writer.create(&wanted).await,
                Some(stored) => {
                    wanted.metadata = stored.metadata.clone();
                    self.writer.update(stored, &wanted).await
                }
            };
            match written {
                Ok(_) => return Ok(next),
                Err(StoreError::Conflict { .. } | StoreError::AlreadyExists { .. })
                    if retry.again().await =>
                {
                    // Read again: the base of `f` stays the status it was given,
                    // which its caller decided on.
                    let key = AttachmentReport::key_of(att);
                    report = self.writer.store().try_get(&key).await?.map(Arc::new);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Deletes this plugin's report at the key of an attachment that is gone.
    pub async fn forget(
        &self,
        plugin: &PluginId,
        att: &ObjectKey<AttachmentSpec>,
    ) -> Result<(), StoreError> {
        let key = AttachmentReport::key_for(plugin, att);
        let Some(report) = self.writer.fresh(&self.cache.reader(), &key).await? else {
            return Ok(());
        };
        match self.writer.delete_read(&report).await {
            Ok(_) | Err(StoreError::NotFound { .. }) => Ok(()),
            // Written since (by this plugin's next leader): its own pass decides.
            Err(StoreError::Conflict { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }
}
