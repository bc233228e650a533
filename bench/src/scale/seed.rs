//! Seeding a big cluster fast: the objects of a few real claims read back as templates,
//! then written again under new names and uids straight into the store (as the
//! controller and agents would have left them), and checked before the scale run.

use super::*;

/// `per_node` volumes created through the plugin and as many allocations claiming them
/// on each real node, until every claim is Published.
pub(super) async fn create_real(
    store: &Store,
    per_node: usize,
    timeout: Duration,
) -> anyhow::Result<()> {
    let n = REAL_NODES.len() * per_node;
    phases::create_volumes_named(store, cluster::PLUGIN_ID, (0..n).map(volume_name)).await?;
    let tracker = phases::Tracker::spawn(store);
    let allocs = (0..n)
        .map(|i| {
            let node = NodeName::new(node_name(i / per_node))?;
            phases::allocation_named(&allocation_name(i), &volume_name(i), &node)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    phases::write_allocations(store, allocs).await?;
    // The tracker groups claims by the allocation name before its `-`: `sa`.
    tracker
        .until("every real claim published", timeout, |t| {
            t.claims("sa", ClaimPhase::Published) >= n
        })
        .await
}

/// One stored object of claim 0's: its key below the prefix and its value.
#[derive(Debug, Clone)]
pub(super) struct Template {
    key: String,
    value: String,
}

/// Everything the system stored about claim 0 (and the node `sn0000`), and the uids in
/// it that must differ per copy.
pub(super) struct Templates {
    objects: Vec<Template>,
    node: Template,
    uids: BTreeSet<String>,
}

impl Templates {
    /// The bytes of the template objects' values, by kind directory.
    pub(super) fn bytes_by_kind(&self) -> BTreeMap<String, usize> {
        let mut by_kind = BTreeMap::new();
        for t in &self.objects {
            let dir = t.key.split('/').next().unwrap_or_default().to_string();
            *by_kind.entry(dir).or_default() += t.value.len();
        }
        by_kind
    }
}

pub(super) async fn read_templates(store: &Store) -> anyhow::Result<Templates> {
    let (v0, a0) = (
        format!("\"{}\"", volume_name(0)),
        format!("\"{}\"", allocation_name(0)),
    );
    let mut objects = Vec::new();
    let mut node = None;
    let node_key = Node::key_for(&NodeName::new(node_name(0))?).to_string();
    store
        .scan(KeyScope::<NodeSpec>::all().as_str(), |key, value, _| {
            if key == node_key {
                node = Some(Template {
                    key: key.to_string(),
                    value: String::from_utf8_lossy(value).into_owned(),
                });
            }
        })
        .await?;
    for dir in [
        KeyScope::<VolumeSpec>::all().as_str().to_owned(),
        KeyScope::<AllocationSpec>::all().as_str().to_owned(),
        KeyScope::<ClaimSpec>::all().as_str().to_owned(),
        KeyScope::<MountSpec>::all().as_str().to_owned(),
        KeyScope::<AttachmentSpec>::all().as_str().to_owned(),
    ] {
        store
            .scan(&dir, |key, value, _| {
                let value = String::from_utf8_lossy(value);
                // Claim 0's objects: they name its volume or allocation as a whole
                // string (other claims' objects never contain `"sv000000"`).
                if value.contains(&v0) || value.contains(&a0) {
                    objects.push(Template {
                        key: key.to_string(),
                        value: value.into_owned(),
                    });
                }
            })
            .await?;
    }
    let mut uids = BTreeSet::new();
    for t in &objects {
        let obj: serde_json::Value = serde_json::from_str(&t.value)
            .with_context(|| format!("template {} is not JSON", t.key))?;
        if let Some(uid) = obj["metadata"]["uid"].as_str() {
            uids.insert(uid.to_string());
        }
    }
    let node = node.context("the real node's Node object is missing")?;
    let kinds: BTreeSet<&str> = objects
        .iter()
        .map(|t| t.key.split('/').next().unwrap_or_default())
        .collect();
    for needed in [
        VolumeSpec::DIR,
        AllocationSpec::DIR,
        ClaimSpec::DIR,
        MountSpec::DIR,
    ] {
        anyhow::ensure!(
            kinds.contains(needed),
            "no {needed} object for claim 0 among {kinds:?}"
        );
    }
    Ok(Templates {
        objects,
        node,
        uids,
    })
}

/// Claim 0's text made claim `i`'s on `node`: names, node and uids replaced.
pub(super) fn copy_of(text: &str, uids: &BTreeSet<String>, i: usize, node: &str) -> String {
    let mut out = text
        .replace(&volume_name(0), &volume_name(i))
        .replace(&allocation_name(0), &allocation_name(i))
        .replace(&node_name(0), node);
    for uid in uids {
        // Same length and shape: the last 12 characters become the copy's number.
        let keep = uid.len().saturating_sub(12);
        let new = format!("{}{:012x}", &uid[..keep], i);
        out = out.replace(uid.as_str(), &new);
    }
    out
}

/// Writes the copies for `range` (and the simulated nodes), 64 keys per txn, 8 txns
/// in flight, each batch made as it is sent (a million claims' copies would otherwise
/// be held at once). Returns the keys written.
pub(super) async fn seed(
    store: &Store,
    t: &Templates,
    range: std::ops::Range<usize>,
    per_node: usize,
    lease: moor::store::LeaseId,
) -> anyhow::Result<usize> {
    let prefix = store.prefix().to_string();
    // The Node objects of the simulated nodes in the range (the real ones keep theirs).
    let first = (range.start / per_node).max(REAL_NODES.len());
    let nodes: Vec<Put> = (first..range.end.div_ceil(per_node))
        .map(|n| {
            let name = node_name(n);
            (
                copy_of(&t.node.key, &BTreeSet::new(), 0, &name),
                copy_of(&t.node.value, &BTreeSet::new(), 0, &name),
                Some(lease.0),
            )
        })
        .collect();
    let total = nodes.len() + range.len() * t.objects.len();
    let per_batch = (64 / t.objects.len().max(1)).max(1);
    let claims = range.clone().step_by(per_batch).map(|from| {
        (from..(from + per_batch).min(range.end))
            .flat_map(|i| {
                let node = node_name(i / per_node);
                t.objects
                    .iter()
                    .map(move |o| {
                        (
                            copy_of(&o.key, &t.uids, i, &node),
                            copy_of(&o.value, &t.uids, i, &node),
                            None,
                        )
                    })
                    .collect::<Vec<Put>>()
            })
            .collect::<Vec<Put>>()
    });
    let node_batches: Vec<Vec<Put>> = nodes.chunks(64).map(|c| c.to_vec()).collect();
    stream::iter(node_batches.into_iter().chain(claims))
        .map(|batch| {
            let mut c = store.client();
            let prefix = prefix.clone();
            async move {
                let ops = batch
                    .into_iter()
                    .map(|(k, v, lease)| {
                        let opts = lease.map(|l| etcd_client::PutOptions::new().with_lease(l));
                        etcd_client::TxnOp::put(format!("{prefix}{k}"), v, opts)
                    })
                    .collect::<Vec<_>>();
                c.txn(etcd_client::Txn::new().and_then(ops)).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(8)
        .try_collect::<()>()
        .await?;
    Ok(total)
}

/// A key, its value and its lease.
type Put = (String, String, Option<i64>);

/// What a scan of one kind found: objects that decode, the first that did not, and the
/// claims among them that are Published.
#[derive(Default)]
struct Scanned {
    decoded: usize,
    first_bad: Option<String>,
    published: usize,
}

/// Every object of kind `S` decoded one page at a time, none kept.
async fn scan_kind<S: moor::api::Spec>(
    store: &Store,
    published: impl Fn(&moor::api::Object<S>) -> bool,
) -> anyhow::Result<Scanned> {
    let mut out = Scanned::default();
    let scope = moor::api::KeyScope::<S>::all();
    store
        .scan(scope.as_str(), |key, value, rev| {
            match store.codec().decode::<S>(key, value, rev) {
                Ok(obj) => {
                    out.decoded += 1;
                    out.published += usize::from(published(&obj));
                }
                Err(e) => {
                    out.first_bad.get_or_insert_with(|| e.to_string());
                }
            }
        })
        .await?;
    Ok(out)
}

/// Every copy decodes (read a page at a time, so a million of each are never held),
/// and the counts are what was asked.
pub(super) async fn check_seeded(store: &Store, n: usize) -> anyhow::Result<()> {
    let claims = scan_kind::<ClaimSpec>(store, |c| c.status.phase == ClaimPhase::Published).await?;
    let volumes = scan_kind::<VolumeSpec>(store, |_| false).await?;
    let allocs = scan_kind::<AllocationSpec>(store, |_| false).await?;
    let mounts = scan_kind::<MountSpec>(store, |_| false).await?;
    for (kind, s) in [
        ("claims", &claims),
        ("volumes", &volumes),
        ("allocations", &allocs),
        ("mounts", &mounts),
    ] {
        if let Some(e) = &s.first_bad {
            bail!("a seeded {kind} object does not decode: {e}");
        }
        if kind != "mounts" {
            anyhow::ensure!(s.decoded == n, "{} {kind} stored, {n} wanted", s.decoded);
        }
    }
    anyhow::ensure!(
        claims.published == n,
        "{}/{n} seeded claims published",
        claims.published
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_changes_names_node_and_uids_only() {
        let uid = "0b9c7a3e-1111-4222-8333-abcdefabcdef".to_string();
        let uids = BTreeSet::from([uid.clone()]);
        let text = format!(
            "{{\"name\":\"sv000000\",\"alloc\":\"sa-000000\",\"node\":\"sn0000\",\"uid\":\"{uid}\"}}"
        );
        let copy = copy_of(&text, &uids, 4242, "sn0004");
        assert_eq!(
            copy,
            "{\"name\":\"sv004242\",\"alloc\":\"sa-004242\",\"node\":\"sn0004\",\
             \"uid\":\"0b9c7a3e-1111-4222-8333-000000001092\"}"
        );
    }
}
