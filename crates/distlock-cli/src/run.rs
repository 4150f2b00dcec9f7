//! `distlock run KEY -- CMD [ARGS..]`.

use std::{
    io::{IsTerminal, Write},
    os::unix::process::ExitStatusExt,
    process::ExitStatus,
    time::Duration,
};

use distlock::{DistributedLockExt, DynLock, Error, LockGuard, LockKey};
use nix::{
    sys::signal::{Signal, killpg},
    unistd::Pid,
};
use tokio::{
    process::Command,
    signal::unix::{SignalKind, signal},
    time::{Instant, sleep, sleep_until},
};

use crate::{
    RunArgs,
    commands::describe_holder,
    duration::format_duration,
    exit::{self, code_for},
};

/// Runs the command under the lock and returns distlock's exit status.
pub async fn run(lock: DynLock, args: RunArgs) -> u8 {
    let key = match LockKey::new(&args.key) {
        Ok(key) => key,
        Err(e) => {
            eprintln!("distlock: {e}");
            return exit::USAGE;
        }
    };
    let guard = match acquire(&lock, &key, &args).await {
        Ok(Some(guard)) => guard,
        Ok(None) => return args.conflict_exit_code,
        Err(code) => return code,
    };
    supervise(guard, &args).await
}

/// Takes the lock (or reports why not). `Ok(None)`: not acquired.
async fn acquire(lock: &DynLock, key: &LockKey, args: &RunArgs) -> Result<Option<LockGuard>, u8> {
    let builder = lock.lock(key).ttl(args.ttl);
    let result = match args.wait {
        None => builder.try_acquire().await,
        Some(wait) => {
            let progress = std::io::stderr()
                .is_terminal()
                .then(|| tokio::spawn(show_progress(lock.clone(), key.clone())));
            let result = unless_interrupted(builder.wait(wait).acquire()).await;
            if let Some(progress) = progress {
                progress.abort();
                let _ = progress.await;
                eprint!("\r\x1b[K");
            }
            match result {
                Ok(result) => result.map(Some),
                Err(signal) => {
                    // The dropped acquire leaves the wait queue in the background; `main`
                    // waits for that before exiting.
                    eprintln!("distlock: interrupted by {signal} while waiting for {key}");
                    return Err(exit::signalled(signal as i32));
                }
            }
        }
    };
    match result {
        Ok(Some(guard)) => Ok(Some(guard)),
        Ok(None) | Err(Error::Timeout { .. }) => {
            let holder = match lock.inspect(key).await {
                Ok(Some(h)) => format!("held by {}", describe_holder(&h)),
                _ => "held by another owner".to_owned(),
            };
            let waited = args.wait.map_or(String::new(), |w| {
                format!(" after waiting {}", format_duration(w))
            });
            eprintln!("distlock: lock {key} not acquired{waited}: {holder}");
            Ok(None)
        }
        Err(e) => {
            eprintln!("distlock: {e}");
            Err(code_for(&e))
        }
    }
}

/// Runs `wait` unless SIGINT or SIGTERM comes first, which drops it and is returned.
async fn unless_interrupted<T>(wait: impl Future<Output = T>) -> Result<T, Signal> {
    let (Ok(mut sigint), Ok(mut sigterm)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        return Ok(wait.await);
    };
    tokio::select! {
        value = wait => Ok(value),
        _ = sigint.recv() => Err(Signal::SIGINT),
        _ = sigterm.recv() => Err(Signal::SIGTERM),
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
        let mut stderr = std::io::stderr().lock();
        let _ = write!(
            stderr,
            "\r\x1b[Kdistlock: waiting for {key} ({holder}), waited {}",
            format_duration(Duration::from_secs(started.elapsed().as_secs()))
        );
        let _ = stderr.flush();
    }
}

/// Runs the command while holding `guard`; terminates it on loss; releases at the end.
async fn supervise(guard: LockGuard, args: &RunArgs) -> u8 {
    let Some((program, program_args)) = args.command.split_first() else {
        eprintln!("distlock: no command given");
        return exit::USAGE;
    };
    let mut command = Command::new(program);
    command
        .args(program_args)
        .env("DISTLOCK_KEY", guard.key().as_str())
        .process_group(0);
    match guard.fencing_token() {
        Some(token) => command.env("DISTLOCK_FENCING_TOKEN", token.to_string()),
        None => command.env_remove("DISTLOCK_FENCING_TOKEN"),
    };
    // Install the handlers before the command starts so no signal slips through.
    let (mut sigint, mut sigterm) = match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(i), Ok(t)) => (i, t),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("distlock: cannot install signal handlers: {e}");
            let _ = guard.release().await;
            return exit::UNAVAILABLE;
        }
    };
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(e) => {
            eprintln!("distlock: cannot run {}: {e}", program.to_string_lossy());
            let _ = guard.release().await;
            return if e.kind() == std::io::ErrorKind::NotFound {
                exit::NOT_FOUND
            } else {
                exit::CANNOT_EXECUTE
            };
        }
    };
    // The child leads its own process group: its pid is the group id.
    let group = child
        .id()
        .and_then(|pid| i32::try_from(pid).ok())
        .map(Pid::from_raw);
    let signal_group = |sig: Signal| {
        if let Some(group) = group {
            // ESRCH: the group is already gone.
            let _ = killpg(group, sig);
        }
    };

    let lost = guard.lost();
    tokio::pin!(lost);
    let mut lost_seen = false;
    let mut kill_at: Option<Instant> = None;
    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            _ = sigint.recv() => signal_group(Signal::SIGINT),
            _ = sigterm.recv() => signal_group(Signal::SIGTERM),
            () = &mut lost, if !lost_seen => {
                lost_seen = true;
                let reason = guard
                    .loss_reason()
                    .map_or("unknown reason".to_owned(), |r| r.to_string());
                eprintln!(
                    "distlock: lost the lock {} ({reason}); terminating the command (SIGTERM, SIGKILL after {})",
                    guard.key(),
                    format_duration(args.kill_after)
                );
                signal_group(Signal::SIGTERM);
                kill_at = Some(Instant::now() + args.kill_after);
            }
            () = sleep_until(kill_at.unwrap_or_else(Instant::now)), if kill_at.is_some() => {
                eprintln!("distlock: the command outlived --kill-after; sending SIGKILL");
                signal_group(Signal::SIGKILL);
                kill_at = None;
            }
        }
    };
    let status = match status {
        Ok(status) => status,
        Err(e) => {
            eprintln!("distlock: lost track of the command: {e}");
            signal_group(Signal::SIGKILL);
            let _ = guard.release().await;
            return exit::UNAVAILABLE;
        }
    };
    if lost_seen || guard.is_lost() {
        if !lost_seen {
            eprintln!(
                "distlock: lost the lock {} before the command finished (it exited with {})",
                guard.key(),
                describe_status(status)
            );
        }
        let _ = guard.release().await;
        return exit::LOST;
    }
    let key = guard.key().clone();
    match guard.release().await {
        Ok(true) => {}
        Ok(false) => {
            eprintln!(
                "distlock: the lease on {key} had already expired when the command finished (it exited with {})",
                describe_status(status)
            );
            return exit::LOST;
        }
        Err(e) => eprintln!("distlock: releasing {key} failed ({e}); it will expire by its ttl"),
    }
    status_code(status)
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
