//! What the node reports of a claim: its Mount (staged, published, paths, the failing
//! step, what the stats loop measured), and the Mount, Unmount and Expand events, each
//! related to the claim.

use super::*;

impl Reconcile {
    /// Writes the claim's Mount object from the local state.
    pub(super) async fn sync_mount(
        &self,
        key: &str,
        claim: &Claim,
        last_error: Option<String>,
    ) -> Result<(), NodeError> {
        let (rec, stage) = {
            let s = self.r.local.lock().await;
            let rec = s.publishes.get(key).cloned();
            let stage = rec
                .as_ref()
                .and_then(|r| r.staging_path.as_ref())
                .and_then(|p| s.stages.get(p))
                .map(|st| st.step)
                .unwrap_or_default();
            (rec, stage)
        };
        let spec = MountSpec {
            claim: claim.metadata.name.clone(),
            claim_uid: claim.metadata.uid.clone(),
            allocation: claim.spec.allocation.clone(),
            volume: claim.spec.volume.clone(),
            node: self.r.node.clone(),
            staging_path: rec
                .as_ref()
                .and_then(|r| r.staging_path.as_ref())
                .map(|p| path_str(p)),
            target_path: rec
                .as_ref()
                .map(|r| path_str(&r.target_path))
                .unwrap_or_else(|| "-".into()),
        };
        // While an orphaned mount of the same volume is live here, no release is
        // acknowledged: the controller would detach the volume from under it.
        let held = claim.spec.external_id.as_ref().and_then(|v| {
            self.held_by_orphan(key, &claim.spec.plugin_id, v)
                .map(|target| NodeError::VolumeHeldByOrphan {
                    target: path_str(&target),
                })
        });
        let last_error = last_error.or_else(|| held.as_ref().map(|e| e.to_string()));
        let released = rec.as_ref().is_none_or(|r| r.released) && held.is_none();
        let publish = rec
            .as_ref()
            .map_or(Step::Absent, |r| r.steps.get(plan::PUBLISH));
        // A failing CSI step stays on the Mount until it succeeds: what it waits on,
        // since when, the last answer and the next retry.
        let retry = self.r.steps.latest_failure(key);
        let last_error = last_error.or_else(|| {
            retry
                .as_ref()
                .map(|f| format!("{} failed with {}: {}", f.step, f.code, f.message))
        });
        let mut status = MountStatus {
            usage: None,
            condition: None,
            staged: !released && stage == Step::Done,
            stage_uncertain: !released && stage == Step::Uncertain,
            published: publish == Step::Done,
            publish_uncertain: publish == Step::Uncertain,
            released: released && (claim.spec.release || claim.is_deleting()),
            expanded_bytes: rec.as_ref().and_then(|r| r.expanded_bytes),
            orphan: None,
            meta: StatusMeta {
                observed_generation: claim.metadata.generation,
                last_error,
                retry: retry.map(Box::new),
                ..Default::default()
            },
        };
        let mount_key = Mount::key_for(&claim.object_key());
        self.put_mount(
            &mount_key,
            (&claim.metadata.namespace, &claim.metadata.name),
            spec,
            claim.metadata.trace.clone(),
            |current| {
                // The volume stats loop's fields are kept as it last wrote them.
                if let Some(current) = current {
                    status.usage = current.status.usage.clone();
                    status.condition = current.status.condition.clone();
                }
                status
            },
        )
        .await
    }

    /// Deletes the Mount of the claim at `claim_key` (gone already is fine), once the
    /// journal holds on disk what led to it.
    pub(super) async fn delete_mount(&self, claim_key: &str) -> Result<(), NodeError> {
        let Some(mount) = mount_key_of(claim_key) else {
            return Ok(());
        };
        self.settle().await?;
        crate::common::ignore_not_found(self.writer.delete(&mount, None).await.map(|_| ()))?;
        Ok(())
    }

    /// Writes the Mount at `key` (of claim `claim` in `namespace`) with `spec` and the
    /// status `status` makes from what is stored: created with `trace` when absent,
    /// nothing written when it is already so.
    pub(super) async fn put_mount(
        &self,
        key: &ObjectKey<MountSpec>,
        (namespace, claim): (&Namespace, &Name),
        spec: MountSpec,
        trace: Option<Box<str>>,
        status: impl FnOnce(Option<&Mount>) -> MountStatus,
    ) -> Result<(), NodeError> {
        // What the Mount says, the journal holds on disk first.
        self.settle().await?;
        let current = self.writer.fresh(&self.mounts, key).await?;
        let status = status(current.as_deref());
        match current {
            None => {
                let mut m = Mount::new(namespace, claim.clone(), spec);
                m.status = status;
                m.metadata.trace = trace;
                self.writer.create(&m).await?;
            }
            Some(current) if current.spec == spec && current.status == status => return Ok(()),
            Some(current) => {
                let mut next = (*current).clone();
                next.spec = spec;
                next.status = status;
                self.writer.update(&current, &next).await?;
            }
        }
        self.r.wake.bump();
        Ok(())
    }

    pub(super) async fn event(&self, claim: &Claim, reason: &str, error: Option<String>) {
        let (type_, message) = match &error {
            None => (
                EventType::Normal,
                format!(
                    "{} published for claim {}",
                    claim.spec.volume, claim.metadata.name
                ),
            ),
            Some(e) => (
                EventType::Warning,
                format!(
                    "{} could not be published for claim {}: {e}",
                    claim.spec.volume, claim.metadata.name
                ),
            ),
        };
        self.node_event(
            claim_ref(&claim.metadata.namespace, &claim.metadata.name),
            &claim.spec.volume,
            reason,
            type_,
            message,
            error,
        )
        .await;
    }

    pub(super) async fn unmount_event(&self, rec: &PublishRecord, error: Option<String>) {
        let (type_, message) = match &error {
            None => (
                EventType::Normal,
                format!("{} unpublished for claim {}", rec.volume, rec.claim),
            ),
            Some(e) => (
                EventType::Warning,
                format!(
                    "{} could not be unpublished for claim {}: {e}",
                    rec.volume, rec.claim
                ),
            ),
        };
        self.node_event(
            claim_ref(&rec.namespace, &rec.claim),
            &rec.volume,
            "Unmount volume",
            type_,
            message,
            error,
        )
        .await;
    }

    /// An event on this node's Node about `claim`'s volume (`describe claim` shows it).
    pub(super) async fn node_event(
        &self,
        claim: ObjectRef,
        volume: &VolumeId,
        reason: &str,
        type_: EventType,
        message: String,
        error: Option<String>,
    ) {
        let object = ObjectRef {
            kind: "Node".into(),
            namespace: Namespace::default(),
            name: Name::new(self.r.node.as_str()).unwrap_or_default(),
        };
        let d = details([
            ("volume_id", volume.to_string()),
            ("success", error.is_none().to_string()),
            ("error", error.unwrap_or_default()),
        ]);
        self.r
            .recorder
            .record_related(object, Some(claim), type_, reason, message, d)
            .await;
    }
}

/// A reference to claim `name` in `namespace`.
pub(super) fn claim_ref(namespace: &Namespace, name: &Name) -> ObjectRef {
    ObjectRef {
        kind: "Claim".into(),
        namespace: namespace.clone(),
        name: name.clone(),
    }
}
