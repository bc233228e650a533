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
    /// When it happened.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time: Option<Timestamp>,
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
}
