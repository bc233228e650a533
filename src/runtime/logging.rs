//! Log setup shared by the daemons: tracing to stderr, filtered by `RUST_LOG` (default
//! `info`), with colours only when stderr is a terminal (not in log files or journald).

/// Installs the tracing subscriber; call once at the start of `main`.
pub fn init() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}
