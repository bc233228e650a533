//! The runner's Lease: created, or taken over from a runner whose lease expired, then
//! renewed every TTL/3 while the workload runs.

use std::time::Duration;

use moor::api::*;

use super::*;

/// Creates the runner's lease, or takes over one whose holder stopped renewing it (by
/// our clock: a holder renews every third of its duration).
pub(super) async fn take_lease(
    ctx: &Ctx,
    ns: &Namespace,
    name: &Name,
    holder: &str,
    ttl: Duration,
) -> anyhow::Result<Lease> {
    let spec = LeaseSpec {
        holder: holder.to_string(),
        duration_seconds: ttl.as_secs().max(1),
        renew_time: Some(Timestamp::now()),
        renewals: 0,
    };
    let key = Lease::key_for(ns, name);
    ride_out(ctx, |_| {
        let (key, spec) = (&key, spec.clone());
        async move {
            match ctx.store.try_get(key).await? {
                None => {
                    let lease = Lease::new(ns, name.clone(), spec);
                    match ctx.store.create(&lease).await {
                        Ok(l) => Ok(l),
                        Err(StoreError::AlreadyExists { .. }) => Err(crate::LookAgain.into()),
                        Err(e) => Err(e.into()),
                    }
                }
                Some(old) if old.spec.holder == holder => Ok(old),
                Some(old) => {
                    let fresh = old
                        .spec
                        .renew_time
                        .is_some_and(|t| t.elapsed() < old.duration());
                    if fresh {
                        return Err(Refused(format!(
                            "allocation {ns}/{name} is run by {} (its lease was renewed {} ago)",
                            old.spec.holder,
                            humantime::format_duration(Duration::from_secs(
                                old.spec.renew_time.map_or(0, |t| t.elapsed().as_secs())
                            ))
                        ))
                        .into());
                    }
                    let mut next = old.clone();
                    next.spec = spec;
                    match ctx.store.replace(&next).await {
                        Ok(l) => Ok(l),
                        Err(StoreError::Conflict { .. }) => Err(crate::LookAgain.into()),
                        Err(e) => Err(e.into()),
                    }
                }
            }
        }
    })
    .await
}

/// Renews the lease every third of its duration until aborted; a failed renewal is
/// said once and tried again at the next tick.
pub(super) async fn renew(store: moor::store::Store, key: ObjectKey<LeaseSpec>, ttl: Duration) {
    let every = (ttl / 3).max(Duration::from_millis(300));
    let mut failing = false;
    loop {
        tokio::time::sleep(every).await;
        let r = store
            .modify_spec(&key, |s: &mut LeaseSpec| {
                s.renewals += 1;
                s.renew_time = Some(Timestamp::now());
                true
            })
            .await;
        match r {
            Ok(_) if failing => {
                eprintln!("moorctl: lease renewed again");
                failing = false;
            }
            Ok(_) => {}
            Err(e) if !failing => {
                eprintln!("moorctl: cannot renew the allocation's lease ({e}); trying again");
                failing = true;
            }
            Err(_) => {}
        }
    }
}
