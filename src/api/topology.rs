//! Topology: where a volume is accessible from, and where one to be created must or
//! should be.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A topology segment map, e.g. `{zone: z1}` (CSI `Topology`).
pub type Topology = BTreeMap<String, String>;

/// Where a volume to be created must (requisite) or should (preferred) be accessible.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopologyRequest {
    /// The volume must be accessible from one of these.
    #[serde(
        default,
        deserialize_with = "crate::api::tight_vec",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub required: Vec<Topology>,
    /// Preferred, in order.
    #[serde(
        default,
        deserialize_with = "crate::api::tight_vec",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub preferred: Vec<Topology>,
}
