//! Which writers may speak about an object: one rule for every view of events
//! (`moorctl events`, `events --for`, `describe`, and the console's timelines), written
//! once as `moor::api::event_shown`; this file says where objects are, as the store
//! says when a view loads it.
//!
//! etcd binds an event's source to its writer's key prefix (`agent/N` was written with
//! node N's identity), but any node may write an event about any object. A node's
//! event is shown only when every object it names (its object, and its related
//! object) is on that node: a Claim, Mount,
//! Allocation or Attachment of the node, the Node itself, a Volume claimed or attached
//! there; or when the node hosts the controller service of the object's plugin (its
//! provisioner, attacher and snapshotter act on every volume of that plugin). The
//! controller's events are always shown. The others are counted, and shown on request
//! (`--all-sources`), with their SOURCE.

use std::collections::{BTreeSet, HashMap};

use serde_json::Value;

use super::kind::{self, text, Kind};
use super::Ctx;
use moor::api::Namespace;

/// The node an event was written by, if a node wrote it.
pub fn node_source(event: &Value) -> Option<String> {
    text(event, "/spec/source")
        .strip_prefix("agent/")
        .map(str::to_string)
}

/// Where each object is, as the store says: enough to apply the rule to any event.
#[derive(Default)]
pub struct Placement {
    /// (kind, namespace, name) → the nodes it is on.
    on: HashMap<(String, String, String), BTreeSet<String>>,
    /// plugin id → the nodes hosting its controller service.
    controllers: HashMap<String, BTreeSet<String>>,
    /// plugin id → the nodes hosting any instance of it.
    hosts: HashMap<String, BTreeSet<String>>,
    /// (kind, namespace, name) → the plugin it belongs to (volumes, snapshots,
    /// attachments).
    plugin_of: HashMap<(String, String, String), String>,
}

fn id(kind: Kind, v: &Value) -> (String, String, String) {
    (
        kind.name().to_string(),
        text(v, "/metadata/namespace"),
        text(v, "/metadata/name"),
    )
}

impl Placement {
    /// Reads the objects the rule needs, in every namespace (in `ns` only for an
    /// identity that may read no other: [`kind::list_readable`]).
    pub async fn load(ctx: &Ctx, ns: Option<&Namespace>) -> anyhow::Result<Placement> {
        let mut p = Placement::default();
        let (nodes, _) = kind::list(ctx, Kind::Node, None).await?;
        for n in &nodes {
            let name = text(n, "/metadata/name");
            p.place(id(Kind::Node, n), &name);
            if let Some(plugins) = n.pointer("/status/plugins").and_then(Value::as_object) {
                for (plugin, status) in plugins {
                    p.hosts
                        .entry(plugin.clone())
                        .or_default()
                        .insert(name.clone());
                    if matches!(
                        text(status, "/plugin_type").as_str(),
                        "controller" | "monolith"
                    ) {
                        p.controllers
                            .entry(plugin.clone())
                            .or_default()
                            .insert(name.clone());
                    }
                }
            }
        }
        let (volumes, _) = kind::list_readable(ctx, Kind::Volume, ns).await?;
        let mut volume_plugin = HashMap::new();
        for v in &volumes {
            let plugin = text(v, "/spec/plugin_id");
            volume_plugin.insert(
                (text(v, "/metadata/namespace"), text(v, "/metadata/name")),
                plugin.clone(),
            );
            p.plugin_of.insert(id(Kind::Volume, v), plugin);
        }
        let plugin_of_volume = |v: &Value| {
            volume_plugin
                .get(&(text(v, "/metadata/namespace"), text(v, "/spec/volume")))
                .cloned()
        };
        for kind in [Kind::Claim, Kind::Attachment, Kind::Allocation, Kind::Mount] {
            let (items, _) = kind::list_readable(ctx, kind, ns).await?;
            for item in &items {
                let node = text(item, "/spec/node");
                p.place(id(kind, item), &node);
                if matches!(kind, Kind::Claim | Kind::Attachment) {
                    // The volume is where its claims and attachments are.
                    let volume = (
                        Kind::Volume.name().to_string(),
                        text(item, "/metadata/namespace"),
                        text(item, "/spec/volume"),
                    );
                    p.place(volume, &node);
                }
                if kind == Kind::Attachment {
                    if let Some(plugin) = plugin_of_volume(item) {
                        p.plugin_of.insert(id(kind, item), plugin);
                    }
                }
            }
        }
        let (snapshots, _) = kind::list_readable(ctx, Kind::Snapshot, ns).await?;
        for s in &snapshots {
            if let Some(plugin) = plugin_of_volume(s) {
                p.plugin_of.insert(id(Kind::Snapshot, s), plugin);
            }
        }
        Ok(p)
    }

    fn place(&mut self, object: (String, String, String), node: &str) {
        if !node.is_empty() {
            self.on.entry(object).or_default().insert(node.to_string());
        }
    }

    /// Whether `event` is shown: [`moor::api::event_shown`] over what the store said
    /// when this placement was loaded.
    pub fn shown(&self, event: &Value) -> bool {
        let named: Vec<(String, String, String)> = ["/spec/object", "/spec/related"]
            .iter()
            .filter(|at| event.pointer(at).is_some_and(|o| !o.is_null()))
            .map(|at| {
                (
                    text(event, &format!("{at}/kind")),
                    text(event, &format!("{at}/namespace")),
                    text(event, &format!("{at}/name")),
                )
            })
            .collect();
        moor::api::event_shown(
            self,
            &text(event, "/spec/source"),
            named
                .iter()
                .map(|(k, ns, n)| (k.as_str(), ns.as_str(), n.as_str())),
        )
    }
}

impl moor::api::Whereabouts for Placement {
    fn known(&self, kind: &str, namespace: &str, name: &str) -> bool {
        if kind == Kind::Plugin.name() {
            return self.hosts.contains_key(name);
        }
        let object = (kind.to_string(), namespace.to_string(), name.to_string());
        self.on.contains_key(&object) || self.plugin_of.contains_key(&object)
    }

    fn speaks_about(&self, kind: &str, namespace: &str, name: &str, node: &str) -> bool {
        if kind == Kind::Plugin.name() {
            return self.hosts.get(name).is_some_and(|n| n.contains(node));
        }
        let object = (kind.to_string(), namespace.to_string(), name.to_string());
        self.on.get(&object).is_some_and(|n| n.contains(node))
            || self
                .plugin_of
                .get(&object)
                .and_then(|plugin| self.controllers.get(plugin))
                .is_some_and(|n| n.contains(node))
    }
}

/// What a view says about the events it hid.
pub fn hidden_note(hidden: usize) -> Option<String> {
    (hidden > 0).then(|| {
        format!(
            "({hidden} event(s) written by nodes their object is not on, not shown: --all-sources shows them)"
        )
    })
}
