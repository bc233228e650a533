//! `moorctl apply -f FILE|-`: create or update objects from manifests.

use std::io::Read;

use anyhow::Context;

use super::{Ctx, Refused};
use crate::api::{parse_manifests, AnyObject, Object, Spec};
use crate::runtime::controller::error_chain;
use crate::store::StoreError;

/// Create or update objects from manifests.
#[derive(Debug, clap::Args)]
pub struct Apply {
    /// The manifest file, or `-` for standard input.
    #[arg(short = 'f', long = "filename")]
    pub file: String,
}

/// Reads a file, or standard input for `-`.
pub fn read_input(file: &str) -> anyhow::Result<String> {
    if file == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("reading standard input")?;
        Ok(s)
    } else {
        std::fs::read_to_string(file).with_context(|| format!("reading {file}"))
    }
}

impl Apply {
    /// Applies every valid document; one line per document; exit code 1 if any failed
    /// (the others are still applied: documents are independent).
    pub async fn run(self, ctx: &Ctx) -> anyhow::Result<i32> {
        let text = read_input(&self.file)?;
        let results = parse_manifests(&text);
        if results.is_empty() {
            eprintln!("{}: no documents", self.file);
            return Ok(1);
        }
        let mut failed = 0;
        for result in results {
            let outcome = match result {
                Ok(obj) => apply_any(ctx, obj).await,
                Err(e) => Err(anyhow::Error::new(e)),
            };
            match outcome {
                Ok(line) => println!("{line}"),
                Err(e) => {
                    failed += 1;
                    eprintln!("error: {}", error_chain(e.as_ref()));
                }
            }
        }
        Ok(if failed > 0 { 1 } else { 0 })
    }
}

async fn apply_any(ctx: &Ctx, obj: AnyObject) -> anyhow::Result<String> {
    match obj {
        AnyObject::Volume(o) => apply_one(ctx, *o).await,
        AnyObject::Allocation(o) => apply_one(ctx, *o).await,
        other => Err(Refused(format!(
            "{}: {} objects are written by moor itself; apply Volumes and Allocations",
            other.key(),
            other.key().split('/').next().unwrap_or_default()
        ))
        .into()),
    }
}

/// Creates the object, or updates the stored one's spec and labels (status and
/// finalizers stay the reconcilers'). A manifest that carries a resource_version is
/// applied only over that version, so a stale copy never overwrites a newer one.
async fn apply_one<S: Spec>(ctx: &Ctx, obj: Object<S>) -> anyhow::Result<String> {
    let suffix = obj.spec.key_suffix(&obj.metadata);
    let what = format!("{}/{}", S::KIND.to_lowercase(), suffix);
    let yours = obj.metadata.resource_version;
    let Some(current) = ctx.store.try_get::<S>(&suffix).await? else {
        if yours != 0 {
            return Err(Refused(format!(
                "{what}: not applied: your copy is of version {yours}, but the object no longer exists"
            ))
            .into());
        }
        let mut fresh = obj;
        fresh.status = S::Status::default();
        fresh.metadata.finalizers.clear();
        ctx.store.create(&fresh).await?;
        return Ok(format!("{what} created"));
    };
    let stored = current.metadata.resource_version;
    if yours != 0 && yours != stored {
        return Err(Refused(format!(
            "{what}: not applied: the stored object (version {stored}) is newer than your copy (version {yours}); get it again and re-apply"
        ))
        .into());
    }
    if current.metadata.deletion_timestamp.is_some() {
        return Err(Refused(format!("{what}: not applied: it is being deleted")).into());
    }
    if current.spec == obj.spec && current.metadata.labels == obj.metadata.labels {
        return Ok(format!("{what} unchanged"));
    }
    let mut next = current;
    next.spec = obj.spec;
    next.metadata.labels = obj.metadata.labels;
    match ctx.store.replace(&next).await {
        Ok(_) => Ok(format!("{what} configured")),
        Err(StoreError::Conflict { .. }) => Err(Refused(format!(
            "{what}: not applied: it changed while applying; run apply again"
        ))
        .into()),
        Err(e) => Err(e.into()),
    }
}
