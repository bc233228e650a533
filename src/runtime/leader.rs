//! Leader election on an etcd lease, with a fence for every leader write.
//!
//! Expected flow:
//! 1. A candidate grants a lease and, in one txn, creates `<prefix>leaders/<name>` bound
//!    to it if the key does not exist. Losing, it revokes the lease and watches the key
//!    until it is deleted, then tries again.
//! 2. The winner's [`Leadership`] carries a [`Fence`] (the key's create_revision) and a
//!    store handle that adds the fence to every write: a deposed leader's writes fail
//!    with `StoreError::Deposed` even if it has not noticed yet (Jepsen showed leases
//!    alone cannot promise mutual exclusion).
//!    The fence holds only while the key keeps both its create revision and the
//!    leader's lease: a key overwritten in place (a put strips its lease) deposes.
//! 3. The leader renews the lease every TTL/3. It considers itself leader only until
//!    `time a renewal was sent + granted TTL - margin`: etcd cannot expire the lease
//!    before that, so a leader cut off from etcd stops acting before another can win.
//!    A revoked lease, a deleted key or an overwritten one ends leadership at once; a
//!    candidate that finds the key without a lease removes it and campaigns, so the
//!    election recovers by itself.
//! 4. [`Leadership::resign`] revokes the lease so the next candidate wins immediately.

use std::future::Future;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse};

use crate::store::{
    Fence, KeepAlive, LeaseId, RawEventKind, Repeat, Store, StoreError, WatchStream,
};

/// Who is campaigning for what.
#[derive(Debug, Clone)]
pub struct LeaderConfig {
    /// The election, e.g. `controller` or `plugin.hostpath.moor.dev`.
    pub name: String,
    /// This candidate, e.g. `controller@host-1`; stored as the key's value.
    pub identity: String,
    /// Lease TTL: how long a dead leader blocks the next one.
    pub ttl: Duration,
}

/// Being leader, until [`Leadership::lost`] is cancelled.
pub struct Leadership {
    fence: Fence,
    store: Store,
    lease: LeaseId,
    lost: CancellationToken,
}

impl Leadership {
    /// The fence every leader write must carry.
    pub fn fence(&self) -> &Fence {
        &self.fence
    }

    /// The lease that holds the election key.
    pub fn lease(&self) -> LeaseId {
        self.lease
    }

    /// A store whose writes carry the fence.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Cancelled when leadership ends (expired locally, revoked, key deleted, resigned).
    pub fn lost(&self) -> CancellationToken {
        self.lost.clone()
    }

    /// Gives leadership up: stops acting, then revokes the lease so another can win.
    pub async fn resign(self) {
        self.lost.cancel();
        if let Err(e) = self.store.revoke_lease(self.lease).await {
            tracing::warn!(error = %e, "could not revoke the leader lease; it will expire");
        }
    }
}

fn election_key(store: &Store, name: &str) -> String {
    store.full_key(&crate::api::election_key(name))
}

/// Campaigns until elected (`Some`) or `shutdown` (`None`).
pub async fn acquire(
    store: &Store,
    cfg: &LeaderConfig,
    shutdown: &CancellationToken,
) -> Option<Leadership> {
    let mut delay =
        super::backoff::Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    loop {
        if shutdown.is_cancelled() {
            return None;
        }
        let attempt = tokio::select! {
            _ = shutdown.cancelled() => return None,
            r = try_acquire(store, cfg, shutdown) => r,
        };
        match attempt {
            Ok(Some(leadership)) => return Some(leadership),
            Ok(None) => delay.reset(),
            Err(e) => {
                tracing::debug!(election = %cfg.name, error = %e, "campaign attempt failed");
                tokio::select! {
                    _ = shutdown.cancelled() => return None,
                    _ = tokio::time::sleep(delay.next_delay()) => {}
                }
            }
        }
    }
}

/// One attempt: `Some` when elected; `None` after the current leader's key went away.
async fn try_acquire(
    store: &Store,
    cfg: &LeaderConfig,
    shutdown: &CancellationToken,
) -> Result<Option<Leadership>, StoreError> {
    let key = election_key(store, &cfg.name);
    let granted_at = Instant::now();
    let lease = store.grant_lease(cfg.ttl).await?;
    let txn = Txn::new()
        .when(vec![Compare::create_revision(
            key.clone(),
            CompareOp::Equal,
            0,
        )])
        .and_then(vec![TxnOp::put(
            key.clone(),
            cfg.identity.clone(),
            Some(PutOptions::new().with_lease(lease.0)),
        )])
        .or_else(vec![TxnOp::get(key.clone(), None)]);
    let resp = match store
        .send(Repeat::OnlyUnsent, |mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })
        .await
    {
        Ok(r) => r,
        Err(e) => {
            let _ = store.revoke_lease(lease).await;
            return Err(StoreError::from_etcd(e));
        }
    };
    let revision = resp.header().map(|h| h.revision()).unwrap_or_default();
    if resp.succeeded() {
        let fence = Fence {
            key: key.clone(),
            create_revision: revision,
            lease: lease.0,
        };
        let lost = CancellationToken::new();
        tokio::spawn(keep_leading(
            store.clone(),
            cfg.clone(),
            fence.clone(),
            lease,
            granted_at + cfg.ttl,
            lost.clone(),
        ));
        tracing::info!(election = %cfg.name, identity = %cfg.identity, "became leader");
        return Ok(Some(Leadership {
            store: store.fenced(fence.clone()),
            fence,
            lease,
            lost,
        }));
    }
    store.revoke_lease(lease).await?;
    // A key without a lease was overwritten (a put strips the lease): nobody holds it,
    // and it would never expire. Remove it, if it is still that very key, and campaign.
    let leaseless = resp.op_responses().iter().find_map(|r| match r {
        TxnOpResponse::Get(g) => g
            .kvs()
            .first()
            .filter(|kv| kv.lease() == 0)
            .map(|kv| kv.mod_revision()),
        _ => None,
    });
    if let Some(mod_revision) = leaseless {
        tracing::warn!(election = %cfg.name, "the election key has no lease (overwritten?); removing it");
        let txn = Txn::new()
            .when(vec![Compare::mod_revision(
                key.clone(),
                CompareOp::Equal,
                mod_revision,
            )])
            .and_then(vec![TxnOp::delete(key.clone(), None)]);
        store
            .send(Repeat::OnlyUnsent, |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await
            .map_err(StoreError::from_etcd)?;
        return Ok(None);
    }
    // Someone else leads: wait for its key to go, watching from just after our read.
    let scope = crate::api::election_key(&cfg.name);
    let mut watch = store.watch_raw(&scope, revision + 1, false).await?;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(None),
            batch = watch.next() => match batch? {
                Some(b) if b.compact_revision > 0 || b.canceled => return Ok(None),
                Some(b) => {
                    if b.events.iter().any(|e| e.kind == RawEventKind::Delete && e.key == scope) {
                        return Ok(None);
                    }
                }
                None => return Ok(None),
            },
        }
    }
}

/// Renews the lease and cancels `lost` when leadership can no longer be vouched for.
async fn keep_leading(
    store: Store,
    cfg: LeaderConfig,
    fence: Fence,
    lease: LeaseId,
    first_deadline: Instant,
    lost: CancellationToken,
) {
    let margin = (cfg.ttl / 5).max(Duration::from_millis(200));
    let mut valid_until = first_deadline - margin;
    let renew_every = (cfg.ttl / 3).max(Duration::from_millis(100));
    let scope = crate::api::election_key(&cfg.name);
    let from = fence.create_revision + 1;
    let (mut keeper, mut key_watch) = (None, None);
    let late = "lease could not be renewed in time";
    let reason = 'lead: {
        if !open_missing(
            &store,
            lease,
            &scope,
            from,
            &mut keeper,
            &mut key_watch,
            valid_until,
        )
        .await
        {
            break 'lead late;
        }
        loop {
            let watch_next = async {
                match key_watch.as_mut() {
                    Some(w) => w.next().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = lost.cancelled() => break "resigned",
                _ = tokio::time::sleep_until(valid_until) => break late,
                batch = watch_next => match batch {
                    Ok(Some(b)) if b.events.iter().any(|e| e.kind == RawEventKind::Delete && e.key == scope) => {
                        break "election key deleted";
                    }
                    // The leader never writes its key after winning: a put is someone
                    // overwriting it (which also strips its lease).
                    Ok(Some(b)) if b.events.iter().any(|e| e.kind == RawEventKind::Put && e.key == scope) => {
                        break "election key overwritten";
                    }
                    Ok(Some(_)) => {}
                    // Watch trouble is not loss of leadership; the lease deadline still holds.
                    Ok(None) | Err(_) => key_watch = None,
                },
                _ = tokio::time::sleep(renew_every) => {
                    let sent = Instant::now();
                    if !open_missing(&store, lease, &scope, from, &mut keeper, &mut key_watch, valid_until).await {
                        break late;
                    }
                    if let Some(k) = keeper.as_mut() {
                        match tokio::time::timeout_at(valid_until, k.renew()).await {
                            Ok(Ok(ttl)) => valid_until = sent + ttl - margin.min(ttl / 2),
                            Ok(Err(StoreError::LeaseGone(_))) => break "lease revoked or expired",
                            Ok(Err(_)) => keeper = None,
                            Err(_) => break late,
                        }
                    }
                }
            }
        }
    };
    if !lost.is_cancelled() {
        tracing::warn!(election = %cfg.name, identity = %cfg.identity, reason, "lost leadership");
    }
    lost.cancel();
}

/// Opens whichever of the keep-alive channel and the election key's watch (from
/// revision `from`) is missing; either may fail and stay missing until the next try.
/// False when `deadline` passed first: the store sends a request again while etcd is
/// unreachable, and the lease deadline must still win.
async fn open_missing(
    store: &Store,
    lease: LeaseId,
    scope: &str,
    from: i64,
    keeper: &mut Option<KeepAlive>,
    key_watch: &mut Option<WatchStream>,
    deadline: Instant,
) -> bool {
    tokio::time::timeout_at(deadline, async {
        if keeper.is_none() {
            *keeper = store.keep_alive(lease).await.ok();
        }
        if key_watch.is_none() {
            *key_watch = store.watch_raw(scope, from, false).await.ok();
        }
    })
    .await
    .is_ok()
}

/// Campaigns, runs `work` while leader, and campaigns again after losing, until
/// `shutdown`. `work` gets the fenced store and a token cancelled when it must stop.
/// On shutdown the token is cancelled and `work` is awaited (a graceful stop); on lost
/// leadership `work` is dropped at once: it is no longer entitled to act.
pub async fn lead<F, Fut>(store: Store, cfg: LeaderConfig, shutdown: CancellationToken, mut work: F)
where
    F: FnMut(Store, CancellationToken) -> Fut,
    Fut: Future<Output = ()>,
{
    while let Some(leadership) = acquire(&store, &cfg, &shutdown).await {
        let lost = leadership.lost();
        let stop = lost.child_token();
        let work = work(leadership.store().clone(), stop.clone());
        tokio::pin!(work);
        tokio::select! {
            _ = &mut work => {}
            _ = lost.cancelled() => {}
            _ = shutdown.cancelled() => {
                stop.cancel();
                work.await;
            }
        }
        stop.cancel();
        leadership.resign().await;
    }
}
