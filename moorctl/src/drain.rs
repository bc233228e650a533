//! Taking things out of service: `moorctl node cordon|uncordon|drain` (a Cordon object
//! the controller's admission reads) and `moorctl volume pause|activate|drain` (the
//! volume's `availability`). A drain waits until nothing holds what it drains, saying
//! who still does; with `--stop` (a node) or always (a volume) it stops the allocations
//! whose runner can stop their workload (`moorctl alloc run`'s, which hold a Lease). An
//! engine's allocation (a Docker or Podman container's hold) is never stopped under the
//! live container: it is reported as holding.

use std::collections::BTreeMap;
use std::time::Duration;

use moor::api::*;
use moor::store::StoreError;
use moor::workload::{self, End};

use crate::{ride_out, Ctx, LookAgain, Refused};

/// How often a drain looks again.
const POLL: Duration = Duration::from_millis(500);

/// `moorctl node ...`.
#[derive(Debug, clap::Subcommand)]
pub enum NodeCmd {
    /// Admit no new claim on NODE (claims already there stay); `get cordons` lists them.
    Cordon {
        /// The node.
        node: String,
        /// Why (shown in each claim that waits).
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Admit claims on NODE again.
    Uncordon {
        /// The node.
        node: String,
    },
    /// Cordon NODE, then wait until no claim on it holds a volume, printing who still
    /// does and which node plugins are still needed. Exit 1 at the timeout.
    Drain {
        /// The node.
        node: String,
        /// Also stop the allocations on NODE whose runner can stop their workload
        /// (`moorctl alloc run`); an engine container's is never stopped.
        #[arg(long)]
        stop: bool,
        /// How long to wait.
        #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
        timeout: Duration,
        /// Why (shown in each claim that waits); without it, a cordon's own reason
        /// stays.
        #[arg(long)]
        reason: Option<String>,
    },
}

impl NodeCmd {
    /// Runs the verb.
    pub async fn run(self, ctx: &Ctx) -> anyhow::Result<i32> {
        match self {
            NodeCmd::Cordon { node, reason } => {
                let node = parse_node(&node)?;
                cordon(ctx, &node, &reason, false).await?;
                outln!("node {node} cordoned: no new claim is admitted there");
                Ok(0)
            }
            NodeCmd::Uncordon { node } => {
                let node = parse_node(&node)?;
                match ctx.store.delete(&Cordon::key_for(&node), None).await {
                    Ok(_) => outln!("node {node} uncordoned"),
                    Err(StoreError::NotFound { .. }) => outln!("node {node} was not cordoned"),
                    Err(e) => return Err(e.into()),
                }
                Ok(0)
            }
            NodeCmd::Drain {
                node,
                stop,
                timeout,
                reason,
            } => {
                let node = parse_node(&node)?;
                let reason = match reason {
                    Some(r) => r,
                    None => ctx
                        .store
                        .try_get(&Cordon::key_for(&node))
                        .await?
                        .map(|c| c.spec.reason)
                        .unwrap_or_default(),
                };
                cordon(ctx, &node, &reason, true).await?;
                outln!("node {node} cordoned");
                if stop {
                    let allocs = live_allocations(ctx).await?;
                    for a in allocs.values().filter(|a| a.spec.node == node) {
                        stop_or_report(ctx, a).await?;
                    }
                }
                let deadline = tokio::time::Instant::now() + timeout;
                let mut said = String::new();
                loop {
                    let holders = node_holders(ctx, &node).await?;
                    if holders.is_empty() {
                        outln!("node {node} drained: no claim holds a volume there");
                        return Ok(0);
                    }
                    let now = describe_holders(&holders);
                    if now != said {
                        out!("{now}");
                        said = now;
                    }
                    if tokio::time::Instant::now() >= deadline {
                        outln!("timed out: node {node} still holds volumes");
                        return Ok(1);
                    }
                    tokio::time::sleep(POLL).await;
                }
            }
        }
    }
}

/// `moorctl volume pause|activate|drain`.
#[derive(Debug, Clone, Copy)]
pub enum VolumeAvailabilityCmd {
    /// Admit no new claim.
    Pause,
    /// Admit claims again.
    Activate,
    /// Pause, stop its holders that can be stopped, wait until it is released.
    Drain,
}

/// Sets volume `name`'s availability and, to drain it, stops its holders and waits.
pub async fn volume(
    ctx: &Ctx,
    cmd: VolumeAvailabilityCmd,
    namespace: &str,
    name: &str,
    timeout: Duration,
) -> anyhow::Result<i32> {
    let ns = crate::parse_ns(namespace)?;
    let vol = VolumeId::new(name).map_err(|e| anyhow::anyhow!("volume {name:?}: {e}"))?;
    let key = Volume::key_for(&ns, &vol);
    let want = match cmd {
        VolumeAvailabilityCmd::Pause => Availability::Pause,
        VolumeAvailabilityCmd::Activate => Availability::Active,
        VolumeAvailabilityCmd::Drain => Availability::Drain,
    };
    ride_out(ctx, |_| {
        let (key, ns, vol) = (&key, &ns, &vol);
        async move {
            let Some(mut v) = ctx.store.try_get(key).await? else {
                return Err(Refused(format!("volume {ns}/{vol} not found")).into());
            };
            if v.spec.availability == want {
                return Ok(());
            }
            v.spec.availability = want;
            match ctx.store.replace(&v).await {
                Err(StoreError::Conflict { .. }) => Err(LookAgain.into()),
                other => other.map(|_| ()).map_err(anyhow::Error::from),
            }
        }
    })
    .await?;
    outln!("volume {ns}/{vol}: availability {want}");
    if !matches!(cmd, VolumeAvailabilityCmd::Drain) {
        return Ok(0);
    }
    let holding = |v: &Volume| -> Vec<String> {
        let c = &v.status.claims;
        c.read_claims
            .iter()
            .chain(&c.write_claims)
            .map(|r| r.allocation.to_string())
            .collect()
    };
    // The holders are allocations of the volume's namespace, read one by one: a
    // person's role may read that namespace's allocations and no other's.
    if let Some(v) = ctx.store.try_get(&key).await? {
        for a in holding(&v) {
            let Ok(a) = Name::new(&a) else { continue };
            match ctx.store.try_get(&Allocation::key_for(&ns, &a)).await? {
                Some(alloc) if !alloc.spec.is_terminal() => stop_or_report(ctx, &alloc).await?,
                _ => {}
            }
        }
    }
    let deadline = tokio::time::Instant::now() + timeout;
    let mut said = String::new();
    loop {
        let Some(v) = ctx.store.try_get(&key).await? else {
            outln!("volume {ns}/{vol} is gone");
            return Ok(0);
        };
        let holders = holding(&v);
        if holders.is_empty() {
            outln!("volume {ns}/{vol} drained: no claim holds it");
            return Ok(0);
        }
        let now = format!("still held by allocation(s) {}\n", holders.join(", "));
        if now != said {
            out!("{now}");
            said = now;
        }
        if tokio::time::Instant::now() >= deadline {
            outln!("timed out: volume {ns}/{vol} is still held");
            return Ok(1);
        }
        tokio::time::sleep(POLL).await;
    }
}

fn parse_node(node: &str) -> anyhow::Result<NodeName> {
    NodeName::new(node).map_err(|e| anyhow::anyhow!("node {node:?}: {e}"))
}

/// Creates or updates node `node`'s Cordon.
async fn cordon(ctx: &Ctx, node: &NodeName, reason: &str, drain: bool) -> anyhow::Result<()> {
    let spec = CordonSpec {
        reason: reason.to_string(),
        drain,
    };
    let mut errors = ValidationErrors::default();
    spec.validate(&mut errors);
    if !errors.is_empty() {
        return Err(Refused(format!("cordon of node {node}: {errors}")).into());
    }
    let key = Cordon::key_for(node);
    ride_out(ctx, |_| {
        let (key, spec) = (&key, &spec);
        async move {
            match ctx.store.try_get(key).await? {
                Some(c) if c.spec == *spec => Ok(()),
                Some(mut c) => {
                    c.spec = spec.clone();
                    match ctx.store.replace(&c).await {
                        Err(StoreError::Conflict { .. }) => Err(LookAgain.into()),
                        other => other.map(|_| ()).map_err(anyhow::Error::from),
                    }
                }
                None => {
                    let name = Name::new(node.as_str())?;
                    let c = Cordon::new(&Namespace::default(), name, spec.clone());
                    match ctx.store.create(&c).await {
                        Err(StoreError::AlreadyExists { .. }) => Err(LookAgain.into()),
                        other => other.map(|_| ()).map_err(anyhow::Error::from),
                    }
                }
            }
        }
    })
    .await
}

/// The allocations not ended, by (namespace, name).
async fn live_allocations(ctx: &Ctx) -> anyhow::Result<BTreeMap<(String, String), Allocation>> {
    let all = ctx
        .store
        .list::<AllocationSpec>(&KeyScope::all())
        .await?
        .items;
    Ok(all
        .into_iter()
        .filter(|a| !a.spec.is_terminal())
        .map(|a| {
            let key = (
                a.metadata.namespace.to_string(),
                a.metadata.name.to_string(),
            );
            (key, a)
        })
        .collect())
}

/// Stops `alloc` if its runner can stop its workload (it holds a Lease: `moorctl alloc
/// run`), else says why it is left running.
async fn stop_or_report(ctx: &Ctx, alloc: &Allocation) -> anyhow::Result<()> {
    let (ns, name) = (&alloc.metadata.namespace, &alloc.metadata.name);
    if let Some(engine) = alloc.metadata.labels.get(ENGINE_HOLD_LABEL) {
        outln!(
            "allocation {ns}/{name} is {engine}'s container hold: not stopped under a live container (stop the container)"
        );
        return Ok(());
    }
    let lease = ctx
        .store
        .try_get(&Lease::key_for(ns, name))
        .await?
        .is_some();
    if !lease {
        outln!(
            "allocation {ns}/{name} has no runner that could stop its workload: not stopped (`moorctl alloc stop {name} -n {ns}` releases it)"
        );
        return Ok(());
    }
    let key = Allocation::key_for(ns, name);
    let wrote = ride_out(ctx, |retrying| {
        let key = &key;
        async move { Ok(workload::end(&ctx.store, key, End::Stop).await? || retrying) }
    })
    .await?;
    if wrote {
        outln!("allocation {ns}/{name} stopped");
    }
    Ok(())
}

/// One claim that holds a volume on a node.
struct Holder {
    allocation: String,
    volume: String,
    plugin: String,
    phase: ClaimPhase,
}

/// The claims on `node` that hold (or may hold) a volume.
async fn node_holders(ctx: &Ctx, node: &NodeName) -> anyhow::Result<Vec<Holder>> {
    let claims = ctx
        .store
        .list::<ClaimSpec>(&Claim::node_scope(node))
        .await?
        .items;
    Ok(claims
        .into_iter()
        .filter(|c| c.spec.node == *node && c.status.phase.is_live())
        .map(|c| Holder {
            allocation: format!("{}/{}", c.metadata.namespace, c.spec.allocation),
            volume: format!("{}/{}", c.metadata.namespace, c.spec.volume),
            plugin: c.spec.plugin_id.to_string(),
            phase: c.status.phase,
        })
        .collect())
}

/// Who still holds what, and which node plugins are still needed for it.
fn describe_holders(holders: &[Holder]) -> String {
    let mut out = String::new();
    let mut plugins: BTreeMap<&str, usize> = BTreeMap::new();
    for h in holders {
        out.push_str(&format!(
            "  allocation {} holds volume {} ({:?})\n",
            h.allocation, h.volume, h.phase
        ));
        *plugins.entry(&h.plugin).or_default() += 1;
    }
    for (p, n) in plugins {
        out.push_str(&format!(
            "  plugin {p} is still needed here: {n} volume(s) to unpublish\n"
        ));
    }
    out
}
