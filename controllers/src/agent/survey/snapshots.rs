//! The survey's ListSnapshots: the plugin's own snapshots, moor's or not.

use moor::api::*;
use moor::csi::v1;

use super::Survey;

impl Survey {
    /// Every page of ListSnapshots (the plugin's own snapshots, moor's or not), kept in
    /// the plugin's snapshot list key for `moorctl volume snapshot list --plugin`: the
    /// first [`MAX_LISTED_SNAPSHOTS`], and how many more. Written when it changed.
    pub(super) async fn snapshots(&self) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let csi = self.ctx.csi()?;
        let mut list = PluginSnapshots::default();
        let mut token = String::new();
        // Bounded however the plugin pages: a plugin that repeats a token ends the list.
        for _ in 0..1024 {
            let page = csi
                .list_snapshots(v1::ListSnapshotsRequest {
                    starting_token: token.clone(),
                    ..Default::default()
                })
                .await?;
            for e in page.entries {
                let Some(s) = e.snapshot else { continue };
                if list.snapshots.len() >= MAX_LISTED_SNAPSHOTS {
                    list.more += 1;
                    continue;
                }
                list.snapshots.push(ListedSnapshot {
                    snapshot_id: printable_bounded(&s.snapshot_id, 128),
                    source_volume_id: printable_bounded(&s.source_volume_id, 128),
                    size_bytes: u64::try_from(s.size_bytes).unwrap_or(0),
                    created_secs: s.creation_time.map(|t| t.seconds),
                    ready: s.ready_to_use,
                });
            }
            if page.next_token.is_empty() || page.next_token == token {
                break;
            }
            token = page.next_token;
        }
        let id = &self.ctx.plugin.id;
        if !matches!(self.ctx.reads.snapshot_list(id).await, Ok(Some(ref known)) if *known == list)
        {
            self.ctx.writer.store().put_snapshot_list(id, &list).await?;
        }
        Ok(())
    }
}
