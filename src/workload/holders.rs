//! Which processes use a mount, found as `fuser -m` finds them: every process whose
//! working directory, root directory, executable or an open file is below the mount's
//! path, or, where the mount is a file system of its own, on that file system (a
//! process in a container sees the volume at another path; its files still report the
//! volume's device). Read from `/proc`; a process that ends during the scan is skipped.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::api::{MountHolder, MAX_HOLDERS};

/// The processes using the mount at `target`, at most [`MAX_HOLDERS`] (lowest process
/// ids first), this process excluded.
pub fn holders(target: &Path) -> Vec<MountHolder> {
    holders_in(Path::new("/proc"), target)
}

fn holders_in(proc: &Path, target: &Path) -> Vec<MountHolder> {
    // The mount's own device, when it differs from the directory it is mounted on: a
    // file system of its own, recognised whatever path a process reaches it by.
    let device = match (target.metadata(), target.parent().map(Path::metadata)) {
        (Ok(t), Some(Ok(parent))) if t.dev() != parent.dev() => Some(t.dev()),
        _ => None,
    };
    let uses = |link: &Path| {
        std::fs::read_link(link).is_ok_and(|p| p.starts_with(target))
            || device.is_some_and(|d| link.metadata().is_ok_and(|m| m.dev() == d))
    };
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir(proc) else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter(|pid| *pid != me)
        .collect();
    pids.sort_unstable();
    let mut found = Vec::new();
    for pid in pids {
        let dir = proc.join(pid.to_string());
        let held = ["cwd", "root", "exe"].iter().any(|l| uses(&dir.join(l)))
            || std::fs::read_dir(dir.join("fd"))
                .map(|fds| fds.flatten().any(|fd| uses(&fd.path())))
                .unwrap_or(false);
        if !held {
            continue;
        }
        let command = std::fs::read_to_string(dir.join("comm"))
            .map(|c| c.trim().chars().take(64).collect())
            .unwrap_or_default();
        found.push(MountHolder { pid, command });
        if found.len() == MAX_HOLDERS {
            break;
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_working_below_the_path_holds_it_and_one_elsewhere_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target");
        std::fs::create_dir(&target).unwrap();
        let mut inside = std::process::Command::new("sleep")
            .arg("30")
            .current_dir(&target)
            .spawn()
            .unwrap();
        let mut outside = std::process::Command::new("sleep")
            .arg("30")
            .current_dir(dir.path())
            .spawn()
            .unwrap();
        let found = holders(&target);
        let _ = (inside.kill(), outside.kill());
        let _ = (inside.wait(), outside.wait());
        assert!(
            found
                .iter()
                .any(|h| h.pid == inside.id() && h.command == "sleep"),
            "{found:?}"
        );
        assert!(found.iter().all(|h| h.pid != outside.id()), "{found:?}");
        assert!(holders(&target).iter().all(|h| h.pid != inside.id()));
    }
}
