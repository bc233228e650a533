//! Raw watches: etcd watch responses under a prefix, with keys made relative to the
//! store prefix. Decoding and the resume/relist policy live in `runtime::watcher`.

use etcd_client::{EventType, WatchOptions};

use std::time::Duration;

use tokio::time::Instant;

use super::{Access, Repeat, Store, StoreError};

/// The error of a watch silent for `quiet`, a progress request included.
fn no_answer_on_watch(quiet: Duration) -> etcd_client::Error {
    let quiet = Duration::from_secs(quiet.as_secs().max(1));
    etcd_client::Error::GRpcStatus(tonic::Status::deadline_exceeded(format!(
        "etcd sent nothing on a watch for {} and did not answer a progress request",
        humantime::format_duration(quiet)
    )))
}

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

/// How a refusal names a watch of `key`.
fn watched(key: &str, prefix: bool) -> String {
    if prefix {
        format!("keys below {}", crate::api::printable(key))
    } else {
        crate::api::printable(key)
    }
}

/// Who watches what, for a cancellation that is a refusal.
struct Refused {
    identity: Option<String>,
    what: String,
}

/// An open watch.
pub struct WatchStream {
    inner: etcd_client::WatchStream,
    refused: Refused,
    prefix_len: usize,
    /// How long the stream may be quiet before it is asked for progress, and how long
    /// the answer may take: the store's request deadline.
    quiet: Duration,
    /// When progress was asked for and not yet answered.
    asked: Option<Instant>,
}

impl WatchStream {
    /// The next response; `Ok(None)` when etcd closed the stream.
    ///
    /// A quiet watch is asked for progress (etcd's WatchProgressRequest) after the
    /// store's deadline: an idle etcd answers at once, with its revision, so a watch
    /// that stays silent for another deadline is on a member that no longer answers
    /// (paused, wedged) and fails as unavailable, for the caller to open it again.
    /// Cancel-safe: a call dropped while waiting keeps the question asked.
    pub async fn next(&mut self) -> Result<Option<WatchBatch>, StoreError> {
        let resp = loop {
            let until = match self.asked {
                Some(at) => at + self.quiet,
                None => Instant::now() + self.quiet,
            };
            match tokio::time::timeout_at(until, self.inner.message()).await {
                Ok(resp) => {
                    self.asked = None;
                    break resp.map_err(StoreError::from_etcd)?;
                }
                Err(_) => match self.asked {
                    None => {
                        self.inner
                            .request_progress()
                            .await
                            .map_err(StoreError::from_etcd)?;
                        self.asked = Some(Instant::now());
                    }
                    Some(at) => {
                        return Err(StoreError::Unavailable(no_answer_on_watch(
                            at.elapsed() + self.quiet,
                        )))
                    }
                },
            }
        };
        let Some(resp) = resp else {
            return Ok(None);
        };
        // A watch etcd cancelled for any reason but compaction (which the caller
        // relists for) is an error with etcd's reason: "permission denied" when the
        // identity's role does not cover the watched range. Never an empty batch that a
        // caller could take for "the watch ended, start again at once".
        if resp.canceled() && resp.compact_revision() == 0 {
            return Err(StoreError::watch_cancelled(
                resp.cancel_reason(),
                self.refused.identity.as_deref(),
                &self.refused.what,
            ));
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
            .map_err(|e| self.refusal(e, Access::Watch, || watched(&key, prefix)))?;
        Ok(WatchStream {
            inner,
            refused: Refused {
                identity: self.identity().map(str::to_string),
                what: watched(&key, prefix),
            },
            prefix_len: self.prefix().len(),
            quiet: self.deadline(),
            asked: None,
        })
    }
}
