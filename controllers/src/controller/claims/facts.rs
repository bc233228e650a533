//! What the publish and release directions both read or do: the claim's Mount,
//! whether its node is done with it or was collected, whether other claims still need
//! an attachment, and the withdrawal of a grant. Neither direction depends on the
//! other: both depend on this.

use super::*;

/// Withdraws the claim's node permission (the grant's attachment was force-detached):
/// the node tears down what it did under it, and acts again only on a new grant.
///
/// The claim is stamped with the volume's generation now (`generation`, when known): the
/// force-detach that withdrew the grant does not cover what the claim does from here
/// on. Else a claim waiting for its new attachment would count as gone from the node,
/// and the next release there would detach that new attachment too (found by the long
/// chaos runs: ControllerPublish and ControllerUnpublish alternating every 30 ms).
pub(super) fn withdraw(c: &mut Claim, why: &str, generation: Option<i64>) {
    c.spec.publish = false;
    c.spec.publish_context.clear();
    c.spec.attachment = None;
    c.spec.revoked = true;
    if let Some(g) = generation {
        c.spec.volume_generation = Some(g);
    }
    if c.status.phase == ClaimPhase::Published {
        c.status.phase = ClaimPhase::Admitted;
    }
    c.status.reason = Some(format!("node permission withdrawn: {why}").into());
}

/// Whether another claim of the claim's volume on its node may still be using the
/// attachment there: it was let onto the node and its node side is not finished. A
/// claim created since the cache last heard is safe to miss: it finds the attachment
/// detaching and waits for a new one.
pub(super) async fn attachment_needed_by_others(
    ctx: &Ctx,
    claim: &Claim,
) -> Result<bool, StoreError> {
    for o in ctx.claims.by_index(
        BY_VOLUME,
        &volume_index(&claim.metadata.namespace, claim.spec.volume.as_str()),
    ) {
        if o.metadata.uid == claim.metadata.uid || o.spec.node != claim.spec.node {
            continue;
        }
        let Some(o) = ctx.claim(&o.object_key()).await? else {
            continue;
        };
        if plan::needs_attachment(&o, &node_done(ctx, &o), node_collected(ctx, &o.spec.node)) {
            return Ok(true);
        }
    }
    Ok(false)
}

pub(super) async fn revoked_event(ctx: &Ctx, claim: &Claim, why: &str) {
    event(
        ctx,
        claim,
        EventType::Warning,
        "Node permission withdrawn",
        format!(
            "volume {} on node {}: {why}; the node tears down what it did and waits for \
             the volume to be attached again",
            claim.spec.volume, claim.spec.node
        ),
    )
    .await;
}

/// The Mount the claim's node agent keeps for this very claim (same uid), if any.
pub(super) fn claim_mount(ctx: &Ctx, claim: &Claim) -> Option<Arc<MountView>> {
    ctx.mounts
        .get(&Mount::key_for(&claim.object_key()))
        .filter(|m| m.serves(&claim.metadata.uid))
}

/// Whether `node` has been gone longer than `--node-gc-timeout` (never without one).
pub(super) fn node_collected(ctx: &Ctx, node: &NodeName) -> bool {
    match (ctx.node_gc_timeout, ctx.node_gone_for(node)) {
        (Some(timeout), Some(gone)) => gone >= timeout,
        _ => false,
    }
}

/// Whether the node side of a claim is finished (or skipped): [`plan::node_done`] over
/// the caches.
pub(super) fn node_done(ctx: &Ctx, claim: &Claim) -> NodeDone {
    let mount = claim_mount(ctx, claim);
    let volume = ctx.volume(&claim.metadata.namespace, &claim.spec.volume);
    let node_gone_for = ctx
        .node_gc_timeout
        .and_then(|_| ctx.node_gone_for(&claim.spec.node));
    plan::node_done(&plan::NodeInputs {
        claim,
        mount: mount.as_deref(),
        volume: volume.as_deref(),
        node_present: ctx.nodes.get(&Node::key_for(&claim.spec.node)).is_some(),
        node_gone_for,
        node_gc_timeout: ctx.node_gc_timeout,
    })
}
