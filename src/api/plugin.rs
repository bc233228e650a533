//! Plugin: the cluster-wide view of one CSI plugin id, aggregated from the nodes.
//!
//! Writer: the controller.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use super::*;

/// Desired state of a plugin: discovered on nodes; the operator only forgets
/// instances whose node is gone for good (`moorctl plugin deregister`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PluginSpec {
    /// Instances an operator deregistered: node -> the uid of the Node object the
    /// instance was seen on. Only that registration is forgotten: a node that comes
    /// back registers a new Node object and counts again.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub deregistered: BTreeMap<NodeName, String>,
}

/// One instance of a plugin, as the controller last saw it. An instance whose node is
/// gone (its agent's lease expired) stays, unhealthy, until an operator deregisters
/// it: a dead instance shows as 1/2 healthy rather than vanishing as 1/1.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PluginInstance {
    /// Which services the instance provides.
    #[serde(default)]
    pub plugin_type: PluginType,
    /// Its node is live and its probe succeeded.
    #[serde(default)]
    pub healthy: bool,
    /// Why it is not healthy.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// The uid of the Node object it was seen on.
    #[serde(default)]
    pub node_uid: String,
    /// The topology segment its NodeGetInfo reported (node instances): the survey
    /// asks GetCapacity for each, so a template's volume is checked against its node's
    /// segment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology: Option<Topology>,
}

impl PluginInstance {
    /// Whether it provides the controller service.
    pub fn is_controller(&self) -> bool {
        matches!(
            self.plugin_type,
            PluginType::Controller | PluginType::Monolith
        )
    }

    /// Whether it provides the node service.
    pub fn is_node(&self) -> bool {
        matches!(self.plugin_type, PluginType::Node | PluginType::Monolith)
    }
}

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
    /// Every instance by node, live or gone (until deregistered).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub instances: BTreeMap<NodeName, PluginInstance>,
    /// Generation, conditions, last error.
    #[serde(flatten)]
    pub meta: StatusMeta,
}

/// The key (below the prefix) of plugin `id`'s GetCapacity answers, whole and per
/// topology segment: a JSON list of [`CapacityEntry`], written by the agent leading the
/// plugin's controller (its etcd role may write that key and no Plugin object).
pub fn capacity_key(id: &PluginId) -> String {
    format!("capacities/{id}")
}

/// The most entries a capacity report holds (one per topology segment asked about).
pub const MAX_CAPACITY_ENTRIES: usize = 256;

/// Reads an agent's report of `what` (untrusted): at most [`NODE_WRITTEN_MAX_BYTES`],
/// and at most `max` of the entries `count` counts.
fn parse_report<T: serde::de::DeserializeOwned>(
    value: &[u8],
    what: &str,
    count: fn(&T) -> usize,
    max: usize,
) -> Result<T, String> {
    if value.len() > NODE_WRITTEN_MAX_BYTES {
        return Err(format!(
            "{} bytes; a {what} is at most {NODE_WRITTEN_MAX_BYTES}",
            value.len()
        ));
    }
    let report: T = serde_json::from_slice(value).map_err(|e| format!("not a {what}: {e}"))?;
    let n = count(&report);
    if n > max {
        return Err(format!("{n} entries; at most {max}"));
    }
    Ok(report)
}

/// Reads a capacity report written by an agent (untrusted: bounded in size and count).
pub fn parse_capacity(value: &[u8]) -> Result<Vec<CapacityEntry>, String> {
    parse_report(value, "capacity report", Vec::len, MAX_CAPACITY_ENTRIES)
}

/// The key of plugin `id`'s snapshot list: the plugin's own ListSnapshots (every
/// snapshot it holds, moor's or not), written by the agent leading the plugin's
/// controller at each survey, for `moorctl volume snapshot list --plugin`.
pub fn snapshot_list_key(id: &PluginId) -> String {
    format!("snapshot-lists/{id}")
}

/// The most snapshots a plugin's list holds (the rest is counted, not listed).
pub const MAX_LISTED_SNAPSHOTS: usize = 256;

/// A plugin's snapshot list, as its survey last read it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginSnapshots {
    /// Up to [`MAX_LISTED_SNAPSHOTS`] of them, in the plugin's order.
    #[serde(default)]
    pub snapshots: Vec<ListedSnapshot>,
    /// How many more the plugin listed.
    #[serde(default)]
    pub more: u64,
}

/// One entry of ListSnapshots.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListedSnapshot {
    /// The plugin's id of the snapshot.
    pub snapshot_id: String,
    /// The plugin's id of the volume it was taken of.
    #[serde(default)]
    pub source_volume_id: String,
    /// Its size (0: unknown).
    #[serde(default)]
    pub size_bytes: u64,
    /// When it was cut, seconds since the epoch (none: unknown).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_secs: Option<i64>,
    /// ready_to_use.
    #[serde(default)]
    pub ready: bool,
}

/// Reads a snapshot list written by an agent (untrusted: bounded in size and count).
pub fn parse_snapshot_list(value: &[u8]) -> Result<PluginSnapshots, String> {
    parse_report(
        value,
        "snapshot list",
        |l: &PluginSnapshots| l.snapshots.len(),
        MAX_LISTED_SNAPSHOTS,
    )
}

/// The key of plugin `id`'s unknown volumes: volumes its ListVolumes holds that no
/// Volume of moor names (a restored etcd snapshot older than their creation, or
/// volumes made outside moor), listed in two survey passes in a row. Written by the
/// agent leading the plugin's controller, for `moorctl get volumes --orphaned`; moor
/// never deletes them.
pub fn unknown_volumes_key(id: &PluginId) -> String {
    format!("unknown-volumes/{id}")
}

/// The most unknown volumes a plugin's report names (the rest is counted).
pub const MAX_UNKNOWN_VOLUMES: usize = 256;

/// A plugin's unknown volumes, as its survey last found them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnknownVolumes {
    /// Up to [`MAX_UNKNOWN_VOLUMES`] of them, by volume id.
    #[serde(default)]
    pub volumes: Vec<UnknownVolume>,
    /// How many more.
    #[serde(default)]
    pub more: u64,
}

/// One volume the plugin lists that moor does not know.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnknownVolume {
    /// The plugin's id of the volume.
    pub volume_id: String,
    /// Its capacity (0: unknown).
    #[serde(default)]
    pub capacity_bytes: u64,
    /// The CSI node ids the plugin says it is published to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub published_nodes: Vec<String>,
}

/// Reads an unknown-volumes report written by an agent (untrusted: bounded).
pub fn parse_unknown_volumes(value: &[u8]) -> Result<UnknownVolumes, String> {
    parse_report(
        value,
        "unknown-volumes report",
        |l: &UnknownVolumes| l.volumes.len(),
        MAX_UNKNOWN_VOLUMES,
    )
}

/// One GetCapacity answer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapacityEntry {
    /// The segment asked about; empty: the plugin as a whole.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub topology: Topology,
    /// available_capacity.
    pub available_bytes: u64,
    /// maximum_volume_size, when reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub maximum_volume_size: Option<u64>,
    /// minimum_volume_size, when reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minimum_volume_size: Option<u64>,
}

impl CapacityEntry {
    /// The largest volume this entry says can be created now.
    pub fn fits(&self) -> u64 {
        match self.maximum_volume_size {
            Some(max) if max > 0 => self.available_bytes.min(max),
            _ => self.available_bytes,
        }
    }
}

impl PluginStatus {
    /// Whether the plugin can serve its volumes' claims: a healthy node instance, and
    /// a healthy controller instance unless it is known not to need ControllerPublish.
    pub fn serves_volumes(&self) -> bool {
        self.nodes_healthy > 0
            && (self.controller_required == Some(false) || self.controllers_healthy > 0)
    }
}

/// A plugin object.
pub type Plugin = Object<PluginSpec>;

impl Plugin {
    /// The key of plugin `id`.
    pub fn key_for(id: &PluginId) -> ObjectKey<PluginSpec> {
        ObjectKey::from_parts(&[id])
    }
}
