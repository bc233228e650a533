//! The watcher and reflector against a real etcd: resume, relist, malformed values.

mod common;

use common::{fixtures::volume, Backend, Etcd};
use futures::{Stream, StreamExt};
use moor::api::*;
use moor::runtime::reflector;
use moor::runtime::watcher::{watcher, Event, WatchError};
use std::sync::Arc;
use std::time::Duration;

type Item = Result<Event<Volume>, WatchError>;

async fn next(stream: &mut (impl Stream<Item = Item> + Unpin)) -> Item {
    tokio::time::timeout(Duration::from_secs(30), stream.next())
        .await
        .expect("the watcher yielded nothing for 30 s")
        .expect("the watcher stream never ends")
}

/// Polls until an Ok event, collecting errors on the way, for at most 60 s (a stream
/// that only ever errs fails the test, never hangs it).
async fn next_event(
    stream: &mut (impl Stream<Item = Item> + Unpin),
    errors: &mut Vec<WatchError>,
) -> Event<Volume> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        match next(stream).await {
            Ok(ev) => return ev,
            Err(e) => errors.push(e),
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no event in 60 s, only errors: {errors:?}"
        );
    }
}

fn names(objs: &[std::sync::Arc<Volume>]) -> Vec<String> {
    let mut n: Vec<String> = objs.iter().map(|v| v.metadata.name.to_string()).collect();
    n.sort();
    n
}

fn applied_name(ev: &Event<Volume>) -> Option<String> {
    match ev {
        Event::Applied(v) => Some(v.metadata.name.to_string()),
        _ => None,
    }
}

async fn lists_then_streams_changes_in_order(backend: Backend) {
    let etcd = Etcd::start_on(backend).await;
    let store = etcd.store("/t/").await;
    store.create(&volume("a")).await.unwrap();
    store.create(&volume("b")).await.unwrap();
    let mut w = Box::pin(watcher::<VolumeSpec>(
        store.clone(),
        moor::api::KeyScope::all(),
    ));
    let mut errors = Vec::new();
    match next_event(&mut w, &mut errors).await {
        Event::Restarted(objs) => assert_eq!(names(&objs), ["a", "b"]),
        other => panic!("expected the initial list, got {other:?}"),
    }
    let c = store.create(&volume("c")).await.unwrap();
    let mut a = store
        .get(&crate::common::key::<VolumeSpec>("volumes/default/a"))
        .await
        .unwrap();
    a.spec.capacity_max = Some(Size(4 << 30));
    store.replace(&a).await.unwrap();
    store
        .delete(&crate::common::key::<VolumeSpec>("volumes/default/b"), None)
        .await
        .unwrap();

    let ev = next_event(&mut w, &mut errors).await;
    assert_eq!(ev, Event::Applied(std::sync::Arc::new(c)));
    match next_event(&mut w, &mut errors).await {
        Event::Applied(v) => assert_eq!(v.spec.capacity_max, Some(Size(4 << 30))),
        other => panic!("{other:?}"),
    }
    match next_event(&mut w, &mut errors).await {
        Event::Deleted { key, last } => {
            assert_eq!(key, "volumes/default/b");
            assert_eq!(last.unwrap().metadata.name.as_str(), "b");
        }
        other => panic!("{other:?}"),
    }
    assert!(errors.is_empty(), "{errors:?}");
}

async fn resumes_after_etcd_is_killed_and_restarted_missing_nothing(backend: Backend) {
    let mut etcd = Etcd::start_on(backend).await;
    let store = etcd.store("/t/").await;
    store.create(&volume("a")).await.unwrap();
    let mut w = Box::pin(watcher::<VolumeSpec>(
        store.clone(),
        moor::api::KeyScope::all(),
    ));
    let mut errors = Vec::new();
    assert!(matches!(next_event(&mut w, &mut errors).await, Event::Restarted(v) if v.len() == 1));
    store.create(&volume("b")).await.unwrap();
    assert_eq!(
        applied_name(&next_event(&mut w, &mut errors).await).as_deref(),
        Some("b")
    );

    etcd.kill();
    // The broken connection surfaces as an error item; the stream goes on.
    assert!(next(&mut w).await.is_err());
    // While the watcher is not polled, etcd comes back and changes happen.
    etcd.restart().await;
    let writer = etcd.store("/t/").await;
    writer.create(&volume("c")).await.unwrap();
    writer.create(&volume("d")).await.unwrap();
    writer
        .delete(&crate::common::key::<VolumeSpec>("volumes/default/a"), None)
        .await
        .unwrap();

    let mut seen = Vec::new();
    while seen.len() < 3 {
        match next_event(&mut w, &mut errors).await {
            Event::Applied(v) => seen.push(format!("applied {}", v.metadata.name)),
            Event::Deleted { key, .. } => seen.push(format!("deleted {key}")),
            Event::Restarted(_) => panic!("it relisted instead of resuming from its revision"),
        }
    }
    assert_eq!(
        seen,
        ["applied c", "applied d", "deleted volumes/default/a"]
    );
    // Nothing is repeated afterwards: the next event is a fresh change.
    writer.create(&volume("e")).await.unwrap();
    assert_eq!(
        applied_name(&next_event(&mut w, &mut errors).await).as_deref(),
        Some("e")
    );
}

async fn relists_after_a_compaction_past_its_revision(backend: Backend) {
    let mut etcd = Etcd::start_on(backend).await;
    let store = etcd.store("/t/").await;
    store.create(&volume("a")).await.unwrap();
    store.create(&volume("b")).await.unwrap();
    let (reader, writer) = reflector::store::<Volume>();
    let mut w = Box::pin(reflector::reflector(
        writer,
        watcher::<VolumeSpec>(store.clone(), moor::api::KeyScope::all()),
    ));
    let mut errors = Vec::new();
    assert!(matches!(next_event(&mut w, &mut errors).await, Event::Restarted(v) if v.len() == 2));

    etcd.kill();
    assert!(next(&mut w).await.is_err());
    etcd.restart().await;
    let other = etcd.store("/t/").await;
    other.create(&volume("c")).await.unwrap();
    other
        .delete(&crate::common::key::<VolumeSpec>("volumes/default/a"), None)
        .await
        .unwrap();
    let latest = other
        .create(&volume("d"))
        .await
        .unwrap()
        .metadata
        .resource_version;
    other.compact(latest).await.unwrap();

    let mut errors = Vec::new();
    match next_event(&mut w, &mut errors).await {
        Event::Restarted(objs) => assert_eq!(names(&objs), ["b", "c", "d"]),
        other => panic!("expected a relist, got {other:?} after {errors:?}"),
    }
    assert!(
        errors
            .iter()
            .any(|e| matches!(e, WatchError::Compacted { .. })),
        "no compaction reported: {errors:?}"
    );
    let mut cached = reader.keys();
    cached.sort();
    assert_eq!(
        cached,
        [
            "volumes/default/b",
            "volumes/default/c",
            "volumes/default/d"
        ],
        "the reflector still holds a deleted object"
    );
}

async fn a_garbage_value_is_reported_and_skipped_while_the_rest_flows(backend: Backend) {
    let etcd = Etcd::start_on(backend).await;
    let store = etcd.store("/t/").await;
    let mut raw = etcd.raw_client().await;
    store.create(&volume("a")).await.unwrap();
    raw.put("/t/volumes/default/junk1", "\u{0}\u{1}binary", None)
        .await
        .unwrap();

    let mut w = Box::pin(watcher::<VolumeSpec>(
        store.clone(),
        moor::api::KeyScope::all(),
    ));
    // The list, then its garbage (a reader marks the garbage on the listed state).
    assert!(matches!(next(&mut w).await, Ok(Event::Restarted(v)) if names(&v) == ["a"]));
    match next(&mut w).await {
        Err(WatchError::Malformed(e)) => {
            assert!(e.to_string().contains("volumes/default/junk1"), "{e}")
        }
        other => panic!("expected the listed garbage after the list, got {other:?}"),
    }

    store.create(&volume("b")).await.unwrap();
    raw.put(
        "/t/volumes/default/junk2",
        r#"{"kind":"Volume","metadata":{"name":"junk2"},"spec":{}}"#,
        None,
    )
    .await
    .unwrap();
    store.create(&volume("c")).await.unwrap();
    assert_eq!(
        applied_name(&next(&mut w).await.unwrap()).as_deref(),
        Some("b")
    );
    match next(&mut w).await {
        Err(WatchError::Malformed(e)) => {
            let text = moor::process::error_chain(&e);
            assert!(text.contains("volumes/default/junk2"), "{text}");
            assert!(
                text.contains("plugin_id"),
                "the cause should say what is invalid: {text}"
            );
        }
        other => panic!("expected the garbage to be reported, got {other:?}"),
    }
    assert_eq!(
        applied_name(&next(&mut w).await.unwrap()).as_deref(),
        Some("c")
    );
}

async fn a_scoped_watcher_sees_only_its_node(backend: Backend) {
    let etcd = Etcd::start_on(backend).await;
    let store = etcd.store("/t/").await;
    let claim = |node: &str, name: &str| {
        let spec = ClaimSpec {
            allocation: AllocationId::new("a").unwrap(),
            request: Name::new("data").unwrap(),
            volume: VolumeId::new("v").unwrap(),
            node: NodeName::new(node).unwrap(),
            plugin_id: PluginId::new("p").unwrap(),
            ..Default::default()
        };
        Claim::new(&Namespace::default_ns(), Name::new(name).unwrap(), spec)
    };
    store.create(&claim("n1", "c1")).await.unwrap();
    store.create(&claim("n10", "c2")).await.unwrap();
    let mut w = Box::pin(watcher::<ClaimSpec>(
        store.clone(),
        Claim::node_scope(&NodeName::new("n1").unwrap()),
    ));
    match w.next().await.unwrap().unwrap() {
        Event::Restarted(objs) => {
            assert_eq!(objs.len(), 1);
            assert_eq!(objs[0].metadata.name.as_str(), "c1");
        }
        other => panic!("{other:?}"),
    }
    store.create(&claim("n10", "c3")).await.unwrap();
    store.create(&claim("n1", "c4")).await.unwrap();
    match w.next().await.unwrap().unwrap() {
        Event::Applied(c) => assert_eq!(c.metadata.name.as_str(), "c4"),
        other => panic!("{other:?}"),
    }
}

/// The informer watches without previous values (etcd reads none), yet a deletion
/// reaches subscribers with the object's last state, taken from its cache; a watcher
/// asked for no previous values gets none.
async fn an_informer_s_deletions_carry_the_last_state_from_its_cache(backend: Backend) {
    use moor::runtime::informer::Informer;
    let etcd = Etcd::start_on(backend).await;
    let store = etcd.store("/t/").await;
    let stop = tokio_util::sync::CancellationToken::new();
    let informer = Informer::<Volume>::spawn(store.clone(), KeyScope::all(), stop.clone());
    let mut sub = Box::pin(informer.subscribe());
    let mut lean = Box::pin(moor::runtime::watcher::watcher_with::<VolumeSpec>(
        store.clone(),
        KeyScope::all(),
        false,
    ));
    let timeout = |what: &'static str| move |_| panic!("no {what} within 30 s");
    let first = tokio::time::timeout(Duration::from_secs(30), sub.next()).await;
    assert!(matches!(
        first.unwrap_or_else(timeout("snapshot")),
        Some(Ok(Event::Restarted(_)))
    ));
    assert!(matches!(next(&mut lean).await, Ok(Event::Restarted(_))));
    let mut v = volume("v1");
    v.spec.parameters.insert("size".into(), "big".into());
    let created = store.create(&v).await.unwrap();
    store.delete(&created.object_key(), None).await.unwrap();
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(30), sub.next()).await;
        match ev.unwrap_or_else(timeout("deletion")) {
            Some(Ok(Event::Deleted { key, last })) => {
                assert_eq!(key, "volumes/default/v1");
                let last = last.expect("the informer fills the last state");
                assert_eq!(last.spec.parameters["size"], "big");
                break;
            }
            Some(Ok(Event::Applied(_))) => continue,
            other => panic!("expected the deletion, got {other:?}"),
        }
    }
    loop {
        match next(&mut lean).await {
            Ok(Event::Deleted { last, .. }) => {
                assert!(last.is_none(), "no previous values were asked for");
                break;
            }
            Ok(Event::Applied(_)) => continue,
            other => panic!("expected the deletion, got {other:?}"),
        }
    }
    stop.cancel();
}

async fn informed<K>(
    sub: &mut (impl Stream<Item = Result<Event<K>, moor::runtime::informer::InformerError>> + Unpin),
) -> Event<K> {
    tokio::time::timeout(Duration::from_secs(30), sub.next())
        .await
        .expect("an event within 30 s")
        .expect("the stream goes on")
        .expect("informers yield no errors")
}

/// Issue 27: a plugin's controller-node agent caches only its plugin's volumes. The
/// filtered informer lists and passes on only what it keeps; another plugin's changes
/// never reach a subscriber; a volume edited onto another plugin leaves as a deletion
/// carrying the last state this cache held. Issue 52: a filtered projection (what the
/// agent keeps of each volume) sees the same, as projections.
async fn a_filtered_informer_caches_and_passes_on_only_what_it_keeps(backend: Backend) {
    use moor::runtime::informer::Informer;
    let etcd = Etcd::start_on(backend).await;
    let store = etcd.store("/t/").await;
    let on = |name: &str, plugin: &str| {
        let mut v = volume(name);
        v.spec.plugin_id = PluginId::new(plugin).unwrap();
        v
    };
    store.create(&on("a1", "a.example")).await.unwrap();
    let b1 = store.create(&on("b1", "b.example")).await.unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let informer = Informer::<Volume>::spawn_filtered(
        store.clone(),
        KeyScope::all(),
        std::sync::Arc::new(|v: &Volume| v.spec.plugin_id.as_str() == "a.example"),
        stop.clone(),
    );
    /// A volume's key, all this projection keeps.
    #[derive(Clone, Debug, PartialEq)]
    struct Keyed(String);
    impl moor::runtime::Resource for Keyed {
        fn key(&self) -> String {
            self.0.clone()
        }
    }
    let names_of = |v: Volume| Keyed(v.key());
    let projected = Informer::<Keyed>::spawn_projected(
        store.clone(),
        KeyScope::all(),
        Some(std::sync::Arc::new(|v: &Volume| {
            v.spec.plugin_id.as_str() == "a.example"
        })),
        names_of,
        stop.clone(),
    );
    let mut sub = Box::pin(informer.subscribe());
    match informed(&mut sub).await {
        Event::Restarted(all) => assert_eq!(names(&all), ["a1"]),
        other => panic!("expected the cache first, got {other:?}"),
    }
    let mut projected_sub = Box::pin(projected.subscribe());
    match informed(&mut projected_sub).await {
        Event::Restarted(all) => {
            assert_eq!(
                all,
                [std::sync::Arc::new(Keyed("volumes/default/a1".into()))]
            )
        }
        other => panic!("expected the projected cache first, got {other:?}"),
    }
    // b's volume changes, then a2 is created: the first event seen is a2's.
    let mut b1_next = b1.clone();
    b1_next.spec.capacity_max = Some(Size(2 << 30));
    store.replace(&b1_next).await.unwrap();
    store.create(&on("b2", "b.example")).await.unwrap();
    store.create(&on("a2", "a.example")).await.unwrap();
    assert_eq!(
        applied_name(&informed(&mut sub).await).as_deref(),
        Some("a2")
    );
    let reader = informer.reader();
    let mut cached = reader.keys();
    cached.sort();
    assert_eq!(cached, ["volumes/default/a1", "volumes/default/a2"]);
    // a1 moved onto plugin b: gone from this cache, with its last state.
    store
        .modify_spec(
            &Volume::key_for(&Namespace::default_ns(), "a1"),
            |v: &mut VolumeSpec| {
                v.plugin_id = PluginId::new("b.example").unwrap();
                true
            },
        )
        .await
        .unwrap();
    match informed(&mut sub).await {
        Event::Deleted { key, last } => {
            assert_eq!(key, "volumes/default/a1");
            assert_eq!(
                last.expect("its last state").spec.plugin_id.as_str(),
                "a.example"
            );
        }
        other => panic!("expected a1 to leave, got {other:?}"),
    }
    assert_eq!(reader.keys(), ["volumes/default/a2"]);
    // The projection saw a2 arrive and a1 leave, and nothing of plugin b.
    match informed(&mut projected_sub).await {
        Event::Applied(v) => assert_eq!(v.0, "volumes/default/a2"),
        other => panic!("expected a2's projection, got {other:?}"),
    }
    match informed(&mut projected_sub).await {
        Event::Deleted { key, last } => {
            assert_eq!(key, "volumes/default/a1");
            assert_eq!(last.map(|v| v.0.clone()).as_deref(), Some(key.as_str()));
        }
        other => panic!("expected a1's projection to leave, got {other:?}"),
    }
    assert_eq!(projected.reader().keys(), ["volumes/default/a2"]);
    stop.cancel();
}

/// Issues 27 and 52: the controller's Mount cache keeps only what it reads. A
/// projected informer's list and its changes reach the cache and the subscribers as
/// projections, each at the revision of the object it came from, and a deletion passes
/// on the last projection.
async fn a_projected_informer_caches_and_passes_on_projections(backend: Backend) {
    use moor::runtime::informer::Informer;
    #[derive(Clone, Debug, PartialEq)]
    struct Seen {
        key: String,
        version: i64,
        path: Option<String>,
    }
    impl moor::runtime::Resource for Seen {
        fn key(&self) -> String {
            self.key.clone()
        }
        fn version(&self) -> i64 {
            self.version
        }
    }
    fn seen(v: &Volume) -> Seen {
        Seen {
            key: v.key(),
            version: v.metadata.resource_version,
            path: v.spec.context.get("path").cloned(),
        }
    }
    let etcd = Etcd::start_on(backend).await;
    let store = etcd.store("/t/").await;
    let with_context = |name: &str| {
        let mut v = volume(name);
        v.spec.context = [("path".to_string(), format!("/srv/{name}"))]
            .into_iter()
            .collect();
        v
    };
    let a1 = store.create(&with_context("a1")).await.unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let informer = Informer::spawn_projected(
        store.clone(),
        KeyScope::all(),
        None,
        |v| seen(&v),
        stop.clone(),
    );
    let mut sub = Box::pin(informer.subscribe());
    match informed(&mut sub).await {
        Event::Restarted(all) => assert_eq!(all, [Arc::new(seen(&a1))]),
        other => panic!("expected the cache first, got {other:?}"),
    }
    let a2 = store.create(&with_context("a2")).await.unwrap();
    match informed(&mut sub).await {
        Event::Applied(v) => {
            assert_eq!(*v, seen(&a2));
            assert_eq!(v.path.as_deref(), Some("/srv/a2"));
        }
        other => panic!("expected a2, got {other:?}"),
    }
    let reader = informer.reader();
    assert_eq!(reader.get(&a1.key()), Some(Arc::new(seen(&a1))));
    assert_eq!(
        reader.get(&a2.key()).map(|s| s.version),
        Some(a2.metadata.resource_version)
    );
    store.delete(&a1.object_key(), None).await.unwrap();
    match informed(&mut sub).await {
        Event::Deleted { key, last } => {
            assert_eq!(key, a1.key());
            assert_eq!(last, Some(Arc::new(seen(&a1))));
        }
        other => panic!("expected a1's deletion, got {other:?}"),
    }
    assert!(reader.get(&a1.key()).is_none());
    stop.cancel();
}

crate::both_stores!(
    a_projected_informer_caches_and_passes_on_projections,
    a_filtered_informer_caches_and_passes_on_only_what_it_keeps,
    an_informer_s_deletions_carry_the_last_state_from_its_cache,
    lists_then_streams_changes_in_order,
    resumes_after_etcd_is_killed_and_restarted_missing_nothing,
    relists_after_a_compaction_past_its_revision,
    a_garbage_value_is_reported_and_skipped_while_the_rest_flows,
    a_scoped_watcher_sees_only_its_node,
);
