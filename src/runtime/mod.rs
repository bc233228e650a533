//! Our kube-runtime: the machinery every reconciler runs on.
//!
//! # Layout
//! - [`watcher`]: a `Stream` of list-then-watch events that resumes from the last seen
//!   revision and relists after compaction; errors are items, never the end.
//! - [`backoff`]: the delay policy, and a stream adaptor that waits after errors.
//! - [`reflector`]: a read-only cache ([`reflector::Store`]) fed by one [`reflector::Writer`].
//! - [`queue`] and [`controller`]: triggers into a keyed queue that dedups and never runs
//!   one key twice at once, bounded concurrency, requeue decisions, per-key backoff that
//!   resets on success, periodic resync.
//! - [`informer`]: one watcher and cache per kind shared by a process's controllers.
//! - [`events`]: the event recorder (batched writes, repeats folded into one event with
//!   a count, events sharing a lease per time window).
//! - [`leader`]: leader election on a renewed record (its etcd lease only collects a
//!   dead holder's key), fenced on its key.
//! - [`metrics`]: per-controller counters, gauge and histogram in a Prometheus registry.
//! - [`writer`]: the store handle reconcilers write through; it records their writes,
//!   so a read of an object the cache shows behind this process's last write answers
//!   with that write.
//! - [`repeats`]: a failure that repeats is logged once, not once per retry.
//! - [`shared_read`]: a fresh read shared by the callers asking while it runs (no
//!   caller gets an answer from a read that began before it asked).
//! - [`term`]: a term of authority (a leadership, a registration) that ends by the
//!   holder's own clock unless renewed; checked before each CSI call made under it.
//! - [`steps`]: the step runner every executor calls CSI through, with per (object,
//!   step) retry gates that a reconciler's own writes cannot reset.

/// Exponential backoff with jitter (the crate's, shared with the store and CSI).
pub use crate::backoff;
pub mod controller;
pub mod events;
pub mod informer;
pub mod leader;
pub mod metrics;
pub mod queue;
pub mod reflector;
pub mod repeats;
pub mod shared_read;
pub mod steps;
pub mod term;
pub mod watcher;
pub mod writer;

use crate::api::{Object, Spec};

/// What the runtime needs of a cached object: its identity, the key below the store
/// prefix.
pub trait Resource: Clone + Send + Sync + 'static {
    /// The object's key, e.g. `volumes/default/db-data`.
    fn key(&self) -> String;

    /// The revision the object was read at (0 when unknown).
    fn version(&self) -> i64 {
        0
    }
}

impl<S: Spec> Resource for Object<S> {
    fn key(&self) -> String {
        Object::key(self)
    }

    fn version(&self) -> i64 {
        self.metadata.resource_version
    }
}
