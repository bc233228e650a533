//! Event: a record of something a reconciler did or met, for `moorctl events`.
//!
//! Writer: anyone. Events are bound to a lease shared by a time window, so they expire
//! together without one lease per event. They never carry a secret.

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
    /// Which component reported it, e.g. `agent/n1`.
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
    const AGENT: AgentAccess = AgentAccess::Write;
    type Status = NoStatus;

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
