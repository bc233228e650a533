//! Transactions as etcd answers them: every compare against the current values, then
//! one branch's ops applied at one revision (a put or delete of one key twice in a
//! branch is refused, as etcd refuses it).

use super::*;

impl Mvcc {
    /// Txn: compares, then one branch, all at one revision.
    pub fn txn_request(
        &mut self,
        req: &PbTxnRequest,
    ) -> Result<(i64, bool, Vec<PbTxnOpResponse>), Status> {
        for branch in [&req.success, &req.failure] {
            check_duplicates(branch)?;
        }
        let succeeded = req.compare.iter().all(|c| self.compare(c));
        let ops = if succeeded {
            &req.success
        } else {
            &req.failure
        };
        self.check_ops(ops)?;
        let mut pending = Pending::default();
        let rev = self.revision + 1;
        let responses = self.apply_ops(ops, rev, &mut pending)?;
        Ok((self.finish(pending)?, succeeded, responses))
    }

    pub(super) fn check_ops(&self, ops: &[PbTxnRequestOp]) -> Result<(), Status> {
        for op in ops {
            match &op.request {
                Some(PbTxnOpRequest::RequestPut(p)) => self.check_put(p)?,
                Some(PbTxnOpRequest::RequestRange(r)) if r.revision > self.revision + 1 => {
                    return Err(future_revision())
                }
                Some(PbTxnOpRequest::RequestDeleteRange(d)) if d.key.is_empty() => {
                    return Err(empty_key())
                }
                Some(PbTxnOpRequest::RequestTxn(t)) => {
                    self.check_ops(&t.success)?;
                    self.check_ops(&t.failure)?;
                }
                _ => {}
            }
        }
        Ok(())
    }

    pub(super) fn apply_ops(
        &mut self,
        ops: &[PbTxnRequestOp],
        rev: i64,
        pending: &mut Pending,
    ) -> Result<Vec<PbTxnOpResponse>, Status> {
        use etcd_client::proto::{PbDeleteResponse, PbPutResponse, PbRangeResponse, PbTxnResponse};
        let mut out = Vec::with_capacity(ops.len());
        for op in ops {
            let resp = match &op.request {
                Some(PbTxnOpRequest::RequestRange(r)) => {
                    let mut r = r.clone();
                    if r.revision == rev {
                        r.revision = 0;
                    }
                    let (kvs, count, more) = self.range(&r)?;
                    PbTxnOpResponse::ResponseRange(PbRangeResponse {
                        header: None,
                        kvs,
                        more,
                        count,
                    })
                }
                Some(PbTxnOpRequest::RequestPut(p)) => {
                    let prev = self.put(p, rev, pending);
                    PbTxnOpResponse::ResponsePut(PbPutResponse {
                        header: None,
                        prev_kv: if p.prev_kv { prev } else { None },
                    })
                }
                Some(PbTxnOpRequest::RequestDeleteRange(d)) => {
                    let gone = self.delete(&d.key, &d.range_end, rev, pending);
                    PbTxnOpResponse::ResponseDeleteRange(PbDeleteResponse {
                        header: None,
                        deleted: gone.len() as i64,
                        prev_kvs: if d.prev_kv { gone } else { Vec::new() },
                    })
                }
                Some(PbTxnOpRequest::RequestTxn(t)) => {
                    let succeeded = t.compare.iter().all(|c| self.compare(c));
                    let branch = if succeeded { &t.success } else { &t.failure };
                    let responses = self
                        .apply_ops(branch, rev, pending)?
                        .into_iter()
                        .map(|r| etcd_client::proto::PbResponseOp { response: Some(r) })
                        .collect();
                    PbTxnOpResponse::ResponseTxn(PbTxnResponse {
                        header: None,
                        succeeded,
                        responses,
                    })
                }
                None => return Err(Status::invalid_argument("etcdserver: empty request op")),
            };
            out.push(resp);
        }
        Ok(out)
    }

    pub(super) fn compare(&self, c: &PbCompare) -> bool {
        let (lo, hi) = range_bounds(&c.key, &c.range_end);
        let kvs: Vec<&PbKeyValue> = self.kv.range::<[u8], _>((lo, hi)).map(|(_, v)| v).collect();
        if kvs.is_empty() {
            // As etcd: a value compare on a missing key fails; other targets compare
            // against zero.
            if matches!(c.target_union, Some(PbTargetUnion::Value(_))) || c.target == 3 {
                return false;
            }
            return compare_one(c, &PbKeyValue::default());
        }
        kvs.iter().all(|kv| compare_one(c, kv))
    }
}

/// etcd refuses a txn branch that puts one key twice, or puts a key it also deletes.
pub(super) fn check_duplicates(ops: &[PbTxnRequestOp]) -> Result<(), Status> {
    fn puts(ops: &[PbTxnRequestOp], out: &mut Vec<Vec<u8>>) -> Result<(), Status> {
        for op in ops {
            match &op.request {
                Some(PbTxnOpRequest::RequestPut(p)) => {
                    if out.contains(&p.key) {
                        return Err(duplicate_key());
                    }
                    out.push(p.key.clone());
                }
                Some(PbTxnOpRequest::RequestTxn(t)) => {
                    let mut success = Vec::new();
                    puts(&t.success, &mut success)?;
                    let mut failure = Vec::new();
                    puts(&t.failure, &mut failure)?;
                    for key in success.into_iter().chain(failure) {
                        if out.contains(&key) {
                            return Err(duplicate_key());
                        }
                        out.push(key);
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }
    let mut put_keys = Vec::new();
    puts(ops, &mut put_keys)?;
    for op in ops {
        if let Some(PbTxnOpRequest::RequestDeleteRange(d)) = &op.request {
            if put_keys.iter().any(|k| in_range(k, &d.key, &d.range_end)) {
                return Err(duplicate_key());
            }
        }
    }
    Ok(())
}

pub(super) fn duplicate_key() -> Status {
    Status::new(
        Code::InvalidArgument,
        "etcdserver: duplicate key given in txn request",
    )
}

pub(super) fn compare_one(c: &PbCompare, kv: &PbKeyValue) -> bool {
    use std::cmp::Ordering;
    let ord = match &c.target_union {
        Some(PbTargetUnion::Version(v)) => kv.version.cmp(v),
        Some(PbTargetUnion::CreateRevision(v)) => kv.create_revision.cmp(v),
        Some(PbTargetUnion::ModRevision(v)) => kv.mod_revision.cmp(v),
        Some(PbTargetUnion::Value(v)) => kv.value.as_slice().cmp(v.as_slice()),
        Some(PbTargetUnion::Lease(v)) => kv.lease.cmp(v),
        None => return false,
    };
    match c.result {
        0 => ord == Ordering::Equal,
        1 => ord == Ordering::Greater,
        2 => ord == Ordering::Less,
        3 => ord != Ordering::Equal,
        _ => false,
    }
}
