//! Attachment: a volume controller-published to one node, shared by every claim there.
//!
//! Writer: the controller (which makes it, asks for its detach, copies into its status
//! what the agent leading its plugin reports, [`AttachmentReport`], and deletes it once
//! that report says detached).

use serde::{Deserialize, Serialize};

use super::*;

/// Desired state of an attachment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttachmentSpec {
    /// The moor volume.
    #[serde(default)]
    pub volume: VolumeId,
    /// The moor node.
    #[serde(default)]
    pub node: NodeName,
    /// The volume's plugin.
    #[serde(default)]
    pub plugin_id: PluginId,
    /// The plugin's id of the volume: what ControllerPublish carries.
    #[serde(default)]
    pub external_id: ExternalVolumeId,
    /// The plugin's id of the node (NodeGetInfo's): what ControllerPublish carries.
    #[serde(default)]
    pub csi_node_id: CsiNodeId,
    /// The capability to publish with.
    pub capability: VolumeCapability,
    /// Publish read-only.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
    /// Set when no live claim remains on the node: ControllerUnpublish, then delete.
    #[serde(default)]
    pub detach: bool,
    /// The volume context ControllerPublish carries, as the claims were admitted with
    /// it: the volume's declared context and what CreateVolume answered, taken from
    /// the volume's ownership record (issue 77: the volume's status is its writer's
    /// word). Absent in an attachment an older controller made: the attacher then
    /// takes the volume's, as before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_context: Option<StrMap>,
}

impl Spec for AttachmentSpec {
    const KIND: &'static str = "Attachment";
    const DIR: &'static str = "attachments";
    const NAMESPACED: bool = true;
    const ALIASES: &'static [&'static str] = &[];
    const PHASE: Option<&'static str> = Some("/status/phase");
    const CHECKED: bool = true;
    const AGENT: AgentAccess = AgentAccess::ControllerPluginRead;
    const KEY_SEGMENTS: usize = 3;
    type Status = AttachmentStatus;

    fn key_suffix(&self, meta: &ObjectMeta) -> String {
        format!("{}/{}/{}", meta.namespace, self.volume, self.node)
    }

    fn validate(&self, errors: &mut ValidationErrors) {
        errors.check_id("volume", self.volume.validate());
        errors.check_id("node", self.node.validate());
        errors.check_id("plugin_id", self.plugin_id.validate());
        errors.check_id("external_id", self.external_id.validate());
        errors.check_id("csi_node_id", self.csi_node_id.validate());
    }
}

/// Where an attachment is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttachmentPhase {
    /// ControllerPublish not yet succeeded.
    #[default]
    Pending,
    /// Published to the node.
    Attached,
    /// ControllerUnpublish failed and is retried (`spec.detach` set; the failure is
    /// in the status). A first call is made from Attached, which stays until the
    /// Attachment is deleted.
    Detaching,
    /// Unpublished; about to be deleted.
    Detached,
}

/// Observed state of an attachment.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AttachmentStatus {
    /// Lifecycle phase.
    #[serde(default)]
    pub phase: AttachmentPhase,
    /// ControllerPublish's answer, passed to NodeStage and NodePublish.
    #[serde(default, skip_serializing_if = "StrMap::is_empty")]
    pub publish_context: StrMap,
    /// A ControllerPublish timed out or was cut off: it may have taken effect, so
    /// ControllerUnpublish is still owed on release.
    #[serde(default)]
    pub uncertain: bool,
    /// Generation, conditions, last error.
    #[serde(flatten)]
    pub meta: StatusMeta,
}

/// An attachment object.
pub type Attachment = Object<AttachmentSpec>;

impl Attachment {
    /// The key of the attachment of volume `volume` (in `ns`) to `node`.
    pub fn key_for(
        ns: &Namespace,
        volume: impl std::fmt::Display,
        node: &NodeName,
    ) -> ObjectKey<AttachmentSpec> {
        ObjectKey::from_parts(&[ns, &volume, node])
    }
}

/// What the agent leading a plugin observed of one of its Attachments: the
/// attachment's status as that agent keeps it (issue 77, "The controller-plugin agent's
/// reach" in docs/architecture.md).
///
/// An Attachment is written by the controller alone; its status used to be written by
/// the agent leading its plugin, which therefore held a grant on every attachment of
/// every plugin and namespace. The agent writes its observations here instead, below
/// `attachment-reports/PLUGIN/`, a prefix only that plugin's controller nodes may
/// write; the controller copies a report into its Attachment's status (for every
/// reader, itself included) and deletes an Attachment whose report says it is
/// detached. A report counts only for the attachment it names (`attachment_uid`) and
/// only under the key of that attachment's own plugin.
///
/// Writer: the agent leading the plugin. Readers: that agent, the controller.
/// Key: `attachment-reports/PLUGIN/NS/VOLUME/NODE` (the attachment's key, under its
/// plugin).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttachmentReportSpec {
    /// The plugin whose leader reports.
    #[serde(default)]
    pub plugin_id: PluginId,
    /// The attachment's volume.
    #[serde(default)]
    pub volume: VolumeId,
    /// The attachment's node.
    #[serde(default)]
    pub node: NodeName,
    /// The attachment reported on: one made again under the same key is another.
    #[serde(default)]
    pub attachment_uid: Uid,
}

impl Spec for AttachmentReportSpec {
    const KIND: &'static str = "AttachmentReport";
    const DIR: &'static str = "attachment-reports";
    const NAMESPACED: bool = true;
    const ALIASES: &'static [&'static str] = &["attachmentreports"];
    const PHASE: Option<&'static str> = Some("/status/phase");
    const CHECKED: bool = true;
    const AGENT: AgentAccess = AgentAccess::OwnPluginWrite;
    const KEY_SEGMENTS: usize = 4;
    const KEY_NAMESPACE_FIRST: bool = false;
    type Status = AttachmentStatus;

    fn key_suffix(&self, meta: &ObjectMeta) -> String {
        format!(
            "{}/{}/{}/{}",
            self.plugin_id, meta.namespace, self.volume, self.node
        )
    }

    fn validate(&self, errors: &mut ValidationErrors) {
        errors.check_id("plugin_id", self.plugin_id.validate());
        errors.check_id("volume", self.volume.validate());
        errors.check_id("node", self.node.validate());
    }
}

/// A report on an attachment.
pub type AttachmentReport = Object<AttachmentReportSpec>;

impl AttachmentReport {
    /// The key of plugin `plugin`'s report on the attachment at `att` (that
    /// attachment's key, whichever plugin it names).
    pub fn key_for(
        plugin: &PluginId,
        att: &ObjectKey<AttachmentSpec>,
    ) -> ObjectKey<AttachmentReportSpec> {
        ObjectKey::from_parts(&[plugin, &att.suffix()])
    }

    /// The report of `att`'s own plugin on it: the only one that counts.
    pub fn key_of(att: &Attachment) -> ObjectKey<AttachmentReportSpec> {
        AttachmentReport::key_for(&att.spec.plugin_id, &att.object_key())
    }

    /// Plugin `plugin`'s reports (what the agent leading it watches).
    pub fn scope_for(plugin: &PluginId) -> KeyScope<AttachmentReportSpec> {
        KeyScope::under(plugin)
    }

    /// A report on `att` with status `status`.
    pub fn of(att: &Attachment, status: AttachmentStatus) -> AttachmentReport {
        let spec = AttachmentReportSpec {
            plugin_id: att.spec.plugin_id.clone(),
            volume: att.spec.volume.clone(),
            node: att.spec.node.clone(),
            attachment_uid: att.metadata.uid.clone(),
        };
        let mut r = AttachmentReport::new(&att.metadata.namespace, att.metadata.name.clone(), spec);
        r.status = status;
        r
    }

    /// Whether this report is about `att` (the same object, under its own plugin).
    pub fn is_about(&self, att: &Attachment) -> bool {
        self.spec.attachment_uid == att.metadata.uid
            && self.spec.plugin_id == att.spec.plugin_id
            && self.key() == AttachmentReport::key_of(att).as_str()
    }
}

impl Attachment {
    /// Its status as `report` says it, when the report is about it; as stored
    /// otherwise (an attachment no agent of this version reported on yet).
    pub fn reported(&self, report: Option<&AttachmentReport>) -> AttachmentStatus {
        match report {
            Some(r) if r.is_about(self) => r.status.clone(),
            _ => self.status.clone(),
        }
    }
}
