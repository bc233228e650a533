//! What any CSI process of moor's needs, and nothing of etcd: the CSI v1 protocol
//! compiled from `proto/csi.proto`, a channel to a plugin's unix socket, the
//! [`journal`] in which a node agent or a plugin keeps what it did, and [`process`]
//! basics (logging, signals, error chains). moor-hostpath depends on this crate alone.
//!
//! # Layout
//! - [`v1`]: the CSI v1 protocol, generated, and `channel` to a plugin's unix socket.
//! - [`journal`]: a durable state of keyed tables, kept as a journal of changes.
//! - [`process`]: log setup, graceful shutdown, error chains.
//! - [`version`]: this build's version as printed and recorded (`0.3.0~dev`).

pub mod journal;
pub mod process;
pub mod version;

use std::path::PathBuf;
use std::time::Duration;

/// Code generated from `proto/csi.proto` (package `csi.v1`): messages, clients, servers.
#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("csi.v1");
}

/// Why a plugin endpoint could not be used.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    /// Only `unix://` endpoints are supported.
    #[error("endpoint {0:?} is not unix:///path")]
    NotUnix(String),
    /// The channel could not be built.
    #[error("cannot connect to {0}")]
    Connect(String, #[source] tonic::transport::Error),
}

/// A gRPC channel to a plugin at `unix:///path`. It connects lazily and reconnects after
/// the plugin restarts, so a supervisor can keep one per plugin.
pub fn channel(endpoint: &str) -> Result<tonic::transport::Channel, EndpointError> {
    let path = PathBuf::from(
        endpoint
            .strip_prefix("unix://")
            .ok_or_else(|| EndpointError::NotUnix(endpoint.to_string()))?,
    );
    // The URI is required by tonic but unused: the connector dials the socket.
    let ep = tonic::transport::Endpoint::from_static("http://csi.plugin")
        .connect_timeout(Duration::from_secs(5));
    Ok(
        ep.connect_with_connector_lazy(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        })),
    )
}
