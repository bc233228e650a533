//! Reports: what the agent leading a plugin observed of one object of a kind whose
//! request others write (issue 77, "The controller-plugin agent's reach" in
//! docs/architecture.md).
//!
//! An Attachment is the controller's, a Volume its requester's; their status used to be
//! written by the agent leading their plugin too, which therefore held a grant on every
//! object of every plugin and namespace. The agent writes what it observes in a report
//! instead, below `REPORT_DIR/PLUGIN/`, a prefix only that plugin's controller nodes may
//! write; the controller copies a report into its object (for every reader, itself
//! included) and acts on what the report asks of the object (a finalizer kept or
//! dropped, an attachment deleted). A report counts only under the key of the object's
//! own plugin and only for the object it names by uid: another plugin's agent cannot
//! report on it, and a report left from an object made again under the same key is not
//! about the new one.
//!
//! Writer: the agent leading the plugin. Readers: that agent, the controller.
//! Key: `REPORT_DIR/PLUGIN/` and the object's key below its kind's directory.

use serde::{Deserialize, Serialize};
use std::marker::PhantomData;

use super::*;

/// A kind whose status (or a section of it) the agent leading its plugin reports.
pub trait Reported: Spec {
    /// The reported part of the kind's status.
    type Section: Serialize
        + serde::de::DeserializeOwned
        + Clone
        + Default
        + PartialEq
        + std::fmt::Debug
        + Send
        + Sync
        + 'static;
    /// The report kind's name, e.g. `AttachmentReport`.
    const REPORT_KIND: &'static str;
    /// Its key directory, e.g. `attachment-reports`.
    const REPORT_DIR: &'static str;
    /// Other names the tools accept for it.
    const REPORT_ALIASES: &'static [&'static str];
    /// Where its phase is, if anywhere.
    const REPORT_PHASE: Option<&'static str>;
    /// The reported part of a status.
    fn section(status: &Self::Status) -> &Self::Section;
    /// The same, to write.
    fn section_mut(status: &mut Self::Status) -> &mut Self::Section;
}

/// What a report asks of the plugin's finalizer on its object, which the controller
/// alone adds and removes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinalizerAsk {
    /// Nothing: the finalizer stays as it is (an attachment; a volume an older agent
    /// made, whose finalizer that agent added).
    #[default]
    Unasked,
    /// Add it, before the plugin makes anything (a volume about to be created).
    Hold,
    /// What the plugin made is gone (or kept on purpose): remove it from the object
    /// being deleted.
    Released,
}

impl FinalizerAsk {
    /// Whether nothing is asked.
    pub fn is_unasked(&self) -> bool {
        *self == FinalizerAsk::Unasked
    }
}

/// A report on one object of kind `K`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReportSpec<K> {
    /// The plugin whose leader reports.
    #[serde(default)]
    pub plugin_id: PluginId,
    /// The object's key below its kind's directory (`NS/NAME`; an attachment's
    /// `NS/VOLUME/NODE`).
    #[serde(default)]
    pub object: String,
    /// The object reported on: one made again under the same key is another.
    #[serde(default)]
    pub uid: Uid,
    /// What the plugin asks of its finalizer on the object.
    #[serde(default, skip_serializing_if = "FinalizerAsk::is_unasked")]
    pub finalizer: FinalizerAsk,
    #[serde(skip)]
    kind: PhantomData<fn() -> K>,
}

impl<K: Reported> Spec for ReportSpec<K> {
    const KIND: &'static str = K::REPORT_KIND;
    const DIR: &'static str = K::REPORT_DIR;
    const NAMESPACED: bool = true;
    const ALIASES: &'static [&'static str] = K::REPORT_ALIASES;
    const PHASE: Option<&'static str> = K::REPORT_PHASE;
    const CHECKED: bool = true;
    const AGENT: AgentAccess = AgentAccess::OwnPluginWrite;
    const KEY_SEGMENTS: usize = 1 + K::KEY_SEGMENTS;
    const KEY_NAMESPACE_FIRST: bool = false;
    type Status = K::Section;

    fn key_suffix(&self, _meta: &ObjectMeta) -> String {
        format!("{}/{}", self.plugin_id, self.object)
    }

    fn validate(&self, errors: &mut ValidationErrors) {
        errors.check_id("plugin_id", self.plugin_id.validate());
        if ObjectKey::<K>::parse(&format!("{}/{}", K::DIR, self.object)).is_err() {
            errors.push(
                "object",
                format!("must be the key of a {} below {}/", K::KIND, K::DIR),
            );
        }
    }
}

/// A report on an object of kind `K`.
pub type Report<K> = Object<ReportSpec<K>>;

impl<K: Reported> Object<ReportSpec<K>> {
    /// The key of plugin `plugin`'s report on the object at `key`.
    pub fn key_for(plugin: &PluginId, key: &ObjectKey<K>) -> ObjectKey<ReportSpec<K>> {
        ObjectKey::from_parts(&[plugin, &key.suffix()])
    }

    /// Plugin `plugin`'s reports (what the agent leading it watches).
    pub fn scope_for(plugin: &PluginId) -> KeyScope<ReportSpec<K>> {
        KeyScope::under(plugin)
    }

    /// Plugin `plugin`'s report on `obj` saying `section`, asking `finalizer` of the
    /// plugin's finalizer.
    pub fn of(
        plugin: &PluginId,
        obj: &Object<K>,
        section: K::Section,
        finalizer: FinalizerAsk,
    ) -> Self {
        let spec = ReportSpec {
            plugin_id: plugin.clone(),
            object: obj.object_key().suffix().to_string(),
            uid: obj.metadata.uid.clone(),
            finalizer,
            kind: PhantomData,
        };
        let mut r = Object::new(&obj.metadata.namespace, obj.metadata.name.clone(), spec);
        r.status = section;
        r
    }

    /// The key of the object reported on.
    pub fn about_key(&self) -> Option<ObjectKey<K>> {
        ObjectKey::parse(&format!("{}/{}", K::DIR, self.spec.object)).ok()
    }

    /// Whether this is plugin `plugin`'s report on `obj` (the same object, under that
    /// plugin's key). It counts only when `plugin` is the object's own, which its
    /// reader knows: an attachment and a volume name it, a snapshot and a group are
    /// their volumes' plugin's until their status records the plugin that holds them.
    pub fn is_about(&self, obj: &Object<K>, plugin: &PluginId) -> bool {
        self.spec.uid == obj.metadata.uid
            && &self.spec.plugin_id == plugin
            && self.key() == Self::key_for(plugin, &obj.object_key()).as_str()
    }
}

impl<K: Reported> Object<K> {
    /// The reported part of its status as plugin `plugin`'s `report` says it, when the
    /// report is about it; as stored otherwise (an object no agent of this version
    /// reported on yet).
    pub fn reported(&self, plugin: &PluginId, report: Option<&Report<K>>) -> K::Section {
        match report.filter(|r| r.is_about(self, plugin)) {
            Some(r) => r.status.clone(),
            None => K::section(&self.status).clone(),
        }
    }

    /// What plugin `plugin`'s report on it asks of the plugin's finalizer.
    pub fn finalizer_asked(&self, plugin: &PluginId, report: Option<&Report<K>>) -> FinalizerAsk {
        report
            .filter(|r| r.is_about(self, plugin))
            .map_or(FinalizerAsk::Unasked, |r| r.spec.finalizer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attachment(plugin: &str, uid: &str) -> Attachment {
        let spec = AttachmentSpec {
            volume: VolumeId::new("v").unwrap(),
            node: NodeName::new("n1").unwrap(),
            plugin_id: PluginId::new(plugin).unwrap(),
            external_id: ExternalVolumeId::new("ext").unwrap(),
            csi_node_id: CsiNodeId::new("n1").unwrap(),
            capability: VolumeCapability {
                access_mode: AccessMode::SingleNodeWriter,
                attachment_mode: AttachmentMode::FileSystem,
            },
            read_only: false,
            detach: false,
            volume_context: None,
        };
        let mut a = Attachment::new(&Namespace::default_ns(), Name::new("v.n1").unwrap(), spec);
        a.metadata.uid = uid.into();
        a
    }

    #[test]
    fn a_report_sits_under_its_plugin_at_its_object_s_key_and_reads_back() {
        let att = attachment("p.example", "u1");
        let st = AttachmentStatus {
            phase: AttachmentPhase::Attached,
            ..Default::default()
        };
        let p = att.spec.plugin_id.clone();
        let r = AttachmentReport::of(&p, &att, st.clone(), FinalizerAsk::Unasked);
        assert_eq!(r.key(), "attachment-reports/p.example/default/v/n1");
        assert_eq!(r.about_key(), Some(att.object_key()));
        assert!(r.is_about(&att, &p));
        assert_eq!(att.reported(&p, Some(&r)), st);
        assert!(r.validate_stored().is_ok());
        // Stored and decoded: the same report.
        let json = serde_json::to_vec(&r).unwrap();
        let back: AttachmentReport = serde_json::from_slice(&json).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn a_report_on_another_object_or_by_another_plugin_is_not_about_it() {
        let att = attachment("p.example", "u1");
        let st = AttachmentStatus {
            phase: AttachmentPhase::Detached,
            ..Default::default()
        };
        let p = att.spec.plugin_id.clone();
        // Made again under the same key.
        let earlier = AttachmentReport::of(
            &p,
            &attachment("p.example", "u0"),
            st.clone(),
            FinalizerAsk::Unasked,
        );
        assert!(!earlier.is_about(&att, &p));
        assert_eq!(att.reported(&p, Some(&earlier)), att.status);
        // Another plugin's, under its own prefix.
        let q = PluginId::new("q.example").unwrap();
        let other = AttachmentReport::of(&q, &att, st, FinalizerAsk::Released);
        assert!(!other.is_about(&att, &p));
        assert_eq!(att.finalizer_asked(&p, Some(&other)), FinalizerAsk::Unasked);
        // An object field that is no key of the kind is refused.
        let mut bad = other.clone();
        bad.spec.object = "default/v".into();
        assert!(bad.validate_stored().is_err());
    }
}
