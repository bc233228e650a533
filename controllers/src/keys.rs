//! `moord keys`: key files for secrets at rest ([`moor::store::Keyring`]).
//!
//! - `moord keys new --id k1 > cluster.keys`: a new cluster key file (the controller,
//!   agents that host a controller plugin, operators' moorctl).
//! - `moord keys node --node n1 --encryption-key-file cluster.keys > n1.keys`: node
//!   n1's derived keys, for its agent: they open the secrets of n1's claims only.
//!
//! Both print to standard output; keep the files private (mode 0600).

use std::path::PathBuf;

use moor::store::Keyring;

/// Key files for secrets at rest.
#[derive(Debug, clap::Args)]
pub struct Keys {
    #[command(subcommand)]
    command: KeysCommand,
}

#[derive(Debug, clap::Subcommand)]
enum KeysCommand {
    /// Prints a new cluster key file with one random key.
    New {
        /// The key's id, stored with everything it seals (e.g. k1, 2026-11).
        #[arg(long)]
        id: String,
    },
    /// Prints node NODE's key file, derived from the cluster key file.
    Node {
        /// The node.
        #[arg(long)]
        node: String,
        /// The cluster key file.
        #[arg(long, env = "MOOR_ENCRYPTION_KEY_FILE")]
        encryption_key_file: PathBuf,
    },
}

impl Keys {
    /// Prints the key file.
    pub fn run(self) -> anyhow::Result<i32> {
        let text = match self.command {
            KeysCommand::New { id } => Keyring::generate(&id)?,
            KeysCommand::Node {
                node,
                encryption_key_file,
            } => {
                moor::api::NodeName::new(&node)?;
                Keyring::load(&encryption_key_file)?.for_node(&node)?
            }
        };
        print!("{text}");
        Ok(0)
    }
}
