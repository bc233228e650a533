//! Group commit: guarded writes that concurrent reconciles issue while the store is
//! busy go to etcd as one transaction.
//!
//! Every guarded write of a [`Store`] (an object's update, create or delete, a
//! [`super::Batch`]) is handed to its store's committer. The committer sends a write
//! at once when fewer than [`IN_FLIGHT`] transactions are outstanding; otherwise the
//! writes that queue meanwhile leave together when one returns, as one transaction
//! whose compares are every write's own guards (and the fence once). An idle store
//! adds no wait: a lone write goes out alone.
//!
//! A batch keeps each write's meaning:
//! - it commits: every write landed, at the transaction's revision (what etcd gives
//!   every key a transaction writes);
//! - a guard failed: nothing landed, and each write is sent again on its own, so only
//!   the write whose guard fails sees the conflict (with what is stored, as alone);
//! - the answer was lost: each write gets the same class of error, so every one of
//!   them stays "may have been sent", exactly as a write alone whose answer was lost;
//! - the fence is gone: every write is deposed;
//! - etcd refused the request as a whole for anything else (too large, a lease gone):
//!   each write is sent again on its own and gets its own answer.
//!
//! Writes that touch a key another write of the batch touches wait for the next
//! batch (etcd refuses a transaction that writes a key twice), and a batch stays
//! within [`MAX_OPS`] operations and [`MAX_BYTES`] of values.
//!
//! **Riders** ([`Store::commit_riding`]): a write that need not land at once (an
//! event) waits up to its linger for another write of the process, through any of its
//! committers (the controller's fenced one as much as the events' unfenced one), and
//! joins that write's transaction: one revision, one fdatasync and one watch delivery
//! for both. A rider never delays a write it joins (riders are taken only when a batch
//! leaves, and only as far as they fit), and a rider nobody took by its deadline goes
//! alone. A rider taken into a fenced batch that finds the fence gone is sent again
//! alone by its own store: a rider is not leader work.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use etcd_client::{Compare, TxnOp};
use futures::future::join_all;
use tokio::sync::{mpsc, oneshot, Semaphore};

use super::{Store, StoreError};

/// Transactions a store has outstanding at once before writes queue into batches.
pub(super) const IN_FLIGHT: usize = 2;
/// Most operations in one batch (etcd refuses more than 128 per branch by default).
pub(super) const MAX_OPS: usize = 64;
/// Most bytes of values in one batch (etcd refuses requests over 1.5 MiB by default).
pub(super) const MAX_BYTES: usize = 512 << 10;

/// One guarded write: its compares, its operations, the keys to read back when a
/// compare fails, every full key it compares or writes, and the bytes it puts.
#[derive(Debug, Clone, Default)]
pub(super) struct Write {
    pub compares: Vec<Compare>,
    pub ops: Vec<TxnOp>,
    pub fetch: Vec<String>,
    pub keys: Vec<String>,
    pub bytes: usize,
}

impl Write {
    /// What the write counts against [`MAX_OPS`]: the longer of its branches.
    fn size(&self) -> usize {
        self.ops.len().max(self.compares.len())
    }

    /// A write of one operation guarded by one compare on `key`.
    pub fn one(key: String, compare: Compare, op: TxnOp, bytes: usize) -> Write {
        Write {
            compares: vec![compare],
            ops: vec![op],
            fetch: Vec::new(),
            keys: vec![key],
            bytes,
        }
    }
}

/// What a guarded write comes to: its revision, or (a compare failed) what is stored
/// at each key it asked to fetch: `(full key, value, mod_revision)`.
pub(super) type Outcome = Result<Result<i64, Vec<(String, Vec<u8>, i64)>>, StoreError>;

struct Pending {
    write: Write,
    done: oneshot::Sender<Outcome>,
}

/// Writes waiting for another write of the process to ride with (see the module
/// docs), shared by every handle of one connection, fenced or not.
#[derive(Default)]
pub(super) struct Riders {
    waiting: Mutex<Vec<(u64, Pending)>>,
    /// How many wait: a batch leaving checks this before taking the lock.
    count: AtomicUsize,
    next: AtomicU64,
}

impl Riders {
    fn push(&self, p: Pending) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut w) = self.waiting.lock() {
            w.push((id, p));
            self.count.store(w.len(), Ordering::Release);
        }
        id
    }

    /// Takes rider `id` back if nobody took it.
    fn withdraw(&self, id: u64) -> Option<Pending> {
        let mut w = self.waiting.lock().ok()?;
        let i = w.iter().position(|(i, _)| *i == id)?;
        let (_, p) = w.swap_remove(i);
        self.count.store(w.len(), Ordering::Release);
        Some(p)
    }

    /// Moves the riders that fit into `batch`, oldest first.
    fn board(&self, batch: &mut Batch) {
        if self.count.load(Ordering::Acquire) == 0 {
            return;
        }
        let Ok(mut w) = self.waiting.lock() else {
            return;
        };
        let mut i = 0;
        while i < w.len() {
            if batch.fits(&w[i].1.write) {
                let (_, p) = w.remove(i);
                batch.push(p);
            } else {
                i += 1;
            }
        }
        self.count.store(w.len(), Ordering::Release);
    }
}

/// A store's committer: started by its first write, ended when the last handle of
/// the store is dropped.
#[derive(Default)]
pub(super) struct Group {
    queue: OnceLock<mpsc::UnboundedSender<Pending>>,
}

impl Store {
    /// Runs `write` through this store's committer (see the module docs).
    pub(super) async fn commit_write(&self, write: Write) -> Outcome {
        let Some(group) = &self.group else {
            return self.txn_now(write).await;
        };
        let queue = group.queue.get_or_init(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(commit_loop(self.alone(), rx));
            tx
        });
        let (done, answer) = oneshot::channel();
        if let Err(mpsc::error::SendError(p)) = queue.send(Pending { write, done }) {
            // The committer is gone (its runtime ended): write alone.
            return self.txn_now(p.write).await;
        }
        // The committer stopped while holding the write: it may have been sent.
        answer.await.unwrap_or_else(|_| Err(committer_stopped()))
    }

    /// Runs `write` as a rider (see the module docs): it joins the next write of this
    /// process within `linger`, or goes alone after it. Each outcome is the one the
    /// write would have had alone, but for its revision.
    pub(super) async fn commit_riding(&self, write: Write, linger: Duration) -> Outcome {
        if linger.is_zero() || self.group.is_none() {
            return self.commit_write(write).await;
        }
        // Kept to send again alone if a fenced batch takes it and finds its fence gone.
        let again = write.clone();
        let (done, mut answer) = oneshot::channel();
        let id = self.riders.push(Pending { write, done });
        let outcome = tokio::select! {
            a = &mut answer => a,
            _ = tokio::time::sleep(linger) => match self.riders.withdraw(id) {
                Some(p) => return self.commit_write(p.write).await,
                None => answer.await,
            },
        };
        match outcome {
            Ok(Err(StoreError::Deposed { .. })) if self.fence.is_none() => {
                self.commit_write(again).await
            }
            Ok(o) => o,
            Err(_) => Err(committer_stopped()),
        }
    }

    /// This store without a committer: what the committer itself sends with.
    fn alone(&self) -> Store {
        Store {
            group: None,
            ..self.clone()
        }
    }
}

fn committer_stopped() -> StoreError {
    StoreError::Unavailable(etcd_client::Error::GRpcStatus(tonic::Status::unavailable(
        "the store's committer stopped",
    )))
}

async fn commit_loop(store: Store, mut queue: mpsc::UnboundedReceiver<Pending>) {
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    let mut next: Option<Pending> = None;
    loop {
        let first = match next.take() {
            Some(p) => p,
            None => match queue.recv().await {
                Some(p) => p,
                None => return,
            },
        };
        // While every slot is taken, writes queue up behind `first`.
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let mut batch = Batch::new(first);
        while let Ok(p) = queue.try_recv() {
            if !batch.fits(&p.write) {
                next = Some(p);
                break;
            }
            batch.push(p);
        }
        store.riders.board(&mut batch);
        let store = store.clone();
        tokio::spawn(async move {
            batch.send(&store).await;
            drop(slot);
        });
    }
}

struct Batch {
    writes: Vec<Pending>,
    /// The hashes of the keys its writes touch: a collision only defers a write to
    /// the next batch, and the keys stay with their writes (a refusal names them).
    keys: HashSet<u64>,
    ops: usize,
    bytes: usize,
}

impl Batch {
    fn new(first: Pending) -> Batch {
        let mut batch = Batch {
            writes: Vec::new(),
            keys: HashSet::new(),
            ops: 0,
            bytes: 0,
        };
        batch.push(first);
        batch
    }

    fn fits(&self, w: &Write) -> bool {
        self.ops + w.size() <= MAX_OPS
            && self.bytes + w.bytes <= MAX_BYTES
            && !w.keys.iter().any(|k| self.keys.contains(&key_hash(k)))
    }

    fn push(&mut self, p: Pending) {
        self.ops += p.write.size();
        self.bytes += p.write.bytes;
        self.keys.extend(p.write.keys.iter().map(|k| key_hash(k)));
        self.writes.push(p);
    }

    async fn send(self, store: &Store) {
        let mut writes = self.writes;
        if writes.len() == 1 {
            let p = writes.remove(0);
            let _ = p.done.send(store.txn_now(p.write).await);
            return;
        }
        let together = Write {
            compares: writes
                .iter()
                .flat_map(|p| p.write.compares.clone())
                .collect(),
            ops: writes.iter().flat_map(|p| p.write.ops.clone()).collect(),
            ..Write::default()
        };
        match store.txn_now(together).await {
            Ok(Ok(revision)) => {
                for p in writes {
                    let _ = p.done.send(Ok(Ok(revision)));
                }
            }
            Err(e) => {
                let copies: Option<Vec<StoreError>> =
                    writes.iter().skip(1).map(|_| copy_of(&e)).collect();
                match copies {
                    Some(copies) => {
                        let errors = std::iter::once(e).chain(copies);
                        for (p, e) in writes.into_iter().zip(errors) {
                            let _ = p.done.send(Err(e));
                        }
                    }
                    None => alone(store, writes).await,
                }
            }
            // A guard failed, and nothing landed: each write again on its own.
            Ok(Err(_)) => alone(store, writes).await,
        }
    }
}

/// A key's hash, to keep a batch free of repeats without copying the key.
fn key_hash(key: &str) -> u64 {
    use std::hash::{BuildHasher, BuildHasherDefault};
    BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default().hash_one(key)
}

/// Sends each write as its own transaction, all at once.
async fn alone(store: &Store, writes: Vec<Pending>) {
    join_all(writes.into_iter().map(|p| async move {
        let _ = p.done.send(store.txn_now(p.write).await);
    }))
    .await;
}

/// A copy of an error of a whole batch that is every write's own (the answer was
/// lost, etcd is out of space, the fence is gone); `None` for a refusal that may be
/// one write's doing.
fn copy_of(e: &StoreError) -> Option<StoreError> {
    use etcd_client::Error as E;
    let status = |e: &E, code: tonic::Code| {
        E::GRpcStatus(match e {
            E::GRpcStatus(s) => s.clone(),
            other => tonic::Status::new(code, other.to_string()),
        })
    };
    match e {
        StoreError::Unavailable(inner) => Some(StoreError::Unavailable(status(
            inner,
            tonic::Code::Unavailable,
        ))),
        StoreError::NoSpace(inner) => Some(StoreError::NoSpace(status(
            inner,
            tonic::Code::ResourceExhausted,
        ))),
        StoreError::Deposed { fence_key } => Some(StoreError::Deposed {
            fence_key: fence_key.clone(),
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_shares_only_the_errors_every_write_would_have_had() {
        let lost = StoreError::Unavailable(etcd_client::Error::GRpcStatus(
            tonic::Status::unavailable("transport error"),
        ));
        assert!(matches!(copy_of(&lost), Some(StoreError::Unavailable(_))));
        let full = StoreError::NoSpace(etcd_client::Error::GRpcStatus(
            tonic::Status::resource_exhausted("etcdserver: mvcc: database space exceeded"),
        ));
        assert!(matches!(copy_of(&full), Some(StoreError::NoSpace(_))));
        let deposed = StoreError::Deposed {
            fence_key: "leader".into(),
        };
        assert!(
            matches!(copy_of(&deposed), Some(StoreError::Deposed { fence_key }) if fence_key == "leader")
        );
        // A refusal of the request as a whole may be one write's doing: each is sent
        // again alone.
        let refused = StoreError::from_etcd(etcd_client::Error::GRpcStatus(
            tonic::Status::invalid_argument("etcdserver: too many operations in txn request"),
        ));
        assert!(copy_of(&refused).is_none());
        let lease_gone = StoreError::from_etcd(etcd_client::Error::GRpcStatus(
            tonic::Status::not_found("etcdserver: requested lease not found"),
        ));
        assert!(copy_of(&lease_gone).is_none());
    }

    #[test]
    fn a_batch_never_holds_a_key_twice_nor_more_than_its_limits() {
        let write = |key: &str, ops: usize, bytes: usize| Write {
            compares: Vec::new(),
            ops: (0..ops).map(|_| TxnOp::delete(key, None)).collect(),
            fetch: Vec::new(),
            keys: vec![key.to_string()],
            bytes,
        };
        let pending = |w: Write| Pending {
            write: w,
            done: oneshot::channel().0,
        };
        let batch = Batch::new(pending(write("a", 1, 100)));
        assert!(batch.fits(&write("b", 1, 100)));
        assert!(!batch.fits(&write("a", 1, 100)), "a key twice");
        assert!(!batch.fits(&write("b", MAX_OPS, 0)), "too many operations");
        assert!(!batch.fits(&write("b", 1, MAX_BYTES)), "too many bytes");
    }
}
