//! Recording events: what a reconciler did or could not do, for `moorctl events`.
//!
//! Recording never waits for the store and never fails the caller: [`Recorder::record`]
//! logs the event and queues it; one writer task per recorder takes whatever has
//! queued and writes it in one transaction (up to [`MAX_BATCH`] events), so a burst of
//! reconciles costs a few event writes instead of one synchronous write each. That
//! transaction rides: it waits up to [`RIDE`] for another write of the process (the
//! status write the events describe, or the next one) and joins its transaction, so
//! events cost the store no revision, fdatasync or watch delivery of their own under
//! load; on an idle system they go alone after [`RIDE`]. A full queue drops the event
//! (it was logged) and counts it in `moor_events_dropped_total`.
//!
//! Repeats fold: an event like one this recorder wrote before (same object, related
//! object, type, reason, and message up to its numbers) updates that event's
//! `series` (count, first and last time) instead of making another. The first of a
//! run is written at once; its repeats at most once per window (`--event-window`),
//! so a step failing a hundred times costs a handful of writes, not a hundred.
//!
//! Events expire: each is written under a lease shared by every event of the same
//! time window (not one lease per event, which would cost etcd a lease per write), so
//! a window's events all go when its lease does. A run longer than that starts a new
//! event.
//!
//! Nothing said is lost on a clean stop: [`flush`], called by a daemon's `main` after
//! its work stopped, has every writer write what is queued and what is folded, within
//! a grace period.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::api::{Event, EventSeries, EventSpec, EventType, Name, Namespace, ObjectRef, Timestamp};
use crate::store::{Batch, LeaseId, Store, StoreError};

/// How long events are kept.
pub const RETENTION: Duration = Duration::from_secs(3600);
/// How long one lease is shared before the next window's.
const WINDOW: Duration = Duration::from_secs(300);
/// Most events written in one transaction (etcd refuses more than 128 operations).
pub const MAX_BATCH: usize = 64;
/// How long a batch of events waits for another write of the process to ride with
/// (one transaction for both; see `store::group`) before it goes alone.
pub const RIDE: Duration = Duration::from_millis(50);
/// Most events that ride (see [`RIDE`]): a batch this small fits beside the writes of
/// a busy committer's transaction; more go alone, in transactions of their own.
const RIDE_BATCH: usize = 16;
/// Events queued behind the one being written before new ones are dropped.
const QUEUE: usize = 8192;
/// How often, at most, a run of repeats is written by default.
pub const DEFAULT_FOLD_WINDOW: Duration = Duration::from_secs(30);
/// A run not seen again for this long ends: its next repeat is a new event.
const RUN_IDLE: Duration = Duration::from_secs(600);
/// Runs remembered (what is over is forgotten oldest first, at a sweep; a run not
/// written yet is never forgotten).
const MAX_RUNS: usize = 4096;

/// How often the writer forgets idle runs (a pass over every run), unless it holds a
/// quarter more than [`MAX_RUNS`]: the oldest are then forgotten at once, so that the
/// sort this takes is paid once per [`MAX_RUNS`] / 4 new runs, not per write.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// Writes events from one source (`controller`, `agent/n1`, ...).
#[derive(Clone)]
pub struct Recorder {
    source: String,
    queue: mpsc::Sender<Event>,
}

impl Recorder {
    /// A recorder writing through `store` (unfenced: events are not leader work),
    /// folding repeats over [`DEFAULT_FOLD_WINDOW`]. Its writer task ends when every
    /// clone of the recorder is dropped, or at [`flush`], after writing what was
    /// queued. Must be called inside a tokio runtime.
    pub fn new(store: Store, source: &str) -> Recorder {
        Recorder::with_fold_window(store, source, DEFAULT_FOLD_WINDOW)
    }

    /// [`Recorder::new`] writing a run of repeats at most once per `window`.
    pub fn with_fold_window(store: Store, source: &str, window: Duration) -> Recorder {
        let (queue, rx) = mpsc::channel(QUEUE);
        let task = tokio::spawn(write_events(store, rx, window, closing().clone()));
        if let Ok(mut writers) = writers().lock() {
            writers.retain(|w| !w.is_finished());
            writers.push(task);
        }
        Recorder {
            source: source.to_string(),
            queue,
        }
    }

    /// Records an event about `object`. `details` keys are snake_case; never put a
    /// secret or a mount flag in the message or details.
    pub async fn record(
        &self,
        object: ObjectRef,
        type_: EventType,
        reason: &str,
        message: String,
        details: BTreeMap<String, String>,
    ) {
        self.record_related(object, None, type_, reason, message, details)
            .await
    }

    /// [`Recorder::record`] of an event also about `related` (the claim a node's
    /// Mount event is for).
    pub async fn record_related(
        &self,
        object: ObjectRef,
        related: Option<ObjectRef>,
        type_: EventType,
        reason: &str,
        message: String,
        details: BTreeMap<String, String>,
    ) {
        match type_ {
            EventType::Normal => {
                tracing::info!(object = %object_display(&object), reason, text = %crate::api::printable(&message), "event")
            }
            EventType::Warning => {
                tracing::warn!(object = %object_display(&object), reason, text = %crate::api::printable(&message), "event")
            }
        }
        let namespace = if object.namespace.is_empty() {
            Namespace::default_ns()
        } else {
            object.namespace.clone()
        };
        let name = event_name(&object.name);
        let spec = EventSpec {
            reason: reason.to_string(),
            message,
            type_,
            object,
            details,
            source: self.source.clone(),
            time: Some(Timestamp::now()),
            related,
            series: None,
        };
        if let Err(e) = self.queue.try_send(Event::new(&namespace, name, spec)) {
            super::metrics::events_dropped(1);
            if matches!(e, mpsc::error::TrySendError::Full(_)) {
                tracing::debug!(reason, "event queue full; event dropped");
            }
        }
    }
}

fn writers() -> &'static Mutex<Vec<JoinHandle<()>>> {
    static WRITERS: OnceLock<Mutex<Vec<JoinHandle<()>>>> = OnceLock::new();
    WRITERS.get_or_init(Mutex::default)
}

fn closing() -> &'static CancellationToken {
    static CLOSING: OnceLock<CancellationToken> = OnceLock::new();
    CLOSING.get_or_init(CancellationToken::new)
}

/// Has every recorder of the process write what it has queued and folded, and stop
/// taking events; waits at most `grace`. Returns whether everything was written in
/// time. Call once, when the daemon's work has stopped (SIGTERM), before it exits.
pub async fn flush(grace: Duration) -> bool {
    closing().cancel();
    let tasks: Vec<JoinHandle<()>> = match writers().lock() {
        Ok(mut w) => w.drain(..).collect(),
        Err(_) => return false,
    };
    let all = futures::future::join_all(tasks);
    match tokio::time::timeout(grace, all).await {
        Ok(_) => true,
        Err(_) => {
            tracing::warn!(?grace, "events still unwritten when the grace period ended");
            false
        }
    }
}

/// A run of one event and its repeats.
struct Run {
    /// The event as last written (its resource_version is the write's revision).
    stored: Option<Event>,
    /// The event as it stands: the last repeat's message and time, the count.
    now: Event,
    /// When it was last written.
    written: Option<Instant>,
    /// When it last happened.
    seen: Instant,
    /// Happened since it was last written.
    dirty: bool,
}

/// What makes two events one run: object, related object, type, reason, source, and
/// the message with its digits left out (counts, sizes and times vary from repeat to
/// repeat).
fn run_key(e: &EventSpec) -> String {
    let pattern: String = e.message.chars().filter(|c| !c.is_ascii_digit()).collect();
    let related = e.related.as_ref().map(object_display).unwrap_or_default();
    format!(
        "{}\0{related}\0{:?}\0{}\0{}\0{pattern}",
        object_display(&e.object),
        e.type_,
        e.reason,
        e.source
    )
}

/// Folds `event` into `runs`: a repeat of a live run updates it; anything else starts
/// a run.
fn fold(runs: &mut HashMap<String, Run>, event: Event, at: Instant) {
    let key = run_key(&event.spec);
    match runs.get_mut(&key) {
        Some(run) if at.duration_since(run.seen) < RUN_IDLE => {
            let count = run.now.spec.count() + 1;
            let first = run
                .now
                .spec
                .series
                .as_ref()
                .map(|s| s.first_time)
                .or(run.now.spec.time)
                .unwrap_or_else(Timestamp::now);
            let mut spec = event.spec;
            spec.series = Some(EventSeries {
                count,
                first_time: first,
            });
            run.now.spec = spec;
            run.seen = at;
            run.dirty = true;
        }
        _ => {
            runs.insert(
                key,
                Run {
                    stored: None,
                    now: event,
                    written: None,
                    seen: at,
                    dirty: true,
                },
            );
        }
    }
}

/// Whether a run is to be written now: it happened since its last write, and that
/// write is a window old (or there was none, or the writer is closing).
fn due(run: &Run, window: Duration, at: Instant, closing: bool) -> bool {
    run.dirty && (closing || run.written.is_none_or(|w| at.duration_since(w) >= window))
}

/// The writer task: folds what is queued into runs, writes the runs that are due in
/// transactions of up to [`MAX_BATCH`], and sleeps until the next run is due or an
/// event comes.
async fn write_events(
    store: Store,
    mut rx: mpsc::Receiver<Event>,
    window: Duration,
    closing: CancellationToken,
) {
    let mut lease: Option<(LeaseId, Instant)> = None;
    let mut runs: HashMap<String, Run> = HashMap::new();
    let mut incoming = Vec::with_capacity(MAX_BATCH);
    let mut closed = false;
    let mut ended = false;
    let mut swept = Instant::now();
    while !ended {
        let next = runs
            .values()
            .filter(|r| r.dirty)
            .filter_map(|r| r.written.map(|w| w + window))
            .min();
        tokio::select! {
            biased;
            n = rx.recv_many(&mut incoming, MAX_BATCH) => ended = n == 0,
            _ = closing.cancelled(), if !closed => {
                // Stop taking events; what is queued is still received.
                closed = true;
                rx.close();
                continue;
            }
            _ = tokio::time::sleep_until(next.map_or_else(tokio::time::Instant::now, Into::into)), if next.is_some() => {}
        }
        let at = Instant::now();
        for e in incoming.drain(..) {
            fold(&mut runs, e, at);
        }
        let keys: Vec<String> = runs
            .iter()
            .filter(|(_, r)| due(r, window, at, closed || ended))
            .map(|(k, _)| k.clone())
            .collect();
        // A few events ride; a burst fills transactions of its own, and a closing
        // writer sends what is left at once.
        let linger = if closed || ended || keys.len() > RIDE_BATCH {
            Duration::ZERO
        } else {
            RIDE
        };
        for chunk in keys.chunks(MAX_BATCH) {
            let id = match lease {
                Some((id, since)) if since.elapsed() < WINDOW => id,
                _ => match store.grant_lease(RETENTION + WINDOW).await {
                    Ok(id) => {
                        lease = Some((id, Instant::now()));
                        id
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, events = chunk.len(), "cannot grant an event lease; events dropped");
                        super::metrics::events_dropped(chunk.len());
                        for k in chunk {
                            runs.remove(k);
                        }
                        continue;
                    }
                },
            };
            // Taken out of the map by key while written (a scan of every run per chunk
            // cost the agent a fifth of its CPU with thousands of runs).
            let mut taken: Vec<(String, Run)> =
                chunk.iter().filter_map(|k| runs.remove_entry(k)).collect();
            let mut batch: Vec<&mut Run> = taken.iter_mut().map(|(_, r)| r).collect();
            match write_runs(&store, &mut batch, id, linger).await {
                Ok(()) => runs.extend(taken),
                Err(e) => {
                    // The window's lease may have been revoked or expired early.
                    lease = None;
                    tracing::warn!(error = %e, events = batch.len(), "cannot record events");
                    super::metrics::events_dropped(batch.len());
                }
            }
        }
        if at.duration_since(swept) >= SWEEP_EVERY || runs.len() > MAX_RUNS + MAX_RUNS / 4 {
            forget_old(&mut runs, at);
            swept = at;
        }
    }
}

/// Forgets runs that are over: written, and not seen for [`RUN_IDLE`]; past
/// [`MAX_RUNS`], the oldest written ones.
fn forget_old(runs: &mut HashMap<String, Run>, at: Instant) {
    runs.retain(|_, r| r.dirty || at.duration_since(r.seen) < RUN_IDLE);
    if runs.len() <= MAX_RUNS {
        return;
    }
    let mut clean: Vec<(Instant, String)> = runs
        .iter()
        .filter(|(_, r)| !r.dirty)
        .map(|(k, r)| (r.seen, k.clone()))
        .collect();
    clean.sort();
    for (_, k) in clean.into_iter().take(runs.len() - MAX_RUNS) {
        runs.remove(&k);
    }
}

/// Writes `runs` in one transaction: a new event for a run never written, an update of
/// the stored one otherwise. When the transaction fails its guards (an event expired
/// with its lease, or a name clashed), each is written on its own, a run whose event
/// is gone as a new event.
async fn write_runs(
    store: &Store,
    runs: &mut [&mut Run],
    lease: LeaseId,
    linger: Duration,
) -> Result<(), StoreError> {
    let mut batch = Batch::default();
    let mut written = Vec::with_capacity(runs.len());
    for r in runs.iter() {
        written.push(match &r.stored {
            Some(read) => batch.update(store, read, &r.now)?,
            None => batch.create_with_lease(store, &r.now, lease)?,
        });
    }
    match batch.commit_riding(store, linger).await {
        Ok(revision) => {
            for (r, mut obj) in runs.iter_mut().zip(written) {
                obj.metadata.resource_version = revision;
                settle(r, obj);
            }
            Ok(())
        }
        Err(StoreError::Conflict { .. }) => {
            for r in runs.iter_mut() {
                write_one(store, r, lease).await?;
            }
            Ok(())
        }
        Err(e) => Err(e),
    }
}

async fn write_one(store: &Store, r: &mut Run, lease: LeaseId) -> Result<(), StoreError> {
    if let Some(read) = &r.stored {
        match store.update(read, &r.now).await {
            Ok(obj) => {
                settle(r, obj);
                return Ok(());
            }
            Err(StoreError::Conflict { .. } | StoreError::NotFound { .. }) => {
                // Expired: the run goes on as a new event.
                r.now.metadata = Event::new(
                    &r.now.metadata.namespace,
                    event_name(&r.now.spec.object.name),
                    EventSpec::default(),
                )
                .metadata;
            }
            Err(e) => return Err(e),
        }
    }
    match store.create_with_lease(&r.now, lease).await {
        Ok(obj) => settle(r, obj),
        // A clash of the random part of two names: the other one stands.
        Err(StoreError::AlreadyExists { .. }) => r.dirty = false,
        Err(e) => return Err(e),
    }
    Ok(())
}

fn settle(r: &mut Run, obj: Event) {
    r.now.metadata = obj.metadata.clone();
    r.stored = Some(obj);
    r.written = Some(Instant::now());
    r.dirty = false;
}

fn object_display(o: &ObjectRef) -> String {
    if o.namespace.is_empty() {
        format!("{}/{}", o.kind, o.name)
    } else {
        format!("{}/{}/{}", o.kind, o.namespace, o.name)
    }
}

/// `<object>.<time><random>`: sorts by time within one object, unique, within the id
/// rule's 128 characters.
fn event_name(object: &Name) -> Name {
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or_default();
    let suffix = format!(".{millis:x}{:04x}", fastrand::u16(..));
    let base: String = object.as_str().chars().take(128 - suffix.len()).collect();
    Name::new(format!("{base}{suffix}")).unwrap_or_else(|_| {
        Name::new(format!("event{suffix}")).expect("a fixed ascii name is a valid id")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_names_are_valid_and_distinct() {
        let long = Name::new("x".repeat(128)).unwrap();
        let a = event_name(&long);
        let b = event_name(&long);
        assert!(a.as_str().len() <= 128);
        assert!(a.validate().is_ok());
        assert_ne!(a, b);
    }

    #[test]
    fn the_oldest_written_runs_are_forgotten_past_the_limit_and_unwritten_ones_never() {
        let start = Instant::now();
        let run = |i: u64, dirty: bool| Run {
            stored: None,
            now: Event::new(
                &Namespace::default_ns(),
                Name::new(format!("e{i}")).unwrap(),
                EventSpec::default(),
            ),
            written: None,
            seen: start + Duration::from_millis(i),
            dirty,
        };
        let mut runs: HashMap<String, Run> = (0..6000u64)
            .map(|i| (format!("r{i}"), run(i, i < 10)))
            .collect();
        let at = start + Duration::from_secs(60);
        forget_old(&mut runs, at);
        assert_eq!(runs.len(), MAX_RUNS);
        assert!(
            (0..10).all(|i| runs.contains_key(&format!("r{i}"))),
            "unwritten runs kept"
        );
        assert!(
            runs.contains_key("r5999") && !runs.contains_key("r10"),
            "the oldest written go"
        );
        // Idle for RUN_IDLE: every written run goes.
        forget_old(&mut runs, at + RUN_IDLE);
        assert_eq!(runs.len(), 10);
    }
}
