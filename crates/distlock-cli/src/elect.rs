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
    DistributedLockExt, DynLock, Election, FencingGuarantee, FencingToken, HolderIdentity,
    InMemoryLock, Leader, LockKey,
};
use tokio::time::{Instant, MissedTickBehavior};

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

/// `leader --watch`: a line now and one per change, until a signal ends it (128 + N) or stdout
/// is closed (141, as for SIGPIPE).
///
/// The rule is [`Election::observe`]'s: a new term (greater than every term shown), or nobody
/// leading after someone did. It polls [`Election::leader`] itself because this crate does not
/// depend on `futures`, whose `Stream` trait `observe`'s stream needs to be read.
async fn watch(election: &Election, args: &LeaderArgs) -> u8 {
    let mut signals = match run::Signals::new() {
        Ok(signals) => signals,
        Err(e) => {
            say!("distlock: cannot install signal handlers: {e}");
            return exit::INTERNAL;
        }
    };
    let mut ticks = tokio::time::interval(args.every);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut changes = Changes::default();
    let mut failing = false;
    loop {
        tokio::select! {
            signal = signals.recv() => return exit::signalled(signal as i32),
            _ = ticks.tick() => {}
        }
        let polled = tokio::select! {
            signal = signals.recv() => return exit::signalled(signal as i32),
            polled = election.leader() => polled,
        };
        match polled {
            Ok(leader) => {
                if failing {
                    say!("distlock: the coordinator answers again");
                    failing = false;
                }
                if changes.is_news(leader.as_ref()) && !print_leader(args, leader.as_ref()) {
                    // Nobody reads any more (`| head -1`): end as a pipe's writer does.
                    return exit::signalled(nix::sys::signal::Signal::SIGPIPE as i32);
                }
            }
            Err(e) => {
                // Said once per outage; the watch goes on (as `observe` does).
                if !failing {
                    say!("distlock: cannot read the leader of {}: {e}", args.name);
                    failing = true;
                }
            }
        }
    }
}

/// What `leader --watch` has shown, to tell a change from the same leader again.
#[derive(Default)]
struct Changes {
    /// Whether anything was shown yet, and whether someone led then.
    shown: Option<bool>,
    /// The highest term shown.
    highest: Option<FencingToken>,
    /// The holder last shown (a leader without a term is told apart by it).
    holder: Option<HolderIdentity>,
}

impl Changes {
    /// Whether `now` is to be shown; records it if so.
    fn is_news(&mut self, now: Option<&Leader>) -> bool {
        self.note(now.map(|l| (l.term, l.holder.as_ref())))
    }

    /// [`Changes::is_news`] of a leader's term and holder (`None`: nobody leads).
    fn note(&mut self, now: Option<(Option<FencingToken>, Option<&HolderIdentity>)>) -> bool {
        let news = match (self.shown, now) {
            (None, _) | (Some(true), None) => true,
            (Some(false), None) => false,
            (Some(led), Some((term, holder))) => match (term, self.highest) {
                (Some(term), Some(highest)) => term > highest,
                (Some(_), None) => true,
                (None, _) => !led || self.holder.as_ref() != holder,
            },
        };
        if news {
            self.shown = Some(now.is_some());
            if let Some((term, holder)) = now {
                self.highest = self.highest.max(term);
                self.holder = holder.cloned();
            }
        }
        news
    }
}

/// One line on stdout, text or JSON; `false` when stdout is closed.
fn print_leader(args: &LeaderArgs, leader: Option<&Leader>) -> bool {
    let line = if args.json {
        serde_json::json!({
            "election": args.name,
            "leader": leader.is_some(),
            "term": leader.and_then(|l| l.term).map(|t| t.get()),
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
                let mut parts = vec![match leader.term {
                    Some(term) => format!("term {term}"),
                    None => "no term".to_owned(),
                }];
                parts.push(
                    leader
                        .holder
                        .as_ref()
                        .map_or_else(|| "an unknown holder".to_owned(), ToString::to_string),
                );
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_watch_shows_the_first_state_each_new_term_and_the_end_of_a_leadership() {
        let mut changes = Changes::default();
        let (a, b) = (
            HolderIdentity::from_stored(b"host=a").unwrap(),
            HolderIdentity::from_stored(b"host=b").unwrap(),
        );
        fn led(
            term: u64,
            who: &HolderIdentity,
        ) -> Option<(Option<FencingToken>, Option<&HolderIdentity>)> {
            Some((Some(FencingToken(term)), Some(who)))
        }
        assert!(changes.note(None), "the first look is always shown");
        assert!(!changes.note(None));
        assert!(changes.note(led(5, &a)));
        assert!(!changes.note(led(5, &a)), "the same term again");
        assert!(changes.note(led(7, &b)), "a new term without a gap between");
        assert!(changes.note(None), "nobody leads any more");
        assert!(
            !changes.note(led(6, &a)),
            "an older term than one shown (a stale read)"
        );
        assert!(changes.note(led(8, &a)));
        // Leaders without terms (no fencing) are told apart by their holder.
        let mut changes = Changes::default();
        assert!(changes.note(Some((None, Some(&a)))));
        assert!(!changes.note(Some((None, Some(&a)))));
        assert!(changes.note(Some((None, Some(&b)))));
        assert!(changes.note(None));
        assert!(changes.note(Some((None, Some(&b)))));
    }
}
