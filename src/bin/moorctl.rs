//! moorctl: the command-line client.

use clap::Parser;

fn main() {
    let cli = moor::cli::Cli::parse();
    match cli.run() {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("moorctl: {e:#}");
            std::process::exit(2);
        }
    }
}
