//! The workload's own cgroup (v2): every process the workload starts stays in it,
//! whatever process group or session it moves to (a `setsid` child leaves the process
//! group the guard ends), so ending the cgroup ends all of the workload, and an empty
//! cgroup proves none of it is left.
//!
//! Expected flow:
//! 1. [`Cgroup::create`] finds the cgroup2 hierarchy in /proc/self/mountinfo (on a
//!    hybrid machine it is /sys/fs/cgroup/unified) and this process's cgroup in
//!    /proc/self/cgroup (`0::PATH`), and makes `moor-workload-<guard pid>` below it.
//! 2. The workload joins it between fork and exec: [`Cgroup::join_fd`] is opened
//!    before the fork, and the child writes `0` (itself) into it.
//! 3. At the end the guard signals every process in it, kills what is left through
//!    `cgroup.kill` (or one by one on a kernel without it), waits until `cgroup.events`
//!    says it is no longer populated, and removes it.
//!
//! Where no cgroup2 is writable (not root, a read-only /sys) the guard falls back to
//! the process group alone, and says so.

use std::fs;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

/// A cgroup of the workload's own.
pub(super) struct Cgroup {
    dir: PathBuf,
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

impl Cgroup {
    /// Makes `name` below this process's cgroup; why not, when it cannot.
    pub(super) fn create(name: &str) -> Result<Cgroup, String> {
        let mountinfo = fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| format!("cannot read /proc/self/mountinfo ({e})"))?;
        let mount = cgroup2_mount(&mountinfo).ok_or("no cgroup2 hierarchy is mounted")?;
        let cgroup = fs::read_to_string("/proc/self/cgroup")
            .map_err(|e| format!("cannot read /proc/self/cgroup ({e})"))?;
        let own = own_cgroup(&cgroup).ok_or("this process has no cgroup2 cgroup")?;
        let dir = mount.join(own.trim_start_matches('/')).join(name);
        fs::create_dir(&dir).map_err(|e| format!("cannot make {} ({e})", dir.display()))?;
        Ok(Cgroup { dir })
    }

    /// Its `cgroup.procs`, opened for writing (close-on-exec), for the child to join
    /// by writing `0` between fork and exec.
    pub(super) fn join_fd(&self) -> std::io::Result<OwnedFd> {
        let f = fs::OpenOptions::new()
            .write(true)
            .open(self.dir.join("cgroup.procs"))?;
        Ok(OwnedFd::from(f))
    }

    /// The processes in it.
    pub(super) fn pids(&self) -> Vec<i32> {
        fs::read_to_string(self.dir.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// Whether a process is left in it (`cgroup.events`; the process list when that
    /// cannot be read).
    pub(super) fn populated(&self) -> bool {
        match fs::read_to_string(self.dir.join("cgroup.events")) {
            Ok(events) => events.lines().any(|l| l == "populated 1"),
            Err(_) => !self.pids().is_empty(),
        }
    }

    /// Sends `sig` to every process in it.
    pub(super) fn signal(&self, sig: rustix::process::Signal) {
        for pid in self.pids() {
            if let Some(pid) = rustix::process::Pid::from_raw(pid) {
                let _ = rustix::process::kill_process(pid, sig);
            }
        }
    }

    /// Kills every process in it: `cgroup.kill` (Linux 5.14), else SIGKILL to each.
    pub(super) fn kill(&self) {
        if fs::write(self.dir.join("cgroup.kill"), "1").is_err() {
            self.signal(rustix::process::Signal::KILL);
        }
    }

    /// Where it is.
    pub(super) fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // Empty by now (the guard waited): a cgroup is removed with rmdir.
        let _ = fs::remove_dir(&self.dir);
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
}
