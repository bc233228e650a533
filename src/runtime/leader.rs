//! Leader election on a renewed record, with a fence for every leader write.
//!
//! Expected flow:
//! 1. A candidate grants a lease and, in one txn, creates `<prefix>leaders/<name>` bound
//!    to it if the key does not exist. The value is a [`LeaderRecord`]: holder, a
//!    campaign token, the TTL and a renewal count.
//! 2. The winner's [`Leadership`] carries a [`Fence`] (the key's create_revision and the
//!    leader's lease) and a store handle that adds the fence to every write: a deposed
//!    leader's writes fail with `StoreError::Deposed` even if it has not noticed yet.
//! 3. The leader renews by *writing* its record every TTL/3 (guarded by the fence), and
//!    keeps the etcd lease alive. It considers itself leader only until `time the last
//!    successful renewal write was sent + TTL - margin`.
//! 4. A losing candidate watches the key. It takes over when the key is deleted, or
//!    when the record has not changed for its TTL *by the candidate's own clock*: it
//!    deletes the key guarded by the mod_revision it last saw and campaigns. Liveness
//!    never rests on the etcd lease alone, because etcd 3.4 lets any authenticated user
//!    keep any lease alive (LeaseKeepAlive checks no permission); the record can be
//!    written only by those the roles let write the election key. The lease stays as
//!    the garbage collector: a holder that dies with nobody keeping its lease alive
//!    loses its key when the lease expires, and the next candidate wins at once.
//! 5. A revoked lease, a deleted key or a key overwritten by anyone else ends leadership
//!    at once; a candidate that finds the key without a lease removes it and campaigns.
//! 6. [`Leadership::resign`] revokes the lease so the next candidate wins immediately.

use serde::{Deserialize, Serialize};
use std::future::Future;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse};

use super::term::Term;
use crate::store::{
    Fence, KeepAlive, LeaseId, RawEventKind, Repeat, Store, StoreError, WatchStream,
};

/// The longest TTL a candidate honours in a record: a holder cannot make itself
/// unremovable by writing an absurd TTL.
const MAX_RECORD_TTL: Duration = Duration::from_secs(600);

/// The value of an election key, rewritten by its holder at every renewal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaderRecord {
    /// Who holds the election, e.g. `controller@host-1`.
    pub holder: String,
    /// A random token of this holder's campaign: tells its own writes from another's.
    pub campaign: u64,
    /// How long the record lasts without a renewal.
    pub ttl_ms: u64,
    /// Renewals so far (every renewal changes the value).
    pub renewals: u64,
    /// The holder's version ([`crate::VERSION`]); empty in a record of a version
    /// before it was written (0.1). `moorctl` warns when it is another minor version.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub version: String,
    /// What the holder knows that an older build may not ([`crate::FEATURES`]);
    /// absent from records of builds before it was written.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub features: Vec<String>,
}

impl LeaderRecord {
    /// Reads a stored value; an older plain identity string is read as a record with
    /// that holder and no TTL of its own.
    pub fn parse(value: &[u8]) -> LeaderRecord {
        serde_json::from_slice(value).unwrap_or_else(|_| LeaderRecord {
            holder: String::from_utf8_lossy(value).into_owned(),
            campaign: 0,
            ttl_ms: 0,
            renewals: 0,
            version: String::new(),
            features: Vec::new(),
        })
    }

    /// How long a candidate waits for a renewal: the record's TTL (bounded), or
    /// `default` when it names none.
    pub fn ttl_or(&self, default: Duration) -> Duration {
        match self.ttl_ms {
            0 => default,
            ms => Duration::from_millis(ms).min(MAX_RECORD_TTL),
        }
    }

    fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

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
    term: Term,
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

    /// The term by the leader's own clock: held until the last renewal's `sent + TTL -
    /// margin`, ended when leadership is lost. What the leader does outside etcd (CSI
    /// calls, which no fence guards) checks it right before each act.
    pub fn term(&self) -> Term {
        self.term.clone()
    }

    /// Gives leadership up: stops acting, then revokes the lease so another can win.
    pub async fn resign(self) {
        self.term.end();
        self.lost.cancel();
        if let Err(e) = self.store.revoke_lease(self.lease).await {
            tracing::warn!(error = %e, "could not revoke the leader lease; it will expire");
        }
    }
}

/// The record of election `name` as stored now; `None` while nobody holds it.
pub async fn holder(store: &Store, name: &str) -> Result<Option<LeaderRecord>, StoreError> {
    Ok(store
        .get_raw(&crate::api::election_key(name))
        .await?
        .map(|(value, _)| LeaderRecord::parse(&value)))
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
    // The last failure logged: a failure that repeats (a permission etcd refuses every
    // time) is logged once, then at debug, until the campaign gets past it.
    let mut repeats = super::repeats::Repeats::default();
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
            Ok(None) => {
                delay.reset();
                repeats.clear();
            }
            Err(e) => {
                let chain = crate::store::bounded_chain(&e);
                if repeats.is_new(&chain) {
                    tracing::warn!(election = %cfg.name, error = %chain, "campaign attempt failed; retrying on a backoff");
                } else {
                    tracing::debug!(election = %cfg.name, error = %chain, "campaign attempt failed");
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return None,
                    _ = tokio::time::sleep(delay.next_delay()) => {}
                }
            }
        }
    }
}

/// One attempt: `Some` when elected; `None` after the current leader's key went away
/// (deleted, expired, or removed by us after it went unrenewed for its TTL).
async fn try_acquire(
    store: &Store,
    cfg: &LeaderConfig,
    shutdown: &CancellationToken,
) -> Result<Option<Leadership>, StoreError> {
    let key = election_key(store, &cfg.name);
    let granted_at = Instant::now();
    let lease = store.grant_lease(cfg.ttl).await?;
    let record = LeaderRecord {
        holder: cfg.identity.clone(),
        campaign: fastrand::u64(1..),
        ttl_ms: cfg.ttl.as_millis() as u64,
        renewals: 0,
        version: crate::VERSION.to_string(),
        features: crate::FEATURES.iter().map(|f| f.to_string()).collect(),
    };
    let txn = Txn::new()
        .when(vec![Compare::create_revision(
            key.clone(),
            CompareOp::Equal,
            0,
        )])
        .and_then(vec![TxnOp::put(
            key.clone(),
            record.encode(),
            Some(PutOptions::new().with_lease(lease.0)),
        )])
        .or_else(vec![TxnOp::get(key.clone(), None)]);
    let resp = match send_txn(store, txn).await {
        Ok(r) => r,
        Err(e) => {
            let _ = store.revoke_lease(lease).await;
            return Err(e);
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
        // Named by election, fence and holder (see Term's docs).
        let term = Term::new(format!("{}/{revision}/{}", cfg.name, cfg.identity));
        term.renewed(granted_at, cfg.ttl);
        tokio::spawn(keep_leading(
            store.clone(),
            cfg.clone(),
            Held {
                fence: fence.clone(),
                lease,
                record,
            },
            term.clone(),
            lost.clone(),
        ));
        tracing::info!(election = %cfg.name, identity = %cfg.identity, "became leader");
        return Ok(Some(Leadership {
            store: store.fenced(fence.clone()),
            fence,
            lease,
            lost,
            term,
        }));
    }
    store.revoke_lease(lease).await?;
    let Some((held_lease, mod_revision, value)) =
        resp.op_responses().iter().find_map(|r| match r {
            TxnOpResponse::Get(g) => g
                .kvs()
                .first()
                .map(|kv| (kv.lease(), kv.mod_revision(), kv.value().to_vec())),
            _ => None,
        })
    else {
        // Gone between the compare and the read: campaign again.
        return Ok(None);
    };
    // A key without a lease was overwritten (a put strips the lease): nobody holds it,
    // and it would never expire. Remove it, if it is still that very key, and campaign.
    if held_lease == 0 {
        tracing::warn!(election = %cfg.name, "the election key has no lease (overwritten?); removing it");
        remove_if_unchanged(store, &key, mod_revision).await?;
        return Ok(None);
    }
    // Someone else leads: wait for its key to go, or for its record to go unrenewed.
    let scope = crate::api::election_key(&cfg.name);
    let mut watch = store.watch_key(&scope, revision + 1, false).await?;
    let mut seen = (mod_revision, Instant::now());
    let mut holder = LeaderRecord::parse(&value);
    loop {
        let expires = seen.1 + holder.ttl_or(cfg.ttl);
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(None),
            _ = tokio::time::sleep_until(expires) => {
                // Unchanged for its whole TTL by our clock, whoever keeps its etcd
                // lease alive: the holder is gone. Remove exactly what we saw.
                if remove_if_unchanged(store, &key, seen.0).await? {
                    tracing::warn!(
                        election = %cfg.name,
                        holder = %crate::api::printable(&holder.holder),
                        ttl_ms = holder.ttl_or(cfg.ttl).as_millis() as u64,
                        "the leader did not renew its record within its TTL (its etcd lease may be kept alive by another); removed its key"
                    );
                }
                return Ok(None);
            }
            // A watch that fails or ends is an error (the campaign backs off), never
            // "campaign again at once": that would spin while the key is held.
            batch = watch.next() => match batch? {
                Some(b) if b.compact_revision > 0 => return Ok(None),
                Some(b) => {
                    for e in b.events.iter().filter(|e| e.key == scope) {
                        match e.kind {
                            RawEventKind::Delete => return Ok(None),
                            RawEventKind::Put => {
                                seen = (e.mod_revision, Instant::now());
                                holder = LeaderRecord::parse(&e.value);
                            }
                        }
                    }
                }
                None => {
                    return Err(StoreError::watch_cancelled(
                        "etcd closed the election watch",
                        store.identity(),
                        &key,
                    ))
                }
            },
        }
    }
}

/// Sends an election txn once (never repeated after it may have reached etcd).
async fn send_txn(store: &Store, txn: Txn) -> Result<etcd_client::TxnResponse, StoreError> {
    store
        .send(Repeat::OnlyUnsent, |mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })
        .await
        .map_err(StoreError::from_etcd)
}

/// Deletes the election key if it is still at `mod_revision`; true when it did.
async fn remove_if_unchanged(
    store: &Store,
    key: &str,
    mod_revision: i64,
) -> Result<bool, StoreError> {
    let txn = Txn::new()
        .when(vec![Compare::mod_revision(
            key.to_string(),
            CompareOp::Equal,
            mod_revision,
        )])
        .and_then(vec![TxnOp::delete(key.to_string(), None)]);
    Ok(send_txn(store, txn).await?.succeeded())
}

/// What the leader holds: its fence, its lease and its record.
struct Held {
    fence: Fence,
    lease: LeaseId,
    record: LeaderRecord,
}

impl Held {
    /// Whether a value written over the key is this leader's own record.
    fn is_own(&self, value: &[u8]) -> bool {
        let r = LeaderRecord::parse(value);
        r.holder == self.record.holder && r.campaign == self.record.campaign
    }

    /// Writes the next renewal of the record, guarded by the fence: false when the key
    /// is no longer this leader's.
    async fn renew_record(&mut self, store: &Store) -> Result<bool, StoreError> {
        let mut next = self.record.clone();
        next.renewals += 1;
        let key = self.fence.key.clone();
        let txn = Txn::new()
            .when(vec![
                Compare::create_revision(key.clone(), CompareOp::Equal, self.fence.create_revision),
                Compare::lease(key.clone(), CompareOp::Equal, self.lease.0),
            ])
            .and_then(vec![TxnOp::put(
                key,
                next.encode(),
                Some(PutOptions::new().with_lease(self.lease.0)),
            )]);
        let ok = send_txn(store, txn).await?.succeeded();
        if ok {
            self.record = next;
        }
        Ok(ok)
    }
}

/// Renews the record and the lease, and cancels `lost` when leadership can no longer be
/// vouched for.
async fn keep_leading(
    store: Store,
    cfg: LeaderConfig,
    mut held: Held,
    term: Term,
    lost: CancellationToken,
) {
    // Valid until the term's deadline, which each applied renewal moves.
    let valid_until = || term.deadline().unwrap_or_else(Instant::now);
    let renew_every = (cfg.ttl / 3).max(Duration::from_millis(100));
    let scope = crate::api::election_key(&cfg.name);
    let from = held.fence.create_revision + 1;
    let lease = held.lease;
    let (mut keeper, mut key_watch) = (None, None);
    let late = "leadership could not be renewed in time";
    let reason = 'lead: {
        if !open_missing(
            &store,
            lease,
            &scope,
            from,
            &mut keeper,
            &mut key_watch,
            valid_until(),
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
                _ = tokio::time::sleep_until(valid_until()) => break late,
                batch = watch_next => match batch {
                    Ok(Some(b)) if b.events.iter().any(|e| e.kind == RawEventKind::Delete && e.key == scope) => {
                        break "election key deleted";
                    }
                    // The leader writes only its own record: any other put is someone
                    // overwriting the key.
                    Ok(Some(b)) if b.events.iter().any(|e| e.kind == RawEventKind::Put && e.key == scope && !held.is_own(&e.value)) => {
                        break "election key overwritten";
                    }
                    Ok(Some(_)) => {}
                    // Watch trouble is not loss of leadership; the deadline still holds.
                    Ok(None) | Err(_) => key_watch = None,
                },
                _ = tokio::time::sleep(renew_every) => {
                    let sent = Instant::now();
                    if !open_missing(&store, lease, &scope, from, &mut keeper, &mut key_watch, valid_until()).await {
                        break late;
                    }
                    // The lease only collects the key of a holder that died; keeping it
                    // alive proves nothing, so it does not extend the deadline.
                    if let Some(k) = keeper.as_mut() {
                        match tokio::time::timeout_at(valid_until(), k.renew()).await {
                            Ok(Ok(_)) => {}
                            Ok(Err(StoreError::LeaseGone(_))) => break "lease revoked or expired",
                            Ok(Err(_)) => keeper = None,
                            Err(_) => break late,
                        }
                    }
                    match tokio::time::timeout_at(valid_until(), held.renew_record(&store)).await {
                        Ok(Ok(true)) => term.renewed(sent, cfg.ttl),
                        Ok(Ok(false)) => break "election key replaced",
                        // Not renewed this time; the deadline decides.
                        Ok(Err(_)) => {}
                        Err(_) => break late,
                    }
                }
            }
        }
    };
    term.end();
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
            *key_watch = store.watch_key(scope, from, false).await.ok();
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
    F: FnMut(Store, CancellationToken, Term) -> Fut,
    Fut: Future<Output = ()>,
{
    while let Some(leadership) = acquire(&store, &cfg, &shutdown).await {
        super::metrics::leading(&cfg.name, true);
        let lost = leadership.lost();
        let stop = lost.child_token();
        let work = work(leadership.store().clone(), stop.clone(), leadership.term());
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
        super::metrics::leading(&cfg.name, false);
        leadership.resign().await;
    }
}
