//! Node liveness: the controller removes a Node whose agent stopped renewing it.
//!
//! Expected flow:
//! 1. Every tick, each cached Node that carries a renewal record ([`NodeLiveness`]) is
//!    looked at: when its version last changed, by this process's clock, is noted.
//! 2. A Node unchanged for its TTL is deleted, guarded by the version seen, with a
//!    `Node expired` Warning. Whoever keeps its etcd lease alive does not matter: etcd
//!    3.4 checks no permission on LeaseKeepAlive, so the lease proves nothing. A renewal
//!    that lands first makes the delete fail, and nothing happens.
//! 3. An agent that is alive after all finds its Node gone at its next renewal and
//!    registers again (a new term: see `agent::plugins`).
//! 4. After a store error the observations start over: a controller that could not see
//!    renewals takes nobody's silence as evidence.
//!
//! The Node watch the reconcilers use is filtered by [`without_renewals`]: a renewal
//! changes nothing they decide on, and would otherwise wake every claim of the node.

use futures::{Stream, StreamExt};
use moor::api::*;
use moor::runtime::watcher::Event;
use moor::store::StoreError;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

use super::context::Ctx;
use crate::common::object_ref;

/// How often the cached Nodes are looked at.
const TICK: Duration = Duration::from_millis(250);

/// Removes the Nodes whose agents stopped renewing them, until `stop`.
pub async fn run(ctx: Ctx, stop: CancellationToken) {
    ctx.nodes.wait_until_ready().await;
    let mut observer = LeaseObserver::default();
    let mut refused: HashMap<String, i64> = HashMap::new();
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(TICK) => {}
        }
        refuse_malformed(&ctx, &mut refused).await;
        let now = Instant::now();
        let nodes = ctx.nodes.state();
        let keys: HashSet<String> = nodes.iter().map(|n| n.key()).collect();
        observer.retain(|k| keys.contains(k));
        for node in expired(&mut observer, &nodes, now) {
            match remove(&ctx, &node).await {
                Ok(()) => observer.forget(&node.key()),
                // Renewed (or re-registered) since the version seen: alive.
                Err(StoreError::Conflict { .. }) | Err(StoreError::NotFound { .. }) => {
                    observer.forget(&node.key())
                }
                Err(e) => {
                    tracing::warn!(node = %node.metadata.name, error = %e, "could not remove an expired Node; looking at every node afresh");
                    observer.reset();
                    break;
                }
            }
        }
    }
}

/// A Warning on each Node whose agent wrote a value moor refuses (over 64 KiB, or
/// plugin reports over their caps), once per value; the informer already counted it in
/// `moor_malformed_values_skipped_total` and logged it.
async fn refuse_malformed(ctx: &Ctx, reported: &mut HashMap<String, i64>) {
    let now = ctx.nodes.malformed_keys();
    reported.retain(|k, _| now.iter().any(|(n, _)| n == k));
    for (key, revision) in now {
        if reported.get(&key) == Some(&revision) {
            continue;
        }
        reported.insert(key.clone(), revision);
        let Ok(node) = ObjectKey::<NodeSpec>::parse(&key) else {
            continue;
        };
        let reference = ObjectRef {
            kind: NodeSpec::KIND.to_string(),
            namespace: Namespace::default(),
            name: Name::new(node.name()).unwrap_or_default(),
        };
        ctx.recorder
            .record(
                reference,
                EventType::Warning,
                "Node refused",
                format!(
                    "the value written at revision {revision} is refused (over {} bytes, or plugin reports over their caps); the last valid one is kept, if any (`moord check` says why)",
                    NODE_WRITTEN_MAX_BYTES
                ),
                BTreeMap::new(),
            )
            .await;
    }
}

/// The Nodes unchanged for their TTL at `now`.
fn expired(observer: &mut LeaseObserver, nodes: &[Arc<Node>], now: Instant) -> Vec<Arc<Node>> {
    nodes
        .iter()
        .filter(|n| {
            let Some(live) = n.status.liveness else {
                return false;
            };
            observer.observe_version(&n.key(), n.metadata.resource_version, now) >= live.ttl()
        })
        .cloned()
        .collect()
}

async fn remove(ctx: &Ctx, node: &Node) -> Result<(), StoreError> {
    let ttl = node.status.liveness.unwrap_or_default().ttl();
    // At the version seen, without reading it again.
    ctx.writer.delete_read(node).await?;
    let message = format!(
        "not renewed for {} (its TTL); removed although its etcd lease may still be kept alive",
        humantime::format_duration(ttl)
    );
    tracing::warn!(node = %node.metadata.name, %message, "node expired");
    ctx.recorder
        .record(
            object_ref(node),
            EventType::Warning,
            "Node expired",
            message,
            BTreeMap::new(),
        )
        .await;
    Ok(())
}

/// `events` without the Node changes that are only renewals.
pub fn without_renewals<E>(
    events: impl Stream<Item = Result<Event<Node>, E>> + Send + 'static,
) -> impl Stream<Item = Result<Event<Node>, E>> + Send + 'static
where
    E: Send + 'static,
{
    let mut last: HashMap<String, Node> = HashMap::new();
    events.filter(move |event| {
        let keep = match event {
            Ok(Event::Applied(n)) => {
                let now = decided(n);
                last.insert(n.key(), now.clone()).as_ref() != Some(&now)
            }
            Ok(Event::Restarted(all)) => {
                last = all.iter().map(|n| (n.key(), decided(n))).collect();
                true
            }
            Ok(Event::Deleted { key, .. }) => {
                last.remove(key);
                true
            }
            Err(_) => true,
        };
        std::future::ready(keep)
    })
}

/// What of a Node anything decides on: all of it but the renewal and its version.
fn decided(n: &Node) -> Node {
    let mut n = n.clone();
    n.status.liveness = None;
    n.metadata.resource_version = 0;
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(rv: i64, renewals: u64) -> Arc<Node> {
        let mut n = Node::new(&Namespace::default(), Name::new("n1").unwrap(), NodeSpec {});
        n.metadata.resource_version = rv;
        n.status.liveness = Some(NodeLiveness {
            ttl_ms: 3000,
            renewals,
        });
        Arc::new(n)
    }

    #[test]
    fn a_node_expires_only_after_its_ttl_without_a_change() {
        let mut o = LeaseObserver::default();
        let t0 = Instant::now();
        let s = Duration::from_secs;
        assert!(expired(&mut o, &[node(5, 1)], t0).is_empty());
        assert!(expired(&mut o, &[node(5, 1)], t0 + s(2)).is_empty());
        // Renewed at 2.5 s: counts from there.
        assert!(expired(&mut o, &[node(9, 2)], t0 + Duration::from_millis(2500)).is_empty());
        assert!(expired(&mut o, &[node(9, 2)], t0 + s(5)).is_empty());
        assert_eq!(expired(&mut o, &[node(9, 2)], t0 + s(6)).len(), 1);
        // A Node without a renewal record (an older agent) is left to its lease.
        let mut old = (*node(3, 0)).clone();
        old.status.liveness = None;
        assert!(expired(&mut o, &[Arc::new(old.clone())], t0).is_empty());
        assert!(expired(&mut o, &[Arc::new(old)], t0 + s(3600)).is_empty());
    }

    #[tokio::test]
    async fn renewals_do_not_reach_the_reconcilers() {
        let mut changed = (*node(7, 2)).clone();
        changed
            .status
            .plugins
            .insert(PluginId::new("p").unwrap(), NodePluginStatus::default());
        changed.metadata.resource_version = 8;
        let events: Vec<Result<Event<Node>, ()>> = vec![
            Ok(Event::Restarted(vec![node(5, 1)])),
            Ok(Event::Applied(node(6, 2))),
            Ok(Event::Applied(Arc::new(changed))),
            Ok(Event::Applied(node(9, 3))),
            Ok(Event::Deleted {
                key: "nodes/n1".into(),
                last: None,
            }),
            Ok(Event::Applied(node(11, 0))),
        ];
        let kept: Vec<_> = without_renewals(futures::stream::iter(events))
            .map(|e| match e.unwrap() {
                Event::Restarted(_) => "restarted".to_string(),
                Event::Applied(n) => format!("applied {}", n.metadata.resource_version),
                Event::Deleted { .. } => "deleted".to_string(),
            })
            .collect()
            .await;
        assert_eq!(
            kept,
            [
                "restarted",
                "applied 8",
                "applied 9",
                "deleted",
                "applied 11"
            ]
        );
    }
}
