//! An allocation's decisions: whether its runner still runs it ([`liveness`]), the
//! claims it asks for and its phase ([`converge`]).

use moor::admission::Made;
use moor::api::*;
use std::sync::Arc;
use std::time::Duration;

/// Whether an allocation's runner still runs it, by its Lease (see `api::lease`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// Not judged by a lease: none is held for it, or it ended already.
    Untracked,
    /// Renewed; it expires after this long without another renewal.
    Live(Duration),
    /// Unrenewed for the lease's duration (or found so before): the workload is lost.
    Lost,
}

/// Judges an allocation's liveness from its lease and how long this process has seen
/// that lease go unrenewed. Once lost, always lost (the runner is gone; a new run is a
/// new allocation).
pub fn liveness(alloc: &Allocation, lease: Option<&Lease>, unrenewed_for: Duration) -> Liveness {
    if alloc.status.lost {
        return Liveness::Lost;
    }
    if alloc.spec.is_terminal() || alloc.is_deleting() {
        return Liveness::Untracked;
    }
    let Some(lease) = lease else {
        return Liveness::Untracked;
    };
    // The lease's duration, then the window the runner's guard gives the workload to
    // end: a claim is released only after every process of it is gone.
    let duration = lease.duration() + lease.workload_grace();
    if unrenewed_for >= duration {
        Liveness::Lost
    } else {
        Liveness::Live(duration - unrenewed_for)
    }
}

/// What one pass over an allocation does, in order: delete `delete`, create
/// `create`, write `status` when given, then look again after `requeue`.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct AllocationPlan {
    /// Released claims of an earlier run of the allocation (set back to `run`): each
    /// gives way to a new claim, admitted from scratch.
    pub delete: Vec<Arc<Claim>>,
    /// Claims to create: one per request of a running allocation that has none.
    pub create: Vec<Claim>,
    /// Volumes to make from a request's template (before its claim).
    pub create_volumes: Vec<Volume>,
    /// Retained volumes to grow to their template (as read, and as they should be).
    pub update_volumes: Vec<(Arc<Volume>, Volume)>,
    /// The allocation's status, when it changes.
    pub status: Option<AllocationStatus>,
    /// When to look again without a trigger: after a rerun's deletions (the new claims
    /// are made once the old ones are gone from the cache) or while a request waits
    /// for a volume (nothing here watches for it).
    pub requeue: Option<Duration>,
}

/// One claim per request, and the phase the claims sum up to. `claim` and `exists`
/// look up the caches; `volume` is the whole volume of a request without its claim
/// (what the claim is made from), and `made` judges a template request's (found or
/// not: `moor::admission::made`).
pub fn converge(
    alloc: &Allocation,
    now: Timestamp,
    claim: impl Fn(&ObjectKey<ClaimSpec>) -> Option<Arc<Claim>>,
    exists: impl Fn(&VolumeId) -> bool,
    volume: impl Fn(&VolumeId) -> Option<Arc<Volume>>,
    made: impl Fn(&VolumeRequest, &VolumeTemplate, Option<&Volume>) -> Made,
) -> AllocationPlan {
    let terminal = alloc.is_terminal() || alloc.is_deleting();
    // Stopping (its runner ends the workload): the claims it has stay, nothing new.
    let frozen = terminal || alloc.is_stopping();
    let mut pass = Pass::default();
    let looks = Looks {
        claim: &claim,
        exists: &exists,
        volume: &volume,
        made: &made,
    };
    for req in &alloc.spec.volumes {
        request(alloc, req, terminal, frozen, &looks, &mut pass);
    }
    settle(alloc, now, terminal, pass)
}

/// What the pass asks of the caches (and of the admission's template rules).
struct Looks<'a> {
    claim: &'a dyn Fn(&ObjectKey<ClaimSpec>) -> Option<Arc<Claim>>,
    exists: &'a dyn Fn(&VolumeId) -> bool,
    volume: &'a dyn Fn(&VolumeId) -> Option<Arc<Volume>>,
    made: &'a dyn Fn(&VolumeRequest, &VolumeTemplate, Option<&Volume>) -> Made,
}

/// What the requests came to: the plan, why the allocation waits, why a claim was
/// denied (shown on the allocation, no requeue: the claim's own changes bring it
/// back), and each request's claim phase.
#[derive(Default)]
struct Pass {
    plan: AllocationPlan,
    waiting: Vec<String>,
    denied: Vec<String>,
    phases: Vec<ClaimPhase>,
}

/// One request: its claim as found (ours, another allocation's, or none), or the claim
/// (and, from a template, the volume) to make; nothing made or run again when `frozen`.
fn request(
    alloc: &Allocation,
    req: &VolumeRequest,
    terminal: bool,
    frozen: bool,
    looks: &Looks<'_>,
    pass: &mut Pass,
) {
    let ns = &alloc.metadata.namespace;
    let (claim, made) = (looks.claim, looks.made);
    let Some(volume_id) = alloc.request_volume_in(req, looks.exists) else {
        pass.waiting.push(format!(
            "request {}: per_alloc volume name is too long",
            req.name
        ));
        return;
    };
    // The request's claim: under its name (or the name an earlier release gave
    // it), and only if its spec says it is this request's. A claim of another
    // allocation under the same name (one an earlier release made ambiguous) is
    // never taken, nor replaced.
    let names = alloc.claim_names(req);
    let found: Vec<Arc<Claim>> = names
        .iter()
        .filter_map(|n| claim(&Claim::key_for(&alloc.spec.node, ns, n)))
        .collect();
    let ours = found.iter().find(|c| alloc.owns(c)).cloned();
    if ours.is_none() {
        if let Some(c) = found
            .iter()
            .find(|c| Some(&c.metadata.name) == names.first())
        {
            pass.waiting.push(format!(
                "request {}: claim {} is allocation {}'s request {}",
                req.name, c.metadata.name, c.spec.allocation, c.spec.request
            ));
            return;
        }
    }
    if names.is_empty() {
        return;
    }
    if let Some(c) = ours {
        if !frozen && c.spec.release && c.status.phase == ClaimPhase::Released {
            pass.plan.delete.push(c);
            pass.phases.push(ClaimPhase::Pending);
        } else {
            pass.phases.push(c.status.phase);
            if c.status.phase == ClaimPhase::Denied && !terminal {
                pass.denied.push(format!(
                    "request {}: {}",
                    req.name,
                    c.status.reason.as_deref().unwrap_or("denied")
                ));
            }
        }
        return;
    }
    if frozen {
        return;
    }
    let found = (looks.volume)(&volume_id);
    if let Some(tpl) = req.template.as_deref() {
        if !template(ns, req, tpl, &volume_id, found.as_ref(), made, pass) {
            return;
        }
    }
    let Some(volume) = found else {
        // Named by request, as every reason here: `alloc run`, `mount adopt` and
        // describe show each request's own (they said "no claim yet").
        pass.waiting.push(format!(
            "request {}: volume {volume_id} does not exist",
            req.name
        ));
        return;
    };
    if let Some(c) = alloc.claim_for(req, &volume) {
        pass.plan.create.push(c);
        pass.phases.push(ClaimPhase::Pending);
    }
}

/// A template request's volume, as `made` judges it (`found`: the one there): made,
/// changed, waited for or denied. False when the request goes no further this pass.
fn template(
    ns: &Namespace,
    req: &VolumeRequest,
    tpl: &VolumeTemplate,
    volume_id: &VolumeId,
    found: Option<&Arc<Volume>>,
    made: &dyn Fn(&VolumeRequest, &VolumeTemplate, Option<&Volume>) -> Made,
    pass: &mut Pass,
) -> bool {
    match made(req, tpl, found.map(|v| v.as_ref())) {
        Made::Ready => {
            // Still being made after a retryable failure: the allocation says why.
            let p = found.map(|v| &v.status.provisioning);
            if let Some(err) = p
                .filter(|p| p.phase != VolumePhase::Ready)
                .and_then(|p| p.meta.last_error.as_deref())
            {
                pass.waiting.push(format!(
                    "request {}: volume {volume_id} is being made: {err}",
                    req.name
                ));
            }
        }
        Made::Update(spec) => {
            if let Some(v) = found {
                let mut next = (**v).clone();
                next.spec = spec;
                pass.plan.update_volumes.push((v.clone(), next));
            }
        }
        Made::Create(spec) => {
            pass.plan.create_volumes.push(Volume::new(
                ns,
                Name::new(volume_id.as_str()).unwrap_or_default(),
                spec,
            ));
            pass.waiting.push(format!(
                "request {}: volume {volume_id} is being made from its template",
                req.name
            ));
            return false;
        }
        Made::Wait(why) => {
            pass.waiting.push(format!("request {}: {why}", req.name));
            return false;
        }
        Made::Deny(why) => {
            pass.waiting.push(format!("request {}: {why}", req.name));
            pass.phases.push(ClaimPhase::Denied);
            return false;
        }
    }
    true
}

/// The allocation's status from what its requests came to, and when to look again.
fn settle(alloc: &Allocation, now: Timestamp, terminal: bool, pass: Pass) -> AllocationPlan {
    let Pass {
        mut plan,
        waiting,
        denied,
        phases,
    } = pass;
    let mut status = alloc.status.clone();
    status.phase = phase(terminal, waiting.is_empty(), &phases);
    // The retention counts from the first pass that saw it Released.
    status.released_at = match status.phase {
        AllocationPhase::Released => alloc.status.released_at.or(Some(now)),
        _ => None,
    };
    status.meta.observed_generation = alloc.metadata.generation;
    let reasons: Vec<String> = waiting.iter().chain(&denied).cloned().collect();
    status.meta.last_error = (!reasons.is_empty()).then(|| reasons.join("; "));
    plan.status = (status != alloc.status).then_some(status);
    plan.requeue = if !plan.delete.is_empty() || !plan.create_volumes.is_empty() {
        Some(Duration::from_millis(100))
    } else if !waiting.is_empty() {
        Some(Duration::from_secs(2))
    } else {
        None
    };
    plan
}

/// When ended work is collected: the workload module's rule.
pub use moor::workload::{collect, Collect};

/// The allocation's phase from its claims' (one per request that has or gets one).
pub fn phase(terminal: bool, none_waiting: bool, claims: &[ClaimPhase]) -> AllocationPhase {
    if terminal {
        if claims.iter().all(|p| *p == ClaimPhase::Released) {
            AllocationPhase::Released
        } else {
            AllocationPhase::Releasing
        }
    } else if claims.contains(&ClaimPhase::Denied) {
        AllocationPhase::Blocked
    } else if none_waiting && claims.iter().all(|p| *p == ClaimPhase::Published) {
        AllocationPhase::Ready
    } else {
        AllocationPhase::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn running_alloc() -> Allocation {
        Allocation::new(
            &Namespace::default_ns(),
            Name::new("a1").unwrap(),
            AllocationSpec::default(),
        )
    }

    fn runner_lease(seconds: u64) -> Lease {
        Lease::new(
            &Namespace::default_ns(),
            Name::new("a1").unwrap(),
            LeaseSpec {
                holder: "moorctl@h/1".into(),
                duration_seconds: seconds,
                ..Default::default()
            },
        )
    }

    #[test]
    fn an_allocation_is_lost_when_its_lease_goes_unrenewed_for_its_duration_and_the_guard_s_grace()
    {
        let a = running_alloc();
        let l = runner_lease(30);
        // 30 s, then the guard's 10 s (a third, at most 10 s).
        assert_eq!(
            liveness(&a, Some(&l), Duration::from_secs(10)),
            Liveness::Live(Duration::from_secs(30))
        );
        assert!(matches!(
            liveness(&a, Some(&l), Duration::from_secs(39)),
            Liveness::Live(_)
        ));
        assert_eq!(
            liveness(&a, Some(&l), Duration::from_secs(40)),
            Liveness::Lost
        );
        let short = runner_lease(3);
        assert!(matches!(
            liveness(&a, Some(&short), Duration::from_millis(3_900)),
            Liveness::Live(_)
        ));
        assert_eq!(
            liveness(&a, Some(&short), Duration::from_secs(4)),
            Liveness::Lost
        );
        // Without a lease nothing judges it.
        assert_eq!(
            liveness(&a, None, Duration::from_secs(99)),
            Liveness::Untracked
        );
    }

    #[test]
    fn an_ended_allocation_is_not_judged_and_a_lost_one_stays_lost() {
        let l = runner_lease(3);
        let mut a = running_alloc();
        a.spec.client_status = ClientStatus::Complete;
        assert_eq!(
            liveness(&a, Some(&l), Duration::from_secs(60)),
            Liveness::Untracked
        );
        let mut a = running_alloc();
        a.spec.desired_status = DesiredStatus::Stop;
        assert_eq!(
            liveness(&a, Some(&l), Duration::from_secs(60)),
            Liveness::Untracked
        );
        let mut a = running_alloc();
        a.status.lost = true;
        assert_eq!(liveness(&a, None, Duration::ZERO), Liveness::Lost);
        assert!(a.is_terminal());
        assert_eq!(a.client_status(), ClientStatus::Lost);
    }

    fn alloc_with(requests: &[(&str, &str, bool)]) -> Allocation {
        let mut a = running_alloc();
        a.spec.node = NodeName::new("n1").unwrap();
        a.metadata.generation = 1;
        a.spec.volumes = requests
            .iter()
            .map(|(name, volume, per_alloc)| VolumeRequest {
                name: Name::new(*name).unwrap(),
                volume: VolumeId::new(*volume).unwrap(),
                per_alloc: *per_alloc,
                ..Default::default()
            })
            .collect();
        a
    }

    fn volume(name: &str) -> Arc<Volume> {
        let mut v = Volume::new(
            &Namespace::default_ns(),
            Name::new(name).unwrap(),
            VolumeSpec {
                plugin_id: PluginId::new("p").unwrap(),
                ..Default::default()
            },
        );
        v.metadata.uid = format!("uid-{name}").into();
        Arc::new(v)
    }

    type Claims = HashMap<String, Arc<Claim>>;

    fn plan(a: &Allocation, claims: &Claims, volumes: &[&str]) -> AllocationPlan {
        let volumes: HashMap<String, Arc<Volume>> =
            volumes.iter().map(|v| (v.to_string(), volume(v))).collect();
        converge(
            a,
            Timestamp::now(),
            |k| claims.get(k.as_str()).cloned(),
            |v| volumes.contains_key(v.as_str()),
            |v| volumes.get(v.as_str()).cloned(),
            |_, _, _| Made::Ready,
        )
    }

    #[test]
    fn a_template_request_makes_its_volume_first_then_claims_it() {
        let mut a = alloc_with(&[]);
        a.spec.volumes.push(VolumeRequest {
            name: Name::new("scratch").unwrap(),
            template: Some(Box::new(VolumeTemplate {
                plugin_id: PluginId::new("p").unwrap(),
                ..Default::default()
            })),
            ..Default::default()
        });
        let claims = Claims::new();
        let spec = |_: &VolumeRequest, t: &VolumeTemplate, _: Option<&Volume>| {
            Made::Create(t.volume_spec(&VolumeRequest::default(), None, MadeFor::default()))
        };
        let p = converge(
            &a,
            Timestamp::now(),
            |k| claims.get(k.as_str()).cloned(),
            |_| false,
            |_| None,
            spec,
        );
        assert_eq!(p.create_volumes.len(), 1);
        assert_eq!(p.create_volumes[0].metadata.name.as_str(), "a1.scratch");
        assert!(p.create.is_empty(), "no claim before its volume");
        assert!(p.requeue.is_some());
        // Made: the claim, on that volume.
        let made = volume("a1.scratch");
        let p = converge(
            &a,
            Timestamp::now(),
            |k| claims.get(k.as_str()).cloned(),
            |_| true,
            |_| Some(made.clone()),
            |_, _, _| Made::Ready,
        );
        assert!(p.create_volumes.is_empty());
        assert_eq!(p.create[0].spec.volume.as_str(), "a1.scratch");
        // Refused: no claim, the allocation Blocked with the reason.
        let p = converge(
            &a,
            Timestamp::now(),
            |k| claims.get(k.as_str()).cloned(),
            |_| false,
            |_| None,
            |_, _, _| Made::Deny("too big".into()),
        );
        let status = p.status.unwrap();
        assert_eq!(status.phase, AllocationPhase::Blocked);
        assert!(status.meta.last_error.unwrap().contains("too big"));
        assert!(p.create.is_empty() && p.create_volumes.is_empty());
    }

    fn with_phase(c: &Claim, phase: ClaimPhase, release: bool) -> Arc<Claim> {
        let mut c = c.clone();
        c.status.phase = phase;
        c.spec.release = release;
        Arc::new(c)
    }

    #[test]
    fn each_request_gets_one_claim_and_the_phase_follows_the_claims() {
        let a = alloc_with(&[("data", "v1", false), ("logs", "v2", true)]);
        let p = plan(&a, &Claims::new(), &["v1", "v2-a1"]);
        let names: Vec<_> = p.create.iter().map(|c| c.key()).collect();
        assert_eq!(
            names,
            ["claims/n1/default/a1.data", "claims/n1/default/a1.logs"]
        );
        assert_eq!(p.create[1].spec.volume.as_str(), "v2-a1", "per_alloc");
        assert_eq!(p.status.as_ref().unwrap().phase, AllocationPhase::Pending);
        assert_eq!(p.requeue, None);
        // Both published: Ready; one denied: Blocked.
        let claims: Claims = p
            .create
            .iter()
            .map(|c| (c.key(), with_phase(c, ClaimPhase::Published, false)))
            .collect();
        let p2 = plan(&a, &claims, &["v1", "v2-a1"]);
        assert!(p2.create.is_empty() && p2.delete.is_empty());
        assert_eq!(p2.status.unwrap().phase, AllocationPhase::Ready);
        let mut denied = claims.clone();
        let c = &p.create[0];
        denied.insert(c.key(), with_phase(c, ClaimPhase::Denied, false));
        assert_eq!(
            plan(&a, &denied, &["v1"]).status.unwrap().phase,
            AllocationPhase::Blocked
        );
    }

    #[test]
    fn an_unchanged_status_is_not_written_again() {
        let a = alloc_with(&[("data", "v1", false)]);
        let first = plan(&a, &Claims::new(), &["v1"]);
        let mut written = a.clone();
        written.status = first.status.unwrap();
        let claims: Claims = first
            .create
            .iter()
            .map(|c| (c.key(), Arc::new(c.clone())))
            .collect();
        // The same pass after its own status write: nothing to write, nothing to make.
        assert_eq!(plan(&written, &claims, &["v1"]), AllocationPlan::default());
    }

    #[test]
    fn a_missing_volume_waits_and_is_looked_at_again() {
        let a = alloc_with(&[("data", "v1", false)]);
        let p = plan(&a, &Claims::new(), &[]);
        assert!(p.create.is_empty());
        let st = p.status.unwrap();
        assert_eq!(st.phase, AllocationPhase::Pending);
        assert_eq!(
            st.meta.last_error.as_deref(),
            Some("request data: volume v1 does not exist")
        );
        // What `alloc run`, `mount adopt` and describe show for the request (issue 78,
        // item 2: "no claim yet").
        assert_eq!(
            moor::workload::reason_for(
                st.meta.last_error.as_deref().unwrap(),
                &Name::new("data").unwrap()
            ),
            Some("volume v1 does not exist".to_string())
        );
        assert_eq!(p.requeue, Some(Duration::from_secs(2)));
    }

    #[test]
    fn a_terminal_allocation_makes_no_claim_and_is_released_when_its_claims_are() {
        let mut a = alloc_with(&[("data", "v1", false), ("logs", "v2", false)]);
        let made = plan(&a, &Claims::new(), &["v1", "v2"]).create;
        a.spec.desired_status = DesiredStatus::Stop;
        // One request never got a claim: nothing is made for it now.
        let mut claims: Claims = [(
            made[0].key(),
            with_phase(&made[0], ClaimPhase::Releasing, true),
        )]
        .into_iter()
        .collect();
        let p = plan(&a, &claims, &["v1", "v2"]);
        assert!(p.create.is_empty() && p.delete.is_empty());
        assert_eq!(p.status.unwrap().phase, AllocationPhase::Releasing);
        claims.insert(
            made[0].key(),
            with_phase(&made[0], ClaimPhase::Released, true),
        );
        assert_eq!(
            plan(&a, &claims, &["v1", "v2"]).status.unwrap().phase,
            AllocationPhase::Released
        );
    }

    #[test]
    fn a_stopping_allocation_keeps_its_claims_and_makes_or_reruns_none() {
        let mut a = alloc_with(&[("data", "v1", false), ("logs", "v2", false)]);
        let made = plan(&a, &Claims::new(), &["v1", "v2"]).create;
        a.spec.client_status = ClientStatus::Running;
        a.spec.desired_status = DesiredStatus::Stop;
        assert!(a.is_stopping() && !a.is_terminal());
        // One claim published, one released by an earlier run: the first stays (the
        // allocation still wants it), the second is not run again, none is made.
        let published = with_phase(&made[0], ClaimPhase::Published, false);
        let released = with_phase(&made[1], ClaimPhase::Released, true);
        assert!(a.wants(&published));
        let claims: Claims = [(published.key(), published), (released.key(), released)]
            .into_iter()
            .collect();
        let p = plan(&a, &claims, &["v1", "v2"]);
        assert!(p.create.is_empty() && p.delete.is_empty(), "{p:?}");
        // Past the stop's bound (the controller's stop_expired), or with its end
        // recorded, it is terminal: its claims go.
        a.status.stop_expired = true;
        assert!(a.is_terminal() && !a.is_stopping());
        a.status.stop_expired = false;
        a.spec.client_status = ClientStatus::Failed;
        assert!(a.is_terminal() && !a.is_stopping());
        // Never started: a stop is terminal at once.
        a.spec.client_status = ClientStatus::Pending;
        assert!(a.is_terminal());
    }

    #[test]
    fn a_rerun_replaces_the_released_claims_of_the_earlier_run() {
        let a = alloc_with(&[("data", "v1", false)]);
        let made = plan(&a, &Claims::new(), &["v1"]).create;
        let old = with_phase(&made[0], ClaimPhase::Released, true);
        let claims: Claims = [(old.key(), old.clone())].into_iter().collect();
        let p = plan(&a, &claims, &["v1"]);
        assert_eq!(p.delete, vec![old.clone()]);
        assert!(p.create.is_empty(), "made once the old one is gone");
        assert_eq!(p.requeue, Some(Duration::from_millis(100)));
        // A claim still releasing is waited for, not replaced.
        let releasing = with_phase(&made[0], ClaimPhase::Releasing, true);
        let claims: Claims = [(releasing.key(), releasing)].into_iter().collect();
        assert!(plan(&a, &claims, &["v1"]).delete.is_empty());
    }

    #[test]
    fn a_per_alloc_name_past_the_id_rule_is_cut_with_a_hash() {
        let long = "v".repeat(120);
        let mut a = alloc_with(&[("data", &long, true)]);
        a.metadata.name = Name::new("a".repeat(20)).unwrap();
        let id = a.request_volume(&a.spec.volumes[0]).unwrap();
        assert!(
            id.as_str().len() <= 128 && !id.as_str().contains('.'),
            "{id}"
        );
        let p = plan(&a, &Claims::new(), &[]);
        assert!(p.create.is_empty());
        let why = p.status.unwrap().meta.last_error.unwrap();
        assert!(
            why.contains(&format!("volume {id} does not exist")),
            "{why}"
        );
    }

    #[test]
    fn an_ended_released_allocation_is_collected_after_its_retention() {
        let retention = Duration::from_secs(60);
        let t0 = Timestamp::now();
        let at = |secs| Timestamp::from_system(t0.system() + Duration::from_secs(secs));
        let mut a = alloc_with(&[]);
        a.spec.client_status = ClientStatus::Complete;
        // Its first pass as Released sets the time the retention counts from.
        let status = plan(&a, &Claims::new(), &[]).status.unwrap();
        assert_eq!(status.phase, AllocationPhase::Released);
        assert!(status.released_at.is_some());
        a.status = status;
        a.status.released_at = Some(t0);
        assert!(
            plan(&a, &Claims::new(), &[]).status.is_none(),
            "a second pass writes nothing"
        );
        assert_eq!(
            collect(&a, at(10), retention),
            Collect::After(Duration::from_secs(50))
        );
        assert_eq!(collect(&a, at(60), retention), Collect::Now);
        assert_eq!(collect(&a, at(61), Duration::ZERO), Collect::Now);
        // Not ended, or not yet released: kept, whatever the time.
        let mut running = a.clone();
        running.spec.client_status = ClientStatus::Running;
        assert_eq!(collect(&running, at(999), retention), Collect::Keep);
        let mut releasing = a.clone();
        releasing.status.phase = AllocationPhase::Releasing;
        assert_eq!(collect(&releasing, at(999), retention), Collect::Keep);
        // Run again: no longer Released, and the time is dropped.
        let status = plan(&running, &Claims::new(), &[]).status.unwrap();
        assert_eq!(status.released_at, None);
    }
}
