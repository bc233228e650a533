//! An informer: one watcher and one cache per kind, shared by every controller of a
//! process that needs that kind.
//!
//! Expected flow:
//! 1. `Informer::spawn` starts a task running watcher → backoff, which applies each
//!    event to the cache ([`Informer::reader`]) before passing it on.
//! 2. Each [`Informer::subscribe`] gets the cache as one `Restarted` event, then every
//!    later event, as a stream for `Controller::owns` / `Controller::watches`. Events
//!    are numbered as the cache applies them, so a subscriber skips those its snapshot
//!    already holds (the first list is seen once, not twice). A subscriber that falls
//!    too far behind gets the whole cache as one `Restarted` event instead of the
//!    events it missed, so it never loses a key.
//! 3. The task ends with `shutdown`.

use futures::{Stream, StreamExt};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use super::backoff::{backoff, Backoff};
use super::reflector::{self, Store};
use super::watcher::{watcher_making, Event, Make, WatchError};
use super::Resource;
use crate::api::{KeyScope, Object, Spec};
use crate::process::error_chain;
use crate::store;

/// How many events a subscriber may fall behind before it is resynced.
const CAPACITY: usize = 4096;

/// A shared watch and cache of one kind.
pub struct Informer<K: Resource> {
    reader: Store<K>,
    /// Each event with its number in the cache (see [`reflector::Writer::apply`]).
    tx: broadcast::Sender<Arc<(u64, Event<K>)>>,
}

impl<K: Resource> Clone for Informer<K> {
    fn clone(&self) -> Self {
        Informer {
            reader: self.reader.clone(),
            tx: self.tx.clone(),
        }
    }
}

/// The error a subscriber never sees (lagging is turned into a resync); it exists so
/// subscriptions fit `Controller::owns`.
#[derive(Debug, thiserror::Error)]
#[error("informer stream error")]
pub struct InformerError;

impl<S: Spec> Informer<Object<S>> {
    /// Watches objects of kind `S` under `scope` (see [`super::watcher`]) until `shutdown`.
    pub fn spawn(store: store::Store, scope: KeyScope<S>, shutdown: CancellationToken) -> Self {
        Self::spawn_indexed(store, scope, &[], shutdown)
    }

    /// [`Informer::spawn`] with a cache that keeps `indexes` (see [`Store::by_index`]).
    pub fn spawn_indexed(
        store: store::Store,
        scope: KeyScope<S>,
        indexes: &[reflector::Index<Object<S>>],
        shutdown: CancellationToken,
    ) -> Self {
        let make: Make<S, Object<S>> = Arc::new(|o| Some(Arc::new(o)));
        spawn_with(store, scope, indexes, make, false, shutdown)
    }

    /// [`Informer::spawn`] that caches and passes on only the objects `keep` holds for
    /// (the volumes of one plugin): the others are decoded, then dropped. An object
    /// that stops being kept is a deletion to the cache and the subscribers, so a
    /// filter must be one no object leaves while it matters to them (a volume's
    /// plugin, which the reconcilers already treat as "not ours" when it differs).
    pub fn spawn_filtered(
        store: store::Store,
        scope: KeyScope<S>,
        keep: Keep<Object<S>>,
        shutdown: CancellationToken,
    ) -> Self {
        let make: Make<S, Object<S>> = Arc::new(move |o| keep(&o).then(|| Arc::new(o)));
        spawn_with(store, scope, &[], make, true, shutdown)
    }
}

impl<P: Resource> Informer<P> {
    /// Watches objects of kind `S` under `scope` and caches each as `project` makes it:
    /// a process that only reads a kind keeps what its reconcilers read, in a type of
    /// its own (the controller's Mounts), not the whole decoded object. Subscribers
    /// get the projections too. A projection is never the base of a write (whatever
    /// writes the kind reads the object itself, or takes it through
    /// `Writer::current`). With `keep`, only the objects it holds
    /// for are cached, as in [`Informer::spawn_filtered`].
    pub fn spawn_projected<S: Spec>(
        store: store::Store,
        scope: KeyScope<S>,
        keep: Option<Keep<Object<S>>>,
        project: fn(Object<S>) -> P,
        shutdown: CancellationToken,
    ) -> Self {
        let filtered = keep.is_some();
        let make: Make<S, P> = Arc::new(move |o| {
            let kept = keep.as_ref().is_none_or(|keep| keep(&o));
            kept.then(|| Arc::new(project(o)))
        });
        spawn_with(store, scope, &[], make, filtered, shutdown)
    }

    /// [`Informer::spawn_projected`] of every object, with a cache that keeps
    /// `indexes` over the projections.
    pub fn spawn_projected_indexed<S: Spec>(
        store: store::Store,
        scope: KeyScope<S>,
        indexes: &[reflector::Index<P>],
        project: fn(Object<S>) -> P,
        shutdown: CancellationToken,
    ) -> Self {
        let make: Make<S, P> = Arc::new(move |o| Some(Arc::new(project(o))));
        spawn_with(store, scope, indexes, make, false, shutdown)
    }
}

fn spawn_with<S: Spec, P: Resource>(
    store: store::Store,
    scope: KeyScope<S>,
    indexes: &[reflector::Index<P>],
    make: Make<S, P>,
    filtered: bool,
    shutdown: CancellationToken,
) -> Informer<P> {
    let (reader, mut writer) = reflector::indexed_store::<P>(indexes);
    let (tx, _) = broadcast::channel(CAPACITY);
    let informer = Informer {
        reader,
        tx: tx.clone(),
    };
    let kind = S::KIND;
    // A malformed value is reported and skipped here, before the backoff: it is not
    // a failure of the watch, and must not delay the other objects of its kind.
    // Without previous values: a deletion's last state comes from the cache.
    // The cache keeps the last valid object of a key that now holds garbage, marks
    // the key malformed (`Store::malformed`), and passes that object on again so
    // the key's reconcilers look at it (its single writer may repair it).
    let marks = informer.reader.clone();
    // Each object is made into what the cache keeps as it is decoded (a list never
    // holds every decoded object at once); a change to one not kept comes as its
    // deletion, which matters only where the cache held it.
    let events = watcher_making(store, scope, false, make).filter_map(move |item| {
        std::future::ready(match item {
            Err(WatchError::Malformed(e)) => skip_malformed(&marks, kind, &e).map(Ok),
            other => Some(other.map(Incoming::Event)),
        })
    });
    let events = backoff(
        events,
        Backoff::new(Duration::from_millis(200), Duration::from_secs(10)),
    );
    let cache = informer.reader.clone();
    tokio::spawn(async move {
        tokio::pin!(events);
        let mut repeats = super::repeats::Repeats::default();
        loop {
            let item = tokio::select! {
                _ = shutdown.cancelled() => return,
                item = events.next() => item,
            };
            let item = match item {
                // The key's last valid object, passed on again as it is cached.
                Some(Ok(Incoming::Repass(key))) => match cache.get(&key) {
                    Some(last) => Some(Ok(Event::Applied(last))),
                    None => continue,
                },
                // A filtered cache never held it, or dropped it already.
                Some(Ok(Incoming::Event(Event::Deleted { key, .. })))
                    if filtered && cache.get(key.as_str()).is_none() =>
                {
                    continue;
                }
                Some(Ok(Incoming::Event(event))) => Some(Ok(event)),
                Some(Err(e)) => Some(Err(e)),
                None => None,
            };
            match item {
                None => return,
                Some(Ok(mut event)) => {
                    repeats.clear();
                    if let Event::Deleted {
                        key,
                        last: last @ None,
                    } = &mut event
                    {
                        *last = cache.get(key.as_str());
                    }
                    // The cache first, so a consumer woken by the event finds it.
                    let version = writer.apply(&event);
                    if matches!(event, Event::Restarted(_)) {
                        super::metrics::cache_listed(kind, true);
                    }
                    // No subscriber yet is fine: they read the cache when they start.
                    let _ = tx.send(Arc::new((version, event)));
                }
                Some(Err(WatchError::Compacted { .. })) => {
                    tracing::info!(kind, "watch compacted; relisting");
                }
                Some(Err(e)) => {
                    let chain = error_chain(&e);
                    if repeats.is_new(&chain) {
                        tracing::warn!(kind, error = %chain, "watch error; retrying on a backoff");
                    } else {
                        tracing::debug!(kind, error = %chain, "watch error");
                    }
                }
            }
        }
    });
    informer
}

impl<K: Resource> Informer<K> {
    /// The cache.
    pub fn reader(&self) -> Store<K> {
        self.reader.clone()
    }

    /// Every event from now on. The stream starts with the current cache as a
    /// `Restarted` event once it is ready, so a late subscriber misses nothing.
    pub fn subscribe(
        &self,
    ) -> impl Stream<Item = Result<Event<K>, InformerError>> + Send + 'static {
        // Subscribed before the snapshot is taken: every event the snapshot lacks is
        // received, and those it holds are skipped by number.
        let rx = self.tx.subscribe();
        let reader = self.reader.clone();
        futures::stream::unfold(
            (rx, reader, None::<u64>),
            |(mut rx, reader, seen)| async move {
                let Some(seen) = seen else {
                    reader.wait_until_ready().await;
                    let (version, all) = reader.snapshot();
                    return Some((Ok(Event::Restarted(all)), (rx, reader, Some(version))));
                };
                loop {
                    match rx.recv().await {
                        Ok(item) => {
                            let (version, event) = &*item;
                            if *version <= seen {
                                continue; // already in the snapshot
                            }
                            return Some((Ok(event.clone()), (rx, reader, Some(*version))));
                        }
                        Err(broadcast::error::RecvError::Lagged(n)) => {
                            tracing::debug!(missed = n, "informer subscriber lagged; resyncing it");
                            let (version, all) = reader.snapshot();
                            return Some((Ok(Event::Restarted(all)), (rx, reader, Some(version))));
                        }
                        Err(broadcast::error::RecvError::Closed) => return None,
                    }
                }
            },
        )
    }
}

/// Which objects a filtered informer keeps (see [`Informer::spawn_filtered`]).
pub type Keep<K> = Arc<dyn Fn(&K) -> bool + Send + Sync>;

/// What the watch brings an informer's task.
enum Incoming<P> {
    /// A change, decoded.
    Event(Event<P>),
    /// A key now holding a malformed value: its last valid object in the cache is
    /// passed on again.
    Repass(String),
}

/// Reports a malformed value (once per revision), marks its key in `cache`, and
/// returns the key, whose last valid object (if cached) is passed on again.
fn skip_malformed<K: Resource>(
    cache: &reflector::Store<K>,
    kind: &str,
    e: &store::StoreError,
) -> Option<Incoming<K>> {
    if first_sighting(e) {
        tracing::warn!(kind, error = %bounded_chain(e), "skipping a malformed value");
        super::metrics::malformed_skipped(kind);
    }
    let store::StoreError::Malformed { key, revision, .. } = e else {
        return None;
    };
    cache.note_malformed(key, *revision);
    Some(Incoming::Repass(key.clone()))
}

/// The (key, revision) pairs of malformed values this process has reported.
static REPORTED: std::sync::LazyLock<std::sync::Mutex<std::collections::HashSet<(String, i64)>>> =
    std::sync::LazyLock::new(Default::default);

/// Whether `e` names a malformed value at a revision this process has not reported yet:
/// a value is logged and counted once per revision, however many informers and relists
/// meet it (a node writing 1.4 MB of garbage 40 times must not cost 56 MB of log per
/// informer). Other errors are always reported.
pub fn first_sighting(e: &store::StoreError) -> bool {
    let store::StoreError::Malformed { key, revision, .. } = e else {
        return true;
    };
    let mut seen = REPORTED.lock().unwrap_or_else(|p| p.into_inner());
    if seen.len() >= 100_000 {
        seen.clear();
    }
    seen.insert((key.clone(), *revision))
}

pub use crate::store::bounded_chain;

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Debug, PartialEq)]
    struct Obj(&'static str);
    impl Resource for Obj {
        fn key(&self) -> String {
            self.0.to_string()
        }
    }

    #[tokio::test]
    async fn an_early_subscriber_sees_the_first_list_once() {
        let (reader, mut writer) = reflector::store::<Obj>();
        let (tx, _) = broadcast::channel(16);
        let informer = Informer { reader, tx };
        // Subscribed before the first list is applied and sent.
        let mut sub = Box::pin(informer.subscribe());
        for e in [Event::restarted(vec![Obj("a")]), Event::applied(Obj("b"))] {
            let v = writer.apply(&e);
            informer.tx.send(Arc::new((v, e))).unwrap();
        }
        match sub.next().await {
            Some(Ok(Event::Restarted(objs))) => assert_eq!(objs.len(), 2, "{objs:?}"),
            other => panic!("expected the cache first, got {other:?}"),
        }
        // The list and `b` are in the snapshot: nothing more until a new event.
        let e = Event::applied(Obj("c"));
        let v = writer.apply(&e);
        informer.tx.send(Arc::new((v, e))).unwrap();
        match sub.next().await {
            Some(Ok(Event::Applied(o))) => assert_eq!(*o, Obj("c")),
            other => panic!("expected only the new event, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_lagging_subscriber_gets_the_whole_cache() {
        let (reader, mut writer) = reflector::store::<Obj>();
        let (tx, _) = broadcast::channel(2);
        let informer = Informer { reader, tx };
        writer.apply(&Event::restarted(vec![Obj("a")]));
        let mut sub = Box::pin(informer.subscribe());
        match sub.next().await {
            Some(Ok(Event::Restarted(objs))) => assert_eq!(objs, vec![Arc::new(Obj("a"))]),
            other => panic!("expected the cache first, got {other:?}"),
        }
        for k in ["b", "c", "d"] {
            let e = Event::applied(Obj(k));
            let v = writer.apply(&e);
            informer.tx.send(Arc::new((v, e))).unwrap();
        }
        match sub.next().await {
            Some(Ok(Event::Restarted(objs))) => assert_eq!(objs.len(), 4),
            other => panic!("expected a resync, got {other:?}"),
        }
    }
}
