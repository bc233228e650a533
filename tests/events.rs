//! Event recording against a real etcd: repeats fold into one event written at most
//! once per window, and a flush at shutdown writes what is still queued or folded.
//!
//! One test: [`moor::runtime::events::flush`] closes every recorder of the process.

mod common;

use common::Etcd;
use moor::api::*;
use moor::runtime::events::{flush, Recorder};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const PREFIX: &str = "/t/";

fn node_ref() -> ObjectRef {
    ObjectRef {
        kind: "Node".into(),
        namespace: Namespace::default(),
        name: Name::new("n1").unwrap(),
    }
}

fn claim_ref() -> ObjectRef {
    ObjectRef {
        kind: "Claim".into(),
        namespace: Namespace::default_ns(),
        name: Name::new("a1.data").unwrap(),
    }
}

/// Records a Warning on node n1 about claim a1.data.
async fn warn(recorder: &Recorder, message: String) {
    recorder
        .record_related(
            node_ref(),
            Some(claim_ref()),
            EventType::Warning,
            "Mount volume",
            message,
            BTreeMap::new(),
        )
        .await;
}

async fn events(store: &moor::store::Store) -> Vec<Event> {
    store
        .list(&KeyScope::<EventSpec>::all())
        .await
        .unwrap()
        .items
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeats_fold_into_one_event_and_a_flush_writes_what_is_left() {
    let etcd = Etcd::start().await;
    let store = etcd.store(PREFIX).await;
    let puts = common::count_puts(&etcd.client_url, &format!("{PREFIX}events/")).await;
    let window = Duration::from_secs(1);
    let recorder = Recorder::with_fold_window(store.clone(), "agent/n1", window);
    let failing =
        |i: usize| format!("v1 could not be published for claim a1.data: attempt {i}: Unavailable");
    let started = Instant::now();
    for i in 0..100 {
        warn(&recorder, failing(i)).await;
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    // Another message (not only its numbers): another event, folded on its own.
    for _ in 0..2 {
        warn(
            &recorder,
            "v1 could not be published for claim a1.data: permission denied".into(),
        )
        .await;
    }
    let elapsed = started.elapsed();
    // Each run's last repeat is written within a window of its previous write.
    common::wait_for(
        "the runs counted 100 and 2",
        Duration::from_secs(10),
        || async {
            let all = events(&store).await;
            all.iter().any(|e| e.spec.count() == 100) && all.iter().any(|e| e.spec.count() == 2)
        },
    )
    .await;
    let all = events(&store).await;
    assert_eq!(all.len(), 2, "{all:#?}");
    let run = all.iter().find(|e| e.spec.count() == 100).unwrap();
    assert_eq!(run.spec.message, failing(99), "the last repeat's message");
    assert_eq!(run.spec.related, Some(claim_ref()));
    let series = run.spec.series.clone().unwrap();
    assert!(series.first_time < run.spec.time.unwrap());
    assert!(
        run.spec.repeats().starts_with("x100 over "),
        "{}",
        run.spec.repeats()
    );
    let other = all.iter().find(|e| e.spec.count() != 100).unwrap();
    assert_eq!(other.spec.count(), 2);
    // Writes of the run: the first at once, then at most one per window.
    let key = format!("{PREFIX}{}", run.key());
    let writes = puts.lock().unwrap().get(&key).copied().unwrap_or_default();
    let most = elapsed.as_secs_f64() / window.as_secs_f64() + 2.0;
    eprintln!("100 repeats over {elapsed:?}: {writes} writes");
    assert!(
        writes >= 2 && (writes as f64) <= most,
        "100 repeats over {elapsed:?} took {writes} writes (at most {most})"
    );

    // A repeat and a burst recorded right before a flush: all written when it returns.
    warn(&recorder, failing(100)).await;
    const BURST: usize = 1000;
    for i in 0..BURST {
        let object = ObjectRef {
            kind: "Volume".into(),
            namespace: Namespace::default_ns(),
            name: Name::new(format!("v{i}")).unwrap(),
        };
        recorder
            .record(
                object,
                EventType::Normal,
                "Test",
                format!("event {i}"),
                BTreeMap::new(),
            )
            .await;
    }
    assert!(flush(Duration::from_secs(20)).await, "flushed in time");
    let all = events(&store).await;
    assert_eq!(all.len(), 2 + BURST);
    assert!(all.iter().any(|e| e.spec.count() == 101));
    // Closed: what is recorded after the flush is logged only.
    recorder
        .record(
            node_ref(),
            EventType::Normal,
            "Late",
            "after the flush".into(),
            BTreeMap::new(),
        )
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(events(&store).await.len(), 2 + BURST);
}
