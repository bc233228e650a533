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
//! - [`activation`]: the sockets systemd passes a socket-activated daemon (the agent's
//!   volume-plugin sockets), taken once by descriptor number.
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

pub mod activation;
pub mod admission;
pub mod api;
pub mod backoff;
pub mod csi;
pub mod runtime;
pub mod store;
pub mod telemetry;
pub mod workload;

pub use moor_csi::{journal, process};

/// `--version` of a moor binary: its version, commit and whether the tree was clean,
/// from the calling crate's build script (build/version.rs: MOOR_COMMIT, MOOR_TREE).
#[macro_export]
macro_rules! long_version {
    () => {
        concat!(
            env!("MOOR_VERSION"),
            " (commit ",
            env!("MOOR_COMMIT"),
            ", ",
            env!("MOOR_TREE"),
            " tree)"
        )
    };
}

/// This build's version (the workspace's: every moor crate has the same), as printed
/// and recorded: `0.3.0~dev` for a development build (`moor_csi::version`).
pub use moor_csi::version::VERSION;

/// What this build's controller knows that an older one of the same version number
/// may not, written in its election record (`LeaderRecord::features`): a client
/// writes a field an older controller would refuse only where the leader lists it.
pub const FEATURES: &[&str] = &[FEATURE_TEMPLATE_CLASS];

/// A template may name a VolumeClass, or leave the plugin to the default class (an
/// older controller refuses the field, so the allocation would never start).
pub const FEATURE_TEMPLATE_CLASS: &str = "template-class";

pub use moor_csi::version::minor_of;

/// What a client of version `ours` says about a controller of version `theirs` (empty:
/// a controller older than versions in the election record): `None` when they are
/// the same minor version.
pub fn version_skew(ours: &str, theirs: &str) -> Option<String> {
    if theirs.is_empty() {
        return Some(format!(
            "the leading controller runs a version older than 0.2 (it does not say which); this is {ours}"
        ));
    }
    if minor_of(ours).is_some() && minor_of(ours) == minor_of(theirs) {
        return None;
    }
    Some(format!(
        "the leading controller runs {theirs}, this is {ours}: see UPGRADING.md for which mixes work"
    ))
}

#[cfg(test)]
mod version_tests {
    use super::*;

    #[test]
    fn only_another_minor_version_is_a_skew() {
        assert_eq!(minor_of("0.2.0"), Some((0, 2)));
        assert_eq!(minor_of("1.12.3-rc.1"), Some((1, 12)));
        assert_eq!(minor_of("x"), None);
        assert_eq!(version_skew("0.2.0", "0.2.7"), None);
        assert!(version_skew("0.2.0", "0.3.0").is_some());
        assert!(version_skew("0.2.0", "1.2.0").is_some());
        assert!(version_skew("0.2.0", "").is_some_and(|w| w.contains("older")));
        assert!(version_skew("0.2.0", "garbage").is_some());
    }
}
