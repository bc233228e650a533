//! Value types shared by several kinds: sizes, timestamps, redacted secrets and mount
//! flags, mount options, topology, conditions and validation errors.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, SystemTime};

/// A size in bytes. Manifests may write plain bytes (`1073741824`) or units (`1GiB`,
/// `512 MiB`, `2TiB`, SI `10GB`, `500kB`); it is stored as bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Size(pub u64);

impl Size {
    /// Parses plain bytes or a number with a unit.
    pub fn parse(s: &str) -> Result<Size, String> {
        let t = s.trim();
        if let Ok(n) = t.parse::<u64>() {
            return Size::checked(n);
        }
        let b = t.parse::<bytesize::ByteSize>().map_err(|_| {
            format!("{s:?} is not a size (write bytes, or e.g. 512MiB, 1GiB, 10GB)")
        })?;
        Size::checked(b.as_u64())
    }

    /// The largest size: 1 EiB (2^60 bytes). CSI carries sizes as int64; the bound
    /// leaves a plugin room to add several sizes without overflowing.
    pub const MAX: u64 = 1 << 60;

    /// `n` bytes, refused above [`Size::MAX`].
    pub fn checked(n: u64) -> Result<Size, String> {
        if n > Size::MAX {
            return Err(format!(
                "{n} bytes is too large; the largest size is {} bytes (1 EiB)",
                Size::MAX
            ));
        }
        Ok(Size(n))
    }
}

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", bytesize::ByteSize(self.0).display().iec())
    }
}

impl Serialize for Size {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Size;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a size: whole bytes, or a number with a unit such as 512MiB or 1GiB")
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Size, E> {
                Size::checked(n).map_err(E::custom)
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<Size, E> {
                match u64::try_from(n) {
                    Ok(n) => self.visit_u64(n),
                    Err(_) => Err(E::custom(format!(
                        "{n} is negative; a size is 0 or more bytes"
                    ))),
                }
            }
            fn visit_u128<E: serde::de::Error>(self, n: u128) -> Result<Size, E> {
                match u64::try_from(n) {
                    Ok(n) => self.visit_u64(n),
                    Err(_) => Err(E::custom(format!(
                        "{n} bytes is too large; the largest size is {} bytes (1 EiB)",
                        Size::MAX
                    ))),
                }
            }
            fn visit_i128<E: serde::de::Error>(self, n: i128) -> Result<Size, E> {
                match u128::try_from(n) {
                    Ok(n) => self.visit_u128(n),
                    Err(_) => Err(E::custom(format!(
                        "{n} is negative; a size is 0 or more bytes"
                    ))),
                }
            }
            fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<Size, E> {
                if n < 0.0 {
                    Err(E::custom(format!(
                        "{n} is negative; a size is 0 or more bytes"
                    )))
                } else if n > Size::MAX as f64 {
                    Err(E::custom(format!(
                        "{n} bytes is too large; the largest size is {} bytes (1 EiB)",
                        Size::MAX
                    )))
                } else if n.fract() != 0.0 || !n.is_finite() {
                    Err(E::custom(format!(
                        "{n} is not a whole number of bytes (write e.g. 1536MiB for 1.5GiB)"
                    )))
                } else {
                    self.visit_u64(n as u64)
                }
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Size, E> {
                Size::parse(s).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// A point in time, written as RFC 3339 UTC (`2026-11-21T19:18:00.123Z`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(pub SystemTime);

impl Timestamp {
    /// The current time, to the millisecond (what is stored), so a round trip through
    /// the store is exact.
    pub fn now() -> Self {
        let since = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        Timestamp(SystemTime::UNIX_EPOCH + Duration::from_millis(since.as_millis() as u64))
    }
    /// Time elapsed since this timestamp (zero if it lies in the future).
    pub fn elapsed(&self) -> Duration {
        self.0.elapsed().unwrap_or_default()
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_rfc3339_millis(self.0))
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_rfc3339_weak(&s)
            .map(Timestamp)
            .map_err(|e| serde::de::Error::custom(format!("{s:?} is not an RFC 3339 time: {e}")))
    }
}

/// Secrets passed to a plugin. Debug and Display print `[redacted]`, so a log line or
/// an event cannot leak them by accident.
///
/// At rest they may be sealed (encrypted: see [`crate::store::Keyring`]): a process that
/// holds the key reads them open; one that does not keeps the sealed text, writes it
/// back unchanged, and cannot [`Secrets::expose`] it.
#[derive(Clone, Default)]
pub struct Secrets(SecretsState);

#[derive(Clone)]
enum SecretsState {
    /// The values, and how they were stored when read.
    Open {
        values: BTreeMap<String, String>,
        stored: StoredAs,
    },
    /// Sealed text this process cannot open: `moor:sealed:v1:KEY_ID:...`.
    Sealed(String),
}

impl Default for SecretsState {
    fn default() -> Self {
        SecretsState::Open {
            values: BTreeMap::new(),
            stored: StoredAs::Plain,
        }
    }
}

/// How open secrets were stored when they were read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum StoredAs {
    /// In plain text (written by a process without a key, or not read from the store).
    #[default]
    Plain,
    /// Sealed with the key of this id.
    Key(String),
}

/// What redacted values print as.
pub const REDACTED: &str = "[redacted]";

/// What sealed secrets start with.
pub const SEALED_PREFIX: &str = "moor:sealed:v1:";

/// Secrets sealed with a key this process does not hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the secrets are encrypted with key {key_id:?}, which this process does not hold (give it the key with --encryption-key-file)")]
pub struct SealedSecrets {
    /// The id of the key they are sealed with.
    pub key_id: String,
}

impl Secrets {
    /// Wraps a map of secrets.
    pub fn new(map: BTreeMap<String, String>) -> Self {
        Secrets(SecretsState::Open {
            values: map,
            stored: StoredAs::Plain,
        })
    }

    /// Secrets read sealed, opened with key `key_id`.
    pub(crate) fn opened(map: BTreeMap<String, String>, key_id: &str) -> Self {
        Secrets(SecretsState::Open {
            values: map,
            stored: StoredAs::Key(key_id.to_string()),
        })
    }

    /// Sealed text kept as read.
    pub(crate) fn sealed_text(text: String) -> Self {
        Secrets(SecretsState::Sealed(text))
    }

    /// The secret values, for the one place that needs them: the CSI request. Sealed
    /// secrets this process cannot open are an error, never an empty map.
    pub fn expose(&self) -> Result<&BTreeMap<String, String>, SealedSecrets> {
        match &self.0 {
            SecretsState::Open { values, .. } => Ok(values),
            SecretsState::Sealed(text) => Err(SealedSecrets {
                key_id: sealed_key_id(text).unwrap_or_default().to_string(),
            }),
        }
    }

    /// The sealed text, when this process could not open it.
    pub fn sealed(&self) -> Option<&str> {
        match &self.0 {
            SecretsState::Sealed(text) => Some(text),
            SecretsState::Open { .. } => None,
        }
    }

    /// How open secrets were stored when read (`None` while sealed).
    pub fn stored_as(&self) -> Option<&StoredAs> {
        match &self.0 {
            SecretsState::Open { stored, .. } => Some(stored),
            SecretsState::Sealed(_) => None,
        }
    }

    /// Whether there are no secrets.
    pub fn is_empty(&self) -> bool {
        matches!(&self.0, SecretsState::Open { values, .. } if values.is_empty())
    }

    /// A copy with every value replaced by `[redacted]`, for output that shows keys.
    pub fn redacted(&self) -> Secrets {
        match &self.0 {
            SecretsState::Open { values, .. } => Secrets::new(
                values
                    .keys()
                    .map(|k| (k.clone(), REDACTED.to_string()))
                    .collect(),
            ),
            SecretsState::Sealed(_) => Secrets::sealed_text(REDACTED.to_string()),
        }
    }

    /// Refuses a sealed text that is not moor's format.
    pub fn check(&self) -> Result<(), String> {
        match &self.0 {
            SecretsState::Sealed(text) if sealed_key_id(text).is_none() => Err(format!(
                "is a string that is not sealed secrets (expected a map of secrets or \"{SEALED_PREFIX}KEY_ID:...\")"
            )),
            _ => Ok(()),
        }
    }
}

/// The key id of a sealed text, `None` when it is not one.
pub fn sealed_key_id(text: &str) -> Option<&str> {
    let rest = text.strip_prefix(SEALED_PREFIX)?;
    let (id, data) = rest.split_once(':')?;
    (!id.is_empty() && !data.is_empty()).then_some(id)
}

impl PartialEq for Secrets {
    /// Open secrets compare by value (however they were stored); sealed ones by text.
    fn eq(&self, other: &Secrets) -> bool {
        match (&self.0, &other.0) {
            (SecretsState::Open { values: a, .. }, SecretsState::Open { values: b, .. }) => a == b,
            (SecretsState::Sealed(a), SecretsState::Sealed(b)) => a == b,
            _ => false,
        }
    }
}

impl Eq for Secrets {}

impl Serialize for Secrets {
    fn serialize<Z: Serializer>(&self, s: Z) -> Result<Z::Ok, Z::Error> {
        match &self.0 {
            SecretsState::Open { values, .. } => values.serialize(s),
            SecretsState::Sealed(text) => s.serialize_str(text),
        }
    }
}

impl<'de> Deserialize<'de> for Secrets {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Repr {
            Open(BTreeMap<String, String>),
            Sealed(String),
        }
        match Repr::deserialize(d)
            .map_err(|_| serde::de::Error::custom("secrets must be a map of strings to strings"))?
        {
            Repr::Open(map) => Ok(Secrets::new(map)),
            Repr::Sealed(text) => Ok(Secrets::sealed_text(text)),
        }
    }
}

impl fmt::Debug for Secrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REDACTED)
    }
}

impl fmt::Display for Secrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REDACTED)
    }
}

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
}

impl MountOptions {
    /// Checks the mount group: 1-64 of `[A-Za-z0-9._-]` (a group id or name).
    pub fn check(&self) -> Result<(), String> {
        match &self.mount_group {
            Some(g)
                if g.is_empty()
                    || g.len() > 64
                    || !g
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) =>
            {
                Err(format!(
                    "mount_group {g:?} must be 1-64 of [A-Za-z0-9._-] (a group id)"
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

/// A volume's condition as a plugin reports it (CSI VolumeCondition).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeHealth {
    /// The plugin says the volume is not healthy.
    pub abnormal: bool,
    /// The plugin's message.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

/// A topology segment map, e.g. `{zone: z1}` (CSI `Topology`).
pub type Topology = BTreeMap<String, String>;

/// Where a volume to be created must (requisite) or should (preferred) be accessible.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopologyRequest {
    /// The volume must be accessible from one of these.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub required: Vec<Topology>,
    /// Preferred, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub preferred: Vec<Topology>,
}

/// One observed condition of an object (Kubernetes-shaped).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Condition {
    /// What the condition is about, e.g. `Attached`.
    #[serde(rename = "type")]
    pub type_: String,
    /// Whether it holds.
    pub status: bool,
    /// A machine-readable reason for the last transition.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// A human-readable message.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// When `status` last changed.
    pub last_transition_time: Timestamp,
}

/// The fields every status section carries.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusMeta {
    /// The `metadata.generation` this status was computed from.
    #[serde(default)]
    pub observed_generation: i64,
    /// Observed conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The last error met while reconciling, cleared on success.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// The step that is failing and backing off, cleared on its success.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<StepFailure>,
}

/// A failing step: what `moorctl describe` shows of an object that waits on a call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepFailure {
    /// The step, e.g. `NodeStageVolume`.
    pub step: String,
    /// When it first failed in this run of failures.
    pub since: Timestamp,
    /// Failed attempts in a row.
    pub attempts: u32,
    /// The last answer's gRPC code.
    pub code: String,
    /// The last answer's message.
    pub message: String,
    /// The answer was final (retried only at the cap or on a relevant change).
    #[serde(rename = "final", default)]
    pub final_answer: bool,
    /// When it is tried next, unless something it depends on changes first.
    pub next_retry: Timestamp,
}

impl StatusMeta {
    /// Clears what a failing step showed ([`StatusMeta::last_error`] and
    /// [`StatusMeta::retry`]): after the step succeeded.
    pub fn clear_failure(&mut self) {
        self.last_error = None;
        self.retry = None;
    }

    /// Sets a condition, keeping its transition time when its status did not change.
    pub fn set_condition(&mut self, type_: &str, status: bool, reason: &str, message: &str) {
        let now = Timestamp::now();
        match self.conditions.iter_mut().find(|c| c.type_ == type_) {
            Some(c) => {
                if c.status != status {
                    c.last_transition_time = now;
                }
                c.status = status;
                c.reason = reason.to_string();
                c.message = message.to_string();
            }
            None => self.conditions.push(Condition {
                type_: type_.to_string(),
                status,
                reason: reason.to_string(),
                message: message.to_string(),
                last_transition_time: now,
            }),
        }
    }
    /// The condition of that type, if any.
    pub fn condition(&self, type_: &str) -> Option<&Condition> {
        self.conditions.iter().find(|c| c.type_ == type_)
    }
}

/// One problem found by validation, at a field path such as `spec.capabilities[0]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// The field's path.
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

/// Every problem validation found in one object.
#[derive(Debug, Clone, PartialEq, Eq, Default, thiserror::Error)]
#[error("{}", self.0.iter().map(|e| format!("{}: {}", e.field, e.message)).collect::<Vec<_>>().join("; "))]
pub struct ValidationErrors(pub Vec<FieldError>);

impl ValidationErrors {
    /// Records a problem.
    pub fn push(&mut self, field: impl Into<String>, message: impl fmt::Display) {
        self.0.push(FieldError {
            field: field.into(),
            message: message.to_string(),
        });
    }
    /// Records the result of an id check.
    pub fn check_id(&mut self, field: &str, result: Result<(), super::IdError>) {
        if let Err(e) = result {
            self.push(field, e);
        }
    }
    /// Whether no problem was found.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    /// `Ok` when no problem was found.
    pub fn into_result(self) -> Result<(), ValidationErrors> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(self)
        }
    }
}

pub use moor_csi::process::{printable, printable_bounded};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_accept_bytes_and_units() {
        let cases = [
            ("1024", 1024),
            ("1KiB", 1024),
            ("1GiB", 1 << 30),
            ("2 TiB", 2 << 40),
            ("512MiB", 512 << 20),
            ("10GB", 10_000_000_000),
            ("1MB", 1_000_000),
            ("500kB", 500_000),
        ];
        for (text, bytes) in cases {
            assert_eq!(Size::parse(text), Ok(Size(bytes)), "{text}");
        }
        let s: Size = serde_json::from_str("\"1GiB\"").unwrap();
        assert_eq!(s, Size(1 << 30));
        let s: Size = serde_json::from_str("42").unwrap();
        assert_eq!(s, Size(42));
        assert_eq!(serde_json::to_string(&Size(1 << 30)).unwrap(), "1073741824");
        assert!(Size::parse("lots").is_err());
        assert!(serde_json::from_str::<Size>("\"-1GiB\"").is_err());
    }

    #[test]
    fn secrets_and_mount_flags_never_print() {
        let secrets = Secrets::new([("password".into(), "hunter2".into())].into());
        let flags = MountFlags::new(vec!["password=hunter2".into()]);
        let opts = MountOptions {
            fs_type: Some("ext4".into()),
            mount_flags: flags.clone(),
            mount_group: None,
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
        };
        assert_eq!(MountOptions::merge(&vol, None), vol);
        let req = MountOptions {
            fs_type: Some("xfs".into()),
            mount_flags: MountFlags::default(),
            mount_group: None,
        };
        let merged = MountOptions::merge(&vol, Some(&req));
        assert_eq!(merged.fs_type.as_deref(), Some("xfs"));
        assert_eq!(merged.mount_flags.expose(), ["noatime"]);
        assert_eq!(merged.mount_group.as_deref(), Some("100"));
        let req = MountOptions {
            fs_type: None,
            mount_flags: MountFlags::new(vec!["ro".into(), "nodev".into()]),
            mount_group: Some("200".into()),
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
    fn timestamps_round_trip_rfc3339() {
        let t = Timestamp::now();
        let json = serde_json::to_string(&t).unwrap();
        let back: Timestamp = serde_json::from_str(&json).unwrap();
        assert_eq!(back, t);
        assert!(serde_json::from_str::<Timestamp>("\"yesterday\"").is_err());
    }

    #[test]
    fn conditions_keep_transition_time_when_unchanged() {
        let mut s = StatusMeta::default();
        s.set_condition("Ready", false, "Waiting", "");
        let first = s.condition("Ready").unwrap().last_transition_time;
        s.set_condition("Ready", false, "StillWaiting", "");
        assert_eq!(s.condition("Ready").unwrap().last_transition_time, first);
        assert_eq!(s.condition("Ready").unwrap().reason, "StillWaiting");
        assert_eq!(s.conditions.len(), 1);
    }
}
