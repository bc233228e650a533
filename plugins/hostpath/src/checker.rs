//! The invariant checker: given the call logs of one or more plugin instances, report
//! every invariant of moor's design that the calls break.
//!
//! A call's outcome is *done* (OK), *maybe* (Cancelled, DeadlineExceeded, Unavailable,
//! Unknown, Internal, DataLoss: it may have taken effect) or *failed* (refused:
//! ResourceExhausted and Aborted, worth retrying; any other code, final). Checked, in
//! log order (merged by end time):
//! 1. a single-node volume is never controller- or node-published on two nodes at once;
//!    single-writer modes never have two read-write publishes;
//! 2. NodeStage only after ControllerPublish succeeded to that node (when required);
//!    NodePublish only after NodeStage succeeded on its staging path (when required);
//! 3. NodeUnstage only after every NodePublish from that staging path is unpublished;
//!    ControllerUnpublish only after that node's stages and publishes are gone;
//! 4. nothing leaks: at the end, every done or maybe publish/stage was reversed (when the
//!    test expects everything released);
//! 5. a reverse is never called for a step whose every attempt failed with a final error;
//! 6. volume ids are ones the plugin handed out (or registered ones), node ids are CSI
//!    node ids: a moor id sent where the plugin's belongs is caught; a volume is not
//!    used after a DeleteVolume of it succeeded;
//! 7. nothing leaks in the plugin: at the end, every volume CreateVolume handed out was
//!    deleted (when the test expects every volume deleted).
//!
//! A node an operator declared gone (`moorctl volume detach`, or a node collected
//! after `--node-gc-timeout`) is *forced* at that time. The declaration covers only
//! what it allows: the attachments, stages and publishes the node held *before* it no
//! longer hold the volume from then on (invariants 1 and 3 skip them, and the node may
//! reverse them later, even on a deleted volume), since moor was told to act without
//! it. Everything the node does after the declaration (a NodeStage when it returns, a
//! stage made then) is checked in full. A declaration without a time excuses every
//! entry of the node at every time (the coarse form, for logs whose times are unknown).

use std::collections::{BTreeMap, BTreeSet};

use crate::calllog::Call;

/// What the checker needs to know beyond the log.
#[derive(Debug, Clone, Default)]
pub struct CheckConfig {
    /// The plugin advertises PUBLISH_UNPUBLISH_VOLUME.
    pub controller_publish_required: bool,
    /// The plugin advertises STAGE_UNSTAGE_VOLUME.
    pub stage_required: bool,
    /// Every claim was released by the end: anything still attached, staged or
    /// published is a leak.
    pub expect_released: bool,
    /// Volume ids registered (not created through this log).
    pub known_volume_ids: BTreeSet<String>,
    /// CSI node ids besides the `plugin_node` of the logs.
    pub known_node_ids: BTreeSet<String>,
    /// Every volume was deleted by the end: a volume handed out and never deleted is a
    /// leak (invariant 7).
    pub expect_deleted: bool,
    /// CSI node ids declared gone during the run, each with the times (RFC 3339, as
    /// the call log writes them) it was declared gone at; an empty time is the coarse
    /// form (see the module docs).
    pub forced_nodes: BTreeMap<String, Vec<String>>,
}

/// One broken invariant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// Which invariant (numbered as in this module's docs).
    pub invariant: u8,
    /// The call's position in the merged log.
    pub index: usize,
    /// What happened.
    pub message: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "invariant {} at call {}: {}",
            self.invariant, self.index, self.message
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Done,
    Maybe,
    Failed { final_error: bool },
}

fn outcome(call: &Call) -> Outcome {
    match call.code.as_str() {
        "OK" => Outcome::Done,
        // As moor classifies answers: these may have taken effect (a plugin dying
        // mid-call answers Unavailable, Internal or Unknown).
        "Cancelled" | "DeadlineExceeded" | "Unavailable" | "Unknown" | "Internal" | "DataLoss" => {
            Outcome::Maybe
        }
        // The plugin refused: no effect, but worth trying again.
        "ResourceExhausted" | "Aborted" => Outcome::Failed { final_error: false },
        _ => Outcome::Failed { final_error: true },
    }
}

fn single_node(mode: Option<&str>) -> bool {
    mode.is_some_and(|m| m.starts_with("SINGLE_NODE"))
}

fn single_writer(mode: Option<&str>) -> bool {
    matches!(
        mode,
        Some("SINGLE_NODE_WRITER" | "MULTI_NODE_SINGLE_WRITER" | "SINGLE_NODE_SINGLE_WRITER")
    )
}

/// Merges the logs of several plugin instances by end time.
pub fn merge(logs: impl IntoIterator<Item = Vec<Call>>) -> Vec<Call> {
    let mut all: Vec<Call> = logs.into_iter().flatten().collect();
    all.sort_by(|a, b| a.time.cmp(&b.time));
    all
}

#[derive(Debug, Clone)]
struct Publish {
    staging: Option<String>,
    readonly: bool,
}

/// An attachment, stage or publish held: how far it got and when it was first made
/// (the time of its first call that may have taken effect).
#[derive(Debug, Clone)]
struct Held {
    outcome: Outcome,
    since: String,
}

impl Held {
    fn new(outcome: Outcome, since: &str) -> Held {
        Held {
            outcome,
            since: since.to_string(),
        }
    }

    /// Records another attempt's outcome (a Done one makes it Done).
    fn again(&mut self, outcome: Outcome) {
        if outcome == Outcome::Done {
            self.outcome = Outcome::Done;
        }
    }
}

type Key3 = (String, String, String);
type Attempts = BTreeMap<(String, Key3), Vec<Outcome>>;

/// Invariant 5: `what` reverses a `fwd` step whose every attempt failed, one of them
/// with a final error.
fn never_took_effect(
    v: &mut Vec<Violation>,
    attempts: &Attempts,
    i: usize,
    fwd: &str,
    key: Key3,
    what: &str,
) {
    if let Some(outs) = attempts.get(&(fwd.to_string(), key)) {
        let took = outs
            .iter()
            .any(|o| matches!(o, Outcome::Done | Outcome::Maybe));
        if !took
            && outs
                .iter()
                .any(|o| matches!(o, Outcome::Failed { final_error: true }))
        {
            v.push(Violation {
                invariant: 5,
                index: i,
                message: format!(
                    "{what} reverses a {fwd} that failed with a final error and never took effect"
                ),
            });
        }
    }
}

/// Checks a merged log.
pub fn check(calls: &[Call], cfg: &CheckConfig) -> Vec<Violation> {
    let mut v = Vec::new();
    let mut attached: BTreeMap<(String, String), Held> = BTreeMap::new();
    let mut staged: BTreeMap<Key3, Held> = BTreeMap::new();
    let mut published: BTreeMap<Key3, (Held, Publish)> = BTreeMap::new();
    // Forward step → outcomes of its attempts (for invariant 5).
    let mut attempts: Attempts = BTreeMap::new();
    let mut volume_ids = cfg.known_volume_ids.clone();
    let mut node_ids = cfg.known_node_ids.clone();
    node_ids.extend(calls.iter().map(|c| c.plugin_node.clone()));
    // Volumes handed out and not deleted yet; volumes deleted.
    let mut created: BTreeSet<String> = BTreeSet::new();
    let mut deleted: BTreeSet<String> = BTreeSet::new();
    // Whether node `n`'s entry made at `since` is excused at `now`: a declaration came
    // after it was made and by `now`.
    let excused = |n: &str, since: &str, now: &str| {
        cfg.forced_nodes.get(n).is_some_and(|ts| {
            ts.iter()
                .any(|t| t.is_empty() || (since < t.as_str() && t.as_str() <= now))
        })
    };
    // Whether node `n` was declared gone by `now` (its reverse calls of what it held
    // then are what the declaration allows).
    let declared = |n: &str, now: &str| {
        cfg.forced_nodes
            .get(n)
            .is_some_and(|ts| ts.iter().any(|t| t.as_str() <= now))
    };
    let s = |o: &Option<String>| o.clone().unwrap_or_default();

    for (i, c) in calls.iter().enumerate() {
        let out = outcome(c);
        let acted = matches!(out, Outcome::Done | Outcome::Maybe);
        let vol = s(&c.volume_id);
        let node = c.plugin_node.clone();
        if c.rpc == "CreateVolume" {
            if let Some(id) = &c.result_volume_id {
                volume_ids.insert(id.clone());
                created.insert(id.clone());
                deleted.remove(id);
            }
            continue;
        }
        if c.rpc == "DeleteVolume" {
            let in_use = attached
                .iter()
                .find(|((av, an), h)| *av == vol && !excused(an, &h.since, &c.time))
                .map(|((_, n), _)| n.clone())
                .or_else(|| {
                    staged
                        .iter()
                        .chain(published.iter().map(|(k, (h, _))| (k, h)))
                        .find(|((n, sv, _), h)| *sv == vol && !excused(n, &h.since, &c.time))
                        .map(|((n, _, _), _)| n.clone())
                });
            if let (Some(n), true) = (in_use, acted) {
                v.push(Violation {
                    invariant: 3,
                    index: i,
                    message: format!(
                        "DeleteVolume of {vol} while still attached, staged or published on {n}"
                    ),
                });
            }
            if c.code == "OK" || c.code == "NotFound" {
                created.remove(&vol);
                deleted.insert(vol);
            }
            continue;
        }
        let uses_volume = c.rpc.starts_with("Controller") || c.rpc.starts_with("Node");
        if uses_volume
            && !vol.is_empty()
            && c.rpc != "ControllerGetCapabilities"
            && !volume_ids.contains(&vol)
        {
            v.push(Violation {
                invariant: 6,
                index: i,
                message: format!(
                    "{} names volume {vol:?}, which the plugin never handed out",
                    c.rpc
                ),
            });
        }
        let reverse = matches!(
            c.rpc.as_str(),
            "NodeUnpublishVolume" | "NodeUnstageVolume" | "ControllerUnpublishVolume"
        );
        if uses_volume && deleted.contains(&vol) && !(reverse && declared(&node, &c.time)) {
            v.push(Violation {
                invariant: 6,
                index: i,
                message: format!("{} of volume {vol} after it was deleted", c.rpc),
            });
        }
        match c.rpc.as_str() {
            "ControllerPublishVolume" => {
                let target = s(&c.node_id);
                if !node_ids.contains(&target) {
                    v.push(Violation {
                        invariant: 6,
                        index: i,
                        message: format!(
                            "ControllerPublishVolume names node {target:?}, not a CSI node id"
                        ),
                    });
                }
                if acted && single_node(c.access_mode.as_deref()) {
                    if let Some(((_, other), _)) = attached.iter().find(|((av, an), h)| {
                        *av == vol && *an != target && !excused(an, &h.since, &c.time)
                    }) {
                        v.push(Violation {
                            invariant: 1,
                            index: i,
                            message: format!("single-node volume {vol} published to {target} while attached to {other}"),
                        });
                    }
                }
                attempts
                    .entry((c.rpc.clone(), (vol.clone(), target.clone(), String::new())))
                    .or_default()
                    .push(out);
                if acted {
                    attached
                        .entry((vol, target))
                        .or_insert_with(|| Held::new(out, &c.time))
                        .again(out);
                }
            }
            "ControllerUnpublishVolume" => {
                let target = s(&c.node_id);
                let nodes: Vec<String> = if target.is_empty() {
                    attached
                        .keys()
                        .filter(|(av, _)| *av == vol)
                        .map(|(_, n)| n.clone())
                        .collect()
                } else {
                    vec![target.clone()]
                };
                for n in &nodes {
                    let held = |(hn, hv, _): &Key3, h: &Held| {
                        hn == n && *hv == vol && !excused(n, &h.since, &c.time)
                    };
                    let busy = staged.iter().any(|(k, h)| held(k, h))
                        || published.iter().any(|(k, (h, _))| held(k, h));
                    if busy {
                        v.push(Violation {
                            invariant: 3,
                            index: i,
                            message: format!("ControllerUnpublish of {vol} from {n} while still staged or published there"),
                        });
                    }
                    never_took_effect(
                        &mut v,
                        &attempts,
                        i,
                        "ControllerPublishVolume",
                        (vol.clone(), n.clone(), String::new()),
                        "ControllerUnpublishVolume",
                    );
                }
                if out == Outcome::Done {
                    for n in nodes {
                        attached.remove(&(vol.clone(), n));
                    }
                }
            }
            "NodeStageVolume" => {
                let path = s(&c.staging_target_path);
                if cfg.controller_publish_required
                    && attached
                        .get(&(vol.clone(), node.clone()))
                        .map(|h| h.outcome)
                        != Some(Outcome::Done)
                {
                    v.push(Violation {
                        invariant: 2,
                        index: i,
                        message: format!(
                            "NodeStage of {vol} on {node} before ControllerPublish succeeded there"
                        ),
                    });
                }
                let key = (node, vol, path);
                attempts
                    .entry((c.rpc.clone(), key.clone()))
                    .or_default()
                    .push(out);
                if acted {
                    staged
                        .entry(key)
                        .or_insert_with(|| Held::new(out, &c.time))
                        .again(out);
                }
            }
            "NodeUnstageVolume" => {
                let path = s(&c.staging_target_path);
                if let Some(((_, _, target), _)) = published.iter().find(|((pn, pv, _), (_, p))| {
                    *pn == node && *pv == vol && p.staging.as_deref() == Some(path.as_str())
                }) {
                    v.push(Violation {
                        invariant: 3,
                        index: i,
                        message: format!(
                            "NodeUnstage of {path} while {target} is still published from it"
                        ),
                    });
                }
                let key = (node, vol, path);
                never_took_effect(
                    &mut v,
                    &attempts,
                    i,
                    "NodeStageVolume",
                    key.clone(),
                    "NodeUnstageVolume",
                );
                if out == Outcome::Done {
                    staged.remove(&key);
                }
            }
            "NodePublishVolume" => {
                let target = s(&c.target_path);
                let staging = c.staging_target_path.clone();
                if cfg.stage_required {
                    let key = (
                        node.clone(),
                        vol.clone(),
                        staging.clone().unwrap_or_default(),
                    );
                    if staged.get(&key).map(|h| h.outcome) != Some(Outcome::Done) {
                        v.push(Violation {
                            invariant: 2,
                            index: i,
                            message: format!(
                                "NodePublish of {vol} on {node} before NodeStage succeeded at {:?}",
                                staging
                            ),
                        });
                    }
                } else if cfg.controller_publish_required
                    && attached
                        .get(&(vol.clone(), node.clone()))
                        .map(|h| h.outcome)
                        != Some(Outcome::Done)
                {
                    v.push(Violation {
                        invariant: 2,
                        index: i,
                        message: format!("NodePublish of {vol} on {node} before ControllerPublish succeeded there"),
                    });
                }
                let readonly = c.readonly.unwrap_or(false);
                if acted {
                    if single_node(c.access_mode.as_deref()) {
                        if let Some(((other, _, _), _)) =
                            published.iter().find(|((pn, pv, _), (h, _))| {
                                *pv == vol && *pn != node && !excused(pn, &h.since, &c.time)
                            })
                        {
                            v.push(Violation {
                                invariant: 1,
                                index: i,
                                message: format!("single-node volume {vol} published on {node} while published on {other}"),
                            });
                        }
                    }
                    if !readonly && single_writer(c.access_mode.as_deref()) {
                        if let Some(((on, _, other), _)) =
                            published.iter().find(|((pn, pv, pt), (h, p))| {
                                *pv == vol
                                    && !p.readonly
                                    && !excused(pn, &h.since, &c.time)
                                    && (*pn != node || *pt != target)
                            })
                        {
                            v.push(Violation {
                                invariant: 1,
                                index: i,
                                message: format!("second writer of {vol} at {target} while {other} on {on} writes"),
                            });
                        }
                    }
                }
                let key = (node, vol, target);
                attempts
                    .entry((c.rpc.clone(), key.clone()))
                    .or_default()
                    .push(out);
                if acted {
                    published
                        .entry(key)
                        .or_insert_with(|| (Held::new(out, &c.time), Publish { staging, readonly }))
                        .0
                        .again(out);
                }
            }
            "NodeUnpublishVolume" => {
                let key = (node, vol, s(&c.target_path));
                never_took_effect(
                    &mut v,
                    &attempts,
                    i,
                    "NodePublishVolume",
                    key.clone(),
                    "NodeUnpublishVolume",
                );
                if out == Outcome::Done {
                    published.remove(&key);
                }
            }
            _ => {}
        }
    }
    if cfg.expect_released {
        let end = calls.len();
        for ((vol, node), h) in &attached {
            let o = h.outcome;
            v.push(Violation {
                invariant: 4,
                index: end,
                message: format!("{vol} still attached to {node} ({o:?})"),
            });
        }
        for ((node, vol, path), h) in &staged {
            let o = h.outcome;
            v.push(Violation {
                invariant: 4,
                index: end,
                message: format!("{vol} still staged at {path} on {node} ({o:?})"),
            });
        }
        for ((node, vol, path), (h, _)) in &published {
            let o = h.outcome;
            v.push(Violation {
                invariant: 4,
                index: end,
                message: format!("{vol} still published at {path} on {node} ({o:?})"),
            });
        }
    }
    if cfg.expect_deleted {
        for vol in &created {
            v.push(Violation {
                invariant: 7,
                index: calls.len(),
                message: format!("volume {vol} was created and never deleted"),
            });
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Log {
        calls: Vec<Call>,
    }

    /// The time of the call at `index` in a test log.
    fn at(index: usize) -> String {
        format!("2026-01-01T00:{:02}:{:02}.000Z", index / 60, index % 60)
    }

    impl Log {
        fn new() -> Log {
            let mut l = Log { calls: Vec::new() };
            l.calls.push(Call {
                rpc: "CreateVolume".into(),
                plugin_node: "ctl".into(),
                result_volume_id: Some("vol-1".into()),
                code: "OK".into(),
                ..Default::default()
            });
            l
        }
        fn call(mut self, rpc: &str, node: &str, code: &str, f: impl FnOnce(&mut Call)) -> Log {
            let mut c = Call {
                rpc: rpc.into(),
                plugin_node: node.into(),
                volume_id: Some("vol-1".into()),
                code: code.into(),
                access_mode: Some("SINGLE_NODE_WRITER".into()),
                ..Default::default()
            };
            // Each call a second after the one before, so declarations can fall
            // between them.
            c.time = at(self.calls.len());
            f(&mut c);
            self.calls.push(c);
            self
        }
        fn attach(self, node: &str, code: &str) -> Log {
            let n = node.to_string();
            self.call("ControllerPublishVolume", "ctl", code, |c| {
                c.node_id = Some(n)
            })
        }
        fn detach(self, node: &str) -> Log {
            let n = node.to_string();
            self.call("ControllerUnpublishVolume", "ctl", "OK", |c| {
                c.node_id = Some(n)
            })
        }
        fn stage(self, node: &str, code: &str) -> Log {
            self.call("NodeStageVolume", node, code, |c| {
                c.staging_target_path = Some("/s".into())
            })
        }
        fn unstage(self, node: &str) -> Log {
            self.call("NodeUnstageVolume", node, "OK", |c| {
                c.staging_target_path = Some("/s".into())
            })
        }
        fn publish(self, node: &str, target: &str, ro: bool) -> Log {
            let t = target.to_string();
            self.call("NodePublishVolume", node, "OK", |c| {
                c.staging_target_path = Some("/s".into());
                c.target_path = Some(t);
                c.readonly = Some(ro);
            })
        }
        fn unpublish(self, node: &str, target: &str) -> Log {
            let t = target.to_string();
            self.call("NodeUnpublishVolume", node, "OK", |c| {
                c.target_path = Some(t)
            })
        }
        fn delete(self) -> Log {
            self.call("DeleteVolume", "ctl", "OK", |_| {})
        }
        fn check(&self) -> Vec<u8> {
            let cfg = CheckConfig {
                controller_publish_required: true,
                stage_required: true,
                expect_released: true,
                ..Default::default()
            };
            check(&self.calls, &cfg)
                .iter()
                .map(|v| v.invariant)
                .collect()
        }
    }

    fn full_cycle() -> Log {
        Log::new()
            .attach("n1", "OK")
            .stage("n1", "OK")
            .publish("n1", "/t1", false)
            .publish("n1", "/t2", true)
            .unpublish("n1", "/t1")
            .unpublish("n1", "/t2")
            .unstage("n1")
            .detach("n1")
    }

    #[test]
    fn a_correct_lifecycle_passes() {
        assert_eq!(full_cycle().check(), Vec::<u8>::new());
    }

    #[test]
    fn invariant_1_two_nodes_or_two_writers() {
        let two_nodes = Log::new().attach("n1", "OK").attach("n2", "OK");
        assert!(two_nodes.check().contains(&1));
        let two_writers = Log::new()
            .attach("n1", "OK")
            .stage("n1", "OK")
            .publish("n1", "/t1", false)
            .publish("n1", "/t2", false);
        assert!(two_writers.check().contains(&1));
    }

    #[test]
    fn invariant_2_out_of_order_forward_steps() {
        assert!(Log::new().stage("n1", "OK").check().contains(&2));
        assert!(Log::new()
            .attach("n1", "OK")
            .publish("n1", "/t", false)
            .check()
            .contains(&2));
        // A stage that only maybe happened does not license a publish.
        assert!(Log::new()
            .attach("n1", "OK")
            .stage("n1", "DeadlineExceeded")
            .publish("n1", "/t", false)
            .check()
            .contains(&2));
    }

    #[test]
    fn invariant_3_early_reverse_steps() {
        let early_unstage = Log::new()
            .attach("n1", "OK")
            .stage("n1", "OK")
            .publish("n1", "/t", false)
            .unstage("n1");
        assert!(early_unstage.check().contains(&3));
        let early_detach = Log::new().attach("n1", "OK").stage("n1", "OK").detach("n1");
        assert!(early_detach.check().contains(&3));
    }

    #[test]
    fn invariant_4_leaks_including_uncertain_steps() {
        let leak = Log::new()
            .attach("n1", "OK")
            .stage("n1", "OK")
            .publish("n1", "/t", false);
        assert_eq!(leak.check().iter().filter(|i| **i == 4).count(), 3);
        // A stage that hit its deadline must still be unstaged.
        let maybe = Log::new()
            .attach("n1", "OK")
            .stage("n1", "DeadlineExceeded")
            .detach("n1");
        let got = maybe.check();
        assert!(got.contains(&4), "{got:?}");
        let mended = Log::new()
            .attach("n1", "OK")
            .stage("n1", "DeadlineExceeded")
            .unstage("n1")
            .detach("n1");
        assert_eq!(mended.check(), Vec::<u8>::new());
    }

    #[test]
    fn invariant_5_reverse_after_a_final_error() {
        let bad = Log::new()
            .attach("n1", "OK")
            .stage("n1", "InvalidArgument")
            .unstage("n1")
            .detach("n1");
        assert!(bad.check().contains(&5));
        let transient = Log::new()
            .attach("n1", "OK")
            .stage("n1", "Unavailable")
            .unstage("n1")
            .detach("n1");
        assert!(!transient.check().contains(&5));
    }

    #[test]
    fn invariant_6_moor_ids_where_plugin_ids_belong() {
        let wrong_volume = Log::new().call("ControllerPublishVolume", "ctl", "OK", |c| {
            c.volume_id = Some("db-data".into());
            c.node_id = Some("n1".into());
        });
        assert!(wrong_volume.check().contains(&6));
        let wrong_node = Log::new().stage("n1", "Unavailable").call(
            "ControllerPublishVolume",
            "ctl",
            "OK",
            |c| c.node_id = Some("moor-node-name".into()),
        );
        assert!(wrong_node.check().contains(&6));
    }

    fn check_with(log: &Log, f: impl FnOnce(&mut CheckConfig)) -> Vec<u8> {
        let mut cfg = CheckConfig {
            controller_publish_required: true,
            stage_required: true,
            expect_released: true,
            ..Default::default()
        };
        f(&mut cfg);
        check(&log.calls, &cfg)
            .iter()
            .map(|v| v.invariant)
            .collect()
    }

    #[test]
    fn invariant_7_and_6_volumes_deleted_once_and_not_used_after() {
        let kept = full_cycle();
        assert!(check_with(&kept, |c| c.expect_deleted = true).contains(&7));
        assert!(!check_with(&kept, |_| {}).contains(&7));
        let deleted = full_cycle().delete();
        assert_eq!(
            check_with(&deleted, |c| c.expect_deleted = true),
            Vec::<u8>::new()
        );
        let used_after = full_cycle().delete().attach("n1", "OK");
        assert!(check_with(&used_after, |c| c.expect_released = false).contains(&6));
        let deleted_in_use = Log::new().attach("n1", "OK").stage("n1", "OK").delete();
        assert!(check_with(&deleted_in_use, |c| c.expect_released = false).contains(&3));
    }

    #[test]
    fn a_forced_node_no_longer_holds_the_volume() {
        // n1 is declared gone while it has the volume published; the volume is
        // detached from it and attached to n2; n1 cleans up when it comes back.
        let log = Log::new()
            .attach("n1", "OK")
            .stage("n1", "OK")
            .publish("n1", "/t1", false)
            .detach("n1")
            .attach("n2", "OK")
            .stage("n2", "OK")
            .publish("n2", "/t2", false)
            .unpublish("n1", "/t1")
            .unstage("n1")
            .unpublish("n2", "/t2")
            .unstage("n2")
            .detach("n2");
        let strict = check_with(&log, |_| {});
        assert!(strict.contains(&1) && strict.contains(&3), "{strict:?}");
        let coarse = check_with(&log, |c| {
            c.forced_nodes.insert("n1".into(), vec![String::new()]);
        });
        assert_eq!(coarse, Vec::<u8>::new());
        // Declared gone just before the detach (call 4): what n1 held is excused.
        let forced = check_with(&log, |c| {
            c.forced_nodes.insert("n1".into(), vec![at(4)]);
        });
        assert_eq!(forced, Vec::<u8>::new());
        // Declared gone only after all of it: nothing excused.
        let late = check_with(&log, |c| {
            c.forced_nodes
                .insert("n1".into(), vec!["9999-01-01T00:00:00.000Z".into()]);
        });
        assert_eq!(late, strict);
    }

    #[test]
    fn a_forced_node_that_returns_is_checked_in_full() {
        // n1 is declared gone (call 4) and its volume force-detached; when it returns
        // it cleans up (excused) and then stages again before any new ControllerPublish:
        // the declaration does not cover that.
        let log = Log::new()
            .attach("n1", "OK")
            .stage("n1", "OK")
            .publish("n1", "/t1", false)
            .detach("n1")
            .unpublish("n1", "/t1")
            .unstage("n1")
            .stage("n1", "FailedPrecondition")
            .attach("n1", "OK")
            .stage("n1", "OK")
            .publish("n1", "/t2", true)
            .unpublish("n1", "/t2")
            .unstage("n1")
            .detach("n1");
        let v = check_with(&log, |c| {
            c.forced_nodes.insert("n1".into(), vec![at(4)]);
        });
        assert_eq!(v, vec![2], "{v:?}");
        // What it staged after the declaration holds the volume: a force-detach that
        // is not declared again finds it staged.
        let log = Log::new()
            .attach("n1", "OK")
            .detach("n1")
            .attach("n1", "OK")
            .stage("n1", "OK")
            .detach("n1")
            .unstage("n1");
        let v = check_with(&log, |c| {
            c.forced_nodes.insert("n1".into(), vec![at(2)]);
        });
        assert_eq!(v, vec![3], "{v:?}");
        // Declared again before that detach: excused.
        let v = check_with(&log, |c| {
            c.forced_nodes.insert("n1".into(), vec![at(2), at(5)]);
        });
        assert_eq!(v, Vec::<u8>::new(), "{v:?}");
    }

    #[test]
    fn logs_merge_by_time() {
        let a = vec![Call {
            time: "2026-01-01T00:00:02.000Z".into(),
            rpc: "B".into(),
            ..Default::default()
        }];
        let b = vec![Call {
            time: "2026-01-01T00:00:01.000Z".into(),
            rpc: "A".into(),
            ..Default::default()
        }];
        let m = merge([a, b]);
        assert_eq!(
            m.iter().map(|c| c.rpc.as_str()).collect::<Vec<_>>(),
            ["A", "B"]
        );
    }
}
