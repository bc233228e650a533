//! `moorctl volume snapshot create|import|delete|list`: Nomad's verbs over Snapshot
//! objects (the snapshotter of the volume's plugin cuts, finds and deletes them), and
//! with `--group` over VolumeGroupSnapshots (one consistent cut of several volumes).

use moor::api::*;

use crate::kind;
use crate::table;
use crate::{parse_name, parse_ns, Ctx, Refused};

/// `moorctl volume snapshot ...`.
#[derive(Debug, clap::Subcommand)]
pub enum SnapshotCmd {
    /// Snapshot a volume: a Snapshot object the volume's plugin cuts (CreateSnapshot).
    /// With `--group V1,V2,...` and only a NAME: one consistent snapshot of those
    /// volumes, a VolumeGroupSnapshot NAME cut by one CreateVolumeGroupSnapshot, whose
    /// members become Snapshots NAME-VOLUME, restored like any other.
    Create {
        /// `VOLUME NAME`; with --group, `NAME`.
        #[arg(num_args = 1..=2, required = true, value_names = ["VOLUME", "NAME"])]
        args: Vec<String>,
        /// The volumes of a group snapshot (comma-separated).
        #[arg(long, value_delimiter = ',')]
        group: Vec<String>,
        /// CreateSnapshot parameters, `KEY=VALUE` (repeatable).
        #[arg(long = "parameter", value_parser = parse_kv)]
        parameters: Vec<(String, String)>,
        /// Namespace.
        #[arg(short = 'n', long, env = "MOOR_NAMESPACE", default_value = "default")]
        namespace: String,
    },
    /// Import a snapshot made outside moor: a Snapshot object naming the plugin's id of
    /// it, which the volume's plugin confirms (ListSnapshots) before it can be
    /// restored from. Deleting it later keeps it in the plugin. With
    /// `--group-snapshot-id` and `--source-volume V1,V2,...`: a group snapshot made
    /// outside moor (GetVolumeGroupSnapshot; its members must be of those volumes).
    Import {
        /// The snapshot's (or group's) name.
        name: String,
        /// The plugin's id of the snapshot.
        #[arg(long, required_unless_present = "group_snapshot_id")]
        snapshot_id: Option<String>,
        /// The plugin's id of a group snapshot.
        #[arg(long, conflicts_with = "snapshot_id")]
        group_snapshot_id: Option<String>,
        /// The moor volume it was taken of (its plugin holds the snapshot); for a group,
        /// its volumes (comma-separated).
        #[arg(long, value_delimiter = ',', required = true)]
        source_volume: Vec<String>,
        /// Namespace.
        #[arg(short = 'n', long, env = "MOOR_NAMESPACE", default_value = "default")]
        namespace: String,
    },
    /// Delete a snapshot (DeleteSnapshot; its finalizer holds it until the plugin did).
    /// With `--group`: a group snapshot (DeleteVolumeGroupSnapshot) and its members.
    Delete {
        /// The snapshot.
        name: String,
        /// NAME is a VolumeGroupSnapshot.
        #[arg(long)]
        group: bool,
        /// Namespace.
        #[arg(short = 'n', long, env = "MOOR_NAMESPACE", default_value = "default")]
        namespace: String,
    },
    /// Snapshots with Nomad's columns (Snapshot ID, Volume ID, Size, Create Time, Ready).
    /// With --plugin: the plugin's own snapshots (its ListSnapshots at the last survey,
    /// those made outside moor too), each with the Snapshot that names it, if any.
    List {
        /// Only this volume's.
        volume: Option<String>,
        /// Namespace.
        #[arg(short = 'n', long, env = "MOOR_NAMESPACE", default_value = "default")]
        namespace: String,
        /// List what this plugin holds instead.
        #[arg(long, conflicts_with = "volume")]
        plugin: Option<String>,
    },
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{s:?} is not KEY=VALUE"))
}

impl SnapshotCmd {
    /// Runs the verb.
    pub async fn run(self, ctx: &Ctx) -> anyhow::Result<i32> {
        match self {
            SnapshotCmd::Create {
                args,
                group,
                parameters,
                namespace,
            } => match (args.as_slice(), group.is_empty()) {
                ([volume, name], true) => {
                    let spec = SnapshotSpec {
                        parameters: parameters.into_iter().collect(),
                        ..Default::default()
                    };
                    create(ctx, &namespace, name, volume, spec, "cut").await
                }
                ([name], false) => {
                    let spec = VolumeGroupSnapshotSpec {
                        parameters: parameters.into_iter().collect(),
                        ..Default::default()
                    };
                    create_group(ctx, &namespace, name, &group, spec, "cut").await
                }
                (_, true) => Err(Refused(
                    "create takes VOLUME NAME (or NAME --group V1,V2,...)".into(),
                )
                .into()),
                (_, false) => {
                    Err(Refused("with --group, create takes only the group's NAME".into()).into())
                }
            },
            SnapshotCmd::Import {
                name,
                snapshot_id,
                group_snapshot_id,
                source_volume,
                namespace,
            } => match (snapshot_id, group_snapshot_id) {
                (Some(id), None) => {
                    let [volume] = source_volume.as_slice() else {
                        return Err(Refused("a snapshot is of one --source-volume".into()).into());
                    };
                    let spec = SnapshotSpec {
                        snapshot_id: Some(id),
                        ..Default::default()
                    };
                    create(ctx, &namespace, &name, volume, spec, "found").await
                }
                (None, Some(id)) => {
                    let spec = VolumeGroupSnapshotSpec {
                        group_snapshot_id: Some(id),
                        ..Default::default()
                    };
                    create_group(ctx, &namespace, &name, &source_volume, spec, "found").await
                }
                _ => Err(Refused("one of --snapshot-id and --group-snapshot-id".into()).into()),
            },
            SnapshotCmd::Delete {
                name,
                group,
                namespace,
            } => {
                crate::delete::Delete {
                    kind: if group {
                        Kind::VolumeGroupSnapshot
                    } else {
                        Kind::Snapshot
                    },
                    name,
                    namespace,
                    volumes: false,
                    when_unused: false,
                }
                .run(ctx)
                .await
            }
            SnapshotCmd::List {
                plugin: Some(plugin),
                ..
            } => plugin_list(ctx, &plugin).await,
            SnapshotCmd::List {
                volume, namespace, ..
            } => {
                let ns = parse_ns(&namespace)?;
                let (mut items, _) = kind::list(ctx, Kind::Snapshot, Some(&ns)).await?;
                if let Some(v) = &volume {
                    items.retain(|s| kind::text(s, "/spec/volume") == *v);
                }
                crate::get::sort(Kind::Snapshot, &mut items);
                out!("{}", table::table(Kind::Snapshot, &items, false, false));
                Ok(0)
            }
        }
    }
}

/// `moorctl volume snapshot list --plugin P`: the plugin's snapshot list as its survey
/// last wrote it, with the Snapshot (in any namespace) that names each.
async fn plugin_list(ctx: &Ctx, plugin: &str) -> anyhow::Result<i32> {
    let id = PluginId::new(plugin).map_err(|e| Refused(format!("plugin {plugin:?}: {e}")))?;
    let Some(list) = ctx.store.snapshot_list(&id).await? else {
        return Err(Refused(format!(
            "plugin {id} has no snapshot list: it does not advertise LIST_SNAPSHOTS, or the \
             agent leading its controller has not surveyed it yet"
        ))
        .into());
    };
    let (objects, _) = kind::list(ctx, Kind::Snapshot, None).await?;
    let named = |sid: &str| {
        objects
            .iter()
            .find(|o| {
                kind::text(o, "/status/snapshot_id") == sid
                    && kind::text(o, "/status/plugin_id") == id.as_str()
            })
            .map(|o| {
                format!(
                    "{}/{}",
                    kind::text(o, "/metadata/namespace"),
                    kind::text(o, "/metadata/name")
                )
            })
            .unwrap_or_else(|| "-".into())
    };
    let rows: Vec<Vec<String>> = list
        .snapshots
        .iter()
        .map(|s| {
            vec![
                s.snapshot_id.clone(),
                s.source_volume_id.clone(),
                if s.size_bytes > 0 {
                    bytesize::ByteSize::b(s.size_bytes)
                        .display()
                        .iec()
                        .to_string()
                } else {
                    "-".into()
                },
                s.created_secs
                    .and_then(|t| u64::try_from(t).ok())
                    .map(|t| {
                        humantime::format_rfc3339_seconds(
                            std::time::UNIX_EPOCH + std::time::Duration::from_secs(t),
                        )
                        .to_string()
                    })
                    .unwrap_or_else(|| "-".into()),
                s.ready.to_string(),
                named(&s.snapshot_id),
            ]
        })
        .collect();
    out!(
        "{}",
        table::render(
            &[
                "SNAPSHOT ID",
                "SOURCE VOLUME ID",
                "SIZE",
                "CREATED",
                "READY",
                "SNAPSHOT"
            ],
            &rows
        )
    );
    if list.more > 0 {
        out!("({} more not listed)", list.more);
    }
    Ok(0)
}

/// Creates VolumeGroupSnapshot `name` of `volumes` with `spec` (its volumes set here),
/// checked and refused when a volume does not exist, the volumes are of more than one
/// plugin, a member's name would not be valid, or the name is taken.
async fn create_group(
    ctx: &Ctx,
    namespace: &str,
    name: &str,
    volumes: &[String],
    mut spec: VolumeGroupSnapshotSpec,
    done: &str,
) -> anyhow::Result<i32> {
    let ns = parse_ns(namespace)?;
    let name = parse_name("group snapshot", name)?;
    spec.volumes = volumes
        .iter()
        .map(|v| VolumeId::new(v.as_str()).map_err(|e| anyhow::anyhow!("volume {v:?}: {e}")))
        .collect::<Result<_, _>>()?;
    let mut errors = ValidationErrors::default();
    spec.validate(&mut errors);
    if !errors.is_empty() {
        return Err(Refused(format!("group snapshot {ns}/{name}: {errors}")).into());
    }
    let group = VolumeGroupSnapshot::new(&ns, name.clone(), spec);
    let mut plugins = std::collections::BTreeSet::new();
    for v in &group.spec.volumes {
        let Some(vol) = ctx.store.try_get(&Volume::key_for(&ns, v)).await? else {
            return Err(Refused(format!("volume {ns}/{v} not found")).into());
        };
        plugins.insert(vol.spec.plugin_id.to_string());
        group.member_name(v).map_err(Refused)?;
    }
    if plugins.len() > 1 {
        return Err(Refused(format!(
            "the volumes are of plugins {}: a group snapshot is of one plugin's volumes",
            plugins.into_iter().collect::<Vec<_>>().join(", ")
        ))
        .into());
    }
    match ctx.store.create(&group).await {
        Ok(_) => {}
        Err(moor::store::StoreError::AlreadyExists { .. }) => {
            return Err(Refused(format!("group snapshot {ns}/{name} exists")).into())
        }
        Err(e) => return Err(e.into()),
    }
    outln!("volumegroupsnapshot/{ns}/{name} created; `moorctl wait volumegroupsnapshot/{name} --for phase=ready` waits until it is {done}; its members are snapshots {name}-VOLUME");
    Ok(0)
}

/// Creates Snapshot `name` of `volume` with `spec` (its volume set here), checked
/// (`validate`) and refused when the volume does not exist or the name is taken.
async fn create(
    ctx: &Ctx,
    namespace: &str,
    name: &str,
    volume: &str,
    mut spec: SnapshotSpec,
    done: &str,
) -> anyhow::Result<i32> {
    let ns = parse_ns(namespace)?;
    let name = parse_name("snapshot", name)?;
    spec.volume = VolumeId::new(volume).map_err(|e| anyhow::anyhow!("volume {volume:?}: {e}"))?;
    let mut errors = ValidationErrors::default();
    spec.validate(&mut errors);
    if !errors.is_empty() {
        return Err(Refused(format!("snapshot {ns}/{name}: {errors}")).into());
    }
    if ctx
        .store
        .try_get(&Volume::key_for(&ns, &spec.volume))
        .await?
        .is_none()
    {
        return Err(Refused(format!("volume {ns}/{} not found", spec.volume)).into());
    }
    let snap = Snapshot::new(&ns, name.clone(), spec);
    match ctx.store.create(&snap).await {
        Ok(_) => {}
        Err(moor::store::StoreError::AlreadyExists { .. }) => {
            return Err(Refused(format!("snapshot {ns}/{name} exists")).into())
        }
        Err(e) => return Err(e.into()),
    }
    outln!("snapshot/{ns}/{name} created; `moorctl wait snapshot/{name} --for phase=ready` waits until it is {done}");
    Ok(0)
}
