//! Snapshot schedules: the leader cuts each schedule's slots through the snapshotter
//! and prunes what its retention drops.
//!
//! Expected flow, every tick, for each SnapshotSchedule (slots and retention are the
//! pure functions of `moor::api::schedule`):
//! 1. The slot due: the latest one at or before now that is after `status.last_slot`
//!    (a new schedule: after its creation). None: nothing to cut.
//! 2. Paused: the slot is recorded as acted on, nothing is cut, nothing is missed.
//! 3. Otherwise one Snapshot per volume the selector picks (same namespace, not being
//!    deleted), named by schedule, volume and slot and labelled `moor.dev/schedule`
//!    and `moor.dev/slot`; the snapshotter in the agent leading the volume's plugin
//!    cuts it. A name already there is this slot's (a leader that died between its
//!    creates and its status write): nothing is cut twice.
//! 4. Then `status.last_slot` (a guarded read-modify-write that only moves it
//!    forward, so two passes over one slot count nothing twice). The slots between the
//!    last one and this one were missed: counted in `status.missed_slots`, a `Missed
//!    slots` Warning, and `status.last_missed`, which the leader exports as
//!    `moor_snapshot_schedule_last_missed_timestamp_seconds` (alert
//!    MoorSnapshotScheduleMissed). After an outage one snapshot is cut, for
//!    the latest slot, never one per missed slot.
//! 5. Retention, per volume: what `moor::api::pruned` drops is deleted (the
//!    snapshotter's finalizer then deletes it in the plugin). A snapshot a volume is
//!    being restored from is never dropped; a paused schedule prunes nothing.
//!
//! The status write of step 4 makes the next pass find no slot due: a pass it brings
//! writes nothing. Deleting a schedule keeps the snapshots it cut.

use moor::api::*;
use moor::runtime::events::Recorder;
use moor::runtime::informer::Informer;
use moor::runtime::reflector;
use moor::runtime::writer::Writer;
use moor::store::StoreError;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio_util::sync::CancellationToken;

use super::volume_view::VolumeView;
use crate::common::object_ref;

/// How often the schedules are looked at (a slot is cut within this of its time).
const TICK: Duration = Duration::from_millis(500);

/// What the schedules reconciler reads and writes.
pub struct Schedules {
    writer: Writer,
    recorder: Recorder,
    schedules: reflector::Store<SnapshotSchedule>,
    snapshots: reflector::Store<Snapshot>,
    volumes: reflector::Store<VolumeView>,
    lookahead: std::sync::Mutex<Lookahead>,
}

/// What a schedule's next slot was computed from: it is computed again only when one
/// of these changes (a new spec, a slot acted on, the schedule made again).
type Basis = (Uid, i64, Option<Timestamp>);

/// When each schedule's next slot falls, as last computed. A cron search is costly
/// (one that never matches, `0 0 30 2 *`, walks to year 5000 and back to year 1), so
/// it runs once per slot and per change of the schedule, never on every tick: between
/// slots a tick compares times, and a cadence with no next slot is not searched
/// again until its schedule changes.
#[derive(Default)]
pub struct Lookahead {
    next: HashMap<(Namespace, Name), (Basis, Option<SystemTime>)>,
    /// Searches made (what the tests count).
    pub searches: u64,
}

impl Lookahead {
    /// The slot of `schedule` due at `now` (after `after`), searching only when its
    /// next slot has come or its basis changed.
    pub fn due(
        &mut self,
        schedule: &SnapshotSchedule,
        cadence: &Cadence,
        after: SystemTime,
        now: SystemTime,
    ) -> Option<Due> {
        let id = (
            schedule.metadata.namespace.clone(),
            schedule.metadata.name.clone(),
        );
        let basis = (
            schedule.metadata.uid.clone(),
            schedule.metadata.generation,
            schedule.status.last_slot,
        );
        if let Some((known, next)) = self.next.get(&id) {
            if *known == basis && next.is_none_or(|t| now < t) {
                return None;
            }
        }
        self.searches += 1;
        let due = cadence.due(after, now);
        let next = cadence.next_after(now.max(after));
        self.next.insert(id, (basis, next));
        due
    }

    /// Forgets the schedules not in `live`.
    pub fn retain(&mut self, live: &HashSet<(Namespace, Name)>) {
        self.next.retain(|k, _| live.contains(k));
    }
}

/// Runs the schedules until `stop`.
pub async fn run(
    writer: Writer,
    recorder: Recorder,
    schedules: Informer<SnapshotSchedule>,
    snapshots: Informer<Snapshot>,
    volumes: reflector::Store<VolumeView>,
    stop: CancellationToken,
) {
    let this = Schedules {
        writer,
        recorder,
        schedules: schedules.reader(),
        snapshots: snapshots.reader(),
        volumes,
        lookahead: Default::default(),
    };
    this.schedules.wait_until_ready().await;
    this.snapshots.wait_until_ready().await;
    this.volumes.wait_until_ready().await;
    let mut exported: HashSet<(Namespace, Name)> = HashSet::new();
    loop {
        let all = this.schedules.state();
        if !all.is_empty() {
            let seen = Seen::now(&this.snapshots, &this.volumes);
            for schedule in &all {
                this.pass(schedule, &seen, SystemTime::now()).await;
            }
        }
        export(&all, &mut exported);
        let live: HashSet<(Namespace, Name)> = all
            .iter()
            .map(|s| (s.metadata.namespace.clone(), s.metadata.name.clone()))
            .collect();
        this.lookahead
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(&live);
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(TICK) => {}
        }
    }
}

impl Schedules {
    /// One look at one schedule at `now`.
    async fn pass(&self, schedule: &SnapshotSchedule, seen: &Seen, now: SystemTime) {
        if schedule.is_deleting() {
            return;
        }
        let cadence = match schedule.spec.cadence() {
            Ok(c) => c,
            Err(e) => {
                // Validation refuses such a spec; one written around it says why.
                let _ = self
                    .writer
                    .write_status(schedule, |st| st.meta.last_error = Some(e.clone()))
                    .await;
                return;
            }
        };
        let after = schedule
            .status
            .last_slot
            .or(schedule.metadata.creation_timestamp)
            .map_or(now, Timestamp::system);
        let due = self
            .lookahead
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .due(schedule, &cadence, after, now);
        if let Some(due) = due {
            self.cut(schedule, due).await;
        }
        if !schedule.spec.paused {
            self.prune(schedule, seen, now).await;
        }
    }

    /// Cuts (or, paused, passes) the slot due.
    async fn cut(&self, schedule: &SnapshotSchedule, due: Due) {
        let slot = Timestamp::from_system(due.slot);
        let mut asked = 0u32;
        if !schedule.spec.paused {
            for volume in self.selected(schedule) {
                match self
                    .writer
                    .create(&scheduled(schedule, &volume, due.slot))
                    .await
                {
                    Ok(_) | Err(StoreError::AlreadyExists { .. }) => asked += 1,
                    Err(e) => {
                        tracing::warn!(schedule = %schedule.key(), volume = %volume, error = %e, "could not ask for a scheduled snapshot; trying again");
                        let _ = self
                            .writer
                            .write_status(schedule, |st| {
                                st.meta.last_error =
                                    Some(format!("creating the snapshot of {volume}: {e}"))
                            })
                            .await;
                        return;
                    }
                }
            }
        }
        let paused = schedule.spec.paused;
        let mut moved = false;
        let written = self
            .writer
            .modify_status(&schedule.object_key(), |_, st| {
                moved = st.last_slot.is_none_or(|l| l < slot);
                if moved {
                    st.last_slot = Some(slot);
                    if !paused {
                        st.last_cut_volumes = asked;
                        st.missed_slots = st.missed_slots.saturating_add(due.skipped);
                        if due.skipped > 0 {
                            st.last_missed = Some(Timestamp::now());
                        }
                    }
                    st.meta.last_error = None;
                }
                moved
            })
            .await;
        if let Err(e) = written {
            tracing::warn!(schedule = %schedule.key(), error = %e, "could not record a schedule's slot");
            return;
        }
        if !moved || paused {
            return;
        }
        let at = slot_label(due.slot);
        if due.skipped > 0 {
            self.recorder
                .record(
                    object_ref(schedule),
                    EventType::Warning,
                    "Missed slots",
                    format!(
                        "{} slot(s) passed without a cut (the controller was down or not leading); one snapshot per volume is cut for the latest slot, {at}",
                        due.skipped
                    ),
                    BTreeMap::from([("missed".to_string(), due.skipped.to_string())]),
                )
                .await;
        }
        self.recorder
            .record(
                object_ref(schedule),
                EventType::Normal,
                "Cut",
                format!("asked for {asked} snapshot(s) for slot {at}"),
                BTreeMap::new(),
            )
            .await;
    }

    /// The volumes a schedule picks now.
    fn selected(&self, schedule: &SnapshotSchedule) -> Vec<VolumeId> {
        let mut picked: Vec<VolumeId> = self
            .volumes
            .state()
            .iter()
            .filter(|v| {
                v.namespace == schedule.metadata.namespace
                    && !v.deleting
                    && schedule.spec.selects(v.labels())
            })
            .filter_map(|v| VolumeId::new(v.name.as_str()).ok())
            .collect();
        picked.sort();
        picked
    }

    /// Deletes what the schedule's retention drops.
    async fn prune(&self, schedule: &SnapshotSchedule, seen: &Seen, now: SystemTime) {
        let ns = &schedule.metadata.namespace;
        let key = (ns.clone(), schedule.metadata.name.to_string());
        let Some(mine) = seen.by_schedule.get(&key) else {
            return;
        };
        let restoring = |s: &Snapshot| {
            seen.restoring
                .contains(&(ns.clone(), s.metadata.name.clone()))
        };
        let mut by_volume: HashMap<&VolumeId, Vec<&Arc<Snapshot>>> = HashMap::new();
        for s in mine {
            by_volume.entry(&s.spec.volume).or_default().push(s);
        }
        let oldest = schedule
            .spec
            .max_age()
            .and_then(|age| now.checked_sub(age))
            .map(slot_label);
        let mut dropped = Vec::new();
        for snaps in by_volume.values() {
            let kept: Vec<Kept> = snaps
                .iter()
                .map(|s| Kept {
                    slot: s
                        .metadata
                        .labels
                        .get(SLOT_LABEL)
                        .cloned()
                        .unwrap_or_default(),
                    ready: s.status.phase == SnapshotPhase::Ready,
                    failed: s.status.phase == SnapshotPhase::Failed,
                    restoring: restoring(s),
                })
                .collect();
            for i in pruned(&kept, schedule.spec.retention.keep, oldest.as_deref()) {
                let s = snaps[i];
                match self
                    .writer
                    .delete(&s.object_key(), Some(s.metadata.resource_version))
                    .await
                {
                    Ok(_) => dropped.push(s.metadata.name.to_string()),
                    // Changed or gone since the cache saw it: looked at again next tick.
                    Err(StoreError::Conflict { .. }) | Err(StoreError::NotFound { .. }) => {}
                    Err(e) => {
                        tracing::warn!(snapshot = %s.key(), error = %e, "could not delete a snapshot retention dropped")
                    }
                }
            }
        }
        if !dropped.is_empty() {
            dropped.sort();
            self.recorder
                .record(
                    object_ref(schedule),
                    EventType::Normal,
                    "Pruned",
                    format!(
                        "retention deleted {} snapshot(s): {}",
                        dropped.len(),
                        dropped.join(", ")
                    ),
                    BTreeMap::new(),
                )
                .await;
        }
    }
}

/// What one tick reads of the caches, once for every schedule.
struct Seen {
    /// Scheduled snapshots not being deleted, by namespace and schedule.
    by_schedule: HashMap<(Namespace, String), Vec<Arc<Snapshot>>>,
    /// Snapshots a volume is being restored from (not yet created), by namespace.
    restoring: HashSet<(Namespace, Name)>,
}

impl Seen {
    fn now(snapshots: &reflector::Store<Snapshot>, volumes: &reflector::Store<VolumeView>) -> Seen {
        let mut by_schedule: HashMap<(Namespace, String), Vec<Arc<Snapshot>>> = HashMap::new();
        for s in snapshots.state() {
            if s.is_deleting() {
                continue;
            }
            if let Some(name) = s.metadata.labels.get(SCHEDULE_LABEL) {
                by_schedule
                    .entry((s.metadata.namespace.clone(), name.clone()))
                    .or_default()
                    .push(s.clone());
            }
        }
        let restoring = volumes
            .state()
            .iter()
            .filter(|v| !v.provisioned)
            .filter_map(|v| match &v.rare.as_ref()?.spec.source {
                Some(VolumeSource::Snapshot(n)) => Some((v.namespace.clone(), n.clone())),
                _ => None,
            })
            .collect();
        Seen {
            by_schedule,
            restoring,
        }
    }
}

/// Exports each schedule's `status.last_missed`; removes the series of those gone.
fn export(all: &[Arc<SnapshotSchedule>], exported: &mut HashSet<(Namespace, Name)>) {
    let mut now = HashSet::new();
    for s in all {
        if let Some(at) = s.status.last_missed {
            let at = at.system().duration_since(std::time::UNIX_EPOCH);
            moor::runtime::metrics::schedule_last_missed(
                s.metadata.namespace.as_str(),
                s.metadata.name.as_str(),
                at.ok().map(|d| d.as_secs() as i64),
            );
            now.insert((s.metadata.namespace.clone(), s.metadata.name.clone()));
        }
    }
    for (ns, name) in exported.difference(&now) {
        moor::runtime::metrics::schedule_last_missed(ns.as_str(), name.as_str(), None);
    }
    *exported = now;
}

/// The Snapshot a schedule asks for of `volume` at `slot`.
fn scheduled(schedule: &SnapshotSchedule, volume: &VolumeId, slot: SystemTime) -> Snapshot {
    let mut snap = Snapshot::new(
        &schedule.metadata.namespace,
        scheduled_snapshot_name(&schedule.metadata.name, volume, slot),
        SnapshotSpec {
            volume: volume.clone(),
            parameters: schedule.spec.parameters.clone(),
            ..Default::default()
        },
    );
    *snap.metadata.labels = BTreeMap::from([
        (
            SCHEDULE_LABEL.to_string(),
            schedule.metadata.name.to_string(),
        ),
        (SLOT_LABEL.to_string(), slot_label(slot)),
    ]);
    snap
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(cron: &str) -> SnapshotSchedule {
        let mut s = SnapshotSchedule::new(
            &Namespace::default_ns(),
            Name::new("s").unwrap(),
            SnapshotScheduleSpec {
                cron: Some(cron.into()),
                ..Default::default()
            },
        );
        s.metadata.uid = Uid::random();
        s.metadata.generation = 1;
        s
    }

    /// Issue 77, item 6: 20 schedules with a cron that never matches kept the
    /// controller at 15% CPU, every tick searching to year 5000 and back. The search
    /// runs once until the schedule changes.
    #[test]
    fn a_cron_that_never_matches_is_searched_once_until_its_schedule_changes() {
        let mut s = schedule("0 0 30 2 *");
        let cadence = s.spec.cadence().unwrap();
        let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let mut look = Lookahead::default();
        for tick in 0..100u64 {
            let now = start + TICK * tick as u32;
            assert_eq!(look.due(&s, &cadence, start, now), None);
        }
        assert_eq!(look.searches, 1, "searched on every tick");
        s.metadata.generation = 2;
        assert_eq!(look.due(&s, &cadence, start, start), None);
        assert_eq!(look.searches, 2, "a changed schedule is searched again");
    }

    /// A cron that matches is searched when its next slot comes, and the slot is due
    /// then, not before.
    #[test]
    fn a_matching_cron_is_searched_once_per_slot() {
        let mut s = schedule("* * * * *");
        let cadence = s.spec.cadence().unwrap();
        // 20 s after a minute began; the slot before was acted on.
        let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 / 60 * 60 + 20);
        s.status.last_slot = Some(Timestamp::from_system(start - Duration::from_secs(20)));
        let mut look = Lookahead::default();
        let mut cut = Vec::new();
        // Three minutes of ticks.
        for tick in 0..360u64 {
            let now = start + TICK * tick as u32;
            let after = s.status.last_slot.map(Timestamp::system).unwrap();
            if let Some(due) = look.due(&s, &cadence, after, now) {
                cut.push(due.slot);
                // The cut's status write moves last_slot (a new basis).
                s.status.last_slot = Some(Timestamp::from_system(due.slot));
            }
        }
        assert_eq!(cut.len(), 3, "{cut:?}");
        assert!(
            look.searches <= 7,
            "{} searches in 3 minutes",
            look.searches
        );
    }
}
