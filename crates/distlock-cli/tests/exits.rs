//! Exit statuses that mean one thing, against real coordinators (`DISTLOCK_TEST_*_URL`), some
//! through a TCP proxy that can be switched to swallow all traffic (a blackholed coordinator).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    path::Path,
    process::{Child, Command, Output, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use distlock::Backend;
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};
use support::{Tally, backends, fresh_key, on_every_backend};

fn distlock(url: &str) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_distlock"));
    command.env("DISTLOCK_URL", url).stdin(Stdio::null());
    command
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The `127.0.0.1:PORT` of a test URL.
fn address(url: &str) -> String {
    let start = url.find("127.0.0.1:").expect("test URLs are on 127.0.0.1");
    let rest = &url[start..];
    let end = rest.find(['/', '?', ',']).unwrap_or(rest.len());
    rest[..end].to_owned()
}

/// A TCP proxy to `upstream`; once `blackhole` is set it reads and drops everything.
struct Proxy {
    port: u16,
    blackhole: Arc<AtomicBool>,
}

impl Proxy {
    fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let blackhole = Arc::new(AtomicBool::new(false));
        let flag = blackhole.clone();
        thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = TcpStream::connect(&upstream) else {
                    continue;
                };
                for (from, to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    let flag = flag.clone();
                    thread::spawn(move || pump(from, to, &flag));
                }
            }
        });
        Self { port, blackhole }
    }

    /// `url` with its address replaced by the proxy's.
    fn url(&self, url: &str) -> String {
        url.replace(&address(url), &format!("127.0.0.1:{}", self.port))
    }

    fn cut(&self) {
        self.blackhole.store(true, Ordering::SeqCst);
    }
}

fn pump(mut from: TcpStream, mut to: TcpStream, blackhole: &AtomicBool) {
    let mut buffer = [0u8; 16 * 1024];
    loop {
        match from.read(&mut buffer) {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if !blackhole.load(Ordering::SeqCst) && to.write_all(&buffer[..n]).is_err() {
                    return;
                }
            }
        }
    }
}

fn wait_with_timeout(mut child: Child, within: Duration) -> Output {
    let deadline = Instant::now() + within;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("distlock did not exit within {within:?}");
        }
        thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().unwrap()
}

/// Holds `key` (directly, not through a proxy) with a command that sleeps, once it started.
fn hold(url: &str, key: &str, dir: &Path) -> Child {
    let started = dir.join(format!("started-{:08x}", rand::random::<u32>()));
    let mut holder = distlock(url)
        .args(["run", key, "--ttl", "10s", "--", "sh", "-c"])
        .arg(format!("touch {}; sleep 30", started.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !started.exists() {
        assert!(holder.try_wait().unwrap().is_none(), "the holder exited");
        assert!(Instant::now() < deadline, "the holder never started");
        thread::sleep(Duration::from_millis(10));
    }
    holder
}

fn stop(mut holder: Child) {
    let _ = kill(
        Pid::from_raw(i32::try_from(holder.id()).unwrap()),
        Signal::SIGTERM,
    );
    let _ = holder.wait();
}

fn wait_until_queued(url: &str, key: &str) {
    wait_until_waiters(url, key, 1);
}

/// Waits until at least `n` waiters are queued on `key`.
fn wait_until_waiters(url: &str, key: &str, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = distlock(url)
            .args(["inspect", key, "--json"])
            .output()
            .unwrap();
        let value: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        if value["waiters"].as_u64().unwrap_or(0) >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "fewer than {n} waiters ever queued: {value}"
        );
        thread::sleep(Duration::from_millis(20));
    }
}

/// What `--wait 2s` may take at most against a coordinator that stops answering: the wait,
/// its 1 s slack, the holder look-up (0.5 s) and the clean-up budget (1 s), plus scheduling.
const WAIT_LIMIT: Duration = Duration::from_millis(2000 + 3000);

/// `run --wait` against a coordinator that does not answer (from the start, or from the moment
/// the waiter is queued) exits 69 within the wait plus the stated slack, and does not say the
/// lock is held by someone else.
#[test]
fn wait_is_a_time_limit_when_the_coordinator_is_blackholed() {
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    on_every_backend(
        "wait_is_a_time_limit_when_the_coordinator_is_blackholed",
        move |backend, url| {
            // Connecting to a listener that never answers.
            let unanswered = url.replace(&address(&url), &format!("127.0.0.1:{port}"));
            let started = Instant::now();
            let out = distlock(&unanswered)
                .args(["run", &fresh_key("silent"), "--wait", "2s", "--", "true"])
                .output()
                .unwrap();
            let took = started.elapsed();
            assert_eq!(out.status.code(), Some(69), "{backend}: {}", stderr(&out));
            assert!(took < WAIT_LIMIT, "{backend}: took {took:?}");

            // Cut off while queued behind a holder.
            let key = fresh_key("blackholed");
            let dir = std::env::temp_dir();
            let holder = hold(&url, &key, &dir);
            let proxy = Proxy::start(address(&url));
            let waiter = distlock(&proxy.url(&url))
                .args(["run", &key, "--wait", "2s", "--", "true"])
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            let started = Instant::now();
            wait_until_queued(&url, &key);
            proxy.cut();
            let out = wait_with_timeout(waiter, Duration::from_secs(30));
            let took = started.elapsed();
            stop(holder);
            let err = stderr(&out);
            assert_eq!(out.status.code(), Some(69), "{backend}: {err}");
            assert!(!err.contains("held by another owner"), "{backend}: {err}");
            assert!(took < WAIT_LIMIT, "{backend}: took {took:?}: {err}");
            eprintln!("{backend}: blackholed --wait 2s exited 69 after {took:?}");
        },
    );
    drop(silent);
}

/// A second Ctrl-C ends the clean-up wait at exit at once (here a waiter's leaving the queue,
/// which hangs: the coordinator was cut off after the waiter queued). Two waiters queued and cut
/// off alike both get a first SIGINT, which leaves each in its clean-up wait (both still run
/// 300 ms later); only one gets a second SIGINT: it exits within a second of it, while the
/// other — the control, without a second SIGINT — is still waiting its clean-up out then.
#[test]
fn a_second_interrupt_ends_the_clean_up_wait() {
    let Some(url) = conformance::backend_url("DISTLOCK_TEST_REDIS_URL") else {
        return;
    };
    let key = fresh_key("second-interrupt");
    let holder = hold(&url, &key, &std::env::temp_dir());
    let proxy = Proxy::start(address(&url));
    let spawn_waiter = || {
        distlock(&proxy.url(&url))
            .args(["run", &key, "--wait", "60s", "--", "true"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (mut twice, mut once) = (spawn_waiter(), spawn_waiter());
    wait_until_waiters(&url, &key, 2);
    proxy.cut();
    let pid = |child: &Child| Pid::from_raw(i32::try_from(child.id()).unwrap());
    let first = Instant::now();
    kill(pid(&twice), Signal::SIGINT).unwrap();
    kill(pid(&once), Signal::SIGINT).unwrap();
    thread::sleep(Duration::from_millis(300));
    // The first SIGINT alone has not ended either: each is in its clean-up wait.
    for (name, child) in [("twice", &mut twice), ("once", &mut once)] {
        assert_eq!(
            child.try_wait().unwrap(),
            None,
            "the waiter interrupted {name} exited 300 ms after its first SIGINT: no clean-up wait to end"
        );
    }
    let second = Instant::now();
    kill(pid(&twice), Signal::SIGINT).unwrap();
    let out = wait_with_timeout(twice, Duration::from_secs(30));
    let took = second.elapsed();
    // The control is still in the clean-up wait the second SIGINT ended.
    let control_waiting = once.try_wait().unwrap().is_none();
    let control = wait_with_timeout(once, Duration::from_secs(30));
    let control_took = first.elapsed();
    stop(holder);
    eprintln!(
        "second SIGINT: exited {took:?} after it; the control exited {control_took:?} after its only SIGINT"
    );
    assert_eq!(out.status.code(), Some(130), "{}", stderr(&out));
    assert!(
        took < Duration::from_secs(1),
        "exited {took:?} after the second SIGINT"
    );
    assert!(
        control_waiting,
        "the waiter interrupted once had exited by then too ({control_took:?} after its SIGINT): \
         the second SIGINT ended nothing that would not have ended anyway"
    );
    assert_eq!(control.status.code(), Some(130), "{}", stderr(&control));
}

/// The coordinator refusing our credentials or database is a configuration error (78), not an
/// outage (69).
#[test]
fn refused_credentials_are_a_configuration_error() {
    let mut urls = Vec::new();
    if Backend::Redis.is_enabled()
        && let Some(url) = conformance::backend_url("DISTLOCK_TEST_REDIS_SECURE_URL")
        && let Some(at) = url.find('@')
        && let Some(colon) = url[..at].rfind(':')
    {
        urls.push(format!("{}:wrong-password{}", &url[..colon], &url[at..]));
    }
    if Backend::Postgres.is_enabled()
        && let Some(url) = conformance::backend_url("DISTLOCK_TEST_PG_URL")
    {
        let address = address(&url);
        urls.push(format!("postgres://no_such_role@{address}/distlock"));
        urls.push(format!("postgres://postgres@{address}/no_such_database"));
    }
    for url in urls {
        let out = distlock(&url).args(["inspect", "k"]).output().unwrap();
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(78), "{err}");
        assert!(err.starts_with("distlock: refused by "), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(!err.contains("wrong-password"), "{err}");
        assert!(!err.contains(" at line "), "{err}");
    }
}

/// The lease is taken away and the command finishes before distlock notices: it was not
/// terminated, so the exit status is 79, not 76 ("the command was terminated").
#[test]
fn a_loss_noticed_after_the_command_finished_is_not_reported_as_terminated() {
    let Some(url) = conformance::backend_url("DISTLOCK_TEST_REDIS_URL") else {
        return;
    };
    let key = fresh_key("late-loss");
    // The command deletes its own lock's key behind the driver's back — a removal the server
    // does not push, as an eviction (a `release --force` is pushed and ends the command at
    // once) — then exits at once; distlock renews only every ~2.5 s at this TTL.
    let authority = url
        .trim_start_matches("redis://")
        .split(['/', '?'])
        .next()
        .unwrap();
    let (host, port) = authority.rsplit_once(':').unwrap();
    let out = distlock(&url)
        .args(["run", &key, "--ttl", "10s", "--", "sh", "-c"])
        .arg(format!(
            "redis-cli -h {host} -p {port} DEL 'distlock:{key}' >/dev/null"
        ))
        .output()
        .unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(79), "{err}");
    assert!(err.contains("not terminated"), "{err}");
}

/// `run -q` and `run --json` on a held lock; `release --force --yes` prints no warning (it asks
/// nothing), and exits non-zero when it released nothing.
#[test]
fn release_force_exits_non_zero_when_nothing_was_released() {
    let backends = backends();
    let tally = Tally::new(
        "release_force_exits_non_zero_when_nothing_was_released",
        &backends,
    );
    for (backend, url) in backends {
        let key = fresh_key("release");
        let holder = hold(&url, &key, &std::env::temp_dir());
        // -q: not acquired says nothing (cron mails nothing); --json says it as an event.
        let out = distlock(&url)
            .args(["run", "-q", &key, "--", "true"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(75), "{backend}");
        assert_eq!(stderr(&out), "", "{backend}");
        let out = distlock(&url)
            .args(["run", "--json", &key, "--", "true"])
            .output()
            .unwrap();
        let err = stderr(&out);
        let last: serde_json::Value = serde_json::from_str(err.lines().last().unwrap()).unwrap();
        assert_eq!(last["event"], "exit", "{backend}: {err}");
        assert_eq!(last["status"], 75, "{backend}: {err}");
        assert!(
            err.contains("\"event\":\"not_acquired\""),
            "{backend}: {err}"
        );

        let out = distlock(&url)
            .args(["release", "--force", "--yes", &key])
            .output()
            .unwrap();
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(0), "{backend}: {err}");
        assert!(!err.contains("Force-releasing"), "{backend}: {err}");
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("released"),
            "{backend}"
        );
        let out = distlock(&url)
            .args(["release", "--force", "--yes", &key])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{backend}: {}", stderr(&out));
        assert!(stderr(&out).contains("nothing released"), "{backend}");
        stop(holder);
        tally.ran(backend);
    }
    tally.assert_each_ran_once();
}
