//! Placement: where a claim could be admitted, and every request of an allocation
//! judged at once (`moorctl alloc plan`, the controller's first pass).

use crate::api::*;

use super::templates::{made, Made};
use super::{access_for, check, room, selinux_for, Verdict};

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
