//! `moorctl volume detach VOLUME --node NODE`: declares a node gone for a volume, so its
//! claims there are released without node calls. `moorctl volume deregister NAME`:
//! removes a volume from moor without plugin calls.

use moor::api::*;
use moor::store::{Declared, StoreError};

use crate::{is_not_found, parse_name, parse_ns, ride_out, Ctx, LookAgain, Refused};

/// Marks `node` gone for `volume` in `namespace`.
pub(crate) async fn detach(
    ctx: &Ctx,
    namespace: &str,
    volume: &str,
    node: &str,
) -> anyhow::Result<i32> {
    let ns = parse_ns(namespace)?;
    let volume = parse_name("volume", volume)?;
    let node = NodeName::new(node).map_err(|e| anyhow::anyhow!("node {node:?}: {e}"))?;
    let key = Volume::key_for(&ns, &volume);
    let outcome = ride_out(ctx, |retrying| {
        let (key, node) = (&key, &node);
        async move {
            match ctx.store.declare_node_gone(key, node, retrying).await {
                Ok(Declared::Written {
                    replaced_malformed: true,
                }) => {
                    eprintln!(
                        "warning: {} held a value that is not force-detach declarations; it was written again from this one",
                        declarations_key(node)
                    );
                    Ok(())
                }
                Ok(_) => Ok(()),
                Err(StoreError::Conflict { .. }) => Err(LookAgain.into()),
                Err(e) => Err(anyhow::Error::from(e)),
            }
        }
    })
    .await;
    match outcome {
        Ok(()) => {}
        Err(e) if is_not_found(&e) => {
            return Err(Refused(format!("volume {ns}/{volume} not found")).into())
        }
        Err(e) => return Err(e),
    }
    outln!(
        "volume {volume}: node {node} marked gone; its claims there now will be released without node calls once its Node has expired, and it takes no new step on them"
    );
    Ok(0)
}

/// What a deregistration drops: the volume's claims that are not Released, and its
/// attachments.
struct Held {
    claims: Vec<Claim>,
    attachments: Vec<Attachment>,
}

async fn held(ctx: &Ctx, ns: &Namespace, volume: &Name) -> anyhow::Result<Held> {
    // Claims are keyed by node first: every node's, filtered.
    let claims = ctx.store.list(&KeyScope::<ClaimSpec>::all()).await?;
    let attachments = match KeyScope::<AttachmentSpec>::namespace(ns) {
        Some(scope) => ctx.store.list(&scope).await?.items,
        None => Vec::new(),
    };
    Ok(Held {
        claims: claims
            .items
            .into_iter()
            .filter(|c| {
                &c.metadata.namespace == ns
                    && c.spec.volume.as_str() == volume.as_str()
                    && c.status.phase != ClaimPhase::Released
            })
            .collect(),
        attachments: attachments
            .into_iter()
            .filter(|a| a.spec.volume.as_str() == volume.as_str())
            .collect(),
    })
}

/// `moorctl volume deregister NAME [--force]`: removes a volume from moor without any
/// plugin call (a created volume's storage is kept). Refused while claims hold it;
/// with `force`, the claims of terminal allocations (a node that will never release
/// them) are dropped with the volume, after printing them.
pub(crate) async fn deregister(
    ctx: &Ctx,
    namespace: &str,
    volume: &str,
    force: bool,
) -> anyhow::Result<i32> {
    let ns = parse_ns(namespace)?;
    let name = parse_name("volume", volume)?;
    let key = Volume::key_for(&ns, &name);
    let dropped = ride_out(ctx, |_| {
        let (ns, name, key) = (&ns, &name, &key);
        async move {
            let Some(vol) = ctx.store.try_get(key).await? else {
                return Ok(None);
            };
            let held = held(ctx, ns, name).await?;
            if !held.claims.is_empty() && !force {
                return Err(Refused(format!(
                    "volume {ns}/{name} is claimed: {}; stop the allocations and wait for the \
                     claims to be released, or --force once the allocations are terminal",
                    describe_claims(&held.claims)
                ))
                .into());
            }
            for c in &held.claims {
                let alloc = Allocation::key_for(ns, &c.spec.allocation);
                let running = match ctx.store.try_get(&alloc).await? {
                    Some(a) => !a.is_terminal() && !a.is_deleting(),
                    None => false,
                };
                if running {
                    return Err(Refused(format!(
                        "volume {ns}/{name}: allocation {} on node {} is running; --force drops \
                         only the claims of terminal allocations (stop it first)",
                        c.spec.allocation, c.spec.node
                    ))
                    .into());
                }
            }
            // Marked at a version whose claims are the ones checked: a claim admitted
            // since the check (it writes the volume's status) runs the check again. A
            // write that left the claims as they were (a reconciler's other status
            // write) is only read past, so the race is a read and a write long, not
            // the lists of the check.
            let mut read = vol;
            let mut retry = moor::store::ConflictRetry::default();
            loop {
                match ctx
                    .store
                    .delete(key, Some(read.metadata.resource_version))
                    .await
                {
                    Ok(_) => return Ok(Some((read, held))),
                    Err(StoreError::NotFound { .. }) => return Ok(None),
                    Err(StoreError::Conflict { .. }) if retry.again().await => {
                        let Some(now) = ctx.store.try_get(key).await? else {
                            return Ok(None);
                        };
                        let (before, after) = (&read.status.claims, &now.status.claims);
                        if before.read_claims != after.read_claims
                            || before.write_claims != after.write_claims
                        {
                            return Err(LookAgain.into());
                        }
                        read = now;
                    }
                    Err(StoreError::Conflict { .. }) => return Err(LookAgain.into()),
                    Err(e) => return Err(e.into()),
                }
            }
        }
    })
    .await?;
    let Some((vol, held)) = dropped else {
        return Err(Refused(format!("volume {ns}/{name} not found")).into());
    };
    for c in &held.claims {
        outln!(
            "dropping claim {} of allocation {} on node {} ({}), without any plugin call",
            c.metadata.name,
            c.spec.allocation,
            c.spec.node,
            phase_name(c.status.phase)
        );
    }
    for a in &held.attachments {
        outln!(
            "dropping attachment of {name} to node {} ({:?}), without ControllerUnpublish",
            a.spec.node,
            a.status.phase
        );
    }
    for c in &held.claims {
        ride_out(ctx, |_| async move {
            match ctx.store.delete(&c.object_key(), None).await {
                Ok(_) | Err(StoreError::NotFound { .. }) => Ok(()),
                Err(e) => Err(anyhow::Error::from(e)),
            }
        })
        .await?;
    }
    for a in &held.attachments {
        ride_out(ctx, |_| async move {
            match ctx.store.delete(&a.object_key(), None).await {
                Ok(_) | Err(StoreError::NotFound { .. }) => Ok(()),
                Err(e) => Err(anyhow::Error::from(e)),
            }
        })
        .await?;
    }
    // Marked for deletion above: dropping every finalizer deletes it, with no
    // DeleteVolume (the provisioner's finalizer is what would call it).
    ride_out(ctx, |_| {
        let key = &key;
        async move {
            let Some(mut v) = ctx.store.try_get(key).await? else {
                return Ok(());
            };
            v.metadata.finalizers.clear();
            match ctx.store.replace(&v).await {
                Err(StoreError::Conflict { .. }) => Err(LookAgain.into()),
                Err(StoreError::NotFound { .. }) => Ok(()),
                other => other.map(|_| ()).map_err(anyhow::Error::from),
            }
        }
    })
    .await?;
    match &vol.status.provisioning.external_id {
        Some(ext) if !vol.spec.is_registration() => outln!(
            "volume {name} deregistered; the plugin's volume {ext} is kept (moorctl delete \
             deletes it)"
        ),
        _ => outln!("volume {name} deregistered"),
    }
    Ok(0)
}

fn phase_name(p: ClaimPhase) -> String {
    serde_json::to_value(p)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

fn describe_claims(claims: &[Claim]) -> String {
    claims
        .iter()
        .map(|c| {
            format!(
                "allocation {} on node {} ({})",
                c.spec.allocation,
                c.spec.node,
                phase_name(c.status.phase)
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}
