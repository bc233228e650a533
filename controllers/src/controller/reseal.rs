//! Secrets at rest, kept sealed with the key that seals now: a volume or claim whose
//! secrets are stored in plain text (written by an older moor, or by a moorctl without
//! the key file) or sealed with a key that is no longer the first of the key file is
//! written back, which seals it with the current key. Runs only in a controller that
//! holds the cluster's key file; the rewrite changes no spec, so nothing else reacts.
//! It writes through the reconcilers' Writer, which records the write, so that a
//! reconciler's fresh read of the object sees it.

use futures::StreamExt;
use moor::api::{Object, Spec};
use moor::runtime::informer::Informer;
use moor::runtime::watcher::Event;
use moor::runtime::writer::Writer;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How often a failed rewrite is tried again before waiting for the object's next event.
const ATTEMPTS: u32 = 5;

/// Rewrites every object of kind `S` that [`moor::store::Codec::needs_reseal`] flags, from the
/// informer's cache and then as objects change, until `stop`.
pub async fn run<S: Spec>(writer: Writer, informer: Informer<Object<S>>, stop: CancellationToken) {
    let store = writer.store();
    if store.keyring().is_none_or(|k| k.node().is_some()) {
        return;
    }
    let events = informer.subscribe().take_until(stop.cancelled_owned());
    futures::pin_mut!(events);
    while let Some(event) = events.next().await {
        let objects = match event {
            Ok(Event::Applied(obj)) => vec![obj],
            Ok(Event::Restarted(all)) => all,
            Ok(Event::Deleted { .. }) | Err(_) => continue,
        };
        for obj in objects.iter().filter(|o| store.codec().needs_reseal(*o)) {
            reseal(&writer, obj).await;
        }
    }
}

/// Writes the cached object back (no read first: a changed object is a conflict, and
/// its own event brings it here again).
async fn reseal<S: Spec>(writer: &Writer, obj: &Object<S>) {
    let key = obj.object_key();
    for attempt in 1..=ATTEMPTS {
        match writer.reseal(obj).await {
            Ok(wrote) => {
                if wrote {
                    tracing::info!(key = %key, "secrets sealed with the current key");
                }
                return;
            }
            // Changed meanwhile: its next event brings it back here.
            Err(e) if e.is_conflict() => return,
            Err(e) => {
                tracing::warn!(key = %key, attempt, error = %moor::process::error_chain(&e), "cannot rewrite secrets sealed");
                tokio::time::sleep(Duration::from_millis(500) * attempt).await;
            }
        }
    }
}
