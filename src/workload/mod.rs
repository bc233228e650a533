//! A workload's life, as every front door shares it: `moorctl alloc run`, the Docker and
//! Podman volume-plugin endpoint and its forgotten-mount rule, `moorctl alloc stop`.
//! Nothing outside this module creates, adopts or ends an allocation for a workload.
//!
//! Expected flow:
//! 1. [`create_or_adopt`]: the allocation a front door wants is created, or the stored
//!    one of that name adopted when it is live and on the same node; one that ended is
//!    refused ([`IfEnded::Refuse`]: `alloc run`) or deleted and made again
//!    ([`IfEnded::Replace`]: an engine's caller whose earlier mount ended).
//! 2. [`wait_published`]: the allocation and its claims are read ([`Observe`]: the
//!    store by default; a front door may answer from state of its own) until every
//!    claim is Published and its Mount says where ([`Published::paths`]). A denied
//!    claim, a request blocked for good, an allocation ended or deleted meanwhile, or
//!    the timeout is a [`WorkloadError`] that says why ([`judge_published`], pure).
//! 3. [`end`]: one write for every way a workload ends ([`End`]): desired `stop`, and
//!    the client status and exit when the workload ended. The first end's client
//!    status stands.
//! 4. [`wait_released`]: until every claim is Released (or gone).
//! 5. Ended work is kept for a retention, then collected by the controller
//!    ([`collect`], pure).
//!
//! # Layout
//! - `mod.rs`: creation and adoption, the waits and their verdicts, the end, collection.
//! - `cgroup`: the workload's own cgroup (v2): `moorctl alloc run` makes it and runs
//!   the workload in it, records it on the allocation (`spec.workload_cgroup`), and the
//!   node's agent ends what is left in it before it unpublishes the allocation's
//!   volumes, also when both moorctl processes were killed.
//! - `holders`: which processes use a mount (from /proc, as `fuser -m`), listed on an
//!   orphaned Mount so that `moorctl mount release` refuses while any does.

use std::future::Future;
use std::time::Duration;

use crate::api::*;
use crate::backoff::Backoff;
use crate::store::{ConflictRetry, Store, StoreError};

pub mod cgroup;
pub mod holders;

/// What [`create_or_adopt`] does with a stored allocation of the name that ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IfEnded {
    /// Refuse the start: the name belongs to work that ended (`alloc run`: a new run is
    /// a new allocation, or the old one deleted first).
    Refuse,
    /// Delete it (at the version read, while it is still ended) and create the wanted
    /// one: the same caller mounting again after an earlier mount ended.
    Replace,
}

/// How a start went.
#[derive(Debug, Clone)]
pub enum Started {
    /// The wanted allocation was created (by this call, or by an earlier try of the
    /// same start whose answer was lost).
    Created(Allocation),
    /// A live allocation of the name on the same node was taken over.
    Adopted(Allocation),
}

impl Started {
    /// The allocation, either way.
    pub fn allocation(&self) -> &Allocation {
        match self {
            Started::Created(a) | Started::Adopted(a) => a,
        }
    }
}

/// Why a start or a wait did not go ahead.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// A refusal a person acts on (the reason, whole).
    #[error("{0}")]
    Refused(String),
    /// The wait ran out; the last progress line says where things stood.
    #[error("timed out after {} waiting for the claims to be {goal:?}: {last}", humantime::format_duration(*.after))]
    TimedOut {
        /// How long it waited.
        after: Duration,
        /// Published or Released.
        goal: ClaimPhase,
        /// The last progress line.
        last: String,
    },
    /// The store, past what is waited out.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Creates `wanted`, or adopts the stored allocation of its name when it is live
/// (neither ended nor being deleted) and on the same node; one that ended is handled
/// as `if_ended` says. `retrying`: an earlier call of this same start may have created
/// it and lost the answer, so a stored allocation with exactly the wanted spec is
/// this start's own. Races with another writer are looked at again, bounded.
pub async fn create_or_adopt(
    store: &Store,
    wanted: &Allocation,
    if_ended: IfEnded,
    retrying: bool,
) -> Result<Started, WorkloadError> {
    let key = wanted.object_key();
    let mut retry = ConflictRetry::default();
    loop {
        let raced = match store.try_get(&key).await? {
            None => match store.create(wanted).await {
                Ok(a) => return Ok(Started::Created(a)),
                Err(e @ StoreError::AlreadyExists { .. }) => e,
                Err(e) => return Err(e.into()),
            },
            Some(a) if retrying && a.spec == wanted.spec && !a.is_terminal() => {
                return Ok(Started::Created(a))
            }
            Some(a) => match adoption(&a, wanted, if_ended) {
                Adoption::Adopt => return Ok(Started::Adopted(a)),
                Adoption::Refuse(why) => {
                    return Err(WorkloadError::Refused(format!(
                        "allocation {} exists and cannot be adopted: {why}",
                        a.metadata.name
                    )))
                }
                Adoption::Replace => match store.delete_read(&a).await {
                    Ok(_) | Err(StoreError::NotFound { .. }) => continue,
                    Err(e @ StoreError::Conflict { .. }) => e,
                    Err(e) => return Err(e.into()),
                },
            },
        };
        if !retry.again().await {
            return Err(raced.into());
        }
    }
}

/// What a start does with the stored allocation `found` of the wanted one's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Adoption {
    /// Take it over.
    Adopt,
    /// Delete it and create the wanted one.
    Replace,
    /// Refuse, for this reason.
    Refuse(String),
}

/// The adoption rule, pure: a live allocation on the wanted node is adopted; one
/// being deleted is refused; one that ended is refused or replaced as `if_ended`
/// says; a live one on another node is refused.
pub fn adoption(found: &Allocation, wanted: &Allocation, if_ended: IfEnded) -> Adoption {
    if found.is_deleting() {
        return Adoption::Refuse("it is being deleted".into());
    }
    if found.is_terminal() {
        return match if_ended {
            IfEnded::Replace => Adoption::Replace,
            IfEnded::Refuse => Adoption::Refuse(format!(
                "it has ended (desired {:?}, client {:?})",
                found.spec.desired_status,
                found.client_status()
            )),
        };
    }
    if found.spec.node != wanted.spec.node {
        return Adoption::Refuse(format!(
            "it runs on node {}, not {}",
            found.spec.node, wanted.spec.node
        ));
    }
    Adoption::Adopt
}

/// How an allocation ends.
#[derive(Debug, Clone, PartialEq)]
pub enum End {
    /// Stopped from outside (`moorctl alloc stop`): desired `stop`; the client status
    /// stays its runner's to report.
    Stop,
    /// The workload ended (or never started): desired `stop` with its client status
    /// (complete or failed) and, when known, how it exited.
    Ended(ClientStatus, Option<ClientExit>),
}

/// The end `how` applied to `spec`; whether it changed anything. The first end's
/// client status and exit stand (an Unmount after the caller was found gone, a second
/// stop): an end never rewrites a terminal client status.
pub fn apply_end(spec: &mut AllocationSpec, how: &End) -> bool {
    let before = (spec.desired_status, spec.client_status, spec.exit.clone());
    spec.desired_status = DesiredStatus::Stop;
    if let End::Ended(status, exit) = how {
        let terminal = matches!(
            spec.client_status,
            ClientStatus::Complete | ClientStatus::Failed | ClientStatus::Lost
        );
        if !terminal {
            spec.client_status = *status;
            spec.exit = exit.clone();
        }
    }
    before != (spec.desired_status, spec.client_status, spec.exit.clone())
}

/// Ends the allocation at `key` as `how` says, in one write (none when it had ended
/// so already); whether it wrote. Not found is the store's error.
pub async fn end(
    store: &Store,
    key: &ObjectKey<AllocationSpec>,
    how: End,
) -> Result<bool, StoreError> {
    let (_, wrote) = store.modify_spec(key, |s| apply_end(s, &how)).await?;
    Ok(wrote)
}

/// [`end`], only while `still` holds of the allocation as read: the write is guarded by
/// that read, so a change made in between is read again. Whether it wrote.
pub async fn end_if(
    store: &Store,
    key: &ObjectKey<AllocationSpec>,
    how: End,
    still: impl Fn(&Allocation) -> bool,
) -> Result<bool, StoreError> {
    let mut retry = ConflictRetry::default();
    loop {
        let Some(read) = store.try_get(key).await? else {
            return Ok(false);
        };
        if !still(&read) {
            return Ok(false);
        }
        let mut next = read.clone();
        if !apply_end(&mut next.spec, &how) || next.spec == read.spec {
            return Ok(false);
        }
        match store.update(&read, &next).await {
            Ok(_) => return Ok(true),
            Err(StoreError::Conflict { .. }) if retry.again().await => {}
            Err(e) => return Err(e),
        }
    }
}

/// Marks the allocation at `key` running, with the cgroup its workload runs in.
pub async fn set_running(
    store: &Store,
    key: &ObjectKey<AllocationSpec>,
    cgroup: Option<String>,
) -> Result<(), StoreError> {
    store
        .modify_spec(key, |s: &mut AllocationSpec| {
            let before = (s.client_status, s.workload_cgroup.clone());
            s.client_status = ClientStatus::Running;
            s.workload_cgroup = cgroup.clone();
            before != (s.client_status, s.workload_cgroup.clone())
        })
        .await?;
    Ok(())
}

/// Where a wait reads an allocation, its claims and their Mounts: the store, or a
/// front door's own view of its node (the endpoint's agent watches them already).
pub trait Observe: Sync {
    /// The allocation at `key`, if stored.
    fn allocation(
        &self,
        key: &ObjectKey<AllocationSpec>,
    ) -> impl Future<Output = Result<Option<Allocation>, StoreError>> + Send;
    /// The claim at `key`, if stored.
    fn claim(
        &self,
        key: &ObjectKey<ClaimSpec>,
    ) -> impl Future<Output = Result<Option<Claim>, StoreError>> + Send;
    /// The Mount at `key`, if stored.
    fn mount(
        &self,
        key: &ObjectKey<MountSpec>,
    ) -> impl Future<Output = Result<Option<Mount>, StoreError>> + Send;
}

impl Observe for Store {
    async fn allocation(
        &self,
        key: &ObjectKey<AllocationSpec>,
    ) -> Result<Option<Allocation>, StoreError> {
        self.try_get(key).await
    }

    async fn claim(&self, key: &ObjectKey<ClaimSpec>) -> Result<Option<Claim>, StoreError> {
        self.try_get(key).await
    }

    async fn mount(&self, key: &ObjectKey<MountSpec>) -> Result<Option<Mount>, StoreError> {
        self.try_get(key).await
    }
}

/// Where one request's volume is on the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestPaths {
    /// The published path (a file system) or device file (a block volume).
    pub target_path: String,
    /// The staging path, when the plugin stages.
    pub staging_path: Option<String>,
}

/// An allocation as a wait sees it: its claims by request (absent: not made yet) and
/// the paths of the requests whose Mount says published.
#[derive(Debug, Clone)]
pub struct Seen {
    /// The allocation.
    pub alloc: Allocation,
    /// Each request's claim, in request order.
    pub claims: Vec<(Name, Option<Claim>)>,
    /// The paths of the published requests, in request order.
    pub paths: Vec<(Name, RequestPaths)>,
    /// With [`Paths::OnNode`]: the requests whose claim, or its Mount, shows a step
    /// the plugin refused for good (a final answer: FailedPrecondition,
    /// InvalidArgument, ...), with that failure.
    pub refused: Vec<(Name, String)>,
}

/// Which requests' paths a look reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Paths {
    /// None: a wait for Released.
    None,
    /// Those of Published claims whose Mount says published.
    Published,
    /// Those whose Mount says published for the claim as it is now (same uid, no
    /// release asked), Published or not yet: NodePublish returned OK for it, which is
    /// all a caller on that node needs; the controller's Published comes a round trip
    /// later ([`wait_node_published`]).
    OnNode,
}

/// Reads the allocation at `key`, each request's claim (under its name, or the one an
/// earlier release gave it, if its spec says it is this request's) and the Mounts
/// `paths` asks for. `None` once the allocation is gone.
pub async fn look(
    obs: &impl Observe,
    key: &ObjectKey<AllocationSpec>,
    paths: Paths,
) -> Result<Option<Seen>, StoreError> {
    let Some(alloc) = obs.allocation(key).await? else {
        return Ok(None);
    };
    seen_paths(obs, alloc, paths).await.map(Some)
}

/// [`look`] for an allocation already read: its claims and, with `with_paths`, the
/// paths of the published ones.
pub async fn seen(
    obs: &impl Observe,
    alloc: Allocation,
    with_paths: bool,
) -> Result<Seen, StoreError> {
    let paths = if with_paths {
        Paths::Published
    } else {
        Paths::None
    };
    seen_paths(obs, alloc, paths).await
}

/// [`seen`] with the paths `which` asks for.
pub async fn seen_paths(
    obs: &impl Observe,
    alloc: Allocation,
    which: Paths,
) -> Result<Seen, StoreError> {
    let mut claims = Vec::new();
    let mut paths = Vec::new();
    let mut refused = Vec::new();
    let final_failure = |meta: &StatusMeta| {
        meta.retry.as_ref().filter(|f| f.final_answer).map(|f| {
            format!(
                "{} was refused for good with {}: {}",
                f.step,
                f.code,
                printable(&f.message)
            )
        })
    };
    for req in &alloc.spec.volumes {
        let mut found = None;
        // The Mount of the claim under its first name is read with it (one round
        // trip); under another name, after.
        let mut first_mount: Option<Option<Mount>> = None;
        for (i, name) in alloc.claim_names(req).into_iter().enumerate() {
            let key = Claim::key_for(&alloc.spec.node, &alloc.metadata.namespace, &name);
            let claim = if i == 0 && which != Paths::None {
                let mount_key = Mount::key_for(&key);
                let (c, m) = tokio::join!(obs.claim(&key), obs.mount(&mount_key));
                first_mount = Some(m?);
                c?
            } else {
                obs.claim(&key).await?
            };
            if let Some(c) = claim {
                if alloc.owns(&c) {
                    found = Some(c);
                    break;
                }
            }
            // Not this request's claim: its Mount is not either.
            first_mount = None;
        }
        if let Some(c) = found.as_ref().filter(|_| which != Paths::None) {
            let wanted = match which {
                Paths::None => false,
                Paths::Published => c.status.phase == ClaimPhase::Published,
                Paths::OnNode => {
                    c.status.phase != ClaimPhase::Denied && !c.spec.release && !c.is_deleting()
                }
            };
            if which == Paths::OnNode {
                if let Some(why) = final_failure(&c.status.meta) {
                    refused.push((req.name.clone(), why));
                }
            }
            if wanted {
                let mount = match first_mount.take() {
                    Some(m) => m,
                    None => obs.mount(&Mount::key_for(&c.object_key())).await?,
                };
                if let Some(m) = mount {
                    let same_claim = which == Paths::Published
                        || (m.spec.claim_uid == c.metadata.uid && !m.status.released);
                    if which == Paths::OnNode && same_claim && !m.status.published {
                        if let Some(why) = final_failure(&m.status.meta) {
                            refused.push((req.name.clone(), why));
                        }
                    }
                    if m.status.published && same_claim {
                        paths.push((
                            req.name.clone(),
                            RequestPaths {
                                target_path: m.spec.target_path.clone(),
                                staging_path: m.spec.staging_path.clone(),
                            },
                        ));
                    }
                }
            }
        }
        claims.push((req.name.clone(), found));
    }
    Ok(Seen {
        alloc,
        claims,
        paths,
        refused,
    })
}

impl Seen {
    /// One line on where the allocation and each claim short of `goal` stand: the
    /// phase, a waiting claim's reason, its failing step, last error and next retry; a
    /// request without a claim says why when the allocation does.
    pub fn progress(&self, goal: ClaimPhase) -> String {
        let alloc = &self.alloc;
        let mut line = format!(
            "allocation {}: {:?}",
            alloc.metadata.name, alloc.status.phase
        );
        let why = alloc
            .status
            .meta
            .last_error
            .as_deref()
            .filter(|_| self.claims.iter().any(|(_, c)| c.is_none()));
        for (req, claim) in &self.claims {
            match claim {
                None => match why.and_then(|w| reason_for(w, req)) {
                    Some(reason) => line.push_str(&format!("; {req}: {}", printable(&reason))),
                    None => line.push_str(&format!("; {req}: no claim yet")),
                },
                Some(c) if c.status.phase == goal => {}
                Some(c) => {
                    line.push_str(&format!("; {req}: {:?}", c.status.phase));
                    if let Some(r) = &c.status.reason {
                        line.push_str(&format!(" ({})", printable(r)));
                    }
                    // The next try's time, not a countdown: a line changes only when
                    // where things stand does (a countdown printed one a second).
                    if let Some(f) = &c.status.meta.retry {
                        line.push_str(&format!(
                            "; {} failed {}x with {}: {}; next try at {}",
                            f.step,
                            f.attempts,
                            f.code,
                            printable(&f.message),
                            humantime::format_rfc3339_seconds(f.next_retry.system())
                        ));
                    } else if let Some(e) = &c.status.meta.last_error {
                        line.push_str(&format!("; last error: {}", printable(e)));
                    }
                }
            }
        }
        line
    }
}

/// What the allocation's `last_error` (its reasons joined by `; `) says about request
/// `req`: the part naming it.
pub fn reason_for(last_error: &str, req: &Name) -> Option<String> {
    let named = format!("request {req}: ");
    last_error
        .split("; ")
        .find(|part| part.starts_with(&named))
        .map(|part| part[named.len()..].to_string())
}

/// The verdict of a wait for Published on what it saw, pure: `None` to wait on;
/// `Some(Ok)` once every claim is Published with its Mount's paths; `Some(Err)` with
/// the reason when it never will be (deleted, ended, a claim denied, a request
/// blocked for this spec with no claim: its template's volume refused for good).
pub fn judge_published(seen: Option<&Seen>) -> Option<Result<(), String>> {
    let Some(seen) = seen else {
        return Some(Err("the allocation was deleted".into()));
    };
    let alloc = &seen.alloc;
    if alloc.is_terminal() || alloc.is_deleting() {
        return Some(Err(format!(
            "allocation {} ended before its volumes were published",
            alloc.metadata.name
        )));
    }
    let denied = seen.claims.iter().find_map(|(r, c)| {
        c.as_ref()
            .filter(|c| c.status.phase == ClaimPhase::Denied)
            .map(|c| (r, c))
    });
    if let Some((req, c)) = denied {
        return Some(Err(format!(
            "request {req} was denied: {}",
            printable(c.status.reason.as_deref().unwrap_or("no reason given"))
        )));
    }
    let current = alloc.status.meta.observed_generation == alloc.metadata.generation;
    if current && alloc.status.phase == AllocationPhase::Blocked {
        let blocked = seen.claims.iter().find_map(|(r, c)| {
            let why = alloc.status.meta.last_error.as_deref()?;
            c.is_none()
                .then(|| reason_for(why, r).map(|w| (r, w)))
                .flatten()
        });
        if let Some((req, why)) = blocked {
            return Some(Err(format!(
                "request {req} is blocked: {}",
                printable(&why)
            )));
        }
    }
    let published = !seen.claims.is_empty()
        && seen.paths.len() == seen.claims.len()
        && seen.claims.iter().all(|(_, c)| c.is_some());
    let nothing_to_publish =
        alloc.spec.volumes.is_empty() && alloc.status.phase == AllocationPhase::Ready;
    (published || nothing_to_publish).then_some(Ok(()))
}

/// The verdict of [`wait_node_published`], pure: [`judge_published`], and a request
/// whose step the plugin refused for good ends the wait at once (a caller would wait
/// for the cap of the retry schedule otherwise).
pub fn judge_node_published(seen: Option<&Seen>) -> Option<Result<(), String>> {
    if let Some((req, why)) = seen.and_then(|s| s.refused.first()) {
        return Some(Err(format!("request {req}: {why}")));
    }
    judge_published(seen)
}

/// The verdict of a wait for Released, pure: every claim Released or gone (or the
/// allocation gone).
pub fn judge_released(seen: Option<&Seen>) -> Option<Result<(), String>> {
    let Some(seen) = seen else {
        return Some(Ok(()));
    };
    seen.claims
        .iter()
        .all(|(_, c)| {
            c.as_ref()
                .is_none_or(|c| c.status.phase == ClaimPhase::Released)
        })
        .then_some(Ok(()))
}

/// An allocation whose every claim is Published, with each request's paths.
#[derive(Debug, Clone)]
pub struct Published {
    /// The allocation as last read.
    pub alloc: Allocation,
    /// Each request's paths, in request order.
    pub paths: Vec<(Name, RequestPaths)>,
}

/// How a wait paces and reports itself.
pub struct Pace<'a> {
    /// The pause between two looks.
    pub poll: Backoff,
    /// Called with each progress line that differs from the one before.
    pub progress: &'a mut (dyn FnMut(&str) + Send),
    /// Ends a pause early: whoever writes what the wait looks for bumps it (the
    /// endpoint's agent, after each Mount it writes).
    pub wake: Option<Wake>,
    /// How long the store may fail or not answer, without a break, before the wait
    /// gives up with [`WorkloadError::Store`] (a look that hangs counts from its start);
    /// `None`: until the wait's timeout.
    pub store_patience: Option<Duration>,
}

/// A signal that something a wait looks for may have changed: a counter its writer
/// bumps, each wait holding a receiver. Cheap to clone; bumping with nobody waiting
/// costs nothing.
#[derive(Debug, Clone)]
pub struct Wake(std::sync::Arc<tokio::sync::watch::Sender<u64>>);

impl Default for Wake {
    fn default() -> Wake {
        Wake(std::sync::Arc::new(tokio::sync::watch::Sender::new(0)))
    }
}

impl Wake {
    /// Wakes every wait holding a receiver.
    pub fn bump(&self) {
        self.0.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A receiver for one wait: it sees bumps made after this call.
    pub fn receiver(&self) -> tokio::sync::watch::Receiver<u64> {
        self.0.subscribe()
    }
}

/// Waits until every claim of the allocation at `key` is Published, with its paths;
/// see [`judge_published`] for what ends the wait early. The store being unavailable
/// meanwhile is waited out until `timeout`.
pub async fn wait_published(
    obs: &impl Observe,
    key: &ObjectKey<AllocationSpec>,
    timeout: Duration,
    pace: Pace<'_>,
) -> Result<Published, WorkloadError> {
    wait_paths(obs, key, timeout, pace, Paths::Published, judge_published).await
}

/// [`wait_published`] for a caller on the allocation's own node: done once every
/// claim's Mount says published for that claim ([`Paths::OnNode`]: NodePublish returned
/// OK), without waiting for the controller to mark the claim Published.
pub async fn wait_node_published(
    obs: &impl Observe,
    key: &ObjectKey<AllocationSpec>,
    timeout: Duration,
    pace: Pace<'_>,
) -> Result<Published, WorkloadError> {
    wait_paths(obs, key, timeout, pace, Paths::OnNode, judge_node_published).await
}

/// A wait for every request's paths (`which` of them), ended early by `judge`.
async fn wait_paths(
    obs: &impl Observe,
    key: &ObjectKey<AllocationSpec>,
    timeout: Duration,
    pace: Pace<'_>,
    which: Paths,
    judge: fn(Option<&Seen>) -> Option<Result<(), String>>,
) -> Result<Published, WorkloadError> {
    let seen = wait_for(
        obs,
        key,
        timeout,
        (ClaimPhase::Published, which),
        pace,
        judge,
    )
    .await?;
    let seen = seen.ok_or_else(|| WorkloadError::Refused("the allocation was deleted".into()))?;
    Ok(Published {
        alloc: seen.alloc,
        paths: seen.paths,
    })
}

/// Waits until every claim of the allocation at `key` is Released (or gone).
pub async fn wait_released(
    obs: &impl Observe,
    key: &ObjectKey<AllocationSpec>,
    timeout: Duration,
    pace: Pace<'_>,
) -> Result<(), WorkloadError> {
    wait_for(
        obs,
        key,
        timeout,
        (ClaimPhase::Released, Paths::None),
        pace,
        judge_released,
    )
    .await?;
    Ok(())
}

/// Looks at the allocation until `judge` gives a verdict; after `timeout`, the last
/// progress line in [`WorkloadError::TimedOut`].
async fn wait_for(
    obs: &impl Observe,
    key: &ObjectKey<AllocationSpec>,
    timeout: Duration,
    (goal, paths): (ClaimPhase, Paths),
    mut pace: Pace<'_>,
    judge: fn(Option<&Seen>) -> Option<Result<(), String>>,
) -> Result<Option<Seen>, WorkloadError> {
    let start = tokio::time::Instant::now();
    let mut last = String::new();
    let mut wake = pace.wake.as_ref().map(Wake::receiver);
    // Since when the store has failed without a break.
    let mut failing: Option<tokio::time::Instant> = None;
    loop {
        let looked = match pace.store_patience {
            None => look(obs, key, paths).await,
            Some(patience) => {
                let left = patience.saturating_sub(failing.map_or(Duration::ZERO, |f| f.elapsed()));
                match tokio::time::timeout(left, look(obs, key, paths)).await {
                    Ok(r) => r,
                    Err(_) => return Err(WorkloadError::Store(StoreError::unanswered(patience))),
                }
            }
        };
        match looked {
            Ok(seen) => {
                failing = None;
                if let Some(s) = &seen {
                    let line = s.progress(goal);
                    if line != last {
                        (pace.progress)(&line);
                        last = line;
                    }
                }
                match judge(seen.as_ref()) {
                    Some(Ok(())) => return Ok(seen),
                    Some(Err(why)) => return Err(WorkloadError::Refused(why)),
                    None => {}
                }
            }
            Err(e) if e.is_transient() && start.elapsed() < timeout => {
                let since = *failing.get_or_insert_with(tokio::time::Instant::now);
                if pace.store_patience.is_some_and(|p| since.elapsed() >= p) {
                    return Err(e.into());
                }
            }
            Err(e) => return Err(e.into()),
        }
        if start.elapsed() >= timeout {
            return Err(WorkloadError::TimedOut {
                after: timeout,
                goal,
                last,
            });
        }
        let pause = tokio::time::sleep(pace.poll.next_delay());
        match wake.as_mut() {
            Some(rx) => {
                tokio::select! {
                    () = pause => {}
                    // A closed sender: the pause alone paces.
                    _ = rx.changed() => {}
                }
            }
            None => pause.await,
        }
    }
}

/// What [`collect`] decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collect {
    /// Not an ended, released allocation: kept.
    Keep,
    /// Its retention ends after this long.
    After(Duration),
    /// Deleted now.
    Now,
}

/// Whether an ended allocation is collected now (deleted: its Released claims follow,
/// each once its node confirmed the teardown, and their Mounts with them), later, or
/// not at all: only an allocation that ended (terminal or being deleted) with every
/// claim released (phase Released, since `released_at`), `retention` after that.
pub fn collect(alloc: &Allocation, now: Timestamp, retention: Duration) -> Collect {
    let ended = alloc.is_terminal() || alloc.is_deleting();
    let since = match alloc.status.released_at {
        Some(t) if ended && alloc.status.phase == AllocationPhase::Released => t,
        _ => return Collect::Keep,
    };
    let elapsed = now
        .system()
        .duration_since(since.system())
        .unwrap_or_default();
    match retention.checked_sub(elapsed) {
        Some(left) if !left.is_zero() => Collect::After(left),
        _ => Collect::Now,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(node: &str) -> Allocation {
        Allocation::new(
            &Namespace::default_ns(),
            Name::new("a1").unwrap(),
            AllocationSpec {
                node: NodeName::new(node).unwrap(),
                ..Default::default()
            },
        )
    }

    #[test]
    fn only_a_live_allocation_on_the_same_node_is_adopted() {
        let wanted = alloc("n1");
        assert_eq!(
            adoption(&alloc("n1"), &wanted, IfEnded::Refuse),
            Adoption::Adopt
        );
        assert!(matches!(
            adoption(&alloc("n2"), &wanted, IfEnded::Replace),
            Adoption::Refuse(why) if why.contains("node n2")
        ));
        let mut ended = alloc("n1");
        apply_end(&mut ended.spec, &End::Ended(ClientStatus::Complete, None));
        assert!(matches!(
            adoption(&ended, &wanted, IfEnded::Refuse),
            Adoption::Refuse(why) if why.contains("ended")
        ));
        assert_eq!(
            adoption(&ended, &wanted, IfEnded::Replace),
            Adoption::Replace
        );
        let mut lost = alloc("n1");
        lost.status.lost = true;
        assert_eq!(
            adoption(&lost, &wanted, IfEnded::Replace),
            Adoption::Replace
        );
        let mut deleting = alloc("n1");
        deleting.metadata.deletion_timestamp = Some(Timestamp::now());
        assert!(matches!(
            adoption(&deleting, &wanted, IfEnded::Replace),
            Adoption::Refuse(_)
        ));
    }

    #[test]
    fn the_first_end_s_client_status_stands_and_a_repeat_writes_nothing() {
        let mut s = alloc("n1").spec;
        s.client_status = ClientStatus::Running;
        let failed = End::Ended(
            ClientStatus::Failed,
            Some(ClientExit {
                code: Some(3),
                signal: None,
            }),
        );
        assert!(apply_end(&mut s, &failed));
        assert_eq!(
            (s.desired_status, s.client_status),
            (DesiredStatus::Stop, ClientStatus::Failed)
        );
        assert!(!apply_end(&mut s, &failed), "a repeat writes nothing");
        assert!(!apply_end(
            &mut s,
            &End::Ended(ClientStatus::Complete, None)
        ));
        assert_eq!(s.client_status, ClientStatus::Failed);
        assert_eq!(s.exit.as_ref().and_then(|e| e.code), Some(3));
        // A stop from outside leaves the client status to the runner.
        let mut s = alloc("n1").spec;
        s.client_status = ClientStatus::Running;
        assert!(apply_end(&mut s, &End::Stop));
        assert_eq!(s.client_status, ClientStatus::Running);
        assert!(!apply_end(&mut s, &End::Stop));
        // The runner's own end after that still records how the workload ended.
        assert!(apply_end(&mut s, &End::Ended(ClientStatus::Complete, None)));
        assert_eq!(s.client_status, ClientStatus::Complete);
    }

    fn claim(phase: ClaimPhase, reason: Option<&str>) -> Claim {
        let mut c = Claim::new(
            &Namespace::default_ns(),
            Name::new("a1.data").unwrap(),
            ClaimSpec::default(),
        );
        c.status.phase = phase;
        c.status.reason = reason.map(Into::into);
        c
    }

    fn seen(claims: Vec<Option<Claim>>, paths: usize) -> Seen {
        let mut alloc = alloc("n1");
        let names: Vec<Name> = (0..claims.len())
            .map(|i| Name::new(format!("r{i}")).unwrap())
            .collect();
        for n in &names {
            alloc.spec.volumes.push(VolumeRequest {
                name: n.clone(),
                volume: VolumeId::new("v1").unwrap(),
                ..Default::default()
            });
        }
        let paths = names
            .iter()
            .take(paths)
            .map(|n| {
                (
                    n.clone(),
                    RequestPaths {
                        target_path: format!("/t/{n}"),
                        staging_path: None,
                    },
                )
            })
            .collect();
        Seen {
            alloc,
            claims: names.into_iter().zip(claims).collect(),
            paths,
            refused: Vec::new(),
        }
    }

    #[test]
    fn a_wait_for_published_ends_on_every_answer_and_only_with_every_path() {
        let published = || Some(claim(ClaimPhase::Published, None));
        assert_eq!(
            judge_published(Some(&seen(vec![published()], 1))),
            Some(Ok(()))
        );
        // Published, but its Mount does not say where yet: wait on.
        assert_eq!(judge_published(Some(&seen(vec![published()], 0))), None);
        assert_eq!(
            judge_published(Some(&seen(vec![published(), None], 1))),
            None
        );
        let denied = seen(
            vec![published(), Some(claim(ClaimPhase::Denied, Some("in use")))],
            1,
        );
        assert!(
            matches!(judge_published(Some(&denied)), Some(Err(why)) if why.contains("r1 was denied: in use"))
        );
        let mut blocked = seen(vec![None], 0);
        blocked.alloc.status.phase = AllocationPhase::Blocked;
        blocked.alloc.status.meta.last_error = Some("request r0: too big".into());
        blocked.alloc.status.meta.observed_generation = blocked.alloc.metadata.generation;
        assert!(
            matches!(judge_published(Some(&blocked)), Some(Err(why)) if why.contains("r0 is blocked: too big"))
        );
        // Blocked for an earlier spec: not yet this one's verdict.
        blocked.alloc.status.meta.observed_generation = blocked.alloc.metadata.generation - 1;
        assert_eq!(judge_published(Some(&blocked)), None);
        let mut ended = seen(vec![published()], 1);
        apply_end(&mut ended.alloc.spec, &End::Stop);
        assert!(matches!(judge_published(Some(&ended)), Some(Err(_))));
        assert!(matches!(judge_published(None), Some(Err(_))));
        assert!(seen(vec![None], 0)
            .progress(ClaimPhase::Published)
            .contains("r0: no claim yet"));
        // A failing step's line is the same from one second to the next (issue 78,
        // item 7: a countdown printed a line every second of a back-off).
        let mut failing = claim(ClaimPhase::Admitted, Some("waiting for node n1 to publish"));
        failing.status.meta.retry = Some(Box::new(StepFailure {
            step: "NodeStageVolume".into(),
            since: Timestamp::now(),
            attempts: 3,
            code: "Unavailable".into(),
            message: "the disk is busy".into(),
            final_answer: false,
            next_retry: Timestamp::from_system(
                std::time::SystemTime::now() + Duration::from_secs(90),
            ),
        }));
        let waiting = seen(vec![Some(failing)], 0);
        let first = waiting.progress(ClaimPhase::Published);
        std::thread::sleep(Duration::from_millis(1100));
        assert_eq!(waiting.progress(ClaimPhase::Published), first);
        assert!(
            first.contains(
                "NodeStageVolume failed 3x with Unavailable: the disk is busy; next try at "
            ),
            "{first}"
        );
    }

    #[test]
    fn a_wait_for_released_ends_when_every_claim_is_released_or_gone() {
        let released = || Some(claim(ClaimPhase::Released, None));
        assert_eq!(
            judge_released(Some(&seen(vec![released(), None], 0))),
            Some(Ok(()))
        );
        assert_eq!(
            judge_released(Some(&seen(
                vec![released(), Some(claim(ClaimPhase::Releasing, None))],
                0
            ))),
            None
        );
        assert_eq!(judge_released(None), Some(Ok(())));
    }
}
