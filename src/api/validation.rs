//! Validation errors: every problem found, each at its field path.

use std::fmt;

/// One problem found by validation, at a field path such as `spec.capabilities[0]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// The field's path.
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

/// Every problem validation found in one object.
#[derive(Debug, Clone, PartialEq, Eq, Default, thiserror::Error)]
#[error("{}", self.0.iter().map(|e| format!("{}: {}", e.field, e.message)).collect::<Vec<_>>().join("; "))]
pub struct ValidationErrors(pub Vec<FieldError>);

impl ValidationErrors {
    /// Records a problem.
    pub fn push(&mut self, field: impl Into<String>, message: impl fmt::Display) {
        self.0.push(FieldError {
            field: field.into(),
            message: message.to_string(),
        });
    }
    /// Records the result of an id check.
    pub fn check_id(&mut self, field: &str, result: Result<(), super::IdError>) {
        if let Err(e) = result {
            self.push(field, e);
        }
    }
    /// Whether no problem was found.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    /// `Ok` when no problem was found.
    pub fn into_result(self) -> Result<(), ValidationErrors> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(self)
        }
    }
}

pub use moor_csi::process::{printable, printable_bounded};
