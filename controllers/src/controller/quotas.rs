//! The quota reconciler: what each Quota charges of its namespace's volumes,
//! allocations and snapshots (`moor::api::quota`).
//!
//! Expected flow, for a Quota (on its change, and on any change of its namespace's
//! volumes, allocations or snapshots):
//! 1. Read its namespace's volumes, allocations and snapshots from etcd (the specs: a
//!    status is its writer's word and is never counted).
//! 2. Keep each charge whose object is still there under the uid it was charged for
//!    (an allocation's only while it has not ended); drop the others: their usage is
//!    free again.
//! 3. Charge what is not charged yet, oldest first, while it fits under every limit;
//!    raise a volume's charge to a larger `capacity_min` (an expansion) the same way.
//!    What does not fit waits, with why; what is being deleted is never charged anew.
//! 4. Write the status (usage, charges, waits) with compare-and-swap on the version
//!    read in step 1's pass: a conflict reads again. A pass over the same state plans
//!    the same status, so the write a pass makes brings a pass that writes nothing.
//!
//! The gates read the charges: the provisioner creates and expands, the snapshotter
//! cuts, and the claims reconciler admits, only what every quota of the namespace
//! charged ([`moor::api::quota_wait`]).

use moor::api::*;
use moor::runtime::controller::{Action, Config, Controller};
use moor::runtime::informer::Informer;
use moor::runtime::metrics::ControllerMetrics;
use moor::runtime::watcher::Event;
use moor::store::StoreError;
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

use super::context::{Ctx, Informers};
use super::volume_view::VolumeView;

/// Runs until `stop`.
pub async fn run(
    ctx: Ctx,
    inf: &Informers,
    snapshots: &Informer<Snapshot>,
    config: Config,
    metrics: ControllerMetrics,
    stop: CancellationToken,
) {
    let this = Arc::new(ctx);
    let (q1, q2, q3) = (
        this.quotas.clone(),
        this.quotas.clone(),
        this.quotas.clone(),
    );
    // Only what may change a charge wakes a quota: an object made, deleted, or whose
    // spec, deletion or end changed, in a namespace with a quota (not the status
    // writes a claim's progress makes).
    let volumes = charging(
        inf.volumes.subscribe(),
        this.quotas.clone(),
        |v: &VolumeView| (v.namespace.clone(), (v.generation, v.deleting, false)),
    );
    let allocations = charging(
        inf.allocations.subscribe(),
        this.quotas.clone(),
        |a: &Allocation| {
            let basis = (a.metadata.generation, a.is_deleting(), a.is_terminal());
            (a.metadata.namespace.clone(), basis)
        },
    );
    let snapshots = charging(
        snapshots.subscribe(),
        this.quotas.clone(),
        |s: &Snapshot| {
            let basis = (s.metadata.generation, s.is_deleting(), false);
            (s.metadata.namespace.clone(), basis)
        },
    );
    Controller::new("quotas", this.quotas.clone(), config)
        .with_metrics(metrics)
        .owns(inf.quotas.subscribe())
        .watches(volumes, move |v: &VolumeView| {
            in_namespace(&q1, &v.namespace)
        })
        .watches(allocations, move |a: &Allocation| {
            in_namespace(&q2, &a.metadata.namespace)
        })
        .watches(snapshots, move |s: &Snapshot| {
            in_namespace(&q3, &s.metadata.namespace)
        })
        .run(reconcile, this, stop)
        .await;
}

/// What of an object a charge depends on: its generation (its spec), whether it is
/// being deleted, whether it ended (an allocation).
type Basis = (i64, bool, bool);

/// `events`, keeping only what may change a charge: an object applied in a namespace
/// with a quota whose [`Basis`] (`basis`) is new or changed, every deletion and relist.
fn charging<K, E>(
    events: impl futures::Stream<Item = Result<Event<K>, E>> + Send + 'static,
    quotas: moor::runtime::reflector::Store<Quota>,
    basis: fn(&K) -> (Namespace, Basis),
) -> impl futures::Stream<Item = Result<Event<K>, E>> + Send + 'static
where
    K: moor::runtime::Resource,
    E: Send + 'static,
{
    use futures::StreamExt;
    let seen: std::sync::Mutex<std::collections::HashMap<String, Basis>> = Default::default();
    events.filter(move |event| {
        let keep = match event {
            Ok(Event::Applied(obj)) => {
                let (ns, now) = basis(obj);
                let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
                if quotas.state().iter().any(|q| q.metadata.namespace == ns) {
                    seen.insert(obj.key(), now) != Some(now)
                } else {
                    seen.remove(&obj.key());
                    false
                }
            }
            Ok(Event::Deleted { key, .. }) => {
                seen.lock().unwrap_or_else(|p| p.into_inner()).remove(key);
                true
            }
            _ => true,
        };
        std::future::ready(keep)
    })
}

/// The keys of namespace `ns`'s quotas (few: most namespaces have none).
fn in_namespace(
    quotas: &moor::runtime::reflector::Store<Quota>,
    ns: &Namespace,
) -> Vec<ObjectKey<QuotaSpec>> {
    quotas
        .state()
        .iter()
        .filter(|q| &q.metadata.namespace == ns)
        .map(|q| q.object_key())
        .collect()
}

async fn reconcile(ctx: Arc<Ctx>, key: ObjectKey<QuotaSpec>) -> Result<Action, StoreError> {
    let store = ctx.writer.store();
    let Some(quota) = store.try_get(&key).await? else {
        return Ok(Action::AwaitChange);
    };
    if quota.is_deleting() {
        return Ok(Action::AwaitChange);
    }
    let ns = quota.metadata.namespace.clone();
    let mut asks = Vec::new();
    if let Some(scope) = KeyScope::<VolumeSpec>::namespace(&ns) {
        asks.extend(store.list(&scope).await?.items.iter().map(Ask::volume));
    }
    if let Some(scope) = KeyScope::<AllocationSpec>::namespace(&ns) {
        asks.extend(
            store
                .list(&scope)
                .await?
                .items
                .iter()
                .filter(|a| !a.is_terminal())
                .map(Ask::allocation),
        );
    }
    if let Some(scope) = KeyScope::<SnapshotSpec>::namespace(&ns) {
        asks.extend(store.list(&scope).await?.items.iter().map(Ask::snapshot));
    }
    let status = plan(&quota.spec, &quota.status, asks);
    if status == quota.status {
        return Ok(Action::AwaitChange);
    }
    let mut next = quota;
    next.status = status;
    // Guarded by the version read above: a conflict is read again by the runtime.
    ctx.writer.replace_status(&next).await?;
    Ok(Action::AwaitChange)
}

/// What an object asks of its namespace's quotas.
#[derive(Debug, Clone, PartialEq)]
pub struct Ask {
    /// Its kind.
    pub kind: Charged,
    /// Its name.
    pub name: Name,
    /// Its uid.
    pub uid: Uid,
    /// The capacity it asks (a volume's `capacity_min`).
    pub bytes: Option<Size>,
    /// Its class (a volume's).
    pub class: Option<Name>,
    /// A registration: no capacity is made for it.
    pub registered: bool,
    /// It is being deleted: kept if charged, never charged anew.
    pub deleting: bool,
    /// When it was made (the order charges are given in).
    pub made: Option<Timestamp>,
}

impl Ask {
    fn of<S: Spec>(kind: Charged, o: &Object<S>) -> Ask {
        Ask {
            kind,
            name: o.metadata.name.clone(),
            uid: o.metadata.uid.clone(),
            bytes: None,
            class: None,
            registered: false,
            deleting: o.is_deleting(),
            made: o.metadata.creation_timestamp,
        }
    }

    /// A volume's ask.
    pub fn volume(v: &Volume) -> Ask {
        Ask {
            bytes: v.spec.capacity_min,
            class: v.spec.class.clone(),
            registered: v.spec.is_registration(),
            ..Ask::of(Charged::Volume, v)
        }
    }

    /// An allocation's ask.
    pub fn allocation(a: &Allocation) -> Ask {
        Ask::of(Charged::Allocation, a)
    }

    /// A snapshot's ask.
    pub fn snapshot(s: &Snapshot) -> Ask {
        Ask::of(Charged::Snapshot, s)
    }

    /// The capacity charged for it: none for a registration.
    fn charged_bytes(&self) -> u64 {
        if self.registered {
            0
        } else {
            self.bytes.map_or(0, |b| b.0)
        }
    }
}

/// The status a quota of `spec` should have, from what it charged (`was`) and what
/// its namespace's objects ask now. Pure: the same inputs plan the same status.
pub fn plan(spec: &QuotaSpec, was: &QuotaStatus, asks: Vec<Ask>) -> QuotaStatus {
    let mut asks = asks;
    asks.sort_by(|a, b| (a.made, &a.name, a.kind).cmp(&(b.made, &b.name, b.kind)));
    let mut next = QuotaStatus {
        meta: was.meta.clone(),
        ..Default::default()
    };
    // Step 2: the charges that stand, at what they were charged.
    let mut raising = Vec::new();
    let mut new = Vec::new();
    for ask in &asks {
        let key = Quota::charge_key(ask.kind, ask.name.as_str());
        match was.charged.get(&key) {
            Some(c) if c.uid == ask.uid => {
                add(&mut next.used, ask.kind, c.bytes.0, c.class.as_ref());
                next.charged.insert(key.clone(), c.clone());
                if ask.charged_bytes() > c.bytes.0 && !ask.deleting {
                    raising.push((key, ask));
                }
            }
            _ if ask.deleting => {}
            _ => new.push((key, ask)),
        }
    }
    let mut waiting = BTreeMap::new();
    // Step 3: expansions of what is charged, then what is new, oldest first.
    for (key, ask) in raising {
        let c = next.charged[&key].clone();
        let more = ask.charged_bytes() - c.bytes.0;
        match room(spec, &next.used, ask.kind, more, c.class.as_ref(), false) {
            Ok(()) => {
                add_bytes(&mut next.used, more, c.class.as_ref());
                if let Some(charge) = next.charged.get_mut(&key) {
                    charge.bytes = Size(ask.charged_bytes());
                }
            }
            Err(why) => {
                waiting.insert(
                    key,
                    format!("its expansion to {}: {why}", Size(ask.charged_bytes())),
                );
            }
        }
    }
    for (key, ask) in new {
        let needs_size = ask.kind == Charged::Volume
            && !ask.registered
            && ask.bytes.is_none()
            && (spec.capacity.is_some()
                || ask
                    .class
                    .as_ref()
                    .is_some_and(|c| spec.classes.contains_key(c)));
        let fits = if needs_size {
            Err("capacity is limited: the volume must ask capacity_min".to_string())
        } else if next.charged.len() >= MAX_CHARGES {
            Err(format!("it charges {MAX_CHARGES} objects, its most"))
        } else {
            room(
                spec,
                &next.used,
                ask.kind,
                ask.charged_bytes(),
                ask.class.as_ref(),
                true,
            )
        };
        match fits {
            Ok(()) => {
                let bytes = ask.charged_bytes();
                add(&mut next.used, ask.kind, bytes, ask.class.as_ref());
                next.charged.insert(
                    key,
                    Charge {
                        uid: ask.uid.clone(),
                        bytes: Size(bytes),
                        class: ask.class.clone().filter(|_| ask.kind == Charged::Volume),
                    },
                );
            }
            Err(why) => {
                waiting.insert(key, why);
            }
        }
    }
    next.waiting_count = waiting.len() as u64;
    next.waiting = waiting.into_iter().take(MAX_WAITING_SHOWN).collect();
    next
}

/// Counts one `kind` and `bytes` (of `class`) into `used`.
fn add(used: &mut Usage, kind: Charged, bytes: u64, class: Option<&Name>) {
    match kind {
        Charged::Volume => {
            used.volumes += 1;
            add_bytes(used, bytes, class);
        }
        Charged::Allocation => used.allocations += 1,
        Charged::Snapshot => used.snapshots += 1,
    }
}

/// Counts `bytes` of `class` into `used`'s capacity.
fn add_bytes(used: &mut Usage, bytes: u64, class: Option<&Name>) {
    used.capacity = Size(used.capacity.0.saturating_add(bytes));
    if let Some(class) = class {
        let c = used.classes.entry(class.clone()).or_default();
        *c = Size(c.0.saturating_add(bytes));
    }
}

/// Whether one more `kind` (`one`: counted; an expansion is not) asking `bytes` of
/// `class` fits under `spec` beside `used`; else which limit it passes.
fn room(
    spec: &QuotaSpec,
    used: &Usage,
    kind: Charged,
    bytes: u64,
    class: Option<&Name>,
    one: bool,
) -> Result<(), String> {
    let count = |what: &str, used: u64, limit: Option<u64>| match limit {
        Some(limit) if one && used >= limit => Err(format!("{what} {used} of {limit} used")),
        _ => Ok(()),
    };
    let size = |what: String, used: Size, limit: Option<Size>| match limit {
        Some(limit) if used.0.saturating_add(bytes) > limit.0 => Err(format!(
            "{what} {used} of {limit} used, and it asks {}",
            Size(bytes)
        )),
        _ => Ok(()),
    };
    match kind {
        Charged::Volume => {
            count("volumes", used.volumes, spec.volumes)?;
            size("capacity".into(), used.capacity, spec.capacity)?;
            if let Some(class) = class {
                size(
                    format!("class {class}: capacity"),
                    used.classes.get(class).copied().unwrap_or_default(),
                    spec.classes.get(class).copied(),
                )?;
            }
            Ok(())
        }
        Charged::Allocation => count("allocations", used.allocations, spec.allocations),
        Charged::Snapshot => count("snapshots", used.snapshots, spec.snapshots),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vol(name: &str, at: i64, bytes: Option<u64>) -> Ask {
        Ask {
            kind: Charged::Volume,
            name: Name::new(name).unwrap(),
            uid: Uid::new(&format!("uid-{name}")),
            bytes: bytes.map(Size),
            class: None,
            registered: false,
            deleting: false,
            made: Some(Timestamp::from_system(
                std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000 + at as u64),
            )),
        }
    }

    fn spec(volumes: Option<u64>, capacity: Option<u64>) -> QuotaSpec {
        QuotaSpec {
            volumes,
            capacity: capacity.map(Size),
            ..Default::default()
        }
    }

    #[test]
    fn the_oldest_are_charged_while_they_fit_and_the_rest_wait_saying_why() {
        let s = spec(Some(2), Some(30));
        let st = plan(
            &s,
            &QuotaStatus::default(),
            vec![
                vol("c", 3, Some(10)),
                vol("a", 1, Some(10)),
                vol("b", 2, Some(10)),
            ],
        );
        assert_eq!(st.used.volumes, 2);
        assert_eq!(st.used.capacity, Size(20));
        assert!(st.charged.contains_key("volume/a") && st.charged.contains_key("volume/b"));
        assert_eq!(st.waiting["volume/c"], "volumes 2 of 2 used");
        assert_eq!(st.waiting_count, 1);
        // A pass over the same state plans the same status: nothing to write.
        let again = plan(
            &s,
            &st,
            vec![
                vol("a", 1, Some(10)),
                vol("b", 2, Some(10)),
                vol("c", 3, Some(10)),
            ],
        );
        assert_eq!(again, st);
        // a deleted: its charge goes, c fits.
        let after = plan(&s, &st, vec![vol("b", 2, Some(10)), vol("c", 3, Some(10))]);
        assert!(after.charged.contains_key("volume/c"));
        assert_eq!(after.used.volumes, 2);
        assert!(after.waiting.is_empty());
    }

    #[test]
    fn capacity_and_class_limits_and_expansions_are_charged_to_the_byte() {
        let mut s = spec(None, Some(25));
        s.classes.insert(Name::new("fast").unwrap(), Size(10));
        let mut fast = vol("f", 1, Some(8));
        fast.class = Some(Name::new("fast").unwrap());
        let mut fast2 = vol("g", 2, Some(4));
        fast2.class = fast.class.clone();
        let st = plan(
            &s,
            &QuotaStatus::default(),
            vec![fast.clone(), fast2.clone(), vol("h", 3, Some(20))],
        );
        assert!(st.charged.contains_key("volume/f"));
        assert_eq!(
            st.waiting["volume/g"],
            "class fast: capacity 8 B of 10 B used, and it asks 4 B"
        );
        assert_eq!(
            st.waiting["volume/h"],
            "capacity 8 B of 25 B used, and it asks 20 B"
        );
        // f grows to 10: fits its class exactly; its count is not taken twice.
        fast.bytes = Some(Size(10));
        let st = plan(&s, &st, vec![fast.clone()]);
        assert_eq!(st.charged["volume/f"].bytes, Size(10));
        assert_eq!((st.used.volumes, st.used.capacity), (1, Size(10)));
        // And to 11: the expansion waits, the charge stays at 10.
        fast.bytes = Some(Size(11));
        let st = plan(&s, &st, vec![fast]);
        assert_eq!(st.charged["volume/f"].bytes, Size(10));
        assert!(st.waiting["volume/f"].starts_with("its expansion to 11 B: class fast"));
    }

    #[test]
    fn a_volume_made_again_a_registration_and_a_volume_being_deleted() {
        let s = spec(Some(1), Some(100));
        let st = plan(&s, &QuotaStatus::default(), vec![vol("a", 1, Some(10))]);
        // Made again under the same name: another uid, charged anew (the old charge
        // goes with the old object).
        let mut again = vol("a", 5, Some(50));
        again.uid = Uid::new("uid-other");
        let st2 = plan(&s, &st, vec![again.clone()]);
        assert_eq!(st2.charged["volume/a"].uid, again.uid);
        assert_eq!(st2.used.capacity, Size(50));
        // Being deleted: kept while charged, never charged anew.
        let mut gone = vol("b", 2, Some(10));
        gone.deleting = true;
        let st3 = plan(&spec(Some(5), None), &QuotaStatus::default(), vec![gone]);
        assert!(st3.charged.is_empty() && st3.waiting.is_empty());
        // A registration counts, with no capacity; a created volume with no size
        // waits where capacity is limited.
        let mut reg = vol("r", 1, None);
        reg.registered = true;
        let st4 = plan(
            &spec(Some(5), Some(10)),
            &QuotaStatus::default(),
            vec![reg, vol("n", 2, None)],
        );
        assert_eq!(st4.used.volumes, 1);
        assert_eq!(st4.used.capacity, Size(0));
        assert_eq!(
            st4.waiting["volume/n"],
            "capacity is limited: the volume must ask capacity_min"
        );
    }

    #[tokio::test]
    async fn only_what_may_change_a_charge_wakes_a_quota() {
        use futures::StreamExt;
        let (quotas, mut writer) = moor::runtime::reflector::store::<Quota>();
        let a = Namespace::new("a").unwrap();
        writer.apply(&Event::restarted(vec![Quota::new(
            &a,
            Name::new("q").unwrap(),
            QuotaSpec {
                volumes: Some(1),
                ..Default::default()
            },
        )]));
        let vol = |ns: &str, generation: i64, claimed: bool| {
            let mut v = Volume::new(
                &Namespace::new(ns).unwrap(),
                Name::new("v").unwrap(),
                VolumeSpec::default(),
            );
            v.metadata.generation = generation;
            v.status.claims.schedulable = claimed;
            Arc::new(VolumeView::of(v))
        };
        let events: Vec<Result<Event<VolumeView>, std::convert::Infallible>> = vec![
            Ok(Event::Applied(vol("a", 1, false))),
            // A status write (a claim's progress): nothing to charge anew.
            Ok(Event::Applied(vol("a", 1, true))),
            // Its spec changed.
            Ok(Event::Applied(vol("a", 2, true))),
            // A namespace without a quota.
            Ok(Event::Applied(vol("b", 1, false))),
            Ok(Event::Deleted {
                key: "volumes/a/v".into(),
                last: None,
            }),
            // Made again: new to the filter.
            Ok(Event::Applied(vol("a", 1, false))),
        ];
        let kept: Vec<String> = charging(futures::stream::iter(events), quotas, |v| {
            (v.namespace.clone(), (v.generation, v.deleting, false))
        })
        .map(|e| match e.unwrap() {
            Event::Applied(v) => format!("{}/{}", v.namespace, v.generation),
            Event::Deleted { key, .. } => format!("deleted {key}"),
            Event::Restarted(_) => "relist".into(),
        })
        .collect()
        .await;
        assert_eq!(kept, ["a/1", "a/2", "deleted volumes/a/v", "a/1"]);
    }

    #[test]
    fn allocations_and_snapshots_are_counted() {
        let s = QuotaSpec {
            allocations: Some(1),
            snapshots: Some(1),
            ..Default::default()
        };
        let mut a1 = vol("x", 1, None);
        a1.kind = Charged::Allocation;
        let mut a2 = vol("y", 2, None);
        a2.kind = Charged::Allocation;
        let mut s1 = vol("x", 3, None);
        s1.kind = Charged::Snapshot;
        let st = plan(&s, &QuotaStatus::default(), vec![a1, a2, s1]);
        assert_eq!((st.used.allocations, st.used.snapshots), (1, 1));
        assert_eq!(st.waiting["allocation/y"], "allocations 1 of 1 used");
        // Volumes are not limited by this quota: charged, counted, never waiting.
        let st = plan(&s, &st, vec![vol("v", 4, None)]);
        assert_eq!(st.used.volumes, 1);
    }
}
