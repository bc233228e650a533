//! CSI v1: the generated protocol types and services.

/// Code generated from `proto/csi.proto` (package `csi.v1`): messages, clients, servers.
#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("csi.v1");
}
