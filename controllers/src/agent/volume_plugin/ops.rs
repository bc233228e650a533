//! What each verb of the volume-plugin protocol does to moor's desired state.
//!
//! An engine holds a volume on this node through one Allocation, its *hold*, named
//! `<engine>-<hash of node and engine>.<volume>` (labelled with this node), with one
//! request `data`. Each caller (the engine's mount ID: a container's, or the one
//! Docker uses to copy an image's files in) is recorded on it as a label
//! `moor.dev/caller.<hash of the ID>` (the ID's first 63 characters): the first Mount
//! makes the hold and waits for NodePublish; a later Mount of the same volume by the
//! same engine adds its caller and is answered from the publish in place. The last
//! Unmount leaves the hold without callers; it ends after `--volume-plugin-linger`
//! unless a Mount came meanwhile (Docker's two Mounts per `docker run`, a restart). It
//! has no runner lease, so an agent restart never ends it; a hold found without
//! callers at two checks of the forgotten-mount rule ends then.
//!
//! A caller whose allocation is its own (`<caller's first 12>-<hash of the
//! caller>.<volume>`: made by an earlier release, or a caller beyond [`MAX_CALLERS`])
//! keeps it until its Unmount, as before.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::time::Instant;

use moor::api::*;
use moor::store::{ConflictRetry, Store, StoreError};
use moor::workload::{self, End, IfEnded, Pace, WorkloadError};

use super::options::CreateOptions;
use super::{Answer, Config, Failure};

/// Labels of what the endpoint writes.
pub const LABEL_CREATED_BY: &str = "moor.dev/created-by";
/// The value of [`LABEL_CREATED_BY`] on volumes Create made.
pub const CREATED_BY_ENDPOINT: &str = "volume-plugin";
/// The label naming the engine whose Create made a volume (the socket it came in on);
/// a volume made before engines had sockets of their own has none and counts as
/// [`super::DEFAULT_ENGINE`]'s.
pub const LABEL_ENGINE: &str = "moor.dev/engine";
/// Set on an endpoint allocation whose Mount came from a process this agent's PID
/// namespace does not number (`SO_PEERCRED` pid 0): its containers' mount namespaces
/// are out of the agent's sight.
pub const LABEL_UNSEEN: &str = "moor.dev/caller-unseen";
/// An endpoint allocation's node (the endpoint that serves its caller).
pub const LABEL_NODE: &str = "moor.dev/volume-plugin-node";
/// An endpoint allocation's caller (the engine's mount ID, up to 63 characters).
pub const LABEL_CALLER: &str = "moor.dev/caller";
/// The name of the one request an endpoint allocation makes.
pub const REQUEST: &str = "data";
/// The prefix of the labels recording a hold's callers: the prefix, then 16 hex digits
/// of the SHA-256 of the caller's whole ID; the value is the ID's first 63 characters.
pub const CALLER_PREFIX: &str = "moor.dev/caller.";
/// Set on an engine's hold, valued with the engine.
pub const LABEL_HOLD: &str = "moor.dev/hold";
/// The most callers one hold records (labels are bounded); a caller beyond them gets an
/// allocation of its own.
pub const MAX_CALLERS: usize = MAX_LABELS - 8;
/// How long the endpoint waits on the store for one answer before it says the store
/// does not answer (shorter than any engine's timeout).
pub const STORE_PATIENCE: Duration = Duration::from_secs(5);
/// The patience instead of [`STORE_PATIENCE`] once a call found the store unavailable,
/// until a call gets an answer from it again: one container start makes several calls
/// (Docker: Get, Create, Mount), and each waiting the whole patience added up to 15 s.
pub const SILENT_PATIENCE: Duration = Duration::from_secs(1);
/// How long a Mount that needs CSI calls waits for the volume's node plugin to be
/// healthy on this node (an agent just started, a plugin restarting) before it fails
/// naming the plugin.
pub const PLUGIN_PATIENCE: Duration = Duration::from_secs(5);

/// The label recording `caller` on a hold.
pub fn caller_label(caller: &str) -> String {
    format!("{CALLER_PREFIX}{}", sha256_hex(caller, 8))
}

/// The callers a hold records (their IDs' first 63 characters).
pub fn hold_callers(alloc: &Allocation) -> impl Iterator<Item = &str> {
    alloc
        .metadata
        .labels
        .iter()
        .filter(|(k, _)| k.starts_with(CALLER_PREFIX))
        .map(|(_, v)| v.as_str())
}

/// Whether `alloc` is an engine's hold.
pub fn is_hold(alloc: &Allocation) -> bool {
    alloc.metadata.labels.contains_key(LABEL_HOLD)
}

/// How often a waiting Mount or Unmount reads the claim again: from 5 ms, doubling
/// up to 100 ms (a claim on an idle node is published in tens of milliseconds; a
/// fixed 100 ms made every Mount take at least that).
fn poll() -> moor::backoff::Backoff {
    moor::backoff::Backoff::new(Duration::from_millis(5), Duration::from_millis(100))
        .without_jitter()
}

/// The endpoint's state: none of its own beyond its configuration.
pub struct Endpoint {
    cfg: Config,
    store: Store,
    node: NodeName,
    /// Mounts being answered, per allocation key: a caller that hangs up ends its
    /// allocation only when no other Mount of the same key is still waiting (Podman
    /// sends one ID for every mount, and tries again after its timeout).
    mounting: std::sync::Mutex<BTreeMap<String, usize>>,
    /// Whether the last call that ended found the store unavailable ([`SILENT_PATIENCE`]).
    silent: std::sync::atomic::AtomicBool,
}

/// A request that names a volume: Create (with its options), Remove, Get, Path.
#[derive(Debug, serde::Deserialize)]
pub struct NameRequest {
    /// The volume.
    #[serde(rename = "Name")]
    pub name: String,
    /// Create's `-o` options.
    #[serde(rename = "Opts", default)]
    pub opts: Option<Value>,
}

/// Mount and Unmount: the volume and the caller (the engine's mount ID).
#[derive(Debug, serde::Deserialize)]
pub struct CallerRequest {
    /// The volume.
    #[serde(rename = "Name")]
    pub name: String,
    /// The caller.
    #[serde(rename = "ID")]
    pub id: String,
}

/// The volume a request names.
fn volume_name(name: &str) -> Result<VolumeId, Failure> {
    VolumeId::new(name)
        .map_err(|e| Failure::bad(format!("volume name {}: {e}", moor::api::printable(name))))
}

/// The caller a Mount or Unmount names: its whole ID (1-256 characters of
/// [A-Za-z0-9._-]).
fn caller(id: &str) -> Result<String, Failure> {
    if id.is_empty()
        || id.len() > 256
        || !id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    {
        return Err(Failure::bad(format!(
            "ID {}: 1-256 characters of [A-Za-z0-9._-]",
            moor::api::printable(id)
        )));
    }
    Ok(id.to_string())
}

/// Whether a Mount was answered from a publish the engine already held.
pub type Reused = bool;

impl Endpoint {
    /// The endpoint of this node.
    pub fn new(cfg: Config, store: Store, node: NodeName) -> Endpoint {
        Endpoint {
            cfg,
            store,
            node,
            mounting: Default::default(),
            silent: Default::default(),
        }
    }

    /// How long a call waits on the store: [`STORE_PATIENCE`], or [`SILENT_PATIENCE`]
    /// while the last call that ended found it unavailable.
    fn patience(&self) -> Duration {
        if self.silent.load(std::sync::atomic::Ordering::Relaxed) {
            SILENT_PATIENCE
        } else {
            STORE_PATIENCE
        }
    }

    /// `f`, given up after the store's patience: the store did not answer.
    async fn bounded<T>(
        &self,
        f: impl std::future::Future<Output = Result<T, Failure>>,
    ) -> Result<T, Failure> {
        let patience = self.patience();
        tokio::time::timeout(patience, f)
            .await
            .map_err(|_| Failure::from(StoreError::unanswered(patience)))?
    }

    /// Records whether `answer` found the store unavailable.
    fn note<T>(&self, answer: &Result<T, Failure>) {
        let silent = answer.as_ref().is_err_and(Failure::store_unavailable);
        self.silent
            .store(silent, std::sync::atomic::Ordering::Relaxed);
    }

    /// Mount, answered through `reply`, for a caller that may hang up: a Podman client
    /// gives up after 5 s by default, a killed `docker run` at once. The handler of a
    /// caller that hung up is dropped with its connection, so the Mount runs on its own
    /// task and watches `reply`: once the caller is gone (before the answer, or the
    /// answer could not be given) its place on the hold (or its own allocation) is
    /// given up and a Warning logged, unless another Mount of the same caller and
    /// volume is still waiting for it. Nobody would ever Unmount it. A refused Mount
    /// gives its place up likewise, after its answer (a store that does not answer
    /// must not delay the answer).
    pub async fn mount_for(
        &self,
        req: &CallerRequest,
        peer: super::Peer,
        mut reply: tokio::sync::oneshot::Sender<Result<(Value, Reused), Failure>>,
    ) {
        let (id, caller) = match (volume_name(&req.name), caller(&req.id)) {
            (Ok(id), Ok(caller)) => (id, caller),
            (Err(f), _) | (_, Err(f)) => {
                let _ = reply.send(Err(f));
                return;
            }
        };
        let inflight = format!("{id}/{caller}");
        *self.lock_mounting().entry(inflight.clone()).or_default() += 1;
        let answered = tokio::select! {
            answer = self.mount(&id, &caller, peer) => {
                self.note(&answer);
                // Answered only when an answer that took the place reached the caller.
                let refused = answer.is_err();
                reply.send(answer).is_ok() && !refused
            }
            () = reply.closed() => false,
        };
        let last = {
            let mut mounting = self.lock_mounting();
            let left = mounting.get(&inflight).map_or(0, |n| n.saturating_sub(1));
            if left == 0 {
                mounting.remove(&inflight);
            } else {
                mounting.insert(inflight.clone(), left);
            }
            left == 0
        };
        if answered {
            return;
        }
        if !last {
            tracing::warn!(volume = %id, caller = %moor::api::printable(&caller), "a Mount ended without its answer reaching the caller; another Mount of the same caller waits, so its place stays");
            return;
        }
        let given_up = tokio::time::timeout(STORE_PATIENCE * 2, self.give_up(&caller, &id)).await;
        tracing::warn!(volume = %id, caller = %moor::api::printable(&caller), given_up = matches!(given_up, Ok(Ok(true))), "a Mount was refused, or its caller hung up before the answer: nobody will Unmount it, so its place on the volume is given up");
    }

    fn lock_mounting(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, usize>> {
        self.mounting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs the verb `verb` (the part after `VolumeDriver.`) on its request body;
    /// Mount, which outlives its connection, is [`Endpoint::mount_for`]. Every verb
    /// answers within the store's patience ([`Endpoint::patience`]) of its silence.
    pub async fn dispatch(&self, verb: &str, body: &[u8]) -> Answer {
        let run = async {
            match verb {
                "Create" => self.create(&super::parse(body)?).await,
                "Remove" => self.remove(&super::parse(body)?).await,
                "Unmount" => self.unmount(&super::parse(body)?).await,
                "Path" => self.path(&super::parse(body)?).await,
                "Get" => self.get(&super::parse(body)?).await,
                "List" => self.list().await,
                _ => Err(Failure::bad(format!(
                    "no such verb VolumeDriver.{}",
                    moor::api::printable(verb)
                ))),
            }
        };
        // Remove may wait for a lingering hold's release (bounded of its own).
        let patience = if verb == "Remove" {
            self.patience() * 3
        } else {
            self.patience()
        };
        let answer = match tokio::time::timeout(patience, run).await {
            Ok(answer) => answer,
            Err(_) => Err(Failure::from(StoreError::unanswered(patience))),
        };
        self.note(&answer);
        answer
    }

    fn ns(&self) -> &Namespace {
        &self.cfg.namespace
    }

    async fn volume(&self, id: &VolumeId) -> Result<Option<Volume>, Failure> {
        Ok(self.store.try_get(&Volume::key_for(self.ns(), id)).await?)
    }

    /// Create: an existing volume is used as it is (an option it contradicts is
    /// refused); otherwise a Volume is written from the options, made where this node
    /// can use it: the placement rules of a template's volume
    /// ([`moor::admission::placement`]: the plugin healthy here, room under its max
    /// volumes, the capacity its survey reported for this node's segment), with this
    /// node's segment as the requisite and preferred topology. Returns once desired
    /// state is written; Mount waits for Ready.
    async fn create(&self, req: &NameRequest) -> Answer {
        let id = volume_name(&req.name)?;
        let opts = CreateOptions::parse(req.opts.as_ref())?;
        if let Some(v) = self.volume(&id).await? {
            return match opts.contradiction(&v.spec, v.status.provisioning.capacity_bytes) {
                Some(why) => Err(Failure::bad(format!("volume {id} exists: {why}"))),
                None => Ok(json!({})),
            };
        }
        let plugin = opts
            .plugin
            .clone()
            .unwrap_or_else(|| self.cfg.default_plugin.clone());
        let mut spec = VolumeSpec {
            plugin_id: plugin.clone(),
            capacity_min: opts.size,
            capabilities: vec![VolumeCapability {
                access_mode: match opts.mode {
                    Some(m) => m,
                    None => self.default_mode(&plugin).await?,
                },
                attachment_mode: AttachmentMode::FileSystem,
            }],
            source: opts.source.clone(),
            ..Default::default()
        };
        if opts.fs_type.is_some() || opts.mount_flags.is_some() {
            spec.mount_options = Rare::new(MountOptions {
                fs_type: opts.fs_type.clone(),
                mount_flags: MountFlags::new(opts.mount_flags.clone().unwrap_or_default()),
                ..Default::default()
            });
        }
        if !opts.parameters.is_empty() {
            spec.parameters = Rare::new(opts.parameters.clone());
        }
        let segment = self.placement(&id, &plugin, opts.size).await?;
        if !segment.is_empty() {
            spec.topology_request = Some(Box::new(TopologyRequest {
                required: vec![segment.clone()],
                preferred: vec![segment],
            }));
        }
        let name = Name::new(id.as_str()).map_err(|e| Failure::bad(e.to_string()))?;
        let mut volume = Volume::new(self.ns(), name, spec);
        volume
            .metadata
            .labels
            .insert(LABEL_CREATED_BY.into(), CREATED_BY_ENDPOINT.into());
        volume
            .metadata
            .labels
            .insert(LABEL_ENGINE.into(), self.cfg.engine.clone());
        if let Err(e) = volume.validate() {
            return Err(Failure::bad(format!("volume {id}: {e}")));
        }
        match self.store.create(&volume).await {
            Ok(_) => Ok(json!({})),
            // Another node's endpoint (the engine asks each) made it first.
            Err(StoreError::AlreadyExists { .. }) => Ok(json!({})),
            Err(e) => Err(e.into()),
        }
    }

    /// The access mode of a volume made without `-o mode=`: shared by the claims of one
    /// node (single-node-multi-writer) where this node's instance of the plugin
    /// advertises SINGLE_NODE_MULTI_WRITER, as Kubernetes' ReadWriteOnce is (Docker and
    /// Podman on one node, a `:ro` container beside a writer); otherwise
    /// single-node-writer.
    async fn default_mode(&self, plugin: &PluginId) -> Result<AccessMode, Failure> {
        let node = self.store.try_get(&Node::key_for(&self.node)).await?;
        let shares = node
            .as_ref()
            .and_then(|n| n.status.plugins.get(plugin))
            .is_some_and(|p| p.capabilities.node.has(NodeRpc::SingleNodeMultiWriter));
        Ok(if shares {
            AccessMode::SingleNodeMultiWriter
        } else {
            AccessMode::SingleNodeWriter
        })
    }

    /// Where volume `id` of `plugin`, at least `size`, is made for this node (see
    /// [`Endpoint::create`]); refused with the rule's reason.
    async fn placement(
        &self,
        id: &VolumeId,
        plugin: &PluginId,
        size: Option<Size>,
    ) -> Result<Topology, Failure> {
        let node = self.store.try_get(&Node::key_for(&self.node)).await?;
        let limited = node
            .as_ref()
            .and_then(|n| n.status.plugins.get(plugin))
            .is_some_and(|p| p.max_volumes_per_node.is_some());
        // The claims on this node, only where the plugin limits volumes per node.
        let claims = if limited {
            self.store.list(&Claim::node_scope(&self.node)).await?.items
        } else {
            Vec::new()
        };
        // The survey's report; unreadable (an older role without the grant, a
        // malformed value) is unknown, as where the plugin offers no GetCapacity.
        let capacity = match self.store.capacity(plugin).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(plugin = %plugin, error = %e, "capacity report unreadable; placing without it");
                None
            }
        };
        moor::admission::placement(
            self.ns(),
            id.as_str(),
            plugin,
            size,
            &self.node,
            node.as_ref(),
            capacity.as_deref(),
            || claims.iter(),
        )
        .map_err(|v| match v {
            moor::admission::Verdict::Wait(why) | moor::admission::Verdict::Deny(why) => {
                Failure::bad(format!("volume {id}: {why}"))
            }
        })
    }

    /// Remove, by the deletion precedence (docs/architecture.md): refused while the
    /// volume's deletion protection is set; refused while any claim holds it (named);
    /// deleted (its finalizer calls DeleteVolume) only when this engine's Create made
    /// it; any other (made by moorctl, a template, or another engine: `podman volume
    /// prune` must not delete what Docker wrote) is only forgotten by the engine. The
    /// delete is guarded by the version the checks read: a claim admitted since (it
    /// writes the volume's status) makes it look again, and a reconciler's unrelated
    /// write likewise (bounded, as every unversioned write).
    async fn remove(&self, req: &NameRequest) -> Answer {
        let id = volume_name(&req.name)?;
        let mut retry = ConflictRetry::default();
        let mut lingering = poll();
        let waited = Instant::now();
        loop {
            let Some(v) = self.volume(&id).await? else {
                return Ok(json!({}));
            };
            // Holds without callers (lingering after their last Unmount) end now, and
            // the Remove waits for their release.
            if self.release_unheld(&v).await? && waited.elapsed() < STORE_PATIENCE * 2 {
                tokio::time::sleep(lingering.next_delay()).await;
                continue;
            }
            if let Some(why) = v.spec.deletion_refused() {
                return Err(Failure::bad(format!("volume {id} is protected: {why}")));
            }
            let claims = &v.status.claims;
            let holders: Vec<String> = claims
                .read_claims
                .iter()
                .chain(&claims.write_claims)
                .map(|c| {
                    format!(
                        "{} (allocation {} on node {})",
                        c.claim, c.allocation, c.node
                    )
                })
                .collect();
            if !holders.is_empty() {
                return Err(Failure::bad(format!(
                    "volume {id} is in use by claim {}",
                    holders.join(", ")
                )));
            }
            let labels = &v.metadata.labels;
            let made_here =
                labels.get(LABEL_CREATED_BY).map(String::as_str) == Some(CREATED_BY_ENDPOINT);
            let maker = labels
                .get(LABEL_ENGINE)
                .map_or(super::DEFAULT_ENGINE, String::as_str);
            if !made_here || maker != self.cfg.engine {
                tracing::info!(volume = %id, engine = %self.cfg.engine, made_by = %if made_here { maker } else { "moor" }, "volume-plugin Remove of a volume this engine did not create: forgotten by the engine, kept in moor");
                return Ok(json!({}));
            }
            let at = Some(v.metadata.resource_version);
            match self.store.delete(&v.object_key(), at).await {
                Ok(_) | Err(StoreError::NotFound { .. }) => return Ok(json!({})),
                Err(StoreError::Conflict { .. }) if retry.again().await => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// The allocation of `caller` for volume `id` on this node: [`joined_name`] of
    /// `<the caller's first 12 characters>-<16 hex digits of the SHA-256 of this node,
    /// the engine and the whole caller>` and the volume, as short as a container's short id (the
    /// caller's first 63 characters are a label). The node is in the hash: engines on
    /// two nodes may send the same ID (Podman sends one constant ID for every mount, as
    /// it counts a volume's users itself). The whole ID is hashed: Docker's are 64
    /// characters, and two that shared their first 63 once shared one allocation.
    fn allocation_key(
        &self,
        caller: &str,
        id: &VolumeId,
    ) -> Result<ObjectKey<AllocationSpec>, Failure> {
        let short: String = caller.chars().take(12).collect();
        let hash = sha256_hex(&format!("{}/{}/{caller}", self.node, self.cfg.engine), 8);
        let name = Name::new(joined_name(&format!("{short}-{hash}"), id.as_str()))
            .map_err(|e| Failure::bad(e.to_string()))?;
        Ok(Allocation::key_for(self.ns(), name))
    }

    /// The key an earlier release gave the allocation of `caller` for `id` (the
    /// caller cut to 63 characters, a 32-bit FNV hash, the dotted join): a container
    /// mounted before an upgrade is still found by its Unmount, and Podman's next
    /// Mount of the same ID adopts it while it runs.
    fn legacy_allocation_key(
        &self,
        caller: &str,
        id: &VolumeId,
    ) -> Option<ObjectKey<AllocationSpec>> {
        let caller: String = caller.chars().take(63).collect();
        let short: String = caller.chars().take(12).collect();
        let hash = fnv1a(&format!("{}/{caller}", self.node)) as u32;
        let name = Name::new(bounded_name(
            &[&format!("{short}-{hash:08x}"), id.as_str()],
            ".",
        ))
        .ok()?;
        Some(Allocation::key_for(self.ns(), name))
    }

    /// The allocation of `caller` for `id`: at its key, or else a live one of this
    /// node at the key an earlier release gave it ([`Endpoint::legacy_allocation_key`]).
    /// Returns the key to use and what is stored there.
    async fn find_allocation(
        &self,
        caller: &str,
        id: &VolumeId,
    ) -> Result<(ObjectKey<AllocationSpec>, Option<Allocation>), Failure> {
        let key = self.allocation_key(caller, id)?;
        let legacy = self.legacy_allocation_key(caller, id).filter(|l| *l != key);
        // Both read at once: one round trip.
        let (current, old) = tokio::try_join!(self.store.try_get(&key), async {
            match &legacy {
                Some(l) => self.store.try_get(l).await,
                None => Ok(None),
            }
        })?;
        if let Some(a) = current {
            return Ok((key, Some(a)));
        }
        if let (Some(l), Some(a)) = (legacy, old) {
            if !a.is_terminal() && a.spec.node == self.node {
                return Ok((l, Some(a)));
            }
        }
        Ok((key, None))
    }

    /// The key of this engine's hold on volume `id` on this node: [`joined_name`] of
    /// `<engine>-<16 hex digits of the SHA-256 of this node and the engine>` and the
    /// volume.
    fn hold_key(&self, id: &VolumeId) -> Result<ObjectKey<AllocationSpec>, Failure> {
        let hash = sha256_hex(&format!("{}/{}", self.node, self.cfg.engine), 8);
        let name = Name::new(joined_name(
            &format!("{}-{hash}", self.cfg.engine),
            id.as_str(),
        ))
        .map_err(|e| Failure::bad(e.to_string()))?;
        Ok(Allocation::key_for(self.ns(), name))
    }

    /// Mount: the caller's place on this engine's hold of the volume (the hold made
    /// when there is none live), then a wait until NodePublish returned OK for the
    /// hold's claim (woken by the node pass); answers the target path, and whether the
    /// hold was already live (a re-mount). A caller with a live allocation of its own
    /// keeps using it.
    async fn mount(
        &self,
        id: &VolumeId,
        caller: &str,
        peer: super::Peer,
    ) -> Result<(Value, Reused), Failure> {
        let started = Instant::now();
        let (key, reused) = self.take_place(id, caller, peer).await?;
        let placed_us = started.elapsed().as_micros() as u64;
        tracing::debug!(allocation = %key, placed_us, reused, "volume-plugin: Mount placed");
        let path = self.wait_published(&key, id).await?;
        Ok((json!({ "Mountpoint": path }), reused))
    }

    /// The allocation a Mount of `id` by `caller` waits on, and whether it was live
    /// already: the engine's hold the caller is on, or the caller's own live
    /// allocation, or the hold it joins ([`Endpoint::join_hold`]).
    async fn take_place(
        &self,
        id: &VolumeId,
        caller: &str,
        peer: super::Peer,
    ) -> Result<(ObjectKey<AllocationSpec>, Reused), Failure> {
        // The hold, the volume and the caller's own allocation, read at once.
        let hold_key = self.hold_key(id)?;
        let (hold, volume, (own_key, own)) = self
            .bounded(async {
                tokio::try_join!(
                    async { Ok::<_, Failure>(self.store.try_get(&hold_key).await?) },
                    self.volume(id),
                    self.find_allocation(caller, id),
                )
            })
            .await?;
        // A caller already on the engine's live hold (Podman's one ID, a retried
        // Mount): nothing to write.
        let on_hold = hold.as_ref().is_some_and(|h| {
            !h.is_terminal()
                && h.spec.node == self.node
                && h.metadata.labels.contains_key(&caller_label(caller))
        });
        if on_hold {
            return Ok((hold_key, true));
        }
        let Some(volume) = volume else {
            return Err(Failure::bad(format!("no such volume {id}")));
        };
        let cap = volume
            .spec
            .capabilities
            .iter()
            .find(|c| c.attachment_mode == AttachmentMode::FileSystem)
            .copied()
            .ok_or_else(|| Failure::bad(format!("volume {id} offers no file-system capability")))?;
        match own.filter(|a| !a.is_terminal() && a.spec.node == self.node) {
            Some(_) => Ok((own_key, true)),
            None => {
                let live = hold
                    .as_ref()
                    .is_some_and(|h| !h.is_terminal() && h.spec.node == self.node);
                if !live {
                    // The hold is made: its claim needs the plugin's node calls.
                    self.plugin_ready(id, &volume.spec.plugin_id).await?;
                }
                self.bounded(self.join_hold(id, caller, cap, peer, hold))
                    .await
            }
        }
    }

    /// Waits up to [`PLUGIN_PATIENCE`] for `plugin` to be healthy on this node, as
    /// this agent probes it; refused naming the plugin and its last answer.
    async fn plugin_ready(&self, id: &VolumeId, plugin: &PluginId) -> Result<(), Failure> {
        let deadline = tokio::time::Instant::now() + PLUGIN_PATIENCE;
        loop {
            let why = match self.cfg.plugins.status(plugin) {
                Some(s) if s.healthy => return Ok(()),
                Some(s) => format!(
                    "plugin {plugin} is unhealthy on node {}: {}",
                    self.node, s.health_message
                ),
                None => format!("plugin {plugin} does not run on node {}", self.node),
            };
            if tokio::time::Instant::now() >= deadline {
                return Err(Failure::bad(format!("volume {id}: {why}")));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Records `caller` on this engine's hold of `id`, making the hold when none is
    /// live (one that ended is replaced); a caller beyond [`MAX_CALLERS`] gets an
    /// allocation of its own. Returns the allocation to wait on and whether it was
    /// live already.
    async fn join_hold(
        &self,
        id: &VolumeId,
        caller: &str,
        cap: VolumeCapability,
        peer: super::Peer,
        read: Option<Allocation>,
    ) -> Result<(ObjectKey<AllocationSpec>, Reused), Failure> {
        let key = self.hold_key(id)?;
        let label = caller_label(caller);
        let short: String = caller.chars().take(63).collect();
        let mut retry = ConflictRetry::default();
        // The hold as the Mount read it, then as read again after a conflict.
        let mut read = Some(read);
        loop {
            let hold = match read.take() {
                Some(h) => h,
                None => self.store.try_get(&key).await?,
            };
            let raced = match hold {
                Some(h) if !h.is_terminal() && !h.is_deleting() && h.spec.node == self.node => {
                    if h.metadata.labels.contains_key(&label) {
                        return Ok((key, true));
                    }
                    if hold_callers(&h).count() >= MAX_CALLERS {
                        let own = self.allocation_key(caller, id)?;
                        let wanted = self.wanted(&own, Some(caller), id, cap, peer)?;
                        self.start(&wanted).await?;
                        return Ok((own, false));
                    }
                    let mut next = h.clone();
                    next.metadata.labels.insert(label.clone(), short.clone());
                    if peer.pid.is_none() {
                        next.metadata
                            .labels
                            .insert(LABEL_UNSEEN.into(), "true".into());
                    }
                    match self.store.update(&h, &next).await {
                        Ok(_) => return Ok((key, true)),
                        Err(e @ StoreError::Conflict { .. }) => e,
                        Err(e) => return Err(e.into()),
                    }
                }
                // None: made, without create_or_adopt's read of what was just read.
                None => {
                    let mut wanted = self.wanted(&key, None, id, cap, peer)?;
                    wanted.metadata.labels.insert(label.clone(), short.clone());
                    wanted
                        .metadata
                        .labels
                        .insert(LABEL_HOLD.into(), self.cfg.engine.clone());
                    match self.store.create(&wanted).await {
                        Ok(_) => return Ok((key, false)),
                        Err(e @ StoreError::AlreadyExists { .. }) => e,
                        Err(e) => return Err(e.into()),
                    }
                }
                // Ended, or being deleted: made again.
                _ => {
                    let mut wanted = self.wanted(&key, None, id, cap, peer)?;
                    wanted.metadata.labels.insert(label.clone(), short.clone());
                    wanted
                        .metadata
                        .labels
                        .insert(LABEL_HOLD.into(), self.cfg.engine.clone());
                    self.start(&wanted).await?;
                    return Ok((key, false));
                }
            };
            if !retry.again().await {
                return Err(raced.into());
            }
        }
    }

    /// Creates `wanted`, or adopts the live one of its name (an ended one is replaced).
    async fn start(&self, wanted: &Allocation) -> Result<(), Failure> {
        workload::create_or_adopt(&self.store, wanted, IfEnded::Replace, false)
            .await
            .map(|_| ())
            .map_err(|e| match e {
                WorkloadError::Store(e) => Failure::from(e),
                other => Failure::internal(other.to_string()),
            })
    }

    /// The allocation a Mount of volume `id` wants: on this node, running, one request
    /// `data` with the capability Mount chose, labelled with its node and, for an
    /// allocation of one caller's own, that caller.
    fn wanted(
        &self,
        key: &ObjectKey<AllocationSpec>,
        caller: Option<&str>,
        id: &VolumeId,
        cap: VolumeCapability,
        peer: super::Peer,
    ) -> Result<Allocation, Failure> {
        let spec = AllocationSpec {
            node: self.node.clone(),
            client_status: ClientStatus::Running,
            volumes: vec![VolumeRequest {
                name: Name::new(REQUEST).map_err(|e| Failure::internal(e.to_string()))?,
                volume: id.clone(),
                read_only: !cap.access_mode.allows_write(),
                access_mode: Some(cap.access_mode),
                attachment_mode: Some(cap.attachment_mode),
                ..Default::default()
            }],
            ..Default::default()
        };
        let name = Name::new(key.name()).map_err(|e| Failure::internal(e.to_string()))?;
        let mut alloc = Allocation::new(self.ns(), name, spec);
        let labels = &mut alloc.metadata.labels;
        labels.insert(LABEL_NODE.into(), self.node.to_string());
        if let Some(caller) = caller {
            // A label value holds 63 characters; the allocation's name hashes the ID.
            labels.insert(LABEL_CALLER.into(), caller.chars().take(63).collect());
        }
        if peer.pid.is_none() {
            // The engine runs where this agent cannot see its processes: neither can
            // the forgotten-mount rule see its containers' (orphans.rs keeps it).
            labels.insert(LABEL_UNSEEN.into(), "true".into());
        }
        Ok(alloc)
    }

    /// Waits until NodePublish returned OK for the allocation's claim
    /// ([`workload::wait_node_published`], woken by the node pass; the store read
    /// between wakes, from 5 ms up to every 100 ms, for what the controller decides);
    /// its target path. A denied claim is the caller's error at once; a store that does
    /// not answer for [`STORE_PATIENCE`] ends the wait; the timeout says where things
    /// stood.
    async fn wait_published(
        &self,
        key: &ObjectKey<AllocationSpec>,
        volume: &VolumeId,
    ) -> Result<String, Failure> {
        let mut quiet = |line: &str| tracing::debug!(progress = line, "volume-plugin: waiting");
        let pace = Pace {
            poll: poll(),
            progress: &mut quiet,
            wake: Some(self.cfg.wake.clone()),
            store_patience: Some(self.patience()),
        };
        match workload::wait_node_published(&self.store, key, self.cfg.mount_timeout, pace).await {
            Ok(published) => published
                .paths
                .into_iter()
                .next()
                .map(|(_, p)| p.target_path)
                .ok_or_else(|| Failure::internal("the allocation has no request")),
            Err(WorkloadError::Refused(why)) => {
                Err(Failure::bad(format!("volume {volume}: {why}")))
            }
            Err(WorkloadError::TimedOut { after, last, .. }) => Err(Failure::internal(format!(
                "volume {volume} was not published on node {} within {} (last: {})",
                self.node,
                humantime::format_duration(after),
                moor::api::printable(&last)
            ))),
            Err(WorkloadError::Store(e)) => Err(e.into()),
        }
    }

    /// Ends the allocation at `key` (client status `status`, desired stop:
    /// `moor::workload::end`); a failure is logged (the allocation then waits for the
    /// forgotten-mount rule).
    async fn end(&self, key: &ObjectKey<AllocationSpec>, status: ClientStatus) {
        match workload::end(&self.store, key, End::Ended(status, None)).await {
            Ok(_) | Err(StoreError::NotFound { .. }) => {}
            Err(e) => {
                tracing::warn!(allocation = %key, error = %moor::store::bounded_chain(&e), "could not end an endpoint allocation")
            }
        }
    }

    /// Takes `caller` off this engine's hold of `id`; returns whether it was on it and
    /// whether callers remain.
    async fn leave_hold(&self, caller: &str, id: &VolumeId) -> Result<(bool, bool), Failure> {
        let key = self.hold_key(id)?;
        let label = caller_label(caller);
        let mut retry = ConflictRetry::default();
        loop {
            let Some(h) = self.store.try_get(&key).await? else {
                return Ok((false, false));
            };
            if h.is_terminal() || !h.metadata.labels.contains_key(&label) {
                return Ok((false, hold_callers(&h).next().is_some()));
            }
            let mut next = h.clone();
            next.metadata.labels.remove(&label);
            let left = hold_callers(&next).next().is_some();
            match self.store.update(&h, &next).await {
                Ok(_) => return Ok((true, left)),
                Err(StoreError::Conflict { .. }) if retry.again().await => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Gives up `caller`'s place on volume `id` after a refused or unanswered Mount: its
    /// own allocation ends (failed), or it leaves the hold, which ends at once when no
    /// caller is left (nothing was published for anyone). Whether anything changed.
    async fn give_up(&self, caller: &str, id: &VolumeId) -> Result<bool, Failure> {
        let (own_key, own) = self.find_allocation(caller, id).await?;
        if own.is_some_and(|a| !a.is_terminal()) {
            self.end(&own_key, ClientStatus::Failed).await;
            return Ok(true);
        }
        let (left_it, others) = self.leave_hold(caller, id).await?;
        if !others {
            end_unheld(&self.store, &self.hold_key(id)?, ClientStatus::Failed).await?;
        }
        Ok(left_it)
    }

    /// Unmount: a caller with an allocation of its own ends it (complete) and the
    /// answer waits until this node no longer publishes it; a caller on the hold leaves
    /// it at once, and the hold, when it has no caller left, ends after the linger
    /// unless a Mount came meanwhile ([`end_unheld`]). The rest of the release goes on
    /// as usual.
    async fn unmount(&self, req: &CallerRequest) -> Answer {
        let id = volume_name(&req.name)?;
        let caller = caller(&req.id)?;
        let (own_key, own) = self.find_allocation(&caller, &id).await?;
        if let Some(alloc) = own.filter(|a| !a.is_terminal()) {
            self.end(&own_key, ClientStatus::Complete).await;
            return self.wait_unpublished(&alloc, &id, &caller).await;
        }
        let (_, others) = self.leave_hold(&caller, &id).await?;
        if !others {
            let (store, key, linger) = (self.store.clone(), self.hold_key(&id)?, self.cfg.linger);
            tokio::spawn(async move {
                tokio::time::sleep(linger).await;
                if let Err(e) = end_unheld(&store, &key, ClientStatus::Complete).await {
                    tracing::warn!(allocation = %key, error = %moor::store::bounded_chain(&e), "could not end a hold without callers; the forgotten-mount rule will");
                }
            });
        }
        Ok(json!({}))
    }

    /// Ends the holds of volume `v` on this node that have no caller, whatever their
    /// engine (a hold without callers is used by nobody: Podman's lingers 2 s after
    /// `podman run --rm` while `docker volume rm` of the same volume follows), and says
    /// whether every claim on the volume is being released: held by an allocation that
    /// ended (or is gone) or by a hold without callers (ended here now, or lingering
    /// out on another node). Remove then waits for those releases rather than refusing
    /// the volume as in use; a claim of a live caller refuses it at once.
    async fn release_unheld(&self, v: &Volume) -> Result<bool, Failure> {
        let claims = &v.status.claims;
        let holders: Vec<_> = claims
            .read_claims
            .iter()
            .chain(&claims.write_claims)
            .collect();
        if holders.is_empty() {
            return Ok(false);
        }
        let keys: Vec<_> = holders
            .iter()
            .map(|c| Allocation::key_for(self.ns(), c.allocation.clone()))
            .collect();
        let read =
            futures::future::try_join_all(keys.iter().map(|k| self.store.try_get(k))).await?;
        let unheld = |a: &Allocation| is_hold(a) && hold_callers(a).next().is_none();
        let mut releasing = true;
        for ((claim, key), alloc) in holders.iter().zip(&keys).zip(read) {
            match alloc {
                None => {}
                Some(a) if a.is_terminal() => {}
                Some(a) if unheld(&a) && claim.node == self.node => {
                    end_unheld(&self.store, key, ClientStatus::Complete).await?;
                }
                // Another node's lingers out by itself.
                Some(a) if unheld(&a) => {}
                Some(_) => releasing = false,
            }
        }
        Ok(releasing)
    }

    /// Waits until this node no longer publishes `alloc`'s volume (an allocation of one
    /// caller's own, ended by its Unmount).
    async fn wait_unpublished(&self, alloc: &Allocation, id: &VolumeId, caller: &str) -> Answer {
        let Some(claim_name) = alloc.spec.volumes.first().and_then(|r| alloc.claim_name(r)) else {
            return Ok(json!({}));
        };
        let claim_key = Claim::key_for(&alloc.spec.node, self.ns(), &claim_name);
        let deadline = Instant::now() + Duration::from_secs(55);
        let mut poll = poll();
        loop {
            let published = match self.store.try_get(&Mount::key_for(&claim_key)).await? {
                Some(m) => m.status.published || m.status.publish_uncertain,
                None => false,
            };
            if !published {
                return Ok(json!({}));
            }
            if Instant::now() >= deadline {
                return Err(Failure::internal(format!(
                    "volume {id} is still published on node {} for {}",
                    self.node,
                    moor::api::printable(caller)
                )));
            }
            tokio::time::sleep(poll.next_delay()).await;
        }
    }

    /// The endpoint allocations of this node for volume `id`, with their published
    /// target paths (None while not published).
    async fn callers(&self, id: &VolumeId) -> Result<Vec<(Allocation, Option<String>)>, Failure> {
        let scope = KeyScope::<AllocationSpec>::namespace(self.ns()).unwrap_or_else(KeyScope::all);
        let list = self.store.list(&scope).await?;
        let mut out = Vec::new();
        for a in list.items {
            let ours =
                a.metadata.labels.get(LABEL_NODE).map(String::as_str) == Some(self.node.as_str());
            let Some(req) = a.spec.volumes.first() else {
                continue;
            };
            if !ours || req.volume != *id || a.is_terminal() {
                continue;
            }
            let path = match a.claim_name(req) {
                Some(c) => {
                    let ck = Claim::key_for(&self.node, self.ns(), &c);
                    self.store
                        .try_get(&Mount::key_for(&ck))
                        .await?
                        .filter(|m| m.status.published)
                        .map(|m| m.spec.target_path.clone())
                }
                None => None,
            };
            out.push((a, path));
        }
        Ok(out)
    }

    async fn path(&self, req: &NameRequest) -> Answer {
        let id = volume_name(&req.name)?;
        let path = self
            .callers(&id)
            .await?
            .into_iter()
            .find_map(|(_, p)| p)
            .unwrap_or_default();
        Ok(json!({ "Mountpoint": path }))
    }

    /// Get: the volume with moor's state of it (phase, plugin, capacity, the nodes
    /// claiming it, this node's callers); an error when moor has no such volume.
    async fn get(&self, req: &NameRequest) -> Answer {
        let id = volume_name(&req.name)?;
        let Some(v) = self.volume(&id).await? else {
            return Err(Failure::bad(format!("no such volume {id}")));
        };
        let callers = self.callers(&id).await?;
        let mountpoint = callers
            .iter()
            .find_map(|(_, p)| p.clone())
            .unwrap_or_default();
        let mut status: BTreeMap<&str, Value> = BTreeMap::new();
        status.insert("phase", json!(format!("{:?}", v.status.provisioning.phase)));
        status.insert("plugin", json!(v.spec.plugin_id.as_str()));
        if let Some(c) = v.status.provisioning.capacity_bytes {
            status.insert("capacity_bytes", json!(c));
        }
        let claims = &v.status.claims;
        let mut nodes: Vec<String> = claims
            .read_claims
            .iter()
            .chain(&claims.write_claims)
            .map(|c| c.node.to_string())
            .collect();
        nodes.sort();
        nodes.dedup();
        status.insert("published_on", json!(nodes));
        status.insert(
            "callers",
            json!(callers
                .iter()
                .flat_map(|(a, _)| a
                    .metadata
                    .labels
                    .get(LABEL_CALLER)
                    .map(String::as_str)
                    .into_iter()
                    .chain(hold_callers(a)))
                .collect::<Vec<_>>()),
        );
        let mut volume = json!({
            "Name": id.as_str(),
            "Mountpoint": mountpoint,
            "Status": status,
        });
        if let Some(t) = v.metadata.creation_timestamp {
            volume["CreatedAt"] = json!(t.to_string());
        }
        Ok(json!({ "Volume": volume }))
    }

    /// List: every volume of the namespace that offers a file system.
    async fn list(&self) -> Answer {
        let scope = KeyScope::<VolumeSpec>::namespace(self.ns()).unwrap_or_else(KeyScope::all);
        let list = self.store.list(&scope).await?;
        let volumes: Vec<Value> = list
            .items
            .iter()
            .filter(|v| v.metadata.namespace == *self.ns())
            .filter(|v| {
                v.spec
                    .capabilities
                    .iter()
                    .any(|c| c.attachment_mode == AttachmentMode::FileSystem)
            })
            .map(|v| json!({ "Name": v.metadata.name.as_str() }))
            .collect();
        Ok(json!({ "Volumes": volumes }))
    }
}

/// Ends the hold at `key` (client status `status`) if it is live and has no caller, in
/// a write guarded by that read (a Mount that joined meanwhile keeps it); whether it
/// ended it.
pub async fn end_unheld(
    store: &Store,
    key: &ObjectKey<AllocationSpec>,
    status: ClientStatus,
) -> Result<bool, StoreError> {
    let ended = workload::end_if(store, key, End::Ended(status, None), |a| {
        is_hold(a) && hold_callers(a).next().is_none()
    })
    .await?;
    if ended {
        tracing::debug!(allocation = %key, "a hold without callers ended");
    }
    Ok(ended)
}
