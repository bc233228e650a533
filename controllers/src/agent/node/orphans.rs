//! Mounts whose claims desired state lost. After an older etcd snapshot is restored,
//! claims made since the snapshot are missing while their mounts live on: such a
//! record ([`plan::Missing::Orphan`]) is kept, never torn down without an operator's
//! command, and reported (its Mount with `status.orphan`, an "Orphaned mount" Warning,
//! `moor_agent_orphaned_mounts`). A granted claim that would publish exactly what an
//! orphan holds ([`plan::adopts`]) takes it over without a CSI call: that is how
//! `moorctl mount adopt` (an allocation made again) and `moorctl mount release`
//! (adopted, then stopped) reach the node. While an orphan of a volume is live, no
//! release of that volume on this node is acknowledged, so the controller never
//! detaches it from under the orphan's workload.

use super::*;
use std::collections::BTreeMap;

/// What the node keeps of each orphaned record, by claim key: enough to find it by
/// target path or by volume without reading the journal.
#[derive(Debug, Clone, Default)]
pub(super) struct Orphans(BTreeMap<String, (PathBuf, PluginId, ExternalVolumeId)>);

impl Orphans {
    /// The orphaned records of a journal.
    pub(super) fn of(local: &LocalState) -> Orphans {
        let orphans = Orphans(
            local
                .publishes
                .iter()
                .filter(|(_, r)| r.orphaned.is_some() && !r.released)
                .map(|(k, r)| (k.clone(), Orphans::entry(r)))
                .collect(),
        );
        orphans.publish_count();
        orphans
    }

    fn entry(r: &PublishRecord) -> (PathBuf, PluginId, ExternalVolumeId) {
        (
            r.target_path.clone(),
            r.plugin_id.clone(),
            r.external_id.clone(),
        )
    }

    fn publish_count(&self) {
        moor::runtime::metrics::orphaned_mounts(self.0.len());
    }
}

impl Reconcile {
    /// [`plan::missing`] for `key`'s record, with the node's own Mount of that claim
    /// as the store holds it now: read from the store, not the cache, whose watch may
    /// not show yet a Mount that went with the claim (only where a record still holds
    /// something, which is rare).
    pub(super) async fn missing(
        &self,
        key: &str,
        rec: &PublishRecord,
    ) -> Result<plan::Missing, NodeError> {
        let facts = plan::read(&*self.r.local.lock().await, key, rec, None);
        let orphan = rec.orphaned.is_some();
        if plan::missing(&facts, false, orphan) == plan::Missing::Deleted {
            return Ok(plan::Missing::Deleted);
        }
        let mount = match mount_key_of(key) {
            Some(k) => self.r.store.try_get(&k).await?,
            None => None,
        };
        let mount_of_claim =
            mount.is_some_and(|m| m.spec.claim_uid == rec.claim_uid && m.status.orphan.is_none());
        Ok(plan::missing(&facts, mount_of_claim, orphan))
    }

    /// Keeps `key`'s record as an orphan ([`Reconcile::mark_orphan`]) and reports it
    /// on its Mount.
    pub(super) async fn orphaned(&self, key: &str, rec: &PublishRecord) -> Result<(), NodeError> {
        let rec = self.mark_orphan(key, rec).await?;
        let since = rec.orphaned.unwrap_or_else(Timestamp::now);
        self.sync_orphan_mount(key, &rec, since).await
    }

    /// Marks `key`'s record an orphan in the journal (once, with a Warning) and in the
    /// node's index of orphans; the record as marked.
    pub(super) async fn mark_orphan(
        &self,
        key: &str,
        rec: &PublishRecord,
    ) -> Result<PublishRecord, NodeError> {
        let mut rec = rec.clone();
        if rec.orphaned.is_none() {
            let since = Timestamp::now();
            self.edit(|s| {
                if let Some(p) = s.publishes.get_mut(key) {
                    p.orphaned = Some(since);
                }
            })
            .await?;
            rec.orphaned = Some(since);
            tracing::warn!(claim = %key, volume = %rec.volume, target = %rec.target_path.display(), "a mount's claim is missing from desired state and nothing says it was deleted (an older etcd snapshot restored?): keeping the mount");
            self.node_event(
                claim_ref(&rec.namespace, &rec.claim),
                &rec.volume,
                "Orphaned mount",
                EventType::Warning,
                format!(
                    "claim {} of allocation {} is missing from desired state, and nothing says it was deleted (an older etcd snapshot restored?): volume {} stays published at {}; adopt it (moorctl mount adopt {} -n {}) or release it (moorctl mount release)",
                    rec.claim,
                    rec.allocation,
                    rec.volume,
                    rec.target_path.display(),
                    rec.claim,
                    rec.namespace,
                ),
                None,
            )
            .await;
        }
        let mut orphans = self.orphans.lock().unwrap_or_else(|e| e.into_inner());
        orphans.0.insert(key.to_string(), Orphans::entry(&rec));
        orphans.publish_count();
        Ok(rec)
    }

    /// Writes the orphan's Mount: what it holds and `status.orphan`.
    async fn sync_orphan_mount(
        &self,
        key: &str,
        rec: &PublishRecord,
        since: Timestamp,
    ) -> Result<(), NodeError> {
        let Some(mount_key) = mount_key_of(key) else {
            return Ok(());
        };
        let stage = match &rec.staging_path {
            Some(p) => self.r.local.lock().await.stages.get(p).map(|s| s.step),
            None => None,
        };
        // Who uses it now (issue 78, item 3): `moorctl mount release` refuses while
        // anyone does. Read from /proc off the runtime's workers.
        let target = rec.target_path.clone();
        let holders =
            tokio::task::spawn_blocking(move || moor::workload::holders::holders(&target))
                .await
                .unwrap_or_default();
        let spec = MountSpec {
            claim: rec.claim.clone(),
            claim_uid: Uid::new(&rec.claim_uid),
            allocation: rec.allocation.clone(),
            volume: rec.volume.clone(),
            node: self.r.node.clone(),
            staging_path: rec.staging_path.as_ref().map(|p| path_str(p)),
            target_path: path_str(&rec.target_path),
        };
        let status = MountStatus {
            staged: stage == Some(Step::Done),
            stage_uncertain: stage == Some(Step::Uncertain),
            published: rec.steps.get(plan::PUBLISH) == Step::Done,
            publish_uncertain: rec.steps.get(plan::PUBLISH) == Step::Uncertain,
            expanded_bytes: rec.expanded_bytes,
            orphan: rec
                .orphan(since)
                .map(|o| Orphan { holders, ..o })
                .map(Box::new),
            ..Default::default()
        };
        self.put_mount(&mount_key, (&rec.namespace, &rec.claim), spec, None, |_| {
            status
        })
        .await
    }

    /// Adopts `key`'s orphaned record for `claim` (stored under the same key, another
    /// uid) when the claim would publish exactly what it holds. `false`: not adopted.
    pub(super) async fn adopt_in_place(
        &self,
        key: &str,
        rec: &PublishRecord,
        claim: &Claim,
    ) -> Result<bool, NodeError> {
        if rec.orphaned.is_none() {
            return Ok(false);
        }
        let Some((target, staging)) = self.claim_paths(claim) else {
            return Ok(false);
        };
        if !plan::adopts(rec, claim, &target, staging.as_deref()) {
            return Ok(false);
        }
        self.adopt(key, key, rec, claim).await?;
        Ok(true)
    }

    /// The orphaned record a new claim (`key`, with no record of its own) adopts, moved
    /// under the claim's key; `None` when no orphan holds what it would publish.
    pub(super) async fn adopt_elsewhere(
        &self,
        key: &str,
        claim: &Claim,
        target: &Path,
        staging: Option<&Path>,
    ) -> Result<Option<PublishRecord>, NodeError> {
        let found = {
            let orphans = self.orphans.lock().unwrap_or_else(|e| e.into_inner());
            orphans
                .0
                .iter()
                .find(|(_, (t, _, _))| t == target)
                .map(|(k, _)| k.clone())
        };
        let Some(from) = found else {
            return Ok(None);
        };
        let Some(rec) = self.r.local.lock().await.publishes.get(&from).cloned() else {
            return Ok(None);
        };
        if !plan::adopts(&rec, claim, target, staging) {
            return Ok(None);
        }
        Ok(Some(self.adopt(&from, key, &rec, claim).await?))
    }

    /// Moves an orphaned record from `from` to `to` as the record of `claim`, on the
    /// claim's grant (the volume never left this node: ControllerPublish of the new
    /// attachment was a no-op for the plugin), and its staging path's record with it.
    /// The orphan's Mount goes when the key changes; the claim's own is written by its
    /// pass.
    async fn adopt(
        &self,
        from: &str,
        to: &str,
        rec: &PublishRecord,
        claim: &Claim,
    ) -> Result<PublishRecord, NodeError> {
        let adopted = PublishRecord {
            claim_uid: claim.metadata.uid.to_string(),
            namespace: claim.metadata.namespace.clone(),
            claim: claim.metadata.name.clone(),
            allocation: claim.spec.allocation.clone(),
            attachment: claim.spec.attachment.as_ref().map(Uid::to_string),
            publish_context: Some(claim.spec.publish_context.clone()),
            made_for: made_for(claim),
            orphaned: None,
            ..rec.clone()
        };
        self.edit(|s| {
            s.publishes.remove(from);
            s.publishes.insert(to.to_string(), adopted.clone());
            if let Some(st) = rec.staging_path.as_ref().and_then(|p| s.stages.get_mut(p)) {
                st.attachment = claim.spec.attachment.as_ref().map(Uid::to_string);
                st.publish_context = Some(claim.spec.publish_context.clone());
            }
        })
        .await?;
        {
            let mut orphans = self.orphans.lock().unwrap_or_else(|e| e.into_inner());
            orphans.0.remove(from);
            orphans.publish_count();
        }
        if from != to {
            self.delete_mount(from).await?;
        }
        tracing::info!(claim = %to, orphan = %from, target = %rec.target_path.display(), "adopted an orphaned mount without a CSI call");
        self.node_event(
            claim_ref(&claim.metadata.namespace, &claim.metadata.name),
            &claim.spec.volume,
            "Adopted mount",
            EventType::Normal,
            format!(
                "claim {} adopted the orphaned mount of {} at {} (earlier claim {}) without unmounting it",
                claim.metadata.name,
                rec.volume,
                rec.target_path.display(),
                rec.claim
            ),
            None,
        )
        .await;
        Ok(adopted)
    }

    /// The target and staging paths `claim` would publish through, when its plugin
    /// runs here and admission filled in its capability.
    fn claim_paths(&self, claim: &Claim) -> Option<(PathBuf, Option<PathBuf>)> {
        let cfg = self.plugin(&claim.spec.plugin_id).ok()?;
        let cap = VolumeCapability {
            access_mode: claim.spec.access_mode?,
            attachment_mode: claim.spec.attachment_mode?,
        };
        let stages = self
            .r
            .supervisor
            .status(&cfg.id)?
            .capabilities
            .node
            .has(NodeRpc::StageUnstageVolume);
        let p = paths(cfg, claim, cap);
        Some((p.target_host, stages.then_some(p.staging_host)))
    }

    /// The target path of an orphan (other than `key`'s record) of the same plugin's
    /// volume on this node, if any: the volume is not let go while it is live.
    pub(super) fn held_by_orphan(
        &self,
        key: &str,
        plugin: &PluginId,
        volume: &ExternalVolumeId,
    ) -> Option<PathBuf> {
        let orphans = self.orphans.lock().unwrap_or_else(|e| e.into_inner());
        orphans
            .0
            .iter()
            .find(|(k, (_, p, v))| k.as_str() != key && p == plugin && v == volume)
            .map(|(_, (t, _, _))| t.clone())
    }

    /// Drops `key` from the orphans, when it was one (its record forgotten).
    pub(super) fn forget_orphan(&self, key: &str) {
        let mut orphans = self.orphans.lock().unwrap_or_else(|e| e.into_inner());
        if orphans.0.remove(key).is_some() {
            orphans.publish_count();
        }
    }
}

/// The request, mode and capability `claim` was made with (absent when admission has
/// not filled the capability in).
pub(super) fn made_for(claim: &Claim) -> Option<MadeFor> {
    Some(MadeFor {
        request: claim.spec.request.clone(),
        mode: claim.spec.mode,
        capability: VolumeCapability {
            access_mode: claim.spec.access_mode?,
            attachment_mode: claim.spec.attachment_mode?,
        },
    })
}
