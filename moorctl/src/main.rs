//! moorctl: the command-line client.

use clap::Parser;

fn main() {
    // The configuration file's settings, under the environment's and the flags'.
    if let Err(e) = moorctl::config::load() {
        eprintln!("moorctl: {}", moorctl::out::terminal_safe(&e));
        std::process::exit(2);
    }
    let cli = moorctl::Cli::parse();
    let (endpoints, verbose) = (cli.endpoints.clone(), cli.verbose);
    match cli.run() {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            // The user's answer (not found, refused, timed out) exits 1; anything else
            // (usage, connection, store errors) exits 2.
            let refused = e.downcast_ref::<moorctl::Refused>().is_some()
                || matches!(
                    e.downcast_ref::<moor::store::StoreError>(),
                    Some(moor::store::StoreError::Protected { .. })
                );
            eprintln!(
                "moorctl: {}",
                moorctl::out::terminal_safe(&moorctl::explain::explain(&e, &endpoints))
            );
            if verbose {
                eprint!(
                    "{}",
                    moorctl::out::terminal_safe(&moorctl::explain::causes(&e))
                );
            }
            std::process::exit(if refused { 1 } else { 2 });
        }
    }
}
