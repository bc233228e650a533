//! The one handle a reconciler writes through: every write it makes is recorded, so the
//! reconciler can decide from its cache and read the store only for an object whose
//! last write by this process the cache has not shown yet.
//!
//! Expected use:
//! 1. A process makes one [`Writer`] over its (fenced) store and registers the caches
//!    of the kinds it reads back ([`Writer::tracking`]).
//! 2. Reconcilers read an object with [`Writer::fresh`] (the cache, unless it lags this
//!    process's own last write of it) and write with the methods below; none of them
//!    has to note what it wrote.
//! 3. A write to a kind with no registered cache is not recorded (nothing reads it
//!    back fresh). Records are dropped once the cache shows them, and at the latest
//!    after [`FORGET_AFTER`], so they stay bounded.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::reflector::{self, Seen};
use crate::api::{Object, ObjectKey, Spec};
use crate::store::{Batch, Deleted, Store, StoreError};

/// How long a write is remembered at most: a cache shows a write within a watch's
/// delivery, far below this, or relists.
pub const FORGET_AFTER: Duration = Duration::from_secs(300);

/// What the cache of a key's kind knows of it.
type Lookup = Arc<dyn Fn(&str) -> Seen + Send + Sync>;

#[derive(Clone)]
struct Written {
    revision: i64,
    deleted: bool,
    at: Instant,
    /// The object as written (an `Object<S>`), when the write returned it: read back
    /// instead of the store while the cache lags.
    object: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

/// A store handle that records this process's own writes (cheap to clone; clones
/// share the record). Reads and writes it does not wrap go through [`Writer::store`].
#[derive(Clone)]
pub struct Writer {
    store: Store,
    caches: Arc<Vec<(&'static str, Lookup)>>,
    writes: Arc<Mutex<Record>>,
}

/// Where [`Writer::fresh`] takes an object from.
enum Fresh {
    /// The cache shows this process's last write, or there is none.
    Cache,
    /// The cache lags the last write, which returned this object.
    Written(Arc<dyn std::any::Any + Send + Sync>),
    /// The cache lags the last write, a deletion.
    Gone,
    /// The cache lags a write that returned no object: read the store.
    Read,
}

#[derive(Default)]
struct Record {
    writes: HashMap<String, Written>,
    /// The size past which the next write prunes what the caches show.
    prune_at: usize,
}

const PRUNE_FLOOR: usize = 1024;

impl Record {
    /// Records a write; past `prune_at` records, drops every one its cache shows (as
    /// `cached` tells) or older than [`FORGET_AFTER`].
    fn note(&mut self, key: String, written: Written, cached: impl Fn(&str) -> Seen) {
        self.writes.insert(key, written);
        if self.writes.len() > self.prune_at {
            let now = Instant::now();
            self.writes
                .retain(|key, w| now.duration_since(w.at) < FORGET_AFTER && !shown(w, cached(key)));
            self.prune_at = (self.writes.len() * 2).max(PRUNE_FLOOR);
        }
    }

    /// Where a fresh view of `key` comes from when the cache knows `cached`.
    fn fresh(&mut self, key: &str, cached: impl Into<Seen>) -> Fresh {
        let cached = cached.into();
        if self.settled(key, cached) {
            return Fresh::Cache;
        }
        match (self.writes.get(key), cached) {
            // A deletion at a known revision (not `delete`'s, which has none: the key
            // may have been made again since, and only the store can say).
            (Some(w), _) if w.deleted && w.revision != i64::MAX => Fresh::Gone,
            // The cache shows an older version: it lags, and the object is as written
            // (or changed by another since, which the next write's guard catches).
            // Absent from the cache with no deletion after the write, it may not have
            // been shown yet or have been deleted by another since: only the store can
            // say. (A deletion after the write shows it: settled above.)
            (
                Some(Written {
                    object: Some(o), ..
                }),
                Seen::Present(_),
            ) => Fresh::Written(o.clone()),
            _ => Fresh::Read,
        }
    }

    /// Where [`Writer::current`] takes `key` from when its projecting cache knows
    /// `seen`: the object as last written here while the cache holds that version or
    /// an older one (forgotten once it holds that version); gone after a deletion here
    /// at a known revision the cache shows nothing newer than; the cache (what it
    /// holds of the object, if anything) when nothing written here is pending or the
    /// cache shows a later change; else the store.
    fn current(&mut self, key: &str, seen: Seen) -> Fresh {
        let Some(w) = self.writes.get(key) else {
            return Fresh::Cache;
        };
        if newer(seen, w.revision) {
            self.writes.remove(key);
            return Fresh::Cache;
        }
        match w {
            Written {
                deleted: true,
                revision,
                ..
            } if *revision != i64::MAX => Fresh::Gone,
            // Present at our write's version or before it. Absent, it may not have
            // been shown yet or have been deleted since: the store says.
            Written {
                object: Some(o),
                revision,
                ..
            } if matches!(seen, Seen::Present(v) if v <= *revision) => {
                let o = o.clone();
                if seen == Seen::Present(*revision) {
                    self.writes.remove(key);
                }
                Fresh::Written(o)
            }
            _ => Fresh::Read,
        }
    }

    /// Whether a cache knowing `cached` of `key` may be read as is: no write of the
    /// key is recorded, or the cache shows the last one (which is then forgotten).
    fn settled(&mut self, key: &str, cached: impl Into<Seen>) -> bool {
        let cached = cached.into();
        match self.writes.get(key) {
            None => true,
            Some(w) if shown(w, cached) => {
                self.writes.remove(key);
                true
            }
            Some(_) => false,
        }
    }
}

impl std::fmt::Debug for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer")
            .field("store", &self.store)
            .field(
                "tracked",
                &self.caches.iter().map(|(d, _)| d).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Writer {
    /// Writes through `store`, recording nothing until a cache is registered.
    pub fn new(store: Store) -> Writer {
        Writer {
            store,
            caches: Arc::default(),
            writes: Arc::new(Mutex::new(Record {
                writes: HashMap::new(),
                prune_at: PRUNE_FLOOR,
            })),
        }
    }

    /// Records this process's writes of `S`, read back through `cache`.
    pub fn tracking<S: Spec>(self, cache: &reflector::Store<Object<S>>) -> Writer {
        self.tracking_as::<S, _>(cache)
    }

    /// Records this process's writes of `S`, whose cache keeps `P`s (a projection),
    /// read back with [`Writer::current`].
    pub fn tracking_as<S: Spec, P: super::Resource>(
        mut self,
        cache: &reflector::Store<P>,
    ) -> Writer {
        let cache = cache.clone();
        let lookup: Lookup = Arc::new(move |key| cache.seen(key));
        Arc::make_mut(&mut self.caches).push((S::DIR, lookup));
        self
    }

    /// The store, for what is not a recorded write (reads, raw keys, batches' guards).
    pub fn store(&self) -> &Store {
        &self.store
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Record> {
        self.writes.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lookup(&self, key: &str) -> Option<&Lookup> {
        let dir = key.split('/').next()?;
        self.caches.iter().find(|(d, _)| *d == dir).map(|(_, l)| l)
    }

    /// Notes a write of `key` at `revision` (a deletion when `deleted`).
    fn note(&self, key: String, revision: i64, deleted: bool) {
        self.note_object(key, revision, deleted, None);
    }

    /// [`Writer::note`], with the object as written when there is one.
    fn note_object(
        &self,
        key: String,
        revision: i64,
        deleted: bool,
        object: Option<Arc<dyn std::any::Any + Send + Sync>>,
    ) {
        if self.lookup(&key).is_none() {
            return;
        }
        let written = Written {
            revision,
            deleted,
            at: Instant::now(),
            object,
        };
        self.lock().note(key, written, |k| {
            self.lookup(k).map_or(Seen::Unknown, |l| l(k))
        });
    }

    /// The object at `key` from `cache` when the cache holds this process's last
    /// write of it (or there is none); while the cache shows an older version, the
    /// object as this process wrote it; `None` after its deletion at a known revision;
    /// else as read from the store (the cache shows nothing, which may mean another
    /// process deleted it since, or the write returned no object). A write by another
    /// process since
    /// is no more visible here than in the cache, and is caught the same way: by the
    /// guard of the next write.
    pub async fn fresh<S: Spec>(
        &self,
        cache: &reflector::Store<Object<S>>,
        key: &ObjectKey<S>,
    ) -> Result<Option<Arc<Object<S>>>, StoreError> {
        let cached = cache.get(key);
        let seen = match &cached {
            Some(c) => Seen::Present(c.metadata.resource_version),
            None => cache.seen(key),
        };
        let known = self.lock().fresh(key.as_str(), seen);
        match known {
            Fresh::Cache => return Ok(cached),
            Fresh::Gone => return Ok(None),
            Fresh::Written(obj) => {
                if let Ok(obj) = obj.downcast::<Object<S>>() {
                    return Ok(Some(obj));
                }
            }
            Fresh::Read => {}
        }
        let stored = self.store.try_get(key).await?.map(Arc::new);
        if stored.is_none() && cached.is_none() {
            // Gone (our write was its deletion, or it went since) and the cache agrees.
            self.lock().writes.remove(key.as_str());
        }
        Ok(stored)
    }

    /// The object at `key` as stored now, for a reconciler whose cache keeps a
    /// projection (`cache`, registered with [`Writer::tracking_as`]) that may hold the
    /// whole object (`held`, at the cache's version): this process's last write of it
    /// while the cache holds that version or an older one (nobody wrote since, or the
    /// cache would hold a later one); `None` after its deletion here at a known
    /// revision; `held` when nothing written here is pending; else as read from the
    /// store. The record is dropped once the cache shows the write, as
    /// [`Writer::fresh`] drops it.
    pub async fn current<S: Spec, P: super::Resource>(
        &self,
        cache: &reflector::Store<P>,
        key: &ObjectKey<S>,
        held: Option<Arc<Object<S>>>,
    ) -> Result<Option<Arc<Object<S>>>, StoreError> {
        let known = self.lock().current(key.as_str(), cache.seen(key.as_str()));
        match known {
            Fresh::Gone => return Ok(None),
            Fresh::Written(obj) => {
                if let Ok(obj) = obj.downcast::<Object<S>>() {
                    return Ok(Some(obj));
                }
            }
            Fresh::Cache if held.is_some() => return Ok(held),
            Fresh::Cache | Fresh::Read => {}
        }
        Ok(self.store.try_get(key).await?.map(Arc::new))
    }

    /// Whether a write of `key` by this process is recorded (not yet seen shown by its
    /// cache): a cache of every object that lacks `key` is then not the last word.
    pub fn pending(&self, key: &str) -> bool {
        self.lock().writes.contains_key(key)
    }

    fn wrote<S: Spec>(&self, written: &Object<S>) {
        if self.lookup(S::DIR).is_none() {
            return;
        }
        self.note_object(
            written.key(),
            written.metadata.resource_version,
            false,
            Some(Arc::new(written.clone())),
        );
    }

    /// [`Store::create`], recorded.
    pub async fn create<S: Spec>(&self, obj: &Object<S>) -> Result<Object<S>, StoreError> {
        let written = self.store.create(obj).await?;
        self.wrote(&written);
        Ok(written)
    }

    /// [`Store::update`], recorded.
    pub async fn update<S: Spec>(
        &self,
        read: &Object<S>,
        next: &Object<S>,
    ) -> Result<Object<S>, StoreError> {
        let written = self.store.update(read, next).await?;
        self.wrote(&written);
        Ok(written)
    }

    /// [`Store::replace`], recorded.
    pub async fn replace<S: Spec>(&self, obj: &Object<S>) -> Result<Object<S>, StoreError> {
        let written = self.store.replace(obj).await?;
        self.wrote(&written);
        Ok(written)
    }

    /// Removes finalizer `name` from the object at `key`, however the object changed
    /// meanwhile: read, drop it, write; again on a conflict, at most 16 times (then
    /// the conflict is the caller's, whose reconcile looks again). Gone, or without
    /// the finalizer: nothing to do.
    pub async fn remove_finalizer<S: Spec>(
        &self,
        key: &ObjectKey<S>,
        name: &str,
    ) -> Result<(), StoreError> {
        let mut last = None;
        for _ in 0..16 {
            let Some(mut obj) = self.store.try_get(key).await? else {
                return Ok(());
            };
            if !obj.metadata.finalizers.iter().any(|f| f == name) {
                return Ok(());
            }
            obj.metadata.finalizers.retain(|f| f != name);
            match self.replace(&obj).await {
                Ok(_) | Err(StoreError::NotFound { .. }) => return Ok(()),
                Err(e @ StoreError::Conflict { .. }) => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| StoreError::Conflict {
            key: key.as_str().to_string(),
            expected: 0,
        }))
    }

    /// [`Store::reseal`], recorded; whether it wrote.
    pub async fn reseal<S: Spec>(&self, obj: &Object<S>) -> Result<bool, StoreError> {
        match self.store.reseal(obj).await? {
            Some(written) => {
                self.wrote(&written);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// [`Store::replace_status`], recorded.
    pub async fn replace_status<S: Spec>(&self, obj: &Object<S>) -> Result<Object<S>, StoreError> {
        let written = self.store.replace_status(obj).await?;
        self.wrote(&written);
        Ok(written)
    }

    /// [`Store::modify_status`], recorded.
    pub async fn modify_status<S: Spec>(
        &self,
        key: &ObjectKey<S>,
        f: impl FnMut(&Object<S>, &mut S::Status) -> bool,
    ) -> Result<Object<S>, StoreError> {
        let written = self.store.modify_status(key, f).await?;
        self.wrote(&written);
        Ok(written)
    }

    /// Writes `f` onto the status of `known` (as last read or written here): guarded
    /// by its version, with no read; if someone wrote since, through a fresh
    /// read-modify-write. No write when `f` changes nothing.
    pub async fn write_status<S: Spec>(
        &self,
        known: &Object<S>,
        f: impl Fn(&mut S::Status),
    ) -> Result<Object<S>, StoreError> {
        let mut next = known.clone();
        f(&mut next.status);
        if next.status == known.status {
            return Ok(next);
        }
        match self.update(known, &next).await {
            Err(StoreError::Conflict { .. }) => {
                self.modify_status(&known.object_key(), |_, st| {
                    f(st);
                    true
                })
                .await
            }
            other => other,
        }
    }

    /// [`Store::delete`], recorded (a marking as a write, a deletion as a deletion).
    pub async fn delete<S: Spec>(
        &self,
        key: &ObjectKey<S>,
        precondition: Option<i64>,
    ) -> Result<Deleted<S>, StoreError> {
        let deleted = self.store.delete(key, precondition).await?;
        if let Deleted::Finalizing(marked) = &deleted {
            self.wrote(&**marked);
        }
        // A deletion's revision is not returned: the next fresh read asks the store.
        if matches!(deleted, Deleted::Gone) {
            self.note(key.as_str().to_string(), i64::MAX, true);
        }
        Ok(deleted)
    }

    /// [`Store::delete_read`], recorded at the deletion's (or marking's) revision.
    pub async fn delete_read<S: Spec>(&self, read: &Object<S>) -> Result<i64, StoreError> {
        let revision = self.store.delete_read(read).await?;
        let deleted = read.metadata.finalizers.is_empty();
        self.note(read.key(), revision, deleted);
        Ok(revision)
    }

    /// [`Store::replace_malformed`], recorded.
    pub async fn replace_malformed<S: Spec>(
        &self,
        key: &ObjectKey<S>,
        revision: i64,
        with: Option<&Object<S>>,
    ) -> Result<i64, StoreError> {
        let written = self.store.replace_malformed(key, revision, with).await?;
        self.note(key.as_str().to_string(), written, with.is_none());
        Ok(written)
    }

    /// [`Batch::commit`], recording every object the batch writes at its revision, as
    /// written.
    pub async fn commit(&self, mut batch: Batch) -> Result<i64, StoreError> {
        let written = batch.written();
        let mut objects = batch.take_objects();
        let revision = batch.commit(&self.store).await?;
        for (key, deleted) in written {
            let object = objects
                .iter()
                .position(|(k, _)| *k == key)
                .map(|i| (objects.swap_remove(i).1)(revision));
            self.note_object(key, revision, deleted, object);
        }
        Ok(revision)
    }
}

/// Whether a cache knowing `cached` shows a change after `revision` (a later version,
/// or a deletion after it): then a write at `revision` is no longer the object.
fn newer(cached: Seen, revision: i64) -> bool {
    match cached {
        Seen::Present(version) => version > revision,
        Seen::DeletedAfter(version) => version >= revision,
        Seen::Unknown => false,
    }
}

/// Whether a cache knowing `cached` shows the write: it holds the object at the
/// write's version or later, or it applied a deletion after that version (or any
/// deletion, when the write was one).
fn shown(w: &Written, cached: Seen) -> bool {
    match cached {
        Seen::Present(version) => version >= w.revision,
        Seen::DeletedAfter(version) => w.deleted || version >= w.revision,
        Seen::Unknown => w.deleted,
    }
}

/// A cached version, or nothing known (the tests' shorthand).
impl From<Option<i64>> for Seen {
    fn from(version: Option<i64>) -> Seen {
        version.map_or(Seen::Unknown, Seen::Present)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(revision: i64) -> Written {
        Written {
            revision,
            deleted: false,
            at: Instant::now(),
            object: None,
        }
    }

    fn record() -> Record {
        Record {
            writes: HashMap::new(),
            prune_at: PRUNE_FLOOR,
        }
    }

    #[test]
    fn a_projecting_cache_reads_its_own_last_write_until_someone_writes_after_it() {
        let mut r = record();
        let key = "volumes/ns/v";
        let written = |revision| Written {
            object: Some(Arc::new(revision) as Arc<dyn std::any::Any + Send + Sync>),
            ..put(revision)
        };
        let read = |f: Fresh| match f {
            Fresh::Written(o) => Some(*o.downcast::<i64>().unwrap()),
            Fresh::Read => None,
            Fresh::Gone => Some(-1),
            Fresh::Cache => Some(-2),
        };
        assert_eq!(
            read(r.current(key, Seen::Present(3))),
            Some(-2),
            "nothing written"
        );
        r.note(key.into(), written(7), |_| Seen::Unknown);
        assert_eq!(
            read(r.current(key, Seen::Present(5))),
            Some(7),
            "the cache lags"
        );
        assert_eq!(
            read(r.current(key, Seen::Unknown)),
            None,
            "not shown: the store"
        );
        assert_eq!(
            read(r.current(key, Seen::Present(7))),
            Some(7),
            "shown: still ours"
        );
        assert!(r.writes.is_empty(), "and forgotten");
        assert_eq!(
            read(r.current(key, Seen::Present(7))),
            Some(-2),
            "the cache's"
        );
        r.note(key.into(), written(8), |_| Seen::Unknown);
        assert_eq!(
            read(r.current(key, Seen::Present(9))),
            Some(-2),
            "written since: the cache's"
        );
        assert!(r.writes.is_empty(), "and forgotten");
        let gone = Written {
            deleted: true,
            ..put(9)
        };
        r.note(key.into(), gone, |_| Seen::Unknown);
        assert_eq!(
            read(r.current(key, Seen::Present(7))),
            Some(-1),
            "deleted here"
        );
        assert_eq!(
            read(r.current(key, Seen::Present(7))),
            Some(-1),
            "still gone"
        );
        assert_eq!(
            read(r.current(key, Seen::Present(12))),
            Some(-2),
            "made again since"
        );
        // Written without the object (a batch's raw key): only the store can say.
        r.note(key.into(), put(14), |_| Seen::Unknown);
        assert_eq!(read(r.current(key, Seen::Present(12))), None);
    }

    #[test]
    fn a_write_is_read_fresh_until_the_cache_shows_it() {
        let mut r = record();
        assert!(
            r.settled("claims/n/ns/a", Some(5)),
            "nothing written: the cache"
        );
        r.note("claims/n/ns/a".into(), put(7), |_| Seen::Unknown);
        assert!(
            !r.settled("claims/n/ns/a", Some(5)),
            "the cache lags our write"
        );
        assert!(!r.settled("claims/n/ns/a", None), "created, not shown yet");
        assert!(r.settled("claims/n/ns/a", Some(7)));
        assert!(r.writes.is_empty(), "forgotten once shown");
        // A deletion is shown by the key's absence, or by a newer object.
        let gone = Written {
            deleted: true,
            ..put(9)
        };
        r.note("claims/n/ns/a".into(), gone.clone(), |_| Seen::Unknown);
        assert!(!r.settled("claims/n/ns/a", Some(7)));
        r.note("claims/n/ns/a".into(), gone.clone(), |_| Seen::Unknown);
        assert!(r.settled("claims/n/ns/a", None));
        r.note("claims/n/ns/a".into(), gone, |_| Seen::Unknown);
        assert!(r.settled("claims/n/ns/a", Some(12)));
    }

    #[test]
    fn while_the_cache_lags_the_write_is_read_back_as_written() {
        let mut r = record();
        let written: Arc<dyn std::any::Any + Send + Sync> = Arc::new(String::from("as written"));
        let with = Written {
            object: Some(written),
            ..put(7)
        };
        r.note("claims/n/ns/a".into(), with, |_| Seen::Unknown);
        match r.fresh("claims/n/ns/a", Some(5)) {
            Fresh::Written(o) => {
                assert_eq!(o.downcast::<String>().unwrap().as_str(), "as written")
            }
            _ => panic!("the object as written"),
        }
        // Absent from the cache: not shown yet, or deleted by another since (chaos
        // seed 1795658555401764419 kept a claim releasing on a stale attachment).
        assert!(matches!(r.fresh("claims/n/ns/a", None), Fresh::Read));
        assert!(matches!(r.fresh("claims/n/ns/a", Some(7)), Fresh::Cache));
        // A write that returned nothing (a batch's) is read from the store.
        r.note("claims/n/ns/a".into(), put(9), |_| Seen::Unknown);
        assert!(matches!(r.fresh("claims/n/ns/a", Some(7)), Fresh::Read));
        // A deletion at a known revision is gone; `delete`'s (no revision) is read.
        let gone = Written {
            deleted: true,
            ..put(11)
        };
        r.note("claims/n/ns/a".into(), gone, |_| Seen::Unknown);
        assert!(matches!(r.fresh("claims/n/ns/a", Some(9)), Fresh::Gone));
        let unknown = Written {
            deleted: true,
            ..put(i64::MAX)
        };
        r.note("claims/n/ns/a".into(), unknown, |_| Seen::Unknown);
        assert!(matches!(r.fresh("claims/n/ns/a", Some(12)), Fresh::Read));
    }

    #[test]
    fn a_deletion_the_cache_applied_after_the_write_shows_it() {
        let mut r = record();
        let with = Written {
            object: Some(Arc::new(String::from("as written"))),
            ..put(7)
        };
        // Written at 7, changed by another at 8, deleted by another: the cache's
        // tombstone says it held 8 before the deletion, so its absence is current.
        r.note("claims/n/ns/a".into(), with.clone(), |_| Seen::Unknown);
        assert!(matches!(
            r.fresh("claims/n/ns/a", Seen::DeletedAfter(8)),
            Fresh::Cache
        ));
        assert!(r.writes.is_empty(), "forgotten once shown");
        // Deleted right after our write (the cache held exactly our version).
        r.note("claims/n/ns/a".into(), with.clone(), |_| Seen::Unknown);
        assert!(r.settled("claims/n/ns/a", Seen::DeletedAfter(7)));
        // A deletion of an older incarnation, before our write (which made the key
        // again) was shown: the store must say.
        r.note("claims/n/ns/a".into(), with, |_| Seen::Unknown);
        assert!(matches!(
            r.fresh("claims/n/ns/a", Seen::DeletedAfter(5)),
            Fresh::Read
        ));
        // Our own deletion is shown by any deletion the cache applied.
        let gone = Written {
            deleted: true,
            ..put(i64::MAX)
        };
        r.note("claims/n/ns/a".into(), gone, |_| Seen::Unknown);
        assert!(r.settled("claims/n/ns/a", Seen::DeletedAfter(3)));
        // Pruning drops what a tombstone shows, and keeps what it does not.
        let mut r = record();
        r.prune_at = 1;
        r.note("k1".into(), put(4), |_| Seen::Unknown);
        r.note("k2".into(), put(6), |k| match k {
            "k1" => Seen::DeletedAfter(4),
            _ => Seen::DeletedAfter(5),
        });
        assert!(!r.writes.contains_key("k1"));
        assert!(r.writes.contains_key("k2"));
    }

    #[test]
    fn records_stay_bounded_by_what_the_caches_have_not_shown() {
        let mut r = record();
        // 10,000 writes, each shown by its cache before the next prune: never more
        // than the prune threshold is kept, and nothing the cache lags is dropped.
        for i in 0..10_000i64 {
            r.note(format!("k{i}"), put(i + 1), |k| {
                let n: i64 = k[1..].parse().unwrap();
                // The last 10 writes are not shown yet.
                (n < 9_990).then_some(n + 1).into()
            });
            assert!(r.writes.len() <= PRUNE_FLOOR + 1);
        }
        for i in 9_990..10_000 {
            assert!(
                !r.settled(&format!("k{i}"), None),
                "k{i} must still be read fresh"
            );
        }
        // Writes older than FORGET_AFTER go at the next prune even when never shown.
        let mut r = record();
        let old = Written {
            at: Instant::now() - FORGET_AFTER - Duration::from_secs(1),
            ..put(1)
        };
        for i in 0..=PRUNE_FLOOR {
            r.note(format!("k{i}"), old.clone(), |_| Seen::Unknown);
        }
        assert!(r.writes.is_empty());
    }
}
