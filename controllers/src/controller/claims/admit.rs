//! Admission of a Pending or Denied claim: the pure verdict of [`admission::check`],
//! then the access-mode rules against the volume's live claims inside one
//! compare-and-swap that records the claim there.

use super::*;

pub(super) async fn admit(ctx: &Ctx, claim: &Claim) -> Result<Action, StoreError> {
    let volume = ctx.volume(&claim.metadata.namespace, &claim.spec.volume);
    let node = ctx.nodes.get(&Node::key_for(&claim.spec.node));
    let checked = admission::check(claim, volume.as_deref(), node.as_deref(), || {
        ctx.claims.by_index(BY_NODE, claim.spec.node.as_str())
    });
    let (admitted, volume) = match (checked, volume) {
        (Ok(a), Some(v)) => (a, v),
        (Err(verdict), _) => return refuse(ctx, claim, verdict).await,
        (Ok(_), None) => return Ok(Action::AwaitChange),
    };
    // The access rules, against the volume's live claims, in the same compare-and-swap
    // that records this claim as one of them.
    let me = ClaimRef {
        allocation: claim.spec.allocation.clone(),
        claim: claim.metadata.name.clone(),
        node: claim.spec.node.clone(),
        mode: claim.spec.mode,
        access_mode: Some(admitted.capability.access_mode),
    };
    let mut context = StrMap::from((*volume.spec.context).clone());
    context.extend(volume.status.provisioning.volume_context.clone());
    let mut c = claim.clone();
    c.spec.access_mode = Some(admitted.capability.access_mode);
    c.spec.attachment_mode = Some(admitted.capability.attachment_mode);
    c.spec.external_id = Some(admitted.external_id.clone());
    c.spec.volume_context = context;
    c.spec.node_secrets = volume.spec.secrets.clone();
    c.spec.volume_generation = Some(volume.metadata.generation);
    c.spec.volume_uid = Some(volume.metadata.uid.clone());
    c.status.phase = ClaimPhase::Admitted;
    c.status
        .meta
        .set_condition("Admitted", true, "Admitted", "");
    // The next step in the same write: the node let act when the attachment is ready
    // or not needed, else the attachment asked for (created in the admission's own
    // transaction, so an attachment never exists for a claim that was not admitted).
    let (state, todo) = attachment_state(ctx, &c).await?;
    let mut guard = None;
    match state {
        Attach::Wait(why) => c.status.reason = Some(why),
        Attach::Revoke(why) => withdraw(&mut c, &why, Some(&volume)),
        Attach::Ready(grant) => {
            grant.apply(&mut c);
            c.status.reason = Some(waiting_for_node(&c));
            guard = grant.attachment;
        }
    }
    // The attachment the admission asks for is created in the same transaction.
    let create = match &todo {
        Some(AttachTodo::Create(att)) => Some(&**att),
        _ => None,
    };
    let recorded = with_volume(
        ctx,
        claim,
        |v, st| {
            let live = &mut st.claims;
            let mine = |r: &ClaimRef| r.claim == me.claim && r.allocation == me.allocation;
            if live.read_claims.iter().chain(&live.write_claims).any(mine) {
                return Ok(false);
            }
            // The claim records the generation it was admitted at (what an operator's
            // force detach is compared with): it must be the one admitted against.
            if v.metadata.generation != volume.metadata.generation {
                return Err(Refusal::Stale);
            }
            // The same rules `moorctl alloc plan` places with.
            let ns = &claim.metadata.namespace;
            admission::access_for(v, &admitted, claim, |r| ending(ctx, ns, r))
                .map_err(Refusal::Access)?;
            match me.mode {
                ClaimMode::Read => live.read_claims.push(me.clone()),
                ClaimMode::Write => live.write_claims.push(me.clone()),
            }
            Ok(true)
        },
        c,
        guard.as_deref(),
        create,
    )
    .await;
    let created = match recorded {
        Ok(VolumeWrite::Written { created }) => created,
        Ok(VolumeWrite::Refused(Refusal::Access(verdict))) => {
            return refuse(ctx, claim, verdict).await
        }
        // The volume changed since the cache showed it: decide again on the new one.
        Ok(VolumeWrite::Refused(Refusal::Stale)) => {
            return Ok(Action::Requeue(Duration::from_millis(50)))
        }
        Err(StoreError::NotFound { .. }) => {
            return refuse(
                ctx,
                claim,
                Verdict::Deny(format!("volume {} does not exist", claim.spec.volume)),
            )
            .await
        }
        Err(e) => return Err(e),
    };
    match todo {
        Some(AttachTodo::Create(_)) if created => {}
        Some(AttachTodo::Create(att)) => create_attachment(ctx, &att).await?,
        // Re-planned from the claim as now stored.
        Some(AttachTodo::Replace(_)) => return Ok(Action::Requeue(Duration::ZERO)),
        None => {}
    }
    Ok(Action::AwaitChange)
}

/// [`admission::holder_ending`] over this controller's caches.
fn ending(ctx: &Ctx, ns: &Namespace, r: &ClaimRef) -> bool {
    let holder = ctx.claims.get(&Claim::key_for(&r.node, ns, &r.claim));
    let alloc = ctx.allocations.get(&Allocation::key_for(ns, &r.allocation));
    admission::holder_ending(holder.as_deref(), alloc.as_deref())
}

/// Why the admission's compare-and-swap did not record the claim.
pub(super) enum Refusal {
    /// An access-mode rule denies it, or makes it wait for a holder's release.
    Access(Verdict),
    /// The volume is not the one the decision was made on.
    Stale,
}

pub(super) async fn refuse(
    ctx: &Ctx,
    claim: &Claim,
    verdict: Verdict,
) -> Result<Action, StoreError> {
    let (phase, reason) = match verdict {
        Verdict::Wait(r) => (ClaimPhase::Pending, r),
        Verdict::Deny(r) => (ClaimPhase::Denied, r),
    };
    let changed = claim.status.phase != phase || claim.status.reason.as_deref() != Some(&reason);
    set_status(ctx, claim, |st| {
        st.phase = phase;
        st.reason = Some(reason.clone());
        st.meta
            .set_condition("Admitted", false, &format!("{phase:?}"), &reason);
    })
    .await?;
    if changed && phase == ClaimPhase::Denied {
        event(
            ctx,
            claim,
            EventType::Warning,
            "Claim denied",
            format!("claim {} denied: {reason}", claim.metadata.name),
        )
        .await;
    }
    Ok(Action::AwaitChange)
}
