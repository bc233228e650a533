//! Sockets handed over by systemd's socket activation (`sd_listen_fds(3)`): a socket
//! unit binds the volume-plugin sockets before the engines start at boot, and keeps
//! them while the agent restarts, so an engine's call waits in the socket's backlog
//! instead of finding no socket.
//!
//! The protocol: when `LISTEN_PID` is this process's pid, file descriptors 3 to
//! 3 + `LISTEN_FDS` - 1 are sockets the service manager passed. They are taken once per
//! process, each as a unix listener with the path it is bound to (a descriptor that is
//! not a unix stream listener bound to a path is closed and logged); a server asks for
//! the one bound to its path ([`take`]) and binds the path itself when none is.
//! This module is the crate's second with unsafe code: taking ownership of an
//! inherited descriptor by number has no safe form.
#![allow(unsafe_code)]

use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// The first descriptor the protocol passes.
const FIRST: i32 = 3;
/// More than any unit passes; a larger count is refused as malformed.
const MOST: i32 = 64;

static INHERITED: OnceLock<Mutex<Vec<(PathBuf, UnixListener)>>> = OnceLock::new();

/// How many descriptors the environment says were passed to this process: `None` when
/// not activated (no variables, or another process's), or when malformed.
fn passed(pid: Option<&str>, fds: Option<&str>, own: u32) -> Option<i32> {
    let pid: u32 = pid?.trim().parse().ok()?;
    if pid != own {
        return None;
    }
    let n: i32 = fds?.trim().parse().ok()?;
    (1..=MOST).contains(&n).then_some(n)
}

fn inherited() -> &'static Mutex<Vec<(PathBuf, UnixListener)>> {
    INHERITED.get_or_init(|| {
        let n = passed(
            std::env::var("LISTEN_PID").ok().as_deref(),
            std::env::var("LISTEN_FDS").ok().as_deref(),
            std::process::id(),
        );
        let mut out = Vec::new();
        for fd in FIRST..FIRST + n.unwrap_or(0) {
            // SAFETY: LISTEN_PID names this process, so by the protocol descriptors
            // 3..3+LISTEN_FDS are open and were given to it; nothing else in the
            // process owns them (an open made since got another number, these being
            // open), and this runs once (OnceLock), so each is owned exactly once.
            let owned = unsafe { OwnedFd::from_raw_fd(fd) };
            let _ = rustix::io::fcntl_setfd(&owned, rustix::io::FdFlags::CLOEXEC);
            let listener = UnixListener::from(owned);
            match listener.local_addr() {
                Ok(addr) => match addr.as_pathname() {
                    Some(path) => out.push((path.to_path_buf(), listener)),
                    None => tracing::warn!(fd, "socket activation: a passed socket is not bound to a path; closed"),
                },
                Err(e) => tracing::warn!(fd, error = %e, "socket activation: a passed descriptor is not a unix socket; closed"),
            }
        }
        if !out.is_empty() {
            tracing::info!(sockets = ?out.iter().map(|(p, _)| p.display().to_string()).collect::<Vec<_>>(), "socket activation: sockets passed by the service manager");
        }
        Mutex::new(out)
    })
}

/// The listener the service manager passed for `path`, once: `None` when this process
/// was not socket-activated or no passed socket is bound there.
pub fn take(path: &Path) -> Option<UnixListener> {
    let mut inherited = inherited().lock().unwrap_or_else(|p| p.into_inner());
    let i = inherited.iter().position(|(p, _)| p == path)?;
    Some(inherited.swap_remove(i).1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_this_process_s_well_formed_variables_count() {
        assert_eq!(passed(Some("42"), Some("2"), 42), Some(2));
        assert_eq!(passed(Some("41"), Some("2"), 42), None, "another process's");
        assert_eq!(passed(None, Some("2"), 42), None);
        assert_eq!(passed(Some("42"), None, 42), None);
        assert_eq!(passed(Some("42"), Some("x"), 42), None);
        assert_eq!(passed(Some("42"), Some("0"), 42), None);
        assert_eq!(passed(Some("42"), Some("-3"), 42), None);
        assert_eq!(passed(Some("42"), Some("100000"), 42), None);
    }
}
