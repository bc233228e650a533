//! The plugin's persisted state: volumes, snapshots, attachments, stages and publishes,
//! each change appended to `state.jsonl` (a [`Journal`]), so a restarted plugin knows
//! everything it did.

use moor_csi::journal::{Journal, JournalError, Journaled, Table, Tables};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One volume.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VolumeRec {
    /// The plugin's id of the volume.
    pub id: String,
    /// The CO's name (CreateVolume idempotency key).
    pub name: String,
    /// Capacity in bytes.
    pub capacity: i64,
    /// CreateVolume parameters (compared on a repeat).
    pub parameters: BTreeMap<String, String>,
    /// The snapshot or volume it was created from.
    #[serde(default)]
    pub source: Option<Source>,
    /// The directory holding its data.
    pub path: PathBuf,
    /// Topology it is accessible from (empty: everywhere).
    #[serde(default)]
    pub topology: BTreeMap<String, String>,
    /// Node id → published read-only.
    #[serde(default)]
    pub published: BTreeMap<String, bool>,
    /// Whether the first capability it was created with was single-node.
    #[serde(default)]
    pub single_node: bool,
    /// Mutable parameters (CreateVolume's, then ControllerModifyVolume's).
    #[serde(default)]
    pub mutable_parameters: BTreeMap<String, String>,
}

/// Content a volume was created from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// A snapshot id.
    Snapshot(String),
    /// A volume id.
    Volume(String),
}

/// One snapshot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotRec {
    /// The plugin's id.
    pub id: String,
    /// The CO's name.
    pub name: String,
    /// The volume it copies.
    pub source_volume_id: String,
    /// Size in bytes.
    pub size: i64,
    /// Creation time, seconds since the epoch.
    pub created_secs: i64,
    /// Where the copy lives.
    pub path: PathBuf,
    /// The group snapshot it was cut in (deleted only with its group).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_id: Option<String>,
}

/// One volume group snapshot: snapshots of several volumes cut together.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupRec {
    /// The plugin's id.
    pub id: String,
    /// The CO's name (CreateVolumeGroupSnapshot's idempotency key).
    pub name: String,
    /// Its snapshots, one per source volume, in the request's order.
    pub snapshot_ids: Vec<String>,
    /// Creation time, seconds since the epoch.
    pub created_secs: i64,
}

/// A staged volume on this node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageRec {
    /// The volume.
    pub volume_id: String,
    /// Where it is staged.
    pub staging_path: PathBuf,
    /// Block (true) or mount.
    pub block: bool,
    /// The loop device a block volume is attached to (`--loop-devices`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loop_device: Option<PathBuf>,
}

/// A published volume on this node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PublishRec {
    /// The volume.
    pub volume_id: String,
    /// Where it is published.
    pub target_path: PathBuf,
    /// The staging path it came from, if staged.
    pub staging_path: Option<PathBuf>,
    /// Read-only.
    pub readonly: bool,
    /// Block (true) or mount.
    pub block: bool,
    /// The loop device a block volume published without staging is attached to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loop_device: Option<PathBuf>,
    /// The access mode it was published under (the CSI enum's number; absent in a
    /// journal written before it was kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_mode: Option<i32>,
}

/// Everything the plugin knows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct State {
    /// Volumes by id.
    pub volumes: Table<String, VolumeRec>,
    /// Snapshots by id.
    pub snapshots: Table<String, SnapshotRec>,
    /// Group snapshots by id.
    pub groups: Table<String, GroupRec>,
    /// Stages by staging path.
    pub stages: Table<PathBuf, StageRec>,
    /// Publishes by target path.
    pub publishes: Table<PathBuf, PublishRec>,
}

impl Tables for State {
    fn tables(&mut self) -> Vec<(&'static str, &mut dyn Journaled)> {
        vec![
            ("volumes", &mut self.volumes),
            ("snapshots", &mut self.snapshots),
            ("groups", &mut self.groups),
            ("stages", &mut self.stages),
            ("publishes", &mut self.publishes),
        ]
    }
}

/// What earlier versions wrote, whole, to `state.json`.
#[derive(Deserialize)]
struct Legacy {
    #[serde(default)]
    volumes: BTreeMap<String, VolumeRec>,
    #[serde(default)]
    snapshots: BTreeMap<String, SnapshotRec>,
    #[serde(default)]
    stages: BTreeMap<PathBuf, StageRec>,
    #[serde(default)]
    publishes: BTreeMap<PathBuf, PublishRec>,
}

/// Why state could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// The journal could not be read or is corrupt.
    #[error(transparent)]
    Journal(#[from] JournalError),
    /// Reading or removing the earlier versions' file failed.
    #[error("state file {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The earlier versions' file is not valid state.
    #[error("state file {path} is corrupt")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
}

impl State {
    /// The state journal in a state directory.
    pub fn file(dir: &Path) -> PathBuf {
        dir.join("state.jsonl")
    }

    /// Opens the state journal (empty when it does not exist yet), importing the
    /// `state.json` of earlier versions once. Commits are not fsynced: the file
    /// outlives the process (a crash or kill), not the machine's page cache.
    pub fn load(dir: &Path) -> Result<Journal<State>, StateError> {
        let mut journal = Journal::<State>::open(&State::file(dir), false)?;
        let legacy = dir.join("state.json");
        let io = |source| StateError::Io {
            path: legacy.clone(),
            source,
        };
        let bytes = match std::fs::read(&legacy) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(journal),
            Err(e) => return Err(io(e)),
        };
        let old: Legacy = serde_json::from_slice(&bytes).map_err(|source| StateError::Corrupt {
            path: legacy.clone(),
            source,
        })?;
        let s = journal.state_mut();
        old.volumes
            .into_iter()
            .for_each(|(k, v)| drop(s.volumes.insert(k, v)));
        old.snapshots
            .into_iter()
            .for_each(|(k, v)| drop(s.snapshots.insert(k, v)));
        old.stages
            .into_iter()
            .for_each(|(k, v)| drop(s.stages.insert(k, v)));
        old.publishes
            .into_iter()
            .for_each(|(k, v)| drop(s.publishes.insert(k, v)));
        journal.commit()?;
        std::fs::remove_file(&legacy).map_err(io)?;
        Ok(journal)
    }

    /// The volume created under a name.
    pub fn volume_by_name(&self, name: &str) -> Option<&VolumeRec> {
        self.volumes.values().find(|v| v.name == name)
    }

    /// Bytes allocated to volumes.
    pub fn used_capacity(&self) -> i64 {
        self.volumes
            .values()
            .fold(0i64, |sum, v| sum.saturating_add(v.capacity.max(0)))
    }

    /// The capacity taken by the volumes placed in segment `topology`.
    pub fn used_capacity_in(&self, topology: &BTreeMap<String, String>) -> i64 {
        self.volumes
            .values()
            .filter(|v| &v.topology == topology)
            .fold(0i64, |sum, v| sum.saturating_add(v.capacity.max(0)))
    }

    /// Whether `size` more bytes fit in `total` (never overflowing: sizes come from
    /// the request, and a request may carry up to i64::MAX).
    pub fn fits(&self, size: i64, total: i64) -> bool {
        self.used_capacity()
            .checked_add(size)
            .is_some_and(|after| after <= total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stage() -> StageRec {
        StageRec {
            volume_id: "v".into(),
            staging_path: "/s".into(),
            block: false,
            loop_device: None,
        }
    }

    #[test]
    fn state_round_trips_and_a_corrupt_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(*State::load(dir.path()).unwrap(), State::default());
        let mut j = State::load(dir.path()).unwrap();
        j.state_mut().stages.insert("/s".into(), stage());
        j.commit().unwrap();
        assert_eq!(*State::load(dir.path()).unwrap(), *j);
        std::fs::write(State::file(dir.path()), "{garbage\n").unwrap();
        assert!(matches!(
            State::load(dir.path()),
            Err(StateError::Journal(JournalError::Corrupt { .. }))
        ));
    }

    #[test]
    fn an_earlier_versions_state_json_is_imported_once() {
        let dir = tempfile::tempdir().unwrap();
        let old = serde_json::json!({"stages": {"/s": stage()}});
        std::fs::write(dir.path().join("state.json"), old.to_string()).unwrap();
        assert_eq!(State::load(dir.path()).unwrap().stages.len(), 1);
        assert!(!dir.path().join("state.json").exists());
        assert_eq!(
            State::load(dir.path()).unwrap().stages["/s".as_ref() as &Path],
            stage()
        );
        std::fs::write(dir.path().join("state.json"), "{garbage").unwrap();
        assert!(matches!(
            State::load(dir.path()),
            Err(StateError::Corrupt { .. })
        ));
    }
}
