//! Logs and traces of a daemon: the log subscriber (text or JSON, `RUST_LOG`), and with
//! an OTLP endpoint the spans moor marks for tracing exported over OTLP/gRPC.
//!
//! One trace per claim: the controller starts it when it makes the claim and stores
//! its context on the claim (`metadata.trace`, a W3C `traceparent`); the Attachment and
//! the Mount made for the claim carry it on. Whoever works on one of them (the
//! controller's claims reconciler, an agent's attacher and node reconciler) opens a
//! span ([`step_span`]) whose parent is that context, so its spans, and the CSI calls
//! made under them, join the claim's trace in whichever process they run.
//!
//! Only spans of the [`TARGET`] target are exported: the runtime's own reconcile spans
//! stay in the logs.

use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState, TracerProvider,
};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::{filter_fn, FilterExt};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

pub use moor_csi::process::LogFormat;

/// The target of the spans that are exported.
pub const TARGET: &str = "moor::trace";

/// The exporter of a daemon's spans; [`Telemetry::shutdown`] sends what is buffered.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Exports what is buffered and stops (at exit).
    pub fn shutdown(self) {
        if let Some(p) = self.provider {
            if let Err(e) = p.shutdown() {
                tracing::warn!(error = %e, "exporting the last spans failed");
            }
        }
    }
}

/// Installs the subscriber: logs to stderr in `format` (filtered by `RUST_LOG`, default
/// `info`) and, with `otlp_endpoint` (e.g. `http://collector:4317`), the [`TARGET`]
/// spans exported over OTLP/gRPC as service `service`. Call once, inside the tokio
/// runtime, at the start of `main`.
pub fn init(
    format: LogFormat,
    otlp_endpoint: Option<&str>,
    service: &str,
) -> anyhow::Result<Telemetry> {
    // Trace spans repeat the reconcile span's fields: the logs leave them out.
    let filter = filter_fn(|meta| !(meta.is_span() && meta.target() == TARGET))
        .and(moor_csi::process::env_filter());
    let logs = moor_csi::process::log_layer(format).with_filter(filter);
    let provider = match otlp_endpoint {
        Some(endpoint) => {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint)
                .build()
                .map_err(|e| anyhow::anyhow!("OTLP exporter for {endpoint}: {e}"))?;
            let resource = opentelemetry_sdk::Resource::builder()
                .with_service_name(service.to_string())
                .build();
            Some(
                SdkTracerProvider::builder()
                    .with_batch_exporter(exporter)
                    .with_resource(resource)
                    .build(),
            )
        }
        None => None,
    };
    let traces = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("moor"))
            .with_filter(filter_fn(|meta| meta.target() == TARGET))
    });
    tracing_subscriber::registry()
        .with(logs)
        .with(traces)
        .try_init()
        .map_err(|e| anyhow::anyhow!("installing the log subscriber: {e}"))?;
    Ok(Telemetry { provider })
}

/// The W3C `traceparent` of `span` (`00-TRACE-SPAN-01`); `None` when spans are not
/// exported (no OpenTelemetry layer: nothing to join).
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| {
        format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        )
    })
}

/// Parses a W3C `traceparent`; `None` for anything else (stored values are untrusted).
fn parse(traceparent: &str) -> Option<SpanContext> {
    let mut parts = traceparent.split('-');
    let (Some("00"), Some(trace), Some(span), Some(flags), None) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return None;
    };
    if trace.len() != 32 || span.len() != 16 || flags.len() != 2 {
        return None;
    }
    let sc = SpanContext::new(
        TraceId::from_hex(trace).ok()?,
        SpanId::from_hex(span).ok()?,
        TraceFlags::new(u8::from_str_radix(flags, 16).ok()?),
        true,
        TraceState::default(),
    );
    sc.is_valid().then_some(sc)
}

/// The trace id of a stored `traceparent` (for `moorctl describe`); `None` when it is
/// not one.
pub fn trace_id(traceparent: &str) -> Option<String> {
    parse(traceparent).map(|sc| sc.trace_id().to_string())
}

/// Makes `span` a child of the stored `traceparent` (a claim's, its Attachment's or
/// Mount's), so it joins that trace; a missing or malformed one leaves it as it is.
/// Call before the span is entered.
pub fn join(span: &tracing::Span, traceparent: Option<&str>) {
    if let Some(sc) = traceparent.and_then(parse) {
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(sc));
    }
}

/// A span for one step of work on an object of a claim's trace: `name` (e.g. `claim`,
/// `node`, `attach`), the object's key, volume and node, joined to `traceparent`.
pub fn step_span(
    name: &'static str,
    key: &str,
    volume: &str,
    node: &str,
    traceparent: Option<&str>,
) -> tracing::Span {
    let span = tracing::info_span!(target: "moor::trace", "step", otel.name = name, object = key, volume, node);
    join(&span, traceparent);
    span
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_are_parsed_strictly() {
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(
            trace_id(good).as_deref(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        for bad in [
            "",
            "garbage",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-zz",
        ] {
            assert_eq!(trace_id(bad), None, "{bad}");
        }
    }
}
