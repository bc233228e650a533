//! moor-hostpath: moor's reference CSI plugin. Its implementation is the subject of its
//! own issue; until then the binary says so and fails, so nothing mistakes it for a
//! working plugin.

fn main() {
    eprintln!("moor-hostpath: not implemented yet (see the moor-hostpath issue)");
    std::process::exit(2);
}
