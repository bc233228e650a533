//! Compiles proto/csi.proto into client and server code (the reference plugin serves it).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=../proto/csi.proto");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .btree_map(".")
        .compile_protos(&["../proto/csi.proto"], &["../proto"])?;
    Ok(())
}
