//! Plugin: the cluster-wide view of one CSI plugin id, aggregated from the nodes.
//!
//! Writer: the controller.

use serde::{Deserialize, Serialize};

use super::*;

/// Desired state of a plugin: nothing (plugins are discovered on nodes).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PluginSpec {}

impl Spec for PluginSpec {
    const KIND: &'static str = "Plugin";
    const DIR: &'static str = "plugins";
    const NAMESPACED: bool = false;
    const ALIASES: &'static [&'static str] = &[];
    const PHASE: Option<&'static str> = None;
    const CHECKED: bool = true;
    const AGENT: AgentAccess = AgentAccess::Read;
    type Status = PluginStatus;

    fn validate(&self, _errors: &mut ValidationErrors) {}
}

/// Aggregated state of a plugin (the columns of `moorctl plugin status`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PluginStatus {
    /// GetPluginInfo's name.
    #[serde(default)]
    pub provider: String,
    /// GetPluginInfo's vendor_version.
    #[serde(default)]
    pub version: String,
    /// Whether volumes need ControllerPublish (PUBLISH_UNPUBLISH_VOLUME); `None` until
    /// a controller instance has answered its first fingerprint. Unknown blocks every
    /// claim of the plugin before the node: it never means "not needed".
    #[serde(default)]
    pub controller_required: Option<bool>,
    /// Healthy controller instances.
    #[serde(default)]
    pub controllers_healthy: u32,
    /// All controller instances.
    #[serde(default)]
    pub controllers_expected: u32,
    /// Healthy node instances.
    #[serde(default)]
    pub nodes_healthy: u32,
    /// All node instances.
    #[serde(default)]
    pub nodes_expected: u32,
    /// Generation, conditions, last error.
    #[serde(flatten)]
    pub meta: StatusMeta,
}

/// A plugin object.
pub type Plugin = Object<PluginSpec>;

impl Plugin {
    /// The key of plugin `id`.
    pub fn key_for(id: &PluginId) -> ObjectKey<PluginSpec> {
        ObjectKey::from_parts(&[id])
    }
}
