//! `moorctl events [-w] [--for KIND/NAME]`: the reconciliation events as they happen.

use futures::StreamExt;
use serde_json::Value;

use super::get::sort;
use super::kind::{self, text, Kind};
use super::sources::{hidden_note, node_source, Placement};
use super::table::{columns, render, render_row};
use super::{Ctx, NsArgs};
use moor::api::EventSpec;
use moor::runtime::watcher::{watcher, Event};

/// The reconciliation events.
#[derive(Debug, clap::Args)]
pub struct Events {
    /// After the stored events, print new ones as they happen (until interrupted).
    #[arg(short = 'w', long)]
    pub watch: bool,
    /// Only events about this object, e.g. `volume/db-data`.
    #[arg(long = "for")]
    pub for_object: Option<String>,
    /// Namespace selection (of the objects the events are about).
    #[command(flatten)]
    pub ns: NsArgs,
    /// Also events a node wrote about an object that is not on it (any node may
    /// write an event about any object; by default they are counted, not shown).
    #[arg(long)]
    pub all_sources: bool,
}

struct Filter {
    kind: Option<Kind>,
    name: Option<String>,
    ns: Option<String>,
}

impl Filter {
    fn matches(&self, v: &Value) -> bool {
        // About the object, or related to it (a node's Mount event for a claim).
        ["/spec/object", "/spec/related"].iter().any(|at| {
            let object_ns = text(v, &format!("{at}/namespace"));
            v.pointer(at).is_some_and(|o| !o.is_null())
                && self
                    .kind
                    .is_none_or(|k| text(v, &format!("{at}/kind")) == k.name())
                && self
                    .name
                    .as_ref()
                    .is_none_or(|n| &text(v, &format!("{at}/name")) == n)
                // Events about cluster-wide objects (nodes, plugins) show in every
                // namespace.
                && self
                    .ns
                    .as_ref()
                    .is_none_or(|ns| object_ns.is_empty() || &object_ns == ns)
        })
    }
}

/// A row with the SOURCE column: which writer said it.
fn row(v: &Value) -> Vec<String> {
    columns(Kind::Event, true)
        .iter()
        .map(|c| (c.cell)(v))
        .collect()
}

impl Events {
    /// Prints the events, oldest first.
    pub async fn run(self, ctx: &Ctx) -> anyhow::Result<i32> {
        let (kind, name) = match &self.for_object {
            Some(f) => {
                let (k, n) = f
                    .split_once('/')
                    .ok_or_else(|| anyhow::anyhow!("--for takes KIND/NAME, e.g. volume/db-data"))?;
                (
                    Some(k.parse::<Kind>().map_err(anyhow::Error::msg)?),
                    Some(n.to_string()),
                )
            }
            None => (None, None),
        };
        let ns = self.ns.filter()?;
        let filter = Filter {
            kind,
            name,
            ns: ns.as_ref().map(|n| n.to_string()),
        };
        let (events, _) = kind::list_readable(ctx, Kind::Event, ns.as_ref()).await?;
        let mut placement = Placement::load(ctx, ns.as_ref()).await?;
        let mut hidden = 0;
        let mut events: Vec<Value> = events
            .into_iter()
            .filter(|v| filter.matches(v))
            .filter(|v| {
                let shown = self.all_sources || placement.shown(v);
                hidden += usize::from(!shown);
                shown
            })
            .collect();
        sort(Kind::Event, &mut events);
        let headers: Vec<&str> = columns(Kind::Event, true)
            .iter()
            .map(|c| c.header)
            .collect();
        let rows: Vec<Vec<String>> = events.iter().map(row).collect();
        out!("{}", render(&headers, &rows));
        if let Some(note) = hidden_note(hidden) {
            eprintln!("{note}");
        }
        if !self.watch {
            return Ok(0);
        }
        let seen: std::collections::HashSet<String> =
            events.iter().map(|v| text(v, "/metadata/uid")).collect();
        let mut loaded = std::time::Instant::now();
        let mut stream: kind::Watch<EventSpec> = Box::pin(watcher::<EventSpec>(
            ctx.store.clone(),
            moor::api::KeyScope::all(),
        ));
        let mut trouble = crate::Trouble::default();
        let mut whole = true;
        while let Some(item) = stream.next().await {
            let new: Vec<Value> = match item {
                // Refused every writer's events (a person's role): the namespace's
                // parts, the controller's and each node's (their first lists show
                // only what was not shown).
                Err(e) if whole => {
                    whole = false;
                    match kind::part_watch::<EventSpec>(ctx, ns.as_ref(), e).await? {
                        Ok((parts, _)) => stream = parts,
                        Err(e) => trouble.say(ctx, "watch: ", &e.into(), "watching again"),
                    }
                    continue;
                }
                Ok(Event::Applied(obj)) => vec![serde_json::to_value(&*obj)?],
                Ok(Event::Restarted(objs)) => objs
                    .iter()
                    .filter(|o| !seen.contains(&o.metadata.uid.to_string()))
                    .map(|o| serde_json::to_value(&**o))
                    .collect::<Result<_, _>>()?,
                Ok(Event::Deleted { .. }) => continue,
                Err(e) => {
                    trouble.say(ctx, "watch: ", &e.into(), "watching again");
                    continue;
                }
            };
            for v in new.iter().filter(|v| filter.matches(v)) {
                if seen.contains(&text(v, "/metadata/uid")) {
                    continue;
                }
                // A node's event is checked against where its object is now: the
                // placement is read again when it does not show the object there (at
                // most every 2 s, so a node writing many such events costs few reads).
                if !self.all_sources && node_source(v).is_some() && !placement.shown(v) {
                    if loaded.elapsed() >= std::time::Duration::from_secs(2) {
                        placement = Placement::load(ctx, ns.as_ref()).await?;
                        loaded = std::time::Instant::now();
                    }
                    if !placement.shown(v) {
                        continue;
                    }
                }
                outln!("{}", render_row(&row(v)));
            }
        }
        Ok(0)
    }
}
