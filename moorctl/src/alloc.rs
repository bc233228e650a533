//! `moorctl alloc stop NAME`: sets an allocation's desired status to stop; the controller
//! then releases its claims. `moorctl alloc paths NAME`: where its volumes are.

use moor::api::{Allocation, ENGINE_HOLD_LABEL};
use moor::workload::{self, End};

use crate::{is_not_found, parse_name, parse_ns, ride_out, Ctx, Refused};

/// Stops the allocation `name` in `namespace`.
pub(crate) async fn stop(
    ctx: &Ctx,
    namespace: &str,
    name: &str,
    force: bool,
) -> anyhow::Result<i32> {
    let ns = parse_ns(namespace)?;
    let name = parse_name("allocation", name)?;
    let key = Allocation::key_for(&ns, &name);
    // An engine's hold has no runner to signal its containers: stopped, its volumes
    // would be released under them once the kill timeout passed (issue 78, item 1).
    if !force {
        let key = &key;
        let alloc = ride_out(ctx, |_| async move { Ok(ctx.store.try_get(key).await?) }).await?;
        let hold = alloc
            .as_ref()
            .and_then(|a| Some((a.metadata.labels.get(ENGINE_HOLD_LABEL)?, &a.spec.node)));
        if let Some((engine, node)) = hold {
            return Err(Refused(format!(
                "allocation {ns}/{name} is {engine}'s hold of its containers' volumes on node {node}: moor cannot stop a container, so it is not stopped under them; stop the containers with {engine} (the hold ends after their last unmount), or --force to release the volumes under them after the kill timeout"
            ))
            .into());
        }
    }
    let outcome = ride_out(ctx, |retrying| {
        let key = &key;
        async move {
            let wrote = workload::end(&ctx.store, key, End::Stop).await?;
            // After a lost answer, "already stopped" may be our write.
            Ok(wrote || retrying)
        }
    })
    .await;
    match outcome {
        Ok(true) => outln!(
            "allocation {name} stopped; its runner ends the workload (SIGTERM, then SIGKILL after its kill timeout) and its claims are released once it has ended"
        ),
        Ok(false) => outln!("allocation {name} already stopped"),
        Err(e) if is_not_found(&e) => {
            return Err(Refused(format!("allocation {ns}/{name} not found")).into())
        }
        Err(e) => return Err(e),
    }
    Ok(0)
}

/// Prints `REQ=PATH` (or `export MOOR_VOLUME_<REQ>=PATH`) for each published request.
pub(crate) async fn paths(
    ctx: &Ctx,
    namespace: &str,
    name: &str,
    export: bool,
) -> anyhow::Result<i32> {
    let ns = parse_ns(namespace)?;
    let name = parse_name("allocation", name)?;
    let alloc = match ctx.store.try_get(&Allocation::key_for(&ns, &name)).await? {
        Some(a) => a,
        None => return Err(Refused(format!("allocation {ns}/{name} not found")).into()),
    };
    let paths = crate::run::paths(ctx, &alloc).await?;
    if paths.is_empty() {
        return Err(Refused(format!("allocation {name} has no published volume")).into());
    }
    for (req, p) in paths {
        let path = moor::api::printable(&p.target_path);
        if export {
            outln!(
                "export {}={}",
                crate::run::volume_var(&req),
                shell_quote(&path)
            );
        } else {
            outln!("{req}={path}");
        }
    }
    Ok(0)
}

/// `s` single-quoted for a POSIX shell.
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}
