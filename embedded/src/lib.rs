//! The embedded store: a server for the part of the etcd v3 gRPC API that moor (and
//! `etcdctl get/put/del/watch/lease`) uses, on one machine, durable in a redb file.
//!
//! KV (Range, Put, DeleteRange, Txn, Compact), Watch (start revision, ranges, prev_kv,
//! filters, cancel, compaction, progress), Lease (grant, revoke, keep-alive, time-to-live,
//! leases; an expired lease deletes its keys) and Maintenance Status. Everything else
//! answers Unimplemented. There is no auth and no TLS: it listens on loopback for
//! `moord dev` and tests; a real deployment uses etcd.

mod mvcc;
mod services;

pub use mvcc::{Commit, Mvcc, MIN_LEASE_TTL};
pub use services::{serve, EmbeddedStore};

/// Why the store would not listen.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    /// The address could not be bound.
    #[error("listening on {0}")]
    Bind(String, #[source] std::io::Error),
    /// A non-loopback address without `--insecure-listen`.
    #[error(
        "refusing to serve the embedded store on {0}: it has no TLS and no auth, so anyone \
         who reaches it reads and writes every object, secrets included; listen on a \
         loopback address (127.0.0.1:2379), or pass --insecure-listen if you mean it"
    )]
    NotLoopback(std::net::SocketAddr),
}

/// Binds `listen` for the store: loopback only, unless `insecure` says the operator
/// means to expose a store that has no TLS and no auth.
pub async fn bind(listen: &str, insecure: bool) -> Result<tokio::net::TcpListener, ListenError> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| ListenError::Bind(listen.to_string(), e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| ListenError::Bind(listen.to_string(), e))?;
    if !addr.ip().is_loopback() && !insecure {
        return Err(ListenError::NotLoopback(addr));
    }
    if !addr.ip().is_loopback() {
        tracing::warn!(%addr, "serving the embedded store beyond loopback without TLS or auth (--insecure-listen)");
    }
    Ok(listener)
}

#[cfg(test)]
mod tests {
    #[tokio::test]
    async fn only_loopback_unless_insecure_listen() {
        assert!(super::bind("127.0.0.1:0", false).await.is_ok());
        let e = super::bind("0.0.0.0:0", false).await.unwrap_err();
        assert!(e.to_string().contains("--insecure-listen"), "{e}");
        assert!(super::bind("0.0.0.0:0", true).await.is_ok());
    }
}
