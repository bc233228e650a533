//! Secret: credentials a plugin's calls carry, stored once and named by the volumes,
//! classes and snapshots that use them (per RPC family: [`SecretRefs`]), so that a
//! rotation is one write: every later call reads the Secret as it is then.
//!
//! Keyed `secrets/PLUGIN/NS/NAME`, plugin first, so that etcd can grant an agent
//! leading a controller plugin that plugin's Secrets and no other's
//! (deploy/etcd/roles.sh); node-only agents get no grant at all: the controller copies
//! what NodeStage and NodePublish need into each claim, sealed with that node's key,
//! and copies it again when the Secret changes. The data is sealed at rest like a
//! volume's secrets (the cluster's key file), and never shown.
//!
//! Writer: the operator (`moorctl apply`; `moorctl delete` refuses while a volume, a
//! class or a snapshot names it). Readers: the agent leading the plugin (controller,
//! expand and snapshot families, at call time) and the controller (node families,
//! into claims).

use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use super::*;

/// The most keys a Secret holds.
pub const MAX_SECRET_KEYS: usize = 64;
/// The longest value of a Secret (a PEM bundle fits).
pub const MAX_SECRET_VALUE: usize = 64 * 1024;

/// Desired state of a Secret: whose it is and what it holds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SecretSpec {
    /// The plugin whose calls carry it (part of its key: only that plugin's agents
    /// may read it).
    #[serde(default)]
    pub plugin_id: PluginId,
    /// The key-value pairs sent as a call's `secrets` (sealed at rest, never shown:
    /// every field named `secrets` is redacted in output).
    #[serde(default)]
    pub secrets: Secrets,
}

/// A Secret has no observed state.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SecretStatus {
    /// Generation, conditions, last error.
    #[serde(flatten)]
    pub meta: StatusMeta,
}

impl Spec for SecretSpec {
    const KIND: &'static str = "Secret";
    const DIR: &'static str = "secrets";
    const NAMESPACED: bool = true;
    const ALIASES: &'static [&'static str] = &["secret"];
    const PHASE: Option<&'static str> = None;
    const CHECKED: bool = true;
    const AGENT: AgentAccess = AgentAccess::OwnPlugin;
    const KEY_SEGMENTS: usize = 3;
    const KEY_NAMESPACE_FIRST: bool = false;
    type Status = SecretStatus;

    fn key_suffix(&self, meta: &ObjectMeta) -> String {
        format!("{}/{}/{}", self.plugin_id, meta.namespace, meta.name)
    }

    fn secret_fields(&mut self) -> Vec<SecretField<'_>> {
        vec![SecretField {
            field: "secrets",
            node: None,
            secrets: &mut self.secrets,
        }]
    }

    fn validate(&self, errors: &mut ValidationErrors) {
        errors.check_id("plugin_id", self.plugin_id.validate());
        if let Err(e) = self.secrets.check() {
            errors.push("secrets", e);
        }
        // Sealed data is checked where it is opened; open data here.
        let Ok(data) = self.secrets.expose() else {
            return;
        };
        if data.is_empty() {
            errors.push("secrets", "at least one key");
        }
        if data.len() > MAX_SECRET_KEYS {
            errors.push(
                "secrets",
                format!("{} keys; at most {MAX_SECRET_KEYS}", data.len()),
            );
        }
        for (k, v) in data {
            if k.is_empty() || k.len() > 256 || k.chars().any(char::is_control) {
                let shown: String = k.chars().take(64).collect();
                errors.push(
                    format!("secrets.{}", printable(&shown)),
                    "a key is 1 to 256 bytes without control characters",
                );
            } else if v.len() > MAX_SECRET_VALUE {
                // The value itself is never repeated.
                errors.push(
                    format!("secrets.{}", printable(k)),
                    format!("the value is {} bytes; at most {MAX_SECRET_VALUE}", v.len()),
                );
            }
        }
    }
}

/// A Secret object.
pub type Secret = Object<SecretSpec>;

impl Secret {
    /// The key of plugin `plugin`'s Secret `name` in `ns`.
    pub fn key_for(plugin: &PluginId, ns: &Namespace, name: &Name) -> ObjectKey<SecretSpec> {
        ObjectKey::from_parts(&[plugin, ns, name])
    }

    /// Plugin `plugin`'s Secrets (what the agent leading it watches).
    pub fn scope_for(plugin: &PluginId) -> KeyScope<SecretSpec> {
        KeyScope::under(plugin)
    }
}

/// The families of CSI calls a Secret is named for, as Kubernetes' external sidecars
/// split them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SecretFamily {
    /// CreateVolume, DeleteVolume, ControllerPublish and Unpublish,
    /// ValidateVolumeCapabilities, ControllerModifyVolume.
    Controller,
    /// NodeStageVolume (and NodeExpandVolume, which runs beside it).
    NodeStage,
    /// NodePublishVolume.
    NodePublish,
    /// ControllerExpandVolume.
    Expand,
    /// CreateSnapshot, DeleteSnapshot, GetSnapshot, ListSnapshots and the group
    /// snapshot calls.
    Snapshot,
}

impl SecretFamily {
    /// Every family, in manifest order.
    pub const ALL: [SecretFamily; 5] = [
        SecretFamily::Controller,
        SecretFamily::NodeStage,
        SecretFamily::NodePublish,
        SecretFamily::Expand,
        SecretFamily::Snapshot,
    ];

    /// As manifests spell it (the field of [`SecretRefs`]).
    pub fn as_str(self) -> &'static str {
        match self {
            SecretFamily::Controller => "controller",
            SecretFamily::NodeStage => "node_stage",
            SecretFamily::NodePublish => "node_publish",
            SecretFamily::Expand => "expand",
            SecretFamily::Snapshot => "snapshot",
        }
    }
}

impl fmt::Display for SecretFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The Secret (in the object's namespace, of its plugin) each family of calls
/// carries; a family named here replaces the object's own `secrets` for its calls.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretRefs {
    /// CreateVolume, DeleteVolume, ControllerPublish/Unpublish, Validate, Modify.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controller: Option<Name>,
    /// NodeStageVolume and NodeExpandVolume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_stage: Option<Name>,
    /// NodePublishVolume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_publish: Option<Name>,
    /// ControllerExpandVolume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expand: Option<Name>,
    /// The snapshot calls of the volume's snapshots that name none of their own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<Name>,
}

impl Empty for SecretRefs {
    fn empty() -> &'static Self {
        static EMPTY: std::sync::OnceLock<SecretRefs> = std::sync::OnceLock::new();
        EMPTY.get_or_init(Default::default)
    }
}

impl SecretRefs {
    /// Whether it names no Secret.
    pub fn is_empty(&self) -> bool {
        self == Self::empty()
    }

    /// The field of `family`.
    pub fn get(&self, family: SecretFamily) -> Option<&Name> {
        self.slot(family).as_ref()
    }

    fn slot(&self, family: SecretFamily) -> &Option<Name> {
        match family {
            SecretFamily::Controller => &self.controller,
            SecretFamily::NodeStage => &self.node_stage,
            SecretFamily::NodePublish => &self.node_publish,
            SecretFamily::Expand => &self.expand,
            SecretFamily::Snapshot => &self.snapshot,
        }
    }

    fn slot_mut(&mut self, family: SecretFamily) -> &mut Option<Name> {
        match family {
            SecretFamily::Controller => &mut self.controller,
            SecretFamily::NodeStage => &mut self.node_stage,
            SecretFamily::NodePublish => &mut self.node_publish,
            SecretFamily::Expand => &mut self.expand,
            SecretFamily::Snapshot => &mut self.snapshot,
        }
    }

    /// Every Secret named, once each.
    pub fn names(&self) -> Vec<&Name> {
        let mut names: Vec<&Name> = SecretFamily::ALL
            .iter()
            .filter_map(|f| self.get(*f))
            .collect();
        names.sort();
        names.dedup();
        names
    }

    /// Whether it names `name`.
    pub fn names_secret(&self, name: &Name) -> bool {
        SecretFamily::ALL.iter().any(|f| self.get(*f) == Some(name))
    }

    /// Checks each name, at `field.FAMILY`.
    pub fn validate(&self, field: &str, errors: &mut ValidationErrors) {
        for family in SecretFamily::ALL {
            if let Some(name) = self.get(family) {
                errors.check_id(&format!("{field}.{family}"), name.validate());
            }
        }
    }

    /// Fills the families this leaves out from `class` (named `class_name`), refusing
    /// one named otherwise, by field.
    pub fn fill_from(
        &mut self,
        class: &SecretRefs,
        class_name: &Name,
        field: &str,
        errors: &mut ValidationErrors,
    ) {
        for family in SecretFamily::ALL {
            let Some(theirs) = class.get(family) else {
                continue;
            };
            let ours = self.slot_mut(family);
            match ours {
                None => *ours = Some(theirs.clone()),
                Some(given) if given == theirs => {}
                Some(_) => errors.push(
                    format!("{field}.{family}"),
                    format!("contradicts class {class_name}, which names Secret {theirs}"),
                ),
            }
        }
    }

    /// For the families this leaves out, what `stored` names (a class filled them).
    pub fn keep_from(&mut self, stored: &SecretRefs) {
        for family in SecretFamily::ALL {
            let ours = self.slot_mut(family);
            if ours.is_none() {
                *ours = stored.get(family).cloned();
            }
        }
    }
}

/// A Secret a call needs is not there (or not yet in this process's cache).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "Secret {namespace}/{name} of plugin {plugin}, named for the {family} calls, does not exist"
)]
pub struct MissingSecret {
    /// Its namespace.
    pub namespace: Namespace,
    /// Its name.
    pub name: Name,
    /// Its plugin.
    pub plugin: PluginId,
    /// The family that names it.
    pub family: SecretFamily,
}

/// The Secret `refs` names for `family`, of `plugin` in `ns`, through `lookup`:
/// `Ok(None)` when the family names none (the object's own secrets apply).
pub fn referenced_secret(
    refs: &SecretRefs,
    family: SecretFamily,
    plugin: &PluginId,
    ns: &Namespace,
    lookup: impl Fn(&ObjectKey<SecretSpec>) -> Option<Arc<Secret>>,
) -> Result<Option<Arc<Secret>>, MissingSecret> {
    refs.get(family)
        .map(|name| named_secret(name, family, plugin, ns, lookup))
        .transpose()
}

/// Secret `name` of `plugin` in `ns`, named for `family`, through `lookup`.
fn named_secret(
    name: &Name,
    family: SecretFamily,
    plugin: &PluginId,
    ns: &Namespace,
    lookup: impl Fn(&ObjectKey<SecretSpec>) -> Option<Arc<Secret>>,
) -> Result<Arc<Secret>, MissingSecret> {
    lookup(&Secret::key_for(plugin, ns, name)).ok_or_else(|| MissingSecret {
        namespace: ns.clone(),
        name: name.clone(),
        plugin: plugin.clone(),
        family,
    })
}

impl AttachInputs {
    /// The inputs as `family`'s calls see them (of a volume of `plugin` in `ns`): the
    /// secrets replaced by the Secret `secret_refs` names for the family (borrowed as
    /// they are when none is named).
    pub fn for_family(
        &self,
        family: SecretFamily,
        plugin: &PluginId,
        ns: &Namespace,
        lookup: impl Fn(&ObjectKey<SecretSpec>) -> Option<Arc<Secret>>,
    ) -> Result<Cow<'_, AttachInputs>, MissingSecret> {
        match referenced_secret(&self.secret_refs, family, plugin, ns, lookup)? {
            None => Ok(Cow::Borrowed(self)),
            Some(secret) => {
                let mut inputs = self.clone();
                inputs.secrets = Rare::new(secret.spec.secrets.clone());
                Ok(Cow::Owned(inputs))
            }
        }
    }
}

impl Volume {
    /// The volume as `family`'s calls see it: its `secrets` replaced by the Secret
    /// its `secret_refs` names for the family (borrowed as it is when none is named).
    pub fn for_family(
        &self,
        family: SecretFamily,
        lookup: impl Fn(&ObjectKey<SecretSpec>) -> Option<Arc<Secret>>,
    ) -> Result<Cow<'_, Volume>, MissingSecret> {
        match referenced_secret(
            &self.spec.secret_refs,
            family,
            &self.spec.plugin_id,
            &self.metadata.namespace,
            lookup,
        )? {
            None => Ok(Cow::Borrowed(self)),
            Some(secret) => {
                let mut v = self.clone();
                v.spec.secrets = Rare::new(secret.spec.secrets.clone());
                Ok(Cow::Owned(v))
            }
        }
    }

    /// The Secrets this volume names for its node's calls, as they are now (what a
    /// claim of it carries: [`NodeSecrets`]). Nothing is copied: the caller compares
    /// with, or puts into, a claim.
    pub fn node_secrets(
        &self,
        lookup: impl Fn(&ObjectKey<SecretSpec>) -> Option<Arc<Secret>>,
    ) -> Result<NodeSecrets, MissingSecret> {
        self.spec.node_secrets(&self.metadata.namespace, lookup)
    }
}

impl VolumeSpec {
    /// [`Volume::node_secrets`] of a volume of this spec in namespace `ns`.
    pub fn node_secrets(
        &self,
        ns: &Namespace,
        lookup: impl Fn(&ObjectKey<SecretSpec>) -> Option<Arc<Secret>>,
    ) -> Result<NodeSecrets, MissingSecret> {
        let resolve =
            |family| referenced_secret(&self.secret_refs, family, &self.plugin_id, ns, &lookup);
        Ok(NodeSecrets {
            stage: resolve(SecretFamily::NodeStage)?,
            publish: resolve(SecretFamily::NodePublish)?,
        })
    }
}

impl Snapshot {
    /// The snapshot as its calls see it: its own `secrets` replaced by the Secret its
    /// `secret_ref` names (of the volume's plugin `plugin`), if it names one.
    pub fn with_secret(
        &self,
        plugin: &PluginId,
        lookup: impl Fn(&ObjectKey<SecretSpec>) -> Option<Arc<Secret>>,
    ) -> Result<Cow<'_, Snapshot>, MissingSecret> {
        let Some(name) = &self.spec.secret_ref else {
            return Ok(Cow::Borrowed(self));
        };
        let ns = &self.metadata.namespace;
        let secret = named_secret(name, SecretFamily::Snapshot, plugin, ns, lookup)?;
        let mut s = self.clone();
        s.spec.secrets = secret.spec.secrets.clone();
        Ok(Cow::Owned(s))
    }
}

/// The Secrets a volume names for its node's calls ([`Volume::node_secrets`]): what a
/// claim of it carries is derived from these and the volume's own `secrets`.
#[derive(Debug, Clone, Default)]
pub struct NodeSecrets {
    /// NodeStage's Secret (none: the volume's `secrets`).
    pub stage: Option<Arc<Secret>>,
    /// NodePublish's Secret (none: NodeStage's).
    pub publish: Option<Arc<Secret>>,
}

impl NodeSecrets {
    /// What NodeStage (and NodeExpand) carries for `volume`: the Secret, else its own.
    pub fn stage_secrets<'a>(&'a self, volume: &'a VolumeSpec) -> &'a Secrets {
        match &self.stage {
            Some(s) => &s.spec.secrets,
            None => &volume.secrets,
        }
    }

    /// What NodePublish carries for `volume` when it differs from NodeStage's (none:
    /// the same, and the claim keeps one copy).
    pub fn publish_secrets<'a>(&'a self, volume: &'a VolumeSpec) -> Option<&'a Secrets> {
        let stage = self.stage_secrets(volume);
        self.publish
            .as_ref()
            .map(|s| &s.spec.secrets)
            .filter(|p| *p != stage)
    }

    /// Whether `claim`, of `volume`, carries them.
    pub fn carried_by(&self, volume: &VolumeSpec, claim: &ClaimSpec) -> bool {
        *claim.node_secrets == *self.stage_secrets(volume)
            && match self.publish_secrets(volume) {
                Some(p) => *claim.node_publish_secrets == *p,
                None => claim.node_publish_secrets.is_empty(),
            }
    }

    /// Puts a copy of them into `claim`, of `volume`.
    pub fn put_into(&self, volume: &VolumeSpec, claim: &mut ClaimSpec) {
        claim.node_secrets = Rare::new(self.stage_secrets(volume).clone());
        claim.node_publish_secrets = self
            .publish_secrets(volume)
            .map(|p| Rare::new(p.clone()))
            .unwrap_or_default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn secret(name: &str, data: &[(&str, &str)]) -> Arc<Secret> {
        let map: BTreeMap<String, String> = data
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Arc::new(Secret::new(
            &Namespace::default_ns(),
            Name::new(name).unwrap(),
            SecretSpec {
                plugin_id: PluginId::new("p").unwrap(),
                secrets: Secrets::new(map),
            },
        ))
    }

    fn volume(refs: SecretRefs) -> Volume {
        let mut v = Volume::new(
            &Namespace::default_ns(),
            Name::new("v").unwrap(),
            VolumeSpec {
                plugin_id: PluginId::new("p").unwrap(),
                ..Default::default()
            },
        );
        v.spec.secrets = Secrets::new([("inline".into(), "i".into())].into()).into();
        v.spec.secret_refs = Rare::new(refs);
        v
    }

    fn book(secrets: Vec<Arc<Secret>>) -> impl Fn(&ObjectKey<SecretSpec>) -> Option<Arc<Secret>> {
        move |k| {
            secrets
                .iter()
                .find(|s| s.object_key().as_str() == k.as_str())
                .cloned()
        }
    }

    fn keys(s: &Secrets) -> Vec<String> {
        s.expose().unwrap().keys().cloned().collect()
    }

    #[test]
    fn a_family_named_replaces_the_inline_secrets_for_its_calls_only() {
        let v = volume(SecretRefs {
            controller: Some(Name::new("ctl").unwrap()),
            ..Default::default()
        });
        let lookup = book(vec![secret("ctl", &[("admin", "a")])]);
        let c = v.for_family(SecretFamily::Controller, &lookup).unwrap();
        assert!(matches!(c, Cow::Owned(_)));
        assert_eq!(keys(&c.spec.secrets), ["admin"]);
        let e = v.for_family(SecretFamily::Expand, &lookup).unwrap();
        assert!(matches!(e, Cow::Borrowed(_)), "expand names none");
        assert_eq!(keys(&e.spec.secrets), ["inline"]);
        let missing = v.for_family(SecretFamily::Controller, book(vec![]));
        let err = missing.unwrap_err().to_string();
        assert_eq!(
            err,
            "Secret default/ctl of plugin p, named for the controller calls, does not exist"
        );
    }

    #[test]
    fn node_secrets_carry_publish_apart_only_when_it_differs() {
        let v = volume(SecretRefs {
            node_stage: Some(Name::new("st").unwrap()),
            node_publish: Some(Name::new("pub").unwrap()),
            ..Default::default()
        });
        let lookup = book(vec![
            secret("st", &[("stage", "s")]),
            secret("pub", &[("publish", "p")]),
        ]);
        let n = v.node_secrets(&lookup).unwrap();
        assert_eq!(keys(n.stage_secrets(&v.spec)), ["stage"]);
        assert_eq!(keys(n.publish_secrets(&v.spec).unwrap()), ["publish"]);
        let mut c = ClaimSpec::default();
        assert!(!n.carried_by(&v.spec, &c));
        n.put_into(&v.spec, &mut c);
        assert!(n.carried_by(&v.spec, &c));
        // The same data for both: one copy.
        let same = book(vec![
            secret("st", &[("k", "v")]),
            secret("pub", &[("k", "v")]),
        ]);
        assert!(v
            .node_secrets(&same)
            .unwrap()
            .publish_secrets(&v.spec)
            .is_none());
        // None named: the inline secrets, as before Secrets existed.
        let plain = volume(SecretRefs::default());
        let n = plain.node_secrets(book(vec![])).unwrap();
        assert_eq!(keys(n.stage_secrets(&plain.spec)), ["inline"]);
        assert!(n.publish_secrets(&plain.spec).is_none());
        assert!(v.node_secrets(book(vec![])).is_err());
    }

    #[test]
    fn a_class_fills_refs_and_a_contradiction_is_refused_by_field() {
        let class = SecretRefs {
            controller: Some(Name::new("a").unwrap()),
            snapshot: Some(Name::new("s").unwrap()),
            ..Default::default()
        };
        let mut refs = SecretRefs {
            controller: Some(Name::new("b").unwrap()),
            ..Default::default()
        };
        let mut e = ValidationErrors::default();
        refs.fill_from(&class, &Name::new("fast").unwrap(), "secret_refs", &mut e);
        assert_eq!(
            e.to_string(),
            "secret_refs.controller: contradicts class fast, which names Secret a"
        );
        assert_eq!(refs.snapshot.as_ref().map(Name::as_str), Some("s"));
        assert_eq!(
            refs.names().iter().map(|n| n.as_str()).collect::<Vec<_>>(),
            ["b", "s"]
        );
    }

    #[test]
    fn a_secret_is_keyed_by_plugin_and_refuses_hostile_data() {
        let s = secret("creds", &[("k", "v")]);
        assert_eq!(s.object_key().as_str(), "secrets/p/default/creds");
        assert_eq!(
            Secret::scope_for(&PluginId::new("p").unwrap()).as_str(),
            "secrets/p/"
        );
        let cases: Vec<(Vec<(String, String)>, &str)> = vec![
            (vec![], "secrets: at least one key"),
            (vec![("a\u{7}".into(), "v".into())], "without control"),
            (vec![(String::new(), "v".into())], "1 to 256 bytes"),
            (
                vec![("big".into(), "x".repeat(MAX_SECRET_VALUE + 1))],
                "at most 65536",
            ),
            (
                (0..=MAX_SECRET_KEYS)
                    .map(|i| (format!("k{i}"), "v".into()))
                    .collect(),
                "keys; at most 64",
            ),
        ];
        for (data, want) in cases {
            let spec = SecretSpec {
                plugin_id: PluginId::new("p").unwrap(),
                secrets: Secrets::new(data.into_iter().collect()),
            };
            let mut e = ValidationErrors::default();
            spec.validate(&mut e);
            let text = e.to_string();
            assert!(text.contains(want), "{want}: {text}");
            assert!(!text.contains("xxxx"), "a value is never repeated");
        }
        // A multi-line value (a PEM) is data, not a control character problem.
        let pem = SecretSpec {
            plugin_id: PluginId::new("p").unwrap(),
            secrets: Secrets::new([("ca.pem".into(), "-----BEGIN\nAAA\n-----END\n".into())].into()),
        };
        let mut e = ValidationErrors::default();
        pem.validate(&mut e);
        assert!(e.is_empty(), "{e}");
        assert!(format!("{pem:?}").contains("[redacted]") && !format!("{pem:?}").contains("AAA"));
    }
}
