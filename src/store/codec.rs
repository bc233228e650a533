//! How objects are stored as bytes: JSON, each value checked against its key and
//! validated on the way in, secrets sealed (and bound to their key) when a keyring is
//! held.

use std::sync::Arc;

use super::{Keyring, MalformedCause, OpenError, StoreError};
use crate::api::{Object, Secrets, Spec, StoredAs, UnknownFields};

/// What a sealed field is bound to: its object's key and its name.
fn aad(key: &str, field: &str) -> String {
    format!("{key}#{field}")
}

/// How objects are stored as bytes: JSON, with secrets sealed when a keyring is held.
#[derive(Debug, Clone, Default)]
pub struct Codec {
    pub(super) keyring: Option<Arc<Keyring>>,
}

impl Codec {
    /// A codec sealing with `keyring` (storing secrets as given without one).
    pub fn new(keyring: Option<Keyring>) -> Codec {
        Codec {
            keyring: keyring.map(Arc::new),
        }
    }

    /// Decodes and checks a value read at `key` (below the prefix), opening its sealed
    /// secrets with this store's keyring where it holds their key.
    pub fn decode<S: Spec>(
        &self,
        key: &str,
        value: &[u8],
        mod_revision: i64,
    ) -> Result<Object<S>, StoreError> {
        let malformed = |cause| StoreError::Malformed {
            key: key.to_string(),
            revision: mod_revision,
            cause,
        };
        if value.len() > S::MAX_BYTES {
            return Err(malformed(MalformedCause::TooLarge {
                kind: S::KIND,
                bytes: value.len(),
                max: S::MAX_BYTES,
            }));
        }
        let mut obj: Object<S> =
            serde_json::from_slice(value).map_err(|e| malformed(MalformedCause::Json(e)))?;
        obj.unknown = unknown_fields(value, &obj);
        obj.validate_stored()
            .map_err(|e| malformed(MalformedCause::Invalid(e)))?;
        let actual = obj.key();
        if actual != key {
            return Err(malformed(MalformedCause::WrongKey { actual }));
        }
        if let Some(keyring) = &self.keyring {
            for field in obj.spec.secret_fields() {
                let Some(text) = field.secrets.sealed() else {
                    continue;
                };
                match keyring.open_map(field.node, &aad(key, field.field), text) {
                    Ok((map, id)) => *field.secrets = Secrets::opened(map, &id),
                    // Kept sealed: written back as read, never exposed.
                    Err(OpenError::NotHeld(_)) => {}
                    Err(e) => return Err(malformed(MalformedCause::Sealed(e))),
                }
            }
        }
        obj.metadata.resource_version = mod_revision;
        Ok(obj)
    }

    /// The bytes stored for `obj`, its open secrets sealed when this store has a
    /// keyring (stored as given without one).
    pub fn encode<S: Spec>(&self, obj: &Object<S>) -> Result<Vec<u8>, StoreError> {
        let mut stored = obj.clone();
        stored.metadata.resource_version = 0;
        if let Some(keyring) = &self.keyring {
            let key = obj.key();
            for field in stored.spec.secret_fields() {
                // Sealed text kept as read, nothing to seal, or secrets this keyring
                // does not serve (a node agent writing a volume's status): as given.
                let Ok(values) = field.secrets.expose() else {
                    continue;
                };
                if values.is_empty() || !keyring.serves(field.node) {
                    continue;
                }
                let aad = aad(&key, field.field);
                let text = keyring.seal_map(field.node, &aad, values).map_err(|e| {
                    StoreError::Sealing {
                        key: key.clone(),
                        cause: e,
                    }
                })?;
                *field.secrets = Secrets::sealed_text(text);
            }
        }
        // Serialising our own types to JSON cannot fail: every map key is a string.
        if stored.unknown.is_empty() {
            return Ok(serde_json::to_vec(&stored).unwrap_or_default());
        }
        let mut value = serde_json::to_value(&stored).unwrap_or_default();
        stored.unknown.restore(&mut value);
        Ok(serde_json::to_vec(&value).unwrap_or_default())
    }

    /// Whether `obj` (as read) has secrets this store would store differently: in
    /// plain text, or sealed with a key other than the one that seals now. Only a
    /// store with the cluster's keys answers yes.
    pub fn needs_reseal<S: Spec>(&self, obj: &Object<S>) -> bool {
        self.spec_needs_reseal(&obj.spec)
    }

    /// [`Codec::needs_reseal`] of an object of spec `spec` (a projection that keeps
    /// the secret fields as read).
    pub fn spec_needs_reseal<S: Spec>(&self, spec: &S) -> bool {
        let Some(keyring) = self.keyring.as_deref().filter(|k| k.node().is_none()) else {
            return false;
        };
        let mut spec = spec.clone();
        let fields = spec.secret_fields();
        fields.iter().any(|f| match f.secrets.stored_as() {
            Some(StoredAs::Plain) => !f.secrets.is_empty(),
            Some(StoredAs::Key(id)) => id != keyring.primary_id(),
            None => false,
        })
    }
}

/// What the stored `value` holds that `obj` (decoded from it, secrets still as stored)
/// does not: nothing when encoding `obj` again gives the same bytes, as it does for
/// every value this version wrote; else the members found by comparing the two.
fn unknown_fields<S: Spec>(value: &[u8], obj: &Object<S>) -> UnknownFields {
    let again = serde_json::to_vec(obj).unwrap_or_default();
    if again == value {
        return UnknownFields::default();
    }
    let (Ok(stored), Ok(known)) = (
        serde_json::from_slice::<serde_json::Value>(value),
        serde_json::to_value(obj),
    ) else {
        return UnknownFields::default();
    };
    UnknownFields::between(&stored, &known)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::*;

    #[test]
    fn decode_rejects_garbage_naming_the_key() {
        let err = Codec::default()
            .decode::<VolumeSpec>("volumes/default/v", b"{not json", 3)
            .unwrap_err();
        assert!(matches!(
            &err,
            StoreError::Malformed { key, revision: 3, cause: MalformedCause::Json(_) } if key == "volumes/default/v"
        ));
    }

    #[test]
    fn decode_rejects_an_object_stored_under_another_key() {
        let spec = VolumeSpec {
            plugin_id: PluginId::new("p").unwrap(),
            capabilities: vec![VolumeCapability {
                access_mode: AccessMode::SingleNodeWriter,
                attachment_mode: AttachmentMode::FileSystem,
            }],
            ..Default::default()
        };
        let v = Volume::new(&Namespace::default_ns(), Name::new("a").unwrap(), spec);
        let bytes = Codec::default().encode(&v).unwrap();
        assert!(Codec::default()
            .decode::<VolumeSpec>("volumes/default/a", &bytes, 7)
            .is_ok());
        let err = Codec::default()
            .decode::<VolumeSpec>("volumes/default/b", &bytes, 7)
            .unwrap_err();
        assert!(matches!(
            err,
            StoreError::Malformed {
                cause: MalformedCause::WrongKey { .. },
                ..
            }
        ));
        let decoded = Codec::default()
            .decode::<VolumeSpec>("volumes/default/a", &bytes, 7)
            .unwrap();
        assert_eq!(decoded.metadata.resource_version, 7);
    }

    /// Issue 50, item 2: an older moor decoded a newer one's object by skipping the
    /// fields it did not know and wrote it back whole, without them.
    #[test]
    fn a_newer_version_s_fields_survive_a_read_and_a_write_back() {
        let mut a = Allocation::new(
            &Namespace::default_ns(),
            Name::new("a1").unwrap(),
            AllocationSpec {
                node: NodeName::new("n1").unwrap(),
                volumes: vec![VolumeRequest {
                    name: Name::new("data").unwrap(),
                    volume: VolumeId::new("v1").unwrap(),
                    ..Default::default()
                }],
                ..Default::default()
            },
        );
        let codec = Codec::default();
        let ours = codec.encode(&a).unwrap();
        let read = codec
            .decode::<AllocationSpec>("allocations/default/a1", &ours, 3)
            .unwrap();
        assert!(read.unknown.is_empty(), "this version's own value");
        // What a newer version wrote: fields at the top, in the spec, in a request and
        // in the status beside the flattened StatusMeta.
        let mut newer: serde_json::Value = serde_json::from_slice(&ours).unwrap();
        newer["future_top"] = 1.into();
        newer["spec"]["future_spec"] = serde_json::json!({"k": "v"});
        newer["spec"]["volumes"][0]["future_request"] = true.into();
        newer["status"]["future_status"] = "x".into();
        let bytes = serde_json::to_vec(&newer).unwrap();
        let mut read = codec
            .decode::<AllocationSpec>("allocations/default/a1", &bytes, 4)
            .unwrap();
        assert_eq!(read.unknown.len(), 4);
        // This version's writers change what they know ...
        read.status.phase = AllocationPhase::Ready;
        read.status.meta.last_error = Some("e".into());
        read.spec.desired_status = DesiredStatus::Stop;
        let written: serde_json::Value =
            serde_json::from_slice(&codec.encode(&read).unwrap()).unwrap();
        // ... and the rest comes back as the newer version wrote it.
        assert_eq!(written["future_top"], 1);
        assert_eq!(written["spec"]["future_spec"]["k"], "v");
        assert_eq!(written["spec"]["volumes"][0]["future_request"], true);
        assert_eq!(written["status"]["future_status"], "x");
        assert_eq!(written["status"]["phase"], "ready");
        assert_eq!(written["status"]["last_error"], "e");
        assert_eq!(written["spec"]["desired_status"], "stop");
        // A request removed takes its unknown member with it.
        a.spec.volumes.clear();
        a.unknown = read.unknown.clone();
        let written: serde_json::Value =
            serde_json::from_slice(&codec.encode(&a).unwrap()).unwrap();
        assert!(written["spec"].get("volumes").is_none(), "{written}");
        assert_eq!(written["spec"]["future_spec"]["k"], "v");
    }

    fn volume_with_secret(name: &str) -> Volume {
        let spec = VolumeSpec {
            plugin_id: PluginId::new("p").unwrap(),
            capabilities: vec![VolumeCapability {
                access_mode: AccessMode::SingleNodeWriter,
                attachment_mode: AttachmentMode::FileSystem,
            }],
            secrets: Secrets::new([("token".to_string(), "hunter2".to_string())].into()).into(),
            ..Default::default()
        };
        Volume::new(&Namespace::default_ns(), Name::new(name).unwrap(), spec)
    }

    fn keyring(id: &str) -> Keyring {
        Keyring::parse(&Keyring::generate(id).unwrap()).unwrap()
    }

    #[test]
    fn secrets_are_sealed_at_rest_and_open_only_for_key_holders() {
        let k1 = Codec::new(Some(keyring("k1")));
        let v = volume_with_secret("a");
        let bytes = k1.encode(&v).unwrap();
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(!text.contains("hunter2"), "{text}");
        assert!(text.contains("moor:sealed:v1:k1:"), "{text}");
        let read = k1
            .decode::<VolumeSpec>("volumes/default/a", &bytes, 2)
            .unwrap();
        assert_eq!(read.spec.secrets, v.spec.secrets);
        assert!(!k1.needs_reseal(&read));
        // Without the key: readable, kept sealed, written back unchanged, never exposed.
        let plain = Codec::default();
        let read = plain
            .decode::<VolumeSpec>("volumes/default/a", &bytes, 2)
            .unwrap();
        assert!(read
            .spec
            .secrets
            .expose()
            .unwrap_err()
            .to_string()
            .contains("\"k1\""));
        let again = plain.encode(&read).unwrap();
        assert_eq!(String::from_utf8(again).unwrap(), text);
        // Moved to another object's key (with its name changed to match): refused.
        let moved = text.replace("\"name\":\"a\"", "\"name\":\"b\"");
        let err = k1
            .decode::<VolumeSpec>("volumes/default/b", moved.as_bytes(), 2)
            .unwrap_err();
        assert!(
            matches!(
                err,
                StoreError::Malformed {
                    cause: MalformedCause::Sealed(OpenError::Corrupt(_)),
                    ..
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn plain_or_old_key_secrets_are_read_and_flagged_for_rewriting() {
        let v = volume_with_secret("a");
        let legacy = Codec::default().encode(&v).unwrap();
        assert!(String::from_utf8(legacy.clone())
            .unwrap()
            .contains("hunter2"));
        let k1 = Codec::new(Some(keyring("k1")));
        let read = k1
            .decode::<VolumeSpec>("volumes/default/a", &legacy, 2)
            .unwrap();
        assert_eq!(read.spec.secrets, v.spec.secrets);
        assert!(k1.needs_reseal(&read), "plain text is rewritten sealed");
        // Rotation: sealed with old, read by a keyring whose first key is new.
        let old_file = Keyring::generate("old").unwrap();
        let old = Keyring::parse(&old_file).unwrap();
        let sealed_old = Codec::new(Some(old.clone())).encode(&v).unwrap();
        let entries = |file: &str| file.split_once("keys:\n").unwrap().1.to_string();
        let both = format!(
            "{}{}",
            Keyring::generate("new").unwrap(),
            entries(&old_file)
        );
        let rotated = Codec::new(Some(Keyring::parse(&both).unwrap()));
        let read = rotated
            .decode::<VolumeSpec>("volumes/default/a", &sealed_old, 2)
            .unwrap();
        assert_eq!(read.spec.secrets, v.spec.secrets);
        assert!(
            rotated.needs_reseal(&read),
            "sealed with a key that no longer seals"
        );
        let resealed = rotated.encode(&read).unwrap();
        assert!(String::from_utf8(resealed)
            .unwrap()
            .contains("moor:sealed:v1:new:"));
        // A process without the cluster's keys never rewrites.
        let n1 = Codec::new(Some(Keyring::parse(&old.for_node("n1").unwrap()).unwrap()));
        let read = n1
            .decode::<VolumeSpec>("volumes/default/a", &legacy, 2)
            .unwrap();
        assert!(!n1.needs_reseal(&read));
    }
}
