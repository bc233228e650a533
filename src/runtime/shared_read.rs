//! A fresh read that callers asking at the same time share.
//!
//! Some reads must be fresh: a node agent reads its force-detach declarations from the
//! store before every forward step, since a cache may not show one made a moment ago.
//! Under a burst, every step paid its own linearizable read. Here a caller waits for
//! the read in flight to end and takes the next one's answer, or the last one's when
//! that read *began* after the caller asked: such a read reflects every write
//! committed before the caller asked, as the caller's own read would have. So a burst
//! of N steps costs about two reads per round trip instead of N, and no caller ever
//! gets an answer older than its question.

use std::future::Future;
use std::time::Instant;

/// The last read and when it began.
#[derive(Debug)]
pub struct SharedRead<T> {
    last: tokio::sync::Mutex<Option<(Instant, T)>>,
}

impl<T> Default for SharedRead<T> {
    fn default() -> Self {
        SharedRead {
            last: tokio::sync::Mutex::new(None),
        }
    }
}

impl<T: Clone> SharedRead<T> {
    /// The answer of a read (`read`) that began after this call did: the last one's
    /// when it did, else a new one (run while other callers wait). A failed read is
    /// not kept: each of its waiters then reads again.
    pub async fn read<E, F, Fut>(&self, read: F) -> Result<T, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let asked = Instant::now();
        let mut last = self.last.lock().await;
        if let Some((began, value)) = &*last {
            if *began >= asked {
                return Ok(value.clone());
            }
        }
        let began = Instant::now();
        let value = read().await?;
        *last = Some((began, value.clone()));
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    #[tokio::test]
    async fn callers_at_once_share_reads_and_a_later_caller_reads_again() {
        let shared = Arc::new(SharedRead::<u32>::default());
        let reads = Arc::new(AtomicU32::new(0));
        let read = |reads: Arc<AtomicU32>| async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            Ok::<_, ()>(reads.fetch_add(1, Ordering::SeqCst) + 1)
        };
        let tasks: Vec<_> = (0..50)
            .map(|_| {
                let (shared, reads) = (shared.clone(), reads.clone());
                tokio::spawn(async move { shared.read(|| read(reads)).await.unwrap() })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        let at_once = reads.load(Ordering::SeqCst);
        assert!(at_once <= 3, "{at_once} reads for 50 callers at once");
        // Asked after the last read began: never its answer.
        let got = shared.read(|| read(reads.clone())).await.unwrap();
        assert_eq!(got, at_once + 1);
        assert_eq!(reads.load(Ordering::SeqCst), at_once + 1);
    }

    #[tokio::test]
    async fn a_failed_read_is_not_kept() {
        let shared = SharedRead::<u32>::default();
        assert_eq!(
            shared.read(|| async { Err::<u32, _>("down") }).await,
            Err("down")
        );
        assert_eq!(shared.read(|| async { Ok::<_, &str>(7) }).await, Ok(7));
    }
}
