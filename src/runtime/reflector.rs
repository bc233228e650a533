//! The reflector: a read-only cache of one kind, fed by exactly one writer.
//!
//! [`Store`] is a cheap clone handing out `Arc<K>`; [`Writer`] applies watcher events;
//! [`reflector`] threads a watcher stream through a writer so the cache is current
//! before a consumer sees each event.

use futures::{Stream, StreamExt};
use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use super::watcher::Event;
use super::Resource;

type Map<K> = Arc<RwLock<HashMap<String, Arc<K>>>>;

/// A read-only view of the cache.
#[derive(Clone)]
pub struct Store<K> {
    map: Map<K>,
    ready: tokio::sync::watch::Receiver<bool>,
}

/// The single writer of a cache.
pub struct Writer<K> {
    map: Map<K>,
    ready: tokio::sync::watch::Sender<bool>,
}

/// A new empty cache: its writer, and a reader to clone.
pub fn store<K: Resource>() -> (Store<K>, Writer<K>) {
    let map: Map<K> = Arc::default();
    let (tx, rx) = tokio::sync::watch::channel(false);
    (
        Store {
            map: map.clone(),
            ready: rx,
        },
        Writer { map, ready: tx },
    )
}

impl<K: Resource> Store<K> {
    /// The object at a key.
    pub fn get(&self, key: &str) -> Option<Arc<K>> {
        self.read().get(key).cloned()
    }

    /// Every cached object.
    pub fn state(&self) -> Vec<Arc<K>> {
        self.read().values().cloned().collect()
    }

    /// Every cached key.
    pub fn keys(&self) -> Vec<String> {
        self.read().keys().cloned().collect()
    }

    /// How many objects are cached.
    pub fn len(&self) -> usize {
        self.read().len()
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

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, Arc<K>>> {
        // A writer that panicked mid-update left a map that is still whole: keep serving.
        self.map.read().unwrap_or_else(|e| e.into_inner())
    }
}

impl<K: Resource> Writer<K> {
    /// Applies one watcher event.
    pub fn apply(&mut self, event: &Event<K>) {
        let mut map = self.map.write().unwrap_or_else(|e| e.into_inner());
        match event {
            Event::Restarted(objects) => {
                *map = objects
                    .iter()
                    .map(|o| (o.key(), Arc::new(o.clone())))
                    .collect();
                drop(map);
                self.ready.send_replace(true);
            }
            Event::Applied(obj) => {
                map.insert(obj.key(), Arc::new(obj.clone()));
            }
            Event::Deleted { key, .. } => {
                map.remove(key);
            }
        }
    }

    /// A reader of this writer's cache.
    pub fn reader(&self) -> Store<K> {
        Store {
            map: self.map.clone(),
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
    }

    #[tokio::test]
    async fn writer_applies_events_and_readers_see_them() {
        let (reader, writer) = store::<Obj>();
        assert!(!reader.is_ready());
        let events: Vec<Result<Event<Obj>, ()>> = vec![
            Ok(Event::Restarted(vec![Obj("a", 1), Obj("b", 1)])),
            Ok(Event::Applied(Obj("a", 2))),
            Err(()),
            Ok(Event::Deleted {
                key: "b".into(),
                last: None,
            }),
            Ok(Event::Applied(Obj("c", 1))),
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
        writer.apply(&Event::Restarted(vec![Obj("a", 1), Obj("b", 1)]));
        writer.apply(&Event::Restarted(vec![Obj("c", 1)]));
        assert_eq!(reader.keys(), ["c"]);
    }
}
