//! Access and attachment modes, and the claim rules that follow from them.

use serde::{Deserialize, Serialize};
use std::fmt;

use super::NodeName;

/// How a volume may be shared (CSI `VolumeCapability.AccessMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AccessMode {
    /// Read-only on one node.
    SingleNodeReaderOnly,
    /// Read-write by one writer on one node.
    SingleNodeWriter,
    /// Read-only on any number of nodes.
    MultiNodeReaderOnly,
    /// One writer, any number of readers, on any number of nodes.
    MultiNodeSingleWriter,
    /// Any number of writers on any number of nodes.
    MultiNodeMultiWriter,
    /// One claim at a time, reading or writing, on one node (Kubernetes'
    /// ReadWriteOncePod). Needs the plugin's SINGLE_NODE_MULTI_WRITER capability.
    SingleNodeSingleWriter,
    /// Any number of claims, writers included, on one node. Needs the plugin's
    /// SINGLE_NODE_MULTI_WRITER capability.
    SingleNodeMultiWriter,
}

/// How a volume is presented to the workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AttachmentMode {
    /// A mounted filesystem (CSI `MountVolume`).
    FileSystem,
    /// A raw block device (CSI `BlockVolume`).
    BlockDevice,
}

/// Whether a claim reads or writes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ClaimMode {
    /// Published read-only (the default: nothing writes unless it asks to).
    #[default]
    Read,
    /// Published read-write.
    Write,
}

/// Why a claim cannot be granted beside the claims that already hold the volume.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClaimDenied {
    /// A writer asked for a mode that only reads.
    #[error("access mode {0} is read-only; a write claim is not allowed")]
    ReadOnlyMode(AccessMode),
    /// A single-node mode already in use on another node.
    #[error("access mode {mode} allows one node and the volume is in use on node {node}")]
    OtherNode {
        /// The volume's mode.
        mode: AccessMode,
        /// The node that holds the volume.
        node: NodeName,
    },
    /// A single-writer mode that already has its writer.
    #[error("access mode {0} allows one writer and the volume already has one")]
    WriterTaken(AccessMode),
    /// A one-claim mode that already has its claim.
    #[error("access mode {0} allows one claim at a time and the volume already has one")]
    ClaimTaken(AccessMode),
    /// A single-node mode whose plugin cannot publish it at a second target path on
    /// the node (the spec's NodePublishVolume table: FAILED_PRECONDITION unless the
    /// mode is MULTI_NODE or SINGLE_NODE_MULTI_WRITER), with a claim there already.
    #[error(
        "access mode {0} is published once per node where the plugin does not advertise \
         SINGLE_NODE_MULTI_WRITER, and the volume already has a claim on this node"
    )]
    OncePerNode(AccessMode),
}

impl AccessMode {
    /// Every mode, in the order the CSI spec numbers them.
    pub const ALL: [AccessMode; 7] = [
        AccessMode::SingleNodeWriter,
        AccessMode::SingleNodeReaderOnly,
        AccessMode::MultiNodeReaderOnly,
        AccessMode::MultiNodeSingleWriter,
        AccessMode::MultiNodeMultiWriter,
        AccessMode::SingleNodeSingleWriter,
        AccessMode::SingleNodeMultiWriter,
    ];

    /// The mode as it is written in manifests.
    pub fn as_str(self) -> &'static str {
        match self {
            AccessMode::SingleNodeReaderOnly => "single-node-reader-only",
            AccessMode::SingleNodeWriter => "single-node-writer",
            AccessMode::MultiNodeReaderOnly => "multi-node-reader-only",
            AccessMode::MultiNodeSingleWriter => "multi-node-single-writer",
            AccessMode::MultiNodeMultiWriter => "multi-node-multi-writer",
            AccessMode::SingleNodeSingleWriter => "single-node-single-writer",
            AccessMode::SingleNodeMultiWriter => "single-node-multi-writer",
        }
    }

    /// Whether the plugin must advertise SINGLE_NODE_MULTI_WRITER (on its controller
    /// and node services) for moor to use the mode: the spec's two newer single-node
    /// modes.
    pub fn needs_single_node_multi_writer(self) -> bool {
        matches!(
            self,
            AccessMode::SingleNodeSingleWriter | AccessMode::SingleNodeMultiWriter
        )
    }

    /// Whether every claim must be on one node.
    pub fn is_single_node(self) -> bool {
        matches!(
            self,
            AccessMode::SingleNodeReaderOnly
                | AccessMode::SingleNodeWriter
                | AccessMode::SingleNodeSingleWriter
                | AccessMode::SingleNodeMultiWriter
        )
    }

    /// Whether the spec lets a plugin publish a volume of this mode at several target
    /// paths on one node: the MULTI_NODE modes and SINGLE_NODE_MULTI_WRITER.
    pub fn shares_a_node(self) -> bool {
        !self.is_single_node() || self == AccessMode::SingleNodeMultiWriter
    }

    /// The mode sent to a plugin for a volume used in this mode, given whether the
    /// service called advertises SINGLE_NODE_MULTI_WRITER (`multi_writer_cap`): there,
    /// single-node-writer and single-node-reader-only volumes are sent as
    /// SINGLE_NODE_MULTI_WRITER, the mode under which the spec allows their claims on
    /// one node to be published at several target paths (as Kubernetes sends
    /// ReadWriteOnce). Every call about a volume uses the same mapping, so the volume is
    /// created, validated, attached, staged and published as what it is used as.
    /// Readers stay read-only: the readonly flags follow the claims, not the mode.
    pub fn as_sent(self, multi_writer_cap: bool) -> AccessMode {
        match self {
            AccessMode::SingleNodeWriter | AccessMode::SingleNodeReaderOnly if multi_writer_cap => {
                AccessMode::SingleNodeMultiWriter
            }
            m => m,
        }
    }

    /// Whether a claim may write.
    pub fn allows_write(self) -> bool {
        !matches!(
            self,
            AccessMode::SingleNodeReaderOnly | AccessMode::MultiNodeReaderOnly
        )
    }

    /// Whether at most one claim may write.
    pub fn single_writer(self) -> bool {
        matches!(
            self,
            AccessMode::SingleNodeWriter
                | AccessMode::MultiNodeSingleWriter
                | AccessMode::SingleNodeSingleWriter
        )
    }

    /// The claim rules: may a claim `(node, mode)` join the `existing` live claims
    /// `(node, mode)` of a volume used in this access mode, where the plugin on the
    /// claim's node advertises SINGLE_NODE_MULTI_WRITER or not (`multi_writer_cap`)?
    ///
    /// Every mode admits readers but single-node-single-writer, which admits one claim
    /// at a time; the single-node modes keep all claims on one node, and those the
    /// plugin cannot publish at a second target path there ([`AccessMode::as_sent`]
    /// not [`AccessMode::shares_a_node`]) admit one claim on it; the single-writer
    /// modes admit one writer; the reader-only modes admit none.
    pub fn admit<'a>(
        self,
        node: &NodeName,
        mode: ClaimMode,
        existing: impl IntoIterator<Item = (&'a NodeName, ClaimMode)>,
        multi_writer_cap: bool,
    ) -> Result<(), ClaimDenied> {
        if mode == ClaimMode::Write && !self.allows_write() {
            return Err(ClaimDenied::ReadOnlyMode(self));
        }
        for (other_node, other_mode) in existing {
            if self == AccessMode::SingleNodeSingleWriter {
                return Err(ClaimDenied::ClaimTaken(self));
            }
            if self.is_single_node() && other_node != node {
                return Err(ClaimDenied::OtherNode {
                    mode: self,
                    node: other_node.clone(),
                });
            }
            if other_node == node && !self.as_sent(multi_writer_cap).shares_a_node() {
                return Err(ClaimDenied::OncePerNode(self));
            }
            if self.single_writer() && mode == ClaimMode::Write && other_mode == ClaimMode::Write {
                return Err(ClaimDenied::WriterTaken(self));
            }
        }
        Ok(())
    }
}

impl fmt::Display for AccessMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl AttachmentMode {
    /// The mode as it is written in manifests.
    pub fn as_str(self) -> &'static str {
        match self {
            AttachmentMode::FileSystem => "file-system",
            AttachmentMode::BlockDevice => "block-device",
        }
    }
}

impl fmt::Display for AttachmentMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Display for ClaimMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ClaimMode::Read => "read",
            ClaimMode::Write => "write",
        })
    }
}

/// One way a volume can be used: an access mode with an attachment mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct VolumeCapability {
    /// How the volume may be shared.
    pub access_mode: AccessMode,
    /// How it is presented.
    pub attachment_mode: AttachmentMode,
}

impl VolumeCapability {
    /// The capability as sent to a service that advertises SINGLE_NODE_MULTI_WRITER
    /// or not ([`AccessMode::as_sent`]).
    pub fn as_sent(self, multi_writer_cap: bool) -> VolumeCapability {
        VolumeCapability {
            access_mode: self.access_mode.as_sent(multi_writer_cap),
            ..self
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use AccessMode::*;
    use ClaimMode::*;

    fn n(s: &str) -> NodeName {
        NodeName::new(s).unwrap()
    }

    #[test]
    fn modes_serialise_as_kebab_case() {
        for m in AccessMode::ALL {
            let json = serde_json::to_string(&m).unwrap();
            assert_eq!(json, format!("\"{}\"", m.as_str()));
            assert_eq!(serde_json::from_str::<AccessMode>(&json).unwrap(), m);
        }
        assert!(serde_json::from_str::<AccessMode>("\"single-node\"").is_err());
    }

    #[test]
    fn single_node_modes_deny_a_second_node() {
        let (a, b) = (n("a"), n("b"));
        for mode in [SingleNodeReaderOnly, SingleNodeWriter] {
            assert!(mode.admit(&a, Read, [(&a, Read)], true).is_ok());
            assert!(matches!(
                mode.admit(&b, Read, [(&a, Read)], true),
                Err(ClaimDenied::OtherNode { .. })
            ));
        }
        assert!(MultiNodeReaderOnly
            .admit(&b, Read, [(&a, Read)], true)
            .is_ok());
    }

    #[test]
    fn single_node_single_writer_admits_one_claim_at_a_time_anywhere() {
        let (a, b) = (n("a"), n("b"));
        let m = SingleNodeSingleWriter;
        assert!(m.admit(&a, Write, [], true).is_ok());
        assert!(m.admit(&a, Read, [], true).is_ok());
        for (node, mode) in [(&a, Read), (&a, Write), (&b, Read)] {
            assert_eq!(
                m.admit(node, mode, [(&a, Write)], true),
                Err(ClaimDenied::ClaimTaken(m)),
                "{node} {mode}"
            );
        }
        assert_eq!(
            m.admit(&a, Read, [(&a, Read)], true),
            Err(ClaimDenied::ClaimTaken(m))
        );
        assert!(m.is_single_node() && m.allows_write() && m.single_writer());
        assert!(m.needs_single_node_multi_writer());
    }

    #[test]
    fn single_node_multi_writer_admits_writers_on_its_one_node() {
        let (a, b) = (n("a"), n("b"));
        let m = SingleNodeMultiWriter;
        assert!(m.admit(&a, Write, [(&a, Write), (&a, Read)], true).is_ok());
        assert!(matches!(
            m.admit(&b, Write, [(&a, Write)], true),
            Err(ClaimDenied::OtherNode { .. })
        ));
        assert!(!m.single_writer() && m.needs_single_node_multi_writer());
        assert!(!SingleNodeWriter.needs_single_node_multi_writer());
    }

    #[test]
    fn without_single_node_multi_writer_a_single_node_mode_has_one_claim_per_node() {
        let (a, b) = (n("a"), n("b"));
        for m in [SingleNodeWriter, SingleNodeReaderOnly] {
            assert_eq!(m.as_sent(true), SingleNodeMultiWriter);
            assert_eq!(m.as_sent(false), m);
            assert!(!m.shares_a_node() && m.as_sent(true).shares_a_node());
            assert!(m.admit(&a, Read, [(&a, Read)], true).is_ok());
            assert_eq!(
                m.admit(&a, Read, [(&a, Read)], false),
                Err(ClaimDenied::OncePerNode(m))
            );
            // The other node is named first: that is the rule a user can act on.
            assert!(matches!(
                m.admit(&b, Read, [(&a, Read)], false),
                Err(ClaimDenied::OtherNode { .. })
            ));
            assert!(m.admit(&a, Read, [], false).is_ok());
        }
        for m in [
            MultiNodeReaderOnly,
            MultiNodeSingleWriter,
            MultiNodeMultiWriter,
        ] {
            assert!(m.shares_a_node() && m.as_sent(false) == m && m.as_sent(true) == m);
            assert!(m.admit(&a, Read, [(&a, Read)], false).is_ok());
        }
        assert_eq!(SingleNodeSingleWriter.as_sent(true), SingleNodeSingleWriter);
        assert!(!SingleNodeSingleWriter.shares_a_node());
        assert!(SingleNodeMultiWriter
            .admit(&a, Write, [(&a, Write)], true)
            .is_ok());
    }

    #[test]
    fn single_writer_modes_deny_a_second_writer_but_admit_readers() {
        let (a, b) = (n("a"), n("b"));
        assert_eq!(
            SingleNodeWriter.admit(&a, Write, [(&a, Write)], true),
            Err(ClaimDenied::WriterTaken(SingleNodeWriter))
        );
        assert!(SingleNodeWriter
            .admit(&a, Read, [(&a, Write)], true)
            .is_ok());
        assert_eq!(
            MultiNodeSingleWriter.admit(&b, Write, [(&a, Write)], true),
            Err(ClaimDenied::WriterTaken(MultiNodeSingleWriter))
        );
        assert!(MultiNodeSingleWriter
            .admit(&b, Write, [(&a, Read)], true)
            .is_ok());
        assert!(MultiNodeMultiWriter
            .admit(&b, Write, [(&a, Write), (&b, Write)], true)
            .is_ok());
    }

    #[test]
    fn reader_only_modes_deny_writers() {
        let a = n("a");
        for mode in [SingleNodeReaderOnly, MultiNodeReaderOnly] {
            assert_eq!(
                mode.admit(&a, Write, [], true),
                Err(ClaimDenied::ReadOnlyMode(mode))
            );
        }
    }
}
