//! Identifier newtypes.
//!
//! moor's own ids (names, namespaces, volume and node names) follow one rule because they
//! appear in etcd keys and in mount paths: 1-128 of `[A-Za-z0-9._-]`, never `.` or `..`.
//! The ids a plugin hands out (`ExternalVolumeId`, `CsiNodeId`) are opaque to moor and
//! have their own types, so a moor id can never be sent where the plugin's id belongs.

use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::fmt;
use std::sync::{Arc, Mutex};

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

/// The ids every object repeats (its namespace, node, plugin, volume and allocation,
/// each named again by the claim, mount and volume that refer to them), shared: a
/// decoded id is looked up here and the copy already held is used. A value is
/// dropped from the table once nothing else holds it (swept whenever the table has
/// doubled since the last sweep), so the table holds about the ids alive.
struct Interner {
    ids: HashSet<Arc<str>>,
    /// Entries after the last sweep.
    kept: usize,
}

/// Ids longer than any valid one are not shared (they are errors to report).
const INTERNED_MAX_LEN: usize = 128;

static INTERNER: Mutex<Option<Interner>> = Mutex::new(None);

/// The shared copy of `s`.
fn intern(s: &str) -> Arc<str> {
    if s.len() > INTERNED_MAX_LEN {
        return Arc::from(s);
    }
    // The table is only ever whole; a panic elsewhere while it was held changes nothing.
    let mut guard = INTERNER.lock().unwrap_or_else(|e| e.into_inner());
    let table = guard.get_or_insert_with(|| Interner {
        ids: HashSet::new(),
        kept: 0,
    });
    if let Some(id) = table.ids.get(s) {
        return id.clone();
    }
    let id: Arc<str> = Arc::from(s);
    table.ids.insert(id.clone());
    if table.ids.len() >= 2 * table.kept.max(1024) {
        // An entry only this table holds is an id nothing uses any more; nobody else
        // can take a copy of it meanwhile, as copies come from this table, under its lock.
        table.ids.retain(|id| Arc::strong_count(id) > 1);
        table.kept = table.ids.len();
    }
    id
}

/// How many ids the table holds (for tests).
#[cfg(test)]
fn interned() -> usize {
    let guard = INTERNER.lock().unwrap_or_else(|e| e.into_inner());
    guard.as_ref().map_or(0, |t| t.ids.len())
}

/// What every interned string type (the ids and [`Term`]) shares: its text, written
/// and read as a JSON string through the interner, displayed as itself.
macro_rules! interned_text {
    ($name:ident) => {
        impl $name {
            /// The text as a string slice.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.0)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                d.deserialize_str(IdVisitor).map(Self)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }
    };
}

/// A word of a small vocabulary that many objects repeat (a condition's type and
/// reason): shared through the same table as the ids, so a clone is a reference count
/// and 100,000 `Admitted` conditions hold one string. Any text is accepted.
#[derive(Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Term(Arc<str>);

impl Term {
    /// The shared copy of `s`.
    pub fn new(s: &str) -> Self {
        Term(intern(s))
    }
}

interned_text!(Term);

impl From<&str> for Term {
    fn from(s: &str) -> Self {
        Term::new(s)
    }
}

impl From<String> for Term {
    fn from(s: String) -> Self {
        Term::new(&s)
    }
}

impl std::ops::Deref for Term {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl PartialEq<str> for Term {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

impl PartialEq<&str> for Term {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}

impl fmt::Debug for Term {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident, $check:path) => {
        $(#[$doc])*
        ///
        /// Deserialisation accepts any string so that validation can report every problem of
        /// an object at once; `new` and `validate` apply the rule. Equal ids share one
        /// string (see `Interner`), so a clone is a reference count.
        #[derive(Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(Arc<str>);

        impl $name {
            /// Makes the id, checking the rule.
            pub fn new(s: impl Into<String>) -> Result<Self, IdError> {
                let s = s.into();
                $check(&s)?;
                Ok(Self(intern(&s)))
            }
            /// Checks the rule on an id that came from deserialisation.
            pub fn validate(&self) -> Result<(), IdError> {
                $check(&self.0)
            }
            /// Whether the id is the empty string (never valid; the default).
            pub fn is_empty(&self) -> bool {
                self.0.is_empty()
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:?})", stringify!($name), &*self.0)
            }
        }

        interned_text!($name);
    };
}

/// Reads an id's string straight into the shared table, without a copy of its own.
struct IdVisitor;

impl serde::de::Visitor<'_> for IdVisitor {
    type Value = Arc<str>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Arc<str>, E> {
        Ok(intern(v))
    }
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
        Self(intern("default"))
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
    fn equal_ids_share_one_string_and_unused_ones_are_dropped() {
        let a: VolumeId = serde_json::from_str("\"interned-shared\"").unwrap();
        let b: NodeName = serde_json::from_str("\"interned-shared\"").unwrap();
        let c = Name::new("interned-shared").unwrap();
        assert!(std::ptr::eq(a.as_str(), b.as_str()));
        assert!(std::ptr::eq(a.as_str(), c.as_str()));
        // Ids made and dropped leave the table as it grows: it stays near what is held.
        let held: Vec<Name> = (0..3000)
            .map(|i| Name::new(format!("held-{i}")).unwrap())
            .collect();
        for i in 0..50_000 {
            drop(Name::new(format!("dropped-{i}")).unwrap());
        }
        assert!(
            interned() < 3 * (held.len() + 1024),
            "{} ids kept",
            interned()
        );
        assert_eq!(held[2999].as_str(), "held-2999");
        assert_eq!(a.as_str(), "interned-shared");
    }

    #[test]
    fn deserialising_accepts_anything_and_validate_reports_it() {
        let id: VolumeId = serde_json::from_str("\"../etc\"").unwrap();
        assert_eq!(id.validate(), Err(IdError::BadChar('/')));
    }
}
