//! The node reconciler: stages and publishes this node's claims, and tears them down.
//!
//! Expected flow for a claim key:
//! 1. Wait for the claim cache; take the volume's lock (one node call per volume at a
//!    time, so a stage and an unstage of one staging path never race).
//! 2. A claim the controller allowed (`spec.publish`) and not released:
//!    `ensure_staged` (once per staging path, `<mount-dir>/staging/NS/VOL/<usage>`, when
//!    the plugin has STAGE_UNSTAGE_VOLUME), then `ensure_published` to
//!    `<mount-dir>/per-alloc/NS/ALLOC/VOL/<ro|rw>-<usage>`. Each step is recorded as
//!    uncertain in the data dir before its call and done after it, so a restarted agent
//!    adopts what is done instead of repeating it.
//! 3. A released (or deleted) claim: `ensure_unpublished`, then `ensure_unstaged` when
//!    no other claim uses the staging path; then the Mount says `released`, which is
//!    what lets the controller detach.
//! 4. Every change is mirrored in the claim's Mount object; failures are recorded there
//!    (`last_error`) and as "Mount volume" / "Unmount volume" events, and retried with
//!    the controller's per-key backoff.

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
use moor::runtime::steps::{self, Gate, Steps};
use moor::store::{Store, StoreError};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use super::plugins::Supervisor;
use super::state::{LocalState, PublishRecord, StageRecord, Step};
use super::PluginConfig;
use crate::common::{details, KeyedLocks, OwnWrites};

/// Why a claim could not be brought to its desired state on this node.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// A CSI call failed.
    #[error("CSI call failed")]
    Csi(#[from] CsiError),
    /// Reading or writing etcd failed.
    #[error("store operation failed")]
    Store(#[from] StoreError),
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
    /// A failed step is backing off; it is tried again after this long (or when its
    /// inputs change).
    #[error("{0} is backing off")]
    BackingOff(&'static str, std::time::Duration),
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

impl ReconcileError for NodeError {
    fn policy(&self) -> ErrorPolicy {
        match self {
            NodeError::Store(e) => e.policy(),
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
    /// One node call per volume at a time.
    pub locks: KeyedLocks,
    /// CSI call policy.
    pub policy: Policy,
    /// Retry gates of failing node steps.
    pub steps: Steps,
    /// Events.
    pub recorder: Recorder,
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

/// The key of the claim a Mount mirrors (they share the suffix `NODE/NS/ALLOC.VOLREQ`).
fn claim_key_of(m: &Mount) -> String {
    format!(
        "{}/{}",
        ClaimSpec::DIR,
        crate::common::suffix::<MountSpec>(&m.key())
    )
}

fn path_str(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

impl NodeReconciler {
    /// Runs until `shutdown`.
    pub async fn run(self, metrics: ControllerMetrics, shutdown: CancellationToken) {
        let claims = Informer::<Claim>::spawn(
            self.store.clone(),
            &format!("{}/", self.node),
            shutdown.clone(),
        );
        let reader = claims.reader();
        // Claims deleted while the agent was down are known only to the local state.
        let local_keys: Vec<String> = self.local.lock().await.publishes.keys().cloned().collect();
        let on_plugin_change = {
            let (reader, local) = (reader.clone(), self.local.clone());
            futures::stream::unfold(self.supervisor.changes(), move |mut rx| {
                let (reader, local) = (reader.clone(), local.clone());
                async move {
                    rx.changed().await.ok()?;
                    let mut keys = reader.keys();
                    keys.extend(local.lock().await.publishes.keys().cloned());
                    Some((futures::stream::iter(keys), rx))
                }
            })
        };
        // Only this agent writes its node's Mounts: its cache of them (checked against
        // its own writes) saves a read before every Mount write.
        let mounts = Informer::<Mount>::spawn(
            self.store.clone(),
            &format!("{}/", self.node),
            shutdown.clone(),
        );
        // A Mount whose claim was deleted while the agent was down, and that the local
        // state does not know (nothing was staged or published for it), is found only
        // by listing the Mounts: each (re)list names the claims of the Mounts, so one
        // without a claim is deleted. The agent's own Mount writes trigger nothing.
        let listed_mounts = futures::StreamExt::flat_map(mounts.subscribe(), |e| {
            let keys: Vec<String> = match e {
                Ok(moor::runtime::watcher::Event::Restarted(all)) => {
                    all.iter().map(claim_key_of).collect()
                }
                _ => Vec::new(),
            };
            futures::stream::iter(keys)
        });
        let this = Arc::new(Reconcile {
            r: self,
            claims: reader.clone(),
            mounts: mounts.reader(),
            own_writes: OwnWrites::default(),
        });
        Controller::new("node", reader, Config::default())
            .with_metrics(metrics)
            .owns(claims.subscribe())
            .trigger(futures::stream::iter(local_keys))
            .trigger(futures::StreamExt::flatten(on_plugin_change))
            .trigger(listed_mounts)
            .run(
                move |key| {
                    let this = this.clone();
                    async move { this.reconcile(key).await }
                },
                shutdown,
            )
            .await;
    }
}

struct Reconcile {
    r: NodeReconciler,
    claims: reflector::Store<Claim>,
    mounts: reflector::Store<Mount>,
    own_writes: OwnWrites,
}

impl Reconcile {
    async fn reconcile(&self, key: String) -> Result<Action, NodeError> {
        self.claims.wait_until_ready().await;
        self.mounts.wait_until_ready().await;
        let claim = self.claims.get(&key);
        let record = self.r.local.lock().await.publishes.get(&key).cloned();
        let lock_key = match (&claim, &record) {
            (Some(c), _) => format!("{}/{}", c.metadata.namespace, c.spec.volume),
            (None, Some(r)) => format!("{}/{}", r.namespace, r.volume),
            (None, None) => key.clone(),
        };
        let _guard = self.r.locks.lock(&lock_key).await;
        let Some(claim) = claim else {
            // Deleted: tear down whatever is left, then forget it.
            if let Some(rec) = record {
                self.teardown(&key, &rec).await?;
                self.forget(&key).await?;
            }
            crate::common::ignore_not_found(
                self.r
                    .store
                    .delete::<MountSpec>(crate::common::suffix::<ClaimSpec>(&key), None)
                    .await
                    .map(|_| ()),
            )?;
            return Ok(Action::AwaitChange);
        };
        if let Some(rec) = &record {
            if rec.claim_uid != claim.metadata.uid {
                // The claim was deleted and made again while we were away.
                self.teardown(&key, rec).await?;
                self.forget(&key).await?;
            }
        }
        let done = if claim.spec.release || claim.is_deleting() {
            self.release(&key, &claim).await
        } else if claim.spec.publish {
            self.publish(&key, &claim).await
        } else {
            Ok(())
        };
        match done {
            // Not a failure to back off from: the plugin's first fingerprint (every
            // change of it) triggers every claim again. Right after an agent starts,
            // this is every claim of the node.
            Err(NodeError::PluginNotReady(id)) => {
                tracing::debug!(claim = %key, plugin = %id, "waiting for the plugin's fingerprint");
                Ok(Action::AwaitChange)
            }
            // Recorded on the Mount already; the step's own schedule says when.
            Err(NodeError::BackingOff(_, after)) => Ok(Action::Requeue(after)),
            Err(NodeError::Csi(_)) => Ok(Action::Requeue(
                self.r.steps.remaining(&key).unwrap_or_default(),
            )),
            other => other.map(|()| Action::AwaitChange),
        }
    }

    /// What a claim's node steps depend on: the claim's identity and spec, and the
    /// plugin's fingerprint. The agent's Mount writes (and the controller's status
    /// writes they cause) change none of it.
    fn inputs(&self, uid: &str, generation: i64) -> u64 {
        steps::inputs((uid, generation, self.r.supervisor.epoch()))
    }

    /// Refuses a step of `key` while it is backing off with unchanged inputs.
    fn gate(&self, key: &str, step: &'static str, inputs: u64) -> Result<(), NodeError> {
        match self.r.steps.gate(key, step, inputs) {
            Gate::Go => Ok(()),
            Gate::Wait(after) => Err(NodeError::BackingOff(step, after)),
        }
    }

    /// Runs one CSI step of `key` (already let through its [`Reconcile::gate`]) and
    /// records the outcome on the step's schedule; a failure comes back as the CSI
    /// error, for the caller to decide what is owed.
    async fn step<T>(
        &self,
        key: &str,
        step: &'static str,
        inputs: u64,
        call: impl std::future::Future<Output = Result<T, CsiError>>,
    ) -> Result<T, NodeError> {
        match call.await {
            Ok(v) => {
                self.r.steps.succeeded(key, step);
                Ok(v)
            }
            Err(e) => {
                let (_, after) = self.r.steps.failed_call(key, step, inputs, &e);
                tracing::warn!(claim = %key, error = %e, retry_in = ?after, "node step failed");
                Err(NodeError::Csi(e))
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

    /// Edits the local state and persists the change before anything else happens.
    async fn edit(&self, f: impl FnOnce(&mut LocalState)) -> Result<(), NodeError> {
        let mut local = self.r.local.lock().await;
        f(local.state_mut());
        Ok(local.commit()?)
    }

    async fn forget(&self, key: &str) -> Result<(), NodeError> {
        self.r.steps.forget(key);
        self.edit(|s| {
            s.publishes.remove(key);
        })
        .await
    }

    async fn publish(&self, key: &str, claim: &Claim) -> Result<(), NodeError> {
        let existing = self.r.local.lock().await.publishes.get(key).cloned();
        if existing.as_ref().is_some_and(|r| r.released) {
            return Ok(());
        }
        let cfg = self.plugin(&claim.spec.plugin_id)?.clone();
        let fp = self
            .r
            .supervisor
            .status(&cfg.id)
            .filter(|s| s.csi_node_id.is_some())
            .ok_or_else(|| NodeError::PluginNotReady(cfg.id.clone()))?;
        let stages = fp.capabilities.node.contains("STAGE_UNSTAGE_VOLUME");
        let cap = match (claim.spec.access_mode, claim.spec.attachment_mode) {
            (Some(access_mode), Some(attachment_mode)) => VolumeCapability {
                access_mode,
                attachment_mode,
            },
            _ => return Err(NodeError::Incomplete("its capability")),
        };
        let external_id = claim
            .spec
            .external_id
            .clone()
            .ok_or(NodeError::Incomplete("the volume's external id"))?;
        let paths = paths(&cfg, claim, cap);
        let rec = existing.unwrap_or_else(|| PublishRecord {
            claim_uid: claim.metadata.uid.clone(),
            namespace: claim.metadata.namespace.clone(),
            claim: claim.metadata.name.clone(),
            allocation: claim.spec.allocation.clone(),
            volume: claim.spec.volume.clone(),
            plugin_id: cfg.id.clone(),
            external_id: external_id.clone(),
            staging_path: stages.then(|| paths.staging_host.clone()),
            target_path: paths.target_host.clone(),
            step: Step::Absent,
            released: false,
        });
        self.edit(|s| {
            s.publishes.insert(key.to_string(), rec.clone());
        })
        .await?;
        self.sync_mount(key, claim, None).await?;
        if rec.step == Step::Done {
            // Adopted from an earlier run, or already done.
            return Ok(());
        }
        let volume = self
            .r
            .store
            .get::<VolumeSpec>(&format!(
                "{}/{}",
                claim.metadata.namespace, claim.spec.volume
            ))
            .await?;
        let secrets = volume.spec.secrets.expose().clone();
        let capability = convert::capability(cap, &claim.spec.mount_options);
        let result = async {
            if let Some(staging) = &rec.staging_path {
                self.ensure_staged(
                    &cfg,
                    key,
                    claim,
                    staging,
                    &external_id,
                    &capability,
                    &secrets,
                )
                .await?;
            }
            self.ensure_published(
                &cfg,
                key,
                claim,
                &rec,
                &paths,
                &external_id,
                &capability,
                &secrets,
            )
            .await
        }
        .await;
        match result {
            Ok(()) => {
                self.sync_mount(key, claim, None).await?;
                self.event(claim, "Mount volume", None).await;
                Ok(())
            }
            // Recorded when it failed; nothing new to say.
            Err(e @ NodeError::BackingOff(..)) => Err(e),
            Err(e) => {
                let msg = moor::runtime::controller::error_chain(&e);
                self.sync_mount(key, claim, Some(msg.clone())).await?;
                self.event(claim, "Mount volume", Some(msg)).await;
                Err(e)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn ensure_staged(
        &self,
        cfg: &PluginConfig,
        key: &str,
        claim: &Claim,
        staging: &Path,
        external_id: &ExternalVolumeId,
        capability: &v1::VolumeCapability,
        secrets: &std::collections::BTreeMap<String, String>,
    ) -> Result<(), NodeError> {
        let current = self.r.local.lock().await.stages.get(staging).cloned();
        if current.as_ref().is_some_and(|s| s.step == Step::Done) {
            return Ok(());
        }
        std::fs::create_dir_all(staging).map_err(|source| NodeError::Io {
            path: path_str(staging),
            source,
        })?;
        let record = StageRecord {
            namespace: claim.metadata.namespace.clone(),
            volume: claim.spec.volume.clone(),
            plugin_id: cfg.id.clone(),
            external_id: external_id.clone(),
            step: Step::Uncertain,
        };
        // Gated before the checkpoint: a step that is backing off owes nothing new.
        let inputs = self.inputs(&claim.metadata.uid, claim.metadata.generation);
        self.gate(key, "NodeStageVolume", inputs)?;
        self.set_stage(staging, Some(record.clone())).await?;
        let req = v1::NodeStageVolumeRequest {
            volume_id: external_id.to_string(),
            publish_context: claim.spec.publish_context.clone(),
            staging_target_path: path_str(&plugin_path(cfg, staging)),
            volume_capability: Some(capability.clone()),
            secrets: secrets.clone(),
            volume_context: claim.spec.volume_context.clone(),
        };
        let csi = self.csi(cfg)?;
        let r = self
            .step(key, "NodeStageVolume", inputs, csi.node_stage(req))
            .await;
        match r {
            Ok(_) => {
                self.set_stage(
                    staging,
                    Some(StageRecord {
                        step: Step::Done,
                        ..record
                    }),
                )
                .await
            }
            Err(e) => {
                if is_final(&e) && current.is_none() {
                    // Took no effect, and nothing was staged before: nothing is owed.
                    self.set_stage(staging, None).await?;
                }
                Err(e)
            }
        }
    }

    async fn set_stage(&self, staging: &Path, rec: Option<StageRecord>) -> Result<(), NodeError> {
        self.edit(|s| match rec {
            Some(r) => {
                s.stages.insert(staging.to_path_buf(), r);
            }
            None => {
                s.stages.remove(staging);
            }
        })
        .await
    }

    async fn set_publish_step(&self, key: &str, step: Step) -> Result<(), NodeError> {
        self.edit(|s| {
            if let Some(p) = s.publishes.get_mut(key) {
                p.step = step;
            }
        })
        .await
    }

    #[allow(clippy::too_many_arguments)]
    async fn ensure_published(
        &self,
        cfg: &PluginConfig,
        key: &str,
        claim: &Claim,
        rec: &PublishRecord,
        paths: &Paths,
        external_id: &ExternalVolumeId,
        capability: &v1::VolumeCapability,
        secrets: &std::collections::BTreeMap<String, String>,
    ) -> Result<(), NodeError> {
        if let Some(parent) = paths.target_host.parent() {
            std::fs::create_dir_all(parent).map_err(|source| NodeError::Io {
                path: path_str(parent),
                source,
            })?;
        }
        let before = rec.step;
        let inputs = self.inputs(&claim.metadata.uid, claim.metadata.generation);
        self.gate(key, "NodePublishVolume", inputs)?;
        self.set_publish_step(key, Step::Uncertain).await?;
        let req = v1::NodePublishVolumeRequest {
            volume_id: external_id.to_string(),
            publish_context: claim.spec.publish_context.clone(),
            staging_target_path: rec
                .staging_path
                .as_ref()
                .map(|s| path_str(&plugin_path(cfg, s)))
                .unwrap_or_default(),
            target_path: path_str(&paths.target_plugin),
            volume_capability: Some(capability.clone()),
            readonly: claim.spec.mode == ClaimMode::Read,
            secrets: secrets.clone(),
            volume_context: claim.spec.volume_context.clone(),
        };
        let csi = self.csi(cfg)?;
        let r = self
            .step(key, "NodePublishVolume", inputs, csi.node_publish(req))
            .await;
        match r {
            Ok(_) => self.set_publish_step(key, Step::Done).await,
            Err(e) => {
                if is_final(&e) && before == Step::Absent {
                    self.set_publish_step(key, Step::Absent).await?;
                }
                Err(e)
            }
        }
    }

    fn csi(&self, cfg: &PluginConfig) -> Result<Csi, NodeError> {
        let ch = self
            .r
            .supervisor
            .channel(&cfg.id)
            .ok_or_else(|| NodeError::UnknownPlugin(cfg.id.clone()))?;
        Ok(Csi::new(ch, self.r.policy.clone()))
    }

    async fn release(&self, key: &str, claim: &Claim) -> Result<(), NodeError> {
        let rec = self.r.local.lock().await.publishes.get(key).cloned();
        if let Some(rec) = rec.filter(|r| !r.released) {
            if let Err(e) = self.teardown(key, &rec).await {
                if !matches!(e, NodeError::BackingOff(..)) {
                    let msg = moor::runtime::controller::error_chain(&e);
                    self.sync_mount(key, claim, Some(msg)).await?;
                }
                return Err(e);
            }
            self.edit(|s| {
                if let Some(p) = s.publishes.get_mut(key) {
                    p.released = true;
                    p.step = Step::Absent;
                }
            })
            .await?;
        }
        self.sync_mount(key, claim, None).await?;
        Ok(())
    }

    /// NodeUnpublish if it may be published, then NodeUnstage if no other claim uses the
    /// staging path and it may be staged.
    async fn teardown(&self, key: &str, rec: &PublishRecord) -> Result<(), NodeError> {
        if rec.released {
            return Ok(());
        }
        let cfg = self.plugin(&rec.plugin_id)?.clone();
        if rec.step.needs_reverse() {
            self.ensure_unpublished(&cfg, key, rec).await?;
        }
        if let Some(staging) = &rec.staging_path {
            let (in_use, stage) = {
                let s = self.r.local.lock().await;
                (
                    s.staging_in_use(staging, key),
                    s.stages.get(staging).cloned(),
                )
            };
            if !in_use {
                if let Some(stage) = stage {
                    let inputs = self.inputs(&rec.claim_uid, 0);
                    self.ensure_unstaged(&cfg, key, inputs, staging, &stage)
                        .await?;
                }
            }
        }
        Ok(())
    }

    async fn ensure_unpublished(
        &self,
        cfg: &PluginConfig,
        key: &str,
        rec: &PublishRecord,
    ) -> Result<(), NodeError> {
        let req = v1::NodeUnpublishVolumeRequest {
            volume_id: rec.external_id.to_string(),
            target_path: path_str(&plugin_path(cfg, &rec.target_path)),
        };
        let inputs = self.inputs(&rec.claim_uid, 0);
        self.gate(key, "NodeUnpublishVolume", inputs)?;
        let csi = self.csi(cfg)?;
        let result = self
            .step(key, "NodeUnpublishVolume", inputs, csi.node_unpublish(req))
            .await;
        let error = result.as_ref().err().map(|e| e.to_string());
        self.unmount_event(rec, error).await;
        result?;
        self.set_publish_step(key, Step::Absent).await
    }

    async fn ensure_unstaged(
        &self,
        cfg: &PluginConfig,
        key: &str,
        inputs: u64,
        staging: &Path,
        stage: &StageRecord,
    ) -> Result<(), NodeError> {
        if stage.step.needs_reverse() {
            let req = v1::NodeUnstageVolumeRequest {
                volume_id: stage.external_id.to_string(),
                staging_target_path: path_str(&plugin_path(cfg, staging)),
            };
            self.gate(key, "NodeUnstageVolume", inputs)?;
            let csi = self.csi(cfg)?;
            self.step(key, "NodeUnstageVolume", inputs, csi.node_unstage(req))
                .await?;
        }
        self.set_stage(staging, None).await?;
        // The staging directory is ours to remove once the plugin let go of it.
        let _ = std::fs::remove_dir(staging);
        Ok(())
    }

    /// Writes the claim's Mount object from the local state.
    async fn sync_mount(
        &self,
        key: &str,
        claim: &Claim,
        last_error: Option<String>,
    ) -> Result<(), NodeError> {
        let (rec, stage) = {
            let s = self.r.local.lock().await;
            let rec = s.publishes.get(key).cloned();
            let stage = rec
                .as_ref()
                .and_then(|r| r.staging_path.as_ref())
                .and_then(|p| s.stages.get(p))
                .map(|st| st.step)
                .unwrap_or_default();
            (rec, stage)
        };
        let spec = MountSpec {
            claim: claim.metadata.name.clone(),
            claim_uid: claim.metadata.uid.clone(),
            allocation: claim.spec.allocation.clone(),
            volume: claim.spec.volume.clone(),
            node: self.r.node.clone(),
            staging_path: rec
                .as_ref()
                .and_then(|r| r.staging_path.as_ref())
                .map(|p| path_str(p)),
            target_path: rec
                .as_ref()
                .map(|r| path_str(&r.target_path))
                .unwrap_or_else(|| "-".into()),
        };
        let released = rec.as_ref().is_none_or(|r| r.released);
        let publish = rec.as_ref().map(|r| r.step).unwrap_or_default();
        // A failing CSI step stays on the Mount until it succeeds: what it waits on,
        // since when, the last answer and the next retry.
        let retry = self.r.steps.latest_failure(key);
        let last_error = last_error.or_else(|| {
            retry
                .as_ref()
                .map(|f| format!("{} failed with {}: {}", f.step, f.code, f.message))
        });
        let status = MountStatus {
            staged: !released && stage == Step::Done,
            stage_uncertain: !released && stage == Step::Uncertain,
            published: publish == Step::Done,
            publish_uncertain: publish == Step::Uncertain,
            released: released && (claim.spec.release || claim.is_deleting()),
            meta: StatusMeta {
                observed_generation: claim.metadata.generation,
                last_error,
                retry,
                ..Default::default()
            },
        };
        let store = &self.r.store;
        let mount_key = format!("mounts/{}", crate::common::suffix::<ClaimSpec>(key));
        let current = self
            .own_writes
            .fresh(store, &self.mounts, &mount_key)
            .await?;
        let written = match current {
            None => {
                let mut m =
                    Mount::new(&claim.metadata.namespace, claim.metadata.name.clone(), spec);
                m.status = status;
                store.create(&m).await?
            }
            Some(current) if current.spec == spec && current.status == status => return Ok(()),
            Some(current) => {
                let mut next = (*current).clone();
                next.spec = spec;
                next.status = status;
                store.update(&current, &next).await?
            }
        };
        self.own_writes.wrote(&written);
        Ok(())
    }

    async fn event(&self, claim: &Claim, reason: &str, error: Option<String>) {
        let (type_, message) = match &error {
            None => (
                EventType::Normal,
                format!(
                    "{} published for claim {}",
                    claim.spec.volume, claim.metadata.name
                ),
            ),
            Some(e) => (
                EventType::Warning,
                format!(
                    "{} could not be published for claim {}: {e}",
                    claim.spec.volume, claim.metadata.name
                ),
            ),
        };
        self.node_event(&claim.spec.volume, reason, type_, message, error)
            .await;
    }

    async fn unmount_event(&self, rec: &PublishRecord, error: Option<String>) {
        let (type_, message) = match &error {
            None => (
                EventType::Normal,
                format!("{} unpublished for claim {}", rec.volume, rec.claim),
            ),
            Some(e) => (
                EventType::Warning,
                format!(
                    "{} could not be unpublished for claim {}: {e}",
                    rec.volume, rec.claim
                ),
            ),
        };
        self.node_event(&rec.volume, "Unmount volume", type_, message, error)
            .await;
    }

    async fn node_event(
        &self,
        volume: &VolumeId,
        reason: &str,
        type_: EventType,
        message: String,
        error: Option<String>,
    ) {
        let object = ObjectRef {
            kind: "Node".into(),
            namespace: Namespace::default(),
            name: Name::new(self.r.node.as_str()).unwrap_or_default(),
        };
        let d = details([
            ("volume_id", volume.to_string()),
            ("success", error.is_none().to_string()),
            ("error", error.unwrap_or_default()),
        ]);
        self.r
            .recorder
            .record(object, type_, reason, message, d)
            .await;
    }
}

/// Whether a step failed with a final answer (it took no effect).
fn is_final(e: &NodeError) -> bool {
    matches!(e, NodeError::Csi(c) if c.class() == Class::Final)
}
