//! The churn phase: ended work is collected, so etcd stays the same size however many
//! workloads have run. A cluster of its own (one node, the controller with a short
//! `--retention`) runs waves of allocations that are published and stopped; the
//! records of ended work (allocations, claims, Mounts, attachments) are counted before
//! the first wave and after the last has been collected, and etcd's `dbSizeInUse`
//! read after a compaction at each point.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use moor::api::{ClaimPhase, VolumePhase};
use moor::store::Store;
use serde::Serialize;

use crate::cluster::{self, Backend, Bins, Cluster};
use crate::phases::{self, Tracker};
use crate::step;

/// What the churn phase measured.
#[derive(Debug, Serialize, Default)]
pub struct ChurnRun {
    /// Allocations run (published, stopped, released, collected).
    pub cycles: usize,
    /// Allocations per wave (each claims its own volume).
    pub wave: usize,
    /// The controller's `--retention`.
    pub retention_s: f64,
    /// Keys of ended work's kinds before the first wave, the most seen after any wave,
    /// and after the last was collected.
    pub work_keys_before: usize,
    pub work_keys_max: usize,
    pub work_keys_after: usize,
    /// Every key under the prefix (events included: they expire with their lease,
    /// an hour by default) before and after.
    pub all_keys_before: usize,
    pub all_keys_after: usize,
    /// etcd's dbSizeInUse after a compaction, before the first wave and after the last.
    pub db_in_use_before: i64,
    pub db_in_use_after: i64,
    /// etcd's dbSize (the file) at the same points.
    pub db_size_before: i64,
    pub db_size_after: i64,
    /// The same once the events written during the waves are gone, as they are an
    /// hour later (their leases revoked here instead of waited for): every key under
    /// the prefix, and dbSizeInUse after a compaction.
    pub all_keys_after_events: usize,
    pub db_in_use_after_events: i64,
    /// Event keys written during the waves, per cycle.
    pub events_per_cycle: f64,
    /// Wall time of all the waves, and cycles per second.
    pub total_s: f64,
    pub cycles_per_s: f64,
}

/// Keys under `dir/` of the default prefix.
async fn keys(raw: &mut etcd_client::Client, dir: &str) -> anyhow::Result<usize> {
    let prefix = format!("{}{dir}", moor::store::DEFAULT_PREFIX);
    let r = raw
        .get(
            prefix.as_bytes(),
            Some(
                etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_count_only(),
            ),
        )
        .await?;
    Ok(r.count() as usize)
}

async fn work_keys(raw: &mut etcd_client::Client) -> anyhow::Result<usize> {
    let mut n = 0;
    for dir in [
        "allocations/",
        "claims/",
        "mounts/",
        "attachments/",
        "leases/",
    ] {
        n += keys(raw, dir).await?;
    }
    Ok(n)
}

/// Compacts at the current revision and reads (dbSizeInUse, dbSize).
async fn compacted_size(raw: &mut etcd_client::Client) -> anyhow::Result<(i64, i64)> {
    let rev = raw
        .get("/bench-probe", None)
        .await?
        .header()
        .map_or(0, |h| h.revision());
    raw.compact(
        rev,
        Some(etcd_client::CompactionOptions::new().with_physical()),
    )
    .await
    .context("compacting")?;
    let status = raw.status().await.context("status")?;
    Ok((status.raft_used_db_size(), status.db_size()))
}

/// Runs `cycles` allocations in waves of `wave` on a cluster of its own in `dir`.
pub async fn run(
    bins: &Bins,
    backend: Backend,
    dir: &Path,
    plugin_id: &str,
    cycles: usize,
    wave: usize,
    retention: Duration,
) -> anyhow::Result<ChurnRun> {
    let wave = wave.clamp(1, cycles.max(1));
    let srv = cluster::start_store(backend, bins, dir).await?;
    let mut raw = etcd_client::Client::connect([&srv.url], None).await?;
    let store = Store::connect(std::slice::from_ref(&srv.url), moor::store::DEFAULT_PREFIX).await?;
    let retention_flag = format!("--retention={}ms", retention.as_millis());
    let cluster = {
        let agent = crate::cluster::AgentFlags {
            plugin_id,
            plugin_options: "",
        };
        Cluster::start_with(bins, &srv.url, dir, 1, &[], &agent, &[retention_flag]).await?
    };
    cluster.wait_ready(&store, plugin_id).await?;
    let tracker = Tracker::spawn(&store);
    let long = Duration::from_secs(600);
    step(&format!("churn: creating {wave} volumes"));
    phases::create_volumes(&store, plugin_id, wave).await?;
    tracker
        .until("every volume ready", long, |t| {
            t.volumes(VolumePhase::Ready) >= wave
        })
        .await?;
    let mut out = ChurnRun {
        cycles,
        wave,
        retention_s: retention.as_secs_f64(),
        ..Default::default()
    };
    out.work_keys_before = work_keys(&mut raw).await?;
    out.all_keys_before = keys(&mut raw, "").await?;
    (out.db_in_use_before, out.db_size_before) = compacted_size(&mut raw).await?;
    let node = cluster.nodes[0].clone();
    let started = Instant::now();
    let waves = cycles.div_ceil(wave);
    for w in 0..waves {
        let n = wave.min(cycles - w * wave);
        let group = format!("ch{w}");
        step(&format!("churn: wave {}/{waves} of {n}", w + 1));
        let allocs = (0..n)
            .map(|i| phases::allocation(&group, i, &node))
            .collect::<anyhow::Result<Vec<_>>>()?;
        // The previous wave's claims on these volumes must be gone before this wave's
        // are admitted (single-node-writer): they are released before it starts.
        phases::write_allocations(&store, allocs).await?;
        tracker
            .until("the wave published", long, |t| {
                t.claims(&group, ClaimPhase::Published) >= n
            })
            .await?;
        phases::stop_allocations(&store, &group, 0..n).await?;
        tracker
            .until("the wave released", long, |t| {
                t.claims_not(&group, ClaimPhase::Released) == 0
            })
            .await?;
        out.work_keys_max = out.work_keys_max.max(work_keys(&mut raw).await?);
    }
    out.total_s = started.elapsed().as_secs_f64();
    out.cycles_per_s = cycles as f64 / out.total_s;
    step("churn: waiting for every ended allocation to be collected");
    let deadline = Instant::now() + long;
    loop {
        let n = work_keys(&mut raw).await?;
        if n <= out.work_keys_before {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{n} keys of ended work left after {long:?} (before: {})",
            out.work_keys_before
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    out.work_keys_after = work_keys(&mut raw).await?;
    out.all_keys_after = keys(&mut raw, "").await?;
    (out.db_in_use_after, out.db_size_after) = compacted_size(&mut raw).await?;
    // An hour later the events are gone with their leases: revoke those leases now.
    let events_before = out.all_keys_before - out.work_keys_before;
    let events = keys(&mut raw, "events/").await?;
    out.events_per_cycle = events.saturating_sub(events_before) as f64 / cycles.max(1) as f64;
    let prefix = format!("{}events/", moor::store::DEFAULT_PREFIX);
    let listed = raw
        .get(
            prefix.as_bytes(),
            Some(
                etcd_client::GetOptions::new()
                    .with_prefix()
                    .with_keys_only(),
            ),
        )
        .await?;
    let leases: std::collections::BTreeSet<i64> = listed
        .kvs()
        .iter()
        .map(|kv| kv.lease())
        .filter(|l| *l != 0)
        .collect();
    drop(cluster);
    for lease in leases {
        let _ = raw.lease_revoke(lease).await;
    }
    out.all_keys_after_events = keys(&mut raw, "").await?;
    (out.db_in_use_after_events, _) = compacted_size(&mut raw).await?;
    Ok(out)
}
