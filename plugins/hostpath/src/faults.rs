//! Fault injection, set while the plugin runs through its admin socket: fail the next N
//! calls of an RPC with a code, add latency, hang calls until released (before or after
//! the operation takes effect), or exit abruptly at the Nth call.
//!
//! The admin socket takes one JSON command per line and answers one line: `ok`, a JSON
//! status, or `error: ...`.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tonic::{Code, Status};

/// A fault-injection command.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Command {
    /// Fail the next `times` calls of `rpc` with `code` (a gRPC code name, e.g.
    /// `Unavailable`, `DeadlineExceeded`, `InvalidArgument`).
    Fail {
        /// The RPC, e.g. `NodeStageVolume`.
        rpc: String,
        /// The gRPC code's name.
        code: String,
        /// How many calls.
        times: u32,
    },
    /// Delay every call of `rpc` by `ms` (0 removes the delay).
    Latency {
        /// The RPC.
        rpc: String,
        /// Milliseconds.
        ms: u64,
    },
    /// Hold every call of `rpc` until released; `after: true` holds it after the
    /// operation took effect (the caller sees a timeout for something that happened).
    Hang {
        /// The RPC.
        rpc: String,
        /// Hang after the operation instead of before.
        #[serde(default)]
        after: bool,
    },
    /// Release the calls of `rpc` held by a hang, and stop hanging new ones.
    Release {
        /// The RPC.
        rpc: String,
    },
    /// Exit the process abruptly when the `nth` call of `rpc` arrives (counting from now).
    ExitAt {
        /// The RPC.
        rpc: String,
        /// Which call.
        nth: u32,
    },
    /// Report a volume's condition (VOLUME_CONDITION) from this instance: abnormal with
    /// `message`, or normal again.
    Condition {
        /// The plugin's volume id.
        volume_id: String,
        /// Abnormal or not.
        abnormal: bool,
        /// The message reported with it.
        #[serde(default)]
        message: String,
    },
    /// Report a volume's health the CSI 1.13 way (NodeGetVolumeHealth on this instance's
    /// node, ControllerGetVolumeHealth and ControllerListVolumeHealth on its
    /// controller): these adverse conditions; none is healthy again. Served with
    /// `--health-api=1.13`.
    Health {
        /// The plugin's volume id.
        volume_id: String,
        /// The conditions, in the order answered.
        #[serde(default)]
        statuses: Vec<HealthEntry>,
    },
    /// Report the storage as this instance's node sees it (NodeGetStorageHealth): these
    /// adverse conditions; none is healthy again.
    StorageHealth {
        /// The conditions, in the order answered.
        #[serde(default)]
        statuses: Vec<HealthEntry>,
    },
    /// Commit (or stop committing) a breach of the spec in every answer it concerns,
    /// so that the contract monitor's tests have a plugin that lies.
    Lie {
        /// Which.
        lie: Lie,
        /// Start (true) or stop.
        on: bool,
    },
    /// From now on max_volumes_per_node is `max` (0: no limit) for this instance, in
    /// place of its flag: what NodeGetInfo answers and what ControllerPublish enforces
    /// (an attach limit that changed while running).
    MaxVolumes {
        /// The new limit.
        max: i64,
    },
    /// Remove every fault and release every hang.
    Clear,
    /// Answer with the calls counted and the calls held, per RPC.
    Status,
}

/// One adverse condition to answer (CSI 1.13 health).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HealthEntry {
    /// The type's name as the spec spells it (`DEGRADED`, `INACCESSIBLE`, `DATA_LOSS`;
    /// `STORAGE_DEGRADED`, `STORAGE_UNREACHABLE`) or a number (one the spec has not
    /// defined, as a later plugin would answer).
    pub status: String,
    /// The CamelCase reason.
    #[serde(default)]
    pub reason: String,
    /// The message.
    #[serde(default)]
    pub message: String,
}

impl HealthEntry {
    /// The type's number among `names` (a name, or a number as it is).
    fn number(&self, name_of: fn(&str) -> Option<i32>) -> Result<i32, String> {
        name_of(&self.status)
            .or_else(|| self.status.parse().ok())
            .ok_or_else(|| format!("unknown health status {:?}", self.status))
    }
}

/// A breach of a MUST of the spec the plugin can be told to commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Lie {
    /// CreateVolume answers a capacity below the required bytes (or above the limit).
    Capacity,
    /// CreateVolume answers an accessible topology outside the requisite asked.
    Topology,
    /// NodeGetInfo answers another node id.
    NodeId,
    /// NodeGetInfo answers max_volumes_per_node 1.
    MaxVolumes,
    /// ListVolumes lists nothing and ControllerGetVolume answers NOT_FOUND.
    Unlisted,
    /// CreateSnapshot answers a snapshot of another volume.
    SnapshotSource,
    /// ControllerExpandVolume and NodeExpandVolume answer less than the required bytes.
    Expansion,
    /// ValidateVolumeCapabilities confirms no capability (not those asked).
    Validation,
    /// GetCapacity answers -1 bytes.
    NegativeCapacity,
    /// CreateVolumeGroupSnapshot and GetVolumeGroupSnapshot answer the group without
    /// its last member.
    GroupMembers,
}

/// What `Command::Status` answers.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FaultStatus {
    /// Calls received per RPC since start.
    pub calls: HashMap<String, u32>,
    /// Calls being held by a hang right now, per RPC.
    pub hanging: HashMap<String, u32>,
}

struct Hang {
    after: bool,
    released: watch::Sender<bool>,
}

#[derive(Default)]
struct Rules {
    fail: HashMap<String, (Code, u32)>,
    latency: HashMap<String, Duration>,
    hang: HashMap<String, Hang>,
    exit_at: HashMap<String, u32>,
    conditions: HashMap<String, (bool, String)>,
    health: HashMap<String, Vec<moor_csi::v1::volume_health::VolumeHealthEntry>>,
    storage_health: Vec<moor_csi::v1::node_get_storage_health_response::StorageBackendHealth>,
    lies: std::collections::HashSet<Lie>,
    max_volumes: Option<i64>,
    status: FaultStatus,
}

/// The active faults.
#[derive(Default)]
pub struct Faults {
    rules: Mutex<Rules>,
}

/// A hold to apply after the operation.
pub struct HoldAfter(watch::Receiver<bool>);

fn code_from_name(name: &str) -> Option<Code> {
    Some(match name {
        "Cancelled" => Code::Cancelled,
        "Unknown" => Code::Unknown,
        "InvalidArgument" => Code::InvalidArgument,
        "DeadlineExceeded" => Code::DeadlineExceeded,
        "NotFound" => Code::NotFound,
        "AlreadyExists" => Code::AlreadyExists,
        "PermissionDenied" => Code::PermissionDenied,
        "ResourceExhausted" => Code::ResourceExhausted,
        "FailedPrecondition" => Code::FailedPrecondition,
        "Aborted" => Code::Aborted,
        "OutOfRange" => Code::OutOfRange,
        "Unimplemented" => Code::Unimplemented,
        "Internal" => Code::Internal,
        "Unavailable" => Code::Unavailable,
        "DataLoss" => Code::DataLoss,
        "Unauthenticated" => Code::Unauthenticated,
        _ => return None,
    })
}

impl Faults {
    fn rules(&self) -> std::sync::MutexGuard<'_, Rules> {
        self.rules.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Applies a command; `Ok(Some(json))` for a status answer.
    pub fn apply(&self, cmd: Command) -> Result<Option<String>, String> {
        let mut r = self.rules();
        match cmd {
            Command::Fail { rpc, code, times } => {
                let code =
                    code_from_name(&code).ok_or_else(|| format!("unknown gRPC code {code:?}"))?;
                r.fail.insert(rpc, (code, times));
            }
            Command::Latency { rpc, ms } => {
                if ms == 0 {
                    r.latency.remove(&rpc);
                } else {
                    r.latency.insert(rpc, Duration::from_millis(ms));
                }
            }
            Command::Hang { rpc, after } => {
                let (released, _) = watch::channel(false);
                if let Some(old) = r.hang.insert(rpc, Hang { after, released }) {
                    old.released.send_replace(true);
                }
            }
            Command::Release { rpc } => {
                if let Some(h) = r.hang.remove(&rpc) {
                    h.released.send_replace(true);
                }
            }
            Command::ExitAt { rpc, nth } => {
                r.exit_at.insert(rpc, nth);
            }
            Command::Condition {
                volume_id,
                abnormal,
                message,
            } => {
                r.conditions.insert(volume_id, (abnormal, message));
            }
            Command::Health {
                volume_id,
                statuses,
            } => {
                let name_of = |n: &str| {
                    moor_csi::v1::VolumeHealthErrorType::from_str_name(n).map(|t| t as i32)
                };
                let mut entries = Vec::new();
                for e in statuses {
                    entries.push(moor_csi::v1::volume_health::VolumeHealthEntry {
                        status: e.number(name_of)?,
                        reason: e.reason,
                        message: e.message,
                    });
                }
                if entries.is_empty() {
                    r.health.remove(&volume_id);
                } else {
                    r.health.insert(volume_id, entries);
                }
            }
            Command::StorageHealth { statuses } => {
                let name_of = |n: &str| {
                    moor_csi::v1::StorageHealthErrorType::from_str_name(n).map(|t| t as i32)
                };
                let mut entries = Vec::new();
                for e in statuses {
                    entries.push(
                        moor_csi::v1::node_get_storage_health_response::StorageBackendHealth {
                            status: e.number(name_of)?,
                            reason: e.reason,
                            message: e.message,
                            volume_capability: None,
                        },
                    );
                }
                r.storage_health = entries;
            }
            Command::Lie { lie, on } => {
                if on {
                    r.lies.insert(lie);
                } else {
                    r.lies.remove(&lie);
                }
            }
            Command::MaxVolumes { max } => {
                if max < 0 {
                    return Err(format!("max_volumes_per_node {max} is negative"));
                }
                r.max_volumes = Some(max);
            }
            Command::Clear => {
                r.max_volumes = None;
                for (_, h) in r.hang.drain() {
                    h.released.send_replace(true);
                }
                r.lies.clear();
                r.fail.clear();
                r.latency.clear();
                r.exit_at.clear();
            }
            Command::Status => {
                return Ok(Some(serde_json::to_string(&r.status).unwrap_or_default()));
            }
        }
        Ok(None)
    }

    /// The max_volumes_per_node set by [`Command::MaxVolumes`], if any.
    pub fn max_volumes(&self) -> Option<i64> {
        self.rules().max_volumes
    }

    /// Whether the plugin is told to commit `lie`.
    pub fn lies(&self, lie: Lie) -> bool {
        self.rules().lies.contains(&lie)
    }

    /// The condition set for a volume (normal unless set).
    pub fn condition(&self, volume_id: &str) -> moor_csi::v1::VolumeCondition {
        let (abnormal, message) = self
            .rules()
            .conditions
            .get(volume_id)
            .cloned()
            .unwrap_or_default();
        moor_csi::v1::VolumeCondition { abnormal, message }
    }

    /// The 1.13 health set for a volume (healthy unless set).
    pub fn health(&self, volume_id: &str) -> moor_csi::v1::VolumeHealth {
        moor_csi::v1::VolumeHealth {
            volume_id: volume_id.to_string(),
            health_statuses: self
                .rules()
                .health
                .get(volume_id)
                .cloned()
                .unwrap_or_default(),
        }
    }

    /// The volumes with a 1.13 health set, by id.
    pub fn unhealthy(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.rules().health.keys().cloned().collect();
        ids.sort();
        ids
    }

    /// The storage's health set (healthy unless set).
    pub fn storage_health(
        &self,
    ) -> Vec<moor_csi::v1::node_get_storage_health_response::StorageBackendHealth> {
        self.rules().storage_health.clone()
    }

    /// Runs before an RPC's operation: counts it, exits if asked, delays, holds, or
    /// fails it. Returns a hold to apply after the operation, if one is set.
    pub async fn before(&self, rpc: &str) -> Result<Option<HoldAfter>, Status> {
        let (latency, hold_before, hold_after) = {
            let mut r = self.rules();
            *r.status.calls.entry(rpc.to_string()).or_default() += 1;
            if let Some(n) = r.exit_at.get_mut(rpc) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    tracing::warn!(rpc, "fault injection: exiting abruptly");
                    std::process::exit(86);
                }
            }
            let hold = r.hang.get(rpc).map(|h| (h.after, h.released.subscribe()));
            let (before, after) = match hold {
                Some((false, rx)) => (Some(rx), None),
                Some((true, rx)) => (None, Some(HoldAfter(rx))),
                None => (None, None),
            };
            (r.latency.get(rpc).copied(), before, after)
        };
        if let Some(d) = latency {
            tokio::time::sleep(d).await;
        }
        if let Some(rx) = hold_before {
            self.hold(rpc, rx).await;
        }
        let mut r = self.rules();
        if let Some((code, n)) = r.fail.get_mut(rpc) {
            if *n > 0 {
                *n -= 1;
                let code = *code;
                return Err(Status::new(
                    code,
                    format!("injected fault: {rpc} fails with {code:?}"),
                ));
            }
        }
        Ok(hold_after)
    }

    /// Applies a hold after the operation took effect.
    pub async fn after(&self, rpc: &str, hold: Option<HoldAfter>) {
        if let Some(HoldAfter(rx)) = hold {
            self.hold(rpc, rx).await;
        }
    }

    async fn hold(&self, rpc: &str, mut rx: watch::Receiver<bool>) {
        *self
            .rules()
            .status
            .hanging
            .entry(rpc.to_string())
            .or_default() += 1;
        struct Unhang<'a>(&'a Faults, &'a str);
        impl Drop for Unhang<'_> {
            fn drop(&mut self) {
                if let Some(n) = self.0.rules().status.hanging.get_mut(self.1) {
                    *n = n.saturating_sub(1);
                }
            }
        }
        let _unhang = Unhang(self, rpc);
        // An error means the hang was replaced or cleared: release.
        let _ = rx.wait_for(|released| *released).await;
    }

    /// Serves the admin socket until the listener fails.
    pub async fn serve_admin(self: std::sync::Arc<Self>, listener: UnixListener) {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let faults = self.clone();
            tokio::spawn(async move {
                let (read, mut write) = stream.into_split();
                let mut lines = BufReader::new(read).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    let reply = match serde_json::from_str::<Command>(&line) {
                        Ok(cmd) => match faults.apply(cmd) {
                            Ok(Some(json)) => json,
                            Ok(None) => "ok".to_string(),
                            Err(e) => format!("error: {e}"),
                        },
                        Err(e) => format!("error: not a command: {e}"),
                    };
                    if write
                        .write_all(format!("{reply}\n").as_bytes())
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
    }
}

/// Sends one command to a plugin's admin socket and returns its answer line.
pub async fn send(admin: &Path, cmd: &Command) -> std::io::Result<String> {
    let stream = UnixStream::connect(admin).await?;
    let (read, mut write) = stream.into_split();
    let mut line = serde_json::to_string(cmd).unwrap_or_default();
    line.push('\n');
    write.write_all(line.as_bytes()).await?;
    let mut reply = String::new();
    BufReader::new(read).read_line(&mut reply).await?;
    let reply = reply.trim_end().to_string();
    if let Some(e) = reply.strip_prefix("error: ") {
        return Err(std::io::Error::other(e.to_string()));
    }
    Ok(reply)
}

/// Asks a plugin for its call counts and held calls.
pub async fn status(admin: &Path) -> std::io::Result<FaultStatus> {
    let reply = send(admin, &Command::Status).await?;
    serde_json::from_str(&reply).map_err(std::io::Error::other)
}
