//! `moorctl plugin status [ID]` and `moorctl volume status [ID]`: the views operators
//! know from Nomad.

use serde_json::Value;

use super::get::sort;
use super::kind::{self, text, Kind};
use super::table::{access_modes, render};
use super::{Ctx, NsArgs, Refused};

/// Plugins, or one plugin with its volumes.
#[derive(Debug, clap::Args)]
pub struct PluginStatusCmd {
    /// One plugin's id.
    pub id: Option<String>,
}

/// Volumes, or one volume with its claims.
#[derive(Debug, clap::Args)]
pub struct VolumeStatusCmd {
    /// One volume's name.
    pub id: Option<String>,
    /// Namespace selection.
    #[command(flatten)]
    pub ns: NsArgs,
}

fn health(v: &Value, healthy: &str, expected: &str) -> String {
    format!("{}/{}", text(v, healthy), text(v, expected))
}

/// The access mode a volume is held in by its live claims, or `<none>`.
fn held_access_mode(v: &Value) -> String {
    let mut modes: Vec<String> = ["/status/claims/read_claims", "/status/claims/write_claims"]
        .iter()
        .filter_map(|p| v.pointer(p).and_then(Value::as_array))
        .flatten()
        .map(|c| text(c, "/access_mode"))
        .filter(|m| !m.is_empty())
        .collect();
    modes.sort();
    modes.dedup();
    if modes.is_empty() {
        "<none>".into()
    } else {
        modes.join(",")
    }
}

fn capacity(v: &Value) -> String {
    match v
        .pointer("/status/provisioning/capacity_bytes")
        .and_then(Value::as_u64)
    {
        Some(b) => bytesize::ByteSize::b(b).display().iec().to_string(),
        None => "<unknown>".into(),
    }
}

/// A Mount's usage, `used/total` (bytes).
fn usage(m: &Value) -> String {
    let b = |p: &str| {
        m.pointer(p)
            .and_then(Value::as_u64)
            .map(|b| bytesize::ByteSize::b(b).display().iec().to_string())
    };
    match (
        b("/status/usage/bytes_used"),
        b("/status/usage/bytes_total"),
    ) {
        (Some(u), Some(t)) => format!("{u}/{t}"),
        (Some(u), None) => u,
        _ => "-".into(),
    }
}

/// The Mount of the claim `c` (a volume's ClaimRef) of volume `v`, as JSON (Null when
/// there is none, or the names do not parse).
async fn mount_of(ctx: &Ctx, v: &Value, c: &Value) -> anyhow::Result<Value> {
    use moor::api::{Claim, Mount, Namespace, NodeName};
    let (Ok(node), Ok(ns)) = (
        NodeName::new(text(c, "/node")),
        Namespace::new(text(v, "/metadata/namespace")),
    ) else {
        return Ok(Value::Null);
    };
    let key = Mount::key_for(&Claim::key_for(&node, &ns, text(c, "/claim")));
    Ok(match ctx.store.try_get(&key).await? {
        Some(m) => serde_json::to_value(&m)?,
        None => Value::Null,
    })
}

/// A Mount's health as its node plugin reports it.
fn mount_health(m: &Value) -> String {
    match m
        .pointer("/status/condition/abnormal")
        .and_then(Value::as_bool)
    {
        Some(true) => format!("abnormal: {}", text(m, "/status/condition/message")),
        Some(false) => "normal".into(),
        None => "-".into(),
    }
}

/// The spec's capacity range, `min..max`.
fn requested(v: &Value) -> String {
    let size = |pointer| match v.pointer(pointer).and_then(Value::as_u64) {
        Some(b) => bytesize::ByteSize::b(b).display().iec().to_string(),
        None => text(v, pointer),
    };
    let min = size("/spec/capacity_min");
    let max = size("/spec/capacity_max");
    match (min.is_empty(), max.is_empty()) {
        (true, true) => "<none>".into(),
        _ => format!("{min}..{max}"),
    }
}

/// The names of a map's entries (values may be sensitive to some users: not shown).
fn keys(v: &Value, pointer: &str) -> String {
    let names: Vec<&str> = v
        .pointer(pointer)
        .and_then(Value::as_object)
        .map(|m| m.keys().map(String::as_str).collect())
        .unwrap_or_default();
    names.join(",")
}

/// Each condition of the provisioner's and the controller's sections, `Type=bool(reason)`.
fn conditions(v: &Value) -> String {
    super::table::volume_conditions(v)
        .map(|c| {
            format!(
                "{}={}({})",
                text(c, "/type"),
                text(c, "/status"),
                text(c, "/reason")
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// GetCapacity's answers: `available (max N)` for the whole plugin, then per segment
/// (from the plugin's capacity key, which its controller's leader writes).
fn plugin_capacity(
    report: Result<Option<Vec<moor::api::CapacityEntry>>, moor::store::StoreError>,
) -> String {
    let size = |b: u64| bytesize::ByteSize::b(b).display().iec().to_string();
    let entries = match report {
        Ok(Some(entries)) => entries,
        Ok(None) => Vec::new(),
        Err(e) => return format!("<unreadable: {}>", moor::process::error_chain(&e)),
    };
    let entries: Vec<String> = entries
        .iter()
        .map(|e| {
            let mut s = format!("{} available", size(e.available_bytes));
            if let Some(max) = e.maximum_volume_size {
                s.push_str(&format!(" (max volume {})", size(max)));
            }
            if e.topology.is_empty() {
                s
            } else {
                let seg: Vec<String> = e.topology.iter().map(|(k, v)| format!("{k}={v}")).collect();
                format!("{}: {s}", seg.join(","))
            }
        })
        .collect();
    if entries.is_empty() {
        "<unknown>".into()
    } else {
        entries.join("; ")
    }
}

fn yes_no(b: bool) -> String {
    if b { "true" } else { "false" }.into()
}

fn fields(pairs: &[(&str, String)]) {
    let width = pairs.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, v) in pairs {
        outln!("{k:<width$} = {v}");
    }
}

impl PluginStatusCmd {
    /// Prints the table, or one plugin.
    pub async fn run(self, ctx: &Ctx) -> anyhow::Result<i32> {
        let (mut plugins, _) = kind::list(ctx, Kind::Plugin, None).await?;
        sort(Kind::Plugin, &mut plugins);
        let Some(id) = self.id else {
            let rows: Vec<Vec<String>> = plugins
                .iter()
                .map(|p| {
                    vec![
                        text(p, "/metadata/name"),
                        text(p, "/status/provider"),
                        health(
                            p,
                            "/status/controllers_healthy",
                            "/status/controllers_expected",
                        ),
                        health(p, "/status/nodes_healthy", "/status/nodes_expected"),
                    ]
                })
                .collect();
            out!(
                "{}",
                render(
                    &[
                        "ID",
                        "PROVIDER",
                        "CONTROLLERS HEALTHY/EXPECTED",
                        "NODES HEALTHY/EXPECTED"
                    ],
                    &rows
                )
            );
            return Ok(0);
        };
        let Some(p) = plugins.iter().find(|p| text(p, "/metadata/name") == id) else {
            return Err(Refused(format!("plugin {id} not found")).into());
        };
        let capacity = match moor::api::PluginId::new(id.clone()) {
            Ok(pid) => plugin_capacity(ctx.store.capacity(&pid).await),
            Err(_) => "<unknown>".into(),
        };
        fields(&[
            ("ID", id.clone()),
            ("Provider", text(p, "/status/provider")),
            ("Version", text(p, "/status/version")),
            (
                "Controllers Healthy",
                text(p, "/status/controllers_healthy"),
            ),
            (
                "Controllers Expected",
                text(p, "/status/controllers_expected"),
            ),
            ("Nodes Healthy", text(p, "/status/nodes_healthy")),
            ("Nodes Expected", text(p, "/status/nodes_expected")),
            (
                "Controller Required",
                text(p, "/status/controller_required"),
            ),
            ("Capacity", capacity),
        ]);
        let rows: Vec<Vec<String>> = p
            .pointer("/status/instances")
            .and_then(Value::as_object)
            .into_iter()
            .flatten()
            .map(|(node, i)| {
                vec![
                    node.clone(),
                    text(i, "/plugin_type"),
                    yes_no(i.pointer("/healthy").and_then(Value::as_bool) == Some(true)),
                    text(i, "/message"),
                ]
            })
            .collect();
        outln!("\nInstances");
        out!("{}", render(&["NODE", "TYPE", "HEALTHY", "MESSAGE"], &rows));
        let (mut volumes, _) = kind::list(ctx, Kind::Volume, None).await?;
        volumes.retain(|v| text(v, "/spec/plugin_id") == id);
        sort(Kind::Volume, &mut volumes);
        outln!("\nVolumes");
        out!("{}", volume_table(&volumes, true));
        Ok(0)
    }
}

fn volume_table(volumes: &[Value], with_ns: bool) -> String {
    let rows: Vec<Vec<String>> = volumes
        .iter()
        .map(|v| {
            let mut row = vec![text(v, "/metadata/name")];
            if with_ns {
                row.push(text(v, "/metadata/namespace"));
            }
            row.extend([
                text(v, "/spec/plugin_id"),
                yes_no(
                    v.pointer("/status/claims/schedulable")
                        .and_then(Value::as_bool)
                        == Some(true),
                ),
                held_access_mode(v),
            ]);
            row
        })
        .collect();
    let mut headers = vec!["ID"];
    if with_ns {
        headers.push("NAMESPACE");
    }
    headers.extend(["PLUGIN ID", "SCHEDULABLE", "ACCESS MODE"]);
    render(&headers, &rows)
}

impl VolumeStatusCmd {
    /// Prints the table, or one volume with its allocations.
    pub async fn run(self, ctx: &Ctx) -> anyhow::Result<i32> {
        let ns = self.ns.filter()?;
        let (mut volumes, _) = kind::list(ctx, Kind::Volume, ns.as_ref()).await?;
        sort(Kind::Volume, &mut volumes);
        let Some(id) = self.id else {
            out!("{}", volume_table(&volumes, self.ns.all_namespaces));
            return Ok(0);
        };
        let Some(v) = volumes.iter().find(|v| text(v, "/metadata/name") == id) else {
            return Err(Refused(format!("volume {id} not found")).into());
        };
        let plugin_id = text(v, "/spec/plugin_id");
        let plugin = kind::find(ctx, Kind::Plugin, None, &plugin_id)
            .await?
            .unwrap_or(Value::Null);
        let external = match text(v, "/status/provisioning/external_id") {
            e if e.is_empty() => text(v, "/spec/external_id"),
            e => e,
        };
        fields(&[
            ("ID", id.clone()),
            ("Namespace", text(v, "/metadata/namespace")),
            ("External ID", external),
            ("Plugin ID", plugin_id),
            ("Provider", text(&plugin, "/status/provider")),
            ("Version", text(&plugin, "/status/version")),
            ("Phase", text(v, "/status/provisioning/phase")),
            (
                "Schedulable",
                yes_no(
                    v.pointer("/status/claims/schedulable")
                        .and_then(Value::as_bool)
                        == Some(true),
                ),
            ),
            (
                "Controllers Healthy",
                text(&plugin, "/status/controllers_healthy"),
            ),
            (
                "Controllers Expected",
                text(&plugin, "/status/controllers_expected"),
            ),
            ("Nodes Healthy", text(&plugin, "/status/nodes_healthy")),
            ("Nodes Expected", text(&plugin, "/status/nodes_expected")),
            ("Access Mode", held_access_mode(v)),
            ("Capabilities", access_modes(v)),
            ("Requested Capacity", requested(v)),
            ("Capacity", capacity(v)),
            (
                "Mutable Parameters",
                keys(v, "/status/provisioning/mutable_parameters"),
            ),
            ("Health", super::table::volume_health(v)),
            ("Conditions", conditions(v)),
            ("Last Error", text(v, "/status/provisioning/last_error")),
        ]);
        let mut rows = Vec::new();
        for (pointer, mode) in [
            ("/status/claims/read_claims", "read"),
            ("/status/claims/write_claims", "write"),
        ] {
            for c in v
                .pointer(pointer)
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                // The node's Mount of the claim: usage and health (NodeGetVolumeStats).
                let m = mount_of(ctx, v, c).await?;
                rows.push(vec![
                    text(c, "/allocation"),
                    text(c, "/node"),
                    mode.to_string(),
                    text(c, "/claim"),
                    usage(&m),
                    mount_health(&m),
                ]);
            }
        }
        outln!("\nAllocations");
        if rows.is_empty() {
            outln!("No allocations placed");
        } else {
            out!(
                "{}",
                render(&["ID", "NODE ID", "MODE", "CLAIM", "USED", "HEALTH"], &rows)
            );
        }
        Ok(0)
    }
}
