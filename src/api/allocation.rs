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
    /// Each allocation gets its own volume, `<volume>.<allocation>` (see
    /// [`Allocation::request_volume`]).
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

/// The label on an engine's hold (the allocation a Docker or Podman container's volume
/// runs under), valued with the engine: never stopped under the live container by a
/// drain.
pub const ENGINE_HOLD_LABEL: &str = "moor.dev/hold";

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
    /// The cgroup (v2; its path in the hierarchy, last component `moor-workload-…`)
    /// every process of the workload runs in, written by `moorctl alloc run` with
    /// `client_status: running`. The controller copies it onto the claims it releases
    /// and the node's agent kills what is left in it before NodeUnpublish, only when
    /// its name carries this allocation's owner tag (`moor::workload::cgroup`): a
    /// request, never proof that the cgroup is this allocation's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload_cgroup: Option<String>,
    /// How long the workload has between SIGTERM and SIGKILL when it is asked to stop
    /// (`desired_status: stop` while it runs), as Nomad's `kill_timeout` and Kubernetes'
    /// `terminationGracePeriodSeconds`: e.g. `30s`; [`DEFAULT_KILL_TIMEOUT`] when
    /// absent, at most [`MAX_KILL_TIMEOUT`]. Its claims stay until its runner records
    /// the end, or this plus its lease's duration has passed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kill_timeout: Option<String>,
    /// The volumes it needs.
    #[serde(
        default,
        deserialize_with = "crate::api::tight_vec",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub volumes: Vec<VolumeRequest>,
}

/// A stopped workload's time between SIGTERM and SIGKILL when its allocation says none.
pub const DEFAULT_KILL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The longest `kill_timeout` an allocation may ask for: with its lease's duration
/// (at most a day), the longest a stopped allocation keeps its claims.
pub const MAX_KILL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// Parses a `kill_timeout`: a duration from 0 to [`MAX_KILL_TIMEOUT`].
pub fn parse_kill_timeout(s: &str) -> Result<std::time::Duration, String> {
    let d = humantime::parse_duration(s)
        .map_err(|e| format!("{:?} is not a duration (e.g. 30s): {e}", printable(s)))?;
    if d > MAX_KILL_TIMEOUT {
        return Err(format!(
            "{:?} is longer than {}",
            printable(s),
            humantime::format_duration(MAX_KILL_TIMEOUT)
        ));
    }
    Ok(d)
}

impl AllocationSpec {
    /// Its `kill_timeout`, or [`DEFAULT_KILL_TIMEOUT`] (also for one that does not
    /// parse: validation refuses it on every write, this is for a stored garbage value).
    pub fn kill_timeout(&self) -> std::time::Duration {
        self.kill_timeout
            .as_deref()
            .and_then(|s| parse_kill_timeout(s).ok())
            .unwrap_or(DEFAULT_KILL_TIMEOUT)
    }

    /// Whether it is over or asked to be (the runner's view: stop the workload, or do
    /// not start it). [`Allocation::is_terminal`] says when its claims go.
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
        if let Some(Err(e)) = self.kill_timeout.as_deref().map(parse_kill_timeout) {
            errors.push("kill_timeout", e);
        }
        if let Some(Err(e)) = self
            .workload_cgroup
            .as_deref()
            .map(crate::workload::cgroup::check_recorded)
        {
            errors.push("workload_cgroup", e);
        }
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
    /// When the controller first saw the allocation ended with every claim released
    /// (phase Released): it is collected, with its claims, a retention after this
    /// (`moord controller --retention`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released_at: Option<Timestamp>,
    /// When the controller first saw it asked to stop while its workload ran: its
    /// claims stay while the runner ends the workload (SIGTERM, SIGKILL after the
    /// kill timeout) and records the end, at most the kill timeout plus its lease's
    /// duration from then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_seen_at: Option<Timestamp>,
    /// Set by the controller when that bound passed without a recorded end: its claims
    /// are released (the node's agent kills what is left of the workload first).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stop_expired: bool,
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

    /// Whether its claims should be released: finished, lost, or stopped (one stopped
    /// while its workload runs once that workload's end is recorded or the stop's bound
    /// passed: [`Allocation::is_stopping`]).
    pub fn is_terminal(&self) -> bool {
        (self.spec.is_terminal() || self.status.lost) && !self.is_stopping()
    }

    /// Asked to stop while its workload runs, and neither ended nor past the stop's
    /// bound: its runner is ending the workload (SIGTERM, then SIGKILL after the kill
    /// timeout), and its claims stay until the end is recorded, so that nothing is
    /// unmounted under it. No new claim is made for it meanwhile.
    pub fn is_stopping(&self) -> bool {
        self.spec.desired_status == DesiredStatus::Stop
            && self.spec.client_status == ClientStatus::Running
            && !self.status.lost
            && !self.status.stop_expired
    }

    /// Whether this allocation still wants its claim named `claim`: neither deleting nor
    /// terminal, and one of its requests makes that claim.
    pub fn wants(&self, claim: &Claim) -> bool {
        !self.is_deleting() && !self.is_terminal() && self.owns(claim)
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

    /// The claim a request makes on `volume` (the request's volume), as the controller
    /// creates it: the mode, the request's access and attachment modes (absent: the
    /// volume's), the merged mount options, the volume's plugin. `None` when the
    /// request's names do not fit the id rule.
    pub fn claim_for(&self, req: &VolumeRequest, volume: &Volume) -> Option<Claim> {
        let spec = ClaimSpec {
            allocation: AllocationId::new(self.metadata.name.as_str()).ok()?,
            request: req.name.clone(),
            // The volume found for the request (a per_alloc one perhaps under its
            // earlier name: Allocation::request_volume_in).
            volume: VolumeId::new(volume.metadata.name.as_str()).ok()?,
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

    /// The name of the claim for a request: [`joined_name`] of the allocation and the
    /// request (`<allocation>.<request>` for a request name without a dot).
    pub fn claim_name(&self, req: &VolumeRequest) -> Option<Name> {
        Name::new(joined_name(self.metadata.name.as_str(), req.name.as_str())).ok()
    }

    /// The names a claim of this request may be stored under: [`Allocation::claim_name`],
    /// then, where it differs, the name an earlier release derived (the dotted join,
    /// ambiguous for a request name with a dot, and cut with FNV past 128): a claim
    /// stored under it before an upgrade is still this request's when its spec says so
    /// ([`Allocation::owns`]).
    pub fn claim_names(&self, req: &VolumeRequest) -> Vec<Name> {
        let mut names: Vec<Name> = self.claim_name(req).into_iter().collect();
        let legacy = bounded_name(&[self.metadata.name.as_str(), req.name.as_str()], ".");
        if let Ok(legacy) = Name::new(legacy) {
            if !names.contains(&legacy) {
                names.push(legacy);
            }
        }
        names
    }

    /// Whether `claim` is the claim of one of this allocation's requests: its spec
    /// names this allocation and that request, and it is stored under one of the
    /// request's [`Allocation::claim_names`]. A claim that only shares a name (another
    /// allocation's, stored under a name an earlier release made ambiguous) is not.
    pub fn owns(&self, claim: &Claim) -> bool {
        self.request_of(claim).is_some()
    }

    /// The request whose claim `claim` is (see [`Allocation::owns`]).
    pub fn request_of(&self, claim: &Claim) -> Option<&VolumeRequest> {
        if claim.spec.allocation.as_str() != self.metadata.name.as_str()
            || claim.metadata.namespace != self.metadata.namespace
        {
            return None;
        }
        // A claim whose spec names no request was written by a release that did not
        // record it (before 2026-11-24): its name is all it has.
        self.spec.volumes.iter().find(|req| {
            (claim.spec.request == req.name || claim.spec.request.as_str().is_empty())
                && self.claim_names(req).contains(&claim.metadata.name)
        })
    }

    /// The volume a request claims: a template's the one made for it, [`joined_name`]
    /// of the allocation and the request; a per_alloc request its own, [`joined_name`]
    /// of the volume and the allocation (`<volume>.<allocation>`); otherwise the named
    /// volume.
    pub fn request_volume(&self, req: &VolumeRequest) -> Option<VolumeId> {
        if req.template.is_some() {
            VolumeId::new(joined_name(self.metadata.name.as_str(), req.name.as_str())).ok()
        } else if req.per_alloc {
            VolumeId::new(joined_name(
                req.volume.as_str(),
                self.metadata.name.as_str(),
            ))
            .ok()
        } else {
            Some(req.volume.clone())
        }
    }

    /// [`Allocation::request_volume`], where a per_alloc request's volume does not exist
    /// (`exists` says) but one under the name earlier releases gave it does
    /// (`<volume>-<allocation>`, ambiguous: volume `a` of allocation `b-c` and volume
    /// `a-b` of allocation `c` were both `a-b-c`): that one, so that volumes an operator
    /// made before keep working; the new name wins once it exists.
    pub fn request_volume_in(
        &self,
        req: &VolumeRequest,
        exists: impl Fn(&VolumeId) -> bool,
    ) -> Option<VolumeId> {
        let id = self.request_volume(req)?;
        if !req.per_alloc || req.template.is_some() || exists(&id) {
            return Some(id);
        }
        match VolumeId::new(format!("{}-{}", req.volume, self.metadata.name)) {
            Ok(legacy) if exists(&legacy) => Some(legacy),
            _ => Some(id),
        }
    }
}

/// The first `bytes` bytes (at most 32) of the SHA-256 of `s`, in lower-case hex: for
/// names that must not collide, even for someone who picks one part to make them.
pub fn sha256_hex(s: &str, bytes: usize) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, s.as_bytes());
    digest.as_ref()[..bytes.min(32)]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
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

/// The name moor derives from two user-chosen names (an allocation and its request, a
/// volume and a node), unambiguous by construction: two different pairs never give one
/// name.
///
/// - `<first>.<second>` when `second` has no dot and the whole fits in 128: split at
///   its last dot, such a name gives back its pair (and every name moor derived
///   before stays as it was);
/// - otherwise a name with no dot at all, so never one of the first form:
///   `<first>-<second>` with its dots as `-`, cut to leave room, then `-` and 32 hex
///   digits of the SHA-256 of the pair (the parts separated by `/`, which no name
///   holds), so that two such names are equal only for one pair.
///
/// An allocation `p` with request `q.r` and an allocation `p.q` with request `r` made
/// one claim name before (`p.q.r`); now the first is `p-q-r-<hash>`.
pub fn joined_name(first: &str, second: &str) -> String {
    let plain = format!("{first}.{second}");
    if !second.contains('.') && plain.len() <= 128 {
        return plain;
    }
    let hash = sha256_hex(&format!("{first}/{second}"), 16);
    let readable: String = format!("{first}-{second}")
        .chars()
        .map(|c| if c == '.' { '-' } else { c })
        .take(128 - 1 - hash.len())
        .collect();
    format!("{readable}-{hash}")
}

/// A name within the id rule: `parts` joined by `sep`, or, when longer than 128, a
/// prefix and an FNV hash of the whole. Ambiguous when a part holds `sep`: names moor
/// derives use [`joined_name`]; this stays for the names earlier releases stored
/// ([`Allocation::claim_names`]) and for names of one user-chosen part.
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
    fn a_kill_timeout_a_raw_writer_stored_past_validation_is_the_default() {
        for (stored, want) in [
            (None, DEFAULT_KILL_TIMEOUT),
            (Some("30s"), std::time::Duration::from_secs(30)),
            (Some("10m"), MAX_KILL_TIMEOUT),
            // What validation refuses, written raw into etcd: never longer than the cap.
            (Some("8760h"), DEFAULT_KILL_TIMEOUT),
            (Some("lots"), DEFAULT_KILL_TIMEOUT),
            (Some("-5s"), DEFAULT_KILL_TIMEOUT),
        ] {
            let spec = AllocationSpec {
                node: NodeName::new("n1").unwrap(),
                kill_timeout: stored.map(String::from),
                ..Default::default()
            };
            assert_eq!(spec.kill_timeout(), want, "{stored:?}");
            let mut errors = ValidationErrors::default();
            spec.validate(&mut errors);
            assert_eq!(
                errors.is_empty(),
                want != DEFAULT_KILL_TIMEOUT || stored.is_none(),
                "{stored:?}: {errors:?}"
            );
        }
    }

    #[test]
    fn a_workload_cgroup_that_is_not_a_workload_s_is_refused() {
        let mut spec = AllocationSpec {
            node: NodeName::new("n1").unwrap(),
            workload_cgroup: Some("/user.slice/moor-workload-7-0000002a".into()),
            ..Default::default()
        };
        let mut errors = ValidationErrors::default();
        spec.validate(&mut errors);
        assert!(errors.is_empty(), "{errors:?}");
        spec.workload_cgroup = Some("/system.slice/sshd.service".into());
        let mut errors = ValidationErrors::default();
        spec.validate(&mut errors);
        assert!(
            format!("{errors:?}").contains("workload_cgroup"),
            "{errors:?}"
        );
    }

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

    /// Every name of at most `len` characters over `alphabet` that the id rule takes.
    fn names_up_to(alphabet: &[char], len: usize) -> Vec<String> {
        let mut all = vec![String::new()];
        let mut out = Vec::new();
        for _ in 0..len {
            all = all
                .iter()
                .flat_map(|p| alphabet.iter().map(move |c| format!("{p}{c}")))
                .collect();
            out.extend(
                all.iter()
                    .filter(|n| Name::new(n.as_str()).is_ok())
                    .cloned(),
            );
        }
        out
    }

    #[test]
    fn joined_names_never_collide_and_keep_the_id_rule() {
        // Every pair of short names over the characters that make joins ambiguous,
        // then long ones at and around the 128-character edge.
        let short = names_up_to(&['a', '.', '-'], 4);
        let mut pairs: Vec<(String, String)> = short
            .iter()
            .flat_map(|a| short.iter().map(move |b| (a.clone(), b.clone())))
            .collect();
        for _ in 0..2_000 {
            let len_a = fastrand::usize(1..=130);
            let len_b = fastrand::usize(1..=130);
            let pick = |n| -> String {
                (0..n)
                    .map(|_| ['a', '.', '-', '_'][fastrand::usize(0..4)])
                    .collect()
            };
            let (a, b) = (
                format!("x{}", pick(len_a - 1)),
                format!("y{}", pick(len_b - 1)),
            );
            pairs.push((a, b));
        }
        let mut seen: std::collections::HashMap<String, (String, String)> = Default::default();
        for (a, b) in pairs {
            let n = joined_name(&a, &b);
            assert!(Name::new(n.as_str()).is_ok(), "{a:?} + {b:?} gave {n:?}");
            if let Some(before) = seen.insert(n.clone(), (a.clone(), b.clone())) {
                assert_eq!(before, (a, b), "two pairs made {n:?}");
            }
        }
        assert_eq!(
            joined_name("web-1", "data"),
            "web-1.data",
            "names moor made before"
        );
        assert_ne!(joined_name("p", "q.r"), joined_name("p.q", "r"));
    }

    #[test]
    fn a_claim_is_an_allocation_s_by_its_spec_not_only_its_name() {
        let alloc = |name: &str, req: &str| {
            Allocation::new(
                &Namespace::default_ns(),
                Name::new(name).unwrap(),
                AllocationSpec {
                    volumes: vec![VolumeRequest {
                        name: Name::new(req).unwrap(),
                        volume: VolumeId::new("v").unwrap(),
                        ..Default::default()
                    }],
                    ..Default::default()
                },
            )
        };
        let (p, pq) = (alloc("p", "q.r"), alloc("p.q", "r"));
        assert_ne!(
            p.claim_name(&p.spec.volumes[0]),
            pq.claim_name(&pq.spec.volumes[0])
        );
        // p.q's claim, stored under the name an earlier release gave both.
        let v = Volume::new(
            &Namespace::default_ns(),
            Name::new("v").unwrap(),
            Default::default(),
        );
        let mut theirs = pq.claim_for(&pq.spec.volumes[0], &v).unwrap();
        theirs.metadata.name = Name::new("p.q.r").unwrap();
        assert!(pq.owns(&theirs), "the legacy name is still p.q's");
        assert!(!p.owns(&theirs), "never p's");
        assert!(p
            .claim_names(&p.spec.volumes[0])
            .contains(&theirs.metadata.name));
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
        let req = &a.spec.volumes[0];
        assert_eq!(a.claim_name(req).unwrap().as_str(), "web-1.data");
        assert_eq!(a.request_volume(req).unwrap().as_str(), "db.web-1");
        // A volume an operator made under the earlier name is still found, until one
        // under the new name exists.
        let req = &a.spec.volumes[0];
        let legacy = |v: &VolumeId| v.as_str() == "db-web-1";
        assert_eq!(
            a.request_volume_in(req, legacy).unwrap().as_str(),
            "db-web-1"
        );
        let both = |v: &VolumeId| v.as_str() == "db-web-1" || v.as_str() == "db.web-1";
        assert_eq!(a.request_volume_in(req, both).unwrap().as_str(), "db.web-1");
        assert_eq!(
            a.request_volume_in(req, |_| false).unwrap().as_str(),
            "db.web-1"
        );
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
