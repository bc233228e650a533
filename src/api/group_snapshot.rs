//! VolumeGroupSnapshot: one consistent point-in-time copy of several volumes of one
//! plugin, cut by one CreateVolumeGroupSnapshot (CSI GroupController) and deleted by
//! one DeleteVolumeGroupSnapshot. Each member becomes a Snapshot object named
//! `GROUP-VOLUME` (`spec.group` names the group), restored like any other.
//!
//! A kind of its own, not a field on Snapshot: a group is one call, one plugin id and
//! one deletion for all its members, and it exists before any member does (the plugin
//! names the member snapshots only in its answer). Were the group a field on each
//! Snapshot, which of N objects owns the call, and when the set is complete, would be
//! decided by coordination across objects; here one object owns both.
//!
//! Writers: the user owns `spec`; the controller owns `status`, the
//! `moor.dev/group-snapshotter` finalizer and the member Snapshots, copied from, asked
//! by and listed in the report of the group snapshotter (run by the agent leading the
//! volumes' controller plugin), [`VolumeGroupSnapshotReport`].

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

use super::*;

/// The most volumes one group snapshot takes.
pub const MAX_GROUP_VOLUMES: usize = 64;

/// Desired state of a group snapshot.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VolumeGroupSnapshotSpec {
    /// The moor volumes (same namespace, one plugin) cut together.
    #[serde(default)]
    pub volumes: Vec<VolumeId>,
    /// Plugin parameters for CreateVolumeGroupSnapshot.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub parameters: BTreeMap<String, String>,
    /// Secrets for the group calls (redacted in output); absent: the first volume's.
    #[serde(default, skip_serializing_if = "Secrets::is_empty")]
    pub secrets: Secrets,
    /// Imported: the plugin's id of a group snapshot made outside moor, of `volumes`.
    /// The group snapshotter reads it (GetVolumeGroupSnapshot) instead of cutting one,
    /// and keeps it in the plugin when this object is deleted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_snapshot_id: Option<String>,
}

impl Spec for VolumeGroupSnapshotSpec {
    const KIND: &'static str = "VolumeGroupSnapshot";
    const DIR: &'static str = "groupsnapshots";
    const NAMESPACED: bool = true;
    const ALIASES: &'static [&'static str] = &["vgs", "groupsnapshot", "groupsnap"];
    const PHASE: Option<&'static str> = Some("/status/phase");
    const CHECKED: bool = true;
    const AGENT: AgentAccess = AgentAccess::ControllerPluginRead;
    type Status = VolumeGroupSnapshotStatus;

    fn secret_fields(&mut self) -> Vec<SecretField<'_>> {
        vec![SecretField {
            field: "secrets",
            node: None,
            secrets: &mut self.secrets,
        }]
    }

    fn validate(&self, errors: &mut ValidationErrors) {
        if self.volumes.is_empty() {
            errors.push("volumes", "at least one volume is required");
        }
        if self.volumes.len() > MAX_GROUP_VOLUMES {
            errors.push(
                "volumes",
                format!(
                    "{} volumes; a group takes at most {MAX_GROUP_VOLUMES}",
                    self.volumes.len()
                ),
            );
        }
        let mut seen = BTreeSet::new();
        for (i, v) in self.volumes.iter().enumerate() {
            errors.check_id(&format!("volumes[{i}]"), v.validate());
            if !seen.insert(v) {
                errors.push(format!("volumes[{i}]"), format!("{v} is named twice"));
            }
        }
        if let Err(e) = self.secrets.check() {
            errors.push("secrets", e);
        }
        if let Some(id) = &self.group_snapshot_id {
            super::snapshot::check_plugin_snapshot_id(errors, "group_snapshot_id", id);
        }
    }
}

/// One member of a group snapshot: a volume's snapshot in it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupMember {
    /// The moor volume.
    pub volume: VolumeId,
    /// The member Snapshot object (`GROUP-VOLUME`).
    pub snapshot: Name,
    /// The plugin's id of the member snapshot.
    pub snapshot_id: String,
    /// The plugin's id of the volume it was cut from.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub source_volume_id: String,
    /// Its size as the plugin reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
}

/// Observed state of a group snapshot.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VolumeGroupSnapshotStatus {
    /// Lifecycle phase (as a Snapshot's).
    #[serde(default)]
    pub phase: SnapshotPhase,
    /// The plugin that holds it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugin_id: Option<PluginId>,
    /// The plugin's ids of the volumes asked, recorded before the first
    /// CreateVolumeGroupSnapshot: from then on the call is in doubt until answered.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub source_volume_ids: Vec<String>,
    /// The plugin's id of the group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_snapshot_id: Option<String>,
    /// Its members, in the order of `spec.volumes`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub members: Vec<GroupMember>,
    /// When the plugin cut it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_time: Option<Timestamp>,
    /// Whether every member can be restored from now.
    #[serde(default)]
    pub ready_to_use: bool,
    /// Generation, conditions, last error.
    #[serde(flatten)]
    pub meta: StatusMeta,
}

/// A group snapshot object.
pub type VolumeGroupSnapshot = Object<VolumeGroupSnapshotSpec>;

impl VolumeGroupSnapshot {
    /// The key of group snapshot `name` in `ns`.
    pub fn key_for(
        ns: &Namespace,
        name: impl std::fmt::Display,
    ) -> ObjectKey<VolumeGroupSnapshotSpec> {
        ObjectKey::from_parts(&[ns, &name])
    }

    /// The name of its member Snapshot of `volume`: `GROUP-VOLUME`, if that is a
    /// valid name (at most 128 bytes).
    pub fn member_name(&self, volume: &VolumeId) -> Result<Name, String> {
        let name = format!("{}-{volume}", self.metadata.name);
        Name::new(name.clone()).map_err(|e| format!("member snapshot name {name:?}: {e}"))
    }
}

/// The finalizer that holds a group's deletion until its plugin let it go
/// (DeleteVolumeGroupSnapshot, or the id kept): the controller adds and removes it as
/// the group snapshotter's report asks, and deletes the group's member Snapshots
/// before removing it.
pub const GROUP_SNAPSHOTTER_FINALIZER: &str = "moor.dev/group-snapshotter";

/// The condition the controller sets on a group once it made its member Snapshots.
pub const MEMBERS_CREATED: &str = "MembersCreated";

impl Reported for VolumeGroupSnapshotSpec {
    type Section = VolumeGroupSnapshotStatus;
    const REPORT_KIND: &'static str = "VolumeGroupSnapshotReport";
    const REPORT_DIR: &'static str = "groupsnapshot-reports";
    const REPORT_ALIASES: &'static [&'static str] = &["groupsnapshotreports"];
    const REPORT_PHASE: Option<&'static str> = Some("/status/phase");

    fn section(status: &VolumeGroupSnapshotStatus) -> &VolumeGroupSnapshotStatus {
        status
    }

    fn section_mut(status: &mut VolumeGroupSnapshotStatus) -> &mut VolumeGroupSnapshotStatus {
        status
    }
}

/// What the agent leading a group's plugin reports of it (its status, what it asks of
/// the group snapshotter's finalizer): written below `groupsnapshot-reports/PLUGIN/`,
/// copied into the group by the controller when PLUGIN is the group's (the one its
/// status records, else its first volume's), which then makes the member Snapshots
/// the status lists. See [`ReportSpec`].
pub type VolumeGroupSnapshotReportSpec = ReportSpec<VolumeGroupSnapshotSpec>;

/// A report on a group snapshot.
pub type VolumeGroupSnapshotReport = Object<VolumeGroupSnapshotReportSpec>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_names_each_volume_once_and_at_least_one() {
        let spec = |vols: &[&str]| VolumeGroupSnapshotSpec {
            volumes: vols.iter().map(|v| VolumeId::new(*v).unwrap()).collect(),
            ..Default::default()
        };
        let errs = |s: &VolumeGroupSnapshotSpec| {
            let mut e = ValidationErrors::default();
            s.validate(&mut e);
            e.to_string()
        };
        assert!(errs(&spec(&["a", "b"])).is_empty());
        assert!(errs(&spec(&[])).contains("at least one"));
        assert!(errs(&spec(&["a", "a"])).contains("named twice"));
        let mut imported = spec(&["a"]);
        imported.group_snapshot_id = Some(String::new());
        assert!(errs(&imported).contains("group_snapshot_id"));
    }

    #[test]
    fn member_names_join_the_group_and_the_volume() {
        let g = VolumeGroupSnapshot::new(
            &Namespace::default_ns(),
            Name::new("nightly").unwrap(),
            VolumeGroupSnapshotSpec::default(),
        );
        assert_eq!(
            g.member_name(&VolumeId::new("db").unwrap())
                .unwrap()
                .as_str(),
            "nightly-db"
        );
        let long = VolumeId::new("v".repeat(125)).unwrap();
        assert!(g.member_name(&long).is_err());
    }
}
