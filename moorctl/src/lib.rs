//! moorctl: the verbs, one file each, dispatched from one enum.
//!
//! Exit codes: 0 success; 1 the request was understood but did not succeed (invalid
//! manifest, conflict, not found, a wait that timed out); 2 usage or connection errors.

mod apply;
mod describe;
mod events;
mod get;
mod kind;
mod status;
mod table;
mod validate;
mod wait;

use clap::{CommandFactory, Parser, Subcommand};

use moor::api::{Name, Namespace, NodeName};
use moor::store::{EtcdAuth, Store, StoreError};

pub use kind::Kind;

/// moorctl: edit moor's desired state and watch it converge.
#[derive(Debug, Parser)]
#[command(name = "moorctl", version, about)]
pub struct Cli {
    /// etcd endpoints, comma-separated.
    #[arg(
        long,
        env = "MOOR_ENDPOINTS",
        value_delimiter = ',',
        default_value = "http://127.0.0.1:2379",
        global = true
    )]
    pub endpoints: Vec<String>,
    /// Key prefix moor uses in etcd.
    #[arg(long, env = "MOOR_PREFIX", default_value = moor::store::DEFAULT_PREFIX, global = true)]
    pub prefix: String,
    /// TLS and etcd auth.
    #[command(flatten)]
    pub auth: EtcdAuth,
    /// How long a write whose answer was lost (etcd unavailable: a member dying, the
    /// quorum gone) is retried before the verb gives up on the object.
    #[arg(long, env = "MOOR_RETRY_FOR", default_value = "60s", value_parser = humantime::parse_duration, global = true)]
    pub retry_for: std::time::Duration,
    /// The verb.
    #[command(subcommand)]
    pub command: Command,
}

/// Where a namespaced object is looked for.
#[derive(Debug, Clone, clap::Args)]
pub struct NsArgs {
    /// Namespace.
    #[arg(short = 'n', long, default_value = "default")]
    pub namespace: String,
    /// Every namespace.
    #[arg(short = 'A', long, conflicts_with = "namespace")]
    pub all_namespaces: bool,
}

impl NsArgs {
    /// The namespace to filter on; `None` for all.
    pub fn filter(&self) -> anyhow::Result<Option<Namespace>> {
        if self.all_namespaces {
            return Ok(None);
        }
        Ok(Some(Namespace::new(&self.namespace).map_err(|e| {
            anyhow::anyhow!("namespace {:?}: {e}", self.namespace)
        })?))
    }
}

/// moorctl's verbs.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create or update objects from manifests (YAML or JSON, several documents).
    Apply(apply::Apply),
    /// List objects, or show one.
    Get(get::Get),
    /// Show one object with its related objects and recent events.
    Describe(describe::Describe),
    /// Delete an object (finalizers hold it until their owners are done).
    Delete(Delete),
    /// Allocation verbs.
    #[command(subcommand)]
    Alloc(AllocCmd),
    /// Volume verbs.
    #[command(subcommand)]
    Volume(VolumeCmd),
    /// Plugin verbs.
    #[command(subcommand)]
    Plugin(PluginCmd),
    /// The reconciliation events, oldest first.
    Events(events::Events),
    /// Wait until an object reaches a phase.
    Wait(wait::Wait),
    /// Check manifests (YAML or JSON, several documents) without applying them.
    Validate(validate::Validate),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completion {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

/// `moorctl delete KIND NAME`.
#[derive(Debug, clap::Args)]
pub struct Delete {
    /// The kind.
    pub kind: Kind,
    /// The name.
    pub name: String,
    /// Namespace.
    #[arg(short = 'n', long, default_value = "default")]
    pub namespace: String,
}

/// `moorctl alloc ...`.
#[derive(Debug, Subcommand)]
pub enum AllocCmd {
    /// Stop an allocation: its claims are released.
    Stop {
        /// The allocation.
        name: String,
        /// Namespace.
        #[arg(short = 'n', long, default_value = "default")]
        namespace: String,
    },
}

/// `moorctl volume ...`.
#[derive(Debug, Subcommand)]
pub enum VolumeCmd {
    /// Declare a node gone for a volume: its claims there are released without the node.
    Detach {
        /// The volume.
        volume: String,
        /// The node that is gone.
        #[arg(long)]
        node: String,
        /// Namespace.
        #[arg(short = 'n', long, default_value = "default")]
        namespace: String,
    },
    /// Volumes with their plugin, schedulability, access mode and claims.
    Status(status::VolumeStatusCmd),
}

/// `moorctl plugin ...`.
#[derive(Debug, Subcommand)]
pub enum PluginCmd {
    /// Plugins with their provider and healthy/expected controllers and nodes.
    Status(status::PluginStatusCmd),
}

impl Cli {
    /// Runs the verb; returns the process exit code.
    pub fn run(self) -> anyhow::Result<i32> {
        match self.command {
            Command::Validate(cmd) => return cmd.run(),
            Command::Completion { shell } => {
                let mut cmd = Cli::command();
                clap_complete::generate(shell, &mut cmd, "moorctl", &mut std::io::stdout());
                return Ok(0);
            }
            _ => {}
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async move {
            let store = self.auth.connect(&self.endpoints, &self.prefix).await?;
            let ctx = Ctx {
                store,
                retry_for: self.retry_for,
            };
            match self.command {
                Command::Apply(cmd) => cmd.run(&ctx).await,
                Command::Get(cmd) => cmd.run(&ctx).await,
                Command::Describe(cmd) => cmd.run(&ctx).await,
                Command::Delete(cmd) => delete(&ctx, cmd).await,
                Command::Alloc(AllocCmd::Stop { name, namespace }) => {
                    alloc_stop(&ctx, &namespace, &name).await
                }
                Command::Volume(VolumeCmd::Detach {
                    volume,
                    node,
                    namespace,
                }) => volume_detach(&ctx, &namespace, &volume, &node).await,
                Command::Volume(VolumeCmd::Status(cmd)) => cmd.run(&ctx).await,
                Command::Plugin(PluginCmd::Status(cmd)) => cmd.run(&ctx).await,
                Command::Events(cmd) => cmd.run(&ctx).await,
                Command::Wait(cmd) => cmd.run(&ctx).await,
                Command::Validate(_) | Command::Completion { .. } => unreachable!(),
            }
        })
    }
}

/// What every verb gets.
pub struct Ctx {
    /// The store.
    pub store: Store,
    /// See [`Cli::retry_for`].
    pub retry_for: std::time::Duration,
}

/// An error that is the user's answer, not a failure of moorctl: printed, exit code 1.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

fn parse_name(what: &str, s: &str) -> anyhow::Result<Name> {
    Name::new(s).map_err(|e| anyhow::anyhow!("{what} {s:?}: {e}"))
}

fn parse_ns(s: &str) -> anyhow::Result<Namespace> {
    Namespace::new(s).map_err(|e| anyhow::anyhow!("namespace {s:?}: {e}"))
}

/// A step's write failed on a change that an earlier write of the same step, whose
/// answer was lost, may have made: [`ride_out`] reads again at once. Past
/// `--retry-for` it is a refusal.
#[derive(Debug, thiserror::Error)]
#[error("it kept changing while applying; run apply again")]
pub(crate) struct LookAgain;

/// Runs a writing step again while its outcome is unknown (etcd unavailable: a member
/// gone, a connection reset, a deadline), for `--retry-for` (a minute), on whichever member
/// answers. Every step reads before it writes, so a run after a lost answer learns
/// whether that write landed; `retrying` tells it one may have. A step that answers
/// [`LookAgain`] is run again at once.
pub(crate) async fn ride_out<T, F, Fut>(ctx: &Ctx, mut step: F) -> anyhow::Result<T>
where
    F: FnMut(bool) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let deadline = tokio::time::Instant::now() + ctx.retry_for;
    let mut delay = std::time::Duration::from_millis(100);
    let mut retrying = false;
    loop {
        match step(retrying).await {
            Err(e) if is_transient(&e) && tokio::time::Instant::now() < deadline => {
                tracing::debug!(error = format!("{e:#}"), "outcome unknown; trying again");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(std::time::Duration::from_secs(2));
                retrying = true;
            }
            Err(e) if e.is::<LookAgain>() && tokio::time::Instant::now() < deadline => {
                retrying = true;
            }
            Err(e) if e.is::<LookAgain>() => return Err(Refused(e.to_string()).into()),
            other => return other,
        }
    }
}

/// Whether the error is etcd being unavailable (retry later, on any member).
pub(crate) fn is_transient(e: &anyhow::Error) -> bool {
    e.downcast_ref::<StoreError>()
        .is_some_and(StoreError::is_transient)
}

fn is_not_found(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<StoreError>(),
        Some(StoreError::NotFound { .. })
    )
}

async fn delete(ctx: &Ctx, cmd: Delete) -> anyhow::Result<i32> {
    let ns = parse_ns(&cmd.namespace)?;
    // None: not found; after a lost answer, that is our deletion having landed.
    let outcome = ride_out(ctx, |retrying| {
        let ns = &ns;
        let cmd = &cmd;
        async move {
            let key = kind::find_key(ctx, cmd.kind, Some(ns), &cmd.name).await?;
            match key {
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
        println!("{} {} deleted", cmd.kind, cmd.name);
    } else {
        println!(
            "{} {} marked for deletion; waiting for {}",
            cmd.kind,
            cmd.name,
            finalizing.join(", ")
        );
    }
    Ok(0)
}

async fn alloc_stop(ctx: &Ctx, namespace: &str, name: &str) -> anyhow::Result<i32> {
    use moor::api::{AllocationSpec, DesiredStatus};
    let ns = parse_ns(namespace)?;
    let name = parse_name("allocation", name)?;
    let suffix = format!("{ns}/{name}");
    let stop = |spec: &mut AllocationSpec| {
        let running = spec.desired_status != DesiredStatus::Stop;
        spec.desired_status = DesiredStatus::Stop;
        running
    };
    let outcome = ride_out(ctx, |retrying| {
        let suffix = &suffix;
        async move {
            let (_, wrote) = ctx.store.modify_spec(suffix, stop).await?;
            // After a lost answer, "already stopped" may be our write.
            Ok(wrote || retrying)
        }
    })
    .await;
    match outcome {
        Ok(true) => println!("allocation {name} stopped; its claims will be released"),
        Ok(false) => println!("allocation {name} already stopped"),
        Err(e) if is_not_found(&e) => {
            return Err(Refused(format!("allocation {suffix} not found")).into())
        }
        Err(e) => return Err(e),
    }
    Ok(0)
}

async fn volume_detach(
    ctx: &Ctx,
    namespace: &str,
    volume: &str,
    node: &str,
) -> anyhow::Result<i32> {
    use moor::api::VolumeSpec;
    let ns = parse_ns(namespace)?;
    let volume = parse_name("volume", volume)?;
    let node = NodeName::new(node).map_err(|e| anyhow::anyhow!("node {node:?}: {e}"))?;
    let suffix = format!("{ns}/{volume}");
    // The entry names the generation this very write makes, so it covers exactly the
    // claims admitted before it. After a lost answer, an entry naming the stored
    // generation is that write.
    let outcome = ride_out(ctx, |retrying| {
        let (suffix, node) = (&suffix, &node);
        async move {
            loop {
                let mut v = ctx.store.get::<VolumeSpec>(suffix).await?;
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
            return Err(Refused(format!("volume {suffix} not found")).into())
        }
        Err(e) => return Err(e),
    }
    println!(
        "volume {volume}: node {node} marked gone; its claims there now will be released without node calls"
    );
    Ok(0)
}
