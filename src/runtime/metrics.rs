//! Per-controller metrics in a Prometheus registry the daemons serve on /metrics.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::LazyLock;
use std::time::Duration;

/// The label every controller metric carries.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabel {
    /// The controller's name.
    pub controller: String,
}

/// The label of per-kind metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// The kind's name, e.g. `Volume`.
    pub kind: String,
}

/// Stored values skipped because they do not decode as their kind, counted by every
/// informer of the process each time one is listed or watched. One family per process,
/// registered in each registry.
static MALFORMED: LazyLock<Family<KindLabel, Counter>> = LazyLock::new(Family::default);

/// Counts a malformed value of `kind` skipped.
pub fn malformed_skipped(kind: &str) {
    MALFORMED
        .get_or_create(&KindLabel {
            kind: kind.to_string(),
        })
        .inc();
}

/// Whether each kind's cache holds its first list (1) or not yet (0); a process that
/// caches a kind several times (filtered caches) reports the last one listed.
static CACHE_LISTED: LazyLock<Family<KindLabel, Gauge>> = LazyLock::new(Family::default);

/// Sets whether this process's cache of `kind` holds its first list.
pub fn cache_listed(kind: &str, listed: bool) {
    CACHE_LISTED
        .get_or_create(&KindLabel {
            kind: kind.to_string(),
        })
        .set(i64::from(listed));
}

/// The labels of a plugin's contract violations.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ContractLabel {
    /// The plugin.
    pub plugin: String,
    /// The rule broken (`moor::csi::contract::Rule`'s name).
    pub rule: String,
}

/// Contract violations found by the live monitor, once per plugin, rule and object.
static CONTRACT: LazyLock<Family<ContractLabel, Counter>> = LazyLock::new(Family::default);

/// Shows `plugin`'s count against `rule` (0 until a violation): a series that appears
/// already at 1 would be no increase to an alert over `increase()`.
pub fn contract_series(plugin: &str, rule: &str) {
    let _shown = CONTRACT.get_or_create(&ContractLabel {
        plugin: plugin.to_string(),
        rule: rule.to_string(),
    });
}

/// Counts a contract violation of `plugin` against `rule`.
pub fn contract_violation(plugin: &str, rule: &str) {
    CONTRACT
        .get_or_create(&ContractLabel {
            plugin: plugin.to_string(),
            rule: rule.to_string(),
        })
        .inc();
}

/// Writes of an agent's journal (its record of what it staged and published) that
/// failed: the step the write was to record was not taken.
static JOURNAL_FAILURES: LazyLock<Counter> = LazyLock::new(Counter::default);

/// Counts a failed journal write.
pub fn journal_failed() {
    JOURNAL_FAILURES.inc();
}

/// Commits appended to the agent's journal, and the fdatasyncs that put them on disk
/// (group-committed: one covers every commit appended before it began).
static JOURNAL_COMMITS: LazyLock<Counter> = LazyLock::new(Counter::default);
static JOURNAL_SYNCS: LazyLock<Counter> = LazyLock::new(Counter::default);

/// Counts a commit appended to the agent's journal.
pub fn journal_committed() {
    JOURNAL_COMMITS.inc();
}

/// Counts an fdatasync of the agent's journal.
pub fn journal_synced() {
    JOURNAL_SYNCS.inc();
}

/// Mounts the agent keeps although desired state lost their claims (an older etcd
/// snapshot restored): each waits for an operator's `moorctl mount adopt` or
/// `moorctl mount release`.
static ORPHANED_MOUNTS: LazyLock<Gauge> = LazyLock::new(Gauge::default);

/// Sets how many orphaned mounts this agent keeps.
pub fn orphaned_mounts(n: usize) {
    ORPHANED_MOUNTS.set(i64::try_from(n).unwrap_or(i64::MAX));
}

/// Events recorded but not written (queue full, or the store refused them); the
/// process's log has each.
static EVENTS_DROPPED: LazyLock<Counter> = LazyLock::new(Counter::default);

/// Counts `n` events not written.
pub fn events_dropped(n: usize) {
    EVENTS_DROPPED.inc_by(n as u64);
}

/// The labels of a per-volume gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VolumeLabel {
    /// The volume's namespace.
    pub namespace: String,
    /// The moor volume.
    pub volume: String,
    /// What is measured: `bytes_used`, `bytes_available`, `bytes_total`,
    /// `inodes_used`, `inodes_available`, `inodes_total`; `abnormal` (1 or 0).
    pub resource: String,
}

/// Per-volume usage and health on this node (NodeGetVolumeStats).
static VOLUMES: LazyLock<Family<VolumeLabel, Gauge>> = LazyLock::new(Family::default);

/// Records a volume's usage and health; a field not reported is removed.
pub fn volume_stats(
    namespace: &str,
    volume: &str,
    usage: &crate::api::VolumeUsage,
    abnormal: Option<bool>,
) {
    let fields = [
        ("bytes_used", usage.bytes_used),
        ("bytes_available", usage.bytes_available),
        ("bytes_total", usage.bytes_total),
        ("inodes_used", usage.inodes_used),
        ("inodes_available", usage.inodes_available),
        ("inodes_total", usage.inodes_total),
        ("abnormal", abnormal.map(u64::from)),
    ];
    for (resource, value) in fields {
        let label = VolumeLabel {
            namespace: namespace.to_string(),
            volume: volume.to_string(),
            resource: resource.to_string(),
        };
        match value {
            Some(v) => {
                VOLUMES
                    .get_or_create(&label)
                    .set(i64::try_from(v).unwrap_or(i64::MAX));
            }
            None => {
                VOLUMES.remove(&label);
            }
        }
    }
}

/// The labels of the storage-health gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StorageHealthLabel {
    /// The plugin.
    pub plugin: String,
    /// `StorageDegraded` or `StorageUnreachable`.
    pub status: String,
}

/// The storage's adverse conditions as this node's plugin reports them
/// (NodeGetStorageHealth), by status.
static STORAGE_HEALTH: LazyLock<Family<StorageHealthLabel, Gauge>> = LazyLock::new(Family::default);

/// Records the storage's health of `plugin` on this node: for each status the number of
/// conditions (0 when healthy); `None` (not reported) removes the series.
pub fn storage_health(plugin: &str, conditions: Option<&[crate::api::HealthCondition]>) {
    for status in ["StorageDegraded", "StorageUnreachable"] {
        let label = StorageHealthLabel {
            plugin: plugin.to_string(),
            status: status.to_string(),
        };
        match conditions {
            Some(all) => {
                let n = all.iter().filter(|c| c.status == status).count();
                STORAGE_HEALTH
                    .get_or_create(&label)
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            }
            None => {
                STORAGE_HEALTH.remove(&label);
            }
        }
    }
}

/// The labels of a snapshot schedule's metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ScheduleLabel {
    /// The schedule's namespace.
    pub namespace: String,
    /// The schedule's name.
    pub schedule: String,
}

/// When each snapshot schedule last found slots passed without a cut (its
/// `status.last_missed`), as the leading controller exports it.
static SCHEDULE_LAST_MISSED: LazyLock<Family<ScheduleLabel, Gauge>> =
    LazyLock::new(Family::default);

/// Exports when schedule `namespace/schedule` last missed a slot (Unix seconds);
/// `None` removes its series (never missed, or gone).
pub fn schedule_last_missed(namespace: &str, schedule: &str, at: Option<i64>) {
    let label = ScheduleLabel {
        namespace: namespace.to_string(),
        schedule: schedule.to_string(),
    };
    match at {
        Some(secs) => {
            SCHEDULE_LAST_MISSED.get_or_create(&label).set(secs);
        }
        None => {
            SCHEDULE_LAST_MISSED.remove(&label);
        }
    }
}

/// The label of etcd's alarms.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AlarmLabel {
    /// `NOSPACE` or `CORRUPT`.
    pub alarm: String,
}

/// Members of etcd with each alarm raised, as the controller last saw them.
static ETCD_ALARMS: LazyLock<Family<AlarmLabel, Gauge>> = LazyLock::new(Family::default);

/// Records how many members have `alarm` raised.
pub fn etcd_alarm(alarm: &str, members: i64) {
    ETCD_ALARMS
        .get_or_create(&AlarmLabel {
            alarm: alarm.to_string(),
        })
        .set(members);
}

/// The label of an election's metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ElectionLabel {
    /// `controller`, or `plugin.ID`.
    pub election: String,
}

/// 1 while this process leads the election.
static LEADER: LazyLock<Family<ElectionLabel, Gauge>> = LazyLock::new(Family::default);
/// Terms this process won.
static TERMS: LazyLock<Family<ElectionLabel, Counter>> = LazyLock::new(Family::default);

/// Records that this process won (`true`) or left (`false`) a term of `election`.
pub fn leading(election: &str, now: bool) {
    let label = ElectionLabel {
        election: election.to_string(),
    };
    LEADER.get_or_create(&label).set(i64::from(now));
    if now {
        TERMS.get_or_create(&label).inc();
    }
}

/// The label of per-phase claim gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabel {
    /// The claim phase, e.g. `Admitted`.
    pub phase: String,
}

/// Claims by phase, as the leading controller sees them.
static CLAIMS: LazyLock<Family<PhaseLabel, Gauge>> = LazyLock::new(Family::default);
/// Per phase, how long the claim longest in it has been there.
static CLAIMS_OLDEST: LazyLock<Family<PhaseLabel, Gauge>> = LazyLock::new(Family::default);

/// Sets the claim gauges: per phase, how many and the longest time one has been in it
/// (seconds). Phases left out read 0.
pub fn claims_by_phase(phases: &[(&str, i64, i64)]) {
    CLAIMS.clear();
    CLAIMS_OLDEST.clear();
    for (phase, count, oldest) in phases {
        let label = PhaseLabel {
            phase: phase.to_string(),
        };
        CLAIMS.get_or_create(&label).set(*count);
        CLAIMS_OLDEST.get_or_create(&label).set(*oldest);
    }
}

/// The labels of a plugin's instance gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PluginLabel {
    /// The plugin id.
    pub plugin: String,
    /// `controller` or `node`.
    pub r#type: String,
}

static PLUGIN_HEALTHY: LazyLock<Family<PluginLabel, Gauge>> = LazyLock::new(Family::default);
static PLUGIN_EXPECTED: LazyLock<Family<PluginLabel, Gauge>> = LazyLock::new(Family::default);

/// Sets the plugin gauges from `(plugin, type, healthy, expected)`; plugins left out
/// are forgotten.
pub fn plugins(instances: &[(&str, &str, i64, i64)]) {
    PLUGIN_HEALTHY.clear();
    PLUGIN_EXPECTED.clear();
    for (plugin, kind, healthy, expected) in instances {
        let label = PluginLabel {
            plugin: plugin.to_string(),
            r#type: kind.to_string(),
        };
        PLUGIN_HEALTHY.get_or_create(&label).set(*healthy);
        PLUGIN_EXPECTED.get_or_create(&label).set(*expected);
    }
}

/// The label of per-plugin metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PluginIdLabel {
    /// The plugin id.
    pub plugin: String,
}

static WAITING_FOR_NODE: LazyLock<Family<PluginIdLabel, Gauge>> = LazyLock::new(Family::default);

/// Counts one ControllerPublish/Unpublish of `plugin` waiting for its node's turn
/// (`serialize-per-node`) until the returned guard drops.
pub fn waiting_for_node(plugin: &str) -> WaitingForNode {
    let gauge = WAITING_FOR_NODE
        .get_or_create(&PluginIdLabel {
            plugin: plugin.to_string(),
        })
        .clone();
    gauge.inc();
    WaitingForNode(gauge)
}

/// One call counted as waiting for its node's turn; uncounted when dropped.
pub struct WaitingForNode(Gauge);

impl Drop for WaitingForNode {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Forgets a volume no longer published on this node.
pub fn forget_volume(namespace: &str, volume: &str) {
    volume_stats(namespace, volume, &Default::default(), None);
}

/// Malformed values of `kind` skipped so far in this process.
pub fn malformed_count(kind: &str) -> u64 {
    MALFORMED
        .get_or_create(&KindLabel {
            kind: kind.to_string(),
        })
        .get()
}

fn duration_histogram() -> Histogram {
    // 1 ms to ~33 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

/// The controller metric families, registered once per registry.
#[derive(Clone)]
pub struct Metrics {
    reconciles: Family<ControllerLabel, Counter>,
    failures: Family<ControllerLabel, Counter>,
    queue_depth: Family<ControllerLabel, Gauge>,
    queue_repairs: Family<ControllerLabel, Gauge>,
    queue_wait: Family<ControllerLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    duration: Family<ControllerLabel, Histogram, fn() -> Histogram>,
}

impl Metrics {
    /// Registers the families in `registry`.
    pub fn register(registry: &mut Registry) -> Metrics {
        let m = Metrics {
            reconciles: Family::default(),
            failures: Family::default(),
            queue_depth: Family::default(),
            queue_repairs: Family::default(),
            queue_wait: Family::default(),
            duration: Family::new_with_constructor(duration_histogram),
        };
        registry.register("moor_reconciles", "Reconciles run", m.reconciles.clone());
        registry.register(
            "moor_reconcile_failures",
            "Reconciles that returned an error",
            m.failures.clone(),
        );
        registry.register(
            "moor_queue_depth",
            "Keys waiting in a controller's queue",
            m.queue_depth.clone(),
        );
        registry.register(
            "moor_queue_repairs",
            "Of the keys waiting, those of a repair pass (a relist's converged objects, a resync), which run behind every change",
            m.queue_repairs.clone(),
        );
        registry.register(
            "moor_queue_change_wait_seconds",
            "How long the longest-due change (a key that is not a repair) has waited for a worker; 0 when none is due",
            m.queue_wait.clone(),
        );
        registry.register(
            "moor_cache_listed",
            "1 once this process's cache of a kind holds its first list",
            CACHE_LISTED.clone(),
        );
        registry.register(
            "moor_reconcile_duration_seconds",
            "Time spent in reconcile",
            m.duration.clone(),
        );
        registry.register(
            "moor_malformed_values_skipped",
            "Stored values skipped because they do not decode as their kind",
            MALFORMED.clone(),
        );
        registry.register(
            "moor_etcd_alarms",
            "etcd members with an alarm raised (NOSPACE: every write fails), as last polled",
            ETCD_ALARMS.clone(),
        );
        registry.register(
            "moor_plugin_contract_violations",
            "Answers of a plugin that broke a MUST of the CSI spec, once per plugin, rule and object (the live contract monitor)",
            CONTRACT.clone(),
        );
        registry.register(
            "moor_agent_journal_write_failures",
            "Writes of the agent's journal (its data dir's record of what it staged and published) that failed, such as on a full disk; the step each was to record was not taken",
            JOURNAL_FAILURES.clone(),
        );
        registry.register(
            "moor_agent_journal_commits",
            "Commits appended to the agent's journal (each records node steps: a step's record before its call, its outcome after)",
            JOURNAL_COMMITS.clone(),
        );
        registry.register(
            "moor_agent_journal_syncs",
            "fdatasyncs of the agent's journal; each puts on disk every commit appended before it began (a group commit)",
            JOURNAL_SYNCS.clone(),
        );
        registry.register(
            "moor_agent_orphaned_mounts",
            "Mounts this agent keeps although desired state lost their claims (an older etcd snapshot restored); each waits for moorctl mount adopt or release",
            ORPHANED_MOUNTS.clone(),
        );
        registry.register(
            "moor_events_dropped",
            "Events recorded but not written to the store (queue full or write refused)",
            EVENTS_DROPPED.clone(),
        );
        registry.register(
            "moor_leader",
            "1 while this process leads the election",
            LEADER.clone(),
        );
        registry.register(
            "moor_leader_terms",
            "Terms of the election this process won",
            TERMS.clone(),
        );
        registry.register(
            "moor_claims",
            "Claims by phase (the leading controller's view)",
            CLAIMS.clone(),
        );
        registry.register(
            "moor_claims_oldest_in_phase_seconds",
            "Per phase, how long the claim longest in it has been there (the leading controller's view)",
            CLAIMS_OLDEST.clone(),
        );
        registry.register(
            "moor_plugin_instances_healthy",
            "Healthy instances of a plugin, by type (the leading controller's view)",
            PLUGIN_HEALTHY.clone(),
        );
        registry.register(
            "moor_plugin_instances_expected",
            "Instances a plugin is expected to have, by type (the leading controller's view)",
            PLUGIN_EXPECTED.clone(),
        );
        registry.register(
            "moor_controller_calls_waiting_for_node",
            "ControllerPublish/ControllerUnpublish calls of a plugin set to serialize-per-node that wait for another call to the same node to end",
            WAITING_FOR_NODE.clone(),
        );
        registry.register(
            "moor_volume",
            "Usage and health of the volumes published on this node, by resource",
            VOLUMES.clone(),
        );
        registry.register(
            "moor_storage_unhealthy",
            "Adverse conditions of a plugin's storage as this node sees it (NodeGetStorageHealth), by status",
            STORAGE_HEALTH.clone(),
        );
        registry.register(
            "moor_snapshot_schedule_last_missed_timestamp_seconds",
            "When a snapshot schedule last found slots passed without a cut (the controller down or not leading; one catch-up snapshot was cut), from its status",
            SCHEDULE_LAST_MISSED.clone(),
        );
        m
    }

    /// The handles for one controller.
    pub fn controller(&self, name: &str) -> ControllerMetrics {
        let label = ControllerLabel {
            controller: name.to_string(),
        };
        ControllerMetrics {
            reconciles: self.reconciles.get_or_create(&label).clone(),
            failures: self.failures.get_or_create(&label).clone(),
            queue_depth: self.queue_depth.get_or_create(&label).clone(),
            queue_repairs: self.queue_repairs.get_or_create(&label).clone(),
            queue_wait: self.queue_wait.get_or_create(&label).clone(),
            duration: self.duration.get_or_create(&label).clone(),
        }
    }
}

/// One controller's metric handles.
#[derive(Clone)]
pub struct ControllerMetrics {
    reconciles: Counter,
    failures: Counter,
    queue_depth: Gauge,
    queue_repairs: Gauge,
    queue_wait: Gauge<f64, std::sync::atomic::AtomicU64>,
    duration: Histogram,
}

impl ControllerMetrics {
    /// Handles not registered anywhere, for controllers run without a registry.
    pub fn unregistered() -> ControllerMetrics {
        ControllerMetrics {
            reconciles: Counter::default(),
            failures: Counter::default(),
            queue_depth: Gauge::default(),
            queue_repairs: Gauge::default(),
            queue_wait: Gauge::default(),
            duration: duration_histogram(),
        }
    }

    pub(crate) fn record(&self, took: Duration, failed: bool) {
        self.reconciles.inc();
        if failed {
            self.failures.inc();
        }
        self.duration.observe(took.as_secs_f64());
    }

    /// Keys waiting, how many of them are a repair pass's, and how long the
    /// longest-due change has waited.
    pub(crate) fn set_queue(&self, depth: usize, repairs: usize, change_waited: Duration) {
        self.queue_depth.set(depth as i64);
        self.queue_repairs.set(repairs as i64);
        self.queue_wait.set(change_waited.as_secs_f64());
    }

    /// Reconciles run so far.
    pub fn reconciles(&self) -> u64 {
        self.reconciles.get()
    }

    /// Failed reconciles so far.
    pub fn failures(&self) -> u64 {
        self.failures.get()
    }
}

/// The registry in Prometheus text format.
pub fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_are_labelled_by_controller() {
        let mut registry = Registry::default();
        let m = Metrics::register(&mut registry);
        let c = m.controller("claims");
        c.record(Duration::from_millis(3), false);
        c.record(Duration::from_millis(3), true);
        c.set_queue(7, 2, Duration::from_millis(1500));
        malformed_skipped("Claim");
        let text = encode(&registry);
        assert!(
            text.contains(r#"moor_malformed_values_skipped_total{kind="Claim"}"#),
            "{text}"
        );
        assert!(
            text.contains(r#"moor_reconciles_total{controller="claims"} 2"#),
            "{text}"
        );
        assert!(
            text.contains(r#"moor_reconcile_failures_total{controller="claims"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"moor_queue_depth{controller="claims"} 7"#)
                && text.contains(r#"moor_queue_repairs{controller="claims"} 2"#)
                && text.contains(r#"moor_queue_change_wait_seconds{controller="claims"} 1.5"#),
            "{text}"
        );
        assert!(
            text.contains("moor_reconcile_duration_seconds_count{controller=\"claims\"} 2"),
            "{text}"
        );
    }
}
