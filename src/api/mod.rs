//! The resource model: one JSON object per etcd key, `{apiVersion, kind, metadata, spec,
//! status}`, one file per kind with its validation beside it.
//!
//! Each part of an object has one writer role (see the kind's docs): spec the user's (or
//! the controller's, for objects the controller derives), each status section one
//! reconciler's. The etcd key of an object is derived from its metadata and spec
//! ([`Spec::key_suffix`]), so an agent can watch only its own node's prefixes.
//!
//! # Layout
//! - `allocation`, `attachment`, `claim`, `event`, `lease`, `mount`, `node`, `plugin`,
//!   `snapshot`, `volume`: one file per kind: its spec, status, key layout and
//!   validation.
//! - `group_snapshot`: the VolumeGroupSnapshot kind (one cut of several volumes).
//! - `quota`: the Quota kind (a namespace's limits, and the charges the controller
//!   records against them), and the gate every step that makes something reads.
//! - `schedule`: the SnapshotSchedule kind (snapshots on a cadence, pruned), its slots
//!   and its retention rule.
//! - `class`: the VolumeClass kind and how a class fills a volume or a template
//!   (`resolve`), the one function every front door that makes volumes calls.
//! - `cordon`: the Cordon kind (a node that takes no new claim) and a volume's
//!   availability.
//! - `kinds`: the registry of kinds (`for_each_kind!`, `Kind`, `with_spec!`).
//! - `key`: typed object keys and key scopes, built only here.
//! - `ids`: the id newtypes, interned process-wide.
//! - `uid`: object uids, held as a UUID's 16 bytes.
//! - `modes`: access and attachment modes, and the claim rules that follow from them.
//! - `mounting`: mount options, redacted mount flags, what a node observes of a volume.
//! - `template`: volumes made for the workload (an allocation's request templates).
//! - `topology`: where a volume is accessible from, and where one must be created.
//! - `secrets`: secrets passed to plugins, redacted and possibly sealed.
//! - `secret`: the Secret kind (secrets stored once, keyed by plugin) and the
//!   references per RPC family that volumes, classes and snapshots make to it.
//! - `ownership`: the Ownership kind: which volume owns each plugin volume, written
//!   only by the plugin's leader (issue 77).
//! - `report`: reports, what the plugin's leader observed of an object others write
//!   (an attachment, a volume), which the controller copies into it (issue 77).
//! - `status`: what every status shares (conditions, observed generation, last error,
//!   retry).
//! - `quantity`: sizes with units, and timestamps.
//! - `strmap`, `rare`: the compact containers decoded objects use.
//! - `unknown`: the fields a stored object holds that this version does not know, kept
//!   and written back.
//! - `manifest`, `yaml_depth`: manifests parsed strictly, their nesting bounded in
//!   libyaml itself.
//! - `validation`: every problem of an object, each at its field path.

mod allocation;
mod attachment;
mod claim;
mod class;
mod cordon;
mod event;
mod group_snapshot;
mod ids;
mod key;
mod kinds;
mod lease;
mod manifest;
mod modes;
mod mount;
mod mounting;
mod node;
mod ownership;
mod plugin;
mod quantity;
mod quota;
mod rare;
mod report;
mod schedule;
mod secret;
mod secrets;
mod snapshot;
mod status;
mod strmap;
mod template;
mod topology;
mod uid;
mod unknown;
mod validation;
mod volume;
mod yaml_depth;

pub use allocation::*;
pub use attachment::*;
pub use claim::*;
pub use class::*;
pub use cordon::*;
pub use event::*;
pub use group_snapshot::*;
pub use ids::*;
pub use key::*;
pub use kinds::*;
pub use lease::*;
pub use manifest::*;
pub use modes::*;
pub use mount::*;
pub use mounting::*;
pub use node::*;
pub use ownership::*;
pub use plugin::*;
pub use quantity::*;
pub use quota::*;
pub use rare::*;
pub use report::*;
pub use schedule::*;
pub use secret::*;
pub use secrets::*;
pub use snapshot::*;
pub use status::*;
pub use strmap::*;
pub use template::*;
pub use topology::*;
pub use uid::Uid;
pub use unknown::{Step as UnknownStep, UnknownFields};
pub use validation::*;
pub use volume::*;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Debug;

/// The `apiVersion` of every moor object.
pub const API_VERSION: &str = "moor/v1";

/// What makes a type the spec of a kind: its names, its key layout, its status type and
/// its validation.
pub trait Spec:
    Serialize + DeserializeOwned + Clone + PartialEq + Debug + Send + Sync + 'static
{
    /// The kind's name, e.g. `Volume`.
    const KIND: &'static str;
    /// The kind's directory under the key prefix, e.g. `volumes`.
    const DIR: &'static str;
    /// Whether objects of the kind live in a namespace.
    const NAMESPACED: bool;
    /// Other names the tools accept for the kind (besides its name and `DIR`).
    const ALIASES: &'static [&'static str];
    /// Where the kind's phase is in the JSON of an object (`moorctl wait`), if any.
    const PHASE: Option<&'static str>;
    /// Whether `moord check` audits the kind.
    const CHECKED: bool;
    /// What a node agent's etcd role may do with the kind (`moord roles`).
    const AGENT: AgentAccess;
    /// How many ids follow `DIR/` in the kind's keys (see [`Spec::key_suffix`]).
    const KEY_SEGMENTS: usize = if Self::NAMESPACED { 2 } else { 1 };
    /// Whether the first id of the kind's keys is the namespace (a namespace is then
    /// one key range; a node's claims and mounts are keyed by node first).
    const KEY_NAMESPACE_FIRST: bool = Self::NAMESPACED;
    /// The kind's status.
    type Status: Serialize
        + DeserializeOwned
        + Clone
        + Default
        + PartialEq
        + Debug
        + Send
        + Sync
        + 'static;

    /// The object's key below `<prefix><DIR>/`, e.g. `default/db-data`: the kind's key
    /// layout, with [`Spec::KEY_SEGMENTS`] parts and the kind's constructor of
    /// [`ObjectKey`]s beside it.
    fn key_suffix(&self, meta: &ObjectMeta) -> String {
        if Self::NAMESPACED {
            format!("{}/{}", meta.namespace, meta.name)
        } else {
            meta.name.to_string()
        }
    }

    /// Whether the ids after `DIR/` of a key (`parts`, each already an id) are the
    /// kind's layout: [`Spec::KEY_SEGMENTS`] of them unless the kind says otherwise.
    fn key_layout(parts: &[&str]) -> bool {
        parts.len() == Self::KEY_SEGMENTS
    }

    /// The largest stored value of the kind a reader decodes; a larger one is
    /// malformed, refused before it is parsed. The kinds a node agent writes are
    /// untrusted input and get [`NODE_WRITTEN_MAX_BYTES`]; etcd bounds the others.
    const MAX_BYTES: usize = if matches!(Self::AGENT, AgentAccess::OwnNode | AgentAccess::OwnWriter)
    {
        NODE_WRITTEN_MAX_BYTES
    } else {
        usize::MAX
    };

    /// The longest name an object of the kind may have, below the id rule's 128 bytes
    /// where the name is copied into a label value (63 bytes at most).
    const MAX_NAME: usize = 128;

    /// Why a delete of an object with this spec is refused, from every front door
    /// ([`crate::store::Store::delete`] answers [`crate::store::StoreError::Protected`]);
    /// none by default (a Volume's `deletion_protection`).
    fn deletion_refused(&self) -> Option<&'static str> {
        None
    }

    /// Records every problem of the spec; field paths are relative to `spec.`.
    fn validate(&self, errors: &mut ValidationErrors);

    /// What a stored object must hold beyond what a manifest must (a manifest's volume
    /// may leave its plugin to a class; a stored one has it): field paths relative to
    /// `spec.`. Nothing more by default.
    fn check_stored(&self, _errors: &mut ValidationErrors) {}

    /// An update's spec `self`, written over the stored `stored`: what the writer
    /// leaves out that the stored object keeps (a class-made volume keeps what its
    /// class filled). Nothing by default.
    fn keep_on_update(&mut self, _stored: &Self) {}

    /// Records every problem of a status; field paths are relative to `status.`. Only
    /// kinds whose status a node writes check theirs (what a node writes is untrusted).
    fn validate_status(_status: &Self::Status, _errors: &mut ValidationErrors) {}

    /// The secrets the kind stores, which the store seals at rest when it holds a key
    /// (see [`crate::store::Keyring`]); none by default.
    fn secret_fields(&mut self) -> Vec<SecretField<'_>> {
        Vec::new()
    }
}

/// One field of secrets of a spec, for sealing at rest.
pub struct SecretField<'a> {
    /// The field's name, e.g. `secrets`; bound into the ciphertext with the object's
    /// key, so sealed text copied elsewhere does not open.
    pub field: &'static str,
    /// The node whose agent opens it (a claim's node secrets), sealed with that node's
    /// key; `None` for secrets only key holders open.
    pub node: Option<&'a str>,
    /// The secrets.
    pub secrets: &'a mut Secrets,
}

/// Metadata common to every object.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectMeta {
    /// The object's name (the id rule applies).
    #[serde(default)]
    pub name: Name,
    /// The namespace; empty for cluster-wide kinds, `default` when a manifest omits it.
    #[serde(default, skip_serializing_if = "Namespace::is_empty")]
    pub namespace: Namespace,
    /// Set by the store at creation; never reused.
    #[serde(default, skip_serializing_if = "Uid::is_empty")]
    pub uid: Uid,
    /// The etcd `mod_revision` the object was read at; not stored in the value.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub resource_version: i64,
    /// Bumped by the store on every spec change; 1 at creation.
    #[serde(default)]
    pub generation: i64,
    /// When the store created the object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_timestamp: Option<Timestamp>,
    /// Labels for selection.
    #[serde(default, skip_serializing_if = "Rare::is_empty")]
    pub labels: Rare<BTreeMap<String, String>>,
    /// Finalizers hold a deletion until their owners remove them.
    #[serde(
        default,
        deserialize_with = "crate::api::tight_vec",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub finalizers: Vec<Term>,
    /// Set when deletion was requested while finalizers remained.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deletion_timestamp: Option<Timestamp>,
    /// The W3C `traceparent` of the trace this object's work belongs to (a claim's,
    /// carried on to its Attachment and Mount; see `moor::telemetry`). Absent when the
    /// controller exports no traces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<Box<str>>,
}

/// Deserializes a list into a vector of exactly its length. Decoding grows a vector as
/// it reads (a list of one gets room for four), and cached objects live long: a
/// status's conditions, a volume's claims and an allocation's requests are mostly one
/// or two entries, held for every object of a 100,000-object cache.
pub(crate) fn tight_vec<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    let mut v = Vec::<T>::deserialize(d)?;
    v.shrink_to_fit();
    Ok(v)
}

pub(crate) fn is_zero(n: &i64) -> bool {
    *n == 0
}

/// `apiVersion` or `kind` as read. Every cached object carries both, and validation
/// accepts only the one value each position may hold (`moor/v1`, the kind's name), so
/// that value is not held at all: `Word::Expected` costs 8 bytes and no allocation. A
/// manifest's other text is kept for validation to report; an empty `kind` is filled
/// in by `apply_defaults`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Word {
    /// The value this position must hold.
    #[default]
    Expected,
    /// Anything else, as read.
    Other(Box<String>),
}

impl Word {
    /// The text, `expected` standing for [`Word::Expected`].
    pub fn as_str<'a>(&'a self, expected: &'a str) -> &'a str {
        match self {
            Word::Expected => expected,
            Word::Other(s) => s,
        }
    }

    /// Whether it was read empty (a manifest left it out).
    fn is_empty(&self) -> bool {
        matches!(self, Word::Other(s) if s.is_empty())
    }
}

/// Reads `apiVersion`: [`API_VERSION`] as [`Word::Expected`].
fn api_version_word<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Word, D::Error> {
    read_word(d, API_VERSION)
}

/// Reads a kind's name: `S::KIND` as [`Word::Expected`].
struct KindWord<S>(std::marker::PhantomData<S>);

impl<S: Spec> KindWord<S> {
    fn read<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Word, D::Error> {
        read_word(d, S::KIND)
    }

    fn write<Z: serde::Serializer>(w: &Word, s: Z) -> Result<Z::Ok, Z::Error> {
        s.serialize_str(w.as_str(S::KIND))
    }
}

fn write_api_version<Z: serde::Serializer>(w: &Word, s: Z) -> Result<Z::Ok, Z::Error> {
    s.serialize_str(w.as_str(API_VERSION))
}

fn read_word<'de, D: serde::Deserializer<'de>>(d: D, expected: &str) -> Result<Word, D::Error> {
    struct Visitor<'a>(&'a str);
    impl serde::de::Visitor<'_> for Visitor<'_> {
        type Value = Word;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a string")
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Word, E> {
            Ok(if v == self.0 {
                Word::Expected
            } else {
                Word::Other(Box::new(v.to_string()))
            })
        }
    }
    d.deserialize_str(Visitor(expected))
}

/// An absent `kind`: read as empty, so that `apply_defaults` fills it in.
fn absent_kind() -> Word {
    Word::Other(Box::default())
}

/// A resource: `{apiVersion, kind, metadata, spec, status}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(bound = "")]
pub struct Object<S: Spec> {
    /// Always `moor/v1`.
    #[serde(
        rename = "apiVersion",
        default,
        deserialize_with = "api_version_word",
        serialize_with = "write_api_version"
    )]
    pub api_version: Word,
    /// The kind's name; filled in when empty.
    #[serde(
        default = "absent_kind",
        deserialize_with = "KindWord::<S>::read",
        serialize_with = "KindWord::<S>::write"
    )]
    pub kind: Word,
    /// Identity and bookkeeping.
    pub metadata: ObjectMeta,
    /// Desired state.
    pub spec: S,
    /// Observed state.
    #[serde(default)]
    pub status: S::Status,
    /// What the stored value held that this version does not know (a newer version's
    /// fields), written back with the object (`api::unknown`).
    #[serde(skip)]
    pub unknown: UnknownFields,
}

impl<S: Spec> Object<S> {
    /// A new object with an empty status; `namespace` is ignored for cluster-wide kinds.
    pub fn new(namespace: &Namespace, name: Name, spec: S) -> Self {
        let mut obj = Object {
            api_version: Word::Expected,
            kind: Word::Expected,
            metadata: ObjectMeta {
                name,
                namespace: namespace.clone(),
                ..ObjectMeta::default()
            },
            spec,
            status: S::Status::default(),
            unknown: UnknownFields::default(),
        };
        obj.apply_defaults();
        obj
    }

    /// Fills what a manifest may leave out: kind, apiVersion, the `default` namespace.
    pub fn apply_defaults(&mut self) {
        if self.kind.is_empty() {
            self.kind = Word::Expected;
        }
        if self.api_version.is_empty() {
            self.api_version = Word::Expected;
        }
        if S::NAMESPACED && self.metadata.namespace.is_empty() {
            self.metadata.namespace = Namespace::default_ns();
        }
        if !S::NAMESPACED {
            self.metadata.namespace = Namespace::default();
        }
    }

    /// The object's key below the store prefix, e.g. `volumes/default/db-data`.
    pub fn key(&self) -> String {
        ObjectKey::of(self).into_string()
    }

    /// The object's typed key.
    pub fn object_key(&self) -> ObjectKey<S> {
        ObjectKey::of(self)
    }

    /// Checks the whole object and reports every problem at once.
    pub fn validate(&self) -> Result<(), ValidationErrors> {
        let mut errors = ValidationErrors::default();
        if let Word::Other(v) = &self.api_version {
            errors.push("apiVersion", format!("is {v:?}; expected {API_VERSION:?}"));
        }
        if let Word::Other(v) = &self.kind {
            if !v.is_empty() {
                errors.push("kind", format!("is {v:?}; expected {:?}", S::KIND));
            }
        }
        errors.check_id("metadata.name", self.metadata.name.validate());
        if self.metadata.name.as_str().len() > S::MAX_NAME {
            errors.push(
                "metadata.name",
                format!(
                    "{} bytes; a {} name is at most {} (its objects carry it in a label)",
                    self.metadata.name.as_str().len(),
                    S::KIND,
                    S::MAX_NAME
                ),
            );
        }
        check_labels(&self.metadata.labels, &mut errors);
        // A W3C traceparent is 55 characters; its form is checked where it is read.
        if self.metadata.trace.as_ref().is_some_and(|t| t.len() > 128) {
            errors.push("metadata.trace", "is longer than 128 characters");
        }
        if S::NAMESPACED {
            errors.check_id("metadata.namespace", self.metadata.namespace.validate());
        } else if !self.metadata.namespace.is_empty() {
            errors.push(
                "metadata.namespace",
                format!("{} objects have no namespace", S::KIND),
            );
        }
        let mut spec_errors = ValidationErrors::default();
        self.spec.validate(&mut spec_errors);
        for e in spec_errors.0 {
            errors.push(format!("spec.{}", e.field), e.message);
        }
        let mut status_errors = ValidationErrors::default();
        S::validate_status(&self.status, &mut status_errors);
        for e in status_errors.0 {
            errors.push(format!("status.{}", e.field), e.message);
        }
        errors.into_result()
    }

    /// [`Object::validate`], and what a stored object must hold beyond a manifest
    /// ([`Spec::check_stored`]): what the store refuses to write and readers skip.
    pub fn validate_stored(&self) -> Result<(), ValidationErrors> {
        let mut errors = match self.validate() {
            Ok(()) => ValidationErrors::default(),
            Err(e) => e,
        };
        let mut stored = ValidationErrors::default();
        self.spec.check_stored(&mut stored);
        for e in stored.0 {
            errors.push(format!("spec.{}", e.field), e.message);
        }
        errors.into_result()
    }

    /// Whether deletion was requested (it waits on finalizers).
    pub fn is_deleting(&self) -> bool {
        self.metadata.deletion_timestamp.is_some()
    }
}

/// The largest value of a kind a node agent writes (Node, Mount, Event): a node's
/// whole status is a few KiB.
pub const NODE_WRITTEN_MAX_BYTES: usize = 64 << 10;

/// The most labels an object may carry.
pub const MAX_LABELS: usize = 64;

/// Labels as Kubernetes shapes them: a key of up to 253 bytes of `[A-Za-z0-9._/-]`
/// (an optional DNS prefix and `/`, then a name) and a value of up to 63 bytes of
/// `[A-Za-z0-9._-]`; at most [`MAX_LABELS`].
fn check_labels(labels: &BTreeMap<String, String>, errors: &mut ValidationErrors) {
    check_label_map("metadata.labels", labels, errors)
}

/// [`check_labels`]' rule for any map shaped as labels (a selector), at `field`.
pub(crate) fn check_label_map(
    field: &str,
    labels: &BTreeMap<String, String>,
    errors: &mut ValidationErrors,
) {
    if labels.len() > MAX_LABELS {
        errors.push(
            field,
            format!("{} labels; at most {MAX_LABELS}", labels.len()),
        );
        return;
    }
    let charset = |s: &str, extra: &[char]| {
        s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c) || extra.contains(&c))
    };
    for (k, v) in labels {
        let field = || {
            let shown: String = k.chars().take(64).collect();
            format!("{field}.{}", printable(&shown))
        };
        if k.is_empty() || k.len() > 253 || !charset(k, &['/']) {
            errors.push(
                field(),
                "a label key is 1 to 253 bytes of letters, digits, '.', '_', '-' and '/'",
            );
        } else if v.len() > 63 || !charset(v, &[]) {
            errors.push(
                field(),
                "a label value is up to 63 bytes of letters, digits, '.', '_' and '-'",
            );
        }
    }
}

/// A status for kinds that have none of their own.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NoStatus {}

/// Checks that map keys are snake_case identifiers (event details, labels' keys use this).
pub(crate) fn check_snake_case(field: &str, key: &str, errors: &mut ValidationErrors) {
    let ok = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !ok {
        errors.push(format!("{field}.{key}"), "keys must be snake_case");
    }
}
