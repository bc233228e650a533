//! Snapshot: a point-in-time copy of a moor Volume, made through the volume's plugin
//! (CreateSnapshot) and deleted through it (DeleteSnapshot). A Volume restores one with
//! `spec.source: {snapshot: NAME}`.
//!
//! Writers: the user owns `spec`; the controller owns `status` and the
//! `moor.dev/snapshotter` finalizer, copied from and asked by the report of the
//! snapshotter (run by the agent leading the volume's controller plugin),
//! [`SnapshotReport`]; the controller also makes and deletes a group's member
//! Snapshots.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use super::*;

/// Desired state of a snapshot.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SnapshotSpec {
    /// The moor volume (same namespace) to snapshot.
    #[serde(default)]
    pub volume: VolumeId,
    /// Plugin parameters for CreateSnapshot.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub parameters: BTreeMap<String, String>,
    /// Secrets for CreateSnapshot and DeleteSnapshot (redacted in output); absent:
    /// the volume's.
    #[serde(default, skip_serializing_if = "Secrets::is_empty")]
    pub secrets: Secrets,
    /// The Secret (same namespace, the volume's plugin) its calls carry instead of
    /// `secrets` (absent: `secrets`, else the volume's snapshot Secret, else the
    /// volume's secrets).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<Name>,
    /// Imported: the plugin's id of a snapshot made outside moor (of `volume`). The
    /// snapshotter finds it with ListSnapshots instead of cutting one, and keeps it in
    /// the plugin when this Snapshot is deleted (moor did not make it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<String>,
    /// The VolumeGroupSnapshot it is a member of: made by the group's one call (the
    /// group snapshotter writes it with `snapshot_id` and its status), restored from
    /// like any other, and deleted in the plugin only with its group
    /// (DeleteVolumeGroupSnapshot); deleting this object alone keeps it there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<Name>,
}

/// The longest plugin id of a snapshot an import accepts (the CSI spec's size limit for
/// its ids).
pub const MAX_SNAPSHOT_ID_BYTES: usize = 128;

/// Checks a plugin's id of a snapshot (or of a group snapshot) an operator names for an
/// import: 1 to [`MAX_SNAPSHOT_ID_BYTES`] bytes, no control characters.
pub(super) fn check_plugin_snapshot_id(errors: &mut ValidationErrors, field: &str, id: &str) {
    if id.is_empty() || id.len() > MAX_SNAPSHOT_ID_BYTES {
        errors.push(field, format!("must be 1 to {MAX_SNAPSHOT_ID_BYTES} bytes"));
    } else if id.chars().any(char::is_control) {
        errors.push(field, "must not contain control characters");
    }
}

impl Spec for SnapshotSpec {
    const KIND: &'static str = "Snapshot";
    const DIR: &'static str = "snapshots";
    const NAMESPACED: bool = true;
    const ALIASES: &'static [&'static str] = &["snap", "snaps"];
    const PHASE: Option<&'static str> = Some("/status/phase");
    const CHECKED: bool = true;
    const AGENT: AgentAccess = AgentAccess::ControllerPluginRead;
    type Status = SnapshotStatus;

    fn secret_fields(&mut self) -> Vec<SecretField<'_>> {
        vec![SecretField {
            field: "secrets",
            node: None,
            secrets: &mut self.secrets,
        }]
    }

    fn validate(&self, errors: &mut ValidationErrors) {
        errors.check_id("volume", self.volume.validate());
        if let Some(g) = &self.group {
            errors.check_id("group", g.validate());
            if self.snapshot_id.is_none() {
                errors.push("group", "a group's member names its snapshot_id");
            }
        }
        if let Err(e) = self.secrets.check() {
            errors.push("secrets", e);
        }
        if let Some(name) = &self.secret_ref {
            errors.check_id("secret_ref", name.validate());
        }
        if let Some(id) = &self.snapshot_id {
            check_plugin_snapshot_id(errors, "snapshot_id", id);
        }
    }
}

/// Where a snapshot is in its life.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotPhase {
    /// Not yet asked for (the volume is not created yet, or the plugin not known).
    #[default]
    Pending,
    /// CreateSnapshot answered, not yet ready to use (or in doubt).
    Creating,
    /// Cut and ready to restore from.
    Ready,
    /// Refused for good (the plugin's final answer, or no CREATE_DELETE_SNAPSHOT).
    Failed,
}

/// Observed state of a snapshot.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SnapshotStatus {
    /// Lifecycle phase.
    #[serde(default)]
    pub phase: SnapshotPhase,
    /// The plugin that holds it (so it can be deleted after its volume is gone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugin_id: Option<PluginId>,
    /// The plugin's id of the snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<String>,
    /// The plugin's id of the volume it was cut from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_volume_id: Option<String>,
    /// Its size as the plugin reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
    /// When the plugin cut it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_time: Option<Timestamp>,
    /// Whether a volume can be restored from it now.
    #[serde(default)]
    pub ready_to_use: bool,
    /// Generation, conditions, last error.
    #[serde(flatten)]
    pub meta: StatusMeta,
}

/// A snapshot object.
pub type Snapshot = Object<SnapshotSpec>;

impl Snapshot {
    /// The key of snapshot `name` in `ns`.
    pub fn key_for(ns: &Namespace, name: impl std::fmt::Display) -> ObjectKey<SnapshotSpec> {
        ObjectKey::from_parts(&[ns, &name])
    }
}

/// The finalizer that holds a snapshot's deletion until its plugin let it go
/// (DeleteSnapshot, or the id kept): the controller adds and removes it as the
/// snapshotter's report asks.
pub const SNAPSHOTTER_FINALIZER: &str = "moor.dev/snapshotter";

impl Reported for SnapshotSpec {
    type Section = SnapshotStatus;
    const REPORT_KIND: &'static str = "SnapshotReport";
    const REPORT_DIR: &'static str = "snapshot-reports";
    const REPORT_ALIASES: &'static [&'static str] = &["snapshotreports"];
    const REPORT_PHASE: Option<&'static str> = Some("/status/phase");

    fn section(status: &SnapshotStatus) -> &SnapshotStatus {
        status
    }

    fn section_mut(status: &mut SnapshotStatus) -> &mut SnapshotStatus {
        status
    }
}

/// What the agent leading a snapshot's plugin reports of it (its status as that agent
/// keeps it, and what it asks of the snapshotter's finalizer): written below
/// `snapshot-reports/PLUGIN/`, copied into the Snapshot by the controller when PLUGIN
/// is the snapshot's (the one its status records, else its volume's). See
/// [`ReportSpec`].
pub type SnapshotReportSpec = ReportSpec<SnapshotSpec>;

/// A report on a snapshot.
pub type SnapshotReport = Object<SnapshotReportSpec>;
