//! The store's error type: every etcd failure classified so callers can match on cause.

use crate::api::ValidationErrors;

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No object at that key.
    #[error("{key} not found")]
    NotFound {
        /// The key below the prefix.
        key: String,
    },
    /// Create of a key that exists.
    #[error("{key} already exists")]
    AlreadyExists {
        /// The key below the prefix.
        key: String,
    },
    /// The object changed (or was deleted) since the revision the write was based on.
    #[error("conflict on {key}: it is no longer at revision {expected}")]
    Conflict {
        /// The key below the prefix.
        key: String,
        /// The resource_version the write expected.
        expected: i64,
    },
    /// A read or watch asked for a revision etcd has compacted away.
    #[error("revision {requested} has been compacted (oldest kept: {compact_revision})")]
    Compacted {
        /// The revision asked for.
        requested: i64,
        /// The oldest revision etcd still has.
        compact_revision: i64,
    },
    /// etcd's backend reached its quota and raised a NOSPACE alarm: every write in the
    /// cluster fails until an operator frees space and disarms it.
    #[error("etcd is out of space (NOSPACE alarm: its backend reached its quota); every write fails until an operator compacts, defragments and disarms the alarm (see deploy/README.md, \"Space\")")]
    NoSpace(#[source] etcd_client::Error),
    /// etcd could not be reached or did not answer in time; retry.
    #[error("etcd is unavailable")]
    Unavailable(#[source] etcd_client::Error),
    /// A value under a moor key that is not a valid object of its kind.
    #[error("malformed value at {key} (revision {revision})")]
    Malformed {
        /// The key below the prefix.
        key: String,
        /// The revision the value was written at (its mod_revision).
        revision: i64,
        /// What is wrong with it.
        #[source]
        cause: MalformedCause,
    },
    /// An object that fails validation was not written.
    #[error("refusing to write an invalid {kind}")]
    Invalid {
        /// The kind.
        kind: &'static str,
        /// Every problem found.
        #[source]
        errors: ValidationErrors,
    },
    /// A fenced write whose leadership is gone: the fence key changed.
    #[error("not the leader any more: fence {fence_key} changed")]
    Deposed {
        /// The leader key the writes were fenced on.
        fence_key: String,
    },
    /// Secrets that this process cannot seal (it holds only a node's keys).
    #[error("cannot write {key}")]
    Sealing {
        /// The object's key.
        key: String,
        /// Why.
        #[source]
        cause: super::SealError,
    },
    /// A delete refused by the object's own spec (a Volume's deletion protection).
    #[error("{key} is protected: {why}")]
    Protected {
        /// The key below the prefix.
        key: String,
        /// What protects it and how to lift it.
        why: &'static str,
    },
    /// A lease that etcd does not know (expired or revoked).
    #[error("lease {0:x} has expired or been revoked")]
    LeaseGone(i64),
    /// etcd refused the request: the identity's role does not grant that access to
    /// those keys (etcd's PERMISSION_DENIED, which names neither).
    #[error("permission denied: etcd refused {} {access} {what}; its etcd role does not grant it", who(.identity))]
    Denied {
        /// The etcd user the connection is (a certificate's CN, a `--user` name).
        identity: Option<String>,
        /// What was asked.
        access: Access,
        /// The full key, keys or range (`below PREFIX`) asked about.
        what: String,
        /// etcd's answer.
        #[source]
        source: etcd_client::Error,
    },
    /// Any other failure etcd reported.
    #[error("etcd request failed")]
    Etcd(#[source] etcd_client::Error),
}

/// What a request asked of etcd, as a refusal words it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// A range read.
    Read,
    /// A write (a transaction's compares read too).
    Write,
    /// A watch.
    Watch,
}

impl std::fmt::Display for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Access::Read => "a read of",
            Access::Write => "a write of",
            Access::Watch => "a watch of",
        })
    }
}

fn who(identity: &Option<String>) -> String {
    match identity {
        Some(name) => format!("identity {}", crate::api::printable(name)),
        None => "this connection (no etcd identity)".to_string(),
    }
}

/// Keys as a refusal names them: the first three, then how many more.
pub(super) fn keys_named(keys: &[String]) -> String {
    const SHOWN: usize = 3;
    let mut out = keys
        .iter()
        .take(SHOWN)
        .map(|k| crate::api::printable(k))
        .collect::<Vec<_>>()
        .join(", ");
    if keys.len() > SHOWN {
        out.push_str(&format!(" and {} more", keys.len() - SHOWN));
    }
    out
}

/// What an operator does about etcd's NOSPACE alarm, for the processes that report it.
pub const NOSPACE_HELP: &str = "etcd's backend reached its quota and every write in the cluster fails until an operator compacts, defragments and disarms the alarm (deploy/README.md, \"Space\")";

/// What is wrong with a malformed value.
#[derive(Debug, thiserror::Error)]
pub enum MalformedCause {
    /// Larger than the kind allows ([`crate::api::Spec::MAX_BYTES`]); not parsed.
    #[error("{bytes} bytes; a stored {kind} may be at most {max} bytes")]
    TooLarge {
        /// The kind.
        kind: &'static str,
        /// The value's size.
        bytes: usize,
        /// The kind's limit.
        max: usize,
    },
    /// Not JSON of the kind's shape.
    #[error("not a valid JSON object of this kind")]
    Json(#[source] serde_json::Error),
    /// Well-formed but invalid.
    #[error("invalid object")]
    Invalid(#[source] ValidationErrors),
    /// The object names itself differently from the key it is stored at.
    #[error("object belongs at {actual}")]
    WrongKey {
        /// Where its metadata and spec place it.
        actual: String,
    },
    /// A report that is not an object (a plugin's capacity report) and is not what it
    /// should be.
    #[error("{0}")]
    Report(String),
    /// Sealed secrets that do not open with the key they name.
    #[error("its secrets")]
    Sealed(#[source] super::OpenError),
}

impl StoreError {
    /// Whether a guarded write lost to a concurrent change.
    pub fn is_conflict(&self) -> bool {
        matches!(self, StoreError::Conflict { .. })
    }

    /// Whether etcd refused the request for this identity (its role lacks the key):
    /// etcd answered, so it is up.
    pub fn is_permission_denied(&self) -> bool {
        match self {
            StoreError::Denied { .. } => true,
            StoreError::Etcd(e) => denied(e),
            _ => false,
        }
    }

    /// `e` as a refusal of `access` to `what` by `identity` when etcd denied it,
    /// otherwise classified as [`StoreError::from_etcd`] does.
    pub(crate) fn refused(
        e: etcd_client::Error,
        identity: Option<&str>,
        access: Access,
        what: impl FnOnce() -> String,
    ) -> StoreError {
        if denied(&e) {
            StoreError::Denied {
                identity: identity.map(str::to_string),
                access,
                what: what(),
                source: e,
            }
        } else {
            StoreError::from_etcd(e)
        }
    }

    /// The store unavailable because it gave no answer within `after` (a paused or
    /// partitioned etcd: a request waits on it with no error of its own).
    pub fn unanswered(after: std::time::Duration) -> StoreError {
        StoreError::Unavailable(etcd_client::Error::GRpcStatus(
            tonic::Status::deadline_exceeded(format!(
                "etcd did not answer within {}",
                humantime::format_duration(after)
            )),
        ))
    }

    /// Whether retrying the same request later may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, StoreError::Unavailable(_))
    }

    /// A watch etcd cancelled, with its reason: permission denied when the reason says
    /// so (the identity's role does not cover the range), otherwise unavailable (the
    /// watch may be opened again).
    pub(crate) fn watch_cancelled(reason: &str, identity: Option<&str>, what: &str) -> StoreError {
        let reason = if reason.is_empty() {
            "watch cancelled by etcd"
        } else {
            reason
        };
        let code = if reason.contains("permission denied") {
            tonic::Code::PermissionDenied
        } else {
            tonic::Code::Aborted
        };
        StoreError::refused(
            etcd_client::Error::GRpcStatus(tonic::Status::new(code, reason.to_string())),
            identity,
            Access::Watch,
            || what.to_string(),
        )
    }

    /// Classifies an etcd client error.
    pub(crate) fn from_etcd(e: etcd_client::Error) -> StoreError {
        use etcd_client::Error as E;
        use tonic::Code;
        match &e {
            E::TransportError(_) | E::IoError(_) => StoreError::Unavailable(e),
            E::GRpcStatus(s) => match s.code() {
                Code::ResourceExhausted if s.message().contains("space exceeded") => {
                    StoreError::NoSpace(e)
                }
                Code::Unavailable
                | Code::DeadlineExceeded
                | Code::Cancelled
                | Code::Aborted
                | Code::ResourceExhausted
                | Code::Unknown => StoreError::Unavailable(e),
                Code::OutOfRange if s.message().contains("compacted") => StoreError::Compacted {
                    requested: 0,
                    compact_revision: 0,
                },
                Code::NotFound if s.message().contains("lease") => StoreError::LeaseGone(0),
                _ => StoreError::Etcd(e),
            },
            E::WatchError(_) | E::LeaseKeepAliveError(_) => StoreError::Unavailable(e),
            _ => StoreError::Etcd(e),
        }
    }
}

/// Whether etcd answered PERMISSION_DENIED.
fn denied(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s) if s.code() == tonic::Code::PermissionDenied)
}

/// How much of a malformed value's error a log line shows.
const MALFORMED_LOG_CHARS: usize = 300;

/// An error chain cut to a few hundred escaped characters (a malformed value's error
/// quotes the value, which may be large or hostile).
pub fn bounded_chain(e: &StoreError) -> String {
    moor_csi::process::printable_bounded(&moor_csi::process::error_chain(e), MALFORMED_LOG_CHARS)
}
