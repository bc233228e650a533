//! The controller: triggers → keyed queue → bounded concurrent reconciles.
//!
//! Expected flow:
//! 1. Triggers (the kind's own watcher events, related kinds' events mapped to keys,
//!    any key stream) schedule keys now; a periodic resync schedules every cached key.
//!    A controller that trusts converged status ([`Controller::owns_trusting`]) puts
//!    the keys of a relist (its start, a watch that lost its place) in a repair pass
//!    behind every change when their object says it is converged; a resync is always
//!    such a pass. Nothing is skipped: the pass runs whenever no change is due, and
//!    one key in [`REPAIR_EVERY`](super::queue::REPAIR_EVERY) handed out is a repair while any is due.
//! 2. Due keys run, at most `concurrency` at once and never one key twice at once; a
//!    burst of triggers for one key collapses into one run (plus one more if triggers
//!    arrived during the run).
//! 3. `reconcile(ctx, key)` (kube-runtime's contract: the reconciler's shared context as
//!    an `Arc`, and the key typed, [`Key`]: read once from the queue's string, a key
//!    no object of the kind can have is dropped with a warning) returns an [`Action`]:
//!    requeue after a delay, or await the next
//!    change. An error says how it is treated ([`ReconcileError::policy`]): a lost
//!    write race is looked at again soon and quietly; anything else requeues the key
//!    after a per-key exponential backoff (jittered) that a success resets.
//! 4. On shutdown no new run starts and the running ones are awaited.

use futures::stream::{BoxStream, SelectAll};
use futures::{Stream, StreamExt};
use std::collections::HashMap;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;

use std::time::Duration;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::backoff::Backoff;
use super::metrics::ControllerMetrics;
use super::queue::{Class, Queue};
use super::reflector::Store;
use super::watcher::Event;
use super::Resource;
use crate::process::error_chain;

/// What to do with a key after a successful reconcile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Run again after this delay (unless a change triggers it sooner).
    Requeue(Duration),
    /// Run again only when something triggers it.
    AwaitChange,
}

/// How the runtime treats a failed reconcile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorPolicy {
    /// A guarded write lost a race (usually the cache lagged a write): run again soon,
    /// quietly, unless it keeps happening.
    Conflict,
    /// A failure: logged, and retried on the key's backoff.
    Backoff,
}

/// A reconciler's error, which says how the runtime should treat it. Each reconciler
/// decides; the runtime does not look inside errors.
pub trait ReconcileError: std::error::Error + Send + 'static {
    /// How this error is treated.
    fn policy(&self) -> ErrorPolicy;
}

/// A lost write race is looked at again soon; anything else backs off. (Here, with the
/// policy, so the store does not depend on the runtime.)
impl ReconcileError for crate::store::StoreError {
    fn policy(&self) -> ErrorPolicy {
        if self.is_conflict() {
            ErrorPolicy::Conflict
        } else {
            ErrorPolicy::Backoff
        }
    }
}

/// The key a controller hands its reconciler: what its queue holds (a string) read
/// back as the reconciler's type once per run.
pub trait Key: Clone + Send + Sync + Into<String> + 'static {
    /// The key `queued` names, or `None` when no object of the controller's kind can
    /// have it.
    fn from_queue(queued: String) -> Option<Self>;
}

impl Key for String {
    fn from_queue(queued: String) -> Option<Self> {
        Some(queued)
    }
}

impl<S: crate::api::Spec> Key for crate::api::ObjectKey<S> {
    fn from_queue(queued: String) -> Option<Self> {
        crate::api::ObjectKey::parse_owned(queued).ok()
    }
}

/// How a controller runs.
#[derive(Debug, Clone)]
pub struct Config {
    /// Most reconciles at once.
    pub concurrency: usize,
    /// Every cached key is scheduled at this interval; `None` disables resync.
    pub resync: Option<Duration>,
    /// The per-key delays after consecutive failures.
    pub backoff: Backoff,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            concurrency: 8,
            resync: Some(Duration::from_secs(300)),
            backoff: Backoff::new(Duration::from_millis(500), Duration::from_secs(300)),
        }
    }
}

/// A controller for objects of type `K`, keyed by their store key, whose reconciler
/// takes keys of type `Q`.
pub struct Controller<K: Resource, Q: Key> {
    name: String,
    reader: Store<K>,
    /// Keys, and what scheduled each.
    triggers: SelectAll<BoxStream<'static, (String, Trigger)>>,
    /// Whether a relist's keys go in the repair pass (see [`Controller::owns_trusting`]).
    trusting: bool,
    config: Config,
    metrics: ControllerMetrics,
    key: PhantomData<fn() -> Q>,
}

impl<K: Resource, Q: Key> Controller<K, Q> {
    /// A controller over the cache `reader` (used for resync).
    pub fn new(name: &str, reader: Store<K>, config: Config) -> Self {
        Controller {
            name: name.to_string(),
            reader,
            triggers: SelectAll::new(),
            trusting: false,
            config,
            metrics: ControllerMetrics::unregistered(),
            key: PhantomData,
        }
    }

    /// Records into these metric handles.
    pub fn with_metrics(mut self, metrics: ControllerMetrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Triggers on the kind's own events (usually the reflector's stream).
    pub fn owns<E>(self, events: impl Stream<Item = Result<Event<K>, E>> + Send + 'static) -> Self
    where
        E: std::error::Error + Send + 'static,
    {
        self.map_events(events, |obj: &K| vec![obj.key()], true, false, |_| false)
    }

    /// [`Controller::owns`], trusting converged status: a relist's objects for which
    /// `converged` holds (their status says the last reconcile left nothing to do) are
    /// reconciled in a repair pass behind every change, and so are the keys related
    /// kinds' relists map to. A start then serves new changes once its caches are
    /// listed instead of after a no-op pass over every object. `converged` decides
    /// only the order: every key still runs.
    pub fn owns_trusting<E>(
        mut self,
        events: impl Stream<Item = Result<Event<K>, E>> + Send + 'static,
        converged: impl Fn(&K) -> bool + Send + Sync + 'static,
    ) -> Self
    where
        E: std::error::Error + Send + 'static,
    {
        self.trusting = true;
        self.map_events(events, |obj: &K| vec![obj.key()], true, false, converged)
    }

    /// Triggers on a related kind's events, mapped to the keys they concern.
    pub fn watches<R, E>(
        self,
        events: impl Stream<Item = Result<Event<R>, E>> + Send + 'static,
        mapper: impl Fn(&R) -> Vec<Q> + Send + Sync + 'static,
    ) -> Self
    where
        R: Resource,
        E: std::error::Error + Send + 'static,
    {
        self.map_events(events, mapper, false, false, |_| true)
    }

    /// [`Controller::watches`] whose keys run before every other due key: for the
    /// change an operator waits on (an allocation stopped), which must not queue
    /// behind the follow-up work of every other object.
    pub fn watches_urgent<R, E>(
        self,
        events: impl Stream<Item = Result<Event<R>, E>> + Send + 'static,
        mapper: impl Fn(&R) -> Vec<Q> + Send + Sync + 'static,
    ) -> Self
    where
        R: Resource,
        E: std::error::Error + Send + 'static,
    {
        self.map_events(events, mapper, false, true, |_| true)
    }

    /// Triggers on the keys `mapper` gives for each event's objects: a change's
    /// urgent or not, a relist's [`Trigger::Relist`] where `relisted` holds for the
    /// object.
    fn map_events<R, E, T>(
        mut self,
        events: impl Stream<Item = Result<Event<R>, E>> + Send + 'static,
        mapper: impl Fn(&R) -> Vec<T> + Send + Sync + 'static,
        own_kind: bool,
        urgent: bool,
        relisted: impl Fn(&R) -> bool + Send + Sync + 'static,
    ) -> Self
    where
        R: Resource,
        E: std::error::Error + Send + 'static,
        T: Into<String>,
    {
        let name = self.name.clone();
        let keys = events.flat_map(move |item| {
            let change = Trigger::Change(urgent);
            let keys: Vec<(String, Trigger)> = match item {
                Ok(Event::Restarted(objs)) => objs
                    .iter()
                    .flat_map(|o| {
                        let t = if relisted(o) { Trigger::Relist } else { change };
                        mapper(o).into_iter().map(move |k| (k.into(), t))
                    })
                    .collect(),
                Ok(Event::Applied(obj)) => mapper(&obj)
                    .into_iter()
                    .map(|k| (k.into(), change))
                    .collect(),
                Ok(Event::Deleted {
                    last: Some(obj), ..
                }) => mapper(&obj)
                    .into_iter()
                    .map(|k| (k.into(), change))
                    .collect(),
                // A deletion whose last state is unknown names only its own key, which
                // is a key of this controller only when the events are its own kind's.
                Ok(Event::Deleted { key, last: None }) if own_kind => vec![(key, change)],
                Ok(Event::Deleted { last: None, .. }) => Vec::new(),
                Err(e) => {
                    tracing::warn!(controller = %name, error = %error_chain(&e), "watch error");
                    Vec::new()
                }
            };
            futures::stream::iter(keys)
        });
        self.triggers.push(keys.boxed());
        self
    }

    /// Triggers on any stream of keys.
    pub fn trigger(mut self, keys: impl Stream<Item = Q> + Send + 'static) -> Self {
        self.triggers
            .push(keys.map(|k| (k.into(), Trigger::Change(false))).boxed());
        self
    }

    /// Runs `reconcile(ctx, key)` for each due key until `shutdown` is cancelled, then
    /// waits for running reconciles.
    pub async fn run<C, F, Fut, E>(self, reconcile: F, ctx: Arc<C>, shutdown: CancellationToken)
    where
        C: Send + Sync + 'static,
        F: Fn(Arc<C>, Q) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: ReconcileError,
    {
        let Controller {
            name,
            reader,
            mut triggers,
            trusting,
            config,
            metrics,
            key: _,
        } = self;
        let concurrency = config.concurrency.max(1);
        let mut queue = Queue::new();
        let mut outcomes = Outcomes {
            name: &name,
            backoff: &config.backoff,
            metrics: &metrics,
            failures: HashMap::new(),
            conflicts: HashMap::new(),
        };
        let mut tasks: JoinSet<(Duration, Result<Action, E>)> = JoinSet::new();
        let mut running: HashMap<tokio::task::Id, String> = HashMap::new();
        let mut triggers_open = true;
        let mut resync = config
            .resync
            .map(|d| tokio::time::interval_at(Instant::now() + d, d));

        loop {
            let now = Instant::now();
            while tasks.len() < concurrency {
                let Some(key) = queue.pop_ready(now) else {
                    break;
                };
                let Some(typed) = Q::from_queue(key.clone()) else {
                    tracing::warn!(controller = %name, key = %key, "not a key of this controller's kind; dropped");
                    queue.finish(&key);
                    continue;
                };
                let span = tracing::info_span!("reconcile", controller = %name, object = %key);
                let fut = reconcile(ctx.clone(), typed);
                let handle = tasks.spawn(
                    async move {
                        let start = Instant::now();
                        let result = fut.await;
                        (start.elapsed(), result)
                    }
                    .instrument(span),
                );
                running.insert(handle.id(), key);
            }
            let waited = queue.change_due_since(now).map(|t| now - t);
            metrics.set_queue(queue.depth(), queue.repairs(), waited.unwrap_or_default());
            let due = queue.next_due();
            let can_launch = tasks.len() < concurrency;
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                Some(joined) = tasks.join_next_with_id(), if !tasks.is_empty() => {
                    let (key, outcome) = joined_outcome(&mut running, joined);
                    outcomes.finished(&mut queue, key, outcome, true);
                }
                next = triggers.next(), if triggers_open => match next {
                    Some((key, trigger)) => {
                        queue.schedule_as(key, Instant::now(), trigger.class(trusting));
                    }
                    None => triggers_open = false,
                },
                _ = tokio::time::sleep_until(due.unwrap_or(now)), if due.is_some() && can_launch => {}
                _ = tick(&mut resync), if resync.is_some() => {
                    let now = Instant::now();
                    for key in reader.keys() {
                        queue.schedule_as(key, now, Class::Repair);
                    }
                }
            }
        }
        while let Some(joined) = tasks.join_next_with_id().await {
            let (key, outcome) = joined_outcome(&mut running, joined);
            outcomes.finished(&mut queue, key, outcome, false);
        }
        tracing::debug!(controller = %name, "controller stopped");
    }
}

/// What a controller makes of each finished reconcile: the key's conflicts and
/// failures in a row, the metrics, and when it runs again.
struct Outcomes<'a> {
    name: &'a str,
    backoff: &'a Backoff,
    metrics: &'a ControllerMetrics,
    failures: HashMap<String, u32>,
    conflicts: HashMap<String, u32>,
}

impl Outcomes<'_> {
    /// Settles `key`'s run (`outcome`: how long it took and its result, or a panic)
    /// and, with `reschedule`, schedules it again when its action or its failure says.
    fn finished<E: ReconcileError>(
        &mut self,
        queue: &mut Queue,
        key: String,
        outcome: Result<(Duration, Result<Action, E>), String>,
        reschedule: bool,
    ) {
        queue.finish(&key);
        let (took, result) = self.conflicts_quietly(&key, outcome);
        self.metrics.record(took, result.is_err());
        let next = match result {
            Ok(action) => {
                self.failures.remove(&key);
                match action {
                    Action::Requeue(after) => Some(after),
                    Action::AwaitChange => None,
                }
            }
            Err(error) => {
                let n = self.failures.entry(key.clone()).or_default();
                *n += 1;
                let delay = self.backoff.delay(*n);
                tracing::warn!(controller = %self.name, object = %key, failures = *n,
                    retry_in = ?delay, %error, "reconcile failed");
                Some(delay)
            }
        };
        if let (Some(after), true) = (next, reschedule) {
            queue.schedule(key, Instant::now() + after);
        }
    }

    /// A guarded write that lost a race (usually the cache lagged a write) is looked at
    /// again soon, quietly, unless it keeps happening; anything else as it came.
    fn conflicts_quietly<E: ReconcileError>(
        &mut self,
        key: &str,
        outcome: Result<(Duration, Result<Action, E>), String>,
    ) -> (Duration, Result<Action, String>) {
        let conflict = matches!(&outcome, Ok((_, Err(e))) if e.policy() == ErrorPolicy::Conflict);
        if !conflict {
            self.conflicts.remove(key);
        }
        match outcome {
            Ok((took, Err(e))) if conflict => {
                let n = self.conflicts.entry(key.to_string()).or_default();
                *n += 1;
                if *n <= QUIET_CONFLICTS {
                    tracing::debug!(controller = %self.name, object = %key, error = %error_chain(&e), "conflict; looking again");
                    (took, Ok(Action::Requeue(CONFLICT_RETRY)))
                } else {
                    (took, Err(error_chain(&e)))
                }
            }
            Ok((took, result)) => (took, result.map_err(|e| error_chain(&e))),
            Err(panic) => (Duration::ZERO, Err(panic)),
        }
    }
}

/// What scheduled a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Trigger {
    /// A change (urgent or not), or a relisted object a trusting controller must look at.
    Change(bool),
    /// A relist: its own object says it is converged, or a related kind relisted.
    Relist,
}

impl Trigger {
    fn class(self, trusting: bool) -> Class {
        match self {
            Trigger::Change(true) => Class::Urgent,
            Trigger::Relist if trusting => Class::Repair,
            Trigger::Change(false) | Trigger::Relist => Class::Normal,
        }
    }
}

type Joined<T> = Result<(tokio::task::Id, T), tokio::task::JoinError>;

fn joined_outcome<T>(
    running: &mut HashMap<tokio::task::Id, String>,
    joined: Joined<T>,
) -> (String, Result<T, String>) {
    match joined {
        Ok((id, value)) => (running.remove(&id).unwrap_or_default(), Ok(value)),
        Err(e) => (
            running.remove(&e.id()).unwrap_or_default(),
            Err(format!("reconcile panicked: {e}")),
        ),
    }
}

async fn tick(interval: &mut Option<tokio::time::Interval>) {
    match interval {
        Some(i) => {
            i.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// How soon a reconcile that lost a write race runs again.
const CONFLICT_RETRY: Duration = Duration::from_millis(50);
/// Conflicts in a row on one key retried quietly before they count as failures.
const QUIET_CONFLICTS: u32 = 10;

#[cfg(test)]
mod tests {
    use super::super::reflector;
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use tokio::sync::mpsc;

    #[derive(Clone, Debug)]
    struct Obj(String);
    impl Resource for Obj {
        fn key(&self) -> String {
            self.0.clone()
        }
    }

    #[derive(Debug, thiserror::Error)]
    #[error("boom")]
    struct Boom;

    impl ReconcileError for Boom {
        fn policy(&self) -> ErrorPolicy {
            ErrorPolicy::Backoff
        }
    }

    fn config(concurrency: usize) -> Config {
        Config {
            concurrency,
            resync: None,
            backoff: Backoff::new(Duration::from_secs(1), Duration::from_secs(60)).without_jitter(),
        }
    }

    fn key_channel() -> (mpsc::UnboundedSender<String>, impl Stream<Item = String>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (tx, tokio_stream_from(rx))
    }

    fn tokio_stream_from(mut rx: mpsc::UnboundedReceiver<String>) -> impl Stream<Item = String> {
        futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
    }

    /// Records (key, time since start) of each reconcile start.
    type Log = Arc<Mutex<Vec<(String, Duration)>>>;

    #[tokio::test(start_paused = true)]
    async fn a_burst_for_one_key_runs_once_plus_once() {
        let (reader, _writer) = reflector::store::<Obj>();
        let (tx, keys) = key_channel();
        for _ in 0..100 {
            tx.send("a".into()).unwrap();
        }
        let runs = Arc::new(AtomicUsize::new(0));
        let shutdown = CancellationToken::new();
        let r = runs.clone();
        let ctl = Controller::new("t", reader, config(4)).trigger(keys);
        let handle = tokio::spawn(ctl.run(
            move |_: Arc<()>, _key: String| {
                let r = r.clone();
                async move {
                    r.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    Ok::<_, Boom>(Action::AwaitChange)
                }
            },
            Arc::new(()),
            shutdown.clone(),
        ));
        tokio::time::sleep(Duration::from_secs(10)).await;
        // The first trigger starts a run; the other 99 arrive during it and collapse into
        // one more run.
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        shutdown.cancel();
        handle.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_never_runs_twice_at_once_but_keys_run_in_parallel() {
        let (reader, _writer) = reflector::store::<Obj>();
        let (tx, keys) = key_channel();
        let in_flight: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
        let max_same = Arc::new(AtomicUsize::new(0));
        let max_total = Arc::new(AtomicUsize::new(0));
        let shutdown = CancellationToken::new();
        let (f, ms, mt) = (in_flight.clone(), max_same.clone(), max_total.clone());
        let ctl = Controller::new("t", reader, config(3)).trigger(keys);
        let handle = tokio::spawn(ctl.run(
            move |_: Arc<()>, key: String| {
                let (f, ms, mt) = (f.clone(), ms.clone(), mt.clone());
                async move {
                    {
                        let mut m = f.lock().unwrap();
                        *m.entry(key.clone()).or_default() += 1;
                        ms.fetch_max(m[&key], Ordering::SeqCst);
                        mt.fetch_max(m.values().sum(), Ordering::SeqCst);
                    }
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    *f.lock().unwrap().get_mut(&key).unwrap() -= 1;
                    Ok::<_, Boom>(Action::AwaitChange)
                }
            },
            Arc::new(()),
            shutdown.clone(),
        ));
        for round in 0..20 {
            for k in ["a", "b", "c", "d", "e"] {
                tx.send(k.into()).unwrap();
            }
            tokio::time::sleep(Duration::from_millis(50 + round)).await;
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(
            max_same.load(Ordering::SeqCst),
            1,
            "one key ran twice at once"
        );
        assert_eq!(
            max_total.load(Ordering::SeqCst),
            3,
            "concurrency bound not used or exceeded"
        );
        shutdown.cancel();
        handle.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn failures_back_off_exponentially_and_success_resets() {
        let (reader, _writer) = reflector::store::<Obj>();
        let (tx, keys) = key_channel();
        let log: Log = Arc::default();
        let calls = Arc::new(AtomicUsize::new(0));
        let shutdown = CancellationToken::new();
        let start = Instant::now();
        let (l, c) = (log.clone(), calls.clone());
        let ctl = Controller::new("t", reader, config(1)).trigger(keys);
        let handle = tokio::spawn(ctl.run(
            move |_: Arc<()>, key: String| {
                let (l, c) = (l.clone(), c.clone());
                async move {
                    l.lock().unwrap().push((key, start.elapsed()));
                    // Calls 1-3 fail, 4 succeeds, 5 fails, 6 succeeds.
                    match c.fetch_add(1, Ordering::SeqCst) + 1 {
                        1..=3 | 5 => Err(Boom),
                        _ => Ok(Action::AwaitChange),
                    }
                }
            },
            Arc::new(()),
            shutdown.clone(),
        ));
        tx.send("a".into()).unwrap();
        tokio::time::sleep(Duration::from_secs(20)).await;
        tx.send("a".into()).unwrap();
        tokio::time::sleep(Duration::from_secs(20)).await;
        shutdown.cancel();
        handle.await.unwrap();
        let times: Vec<u64> = log
            .lock()
            .unwrap()
            .iter()
            .map(|(_, t)| t.as_secs())
            .collect();
        // 0, +1, +2, +4 (success); triggered at 20, fails, retried after 1 s: reset.
        assert_eq!(times, [0, 1, 3, 7, 20, 21]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_conflict_is_retried_soon_until_it_keeps_happening() {
        #[derive(Debug, thiserror::Error)]
        #[error("reconcile failed")]
        struct Wrapped(#[source] crate::store::StoreError);

        impl ReconcileError for Wrapped {
            fn policy(&self) -> ErrorPolicy {
                self.0.policy()
            }
        }

        let (reader, _writer) = reflector::store::<Obj>();
        let (tx, keys) = key_channel();
        let log: Log = Arc::default();
        let shutdown = CancellationToken::new();
        let start = Instant::now();
        let l = log.clone();
        let ctl = Controller::new("t", reader, config(1)).trigger(keys);
        let handle = tokio::spawn(ctl.run(
            move |_: Arc<()>, key: String| {
                let l = l.clone();
                async move {
                    l.lock().unwrap().push((key, start.elapsed()));
                    Err::<Action, _>(Wrapped(crate::store::StoreError::Conflict {
                        key: "k".into(),
                        expected: 1,
                    }))
                }
            },
            Arc::new(()),
            shutdown.clone(),
        ));
        tx.send("a".into()).unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
        shutdown.cancel();
        handle.await.unwrap();
        let times: Vec<u128> = log
            .lock()
            .unwrap()
            .iter()
            .map(|(_, t)| t.as_millis())
            .collect();
        // Ten quiet retries 50 ms apart, then the failure backoff: +1 s, +2 s.
        let quiet: Vec<u128> = (0..=QUIET_CONFLICTS as u128).map(|i| i * 50).collect();
        assert_eq!(times[..quiet.len()], quiet[..]);
        assert_eq!(times[quiet.len()..], [1500, 3500]);
    }

    #[tokio::test(start_paused = true)]
    async fn requeue_after_and_resync_schedule_runs() {
        let (reader, mut writer) = reflector::store::<Obj>();
        writer.apply(&Event::restarted(vec![Obj("x".into()), Obj("y".into())]));
        let (tx, keys) = key_channel();
        let log: Log = Arc::default();
        let shutdown = CancellationToken::new();
        let start = Instant::now();
        let l = log.clone();
        let cfg = Config {
            resync: Some(Duration::from_secs(100)),
            ..config(2)
        };
        let ctl = Controller::new("t", reader, cfg).trigger(keys);
        let handle = tokio::spawn(ctl.run(
            move |_: Arc<()>, key: String| {
                let l = l.clone();
                async move {
                    l.lock().unwrap().push((key.clone(), start.elapsed()));
                    Ok::<_, Boom>(if key == "a" {
                        Action::Requeue(Duration::from_secs(30))
                    } else {
                        Action::AwaitChange
                    })
                }
            },
            Arc::new(()),
            shutdown.clone(),
        ));
        tx.send("a".into()).unwrap();
        tokio::time::sleep(Duration::from_secs(150)).await;
        shutdown.cancel();
        handle.await.unwrap();
        let log = log.lock().unwrap();
        let at = |k: &str| -> Vec<u64> {
            log.iter()
                .filter(|(key, _)| key == k)
                .map(|(_, t)| t.as_secs())
                .collect()
        };
        assert_eq!(at("a"), [0, 30, 60, 90, 120]);
        assert_eq!(at("x"), [100]);
        assert_eq!(at("y"), [100]);
    }

    /// Runs a controller of concurrency 1 whose reconciles take a second each over
    /// `own` (its kind's events) and `related`, for `secs`; the keys in run order.
    async fn run_order(
        own: Vec<Event<Obj>>,
        related: Vec<Event<Related>>,
        trusting: bool,
        secs: u64,
    ) -> Vec<String> {
        let (reader, mut writer) = reflector::store::<Obj>();
        for e in &own {
            writer.apply(e);
        }
        let log: Log = Arc::default();
        let shutdown = CancellationToken::new();
        let l = log.clone();
        let start = Instant::now();
        let own = futures::stream::iter(own.into_iter().map(Ok::<_, Boom>));
        let ctl = Controller::new("t", reader, config(1));
        let ctl = if trusting {
            // Objects named c* say they are converged.
            ctl.owns_trusting(own, |o: &Obj| o.0.starts_with('c'))
        } else {
            ctl.owns(own)
        };
        let ctl = ctl.watches(
            futures::stream::iter(related.into_iter().map(Ok::<_, Boom>)),
            |r: &Related| r.owners.iter().map(|o| o.to_string()).collect(),
        );
        let handle = tokio::spawn(ctl.run(
            move |_: Arc<()>, key: String| {
                let l = l.clone();
                async move {
                    l.lock().unwrap().push((key, start.elapsed()));
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    Ok::<_, Boom>(Action::AwaitChange)
                }
            },
            Arc::new(()),
            shutdown.clone(),
        ));
        tokio::time::sleep(Duration::from_secs(secs)).await;
        shutdown.cancel();
        handle.await.unwrap();
        let log = log.lock().unwrap();
        log.iter().map(|(k, _)| k.clone()).collect()
    }

    fn objs(names: &[&str]) -> Vec<Obj> {
        names.iter().map(|n| Obj(n.to_string())).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_trusting_start_serves_changes_before_its_repair_pass() {
        let own = vec![
            Event::restarted(objs(&["c1", "c2", "p1", "c3", "c4"])),
            Event::applied(Obj("n1".into())),
        ];
        // A related kind's relist maps to keys too: repairs, unless their own object
        // is not converged (p1).
        let related = vec![Event::restarted(vec![Related {
            name: "r",
            owners: vec!["c4", "p1"],
        }])];
        let sorted = |keys: &[String]| {
            let mut keys = keys.to_vec();
            keys.sort();
            keys
        };
        let order = run_order(own.clone(), related.clone(), true, 20).await;
        // c1 was the only key when the loop first looked, and started at once.
        assert_eq!(order.len(), 6, "{order:?}");
        assert_eq!(order[0], "c1", "{order:?}");
        assert_eq!(sorted(&order[1..3]), ["n1", "p1"], "{order:?}");
        assert_eq!(sorted(&order[3..]), ["c2", "c3", "c4"], "{order:?}");
        // Without trust, the relist's keys are changes like any other, in their order.
        let order = run_order(own, related, false, 20).await;
        assert_eq!(order.len(), 6, "{order:?}");
        assert_eq!(order.last().map(String::as_str), Some("n1"), "{order:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_resync_is_a_repair_pass_behind_changes() {
        // The resync at 10 s schedules every cached key as a repair; a change (a
        // trigger at 10.5 s, below) runs before the rest of that pass.
        let (reader, mut writer) = reflector::store::<Obj>();
        writer.apply(&Event::restarted(objs(&["a", "b", "c", "d"])));
        let (tx, keys) = key_channel();
        let log: Log = Arc::default();
        let shutdown = CancellationToken::new();
        let l = log.clone();
        let start = Instant::now();
        let cfg = Config {
            resync: Some(Duration::from_secs(10)),
            ..config(1)
        };
        let handle = tokio::spawn(Controller::new("t", reader, cfg).trigger(keys).run(
            move |_: Arc<()>, key: String| {
                let l = l.clone();
                async move {
                    l.lock().unwrap().push((key, start.elapsed()));
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    Ok::<_, Boom>(Action::AwaitChange)
                }
            },
            Arc::new(()),
            shutdown.clone(),
        ));
        tokio::time::sleep(Duration::from_millis(10_500)).await;
        tx.send("e".into()).unwrap();
        tokio::time::sleep(Duration::from_secs(8)).await;
        shutdown.cancel();
        handle.await.unwrap();
        let order: Vec<String> = log.lock().unwrap().iter().map(|(k, _)| k.clone()).collect();
        assert_eq!(order.len(), 5, "{order:?}");
        assert_eq!(order[1], "e", "the change runs next: {order:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_waits_for_running_reconciles_and_starts_none() {
        let (reader, _writer) = reflector::store::<Obj>();
        let (tx, keys) = key_channel();
        let done = Arc::new(AtomicUsize::new(0));
        let shutdown = CancellationToken::new();
        let d = done.clone();
        let ctl = Controller::new("t", reader, config(1)).trigger(keys);
        let handle = tokio::spawn(ctl.run(
            move |_: Arc<()>, _key: String| {
                let d = d.clone();
                async move {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    d.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, Boom>(Action::AwaitChange)
                }
            },
            Arc::new(()),
            shutdown.clone(),
        ));
        tx.send("a".into()).unwrap();
        tx.send("b".into()).unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
        shutdown.cancel();
        handle.await.unwrap();
        assert_eq!(
            done.load(Ordering::SeqCst),
            1,
            "a finished, b never started"
        );
    }

    #[derive(Clone, Debug)]
    struct Related {
        name: &'static str,
        owners: Vec<&'static str>,
    }
    impl Resource for Related {
        fn key(&self) -> String {
            self.name.to_string()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn related_kinds_trigger_the_keys_they_map_to() {
        let (reader, _writer) = reflector::store::<Obj>();
        let related: Vec<Result<Event<Related>, Boom>> = vec![
            Ok(Event::restarted(vec![Related {
                name: "r1",
                owners: vec!["a"],
            }])),
            Ok(Event::applied(Related {
                name: "r2",
                owners: vec!["b", "c"],
            })),
            Ok(Event::Deleted {
                key: "r3".into(),
                last: Some(Arc::new(Related {
                    name: "r3",
                    owners: vec!["d"],
                })),
            }),
            // A related object deleted without its last state names no owner.
            Ok(Event::Deleted {
                key: "r4".into(),
                last: None,
            }),
            Err(Boom),
        ];
        let log: Log = Arc::default();
        let shutdown = CancellationToken::new();
        let l = log.clone();
        let start = Instant::now();
        let ctl = Controller::new("t", reader, config(2))
            .watches(futures::stream::iter(related), |r: &Related| {
                r.owners.iter().map(|o| o.to_string()).collect()
            });
        let handle = tokio::spawn(ctl.run(
            move |_: Arc<()>, key: String| {
                let l = l.clone();
                async move {
                    l.lock().unwrap().push((key, start.elapsed()));
                    Ok::<_, Boom>(Action::AwaitChange)
                }
            },
            Arc::new(()),
            shutdown.clone(),
        ));
        tokio::time::sleep(Duration::from_secs(1)).await;
        shutdown.cancel();
        handle.await.unwrap();
        let mut keys: Vec<String> = log.lock().unwrap().iter().map(|(k, _)| k.clone()).collect();
        keys.sort();
        assert_eq!(keys, ["a", "b", "c", "d"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_panicking_reconcile_is_a_failure_not_a_crash() {
        let (reader, _writer) = reflector::store::<Obj>();
        let (tx, keys) = key_channel();
        let calls = Arc::new(AtomicUsize::new(0));
        let shutdown = CancellationToken::new();
        let c = calls.clone();
        let metrics = ControllerMetrics::unregistered();
        let ctl = Controller::new("t", reader, config(1))
            .with_metrics(metrics.clone())
            .trigger(keys);
        let handle = tokio::spawn(ctl.run(
            move |_: Arc<()>, _key: String| {
                let c = c.clone();
                async move {
                    if c.fetch_add(1, Ordering::SeqCst) == 0 {
                        panic!("reconcile bug");
                    }
                    Ok::<_, Boom>(Action::AwaitChange)
                }
            },
            Arc::new(()),
            shutdown.clone(),
        ));
        tx.send("a".into()).unwrap();
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(calls.load(Ordering::SeqCst), 2, "retried after the panic");
        assert_eq!(metrics.reconciles(), 2);
        assert_eq!(metrics.failures(), 1);
        shutdown.cancel();
        handle.await.unwrap();
    }
}
