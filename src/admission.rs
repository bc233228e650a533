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
//! The access-mode rules across every node ([`access`]) are checked last, against the
//! volume's live claims, inside the compare-and-swap that records the claim on the volume.

use crate::api::*;

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

/// Checks every rule but the access modes across nodes. `node_claims` (the claims on
/// the claim's node) is asked for only when the plugin limits volumes per node: a node
/// can hold thousands, and collecting them per admission made a burst quadratic.
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
    room(
        plugin,
        &claim.metadata.namespace,
        spec,
        &claim.metadata.uid,
        node_claims,
    )?;
    let reachable = &volume.status.provisioning.accessible_topology;
    if !reachable.is_empty() {
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
    }
    Ok(Admitted {
        capability,
        external_id,
        multi_writer_cap: plugin.capabilities.node.has(NodeRpc::SingleNodeMultiWriter),
        selinux_mount: plugin.selinux_mount,
    })
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

/// What a template request's volume needs now ([`made`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Made {
    /// It exists and serves the request as it is: claim it.
    Ready,
    /// Make it with this spec.
    Create(VolumeSpec),
    /// Claim it, and grow the retained volume to this spec (a larger capacity_min or
    /// new mutable parameters: the expansion and modify paths apply them).
    Update(VolumeSpec),
    /// Not yet, and why.
    Wait(String),
    /// Refused, and why (the allocation is blocked).
    Deny(String),
}

/// A template request `req` (template `tpl`) of `alloc`: its volume `existing` (found
/// by [`Allocation::request_volume`]) claimed as it is, grown, waited for or refused;
/// or, none yet, made where the allocation's node (`node`) can use it: the plugin runs
/// there as a node plugin and is healthy, the node's max volumes leave room
/// (`node_claims`), and the capacity the plugin reports (`capacity`: its
/// GetCapacity per segment, where it offers it) for the node's segment, or as a whole,
/// fits the template's capacity_min. The volume asks for the node's segment as its
/// requisite and preferred topology.
pub fn made<I>(
    alloc: &Allocation,
    req: &VolumeRequest,
    tpl: &VolumeTemplate,
    existing: Option<&Volume>,
    node: Option<&Node>,
    capacity: Option<&[CapacityEntry]>,
    node_claims: impl FnOnce() -> I,
) -> Made
where
    I: IntoIterator,
    I::Item: std::ops::Deref<Target = Claim>,
{
    let name = alloc
        .request_volume(req)
        .map(|v| v.to_string())
        .unwrap_or_default();
    if let Some(v) = existing {
        let Some(m) = v.spec.made_for.as_deref() else {
            return Made::Deny(format!(
                "volume {name} exists and was not made by a template; rename the request or the volume"
            ));
        };
        if m.allocation != alloc.metadata.name || m.request != req.name {
            return Made::Deny(format!(
                "volume {name} was made for allocation {} request {}",
                m.allocation, m.request
            ));
        }
        if v.is_deleting() {
            return Made::Wait(format!("volume {name} of an earlier run is being deleted"));
        }
        if v.status.provisioning.phase == VolumePhase::Failed {
            return Made::Deny(format!(
                "volume {name} could not be made: {}",
                v.status
                    .provisioning
                    .meta
                    .last_error
                    .as_deref()
                    .unwrap_or("see its status")
            ));
        }
        if m.lifecycle == VolumeLifecycle::Ephemeral && m.allocation_uid != alloc.metadata.uid {
            return Made::Wait(format!(
                "ephemeral volume {name} of an earlier allocation of this name is to be deleted"
            ));
        }
        return match tpl.meet(req, &v.spec) {
            Ok(None) => Made::Ready,
            Ok(Some(spec)) => Made::Update(spec),
            Err(why) => Made::Deny(format!("volume {name}: {why}")),
        };
    }
    let segment = match placement(
        &alloc.metadata.namespace,
        &name,
        &tpl.plugin_id,
        tpl.capacity_min,
        &alloc.spec.node,
        node,
        capacity,
        node_claims,
    ) {
        Ok(segment) => segment,
        Err(Verdict::Wait(w)) => return Made::Wait(w),
        Err(Verdict::Deny(d)) => return Made::Deny(d),
    };
    let made_for = MadeFor {
        allocation: alloc.metadata.name.clone(),
        allocation_uid: alloc.metadata.uid.clone(),
        request: req.name.clone(),
        lifecycle: tpl.lifecycle,
    };
    Made::Create(tpl.volume_spec(req, Some(&segment), made_for))
}

/// Where a volume `name` (in namespace `ns`) of plugin `plugin_id`, at least
/// `capacity_min`, can be made for use on node `node_name` (`node`, none while it is
/// not registered): the plugin runs there as a node plugin and is healthy, the node's
/// max volumes leave room (`node_claims`), and the capacity the plugin reports
/// (`capacity`: its GetCapacity per segment) fits in the node's segment, or as a
/// whole. Returns the node's segment, which the volume asks for as its topology.
/// Templates ([`made`]) and the engine endpoint's `volume create` share it.
#[allow(clippy::too_many_arguments)]
pub fn placement<I>(
    ns: &Namespace,
    name: &str,
    plugin_id: &PluginId,
    capacity_min: Option<Size>,
    node_name: &NodeName,
    node: Option<&Node>,
    capacity: Option<&[CapacityEntry]>,
    node_claims: impl FnOnce() -> I,
) -> Result<Topology, Verdict>
where
    I: IntoIterator,
    I::Item: std::ops::Deref<Target = Claim>,
{
    let Some(node) = node else {
        return Err(Verdict::Wait(format!("node {node_name} is not registered")));
    };
    let Some(plugin) = node.status.plugins.get(plugin_id) else {
        return Err(Verdict::Deny(format!(
            "plugin {plugin_id} is not running on node {node_name}"
        )));
    };
    if plugin.plugin_type == PluginType::Controller {
        return Err(Verdict::Deny(format!(
            "plugin {plugin_id} runs only as a controller on node {node_name}"
        )));
    }
    if !plugin.healthy {
        return Err(Verdict::Deny(format!(
            "plugin {plugin_id} is unhealthy on node {node_name}: {}",
            plugin.health_message
        )));
    }
    let claim = ClaimSpec {
        plugin_id: plugin_id.clone(),
        node: node_name.clone(),
        volume: VolumeId::new(name).unwrap_or_default(),
        ..Default::default()
    };
    room(plugin, ns, &claim, &Uid::default(), node_claims)?;
    let segment = plugin.topology.clone().unwrap_or_default();
    if let (Some(min), Some(entries)) = (capacity_min, capacity) {
        // The node's own segment's report, else the plugin's as a whole.
        let entry = entries
            .iter()
            .filter(|e| {
                !e.topology.is_empty() && e.topology.iter().all(|(k, v)| segment.get(k) == Some(v))
            })
            .max_by_key(|e| e.topology.len())
            .or_else(|| entries.iter().find(|e| e.topology.is_empty()));
        if let Some(e) = entry.filter(|e| e.fits() < min.0) {
            let seg: Vec<String> = e.topology.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let seg = if seg.is_empty() {
                "as a whole".to_string()
            } else {
                format!("in segment {}", seg.join(","))
            };
            return Err(Verdict::Deny(format!(
                "plugin {plugin_id} reports {} available {seg}; the volume asks for at least {min}",
                Size(e.fits()),
            )));
        }
    }
    Ok(segment)
}

/// The access-mode rules across nodes: may a claim `(node, mode)` in `access_mode` join
/// the volume's `existing` live claims, where the node's plugin advertises
/// SINGLE_NODE_MULTI_WRITER or not (`multi_writer_cap`)? Both ways: the newcomer's mode
/// must admit the others, and each holder's mode must admit the newcomer.
pub fn access(
    volume: &VolumeSpec,
    access_mode: AccessMode,
    node: &NodeName,
    mode: ClaimMode,
    existing: &[ClaimRef],
    multi_writer_cap: bool,
) -> Result<(), AccessDenied> {
    let default_mode = volume
        .capabilities
        .first()
        .map(|c| c.access_mode)
        .unwrap_or(access_mode);
    let holder = |cause: &ClaimDenied| match cause {
        ClaimDenied::WriterTaken(_) => existing.iter().find(|r| r.mode == ClaimMode::Write),
        ClaimDenied::OtherNode { node: other, .. } => existing.iter().find(|r| &r.node == other),
        ClaimDenied::ClaimTaken(_) => existing.first(),
        ClaimDenied::OncePerNode(_) => existing.iter().find(|r| &r.node == node),
        ClaimDenied::ReadOnlyMode(_) => None,
    };
    let denied = |cause: ClaimDenied| AccessDenied {
        holder: holder(&cause).cloned(),
        cause,
    };
    access_mode
        .admit(
            node,
            mode,
            existing.iter().map(|r| (&r.node, r.mode)),
            multi_writer_cap,
        )
        .map_err(denied)?;
    for holder in existing {
        let held = holder.access_mode.unwrap_or(default_mode);
        let me = [(node, mode)];
        held.admit(
            &holder.node,
            holder.mode,
            me.iter().map(|(n, m)| (*n, *m)),
            multi_writer_cap,
        )
        .map_err(|cause| AccessDenied {
            cause,
            holder: Some(holder.clone()),
        })?;
    }
    Ok(())
}

/// The SELinux rule, where the node's plugin takes labels (`admitted.selinux_mount`):
/// the plugin stages a volume once per node, mounted with the first claim's label, so
/// every live claim of the volume on that node must carry the same label (no label
/// counts as one). A claim with another is denied, the denial naming both labels.
/// `label_of` gives a live claim's label (`None`: the claim is not known here, not
/// counted). Where the plugin does not take labels none is ever sent: no rule.
pub fn selinux_for(
    volume: &Volume,
    admitted: &Admitted,
    claim: &Claim,
    label_of: impl Fn(&ClaimRef) -> Option<Option<String>>,
    ending: impl Fn(&ClaimRef) -> bool,
) -> Result<(), Verdict> {
    if !admitted.selinux_mount || admitted.capability.attachment_mode == AttachmentMode::BlockDevice
    {
        return Ok(());
    }
    let mine = claim.spec.mount_options.selinux_label.as_deref();
    let shown =
        |l: Option<&str>| l.map_or_else(|| "no label".to_string(), |l| format!("label {l}"));
    let live = &volume.status.claims;
    let mut waiting = None;
    for r in live.read_claims.iter().chain(&live.write_claims) {
        if r.node != claim.spec.node
            || (r.claim == claim.metadata.name && r.allocation == claim.spec.allocation)
        {
            continue;
        }
        let Some(theirs) = label_of(r) else {
            continue;
        };
        if theirs.as_deref() == mine {
            continue;
        }
        let why = format!(
            "volume {} is mounted on node {} with SELinux {} (claim of allocation {}); this claim asks for {}",
            claim.spec.volume,
            claim.spec.node,
            shown(theirs.as_deref()),
            r.allocation,
            shown(mine)
        );
        // As the access modes: a conflict only with claims being released waits for
        // them; one with a live claim is a denial.
        if !ending(r) {
            return Err(Verdict::Deny(why));
        }
        waiting.get_or_insert(format!("{why}: waiting for its release"));
    }
    waiting.map_or(Ok(()), |w| Err(Verdict::Wait(w)))
}

/// The access-mode rules for `claim`, admitted by [`check`] as `admitted`, against
/// `volume`'s live claims (its own entry, if recorded already, left out): what the
/// controller checks inside the compare-and-swap that records the claim on the volume.
///
/// A conflict only with holders that are being released (`ending`: their allocation
/// ended, stopped or is gone) is a wait, not a denial: the claim is admitted once they
/// leave (a container started again right after the last one stopped, a job's next
/// allocation). A conflict with any live holder is a denial naming it.
pub fn access_for(
    volume: &Volume,
    admitted: &Admitted,
    claim: &Claim,
    ending: impl Fn(&ClaimRef) -> bool,
) -> Result<(), Verdict> {
    let live = &volume.status.claims;
    let existing: Vec<ClaimRef> = live
        .read_claims
        .iter()
        .chain(&live.write_claims)
        .filter(|r| !(r.claim == claim.metadata.name && r.allocation == claim.spec.allocation))
        .cloned()
        .collect();
    let check = |holders: &[ClaimRef]| {
        access(
            &volume.spec,
            admitted.capability.access_mode,
            &claim.spec.node,
            claim.spec.mode,
            holders,
            admitted.multi_writer_cap,
        )
    };
    let Err(denied) = check(&existing) else {
        return Ok(());
    };
    let staying: Vec<ClaimRef> = existing.iter().filter(|r| !ending(r)).cloned().collect();
    match check(&staying) {
        Err(denied) => Err(Verdict::Deny(denied.to_string())),
        Ok(()) => Err(Verdict::Wait(format!("{denied}; waiting for its release"))),
    }
}

/// Whether a holder of a volume is being released, as [`access_for`]'s `ending` asks:
/// its claim (`holder`, as found) is marked for release or deleted, or its allocation
/// (`alloc`, absent when gone) no longer wants it. A holder not found is taken as
/// staying.
pub fn holder_ending(holder: Option<&Claim>, alloc: Option<&Allocation>) -> bool {
    holder.is_some_and(|h| h.spec.release || h.is_deleting() || !alloc.is_some_and(|a| a.wants(h)))
}

/// Whether one request would be admitted now, and if not why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestFit {
    /// The request's name.
    pub request: Name,
    /// The volume it claims.
    pub volume: String,
    /// `None`: admitted; else the verdict that keeps it out.
    pub refused: Option<Verdict>,
}

/// Placement: would each request of `alloc` be admitted on its node (`alloc.spec.node`,
/// `node`) now? The same rules the controller admits with ([`check`], then
/// [`access_for`]; [`made`] for a template's volume not made yet), over the same
/// objects: `volume_of` finds a request's volume, `node_claims` are the claims on that
/// node, `ending` tells a holder being released, `capacity_of` a plugin's capacity
/// report. Requests are judged one by one.
pub fn plan<'a, 'c, I>(
    alloc: &Allocation,
    node: Option<&Node>,
    volume_of: impl Fn(&VolumeId) -> Option<&'a Volume>,
    node_claims: impl Fn() -> I,
    ending: impl Fn(&ClaimRef) -> bool,
    capacity_of: impl Fn(&PluginId) -> Option<&'c [CapacityEntry]>,
) -> Vec<RequestFit>
where
    I: IntoIterator,
    I::Item: std::ops::Deref<Target = Claim>,
{
    alloc
        .spec
        .volumes
        .iter()
        .map(|req| {
            let volume_id = alloc.request_volume_in(req, |v| volume_of(v).is_some());
            let volume = volume_id.as_ref().and_then(&volume_of);
            let name = volume_id
                .as_ref()
                .map_or_else(String::new, |v| v.to_string());
            let made = req.template.as_deref().map(|tpl| {
                made(
                    alloc,
                    req,
                    tpl,
                    volume,
                    node,
                    capacity_of(&tpl.plugin_id),
                    &node_claims,
                )
            });
            let refused = match (made, volume_id, volume) {
                (Some(Made::Wait(w)), ..) => Some(Verdict::Wait(w)),
                (Some(Made::Deny(d)), ..) => Some(Verdict::Deny(d)),
                // Made where the node can use it: admitted once created.
                (Some(Made::Create(_)), Some(_), None) => None,
                (_, None, _) => Some(Verdict::Deny(format!(
                    "request {}: per_alloc volume name is too long",
                    req.name
                ))),
                (_, Some(v), None) => Some(Verdict::Deny(format!("volume {v} does not exist"))),
                (_, Some(_), Some(volume)) => match alloc.claim_for(req, volume) {
                    None => Some(Verdict::Deny(format!(
                        "request {}: the claim's name does not fit the id rule",
                        req.name
                    ))),
                    Some(claim) => match check(&claim, Some(volume), node, &node_claims) {
                        Err(v) => Some(v),
                        Ok(admitted) => access_for(volume, &admitted, &claim, &ending)
                            .and_then(|()| {
                                selinux_for(
                                    volume,
                                    &admitted,
                                    &claim,
                                    |r| {
                                        node_claims()
                                            .into_iter()
                                            .find(|c| {
                                                c.metadata.name == r.claim
                                                    && c.metadata.namespace
                                                        == claim.metadata.namespace
                                            })
                                            .map(|c| c.spec.mount_options.selinux_label.clone())
                                    },
                                    &ending,
                                )
                            })
                            .err(),
                    },
                },
            };
            RequestFit {
                request: req.name.clone(),
                volume: name,
                refused,
            }
        })
        .collect()
}

/// An access-mode rule that denies a claim, and the live claim it conflicts with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessDenied {
    /// The rule.
    pub cause: ClaimDenied,
    /// The claim holding the volume in the way (what a person asks next).
    pub holder: Option<ClaimRef>,
}

impl std::fmt::Display for AccessDenied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.cause)?;
        if let Some(h) = &self.holder {
            write!(
                f,
                " (held by allocation {} on node {}, {})",
                h.allocation,
                h.node,
                match h.mode {
                    ClaimMode::Read => "reading",
                    ClaimMode::Write => "writing",
                }
            )?;
        }
        Ok(())
    }
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
