//! The keyed work queue behind a controller.
//!
//! A key is pending at most once (a burst of triggers collapses to one run at the
//! earliest requested time) and never handed out while it is running: a key triggered
//! during its own run is held and handed out again when that run finishes. A key
//! scheduled as urgent is handed out before every due key that is not: a change an
//! operator is waiting on (an allocation stopped) does not queue behind the follow-up
//! work of a thousand others. A key scheduled for repair (a relist's or a resync's
//! pass over objects whose status says they are converged) is handed out only when no
//! other key is due: a controller's start or resync serves live changes first and does
//! its repair pass behind them.
//!
//! A queue gives back what a burst grew it to once it has drained: a controller's
//! first pass queues every key it caches (100,000 claims), and the heaps and maps kept
//! that room for good otherwise.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use tokio::time::Instant;

type Heap = BinaryHeap<Reverse<(Instant, u64, String)>>;

/// How soon a due key is handed out, relative to the other due keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Class {
    /// Behind every other due key: a repair pass (relist, resync) over objects that
    /// look converged.
    Repair,
    /// A change.
    Normal,
    /// Ahead of every other due key: a change an operator waits on.
    Urgent,
}

/// While repairs are due, one key in this many handed out is a repair (the rest are
/// changes, while any is due).
pub const REPAIR_EVERY: u32 = 8;

/// Tables up to this many entries keep their room (shrinking them saves nothing).
const SHRINK_ABOVE: usize = 1024;

/// Pending keys by due time, and which keys are running.
#[derive(Debug, Default)]
pub struct Queue {
    /// Each pending key's due time and class.
    pending: HashMap<String, (Instant, Class)>,
    /// One heap per class, by [`Class`] order.
    heaps: [Heap; 3],
    /// Pending keys of class [`Class::Repair`].
    repairs: usize,
    /// Keys handed out in a row while a repair was due: one repair in every
    /// [`REPAIR_EVERY`] goes ahead, so a busy controller still finishes its pass.
    streak: u32,
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
        self.schedule_as(key, at, Class::Normal);
    }

    /// [`Queue::schedule`], ahead of every key that is not urgent once due.
    pub fn schedule_urgent(&mut self, key: String, at: Instant) {
        self.schedule_as(key, at, Class::Urgent);
    }

    /// Asks for `key` to run at `at` in `class`: a key pending already keeps the
    /// earlier time and the higher class of the two requests.
    pub fn schedule_as(&mut self, key: String, at: Instant, class: Class) {
        let (at, class) = match self.pending.get(&key) {
            Some(&(t, c)) if t <= at && c >= class => return,
            Some(&(t, c)) => (t.min(at), c.max(class)),
            None => (at, class),
        };
        if let Some((_, was)) = self.pending.insert(key.clone(), (at, class)) {
            self.repairs -= usize::from(was == Class::Repair);
        }
        self.repairs += usize::from(class == Class::Repair);
        if !self.held.contains(&key) {
            self.push(key, at, class);
        }
    }

    fn push(&mut self, key: String, at: Instant, class: Class) {
        self.seq += 1;
        self.heaps[class as usize].push(Reverse((at, self.seq, key)));
    }

    /// Takes the next key due by `now` that is not running (urgent ones first, repairs
    /// last), and marks it running.
    pub fn pop_ready(&mut self, now: Instant) -> Option<String> {
        loop {
            let due = |h: &Heap| h.peek().is_some_and(|Reverse((at, _, _))| *at <= now);
            let repair_due = due(&self.heaps[Class::Repair as usize]);
            let class = if repair_due && self.streak + 1 >= REPAIR_EVERY {
                Class::Repair
            } else {
                [Class::Urgent, Class::Normal, Class::Repair]
                    .into_iter()
                    .find(|c| due(&self.heaps[*c as usize]))?
            };
            let Reverse((at, _, key)) = self.heaps[class as usize].pop()?;
            if self.pending.get(&key) != Some(&(at, class)) {
                continue; // superseded by an earlier or higher request
            }
            if self.running.contains(&key) {
                self.held.insert(key);
                continue;
            }
            self.pending.remove(&key);
            self.repairs -= usize::from(class == Class::Repair);
            self.streak = match class {
                Class::Repair => 0,
                _ if repair_due => self.streak + 1,
                _ => 0,
            };
            self.shrink();
            self.running.insert(key.clone());
            return Some(key);
        }
    }

    /// Marks a run of `key` finished; a request held during the run becomes due.
    pub fn finish(&mut self, key: &str) {
        self.running.remove(key);
        if self.held.remove(key) {
            if let Some((at, class)) = self.pending.get(key).copied() {
                self.push(key.to_string(), at, class);
            }
        }
    }

    /// When the earliest pending key is due (may be early; never late).
    pub fn next_due(&self) -> Option<Instant> {
        self.heaps
            .iter()
            .filter_map(|h| h.peek().map(|Reverse((at, _, _))| *at))
            .min()
    }

    /// Gives back the room a burst left once a table holds under a quarter of it.
    fn shrink(&mut self) {
        fn heap(h: &mut Heap) {
            if h.capacity() > SHRINK_ABOVE && h.len() < h.capacity() / 4 {
                h.shrink_to(h.len() * 2);
            }
        }
        self.heaps.iter_mut().for_each(heap);
        let pending = &mut self.pending;
        if pending.capacity() > SHRINK_ABOVE && pending.len() < pending.capacity() / 4 {
            pending.shrink_to(pending.len() * 2);
        }
    }

    /// How many keys are waiting (due or not).
    pub fn depth(&self) -> usize {
        self.pending.len()
    }

    /// Since when the longest-due change (a key that is not a repair) has been due by
    /// `now`, if one is (read from the heaps' tops: a superseded entry is dropped by
    /// the next [`Queue::pop_ready`], so right after one this is exact).
    pub fn change_due_since(&self, now: Instant) -> Option<Instant> {
        [Class::Urgent, Class::Normal]
            .iter()
            .filter_map(|c| self.heaps[*c as usize].peek())
            .map(|Reverse((at, _, _))| *at)
            .filter(|at| *at <= now)
            .min()
    }

    /// How many of the waiting keys are [`Class::Repair`]'s.
    pub fn repairs(&self) -> usize {
        self.repairs
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
    fn repairs_go_last_and_a_change_lifts_a_repair_key() {
        let mut q = Queue::new();
        let now = Instant::now();
        for k in ["r1", "r2", "r3"] {
            q.schedule_as(k.into(), now, Class::Repair);
        }
        q.schedule("a".into(), now + Duration::from_millis(1));
        assert_eq!((q.depth(), q.repairs()), (4, 3));
        assert_eq!(q.change_due_since(now), None, "a is not due yet");
        assert_eq!(
            q.pop_ready(now).as_deref(),
            Some("r1"),
            "nothing else is due"
        );
        let later = now + Duration::from_millis(1);
        assert_eq!(q.change_due_since(later), Some(later));
        assert_eq!(q.pop_ready(later).as_deref(), Some("a"), "a change first");
        assert_eq!(q.change_due_since(later), None, "only repairs are due");
        // A change to a key waiting for repair makes it a change, at its place.
        q.schedule("r3".into(), later);
        q.schedule("b".into(), later);
        assert_eq!(q.repairs(), 1);
        assert_eq!(q.pop_ready(later).as_deref(), Some("r3"));
        assert_eq!(q.pop_ready(later).as_deref(), Some("b"));
        // A repair request does not lower a pending change.
        q.schedule("c".into(), later);
        q.schedule_as("c".into(), now, Class::Repair);
        assert_eq!(q.repairs(), 1);
        assert_eq!(q.pop_ready(later).as_deref(), Some("c"), "still a change");
        assert_eq!(q.pop_ready(later).as_deref(), Some("r2"));
        assert_eq!((q.depth(), q.repairs()), (0, 0));
        assert_eq!(q.pop_ready(later), None);
    }

    #[test]
    fn a_busy_queue_still_hands_out_one_repair_in_every_few_keys() {
        let mut q = Queue::new();
        let now = Instant::now();
        q.schedule_as("r".into(), now, Class::Repair);
        let mut handed = Vec::new();
        for i in 0..REPAIR_EVERY {
            q.schedule(format!("c{i}"), now);
            let k = q.pop_ready(now).unwrap();
            q.finish(&k);
            handed.push(k);
        }
        let last = REPAIR_EVERY as usize - 1;
        assert!(
            handed[..last].iter().all(|k| k.starts_with('c')),
            "{handed:?}"
        );
        assert_eq!(handed[last], "r", "{handed:?}");
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
        let grown = (
            q.heaps[Class::Normal as usize].capacity(),
            q.pending.capacity(),
        );
        assert!(grown.0 >= 100_000 && grown.1 >= 100_000);
        let mut handed = 0;
        while let Some(k) = q.pop_ready(now) {
            q.finish(&k);
            handed += 1;
        }
        assert_eq!(handed, 100_000, "every key is still handed out once");
        assert!(
            q.heaps[Class::Normal as usize].capacity() <= SHRINK_ABOVE * 2,
            "{}",
            q.heaps[Class::Normal as usize].capacity()
        );
        assert!(
            q.pending.capacity() <= SHRINK_ABOVE * 2,
            "{}",
            q.pending.capacity()
        );
    }
}
