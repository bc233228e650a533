//! The agent's reports ([`ReportSpec`]): what the agent leading a plugin keeps of the
//! status of each of its attachments (and, with the same rules, of any kind whose
//! objects others write), below its own plugin's prefix, since the objects themselves
//! are not its to write (issue 77).
//!
//! The status the agent acts on is its report's, when the report is about the object
//! (the same uid); else the object's stored status: one no agent of this version
//! reported on yet (made before the upgrade, or just made). A report is written with a
//! compare on the revision read (created if absent), and deleted once its object is
//! gone.

use moor::api::*;
use moor::runtime::informer::Informer;
use moor::runtime::writer::Writer;
use moor::store::StoreError;
use std::sync::Arc;

/// One plugin's reports on objects of kind `K`, and the writer they are written with.
pub struct Reports<K: Reported> {
    /// The plugin whose leader writes them.
    pub plugin: PluginId,
    /// This plugin's reports (`REPORT_DIR/PLUGIN/`).
    pub cache: Informer<Report<K>>,
    /// The plugin leader's fenced writer, tracking the cache.
    pub writer: Writer,
}

impl<K: Reported> Clone for Reports<K> {
    fn clone(&self) -> Self {
        Reports {
            plugin: self.plugin.clone(),
            cache: self.cache.clone(),
            writer: self.writer.clone(),
        }
    }
}

impl<K: Reported> Reports<K> {
    /// Plugin `plugin`'s reports in `cache`, written with `writer`.
    pub fn new(plugin: &PluginId, cache: Informer<Report<K>>, writer: &Writer) -> Self {
        Reports {
            plugin: plugin.clone(),
            cache,
            writer: writer.clone(),
        }
    }

    /// The report on `obj` as this process last wrote or read it.
    async fn current(&self, obj: &Object<K>) -> Result<Option<Arc<Report<K>>>, StoreError> {
        (self.writer)
            .fresh(&self.cache.reader(), &self.key(obj))
            .await
    }

    fn key(&self, obj: &Object<K>) -> ObjectKey<ReportSpec<K>> {
        Report::key_for(&self.plugin, &obj.object_key())
    }

    /// `obj` with the status its report gives it (see the module's doc).
    pub async fn reported(&self, obj: &Object<K>) -> Result<Object<K>, StoreError> {
        Ok(self.reported_asking(obj).await?.0)
    }

    /// [`Reports::reported`], and what the report asks of the plugin's finalizer.
    pub async fn reported_asking(
        &self,
        obj: &Object<K>,
    ) -> Result<(Object<K>, FinalizerAsk), StoreError> {
        let report = self.current(obj).await?;
        let mut o = obj.clone();
        let p = &self.plugin;
        *K::section_mut(&mut o.status) = obj.reported(p, report.as_deref());
        Ok((o, obj.finalizer_asked(p, report.as_deref())))
    }

    /// `obj`'s reported section as the cache shows its report (for a look across
    /// objects, which an action checks again on the one it acts on).
    pub fn cached(&self, obj: &Object<K>) -> K::Section {
        let report = self.cache.reader().get(&self.key(obj));
        obj.reported(&self.plugin, report.as_deref())
    }

    /// Writes `f` onto the reported section of `obj` as its report holds it now (a
    /// read-modify-write: the survey and the step reconcilers write the same report),
    /// asking `finalizer` of the plugin's finalizer (`None`: what the report asks
    /// already); no write when nothing changes. Returns `obj` with the new section.
    pub async fn write(
        &self,
        obj: &Object<K>,
        finalizer: Option<FinalizerAsk>,
        mut f: impl FnMut(&mut K::Section),
    ) -> Result<Object<K>, StoreError> {
        let p = &self.plugin;
        let mut report = self.current(obj).await?;
        let mut retry = moor::store::ConflictRetry::default();
        loop {
            let mut section = obj.reported(p, report.as_deref());
            f(&mut section);
            let asked = finalizer.unwrap_or_else(|| obj.finalizer_asked(p, report.as_deref()));
            let mut next = obj.clone();
            *K::section_mut(&mut next.status) = section.clone();
            let about = report.as_deref().filter(|r| r.is_about(obj, p));
            if about.is_some_and(|r| r.status == section && r.spec.finalizer == asked) {
                return Ok(next);
            }
            let mut wanted = Report::of(p, obj, section, asked);
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
                    report = self
                        .writer
                        .store()
                        .try_get(&self.key(obj))
                        .await?
                        .map(Arc::new);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Deletes this plugin's report at the key of an object that is gone (or no
    /// longer its plugin's).
    pub async fn forget(&self, key: &ObjectKey<K>) -> Result<(), StoreError> {
        let key = Report::key_for(&self.plugin, key);
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
