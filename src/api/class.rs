//! VolumeClass: what "fast" or "cheap" means, named by a volume, a template or an
//! engine's `-o class=`, so that users need not write a plugin's parameters.
//!
//! Writer: the operator (`moorctl apply`). Readers: the front doors that make volumes
//! (moorctl `apply`, the controller's templates, an agent's engine endpoint), through
//! the one function here, [`resolve`]; agents may read classes (the endpoint).
//!
//! A class fills a volume when the volume is made: the plugin, parameters, mutable
//! parameters, capabilities, mount options (filesystem) and the deletion rule the
//! volume leaves empty are copied from it, and a value the volume sets that contradicts
//! the class is refused, by name. A change to a class therefore changes the volumes
//! made after it, never one made before; only `allow_expansion` is read when a
//! volume's capacity is raised (moorctl `apply`, a retained template volume grown).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use super::*;

/// What becomes of a created volume's storage when its Volume is deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OnDelete {
    /// DeleteVolume in the plugin (the default).
    #[default]
    Delete,
    /// The Volume goes, the plugin's volume stays (no DeleteVolume; an event names its
    /// external id, to register it again).
    Retain,
}

impl std::fmt::Display for OnDelete {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OnDelete::Delete => "delete",
            OnDelete::Retain => "retain",
        })
    }
}

fn yes() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

/// Desired state of a volume class.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VolumeClassSpec {
    /// The CSI plugin of its volumes.
    #[serde(default)]
    pub plugin_id: PluginId,
    /// CreateVolume parameters.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub parameters: BTreeMap<String, String>,
    /// Parameters the plugin may change on a live volume.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub mutable_parameters: BTreeMap<String, String>,
    /// The capabilities of a volume that names none.
    #[serde(
        default,
        deserialize_with = "crate::api::tight_vec",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub capabilities: Vec<VolumeCapability>,
    /// Mount options (the filesystem among them) of a volume that sets none.
    #[serde(default, skip_serializing_if = "MountOptions::is_empty")]
    pub mount_options: MountOptions,
    /// Whether a volume's capacity may be raised (true by default).
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub allow_expansion: bool,
    /// What deleting a volume made from it does to its storage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_delete: Option<OnDelete>,
    /// The Secrets (in each volume's namespace) its volumes' calls carry, per family;
    /// filled into each new volume like the parameters.
    #[serde(default, skip_serializing_if = "SecretRefs::is_empty")]
    pub secret_refs: SecretRefs,
    /// The class of a volume or template that names neither a class nor a plugin.
    /// Several defaults (a race between two writers): the oldest counts.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub default: bool,
}

/// A capability, where only one is needed to check the rest.
fn any_capability() -> VolumeCapability {
    VolumeCapability {
        access_mode: AccessMode::SingleNodeWriter,
        attachment_mode: AttachmentMode::FileSystem,
    }
}

/// A class has no observed state.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VolumeClassStatus {
    /// Generation, conditions, last error.
    #[serde(flatten)]
    pub meta: StatusMeta,
}

impl Spec for VolumeClassSpec {
    const KIND: &'static str = "VolumeClass";
    const DIR: &'static str = "volumeclasses";
    const NAMESPACED: bool = false;
    const ALIASES: &'static [&'static str] = &["class", "classes", "volumeclass", "vc"];
    const PHASE: Option<&'static str> = None;
    const CHECKED: bool = true;
    const AGENT: AgentAccess = AgentAccess::Read;
    type Status = VolumeClassStatus;

    fn validate(&self, errors: &mut ValidationErrors) {
        errors.check_id("plugin_id", self.plugin_id.validate());
        // What the class puts into a volume is checked as that volume would be.
        let mut as_volume = VolumeSpec {
            plugin_id: self.plugin_id.clone(),
            capabilities: self.capabilities.clone(),
            mount_options: Rare::new(self.mount_options.clone()),
            parameters: Rare::new(self.parameters.clone()),
            mutable_parameters: Rare::new(self.mutable_parameters.clone()),
            ..Default::default()
        };
        if as_volume.capabilities.is_empty() {
            as_volume.capabilities.push(any_capability());
        }
        let mut own = ValidationErrors::default();
        as_volume.validate(&mut own);
        for e in own.0 {
            if e.field != "plugin_id" {
                errors.push(e.field, e.message);
            }
        }
        check_map_sizes("parameters", &self.parameters, errors);
        check_map_sizes("mutable_parameters", &self.mutable_parameters, errors);
        self.secret_refs.validate("secret_refs", errors);
    }
}

/// Parameters as CSI carries them: at most 64 entries, keys of 1 to 256 bytes and
/// values of at most 4096, without control characters.
pub(crate) fn check_map_sizes(
    field: &str,
    map: &BTreeMap<String, String>,
    errors: &mut ValidationErrors,
) {
    if map.len() > MAX_LABELS {
        errors.push(
            field,
            format!("{} entries; at most {MAX_LABELS}", map.len()),
        );
    }
    for (k, v) in map {
        if k.is_empty() || k.len() > 256 || k.chars().any(char::is_control) {
            let shown: String = k.chars().take(64).collect();
            errors.push(
                format!("{field}.{}", printable(&shown)),
                "a key is 1 to 256 bytes without control characters",
            );
        } else if v.len() > 4096 || v.chars().any(char::is_control) {
            errors.push(
                format!("{field}.{}", printable(k)),
                "a value is up to 4096 bytes without control characters",
            );
        }
    }
}

/// A volume class object.
pub type VolumeClass = Object<VolumeClassSpec>;

impl VolumeClass {
    /// The key of class `name`.
    pub fn key_for(name: impl std::fmt::Display) -> ObjectKey<VolumeClassSpec> {
        ObjectKey::from_parts(&[&name])
    }
}

/// The fields a class fills, borrowed from a volume's spec or a template.
pub struct Classed<'a> {
    /// The class named (recorded once picked).
    pub class: &'a mut Option<Name>,
    /// The plugin.
    pub plugin_id: &'a mut PluginId,
    /// CreateVolume parameters.
    pub parameters: &'a mut BTreeMap<String, String>,
    /// Mutable parameters.
    pub mutable_parameters: &'a mut BTreeMap<String, String>,
    /// Capabilities.
    pub capabilities: &'a mut Vec<VolumeCapability>,
    /// Mount options.
    pub mount_options: &'a mut MountOptions,
}

impl VolumeSpec {
    /// The fields a class fills.
    pub fn classed(&mut self) -> Classed<'_> {
        Classed {
            class: &mut self.class,
            plugin_id: &mut self.plugin_id,
            parameters: &mut self.parameters,
            mutable_parameters: &mut self.mutable_parameters,
            capabilities: &mut self.capabilities,
            mount_options: &mut self.mount_options,
        }
    }
}

impl VolumeTemplate {
    /// The fields a class fills.
    pub fn classed(&mut self) -> Classed<'_> {
        Classed {
            class: &mut self.class,
            plugin_id: &mut self.plugin_id,
            parameters: &mut self.parameters,
            mutable_parameters: &mut self.mutable_parameters,
            capabilities: &mut self.capabilities,
            mount_options: &mut self.mount_options,
        }
    }
}

impl VolumeClassSpec {
    /// Fills what `target` leaves empty from this class (named `class`), and refuses,
    /// field by field, what `target` sets against it.
    pub fn fill(&self, class: &Name, target: &mut Classed<'_>, errors: &mut ValidationErrors) {
        let against = |what: &str| format!("contradicts class {class}, which sets {what}");
        if target.plugin_id.is_empty() {
            *target.plugin_id = self.plugin_id.clone();
        } else if *target.plugin_id != self.plugin_id {
            errors.push("plugin_id", against(&format!("plugin {}", self.plugin_id)));
        }
        for (field, ours, theirs) in [
            ("parameters", &self.parameters, &mut *target.parameters),
            (
                "mutable_parameters",
                &self.mutable_parameters,
                &mut *target.mutable_parameters,
            ),
        ] {
            for (k, v) in ours {
                match theirs.get(k) {
                    None => {
                        theirs.insert(k.clone(), v.clone());
                    }
                    Some(given) if given == v => {}
                    Some(_) => errors.push(
                        format!("{field}.{}", printable(k)),
                        against(&format!("{:?}", printable(v))),
                    ),
                }
            }
        }
        if target.capabilities.is_empty() {
            *target.capabilities = self.capabilities.clone();
        }
        let (ours, theirs) = (&self.mount_options, &mut *target.mount_options);
        fill_one(&mut theirs.fs_type, &ours.fs_type, || {
            errors.push("mount_options.fs_type", against("another filesystem"))
        });
        if theirs.mount_flags.is_empty() {
            theirs.mount_flags = ours.mount_flags.clone();
        } else if !ours.mount_flags.is_empty() && theirs.mount_flags != ours.mount_flags {
            // Flags are redacted: named, never shown.
            errors.push("mount_options.mount_flags", against("other mount flags"));
        }
        fill_one(&mut theirs.mount_group, &ours.mount_group, || {
            errors.push("mount_options.mount_group", against("another mount group"))
        });
        fill_one(&mut theirs.selinux_label, &ours.selinux_label, || {
            errors.push("mount_options.selinux_label", against("another label"))
        });
    }
}

/// Fills an empty option from the class's, calling `contradicts` when both are set
/// and differ.
fn fill_one(theirs: &mut Option<String>, ours: &Option<String>, contradicts: impl FnOnce()) {
    match (theirs.as_ref(), ours) {
        (None, Some(o)) => *theirs = Some(o.clone()),
        (Some(t), Some(o)) if t != o => contradicts(),
        _ => {}
    }
}

/// The class a volume or template uses: the one it names, else the default class
/// when it names no plugin either, else none. A named class that does not exist is
/// an error saying so.
pub fn pick<'a>(
    classes: &'a [impl AsRef<VolumeClass>],
    named: Option<&Name>,
    plugin_set: bool,
) -> Result<Option<&'a VolumeClass>, String> {
    match named {
        Some(name) => classes
            .iter()
            .map(AsRef::as_ref)
            .find(|c| &c.metadata.name == name && !c.is_deleting())
            .map(Some)
            .ok_or_else(|| format!("volume class {name} not found")),
        None if plugin_set => Ok(None),
        None => Ok(classes
            .iter()
            .map(AsRef::as_ref)
            .filter(|c| c.spec.default && !c.is_deleting())
            .min_by(|a, b| {
                (a.metadata.creation_timestamp, &a.metadata.name)
                    .cmp(&(b.metadata.creation_timestamp, &b.metadata.name))
            })),
    }
}

impl AsRef<VolumeClass> for VolumeClass {
    fn as_ref(&self) -> &VolumeClass {
        self
    }
}

/// What every front door says of a volume that names no plugin once its class is
/// resolved.
const PLUGIN_REQUIRED: &str =
    "is required: name a plugin or a class, or make a VolumeClass the default";

impl Classed<'_> {
    /// Picks the class (see [`pick`]), fills what this leaves empty from it and
    /// records its name; returns the class's deletion rule. A problem is pushed to
    /// `errors` by field.
    fn take_class<'c, C: AsRef<VolumeClass>>(
        &mut self,
        classes: &'c [C],
        errors: &mut ValidationErrors,
    ) -> Option<&'c VolumeClass> {
        match pick(classes, self.class.as_ref(), !self.plugin_id.is_empty()) {
            Err(e) => {
                errors.push("class", e);
                None
            }
            Ok(Some(class)) => {
                let name = class.metadata.name.clone();
                class.spec.fill(&name, self, errors);
                *self.class = Some(name);
                Some(class)
            }
            Ok(None) => None,
        }
    }

    /// For what this leaves empty, what its class filled in `stored` when that was
    /// made (maps key by key).
    fn keep_from(&mut self, stored: &VolumeSpec) {
        if self.class.is_none() {
            *self.class = stored.class.clone();
        }
        if self.plugin_id.is_empty() {
            *self.plugin_id = stored.plugin_id.clone();
        }
        for (ours, theirs) in [
            (&mut *self.parameters, &*stored.parameters),
            (&mut *self.mutable_parameters, &*stored.mutable_parameters),
        ] {
            for (k, v) in theirs {
                ours.entry(k.clone()).or_insert_with(|| v.clone());
            }
        }
        if self.capabilities.is_empty() {
            *self.capabilities = stored.capabilities.clone();
        }
        if self.mount_options.is_empty() {
            *self.mount_options = (*stored.mount_options).clone();
        }
    }
}

/// Resolves a new volume's class (see [`pick`]): fills the spec from it, records the
/// class's name and deletion rule, and checks what a volume needs once resolved (a
/// plugin and at least one capability). Every problem is named by its `spec.` field.
pub fn resolve(
    spec: &mut VolumeSpec,
    classes: &[impl AsRef<VolumeClass>],
) -> Result<(), ValidationErrors> {
    let mut errors = ValidationErrors::default();
    if let Some(class) = spec.classed().take_class(classes, &mut errors) {
        if spec.on_delete.is_none() {
            spec.on_delete = class.spec.on_delete;
        }
        if !class.spec.secret_refs.is_empty() {
            let name = class.metadata.name.clone();
            let mut refs = (*spec.secret_refs).clone();
            refs.fill_from(&class.spec.secret_refs, &name, "secret_refs", &mut errors);
            spec.secret_refs = Rare::new(refs);
        }
    }
    spec.check_resolved(&mut errors);
    errors.into_result()
}

/// Resolves a template's class the same way, into the template the volume is made
/// from (and its deletion rule).
pub fn resolve_template(
    template: &VolumeTemplate,
    classes: &[impl AsRef<VolumeClass>],
) -> Result<(VolumeTemplate, Option<OnDelete>), String> {
    let mut t = template.clone();
    let mut errors = ValidationErrors::default();
    let on_delete = t
        .classed()
        .take_class(classes, &mut errors)
        .and_then(|c| c.spec.on_delete);
    if t.plugin_id.is_empty() {
        errors.push("plugin_id", PLUGIN_REQUIRED);
    }
    errors
        .into_result()
        .map(|()| (t, on_delete))
        .map_err(|e| e.to_string())
}

/// A template met against the volume it made before with the same class (`stored`):
/// what the template leaves empty is what the class filled then, never the class as
/// it is now; returns it with the volume's deletion rule.
pub fn template_as_made(
    template: &VolumeTemplate,
    stored: &VolumeSpec,
) -> (VolumeTemplate, Option<OnDelete>) {
    let mut t = template.clone();
    t.classed().keep_from(stored);
    (t, stored.on_delete)
}

/// An update of a stored volume a class made (`stored.class`): what the manifest
/// leaves empty keeps what the class filled at creation (a class is never applied
/// again), and its maps keep the keys the class added. Nothing changes for a volume
/// made without a class.
pub fn keep_class_fill(spec: &mut VolumeSpec, stored: &VolumeSpec) {
    if stored.class.is_none() {
        return;
    }
    spec.classed().keep_from(stored);
    if spec.on_delete.is_none() {
        spec.on_delete = stored.on_delete;
    }
    if !stored.secret_refs.is_empty() {
        let mut refs = (*spec.secret_refs).clone();
        refs.keep_from(&stored.secret_refs);
        spec.secret_refs = Rare::new(refs);
    }
}

/// Why raising `stored`'s capacity to `spec`'s is refused: its class, as it is now,
/// does not allow expansion.
pub fn expansion_refused(
    spec: &VolumeSpec,
    stored: &VolumeSpec,
    classes: &[impl AsRef<VolumeClass>],
) -> Option<String> {
    let name = stored.class.as_ref()?;
    let raised = match (spec.capacity_min, stored.capacity_min) {
        (Some(new), Some(old)) => new > old,
        (Some(_), None) => true,
        _ => false,
    };
    let class = classes
        .iter()
        .map(AsRef::as_ref)
        .find(|c| &c.metadata.name == name)?;
    (raised && !class.spec.allow_expansion).then(|| {
        format!("spec.capacity_min: class {name} does not allow expansion (allow_expansion: false)")
    })
}

impl VolumeSpec {
    /// What a volume needs once its class is resolved: a plugin and a capability.
    pub fn check_resolved(&self, errors: &mut ValidationErrors) {
        if self.plugin_id.is_empty() {
            errors.push("plugin_id", PLUGIN_REQUIRED);
        }
        if self.capabilities.is_empty() {
            errors.push(
                "capabilities",
                "at least one {access_mode, attachment_mode} is required (here or in the class)",
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(name: &str, default: bool) -> VolumeClass {
        VolumeClass::new(
            &Namespace::default(),
            Name::new(name).unwrap(),
            VolumeClassSpec {
                plugin_id: PluginId::new("p").unwrap(),
                parameters: [("tier".to_string(), "ssd".to_string())].into(),
                capabilities: vec![any_capability()],
                mount_options: MountOptions {
                    fs_type: Some("xfs".into()),
                    ..Default::default()
                },
                allow_expansion: true,
                on_delete: Some(OnDelete::Retain),
                default,
                ..Default::default()
            },
        )
    }

    #[test]
    fn a_class_fills_what_a_volume_leaves_empty_and_refuses_what_contradicts_it() {
        let classes = vec![class("fast", false), class("std", true)];
        let mut spec = VolumeSpec {
            class: Some(Name::new("fast").unwrap()),
            parameters: Rare::new([("zone".to_string(), "a".to_string())].into()),
            ..Default::default()
        };
        resolve(&mut spec, &classes).unwrap();
        assert_eq!(spec.plugin_id.as_str(), "p");
        assert_eq!(spec.parameters.get("tier").map(String::as_str), Some("ssd"));
        assert_eq!(spec.parameters.get("zone").map(String::as_str), Some("a"));
        assert_eq!(spec.mount_options.fs_type.as_deref(), Some("xfs"));
        assert_eq!(spec.on_delete, Some(OnDelete::Retain));
        assert_eq!(spec.capabilities.len(), 1);

        let mut bad = VolumeSpec {
            class: Some(Name::new("fast").unwrap()),
            plugin_id: PluginId::new("other").unwrap(),
            parameters: Rare::new([("tier".to_string(), "hdd".to_string())].into()),
            mount_options: Rare::new(MountOptions {
                fs_type: Some("ext4".into()),
                ..Default::default()
            }),
            ..Default::default()
        };
        let e = resolve(&mut bad, &classes).unwrap_err().to_string();
        for field in ["plugin_id", "parameters.tier", "mount_options.fs_type"] {
            assert!(e.contains(field), "{field} not named: {e}");
        }

        // No class, no plugin: the default class.
        let mut plain = VolumeSpec::default();
        resolve(&mut plain, &classes).unwrap();
        assert_eq!(plain.class.as_ref().map(Name::as_str), Some("std"));
        // A plugin and no class: no class at all.
        let mut own = VolumeSpec {
            plugin_id: PluginId::new("q").unwrap(),
            capabilities: vec![any_capability()],
            ..Default::default()
        };
        resolve(&mut own, &classes).unwrap();
        assert!(own.class.is_none() && own.parameters.is_empty());
        // Nothing to go on.
        let none: Vec<VolumeClass> = Vec::new();
        let e = resolve(&mut VolumeSpec::default(), &none).unwrap_err();
        assert!(e.to_string().contains("plugin_id"), "{e}");
        let mut missing = VolumeSpec {
            class: Some(Name::new("gone").unwrap()),
            ..Default::default()
        };
        let e = resolve(&mut missing, &classes).unwrap_err();
        assert!(e.to_string().contains("volume class gone not found"), "{e}");
    }

    #[test]
    fn a_class_names_its_secrets_for_each_volume_and_an_update_keeps_them() {
        let mut fast = class("fast", false);
        fast.spec.secret_refs = SecretRefs {
            controller: Some(Name::new("ctl").unwrap()),
            node_stage: Some(Name::new("node").unwrap()),
            ..Default::default()
        };
        let classes = vec![fast];
        let mut spec = VolumeSpec {
            class: Some(Name::new("fast").unwrap()),
            secret_refs: Rare::new(SecretRefs {
                snapshot: Some(Name::new("snap").unwrap()),
                ..Default::default()
            }),
            ..Default::default()
        };
        resolve(&mut spec, &classes).unwrap();
        let names: Vec<&str> = spec
            .secret_refs
            .names()
            .iter()
            .map(|n| n.as_str())
            .collect();
        assert_eq!(names, ["ctl", "node", "snap"]);
        // An update that leaves them out keeps what the class named at creation.
        let mut update = VolumeSpec {
            class: Some(Name::new("fast").unwrap()),
            ..Default::default()
        };
        keep_class_fill(&mut update, &spec);
        assert_eq!(update.secret_refs, spec.secret_refs);
        // Naming another Secret for a family the class names is refused by field.
        let mut bad = VolumeSpec {
            class: Some(Name::new("fast").unwrap()),
            secret_refs: Rare::new(SecretRefs {
                controller: Some(Name::new("mine").unwrap()),
                ..Default::default()
            }),
            ..Default::default()
        };
        let e = resolve(&mut bad, &classes).unwrap_err().to_string();
        assert!(
            e.contains("secret_refs.controller: contradicts class fast, which names Secret ctl"),
            "{e}"
        );
    }

    #[test]
    fn a_template_is_resolved_like_a_volume() {
        let classes = vec![class("fast", false)];
        let t = VolumeTemplate {
            class: Some(Name::new("fast").unwrap()),
            ..Default::default()
        };
        let (t, on_delete) = resolve_template(&t, &classes).unwrap();
        assert_eq!(t.plugin_id.as_str(), "p");
        assert_eq!(on_delete, Some(OnDelete::Retain));
        let bad = VolumeTemplate {
            class: Some(Name::new("fast").unwrap()),
            parameters: [("tier".to_string(), "hdd".to_string())].into(),
            ..Default::default()
        };
        assert!(resolve_template(&bad, &classes)
            .unwrap_err()
            .contains("parameters.tier"));
    }

    #[test]
    fn hostile_classes_are_refused_by_field() {
        let mut c = class("x", false).spec;
        c.parameters.insert("k\u{1b}".into(), "v".into());
        c.mount_options.fs_type = Some("a\nb".into());
        let mut e = ValidationErrors::default();
        c.validate(&mut e);
        let e = e.to_string();
        assert!(
            e.contains("parameters") && e.contains("mount_options"),
            "{e}"
        );
        let mut e = ValidationErrors::default();
        VolumeClassSpec::default().validate(&mut e);
        assert!(e.to_string().contains("plugin_id"), "{e}");
    }
}
