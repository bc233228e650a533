//! What the node owes a claim, decided from facts alone: the claim's desired state and
//! the agent's local records of what it did ([`read`]). A pass over a claim key starts
//! from [`pass`] (the claim's record settled when the store lost or replaced its claim,
//! then a release, a publish or a withdrawal); a publish pass settles what a withdrawn
//! grant left ([`earlier_grant`], [`earlier_stage`]) and then carries out the ordered
//! list of [`Action`]s [`publish_pass`] gives; a release, the reverse steps
//! [`to_release`] gives; [`after`] says what a failed pass asks of the controller loop;
//! and [`measurable`] says whether the stats loop may look. No I/O here: publish.rs and
//! release.rs carry the lists out in order, each in one exhaustive match, each call
//! through the step runner and behind its checkpoint.

use super::super::state::{on_grant, LocalState, PublishRecord, Step};
use super::super::step_error::StepError;
use super::NodeError;
use moor::api::Claim;

/// NodeStageVolume: its gate's name and its failures' step (its record is the staging
/// path's, shared by the claims staged there).
pub const STAGE: &str = "NodeStageVolume";
/// NodePublishVolume: also the key of its record among the claim's steps.
pub const PUBLISH: &str = "NodePublishVolume";
/// NodeExpandVolume.
pub const EXPAND: &str = "NodeExpandVolume";
/// NodeUnpublishVolume.
pub const UNPUBLISH: &str = "NodeUnpublishVolume";
/// NodeUnstageVolume.
pub const UNSTAGE: &str = "NodeUnstageVolume";

/// What a pass does with a claim key, from the claim the store holds (if any) and the
/// claim's record in the journal (if any).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Pass<'a> {
    /// Neither a claim nor a record: its Mount, if one is left, is deleted.
    Nothing,
    /// A record whose claim the store no longer holds: settled as [`missing`] decides
    /// (torn down and forgotten, or kept as an orphan), then its Mount deleted.
    Gone(&'a PublishRecord),
    /// A record of another claim of the same name (another uid): settled as
    /// [`missing`] decides, then the claim's own pass.
    Replaced(&'a PublishRecord, &'a Claim, Wanted),
    /// The claim's own pass.
    Claim(&'a Claim, Wanted),
    /// The claim is granted but its record says it was released for good: a claim is
    /// never published again (a re-run makes a new claim; only an older snapshot
    /// restored shows a released claim granted), so nothing is done and nothing said.
    ReleasedForGood,
}

/// What the claim wants of the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wanted {
    /// Released or being deleted: torn down, the release acknowledged on the Mount.
    Release,
    /// Granted (`spec.publish`): staged and published.
    Publish,
    /// Not granted yet, or its grant withdrawn: what an earlier grant did is torn down
    /// and forgotten.
    Withdrawn,
}

/// Decides [`Pass`].
pub fn pass<'a>(claim: Option<&'a Claim>, rec: Option<&'a PublishRecord>) -> Pass<'a> {
    let Some(claim) = claim else {
        return match rec {
            Some(rec) => Pass::Gone(rec),
            None => Pass::Nothing,
        };
    };
    let wanted = if claim.spec.release || claim.is_deleting() {
        Wanted::Release
    } else if claim.spec.publish {
        Wanted::Publish
    } else {
        Wanted::Withdrawn
    };
    match rec {
        Some(rec) if rec.claim_uid != claim.metadata.uid => Pass::Replaced(rec, claim, wanted),
        Some(rec) if rec.released && wanted == Wanted::Publish => Pass::ReleasedForGood,
        _ => Pass::Claim(claim, wanted),
    }
}

/// What a pass that failed asks of the controller loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum After {
    /// The journal could not record a step (so it was not taken): said on the Mount and
    /// as a Warning, counted, and retried on the key's backoff.
    JournalFailed,
    /// Not a failure: wait for the plugin's fingerprint (every change of it triggers
    /// every claim) or the node's next registration (which wakes every claim).
    AwaitChange,
    /// A step's gate is closed: recorded when it failed; its schedule says when.
    Gated(std::time::Duration),
    /// A CSI call failed: retried when the failed step's own schedule allows.
    StepSchedule,
    /// Anything else: retried on the key's backoff.
    Backoff,
}

/// Decides [`After`] for a pass's error (every case named: a new one must be placed).
pub fn after(e: &NodeError) -> After {
    match e {
        NodeError::State(_) => After::JournalFailed,
        NodeError::PluginNotReady(_) | NodeError::NotRegistered => After::AwaitChange,
        NodeError::Step(StepError::BackingOff(b)) => After::Gated(b.after),
        NodeError::Step(StepError::Csi(_)) => After::StepSchedule,
        NodeError::Step(
            StepError::Store(_)
            | StepError::NoChannel(_)
            | StepError::Sealed(_)
            | StepError::MissingSecret(_),
        )
        | NodeError::UnknownPlugin(_)
        | NodeError::Incomplete(_)
        | NodeError::StagingBusy(_)
        | NodeError::WorkloadLeft { .. }
        | NodeError::NameHeldByOrphan { .. }
        | NodeError::VolumeHeldByOrphan { .. }
        | NodeError::Io { .. } => After::Backoff,
    }
}

/// A forward step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forward {
    /// NodeStageVolume to the volume's staging path.
    Stage,
    /// NodePublishVolume to the allocation's target path.
    Publish,
}

/// A reverse step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reverse {
    /// NodeUnpublishVolume of the target path.
    Unpublish,
    /// NodeUnstageVolume of the staging path.
    Unstage,
    /// Drop the staging path's record without a call: its NodeStage never took effect.
    ForgetStage,
}

/// What the local state says about one claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Facts {
    /// The claim's publish record: how far NodePublish got (`Absent` when none).
    pub published: Step,
    /// The claim's record says it was released (its teardown is done for good).
    pub released: bool,
    /// The claim goes through a staging path (the plugin stages).
    pub stages: bool,
    /// The staging path's record, if any.
    pub staged: Option<Step>,
    /// Another unreleased claim may be published from the same staging path.
    pub staging_shared: bool,
    /// The claim's publish record was made under the grant the claim holds now (the
    /// same attachment); false when the attachment it stood on was force-detached and
    /// the claim was granted again on a new one.
    pub publish_current: bool,
    /// Likewise for the staging path's record.
    pub stage_current: bool,
}

/// Whether the stats loop may read a published volume's usage (NodeGetVolumeStats): only
/// for a claim that is granted now, not being released, the same claim the record was
/// made for (`same_claim`), on the grant the record was made under (`on_grant`). What
/// a node did under a grant since withdrawn or released is not its to look at: the
/// volume may have been force-detached, or even deleted (found by the long chaos runs,
/// seed 1015: a returning node read the usage of a deleted volume it still had a
/// record of, before tearing that record down).
pub fn measurable(claim: &moor::api::Claim, same_claim: bool, on_grant: bool) -> bool {
    same_claim && on_grant && claim.spec.publish && !claim.spec.release && !claim.is_deleting()
}

/// Reads [`Facts`] from the local state: the claim's record `rec` (under `key`) and
/// its staging path's record. With the claim (`Some`), whether each record stands on
/// the grant the claim holds now; without it (a teardown, which reverses whatever was
/// done under any grant), both count as current. Who else uses the staging path is
/// looked up only where it decides something: for a teardown, and for a stage of an
/// earlier grant (the scan of the node's records stays off the common path).
pub fn read(local: &LocalState, key: &str, rec: &PublishRecord, claim: Option<&Claim>) -> Facts {
    let stage = rec.staging_path.as_ref().and_then(|p| local.stages.get(p));
    let (publish_current, stage_current) = match claim {
        Some(claim) => (
            on_grant(
                rec.attachment.as_deref(),
                rec.publish_context.as_ref(),
                claim,
            ),
            stage.is_none_or(|st| {
                on_grant(st.attachment.as_deref(), st.publish_context.as_ref(), claim)
            }),
        ),
        None => (true, true),
    };
    let staging_shared = (claim.is_none() || !stage_current)
        && rec
            .staging_path
            .as_ref()
            .is_some_and(|p| local.staging_in_use(p, key));
    Facts {
        published: rec.steps.get(PUBLISH),
        released: rec.released,
        stages: rec.staging_path.is_some(),
        staged: stage.map(|st| st.step),
        staging_shared,
        publish_current,
        stage_current,
    }
}

/// Whether the claim's record stands on the grant the claim holds now; if not, what
/// became of what it did. The node acts only on the current grant, never on what it
/// did under a grant since withdrawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Earlier {
    /// The record stands (or is released, for good): plan the pass on it.
    Stands,
    /// Made under an earlier grant and took no effect: forget it, start from nothing.
    Forget,
    /// Made under an earlier grant, on a device since detached, and may have taken
    /// effect: tear it down ([`to_release`]), forget it, start from nothing.
    TearDown,
}

/// Decides [`Earlier`].
pub fn earlier_grant(f: &Facts) -> Earlier {
    if f.released || f.publish_current {
        Earlier::Stands
    } else if f.published.needs_reverse() {
        Earlier::TearDown
    } else {
        Earlier::Forget
    }
}

/// What the node does with a record whose claim desired state no longer holds as the
/// record knew it (the claim is missing, or stored under another uid).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Missing {
    /// The claim was deleted (or nothing of it is on the node): tear down what the
    /// record holds and forget it, as for a release.
    Deleted,
    /// Nothing says the claim was deleted: keep the mount and report it
    /// ([`moor::api::Orphan`]) until an operator adopts or releases it.
    Orphan,
}

/// Decides [`Missing`] from the record's facts and whether the store holds this
/// node's own Mount of that very claim (`mount_of_claim`: same claim uid, not an
/// orphan report). Desired state never loses a claim the node acted on: a released
/// claim is deleted only after the node's Mount acknowledged its teardown, and a
/// force-detached one stays (revoked) until the node, back, has torn it down. So a
/// claim gone while its Mount stays was deleted after the node acted (by an operator,
/// or an older version): torn down. A claim gone with its Mount was never known to the
/// store as it is now: an older snapshot was restored, and the mount is a live
/// workload's that the restored state does not know (Nomad's "ghost volumes" after a
/// state rebuild).
///
/// A record already found an orphan (`orphan`) stays one until an operator's command
/// settles it, whatever Mount is stored meanwhile.
pub fn missing(f: &Facts, mount_of_claim: bool, orphan: bool) -> Missing {
    let holds = f.published.needs_reverse() || f.staged.is_some_and(Step::needs_reverse);
    if orphan && !f.released && holds {
        return Missing::Orphan;
    }
    if f.released || !holds || mount_of_claim {
        Missing::Deleted
    } else {
        Missing::Orphan
    }
}

/// Whether a granted claim takes over an orphaned record (`rec`) without a CSI call:
/// it would publish exactly what the record holds (the same plugin's volume at the
/// same target path, through the same staging path), so doing it again is doing
/// nothing. The target path names the allocation, the volume and the mode.
pub fn adopts(
    rec: &PublishRecord,
    claim: &Claim,
    target_path: &std::path::Path,
    staging_path: Option<&std::path::Path>,
) -> bool {
    rec.orphaned.is_some()
        && !rec.released
        && claim.spec.publish
        && !claim.spec.release
        && !claim.is_deleting()
        && claim.spec.plugin_id == rec.plugin_id
        && claim.spec.external_id.as_ref() == Some(&rec.external_id)
        && rec.target_path == target_path
        && rec.staging_path.as_deref() == staging_path
}

/// What becomes of the claim's staging path when it was staged under a grant since
/// withdrawn (the device it was staged from was detached), before anything of the
/// current grant is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EarlierStage {
    /// Staged under the current grant, never staged, or it took no effect: nothing.
    Stands,
    /// Nobody else uses it: NodeUnstage it (and forget it) before staging again.
    Unstage,
    /// Another claim is still published from it: the pass ends here, until that claim
    /// is torn down (it stands on the same earlier grant, so it will be).
    Wait,
}

/// Decides [`EarlierStage`].
pub fn earlier_stage(f: &Facts) -> EarlierStage {
    if !(f.stages && !f.stage_current && f.staged.is_some_and(Step::needs_reverse)) {
        EarlierStage::Stands
    } else if f.staging_shared {
        EarlierStage::Wait
    } else {
        EarlierStage::Unstage
    }
}

/// One action of a publish pass on the current grant, in the order [`publish_pass`]
/// lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Nothing is owed (adopted from an earlier run, or done): the record is mirrored
    /// on the Mount.
    Adopt,
    /// Before the first forward call: the node's force-detach declarations, read fresh;
    /// the pass ends here if they cover the claim (a node back after an operator
    /// declared it gone must not act on a grant made before).
    Confirm,
    /// NodeStageVolume.
    Stage,
    /// NodeExpandVolume of the staged volume, right before NodePublish (offline).
    ExpandStaged(u64),
    /// NodePublishVolume.
    Publish,
    /// NodeExpandVolume of the published volume (online): the pass's only step.
    ExpandPublished(u64),
}

/// The publish pass of a claim whose record stands on its current grant
/// ([`earlier_grant`]) and whose staging path does too, or was unstaged
/// ([`earlier_stage`]): either [`Action::Adopt`] or the declarations' check followed by
/// the forward steps owed, with the expansion where [`expansion`] puts it. A released
/// record never gets here ([`Pass::ReleasedForGood`]).
pub fn publish_pass(f: &Facts, e: &Expansion) -> Vec<Action> {
    let mut f = *f;
    if !f.stage_current {
        // Unstaged now, or never took effect: staged again from nothing.
        f.staged = None;
    }
    let steps = to_publish(&f);
    let expand = expansion(e, &steps);
    if steps.is_empty() && expand == Expand::No {
        return vec![Action::Adopt];
    }
    let mut actions = Vec::with_capacity(4);
    actions.push(Action::Confirm);
    for step in steps {
        match (step, expand) {
            (Forward::Stage, _) => actions.push(Action::Stage),
            (Forward::Publish, Expand::BeforePublish(bytes)) => {
                actions.extend([Action::ExpandStaged(bytes), Action::Publish])
            }
            (Forward::Publish, Expand::No | Expand::Published(_)) => actions.push(Action::Publish),
        }
    }
    if let Expand::Published(bytes) = expand {
        actions.push(Action::ExpandPublished(bytes));
    }
    actions
}

/// The forward steps still owed to publish the claim, in order. A released record
/// stays released: that claim is never published again (a re-run makes a new claim).
pub fn to_publish(f: &Facts) -> Vec<Forward> {
    if f.released || f.published == Step::Done {
        return Vec::new();
    }
    let mut steps = Vec::with_capacity(2);
    if f.stages && f.staged != Some(Step::Done) {
        steps.push(Forward::Stage);
    }
    steps.push(Forward::Publish);
    steps
}

/// The reverse steps owed to release the claim, in order: NodeUnpublish when it may
/// be published; then, unless another claim still uses the staging path, NodeUnstage
/// when it may be staged (or just forgetting a stage that never took effect).
pub fn to_release(f: &Facts) -> Vec<Reverse> {
    if f.released {
        return Vec::new();
    }
    let mut steps = Vec::with_capacity(2);
    if f.published.needs_reverse() {
        steps.push(Reverse::Unpublish);
    }
    if f.stages && !f.staging_shared {
        match f.staged {
            Some(s) if s.needs_reverse() => steps.push(Reverse::Unstage),
            Some(_) => steps.push(Reverse::ForgetStage),
            None => {}
        }
    }
    steps
}

/// What decides NodeExpandVolume for a claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expansion {
    /// The capacity the controller asks the nodes to expand to (the claim's
    /// `node_expansion_bytes`).
    pub asked: Option<u64>,
    /// What this node expanded the claim's volume to (its publish record).
    pub expanded: Option<u64>,
    /// The plugin's node service advertises EXPAND_VOLUME.
    pub node_expands: bool,
    /// The plugin expands only offline (the volume not published).
    pub offline_only: bool,
    /// The claim goes through a staging path.
    pub stages: bool,
}

/// When NodeExpandVolume runs in this pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expand {
    /// Not now.
    No,
    /// On the published volume, to this many bytes (online).
    Published(u64),
    /// On the staged volume, right before NodePublish, to this many bytes (offline).
    BeforePublish(u64),
}

/// Decides [`Expand`] given the forward steps still owed ([`to_publish`]): owed when
/// the controller asks for more than this node expanded to and the plugin's node
/// service can expand; online on a published volume (no step owed) unless the plugin
/// expands only offline, else on the staged volume right before the next NodePublish.
/// A plugin that does not stage is expanded once published, online.
pub fn expansion(e: &Expansion, steps: &[Forward]) -> Expand {
    let Some(bytes) = e.asked.filter(|b| e.expanded < Some(*b)) else {
        return Expand::No;
    };
    if !e.node_expands {
        return Expand::No;
    }
    if steps.is_empty() {
        return if e.offline_only {
            Expand::No
        } else {
            Expand::Published(bytes)
        };
    }
    if e.stages && steps.contains(&Forward::Publish) {
        Expand::BeforePublish(bytes)
    } else {
        Expand::No
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh() -> Facts {
        Facts {
            published: Step::Absent,
            released: false,
            stages: true,
            staged: None,
            staging_shared: false,
            publish_current: true,
            stage_current: true,
        }
    }

    #[test]
    fn a_fresh_claim_is_staged_then_published() {
        assert_eq!(to_publish(&fresh()), [Forward::Stage, Forward::Publish]);
        let no_stage = Facts {
            stages: false,
            ..fresh()
        };
        assert_eq!(to_publish(&no_stage), [Forward::Publish]);
    }

    #[test]
    fn a_staging_path_staged_by_another_claim_is_not_staged_again() {
        let f = Facts {
            staged: Some(Step::Done),
            ..fresh()
        };
        assert_eq!(to_publish(&f), [Forward::Publish]);
    }

    #[test]
    fn uncertain_steps_are_tried_again_and_done_ones_are_not() {
        let f = Facts {
            staged: Some(Step::Uncertain),
            ..fresh()
        };
        assert_eq!(to_publish(&f), [Forward::Stage, Forward::Publish]);
        let f = Facts {
            staged: Some(Step::Done),
            published: Step::Uncertain,
            ..fresh()
        };
        assert_eq!(to_publish(&f), [Forward::Publish]);
        let f = Facts {
            staged: Some(Step::Done),
            published: Step::Done,
            ..fresh()
        };
        assert_eq!(to_publish(&f), []);
    }

    #[test]
    fn a_released_claim_is_neither_published_nor_torn_down_again() {
        let f = Facts {
            released: true,
            ..fresh()
        };
        assert_eq!(to_publish(&f), []);
        assert_eq!(to_release(&f), []);
    }

    #[test]
    fn release_reverses_what_may_have_taken_effect_in_reverse_order() {
        let f = Facts {
            staged: Some(Step::Done),
            published: Step::Done,
            ..fresh()
        };
        assert_eq!(to_release(&f), [Reverse::Unpublish, Reverse::Unstage]);
        let uncertain = Facts {
            staged: Some(Step::Uncertain),
            published: Step::Uncertain,
            ..fresh()
        };
        assert_eq!(
            to_release(&uncertain),
            [Reverse::Unpublish, Reverse::Unstage]
        );
    }

    #[test]
    fn nothing_is_reversed_that_never_took_effect() {
        // NodePublish failed with a final answer (the record went back to Absent);
        // the stage record's NodeStage was refused for good.
        let f = Facts {
            staged: Some(Step::Absent),
            published: Step::Absent,
            ..fresh()
        };
        assert_eq!(to_release(&f), [Reverse::ForgetStage]);
        assert_eq!(to_release(&fresh()), []);
    }

    #[test]
    fn a_missing_claim_s_mount_is_kept_unless_the_store_knew_the_claim_after_the_node_acted() {
        let live = Facts {
            staged: Some(Step::Done),
            published: Step::Done,
            ..fresh()
        };
        // Restored from before the claim: neither the claim nor its Mount.
        assert_eq!(missing(&live, false, false), Missing::Orphan);
        // An uncertain step may hold a mount as well.
        for (staged, published) in [
            (Some(Step::Uncertain), Step::Absent),
            (None, Step::Uncertain),
        ] {
            let f = Facts {
                staged,
                published,
                ..fresh()
            };
            assert_eq!(missing(&f, false, false), Missing::Orphan);
        }
        // The node's own Mount of that claim is stored: deleted after the node acted.
        assert_eq!(missing(&live, true, false), Missing::Deleted);
        // Once an orphan, always one until settled (its Mount write may have failed).
        assert_eq!(missing(&live, true, true), Missing::Orphan);
        // Nothing held (released for good, or nothing took effect): only forgotten.
        let released = Facts {
            released: true,
            ..live
        };
        assert_eq!(missing(&released, false, true), Missing::Deleted);
        let nothing = Facts {
            staged: Some(Step::Absent),
            ..fresh()
        };
        assert_eq!(missing(&nothing, false, false), Missing::Deleted);
    }

    #[test]
    fn only_a_granted_claim_that_makes_the_same_mount_adopts_an_orphan() {
        use crate::agent::state::PublishRecord;
        use moor::api::*;
        use std::path::{Path, PathBuf};
        let rec = PublishRecord {
            staging_path: Some(PathBuf::from("/s")),
            attachment: Some("att-1".into()),
            orphaned: Some(Timestamp::now()),
            ..record("old", false)
        };
        let mut claim = Claim::new(
            &Namespace::default_ns(),
            Name::new("a.v").unwrap(),
            ClaimSpec {
                plugin_id: PluginId::new("p").unwrap(),
                external_id: Some(ExternalVolumeId::new("e").unwrap()),
                publish: true,
                attachment: Some("att-2".into()),
                ..Default::default()
            },
        );
        let (t, s) = (Path::new("/t"), Some(Path::new("/s")));
        assert!(adopts(&rec, &claim, t, s));
        assert!(
            !adopts(&rec, &claim, Path::new("/other"), s),
            "another target path"
        );
        assert!(
            !adopts(&rec, &claim, t, None),
            "not through the same staging path"
        );
        let not_orphan = PublishRecord {
            orphaned: None,
            ..rec.clone()
        };
        assert!(!adopts(&not_orphan, &claim, t, s), "a record not orphaned");
        claim.spec.external_id = Some(ExternalVolumeId::new("other").unwrap());
        assert!(!adopts(&rec, &claim, t, s), "another volume");
        claim.spec.external_id = Some(ExternalVolumeId::new("e").unwrap());
        claim.spec.publish = false;
        assert!(!adopts(&rec, &claim, t, s), "not granted yet");
        claim.spec.publish = true;
        claim.spec.release = true;
        assert!(!adopts(&rec, &claim, t, s), "released");
    }

    /// Nothing asked of the node's expansion.
    fn no_expansion() -> Expansion {
        Expansion {
            asked: None,
            expanded: None,
            node_expands: true,
            offline_only: false,
            stages: true,
        }
    }

    #[test]
    fn what_was_done_under_the_current_grant_stands() {
        let f = Facts {
            staged: Some(Step::Done),
            published: Step::Done,
            ..fresh()
        };
        assert_eq!(earlier_grant(&f), Earlier::Stands);
        assert_eq!(publish_pass(&f, &no_expansion()), [Action::Adopt]);
        assert_eq!(
            publish_pass(&fresh(), &no_expansion()),
            [Action::Confirm, Action::Stage, Action::Publish]
        );
    }

    #[test]
    fn a_publish_under_a_withdrawn_grant_is_torn_down_first() {
        for published in [Step::Done, Step::Uncertain] {
            let f = Facts {
                staged: Some(Step::Done),
                published,
                publish_current: false,
                stage_current: false,
                ..fresh()
            };
            assert_eq!(earlier_grant(&f), Earlier::TearDown);
            // The teardown reverses both, in order.
            assert_eq!(to_release(&f), [Reverse::Unpublish, Reverse::Unstage]);
        }
        // A record of an earlier grant that never took effect is only forgotten.
        let f = Facts {
            publish_current: false,
            ..fresh()
        };
        assert_eq!(earlier_grant(&f), Earlier::Forget);
    }

    #[test]
    fn a_staging_path_staged_under_a_withdrawn_grant_is_unstaged_before_staging_again() {
        for staged in [Step::Done, Step::Uncertain] {
            let f = Facts {
                staged: Some(staged),
                stage_current: false,
                ..fresh()
            };
            assert_eq!(earlier_stage(&f), EarlierStage::Unstage);
            assert_eq!(
                publish_pass(&f, &no_expansion()),
                [Action::Confirm, Action::Stage, Action::Publish]
            );
            let shared = Facts {
                staging_shared: true,
                ..f
            };
            assert_eq!(earlier_stage(&shared), EarlierStage::Wait);
        }
        // A stage of an earlier grant that never took effect is just staged again.
        let f = Facts {
            staged: Some(Step::Absent),
            stage_current: false,
            ..fresh()
        };
        assert_eq!(earlier_stage(&f), EarlierStage::Stands);
        assert_eq!(
            publish_pass(&f, &no_expansion()),
            [Action::Confirm, Action::Stage, Action::Publish]
        );
        // The current grant's stage, or none at all, stands.
        assert_eq!(earlier_stage(&fresh()), EarlierStage::Stands);
        let current = Facts {
            staged: Some(Step::Done),
            ..fresh()
        };
        assert_eq!(earlier_stage(&current), EarlierStage::Stands);
    }

    #[test]
    fn a_released_record_stands_and_owes_nothing() {
        let f = Facts {
            released: true,
            published: Step::Done,
            publish_current: false,
            ..fresh()
        };
        assert_eq!(earlier_grant(&f), Earlier::Stands);
        assert_eq!(to_publish(&f), []);
        assert_eq!(to_release(&f), []);
    }

    fn claim(uid: &str, edit: impl FnOnce(&mut moor::api::ClaimSpec)) -> Claim {
        use moor::api::*;
        let mut spec = ClaimSpec::default();
        edit(&mut spec);
        let mut c = Claim::new(&Namespace::default_ns(), Name::new("a.v").unwrap(), spec);
        c.metadata.uid = Uid::new(uid);
        c
    }

    fn record(uid: &str, released: bool) -> PublishRecord {
        use moor::api::*;
        PublishRecord {
            claim_uid: uid.into(),
            namespace: Namespace::default_ns(),
            claim: Name::new("a.v").unwrap(),
            allocation: AllocationId::new("a").unwrap(),
            volume: VolumeId::new("v").unwrap(),
            plugin_id: PluginId::new("p").unwrap(),
            external_id: ExternalVolumeId::new("e").unwrap(),
            staging_path: None,
            target_path: std::path::PathBuf::from("/t"),
            steps: Default::default(),
            released,
            expanded_bytes: None,
            attachment: None,
            publish_context: None,
            made_for: None,
            orphaned: None,
        }
    }

    /// A record of an agent before 0.3 held NodePublish's step alone: it reads as the
    /// step the plan calls [`PUBLISH`], so what that agent published is owed its reverse.
    #[test]
    fn an_older_agent_s_publish_step_is_the_plan_s_publish() {
        use crate::agent::state::ClaimSteps;
        let old: ClaimSteps = serde_json::from_value(serde_json::json!("uncertain")).unwrap();
        let mut rec = record("u1", false);
        rec.steps = old;
        let f = read(&LocalState::default(), "k", &rec, None);
        assert_eq!(f.published, Step::Uncertain);
        assert_eq!(to_release(&f), [Reverse::Unpublish]);
    }

    /// The top-level decision: what the store holds against what the journal holds.
    #[test]
    fn a_pass_is_decided_by_the_claim_and_its_record() {
        let (mine, released) = (record("u1", false), record("u1", true));
        assert_eq!(pass(None, None), Pass::Nothing);
        assert_eq!(pass(None, Some(&mine)), Pass::Gone(&mine));
        let granted = claim("u1", |s| s.publish = true);
        let releasing = claim("u1", |s| {
            s.publish = true;
            s.release = true
        });
        let mut deleting = claim("u1", |s| s.publish = true);
        deleting.metadata.deletion_timestamp = Some(moor::api::Timestamp::now());
        let waiting = claim("u1", |_| {});
        for (c, wanted) in [
            (&granted, Wanted::Publish),
            (&releasing, Wanted::Release),
            (&deleting, Wanted::Release),
            (&waiting, Wanted::Withdrawn),
        ] {
            assert_eq!(pass(Some(c), None), Pass::Claim(c, wanted), "{c:?}");
            assert_eq!(pass(Some(c), Some(&mine)), Pass::Claim(c, wanted), "{c:?}");
            let other = claim("u2", |s| s.clone_from(&c.spec));
            let other = Claim {
                metadata: moor::api::ObjectMeta {
                    uid: other.metadata.uid,
                    ..c.metadata.clone()
                },
                ..other
            };
            assert_eq!(
                pass(Some(&other), Some(&mine)),
                Pass::Replaced(&mine, &other, wanted)
            );
        }
        // Released for good: never published again, still released and withdrawn.
        assert_eq!(pass(Some(&granted), Some(&released)), Pass::ReleasedForGood);
        assert_eq!(
            pass(Some(&releasing), Some(&released)),
            Pass::Claim(&releasing, Wanted::Release)
        );
        assert_eq!(
            pass(Some(&waiting), Some(&released)),
            Pass::Claim(&waiting, Wanted::Withdrawn)
        );
    }

    #[test]
    fn a_failed_pass_waits_on_what_can_end_it() {
        use moor::csi::policy::CsiError;
        let gate = moor::runtime::steps::BackingOff {
            step: STAGE,
            after: std::time::Duration::from_secs(3),
        };
        assert_eq!(
            after(&NodeError::Step(StepError::BackingOff(gate))),
            After::Gated(std::time::Duration::from_secs(3))
        );
        let csi = CsiError {
            rpc: PUBLISH,
            code: tonic::Code::Internal,
            message: "boom".into(),
            tries: 1,
        };
        assert_eq!(
            after(&NodeError::Step(StepError::Csi(csi))),
            After::StepSchedule
        );
        assert_eq!(after(&NodeError::NotRegistered), After::AwaitChange);
        let id = moor::api::PluginId::new("p").unwrap();
        assert_eq!(after(&NodeError::PluginNotReady(id)), After::AwaitChange);
        let io = std::io::Error::other("full");
        let journal = moor::journal::JournalError::Io {
            path: "/j".into(),
            source: io,
        };
        assert_eq!(after(&NodeError::State(journal)), After::JournalFailed);
        assert_eq!(after(&NodeError::StagingBusy("/s".into())), After::Backoff);
    }

    /// What an action leaves in the local state when it answers OK.
    fn apply(f: &mut Facts, e: &mut Expansion, action: Action) {
        match action {
            Action::Stage => {
                f.staged = Some(Step::Done);
                f.stage_current = true;
            }
            Action::Publish => f.published = Step::Done,
            Action::ExpandStaged(b) | Action::ExpandPublished(b) => e.expanded = Some(b),
            Action::Adopt | Action::Confirm => {}
        }
    }

    /// Every state a record on its current grant can be in, with every expansion.
    fn every_state() -> Vec<(Facts, Expansion)> {
        let steps = [
            None,
            Some(Step::Absent),
            Some(Step::Uncertain),
            Some(Step::Done),
        ];
        let mut all = Vec::new();
        for published in [Step::Absent, Step::Uncertain, Step::Done] {
            for staged in steps {
                for stages in [true, false] {
                    for stage_current in [true, false] {
                        for staging_shared in [true, false] {
                            for (asked, offline_only, node_expands) in [
                                (None, false, true),
                                (Some(1 << 30), false, true),
                                (Some(1 << 30), true, true),
                                (Some(1 << 30), false, false),
                            ] {
                                let f = Facts {
                                    published,
                                    released: false,
                                    stages,
                                    staged: if stages { staged } else { None },
                                    staging_shared,
                                    publish_current: true,
                                    stage_current,
                                };
                                let e = Expansion {
                                    asked,
                                    expanded: None,
                                    node_expands,
                                    offline_only,
                                    stages,
                                };
                                all.push((f, e));
                            }
                        }
                    }
                }
            }
        }
        all
    }

    /// The orders the spec cares about, from every state: nothing forward before the
    /// declarations are confirmed; NodeStage before NodePublish; an earlier grant's
    /// stage unstaged before the stage; an offline expansion between the stage and the
    /// publish, an online one only of a published volume; and a pass whose actions all
    /// answer OK leaves nothing owed (the next pass only adopts), unless it waits.
    #[test]
    fn every_state_s_pass_is_in_order_and_leaves_nothing_owed() {
        for (f0, e0) in every_state() {
            // What a withdrawn grant's stage needs comes first.
            let mut f = f0;
            match earlier_stage(&f0) {
                EarlierStage::Wait => {
                    assert!(f0.staging_shared && !f0.stage_current, "{f0:?}");
                    continue;
                }
                EarlierStage::Unstage => {
                    assert!(f0.staged.is_some_and(Step::needs_reverse), "{f0:?}");
                    f.staged = None;
                    f.stage_current = true;
                }
                EarlierStage::Stands => {}
            }
            let actions = publish_pass(&f0, &e0);
            let at = |a: Action| actions.iter().position(|x| *x == a);
            let forward = actions.iter().position(|a| {
                matches!(
                    a,
                    Action::Stage
                        | Action::Publish
                        | Action::ExpandStaged(_)
                        | Action::ExpandPublished(_)
                )
            });
            if let Some(first) = forward {
                assert!(
                    at(Action::Confirm).is_some_and(|c| c < first),
                    "{f0:?}: {actions:?}"
                );
            }
            if let (Some(stage), Some(publish)) = (at(Action::Stage), at(Action::Publish)) {
                assert!(stage < publish, "{f0:?}: {actions:?}");
            }
            if f0.stages && f0.staged != Some(Step::Done) && f0.published != Step::Done {
                assert!(at(Action::Stage).is_some(), "{f0:?}: {actions:?}");
            }
            for (i, a) in actions.iter().enumerate() {
                if let Action::ExpandStaged(_) = a {
                    assert_eq!(
                        actions.get(i + 1),
                        Some(&Action::Publish),
                        "{f0:?}: {actions:?}"
                    )
                }
                if let Action::ExpandPublished(_) = a {
                    assert!(!e0.offline_only, "{f0:?}: {actions:?}");
                    assert_eq!(f0.published, Step::Done, "{f0:?}: {actions:?}");
                }
            }
            let mut e = e0;
            for a in actions.iter().copied() {
                apply(&mut f, &mut e, a);
            }
            // Taken: the stale stage is no longer anyone's (its other claims were torn
            // down); what remains is only ever adopted.
            f.staging_shared = false;
            assert_eq!(earlier_stage(&f), EarlierStage::Stands, "{f0:?}");
            let next = publish_pass(&f, &e);
            // A plugin that does not stage is expanded once published, online: in the
            // pass after the one that published.
            let online_later = !f0.stages
                && f0.published != Step::Done
                && e.asked.is_some()
                && e.node_expands
                && !e.offline_only;
            if online_later {
                assert_eq!(
                    next,
                    [Action::Confirm, Action::ExpandPublished(1 << 30)],
                    "{f0:?} {e0:?}: {actions:?}"
                );
            } else {
                assert_eq!(next, [Action::Adopt], "{f0:?} {e0:?}: {actions:?}");
            }
            assert_eq!(f.published, Step::Done, "{f0:?}: {actions:?}");
        }
    }

    #[test]
    fn only_a_granted_claim_s_volume_is_measured() {
        use moor::api::*;
        let mut c = Claim::new(
            &Namespace::default_ns(),
            Name::new("a1.data").unwrap(),
            ClaimSpec {
                publish: true,
                ..Default::default()
            },
        );
        assert!(measurable(&c, true, true));
        // Another claim of that name, or a record of an earlier grant: not ours.
        assert!(!measurable(&c, false, true));
        assert!(!measurable(&c, true, false));
        // Being released (a force-detach may have skipped this node), or withdrawn.
        c.spec.release = true;
        assert!(!measurable(&c, true, true));
        c.spec.release = false;
        c.spec.publish = false;
        assert!(!measurable(&c, true, true));
    }

    #[test]
    fn a_staging_path_another_claim_uses_stays_staged() {
        let f = Facts {
            staged: Some(Step::Done),
            published: Step::Done,
            staging_shared: true,
            ..fresh()
        };
        assert_eq!(to_release(&f), [Reverse::Unpublish]);
    }

    fn asked(bytes: u64) -> Expansion {
        Expansion {
            asked: Some(bytes),
            expanded: None,
            node_expands: true,
            offline_only: false,
            stages: true,
        }
    }

    #[test]
    fn a_published_volume_is_expanded_online_once_per_capacity_asked() {
        let e = asked(2 << 30);
        assert_eq!(expansion(&e, &[]), Expand::Published(2 << 30));
        // Expanded to it already (or past it): nothing.
        let done = Expansion {
            expanded: Some(2 << 30),
            ..e
        };
        assert_eq!(expansion(&done, &[]), Expand::No);
        let more = Expansion {
            asked: Some(4 << 30),
            ..done
        };
        assert_eq!(expansion(&more, &[]), Expand::Published(4 << 30));
        // Nothing asked, or a node service that cannot expand: never.
        assert_eq!(expansion(&Expansion { asked: None, ..e }, &[]), Expand::No);
        let cannot = Expansion {
            node_expands: false,
            ..e
        };
        assert_eq!(expansion(&cannot, &[]), Expand::No);
        assert_eq!(expansion(&cannot, &[Forward::Publish]), Expand::No);
    }

    #[test]
    fn an_offline_expansion_waits_for_the_next_stage_before_publish() {
        let offline = Expansion {
            offline_only: true,
            ..asked(2 << 30)
        };
        assert_eq!(
            expansion(&offline, &[]),
            Expand::No,
            "published: not online"
        );
        assert_eq!(
            expansion(&offline, &[Forward::Stage, Forward::Publish]),
            Expand::BeforePublish(2 << 30)
        );
        assert_eq!(
            expansion(&offline, &[Forward::Publish]),
            Expand::BeforePublish(2 << 30)
        );
        // An online plugin being staged anew is expanded there too, before publish.
        assert_eq!(
            expansion(&asked(2 << 30), &[Forward::Publish]),
            Expand::BeforePublish(2 << 30)
        );
        // Without a staging path there is no volume to expand before publish.
        let unstaged = Expansion {
            stages: false,
            ..asked(2 << 30)
        };
        assert_eq!(expansion(&unstaged, &[Forward::Publish]), Expand::No);
        assert_eq!(expansion(&unstaged, &[]), Expand::Published(2 << 30));
    }
}
