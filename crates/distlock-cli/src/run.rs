//! `distlock run KEY -- CMD [ARGS..]`.
//!
//! The command never outlives the lease: before it starts, distlock re-executes itself as a guard
//! process ([`crate::guard`]) in a process group of its own. The command gets another group of
//! its own (it leads it), outside the guard's: a `kill -STOP -PGID` of the command's group or a
//! terminal's Ctrl-Z stops the command, never the guard that polices it. The command starts as
//! a wrapper (`distlock __exec`) that registers its group with the guard and waits for the
//! guard's acknowledgement before it becomes the command, so the guard knows the group before
//! anything of the command runs, whenever the supervisor dies. distlock (the supervisor) tells
//! the guard every new local deadline; the guard kills the whole group when the supervisor dies,
//! or when the deadline comes so close that SIGKILL would otherwise land after it (the
//! supervisor is frozen or cannot renew). A lease lost while the supervisor is alive is handled
//! the same way, through the guard.

use std::{
    ffi::OsString,
    fs::File,
    io::IsTerminal,
    os::unix::process::ExitStatusExt,
    process::{ExitStatus, Stdio},
    time::Duration,
};

use distlock::{DistributedLockExt, DynLock, Error, LockBuilder, LockGuard, LockKey};
use nix::{
    sys::{
        signal::{Signal, killpg},
        wait::{Id, WaitPidFlag, WaitStatus, waitid},
    },
    unistd::{Pid, getpgrp, getpid, tcgetpgrp, tcsetpgrp},
};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines},
    process::{Child, ChildStdin, ChildStdout, Command},
    signal::unix::{Signal as SignalStream, SignalKind, signal},
    time::{Instant, sleep, sleep_until, timeout, timeout_at},
};

use crate::{
    RunArgs, clock,
    commands::describe_holder,
    duration::format_duration,
    exit::{self, code_for},
    procfs,
};

/// Environment variables of distlock's own that the command (and the guard) must not see: the
/// URL may carry a password.
pub const PRIVATE_ENV: [&str; 2] = ["DISTLOCK_URL", "DISTLOCK_URL_FILE"];

/// `--json`: one JSON object per event on stderr (stdout is the command's).
pub fn event(json: bool, value: serde_json::Value) {
    if json {
        say!("{value}");
    }
}

/// Runs the command under the lock and returns distlock's exit status.
pub async fn run(lock: DynLock, args: RunArgs, wait_deadline: Option<Instant>) -> u8 {
    let code = run_inner(lock, &args, wait_deadline).await;
    event(
        args.json,
        serde_json::json!({"event": "exit", "key": args.key, "status": code}),
    );
    code
}

async fn run_inner(lock: DynLock, args: &RunArgs, wait_deadline: Option<Instant>) -> u8 {
    let key = match LockKey::new(&args.key) {
        Ok(key) => key,
        Err(e) => {
            say!("distlock: {e}");
            return exit::USAGE;
        }
    };
    let span = lease_span(&lock.capabilities(), args.ttl);
    let timing = match Timing::new(args.kill_after, args.ttl, span) {
        Ok(timing) => timing,
        Err(message) => {
            say!("distlock: {message}");
            return exit::USAGE;
        }
    };
    let wait = match args.wait {
        None => Wait::No,
        Some(wait) => Wait::Up(wait),
    };
    let report = Report {
        quiet: args.quiet,
        json: args.json,
    };
    let make = || {
        let mut builder = lock.lock(&key).ttl(args.ttl);
        if let Some(d) = args.at_least {
            builder = builder.at_least(d);
        }
        if let Some(d) = args.at_most {
            builder = builder.at_most(d);
        }
        builder
    };
    let guard = match acquire(&lock, &key, make, &timing, wait, report, wait_deadline).await {
        Ok(Some(guard)) => guard,
        Ok(None) => {
            event(
                args.json,
                serde_json::json!({"event": "not_acquired", "key": key.as_str()}),
            );
            return args.conflict_exit_code;
        }
        Err(code) => return code,
    };
    let fencing = guard.fencing_token().map(|f| f.get());
    event(
        args.json,
        serde_json::json!({"event": "acquired", "key": key.as_str(), "fencing_token": fencing,
            "ttl_ms": u64::try_from(guard.ttl().as_millis()).unwrap_or(u64::MAX)}),
    );
    if args.verbose {
        let token = fencing.map_or(String::new(), |f| format!(" (fencing token {f})"));
        say!("distlock: acquired {key}{token}");
    }
    let mut env = vec![("DISTLOCK_KEY", key.as_str().to_owned())];
    let mut unset = Vec::new();
    match guard.fencing_token() {
        Some(token) => env.push(("DISTLOCK_FENCING_TOKEN", token.to_string())),
        None => unset.push("DISTLOCK_FENCING_TOKEN"),
    }
    let job = Job {
        program: args.program(),
        env,
        unset,
        wait_group: args.wait_group,
        verbose: args.verbose,
        json: args.json,
    };
    supervise(guard, &job, &timing).await
}

/// The command `supervise` runs under a lease, and how it reports.
pub struct Job {
    /// The program and its arguments.
    pub program: Vec<OsString>,
    /// Set in the command's environment.
    pub env: Vec<(&'static str, String)>,
    /// Removed from the command's environment (besides [`PRIVATE_ENV`]).
    pub unset: Vec<&'static str>,
    /// Keep the lease until the command's whole process group is gone (`--wait-group`).
    pub wait_group: bool,
    /// Say when the lease is released.
    pub verbose: bool,
    /// Report the loss as a JSON event.
    pub json: bool,
}

/// How long a lease can be left with right after a renewal: the TTL, except on a session-bound
/// backend (ZooKeeper). There the lease lasts the session timeout (its minimum TTL) from the
/// last moment the leader is proven to have seen the session — a `sync` answered up to a
/// quarter timeout after the request it vouches for, on a heartbeat every quarter timeout — so
/// a renewed lease may have only half the session timeout left. Counting the whole session
/// made the guard terminate every command a few seconds in ("not renewed in time").
pub fn lease_span(caps: &distlock::Capabilities, ttl: Duration) -> Duration {
    if caps.session_bound && !caps.min_ttl.is_zero() {
        ttl.min(caps.min_ttl) / 2
    } else {
        ttl
    }
}

/// When the command's group is signalled, relative to the lease's local deadline.
pub struct Timing {
    /// SIGTERM this long before SIGKILL.
    pub kill_after: Duration,
    /// SIGKILL this long before the local deadline: room for the guard to be scheduled late.
    pub margin: Duration,
    /// The watchdog's renewal interval.
    pub renew_every: Duration,
}

impl Timing {
    /// Checks `--kill-after` against what the lease can cover (before any I/O: `main` calls
    /// this with the TTL for `span`, `run` again with the backend's span). The guard sends
    /// SIGTERM `kill_after` (plus the margin) before the local deadline when no renewal came; a
    /// renewal is due every quarter of the span and a lease may be up to a quarter span old when
    /// granted, so at most a third of the span leaves room for the renewal to arrive first.
    pub fn new(
        kill_after: Option<Duration>,
        ttl: Duration,
        span: Duration,
    ) -> Result<Self, String> {
        let most = span / 3;
        let kill_after = match kill_after {
            None => Duration::from_secs(5).min(span / 4),
            Some(k) if k > most => {
                let capped = if span < ttl {
                    format!(" (the backend caps leases at {})", format_duration(span))
                } else {
                    String::new()
                };
                return Err(format!(
                    "--kill-after {} is more than the lease can cover: at most a third of the lease's ttl \
                     ({} for a ttl of {}{capped}), so that SIGKILL lands before the lease's local deadline",
                    format_duration(k),
                    format_duration(most),
                    format_duration(span)
                ));
            }
            Some(k) => k,
        };
        Ok(Self {
            kill_after,
            margin: (span / 10).clamp(Duration::from_millis(100), Duration::from_secs(1)),
            renew_every: span / 4,
        })
    }
}

/// How long [`acquire`] waits for the lock.
#[derive(Clone, Copy, Debug)]
pub enum Wait {
    /// One attempt.
    No,
    /// Up to this long.
    Up(Duration),
    /// Until acquired (or interrupted).
    Forever,
}

/// How [`acquire`] reports.
#[derive(Clone, Copy, Debug)]
pub struct Report {
    /// Say nothing when not acquired.
    pub quiet: bool,
    /// JSON events: no progress line.
    pub json: bool,
}

/// One round of [`Wait::Forever`]: the acquire is started again after it (a far deadline, not
/// an unbounded one, for the drivers' arithmetic).
const FOREVER_ROUND: Duration = Duration::from_secs(24 * 3600);

/// Takes the lock with the builder `make` gives (with the watchdog `timing` wants added), or
/// reports why not. `Ok(None)`: not acquired.
pub async fn acquire(
    lock: &DynLock,
    key: &LockKey,
    make: impl Fn() -> LockBuilder,
    timing: &Timing,
    wait: Wait,
    report: Report,
    wait_deadline: Option<Instant>,
) -> Result<Option<LockGuard>, u8> {
    let builder = || {
        let builder = make();
        if lock.capabilities().renew && !timing.renew_every.is_zero() {
            // Every quarter span rather than the usual third: more room between a renewal and
            // the moment the guard must start terminating the command (see `Timing::new`).
            builder.watchdog(timing.renew_every)
        } else {
            builder
        }
    };
    let result = match wait {
        Wait::No => builder().try_acquire().await,
        Wait::Up(_) | Wait::Forever => {
            let progress = (std::io::stderr().is_terminal() && !report.quiet && !report.json)
                .then(|| tokio::spawn(show_progress(lock.clone(), key.clone())));
            let waiting = async {
                match wait {
                    Wait::Up(wait) => builder().wait(wait).acquire().await,
                    _ => loop {
                        match builder().wait(FOREVER_ROUND).acquire().await {
                            Err(Error::Timeout { .. }) => {}
                            other => break other,
                        }
                    },
                }
            };
            let bounded = async {
                match wait_deadline {
                    Some(deadline) => timeout_at(deadline, waiting).await,
                    None => Ok(waiting.await),
                }
            };
            let result = unless_interrupted(bounded).await;
            if let Some(progress) = progress {
                progress.abort();
                let _ = progress.await;
                crate::diag::write("\r\x1b[K".to_owned());
            }
            match result {
                Ok(Ok(result)) => result.map(Some),
                Ok(Err(_elapsed)) => {
                    let within = match wait {
                        Wait::Up(wait) => format!(" within the wait of {}", format_duration(wait)),
                        _ => String::new(),
                    };
                    say!(
                        "distlock: lock {key} not acquired: the coordinator did not answer{within}"
                    );
                    return Err(exit::UNAVAILABLE);
                }
                Err(signal) => {
                    // The dropped acquire leaves the wait queue in the background; `main`
                    // waits for that before exiting.
                    say!("distlock: interrupted by {signal} while waiting for {key}");
                    return Err(exit::signalled(signal as i32));
                }
            }
        }
    };
    match result {
        Ok(Some(guard)) => Ok(Some(guard)),
        Ok(None) | Err(Error::Timeout { .. }) => {
            let waited = match wait {
                Wait::Up(w) => format!(" after waiting {}", format_duration(w)),
                _ => String::new(),
            };
            let holder = match timeout(INSPECT_LIMIT, lock.inspect(key)).await {
                Ok(Ok(Some(h))) => format!("held by {}", describe_holder(&h)),
                Ok(Ok(None)) => {
                    "another owner held it when it was tried; nobody holds it now".to_owned()
                }
                // The wait ran out and the coordinator does not answer now: that may be an
                // outage as well as a conflict, so it is not reported as a conflict.
                failed if !matches!(wait, Wait::No) => {
                    let why = match failed {
                        Ok(Err(e)) => e.to_string(),
                        _ => format!("no answer within {}", format_duration(INSPECT_LIMIT)),
                    };
                    say!(
                        "distlock: lock {key} not acquired{waited}, and the coordinator cannot be reached to tell whether another owner holds it: {why}"
                    );
                    return Err(exit::UNAVAILABLE);
                }
                _ => "held by another owner".to_owned(),
            };
            if !report.quiet {
                say!("distlock: lock {key} not acquired{waited}: {holder}");
            }
            Ok(None)
        }
        Err(e) => {
            say!("distlock: {}", explain(lock, &e));
            Err(code_for(&e))
        }
    }
}

/// `error`'s message, with how to fix a TTL below a session-bound backend's minimum: there
/// (ZooKeeper) the minimum is the session timeout, which the URL sets.
pub fn explain(lock: &DynLock, error: &Error) -> String {
    let caps = lock.capabilities();
    match error {
        Error::InvalidTtl { ttl, .. } if caps.session_bound && *ttl < caps.min_ttl => format!(
            "{error}: on {} the smallest ttl is the session timeout; lower it with the URL \
             option session_timeout (e.g. ?session_timeout={}ms, within the server's \
             minSessionTimeout..maxSessionTimeout), or ask for a ttl of at least {}",
            lock.backend_name(),
            ttl.as_millis(),
            format_duration(caps.min_ttl)
        ),
        _ => error.to_string(),
    }
}

/// `run --wait W` gives up after W plus this at the latest, connecting included, also when the
/// coordinator does not answer.
pub const WAIT_SLACK: Duration = Duration::from_secs(1);

/// How long the holder is looked up for the not-acquired message.
const INSPECT_LIMIT: Duration = Duration::from_millis(500);

/// SIGINT, SIGTERM, SIGHUP and SIGQUIT: what ends a job from a terminal, a session or a
/// service manager. All four are handled alike.
pub struct Signals {
    int: SignalStream,
    term: SignalStream,
    hup: SignalStream,
    quit: SignalStream,
}

impl Signals {
    /// Installs the handlers.
    pub fn new() -> std::io::Result<Self> {
        Ok(Self {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
            hup: signal(SignalKind::hangup())?,
            quit: signal(SignalKind::quit())?,
        })
    }

    /// The next of these signals.
    pub async fn recv(&mut self) -> Signal {
        tokio::select! {
            Some(()) = self.int.recv() => Signal::SIGINT,
            Some(()) = self.term.recv() => Signal::SIGTERM,
            Some(()) = self.hup.recv() => Signal::SIGHUP,
            Some(()) = self.quit.recv() => Signal::SIGQUIT,
            else => std::future::pending().await,
        }
    }
}

/// Runs `wait` unless one of [`Signals`] comes first, which drops it and is returned.
async fn unless_interrupted<T>(wait: impl Future<Output = T>) -> Result<T, Signal> {
    let Ok(mut signals) = Signals::new() else {
        return Ok(wait.await);
    };
    tokio::select! {
        value = wait => Ok(value),
        signal = signals.recv() => Err(signal),
    }
}

/// While waiting more than a second, shows who holds the lock and how long we have waited.
async fn show_progress(lock: DynLock, key: distlock::LockKey) {
    let started = Instant::now();
    loop {
        sleep(Duration::from_secs(1)).await;
        let holder = match lock.inspect(&key).await {
            Ok(Some(h)) => format!("held by {}", describe_holder(&h)),
            Ok(None) => "being handed over".to_owned(),
            Err(e) => format!("cannot inspect: {}", e.kind()),
        };
        crate::diag::write(format!(
            "\r\x1b[Kdistlock: waiting for {key} ({holder}), waited {}",
            format_duration(Duration::from_secs(started.elapsed().as_secs()))
        ));
    }
}

/// The supervisor's side of the guard process.
struct GuardProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Lines<BufReader<ChildStdout>>,
    /// The guard's pid (it leads a group of its own).
    pid: Pid,
    /// The command's process group (the command's pid), once it is started.
    group: Option<Pid>,
    /// The local deadline the guard was last told.
    told: Instant,
    /// What the guard reported it is terminating the group for.
    terminating: Option<String>,
    out_closed: bool,
    exited: bool,
}

impl GuardProcess {
    async fn spawn(
        lease: &LockGuard,
        kill_after: Duration,
        margin: Duration,
    ) -> std::io::Result<Self> {
        let deadline = lease.local_deadline();
        let millis = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX).to_string();
        let mut command = Command::new("/proc/self/exe");
        command
            .arg0("distlock")
            .arg("__guard")
            .arg("--parent")
            .arg(getpid().as_raw().to_string())
            .arg("--key")
            .arg(lease.key().as_str())
            .arg("--deadline-ns")
            .arg(clock::deadline_ns(deadline).to_string())
            .arg("--kill-after-ms")
            .arg(millis(kill_after))
            .arg("--margin-ms")
            .arg(millis(margin))
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for name in PRIVATE_ENV {
            command.env_remove(name);
        }
        let mut child = command.spawn()?;
        let failed = |what: &str| std::io::Error::other(format!("the guard process {what}"));
        let pid = child
            .id()
            .and_then(|pid| i32::try_from(pid).ok())
            .map(Pid::from_raw)
            .ok_or_else(|| failed("has no pid"))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill().await;
            return Err(failed("has no pipes"));
        };
        let mut lines = BufReader::new(stdout).lines();
        match timeout(Duration::from_secs(10), lines.next_line()).await {
            Ok(Ok(Some(line))) if line == "ready" => {}
            _ => {
                let _ = child.kill().await;
                return Err(failed("did not start"));
            }
        }
        Ok(Self {
            child,
            stdin: Some(stdin),
            lines,
            pid,
            group: None,
            told: deadline,
            terminating: None,
            out_closed: false,
            exited: false,
        })
    }

    async fn send(&mut self, message: &str) {
        if let Some(stdin) = &mut self.stdin
            && stdin.write_all(message.as_bytes()).await.is_err()
        {
            // The guard is gone; its exit is noticed through `child.wait()`.
            self.stdin = None;
        }
    }

    /// Tells the guard the lease's local deadline if it moved (a renewal).
    async fn tell_deadline(&mut self, lease: &LockGuard) {
        let deadline = lease.local_deadline();
        if deadline > self.told {
            self.told = deadline;
            self.send(&format!("deadline {}\n", clock::deadline_ns(deadline)))
                .await;
        }
    }

    fn on_line(&mut self, line: std::io::Result<Option<String>>) {
        match line {
            Ok(Some(line)) => {
                if let Some(reason) = line.strip_prefix("terminating ") {
                    self.terminating.get_or_insert_with(|| reason.to_owned());
                }
            }
            Ok(None) | Err(_) => self.out_closed = true,
        }
    }

    /// Says `done` and waits for the guard to exit: at once if it is not terminating the group,
    /// else once the group is gone or SIGKILLed (at the latest at the deadline's kill time).
    async fn finish(&mut self) {
        self.send("done\n").await;
        self.stdin = None;
        while !self.out_closed {
            let line = self.lines.next_line().await;
            self.on_line(line);
        }
        if !self.exited {
            let _ = self.child.wait().await;
            self.exited = true;
        }
    }

    fn signal_group(&self, signal: Signal) {
        // ESRCH: the group is already gone.
        if let Some(group) = self.group {
            let _ = killpg(group, signal);
        }
    }
}

/// The terminal's foreground handed to the command's group for its run (like
/// `timeout --foreground`), so that a command that reads the terminal (a password prompt, `read`)
/// works instead of being stopped by SIGTTIN; given back when dropped. distlock keeps SIGTTOU
/// blocked (`main`) so that it can take the terminal back from the background.
struct Foreground {
    tty: File,
    original: Pid,
}

impl Foreground {
    /// Only when distlock itself is in the foreground of its controlling terminal and one of
    /// its standard streams is a terminal (not when run with all three redirected, as by a
    /// test harness or a script that only happens to have a terminal).
    fn take(group: Pid) -> Option<Self> {
        let interactive = std::io::stdin().is_terminal()
            || std::io::stdout().is_terminal()
            || std::io::stderr().is_terminal();
        if !interactive {
            return None;
        }
        let tty = File::options()
            .read(true)
            .write(true)
            .open("/dev/tty")
            .ok()?;
        let original = getpgrp();
        if tcgetpgrp(&tty).ok()? != original {
            return None;
        }
        tcsetpgrp(&tty, group).ok()?;
        Some(Self { tty, original })
    }

    fn owned_by(&self, group: Pid) -> bool {
        tcgetpgrp(&self.tty).is_ok_and(|g| g == group)
    }
}

impl Drop for Foreground {
    fn drop(&mut self) {
        let _ = tcsetpgrp(&self.tty, self.original);
    }
}

/// Runs the command while holding `lease`; terminates it on loss; releases at the end.
pub async fn supervise(lease: LockGuard, job: &Job, timing: &Timing) -> u8 {
    let (kill_after, margin) = (timing.kill_after, timing.margin);
    let command_line = &job.program;
    let Some((program, program_args)) = command_line.split_first() else {
        say!("distlock: no command given");
        return exit::USAGE;
    };
    let key = lease.key().clone();
    // Install the handlers before the command starts so no signal slips through.
    let mut signals = match Signals::new() {
        Ok(signals) => signals,
        Err(e) => {
            say!("distlock: cannot install signal handlers: {e}");
            release_after_loss(lease).await;
            return exit::INTERNAL;
        }
    };
    // A lease granted with little of its span left (a hand-over, a session vouched for a while
    // ago): the guard could start terminating the command before the first renewal reaches it,
    // so wait for that renewal.
    let needed = kill_after + margin + timing.renew_every + Duration::from_millis(100);
    while lease.local_deadline() <= Instant::now() + needed {
        if lease.is_lost() || lease.local_deadline() <= Instant::now() {
            say!("distlock: lost the lock {key} before the command could start");
            let _ = lease.release().await;
            return exit::LOST;
        }
        sleep(Duration::from_millis(10)).await;
    }
    let mut guard = match GuardProcess::spawn(&lease, kill_after, margin).await {
        Ok(guard) => guard,
        Err(e) => {
            say!("distlock: cannot start the guard process: {e}");
            let _ = lease.release().await;
            return exit::INTERNAL;
        }
    };
    // The wrapper registers its group (its pid) with the guard, waits for the guard's
    // acknowledgement, then executes the command in its place (same pid and group).
    let mut command = Command::new("/proc/self/exe");
    command
        .arg0("distlock")
        .arg(crate::guard::EXEC)
        .arg(guard.pid.as_raw().to_string())
        .arg(program)
        .args(program_args)
        .process_group(0);
    for name in PRIVATE_ENV.iter().chain(&job.unset) {
        command.env_remove(name);
    }
    command.envs(job.env.iter().map(|(name, value)| (name, value)));
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(e) => {
            guard.finish().await;
            say!("distlock: cannot run {}: {e}", program.to_string_lossy());
            let _ = lease.release().await;
            return if e.kind() == std::io::ErrorKind::NotFound {
                exit::NOT_FOUND
            } else {
                exit::CANNOT_EXECUTE
            };
        }
    };
    let pid = child
        .id()
        .and_then(|pid| i32::try_from(pid).ok())
        .map(Pid::from_raw);
    let Some(group) = pid else {
        say!("distlock: the command has no pid");
        let _ = child.kill().await;
        guard.finish().await;
        release_after_loss(lease).await;
        return exit::INTERNAL;
    };
    guard.group = Some(group);
    let foreground = Foreground::take(group);

    let lost = lease.lost();
    tokio::pin!(lost);
    let mut lost_seen = false;
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut leader: Option<ExitStatus> = None;
    let mut stopped = false;
    let mut tty_stop: Option<Signal> = None;
    loop {
        if leader.is_some()
            && (!job.wait_group
                || guard.terminating.is_some()
                || !procfs::has_live_members(group.as_raw(), 0))
        {
            break;
        }
        tokio::select! {
            status = child.wait(), if leader.is_none() => {
                leader = Some(status.unwrap_or_else(|e| {
                    say!("distlock: lost track of the command: {e}");
                    guard.signal_group(Signal::SIGKILL);
                    ExitStatus::from_raw(Signal::SIGKILL as i32)
                }));
            }
            line = guard.lines.next_line(), if !guard.out_closed => guard.on_line(line),
            _ = guard.child.wait(), if !guard.exited => {
                guard.exited = true;
                // What it reported before it went is still in the pipe.
                while !guard.out_closed {
                    let line = guard.lines.next_line().await;
                    guard.on_line(line);
                }
                if guard.terminating.is_none() {
                    // Without its guard the command is not safe to leave running.
                    let code = without_guard(&mut child, &guard, &lease, kill_after, margin).await;
                    drop(foreground);
                    release_after_loss(lease).await;
                    return code;
                }
            }
            _ = tick.tick() => {
                guard.tell_deadline(&lease).await;
                if let (None, Some(pid)) = (leader, pid) {
                    match waitid(Id::Pid(pid), WaitPidFlag::WSTOPPED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT) {
                        Ok(WaitStatus::Stopped(_, signal)) if !stopped => {
                            stopped = true;
                            if let Some(signal) = on_stop(signal, &guard, foreground.as_ref(), &key) {
                                tty_stop = Some(signal);
                                guard.send("terminate tty\n").await;
                            }
                        }
                        Ok(WaitStatus::Stopped(..)) => {}
                        _ => stopped = false,
                    }
                }
            }
            signal = signals.recv() => guard.signal_group(signal),
            () = &mut lost, if !lost_seen => {
                lost_seen = true;
                let reason = lease
                    .loss_reason()
                    .map_or("unknown reason".to_owned(), |r| r.to_string());
                event(job.json, serde_json::json!({"event": "lost", "key": key.as_str(), "reason": reason}));
                if guard.terminating.is_none() && !guard.exited {
                    say!(
                        "distlock: lost the lock {key} ({reason}); terminating the command (SIGTERM, SIGKILL after at most {})",
                        format_duration(kill_after)
                    );
                    guard.send("terminate lost\n").await;
                } else {
                    say!("distlock: lost the lock {key} ({reason})");
                }
            }
        }
    }
    guard.finish().await;
    drop(foreground);
    let status = leader.unwrap_or_else(|| ExitStatus::from_raw(Signal::SIGKILL as i32));

    if let Some(signal) = tty_stop {
        release_after_loss(lease).await;
        return exit::signalled(signal as i32);
    }
    if let Some(reason) = &guard.terminating {
        if reason == "deadline" && !lease.is_lost() {
            say!(
                "distlock: the command was terminated because the lease on {key} was not renewed in time"
            );
        }
        release_after_loss(lease).await;
        return exit::LOST;
    }
    if lease.is_lost() {
        say!(
            "distlock: lost the lock {key} before the command finished (it exited with {}, not terminated)",
            describe_status(status)
        );
        release_after_loss(lease).await;
        return exit::LOST_UNTERMINATED;
    }
    match lease.release().await {
        Ok(true) => {
            if job.verbose {
                say!("distlock: released {key}");
            }
        }
        Ok(false) => {
            say!(
                "distlock: the lease on {key} had already expired when the command finished (it exited with {}, not terminated)",
                describe_status(status)
            );
            return exit::LOST_UNTERMINATED;
        }
        Err(e) => say!("distlock: releasing {key} failed ({e}); it will expire by its ttl"),
    }
    status_code(status)
}

/// How long `run` waits for a release once the lease is lost or its command was terminated
/// (then the release goes on in the background, for [`AFTER_LOSS`] more in `main`): a frozen
/// or unreachable coordinator must not hold distlock's exit back, which comes within one
/// --kill-after + 1 s of the command's death.
pub const AFTER_LOSS: Duration = Duration::from_millis(400);

/// Releases a lease that is lost or whose command was terminated, waiting at most
/// [`AFTER_LOSS`] (the release is cancellation safe: it finishes in the background).
async fn release_after_loss(lease: LockGuard) {
    let _ = timeout(AFTER_LOSS, lease.release()).await;
}

/// What to do about the command's top process having been stopped by `signal`; `Some` when the
/// command must be terminated for it.
fn on_stop(
    signal: Signal,
    guard: &GuardProcess,
    foreground: Option<&Foreground>,
    key: &LockKey,
) -> Option<Signal> {
    match signal {
        Signal::SIGTTIN | Signal::SIGTTOU => {
            if foreground.is_some_and(|f| guard.group.is_some_and(|g| f.owned_by(g))) {
                // It touched the terminal in the instant before it was handed over.
                guard.signal_group(Signal::SIGCONT);
                None
            } else {
                say!(
                    "distlock: the command was stopped by {signal}: it used the terminal, which is not its own \
                     (distlock is not in the terminal's foreground); terminating it so that it does not hold {key} forever"
                );
                Some(signal)
            }
        }
        Signal::SIGTSTP if foreground.is_some() => {
            say!(
                "distlock: job control does not work under `distlock run`: the command, stopped by SIGTSTP, \
                 was resumed (it holds {key})"
            );
            guard.signal_group(Signal::SIGCONT);
            None
        }
        // SIGSTOP from someone's `kill`: they want it paused; it keeps the lock meanwhile.
        _ => None,
    }
}

/// The guard process died on its own (someone killed it): nothing would stop the command if
/// distlock died next, so stop it now, as the guard would.
async fn without_guard(
    child: &mut Child,
    guard: &GuardProcess,
    lease: &LockGuard,
    kill_after: Duration,
    margin: Duration,
) -> u8 {
    say!(
        "distlock: the guard process of the command holding {} died; terminating the command (SIGTERM, SIGKILL after {})",
        lease.key(),
        format_duration(kill_after)
    );
    guard.signal_group(Signal::SIGTERM);
    guard.signal_group(Signal::SIGCONT);
    let kill_at = (Instant::now() + kill_after).min(
        lease
            .local_deadline()
            .checked_sub(margin)
            .unwrap_or_else(Instant::now),
    );
    tokio::select! {
        _ = child.wait() => {}
        () = sleep_until(kill_at) => {}
    }
    guard.signal_group(Signal::SIGKILL);
    let _ = child.wait().await;
    exit::INTERNAL
}

fn status_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code & 0xff).unwrap_or(u8::MAX),
        (None, Some(sig)) => exit::signalled(sig),
        (None, None) => exit::UNAVAILABLE,
    }
}

fn describe_status(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("status {code}"),
        (None, Some(sig)) => format!("signal {sig}"),
        _ => "an unknown status".to_owned(),
    }
}
