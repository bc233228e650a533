//! The console's one set of watches: a watch per kind it shows, each kept as a sorted
//! table of rows (what the pages show, [`super::rows`]) with an index of related
//! objects, and one broadcast of what changed, which every browser's live stream
//! filters. A browser never opens a watch of its own: 50 open pages cost etcd what one
//! does.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::StreamExt;
use moor::api::*;
use moor::runtime::backoff::{backoff, Backoff};
use moor::runtime::reflector::Keys;
use moor::runtime::watcher::{watcher_making, Event, Make, WatchError};
use moor::store::Store;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use super::rows::*;

/// What changed: the topics it wakes (its kind, `k:KEY`, and its related topics).
/// `Restarted` wakes everything.
#[derive(Debug)]
pub struct Change {
    pub topics: Vec<String>,
}

impl Change {
    /// Whether a page following `wanted` must refresh.
    pub fn wakes(&self, wanted: &[String]) -> bool {
        self.topics
            .iter()
            .any(|t| t == "*" || wanted.iter().any(|w| w == t || w == "*"))
    }
}

/// A sorted table of one kind's rows, with their index values.
pub struct Table<R> {
    inner: RwLock<Inner<R>>,
}

struct Inner<R> {
    rows: BTreeMap<Arc<str>, Arc<R>>,
    /// By the hash of the index value (not the value: 100,000 claims' volume and
    /// allocation names would be held twice more). A lookup checks the rows it finds.
    index: HashMap<u64, Keys>,
    ready: bool,
}

/// An index value's hash.
fn hash(value: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    value.hash(&mut h);
    h.finish()
}

impl<R: Row> Default for Table<R> {
    fn default() -> Self {
        Table {
            inner: RwLock::new(Inner {
                rows: BTreeMap::new(),
                index: HashMap::new(),
                ready: false,
            }),
        }
    }
}

/// What one person may see (issue 79): every object, or the objects of some
/// namespaces and the cluster's (nodes, plugins, cordons), as their etcd role reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// Everything (the console without `--people`, or an operator).
    All,
    /// These namespaces' objects, and the cluster-wide ones.
    Namespaces(std::collections::BTreeSet<String>),
}

tokio::task_local! {
    /// The scope of the request being served (set by the access layer).
    pub static SCOPE: Scope;
}

/// Whether the console serves people (`--people`): then a request without a scope
/// sees nothing, so a path that lost it fails closed.
pub static PEOPLE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl Scope {
    /// The current request's scope: `All` without `--people`; with it, nothing
    /// outside a request's scope.
    pub fn current() -> Option<Scope> {
        SCOPE
            .try_with(Scope::clone)
            .ok()
            .or_else(|| (!PEOPLE.load(std::sync::atomic::Ordering::Relaxed)).then_some(Scope::All))
    }

    /// Whether the object at `key` (below the prefix) is shown.
    pub fn shows_key(&self, key: &str) -> bool {
        match self {
            Scope::All => true,
            Scope::Namespaces(set) => match key_namespace(key) {
                Some(ns) => set.contains(ns),
                None => cluster_key(key),
            },
        }
    }

    /// Whether namespace `ns` is shown.
    pub fn shows_namespace(&self, ns: &str) -> bool {
        match self {
            Scope::All => true,
            Scope::Namespaces(set) => set.contains(ns),
        }
    }

    /// Whether a live page may follow `topic` (`v:NS/VOLUME`, `a:NS/ALLOCATION`,
    /// `o:KIND/NS/NAME`, `n:NODE`, a key, a kind).
    pub fn shows_topic(&self, topic: &str) -> bool {
        if let Some(rest) = topic
            .strip_prefix("v:")
            .or_else(|| topic.strip_prefix("a:"))
        {
            return self.shows_namespace(rest.split('/').next().unwrap_or(""));
        }
        if let Some(rest) = topic.strip_prefix("o:") {
            return match rest.split('/').nth(1) {
                Some("") | None => true,
                Some(ns) => self.shows_namespace(ns),
            };
        }
        if topic.starts_with("n:") || !topic.contains('/') {
            return true;
        }
        self.shows_key(topic)
    }

    /// What the render cache keys a page by, beside its address.
    pub fn cache_key(&self) -> String {
        match self {
            Scope::All => "*".into(),
            Scope::Namespaces(ns) => ns.iter().cloned().collect::<Vec<_>>().join(","),
        }
    }
}

/// The namespace in a stored key of a kind the console shows, `None` for a
/// cluster-wide kind's (or a key it does not know).
fn key_namespace(key: &str) -> Option<&str> {
    let parts: Vec<&str> = key.split('/').collect();
    let at = match parts.first().copied()? {
        "volumes" | "allocations" | "attachments" | "snapshots" | "quotas" => 1,
        "claims" | "mounts" => 2,
        "events" if parts.get(1) == Some(&"controller") => 2,
        "events" if parts.get(1) == Some(&"node") => 3,
        _ => return None,
    };
    parts.get(at).copied()
}

/// Whether `key` is of a cluster-wide kind a namespace's people read.
fn cluster_key(key: &str) -> bool {
    matches!(key.split('/').next(), Some("nodes" | "plugins" | "cordons"))
}

/// Whether the current request may see the row at `key`.
fn visible(key: &str) -> bool {
    SCOPE
        .try_with(|s| s.shows_key(key))
        .unwrap_or_else(|_| !PEOPLE.load(std::sync::atomic::Ordering::Relaxed))
}

/// Whether the current request sees every row (no filtering to do).
fn sees_all() -> bool {
    SCOPE
        .try_with(|s| *s == Scope::All)
        .unwrap_or_else(|_| !PEOPLE.load(std::sync::atomic::Ordering::Relaxed))
}

impl<R: Row> Table<R> {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner<R>> {
        self.inner.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner<R>> {
        self.inner.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the first list has arrived.
    pub fn ready(&self) -> bool {
        self.read().ready
    }

    /// How many rows (that the current request may see).
    pub fn len(&self) -> usize {
        let inner = self.read();
        if sees_all() {
            return inner.rows.len();
        }
        inner.rows.keys().filter(|k| visible(k)).count()
    }

    /// One row.
    pub fn get(&self, key: &str) -> Option<Arc<R>> {
        if !visible(key) {
            return None;
        }
        self.read().rows.get(key).cloned()
    }

    /// The rows whose related topics include `value`, in key order.
    pub fn by(&self, value: &str) -> Vec<Arc<R>> {
        let inner = self.read();
        inner
            .index
            .get(&hash(value))
            .map(|keys| {
                keys.iter()
                    .filter(|k| visible(k))
                    .filter_map(|k| inner.rows.get(k))
                    .filter(|r| r.related().iter().any(|t| t == value))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// How many rows hold `value` (as its hash: two values of one 64-bit hash, about
    /// one chance in 10^8 at a million values, would be counted together).
    pub fn count_by(&self, value: &str) -> usize {
        if !sees_all() {
            return self.by(value).len();
        }
        self.read().index.get(&hash(value)).map_or(0, Keys::len)
    }

    /// Calls `f` with each row in key order, from the first key after `after`, until
    /// it returns false.
    pub fn scan(&self, after: Option<&str>, mut f: impl FnMut(&Arc<R>) -> bool) {
        use std::ops::Bound;
        let inner = self.read();
        let range = match after {
            Some(a) => inner
                .rows
                .range::<str, _>((Bound::Excluded(a), Bound::Unbounded)),
            None => inner.rows.range::<str, _>(..),
        };
        let all = sees_all();
        for (key, row) in range {
            if !all && !visible(key) {
                continue;
            }
            if !f(row) {
                return;
            }
        }
    }

    /// Calls `f` with each row in reverse key order, from the last key before
    /// `before`, until it returns false.
    pub fn scan_back(&self, before: &str, mut f: impl FnMut(&Arc<R>) -> bool) {
        use std::ops::Bound;
        let inner = self.read();
        let all = sees_all();
        for (key, row) in inner
            .rows
            .range::<str, _>((Bound::Unbounded, Bound::Excluded(before)))
            .rev()
        {
            if !all && !visible(key) {
                continue;
            }
            if !f(row) {
                return;
            }
        }
    }

    /// Drops `key` from the index values `related` (its row's, as indexed).
    fn unindex(inner: &mut Inner<R>, key: &str, related: &[String]) {
        if !R::INDEXED {
            return;
        }
        for value in related {
            let h = hash(value);
            if let Some(keys) = inner.index.get_mut(&h) {
                if keys.remove(key) {
                    inner.index.remove(&h);
                }
            }
        }
    }

    /// Adds `key` under the index values `related`.
    fn index(inner: &mut Inner<R>, key: &Arc<str>, related: &[String]) {
        if !R::INDEXED {
            return;
        }
        for value in related {
            let h = hash(value);
            match inner.index.get_mut(&h) {
                Some(keys) => keys.insert(key),
                None => {
                    inner.index.insert(h, Keys::One(key.clone()));
                }
            }
        }
    }

    /// Applies a watch event; returns the change it makes. Each row's related topics
    /// are made once and serve both the index and the change.
    fn apply(&self, event: Event<R>) -> Change {
        let mut inner = self.write();
        match event {
            Event::Restarted(all) => {
                inner.rows.clear();
                inner.index.clear();
                for row in all {
                    Self::index(&mut inner, row.key(), &row.related());
                    inner.rows.insert(row.key().clone(), row);
                }
                inner.ready = true;
                Change {
                    topics: vec!["*".into()],
                }
            }
            Event::Applied(row) => {
                let key = row.key().clone();
                let mut topics = vec![R::KIND.to_string(), format!("k:{key}")];
                let related = row.related();
                // What it related to before: a page of what it left must refresh too.
                if let Some(old) = inner.rows.insert(key.clone(), row) {
                    let before = old.related();
                    Self::unindex(&mut inner, &key, &before);
                    topics.extend(before.into_iter().filter(|t| !related.contains(t)));
                }
                Self::index(&mut inner, &key, &related);
                topics.extend(related);
                Change { topics }
            }
            Event::Deleted { key, .. } => {
                let mut topics = vec![R::KIND.to_string(), format!("k:{key}")];
                if let Some(old) = inner.rows.remove(key.as_str()) {
                    let before = old.related();
                    Self::unindex(&mut inner, &key, &before);
                    topics.extend(before);
                }
                Change { topics }
            }
        }
    }
}

/// Every table, and the broadcast of changes.
pub struct Catalog {
    pub volumes: Table<VolumeRow>,
    pub claims: Table<ClaimRow>,
    pub allocations: Table<AllocationRow>,
    pub attachments: Table<AttachmentRow>,
    pub mounts: Table<MountRow>,
    pub snapshots: Table<SnapshotRow>,
    pub events: Table<EventRow>,
    pub nodes: Table<Whole<NodeSpec>>,
    pub plugins: Table<Whole<PluginSpec>>,
    pub cordons: Table<Whole<CordonSpec>>,
    pub quotas: Table<Whole<QuotaSpec>>,
    /// What changed, for the live streams.
    pub changes: broadcast::Sender<Arc<Change>>,
    /// The store, for detail pages (one read of the object shown).
    pub store: Store,
    /// How many changes the tables applied (the render cache's version).
    applied: std::sync::atomic::AtomicU64,
}

/// How many changes a live stream may fall behind before it just refreshes.
const CHANGES: usize = 1024;

impl Catalog {
    /// Starts the watches; they run until `shutdown`.
    pub fn spawn(store: Store, shutdown: CancellationToken) -> Arc<Catalog> {
        let catalog = Arc::new(Catalog {
            volumes: Table::default(),
            claims: Table::default(),
            allocations: Table::default(),
            attachments: Table::default(),
            mounts: Table::default(),
            snapshots: Table::default(),
            events: Table::default(),
            nodes: Table::default(),
            plugins: Table::default(),
            cordons: Table::default(),
            quotas: Table::default(),
            changes: broadcast::channel(CHANGES).0,
            store,
            applied: Default::default(),
        });
        follow(&catalog, |c| &c.volumes, VolumeRow::project, &shutdown);
        follow(&catalog, |c| &c.claims, ClaimRow::project, &shutdown);
        follow(
            &catalog,
            |c| &c.allocations,
            AllocationRow::project,
            &shutdown,
        );
        follow(
            &catalog,
            |c| &c.attachments,
            AttachmentRow::project,
            &shutdown,
        );
        follow(&catalog, |c| &c.mounts, MountRow::project, &shutdown);
        follow(&catalog, |c| &c.snapshots, SnapshotRow::project, &shutdown);
        follow(&catalog, |c| &c.events, EventRow::project, &shutdown);
        follow(&catalog, |c| &c.nodes, Whole::project, &shutdown);
        follow(&catalog, |c| &c.plugins, Whole::project, &shutdown);
        follow(&catalog, |c| &c.cordons, Whole::project, &shutdown);
        follow(&catalog, |c| &c.quotas, Whole::project, &shutdown);
        catalog
    }

    /// How many changes the tables applied so far.
    pub fn version(&self) -> u64 {
        self.applied.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Whether every table has its first list.
    pub fn ready(&self) -> bool {
        self.volumes.ready()
            && self.claims.ready()
            && self.allocations.ready()
            && self.attachments.ready()
            && self.mounts.ready()
            && self.snapshots.ready()
            && self.events.ready()
            && self.nodes.ready()
            && self.plugins.ready()
            && self.cordons.ready()
            && self.quotas.ready()
    }
}

/// Watches kind `S`, keeping its rows in the table `table` picks.
fn follow<S: Spec, R: Row>(
    catalog: &Arc<Catalog>,
    table: fn(&Catalog) -> &Table<R>,
    project: fn(Object<S>) -> R,
    shutdown: &CancellationToken,
) {
    let make: Make<S, R> = Arc::new(move |o| Some(Arc::new(project(o))));
    let events = watcher_making(catalog.store.clone(), KeyScope::<S>::all(), false, make)
        .filter_map(|item| {
            std::future::ready(match item {
                // A malformed value is not shown (moord check reports it), and is not
                // a failure of the watch.
                Err(WatchError::Malformed(e)) => {
                    if moor::runtime::informer::first_sighting(&e) {
                        tracing::warn!(kind = S::KIND, error = %e, "console: skipping a malformed value");
                    }
                    None
                }
                other => Some(other),
            })
        });
    let events = backoff(
        events,
        Backoff::new(Duration::from_millis(200), Duration::from_secs(10)),
    );
    let catalog = catalog.clone();
    let shutdown = shutdown.clone();
    tokio::spawn(async move {
        tokio::pin!(events);
        loop {
            let item = tokio::select! {
                _ = shutdown.cancelled() => return,
                item = events.next() => item,
            };
            match item {
                None => return,
                Some(Ok(event)) => {
                    let change = table(&catalog).apply(event);
                    catalog
                        .applied
                        .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
                    // No live page open is fine.
                    let _ = catalog.changes.send(Arc::new(change));
                }
                Some(Err(e)) => {
                    tracing::debug!(kind = S::KIND, error = %moor::process::error_chain(&e), "console: watch error")
                }
            }
        }
    });
}

/// Where the console's tables place objects, for the one rule of node events
/// ([`moor::api::event_shown`]). Claims and mounts are keyed by node first: one not
/// held under the node is taken as elsewhere (a deleted one too: the console hides what
/// moorctl shows with its source, never the reverse).
impl moor::api::Whereabouts for Catalog {
    fn known(&self, kind: &str, namespace: &str, name: &str) -> bool {
        let Ok(ns) = Namespace::new(namespace) else {
            return kind == "Node" || kind == "Plugin";
        };
        match kind {
            "Volume" => self
                .volumes
                .get(Volume::key_for(&ns, name).as_str())
                .is_some(),
            "Allocation" => self
                .allocations
                .get(Allocation::key_for(&ns, name).as_str())
                .is_some(),
            "Claim" | "Mount" => true,
            "Snapshot" => self
                .snapshots
                .get(Snapshot::key_for(&ns, name).as_str())
                .is_some(),
            _ => true,
        }
    }

    fn speaks_about(&self, kind: &str, namespace: &str, name: &str, node: &str) -> bool {
        let controller_of = |plugin: &PluginId| {
            NodeName::new(node)
                .ok()
                .and_then(|n| self.nodes.get(Node::key_for(&n).as_str()))
                .and_then(|n| n.obj.status.plugins.get(plugin).map(|p| p.plugin_type))
                .is_some_and(|t| matches!(t, PluginType::Controller | PluginType::Monolith))
        };
        let ns = Namespace::new(namespace).unwrap_or_default();
        match kind {
            "Node" => name == node,
            "Plugin" => NodeName::new(node)
                .ok()
                .and_then(|n| self.nodes.get(Node::key_for(&n).as_str()))
                .is_some_and(|n| n.obj.status.plugins.keys().any(|p| p.as_str() == name)),
            "Claim" => NodeName::new(node).is_ok_and(|n| {
                self.claims
                    .get(Claim::key_for(&n, &ns, name).as_str())
                    .is_some()
            }),
            "Mount" => NodeName::new(node).is_ok_and(|n| {
                self.mounts
                    .get(Mount::key_for(&Claim::key_for(&n, &ns, name)).as_str())
                    .is_some()
            }),
            "Allocation" => self
                .allocations
                .get(Allocation::key_for(&ns, name).as_str())
                .is_some_and(|a| a.node.as_str() == node),
            "Volume" => {
                let topic = super::rows::vol(&ns, name);
                self.claims
                    .by(&topic)
                    .iter()
                    .any(|c| c.node.as_str() == node)
                    || self
                        .attachments
                        .by(&topic)
                        .iter()
                        .any(|a| a.node.as_str() == node)
                    || self
                        .volumes
                        .get(Volume::key_for(&ns, name).as_str())
                        .is_some_and(|v| controller_of(&v.plugin))
            }
            "Snapshot" => self
                .snapshots
                .get(Snapshot::key_for(&ns, name).as_str())
                .and_then(|s| self.volumes.get(Volume::key_for(&ns, &s.volume).as_str()))
                .is_some_and(|v| controller_of(&v.plugin)),
            // Attachments are named by their volume and node.
            "Attachment" => {
                name.ends_with(&format!("/{node}")) || name.ends_with(&format!(".{node}"))
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mount(name: &str, volume: &str, node_name: &str) -> Arc<MountRow> {
        Arc::new(MountRow {
            key: format!("mounts/{node_name}/default/{name}").into(),
            namespace: Namespace::default_ns(),
            claim: Name::new(name).unwrap(),
            allocation: AllocationId::new(name).unwrap(),
            volume: VolumeId::new(volume).unwrap(),
            node: NodeName::new(node_name).unwrap(),
            stages: true,
            target_path: "/t".into(),
            staged: false,
            stage_uncertain: false,
            published: false,
            publish_uncertain: false,
            released: false,
            abnormal: None,
            usage: None,
            waiting: None,
        })
    }

    #[test]
    fn the_index_follows_changes_and_deletions() {
        let t = Table::<MountRow>::default();
        let change = t.apply(Event::Restarted(vec![
            mount("a", "v1", "n1"),
            mount("b", "v1", "n2"),
            mount("c", "v2", "n1"),
        ]));
        assert!(change.wakes(&["anything".into()]));
        assert!(t.ready());
        let v1 = vol(&Namespace::default_ns(), "v1");
        assert_eq!(t.count_by(&v1), 2);
        assert_eq!(t.count_by(&node("n1")), 2);
        assert_eq!(t.count_by(&alloc(&Namespace::default_ns(), "c")), 1);
        // b moves to v2: out of v1's index, into v2's.
        let change = t.apply(Event::Applied(mount("b", "v2", "n2")));
        assert!(
            change.wakes(std::slice::from_ref(&v1)),
            "the volume it left is woken"
        );
        assert!(change.wakes(&["Mount".into()]));
        assert!(!change.wakes(&[node("n1")]));
        assert_eq!(t.count_by(&v1), 1);
        assert_eq!(t.count_by(&vol(&Namespace::default_ns(), "v2")), 2);
        let change = t.apply(Event::Deleted {
            key: "mounts/n1/default/a".into(),
            last: None,
        });
        assert!(
            change.wakes(std::slice::from_ref(&v1)),
            "the deleted row's topics are woken"
        );
        assert_eq!(t.count_by(&v1), 0);
        assert!(t.by(&v1).is_empty());
        assert_eq!(t.len(), 2);
        let mut keys = Vec::new();
        t.scan(Some("mounts/n1/default/c"), |r| {
            keys.push(r.key().to_string());
            true
        });
        assert_eq!(keys, vec!["mounts/n2/default/b"]);
        keys.clear();
        t.scan_back("mounts/n2/default/b", |r| {
            keys.push(r.key().to_string());
            true
        });
        assert_eq!(keys, vec!["mounts/n1/default/c"]);
    }
}
