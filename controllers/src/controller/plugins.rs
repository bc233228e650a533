//! The plugin reconciler: one Plugin object per plugin id, aggregated from the Node
//! objects of the agents that run it.
//!
//! Expected flow:
//! 1. Record the instances by node: each live node's, and each earlier one whose Node
//!    is gone (its lease expired), kept unhealthy until an operator deregisters it
//!    (`spec.deregistered` names that Node's uid). A live node that stops listing the
//!    plugin has no instance of it any more. Count them: controllers (controller
//!    or monolith) and nodes (node or monolith), expected and healthy; provider and
//!    version from a healthy instance.
//! 2. `controller_required`: a controller instance advertises PUBLISH_UNPUBLISH_VOLUME.
//!    Unknown (`None`) until a controller instance answered a fingerprint; while none
//!    is registered the last answer is kept, so a controller plugin that restarts does
//!    not make claims skip ControllerPublish.
//! 3. A plugin with no instance left is deleted.

use moor::api::*;
use moor::runtime::controller::{Action, Config, Controller};
use moor::runtime::metrics::ControllerMetrics;
use moor::store::StoreError;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

use super::context::{Ctx, Informers};

/// Runs until `stop`.
pub async fn run(
    ctx: Ctx,
    inf: &Informers,
    config: Config,
    metrics: ControllerMetrics,
    stop: CancellationToken,
) {
    let this = Arc::new(ctx);
    Controller::new("plugins", this.plugins.clone(), config)
        .with_metrics(metrics)
        .owns(inf.plugins.subscribe())
        .watches(super::nodes::without_renewals(inf.nodes.subscribe()), {
            // A node's plugins now and the ones it listed before: a plugin a live node
            // stops listing must drop that node's instance.
            type Keys = Vec<ObjectKey<PluginSpec>>;
            let listed: std::sync::Mutex<HashMap<String, Keys>> = Default::default();
            move |n: &Node| {
                let now: Keys = n.status.plugins.keys().map(Plugin::key_for).collect();
                let mut listed = listed.lock().unwrap_or_else(|p| p.into_inner());
                let before = listed.insert(n.key(), now.clone()).unwrap_or_default();
                let gone: Keys = before.into_iter().filter(|k| !now.contains(k)).collect();
                let mut keys = now;
                keys.extend(gone);
                keys
            }
        })
        // A conflict (the cache lags a write) is retried soon by the runtime's error
        // policy, and counted as a failure if it persists.
        .run(reconcile, this, stop)
        .await;
}

async fn reconcile(ctx: Arc<Ctx>, plugin_key: ObjectKey<PluginSpec>) -> Result<Action, StoreError> {
    let ctx = &*ctx;
    ctx.ready().await;
    let key = plugin_key.as_str();
    let id = plugin_key.name();
    let Ok(name) = Name::new(id) else {
        return Ok(Action::AwaitChange);
    };
    let nodes = ctx.nodes.state();
    let live: Vec<(&Node, &NodePluginStatus)> = nodes
        .iter()
        .filter_map(|n| {
            n.status
                .plugins
                .iter()
                .find(|(p, _)| p.as_str() == id)
                .map(|(_, s)| (&**n, s))
        })
        .collect();
    let current = ctx.plugins.get(key);
    let present = |node: &NodeName| ctx.nodes.get(&Node::key_for(node)).is_some();
    let instances = instances(&live, current.as_deref(), &present);
    if instances.is_empty() {
        if let Some(revision) = ctx.plugins.malformed(key) {
            ctx.writer
                .replace_malformed(&plugin_key, revision, None)
                .await?;
            return Ok(Action::AwaitChange);
        }
        if let Some(p) = &current {
            match ctx.writer.delete_read(p).await {
                Ok(_) | Err(StoreError::NotFound { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        return Ok(Action::AwaitChange);
    }
    let status = status(&live, current.as_deref(), instances);
    // Garbage stored over the Plugin: the controller writes its status and keeps its
    // spec, so it writes back what it knows (the last valid spec, if any, and the
    // status it derives), exactly over that value.
    if let Some(revision) = ctx.plugins.malformed(key) {
        let mut p = match &current {
            Some(p) => (**p).clone(),
            None => Plugin::new(&Namespace::default(), name, PluginSpec::default()),
        };
        p.status = status;
        ctx.writer
            .replace_malformed(&plugin_key, revision, Some(&p))
            .await?;
        return Ok(Action::AwaitChange);
    }
    match current {
        None => {
            let mut p = Plugin::new(&Namespace::default(), name, PluginSpec::default());
            p.status = status;
            ctx.writer.create(&p).await?;
        }
        Some(p) if p.status != status => {
            let mut p = (*p).clone();
            p.status = status;
            ctx.writer.replace_status(&p).await?;
        }
        Some(_) => {}
    }
    Ok(Action::AwaitChange)
}

/// Whether claims of the plugin go through ControllerPublish: a controller instance
/// advertises PUBLISH_UNPUBLISH_VOLUME. Only instances that answered a fingerprint
/// count (one that never did has no capabilities to go by); while none has, the last
/// answer (`current`'s) is kept, so a controller plugin that restarts does not make
/// claims skip ControllerPublish. `None`: not known yet.
fn controller_required(
    live: &[(&Node, &NodePluginStatus)],
    current: Option<&Plugin>,
) -> Option<bool> {
    let mut fingerprinted = live
        .iter()
        .map(|(_, s)| *s)
        .filter(|s| matches!(s.plugin_type, PluginType::Controller | PluginType::Monolith))
        .filter(|s| !s.capabilities.plugin.is_empty() || s.healthy)
        .peekable();
    if fingerprinted.peek().is_none() {
        return current.and_then(|p| p.status.controller_required);
    }
    Some(fingerprinted.any(|s| {
        s.capabilities
            .controller
            .has(ControllerRpc::PublishUnpublishVolume)
    }))
}

/// The plugin's status from its live instances (`live`), what the Plugin said
/// (`current`) and its `instances` ([`instances`]).
fn status(
    live: &[(&Node, &NodePluginStatus)],
    current: Option<&Plugin>,
    instances: BTreeMap<NodeName, PluginInstance>,
) -> PluginStatus {
    let controller_required = controller_required(live, current);
    let source = live
        .iter()
        .map(|(_, s)| *s)
        .find(|s| s.healthy)
        .or(live.first().map(|(_, s)| *s));
    let count = |side: fn(&PluginInstance) -> bool, healthy: bool| {
        instances
            .values()
            .filter(|i| side(i) && (i.healthy || !healthy))
            .count() as u32
    };
    PluginStatus {
        provider: source
            .map(|s| s.provider.clone())
            .or(current.as_ref().map(|p| p.status.provider.clone()))
            .unwrap_or_default(),
        version: source
            .map(|s| s.version.clone())
            .or(current.as_ref().map(|p| p.status.version.clone()))
            .unwrap_or_default(),
        controller_required,
        controllers_healthy: count(PluginInstance::is_controller, true),
        controllers_expected: count(PluginInstance::is_controller, false),
        nodes_healthy: count(PluginInstance::is_node, true),
        nodes_expected: count(PluginInstance::is_node, false),
        meta: current
            .as_ref()
            .map(|p| p.status.meta.clone())
            .unwrap_or_default(),
        instances,
    }
}

/// The plugin's instances: each live node's, and each earlier one whose node is gone
/// (unhealthy), unless an operator deregistered that registration. A node that is
/// `present` but no longer lists the plugin has no instance.
fn instances(
    live: &[(&Node, &NodePluginStatus)],
    current: Option<&Plugin>,
    present: &dyn Fn(&NodeName) -> bool,
) -> BTreeMap<NodeName, PluginInstance> {
    let mut out: BTreeMap<NodeName, PluginInstance> = live
        .iter()
        .map(|(n, s)| {
            let name = NodeName::new(n.metadata.name.as_str()).unwrap_or_default();
            let inst = PluginInstance {
                plugin_type: s.plugin_type,
                healthy: s.healthy,
                message: s.health_message.clone(),
                node_uid: n.metadata.uid.to_string(),
                topology: s.topology.clone().filter(|t| !t.is_empty()),
            };
            (name, inst)
        })
        .collect();
    for (node, inst) in current.iter().flat_map(|p| &p.status.instances) {
        if out.contains_key(node)
            || present(node)
            || current.is_some_and(|p| p.spec.deregistered.get(node) == Some(&inst.node_uid))
        {
            continue;
        }
        let gone = PluginInstance {
            healthy: false,
            message: "its node is gone (the agent's lease expired)".into(),
            ..inst.clone()
        };
        out.insert(node.clone(), gone);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fingerprinted instance of `plugin_type`, advertising PUBLISH_UNPUBLISH_VOLUME
    /// or not.
    fn instance(plugin_type: PluginType, publishes: bool) -> NodePluginStatus {
        let mut s = NodePluginStatus {
            plugin_type,
            healthy: true,
            ..Default::default()
        };
        s.capabilities
            .plugin
            .insert(PluginCapability::Service(PluginService::ControllerService));
        if publishes {
            s.capabilities
                .controller
                .insert(ControllerRpc::PublishUnpublishVolume);
        }
        s
    }

    fn plugin_that_said(required: Option<bool>) -> Plugin {
        let mut p = Plugin::new(
            &Namespace::default(),
            Name::new("p").unwrap(),
            PluginSpec::default(),
        );
        p.status.controller_required = required;
        p
    }

    #[test]
    fn controller_publish_is_required_when_a_controller_instance_advertises_it() {
        let n = Node::new(&Namespace::default(), Name::new("n1").unwrap(), NodeSpec {});
        let yes = instance(PluginType::Controller, true);
        let no = instance(PluginType::Monolith, false);
        assert_eq!(controller_required(&[(&n, &yes)], None), Some(true));
        assert_eq!(controller_required(&[(&n, &no)], None), Some(false));
        assert_eq!(
            controller_required(&[(&n, &no), (&n, &yes)], None),
            Some(true)
        );
        // The instances answer for themselves: what the Plugin said before does not
        // outvote them.
        let said = plugin_that_said(Some(true));
        assert_eq!(controller_required(&[(&n, &no)], Some(&said)), Some(false));
    }

    #[test]
    fn without_a_fingerprinted_controller_the_last_answer_stands() {
        let n = Node::new(&Namespace::default(), Name::new("n1").unwrap(), NodeSpec {});
        // A node instance says nothing of the controller; nor does an instance that
        // never answered a fingerprint (no capabilities, unhealthy).
        let node_only = instance(PluginType::Node, true);
        let unanswered = NodePluginStatus {
            plugin_type: PluginType::Controller,
            healthy: false,
            ..Default::default()
        };
        for live in [&node_only, &unanswered] {
            assert_eq!(controller_required(&[(&n, live)], None), None);
            for said in [Some(true), Some(false), None] {
                let p = plugin_that_said(said);
                assert_eq!(controller_required(&[(&n, live)], Some(&p)), said);
            }
        }
        assert_eq!(
            controller_required(&[], Some(&plugin_that_said(Some(true)))),
            Some(true)
        );
    }
}
