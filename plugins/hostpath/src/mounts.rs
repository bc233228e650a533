//! Bind mounts, read from and checked against `/proc/self/mountinfo`. With `no_mount`
//! every function keeps its rules but touches no mount table.

use std::io;
use std::path::Path;

/// Decodes the octal escapes mountinfo uses for spaces, tabs, newlines and backslashes.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 4 <= bytes.len() {
            if let Ok(n) = u8::from_str_radix(&field[i + 1..i + 4], 8) {
                out.push(n);
                i += 4;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether `path` is a mount point (its own entry in mountinfo).
pub fn is_mount_point(path: &Path) -> io::Result<bool> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    let want = path.to_string_lossy();
    Ok(info.lines().any(|line| {
        line.split(' ')
            .nth(4)
            .is_some_and(|mp| unescape(mp) == want.as_ref())
    }))
}

/// Bind-mounts `source` on `target` (read-only when asked). A target that is already a
/// mount point is reused, not mounted twice.
pub fn bind(source: &Path, target: &Path, readonly: bool, no_mount: bool) -> io::Result<()> {
    if no_mount || is_mount_point(target)? {
        return Ok(());
    }
    rustix::mount::mount_bind(source, target)?;
    if readonly {
        use rustix::mount::MountFlags;
        if let Err(e) =
            rustix::mount::mount_remount(target, MountFlags::BIND | MountFlags::RDONLY, "")
        {
            let _ = rustix::mount::unmount(target, rustix::mount::UnmountFlags::empty());
            return Err(e.into());
        }
    }
    Ok(())
}

/// Attaches `file` to a free loop device (`losetup --find --show`); returns the device.
pub fn loop_attach(file: &Path) -> io::Result<std::path::PathBuf> {
    let out = std::process::Command::new("losetup")
        .args(["--find", "--show"])
        .arg(file)
        .output()?;
    let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || dev.is_empty() {
        return Err(io::Error::other(format!(
            "losetup --find --show {}: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(dev.into())
}

/// Detaches loop device `dev` (one already detached is done).
pub fn loop_detach(dev: &Path) -> io::Result<()> {
    let out = std::process::Command::new("losetup")
        .arg("--detach")
        .arg(dev)
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.success()
        || err.contains("No such device")
        || err.contains("No such device or address")
    {
        return Ok(());
    }
    Err(io::Error::other(format!(
        "losetup --detach {}: {}",
        dev.display(),
        err.trim()
    )))
}

/// Unmounts `target` if it is a mount point.
pub fn unmount(target: &Path, no_mount: bool) -> io::Result<()> {
    if no_mount || !target.exists() || !is_mount_point(target)? {
        return Ok(());
    }
    rustix::mount::unmount(target, rustix::mount::UnmountFlags::empty())?;
    Ok(())
}

/// Whether the tests mount for real: as root, always (CI runs as root). Not as root,
/// only when `MOOR_TESTS_NO_MOUNT=1` says to run without mounting (the mount checks
/// then skip); otherwise this fails the test, so that a check that cannot run never
/// passes silently.
pub fn can_mount() -> bool {
    let root = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(2) == Some("0"))
        })
        .unwrap_or(false);
    if root {
        return true;
    }
    assert!(
        std::env::var_os("MOOR_TESTS_NO_MOUNT").is_some_and(|v| v == "1"),
        "these tests mount for real and need root (CI runs them as root); set \
         MOOR_TESTS_NO_MOUNT=1 to run them without mounting, skipping the mount checks"
    );
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_decoded() {
        assert_eq!(unescape(r"/a\040b"), "/a b");
        assert_eq!(unescape(r"/x\134y"), r"/x\y");
        assert_eq!(unescape("/plain"), "/plain");
        assert_eq!(unescape(r"/trailing\04"), r"/trailing\04");
    }

    #[test]
    fn root_is_a_mount_point_and_a_temp_dir_is_not() {
        assert!(is_mount_point(Path::new("/")).unwrap());
        let d = tempfile::tempdir().unwrap();
        assert!(!is_mount_point(d.path()).unwrap());
    }
}
