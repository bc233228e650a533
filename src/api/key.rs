//! Typed object keys: where an object of a kind lives below the store prefix, built only
//! here and next to each kind's layout (kube's `ObjectRef<K>` is the model). The store,
//! the caches and the reconcilers take an [`ObjectKey`]; no moor key string is assembled
//! outside this module.
//!
//! | kind | key |
//! |---|---|
//! | cluster-wide (Node, Plugin) | `DIR/NAME` |
//! | namespaced (Volume, Allocation, Event) | `DIR/NS/NAME` |
//! | Claim, Mount | `DIR/NODE/NS/NAME` (a Mount is keyed like its claim) |
//! | Attachment | `attachments/NS/VOLUME/NODE` |
//! | Event | `events/controller/NS/NAME`, `events/node/NODE/NS/NAME` (by writer) |

use std::fmt;
use std::marker::PhantomData;

use super::{check_id, Namespace, Object, Spec};

/// The key of one object of kind `S` below the store prefix, e.g. `volumes/default/db`.
pub struct ObjectKey<S> {
    key: String,
    kind: PhantomData<fn() -> S>,
}

/// A key that is not one of its kind's keys.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key:?} is not a {kind} key (expected {layout})")]
pub struct KeyError {
    key: String,
    kind: &'static str,
    layout: String,
}

impl<S: Spec> ObjectKey<S> {
    /// The key of the object whose suffix below `DIR/` is the `parts` joined by `/`.
    pub(crate) fn from_parts(parts: &[&dyn fmt::Display]) -> Self {
        let mut key = String::from(S::DIR);
        for part in parts {
            key.push('/');
            key.push_str(&part.to_string());
        }
        ObjectKey {
            key,
            kind: PhantomData,
        }
    }

    /// The key of `obj`, from its metadata and spec ([`Spec::key_suffix`]).
    pub fn of(obj: &Object<S>) -> Self {
        ObjectKey {
            key: format!("{}/{}", S::DIR, obj.spec.key_suffix(&obj.metadata)),
            kind: PhantomData,
        }
    }

    /// The key of the object named `name` (in `ns`, for a namespaced kind), for kinds
    /// whose keys are just that (`DIR/NS/NAME`, `DIR/NAME`); `None` for other layouts
    /// and for a name or namespace that is not an id.
    pub fn named(ns: Option<&Namespace>, name: &str) -> Option<Self> {
        check_id(name).ok()?;
        match (S::NAMESPACED, S::KEY_SEGMENTS, ns) {
            (false, 1, _) => Some(Self::from_parts(&[&name])),
            (true, 2, Some(ns)) if ns.validate().is_ok() => Some(Self::from_parts(&[ns, &name])),
            _ => None,
        }
    }

    /// Reads a key string (from a watch, a queue or a person): `DIR/` and as many valid
    /// ids as the kind's layout has.
    pub fn parse(key: &str) -> Result<Self, KeyError> {
        Self::check(key)?;
        Ok(ObjectKey {
            key: key.to_string(),
            kind: PhantomData,
        })
    }

    /// [`ObjectKey::parse`] of an owned key string, kept without a copy.
    pub fn parse_owned(key: String) -> Result<Self, KeyError> {
        Self::check(&key)?;
        Ok(ObjectKey {
            key,
            kind: PhantomData,
        })
    }

    fn check(key: &str) -> Result<(), KeyError> {
        let wrong = || KeyError {
            key: key.to_string(),
            kind: S::KIND,
            layout: format!("{}/ and {} ids", S::DIR, S::KEY_SEGMENTS),
        };
        let suffix = key
            .strip_prefix(S::DIR)
            .and_then(|k| k.strip_prefix('/'))
            .ok_or_else(wrong)?;
        let parts: Vec<&str> = suffix.split('/').collect();
        if parts.iter().any(|p| check_id(p).is_err()) || !S::key_layout(&parts) {
            return Err(wrong());
        }
        Ok(())
    }

    /// The whole key, e.g. `volumes/default/db`.
    pub fn as_str(&self) -> &str {
        &self.key
    }

    /// The whole key, as an owned string (a queue's or a cache's key).
    pub fn into_string(self) -> String {
        self.key
    }

    /// The key below the kind's directory, e.g. `default/db`.
    pub fn suffix(&self) -> &str {
        &self.key[S::DIR.len() + 1..]
    }

    /// The key's last part: the object's name (an Attachment's: its node).
    pub fn name(&self) -> &str {
        self.key.rsplit('/').next().unwrap_or_default()
    }
}

/// The key of the election `name` below the store prefix, e.g. `leaders/controller`,
/// `leaders/plugin.hostpath.moor.dev`. Elections are not objects: the key's value is
/// the leader's identity and the key lives on the leader's lease.
pub fn election_key(name: &str) -> String {
    format!("leaders/{name}")
}

/// A part of the key space of kind `S` that a list or watch covers: the whole kind, or
/// one node's claims or mounts.
pub struct KeyScope<S> {
    prefix: String,
    kind: PhantomData<fn() -> S>,
}

impl<S: Spec> KeyScope<S> {
    /// Every object of the kind.
    pub fn all() -> Self {
        KeyScope {
            prefix: format!("{}/", S::DIR),
            kind: PhantomData,
        }
    }

    /// The objects of namespace `ns`, for kinds keyed by namespace first (`None` for
    /// the others: a node's claims and mounts are keyed by node first).
    pub fn namespace(ns: &Namespace) -> Option<Self> {
        S::KEY_NAMESPACE_FIRST.then(|| Self::under(ns))
    }

    /// The objects whose keys start with `first` as their first part (a node's claims).
    pub(crate) fn under(first: &dyn fmt::Display) -> Self {
        KeyScope {
            prefix: format!("{}/{first}/", S::DIR),
            kind: PhantomData,
        }
    }

    /// The objects whose keys start with `parts`, for kinds keyed by node, writer or
    /// plugin first: e.g. a namespace's claims on one node (`claims/n1/team-a/`), which
    /// an identity that may read only that namespace's lists one node at a time.
    pub fn below(parts: &[&dyn fmt::Display]) -> Self {
        let mut prefix = format!("{}/", S::DIR);
        for part in parts {
            prefix.push_str(&format!("{part}/"));
        }
        KeyScope {
            prefix,
            kind: PhantomData,
        }
    }

    /// The scope's key prefix, e.g. `claims/n1/`.
    pub fn as_str(&self) -> &str {
        &self.prefix
    }
}

impl<S> Clone for KeyScope<S> {
    fn clone(&self) -> Self {
        KeyScope {
            prefix: self.prefix.clone(),
            kind: PhantomData,
        }
    }
}

impl<S> fmt::Debug for KeyScope<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.prefix)
    }
}

impl<S> Clone for ObjectKey<S> {
    fn clone(&self) -> Self {
        ObjectKey {
            key: self.key.clone(),
            kind: PhantomData,
        }
    }
}

impl<S> PartialEq for ObjectKey<S> {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}

impl<S> Eq for ObjectKey<S> {}

impl<S> std::hash::Hash for ObjectKey<S> {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.key.hash(state);
    }
}

impl<S> PartialOrd for ObjectKey<S> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl<S> Ord for ObjectKey<S> {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.key.cmp(&other.key)
    }
}

impl<S> fmt::Debug for ObjectKey<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.key)
    }
}

impl<S> fmt::Display for ObjectKey<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.key)
    }
}

impl<S> From<ObjectKey<S>> for String {
    fn from(key: ObjectKey<S>) -> String {
        key.key
    }
}

impl<S> AsRef<str> for ObjectKey<S> {
    fn as_ref(&self) -> &str {
        &self.key
    }
}

#[cfg(test)]
mod tests {
    use super::super::*;
    use super::*;

    #[test]
    fn keys_follow_each_kind_s_layout() {
        let (ns, node) = (Namespace::default_ns(), NodeName::new("n1").unwrap());
        let claim = Claim::key_for(&node, &ns, "web-1.data");
        assert_eq!(claim.as_str(), "claims/n1/default/web-1.data");
        assert_eq!(
            Mount::key_for(&claim).as_str(),
            "mounts/n1/default/web-1.data"
        );
        assert_eq!(claim.suffix(), "n1/default/web-1.data");
        assert_eq!(claim.name(), "web-1.data");
        assert_eq!(
            Attachment::key_for(&ns, "v", &node).as_str(),
            "attachments/default/v/n1"
        );
        assert_eq!(Node::key_for(&node).as_str(), "nodes/n1");
        assert_eq!(Volume::key_for(&ns, "db").as_str(), "volumes/default/db");
        assert_eq!(Claim::node_scope(&node).as_str(), "claims/n1/");
    }

    #[test]
    fn parse_takes_only_the_kind_s_layout() {
        assert!(ObjectKey::<VolumeSpec>::parse("volumes/default/db").is_ok());
        for bad in [
            "volumes/db",
            "volumes/default/db/x",
            "claims/default/db",
            "volumes/default/..",
            "volumesx/default/db",
        ] {
            assert!(ObjectKey::<VolumeSpec>::parse(bad).is_err(), "{bad}");
        }
        let e = ObjectKey::<ClaimSpec>::parse("claims/n1").unwrap_err();
        assert_eq!(
            e.to_string(),
            "\"claims/n1\" is not a Claim key (expected claims/ and 3 ids)"
        );
    }

    #[test]
    fn an_object_s_key_is_the_one_its_constructor_builds() {
        let ns = Namespace::default_ns();
        let v = Volume::new(&ns, Name::new("db").unwrap(), VolumeSpec::default());
        assert_eq!(ObjectKey::of(&v), Volume::key_for(&ns, "db"));
    }
}
