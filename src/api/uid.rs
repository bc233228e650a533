//! `Uid`: an object's uid, held as 16 bytes when it is a UUID in its canonical text.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// An object's uid (`metadata.uid`), and the fields that name one (a Mount's claim, a
/// claim's volume and attachment). The store makes every uid a random UUID; held as
/// its 16 bytes, a uid costs no allocation, where its 36-character text cost 48 bytes
/// of heap in each of the 100,000s of cached objects. Any other text (a value written
/// by hand or by another tool, a test's `u1`) is held as read. Written and compared as
/// its text: a UUID is held as bytes only when its text is the canonical lower-case
/// form, so the text written back is always the text read.
#[derive(Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Uid(Repr);

#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Repr {
    Uuid([u8; 16]),
    Text(Box<str>),
}

impl Default for Repr {
    fn default() -> Self {
        Repr::Text(Box::default())
    }
}

impl Uid {
    /// A new random uid (what the store gives an object it creates).
    pub fn random() -> Uid {
        Uid(Repr::Uuid(*uuid::Uuid::new_v4().as_bytes()))
    }

    /// The uid whose text is `s`.
    pub fn new(s: &str) -> Uid {
        if let Ok(u) = uuid::Uuid::try_parse(s) {
            let mut buf = [0u8; uuid::fmt::Hyphenated::LENGTH];
            if u.hyphenated().encode_lower(&mut buf) == s {
                return Uid(Repr::Uuid(*u.as_bytes()));
            }
        }
        Uid(Repr::Text(s.into()))
    }

    /// Whether it is empty (an object not yet created).
    pub fn is_empty(&self) -> bool {
        matches!(&self.0, Repr::Text(t) if t.is_empty())
    }

    /// Runs `f` on the text without allocating (a UUID's canonical text, on the stack).
    fn with_str<R>(&self, f: impl FnOnce(&str) -> R) -> R {
        match &self.0 {
            Repr::Uuid(b) => {
                let mut buf = [0u8; uuid::fmt::Hyphenated::LENGTH];
                f(uuid::Uuid::from_bytes(*b)
                    .hyphenated()
                    .encode_lower(&mut buf))
            }
            Repr::Text(t) => f(t),
        }
    }
}

impl PartialEq<str> for Uid {
    fn eq(&self, other: &str) -> bool {
        self.with_str(|s| s == other)
    }
}

impl PartialEq<&str> for Uid {
    fn eq(&self, other: &&str) -> bool {
        self.with_str(|s| s == *other)
    }
}

impl PartialEq<String> for Uid {
    fn eq(&self, other: &String) -> bool {
        self.with_str(|s| s == other)
    }
}

impl PartialEq<Uid> for String {
    fn eq(&self, other: &Uid) -> bool {
        other == self
    }
}

impl PartialEq<Uid> for str {
    fn eq(&self, other: &Uid) -> bool {
        other == self
    }
}

impl From<&str> for Uid {
    fn from(s: &str) -> Uid {
        Uid::new(s)
    }
}

impl From<String> for Uid {
    fn from(s: String) -> Uid {
        Uid::new(&s)
    }
}

impl From<&String> for Uid {
    fn from(s: &String) -> Uid {
        Uid::new(s)
    }
}

impl fmt::Display for Uid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.with_str(|s| f.write_str(s))
    }
}

impl fmt::Debug for Uid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.with_str(|s| fmt::Debug::fmt(s, f))
    }
}

impl Serialize for Uid {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.with_str(|t| s.serialize_str(t))
    }
}

impl<'de> Deserialize<'de> for Uid {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Uid;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Uid, E> {
                Ok(Uid::new(v))
            }
        }
        d.deserialize_str(Visitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uid_reads_and_writes_back_its_own_text() {
        let canonical = "7de178bf-cafc-4b50-8e37-a0d8a8819574";
        for text in [
            canonical,
            "7DE178BF-CAFC-4B50-8E37-A0D8A8819574",
            "7de178bfcafc4b508e37a0d8a8819574",
            "{7de178bf-cafc-4b50-8e37-a0d8a8819574}",
            "urn:uuid:7de178bf-cafc-4b50-8e37-a0d8a8819574",
            "u1",
            "",
        ] {
            let uid = Uid::new(text);
            assert_eq!(uid.to_string(), text);
            assert_eq!(uid, text);
            assert_eq!(uid, text.to_string());
            let json = serde_json::to_string(&uid).unwrap();
            assert_eq!(json, serde_json::to_string(text).unwrap());
            let back: Uid = serde_json::from_str(&json).unwrap();
            assert_eq!(back, uid);
            assert_eq!(uid.is_empty(), text.is_empty());
        }
        assert!(
            matches!(Uid::new(canonical).0, Repr::Uuid(_)),
            "held as bytes"
        );
        assert!(matches!(
            Uid::new("7DE178BF-CAFC-4B50-8E37-A0D8A8819574").0,
            Repr::Text(_)
        ));
        assert_ne!(
            Uid::new(canonical),
            Uid::new("7DE178BF-CAFC-4B50-8E37-A0D8A8819574")
        );
        assert_ne!(Uid::new(canonical), "7de178bf-cafc-4b50-8e37-a0d8a8819575");
        let r = Uid::random();
        assert_eq!(Uid::new(&r.to_string()), r);
        assert_eq!(std::mem::size_of::<Uid>(), 24);
    }
}
