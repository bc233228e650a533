//! Mount: the node-side observed state of one claim (staged, published, paths).
//!
//! Writer: the agent of the node.

use serde::{Deserialize, Serialize};

use super::*;

/// What is mounted for a claim, and where.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MountSpec {
    /// The claim this mount serves (same namespace).
    #[serde(default)]
    pub claim: Name,
    /// The claiming allocation.
    #[serde(default)]
    pub allocation: AllocationId,
    /// The moor volume.
    #[serde(default)]
    pub volume: VolumeId,
    /// The node.
    #[serde(default)]
    pub node: NodeName,
    /// The uid of the claim this mount serves: a claim deleted and made again under
    /// the same name is another claim.
    #[serde(default)]
    pub claim_uid: Uid,
    /// Host path of the staging directory, when the plugin stages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staging_path: Option<String>,
    /// Host path the volume is published at.
    #[serde(default)]
    pub target_path: String,
}

impl Spec for MountSpec {
    const KIND: &'static str = "Mount";
    const DIR: &'static str = "mounts";
    const NAMESPACED: bool = true;
    const ALIASES: &'static [&'static str] = &[];
    const PHASE: Option<&'static str> = None;
    const CHECKED: bool = true;
    const AGENT: AgentAccess = AgentAccess::OwnNode;
    const KEY_SEGMENTS: usize = 3;
    const KEY_NAMESPACE_FIRST: bool = false;
    type Status = MountStatus;

    fn key_suffix(&self, meta: &ObjectMeta) -> String {
        format!("{}/{}/{}", self.node, meta.namespace, self.claim)
    }

    fn validate(&self, errors: &mut ValidationErrors) {
        errors.check_id("claim", self.claim.validate());
        errors.check_id("allocation", self.allocation.validate());
        errors.check_id("volume", self.volume.validate());
        errors.check_id("node", self.node.validate());
        if self.target_path.is_empty() {
            errors.push("target_path", "is required");
        }
    }
}

/// Observed node-side state of a claim.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MountStatus {
    /// NodeStage succeeded (or may have: see `stage_uncertain`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub staged: bool,
    /// NodeStage timed out or was cut off; NodeUnstage is owed on release.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stage_uncertain: bool,
    /// NodePublish succeeded.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub published: bool,
    /// NodePublish timed out or was cut off; NodeUnpublish is owed on release.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub publish_uncertain: bool,
    /// NodeGetVolumeStats' usage (refreshed every `--volume-stats-interval`, written
    /// when it moved by 1% or more).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Box<VolumeUsage>>,
    /// The node plugin's view of the volume's health (VOLUME_CONDITION).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub condition: Option<Box<VolumeHealth>>,
    /// The capacity NodeExpandVolume last expanded the volume to on this node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expanded_bytes: Option<u64>,
    /// The claim was released and everything it used on the node torn down: the
    /// controller may detach. Once set, the agent never mounts for this claim again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub released: bool,
    /// Set when the claim this mount served is missing from desired state and nothing
    /// says it was deleted (an older etcd snapshot was restored): the agent keeps the
    /// mount and reports it here until an operator adopts it into an allocation or
    /// releases it (`moorctl mount adopt`, `moorctl mount release`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub orphan: Option<Box<Orphan>>,
    /// Generation, conditions, last error.
    #[serde(flatten)]
    pub meta: StatusMeta,
}

/// A mount kept on its node although desired state no longer holds its claim: what it
/// is, so that an operator can adopt it into an allocation that makes the same claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Orphan {
    /// When the agent found the claim missing.
    pub since: Timestamp,
    /// The plugin.
    pub plugin_id: PluginId,
    /// The plugin's volume id.
    pub external_id: ExternalVolumeId,
    /// The allocation's request the claim was made for (absent when the agent that
    /// recorded the mount predates 0.2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<Name>,
    /// Whether it was published read-only or read-write.
    pub mode: ClaimMode,
    /// The capability it was published with.
    pub capability: VolumeCapability,
    /// The processes its node found using the mount (their working or root
    /// directory, executable or an open file is below the target path, or on the
    /// volume's own file system), at most [`MAX_HOLDERS`], refreshed while it is
    /// orphaned: `moorctl mount release` refuses while any is listed, unless `--force`.
    #[serde(
        default,
        deserialize_with = "crate::api::tight_vec",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub holders: Vec<MountHolder>,
}

/// The most holders an orphaned Mount lists.
pub const MAX_HOLDERS: usize = 16;

/// A process that uses a mount, as its node saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountHolder {
    /// Its process id on the node.
    pub pid: u32,
    /// Its command name (`/proc/PID/comm`).
    pub command: String,
}

impl Orphan {
    /// The allocation that makes this mount's claim again, on `node`: named as the
    /// claim's allocation was (the target path holds the name), with one request for
    /// the volume in the mode and capability it was published with. An operator's
    /// `moorctl mount adopt` writes it; the node's agent then adopts the mount for the
    /// new claim without a CSI call.
    pub fn allocation(&self, mount: &Mount) -> Allocation {
        let request = self
            .request
            .clone()
            .unwrap_or_else(|| Name::new(mount.spec.volume.as_str()).unwrap_or_default());
        Allocation::new(
            &mount.metadata.namespace,
            Name::new(mount.spec.allocation.as_str()).unwrap_or_default(),
            AllocationSpec {
                node: mount.spec.node.clone(),
                volumes: vec![VolumeRequest {
                    name: request,
                    volume: mount.spec.volume.clone(),
                    read_only: self.mode == ClaimMode::Read,
                    access_mode: Some(self.capability.access_mode),
                    attachment_mode: Some(self.capability.attachment_mode),
                    ..Default::default()
                }],
                ..Default::default()
            },
        )
    }
}

impl Orphan {
    /// Why the orphan `mount` (a node's report, written with the node's identity) is
    /// not taken at its word, checked against what the store says that node could
    /// have had: the volume it names (`volume`, in the mount's namespace) must exist,
    /// be of the orphan's plugin and have the orphan's plugin volume as its own id;
    /// that plugin volume must be this volume's by its ownership record (`owner`, when
    /// there is one: this volume's or one of its namespace's); and the node must have
    /// served the namespace in the state the store holds (`served`: a claim of the
    /// namespace on the node, or a live or past claim or attachment of the volume
    /// there), unless the operator insists.
    pub fn refusal(
        &self,
        mount: &Mount,
        volume: Option<&Volume>,
        owner: Option<&Ownership>,
        served: bool,
        insist: bool,
    ) -> Option<String> {
        let node = &mount.spec.node;
        let ns = &mount.metadata.namespace;
        let name = &mount.spec.volume;
        let Some(volume) = volume else {
            return Some(format!(
                "node {node} reports a mount of volume {ns}/{name}, which does not exist"
            ));
        };
        let own_id = volume.status.provisioning.external_id.as_ref();
        if volume.spec.plugin_id != self.plugin_id || own_id != Some(&self.external_id) {
            return Some(format!(
                "node {node} reports a mount of volume {ns}/{name} on a plugin volume that is not the volume's: only the node's word says it is"
            ));
        }
        if let Some(rec) = owner {
            if !owned_by(rec, volume) && &rec.spec.owner.namespace != ns {
                return Some(format!(
                    "node {node} reports a mount of volume {ns}/{name}, whose plugin volume is {}",
                    owner_for(rec, ns)
                ));
            }
        }
        if !served && !insist {
            return Some(format!(
                "node {node} has no claim of namespace {ns} and no claim or attachment of volume {name} in the stored state: the orphan is only its word (--insist adopts it anyway)"
            ));
        }
        None
    }
}

/// A mount object.
pub type Mount = Object<MountSpec>;

impl Mount {
    /// The key of the Mount of `claim`: keyed like it, below `mounts/`.
    pub fn key_for(claim: &ObjectKey<ClaimSpec>) -> ObjectKey<MountSpec> {
        ObjectKey::from_parts(&[&claim.suffix()])
    }

    /// The key of the claim a Mount mirrors (they share the suffix `NODE/NS/NAME`).
    pub fn claim_key(mount: &ObjectKey<MountSpec>) -> ObjectKey<ClaimSpec> {
        ObjectKey::from_parts(&[&mount.suffix()])
    }

    /// The mounts on `node`: the scope of its agent's watch.
    pub fn node_scope(node: &NodeName) -> KeyScope<MountSpec> {
        KeyScope::under(node)
    }
}
