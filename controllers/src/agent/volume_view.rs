//! What the agent leading a plugin keeps of each of its volumes: the cache of its
//! provisioner, attacher, survey and snapshotters holds this projection, not the whole
//! decoded Volume (`Informer::spawn_projected`), so 100,000 volumes cost a fraction of
//! their objects (docs/benchmarks.md).
//!
//! A view is never the base of a write. Whoever acts on a volume's whole spec or
//! status takes it through `Writer::current` (this agent's own last write while the
//! cache lags or shows it, else the whole volume a view keeps while something is owed
//! it, else a read): the provisioner, for a volume not at rest
//! ([`VolumeView::at_rest`]); the snapshotters, for a snapshot's volume. The survey
//! writes its conditions by a read-modify-write (`Writer::modify_status`). The attacher
//! calls with what the view keeps ([`AttachInputs`]), so an attach reads nothing more.

use moor::api::*;

use super::survey::{ATTACHMENTS, HEALTHY, PRESENT};
use super::volume_plan;

/// The parts of a [`VolumeView`] most volumes do not have.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RareParts {
    /// `spec.external_id`: the id it was registered with.
    pub registered_id: Option<ExternalVolumeId>,
    /// The snapshot it is to be restored from, until it is created.
    pub restoring_from: Option<Name>,
    /// `spec.topology_request` (the segments GetCapacity is asked about).
    pub topology_request: Option<Box<TopologyRequest>>,
}

/// What the agent leading a plugin reads of one of its volumes (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct VolumeView {
    /// The volume's namespace.
    pub namespace: Namespace,
    /// The volume's name.
    pub name: Name,
    /// The revision the volume was read at.
    pub resource_version: i64,
    /// `metadata.generation`.
    pub generation: i64,
    /// Being deleted.
    pub deleting: bool,
    /// The provisioner owes it nothing whatever the plugin advertises
    /// ([`volume_plan::at_rest`]): it is skipped without a read.
    pub at_rest: bool,
    /// `status.provisioning.phase`.
    pub phase: VolumePhase,
    /// `status.provisioning.external_id`: the plugin's id once created or validated.
    pub external_id: Option<ExternalVolumeId>,
    /// What few volumes have, behind one pointer.
    pub rare: Option<Box<RareParts>>,
    /// The survey's conditions of `status.provisioning` (Present, Healthy,
    /// Attachments), the only ones the view's readers look at.
    pub conditions: Box<[Condition]>,
    /// What ControllerPublish and ControllerUnpublish take from it.
    pub attach: AttachInputs,
    /// The whole volume, while it is not at rest (being created, validated, expanded,
    /// modified or deleted): its provisioner's steps read it from here, as the cache
    /// of whole objects did, and drop it once nothing is owed.
    pub whole: Option<std::sync::Arc<Volume>>,
}

impl VolumeView {
    /// The projection of `v`, whose provisioner's finalizer is `finalizer`.
    pub fn of(v: Volume, finalizer: &str) -> VolumeView {
        let at_rest = volume_plan::at_rest(&v, finalizer);
        let mut view = VolumeView::parts(&v, at_rest);
        view.whole = (!at_rest).then(|| std::sync::Arc::new(v));
        view
    }

    /// What the view keeps of `v` but the whole object.
    fn parts(v: &Volume, at_rest: bool) -> VolumeView {
        let p = &v.status.provisioning;
        let restoring_from = match &v.spec.source {
            Some(VolumeSource::Snapshot(name)) if p.external_id.is_none() => Some(name.clone()),
            _ => None,
        };
        VolumeView {
            namespace: v.metadata.namespace.clone(),
            name: v.metadata.name.clone(),
            resource_version: v.metadata.resource_version,
            generation: v.metadata.generation,
            deleting: v.is_deleting(),
            at_rest,
            phase: p.phase,
            external_id: p.external_id.clone(),
            rare: {
                let rare = RareParts {
                    registered_id: v.spec.external_id.clone(),
                    restoring_from,
                    topology_request: v.spec.topology_request.clone(),
                };
                (rare != RareParts::default()).then(|| Box::new(rare))
            },
            conditions: p
                .meta
                .conditions
                .iter()
                .filter(|c| [PRESENT, HEALTHY, ATTACHMENTS].contains(&&*c.type_))
                .cloned()
                .collect(),
            attach: v.attach_inputs(),
            whole: None,
        }
    }

    /// The projection the provisioner's cache holds (its finalizer's).
    pub fn of_provisioned(v: Volume) -> VolumeView {
        VolumeView::of(v, super::provisioner::FINALIZER)
    }

    /// Ready, with the plugin's id: what the survey compares with the plugin's list.
    pub fn ready_id(&self) -> Option<&ExternalVolumeId> {
        self.external_id
            .as_ref()
            .filter(|_| self.phase == VolumePhase::Ready && !self.deleting)
    }

    /// `spec.external_id`: the id it was registered with.
    pub fn registered_id(&self) -> Option<&ExternalVolumeId> {
        self.rare.as_ref()?.registered_id.as_ref()
    }

    /// The snapshot it is to be restored from, until it is created.
    pub fn restoring_from(&self) -> Option<&Name> {
        self.rare.as_ref()?.restoring_from.as_ref()
    }

    /// The segments `spec.topology_request` requires.
    pub fn required_topology(&self) -> &[Topology] {
        match self.rare.as_ref().and_then(|r| r.topology_request.as_ref()) {
            Some(t) => &t.required,
            None => &[],
        }
    }

    /// The condition of type `t`, if the view keeps it.
    pub fn condition(&self, t: &str) -> Option<&Condition> {
        self.conditions.iter().find(|c| c.type_ == t)
    }
}

crate::common::volume_view_keys!(VolumeView);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_view_keeps_what_its_readers_use_and_drops_the_rest() {
        let mut v = Volume::new(
            &Namespace::default_ns(),
            Name::new("v1").unwrap(),
            VolumeSpec {
                plugin_id: PluginId::new("p").unwrap(),
                source: Some(VolumeSource::Snapshot(Name::new("s1").unwrap())),
                context: std::collections::BTreeMap::from([("a".into(), "b".into())]).into(),
                ..Default::default()
            },
        );
        v.metadata.resource_version = 7;
        let p = &mut v.status.provisioning;
        p.meta.set_condition("Created", true, "CreateVolume", "");
        p.meta
            .set_condition(PRESENT, false, "MissingFromPlugin", "gone");
        let claim = ClaimRef {
            allocation: AllocationId::new("a1").unwrap(),
            claim: Name::new("a1.data").unwrap(),
            node: NodeName::new("n1").unwrap(),
            mode: ClaimMode::Write,
            access_mode: None,
        };
        v.status.claims.write_claims.push(claim);
        let view = VolumeView::of_provisioned(v.clone());
        assert_eq!(view.restoring_from().map(|n| n.as_str()), Some("s1"));
        assert_eq!(view.conditions.len(), 1, "only the survey's conditions");
        assert!(view.condition(PRESENT).is_some_and(|c| !c.status));
        assert_eq!(view.attach, v.attach_inputs());
        assert_eq!(moor::runtime::Resource::key(&view), v.key());
        assert_eq!(moor::runtime::Resource::version(&view), 7);
        assert!(!view.at_rest && view.ready_id().is_none());
        assert_eq!(
            view.whole.as_deref(),
            Some(&v),
            "kept whole while something is owed"
        );
        // Created: no longer restoring, and Ready with an id.
        let p = &mut v.status.provisioning;
        p.external_id = Some(ExternalVolumeId::new("e1").unwrap());
        p.phase = VolumePhase::Ready;
        let view = VolumeView::of_provisioned(v.clone());
        assert!(view.restoring_from().is_none() && view.rare.is_none());
        assert_eq!(view.ready_id().map(|e| e.as_str()), Some("e1"));
        assert!(view.whole.is_some(), "no finalizer yet: not at rest");
        v.metadata
            .finalizers
            .push(super::super::provisioner::FINALIZER.into());
        v.status.provisioning.meta.observed_generation = v.metadata.generation;
        let view = VolumeView::of_provisioned(v);
        assert!(
            view.at_rest && view.whole.is_none(),
            "at rest: the view alone"
        );
    }
}
