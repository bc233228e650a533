//! The live contract monitor's rules: what the CSI spec says a plugin MUST answer,
//! checked on each answer as it arrives. Pure functions over a request and its answer
//! (or what moor knows beside them), each returning the breaches found; a checked
//! typed client runs those of its answers ([`Monitor`]) and the agents report them (a Warning on the object, once per plugin, rule and object, and
//! `moor_plugin_contract_violations_total{plugin,rule}`) and act exactly as they would
//! without the check: a breach is named, never worked around here.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use super::v1;
use crate::api::ObjectRef;

/// Where a checked client ([`super::client::Csi::checked`]) reports what these rules
/// find in its plugin's answers: an agent's monitor, bound to the plugin. The client
/// runs the rules of each call it makes on the request it built and the answer, so no
/// caller checks (or copies a request without its secrets to check) by hand.
pub trait Monitor: Send + Sync {
    /// Reports `breaches` found in an answer to a call about `object` (`None`: about
    /// the plugin itself).
    fn report<'a>(
        &'a self,
        object: Option<&'a ObjectRef>,
        breaches: Vec<Breach>,
    ) -> futures::future::BoxFuture<'a, ()>;

    /// The volume id CreateVolume answered before for `name`, when `id` differs from
    /// it; remembers `id` for the name otherwise.
    fn earlier_id(&self, name: &str, id: &str) -> Option<String>;
}

/// A rule of the spec a plugin's answer can break.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Rule {
    /// CreateVolume (or an expansion) answered a capacity outside the range asked: the
    /// spec's CapacityRange says the volume MUST be at least `required_bytes` and MUST
    /// NOT exceed `limit_bytes`.
    CapacityOutOfRange,
    /// CreateVolume answered another volume id for a name it already answered: the
    /// call is idempotent by name.
    VolumeIdChanged,
    /// CreateVolume answered an accessible topology outside the requisite topologies
    /// asked for: the volume MUST be accessible from at least one requisite segment.
    TopologyOutsideRequisite,
    /// NodeGetInfo answered another node id while volumes are published on the node:
    /// the id names the node to ControllerPublish, and those publishes are to the old.
    NodeIdChanged,
    /// NodeGetInfo's max_volumes_per_node fell below the volumes published there.
    MaxVolumesBelowPublished,
    /// A plugin did not list (ListVolumes) or find (ControllerGetVolume, without
    /// LIST_VOLUMES), in two surveys in a row, a volume it created for moor and was
    /// never asked to delete.
    VolumeNotListed,
    /// CreateSnapshot answered a snapshot of another volume than the one asked.
    SnapshotOfOtherVolume,
    /// ValidateVolumeCapabilities confirmed capabilities other than those asked (the
    /// spec: confirmed is set only when every one asked is supported, and echoes them).
    ConfirmedOtherCapabilities,
    /// GetCapacity answered a negative available capacity.
    NegativeCapacity,
    /// CreateVolumeGroupSnapshot or GetVolumeGroupSnapshot answered a group whose
    /// members are not one snapshot of each volume asked (a volume missing, one
    /// another, one twice, a member without an id or of another group).
    GroupMembersMismatch,
}

impl Rule {
    /// Every rule, in the order the documentation lists them.
    pub const ALL: [Rule; 10] = [
        Rule::CapacityOutOfRange,
        Rule::VolumeIdChanged,
        Rule::TopologyOutsideRequisite,
        Rule::NodeIdChanged,
        Rule::MaxVolumesBelowPublished,
        Rule::VolumeNotListed,
        Rule::SnapshotOfOtherVolume,
        Rule::ConfirmedOtherCapabilities,
        Rule::NegativeCapacity,
        Rule::GroupMembersMismatch,
    ];

    /// The rule's name, as the metric's `rule` label and the Warning carry it.
    pub fn as_str(self) -> &'static str {
        match self {
            Rule::CapacityOutOfRange => "capacity_out_of_range",
            Rule::VolumeIdChanged => "volume_id_changed",
            Rule::TopologyOutsideRequisite => "topology_outside_requisite",
            Rule::NodeIdChanged => "node_id_changed",
            Rule::MaxVolumesBelowPublished => "max_volumes_below_published",
            Rule::VolumeNotListed => "volume_not_listed",
            Rule::SnapshotOfOtherVolume => "snapshot_of_other_volume",
            Rule::ConfirmedOtherCapabilities => "confirmed_other_capabilities",
            Rule::NegativeCapacity => "negative_capacity",
            Rule::GroupMembersMismatch => "group_members_mismatch",
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One breach: the rule and what the plugin answered against it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Breach {
    /// The rule broken.
    pub rule: Rule,
    /// What was asked and answered (ids, sizes, topology: never secrets).
    pub detail: String,
}

impl Breach {
    fn new(rule: Rule, detail: String) -> Breach {
        Breach { rule, detail }
    }
}

/// Whether `capacity` (0: not reported) lies in `range` (0 bounds: none).
fn outside(range: Option<&v1::CapacityRange>, capacity: i64) -> Option<String> {
    let r = range?;
    if capacity == 0 {
        return None;
    }
    let below = r.required_bytes > 0 && capacity < r.required_bytes;
    let above = r.limit_bytes > 0 && capacity > r.limit_bytes;
    (below || above).then(|| {
        format!(
            "answered {capacity} bytes for required {} and limit {} bytes",
            r.required_bytes, r.limit_bytes
        )
    })
}

/// Whether segment `seg` satisfies requisite segment `req`: every key of `req` with its
/// value (a plugin may add keys of its own).
fn within(seg: &v1::Topology, req: &v1::Topology) -> bool {
    req.segments
        .iter()
        .all(|(k, v)| seg.segments.get(k) == Some(v))
}

/// CreateVolume's answer against its request: the capacity in the range asked, the
/// accessible topology within the requisite asked for, and the same id as an earlier
/// answer for the same name (`earlier_id`, when moor holds one).
pub fn create_volume(
    req: &v1::CreateVolumeRequest,
    volume: &v1::Volume,
    earlier_id: Option<&str>,
) -> Vec<Breach> {
    let mut found = Vec::new();
    if let Some(d) = outside(req.capacity_range.as_ref(), volume.capacity_bytes) {
        found.push(Breach::new(
            Rule::CapacityOutOfRange,
            format!("CreateVolume of {}: {d}", req.name),
        ));
    }
    if let Some(earlier) = earlier_id.filter(|e| *e != volume.volume_id) {
        found.push(Breach::new(
            Rule::VolumeIdChanged,
            format!(
                "CreateVolume of {} answered volume id {}, where it answered {earlier} before",
                req.name, volume.volume_id
            ),
        ));
    }
    let requisite = req
        .accessibility_requirements
        .as_ref()
        .map(|a| a.requisite.as_slice())
        .unwrap_or_default();
    if !requisite.is_empty() {
        let stray = volume
            .accessible_topology
            .iter()
            .find(|seg| !requisite.iter().any(|r| within(seg, r)));
        if let Some(seg) = stray {
            found.push(Breach::new(
                Rule::TopologyOutsideRequisite,
                format!(
                    "CreateVolume of {} answered accessible topology {:?}, outside the \
                     requisite {:?}",
                    req.name,
                    seg.segments,
                    requisite.iter().map(|r| &r.segments).collect::<Vec<_>>()
                ),
            ));
        }
    }
    found
}

/// An expansion's answer (ControllerExpandVolume, NodeExpandVolume): a capacity it
/// reports (0: none) in the range asked.
pub fn expanded(
    rpc: &str,
    volume_id: &str,
    range: Option<&v1::CapacityRange>,
    capacity: i64,
) -> Option<Breach> {
    outside(range, capacity).map(|d| {
        Breach::new(
            Rule::CapacityOutOfRange,
            format!("{rpc} of {volume_id}: {d}"),
        )
    })
}

/// ValidateVolumeCapabilities' answer: when it confirms, it confirms what was asked.
pub fn validated(
    req: &v1::ValidateVolumeCapabilitiesRequest,
    resp: &v1::ValidateVolumeCapabilitiesResponse,
) -> Option<Breach> {
    let confirmed = resp.confirmed.as_ref()?;
    let same = confirmed.volume_capabilities.len() == req.volume_capabilities.len()
        && confirmed
            .volume_capabilities
            .iter()
            .all(|c| req.volume_capabilities.contains(c));
    (!same).then(|| {
        Breach::new(
            Rule::ConfirmedOtherCapabilities,
            format!(
                "ValidateVolumeCapabilities of {} confirmed {} capabilities other than the {} \
                 asked",
                req.volume_id,
                confirmed.volume_capabilities.len(),
                req.volume_capabilities.len()
            ),
        )
    })
}

/// CreateSnapshot's answer: a snapshot of the volume asked.
pub fn snapshot_created(
    req: &v1::CreateSnapshotRequest,
    snapshot: &v1::Snapshot,
) -> Option<Breach> {
    (!snapshot.source_volume_id.is_empty() && snapshot.source_volume_id != req.source_volume_id)
        .then(|| {
            Breach::new(
                Rule::SnapshotOfOtherVolume,
                format!(
                    "CreateSnapshot {} of volume {} answered snapshot {} of volume {}",
                    req.name, req.source_volume_id, snapshot.snapshot_id, snapshot.source_volume_id
                ),
            )
        })
}

/// A group snapshot's answer (`rpc`) against the plugin's volume ids it was asked for
/// (`asked`): one member snapshot of each, none of another volume or group, each with
/// an id, and the group with an id.
pub fn group_snapshot(
    rpc: &str,
    asked: &[String],
    group: &v1::VolumeGroupSnapshot,
) -> Option<Breach> {
    let mut sources: Vec<&str> = group
        .snapshots
        .iter()
        .map(|s| s.source_volume_id.as_str())
        .collect();
    sources.sort_unstable();
    let mut want: Vec<&str> = asked.iter().map(String::as_str).collect();
    want.sort_unstable();
    let problem = if group.group_snapshot_id.is_empty() {
        Some("no group_snapshot_id".to_string())
    } else if sources != want {
        Some(format!(
            "members of volumes [{}] for volumes [{}]",
            sources.join(", "),
            want.join(", ")
        ))
    } else if let Some(s) = group.snapshots.iter().find(|s| s.snapshot_id.is_empty()) {
        Some(format!(
            "a member of volume {} without an id",
            s.source_volume_id
        ))
    } else {
        group
            .snapshots
            .iter()
            .find(|s| {
                !s.group_snapshot_id.is_empty() && s.group_snapshot_id != group.group_snapshot_id
            })
            .map(|s| format!("member {} of group {}", s.snapshot_id, s.group_snapshot_id))
    };
    problem.map(|p| {
        Breach::new(
            Rule::GroupMembersMismatch,
            format!("{rpc} answered group {:?}: {p}", group.group_snapshot_id),
        )
    })
}

/// GetCapacity's answer: never negative.
pub fn capacity(available: i64) -> Option<Breach> {
    (available < 0).then(|| {
        Breach::new(
            Rule::NegativeCapacity,
            format!("GetCapacity answered {available} bytes available"),
        )
    })
}

/// What NodeGetInfo answered, as the node rules compare it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeInfo {
    /// The node id.
    pub node_id: String,
    /// max_volumes_per_node (0: no limit).
    pub max_volumes: u64,
}

/// NodeGetInfo's answer `now` against the one before (`before`, none at the first)
/// while `published` volumes of the plugin are published on the node.
pub fn node_info(before: Option<&NodeInfo>, now: &NodeInfo, published: usize) -> Vec<Breach> {
    let mut found = Vec::new();
    if let Some(b) = before {
        if published > 0 && !b.node_id.is_empty() && b.node_id != now.node_id {
            found.push(Breach::new(
                Rule::NodeIdChanged,
                format!(
                    "NodeGetInfo answered node id {}, where it answered {} with {published} \
                     volumes published",
                    now.node_id, b.node_id
                ),
            ));
        }
    }
    if now.max_volumes > 0 && (published as u64) > now.max_volumes {
        found.push(Breach::new(
            Rule::MaxVolumesBelowPublished,
            format!(
                "NodeGetInfo answered max_volumes_per_node {} with {published} volumes published",
                now.max_volumes
            ),
        ));
    }
    found
}

/// What moor expects of a plugin's volumes in one survey: the Ready volumes the plugin
/// created for moor and was never asked to delete (by the plugin's volume id, with the
/// object each is), and the ids the previous survey found missing.
#[derive(Debug, Clone, Copy)]
pub struct Expected<'a> {
    /// The plugin's volume id of each volume it created, and the Volume.
    pub made: &'a BTreeMap<String, ObjectRef>,
    /// The volume ids the previous survey did not find.
    pub missing_before: &'a BTreeSet<String>,
}

/// The volumes of `expected.made` that a whole survey by `rpc` (ListVolumes's pages,
/// or ControllerGetVolume of each) did not find (`found` false) and the previous
/// survey did not find either, each with its breach.
pub fn unlisted<'a>(
    rpc: &str,
    expected: Expected<'a>,
    found: impl Fn(&str) -> bool,
) -> Vec<(&'a ObjectRef, Breach)> {
    expected
        .made
        .iter()
        .filter(|(id, _)| !found(id) && expected.missing_before.contains(*id))
        .map(|(id, vol)| {
            let detail = format!(
                "{rpc} left out volume {id} in two surveys in a row; it was created and never deleted"
            );
            (vol, Breach::new(Rule::VolumeNotListed, detail))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_made_volume_is_unlisted_when_two_surveys_in_a_row_miss_it() {
        let vol = |n: &str| ObjectRef {
            kind: "Volume".into(),
            namespace: crate::api::Namespace::default_ns(),
            name: crate::api::Name::new(n).expect("a name"),
        };
        let made: BTreeMap<String, ObjectRef> = [("e1", "v1"), ("e2", "v2"), ("e3", "v3")]
            .into_iter()
            .map(|(e, v)| (e.to_string(), vol(v)))
            .collect();
        // e1 missed before and now; e2 missed before, found now; e3 missed now only;
        // e4 missed twice but moor did not make it (registered, or not Ready).
        let before: BTreeSet<String> = ["e1", "e2", "e4"].map(String::from).into();
        let found = |id: &str| id == "e2";
        let expected = Expected {
            made: &made,
            missing_before: &before,
        };
        let got = unlisted("ListVolumes", expected, found);
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].0.name.as_str(), "v1");
        assert_eq!(got[0].1.rule, Rule::VolumeNotListed);
        assert!(
            got[0]
                .1
                .detail
                .starts_with("ListVolumes left out volume e1"),
            "{got:?}"
        );
        let first = Expected {
            made: &made,
            missing_before: &BTreeSet::new(),
        };
        assert!(unlisted("ListVolumes", first, |_| false).is_empty());
    }

    fn topo(pairs: &[(&str, &str)]) -> v1::Topology {
        v1::Topology {
            segments: pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    fn req(required: i64, limit: i64, requisite: Vec<v1::Topology>) -> v1::CreateVolumeRequest {
        v1::CreateVolumeRequest {
            name: "uid-1".into(),
            capacity_range: Some(v1::CapacityRange {
                required_bytes: required,
                limit_bytes: limit,
            }),
            accessibility_requirements: (!requisite.is_empty()).then(|| v1::TopologyRequirement {
                requisite,
                preferred: vec![],
            }),
            ..Default::default()
        }
    }

    fn vol(id: &str, capacity: i64, topology: Vec<v1::Topology>) -> v1::Volume {
        v1::Volume {
            volume_id: id.into(),
            capacity_bytes: capacity,
            accessible_topology: topology,
            ..Default::default()
        }
    }

    fn rules(b: &[Breach]) -> Vec<Rule> {
        b.iter().map(|b| b.rule).collect()
    }

    #[test]
    fn create_volume_capacity_must_lie_in_the_range_asked() {
        let r = req(100, 200, vec![]);
        for ok in [0, 100, 150, 200] {
            assert!(
                create_volume(&r, &vol("v", ok, vec![]), None).is_empty(),
                "{ok}"
            );
        }
        for bad in [99, 201] {
            let b = create_volume(&r, &vol("v", bad, vec![]), None);
            assert_eq!(rules(&b), [Rule::CapacityOutOfRange], "{bad}");
            assert!(b[0].detail.contains(&bad.to_string()), "{:?}", b[0]);
        }
        // No limit: anything at least the required size.
        assert!(create_volume(&req(100, 0, vec![]), &vol("v", 1 << 40, vec![]), None).is_empty());
    }

    #[test]
    fn create_volume_is_idempotent_by_name() {
        let r = req(0, 0, vec![]);
        assert!(create_volume(&r, &vol("a", 0, vec![]), Some("a")).is_empty());
        assert_eq!(
            rules(&create_volume(&r, &vol("b", 0, vec![]), Some("a"))),
            [Rule::VolumeIdChanged]
        );
    }

    #[test]
    fn accessible_topology_must_lie_within_a_requisite_segment() {
        let r = req(0, 0, vec![topo(&[("zone", "a")]), topo(&[("zone", "b")])]);
        let within = vol("v", 0, vec![topo(&[("zone", "b"), ("rack", "r1")])]);
        assert!(create_volume(&r, &within, None).is_empty());
        let outside = vol("v", 0, vec![topo(&[("zone", "a")]), topo(&[("zone", "c")])]);
        assert_eq!(
            rules(&create_volume(&r, &outside, None)),
            [Rule::TopologyOutsideRequisite]
        );
        // Nothing asked: any topology.
        assert!(create_volume(&req(0, 0, vec![]), &outside, None).is_empty());
    }

    #[test]
    fn node_info_keeps_its_id_and_limit_while_volumes_are_published() {
        let a = NodeInfo {
            node_id: "a".into(),
            max_volumes: 0,
        };
        let b = NodeInfo {
            node_id: "b".into(),
            max_volumes: 2,
        };
        assert!(node_info(None, &a, 5).is_empty(), "the first answer");
        assert!(node_info(Some(&a), &b, 0).is_empty(), "nothing published");
        assert_eq!(rules(&node_info(Some(&a), &b, 2)), [Rule::NodeIdChanged]);
        assert_eq!(
            rules(&node_info(Some(&a), &b, 3)),
            [Rule::NodeIdChanged, Rule::MaxVolumesBelowPublished]
        );
        assert!(node_info(Some(&b), &b, 2).is_empty());
    }

    #[test]
    fn the_other_answers() {
        let range = v1::CapacityRange {
            required_bytes: 10,
            limit_bytes: 0,
        };
        assert!(expanded("ControllerExpandVolume", "v", Some(&range), 10).is_none());
        assert!(expanded("ControllerExpandVolume", "v", Some(&range), 0).is_none());
        assert_eq!(
            expanded("NodeExpandVolume", "v", Some(&range), 9).map(|b| b.rule),
            Some(Rule::CapacityOutOfRange)
        );
        let sreq = v1::CreateSnapshotRequest {
            source_volume_id: "v1".into(),
            name: "s".into(),
            ..Default::default()
        };
        let snap = |src: &str| v1::Snapshot {
            snapshot_id: "s1".into(),
            source_volume_id: src.into(),
            ..Default::default()
        };
        assert!(snapshot_created(&sreq, &snap("v1")).is_none());
        assert_eq!(
            snapshot_created(&sreq, &snap("v2")).map(|b| b.rule),
            Some(Rule::SnapshotOfOtherVolume)
        );
        assert!(capacity(0).is_none());
        assert_eq!(capacity(-1).map(|b| b.rule), Some(Rule::NegativeCapacity));
        let cap = |mode| v1::VolumeCapability {
            access_mode: Some(v1::volume_capability::AccessMode { mode }),
            access_type: None,
        };
        let vreq = v1::ValidateVolumeCapabilitiesRequest {
            volume_id: "v".into(),
            volume_capabilities: vec![cap(1)],
            ..Default::default()
        };
        let answer = |caps| v1::ValidateVolumeCapabilitiesResponse {
            confirmed: Some(v1::validate_volume_capabilities_response::Confirmed {
                volume_capabilities: caps,
                ..Default::default()
            }),
            message: String::new(),
        };
        assert!(validated(&vreq, &answer(vec![cap(1)])).is_none());
        assert_eq!(
            validated(&vreq, &answer(vec![cap(5)])).map(|b| b.rule),
            Some(Rule::ConfirmedOtherCapabilities)
        );
        let unconfirmed = v1::ValidateVolumeCapabilitiesResponse::default();
        assert!(validated(&vreq, &unconfirmed).is_none());
        let names: std::collections::BTreeSet<_> = Rule::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(names.len(), Rule::ALL.len());
    }
}
