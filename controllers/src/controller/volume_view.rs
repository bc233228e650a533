//! What the controller keeps of each volume: its volume cache holds this projection,
//! not the whole decoded Volume (`Informer::spawn_projected`), so 100,000 claimed
//! volumes cost a fraction of their objects (docs/benchmarks.md).
//!
//! A view keeps what the reconcilers read on every pass (the claim's node copy, the
//! attach and release plans, the volume reconciler's decision, the indexes, the
//! snapshot schedules' selection), and the whole volume while its next step needs it:
//! until it is claimed and settled ([`VolumeView::at_rest`]). A view is never the base
//! of a write: whoever decides on the whole spec or writes the volume takes it through
//! [`super::context::Ctx::whole_volume`] (this process's own last write while the cache lags or
//! shows it, else the whole volume a view keeps, else a read). So the admission of a
//! second claim of a settled volume and each release read the volume once; the
//! admission of a volume's first claim reads nothing more.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;

use moor::api::*;

use super::volumes::{FINALIZER, HEALTHY_ON_NODES};

/// The parts of a volume most volumes leave empty, behind one pointer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RareParts {
    /// The spec's fields the claims' and volumes' passes read: the plugin, its
    /// secrets and the Secrets it names, the operator's force-detach declarations,
    /// the allocation an ephemeral volume was made for, deletion protection, and the
    /// source it is restored from. Every other field is left at its default.
    pub spec: VolumeSpec,
    /// `metadata.labels` (what a snapshot schedule selects by).
    pub labels: Rare<BTreeMap<String, String>>,
}

/// What the controller reads of a volume.
#[derive(Debug, Clone, PartialEq)]
pub struct VolumeView {
    /// Its namespace.
    pub namespace: Namespace,
    /// Its name.
    pub name: Name,
    /// The revision the view was made at.
    pub resource_version: i64,
    /// `metadata.generation`.
    pub generation: i64,
    /// It has a deletion timestamp.
    pub deleting: bool,
    /// It carries the controller's finalizer.
    pub finalized: bool,
    /// The plugin's id of the volume is known (created or registered).
    pub created: bool,
    /// `status.provisioning.external_id` is set (created, or a registration seen).
    pub provisioned: bool,
    /// The volume's plugin.
    pub plugin_id: PluginId,
    /// `status.provisioning.node_expansion_bytes`.
    pub node_expansion_bytes: Option<u64>,
    /// `status.claims.schedulable`.
    pub schedulable: bool,
    /// `status.claims.read_claims`.
    pub read_claims: Box<[ClaimRef]>,
    /// `status.claims.write_claims`.
    pub write_claims: Box<[ClaimRef]>,
    /// The `HealthyOnNodes` condition, when the volume has one.
    pub healthy_on_nodes: Option<Box<Condition>>,
    /// See [`RareParts`]; `None` when every one of them is empty.
    pub rare: Option<Box<RareParts>>,
    /// The whole volume, while it is not [`VolumeView::at_rest`].
    pub whole: Option<Arc<Volume>>,
}

impl VolumeView {
    /// The view of `v`, keeping `v` whole unless it is at rest.
    pub fn of(v: Volume) -> VolumeView {
        let mut view = VolumeView::parts(&v);
        if !view.at_rest() {
            view.whole = Some(Arc::new(v));
        }
        view
    }

    fn parts(v: &Volume) -> VolumeView {
        let claims = &v.status.claims;
        let s = &v.spec;
        let rare = !s.secrets.is_empty()
            || !s.secret_refs.is_empty()
            || !s.force_detach.is_empty()
            || s.made_for.is_some()
            || s.deletion_protection
            || s.source.is_some()
            || !v.metadata.labels.is_empty();
        VolumeView {
            namespace: v.metadata.namespace.clone(),
            name: v.metadata.name.clone(),
            resource_version: v.metadata.resource_version,
            generation: v.metadata.generation,
            deleting: v.is_deleting(),
            finalized: v.metadata.finalizers.iter().any(|f| f == FINALIZER),
            created: moor::admission::external_id(v).is_some(),
            provisioned: v.status.provisioning.external_id.is_some(),
            plugin_id: s.plugin_id.clone(),
            node_expansion_bytes: v.status.provisioning.node_expansion_bytes,
            schedulable: claims.schedulable,
            read_claims: claims.read_claims.clone().into_boxed_slice(),
            write_claims: claims.write_claims.clone().into_boxed_slice(),
            healthy_on_nodes: claims
                .meta
                .conditions
                .iter()
                .find(|c| c.type_ == HEALTHY_ON_NODES)
                .map(|c| Box::new(c.clone())),
            rare: rare.then(|| {
                Box::new(RareParts {
                    spec: VolumeSpec {
                        plugin_id: s.plugin_id.clone(),
                        secrets: s.secrets.clone(),
                        secret_refs: s.secret_refs.clone(),
                        force_detach: s.force_detach.clone(),
                        made_for: s.made_for.clone(),
                        deletion_protection: s.deletion_protection,
                        source: s.source.clone(),
                        ..Default::default()
                    },
                    labels: v.metadata.labels.clone(),
                })
            }),
            whole: None,
        }
    }

    /// Nothing owed it but what the view answers: carrying the finalizer, not being
    /// deleted, schedulable, holding a live claim (so the next admission is of a
    /// further claim, which reads it), and not made from a template (an allocation's
    /// pass judges those whole). A volume not at rest is kept whole.
    pub fn at_rest(&self) -> bool {
        self.finalized
            && !self.deleting
            && self.schedulable
            && self.live()
            && self.made_for().is_none()
    }

    /// It has a live claim.
    pub fn live(&self) -> bool {
        !self.read_claims.is_empty() || !self.write_claims.is_empty()
    }

    /// The live claims, read ones first.
    pub fn live_claims(&self) -> impl Iterator<Item = &ClaimRef> {
        self.read_claims.iter().chain(self.write_claims.iter())
    }

    /// The spec's fields [`RareParts::spec`] keeps (the rest at their defaults).
    pub fn spec(&self) -> Cow<'_, VolumeSpec> {
        match &self.rare {
            Some(r) => Cow::Borrowed(&r.spec),
            None => Cow::Owned(VolumeSpec {
                plugin_id: self.plugin_id.clone(),
                ..Default::default()
            }),
        }
    }

    /// `spec.made_for`.
    pub fn made_for(&self) -> Option<&MadeFor> {
        self.rare.as_ref()?.spec.made_for.as_deref()
    }

    /// `metadata.labels`.
    pub fn labels(&self) -> &Rare<BTreeMap<String, String>> {
        static NONE: std::sync::OnceLock<Rare<BTreeMap<String, String>>> =
            std::sync::OnceLock::new();
        match &self.rare {
            Some(r) => &r.labels,
            None => NONE.get_or_init(Rare::default),
        }
    }

    /// Whether an operator declared `node` gone for this volume after a claim
    /// admitted at `admitted` ([`VolumeSpec::force_detached`]).
    pub fn force_detached(&self, node: &NodeName, admitted: Option<i64>) -> bool {
        self.rare
            .as_ref()
            .is_some_and(|r| r.spec.force_detached(node, admitted))
    }

    /// The Secrets its node calls take, as `lookup` finds them now
    /// ([`Volume::node_secrets`]).
    pub fn node_secrets(
        &self,
        lookup: impl Fn(&ObjectKey<SecretSpec>) -> Option<Arc<Secret>>,
    ) -> Result<NodeSecrets, MissingSecret> {
        self.spec().node_secrets(&self.namespace, lookup)
    }
}

crate::common::volume_view_keys!(VolumeView);

#[cfg(test)]
mod tests {
    use super::*;

    fn claim_ref(name: &str) -> ClaimRef {
        ClaimRef {
            allocation: AllocationId::new("a1").unwrap(),
            claim: Name::new(name).unwrap(),
            node: NodeName::new("n1").unwrap(),
            mode: ClaimMode::Write,
            access_mode: None,
        }
    }

    fn settled() -> Volume {
        let mut v = Volume::new(
            &Namespace::default_ns(),
            Name::new("v1").unwrap(),
            VolumeSpec {
                plugin_id: PluginId::new("p").unwrap(),
                context: BTreeMap::from([("a".into(), "b".into())]).into(),
                ..Default::default()
            },
        );
        v.metadata.resource_version = 7;
        v.metadata.finalizers.push(FINALIZER.into());
        v.status.provisioning.external_id = Some(ExternalVolumeId::new("e1").unwrap());
        v.status.claims.schedulable = true;
        v.status.claims.write_claims.push(claim_ref("a1.data"));
        v
    }

    #[test]
    fn a_settled_claimed_volume_is_kept_as_its_view_alone() {
        let v = settled();
        let view = VolumeView::of(v.clone());
        assert!(view.at_rest() && view.whole.is_none());
        assert!(view.rare.is_none(), "nothing rare in it");
        assert_eq!(moor::runtime::Resource::key(&view), v.key());
        assert_eq!(moor::runtime::Resource::version(&view), 7);
        assert!(view.created && view.finalized && view.schedulable);
        assert_eq!(view.live_claims().count(), 1);
        assert_eq!(view.spec().plugin_id.as_str(), "p");
    }

    #[test]
    fn a_volume_whose_next_step_reads_it_is_kept_whole() {
        type Edit = (&'static str, fn(&mut Volume));
        let edits: [Edit; 5] = [
            ("unclaimed", |v| v.status.claims.write_claims.clear()),
            ("no finalizer", |v| v.metadata.finalizers.clear()),
            ("deleting", |v| {
                v.metadata.deletion_timestamp = Some(Timestamp::now())
            }),
            ("not schedulable", |v| v.status.claims.schedulable = false),
            ("made from a template", |v| {
                v.spec.made_for = Some(Box::default())
            }),
        ];
        for (what, edit) in edits {
            let mut v = settled();
            edit(&mut v);
            let view = VolumeView::of(v.clone());
            assert!(!view.at_rest(), "{what}");
            assert_eq!(view.whole.as_deref(), Some(&v), "{what}: kept whole");
        }
    }

    #[test]
    fn the_rare_parts_are_kept_and_answer_as_the_volume_does() {
        let mut v = settled();
        let n1 = NodeName::new("n1").unwrap();
        v.spec.force_detach = Rare::new(BTreeMap::from([(n1.clone(), 3)]));
        v.spec.secret_refs = Rare::new(SecretRefs {
            node_stage: Some(Name::new("st").unwrap()),
            ..Default::default()
        });
        v.metadata.labels = Rare::new(BTreeMap::from([("tier".into(), "gold".into())]));
        v.status.claims.meta.set_condition(
            HEALTHY_ON_NODES,
            false,
            "VolumeAbnormal",
            "node n1: bad",
        );
        let view = VolumeView::of(v.clone());
        assert!(view.at_rest() && view.rare.is_some());
        for admitted in [None, Some(2), Some(3), Some(4)] {
            assert_eq!(
                view.force_detached(&n1, admitted),
                v.spec.force_detached(&n1, admitted)
            );
        }
        assert_eq!(view.spec().secret_refs, v.spec.secret_refs);
        assert_eq!(view.labels().get("tier").map(|s| s.as_str()), Some("gold"));
        assert!(view.healthy_on_nodes.as_ref().is_some_and(|c| !c.status));
        let st = Arc::new(Secret::new(
            &Namespace::default_ns(),
            Name::new("st").unwrap(),
            SecretSpec {
                plugin_id: PluginId::new("p").unwrap(),
                secrets: Secrets::new([("k".to_string(), "v".to_string())].into()),
            },
        ));
        let lookup = |k: &ObjectKey<SecretSpec>| (*k == st.object_key()).then(|| st.clone());
        let found = view
            .node_secrets(lookup)
            .expect("the Secret named is there");
        assert!(found.stage.is_some());
        assert_eq!(
            format!("{found:?}"),
            format!("{:?}", v.node_secrets(lookup).unwrap())
        );
        assert!(view.node_secrets(|_| None).is_err(), "named and missing");
    }
}
