//! moor: a control plane for CSI volumes.
//!
//! Desired state (volumes, allocations, claims) lives in etcd; independent reconcilers
//! watch it and converge by calling CSI plugins over gRPC. This crate is the API every
//! moor process shares.
//!
//! # Layout
//! - [`api`]: the resource types, one file per kind, with their validation, id newtypes,
//!   access-mode claim rules and redacting wrappers for secrets and mount flags.
//! - [`store`]: the typed store over the etcd v3 API: get, paginated list, guarded
//!   writes, watch, leases; every value read is validated and a bad one is an error.
//! - [`runtime`]: our kube-runtime: watcher, informer, reflector, controller (keyed
//!   queue, backoff, resync), leader election, metrics, events, shutdown.
//! - [`csi`]: the CSI v1 protocol compiled from `proto/csi.proto`, conversions from
//!   moor's types, and the call policy (retries, deadlines, what an error means).
//! - [`cli`]: moorctl, one file per verb.
//! - [`journal`]: a local state of keyed tables kept as an append-only journal (the
//!   agent's and moor-hostpath's records of what they did).

pub mod api;
pub mod cli;
pub mod csi;
pub mod embedded;
pub mod journal;
pub mod runtime;
pub mod store;
