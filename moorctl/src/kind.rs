//! The few generic operations moorctl does on any kind (the registry of kinds is
//! `moor::api::Kind`), on objects as JSON values.

use std::str::FromStr;

use serde_json::Value;

use super::{Ctx, Refused};
use moor::api::*;
use moor::store::Deleted;

pub use moor::api::Kind;
pub(crate) use moor::with_spec;

/// The KIND argument of `get`, `describe` and `delete`: parsed as `Kind` parses (any
/// case, singular, plural or alias, with moor's own error), and offering every name
/// a kind goes by to shell completion (issue 78, item 7: `completion bash` completed
/// no kinds). Hidden from `--help`, where the list would drown the verb.
#[derive(Debug, Clone, Copy)]
pub struct KindParser;

impl clap::builder::TypedValueParser for KindParser {
    type Value = Kind;

    fn parse_ref(
        &self,
        _cmd: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<Kind, clap::Error> {
        let text = value.to_string_lossy();
        text.parse::<Kind>()
            .map_err(|e| clap::Error::raw(clap::error::ErrorKind::InvalidValue, format!("{e}\n")))
    }

    fn possible_values(
        &self,
    ) -> Option<Box<dyn Iterator<Item = clap::builder::PossibleValue> + '_>> {
        let names = Kind::ALL.iter().flat_map(|k| {
            std::iter::once(k.dir())
                .chain(k.aliases().iter().copied())
                .map(clap::builder::PossibleValue::new)
        });
        Some(Box::new(names))
    }
}

/// Objects of a kind, as JSON, in one namespace (or all); malformed values are
/// reported on stderr and skipped. Also returns the revision the list is at.
pub async fn list(
    ctx: &Ctx,
    kind: Kind,
    ns: Option<&Namespace>,
) -> anyhow::Result<(Vec<Value>, i64)> {
    with_spec!(kind, S => list_typed::<S>(ctx, ns).await)
}

async fn list_typed<S: Spec>(
    ctx: &Ctx,
    ns: Option<&Namespace>,
) -> anyhow::Result<(Vec<Value>, i64)> {
    // Volumes, allocations, attachments and events are keyed by namespace first.
    let scope = ns
        .and_then(KeyScope::<S>::namespace)
        .unwrap_or_else(KeyScope::all);
    let (items, malformed, revision) = match ctx.store.list(&scope).await {
        Ok(list) => (list.items, list.malformed, list.revision),
        // The kind is keyed by node, writer or plugin first, and this identity may read
        // only the namespace's part under each (a person's view or edit role): those.
        Err(e) if e.is_permission_denied() => match ns {
            Some(ns) => namespace_parts::<S>(ctx, ns, e).await?,
            None => return Err(e.into()),
        },
        Err(e) => return Err(e.into()),
    };
    for bad in &malformed {
        eprintln!(
            "warning: skipped a malformed value: {}",
            moor::api::printable_bounded(&bad.to_string(), 300)
        );
    }
    let mut out = Vec::with_capacity(items.len());
    for obj in items {
        if S::NAMESPACED && ns.is_some_and(|ns| &obj.metadata.namespace != ns) {
            continue;
        }
        out.push(serde_json::to_value(&obj)?);
    }
    Ok((out, revision))
}

/// Objects of a kind in every namespace; for an identity that may not read them all
/// (a person's role), those of `ns` when one is given, which is all it may be shown.
pub async fn list_readable(
    ctx: &Ctx,
    kind: Kind,
    ns: Option<&Namespace>,
) -> anyhow::Result<(Vec<Value>, i64)> {
    match list(ctx, kind, None).await {
        Err(e) if ns.is_some() && denied(&e) => list(ctx, kind, ns).await,
        other => other,
    }
}

/// Every object of a kind, typed; for an identity that may not read them all (a
/// person's role), namespace `ns`'s part of it. The flag says which was read: `true`
/// for every namespace.
pub async fn typed_readable<S: Spec>(
    ctx: &Ctx,
    ns: &Namespace,
) -> anyhow::Result<(Vec<Object<S>>, bool)> {
    match ctx.store.list(&KeyScope::<S>::all()).await {
        Ok(list) => Ok((list.items, true)),
        Err(e) if e.is_permission_denied() => {
            let items = match KeyScope::<S>::namespace(ns) {
                Some(scope) => ctx.store.list(&scope).await?.items,
                None => namespace_parts::<S>(ctx, ns, e).await?.0,
            };
            Ok((items, false))
        }
        Err(e) => Err(e.into()),
    }
}

/// Whether etcd refused the request for this identity.
pub fn denied(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<moor::store::StoreError>()
            .is_some_and(moor::store::StoreError::is_permission_denied)
    })
}

/// What [`list_typed`] returns: the objects, the malformed values, the revision.
type Listed<S> = (Vec<Object<S>>, Vec<moor::store::StoreError>, i64);

/// Namespace `ns`'s objects of a kind keyed by node, writer or plugin first, one part
/// at a time (`claims/NODE/NS/` for each node, `events/controller/NS/` and
/// `events/node/NODE/NS/`, `secrets/PLUGIN/NS/` for each plugin), for an identity
/// refused the whole kind (`denied`). Parts it may not read either (a node or plugin
/// its role does not name) are left out, said once on stderr; `denied` when every
/// part is refused. The revision is the oldest of the parts' (a watch from it misses none).
async fn namespace_parts<S: Spec>(
    ctx: &Ctx,
    ns: &Namespace,
    denied: moor::store::StoreError,
) -> anyhow::Result<Listed<S>> {
    let (items, malformed, revision, _) = read_parts::<S>(ctx, ns, denied).await?;
    Ok((items, malformed, revision))
}

/// The scopes of namespace `ns`'s parts of a kind keyed by node, writer or plugin
/// first that this identity reads (`denied`: the refusal of the whole kind, which
/// stands when it reads none): what a watch of the namespace follows, one part each
/// (the nodes and plugins as they are now; one added later is not followed).
pub async fn readable_parts<S: Spec>(
    ctx: &Ctx,
    ns: &Namespace,
    denied: moor::store::StoreError,
) -> anyhow::Result<Vec<KeyScope<S>>> {
    Ok(read_parts::<S>(ctx, ns, denied).await?.3)
}

/// A watch of a kind's objects, as `moorctl get -w` and `events -w` follow them.
pub type Watch<S> = std::pin::Pin<
    Box<
        dyn futures::Stream<
                Item = Result<
                    moor::runtime::watcher::Event<Object<S>>,
                    moor::runtime::watcher::WatchError,
                >,
            > + Send,
    >,
>;

/// When `failed` is etcd refusing this identity a watch of a whole kind keyed by
/// node, writer or plugin first, and a namespace is given: a watch of each part of
/// it the identity reads ([`readable_parts`]), merged, and how many first lists it
/// yields (each part's). Otherwise `failed`, as it was.
pub async fn part_watch<S: Spec>(
    ctx: &Ctx,
    ns: Option<&Namespace>,
    failed: moor::runtime::watcher::WatchError,
) -> anyhow::Result<Result<(Watch<S>, usize), moor::runtime::watcher::WatchError>> {
    use moor::runtime::watcher::WatchError;
    let (ns, denied) = match (ns, failed) {
        (Some(ns), WatchError::List(e)) if e.is_permission_denied() && !S::KEY_NAMESPACE_FIRST => {
            (ns, e)
        }
        (_, failed) => return Ok(Err(failed)),
    };
    let parts = readable_parts::<S>(ctx, ns, denied).await?;
    let n = parts.len();
    let watches = parts
        .into_iter()
        .map(|scope| Box::pin(moor::runtime::watcher::watcher(ctx.store.clone(), scope)));
    Ok(Ok((Box::pin(futures::stream::select_all(watches)), n)))
}

/// The first key segments of a kind keyed by node, writer or plugin first (each node;
/// the controller and each node for events; each plugin), and the revision they were
/// read at; `None` for a kind keyed by namespace first.
async fn firsts<S: Spec>(ctx: &Ctx) -> anyhow::Result<Option<(Vec<Vec<String>>, i64)>> {
    Ok(Some(match S::KIND {
        "Claim" | "Mount" => {
            let (nodes, at) = names::<NodeSpec>(ctx).await?;
            (nodes.into_iter().map(|n| vec![n]).collect(), at)
        }
        "Event" => {
            let (nodes, at) = names::<NodeSpec>(ctx).await?;
            let parts = std::iter::once(vec!["controller".to_string()])
                .chain(nodes.into_iter().map(|n| vec!["node".to_string(), n]))
                .collect();
            (parts, at)
        }
        _ if S::NAMESPACED && !S::KEY_NAMESPACE_FIRST => {
            let (plugins, at) = names::<PluginSpec>(ctx).await?;
            (plugins.into_iter().map(|p| vec![p]).collect(), at)
        }
        _ => return Ok(None),
    }))
}

/// [`namespace_parts`], with the scopes of the parts read.
async fn read_parts<S: Spec>(
    ctx: &Ctx,
    ns: &Namespace,
    denied: moor::store::StoreError,
) -> anyhow::Result<(
    Vec<Object<S>>,
    Vec<moor::store::StoreError>,
    i64,
    Vec<KeyScope<S>>,
)> {
    let Some((firsts, empty_at)) = firsts::<S>(ctx).await? else {
        return Err(denied.into());
    };
    let (mut items, mut malformed, mut revision, mut refused) = (Vec::new(), Vec::new(), 0, 0);
    let mut read = Vec::new();
    for first in &firsts {
        let mut parts: Vec<&dyn std::fmt::Display> =
            first.iter().map(|p| p as &dyn std::fmt::Display).collect();
        parts.push(ns);
        let scope = KeyScope::<S>::below(&parts);
        match ctx.store.list(&scope).await {
            Ok(list) => {
                read.push(scope);
                items.extend(list.items);
                malformed.extend(list.malformed);
                revision = if revision == 0 {
                    list.revision
                } else {
                    revision.min(list.revision)
                };
            }
            Err(e) if e.is_permission_denied() => refused += 1,
            Err(e) => return Err(e.into()),
        }
    }
    // Parts refused, none read: the refusal of the whole stands ("none found" would
    // not be true).
    if read.is_empty() && refused > 0 {
        return Err(denied.into());
    }
    if firsts.is_empty() {
        // No node yet: no claim, mount or node event of the namespace to show, to an
        // identity that reads the namespace (its volumes: every namespace role does).
        // A Secret is read under its plugin: with none registered, the refusal stands.
        let reads_namespace = match (S::KIND, KeyScope::<VolumeSpec>::namespace(ns)) {
            ("Claim" | "Mount", Some(scope)) => match ctx.store.list(&scope).await {
                Ok(_) => true,
                Err(e) if e.is_permission_denied() => false,
                Err(e) => return Err(e.into()),
            },
            _ => false,
        };
        if !reads_namespace {
            return Err(denied.into());
        }
        revision = empty_at;
    }
    if refused > 0 {
        eprintln!(
            "warning: {refused} of {} parts of namespace {ns}'s {} not readable by this identity (a node or plugin its role does not name): not shown",
            firsts.len(),
            S::DIR
        );
    }
    Ok((items, malformed, revision, read))
}

/// The names of the stored objects of a cluster-wide kind (nodes, plugins), and the
/// revision they were read at.
async fn names<S: Spec>(ctx: &Ctx) -> anyhow::Result<(Vec<String>, i64)> {
    let list = ctx.store.list(&KeyScope::<S>::all()).await?;
    let names = list
        .items
        .iter()
        .map(|o| o.metadata.name.to_string())
        .collect();
    Ok((names, list.revision))
}

/// The object of `kind` named `name` (in `ns` when namespaced), as JSON.
pub async fn find(
    ctx: &Ctx,
    kind: Kind,
    ns: Option<&Namespace>,
    name: &str,
) -> anyhow::Result<Option<Value>> {
    let ns = if kind.namespaced() { ns } else { None };
    if Name::new(name).is_err() {
        return Ok(None);
    }
    // Kinds keyed by (namespace and) name: one read. Other kinds' keys hold more than
    // the name: search the list.
    let direct = with_spec!(kind, S => match ObjectKey::<S>::named(ns, name) {
        Some(key) => Some(match ctx.store.try_get(&key).await? {
            Some(obj) => Some(serde_json::to_value(&obj)?),
            None => None,
        }),
        None => None,
    });
    if let Some(found) = direct {
        return Ok(found);
    }
    let (items, _) = list(ctx, kind, ns).await?;
    let mut found: Vec<Value> = items
        .into_iter()
        .filter(|v| v.pointer("/metadata/name").and_then(Value::as_str) == Some(name))
        .collect();
    if found.len() > 1 {
        // Two Secrets of one name for two plugins, say: never pick one.
        let keys: Vec<String> = found
            .iter()
            .filter_map(|v| {
                with_spec!(kind, S => serde_json::from_value::<Object<S>>(v.clone()).ok().map(|o| o.key()))
            })
            .collect();
        return Err(Refused(format!(
            "{kind} {name} names {} objects ({}); delete or edit them through a manifest",
            found.len(),
            keys.join(", ")
        ))
        .into());
    }
    Ok(found.pop())
}

/// The key of the object named `name`.
pub async fn find_key(
    ctx: &Ctx,
    kind: Kind,
    ns: Option<&Namespace>,
    name: &str,
) -> anyhow::Result<Option<String>> {
    let Some(found) = find(ctx, kind, ns, name).await? else {
        return Ok(None);
    };
    with_spec!(kind, S => {
        let obj: Object<S> = serde_json::from_value(found)?;
        Ok(Some(obj.key()))
    })
}

/// Deletes by key (as [`find_key`] gave it); returns the finalizers still holding it
/// (empty: gone).
pub async fn delete(ctx: &Ctx, kind: Kind, key: &str) -> anyhow::Result<Vec<String>> {
    with_spec!(kind, S => match ctx.store.delete(&ObjectKey::<S>::parse(key)?, None).await? {
        Deleted::Gone => Ok(Vec::new()),
        Deleted::Finalizing(obj) => Ok(obj.metadata.finalizers.iter().map(|f| f.to_string()).collect()),
    })
}

pub use moor::api::redact_json as redact;

fn is_secrets(field: &str) -> bool {
    moor::api::is_secrets_field(field)
}

/// Refuses to print secrets this moorctl could not open: `--show-secrets` shows them
/// only to an identity that holds the key file.
pub fn revealable(v: &Value) -> Result<(), Refused> {
    fn sealed_key(v: &Value) -> Option<String> {
        match v {
            Value::Object(map) => map.iter().find_map(|(k, child)| match child {
                Value::String(s) if is_secrets(k) => {
                    moor::api::sealed_key_id(s).map(str::to_string)
                }
                _ => sealed_key(child),
            }),
            Value::Array(items) => items.iter().find_map(sealed_key),
            _ => None,
        }
    }
    match sealed_key(v) {
        None => Ok(()),
        Some(id) => Err(Refused(format!(
            "{} {}: its secrets are encrypted with key {id:?}, which this moorctl does not hold; --show-secrets needs the cluster's key file (--encryption-key-file or MOOR_ENCRYPTION_KEY_FILE)",
            text(v, "/kind"),
            text(v, "/metadata/name")
        ))),
    }
}

/// A string at a JSON pointer ("" when absent; numbers and booleans as text).
pub fn text(v: &Value, pointer: &str) -> String {
    match v.pointer(pointer) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => String::new(),
        Some(other) => other.to_string(),
    }
}

/// A label selector: `k=v`, `k!=v`, `k` (present), `!k` (absent), comma-separated.
#[derive(Debug, Clone)]
pub struct Selector(Vec<(String, Op)>);

#[derive(Debug, Clone)]
enum Op {
    Eq(String),
    Ne(String),
    Exists,
    Absent,
}

impl FromStr for Selector {
    type Err = String;

    fn from_str(s: &str) -> Result<Selector, String> {
        let mut terms = Vec::new();
        for term in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let parsed = if let Some((k, v)) = term.split_once("!=") {
                (k.trim().to_string(), Op::Ne(v.trim().to_string()))
            } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
                (k.trim().to_string(), Op::Eq(v.trim().to_string()))
            } else if let Some(k) = term.strip_prefix('!') {
                (k.trim().to_string(), Op::Absent)
            } else {
                (term.to_string(), Op::Exists)
            };
            if parsed.0.is_empty() {
                return Err(format!("selector term {term:?} has no label key"));
            }
            terms.push(parsed);
        }
        Ok(Selector(terms))
    }
}

impl Selector {
    /// Whether an object's labels match every term.
    pub fn matches(&self, v: &Value) -> bool {
        let labels = v.pointer("/metadata/labels");
        self.0.iter().all(|(k, op)| {
            let have = labels.and_then(|l| l.get(k)).and_then(Value::as_str);
            match op {
                Op::Eq(want) => have == Some(want.as_str()),
                Op::Ne(want) => have != Some(want.as_str()),
                Op::Exists => have.is_some(),
                Op::Absent => have.is_none(),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redaction_reaches_nested_secrets_and_flags() {
        let mut v = serde_json::json!({
            "spec": {"secrets": {"password": "hunter2"}, "node_secrets": {"token": "t0ken"},
                     "mount_options": {"fs_type": "ext4", "mount_flags": ["noatime", "ro"]},
                     "volumes": [{"mount_options": {"mount_flags": ["x"]}}]}
        });
        redact(&mut v);
        let s = v.to_string();
        assert!(
            !s.contains("hunter2")
                && !s.contains("t0ken")
                && !s.contains("noatime")
                && !s.contains("\"x\""),
            "{s}"
        );
        assert!(s.contains("ext4"), "{s}");
    }

    #[test]
    fn selectors_match_labels() {
        let v = serde_json::json!({"metadata": {"labels": {"app": "db", "tier": "gold"}}});
        let sel = |s: &str| s.parse::<Selector>().unwrap().matches(&v);
        assert!(sel("app=db"));
        assert!(sel("app=db,tier"));
        assert!(!sel("app=web"));
        assert!(sel("app!=web,!missing"));
        assert!(!sel("!app"));
        assert!("=x".parse::<Selector>().is_err());
    }
}
