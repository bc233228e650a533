//! The watcher: list, then watch from the list's revision, as a `Stream`.
//!
//! Expected flow:
//! 1. List every object under the prefix (paged, one revision R) and yield
//!    [`Event::Restarted`] with them; each malformed value is yielded as an error first.
//! 2. Watch from R+1 and yield [`Event::Applied`] / [`Event::Deleted`] per change,
//!    remembering the last revision seen (events, and progress notifications).
//! 3. If the watch fails or etcd closes it, yield the error and watch again from the last
//!    revision seen + 1: nothing is missed and nothing is repeated.
//! 4. If etcd has compacted that revision away, yield [`WatchError::Compacted`] and go
//!    back to 1 (a relist: the Restarted event replaces what consumers knew).
//!
//! Errors are items, never the end of the stream; wrap it in
//! [`backoff`](super::backoff::backoff) so failures do not spin.

use futures::Stream;
use std::collections::VecDeque;
use std::sync::Arc;

use crate::api::{KeyScope, Object, Spec};
use crate::store::{RawEventKind, Store, StoreError, WatchStream};

/// A change seen by a watcher. Objects are shared (`Arc`): the cache, every
/// subscriber's copy of the event and a resync snapshot hold the one decoded object.
#[derive(Debug, PartialEq)]
pub enum Event<K> {
    /// A fresh list: the complete current set, replacing anything known before.
    Restarted(Vec<Arc<K>>),
    /// An object was created or changed.
    Applied(Arc<K>),
    /// An object was deleted; `last` is its last state when etcd still had it.
    Deleted {
        /// The key below the store prefix.
        key: String,
        /// The last state, if known and valid.
        last: Option<Arc<K>>,
    },
}

impl<K> Event<K> {
    /// A `Restarted` event of `objects`.
    pub fn restarted(objects: Vec<K>) -> Self {
        Event::Restarted(objects.into_iter().map(Arc::new).collect())
    }

    /// An `Applied` event of `object`.
    pub fn applied(object: K) -> Self {
        Event::Applied(Arc::new(object))
    }
}

// Not derived: cloning an event clones pointers, and needs no `K: Clone`.
impl<K> Clone for Event<K> {
    fn clone(&self) -> Self {
        match self {
            Event::Restarted(all) => Event::Restarted(all.clone()),
            Event::Applied(o) => Event::Applied(o.clone()),
            Event::Deleted { key, last } => Event::Deleted {
                key: key.clone(),
                last: last.clone(),
            },
        }
    }
}

/// What went wrong while watching; the stream goes on after each.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    /// The initial list failed; it will be retried.
    #[error("listing failed")]
    List(#[source] StoreError),
    /// Opening or reading the watch failed; it resumes from the last revision.
    #[error("watch failed at revision {revision}")]
    Watch {
        /// The last revision seen.
        revision: i64,
        /// The cause.
        #[source]
        source: StoreError,
    },
    /// etcd closed the watch stream; it resumes from the last revision.
    #[error("etcd closed the watch at revision {0}")]
    Closed(i64),
    /// The resume revision was compacted away; the watcher relists.
    #[error("revision {revision} was compacted (etcd keeps from {compact_revision}); relisting")]
    Compacted {
        /// The revision the watcher wanted.
        revision: i64,
        /// The oldest revision etcd keeps.
        compact_revision: i64,
    },
    /// A value that is not a valid object was skipped.
    #[error("skipped a malformed value")]
    Malformed(#[source] StoreError),
}

enum State {
    /// Must (re)list.
    Empty,
    /// Knows everything up to `revision`; must open a watch from `revision + 1`.
    Listed { revision: i64 },
    /// Watching; has seen everything up to `revision`.
    Watching {
        revision: i64,
        stream: Box<WatchStream>,
    },
}

/// What a watcher makes of each decoded object: the item it yields, or `None` for
/// an object its consumer does not keep (a change to one is yielded as its
/// deletion, so a consumer that kept it before drops it).
pub type Make<S, T> = Arc<dyn Fn(Object<S>) -> Option<Arc<T>> + Send + Sync>;

struct Watcher<S: Spec, T> {
    store: Store,
    scope: KeyScope<S>,
    previous: bool,
    make: Make<S, T>,
    state: State,
    pending: VecDeque<Result<Event<T>, WatchError>>,
}

/// Watches the objects of kind `S` in `scope` (the kind, or one node's claims or
/// mounts); a deletion carries the object's last state.
pub fn watcher<S: Spec>(
    store: Store,
    scope: KeyScope<S>,
) -> impl Stream<Item = Result<Event<Object<S>>, WatchError>> + Send + 'static {
    watcher_with(store, scope, true)
}

/// [`watcher`], and with `previous` false a deletion carries no last state
/// (`last: None`): etcd then does not read each event's prior value, which a consumer
/// that keeps a cache (the informer fills `last` from it) does not need.
pub fn watcher_with<S: Spec>(
    store: Store,
    scope: KeyScope<S>,
    previous: bool,
) -> impl Stream<Item = Result<Event<Object<S>>, WatchError>> + Send + 'static {
    watcher_making(store, scope, previous, Arc::new(|o| Some(Arc::new(o))))
}

/// [`watcher_with`] yielding what `make` makes of each object as it is decoded (a
/// projection, or nothing for an object not kept): a list never holds every decoded
/// object at once, only what `make` keeps of them.
pub fn watcher_making<S: Spec, T: Send + Sync + 'static>(
    store: Store,
    scope: KeyScope<S>,
    previous: bool,
    make: Make<S, T>,
) -> impl Stream<Item = Result<Event<T>, WatchError>> + Send + 'static {
    let w = Watcher::<S, T> {
        store,
        scope,
        previous,
        make,
        state: State::Empty,
        pending: VecDeque::new(),
    };
    futures::stream::unfold(w, |mut w| async move {
        loop {
            if let Some(item) = w.pending.pop_front() {
                return Some((item, w));
            }
            w.step().await;
        }
    })
}

impl<S: Spec, T: Send + Sync + 'static> Watcher<S, T> {
    async fn step(&mut self) {
        self.state = match std::mem::replace(&mut self.state, State::Empty) {
            State::Empty => match self.store.list_making(&self.scope, &*self.make).await {
                Ok(list) => {
                    // The list first, then its malformed values: a reader marking
                    // those does so on the listed state.
                    self.pending.push_back(Ok(Event::Restarted(list.items)));
                    self.pending.extend(
                        list.malformed
                            .into_iter()
                            .map(|e| Err(WatchError::Malformed(e))),
                    );
                    State::Listed {
                        revision: list.revision,
                    }
                }
                Err(e) => {
                    self.pending.push_back(Err(WatchError::List(e)));
                    State::Empty
                }
            },
            State::Listed { revision } => {
                match self
                    .store
                    .watch_raw(self.scope.as_str(), revision + 1, self.previous)
                    .await
                {
                    Ok(stream) => State::Watching {
                        revision,
                        stream: Box::new(stream),
                    },
                    Err(source) => {
                        self.pending
                            .push_back(Err(WatchError::Watch { revision, source }));
                        State::Listed { revision }
                    }
                }
            }
            State::Watching {
                mut revision,
                mut stream,
            } => match stream.next().await {
                Ok(Some(batch)) => {
                    if batch.compact_revision > 0 || batch.canceled {
                        self.pending.push_back(Err(WatchError::Compacted {
                            revision,
                            compact_revision: batch.compact_revision,
                        }));
                        return self.state = State::Empty;
                    }
                    if batch.is_progress() {
                        revision = revision.max(batch.header_revision);
                    }
                    for ev in batch.events {
                        revision = revision.max(ev.mod_revision);
                        let item = match ev.kind {
                            RawEventKind::Put => self
                                .store
                                .codec()
                                .decode::<S>(&ev.key, &ev.value, ev.mod_revision)
                                .map(|o| match (self.make)(o) {
                                    Some(item) => Event::Applied(item),
                                    None => Event::Deleted {
                                        key: ev.key,
                                        last: None,
                                    },
                                })
                                .map_err(WatchError::Malformed),
                            RawEventKind::Delete => Ok(Event::Deleted {
                                last: ev.prev_value.and_then(|(value, rev)| {
                                    let o = self.store.codec().decode::<S>(&ev.key, &value, rev);
                                    (self.make)(o.ok()?)
                                }),
                                key: ev.key,
                            }),
                        };
                        self.pending.push_back(item);
                    }
                    State::Watching { revision, stream }
                }
                Ok(None) => {
                    self.pending.push_back(Err(WatchError::Closed(revision)));
                    State::Listed { revision }
                }
                Err(source) => {
                    self.pending
                        .push_back(Err(WatchError::Watch { revision, source }));
                    State::Listed { revision }
                }
            },
        };
    }
}
