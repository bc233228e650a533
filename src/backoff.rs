//! Exponential backoff with jitter, and a stream adaptor that waits after each error.

use futures::{Stream, StreamExt};
use std::time::Duration;

/// Exponential backoff: `initial`, then ×`factor` per failure up to `max`, with "equal
/// jitter" (each delay drawn from its upper half) so retries do not march in step.
#[derive(Debug, Clone)]
pub struct Backoff {
    /// First delay.
    pub initial: Duration,
    /// Largest delay.
    pub max: Duration,
    /// Growth per failure.
    pub factor: f64,
    /// Whether to randomise each delay within its upper half.
    pub jitter: bool,
    current: Option<Duration>,
}

impl Backoff {
    /// A backoff from `initial` doubling to `max`, jittered.
    pub fn new(initial: Duration, max: Duration) -> Backoff {
        Backoff {
            initial,
            max,
            factor: 2.0,
            jitter: true,
            current: None,
        }
    }

    /// Turns jitter off (for deterministic tests).
    pub fn without_jitter(mut self) -> Backoff {
        self.jitter = false;
        self
    }

    /// The un-jittered delay after `failures` consecutive failures (1 = the first).
    pub fn base_delay(&self, failures: u32) -> Duration {
        let exp = self.factor.powi(failures.saturating_sub(1).min(64) as i32);
        let secs = (self.initial.as_secs_f64() * exp).min(self.max.as_secs_f64());
        Duration::from_secs_f64(secs)
    }

    /// The delay after `failures` consecutive failures, jittered if enabled.
    pub fn delay(&self, failures: u32) -> Duration {
        let base = self.base_delay(failures);
        if self.jitter {
            base.mul_f64(0.5 + fastrand::f64() / 2.0)
        } else {
            base
        }
    }

    /// The next delay of a running sequence.
    pub fn next_delay(&mut self) -> Duration {
        let next = match self.current {
            None => self.initial,
            Some(c) => c.mul_f64(self.factor).min(self.max),
        };
        self.current = Some(next);
        if self.jitter {
            next.mul_f64(0.5 + fastrand::f64() / 2.0)
        } else {
            next
        }
    }

    /// Starts the sequence again (after a success).
    pub fn reset(&mut self) {
        self.current = None;
    }
}

impl Default for Backoff {
    /// 200 ms doubling to 30 s.
    fn default() -> Self {
        Backoff::new(Duration::from_millis(200), Duration::from_secs(30))
    }
}

/// Wraps a fallible stream so that after each error it waits a backoff delay before
/// polling again; a success resets the delay. The errors are still yielded.
pub fn backoff<S, T, E>(stream: S, backoff: Backoff) -> impl Stream<Item = Result<T, E>> + Send
where
    S: Stream<Item = Result<T, E>> + Send + 'static,
    T: Send + 'static,
    E: Send + 'static,
{
    futures::stream::unfold(
        (stream.boxed(), backoff, None::<Duration>),
        |(mut inner, mut b, wait)| async move {
            if let Some(d) = wait {
                tokio::time::sleep(d).await;
            }
            let item = inner.next().await?;
            let wait = match &item {
                Ok(_) => {
                    b.reset();
                    None
                }
                Err(_) => Some(b.next_delay()),
            };
            Some((item, (inner, b, wait)))
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::Instant;

    #[test]
    fn delays_grow_to_the_cap_and_reset() {
        let mut b =
            Backoff::new(Duration::from_millis(100), Duration::from_millis(500)).without_jitter();
        let got: Vec<u128> = (0..5).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(got, [100, 200, 400, 500, 500]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(100));
        assert_eq!(b.base_delay(1), Duration::from_millis(100));
        assert_eq!(b.base_delay(3), Duration::from_millis(400));
        assert_eq!(b.base_delay(1000), Duration::from_millis(500));
    }

    #[test]
    fn jitter_stays_in_the_upper_half() {
        let b = Backoff::new(Duration::from_secs(1), Duration::from_secs(10));
        for _ in 0..100 {
            let d = b.delay(2);
            assert!(
                d >= Duration::from_secs(1) && d <= Duration::from_secs(2),
                "{d:?}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn adaptor_waits_after_errors_only() {
        let items: Vec<Result<u32, &str>> = vec![Ok(1), Err("a"), Err("b"), Ok(2), Ok(3)];
        let b = Backoff::new(Duration::from_secs(1), Duration::from_secs(60)).without_jitter();
        let start = Instant::now();
        let mut s = Box::pin(backoff(futures::stream::iter(items), b));
        let mut seen = Vec::new();
        while let Some(item) = s.next().await {
            seen.push((item, start.elapsed().as_secs()));
        }
        assert_eq!(
            seen,
            vec![
                (Ok(1), 0),
                (Err("a"), 0),
                (Err("b"), 1),
                (Ok(2), 3),
                (Ok(3), 3)
            ]
        );
    }
}
