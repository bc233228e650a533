//! `moorctl volume share|unshare|own`: an operator's word on who may use a plugin
//! volume (issue 77). A plugin volume belongs to the volume its plugin's leader
//! recorded (`owners/PLUGIN/`, which only operators and that leader write): `share`
//! lets other namespaces' registrations of it use it (read-only unless `--write`),
//! never delete it; `unshare` takes that back; `own` makes a registration the owner,
//! evicting whoever registered the id first (a squatter), or picking one of two
//! namings an upgrade kept.

use moor::api::*;
use moor::store::StoreError;

use crate::{parse_name, parse_ns, ride_out, Ctx, LookAgain, Refused};

/// The volume `namespace`/`volume`, the plugin volume it names and that id's record.
async fn read(
    ctx: &Ctx,
    ns: &Namespace,
    name: &Name,
) -> anyhow::Result<(Volume, ExternalVolumeId, Option<Ownership>)> {
    let Some(vol) = ctx.store.try_get(&Volume::key_for(ns, name)).await? else {
        return Err(Refused(format!("volume {ns}/{name} not found")).into());
    };
    // A registration's id is its spec; a created volume's is in its status, which is
    // only a claim: the record read next is what says whose it is.
    let ext = vol
        .spec
        .external_id
        .clone()
        .or_else(|| vol.status.provisioning.external_id.clone());
    let Some(ext) = ext else {
        return Err(Refused(format!(
            "volume {ns}/{name} names no plugin volume yet (not created or registered)"
        ))
        .into());
    };
    let key = Ownership::key_for(&vol.spec.plugin_id, OwnedResource::Volume, ext.as_str());
    let rec = ctx.store.try_get(&key).await?;
    Ok((vol, ext, rec))
}

/// Writes `next` over `rec` (or creates it), asking to look again on a race.
async fn write(ctx: &Ctx, rec: Option<&Ownership>, next: &Ownership) -> anyhow::Result<()> {
    let written = match rec {
        Some(rec) => ctx.store.update(rec, next).await.map(|_| ()),
        None => ctx.store.create(next).await.map(|_| ()),
    };
    match written {
        Ok(()) => Ok(()),
        Err(StoreError::Conflict { .. } | StoreError::AlreadyExists { .. }) => {
            Err(LookAgain.into())
        }
        Err(e) => Err(e.into()),
    }
}

/// The record of `vol`'s plugin volume, which must name `vol` as its owner.
fn owned<'a>(
    vol: &Volume,
    ext: &ExternalVolumeId,
    rec: Option<&'a Ownership>,
) -> anyhow::Result<&'a Ownership> {
    let (ns, name) = (&vol.metadata.namespace, &vol.metadata.name);
    match rec {
        Some(rec) if owned_by(rec, vol) => Ok(rec),
        Some(rec) => Err(Refused(format!(
            "volume {ns}/{name} does not own plugin volume {ext}: {}/{} does (share it from there)",
            rec.spec.owner.namespace, rec.spec.owner.name
        ))
        .into()),
        None => Err(Refused(format!(
            "volume {ns}/{name} does not own plugin volume {ext}: no volume is recorded as its owner yet"
        ))
        .into()),
    }
}

/// `moorctl volume share VOLUME --with NS...`.
pub(crate) async fn share(
    ctx: &Ctx,
    namespace: &str,
    volume: &str,
    with: &[String],
    write_too: bool,
) -> anyhow::Result<i32> {
    let ns = parse_ns(namespace)?;
    let name = parse_name("volume", volume)?;
    let with = namespaces(&ns, with)?;
    let ext = ride_out(ctx, |_| {
        let (ns, name, with) = (&ns, &name, &with);
        async move {
            let (vol, ext, rec) = read(ctx, ns, name).await?;
            let rec = owned(&vol, &ext, rec.as_ref())?;
            let mut next = rec.clone();
            for w in with {
                match next.spec.shared_with.iter_mut().find(|s| &s.namespace == w) {
                    Some(s) => s.write = write_too,
                    None => next.spec.shared_with.push(Share {
                        namespace: w.clone(),
                        write: write_too,
                    }),
                }
            }
            if let Err(e) = next.validate() {
                return Err(Refused(format!("volume {ns}/{name}: {e}")).into());
            }
            if next.spec != rec.spec {
                write(ctx, Some(rec), &next).await?;
            }
            Ok(ext)
        }
    })
    .await?;
    let list: Vec<String> = with.iter().map(ToString::to_string).collect();
    let how = if write_too {
        "read and write: the access-mode rules count each namespace's volume on its own, so keep to one writer yourselves"
    } else {
        "read-only claims"
    };
    outln!(
        "plugin volume {ext} of volume {ns}/{name} shared with {} ({how}); a registration there (external_id: {ext}) may use it, never delete it",
        list.join(", ")
    );
    Ok(0)
}

/// `moorctl volume unshare VOLUME --with NS...`.
pub(crate) async fn unshare(
    ctx: &Ctx,
    namespace: &str,
    volume: &str,
    with: &[String],
) -> anyhow::Result<i32> {
    let ns = parse_ns(namespace)?;
    let name = parse_name("volume", volume)?;
    let with = namespaces(&ns, with)?;
    let ext = ride_out(ctx, |_| {
        let (ns, name, with) = (&ns, &name, &with);
        async move {
            let (vol, ext, rec) = read(ctx, ns, name).await?;
            let rec = owned(&vol, &ext, rec.as_ref())?;
            let mut next = rec.clone();
            next.spec
                .shared_with
                .retain(|s| !with.contains(&s.namespace));
            if next.spec != rec.spec {
                write(ctx, Some(rec), &next).await?;
            }
            Ok(ext)
        }
    })
    .await?;
    let list: Vec<String> = with.iter().map(ToString::to_string).collect();
    outln!(
        "plugin volume {ext} of volume {ns}/{name} no longer shared with {}: their new claims of it are refused; published ones stay until their allocations end",
        list.join(", ")
    );
    Ok(0)
}

/// `moorctl volume own VOLUME`: the registration `namespace`/`volume` becomes the
/// owner of the plugin volume it names.
pub(crate) async fn own(ctx: &Ctx, namespace: &str, volume: &str) -> anyhow::Result<i32> {
    let ns = parse_ns(namespace)?;
    let name = parse_name("volume", volume)?;
    let (ext, was) = ride_out(ctx, |_| {
        let (ns, name) = (&ns, &name);
        async move {
            let (vol, ext, rec) = read(ctx, ns, name).await?;
            if !vol.spec.is_registration() {
                return Err(Refused(format!(
                    "volume {ns}/{name} is not a registration: a created volume owns what its CreateVolume made, and nothing else"
                ))
                .into());
            }
            let mut next = Ownership::of_volume(&vol, &ext);
            next.spec.chosen = true;
            let Some(rec) = rec else {
                write(ctx, None, &next).await?;
                return Ok((ext, None));
            };
            if owned_by(&rec, &vol) && rec.spec.chosen {
                return Ok((ext, None));
            }
            let o = &rec.spec.owner;
            let owner = ctx
                .store
                .try_get(&Volume::key_for(&o.namespace, &o.name))
                .await?
                .filter(|v| v.metadata.uid == o.uid);
            // Its creator's: moor deletes it with that volume; sharing is the way.
            if let Some(creator) = owner.as_ref().filter(|v| !v.spec.is_registration()) {
                return Err(Refused(format!(
                    "plugin volume {ext} was created by volume {}/{}, which deletes it with itself: share it instead (moorctl volume share {} -n {} --with {ns})",
                    creator.metadata.namespace, creator.metadata.name, creator.metadata.name, creator.metadata.namespace
                ))
                .into());
            }
            // What CreateVolume answered of it, if moor made it, stays with the id.
            next.spec.provisioned = rec.spec.provisioned.clone();
            next.spec.shared_with = rec
                .spec
                .shared_with
                .iter()
                .filter(|s| &s.namespace != ns)
                .cloned()
                .collect();
            write(ctx, Some(&rec), &next).await?;
            let was = (!owned_by(&rec, &vol)).then(|| o.to_string());
            Ok((ext, was.filter(|_| owner.is_some())))
        }
    })
    .await?;
    match was {
        Some(was) => outln!(
            "volume {ns}/{name} now owns plugin volume {ext} (it was {was}'s: that volume's new claims of it are refused; its published ones stay until their allocations end)"
        ),
        None => outln!("volume {ns}/{name} owns plugin volume {ext}"),
    }
    Ok(0)
}

/// The namespaces `with` names, none of them the owner's `ns`.
fn namespaces(ns: &Namespace, with: &[String]) -> anyhow::Result<Vec<Namespace>> {
    let mut out: Vec<Namespace> = Vec::new();
    for w in with.iter().flat_map(|w| w.split(',')) {
        let w = parse_ns(w)?;
        if &w == ns {
            return Err(Refused(format!(
                "namespace {w} is the volume's own: its volumes use it already"
            ))
            .into());
        }
        if !out.contains(&w) {
            out.push(w);
        }
    }
    if out.is_empty() {
        return Err(Refused("--with names no namespace".into()).into());
    }
    Ok(out)
}
