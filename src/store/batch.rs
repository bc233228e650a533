//! Several writes committed as one etcd transaction: every one of them or none.
//!
//! A claim's step often changes two objects that only this controller writes (the
//! volume's live claims and the claim; the attachment's `detach` and the claim's
//! reason). Committed together they cost one revision, one round trip and one watch
//! delivery per watcher instead of two, and no reader sees one without the other.

use std::any::Any;
use std::sync::Arc;

use etcd_client::{Compare, CompareOp, PutOptions, TxnOp};

use super::group::Write;
use super::{Codec, LeaseId, Store, StoreError};
use crate::api::{Object, Spec};

/// Decodes a value as the kind its guard was taken on, to tell a malformed value from
/// a newer valid one when the guard fails.
type Check = fn(&Codec, &str, &[u8], i64) -> Result<(), StoreError>;

fn check_as<S: Spec>(
    codec: &Codec,
    key: &str,
    value: &[u8],
    revision: i64,
) -> Result<(), StoreError> {
    codec.decode::<S>(key, value, revision).map(|_| ())
}

/// One guarded key of a batch.
#[derive(Debug)]
struct Guard {
    key: String,
    expected: i64,
    check: Option<Check>,
    /// The batch writes the whole object at this key (an update): over garbage there,
    /// it may write its own state instead.
    repairs: bool,
    /// The update deletes the object (it removed the last finalizer of a deletion).
    deletes: bool,
    /// The batch creates the object.
    creates: bool,
}

/// Writes to commit at once with [`Batch::commit`]. Each is guarded by the version
/// its caller read; if any object changed since (or one to create exists), nothing is
/// written and the commit is a [`StoreError::Conflict`].
#[derive(Debug, Default)]
pub struct Batch {
    compares: Vec<Compare>,
    ops: Vec<TxnOp>,
    keys: Vec<Guard>,
    /// Bytes of the values it puts.
    bytes: usize,
    objects: Stamps,
}

/// An object a batch writes, as it is stored once the commit's revision (its
/// resource_version) is known: an `Arc<Object<S>>`.
pub type Stamp = Box<dyn FnOnce(i64) -> Arc<dyn Any + Send + Sync> + Send>;

/// The objects a batch writes, by key.
#[derive(Default)]
struct Stamps(Vec<(String, Stamp)>);

impl std::fmt::Debug for Stamps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|(k, _)| k))
            .finish()
    }
}

impl Batch {
    /// Adds `next` written over `read` (the object as stored at its resource_version),
    /// as [`Store::update`] does; returns the object as it will be stored (its
    /// resource_version is the commit's revision).
    pub fn update<S: Spec>(
        &mut self,
        store: &Store,
        read: &Object<S>,
        next: &Object<S>,
    ) -> Result<Object<S>, StoreError> {
        let mut obj = next.clone();
        obj.apply_defaults();
        obj.metadata.name = read.metadata.name.clone();
        obj.metadata.namespace = read.metadata.namespace.clone();
        Store::check(&obj)?;
        if obj.key() != read.key() {
            let mut errors = crate::api::ValidationErrors::default();
            errors.push(
                "spec",
                format!("would move {} to {}", read.key(), obj.key()),
            );
            return Err(StoreError::Invalid {
                kind: S::KIND,
                errors,
            });
        }
        obj.metadata.uid = read.metadata.uid.clone();
        obj.metadata.creation_timestamp = read.metadata.creation_timestamp;
        obj.metadata.deletion_timestamp = read.metadata.deletion_timestamp;
        obj.metadata.generation = read.metadata.generation + i64::from(obj.spec != read.spec);
        let rv = read.metadata.resource_version;
        let full = store.full_key(&obj.key());
        self.compares
            .push(Compare::mod_revision(full.clone(), CompareOp::Equal, rv));
        let deletes = obj.is_deleting() && obj.metadata.finalizers.is_empty();
        self.ops.push(if deletes {
            // Removing the last finalizer of an object being deleted deletes it.
            TxnOp::delete(full, None)
        } else {
            // An update keeps the key's lease (a Node lives under its agent's lease).
            let value = store.codec().encode(&obj)?;
            self.bytes += value.len();
            TxnOp::put(full, value, Some(PutOptions::new().with_ignore_lease()))
        });
        self.keys.push(Guard {
            key: obj.key(),
            expected: rv,
            check: Some(check_as::<S>),
            repairs: true,
            deletes,
            creates: false,
        });
        if !deletes {
            self.stamp(&obj);
        }
        Ok(obj)
    }

    fn stamp<S: Spec>(&mut self, obj: &Object<S>) {
        let mut stored = obj.clone();
        let stamp: Stamp = Box::new(move |revision| {
            stored.metadata.resource_version = revision;
            Arc::new(stored)
        });
        self.objects.0.push((obj.key(), stamp));
    }

    /// The objects the batch writes (not those it deletes), by key, each to be
    /// stamped with the commit's revision: what a writer keeps while its cache lags.
    pub fn take_objects(&mut self) -> Vec<(String, Stamp)> {
        std::mem::take(&mut self.objects.0)
    }

    /// The objects the batch writes or creates (by key), and whether it deletes each.
    pub fn written(&self) -> Vec<(String, bool)> {
        self.keys
            .iter()
            .filter(|g| g.repairs || g.creates)
            .map(|g| (g.key.clone(), g.deletes))
            .collect()
    }

    /// Adds a guard without a write: the batch commits only while `read` is still
    /// stored at the version read (a decision taken from it is still true).
    pub fn unchanged<S: Spec>(&mut self, store: &Store, read: &Object<S>) {
        let full = store.full_key(&read.key());
        self.compares.push(Compare::mod_revision(
            full,
            CompareOp::Equal,
            read.metadata.resource_version,
        ));
        self.keys.push(Guard {
            key: read.key(),
            expected: read.metadata.resource_version,
            check: Some(check_as::<S>),
            repairs: false,
            deletes: false,
            creates: false,
        });
    }

    /// Adds a guard without a write: the batch commits only while nothing is stored at
    /// `key` (what was decided because it is absent still holds).
    pub fn absent<S: Spec>(&mut self, store: &Store, key: &crate::api::ObjectKey<S>) {
        let full = store.full_key(key.as_str());
        self.compares
            .push(Compare::version(full, CompareOp::Equal, 0));
        self.keys.push(Guard {
            key: key.as_str().to_string(),
            expected: 0,
            check: None,
            repairs: false,
            deletes: false,
            creates: false,
        });
    }

    /// Adds a put of `value` at `key` (below the prefix), a key that is not an object,
    /// guarded by the mod_revision it was read at (0: absent).
    pub fn put_raw(&mut self, store: &Store, key: &str, value: Vec<u8>, read_at: i64) {
        let full = store.full_key(key);
        self.compares.push(Compare::mod_revision(
            full.clone(),
            CompareOp::Equal,
            read_at,
        ));
        self.bytes += value.len();
        self.ops.push(TxnOp::put(full, value, None));
        self.keys.push(Guard {
            key: key.to_string(),
            expected: read_at,
            check: None,
            repairs: false,
            deletes: false,
            creates: false,
        });
    }

    /// Adds the creation of `obj`, as [`Store::create`] does (without a lease); returns
    /// it as it will be stored.
    pub fn create<S: Spec>(
        &mut self,
        store: &Store,
        obj: &Object<S>,
    ) -> Result<Object<S>, StoreError> {
        self.create_inner(store, obj, None)
    }

    /// Adds the creation of `obj` bound to `lease` (deleted when the lease ends).
    pub fn create_with_lease<S: Spec>(
        &mut self,
        store: &Store,
        obj: &Object<S>,
        lease: LeaseId,
    ) -> Result<Object<S>, StoreError> {
        self.create_inner(store, obj, Some(lease))
    }

    fn create_inner<S: Spec>(
        &mut self,
        store: &Store,
        obj: &Object<S>,
        lease: Option<LeaseId>,
    ) -> Result<Object<S>, StoreError> {
        let obj = Store::prepared_for_create(obj)?;
        let full = store.full_key(&obj.key());
        self.compares
            .push(Compare::create_revision(full.clone(), CompareOp::Equal, 0));
        let options = lease.map(|l| PutOptions::new().with_lease(l.0));
        let value = store.codec().encode(&obj)?;
        self.bytes += value.len();
        self.ops.push(TxnOp::put(full, value, options));
        self.keys.push(Guard {
            key: obj.key(),
            expected: 0,
            check: None,
            repairs: false,
            deletes: false,
            creates: true,
        });
        self.stamp(&obj);
        Ok(obj)
    }

    /// Commits every write, or none; returns the revision, which is the
    /// resource_version of every object written. A failed guard is a
    /// [`StoreError::Conflict`] naming every key of the batch (etcd does not say which
    /// compare failed), unless a guarded key now holds a value that is not a valid
    /// object of its kind (garbage written over it). Where the batch writes that whole
    /// object (an update: its single writer's own state), it writes it over exactly
    /// that garbage, with a warning; where it only guards it, the commit is a
    /// [`StoreError::Malformed`] naming it, so that a writer is not told to read again
    /// what it can never read.
    pub async fn commit(self, store: &Store) -> Result<i64, StoreError> {
        self.commit_riding(store, std::time::Duration::ZERO).await
    }

    /// [`Batch::commit`] of writes that need not land at once (events): the batch
    /// joins the transaction of another write this process makes within `linger`, or
    /// goes alone after it (the store's riders: `store::group`). A retry after a repair goes
    /// at once.
    pub async fn commit_riding(
        self,
        store: &Store,
        mut linger: std::time::Duration,
    ) -> Result<i64, StoreError> {
        let Batch {
            mut compares,
            ops,
            mut keys,
            bytes,
            objects: _,
        } = self;
        if ops.is_empty() {
            return Ok(0);
        }
        // At most one repair per key, then the outcome stands.
        for _ in 0..=keys.len() {
            let fetch = keys
                .iter()
                .filter(|g| g.check.is_some())
                .map(|g| store.full_key(&g.key))
                .collect();
            let write = Write {
                compares: compares.clone(),
                ops: ops.clone(),
                fetch,
                keys: keys.iter().map(|g| store.full_key(&g.key)).collect(),
                bytes,
            };
            let found = match store
                .commit_riding(write, std::mem::take(&mut linger))
                .await?
            {
                Ok(revision) => return Ok(revision),
                Err(found) => found,
            };
            let mut repaired = false;
            for (i, g) in keys.iter_mut().enumerate() {
                let Some(check) = g.check else { continue };
                let full = store.full_key(&g.key);
                let Some((_, value, revision)) = found.iter().find(|(k, _, _)| *k == full) else {
                    continue;
                };
                if *revision == g.expected {
                    continue;
                }
                let Err(e @ StoreError::Malformed { .. }) =
                    check(store.codec(), &g.key, value, *revision)
                else {
                    continue;
                };
                if !g.repairs {
                    return Err(e);
                }
                tracing::warn!(
                    key = %g.key,
                    revision,
                    cause = %super::bounded_chain(&e),
                    "repairing a malformed value with this writer's own state"
                );
                compares[i] = Compare::mod_revision(full, CompareOp::Equal, *revision);
                g.expected = *revision;
                g.repairs = false;
                repaired = true;
            }
            if !repaired {
                break;
            }
        }
        Err(StoreError::Conflict {
            key: keys
                .iter()
                .map(|g| g.key.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            expected: keys.first().map_or(0, |g| g.expected),
        })
    }

    /// Commits a batch of the one write that made `obj`, and returns it as stored.
    pub(super) async fn commit_one<S: Spec>(
        self,
        store: &Store,
        mut obj: Object<S>,
    ) -> Result<Object<S>, StoreError> {
        obj.metadata.resource_version = self.commit(store).await?;
        Ok(obj)
    }
}
