//! `moorctl validate -f FILE|-`: parse and validate manifests, reporting every problem.

use moor::api::parse_manifests;
use moor::process::error_chain;

/// Check manifests without applying them.
#[derive(Debug, clap::Args)]
pub struct Validate {
    /// The manifest file, or `-` for standard input.
    #[arg(short = 'f', long = "filename")]
    pub file: String,
}

impl Validate {
    /// Prints one line per document; exit code 1 if any is invalid.
    pub fn run(self) -> anyhow::Result<i32> {
        let text = super::apply::read_input(&self.file)?;
        let mut bad = 0;
        let results = parse_manifests(&text);
        if results.is_empty() {
            eprintln!("{}: no documents", self.file);
            return Ok(1);
        }
        for result in results {
            match result {
                Ok(obj) => outln!("valid   {}", obj.key()),
                Err(e) => {
                    bad += 1;
                    outln!("invalid {}", error_chain(&e));
                }
            }
        }
        Ok(if bad > 0 { 1 } else { 0 })
    }
}
