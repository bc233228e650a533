//! `moord controller`: cluster-wide bookkeeping. Leader-elected; makes no CSI calls.
//!
//! Expected flow:
//! 1. Campaign for `controller`; replicas that lose wait on the election key.
//! 2. The leader starts one informer per kind and the reconcilers, all writing through
//!    one [`moor::runtime::writer::Writer`] over the leader's fenced store, and deciding
//!    through the pure functions of [`plan`]: [`allocations`] (allocation → claims,
//!    allocation status), [`claims`] (admission, attach requests, publish permission,
//!    release), [`reports`] (what the plugins' leaders report of attachments and
//!    volumes, copied into them), [`volumes`] (the claims finalizer, schedulable), [`plugins`]
//!    (aggregation), [`reseal`] (secrets stored in plain text or under an old key,
//!    rewritten sealed), [`nodes`] (a Node its agent stopped renewing is removed), and
//!    [`gauges`] (the cluster's claims and plugins as metrics, for alerts).
//! 3. Losing leadership drops all of it at once; the next leader resumes from the
//!    checkpoints in etcd.
//!
//! # Layout
//! - [`allocations`]: allocation → claims (and template volumes), the allocation's
//!   phase.
//! - [`claims`]: admission, attach requests, the node's permission, release.
//! - [`reports`]: what the agents leading plugins report of their attachments and
//!   volumes, copied into them (a finalizer added or removed, a detached attachment
//!   deleted).
//! - [`volumes`]: the claims finalizer, ephemeral volumes, `schedulable`, health on
//!   nodes.
//! - [`plugins`]: one Plugin per plugin id, aggregated from the Nodes.
//! - [`nodes`]: a Node its agent stopped renewing is removed.
//! - [`schedules`]: snapshot schedules' cuts, missed slots and retention.
//! - [`quotas`]: what each namespace's quotas charge; admission lets in only that.
//! - [`reseal`]: secrets in plain text or under an old key, rewritten sealed.
//! - [`gauges`]: the cluster's claims and plugins as metrics.
//! - [`plan`]: the reconcilers' decisions as pure functions.
//! - [`context`]: what the reconcilers share: the fenced store, the caches, the writer.
//! - [`volume_view`]: what the volume cache keeps of a volume (whole only while its
//!   next step needs it).

pub mod allocations;
pub mod claims;
pub mod context;
pub mod gauges;
pub mod nodes;
pub mod plan;
pub mod plugins;
pub mod quotas;
pub mod reports;
pub mod reseal;
pub mod schedules;
pub mod volume_view;
pub mod volumes;

use moor::api::*;
use moor::runtime::informer::Informer;
use moor::runtime::leader::{self, LeaderConfig};
use moor::runtime::metrics::Metrics;
use moor::store::Store;
use prometheus_client::registry::Registry;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

use crate::common::{EtcdArgs, KeyedLocks};
use context::{Ctx, Informers};
use moor::runtime::writer::Writer;

/// Flags of `moord controller`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub etcd: EtcdArgs,
    #[command(flatten)]
    pub events: crate::common::EventArgs,
    /// This replica's name in the election (default: host name and pid).
    #[arg(long)]
    pub identity: Option<String>,
    /// TTL of the leader lease: how long a dead leader blocks the next one.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub leader_ttl: Duration,
    /// Release claims on a node whose Node object (its lease) has been gone this long
    /// without waiting for its agent, with a Warning event. Off by default.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub node_gc_timeout: Option<Duration>,
    /// How long an ended allocation stays after its claims were released (`get` shows
    /// it, with its claims and Mounts), before it is collected with them. Nomad's job
    /// GC and Kubernetes' TTL-after-finished are the models: ended work that is kept
    /// forever fills etcd and every cache.
    #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
    pub retention: Duration,
    /// Reconciles at once, per reconciler.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
}

/// Runs the controller until `shutdown`.
pub async fn run(args: Args, shutdown: CancellationToken) -> anyhow::Result<()> {
    let store = args.etcd.connect(Duration::from_secs(30)).await?;
    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    let registry = Arc::new(registry);
    if let Some(addr) = args.etcd.http {
        let (registry, shutdown) = (registry.clone(), shutdown.clone());
        tokio::spawn(async move {
            if let Err(e) = crate::common::serve_http(addr, registry, shutdown).await {
                tracing::error!(error = format!("{e:#}"), "http server failed");
            }
        });
    }
    let identity = args.identity.clone().unwrap_or_else(|| {
        let host = std::fs::read_to_string("/etc/hostname").unwrap_or_default();
        format!("controller@{}/{}", host.trim(), std::process::id())
    });
    let election = LeaderConfig {
        name: "controller".into(),
        identity,
        ttl: args.leader_ttl,
    };
    tokio::spawn(watch_alarms(store.clone(), shutdown.clone()));
    let reads = store.clone();
    // The controller acts only by writing etcd, and every write carries the fence: a
    // deposed leader's write fails whatever its clock says, so it needs no term check.
    leader::lead(store, election, shutdown, |fenced, stop, _term| {
        let (reads, metrics, args) = (reads.clone(), metrics.clone(), args.clone());
        async move {
            tracing::info!("leading: starting reconcilers");
            lead(reads, fenced, metrics, args, stop).await;
        }
    })
    .await;
    Ok(())
}

/// How often etcd's alarms are polled.
const ALARM_POLL: Duration = Duration::from_secs(5);

/// Polls etcd's alarms until `shutdown`: the `moor_etcd_alarms` gauge, and an error in
/// the log while one is raised (a NOSPACE alarm fails every write in the cluster).
async fn watch_alarms(store: Store, shutdown: CancellationToken) {
    let mut raised: Vec<(u64, String)> = Vec::new();
    loop {
        match store.alarms().await {
            Ok(now) => {
                for alarm in ["NOSPACE", "CORRUPT"] {
                    let members = now.iter().filter(|(_, a)| a == alarm).count();
                    moor::runtime::metrics::etcd_alarm(alarm, members as i64);
                }
                if now != raised {
                    for (member, alarm) in now.iter().filter(|a| !raised.contains(a)) {
                        tracing::error!(
                            member = format!("{member:x}"),
                            alarm,
                            "etcd raised an alarm: {}",
                            if alarm == "NOSPACE" {
                                moor::store::NOSPACE_HELP
                            } else {
                                "see etcd's documentation"
                            }
                        );
                    }
                    if now.is_empty() {
                        tracing::info!("etcd's alarms are cleared");
                    }
                    raised = now;
                }
            }
            Err(e) => tracing::debug!(error = %e, "could not read etcd's alarms"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(ALARM_POLL) => {}
        }
    }
}

/// Runs the reconcilers while leading.
async fn lead(reads: Store, fenced: Store, metrics: Metrics, args: Args, stop: CancellationToken) {
    // A cluster whose controller holds the key file says so in etcd, so that a moorctl
    // without it refuses to write secrets in clear (they would stay in etcd's history).
    if let Err(e) = reads.declare_sealing().await {
        tracing::warn!(error = %e, "could not declare that this cluster seals secrets at rest");
    }
    let informers = Informers::spawn(&reads, &stop);
    let schedules =
        Informer::<SnapshotSchedule>::spawn(reads.clone(), KeyScope::all(), stop.clone());
    let snapshots = Informer::<Snapshot>::spawn(reads.clone(), KeyScope::all(), stop.clone());
    let attachment_reports =
        Informer::<AttachmentReport>::spawn(reads.clone(), KeyScope::all(), stop.clone());
    let volume_reports =
        Informer::<VolumeReport>::spawn(reads.clone(), KeyScope::all(), stop.clone());
    let snapshot_reports =
        Informer::<SnapshotReport>::spawn(reads.clone(), KeyScope::all(), stop.clone());
    let group_reports =
        Informer::<VolumeGroupSnapshotReport>::spawn(reads.clone(), KeyScope::all(), stop.clone());
    let ctx = shared(reads, fenced, &informers, &args);
    let config = moor::runtime::controller::Config {
        concurrency: args.concurrency,
        ..Default::default()
    };
    follow_absences(&ctx, &informers.nodes, &stop);
    say_when_listed(&ctx);
    let Informers {
        claims,
        volumes,
        plugins,
        secrets,
        ..
    } = informers.clone();
    tokio::join!(
        gauges::run(claims.reader(), plugins.reader(), stop.clone()),
        nodes::run(ctx.clone(), stop.clone()),
        reseal::run_as(
            ctx.writer.clone(),
            volumes.clone(),
            |v| v.rare.as_ref().map(|r| &r.spec),
            volume_view::VolumeView::object_key,
            stop.clone()
        ),
        reseal::run(ctx.writer.clone(), claims.clone(), stop.clone()),
        reseal::run(ctx.writer.clone(), secrets, stop.clone()),
        quotas::run(
            ctx.clone(),
            &informers,
            &snapshots,
            config.clone(),
            metrics.controller("quotas"),
            stop.clone()
        ),
        schedules::run(
            ctx.writer.clone(),
            ctx.recorder.clone(),
            schedules,
            snapshots.clone(),
            volumes.reader(),
            stop.clone()
        ),
        claims::run(
            ctx.clone(),
            &informers,
            config.clone(),
            metrics.controller("claims"),
            stop.clone()
        ),
        allocations::run(
            ctx.clone(),
            &informers,
            config.clone(),
            metrics.controller("allocations"),
            stop.clone()
        ),
        Box::pin(reports::run(
            ctx.clone(),
            attachment_reports,
            config.clone(),
            metrics.controller("attachment-reports"),
            stop.clone()
        )),
        Box::pin(reports::run(
            ctx.clone(),
            volume_reports,
            config.clone(),
            metrics.controller("volume-reports"),
            stop.clone()
        )),
        Box::pin(reports::run(
            ctx.clone(),
            snapshot_reports,
            config.clone(),
            metrics.controller("snapshot-reports"),
            stop.clone()
        )),
        Box::pin(reports::run(
            ctx.clone(),
            group_reports,
            config.clone(),
            metrics.controller("groupsnapshot-reports"),
            stop.clone()
        )),
        volumes::run(
            ctx.clone(),
            &informers,
            config.clone(),
            metrics.controller("volumes"),
            stop.clone()
        ),
        plugins::run(
            ctx.clone(),
            &informers,
            config,
            metrics.controller("plugins"),
            stop.clone()
        ),
    );
}

/// What the reconcilers share, over the informers' caches: writes through the fenced
/// store, tracking what this process writes.
fn shared(reads: Store, fenced: Store, informers: &Informers, args: &Args) -> Ctx {
    Ctx {
        writer: Writer::new(fenced)
            .tracking(&informers.claims.reader())
            .tracking(&informers.attachments.reader())
            .tracking_as::<VolumeSpec, _>(&informers.volumes.reader())
            .tracking(&informers.allocations.reader()),
        allocations: informers.allocations.reader(),
        claims: informers.claims.reader(),
        volumes: informers.volumes.reader(),
        attachments: informers.attachments.reader(),
        mounts: informers.mounts.reader(),
        nodes: informers.nodes.reader(),
        plugins: informers.plugins.reader(),
        leases: informers.leases.reader(),
        cordons: informers.cordons.reader(),
        classes: informers.classes.reader(),
        secrets: informers.secrets.reader(),
        owners: informers.owners.reader(),
        quotas: informers.quotas.reader(),
        lease_observer: Arc::default(),
        recorder: args.events.recorder(reads, "controller"),
        volume_locks: KeyedLocks::default(),
        node_absence: Arc::default(),
        node_gc_timeout: args.node_gc_timeout,
        retention: args.retention,
    }
}

/// Keeps each node's absence current from the Node watch: a node back from an absence
/// does not carry it into its next one.
fn follow_absences(ctx: &Ctx, nodes: &Informer<Node>, stop: &CancellationToken) {
    let (absence, events, stop) = (
        ctx.node_absence.clone(),
        nodes::without_renewals(nodes.subscribe()),
        stop.clone(),
    );
    tokio::spawn(async move {
        use futures::StreamExt;
        let events = events.take_until(stop.cancelled_owned());
        futures::pin_mut!(events);
        while let Some(event) = events.next().await {
            absence.observe(&event, Instant::now());
        }
    });
}

/// Logs how long the caches took to list, once they have.
fn say_when_listed(ctx: &Ctx) {
    let (ctx, started) = (ctx.clone(), Instant::now());
    tokio::spawn(async move {
        ctx.ready().await;
        tracing::info!(
            elapsed_ms = started.elapsed().as_millis() as u64,
            claims = ctx.claims.len(),
            volumes = ctx.volumes.len(),
            allocations = ctx.allocations.len(),
            "caches listed"
        );
    });
}
