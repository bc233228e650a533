//! Manifests: YAML or JSON documents, several per file, of any kind of the registry
//! ([`AnyObject`], generated in `kinds.rs`), read strictly: unknown fields, fields of
//! the wrong shape, a second document for one object, and documents over the size or
//! nesting limits are errors, as is anything validation finds.

use super::*;

/// Why a manifest document was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// Not YAML or JSON.
    #[error("document {doc}: not valid YAML or JSON{hint}")]
    Syntax {
        /// 1-based document number.
        doc: usize,
        /// What the text holds where the parser stopped, when it is a common slip (a
        /// tab), else empty.
        hint: String,
        /// The parser's complaint.
        #[source]
        source: serde_yaml_ng::Error,
    },
    /// No `kind`, or one moor does not know.
    #[error("document {doc}: kind {kind:?} is not one of Volume, Allocation, Claim, Attachment, Mount, Node, Plugin, Event, Snapshot")]
    UnknownKind {
        /// 1-based document number.
        doc: usize,
        /// What it said.
        kind: String,
    },
    /// A field of the wrong shape (a typo'd mode, a size that is not a size).
    #[error("document {doc} ({kind}): {path}: wrong shape")]
    Shape {
        /// 1-based document number.
        doc: usize,
        /// Its kind.
        kind: String,
        /// The field, e.g. `spec.capacity_min`.
        path: String,
        /// The decoder's complaint, naming the field.
        #[source]
        source: serde_json::Error,
    },
    /// A field moor does not know (a typo, or a field of another version).
    #[error("document {doc} ({kind}): unknown field {path}")]
    UnknownField {
        /// 1-based document number.
        doc: usize,
        /// Its kind.
        kind: String,
        /// The field, e.g. `spec.bogus_field`.
        path: String,
    },
    /// Too large or too deeply nested to be parsed or stored.
    #[error("{what}")]
    TooLarge {
        /// What exceeds which limit.
        what: String,
    },
    /// A second document for an object an earlier document of the same text defines.
    #[error("document {doc}: {key} is also document {first}; one text may define an object once")]
    Repeated {
        /// 1-based document number.
        doc: usize,
        /// The earlier document.
        first: usize,
        /// The object's key.
        key: String,
    },
    /// Well-formed but invalid; every problem is listed.
    #[error("document {doc} ({kind} {name}): invalid")]
    Invalid {
        /// 1-based document number.
        doc: usize,
        /// Its kind.
        kind: String,
        /// Its name as written.
        name: String,
        /// Every problem.
        #[source]
        errors: ValidationErrors,
    },
}

pub(super) fn typed<S: Spec>(
    doc: usize,
    value: serde_json::Value,
    wrap: fn(Box<Object<S>>) -> AnyObject,
) -> Result<AnyObject, ManifestError> {
    let name = value
        .pointer("/metadata/name")
        .and_then(|n| n.as_str())
        .unwrap_or("")
        .to_string();
    let mut obj: Object<S> =
        serde_path_to_error::deserialize(value.clone()).map_err(|e| ManifestError::Shape {
            doc,
            kind: S::KIND.to_string(),
            path: e.path().to_string(),
            source: e.into_inner(),
        })?;
    // Whatever the input says that the typed object does not keep is a field moor does
    // not know: refused with its path, not silently dropped. A known field left at its
    // default is not written back either: a `false`, `0` or `""` missing from the
    // write-back is asked again with a non-default value, which a known field keeps.
    if let Ok(kept) = serde_json::to_value(&obj) {
        let known = |pointer: &str| is_known_field::<S>(&value, pointer);
        if let Some(path) = unknown_field(&value, &kept, String::new(), String::new(), &known) {
            return Err(ManifestError::UnknownField {
                doc,
                kind: S::KIND.to_string(),
                path,
            });
        }
    }
    obj.apply_defaults();
    let mut invalid = obj.validate().err().unwrap_or_default();
    // Refused in manifests only: a stored volume that says so still reads.
    let kept = serde_json::to_value(&obj).unwrap_or_default();
    if S::KIND == "Volume" && kept.pointer("/spec/capacity_max") == Some(&0.into()) {
        invalid.push(
            "spec.capacity_max",
            "is 0; leave it out for no limit (volumes never shrink to 0)",
        );
    }
    invalid
        .into_result()
        .map_err(|errors| ManifestError::Invalid {
            doc,
            kind: S::KIND.to_string(),
            name: printable(&name),
            errors,
        })?;
    let size = serde_json::to_vec(&obj).map(|v| v.len()).unwrap_or(0);
    if size > MAX_OBJECT_BYTES {
        return Err(ManifestError::TooLarge {
            what: format!(
                "document {doc} ({} {}): the object is {size} bytes; the largest object moor \
                 stores is {MAX_OBJECT_BYTES} bytes (etcd refuses requests over 1.5 MiB)",
                S::KIND,
                printable(&name)
            ),
        });
    }
    Ok(wrap(Box::new(obj)))
}

/// The largest object a manifest may hold, encoded: under etcd's default request
/// limit (1.5 MiB) with room for the transaction around it.
pub const MAX_OBJECT_BYTES: usize = 1 << 20;
/// The largest manifest text parsed.
pub const MAX_MANIFEST_BYTES: usize = 64 << 20;
/// The deepest nesting of `[` and `{` accepted (moor's objects need fewer than 10).
pub const MAX_DEPTH: usize = 64;

/// A tab where the parser stopped, or in the indentation of that line (YAML indents
/// with spaces only; the parser's own words, "cannot start any token", do not say).
fn syntax_hint(text: &str, e: &serde_yaml_ng::Error) -> String {
    let Some(at) = e.location() else {
        return String::new();
    };
    let Some(line) = text.lines().nth(at.line().saturating_sub(1)) else {
        return String::new();
    };
    let indent: String = line.chars().take_while(|c| c.is_whitespace()).collect();
    match indent.find('\t') {
        Some(_) => format!(
            " (line {} is indented with a tab: YAML indents with spaces only)",
            at.line()
        ),
        None if line.chars().nth(at.column().saturating_sub(1)) == Some('\t') => format!(
            " (line {}, column {} holds a tab: YAML indents with spaces only)",
            at.line(),
            at.column()
        ),
        None => String::new(),
    }
}

/// Whether the field at `pointer` of `input` is one `S` knows: with some value there
/// that is not its default, the typed object either keeps it or refuses its shape (an
/// unknown field is ignored by the decoder whatever it holds). Two probes of each
/// shape, since the write-back omits a field at its default whichever that is
/// (`allow_expansion` defaults to true: a probe of `true` alone is omitted).
fn is_known_field<S: Spec>(input: &serde_json::Value, pointer: &str) -> bool {
    use serde_json::Value;
    let Some(slot) = input.pointer(pointer) else {
        return false;
    };
    let probes: [Value; 2] = match slot {
        Value::Bool(_) => [Value::Bool(true), Value::Bool(false)],
        Value::String(_) => [Value::String("x".into()), Value::String("y".into())],
        _ => [Value::from(1), Value::from(2)],
    };
    probes.into_iter().any(|value| {
        let mut probe = input.clone();
        if let Some(slot) = probe.pointer_mut(pointer) {
            *slot = value;
        }
        match serde_json::from_value::<Object<S>>(probe) {
            Ok(obj) => serde_json::to_value(&obj)
                .ok()
                .is_some_and(|kept| kept.pointer(pointer).is_some()),
            Err(_) => true,
        }
    })
}

/// The first path present in `input` but absent from `kept` (the object as typed and
/// written back), unless `known` says the value there (a `false`, `0`, `""`, null,
/// `[]` or `{}`, which the write-back omits at its default) belongs to a known field.
fn unknown_field(
    input: &serde_json::Value,
    kept: &serde_json::Value,
    path: String,
    pointer: String,
    known: &dyn Fn(&str) -> bool,
) -> Option<String> {
    use serde_json::Value;
    match (input, kept) {
        (Value::Object(i), Value::Object(k)) => {
            for (key, v) in i {
                let p = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                let ptr = format!("{pointer}/{}", key.replace('~', "~0").replace('/', "~1"));
                match k.get(key) {
                    Some(kv) => {
                        if let Some(found) = unknown_field(v, kv, p, ptr, known) {
                            return Some(found);
                        }
                    }
                    // A known field written back as absent (its value is the
                    // default once typed): whatever it holds that is not a known
                    // field at its default is unknown (`secret_refs: {bogus: x}`).
                    None if known(&ptr) => {
                        let empty = Value::Object(Default::default());
                        if let Some(found) = v
                            .as_object()
                            .filter(|m| !m.is_empty())
                            .and_then(|_| unknown_field(v, &empty, p, ptr, known))
                        {
                            return Some(found);
                        }
                    }
                    None => return Some(printable(&p)),
                }
            }
            None
        }
        (Value::Array(i), Value::Array(k)) if i.len() == k.len() => {
            i.iter().zip(k).enumerate().find_map(|(n, (iv, kv))| {
                unknown_field(
                    iv,
                    kv,
                    format!("{path}[{n}]"),
                    format!("{pointer}/{n}"),
                    known,
                )
            })
        }
        _ => None,
    }
}

/// A YAML or JSON value read as `serde_json::Value`, refusing a mapping key given twice
/// (YAML says keys are unique; a silent last-wins hides a mistake) and nesting deeper
/// than [`MAX_DEPTH`], and reading integers beyond 64 bits as floats (so that a size
/// says it is too large instead of the text failing to parse).
struct Strict {
    depth: usize,
}

impl<'de> serde::de::DeserializeSeed<'de> for Strict {
    type Value = serde_json::Value;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Strict {
    type Value = serde_json::Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a YAML or JSON value")
    }
    fn visit_bool<E>(self, b: bool) -> Result<Self::Value, E> {
        Ok(b.into())
    }
    fn visit_i64<E>(self, n: i64) -> Result<Self::Value, E> {
        Ok(n.into())
    }
    fn visit_u64<E>(self, n: u64) -> Result<Self::Value, E> {
        Ok(n.into())
    }
    fn visit_i128<E>(self, n: i128) -> Result<Self::Value, E> {
        Ok(i64::try_from(n).map_or_else(|_| (n as f64).into(), Into::into))
    }
    fn visit_u128<E>(self, n: u128) -> Result<Self::Value, E> {
        Ok(u64::try_from(n).map_or_else(|_| (n as f64).into(), Into::into))
    }
    fn visit_f64<E>(self, n: f64) -> Result<Self::Value, E> {
        Ok(serde_json::Number::from_f64(n).map_or(serde_json::Value::Null, Into::into))
    }
    fn visit_str<E>(self, s: &str) -> Result<Self::Value, E> {
        Ok(s.into())
    }
    fn visit_string<E>(self, s: String) -> Result<Self::Value, E> {
        Ok(s.into())
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }
    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }
    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let inner = self.deeper()?;
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(Strict { depth: inner })? {
            out.push(v);
        }
        Ok(out.into())
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let inner = self.deeper()?;
        let mut out = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let v = map.next_value_seed(Strict { depth: inner })?;
            if out.contains_key(&key) {
                return Err(serde::de::Error::custom(format!(
                    "the key {:?} is given twice in one mapping",
                    printable(&key)
                )));
            }
            out.insert(key, v);
        }
        Ok(out.into())
    }
}

impl Strict {
    fn deeper<E: serde::de::Error>(&self) -> Result<usize, E> {
        if self.depth >= MAX_DEPTH {
            return Err(E::custom(format!("nested deeper than {MAX_DEPTH} levels")));
        }
        Ok(self.depth + 1)
    }
}

/// Refuses a text too large or too deeply nested before its values are built (a deep
/// flow-style document costs the YAML parser time quadratic in its depth). The depth is
/// counted on libyaml's own events, pulled one at a time and stopped at the first
/// collection past [`MAX_DEPTH`] (`yaml_depth`): no quote, comment or block scalar can
/// hide structure from the parser that builds it, since it is the same parser.
fn check_limits(text: &str) -> Result<(), ManifestError> {
    if text.len() > MAX_MANIFEST_BYTES {
        return Err(ManifestError::TooLarge {
            what: format!(
                "the manifest is {} bytes; the largest accepted is {MAX_MANIFEST_BYTES} bytes",
                text.len()
            ),
        });
    }
    if super::yaml_depth::depth(text.as_bytes(), MAX_DEPTH) == super::yaml_depth::Depth::Deeper {
        return Err(ManifestError::TooLarge {
            what: format!("the manifest nests deeper than {MAX_DEPTH} levels"),
        });
    }
    Ok(())
}

/// Parses every document of a YAML or JSON text (JSON is YAML), applying defaults and
/// validating each; one result per non-empty document.
pub fn parse_manifests(text: &str) -> Vec<Result<AnyObject, ManifestError>> {
    use serde::de::DeserializeSeed;
    // A byte order mark (editors on Windows write one) is not part of the text.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut out = Vec::new();
    if let Err(e) = check_limits(text) {
        out.push(Err(e));
        return out;
    }
    let mut seen: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    for (i, de) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let doc = i + 1;
        let value = match (Strict { depth: 0 }).deserialize(de) {
            Ok(serde_json::Value::Null) => continue,
            Ok(v) => v,
            Err(source) => {
                let hint = syntax_hint(text, &source);
                out.push(Err(ManifestError::Syntax { doc, hint, source }));
                // A syntax error leaves the parser unable to find later documents.
                break;
            }
        };
        let kind = value
            .get("kind")
            .and_then(|k| k.as_str())
            .unwrap_or("")
            .to_string();
        let parsed = AnyObject::parse(&kind, doc, value).unwrap_or_else(|| {
            Err(ManifestError::UnknownKind {
                doc,
                kind: printable(&kind),
            })
        });
        out.push(parsed.and_then(|obj| match seen.entry(obj.key()) {
            std::collections::hash_map::Entry::Occupied(first) => Err(ManifestError::Repeated {
                doc,
                first: *first.get(),
                key: printable(&obj.key()),
            }),
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(doc);
                Ok(obj)
            }
        }));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const DESIGN_EXAMPLE: &str = r#"
apiVersion: moor/v1
kind: Volume
metadata: {name: db-data, namespace: default}
spec:
  plugin_id: hostpath.moor.dev
  capacity_min: 1GiB
  capacity_max: 2GiB
  capabilities:
    - {access_mode: single-node-writer, attachment_mode: file-system}
  mount_options: {fs_type: ext4, mount_flags: [noatime]}
  parameters: {}
  secrets: {}
---
apiVersion: moor/v1
kind: Volume
metadata: {name: archive}
spec:
  plugin_id: hostpath.moor.dev
  external_id: vol-0123
  capabilities:
    - {access_mode: multi-node-reader-only, attachment_mode: file-system}
---
apiVersion: moor/v1
kind: Allocation
metadata: {name: web-1}
spec:
  node: local
  desired_status: run
  volumes:
    - {name: data, volume: db-data, access_mode: single-node-writer, attachment_mode: file-system}
    - {name: old, volume: archive, read_only: true, access_mode: multi-node-reader-only, attachment_mode: file-system}
"#;

    #[test]
    fn unknown_fields_are_refused_with_their_path() {
        let doc = "kind: Volume\nmetadata: {name: v}\nspec:\n  plugin_id: p\n  bogus_field: 1\n  capabilities:\n    - {access_mode: single-node-writer, attachment_mode: file-system, extra: x}\n";
        let r = parse_manifests(doc).remove(0).unwrap_err();
        assert!(r.to_string().contains("spec.bogus_field"), "{r}");
        let nested = doc.replace("  bogus_field: 1\n", "");
        let r = parse_manifests(&nested).remove(0).unwrap_err();
        assert!(r.to_string().contains("spec.capabilities[0].extra"), "{r}");
        // Empty values of known-but-omitted fields are fine (the design example has them).
        assert!(parse_manifests(DESIGN_EXAMPLE).iter().all(Result::is_ok));
    }

    #[test]
    fn sizes_above_1_eib_are_refused() {
        for size in [
            "16EiB",
            "18446744073709551615",
            "9223372036854775808",
            "9223372036854775807",
        ] {
            let doc = format!("kind: Volume\nmetadata: {{name: v}}\nspec: {{plugin_id: p, capacity_min: {size}, capabilities: [{{access_mode: single-node-writer, attachment_mode: file-system}}]}}\n");
            let r = parse_manifests(&doc).remove(0);
            assert!(r.is_err(), "{size} accepted");
        }
        assert_eq!(Size::parse("1EiB").unwrap().0, 1 << 60);
    }

    /// A Volume whose spec holds `field` (YAML lines indented by two spaces).
    fn volume_with(field: &str) -> String {
        format!(
            "apiVersion: moor/v1\nkind: Volume\nmetadata: {{name: v}}\nspec:\n  plugin_id: p\n  capabilities:\n    - {{access_mode: single-node-writer, attachment_mode: file-system}}\n{field}"
        )
    }

    fn errors_of(text: &str) -> String {
        parse_manifests(text)
            .iter()
            .filter_map(|r| r.as_ref().err())
            .map(moor_chain)
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Issue 26: hostile manifests, each refused with a message that names the field,
    /// or accepted where it is legal.
    #[test]
    fn hostile_manifests_are_refused_with_the_field_named() {
        let deep = "[".repeat(100);
        let cases: Vec<(String, &str)> = vec![
            // Quotes and comments do not hide brackets from the depth limit.
            (format!("a: b\"c\nd: {deep}"), "nests deeper"),
            (format!("a: 'it''s \"'\nb: {deep}"), "nests deeper"),
            (format!("# a \" in a comment\na: {deep}"), "nests deeper"),
            (format!("a: \"x\\\" {deep}\"\nb: {deep}"), "nests deeper"),
            (format!("{}x\n", "- ".repeat(100)), "nests deeper"),
            // Sizes.
            (volume_with("  capacity_min: 1e30\n"), "spec.capacity_min"),
            (volume_with("  capacity_min: 1e30\n"), "too large"),
            (volume_with("  capacity_min: -1\n"), "negative"),
            (volume_with("  capacity_min: 1.5\n"), "whole number"),
            (
                volume_with("  capacity_min: 18446744073709551616\n"),
                "too large",
            ),
            (
                volume_with("  capacity_min: 9223372036854775807\n"),
                "too large",
            ),
            (volume_with("  capacity_max: 0\n"), "spec.capacity_max"),
            // Unknown fields, whatever their value.
            (volume_with("  bogus: \"\"\n"), "unknown field spec.bogus"),
            (volume_with("  bogus: false\n"), "unknown field spec.bogus"),
            (volume_with("  bogus: 0\n"), "unknown field spec.bogus"),
            // Issue 37, item 4: empty values too, at any level.
            (volume_with("  bogus: null\n"), "unknown field spec.bogus"),
            (volume_with("  bogus: ~\n"), "unknown field spec.bogus"),
            (volume_with("  bogus: []\n"), "unknown field spec.bogus"),
            (volume_with("  bogus: {}\n"), "unknown field spec.bogus"),
            (
                format!("bogus: ~\n{}", volume_with("")),
                "unknown field bogus",
            ),
            (
                format!("bogus: {{}}\n{}", volume_with("")),
                "unknown field bogus",
            ),
            (
                volume_with("").replace("{name: v}", "{name: v, bogus: []}"),
                "unknown field metadata.bogus",
            ),
            // A key given twice.
            (
                volume_with("  capacity_min: 1MiB\n  capacity_min: 2MiB\n"),
                "\"capacity_min\" is given twice",
            ),
            // Node names and labels.
            (
                volume_with("  force_detach: {\"../../x\": 1}\n"),
                "spec.force_detach.../../x",
            ),
            (
                volume_with("").replace(
                    "metadata: {name: v}",
                    &format!(
                        "metadata:\n  name: v\n  labels:\n    ? {}\n    : a",
                        "k".repeat(100_000)
                    ),
                ),
                "label key",
            ),
            (
                volume_with("").replace("{name: v}", "{name: v, labels: {a: \"\\e[31m\"}}"),
                "label value",
            ),
            // Issue 54: a volume's availability, a cordon; issue 53: a group snapshot.
            (volume_with("  availability: forever\n"), "spec.availability"),
            (
                "kind: Cordon\nmetadata: {name: n1}\nspec: {reason: \"\\e[31mred\"}\n".to_string(),
                "spec.reason",
            ),
            (
                "kind: Cordon\nmetadata: {name: n1}\nspec: {drain: yes please}\n".to_string(),
                "spec.drain",
            ),
            (
                "kind: Cordon\nmetadata: {name: n1}\nspec: {bogus: 1}\n".to_string(),
                "unknown field spec.bogus",
            ),
            (
                "kind: VolumeGroupSnapshot\nmetadata: {name: g}\nspec: {volumes: []}\n".to_string(),
                "at least one volume",
            ),
            (
                "kind: VolumeGroupSnapshot\nmetadata: {name: g}\nspec: {volumes: [a, a]}\n".to_string(),
                "named twice",
            ),
            (
                "kind: VolumeGroupSnapshot\nmetadata: {name: g}\nspec: {volumes: [\"../x\"]}\n".to_string(),
                "spec.volumes",
            ),
            (
                "kind: VolumeGroupSnapshot\nmetadata: {name: g}\nspec: {volumes: [a], group_snapshot_id: \"a\\u0007b\"}\n".to_string(),
                "spec.group_snapshot_id",
            ),
            (
                "kind: Snapshot\nmetadata: {name: s}\nspec: {volume: a, group: g}\n".to_string(),
                "spec.group",
            ),
            // Issue 54, part 3: volume classes, and the fields that name one.
            (
                "kind: VolumeClass\nmetadata: {name: c}\nspec: {plugin_id: \"a b\"}\n".to_string(),
                "spec.plugin_id",
            ),
            (
                "kind: VolumeClass\nmetadata: {name: c}\nspec: {plugin_id: p, parameters: {\"k\\u0007\": v}}\n".to_string(),
                "spec.parameters",
            ),
            (
                "kind: VolumeClass\nmetadata: {name: c}\nspec: {plugin_id: p, mount_options: {fs_type: \"ext4 -o x\"}}\n".to_string(),
                "fs_type",
            ),
            (
                "kind: VolumeClass\nmetadata: {name: c}\nspec: {plugin_id: p, on_delete: shred}\n".to_string(),
                "spec.on_delete",
            ),
            (
                "kind: VolumeClass\nmetadata: {name: c}\nspec: {plugin_id: p, reclaim: keep}\n".to_string(),
                "unknown field spec.reclaim",
            ),
            (volume_with("  class: \"../fast\"\n"), "spec.class"),
            (
                "apiVersion: moor/v1\nkind: Allocation\nmetadata: {name: a}\nspec:\n  node: n1\n  volumes:\n    - {name: d, template: {class: \"a b\"}}\n".to_string(),
                "spec.volumes[0].template.class",
            ),
            // Issue 54, part 5: snapshot schedules.
            (
                "kind: SnapshotSchedule\nmetadata: {name: s}\nspec: {interval: \"1h\\e[31m\", retention: {keep: 1}}\n".to_string(),
                "spec.interval",
            ),
            (
                "kind: SnapshotSchedule\nmetadata: {name: s}\nspec: {cron: \"99 * * * *\", retention: {keep: 1}}\n".to_string(),
                "spec.cron",
            ),
            (
                "kind: SnapshotSchedule\nmetadata: {name: s}\nspec: {interval: 1h, retention: {keep: -1}}\n".to_string(),
                "spec.retention.keep",
            ),
            (
                "kind: SnapshotSchedule\nmetadata: {name: s}\nspec: {interval: 1h, retention: {keep: 1}, selector: {\"a b\": c}}\n".to_string(),
                "spec.selector",
            ),
            (
                format!("kind: SnapshotSchedule\nmetadata: {{name: {}}}\nspec: {{interval: 1h, retention: {{keep: 1}}}}\n", "s".repeat(64)),
                "at most 63",
            ),
            (
                "kind: SnapshotSchedule\nmetadata: {name: s}\nspec: {interval: 1h, retention: {keep: 1}, paused: maybe}\n".to_string(),
                "spec.paused",
            ),
            // Issue 54, part 4: Secrets, and the fields that name one.
            (
                "kind: Secret\nmetadata: {name: s}\nspec: {plugin_id: p, secrets: {}}\n".to_string(),
                "spec.secrets: at least one key",
            ),
            (
                "kind: Secret\nmetadata: {name: s}\nspec: {plugin_id: p, secrets: {\"k\\e[31m\": v}}\n".to_string(),
                "spec.secrets.",
            ),
            (
                "kind: Secret\nmetadata: {name: s}\nspec: {plugin_id: \"../p\", secrets: {k: v}}\n".to_string(),
                "spec.plugin_id",
            ),
            (
                "kind: Secret\nmetadata: {name: s}\nspec: {plugin_id: p, secrets: [k]}\n".to_string(),
                "spec.secrets",
            ),
            (
                "kind: Secret\nmetadata: {name: s}\nspec: {plugin_id: p, secrets: {k: v}, data: {k: v}}\n".to_string(),
                "unknown field spec.data",
            ),
            (
                format!("kind: Secret\nmetadata: {{name: s}}\nspec: {{plugin_id: p, secrets: {{k: {}}}}}\n", "x".repeat(70_000)),
                "at most 65536",
            ),
            (volume_with("  secret_refs: {controller: \"../x\"}\n"), "spec.secret_refs.controller"),
            (volume_with("  secret_refs: {node_stage: \"a\\u0007\"}\n"), "spec.secret_refs.node_stage"),
            (volume_with("  secret_refs: {provisioner: x}\n"), "unknown field spec.secret_refs.provisioner"),
            (
                "kind: Snapshot\nmetadata: {name: s}\nspec: {volume: a, secret_ref: \"a b\"}\n".to_string(),
                "spec.secret_ref",
            ),
            (
                "kind: VolumeClass\nmetadata: {name: c}\nspec: {plugin_id: p, secret_refs: {expand: \"../e\"}}\n".to_string(),
                "spec.secret_refs.expand",
            ),
            // The same object twice in one text.
            (
                format!("{}---\n{}", volume_with(""), volume_with("")),
                "volumes/default/v is also document 1",
            ),
        ];
        for (text, expected) in &cases {
            let errors = errors_of(text);
            assert!(
                errors.contains(expected),
                "expected {expected:?} for {:?}, got {errors:?}",
                text.chars().take(120).collect::<String>()
            );
            assert!(!errors.contains('\u{1b}'), "{errors:?}");
        }
        // Legal input stays accepted: known fields at their defaults, a byte order
        // mark, plain scalars with quotes and brackets inside, comments with quotes.
        for text in [
            volume_with("  parameters: {}\n  secrets: {}\n"),
            volume_with("  capacity_max: null\n  mount_options: {}\n"),
            volume_with("").replace("{name: v}", "{name: v, labels: {}, finalizers: []}"),
            format!("\u{feff}{}", volume_with("")),
            volume_with("  parameters: {note: it's \"fine\" [really}\n").replace("{note: it's \"fine\" [really}", "\n    note: it's \"fine\" [really"),
            volume_with("  # a comment with a \" quote\n  parameters: {a: 'it''s'}\n"),
            "apiVersion: moor/v1\nkind: Allocation\nmetadata: {name: a}\nspec:\n  node: n1\n  volumes:\n    - {name: d, volume: v, read_only: false, per_alloc: false}\n".to_string(),
            volume_with("  availability: pause\n"),
            "kind: Cordon\nmetadata: {name: n1}\nspec: {reason: disk swap, drain: true}\n".to_string(),
            "kind: VolumeGroupSnapshot\nmetadata: {name: g}\nspec: {volumes: [a, b]}\n".to_string(),
            "kind: VolumeClass\nmetadata: {name: fast}\nspec: {plugin_id: p, parameters: {tier: ssd}, on_delete: retain, allow_expansion: false, default: true}\n".to_string(),
            // At its default (true), which the write-back omits: still a known field
            // (issue 78, item 5: the README's example was refused).
            "kind: VolumeClass\nmetadata: {name: fast}\nspec: {plugin_id: p, allow_expansion: true}\n".to_string(),
            "kind: Volume\nmetadata: {name: v}\nspec: {class: fast}\n".to_string(),
            "kind: SnapshotSchedule\nmetadata: {name: nightly}\nspec: {cron: \"0 2 * * *\", selector: {tier: gold}, retention: {keep: 7, max_age: 30d}, parameters: {kind: full}}\n".to_string(),
        ] {
            assert_eq!(errors_of(&text), "", "refused: {text:?}");
        }
    }

    /// The README's VolumeClass example (the indented block from `kind: VolumeClass`
    /// to the blank line) is accepted as written (issue 78, item 5).
    #[test]
    fn the_readme_s_volume_class_example_is_accepted() {
        let readme = include_str!("../../README.md");
        let lines: Vec<&str> = readme.lines().collect();
        let start = lines
            .iter()
            .position(|l| l.trim() == "kind: VolumeClass")
            .expect("README.md shows a VolumeClass");
        let indent = lines[start].len() - lines[start].trim_start().len();
        let block: Vec<&str> = lines[start..]
            .iter()
            .take_while(|l| !l.trim().is_empty())
            .map(|l| l.get(indent..).unwrap_or_default())
            .collect();
        let text = block.join("\n") + "\n";
        let parsed = parse_manifests(&text);
        assert_eq!(parsed.len(), 1, "{text}");
        match &parsed[0] {
            Ok(AnyObject::VolumeClass(c)) => {
                assert!(c.spec.allow_expansion, "{text}");
                assert_eq!(c.spec.on_delete, Some(OnDelete::Retain), "{text}");
            }
            other => panic!("the README's VolumeClass: {other:?}\n{text}"),
        }
    }

    #[test]
    fn deep_or_huge_manifests_are_refused_before_parsing() {
        // Refused at the 65th level, so however deep the text, the answer comes at
        // once (a parser that built the values first would take minutes on these: the
        // test would hang, not time out an assertion).
        let deep = format!("{}{}", "[".repeat(200_000), "]".repeat(200_000));
        let r = parse_manifests(&deep).remove(0).unwrap_err();
        assert!(r.to_string().contains("nests deeper"), "{r}");
        // Issue 37, item 3: what a lexer of our own took for the start of a quoted
        // scalar (a quote inside a block scalar) hid the brackets after it, and the
        // parser spent seconds to minutes on them. Depth is now counted by the parser.
        let brackets = format!("{}{}", "[".repeat(200_000), "]".repeat(200_000));
        for prefix in [
            "a: |\n  \"\ny: ",
            "a: >\n  'x\ny: ",
            "a: |2-\n   \"\n  \"\ny: ",
            "- |\n   \"\n- ",
            "a: b # \"\ny: ",
            "a: \"x\n  y\"\nz: ",
            "a: b\"c\ny: ",
        ] {
            let text = format!("{prefix}{brackets}\n");
            let errors: Vec<String> = parse_manifests(&text)
                .into_iter()
                .filter_map(|r| r.err().map(|e| e.to_string()))
                .collect();
            assert!(
                errors.iter().any(|e| e.contains("nests deeper")),
                "{prefix:?}: {errors:?}"
            );
        }
        // Where the brackets are a scalar's text to the parser (an escaped quote goes
        // on to the next line; a plain scalar may hold brackets), they nest nothing;
        // whatever the answer, it comes (an answer, not a panic or a hang).
        for prefix in ["a: \"\\\"\ny: ", "a: b\"c "] {
            let text = format!("{prefix}{brackets}\n");
            assert!(!parse_manifests(&text).is_empty(), "{prefix:?}");
        }
        let big = format!(
            "kind: Volume\nmetadata: {{name: v}}\nspec: {{plugin_id: p, parameters: {{k: {}}}, capabilities: [{{access_mode: single-node-writer, attachment_mode: file-system}}]}}\n",
            "x".repeat(2 << 20)
        );
        let r = parse_manifests(&big).remove(0).unwrap_err();
        assert!(r.to_string().contains("largest object"), "{r}");
    }

    #[test]
    fn names_echoed_in_errors_are_escaped() {
        let doc = "kind: \"Vol\\u001b[31mume\\u202e\"\n";
        let r = parse_manifests(doc).remove(0).unwrap_err().to_string();
        assert!(!r.contains('\u{1b}') && !r.contains('\u{202e}'), "{r:?}");
        assert!(r.contains("\\u{1b}"), "{r}");
    }

    #[test]
    fn the_design_example_parses() {
        let objs: Vec<AnyObject> = parse_manifests(DESIGN_EXAMPLE)
            .into_iter()
            .collect::<Result<_, _>>()
            .unwrap();
        let keys: Vec<String> = objs.iter().map(AnyObject::key).collect();
        assert_eq!(
            keys,
            [
                "volumes/default/db-data",
                "volumes/default/archive",
                "allocations/default/web-1"
            ]
        );
        let AnyObject::Volume(v) = &objs[0] else {
            panic!()
        };
        assert_eq!(v.spec.capacity_max, Some(Size(2 << 30)));
    }

    #[test]
    fn each_bad_document_is_reported_and_the_good_ones_still_parse() {
        let text = r#"
kind: Volume
metadata: {name: ok}
spec: {plugin_id: p, capabilities: [{access_mode: single-node-writer, attachment_mode: file-system}]}
---
kind: Volume
metadata: {name: bad}
spec: {capabilities: [{access_mode: single-node, attachment_mode: file-system}]}
---
kind: Volume
metadata: {name: "a/b"}
spec: {plugin_id: "a b", capacity_min: 2GiB, capacity_max: 1GiB}
---
kind: Gadget
metadata: {name: g}
"#;
        let results = parse_manifests(text);
        assert_eq!(results.len(), 4);
        assert!(results[0].is_ok());
        let shape = results[1].as_ref().unwrap_err();
        let text = moor_chain(shape);
        assert!(text.contains("single-node"), "{text}");
        assert!(text.contains("spec.capabilities[0].access_mode"), "{text}");
        let invalid = moor_chain(results[2].as_ref().unwrap_err());
        for f in [
            "metadata.name",
            "spec.plugin_id",
            "spec.capabilities",
            "spec.capacity_max",
        ] {
            assert!(invalid.contains(f), "{f} not in {invalid}");
        }
        assert!(matches!(results[3], Err(ManifestError::UnknownKind { .. })));
    }

    #[test]
    fn a_syntax_error_is_reported() {
        let results = parse_manifests("kind: Volume\nmetadata: {name: [\n");
        assert!(matches!(
            results.last(),
            Some(Err(ManifestError::Syntax { .. }))
        ));
        // A tab in the indentation is named (issue 78, item 7).
        let results = parse_manifests("kind: Volume\nmetadata:\n\tname: v\nspec: {plugin_id: p}\n");
        let said = results.last().unwrap().as_ref().unwrap_err().to_string();
        assert!(
            said.contains("line 3 is indented with a tab: YAML indents with spaces only"),
            "{said}"
        );
    }

    fn moor_chain(e: &ManifestError) -> String {
        crate::process::error_chain(e)
    }
}
