//! Waiting on an allocation's claims: until every one is Published (before the
//! workload starts) or Released (after it ended), with one line of progress on stderr
//! per change (the phase, a waiting claim's reason, its failing step, last error and
//! next retry).

use std::time::{Duration, Instant};

use moor::api::*;
use moor::store::StoreError;

use super::*;

/// The allocation's claims as stored, by request name (absent: not made yet).
pub(super) async fn claims(
    ctx: &Ctx,
    alloc: &Allocation,
) -> Result<Vec<(Name, Option<Claim>)>, StoreError> {
    let mut out = Vec::new();
    for req in &alloc.spec.volumes {
        // Under its name, or the one an earlier release gave it, if it is this one's.
        let mut found = None;
        for claim_name in alloc.claim_names(req) {
            let key = Claim::key_for(&alloc.spec.node, &alloc.metadata.namespace, &claim_name);
            if let Some(c) = ctx.store.try_get(&key).await? {
                if alloc.owns(&c) {
                    found = Some(c);
                    break;
                }
            }
        }
        out.push((req.name.clone(), found));
    }
    Ok(out)
}

/// One line on where the allocation and each unsettled claim stand.
pub(super) fn progress(
    alloc: &Allocation,
    claims: &[(Name, Option<Claim>)],
    settled: ClaimPhase,
) -> String {
    let mut line = format!(
        "allocation {}: {:?}",
        alloc.metadata.name, alloc.status.phase
    );
    // Why a request has no claim yet (a template's volume refused or being made, a
    // volume that does not exist): the controller says so on the allocation.
    let why = alloc
        .status
        .meta
        .last_error
        .as_deref()
        .filter(|_| claims.iter().any(|(_, c)| c.is_none()));
    for (req, claim) in claims {
        match claim {
            None => match why.and_then(|w| reason_for(w, req)) {
                Some(reason) => line.push_str(&format!("; {req}: {}", printable(&reason))),
                None => line.push_str(&format!("; {req}: no claim yet")),
            },
            Some(c) if c.status.phase == settled => {}
            Some(c) => {
                line.push_str(&format!("; {req}: {:?}", c.status.phase));
                if let Some(r) = &c.status.reason {
                    line.push_str(&format!(" ({})", printable(r)));
                }
                if let Some(f) = &c.status.meta.retry {
                    line.push_str(&format!(
                        "; {} failed {}x with {}: {}; next try in {}",
                        f.step,
                        f.attempts,
                        f.code,
                        printable(&f.message),
                        humantime::format_duration(Duration::from_secs(
                            f.next_retry
                                .0
                                .duration_since(std::time::SystemTime::now())
                                .map_or(0, |d| d.as_secs())
                        ))
                    ));
                } else if let Some(e) = &c.status.meta.last_error {
                    line.push_str(&format!("; last error: {}", printable(e)));
                }
            }
        }
    }
    line
}

/// What the allocation's `last_error` (its reasons joined by `; `) says about request
/// `req`: the part naming it, or one naming its template's volume.
fn reason_for(last_error: &str, req: &Name) -> Option<String> {
    let named = format!("request {req}: ");
    last_error
        .split("; ")
        .find(|part| part.starts_with(&named))
        .map(|part| part[named.len()..].to_string())
}

/// Waits until every claim of the allocation is Published; a Denied claim, a template
/// refused for good (the allocation Blocked with no claim for it), a Failed volume or
/// the timeout is a refusal naming the reason.
pub(super) async fn wait_published(
    ctx: &Ctx,
    key: &ObjectKey<AllocationSpec>,
    timeout: Duration,
) -> anyhow::Result<Allocation> {
    poll_claims(ctx, key, timeout, ClaimPhase::Published, |seen| {
        let Some((alloc, claims)) = seen else {
            return Some(Err(Refused("the allocation was deleted".into()).into()));
        };
        if alloc.is_terminal() || alloc.is_deleting() {
            return Some(Err(Refused(format!(
                "allocation {} ended before its volumes were published",
                alloc.metadata.name
            ))
            .into()));
        }
        let denied = claims.iter().find_map(|(r, c)| {
            c.as_ref()
                .filter(|c| c.status.phase == ClaimPhase::Denied)
                .map(|c| (r, c))
        });
        if let Some((req, c)) = denied {
            return Some(Err(Refused(format!(
                "request {req} was denied: {}",
                printable(c.status.reason.as_deref().unwrap_or("no reason given"))
            ))
            .into()));
        }
        // Blocked for this very spec with a request that has no claim: its template's
        // volume was refused (too big for the node's segment, the plugin's final
        // answer); waiting until the timeout would only hide the reason.
        let current = alloc.status.meta.observed_generation == alloc.metadata.generation;
        if current && alloc.status.phase == AllocationPhase::Blocked {
            let blocked = claims.iter().find_map(|(r, c)| {
                let why = alloc.status.meta.last_error.as_deref()?;
                c.is_none()
                    .then(|| reason_for(why, r).map(|w| (r, w)))
                    .flatten()
            });
            if let Some((req, why)) = blocked {
                return Some(Err(Refused(format!(
                    "request {req} is blocked: {}",
                    printable(&why)
                ))
                .into()));
            }
        }
        let published = !claims.is_empty()
            && claims.iter().all(|(_, c)| {
                c.as_ref()
                    .is_some_and(|c| c.status.phase == ClaimPhase::Published)
            });
        let nothing_to_publish =
            alloc.spec.volumes.is_empty() && alloc.status.phase == AllocationPhase::Ready;
        (published || nothing_to_publish).then(|| Ok(alloc.clone()))
    })
    .await
}

/// Waits until every claim of the allocation is Released (or gone).
pub(super) async fn wait_released(
    ctx: &Ctx,
    key: &ObjectKey<AllocationSpec>,
    timeout: Duration,
) -> anyhow::Result<()> {
    poll_claims(ctx, key, timeout, ClaimPhase::Released, |seen| {
        let Some((alloc, claims)) = seen else {
            return Some(Ok(()));
        };
        let released = claims.iter().all(|(_, c)| {
            c.as_ref()
                .is_none_or(|c| c.status.phase == ClaimPhase::Released)
        });
        released.then(|| {
            eprintln!(
                "moorctl: allocation {}: every claim released",
                alloc.metadata.name
            );
            Ok(())
        })
    })
    .await
}

/// Reads the allocation and its claims every [`POLL`], printing a progress line when it
/// changes (claims short of `goal` with their reasons), until `decide` gives a verdict;
/// after `timeout`, a refusal with the last progress line. etcd being unavailable
/// meanwhile is waited out.
pub(super) async fn poll_claims<T>(
    ctx: &Ctx,
    key: &ObjectKey<AllocationSpec>,
    timeout: Duration,
    goal: ClaimPhase,
    mut decide: impl FnMut(Seen<'_>) -> Option<anyhow::Result<T>>,
) -> anyhow::Result<T> {
    let start = Instant::now();
    let mut last = String::new();
    loop {
        let seen = match look(ctx, key).await {
            Ok(x) => Some(x),
            Err(e) if crate::is_not_found(&e) => None,
            Err(e) if crate::is_transient(&e) && start.elapsed() < timeout => {
                tokio::time::sleep(POLL).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        if let Some((alloc, claims)) = &seen {
            let line = progress(alloc, claims, goal);
            if line != last {
                eprintln!("moorctl: {line}");
                last = line;
            }
        }
        if let Some(verdict) = decide(seen.as_ref().map(|(a, c)| (a, c.as_slice()))) {
            return verdict;
        }
        if start.elapsed() >= timeout {
            return Err(Refused(format!(
                "timed out after {} waiting for the claims to be {goal:?}: {last}",
                humantime::format_duration(timeout)
            ))
            .into());
        }
        tokio::time::sleep(POLL).await;
    }
}

pub(super) async fn look(
    ctx: &Ctx,
    key: &ObjectKey<AllocationSpec>,
) -> anyhow::Result<(Allocation, Vec<(Name, Option<Claim>)>)> {
    let alloc = ctx.store.get(key).await?;
    let claims = claims(ctx, &alloc).await?;
    Ok((alloc, claims))
}
