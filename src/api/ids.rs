//! Identifier newtypes.
//!
//! moor's own ids (names, namespaces, volume and node names) follow one rule because they
//! appear in etcd keys and in mount paths: 1-128 of `[A-Za-z0-9._-]`, never `.` or `..`.
//! The ids a plugin hands out (`ExternalVolumeId`, `CsiNodeId`) are opaque to moor and
//! have their own types, so a moor id can never be sent where the plugin's id belongs.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Why a string is not a valid moor id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// The id is empty.
    #[error("is required")]
    Empty,
    /// The id is longer than 128 bytes.
    #[error("is {0} characters long; at most 128 are allowed")]
    TooLong(usize),
    /// `.` and `..` would escape a mount path.
    #[error("may not be `.` or `..`")]
    Dots,
    /// A character outside `[A-Za-z0-9._-]`.
    #[error("contains {0:?}; only letters, digits, '.', '_' and '-' are allowed")]
    BadChar(char),
}

/// Checks the moor id rule: 1-128 of `[A-Za-z0-9._-]`, never `.` or `..`.
pub fn check_id(s: &str) -> Result<(), IdError> {
    if s.is_empty() {
        return Err(IdError::Empty);
    }
    if s.len() > 128 {
        return Err(IdError::TooLong(s.len()));
    }
    if s == "." || s == ".." {
        return Err(IdError::Dots);
    }
    match s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        Some(c) => Err(IdError::BadChar(c)),
        None => Ok(()),
    }
}

/// Checks an id the plugin gave us: non-empty, at most 128 bytes (the CSI string limit),
/// no control characters.
pub fn check_opaque_id(s: &str) -> Result<(), IdError> {
    if s.is_empty() {
        return Err(IdError::Empty);
    }
    if s.len() > 128 {
        return Err(IdError::TooLong(s.len()));
    }
    match s.chars().find(|c| c.is_control()) {
        Some(c) => Err(IdError::BadChar(c)),
        None => Ok(()),
    }
}

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident, $check:path) => {
        $(#[$doc])*
        ///
        /// Deserialisation accepts any string so that validation can report every problem of
        /// an object at once; `new` and `validate` apply the rule.
        #[derive(Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            /// Makes the id, checking the rule.
            pub fn new(s: impl Into<String>) -> Result<Self, IdError> {
                let s = s.into();
                $check(&s)?;
                Ok(Self(s))
            }
            /// Checks the rule on an id that came from deserialisation.
            pub fn validate(&self) -> Result<(), IdError> {
                $check(&self.0)
            }
            /// The id as a string slice.
            pub fn as_str(&self) -> &str {
                &self.0
            }
            /// Whether the id is the empty string (never valid; the default).
            pub fn is_empty(&self) -> bool {
                self.0.is_empty()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:?})", stringify!($name), self.0)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }
    };
}

id_type!(
    /// The name of an object (unique per kind and namespace).
    Name, check_id
);
id_type!(
    /// A namespace; `default` when a manifest leaves it out.
    Namespace, check_id
);
id_type!(
    /// moor's id of a volume (the Volume object's name).
    VolumeId, check_id
);
id_type!(
    /// moor's id of an allocation (the Allocation object's name).
    AllocationId, check_id
);
id_type!(
    /// moor's name of a node, as given to `moord agent --node`.
    NodeName, check_id
);
id_type!(
    /// A CSI plugin id, e.g. `hostpath.moor.dev`.
    PluginId, check_id
);
id_type!(
    /// The plugin's id of a volume (CreateVolume's `volume_id`, or an operator's
    /// `external_id`). This, never [`VolumeId`], goes into CSI calls.
    ExternalVolumeId, check_opaque_id
);
id_type!(
    /// The plugin's id of a node (NodeGetInfo's `node_id`). This, never [`NodeName`],
    /// goes into ControllerPublish/Unpublish.
    CsiNodeId, check_opaque_id
);

impl Namespace {
    /// The namespace used when a manifest names none.
    pub fn default_ns() -> Self {
        Self("default".to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_rule_accepts_the_allowed_alphabet() {
        assert!(VolumeId::new("db-data_1.v2").is_ok());
        assert!(VolumeId::new("a".repeat(128)).is_ok());
        assert!(
            VolumeId::new("...").is_ok(),
            "only `.` and `..` are special"
        );
    }

    #[test]
    fn id_rule_rejects_each_kind_of_bad_id() {
        assert_eq!(VolumeId::new(""), Err(IdError::Empty));
        assert_eq!(VolumeId::new("a".repeat(129)), Err(IdError::TooLong(129)));
        assert_eq!(VolumeId::new("."), Err(IdError::Dots));
        assert_eq!(VolumeId::new(".."), Err(IdError::Dots));
        assert_eq!(VolumeId::new("a/b"), Err(IdError::BadChar('/')));
        assert_eq!(VolumeId::new("a b"), Err(IdError::BadChar(' ')));
        assert_eq!(VolumeId::new("é"), Err(IdError::BadChar('é')));
    }

    #[test]
    fn opaque_ids_allow_what_plugins_use() {
        assert!(ExternalVolumeId::new("projects/p/zones/z/disks/d:1").is_ok());
        assert_eq!(ExternalVolumeId::new(""), Err(IdError::Empty));
        assert_eq!(CsiNodeId::new("n\n1"), Err(IdError::BadChar('\n')));
    }

    #[test]
    fn deserialising_accepts_anything_and_validate_reports_it() {
        let id: VolumeId = serde_json::from_str("\"../etc\"").unwrap();
        assert_eq!(id.validate(), Err(IdError::BadChar('/')));
    }
}
