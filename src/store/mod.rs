//! The typed store over the etcd v3 API.
//!
//! One JSON object per key, `<prefix><kind dir>/<suffix>` (see [`Spec::key_suffix`]).
//! Every value read is untrusted: it is decoded, checked against its key and validated,
//! and a bad one becomes [`StoreError::Malformed`] naming the key, never a panic.
//! Writes are compare-and-swap on `mod_revision` (the objects' `resource_version`), and a
//! leader's writes can be fenced on its election key ([`Store::fenced`]).
//!
//! # Layout
//! - `mod.rs`: the object reads and writes.
//! - `txn`: the guarded transactions under every write.
//! - `batch`: several guarded writes as one transaction, all or none.
//! - `group`: group commit of concurrent guarded writes.
//! - `send`: a request sent again when no member took it.
//! - `codec`: the bytes: JSON, the key check, validation, sealing.
//! - `raw`: the keys that are not objects, and etcd's maintenance calls.
//! - `watch`: raw prefix watches.
//! - `lease`: leases: grant, keep alive, revoke.
//! - `seal`: secrets at rest: the keyring that seals and opens them.
//! - `connect`: how a process reaches etcd (endpoints, prefix, TLS, user).
//! - `identity`: who the connection is to etcd (a certificate's CN, a user), for
//!   refusals that name it.
//! - `error`: every etcd failure classified.

mod batch;
mod codec;
mod connect;
mod error;
mod group;
mod identity;
mod lease;
mod raw;
mod seal;
mod send;
mod txn;
mod watch;

pub use batch::Batch;
pub use codec::Codec;
pub use connect::EtcdAuth;
pub use error::{bounded_chain, Access, MalformedCause, StoreError, NOSPACE_HELP};
pub use identity::common_name_of_pem;
pub use lease::{KeepAlive, LeaseId};
pub use raw::{Declared, SEALING_KEY};
pub use seal::{Keyring, KeyringError, OpenError, SealError};
pub(crate) use send::Repeat;
pub use watch::{RawEvent, RawEventKind, WatchBatch, WatchStream};

use etcd_client::{Client, Compare, CompareOp, GetOptions};
use std::marker::PhantomData;
use std::sync::Arc;

use crate::api::{self, KeyScope, Object, ObjectKey, Spec, Timestamp};

/// The default key prefix.
pub const DEFAULT_PREFIX: &str = "/moor/";

/// How many times a write that names no version (a delete, an edit of a spec or a
/// status section by read-modify-write) is tried before its conflict is returned. Each
/// try reads again and writes guarded by what it read, so it loses only to a write that
/// lands between its own read and write: a reconciler's status write, most often. A
/// person's `moorctl delete` must not fail on that (a fresh clone's tests did, under
/// load); losing this many times in a row, with [`ConflictRetry`]'s pauses between,
/// means a writer that never stops, and the caller hears of it.
pub const UNVERSIONED_WRITE_ATTEMPTS: u32 = 24;

/// The tries of one write that names no version, after each conflict: the one place
/// that bounds them ([`UNVERSIONED_WRITE_ATTEMPTS`]) and paces them (0.5-1 ms doubling
/// to 25-50 ms, jittered, so that two writers that raced once do not race again in
/// step). Only for writes that name no version: one that names the version its caller
/// saw must refuse a stale copy, not retry it.
#[derive(Debug, Default)]
pub struct ConflictRetry {
    conflicts: u32,
}

impl ConflictRetry {
    /// After a conflict: pauses and answers true while a try is left, false (at once)
    /// when the write has lost [`UNVERSIONED_WRITE_ATTEMPTS`] times.
    pub async fn again(&mut self) -> bool {
        self.conflicts += 1;
        if self.conflicts >= UNVERSIONED_WRITE_ATTEMPTS {
            return false;
        }
        let pause = crate::backoff::Backoff::new(
            std::time::Duration::from_millis(1),
            std::time::Duration::from_millis(50),
        )
        .delay(self.conflicts);
        tokio::time::sleep(pause).await;
        true
    }
}

/// Runs `step`, a read followed by a write guarded by what it read, again while it
/// answers [`StoreError::Conflict`], as [`ConflictRetry`] allows.
pub async fn retry_conflicts<T, F, Fut>(mut step: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let mut retry = ConflictRetry::default();
    loop {
        match step().await {
            Err(StoreError::Conflict { .. }) if retry.again().await => {}
            other => return other,
        }
    }
}

/// Keys per page when a list starts: thousands, not hundreds (DESIGN: 100k keys list in
/// 0.45 s at 10k per page and 3.5 s at 500).
pub const DEFAULT_PAGE_SIZE: i64 = 5_000;

/// How long one request to etcd (every attempt of it, see `send.rs`) may take before it
/// fails as unavailable: a paused or wedged member accepts connections (the kernel
/// completes the handshake) and never answers, and without a bound the caller would
/// wait for ever. Long enough for a page of [`DEFAULT_PAGE_SIZE`] objects from a loaded
/// etcd; moorctl sets its own (`--request-timeout`).
pub const DEFAULT_REQUEST_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// At most about this many pages per list, whatever its length. Every etcd release to
/// date walks the whole rest of the range on each limited request, to count it
/// (etcd-io/etcd#11057; the limit's push-down was reverted in #13060), so N keys in
/// pages of a fixed P cost N²/2P index visits: a million claims in pages of 2,500 (what
/// 4 MiB held) took 55 s to list, and the controller 147 s to sync. Pages sized from the
/// count each answer carries keep a list at about this many walks of its range.
pub const PAGES_PER_LIST: i64 = 16;

/// The most keys a list asks for in one page.
pub const MAX_PAGE_SIZE: i64 = 200_000;

/// The largest list response accepted (tonic's default is 4 MiB): a page is sized to
/// half of it from the bytes per key seen so far, and one that still outgrows it is
/// halved and asked again.
pub const MAX_LIST_RESPONSE_BYTES: usize = 64 << 20;

/// The next page's size, after a page of `keys` keys holding `bytes` of keys and values
/// came back with `remaining` keys after it in the range: at least `floor` (the store's
/// page size) and enough for the rest in [`PAGES_PER_LIST`] pages, but no more keys
/// than half of [`MAX_LIST_RESPONSE_BYTES`] holds at this page's bytes per key, nor
/// [`MAX_PAGE_SIZE`].
pub fn next_page_size(floor: i64, keys: usize, bytes: usize, remaining: i64) -> i64 {
    let want = floor.max((remaining.max(0) + PAGES_PER_LIST - 1) / PAGES_PER_LIST);
    let per_key = (bytes / keys.max(1)).max(1);
    let fits = i64::try_from(MAX_LIST_RESPONSE_BYTES / 2 / per_key).unwrap_or(i64::MAX);
    want.min(fits).clamp(1, MAX_PAGE_SIZE)
}

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
pub struct List<S: Spec, T = Object<S>> {
    /// Every valid object under the prefix.
    pub items: Vec<T>,
    /// One error per malformed value, each naming its key; they do not stop the list.
    pub malformed: Vec<StoreError>,
    /// The revision the list is consistent at; watch from `revision + 1`.
    pub revision: i64,
    kind: PhantomData<S>,
}

/// Whether a response was refused for exceeding the gRPC message size limit.
/// Runs `work` (CPU for a while without an await: a page of tens of thousands of
/// objects decoded) where it does not hold up the runtime's other tasks: on a
/// multi-threaded runtime the worker running it hands its other tasks to another
/// worker first (`block_in_place`), so that a leader's renewal, a node's heartbeat or a
/// timer is not kept waiting behind a list. Inline on a current-thread runtime.
fn off_the_workers(work: &mut dyn FnMut()) {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(work),
        _ => work(),
    }
}

fn too_large(e: &etcd_client::Error) -> bool {
    e.to_string().contains("message length too large")
}

/// The typed store: a cheap handle (clone it freely) over one etcd client.
#[derive(Clone)]
pub struct Store {
    client: Client,
    prefix: String,
    page_size: i64,
    /// See [`DEFAULT_REQUEST_DEADLINE`].
    deadline: std::time::Duration,
    fence: Option<Fence>,
    codec: Codec,
    /// The committer its guarded writes go through (see [`group`]); `None` for the
    /// committer's own handle.
    group: Option<Arc<group::Group>>,
    /// Writes waiting to ride with another write of this connection (see [`group`]).
    riders: Arc<group::Riders>,
    /// The etcd user it is, when known (see [`identity`]): refusals name it.
    identity: Option<Arc<str>>,
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
            deadline: DEFAULT_REQUEST_DEADLINE,
            fence: None,
            codec: Codec::default(),
            group: Some(Arc::default()),
            riders: Arc::default(),
            identity: None,
        }
    }

    /// The same store known to be the etcd user `name` (its refusals say so).
    pub fn with_identity(mut self, name: Option<String>) -> Store {
        self.identity = name.map(Arc::from);
        self
    }

    /// The etcd user it connects as, when known: a `--user` name or its client
    /// certificate's CN.
    pub fn identity(&self) -> Option<&str> {
        self.identity.as_deref()
    }

    /// `e` as [`StoreError::refused`] words a refusal of `access` to `what` by this
    /// store's identity.
    pub(crate) fn refusal(
        &self,
        e: etcd_client::Error,
        access: Access,
        what: impl FnOnce() -> String,
    ) -> StoreError {
        StoreError::refused(e, self.identity(), access, what)
    }

    /// The same store bounding each request by `deadline` (at least 100 ms) instead of
    /// [`DEFAULT_REQUEST_DEADLINE`]; a watch that hears nothing, not even the answer to
    /// a progress request, for about twice as long fails the same way.
    pub fn with_deadline(mut self, deadline: std::time::Duration) -> Store {
        self.deadline = deadline.max(std::time::Duration::from_millis(100));
        self
    }

    /// How long a request may take (see [`Store::with_deadline`]).
    pub fn deadline(&self) -> std::time::Duration {
        self.deadline
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
        // Its writes carry another guard: a committer of their own.
        Store {
            fence: Some(fence),
            group: Some(Arc::default()),
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
    /// [`StoreError::Conflict`] if it has changed since); the object as written, when
    /// it wrote.
    pub async fn reseal<S: Spec>(&self, obj: &Object<S>) -> Result<Option<Object<S>>, StoreError> {
        if !self.codec.needs_reseal(obj) {
            return Ok(None);
        }
        let written = self
            .write_at(obj.clone(), obj.metadata.resource_version)
            .await?;
        Ok(Some(written))
    }

    fn check<S: Spec>(obj: &Object<S>) -> Result<(), StoreError> {
        obj.validate_stored().map_err(|errors| StoreError::Invalid {
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
    /// for the keys that are not objects (reports, markers, election records).
    pub async fn get_raw(&self, key: &str) -> Result<Option<(Vec<u8>, i64)>, StoreError> {
        let full = self.full_key(key);
        let resp = self
            .send(Repeat::Idempotent, |mut c| {
                let full = full.clone();
                async move { c.get(full, None).await }
            })
            .await
            .map_err(|e| self.refusal(e, Access::Read, || api::printable(&full)))?;
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
        .map_err(|e| self.refusal(e, Access::Write, || api::printable(&full)))?;
        Ok(())
    }

    /// Lists every object in `scope` (the kind, or one node's claims), in pages at one
    /// consistent revision.
    pub async fn list<S: Spec>(&self, scope: &KeyScope<S>) -> Result<List<S>, StoreError> {
        self.list_as(scope, Some).await
    }

    /// [`Store::list`] of what `make` makes of each object as it is decoded (shared, as
    /// a cache keeps it), leaving out those it makes nothing of: a list of 100,000
    /// objects never holds them all decoded at once (see `runtime::watcher::Make`).
    pub async fn list_making<S: Spec, T>(
        &self,
        scope: &KeyScope<S>,
        make: &(dyn Fn(Object<S>) -> Option<Arc<T>> + Send + Sync),
    ) -> Result<List<S, Arc<T>>, StoreError> {
        self.list_as(scope, make).await
    }

    async fn list_as<S: Spec, T>(
        &self,
        scope: &KeyScope<S>,
        wrap: impl Fn(Object<S>) -> Option<T>,
    ) -> Result<List<S, T>, StoreError> {
        let mut list = List {
            items: Vec::new(),
            malformed: Vec::new(),
            revision: 0,
            kind: PhantomData,
        };
        list.revision = self
            .scan(scope.as_str(), |key, value, mod_revision| {
                match self.codec.decode::<S>(key, value, mod_revision) {
                    Ok(obj) => list.items.extend(wrap(obj)),
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
                .send(Repeat::Idempotent, |c| {
                    let (start, opts) = (start.clone(), opts.clone());
                    let mut kv = c
                        .kv_client()
                        .max_decoding_message_size(MAX_LIST_RESPONSE_BYTES);
                    async move { kv.get(start, Some(opts)).await }
                })
                .await
            {
                Ok(resp) => resp,
                Err(e) if page > 1 && too_large(&e) => {
                    page = (page / 2).max(1);
                    continue;
                }
                Err(e) => {
                    let below = || format!("keys below {}", api::printable(&self.full_key(scope)));
                    return Err(match self.refusal(e, Access::Read, below) {
                        StoreError::Compacted { .. } => StoreError::Compacted {
                            requested: revision,
                            compact_revision: 0,
                        },
                        other => other,
                    });
                }
            };
            if revision == 0 {
                revision = resp.header().map(|h| h.revision()).unwrap_or_default();
            }
            let mut bytes = 0;
            let mut page_each = || {
                for kv in resp.kvs() {
                    let key = String::from_utf8_lossy(&kv.key()[self.prefix.len()..]);
                    each(&key, kv.value(), kv.mod_revision());
                    bytes += kv.key().len() + kv.value().len();
                }
            };
            off_the_workers(&mut page_each);
            let remaining = resp.count() - resp.kvs().len() as i64;
            page = next_page_size(self.page_size, resp.kvs().len(), bytes, remaining);
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
        obj.metadata.uid = crate::api::Uid::random();
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
        self.replace_over(current, obj).await
    }

    /// [`Store::replace`]'s write of `obj` (defaulted and checked) over `current`, the
    /// object as stored at its `resource_version`, guarded by that version.
    async fn replace_over<S: Spec>(
        &self,
        current: Object<S>,
        mut obj: Object<S>,
    ) -> Result<Object<S>, StoreError> {
        obj.metadata.uid = current.metadata.uid;
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
    /// it back through [`Store::replace`], retrying on conflict (bounded: see
    /// [`retry_conflicts`]). `f` returning false (or changing nothing) skips the write.
    /// Returns the object and whether it was written.
    pub async fn modify_spec<S: Spec>(
        &self,
        key: &ObjectKey<S>,
        mut f: impl FnMut(&mut S) -> bool,
    ) -> Result<(Object<S>, bool), StoreError> {
        let mut retry = ConflictRetry::default();
        loop {
            let read = self.get(key).await?;
            let mut spec = read.spec.clone();
            if !f(&mut spec) || spec == read.spec {
                return Ok((read, false));
            }
            // Written over the object just read, guarded by its version (a change
            // since is a conflict, read again): one read, not replace's second.
            let mut obj = read.clone();
            obj.spec = spec;
            obj.apply_defaults();
            Store::check(&obj)?;
            match self.replace_over(read, obj).await {
                Err(StoreError::Conflict { .. }) if retry.again().await => {}
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
    /// writes it back with compare-and-swap, retrying on conflict (bounded: see
    /// [`retry_conflicts`]). For writers that own one section of a status shared with
    /// another writer. `f` returning false skips the write.
    pub async fn modify_status<S: Spec>(
        &self,
        key: &ObjectKey<S>,
        mut f: impl FnMut(&Object<S>, &mut S::Status) -> bool,
    ) -> Result<Object<S>, StoreError> {
        let mut retry = ConflictRetry::default();
        loop {
            let mut obj = self.get(key).await?;
            let mut status = obj.status.clone();
            if !f(&obj, &mut status) || status == obj.status {
                return Ok(obj);
            }
            obj.status = status;
            let rv = obj.metadata.resource_version;
            match self.write_at(obj, rv).await {
                Err(StoreError::Conflict { .. }) if retry.again().await => {}
                other => return other,
            }
        }
    }

    /// Deletes an object. With `precondition`, only if it is still at that revision (a
    /// change since is [`StoreError::Conflict`]); without, whatever version is stored
    /// when the delete lands: a write between this read and the delete (a reconciler's
    /// status) is read again, bounded by [`retry_conflicts`]. An object with finalizers
    /// is not deleted but marked (deletion_timestamp) and returned as
    /// [`Deleted::Finalizing`].
    pub async fn delete<S: Spec>(
        &self,
        key: &ObjectKey<S>,
        precondition: Option<i64>,
    ) -> Result<Deleted<S>, StoreError> {
        match precondition {
            Some(_) => self.delete_once(key, precondition).await,
            None => retry_conflicts(|| self.delete_once(key, None)).await,
        }
    }

    /// One read-then-delete (or mark) of [`Store::delete`], guarded by the version read.
    async fn delete_once<S: Spec>(
        &self,
        key: &ObjectKey<S>,
        precondition: Option<i64>,
    ) -> Result<Deleted<S>, StoreError> {
        let mut current = self.get(key).await?;
        let rv = current.metadata.resource_version;
        if let Some(why) = current.spec.deletion_refused() {
            return Err(StoreError::Protected {
                key: current.key(),
                why,
            });
        }
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
        if let Some(why) = read.spec.deletion_refused() {
            return Err(StoreError::Protected {
                key: read.key(),
                why,
            });
        }
        if !read.metadata.finalizers.is_empty() {
            return match self.delete(&read.object_key(), Some(rv)).await? {
                Deleted::Gone => Ok(rv),
                Deleted::Finalizing(marked) => Ok(marked.metadata.resource_version),
            };
        }
        self.delete_at(&read.key(), rv).await
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_increments_the_last_byte() {
        assert_eq!(prefix_end(b"/moor/volumes/"), b"/moor/volumes0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff"), vec![0]);
    }

    #[test]
    fn a_list_takes_about_pages_per_list_pages_within_the_response_limit() {
        // 100,000 claims of about 1 KB: the floor is more than a sixteenth of the rest.
        assert_eq!(next_page_size(5_000, 5_000, 5_000_000, 95_000), 5_938);
        // A million of 400 bytes: a sixteenth of the rest per page; of 1 KB, as many as
        // half the response limit holds.
        assert_eq!(next_page_size(5_000, 5_000, 2_000_000, 995_000), 62_188);
        assert_eq!(next_page_size(5_000, 5_000, 5_000_000, 995_000), 33_554);
        // Tiny objects: capped.
        assert_eq!(
            next_page_size(5_000, 5_000, 50_000, 100_000_000),
            MAX_PAGE_SIZE
        );
        // 1.4 MB objects: a few per page, never none.
        assert_eq!(next_page_size(5_000, 3, 3 * 1_400_000, 1_000), 23);
        assert_eq!(next_page_size(5_000, 1, 200 << 20, 10), 1);
        // The end of the range, or a store that does not count: the floor.
        assert_eq!(next_page_size(7, 7, 700, 0), 7);
        assert_eq!(next_page_size(7, 0, 0, -3), 7);
    }
}
