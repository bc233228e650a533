//! The typed store over the etcd v3 API.
//!
//! One JSON object per key, `<prefix><kind dir>/<suffix>` (see [`Spec::key_suffix`]).
//! Every value read is untrusted: it is decoded, checked against its key and validated,
//! and a bad one becomes [`StoreError::Malformed`] naming the key, never a panic.
//! Writes are compare-and-swap on `mod_revision` (the objects' `resource_version`), and a
//! leader's writes can be fenced on its election key ([`Store::fenced`]).

mod batch;
mod connect;
mod error;
mod lease;
mod seal;
mod send;
mod watch;

pub use batch::Batch;
pub use connect::EtcdAuth;
pub use error::{bounded_chain, MalformedCause, StoreError, NOSPACE_HELP};
pub use lease::{KeepAlive, LeaseId};
pub use seal::{Keyring, KeyringError, OpenError, SealError};
pub(crate) use send::Repeat;
pub use watch::{RawEvent, RawEventKind, WatchBatch, WatchStream};

use etcd_client::{Client, Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse};

use crate::api::{KeyScope, Object, ObjectKey, Secrets, Spec, StoredAs, Timestamp};
use std::sync::Arc;

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "/moor/";

/// Keys per page when listing: thousands, not hundreds (DESIGN: 100k keys list in 0.45 s
/// at 10k per page and 3.5 s at 500).
pub const DEFAULT_PAGE_SIZE: i64 = 5_000;

/// A leader's fence: writes succeed only while `key` still has this create revision and
/// still lives on this lease, i.e. while the election that made this process leader
/// still stands. A key deleted and made again has another create revision; a key
/// overwritten in place (a put strips its lease) has another lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    /// The full election key.
    pub key: String,
    /// Its create_revision when this process won.
    pub create_revision: i64,
    /// The leader's lease, which the key must still carry (0: the key has none).
    pub lease: i64,
}

/// The key (below the prefix) where a controller holding the cluster's key file says
/// so; it holds key ids only, never a key.
pub const SEALING_KEY: &str = "sealing";

/// The value at [`SEALING_KEY`].
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct SealingMarker {
    key_ids: Vec<String>,
}

/// What a delete did.
#[derive(Debug)]
pub enum Deleted<S: Spec> {
    /// The key is gone.
    Gone,
    /// Finalizers remain: deletion_timestamp is set and the object waits for them.
    Finalizing(Box<Object<S>>),
}

/// A page-by-page list result at one revision.
#[derive(Debug)]
pub struct List<S: Spec> {
    /// Every valid object under the prefix.
    pub items: Vec<Object<S>>,
    /// One error per malformed value, each naming its key; they do not stop the list.
    pub malformed: Vec<StoreError>,
    /// The revision the list is consistent at; watch from `revision + 1`.
    pub revision: i64,
}

/// Whether a response was refused for exceeding the gRPC message size limit.
fn too_large(e: &etcd_client::Error) -> bool {
    e.to_string().contains("message length too large")
}

/// The typed store: a cheap handle (clone it freely) over one etcd client.
#[derive(Clone)]
pub struct Store {
    client: Client,
    prefix: String,
    page_size: i64,
    fence: Option<Fence>,
    codec: Codec,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("prefix", &self.prefix)
            .field("fence", &self.fence)
            .finish()
    }
}

impl Store {
    /// Connects to etcd (`http://host:port`, comma-free list) under `prefix`.
    pub async fn connect(endpoints: &[String], prefix: &str) -> Result<Store, StoreError> {
        let client = Client::connect(endpoints, Some(connect::options()))
            .await
            .map_err(StoreError::from_etcd)?;
        Ok(Store::new(client, prefix))
    }

    /// Wraps an existing client.
    pub fn new(client: Client, prefix: &str) -> Store {
        let mut prefix = prefix.to_string();
        if !prefix.ends_with('/') {
            prefix.push('/');
        }
        Store {
            client,
            prefix,
            page_size: DEFAULT_PAGE_SIZE,
            fence: None,
            codec: Codec::default(),
        }
    }

    /// The same store sealing secrets at rest with `keyring` (and opening them).
    pub fn with_keyring(mut self, keyring: Keyring) -> Store {
        self.codec = Codec::new(Some(keyring));
        self
    }

    /// The keyring secrets are sealed with, if this process holds one.
    pub fn keyring(&self) -> Option<&Keyring> {
        self.codec.keyring.as_deref()
    }

    /// How this store turns objects into bytes and back (its keyring's sealing).
    pub fn codec(&self) -> &Codec {
        &self.codec
    }

    /// The same store listing `page_size` keys per request.
    pub fn with_page_size(mut self, page_size: i64) -> Store {
        self.page_size = page_size.max(1);
        self
    }

    /// The same store whose every write also requires `fence` to hold.
    pub fn fenced(&self, fence: Fence) -> Store {
        Store {
            fence: Some(fence),
            ..self.clone()
        }
    }

    /// The key prefix, ending in `/`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The underlying etcd client, for what the typed API does not cover.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// The full etcd key of an object key such as `volumes/default/db`.
    pub fn full_key(&self, key: &str) -> String {
        format!("{}{}", self.prefix, key)
    }

    /// Writes `obj` (as read) back when [`Codec::needs_reseal`] says its secrets would
    /// be stored differently, guarded by the version it was read at (a
    /// [`StoreError::Conflict`] if it has changed since); `true` when it wrote.
    pub async fn reseal<S: Spec>(&self, obj: &Object<S>) -> Result<bool, StoreError> {
        if !self.codec.needs_reseal(obj) {
            return Ok(false);
        }
        self.write_at(obj.clone(), obj.metadata.resource_version)
            .await?;
        Ok(true)
    }

    fn check<S: Spec>(obj: &Object<S>) -> Result<(), StoreError> {
        obj.validate().map_err(|errors| StoreError::Invalid {
            kind: S::KIND,
            errors,
        })
    }

    /// Reads one object.
    pub async fn get<S: Spec>(&self, key: &ObjectKey<S>) -> Result<Object<S>, StoreError> {
        self.try_get(key)
            .await?
            .ok_or_else(|| StoreError::NotFound {
                key: key.to_string(),
            })
    }

    /// Reads one object, `None` when absent.
    pub async fn try_get<S: Spec>(
        &self,
        key: &ObjectKey<S>,
    ) -> Result<Option<Object<S>>, StoreError> {
        let key = key.as_str();
        match self.get_raw(key).await? {
            None => Ok(None),
            Some((value, revision)) => self.codec.decode::<S>(key, &value, revision).map(Some),
        }
    }

    /// The value stored at `key` (below the prefix) and its mod_revision, undecoded:
    /// for the keys that are not objects (reports, markers).
    async fn get_raw(&self, key: &str) -> Result<Option<(Vec<u8>, i64)>, StoreError> {
        let full = self.full_key(key);
        let resp = self
            .send(Repeat::Idempotent, |mut c| {
                let full = full.clone();
                async move { c.get(full, None).await }
            })
            .await
            .map_err(StoreError::from_etcd)?;
        Ok(resp
            .kvs()
            .first()
            .map(|kv| (kv.value().to_vec(), kv.mod_revision())))
    }

    /// Puts `value` at `key` (below the prefix) unconditionally: for a key that is not
    /// an object and has one writer (a report, a marker).
    async fn put_raw(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        let full = self.full_key(key);
        self.send(Repeat::OnlyUnsent, |mut c| {
            let (full, value) = (full.clone(), value.clone());
            async move { c.put(full, value, None).await }
        })
        .await
        .map_err(StoreError::from_etcd)?;
        Ok(())
    }

    /// Lists every object in `scope` (the kind, or one node's claims), in pages at one
    /// consistent revision.
    pub async fn list<S: Spec>(&self, scope: &KeyScope<S>) -> Result<List<S>, StoreError> {
        let mut list = List {
            items: Vec::new(),
            malformed: Vec::new(),
            revision: 0,
        };
        list.revision = self
            .scan(scope.as_str(), |key, value, mod_revision| {
                match self.codec.decode::<S>(key, value, mod_revision) {
                    Ok(obj) => list.items.push(obj),
                    Err(e) => list.malformed.push(e),
                }
            })
            .await?;
        Ok(list)
    }

    /// Calls `each(key below the prefix, value, mod_revision)` for every key starting
    /// with `scope` (below the prefix), in pages at one consistent revision, which it
    /// returns. A page of large values can exceed gRPC's 4 MiB message limit: then the
    /// page is halved and asked again, down to one key per request.
    pub async fn scan(
        &self,
        scope: &str,
        mut each: impl FnMut(&str, &[u8], i64),
    ) -> Result<i64, StoreError> {
        let prefix = self.full_key(scope);
        let range_end = prefix_end(prefix.as_bytes());
        let mut start = prefix.into_bytes();
        let mut revision = 0;
        let mut page = self.page_size;
        loop {
            let mut opts = GetOptions::new()
                .with_range(range_end.clone())
                .with_limit(page);
            if revision > 0 {
                opts = opts.with_revision(revision);
            }
            let resp = match self
                .send(Repeat::Idempotent, |mut c| {
                    let (start, opts) = (start.clone(), opts.clone());
                    async move { c.get(start, Some(opts)).await }
                })
                .await
            {
                Ok(resp) => resp,
                Err(e) if page > 1 && too_large(&e) => {
                    page = (page / 2).max(1);
                    continue;
                }
                Err(e) => {
                    return Err(match StoreError::from_etcd(e) {
                        StoreError::Compacted { .. } => StoreError::Compacted {
                            requested: revision,
                            compact_revision: 0,
                        },
                        other => other,
                    })
                }
            };
            if revision == 0 {
                revision = resp.header().map(|h| h.revision()).unwrap_or_default();
            }
            for kv in resp.kvs() {
                let key = String::from_utf8_lossy(&kv.key()[self.prefix.len()..]);
                each(&key, kv.value(), kv.mod_revision());
            }
            match (resp.more(), resp.kvs().last()) {
                (true, Some(last)) => {
                    start = last.key().to_vec();
                    start.push(0);
                }
                _ => return Ok(revision),
            }
        }
    }

    /// Creates an object; fails with [`StoreError::AlreadyExists`] if its key exists.
    /// Sets uid, generation 1 and the creation time; returns the object as stored.
    pub async fn create<S: Spec>(&self, obj: &Object<S>) -> Result<Object<S>, StoreError> {
        self.create_inner(obj, None).await
    }

    /// Creates an object bound to a lease: it is deleted when the lease ends.
    pub async fn create_with_lease<S: Spec>(
        &self,
        obj: &Object<S>,
        lease: LeaseId,
    ) -> Result<Object<S>, StoreError> {
        self.create_inner(obj, Some(lease)).await
    }

    /// The object as a create stores it: defaults, a new uid, generation 1, now.
    fn prepared_for_create<S: Spec>(obj: &Object<S>) -> Result<Object<S>, StoreError> {
        let mut obj = obj.clone();
        obj.apply_defaults();
        obj.metadata.uid = uuid::Uuid::new_v4().to_string();
        obj.metadata.generation = 1;
        obj.metadata.creation_timestamp = Some(Timestamp::now());
        obj.metadata.deletion_timestamp = None;
        Store::check(&obj)?;
        Ok(obj)
    }

    async fn create_inner<S: Spec>(
        &self,
        obj: &Object<S>,
        lease: Option<LeaseId>,
    ) -> Result<Object<S>, StoreError> {
        let mut obj = Store::prepared_for_create(obj)?;
        let key = obj.key();
        let full = self.full_key(&key);
        let compare = Compare::create_revision(full.clone(), CompareOp::Equal, 0);
        match self
            .guarded_put(&full, self.codec.encode(&obj)?, compare, lease)
            .await?
        {
            Ok(revision) => {
                obj.metadata.resource_version = revision;
                Ok(obj)
            }
            Err(_) => Err(StoreError::AlreadyExists { key }),
        }
    }

    /// Replaces spec, labels and finalizers of an object read at
    /// `metadata.resource_version`; a concurrent change is [`StoreError::Conflict`].
    /// Status is kept as stored (status writers use [`Store::replace_status`]);
    /// generation is bumped when the spec changed. Removing the last finalizer of an
    /// object being deleted deletes it.
    pub async fn replace<S: Spec>(&self, obj: &Object<S>) -> Result<Object<S>, StoreError> {
        let mut obj = obj.clone();
        obj.apply_defaults();
        Store::check(&obj)?;
        let current = self.current_at(&obj).await?;
        obj.metadata.uid = current.metadata.uid.clone();
        obj.metadata.creation_timestamp = current.metadata.creation_timestamp;
        obj.metadata.deletion_timestamp = current.metadata.deletion_timestamp;
        obj.metadata.generation = if obj.spec != current.spec {
            current.metadata.generation + 1
        } else {
            current.metadata.generation
        };
        obj.status = current.status;
        if obj.is_deleting() && obj.metadata.finalizers.is_empty() {
            // The deletion's revision: a cache showing an older version lags it.
            obj.metadata.resource_version = self
                .delete_at(&obj.key(), current.metadata.resource_version)
                .await?;
            return Ok(obj);
        }
        self.write_at(obj, current.metadata.resource_version).await
    }

    /// Replaces the status of an object read at `metadata.resource_version`, keeping the
    /// stored metadata and spec; a concurrent change is [`StoreError::Conflict`].
    pub async fn replace_status<S: Spec>(&self, obj: &Object<S>) -> Result<Object<S>, StoreError> {
        let mut current = self.current_at(obj).await?;
        current.status = obj.status.clone();
        let rv = current.metadata.resource_version;
        self.write_at(current, rv).await
    }

    /// Read-modify-write of a spec: reads the object, lets `f` edit its spec, and writes
    /// it back through [`Store::replace`], retrying on conflict. `f` returning false (or
    /// changing nothing) skips the write. Returns the object and whether it was written.
    pub async fn modify_spec<S: Spec>(
        &self,
        key: &ObjectKey<S>,
        mut f: impl FnMut(&mut S) -> bool,
    ) -> Result<(Object<S>, bool), StoreError> {
        loop {
            let mut obj = self.get(key).await?;
            let mut spec = obj.spec.clone();
            if !f(&mut spec) || spec == obj.spec {
                return Ok((obj, false));
            }
            obj.spec = spec;
            match self.replace(&obj).await {
                Err(StoreError::Conflict { .. }) => continue,
                other => return other.map(|o| (o, true)),
            }
        }
    }

    /// Writes `next` (spec, labels, finalizers and status) over `read`, the object as
    /// stored at `read.metadata.resource_version` (from this process's cache or its last
    /// write), guarded by that version: a concurrent change is
    /// [`StoreError::Conflict`]. For the single writer of both spec and status (the
    /// controller's claims, an agent's mounts): one write, no read first, where
    /// [`Store::replace`] then [`Store::replace_status`] cost two reads and two writes.
    /// Identity and timestamps come from `read`; generation is bumped when the spec
    /// changed. Removing the last finalizer of an object being deleted deletes it.
    ///
    /// When the key holds a malformed value instead (garbage written over it), the
    /// single writer repairs it from what it knows: `next` is written over exactly that
    /// value (guarded by its revision), with a warning naming it (see [`Batch::commit`]).
    pub async fn update<S: Spec>(
        &self,
        read: &Object<S>,
        next: &Object<S>,
    ) -> Result<Object<S>, StoreError> {
        let mut batch = Batch::default();
        let obj = batch.update(self, read, next)?;
        batch.commit_one(self, obj).await
    }

    /// Replaces the malformed value stored at `key` at `revision` with `with`, or
    /// deletes it when `with` is `None`: for the single writer of a key, which may
    /// rewrite it from what it knows. An object never stored before (no uid) is
    /// prepared as [`Store::create`] prepares one. Guarded by that revision (a
    /// [`StoreError::Conflict`] if something else was written since).
    pub async fn replace_malformed<S: Spec>(
        &self,
        key: &ObjectKey<S>,
        revision: i64,
        with: Option<&Object<S>>,
    ) -> Result<i64, StoreError> {
        tracing::warn!(key = %key.as_str(), revision, "replacing a malformed value");
        let Some(obj) = with else {
            return self.delete_at(key.as_str(), revision).await;
        };
        let obj = if obj.metadata.uid.is_empty() {
            Store::prepared_for_create(obj)?
        } else {
            obj.clone()
        };
        Ok(self
            .write_at(obj, revision)
            .await?
            .metadata
            .resource_version)
    }

    /// Read-modify-write of a status: reads the object, lets `f` edit its status, and
    /// writes it back with compare-and-swap, retrying on conflict. For writers that own
    /// one section of a status shared with another writer. `f` returning false skips the
    /// write.
    pub async fn modify_status<S: Spec>(
        &self,
        key: &ObjectKey<S>,
        mut f: impl FnMut(&Object<S>, &mut S::Status) -> bool,
    ) -> Result<Object<S>, StoreError> {
        loop {
            let mut obj = self.get(key).await?;
            let mut status = obj.status.clone();
            if !f(&obj, &mut status) || status == obj.status {
                return Ok(obj);
            }
            obj.status = status;
            let rv = obj.metadata.resource_version;
            match self.write_at(obj, rv).await {
                Err(StoreError::Conflict { .. }) => continue,
                other => return other,
            }
        }
    }

    /// Deletes an object. With `precondition`, only if it is still at that revision.
    /// An object with finalizers is not deleted but marked (deletion_timestamp) and
    /// returned as [`Deleted::Finalizing`].
    pub async fn delete<S: Spec>(
        &self,
        key: &ObjectKey<S>,
        precondition: Option<i64>,
    ) -> Result<Deleted<S>, StoreError> {
        let mut current = self.get(key).await?;
        let rv = current.metadata.resource_version;
        if let Some(expected) = precondition {
            if expected != rv {
                return Err(StoreError::Conflict {
                    key: current.key(),
                    expected,
                });
            }
        }
        if current.metadata.finalizers.is_empty() {
            self.delete_at(&current.key(), rv).await?;
            return Ok(Deleted::Gone);
        }
        if current.metadata.deletion_timestamp.is_none() {
            current.metadata.deletion_timestamp = Some(Timestamp::now());
            current = self.write_at(current, rv).await?;
        }
        Ok(Deleted::Finalizing(Box::new(current)))
    }

    /// Deletes the object as read (at its `resource_version`) without reading it
    /// first: a change since, or the object already gone, is [`StoreError::Conflict`].
    /// An object with finalizers is marked instead, as [`Store::delete`] does. Returns
    /// the revision of the deletion (or of the marking).
    pub async fn delete_read<S: Spec>(&self, read: &Object<S>) -> Result<i64, StoreError> {
        let rv = read.metadata.resource_version;
        if !read.metadata.finalizers.is_empty() {
            return match self.delete(&read.object_key(), Some(rv)).await? {
                Deleted::Gone => Ok(rv),
                Deleted::Finalizing(marked) => Ok(marked.metadata.resource_version),
            };
        }
        self.delete_at(&read.key(), rv).await
    }

    /// Reads the stored object and checks it is still at the caller's revision.
    async fn current_at<S: Spec>(&self, obj: &Object<S>) -> Result<Object<S>, StoreError> {
        let key = obj.object_key();
        let expected = obj.metadata.resource_version;
        let conflict = || StoreError::Conflict {
            key: key.to_string(),
            expected,
        };
        let current = self.try_get(&key).await?.ok_or_else(conflict)?;
        if current.metadata.resource_version != expected {
            return Err(conflict());
        }
        Ok(current)
    }

    async fn write_at<S: Spec>(
        &self,
        mut obj: Object<S>,
        revision: i64,
    ) -> Result<Object<S>, StoreError> {
        let key = obj.key();
        let full = self.full_key(&key);
        let compare = Compare::mod_revision(full.clone(), CompareOp::Equal, revision);
        // An update keeps the key's lease (a Node object lives under its agent's lease).
        let op = TxnOp::put(
            full,
            self.codec.encode(&obj)?,
            Some(PutOptions::new().with_ignore_lease()),
        );
        match self.guarded_txn(compare, op).await? {
            Ok(new_revision) => {
                obj.metadata.resource_version = new_revision;
                Ok(obj)
            }
            Err(_) => Err(StoreError::Conflict {
                key,
                expected: revision,
            }),
        }
    }

    /// Deletes `key` if it is still at `revision`; returns the deletion's revision.
    async fn delete_at(&self, key: &str, revision: i64) -> Result<i64, StoreError> {
        let full = self.full_key(key);
        let compare = Compare::mod_revision(full.clone(), CompareOp::Equal, revision);
        let op = TxnOp::delete(full, None);
        match self.guarded_txn(compare, op).await? {
            Ok(deleted_at) => Ok(deleted_at),
            Err(_) => Err(StoreError::Conflict {
                key: key.to_string(),
                expected: revision,
            }),
        }
    }

    /// Puts `value` at `key` if `compare` (and the fence, if any) holds. `Ok(Err(()))`
    /// means the compare failed.
    async fn guarded_put(
        &self,
        key: &str,
        value: Vec<u8>,
        compare: Compare,
        lease: Option<LeaseId>,
    ) -> Result<Result<i64, ()>, StoreError> {
        let opts = lease.map(|l| PutOptions::new().with_lease(l.0));
        self.guarded_txn(compare, TxnOp::put(key, value, opts))
            .await
    }

    /// Runs `op` if `compare` and the fence hold; tells a lost fence apart from a failed
    /// compare by reading the fence key in the else branch.
    async fn guarded_txn(
        &self,
        compare: Compare,
        op: TxnOp,
    ) -> Result<Result<i64, ()>, StoreError> {
        self.guarded_txn_all(vec![compare], vec![op]).await
    }

    /// Runs every op if every compare and the fence hold, as one transaction.
    async fn guarded_txn_all(
        &self,
        compares: Vec<Compare>,
        ops: Vec<TxnOp>,
    ) -> Result<Result<i64, ()>, StoreError> {
        Ok(self
            .guarded_txn_fetch(compares, ops, Vec::new())
            .await?
            .map_err(|_| ()))
    }

    /// [`Store::guarded_txn_all`] that, when a compare fails, returns what is stored at
    /// each of `fetch` (full keys): `(full key, value, mod_revision)`.
    async fn guarded_txn_fetch(
        &self,
        mut compares: Vec<Compare>,
        ops: Vec<TxnOp>,
        fetch: Vec<String>,
    ) -> Result<Result<i64, Vec<(String, Vec<u8>, i64)>>, StoreError> {
        let mut otherwise: Vec<TxnOp> = fetch.into_iter().map(|k| TxnOp::get(k, None)).collect();
        if let Some(fence) = &self.fence {
            compares.push(Compare::create_revision(
                fence.key.clone(),
                CompareOp::Equal,
                fence.create_revision,
            ));
            compares.push(Compare::lease(
                fence.key.clone(),
                CompareOp::Equal,
                fence.lease,
            ));
            otherwise.push(TxnOp::get(fence.key.clone(), None));
        }
        let txn = Txn::new().when(compares).and_then(ops).or_else(otherwise);
        let resp = self
            .send(Repeat::OnlyUnsent, |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await
            .map_err(StoreError::from_etcd)?;
        let revision = resp.header().map(|h| h.revision()).unwrap_or_default();
        if resp.succeeded() {
            return Ok(Ok(revision));
        }
        let found: Vec<(String, Vec<u8>, i64)> = resp
            .op_responses()
            .iter()
            .filter_map(|r| match r {
                TxnOpResponse::Get(g) => g.kvs().first().map(|kv| {
                    (
                        String::from_utf8_lossy(kv.key()).into_owned(),
                        kv.value().to_vec(),
                        kv.mod_revision(),
                    )
                }),
                _ => None,
            })
            .collect();
        if let Some(fence) = &self.fence {
            let held = resp.op_responses().iter().any(|r| match r {
                TxnOpResponse::Get(g) => g.kvs().first().is_some_and(|kv| {
                    kv.key() == fence.key.as_bytes()
                        && kv.create_revision() == fence.create_revision
                        && kv.lease() == fence.lease
                }),
                _ => false,
            });
            if !held {
                return Err(StoreError::Deposed {
                    fence_key: fence.key.clone(),
                });
            }
        }
        Ok(Err(found))
    }

    /// The key ids of the cluster's key file, as its controller last declared them at
    /// [`SEALING_KEY`]: `Some` when the cluster seals secrets at rest (a writer without
    /// the key file would leave them in clear in etcd's history and WAL).
    pub async fn sealing(&self) -> Result<Option<Vec<String>>, StoreError> {
        Ok(self.get_raw(SEALING_KEY).await?.map(|(value, _)| {
            serde_json::from_slice::<SealingMarker>(&value)
                .map(|m| m.key_ids)
                .unwrap_or_default()
        }))
    }

    /// Declares that this cluster seals secrets with the keys of this store's key file
    /// (the controller, at each election it wins); no write when already declared.
    pub async fn declare_sealing(&self) -> Result<(), StoreError> {
        let Some(keyring) = self.keyring().filter(|k| k.node().is_none()) else {
            return Ok(());
        };
        let ids = keyring.ids();
        if self.sealing().await?.as_ref() == Some(&ids) {
            return Ok(());
        }
        // A list of strings always serializes.
        let value = serde_json::to_vec(&SealingMarker { key_ids: ids }).unwrap_or_default();
        self.put_raw(SEALING_KEY, value).await
    }

    /// Node `node`'s force-detach declarations ([`crate::api::declarations_key`]) and
    /// the mod_revision they were read at (0: none). A malformed value is an error
    /// naming it.
    pub async fn declarations(
        &self,
        node: &crate::api::NodeName,
    ) -> Result<(crate::api::Declarations, i64), StoreError> {
        let key = crate::api::declarations_key(node);
        let Some((value, revision)) = self.get_raw(&key).await? else {
            return Ok((crate::api::Declarations::default(), 0));
        };
        crate::api::Declarations::parse(&value)
            .map(|d| (d, revision))
            .map_err(|why| StoreError::Malformed {
                key,
                revision,
                cause: MalformedCause::Report(why),
            })
    }

    /// Plugin `id`'s last capacity report ([`crate::api::capacity_key`]); `None` when
    /// none was written. A malformed one is an error naming it.
    pub async fn capacity(
        &self,
        id: &crate::api::PluginId,
    ) -> Result<Option<Vec<crate::api::CapacityEntry>>, StoreError> {
        let key = crate::api::capacity_key(id);
        let Some((value, revision)) = self.get_raw(&key).await? else {
            return Ok(None);
        };
        crate::api::parse_capacity(&value)
            .map(Some)
            .map_err(|why| StoreError::Malformed {
                key,
                revision,
                cause: MalformedCause::Report(why),
            })
    }

    /// Writes plugin `id`'s capacity report (the leader of its controller plugin).
    pub async fn put_capacity(
        &self,
        id: &crate::api::PluginId,
        entries: &[crate::api::CapacityEntry],
    ) -> Result<(), StoreError> {
        let value = serde_json::to_vec(entries).unwrap_or_default();
        self.put_raw(&crate::api::capacity_key(id), value).await
    }

    /// The alarms etcd's members have raised, as `(member id, alarm)` (`NOSPACE`,
    /// `CORRUPT`); empty where the server does not implement alarms (the embedded
    /// store, which has no quota).
    pub async fn alarms(&self) -> Result<Vec<(u64, String)>, StoreError> {
        use etcd_client::{AlarmAction, AlarmType};
        let resp = self
            .send(Repeat::Idempotent, |mut c| async move {
                c.alarm(AlarmAction::Get, AlarmType::None, None).await
            })
            .await;
        match resp {
            Ok(r) => Ok(r
                .alarms()
                .iter()
                .filter(|a| a.alarm() != AlarmType::None)
                .map(|a| (a.member_id(), format!("{:?}", a.alarm()).to_uppercase()))
                .collect()),
            Err(etcd_client::Error::GRpcStatus(s)) if s.code() == tonic::Code::Unimplemented => {
                Ok(Vec::new())
            }
            Err(e) => Err(StoreError::from_etcd(e)),
        }
    }

    /// Compacts etcd's history up to `revision` (tests and maintenance).
    pub async fn compact(&self, revision: i64) -> Result<(), StoreError> {
        self.send(Repeat::Idempotent, |mut c| async move {
            c.compact(revision, None).await
        })
        .await
        .map_err(StoreError::from_etcd)?;
        Ok(())
    }
}

/// The end of the range of keys starting with `prefix` (etcd's prefix_end rule).
pub(crate) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// What a sealed field is bound to: its object's key and its name.
fn aad(key: &str, field: &str) -> String {
    format!("{key}#{field}")
}

/// How objects are stored as bytes: JSON, with secrets sealed when a keyring is held.
#[derive(Debug, Clone, Default)]
pub struct Codec {
    keyring: Option<Arc<Keyring>>,
}

impl Codec {
    /// A codec sealing with `keyring` (storing secrets as given without one).
    pub fn new(keyring: Option<Keyring>) -> Codec {
        Codec {
            keyring: keyring.map(Arc::new),
        }
    }

    /// Decodes and checks a value read at `key` (below the prefix), opening its sealed
    /// secrets with this store's keyring where it holds their key.
    pub fn decode<S: Spec>(
        &self,
        key: &str,
        value: &[u8],
        mod_revision: i64,
    ) -> Result<Object<S>, StoreError> {
        let malformed = |cause| StoreError::Malformed {
            key: key.to_string(),
            revision: mod_revision,
            cause,
        };
        if value.len() > S::MAX_BYTES {
            return Err(malformed(MalformedCause::TooLarge {
                kind: S::KIND,
                bytes: value.len(),
                max: S::MAX_BYTES,
            }));
        }
        let mut obj: Object<S> =
            serde_json::from_slice(value).map_err(|e| malformed(MalformedCause::Json(e)))?;
        obj.validate()
            .map_err(|e| malformed(MalformedCause::Invalid(e)))?;
        let actual = obj.key();
        if actual != key {
            return Err(malformed(MalformedCause::WrongKey { actual }));
        }
        if let Some(keyring) = &self.keyring {
            for field in obj.spec.secret_fields() {
                let Some(text) = field.secrets.sealed() else {
                    continue;
                };
                match keyring.open_map(field.node, &aad(key, field.field), text) {
                    Ok((map, id)) => *field.secrets = Secrets::opened(map, &id),
                    // Kept sealed: written back as read, never exposed.
                    Err(OpenError::NotHeld(_)) => {}
                    Err(e) => return Err(malformed(MalformedCause::Sealed(e))),
                }
            }
        }
        obj.metadata.resource_version = mod_revision;
        Ok(obj)
    }

    /// The bytes stored for `obj`, its open secrets sealed when this store has a
    /// keyring (stored as given without one).
    pub fn encode<S: Spec>(&self, obj: &Object<S>) -> Result<Vec<u8>, StoreError> {
        let mut stored = obj.clone();
        stored.metadata.resource_version = 0;
        if let Some(keyring) = &self.keyring {
            let key = obj.key();
            for field in stored.spec.secret_fields() {
                // Sealed text kept as read, nothing to seal, or secrets this keyring
                // does not serve (a node agent writing a volume's status): as given.
                let Ok(values) = field.secrets.expose() else {
                    continue;
                };
                if values.is_empty() || !keyring.serves(field.node) {
                    continue;
                }
                let aad = aad(&key, field.field);
                let text = keyring.seal_map(field.node, &aad, values).map_err(|e| {
                    StoreError::Sealing {
                        key: key.clone(),
                        cause: e,
                    }
                })?;
                *field.secrets = Secrets::sealed_text(text);
            }
        }
        // Serialising our own types to JSON cannot fail: every map key is a string.
        Ok(serde_json::to_vec(&stored).unwrap_or_default())
    }

    /// Whether `obj` (as read) has secrets this store would store differently: in
    /// plain text, or sealed with a key other than the one that seals now. Only a
    /// store with the cluster's keys answers yes.
    pub fn needs_reseal<S: Spec>(&self, obj: &Object<S>) -> bool {
        let Some(keyring) = self.keyring.as_deref().filter(|k| k.node().is_none()) else {
            return false;
        };
        let mut spec = obj.spec.clone();
        let fields = spec.secret_fields();
        fields.iter().any(|f| match f.secrets.stored_as() {
            Some(StoredAs::Plain) => !f.secrets.is_empty(),
            Some(StoredAs::Key(id)) => id != keyring.primary_id(),
            None => false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::*;

    #[test]
    fn prefix_end_increments_the_last_byte() {
        assert_eq!(prefix_end(b"/moor/volumes/"), b"/moor/volumes0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff"), vec![0]);
    }

    #[test]
    fn decode_rejects_garbage_naming_the_key() {
        let err = Codec::default()
            .decode::<VolumeSpec>("volumes/default/v", b"{not json", 3)
            .unwrap_err();
        assert!(matches!(
            &err,
            StoreError::Malformed { key, revision: 3, cause: MalformedCause::Json(_) } if key == "volumes/default/v"
        ));
    }

    #[test]
    fn decode_rejects_an_object_stored_under_another_key() {
        let spec = VolumeSpec {
            plugin_id: PluginId::new("p").unwrap(),
            capabilities: vec![VolumeCapability {
                access_mode: AccessMode::SingleNodeWriter,
                attachment_mode: AttachmentMode::FileSystem,
            }],
            ..Default::default()
        };
        let v = Volume::new(&Namespace::default_ns(), Name::new("a").unwrap(), spec);
        let bytes = Codec::default().encode(&v).unwrap();
        assert!(Codec::default()
            .decode::<VolumeSpec>("volumes/default/a", &bytes, 7)
            .is_ok());
        let err = Codec::default()
            .decode::<VolumeSpec>("volumes/default/b", &bytes, 7)
            .unwrap_err();
        assert!(matches!(
            err,
            StoreError::Malformed {
                cause: MalformedCause::WrongKey { .. },
                ..
            }
        ));
        let decoded = Codec::default()
            .decode::<VolumeSpec>("volumes/default/a", &bytes, 7)
            .unwrap();
        assert_eq!(decoded.metadata.resource_version, 7);
    }

    fn volume_with_secret(name: &str) -> Volume {
        let spec = VolumeSpec {
            plugin_id: PluginId::new("p").unwrap(),
            capabilities: vec![VolumeCapability {
                access_mode: AccessMode::SingleNodeWriter,
                attachment_mode: AttachmentMode::FileSystem,
            }],
            secrets: Secrets::new([("token".to_string(), "hunter2".to_string())].into()),
            ..Default::default()
        };
        Volume::new(&Namespace::default_ns(), Name::new(name).unwrap(), spec)
    }

    fn keyring(id: &str) -> Keyring {
        Keyring::parse(&Keyring::generate(id).unwrap()).unwrap()
    }

    #[test]
    fn secrets_are_sealed_at_rest_and_open_only_for_key_holders() {
        let k1 = Codec::new(Some(keyring("k1")));
        let v = volume_with_secret("a");
        let bytes = k1.encode(&v).unwrap();
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(!text.contains("hunter2"), "{text}");
        assert!(text.contains("moor:sealed:v1:k1:"), "{text}");
        let read = k1
            .decode::<VolumeSpec>("volumes/default/a", &bytes, 2)
            .unwrap();
        assert_eq!(read.spec.secrets, v.spec.secrets);
        assert!(!k1.needs_reseal(&read));
        // Without the key: readable, kept sealed, written back unchanged, never exposed.
        let plain = Codec::default();
        let read = plain
            .decode::<VolumeSpec>("volumes/default/a", &bytes, 2)
            .unwrap();
        assert!(read
            .spec
            .secrets
            .expose()
            .unwrap_err()
            .to_string()
            .contains("\"k1\""));
        let again = plain.encode(&read).unwrap();
        assert_eq!(String::from_utf8(again).unwrap(), text);
        // Moved to another object's key (with its name changed to match): refused.
        let moved = text.replace("\"name\":\"a\"", "\"name\":\"b\"");
        let err = k1
            .decode::<VolumeSpec>("volumes/default/b", moved.as_bytes(), 2)
            .unwrap_err();
        assert!(
            matches!(
                err,
                StoreError::Malformed {
                    cause: MalformedCause::Sealed(OpenError::Corrupt(_)),
                    ..
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn plain_or_old_key_secrets_are_read_and_flagged_for_rewriting() {
        let v = volume_with_secret("a");
        let legacy = Codec::default().encode(&v).unwrap();
        assert!(String::from_utf8(legacy.clone())
            .unwrap()
            .contains("hunter2"));
        let k1 = Codec::new(Some(keyring("k1")));
        let read = k1
            .decode::<VolumeSpec>("volumes/default/a", &legacy, 2)
            .unwrap();
        assert_eq!(read.spec.secrets, v.spec.secrets);
        assert!(k1.needs_reseal(&read), "plain text is rewritten sealed");
        // Rotation: sealed with old, read by a keyring whose first key is new.
        let old_file = Keyring::generate("old").unwrap();
        let old = Keyring::parse(&old_file).unwrap();
        let sealed_old = Codec::new(Some(old.clone())).encode(&v).unwrap();
        let entries = |file: &str| file.split_once("keys:\n").unwrap().1.to_string();
        let both = format!(
            "{}{}",
            Keyring::generate("new").unwrap(),
            entries(&old_file)
        );
        let rotated = Codec::new(Some(Keyring::parse(&both).unwrap()));
        let read = rotated
            .decode::<VolumeSpec>("volumes/default/a", &sealed_old, 2)
            .unwrap();
        assert_eq!(read.spec.secrets, v.spec.secrets);
        assert!(
            rotated.needs_reseal(&read),
            "sealed with a key that no longer seals"
        );
        let resealed = rotated.encode(&read).unwrap();
        assert!(String::from_utf8(resealed)
            .unwrap()
            .contains("moor:sealed:v1:new:"));
        // A process without the cluster's keys never rewrites.
        let n1 = Codec::new(Some(Keyring::parse(&old.for_node("n1").unwrap()).unwrap()));
        let read = n1
            .decode::<VolumeSpec>("volumes/default/a", &legacy, 2)
            .unwrap();
        assert!(!n1.needs_reseal(&read));
    }
}
