//! Recording events: what a reconciler did or could not do, for `moorctl events`.
//!
//! Recording never waits for the store and never fails the caller: [`Recorder::record`]
//! logs the event and queues it; one writer task per recorder takes whatever has
//! queued and writes it in one transaction (up to [`MAX_BATCH`] events), so a burst of
//! reconciles costs a few event writes instead of one synchronous write each, and an
//! idle system still writes each event at once. A full queue drops the event (it was
//! logged) and counts it in `moor_events_dropped_total`.
//!
//! Events expire: each is written under a lease shared by every event of the same
//! time window (not one lease per event, which would cost etcd a lease per write), so
//! a window's events all go when its lease does.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

use crate::api::{Event, EventSpec, EventType, Name, Namespace, ObjectRef, Timestamp};
use crate::store::{Batch, LeaseId, Store};

/// How long events are kept.
pub const RETENTION: Duration = Duration::from_secs(3600);
/// How long one lease is shared before the next window's.
const WINDOW: Duration = Duration::from_secs(300);
/// Most events written in one transaction (etcd refuses more than 128 operations).
pub const MAX_BATCH: usize = 64;
/// Events queued behind the one being written before new ones are dropped.
const QUEUE: usize = 8192;

/// Writes events from one source (`controller`, `agent/n1`, ...).
#[derive(Clone)]
pub struct Recorder {
    source: String,
    queue: mpsc::Sender<Event>,
}

impl Recorder {
    /// A recorder writing through `store` (unfenced: events are not leader work). Its
    /// writer task ends when every clone of the recorder is dropped, after writing
    /// what was queued. Must be called inside a tokio runtime.
    pub fn new(store: Store, source: &str) -> Recorder {
        let (queue, rx) = mpsc::channel(QUEUE);
        tokio::spawn(write_events(store, rx));
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
        match type_ {
            EventType::Normal => {
                tracing::info!(object = %object_display(&object), reason, message = %crate::api::printable(&message), "event")
            }
            EventType::Warning => {
                tracing::warn!(object = %object_display(&object), reason, message = %crate::api::printable(&message), "event")
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
        };
        if let Err(e) = self.queue.try_send(Event::new(&namespace, name, spec)) {
            super::metrics::events_dropped(1);
            if matches!(e, mpsc::error::TrySendError::Full(_)) {
                tracing::debug!(reason, "event queue full; event dropped");
            }
        }
    }
}

/// The writer task: waits for an event, takes every other one already queued (up to
/// [`MAX_BATCH`]), writes them in one transaction, and again.
async fn write_events(store: Store, mut rx: mpsc::Receiver<Event>) {
    let mut lease: Option<(LeaseId, Instant)> = None;
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
        let id = match lease {
            Some((id, since)) if since.elapsed() < WINDOW => id,
            _ => match store.grant_lease(RETENTION + WINDOW).await {
                Ok(id) => {
                    lease = Some((id, Instant::now()));
                    id
                }
                Err(e) => {
                    tracing::warn!(error = %e, events = batch.len(), "cannot grant an event lease; events dropped");
                    super::metrics::events_dropped(batch.len());
                    batch.clear();
                    continue;
                }
            },
        };
        if let Err(e) = write_batch(&store, &batch, id).await {
            // The window's lease may have been revoked or expired early: start a new one.
            lease = None;
            tracing::warn!(error = %e, events = batch.len(), "cannot record events");
            super::metrics::events_dropped(batch.len());
        }
        batch.clear();
    }
}

/// Writes `events` in one transaction; if one name exists already (names are unique
/// but for a clash of their random part), each on its own.
async fn write_batch(
    store: &Store,
    events: &[Event],
    lease: LeaseId,
) -> Result<(), crate::store::StoreError> {
    let mut batch = Batch::default();
    for e in events {
        batch.create_with_lease(store, e, lease)?;
    }
    match batch.commit(store).await {
        Err(crate::store::StoreError::Conflict { .. }) if events.len() > 1 => {
            for e in events {
                match store.create_with_lease(e, lease).await {
                    Ok(_) | Err(crate::store::StoreError::AlreadyExists { .. }) => {}
                    Err(err) => return Err(err),
                }
            }
            Ok(())
        }
        other => other.map(|_| ()),
    }
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
}
