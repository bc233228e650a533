//! `moorctl delete KIND NAME`: deletes an object; finalizers hold it until their owners
//! are done, and the verb says which.

use crate::kind::{self, Kind};
use crate::{is_not_found, parse_ns, ride_out, Ctx, Refused};

/// `moorctl delete KIND NAME`.
#[derive(Debug, clap::Args)]
pub struct Delete {
    /// The kind.
    pub kind: Kind,
    /// The name.
    pub name: String,
    /// Namespace.
    #[arg(short = 'n', long, default_value = "default")]
    pub namespace: String,
}

impl Delete {
    /// Deletes the object; a lost answer is ridden out (see [`ride_out`]).
    pub async fn run(self, ctx: &Ctx) -> anyhow::Result<i32> {
        let cmd = self;
        let ns = parse_ns(&cmd.namespace)?;
        // None: not found; after a lost answer, that is our deletion having landed.
        let outcome = ride_out(ctx, |retrying| {
            let ns = &ns;
            let cmd = &cmd;
            async move {
                let key = kind::find_key(ctx, cmd.kind, Some(ns), &cmd.name).await?;
                match key {
                    Some(key) => match kind::delete(ctx, cmd.kind, &key).await {
                        Ok(f) => Ok(Some(f)),
                        Err(e) if retrying && is_not_found(&e) => Ok(Some(Vec::new())),
                        Err(e) => Err(e),
                    },
                    None if retrying => Ok(Some(Vec::new())),
                    None => Ok(None),
                }
            }
        })
        .await?;
        let Some(finalizing) = outcome else {
            return Err(Refused(format!("{} {}/{} not found", cmd.kind, ns, cmd.name)).into());
        };
        if finalizing.is_empty() {
            outln!("{} {} deleted", cmd.kind, cmd.name);
        } else {
            outln!(
                "{} {} marked for deletion; waiting for {}",
                cmd.kind,
                cmd.name,
                finalizing.join(", ")
            );
        }
        Ok(0)
    }
}
