//! The term a call was made under: moor names it in the `moor-term` gRPC header (a
//! leader's term, or a node registration's), and the call log records it, so the
//! checker can tell whether two holders of one role acted in overlapping terms.

use std::task::{Context, Poll};
use tonic::codegen::http;

/// What the caller said of the call: its term, and when it sent it (Unix ms).
#[derive(Debug, Clone, Default)]
pub struct Named {
    /// The `moor-term` header.
    pub term: Option<String>,
    /// The `moor-sent` header.
    pub sent_ms: Option<u64>,
}

tokio::task_local! {
    static TERM: Named;
}

/// The term and send time of the call being served (empty: the caller named none).
pub fn current() -> Named {
    TERM.try_with(|t| t.clone()).unwrap_or_default()
}

/// Puts each request's `moor-term` header where [`current`] finds it while the call
/// is served.
#[derive(Debug, Clone, Copy)]
pub struct TermLayer;

impl<S> tower::Layer<S> for TermLayer {
    type Service = TermService<S>;

    fn layer(&self, inner: S) -> TermService<S> {
        TermService(inner)
    }
}

/// See [`TermLayer`].
#[derive(Debug, Clone)]
pub struct TermService<S>(S);

impl<S, B> tower::Service<http::Request<B>> for TermService<S>
where
    S: tower::Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = tokio::task::futures::TaskLocalFuture<Named, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok());
        let named = Named {
            // A caller's header is bounded before it reaches the log.
            term: header("moor-term").map(|v| v.chars().take(200).collect()),
            sent_ms: header("moor-sent").and_then(|v| v.parse().ok()),
        };
        TERM.scope(named, self.0.call(req))
    }
}
