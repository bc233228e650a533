//! moor-hostpath: serve the reference CSI plugin until SIGINT/SIGTERM, or
//! `moor-hostpath check CALLS.jsonl...`: run the invariant checker over call logs.

use clap::Parser;
use moor_hostpath::calllog::CallLog;
use moor_hostpath::checker::{self, CheckConfig};
use std::collections::BTreeMap;

/// `moor-hostpath check`: merges call logs by time and reports each broken invariant
/// (exit code 1 if any, 2 if a log cannot be read).
#[derive(Debug, Parser)]
#[command(name = "moor-hostpath check")]
struct Check {
    /// The plugin does not advertise PUBLISH_UNPUBLISH_VOLUME.
    #[arg(long)]
    no_controller_publish: bool,
    /// The plugin does not advertise STAGE_UNSTAGE_VOLUME.
    #[arg(long)]
    no_stage: bool,
    /// Every claim was released by the end: anything still attached, staged or
    /// published is a leak.
    #[arg(long)]
    expect_released: bool,
    /// Every volume was deleted by the end: a volume CreateVolume handed out and never
    /// deleted is a leak.
    #[arg(long)]
    expect_deleted: bool,
    /// A CSI node id declared gone (force-detached, or collected after
    /// `--node-gc-timeout`) at a time (`NODE=2026-11-23T07:45:00.000Z`; repeat for each
    /// declaration): what it held before no longer holds its volumes from then on; what
    /// it does after is checked in full. Without a time, nothing it holds ever counts.
    #[arg(long = "gone", value_name = "NODE[=TIME]")]
    gone: Vec<String>,
    /// Call logs (`calls.jsonl` of each plugin instance).
    #[arg(required = true)]
    logs: Vec<std::path::PathBuf>,
}

fn check(args: Check) -> i32 {
    let mut logs = Vec::new();
    for path in &args.logs {
        match CallLog::read(path) {
            Ok(calls) => logs.push(calls),
            Err(e) => {
                eprintln!("moor-hostpath check: {}: {e}", path.display());
                return 2;
            }
        }
    }
    let merged = checker::merge(logs);
    let cfg = CheckConfig {
        controller_publish_required: !args.no_controller_publish,
        stage_required: !args.no_stage,
        expect_released: args.expect_released,
        expect_deleted: args.expect_deleted,
        forced_nodes: args.gone.iter().fold(BTreeMap::new(), |mut all, g| {
            let (node, at) = g.split_once('=').unwrap_or((g, ""));
            all.entry(node.to_string())
                .or_insert_with(Vec::new)
                .push(at.to_string());
            all
        }),
        ..Default::default()
    };
    let violations = checker::check(&merged, &cfg);
    for v in &violations {
        println!("{v}");
    }
    eprintln!(
        "{} calls checked, {} violations",
        merged.len(),
        violations.len()
    );
    i32::from(!violations.is_empty())
}

#[tokio::main]
async fn main() {
    if std::env::args().nth(1).as_deref() == Some("check") {
        let args = Check::parse_from(std::env::args().skip(1));
        std::process::exit(check(args));
    }
    let cfg = moor_hostpath::Config::parse();
    moor_csi::process::init_logging(cfg.log_format);
    let shutdown = moor_csi::process::on_signal();
    if let Err(e) = moor_hostpath::run(cfg, shutdown).await {
        eprintln!("moor-hostpath: {e:#}");
        std::process::exit(2);
    }
}
