//! The dead man's switch of `distlock run`: the hidden `__guard` subcommand.
//!
//! `distlock run` re-executes itself as this small process before it starts the command. The
//! guard leads the process group the command then joins, so it can signal the whole group, and
//! it stays out of the way of everything else: it blocks the signals a terminal or a `kill` of
//! the group sends (they stay pending), it never reads the terminal, and it uses no runtime.
//!
//! Its stdin is a pipe from the supervisor (`distlock run`), one line per message:
//! - `deadline NS`: the lease's current local deadline, as `CLOCK_BOOTTIME` nanoseconds (sent
//!   after every renewal);
//! - `terminate REASON`: the supervisor wants the group stopped (the lease was lost, …);
//! - `done`: the command finished while the lease was good; exit without touching the group.
//!
//! The guard terminates the group (SIGTERM and SIGCONT now, SIGKILL at the latest at the local
//! deadline minus a margin) when told to, when the pipe closes without `done` (the supervisor
//! died: only it holds the write end), when its parent dies (`PR_SET_PDEATHSIG`), or when the
//! local deadline comes so close that SIGKILL would otherwise land after it (the supervisor is
//! frozen or cannot renew). Once terminating, it ignores later deadlines and exits as soon as no
//! other live process is left in the group; at the kill time it sends SIGKILL to the whole group,
//! itself included. Its stdout reports back to the supervisor: `ready`, `terminating REASON`.

use std::{
    io::{Read, Write},
    os::fd::AsFd,
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
    unistd::{Pid, getpgrp, getpid, getppid},
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

/// Signals the guard must survive: a terminal's (the group may be the foreground one), the ones
/// `distlock run` forwards to the group (the guard is a member), and its parent-death signal.
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
    let group = getpgrp();
    if group != getpid() {
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
        group,
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
    group: Pid,
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
                    if !procfs::has_live_members(self.group.as_raw(), getpid().as_raw()) {
                        return TERMINATED;
                    }
                    if now >= kill_at {
                        self.report("killing");
                        // The last act: this kills the guard too.
                        let _ = killpg(self.group, Signal::SIGKILL);
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
        let _ = killpg(self.group, Signal::SIGTERM);
        // A stopped process acts on SIGTERM only once continued.
        let _ = killpg(self.group, Signal::SIGCONT);
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
