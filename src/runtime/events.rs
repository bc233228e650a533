//! Recording events: what a reconciler did or could not do, for `moorctl events`.
//!
//! Events expire: each is written under a lease shared by every event of the same
//! time window (not one lease per event, which would cost etcd a lease per write), so
//! a window's events all go when its lease does. Recording never fails the caller: an
//! event that cannot be written is logged and dropped.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Mutex;

use crate::api::{Event, EventSpec, EventType, Name, Namespace, ObjectRef, Timestamp};
use crate::store::{LeaseId, Store};

/// How long events are kept.
pub const RETENTION: Duration = Duration::from_secs(3600);
/// How long one lease is shared before the next window's.
const WINDOW: Duration = Duration::from_secs(300);

/// Writes events from one source (`controller`, `agent/n1`, ...).
#[derive(Clone)]
pub struct Recorder {
    store: Store,
    source: String,
    lease: Arc<Mutex<Option<(LeaseId, Instant)>>>,
}

impl Recorder {
    /// A recorder writing through `store` (unfenced: events are not leader work).
    pub fn new(store: Store, source: &str) -> Recorder {
        Recorder {
            store,
            source: source.to_string(),
            lease: Arc::new(Mutex::new(None)),
        }
    }

    /// The current window's lease, granting a new one when the window has passed.
    async fn lease(&self) -> Option<LeaseId> {
        let mut current = self.lease.lock().await;
        if let Some((id, since)) = *current {
            if since.elapsed() < WINDOW {
                return Some(id);
            }
        }
        match self.store.grant_lease(RETENTION + WINDOW).await {
            Ok(id) => {
                *current = Some((id, Instant::now()));
                Some(id)
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot grant an event lease; event dropped");
                None
            }
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
                tracing::info!(object = %object_display(&object), reason, %message, "event")
            }
            EventType::Warning => {
                tracing::warn!(object = %object_display(&object), reason, %message, "event")
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
        let event = Event::new(&namespace, name, spec);
        let Some(lease) = self.lease().await else {
            return;
        };
        if let Err(e) = self.store.create_with_lease(&event, lease).await {
            // The window's lease may have been revoked or expired early: start a new one.
            *self.lease.lock().await = None;
            tracing::warn!(error = %e, reason, "cannot record event");
        }
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
