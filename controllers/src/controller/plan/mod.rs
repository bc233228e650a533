//! The controller's decisions as pure functions of what it observes: the claim, the
//! related objects from the caches, the plugin's capabilities. The reconcilers
//! (`claims/`, `allocations.rs`) gather the inputs and carry out what these return;
//! every transition is unit-tested here, without a store or a clock.
//!
//! # Layout
//! - this file: the claim's controller-publish step ([`attach`]) and its node side on
//!   release ([`node_done`]);
//! - [`claim`]: whether the claim is still wanted, and what its spec copies from its
//!   volume for the node;
//! - [`allocation`]: an allocation's liveness, claims and phase.

pub mod allocation;
pub mod claim;

pub use allocation::{liveness, Liveness};

use moor::api::*;
use std::time::Duration;

use super::context::MountView;
use super::volume_view::VolumeView;

/// Where a claim stands on the controller-publish step, and what to do about it.
#[derive(Debug, Clone, PartialEq)]
pub enum AttachPlan {
    /// The plugin needs no ControllerPublish, or the volume is attached in a way that
    /// covers the claim: the node may act, with this publish context, on the grant of
    /// this attachment (its uid; none when no ControllerPublish is needed).
    Ready(StrMap, Option<Uid>),
    /// The claim was let onto the node on an attachment that is gone, detaching, or
    /// replaced by another (a force-detach: the node was collected or an operator
    /// detached it): the node's permission is withdrawn before anything else happens,
    /// and granted again only on an attachment published after this.
    Revoke(String),
    /// Create this attachment, then wait for it.
    Create(AttachmentSpec),
    /// The attachment on the node does not cover the claim and no other claim uses
    /// it: ask for its detach, then wait (a new one is created once it is gone).
    Replace,
    /// Nothing to do but wait, for this reason.
    Wait(String),
}

/// What [`attach`] decides from.
pub struct AttachInputs<'a> {
    /// The claim (admitted).
    pub claim: &'a Claim,
    /// Its plugin's aggregate, if the controller has one.
    pub plugin: Option<&'a Plugin>,
    /// Its node, if registered.
    pub node: Option<&'a Node>,
    /// The attachment of (volume, node), if any.
    pub attachment: Option<&'a Attachment>,
    /// Whether another claim of the volume on the node may be using the attachment.
    pub attachment_in_use: bool,
    /// The claim's volume, if cached (its operator's force detaches).
    pub volume: Option<&'a VolumeView>,
}

/// Whether an attachment published with `att`'s capability serves `claim`: the same
/// capability (writable for a writer), or for a reader any capability of the same
/// attachment mode.
pub fn covers(att: &AttachmentSpec, claim: &ClaimSpec) -> bool {
    let (Some(access), Some(attach)) = (claim.access_mode, claim.attachment_mode) else {
        return false;
    };
    if att.capability.attachment_mode != attach {
        return false;
    }
    match claim.mode {
        ClaimMode::Read => true,
        ClaimMode::Write => att.capability.access_mode == access && !att.read_only,
    }
}

/// The controller-publish step of an admitted claim. A claim reaches the node only
/// when the plugin is known not to need ControllerPublish or the attachment covering
/// it is Attached; unknown capabilities wait, never count as "not needed".
///
/// A claim an operator's force detach covers (admitted before it: its release skips
/// the node) and that was not let onto the node yet never is from then on: the
/// operator declared the node gone for this volume, and a stage or publish made after
/// that declaration would be left behind by the release. (A grant made before it
/// stands: a force detach never takes a volume from live claims.)
pub fn attach(i: &AttachInputs) -> AttachPlan {
    let claim = i.claim;
    if !claim.spec.publish
        && i.volume
            .is_some_and(|v| v.force_detached(&claim.spec.node, claim.spec.volume_generation))
    {
        return AttachPlan::Wait(format!(
            "the operator detached volume {} from node {}",
            claim.spec.volume, claim.spec.node
        ));
    }
    let required = i.plugin.and_then(|p| p.status.controller_required);
    match required {
        None => {
            return AttachPlan::Wait(format!(
                "waiting for plugin {} to report its controller capabilities",
                claim.spec.plugin_id
            ))
        }
        Some(false) => return AttachPlan::Ready(StrMap::new(), None),
        Some(true) => {}
    }
    // A grant stands only on the attachment it was given for, while that attachment is
    // not being detached. (A grant from before grants named their attachment is
    // adopted by the attachment it finds Attached.)
    if claim.spec.publish {
        let why = match i.attachment {
            None => Some("the volume's attachment to the node is gone".to_string()),
            Some(att) if att.spec.detach => {
                Some("the volume's attachment to the node is being detached".to_string())
            }
            Some(att) => match &claim.spec.attachment {
                Some(uid) if uid != &att.metadata.uid => {
                    Some("the volume was attached to the node again since".to_string())
                }
                _ => None,
            },
        };
        if let Some(why) = why {
            return AttachPlan::Revoke(why);
        }
    }
    let Some(att) = i.attachment else {
        let csi_node_id = i
            .node
            .and_then(|n| n.status.plugins.get(&claim.spec.plugin_id))
            .and_then(|p| p.csi_node_id.clone());
        let (Some(csi_node_id), Some(external_id), Some(access_mode), Some(attachment_mode)) = (
            csi_node_id,
            claim.spec.external_id.clone(),
            claim.spec.access_mode,
            claim.spec.attachment_mode,
        ) else {
            return AttachPlan::Wait("waiting for the node's CSI node id".into());
        };
        return AttachPlan::Create(AttachmentSpec {
            volume: claim.spec.volume.clone(),
            node: claim.spec.node.clone(),
            plugin_id: claim.spec.plugin_id.clone(),
            external_id,
            csi_node_id,
            capability: VolumeCapability {
                access_mode,
                attachment_mode,
            },
            read_only: !access_mode.allows_write(),
            detach: false,
            volume_context: Some(claim.spec.volume_context.clone()),
        });
    };
    if att.spec.detach {
        return AttachPlan::Wait("waiting for an earlier attachment to be detached".into());
    }
    // A claim the node already acts on keeps the attachment it was given.
    if !claim.spec.publish && !covers(&att.spec, &claim.spec) {
        if i.attachment_in_use {
            return AttachPlan::Wait(format!(
                "waiting for the volume's attachment to node {} ({}{}) to be released by \
                 the claims using it",
                claim.spec.node,
                att.spec.capability.access_mode,
                if att.spec.read_only {
                    ", read-only"
                } else {
                    ""
                }
            ));
        }
        return AttachPlan::Replace;
    }
    if att.status.phase != AttachmentPhase::Attached {
        return AttachPlan::Wait(match &att.status.meta.last_error {
            Some(e) => format!("waiting for the volume to be attached: {e}"),
            None => "waiting for the volume to be attached".into(),
        });
    }
    AttachPlan::Ready(
        att.status.publish_context.clone(),
        Some(att.metadata.uid.clone()),
    )
}

/// Whether `other`, another claim of the volume on the same node, still needs the
/// attachment there (so a release must not detach it). A releasing claim needs it until
/// its node side is done or skipped (`other_done`, [`node_done`]). A live claim needs it
/// unless its node was collected (`node_collected`: gone past `--node-gc-timeout`):
/// an operator's force-detach covers the node steps of releases only, never a live
/// claim's use of the volume (found by the long chaos runs: a denied claim's release
/// detached the volume under two live claims the node had published again after
/// returning).
pub fn needs_attachment(other: &Claim, other_done: &NodeDone, node_collected: bool) -> bool {
    if other.status.phase == ClaimPhase::Released {
        return false;
    }
    if !(other.spec.publish || other.status.phase.is_live()) {
        return false;
    }
    if other.spec.release || other.is_deleting() {
        *other_done == NodeDone::No
    } else {
        !node_collected
    }
}

/// Whether the node side of a releasing claim is finished or may be skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeDone {
    /// The agent acknowledged (or the node never had permission to act).
    Agent,
    /// Released without the node, for this reason (a Warning).
    Skipped(String),
    /// Still waiting for the node.
    No,
}

/// What [`node_done`] decides from.
pub struct NodeInputs<'a> {
    /// The claim.
    pub claim: &'a Claim,
    /// Its Mount, if any.
    pub mount: Option<&'a MountView>,
    /// Its volume, if any.
    pub volume: Option<&'a VolumeView>,
    /// Whether the claim's node has a Node object now (its agent renews it).
    pub node_present: bool,
    /// How long the claim's node has been without a Node object (`None`: present, or
    /// not tracked without `--node-gc-timeout`).
    pub node_gone_for: Option<Duration>,
    /// `--node-gc-timeout`.
    pub node_gc_timeout: Option<Duration>,
}

/// Whether the claim's node has nothing left of it: the claim never went onto the node
/// (never granted, never withdrawn), or the node's Mount of this very claim says it
/// was released and torn down. A claim released without its node (force-detach, the
/// node GC timeout) is not, until the node comes back and says so.
pub fn node_confirmed(claim: &Claim, mount: Option<&MountView>) -> bool {
    (!claim.spec.publish && !claim.spec.revoked)
        || mount.is_some_and(|m| m.serves(&claim.metadata.uid) && m.released)
}

/// The node side of a release. The reasons carry no value that changes from one pass
/// to the next, so a pass that decides the same writes nothing.
pub fn node_done(i: &NodeInputs) -> NodeDone {
    let claim = i.claim;
    // Never let onto the node: nothing there to wait for. A withdrawn grant still is.
    if !claim.spec.publish && !claim.spec.revoked {
        return NodeDone::Agent;
    }
    let acked = i
        .mount
        .is_some_and(|m| m.serves(&claim.metadata.uid) && m.released);
    if acked {
        return NodeDone::Agent;
    }
    // An operator's declaration is about a node that is gone: while the node is
    // present (its agent renews its Node) it is asked, as for any release. A node
    // that came back may have acted since the declaration (a call in flight when it
    // was made); what it did, it undoes before the detach.
    let forced = i
        .volume
        .is_some_and(|v| v.force_detached(&claim.spec.node, claim.spec.volume_generation));
    if forced && !i.node_present {
        return NodeDone::Skipped(format!(
            "the operator detached volume {} from node {}",
            claim.spec.volume, claim.spec.node
        ));
    }
    if let (Some(timeout), Some(gone)) = (i.node_gc_timeout, i.node_gone_for) {
        if gone >= timeout {
            return NodeDone::Skipped(format!(
                "node {} has been gone longer than the node GC timeout ({})",
                claim.spec.node,
                humantime::format_duration(timeout)
            ));
        }
    }
    NodeDone::No
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn claim(mode: ClaimMode, access: AccessMode) -> Claim {
        let mut c = Claim::new(
            &Namespace::default_ns(),
            Name::new("a1.data").unwrap(),
            ClaimSpec {
                allocation: AllocationId::new("a1").unwrap(),
                volume: VolumeId::new("v1").unwrap(),
                node: NodeName::new("n1").unwrap(),
                plugin_id: PluginId::new("p").unwrap(),
                mode,
                access_mode: Some(access),
                attachment_mode: Some(AttachmentMode::FileSystem),
                external_id: Some(ExternalVolumeId::new("ext-1").unwrap()),
                ..Default::default()
            },
        );
        c.metadata.uid = "u1".into();
        c.status.phase = ClaimPhase::Admitted;
        c
    }

    fn plugin(required: Option<bool>) -> Plugin {
        let mut p = Plugin::new(
            &Namespace::default(),
            Name::new("p").unwrap(),
            PluginSpec::default(),
        );
        p.status.controller_required = required;
        p
    }

    fn node() -> Node {
        let mut n = Node::new(&Namespace::default(), Name::new("n1").unwrap(), NodeSpec {});
        n.status.plugins.insert(
            PluginId::new("p").unwrap(),
            NodePluginStatus {
                csi_node_id: Some(CsiNodeId::new("csi-n1").unwrap()),
                ..Default::default()
            },
        );
        n
    }

    /// An attachment of volume v1 to n1 (plugin `p`, uid `att-1`), Attached or not.
    pub(crate) fn attachment(access: AccessMode, attached: bool) -> Attachment {
        let mut a = Attachment::new(
            &Namespace::default_ns(),
            Name::new("v1.n1").unwrap(),
            AttachmentSpec {
                volume: VolumeId::new("v1").unwrap(),
                node: NodeName::new("n1").unwrap(),
                plugin_id: PluginId::new("p").unwrap(),
                external_id: ExternalVolumeId::new("ext-1").unwrap(),
                csi_node_id: CsiNodeId::new("csi-n1").unwrap(),
                capability: VolumeCapability {
                    access_mode: access,
                    attachment_mode: AttachmentMode::FileSystem,
                },
                read_only: !access.allows_write(),
                detach: false,
                volume_context: None,
            },
        );
        a.metadata.uid = "att-1".into();
        if attached {
            a.status.phase = AttachmentPhase::Attached;
            a.status.publish_context = [("k".to_string(), "v".to_string())].into();
        }
        a
    }

    fn inputs<'a>(
        c: &'a Claim,
        p: Option<&'a Plugin>,
        n: Option<&'a Node>,
        a: Option<&'a Attachment>,
    ) -> AttachInputs<'a> {
        AttachInputs {
            claim: c,
            plugin: p,
            node: n,
            attachment: a,
            attachment_in_use: false,
            volume: None,
        }
    }

    /// Chaos seed 2008: v19 was force-detached from n3 while a36 (admitted before)
    /// waited there; a36 was then published on n3, and its release later skipped the
    /// node and ControllerUnpublished under the published volume.
    #[test]
    fn a_claim_a_force_detach_covers_is_never_let_onto_the_node() {
        let p = plugin(Some(false));
        let n = node();
        let mut v = Volume::new(
            &Namespace::default_ns(),
            Name::new("v1").unwrap(),
            VolumeSpec::default(),
        );
        let mut c = claim(ClaimMode::Write, AccessMode::SingleNodeWriter);
        c.spec.volume_generation = Some(3);
        v.spec.force_detach.insert(c.spec.node.clone(), 4);
        let v = VolumeView::of(v);
        let mut i = inputs(&c, Some(&p), Some(&n), None);
        i.volume = Some(&v);
        assert!(matches!(attach(&i), AttachPlan::Wait(w) if w.contains("operator detached")));
        // Already let on before the force detach: the grant stands.
        let mut granted = c.clone();
        granted.spec.publish = true;
        let mut i = inputs(&granted, Some(&p), Some(&n), None);
        i.volume = Some(&v);
        assert!(matches!(attach(&i), AttachPlan::Ready(..)));
        // Admitted after the force detach: not covered, let on.
        let mut later = c.clone();
        later.spec.volume_generation = Some(4);
        let mut i = inputs(&later, Some(&p), Some(&n), None);
        i.volume = Some(&v);
        assert!(matches!(attach(&i), AttachPlan::Ready(..)));
    }

    #[test]
    fn unknown_plugin_capabilities_block_the_node() {
        let c = claim(ClaimMode::Write, AccessMode::SingleNodeWriter);
        let n = node();
        for p in [None, Some(plugin(None))] {
            let plan = attach(&inputs(&c, p.as_ref(), Some(&n), None));
            assert!(
                matches!(plan, AttachPlan::Wait(ref w) if w.contains("capabilities")),
                "{plan:?}"
            );
        }
    }

    #[test]
    fn no_controller_publish_needed_lets_the_node_act() {
        let c = claim(ClaimMode::Write, AccessMode::SingleNodeWriter);
        let p = plugin(Some(false));
        assert_eq!(
            attach(&inputs(&c, Some(&p), None, None)),
            AttachPlan::Ready(StrMap::new(), None)
        );
    }

    #[test]
    fn a_missing_attachment_is_created_with_the_plugin_s_node_id() {
        let c = claim(ClaimMode::Write, AccessMode::SingleNodeWriter);
        let p = plugin(Some(true));
        let n = node();
        match attach(&inputs(&c, Some(&p), Some(&n), None)) {
            AttachPlan::Create(spec) => {
                assert_eq!(spec.csi_node_id.as_str(), "csi-n1");
                assert_eq!(spec.external_id.as_str(), "ext-1");
                assert!(!spec.read_only);
            }
            other => panic!("{other:?}"),
        }
        // Without the node's CSI node id there is nothing to publish to.
        assert!(matches!(
            attach(&inputs(&c, Some(&p), None, None)),
            AttachPlan::Wait(_)
        ));
    }

    #[test]
    fn the_node_waits_until_the_attachment_is_attached() {
        let c = claim(ClaimMode::Write, AccessMode::SingleNodeWriter);
        let p = plugin(Some(true));
        let pending = attachment(AccessMode::SingleNodeWriter, false);
        assert!(matches!(
            attach(&inputs(&c, Some(&p), None, Some(&pending))),
            AttachPlan::Wait(_)
        ));
        let done = attachment(AccessMode::SingleNodeWriter, true);
        assert!(matches!(
            attach(&inputs(&c, Some(&p), None, Some(&done))),
            AttachPlan::Ready(ctx, Some(uid)) if ctx.get("k").map(String::as_str) == Some("v") && uid == "att-1"
        ));
    }

    #[test]
    fn a_writer_never_rides_a_read_only_attachment() {
        let c = claim(ClaimMode::Write, AccessMode::SingleNodeWriter);
        let p = plugin(Some(true));
        let ro = attachment(AccessMode::MultiNodeReaderOnly, true);
        let mut i = inputs(&c, Some(&p), None, Some(&ro));
        i.attachment_in_use = true;
        assert!(matches!(attach(&i), AttachPlan::Wait(w) if w.contains("read-only")));
        i.attachment_in_use = false;
        assert_eq!(attach(&i), AttachPlan::Replace);
        // A reader rides it.
        let r = claim(ClaimMode::Read, AccessMode::MultiNodeReaderOnly);
        assert!(matches!(
            attach(&inputs(&r, Some(&p), None, Some(&ro))),
            AttachPlan::Ready(..)
        ));
    }

    #[test]
    fn a_claim_already_on_the_node_keeps_its_attachment() {
        let mut c = claim(ClaimMode::Write, AccessMode::SingleNodeWriter);
        c.spec.publish = true;
        let p = plugin(Some(true));
        let ro = attachment(AccessMode::MultiNodeReaderOnly, true);
        assert!(matches!(
            attach(&inputs(&c, Some(&p), None, Some(&ro))),
            AttachPlan::Ready(..)
        ));
    }

    #[test]
    fn a_detaching_attachment_is_waited_out() {
        let c = claim(ClaimMode::Write, AccessMode::SingleNodeWriter);
        let p = plugin(Some(true));
        let mut a = attachment(AccessMode::SingleNodeWriter, true);
        a.spec.detach = true;
        assert!(matches!(
            attach(&inputs(&c, Some(&p), None, Some(&a))),
            AttachPlan::Wait(w) if w.contains("detached")
        ));
    }

    fn granted_on(uid: Option<&str>) -> Claim {
        let mut c = claim(ClaimMode::Read, AccessMode::SingleNodeWriter);
        c.spec.publish = true;
        c.spec.attachment = uid.map(Uid::new);
        c
    }

    #[test]
    fn a_grant_whose_attachment_is_gone_is_withdrawn() {
        let p = plugin(Some(true));
        let n = node();
        let c = granted_on(Some("att-1"));
        assert!(matches!(
            attach(&inputs(&c, Some(&p), Some(&n), None)),
            AttachPlan::Revoke(w) if w.contains("gone")
        ));
    }

    #[test]
    fn a_grant_whose_attachment_is_detaching_is_withdrawn() {
        let p = plugin(Some(true));
        let c = granted_on(Some("att-1"));
        let mut a = attachment(AccessMode::SingleNodeWriter, true);
        a.spec.detach = true;
        assert!(matches!(
            attach(&inputs(&c, Some(&p), None, Some(&a))),
            AttachPlan::Revoke(w) if w.contains("detached")
        ));
    }

    #[test]
    fn a_grant_on_an_earlier_attachment_is_withdrawn_even_when_attached_again() {
        // The attachment was force-detached and published again before the controller
        // looked: Attached, but not the one the node was let on with.
        let p = plugin(Some(true));
        let c = granted_on(Some("att-0"));
        let a = attachment(AccessMode::SingleNodeWriter, true);
        assert!(matches!(
            attach(&inputs(&c, Some(&p), None, Some(&a))),
            AttachPlan::Revoke(w) if w.contains("again")
        ));
        // Granted on this very attachment: it stands.
        let c = granted_on(Some("att-1"));
        assert!(matches!(
            attach(&inputs(&c, Some(&p), None, Some(&a))),
            AttachPlan::Ready(_, Some(u)) if u == "att-1"
        ));
    }

    #[test]
    fn a_withdrawn_claim_is_granted_again_only_on_an_attached_attachment() {
        let p = plugin(Some(true));
        let n = node();
        let mut c = claim(ClaimMode::Read, AccessMode::SingleNodeWriter);
        c.spec.revoked = true;
        // No attachment: one is asked for, the node waits.
        assert!(matches!(
            attach(&inputs(&c, Some(&p), Some(&n), None)),
            AttachPlan::Create(_)
        ));
        // Asked for, not yet published: the node waits.
        let pending = attachment(AccessMode::SingleNodeWriter, false);
        assert!(matches!(
            attach(&inputs(&c, Some(&p), Some(&n), Some(&pending))),
            AttachPlan::Wait(_)
        ));
        let done = attachment(AccessMode::SingleNodeWriter, true);
        assert!(matches!(
            attach(&inputs(&c, Some(&p), Some(&n), Some(&done))),
            AttachPlan::Ready(_, Some(u)) if u == "att-1"
        ));
    }

    #[test]
    fn a_grant_without_controller_publish_names_no_attachment_and_stands() {
        let p = plugin(Some(false));
        let c = granted_on(None);
        assert_eq!(
            attach(&inputs(&c, Some(&p), None, None)),
            AttachPlan::Ready(StrMap::new(), None)
        );
    }

    #[test]
    fn a_withdrawn_grant_is_still_waited_for_on_release() {
        let mut c = releasing(Some(1));
        c.spec.publish = false;
        assert_eq!(node_done(&node_inputs(&c, None)), NodeDone::Agent);
        c.spec.revoked = true;
        assert_eq!(node_done(&node_inputs(&c, None)), NodeDone::No);
    }

    #[test]
    fn a_live_claim_needs_its_attachment_unless_its_node_was_collected() {
        let mut live = claim(ClaimMode::Read, AccessMode::SingleNodeWriter);
        live.spec.publish = true;
        // An operator's force-detach skips a live claim's node steps on release, but
        // while it lives it keeps the volume attached.
        let forced = NodeDone::Skipped("the operator detached".into());
        assert!(needs_attachment(&live, &forced, false));
        assert!(!needs_attachment(&live, &forced, true));
        // A withdrawn claim waiting for a new attachment needs it too.
        let mut withdrawn = live.clone();
        withdrawn.spec.publish = false;
        withdrawn.spec.revoked = true;
        assert!(needs_attachment(&withdrawn, &NodeDone::No, false));
        // Pending, never let on: it does not.
        let mut pending = claim(ClaimMode::Read, AccessMode::SingleNodeWriter);
        pending.status.phase = ClaimPhase::Pending;
        assert!(!needs_attachment(&pending, &NodeDone::Agent, false));
    }

    #[test]
    fn a_releasing_claim_needs_its_attachment_until_its_node_side_is_done_or_skipped() {
        let c = releasing(Some(1));
        assert!(needs_attachment(&c, &NodeDone::No, false));
        assert!(!needs_attachment(&c, &NodeDone::Agent, false));
        assert!(!needs_attachment(
            &c,
            &NodeDone::Skipped("gone".into()),
            false
        ));
        let mut done = c.clone();
        done.status.phase = ClaimPhase::Released;
        assert!(!needs_attachment(&done, &NodeDone::No, false));
    }

    fn volume_forced(node: &str, generation: i64) -> VolumeView {
        let mut v = Volume::new(
            &Namespace::default_ns(),
            Name::new("v1").unwrap(),
            VolumeSpec::default(),
        );
        v.spec
            .force_detach
            .insert(NodeName::new(node).unwrap(), generation);
        VolumeView::of(v)
    }

    fn releasing(admitted_at: Option<i64>) -> Claim {
        let mut c = claim(ClaimMode::Write, AccessMode::SingleNodeWriter);
        c.spec.publish = true;
        c.spec.release = true;
        c.spec.volume_generation = admitted_at;
        c
    }

    fn node_inputs<'a>(c: &'a Claim, v: Option<&'a VolumeView>) -> NodeInputs<'a> {
        NodeInputs {
            claim: c,
            mount: None,
            volume: v,
            node_present: false,
            node_gone_for: None,
            node_gc_timeout: None,
        }
    }

    #[test]
    fn a_force_detach_covers_only_claims_admitted_before_it() {
        let v = volume_forced("n1", 5);
        let before = releasing(Some(4));
        assert!(matches!(
            node_done(&node_inputs(&before, Some(&v))),
            NodeDone::Skipped(_)
        ));
        // While the node is present, it is asked: it may have acted since.
        let mut present = node_inputs(&before, Some(&v));
        present.node_present = true;
        assert_eq!(node_done(&present), NodeDone::No);
        let after = releasing(Some(5));
        assert_eq!(node_done(&node_inputs(&after, Some(&v))), NodeDone::No);
        // Another node's entry does not count.
        let other = volume_forced("n2", 9);
        assert_eq!(node_done(&node_inputs(&before, Some(&other))), NodeDone::No);
    }

    #[test]
    fn the_agent_s_acknowledgement_of_this_claim_is_what_counts() {
        let c = releasing(Some(1));
        let mut m = Mount::new(
            &Namespace::default_ns(),
            Name::new("a1.data").unwrap(),
            MountSpec {
                claim_uid: "someone-else".into(),
                ..Default::default()
            },
        );
        m.status.released = true;
        let view = MountView::of(&m);
        let mut i = node_inputs(&c, None);
        i.mount = Some(&view);
        assert_eq!(node_done(&i), NodeDone::No);
        m.spec.claim_uid = "u1".into();
        let view = MountView::of(&m);
        let mut i = node_inputs(&c, None);
        i.mount = Some(&view);
        assert_eq!(node_done(&i), NodeDone::Agent);
    }

    #[test]
    fn the_node_gc_reason_does_not_change_from_pass_to_pass() {
        let c = releasing(Some(1));
        let mut i = node_inputs(&c, None);
        i.node_gc_timeout = Some(Duration::from_secs(2));
        i.node_gone_for = Some(Duration::from_secs(1));
        assert_eq!(node_done(&i), NodeDone::No);
        i.node_gone_for = Some(Duration::from_millis(2500));
        let first = node_done(&i);
        i.node_gone_for = Some(Duration::from_secs(700));
        assert!(matches!(first, NodeDone::Skipped(_)));
        assert_eq!(node_done(&i), first);
    }
}
