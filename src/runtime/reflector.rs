//! The reflector: a read-only cache of one kind, fed by exactly one writer.
//!
//! [`Store`] is a cheap clone handing out `Arc<K>`; [`Writer`] applies watcher events;
//! [`reflector`] threads a watcher stream through a writer so the cache is current
//! before a consumer sees each event.
//!
//! A cache can keep indexes (client-go's indexers): each names a function giving an
//! object's index values, and [`Store::by_index`] returns the objects with a value
//! without looking at the others. A mapper or reconciler that needs "the claims of
//! this volume" must use one: a scan of every cached object per event makes a
//! 100,000-object start quadratic.

use futures::{Stream, StreamExt};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, RwLock};

use super::watcher::Event;
use super::Resource;
use crate::api::{Object, ObjectKey, Spec};

/// An index: its name and the values an object is found under.
pub type Index<K> = (&'static str, fn(&K) -> Vec<String>);

/// One index's entries: value -> keys of the objects with it.
type Entries = HashMap<String, Keys>;

/// The keys an index value holds. Most values of an index are one object's (a
/// volume's claims, an object's own name), and a set of one would cost a whole B-tree
/// node per value; keys are shared with the object map, not copied. The web console's
/// tables index their rows with it too.
#[derive(Debug)]
pub enum Keys {
    /// One object's key.
    One(Arc<str>),
    /// Several, in key order.
    Many(BTreeSet<Arc<str>>),
}

impl Keys {
    /// Adds `key` (once).
    pub fn insert(&mut self, key: &Arc<str>) {
        match self {
            Keys::One(k) if k == key => {}
            Keys::One(k) => *self = Keys::Many(BTreeSet::from([k.clone(), key.clone()])),
            Keys::Many(set) => {
                set.insert(key.clone());
            }
        }
    }

    /// Removes `key`; whether none are left.
    pub fn remove(&mut self, key: &str) -> bool {
        match self {
            Keys::One(k) => &**k == key,
            Keys::Many(set) => {
                set.remove(key);
                set.is_empty()
            }
        }
    }

    /// In key order.
    pub fn iter(&self) -> Box<dyn Iterator<Item = &Arc<str>> + '_> {
        match self {
            Keys::One(k) => Box::new(std::iter::once(k)),
            Keys::Many(set) => Box::new(set.iter()),
        }
    }

    /// How many keys.
    pub fn len(&self) -> usize {
        match self {
            Keys::One(_) => 1,
            Keys::Many(set) => set.len(),
        }
    }

    /// Never: a value without keys is removed (for clippy's `len` rule).
    pub fn is_empty(&self) -> bool {
        matches!(self, Keys::Many(set) if set.is_empty())
    }
}

struct Cache<K> {
    objects: HashMap<Arc<str>, Arc<K>>,
    indexes: Vec<(Index<K>, Entries)>,
    /// Events applied so far: a snapshot taken at version V contains exactly the
    /// events numbered up to V.
    version: u64,
    /// Keys whose stored value is malformed, with its revision: the cache keeps the
    /// last valid object (acting on it is safer than acting as if it were gone), and
    /// the single writer of such a key may repair it.
    malformed: HashMap<String, i64>,
    /// The last [`TOMBSTONES`] deletions: each key's last version before it went.
    tombstones: Tombstones,
}

/// Deletions a cache remembers (see [`Store::seen`]): enough for the keys a process
/// wrote and whose deletion its reconcilers have not looked at yet; beyond them a
/// deletion is simply unknown, which costs a read, never a wrong answer.
pub const TOMBSTONES: usize = 4096;

/// The last deletions a cache applied: key -> (the version it was deleted after, its
/// entry's number), and the entries in order, the oldest first. An entry of a key that
/// came back or was deleted again since is skipped when it leaves the order.
#[derive(Default)]
struct Tombstones {
    last: HashMap<Arc<str>, (i64, u64)>,
    order: VecDeque<(Arc<str>, u64)>,
    next: u64,
}

impl Tombstones {
    fn bury(&mut self, key: Arc<str>, version: i64) {
        self.next += 1;
        self.last.insert(key.clone(), (version, self.next));
        self.order.push_back((key, self.next));
        while self.order.len() > TOMBSTONES {
            if let Some((key, n)) = self.order.pop_front() {
                if self.last.get(&key).is_some_and(|(_, m)| *m == n) {
                    self.last.remove(&key);
                }
            }
        }
    }

    fn clear(&mut self) {
        self.last.clear();
        self.order.clear();
    }
}

/// What a cache knows of a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// It holds an object at this version.
    Present(i64),
    /// It applied the key's deletion, and held this version last before it: every
    /// write up to that version was shown, and the deletion after them.
    DeletedAfter(i64),
    /// It holds nothing and remembers no deletion (never held it, or too long ago).
    Unknown,
}

impl<K: Resource> Cache<K> {
    fn insert(&mut self, key: String, obj: Arc<K>) {
        let key: Arc<str> = match self.objects.get_key_value(key.as_str()) {
            Some((k, _)) => k.clone(),
            None => {
                // Back after a deletion: only an absent key has a tombstone.
                let key: Arc<str> = key.into();
                self.tombstones.last.remove(&key);
                key
            }
        };
        if let Some(old) = self.objects.insert(key.clone(), obj.clone()) {
            self.unindex(&key, &old);
        }
        for ((_, values_of), entries) in &mut self.indexes {
            for value in values_of(&obj) {
                match entries.get_mut(&value) {
                    Some(keys) => keys.insert(&key),
                    None => {
                        entries.insert(value, Keys::One(key.clone()));
                    }
                }
            }
        }
    }

    fn remove(&mut self, key: &str) {
        if let Some((key, old)) = self.objects.remove_entry(key) {
            self.unindex(&key, &old);
            self.tombstones.bury(key, old.version());
        }
    }

    fn unindex(&mut self, key: &str, old: &K) {
        for ((_, values_of), entries) in &mut self.indexes {
            for value in values_of(old) {
                if entries.get_mut(&value).is_some_and(|keys| keys.remove(key)) {
                    entries.remove(&value);
                }
            }
        }
    }

    fn clear(&mut self) {
        self.objects.clear();
        // A list says what is, not what went.
        self.tombstones.clear();
        for (_, entries) in &mut self.indexes {
            entries.clear();
        }
    }
}

type Shared<K> = Arc<RwLock<Cache<K>>>;

/// A read-only view of the cache.
#[derive(Clone)]
pub struct Store<K> {
    cache: Shared<K>,
    ready: tokio::sync::watch::Receiver<bool>,
}

/// The single writer of a cache.
pub struct Writer<K> {
    cache: Shared<K>,
    ready: tokio::sync::watch::Sender<bool>,
}

/// A new empty cache: its writer, and a reader to clone.
pub fn store<K: Resource>() -> (Store<K>, Writer<K>) {
    indexed_store(&[])
}

/// A new empty cache keeping `indexes`.
pub fn indexed_store<K: Resource>(indexes: &[Index<K>]) -> (Store<K>, Writer<K>) {
    let cache = Arc::new(RwLock::new(Cache {
        objects: HashMap::new(),
        indexes: indexes.iter().map(|i| (*i, HashMap::new())).collect(),
        version: 0,
        malformed: HashMap::new(),
        tombstones: Tombstones::default(),
    }));
    let (tx, rx) = tokio::sync::watch::channel(false);
    (
        Store {
            cache: cache.clone(),
            ready: rx,
        },
        Writer { cache, ready: tx },
    )
}

/// What a cache lookup takes: a typed key of the cache's kind, or a key string that
/// came from the cache or a queue of it (never one assembled by hand).
pub trait Lookup<K> {
    /// The key as the cache holds it.
    fn cache_key(&self) -> &str;
}

impl<K> Lookup<K> for str {
    fn cache_key(&self) -> &str {
        self
    }
}

impl<K> Lookup<K> for String {
    fn cache_key(&self) -> &str {
        self
    }
}

impl<S: Spec> Lookup<Object<S>> for ObjectKey<S> {
    fn cache_key(&self) -> &str {
        self.as_str()
    }
}

impl<K: Resource> Store<K> {
    /// The object at a key.
    pub fn get<Q: Lookup<K> + ?Sized>(&self, key: &Q) -> Option<Arc<K>> {
        self.read().objects.get(key.cache_key()).cloned()
    }

    /// What the cache knows of `key`: its object's version, or the version it was
    /// deleted after (for the last [`TOMBSTONES`] deletions), or nothing.
    pub fn seen<Q: Lookup<K> + ?Sized>(&self, key: &Q) -> Seen {
        let cache = self.read();
        let key = key.cache_key();
        match cache.objects.get(key) {
            Some(o) => Seen::Present(o.version()),
            None => match cache.tombstones.last.get(key) {
                Some((version, _)) => Seen::DeletedAfter(*version),
                None => Seen::Unknown,
            },
        }
    }

    /// The revision of the malformed value stored at `key`, if the last thing stored
    /// there is one (the cache still holds the last valid object, if any).
    pub fn malformed<Q: Lookup<K> + ?Sized>(&self, key: &Q) -> Option<i64> {
        self.read().malformed.get(key.cache_key()).copied()
    }

    /// Every key whose stored value is malformed, with the value's revision.
    pub fn malformed_keys(&self) -> Vec<(String, i64)> {
        self.read()
            .malformed
            .iter()
            .map(|(k, r)| (k.clone(), *r))
            .collect()
    }

    /// Notes that `key` now holds a malformed value written at `revision`.
    pub(crate) fn note_malformed(&self, key: &str, revision: i64) {
        let mut cache = self.cache.write().unwrap_or_else(|e| e.into_inner());
        cache.malformed.insert(key.to_string(), revision);
    }

    /// Every cached object.
    pub fn state(&self) -> Vec<Arc<K>> {
        self.read().objects.values().cloned().collect()
    }

    /// Every cached object, and the number of the last event applied to them (see
    /// [`Writer::apply`]).
    pub fn snapshot(&self) -> (u64, Vec<Arc<K>>) {
        let cache = self.read();
        (cache.version, cache.objects.values().cloned().collect())
    }

    /// Every cached key.
    pub fn keys(&self) -> Vec<String> {
        self.read().objects.keys().map(|k| k.to_string()).collect()
    }

    /// The objects whose index `name` holds `value`, in key order. An index the cache
    /// was not built with finds nothing (and is a bug: debug builds panic).
    pub fn by_index(&self, name: &str, value: &str) -> Vec<Arc<K>> {
        let cache = self.read();
        let Some((_, entries)) = cache.indexes.iter().find(|((n, _), _)| *n == name) else {
            debug_assert!(false, "no index {name} in this cache");
            return Vec::new();
        };
        entries
            .get(value)
            .into_iter()
            .flat_map(Keys::iter)
            .filter_map(|key| cache.objects.get(key).cloned())
            .collect()
    }

    /// How many objects are cached.
    pub fn len(&self) -> usize {
        self.read().objects.len()
    }

    /// Whether the cache is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the first list has been applied.
    pub fn is_ready(&self) -> bool {
        *self.ready.borrow()
    }

    /// Waits until the first list has been applied.
    pub async fn wait_until_ready(&self) {
        let mut rx = self.ready.clone();
        // An error means the writer is gone; there is nothing more to wait for.
        let _ = rx.wait_for(|ready| *ready).await;
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Cache<K>> {
        // A writer that panicked mid-update left a cache that is still whole: keep serving.
        self.cache.read().unwrap_or_else(|e| e.into_inner())
    }
}

impl<K: Resource> Writer<K> {
    /// Applies one watcher event; returns its number (1, 2, ...), which a
    /// [`Store::snapshot`] taken afterwards includes.
    pub fn apply(&mut self, event: &Event<K>) -> u64 {
        let mut cache = self.cache.write().unwrap_or_else(|e| e.into_inner());
        cache.version += 1;
        let version = cache.version;
        match event {
            Event::Restarted(objects) => {
                cache.clear();
                cache.malformed.clear();
                for o in objects {
                    cache.insert(o.key(), o.clone());
                }
                drop(cache);
                self.ready.send_replace(true);
            }
            Event::Applied(obj) => {
                let key = obj.key();
                if cache
                    .malformed
                    .get(&key)
                    .is_some_and(|rev| *rev < obj.version())
                {
                    cache.malformed.remove(&key);
                }
                cache.insert(key, obj.clone())
            }
            Event::Deleted { key, .. } => {
                cache.malformed.remove(key);
                cache.remove(key)
            }
        }
        version
    }

    /// A reader of this writer's cache.
    pub fn reader(&self) -> Store<K> {
        Store {
            cache: self.cache.clone(),
            ready: self.ready.subscribe(),
        }
    }
}

/// Feeds each successful event of `stream` to `writer`, then passes it on.
pub fn reflector<K, E, W>(mut writer: Writer<K>, stream: W) -> impl Stream<Item = W::Item> + Send
where
    K: Resource,
    E: Send,
    W: Stream<Item = Result<Event<K>, E>> + Send,
{
    stream.inspect(move |item| {
        if let Ok(event) = item {
            writer.apply(event);
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Debug, PartialEq)]
    struct Obj(&'static str, u32);
    impl Resource for Obj {
        fn key(&self) -> String {
            self.0.to_string()
        }

        fn version(&self) -> i64 {
            self.1.into()
        }
    }

    #[tokio::test]
    async fn a_cache_remembers_its_last_deletions_and_nothing_a_list_replaced() {
        let (reader, mut writer) = store::<Obj>();
        writer.apply(&Event::restarted(vec![Obj("a", 3), Obj("b", 4)]));
        assert_eq!(reader.seen("a"), Seen::Present(3));
        assert_eq!(reader.seen("z"), Seen::Unknown);
        writer.apply(&Event::Deleted {
            key: "a".into(),
            last: None,
        });
        assert_eq!(reader.seen("a"), Seen::DeletedAfter(3));
        writer.apply(&Event::applied(Obj("a", 9)));
        assert_eq!(reader.seen("a"), Seen::Present(9), "back: present again");
        writer.apply(&Event::Deleted {
            key: "a".into(),
            last: None,
        });
        assert_eq!(reader.seen("a"), Seen::DeletedAfter(9));
        // A deletion of a key the cache never held is not remembered.
        writer.apply(&Event::Deleted {
            key: "y".into(),
            last: None,
        });
        assert_eq!(reader.seen("y"), Seen::Unknown);
        // Bounded: the oldest deletions are forgotten first.
        let names: Vec<&'static str> = (0..TOMBSTONES + 10)
            .map(|i| &*Box::leak(format!("k{i}").into_boxed_str()))
            .collect();
        for n in &names {
            writer.apply(&Event::applied(Obj(n, 1)));
            writer.apply(&Event::Deleted {
                key: n.to_string(),
                last: None,
            });
        }
        assert_eq!(reader.seen(names[0]), Seen::Unknown);
        assert_eq!(reader.seen(names[TOMBSTONES + 9]), Seen::DeletedAfter(1));
        assert_eq!(reader.seen("a"), Seen::Unknown, "pushed out");
        // A list says what is, not what went.
        writer.apply(&Event::restarted(vec![Obj("b", 4)]));
        assert_eq!(reader.seen(names[TOMBSTONES + 9]), Seen::Unknown);
        assert_eq!(reader.seen("b"), Seen::Present(4));
    }

    #[tokio::test]
    async fn writer_applies_events_and_readers_see_them() {
        let (reader, writer) = store::<Obj>();
        assert!(!reader.is_ready());
        let events: Vec<Result<Event<Obj>, ()>> = vec![
            Ok(Event::restarted(vec![Obj("a", 1), Obj("b", 1)])),
            Ok(Event::applied(Obj("a", 2))),
            Err(()),
            Ok(Event::Deleted {
                key: "b".into(),
                last: None,
            }),
            Ok(Event::applied(Obj("c", 1))),
        ];
        let out: Vec<_> = reflector(writer, futures::stream::iter(events))
            .collect()
            .await;
        assert_eq!(out.len(), 5, "every item passes through");
        reader.wait_until_ready().await;
        assert_eq!(*reader.get("a").unwrap(), Obj("a", 2));
        assert!(reader.get("b").is_none());
        let mut keys = reader.keys();
        keys.sort();
        assert_eq!(keys, ["a", "c"]);
    }

    #[tokio::test]
    async fn restart_replaces_everything() {
        let (reader, mut writer) = store::<Obj>();
        writer.apply(&Event::restarted(vec![Obj("a", 1), Obj("b", 1)]));
        writer.apply(&Event::restarted(vec![Obj("c", 1)]));
        assert_eq!(reader.keys(), ["c"]);
    }

    #[tokio::test]
    async fn an_index_follows_updates_deletes_and_restarts() {
        fn by_count(o: &Obj) -> Vec<String> {
            vec![o.1.to_string()]
        }
        let (reader, mut writer) = indexed_store::<Obj>(&[("count", by_count)]);
        let names = |objs: Vec<Arc<Obj>>| objs.iter().map(|o| o.0).collect::<Vec<_>>();
        writer.apply(&Event::restarted(vec![
            Obj("a", 1),
            Obj("b", 1),
            Obj("c", 2),
        ]));
        assert_eq!(names(reader.by_index("count", "1")), ["a", "b"]);
        writer.apply(&Event::applied(Obj("a", 2)));
        assert_eq!(names(reader.by_index("count", "1")), ["b"]);
        assert_eq!(names(reader.by_index("count", "2")), ["a", "c"]);
        writer.apply(&Event::Deleted {
            key: "c".into(),
            last: None,
        });
        assert_eq!(names(reader.by_index("count", "2")), ["a"]);
        writer.apply(&Event::restarted(vec![Obj("d", 1)]));
        assert_eq!(names(reader.by_index("count", "1")), ["d"]);
        assert!(reader.by_index("count", "2").is_empty());
    }
}
