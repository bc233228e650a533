//! `moorctl delete KIND NAME`: deletes an object; finalizers hold it until their owners
//! are done, and the verb says which.

use crate::kind::{self, Kind};
use crate::{is_not_found, parse_ns, ride_out, Ctx, Refused};

/// `moorctl delete KIND NAME`.
#[derive(Debug, clap::Args)]
pub struct Delete {
    /// The kind.
    #[arg(value_parser = crate::kind::KindParser, hide_possible_values = true)]
    pub kind: Kind,
    /// The name.
    pub name: String,
    /// Namespace.
    #[arg(short = 'n', long, env = "MOOR_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// With an allocation: also delete the volumes its templates made, retained ones
    /// included (their finalizers hold each until its claims are released).
    #[arg(long)]
    pub volumes: bool,
    /// With a volume that claims hold: mark it now and delete it after the last claim
    /// is released (without it, a claimed volume's delete is refused, naming the
    /// holders).
    #[arg(long)]
    pub when_unused: bool,
}

impl Delete {
    /// Deletes the object; a lost answer is ridden out (see [`ride_out`]).
    pub async fn run(self, ctx: &Ctx) -> anyhow::Result<i32> {
        let cmd = self;
        let ns = parse_ns(&cmd.namespace)?;
        if cmd.volumes && cmd.kind != Kind::Allocation {
            return Err(Refused("--volumes applies to an allocation".into()).into());
        }
        if cmd.kind == Kind::Secret {
            refuse_secret_in_use(ctx, &ns, &cmd.name).await?;
        }
        if cmd.when_unused && cmd.kind != Kind::Volume {
            return Err(Refused("--when-unused applies to a volume".into()).into());
        }
        // The volumes its templates made, read before the allocation goes.
        let made = if cmd.volumes {
            made_volumes(ctx, &ns, &cmd.name).await?
        } else {
            Vec::new()
        };
        // None: not found; after a lost answer, that is our deletion having landed.
        let outcome = ride_out(ctx, |retrying| {
            let ns = &ns;
            let cmd = &cmd;
            async move {
                let key = kind::find_key(ctx, cmd.kind, Some(ns), &cmd.name).await?;
                match key {
                    // A volume claims hold: refused (naming them) unless asked to wait,
                    // decided on the version the delete is guarded by.
                    Some(key) if cmd.kind == Kind::Volume && !cmd.when_unused => {
                        match delete_unclaimed(ctx, &key).await {
                            Ok(f) => Ok(Some(f)),
                            Err(e) if retrying && is_not_found(&e) => Ok(Some(Vec::new())),
                            Err(e) => Err(e),
                        }
                    }
                    Some(key) => match kind::delete(ctx, cmd.kind, &key).await {
                        Ok(f) => Ok(Some(f)),
                        Err(e) if retrying && is_not_found(&e) => Ok(Some(Vec::new())),
                        Err(e) => Err(e),
                    },
                    None if retrying => Ok(Some(Vec::new())),
                    None => Ok(None),
                }
            }
        })
        .await?;
        let Some(finalizing) = outcome else {
            return Err(Refused(format!("{} {}/{} not found", cmd.kind, ns, cmd.name)).into());
        };
        if finalizing.is_empty() {
            outln!("{} {} deleted", cmd.kind, cmd.name);
        } else {
            outln!(
                "{} {} marked for deletion; waiting for {}",
                cmd.kind,
                cmd.name,
                finalizing.join(", ")
            );
        }
        for v in made {
            let key = moor::api::Volume::key_for(&ns, v.as_str());
            match kind::delete(ctx, Kind::Volume, &key.into_string()).await {
                Ok(f) if f.is_empty() => outln!("volume {v} deleted"),
                Ok(f) => outln!(
                    "volume {v} marked for deletion; waiting for {}",
                    f.join(", ")
                ),
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(0)
    }
}

/// Deletes the volume at `key` unless claims hold it (its live claims, as recorded in
/// its status by the admission that counts them, whose allocations still want them:
/// one being released lets the deletion wait for it): then refused, naming each
/// holder. Guarded by the version read, so a claim admitted since makes it look again.
async fn delete_unclaimed(ctx: &Ctx, key: &str) -> anyhow::Result<Vec<String>> {
    use moor::api::{Allocation, Claim, ObjectKey, VolumeSpec};
    use moor::store::{Deleted, StoreError};
    let key = ObjectKey::<VolumeSpec>::parse(key)?;
    let vol = ctx.store.get(&key).await?;
    let ns = &vol.metadata.namespace;
    let claims = &vol.status.claims;
    let mut holders = Vec::new();
    if !vol.is_deleting() {
        for c in claims.write_claims.iter().chain(&claims.read_claims) {
            let claim = ctx
                .store
                .try_get(&Claim::key_for(&c.node, ns, &c.claim))
                .await?;
            let alloc = ctx
                .store
                .try_get(&Allocation::key_for(ns, &c.allocation))
                .await?;
            if !moor::admission::holder_ending(claim.as_ref(), alloc.as_ref()) {
                holders.push(format!("allocation {} on node {}", c.allocation, c.node));
            }
        }
    }
    if !holders.is_empty() {
        let more = holders.len().saturating_sub(10);
        return Err(Refused(format!(
            "volume {}/{} is in use by {}{}: stop them first, or --when-unused deletes it after the last release",
            vol.metadata.namespace,
            vol.metadata.name,
            holders[..holders.len().min(10)].join(", "),
            if more > 0 { format!(" and {more} more") } else { String::new() }
        ))
        .into());
    }
    match ctx
        .store
        .delete(&key, Some(vol.metadata.resource_version))
        .await
    {
        Ok(Deleted::Gone) => Ok(Vec::new()),
        Ok(Deleted::Finalizing(obj)) => Ok(obj
            .metadata
            .finalizers
            .iter()
            .map(|f| f.to_string())
            .collect()),
        Err(StoreError::Conflict { .. }) => Err(crate::LookAgain.into()),
        Err(e) => Err(e.into()),
    }
}

/// The volumes allocation `name`'s templates made (those that exist and say so).
async fn made_volumes(
    ctx: &Ctx,
    ns: &moor::api::Namespace,
    name: &str,
) -> anyhow::Result<Vec<moor::api::VolumeId>> {
    use moor::api::{Allocation, Volume};
    let Some(alloc) = ctx.store.try_get(&Allocation::key_for(ns, name)).await? else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for req in alloc.spec.volumes.iter().filter(|r| r.template.is_some()) {
        let Some(id) = alloc.request_volume(req) else {
            continue;
        };
        let made_here = ctx
            .store
            .try_get(&Volume::key_for(ns, &id))
            .await?
            .and_then(|v| v.spec.made_for)
            .is_some_and(|m| m.allocation == alloc.metadata.name && m.request == req.name);
        if made_here {
            out.push(id);
        }
    }
    Ok(out)
}

/// Refuses to delete Secret `name` while a volume, a volume class or a snapshot
/// names it (the next call of theirs would fail), naming each of them.
async fn refuse_secret_in_use(
    ctx: &Ctx,
    ns: &moor::api::Namespace,
    name: &str,
) -> anyhow::Result<()> {
    use moor::api::{KeyScope, Name, Secret, SnapshotSpec, VolumeClassSpec, VolumeSpec};
    let Ok(name) = Name::new(name) else {
        return Ok(());
    };
    let Some(found) = kind::find(ctx, Kind::Secret, Some(ns), name.as_str()).await? else {
        return Ok(());
    };
    let secret: Secret = serde_json::from_value(found)?;
    let plugin = &secret.spec.plugin_id;
    let mut users = Vec::new();
    let scope = KeyScope::<VolumeSpec>::namespace(ns).unwrap_or_else(KeyScope::all);
    for v in ctx.store.list(&scope).await?.items {
        if &v.metadata.namespace == ns
            && &v.spec.plugin_id == plugin
            && v.spec.secret_refs.names_secret(&name)
        {
            users.push(format!("volume {}", v.metadata.name));
        }
    }
    for c in ctx
        .store
        .list(&KeyScope::<VolumeClassSpec>::all())
        .await?
        .items
    {
        if &c.spec.plugin_id == plugin && c.spec.secret_refs.names_secret(&name) {
            users.push(format!("volumeclass {}", c.metadata.name));
        }
    }
    let scope = KeyScope::<SnapshotSpec>::namespace(ns).unwrap_or_else(KeyScope::all);
    for s in ctx.store.list(&scope).await?.items {
        if &s.metadata.namespace == ns && s.spec.secret_ref.as_ref() == Some(&name) {
            users.push(format!("snapshot {}", s.metadata.name));
        }
    }
    if users.is_empty() {
        return Ok(());
    }
    let more = users.len().saturating_sub(10);
    users.truncate(10);
    let key = Secret::key_for(plugin, ns, &name);
    Err(Refused(format!(
        "secret {}/{name} is in use by {}{}: name another Secret there first (the key is {key})",
        ns,
        users.join(", "),
        if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        }
    ))
    .into())
}
