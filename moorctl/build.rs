//! The commit and tree state `--version` prints (build/version.rs).

include!("../build/version.rs");

fn main() {
    emit_version();
}
