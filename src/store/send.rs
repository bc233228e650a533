//! Sending a request to etcd again when the member the client picked could not be
//! reached. With several endpoints the client balances requests over all of them, so
//! while a member is down some requests still go to it and fail to connect; a request
//! that never left this process cannot have been applied, and another attempt lands on
//! a live member. A read is safe to repeat after any transport failure.

use crate::backoff::Backoff;
use std::future::Future;
use std::time::Duration;

use etcd_client::Client;

use super::Store;

/// Attempts after the first. The client picks a member at random for each attempt, so
/// with one of three members down, ten more attempts all failing is a one in 177,000
/// chance.
const RETRIES: u32 = 10;

/// Whether a request is repeatable after a transport failure that may have reached etcd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Repeat {
    /// Reads: repeat after any transport failure.
    Idempotent,
    /// Writes: repeat only when the request never reached a member.
    OnlyUnsent,
}

/// Whether the request failed at the transport, and whether it certainly never reached
/// a member (the connection could not be made). tonic reports a connection that closed
/// under a request in flight (a member killed mid-request) as CANCELLED: this process
/// cancels no request it still waits for, so that code is a transport failure too.
fn failure(e: &etcd_client::Error) -> Option<bool> {
    use etcd_client::Error as E;
    let status = match e {
        E::GRpcStatus(s)
            if matches!(
                s.code(),
                tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::DeadlineExceeded
            ) =>
        {
            s
        }
        // What tonic answers when a connection fails under a request in a way it does
        // not map to a code (a reset by a member that just died: "transport error"):
        // a failure of the connection, not an answer of etcd's.
        E::GRpcStatus(s) if s.code() == tonic::Code::Unknown && io_failure(s) => s,
        E::TransportError(_) | E::IoError(_) => return Some(connect_refused(e)),
        _ => return None,
    };
    // A member without a leader refuses a request that requires one (as every request
    // of ours does) before it proposes anything: not applied.
    let unsent = status.message().contains("connect error")
        || status.message().contains("etcdserver: no leader")
        || connect_refused(status);
    Some(unsent)
}

/// The I/O errors in `e`'s source chain, itself included.
fn io_errors<'a>(
    e: &'a (dyn std::error::Error + 'static),
) -> impl Iterator<Item = &'a std::io::Error> {
    std::iter::successors(Some(e), |err| err.source())
        .filter_map(|err| err.downcast_ref::<std::io::Error>())
}

/// Whether the error's source chain holds an I/O error (of the connection).
fn io_failure(e: &(dyn std::error::Error + 'static)) -> bool {
    io_errors(e).next().is_some()
}

/// Whether the error's source chain holds a failed connection attempt.
fn connect_refused(e: &(dyn std::error::Error + 'static)) -> bool {
    use std::io::ErrorKind as K;
    io_errors(e).any(|io| {
        matches!(
            io.kind(),
            K::ConnectionRefused | K::HostUnreachable | K::NetworkUnreachable
        )
    })
}

impl Store {
    /// Runs `call` on the client, again (up to [`RETRIES`] times, backing off from
    /// 5 ms) while it fails in a way `repeat` allows, all within the store's deadline
    /// ([`Store::with_deadline`]). A read's attempt gets half of it (at least a
    /// second): one that a paused member never answers is sent again and may land on
    /// another member. A write's gets all of it (a slow fsync under load is not a
    /// paused member): one never answered may have been applied, so it fails as
    /// unavailable (its outcome unknown) for the caller to read again.
    pub(crate) async fn send<T, F, Fut>(
        &self,
        repeat: Repeat,
        mut call: F,
    ) -> Result<T, etcd_client::Error>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let start = tokio::time::Instant::now();
        let end = start + self.deadline();
        let per_attempt = match repeat {
            Repeat::Idempotent => (self.deadline() / 2).max(Duration::from_secs(1)),
            Repeat::OnlyUnsent => self.deadline(),
        };
        let mut backoff = Backoff::new(Duration::from_millis(5), Duration::from_millis(200));
        let mut attempt = 0;
        loop {
            let bound = end.min(tokio::time::Instant::now() + per_attempt);
            let outcome = match tokio::time::timeout_at(bound, call(self.client())).await {
                Ok(outcome) => outcome,
                Err(_) => Err(no_answer(start.elapsed())),
            };
            match outcome {
                Err(e)
                    if attempt < RETRIES
                        && retryable(&e, repeat)
                        && tokio::time::Instant::now() < end =>
                {
                    tracing::debug!(error = %e, attempt, "etcd request failed, sending it again");
                    tokio::time::sleep(backoff.next_delay()).await;
                    attempt += 1;
                }
                other => return other,
            }
        }
    }
}

/// The error of a request etcd did not answer in time: DEADLINE_EXCEEDED (unavailable,
/// outcome unknown), naming how long it waited.
pub(crate) fn no_answer(waited: Duration) -> etcd_client::Error {
    // Whole seconds past one (the bound a person set), milliseconds below.
    let waited = if waited >= Duration::from_secs(1) {
        Duration::from_secs(waited.as_secs())
    } else {
        Duration::from_millis(waited.as_millis() as u64)
    };
    etcd_client::Error::GRpcStatus(tonic::Status::deadline_exceeded(format!(
        "etcd did not answer within {}",
        humantime::format_duration(waited)
    )))
}

fn retryable(e: &etcd_client::Error, repeat: Repeat) -> bool {
    match failure(e) {
        None => false,
        Some(unsent) => unsent || repeat == Repeat::Idempotent,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused() -> etcd_client::Error {
        let io = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let mut status = tonic::Status::unavailable("transport failure");
        status.set_source(std::sync::Arc::new(io));
        etcd_client::Error::GRpcStatus(status)
    }

    #[test]
    fn a_refused_connection_is_repeatable_even_for_writes() {
        assert_eq!(failure(&refused()), Some(true));
        assert!(retryable(&refused(), Repeat::OnlyUnsent));
    }

    #[test]
    fn a_failure_after_sending_is_repeated_only_for_reads() {
        let sent = etcd_client::Error::GRpcStatus(tonic::Status::unavailable("transport error"));
        assert_eq!(failure(&sent), Some(false));
        assert!(retryable(&sent, Repeat::Idempotent));
        assert!(!retryable(&sent, Repeat::OnlyUnsent));
    }

    #[test]
    fn a_connection_reset_under_a_request_is_repeated_only_for_reads() {
        // What tonic 0.14 answers when a member dies under a request (seen in the
        // fresh-clone run of ae5d900: a read failed where it should have been resent).
        let io = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        let mut reset = tonic::Status::unknown("transport error");
        reset.set_source(std::sync::Arc::new(io));
        let reset = etcd_client::Error::GRpcStatus(reset);
        assert_eq!(failure(&reset), Some(false));
        assert!(retryable(&reset, Repeat::Idempotent));
        assert!(!retryable(&reset, Repeat::OnlyUnsent));
        // etcd's own Unknown (no connection failure under it) is its answer.
        let answered = etcd_client::Error::GRpcStatus(tonic::Status::unknown("etcdserver: x"));
        assert_eq!(failure(&answered), None);
    }

    #[test]
    fn a_connection_closed_under_a_request_is_repeated_only_for_reads() {
        // What tonic answers when the member dies with the request in flight.
        let closed =
            etcd_client::Error::GRpcStatus(tonic::Status::cancelled("operation was canceled"));
        assert_eq!(failure(&closed), Some(false));
        assert!(retryable(&closed, Repeat::Idempotent));
        assert!(!retryable(&closed, Repeat::OnlyUnsent));
    }

    #[test]
    fn a_member_without_a_leader_refused_the_request_so_writes_repeat_too() {
        let refused =
            etcd_client::Error::GRpcStatus(tonic::Status::unavailable("etcdserver: no leader"));
        assert_eq!(failure(&refused), Some(true));
        assert!(retryable(&refused, Repeat::OnlyUnsent));
    }

    #[test]
    fn an_answer_from_etcd_is_never_repeated() {
        let answer = etcd_client::Error::GRpcStatus(tonic::Status::failed_precondition("nope"));
        assert_eq!(failure(&answer), None);
        assert!(!retryable(&answer, Repeat::Idempotent));
    }
}
