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
    #[error("document {doc}: kind {kind:?} is not one of Volume, Allocation, Claim, Attachment, Mount, Node, Plugin, Event")]
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
        serde_path_to_error::deserialize(value).map_err(|e| ManifestError::Shape {
            doc,
            kind: S::KIND.to_string(),
            path: e.path().to_string(),
            source: e.into_inner(),
        })?;
    obj.apply_defaults();
    obj.validate().map_err(|errors| ManifestError::Invalid {
        doc,
        kind: S::KIND.to_string(),
        name,
        errors,
    })?;
    Ok(wrap(Box::new(obj)))
}

/// Parses every document of a YAML or JSON text (JSON is YAML), applying defaults and
/// validating each; one result per non-empty document.
pub fn parse_manifests(text: &str) -> Vec<Result<AnyObject, ManifestError>> {
    let mut out = Vec::new();
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
            _ => Err(ManifestError::UnknownKind { doc, kind }),
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
        crate::runtime::controller::error_chain(e)
    }
}
