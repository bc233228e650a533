//! moord: moor's daemon. Today: `check`, a read-only audit of the store. The controller,
//! the node agent and `dev` arrive with the claim-lifecycle and newcomer issues.

mod check;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "moord", version, about = "moor's daemon")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Lists every moor object in etcd by kind and reports malformed ones (read-only).
    Check(check::Check),
}

#[tokio::main]
async fn main() {
    moor::runtime::logging::init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Check(cmd) => cmd.run().await,
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("moord: {e:#}");
            std::process::exit(2);
        }
    }
}
