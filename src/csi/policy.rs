//! The CSI call policy: the one place that turns gRPC codes into what a reconciler does.
//!
//! Expected flow of [`Policy::call`]:
//! 1. Each try gets `per_try_timeout` (the gRPC deadline, and a local timer).
//! 2. Unavailable, ResourceExhausted, Aborted and DeadlineExceeded are retried after
//!    an exponential delay from `initial` (jittered), up to `tries` tries.
//! 3. Any other error, or the last retryable one, is returned as a [`CsiError`] whose
//!    [`Class`] says what the step is now: [`Class::Uncertain`] (it may have taken
//!    effect: the reverse is owed), [`Class::Transient`] (refused, no effect; try
//!    again) or [`Class::Final`] (no effect, and repeating it will not help). NotFound
//!    is Final for a forward step; for a reverse step (unpublish, unstage, delete) the
//!    typed client counts it as done ([`CsiError::is_not_found`]).
//!
//! Every try is measured in `moor_csi_call_duration_seconds{rpc, code}`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::future::Future;
use std::time::{Duration, Instant};
use tonic::{Code, Status};

use crate::backoff::Backoff;
use crate::runtime::term::Term;

/// How CSI calls are retried.
#[derive(Debug, Clone)]
pub struct Policy {
    /// The first retry delay.
    pub initial: Duration,
    /// The longest retry delay.
    pub max_delay: Duration,
    /// Tries per call, the first included.
    pub tries: u32,
    /// Deadline of each try.
    pub per_try_timeout: Duration,
    /// Call durations by RPC and code.
    pub metrics: CsiMetrics,
}

impl Policy {
    /// This policy for the calls of plugin `id` (its metrics carry the plugin label).
    pub fn for_plugin(&self, id: &str) -> Policy {
        Policy {
            metrics: self.metrics.for_plugin(id),
            ..self.clone()
        }
    }
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            initial: Duration::from_millis(100),
            max_delay: Duration::from_secs(5),
            tries: 5,
            per_try_timeout: Duration::from_secs(120),
            metrics: CsiMetrics::unregistered(),
        }
    }
}

/// What a failed call means for the step it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Timed out, cut off, unreachable or failed inside the plugin (DeadlineExceeded,
    /// Cancelled, Unavailable, Unknown, Internal, DataLoss): it may have taken effect,
    /// so its reverse is owed on release. Retried.
    Uncertain,
    /// A transient refusal that took no effect (ResourceExhausted, Aborted). Retried.
    /// Unavailable is not here: a plugin that dies mid-call answers it too, so it is
    /// [`Class::Uncertain`].
    Transient,
    /// A final answer (InvalidArgument, FailedPrecondition, NotFound, ...): the call
    /// took no effect and will not by repeating it; needs attention.
    Final,
}

/// A CSI call that did not succeed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{rpc} failed with {code:?} after {tries} tries: {message}")]
pub struct CsiError {
    /// The RPC, e.g. `NodeStageVolume`.
    pub rpc: &'static str,
    /// The last gRPC code.
    pub code: Code,
    /// The plugin's message (plugins must not put secrets in it; we do not add any).
    pub message: String,
    /// How many tries were made.
    pub tries: u32,
}

impl CsiError {
    /// A call stopped before its first try because its term lapsed: Aborted (nothing
    /// was sent, so the step took no effect). A term that lapses between tries leaves
    /// the call with the last try's answer instead.
    pub fn not_sent(rpc: &'static str, why: String) -> CsiError {
        CsiError {
            rpc,
            code: Code::Aborted,
            message: format!("not sent: {why}"),
            tries: 0,
        }
    }

    /// Whether the call's term stopped it before its first try: nothing was sent.
    pub fn is_not_sent(&self) -> bool {
        self.tries == 0 && self.code == Code::Aborted
    }

    /// What the failure means for the step.
    pub fn class(&self) -> Class {
        classify(self.code)
    }

    /// Whether the call may have taken effect.
    pub fn is_uncertain(&self) -> bool {
        self.class() == Class::Uncertain
    }

    /// Whether the answer is NotFound (an unpublish or unstage of something gone is
    /// already done).
    pub fn is_not_found(&self) -> bool {
        self.code == Code::NotFound
    }
}

/// The class of a gRPC code.
pub fn classify(code: Code) -> Class {
    match code {
        Code::DeadlineExceeded
        | Code::Cancelled
        | Code::Unknown
        | Code::Internal
        | Code::DataLoss => Class::Uncertain,
        // Unavailable is usually "not reached", but a plugin dying mid-call answers it
        // too: count it as uncertain, which only costs an idempotent reverse call.
        Code::Unavailable => Class::Uncertain,
        Code::ResourceExhausted | Code::Aborted => Class::Transient,
        _ => Class::Final,
    }
}

fn retryable(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable | Code::ResourceExhausted | Code::Aborted | Code::DeadlineExceeded
    )
}

impl Policy {
    /// Runs `attempt` (which sends one request with the deadline it is given) under the
    /// policy.
    pub async fn call<T, F, Fut>(&self, rpc: &'static str, attempt: F) -> Result<T, CsiError>
    where
        F: FnMut(Duration) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        self.call_gated(rpc, None, attempt).await
    }

    /// [`Policy::call`] under `term`: each try is sent only while the term is held;
    /// once it lapsed the call fails with [`CsiError::not_sent`] (before the first
    /// try) or with the last try's answer.
    pub async fn call_gated<T, F, Fut>(
        &self,
        rpc: &'static str,
        term: Option<&Term>,
        mut attempt: F,
    ) -> Result<T, CsiError>
    where
        F: FnMut(Duration) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let mut backoff = Backoff::new(self.initial, self.max_delay);
        let tries = self.tries.max(1);
        let mut tried = 0;
        let closed = || {
            term.filter(|t| !t.held())
                .map(|t| format!("term {} lapsed", t.label()))
        };
        if let Some(why) = closed() {
            return Err(CsiError::not_sent(rpc, why));
        }
        loop {
            tried += 1;
            let started = Instant::now();
            let result =
                match tokio::time::timeout(self.per_try_timeout, attempt(self.per_try_timeout))
                    .await
                {
                    Ok(r) => r,
                    Err(_) => Err(Status::deadline_exceeded(format!(
                        "no answer within {:?}",
                        self.per_try_timeout
                    ))),
                };
            let code = match &result {
                Ok(_) => Code::Ok,
                Err(s) => s.code(),
            };
            self.metrics.observe(rpc, code, started.elapsed());
            match result {
                Ok(resp) => return Ok(resp.into_inner()),
                Err(status) => {
                    let mut message = status.message().to_string();
                    if retryable(status.code()) && tried < tries {
                        let delay = backoff.next_delay();
                        tracing::debug!(rpc, code = ?status.code(), ?delay, "retrying CSI call");
                        tokio::time::sleep(delay).await;
                        // A gate closed meanwhile: the answer is the last try's (an
                        // uncertain one stays uncertain), and no further try is sent.
                        match closed() {
                            None => continue,
                            Some(why) => message = format!("{message}; then not sent: {why}"),
                        }
                    }
                    return Err(CsiError {
                        rpc,
                        code: status.code(),
                        message,
                        tries: tried,
                    });
                }
            }
        }
    }
}

/// Builds a request with its gRPC deadline.
pub fn request<T>(msg: T, timeout: Duration) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    req.set_timeout(timeout);
    req
}

/// Labels of a CSI call measurement.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabel {
    /// The plugin id (empty for a client not bound to one).
    pub plugin: String,
    /// The RPC.
    pub rpc: String,
    /// The gRPC code (`Ok`, `NotFound`, ...).
    pub code: String,
}

fn call_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 18))
}

/// The CSI call duration family.
#[derive(Clone)]
pub struct CsiMetrics {
    durations: Family<CallLabel, Histogram, fn() -> Histogram>,
    plugin: std::sync::Arc<str>,
}

impl CsiMetrics {
    /// Registers the family in `registry`.
    pub fn register(registry: &mut Registry) -> CsiMetrics {
        let m = CsiMetrics::unregistered();
        registry.register(
            "moor_csi_call_duration_seconds",
            "CSI calls by RPC and answer",
            m.durations.clone(),
        );
        m
    }

    /// Handles that record into no registry.
    pub fn unregistered() -> CsiMetrics {
        CsiMetrics {
            durations: Family::new_with_constructor(call_histogram),
            plugin: std::sync::Arc::from(""),
        }
    }

    /// The same family, labelling calls with plugin `id`.
    pub fn for_plugin(&self, id: &str) -> CsiMetrics {
        CsiMetrics {
            durations: self.durations.clone(),
            plugin: std::sync::Arc::from(id),
        }
    }

    fn observe(&self, rpc: &str, code: Code, took: Duration) {
        self.durations
            .get_or_create(&CallLabel {
                plugin: self.plugin.to_string(),
                rpc: rpc.to_string(),
                code: format!("{code:?}"),
            })
            .observe(took.as_secs_f64());
    }
}

impl std::fmt::Debug for CsiMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CsiMetrics")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn quick() -> Policy {
        Policy {
            initial: Duration::from_millis(1),
            max_delay: Duration::from_millis(2),
            tries: 3,
            per_try_timeout: Duration::from_millis(50),
            metrics: CsiMetrics::unregistered(),
        }
    }

    #[tokio::test]
    async fn transient_errors_are_retried_until_success() {
        let n = AtomicU32::new(0);
        let r = quick()
            .call("NodeStageVolume", |_| {
                let i = n.fetch_add(1, Ordering::SeqCst);
                async move {
                    if i < 2 {
                        Err(Status::unavailable("not yet"))
                    } else {
                        Ok(tonic::Response::new(7))
                    }
                }
            })
            .await;
        assert_eq!(r.unwrap(), 7);
        assert_eq!(n.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn final_errors_are_not_retried_and_not_uncertain() {
        let n = AtomicU32::new(0);
        let e = quick()
            .call("NodeStageVolume", |_| {
                n.fetch_add(1, Ordering::SeqCst);
                async { Err::<tonic::Response<()>, _>(Status::invalid_argument("bad")) }
            })
            .await
            .unwrap_err();
        assert_eq!(n.load(Ordering::SeqCst), 1);
        assert_eq!(e.class(), Class::Final);
        assert!(!e.is_uncertain());
    }

    #[tokio::test]
    async fn a_hung_call_times_out_as_uncertain_after_bounded_tries() {
        let n = AtomicU32::new(0);
        let e = quick()
            .call("NodeStageVolume", |_| {
                n.fetch_add(1, Ordering::SeqCst);
                std::future::pending::<Result<tonic::Response<()>, Status>>()
            })
            .await
            .unwrap_err();
        assert_eq!(n.load(Ordering::SeqCst), 3);
        assert_eq!(e.code, Code::DeadlineExceeded);
        assert!(e.is_uncertain());
    }

    #[tokio::test]
    async fn a_closed_gate_sends_nothing_and_the_call_took_no_effect() {
        let n = AtomicU32::new(0);
        let term = Term::new("t1");
        let e = quick()
            .call_gated("NodeStageVolume", Some(&term), |_| {
                n.fetch_add(1, Ordering::SeqCst);
                async { Ok(tonic::Response::new(())) }
            })
            .await
            .unwrap_err();
        assert_eq!(n.load(Ordering::SeqCst), 0, "nothing sent");
        assert!(e.is_not_sent());
        assert_eq!(e.class(), Class::Transient);
        assert!(e.message.contains("term t1 lapsed"), "{}", e.message);
    }

    #[tokio::test]
    async fn a_gate_that_closes_between_tries_leaves_the_last_answer() {
        let n = AtomicU32::new(0);
        let term = Term::new("t1");
        term.hold_until(tokio::time::Instant::now() + Duration::from_secs(60));
        let e = quick()
            .call_gated("NodeStageVolume", Some(&term), |_| {
                n.fetch_add(1, Ordering::SeqCst);
                term.end();
                std::future::pending::<Result<tonic::Response<()>, Status>>()
            })
            .await
            .unwrap_err();
        assert_eq!(
            n.load(Ordering::SeqCst),
            1,
            "one try, none after the gate closed"
        );
        assert!(
            e.is_uncertain(),
            "the timed-out try may have taken effect: {e}"
        );
        assert!(!e.is_not_sent());
        assert!(
            e.message.contains("then not sent: term t1 lapsed"),
            "{}",
            e.message
        );
    }
}
