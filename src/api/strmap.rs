//! `StrMap`: a small map of strings to strings (a volume's context, a publish context,
//! parameters), stored as a sorted vector.
//!
//! These maps hold a handful of entries, and every cached claim and volume carries
//! some: a `BTreeMap` allocates a whole node (over 500 bytes) for its first entry, a
//! sorted boxed slice exactly what it holds (16 bytes inline: no capacity kept, since
//! a map changes far less often than it is read). It reads and writes as a JSON object, like the
//! map it replaces, in key order.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::fmt;

/// A map of strings to strings in key order (see the module docs).
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct StrMap(Box<[(String, String)]>);

impl StrMap {
    /// An empty map.
    pub fn new() -> Self {
        StrMap(Box::default())
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&String> {
        self.find(key).ok().map(|i| &self.0[i].1)
    }

    /// Whether `key` has a value.
    pub fn contains_key(&self, key: &str) -> bool {
        self.find(key).is_ok()
    }

    /// Sets `key` to `value`; returns the value it replaced.
    pub fn insert(&mut self, key: String, value: String) -> Option<String> {
        match self.find(&key) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, value)),
            Err(i) => {
                let mut entries = std::mem::take(&mut self.0).into_vec();
                entries.insert(i, (key, value));
                self.0 = entries.into_boxed_slice();
                None
            }
        }
    }

    /// Removes `key`; returns its value.
    pub fn remove(&mut self, key: &str) -> Option<String> {
        let i = self.find(key).ok()?;
        let mut entries = std::mem::take(&mut self.0).into_vec();
        let (_, value) = entries.remove(i);
        self.0 = entries.into_boxed_slice();
        Some(value)
    }

    /// The entries, in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &String)> {
        self.0.iter().map(|(k, v)| (k, v))
    }

    /// The keys, in order.
    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.0.iter().map(|(k, _)| k)
    }

    /// How many entries.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Removes every entry.
    pub fn clear(&mut self) {
        self.0 = Box::default();
    }

    fn find(&self, key: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|(k, _)| k.as_str().cmp(key))
    }
}

impl fmt::Debug for StrMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl Extend<(String, String)> for StrMap {
    fn extend<I: IntoIterator<Item = (String, String)>>(&mut self, entries: I) {
        for (k, v) in entries {
            self.insert(k, v);
        }
    }
}

impl FromIterator<(String, String)> for StrMap {
    fn from_iter<I: IntoIterator<Item = (String, String)>>(entries: I) -> Self {
        // Later entries win, as in a map built by inserting them in turn.
        let map: BTreeMap<String, String> = entries.into_iter().collect();
        StrMap(map.into_iter().collect())
    }
}

impl<const N: usize> From<[(String, String); N]> for StrMap {
    fn from(entries: [(String, String); N]) -> Self {
        entries.into_iter().collect()
    }
}

impl From<HashMap<String, String>> for StrMap {
    fn from(map: HashMap<String, String>) -> Self {
        map.into_iter().collect()
    }
}

impl From<BTreeMap<String, String>> for StrMap {
    fn from(map: BTreeMap<String, String>) -> Self {
        StrMap(map.into_iter().collect())
    }
}

impl From<StrMap> for BTreeMap<String, String> {
    fn from(map: StrMap) -> Self {
        map.into_iter().collect()
    }
}

impl From<StrMap> for HashMap<String, String> {
    fn from(map: StrMap) -> Self {
        map.into_iter().collect()
    }
}

impl IntoIterator for StrMap {
    type Item = (String, String);
    type IntoIter = std::vec::IntoIter<(String, String)>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.into_vec().into_iter()
    }
}

impl<'a> IntoIterator for &'a StrMap {
    type Item = (&'a String, &'a String);
    type IntoIter = std::iter::Map<
        std::slice::Iter<'a, (String, String)>,
        fn(&'a (String, String)) -> (&'a String, &'a String),
    >;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(k, v)| (k, v))
    }
}

impl Serialize for StrMap {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.iter())
    }
}

impl<'de> Deserialize<'de> for StrMap {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = StrMap;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map of strings")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut m: A) -> Result<StrMap, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = m.next_entry::<String, String>()? {
                    entries.push(entry);
                }
                // A duplicate key keeps its last value, as a map read from JSON does.
                entries.reverse();
                entries.sort_by(|a, b| a.0.cmp(&b.0));
                entries.dedup_by(|later, first| later.0 == first.0);
                entries.shrink_to_fit();
                Ok(StrMap(entries.into_boxed_slice()))
            }
        }
        d.deserialize_map(Visitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &str) -> String {
        v.to_string()
    }

    #[test]
    fn reads_and_writes_json_objects_in_key_order() {
        let m: StrMap = serde_json::from_str(r#"{"b":"2","a":"1","b":"3"}"#).unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(
            m.get("b"),
            Some(&s("3")),
            "the last duplicate wins, as in a map"
        );
        assert_eq!(serde_json::to_string(&m).unwrap(), r#"{"a":"1","b":"3"}"#);
        assert!(serde_json::from_str::<StrMap>(r#"{"a":1}"#).is_err());
        assert!(serde_json::from_str::<StrMap>(r#"["a"]"#).is_err());
    }

    #[test]
    fn behaves_as_a_map() {
        let mut m = StrMap::from([(s("z"), s("1")), (s("a"), s("2"))]);
        assert_eq!(m.keys().collect::<Vec<_>>(), ["a", "z"]);
        assert_eq!(m.insert(s("m"), s("3")), None);
        assert_eq!(m.insert(s("a"), s("4")), Some(s("2")));
        assert_eq!(m.get("a"), Some(&s("4")));
        assert!(m.contains_key("m") && !m.contains_key("b"));
        assert_eq!(m.remove("m"), Some(s("3")));
        m.extend([(s("b"), s("5"))]);
        let all: Vec<_> = m.iter().map(|(k, v)| format!("{k}={v}")).collect();
        assert_eq!(all, ["a=4", "b=5", "z=1"]);
        let hash: HashMap<String, String> = m.clone().into();
        assert_eq!(StrMap::from(hash), m);
        m.clear();
        assert!(m.is_empty());
    }
}
