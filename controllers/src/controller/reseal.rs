//! Secrets at rest, kept sealed with the key that seals now: a volume or claim whose
//! secrets are stored in plain text (written by an older moor, or by a moorctl without
//! the key file) or sealed with a key that is no longer the first of the key file is
//! written back, which seals it with the current key. Runs only in a controller that
//! holds the cluster's key file; the rewrite changes no spec, so nothing else reacts.
//! It writes through the reconcilers' Writer, which records the write, so that a
//! reconciler's fresh read of the object sees it.

use futures::StreamExt;
use moor::api::{Object, ObjectKey, Spec};
use moor::runtime::informer::Informer;
use moor::runtime::watcher::Event;
use moor::runtime::writer::Writer;
use moor::runtime::Resource;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How often a failed rewrite is tried again before waiting for the object's next event.
const ATTEMPTS: u32 = 5;

/// [`run_as`] over a cache of whole objects.
pub async fn run<S: Spec>(writer: Writer, informer: Informer<Object<S>>, stop: CancellationToken) {
    run_as(
        writer,
        informer,
        |o| Some(&o.spec),
        Object::object_key,
        stop,
    )
    .await
}

/// Rewrites every object of kind `S` that [`moor::store::Codec::spec_needs_reseal`]
/// flags, from the informer's cache and then as objects change, until `stop`. The
/// cache keeps `P`s: `spec` is what one keeps of the object's spec with its secret
/// fields as read (`None`: no secrets), `key` the object's key.
pub async fn run_as<S: Spec, P: Resource>(
    writer: Writer,
    informer: Informer<P>,
    spec: fn(&P) -> Option<&S>,
    key: fn(&P) -> ObjectKey<S>,
    stop: CancellationToken,
) {
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
        let flagged = objects
            .iter()
            .filter(|o| spec(o).is_some_and(|s| store.codec().spec_needs_reseal(s)));
        for obj in flagged {
            reseal(&writer, &key(obj)).await;
        }
    }
}

/// Reads the object at `key` and writes it back if it still needs it (a change since
/// is a conflict, and its own event brings it here again).
async fn reseal<S: Spec>(writer: &Writer, key: &ObjectKey<S>) {
    for attempt in 1..=ATTEMPTS {
        let written = match writer.store().try_get(key).await {
            Ok(Some(obj)) if writer.store().codec().needs_reseal(&obj) => writer.reseal(&obj).await,
            Ok(_) => return,
            Err(e) => Err(e),
        };
        match written {
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
