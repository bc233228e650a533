//! A request's volume made from its template: the name it gets and whether it exists.

use crate::api::*;

use super::{placement, Verdict};

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
