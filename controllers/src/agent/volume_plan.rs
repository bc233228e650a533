//! The provisioner's decision for one volume (pure, unit tested): which controller step
//! it owes now, given the volume and the plugin's advertised controller capabilities.
//! The provisioner executes the step; a step the plugin does not advertise is never
//! called but refused, once, as a condition and a Warning.
//!
//! | volume | step |
//! |---|---|
//! | registered, not validated at this generation | ValidateVolumeCapabilities (+ ControllerGetVolume with GET_VOLUME) |
//! | created, being deleted | DeleteVolume (after the claims) |
//! | created, no finalizer | add `moor.dev/provisioner` |
//! | created, not Ready | CreateVolume |
//! | Ready, `capacity_max` below the capacity | refused: volumes do not shrink |
//! | Ready, `capacity_min` above the capacity | ControllerExpandVolume (EXPAND_VOLUME) |
//! | Ready, no expansion owed, `Expanded` false (a request refused, since lowered) | the failure cleared, `Expanded` true |
//! | Ready, `mutable_parameters` not those accepted | ControllerModifyVolume (MODIFY_VOLUME) |

use moor::api::*;

/// What the provisioner does next for a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Converged.
    Nothing,
    /// Registered: check the plugin knows the volume and can serve the capabilities.
    Validate,
    /// Add the provisioner's finalizer before creating.
    AddFinalizer,
    /// CreateVolume.
    Create,
    /// DeleteVolume (when no claim holds it any more).
    Delete,
    /// ControllerExpandVolume to at least `required` bytes, at most `limit` (0: none).
    Expand {
        /// The new capacity_min.
        required: u64,
        /// capacity_max, or 0.
        limit: u64,
    },
    /// An expansion failed or was refused, and the request was lowered since to what
    /// the volume already has (never below it: volumes do not shrink): nothing is
    /// owed any more, so the failure is cleared and `Expanded` shows true again
    /// (Kubernetes' RecoverVolumeExpansionFailure).
    ExpansionWithdrawn {
        /// The volume's capacity, which meets the request now.
        capacity: u64,
    },
    /// ControllerModifyVolume with the spec's mutable parameters.
    Modify,
    /// A step is owed but cannot be made: shown as condition `condition` false with
    /// `reason` and `message`, and a Warning.
    Refuse {
        /// The condition it shows on.
        condition: &'static str,
        /// Why, machine-readable.
        reason: &'static str,
        /// Why, for a person.
        message: String,
    },
}

/// The condition types the provisioner sets.
pub const VALIDATED: &str = "Validated";
/// See [`VALIDATED`].
pub const EXPANDED: &str = "Expanded";
/// See [`VALIDATED`].
pub const MODIFIED: &str = "Modified";

/// The step owed for `vol`; `caps` are the plugin's advertised capabilities,
/// `capacity` what GetCapacity last said (`None`: not known).
pub fn next(
    vol: &Volume,
    finalizer: &str,
    caps: &PluginCapabilities,
    capacity: Option<&[CapacityEntry]>,
) -> Step {
    let p = &vol.status.provisioning;
    // The spec's two newer single-node modes need SINGLE_NODE_MULTI_WRITER: neither a
    // registration's validation nor a creation asks for them without it.
    let needs_snmw = vol
        .spec
        .capabilities
        .iter()
        .find(|c| c.access_mode.needs_single_node_multi_writer());
    if let Some(c) = needs_snmw.filter(|_| {
        !vol.is_deleting()
            && (p.phase != VolumePhase::Ready
                || p.meta.observed_generation != vol.metadata.generation)
            && !caps.controller.has(ControllerRpc::SingleNodeMultiWriter)
    }) {
        let condition = if vol.spec.external_id.is_some() {
            VALIDATED
        } else {
            "Created"
        };
        let step = Step::Refuse {
            condition,
            reason: "AccessModeUnsupported",
            message: format!(
                "plugin {} does not advertise SINGLE_NODE_MULTI_WRITER: access mode {} cannot be used",
                vol.spec.plugin_id, c.access_mode
            ),
        };
        return refused_once(vol, step);
    }
    if let Some(ext) = &vol.spec.external_id {
        if vol.is_deleting() {
            return Step::Nothing;
        }
        if p.phase != VolumePhase::Ready
            || p.external_id.as_ref() != Some(ext)
            || p.meta.observed_generation != vol.metadata.generation
        {
            return Step::Validate;
        }
        return ready(vol, caps);
    }
    if vol.is_deleting() {
        return Step::Delete;
    }
    if !vol.metadata.finalizers.iter().any(|f| f == finalizer) {
        return Step::AddFinalizer;
    }
    if p.phase != VolumePhase::Ready || p.external_id.is_none() {
        let needs = match &vol.spec.source {
            Some(VolumeSource::Snapshot(_) | VolumeSource::ExternalSnapshotId(_)) => {
                Some((ControllerRpc::CreateDeleteSnapshot, "RestoreUnsupported"))
            }
            Some(VolumeSource::Volume(_)) => Some((ControllerRpc::CloneVolume, "CloneUnsupported")),
            None => None,
        };
        if let Some((cap, reason)) = needs.filter(|(cap, _)| !caps.controller.has(*cap)) {
            let step = Step::Refuse {
                condition: "Created",
                reason,
                message: format!(
                    "plugin {} does not advertise {}",
                    vol.spec.plugin_id,
                    cap.name()
                ),
            };
            return refused_once(vol, step);
        }
        if let Some(message) = capacity.and_then(|c| no_room(vol, c)) {
            let step = Step::Refuse {
                condition: "Created",
                reason: "InsufficientCapacity",
                message,
            };
            return refused_once(vol, step);
        }
        return Step::Create;
    }
    ready(vol, caps)
}

/// Why the volume fits nowhere GetCapacity answered for: its `capacity_min` exceeds
/// what every eligible entry can hold (the entries of its required segments when it
/// has some and they were asked about, else the whole plugin's). `None`: it may fit.
fn no_room(vol: &Volume, capacity: &[CapacityEntry]) -> Option<String> {
    let need = vol.spec.capacity_min?.0;
    let required: Vec<&Topology> = vol
        .spec
        .topology_request
        .iter()
        .flat_map(|t| &t.required)
        .collect();
    let by_segment: Vec<&CapacityEntry> = capacity
        .iter()
        .filter(|e| required.contains(&&e.topology))
        .collect();
    let eligible: Vec<&CapacityEntry> = if by_segment.is_empty() {
        capacity.iter().filter(|e| e.topology.is_empty()).collect()
    } else {
        by_segment
    };
    let best = eligible.iter().map(|e| e.fits()).max()?;
    (best < need).then(|| {
        format!(
            "capacity_min {} does not fit: plugin {} has room for {} at most",
            Size(need),
            vol.spec.plugin_id,
            Size(best)
        )
    })
}

/// The steps of a Ready volume: expansion, then modification.
fn ready(vol: &Volume, caps: &PluginCapabilities) -> Step {
    let controller = &caps.controller;
    // Without the capability a plugin is taken to expand volumes in use (the CSI
    // spec's default for a plugin that does not say).
    let online = !caps.plugin.has(PluginCapability::ExpansionOffline);
    let spec = &vol.spec;
    let p = &vol.status.provisioning;
    let step = match p.capacity_bytes {
        Some(actual) if spec.capacity_max.is_some_and(|max| max.0 < actual) => Step::Refuse {
            condition: EXPANDED,
            reason: "ShrinkRefused",
            message: format!(
                "capacity_max {} is below the volume's capacity {}: volumes do not shrink",
                spec.capacity_max.unwrap_or_default(),
                Size(actual)
            ),
        },
        Some(actual) if spec.capacity_min.is_some_and(|min| min.0 > actual) => {
            let claimed = !vol.status.claims.read_claims.is_empty()
                || !vol.status.claims.write_claims.is_empty();
            if controller.has(ControllerRpc::ExpandVolume) && claimed && !online {
                Step::Refuse {
                    condition: EXPANDED,
                    reason: "ExpansionWaitsForRelease",
                    message: format!(
                        "plugin {} expands only volumes not in use (no VOLUME_EXPANSION ONLINE)",
                        spec.plugin_id
                    ),
                }
            } else if controller.has(ControllerRpc::ExpandVolume) {
                Step::Expand {
                    required: spec.capacity_min.map(|s| s.0).unwrap_or_default(),
                    limit: spec.capacity_max.map(|s| s.0).unwrap_or_default(),
                }
            } else {
                Step::Refuse {
                    condition: EXPANDED,
                    reason: "ExpansionUnsupported",
                    message: format!("plugin {} does not advertise EXPAND_VOLUME", spec.plugin_id),
                }
            }
        }
        Some(actual) => {
            let refused = p
                .meta
                .conditions
                .iter()
                .any(|c| c.type_ == EXPANDED && !c.status);
            if refused {
                Step::ExpansionWithdrawn { capacity: actual }
            } else {
                Step::Nothing
            }
        }
        None => Step::Nothing,
    };
    if step != Step::Nothing {
        return refused_once(vol, step);
    }
    if spec.mutable_parameters != p.mutable_parameters {
        let removed: Vec<&str> = p
            .mutable_parameters
            .keys()
            .filter(|k| !spec.mutable_parameters.contains_key(*k))
            .map(String::as_str)
            .collect();
        let step = if !removed.is_empty() {
            // CSI can set a mutable parameter, not unset one.
            Step::Refuse {
                condition: MODIFIED,
                reason: "ParameterRemovalUnsupported",
                message: format!(
                    "mutable parameters cannot be removed ({}); set them to another value",
                    removed.join(", ")
                ),
            }
        } else if controller.has(ControllerRpc::ModifyVolume) {
            Step::Modify
        } else {
            Step::Refuse {
                condition: MODIFIED,
                reason: "ModifyUnsupported",
                message: format!("plugin {} does not advertise MODIFY_VOLUME", spec.plugin_id),
            }
        };
        return refused_once(vol, step);
    }
    Step::Nothing
}

/// Whether nothing is owed for `vol` whatever the plugin advertises and GetCapacity
/// said: [`next`] is `Nothing` for every `caps` and `capacity`. A created or registered
/// volume, Ready at its generation, with its finalizer, no expansion or modification
/// owed and no refused expansion shown. The provisioner skips such a volume (its
/// cache keeps only this answer, `VolumeView::at_rest`, and drops the whole volume);
/// every other volume is kept whole and given to `next`. False for some volumes that
/// owe nothing (a refusal already shown): they cost a pass and their whole object,
/// never a missed step.
pub fn at_rest(vol: &Volume, finalizer: &str) -> bool {
    let (spec, p) = (&vol.spec, &vol.status.provisioning);
    let identified = match &spec.external_id {
        Some(ext) => p.external_id.as_ref() == Some(ext),
        None => p.external_id.is_some() && vol.metadata.finalizers.iter().any(|f| f == finalizer),
    };
    let capacity_met = p.capacity_bytes.is_none_or(|actual| {
        spec.capacity_max.is_none_or(|max| max.0 >= actual)
            && spec.capacity_min.is_none_or(|min| min.0 <= actual)
            && !p
                .meta
                .conditions
                .iter()
                .any(|c| c.type_ == EXPANDED && !c.status)
    });
    !vol.is_deleting()
        && identified
        && p.phase == VolumePhase::Ready
        && p.meta.observed_generation == vol.metadata.generation
        && capacity_met
        && spec.mutable_parameters == p.mutable_parameters
}

/// A refusal already shown (same condition, reason and message) is not shown again.
fn refused_once(vol: &Volume, step: Step) -> Step {
    if let Step::Refuse {
        condition,
        reason,
        message,
    } = &step
    {
        let shown = vol.status.provisioning.meta.conditions.iter().any(|c| {
            c.type_ == *condition && !c.status && c.reason == *reason && c.message == *message
        });
        if shown {
            return Step::Nothing;
        }
    }
    step
}

#[cfg(test)]
mod tests {
    use super::*;

    const F: &str = "moor.dev/provisioner";

    fn caps(rpcs: &[ControllerRpc]) -> PluginCapabilities {
        PluginCapabilities {
            controller: rpcs.iter().copied().collect(),
            ..Default::default()
        }
    }

    fn ready_volume() -> Volume {
        let mut v = Volume::new(
            &Namespace::default_ns(),
            Name::new("v").unwrap(),
            VolumeSpec {
                plugin_id: PluginId::new("p").unwrap(),
                capacity_min: Some(Size(100)),
                ..Default::default()
            },
        );
        v.metadata.finalizers.push(F.into());
        v.metadata.generation = 2;
        let p = &mut v.status.provisioning;
        p.phase = VolumePhase::Ready;
        p.external_id = Some(ExternalVolumeId::new("e1").unwrap());
        p.capacity_bytes = Some(100);
        v
    }

    /// `at_rest` holds for a converged volume and for none of a set of volumes each
    /// one edit away from it; wherever it holds, `next` owes nothing under every set
    /// of capabilities and capacity answers tried (every combination of the edits).
    #[test]
    fn a_volume_at_rest_owes_nothing_whatever_the_plugin_says() {
        let mut at_rest_volume = ready_volume();
        at_rest_volume.status.provisioning.meta.observed_generation = 2;
        let registered = {
            let mut v = at_rest_volume.clone();
            v.spec.external_id = v.status.provisioning.external_id.clone();
            v.metadata.finalizers.clear();
            v
        };
        type Edit = (&'static str, fn(&mut Volume));
        let edits: Vec<Edit> = vec![
            ("deleting", |v| {
                v.metadata.deletion_timestamp = Some(Timestamp::now())
            }),
            ("no finalizer", |v| v.metadata.finalizers.clear()),
            ("creating", |v| {
                v.status.provisioning.phase = VolumePhase::Creating
            }),
            ("no id", |v| v.status.provisioning.external_id = None),
            ("another id registered", |v| {
                v.spec.external_id = Some(ExternalVolumeId::new("other").unwrap())
            }),
            ("spec edited", |v| v.metadata.generation = 3),
            ("expansion owed", |v| v.spec.capacity_min = Some(Size(200))),
            ("shrink asked", |v| v.spec.capacity_max = Some(Size(50))),
            ("expansion refused", |v| {
                v.status
                    .provisioning
                    .meta
                    .set_condition(EXPANDED, false, "X", "m")
            }),
            ("modification owed", |v| {
                v.spec.mutable_parameters =
                    std::collections::BTreeMap::from([("iops".into(), "1".into())]).into()
            }),
            ("single-node-multi-writer", |v| {
                v.spec.capabilities = vec![VolumeCapability {
                    access_mode: AccessMode::SingleNodeMultiWriter,
                    attachment_mode: AttachmentMode::FileSystem,
                }]
            }),
            ("restored", |v| {
                v.spec.source = Some(VolumeSource::Snapshot(Name::new("s").unwrap()))
            }),
        ];
        let every: Vec<ControllerRpc> = (0..64)
            .filter_map(|i| ControllerRpc::try_from(i).ok())
            .collect();
        let mut capses = vec![caps(&[]), caps(&every)];
        capses.extend(every.iter().map(|r| caps(&[*r])));
        let mut offline = caps(&every);
        offline.plugin = [PluginCapability::ExpansionOffline].into_iter().collect();
        capses.push(offline);
        let tiny = [CapacityEntry::default()];
        let answers: [Option<&[CapacityEntry]>; 3] = [None, Some(&[]), Some(&tiny)];
        assert!(at_rest(&at_rest_volume, F) && at_rest(&registered, F));
        let mut seen_at_rest = 0;
        for base in [&at_rest_volume, &registered] {
            for (name, edit) in &edits {
                let mut v = base.clone();
                edit(&mut v);
                let untouched = matches!(*name, "single-node-multi-writer" | "restored")
                    || (base.spec.external_id.is_some() && *name == "no finalizer");
                assert_eq!(at_rest(&v, F), untouched, "{name}");
            }
            // Every combination of the edits: at rest implies nothing owed.
            for mask in 0u32..(1 << edits.len()) {
                let mut v = base.clone();
                for (i, (_, edit)) in edits.iter().enumerate() {
                    if mask & (1 << i) != 0 {
                        edit(&mut v);
                    }
                }
                if !at_rest(&v, F) {
                    continue;
                }
                seen_at_rest += 1;
                for c in &capses {
                    for capacity in answers {
                        assert_eq!(next(&v, F, c, capacity), Step::Nothing, "{mask:b}");
                    }
                }
            }
        }
        assert!(seen_at_rest > 4, "the combinations reach volumes at rest");
    }

    #[test]
    fn a_created_volume_goes_through_finalizer_create_and_delete() {
        let mut v = ready_volume();
        assert_eq!(next(&v, F, &caps(&[]), None), Step::Nothing);
        v.status.provisioning.phase = VolumePhase::Creating;
        assert_eq!(next(&v, F, &caps(&[]), None), Step::Create);
        v.metadata.finalizers.clear();
        assert_eq!(next(&v, F, &caps(&[]), None), Step::AddFinalizer);
        v.metadata.deletion_timestamp = Some(Timestamp::now());
        assert_eq!(next(&v, F, &caps(&[]), None), Step::Delete);
    }

    #[test]
    fn the_newer_single_node_modes_are_not_asked_of_a_plugin_without_the_capability() {
        let mut v = ready_volume();
        v.status.provisioning.phase = VolumePhase::Pending;
        v.spec.capabilities = vec![VolumeCapability {
            access_mode: AccessMode::SingleNodeSingleWriter,
            attachment_mode: AttachmentMode::FileSystem,
        }];
        let Step::Refuse {
            condition,
            reason,
            message,
        } = next(&v, F, &caps(&[]), None)
        else {
            panic!("CreateVolume asked for a mode the plugin does not serve");
        };
        assert_eq!((condition, reason), ("Created", "AccessModeUnsupported"));
        assert!(message.contains("SINGLE_NODE_MULTI_WRITER"), "{message}");
        assert_eq!(
            next(&v, F, &caps(&[ControllerRpc::SingleNodeMultiWriter]), None),
            Step::Create
        );
        // A registration is not validated with it either.
        v.spec.external_id = Some(ExternalVolumeId::new("e1").unwrap());
        assert!(matches!(
            next(&v, F, &caps(&[]), None),
            Step::Refuse {
                condition: VALIDATED,
                ..
            }
        ));
    }

    #[test]
    fn a_volume_that_fits_nowhere_is_refused_before_create_volume() {
        let mut v = ready_volume();
        v.status.provisioning.phase = VolumePhase::Pending;
        let whole = |avail: u64| CapacityEntry {
            available_bytes: avail,
            ..Default::default()
        };
        // Unknown capacity, or room enough: create.
        assert_eq!(next(&v, F, &caps(&[]), None), Step::Create);
        assert_eq!(next(&v, F, &caps(&[]), Some(&[whole(100)])), Step::Create);
        assert!(matches!(
            next(&v, F, &caps(&[]), Some(&[whole(99)])),
            Step::Refuse {
                reason: "InsufficientCapacity",
                ..
            }
        ));
        // The maximum volume size bounds it too.
        let capped = CapacityEntry {
            available_bytes: 1000,
            maximum_volume_size: Some(50),
            ..Default::default()
        };
        assert!(matches!(
            next(&v, F, &caps(&[]), Some(&[capped])),
            Step::Refuse { .. }
        ));
        // A required segment with room is enough, whatever the whole says.
        let zone: Topology = [("zone".to_string(), "a".to_string())].into();
        v.spec.topology_request = Some(Box::new(TopologyRequest {
            required: vec![zone.clone()],
            preferred: Vec::new(),
        }));
        let in_zone = CapacityEntry {
            topology: zone,
            available_bytes: 500,
            ..Default::default()
        };
        assert_eq!(
            next(&v, F, &caps(&[]), Some(&[whole(10), in_zone])),
            Step::Create
        );
    }

    #[test]
    fn restoring_and_cloning_need_their_capabilities() {
        let mut v = ready_volume();
        v.status.provisioning.phase = VolumePhase::Pending;
        v.spec.source = Some(VolumeSource::Snapshot(Name::new("s").unwrap()));
        assert!(matches!(
            next(&v, F, &caps(&[]), None),
            Step::Refuse {
                reason: "RestoreUnsupported",
                ..
            }
        ));
        assert_eq!(
            next(&v, F, &caps(&[ControllerRpc::CreateDeleteSnapshot]), None),
            Step::Create
        );
        v.spec.source = Some(VolumeSource::Volume(VolumeId::new("w").unwrap()));
        assert!(matches!(
            next(&v, F, &caps(&[ControllerRpc::CreateDeleteSnapshot]), None),
            Step::Refuse {
                reason: "CloneUnsupported",
                ..
            }
        ));
        assert_eq!(
            next(&v, F, &caps(&[ControllerRpc::CloneVolume]), None),
            Step::Create
        );
    }

    #[test]
    fn a_registered_volume_is_validated_once_per_generation() {
        let mut v = ready_volume();
        v.spec.external_id = Some(ExternalVolumeId::new("e1").unwrap());
        v.status.provisioning.phase = VolumePhase::Pending;
        assert_eq!(next(&v, F, &caps(&[]), None), Step::Validate);
        v.status.provisioning.phase = VolumePhase::Ready;
        assert_eq!(
            next(&v, F, &caps(&[]), None),
            Step::Validate,
            "older generation"
        );
        v.status.provisioning.meta.observed_generation = 2;
        assert_eq!(next(&v, F, &caps(&[]), None), Step::Nothing);
        v.spec.external_id = Some(ExternalVolumeId::new("e2").unwrap());
        assert_eq!(next(&v, F, &caps(&[]), None), Step::Validate, "another id");
        v.metadata.deletion_timestamp = Some(Timestamp::now());
        assert_eq!(
            next(&v, F, &caps(&[]), None),
            Step::Nothing,
            "never deleted"
        );
    }

    #[test]
    fn expansion_is_gated_on_the_capability_and_shrinking_is_refused() {
        let mut v = ready_volume();
        v.spec.capacity_min = Some(Size(300));
        v.spec.capacity_max = Some(Size(400));
        assert_eq!(
            next(&v, F, &caps(&[ControllerRpc::ExpandVolume]), None),
            Step::Expand {
                required: 300,
                limit: 400
            }
        );
        let refused = next(&v, F, &caps(&[]), None);
        let Step::Refuse {
            condition,
            reason,
            ref message,
        } = refused
        else {
            panic!("{refused:?}")
        };
        assert_eq!((condition, reason), (EXPANDED, "ExpansionUnsupported"));
        // Shown once: the same refusal on the status is not repeated.
        v.status
            .provisioning
            .meta
            .set_condition(condition, false, reason, message);
        assert_eq!(next(&v, F, &caps(&[]), None), Step::Nothing);
        v.spec.capacity_min = Some(Size(50));
        v.spec.capacity_max = Some(Size(60));
        assert!(matches!(
            next(&v, F, &caps(&[ControllerRpc::ExpandVolume]), None),
            Step::Refuse {
                reason: "ShrinkRefused",
                ..
            }
        ));
        v.spec.capacity_max = None;
        // Nothing is owed now, but the status still shows the earlier refusal: it is
        // withdrawn once, then nothing.
        assert_eq!(
            next(&v, F, &caps(&[ControllerRpc::ExpandVolume]), None),
            Step::ExpansionWithdrawn { capacity: 100 }
        );
        v.status
            .provisioning
            .meta
            .set_condition(EXPANDED, true, "ExpansionWithdrawn", "met");
        assert_eq!(
            next(&v, F, &caps(&[ControllerRpc::ExpandVolume]), None),
            Step::Nothing
        );
        // An OFFLINE plugin expands a volume only while no claim holds it.
        v.spec.capacity_min = Some(Size(300));
        let mut offline = caps(&[ControllerRpc::ExpandVolume]);
        offline.plugin.insert(PluginCapability::ExpansionOffline);
        v.status.claims.write_claims.push(ClaimRef {
            allocation: AllocationId::new("a").unwrap(),
            claim: Name::new("a.data").unwrap(),
            node: NodeName::new("n").unwrap(),
            mode: ClaimMode::Write,
            access_mode: None,
        });
        assert!(matches!(
            next(&v, F, &offline, None),
            Step::Refuse {
                reason: "ExpansionWaitsForRelease",
                ..
            }
        ));
        v.status.claims.write_claims.clear();
        assert!(matches!(next(&v, F, &offline, None), Step::Expand { .. }));
    }

    #[test]
    fn modification_follows_expansion_and_is_gated() {
        let mut v = ready_volume();
        v.spec
            .mutable_parameters
            .insert("iops".into(), "100".into());
        assert_eq!(
            next(&v, F, &caps(&[ControllerRpc::ModifyVolume]), None),
            Step::Modify
        );
        assert!(matches!(
            next(&v, F, &caps(&[]), None),
            Step::Refuse {
                reason: "ModifyUnsupported",
                ..
            }
        ));
        v.spec.capacity_min = Some(Size(200));
        assert!(matches!(
            next(
                &v,
                F,
                &caps(&[ControllerRpc::ModifyVolume, ControllerRpc::ExpandVolume]),
                None
            ),
            Step::Expand { .. }
        ));
        v.status.provisioning.capacity_bytes = Some(200);
        v.status.provisioning.mutable_parameters = v.spec.mutable_parameters.clone();
        assert_eq!(
            next(
                &v,
                F,
                &caps(&[ControllerRpc::ModifyVolume, ControllerRpc::ExpandVolume]),
                None
            ),
            Step::Nothing
        );
        v.spec.mutable_parameters.clear();
        assert!(matches!(
            next(&v, F, &caps(&[ControllerRpc::ModifyVolume]), None),
            Step::Refuse {
                reason: "ParameterRemovalUnsupported",
                ..
            }
        ));
        v.spec.mutable_parameters = v.status.provisioning.mutable_parameters.clone();
        assert_eq!(
            next(
                &v,
                F,
                &caps(&[ControllerRpc::ModifyVolume, ControllerRpc::ExpandVolume]),
                None
            ),
            Step::Nothing
        );
    }

    #[test]
    fn a_refused_expansion_recovers_when_the_request_is_lowered() {
        let expand = caps(&[ControllerRpc::ExpandVolume]);
        let mut v = ready_volume();
        v.spec.capacity_min = Some(Size(1000));
        assert!(matches!(
            next(&v, F, &expand, None),
            Step::Expand { required: 1000, .. }
        ));
        // The plugin refused it for good.
        let meta = &mut v.status.provisioning.meta;
        meta.set_condition(EXPANDED, false, "ControllerExpandVolumeFailed", "too big");
        meta.last_error = Some("too big".into());
        // Still asked for: still owed (the step's gate decides when).
        assert!(matches!(next(&v, F, &expand, None), Step::Expand { .. }));
        // Lowered to a size the plugin takes: expanded to it.
        v.spec.capacity_min = Some(Size(200));
        assert!(matches!(
            next(&v, F, &expand, None),
            Step::Expand { required: 200, .. }
        ));
        // Lowered to what the volume has, or below (it does not shrink): withdrawn.
        for min in [100, 50] {
            v.spec.capacity_min = Some(Size(min));
            assert_eq!(
                next(&v, F, &expand, None),
                Step::ExpansionWithdrawn { capacity: 100 },
                "capacity_min {min}"
            );
        }
        // Never expanded, never refused: nothing.
        let mut fresh = ready_volume();
        fresh.spec.capacity_min = Some(Size(50));
        assert_eq!(next(&fresh, F, &expand, None), Step::Nothing);
    }
}
