//! What the agent has staged and published, persisted in its data dir so a restarted
//! agent re-adopts it instead of doing it again, and finishes half-done releases.
//!
//! A forward step is recorded as `Uncertain` *before* its CSI call and `Done` after it
//! succeeds, so a crash in between leaves a record that says the reverse may be owed.
//! A refusal (a final or transient answer: the call took no effect) to a step that had
//! not taken effect before records it `Absent` again; an uncertain answer leaves it
//! `Uncertain`. Each change is appended to `<data-dir>/state.jsonl`, a [`Journal`] of
//! the two tables; a step's record is on disk before its call, an outcome before the
//! Mount reports it (`node::Reconcile::edit`, `record`, `settle`). The `state.json` of
//! earlier versions is imported once.

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
    /// How far each of the claim's own steps got (NodePublish, and any step after
    /// it), keyed by the step's name; an agent before 0.3 wrote NodePublish's alone,
    /// as `step`.
    #[serde(alias = "step")]
    pub steps: ClaimSteps,
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
    /// The allocation's request, the claim's mode and the capability it was published
    /// with (absent in records of agents before 0.2): what an orphaned mount's
    /// adoption makes again ([`Orphan::allocation`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub made_for: Option<MadeFor>,
    /// When the agent found the claim missing from desired state with nothing saying
    /// it was deleted (an older etcd snapshot restored): the mount is kept and
    /// reported, never torn down without an operator's command.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub orphaned: Option<Timestamp>,
}

/// How far each of a claim's own steps got, keyed by the step's CSI name (the name its
/// retry gate and its failures use): a step not listed is `Absent`. The node
/// executor's checkpointing code writes it ([`Step::Uncertain`] before the call, the
/// outcome after), so a new step needs no field of its own.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(transparent)]
pub struct ClaimSteps(BTreeMap<String, Step>);

impl ClaimSteps {
    /// How far step `name` got.
    pub fn get(&self, name: &str) -> Step {
        self.0.get(name).copied().unwrap_or_default()
    }

    /// Records how far step `name` got (`Absent` drops it).
    pub fn set(&mut self, name: &str, step: Step) {
        match step {
            Step::Absent => {
                self.0.remove(name);
            }
            step => {
                if let Some(s) = self.0.get_mut(name) {
                    *s = step;
                } else {
                    self.0.insert(name.to_string(), step);
                }
            }
        }
    }

    /// Whether any step may have taken effect (its reverse is owed).
    pub fn owed(&self) -> bool {
        self.0.values().any(|s| s.needs_reverse())
    }
}

/// The steps as this version writes them (a map by name), or as an agent before 0.3
/// did: NodePublish's alone.
impl<'de> Deserialize<'de> for ClaimSteps {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Stored {
            ByName(BTreeMap<String, Step>),
            Publish(Step),
        }
        let by_name = match Stored::deserialize(d)? {
            Stored::ByName(by_name) => by_name,
            Stored::Publish(step) => BTreeMap::from([(LEGACY_STEP.to_string(), step)]),
        };
        // Absent is never listed (`set` drops it): a stored one reads as not listed.
        Ok(ClaimSteps(
            by_name
                .into_iter()
                .filter(|(_, s)| *s != Step::Absent)
                .collect(),
        ))
    }
}

/// The one step a publish record of an agent before 0.3 recorded (as `step`): the node
/// executor's name for NodePublishVolume (`node::plan::PUBLISH`).
const LEGACY_STEP: &str = "NodePublishVolume";

/// What a publish record was made for, besides its claim's identity.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MadeFor {
    /// The allocation's request.
    pub request: Name,
    /// Read-only or read-write.
    pub mode: ClaimMode,
    /// The capability as the claim holds it.
    pub capability: VolumeCapability,
}

impl PublishRecord {
    /// The record as an orphan ([`Orphan`]) since `since`: the capability and mode it
    /// was made for, else (a record of an agent before 0.2) read back from the target
    /// path's last component, `<ro|rw>-<attachment>-<access>`, which this agent made.
    pub fn orphan(&self, since: Timestamp) -> Option<Orphan> {
        let made = match &self.made_for {
            Some(m) => m.clone(),
            None => {
                let last = self.target_path.file_name()?.to_str()?;
                let (mode, usage) = match last.split_at_checked(3)? {
                    ("ro-", usage) => (ClaimMode::Read, usage),
                    ("rw-", usage) => (ClaimMode::Write, usage),
                    _ => return None,
                };
                let mode_of = |s: &str| serde_json::from_value(serde_json::Value::from(s)).ok();
                let (attachment_mode, access) =
                    [AttachmentMode::FileSystem, AttachmentMode::BlockDevice]
                        .into_iter()
                        .find_map(|a| {
                            Some((a, usage.strip_prefix(a.as_str())?.strip_prefix('-')?))
                        })?;
                let capability = VolumeCapability {
                    attachment_mode,
                    access_mode: mode_of(access)?,
                };
                MadeFor {
                    request: Name::new(self.volume.as_str()).ok()?,
                    mode,
                    capability,
                }
            }
        };
        Some(Orphan {
            since,
            plugin_id: self.plugin_id.clone(),
            external_id: self.external_id.clone(),
            request: self.made_for.as_ref().map(|m| m.request.clone()),
            mode: made.mode,
            capability: made.capability,
            holders: Vec::new(),
        })
    }
}

/// Whether what was done under `done_under` (a record's attachment) stands on the
/// claim's grant `granted`: the same attachment, a record that names none (made where
/// no ControllerPublish is needed, or before grants named their attachment), or a
/// claim never `revoked`. The controller changes a claim's grant only by withdrawing
/// it (which sets `revoked`, for good); another attachment on a claim never revoked
/// means the store lost the one the node acted under (an older etcd snapshot
/// restored), while the volume stayed attached to this node: what the node did
/// stands, and is not torn down.
pub fn same_grant(done_under: Option<&str>, granted: Option<&str>, revoked: bool) -> bool {
    done_under.is_none() || done_under == granted || !revoked
}

/// Whether what a record did (under attachment `attachment`, with publish_context
/// `context`) stands on `claim`'s current grant: the same grant ([`same_grant`])
/// with the same publish_context, where the record kept it. A volume published again
/// with another context (the survey re-publishes one detached behind moor's back) is
/// staged and published again with it, as a withdrawn grant's work is redone.
pub fn on_grant(attachment: Option<&str>, context: Option<&StrMap>, claim: &Claim) -> bool {
    same_grant(
        attachment,
        claim
            .spec
            .attachment
            .as_ref()
            .map(Uid::to_string)
            .as_deref(),
        claim.spec.revoked,
    ) && context.is_none_or(|c| *c == claim.spec.publish_context)
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
        let mut journal = match Journal::<LocalState>::open(&path, true) {
            Ok(j) => j,
            // A later version's journal is valid, and not this build's to read.
            Err(e @ moor::journal::JournalError::Newer { .. }) => return Err(e.into()),
            Err(e) => {
                return Err(anyhow::Error::new(e).context(format!(
                    "{} is not a valid agent state; {advice}",
                    path.display()
                )))
            }
        };
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
                && p.steps.owed()
                && p.staging_path.as_deref().map(Path::as_os_str) == Some(staging)
                && k != except
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(staging: &str, step: Step, released: bool) -> PublishRecord {
        let mut steps = ClaimSteps::default();
        steps.set(LEGACY_STEP, step);
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
            steps,
            released,
            expanded_bytes: None,
            attachment: None,
            publish_context: None,
            made_for: None,
            orphaned: None,
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
        assert_eq!(
            again.publishes["claims/n/default/c"].steps.get(LEGACY_STEP),
            Step::Done
        );

        std::fs::write(dir.path().join(LEGACY_FILE), b"{not json").unwrap();
        let e = format!("{:#}", LocalState::load(dir.path()).unwrap_err());
        assert!(e.contains("state.json is not a valid agent state"), "{e}");
    }

    /// A journal line of an agent before 0.3 (its publish record's `step`) reads as
    /// that step by name; this version writes the map, and only steps not `Absent`.
    #[test]
    fn a_publish_record_of_an_agent_before_0_3_reads_its_step_by_name() {
        let mut old = serde_json::to_value(record("/s", Step::Done, false)).unwrap();
        let fields = old.as_object_mut().unwrap();
        fields.remove("steps");
        fields.insert("step".into(), serde_json::json!("uncertain"));
        let line = serde_json::json!([["publishes", "claims/n/default/c", old]]);
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(FILE), format!("{line}\n")).unwrap();
        let j = LocalState::load(dir.path()).unwrap();
        let rec = &j.publishes["claims/n/default/c"];
        assert_eq!(rec.steps.get(LEGACY_STEP), Step::Uncertain);
        assert!(rec.steps.owed());
        let written = serde_json::to_value(rec).unwrap();
        assert_eq!(
            written["steps"],
            serde_json::json!({LEGACY_STEP: "uncertain"})
        );
        assert!(written.get("step").is_none(), "{written}");
        // An absent step is not written, and reads back as absent.
        let mut absent = rec.clone();
        absent.steps.set(LEGACY_STEP, Step::Absent);
        let back: PublishRecord =
            serde_json::from_value(serde_json::to_value(&absent).unwrap()).unwrap();
        assert_eq!(back.steps, ClaimSteps::default());
        // The old form with nothing done reads as nothing done.
        let mut none = serde_json::to_value(&absent).unwrap();
        none.as_object_mut().unwrap().remove("steps");
        none["step"] = serde_json::json!("absent");
        let back: PublishRecord = serde_json::from_value(none).unwrap();
        assert!(!back.steps.owed());
    }

    #[test]
    fn an_orphan_reads_its_mode_from_the_record_or_else_from_its_target_path() {
        let mut r = record("/s", Step::Done, false);
        r.target_path = PathBuf::from("/m/per-alloc/default/a/v/rw-file-system-single-node-writer");
        let o = r.orphan(Timestamp::now()).unwrap();
        assert_eq!(o.mode, ClaimMode::Write);
        assert_eq!(
            o.capability,
            VolumeCapability {
                attachment_mode: AttachmentMode::FileSystem,
                access_mode: AccessMode::SingleNodeWriter
            }
        );
        assert_eq!(o.request, None);
        r.target_path =
            PathBuf::from("/m/per-alloc/default/a/v/ro-block-device-multi-node-reader-only");
        let o = r.orphan(Timestamp::now()).unwrap();
        assert_eq!(o.mode, ClaimMode::Read);
        assert_eq!(o.capability.attachment_mode, AttachmentMode::BlockDevice);
        assert_eq!(o.capability.access_mode, AccessMode::MultiNodeReaderOnly);
        r.target_path = PathBuf::from("/m/elsewhere");
        assert!(r.orphan(Timestamp::now()).is_none());
        // Recorded: taken as is, the request with it.
        r.made_for = Some(MadeFor {
            request: Name::new("data").unwrap(),
            mode: ClaimMode::Read,
            capability: VolumeCapability {
                attachment_mode: AttachmentMode::FileSystem,
                access_mode: AccessMode::MultiNodeMultiWriter,
            },
        });
        let o = r.orphan(Timestamp::now()).unwrap();
        assert_eq!(o.request.as_ref().map(|n| n.as_str()), Some("data"));
        assert_eq!(o.capability.access_mode, AccessMode::MultiNodeMultiWriter);
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
