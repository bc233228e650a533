//! The workload as a child process: spawned with the allocation's environment under
//! the workload guard (`guard.rs`: CMD in a process group of its own, ended whole),
//! passed SIGINT, SIGTERM and SIGHUP, ended with SIGTERM if the runner dies, and its
//! exit read as a code or a signal (the guard exits as CMD did).

use moor::api::*;

use super::*;

/// Resolves on the first SIGINT, SIGTERM or SIGHUP (never, if they cannot be caught).
pub(super) async fn interrupted() {
    use futures::StreamExt;
    let mut streams = Vec::new();
    for (kind, _) in FORWARDED {
        if let Ok(mut s) = tokio::signal::unix::signal(kind) {
            streams.push(futures::stream::poll_fn(move |cx| s.poll_recv(cx)).boxed());
        }
    }
    if streams.is_empty() {
        return std::future::pending().await;
    }
    futures::stream::select_all(streams).next().await;
}

/// How long what is left of the workload has after SIGTERM before SIGKILL: a third of
/// the lease's TTL, at most 10 s (the controller releases a dead runner's claims only
/// after the whole TTL and this grace).
pub(super) fn grace(lease_ttl: Duration) -> Duration {
    moor::api::workload_grace(lease_ttl)
}

/// Runs CMD under the workload guard with `env` added, passing SIGINT, SIGTERM and
/// SIGHUP on to it; returns when CMD and everything it left in its process group have
/// ended.
#[allow(unsafe_code)]
pub(super) async fn spawn_and_wait(
    command: &[String],
    env: &BTreeMap<String, String>,
    grace: Duration,
    cgroup: Option<&std::path::Path>,
    stop: Stop,
) -> std::io::Result<std::process::ExitStatus> {
    use futures::StreamExt;
    let mut cmd = tokio::process::Command::new(std::env::current_exe()?);
    cmd.arg("__workload-guard")
        .arg(format!("--runner={}", std::process::id()))
        .arg(format!("--grace={}ms", grace.as_millis()))
        .arg(format!(
            "--kill-timeout={}ms",
            stop.kill_timeout.as_millis()
        ));
    if let Some(dir) = cgroup {
        cmd.arg("--cgroup").arg(dir);
    }
    cmd.arg("--").args(command).envs(env);
    // SAFETY: the closure runs in the child between fork and exec and makes one system
    // call (prctl), which is async-signal-safe; it allocates and locks nothing.
    unsafe {
        cmd.pre_exec(|| {
            // If the runner dies (SIGKILL, a crash), the guard is told (SIGTERM) and
            // ends the workload's whole process group instead of letting it write on
            // into a volume the controller is about to release as lost.
            rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::TERM))
                .map_err(std::io::Error::from)
        });
    }
    let mut child = cmd.spawn()?;
    let pid = child
        .id()
        .and_then(|id| rustix::process::Pid::from_raw(id as i32));
    let mut signals = Vec::new();
    for (kind, sig) in FORWARDED {
        let mut s = tokio::signal::unix::signal(kind)?;
        signals.push(
            futures::stream::poll_fn(move |cx| s.poll_recv(cx))
                .map(move |_| sig)
                .boxed(),
        );
    }
    let mut signals = futures::stream::select_all(signals);
    let mut asked = std::pin::pin!(stop.asked);
    let mut stopping = false;
    loop {
        tokio::select! {
            st = child.wait() => return st,
            Some(sig) = signals.next() => {
                if let Some(pid) = pid {
                    let _ = rustix::process::kill_process(pid, sig);
                }
            }
            why = &mut asked, if !stopping => {
                stopping = true;
                eprintln!(
                    "moorctl: {why}: SIGTERM to the workload, SIGKILL after its kill timeout ({})",
                    humantime::format_duration(stop.kill_timeout)
                );
                if let Some(pid) = pid {
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::USR2);
                }
            }
        }
    }
}

/// A stop of the workload by its allocation: `asked` resolves (with what asked) when
/// the allocation says stop; the guard then gives the workload `kill_timeout` between
/// SIGTERM and SIGKILL.
pub(super) struct Stop {
    pub asked: futures::future::BoxFuture<'static, String>,
    pub kill_timeout: Duration,
}

/// The client status, the recorded exit and moorctl's own exit code for a workload's
/// end.
pub(super) fn outcome(st: std::process::ExitStatus) -> (ClientStatus, ClientExit, i32) {
    use std::os::unix::process::ExitStatusExt;
    if let Some(code) = st.code() {
        let status = if code == 0 {
            ClientStatus::Complete
        } else {
            ClientStatus::Failed
        };
        return (
            status,
            ClientExit {
                code: Some(code),
                signal: None,
            },
            code,
        );
    }
    let sig = st.signal().unwrap_or(0);
    let name = signal_name(sig).unwrap_or_else(|| format!("signal {sig}"));
    (
        ClientStatus::Failed,
        ClientExit {
            code: None,
            signal: Some(name),
        },
        128 + sig,
    )
}

pub(super) fn signal_name(sig: i32) -> Option<String> {
    let name = match sig {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        6 => "SIGABRT",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        13 => "SIGPIPE",
        14 => "SIGALRM",
        15 => "SIGTERM",
        _ => return None,
    };
    Some(name.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exit_is_recorded_as_code_or_signal() {
        use std::os::unix::process::ExitStatusExt;
        let (s, e, c) = outcome(std::process::ExitStatus::from_raw(0));
        assert_eq!((s, e.code, c), (ClientStatus::Complete, Some(0), 0));
        let (s, e, c) = outcome(std::process::ExitStatus::from_raw(3 << 8));
        assert_eq!((s, e.code, c), (ClientStatus::Failed, Some(3), 3));
        let (s, e, c) = outcome(std::process::ExitStatus::from_raw(15));
        assert_eq!(
            (s, e.signal.as_deref(), c),
            (ClientStatus::Failed, Some("SIGTERM"), 143)
        );
    }
}
