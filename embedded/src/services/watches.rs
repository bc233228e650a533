//! The Watch service: each watch a task that replays the history from its start
//! revision, then follows the revision channel; responses cut near 1 MiB, progress
//! notifications when idle, cancellation by the client or on compaction.

use super::*;

#[tonic::async_trait]
impl PbWatchService for EmbeddedStore {
    type WatchStream = BoxStream<PbWatchResponse>;

    async fn watch(
        &self,
        req: Request<Streaming<PbWatchRequest>>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(64);
        let store = self.clone();
        tokio::spawn(async move {
            let mut watchers: HashMap<i64, (tokio::task::JoinHandle<()>, Arc<AtomicI64>)> =
                HashMap::new();
            let mut next_id = 0i64;
            loop {
                let msg = tokio::select! {
                    msg = inbound.message() => msg,
                    _ = tx.closed() => break,
                };
                let Ok(Some(msg)) = msg else { break };
                watchers.retain(|_, (h, _)| !h.is_finished());
                let resp = match msg.request_union {
                    Some(PbWatchRequestUnion::CreateRequest(create)) => {
                        let id = if create.watch_id != 0 {
                            create.watch_id
                        } else {
                            while watchers.contains_key(&next_id) {
                                next_id += 1;
                            }
                            next_id
                        };
                        match watchers.entry(id) {
                            std::collections::hash_map::Entry::Occupied(_) => PbWatchResponse {
                                header: store.header(store.lock().revision),
                                watch_id: id,
                                created: true,
                                canceled: true,
                                cancel_reason: "etcdserver: duplicate watch ID".into(),
                                ..Default::default()
                            },
                            std::collections::hash_map::Entry::Vacant(slot) => {
                                let spec = WatchSpec {
                                    key: create.key,
                                    range_end: create.range_end,
                                    start_revision: create.start_revision,
                                    progress_notify: create.progress_notify,
                                    no_put: create.filters.contains(&0),
                                    no_delete: create.filters.contains(&1),
                                    prev_kv: create.prev_kv,
                                };
                                let delivered = Arc::new(AtomicI64::new(0));
                                let task = store.clone().run_watcher(
                                    id,
                                    spec,
                                    tx.clone(),
                                    delivered.clone(),
                                );
                                slot.insert((tokio::spawn(task), delivered));
                                continue;
                            }
                        }
                    }
                    Some(PbWatchRequestUnion::CancelRequest(cancel)) => {
                        let Some((task, _)) = watchers.remove(&cancel.watch_id) else {
                            continue;
                        };
                        task.abort();
                        PbWatchResponse {
                            header: store.header(store.lock().revision),
                            watch_id: cancel.watch_id,
                            canceled: true,
                            ..Default::default()
                        }
                    }
                    Some(PbWatchRequestUnion::ProgressRequest(_)) => {
                        // Everything up to the revision every watcher of the stream has
                        // delivered, as etcd's progress response promises.
                        let current = store.lock().revision;
                        let rev = watchers
                            .values()
                            .map(|(_, d)| d.load(Ordering::Acquire))
                            .min()
                            .unwrap_or(current);
                        PbWatchResponse {
                            header: store.header(rev),
                            watch_id: -1,
                            ..Default::default()
                        }
                    }
                    None => continue,
                };
                if tx.send(Ok(resp)).await.is_err() {
                    break;
                }
            }
            for (task, _) in watchers.values() {
                task.abort();
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// What one watch asked for.
struct WatchSpec {
    key: Vec<u8>,
    range_end: Vec<u8>,
    start_revision: i64,
    progress_notify: bool,
    no_put: bool,
    no_delete: bool,
    prev_kv: bool,
}

impl EmbeddedStore {
    async fn run_watcher(
        self,
        id: i64,
        create: WatchSpec,
        tx: mpsc::Sender<Result<PbWatchResponse, Status>>,
        delivered_to: Arc<AtomicI64>,
    ) {
        let mut woken = self.inner.revision.subscribe();
        let (mut next, now) = {
            let m = self.lock();
            let next = if create.start_revision > 0 {
                create.start_revision
            } else {
                m.revision + 1
            };
            (next, m.revision)
        };
        let created = PbWatchResponse {
            header: self.header(now),
            watch_id: id,
            created: true,
            ..Default::default()
        };
        if tx.send(Ok(created)).await.is_err() {
            return;
        }
        let (no_put, no_delete) = (create.no_put, create.no_delete);
        let mut progress = tokio::time::interval(PROGRESS_INTERVAL);
        progress.tick().await;
        loop {
            let collected = {
                let m = self.lock();
                let collected = match m.commits_from(next) {
                    None => Err(PbWatchResponse {
                        header: self.header(m.revision),
                        watch_id: id,
                        canceled: true,
                        compact_revision: m.compact_revision,
                        cancel_reason: compacted().message().to_string(),
                        ..Default::default()
                    }),
                    Some(commits) => {
                        let mut events = Vec::new();
                        for ev in commits.flat_map(|c| c.events.iter()) {
                            let Some(kv) = &ev.kv else { continue };
                            let skip = (ev.r#type == 0 && no_put) || (ev.r#type == 1 && no_delete);
                            if skip || !in_range(&kv.key, &create.key, &create.range_end) {
                                continue;
                            }
                            let mut ev = ev.clone();
                            if !create.prev_kv {
                                ev.prev_kv = None;
                            }
                            events.push(ev);
                        }
                        next = m.revision + 1;
                        Ok((events, m.revision))
                    }
                };
                collected
            };
            let (events, delivered) = match collected {
                Ok(found) => found,
                Err(cancel) => {
                    let _ = tx.send(Ok(cancel)).await;
                    return;
                }
            };
            let mut batch = Vec::new();
            let mut size = 0;
            for ev in events {
                size += ev.encoded_len();
                batch.push(ev);
                if size >= MAX_BATCH_BYTES {
                    if !self
                        .send_events(&tx, id, delivered, std::mem::take(&mut batch))
                        .await
                    {
                        return;
                    }
                    size = 0;
                }
            }
            if !batch.is_empty() && !self.send_events(&tx, id, delivered, batch).await {
                return;
            }
            delivered_to.store(delivered, Ordering::Release);
            tokio::select! {
                changed = woken.changed() => if changed.is_err() { return },
                _ = progress.tick(), if create.progress_notify => {
                    if *woken.borrow() == delivered {
                        let resp = PbWatchResponse {
                            header: self.header(delivered),
                            watch_id: id,
                            ..Default::default()
                        };
                        if tx.send(Ok(resp)).await.is_err() {
                            return;
                        }
                    }
                }
            }
        }
    }

    async fn send_events(
        &self,
        tx: &mpsc::Sender<Result<PbWatchResponse, Status>>,
        id: i64,
        revision: i64,
        events: Vec<PbEvent>,
    ) -> bool {
        let resp = PbWatchResponse {
            header: self.header(revision),
            watch_id: id,
            events,
            ..Default::default()
        };
        tx.send(Ok(resp)).await.is_ok()
    }
}
