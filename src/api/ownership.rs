//! Ownership: which moor object a plugin's id belongs to (issue 77, DESIGN.md "Trust:
//! requests and facts").
//!
//! A plugin volume is named by ids that whoever writes a Volume may write: its
//! `spec.external_id` (a registration), its `status.provisioning.external_id` (in the
//! same key as the spec), the `metadata.uid` CreateVolume is named by. None of them
//! proves that the Volume owns the plugin volume. An Ownership record does: it is
//! written only by the agent leading the plugin (`owners/PLUGIN/`, a grant no
//! requester holds), created if absent (an etcd compare on the key's creation
//! revision) when the provisioner first learns the id (CreateVolume's answer, a
//! registration validated), and deleted after the plugin volume is deleted or
//! released. The controller admits a claim only on a volume that owns its id, and the
//! provisioner calls DeleteVolume only for an id its volume owns: a second Volume
//! naming the same id is refused ("owned by another volume").
//!
//! Writer: the agent leading the plugin. Readers: that agent, the controller.
//! Key: `owners/PLUGIN/volume.<SHA-256 of the id, hex>` (the id itself is opaque: it
//! may hold any byte a key must not).

use serde::{Deserialize, Serialize};

use super::*;

/// What a plugin id names.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OwnedResource {
    /// A volume (CreateVolume's `volume_id`, or a registered volume's id).
    #[default]
    Volume,
    /// A snapshot (CreateSnapshot's `snapshot_id`, an imported snapshot's id, or a
    /// group's member, owned by its group).
    Snapshot,
    /// A group snapshot (CreateVolumeGroupSnapshot's `group_snapshot_id`, or an
    /// imported group's).
    GroupSnapshot,
}

impl OwnedResource {
    /// The word in the record's name.
    pub fn as_str(self) -> &'static str {
        match self {
            OwnedResource::Volume => "volume",
            OwnedResource::Snapshot => "snapshot",
            OwnedResource::GroupSnapshot => "group-snapshot",
        }
    }
}

/// The object that owns a plugin id.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnerRef {
    /// Its namespace.
    pub namespace: Namespace,
    /// Its name.
    pub name: Name,
    /// Its uid when the record was made: a Volume deleted and made again under the
    /// same name is another owner.
    pub uid: Uid,
}

impl std::fmt::Display for OwnerRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Who owns one plugin id.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OwnershipSpec {
    /// The plugin whose id it is.
    pub plugin_id: PluginId,
    /// What the id names.
    #[serde(default)]
    pub resource: OwnedResource,
    /// The plugin's id.
    pub external_id: String,
    /// Its owner.
    pub owner: OwnerRef,
    /// What CreateVolume answered of a volume moor created (none for a registration,
    /// a snapshot or a group): the facts a node's calls are given, kept here because
    /// no requester writes this key (the volume's `status.provisioning` shows them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provisioned: Option<Box<Provisioned>>,
    /// Other namespaces whose volumes may use the id (a registration of it, readers
    /// sharing an export) and never delete it: an operator's grant (`moorctl volume
    /// share`), or, at the upgrade, the namespace of a second volume that named the id
    /// before moor kept owners, so that both keep working until an operator picks.
    /// Only operators and the plugin's leader write this key.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shared_with: Vec<Share>,
    /// An operator chose this owner (`moorctl volume own`): the record is the
    /// operator's word, not first come (a squatter evicted).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub chosen: bool,
}

/// A namespace an id is shared with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Share {
    /// The namespace.
    pub namespace: Namespace,
    /// Whether its claims may write (the access-mode rules count claims per Volume
    /// object, so two namespaces' writers are not kept to one writer): by default
    /// only read-only claims are admitted.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub write: bool,
}

impl OwnershipSpec {
    /// How the id is shared with volumes of namespace `ns` (not its owner's), if it is.
    pub fn shared_with(&self, ns: &Namespace) -> Option<&Share> {
        self.shared_with.iter().find(|s| &s.namespace == ns)
    }
}

/// What CreateVolume answered of a plugin volume, as its record keeps it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Provisioned {
    /// The capacity the plugin reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_bytes: Option<u64>,
    /// The volume context the plugin returned: what NodeStage and NodePublish carry.
    #[serde(default, skip_serializing_if = "StrMap::is_empty")]
    pub volume_context: StrMap,
    /// Where the volume is accessible from; empty means everywhere.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub accessible_topology: Vec<Topology>,
}

impl Provisioned {
    /// The facts a volume's status shows (what the provisioner wrote there, or, at an
    /// upgrade, what an older version did).
    pub fn of_status(p: &ProvisioningStatus) -> Provisioned {
        Provisioned {
            capacity_bytes: p.capacity_bytes,
            volume_context: p.volume_context.clone(),
            accessible_topology: p.accessible_topology.clone(),
        }
    }
}

/// An ownership record has no observed state.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OwnershipStatus {
    /// Generation, conditions, last error.
    #[serde(flatten)]
    pub meta: StatusMeta,
}

impl Spec for OwnershipSpec {
    const KIND: &'static str = "Ownership";
    const DIR: &'static str = "owners";
    const NAMESPACED: bool = false;
    const ALIASES: &'static [&'static str] = &["ownerships", "owner"];
    const PHASE: Option<&'static str> = None;
    const CHECKED: bool = true;
    const AGENT: AgentAccess = AgentAccess::OwnPluginWrite;
    const KEY_SEGMENTS: usize = 2;
    const KEY_NAMESPACE_FIRST: bool = false;
    type Status = OwnershipStatus;

    fn key_suffix(&self, meta: &ObjectMeta) -> String {
        format!("{}/{}", self.plugin_id, meta.name)
    }

    fn validate(&self, errors: &mut ValidationErrors) {
        errors.check_id("plugin_id", self.plugin_id.validate());
        if self.external_id.is_empty() || self.external_id.len() > 1024 {
            errors.push("external_id", "must be 1 to 1024 bytes");
        }
        if self.shared_with.len() > MAX_SHARED {
            errors.push("shared_with", format!("at most {MAX_SHARED} namespaces"));
        }
        if self.shared_with(&self.owner.namespace).is_some() {
            errors.push("shared_with", "holds the owner's own namespace");
        }
        let mut seen = std::collections::HashSet::new();
        if !self.shared_with.iter().all(|s| seen.insert(&s.namespace)) {
            errors.push("shared_with", "names a namespace twice");
        }
    }
}

/// How many namespaces one id may be shared with.
pub const MAX_SHARED: usize = 64;

/// An ownership record.
pub type Ownership = Object<OwnershipSpec>;

/// The name of the record of `resource` `id` of a plugin: the resource and the id's
/// SHA-256, so any id makes a valid, fixed-length name.
pub fn ownership_name(resource: OwnedResource, id: &str) -> Name {
    Name::new(format!("{}.{}", resource.as_str(), sha256_hex(id, 32)))
        .expect("a resource word and hex digits make a valid name")
}

/// The name moor gives the plugin for what object `name` of namespace `ns` with uid
/// `uid` asks to be made (CreateVolume, CreateSnapshot, CreateVolumeGroupSnapshot):
/// `moor-` and 128 bits of SHA-256 of the three, joined with newlines (which no name
/// holds). A repeat is idempotent; a name made again is another object. Not the bare
/// uid, which whoever writes a key may copy: a copy in another namespace (or under
/// another name) names another plugin object, so an idempotent create never answers
/// with the original's.
pub fn plugin_name(ns: &Namespace, name: &Name, uid: &Uid) -> String {
    format!("moor-{}", sha256_hex(&format!("{ns}\n{name}\n{uid}"), 16))
}

/// [`plugin_name`] of an object.
pub fn plugin_name_of<S: Spec>(obj: &Object<S>) -> String {
    let m = &obj.metadata;
    plugin_name(&m.namespace, &m.name, &m.uid)
}

/// Whether a record names `object` (a Volume, or a Snapshot) as the owner
/// (namespace, name and uid).
pub fn owned_by<S: Spec>(record: &Ownership, object: &Object<S>) -> bool {
    let o = &record.spec.owner;
    o.namespace == object.metadata.namespace
        && o.name == object.metadata.name
        && o.uid == object.metadata.uid
}

/// What a reader of `volume`'s namespace may be told about the owner of an id it
/// asked for: the owner's name when it is in the same namespace, else only that it
/// is another volume's.
pub fn owner_for(record: &Ownership, namespace: &Namespace) -> String {
    let what = record.spec.resource.as_str();
    if &record.spec.owner.namespace == namespace {
        format!("owned by {what} {}", record.spec.owner.name)
    } else {
        format!("owned by another {what}")
    }
}

/// The name of a plugin's record that the records of its volumes made before moor
/// kept owners are written (by its first leader of a version that keeps them).
pub const MIGRATED: &str = "migrated";

impl Ownership {
    /// The key of plugin `plugin`'s [`MIGRATED`] record.
    pub fn migrated_key(plugin: &PluginId) -> ObjectKey<OwnershipSpec> {
        ObjectKey::from_parts(&[plugin, &MIGRATED])
    }

    /// Plugin `plugin`'s [`MIGRATED`] record.
    pub fn migrated(plugin: &PluginId) -> Ownership {
        Ownership::new(
            &Namespace::default(),
            Name::new(MIGRATED).expect("a valid name"),
            OwnershipSpec {
                plugin_id: plugin.clone(),
                resource: OwnedResource::Volume,
                external_id: MIGRATED.to_string(),
                owner: OwnerRef::default(),
                provisioned: None,
                shared_with: Vec::new(),
                chosen: false,
            },
        )
    }

    /// The key of plugin `plugin`'s record of `resource` `id`.
    pub fn key_for(
        plugin: &PluginId,
        resource: OwnedResource,
        id: &str,
    ) -> ObjectKey<OwnershipSpec> {
        ObjectKey::from_parts(&[plugin, &ownership_name(resource, id)])
    }

    /// Plugin `plugin`'s records (what the agent leading it watches).
    pub fn scope_for(plugin: &PluginId) -> KeyScope<OwnershipSpec> {
        KeyScope::under(plugin)
    }

    /// The record saying `volume` owns its plugin's volume `id`.
    pub fn of_volume(volume: &Volume, id: &ExternalVolumeId) -> Ownership {
        Ownership::of(
            &volume.spec.plugin_id,
            OwnedResource::Volume,
            id.as_str(),
            volume,
        )
    }

    /// The record saying `owner` owns plugin `plugin`'s `resource` `id`.
    pub fn of<S: Spec>(
        plugin: &PluginId,
        resource: OwnedResource,
        id: &str,
        owner: &Object<S>,
    ) -> Ownership {
        Ownership::new(
            &Namespace::default(),
            ownership_name(resource, id),
            OwnershipSpec {
                plugin_id: plugin.clone(),
                resource,
                external_id: id.to_string(),
                owner: OwnerRef {
                    namespace: owner.metadata.namespace.clone(),
                    name: owner.metadata.name.clone(),
                    uid: owner.metadata.uid.clone(),
                },
                provisioned: None,
                shared_with: Vec::new(),
                chosen: false,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volume(ns: &str, name: &str) -> Volume {
        let mut v = Volume::new(
            &Namespace::new(ns).unwrap(),
            Name::new(name).unwrap(),
            VolumeSpec {
                plugin_id: PluginId::new("p.example").unwrap(),
                ..Default::default()
            },
        );
        v.metadata.uid = Uid::random();
        v
    }

    #[test]
    fn a_record_is_keyed_by_the_id_and_names_one_owner() {
        let a = volume("a", "data");
        let id = ExternalVolumeId::new("projects/p/disks/d:1").unwrap();
        let rec = Ownership::of_volume(&a, &id);
        assert!(rec.validate().is_ok(), "{:?}", rec.validate());
        assert_eq!(
            rec.key(),
            Ownership::key_for(&a.spec.plugin_id, OwnedResource::Volume, id.as_str()).as_str()
        );
        assert!(rec.key().starts_with("owners/p.example/volume."));
        assert!(owned_by(&rec, &a));
        // Another namespace's volume of the same name, or one made again: not the owner.
        let b = volume("b", "data");
        assert!(!owned_by(&rec, &b));
        let mut again = a.clone();
        again.metadata.uid = Uid::random();
        assert!(!owned_by(&rec, &again));
        // Its name is told only within its namespace.
        assert_eq!(
            owner_for(&rec, &a.metadata.namespace),
            "owned by volume data"
        );
        assert_eq!(
            owner_for(&rec, &b.metadata.namespace),
            "owned by another volume"
        );
        // Different ids, different records.
        assert_ne!(
            ownership_name(OwnedResource::Volume, "x"),
            ownership_name(OwnedResource::Volume, "y")
        );
    }
}
