//! The runtime composed against a real etcd: watcher → reflector → controller →
//! status writes, the way every moor reconciler runs.

mod common;

use common::{fixtures::volume, wait_for, Backend, Etcd};
use moor::api::*;
use moor::runtime::backoff::{backoff, Backoff};
use moor::runtime::controller::{Action, Config, Controller};
use moor::runtime::metrics::Metrics;
use moor::runtime::reflector;
use moor::runtime::watcher::watcher;
use moor::store::StoreError;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

async fn a_controller_converges_status_to_spec_and_follows_changes(backend: Backend) {
    let etcd = Etcd::start_on(backend).await;
    let store = etcd.store("/t/").await;
    for name in ["a", "b", "c"] {
        store.create(&volume(name)).await.unwrap();
    }
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Metrics::register(&mut registry).controller("volume-status");

    let (reader, writer) = reflector::store::<Volume>();
    let events = reflector::reflector(
        writer,
        backoff(
            watcher::<VolumeSpec>(store.clone(), moor::api::KeyScope::all()),
            Backoff::default(),
        ),
    );
    let shutdown = CancellationToken::new();
    let ctl = Controller::new("volume-status", reader.clone(), Config::default())
        .with_metrics(metrics.clone())
        .owns(events);
    let (r, s) = (reader.clone(), store.clone());
    let run = tokio::spawn(ctl.run(
        move |_: Arc<()>, key: String| {
            let (reader, store) = (r.clone(), s.clone());
            async move {
                let Some(obj) = reader.get(&key) else {
                    return Ok(Action::AwaitChange);
                };
                let generation = obj.metadata.generation;
                store
                    .modify_status(&obj.object_key(), |_, status| {
                        status.claims.schedulable = true;
                        status.claims.meta.observed_generation = generation;
                        true
                    })
                    .await?;
                Ok::<_, StoreError>(Action::AwaitChange)
            }
        },
        Arc::new(()),
        shutdown.clone(),
    ));

    let converged = |generation: i64| {
        let store = store.clone();
        move || {
            let store = store.clone();
            async move {
                let list = store
                    .list::<VolumeSpec>(&moor::api::KeyScope::all())
                    .await
                    .unwrap();
                list.items.len() == 3
                    && list.items.iter().all(|v| {
                        v.status.claims.schedulable
                            && v.status.claims.meta.observed_generation == generation
                    })
            }
        }
    };
    wait_for(
        "every volume reconciled",
        Duration::from_secs(20),
        converged(1),
    )
    .await;

    // A spec change is seen through the watch and reconciled again.
    for name in ["a", "b", "c"] {
        let mut v = store
            .get(&Volume::key_for(&Namespace::default_ns(), name))
            .await
            .unwrap();
        v.spec.capacity_max = Some(Size(8 << 30));
        store.replace(&v).await.unwrap();
    }
    wait_for(
        "spec changes reconciled",
        Duration::from_secs(20),
        converged(2),
    )
    .await;
    assert!(metrics.reconciles() >= 6);
    assert_eq!(metrics.failures(), 0);
    let text = moor::runtime::metrics::encode(&registry);
    assert!(
        text.contains("moor_reconciles_total{controller=\"volume-status\"}"),
        "{text}"
    );

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .unwrap()
        .unwrap();
}

/// Issue 11, defect 8: each malformed value made the informer back off (200 ms
/// doubling to 10 s) on list and watch, so 30 of them delayed every other object of
/// the kind by minutes. They are skipped, and the good objects arrive at once.
async fn malformed_values_do_not_delay_the_rest_of_their_kind(backend: Backend) {
    use moor::runtime::informer::Informer;
    // The count is per process, once per (key, revision): the backends' runs take
    // turns and name their values apart, so that what this run counts is its own.
    static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _turn = TURN.lock().await;
    let counted_before = moor::runtime::metrics::malformed_count("Volume");
    let etcd = Etcd::start_on(backend).await;
    let store = etcd.store("/t/").await;
    let mut raw = etcd.raw_client().await;
    for i in 0..30 {
        raw.put(
            format!("/t/volumes/default/junk-{backend:?}-{i}"),
            "junk",
            None,
        )
        .await
        .unwrap();
    }
    store.create(&volume("before")).await.unwrap();
    let shutdown = CancellationToken::new();
    let informer =
        Informer::<Volume>::spawn(store.clone(), moor::api::KeyScope::all(), shutdown.clone());
    let reader = informer.reader();
    // Well under the first backoffs' sum (30 malformed values: minutes before).
    let deadline = Duration::from_secs(5);
    wait_for("the valid volume listed", deadline, || {
        let r = reader.clone();
        async move { r.get("volumes/default/before").is_some() }
    })
    .await;
    for i in 30..60 {
        raw.put(format!("/t/volumes/default/junk-{i}"), "junk", None)
            .await
            .unwrap();
    }
    store.create(&volume("after")).await.unwrap();
    wait_for("the valid volume watched", deadline, || {
        let r = reader.clone();
        async move { r.get("volumes/default/after").is_some() }
    })
    .await;
    assert_eq!(reader.state().len(), 2, "malformed values are not cached");
    // Counted where an operator looks: this run's 30 values, at least once each.
    let counted = moor::runtime::metrics::malformed_count("Volume") - counted_before;
    assert!(counted >= 30, "{counted} malformed values counted");
    shutdown.cancel();
}

/// A controller that trusts converged status, started on a store of settled objects,
/// serves a change made during its start's repair pass before that pass ends (issue
/// 39, item 4), and still reconciles every object.
async fn a_trusting_start_serves_a_change_before_its_repair_pass(backend: Backend) {
    const SETTLED: usize = 60;
    let etcd = Etcd::start_on(backend).await;
    let store = etcd.store("/t/").await;
    for i in 0..SETTLED {
        let v = store
            .create(&volume(&format!("settled-{i:03}")))
            .await
            .unwrap();
        store
            .modify_status(&v.object_key(), |_, st| {
                st.claims.schedulable = true;
                true
            })
            .await
            .unwrap();
    }
    store.create(&volume("unsettled")).await.unwrap();
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Metrics::register(&mut registry).controller("t");

    let (reader, writer) = reflector::store::<Volume>();
    let events = reflector::reflector(
        writer,
        backoff(
            watcher::<VolumeSpec>(store.clone(), moor::api::KeyScope::all()),
            Backoff::default(),
        ),
    );
    let shutdown = CancellationToken::new();
    let config = Config {
        concurrency: 1,
        ..Config::default()
    };
    let ctl = Controller::new("t", reader.clone(), config)
        .with_metrics(metrics)
        .owns_trusting(events, |v: &Volume| v.status.claims.schedulable);
    let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let o = order.clone();
    let run = tokio::spawn(ctl.run(
        move |_: Arc<()>, key: String| {
            let o = o.clone();
            async move {
                let name = key.rsplit('/').next().unwrap_or_default().to_string();
                o.lock().unwrap().push(name);
                // A no-op reconcile that takes a while: the pass lasts about 3 s.
                tokio::time::sleep(Duration::from_millis(50)).await;
                Ok::<_, StoreError>(Action::AwaitChange)
            }
        },
        Arc::new(()),
        shutdown.clone(),
    ));
    let ran = |order: &std::sync::Arc<std::sync::Mutex<Vec<String>>>, name: &str| {
        order.lock().unwrap().iter().position(|n| n == name)
    };
    wait_for(
        "the start's first reconciles",
        Duration::from_secs(20),
        || {
            let o = order.clone();
            async move { o.lock().unwrap().len() >= 2 }
        },
    )
    .await;
    // Waiting for repair, and shown where an operator looks.
    let text = moor::runtime::metrics::encode(&registry);
    let repairs: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("moor_queue_repairs{controller=\"t\"} "))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    assert!(repairs > 0.0, "{text}");
    store.create(&volume("new")).await.unwrap();
    wait_for(
        "the new volume's reconcile",
        Duration::from_secs(20),
        || {
            let o = order.clone();
            async move { ran(&o, "new").is_some() }
        },
    )
    .await;
    {
        let order = order.lock().unwrap();
        let settled_before = |name: &str| {
            let at = order.iter().position(|n| n == name).unwrap();
            order[..at]
                .iter()
                .filter(|n| n.starts_with("settled-"))
                .count()
        };
        // The unsettled volume is reconciled before the settled ones (but the first,
        // which may have started when it was the only key listed so far).
        assert!(settled_before("unsettled") <= 1, "{order:?}");
        assert!(
            settled_before("new") < SETTLED / 2,
            "the change waited for the repair pass: {order:?}"
        );
    }
    wait_for("every volume reconciled", Duration::from_secs(30), || {
        let o = order.clone();
        async move { o.lock().unwrap().len() >= SETTLED + 2 }
    })
    .await;
    for i in 0..SETTLED {
        let name = format!("settled-{i:03}");
        assert!(ran(&order, &name).is_some(), "{name} was never reconciled");
    }
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .unwrap()
        .unwrap();
}

crate::both_stores!(
    a_controller_converges_status_to_spec_and_follows_changes,
    malformed_values_do_not_delay_the_rest_of_their_kind,
    a_trusting_start_serves_a_change_before_its_repair_pass,
);
