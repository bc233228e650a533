//! Leader election against a real etcd.

mod common;

use common::{fixtures::volume, Backend, Etcd};
use moor::runtime::leader::{acquire, LeaderConfig, LeaderRecord, Leadership};
use moor::store::{Store, StoreError};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

fn cfg(identity: &str) -> LeaderConfig {
    LeaderConfig {
        name: "controller".into(),
        identity: identity.into(),
        ttl: Duration::from_secs(3),
    }
}

/// `who` campaigning in the background until elected or `shutdown`.
fn campaign(
    store: &Store,
    who: &'static str,
    shutdown: &CancellationToken,
) -> tokio::task::JoinHandle<Option<Leadership>> {
    let (store, shutdown) = (store.clone(), shutdown.clone());
    tokio::spawn(async move { acquire(&store, &cfg(who), &shutdown).await })
}

async fn failover_when_the_leader_s_lease_is_revoked(backend: Backend) {
    let etcd = Etcd::start_on(backend).await;
    let (sa, sb) = (etcd.store("/t/").await, etcd.store("/t/").await);
    let shutdown = CancellationToken::new();
    let a = acquire(&sa, &cfg("a"), &shutdown)
        .await
        .expect("a is elected");
    let b_task = campaign(&sb, "b", &shutdown);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!b_task.is_finished(), "b was elected while a leads");
    a.store().create(&volume("by-a")).await.unwrap();

    // An operator (or etcd) revokes a's lease.
    sb.revoke_lease(a.lease()).await.unwrap();
    let b = tokio::time::timeout(Duration::from_secs(10), b_task)
        .await
        .expect("b is elected after the revocation")
        .unwrap()
        .expect("b is elected");
    tokio::time::timeout(Duration::from_secs(10), a.lost().cancelled())
        .await
        .expect("a notices it lost leadership");

    // Whatever a still tries is refused by the fence; b's writes land.
    assert!(matches!(
        a.store().create(&volume("late-a")).await,
        Err(StoreError::Deposed { .. })
    ));
    b.store().create(&volume("by-b")).await.unwrap();
    assert!(sa
        .try_get(&crate::common::key::<moor::api::VolumeSpec>(
            "volumes/default/late-a"
        ))
        .await
        .unwrap()
        .is_none());
    b.resign().await;
}

async fn a_leader_cut_off_from_etcd_stops_before_another_starts(backend: Backend) {
    let mut etcd = Etcd::start_on(backend).await;
    let sa = etcd.store("/t/").await;
    let shutdown = CancellationToken::new();
    let a = acquire(&sa, &cfg("a"), &shutdown)
        .await
        .expect("a is elected");
    let lost = a.lost();

    let term = a.term();
    etcd.kill();
    let cut_at = Instant::now();
    // Every renewal etcd applied was sent before the cut, so no deadline a's term ever
    // holds reaches past `cut + TTL - margin` by a's own clock: it acts on nothing
    // after that, whatever this machine's speed (the check is the deadline itself, not
    // how long the test took to see it).
    let limit = cut_at + cfg("a").ttl - moor::runtime::term::margin(cfg("a").ttl);
    let vouched = term.deadline().expect("a holds its term before the cut");
    assert!(vouched <= limit, "a's term runs past the TTL after the cut");
    tokio::time::timeout(Duration::from_secs(10), lost.cancelled())
        .await
        .expect("a stops acting on its own once it cannot renew");
    assert!(
        term.deadline().is_none_or(|d| d <= limit),
        "a's term was extended after the cut"
    );
    assert!(!term.held(), "a's term is still held after it lost");

    etcd.restart().await;
    let sb = etcd.store("/t/").await;
    let b = tokio::time::timeout(Duration::from_secs(30), acquire(&sb, &cfg("b"), &shutdown))
        .await
        .expect("b is elected once a's lease expires")
        .expect("b is elected");
    b.store().create(&volume("by-b")).await.unwrap();
    b.resign().await;
}

async fn lead_hands_over_on_resign_and_stops_on_shutdown(backend: Backend) {
    use std::sync::{Arc, Mutex};
    let etcd = Etcd::start_on(backend).await;
    let log: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut handles = Vec::new();
    let mut tokens = Vec::new();
    for who in ["a", "b"] {
        let store = etcd.store("/t/").await;
        let shutdown = CancellationToken::new();
        tokens.push(shutdown.clone());
        let log = log.clone();
        handles.push(tokio::spawn(moor::runtime::leader::lead(
            store,
            cfg(who),
            shutdown,
            move |_store, stop, _term| {
                let log = log.clone();
                async move {
                    log.lock().unwrap().push(format!("{who} start"));
                    stop.cancelled().await;
                    log.lock().unwrap().push(format!("{who} stop"));
                }
            },
        )));
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    common::wait_for("a leader", Duration::from_secs(10), || async {
        log.lock().unwrap().len() == 1
    })
    .await;
    let first = log.lock().unwrap()[0].clone();
    let (first_idx, second) = if first == "a start" {
        (0, "b")
    } else {
        (1, "a")
    };
    tokens[first_idx].cancel();
    common::wait_for(
        "the other to take over",
        Duration::from_secs(10),
        || async {
            log.lock()
                .unwrap()
                .iter()
                .any(|l| *l == format!("{second} start"))
        },
    )
    .await;
    let entries = log.lock().unwrap().clone();
    let stop_first = entries
        .iter()
        .position(|l| l.ends_with("stop"))
        .expect("the first stopped");
    let start_second = entries
        .iter()
        .position(|l| *l == format!("{second} start"))
        .unwrap();
    assert!(stop_first < start_second, "{entries:?}");
    for t in &tokens {
        t.cancel();
    }
    for h in handles {
        tokio::time::timeout(Duration::from_secs(10), h)
            .await
            .unwrap()
            .unwrap();
    }
}

/// Issue 15: an identity allowed to write the election key put a plain value over it
/// (which strips its lease). Before, the leader's fence compared only the create revision
/// and carried on; when its lease ended nobody could ever win again.
async fn an_overwritten_election_key_deposes_at_once_and_the_election_recovers(backend: Backend) {
    let etcd = Etcd::start_on(backend).await;
    let (sa, sb) = (etcd.store("/t/").await, etcd.store("/t/").await);
    let shutdown = CancellationToken::new();
    let a = acquire(&sa, &cfg("a"), &shutdown)
        .await
        .expect("a is elected");
    let b_task = campaign(&sb, "b", &shutdown);
    let mut raw = etcd.raw_client().await;
    raw.put("/t/leaders/controller", "x", None).await.unwrap();
    // The fence refuses at once, without waiting for a's lease to end.
    assert!(matches!(
        a.store().create(&volume("late-a")).await,
        Err(StoreError::Deposed { .. })
    ));
    tokio::time::timeout(Duration::from_secs(2), a.lost().cancelled())
        .await
        .expect("a steps down as soon as it sees its key overwritten");
    // b finds the lease-less key, removes it and wins, long before a's lease (3 s TTL,
    // renewed) could have ended had a kept renewing it.
    let b = tokio::time::timeout(Duration::from_secs(10), b_task)
        .await
        .expect("the election recovers by itself")
        .unwrap()
        .expect("b is elected");
    b.store().create(&volume("by-b")).await.unwrap();
    let key = raw.get("/t/leaders/controller", None).await.unwrap();
    let kv = &key.kvs()[0];
    assert_eq!(
        (LeaderRecord::parse(kv.value()).holder.as_str(), kv.lease()),
        ("b", b.lease().0)
    );
    b.resign().await;
}

/// Issue 26: etcd 3.4 checks no permission on LeaseKeepAlive, so any identity could keep
/// a dead leader's lease alive and, with it, its election key. A holder that stops
/// renewing its record is replaced after the record's TTL, whoever keeps its lease
/// alive; a leader renewing its record is never replaced.
async fn a_dead_leader_kept_alive_by_another_is_replaced_after_its_ttl(backend: Backend) {
    let etcd = Etcd::start_on(backend).await;
    let sb = etcd.store("/t/").await;
    let shutdown = CancellationToken::new();
    // A live leader that renews its record keeps b out well past its TTL.
    let sa = etcd.store("/t/").await;
    let a = acquire(&sa, &cfg("a"), &shutdown)
        .await
        .expect("a is elected");
    let b_task = campaign(&sb, "b", &shutdown);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(!b_task.is_finished(), "b took over from a renewing leader");
    assert!(!a.lost().is_cancelled());
    a.resign().await;
    let b = tokio::time::timeout(Duration::from_secs(10), b_task)
        .await
        .expect("b wins once a resigns")
        .unwrap()
        .expect("b is elected");
    b.resign().await;

    // "dead" holds the key with a lease that the attacker keeps alive, and never
    // renews its record.
    let mut raw = etcd.raw_client().await;
    let lease = raw.lease_grant(3, None).await.unwrap().id();
    let (mut keeper, _responses) = raw.lease_keep_alive(lease).await.unwrap();
    let record =
        serde_json::json!({"holder": "dead", "campaign": 7, "ttl_ms": 3000, "renewals": 0});
    raw.put(
        "/t/leaders/controller",
        record.to_string(),
        Some(etcd_client::PutOptions::new().with_lease(lease)),
    )
    .await
    .unwrap();
    let attacker = tokio::spawn(async move {
        loop {
            let _ = keeper.keep_alive().await;
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });
    let started = Instant::now();
    let c = tokio::time::timeout(Duration::from_secs(15), acquire(&sb, &cfg("c"), &shutdown))
        .await
        .expect("c is elected although the dead holder's lease is kept alive")
        .expect("c is elected");
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "c did not wait for the record's TTL"
    );
    let ttl = raw.lease_time_to_live(lease, None).await.unwrap().ttl();
    assert!(ttl > 0, "the attacker's lease was still alive throughout");
    c.store().create(&volume("by-c")).await.unwrap();
    attacker.abort();
    c.resign().await;
}

crate::both_stores!(
    a_dead_leader_kept_alive_by_another_is_replaced_after_its_ttl,
    an_overwritten_election_key_deposes_at_once_and_the_election_recovers,
    failover_when_the_leader_s_lease_is_revoked,
    a_leader_cut_off_from_etcd_stops_before_another_starts,
    lead_hands_over_on_resign_and_stops_on_shutdown,
);
