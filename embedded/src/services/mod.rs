//! The gRPC services over [`Mvcc`]: one lock around the data, writes on blocking threads
//! (each one fsyncs), a revision channel that wakes watchers.
//!
//! # Layout
//! - this file: the KV, Lease and Maintenance services over [`Mvcc`].
//! - `watches`: the Watch service.

use std::collections::HashMap;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use etcd_client::proto::*;
use futures::Stream;
use prost::Message;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use super::mvcc::{compacted, in_range, Mvcc};

mod watches;

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// How often a watch that asked for progress notifications gets one when idle.
const PROGRESS_INTERVAL: Duration = Duration::from_secs(10);
/// Watch responses are cut near this size (gRPC clients refuse 4 MiB messages).
const MAX_BATCH_BYTES: usize = 1 << 20;
const CLUSTER_ID: u64 = 0x6d6f_6f72;
const MEMBER_ID: u64 = 1;

/// The store shared by the services.
#[derive(Clone)]
pub struct EmbeddedStore {
    inner: Arc<Inner>,
}

struct Inner {
    mvcc: Mutex<Mvcc>,
    revision: watch::Sender<i64>,
}

impl EmbeddedStore {
    /// Opens the store in `dir`, keeping `retention` revisions of history.
    pub fn open(dir: &Path, retention: i64) -> anyhow::Result<EmbeddedStore> {
        let mvcc = Mvcc::open(dir, retention)?;
        let (revision, _) = watch::channel(mvcc.revision);
        Ok(EmbeddedStore {
            inner: Arc::new(Inner {
                mvcc: Mutex::new(mvcc),
                revision,
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Mvcc> {
        // A panic while holding the lock cannot leave a half-applied write (writes are
        // undone unless persisted), so a poisoned lock is still consistent.
        self.inner.mvcc.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn header(&self, revision: i64) -> Option<PbResponseHeader> {
        Some(PbResponseHeader {
            cluster_id: CLUSTER_ID,
            member_id: MEMBER_ID,
            revision,
            raft_term: 1,
        })
    }

    /// Runs a write on a blocking thread (it fsyncs) and wakes the watchers.
    async fn write<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Mvcc) -> Result<T, Status> + Send + 'static,
    ) -> Result<(T, i64), Status> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || {
            let mut m = this.lock();
            let out = f(&mut m)?;
            let rev = m.revision;
            this.inner.revision.send_replace(rev);
            Ok((out, rev))
        })
        .await
        .map_err(|e| Status::internal(format!("moor-store: write task failed: {e}")))?
    }

    /// Revokes expired leases until `shutdown`.
    async fn expire_leases(self, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            let expired = self.lock().expired(Instant::now());
            for id in expired {
                if let Err(e) = self.write(move |m| m.revoke(id)).await {
                    tracing::warn!(lease = id, error = %e, "revoking an expired lease failed");
                }
            }
        }
    }
}

/// Serves the store on `listener` until `shutdown`, then for at most two more seconds
/// while open streams end.
pub async fn serve(
    store: EmbeddedStore,
    listener: TcpListener,
    tls: Option<tonic::transport::ServerTlsConfig>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    tokio::spawn(store.clone().expire_leases(shutdown.clone()));
    serve_also(store, listener, tls, shutdown).await
}

/// Serves `store` on one more listener (whose leases [`serve`] already expires): `moord
/// dev` serves TLS to others and plain loopback to its own components.
pub async fn serve_also(
    store: EmbeddedStore,
    listener: TcpListener,
    tls: Option<tonic::transport::ServerTlsConfig>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = builder.tls_config(tls)?;
    }
    let server = builder
        .add_service(PbKvServer::new(store.clone()))
        .add_service(PbWatchServer::new(store.clone()))
        .add_service(PbLeaseServer::new(store.clone()))
        .add_service(PbMaintenanceServer::new(store))
        .serve_with_incoming_shutdown(
            // Without TCP_NODELAY, Nagle's algorithm and delayed ACKs hold small
            // responses (a watch event, a txn answer) for ~40 ms.
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            shutdown.clone().cancelled_owned(),
        );
    tokio::pin!(server);
    tokio::select! {
        r = &mut server => r?,
        _ = async {
            shutdown.cancelled().await;
            tokio::time::sleep(Duration::from_secs(2)).await;
        } => {}
    }
    Ok(())
}

#[tonic::async_trait]
impl PbKvService for EmbeddedStore {
    async fn range(
        &self,
        req: Request<PbRangeRequest>,
    ) -> Result<Response<PbRangeResponse>, Status> {
        let req = req.into_inner();
        let m = self.lock();
        let (kvs, count, more) = m.range(&req)?;
        Ok(Response::new(PbRangeResponse {
            header: self.header(m.revision),
            kvs,
            more,
            count,
        }))
    }

    type RangeStreamStream = BoxStream<PbRangeStreamResponse>;

    async fn range_stream(
        &self,
        _req: Request<PbRangeRequest>,
    ) -> Result<Response<Self::RangeStreamStream>, Status> {
        Err(Status::unimplemented(
            "moor-store: RangeStream is not served",
        ))
    }

    async fn put(&self, req: Request<PbPutRequest>) -> Result<Response<PbPutResponse>, Status> {
        let req = req.into_inner();
        check_size(req.encoded_len())?;
        let want_prev = req.prev_kv;
        let ((_, prev), rev) = self.write(move |m| m.put_request(&req)).await?;
        Ok(Response::new(PbPutResponse {
            header: self.header(rev),
            prev_kv: if want_prev { prev } else { None },
        }))
    }

    async fn delete_range(
        &self,
        req: Request<PbDeleteRequest>,
    ) -> Result<Response<PbDeleteResponse>, Status> {
        let req = req.into_inner();
        let want_prev = req.prev_kv;
        let ((_, gone), rev) = self.write(move |m| m.delete_request(&req)).await?;
        Ok(Response::new(PbDeleteResponse {
            header: self.header(rev),
            deleted: gone.len() as i64,
            prev_kvs: if want_prev { gone } else { Vec::new() },
        }))
    }

    async fn txn(&self, req: Request<PbTxnRequest>) -> Result<Response<PbTxnResponse>, Status> {
        let req = req.into_inner();
        check_size(req.encoded_len())?;
        let ((_, succeeded, responses), rev) = self.write(move |m| m.txn_request(&req)).await?;
        Ok(Response::new(PbTxnResponse {
            header: self.header(rev),
            succeeded,
            responses: responses
                .into_iter()
                .map(|r| PbResponseOp { response: Some(r) })
                .collect(),
        }))
    }

    async fn compact(
        &self,
        req: Request<PbCompactionRequest>,
    ) -> Result<Response<PbCompactionResponse>, Status> {
        let revision = req.into_inner().revision;
        let (_, rev) = self.write(move |m| m.compact(revision)).await?;
        Ok(Response::new(PbCompactionResponse {
            header: self.header(rev),
        }))
    }
}

#[tonic::async_trait]
impl PbLeaseService for EmbeddedStore {
    async fn lease_grant(
        &self,
        req: Request<PbLeaseGrantRequest>,
    ) -> Result<Response<PbLeaseGrantResponse>, Status> {
        let req = req.into_inner();
        let ((id, ttl), rev) = self.write(move |m| m.grant(req.id, req.ttl)).await?;
        Ok(Response::new(PbLeaseGrantResponse {
            header: self.header(rev),
            id,
            ttl,
            error: String::new(),
        }))
    }

    async fn lease_revoke(
        &self,
        req: Request<PbLeaseRevokeRequest>,
    ) -> Result<Response<PbLeaseRevokeResponse>, Status> {
        let id = req.into_inner().id;
        let (_, rev) = self.write(move |m| m.revoke(id)).await?;
        Ok(Response::new(PbLeaseRevokeResponse {
            header: self.header(rev),
        }))
    }

    type LeaseKeepAliveStream = BoxStream<PbLeaseKeepAliveResponse>;

    async fn lease_keep_alive(
        &self,
        req: Request<Streaming<PbLeaseKeepAliveRequest>>,
    ) -> Result<Response<Self::LeaseKeepAliveStream>, Status> {
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(16);
        let store = self.clone();
        tokio::spawn(async move {
            while let Ok(Some(req)) = inbound.message().await {
                let (ttl, rev) = {
                    let mut m = store.lock();
                    (m.keep_alive(req.id), m.revision)
                };
                let resp = PbLeaseKeepAliveResponse {
                    header: store.header(rev),
                    id: req.id,
                    ttl,
                };
                if tx.send(Ok(resp)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn lease_time_to_live(
        &self,
        req: Request<PbLeaseTimeToLiveRequest>,
    ) -> Result<Response<PbLeaseTimeToLiveResponse>, Status> {
        let req = req.into_inner();
        let m = self.lock();
        let resp = match m.leases.get(&req.id) {
            Some(l) => PbLeaseTimeToLiveResponse {
                header: self.header(m.revision),
                id: req.id,
                ttl: l
                    .deadline
                    .saturating_duration_since(Instant::now())
                    .as_secs() as i64,
                granted_ttl: l.ttl,
                keys: if req.keys {
                    l.keys.iter().cloned().collect()
                } else {
                    Vec::new()
                },
            },
            None => PbLeaseTimeToLiveResponse {
                header: self.header(m.revision),
                id: req.id,
                ttl: -1,
                granted_ttl: 0,
                keys: Vec::new(),
            },
        };
        Ok(Response::new(resp))
    }

    async fn lease_leases(
        &self,
        _req: Request<PbLeaseLeasesRequest>,
    ) -> Result<Response<PbLeaseLeasesResponse>, Status> {
        let m = self.lock();
        let mut ids: Vec<i64> = m.leases.keys().copied().collect();
        ids.sort_unstable();
        Ok(Response::new(PbLeaseLeasesResponse {
            header: self.header(m.revision),
            leases: ids.into_iter().map(|id| PbLeaseStatus { id }).collect(),
        }))
    }
}

fn unimplemented<T>(what: &str) -> Result<T, Status> {
    Err(Status::unimplemented(format!(
        "moor-store: {what} is not served by the embedded store"
    )))
}

#[tonic::async_trait]
impl PbMaintenanceService for EmbeddedStore {
    async fn alarm(
        &self,
        _r: Request<PbAlarmRequest>,
    ) -> Result<Response<PbAlarmResponse>, Status> {
        let rev = self.lock().revision;
        Ok(Response::new(PbAlarmResponse {
            header: self.header(rev),
            alarms: Vec::new(),
        }))
    }

    async fn status(
        &self,
        _r: Request<PbStatusRequest>,
    ) -> Result<Response<PbStatusResponse>, Status> {
        let m = self.lock();
        Ok(Response::new(PbStatusResponse {
            header: self.header(m.revision),
            // The etcd API level served, not a build of etcd.
            version: "3.5.0".into(),
            db_size: m.db_size(),
            leader: MEMBER_ID,
            raft_index: m.revision as u64,
            raft_term: 1,
            raft_applied_index: m.revision as u64,
            ..Default::default()
        }))
    }

    async fn defragment(
        &self,
        _r: Request<PbDefragmentRequest>,
    ) -> Result<Response<PbDefragmentResponse>, Status> {
        unimplemented("Defragment")
    }

    async fn hash(&self, _r: Request<PbHashRequest>) -> Result<Response<PbHashResponse>, Status> {
        unimplemented("Hash")
    }

    async fn hash_kv(
        &self,
        _r: Request<PbHashKvRequest>,
    ) -> Result<Response<PbHashKvResponse>, Status> {
        unimplemented("HashKV")
    }

    type SnapshotStream = BoxStream<PbSnapshotResponse>;

    async fn snapshot(
        &self,
        _r: Request<PbSnapshotRequest>,
    ) -> Result<Response<Self::SnapshotStream>, Status> {
        unimplemented("Snapshot")
    }

    async fn move_leader(
        &self,
        _r: Request<PbMoveLeaderRequest>,
    ) -> Result<Response<PbMoveLeaderResponse>, Status> {
        unimplemented("MoveLeader")
    }

    async fn downgrade(
        &self,
        _r: Request<PbDowngradeRequest>,
    ) -> Result<Response<PbDowngradeResponse>, Status> {
        unimplemented("Downgrade")
    }
}

/// etcd's default `--max-request-bytes`: a write request larger than this is refused.
pub const MAX_REQUEST_BYTES: usize = 1536 * 1024;

/// Refuses a write request over [`MAX_REQUEST_BYTES`], as etcd does (code and message).
fn check_size(bytes: usize) -> Result<(), Status> {
    if bytes > MAX_REQUEST_BYTES {
        return Err(Status::invalid_argument("etcdserver: request is too large"));
    }
    Ok(())
}
