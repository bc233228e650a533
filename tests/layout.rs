//! The module maps cannot drift silently: each file below has a `# Layout` section in
//! its module doc, whose bullets name (before their colon) each child module the file
//! declares, every one and only those. A module added, removed or renamed without its
//! map fails here, naming the file and the difference.

use std::collections::BTreeSet;
use std::path::Path;

/// The files whose children a newcomer finds through their map.
const MAPS: &[&str] = &[
    "src/lib.rs",
    "src/api/mod.rs",
    "src/csi/mod.rs",
    "src/runtime/mod.rs",
    "src/store/mod.rs",
    "src/workload/mod.rs",
    "csi/src/lib.rs",
    "embedded/src/lib.rs",
    "moorctl/src/lib.rs",
    "controllers/src/main.rs",
    "controllers/src/agent/mod.rs",
    "controllers/src/agent/node/mod.rs",
    "controllers/src/controller/mod.rs",
    "plugins/hostpath/src/lib.rs",
    "bench/src/main.rs",
];

/// The modules the `# Layout` bullets of `src` name: the backticked identifiers before
/// each bullet's first colon (a bullet's head may run onto its continuation lines).
fn named(src: &str) -> BTreeSet<String> {
    let mut in_layout = false;
    let mut bullets: Vec<String> = Vec::new();
    for line in src.lines() {
        let Some(doc) = line.strip_prefix("//!") else {
            if in_layout {
                break;
            }
            continue;
        };
        let doc = doc.strip_prefix(' ').unwrap_or(doc);
        if doc.starts_with('#') {
            in_layout = doc.trim_start_matches('#').trim() == "Layout";
            continue;
        }
        if !in_layout {
            continue;
        }
        if let Some(bullet) = doc.strip_prefix("- ") {
            bullets.push(bullet.to_string());
        } else if let (Some(more), Some(last)) = (doc.strip_prefix("  "), bullets.last_mut()) {
            last.push(' ');
            last.push_str(more);
        }
    }
    let mut names = BTreeSet::new();
    for bullet in &bullets {
        let head = bullet.split(": ").next().unwrap_or_default();
        for part in head.split('`').skip(1).step_by(2) {
            let plain = part
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
            if !part.is_empty() && plain {
                names.insert(part.to_string());
            }
        }
    }
    names
}

/// The child modules `src` declares (`mod x;`, `pub mod x;`, `pub mod x {`), but test
/// modules.
fn declared(src: &str) -> BTreeSet<String> {
    let lines: Vec<&str> = src.lines().collect();
    let mut out = BTreeSet::new();
    for (i, line) in lines.iter().enumerate() {
        // A re-export of the crate's own module is a child too (`runtime::backoff`).
        let rest = line
            .strip_prefix("pub mod ")
            .or_else(|| line.strip_prefix("pub(crate) mod "))
            .or_else(|| line.strip_prefix("mod "))
            .or_else(|| line.strip_prefix("pub use crate::"));
        let Some(rest) = rest else { continue };
        if i > 0 && lines[i - 1].trim() == "#[cfg(test)]" {
            continue;
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            out.insert(name);
        }
    }
    out
}

#[test]
fn every_map_names_its_modules_and_only_those() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut wrong = Vec::new();
    for file in MAPS {
        let src = std::fs::read_to_string(root.join(file))
            .unwrap_or_else(|e| panic!("reading {file}: {e}"));
        let (named, declared) = (named(&src), declared(&src));
        let unnamed: Vec<_> = declared.difference(&named).collect();
        let missing: Vec<_> = named.difference(&declared).collect();
        if !unnamed.is_empty() || !missing.is_empty() {
            wrong.push(format!(
                "{file}: modules its Layout does not name {unnamed:?}; named but not there {missing:?}"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn the_check_reads_a_layout_and_the_declarations() {
    let src = "//! Intro.\n//!\n//! # Layout\n//! - [`a`], `b_2`: things [`c`]\n//!   more\n//! - `d`,\n//!   `f`: x\n//!\n//! # Other\n//! - `e`: no\n\nmod a;\npub mod b_2;\n#[cfg(test)]\nmod tests;\npub mod d {\n}\nmod f;\n";
    let n: Vec<_> = named(src).into_iter().collect();
    assert_eq!(n, ["a", "b_2", "d", "f"]);
    let d: Vec<_> = declared(src).into_iter().collect();
    assert_eq!(d, ["a", "b_2", "d", "f"]);
}
