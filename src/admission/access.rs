//! The access-mode rules across every node, checked against the volume's live claims
//! inside the compare-and-swap that records the claim, and SELinux labels.

use crate::api::*;

use super::{Admitted, Verdict};

/// The access-mode rules across nodes: may a claim `(node, mode)` in `access_mode` join
/// the volume's `existing` live claims, where the node's plugin advertises
/// SINGLE_NODE_MULTI_WRITER or not (`multi_writer_cap`)? Both ways: the newcomer's mode
/// must admit the others, and each holder's mode must admit the newcomer.
pub fn access(
    volume: &VolumeSpec,
    access_mode: AccessMode,
    node: &NodeName,
    mode: ClaimMode,
    existing: &[ClaimRef],
    multi_writer_cap: bool,
) -> Result<(), AccessDenied> {
    let default_mode = volume
        .capabilities
        .first()
        .map(|c| c.access_mode)
        .unwrap_or(access_mode);
    let holder = |cause: &ClaimDenied| match cause {
        ClaimDenied::WriterTaken(_) => existing.iter().find(|r| r.mode == ClaimMode::Write),
        ClaimDenied::OtherNode { node: other, .. } => existing.iter().find(|r| &r.node == other),
        ClaimDenied::ClaimTaken(_) => existing.first(),
        ClaimDenied::OncePerNode(_) => existing.iter().find(|r| &r.node == node),
        ClaimDenied::ReadOnlyMode(_) => None,
    };
    let denied = |cause: ClaimDenied| AccessDenied {
        holder: holder(&cause).cloned(),
        cause,
    };
    access_mode
        .admit(
            node,
            mode,
            existing.iter().map(|r| (&r.node, r.mode)),
            multi_writer_cap,
        )
        .map_err(denied)?;
    for holder in existing {
        let held = holder.access_mode.unwrap_or(default_mode);
        let me = [(node, mode)];
        held.admit(
            &holder.node,
            holder.mode,
            me.iter().map(|(n, m)| (*n, *m)),
            multi_writer_cap,
        )
        .map_err(|cause| AccessDenied {
            cause,
            holder: Some(holder.clone()),
        })?;
    }
    Ok(())
}

/// The SELinux rule, where the node's plugin takes labels (`admitted.selinux_mount`):
/// the plugin stages a volume once per node, mounted with the first claim's label, so
/// every live claim of the volume on that node must carry the same label (no label
/// counts as one). A claim with another is denied, the denial naming both labels.
/// `label_of` gives a live claim's label (`None`: the claim is not known here, not
/// counted). Where the plugin does not take labels none is ever sent: no rule.
pub fn selinux_for(
    volume: &Volume,
    admitted: &Admitted,
    claim: &Claim,
    label_of: impl Fn(&ClaimRef) -> Option<Option<String>>,
    ending: impl Fn(&ClaimRef) -> bool,
) -> Result<(), Verdict> {
    if !admitted.selinux_mount || admitted.capability.attachment_mode == AttachmentMode::BlockDevice
    {
        return Ok(());
    }
    let mine = claim.spec.mount_options.selinux_label.as_deref();
    let shown =
        |l: Option<&str>| l.map_or_else(|| "no label".to_string(), |l| format!("label {l}"));
    let live = &volume.status.claims;
    let mut waiting = None;
    for r in live.read_claims.iter().chain(&live.write_claims) {
        if r.node != claim.spec.node
            || (r.claim == claim.metadata.name && r.allocation == claim.spec.allocation)
        {
            continue;
        }
        let Some(theirs) = label_of(r) else {
            continue;
        };
        if theirs.as_deref() == mine {
            continue;
        }
        let why = format!(
            "volume {} is mounted on node {} with SELinux {} (claim of allocation {}); this claim asks for {}",
            claim.spec.volume,
            claim.spec.node,
            shown(theirs.as_deref()),
            r.allocation,
            shown(mine)
        );
        // As the access modes: a conflict only with claims being released waits for
        // them; one with a live claim is a denial.
        if !ending(r) {
            return Err(Verdict::Deny(why));
        }
        waiting.get_or_insert(format!("{why}: waiting for its release"));
    }
    waiting.map_or(Ok(()), |w| Err(Verdict::Wait(w)))
}

/// The access-mode rules for `claim`, admitted by [`check`](super::check) as
/// `admitted`, against `volume`'s live claims (its own entry, if recorded already, left
/// out): what the controller checks inside the compare-and-swap that records the claim
/// on the volume.
///
/// A conflict only with holders that are being released (`ending`: their allocation
/// ended, stopped or is gone) is a wait, not a denial: the claim is admitted once they
/// leave (a container started again right after the last one stopped, a job's next
/// allocation). A conflict with any live holder is a denial naming it.
pub fn access_for(
    volume: &Volume,
    admitted: &Admitted,
    claim: &Claim,
    ending: impl Fn(&ClaimRef) -> bool,
) -> Result<(), Verdict> {
    let live = &volume.status.claims;
    let existing: Vec<ClaimRef> = live
        .read_claims
        .iter()
        .chain(&live.write_claims)
        .filter(|r| !(r.claim == claim.metadata.name && r.allocation == claim.spec.allocation))
        .cloned()
        .collect();
    let check = |holders: &[ClaimRef]| {
        access(
            &volume.spec,
            admitted.capability.access_mode,
            &claim.spec.node,
            claim.spec.mode,
            holders,
            admitted.multi_writer_cap,
        )
    };
    let Err(denied) = check(&existing) else {
        return Ok(());
    };
    let staying: Vec<ClaimRef> = existing.iter().filter(|r| !ending(r)).cloned().collect();
    match check(&staying) {
        Err(denied) => Err(Verdict::Deny(denied.to_string())),
        Ok(()) => Err(Verdict::Wait(format!("{denied}; waiting for its release"))),
    }
}

/// Whether a holder of a volume is being released, as [`access_for`]'s `ending` asks:
/// its claim (`holder`, as found) is marked for release or deleted, or its allocation
/// (`alloc`, absent when gone) no longer wants it. A holder not found is taken as
/// staying.
pub fn holder_ending(holder: Option<&Claim>, alloc: Option<&Allocation>) -> bool {
    holder.is_some_and(|h| h.spec.release || h.is_deleting() || !alloc.is_some_and(|a| a.wants(h)))
}

/// An access-mode rule that denies a claim, and the live claim it conflicts with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessDenied {
    /// The rule.
    pub cause: ClaimDenied,
    /// The claim holding the volume in the way (what a person asks next).
    pub holder: Option<ClaimRef>,
}

impl std::fmt::Display for AccessDenied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.cause)?;
        if let Some(h) = &self.holder {
            write!(
                f,
                " (held by allocation {} on node {}, {})",
                h.allocation,
                h.node,
                match h.mode {
                    ClaimMode::Read => "reading",
                    ClaimMode::Write => "writing",
                }
            )?;
        }
        Ok(())
    }
}
