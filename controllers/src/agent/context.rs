//! What the executors of one controller plugin share while this agent leads it.

use moor::api::*;
use moor::csi::policy::Policy;
use moor::runtime::events::Recorder;
use moor::runtime::metrics::Metrics;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

use super::config::PluginConfig;
use super::step_error::NoChannel;
use super::volume_view::VolumeView;
use super::{attacher, contract, group_snapshotter, plugins, provisioner, snapshotter, survey};
use crate::common::KeyedLocks;

/// What the provisioner and the attacher of one controller plugin share while this
/// agent leads it.
#[derive(Clone)]
pub struct ControllerPluginCtx {
    /// Unfenced store for watches and reads.
    pub reads: moor::store::Store,
    /// Fenced store (every write carries the election's fence); records the volumes,
    /// attachments and snapshots this agent writes.
    pub writer: moor::runtime::writer::Writer,
    /// The plugin.
    pub plugin: PluginConfig,
    /// Its supervisor (channel, fingerprint).
    pub supervisor: plugins::Supervisor,
    /// CSI call policy.
    pub policy: Policy,
    /// Events.
    pub recorder: Recorder,
    /// One in-flight controller call per volume.
    pub locks: KeyedLocks,
    /// One in-flight ControllerPublish/Unpublish per node, by CSI node id, when the
    /// plugin is configured so ([`ControllerPluginCtx::in_node_turn`]).
    pub node_calls: KeyedLocks,
    /// Retry gates of failing controller steps.
    pub steps: moor::runtime::steps::Steps,
    /// GetCapacity's answers from the last survey (none yet: unknown).
    pub capacity: Arc<std::sync::RwLock<Option<Vec<CapacityEntry>>>>,
    /// Ticks after each survey that asked GetCapacity.
    pub surveyed: Arc<tokio::sync::watch::Sender<u64>>,
    /// `--survey-interval`.
    pub survey_interval: Duration,
    /// `--unpublish-unknown-attachments`.
    pub unpublish_unknown: bool,
    /// The live contract monitor.
    pub monitor: contract::Monitor,
    /// This agent's leadership of the plugin by its own clock: every CSI call checks
    /// it right before it is sent (no fence guards a call to the plugin).
    pub term: moor::runtime::term::Term,
    /// The plugin's Secrets, which its volumes and snapshots name per call family:
    /// read when a call is built, so a rotated Secret goes into every later call.
    pub secrets: moor::runtime::informer::Informer<Secret>,
}

impl ControllerPluginCtx {
    /// The typed CSI client of the plugin.
    pub fn csi(&self) -> Result<moor::csi::client::Csi, NoChannel> {
        let ch = self
            .supervisor
            .channel(&self.plugin.id)
            .ok_or_else(|| NoChannel(self.plugin.id.clone()))?;
        Ok(
            moor::csi::client::Csi::new(ch, self.policy.for_plugin(self.plugin.id.as_str()))
                .under(self.term.clone())
                .checked(self.monitor.for_plugin(&self.plugin.id)),
        )
    }

    /// Runs `call` (a ControllerPublish or ControllerUnpublish to `csi_node`) in the
    /// node's turn: with `serialize-per-node`, only once no other such call of this
    /// plugin is in flight to that node, the node held until `call` ends; at once
    /// otherwise. Taken after the volume's lock, never before it, so the two cannot
    /// deadlock. The waiting are counted in `moor_controller_calls_waiting_for_node`.
    pub async fn in_node_turn<T>(
        &self,
        csi_node: &str,
        call: impl std::future::Future<Output = T>,
    ) -> T {
        if !self.plugin.serialize_per_node {
            return call.await;
        }
        let _turn = {
            let _waiting = moor::runtime::metrics::waiting_for_node(self.plugin.id.as_str());
            self.node_calls.lock(csi_node).await
        };
        call.await
    }

    /// Whether the plugin advertises controller capability `rpc` (false until its
    /// capabilities are known).
    pub fn advertises(&self, rpc: moor::api::ControllerRpc) -> bool {
        self.supervisor
            .status(&self.plugin.id)
            .is_some_and(|s| s.capabilities.controller.has(rpc))
    }

    /// Whether the plugin's controller service advertises SINGLE_NODE_MULTI_WRITER:
    /// the access modes its calls carry follow it ([`moor::api::AccessMode::as_sent`]).
    pub fn multi_writer_cap(&self) -> bool {
        self.advertises(moor::api::ControllerRpc::SingleNodeMultiWriter)
    }

    /// How long a call that names a Secret waits for this agent's first list of the
    /// plugin's Secrets (a leader just elected), before the Secret counts as missing.
    const SECRETS_LISTED: Duration = Duration::from_secs(5);

    /// The plugin's Secrets through which a call's secrets are looked up, once listed
    /// (or after [`Self::SECRETS_LISTED`]: a missing Secret is then reported).
    pub async fn secret_book(&self) -> impl Fn(&ObjectKey<SecretSpec>) -> Option<Arc<Secret>> {
        let secrets = self.secrets.reader();
        if !secrets.is_ready() {
            let _ = tokio::time::timeout(Self::SECRETS_LISTED, secrets.wait_until_ready()).await;
        }
        move |key| secrets.get(key)
    }

    /// `vol` as `family`'s calls see it: with the Secret it names for them, read now.
    pub async fn for_family<'v>(
        &self,
        vol: &'v Volume,
        family: SecretFamily,
    ) -> Result<std::borrow::Cow<'v, Volume>, moor::api::MissingSecret> {
        if vol.spec.secret_refs.get(family).is_none() {
            return Ok(std::borrow::Cow::Borrowed(vol));
        }
        let resolved = vol.for_family(family, self.secret_book().await);
        self.missing_secret(&crate::common::object_ref(vol), &resolved)
            .await;
        resolved
    }

    /// A volume's call waits for the Secret it names (on the step's backoff, and for
    /// the Secret's event): the volume says why.
    async fn missing_secret<T>(&self, vol: &ObjectRef, resolved: &Result<T, MissingSecret>) {
        if let Err(missing) = resolved {
            self.volume_event(
                vol,
                "Secret missing",
                EventType::Warning,
                missing.to_string(),
            )
            .await;
        }
    }

    /// The keys of the volumes (in `volumes`, this plugin's) that name Secret `s`, for
    /// a watch: a Secret made or changed wakes the calls that wait on it.
    pub fn naming(
        volumes: &moor::runtime::reflector::Store<VolumeView>,
        plugin: &PluginId,
        s: &Secret,
    ) -> Vec<ObjectKey<VolumeSpec>> {
        if s.spec.plugin_id != *plugin {
            return Vec::new();
        }
        volumes
            .state()
            .iter()
            .filter(|v| {
                v.namespace == s.metadata.namespace
                    && v.attach.secret_refs.names_secret(&s.metadata.name)
            })
            .map(|v| v.object_key())
            .collect()
    }

    /// Volume `key` as stored now, when the plugin's volume cache (`views`) holds it:
    /// what acts on a whole volume reads it first (the cache keeps views), unless the
    /// view holds it whole or this agent wrote it last (`Writer::current`). A volume
    /// the cache does not hold, or stored now under another plugin, is absent.
    pub async fn read_volume(
        &self,
        views: &moor::runtime::reflector::Store<VolumeView>,
        key: &ObjectKey<VolumeSpec>,
    ) -> Result<Option<Arc<Volume>>, moor::store::StoreError> {
        let Some(view) = views.get(key) else {
            return Ok(None);
        };
        let stored = self.writer.current(views, key, view.whole.clone()).await?;
        Ok(stored.filter(|v| v.spec.plugin_id == self.plugin.id))
    }

    /// What `family`'s attach calls take from a volume that may be gone (none stays
    /// none): its inputs, with the Secret it names for them, read now.
    pub async fn attach_inputs(
        &self,
        vol: Option<&VolumeView>,
        family: SecretFamily,
    ) -> Result<Option<AttachInputs>, MissingSecret> {
        let Some(v) = vol else {
            return Ok(None);
        };
        if v.attach.secret_refs.get(family).is_none() {
            return Ok(Some(v.attach.clone()));
        }
        let book = self.secret_book().await;
        let resolved = v
            .attach
            .for_family(family, &self.plugin.id, &v.namespace, book)
            .map(std::borrow::Cow::into_owned);
        self.missing_secret(&v.object_ref(), &resolved).await;
        resolved.map(Some)
    }

    /// Records an event about a volume.
    pub async fn volume_event(
        &self,
        vol: &ObjectRef,
        reason: &str,
        type_: EventType,
        message: String,
    ) {
        let d = crate::common::details([("volume_id", vol.name.to_string())]);
        self.recorder
            .record(vol.clone(), type_, reason, message, d)
            .await;
    }

    pub(super) async fn run(mut self, metrics: Metrics, stop: CancellationToken) {
        use moor::runtime::informer::Informer;
        tracing::info!(plugin = %self.plugin.id, "leading the controller plugin");
        // Only this plugin's volumes (a cluster of several plugins caches each
        // plugin's share in its own agent): the provisioner, snapshotter, survey and
        // attacher treat another plugin's volume exactly as an absent one (they skip
        // it), so a volume edited onto another plugin, which leaves this cache as a
        // deletion, is seen as before. Each as a view (`volume_view`): what acts on a
        // whole volume takes it through `Writer::current`.
        let plugin = self.plugin.id.clone();
        let volumes = Informer::<VolumeView>::spawn_projected(
            self.reads.clone(),
            KeyScope::all(),
            Some(Arc::new(move |v: &Volume| v.spec.plugin_id == plugin)),
            VolumeView::of_provisioned,
            stop.clone(),
        );
        let attachments = Informer::<Attachment>::spawn_indexed(
            self.reads.clone(),
            KeyScope::all(),
            &[attacher::BY_PLUGIN_VOLUME],
            stop.clone(),
        );
        let snapshots =
            Informer::<Snapshot>::spawn(self.reads.clone(), KeyScope::all(), stop.clone());
        let groups = Informer::<VolumeGroupSnapshot>::spawn(
            self.reads.clone(),
            KeyScope::all(),
            stop.clone(),
        );
        // This plugin's reports on its attachments: what the attacher keeps of their
        // status, since the controller alone writes attachments (`reports`).
        let reports = Informer::<AttachmentReport>::spawn(
            self.reads.clone(),
            AttachmentReport::scope_for(&self.plugin.id),
            stop.clone(),
        );
        let volume_reports = Informer::<VolumeReport>::spawn(
            self.reads.clone(),
            VolumeReport::scope_for(&self.plugin.id),
            stop.clone(),
        );
        let snapshot_reports = Informer::<SnapshotReport>::spawn(
            self.reads.clone(),
            SnapshotReport::scope_for(&self.plugin.id),
            stop.clone(),
        );
        let group_reports = Informer::<VolumeGroupSnapshotReport>::spawn(
            self.reads.clone(),
            VolumeGroupSnapshotReport::scope_for(&self.plugin.id),
            stop.clone(),
        );
        self.writer = self
            .writer
            .tracking_as::<VolumeSpec, _>(&volumes.reader())
            .tracking(&attachments.reader())
            .tracking(&reports.reader())
            .tracking(&volume_reports.reader())
            .tracking(&snapshot_reports.reader())
            .tracking(&group_reports.reader())
            .tracking(&snapshots.reader())
            .tracking(&groups.reader());
        let granted = Informer::<Ownership>::spawn_filtered(
            self.reads.clone(),
            Ownership::scope_for(&self.plugin.id),
            Arc::new(|o: &Ownership| o.spec.chosen || !o.spec.shared_with.is_empty()),
            stop.clone(),
        );
        // Quotas: what the controller charged of each namespace (few objects).
        let quotas = Informer::<Quota>::spawn(self.reads.clone(), KeyScope::all(), stop.clone());
        use super::reports::Reports;
        let volume_reports = Reports::new(&self.plugin.id, volume_reports, &self.writer);
        let prov = provisioner::Provisioner {
            ctx: self.clone(),
            volumes: volumes.clone(),
            snapshots: snapshots.clone(),
            granted,
            reports: volume_reports.clone(),
            quotas: quotas.clone(),
        };
        let group = group_snapshotter::GroupSnapshotter {
            ctx: self.clone(),
            groups,
            volumes: volumes.clone(),
            reports: Reports::new(&self.plugin.id, group_reports, &self.writer),
        };
        let snap = snapshotter::Snapshotter {
            ctx: self.clone(),
            snapshots,
            volumes: volumes.clone(),
            reports: Reports::new(&self.plugin.id, snapshot_reports, &self.writer),
            quotas,
        };
        let reports = Reports::new(&self.plugin.id, reports, &self.writer);
        let survey = survey::Survey {
            ctx: self.clone(),
            volumes: volumes.clone(),
            attachments: attachments.clone(),
            reports: reports.clone(),
            volume_reports,
            every: self.survey_interval,
            unpublish_unknown: self.unpublish_unknown,
        };
        let att = attacher::Attacher {
            ctx: self,
            volumes,
            attachments,
            reports,
        };
        // Each on the heap: together they outgrow a worker thread's stack (debug
        // builds keep every await point's locals).
        tokio::join!(
            Box::pin(prov.run(metrics.controller("provisioner"), stop.clone())),
            Box::pin(snap.run(metrics.controller("snapshotter"), stop.clone())),
            Box::pin(group.run(metrics.controller("group-snapshotter"), stop.clone())),
            Box::pin(survey.run(stop.clone())),
            Box::pin(att.run(metrics.controller("attacher"), stop))
        );
    }
}
