//! Admission: may a claim use its volume on its node? Pure rules over the objects the
//! controller caches, so every rule is unit-tested here. The controller admits with
//! them and `moorctl alloc plan` answers placement questions with them: one copy.
//!
//! Checked in order: the node is not cordoned ([`cordoned`], asked separately); the
//! volume exists and is not being deleted; it admits new claims (its availability is
//! `active`: paused or drained, the claim waits); it has been created
//! (else the claim waits); the claim's capability (its own modes, or the volume's first
//! for a claim made before per-claim modes existed) is one the volume offers, and allows
//! writing if the claim writes; the plugin is registered on the node, advertises what the
//! claim needs there (VOLUME_MOUNT_GROUP for a mount group, SINGLE_NODE_MULTI_WRITER for
//! the two newer single-node modes) and is healthy; the
//! node's max volumes for the plugin; the volume's accessible topology reaches the node.
//! The access-mode rules across every node ([`access()`]) are checked last, against the
//! volume's live claims, inside the compare-and-swap that records the claim on the volume.
//!
//! # Layout
//! - `access`: the access-mode and SELinux rules across every node, against the
//!   volume's live claims, and whether a holder is ending.
//! - `placement`: where a claim could go (the plugin on the node, room under its max,
//!   topology) and `plan`, every request of an allocation judged at once.
//! - `templates`: a request's volume made from a template (`made`).

use crate::api::*;

mod access;
mod placement;
mod templates;

pub use access::{access, access_for, holder_ending, selinux_for, AccessDenied};
pub use placement::{placement, plan, RequestFit};
pub use templates::{made, Made};

/// Why a claim is not admitted now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Not yet decidable (the volume is being created, the node not registered yet).
    Wait(String),
    /// Refused by a rule; re-checked when what it depends on changes.
    Deny(String),
}

/// What an admitted claim uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    /// The resolved capability.
    pub capability: VolumeCapability,
    /// The plugin's id of the volume.
    pub external_id: ExternalVolumeId,
    /// Whether the plugin on the claim's node advertises SINGLE_NODE_MULTI_WRITER:
    /// whether a single-node volume may be published there at several target paths
    /// ([`AccessMode::admit`]).
    pub multi_writer_cap: bool,
    /// Whether the agent sends SELinux labels to the plugin on the claim's node
    /// (`selinux-mount=true`): then a volume's claims on that node carry one label
    /// ([`selinux_for`]).
    pub selinux_mount: bool,
}

/// The external id a claim may use: a created volume's once created, a registered
/// volume's once the plugin validated it.
pub fn external_id(volume: &Volume) -> Option<ExternalVolumeId> {
    let p = &volume.status.provisioning;
    match &volume.spec.external_id {
        // A registered volume is claimable once the plugin validated that id.
        Some(ext) => (p.phase == VolumePhase::Ready && p.external_id.as_ref() == Some(ext))
            .then(|| ext.clone()),
        None => p.external_id.clone(),
    }
}

/// Checks every rule but the access modes across nodes, in order: the volume, the
/// capability asked of it, the node's plugin, what the claim asks of that plugin, room
/// on the node, topology. `node_claims` (the claims on the claim's node) is asked for
/// only when the plugin limits volumes per node: a node can hold thousands, and
/// collecting them per admission made a burst quadratic.
pub fn check<I>(
    claim: &Claim,
    volume: Option<&Volume>,
    node: Option<&Node>,
    node_claims: impl FnOnce() -> I,
) -> Result<Admitted, Verdict>
where
    I: IntoIterator,
    I::Item: std::ops::Deref<Target = Claim>,
{
    let spec = &claim.spec;
    let (volume, external_id) = claimable(spec, volume)?;
    let capability = capability_asked(spec, volume)?;
    let plugin = plugin_on(spec, node)?;
    serves(spec, plugin, &capability)?;
    room(
        plugin,
        &claim.metadata.namespace,
        spec,
        &claim.metadata.uid,
        node_claims,
    )?;
    reachable(spec, volume, plugin)?;
    Ok(Admitted {
        capability,
        external_id,
        multi_writer_cap: plugin.capabilities.node.has(NodeRpc::SingleNodeMultiWriter),
        selinux_mount: plugin.selinux_mount,
    })
}

/// The volume as a claim can take it: existing, not being deleted, active, of the
/// claim's plugin, not failed, and with the id a claim uses.
fn claimable<'v>(
    spec: &ClaimSpec,
    volume: Option<&'v Volume>,
) -> Result<(&'v Volume, ExternalVolumeId), Verdict> {
    let Some(volume) = volume else {
        return Err(Verdict::Deny(format!(
            "volume {} does not exist",
            spec.volume
        )));
    };
    if volume.is_deleting() {
        return Err(Verdict::Deny(format!(
            "volume {} is being deleted",
            spec.volume
        )));
    }
    match volume.spec.availability {
        Availability::Active => {}
        a => {
            let what = if a == Availability::Pause {
                "paused"
            } else {
                "drained"
            };
            return Err(Verdict::Wait(format!(
                "volume {} is {what}: it admits no new claim until `moorctl volume activate`",
                spec.volume
            )));
        }
    }
    if volume.spec.plugin_id != spec.plugin_id {
        return Err(Verdict::Deny(format!(
            "volume {} belongs to plugin {}, not {}",
            spec.volume, volume.spec.plugin_id, spec.plugin_id
        )));
    }
    if volume.status.provisioning.phase == VolumePhase::Failed {
        return Err(Verdict::Deny(format!(
            "volume {} failed: {}",
            spec.volume,
            volume
                .status
                .provisioning
                .meta
                .last_error
                .as_deref()
                .unwrap_or("see its status")
        )));
    }
    let Some(external_id) = external_id(volume) else {
        let doing = if volume.spec.is_registration() {
            "validated by its plugin"
        } else {
            "created"
        };
        return Err(Verdict::Wait(format!(
            "volume {} is being {doing}",
            spec.volume
        )));
    };
    Ok((volume, external_id))
}

/// The capability the claim asks of the volume: one it offers, writable if the claim
/// writes.
fn capability_asked(spec: &ClaimSpec, volume: &Volume) -> Result<VolumeCapability, Verdict> {
    let Some(capability) = spec.capability(&volume.spec) else {
        return Err(Verdict::Deny(format!(
            "volume {} offers no capability",
            spec.volume
        )));
    };
    if !volume.spec.offers(&capability) {
        return Err(Verdict::Deny(format!(
            "volume {} does not offer {} / {}",
            spec.volume, capability.access_mode, capability.attachment_mode
        )));
    }
    if spec.mode == ClaimMode::Write && !capability.access_mode.allows_write() {
        return Err(Verdict::Deny(
            ClaimDenied::ReadOnlyMode(capability.access_mode).to_string(),
        ));
    }
    Ok(capability)
}

/// The claim's plugin on its node: the node registered, the plugin running there as a
/// node plugin.
fn plugin_on<'n>(
    spec: &ClaimSpec,
    node: Option<&'n Node>,
) -> Result<&'n NodePluginStatus, Verdict> {
    let Some(node) = node else {
        return Err(Verdict::Wait(format!(
            "node {} is not registered",
            spec.node
        )));
    };
    let Some(plugin) = node.status.plugins.get(&spec.plugin_id) else {
        return Err(Verdict::Deny(format!(
            "plugin {} is not running on node {}",
            spec.plugin_id, spec.node
        )));
    };
    if plugin.plugin_type == PluginType::Controller {
        return Err(Verdict::Deny(format!(
            "plugin {} runs only as a controller on node {}",
            spec.plugin_id, spec.node
        )));
    }
    Ok(plugin)
}

/// Whether the node's plugin can do what the claim asks (its mount group, SELinux
/// label, single-node-multi-writer), and is healthy.
fn serves(
    spec: &ClaimSpec,
    plugin: &NodePluginStatus,
    capability: &VolumeCapability,
) -> Result<(), Verdict> {
    if let Some(group) = &spec.mount_options.mount_group {
        if capability.attachment_mode == AttachmentMode::BlockDevice {
            return Err(Verdict::Deny(format!(
                "mount_group {group} applies to file-system volumes, not block devices"
            )));
        }
        if !plugin.capabilities.node.has(NodeRpc::VolumeMountGroup) {
            return Err(Verdict::Deny(format!(
                "plugin {} on node {} does not advertise VOLUME_MOUNT_GROUP: mount_group {group} \
                 cannot be honoured",
                spec.plugin_id, spec.node
            )));
        }
    }
    if let Some(label) = &spec.mount_options.selinux_label {
        if capability.attachment_mode == AttachmentMode::BlockDevice {
            return Err(Verdict::Deny(format!(
                "selinux_label {label} applies to file-system volumes, not block devices"
            )));
        }
    }
    if capability.access_mode.needs_single_node_multi_writer()
        && !plugin.capabilities.node.has(NodeRpc::SingleNodeMultiWriter)
    {
        return Err(Verdict::Deny(format!(
            "plugin {} on node {} does not advertise SINGLE_NODE_MULTI_WRITER: access mode {} \
             cannot be used",
            spec.plugin_id, spec.node, capability.access_mode
        )));
    }
    if !plugin.healthy {
        return Err(Verdict::Deny(format!(
            "plugin {} is unhealthy on node {}: {}",
            spec.plugin_id, spec.node, plugin.health_message
        )));
    }
    Ok(())
}

/// Whether the volume is accessible from the node's topology segment (any volume
/// without an accessible topology is).
fn reachable(spec: &ClaimSpec, volume: &Volume, plugin: &NodePluginStatus) -> Result<(), Verdict> {
    let reachable = &volume.status.provisioning.accessible_topology;
    if reachable.is_empty() {
        return Ok(());
    }
    let here = plugin.topology.clone().unwrap_or_default();
    let fits = reachable
        .iter()
        .any(|seg| seg.iter().all(|(k, v)| here.get(k) == Some(v)));
    if !fits {
        return Err(Verdict::Deny(format!(
            "volume {} is not accessible from node {} (topology {:?})",
            spec.volume, spec.node, here
        )));
    }
    Ok(())
}

/// Whether a node takes new claims: not while an operator cordoned it (the claim
/// waits, with the cordon's reason, and is admitted after `moorctl node uncordon`).
pub fn cordoned(cordon: Option<&Cordon>) -> Result<(), Verdict> {
    match cordon {
        Some(c) => Err(Verdict::Wait(c.why())),
        None => Ok(()),
    }
}

/// Whether node `spec.node` has room for one more volume of plugin `plugin` (its
/// NodeGetInfo max volumes) beside the live claims there (`node_claims`, asked for only
/// when there is a limit), not counting the claim with uid `uid` or other claims of the
/// same volume (`spec.volume` in namespace `ns`).
fn room<I>(
    plugin: &NodePluginStatus,
    ns: &Namespace,
    spec: &ClaimSpec,
    uid: &Uid,
    node_claims: impl FnOnce() -> I,
) -> Result<(), Verdict>
where
    I: IntoIterator,
    I::Item: std::ops::Deref<Target = Claim>,
{
    if let Some(max) = plugin.max_volumes_per_node {
        let mut in_use: Vec<(Namespace, VolumeId)> = node_claims()
            .into_iter()
            .filter(|c| {
                c.metadata.uid != *uid
                    && c.spec.plugin_id == spec.plugin_id
                    && c.status.phase.is_live()
                    && !(&c.metadata.namespace == ns && c.spec.volume == spec.volume)
            })
            .map(|c| (c.metadata.namespace.clone(), c.spec.volume.clone()))
            .collect();
        in_use.sort();
        in_use.dedup();
        if in_use.len() as u64 >= max {
            return Err(Verdict::Deny(format!(
                "node {} already uses {} volumes of plugin {} (max {max})",
                spec.node,
                in_use.len(),
                spec.plugin_id
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cap(access_mode: AccessMode) -> VolumeCapability {
        VolumeCapability {
            access_mode,
            attachment_mode: AttachmentMode::FileSystem,
        }
    }

    fn volume(modes: &[AccessMode]) -> Volume {
        let mut v = Volume::new(
            &Namespace::default_ns(),
            Name::new("v").unwrap(),
            VolumeSpec {
                plugin_id: PluginId::new("p").unwrap(),
                external_id: Some(ExternalVolumeId::new("ext-v").unwrap()),
                capabilities: modes.iter().map(|m| cap(*m)).collect(),
                ..Default::default()
            },
        );
        v.metadata.uid = "uv".into();
        // Validated by the plugin.
        v.status.provisioning.phase = VolumePhase::Ready;
        v.status.provisioning.external_id = v.spec.external_id.clone();
        v
    }

    fn claim(name: &str, node: &str, mode: ClaimMode, access: Option<AccessMode>) -> Claim {
        let mut c = Claim::new(
            &Namespace::default_ns(),
            Name::new(name).unwrap(),
            ClaimSpec {
                allocation: AllocationId::new("a").unwrap(),
                request: Name::new("r").unwrap(),
                volume: VolumeId::new("v").unwrap(),
                node: NodeName::new(node).unwrap(),
                plugin_id: PluginId::new("p").unwrap(),
                mode,
                access_mode: access,
                ..Default::default()
            },
        );
        c.metadata.uid = format!("u-{name}").into();
        c
    }

    fn node(healthy: bool) -> Node {
        let mut n = Node::new(&Namespace::default(), Name::new("n1").unwrap(), NodeSpec {});
        n.status.plugins.insert(
            PluginId::new("p").unwrap(),
            NodePluginStatus {
                plugin_type: PluginType::Node,
                healthy,
                health_message: if healthy { "" } else { "probe failed" }.into(),
                csi_node_id: Some(CsiNodeId::new("csi-n1").unwrap()),
                ..Default::default()
            },
        );
        n
    }

    fn denied(r: Result<Admitted, Verdict>) -> String {
        match r {
            Err(Verdict::Deny(s)) => s,
            other => panic!("expected a denial, got {other:?}"),
        }
    }

    #[test]
    fn an_old_claim_without_modes_uses_the_volume_s_first_capability() {
        let v = volume(&[
            AccessMode::MultiNodeReaderOnly,
            AccessMode::SingleNodeWriter,
        ]);
        let c = claim("c", "n1", ClaimMode::Read, None);
        let a = check(&c, Some(&v), Some(&node(true)), Vec::<&Claim>::new).unwrap();
        assert_eq!(a.capability, cap(AccessMode::MultiNodeReaderOnly));
        assert_eq!(a.external_id.as_str(), "ext-v");
    }

    #[test]
    fn a_paused_or_drained_volume_and_a_cordoned_node_make_the_claim_wait() {
        let mut v = volume(&[AccessMode::SingleNodeWriter]);
        let c = claim("c", "n1", ClaimMode::Write, None);
        for (a, says) in [
            (Availability::Pause, "paused"),
            (Availability::Drain, "drained"),
        ] {
            v.spec.availability = a;
            match check(&c, Some(&v), Some(&node(true)), Vec::<&Claim>::new) {
                Err(Verdict::Wait(w)) => assert!(w.contains(says), "{w}"),
                other => panic!("{a}: {other:?}"),
            }
        }
        v.spec.availability = Availability::Active;
        assert!(check(&c, Some(&v), Some(&node(true)), Vec::<&Claim>::new).is_ok());
        let cordon = Cordon::new(
            &Namespace::default(),
            Name::new("n1").unwrap(),
            CordonSpec {
                reason: "maintenance".into(),
                drain: false,
            },
        );
        assert_eq!(
            cordoned(Some(&cordon)),
            Err(Verdict::Wait("node n1 is cordoned: maintenance".into()))
        );
        assert_eq!(cordoned(None), Ok(()));
    }

    #[test]
    fn the_capability_must_be_offered_and_allow_the_claim_s_mode() {
        let v = volume(&[AccessMode::MultiNodeReaderOnly]);
        let c = claim(
            "c",
            "n1",
            ClaimMode::Read,
            Some(AccessMode::SingleNodeWriter),
        );
        assert!(
            denied(check(&c, Some(&v), Some(&node(true)), Vec::<&Claim>::new))
                .contains("does not offer")
        );
        let c = claim("c", "n1", ClaimMode::Write, None);
        assert!(
            denied(check(&c, Some(&v), Some(&node(true)), Vec::<&Claim>::new))
                .contains("read-only")
        );
    }

    #[test]
    fn a_volume_being_created_waits_and_a_missing_one_is_denied() {
        let mut v = volume(&[AccessMode::SingleNodeWriter]);
        v.spec.external_id = None;
        v.status.provisioning = Default::default();
        let c = claim("c", "n1", ClaimMode::Write, None);
        assert!(matches!(
            check(&c, Some(&v), Some(&node(true)), Vec::<&Claim>::new),
            Err(Verdict::Wait(_))
        ));
        v.status.provisioning.external_id = Some(ExternalVolumeId::new("made").unwrap());
        assert!(check(&c, Some(&v), Some(&node(true)), Vec::<&Claim>::new).is_ok());
        assert!(
            denied(check(&c, None, Some(&node(true)), Vec::<&Claim>::new))
                .contains("does not exist")
        );
    }

    #[test]
    fn a_registered_volume_waits_for_its_validation_and_a_failed_one_is_denied() {
        let mut v = volume(&[AccessMode::SingleNodeWriter]);
        let c = claim("c", "n1", ClaimMode::Write, None);
        assert!(check(&c, Some(&v), Some(&node(true)), Vec::<&Claim>::new).is_ok());
        v.status.provisioning.phase = VolumePhase::Pending;
        match check(&c, Some(&v), Some(&node(true)), Vec::<&Claim>::new) {
            Err(Verdict::Wait(why)) => assert!(why.contains("validated"), "{why}"),
            other => panic!("{other:?}"),
        }
        v.status.provisioning.phase = VolumePhase::Failed;
        v.status.provisioning.meta.last_error = Some("volume ext-v not found".into());
        assert!(
            denied(check(&c, Some(&v), Some(&node(true)), Vec::<&Claim>::new))
                .contains("ext-v not found")
        );
    }

    #[test]
    fn a_mount_group_needs_volume_mount_group_on_the_node() {
        let v = volume(&[AccessMode::SingleNodeWriter]);
        let mut c = claim("c", "n1", ClaimMode::Write, None);
        c.spec.mount_options.mount_group = Some("1234".into());
        let mut n = node(true);
        assert!(denied(check(&c, Some(&v), Some(&n), Vec::<&Claim>::new))
            .contains("VOLUME_MOUNT_GROUP"));
        n.status.plugins.values_mut().for_each(|p| {
            p.capabilities.node.insert(NodeRpc::VolumeMountGroup);
        });
        assert!(check(&c, Some(&v), Some(&n), Vec::<&Claim>::new).is_ok());
        c.spec.attachment_mode = Some(AttachmentMode::BlockDevice);
        let mut vb = volume(&[AccessMode::SingleNodeWriter]);
        vb.spec.capabilities[0].attachment_mode = AttachmentMode::BlockDevice;
        assert!(denied(check(&c, Some(&vb), Some(&n), Vec::<&Claim>::new)).contains("block"));
    }

    #[test]
    fn the_newer_single_node_modes_need_single_node_multi_writer_on_the_node() {
        for mode in [
            AccessMode::SingleNodeSingleWriter,
            AccessMode::SingleNodeMultiWriter,
        ] {
            let v = volume(&[mode]);
            let c = claim("c", "n1", ClaimMode::Write, None);
            let mut n = node(true);
            let why = denied(check(&c, Some(&v), Some(&n), Vec::<&Claim>::new));
            assert!(why.contains("SINGLE_NODE_MULTI_WRITER"), "{why}");
            n.status.plugins.values_mut().for_each(|p| {
                p.capabilities.node.insert(NodeRpc::SingleNodeMultiWriter);
            });
            let a = check(&c, Some(&v), Some(&n), Vec::<&Claim>::new).unwrap();
            assert_eq!(a.capability.access_mode, mode);
        }
        // The older modes do not ask for it.
        let v = volume(&[AccessMode::SingleNodeWriter]);
        let c = claim("c", "n1", ClaimMode::Write, None);
        assert!(check(&c, Some(&v), Some(&node(true)), Vec::<&Claim>::new).is_ok());
    }

    #[test]
    fn the_plugin_must_be_healthy_on_the_node() {
        let v = volume(&[AccessMode::SingleNodeWriter]);
        let c = claim("c", "n1", ClaimMode::Write, None);
        assert!(
            denied(check(&c, Some(&v), Some(&node(false)), Vec::<&Claim>::new))
                .contains("unhealthy")
        );
        let mut other = node(true);
        other.status.plugins.clear();
        assert!(
            denied(check(&c, Some(&v), Some(&other), Vec::<&Claim>::new)).contains("not running")
        );
        assert!(matches!(
            check(&c, Some(&v), None, Vec::<&Claim>::new),
            Err(Verdict::Wait(_))
        ));
    }

    #[test]
    fn max_volumes_per_node_counts_other_live_volumes() {
        let v = volume(&[AccessMode::SingleNodeWriter]);
        let mut n = node(true);
        n.status
            .plugins
            .values_mut()
            .for_each(|p| p.max_volumes_per_node = Some(1));
        let mut held = claim("h", "n1", ClaimMode::Write, None);
        held.spec.volume = VolumeId::new("other").unwrap();
        held.status.phase = ClaimPhase::Published;
        let c = claim("c", "n1", ClaimMode::Write, None);
        assert!(denied(check(&c, Some(&v), Some(&n), || [&held])).contains("max 1"));
        held.status.phase = ClaimPhase::Released;
        assert!(check(&c, Some(&v), Some(&n), || [&held]).is_ok());
        // A second claim of the same volume does not count twice.
        let mut same = claim("s", "n1", ClaimMode::Read, None);
        same.status.phase = ClaimPhase::Published;
        assert!(check(&c, Some(&v), Some(&n), || [&same]).is_ok());
    }

    #[test]
    fn topology_must_reach_the_node() {
        let mut v = volume(&[AccessMode::SingleNodeWriter]);
        v.status.provisioning.accessible_topology =
            vec![[("zone".to_string(), "a".to_string())].into()];
        let c = claim("c", "n1", ClaimMode::Write, None);
        let mut n = node(true);
        assert!(
            denied(check(&c, Some(&v), Some(&n), Vec::<&Claim>::new)).contains("not accessible")
        );
        n.status
            .plugins
            .values_mut()
            .for_each(|p| p.topology = Some([("zone".to_string(), "a".to_string())].into()));
        assert!(check(&c, Some(&v), Some(&n), Vec::<&Claim>::new).is_ok());
    }

    #[test]
    fn access_rules_hold_across_nodes_both_ways() {
        let v = volume(&[
            AccessMode::SingleNodeWriter,
            AccessMode::MultiNodeReaderOnly,
        ])
        .spec;
        let n1 = NodeName::new("n1").unwrap();
        let n2 = NodeName::new("n2").unwrap();
        let holder = |node: &NodeName, mode, access| ClaimRef {
            allocation: AllocationId::new("a").unwrap(),
            claim: Name::new("h").unwrap(),
            node: node.clone(),
            mode,
            access_mode: access,
        };
        let snw = [holder(
            &n1,
            ClaimMode::Write,
            Some(AccessMode::SingleNodeWriter),
        )];
        assert!(access(
            &v,
            AccessMode::SingleNodeWriter,
            &n2,
            ClaimMode::Write,
            &snw,
            true
        )
        .is_err());
        assert!(access(
            &v,
            AccessMode::SingleNodeWriter,
            &n1,
            ClaimMode::Read,
            &snw,
            true
        )
        .is_ok());
        assert!(access(
            &v,
            AccessMode::SingleNodeWriter,
            &n1,
            ClaimMode::Write,
            &snw,
            true
        )
        .is_err());
        // A reader in a multi-node mode may not join a single-node holder elsewhere.
        assert!(access(
            &v,
            AccessMode::MultiNodeReaderOnly,
            &n2,
            ClaimMode::Read,
            &snw,
            true
        )
        .is_err());
        // An old holder without a recorded mode uses the volume's first.
        let old = [holder(&n1, ClaimMode::Write, None)];
        assert!(access(
            &v,
            AccessMode::MultiNodeReaderOnly,
            &n2,
            ClaimMode::Read,
            &old,
            true
        )
        .is_err());
        assert!(access(
            &v,
            AccessMode::SingleNodeWriter,
            &n2,
            ClaimMode::Read,
            &[],
            true
        )
        .is_ok());
    }

    /// A holder ref of claim `name` of allocation `alloc` on `node`.
    fn held(name: &str, alloc: &str, node: &str, mode: ClaimMode) -> ClaimRef {
        ClaimRef {
            allocation: AllocationId::new(alloc).unwrap(),
            claim: Name::new(name).unwrap(),
            node: NodeName::new(node).unwrap(),
            mode,
            access_mode: Some(AccessMode::SingleNodeWriter),
        }
    }

    #[test]
    fn a_volume_s_claims_on_one_node_carry_one_selinux_label_where_the_plugin_takes_labels() {
        let mut v = volume(&[AccessMode::MultiNodeMultiWriter]);
        let mut admitted = Admitted {
            capability: cap(AccessMode::MultiNodeMultiWriter),
            external_id: ExternalVolumeId::new("ext-v").unwrap(),
            multi_writer_cap: true,
            selinux_mount: true,
        };
        let (l1, l2) = (
            "system_u:object_r:container_file_t:s0:c1,c2",
            "system_u:object_r:container_file_t:s0:c3,c4",
        );
        let mut me = claim("me", "n1", ClaimMode::Write, None);
        me.spec.mount_options.selinux_label = Some(l2.into());
        v.status.claims.write_claims = vec![
            held("same-node", "a-one", "n1", ClaimMode::Write),
            held("other-node", "a-two", "n2", ClaimMode::Write),
        ];
        fn labels(first: Option<&str>) -> impl Fn(&ClaimRef) -> Option<Option<String>> + '_ {
            move |r: &ClaimRef| match r.claim.as_str() {
                "same-node" => Some(first.map(String::from)),
                _ => Some(Some("user_u:role_r:other_t".to_string())),
            }
        }
        match selinux_for(&v, &admitted, &me, labels(Some(l1)), |_| false) {
            Err(Verdict::Deny(why)) => assert!(
                why.contains(l1) && why.contains(l2) && why.contains("a-one"),
                "{why}"
            ),
            other => panic!("{other:?}"),
        }
        // Only a claim being released holds the other label: a wait, admitted after.
        assert!(matches!(
            selinux_for(&v, &admitted, &me, labels(Some(l1)), |r| r.claim.as_str() == "same-node"),
            Err(Verdict::Wait(w)) if w.contains(l1) && w.contains("waiting for its release")
        ));
        // No label is a label of its own.
        assert!(matches!(
            selinux_for(&v, &admitted, &me, labels(None), |_| false),
            Err(Verdict::Deny(w)) if w.contains("no label")
        ));
        // The same label on the node (whatever another node uses): admitted.
        assert!(selinux_for(&v, &admitted, &me, labels(Some(l2)), |_| false).is_ok());
        // A claim not known here is not counted.
        assert!(selinux_for(&v, &admitted, &me, |_| None, |_| false).is_ok());
        // A plugin that does not take labels: never sent, no rule.
        admitted.selinux_mount = false;
        assert!(selinux_for(&v, &admitted, &me, labels(Some(l1)), |_| false).is_ok());
    }

    #[test]
    fn a_conflict_only_with_holders_being_released_waits_and_any_live_one_denies() {
        let mut v = volume(&[AccessMode::SingleNodeWriter]);
        let admitted = Admitted {
            capability: cap(AccessMode::SingleNodeWriter),
            external_id: ExternalVolumeId::new("ext-v").unwrap(),
            multi_writer_cap: true,
            selinux_mount: false,
        };
        let me = claim(
            "me",
            "n1",
            ClaimMode::Write,
            Some(AccessMode::SingleNodeWriter),
        );
        v.status.claims.write_claims = vec![held("old", "a-old", "n1", ClaimMode::Write)];
        let ending_old = |r: &ClaimRef| r.claim.as_str() == "old";
        match access_for(&v, &admitted, &me, ending_old) {
            Err(Verdict::Wait(why)) => assert!(
                why.contains("allocation a-old") && why.contains("waiting for its release"),
                "{why}"
            ),
            other => panic!("expected a wait, got {other:?}"),
        }
        // The same holder live: denied, named.
        match access_for(&v, &admitted, &me, |_| false) {
            Err(Verdict::Deny(why)) => assert!(why.contains("allocation a-old"), "{why}"),
            other => panic!("expected a denial, got {other:?}"),
        }
        // One ending writer and one live reader on another node: the live one still
        // keeps the single-node volume away, so a denial naming it.
        v.status.claims.read_claims = vec![held("live", "a-live", "n2", ClaimMode::Read)];
        match access_for(&v, &admitted, &me, ending_old) {
            Err(Verdict::Deny(why)) => {
                assert!(why.contains("a-live") && why.contains("node n2"), "{why}")
            }
            other => panic!("expected a denial, got {other:?}"),
        }
        // No conflict: admitted whatever is ending.
        v.status.claims = Default::default();
        assert!(access_for(&v, &admitted, &me, |_| true).is_ok());
    }

    #[test]
    fn without_single_node_multi_writer_a_reader_beside_a_writer_on_its_node_waits_or_is_denied() {
        let mut v = volume(&[AccessMode::SingleNodeWriter]);
        let mut admitted = Admitted {
            capability: cap(AccessMode::SingleNodeWriter),
            external_id: ExternalVolumeId::new("ext-v").unwrap(),
            multi_writer_cap: false,
            selinux_mount: false,
        };
        let reader = claim(
            "me",
            "n1",
            ClaimMode::Read,
            Some(AccessMode::SingleNodeWriter),
        );
        v.status.claims.write_claims = vec![held("old", "a-old", "n1", ClaimMode::Write)];
        match access_for(&v, &admitted, &reader, |_| false) {
            Err(Verdict::Deny(why)) => assert!(
                why.contains("once per node")
                    && why.contains("SINGLE_NODE_MULTI_WRITER")
                    && why.contains("allocation a-old"),
                "{why}"
            ),
            other => panic!("expected a denial, got {other:?}"),
        }
        // The holder ending: the reader waits for it, as a writer would.
        match access_for(&v, &admitted, &reader, |r| r.claim.as_str() == "old") {
            Err(Verdict::Wait(why)) => assert!(why.contains("waiting for its release"), "{why}"),
            other => panic!("expected a wait, got {other:?}"),
        }
        // Where the plugin advertises it, the reader joins.
        admitted.multi_writer_cap = true;
        assert!(access_for(&v, &admitted, &reader, |_| false).is_ok());
    }

    #[test]
    fn a_holder_is_ending_when_released_deleted_or_no_longer_wanted() {
        let mut h = claim("h", "n1", ClaimMode::Write, None);
        let mut a = Allocation::new(
            &Namespace::default_ns(),
            Name::new("a").unwrap(),
            AllocationSpec {
                node: NodeName::new("n1").unwrap(),
                volumes: vec![VolumeRequest {
                    name: Name::new("r").unwrap(),
                    volume: VolumeId::new("v").unwrap(),
                    ..Default::default()
                }],
                ..Default::default()
            },
        );
        let wanted = a.claim_name(&a.spec.volumes[0]).unwrap();
        h.metadata.name = wanted;
        h.spec.allocation = AllocationId::new("a").unwrap();
        h.spec.request = Name::new("r").unwrap();
        assert!(!holder_ending(Some(&h), Some(&a)), "a live holder");
        // Another allocation's claim under the same name is not this one's.
        let mut other = h.clone();
        other.spec.request = Name::new("q").unwrap();
        assert!(
            holder_ending(Some(&other), Some(&a)),
            "a claim it does not own"
        );
        assert!(!holder_ending(None, None), "a holder not found stays");
        assert!(holder_ending(Some(&h), None), "its allocation gone");
        a.spec.desired_status = DesiredStatus::Stop;
        assert!(holder_ending(Some(&h), Some(&a)), "its allocation stopped");
        a.spec.desired_status = Default::default();
        a.spec.client_status = ClientStatus::Complete;
        assert!(holder_ending(Some(&h), Some(&a)), "its allocation ended");
        a.spec.client_status = ClientStatus::Running;
        h.spec.release = true;
        assert!(holder_ending(Some(&h), Some(&a)), "marked for release");
    }
}
