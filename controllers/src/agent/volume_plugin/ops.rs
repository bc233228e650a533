//! What each verb of the volume-plugin protocol does to moor's desired state.
//!
//! A caller (the engine's mount ID, a container's as a rule) gets an Allocation of this
//! node named `<caller's first 12>-<hash of the caller>.<volume>` (labelled with the
//! caller and this node), with one request `data`. It holds the volume until Unmount ends it or
//! the node is lost; it has no runner lease, so an agent restart never ends it.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{json, Map, Value};
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
}

/// A field of a request that must be a string.
fn field<'a>(req: &'a Map<String, Value>, name: &str) -> Result<&'a str, Failure> {
    match req.get(name) {
        Some(Value::String(s)) => Ok(s),
        Some(_) => Err(Failure::bad(format!("{name} is not a string"))),
        None => Err(Failure::bad(format!("{name} is missing"))),
    }
}

/// The volume a request names.
fn volume_name(req: &Map<String, Value>) -> Result<VolumeId, Failure> {
    let name = field(req, "Name")?;
    VolumeId::new(name)
        .map_err(|e| Failure::bad(format!("volume name {}: {e}", moor::api::printable(name))))
}

/// The caller a Mount or Unmount names: its whole ID (1-256 characters of
/// [A-Za-z0-9._-]).
fn caller(req: &Map<String, Value>) -> Result<String, Failure> {
    let id = field(req, "ID")?;
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

impl Endpoint {
    /// The endpoint of this node.
    pub fn new(cfg: Config, store: Store, node: NodeName) -> Endpoint {
        Endpoint {
            cfg,
            store,
            node,
            mounting: Default::default(),
        }
    }

    /// Mount, answered through `reply`, for a caller that may hang up: a Podman client
    /// gives up after 5 s by default, a killed `docker run` at once. The handler of a
    /// caller that hung up is dropped with its connection, so the Mount runs on its own
    /// task and watches `reply`: once the caller is gone (before the answer, or the
    /// answer could not be given) the allocation it made or adopted is ended and a
    /// Warning logged, unless another Mount of the same caller and volume is still
    /// waiting for it. Nobody would ever Unmount it.
    pub async fn mount_for(
        &self,
        req: &Map<String, Value>,
        peer: super::Peer,
        mut reply: tokio::sync::oneshot::Sender<Answer>,
    ) {
        let named = match (volume_name(req), caller(req)) {
            (Ok(id), Ok(caller)) => self
                .allocation_key(&caller, &id)
                .ok()
                .map(|k| (id, caller, k)),
            _ => None,
        };
        // A request mount() refuses at once: nothing to end if its caller left.
        let Some((id, caller, key)) = named else {
            let _ = reply.send(self.mount(req, peer).await);
            return;
        };
        let inflight = key.as_str().to_string();
        *self.lock_mounting().entry(inflight.clone()).or_default() += 1;
        let answered = tokio::select! {
            answer = self.mount(req, peer) => {
                match reply.send(answer) {
                    Ok(()) => true,
                    // Refused: mount() already stopped what it made.
                    Err(Err(_)) => true,
                    Err(Ok(_)) => false,
                }
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
            tracing::warn!(allocation = %inflight, "the caller of a Mount hung up before its answer; another Mount of the same caller waits for its allocation, which stays");
            return;
        }
        let ended = match self.find_allocation(&caller, &id).await {
            Ok((key, Some(a))) if !a.is_terminal() => {
                self.end(&key, ClientStatus::Failed).await;
                true
            }
            _ => false,
        };
        tracing::warn!(volume = %id, caller = %moor::api::printable(&caller), allocation = %inflight, ended, "the caller of a Mount hung up before its answer: nobody will Unmount it, so its allocation is ended");
    }

    fn lock_mounting(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, usize>> {
        self.mounting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs the verb `verb` (the part after `VolumeDriver.`); Mount, which outlives its
    /// connection, is [`Endpoint::mount_for`].
    pub async fn dispatch(&self, verb: &str, req: &Map<String, Value>) -> Answer {
        match verb {
            "Create" => self.create(req).await,
            "Remove" => self.remove(req).await,
            "Unmount" => self.unmount(req).await,
            "Path" => self.path(req).await,
            "Get" => self.get(req).await,
            "List" => self.list().await,
            _ => Err(Failure::bad(format!(
                "no such verb VolumeDriver.{}",
                moor::api::printable(verb)
            ))),
        }
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
    async fn create(&self, req: &Map<String, Value>) -> Answer {
        let id = volume_name(req)?;
        let opts = CreateOptions::parse(req.get("Opts"))?;
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
                access_mode: opts.access_mode(),
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
    async fn remove(&self, req: &Map<String, Value>) -> Answer {
        let id = volume_name(req)?;
        let mut retry = ConflictRetry::default();
        loop {
            let Some(v) = self.volume(&id).await? else {
                return Ok(json!({}));
            };
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
        if let Some(a) = self.store.try_get(&key).await? {
            return Ok((key, Some(a)));
        }
        if let Some(legacy) = self.legacy_allocation_key(caller, id).filter(|l| *l != key) {
            if let Some(a) = self.store.try_get(&legacy).await? {
                if !a.is_terminal() && a.spec.node == self.node {
                    return Ok((legacy, Some(a)));
                }
            }
        }
        Ok((key, None))
    }

    /// Mount: an allocation of this node for the caller (adopted when the same caller
    /// mounts again), then waits until its claim is Published and answers the target
    /// path. A refusal (denied, failed, timed out) stops the allocation it made, so
    /// nothing stays claimed.
    async fn mount(&self, req: &Map<String, Value>, peer: super::Peer) -> Answer {
        let id = volume_name(req)?;
        let caller = caller(req)?;
        let Some(volume) = self.volume(&id).await? else {
            return Err(Failure::bad(format!("no such volume {id}")));
        };
        let cap = volume
            .spec
            .capabilities
            .iter()
            .find(|c| c.attachment_mode == AttachmentMode::FileSystem)
            .copied()
            .ok_or_else(|| Failure::bad(format!("volume {id} offers no file-system capability")))?;
        // Under the name it was found by (an earlier release's, perhaps), else the
        // current one; a live one on this node is adopted, an ended one replaced.
        let (key, _) = self.find_allocation(&caller, &id).await?;
        let wanted = self.wanted(&key, &caller, &id, cap, peer)?;
        let started = workload::create_or_adopt(&self.store, &wanted, IfEnded::Replace, false)
            .await
            .map_err(|e| match e {
                WorkloadError::Store(e) => Failure::from(e),
                other => Failure::internal(other.to_string()),
            })?;
        match self.wait_published(started.allocation()).await {
            Ok(path) => Ok(json!({ "Mountpoint": path })),
            Err(f) => {
                self.end(&key, ClientStatus::Failed).await;
                Err(f)
            }
        }
    }

    /// The allocation a caller's Mount of volume `id` wants: on this node, running,
    /// one request `data` with the capability Mount chose, labelled with its caller.
    fn wanted(
        &self,
        key: &ObjectKey<AllocationSpec>,
        caller: &str,
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
        // A label value holds 63 characters: what `docker volume inspect` shows; the
        // allocation's name hashes the whole ID.
        labels.insert(LABEL_CALLER.into(), caller.chars().take(63).collect());
        if peer.pid.is_none() {
            // The engine runs where this agent cannot see its processes: neither can
            // the forgotten-mount rule see its containers' (orphans.rs keeps it).
            labels.insert(LABEL_UNSEEN.into(), "true".into());
        }
        Ok(alloc)
    }

    /// Waits until the allocation's claim is Published (`moor::workload`, on the
    /// store); its target path. A denied claim is the caller's error; the timeout
    /// says where things stood.
    async fn wait_published(&self, alloc: &Allocation) -> Result<String, Failure> {
        let volume = alloc
            .spec
            .volumes
            .first()
            .map(|r| r.volume.to_string())
            .unwrap_or_default();
        let mut quiet = |line: &str| tracing::debug!(progress = line, "volume-plugin: waiting");
        let pace = Pace {
            poll: poll(),
            progress: &mut quiet,
        };
        match workload::wait_published(
            &self.store,
            &alloc.object_key(),
            self.cfg.mount_timeout,
            pace,
        )
        .await
        {
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

    /// Unmount: the caller's allocation ends (complete); answers once this node no
    /// longer publishes the volume for it. The rest of the release goes on as usual.
    async fn unmount(&self, req: &Map<String, Value>) -> Answer {
        let id = volume_name(req)?;
        let caller = caller(req)?;
        let (key, found) = self.find_allocation(&caller, &id).await?;
        let Some(alloc) = found else {
            return Ok(json!({}));
        };
        self.end(&key, ClientStatus::Complete).await;
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
                    "volume {id} is still published on node {} for {caller}",
                    self.node
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

    async fn path(&self, req: &Map<String, Value>) -> Answer {
        let id = volume_name(req)?;
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
    async fn get(&self, req: &Map<String, Value>) -> Answer {
        let id = volume_name(req)?;
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
                .map(|(a, _)| a
                    .metadata
                    .labels
                    .get(LABEL_CALLER)
                    .cloned()
                    .unwrap_or_default())
                .collect::<Vec<_>>()),
        );
        Ok(json!({
            "Volume": {
                "Name": id.as_str(),
                "Mountpoint": mountpoint,
                "Status": status,
            }
        }))
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
