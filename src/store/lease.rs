//! Leases: grant, keep alive, revoke. Keys bound to a lease vanish when it ends, which is
//! how node liveness and leader election notice a dead process.

use etcd_client::{LeaseKeepAliveStream, LeaseKeeper};
use std::time::Duration;

use super::{Repeat, Store, StoreError};

/// An etcd lease id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseId(pub i64);

/// A keep-alive channel for one lease.
pub struct KeepAlive {
    id: LeaseId,
    keeper: LeaseKeeper,
    stream: LeaseKeepAliveStream,
}

impl KeepAlive {
    /// The lease kept alive.
    pub fn id(&self) -> LeaseId {
        self.id
    }

    /// Renews the lease once; returns the TTL etcd granted from now.
    /// [`StoreError::LeaseGone`] when the lease has expired or been revoked.
    pub async fn renew(&mut self) -> Result<Duration, StoreError> {
        self.keeper
            .keep_alive()
            .await
            .map_err(StoreError::from_etcd)?;
        match self.stream.message().await.map_err(StoreError::from_etcd)? {
            Some(resp) if resp.ttl() > 0 => Ok(Duration::from_secs(resp.ttl() as u64)),
            Some(_) => Err(StoreError::LeaseGone(self.id.0)),
            None => Err(StoreError::Unavailable(
                etcd_client::Error::LeaseKeepAliveError("keep-alive stream ended".into()),
            )),
        }
    }
}

impl Store {
    /// Grants a lease of `ttl` (rounded up to whole seconds, at least 1).
    pub async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId, StoreError> {
        let secs = ttl.as_secs_f64().ceil().max(1.0) as i64;
        let resp = self
            .send(Repeat::OnlyUnsent, |mut c| async move {
                c.lease_grant(secs, None).await
            })
            .await
            .map_err(StoreError::from_etcd)?;
        Ok(LeaseId(resp.id()))
    }

    /// Opens a keep-alive channel for a lease.
    pub async fn keep_alive(&self, id: LeaseId) -> Result<KeepAlive, StoreError> {
        let (keeper, stream) = self
            .send(Repeat::Idempotent, |mut c| async move {
                c.lease_keep_alive(id.0).await
            })
            .await
            .map_err(StoreError::from_etcd)?;
        Ok(KeepAlive { id, keeper, stream })
    }

    /// Revokes a lease, deleting its keys. A lease already gone counts as revoked.
    pub async fn revoke_lease(&self, id: LeaseId) -> Result<(), StoreError> {
        match self
            .send(Repeat::Idempotent, |mut c| async move {
                c.lease_revoke(id.0).await
            })
            .await
        {
            Ok(_) => Ok(()),
            Err(e) => match StoreError::from_etcd(e) {
                StoreError::LeaseGone(_) => Ok(()),
                other => Err(other),
            },
        }
    }

    /// The time a lease has left, `None` when it is gone.
    pub async fn lease_ttl(&self, id: LeaseId) -> Result<Option<Duration>, StoreError> {
        let resp = self
            .send(Repeat::Idempotent, |mut c| async move {
                c.lease_time_to_live(id.0, None).await
            })
            .await
            .map_err(StoreError::from_etcd)?;
        Ok((resp.ttl() > 0).then(|| Duration::from_secs(resp.ttl() as u64)))
    }
}
