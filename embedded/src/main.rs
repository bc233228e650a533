//! moor-store: the embedded etcd-API store as a process of its own (`moord dev` runs the
//! same store in-process). One machine, no auth; loopback, or TLS (--cert/--key, and
//! --client-ca to require client certificates).

use std::path::PathBuf;

use clap::Parser;
use tokio_util::sync::CancellationToken;

/// Serve the subset of the etcd v3 API that moor uses, durable in DIR.
#[derive(Debug, Parser)]
#[command(name = "moor-store", version = moor_csi::version::VERSION, about)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:2379")]
    listen: String,
    /// Where the data lives (created if missing).
    #[arg(long)]
    data_dir: PathBuf,
    /// Serve on a non-loopback address without TLS.
    #[arg(long)]
    insecure_listen: bool,
    /// TLS.
    #[command(flatten)]
    tls: moor_embedded::TlsArgs,
    /// Revisions of history kept for watchers that resume; older ones are compacted.
    #[arg(long, default_value_t = 100_000)]
    history: i64,
    /// How log lines are written: text, or json (one object per line).
    #[arg(long, env = "MOOR_LOG_FORMAT", default_value = "text")]
    log_format: moor_csi::process::LogFormat,
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    moor_csi::process::init_logging(args.log_format);
    if let Err(e) = run(args).await {
        eprintln!("moor-store: {e:#}");
        std::process::exit(1);
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    use anyhow::Context;
    let store = moor_embedded::EmbeddedStore::open(&args.data_dir, args.history)
        .with_context(|| format!("opening the store in {}", args.data_dir.display()))?;
    let tls = args.tls.config()?;
    let listener = moor_embedded::bind(&args.listen, args.insecure_listen, tls.is_some()).await?;
    let shutdown: CancellationToken = moor_csi::process::on_signal();
    eprintln!(
        "moor-store: serving the etcd v3 API on {}://{}",
        if tls.is_some() { "https" } else { "http" },
        listener.local_addr()?
    );
    moor_embedded::serve(store, listener, tls, shutdown).await
}
