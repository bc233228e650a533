//! `Slim<T>`: a list held as a boxed slice, 16 bytes inline where a `Vec` takes 24.
//!
//! A cached object's lists (conditions, a volume's claims and capabilities, topology
//! segments, finalizers) are read far more often than changed, and a volume carries
//! nine of them: without a capacity each costs a third less inline, which moves a
//! `Volume` into a smaller allocation class. A change rebuilds the slice (through a
//! `Vec`), which is cheap for the handful of entries these lists hold. It reads as a
//! slice, and reads and writes as a JSON array, exactly as the `Vec` it replaces.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::ops::{Deref, DerefMut};

/// A list held as a boxed slice (see the module docs).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Slim<T>(Box<[T]>);

impl<T> Default for Slim<T> {
    fn default() -> Self {
        Slim(Box::default())
    }
}

impl<T> Slim<T> {
    /// An empty list.
    pub fn new() -> Self {
        Slim::default()
    }

    /// Changes the list as a `Vec`.
    pub fn edit<R>(&mut self, f: impl FnOnce(&mut Vec<T>) -> R) -> R {
        let mut v = std::mem::take(&mut self.0).into_vec();
        let r = f(&mut v);
        self.0 = v.into_boxed_slice();
        r
    }

    /// Whether it has no entries.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Appends `value`.
    pub fn push(&mut self, value: T) {
        self.edit(|v| v.push(value));
    }

    /// Inserts `value` at `index` (panics past the end, as `Vec::insert`).
    pub fn insert(&mut self, index: usize, value: T) {
        self.edit(|v| v.insert(index, value));
    }

    /// Removes and returns the entry at `index` (panics past the end, as
    /// `Vec::remove`).
    pub fn remove(&mut self, index: usize) -> T {
        self.edit(|v| v.remove(index))
    }

    /// Keeps the entries `keep` holds for.
    pub fn retain(&mut self, keep: impl FnMut(&T) -> bool) {
        if !self.0.is_empty() {
            self.edit(|v| v.retain(keep));
        }
    }

    /// Removes every entry.
    pub fn clear(&mut self) {
        self.0 = Box::default();
    }

    /// The entries as a `Vec`.
    pub fn into_vec(self) -> Vec<T> {
        self.0.into_vec()
    }
}

impl<T> Deref for Slim<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.0
    }
}

impl<T> DerefMut for Slim<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.0
    }
}

impl<T> From<Vec<T>> for Slim<T> {
    fn from(v: Vec<T>) -> Self {
        Slim(v.into_boxed_slice())
    }
}

impl<T> From<Slim<T>> for Vec<T> {
    fn from(s: Slim<T>) -> Self {
        s.into_vec()
    }
}

impl<T, const N: usize> From<[T; N]> for Slim<T> {
    fn from(a: [T; N]) -> Self {
        Slim(Box::new(a))
    }
}

impl<T> FromIterator<T> for Slim<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        Slim(iter.into_iter().collect())
    }
}

impl<T> Extend<T> for Slim<T> {
    fn extend<I: IntoIterator<Item = T>>(&mut self, iter: I) {
        self.edit(|v| v.extend(iter));
    }
}

impl<T> IntoIterator for Slim<T> {
    type Item = T;
    type IntoIter = std::vec::IntoIter<T>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.into_vec().into_iter()
    }
}

impl<'a, T> IntoIterator for &'a Slim<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

impl<T: PartialEq> PartialEq<Vec<T>> for Slim<T> {
    fn eq(&self, other: &Vec<T>) -> bool {
        *self.0 == **other
    }
}

impl<T: PartialEq> PartialEq<&[T]> for Slim<T> {
    fn eq(&self, other: &&[T]) -> bool {
        *self.0 == **other
    }
}

impl<T: PartialEq, const N: usize> PartialEq<[T; N]> for Slim<T> {
    fn eq(&self, other: &[T; N]) -> bool {
        *self.0 == *other
    }
}

impl<T: fmt::Debug> fmt::Debug for Slim<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.0.iter()).finish()
    }
}

impl<T: Serialize> Serialize for Slim<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Slim<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Vec::<T>::deserialize(d).map(Slim::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_as_a_slice_and_changes_as_a_vec() {
        assert_eq!(std::mem::size_of::<Slim<String>>(), 16);
        let mut s: Slim<u32> = serde_json::from_str("[3, 1, 2]").unwrap();
        assert_eq!(s, [3, 1, 2]);
        s.push(4);
        s.retain(|n| *n != 1);
        s.insert(0, 9);
        assert_eq!(s.remove(1), 3);
        s.sort();
        assert_eq!(s, vec![2, 4, 9]);
        assert_eq!(s.iter().sum::<u32>(), 15);
        assert_eq!(serde_json::to_string(&s).unwrap(), "[2,4,9]");
        s.extend([1]);
        assert_eq!(s.len(), 4);
        s.clear();
        assert!(s.is_empty());
        assert_eq!(serde_json::to_string(&s).unwrap(), "[]");
        assert!(serde_json::from_str::<Slim<u32>>("{}").is_err());
    }
}
