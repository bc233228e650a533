//! Claim: one allocation's use of one volume, keyed under its node so an agent watches
//! only `claims/<its node>/`.
//!
//! Writer: the controller (spec and status). It denormalises what the node needs
//! (external volume id, capability, contexts) so the agent does not read other kinds;
//! secrets stay on the Volume and are read from there.

use serde::{Deserialize, Serialize};

use super::*;

/// Desired state of a claim.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ClaimSpec {
    /// The claiming allocation.
    #[serde(default)]
    pub allocation: AllocationId,
    /// The allocation's volume request this claim is for.
    #[serde(default)]
    pub request: Name,
    /// The claimed volume (same namespace).
    #[serde(default)]
    pub volume: VolumeId,
    /// The node the allocation runs on.
    #[serde(default)]
    pub node: NodeName,
    /// The volume's plugin.
    #[serde(default)]
    pub plugin_id: PluginId,
    /// Read or write.
    #[serde(default)]
    pub mode: ClaimMode,
    /// The claim's access mode; absent on claims made before per-claim modes existed,
    /// which use the volume's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_mode: Option<AccessMode>,
    /// The claim's attachment mode; absent means the volume's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attachment_mode: Option<AttachmentMode>,
    /// Merged mount options (the request's replace the volume's).
    #[serde(default, skip_serializing_if = "Rare::is_empty")]
    pub mount_options: Rare<MountOptions>,
    /// The plugin's id of the volume, once known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_id: Option<ExternalVolumeId>,
    /// Volume context from CreateVolume or the volume's spec.
    #[serde(default, skip_serializing_if = "StrMap::is_empty")]
    pub volume_context: StrMap,
    /// The secrets NodeStage and NodePublish carry, copied from the volume by the
    /// controller at admission and dropped when the claim is released: the node agent
    /// reads its node's claims, not volumes (see deploy/etcd/roles.sh).
    #[serde(default, skip_serializing_if = "Rare::is_empty")]
    pub node_secrets: Rare<Secrets>,
    /// NodePublish's secrets when the volume names a different Secret for them than
    /// for NodeStage (empty: `node_secrets`); copied and dropped like them. An older
    /// agent skips the field and sends `node_secrets`.
    #[serde(default, skip_serializing_if = "Rare::is_empty")]
    pub node_publish_secrets: Rare<Secrets>,
    /// ControllerPublish's publish_context, once attached.
    #[serde(default, skip_serializing_if = "StrMap::is_empty")]
    pub publish_context: StrMap,
    /// Set by the controller once the claim is admitted (and attached, where the plugin
    /// needs ControllerPublish): the node may stage and publish it. Unset only when the
    /// attachment it stood on was force-detached (see `revoked`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub publish: bool,
    /// The uid of the Attachment whose Attached state granted `publish` (none when the
    /// plugin needs no ControllerPublish). The node acts only on a grant for the
    /// attachment it stands on: what it staged or published under another one was done
    /// on a device that has since been detached, and is torn down first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attachment: Option<Uid>,
    /// Set when the controller withdrew `publish` because the attachment it stood on
    /// was force-detached (a node collected after `--node-gc-timeout`, or `moorctl
    /// volume detach`): the node may have acted under the withdrawn grant, so a release
    /// still waits for it (or skips it, with a Warning). Never unset.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub revoked: bool,
    /// The capacity the node expands the volume's filesystem to (NodeExpandVolume),
    /// copied by the controller from the volume when ControllerExpandVolume said the
    /// nodes must expand.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_expansion_bytes: Option<u64>,
    /// Set by the controller when the allocation no longer needs the volume.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub release: bool,
    /// The allocation's workload cgroup, copied by the controller in the write that
    /// sets `release`: the node's agent kills what is left in it before NodeUnpublish
    /// (`moor::workload::cgroup`). A thin box (8 bytes, not 16): it is almost always
    /// absent, and every cached claim carries the field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload_cgroup: Option<Box<String>>,
    /// The volume's generation when the claim was admitted, or when a force-detach
    /// withdrew its grant (an operator's force detach applies only to claims admitted,
    /// or withdrawn, before it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_generation: Option<i64>,
    /// The uid of the volume admitted (absent on claims admitted by earlier versions):
    /// what a node's force-detach declarations are matched on ([`Declarations`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_uid: Option<Uid>,
}

impl ClaimSpec {
    /// The capability this claim uses: its own modes, or the volume's first capability
    /// for what it leaves out.
    pub fn capability(&self, volume: &VolumeSpec) -> Option<VolumeCapability> {
        let first = volume.capabilities.first();
        Some(VolumeCapability {
            access_mode: self.access_mode.or(first.map(|c| c.access_mode))?,
            attachment_mode: self.attachment_mode.or(first.map(|c| c.attachment_mode))?,
        })
    }
}

impl Spec for ClaimSpec {
    const KIND: &'static str = "Claim";
    const DIR: &'static str = "claims";
    const NAMESPACED: bool = true;
    const ALIASES: &'static [&'static str] = &[];
    const PHASE: Option<&'static str> = Some("/status/phase");
    const CHECKED: bool = true;
    const AGENT: AgentAccess = AgentAccess::ReadOwnNode;
    const KEY_SEGMENTS: usize = 3;
    const KEY_NAMESPACE_FIRST: bool = false;
    type Status = ClaimStatus;

    fn key_suffix(&self, meta: &ObjectMeta) -> String {
        format!("{}/{}/{}", self.node, meta.namespace, meta.name)
    }

    fn secret_fields(&mut self) -> Vec<SecretField<'_>> {
        let node = Some(self.node.as_str());
        let stage = self.node_secrets.get_mut().map(|secrets| SecretField {
            field: "node_secrets",
            node,
            secrets,
        });
        let publish = self
            .node_publish_secrets
            .get_mut()
            .map(|secrets| SecretField {
                field: "node_publish_secrets",
                node,
                secrets,
            });
        stage.into_iter().chain(publish).collect()
    }

    fn validate(&self, errors: &mut ValidationErrors) {
        errors.check_id("allocation", self.allocation.validate());
        errors.check_id("request", self.request.validate());
        errors.check_id("volume", self.volume.validate());
        errors.check_id("node", self.node.validate());
        errors.check_id("plugin_id", self.plugin_id.validate());
        if let Some(ext) = &self.external_id {
            errors.check_id("external_id", ext.validate());
        }
        if let Err(e) = self.node_secrets.check() {
            errors.push("node_secrets", e);
        }
        if let Err(e) = self.node_publish_secrets.check() {
            errors.push("node_publish_secrets", e);
        }
        if let Some(Err(e)) = self
            .workload_cgroup
            .as_deref()
            .map(|c| crate::workload::cgroup::check_recorded(c))
        {
            errors.push("workload_cgroup", e);
        }
        if let Some(mode) = self.access_mode {
            if self.mode == ClaimMode::Write && !mode.allows_write() {
                errors.push("mode", format!("write is not allowed by {mode}"));
            }
        }
    }
}

/// Where a claim is in its lifecycle.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClaimPhase {
    /// Waiting for admission.
    #[default]
    Pending,
    /// Refused; `status.reason` says why. Re-admitted when the blocker goes.
    Denied,
    /// Admitted; attaching, staging and publishing.
    Admitted,
    /// Published on the node.
    Published,
    /// Being torn down.
    Releasing,
    /// Torn down; kept as a past claim on the volume.
    Released,
}

impl ClaimPhase {
    /// Whether the claim holds (or may hold) the volume.
    pub fn is_live(self) -> bool {
        matches!(
            self,
            ClaimPhase::Admitted | ClaimPhase::Published | ClaimPhase::Releasing
        )
    }
}

/// Observed state of a claim.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ClaimStatus {
    /// Lifecycle phase.
    #[serde(default)]
    pub phase: ClaimPhase,
    /// Why it is denied or blocked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<Box<str>>,
    /// Generation, conditions, last error.
    #[serde(flatten)]
    pub meta: StatusMeta,
}

/// A claim object.
pub type Claim = Object<ClaimSpec>;

impl Claim {
    /// The key of claim `name` (in `ns`) on `node`.
    pub fn key_for(
        node: &NodeName,
        ns: &Namespace,
        name: impl std::fmt::Display,
    ) -> ObjectKey<ClaimSpec> {
        ObjectKey::from_parts(&[node, ns, &name])
    }

    /// The claims on `node`: the scope of its agent's watch.
    pub fn node_scope(node: &NodeName) -> KeyScope<ClaimSpec> {
        KeyScope::under(node)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_key_is_under_its_node() {
        let spec = ClaimSpec {
            node: NodeName::new("n1").unwrap(),
            ..Default::default()
        };
        let c = Claim::new(
            &Namespace::default_ns(),
            Name::new("web-1.data").unwrap(),
            spec,
        );
        assert_eq!(c.key(), "claims/n1/default/web-1.data");
    }

    #[test]
    fn old_claims_without_modes_use_the_volume_s() {
        let vol = VolumeSpec {
            capabilities: vec![VolumeCapability {
                access_mode: AccessMode::MultiNodeReaderOnly,
                attachment_mode: AttachmentMode::FileSystem,
            }],
            ..Default::default()
        };
        let old: ClaimSpec = serde_json::from_str(r#"{"volume":"v","node":"n"}"#).unwrap();
        assert_eq!(old.capability(&vol), Some(vol.capabilities[0]));
        let own = ClaimSpec {
            access_mode: Some(AccessMode::SingleNodeWriter),
            ..old.clone()
        };
        assert_eq!(
            own.capability(&vol).unwrap().access_mode,
            AccessMode::SingleNodeWriter
        );
        assert_eq!(old.capability(&VolumeSpec::default()), None);
    }

    #[test]
    fn defaults_are_not_stored_and_read_back_as_defaults() {
        let claim = Claim::new(
            &Namespace::default_ns(),
            Name::new("a.data").unwrap(),
            ClaimSpec::default(),
        );
        let mount = Mount::new(
            &Namespace::default_ns(),
            Name::new("a.data").unwrap(),
            MountSpec::default(),
        );
        let json = serde_json::to_string(&claim).unwrap() + &serde_json::to_string(&mount).unwrap();
        for absent in [
            "\"publish\"",
            "\"release\"",
            "mount_options",
            "\"staged\"",
            "\"published\"",
            "uncertain",
            "\"released\"",
            "observed_generation",
        ] {
            assert!(!json.contains(absent), "{absent} written: {json}");
        }
        let back: Claim = serde_json::from_str(&serde_json::to_string(&claim).unwrap()).unwrap();
        assert_eq!(back, claim);
        let mut set = mount.clone();
        set.status.published = true;
        set.status.meta.observed_generation = 2;
        let json = serde_json::to_string(&set).unwrap();
        assert!(json.contains("\"published\":true") && json.contains("\"observed_generation\":2"));
        assert_eq!(serde_json::from_str::<Mount>(&json).unwrap(), set);
    }
}
#[cfg(test)]
mod size {
    /// Every process caches its claims: with its `Arc` header a Claim stays within
    /// mimalloc's 512-byte class (a field that pushes it past costs 128 bytes a claim).
    #[test]
    fn a_cached_claim_fits_the_512_byte_class() {
        assert!(std::mem::size_of::<super::Claim>() + 16 <= 512);
    }
}
