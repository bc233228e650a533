//! What each verb of the volume-plugin protocol does to moor's desired state: Create,
//! Remove, Path, Get and List here; Mount and Unmount through an engine's hold of the
//! volume ([`super::hold`]).

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::time::Instant;

use moor::api::*;
use moor::store::{ConflictRetry, Store, StoreError};

use super::hold::hold_callers;
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
/// How long the endpoint waits on the store for one answer before it says the store
/// does not answer (shorter than any engine's timeout).
pub const STORE_PATIENCE: Duration = Duration::from_secs(5);
/// The patience instead of [`STORE_PATIENCE`] once a call found the store unavailable,
/// until a call gets an answer from it again: one container start makes several calls
/// (Docker: Get, Create, Mount), and each waiting the whole patience added up to 15 s.
pub const SILENT_PATIENCE: Duration = Duration::from_secs(1);

/// How often a waiting Mount or Unmount reads the claim again: from 5 ms, doubling
/// up to 100 ms (a claim on an idle node is published in tens of milliseconds; a
/// fixed 100 ms made every Mount take at least that).
pub(super) fn poll() -> moor::backoff::Backoff {
    moor::backoff::Backoff::new(Duration::from_millis(5), Duration::from_millis(100))
        .without_jitter()
}

/// The endpoint's state: none of its own beyond its configuration.
pub struct Endpoint {
    pub(super) cfg: Config,
    pub(super) store: Store,
    pub(super) node: NodeName,
    /// Mounts being answered, per allocation key: a caller that hangs up ends its
    /// allocation only when no other Mount of the same key is still waiting (Podman
    /// sends one ID for every mount, and tries again after its timeout).
    pub(super) mounting: std::sync::Mutex<BTreeMap<String, usize>>,
    /// Whether the last call that ended found the store unavailable ([`SILENT_PATIENCE`]).
    pub(super) silent: std::sync::atomic::AtomicBool,
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
pub(super) fn volume_name(name: &str) -> Result<VolumeId, Failure> {
    VolumeId::new(name)
        .map_err(|e| Failure::bad(format!("volume name {}: {e}", moor::api::printable(name))))
}

/// The caller a Mount or Unmount names: its whole ID (1-256 characters of
/// [A-Za-z0-9._-]).
pub(super) fn caller(id: &str) -> Result<String, Failure> {
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
    pub(super) fn patience(&self) -> Duration {
        if self.silent.load(std::sync::atomic::Ordering::Relaxed) {
            SILENT_PATIENCE
        } else {
            STORE_PATIENCE
        }
    }

    /// `f`, given up after the store's patience: the store did not answer.
    pub(super) async fn bounded<T>(
        &self,
        f: impl std::future::Future<Output = Result<T, Failure>>,
    ) -> Result<T, Failure> {
        let patience = self.patience();
        tokio::time::timeout(patience, f)
            .await
            .map_err(|_| Failure::from(StoreError::unanswered(patience)))?
    }

    /// Records whether `answer` found the store unavailable.
    pub(super) fn note<T>(&self, answer: &Result<T, Failure>) {
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

    pub(super) fn lock_mounting(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, usize>> {
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

    pub(super) fn ns(&self) -> &Namespace {
        &self.cfg.namespace
    }

    pub(super) async fn volume(&self, id: &VolumeId) -> Result<Option<Volume>, Failure> {
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
        // The class named, or the default one unless a plugin is named: it fills what
        // the options leave out (moor::api::resolve, as every front door does).
        // A plugin named without a class uses none: no classes are read.
        let classes = if opts.plugin.is_some() && opts.class.is_none() {
            Vec::new()
        } else {
            self.store
                .list::<VolumeClassSpec>(&KeyScope::all())
                .await?
                .items
        };
        let class = pick(&classes, opts.class.as_ref(), opts.plugin.is_some())
            .map_err(|e| Failure::bad(format!("option class: {e}")))?;
        let plugin = match (&opts.plugin, class) {
            (Some(p), _) => p.clone(),
            (None, Some(c)) => c.spec.plugin_id.clone(),
            (None, None) => self.cfg.default_plugin.clone(),
        };
        let capabilities = match (opts.mode, class) {
            (Some(m), _) => vec![capability(m)],
            (None, Some(c)) if !c.spec.capabilities.is_empty() => Vec::new(),
            (None, _) => vec![capability(self.default_mode(&plugin).await?)],
        };
        let mut spec = VolumeSpec {
            plugin_id: plugin.clone(),
            class: class.map(|c| c.metadata.name.clone()),
            capacity_min: opts.size,
            capabilities,
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
        if let Err(e) = resolve(&mut spec, &classes) {
            return Err(Failure::bad(format!("volume {id}: {e}")));
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

    /// The access mode of a volume made without `-o mode=` (nor a class that names its
    /// capabilities): shared by the claims of one
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

/// A file-system capability of `mode` (an engine's volumes are mounted, never block).
fn capability(mode: AccessMode) -> VolumeCapability {
    VolumeCapability {
        access_mode: mode,
        attachment_mode: AttachmentMode::FileSystem,
    }
}
