//! What every status shares: conditions, the generation observed, the last error and
//! the failing step.

use serde::{Deserialize, Serialize};

use super::{Term, Timestamp};

/// One observed condition of an object (Kubernetes-shaped).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Condition {
    /// What the condition is about, e.g. `Attached`.
    #[serde(rename = "type")]
    pub type_: Term,
    /// Whether it holds.
    pub status: bool,
    /// A machine-readable reason for the last transition.
    #[serde(default, skip_serializing_if = "str::is_empty")]
    pub reason: Term,
    /// A human-readable message.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// When `status` last changed.
    pub last_transition_time: Timestamp,
}

/// The fields every status section carries.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusMeta {
    /// The `metadata.generation` this status was computed from.
    #[serde(default, skip_serializing_if = "crate::api::is_zero")]
    pub observed_generation: i64,
    /// Observed conditions.
    #[serde(
        default,
        deserialize_with = "crate::api::tight_vec",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub conditions: Vec<Condition>,
    /// The last error met while reconciling, cleared on success.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// The step that is failing and backing off, cleared on its success.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<Box<StepFailure>>,
}

/// A failing step: what `moorctl describe` shows of an object that waits on a call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepFailure {
    /// The step, e.g. `NodeStageVolume`.
    pub step: String,
    /// When it first failed in this run of failures.
    pub since: Timestamp,
    /// Failed attempts in a row.
    pub attempts: u32,
    /// The last answer's gRPC code.
    pub code: String,
    /// The last answer's message.
    pub message: String,
    /// The answer was final (retried only at the cap or on a relevant change).
    #[serde(rename = "final", default)]
    pub final_answer: bool,
    /// When it is tried next, unless something it depends on changes first.
    pub next_retry: Timestamp,
}

impl StatusMeta {
    /// Clears what a failing step showed ([`StatusMeta::last_error`] and
    /// [`StatusMeta::retry`]): after the step succeeded.
    pub fn clear_failure(&mut self) {
        self.last_error = None;
        self.retry = None;
    }

    /// Sets a condition, keeping its transition time when its status did not change.
    pub fn set_condition(&mut self, type_: &str, status: bool, reason: &str, message: &str) {
        let now = Timestamp::now();
        match self.conditions.iter_mut().find(|c| c.type_ == type_) {
            Some(c) => {
                if c.status != status {
                    c.last_transition_time = now;
                }
                c.status = status;
                if c.reason != reason {
                    c.reason = Term::new(reason);
                }
                c.message = message.to_string();
            }
            None => self.conditions.push(Condition {
                type_: Term::new(type_),
                status,
                reason: Term::new(reason),
                message: message.to_string(),
                last_transition_time: now,
            }),
        }
    }
    /// The condition of that type, if any.
    pub fn condition(&self, type_: &str) -> Option<&Condition> {
        self.conditions.iter().find(|c| c.type_ == type_)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conditions_keep_transition_time_when_unchanged() {
        let mut s = StatusMeta::default();
        s.set_condition("Ready", false, "Waiting", "");
        let first = s.condition("Ready").unwrap().last_transition_time;
        s.set_condition("Ready", false, "StillWaiting", "");
        assert_eq!(s.condition("Ready").unwrap().last_transition_time, first);
        assert_eq!(s.condition("Ready").unwrap().reason, "StillWaiting");
        assert_eq!(s.conditions.len(), 1);
    }

    #[test]
    fn decoded_conditions_share_their_type_and_reason() {
        let json = r#"{"type":"Admitted","status":true,"reason":"Admitted","last_transition_time":"2026-11-25T04:17:27.089Z"}"#;
        let a: Condition = serde_json::from_str(json).unwrap();
        let b: Condition = serde_json::from_str(json).unwrap();
        assert!(std::ptr::eq(a.type_.as_str(), b.type_.as_str()));
        assert!(std::ptr::eq(a.reason.as_str(), b.type_.as_str()));
        assert_eq!(serde_json::to_string(&a).unwrap(), json);
        // An empty reason is not written.
        let mut s = StatusMeta::default();
        s.set_condition("Ready", true, "", "");
        let out = serde_json::to_value(&s.conditions[0]).unwrap();
        assert!(out.get("reason").is_none(), "{out}");
    }
}
