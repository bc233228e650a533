//! The plugin reconciler: one Plugin object per plugin id, aggregated from the Node
//! objects of the agents that run it.
//!
//! Expected flow:
//! 1. Count the instances: controllers (controller or monolith) and nodes (node or
//!    monolith), expected and healthy; provider and version from a healthy instance.
//! 2. `controller_required`: a controller instance advertises PUBLISH_UNPUBLISH_VOLUME.
//!    Unknown (`None`) until a controller instance answered a fingerprint; while none
//!    is registered the last answer is kept, so a controller plugin that restarts does
//!    not make claims skip ControllerPublish.
//! 3. A plugin no node runs any more is deleted.

use moor::api::*;
use moor::runtime::controller::{Action, Config, Controller, ErrorPolicy, ReconcileError};
use moor::runtime::metrics::ControllerMetrics;
use moor::store::StoreError;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

use super::Ctx;
use super::Informers;

/// Why a plugin could not be converged.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// Reading or writing etcd failed.
    #[error("store operation failed")]
    Store(#[from] StoreError),
}

impl ReconcileError for PluginError {
    fn policy(&self) -> ErrorPolicy {
        let PluginError::Store(e) = self;
        e.policy()
    }
}

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
        .watches(inf.nodes.subscribe(), |n: &Node| {
            n.status
                .plugins
                .keys()
                .map(|id| Plugin::key_for(id).into_string())
                .collect()
        })
        .run(
            move |key| {
                let this = this.clone();
                async move {
                    match reconcile(&this, &key).await {
                        Err(PluginError::Store(StoreError::Conflict { .. }))
                        | Err(PluginError::Store(StoreError::AlreadyExists { .. })) => {
                            Ok(Action::Requeue(Duration::from_millis(50)))
                        }
                        other => other,
                    }
                }
            },
            stop,
        )
        .await;
}

async fn reconcile(ctx: &Ctx, key: &str) -> Result<Action, PluginError> {
    ctx.ready().await;
    let Ok(plugin_key) = ObjectKey::<PluginSpec>::parse(key) else {
        return Ok(Action::AwaitChange);
    };
    let id = plugin_key.name();
    let Ok(name) = Name::new(id) else {
        return Ok(Action::AwaitChange);
    };
    let nodes = ctx.nodes.state();
    let instances: Vec<&NodePluginStatus> = nodes
        .iter()
        .filter_map(|n| n.status.plugins.iter().find(|(p, _)| p.as_str() == id))
        .map(|(_, s)| s)
        .collect();
    let current = ctx.plugins.get(key);
    if instances.is_empty() {
        if current.is_some() {
            match ctx.store.delete(&plugin_key, None).await {
                Ok(_) | Err(StoreError::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        return Ok(Action::AwaitChange);
    }
    let is_controller = |s: &&&NodePluginStatus| {
        matches!(s.plugin_type, PluginType::Controller | PluginType::Monolith)
    };
    let is_node =
        |s: &&&NodePluginStatus| matches!(s.plugin_type, PluginType::Node | PluginType::Monolith);
    let controllers: Vec<_> = instances.iter().filter(is_controller).collect();
    let node_instances: Vec<_> = instances.iter().filter(is_node).collect();
    // An instance that never answered a fingerprint has no capabilities to go by.
    let fingerprinted: Vec<_> = controllers
        .iter()
        .filter(|s| !s.capabilities.plugin.is_empty() || s.healthy)
        .collect();
    let controller_required = if fingerprinted.is_empty() {
        current.as_ref().and_then(|p| p.status.controller_required)
    } else {
        Some(fingerprinted.iter().any(|s| {
            s.capabilities
                .controller
                .contains("PUBLISH_UNPUBLISH_VOLUME")
        }))
    };
    let source = instances
        .iter()
        .find(|s| s.healthy)
        .or(instances.first())
        .copied();
    let status = PluginStatus {
        provider: source.map(|s| s.provider.clone()).unwrap_or_default(),
        version: source.map(|s| s.version.clone()).unwrap_or_default(),
        controller_required,
        controllers_healthy: controllers.iter().filter(|s| s.healthy).count() as u32,
        controllers_expected: controllers.len() as u32,
        nodes_healthy: node_instances.iter().filter(|s| s.healthy).count() as u32,
        nodes_expected: node_instances.len() as u32,
        meta: current
            .as_ref()
            .map(|p| p.status.meta.clone())
            .unwrap_or_default(),
    };
    match current {
        None => {
            let mut p = Plugin::new(&Namespace::default(), name, PluginSpec {});
            p.status = status;
            ctx.store.create(&p).await?;
        }
        Some(p) if p.status != status => {
            let mut p = (*p).clone();
            p.status = status;
            ctx.store.replace_status(&p).await?;
        }
        Some(_) => {}
    }
    Ok(Action::AwaitChange)
}
