//! The store's guarded writes: every object write is one etcd transaction whose
//! compares are the object's version (and, on a fenced store, the leader's fence); a
//! failed compare tells a lost fence apart from a changed object.

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse};

use super::group::{Outcome, Write};
use super::*;

impl Store {
    /// Reads the stored object and checks it is still at the caller's revision.
    pub(super) async fn current_at<S: Spec>(
        &self,
        obj: &Object<S>,
    ) -> Result<Object<S>, StoreError> {
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

    pub(super) async fn write_at<S: Spec>(
        &self,
        mut obj: Object<S>,
        revision: i64,
    ) -> Result<Object<S>, StoreError> {
        let key = obj.key();
        let full = self.full_key(&key);
        let compare = Compare::mod_revision(full.clone(), CompareOp::Equal, revision);
        let value = self.codec.encode(&obj)?;
        let bytes = value.len();
        // An update keeps the key's lease (a Node object lives under its agent's lease).
        let op = TxnOp::put(
            full.clone(),
            value,
            Some(PutOptions::new().with_ignore_lease()),
        );
        match self.guarded(Write::one(full, compare, op, bytes)).await? {
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
    pub(super) async fn delete_at(&self, key: &str, revision: i64) -> Result<i64, StoreError> {
        let full = self.full_key(key);
        let compare = Compare::mod_revision(full.clone(), CompareOp::Equal, revision);
        let op = TxnOp::delete(full.clone(), None);
        match self.guarded(Write::one(full, compare, op, 0)).await? {
            Ok(deleted_at) => Ok(deleted_at),
            Err(_) => Err(StoreError::Conflict {
                key: key.to_string(),
                expected: revision,
            }),
        }
    }

    /// Puts `value` at `key` if `compare` (and the fence, if any) holds. `Ok(Err(()))`
    /// means the compare failed.
    pub(super) async fn guarded_put(
        &self,
        key: &str,
        value: Vec<u8>,
        compare: Compare,
        lease: Option<LeaseId>,
    ) -> Result<Result<i64, ()>, StoreError> {
        let opts = lease.map(|l| PutOptions::new().with_lease(l.0));
        let bytes = value.len();
        let op = TxnOp::put(key, value, opts);
        self.guarded(Write::one(key.to_string(), compare, op, bytes))
            .await
    }

    /// Runs a write of one guarded key through the committer; `Ok(Err(()))` means its
    /// compare failed.
    async fn guarded(&self, write: Write) -> Result<Result<i64, ()>, StoreError> {
        Ok(self.commit_write(write).await?.map_err(|_| ()))
    }

    /// Runs every op of `write` if every compare and the fence hold, as one
    /// transaction, now; when a compare fails, returns what is stored at each of its
    /// `fetch` keys: `(full key, value, mod_revision)`. A lost fence is told apart
    /// from a failed compare by reading the fence key in the else branch.
    pub(super) async fn txn_now(&self, write: Write) -> Outcome {
        let Write {
            mut compares,
            ops,
            fetch,
            keys,
            ..
        } = write;
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
            .map_err(|e| self.refusal(e, Access::Write, || error::keys_named(&keys)))?;
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
}
