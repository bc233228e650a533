//! The plugin's persisted state: volumes, snapshots, attachments, stages and publishes,
//! rewritten atomically (temp file + rename) after every change, so a restarted plugin
//! knows everything it did.

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
}

/// Everything the plugin knows.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct State {
    /// Volumes by id.
    #[serde(default)]
    pub volumes: BTreeMap<String, VolumeRec>,
    /// Snapshots by id.
    #[serde(default)]
    pub snapshots: BTreeMap<String, SnapshotRec>,
    /// Stages by staging path.
    #[serde(default)]
    pub stages: BTreeMap<PathBuf, StageRec>,
    /// Publishes by target path.
    #[serde(default)]
    pub publishes: BTreeMap<PathBuf, PublishRec>,
}

/// Why state could not be loaded or saved.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// Reading or writing the file failed.
    #[error("state file {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid state.
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
    /// The state file in a state directory.
    pub fn file(dir: &Path) -> PathBuf {
        dir.join("state.json")
    }

    /// Loads the state, empty when the file does not exist yet.
    pub fn load(dir: &Path) -> Result<State, StateError> {
        let path = State::file(dir);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|source| StateError::Corrupt { path, source }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(State::default()),
            Err(source) => Err(StateError::Io { path, source }),
        }
    }

    /// Saves the state atomically.
    pub fn save(&self, dir: &Path) -> Result<(), StateError> {
        let path = State::file(dir);
        let tmp = dir.join("state.json.tmp");
        let io = |source| StateError::Io {
            path: path.clone(),
            source,
        };
        // Serialising plain data to JSON cannot fail.
        let bytes = serde_json::to_vec_pretty(self).unwrap_or_default();
        std::fs::write(&tmp, bytes).map_err(io)?;
        std::fs::rename(&tmp, &path).map_err(io)
    }

    /// The volume created under a name.
    pub fn volume_by_name(&self, name: &str) -> Option<&VolumeRec> {
        self.volumes.values().find(|v| v.name == name)
    }

    /// Bytes allocated to volumes.
    pub fn used_capacity(&self) -> i64 {
        self.volumes.values().map(|v| v.capacity).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_round_trips_and_a_corrupt_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(State::load(dir.path()).unwrap(), State::default());
        let mut s = State::default();
        s.stages.insert(
            "/s".into(),
            StageRec {
                volume_id: "v".into(),
                staging_path: "/s".into(),
                block: false,
            },
        );
        s.save(dir.path()).unwrap();
        assert_eq!(State::load(dir.path()).unwrap(), s);
        std::fs::write(State::file(dir.path()), "{garbage").unwrap();
        assert!(matches!(
            State::load(dir.path()),
            Err(StateError::Corrupt { .. })
        ));
    }
}
