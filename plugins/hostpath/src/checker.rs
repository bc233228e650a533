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
//!    deleted (when the test expects every volume deleted);
//! 8. NodeExpandVolume only on a node that holds the volume (staged or published there,
//!    and not declared gone since);
//! 9. no two terms of one role act at once: of the calls that name their term (the
//!    `moor-term` header, `ROLE/REVISION/HOLDER`), none of a term was sent after a call
//!    of a later term of the same role was (by the `moor-sent` header; without it, by
//!    the start: end less duration, which a plugin that serves a call late delays).
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
    /// CSI node ids whose agent could not write its journal (a full disk), with the
    /// windows (RFC 3339 start and end): a forward step refused for good in such a
    /// window may still be recorded as uncertain (the agent could not record that
    /// nothing is owed), so its reverse is no breach of invariant 5.
    pub journal_unwritable: BTreeMap<String, Vec<(String, String)>>,
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

/// Whether the spec lets a volume published under `mode` be published at a second
/// target path on the node: the MULTI_NODE modes and SINGLE_NODE_MULTI_WRITER.
fn shares_a_node(mode: Option<&str>) -> bool {
    !single_node(mode) || mode == Some("SINGLE_NODE_MULTI_WRITER")
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
    mode: Option<String>,
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

/// Checks a merged log.
pub fn check(calls: &[Call], cfg: &CheckConfig) -> Vec<Violation> {
    let mut checker = Checker::new(calls, cfg);
    for (i, c) in calls.iter().enumerate() {
        checker.call(i, c);
    }
    let mut violations = checker.finish(calls.len());
    violations.extend(terms_overlap(calls));
    violations
}

/// A term label's role and revision (`ROLE/REVISION/HOLDER`).
fn role_and_revision(label: &str) -> Option<(&str, i64)> {
    let mut parts = label.splitn(3, '/');
    let role = parts.next()?;
    let revision = parts.next()?.parse().ok()?;
    Some((role, revision))
}

/// Invariant 9: per role, the calls in start order never go back to an earlier term.
fn terms_overlap(calls: &[Call]) -> Vec<Violation> {
    let mut started: Vec<(std::time::SystemTime, usize, &str, i64)> = calls
        .iter()
        .enumerate()
        .filter_map(|(i, c)| {
            let (role, revision) = role_and_revision(c.term.as_deref()?)?;
            let sent = match c.sent_ms {
                Some(ms) => std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms),
                None => {
                    let end = humantime::parse_rfc3339(&c.time).ok()?;
                    let took = std::time::Duration::from_secs_f64(c.duration_ms.max(0.0) / 1000.0);
                    end.checked_sub(took)?
                }
            };
            Some((sent, i, role, revision))
        })
        .collect();
    started.sort();
    let mut latest: BTreeMap<&str, (i64, usize)> = BTreeMap::new();
    let mut violations = Vec::new();
    for (_, i, role, revision) in started {
        match latest.get(role) {
            Some(&(later, first)) if later > revision => violations.push(Violation {
                invariant: 9,
                index: i,
                message: format!(
                    "{} of role {role}'s term {revision} was sent after a call of its later term {later} (call {first}) was",
                    calls[i].rpc
                ),
            }),
            Some(&(seen, _)) if seen == revision => {}
            _ => {
                latest.insert(role, (revision, i));
            }
        }
    }
    violations
}

/// What the log has done so far, as the checker replays it: one method per call it
/// follows, each checking the invariants that call can break.
struct Checker<'a> {
    cfg: &'a CheckConfig,
    violations: Vec<Violation>,
    /// (volume, node) → the attachment.
    attached: BTreeMap<(String, String), Held>,
    /// (node, volume, staging path) → the stage.
    staged: BTreeMap<Key3, Held>,
    /// (node, volume, target path) → the publish.
    published: BTreeMap<Key3, (Held, Publish)>,
    /// Forward step → outcomes of its attempts (for invariant 5).
    attempts: Attempts,
    volume_ids: BTreeSet<String>,
    node_ids: BTreeSet<String>,
    /// Volumes handed out and not deleted yet.
    created: BTreeSet<String>,
    /// Volumes deleted.
    deleted: BTreeSet<String>,
}

/// One call as the checker reads it.
struct At<'c> {
    index: usize,
    call: &'c Call,
    out: Outcome,
    /// It may have taken effect (done or maybe).
    acted: bool,
    vol: String,
    node: String,
}

fn text(o: &Option<String>) -> String {
    o.clone().unwrap_or_default()
}

impl<'a> Checker<'a> {
    fn new(calls: &[Call], cfg: &'a CheckConfig) -> Checker<'a> {
        let mut node_ids = cfg.known_node_ids.clone();
        node_ids.extend(calls.iter().map(|c| c.plugin_node.clone()));
        Checker {
            cfg,
            violations: Vec::new(),
            attached: BTreeMap::new(),
            staged: BTreeMap::new(),
            published: BTreeMap::new(),
            attempts: BTreeMap::new(),
            volume_ids: cfg.known_volume_ids.clone(),
            node_ids,
            created: BTreeSet::new(),
            deleted: BTreeSet::new(),
        }
    }

    fn violate(&mut self, invariant: u8, index: usize, message: String) {
        self.violations.push(Violation {
            invariant,
            index,
            message,
        });
    }

    /// Whether node `n`'s entry made at `since` is excused at `now`: a declaration
    /// came after it was made and by `now`.
    fn excused(&self, n: &str, since: &str, now: &str) -> bool {
        self.cfg.forced_nodes.get(n).is_some_and(|ts| {
            ts.iter()
                .any(|t| t.is_empty() || (since < t.as_str() && t.as_str() <= now))
        })
    }

    /// Whether node `n` was declared gone by `now` (its reverse calls of what it held
    /// then are what the declaration allows).
    fn declared(&self, n: &str, now: &str) -> bool {
        self.cfg
            .forced_nodes
            .get(n)
            .is_some_and(|ts| ts.iter().any(|t| t.as_str() <= now))
    }

    fn call(&mut self, index: usize, call: &Call) {
        let out = outcome(call);
        let at = At {
            index,
            call,
            out,
            acted: matches!(out, Outcome::Done | Outcome::Maybe),
            vol: text(&call.volume_id),
            node: call.plugin_node.clone(),
        };
        match call.rpc.as_str() {
            "CreateVolume" => return self.create_volume(&at),
            "DeleteVolume" => return self.delete_volume(&at),
            _ => {}
        }
        self.ids_are_the_plugin_s(&at);
        match call.rpc.as_str() {
            "ControllerPublishVolume" => self.controller_publish(&at),
            "ControllerUnpublishVolume" => self.controller_unpublish(&at),
            "NodeStageVolume" => self.node_stage(&at),
            "NodeUnstageVolume" => self.node_unstage(&at),
            "NodePublishVolume" => self.node_publish(&at),
            "NodeUnpublishVolume" => self.node_unpublish(&at),
            "NodeExpandVolume" => self.node_expand(&at),
            _ => {}
        }
    }

    /// Invariant 8: an expansion only where the node holds the volume.
    fn node_expand(&mut self, at: &At) {
        let now = at.call.time.as_str();
        let here = |n: &String, v: &String, h: &Held| {
            n == &at.node && v == &at.vol && !self.excused(n, &h.since, now)
        };
        let holds = self.staged.iter().any(|((n, v, _), h)| here(n, v, h))
            || self
                .published
                .iter()
                .any(|((n, v, _), (h, _))| here(n, v, h));
        if !holds {
            self.violate(
                8,
                at.index,
                format!(
                    "NodeExpandVolume of {} on {}, which holds it neither staged nor published",
                    at.vol, at.node
                ),
            );
        }
    }

    fn create_volume(&mut self, at: &At) {
        if let Some(id) = &at.call.result_volume_id {
            self.volume_ids.insert(id.clone());
            self.created.insert(id.clone());
            self.deleted.remove(id);
        }
    }

    /// Invariant 3: a volume is deleted only once nothing holds it (but what a node
    /// declared gone held).
    fn delete_volume(&mut self, at: &At) {
        let (vol, now) = (&at.vol, at.call.time.as_str());
        let in_use = self
            .attached
            .iter()
            .find(|((av, an), h)| av == vol && !self.excused(an, &h.since, now))
            .map(|((_, n), _)| n.clone())
            .or_else(|| {
                self.staged
                    .iter()
                    .chain(self.published.iter().map(|(k, (h, _))| (k, h)))
                    .find(|((n, sv, _), h)| sv == vol && !self.excused(n, &h.since, now))
                    .map(|((n, _, _), _)| n.clone())
            });
        if let (Some(n), true) = (in_use, at.acted) {
            self.violate(
                3,
                at.index,
                format!("DeleteVolume of {vol} while still attached, staged or published on {n}"),
            );
        }
        if at.call.code == "OK" || at.call.code == "NotFound" {
            self.created.remove(vol);
            self.deleted.insert(vol.clone());
        }
    }

    /// Invariant 6: a volume the plugin handed out (or registered), not one deleted
    /// (but a declared node's reverses of what it held).
    fn ids_are_the_plugin_s(&mut self, at: &At) {
        let rpc = at.call.rpc.as_str();
        let uses_volume = rpc.starts_with("Controller") || rpc.starts_with("Node");
        if !uses_volume {
            return;
        }
        let vol = &at.vol;
        if !vol.is_empty() && rpc != "ControllerGetCapabilities" && !self.volume_ids.contains(vol) {
            self.violate(
                6,
                at.index,
                format!("{rpc} names volume {vol:?}, which the plugin never handed out"),
            );
        }
        let reverse = matches!(
            rpc,
            "NodeUnpublishVolume" | "NodeUnstageVolume" | "ControllerUnpublishVolume"
        );
        if self.deleted.contains(vol) && !(reverse && self.declared(&at.node, &at.call.time)) {
            self.violate(
                6,
                at.index,
                format!("{rpc} of volume {vol} after it was deleted"),
            );
        }
    }

    /// Records an attempt of a forward step (for invariant 5). A final refusal while
    /// the node's journal could not be written counts as a maybe: the agent could not
    /// record that it took no effect.
    fn attempted(&mut self, at: &At, key: Key3) {
        let now = at.call.time.as_str();
        let unrecorded = self.cfg.journal_unwritable.get(&at.node).is_some_and(|ws| {
            ws.iter()
                .any(|(a, b)| a.as_str() <= now && now <= b.as_str())
        });
        let out = match at.out {
            Outcome::Failed { final_error: true } if unrecorded => Outcome::Maybe,
            o => o,
        };
        self.attempts
            .entry((at.call.rpc.clone(), key))
            .or_default()
            .push(out);
    }

    /// Invariant 5: `at` reverses a `fwd` step whose every attempt failed, one of them
    /// with a final error.
    fn never_took_effect(&mut self, at: &At, fwd: &str, key: Key3) {
        let Some(outs) = self.attempts.get(&(fwd.to_string(), key)) else {
            return;
        };
        let took = outs
            .iter()
            .any(|o| matches!(o, Outcome::Done | Outcome::Maybe));
        let refused = outs
            .iter()
            .any(|o| matches!(o, Outcome::Failed { final_error: true }));
        if !took && refused {
            let what = &at.call.rpc;
            self.violate(
                5,
                at.index,
                format!(
                    "{what} reverses a {fwd} that failed with a final error and never took effect"
                ),
            );
        }
    }

    /// Invariants 6 (a CSI node id) and 1 (a single-node volume attached to one node).
    fn controller_publish(&mut self, at: &At) {
        let (vol, target) = (at.vol.clone(), text(&at.call.node_id));
        if !self.node_ids.contains(&target) {
            self.violate(
                6,
                at.index,
                format!("ControllerPublishVolume names node {target:?}, not a CSI node id"),
            );
        }
        if at.acted && single_node(at.call.access_mode.as_deref()) {
            let other = self
                .attached
                .iter()
                .find(|((av, an), h)| {
                    *av == vol && *an != target && !self.excused(an, &h.since, &at.call.time)
                })
                .map(|((_, other), _)| other.clone());
            if let Some(other) = other {
                self.violate(
                    1,
                    at.index,
                    format!(
                        "single-node volume {vol} published to {target} while attached to {other}"
                    ),
                );
            }
        }
        self.attempted(at, (vol.clone(), target.clone(), String::new()));
        if at.acted {
            self.attached
                .entry((vol, target))
                .or_insert_with(|| Held::new(at.out, &at.call.time))
                .again(at.out);
        }
    }

    /// Invariants 3 (nothing staged or published on the node) and 5.
    fn controller_unpublish(&mut self, at: &At) {
        let (vol, target) = (&at.vol, text(&at.call.node_id));
        let nodes: Vec<String> = if target.is_empty() {
            self.attached
                .keys()
                .filter(|(av, _)| av == vol)
                .map(|(_, n)| n.clone())
                .collect()
        } else {
            vec![target]
        };
        for n in &nodes {
            let held = |(hn, hv, _): &Key3, h: &Held| {
                hn == n && hv == vol && !self.excused(n, &h.since, &at.call.time)
            };
            let busy = self.staged.iter().any(|(k, h)| held(k, h))
                || self.published.iter().any(|(k, (h, _))| held(k, h));
            if busy {
                self.violate(
                    3,
                    at.index,
                    format!("ControllerUnpublish of {vol} from {n} while still staged or published there"),
                );
            }
            let key = (vol.clone(), n.clone(), String::new());
            self.never_took_effect(at, "ControllerPublishVolume", key);
        }
        if at.out == Outcome::Done {
            for n in nodes {
                self.attached.remove(&(vol.clone(), n));
            }
        }
    }

    /// Whether ControllerPublish of `vol` to `node` succeeded (and still holds).
    fn attached_to(&self, vol: &str, node: &str) -> bool {
        self.attached
            .get(&(vol.to_string(), node.to_string()))
            .map(|h| h.outcome)
            == Some(Outcome::Done)
    }

    /// Invariant 2: after ControllerPublish succeeded to the node, when required.
    fn node_stage(&mut self, at: &At) {
        let (vol, node) = (&at.vol, &at.node);
        if self.cfg.controller_publish_required && !self.attached_to(vol, node) {
            self.violate(
                2,
                at.index,
                format!("NodeStage of {vol} on {node} before ControllerPublish succeeded there"),
            );
        }
        let key = (
            node.clone(),
            vol.clone(),
            text(&at.call.staging_target_path),
        );
        self.attempted(at, key.clone());
        if at.acted {
            self.staged
                .entry(key)
                .or_insert_with(|| Held::new(at.out, &at.call.time))
                .again(at.out);
        }
    }

    /// Invariants 3 (nothing published from the staging path) and 5.
    fn node_unstage(&mut self, at: &At) {
        let (vol, node) = (&at.vol, &at.node);
        let path = text(&at.call.staging_target_path);
        let still = self
            .published
            .iter()
            .find(|((pn, pv, _), (_, p))| {
                pn == node && pv == vol && p.staging.as_deref() == Some(path.as_str())
            })
            .map(|((_, _, target), _)| target.clone());
        if let Some(target) = still {
            self.violate(
                3,
                at.index,
                format!("NodeUnstage of {path} while {target} is still published from it"),
            );
        }
        let key = (node.clone(), vol.clone(), path);
        self.never_took_effect(at, "NodeStageVolume", key.clone());
        if at.out == Outcome::Done {
            self.staged.remove(&key);
        }
    }

    /// Invariants 2 (after NodeStage, or ControllerPublish without stages) and 1.
    fn node_publish(&mut self, at: &At) {
        let (vol, node) = (at.vol.clone(), at.node.clone());
        let staging = at.call.staging_target_path.clone();
        if self.cfg.stage_required {
            let key = (
                node.clone(),
                vol.clone(),
                staging.clone().unwrap_or_default(),
            );
            if self.staged.get(&key).map(|h| h.outcome) != Some(Outcome::Done) {
                self.violate(
                    2,
                    at.index,
                    format!(
                        "NodePublish of {vol} on {node} before NodeStage succeeded at {staging:?}"
                    ),
                );
            }
        } else if self.cfg.controller_publish_required && !self.attached_to(&vol, &node) {
            self.violate(
                2,
                at.index,
                format!("NodePublish of {vol} on {node} before ControllerPublish succeeded there"),
            );
        }
        let target = text(&at.call.target_path);
        let readonly = at.call.readonly.unwrap_or(false);
        if at.acted {
            self.one_node_one_writer(at, &target, readonly);
        }
        let key = (node, vol, target);
        self.attempted(at, key.clone());
        if at.acted {
            self.published
                .entry(key)
                .or_insert_with(|| {
                    (
                        Held::new(at.out, &at.call.time),
                        Publish {
                            staging,
                            readonly,
                            mode: at.call.access_mode.clone(),
                        },
                    )
                })
                .0
                .again(at.out);
        }
    }

    /// Invariant 1 for a publish that may have taken effect: a single-node volume on
    /// one node, a single-writer volume with one read-write publish.
    fn one_node_one_writer(&mut self, at: &At, target: &str, readonly: bool) {
        let (vol, node, now) = (&at.vol, &at.node, at.call.time.as_str());
        let mode = at.call.access_mode.as_deref();
        if single_node(mode) {
            let other = self
                .published
                .iter()
                .find(|((pn, pv, _), (h, _))| {
                    pv == vol && pn != node && !self.excused(pn, &h.since, now)
                })
                .map(|((other, _, _), _)| other.clone());
            if let Some(other) = other {
                self.violate(
                    1,
                    at.index,
                    format!(
                        "single-node volume {vol} published on {node} while published on {other}"
                    ),
                );
            }
        }
        // The spec's NodePublishVolume table: a second target path on one node needs
        // a mode that shares a node, on both publishes ("exceeds capabilities").
        let second = self
            .published
            .iter()
            .find(|((pn, pv, pt), (h, p))| {
                pv == vol
                    && pn == node
                    && pt != target
                    && !(shares_a_node(mode) && shares_a_node(p.mode.as_deref()))
                    && !self.excused(pn, &h.since, now)
            })
            .map(|((_, _, other), (_, p))| (other.clone(), p.mode.clone()));
        if let Some((other, other_mode)) = second {
            self.violate(
                1,
                at.index,
                format!(
                    "{vol} published on {node} at {target} under {} while published at {other} \
                     under {}: a second target path needs a mode that shares a node",
                    mode.unwrap_or("no mode"),
                    other_mode.as_deref().unwrap_or("no mode")
                ),
            );
        }
        if !readonly && single_writer(mode) {
            let writer = self
                .published
                .iter()
                .find(|((pn, pv, pt), (h, p))| {
                    pv == vol
                        && !p.readonly
                        && !self.excused(pn, &h.since, now)
                        && (pn != node || pt != target)
                })
                .map(|((on, _, other), _)| (on.clone(), other.clone()));
            if let Some((on, other)) = writer {
                self.violate(
                    1,
                    at.index,
                    format!("second writer of {vol} at {target} while {other} on {on} writes"),
                );
            }
        }
    }

    /// Invariant 5.
    fn node_unpublish(&mut self, at: &At) {
        let key = (at.node.clone(), at.vol.clone(), text(&at.call.target_path));
        self.never_took_effect(at, "NodePublishVolume", key.clone());
        if at.out == Outcome::Done {
            self.published.remove(&key);
        }
    }

    /// Invariants 4 and 7 at the end of the log (at position `end`), as the
    /// configuration expects; returns every violation found.
    fn finish(mut self, end: usize) -> Vec<Violation> {
        if self.cfg.expect_released {
            let mut leaks = Vec::new();
            for ((vol, node), h) in &self.attached {
                leaks.push(format!("{vol} still attached to {node} ({:?})", h.outcome));
            }
            for ((node, vol, path), h) in &self.staged {
                leaks.push(format!(
                    "{vol} still staged at {path} on {node} ({:?})",
                    h.outcome
                ));
            }
            for ((node, vol, path), (h, _)) in &self.published {
                leaks.push(format!(
                    "{vol} still published at {path} on {node} ({:?})",
                    h.outcome
                ));
            }
            for message in leaks {
                self.violate(4, end, message);
            }
        }
        if self.cfg.expect_deleted {
            let never: Vec<String> = self.created.iter().cloned().collect();
            for vol in never {
                self.violate(
                    7,
                    end,
                    format!("volume {vol} was created and never deleted"),
                );
            }
        }
        self.violations
    }
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
        /// A publish under access mode `mode`.
        fn publish_as(self, node: &str, target: &str, ro: bool, mode: &str) -> Log {
            let (t, m) = (target.to_string(), mode.to_string());
            self.call("NodePublishVolume", node, "OK", |c| {
                c.staging_target_path = Some("/s".into());
                c.target_path = Some(t);
                c.readonly = Some(ro);
                c.access_mode = Some(m);
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
            .publish_as("n1", "/t1", false, "SINGLE_NODE_MULTI_WRITER")
            .publish_as("n1", "/t2", true, "SINGLE_NODE_MULTI_WRITER")
            .unpublish("n1", "/t1")
            .unpublish("n1", "/t2")
            .unstage("n1")
            .detach("n1")
    }

    #[test]
    fn a_correct_lifecycle_passes() {
        assert_eq!(full_cycle().check(), Vec::<u8>::new());
    }

    fn expand(self_: Log, node: &str) -> Log {
        self_.call("NodeExpandVolume", node, "OK", |c| {
            c.staging_target_path = Some("/s".into());
            c.target_path = Some("/t1".into());
        })
    }

    #[test]
    fn an_expansion_only_where_the_node_holds_the_volume() {
        let held = Log::new()
            .attach("n1", "OK")
            .stage("n1", "OK")
            .publish("n1", "/t1", false);
        let held = expand(held, "n1")
            .unpublish("n1", "/t1")
            .unstage("n1")
            .detach("n1");
        assert_eq!(held.check(), Vec::<u8>::new());
        // Once unpublished and unstaged, the node holds nothing of it.
        let after = expand(full_cycle(), "n1");
        assert_eq!(after.check(), vec![8]);
        // Another node never held it.
        let elsewhere = Log::new()
            .attach("n1", "OK")
            .stage("n1", "OK")
            .publish("n1", "/t1", false);
        let elsewhere = expand(elsewhere, "n2")
            .unpublish("n1", "/t1")
            .unstage("n1")
            .detach("n1");
        assert_eq!(elsewhere.check(), vec![8]);
    }

    /// A log whose calls name terms: (term label, start second, duration seconds).
    fn termed(calls: &[(&str, u32, u32)]) -> Vec<Call> {
        calls
            .iter()
            .map(|(term, start, took)| Call {
                rpc: "ControllerPublishVolume".into(),
                time: format!("2026-01-01T00:00:{:02}.000Z", start + took),
                duration_ms: f64::from(*took) * 1000.0,
                term: Some(term.to_string()),
                code: "OK".into(),
                ..Default::default()
            })
            .collect()
    }

    #[test]
    fn no_call_of_an_earlier_term_starts_after_a_later_term_acted() {
        let nines = |calls: &[Call]| {
            terms_overlap(calls)
                .iter()
                .map(|v| v.invariant)
                .collect::<Vec<u8>>()
        };
        // Terms in order; a long call of term 5 that ends after term 9 began is fine
        // (it started first); other roles do not interfere.
        let ok = termed(&[
            ("plugin.x/5/agent@n1", 0, 20),
            ("plugin.x/5/agent@n1", 1, 1),
            ("node.n2/7/agent@n2", 2, 1),
            ("plugin.x/9/agent@n3", 10, 1),
            ("node.n2/3/agent@n2", 11, 1),
        ]);
        let mut ok = ok;
        // node.n2's term 3 after its term 7: a violation of its own role only.
        assert_eq!(nines(&ok), vec![9]);
        ok.pop();
        assert_eq!(nines(&ok), Vec::<u8>::new());
        // Term 5 acting again after term 9 started.
        let late = termed(&[
            ("plugin.x/5/agent@n1", 0, 1),
            ("plugin.x/9/agent@n3", 10, 1),
            ("plugin.x/5/agent@n1", 12, 1),
        ]);
        assert_eq!(nines(&late), vec![9]);
        // Sent before the later term began, served late (the plugin was paused): fine.
        let mut served_late = termed(&[
            ("plugin.x/5/agent@n1", 0, 1),
            ("plugin.x/9/agent@n3", 10, 1),
            ("plugin.x/5/agent@n1", 12, 1),
        ]);
        let t = |s: u64| 1_767_225_600_000 + s * 1000;
        for (c, s) in served_late.iter_mut().zip([0, 10, 5]) {
            c.sent_ms = Some(t(s));
        }
        assert_eq!(nines(&served_late), Vec::<u8>::new());
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
    fn invariant_1_a_second_target_path_needs_a_mode_that_shares_a_node() {
        let base = || Log::new().attach("n1", "OK").stage("n1", "OK");
        // A reader beside a writer under SINGLE_NODE_WRITER: the spec's "exceeds
        // capabilities", whatever a lenient plugin answered.
        let snw = base()
            .publish("n1", "/t1", false)
            .publish("n1", "/t2", true);
        assert!(snw.check().contains(&1));
        // One side shared, the other not: still refused.
        let mixed = base().publish("n1", "/t1", false).publish_as(
            "n1",
            "/t2",
            true,
            "SINGLE_NODE_MULTI_WRITER",
        );
        assert!(mixed.check().contains(&1));
        for shared in ["SINGLE_NODE_MULTI_WRITER", "MULTI_NODE_MULTI_WRITER"] {
            let ok = base()
                .publish_as("n1", "/t1", false, shared)
                .publish_as("n1", "/t2", true, shared);
            assert!(!ok.check().contains(&1), "{shared}");
        }
        // The first unpublished before the second: one at a time is fine.
        let in_turn = base()
            .publish("n1", "/t1", false)
            .unpublish("n1", "/t1")
            .publish("n1", "/t2", true);
        assert!(!in_turn.check().contains(&1));
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
