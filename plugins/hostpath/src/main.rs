//! moor-hostpath: serve the reference CSI plugin until SIGINT/SIGTERM.

use clap::Parser;

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cfg = moor_hostpath::Config::parse();
    let shutdown = moor::runtime::shutdown::on_signal();
    if let Err(e) = moor_hostpath::run(cfg, shutdown).await {
        eprintln!("moor-hostpath: {e:#}");
        std::process::exit(2);
    }
}
