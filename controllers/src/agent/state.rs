//! What the agent has staged and published, persisted in its data dir so a restarted
//! agent re-adopts it instead of doing it again, and finishes half-done releases.
//!
//! A step is recorded as `Uncertain` *before* its CSI call and `Done` after it succeeds,
//! so a crash in between leaves a record that says the reverse may be owed. A final
//! error removes the record (the call took no effect). The file is rewritten atomically
//! (temp file, fsync, rename) on every change.

use anyhow::Context;
use moor::api::*;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// How far one step got.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Step {
    /// Not done, nothing owed.
    #[default]
    Absent,
    /// Called without a definite answer: it may have taken effect; the reverse is owed.
    Uncertain,
    /// Succeeded.
    Done,
}

impl Step {
    /// Whether the reverse call is owed.
    pub fn needs_reverse(self) -> bool {
        self != Step::Absent
    }
}

/// A staging path and how far NodeStage got there.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageRecord {
    /// The volume's namespace.
    pub namespace: Namespace,
    /// The moor volume.
    pub volume: VolumeId,
    /// The plugin.
    pub plugin_id: PluginId,
    /// The plugin's volume id.
    pub external_id: ExternalVolumeId,
    /// NodeStage.
    pub step: Step,
}

/// One claim's publish, and where.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PublishRecord {
    /// The claim's uid (a claim made again under the same name is another claim).
    pub claim_uid: String,
    /// The claim's namespace.
    pub namespace: Namespace,
    /// The claim's name.
    pub claim: Name,
    /// The claiming allocation.
    pub allocation: AllocationId,
    /// The moor volume.
    pub volume: VolumeId,
    /// The plugin.
    pub plugin_id: PluginId,
    /// The plugin's volume id.
    pub external_id: ExternalVolumeId,
    /// Host staging path, when the plugin stages.
    pub staging_path: Option<PathBuf>,
    /// Host target path.
    pub target_path: PathBuf,
    /// NodePublish.
    pub step: Step,
    /// Torn down after the claim's release: never published again.
    pub released: bool,
}

/// Everything the agent did on its node.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LocalState {
    /// By host staging path.
    #[serde(default)]
    pub stages: BTreeMap<PathBuf, StageRecord>,
    /// By claim key.
    #[serde(default)]
    pub publishes: BTreeMap<String, PublishRecord>,
}

const FILE: &str = "state.json";

impl LocalState {
    /// Loads the state of an earlier run; an empty state when there was none. A
    /// corrupt file is an error (never silently forgotten: it records mounts).
    pub fn load(dir: &Path) -> anyhow::Result<LocalState> {
        let path = dir.join(FILE);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).with_context(|| {
                format!(
                    "{} is not a valid agent state; move it away to start empty (mounts it records will not be cleaned up)",
                    path.display()
                )
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(LocalState::default()),
            Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
        }
    }

    /// Writes the state atomically.
    pub fn save(&self, dir: &Path) -> std::io::Result<()> {
        let tmp = dir.join(format!("{FILE}.tmp"));
        {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?)?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, dir.join(FILE))?;
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }

    /// Whether a claim other than `key` still uses (or may use) a staging path.
    pub fn staging_in_use(&self, staging: &Path, except: &str) -> bool {
        self.publishes.iter().any(|(k, p)| {
            k != except
                && !p.released
                && p.step.needs_reverse()
                && p.staging_path.as_deref() == Some(staging)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(staging: &str, step: Step, released: bool) -> PublishRecord {
        PublishRecord {
            claim_uid: "u".into(),
            namespace: Namespace::default_ns(),
            claim: Name::new("c").unwrap(),
            allocation: AllocationId::new("a").unwrap(),
            volume: VolumeId::new("v").unwrap(),
            plugin_id: PluginId::new("p").unwrap(),
            external_id: ExternalVolumeId::new("e").unwrap(),
            staging_path: Some(PathBuf::from(staging)),
            target_path: PathBuf::from("/t"),
            step,
            released,
        }
    }

    #[test]
    fn state_round_trips_and_a_corrupt_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(LocalState::load(dir.path()).unwrap(), LocalState::default());
        let mut s = LocalState::default();
        s.publishes.insert(
            "claims/n/default/c".into(),
            record("/s", Step::Uncertain, false),
        );
        s.save(dir.path()).unwrap();
        assert_eq!(LocalState::load(dir.path()).unwrap(), s);
        std::fs::write(dir.path().join(FILE), b"{not json").unwrap();
        let e = format!("{:#}", LocalState::load(dir.path()).unwrap_err());
        assert!(e.contains("not a valid agent state"), "{e}");
    }

    #[test]
    fn a_staging_path_is_in_use_while_another_claim_may_be_published_from_it() {
        let mut s = LocalState::default();
        s.publishes
            .insert("a".into(), record("/s", Step::Done, false));
        assert!(!s.staging_in_use(Path::new("/s"), "a"));
        s.publishes
            .insert("b".into(), record("/s", Step::Absent, false));
        assert!(!s.staging_in_use(Path::new("/s"), "a"), "b never published");
        s.publishes
            .insert("c".into(), record("/s", Step::Uncertain, false));
        assert!(s.staging_in_use(Path::new("/s"), "a"));
        s.publishes
            .insert("c".into(), record("/s", Step::Done, true));
        assert!(!s.staging_in_use(Path::new("/s"), "a"), "c was released");
        s.publishes
            .insert("d".into(), record("/other", Step::Done, false));
        assert!(!s.staging_in_use(Path::new("/s"), "a"));
    }
}
