//! Tables: the columns of each kind, rendered from objects as JSON.

use std::time::{Duration, SystemTime};

use serde_json::Value;

use super::kind::{text, Kind};

/// One column: its header and how a cell is read from an object.
pub struct Column {
    /// Header.
    pub header: &'static str,
    /// The cell.
    pub cell: fn(&Value) -> String,
}

const fn col(header: &'static str, cell: fn(&Value) -> String) -> Column {
    Column { header, cell }
}

fn name(v: &Value) -> String {
    text(v, "/metadata/name")
}

fn namespace(v: &Value) -> String {
    text(v, "/metadata/namespace")
}

/// A snapshot schedule's next slot after its last one (or after now, for one never
/// cut): the arithmetic the controller acts on (`moor::api::Cadence`). `paused` when
/// paused, empty for a spec this version cannot read.
fn next_slot(v: &Value) -> String {
    let Some(spec) = v
        .get("spec")
        .cloned()
        .and_then(|s| serde_json::from_value::<moor::api::SnapshotScheduleSpec>(s).ok())
    else {
        return String::new();
    };
    if spec.paused {
        return "paused".into();
    }
    let last = v
        .pointer("/status/last_slot")
        .and_then(Value::as_str)
        .and_then(|t| humantime::parse_rfc3339(t).ok());
    let from = last.map_or_else(SystemTime::now, |l| l.max(SystemTime::now()));
    spec.cadence()
        .ok()
        .and_then(|c| c.next_after(from))
        .map(|t| humantime::format_rfc3339_seconds(t).to_string())
        .unwrap_or_default()
}

fn age(v: &Value) -> String {
    ago(&text(v, "/metadata/creation_timestamp"))
}

/// `5s`, `3m`, `2h`, `4d` since an RFC 3339 time ("" when absent).
pub fn ago(rfc3339: &str) -> String {
    let Ok(t) = humantime::parse_rfc3339_weak(rfc3339) else {
        return String::new();
    };
    let d = SystemTime::now()
        .duration_since(t)
        .unwrap_or(Duration::ZERO)
        .as_secs();
    match d {
        0..=119 => format!("{d}s"),
        120..=7199 => format!("{}m", d / 60),
        7200..=172_799 => format!("{}h", d / 3600),
        _ => format!("{}d", d / 86400),
    }
}

fn count(v: &Value, pointer: &str) -> usize {
    v.pointer(pointer)
        .and_then(Value::as_array)
        .map_or(0, Vec::len)
}

/// The claims column of a volume: `2r 1w`, or `-`.
pub fn claims(v: &Value) -> String {
    let r = count(v, "/status/claims/read_claims");
    let w = count(v, "/status/claims/write_claims");
    if r + w == 0 {
        "-".into()
    } else {
        format!("{r}r {w}w")
    }
}

/// The access modes a volume offers, comma-separated.
pub fn access_modes(v: &Value) -> String {
    let modes: Vec<String> = v
        .pointer("/spec/capabilities")
        .and_then(Value::as_array)
        .map(|caps| caps.iter().map(|c| text(c, "/access_mode")).collect())
        .unwrap_or_default();
    modes.join(",")
}

fn yes_no(v: &Value, pointer: &str) -> String {
    match v.pointer(pointer).and_then(Value::as_bool) {
        Some(true) => "yes".into(),
        _ => "no".into(),
    }
}

fn node_plugins(v: &Value) -> String {
    let Some(plugins) = v.pointer("/status/plugins").and_then(Value::as_object) else {
        return String::new();
    };
    plugins
        .iter()
        .map(|(id, p)| {
            let healthy = p.get("healthy").and_then(Value::as_bool).unwrap_or(false);
            format!("{id}({})", if healthy { "healthy" } else { "unhealthy" })
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// A volume's conditions: the provisioner's section's, then the controller's.
pub fn volume_conditions(v: &Value) -> impl Iterator<Item = &Value> {
    [
        "/status/provisioning/conditions",
        "/status/claims/conditions",
    ]
    .into_iter()
    .flat_map(|section| {
        v.pointer(section)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
    })
}

/// A volume's health as its plugins report it (the `Healthy` condition, from the
/// controller plugin, and `HealthyOnNodes`, from the node plugins): `healthy`,
/// `unhealthy: MESSAGE`, or `-` where no plugin reports health.
pub fn volume_health(v: &Value) -> String {
    let mut known = false;
    let mut bad = Vec::new();
    for c in volume_conditions(v)
        .filter(|c| matches!(text(c, "/type").as_str(), "Healthy" | "HealthyOnNodes"))
    {
        known = true;
        if c.get("status").and_then(Value::as_bool) == Some(false) {
            bad.push(text(c, "/message"));
        }
    }
    match (known, bad.is_empty()) {
        (false, _) => "-".into(),
        (true, true) => "healthy".into(),
        (true, false) => format!("unhealthy: {}", bad.join("; ")),
    }
}

/// The storage's health each plugin of a node reports (NodeGetStorageHealth):
/// `ID(healthy)` or `ID(Status/Reason, ...)`; plugins that do not report it are left out.
fn node_storage(v: &Value) -> String {
    let Some(plugins) = v.pointer("/status/plugins").and_then(Value::as_object) else {
        return String::new();
    };
    let shown: Vec<String> = plugins
        .iter()
        .filter_map(|(id, p)| {
            let all = p.get("storage_health")?.as_array()?;
            if all.is_empty() {
                return Some(format!("{id}(healthy)"));
            }
            let each: Vec<String> = all
                .iter()
                .map(|c| match text(c, "/reason").as_str() {
                    "" => text(c, "/status"),
                    r => format!("{}/{r}", text(c, "/status")),
                })
                .collect();
            Some(format!("{id}({})", each.join(", ")))
        })
        .collect();
    if shown.is_empty() {
        "-".into()
    } else {
        shown.join(",")
    }
}

/// How long ago an event last happened, and for a series how often over how long:
/// `3s (x6 over 21s)`.
fn event_age(v: &Value) -> String {
    let age = ago(&text(v, "/spec/time"));
    let repeats = v
        .get("spec")
        .and_then(|s| serde_json::from_value::<moor::api::EventSpec>(s.clone()).ok())
        .map(|s| s.repeats())
        .unwrap_or_default();
    if repeats.is_empty() {
        age
    } else {
        format!("{age} ({repeats})")
    }
}

fn event_object(v: &Value) -> String {
    format!(
        "{}/{}",
        text(v, "/spec/object/kind").to_lowercase(),
        text(v, "/spec/object/name")
    )
}

/// A quota's usage of `field` against its limit (`3/10`, `-` when not limited), sizes
/// in IEC units when `size`.
fn used_of(v: &Value, field: &str, size: bool) -> String {
    let shown = |n: u64| {
        if size {
            moor::api::Size(n).to_string()
        } else {
            n.to_string()
        }
    };
    let used = v
        .pointer(&format!("/status/used/{field}"))
        .and_then(Value::as_u64)
        .unwrap_or(0);
    match v.pointer(&format!("/spec/{field}")).and_then(Value::as_u64) {
        Some(limit) => format!("{}/{}", shown(used), shown(limit)),
        None => "-".into(),
    }
}

/// A quota's per-class capacity used against each limit (`fast 1.0 GiB/5.0 GiB`).
fn quota_classes(v: &Value) -> String {
    let Some(limits) = v.pointer("/spec/classes").and_then(Value::as_object) else {
        return "-".into();
    };
    limits
        .iter()
        .map(|(class, limit)| {
            let used = v
                .pointer(&format!("/status/used/classes/{class}"))
                .and_then(Value::as_u64)
                .unwrap_or(0);
            format!(
                "{class} {}/{}",
                moor::api::Size(used),
                moor::api::Size(limit.as_u64().unwrap_or(0))
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The columns of a kind (`wide` adds some).
pub fn columns(kind: Kind, wide: bool) -> Vec<Column> {
    let mut cols = match kind {
        Kind::Volume => vec![
            col("NAME", name),
            col("PLUGIN", |v| text(v, "/spec/plugin_id")),
            col("PHASE", |v| text(v, "/status/provisioning/phase")),
            col("SCHEDULABLE", |v| yes_no(v, "/status/claims/schedulable")),
            col("CLAIMS", claims),
            col("AVAILABILITY", |v| {
                match text(v, "/spec/availability").as_str() {
                    "" => "active".into(),
                    a => a.to_string(),
                }
            }),
            col("CLASS", |v| match text(v, "/spec/class").as_str() {
                "" => "-".into(),
                c => c.to_string(),
            }),
            col("MADE FOR", |v| {
                let alloc = text(v, "/spec/made_for/allocation");
                if alloc.is_empty() {
                    "-".into()
                } else {
                    format!(
                        "{alloc}/{} ({})",
                        text(v, "/spec/made_for/request"),
                        match text(v, "/spec/made_for/lifecycle").as_str() {
                            "" => "ephemeral".to_string(),
                            l => l.to_string(),
                        }
                    )
                }
            }),
            col("AGE", age),
        ],
        Kind::Allocation => vec![
            col("NAME", name),
            col("NODE", |v| text(v, "/spec/node")),
            col("DESIRED", |v| text(v, "/spec/desired_status")),
            col("CLIENT", |v| {
                if v.pointer("/status/lost") == Some(&Value::Bool(true)) {
                    "lost".to_string()
                } else {
                    text(v, "/spec/client_status")
                }
            }),
            col("PHASE", |v| text(v, "/status/phase")),
            col("VOLUMES", |v| count(v, "/spec/volumes").to_string()),
            col("AGE", age),
        ],
        Kind::Claim => vec![
            col("NAME", name),
            col("VOLUME", |v| text(v, "/spec/volume")),
            col("NODE", |v| text(v, "/spec/node")),
            col("MODE", |v| text(v, "/spec/mode")),
            col("PHASE", |v| text(v, "/status/phase")),
            col("AGE", age),
        ],
        Kind::Attachment => vec![
            col("NAME", name),
            col("VOLUME", |v| text(v, "/spec/volume")),
            col("NODE", |v| text(v, "/spec/node")),
            col("PHASE", |v| text(v, "/status/phase")),
            col("DETACH", |v| yes_no(v, "/spec/detach")),
            col("AGE", age),
        ],
        Kind::VolumeReport => vec![
            col("PLUGIN", |v| text(v, "/spec/plugin_id")),
            col("VOLUME", |v| text(v, "/spec/object")),
            col("PHASE", |v| text(v, "/status/phase")),
            col("EXTERNAL ID", |v| text(v, "/status/external_id")),
            col("FINALIZER", |v| text(v, "/spec/finalizer")),
            col("AGE", age),
        ],
        Kind::SnapshotReport => vec![
            col("PLUGIN", |v| text(v, "/spec/plugin_id")),
            col("SNAPSHOT", |v| text(v, "/spec/object")),
            col("PHASE", |v| text(v, "/status/phase")),
            col("SNAPSHOT ID", |v| text(v, "/status/snapshot_id")),
            col("FINALIZER", |v| text(v, "/spec/finalizer")),
            col("AGE", age),
        ],
        Kind::VolumeGroupSnapshotReport => vec![
            col("PLUGIN", |v| text(v, "/spec/plugin_id")),
            col("GROUP", |v| text(v, "/spec/object")),
            col("PHASE", |v| text(v, "/status/phase")),
            col("GROUP ID", |v| text(v, "/status/group_snapshot_id")),
            col("FINALIZER", |v| text(v, "/spec/finalizer")),
            col("AGE", age),
        ],
        Kind::AttachmentReport => vec![
            col("PLUGIN", |v| text(v, "/spec/plugin_id")),
            col("ATTACHMENT", |v| text(v, "/spec/object")),
            col("PHASE", |v| text(v, "/status/phase")),
            col("AGE", age),
        ],
        Kind::Mount => vec![
            col("NAME", name),
            col("VOLUME", |v| text(v, "/spec/volume")),
            col("NODE", |v| text(v, "/spec/node")),
            col("STAGED", |v| yes_no(v, "/status/staged")),
            col("PUBLISHED", |v| yes_no(v, "/status/published")),
            col("RELEASED", |v| yes_no(v, "/status/released")),
            col("AGE", age),
        ],
        Kind::Node => vec![
            col("NAME", name),
            col("PLUGINS", node_plugins),
            col("AGE", age),
        ],
        Kind::VolumeClass => vec![
            col("NAME", name),
            col("PLUGIN", |v| text(v, "/spec/plugin_id")),
            col("DEFAULT", |v| yes_no(v, "/spec/default")),
            col("EXPANSION", |v| {
                match v.pointer("/spec/allow_expansion").and_then(Value::as_bool) {
                    Some(false) => "no".into(),
                    _ => "yes".into(),
                }
            }),
            col("ON DELETE", |v| match text(v, "/spec/on_delete").as_str() {
                "" => "delete".into(),
                d => d.to_string(),
            }),
            col("AGE", age),
        ],
        Kind::Secret => vec![
            col("NAME", name),
            col("PLUGIN", |v| text(v, "/spec/plugin_id")),
            // The names of its keys are counted, never listed (nor their values).
            col("KEYS", |v| match v.pointer("/spec/secrets") {
                Some(Value::Object(m)) => m.len().to_string(),
                _ => "sealed".into(),
            }),
            col("AGE", age),
        ],
        Kind::Cordon => vec![
            col("NODE", name),
            col("DRAIN", |v| yes_no(v, "/spec/drain")),
            col("REASON", |v| text(v, "/spec/reason")),
            col("AGE", age),
        ],
        Kind::Plugin => vec![
            col("ID", name),
            col("PROVIDER", |v| text(v, "/status/provider")),
            col("CONTROLLERS", |v| {
                format!(
                    "{}/{}",
                    text(v, "/status/controllers_healthy"),
                    text(v, "/status/controllers_expected")
                )
            }),
            col("NODES", |v| {
                format!(
                    "{}/{}",
                    text(v, "/status/nodes_healthy"),
                    text(v, "/status/nodes_expected")
                )
            }),
        ],
        Kind::Lease => vec![
            col("NAME", name),
            col("HOLDER", |v| text(v, "/spec/holder")),
            col("DURATION", |v| {
                format!("{}s", text(v, "/spec/duration_seconds"))
            }),
            col("RENEWED", |v| text(v, "/spec/renew_time")),
            col("AGE", age),
        ],
        Kind::Ownership => vec![
            col("PLUGIN", |v| text(v, "/spec/plugin_id")),
            col("RESOURCE", |v| text(v, "/spec/resource")),
            col("EXTERNAL ID", |v| text(v, "/spec/external_id")),
            col("OWNER", |v| {
                format!(
                    "{}/{}",
                    text(v, "/spec/owner/namespace"),
                    text(v, "/spec/owner/name")
                )
            }),
            // The namespaces an operator shared it with (`+w`: their writers too).
            col("SHARED WITH", |v| {
                let shares = v.pointer("/spec/shared_with").and_then(Value::as_array);
                let list: Vec<String> = shares
                    .into_iter()
                    .flatten()
                    .map(|s| {
                        let ns = text(s, "/namespace");
                        match s.pointer("/write").and_then(Value::as_bool) {
                            Some(true) => format!("{ns}+w"),
                            _ => ns,
                        }
                    })
                    .collect();
                if list.is_empty() {
                    "-".into()
                } else {
                    list.join(",")
                }
            }),
            col("AGE", age),
        ],
        // Nomad's `volume snapshot list` columns.
        Kind::Snapshot => vec![
            col("NAME", name),
            col("SNAPSHOT ID", |v| text(v, "/status/snapshot_id")),
            col("VOLUME ID", |v| text(v, "/spec/volume")),
            col("SIZE", |v| {
                v.pointer("/status/size_bytes")
                    .and_then(Value::as_u64)
                    .map(|b| bytesize::ByteSize::b(b).display().iec().to_string())
                    .unwrap_or_default()
            }),
            col("CREATE TIME", |v| text(v, "/status/creation_time")),
            col("READY", |v| yes_no(v, "/status/ready_to_use")),
            col("PHASE", |v| text(v, "/status/phase")),
        ],
        Kind::VolumeGroupSnapshot => vec![
            col("NAME", name),
            col("GROUP SNAPSHOT ID", |v| {
                text(v, "/status/group_snapshot_id")
            }),
            col("VOLUMES", |v| {
                v.pointer("/spec/volumes")
                    .and_then(Value::as_array)
                    .map(|a| {
                        a.iter()
                            .filter_map(Value::as_str)
                            .collect::<Vec<_>>()
                            .join(",")
                    })
                    .unwrap_or_default()
            }),
            col("CREATE TIME", |v| text(v, "/status/creation_time")),
            col("READY", |v| yes_no(v, "/status/ready_to_use")),
            col("PHASE", |v| text(v, "/status/phase")),
        ],
        Kind::SnapshotSchedule => vec![
            col("NAME", name),
            col("SCHEDULE", |v| {
                let every = text(v, "/spec/interval");
                if every.is_empty() {
                    format!("cron {}", text(v, "/spec/cron"))
                } else {
                    format!("every {every}")
                }
            }),
            col("SELECTOR", |v| {
                v.pointer("/spec/selector")
                    .and_then(Value::as_object)
                    .map(|m| {
                        m.iter()
                            .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
                            .collect::<Vec<_>>()
                            .join(",")
                    })
                    .unwrap_or_default()
            }),
            col("KEEP", |v| {
                let (n, age) = (
                    text(v, "/spec/retention/keep"),
                    text(v, "/spec/retention/max_age"),
                );
                match (n.is_empty(), age.is_empty()) {
                    (false, false) => format!("{n}, {age}"),
                    (false, true) => n,
                    _ => age,
                }
            }),
            col("LAST SLOT", |v| text(v, "/status/last_slot")),
            col("NEXT SLOT", next_slot),
            col("MISSED", |v| {
                match text(v, "/status/missed_slots").as_str() {
                    "" => "0".into(),
                    n => n.to_string(),
                }
            }),
            col("PAUSED", |v| yes_no(v, "/spec/paused")),
            col("AGE", age),
        ],
        Kind::Quota => vec![
            col("NAME", name),
            col("VOLUMES", |v| used_of(v, "volumes", false)),
            col("CAPACITY", |v| used_of(v, "capacity", true)),
            col("ALLOCATIONS", |v| used_of(v, "allocations", false)),
            col("SNAPSHOTS", |v| used_of(v, "snapshots", false)),
            col("CLASSES", quota_classes),
            col("WAITING", |v| {
                match text(v, "/status/waiting_count").as_str() {
                    "" => "0".into(),
                    n => n.to_string(),
                }
            }),
            col("AGE", age),
        ],
        Kind::Event => vec![
            col("AGE", event_age),
            col("TYPE", |v| text(v, "/spec/type")),
            col("REASON", |v| text(v, "/spec/reason")),
            col("OBJECT", event_object),
            col("MESSAGE", |v| text(v, "/spec/message")),
        ],
    };
    if wide {
        let extra: Vec<Column> = match kind {
            Kind::Volume => vec![
                col("EXTERNAL ID", |v| {
                    text(v, "/status/provisioning/external_id")
                }),
                col("CAPACITY", |v| {
                    text(v, "/status/provisioning/capacity_bytes")
                }),
                col("ACCESS MODES", access_modes),
                col("HEALTH", |v| {
                    let h = volume_health(v);
                    h.split(':').next().unwrap_or_default().to_string()
                }),
            ],
            Kind::Node => vec![col("STORAGE", node_storage)],
            Kind::Claim => vec![
                col("ALLOCATION", |v| text(v, "/spec/allocation")),
                col("ACCESS MODE", |v| text(v, "/spec/access_mode")),
                col("REASON", |v| text(v, "/status/reason")),
            ],
            Kind::Attachment => vec![col("EXTERNAL ID", |v| text(v, "/spec/external_id"))],
            Kind::Mount => vec![
                col("TARGET", |v| text(v, "/spec/target_path")),
                col("ORPHANED", |v| text(v, "/status/orphan/since")),
            ],
            Kind::Plugin => vec![
                col("VERSION", |v| text(v, "/status/version")),
                col("CONTROLLER REQUIRED", |v| {
                    match v.pointer("/status/controller_required") {
                        Some(Value::Bool(_)) => yes_no(v, "/status/controller_required"),
                        _ => "unknown".into(),
                    }
                }),
            ],
            Kind::Event => vec![col("SOURCE", |v| text(v, "/spec/source"))],
            Kind::Snapshot => vec![col("GROUP", |v| text(v, "/spec/group"))],
            _ => Vec::new(),
        };
        cols.extend(extra);
    }
    cols
}

/// Renders rows under headers, columns padded to their widest cell.
pub fn render(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut l = String::new();
        for (i, cell) in cells.enumerate() {
            if i + 1 < widths.len() {
                l.push_str(&format!("{cell:<w$}   ", w = widths[i]));
            } else {
                l.push_str(cell);
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(&mut headers.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

/// One row on its own, cells separated as in a table (for rows printed as they come,
/// under `-w`).
pub fn render_row(row: &[String]) -> String {
    render(&vec![""; row.len()], &[row.to_vec()])
        .lines()
        .nth(1)
        .unwrap_or_default()
        .to_string()
}

/// A table of objects of one kind; with `all_namespaces`, a NAMESPACE column first.
pub fn table(kind: Kind, items: &[Value], wide: bool, all_namespaces: bool) -> String {
    let cols = columns(kind, wide);
    let mut headers: Vec<&str> = Vec::new();
    let with_ns = all_namespaces && kind.namespaced();
    if with_ns {
        headers.push("NAMESPACE");
    }
    headers.extend(cols.iter().map(|c| c.header));
    let rows: Vec<Vec<String>> = items
        .iter()
        .map(|v| {
            let mut row = Vec::new();
            if with_ns {
                row.push(namespace(v));
            }
            row.extend(cols.iter().map(|c| (c.cell)(v)));
            row
        })
        .collect();
    render(&headers, &rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_schedule_shows_its_next_slot() {
        let v = serde_json::json!({
            "spec": {"interval": "1h", "retention": {"keep": 1}},
            "status": {"last_slot": "2000-01-01T00:00:00.000Z"}
        });
        // A slot of an hourly schedule is on the hour, after now.
        let next = next_slot(&v);
        let t = humantime::parse_rfc3339(&next).unwrap();
        let secs = t.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs();
        assert_eq!(secs % 3600, 0, "{next}");
        assert!(t > SystemTime::now() && t <= SystemTime::now() + Duration::from_secs(3600));
        let paused = serde_json::json!({"spec": {"interval": "1h", "paused": true}});
        assert_eq!(next_slot(&paused), "paused");
        assert_eq!(next_slot(&serde_json::json!({"spec": {"interval": 7}})), "");
    }

    #[test]
    fn no_kind_shows_a_column_twice() {
        for kind in Kind::ALL {
            for wide in [false, true] {
                let cols = columns(*kind, wide);
                let mut headers: Vec<&str> = cols.iter().map(|c| c.header).collect();
                let all = headers.len();
                headers.sort_unstable();
                headers.dedup();
                assert_eq!(
                    headers.len(),
                    all,
                    "{kind:?} (wide: {wide}) repeats a column"
                );
            }
        }
    }

    #[test]
    fn columns_line_up() {
        let out = render(
            &["NAME", "PHASE"],
            &[vec!["a-long-name".into(), "ready".into()]],
        );
        assert_eq!(out, "NAME          PHASE\na-long-name   ready\n");
    }
}
