//! Cordon: an operator's mark that a node takes no new claim (`moorctl node cordon`),
//! kept apart from the Node, which its agent re-creates at each registration and which
//! goes with its lease: a cordon outlives the agent's downtime, which is what
//! maintenance is.
//!
//! Writer: the operator (moorctl `node cordon`, `drain` and `uncordon`). Reader: the
//! controller's admission (a claim on a cordoned node waits, saying why; claims
//! already admitted stay) and `moorctl alloc plan`.

use serde::{Deserialize, Serialize};

use super::*;

/// The longest reason a cordon carries.
pub const MAX_CORDON_REASON: usize = 1024;

/// Desired state of a cordon: why.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CordonSpec {
    /// Why the node takes no new claim (shown in each waiting claim's reason).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    /// Set by `moorctl node drain`: the node is being emptied, not only closed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub drain: bool,
}

/// A cordon has no observed state.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CordonStatus {
    /// Generation, conditions, last error.
    #[serde(flatten)]
    pub meta: StatusMeta,
}

impl Spec for CordonSpec {
    const KIND: &'static str = "Cordon";
    const DIR: &'static str = "cordons";
    const NAMESPACED: bool = false;
    const ALIASES: &'static [&'static str] = &["cordon"];
    const PHASE: Option<&'static str> = None;
    const CHECKED: bool = true;
    const AGENT: AgentAccess = AgentAccess::None;
    type Status = CordonStatus;

    fn validate(&self, errors: &mut ValidationErrors) {
        if self.reason.len() > MAX_CORDON_REASON {
            errors.push(
                "reason",
                format!("{} bytes; at most {MAX_CORDON_REASON}", self.reason.len()),
            );
        }
        if self.reason.chars().any(char::is_control) {
            errors.push("reason", "must not contain control characters");
        }
    }
}

/// A cordon object, named by its node.
pub type Cordon = Object<CordonSpec>;

impl Cordon {
    /// The key of node `name`'s cordon.
    pub fn key_for(name: &NodeName) -> ObjectKey<CordonSpec> {
        ObjectKey::from_parts(&[name])
    }

    /// What a claim waiting on the node is told.
    pub fn why(&self) -> String {
        let verb = if self.spec.drain {
            "drained"
        } else {
            "cordoned"
        };
        match self.spec.reason.as_str() {
            "" => format!("node {} is {verb}", self.metadata.name),
            r => format!("node {} is {verb}: {r}", self.metadata.name),
        }
    }
}

/// Whether a volume admits new claims (Docker Swarm's availability).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Availability {
    /// New claims are admitted.
    #[default]
    Active,
    /// No new claim is admitted; the claims it has stay.
    Pause,
    /// No new claim is admitted, and `moorctl volume drain` asked the allocations
    /// holding it to stop.
    Drain,
}

impl Availability {
    /// Whether it is the default (not stored).
    pub fn is_active(&self) -> bool {
        *self == Availability::Active
    }

    /// As `get volumes` and manifests spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Availability::Active => "active",
            Availability::Pause => "pause",
            Availability::Drain => "drain",
        }
    }
}

impl std::fmt::Display for Availability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cordon_says_why_and_refuses_a_hostile_reason() {
        let mut c = Cordon::new(
            &Namespace::default(),
            Name::new("n1").unwrap(),
            CordonSpec {
                reason: "disk swap".into(),
                drain: false,
            },
        );
        assert_eq!(c.why(), "node n1 is cordoned: disk swap");
        c.spec.drain = true;
        c.spec.reason.clear();
        assert_eq!(c.why(), "node n1 is drained");
        let mut e = ValidationErrors::default();
        CordonSpec {
            reason: "a\u{7}b".into(),
            drain: false,
        }
        .validate(&mut e);
        assert!(e.to_string().contains("control"));
        let mut e = ValidationErrors::default();
        CordonSpec {
            reason: "x".repeat(MAX_CORDON_REASON + 1),
            drain: false,
        }
        .validate(&mut e);
        assert!(e.to_string().contains("at most"));
    }
}
