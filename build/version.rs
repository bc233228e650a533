// Shared by the build scripts of the binaries (moorctl/build.rs, controllers/build.rs,
// through include!): the commit a binary is built from and whether the work tree was
// clean, as MOOR_COMMIT (12 hex digits, or `unknown` outside a git checkout) and
// MOOR_TREE (`clean`, `dirty` or `unknown`), printed by `--version`.

use std::path::Path;
use std::process::Command;

/// Runs git in `root`; its trimmed output, if it succeeded.
fn git(root: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(root)
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Emits MOOR_COMMIT and MOOR_TREE for the crate at CARGO_MANIFEST_DIR, whose
/// workspace root is its parent.
fn emit_version() {
    let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default();
    let root = Path::new(&manifest)
        .parent()
        .unwrap_or(Path::new("."))
        .to_path_buf();
    let commit = git(&root, &["rev-parse", "--short=12", "HEAD"]);
    // Tracked files changed since HEAD (untracked ones are not part of a build).
    let tree = match git(&root, &["status", "--porcelain", "--untracked-files=no"]) {
        Some(s) if s.is_empty() => "clean",
        Some(_) => "dirty",
        None => "unknown",
    };
    // As moor_csi::version::VERSION writes it: `~` for `-` (Debian's order).
    println!(
        "cargo:rustc-env=MOOR_VERSION={}",
        std::env::var("CARGO_PKG_VERSION")
            .unwrap_or_default()
            .replace('-', "~")
    );
    println!(
        "cargo:rustc-env=MOOR_COMMIT={}",
        commit.as_deref().unwrap_or("unknown")
    );
    println!("cargo:rustc-env=MOOR_TREE={tree}");
    // Again when HEAD moves, the index changes, or a source of the workspace does.
    if let Some(git_dir) = git(&root, &["rev-parse", "--absolute-git-dir"]) {
        let git_dir = Path::new(&git_dir);
        for f in ["HEAD", "index", "packed-refs"] {
            println!("cargo:rerun-if-changed={}", git_dir.join(f).display());
        }
        if let Some(head_ref) = git(&root, &["symbolic-ref", "-q", "HEAD"]) {
            println!("cargo:rerun-if-changed={}", git_dir.join(head_ref).display());
        }
    }
    for dir in [
        "Cargo.toml",
        "Cargo.lock",
        "src",
        "csi/src",
        "moorctl/src",
        "embedded/src",
        "controllers/src",
        "plugins/hostpath/src",
        "bench/src",
        "proto",
    ] {
        let p = root.join(dir);
        if p.exists() {
            println!("cargo:rerun-if-changed={}", p.display());
        }
    }
}
