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

impl Reported for AttachmentSpec {
    type Section = AttachmentStatus;
    const REPORT_KIND: &'static str = "AttachmentReport";
    const REPORT_DIR: &'static str = "attachment-reports";
    const REPORT_ALIASES: &'static [&'static str] = &["attachmentreports"];
    const REPORT_PHASE: Option<&'static str> = Some("/status/phase");

    fn section(status: &AttachmentStatus) -> &AttachmentStatus {
        status
    }

    fn section_mut(status: &mut AttachmentStatus) -> &mut AttachmentStatus {
        status
    }
}

/// What the agent leading a plugin reports of one of its Attachments (its status as
/// that agent keeps it): written below `attachment-reports/PLUGIN/`, copied into the
/// Attachment by the controller, which deletes an Attachment asked to detach once its
/// report says Detached. See [`ReportSpec`].
pub type AttachmentReportSpec = ReportSpec<AttachmentSpec>;

/// A report on an attachment.
pub type AttachmentReport = Object<AttachmentReportSpec>;
