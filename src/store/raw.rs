//! The keys below the prefix that are not objects, each with one writer: the sealing
//! marker, a node's force-detach declarations, a plugin's capacity report; and the
//! cluster-wide maintenance calls (alarms, compaction).

use super::{MalformedCause, Repeat, Store, StoreError};

/// The key (below the prefix) where a controller holding the cluster's key file says
/// so; it holds key ids only, never a key.
pub const SEALING_KEY: &str = "sealing";

/// What [`Store::declare_node_gone`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Declared {
    /// Wrote the declaration; `replaced_malformed`: over a declarations value that was
    /// not one (written again from this declaration alone).
    Written {
        /// The node's declarations key held garbage, now replaced.
        replaced_malformed: bool,
    },
    /// An earlier try (whose answer was lost) wrote it.
    Already,
}

/// The value at [`SEALING_KEY`].
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct SealingMarker {
    key_ids: Vec<String>,
}

impl Store {
    /// The key ids of the cluster's key file, as its controller last declared them at
    /// [`SEALING_KEY`]: `Some` when the cluster seals secrets at rest (a writer without
    /// the key file would leave them in clear in etcd's history and WAL).
    pub async fn sealing(&self) -> Result<Option<Vec<String>>, StoreError> {
        Ok(self.get_raw(SEALING_KEY).await?.map(|(value, _)| {
            serde_json::from_slice::<SealingMarker>(&value)
                .map(|m| m.key_ids)
                .unwrap_or_default()
        }))
    }

    /// Declares that this cluster seals secrets with the keys of this store's key file
    /// (the controller, at each election it wins); no write when already declared.
    pub async fn declare_sealing(&self) -> Result<(), StoreError> {
        let Some(keyring) = self.keyring().filter(|k| k.node().is_none()) else {
            return Ok(());
        };
        let ids = keyring.ids();
        if self.sealing().await?.as_ref() == Some(&ids) {
            return Ok(());
        }
        // A list of strings always serializes.
        let value = serde_json::to_vec(&SealingMarker { key_ids: ids }).unwrap_or_default();
        self.put_raw(SEALING_KEY, value).await
    }

    /// Node `node`'s force-detach declarations ([`crate::api::declarations_key`]) and
    /// the mod_revision they were read at (0: none). A malformed value is an error
    /// naming it.
    pub async fn declarations(
        &self,
        node: &crate::api::NodeName,
    ) -> Result<(crate::api::Declarations, i64), StoreError> {
        let key = crate::api::declarations_key(node);
        let Some((value, revision)) = self.get_raw(&key).await? else {
            return Ok((crate::api::Declarations::default(), 0));
        };
        crate::api::Declarations::parse(&value)
            .map(|d| (d, revision))
            .map_err(|why| StoreError::Malformed {
                key,
                revision,
                cause: MalformedCause::Report(why),
            })
    }

    /// Declares node `node` gone for the volume at `key` (`moorctl volume detach`): the
    /// volume's `spec.force_detach` entry and the node's declarations key
    /// ([`crate::api::declarations_key`]) in one transaction, the entry naming the
    /// generation this very write makes, so it covers exactly the claims admitted
    /// before it. One try: a concurrent write is a [`StoreError::Conflict`] to try
    /// again on; `retrying` (a try after a lost answer) finds an entry naming the
    /// stored generation to be that try's write.
    pub async fn declare_node_gone(
        &self,
        key: &crate::api::ObjectKey<crate::api::VolumeSpec>,
        node: &crate::api::NodeName,
        retrying: bool,
    ) -> Result<Declared, StoreError> {
        let read = self.get(key).await?;
        if retrying && read.spec.force_detach.get(node) == Some(&read.metadata.generation) {
            return Ok(Declared::Already);
        }
        // The node's agent reads no volume: the same transaction tells it.
        let (mut declarations, read_at, replaced) = match self.declarations(node).await {
            Ok((found, at)) => (found, at, false),
            Err(StoreError::Malformed { revision, .. }) => {
                (crate::api::Declarations::default(), revision, true)
            }
            Err(e) => return Err(e),
        };
        let generation = read.metadata.generation + 1;
        let mut v = read.clone();
        v.spec.force_detach.insert(node.clone(), generation);
        declarations.declare(&v, generation);
        // Declarations (strings and integers) always serialize.
        let value = serde_json::to_vec(&declarations).unwrap_or_default();
        let mut batch = super::Batch::default();
        batch.update(self, &read, &v)?;
        batch.put_raw(self, &crate::api::declarations_key(node), value, read_at);
        batch.commit(self).await?;
        Ok(Declared::Written {
            replaced_malformed: replaced,
        })
    }

    /// The report an agent wrote at `key`, read with `parse` (untrusted: bounded by
    /// it); `None` when none was written. A malformed one is an error naming it.
    async fn report<T>(
        &self,
        key: String,
        parse: fn(&[u8]) -> Result<T, String>,
    ) -> Result<Option<T>, StoreError> {
        let Some((value, revision)) = self.get_raw(&key).await? else {
            return Ok(None);
        };
        parse(&value)
            .map(Some)
            .map_err(|why| StoreError::Malformed {
                key,
                revision,
                cause: MalformedCause::Report(why),
            })
    }

    /// Writes `report` at `key` as JSON.
    async fn put_report<T: serde::Serialize + ?Sized>(
        &self,
        key: &str,
        report: &T,
    ) -> Result<(), StoreError> {
        // Reports are lists and maps of strings and numbers: they always serialize.
        let value = serde_json::to_vec(report).unwrap_or_default();
        self.put_raw(key, value).await
    }

    /// Plugin `id`'s last capacity report ([`crate::api::capacity_key`]).
    pub async fn capacity(
        &self,
        id: &crate::api::PluginId,
    ) -> Result<Option<Vec<crate::api::CapacityEntry>>, StoreError> {
        self.report(crate::api::capacity_key(id), crate::api::parse_capacity)
            .await
    }

    /// Writes plugin `id`'s capacity report (the leader of its controller plugin).
    pub async fn put_capacity(
        &self,
        id: &crate::api::PluginId,
        entries: &[crate::api::CapacityEntry],
    ) -> Result<(), StoreError> {
        self.put_report(&crate::api::capacity_key(id), entries)
            .await
    }

    /// Plugin `id`'s last snapshot list ([`crate::api::snapshot_list_key`]).
    pub async fn snapshot_list(
        &self,
        id: &crate::api::PluginId,
    ) -> Result<Option<crate::api::PluginSnapshots>, StoreError> {
        self.report(
            crate::api::snapshot_list_key(id),
            crate::api::parse_snapshot_list,
        )
        .await
    }

    /// Writes plugin `id`'s snapshot list.
    pub async fn put_snapshot_list(
        &self,
        id: &crate::api::PluginId,
        list: &crate::api::PluginSnapshots,
    ) -> Result<(), StoreError> {
        self.put_report(&crate::api::snapshot_list_key(id), list)
            .await
    }

    /// Plugin `id`'s last unknown-volumes report ([`crate::api::unknown_volumes_key`]).
    pub async fn unknown_volumes(
        &self,
        id: &crate::api::PluginId,
    ) -> Result<Option<crate::api::UnknownVolumes>, StoreError> {
        self.report(
            crate::api::unknown_volumes_key(id),
            crate::api::parse_unknown_volumes,
        )
        .await
    }

    /// Writes plugin `id`'s unknown-volumes report.
    pub async fn put_unknown_volumes(
        &self,
        id: &crate::api::PluginId,
        list: &crate::api::UnknownVolumes,
    ) -> Result<(), StoreError> {
        self.put_report(&crate::api::unknown_volumes_key(id), list)
            .await
    }

    /// The alarms etcd's members have raised, as `(member id, alarm)` (`NOSPACE`,
    /// `CORRUPT`); empty where the server does not implement alarms (the embedded
    /// store, which has no quota).
    pub async fn alarms(&self) -> Result<Vec<(u64, String)>, StoreError> {
        use etcd_client::{AlarmAction, AlarmType};
        let resp = self
            .send(Repeat::Idempotent, |mut c| async move {
                c.alarm(AlarmAction::Get, AlarmType::None, None).await
            })
            .await;
        match resp {
            Ok(r) => Ok(r
                .alarms()
                .iter()
                .filter(|a| a.alarm() != AlarmType::None)
                .map(|a| (a.member_id(), format!("{:?}", a.alarm()).to_uppercase()))
                .collect()),
            Err(etcd_client::Error::GRpcStatus(s)) if s.code() == tonic::Code::Unimplemented => {
                Ok(Vec::new())
            }
            Err(e) => Err(StoreError::from_etcd(e)),
        }
    }

    /// Compacts etcd's history up to `revision` (tests and maintenance).
    pub async fn compact(&self, revision: i64) -> Result<(), StoreError> {
        self.send(Repeat::Idempotent, |mut c| async move {
            c.compact(revision, None).await
        })
        .await
        .map_err(StoreError::from_etcd)?;
        Ok(())
    }
}
