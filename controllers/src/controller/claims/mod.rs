//! The claim reconciler: the controller's half of the claim lifecycle.
//!
//! Expected flow (each step a checkpoint in etcd; any replica resumes from it):
//! 1. A claim whose allocation stopped, finished, was deleted or no longer asks for it
//!    gets `spec.release`.
//! 2. Pending / Denied: [`admission::check`]; then the access-mode rules against the
//!    volume's live claims inside a compare-and-swap that records the claim there.
//!    Admitted claims get their capability, external id and context in `spec`.
//! 3. Admitted: if the plugin needs ControllerPublish, an Attachment for (volume, node)
//!    is created (shared by every claim there) and awaited; then `spec.publish` (with
//!    the publish_context) lets the node agent act. When the Mount says published, the
//!    claim is Published. The admission's write already carries the first of these
//!    steps it can take (the attachment asked for, or `spec.publish` when no attachment
//!    is needed or it is attached already).
//! 4. Releasing: wait for the node agent's `released` on the Mount (or skip the node:
//!    an operator's force-detach, or a node gone past `--node-gc-timeout`, each with a
//!    Warning); when no other live claim of the volume remains on the node, ask the
//!    attacher to detach and wait for the Attachment to go; then drop the claim from
//!    the volume's live claims (kept as a past claim) and mark it Released. A Released
//!    claim whose allocation is gone is deleted.
//!
//! # Layout
//! - this file: the reconciler and what wakes it (Mounts, attachments, volumes, nodes,
//!   plugins, cordons, Secrets), step 1, the claim's node copy of its volume (secrets
//!   rotated), and the guarded writes the other files share.
//! - `admit`: step 2.
//! - `publish`: step 3.
//! - `release`: step 4.
//! - `facts`: what the publish and release directions both read or do.

use futures::StreamExt;
use moor::api::*;
use moor::runtime::controller::{Action, Config, Controller};
use moor::runtime::metrics::ControllerMetrics;
use moor::store::{Batch, StoreError};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

mod admit;
mod facts;
mod publish;
mod release;

use admit::admit;
use facts::{attachment_needed_by_others, claim_mount, node_done, revoked_event, withdraw};
use publish::{attachment_state, create_attachment, publish, waiting_for_node, Attach, AttachTodo};
use release::{node_gc_ticks, release, released_frees, waiting_for_unpublish};

use super::context::BY_SECRET;
use super::context::{
    volume_index, waiting_in, Ctx, Informers, BY_NODE, BY_UNSETTLED, BY_VOLUME, BY_WAITING,
};
use super::context::{waiting_index, MountView};
use super::plan::{self, AttachPlan, NodeDone};
use super::volume_view::VolumeView;
use crate::common::{details, object_ref};
use moor::admission::{self, Verdict};

/// How many past claims a volume remembers.
const PAST_CLAIMS: usize = 16;

/// Runs until `stop`.
pub async fn run(
    ctx: Ctx,
    inf: &Informers,
    config: Config,
    metrics: ControllerMetrics,
    stop: CancellationToken,
) {
    let claims = ctx.claims.clone();
    let by_volume = {
        let claims = claims.clone();
        move |ns: &Namespace, volume: &str, node: Option<&NodeName>| -> Vec<ObjectKey<ClaimSpec>> {
            claims
                .by_index(BY_VOLUME, &volume_index(ns, volume))
                .iter()
                .filter(|c| node.is_none_or(|n| &c.spec.node == n))
                .map(|c| c.object_key())
                .collect()
        }
    };
    let by_volume2 = by_volume.clone();
    let claims2 = claims.clone();
    let claims3 = claims.clone();
    let claims4 = claims.clone();
    let claims5 = claims.clone();
    let claims6 = claims.clone();
    let (volumes, by_volume3) = (ctx.volumes.clone(), by_volume.clone());
    let by_volume4 = by_volume.clone();
    let this = Arc::new(ctx);
    Controller::new("claims", claims, config)
        .with_metrics(metrics)
        .owns_trusting(inf.claims.subscribe(), converged)
        // An allocation's change (a stop, above all) comes before the claims' own
        // follow-up steps: its release is what the operator waits on.
        .watches_urgent(inf.allocations.subscribe(), |a: &Allocation| {
            // Each request's claim, under the name an earlier release gave it too.
            a.spec
                .volumes
                .iter()
                .flat_map(|req| a.claim_names(req))
                .map(|name| Claim::key_for(&a.spec.node, &a.metadata.namespace, &name))
                .collect()
        })
        .watches(inf.mounts.subscribe(), |m: &MountView| vec![m.claim_key()])
        .watches(inf.attachments.subscribe(), move |a: &Attachment| {
            by_volume(
                &a.metadata.namespace,
                a.spec.volume.as_str(),
                Some(&a.spec.node),
            )
        })
        .watches(inf.volumes.subscribe(), move |v: &VolumeView| {
            by_volume2(&v.namespace, v.name.as_str(), None)
        })
        .watches(
            crate::controller::nodes::without_renewals(inf.nodes.subscribe()),
            move |n: &Node| {
                claims2
                    .by_index(BY_NODE, n.metadata.name.as_str())
                    .iter()
                    .map(|c| c.object_key())
                    .collect()
            },
        )
        .watches(inf.plugins.subscribe(), move |p: &Plugin| {
            claims3
                .by_index(BY_UNSETTLED, p.metadata.name.as_str())
                .iter()
                .map(|c| c.object_key())
                .collect()
        })
        .watches(inf.claims.subscribe(), released_frees(claims4))
        // A cordon set or lifted: the claims waiting on its node.
        .watches(inf.cordons.subscribe(), move |c: &Cordon| {
            claims5
                .by_index(BY_NODE, c.metadata.name.as_str())
                .iter()
                .filter(|c| !c.status.phase.is_live())
                .map(|c| c.object_key())
                .collect()
        })
        // A Secret made, rotated or removed: the claims of the volumes naming it (a
        // waiting one is admitted; a live one gets the new copy for its node).
        .watches(inf.secrets.subscribe(), move |s: &Secret| {
            volumes
                .by_index(BY_SECRET, s.object_key().as_str())
                .iter()
                .flat_map(|v| by_volume3(&v.namespace, v.name.as_str(), None))
                .collect()
        })
        // An ownership record made or removed: the claims of the volume it names (a
        // claim waiting for its volume to own its plugin volume is admitted).
        .watches(inf.owners.subscribe(), move |o: &Ownership| {
            by_volume4(&o.spec.owner.namespace, o.spec.owner.name.as_str(), None)
        })
        // A quota's charges changed: the claims waiting in its namespace.
        .watches(inf.quotas.subscribe(), move |q: &Quota| {
            claims6
                .by_index(BY_WAITING, &waiting_in(&q.metadata.namespace))
                .iter()
                .map(|c| c.object_key())
                .collect()
        })
        .trigger(node_gc_ticks(this.clone()).boxed())
        // A conflict (our cache lagged a write) is retried soon by the runtime.
        .run(reconcile, this, stop)
        .await;
}

/// A claim whose status says its last reconcile left nothing to do (published or
/// released, for the spec it saw, not being released or deleted): a relist puts it in
/// the repair pass behind every change (the order only; it still runs).
fn converged(c: &Claim) -> bool {
    matches!(c.status.phase, ClaimPhase::Published | ClaimPhase::Released)
        && c.status.meta.observed_generation == c.metadata.generation
        && !c.spec.release
        && !c.is_deleting()
}

async fn reconcile(ctx: Arc<Ctx>, key: ObjectKey<ClaimSpec>) -> Result<Action, StoreError> {
    let ctx = &*ctx;
    ctx.ready().await;
    let Some(cached) = ctx.claims.get(&key) else {
        return Ok(Action::AwaitChange);
    };
    let _guard = ctx
        .volume_locks
        .lock(Volume::key_for(&cached.metadata.namespace, &cached.spec.volume).as_str())
        .await;
    // Claims of one volume are serialised; a decision never rests on a cache older
    // than this process's last write of the claim (then it is read fresh).
    let Some(claim) = ctx.claim(&cached.object_key()).await? else {
        return Ok(Action::AwaitChange);
    };
    // A step of the claim's trace (its CSI calls are made by agents, which join it
    // through the claim, its Attachment and its Mount).
    let span = moor::telemetry::step_span(
        "claim",
        key.as_str(),
        claim.spec.volume.as_str(),
        claim.spec.node.as_str(),
        claim.metadata.trace.as_deref(),
    );
    tracing::Instrument::instrument(step(ctx, claim), span).await
}

/// One reconcile of a claim read fresh (under its volume's lock).
async fn step(ctx: &Ctx, claim: Arc<Claim>) -> Result<Action, StoreError> {
    let alloc = ctx.allocations.get(&Allocation::key_for(
        &claim.metadata.namespace,
        &claim.spec.allocation,
    ));
    if !plan::claim::wanted(&claim, alloc.as_deref()) && !claim.spec.release {
        let mut c = (*claim).clone();
        c.spec.release = true;
        // What is left of the workload is ended by the node before it unpublishes.
        if let Some(cgroup) = alloc.as_ref().and_then(|a| a.spec.workload_cgroup.clone()) {
            c.spec.workload_cgroup = Some(Box::new(cgroup));
        }
        // The release's first step in the same write: waiting for the node.
        if matches!(node_done(ctx, &c), NodeDone::No) {
            c.status.phase = ClaimPhase::Releasing;
            c.status.reason = Some(waiting_for_unpublish(&c).into());
        }
        write(ctx, &claim, c).await?;
        return Ok(Action::AwaitChange);
    }
    if claim.spec.release || claim.is_deleting() {
        return release(ctx, &claim, alloc.is_none()).await;
    }
    let volume = ctx.volume(&claim.metadata.namespace, &claim.spec.volume);
    // A Secret missing here keeps the copy the claim has (the node keeps working
    // with it); admission waits on one.
    let copy = volume.as_ref().and_then(|v| {
        let secrets = ctx.node_secrets(v).ok()?;
        plan::claim::node_copy(&claim, v, &secrets)
    });
    if let Some(spec) = copy {
        let rotated = spec.node_secrets != claim.spec.node_secrets
            || spec.node_publish_secrets != claim.spec.node_publish_secrets;
        let mut c = (*claim).clone();
        c.spec = spec;
        write(ctx, &claim, c).await?;
        if rotated {
            secrets_rotated(ctx, &claim, volume.as_deref()).await;
        }
        return Ok(Action::AwaitChange);
    }
    match claim.status.phase {
        ClaimPhase::Pending | ClaimPhase::Denied => admit(ctx, &claim).await,
        ClaimPhase::Admitted | ClaimPhase::Published => publish(ctx, &claim).await,
        ClaimPhase::Releasing | ClaimPhase::Released => Ok(Action::AwaitChange),
    }
}

/// A Normal event on a live claim whose node copy of its secrets was replaced (sealed
/// again with its node's key): naming the Secrets the volume names for the node's
/// calls and their generations, never a value.
async fn secrets_rotated(ctx: &Ctx, claim: &Claim, volume: Option<&VolumeView>) {
    let named: Vec<String> = volume
        .map(|v| {
            [SecretFamily::NodeStage, SecretFamily::NodePublish]
                .into_iter()
                .filter_map(|family| {
                    let spec = v.spec();
                    let name = spec.secret_refs.get(family)?;
                    let key = Secret::key_for(&v.plugin_id, &v.namespace, name);
                    let generation = ctx.secrets.get(&key).map(|s| s.metadata.generation);
                    Some(format!(
                        "{family}: Secret {name} generation {}",
                        generation.unwrap_or_default()
                    ))
                })
                .collect()
        })
        .unwrap_or_default();
    let from = match named.is_empty() {
        true => "the volume's secrets".to_string(),
        false => named.join(", "),
    };
    let msg = format!(
        "the node's copy of the secrets was replaced and sealed for node {} ({from})",
        claim.spec.node
    );
    ctx.recorder
        .record(
            object_ref(claim),
            EventType::Normal,
            "Secrets updated",
            msg,
            details([("volume_id", claim.spec.volume.to_string())]),
        )
        .await;
}

/// `next` as it is to be written over `claim`, or `None` when nothing changed.
fn next_claim(claim: &Claim, mut next: Claim) -> Option<Claim> {
    if next.spec == claim.spec && next.status == claim.status {
        return None;
    }
    if next.status != claim.status {
        next.status.meta.observed_generation =
            claim.metadata.generation + i64::from(next.spec != claim.spec);
    }
    Some(next)
}

/// Writes `next` (spec and status at once) over `claim`, as stored, if it differs.
async fn write(ctx: &Ctx, claim: &Claim, next: Claim) -> Result<(), StoreError> {
    if let Some(next) = next_claim(claim, next) {
        ctx.writer.update(claim, &next).await?;
    }
    Ok(())
}

/// Writes `next` over `read` (when given) and `next_claim` over `claim` (when it
/// differs) in one transaction, guarded by both versions read.
async fn write_with<S: Spec>(
    ctx: &Ctx,
    read: &Object<S>,
    next: Option<&Object<S>>,
    claim: &Claim,
    next_claim: Claim,
    guard: Option<&Attachment>,
    create: Option<&Attachment>,
) -> Result<(), StoreError> {
    let mut batch = Batch::default();
    if let Some(g) = guard {
        batch.unchanged(ctx.writer.store(), g);
    }
    if let Some(att) = create {
        batch.create(ctx.writer.store(), att)?;
    }
    if let Some(n) = next {
        batch.update(ctx.writer.store(), read, n)?;
    }
    if let Some(c) = self::next_claim(claim, next_claim) {
        batch.update(ctx.writer.store(), claim, &c)?;
    }
    ctx.writer.commit(batch).await?;
    Ok(())
}

/// Writes `next` over `claim` (if it differs) only while `guard` is stored as read:
/// the write rests on a decision taken from `guard` (a grant from an Attached
/// attachment), which must not be a stale view of it.
async fn write_guarded<S: Spec>(
    ctx: &Ctx,
    guard: &Object<S>,
    claim: &Claim,
    next: Claim,
) -> Result<(), StoreError> {
    let Some(next) = next_claim(claim, next) else {
        return Ok(());
    };
    let mut batch = Batch::default();
    batch.unchanged(ctx.writer.store(), guard);
    batch.update(ctx.writer.store(), claim, &next)?;
    ctx.writer.commit(batch).await?;
    Ok(())
}

/// What [`with_volume`] did.
enum VolumeWrite<E> {
    /// The volume's status and the claim were written; `created`: the attachment asked
    /// for was created in the same transaction (else the caller creates it).
    Written { created: bool },
    /// `f` refused: nothing was written.
    Refused(E),
}

/// Edits the status of the claim's volume with `f` (`Ok(false)`: no change; `Err`:
/// nothing is written and the refusal returned) and writes `next` over `claim`: one
/// transaction against the cached volume, guarded by its version and the claim's (and
/// `guard`'s, the attachment a grant in `next` rests on); if either changed since (the
/// provisioner writes its own section of the volume), the volume through a fresh
/// read-modify-write, then the claim. `create` (the attachment an admission asks for)
/// is created in the same transaction when it can be (not on the fallback).
async fn with_volume<E>(
    ctx: &Ctx,
    claim: &Claim,
    mut f: impl FnMut(&Volume, &mut VolumeStatus) -> Result<bool, E>,
    next: Claim,
    guard: Option<&Attachment>,
    create: Option<&Attachment>,
) -> Result<VolumeWrite<E>, StoreError> {
    let ns = &claim.metadata.namespace;
    let key = Volume::key_for(ns, &claim.spec.volume);
    if let Some(read) = ctx.whole_volume(&key).await? {
        let mut volume = (*read).clone();
        if let Err(e) = f(&read, &mut volume.status) {
            return Ok(VolumeWrite::Refused(e));
        }
        let changed = (volume.status != read.status).then_some(&volume);
        match write_with(ctx, &read, changed, claim, next.clone(), guard, create).await {
            Ok(()) => {
                return Ok(VolumeWrite::Written {
                    created: create.is_some(),
                })
            }
            Err(StoreError::Conflict { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    let mut verdict = Ok(());
    ctx.writer
        .modify_status(&key, |v, st| match f(v, st) {
            Ok(changed) => {
                verdict = Ok(());
                changed
            }
            Err(e) => {
                verdict = Err(e);
                false
            }
        })
        .await?;
    if let Err(e) = verdict {
        return Ok(VolumeWrite::Refused(e));
    }
    match guard {
        Some(g) => write_guarded(ctx, g, claim, next).await?,
        None => write(ctx, claim, next).await?,
    }
    Ok(VolumeWrite::Written { created: false })
}

/// Writes the claim's status if `f` changes it.
async fn set_status(
    ctx: &Ctx,
    claim: &Claim,
    f: impl Fn(&mut ClaimStatus),
) -> Result<(), StoreError> {
    let mut next = claim.clone();
    f(&mut next.status);
    write(ctx, claim, next).await
}

async fn event(ctx: &Ctx, claim: &Claim, type_: EventType, reason: &str, message: String) {
    let d = details([
        ("volume_id", claim.spec.volume.to_string()),
        ("node", claim.spec.node.to_string()),
        ("allocation", claim.spec.allocation.to_string()),
    ]);
    ctx.recorder
        .record(object_ref(claim), type_, reason, message, d)
        .await;
}
