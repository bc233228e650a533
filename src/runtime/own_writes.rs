//! A cache view that reads this process's own writes: a reconciler decides from its
//! cache, and reads the store only for an object whose last write by this process the
//! cache has not shown yet.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::reflector;
use crate::api::{Object, ObjectKey, Spec};
use crate::store::{Store, StoreError};

/// The store revision of this process's last write of each key, kept until this
/// process's cache shows that write. A reconciler then decides from its cache and
/// reads fresh only while the cache lags what it wrote itself: reading every object
/// fresh cost one linearizable read per reconcile (100,000 at a controller start).
/// Writes by others the cache has not shown yet are caught by the writes' guards.
#[derive(Debug, Clone, Default)]
pub struct OwnWrites(Arc<Mutex<HashMap<String, i64>>>);

impl OwnWrites {
    /// Notes a write (the object as the store returned it; for a deletion, at the
    /// deletion's revision).
    pub fn wrote<S: Spec>(&self, written: &Object<S>) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(written.key(), written.metadata.resource_version);
    }

    /// The object at `key` from `cache` when the cache holds this process's last
    /// write of it (or there is none), else as read from the store (`None` when gone).
    pub async fn fresh<S: Spec>(
        &self,
        store: &Store,
        cache: &reflector::Store<Object<S>>,
        key: &ObjectKey<S>,
    ) -> Result<Option<Arc<Object<S>>>, StoreError> {
        let cached = cache.get(key);
        {
            let mut writes = self.0.lock().unwrap_or_else(|p| p.into_inner());
            match (writes.get(key.as_str()), &cached) {
                (None, _) => return Ok(cached),
                (Some(&rev), Some(c)) if c.metadata.resource_version >= rev => {
                    writes.remove(key.as_str());
                    return Ok(cached);
                }
                _ => {}
            }
        }
        let stored = store.try_get(key).await?.map(Arc::new);
        if stored.is_none() && cached.is_none() {
            // Gone (our write was its deletion, or it went since) and the cache agrees.
            self.0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(key.as_str());
        }
        Ok(stored)
    }
}
