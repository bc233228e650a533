//! `moorctl volume detach VOLUME --node NODE`: declares a node gone for a volume, so its
//! claims there are released without node calls.

use moor::api::{NodeName, Volume};
use moor::store::StoreError;

use crate::{is_not_found, parse_name, parse_ns, ride_out, Ctx, Refused};

/// Marks `node` gone for `volume` in `namespace`.
pub(crate) async fn detach(
    ctx: &Ctx,
    namespace: &str,
    volume: &str,
    node: &str,
) -> anyhow::Result<i32> {
    let ns = parse_ns(namespace)?;
    let volume = parse_name("volume", volume)?;
    let node = NodeName::new(node).map_err(|e| anyhow::anyhow!("node {node:?}: {e}"))?;
    let key = Volume::key_for(&ns, &volume);
    // The entry names the generation this very write makes, so it covers exactly the
    // claims admitted before it. After a lost answer, an entry naming the stored
    // generation is that write.
    let outcome = ride_out(ctx, |retrying| {
        let (key, node) = (&key, &node);
        async move {
            loop {
                let mut v = ctx.store.get(key).await?;
                if retrying && v.spec.force_detach.get(node) == Some(&v.metadata.generation) {
                    return Ok(());
                }
                v.spec
                    .force_detach
                    .insert(node.clone(), v.metadata.generation + 1);
                match ctx.store.replace(&v).await {
                    Err(StoreError::Conflict { .. }) => continue,
                    other => return other.map(|_| ()).map_err(anyhow::Error::from),
                }
            }
        }
    })
    .await;
    match outcome {
        Ok(()) => {}
        Err(e) if is_not_found(&e) => {
            return Err(Refused(format!("volume {ns}/{volume} not found")).into())
        }
        Err(e) => return Err(e),
    }
    println!(
        "volume {volume}: node {node} marked gone; its claims there now will be released without node calls"
    );
    Ok(0)
}
