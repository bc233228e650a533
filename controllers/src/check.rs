//! `moord check`: list every kind from etcd, count objects, report malformed values.

use anyhow::Context;
use moor::api::*;
use moor::process::error_chain;
use moor::store::{Store, DEFAULT_PREFIX};

/// Audit the store: every object of every kind is read and validated.
#[derive(Debug, clap::Args)]
pub struct Check {
    /// etcd endpoints, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "http://127.0.0.1:2379")]
    etcd: Vec<String>,
    /// Key prefix moor uses.
    #[arg(long, default_value = DEFAULT_PREFIX)]
    prefix: String,
}

async fn audit<S: Spec>(store: &Store, bad: &mut usize) -> anyhow::Result<()> {
    let list = store
        .list::<S>(&KeyScope::all())
        .await
        .with_context(|| format!("listing {}", S::DIR))?;
    println!(
        "{:<12} {:>8} objects {:>6} malformed",
        S::KIND,
        list.items.len(),
        list.malformed.len()
    );
    for e in &list.malformed {
        println!("  {}", error_chain(e));
    }
    *bad += list.malformed.len();
    Ok(())
}

impl Check {
    /// Prints a line per kind; exit code 1 if anything is malformed.
    pub async fn run(self) -> anyhow::Result<i32> {
        let store = Store::connect(&self.etcd, &self.prefix)
            .await
            .with_context(|| format!("connecting to etcd at {}", self.etcd.join(",")))?;
        let mut bad = 0;
        audit::<VolumeSpec>(&store, &mut bad).await?;
        audit::<AllocationSpec>(&store, &mut bad).await?;
        audit::<ClaimSpec>(&store, &mut bad).await?;
        audit::<AttachmentSpec>(&store, &mut bad).await?;
        audit::<MountSpec>(&store, &mut bad).await?;
        audit::<NodeSpec>(&store, &mut bad).await?;
        audit::<PluginSpec>(&store, &mut bad).await?;
        audit::<EventSpec>(&store, &mut bad).await?;
        Ok(if bad > 0 { 1 } else { 0 })
    }
}
