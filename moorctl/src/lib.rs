//! moorctl: the verbs, one file each, dispatched from one enum.
//!
//! Exit codes: 0 success; 1 the request was understood but did not succeed (invalid
//! manifest, conflict, not found, a wait that timed out); 2 usage or connection errors.
//!
//! # Layout
//! - `out`: every line to stdout, escaped; a closed pipe ends quietly.
//! - [`explain`]: errors a person reads, on one line.
//! - `apply`, `get`, `describe`, `delete`, `events`, `wait`, `validate`: the generic
//!   verbs.
//! - `alloc`, `run`, `plan`: `alloc stop` and `paths`, `alloc run`, `alloc plan`.
//! - `volume`, `snapshot`, `plugin`, `status`: the volume, snapshot and plugin verbs
//!   and status views.
//! - `share`: `volume share|unshare|own`, an operator's word on who may use a plugin
//!   volume (its ownership record).
//! - `mount`: `mount adopt` and `mount release` of an orphaned mount (an older etcd
//!   snapshot restored).
//! - `drain`: `node cordon|uncordon|drain` and `volume pause|activate|drain`.
//! - `kind`, `table`: the generic operations on any kind, and each kind's columns.
//! - `sources`: which writers may speak about an object (every view of events).
//! - `complete`: `completion SHELL`, and the object names bash's completion asks
//!   `__complete` for.
//! - [`config`]: the configuration file (`MOOR_CONFIG`, `~/.config/moor/moorctl.env`)
//!   read before the flags.

/// `println!` to stdout, ending the process quietly (exit 0) when the reader went away
/// (`moorctl get volumes | head -1`): a closed pipe is not an error of ours.
#[macro_export]
macro_rules! outln {
    () => { $crate::out::write(format_args!("\n")) };
    ($($t:tt)*) => { $crate::out::write(format_args!("{}\n", format_args!($($t)*))) };
}

/// `print!` to stdout, as [`outln!`] does.
#[macro_export]
macro_rules! out {
    ($($t:tt)*) => { $crate::out::write(format_args!($($t)*)) };
}

pub mod out {
    //! Standard output that a closed pipe ends quietly, and that no stored value can
    //! use to drive the operator's terminal.
    use std::io::Write;

    /// Writes `args` to stdout with [`terminal_safe`]; exits 0 on a broken pipe, and 2
    /// on another write error (a full disk), saying so on stderr.
    pub fn write(args: std::fmt::Arguments) {
        let text = terminal_safe(&args.to_string());
        let mut out = std::io::stdout().lock();
        if let Err(e) = out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                std::process::exit(0);
            }
            eprintln!("moorctl: cannot write to standard output: {e}");
            std::process::exit(2);
        }
    }

    /// `text` with every control character but newline and tab, and every
    /// bidirectional override, written as an escape: `\u{1b}` (in JSON output, where
    /// the serializer already escaped control characters, a bidirectional override
    /// becomes a valid JSON escape, see [`json_safe`]).
    pub fn terminal_safe(text: &str) -> String {
        if !text.chars().any(needs_escape) {
            return text.to_string();
        }
        let mut out = String::with_capacity(text.len() + 16);
        for c in text.chars() {
            if needs_escape(c) {
                out.push_str(&format!("\\u{{{:x}}}", c as u32));
            } else {
                out.push(c);
            }
        }
        out
    }

    /// JSON text with bidirectional overrides written as JSON escapes (`\u202e`), so
    /// that it stays valid JSON after [`terminal_safe`] (which then finds nothing).
    pub fn json_safe(json: &str) -> String {
        let mut out = String::with_capacity(json.len());
        for c in json.chars() {
            if needs_escape(c) {
                out.push_str(&format!("\\u{:04x}", c as u32));
            } else {
                out.push(c);
            }
        }
        out
    }

    fn needs_escape(c: char) -> bool {
        let bidi = matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
        (c.is_control() && c != '\n' && c != '\t') || bidi
    }
}

mod alloc;
mod apply;
mod complete;
pub mod config;
mod delete;
mod describe;
mod drain;
mod events;
pub mod explain;
mod get;
mod kind;
mod mount;
mod plan;
mod plugin;
mod run;
mod share;
mod snapshot;
mod sources;
mod status;
mod table;
mod validate;
mod volume;
mod wait;

use clap::{Parser, Subcommand};

use moor::api::{Name, Namespace};
use moor::store::{EtcdAuth, Store, StoreError};

pub use kind::Kind;

/// `moorctl --version`: the version, the commit and whether the tree was clean.
pub const LONG_VERSION: &str = moor::long_version!();

/// moorctl: edit moor's desired state and watch it converge.
#[derive(Debug, Parser)]
#[command(name = "moorctl", version = LONG_VERSION, about)]
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
    /// How long one request to etcd may take (connecting included): a paused or
    /// overloaded etcd that accepts the connection and never answers fails the verb
    /// with this bound named. A watch (`-w`, `events -w`, `wait`) asks a quiet etcd
    /// for progress after it and says so when no answer comes in as long again.
    #[arg(long, env = "MOOR_REQUEST_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration, global = true)]
    pub request_timeout: std::time::Duration,
    /// On failure, print every cause under the one-line explanation.
    #[arg(short = 'v', long, global = true)]
    pub verbose: bool,
    /// The verb.
    #[command(subcommand)]
    pub command: Command,
}

/// Where a namespaced object is looked for.
#[derive(Debug, Clone, clap::Args)]
pub struct NsArgs {
    /// Namespace.
    #[arg(short = 'n', long, env = "MOOR_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// Every namespace (over `-n` and MOOR_NAMESPACE).
    #[arg(short = 'A', long)]
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
    Delete(delete::Delete),
    /// Allocation verbs.
    #[command(subcommand)]
    Alloc(AllocCmd),
    /// Volume verbs.
    #[command(subcommand)]
    Volume(VolumeCmd),
    /// Plugin verbs.
    #[command(subcommand)]
    Plugin(PluginCmd),
    /// Node verbs: cordon, uncordon, drain.
    #[command(subcommand)]
    Node(drain::NodeCmd),
    /// Mounts a node keeps although desired state lost their claims (an older etcd
    /// snapshot restored; `get mounts --orphaned` lists them): adopt or release each.
    #[command(subcommand)]
    Mount(mount::MountCmd),
    /// The reconciliation events, oldest first.
    Events(events::Events),
    /// Wait until an object reaches a phase.
    Wait(wait::Wait),
    /// Check manifests (YAML or JSON, several documents) without applying them.
    Validate(validate::Validate),
    /// Print moorctl's version and the leading controller's.
    Version,
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completion {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Internal: the names of stored objects the last word may be (shell completion).
    #[command(name = "__complete", hide = true)]
    Complete {
        /// What follows `moorctl` on the line, the word being completed last.
        #[arg(num_args = 0.., allow_hyphen_values = true, trailing_var_arg = true)]
        words: Vec<String>,
    },
    /// Internal: the process `alloc run` puts between itself and CMD.
    #[command(name = "__workload-guard", hide = true)]
    WorkloadGuard(run::guard::Guard),
}

/// `moorctl alloc ...`.
#[derive(Debug, Subcommand)]
pub enum AllocCmd {
    /// Run a command bound to an allocation: create (or adopt) it, wait for its volumes,
    /// run CMD with `MOOR_VOLUME_<REQ>` set to their paths, then end the allocation with
    /// CMD's exit and release its claims.
    Run(run::Run),
    /// Which nodes could take an allocation now, and why the others cannot (the
    /// controller's own admission rules; nothing is written). Exit 0 when one fits.
    Plan(plan::Plan),
    /// Print where each request's volume is on the node (REQ=PATH lines).
    Paths {
        /// The allocation.
        name: String,
        /// Namespace.
        #[arg(short = 'n', long, env = "MOOR_NAMESPACE", default_value = "default")]
        namespace: String,
        /// Print `export MOOR_VOLUME_<REQ>=PATH` lines, for `eval`.
        #[arg(long)]
        export: bool,
    },
    /// Stop an allocation: its claims are released.
    Stop {
        /// The allocation.
        name: String,
        /// Namespace.
        #[arg(short = 'n', long, env = "MOOR_NAMESPACE", default_value = "default")]
        namespace: String,
        /// Also an engine's hold: its volumes are released under its live containers
        /// after the kill timeout (moor cannot stop a container).
        #[arg(long)]
        force: bool,
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
        #[arg(short = 'n', long, env = "MOOR_NAMESPACE", default_value = "default")]
        namespace: String,
    },
    /// Volumes with their plugin, schedulability, access mode and claims.
    Status(status::VolumeStatusCmd),
    /// Admit no new claim of VOLUME (Swarm's pause); its claims stay.
    Pause {
        /// The volume.
        volume: String,
        /// Namespace.
        #[arg(short = 'n', long, env = "MOOR_NAMESPACE", default_value = "default")]
        namespace: String,
    },
    /// Admit claims of VOLUME again (undoes pause and drain).
    Activate {
        /// The volume.
        volume: String,
        /// Namespace.
        #[arg(short = 'n', long, env = "MOOR_NAMESPACE", default_value = "default")]
        namespace: String,
    },
    /// Pause VOLUME, stop the allocations holding it whose runner can stop their
    /// workload (an engine container's is reported, never stopped), and wait until no
    /// claim holds it. Exit 1 at the timeout.
    Drain {
        /// The volume.
        volume: String,
        /// How long to wait.
        #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
        timeout: std::time::Duration,
        /// Namespace.
        #[arg(short = 'n', long, env = "MOOR_NAMESPACE", default_value = "default")]
        namespace: String,
    },
    /// Snapshots of volumes: create, delete, list.
    #[command(subcommand)]
    Snapshot(snapshot::SnapshotCmd),
    /// Let registrations in other namespaces use VOLUME's plugin volume (read-only
    /// claims unless --write), never delete it. Operators only: it writes the plugin's
    /// ownership record.
    Share {
        /// The volume that owns the plugin volume.
        volume: String,
        /// The namespaces (repeat, or comma-separated).
        #[arg(long, required = true)]
        with: Vec<String>,
        /// Admit their writing claims too (the access-mode rules count each
        /// namespace's volume on its own: one writer is then yours to keep).
        #[arg(long)]
        write: bool,
        /// Namespace.
        #[arg(short = 'n', long, env = "MOOR_NAMESPACE", default_value = "default")]
        namespace: String,
    },
    /// Take back `share`: those namespaces' new claims of the plugin volume are refused.
    Unshare {
        /// The volume that owns the plugin volume.
        volume: String,
        /// The namespaces (repeat, or comma-separated).
        #[arg(long, required = true)]
        with: Vec<String>,
        /// Namespace.
        #[arg(short = 'n', long, env = "MOOR_NAMESPACE", default_value = "default")]
        namespace: String,
    },
    /// Make the registration VOLUME the owner of the plugin volume it names, evicting
    /// the volume that registered it first (never its creator). Operators only.
    Own {
        /// The registration.
        volume: String,
        /// Namespace.
        #[arg(short = 'n', long, env = "MOOR_NAMESPACE", default_value = "default")]
        namespace: String,
    },
    /// Remove a volume from moor without any plugin call (a created volume's storage is
    /// kept); refused while claims hold it.
    Deregister {
        /// The volume.
        volume: String,
        /// Also drop the claims of terminal allocations (a node that will never release
        /// them), and their attachments, without plugin calls; printed first.
        #[arg(long)]
        force: bool,
        /// Namespace.
        #[arg(short = 'n', long, env = "MOOR_NAMESPACE", default_value = "default")]
        namespace: String,
    },
}

/// `moorctl plugin ...`.
#[derive(Debug, Subcommand)]
pub enum PluginCmd {
    /// Plugins with their provider and healthy/expected controllers and nodes.
    Status(status::PluginStatusCmd),
    /// Forget the instance of a plugin on a node that is gone for good: it stops
    /// counting as expected (refused while the node is live).
    Deregister {
        /// The plugin id.
        plugin: String,
        /// The gone node.
        #[arg(long)]
        node: String,
    },
}

impl Cli {
    /// Runs the verb; returns the process exit code.
    pub fn run(self) -> anyhow::Result<i32> {
        match self.command {
            Command::Validate(cmd) => return cmd.run(),
            Command::WorkloadGuard(guard) => return guard.run(),
            Command::Completion { shell } => {
                out!("{}", complete::script(shell));
                return Ok(0);
            }
            Command::Complete { words } => return complete::names(words),
            _ => {}
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async move {
            if matches!(self.command, Command::Version) {
                // This build's line first: it answers without etcd.
                outln!("moorctl {LONG_VERSION}");
                let connecting =
                    self.auth
                        .connect_within(&self.endpoints, &self.prefix, self.request_timeout);
                return match connecting.await {
                    Ok(store) => controller_version(&store, &self.endpoints).await,
                    Err(e) => {
                        outln!(
                            "controller: cannot tell ({})",
                            explain::explain(&e, &self.endpoints)
                        );
                        Ok(0)
                    }
                };
            }
            let store = self
                .auth
                .connect_within(&self.endpoints, &self.prefix, self.request_timeout)
                .await?;
            let ctx = Ctx {
                store,
                endpoints: self.endpoints.clone(),
                retry_for: self.retry_for,
            };
            warn_on_skew(&ctx).await;
            match self.command {
                Command::Apply(cmd) => cmd.run(&ctx).await,
                Command::Get(cmd) => cmd.run(&ctx).await,
                Command::Describe(cmd) => cmd.run(&ctx).await,
                Command::Delete(cmd) => cmd.run(&ctx).await,
                Command::Alloc(AllocCmd::Stop {
                    name,
                    namespace,
                    force,
                }) => alloc::stop(&ctx, &namespace, &name, force).await,
                Command::Alloc(AllocCmd::Run(cmd)) => cmd.run(&ctx).await,
                Command::Alloc(AllocCmd::Plan(cmd)) => cmd.run(&ctx).await,
                Command::Alloc(AllocCmd::Paths {
                    name,
                    namespace,
                    export,
                }) => alloc::paths(&ctx, &namespace, &name, export).await,
                Command::Volume(VolumeCmd::Detach {
                    volume,
                    node,
                    namespace,
                }) => volume::detach(&ctx, &namespace, &volume, &node).await,
                Command::Volume(VolumeCmd::Status(cmd)) => cmd.run(&ctx).await,
                Command::Volume(VolumeCmd::Snapshot(cmd)) => cmd.run(&ctx).await,
                Command::Volume(VolumeCmd::Deregister {
                    volume,
                    force,
                    namespace,
                }) => volume::deregister(&ctx, &namespace, &volume, force).await,
                Command::Volume(VolumeCmd::Share {
                    volume,
                    with,
                    write,
                    namespace,
                }) => share::share(&ctx, &namespace, &volume, &with, write).await,
                Command::Volume(VolumeCmd::Unshare {
                    volume,
                    with,
                    namespace,
                }) => share::unshare(&ctx, &namespace, &volume, &with).await,
                Command::Volume(VolumeCmd::Own { volume, namespace }) => {
                    share::own(&ctx, &namespace, &volume).await
                }
                Command::Plugin(PluginCmd::Status(cmd)) => cmd.run(&ctx).await,
                Command::Node(cmd) => cmd.run(&ctx).await,
                Command::Volume(VolumeCmd::Pause { volume, namespace }) => {
                    let cmd = drain::VolumeAvailabilityCmd::Pause;
                    drain::volume(&ctx, cmd, &namespace, &volume, Default::default()).await
                }
                Command::Volume(VolumeCmd::Activate { volume, namespace }) => {
                    let cmd = drain::VolumeAvailabilityCmd::Activate;
                    drain::volume(&ctx, cmd, &namespace, &volume, Default::default()).await
                }
                Command::Volume(VolumeCmd::Drain {
                    volume,
                    timeout,
                    namespace,
                }) => {
                    let cmd = drain::VolumeAvailabilityCmd::Drain;
                    drain::volume(&ctx, cmd, &namespace, &volume, timeout).await
                }
                Command::Plugin(PluginCmd::Deregister { plugin, node }) => {
                    plugin::deregister(&ctx, &plugin, &node).await
                }
                Command::Mount(cmd) => cmd.run(&ctx).await,
                Command::Events(cmd) => cmd.run(&ctx).await,
                Command::Wait(cmd) => cmd.run(&ctx).await,
                Command::Validate(_)
                | Command::Completion { .. }
                | Command::Complete { .. }
                | Command::WorkloadGuard(_)
                | Command::Version => {
                    unreachable!()
                }
            }
        })
    }
}

/// What every verb gets.
pub struct Ctx {
    /// The store.
    pub store: Store,
    /// Where it is (for error messages).
    pub endpoints: Vec<String>,
    /// See [`Cli::retry_for`].
    pub retry_for: std::time::Duration,
}

/// An error that is the user's answer, not a failure of moorctl: printed, exit code 1.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

pub(crate) fn parse_name(what: &str, s: &str) -> anyhow::Result<Name> {
    Name::new(s).map_err(|e| anyhow::anyhow!("{what} {s:?}: {e}"))
}

pub(crate) fn parse_ns(s: &str) -> anyhow::Result<Namespace> {
    Namespace::new(s).map_err(|e| anyhow::anyhow!("namespace {s:?}: {e}"))
}

/// A step's write failed on a change made since its read: another writer's (a
/// reconciler's status write, most often) or an earlier write of the same step whose
/// answer was lost. [`ride_out`] reads again after a short pause; after
/// [`UNVERSIONED_WRITE_ATTEMPTS`](moor::store::UNVERSIONED_WRITE_ATTEMPTS) races in a
/// row, or past `--retry-for`, it is a refusal.
#[derive(Debug, thiserror::Error)]
#[error("it kept changing while writing (another writer won each time); try again")]
pub(crate) struct LookAgain;

/// Runs a writing step again while its outcome is unknown (etcd unavailable: a member
/// gone, a connection reset, a deadline), for `--retry-for` (a minute), on whichever member
/// answers. Every step reads before it writes, so a run after a lost answer learns
/// whether that write landed; `retrying` tells it one may have. A step that answers
/// [`LookAgain`] (its write lost a race with another writer, most often a reconciler's
/// status write) is run again after a short pause, at most
/// [`UNVERSIONED_WRITE_ATTEMPTS`](moor::store::UNVERSIONED_WRITE_ATTEMPTS) times in a
/// row.
pub(crate) async fn ride_out<T, F, Fut>(ctx: &Ctx, mut step: F) -> anyhow::Result<T>
where
    F: FnMut(bool) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let deadline = tokio::time::Instant::now() + ctx.retry_for;
    let mut backoff = moor::backoff::Backoff::new(
        std::time::Duration::from_millis(100),
        std::time::Duration::from_secs(2),
    );
    let mut retrying = false;
    let mut races = moor::store::ConflictRetry::default();
    let mut trouble = Trouble::default();
    loop {
        match step(retrying).await {
            Err(e) if is_transient(&e) && tokio::time::Instant::now() < deadline => {
                tracing::debug!(error = format!("{e:#}"), "outcome unknown; trying again");
                let next = format!(
                    "trying again for up to {} (--retry-for)",
                    humantime::format_duration(ctx.retry_for)
                );
                trouble.say(ctx, "", &e, &next);
                tokio::time::sleep(backoff.next_delay()).await;
                retrying = true;
            }
            Err(e)
                if e.is::<LookAgain>()
                    && tokio::time::Instant::now() < deadline
                    && races.again().await =>
            {
                retrying = true;
            }
            Err(e) if e.is::<LookAgain>() => return Err(Refused(e.to_string()).into()),
            other => return other,
        }
    }
}

/// What a verb that waits through etcd's trouble says about it on stderr: the cause in
/// one line ([`explain::explain`]) and what the verb does meanwhile, once per cause in
/// a row, so that a wait is never silent and never floods.
#[derive(Default)]
pub(crate) struct Trouble {
    said: String,
}

impl Trouble {
    /// Says `e` (after `what`, e.g. `watch: `) and `next`, unless it was the last said.
    pub(crate) fn say(&mut self, ctx: &Ctx, what: &str, e: &anyhow::Error, next: &str) {
        let why = explain::explain(e, &ctx.endpoints);
        if why != self.said {
            eprintln!("moorctl: {what}{}; {next}", out::terminal_safe(&why));
            self.said = why;
        }
    }
}

/// Whether the error is etcd being unavailable (retry later, on any member).
pub(crate) fn is_transient(e: &anyhow::Error) -> bool {
    e.downcast_ref::<StoreError>()
        .is_some_and(StoreError::is_transient)
}

pub(crate) fn is_not_found(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<StoreError>(),
        Some(StoreError::NotFound { .. })
    )
}

/// How long moorctl waits for the election record when it only warns about skew.
const SKEW_CHECK: std::time::Duration = std::time::Duration::from_secs(1);

/// The second line of `moorctl version`: the leading controller's version as its
/// election record says (older controllers say none).
async fn controller_version(store: &Store, endpoints: &[String]) -> anyhow::Result<i32> {
    match moor::runtime::leader::holder(store, "controller").await {
        Ok(Some(rec)) => {
            let v = if rec.version.is_empty() {
                "before 0.2 (unstated)".to_string()
            } else {
                rec.version.clone()
            };
            outln!(
                "controller {} ({})",
                moor::api::printable(&v),
                moor::api::printable(&rec.holder)
            );
            warn_if_skewed(&rec);
        }
        Ok(None) => outln!("controller: none is leading"),
        // Unreachable: why, in the words every verb uses; anything else (a malformed
        // record) cut short, as it may be large or hostile.
        Err(e) if e.is_transient() => outln!(
            "controller: cannot tell ({})",
            explain::explain(&e.into(), endpoints)
        ),
        Err(e) => outln!(
            "controller: cannot tell ({})",
            moor::store::bounded_chain(&e)
        ),
    }
    Ok(0)
}

/// Warns once, on stderr, when the leading controller runs another minor version;
/// says nothing when it cannot tell within [`SKEW_CHECK`] (the verb's own errors say
/// more).
async fn warn_on_skew(ctx: &Ctx) {
    let read = moor::runtime::leader::holder(&ctx.store, "controller");
    if let Ok(Ok(Some(rec))) = tokio::time::timeout(SKEW_CHECK, read).await {
        warn_if_skewed(&rec);
    }
}

/// The one warning line, on stderr, when `rec`'s controller is another minor version.
fn warn_if_skewed(rec: &moor::runtime::leader::LeaderRecord) {
    if let Some(w) = moor::version_skew(moor::VERSION, &rec.version) {
        eprintln!("moorctl: warning: {}", moor::api::printable(&w));
    }
}
