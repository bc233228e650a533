//! What the node owes a claim, decided from facts alone: the claim's desired state and
//! the agent's local records of what it did: the forward and reverse steps, what an
//! earlier grant left to tear down, when NodeExpandVolume runs, and whether the stats
//! loop may look. No I/O here; publish.rs and release.rs run the steps in order, each
//! through the step runner and behind its checkpoint.

use super::super::state::Step;

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

/// What a granted claim needs before its forward steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Before {
    /// Nothing: go on with [`to_publish`].
    Nothing,
    /// What the claim did was done under an earlier grant, on a device since detached:
    /// tear it down ([`to_release`]) and start again from nothing.
    TearDown,
    /// The staging path was staged under an earlier grant and nobody uses it: unstage
    /// it (and forget it) before staging again.
    Unstage,
    /// The staging path was staged under an earlier grant and another claim is still
    /// published from it: wait until that claim is torn down (it stands on the same
    /// earlier grant, so it will be).
    WaitForStaging,
}

/// Decides [`Before`]: the node acts only on the grant the claim holds now, never on
/// what it did under a grant since withdrawn.
pub fn before_publish(f: &Facts) -> Before {
    if f.released {
        return Before::Nothing;
    }
    if !f.publish_current && f.published.needs_reverse() {
        return Before::TearDown;
    }
    match f.staged {
        Some(s) if f.stages && !f.stage_current && s.needs_reverse() => {
            if f.staging_shared {
                Before::WaitForStaging
            } else {
                Before::Unstage
            }
        }
        _ => Before::Nothing,
    }
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
    fn what_was_done_under_the_current_grant_stands() {
        let f = Facts {
            staged: Some(Step::Done),
            published: Step::Done,
            ..fresh()
        };
        assert_eq!(before_publish(&f), Before::Nothing);
        assert_eq!(before_publish(&fresh()), Before::Nothing);
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
            assert_eq!(before_publish(&f), Before::TearDown);
            // The teardown reverses both, in order.
            assert_eq!(to_release(&f), [Reverse::Unpublish, Reverse::Unstage]);
        }
        // A record of an earlier grant that never took effect owes nothing.
        let f = Facts {
            publish_current: false,
            ..fresh()
        };
        assert_eq!(before_publish(&f), Before::Nothing);
    }

    #[test]
    fn a_staging_path_staged_under_a_withdrawn_grant_is_unstaged_before_staging_again() {
        for staged in [Step::Done, Step::Uncertain] {
            let f = Facts {
                staged: Some(staged),
                stage_current: false,
                ..fresh()
            };
            assert_eq!(before_publish(&f), Before::Unstage);
            let shared = Facts {
                staging_shared: true,
                ..f
            };
            assert_eq!(before_publish(&shared), Before::WaitForStaging);
        }
        // A stage of an earlier grant that never took effect is just staged again.
        let f = Facts {
            staged: Some(Step::Absent),
            stage_current: false,
            ..fresh()
        };
        assert_eq!(before_publish(&f), Before::Nothing);
    }

    #[test]
    fn a_released_claim_needs_nothing_before() {
        let f = Facts {
            released: true,
            published: Step::Done,
            publish_current: false,
            ..fresh()
        };
        assert_eq!(before_publish(&f), Before::Nothing);
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
