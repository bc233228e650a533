//! Process basics every moor binary shares: log setup, graceful shutdown, and error
//! chains written on one line.

use tokio_util::sync::CancellationToken;

/// Installs the tracing subscriber: stderr, filtered by `RUST_LOG` (default `info`), with
/// colours only when stderr is a terminal (not in log files or journald). Call once at
/// the start of `main`.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

/// A token cancelled on the first SIGINT or SIGTERM.
pub fn on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let trip = token.clone();
    tokio::spawn(async move {
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term => {}
        }
        tracing::info!("shutdown requested");
        trip.cancel();
    });
    token
}

/// An error and its sources on one line, `outer: inner: root`, for logs and events.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn error_chain_joins_every_source() {
        let e = Outer(std::io::Error::other("root"));
        assert_eq!(error_chain(&e), "outer: root");
    }
}
