//! A workload's life on its node, as every front door shares it.
//!
//! - [`cgroup`]: the workload's own cgroup (v2): `moorctl alloc run` makes it and runs
//!   the workload in it, records it on the allocation (`spec.workload_cgroup`), and the
//!   node's agent ends what is left in it before it unpublishes the allocation's
//!   volumes, also when both moorctl processes were killed.

pub mod cgroup;
