//! The node reconciler: stages and publishes this node's claims, and tears them down.
//!
//! Expected flow for a claim key:
//! 1. Wait for the claim cache; take the volume's lock (one node call per volume at a
//!    time, so a stage and an unstage of one staging path never race). What the pass
//!    does is [`plan::pass`]'s decision, from the claim and the claim's record, carried
//!    out in one exhaustive match (`Reconcile::reconcile_claim`); a record whose claim
//!    is gone or replaced is settled first (`orphans`).
//! 2. A claim the controller allowed (`spec.publish`) and not released:
//!    `ensure_staged` (once per staging path, `<mount-dir>/staging/NS/VOL/<usage>`, when
//!    the plugin has STAGE_UNSTAGE_VOLUME), then `ensure_published` to
//!    `<mount-dir>/per-alloc/NS/ALLOC/VOL/<ro|rw>-<usage>`. Each step is recorded as
//!    uncertain in the data dir (on disk) before its call and done after it (on disk
//!    before the Mount says so), so a restarted agent adopts what is done instead of
//!    repeating it.
//! 3. A released (or deleted) claim: `ensure_unpublished`, then `unstage` when
//!    no other claim uses the staging path; then the Mount says `released`, which is
//!    what lets the controller detach.
//! 4. Every change is mirrored in the claim's Mount object; failures are recorded there
//!    (`last_error`) and as "Mount volume" / "Unmount volume" events. What a failure
//!    asks of the loop is [`plan::after`]'s: the key is retried on the runtime's
//!    per-key backoff, and a CSI step is not called again before its own schedule
//!    allows (its gate, `moor::runtime::steps`, answers backing off until then).
//!
//! # Layout
//! - `plan`: what the node owes a claim, decided from facts alone.
//! - `publish`: a granted claim's publish pass.
//! - `release`: a released or deleted claim's teardown.
//! - `mount`: the claim's Mount and the node's events.
//! - `orphans`: mounts whose claims desired state lost (an older snapshot restored):
//!   kept, reported, adopted.
//! - `stats`: volume usage and health.

use moor::api::*;
use moor::csi::client::Csi;
use moor::csi::policy::{Class, CsiError, Policy};
use moor::csi::{convert, v1};
use moor::journal::{Journal, JournalError};
use moor::runtime::controller::{Action, Config, Controller, ErrorPolicy, ReconcileError};
use moor::runtime::events::Recorder;
use moor::runtime::informer::Informer;
use moor::runtime::metrics::ControllerMetrics;
use moor::runtime::reflector;
use moor::runtime::steps::{self, Steps};
use moor::store::{Store, StoreError};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

mod mount;
mod orphans;
mod plan;
mod publish;
mod release;
mod stats;
#[cfg(test)]
mod tests;

use mount::claim_ref;

use super::config::PluginConfig;
use super::plugins::Supervisor;
use super::state::{on_grant, LocalState, MadeFor, PublishRecord, StageRecord, Step};
use super::step_error::StepError;
use crate::common::{details, KeyedLocks};
use moor::runtime::writer::Writer;

/// How often an orphaned mount is looked at again, its holders refreshed on its Mount
/// (written only when they changed).
const ORPHAN_HOLDERS_REFRESH: std::time::Duration = std::time::Duration::from_secs(5);

/// Why a claim could not be brought to its desired state on this node: what every
/// executor's pass fails with ([`StepError`]), and the node's own cases.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// What every executor's pass fails with: a closed gate, a CSI call, the store,
    /// sealed secrets.
    #[error(transparent)]
    Step(#[from] StepError),
    /// The claim names a plugin this agent does not run as a node plugin.
    #[error("plugin {0} is not a node plugin on this node")]
    UnknownPlugin(PluginId),
    /// The plugin has not been fingerprinted yet.
    #[error("plugin {0} has not answered a fingerprint yet")]
    PluginNotReady(PluginId),
    /// The controller has not filled in what the node needs.
    #[error("claim is missing {0}")]
    Incomplete(&'static str),
    /// The agent's record of what it did could not be written.
    #[error("cannot record the node's local state")]
    State(#[from] JournalError),
    /// The node is not registered (its lease was lost): it takes no forward step, since
    /// the controller may be releasing its claims without it.
    #[error("the node is not registered; no node step until it is")]
    NotRegistered,
    /// The staging path was staged under a grant since withdrawn and another claim is
    /// still published from it.
    #[error("staging path {0} was staged under an earlier attachment and is still in use; waiting for its other claims to be torn down")]
    StagingBusy(String),
    /// A released claim's workload still has processes after SIGKILL: its volume is
    /// not unpublished under them.
    #[error("the workload's cgroup {cgroup} is not empty: {why}; NodeUnpublish waits until it is")]
    WorkloadLeft {
        /// The cgroup, as recorded.
        cgroup: String,
        /// What is left.
        why: String,
    },
    /// The claim's name is held by an orphaned mount (a claim an older snapshot's
    /// restore lost) that this claim would not make again.
    #[error("an orphaned mount of an earlier claim {claim} (missing from desired state since a restore) is kept at {target}; this claim waits until an operator adopts or releases it (moorctl get mounts --orphaned)")]
    NameHeldByOrphan {
        /// The claim's name.
        claim: String,
        /// The orphan's target path.
        target: String,
    },
    /// An orphaned mount of the same volume is live on this node: the volume is not
    /// let go (a detach would pull it from under the orphan's workload).
    #[error("an orphaned mount of this volume is live on the node at {target} (its claim is missing from desired state since a restore); the release is not acknowledged, so the volume is not detached from under it, until an operator adopts or releases it")]
    VolumeHeldByOrphan {
        /// The orphan's target path.
        target: String,
    },
    /// The agent's own files.
    #[error("cannot write {path}")]
    Io {
        /// The path.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

crate::agent::step_error::through_step_error!(
    NodeError,
    steps::BackingOff,
    CsiError,
    StoreError,
    moor::api::SealedSecrets,
);

impl NodeError {
    /// A step's closed gate: not a failure, and already recorded when it failed.
    fn is_backing_off(&self) -> bool {
        matches!(self, NodeError::Step(StepError::BackingOff(_)))
    }

    /// Nothing new to say on the claim: a closed gate, or a lapsed registration (not
    /// the claim's failure, and etcd may be out of reach: the next term wakes it).
    fn is_quiet(&self) -> bool {
        self.is_backing_off() || matches!(self, NodeError::NotRegistered)
    }
}

/// A failed step: a call its registration term stopped before anything was sent is
/// the node not being registered (it waits for the next term, which wakes every
/// claim), not a failure of the plugin.
impl From<steps::Failed> for NodeError {
    fn from(failed: steps::Failed) -> Self {
        if failed.error.is_not_sent() {
            NodeError::NotRegistered
        } else {
            NodeError::Step(StepError::Csi(failed.error))
        }
    }
}

impl ReconcileError for NodeError {
    fn policy(&self) -> ErrorPolicy {
        match self {
            NodeError::Step(e) => e.policy(),
            _ => ErrorPolicy::Backoff,
        }
    }
}

/// The node reconciler and what it needs.
pub struct NodeReconciler {
    /// etcd.
    pub store: Store,
    /// This node.
    pub node: NodeName,
    /// The node (or monolith) plugins of this node.
    pub plugins: Vec<PluginConfig>,
    /// Channels and fingerprints.
    pub supervisor: Supervisor,
    /// What was staged and published, journalled in the agent's data dir.
    pub local: Arc<Mutex<Journal<LocalState>>>,
    /// The live contract monitor (NodeExpandVolume's answers).
    pub monitor: crate::agent::contract::Monitor,
    /// One node call per volume at a time.
    pub locks: KeyedLocks,
    /// CSI call policy.
    pub policy: Policy,
    /// Retry gates of failing node steps.
    pub steps: Steps,
    /// Events.
    pub recorder: Recorder,
    /// How often published volumes' usage and health are read (NodeGetVolumeStats).
    pub stats_interval: std::time::Duration,
    /// The node's force-detach declarations, read fresh before a forward step; steps
    /// asking at once share a read that began after they asked.
    pub declarations: moor::runtime::shared_read::SharedRead<Declarations>,
    /// Bumped after every Mount this node writes: the volume-plugin endpoint's waits
    /// for a publish wake on it instead of polling the store.
    pub wake: moor::workload::Wake,
}

/// The paths a claim uses, on the host and as the plugin sees them.
struct Paths {
    staging_host: PathBuf,
    target_host: PathBuf,
    target_plugin: PathBuf,
}

fn usage(cap: VolumeCapability) -> String {
    format!("{}-{}", cap.attachment_mode, cap.access_mode)
}

fn paths(cfg: &PluginConfig, claim: &Claim, cap: VolumeCapability) -> Paths {
    let ns = claim.metadata.namespace.as_str();
    let vol = claim.spec.volume.as_str();
    let alloc = claim.spec.allocation.as_str();
    let rw = match claim.spec.mode {
        ClaimMode::Read => "ro",
        ClaimMode::Write => "rw",
    };
    let staging = Path::new("staging").join(ns).join(vol).join(usage(cap));
    let target = Path::new("per-alloc")
        .join(ns)
        .join(alloc)
        .join(vol)
        .join(format!("{rw}-{}", usage(cap)));
    Paths {
        staging_host: cfg.mount_dir.join(&staging),
        target_host: cfg.mount_dir.join(&target),
        target_plugin: cfg.container_mount_dir.join(&target),
    }
}

/// Maps a host path under the plugin's mount dir to the plugin's view of it.
fn plugin_path(cfg: &PluginConfig, host: &Path) -> PathBuf {
    match host.strip_prefix(&cfg.mount_dir) {
        Ok(rel) => cfg.container_mount_dir.join(rel),
        Err(_) => host.to_path_buf(),
    }
}

/// The key of the claim a Mount mirrors.
fn claim_key_of(m: &Mount) -> ObjectKey<ClaimSpec> {
    Mount::claim_key(&m.object_key())
}

/// The claim keys among the journal's keys (claim keys this agent wrote).
fn claim_keys<'a>(keys: impl IntoIterator<Item = &'a String>) -> Vec<ObjectKey<ClaimSpec>> {
    keys.into_iter()
        .filter_map(|k| ObjectKey::parse(k).ok())
        .collect()
}

/// The key of the Mount of a claim key from the claims queue (`None`: not a claim key).
fn mount_key_of(claim: &str) -> Option<ObjectKey<MountSpec>> {
    ObjectKey::<ClaimSpec>::parse(claim)
        .ok()
        .map(|k| Mount::key_for(&k))
}

fn path_str(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

impl NodeReconciler {
    /// Runs until `shutdown`.
    pub async fn run(self, metrics: ControllerMetrics, shutdown: CancellationToken) {
        // Nothing is read or done before the node is registered: a node that was
        // collected while away has its grants withdrawn in a transaction that holds
        // only while its Node is absent, so the claims listed after registering show
        // every withdrawal made while it was gone.
        let term = self.supervisor.registered(&shutdown).await;
        if term == 0 {
            return;
        }
        let claims = Informer::<Claim>::spawn(
            self.store.clone(),
            Claim::node_scope(&self.node),
            shutdown.clone(),
        );
        let reader = claims.reader();
        // Claims deleted while the agent was down are known only to the local state.
        let local_keys = claim_keys(self.local.lock().await.publishes.keys());
        let on_plugin_change = {
            let (reader, local) = (reader.clone(), self.local.clone());
            futures::stream::unfold(self.supervisor.changes(), move |mut rx| {
                let (reader, local) = (reader.clone(), local.clone());
                async move {
                    rx.changed().await.ok()?;
                    let mut keys: Vec<_> = reader.state().iter().map(|c| c.object_key()).collect();
                    keys.extend(claim_keys(local.lock().await.publishes.keys()));
                    Some((futures::stream::iter(keys), rx))
                }
            })
        };
        // Only this agent writes its node's Mounts: its cache of them (checked against
        // its own writes) saves a read before every Mount write.
        let mounts = Informer::<Mount>::spawn(
            self.store.clone(),
            Mount::node_scope(&self.node),
            shutdown.clone(),
        );
        // A Mount whose claim was deleted while the agent was down, and that the local
        // state does not know (nothing was staged or published for it), is found only
        // by listing the Mounts: each (re)list names the claims of the Mounts, so one
        // without a claim is deleted. The agent's own Mount writes trigger nothing.
        let listed_mounts = futures::StreamExt::flat_map(mounts.subscribe(), |e| {
            let keys: Vec<ObjectKey<ClaimSpec>> = match e {
                Ok(moor::runtime::watcher::Event::Restarted(all)) => {
                    all.iter().map(|m| claim_key_of(m)).collect()
                }
                _ => Vec::new(),
            };
            futures::stream::iter(keys)
        });
        let stats_interval = self.stats_interval;
        let writer = Writer::new(self.store.clone()).tracking(&mounts.reader());
        let orphans = orphans::Orphans::of(&**self.local.lock().await);
        let this = Arc::new(Reconcile {
            orphans: std::sync::Mutex::new(orphans),
            r: self,
            claims: reader.clone(),
            mounts: mounts.reader(),
            writer,
            listed_in: term,
        });
        tokio::spawn(this.clone().stats_loop(stats_interval, shutdown.clone()));
        Controller::new("node", reader, Config::default())
            .with_metrics(metrics)
            .owns(claims.subscribe())
            .trigger(futures::stream::iter(local_keys))
            .trigger(futures::StreamExt::flatten(on_plugin_change))
            .trigger(listed_mounts)
            .run(Reconcile::reconcile, this, shutdown)
            .await;
    }
}

struct Reconcile {
    r: NodeReconciler,
    claims: reflector::Store<Claim>,
    mounts: reflector::Store<Mount>,
    /// Writes the node's Mounts (and records them, read back through `mounts`).
    writer: Writer,
    /// The registration term in which the claims were first listed.
    listed_in: u64,
    /// The orphaned records ([`orphans`]).
    orphans: std::sync::Mutex<orphans::Orphans>,
}

impl Reconcile {
    async fn reconcile(self: Arc<Self>, key: ObjectKey<ClaimSpec>) -> Result<Action, NodeError> {
        self.claims.wait_until_ready().await;
        self.mounts.wait_until_ready().await;
        let key = key.as_str();
        let claim = self.claims.get(key);
        // A step of the claim's trace: its NodeStage, NodePublish and their reverses.
        let span = moor::telemetry::step_span(
            "node",
            key,
            claim.as_ref().map_or("", |c| c.spec.volume.as_str()),
            self.r.node.as_str(),
            claim.as_ref().and_then(|c| c.metadata.trace.as_deref()),
        );
        tracing::Instrument::instrument(self.reconcile_claim(key, claim), span).await
    }

    async fn reconcile_claim(
        &self,
        key: &str,
        claim: Option<Arc<Claim>>,
    ) -> Result<Action, NodeError> {
        if let Some(c) = &claim {
            self.r.supervisor.attach_refused(c);
        }
        let record = self.r.local.lock().await.publishes.get(key).cloned();
        let lock_key = match (&claim, &record) {
            (Some(c), _) => Volume::key_for(&c.metadata.namespace, &c.spec.volume).into_string(),
            (None, Some(r)) => Volume::key_for(&r.namespace, &r.volume).into_string(),
            (None, None) => key.to_string(),
        };
        let _guard = self.r.locks.lock(&lock_key).await;
        let (claim, wanted) = match plan::pass(claim.as_deref(), record.as_ref()) {
            plan::Pass::Nothing => {
                self.delete_mount(key).await?;
                return Ok(Action::AwaitChange);
            }
            plan::Pass::Gone(rec) => return self.gone(key, rec).await,
            plan::Pass::ReleasedForGood => return Ok(Action::AwaitChange),
            plan::Pass::Replaced(rec, claim, wanted) => {
                if let Some(done) = self.replaced(key, rec, claim, wanted).await? {
                    return Ok(done);
                }
                (claim, wanted)
            }
            plan::Pass::Claim(claim, wanted) => (claim, wanted),
        };
        let done = match wanted {
            plan::Wanted::Release => self.release(key, claim).await,
            plan::Wanted::Publish => match self.granted(claim).await {
                Ok(Some((claim, term))) => self.publish(key, &claim, term).await,
                // Changed since the cache showed it: its own event comes next.
                Ok(None) => Ok(()),
                Err(e) => Err(e),
            },
            plan::Wanted::Withdrawn => self.withdrawn(key, claim).await,
        };
        let Err(e) = done else {
            return Ok(Action::AwaitChange);
        };
        match plan::after(&e) {
            // The step was not taken: said on the Mount (etcd, not the full disk) and
            // as a Warning, and counted.
            plan::After::JournalFailed => {
                self.journal_failed(key, claim, &e).await;
                Err(e)
            }
            // Not a failure to back off from: the plugin's first fingerprint (right
            // after an agent starts, every claim of the node waits for it) or the
            // node's next registration wakes every claim.
            plan::After::AwaitChange => {
                tracing::debug!(claim = %key, reason = %e, "waiting");
                Ok(Action::AwaitChange)
            }
            // Recorded on the Mount already; the step's own schedule says when.
            plan::After::Gated(after) => Ok(Action::Requeue(after)),
            plan::After::StepSchedule => Ok(Action::Requeue(
                self.r.steps.remaining(key).unwrap_or_default(),
            )),
            plan::After::Backoff => Err(e),
        }
    }

    /// A record whose claim the store no longer holds: torn down and forgotten (and
    /// the claim's Mount deleted), unless nothing says the claim was deleted (an older
    /// snapshot restored): then kept and reported.
    async fn gone(&self, key: &str, rec: &PublishRecord) -> Result<Action, NodeError> {
        if self.missing(key, rec).await? == plan::Missing::Orphan {
            self.orphaned(key, rec).await?;
            // Looked at again while orphaned: its holders are refreshed on its Mount.
            return Ok(Action::Requeue(ORPHAN_HOLDERS_REFRESH));
        }
        self.teardown(key, rec).await?;
        self.forget(key).await?;
        self.delete_mount(key).await?;
        Ok(Action::AwaitChange)
    }

    /// A record of another claim of the same name: torn down and forgotten if that
    /// claim was deleted (and made again while the agent was away); else kept as an
    /// orphan, which this claim takes over if it would publish the same mount. `Some`:
    /// the pass ends there (the claim waits for an operator to settle the orphan).
    async fn replaced(
        &self,
        key: &str,
        rec: &PublishRecord,
        claim: &Claim,
        wanted: plan::Wanted,
    ) -> Result<Option<Action>, NodeError> {
        if self.missing(key, rec).await? == plan::Missing::Deleted {
            self.teardown(key, rec).await?;
            self.forget(key).await?;
            return Ok(None);
        }
        // The record's claim is unknown to the store: kept. Until this claim is
        // granted it cannot be told whether it makes the same mount (an adoption's
        // claim is admitted and attached first: its grant brings it back); one that
        // wants something else waits until an operator settles the orphan.
        let rec = self.mark_orphan(key, rec).await?;
        if self.adopt_in_place(key, &rec, claim).await? {
            return Ok(None);
        }
        self.orphaned(key, &rec).await?;
        match wanted {
            plan::Wanted::Withdrawn => Ok(Some(Action::AwaitChange)),
            plan::Wanted::Release | plan::Wanted::Publish => Err(NodeError::NameHeldByOrphan {
                claim: claim.metadata.name.to_string(),
                target: path_str(&rec.target_path),
            }),
        }
    }

    /// The claim as granted now, before any forward step: only while the node is
    /// registered, and read again from the store when the node registered again since
    /// its claims were listed (it may have been collected meanwhile, and the cache may
    /// not show the withdrawal yet). `None`: the grant is no longer as cached. With the
    /// claim, the registration term it was read in: each forward call is gated on that
    /// term still holding ([`Reconcile::forward_csi`]).
    async fn granted<'c>(
        &self,
        cached: &'c Claim,
    ) -> Result<Option<(std::borrow::Cow<'c, Claim>, u64)>, NodeError> {
        let term = self.r.supervisor.registration();
        if term == 0 {
            return Err(NodeError::NotRegistered);
        }
        if term == self.listed_in {
            return Ok(Some((std::borrow::Cow::Borrowed(cached), term)));
        }
        let fresh = self.r.store.try_get(&cached.object_key()).await?;
        Ok(fresh
            .filter(|c| {
                c.metadata.uid == cached.metadata.uid
                    && c.spec.publish
                    && !c.spec.release
                    && !c.is_deleting()
            })
            .map(|c| (std::borrow::Cow::Owned(c), term)))
    }

    /// A claim the node may not act on (not yet granted, or its grant withdrawn): what
    /// it did under a withdrawn grant is torn down and forgotten, so that a new grant
    /// starts from nothing.
    async fn withdrawn(&self, key: &str, claim: &Claim) -> Result<(), NodeError> {
        let Some(rec) = self.r.local.lock().await.publishes.get(key).cloned() else {
            return Ok(());
        };
        if !rec.released && !claim.spec.revoked && rec.claim_uid == claim.metadata.uid {
            // Never withdrawn (a withdrawal sets `revoked`), so not granted yet as the
            // store has it: an older snapshot restored from before the grant. The
            // mount stays; the controller grants the claim again.
            tracing::info!(claim = %key, "the store shows this claim not yet granted, though the node published it: keeping the mount until the grant comes back");
            return Ok(());
        }
        if !rec.released {
            self.torn_down(key, claim, &rec).await?;
        }
        self.forget(key).await?;
        self.sync_mount(key, claim, None).await
    }

    /// What a claim's node steps depend on: the claim's identity and spec, and the
    /// plugin's fingerprint. The agent's Mount writes (and the controller's status
    /// writes they cause) change none of it.
    fn inputs(&self, uid: &str, generation: i64) -> u64 {
        steps::inputs((uid, generation, self.r.supervisor.epoch()))
    }

    /// Step `name` of `key`, run through the step runner ([`steps::Step::call`]) once
    /// its gate lets it through; while it backs off with unchanged inputs, an error
    /// that records nothing new.
    fn begin<'a>(
        &'a self,
        key: &'a str,
        name: &'static str,
        inputs: u64,
    ) -> Result<steps::Step<'a>, NodeError> {
        self.r
            .steps
            .begin(key, name, inputs)
            .map_err(NodeError::from)
    }

    /// Runs forward CSI step `step` as a checkpoint in the local state, its record kept
    /// in `scope`: gated first (a step that is backing off records nothing new), then
    /// recorded as uncertain before the call and done after OK. A final or transient
    /// answer (the plugin refused: it took no effect) to a step that had not taken
    /// effect before (its record Absent) records it Absent again: nothing is owed. An
    /// uncertain answer leaves it uncertain, so its reverse stays owed.
    async fn checkpointed<T>(
        &self,
        key: &str,
        step: &'static str,
        inputs: u64,
        scope: Scope<'_>,
        call: impl std::future::Future<Output = Result<T, CsiError>>,
    ) -> Result<T, NodeError> {
        let gate = self.begin(key, step, inputs)?;
        let mut before = Step::Absent;
        self.edit(|s| {
            before = scope.get(s, key, step);
            scope.set(s, key, step, Step::Uncertain)
        })
        .await?;
        match gate.call(call).await {
            Ok(v) => {
                self.record(|s| scope.set(s, key, step, Step::Done)).await?;
                Ok(v)
            }
            Err(failed) => {
                if took_no_effect(&failed.error) && before == Step::Absent {
                    self.record(|s| scope.set(s, key, step, Step::Absent))
                        .await?;
                }
                Err(failed.into())
            }
        }
    }

    fn plugin(&self, id: &PluginId) -> Result<&PluginConfig, NodeError> {
        self.r
            .plugins
            .iter()
            .find(|p| &p.id == id)
            .ok_or_else(|| NodeError::UnknownPlugin(id.clone()))
    }

    /// Edits the local state and returns once the change is on disk, before the
    /// caller goes on to act on it: the record of a forward step, before its call.
    /// The disk is waited for outside the state's lock: the steps of claims that edit
    /// meanwhile share one fdatasync (a group commit).
    ///
    /// What the journal promises (and a power cut, `moor::journal::cut_to_synced`,
    /// tests): a forward step that may have taken effect has its record on disk, and
    /// so has everything the node reported in a Mount. What it does not promise is
    /// an outcome recorded after a call ([`Reconcile::record`]): a power cut may lose
    /// it, and the step is then taken again (each is idempotent by the CSI spec), or
    /// its reverse is owed once more.
    async fn edit(&self, f: impl FnOnce(&mut LocalState)) -> Result<(), NodeError> {
        let (n, durability) = self.append(f).await?;
        Self::synced(&durability, n).await
    }

    /// Edits the local state and goes on without waiting for the disk: an outcome
    /// recorded after a call (done, undone, forgotten). The next [`Reconcile::edit`]
    /// or Mount written ([`Reconcile::settle`]) puts it on disk first, with whatever
    /// else was appended meanwhile (commits reach the disk in order).
    async fn record(&self, f: impl FnOnce(&mut LocalState)) -> Result<(), NodeError> {
        self.append(f).await.map(|_| ())
    }

    /// Returns once every commit appended so far is on disk: before the node reports
    /// anything in a Mount (a release acknowledged there lets the controller detach
    /// and collect the claim, so the journal must not lose it first).
    pub(super) async fn settle(&self) -> Result<(), NodeError> {
        let durability = self.r.local.lock().await.durability();
        let n = durability.commits();
        Self::synced(&durability, n).await
    }

    async fn append(
        &self,
        f: impl FnOnce(&mut LocalState),
    ) -> Result<(u64, moor::journal::Durability), NodeError> {
        let mut local = self.r.local.lock().await;
        f(local.state_mut());
        let n = local.commit_unsynced()?;
        moor::runtime::metrics::journal_committed();
        Ok((n, local.durability()))
    }

    async fn synced(durability: &moor::journal::Durability, n: u64) -> Result<(), NodeError> {
        if durability.wait(n).await? {
            moor::runtime::metrics::journal_synced();
        }
        Ok(())
    }

    /// Reports a journal write that failed (the step it was to record was not taken):
    /// the metric, the claim's Mount and a Warning event.
    async fn journal_failed(&self, key: &str, claim: &Claim, e: &NodeError) {
        moor::runtime::metrics::journal_failed();
        let msg = moor::process::error_chain(e);
        tracing::warn!(claim = %key, error = %msg, "cannot record a node step in the journal; the step is not taken");
        if let Err(err) = self.sync_mount(key, claim, Some(msg.clone())).await {
            tracing::debug!(claim = %key, error = %err, "cannot record the journal failure on the Mount");
        }
        self.node_event(
            claim_ref(&claim.metadata.namespace, &claim.metadata.name),
            &claim.spec.volume,
            "Journal write failed",
            EventType::Warning,
            format!(
                "node {} cannot record its steps for claim {} in its data dir, so it does not take them: {msg}",
                self.r.node, claim.metadata.name
            ),
            Some(msg),
        )
        .await;
    }

    async fn forget(&self, key: &str) -> Result<(), NodeError> {
        self.r.steps.forget(key);
        self.forget_orphan(key);
        self.record(|s| {
            s.publishes.remove(key);
        })
        .await
    }

    fn csi(&self, cfg: &PluginConfig) -> Result<Csi, NodeError> {
        let ch = self
            .r
            .supervisor
            .channel(&cfg.id)
            .ok_or_else(|| NodeError::UnknownPlugin(cfg.id.clone()))?;
        Ok(Csi::new(ch, self.r.policy.for_plugin(cfg.id.as_str()))
            .checked(self.r.monitor.for_plugin(&cfg.id)))
    }

    /// The client for a forward step (NodeStage, NodePublish, NodeExpand) taken on a
    /// grant read in registration `term`: it sends nothing once that term no longer
    /// holds (a node that cannot prove its registration may have been collected, its
    /// claims released and the volume attached elsewhere). Reverse steps stay ungated:
    /// they are owed whatever the registration.
    fn forward_csi(&self, cfg: &PluginConfig, term: u64) -> Result<Csi, NodeError> {
        let term = self
            .r
            .supervisor
            .term(term)
            .ok_or(NodeError::NotRegistered)?;
        Ok(self.csi(cfg)?.under(term))
    }
}

/// Where a forward step's record is kept.
#[derive(Clone, Copy)]
enum Scope<'a> {
    /// Among the claim's own steps (its publish record's `steps`), by the step's name.
    Claim,
    /// The staging path's record, shared by the claims staged there: made as this one
    /// (its step aside) when the step is recorded, dropped when the step is Absent.
    Staging(&'a Path, &'a StageRecord),
}

impl Scope<'_> {
    /// How far `step` got, as recorded.
    fn get(self, s: &LocalState, key: &str, step: &str) -> Step {
        match self {
            Scope::Claim => s
                .publishes
                .get(key)
                .map_or(Step::Absent, |p| p.steps.get(step)),
            Scope::Staging(path, _) => s.stages.get(path).map_or(Step::Absent, |st| st.step),
        }
    }

    /// Records how far `step` got.
    fn set(self, s: &mut LocalState, key: &str, step: &str, to: Step) {
        match self {
            Scope::Claim => {
                if let Some(p) = s.publishes.get_mut(key) {
                    p.steps.set(step, to);
                }
            }
            Scope::Staging(path, _) if to == Step::Absent => {
                s.stages.remove(path);
            }
            Scope::Staging(path, made) => {
                let rec = StageRecord {
                    step: to,
                    ..made.clone()
                };
                s.stages.insert(path.to_path_buf(), rec);
            }
        }
    }
}

/// The staging path of a record the plan stages or unstages (it does only where the
/// record has one: [`plan::Facts::stages`]).
fn staging_of(rec: &PublishRecord) -> Result<&Path, NodeError> {
    rec.staging_path
        .as_deref()
        .ok_or(NodeError::Incomplete("a staging path"))
}

/// A final or transient answer (ResourceExhausted, Aborted): the plugin refused, the
/// call did not take effect. Only an uncertain answer may have.
fn took_no_effect(e: &CsiError) -> bool {
    matches!(e.class(), Class::Final | Class::Transient)
}
