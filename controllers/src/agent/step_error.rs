//! What a pass of a controller-plugin executor fails with.

use moor::api::*;

/// What a pass of a controller-plugin executor (attacher, provisioner, snapshotter)
/// fails with; the provisioner adds its own cases to it
/// ([`crate::agent::provisioner::ProvisionError`]).
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// A step's gate is closed: not a failure, the key is looked at again when it
    /// opens.
    #[error(transparent)]
    BackingOff(#[from] moor::runtime::steps::BackingOff),
    /// A CSI call failed.
    #[error("CSI call failed")]
    Csi(#[from] moor::csi::policy::CsiError),
    /// Reading or writing etcd failed.
    #[error("store operation failed")]
    Store(#[from] moor::store::StoreError),
    /// The plugin has no channel.
    #[error(transparent)]
    NoChannel(#[from] NoChannel),
    /// The secrets are sealed with a key this agent does not hold.
    #[error(transparent)]
    Sealed(#[from] moor::api::SealedSecrets),
    /// A Secret the call needs is not there.
    #[error(transparent)]
    MissingSecret(#[from] moor::api::MissingSecret),
}

impl moor::runtime::controller::ReconcileError for StepError {
    fn policy(&self) -> moor::runtime::controller::ErrorPolicy {
        match self {
            StepError::Store(e) => e.policy(),
            _ => moor::runtime::controller::ErrorPolicy::Backoff,
        }
    }
}

impl StepError {
    /// The closed gate, for [`moor::runtime::steps::requeue_backing_off`].
    pub fn backing_off(&self) -> Option<moor::runtime::steps::BackingOff> {
        match self {
            StepError::BackingOff(b) => Some(*b),
            _ => None,
        }
    }
}

/// `?` on what a [`StepError`] carries, for an error type `$error` with a
/// `Step(StepError)` case: each `$source` goes into it through the StepError.
macro_rules! through_step_error {
    ($error:ty, $($source:ty),* $(,)?) => {
        $(impl From<$source> for $error {
            fn from(e: $source) -> Self {
                Self::Step(e.into())
            }
        })*
    };
}
pub(crate) use through_step_error;

/// The plugin has no channel (its endpoint could not be used).
#[derive(Debug, thiserror::Error)]
#[error("plugin {0} has no channel")]
pub struct NoChannel(pub PluginId);
