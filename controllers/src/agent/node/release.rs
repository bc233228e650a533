//! A released or deleted claim: NodeUnpublish if it may be published, then NodeUnstage
//! when no other claim uses the staging path and it may be staged; a step whose every
//! attempt failed with a final answer owes no reverse. Before a released claim is
//! torn down, what is left in its workload's cgroup is killed ([`end_workload`]).

use moor::workload::cgroup::{owner_tag, Cgroup};

use super::*;

impl Reconcile {
    pub(super) async fn release(&self, key: &str, claim: &Claim) -> Result<(), NodeError> {
        let rec = self.r.local.lock().await.publishes.get(key).cloned();
        if let Some(rec) = rec.filter(|r| !r.released) {
            if let Some(cgroup) = claim.spec.workload_cgroup.as_deref() {
                let tag = owner_tag(
                    claim.metadata.namespace.as_str(),
                    claim.spec.allocation.as_str(),
                    claim.spec.node.as_str(),
                );
                if let Err(e) = end_workload(cgroup, &tag).await {
                    return self.teardown_failed(key, claim, e).await;
                }
            }
            self.torn_down(key, claim, &rec).await?;
            // On disk before the Mount says released (sync_mount settles).
            self.record(|s| {
                if let Some(p) = s.publishes.get_mut(key) {
                    p.released = true;
                    p.steps = Default::default();
                }
            })
            .await?;
        }
        self.sync_mount(key, claim, None).await?;
        // Torn down, but not acknowledged while an orphan holds the volume here (the
        // Mount says why): looked at again on the backoff.
        if let Some(target) = claim
            .spec
            .external_id
            .as_ref()
            .and_then(|v| self.held_by_orphan(key, &claim.spec.plugin_id, v))
        {
            return Err(NodeError::VolumeHeldByOrphan {
                target: path_str(&target),
            });
        }
        Ok(())
    }

    /// The claim's teardown ([`Reconcile::teardown`]) for a release or a withdrawn
    /// grant, its failure said on the Mount.
    pub(super) async fn torn_down(
        &self,
        key: &str,
        claim: &Claim,
        rec: &PublishRecord,
    ) -> Result<(), NodeError> {
        match self.teardown(key, rec).await {
            Ok(()) => Ok(()),
            Err(e) => self.teardown_failed(key, claim, e).await,
        }
    }

    /// A teardown that failed: said on the Mount, unless it was recorded when it failed
    /// (backing off).
    async fn teardown_failed(
        &self,
        key: &str,
        claim: &Claim,
        e: NodeError,
    ) -> Result<(), NodeError> {
        if !e.is_backing_off() {
            let msg = moor::process::error_chain(&e);
            self.sync_mount(key, claim, Some(msg)).await?;
        }
        Err(e)
    }

    /// NodeUnpublish if it may be published, then NodeUnstage if no other claim uses the
    /// staging path and it may be staged.
    pub(super) async fn teardown(&self, key: &str, rec: &PublishRecord) -> Result<(), NodeError> {
        if rec.released {
            return Ok(());
        }
        let cfg = self.plugin(&rec.plugin_id)?.clone();
        let facts = plan::read(&*self.r.local.lock().await, key, rec, None);
        let steps = plan::to_release(&facts);
        for step in steps {
            match step {
                plan::Reverse::Unpublish => self.ensure_unpublished(&cfg, key, rec).await?,
                plan::Reverse::Unstage => {
                    let staging = staging_of(rec)?;
                    self.unstage(&cfg, key, rec, staging, &rec.claim_uid)
                        .await?
                }
                plan::Reverse::ForgetStage => self.forget_stage(staging_of(rec)?).await?,
            }
        }
        Ok(())
    }

    /// NodeUnstage of `staging` (with the volume id it was staged with), then its
    /// record forgotten.
    pub(super) async fn unstage(
        &self,
        cfg: &PluginConfig,
        key: &str,
        rec: &PublishRecord,
        staging: &Path,
        claim_uid: &str,
    ) -> Result<(), NodeError> {
        let stage = self.r.local.lock().await.stages.get(staging).cloned();
        let volume_id = stage
            .as_ref()
            .map_or(&rec.external_id, |st| &st.external_id);
        let req = v1::NodeUnstageVolumeRequest {
            volume_id: volume_id.to_string(),
            staging_target_path: path_str(&plugin_path(cfg, staging)),
        };
        let step = self.begin(key, plan::UNSTAGE, self.inputs(claim_uid, 0))?;
        let csi = self.csi(cfg)?;
        step.call(csi.node_unstage(req)).await?;
        self.forget_stage(staging).await
    }

    async fn ensure_unpublished(
        &self,
        cfg: &PluginConfig,
        key: &str,
        rec: &PublishRecord,
    ) -> Result<(), NodeError> {
        let req = v1::NodeUnpublishVolumeRequest {
            volume_id: rec.external_id.to_string(),
            target_path: path_str(&plugin_path(cfg, &rec.target_path)),
        };
        let step = self.begin(key, plan::UNPUBLISH, self.inputs(&rec.claim_uid, 0))?;
        let csi = self.csi(cfg)?;
        let result = step.call(csi.node_unpublish(req)).await;
        let error = result.as_ref().err().map(|f| f.message());
        self.unmount_event(rec, error).await;
        result?;
        self.record(|s| Scope::Claim.set(s, key, plan::PUBLISH, Step::Absent))
            .await
    }

    /// Drops the staging path's record; the directory is ours to remove once the
    /// plugin let go of it.
    async fn forget_stage(&self, staging: &Path) -> Result<(), NodeError> {
        self.record(|s| {
            s.stages.remove(staging);
        })
        .await?;
        let _ = std::fs::remove_dir(staging);
        Ok(())
    }
}

/// How long a pass waits for a workload's cgroup to empty after SIGKILL before it
/// gives up until its next try.
const WORKLOAD_END: std::time::Duration = std::time::Duration::from_secs(5);

/// Kills what is left in the workload cgroup `recorded` (its runner died without
/// ending it) and waits until it is empty: nothing of the workload may use the volume
/// once it is unpublished. A cgroup not found here is gone (or in a hierarchy this
/// agent does not see: said at debug, and the release goes on). A cgroup not made for
/// the claim's allocation (`tag`, [`owner_tag`]) is a writer's word about another
/// workload: nothing in it is signalled (said as a warning, without the path), and the
/// release goes on as where no cgroup was recorded.
pub(super) async fn end_workload(recorded: &str, tag: &str) -> Result<(), NodeError> {
    if let Err(why) = moor::workload::cgroup::check_owned(recorded, tag) {
        tracing::warn!(%why, "the claim's recorded workload cgroup is not signalled");
        return Ok(());
    }
    let found = match Cgroup::find_recorded(recorded, tag) {
        Ok(found) => found,
        Err(why) => {
            tracing::debug!(cgroup = recorded, %why, "the workload's cgroup is not seen here");
            return Ok(());
        }
    };
    let Some(cgroup) = found else {
        return Ok(());
    };
    if cgroup.populated() {
        tracing::warn!(
            cgroup = recorded,
            pids = ?cgroup.pids(),
            "the workload left processes (its runner is gone, or its stop outlived the kill timeout and lease); killing them before NodeUnpublish"
        );
    }
    cgroup
        .end(WORKLOAD_END)
        .await
        .map_err(|why| NodeError::WorkloadLeft {
            cgroup: recorded.to_string(),
            why,
        })
}
