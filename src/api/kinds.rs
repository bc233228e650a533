//! The registry of kinds: every kind moor stores, listed once. moorctl's `get`,
//! `describe`, `delete` and `wait`, `moord check` and `moord roles` (which writes
//! deploy/etcd/roles.sh) all go through [`Kind`] and [`with_spec!`](crate::with_spec);
//! manifests are parsed into [`AnyObject`], generated from the same list.
//!
//! Adding a kind:
//! 1. Its file in `src/api`: the spec type implementing [`Spec`] (name, key directory
//!    and layout, aliases, phase, whether `moord check` audits it, what an agent's
//!    etcd role may do with it, validation) and its `key_for` constructor.
//! 2. Its line in [`crate::for_each_kind!`] below.
//! 3. Its table columns in moorctl (`moorctl/src/table.rs`): the match there is
//!    exhaustive, so a kind without columns does not compile.
//!
//! Then regenerate the roles script: `moord roles > deploy/etcd/roles.sh` (a test fails
//! while it is stale).

use std::fmt;
use std::str::FromStr;

use super::*;

/// What a node agent's etcd role may do with a kind's keys (the controller may do
/// anything below the prefix). An agent reads nothing it is not granted here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentAccess {
    /// Nothing (allocations: the controller turns them into claims).
    None,
    /// Read its own node's objects, keyed by node first (its claims, which carry
    /// everything a node step needs).
    ReadOwnNode,
    /// Read and write its own node's objects: the key `DIR/NODE` of a cluster-wide
    /// kind, the keys below `DIR/NODE/` of a kind keyed by node first.
    OwnNode,
    /// Read all (plugins).
    Read,
    /// Read and write what it wrote itself, below `DIR/node/NODE/` (events: each
    /// writer records under its own prefix and cannot touch another's).
    OwnWriter,
    /// Read, on the nodes that host a controller plugin (attachments, volumes,
    /// snapshots and groups, which the controller writes and the plugin's leader reads;
    /// it reports below its own plugin's prefix); nothing elsewhere.
    ControllerPluginRead,
    /// Read the objects of the plugin it hosts as a controller plugin, keyed by plugin
    /// first (its Secrets); nothing elsewhere, and nothing on node-only agents.
    OwnPlugin,
    /// Read and write the objects of the plugin it hosts as a controller plugin, keyed
    /// by plugin first (its ownership records and reports, which only its leader
    /// writes); nothing elsewhere, and nothing on node-only agents.
    OwnPluginWrite,
}

/// Calls `$m! { Variant(SpecType), ... }` with every kind, in the order moorctl and
/// `moord check` list them. The one list of kinds.
#[macro_export]
macro_rules! for_each_kind {
    ($m:ident) => {
        $m! {
            Volume(VolumeSpec),
            VolumeReport(VolumeReportSpec),
            VolumeClass(VolumeClassSpec),
            Allocation(AllocationSpec),
            Claim(ClaimSpec),
            Attachment(AttachmentSpec),
            AttachmentReport(AttachmentReportSpec),
            Mount(MountSpec),
            Node(NodeSpec),
            Cordon(CordonSpec),
            Plugin(PluginSpec),
            Event(EventSpec),
            Snapshot(SnapshotSpec),
            SnapshotReport(SnapshotReportSpec),
            VolumeGroupSnapshot(VolumeGroupSnapshotSpec),
            VolumeGroupSnapshotReport(VolumeGroupSnapshotReportSpec),
            SnapshotSchedule(SnapshotScheduleSpec),
            Quota(QuotaSpec),
            Secret(SecretSpec),
            Lease(LeaseSpec),
            Ownership(OwnershipSpec),
        }
    };
}

macro_rules! define_kinds {
    ($($kind:ident($spec:ident),)*) => {
        /// A kind, as the tools name it.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Kind {
            $(
                #[doc = concat!("[`", stringify!($spec), "`].")]
                $kind,
            )*
        }

        impl Kind {
            /// Every kind.
            pub const ALL: &'static [Kind] = &[$(Kind::$kind,)*];

            /// The kind's name in manifests, e.g. `Volume`.
            pub fn name(self) -> &'static str {
                match self {
                    $(Kind::$kind => <$spec as Spec>::KIND,)*
                }
            }

            /// The kind's key directory, e.g. `volumes` (also its plural).
            pub fn dir(self) -> &'static str {
                match self {
                    $(Kind::$kind => <$spec as Spec>::DIR,)*
                }
            }

            /// Whether its objects live in a namespace.
            pub fn namespaced(self) -> bool {
                match self {
                    $(Kind::$kind => <$spec as Spec>::NAMESPACED,)*
                }
            }

            /// Other names the tools accept for it.
            pub fn aliases(self) -> &'static [&'static str] {
                match self {
                    $(Kind::$kind => <$spec as Spec>::ALIASES,)*
                }
            }

            /// Where its phase is in the JSON of an object, if it has one.
            pub fn phase_pointer(self) -> Option<&'static str> {
                match self {
                    $(Kind::$kind => <$spec as Spec>::PHASE,)*
                }
            }

            /// Whether `moord check` audits it.
            pub fn checked(self) -> bool {
                match self {
                    $(Kind::$kind => <$spec as Spec>::CHECKED,)*
                }
            }

            /// What a node agent's etcd role may do with it.
            pub fn agent_access(self) -> AgentAccess {
                match self {
                    $(Kind::$kind => <$spec as Spec>::AGENT,)*
                }
            }
        }

        /// An object of any kind, as read from a manifest.
        #[derive(Debug, Clone, PartialEq)]
        pub enum AnyObject {
            $(
                #[doc = concat!("An object of [`", stringify!($spec), "`].")]
                $kind(Box<Object<$spec>>),
            )*
        }

        impl AnyObject {
            /// The object's key below the store prefix.
            pub fn key(&self) -> String {
                match self {
                    $(AnyObject::$kind(o) => o.key(),)*
                }
            }

            /// The object's kind.
            pub fn kind(&self) -> Kind {
                match self {
                    $(AnyObject::$kind(_) => Kind::$kind,)*
                }
            }

            /// Document `doc`'s `value` as an object of the kind a manifest names
            /// `name`; `None` when no kind has that name.
            pub(super) fn parse(
                name: &str,
                doc: usize,
                value: serde_json::Value,
            ) -> Option<Result<AnyObject, ManifestError>> {
                $(
                    if name == <$spec as Spec>::KIND {
                        return Some(manifest::typed(doc, value, AnyObject::$kind));
                    }
                )*
                None
            }
        }

        /// Runs `$body` with `$S` the spec type of the [`Kind`] `$kind`.
        #[macro_export]
        macro_rules! with_spec {
            ($k:expr, $S:ident => $body:expr) => {
                match $k {
                    $($crate::api::Kind::$kind => {
                        #[allow(dead_code)]
                        type $S = $crate::api::$spec;
                        $body
                    })*
                }
            };
        }
    };
}

for_each_kind!(define_kinds);

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name().to_lowercase())
    }
}

impl FromStr for Kind {
    type Err = String;

    /// A kind by its name, its directory (plural) or an alias, in any case.
    fn from_str(s: &str) -> Result<Kind, String> {
        let want = s.to_lowercase();
        Kind::ALL
            .iter()
            .copied()
            .find(|k| {
                k.name().to_lowercase() == want
                    || k.dir() == want
                    || k.aliases().contains(&want.as_str())
            })
            .ok_or_else(|| {
                let names: Vec<String> = Kind::ALL.iter().map(ToString::to_string).collect();
                format!("unknown kind {s:?}: one of {}", names.join(", "))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_parse_by_name_plural_and_alias() {
        assert_eq!("allocs".parse::<Kind>(), Ok(Kind::Allocation));
        assert_eq!("Volume".parse::<Kind>(), Ok(Kind::Volume));
        assert_eq!("claims".parse::<Kind>(), Ok(Kind::Claim));
        assert_eq!("ev".parse::<Kind>(), Ok(Kind::Event));
        assert_eq!("vgs".parse::<Kind>(), Ok(Kind::VolumeGroupSnapshot));
        assert!("pods".parse::<Kind>().is_err());
    }

    #[test]
    fn the_registry_agrees_with_each_spec() {
        for &kind in Kind::ALL {
            let (name, dir) = with_spec!(kind, S => (S::KIND, S::DIR));
            assert_eq!((kind.name(), kind.dir()), (name, dir));
        }
        assert_eq!(Kind::ALL.len(), 21);
    }

    #[test]
    fn manifests_know_every_kind_of_the_registry_and_no_other() {
        for &kind in Kind::ALL {
            let doc = serde_json::json!({"kind": kind.name(), "metadata": {"name": "x"}});
            let parsed = AnyObject::parse(kind.name(), 1, doc);
            assert!(parsed.is_some(), "{kind}");
            if let Some(Ok(obj)) = parsed {
                assert_eq!(obj.kind(), kind);
            }
        }
        let doc = serde_json::json!({"kind": "Pod"});
        assert!(AnyObject::parse("Pod", 1, doc).is_none());
    }
}
