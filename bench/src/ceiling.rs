//! The store's own ceiling, measured in the same run: compare-and-swap updates with
//! moor's concurrency, the same in guarded multi-op transactions (what a group commit
//! of several reconciles' writes would be bounded by), and put→watch-event latency.

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
    /// Guarded multi-op transactions: for each size (ops per txn), the ops per second
    /// that succeeded, every op a put guarded by its own key's mod_revision, with the
    /// same concurrency.
    pub batched_cas_ops_per_s: Vec<BatchedCas>,
    /// Put → watch event latency.
    pub put_watch_ms: Percentiles,
}

/// The ceiling of guarded transactions of one size.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BatchedCas {
    /// Ops (guarded puts) per transaction.
    pub ops_per_txn: usize,
    /// Ops per second that succeeded.
    pub ops_per_s: f64,
    /// Transactions per second.
    pub txns_per_s: f64,
}

/// The sizes of transaction measured (etcd's default `--max-txn-ops` is 128).
pub const BATCH_SIZES: [usize; 3] = [8, 32, 64];

/// `concurrency` tasks each update their own key with a txn guarded by its
/// mod_revision (as a reconciler writes), for `duration`: [`batched_cas`] of one op.
pub async fn cas(client: &Client, concurrency: usize, duration: Duration) -> anyhow::Result<f64> {
    Ok(batched_cas(client, concurrency, 1, duration)
        .await?
        .ops_per_s)
}

/// `concurrency` tasks each update their own `ops` keys in one transaction at a time,
/// every put guarded by its key's mod_revision (as a group commit of `ops` reconciles'
/// writes would be), for `duration`.
pub async fn batched_cas(
    client: &Client,
    concurrency: usize,
    ops: usize,
    duration: Duration,
) -> anyhow::Result<BatchedCas> {
    // Every task writes its keys first (one transaction), then all start together:
    // the setup is not part of the time measured.
    let ready = std::sync::Arc::new(tokio::sync::Barrier::new(concurrency));
    let tasks = (0..concurrency).map(|i| {
        let (mut c, ready) = (client.clone(), ready.clone());
        async move {
            let keys: Vec<String> = (0..ops)
                .map(|k| format!("/bench-ceiling/batch{ops}/{i}/{k}"))
                .collect();
            let puts: Vec<TxnOp> = keys
                .iter()
                .map(|k| TxnOp::put(k.clone(), "0", None))
                .collect();
            let first = c.txn(Txn::new().and_then(puts)).await;
            // Waited for even after a failure, or the other tasks would wait forever.
            ready.wait().await;
            let mut revs = vec![first?.header().map_or(0, |h| h.revision()); ops];
            let start = Instant::now();
            let mut txns = 0u64;
            while start.elapsed() < duration {
                let compares: Vec<Compare> = keys
                    .iter()
                    .zip(&revs)
                    .map(|(k, r)| Compare::mod_revision(k.clone(), CompareOp::Equal, *r))
                    .collect();
                let puts: Vec<TxnOp> = keys
                    .iter()
                    .map(|k| TxnOp::put(k.clone(), txns.to_string(), None))
                    .collect();
                let resp = c.txn(Txn::new().when(compares).and_then(puts)).await?;
                anyhow::ensure!(
                    resp.succeeded(),
                    "a batch under /bench-ceiling/batch{ops}/{i} lost: only this task writes it"
                );
                let rev = resp.header().map_or(0, |h| h.revision());
                revs.iter_mut().for_each(|r| *r = rev);
                txns += 1;
            }
            anyhow::Ok((txns, start.elapsed()))
        }
    });
    let (mut total, mut longest) = (0, Duration::ZERO);
    for r in join_all(tasks).await {
        let (txns, took) = r?;
        total += txns;
        longest = longest.max(took);
    }
    let secs = longest.as_secs_f64();
    Ok(BatchedCas {
        ops_per_txn: ops,
        ops_per_s: (total * ops as u64) as f64 / secs,
        txns_per_s: total as f64 / secs,
    })
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
