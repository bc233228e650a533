//! `moorctl describe KIND NAME`: the object, its related objects, its recent events.

use serde_json::Value;

use super::get::sort;
use super::kind::{self, redact, text, Kind};
use super::table::table;
use super::{Ctx, Refused};
use moor::api::{printable, Allocation, Namespace};

/// Show one object with its related objects and recent events.
#[derive(Debug, clap::Args)]
pub struct Describe {
    /// The kind.
    #[arg(value_parser = crate::kind::KindParser, hide_possible_values = true)]
    pub kind: Kind,
    /// The name.
    pub name: String,
    /// Namespace.
    #[arg(short = 'n', long, env = "MOOR_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// Print secrets and mount flags instead of `[redacted]`.
    #[arg(long)]
    pub show_secrets: bool,
    /// `wide`: also the staging paths of an allocation's volumes.
    #[arg(short = 'o', long, value_parser = ["wide"])]
    pub output: Option<String>,
    /// Also events a node wrote about it although it is not on that node.
    #[arg(long)]
    pub all_sources: bool,
}

impl Describe {
    /// Prints the description; exit code 1 when the object does not exist.
    pub async fn run(self, ctx: &Ctx) -> anyhow::Result<i32> {
        let ns = super::parse_ns(&self.namespace)?;
        let Some(mut obj) = kind::find(ctx, self.kind, Some(&ns), &self.name).await? else {
            return Err(Refused(format!("{} {}/{} not found", self.kind, ns, self.name)).into());
        };
        if self.show_secrets {
            kind::revealable(&obj)?;
        } else {
            redact(&mut obj);
        }
        outln!("Kind:       {}", self.kind.name());
        outln!("Name:       {}", self.name);
        if self.kind.namespaced() {
            outln!("Namespace:  {ns}");
        }
        outln!("UID:        {}", text(&obj, "/metadata/uid"));
        outln!("Version:    {}", text(&obj, "/metadata/resource_version"));
        outln!("Created:    {}", text(&obj, "/metadata/creation_timestamp"));
        // The claim's trace (an Attachment or Mount carries its claim's).
        if let Some(id) = obj
            .pointer("/metadata/trace")
            .and_then(Value::as_str)
            .and_then(moor::telemetry::trace_id)
        {
            outln!("Trace:      {id}");
        }
        if let Some(phase) = self.kind.phase_pointer() {
            outln!("Phase:      {}", text(&obj, phase));
        }
        for (label, pointer) in [
            ("Deleting:   ", "/metadata/deletion_timestamp"),
            ("Finalizers: ", "/metadata/finalizers"),
        ] {
            if obj.pointer(pointer).is_some() {
                outln!("{label}{}", text(&obj, pointer));
            }
        }
        if self.kind == Kind::Allocation {
            allocation(ctx, &ns, &self.name, self.output.is_some()).await?;
        }
        section("Spec", obj.get("spec"))?;
        section("Status", obj.get("status"))?;

        // Events about the object, its claims and attachments, and those related to
        // them (a node's Mount events name the claim); a node's events only from the
        // nodes the object is on (`sources`: the rule of every view of events).
        let mut about = vec![(self.kind, self.name.clone())];
        for (related, field) in related(self.kind) {
            let (items, _) = kind::list(ctx, related, Some(&ns)).await?;
            let mut items: Vec<Value> = items
                .into_iter()
                .filter(|v| text(v, field) == self.name)
                .collect();
            sort(related, &mut items);
            if matches!(related, Kind::Claim | Kind::Attachment) {
                about.extend(items.iter().map(|v| (related, text(v, "/metadata/name"))));
            }
            outln!("\n{}s:", related.name());
            if items.is_empty() {
                outln!("  <none>");
            } else {
                for line in table(related, &items, false, false).lines() {
                    outln!("  {line}");
                }
            }
        }
        if self.kind == Kind::Volume {
            engine_callers(ctx, &ns, &self.name).await?;
        }
        if self.kind == Kind::Claim {
            // The attacher's events about the claim's attachment.
            let (attachments, _) = kind::list(ctx, Kind::Attachment, Some(&ns)).await?;
            about.extend(
                attachments
                    .iter()
                    .filter(|a| {
                        text(a, "/spec/volume") == text(&obj, "/spec/volume")
                            && text(a, "/spec/node") == text(&obj, "/spec/node")
                    })
                    .map(|a| (Kind::Attachment, text(a, "/metadata/name"))),
            );
        }
        print_events(ctx, &about, &ns, self.all_sources).await?;
        Ok(0)
    }
}

/// An allocation's client status (with how it ended) and where each request's volume
/// is on its node.
async fn allocation(ctx: &Ctx, ns: &Namespace, name: &str, wide: bool) -> anyhow::Result<()> {
    let name = super::parse_name("allocation", name)?;
    let Some(alloc) = ctx.store.try_get(&Allocation::key_for(ns, &name)).await? else {
        return Ok(());
    };
    let client = match &alloc.spec.exit {
        Some(exit) => format!("{:?} ({exit})", alloc.client_status()),
        None => format!("{:?}", alloc.client_status()),
    };
    outln!("Client:     {}", client.to_lowercase());
    // What it waits for, in the words `alloc run` prints (issue 78, item 2: a claim
    // pending on a node nobody registered showed no reason here).
    let seen = moor::workload::seen(&ctx.store, alloc.clone(), true).await?;
    let goal = if alloc.is_terminal() || alloc.is_deleting() {
        moor::api::ClaimPhase::Released
    } else {
        moor::api::ClaimPhase::Published
    };
    // The line names only the requests short of the goal, after the allocation's
    // phase: nothing after it when every claim is there.
    let line = seen.progress(goal);
    if let Some((_, waiting)) = line.split_once("; ") {
        outln!("Waiting:    {waiting}");
    }
    let paths = seen.paths;
    outln!("\nVolumes:");
    let mut headers = vec!["REQUEST", "VOLUME", "MODE", "TARGET PATH"];
    if wide {
        headers.push("STAGING PATH");
    }
    let rows: Vec<Vec<String>> = alloc
        .spec
        .volumes
        .iter()
        .map(|req| {
            let p = paths.iter().find(|(r, _)| r == &req.name).map(|(_, p)| p);
            let mut row = vec![
                req.name.to_string(),
                {
                    let v = alloc
                        .request_volume(req)
                        .map_or_else(|| "-".to_string(), |v| v.to_string());
                    match &req.template {
                        Some(t) => format!("{v} (made, {})", t.lifecycle),
                        None => v,
                    }
                },
                if req.read_only { "ro" } else { "rw" }.to_string(),
                p.map_or_else(
                    || "- (not published)".to_string(),
                    |p| printable(&p.target_path),
                ),
            ];
            if wide {
                row.push(
                    p.and_then(|p| p.staging_path.as_deref())
                        .map_or_else(|| "-".to_string(), printable),
                );
            }
            row
        })
        .collect();
    if rows.is_empty() {
        outln!("  <none>");
    } else {
        for line in super::table::render(&headers, &rows).lines() {
            outln!("  {line}");
        }
    }
    Ok(())
}

/// The kinds related to a kind, and the field of theirs that names it.
fn related(kind: Kind) -> Vec<(Kind, &'static str)> {
    match kind {
        Kind::Volume => vec![
            (Kind::Claim, "/spec/volume"),
            (Kind::Attachment, "/spec/volume"),
            (Kind::Mount, "/spec/volume"),
        ],
        Kind::Allocation => vec![
            (Kind::Claim, "/spec/allocation"),
            (Kind::Mount, "/spec/allocation"),
        ],
        Kind::Claim => vec![(Kind::Mount, "/spec/claim")],
        _ => Vec::new(),
    }
}

fn section(title: &str, v: Option<&Value>) -> anyhow::Result<()> {
    outln!("\n{title}:");
    match v {
        Some(v) if !v.as_object().is_some_and(|m| m.is_empty()) => {
            for line in serde_yaml_ng::to_string(v)?.lines() {
                outln!("  {line}");
            }
        }
        _ => outln!("  <none>"),
    }
    Ok(())
}

async fn print_events(
    ctx: &Ctx,
    about: &[(Kind, String)],
    ns: &Namespace,
    all_sources: bool,
) -> anyhow::Result<()> {
    let (events, _) = kind::list_readable(ctx, Kind::Event, Some(ns)).await?;
    let placement = super::sources::Placement::load(ctx, Some(ns)).await?;
    let mut elsewhere = 0;
    let mut events: Vec<Value> = events
        .into_iter()
        .filter(|e| {
            // About it, or about something else and related to it (a node's Mount
            // event for a claim).
            about.iter().any(|(kind, name)| {
                ["/spec/object", "/spec/related"].iter().any(|at| {
                    text(e, &format!("{at}/kind")) == kind.name()
                        && &text(e, &format!("{at}/name")) == name
                        && (!kind.namespaced()
                            || text(e, &format!("{at}/namespace")) == ns.as_str())
                })
            })
        })
        .filter(|e| {
            let shown = all_sources || placement.shown(e);
            elsewhere += usize::from(!shown);
            shown
        })
        .collect();
    sort(Kind::Event, &mut events);
    outln!("\nEvents:");
    if events.is_empty() {
        outln!("  <none>");
    } else {
        // Wide: with the SOURCE column, which writer said it.
        for line in table(Kind::Event, &events, true, false).lines() {
            outln!("  {line}");
        }
    }
    if let Some(note) = super::sources::hidden_note(elsewhere) {
        outln!("  {note}");
    }
    Ok(())
}

/// The container-engine callers (Docker, Podman: the volume-plugin endpoint's Mounts)
/// that hold volume `name`: each running endpoint allocation, with its node.
async fn engine_callers(ctx: &Ctx, ns: &Namespace, name: &str) -> anyhow::Result<()> {
    let (allocs, _) = kind::list(ctx, Kind::Allocation, Some(ns)).await?;
    // An allocation of one caller's own names it in `moor.dev/caller`; an engine's
    // hold names each of its callers in a `moor.dev/caller.<hash>` label.
    let callers = |a: &Value| -> Vec<String> {
        a.pointer("/metadata/labels")
            .and_then(Value::as_object)
            .map(|labels| {
                labels
                    .iter()
                    .filter(|(k, _)| *k == "moor.dev/caller" || k.starts_with("moor.dev/caller."))
                    .filter_map(|(_, v)| v.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    };
    let rows: Vec<Vec<String>> = allocs
        .iter()
        .filter(|a| text(a, "/spec/desired_status") != "stop")
        .filter(|a| {
            a.pointer("/spec/volumes")
                .and_then(Value::as_array)
                .is_some_and(|v| v.iter().any(|r| text(r, "/volume") == name))
        })
        .flat_map(|a| {
            callers(a)
                .into_iter()
                .map(move |caller| vec![caller, text(a, "/spec/node"), text(a, "/metadata/name")])
        })
        .collect();
    outln!("\nEngine callers:");
    if rows.is_empty() {
        outln!("  <none>");
    } else {
        for line in super::table::render(&["CALLER", "NODE", "ALLOCATION"], &rows).lines() {
            outln!("  {line}");
        }
    }
    Ok(())
}
