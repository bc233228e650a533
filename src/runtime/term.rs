//! A term of authority that ends by this process's own clock.
//!
//! A leader, and an agent's registration, act for others only while they can prove
//! they still hold what entitles them: their last renewal that etcd applied, sent at
//! `t`, vouches for them until `t + TTL - margin`. Another process takes over (a
//! candidate, or the controller collecting a node) only after the record went
//! unrenewed for its whole TTL by *its* clock, counted from when it saw the renewal,
//! which is after `t`. So a holder that checks its [`Term`] right before each act
//! stops before anyone else can have started, whether it was cut off, paused or slow,
//! with `margin` left for the two clocks' drift and the act's own travel.
//!
//! The check is made at the last moment, by the CSI client before each try of a call
//! ([`crate::csi::client::Csi::under`]), not when a pass began: a process paused
//! (SIGSTOP) between the two wakes with its deadline passed and acts on nothing.

use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// The margin a holder keeps between its own deadline and its record's TTL: a fifth of
/// the TTL, at least 200 ms, at most half of it.
pub fn margin(ttl: Duration) -> Duration {
    (ttl / 5).max(Duration::from_millis(200)).min(ttl / 2)
}

/// Shared by the holder's renewal loop (which extends or ends it) and whatever acts
/// under it (which checks it). Starts not held. Its label is `ROLE/REVISION/HOLDER`:
/// the role that one holder at a time may act in (`plugin.X` for a plugin's election,
/// `node.N` for node N's registration), the etcd revision that began the term (the
/// election key's or the Node's creation: later terms have higher ones), and who holds
/// it. Every CSI call made under it carries the label as the `moor-term` gRPC header,
/// so a plugin's call log shows whether two terms of one role acted at once.
#[derive(Debug, Clone, Default)]
pub struct Term {
    deadline: Arc<Mutex<Option<Instant>>>,
    label: Arc<str>,
}

impl Term {
    /// A term not held yet, named `label`.
    pub fn new(label: impl Into<Arc<str>>) -> Term {
        Term {
            deadline: Default::default(),
            label: label.into(),
        }
    }

    /// The holder and term it names.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Held until `deadline` (a renewal sent at `sent` and applied: `sent + ttl -
    /// margin(ttl)`).
    pub fn hold_until(&self, deadline: Instant) {
        *self.lock() = Some(deadline);
    }

    /// Held after a renewal sent at `sent` with `ttl` was applied.
    pub fn renewed(&self, sent: Instant, ttl: Duration) {
        self.hold_until(sent + ttl - margin(ttl));
    }

    /// No longer held (lost, resigned, or a new term not yet begun).
    pub fn end(&self) {
        *self.lock() = None;
    }

    /// Whether the term is held now.
    pub fn held(&self) -> bool {
        self.deadline().is_some_and(|d| Instant::now() < d)
    }

    /// Until when it is held (`None`: not held).
    pub fn deadline(&self) -> Option<Instant> {
        *self.lock()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.deadline.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_term_ends_by_the_clock_unless_renewed() {
        let term = Term::default();
        assert!(!term.held(), "a term starts not held");
        let ttl = Duration::from_secs(3);
        term.renewed(Instant::now(), ttl);
        assert!(term.held());
        // 3 s - 600 ms margin.
        tokio::time::advance(Duration::from_millis(2_399)).await;
        assert!(term.held());
        tokio::time::advance(Duration::from_millis(2)).await;
        assert!(!term.held(), "past sent + ttl - margin");
        term.renewed(Instant::now(), ttl);
        assert!(term.held());
        term.end();
        assert!(!term.held());
    }

    #[test]
    fn the_margin_is_a_fifth_at_least_200_ms_at_most_half() {
        assert_eq!(margin(Duration::from_secs(10)), Duration::from_secs(2));
        assert_eq!(
            margin(Duration::from_millis(500)),
            Duration::from_millis(200)
        );
        assert_eq!(
            margin(Duration::from_millis(300)),
            Duration::from_millis(150)
        );
    }
}
