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

use futures::StreamExt;
use moor::api::*;
use moor::runtime::controller::{Action, Config, Controller, ErrorPolicy, ReconcileError};
use moor::runtime::informer::Informer;
use moor::runtime::metrics::ControllerMetrics;
use moor::store::{Batch, StoreError};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

use super::admission::{self, Verdict};
use super::plan::{self, AttachPlan, NodeDone};
use super::{volume_index, Ctx, BY_NODE, BY_PLUGIN, BY_VOLUME};
use crate::common::{details, object_ref};

/// How many past claims a volume remembers.
const PAST_CLAIMS: usize = 16;

/// Why a claim could not be converged.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// Reading or writing etcd failed.
    #[error("store operation failed")]
    Store(#[from] StoreError),
}

impl ReconcileError for ClaimError {
    fn policy(&self) -> ErrorPolicy {
        let ClaimError::Store(e) = self;
        e.policy()
    }
}

/// The informers the controller's reconcilers subscribe to.
pub struct Informers {
    /// Allocations.
    pub allocations: Informer<Allocation>,
    /// Claims.
    pub claims: Informer<Claim>,
    /// Volumes.
    pub volumes: Informer<Volume>,
    /// Attachments.
    pub attachments: Informer<Attachment>,
    /// Mounts.
    pub mounts: Informer<Mount>,
    /// Nodes.
    pub nodes: Informer<Node>,
    /// Plugins.
    pub plugins: Informer<Plugin>,
}

/// The claim key of a request of an allocation.
pub fn claim_key(node: &NodeName, ns: &Namespace, name: &Name) -> String {
    format!("claims/{node}/{ns}/{name}")
}

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
        move |ns: &Namespace, volume: &str, node: Option<&NodeName>| -> Vec<String> {
            claims
                .by_index(BY_VOLUME, &volume_index(ns, volume))
                .iter()
                .filter(|c| node.is_none_or(|n| &c.spec.node == n))
                .map(|c| c.key())
                .collect()
        }
    };
    let by_volume2 = by_volume.clone();
    let claims2 = claims.clone();
    let claims3 = claims.clone();
    let claims4 = claims.clone();
    let this = Arc::new(ctx);
    Controller::new("claims", claims, config)
        .with_metrics(metrics)
        .owns(inf.claims.subscribe())
        .watches(inf.allocations.subscribe(), |a: &Allocation| {
            super::allocations::requests(a)
                .into_iter()
                .map(|(name, _)| claim_key(&a.spec.node, &a.metadata.namespace, &name))
                .collect()
        })
        .watches(inf.mounts.subscribe(), |m: &Mount| {
            vec![claim_key(
                &m.spec.node,
                &m.metadata.namespace,
                &m.spec.claim,
            )]
        })
        .watches(inf.attachments.subscribe(), move |a: &Attachment| {
            by_volume(
                &a.metadata.namespace,
                a.spec.volume.as_str(),
                Some(&a.spec.node),
            )
        })
        .watches(inf.volumes.subscribe(), move |v: &Volume| {
            by_volume2(&v.metadata.namespace, v.metadata.name.as_str(), None)
        })
        .watches(inf.nodes.subscribe(), move |n: &Node| {
            claims2
                .by_index(BY_NODE, n.metadata.name.as_str())
                .iter()
                .map(|c| c.key())
                .collect()
        })
        .watches(inf.plugins.subscribe(), move |p: &Plugin| {
            claims3
                .by_index(BY_PLUGIN, p.metadata.name.as_str())
                .iter()
                .filter(|c| {
                    !matches!(c.status.phase, ClaimPhase::Published | ClaimPhase::Released)
                        || c.spec.release
                })
                .map(|c| c.key())
                .collect()
        })
        .watches(inf.claims.subscribe(), released_frees(claims4))
        .trigger(node_gc_ticks(this.clone()).boxed())
        .run(
            move |key| {
                let this = this.clone();
                // A conflict (our cache lagged a write) is retried soon by the runtime.
                async move { reconcile(&this, &key).await }
            },
            stop,
        )
        .await;
}

/// Maps a claim that reached Released to the Pending and Denied claims its release
/// may now admit: those of the same volume (access modes), of the same node
/// (max_volumes_per_node) and of the same plugin.
fn released_frees(
    claims: moor::runtime::reflector::Store<Claim>,
) -> impl Fn(&Claim) -> Vec<String> + Send + Sync + 'static {
    move |released: &Claim| {
        if released.status.phase != ClaimPhase::Released {
            return Vec::new();
        }
        let waiting = |c: &Arc<Claim>| {
            matches!(c.status.phase, ClaimPhase::Pending | ClaimPhase::Denied)
                && !c.spec.release
                && c.metadata.uid != released.metadata.uid
        };
        let volume = volume_index(&released.metadata.namespace, released.spec.volume.as_str());
        let mut keys: Vec<String> = claims
            .by_index(BY_VOLUME, &volume)
            .iter()
            .chain(claims.by_index(BY_NODE, released.spec.node.as_str()).iter())
            .chain(
                claims
                    .by_index(BY_PLUGIN, released.spec.plugin_id.as_str())
                    .iter(),
            )
            .filter(|c| waiting(c))
            .map(|c| c.key())
            .collect();
        keys.sort();
        keys.dedup();
        keys
    }
}

/// With `--node-gc-timeout`, releasing claims on absent nodes are looked at again
/// every few seconds, so the timeout is noticed without another trigger.
fn node_gc_ticks(ctx: Arc<Ctx>) -> impl futures::Stream<Item = String> + Send {
    let every = ctx
        .node_gc_timeout
        .map(|t| (t / 4).clamp(Duration::from_millis(200), Duration::from_secs(10)));
    futures::stream::unfold(ctx, move |ctx| async move {
        match every {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending::<()>().await,
        }
        let keys: Vec<String> = ctx
            .claims
            .state()
            .iter()
            .filter(|c| c.spec.release && c.status.phase != ClaimPhase::Released)
            .filter(|c| ctx.nodes.get(&format!("nodes/{}", c.spec.node)).is_none())
            .map(|c| c.key())
            .collect();
        Some((futures::stream::iter(keys), ctx))
    })
    .flatten()
}

async fn reconcile(ctx: &Ctx, key: &str) -> Result<Action, ClaimError> {
    ctx.ready().await;
    let Some(cached) = ctx.claims.get(key) else {
        return Ok(Action::AwaitChange);
    };
    let _guard = ctx
        .volume_locks
        .lock(&format!(
            "{}/{}",
            cached.metadata.namespace, cached.spec.volume
        ))
        .await;
    // Claims of one volume are serialised; a decision never rests on a cache older
    // than this process's last write of the claim (then it is read fresh).
    let Some(claim) = ctx.claim(key).await? else {
        return Ok(Action::AwaitChange);
    };
    let alloc = ctx.allocations.get(&format!(
        "allocations/{}/{}",
        claim.metadata.namespace, claim.spec.allocation
    ));
    let wanted = alloc.as_ref().is_some_and(|a| {
        !a.is_deleting()
            && !a.spec.is_terminal()
            && super::allocations::requests(a)
                .iter()
                .any(|(name, _)| name == &claim.metadata.name)
    });
    if !wanted && !claim.spec.release {
        let mut c = (*claim).clone();
        c.spec.release = true;
        // The release's first step in the same write: waiting for the node.
        if matches!(node_done(ctx, &c), NodeDone::No) {
            c.status.phase = ClaimPhase::Releasing;
            c.status.reason = Some(waiting_for_unpublish(&c));
        }
        write(ctx, &claim, c).await?;
        return Ok(Action::AwaitChange);
    }
    if claim.spec.release || claim.is_deleting() {
        return release(ctx, &claim, alloc.is_none()).await;
    }
    match claim.status.phase {
        ClaimPhase::Pending | ClaimPhase::Denied => admit(ctx, &claim).await,
        ClaimPhase::Admitted | ClaimPhase::Published => publish(ctx, &claim).await,
        ClaimPhase::Releasing | ClaimPhase::Released => Ok(Action::AwaitChange),
    }
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
async fn write(ctx: &Ctx, claim: &Claim, next: Claim) -> Result<(), ClaimError> {
    if let Some(next) = next_claim(claim, next) {
        ctx.wrote(&ctx.store.update(claim, &next).await?);
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
) -> Result<(), StoreError> {
    let mut batch = Batch::default();
    let other = next
        .map(|n| batch.update(&ctx.store, read, n))
        .transpose()?;
    let claim_written = self::next_claim(claim, next_claim)
        .map(|c| batch.update(&ctx.store, claim, &c))
        .transpose()?;
    let revision = batch.commit(&ctx.store).await?;
    ctx.wrote_in(other, revision);
    ctx.wrote_in(claim_written, revision);
    Ok(())
}

/// Edits the status of the claim's volume with `f` (`Ok(false)`: no change; `Err`:
/// nothing is written and the error returned) and writes `next` over `claim`: one
/// transaction against the cached volume, guarded by its version and the claim's; if
/// either changed since (the provisioner writes its own section of the volume), the
/// volume through a fresh read-modify-write, then the claim.
async fn with_volume<E>(
    ctx: &Ctx,
    claim: &Claim,
    mut f: impl FnMut(&Volume, &mut VolumeStatus) -> Result<bool, E>,
    next: Claim,
) -> Result<Result<(), E>, ClaimError> {
    let ns = &claim.metadata.namespace;
    let key = format!("volumes/{ns}/{}", claim.spec.volume);
    if let Some(read) = ctx.own_writes.fresh(&ctx.store, &ctx.volumes, &key).await? {
        let mut volume = (*read).clone();
        if let Err(e) = f(&read, &mut volume.status) {
            return Ok(Err(e));
        }
        let changed = (volume.status != read.status).then_some(&volume);
        match write_with(ctx, &read, changed, claim, next.clone()).await {
            Ok(()) => return Ok(Ok(())),
            Err(StoreError::Conflict { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    let mut verdict = Ok(());
    let suffix = format!("{ns}/{}", claim.spec.volume);
    let written = ctx
        .store
        .modify_status::<VolumeSpec>(&suffix, |v, st| match f(v, st) {
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
    ctx.wrote(&written);
    if verdict.is_ok() {
        write(ctx, claim, next).await?;
    }
    Ok(verdict)
}

/// Writes the claim's status if `f` changes it.
async fn set_status(
    ctx: &Ctx,
    claim: &Claim,
    f: impl Fn(&mut ClaimStatus),
) -> Result<(), ClaimError> {
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

async fn admit(ctx: &Ctx, claim: &Claim) -> Result<Action, ClaimError> {
    let volume = ctx.volume(&claim.metadata.namespace, &claim.spec.volume);
    let node = ctx.nodes.get(&format!("nodes/{}", claim.spec.node));
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
    let mut context = volume.spec.context.clone();
    context.extend(volume.status.provisioning.volume_context.clone());
    let mut c = claim.clone();
    c.spec.access_mode = Some(admitted.capability.access_mode);
    c.spec.attachment_mode = Some(admitted.capability.attachment_mode);
    c.spec.external_id = Some(admitted.external_id);
    c.spec.volume_context = context;
    c.spec.volume_generation = Some(volume.metadata.generation);
    c.status.phase = ClaimPhase::Admitted;
    c.status
        .meta
        .set_condition("Admitted", true, "Admitted", "");
    // The next step in the same write: the node let act when the attachment is ready
    // or not needed, else the attachment asked for once the admission is recorded.
    let (state, todo) = attachment_state(ctx, &c).await?;
    match state {
        Attach::Wait(why) => c.status.reason = Some(why),
        Attach::Ready(context) => {
            c.spec.publish = true;
            c.spec.publish_context = context;
            c.status.reason = Some(waiting_for_node(&c));
        }
    }
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
            let existing: Vec<ClaimRef> = live
                .read_claims
                .iter()
                .chain(&live.write_claims)
                .cloned()
                .collect();
            admission::access(
                &v.spec,
                admitted.capability.access_mode,
                &me.node,
                me.mode,
                &existing,
            )
            .map_err(|e| Refusal::Deny(e.to_string()))?;
            match me.mode {
                ClaimMode::Read => live.read_claims.push(me.clone()),
                ClaimMode::Write => live.write_claims.push(me.clone()),
            }
            Ok(true)
        },
        c,
    )
    .await;
    match recorded {
        Ok(Ok(())) => {}
        Ok(Err(Refusal::Deny(denied))) => return refuse(ctx, claim, Verdict::Deny(denied)).await,
        // The volume changed since the cache showed it: decide again on the new one.
        Ok(Err(Refusal::Stale)) => return Ok(Action::Requeue(Duration::from_millis(50))),
        Err(ClaimError::Store(StoreError::NotFound { .. })) => {
            return refuse(
                ctx,
                claim,
                Verdict::Deny(format!("volume {} does not exist", claim.spec.volume)),
            )
            .await
        }
        Err(e) => return Err(e),
    }
    match todo {
        Some(AttachTodo::Create(att)) => create_attachment(ctx, &att).await?,
        // Re-planned from the claim as now stored.
        Some(AttachTodo::Replace(_)) => return Ok(Action::Requeue(Duration::ZERO)),
        None => {}
    }
    Ok(Action::AwaitChange)
}

/// Why the admission's compare-and-swap did not record the claim.
enum Refusal {
    /// An access-mode rule denies it.
    Deny(String),
    /// The volume is not the one the decision was made on.
    Stale,
}

async fn refuse(ctx: &Ctx, claim: &Claim, verdict: Verdict) -> Result<Action, ClaimError> {
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

/// Where a claim's attachment stands.
enum Attach {
    /// Attached, or the plugin needs none: the node may act, with this context.
    Ready(BTreeMap<String, String>),
    /// Not yet, and why.
    Wait(String),
}

/// Carries out the claim's controller-publish step ([`plan::attach`]): creates a
/// missing attachment, asks for the detach of one that does not cover the claim, and
/// says whether the node may act.
async fn ensure_attachment(ctx: &Ctx, claim: &Claim) -> Result<Attach, ClaimError> {
    let (state, todo) = attachment_state(ctx, claim).await?;
    match todo {
        Some(AttachTodo::Create(att)) => create_attachment(ctx, &att).await?,
        Some(AttachTodo::Replace(att)) => {
            let mut next = (*att).clone();
            next.spec.detach = true;
            ctx.wrote(&ctx.store.update(&att, &next).await?);
        }
        None => {}
    }
    Ok(state)
}

async fn create_attachment(ctx: &Ctx, att: &Attachment) -> Result<(), ClaimError> {
    match ctx.store.create(att).await {
        Ok(created) => ctx.wrote(&created),
        Err(StoreError::AlreadyExists { .. }) => {}
        Err(e) => return Err(e.into()),
    }
    Ok(())
}

/// A write the controller-publish step asks for.
enum AttachTodo {
    /// Create this attachment.
    Create(Box<Attachment>),
    /// Set `detach` on this one (it does not cover the claim and nobody uses it).
    Replace(Arc<Attachment>),
}

/// Gathers what [`plan::attach`] decides from and returns its verdict: whether the
/// node may act, and the write to make first.
async fn attachment_state(
    ctx: &Ctx,
    claim: &Claim,
) -> Result<(Attach, Option<AttachTodo>), ClaimError> {
    let plugin = ctx
        .plugins
        .get(&format!("plugins/{}", claim.spec.plugin_id));
    let node = ctx.nodes.get(&format!("nodes/{}", claim.spec.node));
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
    let plan = plan::attach(&plan::AttachInputs {
        claim,
        plugin: plugin.as_deref(),
        node: node.as_deref(),
        attachment: attachment.as_deref(),
        attachment_in_use: in_use,
    });
    Ok(match plan {
        AttachPlan::Ready(context) => (Attach::Ready(context), None),
        AttachPlan::Wait(why) => (Attach::Wait(why), None),
        AttachPlan::Create(spec) => {
            let name = Name::new(format!("{}.{}", spec.volume, spec.node))
                .unwrap_or_else(|_| claim.metadata.name.clone());
            let att = Attachment::new(&claim.metadata.namespace, name, spec);
            let why = "waiting for the volume to be attached".to_string();
            (Attach::Wait(why), Some(AttachTodo::Create(Box::new(att))))
        }
        AttachPlan::Replace => {
            let why = "waiting for the volume's attachment to be replaced by one for this claim's capability".to_string();
            (Attach::Wait(why), attachment.map(AttachTodo::Replace))
        }
    })
}

/// Whether another claim of the claim's volume on its node may still be using the
/// attachment there: it was let onto the node and its node side is not finished. A
/// claim created since the cache last heard is safe to miss: it finds the attachment
/// detaching and waits for a new one.
async fn attachment_needed_by_others(ctx: &Ctx, claim: &Claim) -> Result<bool, ClaimError> {
    for o in ctx.claims.by_index(
        BY_VOLUME,
        &volume_index(&claim.metadata.namespace, claim.spec.volume.as_str()),
    ) {
        if o.metadata.uid == claim.metadata.uid || o.spec.node != claim.spec.node {
            continue;
        }
        let Some(o) = ctx.claim(&o.key()).await? else {
            continue;
        };
        let needs = o.status.phase != ClaimPhase::Released
            && (o.spec.publish || o.status.phase.is_live())
            && node_done(ctx, &o) == NodeDone::No;
        if needs {
            return Ok(true);
        }
    }
    Ok(false)
}

fn waiting_for_unpublish(claim: &Claim) -> String {
    format!("waiting for node {} to unpublish", claim.spec.node)
}

fn waiting_for_node(claim: &Claim) -> String {
    format!("waiting for node {} to publish", claim.spec.node)
}

async fn publish(ctx: &Ctx, claim: &Claim) -> Result<Action, ClaimError> {
    let publish_context = match ensure_attachment(ctx, claim).await? {
        Attach::Ready(context) => context,
        Attach::Wait(why) => return waiting(ctx, claim, &why).await,
    };
    if !claim.spec.publish || claim.spec.publish_context != publish_context {
        let mut c = claim.clone();
        c.spec.publish = true;
        c.spec.publish_context = publish_context;
        write(ctx, claim, c).await?;
        return Ok(Action::AwaitChange);
    }
    let mount = claim_mount(ctx, claim);
    let published = mount.as_ref().is_some_and(|m| m.status.published);
    let node_error = mount
        .as_ref()
        .and_then(|m| m.status.meta.last_error.clone());
    let node_retry = mount.as_ref().and_then(|m| m.status.meta.retry.clone());
    let was_published = claim.status.phase == ClaimPhase::Published;
    set_status(ctx, claim, |st| {
        if published {
            st.phase = ClaimPhase::Published;
            st.reason = None;
        } else {
            st.reason = Some(waiting_for_node(claim));
        }
        st.meta.last_error = node_error.clone();
        st.meta.retry = node_retry.clone();
    })
    .await?;
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

async fn waiting(ctx: &Ctx, claim: &Claim, why: &str) -> Result<Action, ClaimError> {
    set_status(ctx, claim, |st| st.reason = Some(why.to_string())).await?;
    Ok(Action::AwaitChange)
}

/// The Mount the claim's node agent keeps for this very claim (same uid), if any.
fn claim_mount(ctx: &Ctx, claim: &Claim) -> Option<Arc<Mount>> {
    ctx.mounts
        .get(&format!(
            "mounts/{}/{}/{}",
            claim.spec.node, claim.metadata.namespace, claim.metadata.name
        ))
        .filter(|m| m.spec.claim_uid == claim.metadata.uid)
}

/// Whether the node side of a claim is finished (or skipped): [`plan::node_done`] over
/// the caches.
fn node_done(ctx: &Ctx, claim: &Claim) -> NodeDone {
    let mount = claim_mount(ctx, claim);
    let volume = ctx.volume(&claim.metadata.namespace, &claim.spec.volume);
    let node_gone_for = ctx
        .node_gc_timeout
        .and_then(|_| ctx.node_gone_for(&claim.spec.node));
    plan::node_done(&plan::NodeInputs {
        claim,
        mount: mount.as_deref(),
        volume: volume.as_deref(),
        node_gone_for,
        node_gc_timeout: ctx.node_gc_timeout,
    })
}

async fn release(ctx: &Ctx, claim: &Claim, alloc_gone: bool) -> Result<Action, ClaimError> {
    if claim.status.phase == ClaimPhase::Released {
        if alloc_gone {
            match ctx
                .store
                .delete::<ClaimSpec>(&claim.spec.key_suffix(&claim.metadata), None)
                .await
            {
                Ok(_) | Err(StoreError::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        return Ok(Action::AwaitChange);
    }
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
                .map(|m| {
                    (
                        m.status.meta.last_error.clone(),
                        m.status.meta.retry.clone(),
                    )
                })
                .unwrap_or_default();
            set_status(ctx, claim, |st| {
                st.phase = ClaimPhase::Releasing;
                st.reason = Some(why.clone());
                st.meta.last_error = error.clone();
                st.meta.retry = retry.clone();
            })
            .await?;
            return Ok(Action::AwaitChange);
        }
    }
    // Detach when no other claim of the volume on this node still needs the attachment.
    let attachment = ctx.attachment(claim).await?;
    if let Some(att) = attachment {
        if !attachment_needed_by_others(ctx, claim).await? {
            // The detach asked for and the claim's reason, in one transaction.
            let mut detached = (*att).clone();
            detached.spec.detach = true;
            let changed = (!att.spec.detach).then_some(&detached);
            let mut c = claim.clone();
            c.status.phase = ClaimPhase::Releasing;
            c.status.reason = Some("waiting for the volume to be detached".into());
            write_with(ctx, &att, changed, claim, c).await?;
            return Ok(Action::AwaitChange);
        }
    }
    // Done: dropped from the volume's live claims (remembered as a past one) and marked
    // Released, in one transaction.
    let mut released = claim.clone();
    released.status.phase = ClaimPhase::Released;
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
    )
    .await;
    match dropped {
        Ok(_) => {}
        Err(ClaimError::Store(StoreError::NotFound { .. })) => write(ctx, claim, released).await?,
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
    Ok(Action::AwaitChange)
}
