//! Volumes made for the workload (issue 41): an allocation's volume request may carry a
//! template instead of naming a volume. The controller makes the volume, named from
//! the allocation and the request, in the topology of the allocation's node (known
//! before any volume is made), and marks it with what it was made for: `ephemeral`
//! volumes are deleted once the allocation's claims are released, `retain` volumes
//! stay and go to the next allocation of the same name.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use super::*;

/// What becomes of a template's volume when its allocation ends.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum VolumeLifecycle {
    /// Deleted (DeleteVolume) once the allocation's claims are released, however it
    /// ended: completed, failed, stopped, lost or deleted.
    #[default]
    Ephemeral,
    /// Kept, for the next allocation of the same name; deleting it is an operator's act.
    Retain,
}

impl std::fmt::Display for VolumeLifecycle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            VolumeLifecycle::Ephemeral => "ephemeral",
            VolumeLifecycle::Retain => "retain",
        })
    }
}

/// The fields of a Volume's spec a request may template.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeTemplate {
    /// The CSI plugin (empty: the class's).
    #[serde(default)]
    pub plugin_id: PluginId,
    /// The VolumeClass that fills what the template leaves empty (none and no plugin:
    /// the default class). A field older controllers refuse: moorctl writes it only
    /// where the leading controller says it knows it (`LeaderRecord::features`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<Name>,
    /// Smallest acceptable capacity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_min: Option<Size>,
    /// Largest acceptable capacity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_max: Option<Size>,
    /// The ways the volume may be used (empty: the request's modes, else
    /// single-node-writer on a file system).
    #[serde(
        default,
        deserialize_with = "crate::api::tight_vec",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub capabilities: Vec<VolumeCapability>,
    /// CreateVolume parameters.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub parameters: BTreeMap<String, String>,
    /// Parameters the plugin may change on a live volume.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub mutable_parameters: BTreeMap<String, String>,
    /// Default mount options.
    #[serde(default, skip_serializing_if = "MountOptions::is_empty")]
    pub mount_options: MountOptions,
    /// Create from a snapshot or clone another volume (in the allocation's namespace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<VolumeSource>,
    /// Ephemeral (the default) or retain.
    #[serde(default)]
    pub lifecycle: VolumeLifecycle,
}

/// What a template's volume was made for: recorded on the volume, which the
/// controller deletes (ephemeral) or hands back (retain) by it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MadeFor {
    /// The allocation (in the volume's namespace).
    pub allocation: Name,
    /// The allocation's uid when it was made (an allocation made again under the same
    /// name is another allocation).
    pub allocation_uid: Uid,
    /// The request.
    pub request: Name,
    /// Ephemeral or retain.
    #[serde(default)]
    pub lifecycle: VolumeLifecycle,
}

impl VolumeTemplate {
    /// The capabilities the volume offers: the template's, else the request's modes
    /// (single-node-writer and file-system where it names none).
    pub fn capabilities(&self, req: &VolumeRequest) -> Vec<VolumeCapability> {
        if !self.capabilities.is_empty() {
            return self.capabilities.clone();
        }
        vec![VolumeCapability {
            access_mode: req.access_mode.unwrap_or(AccessMode::SingleNodeWriter),
            attachment_mode: req.attachment_mode.unwrap_or(AttachmentMode::FileSystem),
        }]
    }

    /// The spec of the volume the template makes for `req`, for a node whose plugin
    /// reports topology `segment` (none: no topology request), marked `made_for`.
    pub fn volume_spec(
        &self,
        req: &VolumeRequest,
        segment: Option<&Topology>,
        made_for: MadeFor,
    ) -> VolumeSpec {
        VolumeSpec {
            plugin_id: self.plugin_id.clone(),
            capacity_min: self.capacity_min,
            capacity_max: self.capacity_max,
            capabilities: self.capabilities(req),
            mount_options: Rare::new(self.mount_options.clone()),
            parameters: Rare::new(self.parameters.clone()),
            mutable_parameters: Rare::new(self.mutable_parameters.clone()),
            source: self.source.clone(),
            class: self.class.clone(),
            topology_request: segment.filter(|s| !s.is_empty()).map(|s| {
                Box::new(TopologyRequest {
                    required: vec![s.clone()],
                    preferred: vec![s.clone()],
                })
            }),
            made_for: Some(Box::new(made_for)),
            ..Default::default()
        }
    }

    /// How a volume the template made before (`existing`, retained for an allocation
    /// of the same name) meets the template now: `Ok(None)` as it is, `Ok(Some(spec))`
    /// grown to a larger `capacity_min` or new mutable parameters (the expansion and
    /// ControllerModifyVolume paths apply it), or why not: a template never silently
    /// changes anything else of an existing volume.
    pub fn meet(
        &self,
        req: &VolumeRequest,
        existing: &VolumeSpec,
    ) -> Result<Option<VolumeSpec>, String> {
        let mut differs = Vec::new();
        if existing.plugin_id != self.plugin_id {
            differs.push("plugin_id");
        }
        if existing.capabilities != self.capabilities(req) {
            differs.push("capabilities");
        }
        if *existing.parameters != self.parameters {
            differs.push("parameters");
        }
        if *existing.mount_options != self.mount_options {
            differs.push("mount_options");
        }
        if existing.source != self.source {
            differs.push("source");
        }
        if existing.capacity_max != self.capacity_max {
            differs.push("capacity_max");
        }
        if matches!((existing.capacity_min, self.capacity_min), (Some(had), Some(want)) if want < had)
        {
            differs.push("capacity_min (volumes do not shrink)");
        }
        if !differs.is_empty() {
            return Err(format!(
                "the template's {} differ from the retained volume's; delete the volume \
                 (moorctl delete volume) to make it anew",
                differs.join(", ")
            ));
        }
        let grows = self.capacity_min > existing.capacity_min;
        let modified = *existing.mutable_parameters != self.mutable_parameters;
        if !grows && !modified {
            return Ok(None);
        }
        let mut next = existing.clone();
        if grows {
            next.capacity_min = self.capacity_min;
        }
        next.mutable_parameters = Rare::new(self.mutable_parameters.clone());
        Ok(Some(next))
    }

    /// Checks the template as the volume it makes would be checked, with `field` (the
    /// request's path) before each field.
    pub fn validate(&self, field: &str, errors: &mut ValidationErrors) {
        let spec = self.volume_spec(&VolumeRequest::default(), None, MadeFor::default());
        let mut own = ValidationErrors::default();
        spec.validate(&mut own);
        for e in own.0 {
            errors.push(format!("{field}.{}", e.field), e.message);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tpl() -> VolumeTemplate {
        VolumeTemplate {
            plugin_id: PluginId::new("p").unwrap(),
            capacity_min: Some(Size(1 << 30)),
            ..Default::default()
        }
    }

    #[test]
    fn a_template_makes_a_volume_in_its_node_s_segment() {
        let req = VolumeRequest {
            access_mode: Some(AccessMode::SingleNodeSingleWriter),
            ..Default::default()
        };
        let seg: Topology = [("zone".to_string(), "b".to_string())].into();
        let made = MadeFor {
            allocation: Name::new("a").unwrap(),
            allocation_uid: "u".into(),
            request: Name::new("scratch").unwrap(),
            lifecycle: VolumeLifecycle::Ephemeral,
        };
        let spec = tpl().volume_spec(&req, Some(&seg), made.clone());
        let t = spec.topology_request.as_deref().unwrap();
        assert_eq!(
            (t.required.as_slice(), t.preferred.as_slice()),
            (&[seg.clone()][..], &[seg][..])
        );
        assert_eq!(
            spec.capabilities[0].access_mode,
            AccessMode::SingleNodeSingleWriter
        );
        assert_eq!(spec.made_for.as_deref(), Some(&made));
        assert!(tpl()
            .volume_spec(&req, None, made)
            .topology_request
            .is_none());
        let mut errors = ValidationErrors::default();
        tpl().validate("volumes[0].template", &mut errors);
        assert!(errors.is_empty(), "{errors:?}");
        // No plugin: the class's (resolved by the controller); a bad one is refused.
        VolumeTemplate::default().validate("volumes[0].template", &mut errors);
        assert!(errors.is_empty(), "{errors:?}");
        VolumeTemplate {
            plugin_id: PluginId::new("p").unwrap(),
            ..Default::default()
        }
        .validate("volumes[0].template", &mut errors);
        let _ = &mut errors;
        let bad: VolumeTemplate = serde_json::from_str(r#"{"plugin_id": "a b"}"#).unwrap();
        bad.validate("volumes[0].template", &mut errors);
        assert!(errors
            .0
            .iter()
            .any(|e| e.field == "volumes[0].template.plugin_id"));
    }

    #[test]
    fn a_retained_volume_grows_with_its_template_and_nothing_else_changes_silently() {
        let req = VolumeRequest::default();
        let existing = tpl().volume_spec(&req, None, MadeFor::default());
        assert_eq!(tpl().meet(&req, &existing), Ok(None));
        let mut bigger = tpl();
        bigger.capacity_min = Some(Size(2 << 30));
        let grown = bigger.meet(&req, &existing).unwrap().unwrap();
        assert_eq!(grown.capacity_min, Some(Size(2 << 30)));
        let mut smaller = tpl();
        smaller.capacity_min = Some(Size(1 << 20));
        assert!(smaller
            .meet(&req, &existing)
            .unwrap_err()
            .contains("shrink"));
        let mut other = tpl();
        other.parameters.insert("tier".into(), "gold".into());
        let why = other.meet(&req, &existing).unwrap_err();
        assert!(
            why.contains("parameters") && why.contains("moorctl delete volume"),
            "{why}"
        );
    }
}
