//! Manifests: YAML or JSON documents, several per file, of any kind.

use serde::Deserialize;

use super::*;

/// An object of any kind, as read from a manifest.
#[derive(Debug, Clone, PartialEq)]
pub enum AnyObject {
    /// A Volume.
    Volume(Box<Volume>),
    /// An Allocation.
    Allocation(Box<Allocation>),
    /// A Claim.
    Claim(Box<Claim>),
    /// An Attachment.
    Attachment(Box<Attachment>),
    /// A Mount.
    Mount(Box<Mount>),
    /// A Node.
    Node(Box<Node>),
    /// A Plugin.
    Plugin(Box<Plugin>),
    /// An Event.
    Event(Box<Event>),
    /// A Snapshot.
    Snapshot(Box<Snapshot>),
}

/// Why a manifest document was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// Not YAML or JSON.
    #[error("document {doc}: not valid YAML or JSON")]
    Syntax {
        /// 1-based document number.
        doc: usize,
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

impl AnyObject {
    /// The object's key below the store prefix.
    pub fn key(&self) -> String {
        match self {
            AnyObject::Volume(o) => o.key(),
            AnyObject::Allocation(o) => o.key(),
            AnyObject::Claim(o) => o.key(),
            AnyObject::Attachment(o) => o.key(),
            AnyObject::Mount(o) => o.key(),
            AnyObject::Node(o) => o.key(),
            AnyObject::Plugin(o) => o.key(),
            AnyObject::Event(o) => o.key(),
            AnyObject::Snapshot(o) => o.key(),
        }
    }
}

fn typed<S: Spec>(
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
    // not know: refused with its path, not silently dropped.
    if let Ok(kept) = serde_json::to_value(&obj) {
        if let Some(path) = unknown_field(&value, &kept, String::new()) {
            return Err(ManifestError::UnknownField {
                doc,
                kind: S::KIND.to_string(),
                path,
            });
        }
    }
    obj.apply_defaults();
    obj.validate().map_err(|errors| ManifestError::Invalid {
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

/// The first path present in `input` with a non-empty value but absent from `kept`
/// (the object as typed and written back).
fn unknown_field(
    input: &serde_json::Value,
    kept: &serde_json::Value,
    path: String,
) -> Option<String> {
    use serde_json::Value;
    let empty = |v: &Value| match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::Number(n) => n.as_f64() == Some(0.0),
    };
    match (input, kept) {
        (Value::Object(i), Value::Object(k)) => {
            for (key, v) in i {
                let p = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                match k.get(key) {
                    Some(kv) => {
                        if let Some(found) = unknown_field(v, kv, p) {
                            return Some(found);
                        }
                    }
                    None if empty(v) => {}
                    None => return Some(printable(&p)),
                }
            }
            None
        }
        (Value::Array(i), Value::Array(k)) if i.len() == k.len() => i
            .iter()
            .zip(k)
            .enumerate()
            .find_map(|(n, (iv, kv))| unknown_field(iv, kv, format!("{path}[{n}]"))),
        _ => None,
    }
}

/// Refuses a text too large or too deeply nested before the parser sees it (a deep
/// flow-style document costs the parser time quadratic in its depth).
fn check_limits(text: &str) -> Result<(), ManifestError> {
    if text.len() > MAX_MANIFEST_BYTES {
        return Err(ManifestError::TooLarge {
            what: format!(
                "the manifest is {} bytes; the largest accepted is {MAX_MANIFEST_BYTES} bytes",
                text.len()
            ),
        });
    }
    let (mut depth, mut deepest, mut quoted, mut escaped) = (0usize, 0usize, false, false);
    for b in text.bytes() {
        if quoted {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => quoted = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => quoted = true,
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        if deepest > MAX_DEPTH {
            return Err(ManifestError::TooLarge {
                what: format!("the manifest nests deeper than {MAX_DEPTH} levels"),
            });
        }
    }
    Ok(())
}

/// Parses every document of a YAML or JSON text (JSON is YAML), applying defaults and
/// validating each; one result per non-empty document.
pub fn parse_manifests(text: &str) -> Vec<Result<AnyObject, ManifestError>> {
    let mut out = Vec::new();
    if let Err(e) = check_limits(text) {
        out.push(Err(e));
        return out;
    }
    for (i, de) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let doc = i + 1;
        let value = match serde_json::Value::deserialize(de) {
            Ok(serde_json::Value::Null) => continue,
            Ok(v) => v,
            Err(source) => {
                out.push(Err(ManifestError::Syntax { doc, source }));
                // A syntax error leaves the parser unable to find later documents.
                break;
            }
        };
        let kind = value
            .get("kind")
            .and_then(|k| k.as_str())
            .unwrap_or("")
            .to_string();
        out.push(match kind.as_str() {
            "Volume" => typed(doc, value, AnyObject::Volume),
            "Allocation" => typed(doc, value, AnyObject::Allocation),
            "Claim" => typed(doc, value, AnyObject::Claim),
            "Attachment" => typed(doc, value, AnyObject::Attachment),
            "Mount" => typed(doc, value, AnyObject::Mount),
            "Node" => typed(doc, value, AnyObject::Node),
            "Plugin" => typed(doc, value, AnyObject::Plugin),
            "Event" => typed(doc, value, AnyObject::Event),
            "Snapshot" => typed(doc, value, AnyObject::Snapshot),
            _ => Err(ManifestError::UnknownKind {
                doc,
                kind: printable(&kind),
            }),
        });
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
    fn sizes_of_2_63_bytes_or_more_are_refused() {
        for size in ["16EiB", "18446744073709551615", "9223372036854775808"] {
            let doc = format!("kind: Volume\nmetadata: {{name: v}}\nspec: {{plugin_id: p, capacity_min: {size}, capabilities: [{{access_mode: single-node-writer, attachment_mode: file-system}}]}}\n");
            let r = parse_manifests(&doc).remove(0);
            assert!(r.is_err(), "{size} accepted");
        }
        assert_eq!(
            Size::parse("9223372036854775807").unwrap().0,
            i64::MAX as u64
        );
    }

    #[test]
    fn deep_or_huge_manifests_are_refused_before_parsing() {
        let deep = format!("{}{}", "[".repeat(200_000), "]".repeat(200_000));
        let started = std::time::Instant::now();
        let r = parse_manifests(&deep).remove(0).unwrap_err();
        assert!(r.to_string().contains("nests deeper"), "{r}");
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
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
spec: {capacity_min: 2GiB, capacity_max: 1GiB}
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
    }

    fn moor_chain(e: &ManifestError) -> String {
        crate::process::error_chain(e)
    }
}
