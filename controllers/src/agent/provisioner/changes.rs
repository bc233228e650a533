//! The provisioner's steps on a volume that exists: a registered volume validated
//! (ValidateVolumeCapabilities, then ControllerGetVolume where offered), an expansion
//! (ControllerExpandVolume) and a change of mutable parameters
//! (ControllerModifyVolume); each recorded on `status.provisioning` as a condition,
//! with the step's failure and retry while it fails.

use super::*;

impl Provisioner {
    /// A registered volume: ValidateVolumeCapabilities with its capabilities,
    /// parameters and context, then ControllerGetVolume where the plugin has
    /// GET_VOLUME. Ready with what the plugin reports, or Failed with its message.
    pub(super) async fn validate(&self, vol: &Volume) -> Result<Action, ProvisionError> {
        const STEP: &str = "ValidateVolumeCapabilities";
        let Some(ext) = vol.spec.external_id.clone() else {
            return Ok(Action::AwaitChange);
        };
        let key = vol.key();
        // Read before the step's gate: a change of the record (an operator's share or
        // choice, the owner gone) is a new input, tried at once.
        let (owner, rec) = self.owner(vol, &ext).await?;
        let inputs = steps::inputs((
            self.inputs(vol),
            rec.as_ref().map(|r| r.metadata.resource_version),
        ));
        let step = self.ctx.steps.begin(&key, STEP, inputs)?;
        // Another volume's plugin volume: refused before any call about it.
        if let owners::Owner::Another(why) = owner {
            let failed = step.fail(owners::owned_elsewhere(STEP, &why));
            return self.failed(vol, failed, VALIDATED).await;
        }
        let csi = self.ctx.csi()?.about(object_ref(vol));
        let for_call = self.ctx.for_family(vol, SecretFamily::Controller).await?;
        let req = requests::validate_volume_capabilities(
            &for_call,
            ext.as_str(),
            self.ctx.multi_writer_cap(),
        )?;
        let get_volume = self.ctx.advertises(ControllerRpc::GetVolume);
        // One step: the capabilities confirmed, then what the plugin reports of it.
        let validated = step.call(async {
            let r = csi.validate_volume_capabilities(req).await?;
            if r.confirmed.is_none() {
                let why = if r.message.is_empty() {
                    "the plugin did not confirm the capabilities".to_string()
                } else {
                    r.message
                };
                return Err(CsiError {
                    rpc: STEP,
                    code: tonic::Code::InvalidArgument,
                    message: why,
                    tries: 1,
                });
            }
            if !get_volume {
                return Ok(None);
            }
            let req = v1::ControllerGetVolumeRequest {
                volume_id: ext.to_string(),
            };
            Ok(csi.controller_get_volume(req).await?.volume)
        });
        let got = match validated.await {
            Ok(got) => got,
            Err(failed) => return self.failed(vol, failed, VALIDATED).await,
        };
        // Validated: this volume's from now on, unless another volume's record came
        // first.
        if let Err(why) = self.take_ownership(vol, &ext, None).await? {
            let failed = self
                .ctx
                .steps
                .begin(&key, STEP, inputs)?
                .fail(owners::owned_elsewhere(STEP, &why));
            return self.failed(vol, failed, VALIDATED).await;
        }
        let was_ready = vol.status.provisioning.phase == VolumePhase::Ready
            && vol.status.provisioning.external_id.as_ref() == Some(&ext);
        self.succeeded(vol, STEP, VALIDATED, "", |p| {
            p.phase = VolumePhase::Ready;
            p.external_id = Some(ext.clone());
            if let Some(v) = &got {
                p.capacity_bytes = (v.capacity_bytes > 0).then_some(v.capacity_bytes as u64);
            }
            p.accessible_topology = if !vol.spec.accessible_topology.is_empty() {
                vol.spec.accessible_topology.clone()
            } else {
                got.iter()
                    .flat_map(|v| &v.accessible_topology)
                    .map(|t| t.segments.clone())
                    .collect()
            };
            p.mutable_parameters = vol.spec.mutable_parameters.clone();
        })
        .await?;
        if !was_ready {
            self.event(
                vol,
                "Volume registered",
                EventType::Normal,
                format!("{ext} validated by the plugin"),
            )
            .await;
        }
        Ok(Action::AwaitChange)
    }

    /// ControllerExpandVolume to `required` (at most `limit`); records the capacity and
    /// whether the nodes must expand too.
    pub(super) async fn expand(
        &self,
        vol: &Volume,
        required: u64,
        limit: u64,
    ) -> Result<Action, ProvisionError> {
        const STEP: &str = "ControllerExpandVolume";
        let Some(ext) = vol.status.provisioning.external_id.clone() else {
            return Ok(Action::AwaitChange);
        };
        let key = vol.key();
        let step = self.ctx.steps.begin(&key, STEP, self.inputs(vol))?;
        // A volume in use is expanded with the capability it is used with.
        let for_call = self.ctx.for_family(vol, SecretFamily::Expand).await?;
        let req = requests::controller_expand(
            &for_call,
            ext.as_str(),
            required,
            limit,
            self.ctx.multi_writer_cap(),
        )?;
        let csi = self.ctx.csi()?.about(object_ref(vol));
        let resp = match step.call(csi.controller_expand(req)).await {
            Ok(r) => r,
            Err(failed) => return self.failed(vol, failed, EXPANDED).await,
        };
        // A plugin may answer 0 (unknown): the request was met.
        let capacity = if resp.capacity_bytes > 0 {
            resp.capacity_bytes as u64
        } else {
            required
        };
        let msg = Size(capacity).to_string();
        self.succeeded(vol, STEP, EXPANDED, &msg, |p| {
            p.capacity_bytes = Some(capacity);
            if resp.node_expansion_required {
                p.node_expansion_bytes = Some(capacity);
            }
        })
        .await?;
        let nodes = if resp.node_expansion_required {
            "; the nodes expand the filesystem"
        } else {
            ""
        };
        self.event(
            vol,
            "Volume expanded",
            EventType::Normal,
            format!("{ext} expanded to {}{nodes}", Size(capacity)),
        )
        .await;
        Ok(Action::AwaitChange)
    }

    /// The expansion that failed (or was refused) is no longer asked for: the request
    /// was lowered to what the volume has. The expansion's failure is cleared (another
    /// step's stays), `Expanded` is true again, and a Normal event says so.
    pub(super) async fn expansion_withdrawn(
        &self,
        vol: &Volume,
        capacity: u64,
    ) -> Result<Action, ProvisionError> {
        const STEP: &str = "ControllerExpandVolume";
        let message = format!(
            "the request is met by the volume's capacity {}: no expansion is owed",
            Size(capacity)
        );
        self.provisioning(vol, |p| {
            if p.meta.retry.as_ref().is_some_and(|r| r.step == STEP) {
                p.meta.clear_failure();
            }
            p.meta
                .set_condition(EXPANDED, true, "ExpansionWithdrawn", &message);
        })
        .await?;
        self.event(
            vol,
            "Volume expansion withdrawn",
            EventType::Normal,
            message,
        )
        .await;
        Ok(Action::AwaitChange)
    }

    /// ControllerModifyVolume with the spec's mutable parameters.
    pub(super) async fn modify(&self, vol: &Volume) -> Result<Action, ProvisionError> {
        const STEP: &str = "ControllerModifyVolume";
        let Some(ext) = vol.status.provisioning.external_id.clone() else {
            return Ok(Action::AwaitChange);
        };
        let key = vol.key();
        let step = self.ctx.steps.begin(&key, STEP, self.inputs(vol))?;
        let params = vol.spec.mutable_parameters.clone();
        let for_call = self.ctx.for_family(vol, SecretFamily::Controller).await?;
        let req = requests::controller_modify(&for_call, ext.as_str())?;
        if let Err(failed) = step.call(self.ctx.csi()?.controller_modify(req)).await {
            return self.failed(vol, failed, MODIFIED).await;
        }
        self.succeeded(vol, STEP, MODIFIED, "", |p| {
            p.mutable_parameters = params.clone();
        })
        .await?;
        let names: Vec<&str> = params.keys().map(String::as_str).collect();
        self.event(
            vol,
            "Volume modified",
            EventType::Normal,
            format!("{ext} now has mutable parameters {}", names.join(", ")),
        )
        .await;
        Ok(Action::AwaitChange)
    }

    /// A step of a volume that succeeded: `f`'s edit of the provisioning section, the
    /// failure cleared, the generation observed, condition `condition` true.
    async fn succeeded(
        &self,
        vol: &Volume,
        step: &'static str,
        condition: &str,
        message: &str,
        mut f: impl FnMut(&mut ProvisioningStatus),
    ) -> Result<(), ProvisionError> {
        let generation = vol.metadata.generation;
        self.provisioning(vol, |p| {
            f(p);
            p.meta.clear_failure();
            p.meta.observed_generation = generation;
            p.meta.set_condition(condition, true, step, message);
        })
        .await?;
        Ok(())
    }

    /// A failed step of a volume: its failure (and the retry it waits for) on the
    /// status, condition `condition` false, a Warning. A final answer to a
    /// registration makes the volume Failed.
    async fn failed(
        &self,
        vol: &Volume,
        failed: Failed,
        condition: &'static str,
    ) -> Result<Action, ProvisionError> {
        let msg = failed.message();
        let refused = condition == VALIDATED && failed.is_final();
        let reason = format!("{}Failed", failed.failure.step);
        self.provisioning(vol, |p| {
            if refused {
                p.phase = VolumePhase::Failed;
            }
            failed.record(&mut p.meta);
            p.meta.set_condition(condition, false, &reason, &msg);
        })
        .await?;
        let reason = match condition {
            VALIDATED => "Volume validation failed",
            EXPANDED => "Volume expansion failed",
            _ => "Volume modification failed",
        };
        self.event(vol, reason, EventType::Warning, msg).await;
        Ok(Action::Requeue(failed.retry_in))
    }
}
