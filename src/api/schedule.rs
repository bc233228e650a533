//! SnapshotSchedule: snapshots cut on a cadence for every volume a label selector
//! picks, and pruned by count and age.
//!
//! Writers: the user owns `spec`; the controller's leader (`controller/schedules.rs`)
//! owns `status`, creates the Snapshots (labelled [`SCHEDULE_LABEL`] and
//! [`SLOT_LABEL`]; the snapshotter cuts them as it cuts any other) and deletes what
//! retention drops. The slots and the retention rule are pure functions here, so
//! moorctl shows the next slot with the same arithmetic the controller acts on.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use super::*;

/// The label naming the schedule that made a Snapshot.
pub const SCHEDULE_LABEL: &str = "moor.dev/schedule";
/// The label holding the slot a scheduled Snapshot was cut for, as
/// `YYYYMMDDTHHMMSSZ` (UTC; sorts as time does).
pub const SLOT_LABEL: &str = "moor.dev/slot";

/// The shortest interval (and the resolution of every slot).
pub const MIN_INTERVAL: Duration = Duration::from_secs(1);
/// The longest interval or maximum age.
pub const MAX_PERIOD: Duration = Duration::from_secs(366 * 24 * 3600);
/// The longest cron expression.
pub const MAX_CRON_BYTES: usize = 256;
/// The most snapshots of one volume a schedule keeps by count.
pub const MAX_KEEP: u32 = 10_000;
/// The most missed slots counted at once (a one-second cron after a long outage would
/// otherwise be walked slot by slot).
pub const MAX_MISSED_COUNTED: u64 = 100_000;

/// Desired state of a snapshot schedule.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SnapshotScheduleSpec {
    /// The volumes of the schedule's namespace whose labels hold all of these
    /// (`{}`: every volume of the namespace).
    #[serde(default)]
    pub selector: BTreeMap<String, String>,
    /// A cut every interval (`30m`, `1h`, `1d`: whole seconds), at the multiples of it
    /// since the Unix epoch. Exactly one of `interval` and `cron`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval: Option<String>,
    /// A cut at each time a cron expression matches, in UTC (five fields, or six with
    /// seconds first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cron: Option<String>,
    /// What is kept of each volume's scheduled snapshots.
    #[serde(default)]
    pub retention: Retention,
    /// No cut while set; the slots passed while paused are neither cut nor missed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
    /// Plugin parameters for each CreateSnapshot.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub parameters: BTreeMap<String, String>,
}

/// What a schedule keeps of each volume's snapshots. The newest ready snapshot of a
/// volume is always kept, and so is one a volume is being restored from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Retention {
    /// Keep the newest N ready snapshots of each volume (1 to 10,000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep: Option<u32>,
    /// Delete snapshots whose slot is older than this (`7d`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_age: Option<String>,
}

/// Observed state of a snapshot schedule.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SnapshotScheduleStatus {
    /// The last slot acted on (cut, or passed while paused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_slot: Option<Timestamp>,
    /// How many volumes the last cut asked a snapshot of.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub last_cut_volumes: u32,
    /// Slots passed without a cut while the schedule was not paused (the controller
    /// was down or not leading), in all.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub missed_slots: u64,
    /// When slots were last found missed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_missed: Option<Timestamp>,
    /// Generation, conditions, last error.
    #[serde(flatten)]
    pub meta: StatusMeta,
}

impl Spec for SnapshotScheduleSpec {
    const KIND: &'static str = "SnapshotSchedule";
    const DIR: &'static str = "snapshotschedules";
    const NAMESPACED: bool = true;
    const ALIASES: &'static [&'static str] = &["schedule", "schedules", "snapshotschedule"];
    const PHASE: Option<&'static str> = None;
    const CHECKED: bool = true;
    const AGENT: AgentAccess = AgentAccess::None;
    const MAX_NAME: usize = 63;
    type Status = SnapshotScheduleStatus;

    fn validate(&self, errors: &mut ValidationErrors) {
        check_label_map("selector", &self.selector, errors);
        match (&self.interval, &self.cron) {
            (None, None) | (Some(_), Some(_)) => {
                errors.push("interval", "exactly one of interval and cron is required")
            }
            (Some(i), None) => {
                if let Err(e) = interval(i) {
                    errors.push("interval", e);
                }
            }
            (None, Some(c)) => {
                if let Err(e) = cron(c) {
                    errors.push("cron", e);
                }
            }
        }
        match self.retention.keep {
            Some(n) if n == 0 || n > MAX_KEEP => {
                errors.push("retention.keep", format!("must be 1 to {MAX_KEEP}"))
            }
            _ => {}
        }
        if let Some(age) = &self.retention.max_age {
            if let Err(e) = period(age) {
                errors.push("retention.max_age", e);
            }
        }
        if self.retention.keep.is_none() && self.retention.max_age.is_none() {
            errors.push(
                "retention",
                "keep, max_age or both: a schedule that never prunes fills the plugin",
            );
        }
        check_map_sizes("parameters", &self.parameters, errors);
    }
}

/// A snapshot schedule object.
pub type SnapshotSchedule = Object<SnapshotScheduleSpec>;

impl SnapshotSchedule {
    /// The key of schedule `name` in `ns`.
    pub fn key_for(
        ns: &Namespace,
        name: impl std::fmt::Display,
    ) -> ObjectKey<SnapshotScheduleSpec> {
        ObjectKey::from_parts(&[ns, &name])
    }
}

fn is_zero_u32(n: &u32) -> bool {
    *n == 0
}

fn is_zero_u64(n: &u64) -> bool {
    *n == 0
}

/// Parses a duration of whole seconds within the bounds.
fn period(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| format!("{:?}: {e}", printable(s)))?;
    if d < MIN_INTERVAL || d > MAX_PERIOD || d.subsec_nanos() != 0 {
        return Err(format!(
            "{:?} must be whole seconds from 1s to 366d",
            printable(s)
        ));
    }
    Ok(d)
}

fn interval(s: &str) -> Result<Duration, String> {
    period(s)
}

fn cron(s: &str) -> Result<croner::Cron, String> {
    if s.len() > MAX_CRON_BYTES {
        return Err(format!("{} bytes; at most {MAX_CRON_BYTES}", s.len()));
    }
    if s.chars().any(char::is_control) {
        return Err("must not contain control characters".into());
    }
    s.parse::<croner::Cron>()
        .map_err(|e| format!("{:?} is not a cron expression: {e}", printable(s)))
}

/// When a schedule cuts.
#[derive(Debug, Clone)]
pub enum Cadence {
    /// At the multiples of this many seconds since the Unix epoch.
    Every(u64),
    /// When the expression matches, in UTC.
    Cron(Box<croner::Cron>),
}

/// The slot a schedule acts on now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Due {
    /// The latest slot at or before now.
    pub slot: SystemTime,
    /// The slots after the last one acted on and before `slot` (at most
    /// [`MAX_MISSED_COUNTED`]).
    pub skipped: u64,
}

fn unix_secs(t: SystemTime) -> i64 {
    match t.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => d.as_secs() as i64,
        // Before the epoch: round towards earlier.
        Err(e) => -(e.duration().as_secs_f64().ceil() as i64),
    }
}

fn from_unix_secs(s: i64) -> SystemTime {
    if s >= 0 {
        SystemTime::UNIX_EPOCH + Duration::from_secs(s as u64)
    } else {
        SystemTime::UNIX_EPOCH - Duration::from_secs(s.unsigned_abs())
    }
}

fn utc(s: i64) -> Option<chrono::DateTime<chrono::Utc>> {
    chrono::DateTime::from_timestamp(s, 0)
}

impl Cadence {
    /// The latest slot at or before `now` that is after `after`, if there is one, and
    /// how many slots between them were skipped.
    pub fn due(&self, after: SystemTime, now: SystemTime) -> Option<Due> {
        let (after, now) = (unix_secs(after), unix_secs(now));
        match self {
            Cadence::Every(step) => {
                let step = *step as i64;
                let first = after.div_euclid(step) + 1;
                let last = now.div_euclid(step);
                (last >= first).then(|| Due {
                    slot: from_unix_secs(last * step),
                    skipped: ((last - first) as u64).min(MAX_MISSED_COUNTED),
                })
            }
            Cadence::Cron(c) => {
                let latest = c.find_previous_occurrence(&utc(now)?, true).ok()?;
                let latest = latest.timestamp();
                if latest <= after {
                    return None;
                }
                let mut skipped = 0;
                let mut t = utc(after)?;
                while skipped < MAX_MISSED_COUNTED {
                    match c.find_next_occurrence(&t, false) {
                        Ok(next) if next.timestamp() < latest => {
                            skipped += 1;
                            t = next;
                        }
                        _ => break,
                    }
                }
                Some(Due {
                    slot: from_unix_secs(latest),
                    skipped,
                })
            }
        }
    }

    /// The first slot after `t`.
    pub fn next_after(&self, t: SystemTime) -> Option<SystemTime> {
        let t = unix_secs(t);
        match self {
            Cadence::Every(step) => {
                let step = *step as i64;
                Some(from_unix_secs((t.div_euclid(step) + 1) * step))
            }
            Cadence::Cron(c) => c
                .find_next_occurrence(&utc(t)?, false)
                .ok()
                .map(|n| from_unix_secs(n.timestamp())),
        }
    }
}

impl SnapshotScheduleSpec {
    /// The schedule's cadence (an error for a spec validation refuses).
    pub fn cadence(&self) -> Result<Cadence, String> {
        match (&self.interval, &self.cron) {
            (Some(i), None) => Ok(Cadence::Every(interval(i)?.as_secs())),
            (None, Some(c)) => Ok(Cadence::Cron(Box::new(cron(c)?))),
            _ => Err("exactly one of interval and cron is required".into()),
        }
    }

    /// The maximum age of what it keeps, if it has one.
    pub fn max_age(&self) -> Option<Duration> {
        self.retention
            .max_age
            .as_deref()
            .and_then(|a| period(a).ok())
    }

    /// Whether a volume's labels hold all of the selector's.
    pub fn selects(&self, labels: &BTreeMap<String, String>) -> bool {
        self.selector
            .iter()
            .all(|(k, v)| labels.get(k).is_some_and(|l| l == v))
    }
}

/// A slot as the [`SLOT_LABEL`] holds it: `YYYYMMDDTHHMMSSZ`.
pub fn slot_label(slot: SystemTime) -> String {
    match utc(unix_secs(slot)) {
        Some(t) => {
            use chrono::{Datelike, Timelike};
            format!(
                "{:04}{:02}{:02}T{:02}{:02}{:02}Z",
                t.year(),
                t.month(),
                t.day(),
                t.hour(),
                t.minute(),
                t.second()
            )
        }
        None => "0".into(),
    }
}

/// The name of the Snapshot a schedule cuts of a volume for a slot:
/// `SCHEDULE-VOLUME-SLOT`, shortened with a hash of both names when it would pass the
/// id rule's 128 bytes (so two pairs never share one).
pub fn scheduled_snapshot_name(schedule: &Name, volume: &VolumeId, slot: SystemTime) -> Name {
    let stamp = slot_label(slot).to_ascii_lowercase();
    let whole = format!("{schedule}-{volume}-{stamp}");
    let name = if whole.len() <= 128 {
        whole
    } else {
        // FNV-1a of "schedule/volume": stable across builds and processes.
        let mut h: u64 = 0xcbf29ce484222325;
        for b in format!("{schedule}/{volume}").bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x100000001b3);
        }
        let cut = |s: &str| s.chars().take(40).collect::<String>();
        format!(
            "{}-{}-{h:016x}-{stamp}",
            cut(schedule.as_str()),
            cut(volume.as_str())
        )
    };
    Name::new(name).unwrap_or_default()
}

/// One scheduled snapshot of a volume, as retention sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kept {
    /// Its slot label.
    pub slot: String,
    /// Ready to restore from.
    pub ready: bool,
    /// Failed for good.
    pub failed: bool,
    /// A volume is being restored from it.
    pub restoring: bool,
}

/// Which of one volume's scheduled snapshots retention deletes (their indexes in
/// `snaps`). Kept always: the newest ready one, one being restored from, one not yet
/// ready nor failed (it is being cut), and the newest failed one when it is newer than
/// every ready one (it says why the last cut failed). `keep` counts ready ones, newest
/// first; `oldest` is the slot label below which a snapshot is too old.
pub fn pruned(snaps: &[Kept], keep: Option<u32>, oldest: Option<&str>) -> Vec<usize> {
    let mut order: Vec<usize> = (0..snaps.len()).collect();
    order.sort_by(|a, b| snaps[*b].slot.cmp(&snaps[*a].slot));
    let mut ready_seen = 0u32;
    let mut failed_seen = false;
    let mut out = Vec::new();
    for i in order {
        let s = &snaps[i];
        if s.restoring || (!s.ready && !s.failed) {
            continue;
        }
        let too_old = oldest.is_some_and(|o| s.slot.as_str() < o);
        if s.ready {
            ready_seen += 1;
            if ready_seen == 1 {
                continue;
            }
            if too_old || keep.is_some_and(|k| ready_seen > k) {
                out.push(i);
            }
        } else {
            let newest_word = !failed_seen && ready_seen == 0;
            failed_seen = true;
            if !newest_word {
                out.push(i);
            }
        }
    }
    out.sort_unstable();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> SystemTime {
        from_unix_secs(s)
    }

    #[test]
    fn an_interval_cuts_the_latest_slot_and_counts_the_skipped() {
        let c = Cadence::Every(10);
        assert_eq!(c.due(at(100), at(109)), None);
        assert_eq!(
            c.due(at(100), at(110)),
            Some(Due {
                slot: at(110),
                skipped: 0
            })
        );
        assert_eq!(
            c.due(at(100), at(145)),
            Some(Due {
                slot: at(140),
                skipped: 3
            })
        );
        // A baseline between slots (a schedule's creation time).
        assert_eq!(
            c.due(at(103), at(111)),
            Some(Due {
                slot: at(110),
                skipped: 0
            })
        );
        assert_eq!(c.next_after(at(110)), Some(at(120)));
        assert_eq!(c.next_after(at(111)), Some(at(120)));
    }

    #[test]
    fn a_cron_expression_is_read_in_utc_and_counts_the_skipped() {
        let spec = SnapshotScheduleSpec {
            cron: Some("30 2 * * *".into()),
            ..Default::default()
        };
        let c = spec.cadence().unwrap();
        // 2026-11-29T00:00:00Z
        let midnight = 1_795_910_400;
        let slot = midnight + 2 * 3600 + 30 * 60;
        assert_eq!(c.next_after(at(midnight)), Some(at(slot)));
        assert_eq!(slot_label(at(slot)), "20261129T023000Z");
        assert_eq!(c.due(at(midnight), at(slot - 1)), None);
        assert_eq!(
            c.due(at(midnight), at(slot + 3 * 86_400 + 5)),
            Some(Due {
                slot: at(slot + 3 * 86_400),
                skipped: 3
            })
        );
        let secs = SnapshotScheduleSpec {
            cron: Some("*/5 * * * * *".into()),
            ..Default::default()
        };
        assert_eq!(
            secs.cadence().unwrap().due(at(midnight), at(midnight + 23)),
            Some(Due {
                slot: at(midnight + 20),
                skipped: 3
            })
        );
    }

    #[test]
    fn retention_keeps_the_newest_ready_what_restores_and_what_is_being_cut() {
        let k = |slot: &str, ready, failed, restoring| Kept {
            slot: slot.into(),
            ready,
            failed,
            restoring,
        };
        let snaps = vec![
            k("20260101T000000Z", true, false, false),
            k("20260102T000000Z", true, false, true),
            k("20260103T000000Z", true, false, false),
            k("20260104T000000Z", false, true, false),
            k("20260105T000000Z", true, false, false),
            k("20260106T000000Z", false, false, false),
            k("20260107T000000Z", false, true, false),
        ];
        // Keep 1: the newest ready (05) stays; 03 and 01 go; 02 restores; 06 is
        // being cut; 07 is the newest failure, newer than every ready one; 04 goes.
        assert_eq!(pruned(&snaps, Some(1), None), vec![0, 2, 3]);
        // Keep 2: 03 stays too.
        assert_eq!(pruned(&snaps, Some(2), None), vec![0, 3]);
        // By age: older than the 3rd, but the newest ready is kept whatever its age.
        assert_eq!(pruned(&snaps, None, Some("20260103T000000Z")), vec![0, 3]);
        assert_eq!(
            pruned(&snaps, None, Some("20270101T000000Z")),
            vec![0, 2, 3]
        );
    }

    #[test]
    fn names_stay_within_the_id_rule_and_apart() {
        let slot = at(1_795_910_400);
        let n = scheduled_snapshot_name(
            &Name::new("nightly").unwrap(),
            &VolumeId::new("db").unwrap(),
            slot,
        );
        assert_eq!(n.to_string(), "nightly-db-20261129t000000z");
        let long = |c: char| "x".repeat(120).replace('x', &c.to_string());
        let a = scheduled_snapshot_name(
            &Name::new(long('a')).unwrap(),
            &VolumeId::new(format!("{}1", long('b'))).unwrap(),
            slot,
        );
        let b = scheduled_snapshot_name(
            &Name::new(long('a')).unwrap(),
            &VolumeId::new(format!("{}2", long('b'))).unwrap(),
            slot,
        );
        assert!(a.validate().is_ok() && b.validate().is_ok());
        assert_ne!(a, b);
    }

    #[test]
    fn hostile_schedules_are_refused_by_field() {
        let refused = |spec: SnapshotScheduleSpec, field: &str| {
            let mut e = ValidationErrors::default();
            spec.validate(&mut e);
            assert!(
                e.0.iter().any(|f| f.field == field),
                "{field} not refused: {e}"
            );
        };
        let ok = SnapshotScheduleSpec {
            interval: Some("1h".into()),
            retention: Retention {
                keep: Some(3),
                max_age: None,
            },
            ..Default::default()
        };
        let mut e = ValidationErrors::default();
        ok.validate(&mut e);
        assert!(e.0.is_empty(), "{e}");
        for (i, f) in [
            ("0s", "interval"),
            ("1500ms", "interval"),
            ("400d", "interval"),
            ("soon", "interval"),
        ] {
            let mut s = ok.clone();
            s.interval = Some(i.into());
            refused(s, f);
        }
        let mut s = ok.clone();
        s.cron = Some("* * * * *".into());
        refused(s, "interval");
        for c in ["61 * * * *", "* * * * * * * *", "a\u{7}", &"1 ".repeat(200)] {
            let mut s = ok.clone();
            s.interval = None;
            s.cron = Some(c.into());
            refused(s, "cron");
        }
        let mut s = ok.clone();
        s.retention.keep = Some(0);
        refused(s, "retention.keep");
        let mut s = ok.clone();
        s.retention = Retention::default();
        refused(s, "retention");
        let mut s = ok.clone();
        s.retention.max_age = Some("-1s".into());
        refused(s, "retention.max_age");
        let mut s = ok.clone();
        s.selector.insert("bad key\n".into(), "v".into());
        assert!({
            let mut e = ValidationErrors::default();
            s.validate(&mut e);
            e.0.iter().any(|f| f.field.starts_with("selector"))
        });
        let unknown = parse_manifests(
            "kind: SnapshotSchedule\nmetadata: {name: s}\nspec: {interval: 1h, retention: {keep: 1, forever: true}}\n",
        )
        .remove(0)
        .unwrap_err();
        assert!(
            unknown.to_string().contains("spec.retention.forever"),
            "{unknown}"
        );
    }
}
