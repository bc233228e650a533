//! The allocation reconciler: one claim per volume request, and the allocation's phase.
//!
//! Expected flow:
//! 1. A running allocation gets a Claim for each volume request, named
//!    `<allocation>.<request>` (shortened with a hash past the id rule's 128
//!    characters), under its node. A `per_alloc` request claims the volume
//!    `<volume>-<allocation>`: each allocation its own.
//! 2. The claim copies what admission and the node need: mode, the request's access
//!    and attachment modes (absent: the volume's), the merged mount options, the plugin.
//! 3. Releasing is the claim reconciler's (it watches allocations); this one only sums
//!    the claims up in `status.phase`.
//! 4. An allocation whose runner holds a Lease of the same name (`moorctl alloc run`)
//!    is lost when this process has seen that lease go unrenewed for its duration
//!    ([`plan::liveness`]): `status.lost` is set, with a Warning, which makes it
//!    terminal, so its claims are released through the normal sequence. A lease whose
//!    allocation is gone is deleted once it has expired.

use moor::api::*;
use moor::runtime::controller::{Action, Config, Controller};
use moor::runtime::metrics::ControllerMetrics;
use moor::store::StoreError;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

use super::plan::{self, Liveness};
use super::Ctx;
use super::Informers;
use crate::common::{details, object_ref};

/// Runs until `stop`.
pub async fn run(
    ctx: Ctx,
    inf: &Informers,
    config: Config,
    metrics: ControllerMetrics,
    stop: CancellationToken,
) {
    let this = Arc::new(ctx);
    Controller::new("allocations", this.allocations.clone(), config)
        .with_metrics(metrics)
        .owns(inf.allocations.subscribe())
        .watches(inf.claims.subscribe(), |c: &Claim| {
            vec![Allocation::key_for(&c.metadata.namespace, &c.spec.allocation).into_string()]
        })
        .watches(inf.leases.subscribe(), |l: &Lease| {
            vec![Allocation::key_for(&l.metadata.namespace, &l.metadata.name).into_string()]
        })
        .run(
            move |key| {
                let this = this.clone();
                async move { reconcile(&this, &key).await }
            },
            stop,
        )
        .await;
}

/// The lease of the allocation at `key` (same namespace and name) and how long this
/// process has seen it go unrenewed.
fn lease_of(ctx: &Ctx, key: &str) -> Option<(Arc<Lease>, Duration)> {
    let key = ObjectKey::<AllocationSpec>::parse(key).ok()?;
    let (ns, name) = key.suffix().split_once('/')?;
    let lease_key = Lease::key_for(&Namespace::new(ns).ok()?, name);
    let mut observer = ctx.lease_observer.lock().unwrap_or_else(|p| p.into_inner());
    let Some(lease) = ctx.leases.get(&lease_key) else {
        // Gone (its runner ended, or it was collected): nothing to remember of it.
        observer.forget(lease_key.as_str());
        return None;
    };
    let unrenewed = observer.observe(&lease, std::time::Instant::now());
    Some((lease, unrenewed))
}

/// A lease whose allocation is gone: deleted once expired (its runner may still be
/// about to create the allocation until then).
async fn collect_lease(ctx: &Ctx, key: &str) -> Result<Action, StoreError> {
    let Some((lease, unrenewed)) = lease_of(ctx, key) else {
        return Ok(Action::AwaitChange);
    };
    if unrenewed < lease.duration() {
        return Ok(Action::Requeue(lease.duration() - unrenewed));
    }
    // Its deletion comes back through the lease watch, which forgets it.
    match ctx.writer.delete_read(&lease).await {
        Ok(_) | Err(StoreError::NotFound { .. }) | Err(StoreError::Conflict { .. }) => {}
        Err(e) => return Err(e),
    }
    Ok(Action::AwaitChange)
}

async fn reconcile(ctx: &Ctx, key: &str) -> Result<Action, StoreError> {
    ctx.ready().await;
    let Some(alloc) = ctx.allocations.get(key) else {
        return collect_lease(ctx, key).await;
    };
    let lease = lease_of(ctx, key);
    let live = plan::liveness(
        &alloc,
        lease.as_ref().map(|(l, _)| &**l),
        lease.as_ref().map_or(Duration::ZERO, |(_, d)| *d),
    );
    if live == Liveness::Lost && !alloc.status.lost {
        let (holder, duration) = lease
            .as_ref()
            .map(|(l, _)| (l.spec.holder.clone(), l.duration()))
            .unwrap_or_default();
        let why = format!(
            "its runner {holder} did not renew its lease for {}",
            humantime::format_duration(duration)
        );
        let mut a = (*alloc).clone();
        a.status.lost = true;
        a.status
            .meta
            .set_condition("Lost", true, "LeaseExpired", &why);
        match ctx.writer.update(&alloc, &a).await {
            Ok(_) => {}
            Err(StoreError::Conflict { .. }) => {
                return Ok(Action::Requeue(Duration::from_millis(50)))
            }
            Err(e) => return Err(e),
        }
        let d = details([("allocation", alloc.metadata.name.to_string())]);
        ctx.recorder
            .record(
                object_ref(&*alloc),
                EventType::Warning,
                "Allocation lost",
                format!(
                    "allocation {} is lost: {why}; releasing its claims",
                    alloc.metadata.name
                ),
                d,
            )
            .await;
        return Ok(Action::AwaitChange);
    }
    let action = converge(ctx, &alloc).await?;
    // A live lease is looked at again when it would expire.
    Ok(match (live, action) {
        (Liveness::Live(left), Action::AwaitChange) => Action::Requeue(left),
        (Liveness::Live(left), Action::Requeue(d)) => Action::Requeue(d.min(left)),
        (_, action) => action,
    })
}

/// One claim per request, and the phase.
async fn converge(ctx: &Ctx, alloc: &Arc<Allocation>) -> Result<Action, StoreError> {
    let ns = &alloc.metadata.namespace;
    let terminal = alloc.is_terminal() || alloc.is_deleting();
    let mut waiting = Vec::new();
    let mut phases = Vec::new();
    let mut rerun = false;
    for req in &alloc.spec.volumes {
        let Some(volume_id) = alloc.request_volume(req) else {
            waiting.push(format!(
                "request {}: per_alloc volume name is too long",
                req.name
            ));
            continue;
        };
        let Some(name) = alloc.claim_name(req) else {
            continue;
        };
        let key = Claim::key_for(&alloc.spec.node, ns, &name);
        if let Some(c) = ctx.claims.get(&key) {
            if !terminal && c.spec.release && c.status.phase == ClaimPhase::Released {
                // The allocation runs again (set back to `run`): the released claim of
                // its earlier run gives way to a new one, admitted from scratch.
                match ctx.writer.delete_read(&c).await {
                    Ok(_) | Err(StoreError::NotFound { .. }) | Err(StoreError::Conflict { .. }) => {
                    }
                    Err(e) => return Err(e),
                }
                rerun = true;
                phases.push(ClaimPhase::Pending);
                continue;
            }
            phases.push(c.status.phase);
            continue;
        }
        if terminal {
            continue;
        }
        let Some(volume) = ctx.volume(ns, &volume_id) else {
            waiting.push(format!("volume {volume_id} does not exist"));
            continue;
        };
        let Some(mut claim) = alloc.claim_for(req, &volume) else {
            continue;
        };
        // The claim's trace starts here: every step on it, in any process, joins it.
        let root = moor::telemetry::step_span(
            "claim created",
            &claim.key(),
            claim.spec.volume.as_str(),
            claim.spec.node.as_str(),
            None,
        );
        claim.metadata.trace = moor::telemetry::traceparent(&root);
        match ctx.writer.create(&claim).await {
            Ok(_) | Err(StoreError::AlreadyExists { .. }) => phases.push(ClaimPhase::Pending),
            Err(e) => return Err(e),
        }
    }
    let phase = if terminal {
        if phases.iter().all(|p| *p == ClaimPhase::Released) {
            AllocationPhase::Released
        } else {
            AllocationPhase::Releasing
        }
    } else if phases.contains(&ClaimPhase::Denied) {
        AllocationPhase::Blocked
    } else if waiting.is_empty() && phases.iter().all(|p| *p == ClaimPhase::Published) {
        AllocationPhase::Ready
    } else {
        AllocationPhase::Pending
    };
    let mut status = alloc.status.clone();
    status.phase = phase;
    status.meta.observed_generation = alloc.metadata.generation;
    status.meta.last_error = (!waiting.is_empty()).then(|| waiting.join("; "));
    if status != alloc.status {
        let mut a = (**alloc).clone();
        a.status = status;
        match ctx.writer.update(alloc, &a).await {
            Ok(_) => {}
            Err(StoreError::Conflict { .. }) => {
                return Ok(Action::Requeue(Duration::from_millis(50)))
            }
            Err(e) => return Err(e),
        }
    }
    if rerun {
        // The new claims are made once the old ones are gone from the cache.
        Ok(Action::Requeue(Duration::from_millis(100)))
    } else if waiting.is_empty() {
        Ok(Action::AwaitChange)
    } else {
        // A missing volume has no trigger of its own here: look again.
        Ok(Action::Requeue(Duration::from_secs(2)))
    }
}
