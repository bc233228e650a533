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
        if let Some(due) = cadence.due(after, now) {
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
