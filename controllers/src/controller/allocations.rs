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
//!    the claims up in `status.phase`. What to create, delete and write is decided by
//!    [`plan::allocation::converge`]; this file carries it out.
//! 5. An allocation that ended, once every claim is released (phase Released, since
//!    `status.released_at`), is deleted after `--retention` ([`plan::allocation::collect`]);
//!    its claims follow (the claim reconciler), and their Mounts (each node's agent).
//! 4. An allocation whose runner holds a Lease of the same name (`moorctl alloc run`)
//!    is lost when this process has seen that lease go unrenewed for its duration
//!    ([`plan::liveness`]): `status.lost` is set, with a Warning, which makes it
//!    terminal, so its claims are released through the normal sequence. A lease whose
//!    allocation is gone is deleted once it has expired.

use moor::admission::Made;
use moor::api::*;
use moor::runtime::controller::{Action, Config, Controller};
use moor::runtime::metrics::ControllerMetrics;
use moor::store::{Batch, StoreError};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

use super::context::{Ctx, Informers};
use super::plan::{self, Liveness};
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
    let waiting_on_class = this.allocations.clone();
    Controller::new("allocations", this.allocations.clone(), config)
        .with_metrics(metrics)
        .owns_trusting(inf.allocations.subscribe(), converged)
        .watches(inf.claims.subscribe(), |c: &Claim| {
            vec![Allocation::key_for(
                &c.metadata.namespace,
                &c.spec.allocation,
            )]
        })
        .watches(inf.leases.subscribe(), |l: &Lease| {
            vec![Allocation::key_for(&l.metadata.namespace, &l.metadata.name)]
        })
        // A class made or changed: the allocations whose templates wait on one.
        .watches(inf.classes.subscribe(), move |_: &VolumeClass| {
            waiting_on_class
                .state()
                .iter()
                .filter(|a| {
                    a.status.phase == AllocationPhase::Pending
                        && a.spec.volumes.iter().any(|r| {
                            r.template
                                .as_ref()
                                .is_some_and(|t| t.class.is_some() || t.plugin_id.is_empty())
                        })
                })
                .map(|a| a.object_key())
                .collect()
        })
        .run(reconcile, this, stop)
        .await;
}

/// An allocation whose status says its last reconcile left nothing to do (ready or
/// released, for the spec it saw, not being deleted): a relist puts it in the repair
/// pass behind every change (the order only; it still runs).
fn converged(a: &Allocation) -> bool {
    matches!(
        a.status.phase,
        AllocationPhase::Ready | AllocationPhase::Released
    ) && a.status.meta.observed_generation == a.metadata.generation
        && !a.is_deleting()
}

/// The lease of the allocation at `key` (same namespace and name) and how long this
/// process has seen it go unrenewed.
fn lease_of(ctx: &Ctx, key: &ObjectKey<AllocationSpec>) -> Option<(Arc<Lease>, Duration)> {
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
async fn collect_lease(ctx: &Ctx, key: &ObjectKey<AllocationSpec>) -> Result<Action, StoreError> {
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

async fn reconcile(ctx: Arc<Ctx>, key: ObjectKey<AllocationSpec>) -> Result<Action, StoreError> {
    let ctx = &*ctx;
    ctx.ready().await;
    let Some(cached) = ctx.allocations.get(&key) else {
        return collect_lease(ctx, &key).await;
    };
    // From the cache, unless it lags this process's own last write of the allocation.
    let Some(alloc) = ctx
        .writer
        .fresh(&ctx.allocations, &cached.object_key())
        .await?
    else {
        return Ok(Action::AwaitChange);
    };
    let lease = lease_of(ctx, &key);
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
    let stop_left = match stop_bound(ctx, &alloc, lease.as_ref().map(|(l, _)| l.duration())).await?
    {
        StopBound::Wrote => return Ok(Action::AwaitChange),
        StopBound::Conflict => return Ok(Action::Requeue(Duration::from_millis(50))),
        StopBound::Left(left) => left,
    };
    let action = converge(ctx, &alloc).await?;
    // A stop in progress is looked at again when its bound passes.
    let action = match (stop_left, action) {
        (None, action) => action,
        (Some(left), Action::Requeue(d)) => Action::Requeue(d.min(left)),
        (Some(left), _) => Action::Requeue(left),
    };
    // Ended and released: collected after the retention (read again from the cache,
    // as converge may just have written the time it counts from).
    let current = ctx.allocations.get(&key).unwrap_or(alloc.clone());
    let action = match plan::allocation::collect(&current, Timestamp::now(), ctx.retention) {
        plan::allocation::Collect::Keep => action,
        plan::allocation::Collect::After(left) => match action {
            Action::Requeue(d) => Action::Requeue(d.min(left)),
            _ => Action::Requeue(left),
        },
        plan::allocation::Collect::Now => return collect(ctx, &current).await,
    };
    // A live lease is looked at again when it would expire.
    Ok(match (live, action) {
        (Liveness::Live(left), Action::AwaitChange) => Action::Requeue(left),
        (Liveness::Live(left), Action::Requeue(d)) => Action::Requeue(d.min(left)),
        (_, action) => action,
    })
}

/// What [`stop_bound`] did.
enum StopBound {
    /// Wrote the allocation's status (the write brings the next pass).
    Wrote,
    /// Lost a race with another write: looked at again.
    Conflict,
    /// Nothing to write; a stop in progress has this long left.
    Left(Option<Duration>),
}

/// A stop while the workload runs (issue 78, item 1): its first sight is recorded, and
/// the claims stay ([`Allocation::is_stopping`]) while the runner ends the workload
/// (SIGTERM, SIGKILL after the kill timeout) and records the end. Once the kill timeout
/// plus the lease's duration (`lease`, none without one) has passed from that sight with
/// no end recorded, `stop_expired` is set: the claims are released, and the node's
/// agent kills what is left of the workload before it unpublishes. A stop taken back
/// (`desired_status: run` again) forgets the sight.
async fn stop_bound(
    ctx: &Ctx,
    alloc: &Arc<Allocation>,
    lease: Option<Duration>,
) -> Result<StopBound, StoreError> {
    let now = Timestamp::now();
    let bound = alloc.spec.kill_timeout() + lease.unwrap_or_default();
    let mut next = (**alloc).clone();
    let event = match alloc.status.stop_seen_at {
        _ if alloc.is_deleting() => return Ok(StopBound::Left(None)),
        Some(_) if !alloc.is_stopping() && !alloc.spec.is_terminal() => {
            next.status.stop_seen_at = None;
            next.status
                .meta
                .conditions
                .retain(|c| c.type_ != "Stopping");
            None
        }
        Some(seen) if alloc.is_stopping() => {
            let elapsed = now
                .system()
                .duration_since(seen.system())
                .unwrap_or_default();
            if elapsed < bound {
                return Ok(StopBound::Left(Some(bound - elapsed)));
            }
            let why = format!(
                "its workload's end was not recorded within {} of the stop (kill timeout {}, lease {})",
                humantime::format_duration(bound),
                humantime::format_duration(alloc.spec.kill_timeout()),
                humantime::format_duration(lease.unwrap_or_default()),
            );
            next.status.stop_expired = true;
            next.status
                .meta
                .set_condition("Stopping", false, "StopExpired", &why);
            Some((
                EventType::Warning,
                "Allocation stop expired",
                format!(
                    "allocation {}: {why}; releasing its claims (the node's agent ends what is left of it first)",
                    alloc.metadata.name
                ),
            ))
        }
        None if alloc.is_stopping() => {
            next.status.stop_seen_at = Some(now);
            let why = format!(
                "its runner ends the workload (SIGTERM, SIGKILL after {}); its claims stay until the end is recorded, at most {}",
                humantime::format_duration(alloc.spec.kill_timeout()),
                humantime::format_duration(bound),
            );
            next.status
                .meta
                .set_condition("Stopping", true, "StopRequested", &why);
            Some((
                EventType::Normal,
                "Allocation stopping",
                format!("allocation {} asked to stop: {why}", alloc.metadata.name),
            ))
        }
        _ => return Ok(StopBound::Left(None)),
    };
    match ctx.writer.update(alloc, &next).await {
        Ok(_) => {}
        Err(StoreError::Conflict { .. }) => return Ok(StopBound::Conflict),
        Err(e) => return Err(e),
    }
    if let Some((kind, reason, message)) = event {
        let d = details([("allocation", alloc.metadata.name.to_string())]);
        ctx.recorder
            .record(object_ref(&**alloc), kind, reason, message, d)
            .await;
    }
    Ok(StopBound::Wrote)
}

/// Deletes an ended allocation whose retention is over ([`plan::allocation::collect`]).
/// Its Released claims are deleted by the claim reconciler once their allocation is
/// gone, each only after its node confirmed the teardown, and each node's agent deletes
/// the Mount of a deleted claim; an ephemeral volume its template made was deleted when
/// it ended, a retained one stays for the next allocation of the name.
async fn collect(ctx: &Ctx, alloc: &Allocation) -> Result<Action, StoreError> {
    match ctx.writer.delete_read(alloc).await {
        Ok(_) | Err(StoreError::NotFound { .. }) => {
            tracing::debug!(allocation = %alloc.key(), "collected an ended allocation");
            Ok(Action::AwaitChange)
        }
        // Changed since the cache showed it (run again, a status write): looked at anew.
        Err(StoreError::Conflict { .. }) => Ok(Action::Requeue(Duration::from_millis(50))),
        Err(e) => Err(e),
    }
}

/// The template a request's class makes of `tpl` (`moor::api::resolve_template`), and
/// the class's deletion rule; for a volume the template made before (`existing`, of
/// the same class) what the class filled then, never the class as it is now. A class
/// not (yet) there waits; a template contradicting its class is refused.
fn classed(
    tpl: &VolumeTemplate,
    existing: Option<&Volume>,
    classes: &[Arc<VolumeClass>],
) -> Result<(VolumeTemplate, Option<OnDelete>), Box<Made>> {
    if tpl.class.is_none() && !tpl.plugin_id.is_empty() {
        return Ok((tpl.clone(), None));
    }
    if let Some(v) = existing.filter(|v| v.spec.class.is_some() && v.spec.class == tpl.class) {
        return Ok(template_as_made(tpl, &v.spec));
    }
    if let Err(why) = pick(classes, tpl.class.as_ref(), !tpl.plugin_id.is_empty()) {
        return Err(Box::new(Made::Wait(why)));
    }
    resolve_template(tpl, classes).map_err(|why| Box::new(Made::Deny(why)))
}

/// Carries out [`plan::allocation::converge`]: one claim per request, and the phase.
async fn converge(ctx: &Ctx, alloc: &Arc<Allocation>) -> Result<Action, StoreError> {
    let plan = planned(ctx, alloc).await?;
    write_volumes(ctx, alloc, &plan).await?;
    let requeue = plan.requeue;
    if let Some(action) = write_claims(ctx, alloc, plan.create, plan.status).await? {
        return Ok(action);
    }
    Ok(requeue.map_or(Action::AwaitChange, Action::Requeue))
}

/// What a templated request's volume is made from, for one pass of an allocation.
struct Making<'a> {
    ctx: &'a Ctx,
    alloc: &'a Allocation,
    node: Option<&'a Node>,
    classes: &'a [Arc<VolumeClass>],
    /// A cordoned node takes no new claim, so no volume is made for one there either.
    cordon: Option<&'a Cordon>,
    capacities: &'a std::collections::BTreeMap<PluginId, Vec<CapacityEntry>>,
}

impl Making<'_> {
    /// The volume of request `req` from template `tpl` (`existing`: the one there).
    fn made(&self, req: &VolumeRequest, tpl: &VolumeTemplate, existing: Option<&Volume>) -> Made {
        if let (None, Some(c)) = (existing, self.cordon) {
            return Made::Wait(c.why());
        }
        let (tpl, on_delete) = match classed(tpl, existing, self.classes) {
            Ok(t) => t,
            Err(made) => return *made,
        };
        let made = moor::admission::made(
            self.alloc,
            req,
            &tpl,
            existing,
            self.node,
            self.capacities.get(&tpl.plugin_id).map(Vec::as_slice),
            || {
                self.ctx
                    .claims
                    .by_index(super::context::BY_NODE, self.alloc.spec.node.as_str())
            },
        );
        match made {
            Made::Create(mut spec) => {
                spec.on_delete = on_delete;
                // The class's Secrets, named for each family (a template names none
                // of its own).
                if let Some(class) = spec
                    .class
                    .as_ref()
                    .and_then(|n| self.classes.iter().find(|c| &c.metadata.name == n))
                {
                    spec.secret_refs = Rare::new(class.spec.secret_refs.clone());
                }
                Made::Create(spec)
            }
            Made::Update(spec) => {
                match existing.and_then(|v| expansion_refused(&spec, &v.spec, self.classes)) {
                    Some(why) => Made::Deny(why),
                    None => Made::Update(spec),
                }
            }
            other => other,
        }
    }
}

/// The allocation's plan, from the caches and the volumes' whole objects where the
/// plan needs one the cache keeps only as a view.
async fn planned(
    ctx: &Ctx,
    alloc: &Allocation,
) -> Result<plan::allocation::AllocationPlan, StoreError> {
    let ns = &alloc.metadata.namespace;
    let capacities = capacities(ctx, alloc).await?;
    let templated = alloc.spec.volumes.iter().any(|r| r.template.is_some());
    let node = templated
        .then(|| ctx.nodes.get(&Node::key_for(&alloc.spec.node)))
        .flatten();
    let classes = if templated {
        ctx.classes.state()
    } else {
        Vec::new()
    };
    // A cordoned node takes no new claim, so no volume is made for one there either.
    let cordon = templated
        .then(|| ctx.cordons.get(&Cordon::key_for(&alloc.spec.node)))
        .flatten();
    let making = Making {
        ctx,
        alloc,
        node: node.as_deref(),
        classes: &classes,
        cordon: cordon.as_deref(),
        capacities: &capacities,
    };
    let made = |req: &VolumeRequest, tpl: &VolumeTemplate, existing: Option<&Volume>| {
        making.made(req, tpl, existing)
    };
    // The plan asks for the whole volume of a request it makes a claim or a volume for:
    // one the cache keeps only as a view (at rest) is read, and the plan made again.
    let mut read: HashMap<VolumeId, Option<Arc<Volume>>> = HashMap::new();
    Ok(loop {
        let unread = std::cell::RefCell::new(Vec::new());
        let plan = plan::allocation::converge(
            alloc,
            Timestamp::now(),
            |key| ctx.claims.get(key),
            |volume| ctx.volume(ns, volume).is_some(),
            |volume| match read.get(volume) {
                Some(whole) => whole.clone(),
                None => {
                    let view = ctx.volume(ns, volume)?;
                    if view.whole.is_none() {
                        unread.borrow_mut().push(volume.clone());
                    }
                    view.whole.clone()
                }
            },
            made,
        );
        let unread = unread.into_inner();
        if unread.is_empty() {
            break plan;
        }
        for id in unread {
            let whole = ctx.whole_volume(&Volume::key_for(ns, &id)).await?;
            read.insert(id, whole);
        }
    })
}

/// The volumes the plan makes, changes and deletes (a conflict or one already gone
/// is left to the next pass).
async fn write_volumes(
    ctx: &Ctx,
    alloc: &Allocation,
    plan: &plan::allocation::AllocationPlan,
) -> Result<(), StoreError> {
    for v in &plan.create_volumes {
        create_volume(ctx, alloc, v).await?;
    }
    for (old, next) in &plan.update_volumes {
        match ctx.writer.update(old, next).await {
            Ok(_) | Err(StoreError::Conflict { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    for old in &plan.delete {
        match ctx.writer.delete_read(old).await {
            Ok(_) | Err(StoreError::NotFound { .. }) | Err(StoreError::Conflict { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The claims the plan makes and the allocation's status, in one transaction where
/// they fit; `Some` when the pass ends early (the allocation changed under the status
/// write).
async fn write_claims(
    ctx: &Ctx,
    alloc: &Arc<Allocation>,
    create: Vec<Claim>,
    status: Option<AllocationStatus>,
) -> Result<Option<Action>, StoreError> {
    let claims: Vec<Claim> = create.into_iter().map(traced).collect();
    let mut status = status;
    let mut batched = false;
    if let Some(st) = status
        .as_ref()
        .filter(|_| !claims.is_empty() && claims.len() <= 32)
    {
        // The claims it makes and the status that says it saw them, in one
        // transaction: one revision and one round trip for what the next pass would
        // otherwise write after them. A claim already there, or an allocation changed
        // since it was read, fails the batch: each is then written on its own below.
        let store = ctx.writer.store();
        let mut batch = Batch::default();
        for claim in &claims {
            batch.create(store, claim)?;
        }
        let mut a = (**alloc).clone();
        a.status = st.clone();
        batch.update(store, alloc, &a)?;
        match ctx.writer.commit(batch).await {
            Ok(_) => (status, batched) = (None, true),
            Err(StoreError::Conflict { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    if !batched {
        for claim in &claims {
            match ctx.writer.create(claim).await {
                Ok(_) | Err(StoreError::AlreadyExists { .. }) => {}
                Err(e) => return Err(e),
            }
        }
    }
    if let Some(status) = status {
        let mut a = (**alloc).clone();
        a.status = status;
        match ctx.writer.update(alloc, &a).await {
            Ok(_) => {}
            Err(StoreError::Conflict { .. }) => {
                return Ok(Some(Action::Requeue(Duration::from_millis(50))))
            }
            Err(e) => return Err(e),
        }
    }
    Ok(None)
}

/// A claim to create, with the trace that starts with it: every step on it, in any
/// process, joins it.
fn traced(mut claim: Claim) -> Claim {
    let root = moor::telemetry::step_span(
        "claim created",
        &claim.key(),
        claim.spec.volume.as_str(),
        claim.spec.node.as_str(),
        None,
    );
    claim.metadata.trace = moor::telemetry::traceparent(&root).map(Into::into);
    claim
}

/// The capacity reports of the plugins whose templates have no volume yet (read only
/// then: once per volume made). An unreadable report is no report: the provisioner
/// checks again.
async fn capacities(
    ctx: &Ctx,
    alloc: &Allocation,
) -> Result<std::collections::BTreeMap<PluginId, Vec<CapacityEntry>>, StoreError> {
    let ns = &alloc.metadata.namespace;
    let mut capacities = std::collections::BTreeMap::new();
    for req in &alloc.spec.volumes {
        let Some(tpl) = req.template.as_deref() else {
            continue;
        };
        let missing = alloc
            .request_volume(req)
            .is_some_and(|v| ctx.volume(ns, &v).is_none());
        if missing && !capacities.contains_key(&tpl.plugin_id) {
            let report = match ctx.writer.store().capacity(&tpl.plugin_id).await {
                Ok(r) => r,
                Err(StoreError::Malformed { .. }) => None,
                Err(e) => return Err(e),
            };
            if let Some(report) = report {
                capacities.insert(tpl.plugin_id.clone(), report);
            }
        }
    }
    Ok(capacities)
}

/// Creates a volume an allocation's template makes, with a "Volume made from
/// template" event; one made by an earlier pass (its name is the allocation's and the
/// request's) is not made again.
async fn create_volume(ctx: &Ctx, alloc: &Allocation, v: &Volume) -> Result<(), StoreError> {
    match ctx.writer.create(v).await {
        Ok(_) => {
            let d = details([
                ("allocation", alloc.metadata.name.to_string()),
                ("volume_id", v.metadata.name.to_string()),
            ]);
            let lifecycle = v
                .spec
                .made_for
                .as_ref()
                .map(|m| m.lifecycle)
                .unwrap_or_default();
            ctx.recorder
                .record(
                    object_ref(alloc),
                    EventType::Normal,
                    "Volume made from template",
                    format!(
                        "volume {} ({lifecycle}) made for allocation {} on node {}",
                        v.metadata.name, alloc.metadata.name, alloc.spec.node
                    ),
                    d,
                )
                .await;
            Ok(())
        }
        Err(StoreError::AlreadyExists { .. }) => Ok(()),
        Err(e) => Err(e),
    }
}
