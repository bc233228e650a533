//! The call log: one JSON line per RPC (time, RPC, the ids and paths of the request, the
//! response code, duration). Secrets and mount flags are never written. Tests read it to
//! check moor's invariants against what the plugin actually saw.

use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// One RPC as the plugin saw it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Call {
    /// When the call ended (RFC 3339, ms).
    pub time: String,
    /// The RPC's name, e.g. `NodeStageVolume`.
    pub rpc: String,
    /// The `--node-id` of the plugin instance that logged it (to merge several logs).
    #[serde(default)]
    pub plugin_node: String,
    /// The volume id in the request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_id: Option<String>,
    /// The node id in the request (ControllerPublish/Unpublish).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    /// The CreateVolume / CreateSnapshot name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The snapshot id in the request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<String>,
    /// The staging path in the request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staging_target_path: Option<String>,
    /// The target path in the request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_path: Option<String>,
    /// The volume context's `path` in a ControllerPublish, NodeStage or NodePublish
    /// request (the data directory the request names, where it names one): a path,
    /// not a secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_path: Option<String>,
    /// The access mode in the request's capability (CSI enum name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_mode: Option<String>,
    /// The volume id CreateVolume answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_volume_id: Option<String>,
    /// The names of the secrets the request carried (never their values).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secret_keys: Vec<String>,
    /// The capability's volume_mount_group.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mount_group: Option<String>,
    /// The SELinux context among the capability's mount flags (`context="..."`), the
    /// one flag logged: a label, not a secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selinux_context: Option<String>,
    /// The readonly flag in the request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readonly: Option<bool>,
    /// The gRPC code answered: `OK`, `InvalidArgument`, ... or `Cancelled` when the
    /// caller gave up (deadline or disconnect) before an answer.
    pub code: String,
    /// The error message, for failures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// How long the call took.
    pub duration_ms: f64,
    /// The term the caller made it under (its `moor-term` header), if it named one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub term: Option<String>,
    /// When the caller sent it (Unix ms, its `moor-sent` header), if it said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sent_ms: Option<u64>,
}

impl Call {
    /// A log line for `rpc`, the other fields to be filled in.
    pub fn new(rpc: &str) -> Call {
        Call {
            rpc: rpc.into(),
            ..Default::default()
        }
    }

    /// Whether the call succeeded.
    pub fn ok(&self) -> bool {
        self.code == "OK"
    }
}

/// An append-only call log file.
pub struct CallLog {
    path: PathBuf,
    file: Mutex<std::fs::File>,
}

impl CallLog {
    /// Opens (creates) the log for appending.
    pub fn open(path: &Path) -> std::io::Result<CallLog> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(CallLog {
            path: path.to_path_buf(),
            file: Mutex::new(file),
        })
    }

    /// The log's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one call as a line.
    pub fn append(&self, call: &Call) {
        // Serialising plain data cannot fail; a failed write must not fail the RPC.
        let mut line = serde_json::to_vec(call).unwrap_or_default();
        line.push(b'\n');
        let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = file.write_all(&line) {
            tracing::error!(error = %e, "cannot append to the call log");
        }
    }

    /// Reads a log; a line that is not a call (a torn last line after a crash) is skipped.
    pub fn read(path: &Path) -> std::io::Result<Vec<Call>> {
        let text = std::fs::read_to_string(path)?;
        Ok(text
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect())
    }
}
