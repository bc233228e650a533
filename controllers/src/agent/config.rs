//! `--plugin`: one configured plugin, parsed from its option string.

use moor::api::*;
use std::path::PathBuf;

/// One configured plugin.
#[derive(Debug, Clone, PartialEq)]
pub struct PluginConfig {
    /// The plugin id (the name volumes use in `plugin_id`).
    pub id: PluginId,
    /// Which services this instance serves.
    pub plugin_type: PluginType,
    /// `unix:///path`.
    pub endpoint: String,
    /// Host directory under which staging and target paths are made.
    pub mount_dir: PathBuf,
    /// The same directory as the plugin sees it (containerised plugins).
    pub container_mount_dir: PathBuf,
    /// `serialize-per-node=true`: one ControllerPublish or ControllerUnpublish at a
    /// time per node of this plugin (for plugins that fail when two volumes attach to
    /// one node at once); off by default. The agent leading the plugin's controller
    /// election applies its own setting.
    pub serialize_per_node: bool,
    /// `selinux-mount=true`: the node plugin takes SELinux labels as the mount flag
    /// `context="..."` of NodeStage/NodePublish (a claim's `selinux_label`); off by
    /// default, when a label is never sent to it.
    pub selinux_mount: bool,
}

impl PluginConfig {
    /// Whether this instance serves the node service.
    pub fn is_node(&self) -> bool {
        matches!(self.plugin_type, PluginType::Node | PluginType::Monolith)
    }

    /// Whether this instance serves the controller service.
    pub fn is_controller(&self) -> bool {
        matches!(
            self.plugin_type,
            PluginType::Controller | PluginType::Monolith
        )
    }
}

impl std::str::FromStr for PluginConfig {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (mut id, mut ty, mut endpoint, mut mount_dir, mut container) =
            (None, None, None, None, None);
        let (mut serialize_per_node, mut selinux_mount) = (false, false);
        for part in s.split(',').filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("{part:?} is not key=value"))?;
            match k {
                "id" => id = Some(PluginId::new(v).map_err(|e| format!("id: {e}"))?),
                "type" => {
                    ty = Some(match v {
                        "node" => PluginType::Node,
                        "controller" => PluginType::Controller,
                        "monolith" => PluginType::Monolith,
                        _ => return Err(format!("type {v:?} is not node, controller or monolith")),
                    })
                }
                "endpoint" => {
                    if !v.starts_with("unix:///") {
                        return Err(format!("endpoint {v:?} is not unix:///PATH"));
                    }
                    endpoint = Some(v.to_string())
                }
                "mount-dir" => mount_dir = Some(PathBuf::from(v)),
                "container-mount-dir" => container = Some(PathBuf::from(v)),
                "serialize-per-node" => serialize_per_node = on_off(k, v)?,
                "selinux-mount" => selinux_mount = on_off(k, v)?,
                _ => return Err(format!("unknown plugin option {k:?}")),
            }
        }
        let id = id.ok_or("id= is required")?;
        let plugin_type = ty.ok_or("type= is required")?;
        let endpoint = endpoint.ok_or("endpoint= is required")?;
        let mount_dir = match mount_dir {
            Some(d) => d,
            None if plugin_type == PluginType::Controller => PathBuf::new(),
            None => return Err("mount-dir= is required for a node plugin".into()),
        };
        if plugin_type != PluginType::Controller && !mount_dir.is_absolute() {
            return Err(format!("mount-dir {} is not absolute", mount_dir.display()));
        }
        let container_mount_dir = container.unwrap_or_else(|| mount_dir.clone());
        Ok(PluginConfig {
            id,
            plugin_type,
            endpoint,
            mount_dir,
            container_mount_dir,
            serialize_per_node,
            selinux_mount,
        })
    }
}

/// A `--plugin` option's `true` or `false`.
fn on_off(option: &str, value: &str) -> Result<bool, String> {
    match value {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(format!("{option} {value:?} is not true or false")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plugin_flags_parse_and_explain_mistakes() {
        let p: PluginConfig =
            "id=hostpath.moor.dev,type=monolith,endpoint=unix:///run/p.sock,mount-dir=/var/lib/moor"
                .parse()
                .unwrap();
        assert_eq!(p.container_mount_dir, PathBuf::from("/var/lib/moor"));
        assert!(p.is_node() && p.is_controller());
        let p: PluginConfig =
            "id=x,type=node,endpoint=unix:///s,mount-dir=/h,container-mount-dir=/c"
                .parse()
                .unwrap();
        assert_eq!(p.container_mount_dir, PathBuf::from("/c"));
        let c: PluginConfig = "id=x,type=controller,endpoint=unix:///s".parse().unwrap();
        assert!(!c.is_node());
        assert!(!c.serialize_per_node, "off unless asked");
        let c: PluginConfig = "id=x,type=controller,endpoint=unix:///s,serialize-per-node=true"
            .parse()
            .unwrap();
        assert!(c.serialize_per_node);
        for (bad, says) in [
            ("type=node,endpoint=unix:///s,mount-dir=/h", "id="),
            ("id=x,type=nope,endpoint=unix:///s,mount-dir=/h", "type"),
            ("id=x,type=node,endpoint=tcp://h,mount-dir=/h", "endpoint"),
            ("id=x,type=node,endpoint=unix:///s", "mount-dir"),
            (
                "id=x,type=node,endpoint=unix:///s,mount-dir=rel",
                "absolute",
            ),
            (
                "id=x,type=node,endpoint=unix:///s,mount-dir=/h,colour=red",
                "colour",
            ),
            (
                "id=x,type=controller,endpoint=unix:///s,serialize-per-node=yes",
                "serialize-per-node",
            ),
        ] {
            let e = bad.parse::<PluginConfig>().unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
