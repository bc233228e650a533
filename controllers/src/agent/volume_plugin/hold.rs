//! Mount and Unmount: an engine's hold of a volume on this node.
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

use std::time::Duration;

use serde_json::{json, Value};
use tokio::time::Instant;

use moor::api::*;
use moor::store::{ConflictRetry, Store, StoreError};
use moor::workload::{self, End, IfEnded, Pace, WorkloadError};

use super::ops::{
    caller, poll, volume_name, CallerRequest, Endpoint, Reused, LABEL_CALLER, LABEL_NODE,
    LABEL_UNSEEN, REQUEST,
};
use super::{Answer, Failure};

/// The prefix of the labels recording a hold's callers: the prefix, then 16 hex digits
/// of the SHA-256 of the caller's whole ID; the value is the ID's first 63 characters.
pub const CALLER_PREFIX: &str = "moor.dev/caller.";
/// Set on an engine's hold, valued with the engine.
pub const LABEL_HOLD: &str = moor::api::ENGINE_HOLD_LABEL;
/// The most callers one hold records (labels are bounded); a caller beyond them gets an
/// allocation of its own.
pub const MAX_CALLERS: usize = MAX_LABELS - 8;
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

impl Endpoint {
    /// The allocation of `caller` for volume `id` on this node: [`joined_name`] of
    /// `<the caller's first 12 characters>-<16 hex digits of the SHA-256 of this node,
    /// the engine and the whole caller>` and the volume, as short as a container's short id (the
    /// caller's first 63 characters are a label). The node is in the hash: engines on
    /// two nodes may send the same ID (Podman sends one constant ID for every mount, as
    /// it counts a volume's users itself). The whole ID is hashed: Docker's are 64
    /// characters, and two that shared their first 63 once shared one allocation.
    pub(super) fn allocation_key(
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
    pub(super) fn legacy_allocation_key(
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
    pub(super) async fn find_allocation(
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
    pub(super) fn hold_key(&self, id: &VolumeId) -> Result<ObjectKey<AllocationSpec>, Failure> {
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
    pub(super) async fn mount(
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
    pub(super) async fn take_place(
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
    pub(super) async fn plugin_ready(
        &self,
        id: &VolumeId,
        plugin: &PluginId,
    ) -> Result<(), Failure> {
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
    pub(super) async fn join_hold(
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
        // The hold this Mount makes when none is live, with this caller on it.
        let made = || -> Result<Allocation, Failure> {
            let mut wanted = self.wanted(&key, None, id, cap, peer)?;
            let labels = &mut wanted.metadata.labels;
            labels.insert(label.clone(), short.clone());
            labels.insert(LABEL_HOLD.into(), self.cfg.engine.clone());
            Ok(wanted)
        };
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
                None => match self.store.create(&made()?).await {
                    Ok(_) => return Ok((key, false)),
                    Err(e @ StoreError::AlreadyExists { .. }) => e,
                    Err(e) => return Err(e.into()),
                },
                // Ended, or being deleted: made again.
                _ => {
                    self.start(&made()?).await?;
                    return Ok((key, false));
                }
            };
            if !retry.again().await {
                return Err(raced.into());
            }
        }
    }

    /// Creates `wanted`, or adopts the live one of its name (an ended one is replaced).
    pub(super) async fn start(&self, wanted: &Allocation) -> Result<(), Failure> {
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
    pub(super) fn wanted(
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
    /// not answer for [`super::ops::STORE_PATIENCE`] ends the wait; the timeout says where things
    /// stood.
    pub(super) async fn wait_published(
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
    pub(super) async fn end(&self, key: &ObjectKey<AllocationSpec>, status: ClientStatus) {
        match workload::end(&self.store, key, End::Ended(status, None)).await {
            Ok(_) | Err(StoreError::NotFound { .. }) => {}
            Err(e) => {
                tracing::warn!(allocation = %key, error = %moor::store::bounded_chain(&e), "could not end an endpoint allocation")
            }
        }
    }

    /// Takes `caller` off this engine's hold of `id`; returns whether it was on it and
    /// whether callers remain.
    pub(super) async fn leave_hold(
        &self,
        caller: &str,
        id: &VolumeId,
    ) -> Result<(bool, bool), Failure> {
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
    pub(super) async fn give_up(&self, caller: &str, id: &VolumeId) -> Result<bool, Failure> {
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
    pub(super) async fn unmount(&self, req: &CallerRequest) -> Answer {
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
    pub(super) async fn release_unheld(&self, v: &Volume) -> Result<bool, Failure> {
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
    pub(super) async fn wait_unpublished(
        &self,
        alloc: &Allocation,
        id: &VolumeId,
        caller: &str,
    ) -> Answer {
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
