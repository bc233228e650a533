//! Volume health and usage on the node: every `--volume-stats-interval`, for each claim
//! published here, NodeGetVolumeStats at the target path (GET_VOLUME_STATS) and the
//! volume's health: NodeGetVolumeHealth (GET_VOLUME_HEALTH, CSI 1.13) where the plugin
//! advertises it, else the condition a 1.9-1.12 plugin puts in NodeGetVolumeStats
//! (VOLUME_CONDITION). The usage and the health go to the per-volume gauges of /metrics
//! at once, and to the claim's Mount when the health changed or the usage moved by 1%
//! of the total or more (so a busy volume does not rewrite its Mount every interval).
//! A change of health is an event on the volume (`Volume abnormal`, a Warning;
//! `Volume healthy`); the controller raises the volume's `HealthyOnNodes` condition
//! from the Mounts.

use super::*;
use std::time::Duration;

/// What one NodeGetVolumeStats answer says.
fn usage_of(resp: &v1::NodeGetVolumeStatsResponse) -> VolumeUsage {
    use v1::volume_usage::Unit;
    let mut u = VolumeUsage::default();
    let n = |v: i64| u64::try_from(v).ok();
    for x in &resp.usage {
        match Unit::try_from(x.unit) {
            Ok(Unit::Bytes) => {
                u.bytes_used = n(x.used);
                u.bytes_available = n(x.available);
                u.bytes_total = n(x.total);
            }
            Ok(Unit::Inodes) => {
                u.inodes_used = n(x.used);
                u.inodes_available = n(x.available);
                u.inodes_total = n(x.total);
            }
            _ => {}
        }
    }
    u
}

/// Whether a new usage is worth writing over the recorded one: none recorded, or a
/// figure moved by 1% of its total or more.
pub(super) fn moved(old: Option<&VolumeUsage>, new: &VolumeUsage) -> bool {
    let Some(old) = old else {
        return true;
    };
    let far = |a: Option<u64>, b: Option<u64>, total: Option<u64>| match (a, b) {
        (Some(a), Some(b)) => a.abs_diff(b) * 100 >= total.unwrap_or(0).max(1),
        (None, None) => false,
        _ => true,
    };
    far(old.bytes_used, new.bytes_used, new.bytes_total)
        || far(old.inodes_used, new.inodes_used, new.inodes_total)
        || old.bytes_total != new.bytes_total
        || old.inodes_total != new.inodes_total
}

impl Reconcile {
    /// Runs the stats pass every `every` until `stop`.
    pub(super) async fn stats_loop(self: Arc<Self>, every: Duration, stop: CancellationToken) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut measured: std::collections::BTreeSet<(String, String)> = Default::default();
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            self.claims.wait_until_ready().await;
            self.mounts.wait_until_ready().await;
            let published: Vec<(String, PublishRecord)> = {
                let local = self.r.local.lock().await;
                local
                    .publishes
                    .iter()
                    .filter(|(_, r)| r.steps.get(plan::PUBLISH) == Step::Done && !r.released)
                    .map(|(k, r)| (k.clone(), r.clone()))
                    .collect()
            };
            let mut now = std::collections::BTreeSet::new();
            for (key, rec) in &published {
                match self.volume_stats(key, rec).await {
                    Ok(true) => {
                        now.insert((rec.namespace.to_string(), rec.volume.to_string()));
                    }
                    Ok(false) => {}
                    Err(e) => {
                        tracing::debug!(claim = %key, error = %moor::process::error_chain(&e), "volume stats")
                    }
                }
            }
            for (ns, vol) in measured.difference(&now) {
                moor::runtime::metrics::forget_volume(ns, vol);
            }
            measured = now;
        }
    }

    /// One claim's NodeGetVolumeStats (GET_VOLUME_STATS) and health: NodeGetVolumeHealth
    /// where the plugin advertises it (CSI 1.13), else the VolumeCondition a 1.9-1.12
    /// plugin puts in NodeGetVolumeStats (VOLUME_CONDITION). Returns whether it was
    /// measured.
    async fn volume_stats(&self, key: &str, rec: &PublishRecord) -> Result<bool, NodeError> {
        let cfg = self.plugin(&rec.plugin_id)?.clone();
        let Some(fp) = self.r.supervisor.status(&cfg.id) else {
            return Ok(false);
        };
        let caps = &fp.capabilities.node;
        let with_stats = caps.has(NodeRpc::GetVolumeStats);
        let with_health = caps.has(NodeRpc::GetVolumeHealth);
        if !with_stats && !with_health {
            return Ok(false);
        }
        let Some(claim) = self.claims.get(key) else {
            return Ok(false);
        };
        let same_claim = claim.metadata.uid == rec.claim_uid;
        let on_grant = on_grant(
            rec.attachment.as_deref(),
            rec.publish_context.as_ref(),
            &claim,
        );
        if self.r.supervisor.registration() == 0 || !plan::measurable(&claim, same_claim, on_grant)
        {
            return Ok(false);
        }
        let condition_in_stats = !with_health && caps.has(NodeRpc::VolumeCondition);
        let (usage, condition) = self
            .measure(&cfg, rec, with_stats, with_health, condition_in_stats)
            .await?;
        moor::runtime::metrics::volume_stats(
            rec.namespace.as_str(),
            rec.volume.as_str(),
            usage.as_ref().unwrap_or(&VolumeUsage::default()),
            condition.as_ref().map(|c| c.abnormal),
        );
        self.mirror_health(rec, &claim, usage, condition).await?;
        Ok(true)
    }

    /// NodeGetVolumeStats (`with_stats`: the usage, and the condition where
    /// `condition_in_stats`) and NodeGetVolumeHealth (`with_health`: the condition).
    async fn measure(
        &self,
        cfg: &PluginConfig,
        rec: &PublishRecord,
        with_stats: bool,
        with_health: bool,
        condition_in_stats: bool,
    ) -> Result<(Option<VolumeUsage>, Option<VolumeHealth>), NodeError> {
        let volume_path = path_str(&plugin_path(cfg, &rec.target_path));
        let staging_target_path = rec
            .staging_path
            .as_ref()
            .map(|s| path_str(&plugin_path(cfg, s)))
            .unwrap_or_default();
        let csi = self.csi(cfg)?;
        let mut usage = None;
        let mut condition = None;
        if with_stats {
            let req = v1::NodeGetVolumeStatsRequest {
                volume_id: rec.external_id.to_string(),
                volume_path: volume_path.clone(),
                staging_target_path: staging_target_path.clone(),
            };
            let resp = csi.node_get_volume_stats(req).await?;
            usage = Some(usage_of(&resp));
            condition = resp
                .volume_condition
                .as_ref()
                .filter(|_| condition_in_stats)
                .map(|c| VolumeHealth {
                    abnormal: c.abnormal,
                    message: c.message.clone(),
                    conditions: Vec::new(),
                });
        }
        if with_health {
            let req = v1::NodeGetVolumeHealthRequest {
                volume_id: rec.external_id.to_string(),
                volume_publish_path: volume_path,
                staging_target_path,
            };
            let resp = csi.node_get_volume_health(req).await?;
            condition = Some(moor::csi::convert::volume_health(
                resp.volume_health.as_ref(),
            ));
        }
        Ok((usage, condition))
    }

    /// Writes what was measured on the claim's Mount when it moved, and says a change
    /// of health as an event ([`health_event`]).
    async fn mirror_health(
        &self,
        rec: &PublishRecord,
        claim: &Claim,
        usage: Option<VolumeUsage>,
        condition: Option<VolumeHealth>,
    ) -> Result<(), NodeError> {
        // Serialised with the claim's node steps, which write the same Mount.
        let lock_key = Volume::key_for(&rec.namespace, &rec.volume);
        let _guard = self.r.locks.lock(lock_key.as_str()).await;
        let mount_key = Mount::key_for(&claim.object_key());
        let Some(current) = self.writer.fresh(&self.mounts, &mount_key).await? else {
            return Ok(());
        };
        let was = current.status.condition.as_deref();
        let usage_moved = usage
            .as_ref()
            .is_some_and(|u| moved(current.status.usage.as_deref(), u));
        if was == condition.as_ref() && !usage_moved {
            return Ok(());
        }
        let mut next = (*current).clone();
        if let Some(u) = usage {
            next.status.usage = Some(Box::new(u));
        }
        next.status.condition = condition.clone().map(Box::new);
        self.writer.update(&current, &next).await?;
        let Some((kind, reason, msg)) = health_event(was, condition) else {
            return Ok(());
        };
        let object = ObjectRef {
            kind: "Volume".into(),
            namespace: rec.namespace.clone(),
            name: Name::new(rec.volume.as_str()).unwrap_or_default(),
        };
        let d = details([
            ("volume_id", rec.volume.to_string()),
            ("node", self.r.node.to_string()),
        ]);
        self.r
            .recorder
            .record(
                object,
                kind,
                reason,
                format!("{} on node {}: {msg}", rec.volume, self.r.node),
                d,
            )
            .await;
        Ok(())
    }
}

/// The event a change of a volume's health on the node says: abnormal (or abnormal
/// otherwise), or healthy again.
fn health_event(
    was: Option<&VolumeHealth>,
    now: Option<VolumeHealth>,
) -> Option<(EventType, &'static str, String)> {
    let was_abnormal = was.is_some_and(|c| c.abnormal);
    match now {
        Some(c) if c.abnormal && (!was_abnormal || was.map(|w| &w.message) != Some(&c.message)) => {
            Some((EventType::Warning, "Volume abnormal", c.message))
        }
        Some(c) if !c.abnormal && was_abnormal => Some((
            EventType::Normal,
            "Volume healthy",
            String::from("healthy again"),
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_of_health_is_said_once() {
        let h = |abnormal: bool, message: &str| VolumeHealth {
            abnormal,
            message: message.into(),
            conditions: Vec::new(),
        };
        let said = |was: Option<&VolumeHealth>, now: Option<VolumeHealth>| {
            health_event(was, now).map(|(_, reason, _)| reason)
        };
        assert_eq!(said(None, Some(h(true, "io"))), Some("Volume abnormal"));
        assert_eq!(said(Some(&h(true, "io")), Some(h(true, "io"))), None);
        assert_eq!(
            said(Some(&h(true, "io")), Some(h(true, "gone"))),
            Some("Volume abnormal"),
            "abnormal otherwise"
        );
        assert_eq!(
            said(Some(&h(true, "io")), Some(h(false, ""))),
            Some("Volume healthy")
        );
        assert_eq!(said(None, Some(h(false, ""))), None);
        assert_eq!(said(Some(&h(true, "io")), None), None);
    }

    #[test]
    fn usage_is_rewritten_only_when_it_moved_by_a_percent() {
        let u = |used: u64| VolumeUsage {
            bytes_used: Some(used),
            bytes_total: Some(1000),
            ..Default::default()
        };
        assert!(moved(None, &u(0)));
        assert!(!moved(Some(&u(100)), &u(109)));
        assert!(moved(Some(&u(100)), &u(110)));
        assert!(moved(Some(&u(100)), &u(90)));
        let mut bigger = u(100);
        bigger.bytes_total = Some(2000);
        assert!(moved(Some(&u(100)), &bigger));
    }
}
