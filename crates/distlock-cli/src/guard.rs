//! The dead man's switch of `distlock run`: the hidden `__guard` subcommand.
//!
//! `distlock run` re-executes itself as this small process before it starts the command. The
//! guard leads a process group of its own and polices the command's group, which it is not a
//! member of: a `kill -STOP -PGID` of the command's group or a terminal's Ctrl-Z stops the
//! command, never its guard, which keeps watching the clock. It stays out of the way of
//! everything else: it blocks the signals a terminal or a `kill` sends (they stay pending), it
//! never reads the terminal, it uses no runtime, and its diagnostics never block it
//! ([`crate::diag`]).
//!
//! Its stdin is a pipe from the supervisor (`distlock run`), one line per message:
//! - `deadline NS`: the lease's current local deadline, as `CLOCK_BOOTTIME` nanoseconds (sent
//!   after every renewal);
//! - `group PGID`: written by the command's wrapper (`distlock __exec`, which opens the pipe
//!   through `/proc/GUARD/fd/0`) before it becomes the command: the group to police. The guard
//!   acknowledges with SIGUSR2 to the wrapper, which only then executes the command — or, when
//!   the guard is already terminating, SIGKILLs the group, so the command never starts;
//! - `terminate REASON`: the supervisor wants the group stopped (the lease was lost, …);
//! - `done`: the command finished while the lease was good; exit without touching the group.
//!
//! The guard terminates the group (SIGTERM and SIGCONT now, SIGKILL at the latest at the local
//! deadline minus a margin) when told to, when the pipe closes without `done` (the supervisor
//! died: only it holds the write end), when its parent dies (`PR_SET_PDEATHSIG`), or when the
//! local deadline comes so close that SIGKILL would otherwise land after it (the supervisor is
//! frozen or cannot renew). Once terminating, it ignores later deadlines and exits as soon as no
//! live process is left in the group; at the kill time it sends SIGKILL to the whole group and
//! exits. Its stdout reports back to the supervisor: `ready`, `terminating REASON`, `killing`.

use std::{
    ffi::{CString, OsString},
    io::{Read, Write},
    os::{fd::AsFd, unix::ffi::OsStrExt},
    time::Duration,
};

use clap::Args;
use nix::{
    errno::Errno,
    poll::{PollFd, PollFlags, PollTimeout, poll},
    sys::{
        prctl,
        signal::{SigSet, Signal, killpg},
        signalfd::{SfdFlags, SignalFd},
    },
    unistd::{Pid, execvp, getpgrp, getpid, getppid},
};

use crate::{clock, duration::format_duration, exit, procfs};

/// Arguments of the hidden `distlock __guard` (set by `distlock run`, not by users).
#[derive(Debug, Args)]
pub struct GuardArgs {
    /// The supervisor's pid: when it is no longer our parent, it is gone.
    #[arg(long)]
    pub parent: i32,
    /// The lock key, for messages.
    #[arg(long)]
    pub key: String,
    /// The lease's local deadline when the guard starts (`CLOCK_BOOTTIME` ns).
    #[arg(long)]
    pub deadline_ns: i64,
    /// SIGTERM this long before the SIGKILL.
    #[arg(long)]
    pub kill_after_ms: u64,
    /// SIGKILL this long before the local deadline.
    #[arg(long)]
    pub margin_ms: u64,
}

/// Guard's exit status: it terminated the group, which was gone before SIGKILL was due.
pub const TERMINATED: u8 = 3;

/// Signals the guard must survive, should anyone send them to it (it is in no group a terminal
/// or `distlock run` signals), and its parent-death signal.
const BLOCKED: [Signal; 8] = [
    Signal::SIGINT,
    Signal::SIGTERM,
    Signal::SIGHUP,
    Signal::SIGQUIT,
    Signal::SIGTSTP,
    Signal::SIGTTIN,
    Signal::SIGTTOU,
    Signal::SIGUSR1,
];

/// Runs the guard; returns its exit status.
pub fn main(args: &GuardArgs) -> u8 {
    let mut blocked = SigSet::empty();
    for signal in BLOCKED {
        blocked.add(signal);
    }
    let mut death = SigSet::empty();
    death.add(Signal::SIGUSR1);
    let setup = blocked
        .thread_block()
        .and_then(|()| SignalFd::with_flags(&death, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC))
        .and_then(|fd| prctl::set_pdeathsig(Signal::SIGUSR1).map(|()| fd));
    let death_fd = match setup {
        Ok(fd) => fd,
        Err(e) => {
            say!("distlock: the guard process cannot set itself up: {e}");
            return exit::INTERNAL;
        }
    };
    if getpgrp() != getpid() {
        say!("distlock: the guard process must lead its own process group");
        return exit::INTERNAL;
    }
    // The parent may have died before PR_SET_PDEATHSIG was set: then nothing was started yet.
    if getppid().as_raw() != args.parent {
        return exit::INTERNAL;
    }
    // Read the pipe unbuffered (a `StdinLock` could keep a message in its buffer where `poll`
    // does not see it).
    let control = match std::io::stdin().as_fd().try_clone_to_owned() {
        Ok(fd) => std::fs::File::from(fd),
        Err(e) => {
            say!("distlock: the guard process cannot read its supervisor's pipe: {e}");
            return exit::INTERNAL;
        }
    };
    let mut guard = Guard {
        control,
        key: args.key.clone(),
        group: None,
        parent: args.parent,
        deadline: args.deadline_ns,
        kill_after: nanos(Duration::from_millis(args.kill_after_ms)),
        margin: nanos(Duration::from_millis(args.margin_ms)),
        kill_at: None,
        eof: false,
        done: false,
        buffer: Vec::new(),
    };
    guard.report("ready");
    guard.run(&death_fd)
}

fn nanos(d: Duration) -> i64 {
    i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)
}

struct Guard {
    control: std::fs::File,
    key: String,
    /// The command's process group, once its wrapper registered it.
    group: Option<Pid>,
    parent: i32,
    /// The local deadline (`CLOCK_BOOTTIME` ns).
    deadline: i64,
    kill_after: i64,
    margin: i64,
    /// Set once terminating: when SIGKILL goes to the group.
    kill_at: Option<i64>,
    eof: bool,
    done: bool,
    buffer: Vec<u8>,
}

impl Guard {
    fn run(&mut self, death_fd: &SignalFd) -> u8 {
        loop {
            let now = clock::now_ns();
            let wake_in = match self.kill_at {
                None => {
                    let term_at = self
                        .deadline
                        .saturating_sub(self.kill_after)
                        .saturating_sub(self.margin);
                    if now >= term_at {
                        self.terminate("deadline", self.deadline.saturating_sub(self.margin), now);
                        continue;
                    }
                    term_at - now
                }
                Some(kill_at) => {
                    // No group yet: a wrapper that registers later is killed on the spot, so
                    // wait for one until the kill time.
                    if let Some(group) = self.group
                        && !procfs::has_live_members(group.as_raw(), getpid().as_raw())
                    {
                        return TERMINATED;
                    }
                    if now >= kill_at {
                        self.report("killing");
                        if let Some(group) = self.group {
                            let _ = killpg(group, Signal::SIGKILL);
                        }
                        return exit::INTERNAL;
                    }
                    // Look for an emptied group every 20 ms.
                    (kill_at - now).min(20_000_000)
                }
            };
            if self.wait_for_input(death_fd, wake_in) {
                return exit::OK;
            }
        }
    }

    /// Waits up to `wake_in` ns for a message or the parent-death signal and handles it;
    /// `true` when the guard should exit without touching the group.
    fn wait_for_input(&mut self, death_fd: &SignalFd, wake_in: i64) -> bool {
        // Round up so that the guard does not wake a little early and spin.
        let millis = wake_in.saturating_add(999_999) / 1_000_000;
        let timeout = PollTimeout::try_from(millis.clamp(0, 60_000)).unwrap_or(PollTimeout::MAX);
        let control = &self.control;
        let mut fds = vec![PollFd::new(death_fd.as_fd(), PollFlags::POLLIN)];
        if !self.eof {
            fds.push(PollFd::new(control.as_fd(), PollFlags::POLLIN));
        }
        match poll(&mut fds, timeout) {
            Ok(0) | Err(Errno::EINTR) => return false,
            Ok(_) => {}
            Err(e) => {
                // Cannot watch the supervisor any more: stop the command while that is safe.
                say!("distlock: the guard process cannot wait for its supervisor: {e}");
                self.orphaned();
                return false;
            }
        }
        let death = fds[0].any().unwrap_or(false);
        let input = fds.get(1).is_some_and(|fd| fd.any().unwrap_or(true));
        drop(fds);
        if death {
            let _ = death_fd.read_signal();
            if getppid().as_raw() != self.parent {
                self.orphaned();
            }
        }
        if input {
            let mut chunk = [0u8; 512];
            match (&self.control).read(&mut chunk) {
                Ok(0) | Err(_) => {
                    self.eof = true;
                    if !self.done {
                        self.orphaned();
                    }
                }
                Ok(n) => {
                    self.buffer.extend_from_slice(&chunk[..n]);
                    while let Some(end) = self.buffer.iter().position(|&b| b == b'\n') {
                        let line: Vec<u8> = self.buffer.drain(..=end).collect();
                        if self.handle(&String::from_utf8_lossy(&line)) {
                            return true;
                        }
                    }
                }
            }
        }
        false
    }

    /// Handles one message; `true` when the guard should exit at once.
    fn handle(&mut self, line: &str) -> bool {
        let mut words = line.split_whitespace();
        match (words.next(), words.next()) {
            (Some("deadline"), Some(ns)) => {
                if let Ok(ns) = ns.parse::<i64>()
                    && self.kill_at.is_none()
                {
                    self.deadline = self.deadline.max(ns);
                }
                false
            }
            (Some("group"), Some(pgid)) => {
                if let Ok(pgid) = pgid.parse::<i32>()
                    && pgid > 1
                    && self.group.is_none()
                {
                    let group = Pid::from_raw(pgid);
                    self.group = Some(group);
                    if self.kill_at.is_some() {
                        // Too late: the command must not start.
                        let _ = killpg(group, Signal::SIGKILL);
                    } else {
                        // The acknowledgement the wrapper waits for before the command runs.
                        let _ = nix::sys::signal::kill(group, ACK);
                    }
                }
                false
            }
            (Some("terminate"), reason) => {
                let now = clock::now_ns();
                let kill_at = now
                    .saturating_add(self.kill_after)
                    .min(self.deadline.saturating_sub(self.margin));
                self.terminate(reason.unwrap_or("asked"), kill_at, now);
                false
            }
            (Some("done"), _) => {
                self.done = true;
                self.kill_at.is_none()
            }
            _ => false,
        }
    }

    /// The supervisor is gone (pipe closed without `done`, or our parent changed).
    fn orphaned(&mut self) {
        if self.kill_at.is_some() {
            return;
        }
        let now = clock::now_ns();
        let kill_at = now
            .saturating_add(self.kill_after)
            .min(self.deadline.saturating_sub(self.margin));
        self.terminate("orphaned", kill_at, now);
    }

    fn terminate(&mut self, reason: &str, kill_at: i64, now: i64) {
        if self.kill_at.is_some() {
            return;
        }
        self.kill_at = Some(kill_at);
        if let Some(group) = self.group {
            let _ = killpg(group, Signal::SIGTERM);
            // A stopped process acts on SIGTERM only once continued.
            let _ = killpg(group, Signal::SIGCONT);
        }
        self.report(&format!("terminating {reason}"));
        let left = Duration::from_nanos(u64::try_from(kill_at.saturating_sub(now)).unwrap_or(0));
        let why = match reason {
            "deadline" => Some(
                "the lease was not renewed in time (distlock is stopped or cannot reach the coordinator)",
            ),
            "orphaned" => Some("the distlock process that holds it is gone"),
            _ => None,
        };
        if let Some(why) = why {
            say!(
                "distlock: {why}; terminating the command holding {}: SIGTERM now, SIGKILL in {}",
                self.key,
                format_duration(left)
            );
        }
    }

    /// One line to the supervisor; it may be gone (EPIPE: Rust ignores SIGPIPE).
    fn report(&self, line: &str) {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }
}

/// The hidden subcommand of the command's wrapper: `distlock __exec GUARD_PID PROGRAM [ARGS..]`.
pub const EXEC: &str = "__exec";

/// The guard's acknowledgement of a registered group.
const ACK: Signal = Signal::SIGUSR2;

/// The command's wrapper, started by `distlock run` in a new process group of its own (it
/// leads it): tells the guard `group PID` through the guard's control pipe, waits for the
/// guard's acknowledgement, then executes `PROGRAM` in its place (same pid, same group). If the
/// guard is gone (or never answers before it goes), the command is not run: 70. A program that
/// cannot be executed: 127 (not found) or 126, with distlock's message.
pub fn exec_main(args: &[OsString]) -> u8 {
    let (Some(guard), Some(program)) = (args.first(), args.get(1)) else {
        say!("distlock: __exec is internal to `distlock run`");
        return exit::USAGE;
    };
    let Some(guard) = guard.to_str().and_then(|g| g.parse::<i32>().ok()) else {
        say!("distlock: __exec is internal to `distlock run`");
        return exit::USAGE;
    };
    if let Err(why) = register(guard) {
        say!("distlock: the command was not started: {why}");
        return exit::INTERNAL;
    }
    let argv: Result<Vec<CString>, _> = args[1..]
        .iter()
        .map(|a| CString::new(a.as_bytes()))
        .collect();
    let Ok(argv) = argv else {
        say!(
            "distlock: cannot run {}: an argument contains a NUL byte",
            program.to_string_lossy()
        );
        return exit::CANNOT_EXECUTE;
    };
    let Err(e) = execvp(&argv[0], &argv);
    say!(
        "distlock: cannot run {}: {}",
        program.to_string_lossy(),
        std::io::Error::from(e)
    );
    if e == Errno::ENOENT {
        exit::NOT_FOUND
    } else {
        exit::CANNOT_EXECUTE
    }
}

/// Registers this process's group with guard `guard` and waits for the acknowledgement; the
/// signal mask is clean again afterwards (the command inherits it).
fn register(guard: i32) -> Result<(), String> {
    let mut ack = SigSet::empty();
    ack.add(ACK);
    ack.thread_block()
        .map_err(|e| format!("cannot block {ACK}: {e}"))?;
    let waited = (|| {
        let fd = SignalFd::with_flags(&ack, SfdFlags::SFD_CLOEXEC)
            .map_err(|e| format!("cannot wait for the guard: {e}"))?;
        let mut pipe = std::fs::File::options()
            .write(true)
            .open(format!("/proc/{guard}/fd/0"))
            .map_err(|e| format!("cannot reach the guard process {guard}: {e}"))?;
        // One short write: atomic on a pipe, never interleaved with the supervisor's lines.
        pipe.write_all(format!("group {}\n", getpid()).as_bytes())
            .map_err(|e| format!("the guard process {guard} is gone: {e}"))?;
        loop {
            // The pipe's write end reports POLLERR once the guard (its only reader) is gone.
            let mut fds = [
                PollFd::new(fd.as_fd(), PollFlags::POLLIN),
                PollFd::new(pipe.as_fd(), PollFlags::empty()),
            ];
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(e) => return Err(format!("cannot wait for the guard: {e}")),
            }
            if fds[0].any().unwrap_or(false) {
                return match fd.read_signal() {
                    Ok(Some(_)) => Ok(()),
                    Ok(None) => continue,
                    Err(e) => Err(format!("cannot wait for the guard: {e}")),
                };
            }
            let gone = fds[1]
                .revents()
                .is_some_and(|r| r.intersects(PollFlags::POLLERR | PollFlags::POLLHUP));
            if gone {
                return Err(format!("the guard process {guard} is gone"));
            }
        }
    })();
    let _ = ack.thread_unblock();
    waited
}
