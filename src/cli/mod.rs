//! moorctl: the verbs, one file each, dispatched from one enum.

mod validate;

use clap::{Parser, Subcommand};

/// moorctl: edit moor's desired state and watch it converge.
#[derive(Debug, Parser)]
#[command(name = "moorctl", version, about)]
pub struct Cli {
    /// The verb.
    #[command(subcommand)]
    pub command: Command,
}

/// moorctl's verbs.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Check manifests (YAML or JSON, several documents) without applying them.
    Validate(validate::Validate),
}

impl Cli {
    /// Runs the verb; returns the process exit code.
    pub fn run(self) -> anyhow::Result<i32> {
        match self.command {
            Command::Validate(cmd) => cmd.run(),
        }
    }
}
