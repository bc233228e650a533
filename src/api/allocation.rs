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

/// How a workload ended, as its runner saw it (`moorctl alloc run` records it with a
/// terminal client status).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientExit {
    /// The exit code, when it exited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<i32>,
    /// The signal that ended it (e.g. `SIGKILL`), when one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<String>,
}

impl std::fmt::Display for ClientExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.code, &self.signal) {
            (_, Some(sig)) => write!(f, "killed by {sig}"),
            (Some(code), None) => write!(f, "exit code {code}"),
            (None, None) => write!(f, "unknown"),
        }
    }
}

/// One volume an allocation asks for.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VolumeRequest {
    /// The request's name within the allocation.
    #[serde(default)]
    pub name: Name,
    /// The volume's id (for `per_alloc`, the prefix of the ids); none with a template.
    #[serde(default, skip_serializing_if = "VolumeId::is_empty")]
    pub volume: VolumeId,
    /// A volume made for this request instead of a named one (issue 41): created in
    /// the node's topology, named `<allocation>.<request>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<Box<VolumeTemplate>>,
    /// Mount read-only: a read claim.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
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
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
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
    /// How the workload ended (with a terminal client status).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit: Option<ClientExit>,
    /// The volumes it needs.
    #[serde(
        default,
        deserialize_with = "crate::api::tight_vec",
        skip_serializing_if = "Vec::is_empty"
    )]
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
    const ALIASES: &'static [&'static str] = &["alloc", "allocs"];
    const PHASE: Option<&'static str> = Some("/status/phase");
    const CHECKED: bool = true;
    const AGENT: AgentAccess = AgentAccess::None;
    type Status = AllocationStatus;

    fn validate(&self, errors: &mut ValidationErrors) {
        errors.check_id("node", self.node.validate());
        if self.volumes.len() > MAX_VOLUME_REQUESTS {
            errors.push(
                "volumes",
                format!(
                    "{} requests; an allocation may make at most {MAX_VOLUME_REQUESTS}",
                    self.volumes.len()
                ),
            );
            return;
        }
        for (i, req) in self.volumes.iter().enumerate() {
            errors.check_id(&format!("volumes[{i}].name"), req.name.validate());
            match &req.template {
                None => errors.check_id(&format!("volumes[{i}].volume"), req.volume.validate()),
                Some(t) => {
                    if !req.volume.as_str().is_empty() {
                        errors.push(
                            format!("volumes[{i}].volume"),
                            "is set beside a template; a template's volume is named after the allocation and request",
                        );
                    }
                    if req.per_alloc {
                        errors.push(
                            format!("volumes[{i}].per_alloc"),
                            "is implied by a template (its volume is the allocation's own)",
                        );
                    }
                    t.validate(&format!("volumes[{i}].template"), errors);
                }
            }
            if let Some(Err(e)) = req.mount_options.as_ref().map(MountOptions::check) {
                errors.push(format!("volumes[{i}].mount_options"), e);
            }
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

/// The most volume requests one allocation may make (a node attaches far fewer).
pub const MAX_VOLUME_REQUESTS: usize = 128;

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
    /// Set by the controller when the allocation's runner stopped renewing its Lease
    /// for the lease's duration: the workload is lost (Nomad's meaning) and its claims
    /// are released. Never unset.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub lost: bool,
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

    /// Whether its claims should be released: stopped, finished, or lost.
    pub fn is_terminal(&self) -> bool {
        self.spec.is_terminal() || self.status.lost
    }

    /// Whether this allocation still wants its claim named `claim`: neither deleting nor
    /// terminal, and one of its requests makes that claim.
    pub fn wants(&self, claim: &Name) -> bool {
        !self.is_deleting()
            && !self.is_terminal()
            && self.requests().iter().any(|(name, _)| name == claim)
    }

    /// The client status as moor knows it: the runner's, or `lost` once the controller
    /// found its lease expired while the runner had not ended it.
    pub fn client_status(&self) -> ClientStatus {
        if self.status.lost && !self.spec.is_terminal() {
            ClientStatus::Lost
        } else {
            self.spec.client_status
        }
    }

    /// The claims the allocation asks for: (claim name, volume id) per request.
    pub fn requests(&self) -> Vec<(Name, VolumeId)> {
        self.spec
            .volumes
            .iter()
            .filter_map(|req| Some((self.claim_name(req)?, self.request_volume(req)?)))
            .collect()
    }

    /// The claim a request makes on `volume` (the request's volume), as the controller
    /// creates it: the mode, the request's access and attachment modes (absent: the
    /// volume's), the merged mount options, the volume's plugin. `None` when the
    /// request's names do not fit the id rule.
    pub fn claim_for(&self, req: &VolumeRequest, volume: &Volume) -> Option<Claim> {
        let spec = ClaimSpec {
            allocation: AllocationId::new(self.metadata.name.as_str()).ok()?,
            request: req.name.clone(),
            volume: self.request_volume(req)?,
            node: self.spec.node.clone(),
            plugin_id: volume.spec.plugin_id.clone(),
            mode: req.claim_mode(),
            access_mode: req.access_mode,
            attachment_mode: req.attachment_mode,
            mount_options: MountOptions::merge(
                &volume.spec.mount_options,
                req.mount_options.as_ref(),
            )
            .into(),
            ..Default::default()
        };
        Some(Claim::new(
            &self.metadata.namespace,
            self.claim_name(req)?,
            spec,
        ))
    }

    /// The name of the claim for a request: `<allocation>.<request>`, bounded.
    pub fn claim_name(&self, req: &VolumeRequest) -> Option<Name> {
        Name::new(bounded_name(
            &[self.metadata.name.as_str(), req.name.as_str()],
            ".",
        ))
        .ok()
    }

    /// The volume a request claims: a per_alloc request its own `<volume>-<allocation>`,
    /// a template's the one made for it, `<allocation>.<request>` (bounded).
    pub fn request_volume(&self, req: &VolumeRequest) -> Option<VolumeId> {
        if req.template.is_some() {
            VolumeId::new(bounded_name(
                &[self.metadata.name.as_str(), req.name.as_str()],
                ".",
            ))
            .ok()
        } else if req.per_alloc {
            VolumeId::new(format!("{}-{}", req.volume, self.metadata.name)).ok()
        } else {
            Some(req.volume.clone())
        }
    }
}

/// FNV-1a, 64 bits: a stable hash for shortening names (std's hasher may change).
pub fn fnv1a(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// A name within the id rule: `parts` joined by `sep`, or, when longer than 128, a
/// prefix and a hash of the whole.
pub fn bounded_name(parts: &[&str], sep: &str) -> String {
    let full = parts.join(sep);
    if full.len() <= 128 {
        return full;
    }
    let hash = format!("{sep}{:016x}", fnv1a(&full));
    let keep: String = full.chars().take(128 - hash.len()).collect();
    format!("{keep}{hash}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_names_stay_within_the_id_rule() {
        assert_eq!(bounded_name(&["web-1", "data"], "."), "web-1.data");
        let long = "a".repeat(120);
        let n = bounded_name(&[&long, "data-volume"], ".");
        assert_eq!(n.len(), 128);
        assert!(Name::new(n.clone()).is_ok());
        assert_ne!(
            n,
            bounded_name(&[&long, "data-volume2"], "."),
            "distinct requests stay distinct"
        );
    }

    #[test]
    fn per_alloc_requests_claim_the_allocation_s_own_volume() {
        let mut a = Allocation::new(
            &Namespace::default_ns(),
            Name::new("web-1").unwrap(),
            AllocationSpec::default(),
        );
        a.spec.volumes.push(VolumeRequest {
            name: Name::new("data").unwrap(),
            volume: VolumeId::new("db").unwrap(),
            per_alloc: true,
            ..Default::default()
        });
        let r = a.requests();
        assert_eq!(r[0].0.as_str(), "web-1.data");
        assert_eq!(r[0].1.as_str(), "db-web-1");
    }

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
