//! The options of `docker volume create --driver moor -o KEY=VALUE` (and Podman's):
//! what a Volume is made from, each checked before anything is written.

use std::collections::BTreeMap;

use serde_json::Value;

use moor::api::{
    AccessMode, AttachmentMode, MountFlags, MountOptions, Name, PluginId, Size, VolumeId,
    VolumeSource,
};

use super::Failure;

/// The options the endpoint knows, for its error messages.
pub const KNOWN: &str =
    "size, mode, fs, mount-flags, plugin, class, snapshot, source-volume, param.KEY";

/// Create's options, parsed.
#[derive(Debug, Default, PartialEq)]
pub struct CreateOptions {
    /// `size`: the least capacity (bytes or units: 1GiB, 512MiB).
    pub size: Option<Size>,
    /// `mode`: the access mode (default single-node-writer).
    pub mode: Option<AccessMode>,
    /// `fs`: the filesystem type.
    pub fs_type: Option<String>,
    /// `mount-flags`: comma-separated mount flags.
    pub mount_flags: Option<Vec<String>>,
    /// `plugin`: the CSI plugin id (default: the class's, else the endpoint's).
    pub plugin: Option<PluginId>,
    /// `class`: the VolumeClass that fills what the other options leave out (default:
    /// the default class, unless `plugin` is given).
    pub class: Option<Name>,
    /// `snapshot` (a moor Snapshot) or `source-volume` (a moor volume to clone).
    pub source: Option<VolumeSource>,
    /// `param.KEY=VALUE`: CreateVolume parameters.
    pub parameters: BTreeMap<String, String>,
}

/// The most options one Create may carry.
const MAX_OPTIONS: usize = 64;

impl CreateOptions {
    /// Parses Create's `Opts` (absent or null: none); the first bad option refuses the
    /// request, named.
    pub fn parse(opts: Option<&Value>) -> Result<CreateOptions, Failure> {
        let map = match opts {
            None | Some(Value::Null) => return Ok(CreateOptions::default()),
            Some(Value::Object(m)) => m,
            Some(_) => return Err(Failure::bad("Opts is not an object of KEY: VALUE")),
        };
        if map.len() > MAX_OPTIONS {
            return Err(Failure::bad(format!(
                "{} options; at most {MAX_OPTIONS}",
                map.len()
            )));
        }
        let mut o = CreateOptions::default();
        for (key, value) in map {
            let shown = moor::api::printable(key);
            let Value::String(v) = value else {
                return Err(Failure::bad(format!(
                    "option {shown}: the value is not a string"
                )));
            };
            let bad = |why: String| {
                Failure::bad(format!("option {shown}={}: {why}", moor::api::printable(v)))
            };
            match key.as_str() {
                "size" => o.size = Some(Size::parse(v).map_err(bad)?),
                "mode" => {
                    let mode: AccessMode = serde_json::from_value(Value::String(v.clone()))
                        .map_err(|_| {
                            let all: Vec<&str> =
                                AccessMode::ALL.iter().map(|m| m.as_str()).collect();
                            bad(format!("not an access mode ({})", all.join(", ")))
                        })?;
                    o.mode = Some(mode);
                }
                "fs" | "fstype" | "type" if v == "block" => {
                    return Err(bad(
                        "a block volume cannot be a container's volume mount; use moorctl for block volumes".into(),
                    ))
                }
                "fs" | "fstype" => {
                    if v.is_empty()
                        || v.len() > 32
                        || !v.chars().all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '_')
                    {
                        return Err(bad("not a filesystem type".into()));
                    }
                    o.fs_type = Some(v.clone());
                }
                "type" => {
                    if v != "mount" {
                        return Err(bad("the only type is mount".into()));
                    }
                }
                "mount-flags" => {
                    let flags: Vec<String> = v
                        .split(',')
                        .map(str::trim)
                        .filter(|f| !f.is_empty())
                        .map(str::to_string)
                        .collect();
                    MountOptions {
                        mount_flags: MountFlags::new(flags.clone()),
                        ..Default::default()
                    }
                    .check()
                    .map_err(|e| Failure::bad(format!("option {shown}: {e}")))?;
                    o.mount_flags = Some(flags);
                }
                "plugin" => o.plugin = Some(PluginId::new(v).map_err(|e| bad(e.to_string()))?),
                "class" => o.class = Some(Name::new(v).map_err(|e| bad(e.to_string()))?),
                "snapshot" => {
                    o.source = Some(VolumeSource::Snapshot(
                        Name::new(v).map_err(|e| bad(e.to_string()))?,
                    ))
                }
                "source-volume" => {
                    o.source = Some(VolumeSource::Volume(
                        VolumeId::new(v).map_err(|e| bad(e.to_string()))?,
                    ))
                }
                other => match other.strip_prefix("param.") {
                    Some(k) if !k.is_empty() && k.len() <= 256 && v.len() <= 4096 => {
                        o.parameters.insert(k.to_string(), v.clone());
                    }
                    Some(_) => return Err(bad("a parameter's key is 1-256 bytes, its value at most 4096".into())),
                    None => {
                        return Err(Failure::bad(format!(
                            "unknown option {shown} (known: {KNOWN})"
                        )))
                    }
                },
            }
        }
        Ok(o)
    }

    /// What an existing volume `spec` contradicts of these options, named: `None` when
    /// the volume can be used as it is.
    pub fn contradiction(
        &self,
        spec: &moor::api::VolumeSpec,
        capacity: Option<u64>,
    ) -> Option<String> {
        if let Some(p) = &self.plugin {
            if *p != spec.plugin_id {
                return Some(format!(
                    "option plugin={p}: the volume is of plugin {}",
                    spec.plugin_id
                ));
            }
        }
        if let Some(c) = &self.class {
            if spec.class.as_ref() != Some(c) {
                return Some(format!(
                    "option class={c}: the volume is of {}",
                    match &spec.class {
                        Some(theirs) => format!("class {theirs}"),
                        None => "no class".to_string(),
                    }
                ));
            }
        }
        if let Some(size) = self.size {
            let has = capacity.or(spec.capacity_min.map(|s| s.0));
            if has.is_some_and(|c| c < size.0) {
                return Some(format!(
                    "option size={}: the volume has {} bytes",
                    size.0,
                    has.unwrap_or(0)
                ));
            }
        }
        if let Some(mode) = self.mode {
            if !spec
                .capabilities
                .iter()
                .any(|c| c.access_mode == mode && c.attachment_mode == AttachmentMode::FileSystem)
            {
                return Some(format!("option mode={mode}: the volume does not offer it"));
            }
        }
        if let Some(fs) = &self.fs_type {
            if spec.mount_options.fs_type.as_ref().is_some_and(|f| f != fs) {
                return Some(format!(
                    "option fs={fs}: the volume's filesystem is another"
                ));
            }
        }
        if self.source.is_some() && spec.source != self.source {
            return Some(
                "option snapshot/source-volume: the volume was made from another source".into(),
            );
        }
        if self
            .parameters
            .iter()
            .any(|(k, v)| spec.parameters.get(k) != Some(v))
        {
            return Some("option param.*: the volume was made with other parameters".into());
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn err(v: Value) -> String {
        CreateOptions::parse(Some(&v)).unwrap_err().message
    }

    #[test]
    fn options_parse_and_each_bad_one_is_named() {
        let o = CreateOptions::parse(Some(&json!({
            "size": "10MiB", "mode": "multi-node-multi-writer", "fs": "ext4",
            "mount-flags": "noatime, nodev", "param.tier": "fast"
        })))
        .unwrap();
        assert_eq!(o.size, Some(Size(10 << 20)));
        assert_eq!(o.mode, Some(AccessMode::MultiNodeMultiWriter));
        assert_eq!(
            o.mount_flags.as_deref(),
            Some(&["noatime".to_string(), "nodev".into()][..])
        );
        assert_eq!(o.parameters.get("tier").map(String::as_str), Some("fast"));
        assert!(err(json!({"colour": "red"})).contains("unknown option colour"));
        assert!(err(json!({"size": "lots"})).contains("option size=lots"));
        assert!(err(json!({"size": "-1"})).contains("option size"));
        assert!(err(json!({"type": "block"})).contains("block"));
        assert!(err(json!({"fs": "block"})).contains("block"));
        assert!(err(json!({"mode": "everyone"})).contains("option mode=everyone"));
        assert!(err(json!({"size": 5})).contains("not a string"));
        assert!(err(json!({"snapshot": "../x"})).contains("option snapshot"));
        assert!(err(json!(["size"])).contains("not an object"));
        assert_eq!(
            CreateOptions::parse(None).unwrap(),
            CreateOptions::default()
        );
    }
}
