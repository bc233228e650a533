//! Quota: how much of a namespace's storage its people may ask for: counts of
//! volumes, allocations and snapshots, and capacity (in all, and per class).
//!
//! Writers: operators own `spec` (a namespace's roles neither write nor forge it: its
//! key is outside theirs); the controller's leader (`controller/quotas.rs`) alone
//! writes `status`: the usage it charged, object by object, with compare-and-swap. A
//! charge is the fact every gate reads: the provisioner calls CreateVolume (or expands)
//! and the snapshotter CreateSnapshot only for what every quota of the namespace
//! charged, and the controller admits claims only of charged volumes by charged
//! allocations. What a namespace's own objects say of themselves is never counted as
//! usage: their specs are read, their statuses are not.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use super::*;

/// The most objects one quota charges (its status stays one etcd value).
pub const MAX_CHARGES: usize = 20_000;
/// The most objects whose wait a quota's status lists.
pub const MAX_WAITING_SHOWN: usize = 20;

/// Desired state of a quota: each limit, absent when not limited.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct QuotaSpec {
    /// Volumes (created or registered) in the namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volumes: Option<u64>,
    /// Capacity the namespace's volumes ask (`capacity_min`) in all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<Size>,
    /// Capacity asked by the volumes of each class.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub classes: BTreeMap<Name, Size>,
    /// Allocations in the namespace (ended ones are not counted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocations: Option<u64>,
    /// Snapshots in the namespace (a group snapshot's members are counted each).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshots: Option<u64>,
}

/// What a quota charges: the kinds it counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Charged {
    /// A Volume: one, and its capacity.
    Volume,
    /// An Allocation: one.
    Allocation,
    /// A Snapshot: one.
    Snapshot,
}

impl Charged {
    /// As the charge keys and messages spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Charged::Volume => "volume",
            Charged::Allocation => "allocation",
            Charged::Snapshot => "snapshot",
        }
    }
}

/// One object a quota charged.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Charge {
    /// The object's uid when charged: an object made again under the name is another.
    pub uid: Uid,
    /// The capacity charged (a volume's `capacity_min`; 0 for other kinds).
    #[serde(default, skip_serializing_if = "size_is_zero")]
    pub bytes: Size,
    /// The volume's class, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<Name>,
}

/// What is charged against each limit.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Volumes charged.
    #[serde(default)]
    pub volumes: u64,
    /// Their capacity.
    #[serde(default)]
    pub capacity: Size,
    /// Their capacity by class.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub classes: BTreeMap<Name, Size>,
    /// Allocations charged.
    #[serde(default)]
    pub allocations: u64,
    /// Snapshots charged.
    #[serde(default)]
    pub snapshots: u64,
}

/// Observed state of a quota: written by the controller alone.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct QuotaStatus {
    /// The sum of the charges.
    #[serde(default)]
    pub used: Usage,
    /// The charges, by `KIND/NAME` (`volume/db`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub charged: BTreeMap<String, Charge>,
    /// Objects the quota does not let in yet, by `KIND/NAME`, with why (the first
    /// [`MAX_WAITING_SHOWN`]); `waiting_count` counts them all.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub waiting: BTreeMap<String, String>,
    /// How many objects wait.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub waiting_count: u64,
    /// Generation, conditions, last error.
    #[serde(flatten)]
    pub meta: StatusMeta,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn size_is_zero(n: &Size) -> bool {
    n.0 == 0
}

impl Spec for QuotaSpec {
    const KIND: &'static str = "Quota";
    const DIR: &'static str = "quotas";
    const NAMESPACED: bool = true;
    const ALIASES: &'static [&'static str] = &["quota", "resourcequota"];
    const PHASE: Option<&'static str> = None;
    const CHECKED: bool = true;
    const AGENT: AgentAccess = AgentAccess::ControllerPluginRead;
    const MAX_NAME: usize = 63;
    type Status = QuotaStatus;

    fn validate(&self, errors: &mut ValidationErrors) {
        if self.volumes.is_none()
            && self.capacity.is_none()
            && self.classes.is_empty()
            && self.allocations.is_none()
            && self.snapshots.is_none()
        {
            errors.push(
                "spec",
                "no limit: set volumes, capacity, classes, allocations or snapshots",
            );
        }
        for (field, n) in [
            ("volumes", self.volumes),
            ("allocations", self.allocations),
            ("snapshots", self.snapshots),
        ] {
            if n.is_some_and(|n| n > MAX_CHARGES as u64) {
                errors.push(
                    field,
                    format!("at most {MAX_CHARGES} (one quota's charges)"),
                );
            }
        }
    }
}

/// A quota object.
pub type Quota = Object<QuotaSpec>;

impl Quota {
    /// The key of quota `name` in `ns`.
    pub fn key_for(ns: &Namespace, name: impl std::fmt::Display) -> ObjectKey<QuotaSpec> {
        ObjectKey::from_parts(&[ns, &name])
    }

    /// The key of `kind`'s object `name` in [`QuotaStatus::charged`].
    pub fn charge_key(kind: Charged, name: &str) -> String {
        format!("{}/{name}", kind.as_str())
    }

    /// Whether the quota charged `kind`'s object `name` of uid `uid` for at least
    /// `bytes`.
    pub fn admits(&self, kind: Charged, name: &str, uid: &Uid, bytes: u64) -> bool {
        self.status
            .charged
            .get(&Quota::charge_key(kind, name))
            .is_some_and(|c| &c.uid == uid && c.bytes.0 >= bytes)
    }

    /// Why `kind`'s object `name` is not let in: the wait the controller recorded, or
    /// that it has not been charged yet.
    pub fn why_waiting(&self, kind: Charged, name: &str) -> String {
        let key = Quota::charge_key(kind, name);
        match self.status.waiting.get(&key) {
            Some(why) => format!("quota {}: {why}", self.metadata.name),
            None => format!(
                "quota {}: not charged yet (the controller charges it)",
                self.metadata.name
            ),
        }
    }
}

/// Why, under `quotas` (a namespace's), `kind`'s object `name` of uid `uid` asking
/// `bytes` may not be acted on yet; `None` when every quota charged it.
pub fn quota_wait<'a>(
    quotas: impl IntoIterator<Item = &'a Quota>,
    kind: Charged,
    name: &str,
    uid: &Uid,
    bytes: u64,
) -> Option<String> {
    quotas
        .into_iter()
        .find(|q| !q.is_deleting() && !q.admits(kind, name, uid, bytes))
        .map(|q| q.why_waiting(kind, name))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quota(spec: QuotaSpec) -> Quota {
        Quota::new(&Namespace::new("a").unwrap(), Name::new("q").unwrap(), spec)
    }

    #[test]
    fn a_quota_without_a_limit_is_refused() {
        let mut errors = ValidationErrors::default();
        QuotaSpec::default().validate(&mut errors);
        assert!(errors.to_string().contains("no limit"), "{errors}");
        let mut errors = ValidationErrors::default();
        QuotaSpec {
            volumes: Some(3),
            ..Default::default()
        }
        .validate(&mut errors);
        assert!(errors.is_empty(), "{errors}");
    }

    #[test]
    fn only_the_charged_uid_with_enough_bytes_is_admitted() {
        let mut q = quota(QuotaSpec {
            volumes: Some(1),
            ..Default::default()
        });
        let uid = Uid::random();
        q.status.charged.insert(
            Quota::charge_key(Charged::Volume, "v"),
            Charge {
                uid: uid.clone(),
                bytes: Size(10),
                class: None,
            },
        );
        assert!(q.admits(Charged::Volume, "v", &uid, 10));
        assert!(
            !q.admits(Charged::Volume, "v", &uid, 11),
            "an expansion past the charge"
        );
        assert!(
            !q.admits(Charged::Volume, "v", &Uid::random(), 10),
            "made again"
        );
        assert!(!q.admits(Charged::Snapshot, "v", &uid, 0), "another kind");
        assert_eq!(quota_wait([&q], Charged::Volume, "v", &uid, 5), None);
        q.status.waiting.insert(
            Quota::charge_key(Charged::Volume, "w"),
            "volumes 1 of 1 used".into(),
        );
        assert_eq!(
            quota_wait([&q], Charged::Volume, "w", &Uid::random(), 0).as_deref(),
            Some("quota q: volumes 1 of 1 used")
        );
    }
}
