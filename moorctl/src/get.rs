//! `moorctl get KIND [NAME] [-o table|wide|json|yaml] [-w] [-l SELECTOR] [-n NS | -A]`.

use futures::StreamExt;
use serde_json::Value;

use super::kind::{self, redact, with_spec, Kind, Selector};
use super::table::{columns, render_row, table};
use super::{Ctx, NsArgs, Refused};
use moor::api::*;
use moor::runtime::watcher::{watcher, Event};

/// Output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// Columns.
    Table,
    /// More columns.
    Wide,
    /// The objects as JSON.
    Json,
    /// The objects as YAML.
    Yaml,
}

/// List objects, or show one.
#[derive(Debug, clap::Args)]
pub struct Get {
    /// The kind (volume, allocation, claim, attachment, mount, node, plugin, event).
    #[arg(value_parser = crate::kind::KindParser, hide_possible_values = true)]
    pub kind: Kind,
    /// One object's name.
    pub name: Option<String>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value = "table")]
    pub output: Output,
    /// After listing, print changes as they happen (until interrupted).
    #[arg(short = 'w', long)]
    pub watch: bool,
    /// Only objects whose labels match (k=v, k!=v, k, !k; comma-separated).
    #[arg(short = 'l', long)]
    pub selector: Option<Selector>,
    /// Print secrets and mount flags instead of `[redacted]`.
    #[arg(long)]
    pub show_secrets: bool,
    /// With mounts: only those a node keeps although desired state lost their claims
    /// (an older etcd snapshot restored); `moorctl mount adopt` or `release` each.
    #[arg(long)]
    pub orphaned: bool,
    /// Namespace selection.
    #[command(flatten)]
    pub ns: NsArgs,
}

impl Get {
    fn wanted(&self, v: &Value) -> bool {
        self.name
            .as_deref()
            .is_none_or(|n| v.pointer("/metadata/name").and_then(Value::as_str) == Some(n))
            && self.selector.as_ref().is_none_or(|s| s.matches(v))
            && (!self.orphaned || v.pointer("/status/orphan").is_some())
    }

    fn prepare(&self, mut v: Value) -> anyhow::Result<Value> {
        if self.show_secrets {
            kind::revealable(&v)?;
        } else {
            redact(&mut v);
        }
        Ok(v)
    }

    /// Why a named object was not found: the namespace looked in, and the namespaces
    /// that hold one of that name, when the identity may list them (else `-A`).
    async fn not_found(&self, ctx: &Ctx, name: &str, ns: Option<&Namespace>) -> String {
        let kind = self.kind;
        let Some(ns) = ns.filter(|_| kind.namespaced()) else {
            return format!("{kind} {name} not found");
        };
        let elsewhere: Vec<String> = match kind::list(ctx, kind, None).await {
            Ok((items, _)) => items
                .iter()
                .filter(|v| v.pointer("/metadata/name").and_then(Value::as_str) == Some(name))
                .filter_map(|v| v.pointer("/metadata/namespace").and_then(Value::as_str))
                .map(str::to_string)
                .collect(),
            Err(_) => Vec::new(),
        };
        match elsewhere.as_slice() {
            [] => format!(
                "{kind} {name} not found in namespace {ns} (-n NAMESPACE looks in another, -A in every one)"
            ),
            [one] => format!(
                "{kind} {name} not found in namespace {ns}; namespace {one} has one (-n {one})"
            ),
            many => format!(
                "{kind} {name} not found in namespace {ns}; namespaces {} have one (-n NAMESPACE, or -A)",
                many.join(", ")
            ),
        }
    }

    /// Prints the objects; exit code 1 when a named object does not exist.
    pub async fn run(self, ctx: &Ctx) -> anyhow::Result<i32> {
        match (self.orphaned, self.kind) {
            (false, _) | (true, Kind::Mount) => {}
            (true, Kind::Volume) => return self.unknown_volumes(ctx).await,
            (true, _) => {
                return Err(Refused("--orphaned applies to mounts and volumes".into()).into())
            }
        }
        let ns = self.ns.filter()?;
        let (items, listed_at) = kind::list(ctx, self.kind, ns.as_ref()).await?;
        let mut items: Vec<Value> = items
            .into_iter()
            .filter(|v| self.wanted(v))
            .map(|v| self.prepare(v))
            .collect::<anyhow::Result<_>>()?;
        sort(self.kind, &mut items);
        if let (Some(name), true) = (&self.name, items.is_empty()) {
            if !self.watch {
                return Err(Refused(self.not_found(ctx, name, ns.as_ref()).await).into());
            }
        }
        let all_ns = self.ns.all_namespaces;
        match self.output {
            Output::Table | Output::Wide => {
                if items.is_empty() && !self.watch {
                    eprintln!("No {}s found.", self.kind);
                } else {
                    out!(
                        "{}",
                        table(self.kind, &items, self.output == Output::Wide, all_ns)
                    );
                }
            }
            Output::Json | Output::Yaml => {
                let doc = match (&self.name, items.len()) {
                    (Some(_), 1) => items.remove(0),
                    _ => {
                        serde_json::json!({"apiVersion": API_VERSION, "kind": "List", "items": items})
                    }
                };
                print_doc(self.output, &doc)?;
            }
        }
        if !self.watch {
            return Ok(0);
        }
        with_spec!(self.kind, S => {
            let scope = ns
                .as_ref()
                .and_then(KeyScope::<S>::namespace)
                .unwrap_or_else(KeyScope::all);
            self.follow::<S>(ctx, scope, ns.as_ref(), listed_at).await
        })
    }

    /// `get volumes --orphaned`: the volumes each plugin lists that moor does not know,
    /// as the agent leading its controller last surveyed them.
    async fn unknown_volumes(&self, ctx: &Ctx) -> anyhow::Result<i32> {
        if self.watch || self.name.is_some() {
            return Err(Refused(
                "get volumes --orphaned lists every plugin's report; it takes no name and no -w"
                    .into(),
            )
            .into());
        }
        let plugins = ctx.store.list(&KeyScope::<PluginSpec>::all()).await?;
        let mut rows = Vec::new();
        for p in &plugins.items {
            let id = match PluginId::new(p.metadata.name.as_str()) {
                Ok(id) => id,
                Err(_) => continue,
            };
            match ctx.store.unknown_volumes(&id).await {
                Ok(Some(report)) => rows.push((id, report)),
                Ok(None) => {}
                Err(e) => eprintln!("moorctl: plugin {id}: {e}"),
            }
        }
        if matches!(self.output, Output::Json | Output::Yaml) {
            let items: Vec<Value> = rows
                .iter()
                .map(|(id, r)| serde_json::json!({"plugin": id, "volumes": r.volumes, "more": r.more}))
                .collect();
            print_doc(self.output, &serde_json::json!({"items": items}))?;
            return Ok(0);
        }
        if rows.iter().all(|(_, r)| r.volumes.is_empty()) {
            eprintln!("No volumes unknown to moor are listed by any plugin.");
            return Ok(0);
        }
        outln!("PLUGIN\tVOLUME ID\tCAPACITY\tPUBLISHED TO");
        for (id, r) in &rows {
            for v in &r.volumes {
                let nodes = if v.published_nodes.is_empty() {
                    "-".to_string()
                } else {
                    v.published_nodes.join(",")
                };
                outln!("{id}\t{}\t{}\t{nodes}", v.volume_id, v.capacity_bytes);
            }
            if r.more > 0 {
                outln!("{id}\t(and {} more)\t\t", r.more);
            }
        }
        Ok(0)
    }

    /// Prints each change after the list printed (at revision `listed_at`).
    async fn follow<S: Spec>(
        &self,
        ctx: &Ctx,
        scope: KeyScope<S>,
        ns: Option<&Namespace>,
        listed_at: i64,
    ) -> anyhow::Result<i32> {
        let mut stream: kind::Watch<S> = Box::pin(watcher::<S>(ctx.store.clone(), scope));
        let mut trouble = crate::Trouble::default();
        // The first lists (printed already): one, or one per part followed.
        let mut first = 1;
        let mut whole = true;
        while let Some(item) = stream.next().await {
            let (obj, deleted) = match item {
                // The watch's own first list (one per part followed): what changed
                // since the printed list was read is printed, the rest was.
                Ok(Event::Restarted(objs)) if first > 0 => {
                    first -= 1;
                    for obj in objs
                        .iter()
                        .filter(|o| o.metadata.resource_version > listed_at)
                    {
                        self.print_change(obj, false, ns)?;
                    }
                    continue;
                }
                // Refused the whole kind (a person's role): the namespace's parts.
                Err(e) if whole => match kind::part_watch::<S>(ctx, ns, e).await? {
                    Ok((parts, n)) => {
                        (stream, first, whole) = (parts, n, false);
                        continue;
                    }
                    Err(e) => {
                        whole = false;
                        trouble.say(ctx, "watch: ", &e.into(), "watching again");
                        continue;
                    }
                },
                // After a relist the full set is printed again.
                Ok(Event::Restarted(objs)) => {
                    for obj in objs {
                        self.print_change(&obj, false, ns)?;
                    }
                    continue;
                }
                Ok(Event::Applied(obj)) => (obj, false),
                Ok(Event::Deleted {
                    last: Some(obj), ..
                }) => (obj, true),
                Ok(Event::Deleted { last: None, key }) => {
                    eprintln!("{} deleted", printable(&key));
                    continue;
                }
                Err(e) => {
                    trouble.say(ctx, "watch: ", &e.into(), "watching again");
                    continue;
                }
            };
            self.print_change(&obj, deleted, ns)?;
        }
        Ok(0)
    }

    fn print_change<S: Spec>(
        &self,
        obj: &Object<S>,
        deleted: bool,
        ns: Option<&Namespace>,
    ) -> anyhow::Result<()> {
        if S::NAMESPACED && ns.is_some_and(|ns| &obj.metadata.namespace != ns) {
            return Ok(());
        }
        let v = serde_json::to_value(obj)?;
        if !self.wanted(&v) {
            return Ok(());
        }
        let v = self.prepare(v)?;
        match self.output {
            Output::Table | Output::Wide => {
                let cols = columns(self.kind, self.output == Output::Wide);
                let mut row: Vec<String> = Vec::new();
                if self.ns.all_namespaces && self.kind.namespaced() {
                    row.push(kind::text(&v, "/metadata/namespace"));
                }
                row.extend(cols.iter().map(|c| (c.cell)(&v)));
                if deleted {
                    row.push("(deleted)".into());
                }
                outln!("{}", render_row(&row));
            }
            Output::Json | Output::Yaml => print_doc(self.output, &v)?,
        }
        Ok(())
    }
}

/// Sorts by namespace and name; events by time.
pub fn sort(kind: Kind, items: &mut [Value]) {
    if kind == Kind::Event {
        items.sort_by_key(|v| kind::text(v, "/spec/time"));
    } else {
        items.sort_by_key(|v| {
            (
                kind::text(v, "/metadata/namespace"),
                kind::text(v, "/metadata/name"),
            )
        });
    }
}

/// Prints one document as JSON or YAML.
pub fn print_doc(output: Output, doc: &Value) -> anyhow::Result<()> {
    match output {
        Output::Yaml => {
            outln!("---");
            out!("{}", serde_yaml_ng::to_string(doc)?);
        }
        _ => outln!(
            "{}",
            crate::out::json_safe(&serde_json::to_string_pretty(doc)?)
        ),
    }
    Ok(())
}
