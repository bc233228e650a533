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
