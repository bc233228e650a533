//! The leading controller's view of the cluster as gauges, for alerts: claims by phase
//! with the longest time one has been in its phase, and each plugin's healthy and
//! expected instances. Read from the informers' caches every few seconds; cleared when
//! the term ends, so only the leader reports.

use moor::api::*;
use moor::runtime::metrics;
use moor::runtime::reflector;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// How often the gauges are set.
const EVERY: Duration = Duration::from_secs(5);

const PHASES: [ClaimPhase; 6] = [
    ClaimPhase::Pending,
    ClaimPhase::Denied,
    ClaimPhase::Admitted,
    ClaimPhase::Published,
    ClaimPhase::Releasing,
    ClaimPhase::Released,
];

/// When each claim (by uid) was first seen in its current phase. Claims are known by a
/// hash of their uid, updated in place: a clock over 100,000 claims holds no copy of
/// their uids and builds no new table every pass.
#[derive(Default)]
pub struct PhaseClock {
    since: HashMap<u64, Seen>,
    /// Flips every pass; what a pass did not see keeps the old value and is dropped.
    pass: bool,
}

struct Seen {
    phase: ClaimPhase,
    since: Instant,
    pass: bool,
}

fn uid_hash(uid: &Uid) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    uid.hash(&mut h);
    h.finish()
}

impl PhaseClock {
    /// Observes `claims` at `now`; returns per phase `(name, count, oldest seconds)`.
    pub fn observe<'a>(
        &mut self,
        claims: impl Iterator<Item = &'a Claim>,
        now: Instant,
    ) -> Vec<(&'static str, i64, i64)> {
        let mut counts = [(0i64, Duration::ZERO); PHASES.len()];
        let pass = !self.pass;
        self.pass = pass;
        for c in claims {
            let phase = c.status.phase;
            let seen = self.since.entry(uid_hash(&c.metadata.uid)).or_insert(Seen {
                phase,
                since: now,
                pass,
            });
            if seen.phase != phase {
                (seen.phase, seen.since) = (phase, now);
            }
            seen.pass = pass;
            if let Some(i) = PHASES.iter().position(|p| *p == phase) {
                counts[i].0 += 1;
                counts[i].1 = counts[i].1.max(now.duration_since(seen.since));
            }
        }
        self.since.retain(|_, s| s.pass == pass);
        if self.since.capacity() > 1024 && self.since.len() < self.since.capacity() / 4 {
            self.since.shrink_to(self.since.len() * 2);
        }
        PHASES
            .iter()
            .zip(counts)
            .map(|(p, (n, oldest))| (phase_name(*p), n, oldest.as_secs() as i64))
            .collect()
    }
}

fn phase_name(p: ClaimPhase) -> &'static str {
    match p {
        ClaimPhase::Pending => "Pending",
        ClaimPhase::Denied => "Denied",
        ClaimPhase::Admitted => "Admitted",
        ClaimPhase::Published => "Published",
        ClaimPhase::Releasing => "Releasing",
        ClaimPhase::Released => "Released",
    }
}

/// Sets the gauges every [`EVERY`] until `stop`, then clears them.
pub async fn run(
    claims: reflector::Store<Claim>,
    plugins: reflector::Store<Plugin>,
    stop: CancellationToken,
) {
    let mut clock = PhaseClock::default();
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(EVERY) => {}
        }
        let all = claims.state();
        metrics::claims_by_phase(&clock.observe(all.iter().map(|c| &**c), Instant::now()));
        let plugins = plugins.state();
        let rows: Vec<(&str, &str, i64, i64)> = plugins
            .iter()
            .flat_map(|p| {
                let id = p.metadata.name.as_str();
                let s = &p.status;
                [
                    (
                        id,
                        "controller",
                        i64::from(s.controllers_healthy),
                        i64::from(s.controllers_expected),
                    ),
                    (
                        id,
                        "node",
                        i64::from(s.nodes_healthy),
                        i64::from(s.nodes_expected),
                    ),
                ]
            })
            .collect();
        metrics::plugins(&rows);
    }
    metrics::claims_by_phase(&[]);
    metrics::plugins(&[]);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(uid: &str, phase: ClaimPhase) -> Claim {
        let mut c = Claim::new(
            &Namespace::default_ns(),
            Name::new(uid).unwrap(),
            ClaimSpec::default(),
        );
        c.metadata.uid = uid.into();
        c.status.phase = phase;
        c
    }

    fn row(rows: &[(&'static str, i64, i64)], phase: &str) -> (i64, i64) {
        let r = rows.iter().find(|r| r.0 == phase).unwrap();
        (r.1, r.2)
    }

    #[test]
    fn the_oldest_time_in_a_phase_restarts_when_the_phase_changes() {
        let mut clock = PhaseClock::default();
        let t0 = Instant::now();
        let a = claim("a", ClaimPhase::Admitted);
        let b = claim("b", ClaimPhase::Admitted);
        clock.observe([&a, &b].into_iter(), t0);
        let rows = clock.observe([&a, &b].into_iter(), t0 + Duration::from_secs(90));
        assert_eq!(row(&rows, "Admitted"), (2, 90));
        assert_eq!(row(&rows, "Published"), (0, 0));
        // b moves on: its time in Published starts now; a is still the oldest Admitted.
        let b = claim("b", ClaimPhase::Published);
        let rows = clock.observe([&a, &b].into_iter(), t0 + Duration::from_secs(100));
        assert_eq!(row(&rows, "Admitted"), (1, 100));
        assert_eq!(row(&rows, "Published"), (1, 0));
        // A claim gone is forgotten.
        let rows = clock.observe([&b].into_iter(), t0 + Duration::from_secs(130));
        assert_eq!(row(&rows, "Admitted"), (0, 0));
        assert_eq!(row(&rows, "Published"), (1, 30));
    }
}
