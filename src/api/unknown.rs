//! Fields a stored object carries that this version does not know: kept from the read
//! and written back, so that an older moor writing an object a newer one wrote (a
//! status, a finalizer) does not drop the newer fields (UPGRADING.md: version skew).
//!
//! Expected flow:
//! 1. The codec decodes a value; when re-encoding the decoded object does not give the
//!    same bytes (the common case gives them: moor's encoding is deterministic), it
//!    compares the two as JSON trees ([`UnknownFields::between`]) and keeps every
//!    member the stored value has and the decoded object does not, with its path.
//! 2. The object carries them ([`super::Object::unknown`]) through clones, caches and
//!    edits.
//! 3. On a write the codec puts each back ([`UnknownFields::restore`]) where its parent
//!    still exists, is still an object, and does not have the member already; a member
//!    inside an array only while the array keeps its length (an element removed would
//!    shift it onto another). A parent the writer removed takes its unknown members
//!    with it.
//!
//! A field this version knows but stored at its default (`"lost": false`, which moor
//! omits) is kept the same way: put back only where the writer left it at that
//! default, so it reads the same.

use std::sync::Arc;

use serde_json::{Map, Value};

/// One step of a path into a JSON value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// A member of an object.
    Key(String),
    /// An element of an array, and the array's length when it was read.
    Index(usize, usize),
}

/// Members found, each with its path.
type Kept = Vec<(Vec<Step>, Value)>;

/// The members of a stored value its decoded object does not have, by path.
#[derive(Debug, Clone, Default)]
pub struct UnknownFields(Option<Arc<Kept>>);

/// Not part of an object's identity: two objects that differ only in what this version
/// cannot see are equal to it.
impl PartialEq for UnknownFields {
    fn eq(&self, _: &UnknownFields) -> bool {
        true
    }
}

/// The most members kept per object (a value past it keeps the first ones).
const MAX_KEPT: usize = 256;

impl UnknownFields {
    /// What `stored` has that `known` (the decoded object, encoded again) has not.
    pub fn between(stored: &Value, known: &Value) -> UnknownFields {
        let mut found = Kept::new();
        let mut path = Vec::new();
        collect(stored, known, &mut path, &mut found);
        if found.is_empty() {
            UnknownFields(None)
        } else {
            UnknownFields(Some(Arc::new(found)))
        }
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.0.as_ref().is_none_or(|v| v.is_empty())
    }

    /// How many members are kept.
    pub fn len(&self) -> usize {
        self.0.as_ref().map_or(0, |v| v.len())
    }

    /// Puts every kept member back into `value` (the object being written, as JSON)
    /// where its parent is still there (see the module's flow).
    pub fn restore(&self, value: &mut Value) {
        let Some(kept) = &self.0 else {
            return;
        };
        for (path, member) in kept.iter() {
            let Some((Step::Key(name), parents)) = path.split_last() else {
                continue;
            };
            let Some(Value::Object(parent)) = walk(value, parents) else {
                continue;
            };
            if !parent.contains_key(name) {
                parent.insert(name.clone(), member.clone());
            }
        }
    }
}

/// The value at `path` in `value`, if every step still leads somewhere (an array of
/// another length than when read does not).
fn walk<'a>(value: &'a mut Value, path: &[Step]) -> Option<&'a mut Value> {
    let mut at = value;
    for step in path {
        at = match (step, at) {
            (Step::Key(k), Value::Object(m)) => m.get_mut(k)?,
            (Step::Index(i, len), Value::Array(a)) if a.len() == *len => a.get_mut(*i)?,
            _ => return None,
        };
    }
    Some(at)
}

fn collect(stored: &Value, known: &Value, path: &mut Vec<Step>, found: &mut Kept) {
    match (stored, known) {
        (Value::Object(s), Value::Object(k)) => members(s, k, path, found),
        (Value::Array(s), Value::Array(k)) if s.len() == k.len() => {
            for (i, (sv, kv)) in s.iter().zip(k).enumerate() {
                path.push(Step::Index(i, s.len()));
                collect(sv, kv, path, found);
                path.pop();
            }
        }
        _ => {}
    }
}

fn members(
    stored: &Map<String, Value>,
    known: &Map<String, Value>,
    path: &mut Vec<Step>,
    found: &mut Kept,
) {
    for (name, sv) in stored {
        if found.len() >= MAX_KEPT {
            return;
        }
        path.push(Step::Key(name.clone()));
        match known.get(name) {
            None => found.push((path.clone(), sv.clone())),
            Some(kv) => collect(sv, kv, path, found),
        }
        path.pop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn what_a_newer_writer_added_is_kept_and_put_back_where_its_parent_still_is() {
        let stored = json!({
            "spec": {"a": 1, "future": {"x": [1, 2]}, "list": [{"n": 1, "new": true}, {"n": 2}]},
            "status": {"phase": "Ready", "newer_status": "yes"},
            "top": 5
        });
        let known = json!({
            "spec": {"a": 1, "list": [{"n": 1}, {"n": 2}]},
            "status": {"phase": "Ready"}
        });
        let u = UnknownFields::between(&stored, &known);
        assert_eq!(u.len(), 4);
        // The writer changed a known field: the unknown ones come back beside it.
        let mut written = json!({
            "spec": {"a": 2, "list": [{"n": 1}, {"n": 3}]},
            "status": {"phase": "Released"}
        });
        u.restore(&mut written);
        assert_eq!(
            written,
            json!({
                "spec": {"a": 2, "future": {"x": [1, 2]}, "list": [{"n": 1, "new": true}, {"n": 3}]},
                "status": {"phase": "Released", "newer_status": "yes"},
                "top": 5
            })
        );
        // A list that changed length drops what was inside it; a parent removed takes
        // its members with it; a member the writer set itself is the writer's.
        let mut written = json!({"spec": {"a": 2, "list": [{"n": 2}], "future": 0}});
        u.restore(&mut written);
        assert_eq!(
            written,
            json!({"spec": {"a": 2, "list": [{"n": 2}], "future": 0}, "top": 5})
        );
        assert!(UnknownFields::between(&known, &known).is_empty());
    }

    #[test]
    fn unknown_fields_do_not_make_objects_differ() {
        let u = UnknownFields::between(&json!({"x": 1}), &json!({}));
        assert_eq!(u, UnknownFields::default());
    }
}
