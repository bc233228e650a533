//! `moorctl alloc run NAME [--volume REQ=VOLUME[:ro]]... [-f ALLOC.yaml] -- CMD [ARGS...]`:
//! a process bound to its allocation, as Nomad's task runner binds a task.
//!
//! Expected flow:
//! 1. The runner's Lease (`leases/NS/NAME`, holder `moorctl@HOST/PID`) is created (or
//!    taken over from an expired runner) and renewed every TTL/3 from then on: while it
//!    is renewed the controller counts the workload alive; if the runner dies, the
//!    controller marks the allocation lost once the lease goes unrenewed for the TTL
//!    and releases its claims.
//! 2. The Allocation is created, or an existing one of that name adopted when it is
//!    not terminal and on this node; anything else is refused.
//! 3. Its claims are awaited until Published, with progress on stderr (the phase, a
//!    waiting claim's reason, its failing step, last error and next retry). A Denied
//!    or Failed claim, `--timeout` or a signal ends the run with exit 1 after stopping
//!    an allocation it created (so nothing stays claimed).
//! 4. client_status `running`; CMD runs with MOOR_ALLOC, MOOR_NODE and
//!    `MOOR_VOLUME_<REQ>` (the target path of each request), in a process group of its
//!    own under the workload guard (`guard.rs`); SIGINT, SIGTERM and SIGHUP are passed
//!    on to it, and if the runner itself dies the guard ends the whole group (SIGTERM,
//!    SIGKILL after a third of the lease TTL, at most 10 s) well before the controller
//!    finds the lease expired and releases the claims.
//! 5. When CMD has exited, the rest of its group is ended the same way and waited for:
//!    a volume is released only after every process of the workload is gone. CMD
//!    runs in a cgroup of its own (`moor::workload::cgroup`, cgroup v2) where one is
//!    writable, so a process that left the group (`setsid`) is ended too; elsewhere
//!    the runner says it falls back to the process group. The cgroup is recorded on
//!    the allocation with `running`: if both moorctl processes are killed, the node's
//!    agent ends what is left in it before it unpublishes.
//! 6. Then: client_status `complete` (0) or `failed` (with the code or
//!    signal) and desired_status `stop` in one write; the claims are awaited until
//!    Released (unless `--no-wait`); the lease is deleted (left to expire when the end
//!    could not be recorded, so the controller releases the claims as lost); moorctl
//!    exits with CMD's code (128 + the signal's number when a signal ended it).
//!
//! # Layout
//! - this file: the run itself (steps 1-6), its progress and its end.
//! - `lease`: the runner's Lease, created or taken over, renewed every TTL/3.
//! - `process`: CMD as a child under the guard, its signals and its exit.
//! - `guard`: `moorctl __workload-guard`, which ends the workload's whole group (and
//!   cgroup) if the runner dies.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use moor::api::*;
use moor::store::StoreError;
use moor::workload::cgroup::Cgroup;
use moor::workload::{self, End, IfEnded, Pace, RequestPaths, Started, WorkloadError};

pub(crate) mod guard;
mod lease;
mod process;

use lease::{renew, take_lease};
use process::{grace, interrupted, outcome, spawn_and_wait, Stop};

use crate::{parse_name, parse_ns, ride_out, Ctx, Refused};

/// `moorctl alloc run`.
#[derive(Debug, clap::Args)]
pub struct Run {
    /// The allocation's name.
    pub name: String,
    /// Namespace.
    #[arg(short = 'n', long, env = "MOOR_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// The node the workload runs on (default: MOOR_NODE, then the host name).
    #[arg(long, env = "MOOR_NODE")]
    pub node: Option<String>,
    /// A volume request `REQ=VOLUME[:ro]`: request REQ on volume VOLUME, with the volume's
    /// first capability (`:ro`: read-only). Or `REQ=new:SIZE[,plugin=P][,ephemeral|retain]`:
    /// a volume of at least SIZE made for this allocation on its node (single-node-writer,
    /// file system; the node's only plugin unless plugin= names one; ephemeral unless
    /// `retain`). Repeatable.
    #[arg(long = "volume", value_name = "REQ=VOLUME[:ro]|REQ=new:SIZE[,...]")]
    pub volumes: Vec<String>,
    /// An Allocation manifest (YAML or JSON) instead of --volume; its name must be NAME.
    #[arg(short = 'f', long = "filename", conflicts_with = "volumes")]
    pub file: Option<PathBuf>,
    /// How long the claims may take to be published.
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    /// How long the node may stay unregistered (no agent has registered it) before
    /// the run gives up, naming it: within --timeout, and long enough for an agent
    /// started beside this command to register.
    #[arg(long, default_value = "1m", value_parser = humantime::parse_duration)]
    pub node_timeout: Duration,
    /// How long the allocation counts as alive without a renewal of its lease.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub lease_ttl: Duration,
    /// How long CMD has between SIGTERM and SIGKILL when the allocation is asked to
    /// stop (`moorctl alloc stop`, a drain): the allocation's `kill_timeout` (default
    /// 10s, at most 10m).
    #[arg(long, value_name = "DURATION")]
    pub kill_timeout: Option<String>,
    /// Do not wait for the claims to be released after CMD exits.
    #[arg(long)]
    pub no_wait: bool,
    /// Also write the workload's environment (MOOR_*) to FILE as KEY=VALUE lines.
    #[arg(long, value_name = "FILE")]
    pub env_file: Option<PathBuf>,
    /// The command and its arguments.
    #[arg(required = true, last = true, value_name = "CMD")]
    pub command: Vec<String>,
}

/// Signals passed on to the workload.
const FORWARDED: [(tokio::signal::unix::SignalKind, rustix::process::Signal); 3] = [
    (
        tokio::signal::unix::SignalKind::interrupt(),
        rustix::process::Signal::INT,
    ),
    (
        tokio::signal::unix::SignalKind::terminate(),
        rustix::process::Signal::TERM,
    ),
    (
        tokio::signal::unix::SignalKind::hangup(),
        rustix::process::Signal::HUP,
    ),
];

/// How often the claims are looked at while waiting.
const POLL: Duration = Duration::from_millis(200);

impl Run {
    /// Runs the workload; returns its exit code.
    pub async fn run(self, ctx: &Ctx) -> anyhow::Result<i32> {
        let ns = parse_ns(&self.namespace)?;
        let name = parse_name("allocation", &self.name)?;
        let node = match &self.node {
            Some(n) => n.clone(),
            None => host_name()?,
        };
        let node = NodeName::new(&node).map_err(|e| anyhow::anyhow!("node {node:?}: {e}"))?;
        anyhow::ensure!(
            self.lease_ttl >= Duration::from_secs(1)
                && self.lease_ttl.as_secs() <= MAX_LEASE_SECONDS,
            "--lease-ttl must be 1s to {MAX_LEASE_SECONDS}s"
        );
        if let Some(path) = &self.env_file {
            refuse_link(path)?;
        }
        let wanted = self.allocation(ctx, &ns, &name, &node).await?;
        let holder = format!(
            "moorctl@{}/{}",
            host_name().unwrap_or_default(),
            std::process::id()
        );
        let lease = take_lease(ctx, &ns, &name, &holder, self.lease_ttl).await?;
        let renewer = tokio::spawn(renew(ctx.store.clone(), lease.object_key(), self.lease_ttl));
        let result = self.bound(ctx, wanted).await;
        renewer.abort();
        // The lease goes last: until the claims are released (or we gave up waiting)
        // it said the workload was ours. When the run failed on the store (the end
        // could not be recorded), it stays, unrenewed: the controller then finds the
        // allocation lost once it expires and releases its claims, instead of nobody.
        let recorded = match &result {
            Ok(_) => true,
            Err(e) => e.is::<Refused>(),
        };
        if recorded {
            let _ = ctx.store.delete(&lease.object_key(), None).await;
        } else {
            eprintln!(
                "moorctl: the allocation's end may not be recorded; its lease is left to expire in {} (the controller then releases its claims)",
                humantime::format_duration(self.lease_ttl)
            );
        }
        result
    }

    /// Everything after the lease is held: the allocation, the claims, the workload.
    async fn bound(&self, ctx: &Ctx, wanted: Allocation) -> anyhow::Result<i32> {
        let key = wanted.object_key();
        let created = adopt_or_create(ctx, &wanted).await?;
        let waited = tokio::select! {
            r = wait_published(ctx, &key, self.timeout) => r,
            why = node_never_registered(ctx, &wanted.spec.node, self.node_timeout) => {
                Err(Refused(why).into())
            }
            _ = interrupted() => Err(Refused(
                "interrupted before the workload started".into(),
            )
            .into()),
        };
        let alloc = match waited {
            Ok(alloc) => alloc,
            Err(e) => {
                if created {
                    eprintln!(
                        "moorctl: stopping allocation {} (it was created for this run)",
                        wanted.metadata.name
                    );
                    end(ctx, &key, ClientStatus::Failed, None).await?;
                    if !self.no_wait {
                        wait_released(ctx, &key, Duration::from_secs(300)).await?;
                    }
                }
                return Err(e);
            }
        };
        let env = environment(&alloc);
        if let Some(path) = &self.env_file {
            write_env_file(path, &env)?;
        }
        let tag = moor::workload::cgroup::owner_tag(
            alloc.alloc.metadata.namespace.as_str(),
            alloc.alloc.metadata.name.as_str(),
            alloc.alloc.spec.node.as_str(),
        );
        let cgroup = match Cgroup::create(&tag) {
            Ok(c) => Some(c),
            Err(why) => {
                eprintln!(
                    "moorctl: warning: the workload runs without a cgroup of its own ({why}); a process of it that leaves its process group (setsid) is not ended with it"
                );
                None
            }
        };
        set_running(ctx, &key, cgroup.as_ref().map(|c| c.recorded().to_string())).await?;
        let stop = Stop {
            asked: Box::pin(stop_asked(ctx.store.clone(), key.clone())),
            kill_timeout: alloc.alloc.spec.kill_timeout(),
        };
        let exit = spawn_and_wait(
            &self.command,
            &env,
            grace(self.lease_ttl),
            cgroup.as_ref().map(Cgroup::path),
            stop,
        )
        .await;
        // Empty by now (the guard waited for it): removed.
        drop(cgroup);
        let (status, info, code) = match exit {
            Ok(st) => outcome(st),
            Err(e) => {
                eprintln!("moorctl: cannot run {:?}: {e}", self.command[0]);
                (
                    ClientStatus::Failed,
                    ClientExit {
                        code: Some(127),
                        signal: None,
                    },
                    127,
                )
            }
        };
        eprintln!("moorctl: workload ended ({info}); allocation {status:?}, releasing its claims");
        end(ctx, &key, status, Some(info)).await?;
        if !self.no_wait {
            wait_released(ctx, &key, Duration::from_secs(600)).await?;
        }
        Ok(code)
    }

    /// The allocation this run wants: from the manifest, or from the --volume flags.
    async fn allocation(
        &self,
        ctx: &Ctx,
        ns: &Namespace,
        name: &Name,
        node: &NodeName,
    ) -> anyhow::Result<Allocation> {
        if self.volumes.len() > MAX_VOLUME_REQUESTS {
            return Err(Refused(format!(
                "{} --volume flags; an allocation may make at most {MAX_VOLUME_REQUESTS} requests",
                self.volumes.len()
            ))
            .into());
        }
        let mut alloc = match &self.file {
            Some(path) => allocation_from_file(path, ns, name, node)?,
            None => self.flags_allocation(ctx, ns, name, node).await?,
        };
        if let Some(timeout) = &self.kill_timeout {
            parse_kill_timeout(timeout).map_err(|e| Refused(format!("--kill-timeout: {e}")))?;
            alloc.spec.kill_timeout = Some(timeout.clone());
        }
        distinct_variables(&alloc)?;
        Ok(alloc)
    }

    /// The allocation the --volume flags ask for.
    async fn flags_allocation(
        &self,
        ctx: &Ctx,
        ns: &Namespace,
        name: &Name,
        node: &NodeName,
    ) -> anyhow::Result<Allocation> {
        let mut spec = AllocationSpec {
            node: node.clone(),
            ..Default::default()
        };
        for v in &self.volumes {
            spec.volumes.push(match v.split_once("=new:") {
                Some((req, rest)) => template_request(ctx, node, v, req, rest).await?,
                None => request(ctx, ns, v).await?,
            });
        }
        let alloc = Allocation::new(ns, name.clone(), spec);
        alloc
            .validate()
            .map_err(|e| Refused(format!("allocation {name}: {e}")))?;
        Ok(alloc)
    }
}

/// Resolves, with why, once `node` has gone unregistered (no Node object: no agent
/// registered it, or it expired) for `bound` in a row; never while it is registered. A
/// read that fails counts as neither.
async fn node_never_registered(ctx: &Ctx, node: &NodeName, bound: Duration) -> String {
    let key = Node::key_for(node);
    let mut absent_since: Option<tokio::time::Instant> = None;
    loop {
        match ctx.store.try_get(&key).await {
            Ok(Some(_)) => absent_since = None,
            Ok(None) => {
                let since = *absent_since.get_or_insert_with(tokio::time::Instant::now);
                if since.elapsed() >= bound {
                    return format!(
                        "node {node} has not been registered for {}: no agent runs for it (start `moord agent --node {node}`, or give --node another; --node-timeout sets this bound)",
                        humantime::format_duration(bound)
                    );
                }
            }
            Err(e) => tracing::debug!(error = %e, "reading the node"),
        }
        tokio::time::sleep(Duration::from_secs(1).min(bound)).await;
    }
}

/// Resolves when the allocation at `key` is asked to stop (`desired_status: stop`,
/// `moorctl alloc stop`, a drain) or is deleted, with what happened; read, then
/// watched from that revision (one key: no polling), again after a failure.
async fn stop_asked(store: moor::store::Store, key: ObjectKey<AllocationSpec>) -> String {
    let mut backoff =
        moor::backoff::Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    let asked = |a: &Allocation| a.spec.desired_status == DesiredStatus::Stop || a.is_deleting();
    loop {
        let revision = match store.try_get(&key).await {
            Ok(None) => return format!("allocation {} was deleted", key.name()),
            Ok(Some(a)) if asked(&a) => {
                return format!("allocation {} was asked to stop", key.name())
            }
            Ok(Some(a)) => a.metadata.resource_version,
            Err(e) => {
                tracing::debug!(error = %e, "reading the allocation for a stop");
                tokio::time::sleep(backoff.next_delay()).await;
                continue;
            }
        };
        if let Ok(mut watch) = store.watch_key(key.as_str(), revision + 1, false).await {
            while let Ok(Some(batch)) = watch.next().await {
                for ev in batch.events {
                    if ev.kind == moor::store::RawEventKind::Delete {
                        return format!("allocation {} was deleted", key.name());
                    }
                    let decoded =
                        store
                            .codec()
                            .decode::<AllocationSpec>(&ev.key, &ev.value, ev.mod_revision);
                    if decoded.is_ok_and(|a| asked(&a)) {
                        return format!("allocation {} was asked to stop", key.name());
                    }
                }
                backoff.reset();
            }
        }
        tokio::time::sleep(backoff.next_delay()).await;
    }
}

/// Refuses requests whose names give the same `MOOR_VOLUME_<REQ>` (`a-b` and `a_b`): the
/// workload would see only one of the two paths.
fn distinct_variables(alloc: &Allocation) -> anyhow::Result<()> {
    let mut seen: BTreeMap<String, &Name> = BTreeMap::new();
    for req in &alloc.spec.volumes {
        let var = volume_var(&req.name);
        if let Some(first) = seen.insert(var.clone(), &req.name) {
            return Err(Refused(format!(
                "requests {first} and {} would both be {var}; rename one",
                req.name
            ))
            .into());
        }
    }
    Ok(())
}

/// Refuses an --env-file that is a symbolic link (writing through it, as root, would
/// create or overwrite whatever it points at).
fn refuse_link(path: &std::path::Path) -> anyhow::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => Err(Refused(format!(
            "--env-file {}: is a symbolic link; give the file itself",
            path.display()
        ))
        .into()),
        Ok(m) if !m.is_file() => {
            Err(Refused(format!("--env-file {}: not a regular file", path.display())).into())
        }
        _ => Ok(()),
    }
}

/// One `REQ=new:SIZE[,plugin=P][,ephemeral|retain]` (`flag`, split at `=new:` into
/// `req` and `rest`): a template request on `node`.
async fn template_request(
    ctx: &Ctx,
    node: &NodeName,
    flag: &str,
    req: &str,
    rest: &str,
) -> anyhow::Result<VolumeRequest> {
    let bad = |why: String| Refused(format!("--volume {flag:?}: {why}"));
    let mut parts = rest.split(',');
    let size = parts.next().unwrap_or_default();
    let size = Size::parse(size).map_err(|e| bad(format!("size {size:?}: {e}")))?;
    let mut tpl = VolumeTemplate {
        capacity_min: Some(size),
        ..Default::default()
    };
    let mut plugin = None;
    for opt in parts {
        match opt.split_once('=') {
            Some(("plugin", p)) => {
                plugin = Some(PluginId::new(p).map_err(|e| bad(format!("plugin {p:?}: {e}")))?)
            }
            None if opt == "ephemeral" => tpl.lifecycle = VolumeLifecycle::Ephemeral,
            None if opt == "retain" => tpl.lifecycle = VolumeLifecycle::Retain,
            _ => return Err(bad(format!("{opt:?} is not plugin=P, ephemeral or retain")).into()),
        }
    }
    tpl.plugin_id = match plugin {
        Some(p) => p,
        // A default class fills what the template leaves (its plugin, parameters and
        // the rest), as an applied template's does, where the leading controller
        // knows classes in templates (issue 78, item 7: new:SIZE ignored it).
        None if default_class_applies(ctx).await? => PluginId::default(),
        None => {
            // The node's only node plugin.
            let found = ride_out(ctx, |_| {
                let key = Node::key_for(node);
                async move { Ok(ctx.store.try_get(&key).await?) }
            })
            .await?
            .ok_or_else(|| {
                bad(format!(
                    "node {node} is not registered; name the plugin with plugin=P"
                ))
            })?;
            let plugins: Vec<&PluginId> = found
                .status
                .plugins
                .iter()
                .filter(|(_, p)| p.plugin_type != PluginType::Controller)
                .map(|(id, _)| id)
                .collect();
            match plugins.as_slice() {
                [one] => (*one).clone(),
                [] => return Err(bad(format!("node {node} runs no node plugin")).into()),
                many => {
                    let names: Vec<String> = many.iter().map(|p| p.to_string()).collect();
                    return Err(bad(format!(
                        "node {node} runs plugins {}; name one with plugin=P",
                        names.join(", ")
                    ))
                    .into());
                }
            }
        }
    };
    Ok(VolumeRequest {
        name: parse_name("request", req)?,
        template: Some(Box::new(tpl)),
        ..Default::default()
    })
}

/// Whether a default VolumeClass exists and the leading controller fills templates
/// from classes (`FEATURE_TEMPLATE_CLASS`).
async fn default_class_applies(ctx: &Ctx) -> anyhow::Result<bool> {
    let classes = ride_out(ctx, |_| async move {
        Ok(ctx
            .store
            .list(&KeyScope::<VolumeClassSpec>::all())
            .await?
            .items)
    })
    .await?;
    if !classes.iter().any(|c| c.spec.default && !c.is_deleting()) {
        return Ok(false);
    }
    let leader = moor::runtime::leader::holder(&ctx.store, "controller").await?;
    Ok(leader.is_some_and(|r| r.features.iter().any(|f| f == moor::FEATURE_TEMPLATE_CLASS)))
}

/// One `REQ=VOLUME[:ro]`, with the volume's first capability.
async fn request(ctx: &Ctx, ns: &Namespace, flag: &str) -> anyhow::Result<VolumeRequest> {
    let (req, rest) = flag
        .split_once('=')
        .ok_or_else(|| Refused(format!("--volume {flag:?}: expected REQ=VOLUME[:ro]")))?;
    let (volume, read_only) = match rest.strip_suffix(":ro") {
        Some(v) => (v, true),
        None => (rest, false),
    };
    let req = parse_name("request", req)?;
    let volume = VolumeId::new(volume)
        .map_err(|e| Refused(format!("--volume {flag:?}: volume {volume:?}: {e}")))?;
    let stored = ride_out(ctx, |_| {
        let key = Volume::key_for(ns, &volume);
        async move { Ok(ctx.store.try_get(&key).await?) }
    })
    .await?
    .ok_or_else(|| Refused(format!("--volume {flag}: volume {ns}/{volume} not found")))?;
    let cap = stored
        .spec
        .capabilities
        .first()
        .copied()
        .ok_or_else(|| Refused(format!("volume {volume} offers no capability")))?;
    Ok(VolumeRequest {
        name: req,
        volume,
        read_only: read_only || !cap.access_mode.allows_write(),
        access_mode: Some(cap.access_mode),
        attachment_mode: Some(cap.attachment_mode),
        ..Default::default()
    })
}

fn allocation_from_file(
    path: &std::path::Path,
    ns: &Namespace,
    name: &Name,
    node: &NodeName,
) -> anyhow::Result<Allocation> {
    let text = crate::apply::read_input(&path.to_string_lossy())?;
    let mut found = None;
    for doc in parse_manifests(&text) {
        match doc.map_err(|e| Refused(format!("{}: {e}", path.display())))? {
            AnyObject::Allocation(a) if found.is_none() => found = Some(*a),
            _ => {
                return Err(Refused(format!(
                    "{}: alloc run takes one Allocation",
                    path.display()
                ))
                .into())
            }
        }
    }
    let mut alloc =
        found.ok_or_else(|| Refused(format!("{}: no Allocation in it", path.display())))?;
    if &alloc.metadata.name != name || &alloc.metadata.namespace != ns {
        return Err(Refused(format!(
            "{}: the manifest is allocation {}/{}, not {ns}/{name}",
            path.display(),
            alloc.metadata.namespace,
            alloc.metadata.name
        ))
        .into());
    }
    if alloc.spec.node.as_str().is_empty() {
        alloc.spec.node = node.clone();
    }
    alloc.spec.desired_status = DesiredStatus::Run;
    alloc.spec.client_status = ClientStatus::Pending;
    Ok(alloc)
}

/// The host's name (the node by default).
fn host_name() -> anyhow::Result<String> {
    let uname = rustix::system::uname();
    let name = uname.nodename().to_string_lossy().into_owned();
    anyhow::ensure!(!name.is_empty(), "the host has no name; give --node");
    Ok(name)
}

/// Creates the allocation (`true`), or adopts the stored one of that name when it is live
/// and on the same node (`false`): `moor::workload::create_or_adopt`.
async fn adopt_or_create(ctx: &Ctx, wanted: &Allocation) -> anyhow::Result<bool> {
    ride_out(ctx, |retrying| async move {
        match workload::create_or_adopt(&ctx.store, wanted, IfEnded::Refuse, retrying).await {
            Ok(Started::Created(_)) => Ok(true),
            Ok(Started::Adopted(a)) => {
                eprintln!("moorctl: adopting allocation {}", a.metadata.name);
                Ok(false)
            }
            Err(e) => Err(refusal(e)),
        }
    })
    .await
}

/// A refusal of the workload module as moorctl reports it: the reason (exit 1), or the
/// store's error.
pub(crate) fn refusal(e: WorkloadError) -> anyhow::Error {
    match e {
        WorkloadError::Store(e) => e.into(),
        other => Refused(other.to_string()).into(),
    }
}

/// How a wait of `alloc run` paces itself (every [`POLL`]) and reports (a line on
/// stderr for each change).
pub(crate) fn pace(say: &mut (dyn FnMut(&str) + Send)) -> Pace<'_> {
    Pace {
        poll: moor::backoff::Backoff::new(POLL, POLL).without_jitter(),
        progress: say,
        wake: None,
        store_patience: None,
    }
}

/// Waits until every claim of the allocation is Published, with its paths.
async fn wait_published(
    ctx: &Ctx,
    key: &ObjectKey<AllocationSpec>,
    timeout: Duration,
) -> anyhow::Result<workload::Published> {
    let mut say = |line: &str| eprintln!("moorctl: {line}");
    workload::wait_published(&ctx.store, key, timeout, pace(&mut say))
        .await
        .map_err(refusal)
}

/// Waits until every claim of the allocation is Released (or gone).
async fn wait_released(
    ctx: &Ctx,
    key: &ObjectKey<AllocationSpec>,
    timeout: Duration,
) -> anyhow::Result<()> {
    let mut say = |line: &str| eprintln!("moorctl: {line}");
    workload::wait_released(&ctx.store, key, timeout, pace(&mut say))
        .await
        .map_err(refusal)?;
    eprintln!("moorctl: allocation {}: every claim released", key.name());
    Ok(())
}

/// MOOR_ALLOC, MOOR_NODE and `MOOR_VOLUME_<REQ>` for each request (its target path, as
/// the node's agent published it).
fn environment(published: &workload::Published) -> BTreeMap<String, String> {
    let alloc = &published.alloc;
    let mut env = BTreeMap::new();
    env.insert("MOOR_ALLOC".to_string(), alloc.metadata.name.to_string());
    env.insert("MOOR_NODE".to_string(), alloc.spec.node.to_string());
    for (req, path) in &published.paths {
        env.insert(volume_var(req), path.target_path.clone());
    }
    env
}

/// Each request's paths, from its claim's Mount (requests not published yet are left
/// out).
pub(crate) async fn paths(
    ctx: &Ctx,
    alloc: &Allocation,
) -> anyhow::Result<Vec<(Name, RequestPaths)>> {
    Ok(workload::seen(&ctx.store, alloc.clone(), true).await?.paths)
}

/// `MOOR_VOLUME_<REQ>`: REQ upper-cased, every other character than A-Z and 0-9 `_`.
pub(crate) fn volume_var(req: &Name) -> String {
    let tail: String = req
        .as_str()
        .chars()
        .map(|c| match c.to_ascii_uppercase() {
            u @ ('A'..='Z' | '0'..='9') => u,
            _ => '_',
        })
        .collect();
    format!("MOOR_VOLUME_{tail}")
}

/// Writes the environment file, readable by its owner only, never through a symbolic
/// link (O_NOFOLLOW: a link swapped in after the early check is refused too).
fn write_env_file(path: &std::path::Path, env: &BTreeMap<String, String>) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mut text = String::new();
    for (k, v) in env {
        text.push_str(&format!("{k}={v}\n"));
    }
    let fail = |e: std::io::Error| anyhow::anyhow!("writing {}: {e}", path.display());
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(fail)?;
    anyhow::ensure!(
        f.metadata().map_err(fail)?.is_file(),
        "writing {}: not a regular file",
        path.display()
    );
    // An existing file keeps its mode through open: make it the owner's alone.
    f.set_permissions(std::fs::Permissions::from_mode(0o600))
        .map_err(fail)?;
    f.write_all(text.as_bytes()).map_err(fail)
}

async fn set_running(
    ctx: &Ctx,
    key: &ObjectKey<AllocationSpec>,
    cgroup: Option<String>,
) -> anyhow::Result<()> {
    ride_out(ctx, |_| {
        let cgroup = cgroup.clone();
        async move { Ok(workload::set_running(&ctx.store, key, cgroup).await?) }
    })
    .await
}

/// The workload's end in one write: its client status, how it exited, and stop.
async fn end(
    ctx: &Ctx,
    key: &ObjectKey<AllocationSpec>,
    status: ClientStatus,
    exit: Option<ClientExit>,
) -> anyhow::Result<()> {
    ride_out(ctx, |_| {
        let how = End::Ended(status, exit.clone());
        async move {
            workload::end(&ctx.store, key, how).await?;
            Ok(())
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_names_become_environment_variables() {
        let n = |s| Name::new(s).unwrap();
        assert_eq!(volume_var(&n("data")), "MOOR_VOLUME_DATA");
        assert_eq!(volume_var(&n("web-data.v2")), "MOOR_VOLUME_WEB_DATA_V2");
        assert_eq!(volume_var(&n("a_1")), "MOOR_VOLUME_A_1");
    }
}
