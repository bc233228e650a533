//! moor: a control plane for CSI volumes.
//!
//! Desired state (volumes, allocations, claims) lives in etcd; independent reconcilers
//! watch it and converge by calling CSI plugins over gRPC. This crate is the API every
//! moor process shares.
//!
//! # Layout
//! - [`admission`]: the pure admission rules (may a claim use its volume on its node);
//!   the controller admits with them, `moorctl alloc plan` places with them.
//! - [`api`]: the resource types, one file per kind, with their validation, id newtypes,
//!   access-mode claim rules and redacting wrappers for secrets and mount flags.
//! - [`store`]: the typed store over the etcd v3 API: get, paginated list, guarded
//!   writes, watch, leases; every value read is validated and a bad one is an error.
//! - [`runtime`]: our kube-runtime: watcher, informer, reflector, controller (keyed
//!   queue, backoff, resync), leader election, metrics, events, the step runner and
//!   its retry gates, the writer handle reconcilers write through.
//! - [`backoff`]: exponential backoff with jitter, shared by the store, the runtime and
//!   the CSI client.
//! - [`telemetry`]: logs and traces of a daemon (one trace per claim, OTLP export).
//! - [`workload`]: a workload's life on its node shared by the front doors (its
//!   cgroup, which the runner records and the agent ends before an unpublish).
//! - [`csi`]: moor's side of CSI: the typed client, the call policy (retries, deadlines,
//!   what an answer means), conversions from moor's types, the requests built without
//!   I/O (`csi::requests`) and the live contract monitor's rules (`csi::contract`). The protocol itself, the
//!   journal and the process basics are the `moor-csi` crate, re-exported as
//!   [`csi::v1`], [`journal`] and [`process`].
//!
//! The other crates: `moorctl` (the CLI), `moor-embedded` (the embedded etcd-API store
//! and `moor-store`), `moor-controllers` (`moord`: reconcilers and node agent),
//! `moor-hostpath` (the reference plugin, on `moor-csi` alone) and `moor-bench`.

pub mod admission;
pub mod api;
pub mod backoff;
pub mod csi;
pub mod runtime;
pub mod store;
pub mod telemetry;
pub mod workload;

pub use moor_csi::{journal, process};
