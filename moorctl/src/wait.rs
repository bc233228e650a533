//! `moorctl wait KIND/NAME --for phase=PHASE|delete --timeout D`, with a live progress
//! line.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use super::kind::{self, text, Kind};
use super::{Ctx, Refused};

/// Wait until an object reaches a phase (or is deleted).
#[derive(Debug, clap::Args)]
pub struct Wait {
    /// The object, e.g. `volume/db-data` or `claim/web-1.data`.
    pub object: String,
    /// `phase=PHASE` (e.g. `phase=published`), or `delete`.
    #[arg(long = "for")]
    pub condition: String,
    /// Give up after this long (e.g. `30s`, `2m`).
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    /// Namespace.
    #[arg(short = 'n', long, env = "MOOR_NAMESPACE", default_value = "default")]
    pub namespace: String,
}

enum Goal {
    Phase(String),
    Deleted,
}

impl Wait {
    /// Exit code 0 when reached, 1 on timeout.
    pub async fn run(self, ctx: &Ctx) -> anyhow::Result<i32> {
        let (kind, name) = self
            .object
            .split_once('/')
            .ok_or_else(|| anyhow::anyhow!("wait takes KIND/NAME, e.g. volume/db-data"))?;
        let kind: Kind = kind.parse().map_err(anyhow::Error::msg)?;
        let goal = match self.condition.split_once('=') {
            Some(("phase", p)) if kind.phase_pointer().is_some() => Goal::Phase(p.to_lowercase()),
            Some(("phase", _)) => anyhow::bail!("{kind} objects have no phase; wait --for delete"),
            _ if self.condition == "delete" => Goal::Deleted,
            _ => anyhow::bail!(
                "--for takes phase=PHASE or delete, not {:?}",
                self.condition
            ),
        };
        let ns = super::parse_ns(&self.namespace)?;
        let live = std::io::stderr().is_terminal();
        let start = Instant::now();
        let mut last_line = String::new();
        let mut trouble = super::Trouble::default();
        loop {
            let found = match kind::find(ctx, kind, Some(&ns), name).await {
                Ok(found) => found,
                // etcd unavailable (a member dying): keep looking until the timeout.
                Err(e) if super::is_transient(&e) && start.elapsed() < self.timeout => {
                    let next = format!(
                        "looking again until --timeout ({}) has passed",
                        humantime::format_duration(self.timeout)
                    );
                    trouble.say(ctx, "", &e, &next);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
                Err(e) => return Err(e),
            };
            let (done, line) = match (&goal, &found) {
                (Goal::Deleted, None) => (true, format!("{kind}/{name}: deleted")),
                (Goal::Deleted, Some(_)) => (false, format!("{kind}/{name}: still there")),
                (Goal::Phase(_), None) => (false, format!("{kind}/{name}: not found yet")),
                (Goal::Phase(want), Some(v)) => {
                    let phase = text(v, kind.phase_pointer().unwrap_or_default());
                    let error = [
                        "/status/last_error",
                        "/status/provisioning/last_error",
                        "/status/reason",
                    ]
                    .iter()
                    .map(|p| text(v, p))
                    .find(|e| !e.is_empty());
                    let mut line = format!("{kind}/{name}: phase={phase}");
                    if let Some(e) = error {
                        line.push_str(&format!(" ({e})"));
                    }
                    (phase.to_lowercase() == *want, line)
                }
            };
            let elapsed = start.elapsed();
            if done {
                // The result goes to stdout alone (progress is on stderr): on a
                // terminal the live line is cleared so it does not show twice.
                if live {
                    eprint!("\r\x1b[2K");
                    let _ = std::io::stderr().flush();
                }
                outln!("{line}");
                return Ok(0);
            }
            if live {
                eprint!(
                    "\r\x1b[2K{} [{:.1}s]",
                    crate::out::terminal_safe(&line),
                    elapsed.as_secs_f64()
                );
                let _ = std::io::stderr().flush();
            } else if line != last_line {
                eprintln!("{}", crate::out::terminal_safe(&line));
            }
            last_line = line;
            if elapsed >= self.timeout {
                if live {
                    eprintln!();
                }
                return Err(Refused(format!(
                    "timed out after {:?} waiting for {} {}: {last_line}",
                    self.timeout, self.object, self.condition
                ))
                .into());
            }
            tokio::time::sleep(
                Duration::from_millis(200).min(self.timeout.saturating_sub(elapsed)),
            )
            .await;
        }
    }
}
