//! The module maps cannot drift silently: every folder module (a crate's root, and each
//! file whose children live in a folder of their own) has one `# Layout` section in its
//! module doc, whose bullets name (before their colon) each child module the file
//! declares, every one and only those. A module added, removed or renamed without its
//! map, a new folder without one, or a second Layout section fails here, naming the
//! file and the difference.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The source folders of the workspace's crates: each member's `src` (Cargo.toml's
/// `members = [...]`), so a new crate is checked without being listed here.
fn crates(root: &Path) -> Vec<String> {
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).expect("reading Cargo.toml");
    let line = manifest
        .lines()
        .find(|l| l.trim_start().starts_with("members"))
        .expect("the workspace's members");
    line.split('"')
        .skip(1)
        .step_by(2)
        .map(|m| {
            if m == "." {
                "src".to_string()
            } else {
                format!("{m}/src")
            }
        })
        .collect()
}

/// Every folder module under `root`: the crate's root files (`lib.rs`, `main.rs`; a
/// thin `main.rs` beside a library declares no module and needs no map) and, for each
/// folder below, the file that declares it (`dir/mod.rs` or `dir.rs`).
fn folder_modules(root: &Path, crate_dir: &str) -> Vec<PathBuf> {
    let src = root.join(crate_dir);
    let mut out: Vec<PathBuf> = ["lib.rs", "main.rs"]
        .iter()
        .map(|f| src.join(f))
        .filter(|p| p.is_file())
        .collect();
    let mut dirs = vec![src];
    while let Some(dir) = dirs.pop() {
        let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            if !path.is_dir() {
                continue;
            }
            let owner = [path.join("mod.rs"), path.with_extension("rs")]
                .into_iter()
                .find(|p| p.is_file())
                .unwrap_or_else(|| panic!("{}: no mod.rs and no file of its name", path.display()));
            out.push(owner);
            dirs.push(path);
        }
    }
    out.sort();
    out
}

/// How many `# Layout` headings the module doc of `src` has.
fn layouts(src: &str) -> usize {
    src.lines()
        .filter_map(|l| l.strip_prefix("//!"))
        .filter(|d| {
            let d = d.trim();
            d.starts_with('#') && d.trim_start_matches('#').trim() == "Layout"
        })
        .count()
}

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
fn every_folder_module_has_one_map_naming_its_modules_and_only_those() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut wrong = Vec::new();
    let crates = crates(root);
    assert!(crates.len() >= 7, "workspace members read: {crates:?}");
    let files: Vec<PathBuf> = crates
        .iter()
        .flat_map(|c| folder_modules(root, c))
        .collect();
    // The crates' roots and the folders known when this was written: a check that
    // found fewer would be looking in the wrong place.
    assert!(
        files.len() >= 24,
        "only {} folder modules found",
        files.len()
    );
    for path in &files {
        let file = path
            .strip_prefix(root)
            .unwrap_or(path)
            .display()
            .to_string();
        let src = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {file}: {e}"));
        // A binary's thin main beside its library declares nothing to map.
        if declared(&src).is_empty() && layouts(&src) == 0 {
            continue;
        }
        match layouts(&src) {
            1 => {}
            0 => {
                wrong.push(format!("{file}: no # Layout section in its module doc"));
                continue;
            }
            n => {
                wrong.push(format!("{file}: {n} # Layout sections; one map per module"));
                continue;
            }
        }
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
    assert_eq!(layouts(src), 1);
    assert_eq!(layouts(&src.replace("# Other", "# Layout")), 2);
}
