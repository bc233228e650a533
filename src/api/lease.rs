//! Lease: a liveness record renewed by its holder, as Kubernetes' Lease objects are.
//!
//! Writer: the holder only (an allocation's runner, `moorctl alloc run`). The holder
//! rewrites the record every `duration_seconds / 3`; a reader judges it by when it last
//! *saw* the record change, on its own clock, never by the holder's `renew_time` (the
//! clocks may differ) nor by an etcd lease (etcd 3.4 lets any authenticated user keep
//! any lease alive). A record unchanged for `duration_seconds` is expired.
//!
//! An allocation's Lease has the allocation's namespace and name: while it is renewed
//! the workload runs; when it expires the controller marks the allocation lost and
//! releases its claims.

use serde::{Deserialize, Serialize};

use super::*;

/// The longest a lease may last without renewal: a day.
pub const MAX_LEASE_SECONDS: u64 = 86_400;

/// Desired state of a lease: the holder's last renewal.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LeaseSpec {
    /// Who renews it (e.g. `moorctl@HOST/PID`).
    #[serde(default)]
    pub holder: String,
    /// How long the lease lasts without a renewal.
    #[serde(default)]
    pub duration_seconds: u64,
    /// When the holder last renewed it, by the holder's clock (informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renew_time: Option<Timestamp>,
    /// Renewals so far: every renewal changes the record, even within one millisecond.
    #[serde(default)]
    pub renewals: u64,
}

impl Spec for LeaseSpec {
    const KIND: &'static str = "Lease";
    const DIR: &'static str = "leases";
    const NAMESPACED: bool = true;
    const ALIASES: &'static [&'static str] = &[];
    const PHASE: Option<&'static str> = None;
    const CHECKED: bool = true;
    const AGENT: AgentAccess = AgentAccess::None;
    type Status = LeaseStatus;

    fn validate(&self, errors: &mut ValidationErrors) {
        if self.holder.is_empty() || self.holder.len() > 256 {
            errors.push("spec.holder", "must be 1 to 256 bytes");
        }
        if !(1..=MAX_LEASE_SECONDS).contains(&self.duration_seconds) {
            errors.push(
                "spec.duration_seconds",
                format!("must be 1 to {MAX_LEASE_SECONDS}"),
            );
        }
    }
}

/// A lease has no status of its own.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LeaseStatus {
    /// Generation, conditions, last error.
    #[serde(flatten)]
    pub meta: StatusMeta,
}

/// A lease object.
pub type Lease = Object<LeaseSpec>;

impl Lease {
    /// The key of lease `name` in `ns`.
    pub fn key_for(ns: &Namespace, name: impl std::fmt::Display) -> ObjectKey<LeaseSpec> {
        ObjectKey::from_parts(&[ns, &name])
    }

    /// How long it lasts without a renewal.
    pub fn duration(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.spec.duration_seconds)
    }

    /// How long after its runner's death a workload takes to end, all of it: the
    /// guard's SIGTERM-to-SIGKILL window ([`workload_grace`]).
    pub fn workload_grace(&self) -> std::time::Duration {
        workload_grace(self.duration())
    }
}

/// The window a runner's guard gives what is left of a workload between SIGTERM and
/// SIGKILL once the runner is gone: a third of the lease's duration, at most 10 s.
/// The controller counts a runner lost only after the lease went unrenewed for its
/// duration and this window (`Lease::workload_grace`): the runner's last renewal is at
/// most a third of the duration before its death, so by then the guard has ended the
/// workload with two thirds of the duration to spare (not one third, as with the
/// duration alone: a guard delayed under load then outlived it).
pub fn workload_grace(duration: std::time::Duration) -> std::time::Duration {
    (duration / 3).min(std::time::Duration::from_secs(10))
}

/// When a reader last saw each lease change, by its own clock: what decides expiry.
#[derive(Debug, Default)]
pub struct LeaseObserver {
    seen: std::collections::HashMap<String, (i64, std::time::Instant)>,
}

impl LeaseObserver {
    /// Notes `lease` as read at `now`; returns how long it has gone unrenewed (zero when
    /// it changed since the last look, or is seen for the first time: a reader that
    /// starts counts a full duration before calling anything expired).
    pub fn observe(&mut self, lease: &Lease, now: std::time::Instant) -> std::time::Duration {
        self.observe_version(&lease.key(), lease.metadata.resource_version, now)
    }

    /// [`LeaseObserver::observe`] for any renewed record: the object at `key` read at
    /// version `rv`.
    pub fn observe_version(
        &mut self,
        key: &str,
        rv: i64,
        now: std::time::Instant,
    ) -> std::time::Duration {
        let e = self.seen.entry(key.to_string()).or_insert((rv, now));
        if e.0 != rv {
            *e = (rv, now);
        }
        now.saturating_duration_since(e.1)
    }

    /// Forgets a lease that is gone.
    pub fn forget(&mut self, key: &str) {
        self.seen.remove(key);
    }

    /// Keeps only the records `keep` still names.
    pub fn retain(&mut self, mut keep: impl FnMut(&str) -> bool) {
        self.seen.retain(|k, _| keep(k));
    }

    /// Forgets every observation: each record counts a full duration again from its
    /// next look (after this reader could not see the store, nobody's silence is
    /// evidence).
    pub fn reset(&mut self) {
        self.seen.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn lease(rv: i64) -> Lease {
        let mut l = Lease::new(
            &Namespace::default_ns(),
            Name::new("a1").unwrap(),
            LeaseSpec {
                holder: "moorctl@h/1".into(),
                duration_seconds: 3,
                ..Default::default()
            },
        );
        l.metadata.resource_version = rv;
        l
    }

    #[test]
    fn a_lease_ages_only_while_it_is_not_renewed() {
        let mut o = LeaseObserver::default();
        let t0 = Instant::now();
        assert_eq!(o.observe(&lease(5), t0), Duration::ZERO);
        assert_eq!(
            o.observe(&lease(5), t0 + Duration::from_secs(2)),
            Duration::from_secs(2)
        );
        // Renewed: counts from when the change was seen, whatever its own clock says.
        let t1 = t0 + Duration::from_secs(4);
        assert_eq!(o.observe(&lease(9), t1), Duration::ZERO);
        assert_eq!(
            o.observe(&lease(9), t1 + Duration::from_secs(1)),
            Duration::from_secs(1)
        );
        o.forget(&lease(9).key());
        assert_eq!(
            o.observe(&lease(9), t1 + Duration::from_secs(5)),
            Duration::ZERO
        );
    }

    #[test]
    fn a_lease_needs_a_holder_and_a_sane_duration() {
        let mut l = lease(1);
        assert!(l.validate().is_ok());
        l.spec.duration_seconds = 0;
        l.spec.holder.clear();
        let e = l.validate().unwrap_err().to_string();
        assert!(
            e.contains("spec.holder") && e.contains("spec.duration_seconds"),
            "{e}"
        );
    }
}
