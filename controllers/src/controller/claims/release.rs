//! A released claim: wait for the node ([`plan::node_done`]), detach when no other
//! live claim of the volume remains on the node, drop the claim from the volume, mark
//! it Released; and the triggers that bring such claims back (a release that frees
//! others, absent nodes past `--node-gc-timeout`).

use super::*;

/// Maps a claim that reached Released to the Pending and Denied claims its release
/// may now admit: those of the same volume (access modes), of the same node
/// (max_volumes_per_node) and of the same plugin. Only the waiting claims' index is
/// looked at: a node's settled claims cost nothing here.
pub(super) fn released_frees(
    claims: moor::runtime::reflector::Store<Claim>,
) -> impl Fn(&Claim) -> Vec<ObjectKey<ClaimSpec>> + Send + Sync + 'static {
    move |released: &Claim| {
        if released.status.phase != ClaimPhase::Released {
            return Vec::new();
        }
        let mut keys: Vec<ObjectKey<ClaimSpec>> = waiting_index(released)
            .iter()
            .flat_map(|value| claims.by_index(BY_WAITING, value))
            .filter(|c| c.metadata.uid != released.metadata.uid)
            .map(|c| c.object_key())
            .collect();
        keys.sort();
        keys.dedup();
        keys
    }
}

/// With `--node-gc-timeout`, releasing claims on absent nodes are looked at again
/// every few seconds, so the timeout is noticed without another trigger.
pub(super) fn node_gc_ticks(
    ctx: Arc<Ctx>,
) -> impl futures::Stream<Item = ObjectKey<ClaimSpec>> + Send {
    let every = ctx
        .node_gc_timeout
        .map(|t| (t / 4).clamp(Duration::from_millis(200), Duration::from_secs(10)));
    futures::stream::unfold(ctx, move |ctx| async move {
        match every {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending::<()>().await,
        }
        let keys: Vec<ObjectKey<ClaimSpec>> = ctx
            .claims
            .state()
            .iter()
            .filter(|c| c.spec.release && c.status.phase != ClaimPhase::Released)
            .filter(|c| ctx.nodes.get(&Node::key_for(&c.spec.node)).is_none())
            .map(|c| c.object_key())
            .collect();
        Some((futures::stream::iter(keys), ctx))
    })
    .flatten()
}

pub(super) fn waiting_for_unpublish(claim: &Claim) -> String {
    format!("waiting for node {} to unpublish", claim.spec.node)
}

pub(super) async fn release(
    ctx: &Ctx,
    claim: &Claim,
    alloc_gone: bool,
) -> Result<Action, StoreError> {
    if claim.status.phase == ClaimPhase::Released {
        // Collected with its allocation, but only once its node confirmed the
        // teardown: a claim released without its node (force-detach, the node GC
        // timeout) stays until that node, back, has torn down what it holds, so that
        // a returning node never meets a claim missing for reasons it cannot tell.
        let mount = ctx.mounts.get(&Mount::key_for(&claim.object_key()));
        if alloc_gone && plan::node_confirmed(claim, mount.as_deref()) {
            match ctx.writer.delete_read(claim).await {
                Ok(_) | Err(StoreError::NotFound { .. }) => {}
                Err(StoreError::Conflict { .. }) => {
                    return Ok(Action::Requeue(Duration::from_millis(50)))
                }
                Err(e) => return Err(e),
            }
        }
        return Ok(Action::AwaitChange);
    }
    if let Some(waiting) = node_side(ctx, claim).await? {
        return Ok(waiting);
    }
    // Detach when no other claim of the volume on this node still needs the attachment.
    let attachment = ctx.attachment(claim).await?;
    if let Some(att) = attachment {
        if !attachment_needed_by_others(ctx, claim).await? {
            detach(ctx, claim, &att).await?;
            return Ok(Action::AwaitChange);
        }
    }
    mark_released(ctx, claim).await?;
    Ok(Action::AwaitChange)
}

/// The node's side of a release ([`node_done`]): done by its agent, skipped (said once,
/// with a Warning), or not yet: then the claim shows it waits for the node (with the
/// Mount's failing step) and `Some` is the reconcile's answer.
async fn node_side(ctx: &Ctx, claim: &Claim) -> Result<Option<Action>, StoreError> {
    match node_done(ctx, claim) {
        NodeDone::Agent => {}
        NodeDone::Skipped(why) => {
            if claim.status.meta.condition("NodeStepsSkipped").is_none() {
                event(
                    ctx,
                    claim,
                    EventType::Warning,
                    "Node steps skipped",
                    format!("releasing without the node: {why}"),
                )
                .await;
            }
            set_status(ctx, claim, |st| {
                st.phase = ClaimPhase::Releasing;
                st.meta
                    .set_condition("NodeStepsSkipped", true, "NodeGone", &why);
            })
            .await?;
        }
        NodeDone::No => {
            let why = waiting_for_unpublish(claim);
            // The node's failing step, as its Mount shows it.
            let (error, retry) = claim_mount(ctx, claim)
                .map(|m| (m.last_error().cloned(), m.retry().cloned().map(Box::new)))
                .unwrap_or_default();
            set_status(ctx, claim, |st| {
                st.phase = ClaimPhase::Releasing;
                st.reason = Some(why.as_str().into());
                st.meta.last_error = error.clone();
                st.meta.retry = retry.clone();
            })
            .await?;
            return Ok(Some(Action::AwaitChange));
        }
    }
    Ok(None)
}

/// Done: the claim dropped from the volume's live claims (remembered as a past one) and
/// marked Released, in one transaction, with a "Claim released" event.
async fn mark_released(ctx: &Ctx, claim: &Claim) -> Result<(), StoreError> {
    let mut released = claim.clone();
    released.status.phase = ClaimPhase::Released;
    // The node is done with it: its secrets leave the claim.
    released.spec.node_secrets = Secrets::default().into();
    released.spec.node_publish_secrets = Secrets::default().into();
    released.status.reason = None;
    let dropped = with_volume(
        ctx,
        claim,
        |_, st| {
            let live = &mut st.claims;
            let mut gone = None;
            for list in [&mut live.read_claims, &mut live.write_claims] {
                if let Some(i) = list.iter().position(|r| {
                    r.claim == claim.metadata.name && r.allocation == claim.spec.allocation
                }) {
                    gone = Some(list.remove(i));
                }
            }
            let Some(r) = gone else {
                return Ok::<_, std::convert::Infallible>(false);
            };
            live.past_claims.push(r);
            let extra = live.past_claims.len().saturating_sub(PAST_CLAIMS);
            live.past_claims.drain(..extra);
            Ok(true)
        },
        released.clone(),
        None,
        None,
    )
    .await;
    match dropped {
        Ok(_) => {}
        Err(StoreError::NotFound { .. }) => write(ctx, claim, released).await?,
        Err(e) => return Err(e),
    }
    event(
        ctx,
        claim,
        EventType::Normal,
        "Claim released",
        format!(
            "volume {} released from node {}",
            claim.spec.volume, claim.spec.node
        ),
    )
    .await;
    Ok(())
}

/// Whether `other` (a claim of the same volume) stands on the attachment `released`
/// detaches: another claim, on the same node.
fn on_same_attachment(released: &Claim, other: &Claim) -> bool {
    other.metadata.uid != released.metadata.uid && other.spec.node == released.spec.node
}

/// Whether a claim holds a node permission a detach must withdraw: granted, and not
/// being released, deleted or released already.
fn holds_grant(c: &Claim) -> bool {
    c.spec.publish && !c.spec.release && !c.is_deleting() && c.status.phase != ClaimPhase::Released
}

/// Asks for the detach of `att` and sets the claim's reason, in one transaction that
/// also withdraws the node permission of every other live claim that stood on the
/// attachment (they remain only where the node's steps were skipped: a force-detach),
/// so that no node acts on a grant whose device is about to go.
///
/// When the node is absent (collected, or gone while an operator detached it), the
/// transaction holds only while it still is: a node that registers again first makes
/// the decision be taken again with it present, and an agent acts only after it has
/// registered, so it reads the withdrawals this transaction made.
async fn detach(ctx: &Ctx, claim: &Claim, att: &Attachment) -> Result<(), StoreError> {
    const WHY: &str = "the volume's attachment to the node is being force-detached";
    let mut batch = Batch::default();
    if !att.spec.detach {
        let mut next = att.clone();
        next.spec.detach = true;
        batch.update(ctx.writer.store(), att, &next)?;
    }
    let volume = ctx.volume(&claim.metadata.namespace, &claim.spec.volume);
    let mut withdrawn = Vec::new();
    for other in ctx.claims.by_index(
        BY_VOLUME,
        &volume_index(&claim.metadata.namespace, claim.spec.volume.as_str()),
    ) {
        if !on_same_attachment(claim, &other) {
            continue;
        }
        // Decided on the claim as stored now, not as cached: a grant the cache does not
        // show yet is withdrawn too.
        let Some(other) = ctx.claim(&other.object_key()).await? else {
            continue;
        };
        if !holds_grant(&other) {
            continue;
        }
        let mut c = (*other).clone();
        withdraw(&mut c, WHY, volume.as_ref().map(|v| v.generation));
        if let Some(c) = next_claim(&other, c) {
            withdrawn.push(batch.update(ctx.writer.store(), &other, &c)?);
        }
    }
    let mut c = claim.clone();
    c.status.phase = ClaimPhase::Releasing;
    c.status.reason = Some("waiting for the volume to be detached".into());
    if let Some(c) = next_claim(claim, c) {
        batch.update(ctx.writer.store(), claim, &c)?;
    }
    let node = Node::key_for(&claim.spec.node);
    if ctx.nodes.get(&node).is_none() {
        batch.absent(ctx.writer.store(), &node);
    }
    ctx.writer.commit(batch).await?;
    for c in withdrawn {
        revoked_event(ctx, &c, WHY).await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(name: &str, node: &str, uid: &str) -> Claim {
        let mut c = Claim::new(
            &Namespace::default_ns(),
            Name::new(name).unwrap(),
            ClaimSpec {
                node: NodeName::new(node).unwrap(),
                publish: true,
                ..Default::default()
            },
        );
        c.metadata.uid = uid.into();
        c
    }

    /// Issue 24's rule: a detach withdraws the grant of every other claim that stands
    /// on the same attachment (same volume, same node) and still holds one, in the same
    /// transaction; claims on other nodes, and the released claim itself, keep theirs.
    #[test]
    fn a_detach_withdraws_the_grants_that_stand_on_its_attachment() {
        let released = claim("a1.data", "n1", "u1");
        assert!(on_same_attachment(&released, &claim("a2.data", "n1", "u2")));
        assert!(!on_same_attachment(
            &released,
            &claim("a3.data", "n2", "u3")
        ));
        assert!(!on_same_attachment(&released, &released));
        // The same name made again is another claim.
        assert!(on_same_attachment(&released, &claim("a1.data", "n1", "u9")));

        let granted = claim("a2.data", "n1", "u2");
        assert!(holds_grant(&granted));
        let mut c = granted.clone();
        c.spec.publish = false;
        assert!(!holds_grant(&c), "not granted");
        let mut c = granted.clone();
        c.spec.release = true;
        assert!(!holds_grant(&c), "being released: its own release detaches");
        let mut c = granted.clone();
        c.status.phase = ClaimPhase::Released;
        assert!(!holds_grant(&c), "released");
        let mut c = granted;
        c.metadata.deletion_timestamp = Some(Timestamp::now());
        assert!(!holds_grant(&c), "being deleted");
    }
}
