//! A failure that repeats is logged once: the first time it is seen (and whenever it
//! changes) at warn, each repeat at debug, until a success clears it. A refusal etcd
//! gives every time (a permission a role lacks) then costs one log line, not one per
//! retry, while the retry itself stays on its backoff.

/// The failure last logged at warn.
#[derive(Debug, Default)]
pub struct Repeats {
    last: Option<String>,
}

impl Repeats {
    /// Whether `failure` is news (log it at warn) rather than the one last logged.
    pub fn is_new(&mut self, failure: &str) -> bool {
        if self.last.as_deref() == Some(failure) {
            return false;
        }
        self.last = Some(failure.to_string());
        true
    }

    /// A success: the next failure is news again.
    pub fn clear(&mut self) {
        self.last = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_failure_is_news_once_until_cleared_or_changed() {
        let mut r = Repeats::default();
        assert!(r.is_new("permission denied"));
        assert!(!r.is_new("permission denied"));
        assert!(r.is_new("unavailable"));
        assert!(r.is_new("permission denied"));
        r.clear();
        assert!(r.is_new("permission denied"));
    }
}
