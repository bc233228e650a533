//! The ownership records of one plugin's ids ([`Ownership`], issue 77), as the agent
//! leading the plugin reads and writes them: its provisioner for volumes, its
//! snapshotter for snapshots. A record is made if absent when the id is first learned
//! (of two objects naming one id, the first recorded keeps it), read from the store
//! (not a cache) before a step that acts on the id, and removed once the id is gone.

use moor::api::*;
use moor::store::StoreError;

use super::context::ControllerPluginCtx;

/// What a record says of an object and an id.
#[derive(Debug)]
pub enum Owner {
    /// The object owns it.
    Mine,
    /// Another object of the same namespace owns it: the object may use it (whoever
    /// writes one writes both), never delete it.
    Sibling,
    /// An object of another namespace owns it and shares it with the object's (an
    /// operator's grant, or two namings kept at the upgrade): the object may use it,
    /// never delete it.
    Shared,
    /// An object of another namespace owns it (what the object's namespace may be
    /// told of it).
    Another(String),
    /// Nobody does (no record, or one whose object is gone).
    Nobody,
}

impl ControllerPluginCtx {
    /// The record of `resource` `id` of this plugin, read from the store.
    async fn ownership(
        &self,
        resource: OwnedResource,
        id: &str,
    ) -> Result<Option<Ownership>, StoreError> {
        self.reads
            .try_get(&Ownership::key_for(&self.plugin.id, resource, id))
            .await
    }

    /// Whether the object a record names is gone (deleted, or made again under the
    /// same name): then the record is stale. A snapshot id is owned by a Snapshot, or
    /// (a member) by its VolumeGroupSnapshot: the uid tells which.
    async fn stale(&self, rec: &Ownership) -> Result<bool, StoreError> {
        let o = &rec.spec.owner;
        let (ns, name) = (&o.namespace, &o.name);
        let is_owner = |uid: Option<Uid>| uid.is_some_and(|uid| uid == o.uid);
        let group = async {
            let key = VolumeGroupSnapshot::key_for(ns, name);
            Ok::<_, StoreError>(is_owner(
                self.reads.try_get(&key).await?.map(|g| g.metadata.uid),
            ))
        };
        let owned = match rec.spec.resource {
            OwnedResource::Volume => {
                let v = self.reads.try_get(&Volume::key_for(ns, name)).await?;
                is_owner(v.map(|v| v.metadata.uid))
            }
            OwnedResource::Snapshot => {
                let s = self.reads.try_get(&Snapshot::key_for(ns, name)).await?;
                is_owner(s.map(|s| s.metadata.uid)) || group.await?
            }
            OwnedResource::GroupSnapshot => group.await?,
        };
        Ok(!owned)
    }

    /// What the record of `resource` `id` says of `object`, and the record.
    pub async fn owner<S: Spec>(
        &self,
        resource: OwnedResource,
        id: &str,
        object: &Object<S>,
    ) -> Result<(Owner, Option<Ownership>), StoreError> {
        let Some(rec) = self.ownership(resource, id).await? else {
            return Ok((Owner::Nobody, None));
        };
        if owned_by(&rec, object) {
            return Ok((Owner::Mine, Some(rec)));
        }
        if self.stale(&rec).await? {
            return Ok((Owner::Nobody, Some(rec)));
        }
        if rec.spec.owner.namespace == object.metadata.namespace {
            return Ok((Owner::Sibling, Some(rec)));
        }
        if rec.spec.shared_with(&object.metadata.namespace).is_some() {
            return Ok((Owner::Shared, Some(rec)));
        }
        let why = owner_for(&rec, &object.metadata.namespace);
        Ok((Owner::Another(why), Some(rec)))
    }

    /// Records that `object` owns `resource` `id` unless an object of another
    /// namespace does (`Ok(Err(why))`); a record of its own namespace's is left as it
    /// is. A stale record is replaced (guarded by its revision).
    pub async fn take_ownership<S: Spec>(
        &self,
        resource: OwnedResource,
        id: &str,
        object: &Object<S>,
    ) -> Result<Result<(), String>, StoreError> {
        self.take_ownership_with(resource, id, object, None).await
    }

    /// [`ControllerPluginCtx::take_ownership`], keeping what CreateVolume answered in
    /// the record (`provisioned`; written into `object`'s own record when it differs).
    pub async fn take_ownership_with<S: Spec>(
        &self,
        resource: OwnedResource,
        id: &str,
        object: &Object<S>,
        provisioned: Option<Provisioned>,
    ) -> Result<Result<(), String>, StoreError> {
        for _ in 0..3 {
            let (owner, rec) = self.owner(resource, id, object).await?;
            match (owner, rec) {
                (Owner::Mine, Some(rec)) => {
                    let Some(p) = provisioned
                        .as_ref()
                        .filter(|p| rec.spec.provisioned.as_deref() != Some(*p))
                    else {
                        return Ok(Ok(()));
                    };
                    let mut next = rec.clone();
                    next.spec.provisioned = Some(Box::new(p.clone()));
                    match self.writer.update(&rec, &next).await {
                        Ok(_) => return Ok(Ok(())),
                        // Written since: read it again.
                        Err(StoreError::Conflict { .. }) => continue,
                        Err(e) => return Err(e),
                    }
                }
                (Owner::Mine | Owner::Sibling | Owner::Shared, _) => return Ok(Ok(())),
                (Owner::Another(why), _) => return Ok(Err(why)),
                (Owner::Nobody, stale) => {
                    if let Some(stale) = stale {
                        match self.writer.delete_read(&stale).await {
                            Ok(_)
                            | Err(StoreError::Conflict { .. } | StoreError::NotFound { .. }) => {}
                            Err(e) => return Err(e),
                        }
                    }
                }
            }
            let plugin = &self.plugin.id;
            let mut record = Ownership::of(plugin, resource, id, object);
            record.spec.provisioned = provisioned.clone().map(Box::new);
            match self.writer.create(&record).await {
                Ok(_) => return Ok(Ok(())),
                // Another writer's record came first: read it again.
                Err(StoreError::AlreadyExists { .. }) => continue,
                Err(e) => return Err(e),
            }
        }
        // Three writes in a row lost a race on the record: a store error, tried again
        // like any other (not a refusal: nobody was found to own it).
        Err(StoreError::Conflict {
            key: Ownership::key_for(&self.plugin.id, resource, id).to_string(),
            expected: 0,
        })
    }

    /// Shares `resource` `id`, owned by an object of another namespace, with
    /// `object`'s namespace (the upgrade's second naming: both keep working until an
    /// operator picks). Nothing when the record is gone or already shares it.
    pub async fn share_with<S: Spec>(
        &self,
        resource: OwnedResource,
        id: &str,
        object: &Object<S>,
    ) -> Result<(), StoreError> {
        let ns = &object.metadata.namespace;
        for _ in 0..3 {
            let Some(rec) = self.ownership(resource, id).await? else {
                return Ok(());
            };
            if &rec.spec.owner.namespace == ns
                || rec.spec.shared_with(ns).is_some()
                || rec.spec.shared_with.len() >= MAX_SHARED
            {
                return Ok(());
            }
            let mut next = rec.clone();
            // As it was before: its writers keep writing.
            next.spec.shared_with.push(Share {
                namespace: ns.clone(),
                write: true,
            });
            match self.writer.update(&rec, &next).await {
                Err(StoreError::Conflict { .. }) => continue,
                other => return other.map(|_| ()),
            }
        }
        Err(StoreError::Conflict {
            key: Ownership::key_for(&self.plugin.id, resource, id).to_string(),
            expected: 0,
        })
    }

    /// Removes `object`'s record of `resource` `id` once the id is gone (or left to
    /// the storage); another object's record stays.
    pub async fn drop_ownership<S: Spec>(
        &self,
        resource: OwnedResource,
        id: &str,
        object: &Object<S>,
    ) -> Result<(), StoreError> {
        if let Some(rec) = self
            .ownership(resource, id)
            .await?
            .filter(|r| owned_by(r, object))
        {
            match self.writer.delete_read(&rec).await {
                Ok(_) | Err(StoreError::Conflict { .. } | StoreError::NotFound { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}
