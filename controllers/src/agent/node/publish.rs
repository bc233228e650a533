//! A claim the controller let onto the node: NodeStage once per staging path (when
//! the plugin stages), then NodePublish to the allocation's target path. Each step is
//! recorded as uncertain before its call and done after it.

use super::*;
use moor::csi::requests::{self, NodeVolume};

/// What one publish pass of a claim works with.
struct Pass<'a> {
    key: &'a str,
    cfg: &'a PluginConfig,
    /// The claim's publish record.
    rec: &'a PublishRecord,
    paths: &'a Paths,
    /// What every node request of the claim carries.
    v: NodeVolume<'a>,
    /// The registration term the grant was read in; forward calls need it to hold.
    term: u64,
}

/// The claim's capability and the volume's external id, which admission filled in.
fn capability_and_id(claim: &Claim) -> Result<(VolumeCapability, ExternalVolumeId), NodeError> {
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
    Ok((cap, external_id))
}

/// A new publish record for the claim: nothing done yet, on its current grant.
fn new_record(
    claim: &Claim,
    plugin: &PluginId,
    external_id: &ExternalVolumeId,
    paths: &Paths,
    stages: bool,
) -> PublishRecord {
    PublishRecord {
        claim_uid: claim.metadata.uid.to_string(),
        namespace: claim.metadata.namespace.clone(),
        claim: claim.metadata.name.clone(),
        allocation: claim.spec.allocation.clone(),
        volume: claim.spec.volume.clone(),
        plugin_id: plugin.clone(),
        external_id: external_id.clone(),
        staging_path: stages.then(|| paths.staging_host.clone()),
        target_path: paths.target_host.clone(),
        steps: Default::default(),
        released: false,
        expanded_bytes: None,
        attachment: claim.spec.attachment.as_ref().map(Uid::to_string),
        publish_context: Some(claim.spec.publish_context.clone()),
        made_for: super::orphans::made_for(claim),
        orphaned: None,
    }
}

/// A granted claim's record on its current grant, and what its pass needs with it.
struct Recorded {
    cfg: PluginConfig,
    /// The plugin's capabilities as last fingerprinted.
    caps: PluginCapabilities,
    /// The claim's capability (as the claim holds it, before `as_sent`).
    cap: VolumeCapability,
    external_id: ExternalVolumeId,
    paths: Paths,
    rec: PublishRecord,
}

impl Reconcile {
    /// The publish pass of a granted claim: the record on the current grant
    /// ([`Reconcile::recorded`]), a staging path of an earlier grant settled
    /// ([`plan::earlier_stage`]), then the actions [`plan::publish_pass`] lists
    /// ([`Reconcile::carry_out`]).
    pub(super) async fn publish(
        &self,
        key: &str,
        claim: &Claim,
        term: u64,
    ) -> Result<(), NodeError> {
        let Recorded {
            cfg,
            caps,
            cap,
            external_id,
            paths,
            rec,
        } = self.recorded(key, claim).await?;
        // The Mount is written once the steps owed are done (or one failed), not
        // before the first call: the journal already records each call's uncertainty,
        // and the controller waits for a Mount that acknowledges a release whether or
        // not one was written before.
        let facts = plan::read(&*self.r.local.lock().await, key, &rec, Some(claim));
        match plan::earlier_stage(&facts) {
            plan::EarlierStage::Stands => {}
            plan::EarlierStage::Unstage => {
                let uid = claim.metadata.uid.to_string();
                self.unstage(&cfg, key, &rec, staging_of(&rec)?, &uid)
                    .await?
            }
            plan::EarlierStage::Wait => {
                let e = NodeError::StagingBusy(path_str(staging_of(&rec)?));
                self.sync_mount(key, claim, Some(moor::process::error_chain(&e)))
                    .await?;
                return Err(e);
            }
        }
        let expansion = plan::Expansion {
            asked: claim.spec.node_expansion_bytes,
            expanded: rec.expanded_bytes,
            node_expands: caps.node.has(NodeRpc::ExpandVolume),
            offline_only: caps.plugin.has(PluginCapability::ExpansionOffline),
            stages: rec.staging_path.is_some(),
        };
        let actions = plan::publish_pass(&facts, &expansion);
        // The controller copies the volume's secrets (or the Secrets it names for the
        // node calls) onto the claim at admission, and again when they change: an
        // agent reads its node's claims only.
        let secrets = claim.spec.node_secrets.expose()?.clone();
        let publish_secrets = match claim.spec.node_publish_secrets.is_empty() {
            true => secrets.clone(),
            false => claim.spec.node_publish_secrets.expose()?.clone(),
        };
        // Sent as what the claims on this node use it as: several claims of a
        // single-node volume share it under SINGLE_NODE_MULTI_WRITER where advertised.
        let multi_writer_cap = caps.node.has(NodeRpc::SingleNodeMultiWriter);
        let capability = convert::node_capability(
            cap.as_sent(multi_writer_cap),
            &claim.spec.mount_options,
            cfg.selinux_mount,
        );
        let pass = Pass {
            key,
            cfg: &cfg,
            rec: &rec,
            paths: &paths,
            v: NodeVolume {
                claim,
                volume_id: &external_id,
                capability: &capability,
                secrets: &secrets,
                publish_secrets: &publish_secrets,
            },
            term,
        };
        self.carry_out(&pass, &actions).await
    }

    /// The claim's record on its current grant, written to the local state before any
    /// step: what an earlier grant left settled first ([`plan::earlier_grant`]), a new
    /// record made when there is none. A record released for good never gets here
    /// ([`plan::Pass::ReleasedForGood`]).
    async fn recorded(&self, key: &str, claim: &Claim) -> Result<Recorded, NodeError> {
        let existing = self.r.local.lock().await.publishes.get(key).cloned();
        let existing = match existing {
            Some(rec) => self.on_current_grant(key, claim, rec).await?,
            None => None,
        };
        let cfg = self.plugin(&claim.spec.plugin_id)?.clone();
        let caps = self
            .r
            .supervisor
            .status(&cfg.id)
            .filter(|s| s.csi_node_id.is_some())
            .ok_or_else(|| NodeError::PluginNotReady(cfg.id.clone()))?
            .capabilities;
        let (cap, external_id) = capability_and_id(claim)?;
        let paths = paths(&cfg, claim, cap);
        let stages = caps.node.has(NodeRpc::StageUnstageVolume);
        // A new claim that makes again what an orphaned mount holds takes it over.
        let existing = match existing {
            Some(rec) => Some(rec),
            None => {
                let staging = stages.then_some(paths.staging_host.as_path());
                self.adopt_elsewhere(key, claim, &paths.target_host, staging)
                    .await?
            }
        };
        let rec = match existing {
            // Already in the journal as it is (this grant's, or adopted from an orphan).
            Some(rec) => rec,
            None => {
                let rec = new_record(claim, &cfg.id, &external_id, &paths, stages);
                // On disk with the first step's record, before its call.
                self.record(|s| {
                    s.publishes.insert(key.to_string(), rec.clone());
                })
                .await?;
                rec
            }
        };
        Ok(Recorded {
            cfg,
            caps,
            cap,
            external_id,
            paths,
            rec,
        })
    }

    /// Carries out a publish pass's actions on the current grant, in order, each in its
    /// own arm: the Mount written and "Mount volume" said once the forward steps are
    /// done, or at the first that failed ([`Reconcile::mount_failed`]).
    async fn carry_out(&self, pass: &Pass<'_>, actions: &[plan::Action]) -> Result<(), NodeError> {
        let (key, claim) = (pass.key, pass.v.claim);
        let mut mounted = false;
        for &action in actions {
            let done = match action {
                plan::Action::Adopt => return self.sync_mount(key, claim, None).await,
                plan::Action::Confirm => match self.declared_gone(claim).await? {
                    Some(why) => return self.sync_mount(key, claim, Some(why)).await,
                    // Nothing forward is done yet: the steps that follow say it.
                    None => Ok(false),
                },
                plan::Action::Stage => self.ensure_staged(pass).await.map(|()| true),
                plan::Action::ExpandStaged(bytes) => self
                    .ensure_expanded(pass, bytes, Expanded::Staged)
                    .await
                    .map(|()| true),
                plan::Action::Publish => self.ensure_published(pass).await.map(|()| true),
                plan::Action::ExpandPublished(bytes) => {
                    let r = self.ensure_expanded(pass, bytes, Expanded::Published).await;
                    return self.after_expansion(key, claim, r).await;
                }
            };
            match done {
                Ok(stepped) => mounted |= stepped,
                Err(e) => return self.mount_failed(key, claim, e).await,
            }
        }
        if mounted {
            self.sync_mount(key, claim, None).await?;
            self.event(claim, "Mount volume", None).await;
        }
        Ok(())
    }

    /// Whether an operator declared this node gone for the claim's volume, read now,
    /// not from a cache: a node that comes back after such a declaration must not act
    /// on a grant made before (no stage, publish or expansion: the volume may be
    /// attached elsewhere by now). Steps asking at once share a read that began after
    /// each asked. `Some`: why the claim's steps are not taken.
    async fn declared_gone(&self, claim: &Claim) -> Result<Option<String>, NodeError> {
        let (store, node) = (&self.r.store, &self.r.node);
        let declarations = self
            .r
            .declarations
            .read(|| async { Ok::<_, StoreError>(store.declarations(node).await?.0) })
            .await?;
        Ok(declarations.covers(claim).then(|| {
            format!(
                "the operator declared node {} gone for volume {} (moorctl volume detach): no step is taken for this claim until it is released",
                self.r.node, claim.spec.volume
            )
        }))
    }

    /// A forward step failed: said on the Mount and as a "Mount volume" Warning, unless
    /// it was recorded when it failed (backing off) or is not the claim's failure (a
    /// lapsed registration, when etcd may be out of reach: the next term wakes it).
    async fn mount_failed(&self, key: &str, claim: &Claim, e: NodeError) -> Result<(), NodeError> {
        if !e.is_quiet() {
            let msg = moor::process::error_chain(&e);
            self.sync_mount(key, claim, Some(msg.clone())).await?;
            self.event(claim, "Mount volume", Some(msg)).await;
        }
        Err(e)
    }

    /// NodeExpandVolume of the volume (at its staging path or its target path) to
    /// `bytes`; the capacity is recorded in the claim's publish record (and so on its
    /// Mount).
    async fn ensure_expanded(
        &self,
        pass: &Pass<'_>,
        bytes: u64,
        at: Expanded,
    ) -> Result<(), NodeError> {
        let (key, claim, rec) = (pass.key, pass.v.claim, pass.rec);
        let staging = rec
            .staging_path
            .as_ref()
            .map(|s| path_str(&plugin_path(pass.cfg, s)));
        let volume_path = match at {
            Expanded::Staged => path_str(&plugin_path(pass.cfg, staging_of(rec)?)),
            Expanded::Published => path_str(&pass.paths.target_plugin),
        };
        let inputs = self.inputs(&claim.metadata.uid.to_string(), claim.metadata.generation);
        let step = self.begin(key, plan::EXPAND, inputs)?;
        // The volume as the record names it (the one staged and published).
        let v = NodeVolume {
            volume_id: &rec.external_id,
            ..pass.v
        };
        let req = requests::node_expand(&v, &volume_path, staging.as_deref(), bytes);
        let csi = self
            .forward_csi(pass.cfg, pass.term)?
            .about(crate::common::object_ref(claim));
        let resp = step.call(csi.node_expand(req)).await?;
        let got = if resp.capacity_bytes > 0 {
            resp.capacity_bytes as u64
        } else {
            bytes
        };
        self.record(|s| {
            if let Some(p) = s.publishes.get_mut(key) {
                p.expanded_bytes = Some(got);
            }
        })
        .await
    }

    /// Mirrors an online expansion's outcome on the Mount, with an event.
    async fn after_expansion(
        &self,
        key: &str,
        claim: &Claim,
        r: Result<(), NodeError>,
    ) -> Result<(), NodeError> {
        match r {
            Ok(()) => {
                self.sync_mount(key, claim, None).await?;
                let msg = format!(
                    "{} expanded on the node for claim {}",
                    claim.spec.volume, claim.metadata.name
                );
                self.node_event(
                    claim_ref(&claim.metadata.namespace, &claim.metadata.name),
                    &claim.spec.volume,
                    "Expand volume",
                    EventType::Normal,
                    msg,
                    None,
                )
                .await;
                Ok(())
            }
            Err(e) if e.is_quiet() => Err(e),
            Err(e) => {
                let msg = moor::process::error_chain(&e);
                self.sync_mount(key, claim, Some(msg.clone())).await?;
                let text = format!(
                    "{} could not be expanded on the node for claim {}: {msg}",
                    claim.spec.volume, claim.metadata.name
                );
                self.node_event(
                    claim_ref(&claim.metadata.namespace, &claim.metadata.name),
                    &claim.spec.volume,
                    "Expand volume",
                    EventType::Warning,
                    text,
                    Some(msg),
                )
                .await;
                Err(e)
            }
        }
    }

    /// NodeStageVolume to the record's staging path, recorded in the staging path's
    /// record (shared by the claims staged there).
    async fn ensure_staged(&self, pass: &Pass<'_>) -> Result<(), NodeError> {
        let (cfg, key, v) = (pass.cfg, pass.key, &pass.v);
        let claim = v.claim;
        let staging = staging_of(pass.rec)?;
        std::fs::create_dir_all(staging).map_err(|source| NodeError::Io {
            path: path_str(staging),
            source,
        })?;
        let made = StageRecord {
            namespace: claim.metadata.namespace.clone(),
            volume: claim.spec.volume.clone(),
            plugin_id: cfg.id.clone(),
            external_id: v.volume_id.clone(),
            step: Step::Uncertain,
            attachment: claim.spec.attachment.as_ref().map(Uid::to_string),
            publish_context: Some(claim.spec.publish_context.clone()),
        };
        let req = requests::node_stage(v, &path_str(&plugin_path(cfg, staging)));
        let csi = self.forward_csi(cfg, pass.term)?;
        let inputs = self.inputs(&claim.metadata.uid.to_string(), claim.metadata.generation);
        let scope = Scope::Staging(staging, &made);
        self.checkpointed(key, plan::STAGE, inputs, scope, csi.node_stage(req))
            .await
            .map(|_| ())
    }

    /// The claim's publish record if it stands on the claim's current grant; if it was
    /// made under a grant since withdrawn ([`plan::Earlier`]), what it did is
    /// torn down and the record forgotten first (`None`: start from nothing).
    async fn on_current_grant(
        &self,
        key: &str,
        claim: &Claim,
        rec: PublishRecord,
    ) -> Result<Option<PublishRecord>, NodeError> {
        let facts = plan::read(&*self.r.local.lock().await, key, &rec, Some(claim));
        match plan::earlier_grant(&facts) {
            plan::Earlier::Stands => return Ok(Some(rec)),
            plan::Earlier::TearDown => {
                tracing::info!(claim = %key, "tearing down what was done under a withdrawn grant");
                self.teardown(key, &rec).await?;
            }
            plan::Earlier::Forget => {}
        }
        self.forget(key).await?;
        Ok(None)
    }

    async fn ensure_published(&self, pass: &Pass<'_>) -> Result<(), NodeError> {
        let (cfg, key, v, rec, paths) = (pass.cfg, pass.key, &pass.v, pass.rec, pass.paths);
        let claim = v.claim;
        if let Some(parent) = paths.target_host.parent() {
            std::fs::create_dir_all(parent).map_err(|source| NodeError::Io {
                path: path_str(parent),
                source,
            })?;
        }
        let staging = rec
            .staging_path
            .as_ref()
            .map(|s| path_str(&plugin_path(cfg, s)));
        let req = requests::node_publish(v, staging.as_deref(), &path_str(&paths.target_plugin));
        let csi = self.forward_csi(cfg, pass.term)?;
        let inputs = self.inputs(&claim.metadata.uid.to_string(), claim.metadata.generation);
        let call = csi.node_publish(req);
        self.checkpointed(key, plan::PUBLISH, inputs, Scope::Claim, call)
            .await
            .map(|_| ())
    }
}

/// Where NodeExpandVolume finds the volume.
#[derive(Clone, Copy)]
enum Expanded {
    /// At its staging path, before NodePublish (offline).
    Staged,
    /// At the claim's target path (online).
    Published,
}
