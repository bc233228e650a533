//! The workload guard: `moorctl __workload-guard`, re-executed by `alloc run` between
//! itself and CMD (as Nomad re-executes itself as a task's executor), so that the
//! workload ends, all of it, before its volume can be released.
//!
//! Expected flow:
//! 1. The runner spawns the guard with SIGTERM as its parent-death signal; the guard
//!    checks that the runner is still its parent (it may have died before that signal
//!    was armed) and becomes a child subreaper, so that every process the workload
//!    leaves behind is reparented to it and reaped by it.
//! 2. CMD runs in a process group of its own (made the terminal's foreground group when
//!    the runner's was, as a shell does for a job, so an interactive CMD reads the
//!    terminal and gets its Ctrl-C once).
//! 3. SIGINT, SIGTERM and SIGHUP the runner passes on go to CMD's whole group.
//! 4. When CMD exits, or when the runner is gone (its death signal, or a parent that is
//!    no longer the runner), what is left of the group gets SIGTERM, then SIGKILL after
//!    the grace (the runner gives a third of its lease's TTL, at most 10 s: shorter than
//!    the controller waits before it releases a dead runner's claims), and the guard
//!    waits until the group is empty. CMD runs in a cgroup of its own where a cgroup2
//!    hierarchy is writable (`moor::workload::cgroup`, made by the runner and passed as
//!    `--cgroup`): every process it starts stays there, also one that left the process
//!    group (`setsid`), and the guard ends and waits for the cgroup too; elsewhere it
//!    relies on the process group.
//! 5. A stop (SIGUSR2 from the runner: its allocation was asked to stop) sends SIGTERM
//!    to CMD's group once, and SIGKILL to the group and cgroup at `--kill-timeout`
//!    (the allocation's) if CMD has not exited by then. The first SIGTERM the runner
//!    passes on (`systemctl stop`) starts the same kill timeout.
//! 6. The guard exits as CMD did: the same code, or killed by the same signal.

use std::time::Duration;

use rustix::process::{Pid, Signal};

use moor::workload::cgroup::Cgroup;
use tokio::signal::unix::{signal, SignalKind};

/// `moorctl __workload-guard --runner PID --grace D -- CMD...` (internal).
#[derive(Debug, clap::Args)]
pub struct Guard {
    /// The runner's process id: its parent, while the runner lives.
    #[arg(long)]
    pub runner: i32,
    /// How long what is left of the workload has after SIGTERM before SIGKILL.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub grace: Duration,
    /// The workload's cgroup, made by the runner (none: the process group alone).
    #[arg(long)]
    pub cgroup: Option<std::path::PathBuf>,
    /// On the runner's stop (SIGUSR2: its allocation was asked to stop), how long the
    /// workload has after SIGTERM before SIGKILL: the allocation's kill timeout.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    pub kill_timeout: Duration,
    /// The command and its arguments.
    #[arg(required = true, last = true)]
    pub command: Vec<String>,
}

/// How CMD ended.
enum Ended {
    Code(i32),
    Signal(i32),
}

impl Guard {
    /// Runs the guard; never returns when CMD was killed by a signal (the guard dies by
    /// it too).
    pub fn run(self) -> anyhow::Result<i32> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let ended = rt.block_on(self.guard())?;
        drop(rt);
        Ok(match ended {
            Some(Ended::Code(code)) => code,
            Some(Ended::Signal(sig)) => die_by(sig),
            // The runner is gone: nobody reads this exit.
            None => 1,
        })
    }

    async fn guard(&self) -> anyhow::Result<Option<Ended>> {
        let runner = Pid::from_raw(self.runner);
        let orphaned = move || rustix::process::getppid() != runner;
        if orphaned() {
            return Ok(None);
        }
        rustix::process::set_child_subreaper(Some(rustix::process::getpid()))?;
        // A cgroup of the workload's own holds every process it starts, whatever
        // session it moves to; without one, the process group is all there is (the
        // runner said why).
        let cgroup = match self.cgroup.as_deref().map(Cgroup::open).transpose() {
            Ok(c) => c,
            Err(why) => {
                eprintln!("moorctl: cannot use the workload's cgroup: {why}");
                return Ok(Some(Ended::Code(127)));
            }
        };
        let join = match cgroup.as_ref().map(Cgroup::join_fd).transpose() {
            Ok(fd) => fd,
            Err(e) => {
                eprintln!("moorctl: cannot join the workload's cgroup: {e}");
                return Ok(Some(Ended::Code(127)));
            }
        };
        let mut forwarded = Vec::new();
        for (kind, sig) in [
            (SignalKind::interrupt(), Signal::INT),
            (SignalKind::terminate(), Signal::TERM),
            (SignalKind::hangup(), Signal::HUP),
        ] {
            forwarded.push((signal(kind)?, sig));
        }
        let mut children = signal(SignalKind::child())?;
        let mut stop = signal(SignalKind::user_defined2())?;
        // When a stop's SIGTERM turns into SIGKILL.
        let mut kill_at: Option<tokio::time::Instant> = None;
        let mut stopping = false;
        let foreground = is_foreground();
        let workload = match spawn(&self.command, foreground, join.as_ref()) {
            Ok(pid) => pid,
            Err(e) => {
                eprintln!("moorctl: cannot run {:?}: {e}", self.command[0]);
                return Ok(Some(Ended::Code(127)));
            }
        };
        let mut ended = None;
        let mut runner_gone = false;
        while ended.is_none() && !runner_gone {
            let sig = {
                let waits = forwarded.iter_mut().map(|(s, sig)| {
                    let sig = *sig;
                    Box::pin(async move {
                        s.recv().await;
                        sig
                    })
                });
                let any_signal = futures::future::select_all(waits);
                let tick = match kill_at {
                    Some(at) => at.min(tokio::time::Instant::now() + Duration::from_secs(1)),
                    None => tokio::time::Instant::now() + Duration::from_secs(1),
                };
                tokio::select! {
                    (sig, _, _) = any_signal => {
                        // A SIGTERM passed on (`systemctl stop`, a supervisor) is a stop
                        // too: the kill timeout bounds it as it bounds an asked one.
                        if sig == Signal::TERM && !stopping {
                            stopping = true;
                            kill_at = Some(tokio::time::Instant::now() + self.kill_timeout);
                        }
                        Some(sig)
                    }
                    _ = stop.recv() => {
                        // The allocation was asked to stop: SIGTERM once, to the
                        // workload's group; SIGKILL at the kill timeout.
                        if !stopping {
                            stopping = true;
                            kill_at = Some(tokio::time::Instant::now() + self.kill_timeout);
                            Some(Signal::TERM)
                        } else {
                            None
                        }
                    }
                    _ = children.recv() => None,
                    _ = tokio::time::sleep_until(tick) => None,
                }
            };
            ended = reap(Some(workload)).or(ended);
            runner_gone = orphaned();
            if let (Some(sig), false) = (sig, runner_gone) {
                let _ = rustix::process::kill_process_group(workload, sig);
            }
            if ended.is_none() && kill_at.is_some_and(|at| tokio::time::Instant::now() >= at) {
                eprintln!(
                    "moorctl: the workload did not end within its kill timeout ({}) after SIGTERM; killing it",
                    humantime::format_duration(self.kill_timeout)
                );
                let _ = rustix::process::kill_process_group(workload, Signal::KILL);
                if let Some(c) = &cgroup {
                    c.kill();
                }
                kill_at = None;
            }
        }
        if runner_gone && ended.is_none() {
            eprintln!("moorctl: the runner is gone; ending the workload");
        }
        drop(join);
        ended = end_group(workload, self.grace, ended, cgroup.as_ref()).await;
        if let Some(c) = &cgroup {
            tracing::debug!(cgroup = %c.path().display(), "the workload's cgroup is empty");
        }
        drop(cgroup);
        if foreground {
            take_back_terminal();
        }
        Ok(if runner_gone { None } else { ended })
    }
}

/// Reaps every child that has ended (the workload's own, and whatever it left that was
/// reparented to this subreaper); returns the workload's end when it was among them.
fn reap(workload: Option<Pid>) -> Option<Ended> {
    use rustix::process::{wait, WaitOptions};
    let mut found = None;
    // wait(), not waitpid(None): the latter waits only for children in this process's
    // group, and the workload's are in its own.
    while let Ok(Some((pid, status))) = wait(WaitOptions::NOHANG) {
        if Some(pid) != workload {
            continue;
        }
        if let Some(code) = status.exit_status() {
            found = Some(Ended::Code(code));
        } else if let Some(sig) = status.terminating_signal() {
            found = Some(Ended::Signal(sig));
        }
    }
    found
}

/// Ends what is left of the workload's group and cgroup: SIGTERM, SIGKILL after
/// `grace`, then waits (reaping) until both are empty. Returns the workload's end, if
/// seen.
async fn end_group(
    group: Pid,
    grace: Duration,
    mut ended: Option<Ended>,
    cgroup: Option<&Cgroup>,
) -> Option<Ended> {
    let alive = || {
        rustix::process::test_kill_process_group(group).is_ok()
            || cgroup.is_some_and(Cgroup::populated)
    };
    let mut sent_term = false;
    let deadline = tokio::time::Instant::now() + grace;
    let mut killed = false;
    loop {
        if let Some(e) = reap(Some(group)) {
            ended = Some(e);
        }
        if !alive() {
            return ended;
        }
        if !sent_term {
            let _ = rustix::process::kill_process_group(group, Signal::TERM);
            if let Some(c) = cgroup {
                c.signal(Signal::TERM);
            }
            sent_term = true;
        } else if !killed && tokio::time::Instant::now() >= deadline {
            eprintln!(
                "moorctl: the workload's processes outlived {} after SIGTERM; killing them",
                humantime::format_duration(grace)
            );
            let _ = rustix::process::kill_process_group(group, Signal::KILL);
            if let Some(c) = cgroup {
                c.kill();
            }
            killed = true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whether this process's group is the terminal's foreground group (standard input is
/// that terminal).
fn is_foreground() -> bool {
    rustix::termios::tcgetpgrp(std::io::stdin()).is_ok_and(|fg| fg == rustix::process::getpgrp())
}

/// Spawns CMD in a process group of its own (the terminal's foreground group when
/// `foreground`), with SIGTERM as its parent-death signal, in the cgroup whose
/// `cgroup.procs` is `join` (opened before the fork).
#[allow(unsafe_code)]
fn spawn(
    command: &[String],
    foreground: bool,
    join: Option<&std::os::fd::OwnedFd>,
) -> std::io::Result<Pid> {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new(&command[0]);
    cmd.args(&command[1..]);
    let join = join.map(AsRawFd::as_raw_fd);
    // SAFETY: the closure runs in the child between fork and exec and makes only
    // async-signal-safe system calls (write, setpgid, sigprocmask, tcsetpgrp, prctl);
    // it allocates and locks nothing. `join` is a descriptor the parent keeps open
    // until the child has been spawned.
    unsafe {
        cmd.pre_exec(move || {
            if let Some(fd) = join {
                // `0`: the writing process itself, before it can start another.
                rustix::io::write(std::os::fd::BorrowedFd::borrow_raw(fd), b"0")?;
            }
            rustix::process::setpgid(None, None)?;
            if foreground {
                // As a shell does for a job: SIGTTOU blocked while a background group
                // takes the terminal, then unblocked.
                with_sigttou_blocked(|| {
                    let _ = rustix::termios::tcsetpgrp(std::io::stdin(), rustix::process::getpid());
                });
            }
            rustix::process::set_parent_process_death_signal(Some(Signal::TERM))?;
            Ok(())
        });
    }
    let child = cmd.spawn()?;
    // The Child is not waited on: `reap` collects it with the rest.
    Pid::from_raw(child.id() as i32)
        .ok_or_else(|| std::io::Error::other("the workload has no process id"))
}

/// Gives the terminal back to this process's group after the workload's group ended.
fn take_back_terminal() {
    with_sigttou_blocked(|| {
        let _ = rustix::termios::tcsetpgrp(std::io::stdin(), rustix::process::getpgrp());
    });
}

/// Runs `f` with SIGTTOU blocked on this thread (a background group may then change the
/// terminal's foreground group without being stopped).
#[allow(unsafe_code)]
fn with_sigttou_blocked(f: impl FnOnce()) {
    // SAFETY: sigemptyset/sigaddset fill a local set; pthread_sigmask changes this
    // thread's mask only and is restored before returning.
    unsafe {
        let mut set = std::mem::zeroed::<libc::sigset_t>();
        let mut old = std::mem::zeroed::<libc::sigset_t>();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTTOU);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old);
        f();
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
    }
}

/// Dies by `sig` with its default action (as the workload did), without a core file.
#[allow(unsafe_code)]
fn die_by(sig: i32) -> ! {
    let mut core = rustix::process::getrlimit(rustix::process::Resource::Core);
    core.current = Some(0);
    let _ = rustix::process::setrlimit(rustix::process::Resource::Core, core);
    // SAFETY: resetting a signal's disposition to the default and raising it in this
    // process; nothing else runs (the runtime was dropped).
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
    }
    // A signal whose default action is not to end the process.
    std::process::exit(128 + sig)
}
