//! An admitted claim on its way to the node: the Attachment the plugin's capabilities
//! require ([`plan::attach`]), then `spec.publish` with the publish_context, then
//! Published when the node's Mount says so.

use super::*;

/// Where a claim's attachment stands.
pub(super) enum Attach {
    /// Attached, or the plugin needs none: the node may act on this grant.
    Ready(Grant),
    /// Not yet, and why; with the failing step of the attachment waited for (its
    /// ControllerPublish or ControllerUnpublish), which the claim's status shows too.
    Wait(String, Option<Box<StepFailure>>),
    /// The grant the claim holds stands on an attachment that is gone, detaching or
    /// replaced: withdraw it, for this reason.
    Revoke(String),
}

/// What lets a claim onto its node: the publish context, and the attachment (as read)
/// it stands on, whose version guards the write that grants it, so that a grant is
/// never made from a stale view of the attachment.
pub(super) struct Grant {
    pub context: StrMap,
    pub attachment: Option<Arc<Attachment>>,
}

impl Grant {
    /// Sets the grant on `c`.
    pub fn apply(&self, c: &mut Claim) {
        c.spec.publish = true;
        c.spec.publish_context = self.context.clone();
        c.spec.attachment = self.attachment.as_ref().map(|a| a.metadata.uid.clone());
    }

    /// Whether `c` already holds exactly this grant (the fields [`Grant::apply`] sets).
    pub fn held_by(&self, c: &Claim) -> bool {
        c.spec.publish
            && c.spec.publish_context == self.context
            && c.spec.attachment.as_ref() == self.attachment.as_ref().map(|a| &a.metadata.uid)
    }
}

/// Carries out the claim's controller-publish step ([`plan::attach`]): creates a
/// missing attachment, asks for the detach of one that does not cover the claim, and
/// says whether the node may act.
pub(super) async fn ensure_attachment(ctx: &Ctx, claim: &Claim) -> Result<Attach, StoreError> {
    let (state, todo) = attachment_state(ctx, claim).await?;
    match todo {
        Some(AttachTodo::Create(att)) => create_attachment(ctx, &att).await?,
        Some(AttachTodo::Replace(att)) => {
            let mut next = (*att).clone();
            next.spec.detach = true;
            ctx.writer.update(&att, &next).await?;
        }
        None => {}
    }
    Ok(state)
}

pub(super) async fn create_attachment(ctx: &Ctx, att: &Attachment) -> Result<(), StoreError> {
    match ctx.writer.create(att).await {
        Ok(_) | Err(StoreError::AlreadyExists { .. }) => {}
        Err(e) => return Err(e),
    }
    Ok(())
}

/// A write the controller-publish step asks for.
pub(super) enum AttachTodo {
    /// Create this attachment.
    Create(Box<Attachment>),
    /// Set `detach` on this one (it does not cover the claim and nobody uses it).
    Replace(Arc<Attachment>),
}

/// Gathers what [`plan::attach`] decides from and returns its verdict: whether the
/// node may act, and the write to make first.
pub(super) async fn attachment_state(
    ctx: &Ctx,
    claim: &Claim,
) -> Result<(Attach, Option<AttachTodo>), StoreError> {
    let plugin = ctx.plugins.get(&Plugin::key_for(&claim.spec.plugin_id));
    let node = ctx.nodes.get(&Node::key_for(&claim.spec.node));
    let needs_attachment = plugin
        .as_ref()
        .and_then(|p| p.status.controller_required)
        .unwrap_or(false);
    let attachment = if needs_attachment {
        ctx.attachment(claim).await?
    } else {
        None
    };
    // Who else uses the attachment matters only when it does not cover this claim
    // (the scan of the volume's claims stays off the common path).
    let in_use = match &attachment {
        Some(att) if !claim.spec.publish && !plan::covers(&att.spec, &claim.spec) => {
            attachment_needed_by_others(ctx, claim).await?
        }
        _ => false,
    };
    let volume = ctx.volume(&claim.metadata.namespace, &claim.spec.volume);
    let plan = plan::attach(&plan::AttachInputs {
        claim,
        plugin: plugin.as_deref(),
        node: node.as_deref(),
        attachment: attachment.as_deref(),
        attachment_in_use: in_use,
        volume: volume.as_deref(),
    });
    Ok(match plan {
        AttachPlan::Ready(context, uid) => {
            let attachment = uid.and(attachment);
            (
                Attach::Ready(Grant {
                    context,
                    attachment,
                }),
                None,
            )
        }
        AttachPlan::Revoke(why) => (Attach::Revoke(why), None),
        AttachPlan::Wait(why) => {
            let failing = attachment
                .as_ref()
                .filter(|a| a.status.phase != AttachmentPhase::Attached || a.spec.detach)
                .and_then(|a| a.status.meta.retry.clone());
            (Attach::Wait(why, failing), None)
        }
        AttachPlan::Create(spec) => {
            let name = Name::new(joined_name(spec.volume.as_str(), spec.node.as_str()))
                .unwrap_or_else(|_| claim.metadata.name.clone());
            let mut att = Attachment::new(&claim.metadata.namespace, name, spec);
            // The attacher's work on it joins the trace of the claim that asked for it.
            att.metadata.trace = claim.metadata.trace.clone();
            let why = "waiting for the volume to be attached".to_string();
            (
                Attach::Wait(why, None),
                Some(AttachTodo::Create(Box::new(att))),
            )
        }
        AttachPlan::Replace => {
            let why = "waiting for the volume's attachment to be replaced by one for this claim's capability".to_string();
            (Attach::Wait(why, None), attachment.map(AttachTodo::Replace))
        }
    })
}

pub(super) fn waiting_for_node(claim: &Claim) -> String {
    format!("waiting for node {} to publish", claim.spec.node)
}

pub(super) async fn publish(ctx: &Ctx, claim: &Claim) -> Result<Action, StoreError> {
    let grant = match ensure_attachment(ctx, claim).await? {
        Attach::Ready(grant) => grant,
        Attach::Wait(why, failing) => return waiting(ctx, claim, &why, failing).await,
        Attach::Revoke(why) => return revoke(ctx, claim, &why).await,
    };
    let mount = claim_mount(ctx, claim);
    let published = mount.as_ref().is_some_and(|m| m.published);
    let node_error = mount.as_ref().and_then(|m| m.last_error().cloned());
    let node_retry = mount
        .as_ref()
        .and_then(|m| m.retry().cloned().map(Box::new));
    let mirror = |st: &mut ClaimStatus| {
        if published {
            st.phase = ClaimPhase::Published;
            st.reason = None;
        } else {
            st.reason = Some(waiting_for_node(claim).into());
        }
        st.meta.last_error = node_error.clone();
        st.meta.retry = node_retry.clone();
    };
    if !grant.held_by(claim) {
        let mut c = claim.clone();
        grant.apply(&mut c);
        // The status the pass after the grant would write, in the same write (one
        // store write fewer per claim); Published is left to that pass, which says so.
        if !published {
            mirror(&mut c.status);
        }
        // Guarded by the attachment as read: a grant never rests on a stale view of it.
        match &grant.attachment {
            Some(att) => write_guarded(ctx, att, claim, c).await?,
            None => write(ctx, claim, c).await?,
        }
        return Ok(Action::AwaitChange);
    }
    let was_published = claim.status.phase == ClaimPhase::Published;
    set_status(ctx, claim, mirror).await?;
    if published && !was_published {
        event(
            ctx,
            claim,
            EventType::Normal,
            "Claim published",
            format!(
                "volume {} published on node {}",
                claim.spec.volume, claim.spec.node
            ),
        )
        .await;
    }
    Ok(Action::AwaitChange)
}

/// Withdraws the node permission of a claim whose attachment was force-detached
/// under it ([`plan::AttachPlan::Revoke`]), with a Warning.
async fn revoke(ctx: &Ctx, claim: &Claim, why: &str) -> Result<Action, StoreError> {
    let mut c = claim.clone();
    let volume = ctx.volume(&claim.metadata.namespace, &claim.spec.volume);
    withdraw(&mut c, why, volume.map(|v| v.generation));
    write(ctx, claim, c).await?;
    revoked_event(ctx, claim, why).await;
    Ok(Action::AwaitChange)
}

async fn waiting(
    ctx: &Ctx,
    claim: &Claim,
    why: &str,
    failing: Option<Box<StepFailure>>,
) -> Result<Action, StoreError> {
    // The attachment's failing step is shown on the claim (its node agent reads it
    // there: a ControllerPublish refused with ResourceExhausted asks the node's
    // NodeGetInfo again at once).
    set_status(ctx, claim, |st| {
        st.reason = Some(why.into());
        st.meta.retry = failing.clone();
    })
    .await?;
    Ok(Action::AwaitChange)
}
