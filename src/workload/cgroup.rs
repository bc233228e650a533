//! The workload's own cgroup (v2): every process the workload starts stays in it,
//! whatever process group or session it moves to (a `setsid` child leaves the process
//! group the guard ends), so ending the cgroup ends all of the workload, and an empty
//! cgroup proves none of it is left.
//!
//! Expected flow:
//! 1. `moorctl alloc run` calls [`Cgroup::create`]: it finds the cgroup2 hierarchy in
//!    /proc/self/mountinfo (on a hybrid machine it is /sys/fs/cgroup/unified) and its
//!    own cgroup in /proc/self/cgroup (`0::PATH`), and makes
//!    `moor-workload-<owner>-<pid>-<random>` below it, `<owner>` being the allocation's
//!    [`owner_tag`]. Its path in the hierarchy
//!    ([`Cgroup::recorded`]) goes on the allocation, `spec.workload_cgroup`, in the
//!    write that says the workload runs; the controller copies it onto each claim when
//!    it releases it.
//! 2. The workload guard opens it ([`Cgroup::open`]) and the workload joins it between
//!    fork and exec: [`Cgroup::join_fd`] is opened before the fork, and the child
//!    writes `0` (itself) into it.
//! 3. At the end the guard signals every process in it, kills what is left through
//!    `cgroup.kill` (or one by one on a kernel without it), waits until `cgroup.events`
//!    says it is no longer populated, and removes it.
//! 4. If both moorctl processes died first (SIGKILL), the controller releases the
//!    claims once the runner's lease expires, and the node's agent, before
//!    NodeUnpublish, finds the recorded cgroup ([`Cgroup::find_recorded`]), kills what
//!    is left in it and unpublishes only once it is empty.
//!
//! Where no cgroup2 is writable (not root, a read-only /sys) the runner falls back to
//! the process group alone, and says so; nothing is recorded.
//!
//! A recorded path is a request, written by whoever may write the allocation: it is
//! trusted only in its shape ([`check_recorded`]: absolute, plain components, the last
//! one `moor-workload-…`, never a service's) and only for the allocation it was made
//! for ([`check_owned`]): its name carries [`owner_tag`] of the allocation's namespace,
//! name and node, a SHA-256 prefix no writer can match for another allocation. So an
//! allocation of another namespace or node that names a live workload's cgroup never
//! has it signalled; a cgroup made by a runner older than the tag is never signalled
//! either (its name proves nothing).

use std::fs;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

/// The prefix of every workload cgroup's name.
pub const PREFIX: &str = "moor-workload-";

/// The longest recorded path accepted.
pub const MAX_RECORDED: usize = 1024;

/// Hex digits of [`owner_tag`]: 96 bits of SHA-256, beyond any search for a second
/// allocation with the same tag.
pub const TAG_LEN: usize = 24;

/// The tag of the allocation `namespace/name` on `node` that its workload cgroup's
/// name carries. The parts are joined with a newline, which no name holds, so two
/// different allocations never hash the same text.
pub fn owner_tag(namespace: &str, allocation: &str, node: &str) -> String {
    crate::api::sha256_hex(&format!("{namespace}\n{allocation}\n{node}"), TAG_LEN / 2)
}

/// Whether `path`, recorded on an allocation, is a workload cgroup made for the
/// allocation whose [`owner_tag`] is `tag`: its shape ([`check_recorded`]) and its last
/// component `moor-workload-<tag>-…`. Why not, when it is not; the reason never
/// repeats the path.
pub fn check_owned(path: &str, tag: &str) -> Result<(), String> {
    check_recorded(path)?;
    let last = path.rsplit('/').next().unwrap_or_default();
    let owned = last
        .strip_prefix(PREFIX)
        .and_then(|rest| rest.strip_prefix(tag))
        .is_some_and(|rest| rest.starts_with('-'));
    if owned {
        Ok(())
    } else {
        Err("was not made for this allocation on this node (another allocation's, or a runner's older than the tag): nothing in it is signalled".into())
    }
}

/// A cgroup of the workload's own.
#[derive(Debug)]
pub struct Cgroup {
    dir: PathBuf,
    /// Its path in the hierarchy (`/…/moor-workload-…`).
    recorded: String,
    /// Removed (rmdir, once empty) on drop.
    owned: bool,
}

/// The mount point of the cgroup2 hierarchy in `mountinfo`.
fn cgroup2_mount(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let fstype = right.split(' ').next()?;
        let mount_point = left.split(' ').nth(4)?;
        (fstype == "cgroup2").then(|| PathBuf::from(mount_point))
    })
}

/// This process's cgroup in the v2 hierarchy (`0::PATH` of /proc/self/cgroup).
fn own_cgroup(cgroup: &str) -> Option<String> {
    cgroup
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(str::to_string)
}

/// This process's cgroup2 mount point.
fn mount() -> Result<PathBuf, String> {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| format!("cannot read /proc/self/mountinfo ({e})"))?;
    cgroup2_mount(&mountinfo).ok_or_else(|| "no cgroup2 hierarchy is mounted".to_string())
}

/// Whether `path` has the shape of a recorded workload cgroup: absolute, at most
/// [`MAX_RECORDED`] bytes, only plain components, the last one starting with
/// [`PREFIX`]. Why not, when it has not.
pub fn check_recorded(path: &str) -> Result<(), String> {
    if path.len() > MAX_RECORDED {
        return Err(format!("is longer than {MAX_RECORDED} bytes"));
    }
    let Some(rest) = path.strip_prefix('/') else {
        return Err("is not an absolute path in the cgroup hierarchy".into());
    };
    let parts: Vec<&str> = rest.split('/').collect();
    if parts
        .iter()
        .any(|c| c.is_empty() || *c == "." || *c == "..")
    {
        return Err("has a component that is not a plain name".into());
    }
    let last = parts.last().copied().unwrap_or_default();
    if !last.starts_with(PREFIX) || last.len() == PREFIX.len() {
        return Err(format!("does not end in a {PREFIX}… cgroup"));
    }
    Ok(())
}

impl Cgroup {
    /// Makes a workload cgroup below this process's cgroup for the allocation whose
    /// [`owner_tag`] is `tag`; why not, when it cannot.
    pub fn create(tag: &str) -> Result<Cgroup, String> {
        let mount = mount()?;
        let cgroup = fs::read_to_string("/proc/self/cgroup")
            .map_err(|e| format!("cannot read /proc/self/cgroup ({e})"))?;
        let own = own_cgroup(&cgroup).ok_or("this process has no cgroup2 cgroup")?;
        let name = format!(
            "{PREFIX}{tag}-{}-{:08x}",
            std::process::id(),
            fastrand::u32(..)
        );
        let recorded = format!("{}/{name}", own.trim_end_matches('/'));
        let dir = mount.join(recorded.trim_start_matches('/'));
        fs::create_dir(&dir).map_err(|e| format!("cannot make {} ({e})", dir.display()))?;
        Ok(Cgroup {
            dir,
            recorded,
            owned: true,
        })
    }

    /// The workload cgroup at `dir` (made by [`Cgroup::create`] in another process);
    /// removed on drop once empty.
    pub fn open(dir: &Path) -> Result<Cgroup, String> {
        if !dir.join("cgroup.procs").exists() {
            return Err(format!("{} is not a cgroup", dir.display()));
        }
        Ok(Cgroup {
            dir: dir.to_path_buf(),
            recorded: String::new(),
            owned: true,
        })
    }

    /// The cgroup recorded as `recorded` (a path in the hierarchy), as this process's
    /// cgroup2 mount shows it: `Ok(None)` when it is not there (removed once empty,
    /// or never seen from here); an error when the path is not a workload cgroup made
    /// for the allocation whose [`owner_tag`] is `tag` ([`check_owned`]) or no cgroup2
    /// hierarchy is mounted here.
    pub fn find_recorded(recorded: &str, tag: &str) -> Result<Option<Cgroup>, String> {
        check_owned(recorded, tag)?;
        let dir = mount()?.join(recorded.trim_start_matches('/'));
        if !dir.join("cgroup.procs").exists() {
            return Ok(None);
        }
        Ok(Some(Cgroup {
            dir,
            recorded: recorded.to_string(),
            owned: true,
        }))
    }

    /// Its path in the hierarchy, as recorded on the allocation.
    pub fn recorded(&self) -> &str {
        &self.recorded
    }

    /// Its `cgroup.procs`, opened for writing (close-on-exec), for the child to join
    /// by writing `0` between fork and exec.
    pub fn join_fd(&self) -> std::io::Result<OwnedFd> {
        let f = fs::OpenOptions::new()
            .write(true)
            .open(self.dir.join("cgroup.procs"))?;
        Ok(OwnedFd::from(f))
    }

    /// The processes in it.
    pub fn pids(&self) -> Vec<i32> {
        fs::read_to_string(self.dir.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// Whether a process is left in it (`cgroup.events`; the process list when that
    /// cannot be read).
    pub fn populated(&self) -> bool {
        match fs::read_to_string(self.dir.join("cgroup.events")) {
            Ok(events) => events.lines().any(|l| l == "populated 1"),
            Err(_) => !self.pids().is_empty(),
        }
    }

    /// Sends `sig` to every process in it.
    pub fn signal(&self, sig: rustix::process::Signal) {
        for pid in self.pids() {
            if let Some(pid) = rustix::process::Pid::from_raw(pid) {
                let _ = rustix::process::kill_process(pid, sig);
            }
        }
    }

    /// Kills every process in it: `cgroup.kill` (Linux 5.14), else SIGKILL to each.
    pub fn kill(&self) {
        if fs::write(self.dir.join("cgroup.kill"), "1").is_err() {
            self.signal(rustix::process::Signal::KILL);
        }
    }

    /// Kills what is left in it and waits, up to `within`, until it is empty; then
    /// removes it. Why not, when something is still in it at the end (a process in
    /// uninterruptible sleep, on the very volume perhaps).
    pub async fn end(self, within: std::time::Duration) -> Result<(), String> {
        let deadline = tokio::time::Instant::now() + within;
        while self.populated() {
            if tokio::time::Instant::now() >= deadline {
                return Err(format!(
                    "processes {:?} are still in it after SIGKILL",
                    self.pids()
                ));
            }
            self.kill();
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // A cgroup is removed with rmdir, which only an empty one allows.
        if self.owned {
            let _ = fs::remove_dir(&self.dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cgroup2_mount_and_own_cgroup_are_found() {
        let mountinfo = "30 22 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n\
            41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n\
            42 31 0:39 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";
        assert_eq!(
            cgroup2_mount(mountinfo),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        assert_eq!(
            cgroup2_mount("22 1 252:1 / / rw - ext4 /dev/vda1 rw\n"),
            None
        );
        let cgroup = "4:memory:/x\n1:cpu:/\n0::/user.slice/session-1.scope\n";
        assert_eq!(
            own_cgroup(cgroup).as_deref(),
            Some("/user.slice/session-1.scope")
        );
        assert_eq!(own_cgroup("4:memory:/x\n"), None);
    }

    #[test]
    fn only_a_workload_cgroup_s_path_is_accepted() {
        for good in [
            "/moor-workload-12-0a0b0c0d",
            "/user.slice/session-1.scope/moor-workload-7-00000001",
        ] {
            assert_eq!(check_recorded(good), Ok(()), "{good}");
        }
        for bad in [
            "",
            "moor-workload-1-2",
            "/",
            "/system.slice/sshd.service",
            "/x/../system.slice/moor-workload-1",
            "/x/./moor-workload-1",
            "/x//moor-workload-1",
            "/moor-workload-",
            "/moor-workload-1/",
        ] {
            assert!(check_recorded(bad).is_err(), "{bad:?} was accepted");
        }
        assert!(check_recorded(&format!("/{}{}", PREFIX, "a".repeat(MAX_RECORDED))).is_err());
    }

    #[test]
    fn a_cgroup_is_owned_only_by_the_allocation_it_was_made_for() {
        let mine = owner_tag("a", "web", "n1");
        assert_eq!(mine.len(), TAG_LEN);
        let path = format!("/user.slice/{PREFIX}{mine}-7-0000002a");
        assert_eq!(check_owned(&path, &mine), Ok(()));
        // Another namespace, name or node: another tag, and the path is refused.
        for (ns, name, node) in [("b", "web", "n1"), ("a", "web2", "n1"), ("a", "web", "n2")] {
            let theirs = owner_tag(ns, name, node);
            assert_ne!(theirs, mine, "{ns}/{name}@{node}");
            let err = check_owned(&path, &theirs).unwrap_err();
            assert!(
                !err.contains("user.slice"),
                "the reason repeats the path: {err}"
            );
        }
        // The parts cannot slide into each other: a.b/c is not a/b.c.
        assert_ne!(owner_tag("a.b", "c", "n"), owner_tag("a", "b.c", "n"));
        // A runner's older name (no tag) and a tag's prefix are refused; a bad shape too.
        assert!(check_owned(&format!("/{PREFIX}7-0000002a"), &mine).is_err());
        assert!(check_owned(&format!("/{PREFIX}{}-7-1", &mine[..TAG_LEN - 1]), &mine).is_err());
        assert!(check_owned(&format!("/{PREFIX}{mine}x-7-1"), &mine).is_err());
        assert!(check_owned("/system.slice/sshd.service", &mine).is_err());
    }
}
