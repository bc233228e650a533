//! Process basics every moor binary shares: log setup, graceful shutdown, and error
//! chains written on one line.

use tokio_util::sync::CancellationToken;

/// How log lines are written: `text` for people, `json` for log pipelines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// One human-readable line per event (the default).
    #[default]
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, the event's fields
    /// flattened (`message`, `object`, `error`, ...), and the fields of the spans it
    /// happened in (`span`: the innermost, e.g. a reconcile's `controller` and `object`;
    /// `spans`: all of them), so a pipeline can index lines by object key.
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<LogFormat, String> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("{other:?} is not a log format (text or json)")),
        }
    }
}

/// The log layer every moor binary writes through: stderr, in `format`; text has
/// colours only when stderr is a terminal (not in log files or journald). Unfiltered:
/// the caller adds its filter.
pub fn log_layer<S>(format: LogFormat) -> Box<dyn tracing_subscriber::Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    use tracing_subscriber::Layer;
    let layer = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    match format {
        LogFormat::Text => layer
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .boxed(),
        LogFormat::Json => layer
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(true)
            .boxed(),
    }
}

/// The `RUST_LOG` filter (default `info`).
pub fn env_filter() -> tracing_subscriber::EnvFilter {
    tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"))
}

/// Installs the tracing subscriber: [`log_layer`] filtered by [`env_filter`]. Call once
/// at the start of `main`.
pub fn init_logging(format: LogFormat) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    tracing_subscriber::registry()
        .with(log_layer(format).with_filter(env_filter()))
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

/// The longest error chain [`error_chain`] writes, in characters.
pub const MAX_ERROR_CHARS: usize = 2000;

/// An error and its sources on one line, `outer: inner: root`, for logs and events;
/// escaped as [`printable`] (an error may quote a stored value or a plugin's message)
/// and cut at [`MAX_ERROR_CHARS`].
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
        if out.len() > 4 * MAX_ERROR_CHARS {
            break;
        }
    }
    printable_bounded(&out, MAX_ERROR_CHARS)
}

/// `s` with control characters and bidirectional overrides escaped (`\u{1b}`), so a
/// value from the store or a plugin cannot rewrite the operator's terminal or reorder
/// its text.
pub fn printable(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        push_printable(&mut out, c);
    }
    out
}

/// [`printable`] of at most `max` characters of `s`, saying how much was left out.
pub fn printable_bounded(s: &str, max: usize) -> String {
    let mut out = String::new();
    for (n, (i, c)) in s.char_indices().enumerate() {
        if n == max {
            out.push_str(&format!("... ({} more bytes)", s.len() - i));
            break;
        }
        push_printable(&mut out, c);
    }
    out
}

fn push_printable(out: &mut String, c: char) {
    let bidi =
        matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
    if c.is_control() || bidi {
        out.push_str(&format!("\\u{{{:x}}}", c as u32));
    } else {
        out.push(c);
    }
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

    #[test]
    fn error_chain_escapes_and_bounds_what_it_quotes() {
        let quoted = format!("\u{1b}[2J\u{202e}{}", "x".repeat(1 << 20));
        let line = error_chain(&Outer(std::io::Error::other(quoted)));
        assert!(
            line.starts_with("outer: \\u{1b}[2J\\u{202e}xxx"),
            "{}",
            &line[..40]
        );
        assert!(!line.contains('\u{1b}') && !line.contains('\u{202e}'));
        assert!(line.len() < MAX_ERROR_CHARS + 100, "{}", line.len());
        assert!(
            line.ends_with("more bytes)"),
            "{}",
            &line[line.len() - 40..]
        );
    }
}
