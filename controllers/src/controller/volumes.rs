//! The volume reconciler: the controller's section of a volume (`status.claims`) and
//! its finalizer.
//!
//! Expected flow:
//! 1. Every volume carries the `moor.dev/claims` finalizer while it exists, so deleting
//!    a volume in use waits for its claims; it is removed once the volume is being
//!    deleted and no live claim remains (the provisioner then deletes created volumes).
//! 2. `schedulable`: not being deleted, created (an external id is known), and its
//!    plugin able to serve it: a healthy node instance, and a healthy controller
//!    instance unless the plugin is known not to need ControllerPublish. The live and past claims are written by the
//!    claim reconciler as it admits and releases.

use moor::api::*;
use moor::runtime::controller::{Action, Config, Controller, ErrorPolicy, ReconcileError};
use moor::runtime::metrics::ControllerMetrics;
use moor::store::StoreError;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

use super::admission::external_id;
use super::Ctx;
use super::Informers;

/// The controller's finalizer on volumes.
pub const FINALIZER: &str = "moor.dev/claims";

/// Why a volume could not be converged.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// Reading or writing etcd failed.
    #[error("store operation failed")]
    Store(#[from] StoreError),
}

impl ReconcileError for VolumeError {
    fn policy(&self) -> ErrorPolicy {
        let VolumeError::Store(e) = self;
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
    let volumes = ctx.volumes.clone();
    let this = Arc::new(ctx);
    Controller::new("volumes", this.volumes.clone(), config)
        .with_metrics(metrics)
        .owns(inf.volumes.subscribe())
        .watches(inf.plugins.subscribe(), move |p: &Plugin| {
            // Only the volumes whose `schedulable` the plugin's health may flip: a
            // plugin's status changes do not wake its 100,000 settled volumes.
            let healthy = p.status.serves_volumes();
            volumes
                .by_index(
                    super::context::BY_SCHEDULABLE,
                    &super::context::schedulable_index(p.metadata.name.as_str(), !healthy),
                )
                .iter()
                .map(|v| v.key())
                .collect()
        })
        .run(
            move |key| {
                let this = this.clone();
                async move { reconcile(&this, &key).await }
            },
            stop,
        )
        .await;
}

async fn reconcile(ctx: &Ctx, key: &str) -> Result<Action, VolumeError> {
    ctx.ready().await;
    let Some(vol) = ctx.volumes.get(key) else {
        return Ok(Action::AwaitChange);
    };
    let live =
        !vol.status.claims.read_claims.is_empty() || !vol.status.claims.write_claims.is_empty();
    let has_finalizer = vol.metadata.finalizers.iter().any(|f| f == FINALIZER);
    if vol.is_deleting() {
        if has_finalizer && !live {
            let mut v = (*vol).clone();
            v.metadata.finalizers.retain(|f| f != FINALIZER);
            match ctx.store.replace(&v).await {
                Ok(_) | Err(StoreError::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
            return Ok(Action::AwaitChange);
        }
    } else if !has_finalizer {
        let mut v = (*vol).clone();
        v.metadata.finalizers.push(FINALIZER.to_string());
        ctx.store.replace(&v).await?;
        return Ok(Action::AwaitChange);
    }
    let plugin_healthy = ctx
        .plugins
        .get(&Plugin::key_for(&vol.spec.plugin_id))
        .is_some_and(|p| p.status.serves_volumes());
    let schedulable = !vol.is_deleting() && external_id(&vol).is_some() && plugin_healthy;
    if vol.status.claims.schedulable != schedulable {
        let generation = vol.metadata.generation;
        ctx.store
            .modify_status(&vol.object_key(), |_, st| {
                st.claims.schedulable = schedulable;
                st.claims.meta.observed_generation = generation;
                true
            })
            .await?;
    }
    Ok(Action::AwaitChange)
}
