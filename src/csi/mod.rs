//! moor's side of CSI: the typed client the reconcilers call plugins through, the call
//! policy (deadlines, retries, what each answer means), conversions from moor's types,
//! the requests each RPC is sent with ([`requests`]) and the rules the live contract
//! monitor checks each answer against ([`contract`]). The protocol itself is the
//! `moor-csi` crate, re-exported here.
//!
//! # Layout
//! - [`client`]: the typed client, one method per RPC moor drives.
//! - `listing`: the client's whole listings of a plugin's volumes for the survey,
//!   checked against what moor expects.
//! - [`policy`]: the call policy: deadlines, tries, and the class of each answer.
//! - [`requests`]: every request that carries secrets or a capability, built without
//!   I/O.
//! - [`convert`]: conversions between moor's types and CSI messages.
//! - [`contract`]: the rules the live contract monitor checks each answer against.

pub mod client;
pub mod contract;
pub mod convert;
mod listing;
pub mod policy;
pub mod requests;

pub use moor_csi::{channel, v1, EndpointError};
