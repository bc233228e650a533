//! moor-hostpath: serve the reference CSI plugin until SIGINT/SIGTERM.

use clap::Parser;

#[tokio::main]
async fn main() {
    moor::runtime::logging::init();
    let cfg = moor_hostpath::Config::parse();
    let shutdown = moor::runtime::shutdown::on_signal();
    if let Err(e) = moor_hostpath::run(cfg, shutdown).await {
        eprintln!("moor-hostpath: {e:#}");
        std::process::exit(2);
    }
}
