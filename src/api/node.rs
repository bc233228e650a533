//! Node: a machine running `moord agent`, with the CSI plugins it supervises.
//!
//! Writer: the agent of the node. The Node lives under its agent's etcd lease (so a
//! dead agent's Node is collected), but its liveness is [`NodeLiveness`]: the agent
//! rewrites it every TTL/3, and the controller removes a Node it has not seen change for
//! the TTL by its own clock, whoever keeps the etcd lease alive (etcd 3.4 lets any
//! authenticated user keep any lease alive).

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

use super::*;

/// Which CSI services a plugin instance provides.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PluginType {
    /// Node service only.
    #[default]
    Node,
    /// Controller service only.
    Controller,
    /// Both.
    Monolith,
}

/// A ControllerGetCapabilities RPC capability (the CSI enum).
pub use crate::csi::v1::controller_service_capability::rpc::Type as ControllerRpc;
/// A GroupControllerGetCapabilities RPC capability (the CSI enum).
pub use crate::csi::v1::group_controller_service_capability::rpc::Type as GroupRpc;
/// A NodeGetCapabilities RPC capability (the CSI enum).
pub use crate::csi::v1::node_service_capability::rpc::Type as NodeRpc;
/// A GetPluginCapabilities service capability (the CSI enum).
pub use crate::csi::v1::plugin_capability::service::Type as PluginService;

/// A capability asked about by type; its name is how CSI spells it, and how a
/// [`CapabilitySet`] stores it.
pub trait Capability: Copy {
    /// `PUBLISH_UNPUBLISH_VOLUME`, `STAGE_UNSTAGE_VOLUME`, ...
    fn name(self) -> &'static str;
}

impl Capability for ControllerRpc {
    fn name(self) -> &'static str {
        self.as_str_name()
    }
}

impl Capability for NodeRpc {
    fn name(self) -> &'static str {
        self.as_str_name()
    }
}

impl Capability for GroupRpc {
    fn name(self) -> &'static str {
        self.as_str_name()
    }
}

/// A GetPluginCapabilities capability: a service, or how volumes expand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PluginCapability {
    /// A service capability.
    Service(PluginService),
    /// VolumeExpansion ONLINE: a volume in use can be expanded.
    ExpansionOnline,
    /// VolumeExpansion OFFLINE: only a volume published nowhere can be expanded.
    ExpansionOffline,
}

impl Capability for PluginCapability {
    fn name(self) -> &'static str {
        match self {
            PluginCapability::Service(s) => s.as_str_name(),
            PluginCapability::ExpansionOnline => "VOLUME_EXPANSION_ONLINE",
            PluginCapability::ExpansionOffline => "VOLUME_EXPANSION_OFFLINE",
        }
    }
}

/// The capabilities of one kind a plugin reported. Stored as their CSI names (a name
/// this moor does not know is kept, and shown), asked about by type only: a misspelt
/// capability does not compile.
#[derive(Clone, PartialEq, Eq)]
pub struct CapabilitySet<K> {
    names: BTreeSet<String>,
    kind: std::marker::PhantomData<fn() -> K>,
}

impl<K> Default for CapabilitySet<K> {
    fn default() -> Self {
        CapabilitySet {
            names: BTreeSet::new(),
            kind: std::marker::PhantomData,
        }
    }
}

impl<K> std::fmt::Debug for CapabilitySet<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(&self.names).finish()
    }
}

impl<K> Serialize for CapabilitySet<K> {
    fn serialize<Ser: serde::Serializer>(&self, s: Ser) -> Result<Ser::Ok, Ser::Error> {
        self.names.serialize(s)
    }
}

impl<'de, K> Deserialize<'de> for CapabilitySet<K> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(CapabilitySet::from_names(BTreeSet::<String>::deserialize(
            d,
        )?))
    }
}

impl<K: Capability> CapabilitySet<K> {
    /// Whether the plugin reported `cap`.
    pub fn has(&self, cap: K) -> bool {
        self.names.contains(cap.name())
    }

    /// Adds `cap`.
    pub fn insert(&mut self, cap: K) {
        self.names.insert(cap.name().to_string());
    }
}

impl<K> CapabilitySet<K> {
    /// The set of these names, as a plugin answered them.
    pub fn from_names(names: impl IntoIterator<Item = String>) -> Self {
        CapabilitySet {
            names: names.into_iter().collect(),
            kind: std::marker::PhantomData,
        }
    }

    /// The names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.names.iter().map(String::as_str)
    }

    /// How many.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Whether none was reported.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }
}

impl<K: Capability> FromIterator<K> for CapabilitySet<K> {
    fn from_iter<I: IntoIterator<Item = K>>(caps: I) -> Self {
        CapabilitySet::from_names(caps.into_iter().map(|c| c.name().to_string()))
    }
}

/// What a plugin reported of its capabilities (stored by CSI enum name, e.g.
/// `PUBLISH_UNPUBLISH_VOLUME`, `STAGE_UNSTAGE_VOLUME`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginCapabilities {
    /// GetPluginCapabilities' service and expansion capabilities.
    #[serde(default, skip_serializing_if = "CapabilitySet::is_empty")]
    pub plugin: CapabilitySet<PluginCapability>,
    /// ControllerGetCapabilities' RPC capabilities.
    #[serde(default, skip_serializing_if = "CapabilitySet::is_empty")]
    pub controller: CapabilitySet<ControllerRpc>,
    /// NodeGetCapabilities' RPC capabilities.
    #[serde(default, skip_serializing_if = "CapabilitySet::is_empty")]
    pub node: CapabilitySet<NodeRpc>,
    /// GroupControllerGetCapabilities' RPC capabilities (a plugin with
    /// GROUP_CONTROLLER_SERVICE).
    #[serde(default, skip_serializing_if = "CapabilitySet::is_empty")]
    pub group: CapabilitySet<GroupRpc>,
}

/// One plugin as its node's agent observes it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodePluginStatus {
    /// Which services this instance provides.
    #[serde(default)]
    pub plugin_type: PluginType,
    /// Probe succeeded and reported ready.
    #[serde(default)]
    pub healthy: bool,
    /// Why it is unhealthy.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub health_message: String,
    /// GetPluginInfo's name.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub provider: String,
    /// GetPluginInfo's vendor_version.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub version: String,
    /// Reported capabilities.
    #[serde(default)]
    pub capabilities: PluginCapabilities,
    /// NodeGetInfo's node_id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub csi_node_id: Option<CsiNodeId>,
    /// NodeGetInfo's max_volumes_per_node; absent means no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_volumes_per_node: Option<u64>,
    /// The agent is set to send SELinux labels to this node plugin
    /// (`--plugin ...,selinux-mount=true`): it stages a volume once per node with one
    /// label, so admission keeps the labels of a volume's claims on the node alike.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub selinux_mount: bool,
    /// NodeGetInfo's accessible topology.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology: Option<Topology>,
    /// NodeGetStorageHealth (GET_STORAGE_HEALTH, CSI 1.13): the storage's adverse
    /// conditions as this node sees it; empty when it sees none, absent when the plugin
    /// does not report it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_health: Option<Vec<HealthCondition>>,
    /// When the plugin was last fingerprinted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_seen: Option<Timestamp>,
}

/// Desired state of a node: nothing yet (agents register themselves).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeSpec {}

impl Spec for NodeSpec {
    const KIND: &'static str = "Node";
    const DIR: &'static str = "nodes";
    const NAMESPACED: bool = false;
    const ALIASES: &'static [&'static str] = &[];
    const PHASE: Option<&'static str> = None;
    const CHECKED: bool = true;
    const AGENT: AgentAccess = AgentAccess::OwnNode;
    type Status = NodeStatus;

    fn validate(&self, _errors: &mut ValidationErrors) {}

    fn validate_status(status: &NodeStatus, errors: &mut ValidationErrors) {
        if status.plugins.len() > MAX_NODE_PLUGINS {
            errors.push(
                "plugins",
                format!(
                    "{} plugins; a node reports at most {MAX_NODE_PLUGINS}",
                    status.plugins.len()
                ),
            );
            return;
        }
        for (id, plugin) in &status.plugins {
            let field = format!("plugins.{}", printable_bounded(id.as_str(), 64));
            errors.check_id(&field, id.validate());
            if let Err(e) = plugin.check() {
                errors.push(field, e);
            }
        }
    }
}

/// The most plugins one node reports.
pub const MAX_NODE_PLUGINS: usize = 32;
/// The longest text a node reports for a plugin (health message, provider, version).
pub const MAX_PLUGIN_TEXT: usize = 1024;
/// The most capabilities of one kind, topology segments, and their names' length.
const MAX_PLUGIN_ITEMS: usize = 64;

impl NodePluginStatus {
    /// What a node may report of a plugin: bounded texts, capability names as CSI
    /// spells them (`[A-Z0-9_]`), bounded topology. The agent checks a fingerprint
    /// with it before writing, the controller every Node it reads.
    pub fn check(&self) -> Result<(), String> {
        for (what, text) in [
            ("health_message", &self.health_message),
            ("provider", &self.provider),
            ("version", &self.version),
        ] {
            if text.len() > MAX_PLUGIN_TEXT {
                return Err(format!(
                    "{what} is {} bytes; at most {MAX_PLUGIN_TEXT}",
                    text.len()
                ));
            }
        }
        let caps = &self.capabilities;
        let sets: [(&str, Vec<&str>); 4] = [
            ("plugin", caps.plugin.names().collect()),
            ("controller", caps.controller.names().collect()),
            ("node", caps.node.names().collect()),
            ("group", caps.group.names().collect()),
        ];
        for (what, names) in sets {
            let len = names.len();
            if len > MAX_PLUGIN_ITEMS {
                return Err(format!(
                    "{len} {what} capabilities; at most {MAX_PLUGIN_ITEMS}"
                ));
            }
            let bad = |c: &&str| {
                c.is_empty()
                    || c.len() > MAX_PLUGIN_ITEMS
                    || !c
                        .bytes()
                        .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
            };
            if let Some(c) = names.into_iter().find(bad) {
                return Err(format!(
                    "{what} capability {:?} is not a CSI capability name",
                    printable_bounded(c, 64)
                ));
            }
        }
        let health = self.storage_health.as_deref().unwrap_or_default();
        if health.len() > MAX_PLUGIN_ITEMS {
            return Err(format!(
                "{} storage health conditions; at most {MAX_PLUGIN_ITEMS}",
                health.len()
            ));
        }
        if let Some(h) = health.iter().find(|h| {
            [&h.status, &h.reason, &h.message, &h.capability]
                .iter()
                .any(|t| t.len() > MAX_PLUGIN_TEXT / 4)
        }) {
            return Err(format!(
                "storage health condition {:?} has a text over {} bytes",
                printable_bounded(&h.status, 64),
                MAX_PLUGIN_TEXT / 4
            ));
        }
        if let Some(t) = &self.topology {
            if t.len() > MAX_PLUGIN_ITEMS {
                return Err(format!(
                    "{} topology segments; at most {MAX_PLUGIN_ITEMS}",
                    t.len()
                ));
            }
            if t.iter().any(|(k, v)| k.len() > 320 || v.len() > 320) {
                return Err("a topology segment is over 320 bytes".into());
            }
        }
        Ok(())
    }
}

/// The agent's renewal record: every renewal changes the Node, and a reader judges it
/// by when it last saw a change, never by a timestamp the agent wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeLiveness {
    /// How long the Node lasts without a renewal, in milliseconds.
    #[serde(default)]
    pub ttl_ms: u64,
    /// Renewals so far in this registration.
    #[serde(default)]
    pub renewals: u64,
}

/// The bounds the controller applies to a Node's own TTL.
pub const NODE_TTL_BOUNDS: (std::time::Duration, std::time::Duration) = (
    std::time::Duration::from_secs(1),
    std::time::Duration::from_secs(600),
);

impl NodeLiveness {
    /// The TTL a reader honours, within [`NODE_TTL_BOUNDS`].
    pub fn ttl(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.ttl_ms).clamp(NODE_TTL_BOUNDS.0, NODE_TTL_BOUNDS.1)
    }
}

/// Observed state of a node.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// Each supervised plugin by id.
    #[serde(default)]
    pub plugins: BTreeMap<PluginId, NodePluginStatus>,
    /// The agent's renewals (absent from an agent older than renewal records, whose
    /// Node is judged by its etcd lease alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub liveness: Option<NodeLiveness>,
    /// Generation, conditions, last error.
    #[serde(flatten)]
    pub meta: StatusMeta,
}

/// A node object.
pub type Node = Object<NodeSpec>;

impl Node {
    /// The key of node `name`.
    pub fn key_for(name: &NodeName) -> ObjectKey<NodeSpec> {
        ObjectKey::from_parts(&[name])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capabilities_are_stored_by_name_and_asked_about_by_type() {
        let json = r#"{"controller": ["PUBLISH_UNPUBLISH_VOLUME", "SOMETHING_NEWER"],
            "node": ["STAGE_UNSTAGE_VOLUME"], "plugin": ["VOLUME_EXPANSION_OFFLINE"]}"#;
        let caps: PluginCapabilities = serde_json::from_str(json).unwrap();
        assert!(caps.controller.has(ControllerRpc::PublishUnpublishVolume));
        assert!(!caps.controller.has(ControllerRpc::ExpandVolume));
        assert!(caps.node.has(NodeRpc::StageUnstageVolume));
        assert!(caps.plugin.has(PluginCapability::ExpansionOffline));
        assert!(!caps.plugin.has(PluginCapability::ExpansionOnline));
        // A name this moor does not know is kept, and written back as it was.
        let back: serde_json::Value = serde_json::to_value(&caps).unwrap();
        assert_eq!(
            back["controller"],
            serde_json::json!(["PUBLISH_UNPUBLISH_VOLUME", "SOMETHING_NEWER"])
        );
        // The typed names are CSI's.
        let mut set = CapabilitySet::<NodeRpc>::default();
        set.insert(NodeRpc::VolumeMountGroup);
        assert_eq!(set.names().collect::<Vec<_>>(), ["VOLUME_MOUNT_GROUP"]);
        assert_eq!(
            PluginCapability::Service(PluginService::ControllerService).name(),
            "CONTROLLER_SERVICE"
        );
    }
}
