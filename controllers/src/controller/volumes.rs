//! The volume reconciler: the controller's section of a volume (`status.claims`) and
//! its finalizer.
//!
//! Expected flow:
//! 1. Every volume carries the `moor.dev/claims` finalizer while it exists, so deleting
//!    a volume in use waits for its claims; it is removed once the volume is being
//!    deleted and no live claim remains (the provisioner then deletes created volumes).
//! 2. An ephemeral volume made from an allocation's template is deleted once its
//!    allocation ended and no claim holds it.
//! 3. `schedulable`: not being deleted, created (an external id is known), and its
//!    plugin able to serve it: a healthy node instance, and a healthy controller
//!    instance unless the plugin is known not to need ControllerPublish; and
//!    `HealthyOnNodes` from the Mounts' conditions.
//!
//! Which of these a pass does is decided by [`next`] (pure). The live and past claims
//! are written by the claim reconciler as it admits and releases.

use moor::api::*;
use moor::runtime::controller::{Action, Config, Controller};
use moor::runtime::metrics::ControllerMetrics;
use moor::store::StoreError;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

use super::context::MountView;
use super::context::{Ctx, Informers};
use super::volume_view::VolumeView;
use crate::common::{details, object_ref};

/// The controller's finalizer on volumes.
pub const FINALIZER: &str = "moor.dev/claims";

/// Runs until `stop`.
pub async fn run(
    ctx: Ctx,
    inf: &Informers,
    config: Config,
    metrics: ControllerMetrics,
    stop: CancellationToken,
) {
    let volumes = ctx.volumes.clone();
    let this = Arc::new(ctx);
    Controller::new("volumes", this.volumes.clone(), config)
        .with_metrics(metrics)
        .owns_trusting(inf.volumes.subscribe(), converged)
        .watches(inf.plugins.subscribe(), move |p: &Plugin| {
            // Only the volumes whose `schedulable` the plugin's health may flip: a
            // plugin's status changes do not wake its 100,000 settled volumes.
            let healthy = p.status.serves_volumes();
            volumes
                .by_index(
                    super::context::BY_SCHEDULABLE,
                    &super::context::schedulable_index(p.metadata.name.as_str(), !healthy),
                )
                .iter()
                .map(|v| v.object_key())
                .collect()
        })
        // The volumes an allocation's templates made: an ephemeral one goes when the
        // allocation ends.
        .watches(inf.allocations.subscribe(), |a: &Allocation| {
            a.spec
                .volumes
                .iter()
                .filter(|r| r.template.is_some())
                .filter_map(|r| a.request_volume(r))
                .map(|v| Volume::key_for(&a.metadata.namespace, &v))
                .collect()
        })
        // Only Mounts that report a condition (VOLUME_CONDITION): the others' writes
        // (every publish step) say nothing about health.
        .watches(inf.mounts.subscribe(), |m: &MountView| {
            if m.condition.is_none() {
                return Vec::new();
            }
            vec![Volume::key_for(&m.namespace, &m.volume)]
        })
        .run(reconcile, this, stop)
        .await;
}

/// A volume the controller's section says is settled (schedulable, carrying the
/// finalizer, not being deleted): a relist puts it in the repair pass behind every
/// change (the order only; it still runs).
fn converged(v: &VolumeView) -> bool {
    v.schedulable && !v.deleting && v.finalized
}

async fn reconcile(ctx: Arc<Ctx>, key: ObjectKey<VolumeSpec>) -> Result<Action, StoreError> {
    let ctx = &*ctx;
    ctx.ready().await;
    let Some(vol) = ctx.volumes.get(&key) else {
        return Ok(Action::AwaitChange);
    };
    let plugin_serves = ctx
        .plugins
        .get(&Plugin::key_for(&vol.plugin_id))
        .is_some_and(|p| p.status.serves_volumes());
    let schedulable = match next(&vol, plugin_serves, || ephemeral_done(ctx, &vol)) {
        Next::Status { schedulable } => schedulable,
        write => {
            // Never at rest (the view keeps the volume whole): no read but a lagging
            // cache's.
            if let Some(whole) = ctx.whole_volume(&vol.object_key()).await? {
                write_whole(ctx, write, &whole).await?;
            }
            return Ok(Action::AwaitChange);
        }
    };
    let health = nodes_health(ctx, &vol);
    if vol.schedulable != schedulable || health.is_some() {
        let generation = vol.generation;
        ctx.writer
            .modify_status(&vol.object_key(), |_, st| {
                st.claims.schedulable = schedulable;
                st.claims.meta.observed_generation = generation;
                if let Some((healthy, message)) = &health {
                    let reason = if *healthy { "Normal" } else { "VolumeAbnormal" };
                    st.claims
                        .meta
                        .set_condition(HEALTHY_ON_NODES, *healthy, reason, message);
                }
                true
            })
            .await?;
    }
    Ok(Action::AwaitChange)
}

/// Carries out a [`Next`] that writes the volume (`vol`, whole as stored now).
async fn write_whole(ctx: &Ctx, write: Next, vol: &Volume) -> Result<(), StoreError> {
    let has_finalizer = vol.metadata.finalizers.iter().any(|f| f == FINALIZER);
    match write {
        Next::RemoveFinalizer if has_finalizer => {
            let mut v = vol.clone();
            v.metadata.finalizers.retain(|f| f != FINALIZER);
            match ctx.writer.replace(&v).await {
                Ok(_) | Err(StoreError::NotFound { .. }) => Ok(()),
                Err(e) => Err(e),
            }
        }
        Next::AddFinalizer if !has_finalizer => {
            let mut v = vol.clone();
            v.metadata.finalizers.push(FINALIZER.into());
            ctx.writer.replace(&v).await.map(drop)
        }
        Next::DeleteEphemeral => delete_ephemeral(ctx, vol).await,
        // Done already, as the stored volume shows (the cache lags).
        Next::RemoveFinalizer | Next::AddFinalizer | Next::Status { .. } => Ok(()),
    }
}

/// What the volume reconciler does with a volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    /// Being deleted and no live claim holds it: the finalizer goes (the provisioner
    /// then deletes a created volume).
    RemoveFinalizer,
    /// Every volume carries the finalizer while it exists.
    AddFinalizer,
    /// An ephemeral volume whose allocation ended and that no claim holds: deleted like
    /// any volume (the finalizers hold it until the plugin's DeleteVolume).
    DeleteEphemeral,
    /// The controller's section says whether claims may be admitted: not being
    /// deleted, created (an external id is known) and its plugin serving volumes.
    Status {
        /// The section's `schedulable`.
        schedulable: bool,
    },
}

/// Decides [`Next`] from the volume, whether its plugin serves volumes
/// (`plugin_serves`) and, asked only of a settled volume no claim holds, whether it is
/// an ephemeral volume whose allocation ended.
fn next(vol: &VolumeView, plugin_serves: bool, ephemeral_done: impl FnOnce() -> bool) -> Next {
    let live = vol.live();
    let has_finalizer = vol.finalized;
    if vol.deleting {
        if has_finalizer && !live {
            return Next::RemoveFinalizer;
        }
    } else if !has_finalizer {
        return Next::AddFinalizer;
    } else if !live && ephemeral_done() {
        return Next::DeleteEphemeral;
    }
    Next::Status {
        schedulable: !vol.deleting && vol.created && plugin_serves,
    }
}

/// Deletes an ephemeral volume whose allocation ended ([`Next::DeleteEphemeral`]), with
/// an event.
async fn delete_ephemeral(ctx: &Ctx, vol: &Volume) -> Result<(), StoreError> {
    match ctx.writer.delete_read(vol).await {
        Ok(_) => {
            let m = vol.spec.made_for.as_deref().cloned().unwrap_or_default();
            let d = details([
                ("allocation", m.allocation.to_string()),
                ("volume_id", vol.metadata.name.to_string()),
            ]);
            ctx.recorder
                .record(
                    object_ref(vol),
                    EventType::Normal,
                    "Ephemeral volume deleted",
                    format!(
                        "allocation {} ended and released it; deleting ephemeral volume {}",
                        m.allocation, vol.metadata.name
                    ),
                    d,
                )
                .await;
            Ok(())
        }
        Err(StoreError::NotFound { .. }) | Err(StoreError::Conflict { .. }) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Whether `vol` is an ephemeral template volume whose allocation ended: gone, made
/// again (another uid), deleting, or terminal (stopped, completed, failed, lost), with
/// no claim of that allocation on it still to be released.
fn ephemeral_done(ctx: &Ctx, vol: &VolumeView) -> bool {
    let Some(m) = vol.made_for() else {
        return false;
    };
    // Protection comes first in the deletion precedence: an ephemeral volume an
    // operator protected stays (its deletion is refused from every front door).
    let protected = vol
        .rare
        .as_ref()
        .is_some_and(|r| r.spec.deletion_protection);
    if m.lifecycle != VolumeLifecycle::Ephemeral || protected {
        return false;
    }
    let ns = &vol.namespace;
    let alloc = ctx.allocations.get(&Allocation::key_for(ns, &m.allocation));
    let ended = alloc
        .as_ref()
        .is_none_or(|a| a.metadata.uid != m.allocation_uid || a.is_deleting() || a.is_terminal());
    if !ended {
        return false;
    }
    // Its claims on the volume: released (or gone) before the volume goes.
    let claims = ctx.claims.by_index(
        super::context::BY_VOLUME,
        &super::context::volume_index(ns, vol.name.as_str()),
    );
    claims
        .iter()
        .all(|c| c.status.phase == ClaimPhase::Released || c.status.phase == ClaimPhase::Denied)
}

/// The volume's condition from its nodes' Mounts.
pub const HEALTHY_ON_NODES: &str = "HealthyOnNodes";

/// The `HealthyOnNodes` condition to write, if it changes: false with each abnormal
/// node's message while a Mount of a live claim reports the volume abnormal; true again
/// once none does (only after it was false).
fn nodes_health(ctx: &Ctx, vol: &VolumeView) -> Option<(bool, String)> {
    let ns = &vol.namespace;
    let mut abnormal: Vec<String> = vol
        .live_claims()
        .filter_map(|c| {
            let claim = Claim::key_for(&c.node, ns, &c.claim);
            let m = ctx.mounts.get(&Mount::key_for(&claim))?;
            let cond = m.condition.as_ref().filter(|h| h.abnormal)?;
            Some(format!("node {}: {}", c.node, cond.message))
        })
        .collect();
    abnormal.sort();
    abnormal.dedup();
    let current = vol.healthy_on_nodes.as_deref();
    let want = if abnormal.is_empty() {
        current.filter(|c| !c.status).map(|_| (true, String::new()))
    } else {
        Some((false, abnormal.join("; ")))
    };
    want.filter(|(h, m)| !current.is_some_and(|c| c.status == *h && &c.message == m))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volume() -> Volume {
        let mut v = Volume::new(
            &Namespace::default_ns(),
            Name::new("v1").unwrap(),
            VolumeSpec::default(),
        );
        v.metadata.finalizers.push(FINALIZER.into());
        v.status.provisioning.external_id = Some(ExternalVolumeId::new("ext-1").unwrap());
        v
    }

    fn claimed(mut v: Volume) -> Volume {
        v.status.claims.write_claims.push(ClaimRef {
            node: NodeName::new("n1").unwrap(),
            claim: Name::new("a1.data").unwrap(),
            allocation: AllocationId::new("a1").unwrap(),
            mode: ClaimMode::Write,
            access_mode: None,
        });
        v
    }

    fn deleting(mut v: Volume) -> Volume {
        v.metadata.deletion_timestamp = Some(Timestamp::now());
        v
    }

    fn next_of(v: Volume, plugin_serves: bool, ephemeral_done: impl FnOnce() -> bool) -> Next {
        next(&VolumeView::of(v), plugin_serves, ephemeral_done)
    }

    const ASKED: fn() -> bool = || panic!("asked whether an ephemeral volume is done");

    #[test]
    fn a_volume_being_deleted_keeps_its_finalizer_while_a_claim_holds_it() {
        assert_eq!(
            next_of(deleting(claimed(volume())), true, ASKED),
            Next::Status { schedulable: false }
        );
        assert_eq!(
            next_of(deleting(volume()), true, ASKED),
            Next::RemoveFinalizer
        );
        // Without the finalizer (removed, or never added): nothing to remove or add.
        let mut bare = deleting(volume());
        bare.metadata.finalizers.clear();
        assert_eq!(
            next_of(bare, true, ASKED),
            Next::Status { schedulable: false }
        );
    }

    #[test]
    fn every_live_volume_carries_the_finalizer_first() {
        let mut v = claimed(volume());
        v.metadata.finalizers.clear();
        assert_eq!(next_of(v, true, ASKED), Next::AddFinalizer);
    }

    #[test]
    fn schedulable_needs_an_external_id_and_a_serving_plugin() {
        assert_eq!(
            next_of(claimed(volume()), true, ASKED),
            Next::Status { schedulable: true }
        );
        assert_eq!(
            next_of(claimed(volume()), false, ASKED),
            Next::Status { schedulable: false }
        );
        let mut uncreated = claimed(volume());
        uncreated.status.provisioning.external_id = None;
        assert_eq!(
            next_of(uncreated, true, ASKED),
            Next::Status { schedulable: false }
        );
    }

    #[test]
    fn only_an_unclaimed_settled_volume_is_asked_whether_its_allocation_ended() {
        assert_eq!(next_of(volume(), true, || true), Next::DeleteEphemeral);
        assert_eq!(
            next_of(volume(), true, || false),
            Next::Status { schedulable: true }
        );
    }
}
