//! The keyed work queue behind a controller.
//!
//! A key is pending at most once (a burst of triggers collapses to one run at the
//! earliest requested time) and never handed out while it is running: a key triggered
//! during its own run is held and handed out again when that run finishes. A key
//! scheduled as urgent is handed out before every due key that is not: a change an
//! operator is waiting on (an allocation stopped) does not queue behind the follow-up
//! work of a thousand others.
//!
//! A queue gives back what a burst grew it to once it has drained: a controller's
//! first pass queues every key it caches (100,000 claims), and the heaps and maps kept
//! that room for good otherwise.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use tokio::time::Instant;

type Heap = BinaryHeap<Reverse<(Instant, u64, String)>>;

/// Tables up to this many entries keep their room (shrinking them saves nothing).
const SHRINK_ABOVE: usize = 1024;

/// Pending keys by due time, and which keys are running.
#[derive(Debug, Default)]
pub struct Queue {
    /// Each pending key's due time, and whether it is urgent.
    pending: HashMap<String, (Instant, bool)>,
    heap: Heap,
    urgent: Heap,
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
        self.schedule_as(key, at, false);
    }

    /// [`Queue::schedule`], ahead of every key that is not urgent once due.
    pub fn schedule_urgent(&mut self, key: String, at: Instant) {
        self.schedule_as(key, at, true);
    }

    fn schedule_as(&mut self, key: String, at: Instant, urgent: bool) {
        let (at, urgent) = match self.pending.get(&key) {
            Some(&(t, u)) if t <= at && (u || !urgent) => return,
            Some(&(t, u)) => (t.min(at), u || urgent),
            None => (at, urgent),
        };
        self.pending.insert(key.clone(), (at, urgent));
        if !self.held.contains(&key) {
            self.push(key, at, urgent);
        }
    }

    fn push(&mut self, key: String, at: Instant, urgent: bool) {
        self.seq += 1;
        let heap = if urgent {
            &mut self.urgent
        } else {
            &mut self.heap
        };
        heap.push(Reverse((at, self.seq, key)));
    }

    /// Takes the next key due by `now` that is not running (urgent ones first), and
    /// marks it running.
    pub fn pop_ready(&mut self, now: Instant) -> Option<String> {
        loop {
            let due = |h: &Heap| h.peek().is_some_and(|Reverse((at, _, _))| *at <= now);
            let heap = if due(&self.urgent) {
                &mut self.urgent
            } else if due(&self.heap) {
                &mut self.heap
            } else {
                return None;
            };
            let Reverse((at, _, key)) = heap.pop()?;
            if self.pending.get(&key).map(|(t, _)| *t) != Some(at) {
                continue; // superseded by an earlier or urgent request
            }
            if self.running.contains(&key) {
                self.held.insert(key);
                continue;
            }
            self.pending.remove(&key);
            self.shrink();
            self.running.insert(key.clone());
            return Some(key);
        }
    }

    /// Marks a run of `key` finished; a request held during the run becomes due.
    pub fn finish(&mut self, key: &str) {
        self.running.remove(key);
        if self.held.remove(key) {
            if let Some((at, urgent)) = self.pending.get(key).copied() {
                self.push(key.to_string(), at, urgent);
            }
        }
    }

    /// When the earliest pending key is due (may be early; never late).
    pub fn next_due(&self) -> Option<Instant> {
        let top = |h: &Heap| h.peek().map(|Reverse((at, _, _))| *at);
        match (top(&self.heap), top(&self.urgent)) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Gives back the room a burst left once a table holds under a quarter of it.
    fn shrink(&mut self) {
        fn heap(h: &mut Heap) {
            if h.capacity() > SHRINK_ABOVE && h.len() < h.capacity() / 4 {
                h.shrink_to(h.len() * 2);
            }
        }
        heap(&mut self.heap);
        heap(&mut self.urgent);
        let pending = &mut self.pending;
        if pending.capacity() > SHRINK_ABOVE && pending.len() < pending.capacity() / 4 {
            pending.shrink_to(pending.len() * 2);
        }
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
    fn urgent_keys_go_first_once_due_and_stay_urgent_while_held() {
        let mut q = Queue::new();
        let now = Instant::now();
        for k in ["a", "b", "c"] {
            q.schedule(k.into(), now);
        }
        q.schedule_urgent("late".into(), now + Duration::from_secs(5));
        q.schedule_urgent("u".into(), now);
        // `c` was pending already: made urgent, it keeps its place among the urgent.
        q.schedule_urgent("c".into(), now);
        assert_eq!(q.depth(), 5);
        assert_eq!(q.pop_ready(now).as_deref(), Some("u"));
        assert_eq!(q.pop_ready(now).as_deref(), Some("c"));
        assert_eq!(q.pop_ready(now).as_deref(), Some("a"));
        // An urgent key triggered while it runs is held, and urgent when released.
        q.schedule_urgent("u".into(), now);
        q.finish("u");
        q.schedule("d".into(), now);
        assert_eq!(q.pop_ready(now).as_deref(), Some("u"));
        q.schedule_urgent("a".into(), now);
        assert_eq!(q.pop_ready(now).as_deref(), Some("b"), "a is running");
        q.finish("a");
        assert_eq!(q.pop_ready(now).as_deref(), Some("a"), "held, then first");
        assert_eq!(q.pop_ready(now).as_deref(), Some("d"));
        assert_eq!(q.pop_ready(now), None, "nothing left is due");
        assert_eq!(q.next_due(), Some(now + Duration::from_secs(5)));
        let later = now + Duration::from_secs(5);
        assert_eq!(q.pop_ready(later).as_deref(), Some("late"));
        assert_eq!(q.depth(), 0);
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

    #[test]
    fn a_drained_burst_gives_its_room_back() {
        let mut q = Queue::new();
        let now = Instant::now();
        for i in 0..100_000 {
            q.schedule(format!("k{i}"), now);
        }
        let grown = (q.heap.capacity(), q.pending.capacity());
        assert!(grown.0 >= 100_000 && grown.1 >= 100_000);
        let mut handed = 0;
        while let Some(k) = q.pop_ready(now) {
            q.finish(&k);
            handed += 1;
        }
        assert_eq!(handed, 100_000, "every key is still handed out once");
        assert!(
            q.heap.capacity() <= SHRINK_ABOVE * 2,
            "{}",
            q.heap.capacity()
        );
        assert!(
            q.pending.capacity() <= SHRINK_ABOVE * 2,
            "{}",
            q.pending.capacity()
        );
    }
}
