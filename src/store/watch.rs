//! Raw watches: etcd watch responses under a prefix, with keys made relative to the
//! store prefix. Decoding and the resume/relist policy live in `runtime::watcher`.

use etcd_client::{EventType, WatchOptions};

use super::{Repeat, Store, StoreError};

/// Put or delete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RawEventKind {
    /// The key was created or changed.
    Put,
    /// The key was deleted (or its lease ended).
    Delete,
}

/// One change of one key.
#[derive(Debug, Clone)]
pub struct RawEvent {
    /// Put or delete.
    pub kind: RawEventKind,
    /// The key below the store prefix.
    pub key: String,
    /// The new value (empty for a delete).
    pub value: Vec<u8>,
    /// The revision of the change.
    pub mod_revision: i64,
    /// The value before the change, when etcd still had it.
    pub prev_value: Option<(Vec<u8>, i64)>,
}

/// One watch response.
#[derive(Debug, Clone, Default)]
pub struct WatchBatch {
    /// The changes, in revision order.
    pub events: Vec<RawEvent>,
    /// The store's revision when the response was sent.
    pub header_revision: i64,
    /// Non-zero when the start revision was compacted: the watch is dead, relist.
    pub compact_revision: i64,
    /// The watch was cancelled by etcd.
    pub canceled: bool,
    /// The response that confirms the watch was created.
    pub created: bool,
}

impl WatchBatch {
    /// A progress notification: everything up to `header_revision` was delivered.
    pub fn is_progress(&self) -> bool {
        self.events.is_empty() && !self.created && !self.canceled && self.compact_revision == 0
    }
}

/// An open watch.
pub struct WatchStream {
    inner: etcd_client::WatchStream,
    prefix_len: usize,
}

impl WatchStream {
    /// The next response; `Ok(None)` when etcd closed the stream.
    pub async fn next(&mut self) -> Result<Option<WatchBatch>, StoreError> {
        let Some(resp) = self.inner.message().await.map_err(StoreError::from_etcd)? else {
            return Ok(None);
        };
        // A watch etcd cancelled for any reason but compaction (which the caller
        // relists for) is an error with etcd's reason: "permission denied" when the
        // identity's role does not cover the watched range. Never an empty batch that a
        // caller could take for "the watch ended, start again at once".
        if resp.canceled() && resp.compact_revision() == 0 {
            return Err(StoreError::watch_cancelled(resp.cancel_reason()));
        }
        let key_of =
            |k: &[u8]| String::from_utf8_lossy(k.get(self.prefix_len..).unwrap_or(k)).into_owned();
        let events = resp
            .events()
            .iter()
            .filter_map(|ev| {
                let kv = ev.kv()?;
                Some(RawEvent {
                    kind: match ev.event_type() {
                        EventType::Put => RawEventKind::Put,
                        EventType::Delete => RawEventKind::Delete,
                    },
                    key: key_of(kv.key()),
                    value: kv.value().to_vec(),
                    mod_revision: kv.mod_revision(),
                    prev_value: ev.prev_kv().map(|p| (p.value().to_vec(), p.mod_revision())),
                })
            })
            .collect();
        Ok(Some(WatchBatch {
            events,
            header_revision: resp.header().map(|h| h.revision()).unwrap_or_default(),
            compact_revision: resp.compact_revision(),
            canceled: resp.canceled(),
            created: resp.created(),
        }))
    }
}

impl Store {
    /// Watches every key starting with `<prefix><scope>` (e.g. scope `volumes/`) from
    /// `start_revision` (inclusive), with progress notifications, and with each event's
    /// previous value when `previous` is set. Previous values are not free: etcd reads
    /// the prior revision from its backend for every event of such a watch, so a
    /// process that caches the objects anyway (an informer) watches without them.
    pub async fn watch_raw(
        &self,
        scope: &str,
        start_revision: i64,
        previous: bool,
    ) -> Result<WatchStream, StoreError> {
        self.watch_range(scope, true, start_revision, previous)
            .await
    }

    /// Watches the one key `<prefix><key>` from `start_revision`, as [`Store::watch_raw`]
    /// does a prefix. An identity whose role grants that key alone (an election key)
    /// may watch it this way and no other: etcd checks a prefix watch against the whole
    /// range and cancels it.
    pub async fn watch_key(
        &self,
        key: &str,
        start_revision: i64,
        previous: bool,
    ) -> Result<WatchStream, StoreError> {
        self.watch_range(key, false, start_revision, previous).await
    }

    async fn watch_range(
        &self,
        scope: &str,
        prefix: bool,
        start_revision: i64,
        previous: bool,
    ) -> Result<WatchStream, StoreError> {
        let mut opts = WatchOptions::new()
            .with_progress_notify()
            .with_start_revision(start_revision);
        if prefix {
            opts = opts.with_prefix();
        }
        if previous {
            opts = opts.with_prev_key();
        }
        let key = self.full_key(scope);
        let inner = self
            .send(Repeat::Idempotent, |mut c| {
                let (key, opts) = (key.clone(), opts.clone());
                async move { c.watch(key, Some(opts)).await }
            })
            .await
            .map_err(StoreError::from_etcd)?;
        Ok(WatchStream {
            inner,
            prefix_len: self.prefix().len(),
        })
    }
}
