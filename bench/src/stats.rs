//! Percentiles of latency samples.

use std::time::Duration;

/// p50, p99 and max of a set of samples, in milliseconds.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Percentiles {
    /// Samples.
    pub n: usize,
    /// Median.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Largest.
    pub max_ms: f64,
}

impl Percentiles {
    /// Of `samples` (sorted in place); all zero when empty.
    pub fn of(samples: &mut [Duration]) -> Percentiles {
        if samples.is_empty() {
            return Percentiles::default();
        }
        samples.sort();
        let at = |q: f64| {
            let i = ((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len()) - 1;
            samples[i].as_secs_f64() * 1000.0
        };
        Percentiles {
            n: samples.len(),
            p50_ms: at(0.50),
            p99_ms: at(0.99),
            max_ms: at(1.0),
        }
    }

    /// `p50 / p99 ms (n)`, or `n/a`.
    pub fn cell(&self) -> String {
        if self.n == 0 {
            "n/a".into()
        } else {
            format!("{:.1} / {:.1} ms (n={})", self.p50_ms, self.p99_ms, self.n)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_pick_the_right_samples() {
        let mut s: Vec<Duration> = (1..=100).rev().map(Duration::from_millis).collect();
        let p = Percentiles::of(&mut s);
        assert_eq!(
            (p.n, p.p50_ms, p.p99_ms, p.max_ms),
            (100, 50.0, 99.0, 100.0)
        );
        assert_eq!(Percentiles::of(&mut []).n, 0);
    }
}
