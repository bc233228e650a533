//! The keyed work queue behind a controller.
//!
//! A key is pending at most once (a burst of triggers collapses to one run at the
//! earliest requested time) and never handed out while it is running: a key triggered
//! during its own run is held and handed out again when that run finishes.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use tokio::time::Instant;

/// Pending keys by due time, and which keys are running.
#[derive(Debug, Default)]
pub struct Queue {
    pending: HashMap<String, Instant>,
    heap: BinaryHeap<Reverse<(Instant, u64, String)>>,
    seq: u64,
    running: HashSet<String>,
    held: HashSet<String>,
}

impl Queue {
    /// An empty queue.
    pub fn new() -> Queue {
        Queue::default()
    }

    /// Asks for `key` to run at `at`; an earlier request already pending wins.
    pub fn schedule(&mut self, key: String, at: Instant) {
        if self.pending.get(&key).is_some_and(|t| *t <= at) {
            return;
        }
        self.pending.insert(key.clone(), at);
        if !self.held.contains(&key) {
            self.push(key, at);
        }
    }

    fn push(&mut self, key: String, at: Instant) {
        self.seq += 1;
        self.heap.push(Reverse((at, self.seq, key)));
    }

    /// Takes the next key due by `now` that is not running, and marks it running.
    pub fn pop_ready(&mut self, now: Instant) -> Option<String> {
        while let Some(Reverse((at, _, _))) = self.heap.peek() {
            if *at > now {
                return None;
            }
            let Reverse((at, _, key)) = self.heap.pop()?;
            if self.pending.get(&key) != Some(&at) {
                continue; // superseded by an earlier request
            }
            if self.running.contains(&key) {
                self.held.insert(key);
                continue;
            }
            self.pending.remove(&key);
            self.running.insert(key.clone());
            return Some(key);
        }
        None
    }

    /// Marks a run of `key` finished; a request held during the run becomes due.
    pub fn finish(&mut self, key: &str) {
        self.running.remove(key);
        if self.held.remove(key) {
            if let Some(at) = self.pending.get(key).copied() {
                self.push(key.to_string(), at);
            }
        }
    }

    /// When the earliest pending key is due (may be early; never late).
    pub fn next_due(&self) -> Option<Instant> {
        self.heap.peek().map(|Reverse((at, _, _))| *at)
    }

    /// How many keys are waiting (due or not).
    pub fn depth(&self) -> usize {
        self.pending.len()
    }

    /// How many keys are running.
    pub fn running(&self) -> usize {
        self.running.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_burst_of_triggers_runs_once() {
        let mut q = Queue::new();
        let now = Instant::now();
        for _ in 0..100 {
            q.schedule("a".into(), now);
        }
        assert_eq!(q.depth(), 1);
        assert_eq!(q.pop_ready(now).as_deref(), Some("a"));
        assert_eq!(q.pop_ready(now), None);
    }

    #[test]
    fn the_earliest_request_wins() {
        let mut q = Queue::new();
        let now = Instant::now();
        q.schedule("a".into(), now + Duration::from_secs(30));
        q.schedule("a".into(), now + Duration::from_secs(1));
        q.schedule("a".into(), now + Duration::from_secs(10));
        assert_eq!(q.pop_ready(now), None);
        assert_eq!(q.next_due(), Some(now + Duration::from_secs(1)));
        assert_eq!(
            q.pop_ready(now + Duration::from_secs(1)).as_deref(),
            Some("a")
        );
        assert_eq!(
            q.pop_ready(now + Duration::from_secs(60)),
            None,
            "later requests were merged"
        );
    }

    #[test]
    fn a_running_key_is_held_until_it_finishes() {
        let mut q = Queue::new();
        let now = Instant::now();
        q.schedule("a".into(), now);
        assert_eq!(q.pop_ready(now).as_deref(), Some("a"));
        q.schedule("a".into(), now);
        q.schedule("b".into(), now);
        assert_eq!(q.pop_ready(now).as_deref(), Some("b"), "a is running");
        assert_eq!(q.pop_ready(now), None);
        q.finish("a");
        assert_eq!(q.pop_ready(now).as_deref(), Some("a"));
    }
}
