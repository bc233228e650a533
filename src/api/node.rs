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

/// What a plugin reported of its capabilities, by CSI enum name
/// (e.g. `PUBLISH_UNPUBLISH_VOLUME`, `STAGE_UNSTAGE_VOLUME`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginCapabilities {
    /// GetPluginCapabilities' service and expansion capabilities.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub plugin: BTreeSet<String>,
    /// ControllerGetCapabilities' RPC capabilities.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub controller: BTreeSet<String>,
    /// NodeGetCapabilities' RPC capabilities.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub node: BTreeSet<String>,
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
    /// NodeGetInfo's accessible topology.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology: Option<Topology>,
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
        for (what, set) in [
            ("plugin", &caps.plugin),
            ("controller", &caps.controller),
            ("node", &caps.node),
        ] {
            if set.len() > MAX_PLUGIN_ITEMS {
                return Err(format!(
                    "{} {what} capabilities; at most {MAX_PLUGIN_ITEMS}",
                    set.len()
                ));
            }
            let bad = |c: &String| {
                c.is_empty()
                    || c.len() > MAX_PLUGIN_ITEMS
                    || !c
                        .bytes()
                        .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
            };
            if let Some(c) = set.iter().find(|c| bad(c)) {
                return Err(format!(
                    "{what} capability {:?} is not a CSI capability name",
                    printable_bounded(c, 64)
                ));
            }
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
