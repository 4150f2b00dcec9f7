//! A lock holder in its own process, so drills can SIGKILL, SIGSTOP and SIGCONT it.
//!
//! [`HolderProcess::spawn`] runs the `distlock-drill-holder` binary of this crate, which
//! connects to a backend by URL, acquires a key (waiting up to 30 s), keeps it with its watchdog
//! and prints one JSON line per [`HolderEvent`] on stdout. It releases and exits 0 when its stdin
//! is closed ([`HolderProcess::release`]); it exits 3 after reporting a loss; 2 on a usage or
//! connection error. The parent reads the lines as they come and stamps each with its receive
//! time on the parent's monotonic clock.
//!
//! Finding the binary: `$DISTLOCK_DRILL_HOLDER`, else `distlock-drill-holder` next to the
//! running test executable's `deps/` directory (where cargo puts it when it builds this
//! package's binaries, e.g. for tests of this package). Tests of this package can pass
//! `env!("CARGO_BIN_EXE_distlock-drill-holder")` to [`HolderProcess::spawn_with`].

use std::{
    io,
    path::{Path, PathBuf},
    process::{ExitStatus, Stdio},
    sync::Arc,
    time::Duration,
};

use lock_core::LockKey;
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};
use serde::{Deserialize, Serialize};
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::{Child, ChildStdin, Command},
    sync::watch,
    task::JoinHandle,
    time::Instant,
};

/// The binary's name.
pub const HOLDER_BINARY: &str = "distlock-drill-holder";

/// One line of the holder's stdout.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum HolderEvent {
    /// The process started and is connecting.
    Started {
        /// Its process id.
        pid: u32,
    },
    /// The lock was granted.
    Acquired {
        /// The key.
        key: String,
        /// The fencing token, if the backend mints them.
        fencing: Option<u64>,
        /// The ownership token's digest.
        token: String,
        /// The TTL.
        ttl_ms: u64,
        /// When the holder asked for the grant (just before its acquire was sent), on the
        /// machine's monotonic clock like [`HolderEvent::Renewed`]'s deadline: no later than
        /// the coordinator's grant, so job mode's `at_least` can be counted from it (see
        /// [`monotonic_to_instant`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        asked_mono_ns: Option<u64>,
        /// When the holder's acquire returned the grant, on the same clock.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        granted_mono_ns: Option<u64>,
    },
    /// The watchdog renewed the lease (reported within a tenth of the TTL).
    Renewed {
        /// Renewals so far.
        renewals: u64,
        /// The guard's local deadline after the latest renewal, on the machine's monotonic
        /// clock (`CLOCK_MONOTONIC`, nanoseconds), which the parent shares: see
        /// [`monotonic_to_instant`].
        #[serde(default, skip_serializing_if = "Option::is_none")]
        deadline_mono_ns: Option<u64>,
    },
    /// With `--write-every-ms`: the holder, believing it still holds the lock, writes now. The
    /// parent applies the write to its resource when it reads the line (a late line is a late
    /// write: exactly what a paused holder does after it resumes).
    Write {
        /// The fencing token the write carries.
        fencing: Option<u64>,
        /// 1, 2, 3, … per process.
        seq: u64,
    },
    /// The guard reported the lease lost; the process exits 3.
    Lost {
        /// Why.
        reason: String,
    },
    /// The lock was released (stdin closed); the process exits 0.
    Released {
        /// What the release returned.
        released: bool,
    },
    /// Something failed (connect, acquire, release); the process exits 2.
    Error {
        /// What.
        message: String,
    },
}

/// How to run a holder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HolderOptions {
    /// The backend URL (`memory://`; the others once the holder's `connect` knows them).
    pub url: String,
    /// The key to hold.
    pub key: LockKey,
    /// The lease TTL.
    pub ttl: Duration,
    /// Renew with the watchdog (default); `false` lets the lease lapse after one TTL.
    pub watchdog: bool,
    /// Emit a [`HolderEvent::Write`] this often while the lock is believed held.
    pub write_every: Option<Duration>,
    /// Job mode's `at_least`: the lease is kept on the coordinator until this long after the
    /// grant, whatever becomes of the holder.
    pub at_least: Option<Duration>,
}

impl HolderOptions {
    /// Holds `key` at `url` for `ttl` with the watchdog on, without writes.
    pub fn new(url: impl Into<String>, key: LockKey, ttl: Duration) -> Self {
        Self {
            url: url.into(),
            key,
            ttl,
            watchdog: true,
            write_every: None,
            at_least: None,
        }
    }

    /// The command-line arguments of the holder binary.
    pub fn args(&self) -> Vec<String> {
        let mut args = vec![
            "--url".to_owned(),
            self.url.clone(),
            "--key".to_owned(),
            self.key.to_string(),
            "--ttl-ms".to_owned(),
            self.ttl.as_millis().to_string(),
        ];
        if !self.watchdog {
            args.push("--no-watchdog".to_owned());
        }
        if let Some(every) = self.write_every {
            args.push("--write-every-ms".to_owned());
            args.push(every.as_millis().max(1).to_string());
        }
        if let Some(at_least) = self.at_least {
            args.push("--at-least-ms".to_owned());
            args.push(at_least.as_millis().max(1).to_string());
        }
        args
    }
}

#[derive(Default)]
struct Log {
    events: Vec<(Instant, HolderEvent)>,
    closed: bool,
}

/// A running holder process. Killed (SIGKILL) when dropped.
pub struct HolderProcess {
    child: Child,
    pid: u32,
    stdin: Option<ChildStdin>,
    log: Arc<watch::Sender<Log>>,
    reader: JoinHandle<()>,
}

impl HolderProcess {
    /// Where the holder binary is: `$DISTLOCK_DRILL_HOLDER`, else next to the running test
    /// executable (`target/<profile>/distlock-drill-holder`).
    pub fn binary() -> PathBuf {
        if let Some(path) = std::env::var_os("DISTLOCK_DRILL_HOLDER").filter(|p| !p.is_empty()) {
            return PathBuf::from(path);
        }
        let exe = std::env::current_exe().unwrap_or_default();
        let dir = exe.parent().unwrap_or(Path::new("."));
        let dir = if dir.ends_with("deps") {
            dir.parent().unwrap_or(dir)
        } else {
            dir
        };
        dir.join(HOLDER_BINARY)
    }

    /// Spawns a holder of `key` at `url` with `ttl` (watchdog on) from [`HolderProcess::binary`].
    ///
    /// # Errors
    /// When the binary cannot be started (build it: `cargo build -p distlock-conformance --bins`).
    pub async fn spawn(url: &str, key: &LockKey, ttl: Duration) -> io::Result<Self> {
        Self::spawn_with(&Self::binary(), &HolderOptions::new(url, key.clone(), ttl)).await
    }

    /// Spawns `binary` with `options`.
    ///
    /// # Errors
    /// When the process cannot be started.
    pub async fn spawn_with(binary: &Path, options: &HolderOptions) -> io::Result<Self> {
        let mut child = Command::new(binary)
            .args(options.args())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!(
                        "cannot start {} ({e}); build it with `cargo build -p distlock-conformance --bins` or set DISTLOCK_DRILL_HOLDER",
                        binary.display()
                    ),
                )
            })?;
        let pid = child
            .id()
            .ok_or_else(|| io::Error::other("the holder exited at once"))?;
        let stdin = child.stdin.take();
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| io::Error::other("the holder's stdout is not piped"))?;
        let log = Arc::new(watch::Sender::new(Log::default()));
        let reader = tokio::spawn({
            let log = log.clone();
            async move {
                let mut lines = BufReader::new(stdout).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    let event =
                        serde_json::from_str(&line).unwrap_or_else(|e| HolderEvent::Error {
                            message: format!("unreadable line from the holder ({e}): {line}"),
                        });
                    log.send_modify(|log| log.events.push((Instant::now(), event)));
                }
                log.send_modify(|log| log.closed = true);
            }
        });
        Ok(Self {
            child,
            pid,
            stdin,
            log,
            reader,
        })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Every event so far.
    pub fn events(&self) -> Vec<HolderEvent> {
        self.log
            .borrow()
            .events
            .iter()
            .map(|(_, e)| e.clone())
            .collect()
    }

    /// Every event so far with the parent's receive time.
    pub fn timed_events(&self) -> Vec<(Instant, HolderEvent)> {
        self.log.borrow().events.clone()
    }

    /// Waits up to `timeout` for the first event (from the start) matching `want`, returning it
    /// with its receive time. `None` on timeout or when the holder's stdout closed without one.
    pub async fn wait_for(
        &self,
        timeout: Duration,
        mut want: impl FnMut(&HolderEvent) -> bool,
    ) -> Option<(Instant, HolderEvent)> {
        let mut rx = self.log.subscribe();
        tokio::time::timeout(
            timeout,
            rx.wait_for(|log| log.closed || log.events.iter().any(|(_, e)| want(e))),
        )
        .await
        .ok()?
        .ok()?
        .events
        .iter()
        .find(|(_, e)| want(e))
        .cloned()
    }

    /// A cursor over this holder's events, in order, that can be moved to another task (a
    /// drill's pump that turns events into history records while the drill signals the
    /// process).
    pub fn feed(&self) -> EventFeed {
        EventFeed {
            log: self.log.clone(),
            next: 0,
        }
    }

    /// Waits up to `timeout` for the grant; returns `(fencing, token digest, receive time)`.
    pub async fn wait_acquired(&self, timeout: Duration) -> Option<(Option<u64>, String, Instant)> {
        match self
            .wait_for(timeout, |e| matches!(e, HolderEvent::Acquired { .. }))
            .await?
        {
            (at, HolderEvent::Acquired { fencing, token, .. }) => Some((fencing, token, at)),
            _ => None,
        }
    }

    fn signal(&self, signal: Signal) -> io::Result<()> {
        let pid = i32::try_from(self.pid).map_err(io::Error::other)?;
        kill(Pid::from_raw(pid), signal).map_err(io::Error::from)
    }

    /// SIGKILL: the holder dies without releasing.
    ///
    /// # Errors
    /// When the signal cannot be sent (the process is gone).
    pub fn kill(&self) -> io::Result<()> {
        self.signal(Signal::SIGKILL)
    }

    /// SIGSTOP: the holder (watchdog included) freezes, as in a long GC pause or a VM stall.
    /// Returns once the kernel reports the process stopped (on Linux; elsewhere once sent).
    ///
    /// # Errors
    /// When the signal cannot be sent, or the process is not seen stopped within 5 s.
    pub async fn stop(&self) -> io::Result<()> {
        self.signal(Signal::SIGSTOP)?;
        self.settle(true).await
    }

    /// SIGCONT: the holder resumes where it was. Returns once it is no longer stopped.
    ///
    /// # Errors
    /// When the signal cannot be sent, or the process is still stopped after 5 s.
    pub async fn cont(&self) -> io::Result<()> {
        self.signal(Signal::SIGCONT)?;
        self.settle(false).await
    }

    /// Waits until [`HolderProcess::is_stopped`] is `stopped`. Signal delivery is asynchronous
    /// and the kernel offers no event for it short of `waitpid` (which belongs to tokio's child
    /// reaper), so this polls `/proc` every millisecond, for at most 5 s.
    async fn settle(&self, stopped: bool) -> io::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match self.is_stopped() {
                Ok(now) if now == stopped => return Ok(()),
                Ok(_) => {}
                // No /proc (not Linux): trust the signal.
                Err(e)
                    if e.kind() == io::ErrorKind::NotFound && !Path::new("/proc/self").exists() =>
                {
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
            if Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "the holder did not become {}",
                        if stopped { "stopped" } else { "running" }
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// `true` while the process is stopped (state `T` in `/proc/<pid>/stat`; Linux only).
    ///
    /// # Errors
    /// When `/proc/<pid>/stat` cannot be read (the process is gone, or not Linux).
    pub fn is_stopped(&self) -> io::Result<bool> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid))?;
        // "pid (comm) S …": the state follows the last ')'.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .unwrap_or("");
        Ok(state == "T" || state == "t")
    }

    /// Closes the holder's stdin: it releases the lock, reports [`HolderEvent::Released`] and
    /// exits 0.
    pub fn release(&mut self) {
        self.stdin = None;
    }

    /// Waits up to `timeout` for the process to exit.
    ///
    /// # Errors
    /// On timeout ([`io::ErrorKind::TimedOut`]) or when waiting fails.
    pub async fn wait_exit(&mut self, timeout: Duration) -> io::Result<ExitStatus> {
        match tokio::time::timeout(timeout, self.child.wait()).await {
            Ok(status) => status,
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the holder did not exit in time",
            )),
        }
    }
}

impl Drop for HolderProcess {
    fn drop(&mut self) {
        // kill_on_drop sends SIGKILL to the child; stop reading its output.
        self.reader.abort();
    }
}

/// The events of a [`HolderProcess`], one by one (see [`HolderProcess::feed`]).
pub struct EventFeed {
    log: Arc<watch::Sender<Log>>,
    next: usize,
}

impl EventFeed {
    /// The next event with its receive time, waiting up to `timeout`. `None` on timeout, or once
    /// the holder's stdout closed and every event was returned.
    pub async fn next(&mut self, timeout: Duration) -> Option<(Instant, HolderEvent)> {
        let mut rx = self.log.subscribe();
        let next = self.next;
        let event = tokio::time::timeout(
            timeout,
            rx.wait_for(|log| log.closed || log.events.len() > next),
        )
        .await
        .ok()?
        .ok()?
        .events
        .get(next)
        .cloned()?;
        self.next += 1;
        Some(event)
    }
}

impl std::fmt::Debug for EventFeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventFeed")
            .field("next", &self.next)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for HolderProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HolderProcess")
            .field("pid", &self.pid)
            .field("events", &self.log.borrow().events.len())
            .finish_non_exhaustive()
    }
}

/// Now on `CLOCK_MONOTONIC`, in nanoseconds (`None` if the clock cannot be read).
pub fn monotonic_now_ns() -> Option<u64> {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).ok()?;
    let secs = u64::try_from(now.tv_sec()).ok()?;
    let nanos = u64::try_from(now.tv_nsec()).ok()?;
    secs.checked_mul(1_000_000_000)?.checked_add(nanos)
}

/// `instant` (this process's clock) on `CLOCK_MONOTONIC`, so that another process on the same
/// machine can place it on its own clock with [`monotonic_to_instant`].
pub fn instant_to_monotonic(instant: tokio::time::Instant) -> Option<u64> {
    let (now, now_ns) = (tokio::time::Instant::now(), monotonic_now_ns()?);
    if instant >= now {
        now_ns.checked_add(u64::try_from((instant - now).as_nanos()).ok()?)
    } else {
        now_ns.checked_sub(u64::try_from((now - instant).as_nanos()).ok()?)
    }
}

/// A `CLOCK_MONOTONIC` time from another process of this machine, on this process's clock.
pub fn monotonic_to_instant(ns: u64) -> Option<tokio::time::Instant> {
    let (now, now_ns) = (tokio::time::Instant::now(), monotonic_now_ns()?);
    if ns >= now_ns {
        now.checked_add(std::time::Duration::from_nanos(ns - now_ns))
    } else {
        now.checked_sub(std::time::Duration::from_nanos(now_ns - ns))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::Instant;

    use super::{instant_to_monotonic, monotonic_to_instant};

    #[test]
    fn deadlines_survive_the_trip_through_the_monotonic_clock() {
        let now = Instant::now();
        for instant in [
            now + Duration::from_millis(1500),
            now - Duration::from_millis(20),
        ] {
            let ns = instant_to_monotonic(instant).expect("the monotonic clock reads");
            let back = monotonic_to_instant(ns).expect("placed on this clock");
            let error = if back > instant {
                back - instant
            } else {
                instant - back
            };
            // Two clock reads per direction: microseconds apart, far below any lease margin.
            assert!(error < Duration::from_millis(5), "{error:?}");
        }
    }
}
