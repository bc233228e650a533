//! Secrets at rest: the keyring that seals (encrypts) the secrets fields of stored
//! objects, and opens them again. Kubernetes' EncryptionConfiguration is the model.
//!
//! - A key file lists keys by id; the first seals, every one opens, so a key is
//!   rotated without downtime: add the new key second everywhere, then move it first
//!   (new writes use it and the controller rewrites everything sealed with another
//!   key or stored in plain text), then drop the old one.
//! - Each sealed value is AES-256-GCM over the JSON of the secrets map, with a random
//!   96-bit nonce, and the object's key and field name as associated data (a sealed
//!   value copied to another object or field does not open). It is stored as
//!   `moor:sealed:v1:KEY_ID:BASE64(nonce | ciphertext | tag)`.
//! - A claim's node secrets are sealed with that node's key, derived from the cluster
//!   key by HKDF-SHA256 with the node's name. A node agent is given only its node's
//!   derived keys (`moord keys node`): it opens its own claims' secrets, not a
//!   volume's, not another node's.

use std::collections::BTreeMap;
use std::path::Path;

use base64::Engine;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::hkdf;
use ring::rand::{SecureRandom, SystemRandom};
use serde::{Deserialize, Serialize};

use crate::api::{sealed_key_id, SEALED_PREFIX};

const KEY_LEN: usize = 32;
const NODE_SALT: &[u8] = b"moor/v1 node secrets key";

/// The encryption keys of one process: the cluster's keys (the controller, agents that
/// host a controller plugin, operators' moorctl), or one node's derived keys.
#[derive(Clone)]
pub struct Keyring {
    node: Option<String>,
    keys: Vec<Key>,
}

#[derive(Clone)]
struct Key {
    id: String,
    bytes: [u8; KEY_LEN],
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ids: Vec<&str> = self.keys.iter().map(|k| k.id.as_str()).collect();
        f.debug_struct("Keyring")
            .field("node", &self.node)
            .field("key_ids", &ids)
            .finish()
    }
}

/// The key file, as YAML.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyFile {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    node: Option<String>,
    keys: Vec<KeyEntry>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyEntry {
    id: String,
    secret: String,
}

/// A key file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum KeyringError {
    /// Not the file's shape.
    #[error("not a moor key file: {0}")]
    Format(String),
    /// A key that is not a key.
    #[error("key {id:?}: {reason}")]
    Key {
        /// The key's id.
        id: String,
        /// What is wrong.
        reason: String,
    },
}

/// Why sealed secrets did not open.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    /// Sealed with a key this keyring does not hold (or another node's key): kept
    /// sealed, not an error of the value.
    #[error("sealed with key {0:?}, which this process does not hold")]
    NotHeld(String),
    /// The key is held but the value does not open: altered, truncated, or moved from
    /// another object.
    #[error("sealed secrets do not open with key {0:?}: altered, or moved from another object")]
    Corrupt(String),
}

/// Why secrets could not be sealed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot seal {what}: this process holds only node {node:?}'s keys")]
pub struct SealError {
    what: String,
    node: String,
}

impl Keyring {
    /// Reads a key file.
    /// Refused when group or others may read or write it, as ssh refuses such a private
    /// key: whoever reads it opens every secret.
    pub fn load(path: &Path) -> anyhow::Result<Keyring> {
        use anyhow::Context;
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(path)
            .with_context(|| format!("reading the key file {}", path.display()))?
            .permissions()
            .mode();
        if mode & 0o077 != 0 {
            anyhow::bail!(
                "the key file {} may be read or written by group or others (mode {:04o}); \
                 it holds the keys to every secret: `chmod 600 {}`",
                path.display(),
                mode & 0o7777,
                path.display()
            );
        }
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the key file {}", path.display()))?;
        Keyring::parse(&text).with_context(|| format!("in the key file {}", path.display()))
    }

    /// Parses a key file's text.
    pub fn parse(text: &str) -> Result<Keyring, KeyringError> {
        let file: KeyFile =
            serde_yaml_ng::from_str(text).map_err(|e| KeyringError::Format(e.to_string()))?;
        if file.keys.is_empty() {
            return Err(KeyringError::Format("it lists no keys".into()));
        }
        let mut keys: Vec<Key> = Vec::new();
        for entry in file.keys {
            let bad = |reason: String| KeyringError::Key {
                id: entry.id.clone(),
                reason,
            };
            check_key_id(&entry.id).map_err(bad)?;
            if keys.iter().any(|k| k.id == entry.id) {
                return Err(bad("is listed twice".into()));
            }
            let raw = base64::engine::general_purpose::STANDARD
                .decode(entry.secret.trim())
                .map_err(|e| bad(format!("secret is not base64: {e}")))?;
            let bytes: [u8; KEY_LEN] = raw.try_into().map_err(|raw: Vec<u8>| {
                bad(format!(
                    "secret is {} bytes; a key is {KEY_LEN} (make one with `moord keys new`)",
                    raw.len()
                ))
            })?;
            keys.push(Key {
                id: entry.id,
                bytes,
            });
        }
        Ok(Keyring {
            node: file.node,
            keys,
        })
    }

    /// A new key file with one random key named `id`.
    pub fn generate(id: &str) -> anyhow::Result<String> {
        check_key_id(id).map_err(anyhow::Error::msg)?;
        let mut bytes = [0u8; KEY_LEN];
        SystemRandom::new()
            .fill(&mut bytes)
            .map_err(|_| anyhow::anyhow!("the system's random source failed"))?;
        let ring = Keyring {
            node: None,
            keys: vec![Key {
                id: id.to_string(),
                bytes,
            }],
        };
        Ok(ring.file_text())
    }

    /// The key file of node `node`: its derived keys, one per cluster key, same ids.
    pub fn for_node(&self, node: &str) -> anyhow::Result<String> {
        if let Some(own) = &self.node {
            anyhow::bail!(
                "this key file is node {own:?}'s; node keys derive from the cluster's key file"
            );
        }
        let keys = self
            .keys
            .iter()
            .map(|k| Key {
                id: k.id.clone(),
                bytes: derive(&k.bytes, node),
            })
            .collect();
        Ok(Keyring {
            node: Some(node.to_string()),
            keys,
        }
        .file_text())
    }

    fn file_text(&self) -> String {
        let file = KeyFile {
            node: self.node.clone(),
            keys: self
                .keys
                .iter()
                .map(|k| KeyEntry {
                    id: k.id.clone(),
                    secret: base64::engine::general_purpose::STANDARD.encode(k.bytes),
                })
                .collect(),
        };
        let body = serde_yaml_ng::to_string(&file).unwrap_or_default();
        let whose = match &self.node {
            Some(n) => format!("node {n}'s keys: they open the secrets of its claims only"),
            None => "the cluster's keys: they open every secret".to_string(),
        };
        format!(
            "# moor secrets encryption keys ({whose}). Keep this file private (mode 0600).\n\
             # The first key seals; every key opens.\n{body}"
        )
    }

    /// The node whose keys these are, for a node's keyring.
    pub fn node(&self) -> Option<&str> {
        self.node.as_deref()
    }

    /// The ids of every key, in the file's order.
    pub fn ids(&self) -> Vec<String> {
        self.keys.iter().map(|k| k.id.clone()).collect()
    }

    /// The id of the key that seals (the first of the file).
    pub fn primary_id(&self) -> &str {
        &self.keys[0].id
    }

    /// Whether this keyring seals and opens secrets for `node` (`None`: cluster secrets).
    pub fn serves(&self, node: Option<&str>) -> bool {
        match (&self.node, node) {
            (None, _) => true,
            (Some(own), Some(n)) => own == n,
            (Some(_), None) => false,
        }
    }

    fn key(&self, key: &Key, node: Option<&str>) -> LessSafeKey {
        let bytes = match (&self.node, node) {
            (None, Some(n)) => derive(&key.bytes, n),
            _ => key.bytes,
        };
        // A 32-byte key is always a valid AES-256 key.
        LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &bytes).expect("32-byte AES-256 key"))
    }

    /// Seals `plain` for `node` (`None`: cluster secrets), bound to `aad`.
    pub fn seal(&self, node: Option<&str>, aad: &str, plain: &[u8]) -> Result<String, SealError> {
        if !self.serves(node) {
            return Err(SealError {
                what: match node {
                    Some(n) => format!("node {n}'s secrets"),
                    None => "cluster secrets".into(),
                },
                node: self.node.clone().unwrap_or_default(),
            });
        }
        let primary = &self.keys[0];
        let mut nonce = [0u8; NONCE_LEN];
        // The system's random source does not fail on Linux once booted; a zero nonce
        // would be reused, so refuse rather than seal with it.
        SystemRandom::new()
            .fill(&mut nonce)
            .map_err(|_| SealError {
                what: "secrets (the system's random source failed)".into(),
                node: self.node.clone().unwrap_or_default(),
            })?;
        let mut buf = plain.to_vec();
        self.key(primary, node)
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad.as_bytes()),
                &mut buf,
            )
            .map_err(|_| SealError {
                what: "secrets (too large)".into(),
                node: self.node.clone().unwrap_or_default(),
            })?;
        let mut data = nonce.to_vec();
        data.extend_from_slice(&buf);
        Ok(format!(
            "{SEALED_PREFIX}{}:{}",
            primary.id,
            base64::engine::general_purpose::STANDARD.encode(data)
        ))
    }

    /// Opens sealed `text` for `node`, bound to `aad`: the plain bytes and the id of
    /// the key that opened them.
    pub fn open(
        &self,
        node: Option<&str>,
        aad: &str,
        text: &str,
    ) -> Result<(Vec<u8>, String), OpenError> {
        let id = sealed_key_id(text).unwrap_or_default().to_string();
        let Some(key) = self.keys.iter().find(|k| k.id == id) else {
            return Err(OpenError::NotHeld(id));
        };
        if !self.serves(node) {
            return Err(OpenError::NotHeld(id));
        }
        let data = text
            .strip_prefix(SEALED_PREFIX)
            .and_then(|rest| rest.split_once(':'))
            .and_then(|(_, data)| base64::engine::general_purpose::STANDARD.decode(data).ok())
            .filter(|d| d.len() > NONCE_LEN)
            .ok_or_else(|| OpenError::Corrupt(id.clone()))?;
        let (nonce, sealed) = data.split_at(NONCE_LEN);
        let nonce: [u8; NONCE_LEN] = nonce
            .try_into()
            .map_err(|_| OpenError::Corrupt(id.clone()))?;
        let mut buf = sealed.to_vec();
        let plain = self
            .key(key, node)
            .open_in_place(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad.as_bytes()),
                &mut buf,
            )
            .map_err(|_| OpenError::Corrupt(id.clone()))?;
        Ok((plain.to_vec(), id))
    }

    /// Seals a map of secrets (see [`Keyring::seal`]).
    pub fn seal_map(
        &self,
        node: Option<&str>,
        aad: &str,
        map: &BTreeMap<String, String>,
    ) -> Result<String, SealError> {
        // A map of strings always serialises.
        let plain = serde_json::to_vec(map).unwrap_or_default();
        self.seal(node, aad, &plain)
    }

    /// Opens a sealed map of secrets (see [`Keyring::open`]).
    pub fn open_map(
        &self,
        node: Option<&str>,
        aad: &str,
        text: &str,
    ) -> Result<(BTreeMap<String, String>, String), OpenError> {
        let (plain, id) = self.open(node, aad, text)?;
        let map = serde_json::from_slice(&plain).map_err(|_| OpenError::Corrupt(id.clone()))?;
        Ok((map, id))
    }
}

/// A key id: 1 to 32 lowercase letters, digits and dashes.
fn check_key_id(id: &str) -> Result<(), String> {
    let ok = !id.is_empty()
        && id.len() <= 32
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{id:?} is not a key id (1 to 32 lowercase letters, digits and dashes)"
        ))
    }
}

/// Node `node`'s key derived from a cluster key.
fn derive(cluster: &[u8; KEY_LEN], node: &str) -> [u8; KEY_LEN] {
    struct Len;
    impl hkdf::KeyType for Len {
        fn len(&self) -> usize {
            KEY_LEN
        }
    }
    let mut out = [0u8; KEY_LEN];
    let info = [node.as_bytes()];
    // HKDF-SHA256 expands to 32 bytes (far below its 8160-byte limit): cannot fail.
    hkdf::Salt::new(hkdf::HKDF_SHA256, NODE_SALT)
        .extract(cluster)
        .expand(&info, Len)
        .and_then(|okm| okm.fill(&mut out))
        .expect("HKDF-SHA256 expands to 32 bytes");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(text: &str) -> Keyring {
        Keyring::parse(text).unwrap()
    }

    fn secrets() -> BTreeMap<String, String> {
        [("token".to_string(), "hunter2".to_string())].into()
    }

    #[test]
    fn a_key_file_readable_by_group_or_others_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cluster.keys");
        let text = Keyring::generate("k1").unwrap();
        std::fs::write(&path, &text).unwrap();
        for mode in [0o644, 0o640, 0o604, 0o620] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = format!("{:#}", Keyring::load(&path).unwrap_err());
            assert!(
                e.contains("chmod 600") && e.contains(&format!("{mode:04o}")),
                "{e}"
            );
        }
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(Keyring::load(&path).is_ok());
    }

    #[test]
    fn sealed_secrets_open_only_with_the_key_and_where_they_were_sealed() {
        let k1 = ring(&Keyring::generate("k1").unwrap());
        let sealed = k1
            .seal_map(None, "volumes/default/a#secrets", &secrets())
            .unwrap();
        assert!(sealed.starts_with("moor:sealed:v1:k1:"), "{sealed}");
        assert!(!sealed.contains("hunter2"));
        let (map, id) = k1
            .open_map(None, "volumes/default/a#secrets", &sealed)
            .unwrap();
        assert_eq!((map, id.as_str()), (secrets(), "k1"));
        // Moved to another object: does not open.
        assert_eq!(
            k1.open_map(None, "volumes/default/b#secrets", &sealed),
            Err(OpenError::Corrupt("k1".into()))
        );
        // Another key file with the same id: does not open.
        let other = ring(&Keyring::generate("k1").unwrap());
        assert!(matches!(
            other.open_map(None, "volumes/default/a#secrets", &sealed),
            Err(OpenError::Corrupt(_))
        ));
        // A key this keyring does not list.
        let k2 = ring(&Keyring::generate("k2").unwrap());
        assert_eq!(
            k2.open_map(None, "volumes/default/a#secrets", &sealed),
            Err(OpenError::NotHeld("k1".into()))
        );
        // One flipped character.
        let mut bytes = sealed.into_bytes();
        let last = bytes.len() - 3;
        bytes[last] = if bytes[last] == b'A' { b'B' } else { b'A' };
        let tampered = String::from_utf8(bytes).unwrap();
        assert!(k1
            .open_map(None, "volumes/default/a#secrets", &tampered)
            .is_err());
    }

    #[test]
    fn a_node_s_keys_open_its_own_claims_only() {
        let cluster = ring(&Keyring::generate("k1").unwrap());
        let n1 = ring(&cluster.for_node("n1").unwrap());
        let aad = "claims/n1/default/c#node_secrets";
        let sealed = cluster.seal_map(Some("n1"), aad, &secrets()).unwrap();
        assert_eq!(n1.open_map(Some("n1"), aad, &sealed).unwrap().0, secrets());
        // n1's keys do not open cluster secrets, nor seal them, nor n2's.
        let vol = cluster
            .seal_map(None, "volumes/default/a#secrets", &secrets())
            .unwrap();
        assert!(matches!(
            n1.open_map(None, "volumes/default/a#secrets", &vol),
            Err(OpenError::NotHeld(_))
        ));
        assert!(n1.seal_map(None, "x", &secrets()).is_err());
        let for_n2 = cluster
            .seal_map(Some("n2"), "claims/n2/default/c#node_secrets", &secrets())
            .unwrap();
        assert!(n1
            .open_map(Some("n2"), "claims/n2/default/c#node_secrets", &for_n2)
            .is_err());
        // A node key file cannot derive other nodes' keys.
        assert!(n1.for_node("n2").is_err());
    }

    #[test]
    fn the_first_key_seals_and_every_key_opens() {
        let old = ring(&Keyring::generate("old").unwrap());
        let new = ring(&Keyring::generate("new").unwrap());
        let both = format!(
            "keys:\n- id: new\n  secret: {}\n- id: old\n  secret: {}\n",
            base64::engine::general_purpose::STANDARD.encode(new.keys[0].bytes),
            base64::engine::general_purpose::STANDARD.encode(old.keys[0].bytes)
        );
        let both = ring(&both);
        let sealed_old = old.seal_map(None, "a", &secrets()).unwrap();
        assert_eq!(both.open_map(None, "a", &sealed_old).unwrap().1, "old");
        assert!(both
            .seal_map(None, "a", &secrets())
            .unwrap()
            .starts_with("moor:sealed:v1:new:"));
        assert_eq!(both.primary_id(), "new");
    }

    #[test]
    fn bad_key_files_are_refused_with_the_reason() {
        for (text, expect) in [
            ("keys: []", "lists no keys"),
            ("keys:\n- id: k1\n  secret: c2hvcnQ=\n", "5 bytes"),
            ("keys:\n- id: K1\n  secret: c2hvcnQ=\n", "not a key id"),
            ("keys:\n- id: k1\n  secret: '***'\n", "not base64"),
            ("nope: 1", "not a moor key file"),
        ] {
            let err = Keyring::parse(text).unwrap_err().to_string();
            assert!(err.contains(expect), "{text}: {err}");
        }
    }
}
