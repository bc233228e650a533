//! Event: a record of something a reconciler did or met, for `moorctl events`.
//!
//! Writers: every process, each under its own prefix (`events/controller/...`,
//! `events/node/NODE/...`), so an agent's etcd role writes its own events and cannot
//! touch another writer's. Events are bound to their writer's lease for a time window,
//! so they expire together without one lease per event. They never carry a secret.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use super::*;

/// Normal or Warning.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum EventType {
    /// Progress.
    #[default]
    Normal,
    /// Something needs attention.
    Warning,
}

/// The object an event is about.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectRef {
    /// Its kind.
    pub kind: String,
    /// Its namespace (empty for cluster-wide kinds).
    #[serde(default, skip_serializing_if = "Namespace::is_empty")]
    pub namespace: Namespace,
    /// Its name.
    pub name: Name,
}

/// What happened.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EventSpec {
    /// Short CamelCase reason, e.g. `Mount volume`.
    #[serde(default)]
    pub reason: String,
    /// Human-readable message.
    #[serde(default)]
    pub message: String,
    /// Normal or Warning.
    #[serde(default, rename = "type")]
    pub type_: EventType,
    /// The object it concerns.
    #[serde(default)]
    pub object: ObjectRef,
    /// snake_case details, e.g. `volume_id`, `success`, `error`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub details: BTreeMap<String, String>,
    /// Which component reported it: `controller` or `agent/NODE`; it places the event
    /// under its writer's prefix.
    #[serde(default)]
    pub source: String,
    /// When it happened (the last time, for a series).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time: Option<Timestamp>,
    /// Another object the event is about: the claim a node's Mount event is for.
    /// `moorctl describe` shows an event under its object and its related object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub related: Option<ObjectRef>,
    /// Repeats of the same event (same object, related object, reason, type and
    /// message up to its numbers) folded into this one: how many, and since when.
    /// Absent for an event seen once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub series: Option<EventSeries>,
}

/// How often an event happened, for an event folded from repeats.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventSeries {
    /// Times it happened (at least 2).
    pub count: u32,
    /// When it first happened (`time` is the last).
    pub first_time: Timestamp,
}

impl EventSpec {
    /// Times the event happened: its series' count, else 1.
    pub fn count(&self) -> u32 {
        self.series.as_ref().map_or(1, |s| s.count)
    }

    /// `x6 over 21s` for a series, empty for an event seen once.
    pub fn repeats(&self) -> String {
        match (&self.series, &self.time) {
            (Some(s), Some(last)) => {
                let over = last
                    .system()
                    .duration_since(s.first_time.system())
                    .unwrap_or_default();
                let over = std::time::Duration::from_secs(over.as_secs());
                format!("x{} over {}", s.count, humantime::format_duration(over))
            }
            (Some(s), None) => format!("x{}", s.count),
            _ => String::new(),
        }
    }
}

impl Spec for EventSpec {
    const KIND: &'static str = "Event";
    const DIR: &'static str = "events";
    const NAMESPACED: bool = true;
    const ALIASES: &'static [&'static str] = &["ev"];
    const PHASE: Option<&'static str> = None;
    const CHECKED: bool = true;
    const AGENT: AgentAccess = AgentAccess::OwnWriter;
    const KEY_SEGMENTS: usize = 3;
    const KEY_NAMESPACE_FIRST: bool = false;
    type Status = NoStatus;

    fn key_suffix(&self, meta: &ObjectMeta) -> String {
        format!("{}/{}/{}", self.writer_prefix(), meta.namespace, meta.name)
    }

    fn key_layout(parts: &[&str]) -> bool {
        matches!(parts, [CONTROLLER, _, _] | [NODE, _, _, _])
    }

    fn validate(&self, errors: &mut ValidationErrors) {
        if self.reason.is_empty() {
            errors.push("reason", "is required");
        }
        if self.object.kind.is_empty() {
            errors.push("object.kind", "is required");
        }
        errors.check_id("object.name", self.object.name.validate());
        if let Some(r) = &self.related {
            if r.kind.is_empty() {
                errors.push("related.kind", "is required");
            }
            errors.check_id("related.name", r.name.validate());
        }
        if self.series.as_ref().is_some_and(|s| s.count < 2) {
            errors.push(
                "series.count",
                "is at least 2 (an event seen once has no series)",
            );
        }
        for key in self.details.keys() {
            check_snake_case("details", key, errors);
        }
        let writer_ok = match self.source.strip_prefix("agent/") {
            Some(node) => check_id(node).is_ok(),
            None => self.source == CONTROLLER,
        };
        if !writer_ok {
            errors.push(
                "source",
                format!("is {:?}; expected controller or agent/NODE", self.source),
            );
        }
    }
}

const CONTROLLER: &str = "controller";
const NODE: &str = "node";

impl EventSpec {
    /// The source of the events node `node`'s agent records.
    pub fn agent_source(node: &str) -> String {
        format!("agent/{node}")
    }

    /// The first parts of the keys of its writer's events: `controller` or `node/NODE`.
    fn writer_prefix(&self) -> String {
        match self.source.strip_prefix("agent/") {
            Some(node) => format!("{NODE}/{node}"),
            None => CONTROLLER.to_string(),
        }
    }
}

/// An event object.
pub type Event = Object<EventSpec>;

/// What a reader knows of where objects are: enough to judge whether a node may speak
/// about an object ([`event_shown`], the one rule of every view of events: moorctl's
/// `events` and `describe`, the console's timelines).
pub trait Whereabouts {
    /// Whether the reader knows the object (it exists as far as it can tell); an
    /// object it does not know (deleted) cannot be judged.
    fn known(&self, kind: &str, namespace: &str, name: &str) -> bool;
    /// Whether `node` may speak about the object: it is on that node (a Claim,
    /// Mount, Allocation or Attachment of the node, the Node itself, a Volume claimed
    /// or attached there), the node hosts the controller service of the object's
    /// plugin (its provisioner, attacher and snapshotter act on every volume of that
    /// plugin), or, for a Plugin, the node hosts it.
    fn speaks_about(&self, kind: &str, namespace: &str, name: &str, node: &str) -> bool;
}

/// Whether an event written by `source` that names `objects` (its object and its
/// related object, as kind, namespace and name) is shown: written by the controller
/// (or anyone not a node), or by a node (`agent/NODE`) that every object it names and
/// the reader knows is on. Every object is judged: a node that names its own Node as
/// the related object of its event about another node's volume speaks about that
/// volume all the same. When the event names none the reader knows, it is shown (with
/// its source).
pub fn event_shown<'a>(
    reader: &impl Whereabouts,
    source: &str,
    objects: impl IntoIterator<Item = (&'a str, &'a str, &'a str)>,
) -> bool {
    let Some(node) = source.strip_prefix("agent/") else {
        return true;
    };
    objects
        .into_iter()
        .filter(|(k, ns, n)| reader.known(k, ns, n))
        .all(|(k, ns, n)| reader.speaks_about(k, ns, n, node))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn details_must_be_snake_case() {
        let spec = EventSpec {
            reason: "Mount volume".into(),
            object: ObjectRef {
                kind: "Claim".into(),
                namespace: Namespace::default_ns(),
                name: Name::new("c").unwrap(),
            },
            details: [("volumeId".to_string(), "v".to_string())].into(),
            ..Default::default()
        };
        let e = Event::new(&Namespace::default_ns(), Name::new("e1").unwrap(), spec);
        let err = e.validate().unwrap_err().to_string();
        assert!(err.contains("spec.details.volumeId"), "{err}");
    }

    /// The rule of every view of node events, over a reader that places v1 on n1.
    #[test]
    fn a_node_is_believed_only_about_objects_on_it() {
        struct OnN1;
        impl Whereabouts for OnN1 {
            fn known(&self, _kind: &str, _ns: &str, name: &str) -> bool {
                name != "gone"
            }
            fn speaks_about(&self, _kind: &str, _ns: &str, name: &str, node: &str) -> bool {
                name == "v1" && node == "n1" || name == node
            }
        }
        let v1 = ("Volume", "default", "v1");
        assert!(event_shown(&OnN1, "controller", [v1]));
        assert!(event_shown(&OnN1, "agent/n1", [v1]));
        assert!(!event_shown(&OnN1, "agent/n2", [v1]));
        // Its own Node as the related object does not make another's volume its own.
        assert!(!event_shown(&OnN1, "agent/n2", [v1, ("Node", "", "n2")]));
        // What the reader does not know is not judged.
        assert!(event_shown(
            &OnN1,
            "agent/n2",
            [("Volume", "default", "gone")]
        ));
    }
}
