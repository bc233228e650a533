//! Admission of a Pending or Denied claim: the pure verdict of [`admission::check`],
//! then the access-mode rules against the volume's live claims inside one
//! compare-and-swap that records the claim there.

use super::*;

/// A wait while the volume has no plugin id a claim can use yet (`awaits_plugin`: it
/// is being created or validated) says when no node runs that plugin's controller
/// (issue 78, item 2: such a claim waited with no reason while `alloc run` said the
/// volume was being created).
fn why_not_yet(ctx: &Ctx, claim: &Claim, awaits_plugin: bool, verdict: Verdict) -> Verdict {
    let Verdict::Wait(why) = verdict else {
        return verdict;
    };
    let plugin = ctx.plugins.get(&Plugin::key_for(&claim.spec.plugin_id));
    let no_controller = plugin
        .as_ref()
        .is_none_or(|p| p.status.controllers_healthy == 0);
    if awaits_plugin && no_controller {
        return Verdict::Wait(format!(
            "{why}, but no node runs a healthy controller of plugin {} (moorctl plugin status {})",
            claim.spec.plugin_id, claim.spec.plugin_id
        ));
    }
    Verdict::Wait(why)
}

/// Why namespace quotas keep `claim` of `volume` waiting: the volume, or the
/// claim's allocation, not charged by one of them.
fn over_quota(ctx: &Ctx, claim: &Claim, volume: &Volume) -> Option<String> {
    let quotas = ctx.quotas_of(&claim.metadata.namespace);
    if quotas.is_empty() {
        return None;
    }
    let quotas = quotas.iter().map(|q| &**q);
    let vol = quota_wait(
        quotas.clone(),
        Charged::Volume,
        volume.metadata.name.as_str(),
        &volume.metadata.uid,
        0,
    );
    vol.map(|why| format!("volume {}: {why}", volume.metadata.name))
        .or_else(|| {
            let alloc = ctx.allocations.get(&Allocation::key_for(
                &claim.metadata.namespace,
                &claim.spec.allocation,
            ))?;
            quota_wait(
                quotas,
                Charged::Allocation,
                alloc.metadata.name.as_str(),
                &alloc.metadata.uid,
                0,
            )
            .map(|why| format!("allocation {}: {why}", alloc.metadata.name))
        })
}

pub(super) async fn admit(ctx: &Ctx, claim: &Claim) -> Result<Action, StoreError> {
    // Decided on the whole volume (the view keeps it until the volume's first claim;
    // a further claim of a settled volume reads it).
    let key = Volume::key_for(&claim.metadata.namespace, &claim.spec.volume);
    let volume = ctx.whole_volume(&key).await?;
    // Only a volume, and by an allocation, every quota of the namespace charged (the
    // charges are the quota reconciler's: controller/quotas.rs). Said first: a
    // volume a quota keeps from being created waits for that, not for its creation.
    if let Some(why) = volume.as_deref().and_then(|v| over_quota(ctx, claim, v)) {
        return refuse(ctx, claim, Verdict::Wait(why)).await;
    }
    let node = ctx.nodes.get(&Node::key_for(&claim.spec.node));
    let cordon = ctx.cordons.get(&Cordon::key_for(&claim.spec.node));
    let checked = admission::cordoned(cordon.as_deref()).and_then(|()| {
        admission::check(claim, volume.as_deref(), node.as_deref(), || {
            ctx.claims.by_index(BY_NODE, claim.spec.node.as_str())
        })
    });
    let awaits_plugin = volume
        .as_deref()
        .is_some_and(|v| admission::external_id(v).is_none());
    let (admitted, volume) = match (checked, volume) {
        (Ok(a), Some(v)) => (a, v),
        (Err(verdict), _) => {
            return refuse(ctx, claim, why_not_yet(ctx, claim, awaits_plugin, verdict)).await
        }
        (Ok(_), None) => return Ok(Action::AwaitChange),
    };
    // The plugin volume is the volume's own only if its plugin's leader recorded so:
    // what the volume's key says of it is a request.
    let context = match owns(ctx, &volume, &admitted.external_id, claim.spec.mode) {
        Ok(context) => context,
        Err(why) => return refuse(ctx, claim, Verdict::Wait(why)).await,
    };
    // What the node's calls carry, read now (a Secret created later wakes the claim).
    let node_secrets = match volume.node_secrets(|key| ctx.secrets.get(key)) {
        Ok(n) => n,
        Err(missing) => return refuse(ctx, claim, Verdict::Wait(missing.to_string())).await,
    };
    // The access rules, against the volume's live claims, in the same compare-and-swap
    // that records this claim as one of them.
    let me = ClaimRef {
        allocation: claim.spec.allocation.clone(),
        claim: claim.metadata.name.clone(),
        node: claim.spec.node.clone(),
        mode: claim.spec.mode,
        access_mode: Some(admitted.capability.access_mode),
    };
    let mut c = admitted_claim(claim, &volume, &admitted, &node_secrets, context);
    // The next step in the same write: the node let act when the attachment is ready
    // or not needed, else the attachment asked for (created in the admission's own
    // transaction, so an attachment never exists for a claim that was not admitted).
    let (state, todo) = attachment_state(ctx, &c).await?;
    let mut guard = None;
    match state {
        Attach::Wait(why, failing) => {
            c.status.reason = Some(why.into());
            c.status.meta.retry = failing;
        }
        Attach::Revoke(why) => withdraw(&mut c, &why, Some(volume.metadata.generation)),
        Attach::Ready(grant) => {
            grant.apply(&mut c);
            c.status.reason = Some(waiting_for_node(&c).into());
            guard = grant.attachment;
        }
    }
    // The attachment the admission asks for is created in the same transaction.
    let create = match &todo {
        Some(AttachTodo::Create(att)) => Some(&**att),
        _ => None,
    };
    let recorded = with_volume(
        ctx,
        claim,
        |v, st| {
            let live = &mut st.claims;
            let mine = |r: &ClaimRef| r.claim == me.claim && r.allocation == me.allocation;
            if live.read_claims.iter().chain(&live.write_claims).any(mine) {
                return Ok(false);
            }
            // The claim records the generation it was admitted at (what an operator's
            // force detach is compared with): it must be the one admitted against.
            if v.metadata.generation != volume.metadata.generation {
                return Err(Refusal::Stale);
            }
            // The same rules `moorctl alloc plan` places with.
            let ns = &claim.metadata.namespace;
            admission::access_for(v, &admitted, claim, |r| ending(ctx, ns, r))
                .map_err(Refusal::Access)?;
            admission::selinux_for(
                v,
                &admitted,
                claim,
                |r| {
                    ctx.claims
                        .get(&Claim::key_for(&r.node, ns, &r.claim))
                        .map(|c| c.spec.mount_options.selinux_label.clone())
                },
                |r| ending(ctx, ns, r),
            )
            .map_err(Refusal::Access)?;
            match me.mode {
                ClaimMode::Read => live.read_claims.push(me.clone()),
                ClaimMode::Write => live.write_claims.push(me.clone()),
            }
            Ok(true)
        },
        c,
        guard.as_deref(),
        create,
    )
    .await;
    let created = match recorded {
        Ok(VolumeWrite::Written { created }) => created,
        Ok(VolumeWrite::Refused(refusal)) => return refused(ctx, claim, refusal).await,
        Err(StoreError::NotFound { .. }) => {
            let gone = format!("volume {} does not exist", claim.spec.volume);
            return refuse(ctx, claim, Verdict::Deny(gone)).await;
        }
        Err(e) => return Err(e),
    };
    match todo {
        Some(AttachTodo::Create(_)) if created => {}
        Some(AttachTodo::Create(att)) => create_attachment(ctx, &att).await?,
        // Re-planned from the claim as now stored.
        Some(AttachTodo::Replace(_)) => return Ok(Action::Requeue(Duration::ZERO)),
        None => {}
    }
    Ok(Action::AwaitChange)
}

/// The claim as admitted on `volume`: the capability and the plugin's id resolved at
/// admission, the volume context its node calls carry (`context`, as [`owns`] found
/// it), the secrets for the node's calls, the generation and uid admitted against;
/// phase Admitted.
fn admitted_claim(
    claim: &Claim,
    volume: &Volume,
    admitted: &admission::Admitted,
    node_secrets: &NodeSecrets,
    context: StrMap,
) -> Claim {
    let mut c = claim.clone();
    c.spec.access_mode = Some(admitted.capability.access_mode);
    c.spec.attachment_mode = Some(admitted.capability.attachment_mode);
    c.spec.external_id = Some(admitted.external_id.clone());
    c.spec.volume_context = context;
    node_secrets.put_into(&volume.spec, &mut c.spec);
    c.spec.volume_generation = Some(volume.metadata.generation);
    c.spec.volume_uid = Some(volume.metadata.uid.clone());
    c.status.phase = ClaimPhase::Admitted;
    c.status
        .meta
        .set_condition("Admitted", true, "Admitted", "");
    c
}

/// The admission's compare-and-swap refused: denied or waiting by the access rules, or
/// decided on a volume that changed since (decided again on the new one).
async fn refused(ctx: &Ctx, claim: &Claim, refusal: Refusal) -> Result<Action, StoreError> {
    match refusal {
        Refusal::Access(verdict) => refuse(ctx, claim, verdict).await,
        Refusal::Stale => Ok(Action::Requeue(Duration::from_millis(50))),
    }
}

/// Whether `volume` owns its plugin volume `ext` by the record its plugin's leader
/// wrote, and then the volume context its node calls carry ([`node_context`]: never
/// the volume's status, its writer's word). Why the claim waits, when it does not
/// (another namespace's owner unnamed).
fn owns(
    ctx: &Ctx,
    volume: &Volume,
    ext: &ExternalVolumeId,
    mode: ClaimMode,
) -> Result<StrMap, String> {
    let key = Ownership::key_for(&volume.spec.plugin_id, OwnedResource::Volume, ext.as_str());
    match ctx.owners.get(&key) {
        // Its own, or another volume's of the same namespace (a second registration
        // of one plugin volume: whoever writes one of them writes both).
        Some(rec)
            if owned_by(&rec, volume) || rec.spec.owner.namespace == volume.metadata.namespace =>
        {
            Ok(node_context(volume, Some(&rec)))
        }
        // Shared with its namespace (an operator's grant, or two namings kept at the
        // upgrade): for reading only, unless the grant says write.
        Some(rec) => match rec.spec.shared_with(&volume.metadata.namespace) {
            Some(share) if share.write || mode == ClaimMode::Read => {
                Ok(node_context(volume, Some(&rec)))
            }
            Some(_) => Err(
                "the plugin volume it names is shared with this namespace for reading only: claim it read_only"
                    .into(),
            ),
            None => Err(format!(
                "the plugin volume it names is {}: only its owner's claims are admitted",
                owner_for(&rec, &volume.metadata.namespace)
            )),
        },
        // Before the plugin's leader made the records of the volumes older versions
        // made (a rolling upgrade), the volume's word is taken as it was.
        None if ctx
            .owners
            .get(&Ownership::migrated_key(&volume.spec.plugin_id))
            .is_none() =>
        {
            Ok(node_context(volume, None))
        }
        None => Err(format!(
            "waiting for plugin {}'s provisioner to record that this volume owns its plugin volume",
            volume.spec.plugin_id
        )),
    }
}

/// The volume context `volume`'s node calls carry, given the ownership record of its
/// plugin volume (`None`: before its plugin's leader made records, when the volume's
/// word is taken as older versions took it: its declared context, then its status's).
/// A plugin volume moor created carries what CreateVolume answered, from the record
/// (also for a registration of it beside its creator); one only registered carries
/// the registration's declared `spec.context`, which its ValidateVolumeCapabilities
/// carried for the plugin to match against the volume.
fn node_context(volume: &Volume, rec: Option<&Ownership>) -> StrMap {
    let declared = || StrMap::from((*volume.spec.context).clone());
    match rec.map(|r| r.spec.provisioned.as_deref()) {
        Some(Some(made)) => made.volume_context.clone(),
        Some(None) if volume.spec.is_registration() => declared(),
        Some(None) => StrMap::default(),
        None => {
            let mut context = declared();
            context.extend(volume.status.provisioning.volume_context.clone());
            context
        }
    }
}

/// [`admission::holder_ending`] over this controller's caches.
fn ending(ctx: &Ctx, ns: &Namespace, r: &ClaimRef) -> bool {
    let holder = ctx.claims.get(&Claim::key_for(&r.node, ns, &r.claim));
    let alloc = ctx.allocations.get(&Allocation::key_for(ns, &r.allocation));
    admission::holder_ending(holder.as_deref(), alloc.as_deref())
}

/// Why the admission's compare-and-swap did not record the claim.
pub(super) enum Refusal {
    /// An access-mode rule denies it, or makes it wait for a holder's release.
    Access(Verdict),
    /// The volume is not the one the decision was made on.
    Stale,
}

pub(super) async fn refuse(
    ctx: &Ctx,
    claim: &Claim,
    verdict: Verdict,
) -> Result<Action, StoreError> {
    let (phase, reason) = match verdict {
        Verdict::Wait(r) => (ClaimPhase::Pending, r),
        Verdict::Deny(r) => (ClaimPhase::Denied, r),
    };
    let changed = claim.status.phase != phase || claim.status.reason.as_deref() != Some(&reason);
    set_status(ctx, claim, |st| {
        st.phase = phase;
        st.reason = Some(reason.as_str().into());
        st.meta
            .set_condition("Admitted", false, &format!("{phase:?}"), &reason);
    })
    .await?;
    if changed && phase == ClaimPhase::Denied {
        event(
            ctx,
            claim,
            EventType::Warning,
            "Claim denied",
            format!("claim {} denied: {reason}", claim.metadata.name),
        )
        .await;
    }
    Ok(Action::AwaitChange)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_admitted_claim_carries_what_its_node_needs_and_what_it_was_admitted_against() {
        let claim = Claim::new(
            &Namespace::default_ns(),
            Name::new("a1.data").unwrap(),
            ClaimSpec::default(),
        );
        let mut volume = Volume::new(
            &Namespace::default_ns(),
            Name::new("v1").unwrap(),
            VolumeSpec::default(),
        );
        volume.metadata.generation = 7;
        volume.metadata.uid = "vuid".into();
        let mut declared = std::collections::BTreeMap::new();
        declared.insert("a".to_string(), "declared".to_string());
        declared.insert("b".to_string(), "declared".to_string());
        volume.spec.context = declared.into();
        let mut made = StrMap::default();
        made.insert("b".into(), "plugin".into());
        // The status is the word of whoever writes the volume: never carried.
        let mut forged = StrMap::default();
        forged.insert("b".into(), "forged".into());
        forged.insert("c".into(), "forged".into());
        volume.status.provisioning.volume_context = forged;
        let admitted = admission::Admitted {
            capability: VolumeCapability {
                access_mode: AccessMode::MultiNodeReaderOnly,
                attachment_mode: AttachmentMode::BlockDevice,
            },
            external_id: ExternalVolumeId::new("ext-1").unwrap(),
            multi_writer_cap: false,
            selinux_mount: false,
        };
        let secrets = NodeSecrets {
            stage: Some(Arc::new(Secret::new(
                &Namespace::default_ns(),
                Name::new("s").unwrap(),
                SecretSpec {
                    plugin_id: PluginId::new("p").unwrap(),
                    secrets: Secrets::new([("k".to_string(), "s".to_string())].into()),
                },
            ))),
            publish: None,
        };
        let c = admitted_claim(&claim, &volume, &admitted, &secrets, made.clone());
        assert!(
            secrets.carried_by(&volume.spec, &c.spec),
            "the node's secrets as resolved"
        );
        assert_eq!(c.spec.access_mode, Some(AccessMode::MultiNodeReaderOnly));
        assert_eq!(c.spec.attachment_mode, Some(AttachmentMode::BlockDevice));
        assert_eq!(
            c.spec.external_id.as_ref().map(|e| e.as_str()),
            Some("ext-1")
        );
        assert_eq!(c.spec.volume_generation, Some(7));
        assert_eq!(c.spec.volume_uid, Some(Uid::new("vuid")));
        assert_eq!(c.status.phase, ClaimPhase::Admitted);
        // The context given is the one carried, whole.
        assert_eq!(c.spec.volume_context, made);
    }

    #[test]
    fn node_calls_carry_the_plugin_s_context_never_a_requester_s() {
        let map = |pairs: &[(&str, &str)]| -> StrMap {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<std::collections::BTreeMap<_, _>>()
                .into()
        };
        let mut created = Volume::new(
            &Namespace::default_ns(),
            Name::new("v1").unwrap(),
            VolumeSpec::default(),
        );
        created.spec.context = [("path".to_string(), "/declared".to_string())]
            .into_iter()
            .collect::<std::collections::BTreeMap<_, _>>()
            .into();
        created.status.provisioning.volume_context = map(&[("path", "/forged"), ("x", "1")]);
        let ext = ExternalVolumeId::new("ext-1").unwrap();
        let mut rec = Ownership::of_volume(&created, &ext);
        rec.spec.provisioned = Some(Box::new(Provisioned {
            volume_context: map(&[("path", "/made")]),
            ..Default::default()
        }));
        // Created: what CreateVolume answered, from the record; nothing declared or
        // written into the status.
        assert_eq!(
            node_context(&created, Some(&rec)),
            map(&[("path", "/made")])
        );
        // A record without the answer (an earlier build's): nothing rather than a
        // requester's word.
        let mut bare = rec.clone();
        bare.spec.provisioned = None;
        assert_eq!(node_context(&created, Some(&bare)), StrMap::default());
        // A registration of a plugin volume moor created: what CreateVolume answered.
        let mut registered = created.clone();
        registered.spec.external_id = Some(ext);
        assert_eq!(
            node_context(&registered, Some(&rec)),
            map(&[("path", "/made")])
        );
        // A registration of one moor did not create: its declared context, which
        // ValidateVolumeCapabilities carried.
        assert_eq!(
            node_context(&registered, Some(&bare)),
            map(&[("path", "/declared")])
        );
        // Before the plugin's records exist: as older versions did.
        assert_eq!(
            node_context(&created, None),
            map(&[("path", "/forged"), ("x", "1")])
        );
    }
}
