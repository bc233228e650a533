//! Allocation: a workload placed on a node, with the volumes it requests.
//!
//! Writers: the user or scheduler owns `spec` (including the client status); the
//! controller owns `status`.

use serde::{Deserialize, Serialize};

use super::*;

/// Whether the workload should run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DesiredStatus {
    /// Keep running (the default).
    #[default]
    Run,
    /// Stop: release its claims (`moorctl alloc stop`).
    Stop,
}

/// What the node reports of the workload; `complete`, `failed` and `lost` are terminal.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClientStatus {
    /// Not started yet.
    #[default]
    Pending,
    /// Running.
    Running,
    /// Finished successfully.
    Complete,
    /// Finished with an error.
    Failed,
    /// Its node is gone.
    Lost,
}

/// One volume an allocation asks for.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VolumeRequest {
    /// The request's name within the allocation.
    #[serde(default)]
    pub name: Name,
    /// The volume's id (for `per_alloc`, the prefix of the ids).
    #[serde(default)]
    pub volume: VolumeId,
    /// Mount read-only: a read claim.
    #[serde(default)]
    pub read_only: bool,
    /// The access mode to claim with; the volume's when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_mode: Option<AccessMode>,
    /// The attachment mode to claim with; the volume's when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attachment_mode: Option<AttachmentMode>,
    /// Options that replace the volume's, field by field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mount_options: Option<MountOptions>,
    /// Each allocation gets its own volume, named after the allocation.
    #[serde(default)]
    pub per_alloc: bool,
}

impl VolumeRequest {
    /// Read or write, from `read_only`.
    pub fn claim_mode(&self) -> ClaimMode {
        if self.read_only {
            ClaimMode::Read
        } else {
            ClaimMode::Write
        }
    }
}

/// Desired state of an allocation.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AllocationSpec {
    /// The node it runs on.
    #[serde(default)]
    pub node: NodeName,
    /// Run or stop.
    #[serde(default)]
    pub desired_status: DesiredStatus,
    /// What the node reports.
    #[serde(default)]
    pub client_status: ClientStatus,
    /// The volumes it needs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeRequest>,
}

impl AllocationSpec {
    /// Whether its claims should be released: stopped, or finished for good.
    pub fn is_terminal(&self) -> bool {
        self.desired_status == DesiredStatus::Stop
            || matches!(
                self.client_status,
                ClientStatus::Complete | ClientStatus::Failed | ClientStatus::Lost
            )
    }
}

impl Spec for AllocationSpec {
    const KIND: &'static str = "Allocation";
    const DIR: &'static str = "allocations";
    const NAMESPACED: bool = true;
    type Status = AllocationStatus;

    fn validate(&self, errors: &mut ValidationErrors) {
        errors.check_id("node", self.node.validate());
        for (i, req) in self.volumes.iter().enumerate() {
            errors.check_id(&format!("volumes[{i}].name"), req.name.validate());
            errors.check_id(&format!("volumes[{i}].volume"), req.volume.validate());
            if self.volumes[..i].iter().any(|r| r.name == req.name) {
                errors.push(
                    format!("volumes[{i}].name"),
                    format!("{} is used twice", req.name),
                );
            }
            if let Some(mode) = req.access_mode {
                if !req.read_only && !mode.allows_write() {
                    errors.push(
                        format!("volumes[{i}].access_mode"),
                        format!("{mode} is read-only; set read_only: true"),
                    );
                }
            }
        }
    }
}

/// Where an allocation's claims are.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AllocationPhase {
    /// Claims not yet all published.
    #[default]
    Pending,
    /// Every claim published.
    Ready,
    /// A claim was denied.
    Blocked,
    /// Claims being released.
    Releasing,
    /// Every claim released.
    Released,
}

/// The controller's view of an allocation.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AllocationStatus {
    /// Summary phase.
    #[serde(default)]
    pub phase: AllocationPhase,
    /// Generation, conditions, last error.
    #[serde(flatten)]
    pub meta: StatusMeta,
}

/// An allocation object.
pub type Allocation = Object<AllocationSpec>;

impl Allocation {
    /// The key of allocation `name` in `ns`.
    pub fn key_for(ns: &Namespace, name: impl std::fmt::Display) -> ObjectKey<AllocationSpec> {
        ObjectKey::from_parts(&[ns, &name])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_when_stopped_or_finished() {
        let mut spec = AllocationSpec::default();
        assert!(!spec.is_terminal());
        spec.client_status = ClientStatus::Running;
        assert!(!spec.is_terminal());
        for s in [
            ClientStatus::Complete,
            ClientStatus::Failed,
            ClientStatus::Lost,
        ] {
            spec.client_status = s;
            assert!(spec.is_terminal());
        }
        spec.client_status = ClientStatus::Running;
        spec.desired_status = DesiredStatus::Stop;
        assert!(spec.is_terminal());
    }

    #[test]
    fn requests_are_checked() {
        let json = r#"{"kind":"Allocation","metadata":{"name":"web-1"},"spec":{"node":"local",
          "volumes":[{"name":"data","volume":"db-data","access_mode":"multi-node-reader-only"},
                     {"name":"data","volume":"x/y"}]}}"#;
        let mut a: Allocation = serde_json::from_str(json).unwrap();
        a.apply_defaults();
        let errs = a.validate().unwrap_err().to_string();
        assert!(errs.contains("spec.volumes[0].access_mode"), "{errs}");
        assert!(
            errs.contains("spec.volumes[1].name: data is used twice"),
            "{errs}"
        );
        assert!(errs.contains("spec.volumes[1].volume"), "{errs}");
    }
}
