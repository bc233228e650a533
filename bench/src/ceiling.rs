//! The store's own ceiling, measured in the same run: compare-and-swap updates with
//! moor's concurrency, and put→watch-event latency.

use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, EventType, Txn, TxnOp, WatchOptions};
use futures::future::join_all;

use crate::stats::Percentiles;

/// What the store can do.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Ceiling {
    /// Successful CAS updates per second.
    pub cas_updates_per_s: f64,
    /// Concurrent updaters.
    pub concurrency: usize,
    /// Put → watch event latency.
    pub put_watch_ms: Percentiles,
}

/// `concurrency` tasks each update their own key with a txn guarded by its
/// mod_revision (as a reconciler writes), for `duration`.
pub async fn cas(client: &Client, concurrency: usize, duration: Duration) -> anyhow::Result<f64> {
    let start = Instant::now();
    let tasks = (0..concurrency).map(|i| {
        let mut c = client.clone();
        async move {
            let key = format!("/bench-ceiling/cas/{i}");
            let mut rev = c
                .put(key.clone(), "0", None)
                .await?
                .header()
                .map_or(0, |h| h.revision());
            let mut n = 0u64;
            while start.elapsed() < duration {
                let txn = Txn::new()
                    .when([Compare::mod_revision(key.clone(), CompareOp::Equal, rev)])
                    .and_then([TxnOp::put(key.clone(), n.to_string(), None)]);
                let resp = c.txn(txn).await?;
                anyhow::ensure!(
                    resp.succeeded(),
                    "CAS on {key} lost: only this task writes it"
                );
                rev = resp.header().map_or(0, |h| h.revision());
                n += 1;
            }
            anyhow::Ok(n)
        }
    });
    let mut total = 0;
    for r in join_all(tasks).await {
        total += r?;
    }
    Ok(total as f64 / start.elapsed().as_secs_f64())
}

/// `samples` sequential puts, each timed until its watch event arrives.
pub async fn put_watch(client: &Client, samples: usize) -> anyhow::Result<Percentiles> {
    let mut c = client.clone();
    let mut stream = c
        .watch(
            "/bench-ceiling/watch/",
            Some(WatchOptions::new().with_prefix()),
        )
        .await?;
    // The client does not wait for the watch to exist: a put sent before the server
    // has created it is not seen. Wait for the `created` answer first.
    let first = tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .map_err(|_| anyhow::anyhow!("the watch was not created within 10 s"))??;
    anyhow::ensure!(
        first.as_ref().is_some_and(|r| r.created()),
        "the store's first watch answer was not `created`"
    );
    let mut lat = Vec::with_capacity(samples);
    for i in 0..samples {
        let key = format!("/bench-ceiling/watch/{}", i % 64);
        let t = Instant::now();
        let rev = c
            .put(key, i.to_string(), None)
            .await?
            .header()
            .map_or(0, |h| h.revision());
        'seen: loop {
            let resp = tokio::time::timeout(Duration::from_secs(10), stream.message())
                .await
                .map_err(|_| anyhow::anyhow!("no watch event within 10 s"))??
                .ok_or_else(|| anyhow::anyhow!("watch closed"))?;
            for ev in resp.events() {
                if ev.event_type() == EventType::Put
                    && ev.kv().is_some_and(|kv| kv.mod_revision() == rev)
                {
                    break 'seen;
                }
            }
        }
        lat.push(t.elapsed());
    }
    Ok(Percentiles::of(&mut lat))
}
