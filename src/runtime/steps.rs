//! The step runner: per (object, step) retry gates, and how every reconciler runs a
//! CSI step through them.
//!
//! Expected flow for a step of a reconciler (attacher, provisioner, snapshotter, node):
//! 1. [`Steps::begin`] with a fingerprint of the step's inputs (the object's spec
//!    generation, the plugin's fingerprint, the objects the step reads). While the step
//!    is backing off and the inputs are unchanged it answers how long to wait: the
//!    reconciler returns `Requeue(wait)` and writes nothing. Any trigger (the
//!    reconciler's own status write included) thus costs a map lookup, never a call: a
//!    self-caused write cannot reset the schedule, a change of the inputs can.
//! 2. The reconciler records what the call may do before making it (an uncertain mark,
//!    a `Creating` phase, a local checkpoint), then [`Step::call`]s it.
//! 3. On OK the step is forgotten; the reconciler records its success
//!    ([`StatusMeta::clear_failure`]). On an error the schedule moves by the answer's
//!    class: retryable answers wait `initial` doubling (jittered) up to `cap`, final
//!    answers wait `cap` at once. The [`Failed`] it returns carries what the object's
//!    status shows ([`Failed::record`]: attempts, since, next retry; it changes once
//!    per attempt, never per pass) and when to look again.
//!
//! State is in memory: a restarted process tries each failed step once more, then
//! follows the schedule again.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use super::backoff::Backoff;
use crate::api::{StatusMeta, StepFailure, Timestamp};
use crate::csi::policy::{Class, CsiError};

/// The retry schedule of failing steps.
#[derive(Debug, Clone)]
pub struct Schedule {
    /// Delay after the first retryable failure.
    pub initial: Duration,
    /// Longest delay; the delay after a final answer.
    pub cap: Duration,
    /// Randomise each delay within its upper half.
    pub jitter: bool,
}

impl Default for Schedule {
    fn default() -> Self {
        Schedule {
            initial: Duration::from_millis(500),
            cap: Duration::from_secs(300),
            jitter: true,
        }
    }
}

impl Schedule {
    /// The delay after `attempts` failures in a row, the last one final or not.
    pub fn delay(&self, attempts: u32, final_answer: bool) -> Duration {
        if final_answer {
            return self.cap;
        }
        let mut b = Backoff::new(self.initial, self.cap);
        b.jitter = self.jitter;
        b.delay(attempts)
    }

    /// The most calls a step failing without end may receive within `window`, `tries`
    /// calls per attempt (a call policy's own retries), counting the first attempt and
    /// an extra attempt for a restart: what a test holds a failing plugin's call log to.
    pub fn max_attempts_within(&self, window: Duration, final_answer: bool) -> u32 {
        // The shortest delays (jitter draws from the upper half) give the most attempts.
        let mut at = Duration::ZERO;
        let mut attempts = 1;
        loop {
            let d = self.delay_floor(attempts, final_answer);
            at += d;
            if at > window {
                return attempts;
            }
            attempts += 1;
        }
    }

    fn delay_floor(&self, attempts: u32, final_answer: bool) -> Duration {
        let base = if final_answer {
            self.cap
        } else {
            Backoff::new(self.initial, self.cap).base_delay(attempts)
        };
        if self.jitter {
            base / 2
        } else {
            base
        }
    }
}

/// Whether a step may be tried now (what [`Steps::begin`] asks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gate {
    /// Go ahead.
    Go,
    /// Backing off: look again after this long.
    Wait(Duration),
}

#[derive(Debug, Clone)]
struct Entry {
    inputs: u64,
    next_at: Instant,
    failure: StepFailure,
}

/// The retry state of every failing step of one reconciler (cheap to clone): per
/// object key, its failing steps.
#[derive(Debug, Clone, Default)]
pub struct Steps {
    schedule: Schedule,
    entries: Arc<Mutex<HashMap<String, HashMap<&'static str, Entry>>>>,
}

/// A fingerprint of what a step depends on.
pub fn inputs(parts: impl Hash) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parts.hash(&mut h);
    h.finish()
}

type Entries = HashMap<String, HashMap<&'static str, Entry>>;

/// A step its gate let through ([`Steps::begin`]): run it with [`Step::call`].
#[derive(Debug)]
#[must_use = "a step let through its gate is run with Step::call"]
pub struct Step<'a> {
    steps: &'a Steps,
    key: &'a str,
    name: &'static str,
    inputs: u64,
}

/// A step whose call failed, as recorded on its schedule.
#[derive(Debug, Clone)]
pub struct Failed {
    /// The plugin's answer.
    pub error: CsiError,
    /// What the object's status shows ([`Failed::record`]).
    pub failure: StepFailure,
    /// When the step may be tried again (with unchanged inputs).
    pub retry_in: Duration,
}

impl Step<'_> {
    /// The step's name, e.g. `NodeStageVolume`.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Runs `call` and settles the step's schedule with its answer: forgotten on OK,
    /// the next retry set by the answer's class on an error.
    pub async fn call<T>(
        self,
        call: impl std::future::Future<Output = Result<T, CsiError>>,
    ) -> Result<T, Failed> {
        match call.await {
            Ok(v) => {
                self.steps.succeeded(self.key, self.name);
                Ok(v)
            }
            Err(e) => Err(self.fail(e)),
        }
    }

    /// Settles the step as failed with `error` without a call of its own: an answer
    /// that came back OK but says no (ValidateVolumeCapabilities unconfirmed), or a
    /// second call of the same step that failed.
    pub fn fail(self, error: CsiError) -> Failed {
        let final_answer = error.class() == Class::Final;
        let code = format!("{:?}", error.code);
        let (failure, retry_in) = self.steps.failed(
            self.key,
            self.name,
            self.inputs,
            &code,
            &error.message,
            final_answer,
        );
        tracing::warn!(key = %self.key, step = self.name, error = %error, retry_in = ?retry_in, "step failed");
        Failed {
            error,
            failure,
            retry_in,
        }
    }
}

impl Failed {
    /// The error's message, as the status and events show it.
    pub fn message(&self) -> String {
        self.error.to_string()
    }

    /// Whether the plugin refused for good (retried only at the schedule's cap, or
    /// when the step's inputs change).
    pub fn is_final(&self) -> bool {
        self.failure.final_answer
    }

    /// Whether the call may have taken effect (a timeout, a cut-off).
    pub fn is_uncertain(&self) -> bool {
        self.error.is_uncertain()
    }

    /// Shows the failure on a status: the last error and the step's retry.
    pub fn record(&self, meta: &mut StatusMeta) {
        meta.last_error = Some(self.message());
        meta.retry = Some(Box::new(self.failure.clone()));
    }
}

/// A step whose gate is closed: it backs off for `after` more. Not a failure: the
/// reconcile that met it is looked at again then.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{step} backs off for {after:?} more")]
pub struct BackingOff {
    /// The step.
    pub step: &'static str,
    /// How long it still backs off.
    pub after: Duration,
}

/// A reconcile's result with a closed gate (`backing_off` finds it in the error)
/// turned into a requeue for when the gate opens.
pub fn requeue_backing_off<E>(
    result: Result<crate::runtime::controller::Action, E>,
    backing_off: impl Fn(&E) -> Option<BackingOff>,
) -> Result<crate::runtime::controller::Action, E> {
    match result {
        Err(e) => match backing_off(&e) {
            Some(b) => Ok(crate::runtime::controller::Action::Requeue(b.after)),
            None => Err(e),
        },
        ok => ok,
    }
}

impl Steps {
    /// Gates under `schedule`.
    pub fn new(schedule: Schedule) -> Steps {
        Steps {
            schedule,
            entries: Arc::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Step `name` of `key`, to run now if its gate lets it; else how long it still
    /// backs off (an executor's reconcile returns it, and its runner requeues the key
    /// after that long: [`BackingOff`]).
    pub fn begin<'a>(
        &'a self,
        key: &'a str,
        name: &'static str,
        inputs: u64,
    ) -> Result<Step<'a>, BackingOff> {
        match self.gate(key, name, inputs) {
            Gate::Go => Ok(Step {
                steps: self,
                key,
                name,
                inputs,
            }),
            Gate::Wait(after) => Err(BackingOff { step: name, after }),
        }
    }

    /// Whether `step` of `key` may be tried now, given its inputs' fingerprint.
    fn gate(&self, key: &str, step: &'static str, inputs: u64) -> Gate {
        let mut entries = self.lock();
        let Some(steps) = entries.get_mut(key) else {
            return Gate::Go;
        };
        match steps.get(step) {
            None => Gate::Go,
            Some(e) if e.inputs != inputs => {
                // Something the step depends on changed: try at once, from scratch.
                steps.remove(step);
                if steps.is_empty() {
                    entries.remove(key);
                }
                Gate::Go
            }
            Some(e) => {
                let now = Instant::now();
                if now >= e.next_at {
                    Gate::Go
                } else {
                    Gate::Wait(e.next_at - now)
                }
            }
        }
    }

    /// Records a failed attempt; returns what the status shows and the delay.
    fn failed(
        &self,
        key: &str,
        step: &'static str,
        inputs: u64,
        code: &str,
        message: &str,
        final_answer: bool,
    ) -> (StepFailure, Duration) {
        let mut entries = self.lock();
        let steps = entries.entry(key.to_string()).or_default();
        let previous = steps.get(step).filter(|e| e.inputs == inputs);
        let attempts = previous.map_or(0, |e| e.failure.attempts) + 1;
        let since = previous.map_or_else(Timestamp::now, |e| e.failure.since);
        // Whole milliseconds, so the status written round-trips exactly.
        let delay =
            Duration::from_millis(self.schedule.delay(attempts, final_answer).as_millis() as u64);
        let now = Timestamp::now().system();
        let failure = StepFailure {
            step: step.to_string(),
            since,
            attempts,
            code: code.to_string(),
            message: message.to_string(),
            final_answer,
            next_retry: Timestamp::from_system(now.checked_add(delay).unwrap_or(now)),
        };
        steps.insert(
            step,
            Entry {
                inputs,
                next_at: Instant::now() + delay,
                failure: failure.clone(),
            },
        );
        (failure, delay)
    }

    /// Forgets a step after its success.
    fn succeeded(&self, key: &str, step: &'static str) {
        let mut entries = self.lock();
        if let Some(steps) = entries.get_mut(key) {
            steps.remove(step);
            if steps.is_empty() {
                entries.remove(key);
            }
        }
    }

    /// The recorded failure of a step, if it is backing off.
    pub fn failure(&self, key: &str, step: &'static str) -> Option<StepFailure> {
        self.lock().get(key)?.get(step).map(|e| e.failure.clone())
    }

    /// The failure of `key`'s step tried last, if any of its steps is backing off.
    pub fn latest_failure(&self, key: &str) -> Option<StepFailure> {
        self.lock()
            .get(key)?
            .values()
            .max_by_key(|e| e.next_at)
            .map(|e| e.failure.clone())
    }

    /// How long until the soonest retry of any failing step of `key`.
    pub fn remaining(&self, key: &str) -> Option<Duration> {
        let now = Instant::now();
        self.lock()
            .get(key)?
            .values()
            .map(|e| e.next_at.saturating_duration_since(now))
            .min()
    }

    /// Forgets every step of an object that is gone.
    pub fn forget(&self, key: &str) {
        self.lock().remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn steps() -> Steps {
        Steps::new(Schedule {
            initial: Duration::from_secs(1),
            cap: Duration::from_secs(60),
            jitter: false,
        })
    }

    #[tokio::test(start_paused = true)]
    async fn a_retryable_failure_backs_off_and_doubles() {
        let s = steps();
        assert_eq!(s.gate("k", "Stage", 1), Gate::Go);
        let (f, d) = s.failed("k", "Stage", 1, "Unavailable", "down", false);
        assert_eq!((f.attempts, d), (1, Duration::from_secs(1)));
        assert_eq!(s.gate("k", "Stage", 1), Gate::Wait(Duration::from_secs(1)));
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(s.gate("k", "Stage", 1), Gate::Go);
        let (f2, d) = s.failed("k", "Stage", 1, "Unavailable", "down", false);
        assert_eq!((f2.attempts, d), (2, Duration::from_secs(2)));
        assert_eq!(f2.since, f.since, "since the first failure of the run");
    }

    #[tokio::test(start_paused = true)]
    async fn a_final_answer_waits_for_the_cap() {
        let s = steps();
        let (f, d) = s.failed("k", "Stage", 1, "InvalidArgument", "bad", true);
        assert!(f.final_answer);
        assert_eq!(d, Duration::from_secs(60));
        tokio::time::advance(Duration::from_secs(59)).await;
        assert!(matches!(s.gate("k", "Stage", 1), Gate::Wait(_)));
    }

    #[tokio::test(start_paused = true)]
    async fn only_a_change_of_inputs_or_a_success_resets_the_schedule() {
        let s = steps();
        s.failed("k", "Stage", 1, "InvalidArgument", "bad", true);
        // Asking again with the same inputs (a self-caused trigger) changes nothing.
        for _ in 0..100 {
            assert!(matches!(s.gate("k", "Stage", 1), Gate::Wait(_)));
        }
        assert_eq!(s.failure("k", "Stage").unwrap().attempts, 1);
        // Another step and another key are their own.
        assert_eq!(s.gate("k", "Publish", 1), Gate::Go);
        assert_eq!(s.gate("k2", "Stage", 1), Gate::Go);
        // New inputs: at once.
        assert_eq!(s.gate("k", "Stage", 2), Gate::Go);
        s.failed("k", "Stage", 2, "Unavailable", "down", false);
        s.succeeded("k", "Stage");
        assert_eq!(s.gate("k", "Stage", 2), Gate::Go);
    }

    #[test]
    fn the_call_bound_follows_the_schedule() {
        let s = Schedule {
            initial: Duration::from_secs(1),
            cap: Duration::from_secs(60),
            jitter: false,
        };
        // At 0, 1, 3, 7 s within 10 s.
        assert_eq!(s.max_attempts_within(Duration::from_secs(10), false), 4);
        assert_eq!(s.max_attempts_within(Duration::from_secs(10), true), 1);
    }
}
