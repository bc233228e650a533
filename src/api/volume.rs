//! Volume: a CSI volume that moor registers (`external_id`) or creates (creation params).
//!
//! Writers: the user owns `spec`; the provisioner owns `status.provisioning`; the
//! controller owns `status.claims`. Each writes its own section with compare-and-swap.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use super::*;

/// Desired state of a volume.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VolumeSpec {
    /// The CSI plugin that serves the volume (empty in a manifest that names a class,
    /// or none to take the default class: the front door fills it).
    #[serde(default)]
    pub plugin_id: PluginId,
    /// The VolumeClass it was made from (recorded; the class filled the fields this
    /// spec left empty when it was made, and a later change to the class does not
    /// rewrite them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<Name>,
    /// What deleting the Volume does to a created volume's storage: `delete`
    /// (DeleteVolume, the default) or `retain` (the plugin's volume stays).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_delete: Option<OnDelete>,
    /// Registers a volume that already exists in the storage system.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_id: Option<ExternalVolumeId>,
    /// Smallest acceptable capacity when creating.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_min: Option<Size>,
    /// Largest acceptable capacity when creating.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_max: Option<Size>,
    /// The ways the volume may be used; a claim picks one.
    #[serde(default, deserialize_with = "crate::api::tight_vec")]
    pub capabilities: Vec<VolumeCapability>,
    /// Default mount options; a claim's request replaces them field by field.
    #[serde(default, skip_serializing_if = "Rare::is_empty")]
    pub mount_options: Rare<MountOptions>,
    /// Plugin parameters for CreateVolume (and ValidateVolumeCapabilities when
    /// registering).
    #[serde(default, skip_serializing_if = "Rare::is_empty")]
    pub parameters: Rare<BTreeMap<String, String>>,
    /// Secrets passed to the plugin's calls (redacted in output).
    #[serde(default, skip_serializing_if = "Rare::is_empty")]
    pub secrets: Rare<Secrets>,
    /// The Secret (same namespace, this volume's plugin) each family of calls carries
    /// instead of `secrets`, read when the call is made: a rotated Secret is used by
    /// every later call, and copied again into the live claims for their nodes.
    #[serde(default, skip_serializing_if = "Rare::is_empty")]
    pub secret_refs: Rare<SecretRefs>,
    /// Volume context for a registered volume (CreateVolume returns it otherwise).
    #[serde(default, skip_serializing_if = "Rare::is_empty")]
    pub context: Rare<BTreeMap<String, String>>,
    /// Create from a snapshot or clone another volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<VolumeSource>,
    /// Where a created volume must or should be accessible.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology_request: Option<Box<TopologyRequest>>,
    /// Where a registered volume is accessible from (empty: what ControllerGetVolume
    /// says, else everywhere).
    #[serde(
        default,
        deserialize_with = "crate::api::tight_vec",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub accessible_topology: Vec<Topology>,
    /// Parameters the plugin may change on a live volume: passed to CreateVolume, and
    /// a change on a ready volume calls ControllerModifyVolume (MODIFY_VOLUME).
    #[serde(default, skip_serializing_if = "Rare::is_empty")]
    pub mutable_parameters: Rare<BTreeMap<String, String>>,
    /// Nodes the operator declared gone for this volume (`moorctl volume detach`), each
    /// with the volume generation the declaration made: the controller releases the
    /// claims there admitted at an earlier generation without waiting for the node,
    /// with a Warning. A claim admitted later is never released that way, so a stale
    /// entry cannot skip the node steps of a node that came back.
    #[serde(
        default,
        skip_serializing_if = "Rare::is_empty",
        deserialize_with = "force_detach_entries"
    )]
    pub force_detach: Rare<BTreeMap<NodeName, i64>>,
    /// The allocation request whose template made the volume (issue 41): an ephemeral
    /// one is deleted when that allocation's claims are released, a retained one goes
    /// to the next allocation of the same name. Set by the controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub made_for: Option<Box<MadeFor>>,
    /// Deletion protection, opt-in: while set, a delete of the volume is refused from
    /// every front door (`moorctl delete`, an engine's Remove, a template's ephemeral
    /// end, `delete allocation --volumes`): the first rule of the deletion precedence
    /// (docs/architecture.md). Lifted by applying the volume without it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub deletion_protection: bool,
    /// Whether it admits new claims: `active` (the default), `pause` (no new claim; the
    /// claims it has stay) or `drain` (also: `moorctl volume drain` asked the
    /// allocations holding it to stop). Docker Swarm's volume availability.
    #[serde(default, skip_serializing_if = "Availability::is_active")]
    pub availability: Availability,
}

/// `force_detach` as a map of node to generation, or as the plain list of nodes
/// earlier versions wrote (generation 0: it applies only to claims admitted before
/// claims recorded their volume generation).
fn force_detach_entries<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Rare<BTreeMap<NodeName, i64>>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Entries {
        Map(BTreeMap<NodeName, i64>),
        List(Vec<NodeName>),
    }
    Ok(Rare::new(match Entries::deserialize(d)? {
        Entries::Map(m) => m,
        Entries::List(l) => l.into_iter().map(|n| (n, 0)).collect(),
    }))
}

impl VolumeSpec {
    /// Whether an operator's force detach of `node` covers a claim admitted at volume
    /// generation `admitted` (unknown for claims admitted by earlier versions).
    pub fn force_detached(&self, node: &NodeName, admitted: Option<i64>) -> bool {
        self.force_detach
            .get(node)
            .is_some_and(|at| declared_before(*at, admitted))
    }
}

/// Whether a declaration made at volume generation `at` covers a claim admitted at
/// `admitted` (earlier; unknown for claims admitted by earlier versions).
fn declared_before(at: i64, admitted: Option<i64>) -> bool {
    admitted.is_none_or(|a| a < at)
}

/// The key of node `node`'s force-detach declarations: the volumes an operator declared
/// the node gone for (`moorctl volume detach`, in the same transaction as the volume's
/// `spec.force_detach` entry). The node's agent reads no volume, so this key is how it
/// learns of a declaration: it takes no forward step (NodeStage, NodePublish) for a
/// claim one covers, so that nothing the node does after a declaration is left behind
/// by a release that skipped it.
pub fn declarations_key(node: &NodeName) -> String {
    format!("declarations/{node}")
}

/// What [`declarations_key`] holds: `NAMESPACE/VOLUME` → the declaration.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Declarations {
    /// By `NAMESPACE/VOLUME`.
    #[serde(default)]
    pub volumes: BTreeMap<String, Declaration>,
}

/// One volume's force-detach declaration for a node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Declaration {
    /// The volume's uid (a volume made again under the same name is another volume).
    pub uid: Uid,
    /// The volume generation the declaration made (its `spec.force_detach` entry).
    pub generation: i64,
}

impl Declarations {
    /// Reads the stored value (written by operators' moorctl; bounded by etcd's
    /// request size).
    pub fn parse(value: &[u8]) -> Result<Declarations, String> {
        serde_json::from_slice(value).map_err(|e| format!("not force-detach declarations: {e}"))
    }

    fn entry(namespace: &Namespace, volume: &str) -> String {
        format!("{namespace}/{volume}")
    }

    /// Records that `volume` declared this node gone at generation `generation`.
    pub fn declare(&mut self, volume: &Volume, generation: i64) {
        self.volumes.insert(
            Declarations::entry(&volume.metadata.namespace, volume.metadata.name.as_str()),
            Declaration {
                uid: volume.metadata.uid.clone(),
                generation,
            },
        );
    }

    /// Whether a declaration covers `claim` (of this node): the same volume, and the
    /// claim admitted (or last withdrawn) at an earlier generation, as
    /// [`VolumeSpec::force_detached`] decides on the controller's side.
    pub fn covers(&self, claim: &Claim) -> bool {
        let key = Declarations::entry(&claim.metadata.namespace, claim.spec.volume.as_str());
        self.volumes.get(&key).is_some_and(|d| {
            claim
                .spec
                .volume_uid
                .as_ref()
                .is_none_or(|uid| *uid == d.uid)
                && declared_before(d.generation, claim.spec.volume_generation)
        })
    }
}

/// Content to create a volume from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VolumeSource {
    /// A moor Snapshot (in the same namespace) to restore, once it is ready.
    Snapshot(Name),
    /// The plugin's own id of a snapshot moor does not manage.
    ExternalSnapshotId(String),
    /// Another moor volume (in the same namespace) to clone.
    Volume(VolumeId),
}

impl VolumeSpec {
    /// Whether the volume is registered (exists already) rather than created by moor.
    pub fn is_registration(&self) -> bool {
        self.external_id.is_some()
    }

    /// Whether the volume offers a capability.
    pub fn offers(&self, cap: &VolumeCapability) -> bool {
        self.capabilities.contains(cap)
    }
}

impl Spec for VolumeSpec {
    const KIND: &'static str = "Volume";
    const DIR: &'static str = "volumes";
    const NAMESPACED: bool = true;
    const ALIASES: &'static [&'static str] = &["vol", "vols"];
    const PHASE: Option<&'static str> = Some("/status/provisioning/phase");
    const CHECKED: bool = true;
    const AGENT: AgentAccess = AgentAccess::ControllerPluginRead;
    type Status = VolumeStatus;

    fn deletion_refused(&self) -> Option<&'static str> {
        self.deletion_protection.then_some(
            "its deletion_protection is set; apply it without deletion_protection to lift it",
        )
    }

    fn check_stored(&self, errors: &mut ValidationErrors) {
        self.check_resolved(errors);
    }

    fn keep_on_update(&mut self, stored: &Self) {
        keep_class_fill(self, stored);
    }

    fn secret_fields(&mut self) -> Vec<SecretField<'_>> {
        let secrets = self.secrets.get_mut();
        secrets
            .map(|secrets| SecretField {
                field: "secrets",
                node: None,
                secrets,
            })
            .into_iter()
            .collect()
    }

    fn validate(&self, errors: &mut ValidationErrors) {
        // An empty plugin is a class's to fill (`class::resolve`, at the front door).
        if !self.plugin_id.is_empty() {
            errors.check_id("plugin_id", self.plugin_id.validate());
        }
        if let Some(c) = &self.class {
            errors.check_id("class", c.validate());
        }
        if let Err(e) = self.secrets.check() {
            errors.push("secrets", e);
        }
        self.secret_refs.validate("secret_refs", errors);
        if let Err(e) = self.mount_options.check() {
            errors.push("mount_options", e);
        }
        if self.capabilities.is_empty() && self.class.is_none() && !self.plugin_id.is_empty() {
            errors.push(
                "capabilities",
                "at least one {access_mode, attachment_mode} is required",
            );
        }
        for (i, cap) in self.capabilities.iter().enumerate() {
            if self.capabilities[..i].contains(cap) {
                errors.push(format!("capabilities[{i}]"), "is listed twice");
            }
        }
        for node in self.force_detach.keys() {
            if let Err(e) = node.validate() {
                let shown: String = node.as_str().chars().take(64).collect();
                errors.push(format!("force_detach.{}", printable(&shown)), e);
            }
        }
        if let (Some(min), Some(max)) = (self.capacity_min, self.capacity_max) {
            if max < min {
                errors.push(
                    "capacity_max",
                    format!("{max} is less than capacity_min {min}"),
                );
            }
        }
        if let Some(ext) = &self.external_id {
            errors.check_id("external_id", ext.validate());
            let creation = [
                ("capacity_min", self.capacity_min.is_some()),
                ("capacity_max", self.capacity_max.is_some()),
                ("source", self.source.is_some()),
                ("topology_request", self.topology_request.is_some()),
            ];
            for (field, set) in creation {
                if set {
                    errors.push(
                        field,
                        "is a creation parameter; a volume registered by external_id is not created",
                    );
                }
            }
        }
        if self.external_id.is_none() && !self.accessible_topology.is_empty() {
            errors.push(
                "accessible_topology",
                "is declared for a registered volume (external_id); a created volume uses topology_request",
            );
        }
        if let Some(VolumeSource::Volume(id)) = &self.source {
            errors.check_id("source.volume", id.validate());
        }
        if let Some(VolumeSource::Snapshot(name)) = &self.source {
            errors.check_id("source.snapshot", name.validate());
        }
        if let Some(VolumeSource::ExternalSnapshotId(id)) = &self.source {
            if id.is_empty() {
                errors.push("source.external_snapshot_id", "is required");
            }
        }
    }
}

/// Observed state of a volume: one section per writer.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VolumeStatus {
    /// Written by the provisioner.
    #[serde(default)]
    pub provisioning: ProvisioningStatus,
    /// Written by the controller.
    #[serde(default)]
    pub claims: VolumeClaimsStatus,
}

/// Where a volume is in its life in the storage system.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VolumePhase {
    /// Not yet created or registered.
    #[default]
    Pending,
    /// CreateVolume in progress.
    Creating,
    /// Exists and can be claimed.
    Ready,
    /// DeleteVolume in progress.
    Deleting,
    /// Creation failed with a final error.
    Failed,
}

/// The provisioner's section of a volume's status.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProvisioningStatus {
    /// Lifecycle phase.
    #[serde(default)]
    pub phase: VolumePhase,
    /// The plugin's id of the volume (CreateVolume's answer, or the spec's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_id: Option<ExternalVolumeId>,
    /// Capacity the plugin reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_bytes: Option<u64>,
    /// Volume context the plugin returned.
    #[serde(default, skip_serializing_if = "StrMap::is_empty")]
    pub volume_context: StrMap,
    /// Where the volume is accessible from; empty means everywhere.
    #[serde(
        default,
        deserialize_with = "crate::api::tight_vec",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub accessible_topology: Vec<Topology>,
    /// The mutable parameters the plugin last accepted (CreateVolume or
    /// ControllerModifyVolume).
    #[serde(default, skip_serializing_if = "Rare::is_empty")]
    pub mutable_parameters: Rare<BTreeMap<String, String>>,
    /// Set when ControllerExpandVolume answered `node_expansion_required`: the capacity
    /// every node that stages or publishes the volume expands its filesystem to
    /// (NodeExpandVolume).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_expansion_bytes: Option<u64>,
    /// Generation, conditions, last error.
    #[serde(flatten)]
    pub meta: StatusMeta,
}

/// A claim as a volume lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimRef {
    /// The claiming allocation.
    pub allocation: AllocationId,
    /// The claim object's name.
    pub claim: Name,
    /// Where it is used.
    pub node: NodeName,
    /// Read or write.
    pub mode: ClaimMode,
    /// The access mode the claim holds the volume in (absent on old records: the
    /// volume's first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_mode: Option<AccessMode>,
}

/// The controller's section of a volume's status.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VolumeClaimsStatus {
    /// Whether a new claim could be placed (plugin healthy, volume ready).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub schedulable: bool,
    /// Live read claims.
    #[serde(
        default,
        deserialize_with = "crate::api::tight_vec",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub read_claims: Vec<ClaimRef>,
    /// Live write claims.
    #[serde(
        default,
        deserialize_with = "crate::api::tight_vec",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub write_claims: Vec<ClaimRef>,
    /// Released claims, most recent last.
    #[serde(
        default,
        deserialize_with = "crate::api::tight_vec",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub past_claims: Vec<ClaimRef>,
    /// Generation, conditions, last error.
    #[serde(flatten)]
    pub meta: StatusMeta,
}

/// A volume object.
pub type Volume = Object<VolumeSpec>;

/// The finalizer that holds a created volume's deletion until its plugin's leader
/// reports it released (after DeleteVolume): the controller adds and removes it as
/// that leader's [`VolumeReport`] asks.
pub const PROVISIONER_FINALIZER: &str = "moor.dev/provisioner";

impl Reported for VolumeSpec {
    type Section = ProvisioningStatus;
    const REPORT_KIND: &'static str = "VolumeReport";
    const REPORT_DIR: &'static str = "volume-reports";
    const REPORT_ALIASES: &'static [&'static str] = &["volumereports"];
    const REPORT_PHASE: Option<&'static str> = Some("/status/phase");

    fn section(status: &VolumeStatus) -> &ProvisioningStatus {
        &status.provisioning
    }

    fn section_mut(status: &mut VolumeStatus) -> &mut ProvisioningStatus {
        &mut status.provisioning
    }
}

/// What the agent leading a plugin reports of one of its Volumes: the provisioner's
/// section of its status (`status.provisioning`) and what it asks of its finalizer,
/// written below `volume-reports/PLUGIN/`; the controller copies the section into the
/// Volume and adds or removes the `moor.dev/provisioner` finalizer as asked. See
/// [`ReportSpec`].
pub type VolumeReportSpec = ReportSpec<VolumeSpec>;

/// A report on a volume.
pub type VolumeReport = Object<VolumeReportSpec>;

impl Volume {
    /// The key of volume `name` in `ns`.
    pub fn key_for(ns: &Namespace, name: impl std::fmt::Display) -> ObjectKey<VolumeSpec> {
        ObjectKey::from_parts(&[ns, &name])
    }

    /// What its ControllerPublish and ControllerUnpublish calls take from it.
    pub fn attach_inputs(&self) -> AttachInputs {
        AttachInputs {
            secrets: self.spec.secrets.clone(),
            secret_refs: self.spec.secret_refs.clone(),
            context: self.spec.context.clone(),
            volume_context: self.status.provisioning.volume_context.clone(),
            mount_options: self.spec.mount_options.clone(),
        }
    }
}

/// What a volume's ControllerPublish and ControllerUnpublish calls take from it (its
/// secrets, or the Secret named for the call's family, its contexts and its mount
/// options), apart from the volume: the attacher keeps these, not the whole object.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AttachInputs {
    /// `spec.secrets`.
    pub secrets: Rare<Secrets>,
    /// `spec.secret_refs`.
    pub secret_refs: Rare<SecretRefs>,
    /// `spec.context` (a registered volume's).
    pub context: Rare<BTreeMap<String, String>>,
    /// `status.provisioning.volume_context` (what CreateVolume returned).
    pub volume_context: StrMap,
    /// `spec.mount_options`.
    pub mount_options: Rare<MountOptions>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn design_example_parses_and_validates() {
        let json = r#"{
            "apiVersion": "moor/v1", "kind": "Volume",
            "metadata": {"name": "db-data", "namespace": "default"},
            "spec": {
                "plugin_id": "hostpath.moor.dev",
                "capacity_min": "1GiB", "capacity_max": "2GiB",
                "capabilities": [{"access_mode": "single-node-writer", "attachment_mode": "file-system"}],
                "mount_options": {"fs_type": "ext4", "mount_flags": ["noatime"]},
                "parameters": {}, "secrets": {}
            }}"#;
        let v: Volume = serde_json::from_str(json).unwrap();
        v.validate().unwrap();
        assert_eq!(v.spec.capacity_min, Some(Size(1 << 30)));
        assert_eq!(v.key(), "volumes/default/db-data");
        assert!(!v.spec.is_registration());
    }

    #[test]
    fn validation_reports_every_problem_at_once() {
        let json = r#"{"kind": "Volume", "metadata": {"name": "", "namespace": "a/b"},
            "spec": {"plugin_id": "a b", "external_id": "", "capacity_min": "2GiB", "capacity_max": "1GiB"}}"#;
        let v: Volume = serde_json::from_str(json).unwrap();
        let errs = v.validate().unwrap_err();
        let fields: Vec<&str> = errs.0.iter().map(|e| e.field.as_str()).collect();
        for f in [
            "metadata.name",
            "metadata.namespace",
            "spec.plugin_id",
            "spec.capabilities",
            "spec.capacity_max",
            "spec.external_id",
            "spec.capacity_min",
        ] {
            assert!(fields.contains(&f), "{f} missing from {errs}");
        }
    }

    #[test]
    fn namespace_defaults_and_wrong_kind_is_reported() {
        let json = r#"{"kind": "Allocation", "metadata": {"name": "x"},
            "spec": {"plugin_id": "p", "capabilities": [{"access_mode": "multi-node-reader-only", "attachment_mode": "block-device"}]}}"#;
        let mut v: Volume = serde_json::from_str(json).unwrap();
        v.apply_defaults();
        assert_eq!(v.metadata.namespace.as_str(), "default");
        let errs = v.validate().unwrap_err();
        assert_eq!(errs.0.len(), 1);
        assert_eq!(errs.0[0].field, "kind");
    }

    #[test]
    fn secrets_are_stored_but_never_debug_printed() {
        let mut spec = VolumeSpec {
            plugin_id: PluginId::new("p").unwrap(),
            ..Default::default()
        };
        spec.secrets = Secrets::new([("token".into(), "s3cr3t".into())].into()).into();
        let v = Volume::new(&Namespace::default_ns(), Name::new("v").unwrap(), spec);
        assert!(!format!("{v:?}").contains("s3cr3t"));
        assert!(serde_json::to_string(&v).unwrap().contains("s3cr3t"));
    }

    #[test]
    fn a_declaration_covers_claims_of_its_volume_admitted_before_it() {
        let mut v = Volume::new(
            &Namespace::default_ns(),
            Name::new("v1").unwrap(),
            VolumeSpec::default(),
        );
        v.metadata.uid = "vol-uid".into();
        let mut d = Declarations::default();
        d.declare(&v, 5);
        let claim = |volume: &str, generation: Option<i64>, uid: Option<&str>| {
            Claim::new(
                &Namespace::default_ns(),
                Name::new("a1.data").unwrap(),
                ClaimSpec {
                    volume: VolumeId::new(volume).unwrap(),
                    volume_generation: generation,
                    volume_uid: uid.map(Uid::new),
                    ..Default::default()
                },
            )
        };
        assert!(d.covers(&claim("v1", Some(4), Some("vol-uid"))));
        // Admitted at or after the declaration's generation: not covered.
        assert!(!d.covers(&claim("v1", Some(5), Some("vol-uid"))));
        // Another volume, or the same name made again (another uid): not covered.
        assert!(!d.covers(&claim("v2", Some(1), Some("vol-uid"))));
        assert!(!d.covers(&claim("v1", Some(1), Some("new-uid"))));
        // Claims of earlier versions (no uid, no generation) are covered.
        assert!(d.covers(&claim("v1", None, None)));
        // What is stored reads back; garbage is an error, not an empty set.
        let stored = serde_json::to_vec(&d).unwrap();
        assert_eq!(Declarations::parse(&stored).unwrap(), d);
        assert!(Declarations::parse(b"[1,2]").is_err());
    }
}
