//! What a node instance can see of a ControllerPublish: a marker per (volume, node)
//! beside the volume's data directory, as a real attach makes a device appear on the
//! node. The controller instance writes and removes it; a node instance (another
//! process, another state dir) refuses NodeStage, or NodePublish without staging, of a
//! volume whose marker for its node is absent, so a CO that skips or reorders
//! ControllerPublish is caught as a strict third-party plugin would catch it.

use std::path::{Path, PathBuf};

/// The directory of a volume's markers: `<data dir>.attached`.
fn dir(volume_path: &Path) -> PathBuf {
    let mut name = volume_path.as_os_str().to_owned();
    name.push(".attached");
    PathBuf::from(name)
}

/// A node id as one path component (`/` and other bytes outside `[A-Za-z0-9._-]`
/// escaped as `%XX`).
pub(crate) fn file_name(node_id: &str) -> String {
    let mut out = String::new();
    for b in node_id.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || (b == b'.' && !out.is_empty()) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A device name for a new attachment: another each time a volume is attached, as a
/// real attach may bring the disk up under another device path, so the publish_context
/// that names it changes and a node holding the old one must stage again.
pub fn new_device() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("dev-{nanos:x}")
}

/// Records the marker of `node_id` for the volume at `volume_path`, naming the device
/// it appeared as (`Some`), or removes it (`None`).
pub fn set(volume_path: &Path, node_id: &str, device: Option<&str>) -> std::io::Result<()> {
    let d = dir(volume_path);
    let f = d.join(file_name(node_id));
    if let Some(device) = device {
        std::fs::create_dir_all(&d)?;
        std::fs::write(f, device.as_bytes())
    } else {
        match std::fs::remove_file(f) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => {
                // Gone with its last marker; another may have appeared meanwhile.
                let _ = std::fs::remove_dir(&d);
                Ok(())
            }
        }
    }
}

/// Whether the volume at `volume_path` is attached to `node_id`.
pub fn is_set(volume_path: &Path, node_id: &str) -> bool {
    dir(volume_path).join(file_name(node_id)).exists()
}

/// The device the volume at `volume_path` appeared as on `node_id` (none when it is
/// not attached there, or was attached by an earlier version that named none).
pub fn device(volume_path: &Path, node_id: &str) -> Option<String> {
    std::fs::read_to_string(dir(volume_path).join(file_name(node_id)))
        .ok()
        .filter(|d| !d.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_are_per_node_and_escape_the_node_id() {
        let t = tempfile::tempdir().unwrap();
        let vol = t.path().join("vol-1");
        std::fs::create_dir_all(&vol).unwrap();
        set(&vol, "../n/1", Some("dev-1")).unwrap();
        assert!(is_set(&vol, "../n/1"));
        assert_eq!(device(&vol, "../n/1").as_deref(), Some("dev-1"));
        assert_eq!(device(&vol, "n1"), None);
        assert!(!is_set(&vol, "n1"));
        assert_eq!(
            std::fs::read_dir(t.path()).unwrap().count(),
            2,
            "only beside the volume"
        );
        set(&vol, "../n/1", None).unwrap();
        assert!(!is_set(&vol, "../n/1"));
        set(&vol, "../n/1", None).unwrap();
    }
}
