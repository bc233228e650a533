//! `moorctl mount adopt CLAIM` and `moorctl mount release CLAIM`: what an operator does
//! with a mount its node keeps although desired state lost its claim (an older etcd
//! snapshot restored; `moorctl get mounts --orphaned` lists them). Adopting writes the
//! allocation that makes the same claim again (the orphan's allocation name, node,
//! volume, mode and capability: [`Orphan::allocation`]); the node's agent then takes
//! the mount over without a CSI call. Releasing adopts it, then stops that
//! allocation: the claim is released as any other (NodeUnpublish, NodeUnstage,
//! ControllerUnpublish).

use std::time::Duration;

use moor::api::*;
use moor::workload::{self, End, IfEnded, Started};

use crate::run::{pace, refusal};
use crate::{parse_name, parse_ns, Ctx, Refused};

/// `moorctl mount ...`.
#[derive(Debug, clap::Subcommand)]
pub enum MountCmd {
    /// Adopt an orphaned mount into an allocation that makes its claim again (named as
    /// its allocation was, on its node); the node keeps the mount as it is.
    Adopt(Which),
    /// Release an orphaned mount: adopted, then its allocation stopped, so the volume
    /// is unpublished and detached as for any release. Refused while its node reports
    /// processes using it, unless --force.
    Release(Release),
}

/// `moorctl mount release`.
#[derive(Debug, clap::Args)]
pub struct Release {
    /// Which mount.
    #[command(flatten)]
    pub which: Which,
    /// Release it although its node reports processes using it (they lose the volume
    /// under them).
    #[arg(long)]
    pub force: bool,
}

/// Which orphaned mount.
#[derive(Debug, clap::Args)]
pub struct Which {
    /// The claim the mount served (as `get mounts --orphaned` lists it).
    pub claim: String,
    /// Namespace.
    #[arg(short = 'n', long, env = "MOOR_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// The node, when mounts of that claim name are orphaned on several.
    #[arg(long)]
    pub node: Option<String>,
    /// How long to wait for the node to adopt it (and, for release, to release it).
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    /// Adopt it although the stored state shows its node never served the namespace
    /// (a node's report is its own word: checked first against the volume, its plugin
    /// volume and its owner, which this does not skip).
    #[arg(long)]
    pub insist: bool,
}

impl MountCmd {
    /// Runs the verb.
    pub async fn run(self, ctx: &Ctx) -> anyhow::Result<i32> {
        match self {
            MountCmd::Adopt(which) => {
                let alloc = adopt(ctx, &which).await?;
                outln!(
                    "mount adopted by allocation {} on node {}",
                    alloc.metadata.name,
                    alloc.spec.node
                );
                Ok(0)
            }
            MountCmd::Release(Release { which, force }) => {
                in_use(ctx, &which, force).await?;
                let alloc = adopt(ctx, &which).await?;
                let key = alloc.object_key();
                workload::end(&ctx.store, &key, End::Stop).await?;
                eprintln!(
                    "moorctl: allocation {} stopped; releasing its claims",
                    alloc.metadata.name
                );
                let mut say = |line: &str| eprintln!("moorctl: {line}");
                workload::wait_released(&ctx.store, &key, which.timeout, pace(&mut say))
                    .await
                    .map_err(refusal)?;
                outln!(
                    "mount released: allocation {} stopped and its claims released",
                    alloc.metadata.name
                );
                Ok(0)
            }
        }
    }
}

/// Refuses the release of a mount its node reports in use (issue 78, item 3: a
/// release unmounted a restored orphan under its live workload), naming each holder;
/// with `force`, says whom it releases it under.
async fn in_use(ctx: &Ctx, which: &Which, force: bool) -> anyhow::Result<()> {
    let mount = find(ctx, which).await?;
    let holders = mount
        .status
        .orphan
        .as_deref()
        .map(|o| o.holders.as_slice())
        .unwrap_or_default();
    if holders.is_empty() {
        return Ok(());
    }
    let named: Vec<String> = holders
        .iter()
        .map(|h| format!("{} ({})", h.pid, printable(&h.command)))
        .collect();
    let what = format!(
        "node {} reports the mount of claim {} at {} in use by process{} {}",
        mount.spec.node,
        mount.spec.claim,
        printable(&mount.spec.target_path),
        if named.len() == 1 { "" } else { "es" },
        named.join(", ")
    );
    if force {
        eprintln!("moorctl: warning: {what}; releasing it under them (--force)");
        return Ok(());
    }
    Err(Refused(format!(
        "{what}: end them first (the node looks again every few seconds), adopt the mount instead (moorctl mount adopt), or release it under them with --force"
    ))
    .into())
}

/// The orphaned Mount `which` names.
async fn find(ctx: &Ctx, which: &Which) -> anyhow::Result<Mount> {
    let ns = parse_ns(&which.namespace)?;
    let claim = parse_name("claim", &which.claim)?;
    let node = which
        .node
        .as_deref()
        .map(|n| NodeName::new(n).map_err(|e| anyhow::anyhow!("node {n:?}: {e}")))
        .transpose()?;
    let listed = ctx.store.list(&KeyScope::<MountSpec>::all()).await?;
    let mut found: Vec<Mount> = listed
        .items
        .into_iter()
        .filter(|m| {
            m.status.orphan.is_some()
                && m.metadata.namespace == ns
                && m.spec.claim == claim
                && node.as_ref().is_none_or(|n| &m.spec.node == n)
        })
        .collect();
    match found.len() {
        0 => Err(Refused(format!(
            "no orphaned mount of claim {ns}/{claim}{} (moorctl get mounts --orphaned -A lists them)",
            node.map(|n| format!(" on node {n}")).unwrap_or_default()
        ))
        .into()),
        1 => Ok(found.remove(0)),
        _ => Err(Refused(format!(
            "mounts of claim {ns}/{claim} are orphaned on nodes {}: say which with --node",
            found
                .iter()
                .map(|m| m.spec.node.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ))
        .into()),
    }
}

/// Refuses an orphan the stored state does not bear out ([`Orphan::refusal`]): its
/// volume, that volume's plugin volume and owner, and whether its node served the
/// namespace.
async fn checked(ctx: &Ctx, mount: &Mount, orphan: &Orphan, insist: bool) -> anyhow::Result<()> {
    let ns = &mount.metadata.namespace;
    let node = &mount.spec.node;
    let volume = ctx
        .store
        .try_get(&Volume::key_for(ns, &mount.spec.volume))
        .await?;
    let owner = ctx
        .store
        .try_get(&Ownership::key_for(
            &orphan.plugin_id,
            OwnedResource::Volume,
            orphan.external_id.as_str(),
        ))
        .await?;
    let mut served = volume.as_ref().is_some_and(|v| {
        let c = &v.status.claims;
        c.read_claims
            .iter()
            .chain(&c.write_claims)
            .chain(&c.past_claims)
            .any(|r| &r.node == node)
    });
    if !served {
        served = ctx
            .store
            .try_get(&Attachment::key_for(ns, &mount.spec.volume, node))
            .await?
            .is_some();
    }
    if !served {
        served = ctx
            .store
            .list(&Claim::node_scope(node))
            .await?
            .items
            .iter()
            .any(|c| &c.metadata.namespace == ns);
    }
    if let Some(why) = orphan.refusal(mount, volume.as_ref(), owner.as_ref(), served, insist) {
        return Err(Refused(why).into());
    }
    if !served {
        eprintln!(
            "moorctl: warning: adopting on node {node}'s word alone (--insist): nothing stored shows it served namespace {ns}"
        );
    }
    Ok(())
}

/// Writes the allocation that makes the orphan's claim again (or finds it written by
/// an earlier try) and waits until the node adopted the mount: the claim Published
/// and the orphan's Mount gone or no longer an orphan.
async fn adopt(ctx: &Ctx, which: &Which) -> anyhow::Result<Allocation> {
    let mount = find(ctx, which).await?;
    let Some(orphan) = mount.status.orphan.as_deref() else {
        return Err(Refused("the mount is no longer orphaned".into()).into());
    };
    checked(ctx, &mount, orphan, which.insist).await?;
    let wanted = orphan.allocation(&mount);
    let started = workload::create_or_adopt(&ctx.store, &wanted, IfEnded::Refuse, false)
        .await
        .map_err(refusal)?;
    let alloc = match started {
        Started::Created(a) => {
            eprintln!(
                "moorctl: allocation {} created on node {} for volume {} ({}); waiting for the node to adopt the mount",
                a.metadata.name, a.spec.node, mount.spec.volume, orphan.mode
            );
            a
        }
        Started::Adopted(a) => {
            // An allocation of that name already: only one that makes the same claim
            // (the volume, mode and capability) takes the mount over.
            let makes_it = a.spec.volumes.iter().any(|r| {
                r.volume == mount.spec.volume
                    && r.claim_mode() == orphan.mode
                    && r.access_mode
                        .is_none_or(|m| m == orphan.capability.access_mode)
                    && r.attachment_mode
                        .is_none_or(|m| m == orphan.capability.attachment_mode)
            });
            if !makes_it {
                return Err(Refused(format!(
                    "allocation {} exists on node {} without a request for volume {} in mode {}: it cannot adopt the mount; stop and delete it first, or release the mount",
                    a.metadata.name, a.spec.node, mount.spec.volume, orphan.mode
                ))
                .into());
            }
            a
        }
    };
    let key = alloc.object_key();
    let mut say = |line: &str| eprintln!("moorctl: {line}");
    workload::wait_published(&ctx.store, &key, which.timeout, pace(&mut say))
        .await
        .map_err(refusal)?;
    // Published: the claim stands on the node; the orphan's own Mount goes (or
    // became the claim's) in the agent's same pass.
    let orphan_key = mount.object_key();
    let deadline = tokio::time::Instant::now() + which.timeout;
    loop {
        let still =
            ctx.store.try_get(&orphan_key).await?.is_some_and(|m| {
                m.status.orphan.is_some() && m.spec.claim_uid == mount.spec.claim_uid
            });
        if !still {
            return Ok(alloc);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Refused(format!(
                "allocation {} is published but node {} still reports the mount orphaned after {}",
                alloc.metadata.name,
                mount.spec.node,
                humantime::format_duration(which.timeout)
            ))
            .into());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
