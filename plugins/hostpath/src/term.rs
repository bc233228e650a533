//! The term a call was made under: moor names it in the `moor-term` gRPC header (a
//! leader's term, or a node registration's), and the call log records it, so the
//! checker can tell whether two holders of one role acted in overlapping terms.

use std::task::{Context, Poll};
use tonic::codegen::http;

tokio::task_local! {
    static TERM: Option<String>;
}

/// The term of the call being served (`None`: the caller named none).
pub fn current() -> Option<String> {
    TERM.try_with(|t| t.clone()).ok().flatten()
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
    type Future = tokio::task::futures::TaskLocalFuture<Option<String>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let term = req
            .headers()
            .get("moor-term")
            .and_then(|v| v.to_str().ok())
            // A caller's header is bounded before it reaches the log.
            .map(|v| v.chars().take(200).collect());
        TERM.scope(term, self.0.call(req))
    }
}
