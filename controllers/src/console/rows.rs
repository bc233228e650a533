//! What the console keeps of each object: the fields its pages show, decoded once as
//! the watch delivers them (never whole objects: secrets, contexts and mount options
//! are dropped here, so no page can show them). A detail page reads its one object
//! from the store and redacts it ([`moor::api::redact_json`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use moor::api::*;
use serde::Serialize;

/// What an object is waiting on: its failing step, from its status.
#[derive(Debug, Clone)]
pub struct Waiting {
    /// The step (`NodeStageVolume`), or `-` for an error not tied to one.
    pub step: Term,
    /// Since when it fails.
    pub since: Option<Timestamp>,
    /// How many attempts so far.
    pub attempts: u32,
    /// The last error.
    pub message: Box<str>,
    /// The plugin's answer was final: no retry will come.
    pub final_answer: bool,
    /// When the next attempt is due.
    pub next_retry: Option<Timestamp>,
}

/// The waiting of a status, if it fails.
pub fn waiting(meta: &StatusMeta) -> Option<Box<Waiting>> {
    if let Some(r) = &meta.retry {
        return Some(Box::new(Waiting {
            step: Term::new(&r.step),
            since: Some(r.since),
            attempts: r.attempts,
            message: r.message.as_str().into(),
            final_answer: r.final_answer,
            next_retry: (!r.final_answer).then_some(r.next_retry),
        }));
    }
    meta.last_error.as_deref().map(Waiting::message)
}

impl Waiting {
    /// A waiting on `message` alone, with no step failing.
    pub fn message(message: &str) -> Box<Waiting> {
        Box::new(Waiting {
            step: Term::new("-"),
            since: None,
            attempts: 0,
            message: message.into(),
            final_answer: false,
            next_retry: None,
        })
    }
}

/// A unit enum's name as its manifests spell it (`published`), interned: 100,000
/// rows share one copy of each word.
pub fn word<T: Serialize>(t: &T) -> Term {
    match serde_json::to_value(t) {
        Ok(serde_json::Value::String(s)) => Term::new(&s),
        Ok(other) => Term::new(&other.to_string()),
        Err(_) => Term::new("?"),
    }
}

/// What the console's tables need of a row.
pub trait Row: Send + Sync + 'static {
    /// The kind, as pages and topics name it.
    const KIND: &'static str;
    /// Whether the table indexes its related topics (a volume's only topic is itself:
    /// not indexed).
    const INDEXED: bool = true;
    /// Its key below the prefix.
    fn key(&self) -> &Arc<str>;
    /// The topics a change to it wakes, besides its kind and its key, which are also
    /// the table's index values: `v:NS/VOLUME`, `a:NS/ALLOCATION`, `n:NODE`,
    /// `o:KIND/NS/NAME` (what an event is about).
    fn related(&self) -> Vec<String>;
}

macro_rules! row {
    ($row:ty, $kind:literal, |$r:ident| $related:expr) => {
        row!($row, $kind, true, |$r| $related);
    };
    ($row:ty, $kind:literal, $indexed:literal, |$r:ident| $related:expr) => {
        impl Row for $row {
            const KIND: &'static str = $kind;
            const INDEXED: bool = $indexed;
            fn key(&self) -> &Arc<str> {
                &self.key
            }
            fn related(&self) -> Vec<String> {
                let $r = self;
                $related
            }
        }
    };
}

/// A volume's topic and index value (`v:NS/NAME`).
pub fn vol(ns: &Namespace, name: impl std::fmt::Display) -> String {
    format!("v:{ns}/{name}")
}

/// An allocation's topic and index value.
pub fn alloc(ns: &Namespace, name: impl std::fmt::Display) -> String {
    format!("a:{ns}/{name}")
}

/// A node's topic and index value.
pub fn node(name: impl std::fmt::Display) -> String {
    format!("n:{name}")
}

/// The topic and index value of an object events are about (`o:KIND/NS/NAME`).
pub fn about(kind: &str, ns: &Namespace, name: impl std::fmt::Display) -> String {
    format!("o:{kind}/{ns}/{name}")
}

/// A volume's row.
#[derive(Debug, Clone)]
pub struct VolumeRow {
    pub key: Arc<str>,
    pub namespace: Namespace,
    pub name: Name,
    pub plugin: PluginId,
    pub phase: Term,
    pub labels: Rare<BTreeMap<String, String>>,
    pub capacity: Option<u64>,
    /// Live claims (readers and writers).
    pub claims: u32,
    pub schedulable: bool,
    pub deleting: bool,
    pub waiting: Option<Box<Waiting>>,
}
row!(VolumeRow, "Volume", false, |r| vec![vol(
    &r.namespace,
    &r.name
)]);

impl VolumeRow {
    pub fn project(v: Volume) -> VolumeRow {
        let claims = &v.status.claims;
        VolumeRow {
            key: v.object_key().as_str().into(),
            phase: word(&v.status.provisioning.phase),
            capacity: v.status.provisioning.capacity_bytes,
            claims: (claims.read_claims.len() + claims.write_claims.len()) as u32,
            schedulable: claims.schedulable,
            deleting: v.metadata.deletion_timestamp.is_some(),
            waiting: waiting(&v.status.provisioning.meta).or_else(|| waiting(&claims.meta)),
            namespace: v.metadata.namespace,
            name: v.metadata.name,
            plugin: v.spec.plugin_id,
            labels: v.metadata.labels,
        }
    }

    /// The `ns/name` other kinds name it by (their volume index).
    pub fn id(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// A claim's row.
#[derive(Debug, Clone)]
pub struct ClaimRow {
    pub key: Arc<str>,
    pub namespace: Namespace,
    pub name: Name,
    pub node: NodeName,
    pub volume: VolumeId,
    pub allocation: AllocationId,
    pub request: Name,
    pub mode: Term,
    pub phase: Term,
    pub release: bool,
    pub waiting: Option<Box<Waiting>>,
}
row!(ClaimRow, "Claim", |r| vec![
    vol(&r.namespace, &r.volume),
    alloc(&r.namespace, &r.allocation)
]);

impl ClaimRow {
    pub fn project(c: Claim) -> ClaimRow {
        ClaimRow {
            key: c.object_key().as_str().into(),
            mode: word(&c.spec.mode),
            phase: word(&c.status.phase),
            release: c.spec.release,
            // A claim not admitted yet waits for the reason its admission gave (a node
            // not registered, a volume being created), with no step failing.
            waiting: waiting(&c.status.meta).or_else(|| {
                let admitting = matches!(c.status.phase, ClaimPhase::Pending | ClaimPhase::Denied);
                c.status
                    .reason
                    .as_deref()
                    .filter(|_| admitting)
                    .map(Waiting::message)
            }),
            namespace: c.metadata.namespace,
            name: c.metadata.name,
            node: c.spec.node,
            volume: c.spec.volume,
            allocation: c.spec.allocation,
            request: c.spec.request,
        }
    }
}

/// One of an allocation's volume requests.
#[derive(Debug, Clone)]
pub struct RequestRow {
    pub name: Name,
    pub volume: VolumeId,
    pub read_only: bool,
    pub per_alloc: bool,
    pub template: bool,
}

/// An allocation's row.
#[derive(Debug, Clone)]
pub struct AllocationRow {
    pub key: Arc<str>,
    pub namespace: Namespace,
    pub name: Name,
    pub node: NodeName,
    pub desired: Term,
    pub client: Term,
    pub exit: Option<Box<str>>,
    pub phase: Term,
    pub lost: bool,
    pub requests: Box<[RequestRow]>,
    pub waiting: Option<Box<Waiting>>,
}
row!(AllocationRow, "Allocation", |r| vec![
    alloc(&r.namespace, &r.name),
    node(&r.node)
]);

impl AllocationRow {
    pub fn project(a: Allocation) -> AllocationRow {
        let exit = a.spec.exit.as_ref().map(|e| {
            match (&e.code, &e.signal) {
                (Some(c), Some(s)) => format!("code {c}, signal {s}"),
                (Some(c), None) => format!("code {c}"),
                (None, Some(s)) => format!("signal {s}"),
                (None, None) => "-".into(),
            }
            .into()
        });
        AllocationRow {
            key: a.object_key().as_str().into(),
            desired: word(&a.spec.desired_status),
            client: word(&a.spec.client_status),
            exit,
            phase: word(&a.status.phase),
            lost: a.status.lost,
            requests: a
                .spec
                .volumes
                .iter()
                .map(|r| RequestRow {
                    name: r.name.clone(),
                    volume: r.volume.clone(),
                    read_only: r.read_only,
                    per_alloc: r.per_alloc,
                    template: r.template.is_some(),
                })
                .collect(),
            waiting: waiting(&a.status.meta),
            namespace: a.metadata.namespace,
            name: a.metadata.name,
            node: a.spec.node,
        }
    }
}

/// An attachment's row (a volume on a node, ControllerPublish).
#[derive(Debug, Clone)]
pub struct AttachmentRow {
    pub key: Arc<str>,
    pub namespace: Namespace,
    pub name: Name,
    pub volume: VolumeId,
    pub node: NodeName,
    pub phase: Term,
    pub uncertain: bool,
    pub detach: bool,
    pub waiting: Option<Box<Waiting>>,
}
row!(AttachmentRow, "Attachment", |r| vec![
    vol(&r.namespace, &r.volume),
    node(&r.node)
]);

impl AttachmentRow {
    pub fn project(a: Attachment) -> AttachmentRow {
        AttachmentRow {
            key: a.object_key().as_str().into(),
            phase: word(&a.status.phase),
            uncertain: a.status.uncertain,
            detach: a.spec.detach,
            waiting: waiting(&a.status.meta),
            namespace: a.metadata.namespace,
            name: a.metadata.name,
            volume: a.spec.volume,
            node: a.spec.node,
        }
    }
}

/// A mount's row (a claim's stage and publish on its node).
#[derive(Debug, Clone)]
pub struct MountRow {
    pub key: Arc<str>,
    pub namespace: Namespace,
    pub claim: Name,
    pub allocation: AllocationId,
    pub volume: VolumeId,
    pub node: NodeName,
    /// Whether the claim stages (its plugin has STAGE_UNSTAGE_VOLUME).
    pub stages: bool,
    pub target_path: Box<str>,
    pub staged: bool,
    pub stage_uncertain: bool,
    pub published: bool,
    pub publish_uncertain: bool,
    pub released: bool,
    pub abnormal: Option<Box<str>>,
    pub usage: Option<(Option<u64>, Option<u64>)>,
    pub waiting: Option<Box<Waiting>>,
}
row!(MountRow, "Mount", |r| vec![
    vol(&r.namespace, &r.volume),
    alloc(&r.namespace, &r.allocation),
    node(&r.node)
]);

impl MountRow {
    pub fn project(m: Mount) -> MountRow {
        let s = &m.status;
        MountRow {
            key: m.object_key().as_str().into(),
            stages: m.spec.staging_path.is_some(),
            target_path: m.spec.target_path.as_str().into(),
            staged: s.staged,
            stage_uncertain: s.stage_uncertain,
            published: s.published,
            publish_uncertain: s.publish_uncertain,
            released: s.released,
            abnormal: s
                .condition
                .as_ref()
                .filter(|c| c.abnormal)
                .map(|c| c.message.as_str().into()),
            usage: s.usage.as_ref().map(|u| (u.bytes_used, u.bytes_total)),
            waiting: waiting(&s.meta),
            namespace: m.metadata.namespace,
            claim: m.spec.claim,
            allocation: m.spec.allocation,
            volume: m.spec.volume,
            node: m.spec.node,
        }
    }

    /// Its state as the volume's picture shows it.
    pub fn state(&self) -> &'static str {
        match (self.released, self.published, self.staged) {
            (true, _, _) => "released",
            (_, true, _) => "published",
            (_, _, true) => "staged",
            _ => "pending",
        }
    }
}

/// A snapshot's row.
#[derive(Debug, Clone)]
pub struct SnapshotRow {
    pub key: Arc<str>,
    pub namespace: Namespace,
    pub name: Name,
    pub volume: VolumeId,
    pub phase: Term,
    pub size: Option<u64>,
    pub created: Option<Timestamp>,
    pub waiting: Option<Box<Waiting>>,
}
row!(SnapshotRow, "Snapshot", |r| vec![vol(
    &r.namespace,
    &r.volume
)]);

impl SnapshotRow {
    pub fn project(s: Snapshot) -> SnapshotRow {
        SnapshotRow {
            key: s.object_key().as_str().into(),
            phase: word(&s.status.phase),
            size: s.status.size_bytes,
            created: s.status.creation_time,
            waiting: waiting(&s.status.meta),
            namespace: s.metadata.namespace,
            name: s.metadata.name,
            volume: s.spec.volume,
        }
    }
}

/// An event's row (the timeline).
#[derive(Debug, Clone)]
pub struct EventRow {
    pub key: Arc<str>,
    pub object: ObjectRef,
    pub related: Option<ObjectRef>,
    pub warning: bool,
    pub reason: Term,
    pub message: Box<str>,
    pub source: Term,
    pub time: Option<Timestamp>,
    pub count: u32,
}
row!(EventRow, "Event", |r| std::iter::once(&r.object)
    .chain(&r.related)
    .map(|o| about(&o.kind, &o.namespace, &o.name))
    .collect());

impl EventRow {
    pub fn project(e: Event) -> EventRow {
        EventRow {
            key: e.object_key().as_str().into(),
            warning: matches!(e.spec.type_, EventType::Warning),
            reason: Term::new(&e.spec.reason),
            message: e.spec.message.into(),
            source: Term::new(&e.spec.source),
            time: e.spec.time.or(e.metadata.creation_timestamp),
            count: e.spec.series.as_ref().map_or(1, |s| s.count),
            object: e.spec.object,
            related: e.spec.related,
        }
    }
}

/// An object kept whole (nodes, plugins, cordons: a few per node; quotas: a few per
/// namespace).
#[derive(Debug, Clone)]
pub struct Whole<S: Spec> {
    pub key: Arc<str>,
    pub obj: Object<S>,
    /// When the console received this version of it (a Node's is rewritten at each of
    /// its agent's renewals, and exists only while they go on: the node's last sign of
    /// life the console saw).
    pub seen: Timestamp,
}

impl<S: Spec> Whole<S> {
    pub fn project(obj: Object<S>) -> Whole<S> {
        Whole {
            key: obj.object_key().as_str().into(),
            obj,
            seen: Timestamp::now(),
        }
    }
}

row!(Whole<NodeSpec>, "Node", |r| vec![node(
    &r.obj.metadata.name
)]);
row!(Whole<PluginSpec>, "Plugin", |_r| Vec::new());
row!(Whole<CordonSpec>, "Cordon", |r| vec![node(
    &r.obj.metadata.name
)]);
row!(Whole<QuotaSpec>, "Quota", |_r| Vec::new());

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_not_admitted_yet_waits_for_its_admission_s_reason() {
        let mut c = Claim::new(
            &Namespace::default_ns(),
            Name::new("a1.data").unwrap(),
            ClaimSpec {
                node: NodeName::new("nowhere").unwrap(),
                ..Default::default()
            },
        );
        c.status.reason = Some("node nowhere is not registered".into());
        let row = ClaimRow::project(c.clone());
        let w = row.waiting.expect("a pending claim with a reason waits");
        assert_eq!(&*w.message, "node nowhere is not registered");
        // Past admission, a reason (waiting for the node) is no failure.
        c.status.phase = ClaimPhase::Published;
        assert!(ClaimRow::project(c).waiting.is_none());
    }
}
