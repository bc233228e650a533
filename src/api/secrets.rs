//! Secrets passed to plugins: redacted in every Debug and Display, and possibly
//! sealed at rest.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::BTreeMap;
use std::fmt;

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

/// Replaces secret values and mount flags with [`REDACTED`], wherever they appear in an
/// object written as JSON: what moorctl prints by default and every console page
/// shows.
pub fn redact_json(v: &mut serde_json::Value) {
    use serde_json::Value;
    match v {
        Value::Object(map) => {
            for (k, child) in map.iter_mut() {
                match (k.as_str(), &mut *child) {
                    (k, Value::Object(secrets)) if is_secrets_field(k) => {
                        for s in secrets.values_mut() {
                            *s = Value::String(REDACTED.into());
                        }
                    }
                    // Sealed secrets: the text says which key sealed them, nothing else.
                    (k, Value::String(_)) if is_secrets_field(k) => {
                        *child = Value::String(REDACTED.into());
                    }
                    ("mount_flags", Value::Array(flags)) if !flags.is_empty() => {
                        *child = Value::String(REDACTED.into());
                    }
                    _ => redact_json(child),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(redact_json),
        _ => {}
    }
}

/// Whether an object's field of this name holds secrets (`secrets`, `node_secrets`).
pub fn is_secrets_field(field: &str) -> bool {
    field == "secrets" || field.ends_with("_secrets")
}

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
