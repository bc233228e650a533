//! The embedded store: a server for the part of the etcd v3 gRPC API that moor (and
//! `etcdctl get/put/del/watch/lease`) uses, on one machine, durable in a redb file.
//!
//! KV (Range, Put, DeleteRange, Txn, Compact), Watch (start revision, ranges, prev_kv,
//! filters, cancel, compaction, progress), Lease (grant, revoke, keep-alive, time-to-live,
//! leases; an expired lease deletes its keys) and Maintenance Status. Everything else
//! answers Unimplemented. There is no auth. It listens on loopback for `moord dev` and
//! tests; a non-loopback address needs TLS (`--cert`/`--key`, and `--client-ca` to
//! require client certificates) or an explicit `--insecure-listen`. A real deployment
//! uses etcd.
//!
//! # Layout
//! - `mvcc`: the data: current values, the history since the compaction, leases;
//!   durable in redb.
//! - `services`: the gRPC services (KV, Watch, Lease, Maintenance) over it.

mod mvcc;
mod services;

pub use mvcc::{Commit, Mvcc, MIN_LEASE_TTL};
pub use services::{serve, serve_also, EmbeddedStore};

/// Why the store would not listen.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    /// The address could not be bound.
    #[error("listening on {0}")]
    Bind(String, #[source] std::io::Error),
    /// A non-loopback address without TLS or `--insecure-listen`.
    #[error(
        "refusing to serve the embedded store on {0} without TLS: anyone who reaches it \
         would read and write every object; listen on a loopback address (127.0.0.1:2379), \
         serve TLS with --cert and --key (and --client-ca to require client certificates), \
         or pass --insecure-listen if you mean it"
    )]
    NotLoopback(std::net::SocketAddr),
}

/// TLS for the embedded store's clients.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TlsArgs {
    /// Serve TLS with this certificate (PEM; needs --key); a non-loopback --listen is
    /// then allowed.
    #[arg(long, requires = "key")]
    pub cert: Option<std::path::PathBuf>,
    /// The private key (PEM) of --cert.
    #[arg(long, requires = "cert")]
    pub key: Option<std::path::PathBuf>,
    /// Require client certificates signed by this CA (PEM).
    #[arg(long, requires = "cert")]
    pub client_ca: Option<std::path::PathBuf>,
}

impl TlsArgs {
    /// The server's TLS configuration, `None` without --cert.
    pub fn config(&self) -> anyhow::Result<Option<tonic::transport::ServerTlsConfig>> {
        use anyhow::Context;
        let (Some(cert), Some(key)) = (&self.cert, &self.key) else {
            return Ok(None);
        };
        let read = |p: &std::path::Path| {
            std::fs::read(p).with_context(|| format!("reading {}", p.display()))
        };
        let mut tls = tonic::transport::ServerTlsConfig::new().identity(
            tonic::transport::Identity::from_pem(read(cert)?, read(key)?),
        );
        if let Some(ca) = &self.client_ca {
            tls = tls.client_ca_root(tonic::transport::Certificate::from_pem(read(ca)?));
        }
        Ok(Some(tls))
    }
}

/// Binds `listen` for the store: loopback only, unless it serves TLS (`tls`) or
/// `insecure` says the operator means to expose a store without TLS.
pub async fn bind(
    listen: &str,
    insecure: bool,
    tls: bool,
) -> Result<tokio::net::TcpListener, ListenError> {
    // Every address `listen` names is checked before any is bound: a refused address
    // never holds a socket, even for a moment.
    let addrs: Vec<std::net::SocketAddr> = tokio::net::lookup_host(listen)
        .await
        .map_err(|e| ListenError::Bind(listen.to_string(), e))?
        .collect();
    if !insecure && !tls {
        if let Some(a) = addrs.iter().find(|a| !a.ip().is_loopback()) {
            return Err(ListenError::NotLoopback(*a));
        }
    }
    let listener = tokio::net::TcpListener::bind(&addrs[..])
        .await
        .map_err(|e| ListenError::Bind(listen.to_string(), e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| ListenError::Bind(listen.to_string(), e))?;
    if !addr.ip().is_loopback() && !insecure && !tls {
        return Err(ListenError::NotLoopback(addr));
    }
    if !addr.ip().is_loopback() && !tls {
        tracing::warn!(%addr, "serving the embedded store beyond loopback without TLS or auth (--insecure-listen)");
    }
    Ok(listener)
}

#[cfg(test)]
mod tests {
    #[tokio::test]
    async fn only_loopback_unless_insecure_listen() {
        assert!(super::bind("127.0.0.1:0", false, false).await.is_ok());
        let e = super::bind("0.0.0.0:0", false, false).await.unwrap_err();
        assert!(e.to_string().contains("--insecure-listen"), "{e}");
        assert!(super::bind("0.0.0.0:0", true, false).await.is_ok());
        assert!(super::bind("0.0.0.0:0", false, true).await.is_ok());
    }

    /// Issue 37, item 8: a refused address is refused before it is bound, also when it
    /// is in use (the error then is the refusal, not "address in use").
    #[tokio::test]
    async fn a_refused_address_is_never_bound() {
        let taken = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let e = super::bind(&format!("0.0.0.0:{port}"), false, false)
            .await
            .unwrap_err();
        assert!(matches!(e, super::ListenError::NotLoopback(_)), "{e}");
        drop(taken);
        // Free again, and refused again: nothing of ours holds it afterwards.
        let e = super::bind(&format!("0.0.0.0:{port}"), false, false)
            .await
            .unwrap_err();
        assert!(matches!(e, super::ListenError::NotLoopback(_)), "{e}");
        std::net::TcpListener::bind(format!("0.0.0.0:{port}")).expect("the port is free");
    }
}
