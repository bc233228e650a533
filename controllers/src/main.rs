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
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
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
