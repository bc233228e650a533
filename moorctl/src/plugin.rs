//! `moorctl plugin deregister PLUGIN --node NODE`: forgets a plugin instance whose node
//! is gone for good, so it no longer counts as expected; refused while the node is
//! live or while claims there still hold volumes of the plugin.

use moor::api::*;
use moor::store::StoreError;

use crate::{ride_out, Ctx, LookAgain, Refused};

/// Records the instance of `plugin` on `node` as deregistered (by the uid of the Node
/// object it was seen on); refused while that node is live.
pub(crate) async fn deregister(ctx: &Ctx, plugin: &str, node: &str) -> anyhow::Result<i32> {
    let id = PluginId::new(plugin).map_err(|e| anyhow::anyhow!("plugin {plugin:?}: {e}"))?;
    let node = NodeName::new(node).map_err(|e| anyhow::anyhow!("node {node:?}: {e}"))?;
    let key = Plugin::key_for(&id);
    ride_out(ctx, |_| {
        let (key, node, id) = (&key, &node, &id);
        async move {
            let Some(mut p) = ctx.store.try_get(key).await? else {
                return Err(Refused(format!("plugin {id} not found")).into());
            };
            let Some(inst) = p.status.instances.get(node) else {
                return Err(Refused(format!("plugin {id} has no instance on node {node}")).into());
            };
            if ctx.store.try_get(&Node::key_for(node)).await?.is_some() {
                return Err(Refused(format!(
                    "node {node} is live; stop its agent (and let its lease expire) before \
                     deregistering its instance of {id}"
                ))
                .into());
            }
            if p.spec.deregistered.get(node) == Some(&inst.node_uid) {
                return Ok(());
            }
            // Still needed while it has volumes there to unpublish (nomad#22192: a
            // plugin stopped before its consumers).
            let holding: Vec<String> = ctx
                .store
                .list::<ClaimSpec>(&Claim::node_scope(node))
                .await?
                .items
                .into_iter()
                .filter(|c| &c.spec.plugin_id == id && c.status.phase.is_live())
                .map(|c| format!("{}/{}", c.metadata.namespace, c.spec.volume))
                .collect();
            if !holding.is_empty() {
                return Err(Refused(format!(
                    "plugin {id} on node {node} still has volume(s) {} published by live \
                     claims: release them first (`moorctl volume detach VOLUME --node {node}`)",
                    holding.join(", ")
                ))
                .into());
            }
            p.spec
                .deregistered
                .insert(node.clone(), inst.node_uid.clone());
            match ctx.store.replace(&p).await {
                Err(StoreError::Conflict { .. }) => Err(LookAgain.into()),
                other => other.map(|_| ()).map_err(anyhow::Error::from),
            }
        }
    })
    .await?;
    outln!(
        "plugin {id}: the instance on node {node} is deregistered; it no longer counts as expected"
    );
    Ok(0)
}
