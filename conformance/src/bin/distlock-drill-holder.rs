//! Fault-drill helper: acquires a lock and holds it until its stdin closes, so a drill can
//! SIGKILL, SIGSTOP and SIGCONT a real holder process. Prints one JSON line per event on stdout
//! (see `conformance::drill::holder::HolderEvent`).
//!
//! ```text
//! distlock-drill-holder --url memory:// --key orders --ttl-ms 500 [--no-watchdog] [--write-every-ms 50] [--at-least-ms 2000]
//! ```
//!
//! Any `distlock::connect` URL works when the crate is built with its `drivers` feature
//! (`cargo build -p distlock-conformance --features drivers --bins`); without it only `memory://`.
//! With `--write-every-ms` it reports a write only while the lease is trusted: not lost and
//! before the guard's local deadline.
//!
//! Exit codes: 0 released after stdin closed; 2 usage, connection or acquire error; 3 the lease
//! was lost.

use std::{process::ExitCode, time::Duration};

use conformance::drill::holder::HolderEvent;
use lock_core::{DistributedLockExt, DynLock, LockKey, Result};
use tokio::{
    io::AsyncReadExt,
    time::{Instant, sleep_until},
};

/// Turns a backend URL into a client through the distlock facade (every coordinator), or — when
/// this crate is built without its `drivers` feature — only `memory://` (a coordinator inside this
/// process).
#[cfg(feature = "drivers")]
async fn connect(url: &str) -> Result<DynLock> {
    distlock::connect(url).await
}

#[cfg(not(feature = "drivers"))]
async fn connect(url: &str) -> Result<DynLock> {
    let scheme = url.split_once("://").map_or(url, |(scheme, _)| scheme);
    match scheme {
        "memory" => Ok(std::sync::Arc::new(lock_core::InMemoryLock::new())),
        // Never echo the URL itself: it may carry a password.
        other => Err(lock_core::Error::Config(format!(
            "this drill holder was built without the `drivers` feature of distlock-conformance \
             and cannot connect to {other}:// URLs"
        ))),
    }
}

struct Args {
    url: String,
    key: LockKey,
    ttl: Duration,
    watchdog: bool,
    write_every: Option<Duration>,
    at_least: Option<Duration>,
}

fn parse_args() -> std::result::Result<Args, String> {
    let mut url = None;
    let mut key = None;
    let mut ttl = None;
    let mut watchdog = true;
    let mut write_every = None;
    let mut at_least = None;
    let mut args = std::env::args().skip(1);
    let millis = |v: Option<String>, name: &str| -> std::result::Result<Duration, String> {
        v.and_then(|v| v.parse::<u64>().ok())
            .filter(|ms| *ms > 0)
            .map(Duration::from_millis)
            .ok_or_else(|| format!("{name} needs a positive number of milliseconds"))
    };
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--url" => url = args.next(),
            "--key" => {
                let k = args.next().ok_or("--key needs a value")?;
                key = Some(LockKey::new(k).map_err(|e| e.to_string())?);
            }
            "--ttl-ms" => ttl = Some(millis(args.next(), "--ttl-ms")?),
            "--write-every-ms" => write_every = Some(millis(args.next(), "--write-every-ms")?),
            "--at-least-ms" => at_least = Some(millis(args.next(), "--at-least-ms")?),
            "--no-watchdog" => watchdog = false,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(Args {
        url: url.ok_or("--url is required")?,
        key: key.ok_or("--key is required")?,
        ttl: ttl.ok_or("--ttl-ms is required")?,
        watchdog,
        write_every,
        at_least,
    })
}

fn emit(event: &HolderEvent) {
    if let Ok(line) = serde_json::to_string(event) {
        println!("{line}");
    }
}

fn fail(message: impl std::fmt::Display) -> ExitCode {
    emit(&HolderEvent::Error {
        message: message.to_string(),
    });
    ExitCode::from(2)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => return fail(message),
    };
    emit(&HolderEvent::Started {
        pid: std::process::id(),
    });
    let lock = match connect(&args.url).await {
        Ok(lock) => lock,
        Err(e) => return fail(e),
    };
    let mut builder = lock
        .lock(args.key.as_str())
        .ttl(args.ttl)
        .wait(Duration::from_secs(30));
    if !args.watchdog {
        builder = builder.no_watchdog();
    }
    if let Some(at_least) = args.at_least {
        builder = builder.at_least(at_least);
    }
    let asked = conformance::drill::holder::instant_to_monotonic(Instant::now());
    let guard = match builder.acquire().await {
        Ok(guard) => guard,
        Err(e) => return fail(e),
    };
    let granted = conformance::drill::holder::instant_to_monotonic(Instant::now());
    emit(&HolderEvent::Acquired {
        key: args.key.to_string(),
        fencing: guard.fencing_token().map(|f| f.get()),
        token: guard.token_digest().to_string(),
        ttl_ms: u64::try_from(args.ttl.as_millis()).unwrap_or(u64::MAX),
        asked_mono_ns: asked,
        granted_mono_ns: granted,
    });

    let lost = guard.lost();
    tokio::pin!(lost);
    let mut stdin = tokio::io::stdin();
    let mut buf = [0u8; 64];
    let report_every = (args.ttl / 10).max(Duration::from_millis(1));
    let mut next_report = Instant::now() + report_every;
    let mut reported = 0;
    let far = Duration::from_secs(86_400);
    let mut next_write = Instant::now() + args.write_every.unwrap_or(far);
    let mut writes = 0;
    loop {
        tokio::select! {
            biased;
            () = &mut lost => {
                let reason = guard
                    .loss_reason()
                    .map_or_else(|| "unknown".to_owned(), |r| r.to_string());
                emit(&HolderEvent::Lost { reason });
                // Not a return: the runtime's shutdown would wait for the blocking stdin read.
                std::process::exit(3);
            }
            read = stdin.read(&mut buf) => {
                if matches!(read, Ok(0) | Err(_)) {
                    break;
                }
            }
            () = sleep_until(next_report) => {
                next_report += report_every;
                let renewals = guard.renewals();
                if renewals != reported {
                    reported = renewals;
                    emit(&HolderEvent::Renewed {
                        renewals,
                        deadline_mono_ns: conformance::drill::holder::instant_to_monotonic(
                            guard.local_deadline(),
                        ),
                    });
                }
            }
            () = sleep_until(next_write) => {
                next_write = Instant::now() + args.write_every.unwrap_or(far);
                // Write only while the lease is trusted: not reported lost AND inside its local
                // deadline. A process resumed after a pause sees its write timer and the
                // watchdog's deadline fire together; whichever task runs first, a lapsed
                // deadline means no write (the lost branch reports the loss right after).
                if !guard.is_lost() && Instant::now() < guard.local_deadline() {
                    writes += 1;
                    emit(&HolderEvent::Write {
                        fencing: guard.fencing_token().map(|f| f.get()),
                        seq: writes,
                    });
                }
            }
        }
    }
    match guard.release().await {
        Ok(released) => {
            emit(&HolderEvent::Released { released });
            ExitCode::SUCCESS
        }
        Err(e) => fail(e),
    }
}
