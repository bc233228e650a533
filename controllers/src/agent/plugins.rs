//! Plugin supervision: probe, fingerprint, and the Node object under the node's lease.
//!
//! Expected flow:
//! 1. Each plugin is probed until ready, then fingerprinted (GetPluginInfo, plugin,
//!    controller and node capabilities, NodeGetInfo) every interval; every second while
//!    unhealthy; at once when a claim of the node shows its ControllerPublish refused
//!    with ResourceExhausted (an attach limit that changed).
//! 2. A plugin that stops answering is marked unhealthy with the reason and keeps what
//!    was last learned of it (it is not forgotten); a health change is an event.
//! 3. The Node object holds every plugin's status. It is created under the node's lease,
//!    re-created under a new lease if the old one is lost, and rewritten when a plugin's
//!    status changes.

use moor::api::*;
use moor::csi::convert;
use moor::csi::v1;
use moor::runtime::backoff::Backoff;
use moor::runtime::events::Recorder;
use moor::runtime::term::Term;
use moor::store::{Store, StoreError};
use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use super::config::PluginConfig;

/// Deadline of each fingerprint call.
const FINGERPRINT_TIMEOUT: Duration = Duration::from_secs(10);

/// The plugins of this node: their channels and what was last learned of them.
#[derive(Clone)]
pub struct Supervisor {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Supervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Supervisor").finish_non_exhaustive()
    }
}

struct Inner {
    channels: BTreeMap<PluginId, Channel>,
    status: RwLock<BTreeMap<PluginId, NodePluginStatus>>,
    changed: watch::Sender<u64>,
    /// The lease term whose Node object is registered (counted from 1), 0 while none is.
    registered: watch::Sender<u64>,
    /// The registration's current term (`node.N/REVISION/agent@N`), held until the last
    /// applied Node write's `sent + TTL - margin` by this agent's clock: past it the
    /// controller may have collected the node, so the agent counts itself unregistered
    /// whatever `registered` says.
    vouched: std::sync::Mutex<Term>,
    /// Per plugin: wakes its fingerprint loop before its interval is up
    /// ([`Supervisor::attach_refused`]).
    refresh: BTreeMap<PluginId, Arc<tokio::sync::Notify>>,
    /// Per plugin: the last refused ControllerPublish that woke it (since, attempts of
    /// the claim's failing step), so one refusal asks once.
    refused: std::sync::Mutex<BTreeMap<PluginId, (Timestamp, u32)>>,
}

/// What the node rules of the contract monitor need: the volumes this node has
/// published (its journal), and the monitor.
#[derive(Clone)]
pub struct Published {
    /// The node's journal.
    pub local: Arc<tokio::sync::Mutex<moor::journal::Journal<super::state::LocalState>>>,
    /// The monitor.
    pub monitor: super::contract::Monitor,
}

impl Published {
    /// The volumes of `plugin` published (or perhaps published) on this node.
    async fn count(&self, plugin: &PluginId) -> usize {
        let local = self.local.lock().await;
        let volumes: std::collections::BTreeSet<_> = local
            .publishes
            .values()
            .filter(|p| &p.plugin_id == plugin && p.steps.owed())
            .map(|p| &p.external_id)
            .collect();
        volumes.len()
    }

    /// Checks NodeGetInfo's answer `next` against `old` (the rules of
    /// [`moor::csi::contract::node_info`]) and reports a breach on the Node.
    async fn check(
        &self,
        plugin: &PluginId,
        node: &ObjectRef,
        old: &NodePluginStatus,
        next: &NodePluginStatus,
    ) {
        let info = |s: &NodePluginStatus| moor::csi::contract::NodeInfo {
            node_id: s
                .csi_node_id
                .as_ref()
                .map(|i| i.to_string())
                .unwrap_or_default(),
            max_volumes: s.max_volumes_per_node.unwrap_or(0),
        };
        let (before, now) = (info(old), info(next));
        if now.node_id.is_empty() {
            return;
        }
        let published = self.count(plugin).await;
        let before = (!before.node_id.is_empty()).then_some(&before);
        let found = moor::csi::contract::node_info(before, &now, published);
        self.monitor.report(plugin, node, found).await;
    }
}

impl Supervisor {
    /// Starts a fingerprint task per plugin and the Node object's keeper in `tasks`.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        store: Store,
        node: NodeName,
        configs: &[PluginConfig],
        recorder: Recorder,
        published: Published,
        interval: Duration,
        node_ttl: Duration,
        tasks: &mut tokio::task::JoinSet<()>,
        shutdown: CancellationToken,
    ) -> Supervisor {
        let mut channels = BTreeMap::new();
        let mut status = BTreeMap::new();
        for cfg in configs {
            // The endpoint was checked to be unix:/// when parsed; channel() only fails
            // on other schemes.
            if let Ok(ch) = moor::csi::channel(&cfg.endpoint) {
                channels.insert(cfg.id.clone(), ch);
            }
            status.insert(
                cfg.id.clone(),
                NodePluginStatus {
                    plugin_type: cfg.plugin_type,
                    health_message: "not probed yet".into(),
                    ..Default::default()
                },
            );
        }
        let (changed, _) = watch::channel(0);
        let (registered, _) = watch::channel(0);
        let refresh = configs
            .iter()
            .map(|c| (c.id.clone(), Arc::default()))
            .collect();
        let sup = Supervisor {
            inner: Arc::new(Inner {
                channels,
                status: RwLock::new(status),
                changed,
                registered,
                vouched: Default::default(),
                refresh,
                refused: Default::default(),
            }),
        };
        for cfg in configs {
            let (sup, cfg, recorder, node, shutdown, published) = (
                sup.clone(),
                cfg.clone(),
                recorder.clone(),
                node.clone(),
                shutdown.clone(),
                published.clone(),
            );
            tasks.spawn(async move {
                sup.fingerprint_loop(cfg, node, recorder, published, interval, shutdown)
                    .await
            });
        }
        let (keeper, shutdown) = (sup.clone(), shutdown.clone());
        tasks.spawn(async move { keeper.keep_node(store, node, node_ttl, shutdown).await });
        sup
    }

    /// Reads a claim of this node: when its attachment's ControllerPublish was refused
    /// with ResourceExhausted (the spec's "max volumes attached"), the plugin is
    /// fingerprinted again at once, so that NodeGetInfo's max_volumes_per_node, if it
    /// changed, reaches the Node and the controller's admission now rather than at
    /// the next `--fingerprint-interval`. Each refusal (the failing step's since and
    /// attempts) asks once.
    pub fn attach_refused(&self, claim: &Claim) {
        let Some(f) = claim.status.meta.retry.as_deref() else {
            return;
        };
        if f.step != "ControllerPublishVolume" || f.code != "ResourceExhausted" {
            return;
        }
        let Some(wake) = self.inner.refresh.get(&claim.spec.plugin_id) else {
            return;
        };
        let this = (f.since, f.attempts);
        {
            let mut refused = self.inner.refused.lock().unwrap_or_else(|p| p.into_inner());
            if refused.get(&claim.spec.plugin_id) == Some(&this) {
                return;
            }
            refused.insert(claim.spec.plugin_id.clone(), this);
        }
        tracing::info!(
            plugin = %claim.spec.plugin_id,
            claim = %claim.metadata.name,
            "ControllerPublish refused with ResourceExhausted: asking NodeGetInfo again"
        );
        wake.notify_one();
    }

    /// The channel to a plugin.
    pub fn channel(&self, id: &PluginId) -> Option<Channel> {
        self.inner.channels.get(id).cloned()
    }

    /// What was last learned of a plugin.
    pub fn status(&self, id: &PluginId) -> Option<NodePluginStatus> {
        self.read().get(id).cloned()
    }

    /// The number of health or fingerprint changes so far: part of every CSI step's
    /// inputs, so a step of a plugin that changed is tried again at once.
    pub fn epoch(&self) -> u64 {
        *self.inner.changed.borrow()
    }

    /// Ticks whenever a plugin's health or fingerprint changes, and when the node
    /// registers again.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.inner.changed.subscribe()
    }

    /// The lease term whose Node object is registered now (1 for the first), 0 while
    /// the node is not registered (its lease was lost, or not yet granted) or cannot
    /// prove it is (no Node write applied within its TTL less the margin, by this
    /// agent's clock: cut off from etcd, or paused).
    pub fn registration(&self) -> u64 {
        if !self.vouched().held() {
            return 0;
        }
        *self.inner.registered.borrow()
    }

    /// The term of registration `n` while it is the current one (held or lapsed), for
    /// the calls of a forward node step taken on grants read in it: they are sent only
    /// while it is held.
    pub fn term(&self, n: u64) -> Option<Term> {
        let registered = *self.inner.registered.borrow();
        (n != 0 && registered == n).then(|| self.vouched())
    }

    fn vouched(&self) -> Term {
        self.inner
            .vouched
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Waits until the node is registered; returns the term (0: shut down first).
    pub async fn registered(&self, shutdown: &CancellationToken) -> u64 {
        let mut rx = self.inner.registered.subscribe();
        tokio::select! {
            _ = shutdown.cancelled() => 0,
            r = rx.wait_for(|t| *t != 0) => r.map(|t| *t).unwrap_or(0),
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<PluginId, NodePluginStatus>> {
        self.inner.status.read().unwrap_or_else(|p| p.into_inner())
    }

    async fn fingerprint_loop(
        &self,
        cfg: PluginConfig,
        node: NodeName,
        recorder: Recorder,
        published: Published,
        interval: Duration,
        shutdown: CancellationToken,
    ) {
        let Some(channel) = self.channel(&cfg.id) else {
            return;
        };
        let wake = self.inner.refresh.get(&cfg.id).cloned().unwrap_or_default();
        loop {
            // What a plugin reports is checked before it is written: a Node the
            // controller would refuse must never be what this agent writes.
            let found = fingerprint(&cfg, channel.clone())
                .await
                .and_then(|fp| match fp.check() {
                    Ok(()) => Ok(fp),
                    Err(e) => Err(format!("the plugin's report is refused: {e}")),
                })
                .map_err(|message| printable_bounded(&message, MAX_PLUGIN_TEXT / 2));
            let (was_healthy, now_healthy, message, answered, storage) = {
                let mut all = self.inner.status.write().unwrap_or_else(|p| p.into_inner());
                let old = all.get(&cfg.id).cloned().unwrap_or_default();
                let mut next = match found {
                    Ok(fp) => fp,
                    Err(message) => NodePluginStatus {
                        healthy: false,
                        health_message: message,
                        last_seen: None,
                        // Keep what was learned: a plugin that goes away is unhealthy,
                        // not forgotten.
                        ..old.clone()
                    },
                };
                next.last_seen = old.last_seen;
                if next.storage_health.is_none()
                    && next.capabilities.node.has(NodeRpc::GetStorageHealth)
                {
                    next.storage_health = old.storage_health.clone();
                }
                let changed = next != old;
                if changed {
                    if next.healthy {
                        next.last_seen = Some(Timestamp::now());
                    }
                    all.insert(cfg.id.clone(), next.clone());
                    self.inner.changed.send_modify(|n| *n += 1);
                }
                // A new answer of a healthy plugin: the monitor's node rules.
                let answered =
                    (changed && next.healthy && cfg.is_node()).then(|| (old.clone(), next.clone()));
                let storage = (old.storage_health != next.storage_health)
                    .then(|| next.storage_health.clone())
                    .map(|now| (old.storage_health.clone(), now));
                (
                    old.healthy,
                    next.healthy,
                    next.health_message.clone(),
                    answered,
                    storage,
                )
            };
            let object = ObjectRef {
                kind: "Node".into(),
                namespace: Namespace::default(),
                name: Name::new(node.as_str()).unwrap_or_default(),
            };
            if let Some((old, next)) = answered {
                published.check(&cfg.id, &object, &old, &next).await;
            }
            if let Some((before, now)) = storage {
                storage_changed(&recorder, &cfg.id, &object, before, now).await;
            }
            if was_healthy != now_healthy {
                let details = crate::common::details([("plugin_id", cfg.id.to_string())]);
                if now_healthy {
                    recorder
                        .record(
                            object,
                            EventType::Normal,
                            "Plugin healthy",
                            format!("plugin {} is healthy", cfg.id),
                            details,
                        )
                        .await;
                } else {
                    recorder
                        .record(
                            object,
                            EventType::Warning,
                            "Plugin unhealthy",
                            format!("plugin {} is unhealthy: {message}", cfg.id),
                            details,
                        )
                        .await;
                }
            }
            let wait = if now_healthy {
                interval
            } else {
                interval.min(Duration::from_secs(1))
            };
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
                _ = wake.notified() => {}
            }
        }
    }

    /// Keeps the node's lease alive and the Node object current, re-creating both when
    /// the lease is lost.
    async fn keep_node(
        &self,
        store: Store,
        node: NodeName,
        ttl: Duration,
        shutdown: CancellationToken,
    ) {
        let mut retry = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
        let mut changes = self.changes();
        let mut term = 0;
        while !shutdown.is_cancelled() {
            term += 1;
            let result = self
                .lease_term(&store, &node, ttl, term, &mut changes, &shutdown)
                .await;
            // Not registered until the next term's Node is: no new node step meanwhile.
            self.vouched().end();
            let registered = self.inner.registered.send_replace(0) == term;
            if let Err(e) = result {
                // A term that got as far as registering starts the backoff over: a blip
                // after hours of failures long past must not keep the node away for the
                // backoff's cap (past --node-gc-timeout, its claims would be released).
                if registered {
                    retry.reset();
                }
                let delay = retry.next_delay();
                tracing::warn!(error = %e, ?delay, "node lease lost or unavailable; re-registering");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        }
    }

    /// One lease: grant, register the Node, renew and rewrite until something fails.
    async fn lease_term(
        &self,
        store: &Store,
        node: &NodeName,
        ttl: Duration,
        term: u64,
        changes: &mut watch::Receiver<u64>,
        shutdown: &CancellationToken,
    ) -> Result<(), StoreError> {
        let lease = store.grant_lease(ttl).await?;
        let mut keep = store.keep_alive(lease).await?;
        let name = Name::new(node.as_str()).unwrap_or_default();
        // A Node left by an earlier run is bound to that run's lease: replace it.
        // A malformed value there (garbage written over it) is this agent's to repair.
        let key = Node::key_for(node);
        match store.delete(&key, None).await {
            Ok(_) | Err(StoreError::NotFound { .. }) => {}
            Err(StoreError::Malformed { revision, .. }) => {
                store.replace_malformed(&key, revision, None).await?;
            }
            Err(e) => return Err(e),
        }
        let mut obj = Node::new(&Namespace::default(), name, NodeSpec {});
        // What the Node is created with counts as seen; a change from here on is
        // written after it.
        changes.borrow_and_update();
        obj.status.plugins = self.read().clone();
        obj.status.liveness = Some(NodeLiveness {
            ttl_ms: ttl.as_millis() as u64,
            renewals: 0,
        });
        let sent = tokio::time::Instant::now();
        let mut current = store.create_with_lease(&obj, keep.id()).await?;
        let vouched = Term::new(format!(
            "node.{node}/{}/agent@{node}",
            current.metadata.resource_version
        ));
        vouched.renewed(sent, ttl);
        *self.inner.vouched.lock().unwrap_or_else(|p| p.into_inner()) = vouched.clone();
        tracing::info!(node = %node, term, "node registered");
        // The node reconciler acts only while registered; a term after the first
        // wakes every claim (it reads each again before acting, see node/mod.rs).
        self.inner.registered.send_replace(term);
        if term > 1 {
            self.inner.changed.send_modify(|n| *n += 1);
        }
        let renew_every = ttl / 3;
        // The lease is renewed on its own schedule: a Node write for a plugin's change
        // never postpones it (a plugin whose health flapped kept restarting the wait,
        // and the lease expired while the agent went on writing: found by the
        // randomized suite, seed 15073).
        let mut next_renew = tokio::time::Instant::now() + renew_every;
        loop {
            let mut next = current.clone();
            let deadline = vouched.deadline().unwrap_or_else(tokio::time::Instant::now);
            // Every wait on etcd ends at the registration's deadline: a request that
            // hangs (a partition drops packets; nothing is refused) must not keep the
            // term alive past it.
            let tick = tokio::time::timeout_at(deadline, async {
                let mut renewed = None;
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(Tick::Stop),
                    _ = tokio::time::sleep_until(next_renew) => {
                        // The lease only collects a dead agent's Node; liveness is the
                        // renewal written to the Node, which only this agent may write.
                        let sent = tokio::time::Instant::now();
                        next_renew = sent + renew_every;
                        keep.renew().await?;
                        renewed = Some(sent);
                        let live = next.status.liveness.get_or_insert_with(Default::default);
                        live.renewals += 1;
                    }
                    r = changes.changed() => {
                        if r.is_err() {
                            return Ok(Tick::Stop);
                        }
                        next.status.plugins = self.read().clone();
                    }
                }
                // Guarded by the version this agent wrote last: a Node removed by the
                // controller (not renewed in time) or overwritten fails here, and the
                // agent registers again in a new term. A wake-up that changed nothing
                // writes nothing.
                if next != current {
                    current = store.update(&current, &next).await?;
                }
                Ok::<_, StoreError>(Tick::Turned { renewed })
            })
            .await;
            match tick {
                Err(_) => {
                    return Err(StoreError::Unavailable(
                        etcd_client::Error::LeaseKeepAliveError(
                            "no Node write was applied within the node TTL (less the margin) by this agent's clock".into(),
                        ),
                    ))
                }
                Ok(Err(e)) => return Err(e),
                Ok(Ok(Tick::Stop)) => return Ok(()),
                // The term lasts as long as the lease: from a renewal (sent before it,
                // and written to the Node after it), never from a change's write.
                Ok(Ok(Tick::Turned {
                    renewed: Some(sent),
                })) => vouched.renewed(sent, ttl),
                Ok(Ok(Tick::Turned { renewed: None })) => {}
            }
        }
    }
}

/// One turn of the registration loop.
enum Tick {
    /// Shutting down.
    Stop,
    /// A turn done (the Node written if it changed); `renewed`: the lease was renewed
    /// and the renewal written, the renewal sent at this instant.
    Turned {
        renewed: Option<tokio::time::Instant>,
    },
}

/// Asks the plugin who it is and what it can do; `Err` says why it is unhealthy.
/// The storage's health as this node sees it changed (NodeGetStorageHealth): the gauge
/// and an event on the Node, `Storage unhealthy` (a Warning) or `Storage healthy`.
async fn storage_changed(
    recorder: &Recorder,
    plugin: &PluginId,
    node: &ObjectRef,
    before: Option<Vec<HealthCondition>>,
    now: Option<Vec<HealthCondition>>,
) {
    moor::runtime::metrics::storage_health(plugin.as_str(), now.as_deref());
    let (Some(before), Some(now)) = (before.or(Some(Vec::new())), now) else {
        return;
    };
    let details = crate::common::details([("plugin_id", plugin.to_string())]);
    let (kind, reason, message) = if now.is_empty() {
        if before.is_empty() {
            return;
        }
        (
            EventType::Normal,
            "Storage healthy",
            format!("plugin {plugin} sees its storage healthy again"),
        )
    } else {
        (
            EventType::Warning,
            "Storage unhealthy",
            format!(
                "plugin {plugin} sees its storage unhealthy: {}",
                HealthCondition::lines(&now)
            ),
        )
    };
    recorder
        .record(node.clone(), kind, reason, message, details)
        .await;
}

async fn fingerprint(cfg: &PluginConfig, channel: Channel) -> Result<NodePluginStatus, String> {
    use moor::csi::policy::request;
    let t = FINGERPRINT_TIMEOUT;
    let fail = |what: &str, s: tonic::Status| format!("{what}: {:?}: {}", s.code(), s.message());
    let mut identity = v1::identity_client::IdentityClient::new(channel.clone());
    let probe = identity
        .probe(request(v1::ProbeRequest {}, t))
        .await
        .map_err(|s| fail("Probe", s))?
        .into_inner();
    if probe.ready == Some(false) {
        return Err("Probe: not ready".into());
    }
    let info = identity
        .get_plugin_info(request(v1::GetPluginInfoRequest {}, t))
        .await
        .map_err(|s| fail("GetPluginInfo", s))?
        .into_inner();
    let caps = identity
        .get_plugin_capabilities(request(v1::GetPluginCapabilitiesRequest {}, t))
        .await
        .map_err(|s| fail("GetPluginCapabilities", s))?
        .into_inner();
    let mut status = NodePluginStatus {
        plugin_type: cfg.plugin_type,
        selinux_mount: cfg.selinux_mount && cfg.is_node(),
        healthy: true,
        provider: info.name,
        version: info.vendor_version,
        ..Default::default()
    };
    status.capabilities.plugin = CapabilitySet::from_names(convert::plugin_capability_names(&caps));
    if cfg.is_controller() {
        let mut c = v1::controller_client::ControllerClient::new(channel.clone());
        let caps = c
            .controller_get_capabilities(request(v1::ControllerGetCapabilitiesRequest {}, t))
            .await
            .map_err(|s| fail("ControllerGetCapabilities", s))?
            .into_inner();
        status.capabilities.controller =
            CapabilitySet::from_names(convert::controller_capability_names(&caps));
        if status.capabilities.plugin.has(PluginCapability::Service(
            PluginService::GroupControllerService,
        )) {
            let mut g = v1::group_controller_client::GroupControllerClient::new(channel.clone());
            let caps = g
                .group_controller_get_capabilities(request(
                    v1::GroupControllerGetCapabilitiesRequest {},
                    t,
                ))
                .await
                .map_err(|s| fail("GroupControllerGetCapabilities", s))?
                .into_inner();
            status.capabilities.group =
                CapabilitySet::from_names(convert::group_capability_names(&caps));
        }
    }
    if cfg.is_node() {
        let mut n = v1::node_client::NodeClient::new(channel);
        let caps = n
            .node_get_capabilities(request(v1::NodeGetCapabilitiesRequest {}, t))
            .await
            .map_err(|s| fail("NodeGetCapabilities", s))?
            .into_inner();
        status.capabilities.node = CapabilitySet::from_names(convert::node_capability_names(&caps));
        let info = n
            .node_get_info(request(v1::NodeGetInfoRequest {}, t))
            .await
            .map_err(|s| fail("NodeGetInfo", s))?
            .into_inner();
        let id = CsiNodeId::new(info.node_id.clone())
            .map_err(|e| format!("NodeGetInfo: node_id {:?}: {e}", info.node_id))?;
        status.csi_node_id = Some(id);
        status.max_volumes_per_node =
            (info.max_volumes_per_node > 0).then_some(info.max_volumes_per_node as u64);
        status.topology = info.accessible_topology.map(|t| t.segments);
        // The storage as this node sees it (CSI 1.13). A failed call leaves it
        // unknown here; the loop keeps what the last answer said.
        if status.capabilities.node.has(NodeRpc::GetStorageHealth) {
            match n
                .node_get_storage_health(request(v1::NodeGetStorageHealthRequest::default(), t))
                .await
            {
                Ok(r) => status.storage_health = Some(convert::storage_health(&r.into_inner())),
                Err(s) => tracing::warn!(
                    plugin = %cfg.id,
                    error = %fail("NodeGetStorageHealth", s),
                    "storage health not read"
                ),
            }
        }
    }
    Ok(status)
}
