//! How a volume is mounted (options, redacted flags) and what a node observes of a
//! mounted volume (usage, health).

use serde::{Deserialize, Serialize};
use std::fmt;

use super::REDACTED;

/// Mount flags. The CSI spec says they MAY carry sensitive information, so Debug and
/// Display print `[redacted]`.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct MountFlags(Vec<String>);

impl MountFlags {
    /// Wraps a list of flags.
    pub fn new(flags: Vec<String>) -> Self {
        MountFlags(flags)
    }
    /// The flags, for the one place that needs them: the CSI request.
    pub fn expose(&self) -> &[String] {
        &self.0
    }
    /// Whether there are no flags.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    /// A copy with every flag replaced by `[redacted]`, for output.
    pub fn redacted(&self) -> MountFlags {
        MountFlags(self.0.iter().map(|_| REDACTED.to_string()).collect())
    }
}

impl fmt::Debug for MountFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REDACTED)
    }
}

impl fmt::Display for MountFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REDACTED)
    }
}

/// How a file-system volume is mounted.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountOptions {
    /// Filesystem type, e.g. `ext4`; empty means the plugin's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fs_type: Option<String>,
    /// Mount flags (redacted in output).
    #[serde(default, skip_serializing_if = "MountFlags::is_empty")]
    pub mount_flags: MountFlags,
    /// The group id the node mounts the volume for (CSI `volume_mount_group`, Nomad's
    /// mount group, Kubernetes' fsGroup); needs the node plugin's VOLUME_MOUNT_GROUP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mount_group: Option<String>,
    /// The SELinux context to mount the volume with, `user:role:type[:level]` (e.g.
    /// `system_u:object_r:container_file_t:s0:c1,c2`; Kubernetes' SELinuxMount): sent
    /// as the mount flag `context="..."` of NodeStage and NodePublish only where the
    /// node's plugin is set to take it (`--plugin ...,selinux-mount=true`), never to
    /// another. A label, not a secret: shown as given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selinux_label: Option<String>,
}

impl MountOptions {
    /// Whether nothing is set (not written to the store).
    pub fn is_empty(&self) -> bool {
        self.fs_type.is_none()
            && self.mount_flags.is_empty()
            && self.mount_group.is_none()
            && self.selinux_label.is_none()
    }

    /// The mount flag that carries the SELinux label, `context="LABEL"`, if one is set.
    pub fn selinux_context_flag(&self) -> Option<String> {
        self.selinux_label
            .as_ref()
            .map(|l| format!("context=\"{l}\""))
    }

    /// Checks the mount group: 1-64 of `[A-Za-z0-9._-]` (a group id or name).
    pub fn check(&self) -> Result<(), String> {
        match &self.fs_type {
            Some(f)
                if f.is_empty()
                    || f.len() > 32
                    || !f
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"._".contains(&b)) =>
            {
                return Err(format!(
                    "fs_type {:?} must be 1-32 of [A-Za-z0-9._] (a filesystem type)",
                    crate::api::printable(f)
                ));
            }
            _ => {}
        }
        match &self.mount_group {
            Some(g)
                if g.is_empty()
                    || g.len() > 64
                    || !g
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) =>
            {
                return Err(format!(
                    "mount_group {g:?} must be 1-64 of [A-Za-z0-9._-] (a group id)"
                ));
            }
            _ => {}
        }
        match &self.selinux_label {
            Some(l)
                if l.is_empty()
                    || l.len() > 255
                    || l.split(':').count() < 3
                    || l.split(':').take(3).any(str::is_empty)
                    || !l
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"_.:,-".contains(&b)) =>
            {
                Err(format!(
                    "selinux_label {l:?} must be user:role:type[:level], at most 255 of [A-Za-z0-9_.:,-] (e.g. system_u:object_r:container_file_t:s0:c1,c2)"
                ))
            }
            _ => Ok(()),
        }
    }

    /// The options a claim uses: each option the request sets replaces the volume's
    /// (an fs_type, and the whole list of flags when the request gives any).
    pub fn merge(volume: &MountOptions, request: Option<&MountOptions>) -> MountOptions {
        let mut merged = volume.clone();
        if let Some(req) = request {
            if let Some(fs) = req.fs_type.as_ref().filter(|s| !s.is_empty()) {
                merged.fs_type = Some(fs.clone());
            }
            if !req.mount_flags.is_empty() {
                merged.mount_flags = req.mount_flags.clone();
            }
            if let Some(g) = req.mount_group.as_ref().filter(|s| !s.is_empty()) {
                merged.mount_group = Some(g.clone());
            }
            if let Some(l) = req.selinux_label.as_ref().filter(|s| !s.is_empty()) {
                merged.selinux_label = Some(l.clone());
            }
        }
        merged
    }
}

/// A volume's usage on a node (NodeGetVolumeStats); absent fields were not reported.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeUsage {
    /// Bytes used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_used: Option<u64>,
    /// Bytes available.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_available: Option<u64>,
    /// Bytes in all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_total: Option<u64>,
    /// Inodes used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inodes_used: Option<u64>,
    /// Inodes available.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inodes_available: Option<u64>,
    /// Inodes in all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inodes_total: Option<u64>,
}

/// A volume's health as a plugin reports it: CSI 1.13's VolumeHealth (a list of adverse
/// conditions, empty when healthy) or, from a 1.9-1.12 plugin, the older VolumeCondition
/// (abnormal and a message, no list). `abnormal` and `message` are filled either way, so
/// a reader that knows only them (an older moor) reads a 1.13 plugin's health too.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeHealth {
    /// The plugin says the volume is not healthy.
    pub abnormal: bool,
    /// The plugin's message; for a 1.13 plugin, its conditions in one line.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// The adverse conditions of a 1.13 plugin (those of a type moor knows).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<HealthCondition>,
}

/// One adverse condition a CSI 1.13 plugin reports of a volume
/// (`VolumeHealthErrorType`) or of its storage as a node sees it
/// (`StorageHealthErrorType`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthCondition {
    /// `Degraded`, `Inaccessible`, `DataLoss` (a volume); `StorageDegraded`,
    /// `StorageUnreachable` (the storage). Text, so that a later moor's values read.
    pub status: String,
    /// The plugin's CamelCase reason.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// The plugin's message.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// Storage only: the kind of volume it concerns (`SINGLE_NODE_WRITER/mount`), when
    /// not all.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub capability: String,
}

impl HealthCondition {
    /// `Status/Reason: message` (the parts present).
    pub fn line(&self) -> String {
        let mut s = self.status.clone();
        if !self.reason.is_empty() {
            s = format!("{s}/{}", self.reason);
        }
        if !self.capability.is_empty() {
            s = format!("{s} ({})", self.capability);
        }
        if !self.message.is_empty() {
            s = format!("{s}: {}", self.message);
        }
        s
    }

    /// The conditions in one line, `; ` between them.
    pub fn lines(all: &[HealthCondition]) -> String {
        all.iter()
            .map(HealthCondition::line)
            .collect::<Vec<_>>()
            .join("; ")
    }
}

impl VolumeHealth {
    /// The health a 1.13 plugin's conditions make.
    pub fn of(conditions: Vec<HealthCondition>) -> VolumeHealth {
        VolumeHealth {
            abnormal: !conditions.is_empty(),
            message: HealthCondition::lines(&conditions),
            conditions,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Secrets;

    #[test]
    fn secrets_and_mount_flags_never_print() {
        let secrets = Secrets::new([("password".into(), "hunter2".into())].into());
        let flags = MountFlags::new(vec!["password=hunter2".into()]);
        let opts = MountOptions {
            fs_type: Some("ext4".into()),
            mount_flags: flags.clone(),
            mount_group: None,
            selinux_label: None,
        };
        for text in [
            format!("{secrets:?}"),
            format!("{secrets}"),
            format!("{flags:?}"),
            format!("{flags}"),
            format!("{opts:?}"),
            format!("{:?}", secrets.redacted().expose()),
            format!("{:?}", flags.redacted().expose()),
        ] {
            assert!(!text.contains("hunter2"), "leaked in {text}");
        }
        // ...but they are stored as given.
        assert!(serde_json::to_string(&secrets).unwrap().contains("hunter2"));
        assert_eq!(flags.expose(), ["password=hunter2"]);
    }

    #[test]
    fn request_mount_options_replace_the_volume_s() {
        let vol = MountOptions {
            fs_type: Some("ext4".into()),
            mount_flags: MountFlags::new(vec!["noatime".into()]),
            mount_group: Some("100".into()),
            selinux_label: Some("system_u:object_r:container_file_t:s0:c1,c2".into()),
        };
        assert_eq!(MountOptions::merge(&vol, None), vol);
        let req = MountOptions {
            fs_type: Some("xfs".into()),
            mount_flags: MountFlags::default(),
            mount_group: None,
            selinux_label: None,
        };
        let merged = MountOptions::merge(&vol, Some(&req));
        assert_eq!(merged.fs_type.as_deref(), Some("xfs"));
        assert_eq!(merged.mount_flags.expose(), ["noatime"]);
        assert_eq!(merged.mount_group.as_deref(), Some("100"));
        let req = MountOptions {
            fs_type: None,
            mount_flags: MountFlags::new(vec!["ro".into(), "nodev".into()]),
            mount_group: Some("200".into()),
            selinux_label: Some("system_u:object_r:container_file_t:s0:c3".into()),
        };
        let merged = MountOptions::merge(&vol, Some(&req));
        assert_eq!(merged.fs_type.as_deref(), Some("ext4"));
        assert_eq!(merged.mount_flags.expose(), ["ro", "nodev"]);
        assert_eq!(merged.mount_group.as_deref(), Some("200"));
        assert!(req.check().is_ok());
        let bad = MountOptions {
            mount_group: Some("a b".into()),
            ..req
        };
        assert!(bad.check().unwrap_err().contains("mount_group"));
    }

    #[test]
    fn an_selinux_label_is_checked_merged_and_sent_as_a_context_flag() {
        let vol = MountOptions {
            selinux_label: Some("system_u:object_r:container_file_t:s0".into()),
            ..Default::default()
        };
        assert!(!vol.is_empty());
        assert_eq!(MountOptions::merge(&vol, None), vol);
        let req = MountOptions {
            selinux_label: Some("system_u:object_r:container_file_t:s0:c1,c2".into()),
            ..Default::default()
        };
        let merged = MountOptions::merge(&vol, Some(&req));
        assert_eq!(merged.selinux_label, req.selinux_label);
        assert_eq!(
            merged.selinux_context_flag().as_deref(),
            Some("context=\"system_u:object_r:container_file_t:s0:c1,c2\"")
        );
        assert!(req.check().is_ok());
        assert!(MountOptions::default().selinux_context_flag().is_none());
        for bad in [
            "",
            "container_file_t",
            "u:r",
            "u::t",
            "u:r:t\",nodev",
            "u:r:t s0",
            &format!("u:r:{}", "t".repeat(300)),
        ] {
            let o = MountOptions {
                selinux_label: Some(bad.into()),
                ..Default::default()
            };
            assert!(
                o.check().is_err_and(|e| e.contains("selinux_label")),
                "{bad:?}"
            );
        }
    }
}
