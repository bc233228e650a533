//! Leases: granted (TTLs raised to etcd's minimum), kept alive, revoked (with their
//! keys, in one revision) and expired by the server's clock.

use super::*;

impl Mvcc {
    /// Grants a lease (`id` 0: pick one).
    pub fn grant(&mut self, id: i64, ttl: i64) -> Result<(i64, i64), Status> {
        if ttl > MAX_LEASE_TTL {
            return Err(Status::new(
                Code::OutOfRange,
                "etcdserver: too large lease TTL",
            ));
        }
        let ttl = ttl.max(MIN_LEASE_TTL);
        let id = if id == 0 {
            loop {
                let candidate = fastrand::i64(1..i64::MAX);
                if !self.leases.contains_key(&candidate) {
                    break candidate;
                }
            }
        } else if self.leases.contains_key(&id) {
            return Err(Status::new(
                Code::FailedPrecondition,
                "etcdserver: lease already exists",
            ));
        } else {
            id
        };
        let txn = self.db.begin_write().map_err(storage)?;
        txn.open_table(LEASES)
            .map_err(storage)?
            .insert(id, ttl)
            .map_err(storage)?;
        txn.commit().map_err(storage)?;
        self.leases.insert(
            id,
            Lease {
                ttl,
                deadline: Instant::now() + Duration::from_secs(ttl as u64),
                keys: BTreeSet::new(),
            },
        );
        Ok((id, ttl))
    }

    /// Revokes a lease and deletes its keys in one revision.
    pub fn revoke(&mut self, id: i64) -> Result<i64, Status> {
        let Some(lease) = self.leases.get(&id) else {
            return Err(lease_not_found());
        };
        let keys: Vec<Vec<u8>> = lease.keys.iter().cloned().collect();
        let mut pending = Pending::default();
        let rev = self.revision + 1;
        for key in keys {
            self.delete(&key, &[], rev, &mut pending);
        }
        let rev = self.finish(pending)?;
        let txn = self.db.begin_write().map_err(storage)?;
        txn.open_table(LEASES)
            .map_err(storage)?
            .remove(id)
            .map_err(storage)?;
        txn.commit().map_err(storage)?;
        self.leases.remove(&id);
        Ok(rev)
    }

    /// Renews a lease; its TTL, or 0 when it is unknown (as etcd answers).
    pub fn keep_alive(&mut self, id: i64) -> i64 {
        match self.leases.get_mut(&id) {
            Some(l) => {
                l.deadline = Instant::now() + Duration::from_secs(l.ttl as u64);
                l.ttl
            }
            None => 0,
        }
    }

    /// Leases past their deadline.
    pub fn expired(&self, now: Instant) -> Vec<i64> {
        self.leases
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .map(|(id, _)| *id)
            .collect()
    }
}
