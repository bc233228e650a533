//! The measured phases: claims published and released in bulk, reaction latency one
//! stop at a time, attachments alone, and a controller restart mid-run.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context};
use futures::{stream, StreamExt, TryStreamExt};
use moor::api::*;
use moor::runtime::watcher::{watcher_with, Event};
use moor::store::Store;
use tokio::sync::Notify;

use crate::stats::Percentiles;

/// Writers in flight at once, as the controller's default concurrency.
pub const WRITERS: usize = 16;

/// Live counts of claims per (allocation prefix, phase) and of attachments per phase.
#[derive(Default)]
struct Counts {
    claims: HashMap<String, ClaimPhase>,
    claim_counts: HashMap<(String, ClaimPhase), usize>,
    attachments: PhaseCounts<AttachmentPhase>,
    volumes: PhaseCounts<VolumePhase>,
    /// The highest store revision at which a claim changed phase (only the controller
    /// writes claim phases), for the restart phase.
    last_change: i64,
}

/// The phase of every object of one kind by key, and how many are in each phase.
struct PhaseCounts<P> {
    by_key: HashMap<String, P>,
    counts: HashMap<P, usize>,
}

impl<P> Default for PhaseCounts<P> {
    fn default() -> Self {
        PhaseCounts {
            by_key: HashMap::new(),
            counts: HashMap::new(),
        }
    }
}

impl<P: Copy + Eq + std::hash::Hash> PhaseCounts<P> {
    fn set(&mut self, key: String, phase: Option<P>) {
        let old = match phase {
            Some(p) => self.by_key.insert(key, p),
            None => self.by_key.remove(&key),
        };
        if let Some(o) = old {
            *self.counts.entry(o).or_default() -= 1;
        }
        if let Some(p) = phase {
            *self.counts.entry(p).or_default() += 1;
        }
    }

    fn get(&self, phase: P) -> usize {
        self.counts.get(&phase).copied().unwrap_or(0)
    }
}

/// Watches every object of kind `S` into the `PhaseCounts` that `field` picks.
fn count_phases<S, P>(
    store: Store,
    counts: Arc<Mutex<Counts>>,
    changed: Arc<Notify>,
    field: fn(&mut Counts) -> &mut PhaseCounts<P>,
    phase: fn(&Object<S>) -> P,
) -> tokio::task::JoinHandle<()>
where
    S: Spec,
    P: Copy + Eq + std::hash::Hash + Send + 'static,
{
    tokio::spawn(async move {
        // No previous values: the harness must not add backend reads to etcd's work.
        let mut w = Box::pin(watcher_with::<S>(store, moor::api::KeyScope::all(), false));
        while let Some(ev) = w.next().await {
            let mut c = counts.lock().unwrap_or_else(|e| e.into_inner());
            let t = field(&mut c);
            match ev {
                Ok(Event::Applied(o)) => t.set(o.key(), Some(phase(&o))),
                Ok(Event::Deleted { key, .. }) => t.set(key, None),
                Ok(Event::Restarted(objs)) => {
                    *t = PhaseCounts::default();
                    for o in objs {
                        t.set(o.key(), Some(phase(&o)));
                    }
                }
                _ => {}
            }
            drop(c);
            changed.notify_waiters();
        }
    })
}

fn group(claim: &str) -> String {
    claim.split('-').next().unwrap_or_default().to_string()
}

/// Watches claims, attachments and volumes (what an observer of moor would do) and keeps
/// counts.
#[derive(Clone)]
pub struct Tracker {
    counts: Arc<Mutex<Counts>>,
    changed: Arc<Notify>,
    _tasks: Arc<Tasks>,
}

/// The watch tasks, aborted when the last Tracker goes (a finished run must not keep
/// watching a dead store and take CPU from the next one).
struct Tasks(Vec<tokio::task::AbortHandle>);

impl Drop for Tasks {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

impl Tracker {
    /// Starts watching.
    pub fn spawn(store: &Store) -> Tracker {
        let counts: Arc<Mutex<Counts>> = Arc::default();
        let changed = Arc::new(Notify::new());
        let (c1, n1, s1) = (counts.clone(), changed.clone(), store.clone());
        let claims = tokio::spawn(async move {
            let mut w = Box::pin(watcher_with::<ClaimSpec>(
                s1,
                moor::api::KeyScope::all(),
                false,
            ));
            while let Some(ev) = w.next().await {
                let mut c = c1.lock().unwrap_or_else(|e| e.into_inner());
                let mut apply = |name: String, phase: Option<ClaimPhase>, rev: i64| {
                    let g = group(&name);
                    let old = match phase {
                        Some(p) => c.claims.insert(name, p),
                        None => c.claims.remove(&name),
                    };
                    if old == phase {
                        return;
                    }
                    if let Some(o) = old {
                        *c.claim_counts.entry((g.clone(), o)).or_default() -= 1;
                    }
                    if let Some(p) = phase {
                        *c.claim_counts.entry((g, p)).or_default() += 1;
                    }
                    c.last_change = c.last_change.max(rev);
                };
                match ev {
                    Ok(Event::Applied(o)) => apply(
                        o.metadata.name.to_string(),
                        Some(o.status.phase),
                        o.metadata.resource_version,
                    ),
                    Ok(Event::Deleted { key, .. }) => apply(
                        key.rsplit('/').next().unwrap_or_default().to_string(),
                        None,
                        0,
                    ),
                    Ok(Event::Restarted(objs)) => {
                        for o in objs {
                            let rev = o.metadata.resource_version;
                            apply(o.metadata.name.to_string(), Some(o.status.phase), rev);
                        }
                    }
                    _ => {}
                }
                drop(c);
                n1.notify_waiters();
            }
        });
        let attachments = count_phases::<AttachmentSpec, _>(
            store.clone(),
            counts.clone(),
            changed.clone(),
            |c| &mut c.attachments,
            |a| a.status.phase,
        );
        let volumes = count_phases::<VolumeSpec, _>(
            store.clone(),
            counts.clone(),
            changed.clone(),
            |c| &mut c.volumes,
            |v| v.status.provisioning.phase,
        );
        Tracker {
            counts,
            changed,
            _tasks: Arc::new(Tasks(vec![
                claims.abort_handle(),
                attachments.abort_handle(),
                volumes.abort_handle(),
            ])),
        }
    }

    /// Claims of allocation group `g` (the name before `-`) in `phase`.
    pub fn claims(&self, g: &str, phase: ClaimPhase) -> usize {
        let c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        c.claim_counts
            .get(&(g.to_string(), phase))
            .copied()
            .unwrap_or(0)
    }

    /// Claims of allocation group `g` in any phase but `phase` (deleted ones are in
    /// none).
    pub fn claims_not(&self, g: &str, phase: ClaimPhase) -> usize {
        let c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        c.claim_counts
            .iter()
            .filter(|((group, p), _)| group == g && *p != phase)
            .map(|(_, n)| *n)
            .sum()
    }

    /// Attachments in `phase`, and in all.
    pub fn attachments(&self, phase: AttachmentPhase) -> (usize, usize) {
        let c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        (c.attachments.get(phase), c.attachments.by_key.len())
    }

    /// Volumes whose provisioning is in `phase`.
    pub fn volumes(&self, phase: VolumePhase) -> usize {
        let c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        c.volumes.get(phase)
    }

    /// The highest revision at which a claim changed phase.
    pub fn last_change(&self) -> i64 {
        self.counts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .last_change
    }

    /// Waits until `done` holds, waking on every change, failing after `timeout`.
    pub async fn until(
        &self,
        what: &str,
        timeout: Duration,
        mut done: impl FnMut(&Tracker) -> bool,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let woken = self.changed.notified();
            if done(self) {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!("timed out after {timeout:?} waiting for {what}");
            }
            // A change may land between the check and the wait: re-check at least
            // every 100 ms.
            let _ = tokio::time::timeout(left.min(Duration::from_millis(100)), woken).await;
        }
    }
}

fn ns() -> Namespace {
    Namespace::default_ns()
}

/// `n` volumes `v00000`.., single-node-writer, created through the plugin.
pub async fn create_volumes(store: &Store, plugin: &str, n: usize) -> anyhow::Result<()> {
    create_volumes_named(store, plugin, (0..n).map(|i| format!("v{i:05}"))).await
}

/// Volumes with these names, single-node-writer, created through the plugin, with
/// [`WRITERS`] in flight.
pub async fn create_volumes_named(
    store: &Store,
    plugin: &str,
    names: impl Iterator<Item = String>,
) -> anyhow::Result<()> {
    stream::iter(names)
        .map(|name| {
            let spec = VolumeSpec {
                plugin_id: PluginId::new(plugin)?,
                capacity_min: Some(Size(1 << 20)),
                capabilities: vec![VolumeCapability {
                    access_mode: AccessMode::SingleNodeWriter,
                    attachment_mode: AttachmentMode::FileSystem,
                }],
                ..Default::default()
            };
            Ok(Volume::new(&ns(), Name::new(name)?, spec))
        })
        .map_ok(|v| async move {
            store
                .create(&v)
                .await
                .map(|_| ())
                .context("creating a volume")
        })
        .try_buffer_unordered(WRITERS)
        .try_collect::<()>()
        .await
}

/// The allocation `<group>-<i>` on `node` claiming volume `v<i>`.
pub fn allocation(group: &str, i: usize, node: &NodeName) -> anyhow::Result<Allocation> {
    allocation_named(&format!("{group}-{i:05}"), &format!("v{i:05}"), node)
}

/// The allocation `name` on `node` claiming `volume` (single-node-writer, file system)
/// as its request `data`.
pub fn allocation_named(name: &str, volume: &str, node: &NodeName) -> anyhow::Result<Allocation> {
    let spec = AllocationSpec {
        node: node.clone(),
        volumes: vec![VolumeRequest {
            name: Name::new("data")?,
            volume: VolumeId::new(volume)?,
            access_mode: Some(AccessMode::SingleNodeWriter),
            attachment_mode: Some(AttachmentMode::FileSystem),
            ..Default::default()
        }],
        ..Default::default()
    };
    Ok(Allocation::new(&ns(), Name::new(name)?, spec))
}

/// Writes allocations with [`WRITERS`] in flight.
pub async fn write_allocations(store: &Store, allocs: Vec<Allocation>) -> anyhow::Result<()> {
    stream::iter(allocs)
        .map(|a| async move {
            store
                .create(&a)
                .await
                .map(|_| ())
                .context("creating an allocation")
        })
        .buffer_unordered(WRITERS)
        .try_collect::<()>()
        .await
}

/// Stops allocations `<group>-<i>` for `range`, with [`WRITERS`] in flight; returns when
/// each stop was written (wall clock, to compare with the plugin's call log).
pub async fn stop_allocations(
    store: &Store,
    group: &str,
    range: std::ops::Range<usize>,
) -> anyhow::Result<HashMap<String, SystemTime>> {
    let written = stream::iter(range)
        .map(|i| async move {
            let name = format!("{group}-{i:05}");
            stop_one(store, &name).await.map(|t| (name, t))
        })
        .buffer_unordered(WRITERS)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(written.into_iter().collect())
}

/// Sets one allocation's desired status to stop; the time the write returned.
pub async fn stop_one(store: &Store, name: &str) -> anyhow::Result<SystemTime> {
    moor::workload::end(
        store,
        &Allocation::key_for(&Namespace::default_ns(), name),
        moor::workload::End::Stop,
    )
    .await?;
    Ok(SystemTime::now())
}

/// The store's current revision (its count of write requests so far).
pub async fn revision(store: &Store) -> anyhow::Result<i64> {
    let resp = store.client().get("/bench-probe", None).await?;
    Ok(resp.header().map_or(0, |h| h.revision()))
}

/// One line of a plugin's call log.
#[derive(serde::Deserialize)]
struct CallLine {
    time: String,
    rpc: String,
    #[serde(default)]
    target_path: Option<String>,
    #[serde(default)]
    volume_id: Option<String>,
    #[serde(default)]
    node_id: Option<String>,
    #[serde(default)]
    duration_ms: f64,
}

/// Every call of the given logs.
pub struct Calls(Vec<CallLine>);

impl Calls {
    /// Reads the logs (missing ones are skipped: external plugins keep none).
    pub fn read(logs: &[Option<PathBuf>]) -> anyhow::Result<Calls> {
        let mut calls = Vec::new();
        for path in logs.iter().flatten() {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            calls.extend(
                text.lines()
                    .filter_map(|l| serde_json::from_str::<CallLine>(l).ok()),
            );
        }
        Ok(Calls(calls))
    }

    /// Calls of `rpc`.
    pub fn count(&self, rpc: &str) -> usize {
        self.0.iter().filter(|c| c.rpc == rpc).count()
    }

    /// ControllerPublishVolume calls per (volume, node), for those after `skip` (the
    /// number of such calls before the phase).
    pub fn publishes_per_attachment(&self, skip: usize) -> (usize, usize) {
        let mut per: HashMap<(String, String), usize> = HashMap::new();
        for c in self
            .0
            .iter()
            .filter(|c| c.rpc == "ControllerPublishVolume")
            .skip(skip)
        {
            *per.entry((
                c.volume_id.clone().unwrap_or_default(),
                c.node_id.clone().unwrap_or_default(),
            ))
            .or_default() += 1;
        }
        (per.values().sum(), per.len())
    }

    /// For each stopped allocation, from its stop being written to the first
    /// NodeUnpublishVolume for it reaching the plugin (the call's end minus its
    /// duration).
    pub fn reaction(&self, stops: &HashMap<String, SystemTime>) -> Percentiles {
        let mut first: HashMap<&str, SystemTime> = HashMap::new();
        for c in self.0.iter().filter(|c| c.rpc == "NodeUnpublishVolume") {
            let Some(path) = &c.target_path else { continue };
            let Some(alloc) = path
                .split("/per-alloc/default/")
                .nth(1)
                .and_then(|r| r.split('/').next())
            else {
                continue;
            };
            let Ok(end) = humantime::parse_rfc3339_weak(&c.time) else {
                continue;
            };
            let arrived = end - Duration::from_secs_f64(c.duration_ms / 1000.0);
            let e = first.entry(alloc).or_insert(arrived);
            if arrived < *e {
                *e = arrived;
            }
        }
        let mut lat: Vec<Duration> = stops
            .iter()
            .filter_map(|(name, stop)| {
                let arrived = first.get(name.as_str())?;
                // The log has millisecond times: a call within the stop's millisecond
                // counts as zero.
                Some(arrived.duration_since(*stop).unwrap_or_default())
            })
            .collect();
        Percentiles::of(&mut lat)
    }
}
