//! `distlock elect NAME -- CMD [ARGS..]` and `distlock leader NAME [--watch] [--json]`.
//!
//! An election is the lock on its key `election/NAME` ([`distlock::Election::key`]), so `elect`
//! is `run` on that key: the same acquire (waiting, progress, interruption), the same guard
//! process and supervision ([`run::supervise`]), with fencing required (the term is the grant's
//! fencing token). It takes the lock itself rather than through [`distlock::Election::campaign`]
//! because the guard process needs the lease's local deadline after every renewal and a
//! renewal interval of its own, which a [`distlock::Leadership`] does not expose; resigning is
//! releasing that lock, which is all [`distlock::Leadership::resign`] does.

use std::sync::Arc;

use distlock::{
    DistributedLockExt, DynLock, Election, FencingGuarantee, InMemoryLock, Leader, LockKey,
};
use tokio::time::Instant;

use crate::{
    ElectArgs, LeaderArgs,
    duration::format_duration,
    exit::{self, code_for},
    run::{self, Job, Report, Timing, Wait, event},
};

/// Checks an election's name before any I/O, with the library's own check (on a lock that is
/// never used: [`Election::new`] does no I/O).
pub fn check_name(name: &str) -> Result<(), String> {
    let unused: DynLock = Arc::new(InMemoryLock::new());
    Election::new(unused, name)
        .map(drop)
        .map_err(|e| format!("invalid election name {name:?}: {e}"))
}

/// The election `name` on `lock`, or the usage exit status.
fn election(lock: DynLock, name: &str) -> Result<Election, u8> {
    Election::new(lock, name).map_err(|e| {
        say!("distlock: invalid election name {name:?}: {e}");
        exit::USAGE
    })
}

/// `distlock elect`: runs the command while leader and returns distlock's exit status.
pub async fn elect(lock: DynLock, args: ElectArgs, wait_deadline: Option<Instant>) -> u8 {
    let code = elect_inner(lock, &args, wait_deadline).await;
    event(
        args.json,
        serde_json::json!({"event": "exit", "election": args.name, "status": code}),
    );
    code
}

async fn elect_inner(lock: DynLock, args: &ElectArgs, wait_deadline: Option<Instant>) -> u8 {
    let ttl = args.ttl();
    let election = match election(lock.clone(), &args.name) {
        Ok(election) => election.ttl(ttl),
        Err(code) => return code,
    };
    let key: LockKey = election.key().clone();
    let span = run::lease_span(&lock.capabilities(), ttl);
    let timing = match Timing::new(args.kill_after, ttl, span) {
        Ok(timing) => timing,
        Err(message) => {
            say!("distlock: {message}");
            return exit::USAGE;
        }
    };
    // As `Election::campaign` asks: any fencing, for the term (refused before I/O without).
    let make = || {
        lock.lock(&key)
            .ttl(ttl)
            .require_fencing(FencingGuarantee::SingleNode)
    };
    let wait = args.wait.map_or(Wait::Forever, Wait::Up);
    let report = Report {
        quiet: args.quiet,
        json: args.json,
    };
    let guard = match run::acquire(&lock, &key, make, &timing, wait, report, wait_deadline).await {
        Ok(Some(guard)) => guard,
        Ok(None) => {
            event(
                args.json,
                serde_json::json!({"event": "not_elected", "election": args.name, "key": key.as_str()}),
            );
            return exit::NOT_ACQUIRED;
        }
        Err(code) => return code,
    };
    let Some(term) = guard.fencing_token() else {
        say!(
            "distlock: the {} backend claims fencing but granted {key} without a fencing token: no term",
            lock.backend_name()
        );
        let _ = guard.release().await;
        return exit::UNAVAILABLE;
    };
    event(
        args.json,
        serde_json::json!({"event": "elected", "election": args.name, "key": key.as_str(),
            "term": term.get(), "ttl_ms": u64::try_from(guard.ttl().as_millis()).unwrap_or(u64::MAX)}),
    );
    if args.verbose {
        say!("distlock: elected leader of {} (term {term})", args.name);
    }
    let job = Job {
        program: args.command.clone(),
        env: vec![
            ("DISTLOCK_ELECTION", args.name.clone()),
            ("DISTLOCK_TERM", term.to_string()),
        ],
        // `run`'s, should distlock elect run under distlock run: not this leadership's.
        unset: vec!["DISTLOCK_KEY", "DISTLOCK_FENCING_TOKEN"],
        wait_group: args.wait_group,
        verbose: args.verbose,
        json: args.json,
    };
    // Releasing the lock at the end is the resignation.
    run::supervise(guard, &job, &timing).await
}

/// `distlock leader`: prints the leader (or follows it) and returns distlock's exit status.
pub async fn leader(lock: DynLock, args: LeaderArgs) -> u8 {
    let election = match election(lock, &args.name) {
        Ok(election) => election,
        Err(code) => return code,
    };
    if args.watch {
        return watch(&election, &args).await;
    }
    match election.leader().await {
        Ok(leader) => {
            // A closed stdout changes nothing: the exit status still tells.
            let _ = print_leader(&args, leader.as_ref());
            if leader.is_some() {
                exit::OK
            } else {
                exit::FAILED
            }
        }
        Err(e) => {
            say!("distlock: {e}");
            code_for(&e)
        }
    }
}

/// `leader --watch`: a line now and one per change ([`Election::observe`]'s rule: a new term,
/// greater than every term shown, a new value of the same leader (a foreign leader's proclaim),
/// or nobody leading after someone did; polled, as the client is a [`DynLock`]), until a signal ends it
/// (128 + N) or stdout is closed (141, as for SIGPIPE).
async fn watch(election: &Election, args: &LeaderArgs) -> u8 {
    use futures::StreamExt as _;
    let mut signals = match run::Signals::new() {
        Ok(signals) => signals,
        Err(e) => {
            say!("distlock: cannot install signal handlers: {e}");
            return exit::INTERNAL;
        }
    };
    let changes = election.observe(args.every);
    tokio::pin!(changes);
    let closed = stdout_closed();
    tokio::pin!(closed);
    let mut failing = false;
    loop {
        let change = tokio::select! {
            signal = signals.recv() => return exit::signalled(signal as i32),
            // Nobody reads any more (`| head -1`), seen at once rather than at the next line.
            () = &mut closed => return exit::signalled(nix::sys::signal::Signal::SIGPIPE as i32),
            change = changes.next() => change,
        };
        match change {
            Some(Ok(leader)) => {
                if failing {
                    say!("distlock: the coordinator answers again");
                    failing = false;
                }
                if !print_leader(args, leader.as_ref()) {
                    // Nobody reads any more (`| head -1`): end as a pipe's writer does.
                    return exit::signalled(nix::sys::signal::Signal::SIGPIPE as i32);
                }
            }
            Some(Err(e)) => {
                // Said once per outage; the watch goes on (as `observe` does).
                if !failing {
                    say!("distlock: cannot read the leader of {}: {e}", args.name);
                    failing = true;
                }
            }
            // The stream ends only after an error it cannot go on from (a zero interval,
            // refused before any I/O).
            None => return exit::USAGE,
        }
    }
}

/// Completes when stdout's reader is gone (a pipe whose read end closed: POLLERR; a terminal
/// hung up: POLLHUP), watched by a thread polling a duplicate of fd 1 for nothing but those
/// (which works on any kind of fd, unlike the runtime's epoll). Never completes on a file, or
/// when stdout cannot be watched.
async fn stdout_closed() {
    use std::os::fd::AsFd as _;

    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let Ok(fd) = std::io::stdout().as_fd().try_clone_to_owned() else {
        return std::future::pending().await;
    };
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let watcher = std::thread::Builder::new()
        .name("distlock-stdout".to_owned())
        .spawn(move || {
            let gone = PollFlags::POLLERR | PollFlags::POLLHUP | PollFlags::POLLNVAL;
            loop {
                let mut fds = [PollFd::new(fd.as_fd(), PollFlags::empty())];
                match poll(&mut fds, PollTimeout::NONE) {
                    Ok(_) if fds[0].revents().is_some_and(|r| r.intersects(gone)) => {
                        let _ = tx.send(());
                        return;
                    }
                    // No events are asked for, so poll returns only for these (or a signal):
                    // waiting again does not spin.
                    Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                    Err(_) => return,
                }
            }
        });
    if watcher.is_err() || rx.await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// One line on stdout, text or JSON; `false` when stdout is closed.
fn print_leader(args: &LeaderArgs, leader: Option<&Leader>) -> bool {
    let line = if args.json {
        serde_json::json!({
            "election": args.name,
            "leader": leader.is_some(),
            "term": leader.and_then(|l| l.term).map(|t| t.get()),
            "value": leader.and_then(|l| l.value.as_deref()),
            "holder": leader.and_then(|l| l.holder.as_ref()).map(|h| h.as_str()),
            "ttl_remaining_ms": leader
                .and_then(|l| l.ttl_remaining)
                .map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX)),
        })
        .to_string()
    } else {
        match leader {
            None => format!("{}: no leader", args.name),
            Some(leader) => {
                // The value first (exactly what etcd's and Curator's peers read), then the term,
                // then our identity when the leader is one of ours.
                let mut parts: Vec<String> = leader.value.iter().cloned().collect();
                parts.push(match leader.term {
                    Some(term) => format!("term {term}"),
                    None => "no term".to_owned(),
                });
                match (&leader.holder, &leader.value) {
                    (Some(holder), _) => parts.push(crate::commands::readable_since(
                        &holder.to_string(),
                        std::time::SystemTime::now(),
                    )),
                    (None, None) => parts.push("an unknown holder".to_owned()),
                    (None, Some(_)) => {}
                }
                if let Some(ttl) = leader.ttl_remaining {
                    parts.push(format!("{} left", format_duration(ttl)));
                }
                format!("{}: {}", args.name, parts.join(", "))
            }
        }
    };
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").and_then(|()| out.flush()).is_ok()
}
