//! moord: moor's daemon.
//!
//! # Layout
//! - `controller`: `moord controller`: cluster-wide bookkeeping, leader-elected.
//! - `agent`: `moord agent`: one per node: plugin supervision, the node reconciler, and
//!   the provisioner, attacher, snapshotter and survey of the controller plugins it
//!   hosts.
//! - `console`: `moord console`: the read-only web console.
//! - `check`: `moord check`: a read-only audit of the store.
//! - `backup`: `moord backup check`: what an etcd snapshot holds, read from a temporary
//!   etcd restored from it.
//! - `roles`: `moord roles`: the etcd roles script, generated from the kinds.
//! - `keys`: `moord keys`: key files for secrets at rest.
//! - `dev`: `moord dev`: all of moor on one machine, on the embedded store.
//! - `common`: what the daemons share (connecting to etcd, events, flags).

/// moord's allocator. Its processes allocate and free on several threads at once (an
/// informer decodes on one worker what a reconciler drops on another): with glibc's
/// malloc, a profile of the controller syncing 100,000 claims spent about a sixth of
/// its time in the arenas' lock waits, and mimalloc took a fifth off its CPU
/// (docs/benchmarks.md). Built without transparent huge pages (`no_thp`): with them, a
/// node agent holding 1,000 claims resided in 46-60 MiB instead of 27.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod agent;
mod backup;
mod check;
mod common;
mod console;
mod controller;
mod dev;
mod keys;
#[cfg(test)]
mod rig;
mod roles;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "moord", version = moor::long_version!(), about = "moor's daemon")]
struct Cli {
    /// How log lines are written: text, or json (one object per line, with the
    /// object key of the reconcile it came from).
    #[arg(long, global = true, env = "MOOR_LOG_FORMAT", default_value = "text")]
    log_format: moor::process::LogFormat,
    /// Export traces over OTLP/gRPC to this collector (e.g. http://127.0.0.1:4317): one
    /// trace per claim, with a span per reconcile step and per CSI call.
    #[arg(long, global = true, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    otlp_endpoint: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Runs the controller (allocations → claims, admission, release, status).
    Controller(controller::Args),
    /// Runs the node agent for one node.
    Agent(Box<agent::Args>),
    /// Serves the read-only web console (volumes, attachments, mounts, what waits and why).
    Console(Box<console::Args>),
    /// Runs moor on one machine: embedded store, controller, agent and moor-hostpath.
    Dev(dev::Args),
    /// Lists every moor object in etcd by kind and reports malformed ones (read-only).
    Check(check::Check),
    /// Backups: `backup check FILE` says what an etcd snapshot holds.
    #[command(subcommand)]
    Backup(backup::Backup),
    /// Prints the etcd users-and-roles script (deploy/etcd/roles.sh) made from the kinds.
    Roles(roles::Roles),
    /// Prints key files for secrets at rest (a new cluster key; a node's derived keys).
    Keys(keys::Keys),
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    let service = match &cli.command {
        Command::Controller(_) => "moor-controller".to_string(),
        Command::Agent(args) => format!("moor-agent/{}", args.node),
        Command::Dev(_) => "moor-dev".to_string(),
        Command::Console(_) => "moor-console".to_string(),
        _ => "moord".to_string(),
    };
    let telemetry =
        match moor::telemetry::init(cli.log_format, cli.otlp_endpoint.as_deref(), &service) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("moord: {e:#}");
                std::process::exit(2);
            }
        };
    let shutdown = moor::process::on_signal();
    if matches!(
        cli.command,
        Command::Controller(_) | Command::Agent(_) | Command::Dev(_) | Command::Console(_)
    ) {
        tracing::info!(version = moor::long_version!(), "{service} starting");
    }
    let result = match cli.command {
        Command::Controller(args) => controller::run(args, shutdown).await.map(|()| 0),
        Command::Agent(args) => agent::run(*args, shutdown).await.map(|()| 0),
        Command::Check(cmd) => cmd.run().await,
        Command::Backup(cmd) => cmd.run().await,
        Command::Roles(cmd) => cmd.run(),
        Command::Keys(cmd) => cmd.run(),
        Command::Dev(args) => dev::run(args, shutdown).await.map(|()| 0),
        Command::Console(args) => console::run(*args, shutdown).await.map(|()| 0),
    };
    // What the daemons said and did not write yet (SIGTERM): written before exiting.
    moor::runtime::events::flush(common::EVENT_GRACE).await;
    telemetry.shutdown();
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("moord: {e:#}");
            std::process::exit(2);
        }
    }
}
