//! What the agent has staged and published, persisted in its data dir so a restarted
//! agent re-adopts it instead of doing it again, and finishes half-done releases.
//!
//! A step is recorded as `Uncertain` *before* its CSI call and `Done` after it succeeds,
//! so a crash in between leaves a record that says the reverse may be owed. A final
//! error removes the record (the call took no effect). Each change is appended (and
//! fsynced) to `<data-dir>/state.jsonl`, a [`Journal`] of the two tables, before the
//! agent goes on; the `state.json` of earlier versions is imported once.

use anyhow::Context;
use moor::api::*;
use moor::journal::{Journal, Journaled, Table, Tables};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
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
    /// The attachment (uid) whose grant it was staged under; none where the plugin
    /// needs no ControllerPublish (or the record predates grants naming one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attachment: Option<String>,
    /// The publish_context it was staged with (none in a record that predates it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publish_context: Option<StrMap>,
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
    /// The capacity NodeExpandVolume expanded the volume to for this claim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expanded_bytes: Option<u64>,
    /// The attachment (uid) whose grant it was published under (see
    /// [`StageRecord::attachment`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attachment: Option<String>,
    /// The publish_context it was published with (see
    /// [`StageRecord::publish_context`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publish_context: Option<StrMap>,
}

/// Whether what was done under `done_under` (a record's attachment) stands on the
/// claim's grant `granted`: the same attachment, or a record that names none (made
/// where no ControllerPublish is needed, or before grants named their attachment).
pub fn same_grant(done_under: Option<&str>, granted: Option<&str>) -> bool {
    done_under.is_none() || done_under == granted
}

/// Whether what a record did (under attachment `attachment`, with publish_context
/// `context`) stands on `claim`'s current grant: the same attachment ([`same_grant`])
/// with the same publish_context, where the record kept it. A volume published again
/// with another context (the survey re-publishes one detached behind moor's back) is
/// staged and published again with it, as a withdrawn grant's work is redone.
pub fn on_grant(attachment: Option<&str>, context: Option<&StrMap>, claim: &Claim) -> bool {
    same_grant(attachment, claim.spec.attachment.as_deref())
        && context.is_none_or(|c| *c == claim.spec.publish_context)
}

/// Everything the agent did on its node.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LocalState {
    /// By host staging path.
    pub stages: Table<PathBuf, StageRecord>,
    /// By claim key.
    pub publishes: Table<String, PublishRecord>,
}

impl Tables for LocalState {
    fn tables(&mut self) -> Vec<(&'static str, &mut dyn Journaled)> {
        vec![
            ("stages", &mut self.stages),
            ("publishes", &mut self.publishes),
        ]
    }
}

/// The journal, in the agent's data dir.
const FILE: &str = "state.jsonl";
/// The whole-state file of earlier versions.
const LEGACY_FILE: &str = "state.json";

/// What earlier versions wrote, whole, to `state.json`.
#[derive(Deserialize)]
struct Legacy {
    #[serde(default)]
    stages: BTreeMap<PathBuf, StageRecord>,
    #[serde(default)]
    publishes: BTreeMap<String, PublishRecord>,
}

impl LocalState {
    /// Opens the journal of earlier runs (empty when there was none). A corrupt file
    /// is an error, never silently forgotten: it records mounts.
    pub fn load(dir: &Path) -> anyhow::Result<Journal<LocalState>> {
        let path = dir.join(FILE);
        let advice = "move it away to start empty (mounts it records will not be cleaned up)";
        let mut journal = Journal::<LocalState>::open(&path, true)
            .with_context(|| format!("{} is not a valid agent state; {advice}", path.display()))?;
        let legacy = dir.join(LEGACY_FILE);
        let bytes = match std::fs::read(&legacy) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(journal),
            Err(e) => return Err(e).with_context(|| format!("reading {}", legacy.display())),
        };
        let old: Legacy = serde_json::from_slice(&bytes).with_context(|| {
            format!("{} is not a valid agent state; {advice}", legacy.display())
        })?;
        let s = journal.state_mut();
        for (k, v) in old.stages {
            s.stages.insert(k, v);
        }
        for (k, v) in old.publishes {
            s.publishes.insert(k, v);
        }
        journal
            .commit()
            .with_context(|| format!("importing {}", legacy.display()))?;
        std::fs::remove_file(&legacy)
            .with_context(|| format!("removing {} once imported", legacy.display()))?;
        Ok(journal)
    }

    /// Whether a claim other than `key` still uses (or may use) a staging path.
    pub fn staging_in_use(&self, staging: &Path, except: &str) -> bool {
        // Runs over every record at each release: the cheap tests first, and the paths
        // compared as bytes (Path equality parses components; it showed in a profile).
        let staging = staging.as_os_str();
        self.publishes.iter().any(|(k, p)| {
            !p.released
                && p.step.needs_reverse()
                && p.staging_path.as_deref().map(Path::as_os_str) == Some(staging)
                && k != except
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
            expanded_bytes: None,
            attachment: None,
            publish_context: None,
        }
    }

    #[test]
    fn state_round_trips_and_a_corrupt_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            *LocalState::load(dir.path()).unwrap(),
            LocalState::default()
        );
        let mut j = LocalState::load(dir.path()).unwrap();
        j.state_mut().publishes.insert(
            "claims/n/default/c".into(),
            record("/s", Step::Uncertain, false),
        );
        j.commit().unwrap();
        assert_eq!(*LocalState::load(dir.path()).unwrap(), *j);
        std::fs::write(dir.path().join(FILE), b"{not json\n").unwrap();
        let e = format!("{:#}", LocalState::load(dir.path()).unwrap_err());
        assert!(e.contains("not a valid agent state"), "{e}");
    }

    #[test]
    fn an_earlier_versions_state_json_is_imported_once() {
        let dir = tempfile::tempdir().unwrap();
        let old = serde_json::json!({
            "stages": {"/s": {"namespace": "default", "volume": "v", "plugin_id": "p",
                              "external_id": "e", "step": "done"}},
            "publishes": {"claims/n/default/c": record("/s", Step::Done, false)},
        });
        std::fs::write(dir.path().join(LEGACY_FILE), old.to_string()).unwrap();
        let j = LocalState::load(dir.path()).unwrap();
        assert_eq!(j.stages.len(), 1);
        assert_eq!(j.publishes.len(), 1);
        assert!(!dir.path().join(LEGACY_FILE).exists());
        drop(j);
        let again = LocalState::load(dir.path()).unwrap();
        assert_eq!(again.publishes["claims/n/default/c"].step, Step::Done);

        std::fs::write(dir.path().join(LEGACY_FILE), b"{not json").unwrap();
        let e = format!("{:#}", LocalState::load(dir.path()).unwrap_err());
        assert!(e.contains("state.json is not a valid agent state"), "{e}");
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
