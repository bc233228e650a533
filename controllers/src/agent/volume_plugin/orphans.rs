//! Callers whose Unmount never came: found by the mount table, never under a live
//! container.
//!
//! An engine bind-mounts the path Mount answered into the container's own mount
//! namespace. An endpoint allocation is in use while some mount namespace of this
//! machine other than the agent's own holds a mount of that path (the same device, and
//! a root at or below the path's place in its file system): every engine works that
//! way, and no engine API is needed.
//!
//! Expected flow, every `interval`:
//! 1. List this node's endpoint allocations that run and are older than `grace` (a
//!    Mount's answer reaches its container some time after it is given).
//! 2. For each whose volume is published here, look for a mount namespace using its
//!    path. In use: nothing. Not in use at two checks in a row: the caller is gone
//!    (its Unmount was missed while the agent was down, or it gave up waiting for a
//!    slow Mount): the allocation ends (complete), and the release goes on as usual.
//! 3. An engine's hold without callers at two checks in a row (its linger's end was
//!    lost with the agent's process) ends, whatever its age, unless a Mount joined it.
//!
//! The rule never releases under a holder it cannot see. A Mount whose engine this
//! agent cannot number (`SO_PEERCRED` gives pid 0: the engine runs in a PID namespace
//! the agent does not see into, as when the agent runs in a PID namespace of its own)
//! marks its allocation; the containers of such an engine are out of sight too, so the
//! rule keeps its claim and says why, with a Warning ([`blind_spot`]). An engine the
//! agent sees is the parent of its containers, whose processes it then sees as well.
//!
//! Bounds: a caller gone is released about `grace` + 2 × `interval` after its Mount at
//! the earliest (140 s + 60 s with the defaults; 120-174 s seen); a process that holds
//! a copy of the mount table made while the container ran (a `unshare -m` child, a
//! stuck `mount` helper) holds the claim as long as it lives, as a container would.

use std::collections::{BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use moor::api::*;
use moor::store::Store;

use super::hold::{end_unheld, hold_callers, is_hold};
use super::ops::{LABEL_CALLER, LABEL_NODE, LABEL_UNSEEN};

/// Where a path lives: its file system's device and the path within that file system.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Place {
    device: String,
    root: String,
}

/// One line of a mountinfo file: the device and root of the mount, and its mount point.
struct MountLine {
    device: String,
    root: String,
    mount_point: String,
}

/// Undoes mountinfo's octal escapes (`\040` for a space).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_mountinfo(text: &str) -> Vec<MountLine> {
    text.lines()
        .filter_map(|line| {
            let mut f = line.split(' ');
            let (_id, _parent) = (f.next()?, f.next()?);
            let device = f.next()?.to_string();
            let root = unescape(f.next()?);
            let mount_point = unescape(f.next()?);
            Some(MountLine {
                device,
                root,
                mount_point,
            })
        })
        .collect()
}

/// Where `path` lives, from this process's mount table: the mount with the longest
/// mount point that contains it.
fn place_of(path: &Path, own: &[MountLine]) -> Option<Place> {
    let path = path.canonicalize().ok()?;
    let p = path.to_str()?;
    let m = own
        .iter()
        .filter(|m| {
            p == m.mount_point
                || m.mount_point == "/"
                || p.strip_prefix(m.mount_point.as_str())
                    .is_some_and(|rest| rest.starts_with('/'))
        })
        .max_by_key(|m| m.mount_point.len())?;
    let rest = if m.mount_point == "/" {
        p.to_string()
    } else {
        p[m.mount_point.len()..].to_string()
    };
    let root = match (m.root.as_str(), rest.as_str()) {
        ("/", "") => "/".to_string(),
        ("/", r) => r.to_string(),
        (base, r) => format!("{base}{r}"),
    };
    Some(Place {
        device: m.device.clone(),
        root,
    })
}

/// Every mount namespace's table but this process's own, each read once.
fn other_namespaces() -> Vec<Vec<MountLine>> {
    let own = std::fs::read_link("/proc/self/ns/mnt").ok();
    let mut seen: HashSet<PathBuf> = own.into_iter().collect();
    let mut tables = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return tables;
    };
    for entry in dir.flatten() {
        let name = entry.file_name();
        if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(ns) = std::fs::read_link(entry.path().join("ns/mnt")) else {
            continue;
        };
        if !seen.insert(ns) {
            continue;
        }
        if let Ok(text) = std::fs::read_to_string(entry.path().join("mountinfo")) {
            tables.push(parse_mountinfo(&text));
        }
    }
    tables
}

/// Whether a mount in `tables` shows `place` (or something below it).
fn used(place: &Place, tables: &[Vec<MountLine>]) -> bool {
    tables.iter().flatten().any(|m| {
        m.device == place.device
            && (m.root == place.root
                || m.root
                    .strip_prefix(place.root.as_str())
                    .is_some_and(|rest| rest.starts_with('/'))
                || place.root == "/")
    })
}

/// Whether some other mount namespace of this machine uses `path`; `None` when that
/// cannot be told (the path is gone, or the mount table unreadable).
pub fn in_use(path: &Path) -> Option<bool> {
    let own = parse_mountinfo(&std::fs::read_to_string("/proc/self/mountinfo").ok()?);
    let place = place_of(path, &own)?;
    Some(used(&place, &other_namespaces()))
}

/// Why the rule cannot judge allocation `a`, if it cannot: its Mount came from an engine
/// whose processes this agent cannot see (a PID namespace it does not see into, as
/// when the agent runs in a PID namespace of its own), so neither can it see the
/// containers' mount namespaces.
pub fn blind_spot(a: &Allocation) -> Option<String> {
    a.metadata.labels.contains_key(LABEL_UNSEEN).then(|| {
        "its engine called from a PID namespace this agent cannot see into (an agent in a PID namespace of its own), so the containers' mount namespaces are out of its sight".to_string()
    })
}

/// Runs the rule until `shutdown`.
pub async fn watch(
    store: Store,
    node: NodeName,
    ns: Namespace,
    interval: Duration,
    grace: Duration,
    recorder: moor::runtime::events::Recorder,
    shutdown: CancellationToken,
) {
    // Allocations seen unused at the last check, by key.
    let mut suspects: BTreeSet<String> = BTreeSet::new();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        match check(&store, &node, &ns, grace, &suspects, &recorder).await {
            Ok(next) => suspects = next,
            Err(e) => {
                tracing::warn!(error = %moor::store::bounded_chain(&e), "volume-plugin: could not look for callers that are gone")
            }
        }
    }
}

/// One check; returns the allocations unused this time (ending those unused twice).
async fn check(
    store: &Store,
    node: &NodeName,
    ns: &Namespace,
    grace: Duration,
    suspects: &BTreeSet<String>,
    recorder: &moor::runtime::events::Recorder,
) -> Result<BTreeSet<String>, moor::store::StoreError> {
    let scope = KeyScope::<AllocationSpec>::namespace(ns).unwrap_or_else(KeyScope::all);
    let mut next = BTreeSet::new();
    for a in store.list(&scope).await?.items {
        let ours = a.metadata.labels.get(LABEL_NODE).map(String::as_str) == Some(node.as_str());
        let old = a
            .metadata
            .creation_timestamp
            .as_ref()
            .is_some_and(|t| t.elapsed() >= grace);
        if !ours || a.is_terminal() || a.spec.node != *node {
            continue;
        }
        // A hold left without callers (its linger's end lost with an agent restart):
        // ended once seen so at two checks in a row, guarded against a Mount meanwhile.
        if is_hold(&a) && hold_callers(&a).next().is_none() {
            let key = a.object_key().to_string();
            if !suspects.contains(&key) {
                next.insert(key);
                continue;
            }
            let ended = end_unheld(store, &a.object_key(), ClientStatus::Complete).await?;
            tracing::info!(allocation = %a.metadata.name, ended, "volume-plugin: a hold without callers since the last check ends");
            continue;
        }
        if !old {
            continue;
        }
        let Some(claim) = a.spec.volumes.first().and_then(|r| a.claim_name(r)) else {
            continue;
        };
        let claim_key = Claim::key_for(node, ns, &claim);
        let Some(mount) = store.try_get(&Mount::key_for(&claim_key)).await? else {
            continue;
        };
        if !mount.status.published {
            continue;
        }
        let caller = a
            .metadata
            .labels
            .get(LABEL_CALLER)
            .map(String::as_str)
            .into_iter()
            .chain(hold_callers(&a))
            .collect::<Vec<_>>()
            .join(", ");
        if let Some(why) = blind_spot(&a) {
            // Never a release under a holder it cannot see: kept, and said (the
            // recorder folds the repeats of every check into one event).
            let volume = a
                .spec
                .volumes
                .first()
                .map(|r| r.volume.to_string())
                .unwrap_or_default();
            recorder
                .record(
                    crate::common::object_ref(&a),
                    EventType::Warning,
                    "Caller not seen",
                    format!(
                        "volume-plugin: cannot tell whether caller {caller} still uses volume {volume}: {why}; its claim is kept (its Unmount, or moorctl alloc stop, ends it)"
                    ),
                    crate::common::details([
                        ("volume_id", volume.clone()),
                        ("caller", caller.to_string()),
                    ]),
                )
                .await;
            continue;
        }
        let path = PathBuf::from(&mount.spec.target_path);
        let unused = tokio::task::spawn_blocking(move || in_use(&path))
            .await
            .ok()
            .flatten()
            == Some(false);
        if !unused {
            continue;
        }
        let key = a.object_key().to_string();
        if !suspects.contains(&key) {
            next.insert(key);
            continue;
        }
        tracing::warn!(
            allocation = %a.metadata.name,
            caller = %caller,
            "volume-plugin: no container uses the volume any more (its Unmount never came); ending its allocation"
        );
        let r = moor::workload::end(
            store,
            &a.object_key(),
            moor::workload::End::Ended(ClientStatus::Complete, None),
        )
        .await;
        if let Err(e) = r {
            if !matches!(e, moor::store::StoreError::NotFound { .. }) {
                return Err(e);
            }
        }
    }
    Ok(next)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OWN: &str = "22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw\n\
        30 22 0:25 / /tmp rw shared:2 - tmpfs tmpfs rw\n\
        40 22 252:1 /srv/plugin/vol-1 /var/mnt/pub/x rw - ext4 /dev/vda1 rw\n";

    #[test]
    fn a_path_s_place_is_its_file_system_s_device_and_root() {
        let own = parse_mountinfo(OWN);
        // A plain directory under the root file system.
        let p = place_of(Path::new("/"), &own).unwrap();
        assert_eq!(
            p,
            Place {
                device: "252:1".into(),
                root: "/".into()
            }
        );
        // The escapes of mountinfo are undone.
        assert_eq!(unescape("/a\\040b"), "/a b");
    }

    #[test]
    fn a_mount_of_the_place_or_below_it_is_a_use() {
        let place = Place {
            device: "252:1".into(),
            root: "/srv/plugin/vol-1".into(),
        };
        let container =
            parse_mountinfo("100 90 252:1 /srv/plugin/vol-1 /data rw - ext4 /dev/vda1 rw\n");
        let below =
            parse_mountinfo("100 90 252:1 /srv/plugin/vol-1/sub /data rw - ext4 /dev/vda1 rw\n");
        let other =
            parse_mountinfo("100 90 252:1 /srv/plugin/vol-10 /data rw - ext4 /dev/vda1 rw\n");
        let other_dev = parse_mountinfo("100 90 0:44 /srv/plugin/vol-1 /data rw - tmpfs t rw\n");
        assert!(used(&place, &[container]));
        assert!(used(&place, &[below]));
        assert!(!used(&place, &[other]));
        assert!(!used(&place, &[other_dev]));
    }
}
