//! `moord check`: list every kind the registry marks as audited, count objects, report
//! malformed values. It connects as every moord mode does (TLS and auth flags).

use anyhow::Context;
use moor::api::*;
use moor::process::error_chain;
use moor::store::Store;
use std::time::Duration;

use crate::common::EtcdArgs;

/// Audit the store: every object of every kind is read and validated.
#[derive(Debug, clap::Args)]
pub struct Check {
    #[command(flatten)]
    etcd: EtcdArgs,
}

/// Lists kind `S`: prints a line of counts and each malformed value (added to `bad`);
/// the objects that read. Shared with `moord backup check`.
pub(crate) async fn audit<S: Spec>(
    store: &Store,
    bad: &mut usize,
) -> anyhow::Result<Vec<Object<S>>> {
    let list = store
        .list::<S>(&KeyScope::all())
        .await
        .with_context(|| format!("listing {}", KeyScope::<S>::all().as_str()))?;
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
    Ok(list.items)
}

impl Check {
    /// Prints etcd's alarms and a line per kind; exit code 1 if an alarm is raised or
    /// anything is malformed.
    pub async fn run(self) -> anyhow::Result<i32> {
        let store = self.etcd.connect(Duration::ZERO).await?;
        let mut bad = 0;
        // A raised alarm first: with NOSPACE every write in the cluster fails.
        match store.alarms().await {
            Ok(alarms) if alarms.is_empty() => println!("etcd alarms: none"),
            Ok(alarms) => {
                for (member, alarm) in &alarms {
                    let help = if alarm == "NOSPACE" {
                        format!(": {}", moor::store::NOSPACE_HELP)
                    } else {
                        String::new()
                    };
                    println!("etcd alarm:  {alarm} on member {member:x}{help}");
                }
                bad += alarms.len();
            }
            Err(e) => println!("etcd alarms: unknown ({})", error_chain(&e)),
        }
        for &kind in Kind::ALL.iter().filter(|k| k.checked()) {
            moor::with_spec!(kind, S => {
                audit::<S>(&store, &mut bad).await?;
            });
        }
        Ok(if bad > 0 { 1 } else { 0 })
    }
}
