//! What the node owes a claim, decided from facts alone: the claim's desired state and
//! the agent's local records of what it did. No I/O here; publish.rs and release.rs
//! run the steps in order, each behind its retry gate and its checkpoint.

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
    fn a_staging_path_another_claim_uses_stays_staged() {
        let f = Facts {
            staged: Some(Step::Done),
            published: Step::Done,
            staging_shared: true,
            ..fresh()
        };
        assert_eq!(to_release(&f), [Reverse::Unpublish]);
    }
}
