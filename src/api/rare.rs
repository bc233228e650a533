//! `Rare<T>`: a field that is almost always empty, held behind one pointer.
//!
//! Every cached object carries every field of its kind inline: a volume's secrets,
//! mount options, topology request and four maps take over 250 bytes of a `Volume`
//! even when none is set, which is nearly always. A `Rare` field costs 8 bytes when
//! empty and a box when set. It reads as its value (through `Deref`, an empty one as
//! the type's default), compares and serializes as its value, and is written only when
//! set, so stored objects and the JSON of a manifest are unchanged.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::ops::{Deref, DerefMut};

/// A type with a shared empty value (what an empty [`Rare`] reads as).
pub trait Empty: Default + PartialEq + 'static {
    /// The empty value.
    fn empty() -> &'static Self;
}

/// Implements [`Empty`] for types whose `Default` is their empty value.
macro_rules! empty_is_default {
    ($($t:ty),* $(,)?) => {$(
        impl Empty for $t {
            fn empty() -> &'static Self {
                static EMPTY: std::sync::OnceLock<$t> = std::sync::OnceLock::new();
                EMPTY.get_or_init(Default::default)
            }
        }
    )*};
}
empty_is_default!(
    std::collections::BTreeMap<String, String>,
    std::collections::BTreeMap<super::NodeName, i64>,
    super::MountOptions,
    super::Secrets,
);

/// A field that is almost always empty (see the module docs).
#[derive(Clone, Default)]
pub struct Rare<T>(Option<Box<T>>);

impl<T: Empty> Rare<T> {
    /// Holds `value`, boxed only when it is not empty.
    pub fn new(value: T) -> Self {
        if value == *T::empty() {
            Rare(None)
        } else {
            Rare(Some(Box::new(value)))
        }
    }

    /// Whether the value is empty (it is then not written).
    pub fn is_empty(&self) -> bool {
        **self == *T::empty()
    }

    /// The value for changing in place when one is set; `None` when empty, without
    /// allocating one (what a pass over every cached object should use).
    pub fn get_mut(&mut self) -> Option<&mut T> {
        self.0.as_deref_mut()
    }

    /// The value, the empty one when none is set.
    pub fn into_inner(self) -> T {
        self.0.map(|b| *b).unwrap_or_default()
    }
}

impl<T: Empty> From<T> for Rare<T> {
    fn from(value: T) -> Self {
        Rare::new(value)
    }
}

impl<A, T: Empty + FromIterator<A>> FromIterator<A> for Rare<T> {
    fn from_iter<I: IntoIterator<Item = A>>(iter: I) -> Self {
        Rare::new(iter.into_iter().collect())
    }
}

impl<T: Empty> Deref for Rare<T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.0.as_deref().unwrap_or_else(|| T::empty())
    }
}

/// Changing a value in place boxes an empty one first.
impl<T: Empty> DerefMut for Rare<T> {
    fn deref_mut(&mut self) -> &mut T {
        self.0.get_or_insert_with(Box::default)
    }
}

impl<T: Empty> PartialEq for Rare<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T: Empty + Eq> Eq for Rare<T> {}

impl<T: Empty + fmt::Debug> fmt::Debug for Rare<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        (**self).fmt(f)
    }
}

impl<T: Empty + Serialize> Serialize for Rare<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        (**self).serialize(s)
    }
}

impl<'de, T: Empty + Deserialize<'de>> Deserialize<'de> for Rare<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        T::deserialize(d).map(Rare::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    type Map = BTreeMap<String, String>;

    #[test]
    fn an_empty_value_is_not_boxed_and_reads_as_empty() {
        let r: Rare<Map> = serde_json::from_str("{}").unwrap();
        assert!(r.0.is_none() && r.is_empty() && (*r).is_empty());
        assert_eq!(std::mem::size_of::<Rare<Map>>(), 8);
        assert_eq!(Rare::new(Map::new()).0, None);
    }

    #[test]
    fn a_set_value_reads_writes_and_compares_as_itself() {
        let r: Rare<Map> = serde_json::from_str(r#"{"a":"1"}"#).unwrap();
        assert_eq!(r.get("a").map(String::as_str), Some("1"));
        assert_eq!(serde_json::to_string(&r).unwrap(), r#"{"a":"1"}"#);
        // A box emptied in place equals an empty field.
        let mut emptied = r.clone();
        emptied.remove("a");
        assert!(emptied.0.is_some());
        assert_eq!(emptied, Rare::default());
        assert!(emptied.is_empty());
        assert_ne!(r, Rare::default());
    }

    #[test]
    fn changing_in_place_boxes_only_when_asked() {
        let mut r: Rare<Map> = Rare::default();
        assert!(r.get_mut().is_none());
        assert!(r.0.is_none());
        r.insert("k".into(), "v".into());
        assert_eq!(r.get_mut().map(|m| m.len()), Some(1));
        assert_eq!(r.into_inner().len(), 1);
    }
}
